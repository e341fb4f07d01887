"""DRY ("Don't Repeat Yourself") sequence-repetition control: its parameters and its penalties.

The definition (p-e-w's, as in text-generation-webui, koboldcpp and llama.cpp #9702): at each
position, for every earlier occurrence of the context's last token, extend the match backwards
while the tokens agree (at most :data:`MAX_MATCH`, never across a sequence breaker); the token
that followed that occurrence would extend the repeat, so it gets
``multiplier * base ** (length - allowed_length)`` subtracted from its logit when the match is
at least ``allowed_length`` long (the longest match per token counts). Single words and short
phrases repeat freely; a line that starts to repeat is pushed off ever harder.

Where it runs (a newcomer's map):
- request fields and the server's default (``sampling.dry``): ``serving/dry_fields.py``;
- in the engine, at every sampled and every verified position, and in the draft:
  ``vllm_patches/dry.py`` (V1 runner), declared in ``engine/features.py``;
- the reference it is tested against: ``support/dry_reference.py``.

What counts as context: the answer so far (and, under speculation, the drafts before the
position), the prompt only with ``include_prompt``: an answer that quotes its prompt (a sentence
to correct, a list to sort) must not be pushed off the quote (docs/steering.md#dry).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

MAX_MATCH = 50  # longest repeat measured (the definition's cap: the penalty stays finite)

DEFAULT_BASE = 1.75
DEFAULT_ALLOWED_LENGTH = 2
DEFAULT_PENALTY_LAST_N = -1
DEFAULT_SEQUENCE_BREAKERS = ("\n", ":", '"', "*")

# The request fields (llama.cpp server's names; ``include_prompt`` is this project's).
FIELDS = ("dry_multiplier", "dry_base", "dry_allowed_length", "dry_penalty_last_n", "dry_sequence_breakers",
          "dry_include_prompt")


@dataclass(frozen=True)
class DryParams:
    multiplier: float
    base: float = DEFAULT_BASE
    allowed_length: int = DEFAULT_ALLOWED_LENGTH
    penalty_last_n: int = DEFAULT_PENALTY_LAST_N
    sequence_breakers: tuple[str, ...] = DEFAULT_SEQUENCE_BREAKERS
    include_prompt: bool = False

    @property
    def active(self) -> bool:
        return self.multiplier > 0 and self.penalty_last_n != 0


def _number(name: str, value: Any, *, integer: bool, minimum: float) -> float | int:
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    if ok and integer:
        ok = float(value).is_integer()
    if not ok or value < minimum or value != value or value in (float("inf"), float("-inf")):
        kind = "an integer" if integer else "a number"
        raise ValueError(f"'{name}' must be {kind} >= {minimum:g}, not {value!r}")
    return int(value) if integer else float(value)


def parse(fields: Mapping[str, Any], prefix: str = "") -> DryParams | None:
    """The DRY parameters ``fields`` set (a request's extra args), or None when it sets no
    ``dry_multiplier``; ValueError whose message names the field (``prefix`` + name) otherwise."""
    if fields.get("dry_multiplier") is None:
        unknown = [k for k in FIELDS[1:] if fields.get(k) is not None]
        if unknown:
            raise ValueError(f"'{prefix}{unknown[0]}' needs '{prefix}dry_multiplier' (0: DRY off)")
        return None
    multiplier = _number(prefix + "dry_multiplier", fields["dry_multiplier"], integer=False, minimum=0)
    kw: dict[str, Any] = {}
    if (v := fields.get("dry_base")) is not None:
        kw["base"] = _number(prefix + "dry_base", v, integer=False, minimum=1)
    if (v := fields.get("dry_allowed_length")) is not None:
        kw["allowed_length"] = _number(prefix + "dry_allowed_length", v, integer=True, minimum=1)
    if (v := fields.get("dry_penalty_last_n")) is not None:
        kw["penalty_last_n"] = _number(prefix + "dry_penalty_last_n", v, integer=True, minimum=-1)
    if (v := fields.get("dry_sequence_breakers")) is not None:
        if not isinstance(v, list | tuple) or not all(isinstance(s, str) and s for s in v) or len(v) > 64:
            raise ValueError(f"'{prefix}dry_sequence_breakers' must be a list of at most 64 non-empty strings, "
                             f"not {v!r}")
        kw["sequence_breakers"] = tuple(v)
    if (v := fields.get("dry_include_prompt")) is not None:
        # vLLM's vllm_xargs holds numbers and strings: a JSON true reaches the engine as 1
        if not (isinstance(v, bool) or (isinstance(v, int) and v in (0, 1))):
            raise ValueError(f"'{prefix}dry_include_prompt' must be true or false, not {v!r}")
        kw["include_prompt"] = bool(v)
    return DryParams(multiplier, **kw)


def as_fields(params: DryParams) -> dict[str, Any]:
    """The request fields that give ``params`` (what the server writes for its default)."""
    return {"dry_multiplier": params.multiplier, "dry_base": params.base, "dry_allowed_length": params.allowed_length,
            "dry_penalty_last_n": params.penalty_last_n, "dry_sequence_breakers": list(params.sequence_breakers),
            "dry_include_prompt": params.include_prompt}


def breaker_mask(token_texts: Sequence[str], breakers: Sequence[str]) -> np.ndarray:
    """Per token id: whether its text contains a sequence breaker (a token ".\\n" breaks as "\\n" does)."""
    return np.fromiter((any(b in text for b in breakers) for text in token_texts), dtype=bool,
                       count=len(token_texts))


def penalties(context: np.ndarray, params: DryParams, is_breaker: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The tokens DRY penalises after ``context`` (token ids, oldest first) and by how much:
    ``(token_ids, amounts)``, each token once. ``is_breaker``: a bool per token id (ids past its
    end are not breakers)."""
    none = (np.empty(0, dtype=np.int64), np.empty(0, dtype=np.float64))
    if not params.active:
        return none
    if params.penalty_last_n > 0:
        context = context[-params.penalty_last_n:]
    n = len(context)
    if n < 2:
        return none

    def breaks(tokens: np.ndarray) -> np.ndarray:
        inside = tokens < len(is_breaker)
        out = np.zeros(tokens.shape, dtype=bool)
        out[inside] = is_breaker[tokens[inside]]
        return out

    last = context[-1]
    if breaks(context[-1:])[0]:
        return none
    starts = np.flatnonzero(context[:-1] == last)  # earlier occurrences of the last token
    starts = starts[~breaks(context[starts + 1])]  # the token that followed each
    if not starts.size:
        return none
    lengths = np.ones(starts.size, dtype=np.int64)
    active = np.ones(starts.size, dtype=bool)
    for m in range(1, MAX_MATCH):
        if n - 1 - m < 0:
            break
        previous = context[n - 1 - m]  # the token m before the last
        if breaks(context[n - 1 - m:n - m])[0]:
            break
        j = starts - m
        active &= j >= 0
        active[active] = context[j[active]] == previous
        if not active.any():
            break
        lengths[active] += 1
    following = context[starts + 1]
    tokens, inverse = np.unique(following, return_inverse=True)
    longest = np.zeros(tokens.size, dtype=np.int64)
    np.maximum.at(longest, inverse, lengths)
    keep = longest >= params.allowed_length
    amounts = params.multiplier * params.base ** (longest[keep] - params.allowed_length).astype(np.float64)
    return tokens[keep].astype(np.int64), amounts
