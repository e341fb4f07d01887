"""What the README's request gets at the shipped defaults: acceptance through the server
when a request sets no sampling of its own.

    python -m benchmarks.default_sampling --config configs/smollm2-135m-instruct-eagle3-cpu.yaml \
        [--passes 2] [--max-tokens 250] [--concurrency 1]

Two servers from the same config, one after the other: ``model`` (vLLM applies the
model's generation_config.json, i.e. the sampling defaults `prepare-default` writes) and
``neutral`` (``generation_config: vllm``: vLLM's neutral defaults, temperature 1 and
top_p 1, what such requests got before). Each is sent the README's request shape
(streaming chat, ``max_tokens`` 250, no temperature) for every prompt of the everyday
evaluation set, ``passes`` times, one at a time (one user: the schedule's k at batch 1).
Acceptance comes from vLLM's counters on /metrics, as in the bench.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
from pathlib import Path

from dynamo_spec.bench.load import run_cell
from dynamo_spec.bench.report import spec_delta
from dynamo_spec.bench.run import read_spec_counters
from dynamo_spec.bench.server import ManagedServer, free_port, serve_command
from dynamo_spec.config.loader import load_settings
from dynamo_spec.training.rows import EVERYDAY_EVAL, read_jsonl

VARIANTS = {"model": [], "neutral": ["--engine.extra.generation_config", "vllm"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, required=True)
    parser.add_argument("--prompts", type=Path, default=EVERYDAY_EVAL)
    parser.add_argument("--passes", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=250)
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--out", type=Path, default=Path("runs/default-sampling"))
    args = parser.parse_args()
    model = load_settings(args.config).settings.served_model_name
    items = read_jsonl(args.prompts)
    rows = {}
    for label, overrides in VARIANTS.items():
        port = free_port()
        with ManagedServer(serve_command(args.config, port, overrides), port, args.out / f"{label}.log",
                           env=dict(os.environ)) as server:
            before = read_spec_counters(server.url)
            cell = asyncio.run(run_cell(server.url, model, items, concurrency=args.concurrency,
                                        requests=args.passes * len(items), max_tokens=args.max_tokens,
                                        temperature=None))
            acc = spec_delta(before, read_spec_counters(server.url))
        ok = cell.completed
        rows[label] = {"requests": len(cell.requests), "failed": len(cell.requests) - len(ok),
                       "output_tokens": cell.output_tokens, "tokens_per_s": cell.output_tokens / cell.wall,
                       "mean_completion_tokens": cell.output_tokens / max(1, len(ok)), **acc}
        print(label, json.dumps(rows[label]), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "result.json").write_text(json.dumps(rows, indent=2) + "\n")
    print("\n| defaults | requests | mean acceptance length | acceptance rate | per position | tokens/s "
          "| mean tokens per answer |\n|---|---|---|---|---|---|---|")
    for label, r in rows.items():
        pos = " / ".join(f"{p:.2f}" for p in r["per_position_acceptance"])
        print(f"| {label} | {r['requests'] - r['failed']} | {r['mean_acceptance_length']:.2f} | "
              f"{r['acceptance_rate']:.2f} | {pos} | {r['tokens_per_s']:.1f} | {r['mean_completion_tokens']:.0f} |")


if __name__ == "__main__":
    main()
