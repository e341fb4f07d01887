"""vLLM engines in the test's own process, for tests that are not about the engine's processes.

An offline engine normally spawns its EngineCore and, on CPU, a worker: each imports vLLM again
(about 7 s each on one core of these hosts) before the engine loads its tiny models in a second.
With ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` the engine core runs in the process that builds the
``vllm.LLM`` and, on CPU, its executor stays the uni-process one (vllm/platforms/cpu.py forces the
multiprocess executor only with multiprocessing on): the same model runner, sampler and patches
(the project's vLLM plugin loads in this process as in a worker), started in 2-4 s.

What such an engine leaves in the process, undone on leaving :func:`in_process_engines`: its
torch.distributed groups, vLLM's cache of its environment variables (``enable_envs_cache``, set by
``EngineCore``) and the frozen GC heap (``freeze_gc_heap``), with vLLM's own
``cleanup_dist_env_and_memory`` (what vLLM's tests call between engines in one process);
``torch.set_num_threads`` replaced by the CPU worker with a
no-op, the number of torch threads, the CPU affinity, the environment variables it set
(``VLLM_DIST_IDENT`` and others that servers started later would inherit), and the worker
extension (``worker_extension_cls``: vLLM adds it to the worker class's bases, v1/worker/worker_base.py).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

MULTIPROCESSING = "VLLM_ENABLE_V1_MULTIPROCESSING"


@contextlib.contextmanager
def in_process_engines() -> Iterator[None]:
    """Offline ``vllm.LLM`` engines built inside run in this process (not ``AsyncLLM``: it always
    has its core in another process); this process as it was afterwards."""
    import torch
    from vllm import envs
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory
    from vllm.v1.worker.cpu_worker import CPUWorker
    from vllm.v1.worker.gpu_worker import Worker

    bases = {cls: cls.__bases__ for cls in (CPUWorker, Worker)}
    environ = dict(os.environ)
    affinity = os.sched_getaffinity(0)
    set_num_threads, threads = torch.set_num_threads, torch.get_num_threads()
    envs.disable_envs_cache()  # read the variable below, not a value cached earlier
    os.environ[MULTIPROCESSING] = "0"
    try:
        yield
    finally:
        cleanup_dist_env_and_memory()
        for cls, own in bases.items():
            cls.__bases__ = own
        torch.set_num_threads = set_num_threads
        torch.set_num_threads(threads)
        os.sched_setaffinity(0, affinity)
        os.environ.clear()
        os.environ.update(environ)


@contextlib.contextmanager
def in_process_llm(**engine_kwargs):
    """A ``vllm.LLM`` built from ``engine_kwargs`` in this process (:func:`in_process_engines`),
    always shut down after."""
    with in_process_engines():
        from vllm import LLM

        llm = LLM(**engine_kwargs)
        try:
            yield llm
        finally:
            llm.llm_engine.engine_core.shutdown()
            del llm


def in_process_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for a command (``dynamo-spec verify``, ``eval-draft``, ...) whose offline
    engines should run in its own process: ``env`` (default: this process's) with multiprocessing off."""
    return {**(os.environ if env is None else env), MULTIPROCESSING: "0"}
