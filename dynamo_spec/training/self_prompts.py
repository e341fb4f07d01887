"""Prompts written by the target itself (Magpie: Xu et al., 2024, arXiv:2406.08464).

An instruction-tuned model given only its chat template up to the start of a user turn
writes a plausible user request: the kinds of requests it was tuned on. Sampled,
filtered and deduplicated, these add instruction prompts with no download and no
licence beyond the target's own. Their answers come later, greedy, like every other
prompt's; the training targets stay the target's own distribution.
"""

from __future__ import annotations

import logging
import math
import re
from pathlib import Path

import torch
from tqdm import tqdm

from .rows import read_jsonl, sample_seed, write_jsonl

logger = logging.getLogger(__name__)

SOURCE = "magpie"
_MARK = "@@MAGPIE_QUERY@@"
# (start, end) of each kind of request, used in turn: a free request (plain Magpie), and
# one started for it ("Magpie with a prefix") to get multiple-choice questions, ended
# like the MMLU source's prompts.
KINDS: tuple[tuple[str, str], ...] = (
    ("", ""),
    ("", ""),
    ("Which of the following", "\nExplain your reasoning, then give the answer."),
)
# Requests steered to what users send a chat model (explanations,
# how-tos, recipes, tips, poems and stories, writing help, comparisons), one free kind
# among them so the mix keeps the target's own spread.
INSTRUCTION_KINDS: tuple[tuple[str, str], ...] = (
    ("", ""),
    ("Explain", ""),
    ("How do I", ""),
    ("Give me a recipe for", ""),
    ("What are some tips for", ""),
    ("Write a short", ""),
    ("Can you help me write", ""),
    ("What is the difference between", ""),
    ("How does", ""),
)
# The instruction kinds plus the questions the everyday set scores lowest on: explanations
# of how and why things work, and facts about the world, history and the body.
EVERYDAY_KINDS: tuple[tuple[str, str], ...] = INSTRUCTION_KINDS + (
    ("Why do", ""),
    ("Why is", ""),
    ("What causes", ""),
    ("Tell me about", ""),
    ("What is", ""),
    ("How did", ""),
    ("Explain how", ""),
)
KIND_SETS = {"mixed": KINDS, "instructions": INSTRUCTION_KINDS, "everyday": EVERYDAY_KINDS}


def pre_query_ids(tokenizer) -> list[int]:
    """The chat template (with its default system prompt, if any) up to where a user
    message's text starts."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": _MARK}], tokenize=False)
    head, sep, _ = text.partition(_MARK)
    if not sep:
        raise ValueError("the chat template does not echo the user message")
    return tokenizer(head, add_special_tokens=False)["input_ids"]


def keep_query(text: str, min_chars: int) -> bool:
    """A usable request: long enough, and no template markup leaked into it."""
    return len(text) >= min_chars and "<|" not in text and _MARK not in text


def sample_requests(model, heads: list[list[int]], eos_ids: set[int], *, seed: int = 0,
                    temperature: float = 1.0, max_new_tokens: int = 96,
                    batch_size: int = 64) -> list[list[int]]:
    """One continuation of each of ``heads``, each sampled from its own generator seeded
    by ``seed`` and its index, so they do not depend on the batching."""
    from .decode import BatchDecoder

    m = len(heads)
    sampling = {i: (temperature, sample_seed(seed, f"{SOURCE}-{i}")) for i in range(m)}
    decoder = BatchDecoder(model, aux_layers=(0,))  # the states are not needed here
    out: dict[int, list[int]] = {}
    with tqdm(total=m, desc="self-prompts", unit="prompt") as bar:
        for i, ans, _, _ in decoder.stream(heads, max_new_tokens, eos_ids,
                                           batch_size=batch_size, sampling=sampling):
            out[i] = ans
            bar.update(1)
    return [out[i] for i in range(m)]


def _words(text: str) -> frozenset[str]:
    return frozenset(re.findall(r"[a-z0-9]+", text.lower()))


def near_duplicate(text: str, others: list[frozenset[str]], threshold: float = 0.6) -> bool:
    """Whether ``text`` shares at least ``threshold`` of its words with one of ``others``
    (word sets, :func:`_words`), by Jaccard similarity of the word sets."""
    words = _words(text)
    return any(len(words & o) >= threshold * len(words | o) for o in others if words | o)


def select_queries(tokenizer, requests: list[list[int]], eos_ids: set[int], n: int,
                   min_chars: int = 24, kinds: list[tuple[str, str]] | None = None,
                   known: set[str] = frozenset(), avoid: tuple[str, ...] = ()) -> list[str]:
    """The first ``n`` usable requests in order: ended on their own (EOS before the
    token cap), pass :func:`keep_query` with their start, and new (case-insensitive),
    also against ``known`` (lower-cased texts of earlier runs' prompts), and no near
    duplicate (:func:`near_duplicate`) of a text in ``avoid`` (the evaluation set's).
    ``kinds[i]`` is the (start, end) of request i: the text is start + request + end."""
    out, seen = [], {k.lower() for k in known}
    avoided = [_words(a) for a in avoid]
    for i, ans in enumerate(requests):
        if not ans or ans[-1] not in eos_ids:
            continue  # cut off at max_new_tokens
        start, end = kinds[i] if kinds else ("", "")
        text = (start + tokenizer.decode(ans, skip_special_tokens=True)).strip()
        key = (text + end).lower()
        if keep_query(text, min_chars) and key not in seen and not near_duplicate(text, avoided):
            seen.add(key)
            out.append(text + end)
            if len(out) == n:
                break
    return out


def write_self_prompts(target: Path, path: Path, n: int, *, seed: int = 0,
                       temperature: float = 0.8, max_new_tokens: int = 96,
                       batch_size: int = 64, min_chars: int = 24,
                       dtype: str = "bfloat16", attempts: float = 1.4,
                       kinds: tuple[tuple[str, str], ...] = KINDS,
                       known: set[str] = frozenset(), avoid: tuple[str, ...] = (),
                       answer_temperatures: tuple[float, ...] = (0.0,)) -> Path:
    """Write at most ``n`` target-written prompts to ``path`` once (idempotent):
    ``ceil(attempts * n)`` sampled requests (:func:`sample_requests`), request i of kind
    ``kinds[i % len(kinds)]``, and the first ``n`` usable ones not in ``known`` nor near
    ``avoid`` (:func:`select_queries`) as ``{"id", "source", "split", "messages"}`` rows, as
    :func:`.data.build_prompts` writes them. Row i is answered at
    ``answer_temperatures[i % len]`` (0: greedy; otherwise the row has a ``temperature``,
    as :func:`.data.sampled_rows` writes). Ids carry a non-zero ``seed`` so that runs
    with different seeds can be trained on together."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .decode import model_eos_ids

    if path.exists():
        return path
    tok = AutoTokenizer.from_pretrained(target)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=getattr(torch, dtype)).eval()
    eos_ids = model_eos_ids(model)
    m = math.ceil(attempts * n)
    head = pre_query_ids(tok)
    per = [kinds[i % len(kinds)] for i in range(m)]
    heads = [head + (tok.encode(start, add_special_tokens=False) if start else [])
             for start, _ in per]
    requests = sample_requests(model, heads, eos_ids, seed=seed, temperature=temperature,
                               max_new_tokens=max_new_tokens, batch_size=batch_size)
    texts = select_queries(tok, requests, eos_ids, n, min_chars, per, known, avoid)
    logger.info("self-prompts: kept %d of %d sampled requests", len(texts), m)
    prefix = SOURCE if seed == 0 else f"{SOURCE}-s{seed}"
    rows = [{"id": f"{prefix}-{i:05d}", "source": SOURCE, "split": "train",
             "messages": [{"role": "user", "content": text}]} for i, text in enumerate(texts)]
    for i, row in enumerate(rows):
        if t := answer_temperatures[i % len(answer_temperatures)]:
            row["temperature"] = t
    return write_jsonl(path, rows)


def merge_prompt_files(out: Path, *paths: Path) -> Path:
    """One prompt file with the rows of ``paths`` in order (written once)."""
    if not out.exists():
        write_jsonl(out, [r for p in paths for r in read_jsonl(p)])
    return out
