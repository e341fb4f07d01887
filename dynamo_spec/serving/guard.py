"""The API process's side of the speculation guard (``dynamo_spec.vllm_patches.speculation_guard``,
which runs in EngineCore): its state on /metrics, and the operator's admin route.

The guard lives in the engine's scheduler; the EngineCore utility method
``dynamo_spec_guard`` (added by ``draft_admission``) returns its snapshot and forces a
state. ``serving.metering.poll`` reads it every second into the metrics; ``/admin/speculation`` reads it
(GET) or forces a state (POST ``{"state": "fallback" | "speculating" | "probing" | "auto"}``).
Forcing needs ``server.api_key`` (the API-key check guards ``/admin``).
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from dynamo_spec.serving.admission import openai_error
from dynamo_spec.serving.metrics import DynamoSpecMetrics
from dynamo_spec.vllm_patches.draft_admission import GUARD_UTILITY
from dynamo_spec.vllm_patches.speculation_guard import AUTO, STATES

logger = logging.getLogger("dynamo_spec.serving.guard")

ROUTE = "/admin/speculation"


async def snapshot(engine: Any, state: str = "") -> dict | None:
    """The guard's snapshot from the engine (after forcing ``state``); None without a guard."""
    return await engine.engine_core.call_utility_async(GUARD_UTILITY, state)




def router(enabled: bool, api_key_set: bool, metrics: DynamoSpecMetrics | None) -> APIRouter:
    r = APIRouter()

    def off() -> Response:
        return openai_error(404, "The speculation guard is off: set speculative.guard.enabled: true",
                            "NotFoundError")

    @r.get(ROUTE)
    async def read(request: Request) -> Response:
        """The guard's state, window figures and transition counts."""
        engine = request.app.state.engine
        if not enabled:
            return off()
        if engine is None:
            return openai_error(503, "The engine is not ready", "ServiceUnavailableError")
        return JSONResponse(await snapshot(engine))

    @r.post(ROUTE)
    async def force(request: Request) -> Response:
        """Force a state: {"state": "fallback" | "speculating" (pinned), "probing" (now), "auto"}."""
        if not enabled:
            return off()
        if not api_key_set:
            return openai_error(403, "Forcing the speculation guard needs server.api_key to be set",
                                "PermissionDeniedError")
        try:
            body = await request.json()
        except ValueError:
            body = None
        choices = (*STATES, AUTO)
        state = body.get("state") if isinstance(body, dict) else None
        if state not in choices:
            return openai_error(400, f"'state' must be one of {', '.join(choices)}", "BadRequestError", "state")
        engine = request.app.state.engine
        if engine is None:
            return openai_error(503, "The engine is not ready", "ServiceUnavailableError")
        snap = await snapshot(engine, state)
        logger.info("Speculation guard forced to %s by an operator: now %s%s", state, snap["state"],
                    " (pinned)" if snap["pinned"] else "")
        if metrics is not None:
            metrics.record_guard(snap)
        return JSONResponse(snap)

    return r
