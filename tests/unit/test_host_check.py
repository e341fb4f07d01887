"""`dynamo-spec bench --host-check`: its figures from plain series (the probe itself runs for minutes), its flags."""

from __future__ import annotations

from pathlib import Path

import pytest

from dynamo_spec.bench.host_check import adjacent_differences, figures, summarize, text
from dynamo_spec.bench.options import HostCheckOptions
from dynamo_spec.cli import build_parser

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


def test_report_names_each_core_and_how_alike_they_move():
    steady, slowing = [100.0] * 40, [100.0 - i for i in range(40)]
    report = figures(HostCheckOptions(seconds=40), [0, 1], {0: slowing, 1: [2 * v for v in slowing]}, 0.02)
    assert report["kind"] == "gemm" and report["steal_share"] == 0.02
    assert report["correlation_core0_core1"] == pytest.approx(1.0)
    lines = text(report).splitlines()
    assert lines[0] == "gemm on 2 core(s), 40 s, steal 2.0%"
    assert lines[1].startswith("core 0: 1-s windows stdev") and "8 s windows: adjacent differ" in lines[1]
    assert lines[-1] == "correlation of the cores' series: 1.00"
    assert "correlation_core0_core1" not in figures(HostCheckOptions(), [3], {3: steady}, 0.0)


def parse(*argv: str):
    args, extra = build_parser().parse_known_args(["bench", *argv])
    args.overrides = extra
    return args


def test_host_check_flags_and_defaults():
    options = HostCheckOptions.from_args(parse("--host-check"))
    assert options == HostCheckOptions(workload="gemm", seconds=240, out=Path("runs/bench"))
    options = HostCheckOptions.from_args(parse("--host-check", "--workload", "mem", "--seconds", "30", "--out", "x"))
    assert (options.workload, options.seconds, options.out) == ("mem", 30, Path("x"))
    with pytest.raises(SystemExit, match="no --config or --url"):
        HostCheckOptions.from_args(parse("--host-check", "--url", "http://localhost:8000"))
    with pytest.raises(SystemExit, match="more than 0"):
        HostCheckOptions.from_args(parse("--host-check", "--seconds", "0"))
    args = parse("--config", "c.yaml", "--seconds", "30")
    with pytest.raises(SystemExit, match="belong to --host-check"):
        args.func(args)
