"""`dynamo-spec bench --config`: a run's plan from its config, its servers and their turns at the cells.

The phases (bench.phases, which runs a config: ``run_config``) start servers through a Runner
and have them take turns; each phase returns what it measured, and the result is built from
those values at the end (bench.result).
"""

from __future__ import annotations

import contextlib
import datetime
import json
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

from tqdm import tqdm

from dynamo_spec.bench.host_report import command_line, host_info, relative
from dynamo_spec.bench.load import run_cell
from dynamo_spec.bench.managed_server import ManagedServer, free_port, serve_command
from dynamo_spec.bench.measure import measure_round
from dynamo_spec.bench.options import BenchOptions
from dynamo_spec.bench.result import Cells, Column, SideBySide, columns_json, servers_json
from dynamo_spec.bench.summary import summarize_rounds

STARTS_AT_ONCE = 2  # servers started at once (`Runner.start`)
Prompts = list[dict[str, Any]]


@dataclass(frozen=True)
class Plan:
    """What a run takes from its config, resolved on this host."""

    model: str
    max_batch: int  # the engine's max_num_seqs: where the schedule's last range ends
    dtype: str  # the dtype the engine runs in here
    configured: list[list[int]] | None  # the config's own schedule for that dtype, or None
    derive: Prompts  # the prompts a schedule is derived from
    judge: Prompts  # and those it is judged on
    # servers one at a time: the first phase's speculative columns on one server, each smaller k
    # by a per-request cap (bench.phases.capped_first_phase); False where caps cannot stand in
    capped: bool = False


class Runner:
    """The servers of one run, their turns at the cells, the progress bar and the partial bench.json."""

    def __init__(self, options: BenchOptions, plan: Plan, header: Mapping[str, Any]):
        self.options, self.plan, self.header = options, plan, header
        self.splits = {"derive": plan.derive, "judge": plan.judge}
        self.judge_split = {"judge": plan.judge}
        self.bar = tqdm(total=0, unit="req", desc="bench")

    def requests(self, columns: float, splits: int = 2) -> int:
        """Requests of `columns` columns over `splits` prompt sets and every round: for the progress bar."""
        return int(columns * splits * self.options.rounds
                   * sum(self.options.cell_requests(c) for c in self.options.concurrencies))

    def grow(self, requests: int) -> None:
        self.bar.total += requests
        self.bar.refresh()

    def server(self, name: str, overrides: list[str]) -> ManagedServer:
        port = free_port()
        argv = serve_command(self.options.config, port, [*self.options.overrides, *overrides])
        log = self.options.out / "logs" / f"{name.replace(' ', '_').replace('=', '')}.log"
        return ManagedServer(argv, port, log)

    async def start(self, stack: contextlib.ExitStack, group: list[tuple[str, list[str]]]) -> dict[str, ManagedServer]:
        """`group`'s servers, STARTS_AT_ONCE at a time, each stopped with `stack`, warmed up once all are up.

        A start is mostly three Python processes importing vLLM one after another (API server,
        EngineCore, worker), each on one core: on a 2-core host one start took 35-36 s, two at
        once 50 s for both, three at once 91 s for all three. A cold compile cache makes each
        start longer, not the pairing wrong."""
        servers: dict[str, ManagedServer] = {}
        for i in range(0, len(group), STARTS_AT_ONCE):
            wave = group[i:i + STARTS_AT_ONCE]
            self.bar.set_description("start " + " + ".join(name for name, _ in wave))
            for name, overrides in wave:
                server = self.server(name, overrides)
                stack.callback(server.stop)
                servers[name] = server.launch()
            for name, _ in wave:
                servers[name].wait_ready()
        for server in servers.values():
            await self.warm_up(server)
        return servers

    async def warm_up(self, server: ManagedServer) -> None:
        # the first requests allocate and, without enforce_eager, compile: not recorded
        await run_cell(server.url, self.plan.model, self.plan.judge, concurrency=2, requests=4, max_tokens=16,
                       temperature=self.options.temperature)

    async def take_turns(self, turns: list[tuple[str, ManagedServer]], splits: dict[str, Prompts],
                         on_cells: Callable[[dict[str, Cells]], None] | None = None,
                         caps: Mapping[str, int] | None = None) -> dict[str, Cells]:
        """Each concurrency and prompt split on each server in turn, --rounds times, always in the
        same order, so that (with two servers or more) every cell follows another server's: on a
        2-core VM a server's first cell after another's ran 3-9 % slower than one right after its
        own, and an order that reverses leaves some servers that cost and others not. `on_cells`
        sees the cells so far after each concurrency and split. `caps`: the turns whose requests
        each carry a cap on draft tokens (a column of a server at a larger k), by name."""
        caps = caps or {}
        cells: dict[str, Cells] = {name: {part: {} for part in splits} for name, _ in turns}
        rounds_total = self.options.rounds
        for c in self.options.concurrencies:
            for part, items in splits.items():
                rounds: dict[str, list] = {name: [] for name, _ in turns}
                for r in range(rounds_total):
                    for name, server in turns:
                        self.bar.set_description(name)
                        self.bar.set_postfix_str(f"c={c} {part}" + (f" round {r + 1}" if rounds_total > 1 else ""))
                        rounds[name].append(await measure_round(server.url, self.plan.model, items, c, self.options,
                                                                self.bar, caps.get(name)))
                for name in rounds:
                    cells[name][part][str(c)] = summarize_rounds(rounds[name])
                if on_cells is not None:
                    on_cells(cells)
        return cells

    def checkpoint(self, columns: Mapping[str, Column], side_by_side: SideBySide | None = None) -> None:
        """bench.json with the columns measured so far: partial results survive a crash."""
        partial = {**self.header, "servers": servers_json(side_by_side), "columns": columns_json(columns)}
        (self.options.out / "bench.json").write_text(json.dumps(partial, indent=2))


def run_header(options: BenchOptions, plan: Plan, settings: Any, prompt_sets: Mapping[str, Prompts]) -> dict[str, Any]:
    """The result's first keys: when, the command, what was measured and on which host."""
    return {
        "started": datetime.datetime.now().isoformat(timespec="seconds"),
        "command": command_line(),
        "settings": {"config": str(options.config), "overrides": list(options.overrides), "model": plan.model,
                     "draft": relative(settings.speculative.model), "method": settings.speculative.method,
                     "ks": list(options.ks), "concurrency": list(options.concurrencies), "requests": options.requests,
                     "per_client": options.per_client, "rounds": options.rounds, "max_tokens": options.max_tokens,
                     "temperature": options.temperature, "prompt_sets": {n: len(v) for n, v in prompt_sets.items()},
                     "derive_prompts": len(plan.derive), "judge_prompts": len(plan.judge),
                     "config_schedule": plan.configured, "targets": asdict(options.targets)},
        "host": host_info(plan.dtype, settings.engine.cpu_preload),
    }
