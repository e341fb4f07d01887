"""Patch: a seeded request whose prefill is split across steps no longer kills a CPU engine.

Upstream: a request that sets ``seed`` gets its own ``torch.Generator``. While its prompt is
prefilled in chunks (chunked prefill, or any step whose token budget cuts the prompt), each
step still samples a token for it and then drops it; ``GPUModelRunner._bookkeeping_sync``
rewinds the generator as if nothing was sampled with ``gen.set_offset(gen.get_offset() - 4)``,
a detail of CUDA's Philox generator. A CPU generator has no offset: both calls raise
``RuntimeError: CPU Generator does not use offset``, the worker dies, and with it every
request in flight (the server turns unhealthy and stops). Any client that sends the OpenAI
``seed`` field with a prompt longer than what is left of a step's token budget triggers it.

Change: before ``sample_tokens``, the state of each CPU generator of a request whose sample
will be dropped is saved (``get_state``); ``_bookkeeping_sync`` runs with those generators
out of its sight, then they get the saved state back: the dropped sample leaves the generator
exactly as it was, as the CUDA rewind does, so a seed gives the same answer however its prompt
was chunked. CUDA generators are left to vLLM's own rewind.

Checked on vLLM 0.32.0 (``CHECKED_ON``). Goes away when vLLM rewinds generators that have no
offset (tests/integration/test_seeded_sampling.py fails without it).
"""

from __future__ import annotations

import functools

from dynamo_spec.vllm_patches._upstream import checked, wrap_method

CHECKED_ON = ("0.32.0",)
UPSTREAM_SIGNATURES = {
    "vllm.v1.worker.gpu_model_runner:GPUModelRunner.sample_tokens": "(self, grammar_output)",
    "vllm.v1.worker.gpu_model_runner:GPUModelRunner._bookkeeping_sync":
        "(self, scheduler_output, sampler_output, logits, hidden_states, num_scheduled_tokens)",
}

_MARK = "_dynamo_spec_seeded_sampling"
_SAVED = "_dynamo_spec_dropped_generator_states"


def _dropped_cpu_states(runner) -> dict[int, object]:
    """Batch index -> generator state, for the requests whose sample this step drops (their
    prefill is not complete) and whose generator is a CPU one."""
    import numpy as np

    batch = runner.input_batch
    if not batch.generators:
        return {}
    dropped = np.nonzero(runner.discard_request_mask.np[:batch.num_reqs])[0]
    states = {}
    for i in map(int, dropped):
        gen = batch.generators.get(i)
        if gen is not None and gen.device.type == "cpu":
            states[i] = gen.get_state()
    return states


def _saving_states(original):
    @functools.wraps(original)
    def sample_tokens(self, grammar_output):
        setattr(self, _SAVED, _dropped_cpu_states(self))
        try:
            return original(self, grammar_output)
        finally:
            setattr(self, _SAVED, None)

    setattr(sample_tokens, _MARK, True)
    return sample_tokens


def _restoring_states(original):
    @functools.wraps(original)
    def _bookkeeping_sync(self, *args, **kwargs):
        saved = getattr(self, _SAVED, None) or {}
        generators = self.input_batch.generators
        hidden = {i: generators.pop(i) for i in saved if i in generators}
        try:
            return original(self, *args, **kwargs)
        finally:
            for i, gen in hidden.items():
                gen.set_state(saved[i])
                generators[i] = gen

    setattr(_bookkeeping_sync, _MARK, True)
    return _bookkeeping_sync


def apply() -> list[str]:
    """Install both wrappers in this process (idempotent); return what was patched."""
    if not checked(__name__, CHECKED_ON):
        return []
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    patched = []
    if wrap_method(GPUModelRunner, "sample_tokens", _saving_states, _MARK):
        patched.append("GPUModelRunner.sample_tokens")
    if wrap_method(GPUModelRunner, "_bookkeeping_sync", _restoring_states, _MARK):
        patched.append("GPUModelRunner._bookkeeping_sync")
    return patched
