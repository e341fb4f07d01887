"""The EAGLE-3 draft head, written to mirror vLLM's ``llama_eagle3.py`` exactly, and
its training-time-test (TTT) loss.

Layout (tensor names are the checkpoint's): ``fc`` fuses the target's three aux hidden
states; one decoder layer ``midlayer`` whose attention reads ``[norm(embed), norm(h)]``
(2 x hidden); ``norm``; ``lm_head`` over the reduced draft vocabulary; ``d2t`` maps
draft ids to target ids. The token embedding is the target's (frozen, not saved).

Training-time test: step 0 feeds ``fc(aux)``; step j > 0 feeds the draft's own
pre-norm output of step j - 1, one token further on. A query of step j at index t
sees step-0 keys at indices <= t and the keys of steps 1..j at index t only: the
chain that vLLM builds when it drafts j tokens after position t.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * x).to(dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float):
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    freqs = positions.float()[..., None] * inv  # [..., T, hd/2]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Neox-style rotary (``rotate_half``), as Llama in vLLM and transformers."""
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x * cos + rot * sin).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        h = cfg["hidden_size"]
        self.heads, self.kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
        self.hd = cfg.get("head_dim") or h // self.heads
        self.q_proj = nn.Linear(2 * h, self.heads * self.hd, bias=False)
        self.k_proj = nn.Linear(2 * h, self.kv_heads * self.hd, bias=False)
        self.v_proj = nn.Linear(2 * h, self.kv_heads * self.hd, bias=False)
        self.o_proj = nn.Linear(self.heads * self.hd, h, bias=False)

    def qkv(self, x, cos, sin):
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.heads, self.hd).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.kv_heads, self.hd).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.kv_heads, self.hd).transpose(1, 2)
        rep = self.heads // self.kv_heads
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def forward(self, x, cos, sin, mask, cache: list):
        """``mask`` [B, S, T] (bool, True = may attend) for the step-0 keys; ``cache``
        holds (k, v) of earlier steps: index 0 all T keys, later ones (computed on the
        same S query rows) seen on the diagonal only."""
        B, T, _ = x.shape
        q, k, v = self.qkv(x, cos, sin)
        scale = 1.0 / math.sqrt(self.hd)
        if not cache:
            cache.append((k, v))
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], scale=scale)
        else:
            k0, v0 = cache[0]
            cache.append((k, v))
            s0 = (q @ k0.transpose(-1, -2)) * scale
            s0 = s0.masked_fill(~mask[:, None], float("-inf"))
            diag = torch.stack([(q * ki).sum(-1) * scale for ki, _ in cache[1:]], dim=-1)
            probs = torch.cat([s0, diag], dim=-1).float().softmax(-1).to(q.dtype)
            n0 = k0.shape[2]
            out = probs[..., :n0] @ v0
            out = out + sum(probs[..., n0 + i, None] * vi for i, (_, vi) in enumerate(cache[1:]))
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, h: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(h, inter, bias=False)
        self.up_proj = nn.Linear(h, inter, bias=False)
        self.down_proj = nn.Linear(inter, h, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MidLayer(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        h, eps = cfg["hidden_size"], cfg["rms_norm_eps"]
        self.input_layernorm = RMSNorm(h, eps)
        self.hidden_norm = RMSNorm(h, eps)
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.self_attn = Attention(cfg)
        self.mlp = MLP(h, cfg["intermediate_size"])

    def forward(self, emb, hidden, cos, sin, mask, cache):
        residual = hidden  # vLLM's default: the residual is taken before hidden_norm
        x = torch.cat([self.input_layernorm(emb), self.hidden_norm(hidden)], dim=-1)
        residual = self.self_attn(x, cos, sin, mask, cache) + residual
        x = self.post_attention_layernorm(residual)
        return self.mlp(x) + residual  # pre-norm output


class Eagle3Draft(nn.Module):
    """Trainable part of the draft; ``d2t`` is a buffer saved with the weights."""

    def __init__(self, cfg: dict):
        super().__init__()
        h = cfg["hidden_size"]
        self.cfg = cfg
        self.fc = nn.Linear(3 * cfg["target_hidden_size"], h, bias=False)
        self.midlayer = MidLayer(cfg)
        self.norm = RMSNorm(h, cfg["rms_norm_eps"])
        self.lm_head = nn.Linear(h, cfg["draft_vocab_size"], bias=False)
        self.register_buffer("d2t", torch.zeros(cfg["draft_vocab_size"], dtype=torch.long))
        rope = cfg.get("rope_parameters") or {}
        self.rope_theta = float(rope.get("rope_theta") or cfg.get("rope_theta") or 10000.0)

    def step(self, emb, hidden, positions, mask, cache):
        """One draft step: the pre-norm output (the next step's hidden input)."""
        cos, sin = rope_cos_sin(positions, self.midlayer.self_attn.hd, self.rope_theta)
        cos, sin = cos[:, None].to(emb.dtype), sin[:, None].to(emb.dtype)
        return self.midlayer(emb, hidden, cos, sin, mask, cache)

    def logits(self, pre: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(pre))


def ttt_loss(draft: Eagle3Draft, embed: torch.Tensor, batch: dict, steps: int = 3,
             decay: float = 0.8) -> tuple[torch.Tensor, list[float], list[float]]:
    """EAGLE-3 training-time-test loss over ``steps`` draft steps.

    ``batch`` (all [B, T, ...], packed rows of whole sequences):
      ``input_ids`` tokens; ``aux`` target aux hidden states [B, T, 3h];
      ``target_probs`` target's next-token distribution over the draft vocabulary at
      each position [B, T, V_d]; ``loss_mask`` 1 where the token at t + 1 is an
      answer token; ``segment`` sequence index within the row; ``positions``.
    Step j at index t reads token t + 1 + j, sits at position t + j, and is scored
    (soft cross-entropy) against the target's distribution at t + 1 + j, only where
    that predicts an answer token of the same sequence. Step losses are weighted
    ``decay ** j``. Returns (loss, per-step top-1 accuracy, per-step loss).
    """
    ids, seg, pos = batch["input_ids"], batch["segment"], batch["positions"]
    B, T = ids.shape
    assert B == 1, "rows are packed: one row per batch"
    same = seg[:, :, None] == seg[:, None, :]
    mask = same & torch.ones(T, T, dtype=torch.bool).tril()
    valid = []
    for j in range(steps):
        shift = j + 1
        same_seq = F.pad(seg[:, shift:], (0, shift), value=-1) == seg
        valid.append(same_seq & (F.pad(batch["loss_mask"][:, shift:], (0, shift)) > 0))
    # Steps >= 1 only matter where some later step is scored (not on prompt tokens).
    sub = torch.stack(valid[1:]).any(0)[0].nonzero()[:, 0] if steps > 1 else None
    hidden = draft.fc(batch["aux"])
    cache: list = []
    total, accs, losses = 0.0, [], []
    for j in range(steps):
        shift = j + 1
        nxt = F.pad(ids[:, shift:], (0, shift))
        if j == 0:
            rows, qmask = torch.arange(T), mask
        else:
            rows, qmask = sub, mask[:, sub]
            hidden = hidden[:, sub] if j == 1 else hidden
        pre = draft.step(embed[nxt[:, rows]], hidden, (pos + j)[:, rows], qmask, cache)
        hidden = pre
        sel = valid[j][:, rows].nonzero(as_tuple=True)
        logits = draft.logits(pre[sel]).float()
        target = batch["target_probs"][sel[0], rows[sel[1]] + shift]
        if len(sel[0]):
            step_loss = -(target * logits.log_softmax(-1)).sum(-1).mean()
        else:
            step_loss = logits.sum() * 0.0
        total = total + (decay ** j) * step_loss
        with torch.no_grad():
            hit = logits.argmax(-1) == target.argmax(-1)
            accs.append(float(hit.float().mean()) if len(sel[0]) else 0.0)
        losses.append(float(step_loss.detach()))
    return total, accs, losses
