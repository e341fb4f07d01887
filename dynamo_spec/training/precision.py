"""The dtype the training tools compute in: the target's prefill pass over the rows (its
hidden states) and the draft's training loop. Both run on the CPU in torch, so they follow
the host as a CPU engine does (``engine/host.py``): bf16 only where the CPU computes it
natively, else fp32. On a CPU without native bf16 torch emulates it: its bf16 matrix product
ran at 0.7 GFLOP/s against 127 in fp32 on an AVX2-only EPYC (issue 58), so bf16 there made
the states pass 4x and a training step 20x slower."""

from __future__ import annotations

import os

from ..engine.host import Host, cpu_info, resolve_dtype

CHOICES = ("auto", "bfloat16", "float32")


def cpu_host() -> Host:
    """This machine's CPU as :func:`..engine.host.resolve_dtype` reads it (no import of vLLM:
    the training tools compute on the CPU whatever platform vLLM serves on)."""
    model, flags = cpu_info()
    return Host(on_cpu=True, cpu_model=model, cpu_flags=flags, environ=dict(os.environ))


def training_dtype(requested: str = "auto", host: Host | None = None) -> tuple[str, str]:
    """(``bfloat16`` or ``float32``, why): ``auto`` follows the host's native bf16, an explicit
    dtype wins."""
    if requested not in CHOICES:
        raise ValueError(f"dtype must be one of {', '.join(CHOICES)}, not {requested!r}")
    if requested != "auto":
        return requested, "as asked"
    dtype, why = resolve_dtype("auto", host or cpu_host())
    return dtype, why or "auto"
