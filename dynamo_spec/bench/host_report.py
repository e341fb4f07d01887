"""What a report says about the host: CPU, ISA, dtype, versions, and the engine's LD_PRELOAD."""

from __future__ import annotations

import os
import platform
import sys
from typing import Any

from dynamo_spec import __version__


def host_info(dtype: str, preload: bool = False) -> dict[str, Any]:
    from dynamo_spec.engine.host import detect_host

    try:
        import vllm

        vllm_version = vllm.__version__
    except Exception:  # noqa: BLE001 - only a label
        vllm_version = "unknown"
    host = detect_host()
    isa = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in host.cpu_flags]
    return {"cpu_model": host.cpu_model, "cores": len(os.sched_getaffinity(0)), "isa": " ".join(isa) or "none",
            "dtype": dtype, "platform": host.platform,
            "vllm": vllm_version, "dynamo_spec": __version__, "python": platform.python_version(),
            "ld_preload": engine_ld_preload(preload and host.on_cpu)}


def engine_ld_preload(preload: bool) -> str:
    """LD_PRELOAD the servers' engine processes get: the environment's, plus engine.cpu_preload's
    (libraries inside the Python environment written as ``<venv>/...``: reports carry no local paths)."""
    from dynamo_spec.engine.process_env import apply_cpu_preload, cpu_preload_libraries

    env = {"LD_PRELOAD": os.environ.get("LD_PRELOAD", "")}
    if preload:
        apply_cpu_preload(env, cpu_preload_libraries())
    value = env["LD_PRELOAD"]
    for prefix in {os.path.realpath(sys.prefix), sys.prefix}:
        value = value.replace(prefix + os.sep, "<venv>" + os.sep)
    return value


def command_line() -> str:
    """The command this run was started with, the program by name only: no path of this machine."""
    import shlex

    program = "dynamo-spec" if sys.argv[0].endswith("__main__.py") else os.path.basename(sys.argv[0])
    return shlex.join([program, *sys.argv[1:]])


def relative(path: str | None) -> str | None:
    """A local path relative to the working directory (reports travel between machines)."""
    if path and os.path.isabs(path) and os.path.exists(path):
        rel = os.path.relpath(path)
        return rel if not rel.startswith("../../") else path
    return path
