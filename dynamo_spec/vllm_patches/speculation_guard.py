"""The speculation guard: stop drafting for the whole engine when acceptance collapses.

A draft token that the target rejects costs a share of a target step and buys nothing.
Speculation pays only while the acceptance rate (accepted / drafted tokens) stays above
the cost of one draft token relative to a plain step: a step drafting k tokens per
request costs about ``1 + c k`` plain steps and yields ``1 + r k`` tokens, so it gains
exactly when ``r > c``, whatever k the batch-size schedule picks. ``min_acceptance_rate``
is that break-even ``c`` (``dynamo-spec bench`` reports it per cell as "break-even rate").

States (one per engine):

* ``speculating``: drafts as the schedule and the requests allow; the acceptance of the
  trailing ``window_draft_tokens`` drafted tokens is watched. Below ``min_acceptance_rate``
  (judged once the window holds ``window_draft_tokens``, or after ``window_seconds`` with
  at least ``min_draft_tokens``), the guard falls back.
* ``fallback``: every request's cap is 0 (k=0 steps: the cheap path of
  ``zero_draft_steps``); after ``probe_interval_seconds`` the guard probes.
* ``probing``: drafts as when speculating until ``probe_draft_tokens`` were drafted, then
  resumes (rate at or above the threshold) or falls back again.

An operator may pin a state (``force``): pinned ``speculating`` never falls back, pinned
``fallback`` never probes; ``auto`` lets the guard decide again from a fresh window.
Transitions are logged with their figures and counted. No vLLM import: the draft
admission patch feeds :meth:`SpeculationGuard.observe` and asks :meth:`SpeculationGuard.cap`.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

logger = logging.getLogger("vllm.dynamo_spec_plugin")

# The guard's settings in the engine's switches (``vllm_patches.switches_of``; None or absent: no guard).
GUARD_KEY = "guard"

SPECULATING, FALLBACK, PROBING = "speculating", "fallback", "probing"
STATES = (SPECULATING, FALLBACK, PROBING)
AUTO = "auto"


@dataclass(frozen=True)
class GuardConfig:
    """``speculative.guard`` as the engine's processes get it; its defaults are the settings' own
    (config/settings.py, GuardSettings), written nowhere else."""

    min_acceptance_rate: float
    window_draft_tokens: int
    window_seconds: float
    min_draft_tokens: int
    probe_interval_seconds: float
    probe_draft_tokens: int

    def to_switch(self) -> dict:
        """The value of :data:`GUARD_KEY` in the engine's switches (plain JSON data)."""
        return asdict(self)

    @classmethod
    def from_switches(cls, switches: Mapping[str, Any]) -> GuardConfig | None:
        values = switches.get(GUARD_KEY)
        return cls(**values) if values else None


class SpeculationGuard:
    def __init__(self, config: GuardConfig, clock: Callable[[], float] = time.monotonic):
        self.config = config
        self._clock = clock
        self.state = SPECULATING
        self.pinned = False
        self.since = clock()
        self.transitions: dict[str, int] = {}
        self._window: deque[tuple[float, int, int, int]] = deque()  # (time, drafts, drafted, accepted)
        self._drafts = self._drafted = self._accepted = 0
        self.last_judged: dict[str, float] | None = None

    # --- what the scheduler asks -------------------------------------------------

    def cap(self, request=None, step=None) -> int | None:
        """A cap source (``draft_admission.CapSource``): 0 in fallback, else no cap."""
        if self.state == FALLBACK:
            if not self.pinned and self._clock() - self.since >= self.config.probe_interval_seconds:
                self._move(PROBING, f"{self.config.probe_interval_seconds:g} s in fallback")
                return None
            return 0
        return None

    def observe(self, drafted: int, accepted: int) -> None:
        """One request's draft verified in a step: ``drafted`` tokens, ``accepted`` of them."""
        if drafted <= 0 or self.state == FALLBACK:
            return
        now = self._clock()
        self._window.append((now, 1, drafted, accepted))
        self._drafts += 1
        self._drafted += drafted
        self._accepted += accepted
        if self.state == SPECULATING:
            # Keep the most recent window_draft_tokens (the oldest entry goes once the rest hold enough).
            while self._window and self._drafted - self._window[0][2] >= self.config.window_draft_tokens:
                self._drop_oldest()
            if self.pinned:
                return
            full = self._drafted >= self.config.window_draft_tokens
            long_enough = (now - self._window[0][0] >= self.config.window_seconds
                           and self._drafted >= self.config.min_draft_tokens)
            if (full or long_enough) and self.rate < self.config.min_acceptance_rate:
                self._judge_and_move(FALLBACK)
        elif self.state == PROBING and self._drafted >= self.config.probe_draft_tokens:
            self._judge_and_move(SPECULATING if self.rate >= self.config.min_acceptance_rate else FALLBACK)

    # --- what an operator asks ---------------------------------------------------

    def force(self, state: str) -> dict:
        """Pin ``state`` (speculating or fallback), start a probe now (probing), or let
        the guard decide again (auto). ValueError for anything else."""
        if state == AUTO:
            self.pinned = False
            if self.state == SPECULATING:
                self._clear()
            logger.info("dynamo-spec: speculation guard: automatic again (state %s)", self.state)
        elif state in (SPECULATING, FALLBACK):
            self.pinned = True
            if state != self.state:
                self._move(state, "forced by an operator")
        elif state == PROBING:
            self.pinned = False
            self._move(PROBING, "forced by an operator")
        else:
            raise ValueError(f"state must be one of {', '.join((*STATES, AUTO))}, not {state!r}")
        return self.snapshot()

    def snapshot(self) -> dict:
        return {"state": self.state, "pinned": self.pinned, "seconds_in_state": self._clock() - self.since,
                "transitions": dict(self.transitions), "window": self.window_figures(),
                "last_judged": self.last_judged, "config": asdict(self.config)}

    # --- figures ---------------------------------------------------------------

    @property
    def rate(self) -> float:
        return self._accepted / self._drafted if self._drafted else float("nan")

    def window_figures(self) -> dict[str, float | None]:
        """The window's counts and figures (None where nothing was drafted)."""
        return {"drafts": self._drafts, "draft_tokens": self._drafted, "accepted_tokens": self._accepted,
                "acceptance_rate": self._accepted / self._drafted if self._drafted else None,
                "mean_acceptance_length": 1 + self._accepted / self._drafts if self._drafts else None}

    # --- internals ---------------------------------------------------------------

    def _drop_oldest(self) -> None:
        _, drafts, drafted, accepted = self._window.popleft()
        self._drafts -= drafts
        self._drafted -= drafted
        self._accepted -= accepted

    def _clear(self) -> None:
        self._window.clear()
        self._drafts = self._drafted = self._accepted = 0

    def _judge_and_move(self, to: str) -> None:
        figures = self.window_figures()
        self.last_judged = figures
        verdict = "below" if to == FALLBACK else "at or above"
        self._move(to, (f"acceptance rate {figures['acceptance_rate']:.1%} (mean acceptance length "
                        f"{figures['mean_acceptance_length']:.2f}) over {figures['draft_tokens']} drafted tokens, "
                        f"{verdict} speculative.guard.min_acceptance_rate {self.config.min_acceptance_rate:.0%}"))

    def _move(self, to: str, why: str) -> None:
        before, self.state, self.since = self.state, to, self._clock()
        key = f"{before}->{to}"
        self.transitions[key] = self.transitions.get(key, 0) + 1
        self._clear()
        after = {FALLBACK: ("k capped at 0" + ("" if self.pinned else
                                              f"; a probe in {self.config.probe_interval_seconds:g} s")),
                 PROBING: f"drafting for {self.config.probe_draft_tokens} tokens",
                 SPECULATING: "drafting as the schedule allows"}[to]
        logger.warning("dynamo-spec: speculation guard: %s -> %s: %s; %s", before, to, why, after)
