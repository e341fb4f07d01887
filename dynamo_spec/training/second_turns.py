"""Second turns: an answered conversation, a follow-up request, answered again.

Chat users rarely stop after one request: they ask for it shorter, simpler, with an
example, rewritten, or for more on one point (MT-bench's second turns are of this kind).
A draft trained on first turns only sees the target answer with the whole earlier
answer in its context less often than it serves it. A follow-up is drawn from a fixed
list per conversation, seeded, so a round is reproducible.
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from pathlib import Path

from .corpus import normal_text
from .rows import read_jsonl, write_jsonl

FOLLOW_UPS: tuple[str, ...] = (
    "Can you make that shorter?",
    "Can you explain that in simpler terms?",
    "Give me a concrete example.",
    "Can you turn that into a bulleted list?",
    "Why is that?",
    "Can you go into more detail on the first point?",
    "Rewrite it in a more formal tone.",
    "Rewrite it so a ten-year-old could understand it.",
    "What are the most common mistakes people make with this?",
    "Summarize that in two sentences.",
    "What should I do next?",
    "Can you add a few more ideas?",
    "Is there anything I should be careful about?",
    "Thanks! Can you make it a bit more fun?",
    "How would you explain this to a beginner?",
    "What are the pros and cons?",
    "Can you give me a step-by-step version?",
    "Write a short title for your answer.",
    "What is the most important thing to remember from this?",
    "Can you rewrite your answer without using any lists?",
)
SUFFIX = "-t2"


def write_second_turns(path: Path, prompts: Path, answers: Path, n: int, *, seed: int = 0,
                       avoid: Iterable[str] = ()) -> Path:
    """Write (once) at most ``n`` two-turn prompts to ``path``: a seeded choice of the
    first-turn conversations of ``prompts`` answered in ``answers`` (answers that ended
    on their own, not cut at the token limit), each followed by the answer and a
    follow-up; id ``<id>-t2``, the first answer's source, split and temperature.
    Requests containing one of the ``avoid`` texts (the evaluation set's, which the
    corpus drops) get none."""
    if path.exists():
        return path
    avoid = [normal_text(t) for t in avoid if t.strip()]
    rows = {r["id"]: r for r in read_jsonl(prompts)
            if not any(t in normal_text(m["content"]) for m in r["messages"] for t in avoid)}
    done = [a for a in read_jsonl(answers)
            if a["id"] in rows and not a["id"].endswith(SUFFIX) and a.get("finish_reason") != "length"
            and len(rows[a["id"]]["messages"]) == 1]
    rng = random.Random(seed)
    rng.shuffle(done)
    out = []
    for a in done[:n]:
        first = rows[a["id"]]
        row = {**first, "id": a["id"] + SUFFIX,
               "messages": [*first["messages"], {"role": "assistant", "content": a["answer"]},
                            {"role": "user", "content": rng.choice(FOLLOW_UPS)}]}
        out.append(row)
    return write_jsonl(path, out)
