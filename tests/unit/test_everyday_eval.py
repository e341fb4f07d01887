"""The shipped everyday-instruction evaluation set is well formed and is what eval-draft reads."""

from __future__ import annotations

import collections

import pytest

from dynamo_spec.training.rows import EVERYDAY_EVAL, interleave_sources, read_jsonl

pytestmark = pytest.mark.unit


def test_rows_are_single_user_turns_of_the_eval_split():
    rows = read_jsonl(EVERYDAY_EVAL)
    assert len({r["id"] for r in rows}) == len(rows)
    assert all(r["split"] == "eval" and r["origin"] for r in rows)
    assert all(len(r["messages"]) == 1 and r["messages"][0]["role"] == "user"
               and r["messages"][0]["content"].strip() for r in rows)
    texts = [r["messages"][0]["content"] for r in rows]
    assert len(set(texts)) == len(texts)
    per_source = collections.Counter(r["source"] for r in rows)
    hand_written = {s: n for s, n in per_source.items() if not s.startswith("mtbench-")}
    assert len(hand_written) == 8 and set(hand_written.values()) == {6}
    assert sum(n for s, n in per_source.items() if s.startswith("mtbench-")) == 20
    # eval-draft takes a prefix of the interleaved rows: any prefix mixes the categories
    assert len({r["source"] for r in interleave_sources(read_jsonl(EVERYDAY_EVAL, split="eval"))[:8]}) == 8
