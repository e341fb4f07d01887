"""The HTTP app: vLLM's OpenAI layer plus health, liveness, metrics, auth, admission and metering.

The app exists before the engine: it answers /live and /health ("loading") while
the engine loads, and `attach_engine` plugs the engine in when it is up.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from dynamo_spec.config.settings import Settings
from dynamo_spec.engine.args import vllm_serving_args
from dynamo_spec.engine.host import on_cpu
from dynamo_spec.learning import auto, capture, draft_admin
from dynamo_spec.serving import budget_monitor, guard, suffix_trees
from dynamo_spec.serving.admission import AdmissionMiddleware, openai_error
from dynamo_spec.serving.draft_caps import TenantDraftCaps
from dynamo_spec.serving.draft_caps import unavailable as draft_caps_unavailable
from dynamo_spec.serving.dry_fields import DryFields
from dynamo_spec.serving.lifecycle import Lifecycle, Phase
from dynamo_spec.serving.metering import HTTPMetricsMiddleware, MeteredEngineClient, log_stats, poll
from dynamo_spec.serving.metrics import DynamoSpecMetrics

logger = logging.getLogger("dynamo_spec.serving.app")

WATCHDOG_SECONDS = 5.0


def create_app(
    settings: Settings,
    lifecycle: Lifecycle,
    metrics: DynamoSpecMetrics | None,
    metrics_registries: Sequence[CollectorRegistry],
) -> FastAPI:
    """The FastAPI app; serves /v1 once `attach_engine` has given it the engine.

    `metrics_registries` are rendered on /metrics: ours, and the registry that
    holds vLLM's own `vllm:*` collectors (prometheus_client's default one).
    """
    from vllm.entrypoints.openai.chat_completion.api_router import attach_router as attach_chat
    from vllm.entrypoints.openai.completion.api_router import attach_router as attach_completion
    from vllm.entrypoints.openai.models.api_router import attach_router as attach_models
    from vllm.entrypoints.serve.exception_handling.handlers.http import http_exception_handler
    from vllm.entrypoints.serve.exception_handling.register import init_exception_handler

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        try:
            yield
        finally:
            for task in app.state.background:
                task.cancel()

    app = FastAPI(title="dynamo-spec", lifespan=lifespan)
    app.state.args = vllm_serving_args(settings)
    app.state.lifecycle = lifecycle
    app.state.engine = None
    app.state.background = []
    app.state.dry_fields = DryFields(settings.sampling.dry.params())
    attach_models(app)
    attach_completion(app)
    attach_chat(app)
    keyed = settings.server.api_key is not None or settings.server.admin_api_key is not None
    app.include_router(guard.router(enabled=guard_enabled(settings), api_key_set=keyed,
                                    metrics=metrics))
    app.include_router(budget_monitor.router(enabled=budget_enabled(settings)))
    app.include_router(suffix_trees.router(settings))  # speculative.suffix: GET /admin/suffix
    app.state.suffix_enabled = suffix_trees.enabled(settings)
    swapper = draft_admin.swapper_of(settings, metrics)
    app.include_router(draft_admin.router(settings, metrics, swapper))  # /admin/draft: the live draft swap
    capture.attach(app, settings)  # learning.capture: app.state.capture, /admin/learning/captures
    auto.attach(app, settings, swapper)  # learning.auto: its cycles swap through swapper; /admin/learning

    @app.get("/live")
    async def live() -> Response:
        """Liveness: the process answers. Kubernetes restarts the pod when this fails."""
        return JSONResponse({"status": "alive"})

    @app.get("/health")
    async def health() -> Response:
        """Readiness: 200 only when requests can be served (503 loading, draining or dead)."""
        if lifecycle.phase is not Phase.READY:
            body = {"status": lifecycle.phase.value}
            if lifecycle.reason:
                body["reason"] = lifecycle.reason
            return JSONResponse(body, status_code=503)
        try:
            await app.state.engine.check_health()
        except Exception as exc:  # the engine is dead: say so, don't raise
            return JSONResponse({"status": "unhealthy", "reason": str(exc) or type(exc).__name__}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        body = b"".join(generate_latest(r) for r in metrics_registries)
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    init_exception_handler(app)
    # Unknown routes and wrong methods raise Starlette's HTTPException: answer in the OpenAI shape too.
    app.exception_handler(StarletteHTTPException)(http_exception_handler)
    # Middleware: the last added is the outermost. Order of a request: metrics, API key, admission.
    app.add_middleware(AdmissionMiddleware, lifecycle=lifecycle, limits=settings.limits, metrics=metrics,
                       tenant_caps=TenantDraftCaps.from_settings(settings),
                       caps_unavailable=draft_caps_unavailable(on_cpu()), dry=app.state.dry_fields,
                       trees=suffix_trees.TreeNames.from_settings(settings))
    admin_key = settings.server.admin_api_key
    if admin_key is not None:  # /admin takes its own key only: the users' key is refused there
        app.add_middleware(ApiKeyMiddleware, tokens=[admin_key.get_secret_value()], guarded=("/admin",))
    if settings.server.api_key is not None:
        guarded = ("/v1",) if admin_key is not None else ("/v1", "/admin")
        guarded += ("/metrics",) if settings.server.metrics_require_api_key else ()
        app.add_middleware(ApiKeyMiddleware, tokens=[settings.server.api_key.get_secret_value()], guarded=guarded)
    if metrics is not None:
        # Outermost: it also counts the 401s of the API-key check and the refusals of admission.
        app.add_middleware(HTTPMetricsMiddleware, metrics=metrics, tenant_header=settings.metrics.tenant_header)
    return app


async def attach_engine(app: FastAPI, engine: Any, metrics: DynamoSpecMetrics | None, settings: Settings,
                        on_engine_dead: Callable[[], None]) -> None:
    """Give the app its started engine (vLLM's serving state, metering, watchdog) and mark it ready."""
    from vllm.entrypoints.launchers.api_server.app_state import init_app_state

    client = MeteredEngineClient(engine, metrics) if metrics is not None else engine
    client = capture.capturing(client, app.state.capture)  # the client itself when capture is off
    if suffix_trees.enabled(settings):
        client = suffix_trees.SourcesClient(client, engine)  # per-source figures on each response
    # Sets app.state.engine_client (the metered client) and vLLM's serving objects.
    await init_app_state(client, app.state, app.state.args, supported_tasks=await engine.get_supported_tasks())
    app.state.engine = engine
    app.state.dry_fields.unavailable = dry_unavailable(engine)
    app.state.background += [
        asyncio.create_task(_watchdog(engine, on_engine_dead)),
        asyncio.create_task(log_stats(engine, metrics, settings.metrics.log_interval_seconds)),
    ]
    if metrics is not None:  # the engine-side figures /metrics shows, each read every second
        for on, fetch, record in ((guard_enabled, guard.snapshot, metrics.record_guard),
                                  (budget_enabled, budget_monitor.snapshot, metrics.record_budget),
                                  (suffix_trees.enabled, suffix_trees.counts, metrics.record_sources)):
            if on(settings):
                app.state.background.append(asyncio.create_task(poll(functools.partial(fetch, engine), record)))
    app.state.lifecycle.set_phase(Phase.READY)


def dry_unavailable(engine: Any) -> str | None:
    """Why ``engine`` cannot apply DRY (its path, or its patch off on this vLLM), or None."""
    from dynamo_spec.engine import features, paths
    from dynamo_spec.vllm_patches import unapplied

    config = getattr(engine, "vllm_config", None)
    path = paths.from_vllm_config(config) if config is not None else None
    return features.unavailable(features.DRY, path, unapplied(on_cpu()))


def guard_enabled(settings: Settings) -> bool:
    return settings.speculative.enabled and settings.speculative.guard.enabled


def budget_enabled(settings: Settings) -> bool:
    return settings.speculative.enabled and settings.speculative.draft_budget.enabled


async def _watchdog(engine: Any, on_engine_dead: Callable[[], None]) -> None:
    """Stop the server when the engine dies (vLLM's own server does the same)."""
    while True:
        await asyncio.sleep(WATCHDOG_SECONDS)
        try:
            await engine.check_health()
        except Exception:
            logger.error("The engine died; shutting the server down.")
            on_engine_dead()
            return


class ApiKeyMiddleware:
    """vLLM's bearer-token check (constant-time) on the guarded paths, answering 401 in the OpenAI error shape."""

    def __init__(self, app: ASGIApp, tokens: list[str], guarded: tuple[str, ...] = ("/v1",)):
        from vllm.entrypoints.serve.middleware.authenticate import AuthenticationMiddleware

        self.app = app
        self.guarded = guarded
        self._check = AuthenticationMiddleware(app, tokens)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] == "http"
            and scope.get("method") != "OPTIONS"
            and scope["path"].startswith(self.guarded)
            and not self._check.verify_token(Request(scope).headers)
        ):
            response = openai_error(401, "Invalid or missing API key: send 'Authorization: Bearer <key>'", "Unauthorized")
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)
