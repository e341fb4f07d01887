"""Everything that runs inside vLLM's processes: the patches of vLLM, one a module.

Each patch module's docstring says what upstream does, what the patch changes, and what would
let it go; it declares the vLLM versions it was checked on (``CHECKED_ON``) and the upstream
signatures it was written for (``UPSTREAM_SIGNATURES``), and applies only on those versions
(``_upstream.checked``: on another it logs one line and changes nothing).

``register`` is the ``vllm.general_plugins`` entry point ``dynamo_spec_cpu_fixes``; vLLM
calls it in every process it starts (if ``VLLM_PLUGINS`` is set, it must name it). The Zen
platform (``zen_platform``) is a ``vllm.platform_plugins`` entry point of its own.
"""

from __future__ import annotations

import logging
import os

# Under the "vllm" logger so the lines show up with vLLM's own engine logs.
logger = logging.getLogger("vllm.dynamo_spec_plugin")

PLUGIN_NAME = "dynamo_spec_cpu_fixes"
# "0" leaves vLLM's k=0 steps as they are (zero_draft_steps); for A/B runs.
ZERO_DRAFT_STEPS_ENV = "DYNAMO_SPEC_ZERO_DRAFT_STEPS"
# The patch modules (each with CHECKED_ON and UPSTREAM_SIGNATURES).
PATCHES = ("cpu_expand_kernel", "compile_cache", "seeded_sampling", "zero_draft_steps", "draft_admission",
           "draft_confidence", "zen_platform")


def register() -> None:
    """Entry point of the ``vllm.general_plugins`` group (runs in every process).

    Each patch installs on its own: a failure is logged loudly and never takes the engine down."""
    try:
        from dynamo_spec.engine.host import on_cpu

        cpu = on_cpu()
    except Exception:
        logger.exception("dynamo-spec: could not tell vLLM's platform; the CPU patches stay off")
        cpu = False
    if cpu:
        try:
            from dynamo_spec.vllm_patches.cpu_expand_kernel import apply_cpu_fixes

            apply_cpu_fixes()
        except Exception:
            logger.exception("dynamo-spec: could not install the CPU rejection-sampler fix; "
                             "speculative decoding with temperature > 0 may emit garbage on CPU")
        try:
            from dynamo_spec.vllm_patches import compile_cache

            if installed := compile_cache.apply():
                logger.debug("dynamo-spec: compile cache: installed %s", ", ".join(installed))
        except Exception:
            logger.exception("dynamo-spec: could not fix loading compiled models; every start compiles again")
        try:
            from dynamo_spec.vllm_patches import seeded_sampling

            if patched := seeded_sampling.apply():
                logger.debug("dynamo-spec: seeded sampling: patched %s", ", ".join(patched))
        except Exception:
            logger.exception("dynamo-spec: could not fix seeded requests; a 'seed' with a chunked prompt "
                             "stops the CPU engine")
    try:
        from dynamo_spec.vllm_patches import draft_admission

        if patched := draft_admission.apply():
            logger.debug("dynamo-spec: draft admission: patched %s", ", ".join(patched))
    except Exception:
        logger.exception("dynamo-spec: could not install the per-request draft caps; "
                         "every request drafts the step's k")
    try:
        from dynamo_spec.vllm_patches import draft_confidence

        if patched := draft_confidence.apply():
            logger.debug("dynamo-spec: draft confidence: patched %s", ", ".join(patched))
    except Exception:
        logger.exception("dynamo-spec: could not install the draft confidences; drafts are not trimmed by them")
    if os.environ.get(ZERO_DRAFT_STEPS_ENV, "1") == "0":
        return
    try:
        from dynamo_spec.vllm_patches import zero_draft_steps

        if patched := zero_draft_steps.apply():
            logger.debug("dynamo-spec: zero-draft steps: patched %s", ", ".join(patched))
    except Exception:
        logger.exception("dynamo-spec: could not install the zero-draft-step changes; "
                         "k=0 steps of a speculative engine keep vLLM's own cost")
