"""benchmarks/host_speed.py's figures from plain series (the probe itself runs for minutes)."""

from __future__ import annotations

import pytest

from benchmarks.host_speed import adjacent_differences, summarize

pytestmark = pytest.mark.unit


def test_adjacent_windows_compare_their_means():
    series = [100.0] * 8 + [80.0] * 8 + [80.0] * 8
    assert adjacent_differences(series, 8) == pytest.approx([20 / 90, 0.0])
    assert adjacent_differences(series[:7], 8) == []


def test_summary_is_relative_to_the_median():
    series = [100.0] * 20 + [50.0] * 2 + [110.0] * 18
    s = summarize(series)
    assert s["median_per_s"] == 100.0 and s["min"] == 0.5 and s["max"] == pytest.approx(1.1)
    assert s["below_0.8"] == pytest.approx(2 / 40)
    assert s["adjacent_8s"]["pairs"] == 4 and s["adjacent_18s"]["pairs"] == 1
