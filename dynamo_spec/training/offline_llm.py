"""A short-lived offline vLLM engine for the training tools (answers, eval, verify).

vLLM runs one engine per process at a time here: the context manager shuts the engine
core down fully on exit, before the next one starts.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from ..config.settings import EngineSettings, Settings
from ..engine.args import engine_kwargs
from ..engine.process_env import prepare_engine_processes, temporary_vllm_dirs


@contextlib.contextmanager
def offline_llm(target: Path, *, draft: Path | None = None, k: int = 3,
                dtype: str = "bfloat16", kv_cache_bytes: int = 512 * 2**20,
                max_num_seqs: int = 64, max_model_len: int = 2048, schedule=None, draft_budget: dict | None = None,
                draft_penalties: bool = True, **extra):
    """Yield a ``vllm.LLM`` (optionally with an EAGLE-3 draft) and always shut it down.

    Its arguments come from a ``Settings`` through ``engine_args.engine_kwargs``, as the
    server's do; ``schedule``: the draft's batch-size schedule of k (``[[lo, hi, k], ...]``);
    ``draft_budget``: ``speculative.draft_budget`` fields (the confidence budget, handed to the
    engine's processes as the server hands it); ``draft_penalties``: ``speculative.draft_penalties``;
    ``extra``: other engine settings (typed fields)
    or ``engine.extra`` fields."""
    engine = {"model": str(target), "dtype": dtype, "kv_cache_memory_bytes": kv_cache_bytes, "enforce_eager": True,
              "max_model_len": max_model_len, "max_num_seqs": max_num_seqs, "seed": 0,
              "per_request_spec_decode_metrics": "none"}
    typed = set(EngineSettings.model_fields) - {"extra"}
    engine.update({k: v for k, v in extra.items() if k in typed})  # e.g. per_request_spec_decode_metrics
    engine["extra"] = {k: v for k, v in extra.items() if k not in typed}
    settings = Settings(
        engine=engine,
        speculative={"method": "eagle3", "model": str(draft), "num_speculative_tokens": k,
                     "num_speculative_tokens_per_batch_size": schedule, "draft_budget": draft_budget or {},
                     "draft_penalties": draft_penalties}
        if draft is not None else {"enabled": False},
    )
    with temporary_vllm_dirs(), _speculation_controls(settings):
        from vllm import LLM

        prepare_engine_processes(cpu_preload=settings.engine.cpu_preload)
        llm = LLM(**engine_kwargs(settings))
        try:
            yield llm
        finally:
            llm.llm_engine.engine_core.shutdown()
            del llm


@contextlib.contextmanager
def environ_restored(*names: str):
    """Let the body set these environment variables (for an engine's processes); afterwards each is as it was."""
    saved = {name: os.environ.get(name) for name in names}
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@contextlib.contextmanager
def _speculation_controls(settings: Settings):
    """The engine environment of the guard and the confidence budget while the engine runs, then as it was."""
    from ..engine.async_llm import set_speculation_controls
    from ..vllm_patches.draft_budget import BUDGET_ENV
    from ..vllm_patches.draft_confidence import CONFIDENCE_ENV
    from ..vllm_patches.draft_penalties import PENALTIES_ENV
    from ..vllm_patches.speculation_guard import GUARD_ENV

    with environ_restored(BUDGET_ENV, CONFIDENCE_ENV, GUARD_ENV, PENALTIES_ENV):
        if settings.speculative.enabled and settings.speculative.draft_budget.enabled:
            set_speculation_controls(os.environ, settings)
        # the rest as asked (eval-draft --calibration sets the confidences itself); draft-side penalties
        os.environ[PENALTIES_ENV] = "1" if settings.speculative.draft_penalties else "0"
        yield


def request_params(llm, **fields):
    """``SamplingParams`` as vLLM's OpenAI server builds them for a request that sets
    ``fields`` (None: not set): each sampling field the request leaves out takes the
    model's default from its ``generation_config.json`` (none when the engine runs with
    ``generation_config="vllm"``), then vLLM's own."""
    from vllm import SamplingParams

    defaults = llm.model_config.get_diff_sampling_param()
    return SamplingParams.from_optional(
        **{**defaults, **{k: v for k, v in fields.items() if v is not None}})
