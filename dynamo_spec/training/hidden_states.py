"""The target's hidden states over prompt + answer, for teacher-forced draft training.

For each sequence it keeps the aux layers (``hidden_states[i]`` = the residual stream
after i layers, the same tensor vLLM hands an EAGLE-3 draft for aux id i) and the
final normed hidden state (the target's next-token distribution is computed from it
during training). Shards of ``rows_per_shard`` sequences are written as safetensors,
each once, so an interrupted pass resumes at the first missing shard.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from .rows import read_jsonl

logger = logging.getLogger(__name__)


def shard_path(out_dir: Path, start: int, count: int) -> Path:
    return out_dir / f"shard-{start:06d}-{count:04d}.safetensors"


def write_shard(path: Path, rows: list[tuple]) -> None:
    """One shard from ``(prompt_ids, answer_ids, aux, final)`` rows (states over
    prompt + answer), stored as bf16."""
    seqs = [ids + ans for ids, ans, _, _ in rows]
    lens = torch.tensor([len(q) for q in seqs])
    save_file({
        "input_ids": torch.tensor([t for q in seqs for t in q], dtype=torch.int32),
        "prompt_lens": torch.tensor([len(ids) for ids, _, _, _ in rows]),
        "offsets": torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)]),
        "aux": torch.cat([a for _, _, a, _ in rows]).to(torch.bfloat16).contiguous(),
        "final": torch.cat([f for _, _, _, f in rows]).to(torch.bfloat16).contiguous(),
    }, str(path))


@dataclass(frozen=True)
class StatesPass:
    """What one call of :func:`extract_hidden_states` did: the shards' folder and the
    tokens it ran through the target (0 when every shard was already there)."""

    out_dir: Path
    tokens: int = 0
    seconds: float = 0.0

    @property
    def tokens_per_s(self) -> float | None:
        return self.tokens / self.seconds if self.seconds > 0 else None


@torch.inference_mode()
def _extract(model, seqs: list[list[int]], aux_layers, max_batch_tokens: int):
    """Aux [T, 3h] and final [T, h] per sequence, padded batches sorted by length."""
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
    out: dict[int, tuple] = {}
    i = 0
    while i < len(order):
        longest, j = len(seqs[order[i]]), i
        while j < len(order) and len(seqs[order[j]]) * (j - i + 1) <= max_batch_tokens:
            longest = len(seqs[order[j]])
            j += 1
        j = max(j, i + 1)
        batch = [seqs[k] for k in order[i:j]]
        longest = max(len(s) for s in batch)
        ids = torch.zeros(len(batch), longest, dtype=torch.long)
        att = torch.zeros(len(batch), longest, dtype=torch.long)
        for r, s in enumerate(batch):
            ids[r, :len(s)] = torch.tensor(s)
            att[r, :len(s)] = 1
        hs = model.model(input_ids=ids, attention_mask=att, output_hidden_states=True).hidden_states
        aux = torch.cat([hs[a] for a in aux_layers], dim=-1)
        for r, k in enumerate(order[i:j]):
            n = len(seqs[k])
            out[k] = (aux[r, :n].to(torch.bfloat16), hs[-1][r, :n].to(torch.bfloat16))
        i = j
    return [out[k] for k in range(len(seqs))]


def extract_hidden_states(target: Path, answers_path: Path, out_dir: Path,
                          aux_layers: tuple[int, ...], *, dtype: str,
                          rows_per_shard: int = 128, max_batch_tokens: int = 4096,
                          full_shards_only: bool = False) -> StatesPass:
    """Write shards with ``input_ids``, ``prompt_lens``, ``offsets``, ``aux``, ``final``:
    one prefill-only forward pass over prompt + answer, no decoding.

    ``full_shards_only`` leaves a last partial shard for later (used while the answers
    file is still growing). Returns the pass's tokens and seconds (tokens/s is logged)."""
    from transformers import AutoModelForCausalLM

    rows = read_jsonl(answers_path)
    if full_shards_only:
        rows = rows[: len(rows) // rows_per_shard * rows_per_shard]
    out_dir.mkdir(parents=True, exist_ok=True)
    for stale in out_dir.glob("shard-*.safetensors"):  # a partial shard that has grown
        start, count = (int(x) for x in stale.stem.split("-")[1:3])
        if count < rows_per_shard and len(rows) > start + count:
            stale.unlink()
    starts = range(0, len(rows), rows_per_shard)
    todo = [s for s in starts
            if not shard_path(out_dir, s, len(rows[s:s + rows_per_shard])).exists()]
    if not todo:
        return StatesPass(out_dir)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=getattr(torch, dtype)).eval()
    total = sum(len(r["prompt_ids"]) + len(r["answer_ids"]) for r in rows)
    t0, n_tok = time.monotonic(), 0
    with tqdm(total=total, desc="hidden states", unit="tok", unit_scale=True) as bar:
        bar.update(sum(len(r["prompt_ids"]) + len(r["answer_ids"])
                       for s in starts if s not in todo for r in rows[s:s + rows_per_shard]))
        for s in todo:
            part = rows[s:s + rows_per_shard]
            seqs = [r["prompt_ids"] + r["answer_ids"] for r in part]
            feats = _extract(model, seqs, aux_layers, max_batch_tokens)
            write_shard(shard_path(out_dir, s, len(part)),
                        [(r["prompt_ids"], r["answer_ids"], a, f) for r, (a, f) in zip(part, feats)])
            lens = torch.tensor([len(q) for q in seqs])
            n_tok += int(lens.sum())
            bar.update(int(lens.sum()))
            bar.set_postfix(tok_s=f"{n_tok / (time.monotonic() - t0):.0f}")
    done = StatesPass(out_dir, n_tok, time.monotonic() - t0)
    logger.info("hidden states (prefill): %d tokens in %.1f s, %.0f tokens/s", n_tok, done.seconds,
                done.tokens_per_s or 0)
    return done


def load_shards(out_dir: Path) -> list[dict]:
    """Every sequence as a dict of tensors (``input_ids``, ``prompt_len``, ``aux``,
    ``final``), in shard order."""
    seqs = []
    for path in sorted(out_dir.glob("shard-*.safetensors")):
        d = load_file(str(path))
        off = d["offsets"].tolist()
        for i in range(len(off) - 1):
            a, b = off[i], off[i + 1]
            seqs.append({"input_ids": d["input_ids"][a:b].long(),
                         "prompt_len": int(d["prompt_lens"][i]),
                         "aux": d["aux"][a:b], "final": d["final"][a:b]})
    return seqs
