"""Where the server is in its life (loading, ready, draining, dead) and what is in flight.

One object, shared by the app (health, admission) and the server (signals, drain):

- ``loading``: the port is bound, the engine is not up yet; /health says 503 "loading".
- ``ready``: requests are served.
- ``draining``: SIGTERM came; in-flight requests finish, new ones get 503, /health 503.
- ``dead``: the engine died or failed to load; the server is stopping.
"""

from __future__ import annotations

import asyncio
import enum


class Phase(str, enum.Enum):
    LOADING = "loading"
    READY = "ready"
    DRAINING = "draining"
    DEAD = "dead"


class Lifecycle:
    def __init__(self) -> None:
        self.phase = Phase.LOADING
        self.reason: str | None = None  # why the server is dead, for /health
        self.in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def ready(self) -> bool:
        return self.phase is Phase.READY

    def set_phase(self, phase: Phase, reason: str | None = None) -> None:
        if self.phase is Phase.DEAD:  # final
            return
        self.phase = phase
        self.reason = reason

    def started(self) -> None:
        self.in_flight += 1
        self._idle.clear()

    def finished(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0:
            self._idle.set()

    async def wait_idle(self, timeout: float) -> bool:
        """True if nothing is in flight within `timeout` seconds."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except asyncio.TimeoutError:
            return False
        return True
