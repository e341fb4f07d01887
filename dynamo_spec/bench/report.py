"""Bench figures: per-cell summaries, the derived batch-size schedule, the verdict, Markdown and plots.

Pure functions over plain data (the JSON the bench writes), so the report can be
rebuilt from a saved run and its consistency checked in tests.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from dynamo_spec.bench.load import CellResult

BASELINE = "k=0"
REPEAT = "k=0 (repeat)"
SCHEDULE = "schedule"
# The schedule the benchmarked config already carries (for the engine's dtype), as a user serves it.
CONFIGURED = "config's schedule"
# Speculation on, but k=0 at every batch size: what a schedule's k=0 ranges serve. vLLM keeps
# the draft's KV cache current in those steps, so this is not free (see SPEC_K0 in choose_k).
SPEC_K0 = "k=0 (speculative engine)"
TARGET_C1 = 1.3  # the targets: >= 1.3x at concurrency 1, >= 0.97x at 4 and above
TARGET_HIGH = 0.97
PRACTICAL_ROUNDS = 6  # beyond this the resolution text advises a quieter host, not more rounds


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
    """How much each spec-decode counter (see read_spec_counters) grew between two readings."""
    return {key: after.get(key, 0.0) - before.get(key, 0.0) for key in set(before) | set(after)}


def spec_stats(d: Mapping[str, float]) -> dict[str, Any]:
    """Acceptance from counter growth (one cell's, or the sum over its rounds), by vLLM's definitions."""
    drafts, draft_tokens, accepted = (int(d.get(n, 0)) for n in ("drafts", "draft_tokens", "accepted"))
    positions = sorted(int(key.split(":")[1]) for key in d if key.startswith("pos:"))
    per_pos = [int(d[f"pos:{p}"]) for p in positions]
    return {
        "drafts": drafts,
        "draft_tokens": draft_tokens,
        "accepted_tokens": accepted,
        "acceptance_rate": accepted / draft_tokens if draft_tokens else None,
        "mean_acceptance_length": 1 + accepted / drafts if drafts else None,
        "per_position_acceptance": [a / drafts for a in per_pos] if drafts else [],
    }


def spec_delta(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, Any]:
    """Acceptance over a cell from two readings of vLLM's spec-decode counters (see read_spec_counters)."""
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
        "output_tokens_per_s": cell.output_tokens / cell.wall if cell.wall > 0 else 0.0,
        "requests_per_s": len(ok) / cell.wall if cell.wall > 0 else 0.0,
        "ttft_s": percentiles([r.ttft for r in ok if r.ttft is not None]),
        "itl_s": percentiles([r.itl for r in ok if r.itl is not None]),
        "e2e_s": percentiles([r.e2e for r in ok]),
        **spec,
    }


def summarize_rounds(rounds: Sequence[tuple[CellResult, Mapping[str, float]]]) -> dict[str, Any]:
    """One cell measured in rounds (each a CellResult and its counter growth): the figures over
    all rounds' requests (tokens/s: all tokens over all rounds' wall time), plus each round's
    tokens/s, from which speed-ups are taken round by round (see `speedup`)."""
    pooled = CellResult(concurrency=rounds[0][0].concurrency, wall=sum(cell.wall for cell, _ in rounds),
                        requests=[r for cell, _ in rounds for r in cell.requests])
    counters: dict[str, float] = {}
    for _, d in rounds:
        for key, value in d.items():
            counters[key] = counters.get(key, 0.0) + value
    out = summarize_cell(pooled, spec_stats(counters))
    out["rounds_output_tokens_per_s"] = [cell.output_tokens / cell.wall if cell.wall > 0 else 0.0
                                         for cell, _ in rounds]
    return out


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


def add_speedups(columns: dict[str, Any]) -> None:
    """speedup = output tokens/s of the cell / that of its k=0 reference at the same concurrency and prompts."""
    for name, column in columns.items():
        for split, cells in column["cells"].items():
            for c, cell in cells.items():
                cell["speedup"] = speedup(columns, name, split, int(c))


def _apart(a: float, b: float) -> float:
    return abs(a - b) / ((a + b) / 2)


def noise(columns: Mapping[str, Any], split: str = "judge") -> dict[str, float]:
    """Run-to-run noise per concurrency: how far apart the same method puts two k=0 runs, the
    repeat and its reference (interleaved: the k=0 cells just before and after the schedule's;
    one after another: the first and the last server), as |a - b| / mean of the two. Measured in
    rounds, the median over rounds of each round's pair: what one round's ratio of two identical
    servers strays by. (Not the stray of the median ratio: two k=0 servers 0.99x, 1.13x and 0.89x
    apart in three rounds have a median ratio of 0.99x, but a speed-up measured the same way
    can be 11 % off; session 18's short run, docs/bench-cpu-default.md.)"""
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


def resolution_text(res: Mapping[str, Any] | None, rounds: int) -> str:
    if not res:
        return ""
    needed = res["rounds_needed"]
    text = (f"One round's speed-up strays here by about {res['round_sd']:.0%} (one standard deviation, from the "
            f"noise), so this run's {'speed-ups tell' if rounds == 1 else f'{rounds}-round medians tell'} apart "
            f"differences of about {res['resolves']:.0%} (two deviations)")
    if res["resolves"] <= res["difference"]:
        return text + f", within the {res['difference']:.0%} margin."
    if needed and needed <= PRACTICAL_ROUNDS:
        return text + f"; the {res['difference']:.0%} margin would take about {needed} rounds (--rounds {needed})."
    return text + (f"; the {res['difference']:.0%} margin would take {f'about {needed}' if needed else 'over 1,000'} "
                   "rounds: on this host trust only larger differences, or measure on a quieter one "
                   "(python -m benchmarks.host_speed shows how steady a host is).")


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
    does not rise with the batch (SmartSpec, arXiv 2406.14066; every schedule this bench derived
    on a quiet host). Where one run's noise says otherwise (session 20: k=0 at 4 clients between
    k=1 at 2 and at 8), the choice is the non-rising sequence of k with the largest product of
    speed-ups over the concurrencies (a dynamic programme over concurrency and k), which is
    the best k at each concurrency wherever that sequence already does not rise.
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


def _judged(columns: Mapping[str, Any], name: str, c: int, best: float, n: float | None,
            target: float | None) -> tuple[float | None, float | None, bool | None, bool | None]:
    """A column's speed-up at `c` (judge prompts), its ratio to the best fixed k's, whether it
    meets `target`, whether it lies within the noise `n` of the best fixed k."""
    r = speedup(columns, name, "judge", c)
    vs_best = r / best if r else None
    return (r, vs_best, None if target is None or r is None else r >= target,
            None if vs_best is None or n is None else vs_best >= 1 - n)


def verdict(columns: Mapping[str, Any], concurrencies: Sequence[int], ks: Sequence[int]) -> dict[str, Any]:
    """Judge split: the derived schedule (and, where measured, the config's own: `config_*`)
    against k=0, the issue's targets and the best fixed k (by speed-up against each column's
    k=0 reference), per concurrency, within the noise."""
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
        target = TARGET_C1 if c == 1 else TARGET_HIGH if c >= 4 else None
        row = {"best_fixed_k": best_k, "noise": n, "target": target}
        (row["schedule_speedup"], row["schedule_vs_best_fixed"], row["meets_target"],
         row["within_noise_of_best"]) = _judged(columns, SCHEDULE, c, best, n, target)
        if CONFIGURED in columns:
            (row["config_speedup"], row["config_vs_best_fixed"], row["config_meets_target"],
             row["config_within_noise_of_best"]) = _judged(columns, CONFIGURED, c, best, n, target)
        rows[str(c)] = row
    return rows


def k0_cost(columns: Mapping[str, Any], concurrencies: Sequence[int], split: str = "derive") -> dict[int, float]:
    """Per concurrency: 1 - (speculative engine at k=0) / (engine without speculation), tokens/s."""
    out = {}
    for c in concurrencies:
        s = speedup(columns, SPEC_K0, split, c)
        if s is not None:
            out[c] = 1 - s
    return out


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


# --- Markdown ------------------------------------------------------------------


def fmt(value: float | None, fmt: str = "{:.1f}") -> str:
    return "-" if value is None else fmt.format(value)


def interleaved(result: Mapping[str, Any]) -> bool:
    return result.get("servers", {}).get("mode") == "interleaved"


def rounds_text(rounds: int) -> str:
    if rounds <= 1:
        return "."
    return (f", in {rounds} rounds (the servers take turns round by round); tokens/s over all rounds, "
            "each speed-up the median of the per-round ratios.")


def servers_line(servers: Mapping[str, Any]) -> str:
    if servers.get("mode") != "interleaved":
        return ("Servers: one at a time (k=0 first and last); speed-ups against the first k=0 server. "
                "On a host whose speed drifts, prefer --together (on CPU the default).")
    groups = " then ".join(" + ".join(g) for g in servers["groups"])
    final = " + ".join(n for n in servers.get("final", [SCHEDULE]) if n != REPEAT)
    return (f"Servers: a k=0 server up the whole run ({servers['reference_rss_gib']} GiB resident); beside it "
            f"{groups}, then {final}; they take turns cell by cell and each speed-up is against the k=0 cell "
            "measured alongside (the k=0 row: the first group's).")


def rate_rows(columns: Mapping[str, Any], split: str, cs: Sequence[int]) -> list[str]:
    """Table rows: tokens/s (speed-up) per column; where servers ran side by side, a row for each
    k=0 reference other than the k=0 column, above the columns measured with it."""
    def row(name: str, cells: Mapping[str, Any]) -> str:
        return f"| {name} | " + " | ".join(
            f"{fmt(cells[str(c)]['output_tokens_per_s'])} ({fmt(cells[str(c)].get('speedup', 1.0), '{:.2f}x')})"
            if str(c) in cells else "-" for c in cs) + " |"

    lines, shown = [], [columns.get(BASELINE, {}).get("cells", {}).get(split)]
    for name, column in columns.items():
        cells = column["cells"].get(split)
        if not cells:
            continue
        reference = column.get("reference", {}).get(split)
        if reference and reference not in shown:
            shown.append(reference)
            lines.append(row(f"k=0 (measured with {name})", {c: {**cell, "speedup": 1.0}
                                                             for c, cell in reference.items()}))
        lines.append(row(name, cells))
    return lines


def markdown(result: Mapping[str, Any]) -> str:
    columns = result["columns"]
    cs = result["settings"]["concurrency"]
    host = result["host"]
    lines = [
        f"# dynamo-spec bench: {result['settings']['model']}",
        "",
        f"Host: {host['cpu_model']} ({host['cores']} cores; {host['isa']}); dtype {host['dtype']}; "
        f"vLLM {host['vllm']} ({host.get('platform') or 'platform not recorded'}); "
        f"LD_PRELOAD {host['ld_preload'] or 'none'}; {result['started']}.",
        f"Load: streaming chat completions via the official openai client, max_tokens "
        f"{result['settings']['max_tokens']}, temperature {result['settings']['temperature']}, requests per cell "
        f"max({result['settings']['requests']}, {result['settings'].get('per_client', 2)} x concurrency)"
        + rounds_text(result['settings'].get('rounds', 1)),
        servers_line(result.get("servers", {})),
        "",
        "## Output tokens/s (speed-up against k=0), judge prompts",
        "",
        "| column | " + " | ".join(f"c={c}" for c in cs) + " |",
        "|---|" + "---|" * len(cs),
    ]
    lines += rate_rows(columns, "judge", cs)
    lines += ["", "## Derive prompts (the schedule is chosen from these)", "",
              "| column | " + " | ".join(f"c={c}" for c in cs) + " | chosen k |", "|---|" + "---|" * (len(cs) + 1)]
    lines += [line + " |" for line in rate_rows(columns, "derive", cs)]
    derived = result["derived"]
    lines.append("| **chosen k** | " + " | ".join(str(derived["choice"].get(str(c), "-")) for c in cs) + " | |")
    if "close_calls" in derived:
        close = derived["close_calls"]
        lines.append("| within the noise of the chosen k | " + " | ".join(
            ", ".join(f"k={k}" for k in close[str(c)]) or "none" if str(c) in close else "-" for c in cs) + " | |")
    lines += ["", f"Schedule (`speculative.num_speculative_tokens_per_batch_size`): `{derived['schedule']}` "
                  f"(k > 0 only where it beats k=0 by more than {100 * derived['margin']:.0f} %, k=0 as a "
                  f"speculative engine serves it when `{SPEC_K0}` was measured); "
                  f"config written to `{derived['config_file']}`.", ""]
    configured = CONFIGURED in columns
    lines += ["## Verdict (judge prompts)", ""]
    if configured:
        lines += [f"The config's own schedule, as it serves: `{result['settings'].get('config_schedule')}`.", ""]
    lines += ["| concurrency | schedule vs k=0 | target | best fixed k | schedule vs best fixed k | noise | within noise |"
              + (" config's schedule vs k=0 | target | vs best fixed k | within noise |" if configured else ""),
              "|---|---|---|---|---|---|---|" + ("---|---|---|---|" if configured else "")]
    yes_no = {True: "yes", False: "NO", None: "-"}

    def judged(v: Mapping[str, Any], speedup_key: str, meets_key: str) -> str:
        return "-" if v.get("target") is None or v.get(speedup_key) is None else \
            f">= {v['target']}x: {yes_no[v.get(meets_key)]}"

    for c in cs:
        v = result["verdict"].get(str(c), {})
        line = (f"| {c} | {fmt(v.get('schedule_speedup'), '{:.2f}x')} | {judged(v, 'schedule_speedup', 'meets_target')} | "
                f"{v.get('best_fixed_k', '-')} | {fmt(v.get('schedule_vs_best_fixed'), '{:.3f}')} | "
                f"{fmt(v.get('noise'), '{:.1%}')} | {yes_no[v.get('within_noise_of_best')]} |")
        if configured:
            line += (f" {fmt(v.get('config_speedup'), '{:.2f}x')} | {judged(v, 'config_speedup', 'config_meets_target')} | "
                     f"{fmt(v.get('config_vs_best_fixed'), '{:.3f}')} | {yes_no[v.get('config_within_noise_of_best')]} |")
        lines.append(line)
    between = ("k=0 first run - k=0 last run" if not interleaved(result)
               else "the k=0 server's cells - a second k=0 server's, taking turns with the schedule"
               if result["servers"].get("repeat") == "second k=0 server"
               else "the k=0 cells just before and after the schedule's")
    if result["settings"].get("rounds", 1) > 1:
        between += ", each round's pair, the median over rounds"
    lines += ["", f"Noise: |{between}| / mean, per concurrency, judge prompts "
                  f"(median {fmt(result['noise_median'], '{:.1%}')}). "
                  + resolution_text(result.get("resolution"), result["settings"].get("rounds", 1)), "",
              f"**Recommendation:** {result['recommendation']}", ""]
    lines += ["## Latency and acceptance per cell (judge prompts)", "",
              "| column | c | tokens/s | req/s | TTFT p50/p90/p99 ms | ITL p50/p90/p99 ms | e2e p50 s | "
              "acceptance rate | mean acceptance length | per position | failed |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, column in columns.items():
        for c in cs:
            cell = column["cells"].get("judge", {}).get(str(c))
            if not cell:
                continue
            ms = lambda p: "/".join(fmt(None if p[q] is None else 1000 * p[q], "{:.0f}") for q in ("p50", "p90", "p99"))  # noqa: E731
            lines.append(
                f"| {name} | {c} | {fmt(cell['output_tokens_per_s'])} | {fmt(cell['requests_per_s'], '{:.2f}')} | "
                f"{ms(cell['ttft_s'])} | {ms(cell['itl_s'])} | {fmt(cell['e2e_s']['p50'], '{:.2f}')} | "
                f"{fmt(cell['acceptance_rate'], '{:.3f}')} | {fmt(cell['mean_acceptance_length'], '{:.2f}')} | "
                f"{' / '.join(f'{p:.2f}' for p in cell['per_position_acceptance']) or '-'} | {cell['failed']} |")
    lines += ["", f"Command: `{result['command']}`", ""]
    return "\n".join(lines)


# --- plots -----------------------------------------------------------------------


def plots(result: Mapping[str, Any], out_dir: Any) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    columns, cs = result["columns"], result["settings"]["concurrency"]
    written = []
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, column in columns.items():
        cells = column["cells"].get("judge", {})
        xs = [c for c in cs if str(c) in cells]
        style = ({"linewidth": 3, "color": "black"} if name == SCHEDULE else {"linewidth": 2, "color": "grey"}
                 if name == CONFIGURED else {"linestyle": "--"} if name == REPEAT else {})
        ax1.plot(xs, [cells[str(c)]["output_tokens_per_s"] for c in xs], marker="o", label=name, **style)
        ax2.plot(xs, [cells[str(c)].get("speedup") or 0 for c in xs], marker="o", label=name, **style)
    for ax, title in ((ax1, "output tokens/s"), (ax2, "speed-up vs k=0")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(cs, [str(c) for c in cs])
        ax.set_xlabel("concurrent clients")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    ax2.axhline(1.0, color="grey", linewidth=1)
    ax1.legend(fontsize=8)
    fig.suptitle(f"{result['settings']['model']} on {result['host']['cpu_model']} (judge prompts)")
    fig.tight_layout()
    path = f"{out_dir}/throughput.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)

    fig, ax = plt.subplots(figsize=(6, 4.5))
    for name, column in columns.items():
        if not name.startswith("k=") or name in (BASELINE, REPEAT, SPEC_K0):
            continue
        cells = [cell for cell in column["cells"].get("judge", {}).values() if cell["drafts"]]
        if not cells:
            continue
        drafts = sum(cell["drafts"] for cell in cells)
        k = len(cells[0]["per_position_acceptance"])
        per_pos = [sum(cell["per_position_acceptance"][p] * cell["drafts"] for cell in cells) / drafts
                   for p in range(k)]
        ax.plot(range(1, k + 1), per_pos, marker="o", label=name)
    ax.set_xlabel("draft position")
    ax.set_ylabel("share of drafts accepted at this position")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title("acceptance by position (judge prompts, all concurrencies)")
    fig.tight_layout()
    path = f"{out_dir}/acceptance_by_position.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)
    return written
