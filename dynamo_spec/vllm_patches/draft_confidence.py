"""Patch: each draft token's confidence (the draft's own probability of it), from the worker to the scheduler.

Upstream (vLLM's v1 EAGLE proposer and model runner):

- ``SpecDecodeBaseProposer._greedy_sample`` takes the argmax of the draft's logits at each
  draft position and drops the probabilities (they are kept only for probabilistic
  drafting, ``_enable_probabilistic_draft_probs``, which greedy EAGLE-3 drafting does not use).
- ``GPUModelRunner.take_draft_token_ids`` (the CPU runner inherits it) hands the scheduler
  a ``DraftTokenIds``: the request ids and their draft token ids, nothing else.

Change, only in an engine whose switches turn it on (:data:`CONFIDENCE_KEY`, set with the
confidence budget or a confidence log; read once per proposer from its own ``vllm_config``:
elsewhere every call goes straight to vLLM's and drafting costs what it did):

1. ``SpecDecodeBaseProposer._greedy_sample``: the same argmax of the same logits, and the
   softmax probability of the chosen token (float32), kept for the current ``propose`` call.
   With ``use_local_argmax_reduction`` on one rank, the same argmax over the draft's own
   vocabulary (then mapped to target ids as vLLM maps them) and its softmax probability.
   Drafts that vLLM samples another way (a heterogeneous vocabulary, a local argmax
   reduction across tensor-parallel ranks) keep vLLM's path and report no confidence.
2. ``SpecDecodeBaseProposer.propose``: the kept probabilities are reset before and stacked
   after into ``[num_requests, k]`` (rows in the runner's request order).
3. ``GPUModelRunner.take_draft_token_ids``: the ``DraftTokenIds`` it returns carries them as
   ``confidence`` (a list per request, aligned with ``req_ids``); it travels to EngineCore
   with the object. ``draft_admission`` reads it there (:func:`confidences_of`).

The draft tokens themselves are unchanged: this patch only observes.

Checked on vLLM 0.32.0 (``CHECKED_ON``). Goes away when vLLM's v1 proposer returns its
draft probabilities for greedy drafts (the GPU model runner v2's adaptive verification keeps
them for DSpark drafts only).
"""

from __future__ import annotations

import functools
from typing import Any

from dynamo_spec.vllm_patches import switch
from dynamo_spec.vllm_patches._upstream import checked, wrap_method

CHECKED_ON = ("0.32.0",)
UPSTREAM_SIGNATURES = {
    "vllm.v1.spec_decode.llm_base_proposer:SpecDecodeBaseProposer._greedy_sample": "(self, hidden_states)",
    "vllm.v1.spec_decode.llm_base_proposer:SpecDecodeBaseProposer.propose":
        "(self, num_speculative_tokens, target_token_ids, target_positions, target_hidden_states, next_token_ids, "
        "token_indices_to_sample, common_attn_metadata, sampling_metadata, mm_embed_inputs=None, "
        "num_rejected_tokens_gpu=None, slot_mappings=None)",
    "vllm.v1.worker.gpu_model_runner:GPUModelRunner.take_draft_token_ids": "(self)",
}
# True in the engine's switches: drafts carry their confidences to the scheduler.
CONFIDENCE_KEY = "draft_confidence"
# The attribute of DraftTokenIds that carries them.
CONFIDENCE_ATTR = "confidence"

_PATCHED_ATTR = "_dynamo_spec_draft_confidence"
_KEPT_ATTR = "_dynamo_spec_kept_confidence"  # the current propose call's [num_requests] tensors
_LAST_ATTR = "_dynamo_spec_last_confidence"  # the last propose call's [num_requests, k] tensor


def enabled(owner: Any) -> bool:
    """Whether the drafts of ``owner``'s engine carry their confidences (off where its switches do not say)."""
    return switch(owner, CONFIDENCE_KEY, default=False)


def confidences_of(draft_token_ids: Any) -> list[list[float]] | None:
    """The confidences a ``DraftTokenIds`` carries (one list per request), or None."""
    return getattr(draft_token_ids, CONFIDENCE_ATTR, None)


def _greedy_sample_keeping_confidence(original):
    @functools.wraps(original)
    def _greedy_sample(self, hidden_states):
        kept = self.__dict__.get(_KEPT_ATTR)
        model = self.model
        local = self.use_local_argmax_reduction
        if kept is None or self.use_heterogeneous_vocab or (local and getattr(model.lm_head, "tp_size", 1) != 1):
            return original(self, hidden_states)
        import torch

        d2t = getattr(model, "draft_id_to_target_id", None) if local else None
        # Local argmax (one rank): the draft's own vocabulary, then its ids mapped as vLLM maps them.
        logits = (model.logits_processor(model.lm_head, hidden_states) if local
                  else model.compute_logits(hidden_states)).float()
        top, ids = logits.max(dim=-1)
        kept.append(torch.exp(top - torch.logsumexp(logits, dim=-1)))
        return ids + d2t[ids] if d2t is not None else ids

    setattr(_greedy_sample, _PATCHED_ATTR, True)
    return _greedy_sample


def _propose_stacking_confidence(original):
    @functools.wraps(original)
    def propose(self, *args, **kwargs):
        if not enabled(self):
            return original(self, *args, **kwargs)
        kept = self.__dict__[_KEPT_ATTR] = []
        self.__dict__[_LAST_ATTR] = None
        try:
            draft_token_ids = original(self, *args, **kwargs)
        finally:
            self.__dict__[_KEPT_ATTR] = None
        if kept and len(kept) == draft_token_ids.shape[1] and all(c.shape[0] >= draft_token_ids.shape[0]
                                                                 for c in kept):
            import torch

            rows = draft_token_ids.shape[0]
            self.__dict__[_LAST_ATTR] = torch.stack([c[:rows] for c in kept], dim=1)
        return draft_token_ids

    setattr(propose, _PATCHED_ATTR, True)
    return propose


def _take_draft_token_ids_with_confidence(original):
    @functools.wraps(original)
    def take_draft_token_ids(self):
        taken = original(self)
        drafter = getattr(self, "drafter", None)
        last = drafter.__dict__.get(_LAST_ATTR) if drafter is not None else None
        if taken is not None and last is not None and last.shape[0] >= len(taken.req_ids):
            rows = last[:len(taken.req_ids)].cpu().tolist()
            setattr(taken, CONFIDENCE_ATTR, [row[:len(ids)] for row, ids in zip(rows, taken.draft_token_ids)])
        return taken

    setattr(take_draft_token_ids, _PATCHED_ATTR, True)
    return take_draft_token_ids


def _patch(owner: type, name: str, wrapper) -> bool:
    return wrap_method(owner, name, wrapper, _PATCHED_ATTR)


def apply() -> list[str]:
    """Install in this process (idempotent); return what was patched. Whether a proposer keeps the
    confidences is its engine's switch (:data:`CONFIDENCE_KEY`)."""
    if not checked(__name__, CHECKED_ON):
        return []
    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    patched = []
    if _patch(SpecDecodeBaseProposer, "_greedy_sample", _greedy_sample_keeping_confidence):
        patched.append("SpecDecodeBaseProposer._greedy_sample")
    if _patch(SpecDecodeBaseProposer, "propose", _propose_stacking_confidence):
        patched.append("SpecDecodeBaseProposer.propose")
    if _patch(GPUModelRunner, "take_draft_token_ids", _take_draft_token_ids_with_confidence):
        patched.append("GPUModelRunner.take_draft_token_ids")
    return patched
