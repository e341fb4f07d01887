"""`dynamo-spec verify` under batching, a schedule, the confidence budget and the shipped penalty on the
tiny fixtures: one run (one engine per variant serves the three concurrencies) that both tests read."""

from __future__ import annotations

import subprocess
import sys

import pytest

from dynamo_spec.default_model import SAMPLING_DEFAULTS
from support.in_process import in_process_env

pytestmark = pytest.mark.integration

WORDS = ["sea", "sky", "trees", "cats", "code", "rain", "bread", "sun", "snow", "salt", "glass", "maps",
         "owls", "tea", "rust", "moss"]
SCHEDULE = "[[1, 1, 3], [2, 3, 1], [4, 8, 0], [9, 128, 2]]"
# Every draft token worth verifying at cost 0, so the drafts are verified and learnt from, cut
# where a calibration cell is learnt to be rejected.
BUDGET = {"enabled": True, "draft_token_cost": [[1, 0.0]], "min_observations": 2}


def target_with_the_shipped_penalty(tiny_models, tmp_path):
    """The tiny target with the sampling defaults prepare-default writes (its presence penalty):
    verify's greedy requests take its penalty, and the draft drafts under it (draft_penalties)."""
    import shutil

    from dynamo_spec.default_model import ensure_sampling_defaults

    out = tmp_path / "target-with-penalty"
    out.mkdir()
    for f in tiny_models["target"].iterdir():
        (shutil.copy(f, out / f.name) if f.name == "generation_config.json" else (out / f.name).symlink_to(f))
    assert ensure_sampling_defaults(out)
    return out


@pytest.fixture(scope="module")
def batched(tiny_models, tmp_path_factory):
    """Sixteen prompts at concurrency 1, 4 and 16, under the shipped presence penalty (drafted under
    it too): the reference, fixed k=3, a schedule whose ranges the batch crosses as requests finish
    (k=3 alone, k=1 for 2-3, k=0 from 4, k=2 from 9), and that schedule with a config's confidence
    budget. verify's stdout."""
    import yaml

    from support.server_process import tiny_config

    tmp_path = tmp_path_factory.mktemp("verify-batching")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("".join(f"Prompt number {i}: say something about {w}.\n" for i, w in enumerate(WORDS)))
    config = tmp_path / "budget.yaml"
    config.write_text(yaml.safe_dump(tiny_config(tiny_models["target"], tiny_models["draft"], k=3,
                                                 speculative={"draft_budget": BUDGET})))
    result = subprocess.run(
        [sys.executable, "-m", "dynamo_spec", "verify", "--target", str(target_with_the_shipped_penalty(
            tiny_models, tmp_path)), "--draft", str(tiny_models["draft"]), "--k", "3", "--prompts", str(prompts),
         "--n", "16", "--max-tokens", "24", "--concurrency", "1,4,16", "--schedule", SCHEDULE,
         "--config", str(config)],
        capture_output=True, text=True, timeout=1200, env=in_process_env(),
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    return result.stdout


def test_verify_under_batching_a_schedule_and_a_penalty_finds_outputs_identical(batched):
    """On the tiny pair the outputs must be identical, not merely near-ties."""
    assert f"greedy, presence_penalty {SAMPLING_DEFAULTS['presence_penalty']}" in batched, batched[-2000:]
    for n in (1, 4, 16):
        assert f"| {n} | k=3 | 16 | 0 | 0 |" in batched, batched[-2000:]
        assert f"| {n} | schedule {SCHEDULE} | 16 | 0 | 0 |" in batched, batched
    assert "VLLM_CPU_ATTN_SPLIT_KV=" in batched


def test_verify_with_the_confidence_budget_finds_outputs_identical(batched):
    """A config whose confidence budget is on: its schedule with the budget, under batching and
    the penalty, must leave the tiny pair's output identical."""
    for n in (1, 4, 16):
        assert f"| {n} | schedule {SCHEDULE} + confidence budget | 16 | 0 | 0 |" in batched, batched
