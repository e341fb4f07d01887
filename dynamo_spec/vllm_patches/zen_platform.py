"""Patch (a ``vllm.platform_plugins`` entry point): vLLM's own Zen CPU platform (zentorch GEMMs)
on every AMD CPU, with zentorch's GEMMs only for the dtypes it computes.

Upstream: vLLM's built-in CPU platform plugin, ``vllm.platforms.cpu_platform_plugin``, names
``vllm.platforms.zen_cpu.ZenCpuPlatform`` (its CPU platform with the linear layers routed to
AMD's zentorch: prepacked weights, ZenDNN kernels) only on AMD CPUs with AVX-512
(``vllm.platforms._is_amd_zen_cpu``). AMD hosts without AVX-512 (Zen 2 and Zen 3, common
cloud VMs) get the generic CPU platform and oneDNN, although zentorch's fp32 GEMMs are faster
there at the few rows a decoding step multiplies. And ``ZenCpuPlatform`` routes every dtype to
zentorch, which computes bf16 only on CPUs with AVX512-BF16 ("zentorch_matmul bf16 path needs
the cpu support avx512bf16"; oneDNN emulates it elsewhere) and fp16 nowhere: a bf16 model
(an explicit ``engine.dtype``, the tests' tiny fixtures, ``verify``'s default) on such a host
fails at its first forward.

Change: :func:`platform_plugin` names ``CheckedZenCpuPlatform`` (``zen_cpu_platform.py``:
``ZenCpuPlatform`` with ``is_zen_cpu`` and ``check_and_update_config`` overridden) when vLLM
would pick its plain CPU platform on an AMD CPU and zentorch imports. Everywhere else it names
nothing and vLLM's own choice stands: GPUs, Intel CPUs, AMD CPUs that vLLM already gives the
Zen platform, machines without zentorch. ``DYNAMO_SPEC_ZENTORCH=0`` turns it off (vLLM's
oneDNN path, for A/B runs); so does ``VLLM_TARGET_DEVICE=cpu``, with which vLLM skips platform
plugins. The platform's ``check_and_update_config`` (vLLM calls it where the engine's config is
built, before the engine's processes start) sees the model's dtype: fp16, or bf16 on a CPU
without native bf16, turns the Zen GEMMs off in that process and sets
``DYNAMO_SPEC_ZENTORCH=0`` for the engine's processes, which then run vLLM's plain CPU platform.
vLLM calls platform plugins in every process before it resolves ``current_platform``; this
module must not touch ``current_platform`` itself.

Checked on vLLM 0.32.0 (``CHECKED_ON``). Goes away when vLLM selects its Zen platform on AMD
CPUs without AVX-512 and sends zentorch only the dtypes the host's zentorch computes.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path

import torch

from dynamo_spec.engine.host import Host
from dynamo_spec.vllm_patches._upstream import checked

CHECKED_ON = ("0.32.0",)
# The upstream functions whose choice this plugin overrides, and the methods CheckedZenCpuPlatform
# overrides, with the parameters it was written for.
UPSTREAM_SIGNATURES = {
    "vllm.platforms:cpu_platform_plugin": "()",
    "vllm.platforms.zen_cpu:ZenCpuPlatform.is_zen_cpu": "(self)",
    "vllm.platforms.zen_cpu:ZenCpuPlatform.check_and_update_config": "(vllm_config)",  # a classmethod
}

# In its own module: vLLM's CPU platform code is imported only where this platform is chosen.
ZEN_PLATFORM = "dynamo_spec.vllm_patches.zen_cpu_platform.CheckedZenCpuPlatform"
CPU_PLATFORM = "vllm.platforms.cpu.CpuPlatform"
ENV = "DYNAMO_SPEC_ZENTORCH"


def zentorch_importable() -> bool:
    try:
        import zentorch  # noqa: F401
    except (ImportError, OSError):  # OSError: a build that does not match this torch
        return False
    return True


def is_amd_cpu(cpuinfo: Path = Path("/proc/cpuinfo")) -> bool:
    try:
        return "AuthenticAMD" in cpuinfo.read_text()
    except OSError:
        return False


def choose(vllm_choice: str | None, amd: bool, environ: Mapping[str, str],
           importable: Callable[[], bool] = zentorch_importable) -> str | None:
    """The platform to force, or None to leave vLLM's choice (``vllm_choice``: what
    vLLM's own CPU detection names, None when vLLM is not running on the CPU)."""
    if vllm_choice != CPU_PLATFORM or not amd or environ.get(ENV, "1") == "0":
        return None
    return ZEN_PLATFORM if importable() else None


def platform_plugin() -> str | None:
    """The ``vllm.platform_plugins`` entry point."""
    if not checked(__name__, CHECKED_ON):
        return None
    from vllm.platforms import cpu_platform_plugin

    try:
        vllm_choice = cpu_platform_plugin()
    except Exception:  # noqa: BLE001 - detection must never break vLLM's start
        return None
    return choose(vllm_choice, is_amd_cpu(), os.environ)


def zen_gemm_works(dtype: torch.dtype, host: Host) -> bool:
    """zentorch computes fp32 everywhere, bf16 only with native bf16 (AVX512-BF16), fp16 nowhere."""
    return dtype == torch.float32 or (dtype == torch.bfloat16 and host.native_bf16[0])
