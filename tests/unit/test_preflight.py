"""Preflight rejects each bad target/draft pairing, on generated checkpoints."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
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
