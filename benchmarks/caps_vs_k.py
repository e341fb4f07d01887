"""Whether a per-request cap on a server of a larger k serves like a server of the capped k.

    python -m benchmarks.caps_vs_k --config configs/smollm2-135m-instruct-eagle3-cpu.yaml \
        [--top 3] [--concurrency 1,4] [--rounds 3] [--max-tokens 48]

`dynamo-spec bench --together 0` (one server at a time, the GPU default) serves its smaller k
columns, and the speculative engine at k=0, from one server of the largest k through each
request's cap (``vllm_xargs.max_draft_tokens``). This checks that stand-in: three servers up at
once (started one at a time), each a batch-size schedule of one k everywhere: k=1, k=0 (speculation
on) and k=`--top`; each round runs each concurrency on k=1, on the top server capped at 1, on k=0,
on the top server capped at 0, in that order (every cell after another's). Prints every round,
then per concurrency the median output tokens/s and the median per-round ratio capped/dedicated,
with the draft tokens per draft each served (from the servers' counters). Greedy, the bench's judge
prompts, streaming through the official openai client.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import tempfile
from pathlib import Path

from benchmarks.capture_cost import cpu_name
from dynamo_spec.bench.load import run_cell
from dynamo_spec.bench.managed_server import ManagedServer, free_port, serve_command
from dynamo_spec.bench.measure import read_spec_counters
from dynamo_spec.bench.prompts import load_sets, split
from dynamo_spec.bench.summary import counter_delta
from dynamo_spec.config.loader import load_settings
from dynamo_spec.config.preflight import effective_max_num_seqs
from dynamo_spec.engine.host import detect_host


def overrides(k: int, top: int, max_batch: int) -> list[str]:
    """A schedule of k at every batch size (k=0: speculation on, never a draft, as the bench's column)."""
    return ["--speculative.enabled", "true", "--speculative.num_speculative_tokens", str(k or top),
            "--speculative.num_speculative_tokens_per_batch_size", json.dumps([[1, max_batch, k]])]


async def cell(url: str, model: str, items: list, c: int, requests: int, max_tokens: int,
               cap: int | None) -> tuple[float, float | None]:
    """Output tokens/s of one cell, and its draft tokens per draft (None: no drafts)."""
    before = read_spec_counters(url)
    got = await run_cell(url, model, items, concurrency=c, requests=requests, max_tokens=max_tokens,
                         temperature=0.0, max_draft_tokens=cap)
    assert all(r.ok for r in got.requests), [r.error for r in got.requests if not r.ok][:2]
    delta = counter_delta(before, read_spec_counters(url))
    per_draft = delta["draft_tokens"] / delta["drafts"] if delta.get("drafts") else None
    return got.output_tokens / got.wall, per_draft


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, required=True)
    parser.add_argument("--top", type=int, default=3, help="the shared server's k")
    parser.add_argument("--concurrency", default="1,4")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--per-client", type=int, default=4, help="requests per client in a cell")
    args = parser.parse_args()
    settings = load_settings(args.config).settings
    model, max_batch = settings.served_model_name, effective_max_num_seqs(settings, detect_host().on_cpu)
    items = split(load_sets())[1]
    cs = [int(c) for c in args.concurrency.split(",")]
    out = Path(tempfile.mkdtemp(prefix="dynamo-spec-caps-vs-k-"))
    servers_of = {"k=1": 1, "k=0": 0, f"k={args.top}": args.top}
    turns = [("k=1", "k=1", None), (f"k={args.top} capped at 1", f"k={args.top}", 1),
             ("k=0 (speculative engine)", "k=0", None), (f"k={args.top} capped at 0", f"k={args.top}", 0)]
    rows: dict[str, list[dict[int, tuple[float, float | None]]]] = {name: [] for name, _, _ in turns}
    with contextlib.ExitStack() as stack:
        servers = {}
        for name, k in servers_of.items():  # one start at a time: a compile takes both cores
            port = free_port()
            servers[name] = stack.enter_context(ManagedServer(
                serve_command(args.config, port, overrides(k, args.top, max_batch)), port, out / f"{name}.log"))
            asyncio.run(run_cell(servers[name].url, model, items, concurrency=2, requests=4, max_tokens=16,
                                 temperature=0.0))
        for r in range(args.rounds):
            got: dict[str, dict[int, tuple[float, float | None]]] = {name: {} for name, _, _ in turns}
            for c in cs:
                for name, server, cap in turns:
                    got[name][c] = asyncio.run(cell(servers[server].url, model, items, c, c * args.per_client,
                                                    args.max_tokens, cap))
            for name in got:
                rows[name].append(got[name])
                print(f"round {r} {name}: " + ", ".join(f"c={c} {t:.1f} tok/s ({d or 0:.2f} per draft)"
                                                        for c, (t, d) in got[name].items()), flush=True)
    print(f"\nHost: {cpu_name()}; config {args.config}; {args.rounds} paired rounds, {args.max_tokens} new tokens")
    print("\n| clients | dedicated | tok/s | capped | tok/s | capped/dedicated (median; min-max) | per draft |")
    print("|---|---|---|---|---|---|---|")
    for c in cs:
        for (own, _, _), (capped, _, _) in ((turns[0], turns[1]), (turns[2], turns[3])):
            a = [row[c][0] for row in rows[own]]
            b = [row[c][0] for row in rows[capped]]
            ratios = [y / x for x, y in zip(a, b)]
            per = [row[c][1] for row in rows[own]][-1], [row[c][1] for row in rows[capped]][-1]
            print(f"| {c} | {own} | {statistics.median(a):.1f} | {capped} | {statistics.median(b):.1f} | "
                  f"{statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f}) | "
                  f"{per[0] or 0:.2f} / {per[1] or 0:.2f} |")


if __name__ == "__main__":
    main()
