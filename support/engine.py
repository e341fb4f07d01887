"""A fresh in-process vLLM ``AsyncLLM`` for tests that look at engine outputs directly."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any


def generate_one_by_one(engine_args: Any, prompts: Sequence[str], params: Any) -> list[Any]:
    """Each prompt in turn (one request at a time) in a fresh engine, always shut down after;
    the final ``RequestOutput`` of each."""
    from vllm.v1.engine.async_llm import AsyncLLM

    async def run() -> list[Any]:
        engine = AsyncLLM.from_engine_args(engine_args)
        try:
            finals = []
            for i, prompt in enumerate(prompts):
                final = None
                async for out in engine.generate(prompt, params, request_id=f"req-{i}"):
                    final = out
                assert final is not None and final.finished
                finals.append(final)
            return finals
        finally:
            engine.shutdown()

    return asyncio.run(run())
