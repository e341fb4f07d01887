"""The suite's cores under pytest-xdist: each worker on its own share, and the whole machine for
a module that needs it (tests/conftest.py calls these)."""

from __future__ import annotations

import os

EVERY_CORE = "DYNAMO_SPEC_TEST_CORES"  # the cores the suite was given, before a worker took its share


def every_core() -> set[int]:
    return {int(c) for c in os.environ[EVERY_CORE].split(",")}


def take_own_share() -> None:
    """Under pytest-xdist, each worker (and every server and engine it starts, which inherit it)
    gets its own share of the cores. Unshared, the two workers' engines spin on each other's cores
    (vLLM's workers busy-wait between steps): two modules took 233 s on two workers against 320 s
    one after the other; on a core each, 181 s (Zen 4, 2 cores). vLLM then binds its threads
    to that share (engine/cpu_threads.py)."""
    worker, count = os.environ.get("PYTEST_XDIST_WORKER"), int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    cpus = sorted(os.sched_getaffinity(0))
    os.environ.setdefault(EVERY_CORE, ",".join(map(str, cpus)))
    if worker is None or count < 2 or len(cpus) < count:
        return
    per, index = len(cpus) // count, int(worker.removeprefix("gw"))
    os.sched_setaffinity(0, cpus[index * per:(index + 1) * per])
