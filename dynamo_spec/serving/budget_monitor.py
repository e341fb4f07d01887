"""The API process's side of the confidence draft budget (``dynamo_spec.vllm_patches.draft_budget``,
which runs in EngineCore): its counts on /metrics, its calibration on ``GET /admin/draft-budget``.

The EngineCore utility method ``dynamo_spec_draft_budget`` (added by ``draft_admission``)
returns the budget's snapshot; ``serving.metering.poll`` reads it every second into the metrics.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from dynamo_spec.serving.admission import openai_error
from dynamo_spec.vllm_patches.draft_admission import BUDGET_UTILITY

ROUTE = "/admin/draft-budget"


async def snapshot(engine: Any) -> dict | None:
    """The budget's counts and calibration cells from the engine; None without a budget."""
    return await engine.engine_core.call_utility_async(BUDGET_UTILITY)




def router(enabled: bool) -> APIRouter:
    r = APIRouter()

    @r.get(ROUTE)
    async def read(request: Request) -> Response:
        """The budget's counts (offered, admitted, explored draft tokens) and its calibration cells."""
        if not enabled:
            return openai_error(404, "The confidence draft budget is off: set speculative.draft_budget.enabled: true",
                                "NotFoundError")
        engine = request.app.state.engine
        if engine is None:
            return openai_error(503, "The engine is not ready", "ServiceUnavailableError")
        return JSONResponse(await snapshot(engine))

    return r
