"""The suffix mix in a real engine (dynamo_spec/vllm_patches/suffix_mix.py), offline in this process.

Greedy: the tiny random target and its random draft (acceptance ~0, so every accepted draft token
is the tree's), engines with the mix on and off answering the same 16 prompts one by one, four at
a time and all together. The mix's engine has seen each prompt's answer by the second pass, so the
tree drafts long continuations there, in batches that mix lengths 16 and 3: the output must be the
same token for token, and the repeats must accept the tree's drafts.

Sampled: the preference target (the same logits at every position whatever the input,
``build_preference_target``), so each answer token is an independent draw from one known
distribution; the tree (min_score 0) drafts continuations of earlier sampled answers, which the
rejection sampler must neither favour nor refuse: the tokens' frequencies match the distribution
(chi-square), with most verify steps drafted by the tree.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

pytestmark = pytest.mark.integration

K = 3
MAX_TOKENS = 48
SUFFIX = {"enabled": True, "max_tokens": 16, "min_score": 1.0}
PROMPTS = [[5 + i, 40 + 3 * i, 90 + i, 7, 200 + 5 * i] for i in range(16)]


def _generate(llm, prompts: list[list[int]], at_once: int) -> list[tuple[list[int], dict]]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    results = []
    for i in range(0, len(prompts), at_once):
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts[i:i + at_once]],
                            SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True), use_tqdm=False)
        results += [(list(o.outputs[0].token_ids), o.outputs[0].spec_decode_metrics.to_dict()) for o in outs]
    return results


@pytest.fixture(scope="module")
def greedy(tiny_models):
    """Per engine (mix on, off): the 16 prompts at 1, 4 and 16 at once; the mix's per-source counts."""
    from dynamo_spec.training.offline_llm import offline_llm
    from support.in_process import in_process_engines

    results = {}
    for mix in (True, False):
        with in_process_engines(), offline_llm(
                tiny_models["target"], draft=tiny_models["draft"], k=K, max_model_len=512, kv_cache_bytes=64 << 20,
                max_num_seqs=16, dtype="float32", per_request_spec_decode_metrics="summary", generation_config="vllm",
                suffix=SUFFIX if mix else None) as llm:
            results[mix] = {n: _generate(llm, PROMPTS, n) for n in (1, 4, 16)}
            if mix:
                results["counts"] = llm.llm_engine.engine_core.engine_core.dynamo_spec_suffix()
    return results


@pytest.mark.parametrize("n", [1, 4, 16])
def test_greedy_output_is_the_same_with_the_mix_on_and_off(greedy, n):
    # the random target's greedy answer depends on the prompt: a mix that changed output would show
    assert len({tuple(tokens) for tokens, _ in greedy[False][n]}) == len(PROMPTS)
    for i, ((on, _), (off, _)) in enumerate(zip(greedy[True][n], greedy[False][n])):
        assert on == off, (n, i)


@pytest.mark.parametrize("n", [4, 16])
def test_a_repeated_answer_is_drafted_by_the_tree_and_accepts_its_long_drafts(greedy, n):
    """Every prompt's answer is in the tree after the first pass: the repeats take a few steps of up to
    16 tokens, nearly all accepted, where the random draft alone (the engine without the mix) accepts
    next to nothing. (The first pass gains too where the random target's answer repeats itself.)"""
    for (_, alone), (_, again) in zip(greedy[False][n], greedy[True][n]):
        assert again["num_spec_steps"] <= MAX_TOKENS // 4, again
        assert again["num_accepted_draft_tokens"] >= 0.8 * (MAX_TOKENS - 1 - again["num_spec_steps"]), again
        assert alone["num_draft_tokens"] > 0 and alone["mean_acceptance_length"] < 1.5, alone
        assert again["mean_acceptance_length"] > 3 * alone["mean_acceptance_length"], (alone, again)


def test_the_engine_counts_each_sources_drafts(greedy):
    suffix, draft = greedy["counts"]["suffix"], greedy["counts"]["draft"]
    assert suffix["steps"] > 0 and suffix["accepted_tokens"] >= 0.8 * suffix["draft_tokens"]
    assert draft["steps"] > 0 and draft["draft_tokens"] == K * draft["steps"]
    total = sum(s["num_accepted_draft_tokens"] for n in (1, 4, 16) for _, s in greedy[True][n])
    assert suffix["accepted_tokens"] + draft["accepted_tokens"] == total


PREFERENCES = {20: 8.0, 21: 7.5, 22: 7.0, 23: 6.5}
VOCAB = 512
SAMPLED_REQUESTS = 300
SAMPLED_TOKENS = 12


def test_sampled_tokens_keep_the_targets_distribution(tmp_path_factory):
    """Temperature 1 on the preference target: each token an independent draw from softmax(logits),
    whatever the tree proposes. Chi-square over the four preferred tokens and the rest (4 degrees of
    freedom, p = 0.001: 18.47)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from dynamo_spec.training.offline_llm import offline_llm
    from support.in_process import in_process_engines
    from support.tiny_models import build_preference_draft, build_preference_target

    root = tmp_path_factory.mktemp("suffix-preference")
    target = build_preference_target(root / "target", PREFERENCES)
    draft = build_preference_draft(root / "draft", target, PREFERENCES)
    with in_process_engines(), offline_llm(
            target, draft=draft, k=K, max_model_len=256, kv_cache_bytes=64 << 20, max_num_seqs=16, dtype="float32",
            per_request_spec_decode_metrics="summary", generation_config="vllm",
            suffix={"enabled": True, "max_tokens": 8, "min_score": 0.0}) as llm:
        outs = llm.generate([TokensPrompt(prompt_token_ids=[1, 2, 3])] * SAMPLED_REQUESTS,
                            [SamplingParams(temperature=1.0, top_p=1.0, top_k=0, max_tokens=SAMPLED_TOKENS,
                                            ignore_eos=True, seed=seed) for seed in range(SAMPLED_REQUESTS)],
                            use_tqdm=False)
        counts = llm.llm_engine.engine_core.engine_core.dynamo_spec_suffix()
    tokens = [t for o in outs for t in o.outputs[0].token_ids]
    logits = np.zeros(VOCAB)
    for token, value in PREFERENCES.items():
        logits[token] = value
    p = np.exp(logits) / np.exp(logits).sum()
    observed = np.array([tokens.count(t) for t in PREFERENCES] + [sum(t not in PREFERENCES for t in tokens)])
    expected = np.array([p[t] for t in PREFERENCES] + [1 - sum(p[t] for t in PREFERENCES)]) * len(tokens)
    chi2 = float(((observed - expected) ** 2 / expected).sum())
    assert chi2 < 18.47 and not math.isnan(chi2), (observed, expected, chi2)
    # the tree drafted most steps and some of its drafts were accepted, some refused
    assert counts["suffix"]["steps"] > counts["draft"]["steps"], counts
    assert 0 < counts["suffix"]["accepted_tokens"] < counts["suffix"]["draft_tokens"], counts
