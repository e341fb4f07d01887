"""``GET /admin/learning``: the automatic learn cycles (``learning.auto``, ``auto.py``).

Whether auto is on, the answer tokens captured since the last cycle against
``learning.every_tokens``, the cycle running now (pid, since when, its log) and the recent
cycles (the newest 20, oldest first: start, end, exit, promoted, swapped, version, reason,
figures, seconds), also after a restart (``learning.dir/cycles.jsonl``). Like every ``/admin``
route it needs the API key when ``server.api_key`` is set.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from dynamo_spec.learning.auto import AutoLearner, read_cycles, running

ROUTE = "/admin/learning"


def router(root: str, learner: AutoLearner | None) -> APIRouter:
    """The route; the router's lifespan runs the learner (nothing when auto is off)."""
    r = APIRouter(lifespan=lambda app: running(app, learner))

    @r.get(ROUTE)
    async def read(request: Request) -> JSONResponse:
        if learner is not None:
            return JSONResponse(learner.state(request.app.state.lifecycle.in_flight))
        cycles = await asyncio.to_thread(read_cycles, Path(root))
        return JSONResponse({"auto": False, "dir": root, "running": None, "cycles": cycles})

    return r
