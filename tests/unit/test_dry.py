"""DRY's penalties (``dynamo_spec.sampling.dry``) against the definition (``support.dry_reference``),
and its request fields."""

from __future__ import annotations

import random

import numpy as np
import pytest

from dynamo_spec.sampling import dry
from support.dry_reference import dry_reference

pytestmark = pytest.mark.unit

VOCAB = 40
BREAKER_IDS = {7, 13}


def _mask() -> np.ndarray:
    mask = np.zeros(VOCAB, dtype=bool)
    mask[list(BREAKER_IDS)] = True
    return mask


def _ours(context, params) -> dict[int, float]:
    tokens, amounts = dry.penalties(np.asarray(context, dtype=np.int64), params, _mask())
    return dict(zip(tokens.tolist(), amounts.tolist()))


def _ref(context, params) -> dict[int, float]:
    return dry_reference(list(context), params.multiplier, params.base, params.allowed_length, BREAKER_IDS,
                         params.penalty_last_n)


def _same(a: dict[int, float], b: dict[int, float]) -> bool:
    return a.keys() == b.keys() and all(abs(a[t] - b[t]) <= 1e-9 * max(1.0, abs(b[t])) for t in a)


CRAFTED = {
    # a line repeated: the token after "1 2 3 4" is pushed off, by the length of the match
    "repeat": ([1, 2, 3, 4, 5, 9, 1, 2, 3, 4], {5: 0.8 * 1.75 ** (4 - 2)}),
    # a repeat shorter than allowed_length is free
    "short": ([1, 2, 9, 8, 1], {}),
    # exactly allowed_length
    "allowed": ([1, 2, 5, 9, 1, 2], {5: 0.8}),
    # a breaker inside the repeat cuts the match at it
    "breaker inside": ([1, 7, 2, 3, 5, 9, 1, 7, 2, 3], {5: 0.8 * 1.75 ** (2 - 2)}),
    # the last token a breaker: nothing
    "breaker last": ([1, 7, 5, 1, 7], {}),
    # the token that followed is a breaker: not penalised
    "breaker next": ([1, 2, 13, 9, 1, 2], {}),
    # two continuations: each by its own longest match
    "two": ([1, 2, 5, 3, 1, 2, 6, 4, 3, 1, 2], {5: 0.8, 6: 0.8 * 1.75}),
}


@pytest.mark.parametrize("name", list(CRAFTED))
def test_crafted_repeats_match_the_definition_and_the_hand_count(name: str) -> None:
    context, expected = CRAFTED[name]
    params = dry.DryParams(0.8)
    assert _same(_ref(context, params), expected), (_ref(context, params), expected)
    assert _same(_ours(context, params), expected), (_ours(context, params), expected)


def test_window_only_counts_the_last_n_tokens() -> None:
    context = [1, 2, 3, 4, 5, 9, 9, 9, 1, 2, 3, 4]
    assert _ours(context, dry.DryParams(1.0, penalty_last_n=0)) == {}
    assert _same(_ours(context, dry.DryParams(1.0)), {5: 1.75 ** 2})
    # a window of 7 keeps "4 5 9 9 9 ... 1 2 3 4" minus the first three: the match is "4" only (length 1)
    assert _ours(context, dry.DryParams(1.0, penalty_last_n=7)) == {}
    assert _same(_ours(context, dry.DryParams(1.0, penalty_last_n=10)), _ref(context, dry.DryParams(1.0, penalty_last_n=10)))


def test_match_length_is_capped() -> None:
    context = [3] * 200
    ours, ref = _ours(context, dry.DryParams(0.5)), _ref(context, dry.DryParams(0.5))
    assert _same(ours, ref) and ours == pytest.approx({3: 0.5 * 1.75 ** (dry.MAX_MATCH - 2)})


@pytest.mark.parametrize("seed", range(300))
def test_random_contexts_match_the_definition(seed: int) -> None:
    rng = random.Random(seed)
    alphabet = rng.randint(2, 12)  # small alphabets repeat a lot
    context = [rng.randrange(alphabet) + (7 if rng.random() < 0.05 else 0) for _ in range(rng.randint(1, 120))]
    # splice in verbatim repeats
    for _ in range(rng.randint(0, 3)):
        if len(context) > 4:
            a = rng.randrange(len(context) - 2)
            b = rng.randint(a + 1, min(len(context), a + 30))
            context += context[a:b]
    params = dry.DryParams(rng.choice([0.2, 0.8, 2.0]), base=rng.choice([1.0, 1.5, 1.75, 3.0]),
                           allowed_length=rng.randint(1, 4), penalty_last_n=rng.choice([-1, -1, 5, 30, 100]))
    assert _same(_ours(context, params), _ref(context, params))


def test_breaker_mask_marks_tokens_containing_a_breaker() -> None:
    mask = dry.breaker_mask(["a", "b\n", ":", "x*y", "plain", "\"q"], ["\n", ":", '"', "*"])
    assert mask.tolist() == [False, True, True, True, False, True]


@pytest.mark.parametrize(("fields", "named"), [
    ({"dry_multiplier": -0.1}, "dry_multiplier"),
    ({"dry_multiplier": "0.8"}, "dry_multiplier"),
    ({"dry_multiplier": True}, "dry_multiplier"),
    ({"dry_multiplier": 0.8, "dry_base": 0.5}, "dry_base"),
    ({"dry_multiplier": 0.8, "dry_allowed_length": 0}, "dry_allowed_length"),
    ({"dry_multiplier": 0.8, "dry_allowed_length": 2.5}, "dry_allowed_length"),
    ({"dry_multiplier": 0.8, "dry_penalty_last_n": -2}, "dry_penalty_last_n"),
    ({"dry_multiplier": 0.8, "dry_sequence_breakers": "\n"}, "dry_sequence_breakers"),
    ({"dry_multiplier": 0.8, "dry_sequence_breakers": [""]}, "dry_sequence_breakers"),
    ({"dry_multiplier": 0.8, "dry_include_prompt": 2}, "dry_include_prompt"),
    ({"dry_base": 2.0}, "dry_base"),
])
def test_invalid_fields_are_refused_naming_the_field(fields: dict, named: str) -> None:
    with pytest.raises(ValueError, match=f"'vllm_xargs.{named}'"):
        dry.parse(fields, prefix="vllm_xargs.")


def test_fields_round_trip() -> None:
    params = dry.DryParams(0.8, 2.0, 3, 256, ("\n",), True)
    assert dry.parse(dry.as_fields(params)) == params
    assert dry.parse({}) is None
    assert not dry.parse({"dry_multiplier": 0}).active
