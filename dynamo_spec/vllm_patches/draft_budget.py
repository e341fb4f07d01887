"""The confidence draft budget: per step, verify only the draft tokens likely to survive.

A draft token is worth verifying when what it saves beats what it costs. Verifying one
more draft token costs about ``c`` plain steps per request of the step (``c``: the
measured cost of one verified draft token at this many requests, ``draft_token_cost``);
it yields one more token with the probability that it and every draft token before it
are accepted, its *survival* ``s``. A step that verifies ``n`` draft tokens across ``B``
requests, with survivals summing to ``S``, yields ``B + S`` tokens for ``1 + c n / B``
plain steps. Adding a token of survival ``s`` raises that rate exactly when

    s > c (B + S) / (B + c n)

so the step's best set is found greedily: every draft token of the step ranked by
survival (a request's survivals never grow along its draft, so each request keeps a
prefix), taken while the next one clears the bar, which rises as tokens are taken. The
first token needs ``s > c``; the bar is the step's own yield, so a batch rich in sure
drafts asks more of the doubtful ones. The cut is per request and happens before
verification: the target's verification pass shrinks.

Survival comes from the draft's own probability of each token it proposed
(``draft_confidence``), calibrated online: the acceptance of each (position, confidence
decile) cell is counted from the drafts the target verifies (a token is judged when every
token before it was accepted), starting from the confidence itself as a prior worth
``prior_weight`` observations, counts halved past ``max_count`` so it follows drift. A
draft whose probabilities are right (the shipped one: calibration error 0.02-0.04) is
used as it is; one that is confidently wrong, or right while unsure, is corrected once
its cells are observed. Two rules keep the cells observed: a draft token whose cell
holds fewer than ``min_observations`` is verified (with the tokens before it, where those
are worth verifying themselves), and every ``explore_every``-th draft is verified whole.

No vLLM import: ``draft_admission`` calls :meth:`DraftBudget.admit` with each step's
confidences (cut to the request's other caps) and :meth:`DraftBudget.observe` with each
verified draft.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

# The budget's settings in the engine's switches (``vllm_patches.switches_of``; None or absent: no budget).
BUDGET_KEY = "draft_budget"


@dataclass(frozen=True)
class BudgetConfig:
    """``speculative.draft_budget`` as the engine's processes get it (the settings' defaults, written
    only there: config/settings.py, DraftBudgetSettings), and the budget's own constants."""

    # (requests in the step, cost of one verified draft token in plain steps per request),
    # requests ascending: linear between points, flat beyond the ends.
    draft_token_cost: tuple[tuple[int, float], ...]
    min_observations: int
    explore_every: int
    bins: int = 10
    prior_weight: float = 2.0
    max_count: float = 2000.0

    def to_switch(self) -> dict:
        """The value of :data:`BUDGET_KEY` in the engine's switches (plain JSON data: lists, not tuples,
        so that vLLM's config hash, a JSON dump, and a copy through any process see the same)."""
        values = asdict(self)
        values["draft_token_cost"] = [list(p) for p in self.draft_token_cost]
        return values

    @classmethod
    def from_switches(cls, switches: Mapping[str, Any]) -> BudgetConfig | None:
        values = switches.get(BUDGET_KEY)
        if not values:
            return None
        return cls(**{**values, "draft_token_cost": tuple(tuple(p) for p in values["draft_token_cost"])})


def cost_at(points: Sequence[tuple[int, float]], requests: int) -> float:
    """The cost of one verified draft token at ``requests`` requests a step: linear between the
    measured points, the nearest end's value beyond them."""
    xs = [x for x, _ in points]
    i = bisect.bisect_left(xs, requests)
    if i == 0:
        return points[0][1]
    if i == len(points):
        return points[-1][1]
    (x0, y0), (x1, y1) = points[i - 1], points[i]
    return y0 + (y1 - y0) * (requests - x0) / (x1 - x0)


def best_prefixes(survivals: Sequence[Sequence[float]], cost: float,
                  given: Sequence[int] | None = None) -> list[int]:
    """How many draft tokens each request keeps: ``given[i]`` first (verified whatever
    their worth), then the best of the rest while each clears ``cost (B + S) / (B + cost n)``.
    ``survivals[i]`` must not grow along a request's draft."""
    b = len(survivals)
    kept = list(given) if given is not None else [0] * b
    total = sum(sum(s[:k]) for s, k in zip(survivals, kept))
    n = sum(kept)
    ranked = sorted((-s, pos, i) for i, row in enumerate(survivals) for pos, s in enumerate(row) if pos >= kept[i])
    for neg, pos, i in ranked:
        s = -neg
        if s <= cost * (b + total) / (b + cost * n):
            break
        if pos != kept[i]:  # a tie broken out of order: its prefix comes first
            continue
        kept[i] = pos + 1
        total += s
        n += 1
    return kept


@dataclass
class Calibration:
    """Acceptance of a draft token by (position, confidence bin), learnt from verified drafts."""

    bins: int = 10
    prior_weight: float = 2.0
    max_count: float = 2000.0
    # (position, bin) -> [accepted, judged, summed confidence]
    cells: dict[tuple[int, int], list[float]] = field(default_factory=dict)

    def key(self, position: int, confidence: float) -> tuple[int, int]:
        return position, min(self.bins - 1, max(0, int(confidence * self.bins)))

    def judged(self, position: int, confidence: float) -> float:
        cell = self.cells.get(self.key(position, confidence))
        return cell[1] if cell else 0.0

    def rate(self, position: int, confidence: float) -> float:
        """Accepted share of the cell, with the confidence itself as a prior of ``prior_weight`` judgements."""
        cell = self.cells.get(self.key(position, confidence))
        if not cell:
            return confidence
        accepted, judged, _ = cell
        return (accepted + self.prior_weight * confidence) / (judged + self.prior_weight)

    def survival(self, confidences: Sequence[float]) -> list[float]:
        out, s = [], 1.0
        for pos, c in enumerate(confidences):
            s *= self.rate(pos, c)
            out.append(s)
        return out

    def observe(self, confidences: Sequence[float], accepted: int) -> None:
        """One verified draft: its first ``accepted`` tokens were accepted, the next (if any) rejected."""
        for pos, c in enumerate(confidences[:accepted + 1]):
            cell = self.cells.setdefault(self.key(pos, c), [0.0, 0.0, 0.0])
            cell[0] += pos < accepted
            cell[1] += 1
            cell[2] += c
            if cell[1] > self.max_count:
                cell[:] = [v / 2 for v in cell]

    def table(self) -> list[dict]:
        """The cells: position, bin, judged, accepted share, mean confidence (for /metrics and logs)."""
        return [{"position": p, "bin": b, "judged": round(n, 1), "accepted": round(a / n, 4),
                 "confidence": round(c / n, 4)}
                for (p, b), (a, n, c) in sorted(self.cells.items()) if n]


class DraftBudget:
    def __init__(self, config: BudgetConfig):
        self.config = config
        self.calibration = Calibration(config.bins, config.prior_weight, config.max_count)
        self.steps = 0
        self.offered = 0  # draft tokens offered to the budget (after the other caps)
        self.admitted = 0  # of which kept for verification
        self.explored = 0  # of which kept to learn their acceptance rather than for their worth
        self.verified = 0  # draft tokens verified and observed (fewer than admitted where vLLM dropped some)
        self._drafts = 0

    def admit(self, confidences: Sequence[Sequence[float]]) -> list[int]:
        """How many of its draft tokens each request of the step verifies (``confidences``: one
        list per request, as long as the drafts it may have)."""
        cfg = self.config
        cost = cost_at(cfg.draft_token_cost, len(confidences))
        kept = best_prefixes([self.calibration.survival(row) for row in confidences], cost)
        explored = 0
        for i, row in enumerate(confidences):
            self._drafts += 1
            whole = cfg.explore_every and self._drafts % cfg.explore_every == 0
            more = len(row) if whole else self._to_explore(row, kept[i])
            if more > kept[i]:
                explored += more - kept[i]
                kept[i] = more
        self.steps += 1
        self.offered += sum(map(len, confidences))
        self.admitted += sum(kept)
        self.explored += explored
        return kept

    def _to_explore(self, confidences: Sequence[float], worth: int) -> int:
        """Tokens to verify so that the first cell with fewer than ``min_observations`` judgements
        gets one, where the ``worth`` tokens kept for their worth reach up to it; else 0."""
        for pos, c in enumerate(confidences[:worth + 1]):
            if self.calibration.judged(pos, c) < self.config.min_observations:
                return pos + 1
        return 0

    def observe(self, confidences: Sequence[float], accepted: int) -> None:
        """One verified draft (its tokens' confidences) and how many of its tokens were accepted."""
        self.verified += len(confidences)
        self.calibration.observe(confidences, accepted)

    def snapshot(self) -> dict:
        return {"steps": self.steps, "offered": self.offered, "admitted": self.admitted,
                "explored": self.explored, "verified": self.verified, "calibration": self.calibration.table()}
