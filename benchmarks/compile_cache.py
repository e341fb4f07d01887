"""A compiled model loaded from vLLM's compile cache against one compiled at start,
through the server (dynamo_spec/compile_cache.py).

    python -m benchmarks.compile_cache --config configs/smollm2-135m-instruct-eagle3-cpu.yaml \
        [--concurrency 1,8] [--rounds 2] [--speculative]

Two servers from the same config (speculation off unless ``--speculative``), started in
turn, the order reversed every other round: ``fresh`` (``VLLM_DISABLE_COMPILE_CACHE=1``:
compiles at start, as every CPU start did before the plugin's fix) and ``loaded`` (loads
what an earlier start saved; one start before the rounds fills the cache). The load is the
bench's (streaming chat, official openai client, greedy, judge prompts). Prints every
round and the median ratio loaded/fresh per concurrency.
"""

from __future__ import annotations

import argparse
import os
import statistics
from pathlib import Path

from benchmarks.runtime_options import alternate
from dynamo_spec.bench.server import ManagedServer, free_port, serve_command


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, required=True)
    parser.add_argument("--concurrency", default="1,8")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--speculative", action="store_true", help="keep the config's speculation on")
    parser.add_argument("--out", type=Path, default=Path("runs/compile-cache"))
    args = parser.parse_args()
    overrides = [] if args.speculative else ["--speculative.enabled", "false"]
    port = free_port()
    with ManagedServer(serve_command(args.config, port, overrides), port, args.out / "fill-cache.log",
                       env=dict(os.environ)):
        pass  # a start that saves the compiled model if the cache has none yet
    plan = {"fresh": ({"VLLM_DISABLE_COMPILE_CACHE": "1"}, overrides), "loaded": ({}, overrides)}
    cs = [int(c) for c in args.concurrency.split(",")]
    results = alternate(args.config, plan, cs, args.rounds, args.max_tokens, args.out)
    for c in cs:
        ratios = [loaded[c] / fresh[c] for loaded, fresh in zip(results["loaded"], results["fresh"])]
        print(f"c={c}: fresh {statistics.median(r[c] for r in results['fresh']):.1f} tok/s, "
              f"loaded {statistics.median(r[c] for r in results['loaded']):.1f} tok/s, "
              f"loaded/fresh {statistics.median(ratios):.3f} (rounds: {', '.join(f'{x:.3f}' for x in ratios)})")


if __name__ == "__main__":
    main()
