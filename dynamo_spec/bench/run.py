"""`dynamo-spec bench`: servers per k, the same load on each, a derived schedule, and its judgement.

Columns: k=0, k=1.., k=0 in a speculative engine (speculation on, schedule k=0 at every
batch size: what the schedule's k=0 ranges serve, and the k=0 a schedule's k > 0 must beat),
each on the derive and the judge prompts; then the schedule derived from them, the config's own
schedule where it has one for the engine's dtype (as the config serves it; not when the derived
one is the same), and k=0 again (the run-to-run noise), on the judge prompts. On CPU the servers run side by side: a k=0
server up the whole run, the others in groups beside it taking turns cell by cell, each
speed-up against the k=0 cell measured alongside (`_Bench.interleaved`). With --together 0
(GPU) one server at a time, k=0 first and last (`_Bench.sequential`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import functools
import json
import os
import platform
import shlex
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import requests
import yaml
from prometheus_client.parser import text_string_to_metric_families
from tqdm import tqdm

from dynamo_spec import __version__
from dynamo_spec.bench import report
from dynamo_spec.bench.load import CellResult, run_cell
from dynamo_spec.bench.prompts import load_sets, split
from dynamo_spec.bench.server import ManagedServer, free_port, serve_command
from dynamo_spec.config import schedule as schedules

STARTS_AT_ONCE = 2  # servers started at once (`_Bench.start`)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="measure speculation through the server per k and concurrency; derive a "
                                     "batch-size schedule of k and judge it",
                       epilog="Overrides (--section.field VALUE) after the options apply to every server.")
    p.add_argument("--config", "-c", help="YAML config to benchmark (servers are started from it)")
    p.add_argument("--url", help="benchmark an already running server instead (one setting, no schedule)")
    p.add_argument("--k", default="0,1,2,3,4", help="speculative tokens per step to compare; 0 = no speculation "
                                                    "(default: %(default)s)")
    p.add_argument("--concurrency", default="1,2,4,8,16,32", help="concurrent clients (default: %(default)s)")
    p.add_argument("--prompts", action="append", type=Path,
                   help="JSONL prompt file (repeatable; default: the shipped chat, code and summarize sets)")
    p.add_argument("--requests", type=int, default=8, help="requests per cell, at least --per-client x concurrency "
                                                           "(default: %(default)s)")
    p.add_argument("--per-client", type=int, default=4,
                   help="requests each client sends in a cell, at least: the longer a cell, the less its ramp-up "
                        "and drain (batches below the concurrency) weigh (default: %(default)s)")
    p.add_argument("--max-tokens", type=int, default=64, help="max_tokens of each request (default: %(default)s)")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default: %(default)s)")
    p.add_argument("--margin", type=float, default=0.03,
                   help="k > 0 enters the schedule only where it beats k=0 by more than this (default: %(default)s)")
    p.add_argument("--out", type=Path, default=Path("runs/bench"), help="output folder (default: %(default)s)")
    p.add_argument("--together", type=int, default=None,
                   help="servers up at once beside a k=0 server that stays up the whole run: they take turns cell "
                        "by cell and each speed-up is against the k=0 cell measured alongside, so a host whose speed "
                        "drifts moves them alike; 0: one server at a time, k=0 first and last (default: on CPU as "
                        "many as free memory holds, on GPU 0, as one server takes the device)")
    p.add_argument("--rounds", type=int, default=1,
                   help="measure each cell this many times, the servers taking turns round by round; each "
                        "speed-up is the median of the per-round ratios, so one disturbed round does not move it "
                        "(for hosts whose speed drifts; the run takes this many times as long) (default: %(default)s)")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    p.set_defaults(func=cmd_bench, accepts_overrides=True)


def _ints(text: str, name: str) -> list[int]:
    try:
        values = sorted({int(v) for v in text.split(",") if v.strip()})
    except ValueError:
        raise SystemExit(f"error: --{name}: expected comma-separated integers, got '{text}'") from None
    if not values or values[0] < 0 or (name == "concurrency" and values[0] < 1):
        raise SystemExit(f"error: --{name}: out of range: '{text}'")
    return values


def read_spec_counters(url: str) -> dict[str, float]:
    """vLLM's spec-decode counters from /metrics, summed over engines: drafts, draft_tokens, accepted, pos:i."""
    names = {"vllm:spec_decode_num_drafts": "drafts", "vllm:spec_decode_num_draft_tokens": "draft_tokens",
             "vllm:spec_decode_num_accepted_tokens": "accepted"}
    out: dict[str, float] = {}
    text = requests.get(url.rstrip("/") + "/metrics", timeout=30).text
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if not s.name.endswith("_total"):
                continue
            base = s.name[: -len("_total")]
            if base in names:
                out[names[base]] = out.get(names[base], 0.0) + s.value
            elif base == "vllm:spec_decode_num_accepted_tokens_per_pos":
                key = f"pos:{s.labels['position']}"
                out[key] = out.get(key, 0.0) + s.value
    return out


def host_info(dtype: str, preload: bool = False) -> dict[str, Any]:
    from dynamo_spec.engine.host import detect_host

    try:
        import vllm

        vllm_version = vllm.__version__
    except Exception:  # noqa: BLE001 - only a label
        vllm_version = "unknown"
    host = detect_host()
    isa = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in host.cpu_flags]
    return {"cpu_model": host.cpu_model, "cores": len(os.sched_getaffinity(0)), "isa": " ".join(isa) or "none",
            "dtype": dtype, "platform": host.platform,
            "vllm": vllm_version, "dynamo_spec": __version__, "python": platform.python_version(),
            "ld_preload": _engine_ld_preload(preload and host.on_cpu)}


def _engine_ld_preload(preload: bool) -> str:
    """LD_PRELOAD the servers' engine processes get: the environment's, plus engine.cpu_preload's
    (libraries inside the Python environment written as ``<venv>/...``: reports carry no local paths)."""
    from dynamo_spec.engine.process_env import apply_cpu_preload, cpu_preload_libraries

    env = {"LD_PRELOAD": os.environ.get("LD_PRELOAD", "")}
    if preload:
        apply_cpu_preload(env, cpu_preload_libraries())
    value = env["LD_PRELOAD"]
    for prefix in {os.path.realpath(sys.prefix), sys.prefix}:
        value = value.replace(prefix + os.sep, "<venv>" + os.sep)
    return value


def cell_requests(args: argparse.Namespace, c: int) -> int:
    return max(args.requests, args.per_client * c)


async def _measure_round(url: str, model: str, items: list[dict], c: int, args: argparse.Namespace,
                         bar: tqdm) -> tuple[CellResult, dict[str, float]]:
    """One round of a cell: its requests and how far the server's spec-decode counters grew."""
    before = read_spec_counters(url)
    cell = await run_cell(url, model, items, concurrency=c, requests=cell_requests(args, c),
                          max_tokens=args.max_tokens, temperature=args.temperature, on_done=lambda: bar.update(1))
    return cell, report.counter_delta(before, read_spec_counters(url))


async def _measure(url: str, model: str, items: list[dict], c: int, args: argparse.Namespace, bar: tqdm) -> dict:
    return report.summarize_rounds([await _measure_round(url, model, items, c, args, bar) for _ in range(args.rounds)])


def _server_overrides(k: int | None, schedule: list[list[int]] | None) -> list[str]:
    if k == 0:
        return ["--speculative.enabled", "false"]
    out = ["--speculative.enabled", "true", "--speculative.num_speculative_tokens", str(k)]
    return out + ["--" + schedules.FIELD, json.dumps(schedule) if schedule else "null"]


def write_schedule_config(config: Path, schedule: list[list[int]], out: Path, dtype: str = "default") -> Path:
    """The benchmarked config with the derived schedule; paths rebased to the new file's folder.

    A config with a schedule per dtype keeps its other hosts' entries: the derived schedule
    replaces the entry for `dtype`, the dtype the engine ran in here.
    """
    data = yaml.safe_load(config.read_text()) or {}
    base = config.parent.resolve()

    def rebase(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: rebase(v) for k, v in value.items()}
        if isinstance(value, list):
            return [rebase(v) for v in value]
        if isinstance(value, str) and value.startswith(("./", "../")):
            rel = os.path.relpath(os.path.normpath(base / value), out.parent.resolve())
            return rel if rel.startswith("../") else "./" + rel
        return value

    out.parent.mkdir(parents=True, exist_ok=True)
    data = rebase(data)
    spec = data.setdefault("speculative", {})
    per_dtype = spec.get("num_speculative_tokens_per_batch_size")
    if isinstance(per_dtype, dict):
        per_dtype = schedules.with_entry(per_dtype, dtype, schedule)
        top = max(schedules.top_k(entry) for entry in per_dtype.values())
        spec["enabled"] = top > 0
        if top:
            spec["num_speculative_tokens"] = top
        spec["num_speculative_tokens_per_batch_size"] = per_dtype
    elif (top := schedules.top_k(schedule)) == 0:
        spec["enabled"] = False
        spec.pop("num_speculative_tokens_per_batch_size", None)
    else:
        spec["enabled"] = True
        spec["num_speculative_tokens"] = top
        if len({k for _, _, k in schedule}) == 1:
            spec.pop("num_speculative_tokens_per_batch_size", None)  # one k everywhere: no schedule needed
        else:
            spec["num_speculative_tokens_per_batch_size"] = schedule
    out.write_text(f"# Written by dynamo-spec bench from {config.name}; schedule derived on "
                   f"{host_info('-')['cpu_model']} ({dtype}).\n" + yaml.safe_dump(data, sort_keys=False))
    return out


def _relative(path: str | None) -> str | None:
    """A local path relative to the working directory (reports travel between machines)."""
    if path and os.path.isabs(path) and Path(path).exists():
        rel = os.path.relpath(path)
        return rel if not rel.startswith("../../") else path
    return path


def cmd_bench(args: argparse.Namespace) -> int:
    if bool(args.config) == bool(args.url):
        raise SystemExit("error: give --config FILE (start servers) or --url URL (a running server)")
    concurrencies = _ints(args.concurrency, "concurrency")
    if args.rounds < 1:
        raise SystemExit(f"error: --rounds: expected 1 or more, got {args.rounds}")
    sets = load_sets(args.prompts)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.url:
        return _bench_url(args, concurrencies, sets)
    return asyncio.run(_bench_config(args, concurrencies, sets))


def _bench_url(args: argparse.Namespace, concurrencies: list[int], sets: dict) -> int:
    items = [item for items in sets.values() for item in items]
    model = requests.get(args.url.rstrip("/") + "/v1/models", timeout=30).json()["data"][0]["id"]
    total = args.rounds * sum(cell_requests(args, c) for c in concurrencies)
    cells = {}
    with tqdm(total=total, desc=args.url, unit="req") as bar:
        for c in concurrencies:
            cells[str(c)] = asyncio.run(_measure(args.url, model, items, c, args, bar))
    result = {"url": args.url, "model": model, "cells": cells, "command": shlex.join(sys.argv),
              "started": datetime.datetime.now().isoformat(timespec="seconds")}
    (args.out / "bench-url.json").write_text(json.dumps(result, indent=2))
    print("| c | tokens/s | req/s | TTFT p50 ms | ITL p50 ms | acceptance rate | mean acceptance length |")
    print("|---|---|---|---|---|---|---|")
    for c, cell in cells.items():
        print(f"| {c} | {cell['output_tokens_per_s']:.1f} | {cell['requests_per_s']:.2f} | "
              f"{1000 * cell['ttft_s']['p50']:.0f} | {1000 * (cell['itl_s']['p50'] or 0):.1f} | "
              f"{report.fmt(cell['acceptance_rate'], '{:.3f}')} | {report.fmt(cell['mean_acceptance_length'], '{:.2f}')} |")
    return 0


def _others(ks: list[int], never: list[list[int]]) -> list[tuple[str, list[str]]]:
    """The first phase's columns besides k=0: each fixed k, then the speculative engine at k=0."""
    plan = [(f"k={k}", _server_overrides(k, None)) for k in ks if k]
    if max(ks) > 0:
        plan.append((report.SPEC_K0, _server_overrides(max(ks), never)))
    return plan


def server_rss(server: ManagedServer) -> int:
    """Resident memory of a server's processes (API server, EngineCore, workers), in bytes."""
    import psutil

    procs = [psutil.Process(server.proc.pid)]
    procs += procs[0].children(recursive=True)
    total = 0
    for proc in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            total += proc.memory_info().rss
    return total


def servers_that_fit(per_server: int, wanted: int, reserve: int = 2 << 30) -> int:
    """How many more servers of `per_server` bytes the free memory holds, keeping `reserve` free
    (at most `wanted`; 0: not one)."""
    import psutil

    available = psutil.virtual_memory().available
    return max(0, min(wanted, int((available - reserve) // (per_server * 1.15))))


class _Bench:
    """One `dynamo-spec bench --config` run: its servers, cells, and the result it writes."""

    def __init__(self, args: argparse.Namespace, config: Path, model: str, concurrencies: list[int],
                 splits: dict[str, list[dict]], result: dict[str, Any], max_batch: int):
        self.args, self.config, self.model, self.concurrencies = args, config, model, concurrencies
        self.splits, self.judge = splits, {"judge": splits["judge"]}
        self.result, self.max_batch = result, max_batch
        self.configured = result["settings"]["config_schedule"]  # the config's own schedule, or None
        self.bar = tqdm(total=0, unit="req", desc="bench")

    def requests(self, columns: float, splits: int = 2) -> int:
        """Requests of `columns` columns over `splits` prompt sets and every round: for the progress bar."""
        return int(columns * splits * self.args.rounds * sum(cell_requests(self.args, c) for c in self.concurrencies))

    def grow(self, requests: int) -> None:
        self.bar.total += requests
        self.bar.refresh()

    def server(self, name: str, overrides: list[str]) -> ManagedServer:
        port = free_port()
        argv = serve_command(self.config, port, [*self.args.overrides, *overrides])
        log = self.args.out / "logs" / f"{name.replace(' ', '_').replace('=', '')}.log"
        return ManagedServer(argv, port, log)

    async def start(self, stack: contextlib.ExitStack, plan: list[tuple[str, list[str]]]) -> dict[str, ManagedServer]:
        """`plan`'s servers, STARTS_AT_ONCE at a time, each stopped with `stack`, warmed up once all are up.

        A start is mostly three Python processes importing vLLM one after another (API server,
        EngineCore, worker), each on one core: on the 2-core Zen 4 host one start took 35-36 s,
        two at once 50 s for both, three at once 91 s for all three (docs/bench-zen4-21/starts.py).
        A cold compile cache makes each start longer, not the pairing wrong."""
        servers: dict[str, ManagedServer] = {}
        for i in range(0, len(plan), STARTS_AT_ONCE):
            wave = plan[i:i + STARTS_AT_ONCE]
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
        await run_cell(server.url, self.model, self.splits["judge"], concurrency=2, requests=4, max_tokens=16,
                       temperature=self.args.temperature)

    def record(self, name: str, overrides: list[str], server: ManagedServer, cells: dict,
               reference: dict | None = None) -> None:
        column = {"overrides": overrides, "server_ready_s": server.ready_after, "cells": cells}
        if reference is not None:
            column["reference"] = reference  # the k=0 cells measured alongside: this column's speed-ups
        self.result["columns"][name] = column
        report.add_speedups(self.result["columns"])
        self.save()

    def save(self) -> None:
        (self.args.out / "bench.json").write_text(json.dumps(self.result, indent=2))  # partial results survive

    def judge_configured(self) -> bool:
        """Whether the config's own schedule gets a column: it has one that the derived one is not."""
        return self.configured is not None and self.configured != self.result["derived"]["schedule"]

    def derive_schedule(self, ks: list[int]) -> list[str]:
        """The schedule from the first phase's columns, written as a config; its server's overrides."""
        choice = report.choose_k(self.result["columns"], ks, self.concurrencies, self.args.margin)
        schedule = report.schedule_from_choice(choice, self.max_batch)
        config_file = write_schedule_config(self.config, schedule, self.args.out / "config-with-schedule.yaml",
                                            self.result["host"]["dtype"])
        self.result["derived"] = {"choice": {str(c): k for c, k in choice.items()}, "schedule": schedule,
                                  "margin": self.args.margin, "config_file": str(config_file)}
        top = schedules.top_k(schedule)
        return _server_overrides(top, schedule) if top else _server_overrides(0, None)

    async def sequential(self, ks: list[int], never: list[list[int]]) -> None:
        """One server at a time: k=0, the others, the schedule, the config's own, k=0 again (the noise)."""
        k0 = _server_overrides(0, None)
        plan = [(report.BASELINE, k0, self.splits), *((n, o, self.splits) for n, o in _others(ks, never))]
        self.grow(self.requests(len(plan)) + self.requests(2, splits=1))
        for name, overrides, splits in [*plan, (report.SCHEDULE, None, self.judge), (report.CONFIGURED, [], self.judge),
                                        (report.REPEAT, k0, self.judge)]:
            if name == report.SCHEDULE:
                overrides = self.derive_schedule(ks)
            elif name == report.CONFIGURED:
                if not self.judge_configured():
                    continue
                self.grow(self.requests(1, splits=1))
            self.bar.set_description(f"start {name}")
            with self.server(name, overrides) as server:
                await self.warm_up(server)
                cells = await self.take_turns([(name, server)], splits)
            self.record(name, overrides, server, cells[name])

    async def interleaved(self, ks: list[int], never: list[list[int]], together: int | None) -> bool:
        """A k=0 server up the whole run; the other columns in groups of `together` servers beside
        it, taking turns cell by cell in a fixed order, each group's speed-ups against the k=0 cells
        measured with it; the schedule last, beside the k=0 server and a second one (the noise).
        False, having measured nothing, if `together` is None and free memory holds no second server.
        """
        k0 = _server_overrides(0, None)
        others = _others(ks, never)
        with self.server(report.BASELINE, k0) as reference:
            await self.warm_up(reference)
            rss = server_rss(reference)
            if not together:
                together = servers_that_fit(rss, len(others))
                if not together:
                    tqdm.write(f"bench: free memory holds no second server of {rss / 2**30:.1f} GiB: "
                               "one server at a time")
                    return False
            groups = [others[i:i + together] for i in range(0, len(others), together)]
            self.result["servers"] = {"mode": "interleaved", "together": together,
                                      "groups": [[n for n, _ in g] for g in groups],
                                      "reference_rss_gib": round(rss / 2**30, 2)}
            tqdm.write(f"bench: a k=0 server ({rss / 2**30:.1f} GiB) up the whole run; beside it "
                       f"{' then '.join('+'.join(n for n, _ in g) for g in groups)}, then the schedule"
                       + (f" and the config's own {self.configured} (if not the same)" if self.configured else ""))
            self.grow(self.requests(len(others) + len(groups)) + self.requests(3, splits=1))
            for g, group in enumerate(groups):
                with contextlib.ExitStack() as stack:
                    servers = await self.start(stack, group)
                    turns = [(report.BASELINE, reference), *servers.items()]
                    # recorded as the cells come: partial results survive a crash
                    await self.take_turns(turns, self.splits, on_cells=functools.partial(
                        self.record_group, group=group, servers=servers, reference=reference, with_baseline=g == 0))
            overrides = self.derive_schedule(ks)
            with contextlib.ExitStack() as stack:
                # the same shapes as a first-phase group: (name, overrides) and the servers by name.
                # Beside the derived schedule: the config's own, as it serves (no override), and the
                # repeat, a second k=0 server, so that every cell follows another server's (a
                # server's first cell after another's runs a few per cent slower on a 2-core VM),
                # as far as free memory holds them (the derived schedule's server always starts).
                extras = [(report.CONFIGURED, [])] if self.judge_configured() else []
                extras.append((report.REPEAT, k0))
                room = max(0, servers_that_fit(rss, 1 + len(extras)) - 1)
                group = [(report.SCHEDULE, overrides), *extras[:room]]
                if self.judge_configured() and room == 0:
                    tqdm.write(f"bench: free memory holds no server for {report.CONFIGURED}: not measured")
                if any(name == report.CONFIGURED for name, _ in group):
                    self.grow(self.requests(1, splits=1))
                servers = await self.start(stack, group)
                if report.REPEAT not in servers:  # no room for it: the k=0 server again, before its own next cell
                    group.append((report.REPEAT, k0))
                    servers[report.REPEAT] = reference
                self.result["servers"]["repeat"] = ("k=0 server" if servers[report.REPEAT] is reference
                                                    else "second k=0 server")
                self.result["servers"]["final"] = [name for name, _ in group]
                turns = [("before", reference), *servers.items()]
                record = functools.partial(self.record_group, group=group, servers=servers, reference_name="before")
                await self.take_turns(turns, self.judge, on_cells=record)  # k=0, schedule(s), k=0
        return True

    def record_group(self, cells: dict[str, dict], *, group: list[tuple[str, list[str]]],
                     servers: dict[str, ManagedServer], reference: ManagedServer | None = None,
                     with_baseline: bool = False, reference_name: str = report.BASELINE) -> None:
        """Record a group's columns with the k=0 cells taken alongside (`reference_name` in `cells`)
        as their reference; `with_baseline`: those cells are also the k=0 column."""
        if with_baseline:
            self.record(report.BASELINE, _server_overrides(0, None), reference, cells[reference_name])
        for name, overrides in group:
            self.record(name, overrides, servers[name], cells[name], reference=cells[reference_name])

    async def take_turns(self, turns: list[tuple[str, ManagedServer]], splits: dict[str, list[dict]],
                         on_cells: Callable[[dict], None] | None = None,
                         ) -> dict[str, dict[str, dict]]:
        """Each concurrency and prompt split on each server in turn, --rounds times, always in the
        same order, so that (with two servers or more) every cell follows another server's: on a
        2-core VM a server's first cell after another's ran 3-9 % slower than one right after its
        own (docs/bench-cpu-default.md, session 18), and an order that reverses leaves some servers
        that cost and others not. `on_cells` sees the cells so far after each concurrency and split."""
        cells: dict[str, dict[str, dict]] = {name: {part: {} for part in splits} for name, _ in turns}
        for c in self.concurrencies:
            for part, items in splits.items():
                rounds: dict[str, list] = {name: [] for name, _ in turns}
                for r in range(self.args.rounds):
                    for name, server in turns:
                        self.bar.set_description(name)
                        self.bar.set_postfix_str(f"c={c} {part}" + (f" round {r + 1}" if self.args.rounds > 1 else ""))
                        rounds[name].append(await _measure_round(server.url, self.model, items, c, self.args,
                                                                 self.bar))
                for name in rounds:
                    cells[name][part][str(c)] = report.summarize_rounds(rounds[name])
                if on_cells is not None:
                    on_cells(cells)
        return cells


def default_together(args: argparse.Namespace, on_cpu: bool) -> int | None:
    """--together as given; else None (as many as memory holds) on CPU and 0 (one at a time) on GPU,
    where one server takes the device's memory."""
    if args.together is not None:
        if args.together < 0:
            raise SystemExit(f"error: --together: expected 0 or more, got {args.together}")
        return args.together
    return None if on_cpu else 0


async def _bench_config(args: argparse.Namespace, concurrencies: list[int], sets: dict) -> int:
    from dynamo_spec.config.loader import load_settings
    from dynamo_spec.config.preflight import effective_max_num_seqs
    from dynamo_spec.engine.host import detect_host, resolve_dtype

    config = Path(args.config)
    ks = _ints(args.k, "k")
    if ks[0] != 0:
        ks = [0, *ks]  # k=0 is the reference of every speed-up
    settings = load_settings(config, args.overrides).settings
    host = detect_host()
    together = default_together(args, host.on_cpu)
    model = settings.served_model_name
    derive, judge = split(sets)
    max_batch = effective_max_num_seqs(settings, host.on_cpu)
    dtype = resolve_dtype(settings.engine.dtype, host)[0]
    configured = schedules.for_engine(settings, dtype)[0] if settings.speculative.enabled else None
    never = [[1, max_batch, 0]]  # speculation on, never a draft token: the schedule's k=0 ranges
    result: dict[str, Any] = {
        "started": datetime.datetime.now().isoformat(timespec="seconds"),
        # the program by name only: no path of this machine in the report
        "command": shlex.join(["dynamo-spec" if sys.argv[0].endswith("__main__.py") else os.path.basename(sys.argv[0]),
                               *sys.argv[1:]]),
        "settings": {"config": str(config), "overrides": args.overrides, "model": model,
                     "draft": _relative(settings.speculative.model), "method": settings.speculative.method, "ks": ks,
                     "concurrency": concurrencies, "requests": args.requests,
                     "per_client": args.per_client, "rounds": args.rounds, "max_tokens": args.max_tokens,
                     "temperature": args.temperature, "prompt_sets": {n: len(v) for n, v in sets.items()},
                     "derive_prompts": len(derive), "judge_prompts": len(judge),
                     "config_schedule": schedules.as_lists(configured)},
        "host": host_info(dtype, settings.engine.cpu_preload),
        "servers": {"mode": "sequential"},
        "columns": {},
    }
    bench = _Bench(args, config, model, concurrencies, {"derive": derive, "judge": judge}, result, max_batch)
    try:
        if together == 0 or not await bench.interleaved(ks, never, together):
            await bench.sequential(ks, never)
    finally:
        bench.bar.close()
    report.add_speedups(result["columns"])
    result["verdict"] = report.verdict(result["columns"], concurrencies, ks)
    noise = report.noise(result["columns"])
    result["noise_median"] = statistics.median(noise.values()) if noise else None
    result["resolution"] = report.resolution(result["noise_median"], args.rounds, args.margin)
    choice = {int(c): k for c, k in result["derived"]["choice"].items()}
    cost = report.k0_cost(result["columns"], concurrencies)
    result["k0_cost"] = {str(c): v for c, v in cost.items()}
    close = report.close_calls(result["columns"], choice, ks, noise)
    result["derived"]["close_calls"] = {str(c): v for c, v in close.items()}
    result["recommendation"] = report.recommendation(choice, result["derived"]["schedule"], cost, close,
                                                     result["settings"]["config_schedule"], result["verdict"])
    result["finished"] = datetime.datetime.now().isoformat(timespec="seconds")
    (args.out / "bench.json").write_text(json.dumps(result, indent=2))
    (args.out / "bench.md").write_text(report.markdown(result))
    if not args.no_plots:
        result["plots"] = report.plots(result, args.out)
    print(report.markdown(result))
    print(f"\nWritten: {args.out}/bench.json, bench.md, config-with-schedule.yaml"
          + ("" if args.no_plots else ", throughput.png, acceptance_by_position.png"))
    return 0
