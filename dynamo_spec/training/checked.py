"""Everyday requests whose answers a program can check, and the checks.

``checked_eval.jsonl`` beside this file: 46 requests (lists of known items, counting, the
alphabet, copying a sentence, small arithmetic, a function with a given name, JSON with given
keys, capital cities), each with its check. Sampling defaults are judged by how many answers stay
right (``eval-sampling``), not by loops alone: a penalty that stops loops can also break the
answers that must repeat words, such as lists and counts; and a list that runs on past its end
("7. Sunday 8. Monday 9. Tuesday ...", a loop no repeated 4-gram shows) is a wrong answer.

Checks (``check`` of a row; text compared lower-cased):

- ``in_order``: every item, in this order, and the list ends there: it does not start again (its
  first three items, in order, after its end) nor number an item past its length ("8." of seven);
- ``all``: every pattern (a regular expression; ``a|b`` for either), in any order;
- ``numbers``: the integers of the answer hold this run, in order, one after the other, and the
  run ends there: the next integer does not go on by the run's last step (11 after 1 to 10), nor
  does the run's start come again;
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


RESTART = 3  # a list starts again when this many of its first items come again, in order, after its end


def _in_order(text: str, items: list[str], start: int = 0) -> int | None:
    """Where the first occurrence of ``items`` in this order (from ``start``) ends, or None."""
    pos = start
    for item in items:
        found = text.find(item, pos)
        if found < 0:
            return None
        pos = found + len(item)
    return pos


def _entry(item: str) -> re.Pattern:
    """``item`` where it starts an entry of a list: at the start of a line, after an enumerator ("8. "),
    a bullet or a comma ("monday, tuesday"), possibly in bold; not inside a sentence."""
    return re.compile(r"(?m)(?:^[ \t]*(?:[-*][ \t]*)?(?:\d+[.)][ \t]*)?|[,;][ \t]*|\d+[.)][ \t]+)(?:\*\*)?"
                      + re.escape(item))


def _numbered_past(text: str, items: list[str], start: int) -> bool:
    """Whether an entry from ``start`` on is numbered past the list's length: "8. " at the start of a
    line, or "8. monday" inside one."""
    listed = "|".join(re.escape(item) for item in items)
    numbers = (re.findall(r"(?m)^[ \t]*(?:[-*][ \t]*)?(\d+)[.)][ \t]+(?=\S)", text[start:])
               + re.findall(rf"(?<![\d.])(\d+)[.)][ \t]+(?:\*\*)?(?={listed})", text[start:]))
    return any(int(n) > len(items) for n in numbers)


def list_runs_on(text: str, items: list[str]) -> bool:
    """Whether a list that holds ``items`` in order (lower-cased text) goes on past its end: its first
    items start entries again after it (in order), or an entry is numbered past its length."""
    end = _in_order(text, items)
    if end is None:
        return False
    pos = end
    for item in items[:RESTART]:
        again = _entry(item).search(text, pos)
        if again is None:
            break
        pos = again.end()
    else:
        return True
    return _numbered_past(text, items, text.find(items[0]))


def _run_at(values: list, run: list) -> int | None:
    """Index after the first occurrence of ``run`` in ``values`` (contiguous), or None."""
    n = len(run)
    return next((i + n for i in range(len(values) - n + 1) if values[i:i + n] == run), None)


def run_goes_on(values: list[int], run: list[int]) -> bool:
    """Whether integers that hold ``run`` go on past it: the next one continues its last step, or its
    first values come again (one after the other) later."""
    end = _run_at(values, run)
    if end is None:
        return False
    step = run[-1] - run[-2] if len(run) > 1 else 1
    if end < len(values) and values[end] == run[-1] + step:
        return True
    return _run_at(values[end:], run[:RESTART]) is not None


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
        return _in_order(text, want) is not None and not list_runs_on(text, want)
    if kind == "all":
        return all(re.search(pattern, text) for pattern in want)
    if kind == "numbers":  # a numbered list's own enumerators ("3. 3") are not the answer's numbers
        unnumbered = re.sub(r"(?m)^\s*\d+[.)][ \t]+(?=\S)", "", text)
        values = [int(n) for n in re.findall(r"-?\d+", unnumbered)]
        return _run_at(values, want) is not None and not run_goes_on(values, want)
    if kind == "letters":
        return _run_at(re.findall(r"\b[a-z]\b", text), list(want)) is not None
    if kind == "answer":
        return want in [int(n) for n in re.findall(r"-?\d+", text)]
    if kind == "json_keys":
        return any(set(want) <= set(obj) for obj in _json_objects(answer))
    raise ValueError(f"unknown check {kind!r}")
