"""Does the README's first answer loop? The README's poem (and other open requests) sent to a running
server at its defaults, over several seeds: repeated word 4-grams per answer, and answers that run
to the token limit in a loop.

    python benchmarks/poem_loops.py --url http://localhost:8000 --seeds 8 [--extra '{"dry_multiplier": 0.8}']
"""

from __future__ import annotations

import argparse
import json
import re
from concurrent.futures import ThreadPoolExecutor

import requests

POEM = "Write a poem about why Sakura trees are beautiful."


def words(text: str) -> list[str]:
    return re.findall(r"\w+", text.lower())


def repeated_4grams(text: str) -> float:
    """Share of the answer's word 4-grams that already occurred earlier in it."""
    w = words(text)
    grams = [tuple(w[i:i + 4]) for i in range(len(w) - 3)]
    seen, repeats = set(), 0
    for g in grams:
        repeats += g in seen
        seen.add(g)
    return repeats / len(grams) if grams else 0.0


def loops(text: str, finish_reason: str) -> bool:
    """Ran to the token limit with its last lines repeating an earlier line."""
    if finish_reason != "length":
        return False
    lines = [ln.strip() for ln in text.strip().split("\n") if ln.strip()]
    tail = lines[-4:-1]  # the last line may be cut short
    return any(lines.count(ln) >= 3 for ln in tail) or repeated_4grams(" ".join(lines[-10:])) > 0.5


def ask(url: str, prompt: str, seed: int, max_tokens: int, extra: dict) -> dict:
    r = requests.post(f"{url}/v1/chat/completions", timeout=600, json={
        "model": requests.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"],
        "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "seed": seed, **extra})
    r.raise_for_status()
    choice = r.json()["choices"][0]
    return {"seed": seed, "text": choice["message"]["content"], "finish_reason": choice["finish_reason"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="http://localhost:8000")
    ap.add_argument("--prompt", default=POEM)
    ap.add_argument("--seeds", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=250)
    ap.add_argument("--extra", default="{}", help="JSON merged into each request body")
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--show", type=int, default=0, help="print this many answers")
    args = ap.parse_args()
    extra = json.loads(args.extra)
    with ThreadPoolExecutor(args.concurrency) as pool:
        answers = list(pool.map(lambda s: ask(args.url, args.prompt, s, args.max_tokens, extra), range(args.seeds)))
    for a in answers:
        a["repeated_4grams"] = round(repeated_4grams(a["text"]), 3)
        a["loops"] = loops(a["text"], a["finish_reason"])
    for a in answers[:args.show]:
        print(f"--- seed {a['seed']} ({a['finish_reason']}, {a['repeated_4grams']:.0%} repeated 4-grams)\n{a['text']}\n")
    summary = {"prompt": args.prompt, "extra": extra, "seeds": args.seeds,
               "repeated_4grams": [a["repeated_4grams"] for a in answers],
               "mean_repeated_4grams": round(sum(a["repeated_4grams"] for a in answers) / len(answers), 3),
               "looping": sum(a["loops"] for a in answers)}
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
