"""What the phases of a run return, and the result (``bench.json``) built from them at the end."""

from __future__ import annotations

import datetime
import json
import statistics
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from dynamo_spec.bench import plots, render
from dynamo_spec.bench.choose import close_calls, k0_cost
from dynamo_spec.bench.options import BenchOptions
from dynamo_spec.bench.schedule_config import FILE as SCHEDULE_CONFIG
from dynamo_spec.bench.speedups import add_speedups, noise, resolution
from dynamo_spec.bench.verdict import recommendation, verdict

Cells = dict[str, dict[str, dict[str, Any]]]  # prompt split -> concurrency -> a cell's summary


@dataclass(frozen=True)
class Column:
    """One server's cells; `reference`: the k=0 cells measured alongside (servers side by side);
    `max_draft_tokens`: each request's cap on draft tokens, where the column shares a server at a
    larger k (servers one at a time)."""

    overrides: list[str]
    server_ready_s: float | None
    cells: Cells
    reference: Cells | None = None
    max_draft_tokens: int | None = None

    def as_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"overrides": self.overrides, "server_ready_s": self.server_ready_s,
                               "cells": self.cells}
        if self.reference is not None:
            out["reference"] = self.reference
        if self.max_draft_tokens is not None:
            out["max_draft_tokens"] = self.max_draft_tokens
        return out


@dataclass(frozen=True)
class SideBySide:
    """How the first phase's servers ran beside the k=0 server that stays up the whole run."""

    together: int
    groups: list[list[str]]
    reference_rss_gib: float


@dataclass(frozen=True)
class Compared:
    """The first phase: k=0, each fixed k and the speculative engine at k=0, on both prompt splits."""

    columns: dict[str, Column]
    side_by_side: SideBySide | None = None  # None: one server at a time


@dataclass(frozen=True)
class Derived:
    """The schedule chosen from the first phase, and the config written with it."""

    choice: dict[int, int]
    schedule: list[list[int]]
    margin: float
    config_file: str
    # The confidence budget's measured cost of a verified draft token, [[concurrency, cost], ...], and the
    # schedule its column runs (None: not measured, no k=1 or no speculative engine at k=0).
    draft_token_cost: list[list[float]] | None = None
    budget_schedule: list[list[int]] | None = None


@dataclass(frozen=True)
class Judged:
    """The second phase: the schedule, the config's own where it differs, and k=0 again, on the judge split."""

    columns: dict[str, Column]
    repeat: str | None = None  # side by side: which server served the repeat
    final: list[str] | None = None  # side by side: the servers beside the k=0 server, in turn order


def columns_json(columns: Mapping[str, Column]) -> dict[str, Any]:
    return add_speedups({name: column.as_json() for name, column in columns.items()})


def servers_json(side_by_side: SideBySide | None, judged: Judged | None = None) -> dict[str, Any]:
    if side_by_side is None:
        return {"mode": "sequential"}
    out = {"mode": "interleaved", **asdict(side_by_side)}
    if judged is not None:
        out.update(repeat=judged.repeat, final=judged.final)
    return out


def assemble(header: Mapping[str, Any], compared: Compared, derived: Derived, judged: Judged,
             options: BenchOptions) -> dict[str, Any]:
    """The whole result: the phases' columns, the schedule, and what they say (verdict, noise, advice)."""
    columns = columns_json({**compared.columns, **judged.columns})
    cs, ks = list(options.concurrencies), list(options.ks)
    rows = verdict(columns, cs, ks, options.targets)
    noise_by_c = noise(columns)
    noise_median = statistics.median(noise_by_c.values()) if noise_by_c else None
    cost = k0_cost(columns, cs)
    close = close_calls(columns, derived.choice, ks, noise_by_c)
    return {
        **header,
        "servers": servers_json(compared.side_by_side, judged),
        "columns": columns,
        "derived": {"choice": {str(c): k for c, k in derived.choice.items()}, "schedule": derived.schedule,
                    "margin": derived.margin, "config_file": derived.config_file,
                    "close_calls": {str(c): v for c, v in close.items()},
                    "draft_token_cost": derived.draft_token_cost, "budget_schedule": derived.budget_schedule},
        "verdict": rows,
        "noise_median": noise_median,
        "resolution": resolution(noise_median, options.rounds, options.margin),
        "k0_cost": {str(c): v for c, v in cost.items()},
        "recommendation": recommendation(derived.choice, derived.schedule, cost, close,
                                         header["settings"]["config_schedule"], rows),
        "finished": datetime.datetime.now().isoformat(timespec="seconds"),
    }


def write(result: Mapping[str, Any], out: Path, with_plots: bool) -> None:
    """bench.json, bench.md and the plots; the Markdown printed too."""
    (out / "bench.json").write_text(json.dumps(result, indent=2))
    (out / "bench.md").write_text(render.markdown(result))
    if with_plots:
        plots.plots(result, out)
    print(render.markdown(result))
    print(f"\nWritten: {out}/bench.json, bench.md, {SCHEDULE_CONFIG}" + ("" if not with_plots else
                                                                       ", " + ", ".join(plots.FILES)))
