"""Which runner and scheduling an engine takes (dynamo_spec/engine/paths.py), checked against the
config vLLM itself builds; the features refused where they cannot run (engine/features.py); the
engine sized as `vllm serve` sizes it (engine/args.py)."""

from __future__ import annotations

import hashlib
import inspect
import types

import pytest

from dynamo_spec.config.preflight import check_driver, check_features_on_path, run_preflight
from dynamo_spec.config.settings import Settings
from dynamo_spec.engine import features, paths
from dynamo_spec.vllm_patches import PATCHES

pytestmark = pytest.mark.unit

GPU = {"on_cpu": False, "triton": True, "environ": {}}
CPU = {"on_cpu": True, "triton": False, "environ": {}}
BUDGET = {"draft_budget": {"enabled": True}}
V2_ASYNC, V2_SYNC, V1_ASYNC, V1_SYNC = (True, True), (True, False), (False, True), (False, False)


def settings(target="t", **speculative) -> Settings:
    engine = speculative.pop("engine", {})
    return Settings(engine={"model": str(target), **engine},
                    speculative={"method": "eagle3", "model": "d", **speculative},
                    metrics={"tenant_header": "X-Tenant"})


def pair(path: paths.EnginePath) -> tuple[bool, bool]:
    return path.v2_runner, path.async_scheduling


def patch(module: str):
    return next(p for p in PATCHES if p.module == module)


# --------------------------------------------------------------------------- against vLLM's own config


@pytest.fixture
def gpu_choices(monkeypatch):
    """vLLM's config built here as a GPU host's vLLM would choose: Triton usable (the flag
    ``use_v2_model_runner`` reads), and the CPU platform's last word on async scheduling undone
    (platforms/cpu.py sets it False after VllmConfig chose; pinned below)."""
    import vllm.config.vllm
    from vllm.platforms import current_platform

    monkeypatch.setattr(vllm.config.vllm, "HAS_TRITON", True)
    platform = type(current_platform)
    hook = platform.check_and_update_config.__func__

    def keep_async(cls, vllm_config):
        chosen = vllm_config.scheduler_config.async_scheduling
        hook(cls, vllm_config)
        vllm_config.scheduler_config.async_scheduling = chosen

    monkeypatch.setattr(platform, "check_and_update_config", classmethod(keep_async))


def tiny(tiny_models, speculative: dict, **engine) -> Settings:
    return Settings(engine={"model": str(tiny_models["target"]), "dtype": "bfloat16", "max_model_len": 256,
                            "kv_cache_memory_bytes": "64MiB", "enforce_eager": True, **engine},
                    speculative=speculative)


CASES = {  # name: (speculative, engine, environment, expected (V2 runner?, async?))
    "eagle3": ({}, {}, {}, V2_ASYNC),
    "runner variable 0": ({}, {}, {paths.RUNNER_ENV: "0"}, V1_ASYNC),
    "async off": ({}, {"extra": {"async_scheduling": False}}, {}, V2_SYNC),
    "disable_padded_drafter_batch": ({"extra": {"disable_padded_drafter_batch": True}}, {}, {}, V2_SYNC),
    "parallel drafting": ({"extra": {"parallel_drafting": True}}, {}, {}, V1_ASYNC),
    "ray (RayExecutorV2)": ({}, {"distributed_executor_backend": "ray"}, {}, V2_ASYNC),
    "ray, V1 executor": ({}, {"distributed_executor_backend": "ray"}, {paths.RAY_V2_ENV: "0"}, V2_SYNC),
    "ngram": ({"method": "ngram", "model": None, "extra": {"prompt_lookup_max": 3}}, {}, {}, V2_SYNC),
    "another vocabulary": ({"method": "draft_model", "model": "target", "extra": {"use_heterogeneous_vocab": True}},
                           {}, {}, V1_ASYNC),
}


@pytest.mark.parametrize("case", CASES)
def test_the_gpu_prediction_is_the_path_vllms_own_config_takes(case, tiny_models, gpu_choices, monkeypatch):
    from dynamo_spec.engine.args import build_vllm_config

    speculative, engine, environ, expected = CASES[case]
    spec = {"method": "eagle3", "model": str(tiny_models["draft"]), **speculative}
    if spec["model"] == "target":
        spec["model"] = str(tiny_models["target"])
    for name in (paths.RUNNER_ENV, paths.RAY_V2_ENV):
        monkeypatch.delenv(name, raising=False)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    s = tiny(tiny_models, spec, **engine)
    assert pair(paths.from_vllm_config(build_vllm_config(s))) == expected
    assert pair(paths.predict(s, **{**GPU, "environ": environ})) == expected


@pytest.mark.parametrize("speculative, engine, environ, message", [
    ({"extra": {"disable_padded_drafter_batch": True}}, {"async_scheduling": True}, {},
     "async_scheduling: true does not go with speculative.extra.disable_padded_drafter_batch"),
    ({}, {"async_scheduling": True}, {paths.RAY_V2_ENV: "0"}, f"Ray's V1 executor ({paths.RAY_V2_ENV}=0)"),
    ({}, {}, {paths.RUNNER_ENV: "true"}, f"{paths.RUNNER_ENV}='true': vLLM reads it with int()"),
    ({}, {}, {paths.RUNNER_ENV: ""}, f"{paths.RUNNER_ENV}='': vLLM reads it with int()"),
])
def test_where_vllm_refuses_to_start_the_prediction_is_an_error_naming_why(
        speculative, engine, environ, message, tiny_models, gpu_choices, monkeypatch):
    from dynamo_spec.engine.args import build_vllm_config

    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    backend = {"distributed_executor_backend": "ray"} if paths.RAY_V2_ENV in environ else {}
    s = tiny(tiny_models, {"method": "eagle3", "model": str(tiny_models["draft"]), **speculative},
             extra=engine, **backend)
    with pytest.raises(ValueError):
        build_vllm_config(s)
    with pytest.raises(paths.PredictionError) as refused:
        paths.predict(s, **{**GPU, "environ": environ})
    assert message in str(refused.value)
    assert [p.message for p in check_features_on_path(s, on_cpu=False)] == [str(refused.value)]


def test_the_cpu_prediction_is_vllms_own_answer_and_the_server_refuses_from_vllms_config(tiny_models):
    """vLLM's config for the tiny pair (the CPU build: no Triton): V1 runner, synchronous scheduling,
    as predicted. The same config with async scheduling on (a GPU's default) is refused for the budget
    by the check the server runs before the engine starts."""
    from dynamo_spec.engine.args import build_vllm_config
    from dynamo_spec.engine.async_llm import EnginePathError, check_engine_path

    s = tiny(tiny_models, {"method": "eagle3", "model": str(tiny_models["draft"]), **BUDGET})
    vllm_config = build_vllm_config(s)
    real = paths.from_vllm_config(vllm_config)
    predicted = paths.predict(s, on_cpu=True, triton=paths.has_triton(on_cpu=True))
    assert pair(real) == pair(predicted) == V1_SYNC
    assert check_engine_path(s, vllm_config, []) == real
    vllm_config.scheduler_config.async_scheduling = True
    with pytest.raises(EnginePathError, match=r"^speculative.draft_budget: .*synchronous scheduling"):
        check_engine_path(s, vllm_config, [])


def test_the_server_refuses_what_an_unapplied_patch_leaves_inactive_as_preflight_does(tiny_models, caplog):
    """`serve --skip-preflight` skips preflight; the server's own check, from vLLM's config, gives the
    same lines for the patches that stay off on this vLLM (passed in, as open_engine passes
    ``vllm_patches.unapplied``)."""
    from dynamo_spec.engine.args import build_vllm_config
    from dynamo_spec.engine.async_llm import EnginePathError, check_engine_path

    s = tiny(tiny_models, {"method": "eagle3", "model": str(tiny_models["draft"]), "guard": {"enabled": True}})
    vllm_config = build_vllm_config(s)
    off = [patch("draft_admission"), patch("seeded_sampling")]
    lines = [p.message for p in features.refusals(s, paths.from_vllm_config(vllm_config), off)]
    assert len(lines) == 2 and lines[1].startswith("speculative.guard: vLLM ") and "draft_admission" in lines[1]
    assert "seeded_sampling" in lines[0] and "engine.allow_unpatched_vllm: true" in lines[0]
    with pytest.raises(EnginePathError) as refused:
        check_engine_path(s, vllm_config, off)
    assert str(refused.value) == "; ".join(lines)
    # allowed: the missing correctness fix is a warning, the engine starts; the guard alone still refused
    allowed = tiny(tiny_models, {"method": "eagle3", "model": str(tiny_models["draft"])}, allow_unpatched_vllm=True)
    assert check_engine_path(allowed, vllm_config, off) == paths.from_vllm_config(vllm_config)
    assert any("seeded_sampling" in r.getMessage() for r in caplog.records if r.levelname == "WARNING")
    with pytest.raises(EnginePathError, match=r"^speculative.guard: .*draft_admission"):
        check_engine_path(s, vllm_config, [patch("draft_admission")])


# --------------------------------------------------------------------------- predictions without vLLM


def test_the_cpu_platform_and_the_v1_runners_limits_turn_async_off():
    s = settings()
    assert pair(paths.predict(s, **CPU)) == V1_SYNC
    assert pair(paths.predict(settings(engine={"extra": {"async_scheduling": True}}), **CPU)) == V1_SYNC
    pp = settings(engine={"pipeline_parallel_size": 2})
    assert pair(paths.predict(pp, **GPU)) == V2_ASYNC
    assert pair(paths.predict(pp, **{**GPU, "environ": {paths.RUNNER_ENV: "0"}})) == V1_SYNC
    with pytest.raises(paths.PredictionError, match="pipeline parallelism on the V1 runner"):
        paths.predict(settings(engine={"pipeline_parallel_size": 2, "extra": {"async_scheduling": True}}),
                      **{**GPU, "environ": {paths.RUNNER_ENV: "0"}})
    with pytest.raises(paths.PredictionError, match=f"{paths.RUNNER_ENV}=1: .*parallel drafting"):
        paths.predict(settings(extra={"parallel_drafting": True}), **{**GPU, "environ": {paths.RUNNER_ENV: "1"}})
    with pytest.raises(paths.PredictionError, match=f"{paths.RUNNER_ENV}=1: .*Triton"):
        paths.predict(s, **{**CPU, "environ": {paths.RUNNER_ENV: "1"}})


class Backend(types.SimpleNamespace):
    def __init__(self, active: bool):
        super().__init__(driver=types.SimpleNamespace(is_active=lambda: active))


@pytest.mark.parametrize("backends, cpu_build, environ, usable", [
    (None, False, {}, False),
    ({"nvidia": Backend(True), "amd": Backend(False)}, False, {}, True),
    ({"nvidia": Backend(True), "cpu": Backend(True)}, False, {}, True),  # Triton's CPU driver does not count
    ({"nvidia": Backend(True), "amd": Backend(True)}, False, {}, False),  # two active drivers
    ({"nvidia": Backend(False)}, False, {}, False),  # the package, no active driver
    ({"nvidia": Backend(False)}, False, {"CUDA_VISIBLE_DEVICES": ""}, True),  # Ray's workers, drivers later
    ({"cpu": Backend(True)}, True, {}, True),
    ({"nvidia": Backend(True)}, True, {}, False),  # vLLM's CPU build needs Triton's CPU backend
])
def test_triton_counts_as_vllm_counts_it(backends, cpu_build, environ, usable):
    assert paths.triton_usable(backends, cpu_build=cpu_build, environ=environ) is usable


def test_has_triton_agrees_with_vllm_here():
    from vllm.triton_utils import HAS_TRITON

    assert paths.has_triton(on_cpu=True) is HAS_TRITON


# --------------------------------------------------------------------------- features on each path


def test_the_budget_is_refused_on_the_gpu_path_with_what_would_make_it_work():
    s = settings(**BUDGET)
    [line] = [p.message for p in features.refusals(s, paths.predict(s, **GPU), [])]
    assert line.startswith("speculative.draft_budget: the confidence draft budget")
    assert f"{paths.RUNNER_ENV}=0" in line and "engine.extra.async_scheduling: false" in line
    assert "Model Runner V2 with asynchronous scheduling" in line
    # async off alone is not enough: the V2 runner has no confidences
    sync = settings(engine={"extra": {"async_scheduling": False}}, **BUDGET)
    [line] = [p.message for p in features.refusals(sync, paths.predict(sync, **GPU), [])]
    needs = line.split("needs ", 1)[1].split(", and this engine runs")[0]
    assert needs == f"the V1 model runner ({paths.TO_V1_RUNNER})"
    v1_sync = paths.predict(sync, **{**GPU, "environ": {paths.RUNNER_ENV: "0"}})
    assert features.refusals(sync, v1_sync, []) == []
    assert features.refusals(s, paths.predict(s, **CPU), []) == []


def test_the_scheduler_features_run_on_every_path_and_the_automatic_ones_say_where_they_stay_off():
    s = settings(guard={"enabled": True}, tenants={"free": {"max_draft_tokens": 1}},
                 num_speculative_tokens_per_batch_size=[[1, 4, 3], [5, 1024, 1]])
    for where in (GPU, CPU):
        assert features.refusals(s, paths.predict(s, **where), []) == []
    assert features.inactive(s, paths.predict(s, **CPU), []) == []
    lines = features.inactive(s, paths.predict(s, **GPU), [])
    assert [line.split(":")[0] for line in lines] == ["cheap k=0 steps", "draft-side penalties"]
    assert all("inactive on Model Runner V2" in line for line in lines)
    no_penalties = settings(draft_penalties=False)
    assert [line.split(":")[0] for line in features.inactive(no_penalties, paths.predict(s, **GPU), [])] == [
        "cheap k=0 steps"]
    # where their patch stays off, on any path
    [line] = features.inactive(no_penalties, paths.predict(s, **CPU), [patch("zero_draft_steps")])
    assert line.startswith("cheap k=0 steps: inactive (vLLM ") and "zero_draft_steps" in line


def test_preflight_refuses_the_budget_where_the_gpu_would_run_it(tmp_path, monkeypatch):
    monkeypatch.setattr(paths, "has_triton", lambda on_cpu, environ=None: not on_cpu)  # a GPU host has it
    monkeypatch.delenv(paths.RUNNER_ENV, raising=False)
    s = settings(target=tmp_path / "missing", **BUDGET)
    lines = [p.message for p in run_preflight(s, on_cpu=False) if p.level == "error"]
    assert any(line.startswith("speculative.draft_budget: the confidence draft budget") for line in lines), lines
    assert not any("draft_budget" in p.message for p in run_preflight(s, on_cpu=True))


def test_the_engine_is_sized_as_vllm_serve_sizes_it(tiny_models):
    """vLLM sizes max_num_seqs / max_num_batched_tokens by usage context; AsyncLLM's default context
    gets the scheduler's defaults (128 / 2,048), `vllm serve`'s more (here, CPU with two ranks: twice
    that; an H100: 1,024 / 8,192)."""
    from dynamo_spec.engine.args import build_vllm_config

    s = tiny(tiny_models, {"enabled": False}, tensor_parallel_size=2)
    scheduler = build_vllm_config(s).scheduler_config
    assert (scheduler.max_num_seqs, scheduler.max_num_batched_tokens) == (256, 4096)


# --------------------------------------------------------------------------- the vLLM source predict mirrors
# A change upstream changes a digest: re-read that source, update paths.predict, then the digest.


def digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def between(source: str, start: str, end: str) -> str:
    first = source.index(start)
    return source[first:source.index(end, first)]


def upstream_sources() -> dict[str, str]:
    import vllm.envs
    import vllm.triton_utils.importing
    from vllm.config import VllmConfig
    from vllm.platforms.cpu import CpuPlatform
    from vllm.v1.executor.abstract import Executor

    envs = inspect.getsource(vllm.envs)
    return {
        "VllmConfig.use_v2_model_runner": inspect.getsource(VllmConfig.use_v2_model_runner.fget),
        "VllmConfig._get_v2_model_runner_unsupported_features": inspect.getsource(
            VllmConfig._get_v2_model_runner_unsupported_features),
        "VllmConfig.__post_init__ (async scheduling)": between(
            inspect.getsource(VllmConfig.__post_init__), "executor_backend = self.parallel_config",
            "disable_nccl_for_dp_synchronization is None"),
        "Executor.get_class": inspect.getsource(Executor.get_class),
        "envs (the two variables)": between(envs, '"VLLM_USE_RAY_V2_EXECUTOR_BACKEND": lambda', "),\n")
        + between(envs, '"VLLM_USE_V2_MODEL_RUNNER": lambda', "),\n")
        + inspect.getsource(vllm.envs.maybe_convert_bool),
        "triton_utils HAS_TRITON": between(inspect.getsource(vllm.triton_utils.importing), "HAS_TRITON = (",
                                           "if not HAS_TRITON:"),
        "CpuPlatform (async off)": between(inspect.getsource(CpuPlatform.check_and_update_config),
                                           "scheduler_config = vllm_config.scheduler_config", "parallel_config ="),
    }


PINNED = {
    "VllmConfig.use_v2_model_runner": "515385db129c",
    "VllmConfig._get_v2_model_runner_unsupported_features": "cb1a79994bd3",
    "VllmConfig.__post_init__ (async scheduling)": "8dd36318a479",
    "Executor.get_class": "894e908d6575",
    "envs (the two variables)": "d201eb2f118f",
    "triton_utils HAS_TRITON": "2c394b845d4f",
    "CpuPlatform (async off)": "527bb18e3d3b",
}


def test_the_upstream_choices_predict_mirrors_are_unchanged():
    changed = {name: digest(text) for name, text in upstream_sources().items() if digest(text) != PINNED[name]}
    assert not changed, f"vLLM changed what dynamo_spec/engine/paths.py:predict mirrors: {changed}"


def test_the_executors_ray_picks_schedule_as_predicted():
    """Ray's default executor (RayExecutorV2) is a MultiprocExecutor and keeps async scheduling; the
    old one (VLLM_USE_RAY_V2_EXECUTOR_BACKEND=0) does not."""
    from vllm.v1.executor.multiproc_executor import MultiprocExecutor
    from vllm.v1.executor.ray_executor import RayDistributedExecutor
    from vllm.v1.executor.ray_executor_v2 import RayExecutorV2

    assert issubclass(RayExecutorV2, MultiprocExecutor) and RayExecutorV2.supports_async_scheduling()
    assert not RayDistributedExecutor.supports_async_scheduling()


@pytest.mark.parametrize("torch_cuda, driver, refused", [
    ("13.0", 13000, False), ("13.0", 13020, False), ("13.0", 12080, True), ("12.8", 12080, False),
    (None, None, False), ("13.0", None, False),
])
def test_the_driver_must_support_torchs_cuda(torch_cuda, driver, refused):
    problems = check_driver(torch_cuda, driver)
    assert bool(problems) is refused
    if refused:
        assert "supports CUDA 12.8" in problems[0].message and "CUDA 13.0" in problems[0].message
