"""`dynamo-spec bench` end to end on the tiny fixtures: short runs, a consistent report."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys

import pytest
import yaml

from support.server_process import tiny_config

pytestmark = pytest.mark.integration

KS = [0, 1, 3]
CONCURRENCY = [1, 4]
ROUNDS = 2
# The config's own schedule: k=3 for one request, k=1 from two. No derived schedule can equal it
# (the derived ranges end at 2 for the concurrencies 1 and 4, or at 1 with --k 0,1), so the bench
# gives it a column.
CONFIGURED = [[1, 1, 3], [2, 128, 1]]
PROMPTS = ["What is the capital of France?", "Write a poem about the sea.", "def add(a, b):", "Hello!",
           "Explain speculative decoding.", "Tell me a story about a cat."]


def run_bench(tiny_models, work, ks: list[int], concurrency: list[int], *options: str, configured=CONFIGURED):
    config = tiny_config(tiny_models["fixed_target"], tiny_models["partial_draft"], k=3,
                         speculative={"num_speculative_tokens_per_batch_size": configured})
    config_path = work / "tiny.yaml"
    config_path.write_text(yaml.safe_dump(config))
    prompts = work / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in PROMPTS) + "\n")
    out = work / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "dynamo_spec", "bench", "--config", str(config_path), "--k", ",".join(map(str, ks)),
         "--concurrency", ",".join(map(str, concurrency)), "--requests", "4", "--per-client", "2", "--max-tokens", "12",
         "--prompts", str(prompts), *options, "--out", str(out)],
        capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads((out / "bench.json").read_text()), out, proc.stdout


@pytest.fixture(scope="module")
def bench(tiny_models, tmp_path_factory):
    return run_bench(tiny_models, tmp_path_factory.mktemp("bench"), KS, CONCURRENCY,
                     "--together", "2", "--rounds", str(ROUNDS))


def median_ratio(cell: dict, base: dict) -> float:
    """The speed-up of a cell measured in two rounds: the median (here the mean) of the per-round ratios."""
    ours, theirs = cell["rounds_output_tokens_per_s"], base["rounds_output_tokens_per_s"]
    assert len(ours) == len(theirs) == ROUNDS
    return sum(a / b for a, b in zip(ours, theirs)) / ROUNDS


def test_every_cell_is_present_and_answered(bench):
    result, _, _ = bench
    expected = {f"k={k}": {"derive", "judge"} for k in KS} | {
        "k=0 (speculative engine)": {"derive", "judge"}, "schedule": {"judge"}, "confidence budget": {"judge"},
        "config's schedule": {"judge"}, "k=0 (repeat)": {"judge"}}
    assert {name: set(col["cells"]) for name, col in result["columns"].items()} == expected
    for col in result["columns"].values():
        for cells in col["cells"].values():
            assert sorted(map(int, cells)) == CONCURRENCY
            for c, cell in cells.items():
                assert cell["failed"] == 0, cell["errors"]
                assert cell["requests"] == ROUNDS * max(4, 2 * int(c))
                assert cell["output_tokens"] == 12 * cell["requests"]  # the fixed target never stops early
                assert cell["ttft_s"]["p50"] <= cell["e2e_s"]["p50"]


def test_acceptance_is_consistent_and_known(bench):
    result, _, _ = bench
    for name, col in result["columns"].items():
        for cells in col["cells"].values():
            for cell in cells.values():
                assert 0 <= cell["accepted_tokens"] <= cell["draft_tokens"]
                if name in ("k=0", "k=0 (repeat)", "k=0 (speculative engine)"):
                    # the last: speculation on, schedule k=0 at every batch size: no draft at all
                    assert cell["drafts"] == 0 and cell["acceptance_rate"] is None
    # The partial draft is accepted at its first position only: at k=3 the rate is 1/3, length 2.
    for cell in result["columns"]["k=3"]["cells"]["judge"].values():
        assert cell["acceptance_rate"] == pytest.approx(1 / 3)
        assert cell["mean_acceptance_length"] == pytest.approx(2.0)
        assert cell["per_position_acceptance"] == pytest.approx([1.0, 0.0, 0.0])
    # The config's own schedule served as written: k=3 drafts for one request, k=1 drafts once two
    # or more run (at c=4 mostly; the drain down to one request drafts 3 again).
    configured = result["columns"]["config's schedule"]
    assert configured["overrides"] == [] and result["settings"]["config_schedule"] == CONFIGURED
    cells = configured["cells"]["judge"]
    assert cells["1"]["draft_tokens"] == 3 * cells["1"]["drafts"] > 0
    assert cells["4"]["drafts"] <= cells["4"]["draft_tokens"] < 3 * cells["4"]["drafts"]
    for cell in cells.values():  # the partial draft: its first position, whatever k
        assert cell["mean_acceptance_length"] == pytest.approx(2.0)


def test_speedups_are_ratios_of_measured_rates(bench):
    result, _, _ = bench
    cols = result["columns"]
    # On CPU the servers run side by side (the default), here two at a time beside the k=0 server:
    # each column's speed-ups are against the k=0 cells measured alongside it; the first group's
    # are the k=0 column itself, the second group has its own.
    servers = result["servers"]
    assert servers["mode"] == "interleaved" and servers["together"] == 2
    assert servers["repeat"] == "second k=0 server"  # every cell follows another server's
    assert servers["groups"] == [["k=1", "k=3"], ["k=0 (speculative engine)"]]
    assert cols["k=1"]["reference"] == cols["k=3"]["reference"] == cols["k=0"]["cells"]
    second = cols["k=0 (speculative engine)"]["reference"]
    assert {split: sorted(cells) for split, cells in second.items()} == {
        split: sorted(cells) for split, cells in cols["k=0"]["cells"].items()}
    for name, col in cols.items():
        for split, cells in col["cells"].items():
            for c, cell in cells.items():
                base = (col["reference"] if name != "k=0" else col["cells"])[split][c]
                assert cell["speedup"] == pytest.approx(median_ratio(cell, base))
                assert cell["output_tokens_per_s"] == pytest.approx(cell["output_tokens"] / cell["wall_s"])
    before = cols["schedule"]["reference"]["judge"]  # the k=0 server's turn before the schedule's, the repeat's after
    assert cols["k=0 (repeat)"]["reference"]["judge"] == cols["config's schedule"]["reference"]["judge"] == before
    # the budget's column drafts under the config's schedule opened up by one token: k=4, then k=2
    assert cols["confidence budget"]["reference"]["judge"] == before
    assert result["derived"]["budget_schedule"] == [[1, 1, 4], [2, 128, 2]]
    assert servers["final"] == ["schedule", "confidence budget", "config's schedule", "k=0 (repeat)"]
    for c, v in result["verdict"].items():
        assert v["schedule_speedup"] == pytest.approx(median_ratio(cols["schedule"]["cells"]["judge"][c], before[c]))
        assert v["config_speedup"] == pytest.approx(
            median_ratio(cols["config's schedule"]["cells"]["judge"][c], before[c]))
        assert v["config_meets_target"] is (None if v["target"] is None else v["config_speedup"] >= v["target"])
        pairs = zip(cols["k=0 (repeat)"]["cells"]["judge"][c]["rounds_output_tokens_per_s"],
                    before[c]["rounds_output_tokens_per_s"])
        assert v["noise"] == pytest.approx(statistics.median(abs(a - b) / ((a + b) / 2) for a, b in pairs))


def test_schedule_is_derived_written_and_passes_preflight(bench):
    result, out, stdout = bench
    derived = result["derived"]
    assert sorted(map(int, derived["choice"])) == CONCURRENCY
    assert derived["schedule"][0][0] == 1 and derived["schedule"][-1][1] >= 128
    written = yaml.safe_load((out / "config-with-schedule.yaml").read_text())
    top = max(k for _, _, k in derived["schedule"])
    assert written["speculative"]["enabled"] is (top > 0)
    check = subprocess.run([sys.executable, "-m", "dynamo_spec", "check", "--config",
                            str(out / "config-with-schedule.yaml")], capture_output=True, text=True)
    assert check.returncode == 0, check.stderr
    assert result["recommendation"] in stdout and "## Verdict" in stdout
    assert set(result["k0_cost"]) == {str(c) for c in CONCURRENCY}
    assert set(derived["close_calls"]) == {str(c) for c in CONCURRENCY}  # the noise is measured at each
    assert "within the noise of the chosen k" in stdout
    assert f"The config's own schedule {CONFIGURED}" in result["recommendation"]
    assert "config's schedule vs k=0" in stdout
    assert (out / "bench.md").read_text().startswith("# dynamo-spec bench")
    for png in ("throughput.png", "acceptance_by_position.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG"
