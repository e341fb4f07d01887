"""Patch: cheaper k=0 steps in a speculative vLLM engine (model runner v1, the one vLLM uses on CPU).

Upstream: with a batch-size schedule (``num_speculative_tokens_per_batch_size``) vLLM turns
drafting off (k=0) for large batches, but a speculative engine still pays for speculation
in those steps, enough to serve clearly less than an engine started without speculation:

1. ``GPUModelRunner._sample`` samples through the rejection sampler whenever a speculative
   config exists (``_prepare_inputs`` builds ``SpecDecodeMetadata`` even when no request
   has a draft token): the plain sampler plus a gather of every logits row, a full float32
   copy of them and an empty rejection pass.
2. ``GPUModelRunner.propose_draft_token_ids`` runs the draft model's whole first pass, only
   to fill the draft's KV cache for these positions so that drafting can resume when the
   batch shrinks.
3. ``EngineCore.post_step`` asks the worker for draft tokens after every step
   (``take_draft_token_ids``, a round trip to the worker process), even after a step
   scheduled with k=0, whose answer is empty lists.

Change (the output stays token for token the same; the integration tests pin it against
vLLM's own path):

1. ``GPUModelRunner._sample``: a step in which no request has a draft token
   (``spec_decode_metadata.max_spec_len == 0``) samples with the plain sampler, as an
   engine without speculation does. The logits are then one row per request in request
   order, the rows the rejection sampler would have gathered, and the plain sampler's
   output has the same shape, dtype (``[num_reqs, 1]``, int32) and logprobs layout.
2. ``GPUModelRunner.propose_draft_token_ids``: for an EAGLE-3 Llama draft of one layer on
   an attention backend that writes the KV cache in a separate step (vLLM's CPU backend
   does), with vLLM's padded drafter batch (the CPU runner's path), a k=0 step runs only
   what writes the draft's KV cache: the draft's input tokens (the target's shifted by
   one, the sampled or next prompt token last, as ``prepare_next_token_ids_padded`` and
   ``set_inputs_first_pass`` set them), ``fc`` over the aux hidden states, the embedding,
   the two input norms, the QKV projection, rotary embedding and the backend's own KV
   write, at the target's slots (the draft shares its KV cache group). The input
   preparation, attention metadata, forward context, attention, output projection, MLP and
   final norm, whose results a k=0 step discards, are skipped; the cache gets the same
   values, so later drafts are those vLLM would have made. Other drafts, backends and
   settings keep vLLM's full pass. Skipping the draft pass altogether would leave holes
   in the draft's KV cache that drafting reads once the batch shrinks, and that later
   requests inherit through the prefix cache.
3. ``Scheduler.schedule`` records the step's k; ``EngineCore.post_step`` skips
   ``take_draft_token_ids`` after a step scheduled with k=0 (the scheduler cleared the
   scheduled requests' draft tokens when it scheduled it).

An engine whose switches set ``zero_draft_steps: false`` (:data:`ZERO_DRAFT_KEY`, for A/B
runs: ``engine.extra.additional_config.dynamo_spec.zero_draft_steps``) keeps vLLM's k=0 steps;
the runner and the scheduler each read it once from their own ``vllm_config``. Checked on vLLM
0.32.0 (``CHECKED_ON``). Goes away when vLLM samples k=0 steps with its plain sampler,
skips the draft round trip after them, and writes the draft's KV cache without its full
first pass (or when drafting no longer needs those KV entries).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from dynamo_spec.vllm_patches import switch
from dynamo_spec.vllm_patches._upstream import checked

if TYPE_CHECKING:
    import torch

CHECKED_ON = ("0.32.0",)
# The upstream methods this patch wraps, then those its lean draft pass calls itself,
# with the parameters it was written for.
UPSTREAM_SIGNATURES = {
    "vllm.v1.worker.gpu_model_runner:GPUModelRunner._sample": "(self, logits, spec_decode_metadata)",
    "vllm.v1.worker.gpu_model_runner:GPUModelRunner.propose_draft_token_ids":
        "(self, scheduler_output, sampled_token_ids, sampling_metadata, hidden_states, sample_hidden_states, "
        "aux_hidden_states, spec_decode_metadata, common_attn_metadata, slot_mappings)",
    "vllm.v1.core.sched.scheduler:Scheduler.schedule": "(self, throttle_prefills=False)",
    "vllm.v1.engine.core:EngineCore.post_step": "(self, model_executed)",
    "vllm.v1.worker.gpu_model_runner:GPUModelRunner._get_positions": "(self, num_tokens)",
    "vllm.model_executor.models.llama_eagle3:Eagle3LlamaForCausalLM.combine_hidden_states": "(self, hidden_states)",
    "vllm.model_executor.models.llama_eagle3:LlamaModel.embed_input_ids": "(self, input_ids)",
    "vllm.model_executor.models.llama_eagle3:LlamaDecoderLayer._norm_before_residual": "(self, hidden_states)",
    "vllm.model_executor.models.llama_eagle3:LlamaDecoderLayer._norm_after_residual": "(self, hidden_states)",
    "vllm.v1.attention.backends.cpu_attn:CPUAttentionBackendImpl.do_kv_cache_update":
        "(self, layer, key, value, kv_cache, slot_mapping)",
}

# False in the engine's switches: vLLM's own k=0 steps (on where they do not say).
ZERO_DRAFT_KEY = "zero_draft_steps"

_PATCHED_ATTR = "_dynamo_spec_zero_draft"


def enabled(owner: Any) -> bool:
    """Whether ``owner``'s engine takes the cheap k=0 steps (on where its switches do not say)."""
    return switch(owner, ZERO_DRAFT_KEY, default=True)


def _sample_without_drafts(original):
    @functools.wraps(original)
    def _sample(self, logits, spec_decode_metadata):
        if spec_decode_metadata is None or spec_decode_metadata.max_spec_len != 0 or not enabled(self):
            return original(self, logits, spec_decode_metadata)
        # No request has a draft token in this step: what the runner does without
        # speculation (see GPUModelRunner._sample's `spec_decode_metadata is None` branch).
        self.input_batch.update_async_output_token_ids()
        return self.sampler(logits=logits, sampling_metadata=self.input_batch.sampling_metadata)

    setattr(_sample, _PATCHED_ATTR, True)
    return _sample


def _lean_k0_applies(runner, scheduler_output, sampled_token_ids, spec_decode_metadata,
                     aux_hidden_states) -> bool:
    """Whether this step's draft work is only the KV write, and :func:`_write_draft_kv`
    reproduces what vLLM's first draft pass would write: a k=0 step with no draft token
    scheduled, an EAGLE-3 Llama draft of one layer on a backend that writes its KV
    cache in a separate step, vLLM's padded drafter batch (the path the CPU runner
    takes) and none of the extras that change the draft's inputs; in an engine whose
    switches leave it on."""
    if scheduler_output.num_spec_tokens_to_schedule != 0 or not enabled(runner):
        return False
    if spec_decode_metadata is not None and spec_decode_metadata.max_spec_len != 0:
        return False
    spec = runner.speculative_config
    drafter = runner.drafter
    import torch  # here, not at import: engine/args.py reads this module's switch name

    if (spec is None or spec.method != "eagle3" or spec.disable_padded_drafter_batch
            or not isinstance(sampled_token_ids, torch.Tensor) or sampled_token_ids.shape[-1] != 1
            or aux_hidden_states is None or not runner.use_aux_hidden_state_outputs
            or runner.valid_sampled_token_count_event is not None
            or runner.uses_mrope or runner.supports_mm_inputs):
        return False
    if (getattr(drafter, "needs_extra_input_slots", False) or getattr(drafter, "use_heterogeneous_vocab", False)
            or getattr(drafter, "eplb_state", None) is not None):
        return False
    model = drafter.model
    if "_dynamo_spec_kv_only_applies" not in model.__dict__:
        model.__dict__["_dynamo_spec_kv_only_applies"] = _kv_only_applies(model)
    return model.__dict__["_dynamo_spec_kv_only_applies"]


def _kv_only_applies(model) -> bool:
    """An EAGLE-3 Llama draft of one layer whose attention writes its KV cache in a
    separate step (vLLM's CPU backend does): then the KV write can run alone."""
    from vllm.model_executor.models.llama_eagle3 import Eagle3LlamaForCausalLM

    if type(model) is not Eagle3LlamaForCausalLM or getattr(model, "use_parallel_drafting", False):
        return False
    layers = model.model.layers
    if len(layers) != 1:
        return False
    attn = layers[0].self_attn.attn
    return (not attn.attn_backend.forward_includes_kv_cache_update
            and attn.kv_sharing_target_layer_name is None)


def _draft_inputs(runner, num_tokens: int, sampled_token_ids: torch.Tensor,
                  common_attn_metadata) -> torch.Tensor:
    """The draft's token ids for this step's positions, as vLLM's padded first pass sets
    them (``prepare_next_token_ids_padded`` + ``set_inputs_first_pass``): the target's
    tokens shifted left by one, and at each request's last position its next token, the
    one just sampled, or for a request still in its prefill (discarded sample) the next
    prompt token."""
    import torch

    batch = runner.input_batch
    num_reqs = batch.num_reqs
    next_ids = sampled_token_ids[:num_reqs, 0].to(torch.int32)  # a copy: the sample is not touched
    for i in runner.discard_request_mask.np[:num_reqs].nonzero()[0]:
        req = runner.requests[batch.req_ids[i]]
        next_ids[i] = req.get_token_id(int(batch.num_tokens_no_spec[i]) - 1)
    ids = runner.drafter.input_ids
    ids[:num_tokens - 1] = runner.input_ids.gpu[1:num_tokens]
    ids[common_attn_metadata.query_start_loc[1:num_reqs + 1] - 1] = next_ids
    return ids[:num_tokens]


def _write_draft_kv(model, input_ids: torch.Tensor, positions: torch.Tensor,
                    aux_hidden_states: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write the draft's KV cache for these positions: what Eagle3 LlamaModel.forward ->
    LlamaDecoderLayer.forward (layer 0) -> LlamaAttention.forward -> Attention.forward
    compute before the KV write, and the backend's own KV write. Attention, output
    projection, MLP, final norm and the draft's head, whose results a k=0 step would
    discard, are not run."""
    import torch

    hidden = model.combine_hidden_states(aux_hidden_states)
    inner = model.model
    layer = inner.layers[0]
    embeds = layer.input_layernorm(inner.embed_input_ids(input_ids))
    normed, _ = layer._residual_norm(hidden_states=hidden)
    attn_module = layer.self_attn
    qkv, _ = attn_module.qkv_proj(torch.cat([embeds, normed], dim=-1))
    q, k, v = qkv.split([attn_module.q_size, attn_module.kv_size, attn_module.kv_size], dim=-1)
    _, k = attn_module.rotary_emb(positions, q, k)
    attn = attn_module.attn
    attn.impl.do_kv_cache_update(attn, k.view(-1, attn.num_kv_heads, attn.head_size),
                                 v.view(-1, attn.num_kv_heads, attn.head_size_v),
                                 attn.kv_cache, slot_mapping)


def _propose_kv_only_at_k0(original):
    @functools.wraps(original)
    def propose_draft_token_ids(self, scheduler_output, sampled_token_ids, sampling_metadata,
                                hidden_states, sample_hidden_states, aux_hidden_states,
                                spec_decode_metadata, common_attn_metadata, slot_mappings):
        if not _lean_k0_applies(self, scheduler_output, sampled_token_ids, spec_decode_metadata,
                                aux_hidden_states):
            return original(self, scheduler_output, sampled_token_ids, sampling_metadata,
                            hidden_states, sample_hidden_states, aux_hidden_states,
                            spec_decode_metadata, common_attn_metadata, slot_mappings)
        import torch

        n = scheduler_output.total_num_scheduled_tokens
        with torch.inference_mode():
            input_ids = _draft_inputs(self, n, sampled_token_ids, common_attn_metadata)
            _write_draft_kv(self.drafter.model, input_ids, self._get_positions(n),
                            torch.cat([h[:n] for h in aux_hidden_states], dim=-1),
                            common_attn_metadata.slot_mapping[:n])
        # what vLLM's propose returns for k=0: no draft token for any request
        return torch.empty(self.input_batch.num_reqs, 0, dtype=torch.int64,
                           device=sampled_token_ids.device)

    setattr(propose_draft_token_ids, _PATCHED_ATTR, True)
    return propose_draft_token_ids


def _post_step_skipping_k0(original):
    @functools.wraps(original)
    def post_step(self, model_executed: bool) -> None:
        if getattr(self.scheduler, "_dynamo_spec_last_k", None) == 0:
            return
        return original(self, model_executed)

    setattr(post_step, _PATCHED_ATTR, True)
    return post_step


def _schedule_recording_k(original):
    @functools.wraps(original)
    def schedule(self, *args: Any, **kwargs: Any):
        output = original(self, *args, **kwargs)
        if enabled(self):  # post_step skips the round trip only where this is set
            self._dynamo_spec_last_k = output.num_spec_tokens_to_schedule
        return output

    setattr(schedule, _PATCHED_ATTR, True)
    return schedule


def _patch(owner: type, name: str, wrapper) -> bool:
    current = getattr(owner, name)
    if getattr(current, _PATCHED_ATTR, False):
        return False
    setattr(owner, name, wrapper(current))
    return True


def apply() -> list[str]:
    """Install the changes in this process (idempotent); return what was patched."""
    if not checked(__name__, CHECKED_ON):
        return []
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine.core import EngineCore
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    patched = []
    if _patch(GPUModelRunner, "_sample", _sample_without_drafts):
        patched.append("GPUModelRunner._sample")
    if _patch(GPUModelRunner, "propose_draft_token_ids", _propose_kv_only_at_k0):
        patched.append("GPUModelRunner.propose_draft_token_ids")
    if _patch(Scheduler, "schedule", _schedule_recording_k):
        patched.append("Scheduler.schedule")
    if _patch(EngineCore, "post_step", _post_step_skipping_k0):
        patched.append("EngineCore.post_step")
    return patched
