"""eval-sampling's pure parts (dynamo_spec/training/sampling_eval.py): how settings differ, how a
setting's answers are scored, the table, and the settings the command accepts. The engine part:
tests/integration/test_sampling_eval.py."""

from __future__ import annotations

import json

import pytest

from dynamo_spec.cli import build_parser
from dynamo_spec.training.checked import load_checked
from dynamo_spec.training.sampling_eval import (
    NEUTRAL,
    SETTINGS,
    format_table,
    parse_settings,
    penalty_fields,
    setting_row,
    words,
)

pytestmark = pytest.mark.unit

CHECKED = [r for r in load_checked() if r["id"] in ("list-days", "count-10", "math-mul")]
RIGHT = ["Monday Tuesday Wednesday Thursday Friday Saturday Sunday", "1 2 3 4 5 6 7 8 9 10", "56"]
WRONG = ["Monday Monday Monday", "1 2 3 4 5 5 5 5", "54"]
POEM = "Blossoms fall like snow upon the quiet river in the spring"
LOOP = "The tree is pink. " * 12  # 48 words that repeat one sentence


def test_a_setting_differs_from_no_penalty_by_its_own_fields_only():
    """Every penalty field is set in every setting's requests: one a setting leaves out is neutral,
    never the model's default (the CPU default's generation_config.json sets a presence penalty)."""
    assert penalty_fields({}) == NEUTRAL == {"repetition_penalty": 1.0, "frequency_penalty": 0.0,
                                             "presence_penalty": 0.0}
    assert penalty_fields({"presence_penalty": 0.8}) == {**NEUTRAL, "presence_penalty": 0.8}
    for name, penalty in SETTINGS.items():
        fields = penalty_fields(penalty)
        assert set(fields) == set(NEUTRAL), name
        assert {k: v for k, v in fields.items() if v != NEUTRAL[k]} == penalty, name


def test_words_are_lower_cased_and_split_on_whitespace():
    assert words("The  tree\nis THE tree.") == ["the", "tree", "is", "the", "tree."]


def test_a_settings_row_counts_right_answers_and_loops():
    row = setting_row("presence 0.8", {"presence_penalty": 0.8}, CHECKED, [RIGHT[0], WRONG[1], RIGHT[2]],
                      [POEM, LOOP, "Short."], checked_acceptance=2.5, open_acceptance=1.5)
    assert row == {
        "setting": "presence 0.8", "fields": {"presence_penalty": 0.8}, "passed": 2, "checked": 3,
        "failed": ["count-10"], "checked_acceptance": 2.5,
        # word 4-grams, each answer against itself: the poem's 8 new, the loop's 45 of which 41 repeat
        # its first 4, none in one word
        "open_repeated_4grams": pytest.approx(41 / (8 + 45)), "open_looping": 1, "open_answers": 3,
        "open_acceptance": 1.5, "poem": POEM,
    }
    # words are compared lower-cased: 3 of this answer's 6 4-grams repeat
    assert setting_row("none", {}, CHECKED, RIGHT, ["Pink tree is PINK TREE IS pink tree is"], checked_acceptance=1.0,
                       open_acceptance=1.0)["open_repeated_4grams"] == pytest.approx(3 / 6)
    assert setting_row("none", {}, CHECKED, WRONG, [POEM], checked_acceptance=1.0,
                       open_acceptance=1.0)["failed"] == [r["id"] for r in CHECKED]
    assert setting_row("none", {}, CHECKED, RIGHT, [POEM], checked_acceptance=1.0,
                       open_acceptance=1.0)["passed"] == 3


def test_a_row_needs_an_answer_to_every_checked_request():
    with pytest.raises(ValueError):
        setting_row("none", {}, CHECKED, RIGHT[:2], [POEM], checked_acceptance=1.0, open_acceptance=1.0)


def test_the_table_has_a_line_per_setting_in_their_order():
    rows = [setting_row(name, {}, CHECKED, answers, opens, checked_acceptance=c, open_acceptance=o)
            for name, answers, opens, c, o in [("no penalty", RIGHT, [LOOP, POEM], 2.0831, 2.114),
                                               ("presence 0.8", WRONG, [POEM, POEM], 1.9, 1.0)]]
    lines = format_table(rows).splitlines()
    assert lines[0].startswith("| setting | checked answers right | looping answers (open-ended) |")
    assert lines[2:] == ["| no penalty | 3 / 3 | 1 / 2 | 77% | 2.08 | 2.11 |",
                         "| presence 0.8 | 0 / 3 | 0 / 2 | 0% | 1.90 | 1.00 |"]


def test_the_shipped_settings_are_ones_the_command_accepts():
    assert parse_settings(json.dumps(SETTINGS)) == SETTINGS


@pytest.mark.parametrize("settings, says", [
    ('{"hot": {"temperature": 0.7}}', "'temperature' is not one of"),
    ('{"typo": {"presence": 0.5}}', "'presence' is not one of"),
    ('{"text": {"presence_penalty": "0.5"}}', "presence_penalty must be a number"),
    ('{"flag": {"presence_penalty": true}}', "presence_penalty must be a number"),
    ('[{"presence_penalty": 0.5}]', 'expected {"name"'),
    ('{"presence_penalty": 0.5}', 'expected {"name"'),
])
def test_a_setting_that_is_not_penalties_is_refused_before_an_engine_starts(settings, says, capsys):
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["eval-sampling", "--target", "t", "--draft", "d", "--settings", settings])
    assert exit_.value.code == 2 and says in capsys.readouterr().err


def test_the_command_line_takes_the_settings_it_is_given():
    args = build_parser().parse_args(["eval-sampling", "--target", "t", "--draft", "d", "--settings",
                                      '{"p": {"presence_penalty": 0.5, "frequency_penalty": 0}}'])
    assert args.settings == {"p": {"presence_penalty": 0.5, "frequency_penalty": 0}}
    assert build_parser().parse_args(["eval-sampling", "--target", "t", "--draft", "d"]).settings is None
