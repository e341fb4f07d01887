"""The settings -> AsyncEngineArgs function, pinned for the shipped configs."""

from __future__ import annotations

import pytest

from dynamo_spec.config.loader import load_settings
from dynamo_spec.config.settings import GuardSettings
from dynamo_spec.engine.args import build_engine_args, engine_kwargs

pytestmark = pytest.mark.unit


def test_gpu_default_mirrors_the_dynamo_guide(repo_root):
    settings = load_settings(repo_root / "configs/llama-3.1-8b-instruct-eagle3.yaml", [], {}).settings
    assert settings.server.port == 8000
    assert engine_kwargs(settings) == {
        "model": "meta-llama/Meta-Llama-3.1-8B-Instruct",
        "served_model_name": ["meta-llama/Meta-Llama-3.1-8B-Instruct"],
        "dtype": "auto",
        "tensor_parallel_size": 1,
        "pipeline_parallel_size": 1,
        "data_parallel_size": 1,
        "gpu_memory_utilization": 0.8,
        "enforce_eager": True,
        "seed": 0,
        "speculative_config": {
            "method": "eagle3",
            "model": "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B",
            "num_speculative_tokens": 2,
            "draft_tensor_parallel_size": 1,
        },
        "per_request_spec_decode_metrics": "summary",
        "worker_extension_cls": "dynamo_spec.learning.swap.DraftSwapExtension",  # the live draft swap
        # this project's switches of the engine (engine_switches): the guide's, no guard, no budget
        "additional_config": {"dynamo_spec": {"draft_penalties": True, "guard": None, "draft_budget": None,
                                              "suffix": None, "draft_confidence": False}},
    }


BF16_SCHEDULE = [[1, 1, 4], [2, 2, 2], [3, 11, 1], [12, 128, 0]]  # runs 12 (Xeon with AMX) and 19 (EPYC Zen 4)
FP32_SCHEDULE = [[1, 5, 2], [6, 11, 1], [12, 128, 0]]  # the shipped fp32 entry


@pytest.mark.parametrize("flags, dtype, schedule", [
    (frozenset({"avx2", "avx512f", "avx512_bf16", "amx_bf16"}), "bfloat16", BF16_SCHEDULE),
    (frozenset({"avx2", "fma"}), "float32", FP32_SCHEDULE),
])
def test_cpu_default(repo_root, flags, dtype, schedule):
    from dynamo_spec.engine.host import Host

    settings = load_settings(repo_root / "configs/smollm2-135m-instruct-eagle3-cpu.yaml", [], {}).settings
    host = Host(on_cpu=True, cpu_model="test", cpu_flags=flags, environ={})
    assert engine_kwargs(settings, host) == {
        "model": str(repo_root / ".cache/models/SmolLM2-135M-Instruct"),
        "served_model_name": ["SmolLM2-135M-Instruct"],
        "dtype": dtype,  # auto, resolved for the host (tests/unit/test_host.py)
        "max_model_len": 2048,
        "tensor_parallel_size": 1,
        "pipeline_parallel_size": 1,
        "data_parallel_size": 1,
        "gpu_memory_utilization": 0.9,
        "kv_cache_memory_bytes": 512 * 2**20,
        "enforce_eager": False,
        "seed": 0,
        "speculative_config": {
            "method": "eagle3",
            "model": str(repo_root / "models/smollm2-135m-instruct-eagle3"),
            "num_speculative_tokens": 4,
            "num_speculative_tokens_per_batch_size": schedule,  # the entry for the host's dtype
            "use_local_argmax_reduction": True,
            "disable_eagle_block_drop": True,
        },
        "per_request_spec_decode_metrics": "summary",
        "worker_extension_cls": "dynamo_spec.learning.swap.DraftSwapExtension",  # the live draft swap
        # the guard on with the settings' defaults (config/settings.py GuardSettings), no budget
        "additional_config": {"dynamo_spec": {
            "draft_penalties": True, "draft_budget": None, "draft_confidence": False, "suffix": None,
            "guard": GuardSettings().model_dump(exclude={"enabled"})}},
    }


def test_pass_through_and_speculation_off(repo_root):
    settings = load_settings(
        repo_root / "configs/smollm2-135m-instruct-eagle3-cpu.yaml",
        ["--engine.extra.block_size", "32", "--speculative.enabled", "false", "--engine.max_num_seqs", "4"],
        {},
    ).settings
    kwargs = engine_kwargs(settings)
    assert kwargs["block_size"] == 32 and kwargs["max_num_seqs"] == 4
    assert "speculative_config" not in kwargs and "per_request_spec_decode_metrics" not in kwargs
    assert "additional_config" not in kwargs  # no switches without speculation


def test_speculative_pass_through(repo_root):
    settings = load_settings(
        repo_root / "configs/llama-3.1-8b-instruct-eagle3.yaml",
        ["--speculative.extra.disable_padded_drafter_batch", "true"], {},
    ).settings
    assert engine_kwargs(settings)["speculative_config"]["disable_padded_drafter_batch"] is True


def test_builds_real_engine_args(repo_root, tiny_models):
    overrides = ["--engine.model", str(tiny_models["target"]), "--speculative.model", str(tiny_models["draft"])]
    settings = load_settings(repo_root / "configs/smollm2-135m-instruct-eagle3-cpu.yaml", overrides, {}).settings
    args = build_engine_args(settings)
    assert type(args).__name__ == "AsyncEngineArgs"
    assert args.dtype in ("bfloat16", "float32")  # auto, resolved for this host
    assert args.speculative_config == {"method": "eagle3", "model": str(tiny_models["draft"]), "num_speculative_tokens": 4,
                                       "num_speculative_tokens_per_batch_size":
                                           BF16_SCHEDULE if args.dtype == "bfloat16" else FP32_SCHEDULE,
                                       "use_local_argmax_reduction": True, "disable_eagle_block_drop": True}
    assert args.kv_cache_memory_bytes == 512 * 2**20 and args.per_request_spec_decode_metrics == "summary"


def test_cpu_thread_binding_covers_all_cores_on_small_cpu_hosts_only():
    from dynamo_spec.engine.cpu_threads import VAR, default_cpu_thread_binding

    env: dict[str, str] = {}
    assert default_cpu_thread_binding(env, cpus={0, 1}, is_cpu=True) == "0,1"
    two_ranks: dict[str, str] = {}
    assert default_cpu_thread_binding(two_ranks, cpus={0, 1, 2, 3}, is_cpu=True, ranks=2) == "0,1|2,3"
    assert default_cpu_thread_binding({}, cpus={0, 1}, is_cpu=True, ranks=4) is None
    assert env == {VAR: "0,1"}
    user = {VAR: "auto"}  # the user's choice is kept
    assert default_cpu_thread_binding(user, cpus={0, 1}, is_cpu=True) is None
    assert user == {VAR: "auto"}
    for cpus, is_cpu in (({0, 1}, False), (set(range(16)), True)):  # GPU host; big CPU host
        env = {}
        assert default_cpu_thread_binding(env, cpus=cpus, is_cpu=is_cpu) is None and env == {}


def test_schedule_reaches_the_speculative_config(repo_root):
    settings = load_settings(
        repo_root / "configs" / "smollm2-135m-instruct-eagle3-cpu.yaml",
        ["--speculative.num_speculative_tokens_per_batch_size", "[[1, 2, 3], [3, 128, 0]]"], {},
    ).settings
    assert engine_kwargs(settings)["speculative_config"]["num_speculative_tokens_per_batch_size"] == [
        [1, 2, 3], [3, 128, 0]]


def test_a_schedule_per_dtype_applies_the_entry_for_the_dtype_the_engine_runs_in(repo_root):
    from dynamo_spec.config.schedule import for_engine as schedule_for
    from dynamo_spec.engine.host import Host

    per_dtype = '{"bfloat16": [[1, 2, 3], [3, 128, 0]], "float32": [[1, 1, 2], [2, 128, 0]]}'
    settings = load_settings(repo_root / "configs" / "smollm2-135m-instruct-eagle3-cpu.yaml",
                             ["--speculative.num_speculative_tokens_per_batch_size", per_dtype], {}).settings
    amx = Host(on_cpu=True, cpu_model="t", cpu_flags=frozenset({"avx512f", "amx_bf16"}), environ={})
    avx2 = Host(on_cpu=True, cpu_model="t", cpu_flags=frozenset({"avx2"}), environ={})
    for host, dtype, schedule in ((amx, "bfloat16", [[1, 2, 3], [3, 128, 0]]),
                                  (avx2, "float32", [[1, 1, 2], [2, 128, 0]])):
        kwargs = engine_kwargs(settings, host)
        assert kwargs["dtype"] == dtype
        assert kwargs["speculative_config"]["num_speculative_tokens_per_batch_size"] == schedule
    # An explicit dtype picks its entry on any host ("float" is vLLM's alias of float32).
    explicit = settings.model_copy(update={"engine": settings.engine.model_copy(update={"dtype": "float"})})
    assert engine_kwargs(explicit, amx)["speculative_config"]["num_speculative_tokens_per_batch_size"] == [
        [1, 1, 2], [2, 128, 0]]
    # No entry for the dtype: `default` if given, else a fixed k (no schedule reaches vLLM).
    assert schedule_for(settings, "float16") == (
        None, "no entry for float16 and no default: a fixed k of speculative.num_speculative_tokens")
    assert "num_speculative_tokens_per_batch_size" not in speculative_config_for(settings, "float16")
    with_default = load_settings(repo_root / "configs" / "smollm2-135m-instruct-eagle3-cpu.yaml",
                                 ["--speculative.num_speculative_tokens_per_batch_size",
                                  '{"default": [[1, 128, 1]], "float32": [[1, 128, 2]]}'], {}).settings
    assert schedule_for(with_default, "float16") == ([(1, 128, 1)], "the default entry (no float16 entry)")
    assert schedule_for(with_default, "float32") == ([(1, 128, 2)], "the float32 entry (the engine runs in float32)")


def speculative_config_for(settings, dtype):
    from dynamo_spec.engine.args import speculative_config

    return speculative_config(settings, dtype)
