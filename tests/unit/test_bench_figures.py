"""The bench's figures from plain data: percentiles, acceptance deltas, the derived schedule, the verdict."""

from __future__ import annotations

import pytest

from dynamo_spec.bench import choose, render, speedups, summary
from dynamo_spec.bench import verdict as verdicts
from dynamo_spec.bench.load import CellResult, RequestResult
from dynamo_spec.bench.prompts import PromptError, load_sets, read_prompts, split
from dynamo_spec.config.schedule import problems as check_schedule

pytestmark = pytest.mark.unit


def test_percentiles_interpolate_like_numpy():
    p = summary.percentiles([1.0, 2.0, 3.0, 4.0])
    assert p["p50"] == 2.5 and p["mean"] == 2.5
    assert p["p90"] == pytest.approx(3.7) and p["p99"] == pytest.approx(3.97)
    assert summary.percentiles([])["p50"] is None


def test_spec_delta_uses_vllms_definitions():
    before = {"drafts": 10, "draft_tokens": 30, "accepted": 12, "pos:0": 8, "pos:1": 3, "pos:2": 1}
    after = {"drafts": 30, "draft_tokens": 90, "accepted": 42, "pos:0": 26, "pos:1": 12, "pos:2": 4}
    d = summary.spec_delta(before, after)
    assert (d["drafts"], d["draft_tokens"], d["accepted_tokens"]) == (20, 60, 30)
    assert d["acceptance_rate"] == 0.5
    assert d["mean_acceptance_length"] == 2.5
    assert d["per_position_acceptance"] == [0.9, 0.45, 0.15]
    assert summary.spec_delta({}, {})["acceptance_rate"] is None


def columns(rates: dict[str, dict[int, float]], split_: str = "derive") -> dict:
    return {name: {"cells": {split_: {str(c): {"output_tokens_per_s": r} for c, r in by_c.items()}}}
            for name, by_c in rates.items()}


def test_choose_k_picks_the_best_k_and_zero_where_speculation_loses():
    cols = columns({"k=0": {1: 30, 4: 100, 32: 400}, "k=2": {1: 40, 4: 110, 32: 300},
                    "k=3": {1: 42, 4: 102, 32: 280}})
    assert choose.choose_k(cols, [0, 2, 3], [1, 4, 32], margin=0.03) == {1: 3, 4: 2, 32: 0}
    # within the margin k=0 stays
    assert choose.choose_k(cols, [0, 2, 3], [1, 4, 32], margin=0.15) == {1: 3, 4: 0, 32: 0}


def test_choose_k_measures_k_against_the_k0_a_schedule_really_serves():
    # At c=8 k=2 loses 2 % to an engine without speculation but beats the speculative
    # engine at k=0 (which pays for the draft's KV pass) by 5 %: the schedule should draft there.
    cols = columns({"k=0": {8: 100, 32: 400}, "k=2": {8: 98, 32: 300},
                    speedups.SPEC_K0: {8: 93, 32: 370}})
    assert choose.choose_k(cols, [0, 2], [8, 32], margin=0.03) == {8: 2, 32: 0}
    assert choose.k0_cost(cols, [8, 32]) == {8: pytest.approx(0.07), 32: pytest.approx(0.075)}


def test_choose_k_never_rises_with_concurrency():
    # A noisy derive split: k=1 wins at 2 and from 8 up, every k loses at 4. Per
    # concurrency that is k=0 at 4 between k=1 at 2 and 8, a schedule no host would want; the
    # choice that does not rise takes k=1 at 4 too (0.95 there, against 1.15 and 1.10 gained after)
    cols = columns({"k=0": {1: 30, 2: 50, 4: 100, 8: 150, 16: 200},
                    "k=1": {1: 36, 2: 60, 4: 95, 8: 172, 16: 220},
                    "k=4": {1: 40, 2: 45, 4: 80, 8: 120, 16: 150}})
    assert choose.choose_k(cols, [0, 1, 4], [1, 2, 4, 8, 16], margin=0.03) == {1: 4, 2: 1, 4: 1, 8: 1, 16: 1}
    # where what comes after gains less than the dip costs, k=0 from the dip on
    cols["k=1"]["cells"]["derive"]["4"]["output_tokens_per_s"] = 70
    cols["k=1"]["cells"]["derive"]["16"]["output_tokens_per_s"] = 150
    assert choose.choose_k(cols, [0, 1, 4], [1, 2, 4, 8, 16], margin=0.03) == {1: 4, 2: 1, 4: 0, 8: 0, 16: 0}


def test_choose_k_is_the_best_sequence_that_does_not_rise():
    import itertools
    import math
    import random

    rng = random.Random(7)
    ks, cs = [0, 1, 2, 3], [1, 2, 4, 8, 16]
    for _ in range(200):
        rates = {f"k={k}": {c: rng.uniform(50, 150) for c in cs} for k in ks}
        cols = columns(rates)
        choice = choose.choose_k(cols, ks, cs, margin=0.03)
        picked = [choice[c] for c in cs]
        assert picked == sorted(picked, reverse=True)

        def score(seq, rates=rates):
            return sum(math.log(rates[f"k={k}"][c] / rates["k=0"][c] * (1.03 if k == 0 else 1))
                       for c, k in zip(cs, seq))
        falling = [s for s in itertools.product(ks, repeat=len(cs)) if list(s) == sorted(s, reverse=True)]
        assert score(picked) == pytest.approx(max(score(s) for s in falling))


def test_close_calls_name_the_k_within_the_noise_of_the_chosen_one():
    cols = columns({"k=0": {1: 30, 4: 100, 32: 400}, "k=2": {1: 40, 4: 110, 32: 300},
                    "k=3": {1: 42, 4: 102, 32: 280}, speedups.SPEC_K0: {1: 30, 4: 100, 32: 380}})
    choice = choose.choose_k(cols, [0, 2, 3], [1, 4, 32], margin=0.03)
    assert choice == {1: 3, 4: 2, 32: 0}
    # c=1: k=2 (1.33x) within 6 % of k=3 (1.40x), k=0 not; c=4: with 2 % noise k=3 (1.02x) is
    # not within reach of k=2 (1.10x); c=32: k=0 is the speculative engine's 0.95x, k=2 0.75x
    close = choose.close_calls(cols, choice, [0, 2, 3], {"1": 0.06, "4": 0.02, "32": 0.30})
    assert close == {1: [2], 4: [], 32: [2, 3]}
    assert choose.close_calls(cols, choice, [0, 2, 3], {"1": 0.06}) == {1: [2]}  # no noise figure, no entry


def test_schedule_ranges_cover_every_batch_size_and_pass_preflight():
    schedule = choose.schedule_from_choice({1: 3, 2: 3, 4: 2, 8: 2, 16: 0, 32: 0}, max_batch=128)
    assert schedule == [[1, 2, 3], [3, 11, 2], [12, 128, 0]]  # split at the geometric means (2.8, 11.3)
    assert check_schedule(schedule, k=3, max_num_seqs=128) == []
    assert choose.schedule_from_choice({1: 0}, 64) == [[1, 64, 0]]


def test_speedup_is_the_ratio_of_measured_rates_and_noise_uses_the_repeat():
    cols = columns({"k=0": {1: 30, 4: 100}, "k=3": {1: 45, 4: 90}, "k=0 (repeat)": {1: 33, 4: 100}}, "judge")
    speedups.add_speedups(cols)
    assert cols["k=3"]["cells"]["judge"]["1"]["speedup"] == 1.5
    assert cols["k=3"]["cells"]["judge"]["4"]["speedup"] == 0.9
    assert speedups.noise(cols) == {"1": pytest.approx(3 / 31.5), "4": 0.0}


def test_verdict_compares_the_schedule_with_k0_and_the_best_fixed_k():
    cols = columns({"k=0": {1: 30, 4: 100}, "k=3": {1: 45, 4: 90}, "schedule": {1: 44, 4: 99},
                    "k=0 (repeat)": {1: 30, 4: 102}}, "judge")
    v = verdicts.verdict(cols, [1, 4], [0, 3])
    assert v["1"]["best_fixed_k"] == 3 and v["1"]["schedule_speedup"] == pytest.approx(44 / 30)
    assert v["1"]["meets_target"] is True and v["1"]["within_noise_of_best"] is False  # noise 0 at c=1
    assert v["4"]["best_fixed_k"] == 0 and v["4"]["schedule_speedup"] == pytest.approx(0.99)
    assert v["4"]["meets_target"] is True and v["4"]["within_noise_of_best"] is True  # 0.99 >= 1 - 2 %


def test_verdict_judges_the_configs_own_schedule_beside_the_derived_one():
    cols = columns({"k=0": {1: 30, 4: 100, 16: 200}, "k=3": {1: 45, 4: 90, 16: 150},
                    "schedule": {1: 44, 4: 99, 16: 199}, speedups.CONFIGURED: {1: 42, 4: 96, 16: 180},
                    "k=0 (repeat)": {1: 30, 4: 102, 16: 200}}, "judge")
    v = verdicts.verdict(cols, [1, 4, 16], [0, 3])
    assert v["1"]["config_speedup"] == pytest.approx(1.4) and v["1"]["config_meets_target"] is True
    assert v["1"]["config_vs_best_fixed"] == pytest.approx(42 / 45)
    assert v["4"]["config_speedup"] == pytest.approx(0.96) and v["4"]["config_meets_target"] is False
    assert v["4"]["config_within_noise_of_best"] is False  # 0.96 < 1 - 2 %
    assert v["16"]["config_meets_target"] is False and v["16"]["meets_target"] is True
    text = verdicts.recommendation({1: 3, 4: 0, 16: 0}, [[1, 2, 3], [3, 128, 0]],
                                 configured=[[1, 3, 3], [4, 128, 0]], rows=v)
    assert "use the derived schedule [[1, 2, 3], [3, 128, 0]]." in text
    assert text.endswith("The config's own schedule [[1, 3, 3], [4, 128, 0]] missed the targets at "
                         "concurrency 4 (0.96x, target 0.97x), 16 (0.90x, target 0.97x). The derived one served "
                         "more than it beyond this run's noise at concurrency 1, 4, 16.")
    # The config's own as good as the derived one (c=1, the same figure), within the
    # noise (c=4) or better (c=16): keep it.
    rows = {"1": {**v["1"], "config_speedup": 44 / 30}, "4": {**v["4"], "config_speedup": 0.98},
            "16": {**v["16"], "config_speedup": 1.05}}
    assert verdicts.derived_vs_configured(rows) == ([], ["16"])  # 0.98 within c=4's 2 % noise of 0.99
    text = verdicts.recommendation({1: 3, 4: 0, 16: 0}, [[1, 2, 3], [3, 128, 0]],
                                 configured=[[1, 3, 3], [4, 128, 0]], rows=rows)
    assert "served no more than the config's own beyond this run's noise at any concurrency" in text
    assert "keep the config's" in text and "use the derived" not in text
    assert "config" not in verdicts.recommendation({1: 3}, [[1, 128, 3]], configured=[[1, 128, 3]], rows={})
    # not measured (no column): no config_* figures
    assert "config_speedup" not in verdicts.verdict(columns({"k=0": {1: 30}}, "judge"), [1], [0])["1"]


def with_reference(cols: dict, name: str, rates: dict[int, float], split_: str) -> dict:
    cols[name]["reference"] = {split_: {str(c): {"output_tokens_per_s": r} for c, r in rates.items()}}
    return cols


def test_interleaved_columns_compare_by_their_own_k0_reference():
    # Two groups of servers on a host that slowed down between them: k=3 ran in the slow
    # group. By raw rates k=2 wins at c=1 and 4; against the k=0 measured alongside each, k=3 wins
    # at c=1 and at c=4 k=2 (0.95x) does not beat the speculative engine at k=0 (0.94x) by 3 %.
    cols = columns({"k=0": {1: 30, 4: 100}, "k=2": {1: 40, 4: 95}, "k=3": {1: 36, 4: 63},
                    speedups.SPEC_K0: {1: 19, 4: 66}})
    with_reference(cols, "k=2", {1: 30, 4: 100}, "derive")
    with_reference(cols, "k=3", {1: 20, 4: 70}, "derive")
    with_reference(cols, speedups.SPEC_K0, {1: 20, 4: 70}, "derive")
    speedups.add_speedups(cols)
    assert cols["k=3"]["cells"]["derive"]["1"]["speedup"] == pytest.approx(1.8)
    assert choose.choose_k(cols, [0, 2, 3], [1, 4], margin=0.03) == {1: 3, 4: 0}
    assert choose.k0_cost(cols, [1, 4]) == {1: pytest.approx(0.05), 4: pytest.approx(1 - 66 / 70)}


def test_interleaved_verdict_and_noise_use_the_k0_cells_around_the_schedule():
    cols = columns({"k=0": {1: 30}, "k=2": {1: 40}, "schedule": {1: 26}, "k=0 (repeat)": {1: 21}}, "judge")
    with_reference(cols, "k=2", {1: 30}, "judge")
    with_reference(cols, "schedule", {1: 20}, "judge")  # the host was slower when the schedule ran
    with_reference(cols, "k=0 (repeat)", {1: 20}, "judge")
    v = verdicts.verdict(cols, [1], [0, 2])["1"]
    assert v["schedule_speedup"] == pytest.approx(1.3) and v["meets_target"] is True
    assert v["best_fixed_k"] == 2 and v["schedule_vs_best_fixed"] == pytest.approx(1.3 / (40 / 30))
    assert v["noise"] == pytest.approx(1 / 20.5) and v["within_noise_of_best"] is True


def _round(tokens_per_request: int, requests: int, wall: float, drafts: int = 0, accepted: int = 0) -> tuple:
    results = [RequestResult(ok=True, completion_tokens=tokens_per_request, ttft=0.1, e2e=wall / requests)
               for _ in range(requests)]
    return CellResult(concurrency=1, wall=wall, requests=results), {
        "drafts": drafts, "draft_tokens": 2 * drafts, "accepted": accepted, "pos:0": accepted, "pos:1": 0}


def test_rounds_pool_requests_and_counters_and_keep_each_rounds_rate():
    cell = summary.summarize_rounds([_round(10, 4, 2.0, drafts=20, accepted=10), _round(10, 4, 8.0, drafts=20,
                                                                                       accepted=14)])
    assert cell["requests"] == 8 and cell["output_tokens"] == 80 and cell["wall_s"] == 10.0
    assert cell["output_tokens_per_s"] == 8.0  # all tokens over all rounds' wall time
    assert cell["rounds_output_tokens_per_s"] == [20.0, 5.0]
    assert cell["drafts"] == 40 and cell["accepted_tokens"] == 24 and cell["draft_tokens"] == 80
    assert cell["mean_acceptance_length"] == pytest.approx(1.6) and cell["per_position_acceptance"] == [0.6, 0.0]


def test_in_rounds_speedups_and_noise_are_medians_of_per_round_ratios():
    # k=2 beside k=0 in three rounds; the host halved its speed in round 2, and round 3 was disturbed
    # on k=2's turn: the pooled rates say 1.10x, each round's pair says 1.25x, 1.25x, 0.5x.
    cols = {"k=0": {"cells": {"judge": {"1": {"output_tokens_per_s": 20.0,
                                              "rounds_output_tokens_per_s": [20.0, 10.0, 30.0]}}}},
            "k=2": {"cells": {"judge": {"1": {"output_tokens_per_s": 22.0,
                                              "rounds_output_tokens_per_s": [25.0, 12.5, 15.0]}}}},
            "k=0 (repeat)": {"cells": {"judge": {"1": {"output_tokens_per_s": 21.0,
                                                       "rounds_output_tokens_per_s": [21.0, 10.0, 33.0]}}}}}
    cols["k=2"]["reference"] = cols["k=0 (repeat)"]["reference"] = cols["k=0"]["cells"]
    assert speedups.speedup(cols, "k=2", "judge", 1) == pytest.approx(1.25)
    # each round's pair 21/20, 10/10, 33/30 apart by |a - b| / mean: 4.9 %, 0 %, 9.5 %; the median
    assert speedups.noise(cols) == {"1": pytest.approx(1 / 20.5)}
    # the median ratio (1.05x) would say the same here; not when the rounds stray both ways
    cols["k=0 (repeat)"]["cells"]["judge"]["1"]["rounds_output_tokens_per_s"] = [19.8, 11.3, 26.7]
    assert speedups.speedup(cols, "k=0 (repeat)", "judge", 1) == pytest.approx(0.99)
    assert speedups.noise(cols) == {"1": pytest.approx(3.3 / 28.35)}  # 1 %, 12.2 %, 11.6 %: the median 11.6 %
    # one round (or unequal rounds): the ratio of the rates, as before
    one = {name: {"cells": {"judge": {"1": {**cell["cells"]["judge"]["1"], "rounds_output_tokens_per_s": [1.0]}}}}
           for name, cell in cols.items()}
    assert speedups.speedup(one, "k=2", "judge", 1) == pytest.approx(1.1)


def test_tables_show_each_k0_reference_above_the_columns_measured_with_it():
    cols = columns({"k=0": {1: 30}, "k=2": {1: 40}, "k=3": {1: 21}, "schedule": {1: 26}}, "judge")
    cols["k=2"]["reference"] = cols["k=0"]["cells"]  # measured with the k=0 column (its group): no extra row
    with_reference(cols, "k=3", {1: 20}, "judge")
    with_reference(cols, "schedule", {1: 20}, "judge")  # the same cells as k=3's: shown once
    cols["schedule"]["reference"] = cols["k=3"]["reference"]
    speedups.add_speedups(cols)
    assert render.rate_rows(cols, "judge", [1]) == [
        "| k=0 | 30.0 (1.00x) |", "| k=2 | 40.0 (1.33x) |", "| k=0 (measured with k=3) | 20.0 (1.00x) |",
        "| k=3 | 21.0 (1.05x) |", "| schedule | 26.0 (1.30x) |"]


def test_servers_side_by_side_only_as_many_as_free_memory_holds():
    from dynamo_spec.bench.managed_server import servers_that_fit

    assert servers_that_fit(1 << 50, 5) == 0  # not one more: the bench runs one server at a time
    assert servers_that_fit(1 << 20, 5) == 5  # 1 MiB servers: all of them


def test_recommendation_says_where_speculation_does_not_pay():
    assert "does not pay" in verdicts.recommendation({1: 0, 4: 0}, [[1, 128, 0]])
    text = verdicts.recommendation({1: 3, 32: 0}, [[1, 5, 3], [6, 128, 0]])
    assert "pays at concurrency 1" in text and "does not at 32" in text
    assert "speculative.enabled: false" not in text
    text = verdicts.recommendation({1: 3, 32: 0}, [[1, 5, 3], [6, 128, 0]], cost={1: 0.02, 32: 0.075})
    assert "serves 8 % less" in text and "speculative.enabled: false" in text
    text = verdicts.recommendation({1: 3, 16: 0, 32: 0}, [[1, 5, 3], [6, 128, 0]], cost={16: -0.01, 32: 0.04})
    assert "serves up to 4 % less" in text


def test_shipped_prompt_sets_split_apart(tmp_path):
    sets = load_sets()
    assert set(sets) == {"chat", "code", "summarize"}
    derive, judge = split(sets)
    assert len(derive) + len(judge) == sum(len(v) for v in sets.values())
    assert not {str(i) for i in derive} & {str(i) for i in judge}


def test_prompt_files_accept_messages_or_prompt_and_reject_the_rest(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "hi"}\n\n{"messages": [{"role": "user", "content": "yo"}]}\n')
    assert read_prompts(path)[0] == {"messages": [{"role": "user", "content": "hi"}]}
    path.write_text('{"prompt": "hi"}\n{"text": "no"}\n')
    with pytest.raises(PromptError, match=r"p.jsonl:2: expected"):
        read_prompts(path)


def test_written_schedule_config_keeps_its_paths_and_passes_preflight(repo_root, tmp_path):
    import yaml

    from dynamo_spec.bench.schedule_config import write_schedule_config
    from dynamo_spec.config.loader import load_settings

    # The shipped CPU config with one schedule for every host (paths relative to the file).
    data = yaml.safe_load((repo_root / "configs" / "smollm2-135m-instruct-eagle3-cpu.yaml").read_text())
    data["speculative"]["num_speculative_tokens_per_batch_size"] = [[1, 2, 4], [3, 128, 0]]
    original = tmp_path / "configs" / "one-schedule.yaml"
    original.parent.mkdir()
    original.write_text(yaml.safe_dump(data))
    schedule = [[1, 2, 2], [3, 128, 0]]
    written = write_schedule_config(original, schedule, tmp_path / "deep" / "config-with-schedule.yaml", "float32")
    before = load_settings(original, [], {}).settings
    after = load_settings(written, [], {}).settings
    assert after.engine.model == before.engine.model and after.speculative.model == before.speculative.model
    assert after.speculative.num_speculative_tokens == 2
    assert after.speculative.num_speculative_tokens_per_batch_size == [(1, 2, 2), (3, 128, 0)]
    assert check_schedule(schedule, 2, 128) == []
    # One k everywhere needs no schedule; k=0 everywhere turns speculation off.
    assert "num_speculative_tokens_per_batch_size" not in load_settings(
        write_schedule_config(original, [[1, 128, 2]], tmp_path / "one.yaml"), [], {}).settings.speculative.model_fields_set
    assert load_settings(write_schedule_config(original, [[1, 128, 0]], tmp_path / "off.yaml"), [], {}
                         ).settings.speculative.enabled is False


def test_written_schedule_replaces_only_this_hosts_entry_of_a_schedule_per_dtype(repo_root, tmp_path):
    from dynamo_spec.bench.schedule_config import write_schedule_config
    from dynamo_spec.config.loader import load_settings

    shipped = repo_root / "configs" / "smollm2-135m-instruct-eagle3-cpu.yaml"
    entries = load_settings(shipped, [], {}).settings.speculative.num_speculative_tokens_per_batch_size
    assert isinstance(entries, dict) and "float32" in entries
    written = write_schedule_config(shipped, [[1, 128, 0]], tmp_path / "w.yaml", "float32")
    assert "(float32)" in written.read_text().splitlines()[0]
    spec = load_settings(written, [], {}).settings.speculative
    # Speculation stays on for the other hosts; the top k covers every entry.
    assert spec.enabled and spec.num_speculative_tokens_per_batch_size == {**entries, "float32": [(1, 128, 0)]}
    assert spec.num_speculative_tokens == max(k for entry in entries.values() if entry is not entries["float32"]
                                              for _, _, k in entry)
    # On a host without a dtype key of its own (e.g. auto on a GPU) the derived schedule is the default.
    assert load_settings(write_schedule_config(shipped, [[1, 128, 1]], tmp_path / "g.yaml", "auto"), [], {}
                         ).settings.speculative.num_speculative_tokens_per_batch_size["default"] == [(1, 128, 1)]


def test_reported_preloads_carry_no_local_paths(monkeypatch):
    import os
    import sys

    from dynamo_spec.bench.host_report import engine_ld_preload

    monkeypatch.setenv("LD_PRELOAD", os.path.join(sys.prefix, "lib", "libiomp5.so") + ":/usr/lib/libtcmalloc.so.4")
    assert engine_ld_preload(False) == "<venv>/lib/libiomp5.so:/usr/lib/libtcmalloc.so.4"


def test_resolution_reads_the_noise_as_a_standard_deviation_and_counts_the_rounds():
    import random
    import statistics

    rng = random.Random(7)
    s_true = 0.05  # one round's speed-up: the ratio of two rates, each straying by s_true / sqrt(2)

    def rate() -> float:
        return 1 + rng.gauss(0, s_true / 2 ** 0.5)

    pairs = [(rate(), rate()) for _ in range(4000)]
    noise = statistics.median(abs(a - b) / ((a + b) / 2) for a, b in pairs)  # as speedups.noise takes it
    res = speedups.resolution(noise, 1, 0.03)
    assert res["round_sd"] == pytest.approx(s_true, rel=0.06)
    assert res["resolves"] == pytest.approx(2 * s_true, rel=0.06)
    n = res["rounds_needed"]
    assert 12 <= n <= 24  # 2 x 1.253 x 0.05 / sqrt(n) <= 0.03
    # the median of n rounds' ratios of identical servers stays within the 3 % in about 95 % of runs
    inside = sum(abs(statistics.median(rate() / rate() for _ in range(n)) - 1) <= 0.03 for _ in range(3000))
    assert 0.92 <= inside / 3000 <= 0.985
    assert speedups.resolution(None, 1, 0.03) is None
    assert speedups.resolution(0.005, 1, 0.03)["rounds_needed"] == 1


def test_resolution_text_advises_rounds_only_where_they_are_practical():
    near = render.resolution_text(speedups.resolution(0.018, 1, 0.03), 1)
    assert "--rounds 5" in near
    far = render.resolution_text(speedups.resolution(0.09, 1, 0.03), 1)
    assert "--rounds" not in far and "quieter" in far
    assert "within the 3% margin" in render.resolution_text(speedups.resolution(0.005, 1, 0.03), 1)
    assert render.resolution_text(None, 1) == ""


def parse_bench(*argv: str):
    from dynamo_spec.cli import build_parser

    args, extra = build_parser().parse_known_args(["bench", *argv])
    args.overrides = extra
    return args


def test_options_are_read_from_the_flags_in_one_place():
    from dynamo_spec.bench.options import BenchOptions

    options = BenchOptions.from_args(parse_bench("--config", "c.yaml", "--k", "3,1", "--concurrency", "4,1,4",
                                                 "--no-plots", "--speculative.method", "eagle3"))
    assert options.ks == (0, 1, 3) and options.concurrencies == (1, 4)  # k=0 always: every speed-up's reference
    assert options.overrides == ("--speculative.method", "eagle3") and not options.plots
    assert options.targets == verdicts.Targets() and options.together is None and options.rounds == 1
    assert options.cell_requests(1) == 8 and options.cell_requests(4) == 16  # --requests 8, --per-client 4
    off = BenchOptions.from_args(parse_bench("--url", "http://h:1", "--target-speedup", "0", "--target-floor", "0.9",
                                             "--target-floor-from", "8"))
    assert off.targets == verdicts.Targets(speedup=None, floor=0.9, floor_from=8)
    for argv, message in [((), "give --config"), (("--config", "c", "--url", "u"), "give --config"),
                          (("--config", "c", "--rounds", "0"), "--rounds"), (("--config", "c", "--together", "-1"),
                                                                            "--together"),
                          (("--config", "c", "--k", "a"), "--k"), (("--config", "c", "--concurrency", "0"),
                                                                   "--concurrency")]:
        with pytest.raises(SystemExit, match=message):
            BenchOptions.from_args(parse_bench(*argv))


def test_verdict_targets_are_options():
    cols = columns({"k=0": {1: 30, 2: 40, 4: 100, 8: 100}, "schedule": {1: 42, 2: 44, 4: 96, 8: 96}}, "judge")
    v = verdicts.verdict(cols, [1, 2, 4, 8], [0])
    assert [v[c]["target"] for c in ("1", "2", "4", "8")] == [1.3, None, 0.97, 0.97]
    assert [v[c]["meets_target"] for c in ("1", "2", "4", "8")] == [True, None, False, False]
    v = verdicts.verdict(cols, [1, 2, 4, 8], [0], verdicts.Targets(speedup=1.5, floor=0.95, floor_from=8))
    assert [v[c]["target"] for c in ("1", "2", "4", "8")] == [1.5, None, None, 0.95]
    assert [v[c]["meets_target"] for c in ("1", "2", "4", "8")] == [False, None, None, True]
    assert verdicts.verdict(cols, [1], [0], verdicts.Targets(speedup=None))["1"]["meets_target"] is None


def test_server_overrides_set_k_and_the_schedule_setting():
    from dynamo_spec.bench import phases
    from dynamo_spec.config import schedule as schedules

    assert phases.overrides_for(0) == ["--speculative.enabled", "false"]
    on = phases.overrides_for(2, [[1, 4, 2], [5, 128, 0]])
    assert on[on.index("--" + schedules.K_FIELD) + 1] == "2"
    assert on[on.index("--" + schedules.FIELD) + 1] == "[[1, 4, 2], [5, 128, 0]]"
    assert phases.schedule_overrides([[1, 128, 0]]) == phases.overrides_for(0)
    assert phases.schedule_overrides([[1, 2, 3], [3, 64, 1]]) == phases.overrides_for(3, [[1, 2, 3], [3, 64, 1]])
    first = phases.first_phase((0, 1, 3), 64)
    assert [name for name, _ in first] == ["k=1", "k=3", speedups.SPEC_K0]
    assert first[-1][1] == phases.overrides_for(3, [[1, 64, 0]])  # speculation on, never a draft token


def _cells(rate: float, splits=("derive", "judge"), cs=(1, 4)) -> dict:
    """Cells of a column whose every concurrency served `rate` tokens/s (10 requests of 10 tokens)."""
    return {split: {str(c): summary.summarize_rounds([_round(10, 10, 100 / rate)]) for c in cs} for split in splits}


def test_the_result_is_built_from_the_phases_values_and_renders_again(tmp_path):
    import json

    from dynamo_spec.bench.options import BenchOptions
    from dynamo_spec.bench.result import Column, Compared, Derived, Judged, SideBySide, assemble

    options = BenchOptions.from_args(parse_bench("--config", "c.yaml", "--k", "0,2", "--concurrency", "1,4"))
    header = {"started": "2030-01-01T00:00:00", "command": "dynamo-spec bench --config c.yaml",
              "settings": {"model": "m", "concurrency": [1, 4], "max_tokens": 64, "temperature": 0.0, "requests": 8,
                           "per_client": 4, "rounds": 1, "config_schedule": [[1, 1, 2], [2, 128, 0]]},
              "host": {"cpu_model": "cpu", "cores": 2, "isa": "avx2", "dtype": "bfloat16", "vllm": "0.32.0",
                       "platform": "CpuPlatform", "ld_preload": ""}}
    baseline = _cells(100)
    compared = Compared({"k=0": Column(["--speculative.enabled", "false"], 30.0, baseline),
                         "k=2": Column(["--speculative.enabled", "true"], 31.0, _cells(140), reference=baseline)},
                        SideBySide(together=1, groups=[["k=2"]], reference_rss_gib=1.5))
    before = _cells(100, splits=("judge",))
    judged = Judged({speedups.SCHEDULE: Column([], 32.0, _cells(135, ("judge",)), reference=before),
                     speedups.CONFIGURED: Column([], 33.0, _cells(120, ("judge",)), reference=before),
                     speedups.REPEAT: Column([], 34.0, _cells(102, ("judge",)), reference=before)},
                    repeat="second k=0 server", final=[speedups.SCHEDULE, speedups.CONFIGURED, speedups.REPEAT])
    derived = Derived(choice={1: 2, 4: 2}, schedule=[[1, 128, 2]], margin=0.03, config_file="c-with-schedule.yaml")
    result = assemble(header, compared, derived, judged, options)
    assert list(result) == ["started", "command", "settings", "host", "servers", "columns", "derived", "verdict",
                            "noise_median", "resolution", "k0_cost", "recommendation", "finished"]
    assert result["servers"] == {"mode": "interleaved", "together": 1, "groups": [["k=2"]], "reference_rss_gib": 1.5,
                                 "repeat": "second k=0 server", "final": list(judged.final)}
    assert list(result["columns"]) == ["k=0", "k=2", speedups.SCHEDULE, speedups.CONFIGURED, speedups.REPEAT]
    assert result["columns"]["k=2"]["cells"]["derive"]["4"]["speedup"] == pytest.approx(1.4)
    assert "reference" not in result["columns"]["k=0"]
    assert result["derived"] == {"choice": {"1": 2, "4": 2}, "schedule": [[1, 128, 2]], "margin": 0.03,
                                 "config_file": "c-with-schedule.yaml", "close_calls": {"1": [], "4": []},
                                 "draft_token_cost": None, "budget_schedule": None}
    assert result["verdict"]["1"]["schedule_speedup"] == pytest.approx(1.35)
    assert result["verdict"]["1"]["config_speedup"] == pytest.approx(1.2)
    assert result["noise_median"] == pytest.approx(2 / 101)
    assert "use the derived schedule [[1, 128, 2]]" in result["recommendation"]
    text = render.markdown(result)
    assert text.startswith("# dynamo-spec bench: m") and "## Verdict" in text and "| 1 | 1.35x | >= 1.3x: yes |" in text
    # a saved bench.json renders to the same Markdown
    saved = tmp_path / "bench.json"
    saved.write_text(json.dumps(result, indent=2))
    assert render.markdown(json.loads(saved.read_text())) == text


def test_resolution_text_names_the_packaged_host_check():
    far = render.resolution_text(speedups.resolution(0.09, 1, 0.03), 1)
    assert "dynamo-spec bench --host-check" in far and "benchmarks" not in far


def test_url_mode_measures_each_concurrency_and_writes_its_json(monkeypatch, tmp_path, capsys):
    import json

    from dynamo_spec.bench import url
    from dynamo_spec.bench.options import BenchOptions

    class Models:
        def json(self):
            return {"data": [{"id": "served"}]}

    measured = []

    async def fake_measure(base, model, items, c, options, bar):
        measured.append((base, model, c, options.rounds))
        return summary.summarize_rounds([_round(10, 4, 2.0)])

    monkeypatch.setattr(url.requests, "get", lambda address, timeout: Models())
    monkeypatch.setattr(url, "measure", fake_measure)
    options = BenchOptions.from_args(parse_bench("--url", "http://h:1", "--concurrency", "1,2", "--out", str(tmp_path)))
    assert url.run_url(options) == 0
    assert measured == [("http://h:1", "served", 1, 1), ("http://h:1", "served", 2, 1)]
    saved = json.loads((tmp_path / "bench-url.json").read_text())
    assert saved["model"] == "served" and list(saved["cells"]) == ["1", "2"]
    assert saved["command"].split()[0] != "" and "/" not in saved["command"].split()[0]  # the program by name only
    assert "| 1 | 20.0 | 2.00 | 100 |" in capsys.readouterr().out


def test_break_even_rate_is_the_draft_token_cost_the_speedup_implies():
    from dynamo_spec.bench.speedups import break_even_rate

    # k=3, a draft token costs c = 0.1 of a plain step, rate r = 0.3: L = 1.9, speed-up 1.9 / 1.3.
    cell = {"acceptance_rate": 0.3, "mean_acceptance_length": 1.9, "speedup": 1.9 / 1.3}
    assert break_even_rate(cell) == pytest.approx(0.1)
    # Speculation that just pays has a break-even rate equal to its acceptance rate.
    assert break_even_rate({**cell, "speedup": 1.0}) == pytest.approx(0.3)
    for missing in ({"acceptance_rate": None}, {"mean_acceptance_length": 1.0}, {"speedup": None}):
        assert break_even_rate({**cell, **missing}) is None


def test_the_cost_of_a_verified_draft_token_is_k1_against_the_speculative_engine_at_k0():
    from dynamo_spec.bench.phases import budget_schedule, draft_token_cost
    from dynamo_spec.bench.speedups import SPEC_K0, verify_cost

    def column(rates: dict[int, float], length: float | None = None) -> dict:
        return {"cells": {"derive": {str(c): {"output_tokens_per_s": r, "mean_acceptance_length": length}
                                     for c, r in rates.items()}}}

    # k=1 yields L = 1.5 tokens a step; against the speculative engine at k=0 it serves 1.25x: a step
    # drafting one token costs 1.5 / 1.25 = 1.2 plain steps, so verifying the token costs 0.2.
    columns = {"k=0": column({1: 100, 4: 300, 8: 500}), SPEC_K0: column({1: 100, 4: 270, 8: 450}),
               "k=1": column({1: 125, 4: 270 * 1.5 / 1.1, 8: 450 * 1.5 / 1.6}, length=1.5)}
    assert verify_cost(columns, "derive", 1) == pytest.approx(0.2)
    assert verify_cost(columns, "derive", 4) == pytest.approx(0.1)
    assert verify_cost(columns, "derive", 8) == pytest.approx(0.6)
    assert verify_cost(columns, "derive", 16) is None
    # as the batch grows the cost never falls (the dip at 4 is noise): 0.2, 0.2, 0.6
    assert draft_token_cost(columns, [1, 4, 8, 16]) == [[1, 0.2], [4, 0.2], [8, 0.6]]
    assert draft_token_cost({"k=0": columns["k=0"]}, [1, 4]) is None
    # k=1 30x slower than k=0 (a slow host, tiny models): capped at what the setting accepts
    slow = {**columns, "k=1": column({1: 100 / 30}, length=1.5)}
    assert draft_token_cost(slow, [1]) == [[1, 10.0]]
    from dynamo_spec.config.settings import DraftBudgetSettings
    assert DraftBudgetSettings(draft_token_cost=draft_token_cost(slow, [1])).draft_token_cost == [(1, 10.0)]
    assert budget_schedule([[1, 1, 4], [2, 11, 1], [12, 128, 0]]) == [[1, 1, 5], [2, 11, 2], [12, 128, 0]]


def test_the_report_says_where_the_budget_dropped_drafts():
    from dynamo_spec.bench.speedups import BUDGET, SCHEDULE

    cell = summary.summarize_rounds([(_round(10, 4, 2.0, drafts=20, accepted=10)[0],
                                      {"drafts": 20, "draft_tokens": 30, "accepted": 10,
                                       "budget_offered": 80, "budget_admitted": 32})])
    assert cell["budget"] == {"drafted": 80, "admitted": 32}
    result = {"derived": {"draft_token_cost": [[1, 0.12]], "budget_schedule": [[1, 128, 3]]},
              "settings": {"concurrency": [1]},
              "columns": {BUDGET: {"cells": {"judge": {"1": {**cell, "speedup": 1.3}}}},
                          SCHEDULE: {"cells": {"judge": {"1": {"speedup": 1.2}}}}}}
    text = "\n".join(render._budget(result))
    assert "`[[1, 0.12]]`" in text and "`[[1, 128, 3]]`" in text
    assert "| 1 | 1.30x | 1.20x | 1.083 | 80 | 32 | 10 | 1.50 |" in text


def test_one_at_a_time_the_smaller_ks_are_caps_on_the_largest_ks_server():
    from dynamo_spec.bench.load import request_body
    from dynamo_spec.bench.phases import capped_first_phase, caps_stand_in, first_phase
    from dynamo_spec.config.settings import Settings

    group, caps = capped_first_phase((0, 1, 3), 64)
    assert [name for name, _ in group] == ["k=1", "k=3", speedups.SPEC_K0]
    shared = group[0][1]
    assert all(overrides == shared for _, overrides in group)  # one server
    assert shared[shared.index("--speculative.num_speculative_tokens") + 1] == "3"
    assert shared[-1] == "[[1, 64, 3]]"  # a schedule, not a fixed k (no padded drafts past a cap)
    assert caps == {"k=1": 1, speedups.SPEC_K0: 0}
    assert len({tuple(o) for _, o in first_phase((0, 1, 3), 64)}) == 3  # side by side: a server each
    body = request_body({"messages": []}, "m", 8, 0.0, max_draft_tokens=1)
    assert body["extra_body"] == {"vllm_xargs": {"max_draft_tokens": 1}}
    assert "extra_body" not in request_body({"messages": []}, "m", 8, 0.0)
    # an engine-wide cap would carry one column's acceptance into the next: a server per column
    spec = {"method": "eagle3", "model": "d"}
    assert caps_stand_in(Settings(engine={"model": "m"}, speculative=spec), on_cpu=True)
    assert not caps_stand_in(Settings(engine={"model": "m"}, speculative={**spec, "guard": {"enabled": True}}),
                             on_cpu=True)
