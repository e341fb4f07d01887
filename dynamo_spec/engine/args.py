"""Settings -> vLLM's arguments, the one place that translates them: the engine's
(``engine_kwargs``, a pure function pinned by unit tests; the offline engines of the
training tools use it too), with this project's switches of that engine (``engine_switches``,
which the patches in ``dynamo_spec.vllm_patches`` read from the engine's own config), and the
OpenAI frontend's (``vllm_serving_args``)."""

from __future__ import annotations

from typing import Any

from dynamo_spec.config import schedule
from dynamo_spec.config.settings import Settings
from dynamo_spec.engine.host import Host, detect_host, resolve_dtype
from dynamo_spec.learning.swap import EXTENSION as DRAFT_SWAP_EXTENSION
from dynamo_spec.vllm_patches import CONFIG_KEY
from dynamo_spec.vllm_patches.draft_admission import CONFIDENCE_LOG_KEY
from dynamo_spec.vllm_patches.draft_budget import BUDGET_KEY, BudgetConfig
from dynamo_spec.vllm_patches.draft_confidence import CONFIDENCE_KEY
from dynamo_spec.vllm_patches.draft_penalties import PENALTIES_KEY
from dynamo_spec.vllm_patches.speculation_guard import GUARD_KEY, GuardConfig
from dynamo_spec.vllm_patches.suffix_mix import SUFFIX_KEY, MixConfig
from dynamo_spec.vllm_patches.zero_draft_steps import ZERO_DRAFT_KEY

# Switches with no settings field, for A/B runs and the training tools only, taken from
# ``engine.extra.additional_config.dynamo_spec`` (name -> type).
PASSTHROUGH_SWITCHES = {ZERO_DRAFT_KEY: bool, CONFIDENCE_LOG_KEY: str}


def speculative_config(settings: Settings, dtype: str | None = None) -> dict[str, Any] | None:
    """The `speculative_config` dict vLLM receives, or None when speculation is off.

    `dtype` is the engine's resolved dtype (it picks a schedule given per dtype);
    default: ``engine.dtype`` as written.
    """
    spec = settings.speculative
    if not spec.enabled:
        return None
    # With the suffix mix vLLM's k is the tree's longest draft (its buffers, the rejection sampler), and a
    # schedule keeps the EAGLE loop at its own k (vLLM carries the last entry's k to every larger batch).
    config: dict[str, Any] = {"method": spec.method, "num_speculative_tokens": spec.longest_draft}
    if spec.model is not None:
        config["model"] = spec.model
    applied, _ = schedule.for_engine(settings, dtype or settings.engine.dtype)
    if applied is None and spec.longest_draft > spec.num_speculative_tokens:
        applied = ((1, 1, spec.num_speculative_tokens),)
    if applied is not None:
        config["num_speculative_tokens_per_batch_size"] = schedule.as_lists(applied)
    if spec.draft_tensor_parallel_size is not None:
        config["draft_tensor_parallel_size"] = spec.draft_tensor_parallel_size
    config.update(spec.extra)
    return config


def engine_switches(settings: Settings) -> dict[str, Any]:
    """This project's switches of one speculative engine: the value of vLLM's
    ``additional_config["dynamo_spec"]`` (vLLM hands it to every process of the engine; each patch
    reads its own switch from its scheduler's, runner's or proposer's ``vllm_config``). Plain JSON
    data: vLLM's config hash (``VllmConfig.compute_hash``) dumps ``additional_config`` whole, so the
    compile cache keys on these start-time switches too (an engine started with other ones compiles
    once more; a hash that left them out needs ``additional_config`` to be a non-dict object, which
    vLLM's own ``additional_config`` readers and writers do not accept). With
    ``engine.extra.additional_config.dynamo_spec``, only the switches without a settings field
    (:data:`PASSTHROUGH_SWITCHES`) may be set there."""
    spec = settings.speculative
    given = settings.engine.extra.get("additional_config", {}).get(CONFIG_KEY, {})
    for key, value in given.items():
        if key not in PASSTHROUGH_SWITCHES or not isinstance(value, PASSTHROUGH_SWITCHES[key]):
            allowed = ", ".join(f"{k} ({t.__name__})" for k, t in PASSTHROUGH_SWITCHES.items())
            raise ValueError(f"engine.extra.additional_config.{CONFIG_KEY}.{key}: only {allowed} may be set "
                             f"there; the other switches come from the speculative settings")
    guard = GuardConfig(**spec.guard.model_dump(exclude={"enabled"})).to_switch() if spec.guard.enabled else None
    budget = spec.draft_budget
    budget_switch = BudgetConfig(
        draft_token_cost=tuple(map(tuple, budget.draft_token_cost)), min_observations=budget.min_observations,
        explore_every=budget.explore_every).to_switch() if budget.enabled else None
    suffix = (MixConfig(**spec.suffix.model_dump(exclude={"enabled"}), draft_k=spec.num_speculative_tokens).to_switch()
              if spec.enabled and spec.suffix.enabled else None)
    return {**given, PENALTIES_KEY: spec.draft_penalties, GUARD_KEY: guard, BUDGET_KEY: budget_switch, SUFFIX_KEY: suffix,
            # the budget needs the drafts' confidences, and so does a confidence log
            CONFIDENCE_KEY: budget_switch is not None or bool(given.get(CONFIDENCE_LOG_KEY))}


def engine_kwargs(settings: Settings, host: Host | None = None) -> dict[str, Any]:
    """Keyword arguments of AsyncEngineArgs (plain data, easy to pin in tests).

    With `host`, ``dtype: auto`` is resolved for it (see dynamo_spec.engine.host); without,
    it is passed through as written.
    """
    engine = settings.engine
    dtype = resolve_dtype(engine.dtype, host)[0] if host is not None else engine.dtype
    kwargs: dict[str, Any] = {
        "model": engine.model,
        "tokenizer": engine.tokenizer,
        "served_model_name": [settings.served_model_name],
        "dtype": dtype,
        "max_model_len": engine.max_model_len,
        "tensor_parallel_size": engine.tensor_parallel_size,
        "pipeline_parallel_size": engine.pipeline_parallel_size,
        "data_parallel_size": engine.data_parallel_size,
        "distributed_executor_backend": engine.distributed_executor_backend,
        "gpu_memory_utilization": engine.gpu_memory_utilization,
        "kv_cache_memory_bytes": int(engine.kv_cache_memory_bytes) if engine.kv_cache_memory_bytes else None,
        "enforce_eager": engine.enforce_eager,
        "max_num_seqs": engine.max_num_seqs,
        "seed": engine.seed,
        "speculative_config": speculative_config(settings, dtype),
    }
    if kwargs["speculative_config"] is not None:
        kwargs["per_request_spec_decode_metrics"] = engine.per_request_spec_decode_metrics
    kwargs = {k: v for k, v in kwargs.items() if v is not None}
    if settings.speculative.enabled and settings.speculative.method == "eagle3":
        # POST /admin/draft loads a draft through this worker extension (dynamo_spec/learning/swap.py)
        if "worker_extension_cls" in engine.extra:
            raise ValueError(f"engine.extra.worker_extension_cls: dynamo-spec sets it to {DRAFT_SWAP_EXTENSION} (the "
                             "live draft swap, POST /admin/draft); remove it")
        kwargs["worker_extension_cls"] = DRAFT_SWAP_EXTENSION
    kwargs.update(engine.extra)
    if "speculative_config" in kwargs:  # a user's additional_config is kept beside this project's key
        kwargs["additional_config"] = {**engine.extra.get("additional_config", {}), CONFIG_KEY: engine_switches(settings)}
    return kwargs


def build_engine_args(settings: Settings):  # -> vllm.engine.arg_utils.AsyncEngineArgs
    from vllm.engine.arg_utils import AsyncEngineArgs

    return AsyncEngineArgs(**engine_kwargs(settings, detect_host()))


def serve_usage_context():  # -> vllm.usage.usage_lib.UsageContext
    """``vllm serve``'s usage context: vLLM sizes max_num_seqs / max_num_batched_tokens by it, and
    the default one (``ENGINE_CONTEXT``) gets 128 / 2,048 where ``vllm serve`` gets 1,024 / 8,192 on
    an H100 (``EngineArgs.get_batch_defaults``)."""
    from vllm.usage.usage_lib import UsageContext

    return UsageContext.OPENAI_API_SERVER


def build_vllm_config(settings: Settings, engine_args=None):  # -> vllm.config.VllmConfig
    """The config the server's engine is built from (from ``engine_args`` where given), sized as
    ``vllm serve`` sizes it."""
    return (engine_args or build_engine_args(settings)).create_engine_config(serve_usage_context())


def vllm_serving_args(settings: Settings):  # -> argparse.Namespace
    """The namespace vLLM's OpenAI serving layer reads: model names, and server.frontend."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    argv = ["--model", settings.engine.model, "--served-model-name", settings.served_model_name]
    if settings.engine.tokenizer:
        argv += ["--tokenizer", settings.engine.tokenizer]
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(argv)
    for key, value in settings.server.frontend.items():
        setattr(args, key, value)
    return args
