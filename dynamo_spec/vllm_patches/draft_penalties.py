"""Patch: the EAGLE draft drafts under the request's penalties (repetition, frequency, presence).

Upstream (vLLM's v1 EAGLE proposer and model runner): ``SpecDecodeBaseProposer._greedy_sample``
takes the argmax of the draft's raw logits. The request's penalties act only when the target
verifies (``RejectionSampler.apply_penalties``: over the prompt, the output so far and the
drafts before each position). A request with a penalty therefore gets drafts the target would
not choose, and acceptance falls (a list or a count, where the penalty changes the target's
choice, the most).

Change, in an engine whose switches do not turn it off (:data:`PENALTIES_KEY`,
``speculative.draft_penalties``; read once per model runner from its own ``vllm_config``):

1. ``GPUModelRunner.propose_draft_token_ids`` (the CPU runner inherits it): where the step's
   sampling metadata carries penalties, a :class:`PenaltyContext` is kept on the drafter for the
   call, with what the target will count at the next verify: each request's output so far and
   this step's accepted tokens. vLLM drafts either before its bookkeeping appends them (the
   padded drafter batch, its default: the sampled rows come as a tensor with placeholders) or
   after it (``disable_padded_drafter_batch``: the valid tokens come as lists, and the output
   lists already hold them); :func:`accepted_outputs` counts them once either way.
2. ``SpecDecodeBaseProposer._greedy_sample``: the draft's logits over the target vocabulary
   (``compute_logits``; under ``use_local_argmax_reduction`` too, which would otherwise never
   build them) get the request's penalties (:func:`penalized_argmax`), then the argmax. The
   penalties are vLLM's own arithmetic (``apply_penalties``: the same operations in the same
   order, so the same logits), with the prompt's mask and the output's counts built once per
   call and the drafts added to the counts position by position. Where ``draft_confidence``
   keeps confidences, the chosen token's probability is kept from the same logits.

Only the proposals change: the target verifies as before, so greedy output is identical and
sampled output is distributed as before. Not patched, and said at start (engine/features.py,
``DRAFT_PENALTIES``): drafts sampled from the draft's distribution
(``draft_sample_method: probabilistic``, for batches with a sampled request), a draft with
another vocabulary (``use_heterogeneous_vocab``), parallel drafting and the methods without draft
logits (ngram, suffix, medusa, ...) keep vLLM's path; Model Runner V2 (a GPU) has its own
speculator (engine/paths.py: inactive there).

Checked on vLLM 0.32.0 (``CHECKED_ON``). Goes away when vLLM's proposers apply the request's
logits processors to the draft (upstream: penalties are target-only in both runners).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

from dynamo_spec.vllm_patches import switch
from dynamo_spec.vllm_patches._upstream import checked, wrap_method

CHECKED_ON = ("0.32.0",)
UPSTREAM_SIGNATURES = {
    "vllm.v1.spec_decode.llm_base_proposer:SpecDecodeBaseProposer._greedy_sample": "(self, hidden_states)",
    "vllm.v1.worker.gpu_model_runner:GPUModelRunner.propose_draft_token_ids":
        "(self, scheduler_output, sampled_token_ids, sampling_metadata, hidden_states, sample_hidden_states, "
        "aux_hidden_states, spec_decode_metadata, common_attn_metadata, slot_mappings)",
    # the arithmetic penalized_argmax repeats element by element
    "vllm.model_executor.layers.utils:apply_penalties":
        "(logits, prompt_tokens_tensor, output_tokens_tensor, presence_penalties, frequency_penalties, "
        "repetition_penalties)",
    "vllm._custom_ops:apply_repetition_penalties_torch": "(logits, prompt_mask, output_mask, repetition_penalties)",
}
# False in the engine's switches: the draft drafts without the penalties (vLLM's own).
PENALTIES_KEY = "draft_penalties"
PLACEHOLDER = -1  # vLLM's rejected-draft slot in a sampled row (rejection_sampler.PLACEHOLDER_TOKEN_ID)

_PATCHED_ATTR = "_dynamo_spec_draft_penalties"
_CONTEXT_ATTR = "_dynamo_spec_penalty_context"  # the current propose call's PenaltyContext


def enabled(owner: Any) -> bool:
    """Whether ``owner``'s engine drafts under the request's penalties (on where its switches do not say;
    ``engine.args.engine_switches`` always says, from ``speculative.draft_penalties``)."""
    return switch(owner, PENALTIES_KEY, default=True)


@dataclass
class PenaltyContext:
    """What the target's penalties will see at the next verify, for one propose call. The counts that
    vLLM rebuilds at every verified position are built here at the first draft position, then only
    updated with each position's drafts; the penalties touch only the entries they can change."""

    metadata: Any  # the step's SamplingMetadata (penalty tensors, prompt ids), rows in batch order
    outputs: list[list[int]]  # per request: output so far and this step's accepted tokens
    vocab_size: int  # the target's (the prompt ids are padded with it)
    drafted: list[list[int]] = field(default_factory=list)  # per draft position: the tokens chosen
    counts: Any = None  # [rows, vocab + 1] int64: outputs and drafts so far (vLLM's bin counts, pad column last)
    in_prompt: Any = None  # [rows, vocab + 1] bool, where a repetition penalty acts (else None)
    touched: Any = None  # flat indices into ``counts`` of the entries a penalty can change
    penalties: dict[str, Any] = field(default_factory=dict)  # the kinds some row uses: [rows] tensors
    penalized: bool = True  # some request has a penalty (else only DRY acts)
    dry: list[Any] | None = None  # the DRY requests' rows (vllm_patches/dry.py), applied after the penalties
    rows: int | None = None  # requests in the batch (default: len(outputs))

    def outputs_at(self, rows: int) -> list[list[int]]:
        """Each request's outputs plus the drafts before the next position."""
        return [self.outputs[i] + [position[i] for position in self.drafted] for i in range(rows)]

    def fits(self, logits) -> bool:
        """Whether ``logits`` are rows of this batch over the target vocabulary (what the penalties are for)."""
        rows = self.rows if self.rows is not None else len(self.outputs)
        return logits.shape[0] <= rows and logits.shape[1] == self.vocab_size

    def _count(self, rows: int, device) -> None:
        import torch
        from vllm.utils.torch_utils import make_tensor_with_pad

        width = self.vocab_size + 1
        tokens = make_tensor_with_pad(self.outputs_at(rows), pad=self.vocab_size, dtype=torch.int64, device=device)
        tokens.masked_fill_(tokens < 0, self.vocab_size)  # vLLM's: placeholders count as the pad
        self.counts = _bins(tokens, width)
        md = self.metadata
        given = {"repetition": (md.repetition_penalties, 1.0), "frequency": (md.frequency_penalties, 0.0),
                 "presence": (md.presence_penalties, 0.0)}
        # a kind whose every row is neutral is skipped: vLLM's arithmetic is the identity there
        self.penalties = {kind: p[:rows] for kind, (p, neutral) in given.items() if bool((p[:rows] != neutral).any())}
        seen = [tokens]
        self.in_prompt = None
        if "repetition" in self.penalties:
            prompt = md.prompt_token_ids[:rows].to(device)
            self.in_prompt = _bins(prompt, width) > 0
            seen.append(prompt)
        flat = torch.cat([(torch.arange(rows, device=device)[:, None] * width + t).view(-1) for t in seen])
        self.touched = torch.unique(flat[flat % width != self.vocab_size])

    def _add(self, ids) -> None:
        import torch

        if self.penalized:
            flat = torch.arange(ids.shape[0], device=ids.device) * (self.vocab_size + 1) + ids
            self.touched = torch.cat([self.touched, flat])  # an entry twice is harmless: each gets the same value
            self.counts.view(-1)[flat] += 1
        self.drafted.append(ids.tolist())


def _bins(tokens, width: int):
    """vLLM's bin counts (``get_token_bin_counts_and_mask``, before it drops the pad column)."""
    import torch

    counts = torch.zeros((tokens.shape[0], width), dtype=torch.long, device=tokens.device)
    return counts.scatter_add_(1, tokens, torch.ones_like(tokens))


def accepted_outputs(metadata: Any, sampled_token_ids: Any) -> list[list[int]]:
    """Per request: its output tokens so far and the ones this step accepted, each counted once.

    ``sampled_token_ids`` as vLLM hands it to ``propose_draft_token_ids``: a tensor of sampled rows
    (placeholders for the rejected slots) where it drafts before its bookkeeping, the lists of valid
    tokens where it drafts after it (``disable_padded_drafter_batch``: the output lists, which the
    metadata shares with the runner's requests, already hold them)."""
    if isinstance(sampled_token_ids, list):
        return [list(metadata.output_token_ids[i]) for i in range(len(sampled_token_ids))]
    rows = sampled_token_ids.tolist()
    return [list(metadata.output_token_ids[i]) + [t for t in row if t != PLACEHOLDER]
            for i, row in enumerate(rows)]


def penalized_argmax(logits, context: PenaltyContext):
    """The request's processing of the draft's logits for the next position (vLLM's penalties over the
    prompt, the outputs and the drafts before it, in place), then the argmax; returns both.

    vLLM's ``apply_penalties`` element by element, the same operations in the same order (the same
    floats), on the entries it can change only: elsewhere it multiplies by 1.0 and subtracts 0.0."""
    if context.penalized:
        _penalize(logits, context)
    if context.dry:  # after the penalties, as the target's sampler applies it (vllm_patches/dry.py)
        from dynamo_spec.vllm_patches import dry

        logits = dry.on_draft_logits(logits, context.dry, context.drafted)
    ids = logits.argmax(dim=-1)
    context._add(ids)
    return ids, logits


def _penalize(logits, context: PenaltyContext) -> None:
    import torch

    rows = logits.shape[0]
    if context.counts is None or context.counts.shape[0] != rows:
        context._count(rows, logits.device)
    flat, width, penalties = context.touched, context.vocab_size + 1, context.penalties
    row, col = flat // width, flat % width
    counts = context.counts.view(-1)[flat]
    x = logits[row, col]
    if (repetition := penalties.get("repetition")) is not None:  # vLLM's apply_repetition_penalties_torch
        factor = torch.where(context.in_prompt.view(-1)[flat] | (counts > 0), repetition[row], 1.0)
        x = (x * torch.where(x > 0, 1.0 / factor, factor)).to(logits.dtype)
    if (frequency := penalties.get("frequency")) is not None:
        x = (x - frequency[row] * counts).to(logits.dtype)
    if (presence := penalties.get("presence")) is not None:
        x = (x - presence[row] * (counts > 0)).to(logits.dtype)
    logits[row, col] = x


def _propose_draft_token_ids_keeping_outputs(original):
    @functools.wraps(original)
    def propose_draft_token_ids(self, scheduler_output, sampled_token_ids, sampling_metadata, *args):
        from dynamo_spec.vllm_patches import dry

        drafter = getattr(self, "drafter", None)
        if drafter is None or not scheduler_output.num_spec_tokens_to_schedule or not enabled(self):
            return original(self, scheduler_output, sampled_token_ids, sampling_metadata, *args)
        penalized = not sampling_metadata.no_penalties and sampling_metadata.prompt_token_ids is not None
        dry_rows = dry.draft_rows(self, sampled_token_ids)
        if not penalized and not dry_rows:
            return original(self, scheduler_output, sampled_token_ids, sampling_metadata, *args)
        drafter.__dict__[_CONTEXT_ATTR] = PenaltyContext(
            sampling_metadata, accepted_outputs(sampling_metadata, sampled_token_ids) if penalized else [],
            self.model_config.get_vocab_size(), penalized=penalized, dry=dry_rows, rows=len(sampled_token_ids))
        try:
            return original(self, scheduler_output, sampled_token_ids, sampling_metadata, *args)
        finally:
            drafter.__dict__[_CONTEXT_ATTR] = None

    setattr(propose_draft_token_ids, _PATCHED_ATTR, True)
    return propose_draft_token_ids


def _greedy_sample_under_penalties(original):
    @functools.wraps(original)
    def _greedy_sample(self, hidden_states):
        context = self.__dict__.get(_CONTEXT_ATTR)
        if context is None or self.use_heterogeneous_vocab or self.parallel_drafting:
            return original(self, hidden_states)  # said at start: features.DRAFT_PENALTIES
        logits = self.model.compute_logits(hidden_states)
        if not context.fits(logits):
            return original(self, hidden_states)  # not the rows or the vocabulary the penalties are for
        ids, logits = penalized_argmax(logits, context)
        _keep_confidence(self, logits, ids)
        return ids

    setattr(_greedy_sample, _PATCHED_ATTR, True)
    return _greedy_sample


def _keep_confidence(drafter, logits, ids) -> None:
    """Where draft_confidence keeps this call's confidences, the chosen token's probability."""
    from dynamo_spec.vllm_patches.draft_confidence import _KEPT_ATTR

    kept = drafter.__dict__.get(_KEPT_ATTR)
    if kept is not None:
        import torch

        logits = logits.float()
        kept.append(torch.exp(logits.gather(1, ids[:, None])[:, 0] - torch.logsumexp(logits, dim=-1)))


def apply() -> list[str]:
    """Install in this process (idempotent); return what was patched. Whether a runner drafts under
    the penalties is its engine's switch (:data:`PENALTIES_KEY`)."""
    if not checked(__name__, CHECKED_ON):
        return []
    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    patched = []
    if wrap_method(GPUModelRunner, "propose_draft_token_ids", _propose_draft_token_ids_keeping_outputs,
                   _PATCHED_ATTR):
        patched.append("GPUModelRunner.propose_draft_token_ids")
    if wrap_method(SpecDecodeBaseProposer, "_greedy_sample", _greedy_sample_under_penalties, _PATCHED_ATTR):
        patched.append("SpecDecodeBaseProposer._greedy_sample")
    return patched
