"""eval-sampling's pure parts (dynamo_spec/training/sampling_eval.py): the settings compared and how they
differ, the requests, how a setting's answers are scored, the table, and the settings the command
accepts. The engine part: tests/integration/test_sampling_eval.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dynamo_spec.cli import build_parser
from dynamo_spec.training.checked import load_checked
from dynamo_spec.training.sampling_eval import (
    NEUTRAL,
    SETTINGS,
    format_table,
    is_model_default,
    kv_cache_bytes,
    load_open_ended,
    open_seed,
    parse_settings,
    penalty_fields,
    setting_row,
)

pytestmark = pytest.mark.unit

CHECKED = [r for r in load_checked() if r["id"] in ("list-days", "count-10", "math-mul")]
RIGHT = ["1. Monday\n2. Tuesday\n3. Wednesday\n4. Thursday\n5. Friday\n6. Saturday\n7. Sunday",
         "1 2 3 4 5 6 7 8 9 10", "56"]
WRONG = ["Monday Monday Monday", "1 2 3 4 5 5 5 5", "54"]
RUN_ON = RIGHT[0] + "\n8. Monday\n9. Tuesday\n10. Wednesday\n11. Thurs"  # the list starts again at the limit
POEM = "Blossoms fall like snow upon the quiet river in the spring"
LOOP = "The tree is pink. " * 12  # 48 words that repeat one sentence
DAYS_AGAIN = "\n".join(f"{i}. {d}" for i, d in enumerate(["Monday", "Tuesday", "Wednesday", "Thursday", "Friday",
                                                          "Saturday", "Sunday"] * 4, 1))


def _open(*texts: str, cut: bool = False) -> list[dict]:
    return [{"id": "poem-sakura" if i == 0 else f"r{i}", "seed": 0, "text": t, "cut": cut}
            for i, t in enumerate(texts)]


def _row(name="s", setting=None, answers=RIGHT, opens=(POEM,), **kw) -> dict:
    return setting_row(name, setting or {}, CHECKED, list(answers), _open(*opens), checked_acceptance=kw.pop("c", 1.0),
                       open_acceptance=kw.pop("o", 1.0), **kw)


def test_the_shipped_settings_hold_todays_default_dry_and_frequency():
    """What issue 57 compares: today's default, every penalty off, DRY alone at several strengths, DRY with
    a small presence penalty, frequency 0.3 and 0.5."""
    assert SETTINGS["presence 0.8"] == {"presence_penalty": 0.8}
    assert SETTINGS["no penalty"] == {}
    dry_alone = {s["extra_args"]["dry_multiplier"] for s in SETTINGS.values() if set(s) == {"extra_args"}}
    assert len(dry_alone) >= 2 and 0.8 in dry_alone
    assert any(set(s) == {"extra_args", "presence_penalty"} and 0 < s["presence_penalty"] <= 0.3
               for s in SETTINGS.values())
    assert {s.get("frequency_penalty") for s in SETTINGS.values()} >= {0.3, 0.5}


def test_a_setting_differs_from_no_penalty_by_its_own_fields_only():
    """Every penalty field is set in every setting's requests: one a setting leaves out is neutral,
    never the model's default (the CPU default's generation_config.json sets a presence penalty)."""
    assert penalty_fields({}) == NEUTRAL == {"repetition_penalty": 1.0, "frequency_penalty": 0.0,
                                             "presence_penalty": 0.0}
    assert penalty_fields({"presence_penalty": 0.8}) == {**NEUTRAL, "presence_penalty": 0.8}
    for name, setting in SETTINGS.items():
        fields = penalty_fields(setting)
        assert set(fields) - {"extra_args"} == set(NEUTRAL), name
        assert {k: v for k, v in fields.items() if NEUTRAL.get(k) != v} == setting, name


def test_a_settings_extras_reach_its_requests():
    """DRY's fields travel as the request's sampling extras (SamplingParams.extra_args, which the
    integration test's DRY setting passes to vLLM), beside its penalties."""
    dry = {"presence_penalty": 0.3, "extra_args": {"dry_multiplier": 0.8, "dry_allowed_length": 3}}
    fields = penalty_fields(dry)
    assert fields == {**NEUTRAL, "presence_penalty": 0.3, "extra_args": {"dry_multiplier": 0.8, "dry_allowed_length": 3}}
    assert "extra_args" not in penalty_fields({"extra_args": {}})


def test_the_setting_a_request_without_penalties_gets_is_marked_the_models_default():
    cpu_default = {"temperature": 0.2, "top_p": 0.9, "repetition_penalty": 1.0, "presence_penalty": 0.8}
    assert is_model_default({"presence_penalty": 0.8}, cpu_default)
    assert not is_model_default({}, cpu_default)
    assert not is_model_default({"presence_penalty": 0.8, "extra_args": {"dry_multiplier": 0.8}}, cpu_default)
    assert is_model_default({}, {"temperature": 0.7})  # a model that sets no penalty


def test_the_open_ended_requests_are_the_readmes_poem_and_at_least_eleven_more_with_lists():
    rows = load_open_ended()
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    assert len(rows) >= 12 and len({r["id"] for r in rows}) == len(rows)
    assert rows[0]["id"] == "poem-sakura" and f'"content": "{rows[0]["messages"][0]["content"]}"' in readme
    prompts = [r["messages"][0]["content"] for r in rows]
    assert "List the days of the week." in prompts and sum(p.startswith("List") for p in prompts) >= 3
    for r in rows:
        assert [m["role"] for m in r["messages"]] == ["user"]


def test_an_open_answer_has_one_seed_in_every_setting_and_its_own_per_request():
    rows = load_open_ended()
    assert open_seed(0, rows[0]) == open_seed(0, dict(rows[0]))
    assert len({open_seed(s, r) for s in range(4) for r in rows}) == 4 * len(rows)


def test_a_settings_row_counts_right_answers_and_loops():
    row = _row("presence 0.8", {"presence_penalty": 0.8}, [RIGHT[0], WRONG[1], RIGHT[2]], [POEM, LOOP, "Short."],
               c=2.5, o=1.5, model_default=True)
    assert row == {
        "setting": "presence 0.8", "fields": {"presence_penalty": 0.8}, "model_default": True,
        "passed": 2, "checked": 3, "failed": ["count-10"], "checked_acceptance": 2.5,
        "open_looping": 1, "open_answers": 3, "looping": ["r1 (seed 0)"],
        # word 4-grams, each answer against itself: the poem's 8 new, the loop's 45 of which 41 repeat
        # its first 4, none in one word
        "open_repeated_4grams": pytest.approx((0 + 41 / 45 + 0) / 3),
        "open_repeated_4grams_pooled": pytest.approx(41 / (8 + 45)),
        "open_acceptance": 1.5, "poem": [POEM],
    }
    assert _row(answers=WRONG)["failed"] == [r["id"] for r in CHECKED]
    assert _row(answers=RIGHT)["passed"] == 3


def test_a_list_that_runs_on_past_its_end_is_a_wrong_answer_and_a_loop():
    """"List the days of the week." answered with the seven days, then "8. Monday 9. Tuesday ...":
    checked, it fails; open-ended, it loops (its word 4-grams differ only by their numbers)."""
    assert _row(answers=[RUN_ON, RIGHT[1], RIGHT[2]])["failed"] == ["list-days"]
    assert _row(answers=[RIGHT[0], "1 2 3 4 5 6 7 8 9 10 11 12", RIGHT[2]])["failed"] == ["count-10"]
    row = _row(opens=[POEM, DAYS_AGAIN, RIGHT[0]])
    assert (row["open_looping"], row["looping"]) == (1, ["r1 (seed 0)"])


def test_a_loop_cut_in_a_word_at_the_token_limit_still_loops():
    cut_loop = LOOP + "The tr"
    assert _row(opens=[cut_loop])["open_looping"] == 0  # a new last word ends the repeating tail ...
    assert setting_row("s", {}, CHECKED, RIGHT, _open(cut_loop, cut=True), checked_acceptance=1.0,
                       open_acceptance=1.0)["open_looping"] == 1  # ... unless it was cut in two


def test_a_row_needs_an_answer_to_every_checked_request():
    with pytest.raises(ValueError):
        _row(answers=RIGHT[:2])


def test_the_table_has_a_line_per_setting_in_their_order():
    rows = [_row("no penalty", {}, RIGHT, [LOOP, POEM], c=2.0831, o=2.114),
            _row("presence 0.8", {"presence_penalty": 0.8}, WRONG, [POEM, POEM], c=1.9, o=1.0, model_default=True)]
    lines = format_table(rows).splitlines()
    assert lines[0] == ("| setting | checked answers right | looping open answers | mean repeated word 4-grams "
                        "| mean acceptance length: checked / open-ended |")
    assert lines[2:] == ["| no penalty | 3 / 3 | 1 / 2 | 46% | 2.08 / 2.11 |",
                         "| **presence 0.8** (the model's default) | 0 / 3 | 0 / 2 | 0% | 1.90 / 1.00 |"]


def test_the_kv_cache_holds_every_request_in_whole_blocks(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 30, "num_attention_heads": 9,
                                                      "num_key_value_heads": 3, "hidden_size": 576}))
    per_token = 2 * 31 * 3 * 64 * 4  # K and V, 30 layers and the draft's one, 3 heads of 64, fp32
    assert kv_cache_bytes(tmp_path, 64, 300, "float32") == 64 * 4 * 128 * per_token  # 3 blocks and one more
    assert kv_cache_bytes(tmp_path, 64, 300, "bfloat16") == 64 * 4 * 128 * per_token // 2
    assert kv_cache_bytes(tmp_path, 1, 10, "float32") == 512 * 2**20


def test_the_shipped_settings_are_ones_the_command_accepts():
    assert parse_settings(json.dumps(SETTINGS)) == SETTINGS


@pytest.mark.parametrize("settings, says", [
    ('{"hot": {"temperature": 0.7}}', "'temperature' is not one of"),
    ('{"typo": {"presence": 0.5}}', "'presence' is not one of"),
    ('{"text": {"presence_penalty": "0.5"}}', "presence_penalty must be a number"),
    ('{"flag": {"presence_penalty": true}}', "presence_penalty must be a number"),
    ('[{"presence_penalty": 0.5}]', 'expected {"name"'),
    ('{"presence_penalty": 0.5}', 'expected {"name"'),
    ("{}", 'expected {"name"'),
    ('{"d": {"extra_args": [0.8]}}', "extra_args must be an object"),
    ('{"d": {"extra_args": {"dry_multiplyer": 0.8}}}', "extra_args.dry_multiplyer is not one of dry_multiplier"),
    ('{"d": {"extra_args": {"dry_multiplier": -1}}}', "'extra_args.dry_multiplier' must be a number >= 0"),
    ('{"d": {"extra_args": {"dry_multiplier": 0.8, "dry_allowed_length": 1.5}}}',
     "'extra_args.dry_allowed_length' must be an integer"),
    ('{"d": {"extra_args": {"dry_base": 1.75}}}', "'extra_args.dry_base' needs 'extra_args.dry_multiplier'"),
])
def test_a_setting_that_is_not_penalties_and_dry_is_refused_before_an_engine_starts(settings, says, capsys):
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["eval-sampling", "--target", "t", "--draft", "d", "--settings", settings])
    assert exit_.value.code == 2 and says in capsys.readouterr().err


def test_the_command_line_takes_the_settings_it_is_given():
    given = {"p": {"presence_penalty": 0.5, "frequency_penalty": 0},
             "dry": {"extra_args": {"dry_multiplier": 0.8, "dry_base": 1.75, "dry_allowed_length": 2,
                                    "dry_penalty_last_n": -1, "dry_sequence_breakers": ["\n", ":", '"', "*"]}}}
    args = build_parser().parse_args(["eval-sampling", "--target", "t", "--draft", "d", "--settings", json.dumps(given)])
    assert args.settings == given and args.dtype == "auto"
    assert build_parser().parse_args(["eval-sampling", "--target", "t", "--draft", "d"]).settings is None
