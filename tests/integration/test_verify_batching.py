"""`dynamo-spec verify` under batching, a schedule and the shipped penalty on the tiny fixtures (its own
module, so the suite's two workers can run it beside the others; one engine per variant serves the
three concurrencies)."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration


def target_with_the_shipped_penalty(tiny_models, tmp_path):
    """The tiny target with the sampling defaults prepare-default writes (presence penalty 0.8):
    verify's greedy requests take its penalty, and the draft drafts under it (draft_penalties)."""
    import shutil

    from dynamo_spec.default_model import ensure_sampling_defaults

    out = tmp_path / "target-with-penalty"
    out.mkdir()
    for f in tiny_models["target"].iterdir():
        (shutil.copy(f, out / f.name) if f.name == "generation_config.json" else (out / f.name).symlink_to(f))
    assert ensure_sampling_defaults(out)
    return out


def test_verify_under_batching_a_schedule_and_a_penalty_finds_outputs_identical(tiny_models, tmp_path):
    """Sixteen prompts at concurrency 1, 4 and 16, under the shipped presence penalty (drafted
    under it too): with a fixed k, and with a schedule whose ranges the batch crosses as requests
    finish (k=3 alone, k=1 for 2-3, k=0 from 4, k=2 from 9). On the tiny pair the outputs must be
    identical, not merely near-ties."""
    words = ["sea", "sky", "trees", "cats", "code", "rain", "bread", "sun", "snow", "salt", "glass", "maps",
             "owls", "tea", "rust", "moss"]
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("".join(f"Prompt number {i}: say something about {w}.\n" for i, w in enumerate(words)))
    schedule = "[[1, 1, 3], [2, 3, 1], [4, 8, 0], [9, 128, 2]]"
    result = subprocess.run(
        [sys.executable, "-m", "dynamo_spec", "verify", "--target", str(target_with_the_shipped_penalty(
            tiny_models, tmp_path)), "--draft", str(tiny_models["draft"]), "--k", "3", "--prompts", str(prompts),
         "--n", "16", "--max-tokens", "24", "--concurrency", "1,4,16", "--schedule", schedule],
        capture_output=True, text=True, timeout=1200,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "greedy, presence_penalty 0.8" in result.stdout, result.stdout[-2000:]
    for n in (1, 4, 16):
        assert f"| {n} | k=3 | 16 | 0 | 0 |" in result.stdout, result.stdout[-2000:]
        assert f"| {n} | schedule {schedule} | 16 | 0 | 0 |" in result.stdout, result.stdout
    assert "VLLM_CPU_ATTN_SPLIT_KV=" in result.stdout
