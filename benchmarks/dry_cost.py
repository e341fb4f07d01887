"""DRY's cost per engine step, the function the patch runs (``vllm_patches/dry.py``), on real answers.

Contexts are answers of the CPU default from ``data/`` (their own repeats), cut at ``--length`` tokens;
logits are a [rows, 49152] float32 tensor (SmolLM2's vocabulary). Per step: the target's rows (k + 1
per request: the verified positions and the bonus) and the draft's k positions.

    python benchmarks/dry_cost.py --requests 1,16 --k 3 --length 500
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from dynamo_spec.sampling import dry
from dynamo_spec.vllm_patches.dry import DryRow, apply_to_logits

VOCAB = 49152


def answers(n: int, length: int) -> list[list[int]]:
    """``n`` contexts of ``length`` tokens: the corpus's answers one after another (they are at most
    192 tokens each)."""
    rows, current = [], []
    for path in sorted(Path("data/rounds").glob("round-*.jsonl.gz")):
        with gzip.open(path, "rt") as f:
            for line in f:
                current += json.loads(line)["answer_ids"]
                if len(current) >= length:
                    rows.append(current[:length])
                    current = []
                if len(rows) == n:
                    return rows
    raise SystemExit(f"data/ holds fewer than {n} contexts of {length} tokens")


def step_seconds(requests: int, k: int, length: int, repeats: int) -> float:
    params = dry.DryParams(0.8)
    mask = np.zeros(VOCAB, dtype=bool)
    contexts = answers(requests, length)
    rows = [DryRow(i, params, mask, c) for i, c in enumerate(contexts)]
    logits = torch.zeros(requests * (k + 1), VOCAB)
    draft_logits = torch.zeros(requests, VOCAB)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        # the target: each request's k verified positions and its bonus, drafts before each
        targets = [(r.index * (k + 1) + j, r, r.context + [7] * j) for r in rows for j in range(k + 1)]
        apply_to_logits(logits, targets)
        for j in range(k):  # the draft: one call per position
            apply_to_logits(draft_logits, [(r.index, r, r.context + [7] * j) for r in rows])
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", default="1,16")
    ap.add_argument("--k", default="0,1,3")
    ap.add_argument("--length", type=int, default=500)
    ap.add_argument("--repeats", type=int, default=50)
    args = ap.parse_args()
    torch.set_num_threads(1)
    for n in map(int, args.requests.split(",")):
        for k in map(int, args.k.split(",")):
            print(json.dumps({"requests": n, "k": k, "context_tokens": args.length,
                              "ms_per_step": round(step_seconds(n, k, args.length, args.repeats) * 1e3, 3)}))


if __name__ == "__main__":
    main()
