"""Each steering feature, declared once: the setting that turns it on, the patches of vLLM that
back it, the runner and scheduling it needs, and where it acts.

A feature turned on that cannot act is refused with one line naming the setting, never left to do
nothing: its patch stays off on this vLLM (``vllm_patches.unapplied``), or the engine's path lacks
what it needs (``paths.EnginePath``). ``refusals`` is that one check, run by preflight on the
predicted path and by the server on the path vLLM's config chose, before the engine starts (so
``serve --skip-preflight`` cannot start a feature silently inactive). ``dynamo-spec config``, the
API's per-request caps (``serving/draft_caps.py``) and the README's table (``readme_table``, a
unit test compares) read the same declarations.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from dynamo_spec.config.problems import Problem
from dynamo_spec.config.settings import Settings
from dynamo_spec.engine.paths import TO_SYNC, TO_V1_RUNNER, EnginePath
from dynamo_spec.vllm_patches import Patch, checked_on


@dataclass(frozen=True)
class Feature:
    """A steering feature. ``automatic``: on by default, lossless, speed only: where it cannot act,
    vLLM's own way runs and the server logs so at start instead of refusing."""

    name: str
    setting: str
    enabled: Callable[[Settings], bool]
    where: str  # where it acts, for the README's table and the refusal line
    patches: tuple[str, ...] = ()  # modules of dynamo_spec.vllm_patches it needs applied
    needs_v1_runner: bool = False
    needs_sync: bool = False
    automatic: bool = False
    on_request: bool = False  # an admin action: refused when asked (``unavailable``), never at start
    # settings under which the patch leaves some or all of the work to vLLM on any path: where, or None
    bypassed: Callable[[Settings], str | None] | None = None
    needs_package: tuple[str, str] | None = None  # (import name, what installs it) the feature's code imports


def _on(settings: Settings, flag: Callable[[object], bool]) -> bool:
    return settings.speculative.enabled and bool(flag(settings.speculative))


BATCH_SCHEDULE = Feature("batch-size schedule", "speculative.num_speculative_tokens_per_batch_size",
                         lambda s: _on(s, lambda spec: spec.num_speculative_tokens_per_batch_size is not None),
                         "vLLM's own (both runners)")
DRAFT_CAPS = Feature("per-request and tenant draft caps", "speculative.tenants",
                     lambda s: _on(s, lambda spec: spec.tenants),
                     "the scheduler: drafts cut (sync) or placeholders cut (async)", patches=("draft_admission",))
GUARD = Feature("speculation guard", "speculative.guard", lambda s: _on(s, lambda spec: spec.guard.enabled),
                "the scheduler: an engine-wide cap, fed by the verified counts", patches=("draft_admission",))
DRAFT_BUDGET = Feature("confidence draft budget", "speculative.draft_budget",
                       lambda s: _on(s, lambda spec: spec.draft_budget.enabled),
                       "the V1 EAGLE proposer's confidences, cut in Scheduler.update_draft_token_ids, "
                       "which asynchronous scheduling never calls",
                       patches=("draft_admission", "draft_confidence"), needs_v1_runner=True, needs_sync=True)
ZERO_DRAFT_STEPS = Feature("cheap k=0 steps", "(always on)", lambda s: s.speculative.enabled,
                           "the V1 runner's sampler and draft pass; the scheduler part runs on both",
                           patches=("zero_draft_steps",), needs_v1_runner=True, automatic=True)


PENALISED_METHODS = ("eagle", "eagle3", "mtp", "draft_model")  # drafted by the proposer's greedy sample


def _draft_penalties_bypassed(settings: Settings) -> str | None:
    """Where vLLM drafts by other means than the greedy sample the patch penalises."""
    spec, extra = settings.speculative, settings.speculative.extra
    if spec.method not in PENALISED_METHODS:
        return f"for speculative.method '{spec.method}' (its drafts come from no draft logits)"
    if extra.get("use_heterogeneous_vocab"):
        return "for a draft with another vocabulary (speculative.extra.use_heterogeneous_vocab)"
    if extra.get("parallel_drafting"):
        return "for parallel drafting (speculative.extra.parallel_drafting: no draft before the next)"
    if extra.get("draft_sample_method") == "probabilistic" and extra.get("rejection_sample_method",
                                                                         "standard") == "standard":
        return ("in steps with a sampled request (speculative.extra.draft_sample_method: probabilistic "
                "samples those from the draft's own distribution)")
    return None


DRAFT_PENALTIES = Feature("draft-side penalties", "speculative.draft_penalties",
                          lambda s: _on(s, lambda spec: spec.draft_penalties),
                          "the V1 EAGLE proposer's greedy sample", patches=("draft_penalties",),
                          needs_v1_runner=True, automatic=True, bypassed=_draft_penalties_bypassed)
DRY = Feature("DRY repetition control", "sampling.dry",
              lambda s: s.sampling.dry.multiplier > 0 and s.sampling.dry.penalty_last_n != 0,
              "the V1 runner's sampler and rejection sampler, at every sampled and verified position (per "
              "request; the server's default from the setting)", patches=("dry",), needs_v1_runner=True,
              needs_sync=True)
DRAFT_SWAP = Feature("live draft swap", "POST /admin/draft", lambda s: _on(s, lambda spec: spec.method == "eagle3"),
                     "the V1 EAGLE proposer", needs_v1_runner=True, on_request=True)  # dynamo_spec/learning/swap.py
LEARNING_AUTO = Feature("automatic learn cycle", "learning.auto", lambda s: s.learning.auto,
                        "a learn-draft child; its promoted draft swapped into the V1 EAGLE proposer",
                        needs_v1_runner=True)  # dynamo_spec/learning/auto.py
SUFFIX_MIX = Feature("suffix-tree drafts mixed with the draft's", "speculative.suffix",
                     lambda s: _on(s, lambda spec: spec.suffix.enabled),
                     "the V1 runner's drafts (per request and step, a sure tree draft replaces the EAGLE-3 draft), "
                     "taken by Scheduler.update_draft_token_ids, which asynchronous scheduling never calls",
                     patches=("suffix_mix",), needs_v1_runner=True, needs_sync=True,
                     needs_package=("arctic_inference", "pip install --no-build-isolation arctic-inference==0.3.0 "
                                    "(launch/env.sh's ensure_venv does)"))  # dynamo_spec/vllm_patches/suffix_mix.py
FEATURES = (BATCH_SCHEDULE, DRAFT_CAPS, GUARD, DRAFT_BUDGET, ZERO_DRAFT_STEPS, DRAFT_PENALTIES, DRY, DRAFT_SWAP,
            LEARNING_AUTO, SUFFIX_MIX)


def package_missing(feature: Feature) -> str | None:
    """The package ``feature`` imports where it cannot be found here: '<name> (<how to install>)', or None."""
    import importlib.util

    if feature.needs_package is None:
        return None
    name, how = feature.needs_package
    try:
        found = importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        found = False
    return None if found else f"{name} ({how})"


def missing(feature: Feature, path: EnginePath) -> list[str]:
    """What ``feature`` needs that ``path`` lacks, with the setting that would give it."""
    lacks = []
    if feature.needs_v1_runner and path.v2_runner:
        lacks.append(f"the V1 model runner ({TO_V1_RUNNER})")
    if feature.needs_sync and path.async_scheduling:
        lacks.append(f"synchronous scheduling ({TO_SYNC})")
    return lacks


def unpatched(feature: Feature, unapplied: Sequence[Patch]) -> Patch | None:
    """A patch ``feature`` needs that stays off on this vLLM (so the feature would do nothing), or None."""
    return next((p for p in unapplied if p.module in feature.patches), None)


def unavailable(feature: Feature, path: EnginePath | None, unapplied: Sequence[Patch]) -> str | None:
    """Why an engine on ``path`` (None: not known) cannot apply ``feature`` for a request that asks
    for it, or None."""
    if patch := unpatched(feature, unapplied):
        return why_off(patch)
    if path is not None and (lacks := missing(feature, path)):
        return f"the {feature.name} acts in {feature.where}; it needs {' and '.join(lacks)}, and this engine runs {path}"
    return None


def why_off(patch: Patch) -> str:
    from dynamo_spec.vllm_patches._upstream import vllm_version

    return (f"vLLM {vllm_version()} is not a version its patch {patch.module} was checked on "
            f"({', '.join(checked_on(patch))})")


def _fix(patch: Patch) -> str:
    from dynamo_spec.vllm_patches._upstream import FORCE_ENV

    return f"install vLLM {', '.join(checked_on(patch))} (or set {FORCE_ENV}=1 to apply the patch anyway)"


def refusals(settings: Settings, path: EnginePath | None, unapplied: Sequence[Patch]) -> list[Problem]:
    """The one check of what an engine on ``path`` (None: not known yet) would run without
    (``unapplied``: its patches that stay off): an error for each correctness fix missing (a warning
    under ``engine.allow_unpatched_vllm``) and for each feature turned on that could not act."""
    problems = []
    for patch in unapplied:
        if patch.kind == "correctness":
            level = "warning" if settings.engine.allow_unpatched_vllm else "error"
            problems.append(Problem(level, f"{why_off(patch)}; without it {patch.without}: {_fix(patch)}, or set "
                                           "engine.allow_unpatched_vllm: true to serve anyway"))
    for feature in FEATURES:
        if feature.automatic or feature.on_request or not feature.enabled(settings):
            continue
        if package := package_missing(feature):
            problems.append(Problem("error", f"{feature.setting}: the {feature.name} needs the package {package}, "
                                             "which cannot be imported here: install it, or turn the feature off"))
        elif patch := unpatched(feature, unapplied):
            problems.append(Problem("error", f"{feature.setting}: {why_off(patch)}, so it would do nothing: "
                                             f"{_fix(patch)}, or turn it off"))
        elif path is not None and (lacks := missing(feature, path)):
            problems.append(Problem("error", f"{feature.setting}: the {feature.name} acts in {feature.where}; it "
                                             f"needs {' and '.join(lacks)}, and this engine runs {path}: set that, "
                                             "or turn the feature off"))
    return problems


def inactive(settings: Settings, path: EnginePath, unapplied: Sequence[Patch]) -> list[str]:
    """Automatic features that leave the work to vLLM on this engine (a log line each at start)."""
    lines = []
    for feature in FEATURES:
        if not (feature.automatic and feature.enabled(settings)):
            continue
        if patch := unpatched(feature, unapplied):
            lines.append(f"{feature.name}: inactive ({why_off(patch)}); vLLM's own way runs")
        elif lacks := missing(feature, path):
            lines.append(f"{feature.name}: inactive on {path} (needs {' and '.join(lacks)}); vLLM's own way runs")
        elif feature.bypassed is not None and (where := feature.bypassed(settings)):
            lines.append(f"{feature.name}: inactive {where}; vLLM's own way runs")
    return lines


README_PATHS = (EnginePath(False, False, "CPU"), EnginePath(True, True, "GPU default"))


def readme_table() -> str:
    """The README's "Where each feature runs" table, rendered from the declarations."""
    def cell(feature: Feature, path: EnginePath) -> str:
        return "yes" if not missing(feature, path) else "inactive" if feature.automatic else "refused"

    rows = ["| feature | acts in | V1 runner, sync (CPU) | V2 runner, async (GPU default) |", "|---|---|---|---|"]
    rows += [f"| {f.name} | {f.where} | {' | '.join(cell(f, p) for p in README_PATHS)} |" for f in FEATURES]
    return "\n".join(rows)
