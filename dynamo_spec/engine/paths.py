"""Which path through vLLM an engine takes: its model runner and its scheduling.

vLLM 0.32 has two model runners and two kinds of scheduling (``vllm/config/vllm.py``):

- **Model Runner V2** (``VllmConfig.use_v2_model_runner``): ``VLLM_USE_V2_MODEL_RUNNER`` if set
  (read with ``int()``), else V2 when vLLM finds Triton usable and no feature V2 lacks is on
  (``_get_v2_model_runner_unsupported_features``: some methods, parallel drafting, a draft with
  another vocabulary, dual batch overlap). EAGLE-3 on a GPU runs V2; vLLM's CPU build has no
  Triton: the **V1 runner**.
- **Asynchronous scheduling** by default, unless the platform (CPU) or an option turns it off: a
  method other than the EAGLE kinds, ``disable_padded_drafter_batch``, an executor without it (Ray's
  old one, ``VLLM_USE_RAY_V2_EXECUTOR_BACKEND=0``), pipeline parallelism on V1. Under it the
  scheduler gives each request placeholder drafts and ``Scheduler.update_draft_token_ids`` is
  never called.

``predict`` mirrors that for preflight and ``dynamo-spec config``, before any engine is built;
``open_engine`` reads vLLM's own answer (``from_vllm_config``). Which feature runs on which path:
``dynamo_spec/engine/features.py``. Unit tests build vLLM's config for each rule this machine
can show, and pin the source of the rest.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from dynamo_spec.config.settings import Settings

RUNNER_ENV = "VLLM_USE_V2_MODEL_RUNNER"
RAY_V2_ENV = "VLLM_USE_RAY_V2_EXECUTOR_BACKEND"
# vLLM's async-capable speculative methods (config/vllm.py: EAGLE kinds, n-gram on GPU, draft model).
ASYNC_METHODS = ("eagle", "eagle3", "mtp", "ngram_gpu", "draft_model", "dspark", "dflash")
V1_ONLY_METHODS = ("suffix", "medusa", "mlp_speculator", "custom_class")  # not in Model Runner V2
SELF_PARALLEL_METHODS = ("dflash", "dspark")  # draft in parallel on V2's own speculators

TO_V1_RUNNER = f"{RUNNER_ENV}=0 in the server's environment (the V1 model runner)"
TO_SYNC = "engine.extra.async_scheduling: false"


class PredictionError(ValueError):
    """vLLM would refuse these settings or this environment before it picks a path (one line)."""


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


def env_flag(environ: Mapping[str, str], name: str, default: str | None = None) -> bool | None:
    """A vLLM switch read as vLLM reads it (envs.py: ``bool(int(value))``): None when unset without a
    default; a value ``int()`` rejects (``true``, empty) fails vLLM's start, so it is an error here."""
    value = environ.get(name, default)
    if value is None:
        return None
    try:
        return bool(int(value))
    except ValueError:
        raise PredictionError(f"{name}={value!r}: vLLM reads it with int() and would fail to start; "
                              "set 0 or 1, or unset it") from None


def triton_usable(backends: Mapping[str, Any] | None, *, cpu_build: bool, environ: Mapping[str, str]) -> bool:
    """vLLM's ``HAS_TRITON`` (triton_utils/importing.py) from Triton's backends (None: no triton):
    exactly one active driver other than Triton's CPU one, or any number where Ray blanked
    CUDA_VISIBLE_DEVICES; vLLM's CPU build needs Triton's CPU backend instead."""
    if backends is None:
        return False
    if cpu_build:
        return "cpu" in backends
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and not visible.strip():
        return True
    return sum(1 for name, b in backends.items() if name != "cpu" and b.driver and b.driver.is_active()) == 1


def has_triton(on_cpu: bool, environ: Mapping[str, str] | None = None) -> bool:
    """Whether vLLM will find Triton usable here, without importing vLLM (seconds); a GPU host's
    Triton drivers import torch to tell whether they are active."""
    import importlib.util

    backends = None
    if importlib.util.find_spec("triton") is not None:
        try:
            from triton.backends import backends
        except Exception:  # noqa: BLE001 - vLLM turns Triton off on any error here too
            return False
    return triton_usable(backends, cpu_build=on_cpu, environ=os.environ if environ is None else environ)


def v2_unsupported(settings: Settings, forced: bool | None) -> list[str]:
    """What the settings turn on that Model Runner V2 lacks (vLLM's
    ``_get_v2_model_runner_unsupported_features``, for what the settings can set)."""
    spec, engine = settings.speculative, settings.engine
    lacks = []
    if spec.enabled and spec.method in V1_ONLY_METHODS:
        lacks.append(f"speculative.method '{spec.method}'")
    if spec.enabled and spec.extra.get("parallel_drafting") and spec.method not in SELF_PARALLEL_METHODS:
        lacks.append("parallel drafting (speculative.extra.parallel_drafting)")
    if spec.enabled and spec.extra.get("use_heterogeneous_vocab"):
        lacks.append("a draft with another vocabulary (speculative.extra.use_heterogeneous_vocab)")
    ubatching = engine.extra.get("enable_dbo") or (engine.extra.get("ubatch_size") or 1) > 1
    if ubatching and (forced is None or spec.enabled or engine.pipeline_parallel_size > 1):
        lacks.append("dual batch overlap (engine.extra.enable_dbo / ubatch_size)")
    return lacks


def _v2_runner(settings: Settings, triton: bool, environ: Mapping[str, str]) -> bool:
    forced = env_flag(environ, RUNNER_ENV)
    extra = settings.engine.extra
    if (extra.get("attention_config") or {}).get("hisparse_config") is not None:
        if forced is False:
            raise PredictionError(f"engine.extra.attention_config.hisparse_config needs Model Runner V2: "
                                  f"unset {RUNNER_ENV}=0")
        return True
    if extra.get("watermark_config") is not None:
        return True  # watermarking overrides the variable
    lacks = v2_unsupported(settings, forced)
    if forced is None:
        return triton and not lacks
    if forced and (lacks or not triton):  # vLLM's _validate_v2_model_runner
        why = ", ".join(lacks) if lacks else "Triton, which vLLM does not find usable here"
        raise PredictionError(f"{RUNNER_ENV}=1: Model Runner V2 does not support {why}; unset it")
    return forced


def _sync_reasons(settings: Settings, environ: Mapping[str, str]) -> list[str]:
    """The options that rule asynchronous scheduling out whatever the runner (config/vllm.py)."""
    spec = settings.speculative
    reasons = []
    if spec.enabled and spec.method not in ASYNC_METHODS:
        reasons.append(f"speculative.method '{spec.method}'")
    if spec.enabled and spec.extra.get("disable_padded_drafter_batch"):
        reasons.append("speculative.extra.disable_padded_drafter_batch")
    # v1/executor/abstract.py: ray -> RayExecutorV2 (a MultiprocExecutor: async) unless the variable is 0
    if settings.engine.distributed_executor_backend == "ray" and not env_flag(environ, RAY_V2_ENV, "1"):
        reasons.append(f"Ray's V1 executor ({RAY_V2_ENV}=0)")
    return reasons


def predict(settings: Settings, *, on_cpu: bool, triton: bool, environ: Mapping[str, str] | None = None) -> EnginePath:
    """The path vLLM 0.32 will choose for ``settings`` on a host. PredictionError where vLLM would
    refuse to start instead (a switch it cannot parse, an option that contradicts another)."""
    environ = os.environ if environ is None else environ
    v2 = _v2_runner(settings, triton, environ)
    explicit = settings.engine.extra.get("async_scheduling")
    reasons = _sync_reasons(settings, environ)
    pp_on_v1 = settings.engine.pipeline_parallel_size > 1 and not v2
    # vLLM fails these before the CPU platform has its say; the V1 runner's check comes after it
    if explicit and (wrong := reasons + (["pipeline parallelism on the V1 runner"] if pp_on_v1 and not on_cpu else [])):
        raise PredictionError(f"engine.extra.async_scheduling: true does not go with {', '.join(wrong)} "
                              "(vLLM refuses to start); drop one of them")
    if on_cpu:
        use_async = False  # platforms/cpu.py turns it off whatever was asked
    elif explicit is not None:
        use_async = bool(explicit)
    else:
        use_async = not reasons and not pp_on_v1
    return EnginePath(v2, use_async, "predicted for this host")


def from_vllm_config(vllm_config: Any) -> EnginePath:
    """The path an engine built from ``vllm_config`` takes (vLLM's own answer)."""
    return EnginePath(bool(vllm_config.use_v2_model_runner), bool(vllm_config.scheduler_config.async_scheduling),
                      "vLLM's config")
