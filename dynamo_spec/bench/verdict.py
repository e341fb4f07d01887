"""The judgement of the derived schedule (and the config's own) on the judge prompts, and the advice.

Pure functions over the run's ``columns`` (see speedups).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from dynamo_spec.bench.speedups import CONFIGURED, SCHEDULE, noise, speedup


@dataclass(frozen=True)
class Targets:
    """The speed-ups over k=0 a schedule is held to (None: no target there).

    `speedup`: what it should reach with one client, where speculation has the most idle
    compute to use; `floor`: the least it should keep from `floor_from` clients up, where a
    batch leaves little idle compute and a schedule should fall back to k=0 rather than lose
    more. Between them no target.
    """

    speedup: float | None = 1.3
    floor: float | None = 0.97
    floor_from: int = 4

    def at(self, c: int) -> float | None:
        if c == 1:
            return self.speedup
        return self.floor if c >= self.floor_from else None


def _judged(columns: Mapping[str, Any], name: str, c: int, best: float, n: float | None,
            target: float | None) -> tuple[float | None, float | None, bool | None, bool | None]:
    """A column's speed-up at `c` (judge prompts), its ratio to the best fixed k's, whether it
    meets `target`, whether it lies within the noise `n` of the best fixed k."""
    r = speedup(columns, name, "judge", c)
    vs_best = r / best if r else None
    return (r, vs_best, None if target is None or r is None else r >= target,
            None if vs_best is None or n is None else vs_best >= 1 - n)


def verdict(columns: Mapping[str, Any], concurrencies: Sequence[int], ks: Sequence[int],
            targets: Targets | None = None) -> dict[str, Any]:
    """Judge split: the derived schedule (and, where measured, the config's own: `config_*`)
    against k=0, the `targets` and the best fixed k (by speed-up against each column's k=0
    reference), per concurrency, within the noise. `targets`: the defaults of Targets if None."""
    targets = targets or Targets()
    noise_by_c = noise(columns)
    rows = {}
    for c in concurrencies:
        fixed = {k: speedup(columns, f"k={k}", "judge", c) for k in ks if k}
        fixed = {k: r for k, r in fixed.items() if r is not None}
        best_k = max(fixed, key=fixed.get) if fixed else None
        if best_k is None or fixed[best_k] <= 1.0:
            best_k = 0
        best = 1.0 if best_k == 0 else fixed[best_k]
        n = noise_by_c.get(str(c))
        target = targets.at(c)
        row = {"best_fixed_k": best_k, "noise": n, "target": target}
        (row["schedule_speedup"], row["schedule_vs_best_fixed"], row["meets_target"],
         row["within_noise_of_best"]) = _judged(columns, SCHEDULE, c, best, n, target)
        if CONFIGURED in columns:
            (row["config_speedup"], row["config_vs_best_fixed"], row["config_meets_target"],
             row["config_within_noise_of_best"]) = _judged(columns, CONFIGURED, c, best, n, target)
        rows[str(c)] = row
    return rows


def recommendation(choice: Mapping[int, int], entries: list[list[int]],
                   cost: Mapping[int, float] | None = None, close: Mapping[int, list[int]] | None = None,
                   configured: list[list[int]] | None = None, rows: Mapping[str, Any] | None = None) -> str:
    """`configured`: the config's own schedule, judged in `rows` (the verdict's) when it was
    measured; then the advice weighs the derived schedule against it, not only against k=0."""
    judged = {c: row for c, row in (rows or {}).items()
              if row.get("config_speedup") is not None and row.get("schedule_speedup") is not None}
    better, worse = derived_vs_configured(judged)
    keep = configured is not None and bool(judged) and not better
    return _derived_text(choice, entries, cost, close, keep) + _configured_text(configured, judged, better, worse)


def derived_vs_configured(rows: Mapping[str, Any]) -> tuple[list[str], list[str]]:
    """The concurrencies at which the derived schedule served more than the config's own by more
    than the noise, and those at which it served less by more than the noise (judge prompts)."""
    better, worse = [], []
    for c, row in rows.items():
        n, derived, own = row.get("noise") or 0.0, row["schedule_speedup"], row["config_speedup"]
        if derived > own * (1 + n):
            better.append(c)
        elif own > derived * (1 + n):
            worse.append(c)
    return better, worse


def _configured_text(configured: list[list[int]] | None, judged: Mapping[str, Any], better: list[str],
                     worse: list[str]) -> str:
    if configured is None or not judged:
        return ""
    missed = [f"{c} ({row['config_speedup']:.2f}x, target {row['target']}x)" for c, row in judged.items()
              if row["config_meets_target"] is False]
    text = f" The config's own schedule {configured} " + (
        f"missed the targets at concurrency {', '.join(missed)}." if missed
        else "met the targets at every measured concurrency that has one.")
    if better:
        text += f" The derived one served more than it beyond this run's noise at concurrency {', '.join(better)}"
        text += f" and less at {', '.join(worse)}." if worse else "."
    return text


def _derived_text(choice: Mapping[int, int], entries: list[list[int]], cost: Mapping[int, float] | None,
                  close: Mapping[int, list[int]] | None, keep_configured: bool = False) -> str:
    pays = sorted(c for c, k in choice.items() if k > 0)
    loses = sorted(c for c, k in choice.items() if k == 0)
    if not pays:
        return ("Speculation does not pay on this host and traffic at any measured concurrency: serve without it "
                "(speculative.enabled: false).")
    text = f"Speculation pays at concurrency {', '.join(map(str, pays))}"
    if loses:
        text += f" and does not at {', '.join(map(str, loses))}"
    text += (f": the derived schedule {entries} served no more than the config's own beyond this run's noise "
             "at any concurrency (judge prompts): keep the config's." if keep_configured
             else f": use the derived schedule {entries}.")
    costs = [cost[c] for c in loses if cost and c in cost]
    if costs and max(costs) > 0:
        lo, hi = round(100 * min(costs)), round(100 * max(costs))
        amount = f"{hi} %" if lo == hi else f"up to {hi} %" if lo <= 0 else f"{lo}-{hi} %"
        text += (f" In its k=0 ranges a speculative engine still serves {amount} "
                 f"less than one without speculation (at concurrency {', '.join(map(str, loses))}, derive prompts): "
                 "vLLM keeps the draft's KV cache current in every step. If most of your traffic runs there, "
                 "serve without speculation (speculative.enabled: false).")
    if tied := [c for c, v in (close or {}).items() if v]:
        text += (f" At concurrency {', '.join(map(str, tied))} another k served within this run's noise of the "
                 "chosen one: more --rounds would settle it.")
    return text
