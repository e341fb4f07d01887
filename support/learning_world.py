"""What the learning tests start from: a tiny target whose head is tied to its embedding (as
SmolLM2's is: the training's target distribution is the embedding's), its greedy answers, and a
served draft trained one step on some of them (tests/integration/test_learn_draft.py,
test_learning_auto.py)."""

from __future__ import annotations

import json
from pathlib import Path

AUX = (1, 2, 3)


def build_tied_target(out_dir: Path) -> Path:
    """The tiny fixture target with ``lm_head`` a copy of the embedding."""
    from safetensors.torch import load_file, save_file

    from support.tiny_models import build_tiny_target

    target = build_tiny_target(out_dir)
    weights = load_file(str(target / "model.safetensors"))
    weights["lm_head.weight"] = weights["model.embed_tokens.weight"].clone()
    save_file(weights, str(target / "model.safetensors"), metadata={"format": "pt"})
    return target


def greedy_answers(target: Path, conversations: list[list[dict]], new_tokens: int,
                   stop_at_eos: bool = True) -> list[tuple[list[int], list[int]]]:
    """The target's greedy (prompt ids, answer ids) for each conversation (transformers, one
    left-padded batch); with `stop_at_eos` each answer ends before its first EOS."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(target)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    prompts = [tok.apply_chat_template(c, add_generation_prompt=True, tokenize=True, return_dict=False)
               for c in conversations]
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    answers = out[:, width:].tolist()
    if stop_at_eos:
        answers = [a[:a.index(tok.eos_token_id)] if tok.eos_token_id in a else a for a in answers]
    return list(zip(prompts, answers))


def train_served_draft(target: Path, rows_jsonl: Path, out_dir: Path, aux: tuple[int, ...] = AUX) -> Path:
    """A draft trained one step on the rows of `rows_jsonl` (float32): barely better than random."""
    from dynamo_spec.training.hidden_states import extract_hidden_states, load_shards
    from dynamo_spec.training.train import TrainConfig, train

    hidden = rows_jsonl.with_suffix(".hidden")
    extract_hidden_states(target, rows_jsonl, hidden, aux, dtype="float32")
    train(target, load_shards(hidden), out_dir, out_dir.with_suffix(".pt"),
          TrainConfig(steps=1, lr=1e-4, draft_vocab=128, aux_layers=aux, dtype="float32", val_sequences=0),
          eos_id=json.loads((target / "config.json").read_text())["eos_token_id"])
    return out_dir
