"""The degeneration figures eval-draft reports beside acceptance, and eval-sampling's loop judge on words."""

from __future__ import annotations

import pytest

from dynamo_spec.training.degeneration import (
    cycle_start,
    degeneration,
    loop_words,
    repeated_ngram_share,
    text_degeneration,
)

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


DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]


def _numbered(start: int, items: list[str]) -> str:
    return "\n".join(f"{i}. {item}" for i, item in enumerate(items, start))


def test_a_numbered_list_that_starts_again_loops_though_its_numbers_go_on():
    """"8. Monday 9. Tuesday ...": no word 4-gram repeats verbatim, but the list loops."""
    run_on = "Here are the days of the week:\n" + _numbered(1, DAYS * 5)  # 35 entries, numbered 1 to 35
    assert len(set(run_on.split())) == len(DAYS) + 35 + 6  # every enumerator new
    result = text_degeneration([run_on])
    assert result["looping"] == 1
    assert result["mean_repeated_ngram_share"] > 0.7
    assert loop_words("8. Monday 9) Tuesday (10) Wednesday 11: x") == ["#.", "monday", "#.", "tuesday", "#.",
                                                                       "wednesday", "#.", "x"]


def test_a_list_that_ends_does_not_loop():
    answer = "Here are the days of the week:\n" + _numbered(1, DAYS) + "\nEach day has its own rhythm."
    result = text_degeneration([answer])
    assert result["looping"] == 0 and result["mean_repeated_ngram_share"] == 0.0


def test_a_repeated_line_loops_and_a_word_cut_at_the_limit_does_not_hide_it():
    poem = "Sakura blooms in spring,\nsoft petals on the wind.\n" + "A tree of love,\n" * 30
    assert text_degeneration([poem])["looping"] == 1
    cut = poem + "A tree of lo"  # the token limit cut the last word in two
    assert text_degeneration([cut])["looping"] == 0  # read as a new last 4-gram ...
    assert text_degeneration([cut], cut=[True])["looping"] == 1  # ... unless known to be cut
    assert loop_words("A tree of lo", cut=True) == ["a", "tree", "of"]


def test_text_figures_are_per_answer_and_lower_cased():
    result = text_degeneration(["Pink tree is PINK TREE IS pink tree is", "blossoms fall like snow on the river"])
    assert result["mean_repeated_ngram_share"] == pytest.approx((3 / 6 + 0) / 2)
    assert result["answers"] == 2 and result["looping"] == 0
