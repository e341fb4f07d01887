"""The batch-size schedule of k takes effect on vLLM's CPU runner.

Fixed target + always-accepted draft, k=3: every drafted token is accepted, so the
counters say exactly how many tokens were drafted. A lone request is a batch of 1;
three or eight prompts in one completions request enter the engine together (a batch of 3 or 8).
"""

from __future__ import annotations

import openai
import pytest

from dynamo_spec.bench.measure import read_spec_counters
from support.server_process import ServerProcess, tiny_config

pytestmark = pytest.mark.integration

K = 3
STEPS = 6
MAX_TOKENS = 1 + STEPS * (K + 1)  # the prefill's token, then six full speculative steps
BATCH = [f"Prompt number {i}: tell me something." for i in range(8)]


def drafted_by(server: ServerProcess, prompt: str | list[str]) -> dict[str, float]:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    before = read_spec_counters(server.url)
    client.completions.create(model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                              extra_body={"ignore_eos": True})
    after = read_spec_counters(server.url)
    return {key: after.get(key, 0) - before.get(key, 0) for key in ("drafts", "draft_tokens", "accepted")}


# One server, three ranges: k=0 alone, k=3 for 2-4 requests, k=0 again from 5.
SCHEDULE = [[1, 1, 0], [2, 4, K], [5, 128, 0]]


@pytest.fixture(scope="module")
def server(tiny_models, tmp_path_factory):
    config = tiny_config(tiny_models["fixed_target"], tiny_models["always_draft"], k=K)
    config["speculative"]["num_speculative_tokens_per_batch_size"] = SCHEDULE
    with ServerProcess(config, tmp_path_factory.mktemp("schedule")) as srv:
        yield srv


def test_k0_for_a_lone_request(server):
    assert drafted_by(server, BATCH[0]) == {"drafts": 0, "draft_tokens": 0, "accepted": 0}


def test_k3_for_a_batch_of_three(server):
    batch = drafted_by(server, BATCH[:3])
    assert batch["draft_tokens"] >= 3 * (STEPS - 1) * K, batch  # k=3 once the batch has formed
    assert batch["draft_tokens"] <= 3 * STEPS * K and batch["accepted"] == batch["draft_tokens"]


def test_k0_for_batches_above_four(server):
    batch = drafted_by(server, BATCH)
    # At batch 8 nothing is drafted; only a step in which the batch was still filling
    # (2-4 requests for a moment) may draft, far below the 8 x 6 drafts of k=3.
    assert batch["drafts"] <= 2 * 4, batch
    assert batch["accepted"] == batch["draft_tokens"]
