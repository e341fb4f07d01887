"""The batch-size schedule of k (``speculative.num_speculative_tokens_per_batch_size``), in one place.

A schedule is a list of entries ``[lo, hi, k]``: inclusive ranges of the number of requests in
an engine step, and the k drafted there (k=0: no speculation in that range). vLLM picks the
entry of each step's batch size. The setting is either one schedule or one per kind of host,
keyed by the dtype the engine runs in (``{bfloat16: [...], float32: [...], default: [...]}``),
because ``engine.dtype: auto`` resolves per CPU and the schedule that pays differs with it.

This module owns the setting's type, the per-dtype lookup, validation, and the edits the
loader (a lowered k caps the schedule) and the bench (a derived schedule written into one
host's entry) make to it. Nothing here imports vLLM.
"""

from __future__ import annotations

import typing
from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import Discriminator, Tag

FIELD = "speculative.num_speculative_tokens_per_batch_size"
K_FIELD = "speculative.num_speculative_tokens"

Entry = tuple[int, int, int]
Schedule = list[Entry]
DtypeKey = Literal["bfloat16", "float16", "float32", "default"]
DTYPE_KEYS: tuple[str, ...] = typing.get_args(DtypeKey)
# The tags name the two forms of the setting; config errors leave them out of field names.
TAGS = ("union-schedule", "union-by-dtype")
Setting = Annotated[
    Annotated[Schedule, Tag(TAGS[0])] | Annotated[dict[DtypeKey, Schedule], Tag(TAGS[1])],
    Discriminator(lambda v: TAGS[1] if isinstance(v, dict) else TAGS[0]),
]
DTYPE_ALIASES = {"half": "float16", "float": "float32"}


def for_dtype(value: Schedule | Mapping[str, Schedule] | None, dtype: str) -> tuple[Schedule | None, str | None]:
    """The schedule that applies when the engine runs in `dtype`, and why (None when the
    setting is one schedule or none).

    A schedule per dtype picks the entry for the resolved dtype, else ``default``, else none
    (a fixed k of ``speculative.num_speculative_tokens``).
    """
    if not isinstance(value, Mapping):
        return value, None
    dtype = DTYPE_ALIASES.get(dtype, dtype)
    if dtype in value:
        return value[dtype], f"the {dtype} entry (the engine runs in {dtype})"
    if "default" in value:
        return value["default"], f"the default entry (no {dtype} entry)"
    return None, f"no entry for {dtype} and no default: a fixed k of {K_FIELD}"


def for_engine(settings: Any, dtype: str) -> tuple[Schedule | None, str | None]:
    """`for_dtype` of a ``Settings``' schedule: what its engine runs when it runs in `dtype`."""
    return for_dtype(settings.speculative.num_speculative_tokens_per_batch_size, dtype)


def entries(value: Schedule | Mapping[str, Schedule] | None) -> list[tuple[str, Schedule]]:
    """(field name, schedule) for each schedule the setting holds: one, or one per dtype."""
    if value is None:
        return []
    if isinstance(value, Mapping):
        return [(f"{FIELD}.{key}", schedule) for key, schedule in value.items()]
    return [(FIELD, value)]


def top_k(schedule: Schedule) -> int:
    """The largest k a schedule drafts."""
    return max((k for _, _, k in schedule), default=0)


def as_lists(schedule: Schedule | None) -> list[list[int]] | None:
    """JSON/YAML form: ``[[lo, hi, k], ...]``."""
    return None if schedule is None else [list(e) for e in schedule]


def problems(schedule: Schedule, k: int, max_num_seqs: int, where: str = "engine.max_num_seqs",
             field: str = FIELD) -> list[str]:
    """What is wrong with a schedule, one line each: ranges out of order, overlapping, with gaps or
    not reaching `max_num_seqs`, or a k outside 0..`k` (vLLM would silently cap it)."""
    if not schedule:
        return [f"{field}: empty; give entries [lo, hi, k] or leave it unset"]
    found: list[str] = []
    expected_lo = 1
    malformed = False
    for i, (lo, hi, k_i) in enumerate(schedule):
        entry = f"{field}[{i}] [{lo}, {hi}, {k_i}]"
        if lo < 1 or hi < lo:
            malformed = True  # then the coverage check below would only repeat this line
            found.append(f"{entry}: a range needs 1 <= lo <= hi (batch sizes are inclusive)")
        elif lo < expected_lo:
            found.append(f"{entry}: overlaps or is out of order with the previous range "
                         f"(next range must start at {expected_lo})")
        elif lo > expected_lo:
            found.append(f"{entry}: batch sizes {expected_lo}..{lo - 1} have no range "
                         f"(the ranges must cover 1..{max_num_seqs} without gaps)")
        if not 0 <= k_i <= k:
            found.append(f"{entry}: k must be in 0..{K_FIELD} ({k}); vLLM would silently cap it")
        expected_lo = max(expected_lo, hi + 1)
    if expected_lo <= max_num_seqs and not malformed:
        found.append(f"{field}: the ranges end at {expected_lo - 1} but {where} is "
                     f"{max_num_seqs}; extend the last range to {max_num_seqs}")
    return found


def capped(value: Any, k: int) -> Any:
    """The setting (raw: one schedule, a per-dtype map, or anything else left as is) with every
    entry's k lowered to at most `k`; entries that only differ in range are not merged."""
    def cap(schedule: Any) -> Any:
        if not isinstance(schedule, list):
            return schedule
        return [[*e[:2], min(e[2], k)] if isinstance(e, (list, tuple)) and len(e) == 3
                and isinstance(e[2], int) else e for e in schedule]

    if isinstance(value, Mapping):
        return {key: cap(schedule) for key, schedule in value.items()}
    return cap(value)


def with_entry(value: Schedule | Mapping[str, Schedule] | None, dtype: str,
               schedule: Schedule | None) -> Schedule | dict[str, Schedule] | None:
    """The setting with `schedule` for hosts that run in `dtype`: a per-dtype setting keeps the
    other hosts' entries and gets this dtype's (``default`` for a dtype it has no key for);
    a single schedule (or none) is replaced. `schedule` None removes this host's entry."""
    if not isinstance(value, Mapping):
        return schedule
    key = DTYPE_ALIASES.get(dtype, dtype)
    key = key if key in DTYPE_KEYS else "default"
    out = {k: v for k, v in value.items() if k != key}
    if schedule is not None:
        out[key] = schedule
    return out
