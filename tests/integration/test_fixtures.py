"""The tiny fixtures load in a real vLLM engine and give the acceptance they promise.

One engine per (target, draft) pair, started once per module in the test's own process
(support/in_process.py: 2-4 s each on CPU, against ~20 s for an engine with its own processes).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from support.engine import generate_one_by_one

pytestmark = pytest.mark.integration

K = 3  # num_speculative_tokens
MAX_TOKENS = 32
PROMPTS = [
    "What is the capital of France?",
    "Write a poem about the sea.",
    "<|im_start|>user\nHello! How are you today?<|im_end|>\n<|im_start|>assistant\n",
]


@pytest.fixture(scope="module")
def fixtures(tiny_models: dict[str, Path]) -> dict[str, Path]:
    # tests/conftest.py builds the set once per session and has already pointed
    # vLLM's caches, sockets and configs into a temp folder (process_env.vllm_dirs).
    return tiny_models


def test_tokenizer_and_chat_template(fixtures: dict[str, Path]) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(fixtures["target"])
    assert len(tok) == 512
    assert tok.eos_token == "<|im_end|>" and tok.convert_ids_to_tokens(0) != tok.eos_token
    text = tok.apply_chat_template(
        [{"role": "user", "content": "Hi there!"}], tokenize=False, add_generation_prompt=True
    )
    assert text == "<|im_start|>user\nHi there!<|im_end|>\n<|im_start|>assistant\n"
    assert tok.decode(tok("Hello, world! 123")["input_ids"]) == "Hello, world! 123"


def generate(target: Path, draft: Path | None) -> list[Any]:
    """Greedy-generate PROMPTS one by one in a fresh engine; final RequestOutputs."""
    from vllm import SamplingParams

    spec = (
        {"method": "eagle3", "model": str(draft), "num_speculative_tokens": K}
        if draft is not None
        else None
    )
    args = dict(
        model=str(target),
        speculative_config=spec,
        enforce_eager=True,
        kv_cache_memory_bytes=256 * 2**20,
        max_model_len=512,
        dtype="bfloat16",
        # vLLM rejects this option without a speculative_config.
        per_request_spec_decode_metrics="summary" if draft is not None else "none",
        seed=0,
    )
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return generate_one_by_one(args, PROMPTS, params)


def spec_metrics(outputs: list[Any]) -> list[dict[str, Any]]:
    """Per-request summary: RequestOutput.outputs[0].spec_decode_metrics.to_dict()."""
    result = []
    for out in outputs:
        metrics = out.outputs[0].spec_decode_metrics
        assert metrics is not None, "per_request_spec_decode_metrics gave nothing"
        result.append(metrics.to_dict())
    return result


def token_ids(outputs: list[Any]) -> list[list[int]]:
    return [list(out.outputs[0].token_ids) for out in outputs]


@pytest.fixture(scope="module")
def always_out(fixtures: dict[str, Path]) -> list[Any]:
    return generate(fixtures["fixed_target"], fixtures["always_draft"])


@pytest.fixture(scope="module")
def never_out(fixtures: dict[str, Path]) -> list[Any]:
    return generate(fixtures["fixed_target"], fixtures["never_draft"])


@pytest.fixture(scope="module")
def partial_out(fixtures: dict[str, Path]) -> list[Any]:
    return generate(fixtures["fixed_target"], fixtures["partial_draft"])


def test_fixed_target_emits_token_zero(
    always_out: list[Any], never_out: list[Any], partial_out: list[Any]
) -> None:
    for outputs in (always_out, never_out, partial_out):
        for ids in token_ids(outputs):
            assert ids == [0] * MAX_TOKENS


def test_an_engine_in_this_process_leaves_it_as_it_was(fixtures: dict[str, Path]) -> None:
    """support/in_process.py: the engine runs here (its core and worker in this process, no child
    process), and what it changed in the process is undone: environment, affinity, torch's threads,
    vLLM's cache of its environment, its torch.distributed group, the worker class it extended (the
    server's draft-swap extension)."""
    import os

    import psutil
    import torch
    from vllm import SamplingParams, envs
    from vllm.v1.worker.cpu_worker import CPUWorker

    from dynamo_spec.learning.swap import WORKER_METHOD, DraftSwapExtension
    from support.in_process import in_process_llm

    environ, affinity = dict(os.environ), os.sched_getaffinity(0)
    set_num_threads, threads = torch.set_num_threads, torch.get_num_threads()
    children = {p.pid for p in psutil.Process().children(recursive=True)}
    extension = f"{DraftSwapExtension.__module__}.{DraftSwapExtension.__qualname__}"
    with in_process_llm(model=str(fixtures["fixed_target"]), enforce_eager=True, max_model_len=512,
                        kv_cache_memory_bytes=64 * 2**20, dtype="bfloat16", seed=0,
                        worker_extension_cls=extension) as llm:
        (out,) = llm.generate(PROMPTS[:1], SamplingParams(max_tokens=2, temperature=0.0), use_tqdm=False)
        assert type(llm.llm_engine.engine_core).__name__ == "InprocClient"
        assert {p.pid for p in psutil.Process().children(recursive=True)} <= children
        assert hasattr(CPUWorker, WORKER_METHOD)  # vLLM extended the class itself, in this process
    assert list(out.outputs[0].token_ids) == [0, 0]
    assert not hasattr(CPUWorker, WORKER_METHOD)
    assert dict(os.environ) == environ and os.sched_getaffinity(0) == affinity
    assert torch.set_num_threads is set_num_threads and torch.get_num_threads() == threads
    assert not envs._is_envs_cache_enabled() and not torch.distributed.is_initialized()


def test_always_draft_is_always_accepted(always_out: list[Any]) -> None:
    for m in spec_metrics(always_out):
        assert m["num_spec_tokens"] == K
        assert m["draft_acceptance_rate"] == 1.0, m
        assert m["mean_acceptance_length"] == K + 1.0, m


def test_never_draft_is_never_accepted(never_out: list[Any]) -> None:
    for m in spec_metrics(never_out):
        assert m["num_draft_tokens"] > 0, m
        assert m["draft_acceptance_rate"] == 0.0, m
        assert m["mean_acceptance_length"] == 1.0, m


def test_partial_draft_is_partly_accepted(partial_out: list[Any]) -> None:
    # build_fixture_set's partial draft accepts the first draft token of each step.
    for m in spec_metrics(partial_out):
        assert 0.0 < m["draft_acceptance_rate"] < 1.0, m
        assert m["draft_acceptance_rate"] == pytest.approx(1 / K), m
        assert m["mean_acceptance_length"] == 2.0, m
        assert m["acceptance_histogram"] == [0, m["num_spec_steps"]] + [0] * (K - 1), m


def test_random_draft_is_lossless(fixtures: dict[str, Path]) -> None:
    with_spec = generate(fixtures["target"], fixtures["draft"])
    without = generate(fixtures["target"], None)
    assert token_ids(with_spec) == token_ids(without)
    assert all(len(ids) == MAX_TOKENS for ids in token_ids(without))
    assert all(out.outputs[0].spec_decode_metrics is None for out in without)


def speculators_copy(draft: Path, target: Path, out: Path) -> Path:
    """The draft in the speculators format, as published EAGLE-3 heads are: config.json
    converted by eagle3_format.to_speculators, tensors named ``layers.0.*``."""
    from safetensors.torch import load_file, save_file

    from dynamo_spec.config.eagle3_format import to_speculators

    out.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((draft / "config.json").read_text())
    target_cfg = json.loads((target / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(to_speculators(
        cfg, verifier=str(target), verifier_architectures=target_cfg["architectures"], num_speculative_tokens=K)))
    tensors = load_file(str(draft / "model.safetensors"))
    save_file({k.replace("midlayer.", "layers.0."): v for k, v in tensors.items()}, str(out / "model.safetensors"))
    return out


def test_speculators_format_draft_serves_the_same(fixtures: dict[str, Path], partial_out: list[Any],
                                                  tmp_path: Path) -> None:
    """vLLM loads the speculators-format copy and accepts exactly as with ours."""
    draft = speculators_copy(fixtures["partial_draft"], fixtures["fixed_target"], tmp_path / "spec-draft")
    outputs = generate(fixtures["fixed_target"], draft)
    assert token_ids(outputs) == token_ids(partial_out)
    assert spec_metrics(outputs) == spec_metrics(partial_out)
