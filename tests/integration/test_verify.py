"""`dynamo-spec verify` on the tiny fixtures: greedy output unchanged by speculation."""

from __future__ import annotations

import subprocess
import sys

import pytest

from support.in_process import in_process_env

pytestmark = pytest.mark.integration


def test_verify_finds_no_difference_on_the_tiny_pair(tiny_models, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("What is the capital of France?\nWrite a poem about the sea.\ndef add(a, b):\n")
    result = subprocess.run(
        [sys.executable, "-m", "dynamo_spec", "verify", "--target", str(tiny_models["target"]),
         "--draft", str(tiny_models["draft"]), "--k", "3", "--prompts", str(prompts), "--n", "3",
         "--max-tokens", "32"],
        capture_output=True, text=True, timeout=600, env=in_process_env(),
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "3 prompts" in result.stdout and "0 real differences" in result.stdout, result.stdout[-2000:]
    assert "greedy, no penalty" in result.stdout  # the fixture's generation_config.json sets none
