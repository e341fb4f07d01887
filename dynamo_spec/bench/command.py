"""`dynamo-spec bench`'s command line: its flags, and which run they start."""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

from dynamo_spec.bench.options import BenchOptions, HostCheckOptions
from dynamo_spec.bench.verdict import Targets


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
    targets = p.add_argument_group("verdict targets", "speed-ups over k=0 the verdict holds the derived schedule "
                                                      "(and the config's own) to")
    targets.add_argument("--target-speedup", type=float, default=Targets.speedup, metavar="X",
                         help="what a schedule should reach with one client, where speculation has the most idle "
                              "compute to use; 0: none (default: %(default)s)")
    targets.add_argument("--target-floor", type=float, default=Targets.floor, metavar="X",
                         help="the least a schedule should keep from --target-floor-from clients up, where a batch "
                              "leaves little idle compute and k=0 should serve instead; 0: none (default: %(default)s)")
    targets.add_argument("--target-floor-from", type=int, default=Targets.floor_from, metavar="C",
                         help="the concurrency from which --target-floor applies; between 1 and it, no target "
                              "(default: %(default)s)")
    host = p.add_argument_group("host check", "how steady the host's own speed is, before any server runs")
    host.add_argument("--host-check", action="store_true",
                      help="instead of the bench: each core repeats a fixed piece of work and counts it per second; "
                           "prints how far windows as long as a bench cell differ, writes host-check.json to --out")
    host.add_argument("--workload", choices=("gemm", "mem"), default=None,
                      help=f"gemm: a bf16 matmul in cache; mem: a memory-bound sum (default: {HostCheckOptions.workload})")
    host.add_argument("--seconds", type=float, default=None,
                      help=f"how long the check runs (default: {HostCheckOptions.seconds:.0f})")
    p.set_defaults(func=cmd_bench, accepts_overrides=True)


def cmd_bench(args: argparse.Namespace) -> int:
    if args.host_check:
        from dynamo_spec.bench import host_check

        return host_check.run(HostCheckOptions.from_args(args))
    if args.workload is not None or args.seconds is not None:
        raise SystemExit("error: --workload and --seconds belong to --host-check")
    options = BenchOptions.from_args(args)
    options.out.mkdir(parents=True, exist_ok=True)
    if options.url:
        from dynamo_spec.bench.url import run_url

        return run_url(options)
    from dynamo_spec.bench.phases import run_config

    return asyncio.run(run_config(options))
