"""The checked requests of eval-sampling (dynamo_spec/training/checked.py): each check passes a right
answer and fails the wrong ones a penalty or a loop produces; every request of the shipped set is
judged right on a right answer and wrong on a wrong one."""

from __future__ import annotations

import json
import re

import pytest

from dynamo_spec.training.checked import load_checked, passes

pytestmark = pytest.mark.unit

KINDS = {"in_order", "all", "numbers", "letters", "answer", "json_keys"}


@pytest.mark.parametrize("check, answer, ok", [
    ({"in_order": ["monday", "tuesday", "sunday"]}, "1. Monday\n2. Tuesday\n3. Sunday", True),
    ({"in_order": ["monday", "tuesday", "sunday"]}, "Sunday, Monday, Tuesday", False),
    ({"in_order": ["monday", "tuesday", "sunday"]}, "Monday, Tuesday, Monday, Tuesday", False),  # a loop
    # a list that runs on past its end: it starts again, or numbers an entry past its length
    ({"in_order": ["monday", "tuesday", "wednesday", "sunday"]},
     "1. Monday\n2. Tuesday\n3. Wednesday\n4. Sunday\n5. Monday\n6. Tuesday\n7. Wednesday", False),
    ({"in_order": ["monday", "tuesday", "wednesday", "sunday"]},
     "1. Monday 2. Tuesday 3. Wednesday 4. Sunday 5. Monday 6. Tuesday 7. Wedn", False),  # cut at the limit
    ({"in_order": ["monday", "tuesday", "wednesday", "sunday"]},
     "Monday, Tuesday, Wednesday, Sunday, Monday, Tuesday, Wednesday, Sunday", False),
    ({"in_order": ["monday", "tuesday", "wednesday", "sunday"]},
     "- Monday\n- Tuesday\n- Wednesday\n- Sunday\n- **Monday**\n- **Tuesday**\n- **Wednesday**", False),
    ({"in_order": ["monday", "tuesday", "sunday"]}, "1. Monday\n2. Tuesday\n3. Sunday\n4. Monday", False),
    ({"in_order": ["mercury", "venus", "neptune"]}, "1. Mercury\n2. Venus\n3. Neptune\n4. Pluto", False),
    # ... not a list that mentions its items again in a sentence, nor another list's numbers
    ({"in_order": ["monday", "tuesday", "wednesday", "sunday"]},
     "1. Monday\n2. Tuesday\n3. Wednesday\n4. Sunday\n\nMonday starts the week, then Tuesday and Wednesday.", True),
    ({"in_order": ["monday", "tuesday", "wednesday", "sunday"]},
     "**Monday**, **Tuesday**, **Wednesday** and **Sunday**.", True),
    ({"in_order": ["mercury", "venus", "neptune"]}, "Facts:\n5. Hot\n1. Mercury\n2. Venus\n3. Neptune", True),
    ({"all": ["spring", "autumn|fall"]}, "Spring and fall.", True),
    ({"all": ["spring", "autumn|fall"]}, "Autumn, then spring.", True),  # any order
    ({"all": ["spring", "autumn|fall"]}, "Spring and summer.", False),
    ({"all": [r"\ba\b", r"\be\b"]}, "A and E", True),
    ({"all": [r"\ba\b", r"\be\b"]}, "The vowels are here", False),  # letters inside words are not letters
    ({"numbers": [1, 2, 3, 4]}, "1, 2, 3, 4. Done: 4 numbers.", True),
    ({"numbers": [1, 2, 3, 4]}, "1, 2, 3, 4, 5", False),  # a count that runs on past its end
    ({"numbers": [10, 20, 30]}, "10, 20, 30, 40", False),
    ({"numbers": [4, 3, 2, 1]}, "4, 3, 2, 1, 0", False),
    ({"numbers": [1, 2, 3, 4]}, "1. 1\n2. 2\n3. 3\n4. 4\n5. 5", False),
    ({"numbers": [1, 2, 3, 4]}, "1, 2, 3, 4, 1, 2, 3", False),  # ... or starts again
    ({"numbers": [1, 2, 3, 4]}, "1. 1\n2. 2\n3. 3\n4. 4", True),  # a numbered list of the numbers
    ({"numbers": [2, 3, 5, 7]}, "1. 2\n2. 3\n3. 5\n4. 7", True),  # its enumerators are not the answer's numbers
    ({"numbers": [2, 3, 5, 7]}, "1. 2\n2. 3\n3. 4\n4. 7", False),
    ({"numbers": [1, 2, 3, 4]}, "1, 2, 4, 3", False),
    ({"numbers": [1, 2, 3, 4]}, "1, 2, 3, 3, 4", False),  # a repeat breaks the run
    ({"numbers": [1, 2, 3, 4]}, "The number of items that can be counted ...", False),
    ({"letters": "abcd"}, "A B C D E", True),
    ({"letters": "abcd"}, "a, b, c, d", True),
    ({"letters": "abcd"}, "A B D C", False),
    ({"letters": "abcd"}, "abcd", False),  # one word, not four letters
    ({"answer": 56}, "7 times 8 is 56.", True),
    ({"answer": 56}, "7 times 8 is 54.", False),
    ({"answer": 56}, "7 times 8 is 560.", False),  # a whole number, not digits inside one
    ({"answer": 9}, "15 - 6 = 9", True),
    ({"json_keys": ["name", "age"]}, 'Here: {"name": "Ann", "age": 30}', True),
    ({"json_keys": ["name", "age"]}, '```json\n{"person": {"name": "Ann", "age": 30}}\n```', True),  # nested
    ({"json_keys": ["name", "age"]}, '{"name": "Ann"}', False),
    ({"json_keys": ["name", "age"]}, "{name: Ann, age: 30}", False),
])
def test_a_check_passes_right_answers_only(check, answer, ok):
    assert passes(answer, check) is ok


@pytest.mark.parametrize("check", [{"contains": ["x"]}, {"all": ["x"], "answer": 1}, {}])
def test_a_check_of_no_known_single_kind_is_refused(check):
    with pytest.raises(ValueError):
        passes("x 1", check)


def _literal(pattern: str) -> str:
    """Text a check's pattern matches: its first alternative, without word boundaries and escapes."""
    return re.sub(r"\\(.)", lambda m: "" if m.group(1) == "b" else m.group(1), pattern.split("|")[0])


def right_answer(check: dict) -> str:
    """An answer written as a model would (capitals, enumerators, prose around it) that holds the check."""
    [(kind, want)] = check.items()
    if kind == "in_order":
        return "Sure! Here they are:\n" + "\n".join(f"{i}. {item.title()}" for i, item in enumerate(want, 1))
    if kind == "all":
        return "The answer: " + ", ".join(_literal(p).upper() for p in want) + "."
    if kind == "numbers":
        return "Here you go: " + ", ".join(map(str, want)) + "."
    if kind == "letters":
        return " ".join(want.upper())
    if kind == "answer":
        return f"The result is {want}."
    return "```json\n" + json.dumps({key: "x" for key in want}) + "\n```"


def wrong_answer(check: dict) -> str:
    """The right answer less its last item (for a number: one more)."""
    [(kind, want)] = check.items()
    return right_answer({kind: want + 1 if kind == "answer" else want[:-1]})


ROWS = load_checked()


def test_the_set_is_30_to_50_requests_of_every_kind():
    assert 30 <= len(ROWS) <= 50 and len({r["id"] for r in ROWS}) == len(ROWS)
    assert {kind for r in ROWS for kind in r["check"]} == KINDS
    for row in ROWS:
        assert len(row["check"]) == 1 and row["messages"][0]["role"] == "user"


@pytest.mark.parametrize("row", ROWS, ids=[r["id"] for r in ROWS])
def test_each_request_is_right_on_a_right_answer_and_wrong_on_a_wrong_one(row):
    check = row["check"]
    assert passes(right_answer(check), check) is True
    assert passes(wrong_answer(check), check) is False
    assert passes("", check) is False
    assert passes("I cannot answer that. " * 20, check) is False
