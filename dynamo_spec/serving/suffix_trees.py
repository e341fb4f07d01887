"""The API process's side of the suffix mix (``dynamo_spec.vllm_patches.suffix_mix``, which runs in
the engine): which tree a request drafts from, the per-source counts on /metrics, ``GET
/admin/suffix``, and emptying the trees (``DELETE /admin/learning/captures`` calls :func:`erase`).

Each response's ``metrics.speculative_decoding`` gains ``sources``: the request's verify steps,
drafted and accepted tokens and acceptance length per source (:class:`SourcesClient`).

A request's tree is its tenant's (the value of ``metrics.tenant_header``; requests without the
header share one), written into ``vllm_xargs`` by admission whatever the client sent there, so no
request can draft from another tenant's answers. Past ``metrics.max_tenants`` distinct tenants a
new tenant's requests get no shared tree (:data:`NO_TREE`: the EAGLE-3 draft alone), which bounds
the trees' memory at ``max_tenants x max_cached_requests`` answers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from dynamo_spec.config.settings import Settings
from dynamo_spec.serving.admission import openai_error
from dynamo_spec.vllm_patches.suffix_mix import (
    DEFAULT_TREE,
    NO_TREE,
    REQUEST_KEY_FIELD,
    REQUEST_UTILITY,
    TREE_FIELD,
    UTILITY,
    WORKER_CLEAR,
    WORKER_STATS,
)

ROUTE = "/admin/suffix"


def enabled(settings: Settings) -> bool:
    return settings.speculative.enabled and settings.speculative.suffix.enabled


class TreeNames:
    """The tree of each request, from its tenant header (scope ``tenant``) or one for all (``global``)."""

    def __init__(self, header: str | None, per_tenant: bool, max_trees: int):
        self.header = header.lower().encode("latin-1") if header and per_tenant else None
        self.max_trees = max_trees
        self._seen: set[str] = set()
        self._lock = threading.Lock()

    @classmethod
    def from_settings(cls, settings: Settings) -> TreeNames | None:
        if not enabled(settings):
            return None
        return cls(settings.metrics.tenant_header, settings.speculative.suffix.scope == "tenant",
                   settings.metrics.max_tenants)

    def name(self, headers: list[tuple[bytes, bytes]]) -> str:
        if self.header is None:
            return DEFAULT_TREE
        tenant = next((v.decode("latin-1") for k, v in headers if k == self.header), None)
        if not tenant:
            return DEFAULT_TREE
        with self._lock:
            if tenant in self._seen:
                return tenant
            if len(self._seen) < self.max_trees:
                self._seen.add(tenant)
                return tenant
        return NO_TREE

    def merged(self, body: Any, headers: list[tuple[bytes, bytes]]) -> dict[str, Any] | None:
        """The body with its tree named in ``vllm_xargs`` (a client's own value replaced), or None
        where there is nothing to change (not an object, or a ``vllm_xargs`` vLLM refuses)."""
        if not isinstance(body, dict):
            return None
        xargs = body.get("vllm_xargs")
        if xargs is None:
            xargs = {}
        elif not isinstance(xargs, dict):
            return None
        return {**body, "vllm_xargs": {**xargs, TREE_FIELD: self.name(headers), REQUEST_KEY_FIELD: uuid.uuid4().hex}}


class SourcesClient:
    """Delegates to the engine client; on a request's final output, its per-source counts join its
    ``metrics.speculative_decoding`` as ``sources`` (fetched once from the engine by the key
    admission wrote into ``vllm_xargs``)."""

    def __init__(self, client: Any, engine: Any):
        self._client = client
        self._engine = engine

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    async def generate(self, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        params = kwargs.get("sampling_params", args[1] if len(args) > 1 else None)
        key = (getattr(params, "extra_args", None) or {}).get(REQUEST_KEY_FIELD)
        async for output in self._client.generate(*args, **kwargs):
            if output.finished and isinstance(key, str):
                with contextlib.suppress(Exception):  # the figures are an extra: never fail a request
                    attach_sources(output, await self._engine.engine_core.call_utility_async(REQUEST_UTILITY, key))
            yield output


def attach_sources(output: Any, split: dict | None) -> None:
    """Give the output's per-request stats (vLLM's ``RequestSpecDecodeMetrics``) a ``sources`` entry."""
    if not split:
        return
    sources = {name: {**c, "acceptance_length": 1 + c["accepted_tokens"] / c["steps"] if c["steps"] else None}
               for name, c in split.items()}
    for completion in output.outputs:
        metrics = getattr(completion, "spec_decode_metrics", None)
        if metrics is not None:
            completion.spec_decode_metrics = _with_sources(metrics, sources)


def _with_sources(metrics: Any, sources: dict) -> Any:
    return _sources_class(type(metrics))(**dataclasses.asdict(metrics), sources=sources)


@functools.cache
def _sources_class(base: type) -> type:
    """vLLM's per-request stats class with a ``sources`` field its ``to_dict`` adds."""

    @dataclasses.dataclass
    class WithSources(base):  # type: ignore[misc, valid-type]
        sources: dict = dataclasses.field(default_factory=dict)

        def to_dict(self) -> dict[str, Any]:
            return {**super().to_dict(), "sources": self.sources}

    return WithSources


async def counts(engine: Any) -> dict | None:
    """Drafted, accepted tokens and verify steps per source, from the engine's scheduler; None when off."""
    return await engine.engine_core.call_utility_async(UTILITY)


async def tree_stats(engine: Any) -> list[dict | None]:
    """Each worker's trees: how many, answers cached, requests in flight, their own time."""
    return await engine.collective_rpc(WORKER_STATS)


async def erase(app_state: Any) -> int | None:
    """Empty every tree of the engine's workers: the answers erased, or None (no engine, or the mix off)."""
    engine = getattr(app_state, "engine", None)
    if engine is None or not getattr(app_state, "suffix_enabled", False):
        return None
    results = await engine.collective_rpc(WORKER_CLEAR)
    return sum(r.get("erased_answers", 0) for r in results if r)




def router(settings: Settings) -> APIRouter:
    r = APIRouter()
    on = enabled(settings)

    @r.get(ROUTE)
    async def read(request: Request) -> Response:
        """Per source (suffix, draft): verify steps, drafted and accepted tokens, acceptance length; the trees."""
        if not on:
            return openai_error(404, "The suffix mix is off: set speculative.suffix.enabled: true", "NotFoundError")
        engine = request.app.state.engine
        if engine is None:
            return openai_error(503, "The engine is not ready", "ServiceUnavailableError")
        by_source = await counts(engine) or {}
        for c in by_source.values():
            c["acceptance_length"] = 1 + c["accepted_tokens"] / c["steps"] if c["steps"] else None
        steps = sum(c["steps"] for c in by_source.values())
        return JSONResponse({"sources": by_source,
                             "suffix_share": by_source.get("suffix", {}).get("steps", 0) / steps if steps else None,
                             "trees": await tree_stats(engine)})

    return r
