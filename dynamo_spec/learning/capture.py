"""Capture (opt-in, ``learning.capture``): one row per finished chat or completions request.

The pieces, all built by :func:`attach` only when capture is on (off, the app has none of them
and nothing is created on disk):

- :class:`CaptureMiddleware` notes each ``/v1/chat/completions`` and ``/v1/completions``
  request's endpoint and tenant (the raw value of ``metrics.tenant_header``);
- :class:`CapturingEngineClient` sits in front of the engine client vLLM's serving layer calls
  and, when a request of a captured tenant finishes, hands its rows to :class:`Capture`;
- :class:`Capture` buffers the rows and writes them from its own thread every
  :data:`FLUSH_SECONDS` into :class:`~dynamo_spec.learning.captures.CaptureStore` (the event
  loop never touches the disk).

A row per finished choice (n > 1 gives n rows): token ids, the sampling that produced them,
tenant, time, endpoint and the choice's own speculative acceptance (vLLM's per-request
metrics, ``engine.per_request_spec_decode_metrics``). A choice that was aborted (client
disconnect) or failed is not captured; neither are beam search's internal requests. Nothing
of a row is logged.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import contextvars
import logging
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from starlette.types import ASGIApp, Receive, Scope, Send

from dynamo_spec.learning.captures import CaptureStore, CaptureTargetMismatch

logger = logging.getLogger(__name__)

FLUSH_SECONDS = 1.0
ENFORCE_SECONDS = 60.0  # caps and retention also apply while no row arrives
MAX_PENDING = 10_000  # rows buffered while the disk lags; more are dropped (and counted in the log)
CAPTURED_FINISH = frozenset({"stop", "length"})  # not "abort" (client gone) nor "error"
ENDPOINTS = (("/v1/chat/completions", "chat"), ("/v1/completions", "completions"))
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                   "repetition_penalty", "seed", "max_tokens", "extra_args")


@dataclass(frozen=True)
class RequestContext:
    endpoint: str
    tenant: str | None


request_context: contextvars.ContextVar[RequestContext | None] = contextvars.ContextVar(
    "dynamo_spec_capture_request", default=None)


# ------------------------------------------------------------------ rows


def sampling_of(params: Any) -> dict:
    """The SamplingParams fields that shaped an answer."""
    out = {name: getattr(params, name, None) for name in SAMPLING_FIELDS}
    if out["extra_args"] is not None:
        out["extra_args"] = dict(out["extra_args"])
    return out


def acceptance_of(completion: Any) -> dict | None:
    """A choice's speculative acceptance (vLLM's per-request metrics, as metering reads them); None
    without speculation or with ``engine.per_request_spec_decode_metrics: none``."""
    spec = getattr(completion, "spec_decode_metrics", None)
    if spec is None:
        return None
    d = spec.to_dict()
    return {"drafted": d["num_draft_tokens"], "accepted": d["num_accepted_draft_tokens"], "steps": d["num_spec_steps"]}


def make_row(*, row_id: str, context: RequestContext, when: float, prompt_ids: list[int], answer_ids: list[int],
             sampling: dict, finish_reason: str, acceptance: dict | None) -> dict:
    """One capture row: a ``data/`` round row (id, source, round, temperature, prompt_ids,
    answer_ids) plus what the capture knows about the request."""
    return {
        "id": row_id, "source": "capture", "round": None, "temperature": float(sampling["temperature"] or 0.0),
        "tenant": context.tenant, "time": when, "endpoint": context.endpoint,
        "prompt_ids": prompt_ids, "answer_ids": answer_ids, "sampling": sampling,
        "finish_reason": finish_reason, "acceptance": acceptance,
    }


# ------------------------------------------------------------------ the buffer and its writer


class Capture:
    """Buffers finished requests' rows (event loop: `record`, cheap) and writes them on a thread."""

    def __init__(self, store: CaptureStore, tenants: list[str] | None, flush_seconds: float = FLUSH_SECONDS):
        self.store = store
        self.tenants = frozenset(tenants) if tenants is not None else None
        self.flush_seconds = flush_seconds
        self._pending: collections.deque[dict] = collections.deque()
        self._dropped = 0
        self._flush_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._refused: str | None = None  # why rows are not written (captures of another target)
        self._last_enforce = 0.0
        self.answer_tokens = 0  # answer tokens written since the start (learning.auto's count, auto.py)

    @classmethod
    def from_settings(cls, settings: Any) -> Capture | None:
        """The capture of ``settings.learning``; None when ``learning.capture`` is off."""
        learning = settings.learning
        if not learning.capture:
            return None
        model = settings.engine.model
        store = CaptureStore(learning.dir, max_bytes=int(learning.max_bytes), retention_days=learning.retention_days,
                             target=lambda: served_target(model))
        return cls(store, learning.tenants)

    def wants(self, tenant: str | None) -> bool:
        return self.tenants is None or tenant in self.tenants

    def record(self, row: dict) -> None:
        if len(self._pending) >= MAX_PENDING:
            self._dropped += 1
            return
        self._pending.append(row)

    # ---------------------------------------------------------------- the writer thread

    def start(self) -> None:
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="dynamo-spec-capture", daemon=True)
            self._thread.start()

    def close(self) -> None:
        """Stop the thread, write what is buffered, close the open file."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self.flush()
        self.store.close()

    def _run(self) -> None:
        while not self._stop.wait(self.flush_seconds):
            self.flush()

    def flush(self) -> None:
        """Write the buffered rows; apply the caps at least every ENFORCE_SECONDS."""
        with self._flush_lock:
            rows = []
            while self._pending:
                rows.append(self._pending.popleft())
            if self._dropped:
                logger.warning("Capture: %d row(s) dropped, the disk did not keep up", self._dropped)
                self._dropped = 0
            try:
                if rows:
                    self.store.append(rows)
                    self.answer_tokens += sum(len(r["answer_ids"]) for r in rows)
                    if self._refused:
                        logger.info("Capture: writing rows again")
                    self._refused = None
                    self._last_enforce = time.monotonic()
                elif time.monotonic() - self._last_enforce >= ENFORCE_SECONDS:
                    self.store.enforce()
                    self._last_enforce = time.monotonic()
            except CaptureTargetMismatch as exc:
                if self._refused is None:
                    logger.error("Capture: rows are not written: %s", exc)
                self._refused = str(exc)
            except OSError as exc:
                logger.error("Capture: %d row(s) lost: %s", len(rows), exc)

    def erase(self) -> dict:
        """Erase every capture, buffered rows included; what was erased."""
        with self._flush_lock:
            pending = len(self._pending)
            self._pending.clear()
            erased = self.store.erase()
        erased["rows"] += pending
        return erased


def served_target(model: str) -> dict:
    """The served target as ``data/`` rounds name it (``corpus.target_checksum``); a Hugging Face
    id is looked up in the local cache. Without weights at hand the checksum is None (and
    ``learn-draft`` refuses the captures)."""
    from dynamo_spec.training.corpus import target_checksum

    path = Path(model)
    name = path.resolve().name if path.is_dir() else model.rstrip("/").rsplit("/", 1)[-1]
    try:
        if not path.is_dir():
            from huggingface_hub import snapshot_download

            path = Path(snapshot_download(model, local_files_only=True))
        return {"name": name, "checksum": target_checksum(path)}
    except Exception as exc:  # no local copy, no weights: the rows are still kept
        logger.warning("Capture: no checksum of the target %s (%s): learn-draft cannot use these captures",
                       model, type(exc).__name__)
        return {"name": name, "checksum": None}


# ------------------------------------------------------------------ the request path


class CaptureMiddleware:
    """Notes a chat or completions request's endpoint and tenant for :class:`CapturingEngineClient`."""

    def __init__(self, app: ASGIApp, tenant_header: str | None):
        self.app = app
        self.tenant_header = tenant_header.lower().encode() if tenant_header else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        endpoint = next((name for prefix, name in ENDPOINTS if scope["path"].startswith(prefix)), None)
        if endpoint is None:
            await self.app(scope, receive, send)
            return
        tenant = None
        if self.tenant_header:
            tenant = next((v.decode("latin-1") for k, v in scope["headers"] if k == self.tenant_header), None)
        token = request_context.set(RequestContext(endpoint, tenant))
        try:
            await self.app(scope, receive, send)
        finally:
            request_context.reset(token)


class CapturingEngineClient:
    """Delegates to the engine client; records each finished request of a captured tenant."""

    def __init__(self, engine: Any, capture: Capture):
        self._engine = engine
        self._capture = capture

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    async def generate(self, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        context = request_context.get()
        params = args[1] if len(args) > 1 else kwargs.get("sampling_params")
        request_id = args[2] if len(args) > 2 else kwargs.get("request_id", "")
        if context is None or not self._capture.wants(context.tenant) or "-beam-" in str(request_id):
            async for output in self._engine.generate(*args, **kwargs):
                yield output
            return
        from vllm.sampling_params import RequestOutputKind

        delta = getattr(params, "output_kind", None) is RequestOutputKind.DELTA
        answers: dict[int, list[int]] = {}
        ends: dict[int, Any] = {}  # index -> the choice's last output (finish reason, acceptance)
        prompt_ids = None
        async for output in self._engine.generate(*args, **kwargs):
            if prompt_ids is None:
                prompt_ids = output.prompt_token_ids
            for o in output.outputs:
                if delta:
                    answers.setdefault(o.index, []).extend(o.token_ids)
                else:
                    answers[o.index] = o.token_ids
                if o.finish_reason is not None:
                    ends[o.index] = o
            if output.finished:
                self._finished(context, str(request_id), params, prompt_ids, answers, ends)
            yield output

    def _finished(self, context: RequestContext, request_id: str, params: Any, prompt_ids: Any,
                  answers: dict[int, list[int]], ends: dict[int, Any]) -> None:
        if prompt_ids is None:
            return
        now = time.time()
        sampling = sampling_of(params)
        prompt = list(prompt_ids)
        for index, end in sorted(ends.items()):
            if end.finish_reason not in CAPTURED_FINISH:
                continue
            self._capture.record(make_row(
                row_id=request_id if len(answers) == 1 else f"{request_id}/{index}", context=context, when=now,
                prompt_ids=prompt, answer_ids=list(answers.get(index, ())), sampling=sampling,
                finish_reason=end.finish_reason, acceptance=acceptance_of(end)))


# ------------------------------------------------------------------ wiring


def attach(app: Any, settings: Any) -> Capture | None:
    """Give the app the capture of ``settings.learning`` (``app.state.capture``) and its admin
    route; with capture on, also the middleware and the writer thread (started and stopped
    with the app). Off: only the route (which can still erase captures kept earlier)."""
    from dynamo_spec.learning import capture_admin

    capture = Capture.from_settings(settings)
    app.state.capture = capture
    app.include_router(capture_admin.router(settings.learning.dir, capture))
    if capture is not None:
        app.add_middleware(CaptureMiddleware, tenant_header=settings.metrics.tenant_header)
    return capture


def capturing(client: Any, capture: Capture | None) -> Any:
    """The engine client vLLM's serving layer should call: ``client`` itself when capture is off."""
    return client if capture is None else CapturingEngineClient(client, capture)


@contextlib.asynccontextmanager
async def running(capture: Capture | None) -> AsyncIterator[None]:
    """The writer thread for the app's lifetime; at shutdown the last rows are written."""
    if capture is None:
        yield
        return
    capture.start()
    try:
        yield
    finally:
        await asyncio.to_thread(capture.close)
