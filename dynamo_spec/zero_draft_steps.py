"""Cheaper k=0 steps in a speculative vLLM engine (installed by dynamo_spec.vllm_plugin).

Why this exists (vLLM 0.32, model runner v1, the runner vLLM uses on CPU):
    With a batch-size schedule (``num_speculative_tokens_per_batch_size``) vLLM turns
    drafting off (k=0) for large batches, but a speculative engine still pays for
    speculation in those steps: the CPU default's schedule, k=0 from 6 requests, served
    0.81-0.94x of an engine started without speculation there. A py-spy profile of the
    worker (CPU default, 32 requests, k=0 everywhere) showed three costs:

    1. The runner samples through the rejection sampler whenever a speculative config
       exists (``_prepare_inputs`` builds ``SpecDecodeMetadata`` even when no request
       has a draft token): the plain sampler plus a gather of every logits row, a full
       float32 copy of them and an empty rejection pass. ``_sample``: 5.0 % of the
       worker's time, against 2.2 % without speculation.
    2. The draft model's first pass (5.3 %), run only to fill the draft's KV cache for
       these positions, so that drafting can resume when the batch shrinks.
    3. EngineCore asks the worker for draft tokens after every step
       (``take_draft_token_ids``, a round trip to the worker process), even after a
       step scheduled with k=0, whose answer is empty lists.

What this module changes (the output stays token for token the same; tests pin it
against vLLM's own path):
    1. ``GPUModelRunner._sample``: a step in which no request has a draft token
       (``spec_decode_metadata.max_spec_len == 0``) samples with the plain sampler, as
       an engine without speculation does. The logits are then one row per request in
       request order, the rows the rejection sampler would have gathered, and the
       plain sampler's output has the same shape, dtype (``[num_reqs, 1]``, int32) and
       logprobs layout.
    2. ``SpecDecodeBaseProposer.propose`` / ``Eagle3LlamaForCausalLM.forward``: for an
       EAGLE-3 Llama draft of one layer (the usual shape, ours included) on an
       attention backend that writes the KV cache in a separate step (vLLM's CPU
       backend does), the k=0 draft pass runs only what writes the draft's KV cache:
       embedding, the two input norms, the QKV projection, rotary embedding and vLLM's
       own KV write. Attention, output projection, MLP and final norm, whose results a
       k=0 step discards, are skipped. The cache gets the same values (the same modules
       on the same inputs), so later drafts are those vLLM would have made. Other
       drafts and backends keep vLLM's full pass.
    3. ``EngineCore.post_step``: no ``take_draft_token_ids`` after a step scheduled
       with k=0 (the scheduler cleared the scheduled requests' draft tokens when it
       scheduled the step).

Measured through the server (benchmarks/k0_cost.py, docs/bench-cpu-default.md): a k=0
engine went from 0.86-0.90x to 0.91-0.95x of an engine without speculation; the rest of
the gap is native worker time not pinned down yet.

Not done: skipping the draft pass altogether (tried). It leaves holes in the draft's KV
cache that drafting reads once the batch shrinks, and that later requests inherit
through the prefix cache (a system prompt first served under load would lower
acceptance for every later request).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

_PATCHED_ATTR = "_dynamo_spec_zero_draft"


def _sample_without_drafts(original):
    @functools.wraps(original)
    def _sample(self, logits, spec_decode_metadata):
        if spec_decode_metadata is None or spec_decode_metadata.max_spec_len != 0:
            return original(self, logits, spec_decode_metadata)
        # No request has a draft token in this step: what the runner does without
        # speculation (see GPUModelRunner._sample's `spec_decode_metadata is None` branch).
        self.input_batch.update_async_output_token_ids()
        return self.sampler(logits=logits, sampling_metadata=self.input_batch.sampling_metadata)

    setattr(_sample, _PATCHED_ATTR, True)
    return _sample


def _propose_writing_kv_only_at_k0(original):
    @functools.wraps(original)
    def propose(self, num_speculative_tokens, *args: Any, **kwargs: Any):
        model = self.model
        if "_dynamo_spec_kv_only_applies" not in model.__dict__:
            model.__dict__["_dynamo_spec_kv_only_applies"] = _kv_only_applies(model)
        model.__dict__["_dynamo_spec_kv_only"] = (num_speculative_tokens == 0
                                                  and model.__dict__["_dynamo_spec_kv_only_applies"])
        try:
            return original(self, num_speculative_tokens, *args, **kwargs)
        finally:
            model.__dict__["_dynamo_spec_kv_only"] = False

    setattr(propose, _PATCHED_ATTR, True)
    return propose


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


def _forward_kv_only_at_k0(original):
    @functools.wraps(original)
    def forward(self, input_ids, positions, hidden_states, inputs_embeds=None):
        if not self.__dict__.get("_dynamo_spec_kv_only"):
            return original(self, input_ids, positions, hidden_states, inputs_embeds)
        from vllm.model_executor.layers.attention.attention import unified_kv_cache_update

        # What Eagle3 LlamaModel.forward -> LlamaDecoderLayer.forward (layer 0) ->
        # LlamaAttention.forward -> Attention.forward compute before the KV write.
        inner = self.model
        layer = inner.layers[0]
        embeds = inputs_embeds if inputs_embeds is not None else inner.embed_input_ids(input_ids)
        embeds = layer.input_layernorm(embeds)
        normed, _ = layer._residual_norm(hidden_states=hidden_states)
        attn_module = layer.self_attn
        qkv, _ = attn_module.qkv_proj(torch.cat([embeds, normed], dim=-1))
        q, k, v = qkv.split([attn_module.q_size, attn_module.kv_size, attn_module.kv_size], dim=-1)
        q, k = attn_module.rotary_emb(positions, q, k)
        attn = attn_module.attn
        unified_kv_cache_update(k.view(-1, attn.num_kv_heads, attn.head_size),
                                v.view(-1, attn.num_kv_heads, attn.head_size_v), attn.layer_name)
        # The k=0 step reads no draft output; shapes as the full pass returns them.
        unused = hidden_states.new_empty(hidden_states.shape)
        return unused, unused

    setattr(forward, _PATCHED_ATTR, True)
    return forward


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
    from vllm.model_executor.models.llama_eagle3 import Eagle3LlamaForCausalLM
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine.core import EngineCore
    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    patched = []
    if _patch(GPUModelRunner, "_sample", _sample_without_drafts):
        patched.append("GPUModelRunner._sample")
    if _patch(SpecDecodeBaseProposer, "propose", _propose_writing_kv_only_at_k0):
        patched.append("SpecDecodeBaseProposer.propose")
    if _patch(Eagle3LlamaForCausalLM, "forward", _forward_kv_only_at_k0):
        patched.append("Eagle3LlamaForCausalLM.forward")
    if _patch(Scheduler, "schedule", _schedule_recording_k):
        patched.append("Scheduler.schedule")
    if _patch(EngineCore, "post_step", _post_step_skipping_k0):
        patched.append("EngineCore.post_step")
    return patched
