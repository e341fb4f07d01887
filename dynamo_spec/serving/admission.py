"""Admission for /v1: is the server ready, is there room, is the request within bounds, is it done in time.

Each refusal is answered at once in the OpenAI error shape and counted in
``dynamo_spec_requests_rejected_total{reason}``:

- 503 ``loading`` / ``draining`` / ``dead`` (with Retry-After while loading);
- 429 ``overloaded`` when ``limits.max_in_flight`` generation requests are running
  (Retry-After: 1);
- 413 ``body_too_large`` past ``limits.max_body_bytes``;
- 400 ``limit`` when a field asks for more than its limit (the message names the
  field and the limit);
- 400 ``invalid`` when the body is not JSON, nests deeper than ``limits.max_json_depth``,
  has a field of a type vLLM would crash on, or a ``vllm_xargs.max_draft_tokens`` that is
  not an integer >= 0.

DRY fields (top-level or in ``vllm_xargs``) are checked (400 ``invalid`` naming the field) and
reach vLLM in ``vllm_xargs``, completed with the server's ``sampling.dry`` default (``dry_fields``).
An admitted request of a tenant with a default cap on draft tokens (``speculative.tenants``)
reaches vLLM with that default merged into its ``vllm_xargs`` (``draft_caps``).

A generation request running past ``limits.request_timeout_seconds`` is aborted in
the engine and answered 504, or ended with an error event if it was streaming. A client
that reads a stream too slowly to take that event within ``FINAL_SEND_SECONDS`` (its
socket buffers full) has its connection closed instead: the timeout bounds how long a
slow reader holds a request, whatever it reads.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from typing import Any

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from dynamo_spec.config.settings import LimitsSettings
from dynamo_spec.serving import draft_caps
from dynamo_spec.serving.dry_fields import DryFieldError, DryFields
from dynamo_spec.serving.lifecycle import Lifecycle, Phase
from dynamo_spec.serving.metrics import DynamoSpecMetrics

logger = logging.getLogger("dynamo_spec.serving.admission")

GENERATION_ROUTES = frozenset({"/v1/chat/completions", "/v1/completions"})
# After a timeout, how long the app gets to abort the request and return.
ABORT_WAIT_SECONDS = 10.0
# After a timeout, how long a streaming client gets to take the error event.
FINAL_SEND_SECONDS = 5.0


class SlowReaderClosed(Exception):
    """Raised to the HTTP server to close a connection whose client stopped taking data."""


class _QuietSlowReaders(logging.Filter):
    """uvicorn logs an exception that ends a response with a traceback; this one is ours and
    already logged in one line."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and isinstance(record.exc_info[1], SlowReaderClosed))


logging.getLogger("uvicorn.error").addFilter(_QuietSlowReaders())


def openai_error(status: int, message: str, type_: str, param: str | None = None,
                 headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": type_, "param": param, "code": status}},
                        status_code=status, headers=headers)


class Refusal(Exception):
    def __init__(self, status: int, reason: str, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.reason, self.message, self.param = status, reason, message, param


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


# Fields whose wrong JSON type vLLM 0.32's own request validators do not catch: they call
# .get on the value (ChatCompletionRequest.check_structured_outputs_count and the
# completions twin), so `"structured_outputs": false` was a 500 (found by tests/integration/test_fuzz.py).
OBJECT_FIELDS = ("structured_outputs",)


def parse_body(body: bytes, max_depth: int) -> Any:
    """The request body as JSON, or a Refusal: not UTF-8, not JSON, or nested past `max_depth`.

    The depth is bounded because every later parser (ours, vLLM's, pydantic's) recurses
    on nesting: a body of a few hundred kB of ``[[[[...`` raises RecursionError, a 500.
    """
    try:
        parsed = json.loads(body)
    except RecursionError:
        raise Refusal(400, "invalid", f"The request body nests deeper than {max_depth} levels "
                                      "(limits.max_json_depth).") from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
        raise Refusal(400, "invalid", f"The request body is not valid JSON: {exc}") from None
    if _depth_exceeds(parsed, max_depth):
        raise Refusal(400, "invalid", f"The request body nests deeper than {max_depth} levels "
                                      "(limits.max_json_depth).")
    return parsed


def _depth_exceeds(value: Any, max_depth: int) -> bool:
    """Whether arrays/objects in `value` nest deeper than `max_depth` (iterative: no recursion)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        if depth > max_depth:
            return True
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return False


def check_types(body: Any, caps_unavailable: str | None = None) -> None:
    """Raise a Refusal naming the field when a field vLLM expects as an object is not one, or
    when the request's cap on draft tokens is not an integer >= 0 (or caps are unavailable:
    ``caps_unavailable`` says why)."""
    if not isinstance(body, dict):
        return
    for field in OBJECT_FIELDS:
        value = body.get(field)
        if value is not None and not isinstance(value, dict):
            raise Refusal(400, "invalid", f"'{field}' must be an object or null, not {type(value).__name__}",
                          param=field)
    try:
        cap = draft_caps.requested_cap(body)
    except ValueError as exc:
        raise Refusal(400, "invalid", str(exc), param=draft_caps.PARAM) from None
    if cap is not None and caps_unavailable:
        raise Refusal(400, "invalid", f"'{draft_caps.PARAM}' is not available on this server: {caps_unavailable}",
                      param=draft_caps.PARAM)


def check_bounds(body: Any, limits: LimitsSettings) -> None:
    """Raise a Refusal naming the field and the limit when `body` asks for more than allowed.

    Only well-typed values are judged here; anything malformed is left to vLLM's own
    validation, which answers 400 in the same shape.
    """
    if not isinstance(body, dict):
        return

    def over(field: str, value: int | None, limit: int | None, setting: str) -> None:
        if value is not None and limit is not None and value > limit:
            raise Refusal(400, "limit", f"'{field}' is {value}; this server allows at most {limit} "
                                        f"(limits.{setting})", param=field)

    over("n", _int(body.get("n")), limits.max_n, "max_n")
    over("best_of", _int(body.get("best_of")), limits.max_n, "max_n")
    for field in ("max_tokens", "max_completion_tokens"):
        over(field, _int(body.get(field)), limits.max_tokens, "max_tokens")
    stop = body.get("stop")
    if isinstance(stop, list):
        over("stop", len(stop), limits.max_stop_sequences, "max_stop_sequences")
    over("top_logprobs", _int(body.get("top_logprobs")), limits.max_top_logprobs, "max_top_logprobs")
    # completions: `logprobs` is a count (chat's is a bool, which _int ignores)
    over("logprobs", _int(body.get("logprobs")), limits.max_top_logprobs, "max_top_logprobs")
    over("prompt_logprobs", _int(body.get("prompt_logprobs")), limits.max_top_logprobs, "max_top_logprobs")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and not all(_int(t) is not None for t in prompt):
        over("prompt", len(prompt), limits.max_prompts, "max_prompts")  # a batch of prompts, not one token list


class AdmissionMiddleware:
    def __init__(self, app: ASGIApp, lifecycle: Lifecycle, limits: LimitsSettings,
                 metrics: DynamoSpecMetrics | None, tenant_caps: draft_caps.TenantDraftCaps | None = None,
                 caps_unavailable: str | None = None, dry: DryFields | None = None, trees: Any = None):
        self.app = app
        self.trees = trees  # suffix_trees.TreeNames: each request's suffix tree, or None (the mix off)
        self.dry = dry
        self.lifecycle = lifecycle
        self.limits = limits
        self.metrics = metrics
        self.tenant_caps = tenant_caps
        self.caps_unavailable = caps_unavailable

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1"):
            await self.app(scope, receive, send)
            return
        generation = scope["path"] in GENERATION_ROUTES and scope["method"] == "POST"
        try:
            self._admit(generation)
            if generation:
                body = await self._read_body(scope, receive)
                parsed = parse_body(body, self.limits.max_json_depth)
                check_types(parsed, self.caps_unavailable)
                check_bounds(parsed, self.limits)
                merged = self._with_dry(parsed)
                if self.tenant_caps is not None:
                    merged = self.tenant_caps.merged(merged or parsed, scope["headers"]) or merged
                if self.trees is not None:
                    merged = self.trees.merged(merged or parsed, scope["headers"]) or merged
                if merged is not None:
                    body = json.dumps(merged).encode()
                    scope = _with_content_length(scope, len(body))
                receive = _replay(body, receive)
        except Refusal as refusal:
            await self._refuse(refusal, scope, receive, send)
            return
        if not generation:
            await self.app(scope, receive, send)
            return
        self.lifecycle.started()
        try:
            await self._run_in_time(scope, receive, send)
        finally:
            self.lifecycle.finished()

    def _with_dry(self, parsed: Any) -> dict[str, Any] | None:
        if self.dry is None:
            return None
        try:
            return self.dry.rewritten(parsed)
        except DryFieldError as exc:
            raise Refusal(400, "invalid", str(exc), param=exc.param) from None

    def _admit(self, generation: bool) -> None:
        phase = self.lifecycle.phase
        if phase is Phase.LOADING:
            raise Refusal(503, "loading", "The model is still loading; retry shortly.")
        if phase is Phase.DRAINING:
            raise Refusal(503, "draining", "The server is shutting down; send the request to another replica.")
        if phase is Phase.DEAD:
            raise Refusal(503, "dead", "The engine is not running; the server is stopping.")
        limit = self.limits.max_in_flight
        if generation and limit is not None and self.lifecycle.in_flight >= limit:
            raise Refusal(429, "overloaded", f"The server is at its limit of {limit} requests in flight "
                                             "(limits.max_in_flight); retry shortly.")

    async def _read_body(self, scope: Scope, receive: Receive) -> bytes:
        limit = self.limits.max_body_bytes
        too_large = Refusal(413, "body_too_large", f"The request body is larger than {limit} bytes "
                                                   "(limits.max_body_bytes).")
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            raise too_large
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                break  # the client went away; the app sees an empty body and the disconnect
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise too_large
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        return b"".join(chunks)

    async def _refuse(self, refusal: Refusal, scope: Scope, receive: Receive, send: Send) -> None:
        if self.metrics is not None:
            self.metrics.rejected.labels(refusal.reason).inc()
        headers = {"Retry-After": "1" if refusal.status == 429 else "5"} if refusal.reason in (
            "overloaded", "loading") else None
        type_ = {400: "BadRequestError", 413: "BadRequestError", 429: "RateLimitError"}.get(
            refusal.status, "ServiceUnavailableError")
        response = openai_error(refusal.status, refusal.message, type_, refusal.param, headers)
        await response(scope, receive, send)

    async def _run_in_time(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Run the request; past the timeout, tell the app the client has gone.

        vLLM aborts a request in the engine when its client disconnects (its handlers
        watch for ``http.disconnect``), but not when the task serving the request is
        cancelled (the handler runs in a task of its own). So at the deadline the app
        sees a disconnect, and the client gets the answer from here.
        """
        timeout = self.limits.request_timeout_seconds
        if timeout is None:
            await self.app(scope, receive, send)
            return
        deadline = asyncio.Event()
        started = False

        async def receive_until_deadline() -> Message:
            message = asyncio.ensure_future(receive())
            expired = asyncio.ensure_future(deadline.wait())
            try:
                await asyncio.wait({message, expired}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for task in (message, expired):
                    if not task.done():
                        task.cancel()
            return message.result() if message.done() and not message.cancelled() else {"type": "http.disconnect"}

        async def send_until_deadline(message: Message) -> None:
            nonlocal started
            if deadline.is_set():
                return  # the answer now comes from here
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        app = asyncio.ensure_future(self.app(scope, receive_until_deadline, send_until_deadline))
        try:
            done, _ = await asyncio.wait({app}, timeout=timeout)
            if done:
                app.result()
                return
            deadline.set()
            with contextlib.suppress(Exception):  # the request is being given up either way
                await asyncio.wait_for(app, ABORT_WAIT_SECONDS)
        except asyncio.CancelledError:
            app.cancel()
            raise
        if self.metrics is not None:
            self.metrics.timeouts.inc()
        message = f"The request ran past {timeout:g} s (limits.request_timeout_seconds) and was aborted."
        logger.warning("%s %s: %s", scope["method"], scope["path"], message)
        if not started:
            await openai_error(504, message, "TimeoutError")(scope, receive, send)
        else:  # streaming: end the stream with an error event, as vLLM does for errors mid-stream
            error = {"error": {"message": message, "type": "TimeoutError", "param": None, "code": 504}}
            event = {"type": "http.response.body", "body": f"data: {json.dumps(error)}\n\n".encode(),
                     "more_body": False}
            try:
                await asyncio.wait_for(send(event), FINAL_SEND_SECONDS)
            except asyncio.TimeoutError:
                logger.warning("%s %s: the client takes the stream too slowly; closing its connection",
                               scope["method"], scope["path"])
                raise SlowReaderClosed(message) from None


def _with_content_length(scope: Scope, length: int) -> Scope:
    """The scope with its content-length header set to ``length`` (the body was rewritten)."""
    headers = [(k, v) for k, v in scope["headers"] if k != b"content-length"]
    return {**scope, "headers": [*headers, (b"content-length", str(length).encode())]}


def _replay(body: bytes, receive: Receive) -> Receive:
    """A receive that hands the already-read body to the app, then passes through (disconnects)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
