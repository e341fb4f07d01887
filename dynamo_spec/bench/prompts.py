"""Prompt sets for the bench: JSON lines of chat messages or plain prompts.

Shipped sets (``dynamo_spec/bench/prompts/``): ``chat`` (everyday requests), ``code``
and ``summarize`` (a given passage to summarise). Each set is split in two by
position, even lines for deriving a schedule and odd lines for judging it, so a
schedule is never judged on the prompts it was derived from.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

SHIPPED = Path(__file__).parent / "prompts"
DEFAULT_SETS = ("chat", "code", "summarize")


class PromptError(ValueError):
    pass


def read_prompts(path: Path) -> list[dict[str, Any]]:
    """Items {"messages": [...]} from a JSONL file of {"messages": [...]} or {"prompt": "..."} lines."""
    items: list[dict[str, Any]] = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise PromptError(f"{path}:{number}: not JSON ({exc.msg})") from None
        if isinstance(row, dict) and isinstance(row.get("messages"), list) and row["messages"]:
            items.append({"messages": row["messages"]})
        elif isinstance(row, dict) and isinstance(row.get("prompt"), str):
            items.append({"messages": [{"role": "user", "content": row["prompt"]}]})
        else:
            raise PromptError(f"{path}:{number}: expected {{\"messages\": [...]}} or {{\"prompt\": \"...\"}}")
    if len(items) < 2:
        raise PromptError(f"{path}: needs at least 2 prompts (one to derive a schedule, one to judge it)")
    return items


def load_sets(paths: list[Path] | None = None) -> dict[str, list[dict[str, Any]]]:
    """name -> items; the shipped sets when `paths` is empty."""
    files = paths or [SHIPPED / f"{name}.jsonl" for name in DEFAULT_SETS]
    return {f.stem: read_prompts(f) for f in files}


def split(sets: dict[str, list[dict[str, Any]]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(derive, judge): even and odd items of each set, interleaved across sets."""
    derive: list[dict[str, Any]] = []
    judge: list[dict[str, Any]] = []
    for part, offset in ((derive, 0), (judge, 1)):
        columns = [items[offset::2] for items in sets.values()]
        for i in range(max(len(c) for c in columns)):
            part.extend(c[i] for c in columns if i < len(c))
    return derive, judge
