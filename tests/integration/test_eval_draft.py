"""`dynamo-spec eval-draft` on the known-acceptance fixtures: its table is the truth."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration


def test_eval_draft_reports_the_known_acceptance(tiny_models, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    rows = [{"id": f"p{i}", "source": src, "split": split,
             "messages": [{"role": "user", "content": text}]}
            for i, (src, split, text) in enumerate([
                ("a", "eval", "What is the capital of France?"),
                ("b", "eval", "Write a poem about the sea."),
                ("a", "train", "never used by eval-draft"),
                ("b", "eval", "def add(a, b):")])]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "result.json"
    result = subprocess.run(
        [sys.executable, "-m", "dynamo_spec", "eval-draft",
         "--target", str(tiny_models["fixed_target"]),
         "--draft", str(tiny_models["always_draft"]), "--prompts", str(prompts),
         "--k", "1,3", "--temperatures", "0,0.8,default", "--max-tokens", "33", "--speed-prompts", "2", "--speed-runs", "1",
         "--speed-max-tokens", "16", "--json", str(out)],
        capture_output=True, text=True, timeout=900,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["n_prompts"] == 3  # the eval split only
    by_k = {a["k"]: a for a in report["acceptance"] if a["temperature"] == 0}
    sampled = {a["k"]: a for a in report["acceptance"] if a["temperature"] == 0.8}
    # always accepted: every draft step yields k + 1 tokens; 33 tokens = 1 from the
    # prefill + 32 from speculative steps (a whole number of steps for k = 1 and 3)
    for k in (1, 3):
        assert by_k[k]["mean_acceptance_length"] == pytest.approx(k + 1)
        assert by_k[k]["acceptance_rate"] == pytest.approx(1.0)
        assert by_k[k]["per_position"] == pytest.approx([1.0] * k)
        assert by_k[k]["drafts"] == 3 * 32 // (k + 1)
        per_source = by_k[k]["per_source"]
        assert {s: v["n"] for s, v in per_source.items()} == {"a": 1, "b": 2}
        assert all(v["mean_acceptance_length"] == pytest.approx(k + 1)
                   for v in per_source.values())
    # The fixed target's greedy answer is token 0 again and again: 33 tokens, 30 4-grams of
    # which 29 repeat the first, and a loop from token 1 on; no answer is left to measure
    # acceptance without loops.
    for k in (1, 3):
        deg = by_k[k]["degeneration"]
        assert deg["repeated_ngram_share"] == pytest.approx(29 / 30)
        assert (deg["looping"], deg["answers"], deg["cycle_starts"]) == (3, 3, [1, 1, 1])
        assert by_k[k]["not_looping"]["n"] == 0
        assert sampled[k]["degeneration"]["looping"] == 0
    # Sampled: every target logit is 0 (a uniform distribution over the vocabulary) and the
    # draft always proposes token 0, so rejection sampling accepts a draft token with
    # probability 1 / vocabulary size: almost never (greedy would accept them all).
    for k in (1, 3):
        assert sampled[k]["drafts"] > 0
        assert sampled[k]["acceptance_rate"] < 0.05
        assert set(sampled[k]["per_source"]) == {"a", "b"}
    # 'default': a request without sampling fields; the fixture's generation_config.json has
    # none, so vLLM's temperature 1 applies: sampled, not greedy.
    assert report["model_defaults"] == {}
    default = {a["k"]: a for a in report["acceptance"] if a["temperature"] == "default"}
    assert all(default[k]["acceptance_rate"] < 0.05 for k in (1, 3))
    assert "| 3 | 0.8 |" in result.stdout and "| 3 | default |" in result.stdout
    for key in ("speed_no_spec", "speed_spec"):
        assert report[key]["batch1_tok_s"] > 0 and report[key]["batch8_tok_s"] > 0
    assert "| 3 | 0 | 4.00 | 1.00 | 1.00 / 1.00 / 1.00 | 96.7% | 3 / 3 | - (0) |" in result.stdout
    assert "| b | 2 | 2.00 (97%) |" in result.stdout and "| 4.00 (97%) |" in result.stdout
