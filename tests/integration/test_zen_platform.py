"""vLLM resolves its platform through our plugin entry point (dynamo_spec/vllm_patches/zen_platform.py), in a
fresh process as vLLM's own processes do: the Zen CPU platform on an AMD CPU with zentorch, vLLM's
own choice everywhere else and when turned off."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from dynamo_spec.vllm_patches import zen_platform

pytestmark = pytest.mark.integration

PROBE = "from vllm.platforms import current_platform; print('PLATFORM', type(current_platform).__name__)"


def environment(**env: str) -> dict[str, str]:
    """This environment without the two variables that decide the platform, plus `env`."""
    kept = {k: v for k, v in os.environ.items() if k not in ("DYNAMO_SPEC_ZENTORCH", "VLLM_TARGET_DEVICE")}
    return {**kept, **env}


def resolved(**env: str) -> str:
    proc = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300,
                          env=environment(**env))
    lines = [line for line in proc.stdout.splitlines() if line.startswith("PLATFORM ")]
    assert proc.returncode == 0 and lines, (proc.stdout + proc.stderr)[-4000:]
    return lines[-1].split()[1]


def vllm_own_choice() -> str | None:
    from vllm.platforms import cpu_platform_plugin

    return cpu_platform_plugin()


def test_the_platform_vllm_resolves_is_the_plugins_choice():
    own = vllm_own_choice()
    forced = zen_platform.choose(own, zen_platform.is_amd_cpu(), {})
    expected = (forced or own or "").rsplit(".", 1)[-1]
    if not expected:
        pytest.skip("not vLLM's CPU build: the plugin names nothing and vLLM's GPU detection decides")
    assert resolved() == expected


def test_turned_off_vllm_keeps_its_own_choice():
    own = vllm_own_choice()
    if own is None:
        pytest.skip("not vLLM's CPU build")
    assert resolved(DYNAMO_SPEC_ZENTORCH="0") == own.rsplit(".", 1)[-1]


PROBE_ENGINE = """
import sys
from vllm import LLM, SamplingParams
llm = LLM(model=sys.argv[1], dtype=sys.argv[2], max_model_len=256, kv_cache_memory_bytes=64 << 20, enforce_eager=True,
          seed=0)
out = llm.generate(["Hello there", "The capital of"], SamplingParams(max_tokens=8, temperature=0))
print("TOKENS", [len(o.outputs[0].token_ids) for o in out])
"""
ZEN_GEMM_LINE = "CPU unquantized GEMM dispatch: using zentorch_linear_unary"


def run_engine(target: str, dtype: str, **env: str) -> str:
    proc = subprocess.run([sys.executable, "-c", PROBE_ENGINE, target, dtype], capture_output=True, text=True,
                          timeout=600, env=environment(VLLM_LOGGING_LEVEL="DEBUG", **env))
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "TOKENS [8, 8]" in proc.stdout, log[-4000:]
    return log


needs_zen = pytest.mark.skipif(
    not (vllm_own_choice() == zen_platform.CPU_PLATFORM and zen_platform.is_amd_cpu()
         and zen_platform.zentorch_importable()),
    reason="an AMD CPU where vLLM would run its plain CPU platform, with zentorch installed")


@needs_zen
@pytest.mark.parametrize("multiprocessing", ["1", "0"])
def test_fp32_engine_runs_its_linear_layers_on_zentorch(tiny_models, multiprocessing):
    log = run_engine(str(tiny_models["target"]), "float32", VLLM_ENABLE_V1_MULTIPROCESSING=multiprocessing)
    assert ZEN_GEMM_LINE in log


@needs_zen
@pytest.mark.parametrize("multiprocessing", ["1", "0"])
def test_bf16_engine_without_native_bf16_runs_on_onednn(tiny_models, multiprocessing):
    from dynamo_spec.engine.host import detect_host

    if detect_host().native_bf16[0]:
        pytest.skip("this CPU computes bf16 natively: zentorch runs bf16 here")
    log = run_engine(str(tiny_models["target"]), "bfloat16", VLLM_ENABLE_V1_MULTIPROCESSING=multiprocessing)
    assert ZEN_GEMM_LINE not in log  # and it answered (zentorch's bf16 path would have raised)
