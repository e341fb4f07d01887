"""``/admin/draft``: which draft the engine serves (GET), and a swap to another one (POST
``{"path": DIR}``) without a restart; posting the previous path rolls back. The work is in
``swap.py``; the API-key check guards ``/admin`` when ``server.api_key`` is set.

Answers: 200 with the served draft (path, version, when loaded, gate figures, the previous one);
400 naming every problem of a draft the engine cannot load (the served draft stays); 404 without
an EAGLE-3 draft; 501 where the engine's runner cannot swap (Model Runner V2); 503 while loading.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from dynamo_spec.config.settings import Settings
from dynamo_spec.engine import features, paths
from dynamo_spec.engine.host import on_cpu
from dynamo_spec.learning.swap import DraftSwapper, SwapRefused
from dynamo_spec.serving.admission import openai_error
from dynamo_spec.serving.metrics import DynamoSpecMetrics

logger = logging.getLogger("dynamo_spec.learning.draft_admin")

ROUTE = "/admin/draft"


class Unavailable(Exception):
    """No swap is possible now (404 no EAGLE-3 draft, 503 no engine yet, 501 Model Runner V2)."""

    def __init__(self, status: int, message: str, type_: str):
        super().__init__(message)
        self.status, self.message, self.type_ = status, message, type_


def swapper_of(settings: Settings, metrics: DynamoSpecMetrics | None) -> DraftSwapper | None:
    """What the engine serves and the way to change it; None without an EAGLE-3 draft."""
    return DraftSwapper(settings, metrics, started_at=time.time()) if features.DRAFT_SWAP.enabled(settings) else None


async def swap(swapper: DraftSwapper | None, engine: Any, path: str) -> dict[str, Any]:
    """Swap the served draft for the one in ``path``: the one way, for ``POST /admin/draft`` and
    ``learning.auto`` (``auto.py``). Raises :class:`Unavailable`, or ``SwapRefused`` (the served
    draft stays) naming every problem of the draft."""
    if swapper is None:
        raise Unavailable(404, "No EAGLE-3 draft is served (speculative.enabled with method eagle3 serves one)",
                          "NotFoundError")
    if engine is None:
        raise Unavailable(503, "The engine is not ready", "ServiceUnavailableError")
    if why := features.unavailable(features.DRAFT_SWAP, paths.from_vllm_config(engine.vllm_config), ()):
        raise Unavailable(501, f"{features.DRAFT_SWAP.setting}: {why}", "NotImplementedError")
    try:
        return await swapper.swap(engine, path, on_cpu())
    except SwapRefused as exc:
        logger.warning("Draft swap refused, %s stays: %s", swapper.served.path, exc)
        raise


def router(settings: Settings, metrics: DynamoSpecMetrics | None, swapper: DraftSwapper | None = None) -> APIRouter:
    """The routes; ``swapper``: the app's (``learning.auto`` swaps through it too), else one of their own."""
    r = APIRouter()
    swapper = swapper or swapper_of(settings, metrics)

    @r.get(ROUTE)
    async def read() -> Response:
        """The served draft: path, version, when loaded, its gate figures; and the one before it."""
        if swapper is None:
            return openai_error(404, "No EAGLE-3 draft is served (speculative.enabled with method eagle3 serves one)",
                                "NotFoundError")
        return JSONResponse(swapper.state())

    @r.post(ROUTE)
    async def post(request: Request) -> Response:
        """Load the draft in {"path": DIR} into the running engine; requests in flight go on."""
        try:
            body = await request.json()
        except ValueError:
            body = None
        path = body.get("path") if isinstance(body, dict) else None
        if swapper is not None and (not isinstance(path, str) or not path):
            return openai_error(400, "'path' must be a draft's directory (a string)", "BadRequestError", "path")
        try:
            return JSONResponse(await swap(swapper, request.app.state.engine, path))
        except Unavailable as exc:
            return openai_error(exc.status, exc.message, exc.type_)
        except SwapRefused as exc:
            return openai_error(400, f"{exc} (still serving {swapper.served.path})", "BadRequestError", "path")

    return r
