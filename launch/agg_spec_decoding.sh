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

set -m  # the server gets its own process group: we can stop all of it
"$python" -m dynamo_spec serve --config "$config" --skip-preflight "$@" &
server=$!
# Live (not zombie) members of the server's process group.
group_alive() { ps -eo pgid=,stat=,comm= | awk -v g="$server" '$1 == g && $2 !~ /^Z/ {print $3}'; }

stop() {
  trap - INT TERM EXIT
  if kill -0 "$server" 2>/dev/null; then
    echo ">>> Stopping the server" >&2
    kill -TERM "$server" 2>/dev/null || true  # it drains, shuts its engine down, then exits
    for _ in $(seq 1 $((grace + 30))); do kill -0 "$server" 2>/dev/null || break; sleep 1; done
  fi
  for _ in $(seq 1 10); do [ -z "$(group_alive)" ] && break; sleep 0.5; done  # helpers exiting
  if [ -n "$(group_alive)" ]; then
    echo ">>> Killing what is left of the server's process group: $(group_alive | tr '\n' ' ')" >&2
    kill -KILL -- "-$server" 2>/dev/null || true
  fi
  wait "$server" 2>/dev/null || true
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
  sleep 1 & wait $!
done

cat >&2 <<MSG

>>> Ready: $url  (OpenAI API under /v1, health on /health, Prometheus metrics on /metrics)
>>> Try:
curl $url/v1/chat/completions -H 'Content-Type: application/json' -d '{"model": "$name", "messages": [{"role": "user", "content": "Write a poem about why Sakura trees are beautiful."}], "max_tokens": 250}'

MSG
wait "$server" && status=0 || status=$?
exit "$status"
