"""The suffix mix's trees: memory per 10,000 cached answers, and their own time per engine step.

    python -m benchmarks.suffix_tree_cost [--answers 10000] [--steps 200]

Answers: the target's own greedy and sampled answers kept in ``data/`` (the draft-training corpus,
token ids), taken in turn until ``--answers`` (each a new request id, so a repeat is a new answer
as in serving). Memory: the process's resident set before and after putting them into one tree
(``SuffixDecodingCache``, max_tree_depth 24 as vLLM's default), per 10,000 answers. Time: the trees'
work of one engine step (``suffix_mix.Trees.mix``: each request's new token in, a match, a draft) at
1 and 16 requests decoding, over ``--steps`` steps on the warm tree; compare with the engine step
times of the same host (docs/suffix-mix.md). Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from dynamo_spec.training.corpus import _read_round_file, load_manifest
from dynamo_spec.vllm_patches.suffix_mix import MixConfig, Trees


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def answers(n: int) -> list[list[int]]:
    root = Path(__file__).resolve().parents[1] / "data"
    rows = [r["answer_ids"] for entry in load_manifest(root)["rounds"] for r in _read_round_file(root, entry)
            if r.get("answer_ids")]
    return [rows[i % len(rows)] for i in range(n)]


class Batch:
    """A runner's batch as suffix_mix.Trees reads it (vLLM's InputBatch layout)."""

    def __init__(self, rows: int, width: int = 4096):
        self.input_batch = SimpleNamespace(token_ids_cpu=np.zeros((rows, width), np.int32),
                                           num_tokens_no_spec=np.zeros(rows, np.int32),
                                           num_prompt_tokens=np.zeros(rows, np.int32), req_id_to_index={})
        self.requests = {}


def step_time(trees: Trees, corpus: list[list[int]], requests: int, steps: int) -> float:
    """Seconds of tree work per engine step with ``requests`` decoding (each a corpus answer replayed)."""
    runner = Batch(requests)
    batch = runner.input_batch
    ids = [f"bench-{requests}-{i}" for i in range(requests)]
    for i, req_id in enumerate(ids):
        prompt = corpus[-(i + 1)][:16]
        batch.req_id_to_index[req_id] = i
        batch.token_ids_cpu[i, :len(prompt)] = prompt
        batch.num_tokens_no_spec[i] = batch.num_prompt_tokens[i] = len(prompt)
        runner.requests[req_id] = SimpleNamespace(sampling_params=SimpleNamespace(extra_args=None))
    elapsed = 0.0
    for s in range(steps):
        for i in range(requests):
            answer = corpus[(i * 7 + 3) % len(corpus)]
            n = batch.num_tokens_no_spec[i]
            batch.token_ids_cpu[i, n] = answer[s % len(answer)]
            batch.num_tokens_no_spec[i] = n + 1
        drafts = [[1, 2, 3] for _ in ids]
        t0 = time.perf_counter()
        trees.mix(runner, ids, drafts, None)
        elapsed += time.perf_counter() - t0
    trees.finish(runner, ids, ids)  # aborted: leave the tree as it was
    return elapsed / steps


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--answers", type=int, default=10000)
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    corpus = answers(args.answers)
    tokens = sum(map(len, corpus))
    trees = Trees(MixConfig(max_cached_requests=args.answers, min_score=2.0, max_tokens=16), max_model_len=8192)
    cache = trees.cache("")
    before = rss_bytes()
    t0 = time.perf_counter()
    for i, answer in enumerate(corpus):
        cache.start_request(f"a{i}", np.empty(0, np.int32))
        cache.add_active_response(f"a{i}", np.asarray(answer, np.int32))
        cache.stop_request(f"a{i}")
    build = time.perf_counter() - t0
    grown = rss_bytes() - before
    out = {"answers": args.answers, "answer_tokens": tokens, "mean_answer_tokens": round(tokens / args.answers, 1),
           "rss_bytes": grown, "bytes_per_10000_answers": round(grown * 10000 / args.answers),
           "bytes_per_token": round(grown / tokens, 1), "insert_seconds_per_answer": round(build / args.answers, 7),
           "step_seconds": {str(n): round(step_time(trees, corpus, n, args.steps), 7) for n in (1, 16)},
           "cpu": os.uname().machine}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
