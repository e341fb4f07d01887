"""The degeneration figures eval-draft reports beside acceptance."""

from __future__ import annotations

import pytest

from dynamo_spec.training.degeneration import cycle_start, degeneration, repeated_ngram_share

pytestmark = pytest.mark.unit


def test_text_that_never_repeats_a_4gram_scores_zero():
    ids = list(range(100))
    assert repeated_ngram_share(ids) == 0.0
    assert cycle_start(ids) is None


def test_a_loop_scores_its_share_and_where_it_starts():
    prefix, loop = list(range(100, 120)), [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    ids = prefix + loop * 6  # 80 tokens, 77 4-grams
    # new: the 30 4-grams starting before the second copy; all later ones repeat
    assert repeated_ngram_share(ids) == pytest.approx((77 - 30) / 77)
    assert cycle_start(ids) == len(prefix) + len(loop)  # the first token that only repeats


def test_a_short_repeated_tail_is_not_a_loop():
    ids = list(range(50)) + list(range(10, 20))  # a 10-token tail that repeats earlier text
    assert repeated_ngram_share(ids) > 0
    assert cycle_start(ids) is None
    assert cycle_start(ids, min_tail=10) == 50


def test_a_repeat_in_the_middle_does_not_make_a_cycle():
    ids = list(range(40)) + list(range(40)) + list(range(200, 240))
    assert repeated_ngram_share(ids) == pytest.approx(37 / 117)
    assert cycle_start(ids) is None


def test_short_answers_and_other_n():
    assert repeated_ngram_share([1, 2, 3]) == 0.0
    assert repeated_ngram_share([7, 7, 7, 7], n=1) == pytest.approx(3 / 4)
    assert repeated_ngram_share([1, 2, 1, 2, 1], n=2) == pytest.approx(2 / 4)


def test_figures_over_a_set_pool_the_ngrams_and_count_the_loops():
    clean, looping = list(range(36)), [5, 6, 7, 8] * 10  # 33 and 37 4-grams
    result = degeneration([clean, looping, []])
    assert result["repeated_ngram_share"] == pytest.approx(33 / 70)  # 37 - 4 new in the loop
    assert result["mean_repeated_ngram_share"] == pytest.approx((0 + 33 / 37 + 0) / 3)
    assert result["looping"] == 1 and result["answers"] == 3
    assert result["cycle_starts"] == [None, 4, None]
    assert degeneration([])["repeated_ngram_share"] == 0.0
