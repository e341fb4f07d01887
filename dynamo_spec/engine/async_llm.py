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
from dynamo_spec.engine import features, paths
from dynamo_spec.engine.args import build_engine_args, build_vllm_config, serve_usage_context
from dynamo_spec.engine.host import detect_host, resolve_dtype
from dynamo_spec.engine.process_env import prepare_engine_processes
from dynamo_spec.engine.teardown import set_worker_timeout, shutdown_engine
from dynamo_spec.vllm_patches import Patch, unapplied

logger = logging.getLogger("dynamo_spec.engine.async_llm")


@asynccontextmanager
async def open_engine(settings: Settings, stat_loggers: Sequence[Any] = ()) -> AsyncIterator[Any]:
    """Start vLLM's AsyncLLM for `settings`; on exit, shut it down and return once its
    processes are gone (``teardown``).

    `stat_loggers` are vLLM StatLoggerFactory callables; they are added to
    vLLM's own (logging and Prometheus) loggers. The load (minutes for a large
    model) runs in a thread, so the event loop keeps answering /live and /health
    meanwhile; cancelling this while it loads is `stop_loading`'s job.
    """
    from vllm.v1.engine.async_llm import AsyncLLM

    prepare_engine_processes(ranks=settings.engine.tensor_parallel_size * settings.engine.pipeline_parallel_size,
                             cpu_preload=settings.engine.cpu_preload)
    set_worker_timeout(os.environ, settings.server.engine_stop_seconds)
    host = detect_host()
    dtype, why = resolve_dtype(settings.engine.dtype, host)
    if why:
        logger.info("engine.dtype: %s (%s; CPU: %s; vLLM platform: %s)", dtype, why, host.cpu_model, host.platform)
    applied, why_schedule = schedule.for_engine(settings, dtype)
    if why_schedule and settings.speculative.enabled:
        logger.info("%s: %s (%s)", schedule.FIELD, schedule.as_lists(applied), why_schedule)

    def start() -> Any:  # in a thread: building vLLM's config alone inspects the models (seconds)
        from vllm.v1.executor.abstract import Executor

        # AsyncLLM.from_engine_args, with `vllm serve`'s usage context and the path checked in between
        engine_args = build_engine_args(settings)
        vllm_config = build_vllm_config(settings, engine_args)
        check_engine_path(settings, vllm_config, unapplied(host.on_cpu))
        return AsyncLLM(vllm_config=vllm_config, executor_class=Executor.get_class(vllm_config),
                        log_requests=engine_args.enable_log_requests, log_stats=not engine_args.disable_log_stats,
                        usage_context=serve_usage_context(), stat_loggers=list(stat_loggers) or None)

    engine = await asyncio.to_thread(start)
    try:
        yield engine
    finally:
        shutdown_engine(engine, settings.server.engine_stop_seconds)


class EnginePathError(RuntimeError):
    """The engine would run without what the settings need: a feature turned on that cannot act
    (its patch stays off, or this runner or scheduling cannot run it), or a correctness fix."""


def check_engine_path(settings: Settings, vllm_config: Any, unapplied_patches: Sequence[Patch]) -> paths.EnginePath:
    """From the config vLLM built, before any engine process starts, preflight's check again
    (``features.refusals``), so that ``serve --skip-preflight`` cannot start a feature inactive:
    refuse (one line each), warn where allowed, and say which automatic features stay off."""
    path = paths.from_vllm_config(vllm_config)
    logger.info("engine path: %s", path)
    problems = features.refusals(settings, path, unapplied_patches)
    if errors := [p.message for p in problems if p.level == "error"]:
        raise EnginePathError("; ".join(errors))
    for line in [p.message for p in problems] + features.inactive(settings, path, unapplied_patches):
        logger.warning("%s", line)
    return path


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
