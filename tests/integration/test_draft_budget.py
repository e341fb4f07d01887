"""The confidence draft budget against real servers on the known-acceptance fixtures
(support/tiny_models.py): dynamo_spec/vllm_patches/draft_budget.py, draft_confidence.py and
draft_admission.py in a running engine.

Every fixture's draft is wrongly confident in its own way, so each case needs the online
calibration: the always-accepting draft proposes with all-zero logits (confidence 1 / draft
vocabulary, accepted every time), the never-accepting one confidently proposes a token the
target never emits, the partial one is unsure of its accepted first token and sure of its
rejected second. After a warm-up request has filled the calibration cells, a request drafts
its full k (always), nothing (never) or one token a step (partial), exactly; the budget's own
count of admitted tokens equals vLLM's count of verified ones.
"""

from __future__ import annotations

import time

import pytest
import requests

from dynamo_spec.serving.metering import POLL_SECONDS
from support.server_process import ServerProcess, tiny_config

pytestmark = pytest.mark.integration

K = 3
STEPS = 12
MAX_TOKENS = 1 + STEPS * (K + 1)  # the prefill step's token, then whole steps at k=3 (and at k=1: 24 of 2)
BUDGET = {"enabled": True, "draft_token_cost": [[1, 0.05]], "min_observations": 3, "explore_every": 0}


def complete(server: ServerProcess, prompt: str, max_tokens: int = MAX_TOKENS, cap: int | None = None) -> dict:
    extra = {"vllm_xargs": {"max_draft_tokens": cap}} if cap is not None else {}
    response = requests.post(server.url + "/v1/completions", timeout=120, json={
        "model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, **extra})
    assert response.status_code == 200, response.text
    return response.json()


def drafted(result: dict) -> tuple[int, int]:
    stats = result["metrics"]["speculative_decoding"]
    return stats["num_draft_tokens"], stats["num_accepted_draft_tokens"]


def counter(server: ServerProcess, name: str) -> float:
    line = next(line for line in server.metrics().splitlines() if line.startswith(name + "{"))
    return float(line.rsplit(" ", 1)[1])


@pytest.fixture(scope="module", params=["always", "never", "partial"])
def served(request, tiny_models, tmp_path_factory):
    """A server with the budget on; three warm-up requests, then the request judged."""
    config = tiny_config(tiny_models["fixed_target"], tiny_models[f"{request.param}_draft"], k=K,
                         speculative={"draft_budget": BUDGET})
    with ServerProcess(config, tmp_path_factory.mktemp(f"budget-{request.param}")) as server:
        warm = [complete(server, f"Warm-up {i}: tell me a story.") for i in range(3)]
        judged = complete(server, "Tell me about the sea.")
        admin = requests.get(server.url + "/admin/draft-budget", timeout=30).json()
        time.sleep(2 * POLL_SECONDS)  # /metrics holds the budget's counts as polled, at most a second old
        yield {"mode": request.param, "warm": warm, "judged": judged, "admin": admin,
               "verified": counter(server, "vllm:spec_decode_num_draft_tokens_total"),
               "metrics": {key: counter(server, f"dynamo_spec_draft_budget_{key}_tokens_total")
                           for key in ("offered", "admitted", "explored", "verified")}}


def test_each_fixture_drafts_what_its_learnt_acceptance_is_worth(served):
    tokens, accepted = drafted(served["judged"])
    expected = {"always": (K * STEPS, K * STEPS),  # full k in every step, all accepted
                "never": (0, 0),  # nothing: every step a k=0 step
                "partial": (MAX_TOKENS // 2, MAX_TOKENS // 2)}[served["mode"]]  # one a step: 24 steps of 2 tokens
    assert (tokens, accepted) == expected
    assert served["judged"]["usage"]["completion_tokens"] == MAX_TOKENS
    assert served["judged"]["choices"][0]["text"] == "!" * MAX_TOKENS  # the fixed target's token 0


def test_the_budget_learnt_from_every_draft_token_vllm_verified(served):
    snap = served["admin"]
    assert snap["verified"] == served["verified"] == sum(drafted(r)[0] for r in [*served["warm"], served["judged"]])
    assert snap["offered"] == K * snap["steps"]  # one request a step, each offering its k drafts
    # admitted, less what vLLM dropped before max_tokens (the last steps of a request need fewer drafts)
    assert snap["verified"] <= snap["admitted"] <= snap["verified"] + K * 4
    # exploration: where the draft's own probability undersells a cell (always: 1/vocabulary for tokens
    # always accepted; partial: its first token), never where it oversells (never: learnt by worth)
    assert (snap["explored"] > 0) == (served["mode"] != "never") and snap["explored"] <= snap["admitted"]
    assert served["metrics"] == {key: snap[key] for key in served["metrics"]}


def test_the_calibration_learnt_what_the_target_accepts(served):
    cells = {c["position"]: c for c in served["admin"]["calibration"]}
    learnt = {p: c["accepted"] for p, c in cells.items()}
    if served["mode"] == "always":
        assert learnt == {0: 1.0, 1: 1.0, 2: 1.0}
        assert cells[0]["confidence"] < 0.05  # while the draft's own probability said it was a guess
    elif served["mode"] == "never":
        assert learnt == {0: 0.0}  # the later positions were never reached
        assert cells[0]["confidence"] > 0.5
    else:
        assert learnt == {0: 1.0, 1: 0.0}
        assert cells[1]["confidence"] > cells[0]["confidence"]


@pytest.fixture(scope="module")
def random_pair(tiny_models, tmp_path_factory):
    config = tiny_config(tiny_models["target"], tiny_models["draft"], k=K,
                         speculative={"draft_budget": {**BUDGET, "draft_token_cost": [[1, 0.0]]}})
    with ServerProcess(config, tmp_path_factory.mktemp("budget-random")) as server:
        yield server


@pytest.mark.parametrize("prompt", ["Tell me about the sea.", "def add(a, b):", "1, 2, 3, 4,"])
def test_greedy_output_with_the_budget_is_the_output_without_drafts(random_pair, prompt):
    """A random target and draft (acceptance near 0): what the budget verifies changes, never what
    the target emits. The reference is the same request verified without drafts (its cap 0)."""
    with_budget = complete(random_pair, prompt, max_tokens=32)
    reference = complete(random_pair, prompt, max_tokens=32, cap=0)
    assert drafted(reference) == (0, 0)
    assert with_budget["choices"][0]["text"] == reference["choices"][0]["text"]
