"""`dynamo-spec eval-sampling` end to end on the known-acceptance fixtures: one engine, two penalty settings."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from dynamo_spec.training.checked import load_checked

pytestmark = pytest.mark.integration


def test_eval_sampling_compares_settings_on_one_engine(tiny_models, tmp_path):
    """The fixed target answers token 0 ("!") to everything, so no checked answer is right; the always
    draft proposes that token, so without a penalty every greedy draft is accepted (k + 1). A presence
    penalty moves the target off the token it has said: the setting's penalty reached its requests, and
    the other setting's did not. Open-ended answers are sampled at the model's default temperature (the
    fixture sets none: vLLM's 1, uniform over the vocabulary on this target): drafts almost never accepted."""
    out = tmp_path / "rows.json"
    settings = {"no penalty": {}, "presence 0.5": {"presence_penalty": 0.5}}
    result = subprocess.run(
        [sys.executable, "-m", "dynamo_spec", "eval-sampling", "--target", str(tiny_models["fixed_target"]),
         "--draft", str(tiny_models["always_draft"]), "--k", "3", "--seeds", "1", "--max-tokens", "17",
         "--settings", json.dumps(settings), "--json", str(out)],
        capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    none, presence = json.loads(out.read_text())
    ids = [row["id"] for row in load_checked()]
    for row, (name, fields) in zip((none, presence), settings.items(), strict=True):
        assert (row["setting"], row["fields"]) == (name, fields)
        assert (row["passed"], row["checked"], row["failed"]) == (0, len(ids), ids)
        assert row["open_answers"] == 4 and row["open_looping"] == 0  # 4 open-ended requests x 1 seed
        assert row["open_acceptance"] < 1.2
    assert none["checked_acceptance"] == pytest.approx(4.0)
    assert presence["checked_acceptance"] < 3.0
    assert f"| no penalty | 0 / {len(ids)} | 0 / 4 | 0% | 4.00 |" in result.stdout
    assert f"\npresence 0.5: failed {', '.join(ids)}\n" in result.stdout
