"""Second turns: which answered conversations get a follow-up, and what the new prompt holds."""

from __future__ import annotations

import pytest

from dynamo_spec.training.rows import read_jsonl, write_jsonl
from dynamo_spec.training.second_turns import FOLLOW_UPS, write_second_turns

pytestmark = pytest.mark.unit


def _files(tmp_path):
    prompts = write_jsonl(tmp_path / "prompts.jsonl", [
        {"id": f"p{i}", "source": "magpie", "split": "train", "temperature": 0.7 if i % 2 else None,
         "messages": [{"role": "user", "content": f"question {i}"}]} for i in range(6)]
        + [{"id": "two", "source": "mtbench", "split": "train",
            "messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                         {"role": "user", "content": "c"}]}])
    answers = write_jsonl(tmp_path / "answers.jsonl", [
        {"id": f"p{i}", "source": "magpie", "prompt_ids": [1], "answer_ids": [2], "answer": f"answer {i}",
         "finish_reason": "length" if i == 5 else "stop"} for i in range(6)]
        + [{"id": "two", "source": "mtbench", "prompt_ids": [1], "answer_ids": [2], "answer": "d",
            "finish_reason": "stop"}])
    return prompts, answers


def test_follow_ups_continue_answered_first_turns_only(tmp_path):
    prompts, answers = _files(tmp_path)
    rows = read_jsonl(write_second_turns(tmp_path / "t2.jsonl", prompts, answers, 10, seed=1))
    # p5 was cut at the token limit, "two" is already a second turn: neither is continued
    assert sorted(r["id"] for r in rows) == [f"p{i}-t2" for i in range(5)]
    for r in rows:
        i = int(r["id"][1])
        user, assistant, follow = r["messages"]
        assert user["content"] == f"question {i}" and assistant == {"role": "assistant", "content": f"answer {i}"}
        assert follow["role"] == "user" and follow["content"] in FOLLOW_UPS
        assert r.get("temperature") == (0.7 if i % 2 else None) and r["source"] == "magpie"


def test_a_seeded_choice_of_n_written_once(tmp_path):
    prompts, answers = _files(tmp_path)
    a = read_jsonl(write_second_turns(tmp_path / "a.jsonl", prompts, answers, 3, seed=2))
    b = read_jsonl(write_second_turns(tmp_path / "b.jsonl", prompts, answers, 3, seed=2))
    assert len(a) == 3 and a == b
    write_jsonl(tmp_path / "a.jsonl", a[:1])
    assert len(read_jsonl(write_second_turns(tmp_path / "a.jsonl", prompts, answers, 3, seed=2))) == 1


def test_requests_of_the_evaluation_set_get_no_second_turn(tmp_path):
    prompts, answers = _files(tmp_path)
    rows = read_jsonl(write_second_turns(tmp_path / "t2.jsonl", prompts, answers, 10, seed=1,
                                         avoid=["QUESTION  1", "Question 3", " "]))
    assert sorted(r["id"] for r in rows) == ["p0-t2", "p2-t2", "p4-t2"]
