"""Per-request caps on draft tokens (``vllm_xargs.max_draft_tokens``, tenant defaults from
``speculative.tenants``) against a real server: dynamo_spec/vllm_patches/draft_admission.py and
dynamo_spec/serving/draft_caps.py.

The fixed target always emits token 0 and the always-accepting draft proposes it at every
position (support/tiny_models.py): a request allowed c draft tokens a step verifies exactly c
and emits c + 1 tokens a step, so its drafted count is known in advance. That a step in
which no request wants drafts takes zero_draft_steps' k=0 path is counted in
tests/integration/test_zero_draft_steps.py.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from support.server_process import ServerProcess, tiny_config

pytestmark = pytest.mark.integration

K = 3
STEPS = 12  # decode steps at k=3; 12 * 4 tokens is also a whole number of steps at k=1 and k=2
MAX_TOKENS = 1 + STEPS * (K + 1)  # the prefill step's token, then whole speculative steps
TENANTS = {"batch": {"max_draft_tokens": 0}, "slow": {"max_draft_tokens": 2}}
PARAM = "vllm_xargs.max_draft_tokens"


def drafted_at(cap: int) -> int:
    """Draft tokens verified over the request: `cap` a step, (cap + 1) tokens a step."""
    return cap * (MAX_TOKENS - 1) // (cap + 1) if cap else 0


# (name, tenant header or None, the request's own max_draft_tokens or None, drafted tokens)
WAVES = [
    [("own 0", None, 0, 0),
     ("own 1", None, 1, drafted_at(1)),
     ("no cap", None, None, drafted_at(K)),
     ("tenant 0, own 3", "batch", 3, 0)],  # the request's value cannot raise the tenant's
    [("tenant 2", "slow", None, drafted_at(2)),
     ("tenant 2, own 1", "slow", 1, drafted_at(1)),
     ("tenant 0", "batch", None, 0),
     ("own 5 > k", None, 5, drafted_at(K))],
]


def body(route: str, prompt: str, cap: int | None) -> dict:
    message = {"messages": [{"role": "user", "content": prompt}]} if route == "chat" else {"prompt": prompt}
    extra = {"vllm_xargs": {"max_draft_tokens": cap}} if cap is not None else {}
    return {"model": "tiny", "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, **message, **extra}


def post(url: str, route: str, payload: dict, tenant: str | None = None) -> requests.Response:
    path = "/v1/chat/completions" if route == "chat" else "/v1/completions"
    headers = {"X-Tenant": tenant} if tenant else {}
    return requests.post(url + path, json=payload, headers=headers, timeout=120)


def drafts_counter(server: ServerProcess) -> float:
    line = next(line for line in server.metrics().splitlines()
                if line.startswith("vllm:spec_decode_num_draft_tokens_total{"))
    return float(line.rsplit(" ", 1)[1])


@pytest.fixture(scope="module")
def served(tiny_models, tmp_path_factory):
    """One server; each wave of four requests sent together (they share the engine's steps),
    then two requests that both want no drafts. Returns the responses and the counter."""
    config = tiny_config(tiny_models["fixed_target"], tiny_models["always_draft"], k=K,
                         speculative={"tenants": TENANTS}, metrics={"tenant_header": "X-Tenant"})
    with ServerProcess(config, tmp_path_factory.mktemp("draft-caps")) as server:
        results = {}
        for wave in WAVES:
            start = threading.Barrier(len(wave))

            def send(case, route, start=start):
                name, tenant, cap, _ = case
                start.wait()
                return name, post(server.url, route, body(route, f"Request {name}: tell me a story.", cap), tenant)

            with ThreadPoolExecutor(len(wave)) as pool:
                routes = ["completions", "chat"] * (len(wave) // 2)
                results.update(pool.map(send, wave, routes))
        before = drafts_counter(server)
        with ThreadPoolExecutor(2) as pool:
            none_want = list(pool.map(lambda i: post(server.url, "completions", body("completions", f"Off {i}", 0)),
                                      range(2)))
        yield {"results": results, "none_want": none_want, "drafted_while_none_want": drafts_counter(server) - before,
               "server": server}


@pytest.mark.parametrize("case", [c for wave in WAVES for c in wave], ids=lambda c: c[0])
def test_each_request_drafts_exactly_its_cap_while_others_in_the_batch_draft(served, case):
    name, _, _, drafted = case
    response = served["results"][name]
    assert response.status_code == 200, response.text
    stats = response.json()["metrics"]["speculative_decoding"]
    assert stats["num_draft_tokens"] == drafted
    assert stats["num_accepted_draft_tokens"] == drafted  # the always-accepting draft
    assert response.json()["usage"]["completion_tokens"] == MAX_TOKENS


def test_steps_where_no_request_wants_drafts_draft_nothing(served):
    assert [r.status_code for r in served["none_want"]] == [200, 200]
    assert all(r.json()["metrics"]["speculative_decoding"]["num_draft_tokens"] == 0 for r in served["none_want"])
    assert served["drafted_while_none_want"] == 0


@pytest.mark.parametrize("value", [-1, True, 1.5, "2", [1]], ids=repr)
@pytest.mark.parametrize("route", ["completions", "chat"])
def test_an_invalid_cap_is_a_400_naming_the_field(served, route, value):
    response = post(served["server"].url, route, {**body(route, "x", None), "vllm_xargs": {"max_draft_tokens": value}})
    assert response.status_code == 400
    error = response.json()["error"]
    assert (error["param"], error["code"], error["type"]) == (PARAM, 400, "BadRequestError")
    assert PARAM in error["message"]


