"""Rows of the training pipeline's JSON-lines files: reading, writing, ordering, seeds.

Shared by every stage (prompts, answers, hidden states, evaluation, verify); the
prompt sources themselves are in ``data``.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path

# The shipped evaluation set (eval-draft's default): everyday requests written for evaluation
# only and the MT-bench first turns train-draft holds out, by category; never trained on.
EVERYDAY_EVAL = Path(__file__).with_name("everyday_eval.jsonl")


def eval_texts(path: Path = EVERYDAY_EVAL) -> tuple[str, ...]:
    """The user turns of the evaluation set: what training data must never contain."""
    return tuple(m["content"] for r in read_jsonl(path) for m in r["messages"] if m["role"] == "user")


def write_jsonl(path: Path, rows) -> Path:
    """Write ``rows`` as JSON lines all at once (a temp file, then a rename)."""
    tmp = path.with_suffix(".tmp")
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(tmp, "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    tmp.rename(path)
    return path


def read_jsonl(path: Path, split: str | None = None) -> list[dict]:
    """Rows of a JSON-lines file; a last line still being written is left out."""
    lines = Path(path).read_text().split("\n")[:-1]  # complete lines end with a newline
    rows = [json.loads(line) for line in lines if line.strip()]
    return [r for r in rows if split is None or r.get("split") == split]


def interleave_sources(rows: list[dict]) -> list[dict]:
    """Round-robin over sources (sorted by name), so any prefix is a mix."""
    by_src: dict[str, list] = {}
    for r in rows:
        by_src.setdefault(r.get("source", ""), []).append(r)
    queues = [by_src[k] for k in sorted(by_src)]
    out = []
    while any(queues):
        for q in queues:
            if q:
                out.append(q.pop(0))
    return out


def sample_seed(seed: int, row_id: str) -> int:
    """The sampling seed of one row: the run's seed and the row id, so an answer does
    not depend on which other rows it was batched with."""
    return zlib.crc32(f"{seed}-{row_id}".encode())
