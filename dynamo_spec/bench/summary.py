"""One cell's figures: latency percentiles, tokens/s, and acceptance from vLLM's spec-decode counters.

Pure functions over the load's results and counter readings, so a saved run's figures can be
checked in tests.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from dynamo_spec.bench.load import CellResult


def percentiles(values: Sequence[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p90": None, "p99": None, "mean": None}
    ordered = sorted(values)

    def pct(q: float) -> float:  # linear interpolation, as numpy's default
        pos = (len(ordered) - 1) * q
        lo, hi = math.floor(pos), math.ceil(pos)
        return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)

    return {"p50": pct(0.5), "p90": pct(0.9), "p99": pct(0.99), "mean": statistics.fmean(ordered)}


def counter_delta(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, float]:
    """How much each spec-decode counter (see measure.read_spec_counters) grew between two readings."""
    return {key: after.get(key, 0.0) - before.get(key, 0.0) for key in set(before) | set(after)}


def spec_stats(d: Mapping[str, float]) -> dict[str, Any]:
    """Acceptance from counter growth (one cell's, or the sum over its rounds), by vLLM's definitions."""
    drafts, draft_tokens, accepted = (int(d.get(n, 0)) for n in ("drafts", "draft_tokens", "accepted"))
    positions = sorted(int(key.split(":")[1]) for key in d if key.startswith("pos:"))
    per_pos = [int(d[f"pos:{p}"]) for p in positions]
    out = {
        "drafts": drafts,
        "draft_tokens": draft_tokens,
        "accepted_tokens": accepted,
        "acceptance_rate": accepted / draft_tokens if draft_tokens else None,
        "mean_acceptance_length": 1 + accepted / drafts if drafts else None,
        "per_position_acceptance": [a / drafts for a in per_pos] if drafts else [],
    }
    if "budget_offered" in d:  # the confidence budget: the draft tokens drafted, and those it let be verified
        out["budget"] = {"drafted": int(d["budget_offered"]), "admitted": int(d.get("budget_admitted", 0))}
    return out


def spec_delta(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, Any]:
    """Acceptance over a cell from two readings of vLLM's spec-decode counters."""
    return spec_stats(counter_delta(before, after))


def summarize_cell(cell: CellResult, spec: dict[str, Any]) -> dict[str, Any]:
    ok = cell.completed
    return {
        "concurrency": cell.concurrency,
        "requests": len(cell.requests),
        "failed": len(cell.requests) - len(ok),
        "errors": sorted({r.error for r in cell.requests if r.error})[:3],
        "wall_s": cell.wall,
        "output_tokens": cell.output_tokens,
        "output_tokens_per_s": _rate(cell),
        "requests_per_s": len(ok) / cell.wall if cell.wall > 0 else 0.0,
        "ttft_s": percentiles([r.ttft for r in ok if r.ttft is not None]),
        "itl_s": percentiles([r.itl for r in ok if r.itl is not None]),
        "e2e_s": percentiles([r.e2e for r in ok]),
        **spec,
    }


def _rate(cell: CellResult) -> float:
    return cell.output_tokens / cell.wall if cell.wall > 0 else 0.0


def summarize_rounds(rounds: Sequence[tuple[CellResult, Mapping[str, float]]]) -> dict[str, Any]:
    """One cell measured in rounds (each a CellResult and its counter growth): the figures over
    all rounds' requests (tokens/s: all tokens over all rounds' wall time), plus each round's
    tokens/s, from which speed-ups are taken round by round (see `speedups.speedup`)."""
    pooled = CellResult(concurrency=rounds[0][0].concurrency, wall=sum(cell.wall for cell, _ in rounds),
                        requests=[r for cell, _ in rounds for r in cell.requests])
    counters: dict[str, float] = {}
    for _, d in rounds:
        for key, value in d.items():
            counters[key] = counters.get(key, 0.0) + value
    out = summarize_cell(pooled, spec_stats(counters))
    out["rounds_output_tokens_per_s"] = [_rate(cell) for cell, _ in rounds]
    return out
