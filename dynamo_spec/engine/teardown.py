"""Stopping the engine so that nothing of it outlives the server: no process, no shared memory.

vLLM's ``AsyncLLM.shutdown(timeout)`` SIGTERMs EngineCore and force-kills its process tree
when it has not exited within ``timeout`` (5 s when none is given); EngineCore in turn gives
its workers ``VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS`` (5 s by default) before it SIGTERMs
them. A compiled worker's exit can take several seconds on a busy CPU host, so with
vLLM's defaults EngineCore is killed while it waits for its worker. A killed process
leaves what only its own exit removes: the shared-memory segments it created (vLLM's
broadcast queue; multiprocessing's resource tracker then unlinks them, warning of a leak)
and Intel OpenMP's registration file ``/dev/shm/__KMP_REGISTERED_LIB_<pid>_<uid>``.

So the engine gets ``server.engine_stop_seconds``: the worker wait fits inside it, the
engine's processes are waited for until they are gone (killed only past that time), and
what a killed process left in /dev/shm is removed.
"""

from __future__ import annotations

import contextlib
import glob
import logging
import os
from collections.abc import MutableMapping

logger = logging.getLogger("dynamo_spec.engine.teardown")

WORKER_TIMEOUT_ENV = "VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS"
# What EngineCore needs after its workers are gone (its own teardown), out of the stop time.
ENGINE_CORE_SECONDS = 5


def set_worker_timeout(environ: MutableMapping[str, str], stop_seconds: float) -> None:
    """Give the workers all of `stop_seconds` but EngineCore's own part (unless already set)."""
    environ.setdefault(WORKER_TIMEOUT_ENV, str(max(1, int(stop_seconds) - ENGINE_CORE_SECONDS)))


def engine_processes() -> list:
    """This process's descendants that belong to the engine (all but the resource tracker)."""
    import psutil

    tracker = _resource_tracker_pid()
    return [p for p in psutil.Process().children(recursive=True) if p.pid != tracker]


def _resource_tracker_pid() -> int | None:
    from multiprocessing import resource_tracker

    return getattr(resource_tracker._resource_tracker, "_pid", None)


def wait_gone(processes: list, timeout: float) -> list[str]:
    """Wait until `processes` have exited; kill those still there after `timeout`.

    Returns a line per killed process (empty when all exited on their own)."""
    import psutil

    _, alive = psutil.wait_procs(processes, timeout=timeout)
    killed = []
    for proc in alive:
        with contextlib.suppress(psutil.Error):
            killed.append(f"{proc.pid} {proc.name()}")
            proc.kill()
    psutil.wait_procs(alive, timeout=5)
    return killed


def remove_openmp_registrations(pids: list[int], shm: str = "/dev/shm") -> list[str]:
    """Remove Intel OpenMP's registration files of `pids` (processes that have exited):
    the library removes its own at a normal exit, so those left are from killed ones."""
    removed = []
    for pid in pids:
        if _exists(pid):
            continue
        for path in glob.glob(os.path.join(shm, f"__KMP_REGISTERED_LIB_{pid}_*")):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
                removed.append(os.path.basename(path))
    return removed


def _exists(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def shutdown_engine(engine, stop_seconds: float) -> None:
    """Shut `engine` down; return once every process it started is gone."""
    processes = engine_processes()
    engine.shutdown(timeout=stop_seconds)
    killed = wait_gone(processes, timeout=stop_seconds)
    if killed:
        logger.warning("Engine processes still running %g s after the stop (server.engine_stop_seconds), "
                       "killed: %s", stop_seconds, ", ".join(killed))
    if removed := remove_openmp_registrations([p.pid for p in processes]):
        logger.info("Removed what killed engine processes left in /dev/shm: %s", ", ".join(removed))
