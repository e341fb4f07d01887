"""The training loop: packed rows, AdamW with fp32 master weights, computed in the host's
dtype (bf16 autocast where the CPU has native bf16, else fp32: ``precision.py``), a tqdm
bar, a checkpoint every ``ckpt_every`` steps (re-running resumes from it), and
deterministic batches given the seed.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from ..config.eagle3_format import draft_config, to_speculators
from .draft_defaults import AUX_LAYERS, DRAFT_FORMAT, DRAFT_VOCAB
from .model import Eagle3Draft, ttt_loss
from .vocab import choose_draft_vocab, d2t_from_ids

logger = logging.getLogger(__name__)


@dataclass
class TrainConfig:
    seed: int = 0
    steps: int | None = None  # total optimizer steps (exactly reproducible; on resume
    # a larger value continues the run with the schedule stretched to it)
    minutes: float | None = None  # or a time budget; steps are then estimated once
    row_tokens: int = 1024
    lr: float = 1e-3
    warmup: int = 10
    weight_decay: float = 0.0
    ttt_steps: int = 3
    ckpt_every: int = 25
    val_sequences: int = 48
    draft_vocab: int = DRAFT_VOCAB
    aux_layers: tuple = AUX_LAYERS
    # lm_head starts as the target's embedding rows (tied target); keeping it frozen
    # (as EAGLE-1/2 keep the target's head) halves the trainable parameters, which
    # matters when data is scarce.
    train_lm_head: bool = False
    # warm start: a draft directory whose fc / decoder layer / norm weights replace the
    # random init (the lm_head and d2t still follow this run's draft vocabulary) ...
    init_from: Path | None = None
    # ... unless keep_vocab: then the draft keeps that draft's vocabulary (lm_head, d2t, t2d)
    # and its config.json (shape, aux layers), so a server serving it can load the result in
    # its place; draft_vocab and aux_layers are then that draft's.
    keep_vocab: bool = False
    draft_format: str = DRAFT_FORMAT
    # what the loop computes in: bfloat16 (autocast) or float32 (precision.training_dtype)
    dtype: str = "bfloat16"


def load_target_tensors(target: Path) -> dict:
    """The target's token embedding and final norm weight (fp32)."""
    out = {}
    for f in sorted(Path(target).glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            for key in ("model.embed_tokens.weight", "model.norm.weight"):
                if key in st.keys():  # noqa: SIM118 - safe_open is not a mapping
                    out[key] = st.get_tensor(key).float()
    return out


def pack_rows(seqs: list[dict], order: list[int], row_tokens: int) -> list[list[int]]:
    """Greedy packing of whole sequences (truncated to a row) in ``order``."""
    rows, cur, used = [], [], 0
    for i in order:
        n = min(len(seqs[i]["input_ids"]), row_tokens)
        if cur and used + n > row_tokens:
            rows.append(cur)
            cur, used = [], 0
        cur.append(i)
        used += n
    if cur:
        rows.append(cur)
    return rows


def make_batch(seqs: list[dict], row: list[int], row_tokens: int, embed_draft: torch.Tensor):
    """One packed row as the tensors ``ttt_loss`` wants (batch dim 1)."""
    ids, seg, pos, mask, aux, final = [], [], [], [], [], []
    for s_idx, i in enumerate(row):
        s = seqs[i]
        n = min(len(s["input_ids"]), row_tokens)
        ids.append(s["input_ids"][:n])
        seg.append(torch.full((n,), s_idx))
        pos.append(torch.arange(n))
        m = torch.zeros(n)
        m[max(s["prompt_len"] - 1, 0): n - 1] = 1  # token t + 1 is an answer token
        mask.append(m)
        aux.append(s["aux"][:n])
        final.append(s["final"][:n])
    final_t = torch.cat(final).float()
    probs = (final_t @ embed_draft.T).softmax(-1)
    return {"input_ids": torch.cat(ids)[None], "segment": torch.cat(seg)[None],
            "positions": torch.cat(pos)[None], "loss_mask": torch.cat(mask)[None],
            "aux": torch.cat(aux)[None].float(), "target_probs": probs[None]}


def lr_at(step: int, total: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    frac = (step - cfg.warmup) / max(1, total - cfg.warmup)
    return cfg.lr * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))


def epoch_rows(seqs, train_idx, epoch: int, cfg: TrainConfig) -> list[list[int]]:
    order = list(train_idx)
    random.Random(f"{cfg.seed}-{epoch}").shuffle(order)
    return pack_rows(seqs, order, cfg.row_tokens)


def batch_at(seqs, train_idx, step: int, cfg: TrainConfig, cache: dict) -> list[int]:
    """The row for a global step: epochs are walked in order, so resuming at any
    step reproduces the same batches."""
    epoch, k = 0, step
    while True:
        if epoch not in cache:
            cache.clear()
            cache[epoch] = epoch_rows(seqs, train_idx, epoch, cfg)
        rows = cache[epoch]
        if k < len(rows):
            return rows[k]
        k -= len(rows)
        epoch += 1


def compute(dtype: str):
    """The context the draft's forward runs in: bf16 autocast, or plain fp32."""
    if dtype == "bfloat16":
        return torch.autocast("cpu", dtype=torch.bfloat16)
    if dtype == "float32":
        return contextlib.nullcontext()
    raise ValueError(f"training dtype must be bfloat16 or float32, not {dtype!r}")


def step_loss(draft, embed, batch: dict, cfg: TrainConfig):
    """The TTT loss of one batch, computed in ``cfg.dtype``."""
    with compute(cfg.dtype):
        return ttt_loss(draft, embed, batch, cfg.ttt_steps)


VOCAB_BOUND = ("lm_head.weight", "d2t", "t2d")  # tensors that follow the draft vocabulary


def _kept_vocab_draft(init: Path):
    """A draft with the config.json and vocabulary of ``init`` (every tensor loaded): the
    warm start of a draft that must stay loadable in place of ``init``."""
    from ..config.eagle3_format import UNTRAINED_KEY, is_speculators, vllm_view

    written = json.loads((Path(init) / "config.json").read_text())
    dcfg = {k: v for k, v in written.items() if k != UNTRAINED_KEY}  # it is being trained now
    view = vllm_view(dcfg) if is_speculators(dcfg) else dcfg
    state = load_file(str(Path(init) / "model.safetensors"))
    draft = Eagle3Draft(view)
    keep = {k: v.float() if v.is_floating_point() else v for k, v in state.items() if k != "t2d"}
    missing, unexpected = draft.load_state_dict(keep, strict=False)
    if missing or unexpected:
        raise ValueError(f"{init}: not a draft this code trains (missing {missing}, unexpected {unexpected})")
    d2t_ids = (torch.arange(draft.d2t.numel()) + draft.d2t).tolist()
    logger.info("initialised from %s, its vocabulary kept (%d ids)", init, len(d2t_ids))
    return draft, dcfg, d2t_ids


def _kept_tensors(init: Path) -> dict:
    """The vocabulary tensors of ``init`` the draft module does not hold (``t2d``), saved as they are."""
    with safe_open(str(Path(init) / "model.safetensors"), "pt") as f:
        return {"t2d": f.get_tensor("t2d")} if "t2d" in f.keys() else {}  # noqa: SIM118 - not a mapping


def build_draft(target: Path, seqs: list[dict], cfg: TrainConfig, eos_id: int):
    """The draft to train, its config.json, its vocabulary (target ids) and the target's embedding."""
    if cfg.keep_vocab:
        if not cfg.init_from:
            raise ValueError("keep_vocab keeps the vocabulary of init_from: set init_from")
        draft, dcfg, d2t_ids = _kept_vocab_draft(cfg.init_from)
        return draft, dcfg, d2t_ids, load_target_tensors(target)["model.embed_tokens.weight"]
    target_cfg = json.loads((Path(target) / "config.json").read_text())
    dcfg = draft_config(target_cfg, cfg.aux_layers, cfg.draft_vocab)
    answer_tokens = (s["input_ids"][s["prompt_len"]:].tolist() for s in seqs)
    d2t_ids = choose_draft_vocab(answer_tokens, cfg.draft_vocab, target_cfg["vocab_size"],
                                 always=[eos_id])
    torch.manual_seed(cfg.seed)
    draft = Eagle3Draft(dcfg)
    tensors = load_target_tensors(target)
    with torch.no_grad():
        draft.lm_head.weight.copy_(tensors["model.embed_tokens.weight"][d2t_ids])
        draft.norm.weight.copy_(tensors["model.norm.weight"])
        draft.d2t.copy_(d2t_from_ids(d2t_ids))
    if cfg.init_from:
        init = load_file(str(Path(cfg.init_from) / "model.safetensors"))
        vocab_bound = set(VOCAB_BOUND)  # rebuilt for this run's vocabulary
        keep = {k: v.float() for k, v in init.items() if k not in vocab_bound}
        missing, unexpected = draft.load_state_dict(keep, strict=False)
        if unexpected or set(missing) - vocab_bound:
            raise ValueError(f"{cfg.init_from}: not a draft of this shape "
                             f"(missing {missing}, unexpected {unexpected})")
        logger.info("initialised from %s (%d tensors)", cfg.init_from, len(keep))
    return draft, dcfg, d2t_ids, tensors["model.embed_tokens.weight"]


@torch.no_grad()
def evaluate(draft, embed, seqs, idx, cfg, embed_draft) -> list[float]:
    rows = pack_rows(seqs, list(idx), cfg.row_tokens)
    accs = []
    for row in rows:
        _, a, _ = step_loss(draft, embed, make_batch(seqs, row, cfg.row_tokens, embed_draft), cfg)
        accs.append(a)
    return [sum(a[j] for a in accs) / max(1, len(accs)) for j in range(cfg.ttt_steps)]


def save_draft(draft: Eagle3Draft, dcfg: dict, out_dir: Path, *, draft_format: str = "vllm",
               target: Path | None = None, extra: dict | None = None) -> None:
    """Weights and config.json; ``draft_format`` "speculators" writes the config in vLLM's
    speculators format (the same weights; vLLM 0.32 loads both). ``extra``: tensors saved as
    given beside the draft's (a kept vocabulary's ``t2d``)."""
    if draft_format == "speculators":
        if target is None:
            raise ValueError("the speculators format names its verifier: pass the target")
        target_cfg = json.loads((Path(target) / "config.json").read_text())
        dcfg = to_speculators(dcfg, verifier=str(target), verifier_architectures=target_cfg.get("architectures") or [])
    elif draft_format != "vllm":
        raise ValueError(f"draft_format must be 'vllm' or 'speculators', not {draft_format!r}")
    out_dir.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to(torch.bfloat16 if v.is_floating_point() else v.dtype)
             .contiguous() for k, v in draft.state_dict().items()}
    state.update(extra or {})
    save_file(state, str(out_dir / "model.safetensors"))
    (out_dir / "config.json").write_text(json.dumps(dcfg, indent=2) + "\n")


def train(target: Path, seqs: list[dict], out_dir: Path, ckpt_path: Path, cfg: TrainConfig,
          eos_id: int) -> dict:
    """Train and write the draft; returns a summary for the model card."""
    if not seqs:
        raise ValueError("no answered sequences to train on")
    torch.manual_seed(cfg.seed)
    draft, dcfg, d2t_ids, embed = build_draft(target, seqs, cfg, eos_id)
    # a kept vocabulary keeps its t2d too, and the config.json as that draft wrote it, whatever its format
    extra = _kept_tensors(cfg.init_from) if cfg.keep_vocab else None
    draft_format = "vllm" if cfg.keep_vocab else cfg.draft_format
    embed_draft = embed[d2t_ids]
    draft.lm_head.weight.requires_grad_(cfg.train_lm_head)
    idx = list(range(len(seqs)))
    random.Random(cfg.seed).shuffle(idx)
    n_val = min(cfg.val_sequences, len(seqs) // 4)  # a small run still has rows to train on
    val_idx, train_idx = idx[:n_val], sorted(idx[n_val:])
    opt = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=cfg.lr,
                            betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    step, total, elapsed = 0, cfg.steps, 0.0
    if ckpt_path.exists():
        ck = torch.load(ckpt_path, weights_only=False)
        draft.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        step, total, elapsed = ck["step"], cfg.steps or ck["total"], ck["elapsed"]
        logger.info("resuming at step %d of %s", step, total)
    cache: dict = {}
    t0 = time.monotonic() - elapsed
    bar = tqdm(total=total, initial=step, desc="train", unit="step")
    while total is None or step < total:
        for g in opt.param_groups:
            g["lr"] = lr_at(step, total or 10**9, cfg)
        batch = make_batch(seqs, batch_at(seqs, train_idx, step, cfg, cache), cfg.row_tokens,
                           embed_draft)
        loss, accs, _ = step_loss(draft, embed, batch, cfg)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        opt.step()
        step += 1
        if total is None and step == 10:  # time budget: fix the schedule length once
            per_step = (time.monotonic() - t0) / step
            total = max(step + 1, int(cfg.minutes * 60 / per_step))
            bar.total = total
            logger.info("%.2f s/step: %d steps fit in %.0f min", per_step, total, cfg.minutes)
        bar.update(1)
        bar.set_postfix(loss=f"{loss.item():.3f}", acc="/".join(f"{a:.2f}" for a in accs))
        if step % cfg.ckpt_every == 0 or step == total:
            torch.save({"model": draft.state_dict(), "opt": opt.state_dict(), "step": step,
                        "total": total, "elapsed": time.monotonic() - t0}, ckpt_path)
    bar.close()
    train_seconds = time.monotonic() - t0
    val = evaluate(draft, embed, seqs, val_idx, cfg, embed_draft)
    save_draft(draft, dcfg, out_dir, draft_format=draft_format, target=target, extra=extra)
    n_tokens = sum(len(seqs[i]["input_ids"]) for i in train_idx)
    summary = {"steps": step, "train_seconds": round(train_seconds), "train_sequences":
               len(train_idx), "train_tokens": n_tokens, "val_sequences": len(val_idx),
               "val_accuracy_per_step": [round(a, 4) for a in val], "dtype": cfg.dtype,
               "config": asdict(cfg)}
    logger.info("training done: %s", summary)
    return summary
