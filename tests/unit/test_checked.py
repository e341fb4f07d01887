"""The checked requests of eval-sampling (dynamo_spec/training/checked.py): each check passes a right
answer and fails the wrong ones a penalty or a loop produces."""

from __future__ import annotations

import pytest

from dynamo_spec.training.checked import load_checked, passes

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("check, answer, ok", [
    ({"in_order": ["monday", "tuesday", "sunday"]}, "1. Monday\n2. Tuesday\n3. Sunday", True),
    ({"in_order": ["monday", "tuesday", "sunday"]}, "Sunday, Monday, Tuesday", False),
    ({"all": ["spring", "autumn|fall"]}, "Spring and fall.", True),
    ({"all": ["spring", "autumn|fall"]}, "Spring and summer.", False),
    ({"numbers": [1, 2, 3, 4]}, "1, 2, 3, 4, 5", True),
    ({"numbers": [1, 2, 3, 4]}, "1. 1\n2. 2\n3. 3\n4. 4", True),  # a numbered list of the numbers
    ({"numbers": [1, 2, 3, 4]}, "1, 2, 4, 3", False),
    ({"numbers": [1, 2, 3, 4]}, "The number of items that can be counted ...", False),
    ({"letters": "abcd"}, "A B C D E", True),
    ({"letters": "abcd"}, "A B D C", False),
    ({"answer": 56}, "7 times 8 is 56.", True),
    ({"answer": 56}, "7 times 8 is 54.", False),
    ({"json_keys": ["name", "age"]}, 'Here: {"name": "Ann", "age": 30}', True),
    ({"json_keys": ["name", "age"]}, '{"name": "Ann"}', False),
    ({"json_keys": ["name", "age"]}, "{name: Ann, age: 30}", False),
])
def test_a_check_passes_right_answers_only(check, answer, ok):
    assert passes(answer, check) is ok


def test_the_set_is_30_to_50_requests_each_with_one_known_check():
    rows = load_checked()
    assert 30 <= len(rows) <= 50 and len({r["id"] for r in rows}) == len(rows)
    for row in rows:
        passes("", row["check"])  # a known kind (an unknown one raises)
        assert len(row["check"]) == 1 and row["messages"][0]["role"] == "user"
