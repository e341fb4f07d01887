"""The batch-size schedule's one home (dynamo_spec.config.schedule) and the loader's cap at a lowered k."""

from __future__ import annotations

import pytest

from dynamo_spec.config import schedule
from dynamo_spec.config.loader import load_settings
from dynamo_spec.config.preflight import run_preflight

pytestmark = pytest.mark.unit

CPU_CONFIG = "configs/smollm2-135m-instruct-eagle3-cpu.yaml"
PER_DTYPE = {"bfloat16": [[1, 1, 4], [2, 2, 2], [3, 128, 0]], "float32": [[1, 5, 2], [6, 128, 0]]}


def test_per_dtype_lookup_picks_the_entry_then_default_then_none():
    assert schedule.for_dtype(PER_DTYPE, "bfloat16") == (PER_DTYPE["bfloat16"],
                                                         "the bfloat16 entry (the engine runs in bfloat16)")
    assert schedule.for_dtype(PER_DTYPE, "float")[0] == PER_DTYPE["float32"]  # vLLM's alias
    assert schedule.for_dtype({**PER_DTYPE, "default": [[1, 128, 1]]}, "float16")[0] == [[1, 128, 1]]
    assert schedule.for_dtype(PER_DTYPE, "float16")[0] is None
    assert schedule.for_dtype([[1, 128, 2]], "bfloat16") == ([[1, 128, 2]], None)
    assert schedule.entries(PER_DTYPE) == [(f"{schedule.FIELD}.bfloat16", PER_DTYPE["bfloat16"]),
                                           (f"{schedule.FIELD}.float32", PER_DTYPE["float32"])]


def test_problems_name_each_bad_entry():
    assert schedule.problems([[1, 2, 3], [3, 128, 0]], k=3, max_num_seqs=128) == []
    assert schedule.problems([], 3, 128) == [f"{schedule.FIELD}: empty; give entries [lo, hi, k] or leave it unset"]
    found = schedule.problems([[1, 2, 4], [4, 100, 0]], k=3, max_num_seqs=128)
    assert [line.split(": ")[0] for line in found] == [f"{schedule.FIELD}[0] [1, 2, 4]", f"{schedule.FIELD}[1] [4, 100, 0]",
                                                       schedule.FIELD]


def test_capped_lowers_every_entry_and_with_entry_keeps_other_hosts():
    assert schedule.capped(PER_DTYPE, 2) == {"bfloat16": [[1, 1, 2], [2, 2, 2], [3, 128, 0]],
                                             "float32": [[1, 5, 2], [6, 128, 0]]}
    assert schedule.capped([[1, 3, 5], [4, 128, 1]], 1) == [[1, 3, 1], [4, 128, 1]]
    derived = [[1, 128, 1]]
    assert schedule.with_entry(PER_DTYPE, "bfloat16", derived) == {"float32": PER_DTYPE["float32"], "bfloat16": derived}
    assert schedule.with_entry(PER_DTYPE, "float16", derived)["float16"] == derived
    assert schedule.with_entry(PER_DTYPE, "int8", derived)["default"] == derived
    assert schedule.with_entry([[1, 128, 2]], "bfloat16", derived) == derived
    assert schedule.top_k(PER_DTYPE["bfloat16"]) == 4


@pytest.mark.parametrize("where", ["cli", "env"])
def test_lowering_k_over_the_file_caps_its_schedule_and_says_so(repo_root, where):
    config = repo_root / CPU_CONFIG
    if where == "cli":
        loaded = load_settings(config, ["--speculative.num_speculative_tokens", "2"], {})
    else:
        loaded = load_settings(config, [], {"DYNAMO_SPEC_SPECULATIVE__NUM_SPECULATIVE_TOKENS": "2"})
    value = loaded.settings.speculative.num_speculative_tokens_per_batch_size
    assert isinstance(value, dict) and value
    assert all(k <= 2 for entry in value.values() for _, _, k in entry)
    assert len(loaded.notes) == 1 and "capped at k=2" in loaded.notes[0]
    assert "capped at k=2" in loaded.source_of(schedule.FIELD)
    assert not [p for p in run_preflight(loaded.settings, on_cpu=True) if "k must be" in p.message]


def test_a_schedule_as_explicit_as_k_is_not_capped(repo_root):
    config = repo_root / CPU_CONFIG
    # The schedule itself given on the command line with k above num_speculative_tokens: an error.
    loaded = load_settings(config, ["--speculative.num_speculative_tokens", "2",
                                    f"--{schedule.FIELD}", "[[1, 2, 3], [3, 128, 0]]"], {})
    assert loaded.notes == ()
    assert [p.level for p in run_preflight(loaded.settings, on_cpu=True) if "k must be" in p.message] == ["error"]
    # k from the file (as written), schedule overridden: nothing capped either.
    loaded = load_settings(config, [f"--{schedule.FIELD}", "[[1, 128, 4]]"], {})
    assert loaded.notes == () and loaded.settings.speculative.num_speculative_tokens_per_batch_size == [(1, 128, 4)]


def test_raising_k_leaves_the_schedule_alone(repo_root):
    loaded = load_settings(repo_root / CPU_CONFIG, ["--speculative.num_speculative_tokens", "6"], {})
    assert loaded.notes == ()
    file_value = load_settings(repo_root / CPU_CONFIG, [], {}).settings.speculative.num_speculative_tokens_per_batch_size
    assert loaded.settings.speculative.num_speculative_tokens_per_batch_size == file_value


def test_verify_takes_the_schedule_a_config_applies_for_its_dtype():
    import argparse
    from pathlib import Path

    from dynamo_spec.training.verify import _schedule

    config = Path(__file__).resolve().parents[2] / "configs" / "smollm2-135m-instruct-eagle3-cpu.yaml"
    args = argparse.Namespace(schedule=None, config=config, dtype="bfloat16")
    assert _schedule(args) == [[1, 1, 4], [2, 2, 2], [3, 11, 1], [12, 128, 0]]
    assert _schedule(argparse.Namespace(schedule=None, config=config, dtype="float32"))[0] == [1, 5, 2]
    assert _schedule(argparse.Namespace(schedule="[[1, 128, 2]]", config=None, dtype="bfloat16")) == [[1, 128, 2]]
