"""The CPU default at its shipped sampling defaults, through the server: mean acceptance length on the
everyday set, and one client's speed-up against a server without speculation (streaming, paired).

Start two servers from the same config (one with ``--speculative.enabled false``), then:

    python benchmarks/defaults_check.py --spec http://127.0.0.1:8123 --plain http://127.0.0.1:8124 --rounds 3

Requests set no sampling field (the README's curl): each gets the model's generation_config and the
server's ``sampling.dry``. A seed per prompt keeps a prompt's two runs comparable.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import requests

from dynamo_spec.training.rows import EVERYDAY_EVAL, read_jsonl


def model(url: str) -> str:
    return requests.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]


def acceptance(url: str, rows: list[dict], max_tokens: int, concurrency: int, extra: dict | None = None) -> dict:
    name = model(url)

    def one(row: dict) -> dict:
        r = requests.post(f"{url}/v1/chat/completions", timeout=600, json={
            "model": name, "messages": row["messages"], "max_tokens": max_tokens, "seed": 0, **(extra or {})})
        r.raise_for_status()
        return r.json()["metrics"]["speculative_decoding"]

    with ThreadPoolExecutor(concurrency) as pool:
        stats = list(pool.map(one, rows))
    drafts = sum(s["num_spec_steps"] for s in stats)
    accepted = sum(s["num_accepted_draft_tokens"] for s in stats)
    return {"requests": len(stats), "num_drafts": drafts, "accepted": accepted,
            "mean_acceptance_length": round(1 + accepted / drafts, 3) if drafts else None}


def stream_rate(url: str, name: str, messages: list, max_tokens: int, seed: int,
                extra: dict | None = None) -> tuple[int, float]:
    t0 = time.perf_counter()
    tokens = 0
    with requests.post(f"{url}/v1/chat/completions", timeout=600, stream=True, json={
            "model": name, "messages": messages, "max_tokens": max_tokens, "seed": seed, "stream": True,
            "stream_options": {"include_usage": True}, **(extra or {})}) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith(b"data: {"):
                usage = json.loads(line[6:]).get("usage")
                if usage:
                    tokens = usage["completion_tokens"]
    return tokens, time.perf_counter() - t0


def speedup(spec: str, plain: str, rows: list[dict], max_tokens: int, rounds: int, extra: dict | None = None) -> dict:
    names = {spec: model(spec), plain: model(plain)}
    ratios = []
    for rnd in range(rounds):
        totals = {spec: [0, 0.0], plain: [0, 0.0]}
        for i, row in enumerate(rows):
            order = (spec, plain) if (i + rnd) % 2 == 0 else (plain, spec)
            for url in order:
                n, s = stream_rate(url, names[url], row["messages"], max_tokens, seed=i, extra=extra)
                totals[url][0] += n
                totals[url][1] += s
        rate = {u: t[0] / t[1] for u, t in totals.items()}
        ratios.append(rate[spec] / rate[plain])
        print(json.dumps({"round": rnd, "spec_tokens_per_s": round(rate[spec], 2),
                          "plain_tokens_per_s": round(rate[plain], 2), "speedup": round(ratios[-1], 3)}), flush=True)
    return {"rounds": [round(r, 3) for r in ratios], "median_speedup": round(statistics.median(ratios), 3),
            "spread": round(max(ratios) - min(ratios), 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--spec", required=True)
    ap.add_argument("--plain", required=True)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--speed-prompts", type=int, default=12, help="everyday prompts timed per round")
    ap.add_argument("--skip-acceptance", action="store_true")
    ap.add_argument("--skip-speed", action="store_true")
    ap.add_argument("--extra", default="{}", help="JSON merged into each request (e.g. the old defaults)")
    args = ap.parse_args()
    rows = read_jsonl(EVERYDAY_EVAL)
    out = {}
    if not args.skip_acceptance:
        out["everyday"] = acceptance(args.spec, rows, args.max_tokens, concurrency=4, extra=json.loads(args.extra))
        print(json.dumps(out["everyday"]), flush=True)
    if not args.skip_speed:
        out["one_client"] = speedup(args.spec, args.plain, rows[:args.speed_prompts], args.max_tokens, args.rounds,
                                    extra=json.loads(args.extra))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
