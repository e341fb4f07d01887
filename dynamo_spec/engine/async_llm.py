"""The vLLM engine as an async context manager."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

from dynamo_spec.config import schedule
from dynamo_spec.config.settings import Settings
from dynamo_spec.engine.args import build_engine_args
from dynamo_spec.engine.cpu_threads import default_cpu_thread_binding
from dynamo_spec.engine.host import apply_cpu_preload, cpu_preload_libraries, detect_host, resolve_dtype

logger = logging.getLogger("dynamo_spec.engine.async_llm")


@asynccontextmanager
async def open_engine(settings: Settings, stat_loggers: Sequence[Any] = ()) -> AsyncIterator[Any]:
    """Start vLLM's AsyncLLM for `settings`; always shut it down on exit.

    `stat_loggers` are vLLM StatLoggerFactory callables; they are added to
    vLLM's own (logging and Prometheus) loggers. The load (minutes for a large
    model) runs in a thread, so the event loop keeps answering /live and /health
    meanwhile; cancelling this while it loads is `stop_loading`'s job.
    """
    from vllm.v1.engine.async_llm import AsyncLLM

    default_cpu_thread_binding(ranks=settings.engine.tensor_parallel_size * settings.engine.pipeline_parallel_size)
    host = detect_host()
    dtype, why = resolve_dtype(settings.engine.dtype, host)
    if why:
        logger.info("engine.dtype: %s (%s; CPU: %s; vLLM platform: %s)", dtype, why, host.cpu_model, host.platform)
    applied, why_schedule = schedule.for_engine(settings, dtype)
    if why_schedule and settings.speculative.enabled:
        logger.info("%s: %s (%s)", schedule.FIELD, schedule.as_lists(applied), why_schedule)
    if host.on_cpu and settings.engine.cpu_preload:
        wanted = cpu_preload_libraries()
        added = apply_cpu_preload(os.environ, wanted)
        if added:
            logger.info("LD_PRELOAD for the engine's processes: %s (engine.cpu_preload)", ":".join(added))
        if set(wanted) - set(added):
            logger.info("engine.cpu_preload: kept what LD_PRELOAD already has (%s) instead of %s",
                        os.environ.get("LD_PRELOAD", ""), ":".join(sorted(set(wanted) - set(added))))
    # Engine processes are started from the loading thread: spawn them (vLLM's CPU
    # platform forces spawn anyway; on GPU, forking beside a running event loop is unsafe).
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    engine_args = build_engine_args(settings)
    engine = await asyncio.to_thread(AsyncLLM.from_engine_args, engine_args, stat_loggers=list(stat_loggers) or None)
    try:
        yield engine
    finally:
        engine.shutdown()


def stop_loading(grace: float = 5.0) -> int:
    """Stop an engine that is still loading: terminate this process's children (EngineCore, workers).

    vLLM's start-up then fails in the loading thread, which ends it. Returns how many
    processes were stopped.
    """
    import psutil

    children = psutil.Process().children(recursive=True)
    for child in children:
        with contextlib.suppress(psutil.NoSuchProcess):
            child.terminate()
    _, alive = psutil.wait_procs(children, timeout=grace)
    for child in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            child.kill()
    return len(children)
