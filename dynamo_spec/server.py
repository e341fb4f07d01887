"""`dynamo-spec serve`: preflight, engine, app, uvicorn."""

from __future__ import annotations

import asyncio
import logging
import signal

import uvicorn
from prometheus_client import REGISTRY, CollectorRegistry

from dynamo_spec import __version__
from dynamo_spec.app import create_app
from dynamo_spec.engine import open_engine
from dynamo_spec.metrics import DynamoSpecMetrics
from dynamo_spec.settings import Settings

logger = logging.getLogger("dynamo_spec.server")


def build_metrics(settings: Settings, registry: CollectorRegistry) -> DynamoSpecMetrics:
    spec = settings.speculative
    return DynamoSpecMetrics(
        registry,
        model=settings.served_model_name,
        draft_model=(spec.model or "") if spec.enabled else "",
        method=spec.method if spec.enabled else "none",
        num_speculative_tokens=spec.num_speculative_tokens if spec.enabled else 0,
        version=__version__,
        window_seconds=settings.metrics.window_seconds,
        max_tenants=settings.metrics.max_tenants,
    )


async def serve(settings: Settings) -> int:
    """Serve until stopped; the exit status is 1 if the engine died, else 0."""
    registry = CollectorRegistry()
    metrics = build_metrics(settings, registry) if settings.metrics.enabled else None
    stat_loggers = [metrics.stat_logger_factory()] if metrics is not None else []
    async with open_engine(settings, stat_loggers=stat_loggers) as engine:
        app = create_app(settings, engine, metrics, metrics_registries=[registry, REGISTRY])
        config = uvicorn.Config(
            app, host=settings.server.host, port=settings.server.port,
            log_level=settings.server.log_level, timeout_graceful_shutdown=5,
        )
        server = uvicorn.Server(config)
        app.state.server = server
        logger.info("Serving %s on http://%s:%d", settings.served_model_name, settings.server.host, settings.server.port)
        await server.serve()
        return 1 if app.state.engine_dead else 0


def run(settings: Settings) -> int:
    # uvicorn stops on SIGINT/SIGTERM, then re-raises the signal. SIGTERM's default
    # action would kill this process before the engine's context manager shuts the
    # engine down, orphaning EngineCore; as KeyboardInterrupt it unwinds through it.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        return asyncio.run(serve(settings))
    except KeyboardInterrupt:
        logger.info("Stopped.")
        return 0
