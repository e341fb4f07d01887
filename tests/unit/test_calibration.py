"""The calibration table of eval-draft (dynamo_spec/training/calibration.py) on records whose answer is known."""

from __future__ import annotations

import pytest

from dynamo_spec.training.calibration import calibration, format_calibration, pairs

pytestmark = pytest.mark.unit


def test_positions_after_the_first_rejection_are_not_judged_per_token_but_count_for_survival():
    got = pairs([{"confidence": [0.9, 0.5, 0.8], "accepted": 1}])
    assert got["token"] == [(0.9, True, 0), (0.5, False, 1)]
    assert [(round(p, 3), a, i) for p, a, i in got["survival"]] == [(0.9, True, 0), (0.45, False, 1),
                                                                    (0.36, False, 2)]


def test_a_calibrated_draft_is_off_only_by_the_spread_inside_its_deciles():
    # 10 drafts of one token at confidence c in {0.05, ..., 0.95}: accepted in 10 * c of 10 copies.
    records = []
    for tenth in range(10):
        c = tenth / 10 + 0.05
        accepted = round(c * 10 - 0.5)  # 0, 1, ..., 9 of 10
        records += [{"confidence": [c], "accepted": int(i < accepted)} for i in range(10)]
    result = calibration(records)
    token = result["token"]
    assert token["n"] == 100 and len(token["deciles"]) == 10
    assert [d["n"] for d in token["deciles"]] == [10] * 10
    assert [d["observed"] for d in token["deciles"]] == pytest.approx([i / 10 for i in range(10)])
    assert token["ece"] == pytest.approx(0.05)  # each decile predicts 0.05 above what it gets


def test_a_confidence_that_separates_accepted_from_rejected_ranks_perfectly():
    records = [{"confidence": [c / 20], "accepted": int(c >= 10)} for c in range(1, 20)]
    assert calibration(records)["token"]["auc"] == 1.0


def test_a_confidence_that_says_nothing_ranks_at_chance():
    records = [{"confidence": [0.5], "accepted": i % 2} for i in range(40)]
    result = calibration(records)["token"]
    assert result["auc"] == pytest.approx(0.5)
    assert result["brier"] == pytest.approx(0.25)
    assert result["by_position"] == [{"position": 0, "n": 40, "predicted": 0.5, "observed": 0.5}]


def test_an_inverted_confidence_has_auc_zero_and_the_report_names_both_questions():
    records = [{"confidence": [0.9], "accepted": 0}, {"confidence": [0.1], "accepted": 1}]
    result = calibration(records, bins=2)
    assert result["token"]["auc"] == 0.0
    text = "\n".join(format_calibration(result, ", k=1 0"))
    assert "2 verified drafts" in text and "per token" in text and "survival" in text
    assert "| 1 | 0.100-0.100 | 1 | 0.100 | 1.000 |" in text
