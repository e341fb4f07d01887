"""A run's result (the JSON the bench writes) as Markdown: rates, the chosen k, the verdict, latency.

Reads only the saved result, so a saved ``bench.json`` renders again.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from dynamo_spec.bench.speedups import BASELINE, BUDGET, CONFIGURED, REPEAT, SCHEDULE, SPEC_K0, break_even_rate
from dynamo_spec.config import schedule as schedules

PRACTICAL_ROUNDS = 6  # beyond this the resolution text advises a quieter host, not more rounds
HOST_CHECK = "dynamo-spec bench --host-check"
YES_NO = {True: "yes", False: "NO", None: "-"}


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


def resolution_text(res: Mapping[str, Any] | None, rounds: int) -> str:
    """speedups.resolution in words, with the advice it leads to."""
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
                   f"({HOST_CHECK} shows how steady a host is).")


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


def _header(result: Mapping[str, Any]) -> list[str]:
    host, settings = result["host"], result["settings"]
    return [
        f"# dynamo-spec bench: {settings['model']}",
        "",
        f"Host: {host['cpu_model']} ({host['cores']} cores; {host['isa']}); dtype {host['dtype']}; "
        f"vLLM {host['vllm']} ({host.get('platform') or 'platform not recorded'}); "
        f"LD_PRELOAD {host['ld_preload'] or 'none'}; {result['started']}.",
        f"Load: streaming chat completions via the official openai client, max_tokens "
        f"{settings['max_tokens']}, temperature {settings['temperature']}, requests per cell "
        f"max({settings['requests']}, {settings.get('per_client', 2)} x concurrency)"
        + rounds_text(settings.get('rounds', 1)),
        servers_line(result.get("servers", {})),
        "",
    ]


def _rates(result: Mapping[str, Any]) -> list[str]:
    columns, cs, derived = result["columns"], result["settings"]["concurrency"], result["derived"]
    lines = ["## Output tokens/s (speed-up against k=0), judge prompts", "",
             "| column | " + " | ".join(f"c={c}" for c in cs) + " |", "|---|" + "---|" * len(cs)]
    lines += rate_rows(columns, "judge", cs)
    lines += ["", "## Derive prompts (the schedule is chosen from these)", "",
              "| column | " + " | ".join(f"c={c}" for c in cs) + " | chosen k |", "|---|" + "---|" * (len(cs) + 1)]
    lines += [line + " |" for line in rate_rows(columns, "derive", cs)]
    lines.append("| **chosen k** | " + " | ".join(str(derived["choice"].get(str(c), "-")) for c in cs) + " | |")
    if "close_calls" in derived:
        close = derived["close_calls"]
        lines.append("| within the noise of the chosen k | " + " | ".join(
            ", ".join(f"k={k}" for k in close[str(c)]) or "none" if str(c) in close else "-" for c in cs) + " | |")
    return lines + ["", f"Schedule (`{schedules.FIELD}`): `{derived['schedule']}` "
                        f"(k > 0 only where it beats k=0 by more than {100 * derived['margin']:.0f} %, k=0 as a "
                        f"speculative engine serves it when `{SPEC_K0}` was measured); "
                        f"config written to `{derived['config_file']}`.", ""]


def _judged(v: Mapping[str, Any], speedup_key: str, meets_key: str) -> str:
    return "-" if v.get("target") is None or v.get(speedup_key) is None else \
        f">= {v['target']}x: {YES_NO[v.get(meets_key)]}"


def _verdict(result: Mapping[str, Any]) -> list[str]:
    configured = CONFIGURED in result["columns"]
    lines = ["## Verdict (judge prompts)", ""]
    if configured:
        lines += [f"The config's own schedule, as it serves: `{result['settings'].get('config_schedule')}`.", ""]
    lines += ["| concurrency | schedule vs k=0 | target | best fixed k | schedule vs best fixed k | noise | within noise |"
              + (" config's schedule vs k=0 | target | vs best fixed k | within noise |" if configured else ""),
              "|---|---|---|---|---|---|---|" + ("---|---|---|---|" if configured else "")]
    for c in result["settings"]["concurrency"]:
        v = result["verdict"].get(str(c), {})
        line = (f"| {c} | {fmt(v.get('schedule_speedup'), '{:.2f}x')} | {_judged(v, 'schedule_speedup', 'meets_target')} | "
                f"{v.get('best_fixed_k', '-')} | {fmt(v.get('schedule_vs_best_fixed'), '{:.3f}')} | "
                f"{fmt(v.get('noise'), '{:.1%}')} | {YES_NO[v.get('within_noise_of_best')]} |")
        if configured:
            line += (f" {fmt(v.get('config_speedup'), '{:.2f}x')} | {_judged(v, 'config_speedup', 'config_meets_target')} | "
                     f"{fmt(v.get('config_vs_best_fixed'), '{:.3f}')} | {YES_NO[v.get('config_within_noise_of_best')]} |")
        lines.append(line)
    return lines


def _noise(result: Mapping[str, Any]) -> list[str]:
    between = ("k=0 first run - k=0 last run" if not interleaved(result)
               else "the k=0 server's cells - a second k=0 server's, taking turns with the schedule"
               if result["servers"].get("repeat") == "second k=0 server"
               else "the k=0 cells just before and after the schedule's")
    rounds = result["settings"].get("rounds", 1)
    if rounds > 1:
        between += ", each round's pair, the median over rounds"
    return ["", f"Noise: |{between}| / mean, per concurrency, judge prompts "
                f"(median {fmt(result['noise_median'], '{:.1%}')}). "
                + resolution_text(result.get("resolution"), rounds), "",
            f"**Recommendation:** {result['recommendation']}", ""]


def _ms(p: Mapping[str, float | None]) -> str:
    return "/".join(fmt(None if p[q] is None else 1000 * p[q], "{:.0f}") for q in ("p50", "p90", "p99"))


def _latency(result: Mapping[str, Any]) -> list[str]:
    lines = ["## Latency and acceptance per cell (judge prompts)", "",
             "| column | c | tokens/s | req/s | TTFT p50/p90/p99 ms | ITL p50/p90/p99 ms | e2e p50 s | "
             "acceptance rate | mean acceptance length | per position | break-even rate | failed |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, column in result["columns"].items():
        for c in result["settings"]["concurrency"]:
            cell = column["cells"].get("judge", {}).get(str(c))
            if not cell:
                continue
            lines.append(
                f"| {name} | {c} | {fmt(cell['output_tokens_per_s'])} | {fmt(cell['requests_per_s'], '{:.2f}')} | "
                f"{_ms(cell['ttft_s'])} | {_ms(cell['itl_s'])} | {fmt(cell['e2e_s']['p50'], '{:.2f}')} | "
                f"{fmt(cell['acceptance_rate'], '{:.3f}')} | {fmt(cell['mean_acceptance_length'], '{:.2f}')} | "
                f"{' / '.join(f'{p:.2f}' for p in cell['per_position_acceptance']) or '-'} | "
                f"{fmt(break_even_rate(cell), '{:.3f}')} | {cell['failed']} |")
    lines += ["", "Break-even rate: the acceptance rate at which the cell's speculation would just pay, the "
              "cost of a draft token in plain steps (`speculative.guard.min_acceptance_rate`)."]
    return lines


def _budget(result: Mapping[str, Any]) -> list[str]:
    """The confidence budget's column against the schedules and k=0, and where it dropped drafts."""
    derived, columns = result["derived"], result["columns"]
    costs = derived.get("draft_token_cost")
    if not costs:
        return []
    lines = ["## Confidence budget (judge prompts)", "",
             f"Cost of verifying one draft token, plain steps per request (`speculative.draft_budget.draft_token_cost`, "
             f"k=1 against `{SPEC_K0}`, derive prompts): `{costs}`."]
    if BUDGET not in columns:
        return lines + ["The budget's column was not measured (its schedule drafts nowhere).", ""]
    others = [name for name in (SCHEDULE, CONFIGURED) if name in columns]
    lines += [f"Its column drafts under `{derived.get('budget_schedule')}` (the config's schedule, "
              "else the derived one, one token more wherever it drafts) and verifies only the draft tokens worth it.", "",
              "| c | budget vs k=0 | " + " | ".join(f"{n} vs k=0 | budget vs {n}" for n in others)
              + " | drafted | admitted | accepted | mean acceptance length |",
              "|---|---|" + "---|---|" * len(others) + "---|---|---|---|"]
    for c in result["settings"]["concurrency"]:
        cell = columns[BUDGET]["cells"].get("judge", {}).get(str(c))
        if not cell:
            continue
        mine = cell.get("speedup")
        line = f"| {c} | {fmt(mine, '{:.2f}x')} |"
        for name in others:
            theirs = columns[name]["cells"].get("judge", {}).get(str(c), {}).get("speedup")
            line += (f" {fmt(theirs, '{:.2f}x')} | "
                     f"{fmt(mine / theirs if mine and theirs else None, '{:.3f}')} |")
        budget = cell.get("budget") or {}
        line += (f" {budget.get('drafted', '-')} | {budget.get('admitted', '-')} | {cell.get('accepted_tokens', '-')} | "
                 f"{fmt(cell.get('mean_acceptance_length'), '{:.2f}')} |")
        lines.append(line)
    return lines + ["", "Drafted: draft tokens the draft proposed (after per-request caps); admitted: those the "
                        "budget let the target verify; accepted: those the target accepted.", ""]


def markdown(result: Mapping[str, Any]) -> str:
    lines = (_header(result) + _rates(result) + _verdict(result) + _noise(result) + _budget(result)
             + _latency(result))
    return "\n".join(lines + ["", f"Command: `{result['command']}`", ""])


def url_table(cells: Mapping[str, Mapping[str, Any]]) -> str:
    """One running server's cells (--url), one row per concurrency."""
    lines = ["| c | tokens/s | req/s | TTFT p50 ms | ITL p50 ms | acceptance rate | mean acceptance length |",
             "|---|---|---|---|---|---|---|"]
    for c, cell in cells.items():
        lines.append(f"| {c} | {cell['output_tokens_per_s']:.1f} | {cell['requests_per_s']:.2f} | "
                     f"{1000 * cell['ttft_s']['p50']:.0f} | {1000 * (cell['itl_s']['p50'] or 0):.1f} | "
                     f"{fmt(cell['acceptance_rate'], '{:.3f}')} | {fmt(cell['mean_acceptance_length'], '{:.2f}')} |")
    return "\n".join(lines)
