"""Which path through vLLM an engine takes, and where each steering feature works on it.

vLLM 0.32 has two model runners and two kinds of scheduling (``vllm/config/vllm.py``):

- **Model Runner V2** (``VllmConfig.use_v2_model_runner``) whenever Triton is importable, unless
  ``VLLM_USE_V2_MODEL_RUNNER`` says otherwise or a feature it lacks is on; EAGLE-3 is not one of
  those, so a GPU runs V2. vLLM's CPU build has no Triton: the **V1 runner**.
- **Asynchronous scheduling** by default for EAGLE-3, unless the platform (CPU) or an option
  (``engine.extra.async_scheduling: false``, pipeline parallelism on V1, another executor)
  turns it off. Under it the scheduler gives each request placeholder drafts and
  ``Scheduler.update_draft_token_ids`` is never called.

This project's features act at different places (``vllm_patches/``), so each declares what it
needs. One the user turned on where the engine cannot run it is refused with one line (preflight
before start, ``open_engine`` from the config vLLM built), never left to do nothing.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dynamo_spec.config.settings import Settings

RUNNER_ENV = "VLLM_USE_V2_MODEL_RUNNER"
# vLLM's async-capable speculative methods (config/vllm.py: EAGLE kinds, n-gram on GPU, draft model).
ASYNC_METHODS = ("eagle", "eagle3", "mtp", "ngram_gpu", "draft_model", "dspark", "dflash")

TO_V1_RUNNER = f"{RUNNER_ENV}=0 in the server's environment (the V1 model runner)"
TO_SYNC = "engine.extra.async_scheduling: false"


@dataclass(frozen=True)
class EnginePath:
    """The runner and scheduling of one engine, and how we know them."""

    v2_runner: bool
    async_scheduling: bool
    source: str  # "vLLM's config" or "predicted for this host"

    def __str__(self) -> str:
        runner = "Model Runner V2" if self.v2_runner else "the V1 model runner"
        scheduling = "asynchronous" if self.async_scheduling else "synchronous"
        return f"{runner} with {scheduling} scheduling ({self.source})"


@dataclass(frozen=True)
class Feature:
    """A steering feature: the setting that turns it on, and what it needs from the engine."""

    name: str
    setting: str
    enabled: Callable[[Settings], bool]
    needs_v1_runner: bool
    needs_sync: bool
    where: str  # where it acts, for the README's table and the refusal line


def _spec(settings: Settings) -> Any:
    return settings.speculative


FEATURES: tuple[Feature, ...] = (
    Feature("batch-size schedule", "speculative.num_speculative_tokens_per_batch_size",
            lambda s: _spec(s).enabled and _spec(s).num_speculative_tokens_per_batch_size is not None,
            False, False, "vLLM's own (both runners)"),
    Feature("per-request and tenant draft caps", "speculative.tenants",
            lambda s: _spec(s).enabled and bool(_spec(s).tenants),
            False, False, "the scheduler: drafts cut (sync) or placeholders cut (async)"),
    Feature("speculation guard", "speculative.guard",
            lambda s: _spec(s).enabled and _spec(s).guard.enabled,
            False, False, "the scheduler: an engine-wide cap, fed by the verified counts"),
    Feature("confidence draft budget", "speculative.draft_budget",
            lambda s: _spec(s).enabled and _spec(s).draft_budget.enabled,
            True, True, "the V1 EAGLE proposer's confidences, cut in Scheduler.update_draft_token_ids, "
                        "which asynchronous scheduling never calls"),
)
# On by default, lossless, speed only: where one cannot run, vLLM's own way runs (logged at start).
AUTOMATIC: tuple[Feature, ...] = (
    Feature("cheap k=0 steps", "(always on)", lambda s: _spec(s).enabled, True, False,
            "the V1 runner's sampler and draft pass; the scheduler part runs on both"),
    Feature("draft-side penalties", "speculative.draft_penalties",
            lambda s: _spec(s).enabled and _spec(s).draft_penalties, True, False,
            "the V1 EAGLE proposer's greedy sample"),
)


def missing(feature: Feature, path: EnginePath) -> list[str]:
    """What ``feature`` needs that ``path`` lacks, with the setting that would give it."""
    lacks = []
    if feature.needs_v1_runner and path.v2_runner:
        lacks.append(f"the V1 model runner ({TO_V1_RUNNER})")
    if feature.needs_sync and path.async_scheduling:
        lacks.append(f"synchronous scheduling ({TO_SYNC})")
    return lacks


def refusals(settings: Settings, path: EnginePath) -> list[str]:
    """One line for each feature turned on that ``path`` cannot run."""
    lines = []
    for feature in FEATURES:
        lacks = missing(feature, path) if feature.enabled(settings) else []
        if lacks:
            lines.append(f"{feature.setting}: the {feature.name} acts in {feature.where}; it needs "
                         f"{' and '.join(lacks)}, and this engine runs {path}: set that, or turn the feature off")
    return lines


def inactive(settings: Settings, path: EnginePath) -> list[str]:
    """Automatic optimisations that ``path`` leaves to vLLM (a log line each at start)."""
    return [f"{feature.name}: inactive on {path} (needs {' and '.join(lacks)}); vLLM's own way runs"
            for feature in AUTOMATIC if feature.enabled(settings) and (lacks := missing(feature, path))]


def _env_flag(environ: dict[str, str], name: str) -> bool | None:
    value = environ.get(name)
    if value is None or value == "":
        return None
    return value.strip().lower() in ("1", "true", "yes")


def has_triton() -> bool:
    import importlib.util

    return importlib.util.find_spec("triton") is not None


def predict(settings: Settings, *, on_cpu: bool, triton: bool, environ: dict[str, str] | None = None) -> EnginePath:
    """The path vLLM 0.32 will choose for ``settings`` on a host (``VllmConfig.use_v2_model_runner`` and
    its async-scheduling defaults, for the options this project sets): for preflight and
    ``dynamo-spec config``, before any engine is built. ``open_engine`` checks vLLM's own answer."""
    environ = os.environ if environ is None else environ
    forced = _env_flag(environ, RUNNER_ENV)
    v2 = forced if forced is not None else (triton and not on_cpu)
    explicit = settings.engine.extra.get("async_scheduling")
    spec = settings.speculative
    if on_cpu:
        use_async = False  # platforms/cpu.py turns it off whatever was asked
    elif explicit is not None:
        use_async = bool(explicit)
    elif spec.enabled and spec.method not in ASYNC_METHODS:
        use_async = False
    elif settings.engine.distributed_executor_backend == "ray":
        use_async = False  # vLLM's ray executor does not support it (warns and turns it off)
    elif settings.engine.pipeline_parallel_size > 1 and not v2:
        use_async = False
    else:
        use_async = True
    return EnginePath(v2, use_async, "predicted for this host")


def predict_here(settings: Settings) -> EnginePath:
    from dynamo_spec.engine.host import on_cpu

    return predict(settings, on_cpu=on_cpu(), triton=has_triton())


def from_vllm_config(vllm_config: Any) -> EnginePath:
    """The path an engine built from ``vllm_config`` takes (vLLM's own answer)."""
    return EnginePath(bool(vllm_config.use_v2_model_runner), bool(vllm_config.scheduler_config.async_scheduling),
                      "vLLM's config")
