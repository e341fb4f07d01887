"""The draft drafts under the request's penalties (dynamo_spec/vllm_patches/draft_penalties.py), in a
real engine on a fixture whose answers under each penalty are known.

The target's logits are the same at every position whatever the input (support/tiny_models.py,
``build_preference_target``): PREFERENCES for six tokens, 0.0 for the others, so greedy without a
penalty emits token 20 forever; under a presence, frequency or repetition penalty each emitted (for
repetition: or prompted) token drops, and the answer is the sequence that vLLM's own
``apply_all_penalties`` gives step by step (:func:`target_answer`; the values are chosen so that
the arithmetic is exact in bf16 and no two candidates tie). The draft's logits are the target's at
every draft position (``build_preference_draft``, whole target vocabulary), so:

- draft-side on: it proposes what the target will choose, every draft is accepted;
- draft-side off: it proposes token 20 at every position, accepted only where the target chooses 20
  (:func:`acceptance_drafting`: exact counts, fewer for every penalised request here);
- no penalty: every draft is accepted either way; the output is the target's in all cases.
The draft-side-on engine runs with ``use_local_argmax_reduction`` as the CPU default ships it (the patch
builds the full logits there); a third drafts after vLLM's bookkeeping (``disable_padded_drafter_batch``:
the output lists already hold the step's tokens, which must count once, or the frequency request's drafts
go wrong). The requests run in one batch per engine (penalties are per request): three engines in all.
"""

from __future__ import annotations

import functools

import pytest

pytestmark = pytest.mark.integration

K = 3
STEPS = 6
MAX_TOKENS = 1 + STEPS * (K + 1)  # the prefill's token, then whole steps of K drafts + 1 (all accepted)
# Values bf16 holds exactly, pairwise apart by a non-multiple of 0.75 (the penalties below are
# multiples of it, repetition halves): every penalised candidate stays >= 0.125 from the next.
PREFERENCES = {20: 8.0, 21: 7.375, 22: 6.75, 23: 6.125, 24: 5.5, 25: 4.875}
FAVOURITE = 20
# name: prompt token ids, penalties. The repetition request's prompt holds its two favourite tokens.
REQUESTS = {
    "none": ([1, 2, 3], {}),
    "presence": ([1, 2, 3, 4, 5], {"presence_penalty": 1.5}),
    "frequency": ([6, 7], {"frequency_penalty": 0.75}),
    "repetition": ([20, 9, 21, 10], {"repetition_penalty": 2.0}),
}


def target_answer(prompt: list[int], penalties: dict, n: int) -> list[int]:
    """The target's first ``n`` greedy tokens under ``penalties``, by vLLM's own penalty function."""
    import torch
    from vllm.v1.sample.ops.penalties import apply_all_penalties

    vocab = 512
    answer: list[int] = []
    for _ in range(n):
        logits = torch.zeros(1, vocab)
        for token, value in PREFERENCES.items():
            logits[0, token] = value
        logits = apply_all_penalties(logits, torch.tensor([prompt]),
                                     torch.tensor([penalties.get("presence_penalty", 0.0)]),
                                     torch.tensor([penalties.get("frequency_penalty", 0.0)]),
                                     torch.tensor([penalties.get("repetition_penalty", 1.0)]), [answer])
        top = logits[0].topk(2)
        assert top.values[0] - top.values[1] >= 0.125  # no near-tie: bf16 and fp32 agree
        answer.append(int(top.indices[0]))
    return answer


def acceptance_drafting(answer: list[int], draft, max_tokens: int) -> tuple[int, int]:
    """(drafted, accepted) of a greedy request whose target answers ``answer`` while the draft proposes
    ``draft(position)`` tokens at each step; vLLM counts every verified step in full."""
    position, drafted, accepted = 1, 0, 0  # the prefill's token first
    while position < max_tokens:
        proposals = draft(position)
        n = next((j for j in range(K) if proposals[j] != answer[position + j]), K)
        drafted, accepted, position = drafted + K, accepted + n, position + n + 1
    return drafted, accepted


@functools.cache
def expected(name: str, draft_penalties: bool) -> tuple[list[int], tuple[int, int]]:
    prompt, penalties = REQUESTS[name]
    answer = target_answer(prompt, penalties, MAX_TOKENS + K + 1)
    if draft_penalties:
        counts = acceptance_drafting(answer, lambda p: answer[p:p + K], MAX_TOKENS)
    else:
        counts = acceptance_drafting(answer, lambda p: [FAVOURITE] * K, MAX_TOKENS)
    return answer[:MAX_TOKENS], counts


@pytest.fixture(scope="module")
def preference_models(tmp_path_factory):
    from support.tiny_models import build_preference_draft, build_preference_target

    root = tmp_path_factory.mktemp("preference-models")
    target = build_preference_target(root / "target", PREFERENCES)
    return target, build_preference_draft(root / "draft", target, PREFERENCES)


# engine: (draft-side penalties, speculative.extra)
ENGINES = {
    "draft-side off": (False, {}),
    "draft-side on": (True, {"use_local_argmax_reduction": True}),
    "draft-side on, drafting after the bookkeeping": (True, {"disable_padded_drafter_batch": True}),
}


def generate(models, draft_penalties: bool, speculative_extra: dict) -> dict[str, tuple[list[int], dict]]:
    """The requests together in one engine: each one's tokens and speculative figures."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from dynamo_spec.training.offline_llm import offline_llm
    from support.in_process import in_process_engines

    target, draft = models
    with in_process_engines(), offline_llm(
            target, draft=draft, k=K, max_model_len=256, kv_cache_bytes=64 << 20, max_num_seqs=8,
            draft_penalties=draft_penalties, speculative_extra=speculative_extra,
            per_request_spec_decode_metrics="summary", generation_config="vllm") as llm:
        prompts = [TokensPrompt(prompt_token_ids=prompt) for prompt, _ in REQUESTS.values()]
        params = [SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, **p)
                  for _, p in REQUESTS.values()]
        outs = llm.generate(prompts, params, use_tqdm=False)
    return {name: (list(o.outputs[0].token_ids), o.outputs[0].spec_decode_metrics.to_dict())
            for name, o in zip(REQUESTS, outs)}


@pytest.fixture(scope="module")
def runs(preference_models):
    return {engine: generate(preference_models, *how) for engine, how in ENGINES.items()}


def test_each_penalty_changes_the_targets_answer_and_the_plain_drafts_acceptance():
    """The fixture shows what it must: the answers the module expects, and fewer drafts accepted
    without the draft-side penalties for every penalised request."""
    assert expected("none", True)[0] == [FAVOURITE] * MAX_TOKENS
    assert expected("repetition", True)[0][:6] == [22, 23, 24, 25, 20, 20]  # 20 and 21 are in its prompt
    assert expected("presence", True)[0][:5] == [20, 21, 22, 20, 20]
    assert expected("frequency", True)[0][:6] == [20, 21, 20, 22, 21, 20]
    for name in REQUESTS:
        (drafted_on, accepted_on), (drafted_off, accepted_off) = expected(name, True)[1], expected(name, False)[1]
        assert (drafted_on, accepted_on) == (K * STEPS, K * STEPS), name
        if name != "none":
            assert accepted_off / drafted_off < accepted_on / drafted_on, name


@pytest.mark.parametrize("name", REQUESTS)
def test_the_output_is_the_targets_whatever_the_draft_proposes(runs, name):
    for engine, results in runs.items():
        assert results[name][0] == expected(name, ENGINES[engine][0])[0], engine


@pytest.mark.parametrize("name", REQUESTS)
@pytest.mark.parametrize("engine", ENGINES)
def test_acceptance_is_exactly_the_predicted_count(runs, engine, name):
    """On: every draft accepted, for each penalty. Off: only where the target's choice is token 20."""
    stats = runs[engine][name][1]
    assert (stats["num_draft_tokens"], stats["num_accepted_draft_tokens"]) == expected(name, ENGINES[engine][0])[1]
