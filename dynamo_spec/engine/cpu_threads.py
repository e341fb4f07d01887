"""vLLM CPU thread binding on small machines.

vLLM's CPU default (``VLLM_CPU_OMP_THREADS_BIND=auto``) reserves a core for the engine
process and binds the model's OpenMP threads to the rest: on a 2-core machine the model
then runs on one core, and the reserved core mostly waits. Binding every core to the model
is faster there, with and without speculation, at one request and at eight. So on machines
with at most ``SMALL`` usable cores, and only when the user has not set the variable, the
binding covers every usable core."""

from __future__ import annotations

import logging
import os
from collections.abc import MutableMapping

from dynamo_spec.engine.host import on_cpu

logger = logging.getLogger("dynamo_spec.engine.cpu_threads")

SMALL = 4
VAR = "VLLM_CPU_OMP_THREADS_BIND"


def default_cpu_thread_binding(environ: MutableMapping[str, str] | None = None,
                               cpus: set[int] | None = None,
                               is_cpu: bool | None = None, ranks: int = 1) -> str | None:
    """Set ``VLLM_CPU_OMP_THREADS_BIND`` to all usable cores on a small CPU-only host
    unless it is set already; return the value set, or None when nothing changed.

    With ``ranks`` > 1 (tensor/pipeline parallel ranks, one process each) the cores are
    split into that many contiguous groups, ``0,1|2,3``: vLLM's format, one group per rank."""
    environ = os.environ if environ is None else environ
    if VAR in environ:
        return None
    cpus = set(os.sched_getaffinity(0)) if cpus is None else cpus
    if len(cpus) > SMALL or not (on_cpu() if is_cpu is None else is_cpu):
        return None
    if ranks > len(cpus):
        return None  # fewer cores than ranks: leave it to vLLM (which will say so)
    ordered, per_rank = sorted(cpus), len(cpus) // ranks
    value = "|".join(",".join(str(c) for c in ordered[r * per_rank:(r + 1) * per_rank]) for r in range(ranks))
    environ[VAR] = value
    logger.info("%s=%s (all %d cores over %d rank(s): faster than vLLM's 'auto' on small machines; "
                "set the variable to override)", VAR, value, len(cpus), ranks)
    return value
