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
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

# Under the "vllm" logger so the lines show up with vLLM's own engine logs.
logger = logging.getLogger("vllm.dynamo_spec_plugin")

# The key of vLLM's ``additional_config`` that holds this project's switches of one engine (built by
# ``engine.args.engine_switches``; vLLM hands the config to every process of that engine).
CONFIG_KEY = "dynamo_spec"
_SWITCHES_ATTR = "_dynamo_spec_switches"  # on a scheduler, model runner or proposer: switches_of its config


@dataclass(frozen=True)
class Patch:
    """One patch module: where it applies, what it is for, and what goes wrong without it.

    kind: ``correctness`` (without it the engine gives wrong output or crashes: the server does
    not start where it cannot apply, unless ``engine.allow_unpatched_vllm``), ``feature`` (backs
    the features that name it in ``dynamo_spec/engine/features.py``: those are refused where it
    cannot apply), ``speed``."""

    module: str
    kind: Literal["correctness", "feature", "speed"]
    without: str
    cpu_only: bool = False
    entry: str = "apply"


PATCHES = (
    Patch("cpu_expand_kernel", "correctness", "speculative decoding with temperature > 0 emits garbage on CPU",
          cpu_only=True, entry="apply_cpu_fixes"),
    Patch("compile_cache", "speed", "every start compiles again", cpu_only=True),
    Patch("seeded_sampling", "correctness", "a request with a seed whose prompt is prefilled in chunks stops "
          "the CPU engine", cpu_only=True),
    Patch("draft_admission", "feature", "every request drafts the step's k"),
    Patch("draft_confidence", "feature", "drafts are not trimmed by their confidence"),
    Patch("zero_draft_steps", "speed", "k=0 steps of a speculative engine keep vLLM's own cost"),
    # after draft_confidence: its greedy sample wraps that one's (and keeps the confidences itself)
    Patch("draft_penalties", "speed", "requests with penalties get drafts drafted without them (lower acceptance)"),
    # after zero_draft_steps: its _sample wraps that one's (a k=0 step's plain sampler gets DRY too)
    Patch("dry", "feature", "requests with DRY fields are sampled without it"),
    # after draft_admission: its update_draft_token_ids reads the drafts' sources before that one rebuilds them
    Patch("suffix_mix", "feature", "every draft is the EAGLE-3 draft's (no suffix-tree drafts)"),
)
# The Zen platform is a vllm.platform_plugins entry point of its own (not registered here).
PLATFORM_PATCHES = ("zen_platform",)


def module(patch: Patch):
    return importlib.import_module(f"{__name__}.{patch.module}")


def register() -> None:
    """Entry point of the ``vllm.general_plugins`` group (runs in every process).

    Each patch installs on its own: a failure is logged loudly and never takes the engine down
    (the server refuses beforehand what a patch that cannot apply would leave broken: ``unapplied``)."""
    from dynamo_spec.engine.process_exit import install as quick_exit

    quick_exit()  # not a patch of vLLM: this process's exit skips the final walks of its heap
    try:
        from dynamo_spec.engine.host import on_cpu

        cpu = on_cpu()
    except Exception:
        logger.exception("dynamo-spec: could not tell vLLM's platform; the CPU patches stay off")
        cpu = False
    for patch in PATCHES:
        if patch.cpu_only and not cpu:
            continue
        try:
            if done := getattr(module(patch), patch.entry)():
                logger.debug("dynamo-spec: %s: patched %s", patch.module, done)
        except Exception:
            logger.exception("dynamo-spec: could not install %s; %s", patch.module, patch.without)


def switches_of(vllm_config: Any) -> Mapping[str, Any]:
    """One engine's switches: its config's ``additional_config[CONFIG_KEY]``, or {} for an engine
    built without this project's settings (each patch then keeps its own default: the speed
    patches on, the features off). Patches install process-wide and ask this per engine, once
    per scheduler, runner or proposer (cached on the object)."""
    extra = getattr(vllm_config, "additional_config", None)
    switches = extra.get(CONFIG_KEY) if isinstance(extra, dict) else None
    return switches if isinstance(switches, dict) else {}


def switch(owner: Any, key: str, default: bool) -> bool:
    """The switch ``key`` of ``owner``'s engine (a scheduler, model runner or proposer: it holds its
    engine's ``vllm_config``), read once and kept on it, so that asking each step costs a lookup."""
    switches = owner.__dict__.get(_SWITCHES_ATTR)
    if switches is None:
        switches = owner.__dict__[_SWITCHES_ATTR] = switches_of(getattr(owner, "vllm_config", None))
    return bool(switches.get(key, default))


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
