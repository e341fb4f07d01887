"""Runtime options of the CPU serving path, measured through the server.

    python -m benchmarks.runtime_options --config configs/smollm2-135m-instruct-eagle3-cpu.yaml \
        [--variants none,tcmalloc,iomp,both] [--k 0,3] [--concurrency 1,4] [--rounds 2]
        [--cells default:0,default:2,default:config,nst-max:config] [--interleave]
        [--schedule NAME=JSON ...]   # adds variant sched-NAME: that batch-size schedule (cell sched-NAME:config)
        [--draft NAME=PATH ...]      # adds variant draft-NAME: that draft checkpoint (cell draft-NAME:config)
        [--set NAME=OVERRIDES ...]   # adds variant NAME: these config overrides ('--speculative.guard.enabled false')

Each variant is an environment (LD_PRELOAD of tcmalloc and/or Intel OpenMP, thread
binding) and/or config overrides; every (variant, k) gets its own server, and the
rounds alternate the order. k=config runs the config's own speculative settings (its
batch-size schedule); `--cells` names the (variant, k) pairs instead of every pair of
--variants and --k. The load is the bench's (streaming chat, openai client,
greedy, judge prompts). Prints the median output tokens/s per cell and the median of
its per-round ratios to the first cell. With --interleave every server is up at once
and they take turns cell by cell, which cancels a host's drift over minutes.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import glob
import json
import os
import shlex
import statistics
import sys
from pathlib import Path

from dynamo_spec.bench.load import run_cell
from dynamo_spec.bench.managed_server import ManagedServer, free_port, serve_command
from dynamo_spec.bench.prompts import load_sets, split
from dynamo_spec.config import schedule as schedules
from dynamo_spec.config.loader import load_settings
from dynamo_spec.engine.host import detect_host, resolve_dtype


def find_lib(patterns: list[str]) -> str | None:
    for pattern in patterns:
        hits = sorted(glob.glob(pattern))
        if hits:
            return hits[0]
    return None


def variants(config: Path) -> dict[str, tuple[dict[str, str], list[str]]]:
    prefix = sys.prefix
    tcmalloc = find_lib(["/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4", "/usr/lib/*/libtcmalloc_minimal.so*",
                         f"{prefix}/lib/python3*/site-packages/*/libtcmalloc*.so*"])
    iomp = find_lib([f"{prefix}/lib/libiomp5.so"])
    own = ["--engine.cpu_preload", "false"]  # the preloads below are the variant's, not the server's default
    out: dict[str, tuple[dict[str, str], list[str]]] = {"none": ({}, own)}
    if tcmalloc:
        out["tcmalloc"] = ({"LD_PRELOAD": tcmalloc}, own)
    if iomp:
        out["iomp"] = ({"LD_PRELOAD": iomp}, own)
    if tcmalloc and iomp:
        out["both"] = ({"LD_PRELOAD": f"{tcmalloc}:{iomp}"}, own)
    out["default"] = ({}, [])  # what `serve` does by itself (engine.cpu_preload: true)
    # An AVX2 host approximated on an AVX-512/AMX one: oneDNN and PyTorch capped at AVX2.
    cap = {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}
    out["avx2-bf16"] = (cap, ["--engine.dtype", "bfloat16"])
    out["avx2-fp32"] = (cap, ["--engine.dtype", "float32"])
    out["bind-auto"] = ({"VLLM_CPU_OMP_THREADS_BIND": "auto"}, [])
    out["stream4"] = ({}, ["--engine.extra.stream_interval", "4"])  # fewer, larger stream chunks
    out["inproc"] = ({"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}, [])  # EngineCore inside the API process
    # vLLM's plain CPU platform (oneDNN GEMMs) where the default is its Zen platform (AMD CPUs; zen_platform.py).
    out["onednn"] = ({"DYNAMO_SPEC_ZENTORCH": "0"}, [])
    out["fp32"] = ({}, ["--engine.dtype", "float32"])
    out["compiled"] = ({}, ["--engine.enforce_eager", "false"])
    out["eager"] = ({}, ["--engine.enforce_eager", "true"])
    # The schedule that applies on this host with num_speculative_tokens lowered to its largest k
    # (a config with a schedule per dtype keeps the largest k of all entries).
    settings = load_settings(config).settings
    schedule, _ = schedules.for_engine(settings, resolve_dtype(settings.engine.dtype, detect_host())[0])
    if schedule and (top := schedules.top_k(schedule)):
        out["nst-max"] = ({}, ["--speculative.num_speculative_tokens", str(top),
                               "--" + schedules.FIELD,
                               json.dumps(schedules.as_lists(schedule))])
    # Greedy drafts by the full-vocabulary scatter + argmax (vLLM's default) instead of the
    # draft-vocabulary argmax the CPU config sets.
    out["no-local-argmax"] = ({}, ["--speculative.extra.use_local_argmax_reduction", "false"])
    # vLLM's default for EAGLE: drop the last block of every prefix-cache hit (the CPU config keeps it).
    out["block-drop"] = ({}, ["--speculative.extra.disable_eagle_block_drop", "false"])
    return out


async def warm_up(url: str, model: str, items: list[dict]) -> None:
    await run_cell(url, model, items, concurrency=2, requests=4, max_tokens=16, temperature=0)


async def measure(url: str, model: str, items: list[dict], concurrency: list[int], max_tokens: int,
                  warm: bool = True) -> dict[int, float]:
    if warm:
        await warm_up(url, model, items)
    out = {}
    for c in concurrency:
        cell = await run_cell(url, model, items, concurrency=c, requests=max(8, 4 * c), max_tokens=max_tokens,
                              temperature=0)
        out[c] = cell.output_tokens / cell.wall
    return out


def alternate(config: Path, plan: dict[str, tuple[dict[str, str], list[str]]], concurrency: list[int],
              rounds: int, max_tokens: int, out: Path) -> dict[str, list[dict[int, float]]]:
    """One server per plan entry (extra environment, config overrides), started in turn,
    the order reversed every other round; returns each entry's tokens/s per concurrency
    per round."""
    model = load_settings(config).settings.served_model_name
    items = split(load_sets())[1]
    results: dict[str, list[dict[int, float]]] = {label: [] for label in plan}
    for r in range(rounds):
        for label in (list(plan) if r % 2 == 0 else list(plan)[::-1]):
            env, overrides = plan[label]
            port = free_port()
            with ManagedServer(serve_command(config, port, overrides), port, out / f"{label}-{r}.log",
                               env={**os.environ, **env}) as server:
                got = asyncio.run(measure(server.url, model, items, concurrency, max_tokens))
            results[label].append(got)
            print(f"round {r} {label}: " + ", ".join(f"c={c} {t:.1f} tok/s" for c, t in got.items()), flush=True)
    return results


def interleave(config: Path, plan: dict[str, tuple[dict[str, str], list[str]]], concurrency: list[int],
               rounds: int, max_tokens: int, out: Path) -> dict[str, list[dict[int, float]]]:
    """Every plan entry's server up at once; each round runs each concurrency on each server
    in turn, in the same order every round. The servers take turns every few
    seconds, so a host whose speed drifts over minutes (a shared VM) moves them alike;
    `alternate` restarts them minutes apart. Needs the memory of all servers at once."""
    model = load_settings(config).settings.served_model_name
    items = split(load_sets())[1]
    results: dict[str, list[dict[int, float]]] = {label: [] for label in plan}
    with contextlib.ExitStack() as stack:
        servers = {}
        for label, (env, overrides) in plan.items():  # one start at a time: a compile takes both cores
            port = free_port()
            servers[label] = stack.enter_context(ManagedServer(serve_command(config, port, overrides), port,
                                                               out / f"{label}.log", env={**os.environ, **env}))
            asyncio.run(warm_up(servers[label].url, model, items))
        for r in range(rounds):
            # one order every round, so each cell follows another server's (a server's first cell
            # after another server's runs slower on a shared VM)
            got: dict[str, dict[int, float]] = {label: {} for label in plan}
            for c in concurrency:
                for label in plan:
                    got[label].update(asyncio.run(measure(servers[label].url, model, items, [c], max_tokens,
                                                          warm=False)))
            for label in plan:
                results[label].append(got[label])
                print(f"round {r} {label}: " + ", ".join(f"c={c} {t:.1f} tok/s" for c, t in got[label].items()),
                      flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, required=True)
    parser.add_argument("--variants", default="none,tcmalloc,iomp,both")
    parser.add_argument("--k", default="0,3", help="k per server; 0: speculation off; config: the config's own")
    parser.add_argument("--cells", default=None, help="variant:k pairs to run instead of every variant with every k")
    parser.add_argument("--concurrency", default="1,4")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, default=Path("runs/runtime-options"))
    parser.add_argument("--schedule", action="append", default=[], metavar="NAME=JSON",
                        help="a variant sched-NAME serving this batch-size schedule, e.g. "
                             "zen4='[[1,11,1],[12,128,0]]' (its cells: sched-NAME:config)")
    parser.add_argument("--draft", action="append", default=[], metavar="NAME=PATH",
                        help="a variant draft-NAME serving this draft checkpoint instead of the config's "
                             "(its cells: draft-NAME:config, draft-NAME:3, ...)")
    parser.add_argument("--set", action="append", default=[], metavar="NAME=OVERRIDES",
                        help="a variant NAME serving with these command-line overrides, e.g. "
                             "'noguard=--speculative.guard.enabled false' (combine with a draft: "
                             "'bad=--speculative.model DIR')")
    parser.add_argument("--interleave", action="store_true",
                        help="all servers up at once, taking turns every cell (a noisy host; needs their memory)")
    args = parser.parse_args()
    known = variants(args.config)
    for item in args.schedule:
        name, _, text = item.partition("=")
        entries = json.loads(text)
        known[f"sched-{name}"] = ({}, ["--speculative.num_speculative_tokens", str(max(k for _, _, k in entries)),
                                       "--" + schedules.FIELD, json.dumps(entries)])
    for item in args.draft:
        name, _, path = item.partition("=")
        if not Path(path).is_dir():
            raise SystemExit(f"--draft {item}: no draft directory at '{path}'")
        known[f"draft-{name}"] = ({}, ["--speculative.model", path])
    for item in args.set:
        name, _, text = item.partition("=")
        known[name] = ({}, shlex.split(text))
    if args.cells:
        cells = [(cell.partition(":")[0], cell.partition(":")[2]) for cell in args.cells.split(",") if cell]
    else:
        cells = [(name, k) for name in args.variants.split(",") if name for k in args.k.split(",")]
    missing = sorted({name for name, _ in cells if name not in known})
    if missing:
        raise SystemExit(f"unknown or unavailable variants: {missing} (available: {sorted(known)})")
    bad = [f"{name}:{k}" for name, k in cells if k != "config" and not k.isdigit()]
    if bad:
        raise SystemExit(f"each cell is variant:k with k a number or 'config': {bad}")
    cs = [int(c) for c in args.concurrency.split(",")]
    plan = {}
    for name, k in cells:
        env, overrides = known[name]
        spec = ([] if k == "config" else ["--speculative.enabled", "false"] if int(k) == 0 else
                ["--speculative.num_speculative_tokens", k,
                 "--" + schedules.FIELD, "null"])  # a fixed k
        plan[f"{name}-k{k}"] = (env, [*overrides, *spec])
    results = (interleave if args.interleave else alternate)(args.config, plan, cs, args.rounds, args.max_tokens,
                                                             args.out)
    first = next(iter(results))
    print("\n| server | " + " | ".join(f"c={c} tok/s (x {first})" for c in cs) + " |")
    print("|---|" + "---|" * len(cs))
    for label, runs in results.items():
        cells = [f"{statistics.median(run[c] for run in runs):.1f} "
                 f"({statistics.median(run[c] / base[c] for run, base in zip(runs, results[first])):.2f}x)"
                 for c in cs]
        print(f"| {label} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
