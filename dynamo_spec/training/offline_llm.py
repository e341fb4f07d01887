"""A short-lived offline vLLM engine for the training tools (answers, eval, verify).

The context manager shuts the engine core down fully on exit. Each engine carries its own
switches in its config (``engine.args.engine_switches``), so engines open at the same time in one
process may differ.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from ..config.settings import EngineSettings, Settings
from ..engine.args import engine_kwargs
from ..engine.process_env import prepare_engine_processes, temporary_vllm_dirs
from ..vllm_patches import CONFIG_KEY
from ..vllm_patches.draft_admission import CONFIDENCE_LOG_KEY


@contextlib.contextmanager
def offline_llm(target: Path, *, draft: Path | None = None, k: int = 3,
                dtype: str = "bfloat16", kv_cache_bytes: int = 512 * 2**20,
                max_num_seqs: int = 64, max_model_len: int = 2048, schedule=None, draft_budget: dict | None = None,
                guard: dict | None = None, draft_penalties: bool = True, confidence_log: Path | None = None,
                speculative_extra: dict | None = None, suffix: dict | None = None, **extra):
    """Yield a ``vllm.LLM`` (optionally with an EAGLE-3 draft) and always shut it down.

    Its arguments come from a ``Settings`` through ``engine_args.engine_kwargs``, as the
    server's do; ``schedule``: the draft's batch-size schedule of k (``[[lo, hi, k], ...]``);
    ``draft_budget``: ``speculative.draft_budget`` fields (the confidence budget);
    ``guard``: ``speculative.guard`` fields; ``draft_penalties``: ``speculative.draft_penalties``;
    ``suffix``: ``speculative.suffix`` fields (the suffix-tree mix);
    ``confidence_log``: a file to which the engine appends each verified draft's confidences
    (``draft_admission``); ``speculative_extra``: ``speculative.extra`` (other speculative_config
    fields); ``extra``: other engine settings (typed fields) or ``engine.extra`` fields."""
    engine = {"model": str(target), "dtype": dtype, "kv_cache_memory_bytes": kv_cache_bytes, "enforce_eager": True,
              "max_model_len": max_model_len, "max_num_seqs": max_num_seqs, "seed": 0,
              "per_request_spec_decode_metrics": "none"}
    typed = set(EngineSettings.model_fields) - {"extra"}
    engine.update({k: v for k, v in extra.items() if k in typed})  # e.g. per_request_spec_decode_metrics
    engine["extra"] = {k: v for k, v in extra.items() if k not in typed}
    if confidence_log is not None:
        given = engine["extra"].get("additional_config", {})
        engine["extra"]["additional_config"] = {
            **given, CONFIG_KEY: {**given.get(CONFIG_KEY, {}), CONFIDENCE_LOG_KEY: str(confidence_log)}}
    settings = Settings(
        engine=engine,
        speculative={"method": "eagle3", "model": str(draft), "num_speculative_tokens": k,
                     "num_speculative_tokens_per_batch_size": schedule, "draft_budget": draft_budget or {},
                     "guard": guard or {}, "draft_penalties": draft_penalties, "extra": speculative_extra or {},
                     "suffix": suffix or {}}
        if draft is not None else {"enabled": False},
    )
    with llm_for(settings) as llm:
        yield llm


@contextlib.contextmanager
def llm_for(settings: Settings):
    """A ``vllm.LLM`` built from ``settings`` as the server builds its engine, always shut down."""
    with temporary_vllm_dirs():
        from vllm import LLM

        prepare_engine_processes(cpu_preload=settings.engine.cpu_preload)
        llm = LLM(**engine_kwargs(settings))
        try:
            yield llm
        finally:
            llm.llm_engine.engine_core.shutdown()
            del llm


def request_params(llm, **fields):
    """``SamplingParams`` as vLLM's OpenAI server builds them for a request that sets
    ``fields`` (None: not set): each sampling field the request leaves out takes the
    model's default from its ``generation_config.json`` (none when the engine runs with
    ``generation_config="vllm"``), then vLLM's own."""
    from vllm import SamplingParams

    defaults = llm.model_config.get_diff_sampling_param()
    return SamplingParams.from_optional(
        **{**defaults, **{k: v for k, v in fields.items() if v is not None}})
