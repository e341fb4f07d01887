"""Everyday requests whose answers a program can check, and the checks.

``checked_eval.jsonl`` beside this file: 42 requests (lists of known items, counting, the
alphabet, copying a sentence, small arithmetic, a function with a given name, JSON with given
keys, capital cities), each with its check. Sampling defaults are judged by how many answers stay
right (``eval-sampling``), not by loops alone: a penalty that stops loops can also break the
answers that must repeat words, such as lists and counts.

Checks (``check`` of a row; text compared lower-cased):

- ``in_order``: every item, in this order;
- ``all``: every pattern (a regular expression; ``a|b`` for either), in any order;
- ``numbers``: the integers of the answer hold this run, in order, one after the other;
- ``letters``: the answer's single letters hold this run of letters, in order;
- ``answer``: this integer is among the answer's numbers;
- ``json_keys``: a JSON object in the answer has these keys.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

CHECKED_EVAL = Path(__file__).with_name("checked_eval.jsonl")


def load_checked(path: Path = CHECKED_EVAL) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def _in_order(text: str, items: list[str]) -> bool:
    pos = 0
    for item in items:
        found = text.find(item, pos)
        if found < 0:
            return False
        pos = found + len(item)
    return True


def _contains_run(values: list, run: list) -> bool:
    n = len(run)
    return any(values[i:i + n] == run for i in range(len(values) - n + 1))


def _json_objects(text: str) -> list[dict]:
    objects, decoder = [], json.JSONDecoder()
    for match in re.finditer(r"\{", text):
        try:
            value, _ = decoder.raw_decode(text[match.start():])
        except ValueError:
            continue
        if isinstance(value, dict):
            objects.append(value)
    return objects


def passes(answer: str, check: dict[str, Any]) -> bool:
    """Whether ``answer`` passes ``check`` (one kind per check)."""
    [(kind, want)] = check.items()
    text = answer.lower()
    if kind == "in_order":
        return _in_order(text, want)
    if kind == "all":
        return all(re.search(pattern, text) for pattern in want)
    if kind == "numbers":  # a numbered list's own enumerators ("3. 3") are not the answer's numbers
        unnumbered = re.sub(r"(?m)^\s*\d+[.)][ \t]+(?=\S)", "", text)
        return _contains_run([int(n) for n in re.findall(r"-?\d+", unnumbered)], want)
    if kind == "letters":
        return _contains_run(re.findall(r"\b[a-z]\b", text), list(want))
    if kind == "answer":
        return want in [int(n) for n in re.findall(r"-?\d+", text)]
    if kind == "json_keys":
        return any(set(want) <= set(obj) for obj in _json_objects(answer))
    raise ValueError(f"unknown check {kind!r}")
