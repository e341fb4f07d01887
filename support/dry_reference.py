"""DRY written from its definition, one sequence at a time in plain Python (p-e-w's original
for text-generation-webui, ``DRYLogitsProcessor``): what ``dynamo_spec.sampling.dry`` is tested against."""

from __future__ import annotations


def dry_reference(context: list[int], multiplier: float, base: float, allowed_length: int,
                  breakers: set[int], last_n: int = -1) -> dict[int, float]:
    """Token id -> the amount DRY subtracts from its logit after ``context``."""
    if multiplier == 0 or last_n == 0:
        return {}
    row = context[-last_n:] if last_n > 0 else list(context)
    if not row or row[-1] in breakers:
        return {}
    last = row[-1]
    match_lengths: dict[int, int] = {}
    for i in range(len(row) - 1):  # the last token itself always matches: excluded
        if row[i] != last:
            continue
        next_token = row[i + 1]
        if next_token in breakers:
            continue
        match_length = 1
        while match_length < 50:
            j = i - match_length
            if j < 0:
                break
            previous = row[-(match_length + 1)]
            if row[j] != previous or previous in breakers:
                break
            match_length += 1
        match_lengths[next_token] = max(match_length, match_lengths.get(next_token, 0))
    return {token: multiplier * base ** (length - allowed_length)
            for token, length in match_lengths.items() if length >= allowed_length}
