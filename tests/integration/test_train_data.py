"""train-draft's answer stage on the tiny target: answers and hidden-state shards agree,
held-out and skipped prompts are never answered, and a re-run resumes."""

from __future__ import annotations

import json

import pytest
import torch

from dynamo_spec.training.decode import generate_with_states
from dynamo_spec.training.hidden_states import load_shards
from dynamo_spec.training.rows import read_jsonl

pytestmark = pytest.mark.integration


def test_answers_and_states_on_the_tiny_target(tiny_models, tmp_path):
    rows = [{"id": f"{src}-{i}", "source": src, "split": split,
             "messages": [{"role": "user", "content": f"question {i} from {src}"}]}
            for i, (src, split) in enumerate([("chitchat", "train"), ("chitchat", "eval"),
                                              ("mmlu", "train"), ("chitchat", "train"),
                                              ("humaneval", "train"), ("mmlu", "train")])]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    work = tmp_path / "work"
    args = {"aux_layers": (1, 2, 3), "max_new_tokens": 8, "batch_size": 2,
            "rows_per_shard": 2, "skip_ids": {"mmlu-5"}}
    generate_with_states(tiny_models["target"], prompts, work, **args)

    answers = read_jsonl(work / "answers.jsonl")
    # train prompts only, minus the skipped one; smaller sources before chit-chat
    assert sorted(r["id"] for r in answers) == ["chitchat-0", "chitchat-3", "humaneval-4",
                                                "mmlu-2"]
    seqs = load_shards(work / "hidden")
    assert len(seqs) == len(answers)
    for r, s in zip(answers, seqs):
        assert s["input_ids"].tolist() == r["prompt_ids"] + r["answer_ids"]
        assert s["prompt_len"] == len(r["prompt_ids"])
        assert 1 <= len(r["answer_ids"]) <= 8
        assert s["aux"].shape == (len(s["input_ids"]), 3 * 128)
        assert s["final"].shape == (len(s["input_ids"]), 128)
        assert s["aux"].dtype == torch.bfloat16 and torch.isfinite(s["aux"].float()).all()
    assert (work / "answers.seconds").exists()

    generate_with_states(tiny_models["target"], prompts, work, **args)  # resumes: no-op
    assert len(read_jsonl(work / "answers.jsonl")) == len(answers)
    assert len(load_shards(work / "hidden")) == len(seqs)


def test_train_draft_end_to_end_with_self_prompts(tiny_models, tmp_path):
    """The whole command: the prompt file (pre-written, so nothing is downloaded), the
    target's own instruction requests, answered in turn greedily and sampled, answers
    and states for the chosen sources only, a few training steps, and the draft as vLLM
    loads it."""
    from dynamo_spec.training.pipeline import PipelineConfig, run_pipeline

    work = tmp_path / "work"
    work.mkdir()
    rows = [{"id": f"chitchat-{i}", "source": "chitchat", "split": split,
             "messages": [{"role": "user", "content": f"hello number {i}"}]}
            for i, split in enumerate(["train", "eval", "train"])]
    rows.append({"id": "mmlu-0", "source": "mmlu", "split": "train",
                 "messages": [{"role": "user", "content": "Which of the following is a prime?"}]})
    (work / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = PipelineConfig(target=tiny_models["target"], out=tmp_path / "draft", work_dir=work,
                         generator="decoder", steps=3, minutes=None, answer_minutes=None, max_new_tokens=8,
                         aux_layers=(1, 2, 3), draft_vocab=64, self_prompts=3,
                         self_temperature=1.0, self_kinds="instructions",
                         self_answer_temperatures=(0.0, 0.7), answer_sources=("chitchat", "magpie"))
    summary = run_pipeline(cfg)

    own = read_jsonl(work / "self_prompts.jsonl")
    assert len(own) <= 3 and all(r["source"] == "magpie" for r in own)
    assert [r.get("temperature") for r in own] == [None, 0.7, None][:len(own)]
    answered = {r["id"] for r in read_jsonl(work / "answers.jsonl")}
    assert answered == {"chitchat-0", "chitchat-2"} | {r["id"] for r in own}
    assert summary["steps"] == 3 and summary["answer_sequences"] == len(answered)
    assert {"name": "magpie", "package": "the target itself",
            "licence": "the target's"} in summary["sources"]
    config = json.loads((tmp_path / "draft" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["draft_vocab_size"] == 64
    assert (tmp_path / "draft" / "model.safetensors").exists()
