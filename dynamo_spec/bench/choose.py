"""The k per concurrency from the derive prompts' columns, and the batch-size schedule it makes.

Pure functions over the run's ``columns`` (see speedups).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from dynamo_spec.bench.speedups import SPEC_K0, speedup


def _k0_speedup(columns: Mapping[str, Any], split: str, c: int) -> float:
    """The k=0 a schedule serves: a speculative engine at k=0 where measured, else no speculation."""
    return speedup(columns, SPEC_K0, split, c) or 1.0


def choose_k(columns: Mapping[str, Any], ks: Sequence[int], concurrencies: Sequence[int], margin: float,
             split: str = "derive") -> dict[int, int]:
    """The k per concurrency on the derive prompts: the best, never rising with concurrency; k > 0
    only where it beats k=0 by more than `margin`.

    Columns are compared by speed-up against their own k=0 reference, so columns measured in
    different groups of servers compare fairly. The k=0 a k > 0 must beat is the one the
    schedule would give at that batch size: a speculative engine at k=0 (SPEC_K0), which pays
    for the draft's KV pass, when that column was measured; else the engine without speculation.

    A bigger batch leaves less idle compute for the target to verify drafts with, so the best k
    does not rise with the batch (SmartSpec, arXiv 2406.14066). Where one run's noise says
    otherwise (say k=0 at 4 clients between k=1 at 2 and at 8), the choice is the non-rising
    sequence of k with the largest product of speed-ups over the concurrencies (a dynamic
    programme over concurrency and k), which is the best k at each concurrency wherever that
    sequence already does not rise.
    """
    cs = sorted(concurrencies)
    rates: list[dict[int, float]] = []  # per concurrency: k -> what serving it would give
    for c in cs:
        rate = {0: _k0_speedup(columns, split, c) * (1 + margin)}
        for k in ks:
            if k and (r := speedup(columns, f"k={k}", split, c)) is not None and r > 0:
                rate[k] = r
        rates.append(rate)
    # best[i][k]: the largest sum of log speed-ups over cs[i:] with k at cs[i] and no k rising after it
    best: list[dict[int, float]] = [{} for _ in cs]
    for i in range(len(cs) - 1, -1, -1):
        for k, r in rates[i].items():
            after = [v for k2, v in best[i + 1].items() if k2 <= k] if i + 1 < len(cs) else [0.0]
            best[i][k] = math.log(r) + max(after)
    choice: dict[int, int] = {}
    allowed = max(ks)
    for i, c in enumerate(cs):
        options = {k: v for k, v in best[i].items() if k <= allowed}
        top = max(options.values())
        allowed = min(k for k, v in options.items() if v >= top - 1e-12)  # ties: the smaller k
        choice[c] = allowed
    return choice


def close_calls(columns: Mapping[str, Any], choice: Mapping[int, int], ks: Sequence[int],
                noise_by_c: Mapping[str, float], split: str = "derive") -> dict[int, list[int]]:
    """Per concurrency whose noise was measured: the other k (0: the k=0 `choose_k` weighs) whose
    speed-up on the derive prompts lies within that noise of the chosen k's, so the choice
    between them is a coin toss at this run's length; empty where the choice stands clear."""
    def rate(c: int, k: int) -> float | None:
        return _k0_speedup(columns, split, c) if k == 0 else speedup(columns, f"k={k}", split, c)

    out = {}
    for c, chosen in choice.items():
        n, best = noise_by_c.get(str(c)), rate(c, chosen)
        if n is None or best is None:
            continue
        out[c] = [k for k in ks if k != chosen and (r := rate(c, k)) is not None and r >= best * (1 - n)]
    return out


def schedule_from_choice(choice: Mapping[int, int], max_batch: int) -> list[list[int]]:
    """Inclusive batch-size ranges [lo, hi, k] around the measured concurrencies.

    A concurrency c stands for the batch sizes up to the geometric mean of c and the next
    measured one; the last range runs to `max_batch`. Neighbours with the same k merge.
    """
    cs = sorted(choice)
    entries: list[list[int]] = []
    lo = 1
    for i, c in enumerate(cs):
        hi = max(lo, math.floor(math.sqrt(c * cs[i + 1]))) if i + 1 < len(cs) else max(max_batch, lo)
        if entries and entries[-1][2] == choice[c]:
            entries[-1][1] = hi
        else:
            entries.append([lo, hi, choice[c]])
        lo = hi + 1
    return entries


def k0_cost(columns: Mapping[str, Any], concurrencies: Sequence[int], split: str = "derive") -> dict[int, float]:
    """Per concurrency: 1 - (speculative engine at k=0) / (engine without speculation), tokens/s."""
    out = {}
    for c in concurrencies:
        s = speedup(columns, SPEC_K0, split, c)
        if s is not None:
            out[c] = 1 - s
    return out
