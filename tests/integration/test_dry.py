"""DRY in a real engine (dynamo_spec/vllm_patches/dry.py), with and without speculation, against the
definition (support/dry_reference.py) on a fixture whose answers are known.

The target's logits are the same at every position whatever the input (``build_preference_target``):
PREFERENCES for six tokens ('5'..'9' and ':', a default sequence breaker), 0.0 for the others, so
greedy without DRY emits token 20 forever; under DRY each answer is what the reference gives step by
step (:func:`reference_answer`). The draft's logits are the target's at every draft position
(``build_preference_draft``): drafting under the request's DRY with the same context, it proposes what
the target verifies, every draft accepted (without the draft side it would propose token 20 where DRY
pushed it off). Two engines (speculation on, k=3, and off) answer the same batches of 1, 4 and 16
requests; a sampled batch is compared with the distribution DRY gives by definition.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import pytest

from support.dry_reference import dry_reference

pytestmark = pytest.mark.integration

K = 3
MAX_TOKENS = 25
VOCAB = 512
PREFERENCES = {20: 8.0, 21: 7.375, 22: 6.75, 23: 6.125, 24: 5.5, 25: 4.875}
DEFAULT_BREAKERS = ["\n", ":", '"', "*"]
CONFIGS = {
    "off": {},
    "llama.cpp's": {"dry_multiplier": 0.8},
    "allowed 3": {"dry_multiplier": 0.8, "dry_allowed_length": 3},
    "window 8": {"dry_multiplier": 1.0, "dry_penalty_last_n": 8},
    "strong": {"dry_multiplier": 2.0, "dry_base": 2.0},
    "breaker '6'": {"dry_multiplier": 0.8, "dry_sequence_breakers": ["6"]},  # token 21
    "strong, no breakers": {"dry_multiplier": 2.0, "dry_base": 2.0, "dry_sequence_breakers": ["\u00a7"]},
    "with the prompt": {"dry_multiplier": 0.8, "dry_include_prompt": True},
}
PROMPTS = [[1, 2, 3], [20, 20, 20, 21, 9], [22, 23, 22, 23, 5], [7, 20, 21, 22]]


@pytest.fixture(scope="module")
def preference_models(tmp_path_factory):
    from support.tiny_models import build_preference_draft, build_preference_target

    root = tmp_path_factory.mktemp("dry-models")
    target = build_preference_target(root / "target", PREFERENCES)
    return target, build_preference_draft(root / "draft", target, PREFERENCES)


@functools.cache
def breaker_ids(target: str, breakers: tuple[str, ...]) -> frozenset[int]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(f"{target}/tokenizer.json")
    return frozenset(i for i in range(VOCAB) if any(b in tok.decode([i]) for b in breakers))


def base_logits() -> np.ndarray:
    logits = np.zeros(VOCAB)
    for token, value in PREFERENCES.items():
        logits[token] = value
    return logits


def dry_logits(target, prompt: list[int], answer: list[int], fields: dict) -> np.ndarray:
    logits = base_logits()
    if not fields.get("dry_multiplier"):
        return logits
    context = (prompt if fields.get("dry_include_prompt") else []) + answer
    for token, amount in dry_reference(
            context, fields["dry_multiplier"], fields.get("dry_base", 1.75), fields.get("dry_allowed_length", 2),
            set(breaker_ids(str(target), tuple(fields.get("dry_sequence_breakers", DEFAULT_BREAKERS)))),
            fields.get("dry_penalty_last_n", -1)).items():
        logits[token] -= amount
    return logits


def reference_answer(target, prompt: list[int], fields: dict, n: int = MAX_TOKENS) -> list[int]:
    answer: list[int] = []
    for _ in range(n):
        logits = dry_logits(target, prompt, answer, fields)
        top = np.sort(logits)[-2:]
        assert top[1] - top[0] >= 0.01, (prompt, fields, answer)  # no near-tie: fp32 agrees
        answer.append(int(logits.argmax()))
    return answer


def batch(n: int) -> list[tuple[list[int], str]]:
    names = list(CONFIGS)
    return [(PROMPTS[i % len(PROMPTS)], names[(i * 3 + n) % len(names)]) for i in range(n)]


def greedy(llm, requests) -> list[tuple[list[int], dict | None]]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p, _ in requests],
                        [SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True,
                                        extra_args=dict(CONFIGS[name]) or None) for _, name in requests],
                        use_tqdm=False)
    return [(list(o.outputs[0].token_ids),
             o.outputs[0].spec_decode_metrics.to_dict() if o.outputs[0].spec_decode_metrics else None) for o in outs]


SAMPLED_FIELDS = {"dry_multiplier": 1.5, "dry_base": 2.0}
SAMPLED_REQUESTS = 400
SAMPLED_TOKENS = 8
SAMPLED_TEMPERATURE = 0.5


def sampled(llm, prompt: list[int]) -> list[list[int]]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    outs = llm.generate([TokensPrompt(prompt_token_ids=prompt)] * SAMPLED_REQUESTS,
                        [SamplingParams(temperature=SAMPLED_TEMPERATURE, top_p=1.0, top_k=0, max_tokens=SAMPLED_TOKENS,
                                        ignore_eos=True, seed=seed, extra_args=dict(SAMPLED_FIELDS))
                         for seed in range(SAMPLED_REQUESTS)], use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.fixture(scope="module")
def runs(preference_models):
    """Per engine (speculation on, off): the greedy batches of 1, 4 and 16 requests, and the sampled batch."""
    from dynamo_spec.training.offline_llm import offline_llm
    from support.in_process import in_process_engines

    target, draft = preference_models
    results = {}
    for speculation in (True, False):
        with in_process_engines(), offline_llm(
                target, draft=draft if speculation else None, k=K, max_model_len=256, kv_cache_bytes=64 << 20,
                max_num_seqs=64, dtype="float32", per_request_spec_decode_metrics="summary",
                generation_config="vllm") as llm:
            results[speculation] = {n: greedy(llm, batch(n)) for n in (1, 4, 16)}
            results[speculation]["sampled"] = sampled(llm, PROMPTS[0]) if speculation else None
    return results


def test_the_fixture_shows_what_each_setting_does(preference_models):
    target = preference_models[0]
    answers = {name: reference_answer(target, PROMPTS[1], fields) for name, fields in CONFIGS.items()}
    assert answers["off"] == [20] * MAX_TOKENS
    # each setting gives its own answer: breakers, window, allowed length and the prompt all count
    assert len({tuple(a) for a in answers.values()}) == len(CONFIGS), answers
    # "20 20 20" then 20 again would extend a repeat of "20 20"
    assert answers["llama.cpp's"][:4] == [20, 20, 20, 21]


@pytest.mark.parametrize("n", [1, 4, 16])
@pytest.mark.parametrize("speculation", [True, False], ids=["speculation", "no speculation"])
def test_greedy_output_is_the_definitions(preference_models, runs, speculation, n):
    target = preference_models[0]
    for (prompt, name), (tokens, _) in zip(batch(n), runs[speculation][n]):
        assert tokens == reference_answer(target, prompt, CONFIGS[name]), (name, prompt)


@pytest.mark.parametrize("n", [1, 4, 16])
def test_the_draft_drafts_under_dry_so_every_draft_is_accepted(runs, n):
    """The draft's logits are the target's: drafting under the request's DRY with the same context
    (answer, accepted tokens, drafts before), it proposes exactly what the target verifies. Without
    the draft side, it would propose token 20 where DRY has pushed it off."""
    for (_, name), (tokens, stats) in zip(batch(n), runs[True][n]):
        assert stats["num_draft_tokens"] > 0, name
        assert stats["num_accepted_draft_tokens"] == stats["num_draft_tokens"], (name, stats, tokens)


def _favourites(answers) -> np.ndarray:
    """How many answers hold token 20 (the target's favourite) at most 4, 5, 6, 7 or more times of 8."""
    counts = np.zeros(4)
    for answer in answers:
        counts[min(max(answer.count(20) - 4, 0), 3)] += 1
    return counts


def _by_definition(target, prompt, n: int, seed: int = 0) -> np.ndarray:
    """The same statistic over ``n`` answers sampled in numpy from the definition's probabilities."""
    rng = np.random.default_rng(seed)
    answers = []
    for _ in range(n):
        answer: list[int] = []
        for _ in range(SAMPLED_TOKENS):
            logits = dry_logits(target, prompt, answer, SAMPLED_FIELDS) / SAMPLED_TEMPERATURE
            p = np.exp(logits - logits.max())
            answer.append(int(rng.choice(VOCAB, p=p / p.sum())))
        answers.append(answer)
    return _favourites(answers) / n


def test_sampled_answers_follow_the_definitions_distribution(preference_models, runs):
    """Temperature 0.5 with speculation: how often the favourite token comes matches the definition
    (chi-square, 3 degrees of freedom, p = 0.001: 16.27). Without DRY at the verified positions, the
    draft's proposals of token 20 would be accepted into repeats DRY pushes off (7 or more of 8 in
    some 29 % of answers, against 2 % under DRY)."""
    target = preference_models[0]
    observed = _favourites(runs[True]["sampled"])
    expected = _by_definition(target, PROMPTS[0], 3000) * SAMPLED_REQUESTS
    assert (expected >= 5).all(), expected
    chi2 = float(((observed - expected) ** 2 / expected).sum())
    assert chi2 < 16.27, (observed, expected, chi2)
    assert not math.isnan(chi2)
