"""A request with a ``seed`` whose prompt is prefilled in chunks, on the real CPU engine
(tiny target + EAGLE-3 draft, as the server runs it; here in the test's process:
support/in_process.py): vLLM 0.32 rewinds the request's generator with a CUDA-only call and the
worker dies (dynamo_spec/vllm_patches/seeded_sampling.py)."""

from __future__ import annotations

import pytest

from dynamo_spec.training.offline_llm import offline_llm
from support.in_process import in_process_engines

pytestmark = pytest.mark.integration

PROMPT = list(range(5, 105))  # 100 tokens: four steps of a 32-token budget


def _answers(models, seeds, **engine) -> list[list[int]]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = [SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True, seed=s) for s in seeds]
    with in_process_engines(), offline_llm(models["target"], draft=models["draft"], k=3, dtype="float32",
                                           max_num_seqs=4, max_model_len=512, kv_cache_bytes=128 * 2**20,
                                           **engine) as llm:
        outs = llm.generate([TokensPrompt(prompt_token_ids=PROMPT)] * len(seeds), params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def test_a_seed_survives_a_chunked_prefill_and_gives_the_answer_of_a_whole_one(tiny_models):
    chunked = _answers(tiny_models, [7, 7, 8], enable_chunked_prefill=True, max_num_batched_tokens=32)
    whole = _answers(tiny_models, [7, 7, 8], enable_chunked_prefill=False, max_num_batched_tokens=2048)
    assert chunked[0] == chunked[1] and chunked[0] != chunked[2]  # the seed is what decides
    assert chunked == whole  # the dropped samples of the chunked steps left no trace
