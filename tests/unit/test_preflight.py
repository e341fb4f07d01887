"""Preflight rejects each bad target/draft pairing, on generated checkpoints."""

from __future__ import annotations

import hashlib
import http.server
import json
import math
import shutil
import struct
import subprocess
import sys
import urllib.parse
from pathlib import Path

import pytest
import yaml

from dynamo_spec.config.loader import load_settings
from dynamo_spec.config.preflight import run_preflight

pytestmark = pytest.mark.unit


@pytest.fixture
def pair(tmp_path: Path, tiny_models: dict[str, Path]):
    """Copies of the tiny target and draft, and a helper to edit their config.json."""
    target = shutil.copytree(tiny_models["target"], tmp_path / "target")
    draft = shutil.copytree(tiny_models["draft"], tmp_path / "draft")

    def edit(directory: Path, **changes) -> None:
        path = directory / "config.json"
        config = json.loads(path.read_text())
        for key, value in changes.items():
            if value is None:
                config.pop(key, None)
            else:
                config[key] = value
        path.write_text(json.dumps(config))

    return target, draft, edit


def check(target, draft, *overrides: str, method: str = "eagle3", on_cpu: bool = True) -> list[str]:
    config = {
        "engine": {"model": str(target), "kv_cache_memory_bytes": "256MiB"},
        "speculative": {"method": method, "model": str(draft), "num_speculative_tokens": 3},
    }
    path = Path(str(target) + ".yaml")
    path.write_text(yaml.safe_dump(config))
    settings = load_settings(path, list(overrides), {}).settings
    return [str(p) for p in run_preflight(settings, on_cpu=on_cpu)]


def only_error(problems: list[str]) -> str:
    errors = [p for p in problems if p.startswith("error:")]
    assert len(errors) == 1, problems
    return errors[0]


def test_matching_pair_passes(pair):
    target, draft, _ = pair
    assert check(target, draft) == []


def test_missing_directories(pair, tmp_path):
    target, draft, _ = pair
    problem = only_error(check(tmp_path / "nope", draft))
    assert "engine.model" in problem and "does not exist" in problem
    problem = only_error(check(target, tmp_path / "nodraft"))
    assert "speculative.model" in problem and "does not exist" in problem


def test_directory_without_config_json(pair):
    target, draft, _ = pair
    (draft / "config.json").unlink()
    assert "has no config.json" in only_error(check(target, draft))


def test_hub_id_without_hub_access_is_one_clear_line(pair):
    target, _, _ = pair
    problem = only_error(check(target, "someone/some-eagle3-draft"))
    assert "not a local directory" in problem and "huggingface-cli download someone/some-eagle3-draft" in problem
    assert "\n" not in problem


def test_method_eagle_with_an_eagle3_checkpoint(pair):
    target, draft, _ = pair
    problem = only_error(check(target, draft, method="eagle"))
    assert "set speculative.method: eagle3" in problem and "KeyError: 'd2t'" in problem


def test_method_eagle3_with_an_eagle1_checkpoint(pair):
    target, draft, edit = pair
    edit(draft, architectures=["EagleLlamaForCausalLM"], draft_vocab_size=None, eagle_config=None)
    assert "is not an EAGLE-3 checkpoint" in only_error(check(target, draft))


def test_hidden_size_mismatch(pair):
    target, draft, edit = pair
    edit(draft, hidden_size=256, target_hidden_size=256)
    assert "built for hidden size 256 but the target's is 128" in only_error(check(target, draft))


def test_vocabulary_mismatch(pair):
    target, draft, edit = pair
    edit(draft, vocab_size=1024)
    assert "vocabulary mismatch: target has 512 tokens" in only_error(check(target, draft))


def test_aux_layer_ids_out_of_range(pair):
    target, draft, edit = pair
    edit(draft, eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 2, 7]})
    assert "outside the target's 4 layers" in only_error(check(target, draft))


def test_aux_layer_ids_collide_with_vllm_default_on_a_small_target(pair):
    target, draft, edit = pair
    edit(draft, eagle_config={"use_aux_hidden_state": True})  # no ids: vLLM's default (2, 2, 1)
    problem = only_error(check(target, draft))
    assert "[2, 2, 1]" in problem and "collide" in problem and "crash on the first request" in problem


def test_configured_aux_ids_must_match_the_draft(pair):
    target, draft, _ = pair
    problem = only_error(check(target, draft, "--speculative.aux_hidden_state_layer_ids", "[0, 1, 2]"))
    assert "is [0, 1, 2] but vLLM will use [1, 2, 3]" in problem


def test_head_size_unsupported_on_cpu_only(pair):
    target, draft, edit = pair
    edit(target, head_dim=48)
    assert "head size 48 is not supported by vLLM's CPU attention" in only_error(check(target, draft))
    assert check(target, draft, on_cpu=False) == []


def test_memory_estimate(pair):
    target, draft, _ = pair
    problem = only_error(check(target, draft, "--engine.kv_cache_memory_bytes", "100TiB"))
    assert problem.startswith("error: memory:") and "lower engine.kv_cache_memory_bytes" in problem


def test_untrained_draft_is_a_loud_warning(pair):
    target, draft, edit = pair
    edit(draft, dynamo_spec_untrained=True)
    (problem,) = check(target, draft)
    assert problem.startswith("warning:") and "UNTRAINED" in problem


def test_cli_check_exit_code_and_one_line_per_problem(pair):
    target, draft, edit = pair
    edit(draft, hidden_size=256, target_hidden_size=256)
    path = Path(str(target) + ".yaml")
    path.write_text(yaml.safe_dump({
        "engine": {"model": str(target), "kv_cache_memory_bytes": "256MiB"},
        "speculative": {"method": "eagle", "model": str(draft)},
    }))
    result = subprocess.run([sys.executable, "-m", "dynamo_spec", "check", "--config", str(path)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 2, result.stderr  # wrong method, wrong hidden size
    assert "Traceback" not in result.stderr


# --- the batch-size schedule of k --------------------------------------------

def test_a_good_schedule_passes(pair):
    target, draft, _ = pair
    schedule = "[[1, 2, 3], [3, 8, 1], [9, 128, 0]]"
    assert check(target, draft, "--speculative.num_speculative_tokens_per_batch_size", schedule) == []


@pytest.mark.parametrize("schedule, expected", [
    ("[[1, 4, 3], [4, 128, 0]]", "[1] [4, 128, 0]: overlaps or is out of order"),
    ("[[1, 4, 3], [6, 128, 0]]", "batch sizes 5..5 have no range"),
    ("[[2, 128, 3]]", "batch sizes 1..1 have no range"),
    ("[[1, 4, 5], [5, 128, 0]]", "[0] [1, 4, 5]: k must be in 0..speculative.num_speculative_tokens (3)"),
    ("[[1, 4, 3], [5, 16, 0]]", "the ranges end at 16 but vLLM's default max_num_seqs here is 128"),
    ("[[1, 4, 3], [5, 3, 0]]", "[1] [5, 3, 0]: a range needs 1 <= lo <= hi"),
])
def test_bad_schedules_are_one_line_each(pair, schedule, expected):
    target, draft, _ = pair
    error = only_error(check(target, draft, "--speculative.num_speculative_tokens_per_batch_size", schedule))
    assert error.startswith("error: speculative.num_speculative_tokens_per_batch_size") and expected in error


def test_schedule_must_cover_the_configured_max_num_seqs(pair):
    target, draft, _ = pair
    schedule = "[[1, 4, 3], [5, 16, 0]]"
    assert check(target, draft, "--speculative.num_speculative_tokens_per_batch_size", schedule,
                 "--engine.max_num_seqs", "16") == []
    error = only_error(check(target, draft, "--speculative.num_speculative_tokens_per_batch_size", schedule,
                             "--engine.max_num_seqs", "32"))
    assert "the ranges end at 16 but engine.max_num_seqs is 32" in error


def test_schedule_entries_are_typed(pair, tmp_path):
    from dynamo_spec.config.loader import ConfigError

    target, draft, _ = pair
    with pytest.raises(ConfigError, match=r"cli: speculative.num_speculative_tokens_per_batch_size.0.2: missing item"):
        check(target, draft, "--speculative.num_speculative_tokens_per_batch_size", "[[1, 2]]")


def test_parallel_layout_against_the_machine():
    from dynamo_spec.config.preflight import check_parallel
    from dynamo_spec.config.settings import Settings

    def problems(engine: dict, spec: dict | None = None, on_cpu: bool = False, gpus: int | None = 4) -> list[str]:
        settings = Settings(engine={"model": "m", **engine},
                            speculative={"method": "eagle3", "model": "d", **(spec or {})})
        return [str(p) for p in check_parallel(settings, on_cpu, gpus)]

    assert problems({"tensor_parallel_size": 2, "pipeline_parallel_size": 2}) == []
    (too_many,) = problems({"tensor_parallel_size": 4, "data_parallel_size": 2})
    assert too_many.startswith("error:") and "= 8 GPUs but this machine shows 4" in too_many
    assert problems({"tensor_parallel_size": 2}, on_cpu=True, gpus=None) == []  # CPU ranks are processes
    (draft,) = problems({"tensor_parallel_size": 2}, {"draft_tensor_parallel_size": 4})
    assert "draft_tensor_parallel_size 4 exceeds engine.tensor_parallel_size 2" in draft
    (schedule,) = problems({"data_parallel_size": 2}, {"num_speculative_tokens_per_batch_size": [[1, 256, 2]]})
    assert schedule.startswith("warning:") and "ignored with engine.data_parallel_size > 1" in schedule


def test_ray_backend_is_checked_against_the_cluster_it_names(monkeypatch):
    """The live-cluster checks run in tests/e2e/test_ray_cluster.py; here: an address nothing answers at."""
    from dynamo_spec.config.preflight import check_parallel
    from dynamo_spec.config.ray_cluster import platform_device
    from dynamo_spec.config.settings import Settings

    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:9")  # the discard port: nothing listens
    settings = Settings(engine={"model": "m", "tensor_parallel_size": 8, "distributed_executor_backend": "ray"},
                        speculative={"method": "eagle3", "model": "d"})
    lines = [str(p) for p in check_parallel(settings, False, 1)]
    assert lines[-1].startswith("error: engine.distributed_executor_backend ray: nothing answers at "
                                "RAY_ADDRESS=127.0.0.1:9")
    platform, device = platform_device()
    assert any(f"cannot run its {platform} platform over Ray" in line for line in lines) == (not device)
    assert not any("this machine shows 1" in line for line in lines)  # the cluster's GPUs count, not this node's


def to_speculators_format(target: Path, draft: Path) -> None:
    from dynamo_spec.config.eagle3_format import to_speculators

    cfg = json.loads((draft / "config.json").read_text())
    archs = json.loads((target / "config.json").read_text())["architectures"]
    (draft / "config.json").write_text(json.dumps(to_speculators(cfg, verifier=str(target),
                                                                 verifier_architectures=archs)))


def test_speculators_format_draft_passes_and_a_mismatch_is_caught(pair):
    from dynamo_spec.config.eagle3_format import vllm_view

    target, draft, _ = pair
    ours = json.loads((draft / "config.json").read_text())
    to_speculators_format(target, draft)
    converted = json.loads((draft / "config.json").read_text())
    assert converted["speculators_model_type"] == "eagle3" and "transformer_layer_config" in converted
    view = vllm_view(converted)  # what vLLM's speculators loader makes of it
    for key in ("hidden_size", "vocab_size", "draft_vocab_size", "num_attention_heads", "intermediate_size"):
        assert view[key] == ours[key], key
    assert view["architectures"] == ["Eagle3LlamaForCausalLM"] and view["norm_before_residual"] is False
    assert check(target, draft) == []

    # A vocabulary mismatch inside transformer_layer_config is seen as with our format.
    converted["transformer_layer_config"]["vocab_size"] += 1
    (draft / "config.json").write_text(json.dumps(converted))
    assert "vocabulary mismatch" in only_error(check(target, draft))

    # A verifier of another architecture.
    converted["transformer_layer_config"]["vocab_size"] -= 1
    converted["speculators_config"]["verifier"]["architectures"] = ["Qwen3ForCausalLM"]
    (draft / "config.json").write_text(json.dumps(converted))
    assert "was trained for" in only_error(check(target, draft))


def test_speculators_draft_of_another_kind(pair):
    target, draft, edit = pair
    to_speculators_format(target, draft)
    edit(draft, speculators_model_type="dflash")
    assert "speculators 'dflash' draft" in " ".join(check(target, draft))


def test_tensor_parallel_must_split_the_heads(pair):
    target, draft, edit = pair
    edit(target, num_attention_heads=9)
    edit(draft, num_attention_heads=9)
    problems = check(target, draft, "--engine.tensor_parallel_size", "2")
    assert any("engine.tensor_parallel_size 2" in p and "9 attention heads" in p for p in problems), problems
    # Heads split; the target's 576 rows split; the draft's 100 rows pad to 128, which 3 do not.
    edit(target, num_attention_heads=6, vocab_size=576)
    edit(draft, num_attention_heads=6, vocab_size=576, draft_vocab_size=100)
    problems = [p for p in check(target, draft, "--engine.tensor_parallel_size", "3") if "split evenly" in p]
    assert len(problems) == 1 and "128 vocabulary rows" in problems[0] and str(draft) in problems[0], problems


def test_a_schedule_per_dtype_is_checked_entry_by_entry(pair):
    target, draft, _ = pair
    good = '{"bfloat16": [[1, 2, 3], [3, 128, 0]], "float32": [[1, 128, 1]]}'
    assert check(target, draft, "--speculative.num_speculative_tokens_per_batch_size", good) == []
    bad = '{"bfloat16": [[1, 2, 3], [3, 128, 0]], "float32": [[1, 4, 1], [4, 128, 0]]}'
    error = only_error(check(target, draft, "--speculative.num_speculative_tokens_per_batch_size", bad))
    assert error.startswith("error: speculative.num_speculative_tokens_per_batch_size.float32[1] [4, 128, 0]: "
                            "overlaps or is out of order"), error


def test_a_schedule_per_dtype_names_an_unknown_dtype(pair, tmp_path):
    from dynamo_spec.config.loader import ConfigError

    target, draft, _ = pair
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({
        "engine": {"model": str(target)},
        "speculative": {"model": str(draft), "num_speculative_tokens_per_batch_size": {"fp32": [[1, 128, 1]]}},
    }))
    with pytest.raises(ConfigError) as err:
        load_settings(config, [], {})
    # The file and the line of the key, the field with the unknown key.
    assert f"{config}:6: speculative.num_speculative_tokens_per_batch_size.fp32: Input should be 'bfloat16', " \
           "'float16', 'float32' or 'default'" in str(err.value), str(err.value)
    with pytest.raises(ConfigError, match=r"cli: speculative.num_speculative_tokens_per_batch_size.float32.0.2: "
                                          r"missing item$"):
        check(target, draft, "--speculative.num_speculative_tokens_per_batch_size", '{"float32": [[1, 2]]}')


# --- hub ids: the GPU config's pair from a Hugging Face cache, or from a Hub behind a proxy ---
# Header-only safetensors files with the real checkpoints' shapes: preflight reads headers only,
# so Llama-3.1-8B costs a few hundred kB here and the memory check still sees its 15 GiB.

GPU_CONFIG = "configs/llama-3.1-8b-instruct-eagle3.yaml"
TARGET_ID, DRAFT_ID = "meta-llama/Meta-Llama-3.1-8B-Instruct", "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
DTYPE_BYTES = {"BF16": 2, "F16": 2, "I64": 8, "BOOL": 1}
GiB = 1 << 30


def header_only(tensors: dict[str, tuple[str, list[int]]]) -> bytes:
    """A safetensors file cut after its header: the 8-byte length, the JSON, no weights."""
    header, offset = {}, 0
    for name, (dtype, shape) in tensors.items():
        end = offset + DTYPE_BYTES[dtype] * math.prod(shape)
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, end]}
        offset = end
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    return struct.pack("<Q", len(blob)) + blob


def llama_8b_files() -> dict[str, bytes]:
    """Meta-Llama-3.1-8B-Instruct: its config.json, four shards and their index."""
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
              "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
              "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 131072,
              "rms_norm_eps": 1e-05, "rope_theta": 500000.0, "hidden_act": "silu", "tie_word_embeddings": False,
              "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                               "original_max_position_embeddings": 8192, "rope_type": "llama3"},
              "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009], "torch_dtype": "bfloat16"}
    h, inter, kv = 4096, 14336, 8 * 128
    layer = {"input_layernorm.weight": [h], "post_attention_layernorm.weight": [h],
             "self_attn.q_proj.weight": [h, h], "self_attn.k_proj.weight": [kv, h], "self_attn.v_proj.weight": [kv, h],
             "self_attn.o_proj.weight": [h, h], "mlp.gate_proj.weight": [inter, h], "mlp.up_proj.weight": [inter, h],
             "mlp.down_proj.weight": [h, inter]}
    shards: list[dict[str, tuple[str, list[int]]]] = [{"model.embed_tokens.weight": ("BF16", [128256, h])}, {}, {}, {}]
    for i in range(32):
        shards[i // 8].update({f"model.layers.{i}.{name}": ("BF16", shape) for name, shape in layer.items()})
    shards[3].update({"model.norm.weight": ("BF16", [h]), "lm_head.weight": ("BF16", [128256, h])})
    names = [f"model-0000{n}-of-00004.safetensors" for n in range(1, 5)]
    index = {"metadata": {}, "weight_map": {t: name for name, shard in zip(names, shards) for t in shard}}
    files = {name: header_only(shard) for name, shard in zip(names, shards)}
    return {"config.json": json.dumps(config).encode(), "model.safetensors.index.json": json.dumps(index).encode(),
            **files}


def eagle3_head_files(fc_inputs: int = 3, d2t_entries: int = 32000) -> dict[str, bytes]:
    """An EAGLE-3 head for it as yuhuili's config.json describes it (no aux ids: vLLM's default
    three), tensors named as vLLM's llama_eagle3.py loads them."""
    from dynamo_spec.config.eagle3_format import tensor_shapes

    config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": 4096,
              "intermediate_size": 14336, "num_hidden_layers": 1, "num_attention_heads": 32, "num_key_value_heads": 8,
              "vocab_size": 128256, "draft_vocab_size": 32000, "max_position_embeddings": 2048, "rms_norm_eps": 1e-05,
              "hidden_act": "silu", "tie_word_embeddings": False, "bos_token_id": 128000, "eos_token_id": 128001,
              "torch_dtype": "float16"}
    tensors = {name: ("F16", list(shape)) for name, shape in tensor_shapes(config).items()}
    tensors["fc.weight"] = ("F16", [4096, fc_inputs * 4096])
    tensors.update({"d2t": ("I64", [d2t_entries]), "t2d": ("BOOL", [128256])})
    return {"config.json": json.dumps(config).encode(), "model.safetensors": header_only(tensors)}


def weights_gib(files: dict[str, bytes]) -> float:
    """What the headers add up to, dtype x shape."""
    total = 0
    for name, data in files.items():
        if name.endswith(".safetensors"):
            (size,) = struct.unpack("<Q", data[:8])
            total += sum(v["data_offsets"][1] - v["data_offsets"][0] for v in json.loads(data[8:8 + size]).values())
    return total / GiB


@pytest.fixture
def hub(tmp_path: Path, monkeypatch, repo_root: Path):
    """An empty Hugging Face cache, offline, on a machine with one 80 GiB GPU; publish() puts a
    repository into the cache (refs/main -> snapshots/COMMIT/, as huggingface_hub lays it out),
    local() writes the same files as a plain directory, check() runs preflight on the GPU config."""
    import huggingface_hub.constants as hf_constants

    from dynamo_spec.config import preflight

    cache_dir = tmp_path / "hf-cache"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache_dir))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(cache_dir))  # huggingface_hub reads both at import
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(preflight, "_gpu_count", lambda: 1)
    monkeypatch.setattr(preflight, "_gpu_memory", lambda: 80 * GiB)

    class Hub:
        cache = cache_dir

        def publish(self, repo_id: str, files: dict[str, bytes]) -> None:
            repo = self.cache / f"models--{repo_id.replace('/', '--')}"
            (repo / "refs").mkdir(parents=True, exist_ok=True)
            (repo / "refs" / "main").write_text(COMMIT)
            self._write(repo / "snapshots" / COMMIT, files)

        def local(self, name: str, files: dict[str, bytes]) -> Path:
            return self._write(tmp_path / "local" / name, files)

        @staticmethod
        def _write(directory: Path, files: dict[str, bytes]) -> Path:
            directory.mkdir(parents=True, exist_ok=True)
            for name, data in files.items():
                (directory / name).write_bytes(data)
            return directory

        @staticmethod
        def check(*overrides: str) -> list[str]:
            settings = load_settings(repo_root / GPU_CONFIG, list(overrides), {}).settings
            return [str(p) for p in run_preflight(settings, on_cpu=False)]

    return Hub()


def check_local(hub, target: Path, draft: Path, *overrides: str) -> list[str]:
    """The same check with both checkpoints as local directories, lines written with the hub ids."""
    lines = hub.check("--engine.model", str(target), "--speculative.model", str(draft), *overrides)
    return [line.replace(str(target), TARGET_ID).replace(str(draft), DRAFT_ID) for line in lines]


def test_gpu_config_pair_from_the_hf_cache_passes(hub, repo_root):
    config = yaml.safe_load((repo_root / GPU_CONFIG).read_text())
    assert (config["engine"]["model"], config["speculative"]["model"]) == (TARGET_ID, DRAFT_ID)
    hub.publish(TARGET_ID, llama_8b_files())
    hub.publish(DRAFT_ID, eagle3_head_files())
    assert hub.check() == []
    # It passed having read the shapes, from the cached headers.
    from dynamo_spec.config.preflight import _load

    draft = _load(DRAFT_ID, "speculative.model", [])
    assert draft.directory is None and draft.safetensors_shapes()["d2t"] == [32000]
    assert draft.safetensors_shapes()["fc.weight"] == [4096, 3 * 4096]


@pytest.mark.parametrize("head, expected", [
    ({"fc_inputs": 2}, f"error: draft {DRAFT_ID}: fc takes 2 hidden states but 3 aux layer ids are configured ([2, 16, 29])"),
    ({"d2t_entries": 31999}, f"error: draft {DRAFT_ID}: d2t has 31999 entries but draft_vocab_size is 32000"),
])
def test_hub_draft_with_bad_tensors_fails_as_a_directory_does(hub, head, expected):
    hub.publish(TARGET_ID, llama_8b_files())
    hub.publish(DRAFT_ID, eagle3_head_files(**head))
    assert hub.check() == [expected]
    target, draft = hub.local("target", llama_8b_files()), hub.local("draft", eagle3_head_files(**head))
    assert check_local(hub, target, draft) == [expected]


def test_memory_check_sees_the_hub_target_weights(hub, monkeypatch):
    """An 8B target in bf16 (15 GiB) on a 16 GiB GPU at gpu_memory_utilization 0.8 does not fit:
    preflight says so from the cached headers, with the size a local directory gives."""
    from dynamo_spec.config import preflight

    monkeypatch.setattr(preflight, "_gpu_memory", lambda: 16 * GiB)
    hub.publish(TARGET_ID, llama_8b_files())
    hub.publish(DRAFT_ID, eagle3_head_files())
    weights = weights_gib(llama_8b_files()) + weights_gib(eagle3_head_files())
    assert 15.6 < weights < 15.8  # 8.03B parameters in bf16 and the head's 0.42B in fp16
    problem = only_error(hub.check())
    assert problem.startswith(f"error: memory: weights {weights:.1f} GiB + KV cache 0.0 GiB") and "(12.8 GiB)" in problem
    target, draft = hub.local("target", llama_8b_files()), hub.local("draft", eagle3_head_files())
    assert check_local(hub, target, draft) == [problem]


def test_hub_draft_with_bin_weights_counts_their_size(hub, monkeypatch):
    """.bin weights have no header to read: their cached files' sizes count, as a directory's do
    (a sparse 4 GiB file: nothing written)."""
    from dynamo_spec.config import preflight

    monkeypatch.setattr(preflight, "_gpu_memory", lambda: 16 * GiB)
    bin_draft = {"config.json": eagle3_head_files()["config.json"], "pytorch_model.bin": b""}
    hub.publish(TARGET_ID, llama_8b_files())
    hub.publish(DRAFT_ID, bin_draft)
    target, draft = hub.local("target", llama_8b_files()), hub.local("draft", bin_draft)
    for directory in (hub.cache / f"models--{DRAFT_ID.replace('/', '--')}" / "snapshots" / COMMIT, draft):
        with (directory / "pytorch_model.bin").open("r+b") as f:
            f.truncate(4 * GiB)
    problem = only_error(hub.check())
    assert problem.startswith(f"error: memory: weights {weights_gib(llama_8b_files()) + 4:.1f} GiB"), problem
    assert check_local(hub, target, draft) == [problem]


def test_hub_target_without_its_weights_cached_is_not_checked_offline(hub):
    """Offline with config.json alone in the cache: the checks that need the target's tensors are
    skipped, not failed (8 GiB of GPU would not hold its 15 GiB; the cached draft's 0.8 GiB fit)."""
    hub.publish(TARGET_ID, {"config.json": llama_8b_files()["config.json"]})
    hub.publish(DRAFT_ID, eagle3_head_files())
    assert hub.check("--engine.gpu_memory_utilization", "0.1") == []
    hub.publish(DRAFT_ID, eagle3_head_files(d2t_entries=31999))
    assert hub.check("--engine.gpu_memory_utilization", "0.1") == [
        f"error: draft {DRAFT_ID}: d2t has 31999 entries but draft_vocab_size is 32000"]


class _HubBehindProxy(http.server.BaseHTTPRequestHandler):
    """A forward proxy that answers for the Hub itself: it gets absolute URLs
    (http://hub.invalid/ORG/NAME/resolve/REV/FILE) and serves files, with Range."""

    files: dict[str, bytes] = {}  # "ORG/NAME/FILE" -> bytes
    requests: list[tuple[str, str, str | None]] = []  # method, "ORG/NAME/FILE", Range

    def do_HEAD(self) -> None:
        self._answer(body=False)

    def do_GET(self) -> None:
        self._answer(body=True)

    def _answer(self, body: bool) -> None:
        org, name, _, _, file = urllib.parse.urlsplit(self.path).path.strip("/").split("/", 4)
        self.requests.append((self.command, f"{org}/{name}/{file}", self.headers.get("Range")))
        data = self.files.get(f"{org}/{name}/{file}")
        if data is None:
            self.send_response(404)
            self.send_header("X-Error-Code", "EntryNotFound")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        status, part = 200, data
        if self.headers.get("Range"):
            first, _, last = self.headers["Range"].removeprefix("bytes=").partition("-")
            status, part = 206, data[int(first):int(last or len(data) - 1) + 1]
        self.send_response(status)
        self.send_header("X-Repo-Commit", COMMIT)
        self.send_header("ETag", f'"{hashlib.sha256(data).hexdigest()}"')
        self.send_header("Content-Length", str(len(part)))
        self.end_headers()
        if body:
            self.wfile.write(part)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def hub_behind_proxy(hub, monkeypatch):
    """The Hub at http://hub.invalid, reachable only through HTTP_PROXY: a direct connection
    to anything but the proxy fails, as on a machine behind a corporate proxy."""
    import socket
    import threading

    import huggingface_hub
    import huggingface_hub.constants as hf_constants

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _HubBehindProxy)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    proxy = f"http://127.0.0.1:{server.server_address[1]}"
    for var in ("HF_HUB_OFFLINE", "NO_PROXY", "no_proxy", "HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HTTP_PROXY", proxy)
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(hf_constants, "ENDPOINT", "http://hub.invalid")
    monkeypatch.setattr(hf_constants, "HUGGINGFACE_CO_URL_TEMPLATE", "http://hub.invalid/{repo_id}/resolve/{revision}/{filename}")
    direct = socket.create_connection

    def only_the_proxy(address, *args, **kwargs):
        if address[0] != "127.0.0.1":
            raise OSError(f"direct connection to {address[0]} refused: only the proxy is reachable")
        return direct(address, *args, **kwargs)

    monkeypatch.setattr(socket, "create_connection", only_the_proxy)
    huggingface_hub.close_session()  # its shared client read the proxy settings when it was made
    yield _HubBehindProxy
    huggingface_hub.close_session()
    server.shutdown()
    server.server_close()
    _HubBehindProxy.files, _HubBehindProxy.requests = {}, []


def test_hub_pair_through_a_proxy_gets_every_check(hub, hub_behind_proxy):
    """Nothing cached: config.json and the safetensors headers come from the Hub through the
    proxy, and the checks on shapes run as for a local directory."""
    from dynamo_spec.config import preflight

    assert not hasattr(preflight, "socket")  # no probe of our own that a proxy would not carry
    served = hub_behind_proxy.files
    served.update({f"{TARGET_ID}/{name}": data for name, data in llama_8b_files().items()})
    served.update({f"{DRAFT_ID}/{name}": data for name, data in eagle3_head_files(d2t_entries=31999).items()})
    assert hub.check() == [f"error: draft {DRAFT_ID}: d2t has 31999 entries but draft_vocab_size is 32000"]
    fetched = {(method, file) for method, file, _ in hub_behind_proxy.requests}
    assert {("GET", f"{TARGET_ID}/config.json"), ("GET", f"{DRAFT_ID}/config.json")} <= fetched
    # The five safetensors files: their first bytes only (a ranged GET each), never the weights.
    gets = [(file, part) for method, file, part in hub_behind_proxy.requests if method == "GET" and file.endswith(".safetensors")]
    assert len({file for file, _ in gets}) == 5 and all(part and part.startswith("bytes=0-") for _, part in gets), gets


def test_uncached_hub_id_with_the_hub_unreachable_is_one_line(hub, monkeypatch):
    """Not offline, nothing cached, nothing answering at HF_ENDPOINT: huggingface_hub's own error,
    once (no retries for half a minute), and what to do."""
    import socket
    import time

    import huggingface_hub.constants as hf_constants

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        endpoint = f"http://127.0.0.1:{s.getsockname()[1]}"  # closed once the socket is
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(hf_constants, "ENDPOINT", endpoint)
    monkeypatch.setattr(hf_constants, "HUGGINGFACE_CO_URL_TEMPLATE", endpoint + "/{repo_id}/resolve/{revision}/{filename}")
    hub.publish(DRAFT_ID, eagle3_head_files())
    start = time.monotonic()
    problem = only_error(hub.check())
    assert time.monotonic() - start < 10
    assert problem.startswith(f"error: engine.model: {TARGET_ID} is not a local directory and its config.json could not "
                              "be fetched from the Hugging Face Hub (")
    assert "not reachable from this machine" not in problem and "\n" not in problem
    assert f"huggingface-cli download {TARGET_ID} --local-dir DIR" in problem and "set HF_TOKEN" in problem


def test_a_runner_switch_vllm_cannot_parse_is_one_error_naming_it(tmp_path, monkeypatch):
    """vLLM reads VLLM_USE_V2_MODEL_RUNNER with int(): `true` stops its start, so preflight says so
    instead of guessing a runner (dynamo_spec/engine/paths.py)."""
    from dynamo_spec.config.settings import Settings

    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "true")
    s = Settings(engine={"model": str(tmp_path / "missing")}, speculative={"method": "eagle3", "model": "d"})
    errors = [p.message for p in run_preflight(s, on_cpu=True) if "VLLM_USE_V2_MODEL_RUNNER" in p.message]
    assert errors == ["VLLM_USE_V2_MODEL_RUNNER='true': vLLM reads it with int() and would fail to start; "
                      "set 0 or 1, or unset it"]
