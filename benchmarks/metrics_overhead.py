"""What do dynamo-spec's metrics cost? Requests/s with and without them, and /metrics scrape time under load.

    python -m benchmarks.metrics_overhead [--seconds 30] [--concurrency 8] [--rounds 3]

Serves the tiny fixed target + partial draft (k=3; the worst case for relative
overhead: the engine is as fast as it gets), alternating metrics.enabled true/false,
and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
from pathlib import Path

import requests

from dynamo_spec.engine.process_env import vllm_dirs
from support.server_process import ServerProcess, tiny_config
from support.tiny_models import build_fixture_set


def load(url: str, seconds: float, concurrency: int) -> float:
    """Completion requests/s with `concurrency` clients for `seconds`."""
    done = [0] * concurrency
    stop = time.monotonic() + seconds
    body = {"model": "tiny", "prompt": "Write a poem about the sea.", "max_tokens": 16, "temperature": 0,
            "ignore_eos": True}

    def client(i: int) -> None:
        with requests.Session() as session:
            while time.monotonic() < stop:
                session.post(url + "/v1/completions", json=body, timeout=60).raise_for_status()
                done[i] += 1

    threads = [threading.Thread(target=client, args=(i,)) for i in range(concurrency)]
    start = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(done) / (time.monotonic() - start)


def scrape_times(url: str, n: int) -> list[float]:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        requests.get(url + "/metrics", timeout=10).raise_for_status()
        times.append(time.perf_counter() - t0)
        time.sleep(0.2)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, default=30)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    import os

    work = Path(tempfile.mkdtemp(prefix="dynamo-spec-bench-"))
    os.environ.update(vllm_dirs(work / "env", offline=True))
    models = build_fixture_set(work / "models")
    results: dict[bool, list[float]] = {True: [], False: []}
    scrapes: list[float] = []
    for round_ in range(args.rounds):
        for enabled in ((True, False) if round_ % 2 == 0 else (False, True)):  # alternate the order
            config = tiny_config(models["fixed_target"], models["partial_draft"], metrics={"enabled": enabled})
            with ServerProcess(config, work) as server:
                load(server.url, 3, args.concurrency)  # warm-up
                if enabled:
                    scraper = threading.Thread(target=lambda: scrapes.extend(scrape_times(server.url, 20)))
                    scraper.start()
                results[enabled].append(load(server.url, args.seconds, args.concurrency))
                if enabled:
                    scraper.join()
                    size = len(requests.get(server.url + "/metrics", timeout=10).content)
    on, off = statistics.median(results[True]), statistics.median(results[False])
    print(f"| metrics | requests/s (median of {args.rounds} x {args.seconds:g} s, concurrency {args.concurrency}) |")
    print("|---|---|")
    print(f"| on | {on:.1f} ({', '.join(f'{r:.1f}' for r in results[True])}) |")
    print(f"| off | {off:.1f} ({', '.join(f'{r:.1f}' for r in results[False])}) |")
    print(f"\ncost: {100 * (off - on) / off:+.1f} % requests/s")
    scrapes.sort()
    print(f"/metrics under load: {len(scrapes)} scrapes, median {1000 * statistics.median(scrapes):.1f} ms, "
          f"max {1000 * scrapes[-1]:.1f} ms, {size / 1024:.0f} KiB")


if __name__ == "__main__":
    main()
