"""Tensor parallelism with speculation on vLLM's CPU backend: two ranks (one core each,
over shared memory) serve the same greedy output as one, and the acceptance metrics stay
exact. The server splits the cores between the ranks itself (VLLM_CPU_OMP_THREADS_BIND=0|1)."""

from __future__ import annotations

import openai
import pytest

from support.cores import every_core
from support.server_process import ServerProcess, tiny_config
from tests.integration.test_acceptance_metrics import MAX_TOKENS, PROMPTS, K, get, samples

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("on_every_core"),  # not a worker's share
              pytest.mark.skipif(len(every_core()) < 2, reason="two ranks need two cores")]


def completions(server) -> list[str]:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    return [client.completions.create(model="tiny", prompt=p, max_tokens=MAX_TOKENS, temperature=0,
                                      extra_body={"ignore_eos": True}).choices[0].text for p in PROMPTS]


def test_two_ranks_serve_what_one_serves(tiny_models, tmp_path_factory):
    outputs = {}
    for tp in (1, 2):
        config = tiny_config(tiny_models["target"], tiny_models["draft"], k=K, engine={"tensor_parallel_size": tp})
        with ServerProcess(config, tmp_path_factory.mktemp(f"tp{tp}")) as server:
            outputs[tp] = completions(server)
            if tp == 2:
                assert "VLLM_CPU_OMP_THREADS_BIND=0|1" in server.log()
    assert outputs[2] == outputs[1] and all(outputs[1])


def test_acceptance_metrics_stay_exact_with_two_ranks(tiny_models, tmp_path_factory):
    config = tiny_config(tiny_models["fixed_target"], tiny_models["partial_draft"], k=K,
                         engine={"tensor_parallel_size": 2})
    with ServerProcess(config, tmp_path_factory.mktemp("tp2-partial")) as server:
        completions(server)
        values = samples(server.metrics())
    vllm = {"engine": "0", "model_name": "tiny"}
    drafted = get(values, "dynamo_spec_draft_tokens_total", model="tiny")
    assert drafted == get(values, "vllm:spec_decode_num_draft_tokens_total", **vllm) > 0
    assert get(values, "dynamo_spec_accepted_tokens_total", model="tiny") == drafted / K  # the first of K, always
    assert get(values, "dynamo_spec_acceptance_rate", model="tiny") == pytest.approx(1 / K, abs=1e-9)
    assert get(values, "dynamo_spec_mean_acceptance_length", model="tiny") == pytest.approx(2.0, abs=1e-9)
