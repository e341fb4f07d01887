"""Random sampling (temperature > 0) with speculative decoding on vLLM's CPU build: one
tiny engine (in the test's process, support/in_process.py) with the plugin
(dynamo_spec.vllm_patches.cpu_expand_kernel) loaded as vLLM loads it in a worker.
The kernel-level tests of the fix are in tests/unit/test_cpu_rejection_sampler.py.
"""

from __future__ import annotations

from importlib.metadata import entry_points
from pathlib import Path

import pytest

from support.engine import generate_one_by_one

pytestmark = pytest.mark.integration

pytest.importorskip("vllm")

def _plugin_entry_point_installed() -> bool:
    return any(
        ep.value.startswith("dynamo_spec.vllm_patches")
        for ep in entry_points(group="vllm.general_plugins")
    )


@pytest.mark.skipif(
    not _plugin_entry_point_installed(),
    reason="dynamo_spec.vllm_patches.cpu_expand_kernel is not registered as a vllm.general_plugins "
    "entry point (pyproject) in this environment",
)
def test_engine_low_temperature_sampling_with_eagle3_follows_target(
    tiny_models: dict[str, Path],
) -> None:
    """Temperature 0.05 (random path, not greedy) must pick the target's top token.

    With the CPU bug, the temperatures are garbage and the picks look uniform over
    the 512-token vocabulary (top-1 rate ~0); correct sampling picks the top token
    almost always.
    """
    from vllm import SamplingParams

    args = dict(
        model=str(tiny_models["target"]),
        speculative_config={
            "method": "eagle3",
            "model": str(tiny_models["draft"]),
            "num_speculative_tokens": 3,
        },
        enforce_eager=True,
        kv_cache_memory_bytes=256 * 2**20,
        max_model_len=512,
        dtype="float32",
        seed=0,
    )
    params = SamplingParams(
        temperature=0.05, max_tokens=48, ignore_eos=True, logprobs=1, seed=1
    )
    prompts = ["What is the capital of France?", "Write a poem about the sea."]

    ranks = []
    for final in generate_one_by_one(args, prompts, params):
        comp = final.outputs[0]
        for tok, lp in zip(comp.token_ids, comp.logprobs):
            ranks.append(lp[tok].rank)
    # Tokens after the first come from speculative verification steps.
    top1 = sum(r == 1 for r in ranks) / len(ranks)
    print(f"top-1 rate at temperature 0.05 with EAGLE-3: {top1:.3f} of {len(ranks)}")
    assert top1 > 0.8, (top1, ranks)
