"""Patch: how many draft tokens each request may have verified in a step (draft admission).

Upstream (vLLM's v1 scheduler): every request of a step gets the same number of draft
tokens, the step's k.

- ``Scheduler.schedule`` sets ``SchedulerOutput.num_spec_tokens_to_schedule``, the k the
  worker drafts after this step for every request in it: ``num_speculative_tokens``, or
  the batch-size schedule's k (``Scheduler.dynamic_sd_lookup``).
- Synchronous scheduling (the only kind on CPU): ``EngineCore.post_step`` takes the
  drafts from the worker and hands them to ``Scheduler.update_draft_token_ids``, which
  keeps all of them (less what a grammar rejects) as ``Request.spec_token_ids``; the next
  ``schedule`` trims them only to the token budget.
- Asynchronous scheduling: ``AsyncScheduler._update_after_schedule`` gives each
  scheduled request k placeholder draft tokens (``Request.spec_token_ids``); the worker
  fills them with its own drafts and ``update_draft_token_ids`` is not called. Fewer
  placeholders than the worker drafted are fine: the runner takes the first ones.

Change: each request's draft tokens are capped at the smallest of its caps (no cap: as
vLLM drafts them). A cap source is a function ``(request, step) -> int | None``
(:data:`CapSource`, ``None``: no cap); the sources are built once per scheduler by
:func:`build_cap_sources`. The one source so far is the request's own
``SamplingParams.extra_args["max_draft_tokens"]`` (vLLM's OpenAI layer copies a
request's ``vllm_xargs`` there; the server merges the tenant's default in), then, where
the engine's switches configure one (``speculation_guard.GUARD_KEY``), the speculation
guard's engine-wide cap (0 while acceptance has collapsed). Last, where they configure
one (``draft_budget.BUDGET_KEY``) and the drafts came with confidences
(``draft_confidence``), the confidence draft budget (:mod:`.draft_budget`) ranks the
draft tokens the other caps leave across the whole step and cuts each request's drafts
to those worth verifying; it learns from every verified draft (4.). The switches are
those of the scheduler's own engine (``vllm_patches.switches_of(scheduler.vllm_config)``),
read once per scheduler: two engines in one process each keep theirs.

1. ``Scheduler._update_after_schedule`` (inside ``schedule``, before the async
   scheduler sets its placeholders): the step's k is lowered to the largest cap among
   the scheduled requests that will draft (those not part-way through their prompt);
   unchanged where one of them has no cap. A step in which none of them wants drafts is
   then a k=0 step: ``zero_draft_steps`` takes its cheap path (the KV-only draft pass,
   no round trip to the worker, the plain sampler in the next step), and the worker
   never drafts more than a request may use.
2. ``Scheduler.update_draft_token_ids``: each request's drafts are cut to its cap, then
   to what the confidence budget admits, before vLLM stores them.
3. ``AsyncScheduler._update_after_schedule``: each request's placeholders are cut to
   its cap.
4. ``Scheduler.make_spec_decoding_stats`` (called once per request whose drafts were
   verified in a step, with the drafted and accepted counts): the counts also go to the
   guard and the draft's confidences with its verdict to the confidence budget, whatever
   ``log_stats`` says; where the drafts came with confidences
   (``draft_confidence``) and the engine's switches name a file (:data:`CONFIDENCE_LOG_KEY`),
   one JSON line per verified draft: the confidences of the tokens verified and how many
   were accepted (``eval-draft --calibration`` reads them).
5. ``EngineCore.dynamo_spec_guard(state="")``: a utility method (the API process calls
   it with ``call_utility_async``): the guard's state and figures, after forcing
   ``state`` if one is given; None without a guard. ``EngineCore.dynamo_spec_draft_budget()``:
   the confidence budget's counts (offered, admitted, explored, verified) and calibration; None without one.

The confidence budget needs ``update_draft_token_ids``: with asynchronous scheduling
(where the worker fills placeholders itself) it is not consulted, and the settings refuse
the combination.

A request whose cap is 0 is then verified as without speculation: its per-request stats
(``metrics.speculative_decoding``) show no drafts, while the others in the same batch
draft as before; greedy output is the same.

Not covered: a new request whose prompt is all in the prefix cache but its last token,
in an engine without a batch-size schedule, is padded by vLLM with k placeholder drafts
in its first decode step (``Scheduler.schedule``'s ``pad_spec_decode``); those are
verified and counted, whatever its cap.

Checked on vLLM 0.32.0 (``CHECKED_ON``). Goes away when vLLM takes a per-request draft
limit itself (a per-request switch was proposed upstream and closed, PR #55412) and lets
a plugin add engine-wide caps at the same place.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from dynamo_spec.vllm_patches import switches_of
from dynamo_spec.vllm_patches._upstream import checked, wrap_method
from dynamo_spec.vllm_patches.draft_budget import BudgetConfig, DraftBudget
from dynamo_spec.vllm_patches.draft_confidence import confidences_of

CHECKED_ON = ("0.32.0",)
# The upstream methods this patch wraps, with the parameters it was written for.
UPSTREAM_SIGNATURES = {
    "vllm.v1.core.sched.scheduler:Scheduler.update_draft_token_ids": "(self, draft_token_ids)",
    "vllm.v1.core.sched.scheduler:Scheduler._update_after_schedule": "(self, scheduler_output)",
    "vllm.v1.core.sched.async_scheduler:AsyncScheduler._update_after_schedule": "(self, scheduler_output)",
    "vllm.v1.core.sched.scheduler:Scheduler.make_spec_decoding_stats":
        "(self, spec_decoding_stats, num_draft_tokens, num_accepted_tokens, num_invalid_spec_tokens, request_id)",
    "vllm.v1.engine.core:EngineCoreProc._handle_client_request": "(self, request_type, request)",
}
# The EngineCore utility methods this patch adds (the API process's names for them).
GUARD_UTILITY = "dynamo_spec_guard"
BUDGET_UTILITY = "dynamo_spec_draft_budget"

# The request field (in ``vllm_xargs``, i.e. ``SamplingParams.extra_args``).
MAX_DRAFT_TOKENS = "max_draft_tokens"

_PATCHED_ATTR = "_dynamo_spec_draft_admission"
_SOURCES_ATTR = "_dynamo_spec_cap_sources"
_GUARD_ATTR = "_dynamo_spec_guard"
_BUDGET_ATTR = "_dynamo_spec_draft_budget"
_CONFIDENCE_ATTR = "_dynamo_spec_draft_confidence"  # on a Request: its stored drafts' confidences
_LOG_ATTR = "_dynamo_spec_confidence_log"
# In the engine's switches, a file: each verified draft with confidences is appended to it as
# {"confidence": [...], "accepted": n}.
CONFIDENCE_LOG_KEY = "confidence_log"


@dataclass(frozen=True, slots=True)
class StepContext:
    """What a cap source may know about the step besides the request."""

    num_requests: int  # requests scheduled in the step
    k: int  # draft tokens per request the step drafts, before any cap


# (request, step) -> the most draft tokens the request may have, or None (no cap).
CapSource = Callable[[Any, StepContext], "int | None"]


def request_cap(request: Any, step: StepContext) -> int | None:
    """The request's own ``max_draft_tokens`` (a non-negative int; anything else: no cap,
    the server refuses it with a 400 before it gets here)."""
    params = getattr(request, "sampling_params", None)
    extra = params.extra_args if params is not None else None
    if not extra:
        return None
    value = extra.get(MAX_DRAFT_TOKENS)
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    return None


def build_cap_sources(scheduler: Any) -> tuple[CapSource, ...]:
    """The cap sources of this scheduler's engine, from its switches. Engine-wide caps that keep
    state (the guard's trailing window, a confidence budget) are built here, one set per scheduler."""
    from dynamo_spec.vllm_patches.speculation_guard import GuardConfig, SpeculationGuard

    switches = switches_of(getattr(scheduler, "vllm_config", None))
    sources: list[CapSource] = [request_cap]
    config = GuardConfig.from_switches(switches)
    if config is not None and getattr(scheduler, "num_spec_tokens", 0):
        guard = scheduler.__dict__[_GUARD_ATTR] = SpeculationGuard(config)
        sources.append(guard.cap)
    budget = BudgetConfig.from_switches(switches)
    if budget is not None and getattr(scheduler, "num_spec_tokens", 0):
        scheduler.__dict__[_BUDGET_ATTR] = DraftBudget(budget)
    return tuple(sources)


def draft_cap(request: Any, step: StepContext, sources: Iterable[CapSource]) -> int | None:
    """The smallest cap the sources give the request; None when none caps it."""
    cap = None
    for source in sources:
        value = source(request, step)
        if value is not None and (cap is None or value < cap):
            cap = value
    return cap


def admitted_k(requests: Iterable[Any], step: StepContext, sources: Sequence[CapSource]) -> int:
    """The step's k lowered to the largest cap among ``requests`` (the step's k where one
    has no cap, or where there are none)."""
    largest = None
    for request in requests:
        cap = draft_cap(request, step, sources)
        if cap is None or cap >= step.k:
            return step.k
        largest = cap if largest is None else max(largest, cap)
    return step.k if largest is None else largest


def _sources(scheduler: Any) -> tuple[CapSource, ...]:
    sources = scheduler.__dict__.get(_SOURCES_ATTR)
    if sources is None:
        sources = scheduler.__dict__[_SOURCES_ATTR] = build_cap_sources(scheduler)
    return sources


def guard_of(scheduler: Any):
    """The scheduler's speculation guard, or None."""
    _sources(scheduler)
    return scheduler.__dict__.get(_GUARD_ATTR)


def budget_of(scheduler: Any) -> DraftBudget | None:
    """The scheduler's confidence draft budget, or None."""
    _sources(scheduler)
    return scheduler.__dict__.get(_BUDGET_ATTR)


def _confidence_log(scheduler: Any):
    """The scheduler's open confidence log (line-buffered), or None where its engine asks for none."""
    if _LOG_ATTR not in scheduler.__dict__:
        path = switches_of(getattr(scheduler, "vllm_config", None)).get(CONFIDENCE_LOG_KEY)
        scheduler.__dict__[_LOG_ATTR] = open(path, "a", buffering=1) if path else None  # noqa: SIM115
    return scheduler.__dict__[_LOG_ATTR]


def _observed(original):
    @functools.wraps(original)
    def make_spec_decoding_stats(self, spec_decoding_stats, num_draft_tokens, num_accepted_tokens,
                                 num_invalid_spec_tokens, request_id):
        guard = guard_of(self)
        invalid = num_invalid_spec_tokens.get(request_id, 0) if num_invalid_spec_tokens else 0
        if guard is not None:
            guard.observe(num_draft_tokens - invalid, num_accepted_tokens)
        request = self.requests.get(request_id)
        confidence = getattr(request, _CONFIDENCE_ATTR, None)
        if confidence and num_draft_tokens and not invalid and (budget := budget_of(self)) is not None:
            budget.observe(confidence[:num_draft_tokens], num_accepted_tokens)
        if confidence and num_draft_tokens and not invalid and (log := _confidence_log(self)) is not None:
            log.write(json.dumps({"confidence": [round(c, 5) for c in confidence[:num_draft_tokens]],
                                  "accepted": num_accepted_tokens}) + "\n")
        return original(self, spec_decoding_stats, num_draft_tokens, num_accepted_tokens,
                        num_invalid_spec_tokens, request_id)

    setattr(make_spec_decoding_stats, _PATCHED_ATTR, True)
    return make_spec_decoding_stats


def _guard_utility(self, state: str = "") -> dict | None:
    """EngineCore utility: the guard's snapshot (after forcing ``state`` when given)."""
    guard = guard_of(self.scheduler)
    if guard is None:
        return None
    return guard.force(state) if state else guard.snapshot()


def _budget_utility(self) -> dict | None:
    """EngineCore utility: the confidence budget's counts and calibration; None without one."""
    budget = budget_of(self.scheduler)
    return None if budget is None else budget.snapshot()


def _update_draft_token_ids_capped(original):
    @functools.wraps(original)
    def update_draft_token_ids(self, draft_token_ids) -> None:
        lists = draft_token_ids.draft_token_ids
        confidences = confidences_of(draft_token_ids) or [None] * len(lists)
        step = StepContext(num_requests=len(lists), k=max((len(ids) for ids in lists), default=0))
        if step.k:
            sources = _sources(self)
            capped, live = [], []
            for i, (req_id, ids, confidence) in enumerate(zip(draft_token_ids.req_ids, lists, confidences)):
                request = self.requests.get(req_id)
                cap = draft_cap(request, step, sources) if request is not None else None
                capped.append(ids[:cap] if cap is not None and cap < len(ids) else ids)
                if request is not None and confidence is not None:
                    setattr(request, _CONFIDENCE_ATTR, confidence)
                if request is not None and not request.is_finished() and not request.is_prefill_chunk:
                    live.append(i)  # the requests whose drafts vLLM keeps
            budget = budget_of(self)
            if budget is not None and live and all(confidences[i] is not None for i in live):
                kept = budget.admit([confidences[i][:len(capped[i])] for i in live])
                for i, n in zip(live, kept):
                    capped[i] = capped[i][:n]
            draft_token_ids = type(draft_token_ids)(draft_token_ids.req_ids, capped)
        return original(self, draft_token_ids)

    setattr(update_draft_token_ids, _PATCHED_ATTR, True)
    return update_draft_token_ids


def _update_after_schedule_admitting_k(original):
    @functools.wraps(original)
    def _update_after_schedule(self, scheduler_output) -> None:
        original(self, scheduler_output)
        k = scheduler_output.num_spec_tokens_to_schedule
        scheduled = scheduler_output.num_scheduled_tokens
        if k <= 0 or not scheduled:
            return
        drafting = [r for r in map(self.requests.get, scheduled) if r is not None and not r.is_prefill_chunk]
        step = StepContext(num_requests=len(scheduled), k=k)
        scheduler_output.num_spec_tokens_to_schedule = admitted_k(drafting, step, _sources(self))

    setattr(_update_after_schedule, _PATCHED_ATTR, True)
    return _update_after_schedule


def _async_placeholders_capped(original):
    @functools.wraps(original)
    def _update_after_schedule(self, scheduler_output) -> None:
        original(self, scheduler_output)
        k = scheduler_output.num_spec_tokens_to_schedule
        if k <= 0:
            return
        step = StepContext(num_requests=len(scheduler_output.num_scheduled_tokens), k=k)
        sources = _sources(self)
        for req_id in scheduler_output.num_scheduled_tokens:
            request = self.requests[req_id]
            if request.is_prefill_chunk:
                continue
            cap = draft_cap(request, step, sources)
            if cap is not None and cap < len(request.spec_token_ids):
                request.spec_token_ids = request.spec_token_ids[:cap]

    setattr(_update_after_schedule, _PATCHED_ATTR, True)
    return _update_after_schedule


def _patch(owner: type, name: str, wrapper) -> bool:
    return wrap_method(owner, name, wrapper, _PATCHED_ATTR)


def apply() -> list[str]:
    """Install the caps in this process (idempotent); return what was patched."""
    if not checked(__name__, CHECKED_ON):
        return []
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine.core import EngineCore

    patched = []
    if _patch(Scheduler, "update_draft_token_ids", _update_draft_token_ids_capped):
        patched.append("Scheduler.update_draft_token_ids")
    if _patch(Scheduler, "_update_after_schedule", _update_after_schedule_admitting_k):
        patched.append("Scheduler._update_after_schedule")
    if _patch(AsyncScheduler, "_update_after_schedule", _async_placeholders_capped):
        patched.append("AsyncScheduler._update_after_schedule")
    if _patch(Scheduler, "make_spec_decoding_stats", _observed):
        patched.append("Scheduler.make_spec_decoding_stats")
    if GUARD_UTILITY not in EngineCore.__dict__:
        EngineCore.dynamo_spec_guard = _guard_utility
        patched.append(f"EngineCore.{GUARD_UTILITY}")
    if BUDGET_UTILITY not in EngineCore.__dict__:
        EngineCore.dynamo_spec_draft_budget = _budget_utility
        patched.append(f"EngineCore.{BUDGET_UTILITY}")
    return patched
