"""engine.dtype: auto follows the CPU's instruction set; explicit dtypes always win."""

from __future__ import annotations

import pytest

from dynamo_spec.config.loader import load_settings
from dynamo_spec.engine.args import engine_kwargs
from dynamo_spec.engine.host import Host, cpu_info, resolve_dtype

pytestmark = pytest.mark.unit

AVX512_BF16 = frozenset({"avx2", "avx512f", "avx512_bf16"})
AMX = frozenset({"avx2", "avx512f", "amx_bf16", "amx_tile"})
AVX2 = frozenset({"avx2", "fma"})


def host(flags: frozenset[str], on_cpu: bool = True, **environ: str) -> Host:
    return Host(on_cpu=on_cpu, cpu_model="test", cpu_flags=flags, environ=environ)


@pytest.mark.parametrize("flags, expected", [(AVX512_BF16, "bfloat16"), (AMX, "bfloat16"), (AVX2, "float32")])
def test_auto_on_cpu_follows_native_bf16(flags, expected):
    dtype, why = resolve_dtype("auto", host(flags))
    assert dtype == expected
    assert why.startswith("auto on CPU: ")


@pytest.mark.parametrize("environ", [{"ONEDNN_MAX_CPU_ISA": "avx2"}, {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE"},
                                     {"ATEN_CPU_CAPABILITY": "avx2"}])
def test_an_isa_cap_below_bf16_counts_as_no_bf16(environ):
    dtype, why = resolve_dtype("auto", host(AMX, **environ))
    assert dtype == "float32" and next(iter(environ)) in why


def test_a_cap_that_keeps_bf16_keeps_bf16():
    assert resolve_dtype("auto", host(AMX, ONEDNN_MAX_CPU_ISA="AVX512_CORE_BF16"))[0] == "bfloat16"


@pytest.mark.parametrize("dtype", ["bfloat16", "float32", "float16"])
def test_explicit_dtype_wins(dtype):
    assert resolve_dtype(dtype, host(AVX2)) == (dtype, None)
    assert resolve_dtype(dtype, host(AMX)) == (dtype, None)


def test_auto_on_gpu_is_vllms_choice():
    assert resolve_dtype("auto", host(AVX2, on_cpu=False)) == ("auto", None)


def test_cpu_info_reads_model_and_flags(tmp_path):
    path = tmp_path / "cpuinfo"
    path.write_text("processor\t: 0\nmodel name\t: AMD EPYC 7B13\nflags\t\t: fpu avx2 fma\n\n"
                    "processor\t: 1\nmodel name\t: AMD EPYC 7B13\nflags\t\t: fpu avx2 fma\n")
    assert cpu_info(path) == ("AMD EPYC 7B13", frozenset({"fpu", "avx2", "fma"}))
    assert cpu_info(tmp_path / "missing") == ("unknown", frozenset())


def test_cpu_default_config_resolves_per_host(repo_root):
    settings = load_settings(repo_root / "configs" / "smollm2-135m-instruct-eagle3-cpu.yaml", [], {}).settings
    assert settings.engine.dtype == "auto"
    assert engine_kwargs(settings, host(AVX2))["dtype"] == "float32"
    assert engine_kwargs(settings, host(AMX))["dtype"] == "bfloat16"
    assert engine_kwargs(settings)["dtype"] == "auto"  # without a host: as written


def test_cpu_preload_finds_intel_openmp_in_the_environment(tmp_path):
    from dynamo_spec.engine.process_env import cpu_preload_libraries

    (tmp_path / "lib").mkdir()
    assert str(tmp_path / "lib" / "libiomp5.so") not in cpu_preload_libraries(str(tmp_path))
    (tmp_path / "lib" / "libiomp5.so").write_bytes(b"")
    assert cpu_preload_libraries(str(tmp_path))[0] == str(tmp_path / "lib" / "libiomp5.so")


def test_cpu_preload_prepends_what_is_missing_and_keeps_the_users():
    from dynamo_spec.engine.process_env import apply_cpu_preload

    env: dict[str, str] = {}
    assert apply_cpu_preload(env, ["/v/lib/libiomp5.so", "/usr/lib/libtcmalloc_minimal.so.4"]) == [
        "/v/lib/libiomp5.so", "/usr/lib/libtcmalloc_minimal.so.4"]
    assert env["LD_PRELOAD"] == "/v/lib/libiomp5.so:/usr/lib/libtcmalloc_minimal.so.4"
    env = {"LD_PRELOAD": "/opt/libtcmalloc_minimal.so.4"}  # the user's own tcmalloc wins
    assert apply_cpu_preload(env, ["/v/lib/libiomp5.so", "/usr/lib/libtcmalloc_minimal.so.4"]) == ["/v/lib/libiomp5.so"]
    assert env["LD_PRELOAD"] == "/v/lib/libiomp5.so:/opt/libtcmalloc_minimal.so.4"
    assert apply_cpu_preload(env, ["/v/lib/libiomp5.so"]) == []
    # An OpenMP runtime already preloaded (vLLM puts PyTorch's libgomp into the environment of
    # any process that ran an engine) is kept: vLLM's engine refuses two of them.
    env = {"LD_PRELOAD": "/t/torch.libs/libgomp-a34b3233.so.1.0.0"}
    assert apply_cpu_preload(env, ["/v/lib/libiomp5.so", "/usr/lib/libtcmalloc_minimal.so.4"]) == [
        "/usr/lib/libtcmalloc_minimal.so.4"]
    assert env["LD_PRELOAD"] == "/usr/lib/libtcmalloc_minimal.so.4:/t/torch.libs/libgomp-a34b3233.so.1.0.0"


# --- vLLM's Zen CPU platform on AMD CPUs (dynamo_spec/vllm_patches/zen_platform.py) -------------------

from dynamo_spec.vllm_patches import zen_platform  # noqa: E402


@pytest.mark.parametrize("vllm_choice, amd, environ, importable, expected", [
    (zen_platform.CPU_PLATFORM, True, {}, True, zen_platform.ZEN_PLATFORM),  # AMD without AVX-512
    (zen_platform.CPU_PLATFORM, False, {}, True, None),  # Intel: vLLM's choice
    (zen_platform.ZEN_PLATFORM, True, {}, True, None),  # vLLM picked Zen itself (AVX-512)
    (None, True, {}, True, None),  # not vLLM's CPU build (a GPU)
    (zen_platform.CPU_PLATFORM, True, {}, False, None),  # zentorch missing or broken
    (zen_platform.CPU_PLATFORM, True, {"DYNAMO_SPEC_ZENTORCH": "0"}, True, None),  # turned off
])
def test_zen_platform_only_where_vllm_would_run_oneDNN_on_an_AMD_cpu(vllm_choice, amd, environ, importable,
                                                                     expected):
    assert zen_platform.choose(vllm_choice, amd, environ, lambda: importable) == expected


def test_zentorch_is_not_imported_where_it_cannot_be_chosen():
    def importable():
        raise AssertionError("imported")

    assert zen_platform.choose(zen_platform.CPU_PLATFORM, False, {}, importable) is None


def test_amd_cpu_from_cpuinfo(tmp_path):
    (tmp_path / "amd").write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t: avx2\n")
    (tmp_path / "intel").write_text("processor\t: 0\nvendor_id\t: GenuineIntel\nflags\t: avx2\n")
    assert zen_platform.is_amd_cpu(tmp_path / "amd")
    assert not zen_platform.is_amd_cpu(tmp_path / "intel")
    assert not zen_platform.is_amd_cpu(tmp_path / "missing")


@pytest.mark.parametrize("dtype, flags, works", [
    ("float32", AVX2, True), ("float32", AVX512_BF16, True),
    ("bfloat16", AVX2, False),  # zentorch raises: its bf16 path needs avx512bf16
    ("bfloat16", AVX512_BF16, True),
    ("float16", AVX512_BF16, False),  # no fp16 compute on AMD CPUs
])
def test_zentorch_gemms_only_for_the_dtypes_they_compute(dtype, flags, works):
    import torch

    assert zen_platform.zen_gemm_works(getattr(torch, dtype), host(flags)) is works


def test_a_bf16_isa_cap_turns_zentorch_bf16_off():
    import torch

    assert not zen_platform.zen_gemm_works(torch.bfloat16, host(AVX512_BF16, ONEDNN_MAX_CPU_ISA="AVX2"))
