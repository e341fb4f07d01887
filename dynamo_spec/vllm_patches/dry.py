"""Patch: DRY sequence-repetition control (``dynamo_spec.sampling.dry``) in vLLM's V1 samplers.

Upstream (vLLM 0.32): no DRY, and a custom logits processor is refused whenever speculative
decoding is on (``STR_SPEC_DEC_REJECTS_LOGITSPROCS``, ``v1/sample/logits_processor/__init__.py``).
Penalties are applied per verified position with the drafts before it
(``RejectionSampler.apply_logits_processors``), and the bonus position with all of them
(``Sampler.apply_logits_processors(predict_bonus_token=True)``).

Change: a request whose ``SamplingParams.extra_args`` set ``dry_multiplier`` (the server writes
its ``sampling.dry`` default there; ``serving/dry_fields.py``) gets DRY's penalties after vLLM's
own processors, exactly where vLLM applies penalties:

1. ``GPUModelRunner._sample`` (the CPU runner inherits it): for the step's requests with DRY on,
   their context (the answer so far; the prompt too with ``dry_include_prompt``) and this step's
   drafts are kept on the runner's sampler for the call.
2. ``Sampler.apply_logits_processors``: a plain step's row ``i`` gets DRY on request ``i``'s
   context; a bonus row on the context and all of its drafts.
3. ``RejectionSampler.apply_logits_processors``: the row of draft position ``j`` gets DRY on the
   context and the drafts before ``j``.

So every token the target emits was chosen from the distribution it would have had without
speculation: greedy output is identical, sampled output distributed the same. The draft drafts
under DRY as under the penalties (``draft_penalties``). A token is a sequence breaker when its
text contains a breaker string (the tokenizer's text of each id, computed once per engine).

V1 runner with synchronous scheduling only (the answer so far must be final when sampling):
``engine/features.py`` declares it, and the server refuses a DRY request elsewhere.
Checked on vLLM 0.32.0 (``CHECKED_ON``). Goes away when vLLM applies logits processors under
speculation (upstream #8581 for DRY; PR #50584 open).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Any

import numpy as np

from dynamo_spec.sampling import dry
from dynamo_spec.vllm_patches._upstream import checked, wrap_method

logger = logging.getLogger("vllm.dynamo_spec_plugin")

CHECKED_ON = ("0.32.0",)
UPSTREAM_SIGNATURES = {
    "vllm.v1.worker.gpu_model_runner:GPUModelRunner._sample": "(self, logits, spec_decode_metadata)",
    "vllm.v1.sample.sampler:Sampler.apply_logits_processors": "(self, logits, sampling_metadata, predict_bonus_token)",
    "vllm.v1.sample.rejection_sampler:RejectionSampler.apply_logits_processors":
        "(self, logits, sampling_metadata, metadata)",
    "vllm.tokenizers.registry:cached_tokenizer_from_config": "(model_config, **kwargs)",
}

_PATCHED_ATTR = "_dynamo_spec_dry"
_STEP_ATTR = "_dynamo_spec_dry_step"  # on the runner's Sampler: the current _sample call's DryStep
_PARAMS_ATTR = "_dynamo_spec_dry_params"  # on a request's CachedRequestState: its parsed DryParams (or None)
_BREAKERS_ATTR = "_dynamo_spec_dry_breakers"  # on the runner: Breakers


@dataclass
class DryRow:
    index: int  # the request's row in the batch
    params: dry.DryParams
    is_breaker: np.ndarray
    context: list[int]  # the context before this step's drafts


@dataclass
class DryStep:
    """The DRY requests of one ``_sample`` call."""

    rows: list[DryRow]
    num_reqs: int
    drafts: list[list[int]] | None  # per request, this step's drafts (None: a step without drafts)

    def plain(self) -> list[tuple[int, DryRow, list[int]]]:
        """(logits row, request, context): one row per request, before its drafts."""
        return [(r.index, r, r.context) for r in self.rows]

    def bonus(self) -> list[tuple[int, DryRow, list[int]]]:
        """One row per request, after all its drafts."""
        drafts = self.drafts or [[] for _ in range(self.num_reqs)]
        return [(r.index, r, r.context + drafts[r.index]) for r in self.rows]

    def verified(self) -> list[tuple[int, DryRow, list[int]]]:
        """One row per draft position (requests in batch order), with the drafts before it."""
        starts = np.cumsum([0] + [len(d) for d in self.drafts or []]).tolist()
        return [(starts[r.index] + j, r, r.context + self.drafts[r.index][:j])
                for r in self.rows for j in range(len(self.drafts[r.index]))]


class Breakers:
    """Sequence-breaker masks of one engine's vocabulary, per breaker set (texts decoded once)."""

    def __init__(self, model_config: Any):
        self.model_config = model_config
        self.texts: list[str] | None = None
        self.masks: dict[tuple[str, ...], np.ndarray] = {}

    def mask(self, breakers: tuple[str, ...]) -> np.ndarray:
        if breakers not in self.masks:
            if self.texts is None:
                self.texts = _token_texts(self.model_config)
            self.masks[breakers] = dry.breaker_mask(self.texts, breakers)
        return self.masks[breakers]


def _token_texts(model_config: Any) -> list[str]:
    """Each token id's text (ids past the tokenizer's: empty); none without a tokenizer."""
    if getattr(model_config, "skip_tokenizer_init", False):
        logger.warning("dynamo-spec: DRY without a tokenizer (skip_tokenizer_init): no sequence breakers")
        return []
    from vllm.tokenizers.registry import cached_tokenizer_from_config

    tokenizer = cached_tokenizer_from_config(model_config)
    texts = tokenizer.batch_decode([[i] for i in range(len(tokenizer))])
    return texts + [""] * max(0, model_config.get_vocab_size() - len(texts))


def params_of(state: Any) -> dry.DryParams | None:
    """A request's DRY parameters (from its extra args; parsed once, kept on its state), None when off.
    The server checked them; a request that reached the engine another way with bad ones runs without."""
    if _PARAMS_ATTR not in state.__dict__:
        sp = getattr(state, "sampling_params", None)
        params = None
        try:
            params = dry.parse((getattr(sp, "extra_args", None) or {}) if sp is not None else {})
        except ValueError as exc:
            logger.error("dynamo-spec: DRY off for a request: %s", exc)
        state.__dict__[_PARAMS_ATTR] = params if params is not None and params.active else None
    return state.__dict__[_PARAMS_ATTR]


def step_of(runner: Any, spec_decode_metadata: Any) -> DryStep | None:
    """The step's DRY requests, or None when none has DRY on."""
    batch = runner.input_batch
    rows = []
    for index, req_id in enumerate(batch.req_ids):
        state = runner.requests.get(req_id)
        params = params_of(state) if state is not None else None
        if params is None:
            continue
        if getattr(runner, "use_async_scheduling", False):
            _warn_async()
            return None
        breakers = runner.__dict__.get(_BREAKERS_ATTR)
        if breakers is None:
            breakers = runner.__dict__[_BREAKERS_ATTR] = Breakers(runner.model_config)
        prompt = (state.prompt_token_ids or []) if params.include_prompt else []
        rows.append(DryRow(index, params, breakers.mask(params.sequence_breakers), [*prompt, *state.output_token_ids]))
    if not rows:
        return None
    drafts = None
    if spec_decode_metadata is not None:
        flat = spec_decode_metadata.draft_token_ids.tolist()
        starts = np.cumsum([0, *spec_decode_metadata.num_draft_tokens]).tolist()
        drafts = [flat[starts[i]:starts[i + 1]] for i in range(len(starts) - 1)]
    return DryStep(rows, batch.num_reqs, drafts)


def draft_rows(runner: Any, sampled_token_ids: Any) -> list[DryRow] | None:
    """For the draft (``draft_penalties``' propose call): each DRY request's row with the context the
    target will see at the next verify, before the drafts. ``sampled_token_ids`` as vLLM hands it to
    ``propose_draft_token_ids``: a tensor of sampled rows (placeholders -1 for rejected slots) where it
    drafts before its bookkeeping adds them to the outputs, lists where it drafts after."""
    step = step_of(runner, None)
    if step is None:
        return None
    if not isinstance(sampled_token_ids, list):
        accepted = sampled_token_ids.tolist()
        for row in step.rows:
            if row.index < len(accepted):
                row.context = row.context + [t for t in accepted[row.index] if t != -1]
    return step.rows


def on_draft_logits(logits: Any, rows: list[DryRow], drafted: list[list[int]]) -> Any:
    """DRY on the draft's logits for the next position: ``drafted`` holds the tokens chosen at the
    positions before it (one list per position, a token per request)."""
    targets = [(r.index, r, r.context + [position[r.index] for position in drafted])
               for r in rows if r.index < logits.shape[0]]
    return apply_to_logits(logits, targets) if targets else logits


@functools.cache
def _warn_async() -> None:
    logger.error("dynamo-spec: DRY needs synchronous scheduling (the answer so far is not final when an "
                 "asynchronous step samples); requests run without it")


def apply_to_logits(logits: Any, targets: list[tuple[int, DryRow, list[int]]]) -> Any:
    """Subtract DRY's penalties from ``logits`` in place: ``targets`` are (row, request, context)."""
    import torch

    rows, tokens, amounts = [], [], []
    width = logits.shape[1]
    for row, request, context in targets:
        ids, by = dry.penalties(np.asarray(context, dtype=np.int64), request.params, request.is_breaker)
        keep = ids < width
        rows.append(np.full(int(keep.sum()), row, dtype=np.int64))
        tokens.append(ids[keep])
        amounts.append(by[keep])
    if rows and sum(len(r) for r in rows):
        index = (torch.from_numpy(np.concatenate(rows)).to(logits.device),
                 torch.from_numpy(np.concatenate(tokens)).to(logits.device))
        logits.index_put_(index, -torch.from_numpy(np.concatenate(amounts)).to(logits.device, logits.dtype),
                          accumulate=True)
    return logits


def _sample_with_dry(original):
    @functools.wraps(original)
    def _sample(self, logits, spec_decode_metadata):
        step = step_of(self, spec_decode_metadata) if logits is not None else None
        if step is None:
            return original(self, logits, spec_decode_metadata)
        self.sampler.__dict__[_STEP_ATTR] = step
        try:
            return original(self, logits, spec_decode_metadata)
        finally:
            self.sampler.__dict__[_STEP_ATTR] = None

    setattr(_sample, _PATCHED_ATTR, True)
    return _sample


def _sampler_processors_with_dry(original):
    @functools.wraps(original)
    def apply_logits_processors(self, logits, sampling_metadata, predict_bonus_token):
        logits = original(self, logits, sampling_metadata, predict_bonus_token)
        step = self.__dict__.get(_STEP_ATTR)
        if step is not None and logits.shape[0] == step.num_reqs:
            logits = apply_to_logits(logits, step.bonus() if predict_bonus_token else step.plain())
        return logits

    setattr(apply_logits_processors, _PATCHED_ATTR, True)
    return apply_logits_processors


def _rejection_processors_with_dry(original):
    @functools.wraps(original)
    def apply_logits_processors(self, logits, sampling_metadata, metadata):
        logits = original(self, logits, sampling_metadata, metadata)
        step = self.sampler.__dict__.get(_STEP_ATTR)
        if step is not None and step.drafts is not None and logits.shape[0] == sum(map(len, step.drafts)):
            logits = apply_to_logits(logits, step.verified())
        return logits

    setattr(apply_logits_processors, _PATCHED_ATTR, True)
    return apply_logits_processors


def apply() -> list[str]:
    """Install in this process (idempotent); return what was patched. A request turns DRY on by its
    own extra args; an engine without DRY requests pays one attribute lookup per request and step."""
    if not checked(__name__, CHECKED_ON):
        return []
    from vllm.v1.sample.rejection_sampler import RejectionSampler
    from vllm.v1.sample.sampler import Sampler
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    patched = []
    if wrap_method(GPUModelRunner, "_sample", _sample_with_dry, _PATCHED_ATTR):
        patched.append("GPUModelRunner._sample")
    if wrap_method(Sampler, "apply_logits_processors", _sampler_processors_with_dry, _PATCHED_ATTR):
        patched.append("Sampler.apply_logits_processors")
    if wrap_method(RejectionSampler, "apply_logits_processors", _rejection_processors_with_dry, _PATCHED_ATTR):
        patched.append("RejectionSampler.apply_logits_processors")
    return patched
