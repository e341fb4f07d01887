"""The columns of a run, each cell's speed-up against its k=0 reference, and the run-to-run noise.

Pure functions over plain data, the ``columns`` of the JSON the bench writes: name ->
{"cells": {split: {concurrency: cell}}, "reference": {split: {concurrency: cell}}}.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping
from typing import Any

BASELINE = "k=0"
REPEAT = "k=0 (repeat)"
SCHEDULE = "schedule"
# The schedule the benchmarked config already carries (for the engine's dtype), as a user serves it.
CONFIGURED = "config's schedule"
# Speculation on, but k=0 at every batch size: what a schedule's k=0 ranges serve. vLLM keeps
# the draft's KV cache current in those steps, so this is not free (see SPEC_K0 in choose.choose_k).
SPEC_K0 = "k=0 (speculative engine)"
# The config's schedule (else the derived one) opened up (see phases.budget_schedule),
# with the confidence draft budget trimming it.
BUDGET = "confidence budget"


def _cell(columns: Mapping[str, Any], name: str, split: str, c: int, part: str = "cells") -> dict | None:
    return columns.get(name, {}).get(part, {}).get(split, {}).get(str(c))


def _rounds(columns: Mapping[str, Any], name: str, split: str, c: int) -> tuple[dict | None, dict | None, list]:
    """A cell, its k=0 reference (interleaved: the `reference` cell, else the k=0 column's) and
    their per-round tokens/s as pairs when both were measured in the same number (> 1) of rounds."""
    cell = _cell(columns, name, split, c)
    base = _cell(columns, name, split, c, "reference") or _cell(columns, BASELINE, split, c)
    ours = (cell or {}).get("rounds_output_tokens_per_s") or []
    theirs = (base or {}).get("rounds_output_tokens_per_s") or []
    pairs = list(zip(ours, theirs)) if len(ours) > 1 and len(ours) == len(theirs) and all(theirs) else []
    return cell, base, pairs


def speedup(columns: Mapping[str, Any], name: str, split: str, c: int) -> float | None:
    """A cell's tokens/s over its k=0 reference's: the k=0 cell measured alongside it (servers
    interleaved: `reference` cells), else the k=0 column (servers one after another). Measured in
    rounds (--rounds), the median of the per-round ratios: each round's pair was measured minutes
    apart at most, so a host whose speed drifts between rounds moves both alike, and one
    disturbed round does not move the median."""
    cell, base, pairs = _rounds(columns, name, split, c)
    if not cell or not base or not base["output_tokens_per_s"]:
        return None
    if pairs:
        return statistics.median(a / b for a, b in pairs)
    return cell["output_tokens_per_s"] / base["output_tokens_per_s"]


def break_even_rate(cell: Mapping[str, Any]) -> float | None:
    """The acceptance rate at which this cell's speculation would just pay: the cost of one draft
    token in plain steps, c. A step drafting k tokens a request costs 1 + c k plain steps and
    yields L = 1 + r k tokens (r: acceptance rate), so speedup = L / (1 + c k); with r k = L - 1,
    c = r (L / speedup - 1) / (L - 1). None without drafts or a speed-up."""
    r, length, gain = cell.get("acceptance_rate"), cell.get("mean_acceptance_length"), cell.get("speedup")
    if not r or not length or not gain or length <= 1 or any(map(math.isnan, (r, length, gain))):
        return None
    return r * (length / gain - 1) / (length - 1)


def verify_cost(columns: Mapping[str, Any], split: str, c: int) -> float | None:
    """What verifying one draft token costs at concurrency `c`, in plain steps per request: the
    k=1 column against the speculative engine at k=0 (which drafts nothing but keeps the draft's
    KV current), so the draft's own pass is left out. With L = 1 + r tokens for 1 + cost plain
    steps, cost = L / speedup - 1 (clamped at 0). None without both cells."""
    k1, k0 = speedup(columns, "k=1", split, c), speedup(columns, SPEC_K0, split, c)
    cell = _cell(columns, "k=1", split, c)
    length = cell.get("mean_acceptance_length") if cell else None
    if not k1 or not k0 or not length:
        return None
    return max(0.0, length / (k1 / k0) - 1)


def add_speedups(columns: dict[str, Any]) -> dict[str, Any]:
    """speedup = output tokens/s of the cell / that of its k=0 reference at the same concurrency and
    prompts, written into each cell; returns `columns`."""
    for name, column in columns.items():
        for split, cells in column["cells"].items():
            for c, cell in cells.items():
                cell["speedup"] = speedup(columns, name, split, int(c))
    return columns


def _apart(a: float, b: float) -> float:
    return abs(a - b) / ((a + b) / 2)


def noise(columns: Mapping[str, Any], split: str = "judge") -> dict[str, float]:
    """Run-to-run noise per concurrency: how far apart the same method puts two k=0 runs, the
    repeat and its reference (interleaved: the k=0 cells just before and after the schedule's;
    one after another: the first and the last server), as |a - b| / mean of the two. Measured in
    rounds, the median over rounds of each round's pair: what one round's ratio of two identical
    servers strays by. Not the stray of the median ratio: two k=0 servers 0.99x, 1.13x and 0.89x
    apart in three rounds have a median ratio of 0.99x, but a speed-up measured the same way
    can be 11 % off."""
    out = {}
    for c in columns.get(REPEAT, {}).get("cells", {}).get(split, {}):
        _, _, pairs = _rounds(columns, REPEAT, split, int(c))
        if pairs and all(a for a, _ in pairs):
            out[c] = statistics.median(_apart(a, b) for a, b in pairs)
        elif (r := speedup(columns, REPEAT, split, int(c))):
            out[c] = _apart(r, 1.0)
    return out


def resolution(noise_median: float | None, rounds: int, difference: float) -> dict[str, Any] | None:
    """What a run's noise says about the differences it can tell apart.

    `noise_median`: one round's |a - b| / mean for two identical servers, the median over
    concurrencies (`noise`). A speed-up is the same kind of ratio, so if one round's strays
    normally with standard deviation s, that median is about 0.674 s. The median of n rounds'
    ratios (`speedup`) strays by s / sqrt(n) for n <= 2 and about 1.253 s / sqrt(n) beyond.
    Returns s, the difference this run resolves (two such deviations), and the rounds that
    would resolve `difference` (None: more than 1,000)."""
    if not noise_median or rounds < 1:
        return None
    s = noise_median / 0.6745

    def resolves(n: int) -> float:
        return 2 * (1.0 if n <= 2 else 1.2533) * s / math.sqrt(n)

    needed = next((n for n in range(1, 1001) if resolves(n) <= difference), None)
    return {"round_sd": s, "resolves": resolves(rounds), "difference": difference, "rounds_needed": needed}
