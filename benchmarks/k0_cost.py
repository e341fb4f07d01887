"""What a k=0 step costs inside a speculative engine, measured through the server.

    python -m benchmarks.k0_cost --config configs/smollm2-135m-instruct-eagle3-cpu.yaml \
        [--concurrency 8,32] [--rounds 3]

Three servers from the same config, started in turn (order reversed every other round):
``plain`` (speculation off), ``k0`` (speculation on, schedule ``[[1, max_num_seqs, 0]]``:
never a draft token) and ``k0-vllm`` (the same with dynamo-spec's zero-draft-step
changes turned off, ``engine.extra.additional_config.dynamo_spec.zero_draft_steps: false``: what
vLLM 0.32 does by itself).
The load is the bench's (streaming chat, official openai client, greedy, judge prompts).
Prints every round and the median ratio of each speculative server to ``plain``.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from benchmarks.runtime_options import alternate
from dynamo_spec.config import schedule as schedules
from dynamo_spec.config.loader import load_settings
from dynamo_spec.config.preflight import effective_max_num_seqs
from dynamo_spec.engine.host import on_cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, required=True)
    parser.add_argument("--concurrency", default="8,32")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, default=Path("runs/k0-cost"))
    args = parser.parse_args()
    settings = load_settings(args.config).settings
    max_batch = effective_max_num_seqs(settings, on_cpu())
    never = f"[[1,{max_batch},0]]"
    servers = {
        "plain": ({}, ["--speculative.enabled", "false"]),
        "k0": ({}, ["--" + schedules.FIELD, never]),
        "k0-vllm": ({}, ["--" + schedules.FIELD, never,
                         "--engine.extra.additional_config.dynamo_spec.zero_draft_steps", "false"]),
    }
    cs = [int(c) for c in args.concurrency.split(",")]
    results = alternate(args.config, servers, cs, args.rounds, args.max_tokens, args.out)
    print("\n| server | " + " | ".join(f"c={c} tok/s (ratio to plain, median of rounds)" for c in cs) + " |")
    print("|---|" + "---|" * len(cs))
    for name, runs in results.items():
        cells = []
        for c in cs:
            ratios = [run[c] / base[c] for run, base in zip(runs, results["plain"])]
            cells.append(f"{statistics.median(run[c] for run in runs):.1f} ({statistics.median(ratios):.3f}x)")
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
