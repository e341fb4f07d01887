"""``CheckedZenCpuPlatform``: vLLM's Zen CPU platform with zentorch's GEMMs only for the dtypes
zentorch computes. Part of the ``zen_platform`` patch, which says why and holds its version guard
and upstream signatures; in a module of its own so that vLLM's platform code is imported only
where the plugin (on a vLLM it was checked on) names this platform."""

from __future__ import annotations

import os

from vllm.platforms.zen_cpu import ZenCpuPlatform

from dynamo_spec.engine.host import detect_host
from dynamo_spec.vllm_patches.zen_platform import ENV, zen_gemm_works


class CheckedZenCpuPlatform(ZenCpuPlatform):
    """vLLM's Zen CPU platform, with zentorch's GEMMs turned off for a model they cannot run."""

    zen_gemm = True  # class-wide: vLLM reads it through its one platform instance

    def is_zen_cpu(self) -> bool:
        return type(self).zen_gemm

    @classmethod
    def check_and_update_config(cls, vllm_config) -> None:  # noqa: ANN001 - vLLM's VllmConfig
        super().check_and_update_config(vllm_config)
        model_config = getattr(vllm_config, "model_config", None)
        if model_config is None:
            return
        works = zen_gemm_works(model_config.dtype, detect_host())
        cls.zen_gemm = works
        # The engine's processes, started after this, resolve their platform from the environment.
        # This platform is active, so the variable was not "0" when it was chosen: a "0" now is ours.
        if not works:
            os.environ[ENV] = "0"
        elif os.environ.get(ENV) == "0":
            del os.environ[ENV]
