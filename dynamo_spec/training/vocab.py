"""The reduced draft vocabulary and its ``d2t`` offset table.

vLLM maps a draft id to a target id as ``target_id = draft_id + d2t[draft_id]``; the
draft ids are the ``size`` most frequent target ids in the answers, in ascending
target-id order (so ``d2t`` is non-decreasing and non-negative).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

import torch


def choose_draft_vocab(token_lists: Iterable[Iterable[int]], size: int, vocab_size: int,
                       always: Iterable[int] = ()) -> torch.Tensor:
    """Sorted target ids of the draft vocabulary: ``always`` first (e.g. eos), then by
    frequency (ties broken by smaller id), padded with the smallest unused ids."""
    counts = Counter()
    for toks in token_lists:
        counts.update(toks)
    chosen = list(dict.fromkeys(int(t) for t in always))
    for tok, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])):
        if len(chosen) >= size:
            break
        if tok not in chosen:
            chosen.append(int(tok))
    if len(chosen) < size:
        used = set(chosen)
        chosen += [t for t in range(vocab_size) if t not in used][: size - len(chosen)]
    return torch.tensor(sorted(chosen[:size]), dtype=torch.long)


def d2t_from_ids(draft_to_target: torch.Tensor) -> torch.Tensor:
    """The offsets vLLM loads: ``d2t[i] = target_id(i) - i`` (int64)."""
    return (draft_to_target - torch.arange(len(draft_to_target))).to(torch.int64)


def target_to_draft(draft_to_target: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Dense map target id -> draft id (-1 where not in the draft vocabulary)."""
    t2d = torch.full((vocab_size,), -1, dtype=torch.long)
    t2d[draft_to_target] = torch.arange(len(draft_to_target))
    return t2d
