#!/usr/bin/env bash
# Serve a model with EAGLE-3 speculative decoding behind an OpenAI-compatible API.
#
#   bash launch/agg_spec_decoding.sh [--config FILE] [--section.field VALUE ...]
#
# First run: creates .venv (CPU or GPU build of vLLM), prepares the CPU default
# model, then starts the server, waits until it answers and prints a curl line.
# Ctrl-C or SIGTERM stops everything it started. Default config: the GPU guide's
# Llama-3.1-8B + EAGLE-3 on a CUDA machine, SmolLM2-135M + our draft on a CPU.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$DYNAMO_SPEC_ROOT"

config=""
if [ "${1:-}" = "--config" ] || [ "${1:-}" = "-c" ]; then
  config=$2
  shift 2
fi
device=$(detect_device)
if [ -z "$config" ]; then
  if [ "$device" = gpu ]; then
    config=configs/llama-3.1-8b-instruct-eagle3.yaml
  else
    config=configs/smollm2-135m-instruct-eagle3-cpu.yaml
  fi
fi

ensure_venv
python="$DYNAMO_SPEC_VENV/bin/python"
vllm_runtime_env
if [ "$config" = configs/smollm2-135m-instruct-eagle3-cpu.yaml ]; then
  export HF_HUB_OFFLINE=1
  "$python" -m dynamo_spec prepare-default >/dev/null
fi

# Preflight before the slow load: a wrong pairing fails here, in seconds.
"$python" -m dynamo_spec check --config "$config" "$@"

read -r host port grace name < <("$python" -m dynamo_spec config --config "$config" "$@" --json |
  "$python" -c 'import json,sys; v={r["field"]: r["value"] for r in json.load(sys.stdin)}; print(v["server.host"], v["server.port"], int(v["server.shutdown_grace_seconds"]), v["server.served_model_name"] or v["engine.model"])')
[ "$host" = 0.0.0.0 ] && host=localhost

set -m  # the server gets its own process group (Ctrl-C in a terminal reaches only this script)
"$python" -m dynamo_spec serve --config "$config" --skip-preflight "$@" &
server=$!

# What the server started, tracked until it is gone: its descendants and its process group,
# also those that leave the group or the session, or whose parent exits (they stay tracked
# once seen). A process is known as pid@start-time: a pid is reused once its process is gone.
server_key="$server@$(LC_ALL=C ps -o lstart= -p "$server" | tr -d ' ' || true)"
tracked=""
track() {
  local now
  if now=$(LC_ALL=C ps -eo pid=,ppid=,pgid=,lstart= | awk -v server="$server_key" -v tracked="$tracked" '
    { key[NR] = $1 "@" $4 $5 $6 $7 $8; pid[NR] = $1; ppid[NR] = $2; pgid[NR] = $3 }
    END {
      known[server] = 1; n = split(tracked, t); for (i = 1; i <= n; i++) known[t[i]] = 1
      for (i = 1; i <= NR; i++) if (key[i] in known) live[pid[i]] = 1
      split(server, s, "@"); group = (s[1] in live) ? s[1] : ""  # while the server exists
      do {
        more = 0
        for (i = 1; i <= NR; i++)
          if (!(key[i] in known) && (ppid[i] in live || pgid[i] == group)) {
            known[key[i]] = 1; live[pid[i]] = 1; more = 1
          }
      } while (more)
      for (i = 1; i <= NR; i++) if (key[i] in known) printf "%s ", key[i]
    }'); then tracked=$now; fi
}
# The tracked processes still there, as "pid name" lines; `left running`: those not ended yet
# (a zombie has ended; only its parent, init for an orphan, can remove it).
left() {
  LC_ALL=C ps -eo pid=,stat=,lstart=,comm= | awk -v tracked="$tracked" -v running="${1:-}" '
    BEGIN { n = split(tracked, t); for (i = 1; i <= n; i++) known[t[i]] = 1 }
    ($1 "@" $3 $4 $5 $6 $7) in known && !(running && $2 ~ /^Z/) { print $1, $8 }'
}
# Sleep, but let a signal cut it short (its trap then runs at once).
nap() { sleep "$1" & napping=$!; wait "$napping"; napping=""; }
napping=""

# Returns only when all the server started is gone.
stop() {
  trap - INT TERM EXIT
  if [ -n "$napping" ]; then kill "$napping" 2>/dev/null; wait "$napping" 2>/dev/null || true; fi
  track
  if kill -0 "$server" 2>/dev/null; then
    echo ">>> Stopping the server" >&2
    kill -TERM "$server" 2>/dev/null || true  # it drains, shuts its engine down, then exits
    for _ in $(seq 1 $((grace + 30))); do kill -0 "$server" 2>/dev/null || break; sleep 1; track; done
  fi
  for _ in $(seq 1 10); do track; [ -z "$(left running)" ] && break; sleep 0.5; done  # helpers exiting
  if [ -n "$(left running)" ]; then
    echo ">>> Killing what is left of the server: $(left running | tr '\n' ' ')" >&2
    for _ in $(seq 1 20); do  # until none runs (also one started meanwhile)
      kill -KILL $(left running | cut -d' ' -f1) 2>/dev/null || true
      sleep 0.5; track; [ -z "$(left running)" ] && break
    done
    [ -z "$(left running)" ] || echo ">>> Still running after SIGKILL: $(left running | tr '\n' ' ')" >&2
  fi
  wait "$server" 2>/dev/null || true
  for _ in $(seq 1 10); do [ -z "$(left)" ] && break; sleep 0.5; done  # orphans' zombies: init removes them
}
trap 'stop; exit 130' INT
trap 'stop; exit 143' TERM
trap stop EXIT

url="http://$host:$port"
until curl -sf "$url/health" >/dev/null 2>&1; do
  if ! kill -0 "$server" 2>/dev/null; then
    wait "$server" && status=0 || status=$?
    echo ">>> The server exited with status $status before it was ready" >&2
    exit "$status"
  fi
  track
  nap 1
done

cat >&2 <<MSG

>>> Ready: $url  (OpenAI API under /v1, health on /health, Prometheus metrics on /metrics)
>>> Try:
curl $url/v1/chat/completions -H 'Content-Type: application/json' -d '{"model": "$name", "messages": [{"role": "user", "content": "Write a poem about why Sakura trees are beautiful."}], "max_tokens": 250}'

MSG
while kill -0 "$server" 2>/dev/null; do track; nap 2; done  # notes what it starts meanwhile
wait "$server" && status=0 || status=$?
exit "$status"
