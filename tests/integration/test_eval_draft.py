"""`dynamo-spec eval-draft` on the known-acceptance fixtures: its table is the truth."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from support.in_process import in_process_env

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
         "--speed-max-tokens", "16", "--draft-penalties", "on", "--json", str(out)],
        capture_output=True, text=True, timeout=900, env=in_process_env(),
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["n_prompts"] == 3  # the eval split only
    # only with the draft-side penalties, as asked (this fixture sets no penalty: on and off are
    # compared on one that does, below)
    assert [(a["k"], a["temperature"], a["draft_penalties"]) for a in report["acceptance"]] == [
        (k, t, True) for k in (1, 3) for t in (0, 0.8, "default")]
    by_k = {a["k"]: a for a in report["acceptance"] if a["temperature"] == 0 and a["draft_penalties"]}
    sampled = {a["k"]: a for a in report["acceptance"] if a["temperature"] == 0.8 and a["draft_penalties"]}
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
    default = {a["k"]: a for a in report["acceptance"] if a["temperature"] == "default" and a["draft_penalties"]}
    assert all(default[k]["acceptance_rate"] < 0.05 for k in (1, 3))
    assert "| 3 | 0.8 | on | off |" in result.stdout and "| 3 | default | on | off |" in result.stdout
    for key in ("speed_no_spec", "speed_spec"):
        assert report[key]["batch1_tok_s"] > 0 and report[key]["batch8_tok_s"] > 0
    assert "| 3 | 0 | on | off | 4.00 | 1.00 | 1.00 / 1.00 / 1.00 | 96.7% | 3 / 3 | - (0) |" in result.stdout
    assert "| b | 2 | 2.00 (97%) |" in result.stdout and "| 4.00 (97%) |" in result.stdout


# Logits the same at every position (support/tiny_models.py, build_preference_target); the model's
# generation_config.json asks for a frequency penalty, so every request of eval-draft takes it.
PREFERENCES = {20: 8.0, 21: 7.375, 22: 6.75, 23: 6.125, 24: 5.5, 25: 4.875}
FREQUENCY_PENALTY = 0.75


@pytest.fixture(scope="module")
def penalised_models(tmp_path_factory):
    from support.tiny_models import build_preference_draft, build_preference_target

    root = tmp_path_factory.mktemp("penalised-models")
    target = build_preference_target(root / "target", PREFERENCES)
    config = json.loads((target / "generation_config.json").read_text())
    (target / "generation_config.json").write_text(json.dumps({**config, "frequency_penalty": FREQUENCY_PENALTY}))
    return target, build_preference_draft(root / "draft", target, PREFERENCES)


def eval_draft_on_two_prompts(tmp_path, target, draft, *options: str):
    """`dynamo-spec eval-draft` at k=3, temperature 0, no speed runs, on two prompts: its stdout and report."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "source": "a", "split": "eval",
                                           "messages": [{"role": "user", "content": text}]}) + "\n"
                               for i, text in enumerate(["Tell me about the sea.", "def add(a, b):"])))
    out = tmp_path / "result.json"
    result = subprocess.run(
        [sys.executable, "-m", "dynamo_spec", "eval-draft", "--target", str(target), "--draft", str(draft),
         "--prompts", str(prompts), "--k", "3", "--temperatures", "0", "--speed-runs", "0", *options,
         "--json", str(out)],
        capture_output=True, text=True, timeout=900, env=in_process_env(),
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    return result, json.loads(out.read_text())


def test_eval_draft_compares_drafting_with_and_without_the_penalties(penalised_models, tmp_path):
    """Under the model's frequency penalty the greedy answer cycles through the six tokens
    (20 21 20 22 21 20 23 22 21 20 24 ...: each use costs 0.75). The draft's logits are the target's:
    drafting under the penalty it proposes the answer (every draft accepted, k + 1 a step);
    without, it proposes token 20 every time, accepted only where the answer has it: of 25 tokens,
    19 steps of 3 drafts, 5 accepted (the reckoning of tests/integration/test_draft_penalties.py)."""
    target, draft = penalised_models
    result, report = eval_draft_on_two_prompts(tmp_path, target, draft, "--max-tokens", "25",
                                               "--draft-penalties", "on,off")
    assert report["model_defaults"] == {"frequency_penalty": FREQUENCY_PENALTY}
    on, off = (next(a for a in report["acceptance"] if a["draft_penalties"] is v) for v in (True, False))
    assert (on["drafts"], on["mean_acceptance_length"], on["acceptance_rate"]) == (2 * 6, 4.0, 1.0)
    assert off["drafts"] == 2 * 19
    assert off["mean_acceptance_length"] == pytest.approx(1 + 5 / 19)
    assert off["acceptance_rate"] == pytest.approx(5 / 57)
    assert "| 3 | 0 | on | off | 4.00 | 1.00 |" in result.stdout and "| 3 | 0 | off | off | 1.26 | 0.09 |" in result.stdout


def test_eval_draft_takes_the_suffix_mix_as_a_column(tiny_models, tmp_path):
    """The fixed target answers token 0 forever and the never-draft is never accepted: alone it accepts
    nothing; with the suffix mix the answer's own repetition is drafted by the tree, long and accepted."""
    result, report = eval_draft_on_two_prompts(tmp_path, tiny_models["fixed_target"], tiny_models["never_draft"],
                                               "--max-tokens", "49", "--draft-penalties", "on", "--suffix", "on,off")
    on, off = (next(a for a in report["acceptance"] if a["suffix"] is v) for v in (True, False))
    assert off["mean_acceptance_length"] == 1.0
    assert on["mean_acceptance_length"] > 3, on
    assert "| 3 | 0 | on | on |" in result.stdout and "| 3 | 0 | on | off | 1.00 |" in result.stdout


def test_calibration_records_each_verified_draft_with_the_drafts_own_probabilities(tiny_models, tmp_path):
    """The partial draft proposes target token 0 with all-zero draft logits at its first position
    (probability exactly 1 / draft vocabulary: its confidence) and another token after that:
    every draft of k=3 has its first token accepted and its second rejected. The log must hold
    each verified draft once (vLLM's own count), those probabilities and those verdicts."""
    result, report = eval_draft_on_two_prompts(tmp_path, tiny_models["fixed_target"], tiny_models["partial_draft"],
                                               "--max-tokens", "33", "--calibration", "--draft-penalties", "on")
    acceptance = report["acceptance"][0]
    calibration = acceptance["calibration"]
    draft_vocab = json.loads((tiny_models["partial_draft"] / "config.json").read_text())["draft_vocab_size"]
    # 33 tokens: 1 from the prefill, then 16 steps of 2 (one accepted, the bonus token) per prompt.
    assert acceptance["drafts"] == 2 * 16
    assert calibration["drafts"] == acceptance["drafts"]
    token, survival = calibration["token"], calibration["survival"]
    assert survival["n"] == 3 * acceptance["drafts"]  # every verified token of every draft
    first, second = token["by_position"]  # judged: the first token, and the second after it
    assert (first["n"], first["observed"]) == (32, 1.0)
    assert first["predicted"] == pytest.approx(1 / draft_vocab, abs=1e-5)
    assert (second["n"], second["observed"]) == (32, 0.0)
    assert second["predicted"] > first["predicted"]  # this fixture is confidently wrong after its first token
    assert [p["observed"] for p in survival["by_position"]] == [1.0, 0.0, 0.0]
    assert "draft confidence against acceptance, k=3 0: 32 verified drafts" in result.stdout
