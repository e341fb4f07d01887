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
   sampling metadata carries penalties, the outputs the target will count at the next verify
   are kept on the drafter for the call: each request's output so far and this step's
   accepted tokens (the sampled row less vLLM's placeholders; the proposer runs before the
   runner's bookkeeping appends them).
2. ``SpecDecodeBaseProposer._greedy_sample``: the draft's logits (over the target vocabulary,
   as ``compute_logits`` gives them) get vLLM's own ``apply_all_penalties`` with those outputs
   plus the drafts already made in this call, then the argmax. Where ``draft_confidence``
   keeps confidences, the chosen token's probability is kept from the same logits.

Only the proposals change: the target verifies as before, so greedy output is identical and
sampled output is distributed as before. Drafts that vLLM samples another way (a heterogeneous
vocabulary, probabilistic drafting) keep vLLM's path. Model Runner V2 (a GPU) has its own
speculator and is not patched (engine/paths.py: inactive there).

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
    "vllm.v1.sample.ops.penalties:apply_all_penalties":
        "(logits, prompt_token_ids, presence_penalties, frequency_penalties, repetition_penalties, "
        "output_token_ids)",
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
    """What the target's penalties will see at the next verify, for one propose call."""

    metadata: Any  # the step's SamplingMetadata (penalty tensors, prompt ids), rows in batch order
    outputs: list[list[int]]  # per request: output so far and this step's accepted tokens
    vocab_size: int  # the target's (the prompt ids are padded with it)
    drafted: list[list[int]] = field(default_factory=list)  # per draft position: the tokens chosen

    def outputs_at(self, rows: int) -> list[list[int]]:
        """Each request's outputs plus the drafts before the next position."""
        return [self.outputs[i] + [position[i] for position in self.drafted] for i in range(rows)]


def accepted_outputs(metadata: Any, sampled_token_ids: Any) -> list[list[int]]:
    """Per request: its output tokens so far and the ones this step accepted (placeholders dropped)."""
    rows = sampled_token_ids.tolist() if hasattr(sampled_token_ids, "tolist") else sampled_token_ids
    return [list(metadata.output_token_ids[i]) + [t for t in row if t != PLACEHOLDER]
            for i, row in enumerate(rows)]


def penalized_argmax(logits, context: PenaltyContext):
    """vLLM's penalties on draft logits for the next position, and the argmax (and the logits)."""
    from vllm.v1.sample.ops.penalties import apply_all_penalties

    rows = logits.shape[0]
    md = context.metadata
    logits = apply_all_penalties(logits, md.prompt_token_ids[:rows], md.presence_penalties[:rows],
                                 md.frequency_penalties[:rows], md.repetition_penalties[:rows],
                                 context.outputs_at(rows))
    ids = logits.argmax(dim=-1)
    context.drafted.append(ids.tolist())
    return ids, logits


def _propose_draft_token_ids_keeping_outputs(original):
    @functools.wraps(original)
    def propose_draft_token_ids(self, scheduler_output, sampled_token_ids, sampling_metadata, *args):
        drafter = getattr(self, "drafter", None)
        if (drafter is None or sampling_metadata.no_penalties or sampling_metadata.prompt_token_ids is None
                or not scheduler_output.num_spec_tokens_to_schedule or not enabled(self)):
            return original(self, scheduler_output, sampled_token_ids, sampling_metadata, *args)
        drafter.__dict__[_CONTEXT_ATTR] = PenaltyContext(
            sampling_metadata, accepted_outputs(sampling_metadata, sampled_token_ids),
            self.model_config.get_vocab_size())
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
        if context is None or self.use_heterogeneous_vocab:
            return original(self, hidden_states)
        logits = self.model.compute_logits(hidden_states)
        if logits.shape[0] > len(context.outputs) or logits.shape[1] != context.vocab_size:
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
