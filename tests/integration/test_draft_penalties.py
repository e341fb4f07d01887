"""The draft drafts under the request's penalties (dynamo_spec/vllm_patches/draft_penalties.py), in a
real engine on a fixture whose answers under a penalty are known.

The fixed target's logits are all exactly 0.0 (support/tiny_models.py): greedy, it emits token 0
forever; under a presence or frequency penalty (output tokens only) each emitted token drops below
the others, so it emits 0, 1, 2, ... (the lowest id not emitted yet). The draft here is the
always-accepting one over the whole target vocabulary (all its logits 0.0, no d2t): without
the request's penalty it proposes token 0 at every position, which the target refuses after the
first token; with it, it proposes what the target will choose. So, exactly:

- no penalty: every draft is accepted, with the draft-side penalties on or off;
- a penalty, draft-side off: no draft is accepted after the first token;
- a penalty, draft-side on: every draft is accepted;
and the output is the same in all cases.
"""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.integration

K = 3
STEPS = 8
MAX_TOKENS = 1 + STEPS * (K + 1)  # the prefill's token, then whole steps of K drafts + 1
REQUESTS = [("none", {}), ("presence", {"presence_penalty": 0.5}), ("frequency", {"frequency_penalty": 0.5}),
            ("presence, longer prompt", {"presence_penalty": 1.0})]
PROMPTS = ["Tell me a story.", "Count to ten.", "List the days of the week.",
           "A longer prompt, so that the rows of the batch have prompts of other lengths."]


@pytest.fixture(scope="module")
def full_vocab_draft(tiny_models, tmp_path_factory):
    from support.tiny_models import build_eagle3_draft

    target = tiny_models["fixed_target"]
    vocab = json.loads((target / "config.json").read_text())["vocab_size"]
    return build_eagle3_draft(tmp_path_factory.mktemp("full-vocab-draft"), target, mode="always",
                              draft_vocab_size=vocab)


def generate(tiny_models, draft, draft_penalties: bool) -> dict[str, tuple[list[int], dict]]:
    """The requests together in one engine: each one's tokens and speculative figures."""
    from vllm import SamplingParams

    from dynamo_spec.training.offline_llm import offline_llm

    with offline_llm(tiny_models["fixed_target"], draft=draft, k=K, max_model_len=256, kv_cache_bytes=64 << 20,
                     max_num_seqs=8, draft_penalties=draft_penalties, per_request_spec_decode_metrics="summary",
                     generation_config="vllm") as llm:
        params = [SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, **p) for _, p in REQUESTS]
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
    return {name: (list(o.outputs[0].token_ids), o.outputs[0].spec_decode_metrics.to_dict())
            for (name, _), o in zip(REQUESTS, outs)}


@pytest.fixture(scope="module")
def runs(tiny_models, full_vocab_draft):
    return {on: generate(tiny_models, full_vocab_draft, on) for on in (False, True)}


def test_the_output_is_the_targets_whatever_the_draft_proposes(runs):
    for on, results in runs.items():
        assert results["none"][0] == [0] * MAX_TOKENS, on
        for name in ("presence", "frequency", "presence, longer prompt"):
            assert results[name][0] == list(range(MAX_TOKENS)), (on, name)


@pytest.mark.parametrize("on", [False, True], ids=["draft-side off", "draft-side on"])
def test_acceptance_is_exactly_the_predicted_count(runs, on):
    results = runs[on]
    stats = results["none"][1]
    assert (stats["num_draft_tokens"], stats["num_accepted_draft_tokens"]) == (K * STEPS, K * STEPS)
    for name in ("presence", "frequency", "presence, longer prompt"):
        stats = results[name][1]
        if on:  # every step: K drafts, all accepted
            assert (stats["num_draft_tokens"], stats["num_accepted_draft_tokens"]) == (K * STEPS, K * STEPS), name
        else:  # one token a step after the first: MAX_TOKENS - 1 steps of K drafts, none accepted
            assert (stats["num_draft_tokens"], stats["num_accepted_draft_tokens"]) == (K * (MAX_TOKENS - 1), 0), name
