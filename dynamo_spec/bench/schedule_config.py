"""The benchmarked config written again with the derived schedule (`config-with-schedule.yaml`)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from dynamo_spec.config import schedule as schedules

FILE = "config-with-schedule.yaml"


def _map_strings(value: Any, fn: Callable[[str], str]) -> Any:
    """`value` with `fn` applied to each string in it, through nested dicts and lists."""
    if isinstance(value, (dict, list)):
        items = value.items() if isinstance(value, dict) else enumerate(value)
        mapped = {key: _map_strings(v, fn) for key, v in items}
        return mapped if isinstance(value, dict) else list(mapped.values())
    return fn(value) if isinstance(value, str) else value


def _with_schedule(spec: dict[str, Any], schedule: list[list[int]], dtype: str) -> None:
    """`spec` (the speculative section) serving `schedule` where the engine runs in `dtype`.

    A config with a schedule per dtype keeps its other hosts' entries; one k everywhere needs
    no schedule, and k=0 everywhere turns speculation off."""
    key, k_key = schedules.FIELD.split(".")[-1], schedules.K_FIELD.split(".")[-1]
    per_dtype = spec.get(key)
    if isinstance(per_dtype, dict):
        per_dtype = schedules.with_entry(per_dtype, dtype, schedule)
        top = max(schedules.top_k(entry) for entry in per_dtype.values())
        spec["enabled"] = top > 0
        if top:
            spec[k_key] = top
        spec[key] = per_dtype
    elif (top := schedules.top_k(schedule)) == 0:
        spec["enabled"] = False
        spec.pop(key, None)
    else:
        spec["enabled"] = True
        spec[k_key] = top
        if len({k for _, _, k in schedule}) == 1:
            spec.pop(key, None)
        else:
            spec[key] = schedule


def write_schedule_config(config: Path, schedule: list[list[int]], out: Path, dtype: str = "default",
                          draft_token_cost: list[list[float]] | None = None) -> Path:
    """The benchmarked config with the derived schedule for `dtype` (the dtype the engine ran in
    here) and the confidence budget's measured cost of a verified draft token (where measured; the
    budget stays as the config has it, on or off); paths relative to the config rebased to the new
    file's folder."""
    from dynamo_spec.engine.host import detect_host

    base, target = config.parent.resolve(), out.parent.resolve()

    def rebase(value: str) -> str:
        if not value.startswith(("./", "../")):
            return value
        rel = os.path.relpath(os.path.normpath(base / value), target)
        return rel if rel.startswith("../") else "./" + rel

    data = _map_strings(yaml.safe_load(config.read_text()) or {}, rebase)
    _with_schedule(data.setdefault("speculative", {}), schedule, dtype)
    if draft_token_cost:
        data["speculative"].setdefault("draft_budget", {})["draft_token_cost"] = draft_token_cost
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(f"# Written by dynamo-spec bench from {config.name}; schedule derived on "
                   f"{detect_host().cpu_model} ({dtype}).\n" + yaml.safe_dump(data, sort_keys=False))
    return out
