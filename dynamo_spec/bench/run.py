"""`dynamo-spec bench`: servers per k, the same load on each, a derived schedule, and its judgement.

Order of servers: k=0, k=1.., k=0 in a speculative engine (speculation on, schedule k=0
at every batch size: what the schedule's k=0 ranges serve, and the k=0 a schedule's k > 0
must beat), the derived schedule, k=0 again (the last gives the run-to-run noise). Each
fixed k and the speculative k=0 run every concurrency on the derive prompts and on the
judge prompts; the schedule and the repeat run on the judge prompts only.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import shlex
import statistics
import sys
from pathlib import Path
from typing import Any

import requests
import yaml
from prometheus_client.parser import text_string_to_metric_families
from tqdm import tqdm

from dynamo_spec import __version__
from dynamo_spec.bench import report
from dynamo_spec.bench.load import run_cell
from dynamo_spec.bench.prompts import load_sets, split
from dynamo_spec.bench.server import ManagedServer, free_port, serve_command
from dynamo_spec.settings import SCHEDULE_KEYS

SCHEDULE_KEY = "speculative.num_speculative_tokens_per_batch_size"


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
    from dynamo_spec.host import detect_host

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
    from dynamo_spec.host import apply_cpu_preload, cpu_preload_libraries

    env = {"LD_PRELOAD": os.environ.get("LD_PRELOAD", "")}
    if preload:
        apply_cpu_preload(env, cpu_preload_libraries())
    value = env["LD_PRELOAD"]
    for prefix in {os.path.realpath(sys.prefix), sys.prefix}:
        value = value.replace(prefix + os.sep, "<venv>" + os.sep)
    return value


def cell_requests(args: argparse.Namespace, c: int) -> int:
    return max(args.requests, args.per_client * c)


async def _measure(url: str, model: str, items: list[dict], c: int, args: argparse.Namespace, bar: tqdm) -> dict:
    before = read_spec_counters(url)
    cell = await run_cell(url, model, items, concurrency=c, requests=cell_requests(args, c),
                          max_tokens=args.max_tokens, temperature=args.temperature, on_done=lambda: bar.update(1))
    return report.summarize_cell(cell, report.spec_delta(before, read_spec_counters(url)))


async def _column(url: str, model: str, splits: dict[str, list[dict]], args: argparse.Namespace,
                  concurrencies: list[int], bar: tqdm) -> dict[str, dict[str, Any]]:
    # Warm-up (first requests allocate and, without enforce_eager, compile): not recorded.
    await run_cell(url, model, splits[next(iter(splits))], concurrency=2, requests=4, max_tokens=16,
                   temperature=args.temperature)
    cells: dict[str, dict[str, Any]] = {name: {} for name in splits}
    for c in concurrencies:
        for name, items in splits.items():
            bar.set_postfix_str(f"c={c} {name}")
            cells[name][str(c)] = await _measure(url, model, items, c, args, bar)
    return cells


def _server_overrides(k: int | None, schedule: list[list[int]] | None) -> list[str]:
    if k == 0:
        return ["--speculative.enabled", "false"]
    out = ["--speculative.enabled", "true", "--speculative.num_speculative_tokens", str(k)]
    return out + ["--" + SCHEDULE_KEY, json.dumps(schedule) if schedule else "null"]


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
        key = dtype if dtype in SCHEDULE_KEYS else "default"
        per_dtype = {**per_dtype, key: schedule}
        top = max(k for entry in per_dtype.values() for _, _, k in entry)
        spec["enabled"] = top > 0
        if top:
            spec["num_speculative_tokens"] = top
        spec["num_speculative_tokens_per_batch_size"] = per_dtype
    elif (top := max(k for _, _, k in schedule)) == 0:
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
    sets = load_sets(args.prompts)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.url:
        return _bench_url(args, concurrencies, sets)
    return asyncio.run(_bench_config(args, concurrencies, sets))


def _bench_url(args: argparse.Namespace, concurrencies: list[int], sets: dict) -> int:
    items = [item for items in sets.values() for item in items]
    model = requests.get(args.url.rstrip("/") + "/v1/models", timeout=30).json()["data"][0]["id"]
    total = sum(cell_requests(args, c) for c in concurrencies)
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


async def _bench_config(args: argparse.Namespace, concurrencies: list[int], sets: dict) -> int:
    from dynamo_spec.config_loader import load_settings
    from dynamo_spec.host import detect_host, resolve_dtype
    from dynamo_spec.preflight import VLLM_DEFAULT_MAX_NUM_SEQS

    config = Path(args.config)
    ks = _ints(args.k, "k")
    if ks[0] != 0:
        ks = [0, *ks]  # k=0 is the reference of every speed-up
    settings = load_settings(config, args.overrides).settings
    host = detect_host()
    model = settings.served_model_name
    derive, judge = split(sets)
    splits_fixed = {"derive": derive, "judge": judge}
    max_batch = settings.engine.max_num_seqs or VLLM_DEFAULT_MAX_NUM_SEQS["cpu" if host.on_cpu else "gpu"]
    never = [[1, max_batch, 0]]  # speculation on, never a draft token: the schedule's k=0 ranges
    plan = [(f"k={k}", k) for k in ks]
    if max(ks) > 0:
        plan.append((report.SPEC_K0, None))
    plan += [(report.SCHEDULE, None), (report.REPEAT, 0)]
    per_split = sum(cell_requests(args, c) for c in concurrencies)
    # the schedule and the repeat run the judge prompts only, every other column both splits
    total = per_split * sum(1 if name in (report.SCHEDULE, report.REPEAT) else 2 for name, _ in plan)
    result: dict[str, Any] = {
        "started": datetime.datetime.now().isoformat(timespec="seconds"),
        # the program by name only: no path of this machine in the report
        "command": shlex.join(["dynamo-spec" if sys.argv[0].endswith("__main__.py") else os.path.basename(sys.argv[0]),
                               *sys.argv[1:]]),
        "settings": {"config": str(config), "overrides": args.overrides, "model": model,
                     "draft": _relative(settings.speculative.model), "method": settings.speculative.method, "ks": ks,
                     "concurrency": concurrencies, "requests": args.requests,
                     "per_client": args.per_client, "max_tokens": args.max_tokens,
                     "temperature": args.temperature, "prompt_sets": {n: len(v) for n, v in sets.items()},
                     "derive_prompts": len(derive), "judge_prompts": len(judge)},
        "host": host_info(resolve_dtype(settings.engine.dtype, host)[0], settings.engine.cpu_preload),
        "columns": {},
    }
    bar = tqdm(total=total, unit="req", desc="bench")
    try:
        for name, k in plan:
            if name == report.SCHEDULE:
                choice = report.choose_k(result["columns"], ks, concurrencies, args.margin)
                schedule = report.schedule_from_choice(choice, max_batch)
                config_file = write_schedule_config(config, schedule, args.out / "config-with-schedule.yaml",
                                                    result["host"]["dtype"])
                result["derived"] = {"choice": {str(c): k for c, k in choice.items()}, "schedule": schedule,
                                     "margin": args.margin, "config_file": str(config_file)}
                top = max(k for _, _, k in schedule)
                overrides = _server_overrides(top, schedule) if top else _server_overrides(0, None)
                splits = {"judge": judge}
            elif name == report.SPEC_K0:
                overrides = _server_overrides(max(ks), never)
                splits = splits_fixed
            else:
                overrides = _server_overrides(k, None)
                splits = splits_fixed if name != report.REPEAT else {"judge": judge}
            bar.set_description(name)
            port = free_port()
            argv = serve_command(config, port, [*args.overrides, *overrides])
            server = ManagedServer(argv, port, args.out / "logs" / f"{name.replace(' ', '_').replace('=', '')}.log")
            with server:
                cells = await _column(server.url, model, splits, args, concurrencies, bar)
            result["columns"][name] = {"overrides": overrides, "server_ready_s": server.ready_after, "cells": cells}
            report.add_speedups(result["columns"])
            (args.out / "bench.json").write_text(json.dumps(result, indent=2))  # partial results survive a crash
    finally:
        bar.close()
    report.add_speedups(result["columns"])
    result["verdict"] = report.verdict(result["columns"], concurrencies, ks)
    noise = list(report.noise(result["columns"]).values())
    result["noise_median"] = statistics.median(noise) if noise else None
    choice = {int(c): k for c, k in result["derived"]["choice"].items()}
    cost = report.k0_cost(result["columns"], concurrencies)
    result["k0_cost"] = {str(c): v for c, v in cost.items()}
    result["recommendation"] = report.recommendation(choice, result["derived"]["schedule"], cost)
    result["finished"] = datetime.datetime.now().isoformat(timespec="seconds")
    (args.out / "bench.json").write_text(json.dumps(result, indent=2))
    (args.out / "bench.md").write_text(report.markdown(result))
    if not args.no_plots:
        result["plots"] = report.plots(result, args.out)
    print(report.markdown(result))
    print(f"\nWritten: {args.out}/bench.json, bench.md, config-with-schedule.yaml"
          + ("" if args.no_plots else ", throughput.png, acceptance_by_position.png"))
    return 0
