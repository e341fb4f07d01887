"""The target's greedy answers and its hidden states in one pass (a batched decoder).

vLLM's CPU engine decodes about 130 tokens/s here at any batch size, and a separate
transformers pass then recomputes every hidden state. This decoder runs the target's
own transformers modules (same weights, serving dtype) over a preallocated KV cache:
the prompt is prefilled once, each answer token is decoded once, and the aux layers and
final normed state of every position are kept as they go by, so no second pass is
needed. Batches are formed from prompts of similar length (left padding) and shrink as
rows finish.

Output: rows appended to ``answers.jsonl`` (as :mod:`.answers` writes them) and one
shard per batch in ``hidden/`` (as :mod:`.hidden_states` writes them), so an
interrupted run resumes at the next batch.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from .answers import chat_prompt_ids
from .hidden_states import shard_path, write_shard
from .rows import interleave_sources, read_jsonl, sample_seed

logger = logging.getLogger(__name__)


class BatchDecoder:
    """Greedy decoding of a Llama-family transformers model with a static KV cache."""

    def __init__(self, model, aux_layers: tuple[int, ...]):
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        self.model = model
        self.base = model.model
        cfg = model.config
        self.n_heads = cfg.num_attention_heads
        self.n_kv = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.n_heads
        self.aux_layers = tuple(aux_layers)
        self.dtype = next(model.parameters()).dtype
        self._rope = apply_rotary_pos_emb

    def _forward(self, ids, pos, cache, cols, mask):
        """Run ``ids`` [B, T] at positions ``pos`` -> aux [B, T, 3h], final [B, T, h].

        K/V go to cache columns ``cols`` (an int: columns cols..cols+T of every row; a
        tensor [B]: one column per row, T == 1); attention spans the mask's columns."""
        b, t = ids.shape
        span = mask.shape[-1]
        rows = torch.arange(b)
        h = self.base.embed_tokens(ids)
        cos, sin = self.base.rotary_emb(h, pos)
        aux = []
        for i, layer in enumerate(self.base.layers):
            if i in self.aux_layers:
                aux.append(h)
            attn = layer.self_attn
            x = layer.input_layernorm(h)
            q = attn.q_proj(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
            k = attn.k_proj(x).view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
            v = attn.v_proj(x).view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
            q, k = self._rope(q, k, cos, sin)
            kc, vc = cache[i]
            if isinstance(cols, int):
                kc[:, :, cols:cols + t] = k
                vc[:, :, cols:cols + t] = v
            else:
                kc[rows, :, cols] = k[:, :, 0]
                vc[rows, :, cols] = v[:, :, 0]
            o = self._attention(q, kc[:, :, :span], vc[:, :, :span], mask)
            h = h + attn.o_proj(o.transpose(1, 2).reshape(b, t, -1))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return torch.cat(aux, dim=-1), self.base.norm(h)

    def _attention(self, q, k, v, mask):
        """Grouped-query attention with a boolean mask [B, 1, T, C]; for one query
        token (decoding) two batched matmuls beat the CPU flash kernel."""
        b, _, t, d = q.shape
        if t > 1:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        g = self.n_heads // self.n_kv
        q = q.reshape(b, self.n_kv, g, d)                               # [B, kv, g, d]
        scores = torch.matmul(q, k.transpose(-1, -2)) * d ** -0.5      # [B, kv, g, C]
        scores = scores.masked_fill(~mask.view(b, 1, 1, -1), float("-inf"))
        probs = torch.softmax(scores.float(), dim=-1).to(v.dtype)
        return torch.matmul(probs, v).reshape(b, self.n_heads, 1, d)

    def _next_tokens(self, final_last, reqs=None, sampling=None):
        """Greedy next tokens for [B, h] final states; row j is sampled instead when
        ``sampling`` maps its request ``reqs[j]`` to ``(temperature, generator)``."""
        if self.model.config.tie_word_embeddings:
            logits = final_last @ self.base.embed_tokens.weight.T
        else:
            logits = self.model.lm_head(final_last)
        out = logits.argmax(dim=-1)
        for j, q in enumerate(reqs or ()):
            if sampling and q in sampling:
                temperature, gen = sampling[q]
                probs = torch.softmax(logits[j].float() / temperature, dim=-1)
                out[j] = torch.multinomial(probs, 1, generator=gen)[0]
        return out

    def _prefill(self, prompts: list[list[int]], max_batch_tokens: int = 4096):
        """Per prompt: aux [n, 3h], final [n, h] and K/V [layers][kv, n, d]; prompts of
        similar length are run together (right-padded) to keep the padding small."""
        out = [None] * len(prompts)
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
        while order:
            take = 0
            while take < len(order) and len(prompts[order[take]]) * (take + 1) <= max_batch_tokens:
                take += 1
            chunk, order = order[:max(take, 1)], order[max(take, 1):]
            plen = max(len(prompts[i]) for i in chunk)
            r = len(chunk)
            ids = torch.zeros(r, plen, dtype=torch.long)
            lens = torch.tensor([len(prompts[i]) for i in chunk])
            for j, i in enumerate(chunk):
                ids[j, :len(prompts[i])] = torch.tensor(prompts[i])
            cols = torch.arange(plen)
            mask = (cols[:, None] >= cols[None, :])[None] & (cols[None, None, :] < lens[:, None, None])
            mask |= torch.eye(plen, dtype=torch.bool)[None]  # padded queries see themselves
            cache = [(torch.zeros(r, self.n_kv, plen, self.head_dim, dtype=self.dtype),
                      torch.zeros(r, self.n_kv, plen, self.head_dim, dtype=self.dtype))
                     for _ in self.base.layers]
            aux, final = self._forward(ids, cols[None].expand(r, -1), cache, 0, mask[:, None])
            for j, i in enumerate(chunk):
                n = len(prompts[i])
                out[i] = (aux[j, :n], final[j, :n], [(k[j, :, :n], v[j, :, :n]) for k, v in cache])
        return out

    @torch.inference_mode()
    def stream(self, prompts: list[list[int]], max_new_tokens: int, eos_ids: set[int], *,
               batch_size: int = 64, refill_at: int | None = None,
               stop_at: float | None = None, sampling: dict | None = None):
        """Continuous batching: yield ``(index, answer_ids, aux, final)`` per prompt as it
        finishes (aux/final over prompt + answer). Finished slots are refilled with new
        prompts (prefilled together once ``refill_at`` slots are free); after the
        monotonic time ``stop_at`` no new prompt is started. ``sampling`` maps a prompt
        index to ``(temperature, seed)``: that answer is sampled, from its own seeded
        generator (so it does not depend on the batching); the others are greedy."""
        sampling = {q: (t, torch.Generator().manual_seed(seed))
                    for q, (t, seed) in (sampling or {}).items() if t > 0}
        refill_at = refill_at or max(1, batch_size // 8)
        width = max(len(p) for p in prompts) + max_new_tokens + 1
        cache = [(torch.zeros(batch_size, self.n_kv, width, self.head_dim, dtype=self.dtype),
                  torch.zeros(batch_size, self.n_kv, width, self.head_dim, dtype=self.dtype))
                 for _ in self.base.layers]
        lens = torch.zeros(batch_size, dtype=torch.long)     # tokens in each slot's cache
        nxt = torch.zeros(batch_size, dtype=torch.long)      # token each slot feeds next
        slot_req = [-1] * batch_size
        answers = {}
        # states are written into per-slot buffers: keeping each step's output tensors
        # alive instead makes every allocation a fresh page and halves the speed
        hid = self.base.config.hidden_size
        st_aux = torch.zeros(batch_size, width, len(self.aux_layers) * hid, dtype=self.dtype)
        st_final = torch.zeros(batch_size, width, hid, dtype=self.dtype)
        pending = list(range(len(prompts)))
        pending.reverse()
        while pending or any(q >= 0 for q in slot_req):
            if stop_at is not None and time.monotonic() > stop_at:
                pending.clear()
            free = [s for s in range(batch_size) if slot_req[s] < 0]
            if pending and (len(free) >= refill_at or len(free) == batch_size
                            or all(q < 0 for q in slot_req)):
                new = [pending.pop() for _ in range(min(len(free), len(pending)))]
                filled = self._prefill([prompts[q] for q in new])
                first = self._next_tokens(torch.stack([f[-1] for _, f, _ in filled]), new,
                                          sampling)
                for j, (q, s) in enumerate(zip(new, free)):
                    aux, final, kv = filled[j]
                    n = len(prompts[q])
                    for (kc, vc), (k, v) in zip(cache, kv):
                        kc[s, :, :n] = k
                        vc[s, :, :n] = v
                    lens[s], nxt[s], slot_req[s] = n, first[j], q
                    answers[q] = [int(first[j])]
                    st_aux[s, :n] = aux
                    st_final[s, :n] = final
            live = torch.tensor([q >= 0 for q in slot_req])
            span = int(lens.max()) + 1
            mask = (torch.arange(span)[None, :] <= lens[:, None])[:, None, None]
            aux, final = self._forward(nxt[:, None], lens[:, None], cache, lens, mask)
            slots = torch.arange(batch_size)
            st_aux[slots, lens] = aux[:, 0]
            st_final[slots, lens] = final[:, 0]
            lens = torch.where(live, lens + 1, lens)
            nxt = self._next_tokens(final[:, 0], slot_req, sampling)
            for s, q in enumerate(slot_req):
                if q < 0:
                    continue
                ans = answers[q]
                if ans[-1] in eos_ids or len(ans) >= max_new_tokens:
                    n = int(lens[s])
                    yield q, answers.pop(q), st_aux[s, :n].clone(), st_final[s, :n].clone()
                    slot_req[s], lens[s] = -1, 0
                else:
                    ans.append(int(nxt[s]))

    def generate(self, prompts: list[list[int]], max_new_tokens: int, eos_ids: set[int],
                 batch_size: int = 64, sampling: dict | None = None):
        """All answers, in prompt order: ``(answer_ids, aux, final)`` per prompt."""
        out = {q: (a, x, f) for q, a, x, f in self.stream(prompts, max_new_tokens, eos_ids,
                                                          batch_size=batch_size,
                                                          sampling=sampling)}
        return [out[q] for q in range(len(prompts))]


def model_eos_ids(model) -> set[int]:
    """The ids that end an answer (a model config holds one id or a list)."""
    eos = model.config.eos_token_id
    return set(eos if isinstance(eos, list) else [eos])


def generate_with_states(target: Path, prompts_path: Path, work: Path, *,
                         aux_layers: tuple[int, ...], max_new_tokens: int,
                         batch_size: int = 64, max_prompt_tokens: int = 512,
                         rows_per_shard: int = 128, dtype: str = "bfloat16",
                         minutes: float | None = None, threads: int | None = None,
                         skip_ids: set[str] = frozenset(), seed: int = 0) -> Path:
    """Answer the train prompts of ``prompts_path`` not yet answered (nor in
    ``skip_ids``): the smaller sources first, then chit-chat, each in file order.

    Appends to ``work/answers.jsonl`` and writes ``work/hidden/shard-*`` every
    ``rows_per_shard`` answers (a shard, then its answer rows), so an interrupted run
    loses at most the unwritten rows and resumes with them. ``minutes`` is a budget over
    all runs (the seconds spent are kept in ``work/answers.seconds``): once it is spent
    no new prompt is started, and the ones in flight finish. Rows with a
    ``temperature`` are sampled, seeded by ``seed`` and the row id.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if threads:
        torch.set_num_threads(threads)
    answers_path, hidden = work / "answers.jsonl", work / "hidden"
    hidden.mkdir(parents=True, exist_ok=True)
    done = {r["id"] for r in read_jsonl(answers_path)} if answers_path.exists() else set()
    todo = [r for r in read_jsonl(prompts_path, split="train")
            if r["id"] not in done and r["id"] not in skip_ids]
    # the smaller sources first (interleaved), then chit-chat, so a time budget that
    # runs out still leaves every source answered
    todo = (interleave_sources([r for r in todo if r["source"] != "chitchat"])
            + [r for r in todo if r["source"] == "chitchat"])
    tok = AutoTokenizer.from_pretrained(target)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=getattr(torch, dtype)).eval()
    eos_ids = model_eos_ids(model)
    encoded = [(r, chat_prompt_ids(tok, r["messages"])) for r in todo]
    encoded = [(r, ids) for r, ids in encoded if len(ids) <= max_prompt_tokens]
    spent_file = work / "answers.seconds"
    spent = float(spent_file.read_text()) if spent_file.exists() else 0.0
    if not encoded or (minutes is not None and spent >= 60 * minutes):
        logger.info("answers+states complete (%.0f s spent): %s", spent, answers_path)
        return answers_path
    decoder = BatchDecoder(model, aux_layers)
    index = sum(int(p.stem.split("-")[2]) for p in hidden.glob("shard-*.safetensors"))
    start, n_answer, buffer = time.monotonic(), 0, []

    def flush(f):
        nonlocal index
        if not buffer:
            return
        write_shard(shard_path(hidden, index, len(buffer)), [b[1:] for b in buffer])
        for r, ids, ans, _, _ in buffer:
            f.write(json.dumps({"id": r["id"], "source": r["source"], "prompt_ids": ids,
                                "answer_ids": ans,
                                "answer": tok.decode(ans, skip_special_tokens=True)}) + "\n")
        f.flush()
        index += len(buffer)
        buffer.clear()
        spent_file.write_text(f"{spent + time.monotonic() - start:.0f}")

    budget = None if minutes is None else start + 60 * minutes - spent
    # prompts of similar length decode side by side (the attention spans the longest)
    window = 8 * batch_size
    encoded = [x for w in range(0, len(encoded), window)
               for x in sorted(encoded[w:w + window], key=lambda x: len(x[1]))]
    prompts = [ids for _, ids in encoded]
    sampling = {q: (r["temperature"], sample_seed(seed, r["id"]))
                for q, (r, _) in enumerate(encoded) if r.get("temperature")}
    with open(answers_path, "a") as f, tqdm(total=len(encoded), desc="answers+states",
                                             unit="prompt") as bar:
        for q, ans, aux, fin in decoder.stream(prompts, max_new_tokens, eos_ids,
                                               batch_size=batch_size,
                                               stop_at=budget, sampling=sampling):
            r, ids = encoded[q]
            buffer.append((r, ids, ans, aux, fin))
            n_answer += len(ans)
            bar.update(1)
            bar.set_postfix(answer_tok_s=f"{n_answer / (time.monotonic() - start):.0f}")
            if len(buffer) >= rows_per_shard:
                flush(f)
        flush(f)
    logger.info("answers+states: %d answer tokens in %.0f s", n_answer, time.monotonic() - start)
    return answers_path
