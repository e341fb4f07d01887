"""A quick exit for every process of the engine: the heap frozen before Python's final collections.

At exit CPython runs its atexit handlers, then tears the modules down with full garbage
collections, each of which walks every object still alive: after importing vLLM and torch that
is millions of them, about 1.6 s per process on an idle 2-core EPYC and 2.6 s with both cores
busy (``python -c "import torch, vllm"``, measured). A server's stop pays it three times in a row
(worker, then EngineCore, then the API process), and the tests stop a hundred engines.

``install`` registers, once per process and as early as possible (atexit runs handlers last in,
first out, so this one runs after vLLM's and multiprocessing's own), one collection of what is
already garbage (so that finalizers such as shared-memory handles still run) and then
``gc.freeze()``: the final collections skip the frozen survivors. Module teardown, destructors
and the exit code are unchanged; the same exit took 0.5 s idle.

vLLM imports Ray in each of its processes, and Ray's own atexit handler (``ray.shutdown``) then
imports ``ray.dag`` at every exit, whether Ray was used or not (seen with py-spy in a stopping
server). Where Ray is imported by then, its handler is swapped for one that shuts Ray down only
when this process connected to it (the Ray executor's processes).
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import sys
from typing import NoReturn

_installed = False


def _collect_then_freeze() -> None:
    gc.collect()
    gc.freeze()


def install() -> None:
    """Register the quick exit in this process (idempotent)."""
    global _installed
    if not _installed:
        atexit.register(_collect_then_freeze)
        _installed = True
    _ray_shutdown_only_if_connected()


_RAY_WRAPPED = "_dynamo_spec_exit_only_if_connected"


def _ray_shutdown_only_if_connected() -> None:
    worker = sys.modules.get("ray._private.worker")
    if worker is None or getattr(worker, _RAY_WRAPPED, False):
        return
    shutdown = worker.shutdown

    def shutdown_if_connected() -> None:
        if worker.global_worker.connected:
            shutdown(_exiting_interpreter=True)

    atexit.unregister(shutdown)
    atexit.register(shutdown_if_connected)
    setattr(worker, _RAY_WRAPPED, True)


def exit_now(code: int) -> NoReturn:
    """End this process with ``code`` once its work is done and its resources released: the atexit
    handlers run (logging's flush among them), then the interpreter's module teardown is skipped
    (``os._exit``): 1-3 s of deallocation a server's API process had no use for. For a command whose
    own cleanup is explicit (``serve``: the engine stopped, its processes and the resource tracker
    waited for), never for code that may leave buffered files to the teardown."""
    import os

    atexit.unregister(_collect_then_freeze)  # nothing left to collect for: the heap goes with the process
    _ray_shutdown_only_if_connected()  # Ray may have been imported after install
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)
