"""Acceptance metrics are exactly right, on drafts whose acceptance is known in advance.

The fixed target always emits token 0; the drafts propose it always, never, or at
the first position only (see support/tiny_models.py). One server per pair.
"""

from __future__ import annotations

import math

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from support.server_process import ServerProcess, tiny_config

pytestmark = pytest.mark.integration

K = 3
MAX_TOKENS = 1 + 6 * (K + 1)  # prefill token + six full speculative steps
PROMPTS = ["What is the capital of France?", "Write a poem about the sea.", "def add(a, b):", "Hello!"]

# pair -> (acceptance rate, mean acceptance length, per-position rates), by construction
EXPECTED = {
    "always_draft": (1.0, K + 1.0, [1.0] * K),
    "never_draft": (0.0, 1.0, [0.0] * K),
    "partial_draft": (1 / K, 2.0, [1.0] + [0.0] * (K - 1)),
}


def samples(text: str) -> dict[tuple[str, tuple], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def get(values: dict, name: str, **labels: str) -> float:
    return values[(name, tuple(sorted(labels.items())))]


@pytest.fixture(scope="module", params=sorted(EXPECTED))
def run(request, tiny_models, tmp_path_factory):
    """Serve one known-acceptance pair, send greedy traffic, return (pair, responses, metrics)."""
    pair = request.param
    config = tiny_config(tiny_models["fixed_target"], tiny_models[pair], k=K)
    with ServerProcess(config, tmp_path_factory.mktemp(pair)) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        responses = [
            client.completions.create(model="tiny", prompt=p, max_tokens=MAX_TOKENS, temperature=0,
                                      extra_body={"ignore_eos": True})
            for p in PROMPTS
        ]
        yield pair, responses, samples(server.metrics())


def test_window_gauges_equal_the_known_acceptance(run):
    pair, _, values = run
    rate, length, per_position = EXPECTED[pair]
    assert get(values, "dynamo_spec_acceptance_rate", model="tiny") == pytest.approx(rate, abs=1e-9)
    assert get(values, "dynamo_spec_mean_acceptance_length", model="tiny") == pytest.approx(length, abs=1e-9)
    for i, expected in enumerate(per_position):
        assert get(values, "dynamo_spec_position_acceptance_rate", model="tiny", position=str(i)) == \
            pytest.approx(expected, abs=1e-9)


def test_counters_equal_vllms_own_counters(run):
    _, _, values = run
    vllm = {"engine": "0", "model_name": "tiny"}
    for ours, theirs in [
        ("dynamo_spec_drafts_total", "vllm:spec_decode_num_drafts_total"),
        ("dynamo_spec_draft_tokens_total", "vllm:spec_decode_num_draft_tokens_total"),
        ("dynamo_spec_accepted_tokens_total", "vllm:spec_decode_num_accepted_tokens_total"),
    ]:
        assert get(values, ours, model="tiny") == get(values, theirs, **vllm) > -1
    for i in range(K):
        assert get(values, "dynamo_spec_accepted_tokens_per_position_total", model="tiny", position=str(i)) == \
            get(values, "vllm:spec_decode_num_accepted_tokens_per_pos_total", position=str(i), **vllm)
    accepted = get(values, "vllm:spec_decode_num_accepted_tokens_total", **vllm)
    drafted = get(values, "vllm:spec_decode_num_draft_tokens_total", **vllm)
    drafts = get(values, "vllm:spec_decode_num_drafts_total", **vllm)
    assert get(values, "dynamo_spec_acceptance_rate", model="tiny") == pytest.approx(accepted / drafted, abs=1e-9)
    assert get(values, "dynamo_spec_mean_acceptance_length", model="tiny") == pytest.approx(1 + accepted / drafts, abs=1e-9)


def test_per_request_figures_agree(run):
    pair, responses, values = run
    rate, length, _ = EXPECTED[pair]
    stats = [r.model_extra["metrics"]["speculative_decoding"] for r in responses]
    for s in stats:
        assert s["draft_acceptance_rate"] == pytest.approx(rate, abs=1e-9)
        assert s["mean_acceptance_length"] == pytest.approx(length, abs=1e-9)
    # Everything drafted for these requests is what the server counted.
    assert sum(s["num_draft_tokens"] for s in stats) == get(values, "dynamo_spec_draft_tokens_total", model="tiny")
    assert sum(s["num_accepted_draft_tokens"] for s in stats) == \
        get(values, "dynamo_spec_accepted_tokens_total", model="tiny")
    # One histogram observation per request, each at the known value.
    labels = {"model": "tiny", "tenant": "default"}
    assert get(values, "dynamo_spec_request_acceptance_length_count", **labels) == len(responses)
    assert get(values, "dynamo_spec_request_acceptance_length_sum", **labels) == pytest.approx(length * len(responses))
    assert get(values, "dynamo_spec_request_acceptance_rate_sum", **labels) == pytest.approx(rate * len(responses))
    le = "4.0" if pair == "always_draft" else ("1.0" if pair == "never_draft" else "2.0")
    assert get(values, "dynamo_spec_request_acceptance_length_bucket", le=le, **labels) == len(responses)
    assert not math.isnan(get(values, "dynamo_spec_window_drafts", model="tiny"))
