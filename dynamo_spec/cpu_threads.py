"""vLLM CPU thread binding on small machines.

vLLM's CPU default (``VLLM_CPU_OMP_THREADS_BIND=auto``) reserves a core for the engine
process and binds the model's OpenMP threads to the rest: on a 2-core machine the model
then runs on one core. Measured here (2 cores, SmolLM2-135M, bf16, eager; see
docs/measurements.md) binding both cores is faster for every case we serve: batch 1
22.6 -> 29.6 tokens/s without speculation and 22.8 -> 31.7 with EAGLE-3 k=3; batch 8
95 -> 140 and 47 -> 74. So on machines with at most ``SMALL`` usable cores, and only
when the user has not set the variable, the binding covers every usable core.
"""

from __future__ import annotations

import logging
import os
from collections.abc import MutableMapping

from dynamo_spec.host import on_cpu

logger = logging.getLogger("dynamo_spec.cpu_threads")

SMALL = 4
VAR = "VLLM_CPU_OMP_THREADS_BIND"


def default_cpu_thread_binding(environ: MutableMapping[str, str] | None = None,
                               cpus: set[int] | None = None,
                               is_cpu: bool | None = None) -> str | None:
    """Set ``VLLM_CPU_OMP_THREADS_BIND`` to all usable cores on a small CPU-only host
    unless it is set already; return the value set, or None when nothing changed."""
    environ = os.environ if environ is None else environ
    if VAR in environ:
        return None
    cpus = set(os.sched_getaffinity(0)) if cpus is None else cpus
    if len(cpus) > SMALL or not (on_cpu() if is_cpu is None else is_cpu):
        return None
    value = ",".join(str(c) for c in sorted(cpus))
    environ[VAR] = value
    logger.info("%s=%s (all %d cores: faster than vLLM's 'auto' on small machines; "
                "set the variable to override)", VAR, value, len(cpus))
    return value
