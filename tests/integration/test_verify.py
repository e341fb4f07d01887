"""`dynamo-spec verify` on the tiny fixtures: greedy output unchanged by speculation."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration


def test_verify_finds_no_difference_on_the_tiny_pair(tiny_models, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("What is the capital of France?\nWrite a poem about the sea.\ndef add(a, b):\n")
    result = subprocess.run(
        [sys.executable, "-m", "dynamo_spec", "verify", "--target", str(tiny_models["target"]),
         "--draft", str(tiny_models["draft"]), "--k", "3", "--prompts", str(prompts), "--n", "3",
         "--max-tokens", "32"],
        capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "3 prompts" in result.stdout and "0 real differences" in result.stdout, result.stdout[-2000:]
    assert "greedy, no penalty" in result.stdout  # the fixture's generation_config.json sets none


def test_verify_with_the_confidence_budget_finds_outputs_identical(tiny_models, tmp_path):
    """A config whose confidence budget is on (every draft token worth verifying at cost 0, so the
    drafts are verified and learnt from, cut where a calibration cell is learnt to be rejected):
    its schedule with the budget, under batching, must leave the tiny pair's output identical."""
    import yaml

    from support.server import tiny_config

    config = tmp_path / "budget.yaml"
    config.write_text(yaml.safe_dump(tiny_config(tiny_models["target"], tiny_models["draft"], k=3, speculative={
        "num_speculative_tokens_per_batch_size": [[1, 3, 3], [4, 128, 1]],
        "draft_budget": {"enabled": True, "draft_token_cost": [[1, 0.0]], "min_observations": 2}})))
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("".join(f"Prompt {i}: a word about {w}.\n" for i, w in enumerate(["sea", "sky", "cats", "rain"])))
    result = subprocess.run(
        [sys.executable, "-m", "dynamo_spec", "verify", "--target", str(tiny_models["target"]),
         "--draft", str(tiny_models["draft"]), "--k", "3", "--prompts", str(prompts), "--n", "4",
         "--max-tokens", "24", "--concurrency", "4", "--config", str(config)],
        capture_output=True, text=True, timeout=900,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "| 4 | schedule [[1, 3, 3], [4, 128, 1]] + confidence budget | 4 | 0 | 0 |" in result.stdout, result.stdout
