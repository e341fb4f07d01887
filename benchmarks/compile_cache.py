"""A compiled model loaded from vLLM's compile cache against one compiled at start,
through the server (dynamo_spec/vllm_patches/compile_cache.py).

    python -m benchmarks.compile_cache --config configs/smollm2-135m-instruct-eagle3-cpu.yaml \
        [--concurrency 1,8] [--rounds 2] [--speculative]

Two servers from the same config (speculation off unless ``--speculative``), started in
turn, the order reversed every other round: ``fresh`` (an empty compile cache of its own:
compiles at start and saves, as every CPU start did before the plugin's fix) and
``loaded`` (one cache, filled by a start before the rounds: loads). Not
``VLLM_DISABLE_COMPILE_CACHE=1`` for ``fresh``: that skips vLLM's AOT path altogether and
served 14-16 % fewer tokens/s. The load is the bench's (streaming chat, official openai
client, greedy, judge prompts). Prints every round, the time to ready, and the median
ratio loaded/fresh per concurrency.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.runtime_options import measure
from dynamo_spec.bench.prompts import load_sets, split
from dynamo_spec.bench.server import ManagedServer, free_port, serve_command
from dynamo_spec.config.loader import load_settings


def start(config: Path, overrides: list[str], cache: str, log: Path) -> ManagedServer:
    port = free_port()
    env = {**os.environ, "VLLM_CACHE_ROOT": cache}
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)  # vLLM puts inductor's cache inside its own
    return ManagedServer(serve_command(config, port, overrides), port, log, env=env)


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
    model = load_settings(args.config).settings.served_model_name
    items = split(load_sets())[1]
    cs = [int(c) for c in args.concurrency.split(",")]
    with tempfile.TemporaryDirectory(prefix="compile-cache-") as tmp:
        shared = os.path.join(tmp, "shared")
        with start(args.config, overrides, shared, args.out / "fill-cache.log"):
            pass  # compiles and saves into the shared cache
        results: dict[str, list[dict[int, float]]] = {"fresh": [], "loaded": []}
        for r in range(args.rounds):
            for label in (["fresh", "loaded"] if r % 2 == 0 else ["loaded", "fresh"]):
                cache = shared if label == "loaded" else os.path.join(tmp, f"fresh-{r}")
                t0 = time.monotonic()
                with start(args.config, overrides, cache, args.out / f"{label}-{r}.log") as server:
                    ready = time.monotonic() - t0
                    got = asyncio.run(measure(server.url, model, items, cs, args.max_tokens))
                results[label].append(got)
                print(f"round {r} {label}: ready in {ready:.1f} s; "
                      + ", ".join(f"c={c} {t:.1f} tok/s" for c, t in got.items()), flush=True)
    for c in cs:
        ratios = [loaded[c] / fresh[c] for loaded, fresh in zip(results["loaded"], results["fresh"])]
        print(f"c={c}: fresh {statistics.median(r[c] for r in results['fresh']):.1f} tok/s, "
              f"loaded {statistics.median(r[c] for r in results['loaded']):.1f} tok/s, "
              f"loaded/fresh {statistics.median(ratios):.3f} (rounds: {', '.join(f'{x:.3f}' for x in ratios)})")


if __name__ == "__main__":
    main()
