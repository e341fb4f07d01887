"""`dynamo-spec eval-sampling` end to end on the known-acceptance fixtures: one engine, three settings
(one with DRY's fields as sampling extras), every setting's requests in one batch."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from dynamo_spec.training.checked import load_checked
from dynamo_spec.training.sampling_eval import load_open_ended
from support.in_process import in_process_env

pytestmark = pytest.mark.integration


def test_eval_sampling_compares_settings_on_one_engine(tiny_models, tmp_path):
    """The fixed target answers token 0 ("!") to everything, so no checked answer is right; the always
    draft proposes that token, so without a penalty every greedy draft is accepted (k + 1). A presence
    penalty moves the target off the token it has said: the setting's penalty reached its requests, and
    the other settings' did not, though all went in one batch. Open-ended answers are sampled at the
    model's default temperature (the fixture sets none: vLLM's 1, uniform over the vocabulary on this
    target): drafts almost never accepted. The DRY setting's row is checked for its shape only (what DRY
    does to these answers is the DRY tests' business)."""
    out = tmp_path / "rows.json"
    dry = {"extra_args": {"dry_multiplier": 0.8, "dry_base": 1.75, "dry_allowed_length": 2}}
    settings = {"no penalty": {}, "presence 0.5": {"presence_penalty": 0.5}, "dry 0.8": dry}
    result = subprocess.run(
        [sys.executable, "-m", "dynamo_spec", "eval-sampling", "--target", str(tiny_models["fixed_target"]),
         "--draft", str(tiny_models["always_draft"]), "--k", "3", "--seeds", "1", "--max-tokens", "17",
         "--settings", json.dumps(settings), "--json", str(out)],
        capture_output=True, text=True, timeout=600, env=in_process_env(),
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    rows = json.loads(out.read_text())
    ids, opens = [row["id"] for row in load_checked()], len(load_open_ended())
    assert [(r["setting"], r["fields"]) for r in rows] == list(settings.items())
    for row in rows:
        assert (row["passed"], row["checked"], row["failed"]) == (0, len(ids), ids)
        assert row["open_answers"] == opens and row["open_looping"] == 0  # the open-ended requests x 1 seed
        assert len(row["poem"]) == 1 and row["open_acceptance"] < 1.2
    none, presence, _ = rows
    # a request that sets no penalty gets the fixture's defaults: none
    assert [r["model_default"] for r in rows] == [True, False, False]
    assert none["checked_acceptance"] == pytest.approx(4.0)
    assert presence["checked_acceptance"] < 3.0
    assert f"| **no penalty** (the model's default) | 0 / {len(ids)} | 0 / {opens} | 0% | 4.00 / " in result.stdout
    assert f"\npresence 0.5: failed {', '.join(ids)}; looping none\n" in result.stdout
