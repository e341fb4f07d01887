"""What feeds the metrics of ``dynamo_spec.serving.metrics``: building them from the settings, the
engine client that meters every request, the HTTP middleware that counts requests by
route and sets the tenant, and the periodic log line. The metrics themselves, and vLLM's
stat logger that feeds the acceptance window, are in ``metrics``."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from prometheus_client import CollectorRegistry
from starlette.routing import Match
from starlette.types import ASGIApp, Receive, Scope, Send

from dynamo_spec import __version__
from dynamo_spec.config.settings import Settings
from dynamo_spec.serving.metrics import DynamoSpecMetrics, current_tenant


def build_metrics(settings: Settings, registry: CollectorRegistry) -> DynamoSpecMetrics:
    spec = settings.speculative
    return DynamoSpecMetrics(
        registry,
        model=settings.served_model_name,
        draft_model=(spec.model or "") if spec.enabled else "",
        method=spec.method if spec.enabled else "none",
        num_speculative_tokens=spec.longest_draft if spec.enabled else 0,
        version=__version__,
        window_seconds=settings.metrics.window_seconds,
        max_tenants=settings.metrics.max_tenants,
    )


class MeteredEngineClient:
    """Delegates to the engine; meters each request's latency, tokens and acceptance.

    vLLM's OpenAI serving layer calls `generate` for every completion and chat
    request; everything else passes straight through.
    """

    def __init__(self, engine: Any, metrics: DynamoSpecMetrics):
        self._engine = engine
        self._metrics = metrics

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    async def generate(self, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        tenant = current_tenant.get()
        start = time.monotonic()
        first_at: float | None = None
        async for output in self._engine.generate(*args, **kwargs):
            if first_at is None and any(o.token_ids for o in output.outputs):
                first_at = time.monotonic()
            if output.finished:
                self._observe(output, tenant, start, first_at)
            yield output

    def _observe(self, output: Any, tenant: str, start: float, first_at: float | None) -> None:
        now = time.monotonic()
        stats = output.metrics  # RequestStateStats, engine-side timestamps (None if stats are off)
        completion_tokens = stats.num_generation_tokens if stats else sum(len(o.token_ids) for o in output.outputs)
        ttft = stats.first_token_latency if stats and stats.first_token_latency else None
        if ttft is None and first_at is not None:
            ttft = first_at - start
        itl = None
        if stats and stats.num_generation_tokens > 1 and stats.last_token_ts > stats.first_token_ts:
            itl = (stats.last_token_ts - stats.first_token_ts) / (stats.num_generation_tokens - 1)
        spec = [o.spec_decode_metrics.to_dict() for o in output.outputs if getattr(o, "spec_decode_metrics", None)]
        self._metrics.observe_request(
            tenant,
            prompt_tokens=len(output.prompt_token_ids or ()),
            completion_tokens=completion_tokens,
            e2e_seconds=now - start,
            ttft_seconds=ttft,
            itl_seconds=itl,
            spec=spec,
        )


POLL_SECONDS = 1.0


async def poll(fetch: Callable[[], Awaitable[Any]], record: Callable[[Any], None], interval: float = POLL_SECONDS) -> None:
    """Keep the metrics' copy of a figure the engine holds (the guard's state, the budget's counts, the
    suffix mix's per-source counts: ``fetch``, an EngineCore utility call) at most ``interval`` old."""
    while True:
        with contextlib.suppress(Exception):  # the engine is stopping or dead: the watchdog says so
            record(await fetch())
        await asyncio.sleep(interval)


async def log_stats(engine: Any, metrics: DynamoSpecMetrics | None, interval: float) -> None:
    while True:
        await asyncio.sleep(interval)
        await engine.do_log_stats()
        if metrics is not None:
            metrics.log_window()


def route_of(app: Any, scope: Scope) -> str:
    for route in app.router.routes:
        match, _ = route.matches(scope)
        if match == Match.FULL:
            return route.path
    return "unmatched"


class HTTPMetricsMiddleware:
    """Counts requests by route template and status; sets the request's tenant."""

    def __init__(self, app: ASGIApp, metrics: DynamoSpecMetrics, tenant_header: str | None):
        self.app = app
        self.metrics = metrics
        self.tenant_header = tenant_header.lower().encode() if tenant_header else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        route = route_of(scope["app"], scope)
        tenant = None
        if self.tenant_header:
            tenant = next((v.decode("latin-1") for k, v in scope["headers"] if k == self.tenant_header), None)
        token = current_tenant.set(self.metrics.tenants.label(tenant))
        status = 500
        in_flight = self.metrics.http_in_flight.labels(route)

        async def send_wrapper(message: dict) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        in_flight.inc()
        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            in_flight.dec()
            self.metrics.observe_http(route, scope["method"], status)
            current_tenant.reset(token)
