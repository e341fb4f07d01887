"""Which runner and scheduling an engine takes, and the features refused where they cannot run
(dynamo_spec/engine/paths.py); the engine sized as `vllm serve` sizes it (engine/args.py)."""

from __future__ import annotations

import hashlib
import inspect

import pytest

from dynamo_spec.config.preflight import check_driver, run_preflight
from dynamo_spec.config.settings import Settings
from dynamo_spec.engine import paths

pytestmark = pytest.mark.unit

GPU = {"on_cpu": False, "triton": True, "environ": {}}
CPU = {"on_cpu": True, "triton": False, "environ": {}}


def settings(target="t", **speculative) -> Settings:
    engine = speculative.pop("engine", {})
    return Settings(engine={"model": str(target), **engine},
                    speculative={"method": "eagle3", "model": "d", **speculative},
                    metrics={"tenant_header": "X-Tenant"})


BUDGET = {"draft_budget": {"enabled": True}}


def test_a_gpu_takes_model_runner_v2_with_async_scheduling_and_the_cpu_v1_sync():
    s = settings()
    assert (paths.predict(s, **GPU).v2_runner, paths.predict(s, **GPU).async_scheduling) == (True, True)
    assert (paths.predict(s, **CPU).v2_runner, paths.predict(s, **CPU).async_scheduling) == (False, False)
    # what a user can set: vLLM's runner variable, async scheduling off
    assert paths.predict(s, **{**GPU, "environ": {paths.RUNNER_ENV: "0"}}).v2_runner is False
    assert paths.predict(settings(engine={"extra": {"async_scheduling": False}}), **GPU).async_scheduling is False
    # the CPU platform turns async off whatever was asked
    assert paths.predict(settings(engine={"extra": {"async_scheduling": True}}), **CPU).async_scheduling is False
    assert paths.predict(settings(method="ngram", model=None), **GPU).async_scheduling is False


def test_the_budget_is_refused_on_the_gpu_path_with_what_would_make_it_work():
    s = settings(**BUDGET)
    [line] = paths.refusals(s, paths.predict(s, **GPU))
    assert line.startswith("speculative.draft_budget: the confidence draft budget")
    assert f"{paths.RUNNER_ENV}=0" in line and "engine.extra.async_scheduling: false" in line
    assert "Model Runner V2 with asynchronous scheduling" in line
    # async off alone is not enough: the V2 runner has no confidences
    sync = settings(engine={"extra": {"async_scheduling": False}}, **BUDGET)
    [line] = paths.refusals(sync, paths.predict(sync, **GPU))
    assert f"{paths.RUNNER_ENV}=0" in line and "async_scheduling" not in line.split("needs", 1)[1].split(",")[0]
    v1_sync = paths.predict(sync, **{**GPU, "environ": {paths.RUNNER_ENV: "0"}})
    assert paths.refusals(sync, v1_sync) == []
    assert paths.refusals(s, paths.predict(s, **CPU)) == []


def test_the_scheduler_features_run_on_every_path():
    s = settings(guard={"enabled": True}, tenants={"free": {"max_draft_tokens": 1}},
                 num_speculative_tokens_per_batch_size=[[1, 4, 3], [5, 1024, 1]])
    for where in (GPU, CPU):
        assert paths.refusals(s, paths.predict(s, **where)) == []
    # the cheap k=0 steps are V1-only: said once at start on V2, not refused
    assert paths.inactive(s, paths.predict(s, **CPU)) == []
    lines = paths.inactive(s, paths.predict(s, **GPU))
    assert [line.split(":")[0] for line in lines] == ["cheap k=0 steps", "draft-side penalties"]
    assert all("inactive on Model Runner V2" in line for line in lines)
    assert paths.inactive(settings(draft_penalties=False), paths.predict(s, **GPU))[1:] == []


def test_preflight_refuses_the_budget_where_the_gpu_would_run_it(tmp_path, monkeypatch):
    monkeypatch.setattr(paths, "has_triton", lambda: True)  # a GPU host's vLLM has Triton
    monkeypatch.delenv(paths.RUNNER_ENV, raising=False)
    s = settings(target=tmp_path / "missing", **BUDGET)
    lines = [p.message for p in run_preflight(s, on_cpu=False) if p.level == "error"]
    assert any(line.startswith("speculative.draft_budget: the confidence draft budget") for line in lines), lines
    assert not any("draft_budget" in p.message for p in run_preflight(s, on_cpu=True))


def test_the_prediction_is_vllms_own_answer_here_and_the_server_refuses_from_vllms_config(tiny_models):
    """vLLM's config for the tiny pair (the CPU build: no Triton): V1 runner, synchronous scheduling,
    as predicted. The same config with async scheduling on (a GPU's default) is refused for the budget
    by the check the server runs before the engine starts."""
    from dynamo_spec.engine.args import build_vllm_config
    from dynamo_spec.engine.async_llm import EnginePathError, check_engine_path

    s = Settings(engine={"model": str(tiny_models["target"]), "dtype": "bfloat16", "max_model_len": 256,
                         "kv_cache_memory_bytes": "64MiB", "enforce_eager": True},
                 speculative={"method": "eagle3", "model": str(tiny_models["draft"]), **BUDGET})
    vllm_config = build_vllm_config(s)
    real = paths.from_vllm_config(vllm_config)
    predicted = paths.predict(s, on_cpu=True, triton=paths.has_triton())
    assert (real.v2_runner, real.async_scheduling) == (predicted.v2_runner, predicted.async_scheduling) == (False, False)
    assert check_engine_path(s, vllm_config) == real
    vllm_config.scheduler_config.async_scheduling = True
    with pytest.raises(EnginePathError, match=r"^speculative.draft_budget: .*synchronous scheduling"):
        check_engine_path(s, vllm_config)


def test_the_engine_is_sized_as_vllm_serve_sizes_it(tiny_models):
    """vLLM sizes max_num_seqs / max_num_batched_tokens by usage context; AsyncLLM's default context
    gets the scheduler's defaults (128 / 2,048), `vllm serve`'s more (here, CPU with two ranks: twice
    that; an H100: 1,024 / 8,192)."""
    from dynamo_spec.engine.args import build_vllm_config

    s = Settings(engine={"model": str(tiny_models["target"]), "dtype": "bfloat16", "max_model_len": 256,
                         "kv_cache_memory_bytes": "64MiB", "enforce_eager": True, "tensor_parallel_size": 2},
                 speculative={"enabled": False})
    scheduler = build_vllm_config(s).scheduler_config
    assert (scheduler.max_num_seqs, scheduler.max_num_batched_tokens) == (256, 4096)


# vLLM's choice of runner and of async scheduling, as `predict` mirrors it: a change upstream
# changes these digests; re-read config/vllm.py, update predict(), then the digests.
RUNNER_CHOICE = "515385db129c"  # VllmConfig.use_v2_model_runner
ASYNC_CHOICE = "39e8b411eb3c"  # VllmConfig.__post_init__, from its async-scheduling block to the next setting


def digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def async_choice_source() -> str:
    from vllm.config import VllmConfig

    source = inspect.getsource(VllmConfig.__post_init__)
    start = source.index("if self.scheduler_config.async_scheduling:")
    return source[start:source.index("disable_nccl_for_dp_synchronization is None", start)]


def test_the_upstream_choices_predict_mirrors_are_unchanged():
    from vllm.config import VllmConfig

    assert digest(inspect.getsource(VllmConfig.use_v2_model_runner.fget)) == RUNNER_CHOICE, (
        "vLLM changed how it picks Model Runner V2: re-check dynamo_spec/engine/paths.py:predict")
    assert digest(async_choice_source()) == ASYNC_CHOICE, (
        "vLLM changed when it schedules asynchronously: re-check dynamo_spec/engine/paths.py:predict")


@pytest.mark.parametrize("torch_cuda, driver, refused", [
    ("13.0", 13000, False), ("13.0", 13020, False), ("13.0", 12080, True), ("12.8", 12080, False),
    (None, None, False), ("13.0", None, False),
])
def test_the_driver_must_support_torchs_cuda(torch_cuda, driver, refused):
    problems = check_driver(torch_cuda, driver)
    assert bool(problems) is refused
    if refused:
        assert "supports CUDA 12.8" in problems[0].message and "CUDA 13.0" in problems[0].message
