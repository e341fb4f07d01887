"""How much an answer repeats itself: the figure reported beside every acceptance figure.

A draft predicts a loop easily, so acceptance measured on looping answers overstates
what users get. Two figures per answer, on token ids:

* repeated n-gram share: of the answer's n-grams (n = 4), the share that already
  occurred earlier in the same answer (0 for text that never repeats a 4-gram, near 1
  for a loop);
* cycle start: where the answer's repeating tail begins, the first token of the
  longest run of n-grams at its end that all occurred before (None when that run is
  shorter than ``min_tail`` tokens); an answer with a cycle start loops.

On text (``text_degeneration``, eval-sampling's and the README's measure): the same on words,
lower-cased, with a list's enumerators as one word ("8." and "1." alike: a numbered list that
starts again repeats itself) and without the last word of an answer cut at the token limit
(a word cut in two is not a new word).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

NGRAM = 4
MIN_TAIL = 32  # tokens of pure repetition at the end that count as a loop


def _repeats(ids: Sequence[int], n: int) -> list[bool]:
    """For each n-gram of ``ids`` (by start), whether it occurred earlier."""
    seen: set[tuple[int, ...]] = set()
    out = []
    for i in range(len(ids) - n + 1):
        gram = tuple(ids[i:i + n])
        out.append(gram in seen)
        seen.add(gram)
    return out


def repeated_ngram_share(ids: Sequence[int], n: int = NGRAM) -> float:
    """Share of the n-grams of ``ids`` that occurred earlier in ``ids`` (0.0 if none)."""
    rep = _repeats(ids, n)
    return sum(rep) / len(rep) if rep else 0.0


def cycle_start(ids: Sequence[int], n: int = NGRAM, min_tail: int = MIN_TAIL) -> int | None:
    """Index of the first token of the repeating tail of ``ids``, or None if the tail
    of n-grams that all occurred before spans fewer than ``min_tail`` tokens."""
    rep = _repeats(ids, n)
    start = len(rep)
    while start > 0 and rep[start - 1]:
        start -= 1
    if start == len(rep) or len(ids) - start < min_tail:
        return None
    return start


def degeneration(answers: Sequence[Sequence[int]], n: int = NGRAM,
                 min_tail: int = MIN_TAIL) -> dict:
    """Figures over a set of answers: the repeated n-gram share pooled over all their
    n-grams, its mean per answer, and how many answers loop (have a cycle start)."""
    reps = [_repeats(a, n) for a in answers]
    grams = sum(len(r) for r in reps)
    starts = [cycle_start(a, n, min_tail) for a in answers]
    return {
        "ngram": n,
        "repeated_ngram_share": sum(map(sum, reps)) / grams if grams else 0.0,
        "mean_repeated_ngram_share": (sum(sum(r) / len(r) for r in reps if r) / len(answers)
                                      if answers else 0.0),
        "looping": sum(s is not None for s in starts),
        "answers": len(answers),
        "cycle_starts": starts,
    }


ENUMERATOR = re.compile(r"^\(?\d+[.):]$")  # "8.", "8)", "(8)", "8:"


def loop_words(text: str, cut: bool = False) -> list[str]:
    """The words ``text_degeneration`` compares: lower-cased, split on whitespace, enumerators as
    one word; without the last word where the answer was ``cut`` at the token limit."""
    out = ["#." if ENUMERATOR.match(w) else w for w in text.lower().split()]
    return out[:-1] if cut else out


def text_degeneration(texts: Sequence[str], cut: Sequence[bool] | None = None, n: int = NGRAM,
                      min_tail: int = MIN_TAIL) -> dict:
    """``degeneration`` of answers' words (``loop_words``; ``cut``: per answer, whether it ended at
    the token limit)."""
    vocab: dict[str, int] = {}
    cut = cut if cut is not None else [False] * len(texts)
    return degeneration([[vocab.setdefault(w, len(vocab)) for w in loop_words(t, c)]
                         for t, c in zip(texts, cut, strict=True)], n, min_tail)
