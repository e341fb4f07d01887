"""Patch: suffix-tree drafts from the served answers, mixed with the EAGLE-3 draft per request and step.

Upstream (vLLM's V1 model runner): one runner has one drafter (``GPUModelRunner.drafter``), built
from ``speculative_config.method``: ``suffix`` (``SuffixDecodingProposer``, over
``arctic_inference``'s ``SuffixDecodingCache``) or ``eagle3`` (``EagleProposer``), never both.
``take_draft_token_ids`` hands the scheduler one list of draft tokens per request; the scheduler
keeps lists of any length (``Scheduler.update_draft_token_ids``; ``schedule`` trims them only to
the token budget) and the rejection sampler verifies ragged drafts (``SpecDecodeMetadata``).

Change, only in an engine whose switches configure it (:data:`SUFFIX_KEY`, from
``speculative.suffix``):

1. The engine is built with ``num_speculative_tokens`` = the larger of the EAGLE k and the tree's
   ``max_tokens`` (buffers, the rejection sampler, KV lookahead) and a batch-size schedule that
   never gives the EAGLE loop more than its own k (``engine/args.py``): the EAGLE-3 draft runs every
   step for every request as before, so its KV cache stays whole, and the next step's EAGLE pass
   takes the target's hidden states of however many tokens were accepted (vLLM's own padded
   drafter batch).
2. ``GPUModelRunner.take_draft_token_ids`` (after the step's bookkeeping): each request's text so
   far goes into its trees (:class:`Trees`: one ``SuffixDecodingCache`` per tree name, the tenant
   the server writes into ``vllm_xargs``, :data:`TREE_FIELD`, or one for all under scope
   ``global``); where the tree's draft for the request scores at least ``min_score`` (its expected
   number of accepted tokens), that draft (up to ``max_tokens``, and never past the model length)
   replaces the EAGLE draft; a step whose schedule gives the EAGLE draft a smaller k than its top
   one scales the tree's longest draft alike (``MixConfig.longest``: 16 at k=4, 4 at k=1), and in a
   step whose k is 0 nobody drafts. The ``DraftTokenIds`` carries
   each request's source (:data:`SOURCE_ATTR`) and, where the drafts carry confidences
   (``draft_confidence``), the tree's per-token probabilities in place of the draft's.
3. ``GPUModelRunner.execute_model`` (before vLLM drops the finished requests from its batch): the
   finished requests' last tokens go into the trees and their per-request trees are dropped; an
   aborted request's answer (``Scheduler.finish_requests`` with ``FINISHED_ABORTED``, carried on
   the ``SchedulerOutput`` as :data:`ABORTED_ATTR`) is evicted from its tenant's tree.
4. ``Scheduler.update_draft_token_ids`` notes each request's draft source;
   ``Scheduler.make_spec_decoding_stats`` counts drafted and accepted tokens and verify steps per
   source, engine-wide and per request (under the key the server writes into ``vllm_xargs``,
   :data:`REQUEST_KEY_FIELD`). ``EngineCore.dynamo_spec_suffix()`` (a utility method) returns the
   engine's counts, ``dynamo_spec_suffix_request(key)`` a request's (once).
5. ``dynamo_spec_suffix_clear`` / ``dynamo_spec_suffix_stats`` (worker extension methods, through
   ``collective_rpc``): empty every tree (the erase route), the trees' counts and own time.

The target verifies every draft token as before: greedy output is the same with the mix on or
off, and sampled output keeps its distribution (the rejection sampler is unchanged).

Nothing here writes to disk; the trees live in the worker's memory and go with the engine.

Model Runner V2 and asynchronous scheduling: refused (``engine/features.py``). V2 would need the
same hook where its runner turns the EAGLE output into the next step's drafts
(``v1/worker/gpu/spec_decode``), a ragged draft layout instead of its fixed ``[num_reqs, k]``
buffers, and the tree fed from ``req_states.all_token_ids``; asynchronous scheduling would need the
tree's draft before the next step is scheduled (it schedules k placeholders per request).

Checked on vLLM 0.32.0 (``CHECKED_ON``) with arctic-inference 0.3.0. Goes away when vLLM runs two
drafters in one runner (its n-gram + EAGLE pull request is open).
"""

from __future__ import annotations

import collections
import functools
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

from dynamo_spec.vllm_patches import switches_of
from dynamo_spec.vllm_patches._upstream import checked, wrap_method

CHECKED_ON = ("0.32.0",)
UPSTREAM_SIGNATURES = {
    "vllm.v1.worker.gpu_model_runner:GPUModelRunner.take_draft_token_ids": "(self)",
    "vllm.v1.worker.gpu_model_runner:GPUModelRunner.execute_model": "(self, scheduler_output, intermediate_tensors=None)",
    "vllm.v1.core.sched.scheduler:Scheduler.update_draft_token_ids": "(self, draft_token_ids)",
    "vllm.v1.core.sched.scheduler:Scheduler.make_spec_decoding_stats":
        "(self, spec_decoding_stats, num_draft_tokens, num_accepted_tokens, num_invalid_spec_tokens, request_id)",
    "vllm.v1.core.sched.scheduler:Scheduler.finish_requests": "(self, request_ids, finished_status)",
    "vllm.v1.core.sched.scheduler:Scheduler.schedule": "(self, throttle_prefills=False)",
}
# The engine's switch: the mix's settings (MixConfig.to_switch), or absent/None: off.
SUFFIX_KEY = "suffix"
# The request field (vllm_xargs, i.e. SamplingParams.extra_args) naming its tree; the server sets it
# from the tenant header (and overwrites a client's own).
TREE_FIELD = "dynamo_spec_suffix_tree"
# The request field the server sets to a key of its own: the request's per-source counts are kept
# under it for the server to fetch once the request is done (:data:`REQUEST_UTILITY`).
REQUEST_KEY_FIELD = "dynamo_spec_request"
DEFAULT_TREE = ""
NO_TREE = "\x00"  # a tenant past the server's bound: no shared tree, the EAGLE-3 draft alone
SOURCES = ("suffix", "draft")
SOURCE_ATTR = "draft_source"  # on DraftTokenIds: one source per request
ABORTED_ATTR = "dynamo_spec_aborted"  # on SchedulerOutput: requests aborted since the last step
UTILITY = "dynamo_spec_suffix"
REQUEST_UTILITY = "dynamo_spec_suffix_request"
KEPT_REQUESTS = 4096  # per-request counts kept for the server to fetch, the oldest dropped first
WORKER_CLEAR = "dynamo_spec_suffix_clear"
WORKER_STATS = "dynamo_spec_suffix_stats"

_PATCHED_ATTR = "_dynamo_spec_suffix_mix"
_TREES_ATTR = "_dynamo_spec_suffix_trees"  # on a model runner
_COUNTS_ATTR = "_dynamo_spec_suffix_counts"  # on a scheduler
_ABORTED_ATTR = "_dynamo_spec_suffix_aborted"  # on a scheduler
_SOURCE_REQ_ATTR = "_dynamo_spec_draft_source"  # on a Request
_SPLIT_ATTR = "_dynamo_spec_suffix_split"  # on a scheduler: request key -> per-source counts


# A cached answer's memory in a tree, per token: measured by benchmarks/suffix_tree_cost.py (10,000
# answers of the target's own corpus, 159 tokens on average: 342 MB, 215 bytes a token; AMD EPYC Zen 4).
BYTES_PER_ANSWER_TOKEN = 215


def memory_bound(max_cached_requests: int, trees: int, longest_answer: int, typical_answer: int = 160) -> str:
    """The trees' memory, in words: ``trees`` full trees of answers of ``typical_answer`` tokens, and at
    most (every answer ``longest_answer`` tokens long)."""
    answers = trees * max_cached_requests

    def mib(tokens: int) -> str:
        return f"{answers * tokens * BYTES_PER_ANSWER_TOKEN / 2**20:,.0f} MiB"

    return (f"memory: {trees} tree(s) x {max_cached_requests} answers, ~{mib(typical_answer)} at {typical_answer} "
            f"tokens an answer, at most {mib(longest_answer)} ({BYTES_PER_ANSWER_TOKEN} B a token, measured)")


@dataclass(frozen=True)
class MixConfig:
    max_tokens: int = 16
    min_score: float = 2.0
    max_cached_requests: int = 2000
    scope: str = "tenant"
    include_prompt: bool = True
    draft_k: int = 0  # the EAGLE draft's own k (the schedule's top); 0: the tree's drafts are not scaled

    def longest(self, k_step: int) -> int:
        """The tree's longest draft in a step whose EAGLE k is ``k_step``: ``max_tokens`` scaled as the
        batch-size schedule scales k (where verifying costs more, shorter drafts), none at k=0."""
        if k_step <= 0:
            return 0
        if not self.draft_k or k_step >= self.draft_k:
            return self.max_tokens
        return max(k_step, -(-self.max_tokens * k_step // self.draft_k))

    def to_switch(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_switches(cls, switches: Any) -> MixConfig | None:
        value = switches.get(SUFFIX_KEY) if switches else None
        return cls(**value) if isinstance(value, dict) else None


def config_of(owner: Any) -> MixConfig | None:
    """The mix's settings of ``owner``'s engine (a runner or scheduler), or None where it is off."""
    return MixConfig.from_switches(switches_of(getattr(owner, "vllm_config", None)))


class Trees:
    """One engine's suffix trees: a ``SuffixDecodingCache`` per tree name (its global tree holds
    that tenant's answers, oldest evicted first past ``max_cached_requests``; its per-request trees
    hold each running request's prompt and answer so far)."""

    def __init__(self, config: MixConfig, *, max_model_len: int, max_tree_depth: int = 24,
                 max_spec_factor: float = 1.0, min_token_prob: float = 0.1):
        self.config = config
        self.max_model_len = max_model_len
        self.max_tree_depth = max_tree_depth
        self.max_spec_factor = max_spec_factor
        self.min_token_prob = min_token_prob
        self.caches: dict[str, Any] = {}
        self.active: dict[str, list] = {}  # req_id -> [tree name, tokens fed]
        self.excluded: set[str] = set()  # in flight at an erase: never drafted by nor added to a tree
        self.aborted: set[str] = set()
        self.seconds = 0.0  # the trees' own time (feeding, matching), for the step-cost benchmark
        self.calls = 0

    @classmethod
    def for_runner(cls, runner: Any) -> Trees | None:
        trees = runner.__dict__.get(_TREES_ATTR, False)
        if trees is False:
            config = config_of(runner)
            trees = None
            if config is not None:
                spec = runner.vllm_config.speculative_config
                trees = cls(config, max_model_len=runner.vllm_config.model_config.max_model_len,
                            max_tree_depth=spec.suffix_decoding_max_tree_depth,
                            max_spec_factor=spec.suffix_decoding_max_spec_factor,
                            min_token_prob=spec.suffix_decoding_min_token_prob)
            runner.__dict__[_TREES_ATTR] = trees
        return trees

    def cache(self, name: str):
        cache = self.caches.get(name)
        if cache is None:
            from arctic_inference.suffix_decoding import SuffixDecodingCache

            cache = self.caches[name] = SuffixDecodingCache(max_tree_depth=self.max_tree_depth,
                                                            max_cached_requests=self.config.max_cached_requests)
        return cache

    def tree_name(self, request_state: Any) -> str:
        if self.config.scope == "global":
            return DEFAULT_TREE
        params = getattr(request_state, "sampling_params", None)
        extra = getattr(params, "extra_args", None) or {}
        name = extra.get(TREE_FIELD, DEFAULT_TREE)
        return name if isinstance(name, str) else DEFAULT_TREE

    def _feed(self, runner: Any, req_id: str, index: int) -> str | None:
        """Put the request's new tokens into its trees (starting it there if new); its tree name."""
        import numpy as np

        if req_id in self.excluded:
            return None
        batch = runner.input_batch
        entry = self.active.get(req_id)
        num_tokens = int(batch.num_tokens_no_spec[index])
        if entry is None:
            state = runner.requests.get(req_id)
            if state is None:
                return None
            name = self.tree_name(state)
            if name == NO_TREE:
                self.excluded.add(req_id)
                return None
            cache = self.cache(name)
            num_prompt = int(batch.num_prompt_tokens[index])
            if req_id in cache.cached_requests:
                cache.evict_cached_response(req_id)
            prompt = batch.token_ids_cpu[index, :num_prompt] if self.config.include_prompt else np.empty(0, np.int32)
            cache.start_request(req_id, np.ascontiguousarray(prompt, dtype=np.int32))
            entry = self.active[req_id] = [name, num_prompt]
        name, fed = entry
        if num_tokens > fed:
            self.caches[name].add_active_response(
                req_id, np.ascontiguousarray(batch.token_ids_cpu[index, fed:num_tokens], dtype=np.int32))
            entry[1] = num_tokens
        return name

    def finish(self, runner: Any, finished: Iterable[str], aborted: Iterable[str]) -> None:
        """Before vLLM drops ``finished`` from its batch: their last tokens in, their per-request
        trees dropped, the aborted ones' answers evicted."""
        started = time.perf_counter()
        self.aborted.update(aborted)
        batch = runner.input_batch
        for req_id in finished:
            index = batch.req_id_to_index.get(req_id)
            if index is not None and req_id not in self.aborted:
                self._feed(runner, req_id, index)  # also one that ran only k=0 steps (never drafted)
            self._stop(req_id)
        self.seconds += time.perf_counter() - started

    def _stop(self, req_id: str) -> None:
        self.excluded.discard(req_id)
        entry = self.active.pop(req_id, None)
        aborted = req_id in self.aborted
        self.aborted.discard(req_id)
        if entry is None:
            return
        cache = self.caches.get(entry[0])
        if cache is None:
            return
        cache.stop_request(req_id)
        if aborted and req_id in cache.cached_requests:
            cache.evict_cached_response(req_id)

    def mix(self, runner: Any, req_ids: list[str], drafts: list[list[int]],
            confidences: list | None) -> list[str]:
        """Feed the trees, and replace each request's draft by its tree's where the tree is sure
        enough; the source of each request's drafts."""
        import numpy as np

        started = time.perf_counter()
        batch = runner.input_batch
        k_step = max((len(d) for d in drafts), default=0)
        sources = ["draft"] * len(req_ids)
        for i, req_id in enumerate(req_ids):
            index = batch.req_id_to_index.get(req_id)
            if index is None or not drafts[i]:
                continue  # a prompt part-way through its prefill, or a step without drafts
            name = self._feed(runner, req_id, index)
            if name is None or not k_step:
                continue
            num_tokens = int(batch.num_tokens_no_spec[index])
            room = min(self.config.longest(k_step), self.max_model_len - num_tokens - 1)
            if room <= 0:
                continue
            start = max(0, num_tokens - self.max_tree_depth)
            draft = self.caches[name].speculate(
                req_id, np.ascontiguousarray(batch.token_ids_cpu[index, start:num_tokens], dtype=np.int32),
                max_spec_tokens=room, max_spec_factor=self.max_spec_factor, min_token_prob=self.min_token_prob)
            if draft.token_ids and draft.score >= self.config.min_score:
                drafts[i] = list(draft.token_ids)
                sources[i] = "suffix"
                if confidences is not None:
                    # the tree's probabilities are of the whole prefix: per token, the ratio
                    probs, previous, own = draft.probs, 1.0, []
                    for p in probs:
                        own.append(min(1.0, p / previous) if previous > 0 else 0.0)
                        previous = p
                    confidences[i] = own
        for req_id in [r for r in self.active if r not in batch.req_id_to_index]:
            self._stop(req_id)  # left the batch without a finish we saw (a preemption, a reset)
        self.seconds += time.perf_counter() - started
        self.calls += 1
        return sources

    def clear(self) -> dict[str, Any]:
        """Empty every tree; the requests in flight now draft from the EAGLE-3 draft alone to their end."""
        erased = sum(len(c.cached_requests) for c in self.caches.values())
        self.excluded.update(self.active)
        self.caches, self.active = {}, {}
        return {"erased_answers": erased}

    def stats(self) -> dict[str, Any]:
        return {"trees": len(self.caches), "cached_answers": sum(len(c.cached_requests) for c in self.caches.values()),
                "active_requests": len(self.active), "tree_seconds": self.seconds, "tree_calls": self.calls}


# --- the worker ---------------------------------------------------------------------------------

def _take_draft_token_ids_mixed(original):
    @functools.wraps(original)
    def take_draft_token_ids(self):
        out = original(self)
        trees = Trees.for_runner(self)
        if trees is None or out is None:
            return out
        drafts = [list(d) for d in out.draft_token_ids]
        confidences = getattr(out, "confidence", None)
        confidences = list(confidences) if confidences is not None else None
        sources = trees.mix(self, list(out.req_ids), drafts, confidences)
        mixed = type(out)(out.req_ids, drafts)
        setattr(mixed, SOURCE_ATTR, sources)
        if confidences is not None:
            mixed.confidence = confidences
        return mixed

    setattr(take_draft_token_ids, _PATCHED_ATTR, True)
    return take_draft_token_ids


def _execute_model_finishing(original):
    @functools.wraps(original)
    def execute_model(self, scheduler_output, intermediate_tensors=None):
        trees = Trees.for_runner(self)
        if trees is not None and (scheduler_output.finished_req_ids or getattr(scheduler_output, ABORTED_ATTR, None)):
            trees.finish(self, scheduler_output.finished_req_ids, getattr(scheduler_output, ABORTED_ATTR, None) or ())
        return original(self, scheduler_output, intermediate_tensors)

    setattr(execute_model, _PATCHED_ATTR, True)
    return execute_model


def _runner(worker: Any) -> Any:
    return getattr(worker, "model_runner", None)


def clear_worker_trees(worker: Any) -> dict[str, Any]:
    """Worker extension method (:data:`WORKER_CLEAR`): empty this worker's trees."""
    trees = Trees.for_runner(_runner(worker)) if _runner(worker) is not None else None
    return trees.clear() if trees is not None else {"erased_answers": 0}


def worker_tree_stats(worker: Any) -> dict[str, Any] | None:
    """Worker extension method (:data:`WORKER_STATS`): this worker's trees' counts and own time."""
    trees = Trees.for_runner(_runner(worker)) if _runner(worker) is not None else None
    return trees.stats() if trees is not None else None


# --- the scheduler ------------------------------------------------------------------------------

def _counts(scheduler: Any) -> dict[str, dict[str, int]] | None:
    counts = scheduler.__dict__.get(_COUNTS_ATTR, False)
    if counts is False:
        counts = None
        if config_of(scheduler) is not None:
            counts = {s: {"steps": 0, "draft_tokens": 0, "accepted_tokens": 0} for s in SOURCES}
        scheduler.__dict__[_COUNTS_ATTR] = counts
    return counts


def _update_draft_token_ids_noting_source(original):
    @functools.wraps(original)
    def update_draft_token_ids(self, draft_token_ids) -> None:
        sources = getattr(draft_token_ids, SOURCE_ATTR, None)
        if sources is not None:
            for req_id, source in zip(draft_token_ids.req_ids, sources):
                request = self.requests.get(req_id)
                if request is not None:
                    setattr(request, _SOURCE_REQ_ATTR, source)
        return original(self, draft_token_ids)

    setattr(update_draft_token_ids, _PATCHED_ATTR, True)
    return update_draft_token_ids


def _counted_by_source(original):
    @functools.wraps(original)
    def make_spec_decoding_stats(self, spec_decoding_stats, num_draft_tokens, num_accepted_tokens,
                                 num_invalid_spec_tokens, request_id):
        counts = _counts(self)
        if counts is not None and num_draft_tokens:
            request = self.requests.get(request_id)
            name = getattr(request, _SOURCE_REQ_ATTR, "draft")
            invalid = num_invalid_spec_tokens.get(request_id, 0) if num_invalid_spec_tokens else 0
            targets = [counts[name]]
            params = getattr(request, "sampling_params", None)
            key = (getattr(params, "extra_args", None) or {}).get(REQUEST_KEY_FIELD)
            if isinstance(key, str):
                split = self.__dict__.setdefault(_SPLIT_ATTR, collections.OrderedDict())
                if key not in split:
                    split[key] = {s: {"steps": 0, "draft_tokens": 0, "accepted_tokens": 0} for s in SOURCES}
                    while len(split) > KEPT_REQUESTS:
                        split.popitem(last=False)
                targets.append(split[key][name])
            for source in targets:
                source["steps"] += 1
                source["draft_tokens"] += num_draft_tokens - invalid
                source["accepted_tokens"] += num_accepted_tokens
        return original(self, spec_decoding_stats, num_draft_tokens, num_accepted_tokens,
                        num_invalid_spec_tokens, request_id)

    setattr(make_spec_decoding_stats, _PATCHED_ATTR, True)
    return make_spec_decoding_stats


def _finish_requests_noting_aborts(original):
    @functools.wraps(original)
    def finish_requests(self, request_ids, finished_status):
        if request_ids and _counts(self) is not None and finished_status == _aborted_status():
            ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
            self.__dict__.setdefault(_ABORTED_ATTR, set()).update(ids)
            request_ids = ids
        return original(self, request_ids, finished_status)

    setattr(finish_requests, _PATCHED_ATTR, True)
    return finish_requests


@functools.cache
def _aborted_status():
    from vllm.v1.request import RequestStatus

    return RequestStatus.FINISHED_ABORTED


def _schedule_carrying_aborts(original):
    @functools.wraps(original)
    def schedule(self, throttle_prefills=False):
        output = original(self, throttle_prefills)
        aborted = self.__dict__.get(_ABORTED_ATTR)
        if aborted:
            setattr(output, ABORTED_ATTR, frozenset(aborted))
            aborted.clear()
        return output

    setattr(schedule, _PATCHED_ATTR, True)
    return schedule


def _utility(self) -> dict | None:
    """EngineCore utility: drafted and accepted tokens and verify steps per source; None when off."""
    counts = _counts(self.scheduler)
    return None if counts is None else {s: dict(c) for s, c in counts.items()}


def _request_utility(self, key: str) -> dict | None:
    """EngineCore utility: the per-source counts of the request the server keyed ``key`` (once: they
    are dropped as they are read); None if it drafted nothing or is unknown."""
    split = self.scheduler.__dict__.get(_SPLIT_ATTR)
    return split.pop(key, None) if split else None


def apply() -> list[str]:
    """Install the mix in this process (idempotent); return what was patched."""
    if not checked(__name__, CHECKED_ON):
        return []
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine.core import EngineCore
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    patched = []
    for owner, name, wrapper in (
            (GPUModelRunner, "take_draft_token_ids", _take_draft_token_ids_mixed),
            (GPUModelRunner, "execute_model", _execute_model_finishing),
            (Scheduler, "update_draft_token_ids", _update_draft_token_ids_noting_source),
            (Scheduler, "make_spec_decoding_stats", _counted_by_source),
            (Scheduler, "finish_requests", _finish_requests_noting_aborts),
            (Scheduler, "schedule", _schedule_carrying_aborts)):
        if wrap_method(owner, name, wrapper, _PATCHED_ATTR):
            patched.append(f"{owner.__name__}.{name}")
    if UTILITY not in EngineCore.__dict__:
        EngineCore.dynamo_spec_suffix = _utility
        patched.append(f"EngineCore.{UTILITY}")
    if REQUEST_UTILITY not in EngineCore.__dict__:
        EngineCore.dynamo_spec_suffix_request = _request_utility
        patched.append(f"EngineCore.{REQUEST_UTILITY}")
    return patched
