#!/usr/bin/env bash
# The test command: installs what the suite needs from nothing, then runs it.
#
#   bash tests/run.sh [pytest args]      e.g. bash tests/run.sh -m unit
#
# Runs ruff (the lint rules in pyproject.toml), then pytest.
# Installs (once): the project's .venv with the CPU/GPU vLLM build and test extras,
# and, as root, the Debian packages `prometheus` and `docker-compose` (real
# Prometheus and promtool for the metrics tests; compose-file validation), `kubernetes-client`
# when kubectl is missing (renders deploy/k8s) and
# `libtcmalloc-minimal4` (preloaded into vLLM's CPU engine processes).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../launch/env.sh"
cd "$DYNAMO_SPEC_ROOT"

missing=()
command -v promtool >/dev/null 2>&1 || missing+=(prometheus)
command -v docker-compose >/dev/null 2>&1 || missing+=(docker-compose)
# kubectl (its built-in kustomize renders deploy/k8s); machines of this kind ship v1.32.
command -v kubectl >/dev/null 2>&1 || missing+=(kubernetes-client)
# tcmalloc, preloaded into vLLM's engine processes on CPU (engine.cpu_preload) as the servers do in production.
ls /usr/lib/*/libtcmalloc_minimal.so.4 >/dev/null 2>&1 || missing+=(libtcmalloc-minimal4)
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ]; then
    echo ">>> apt-get install ${missing[*]}" >&2
    apt-get update -qq >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2
  else
    echo ">>> warning: ${missing[*]} not installed and not root: those tests will fail or skip" >&2
  fi
fi

ensure_venv
export HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 TOKENIZERS_PARALLELISM=false
# Lint first (seconds): the rules are in pyproject.toml [tool.ruff].
"$DYNAMO_SPEC_VENV/bin/ruff" check --quiet "$DYNAMO_SPEC_ROOT"
pytest=("$DYNAMO_SPEC_VENV/bin/python" -m pytest)
if [ $# -gt 0 ]; then exec "${pytest[@]}" "$@"; fi
# The whole suite (CI, the README's command): two workers, whole modules each, each worker on its own
# share of the cores (tests/conftest.py; most of an engine start is single-threaded: vLLM's imports
# in three processes), then the tests marked `serial` (a compiled engine's
# shutdown, timed against a slow exit) alone on every core.
status=0
"${pytest[@]}" -n 2 --dist loadfile --no-loadscope-reorder -m "not serial" || status=$?
"${pytest[@]}" -m serial -p no:xdist || status=$((status ? status : $?))
exit "$status"
