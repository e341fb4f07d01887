"""``/admin/learning/captures``: what the capture keeps (GET) and erasing it (DELETE).

Like every ``/admin`` route it needs the API key when ``server.api_key`` is set
(``serving.app.ApiKeyMiddleware``). Erasing works with capture off too: it removes what an
earlier run kept under ``learning.dir`` (and creates nothing where there is nothing).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from dynamo_spec.learning import captures
from dynamo_spec.learning.capture import Capture, running
from dynamo_spec.serving import suffix_trees

ROUTE = "/admin/learning/captures"


def router(root: str, capture: Capture | None) -> APIRouter:
    """The routes; the router's lifespan runs the capture's writer thread (nothing when off)."""
    r = APIRouter(lifespan=lambda app: running(capture))

    @r.get(ROUTE)
    async def read() -> JSONResponse:
        """Whether capture is on, where the captures are, their target, files, rows and bytes."""
        manifest = await asyncio.to_thread(captures.manifest_of, root)
        files = manifest["files"]
        return JSONResponse({
            "capture": capture is not None, "dir": str(Path(root) / captures.CAPTURES),
            "target": manifest.get("target"), "files": len(files), "rows": sum(e["rows"] for e in files),
            "bytes": sum(e["bytes"] for e in files),
        })

    @r.delete(ROUTE)
    async def erase(request: Request) -> JSONResponse:
        """Erase every capture (those still buffered too), and empty the suffix mix's trees (the served
        answers they hold in the engine's memory); answers what was erased."""
        erased = await asyncio.to_thread(capture.erase if capture is not None else lambda: captures.erase(root))
        body = {"erased": erased, "capture": capture is not None}
        if (answers := await suffix_trees.erase(request.app.state)) is not None:
            body["suffix_trees_erased_answers"] = answers
        return JSONResponse(body)

    return r
