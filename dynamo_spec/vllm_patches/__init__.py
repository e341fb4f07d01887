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

import importlib
import logging
import os
from dataclasses import dataclass
from typing import Literal

# Under the "vllm" logger so the lines show up with vLLM's own engine logs.
logger = logging.getLogger("vllm.dynamo_spec_plugin")

# "0" leaves vLLM's k=0 steps as they are (zero_draft_steps); for A/B runs.
ZERO_DRAFT_STEPS_ENV = "DYNAMO_SPEC_ZERO_DRAFT_STEPS"


@dataclass(frozen=True)
class Patch:
    """One patch module: where it applies, what it is for, and what goes wrong without it.

    kind: ``correctness`` (without it the engine gives wrong output or crashes: the server does
    not start where it cannot apply, unless ``engine.allow_unpatched_vllm``), ``feature`` (backs the
    settings in ``features``: those are refused where it cannot apply), ``speed``."""

    module: str
    kind: Literal["correctness", "feature", "speed"]
    without: str
    cpu_only: bool = False
    entry: str = "apply"
    features: tuple[str, ...] = ()
    off_env: str | None = None


PATCHES = (
    Patch("cpu_expand_kernel", "correctness", "speculative decoding with temperature > 0 emits garbage on CPU",
          cpu_only=True, entry="apply_cpu_fixes"),
    Patch("compile_cache", "speed", "every start compiles again", cpu_only=True),
    Patch("seeded_sampling", "correctness", "a request with a seed whose prompt is prefilled in chunks stops "
          "the CPU engine", cpu_only=True),
    Patch("draft_admission", "feature", "every request drafts the step's k",
          features=("speculative.tenants", "speculative.guard", "speculative.draft_budget")),
    Patch("draft_confidence", "feature", "drafts are not trimmed by their confidence",
          features=("speculative.draft_budget",)),
    Patch("zero_draft_steps", "speed", "k=0 steps of a speculative engine keep vLLM's own cost",
          off_env=ZERO_DRAFT_STEPS_ENV),
    # after draft_confidence: its greedy sample wraps that one's (and keeps the confidences itself)
    Patch("draft_penalties", "speed", "requests with penalties get drafts drafted without them (lower acceptance)"),
)
# The Zen platform is a vllm.platform_plugins entry point of its own (not registered here).
PLATFORM_PATCHES = ("zen_platform",)


def module(patch: Patch):
    return importlib.import_module(f"{__name__}.{patch.module}")


def register() -> None:
    """Entry point of the ``vllm.general_plugins`` group (runs in every process).

    Each patch installs on its own: a failure is logged loudly and never takes the engine down
    (the server refuses beforehand what a patch that cannot apply would leave broken: ``unapplied``)."""
    try:
        from dynamo_spec.engine.host import on_cpu

        cpu = on_cpu()
    except Exception:
        logger.exception("dynamo-spec: could not tell vLLM's platform; the CPU patches stay off")
        cpu = False
    for patch in PATCHES:
        if (patch.cpu_only and not cpu) or (patch.off_env and os.environ.get(patch.off_env, "1") == "0"):
            continue
        try:
            if done := getattr(module(patch), patch.entry)():
                logger.debug("dynamo-spec: %s: patched %s", patch.module, done)
        except Exception:
            logger.exception("dynamo-spec: could not install %s; %s", patch.module, patch.without)


def checked_on(patch: Patch) -> tuple[str, ...]:
    """The patch module's ``CHECKED_ON``, read from its source: importing some patch modules imports
    torch (seconds), which preflight does not need."""
    import ast
    import importlib.util
    from pathlib import Path

    origin = importlib.util.find_spec(f"{__name__}.{patch.module}").origin
    for node in ast.parse(Path(origin).read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "CHECKED_ON" for t in node.targets):
            return tuple(ast.literal_eval(node.value))
    raise LookupError(f"{patch.module} declares no CHECKED_ON")


def unapplied(on_cpu: bool) -> list[Patch]:
    """The patches that would stay off in an engine on this host: vLLM is not a version they were
    checked on (``_upstream.applies``), quietly, for the server to decide before it starts."""
    from dynamo_spec.vllm_patches._upstream import applies

    return [p for p in PATCHES if (on_cpu or not p.cpu_only) and not applies(checked_on(p))]
