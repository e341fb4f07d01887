"""The suffix mix through a real server and the official openai client: tenants' trees, a client that
names another tenant's tree, an aborted answer, eviction, the erase route, /admin/suffix and /metrics.

The tiny random target and its random draft (acceptance ~0): a request whose answer the tree holds
(the same prompt answered before, to the same tenant) accepts long drafts; one whose tree does not
hold it barely accepts any. ``max_cached_requests: 3`` bounds each tenant's tree.
"""

from __future__ import annotations

import httpx
import pytest

from support.server_process import ServerProcess, tiny_config

pytestmark = pytest.mark.integration

MAX_TOKENS = 48
HEADER = "X-Tenant"


@pytest.fixture(scope="module")
def server(tiny_models, tmp_path_factory):
    config = tiny_config(tiny_models["target"], tiny_models["draft"], k=3,
                         engine={"dtype": "float32"}, metrics={"tenant_header": HEADER},
                         speculative={"method": "eagle3", "model": str(tiny_models["draft"]), "num_speculative_tokens": 3,
                                      "suffix": {"enabled": True, "max_tokens": 16, "min_score": 1.0,
                                                 "max_cached_requests": 3}})
    with ServerProcess(config, tmp_path_factory.mktemp("suffix-server")) as server:
        yield server


@pytest.fixture(scope="module")
def client(server):
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


def ask(client, prompt: str, tenant: str | None, **extra) -> tuple[str, dict]:
    headers = {HEADER: tenant} if tenant else {}
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                  extra_headers=headers, extra_body={"ignore_eos": True, **extra})
    return r.choices[0].text, r.model_extra["metrics"]["speculative_decoding"]


def admin(server) -> dict:
    return httpx.get(server.url + "/admin/suffix", timeout=30).json()


def cached(server) -> int:
    return sum(t["cached_answers"] for t in admin(server)["trees"])


def test_a_tenant_drafts_from_its_own_answers_only(server, client):
    prompt = "The capital of France is"
    first_text, first = ask(client, prompt, "acme")
    again_text, again = ask(client, prompt, "acme")
    other_text, other = ask(client, prompt, "globex")
    # a client naming another tenant's tree in vllm_xargs gets its own tenant's anyway
    spoofed_text, spoofed = ask(client, prompt, "initech", vllm_xargs={"dynamo_spec_suffix_tree": "acme"})
    assert first_text == again_text == other_text == spoofed_text  # greedy: the tree changes no output
    assert again["mean_acceptance_length"] > 4, again
    # each response splits its figures by source, and the split adds up to them
    split = again["sources"]
    assert split["suffix"]["steps"] > 0 and split["suffix"]["accepted_tokens"] > split["draft"]["accepted_tokens"]
    assert sum(s["steps"] for s in split.values()) == again["num_spec_steps"]
    assert sum(s["accepted_tokens"] for s in split.values()) == again["num_accepted_draft_tokens"]
    for stats in (first, other, spoofed):
        assert stats["mean_acceptance_length"] < again["mean_acceptance_length"] / 2, (stats, again)
    body = admin(server)
    assert body["sources"]["suffix"]["accepted_tokens"] >= again["num_accepted_draft_tokens"] - 3
    assert 0 < body["suffix_share"] < 1


def test_per_source_series_on_metrics(server, client):
    ask(client, "Hello! How are you", "acme")
    ask(client, "Hello! How are you", "acme")
    text = httpx.get(server.url + "/metrics", timeout=30).text  # polled every second
    for _ in range(30):
        if 'dynamo_spec_source_verify_steps_total{model="tiny",source="suffix"}' in text:
            break
        import time

        time.sleep(0.5)
        text = httpx.get(server.url + "/metrics", timeout=30).text
    steps = {line.split('source="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
             for line in text.splitlines() if line.startswith("dynamo_spec_source_verify_steps_total{")}
    assert steps["suffix"] > 0 and steps["draft"] > 0, steps


def test_an_aborted_answer_is_not_kept(server, client):
    prompt = "Once upon a time there was a small grey cat"
    with httpx.stream("POST", server.url + "/v1/completions", headers={HEADER: "stream"}, timeout=60,
                      json={"model": "tiny", "prompt": prompt, "max_tokens": 400, "temperature": 0,
                            "ignore_eos": True, "stream": True}) as response:
        for i, _ in enumerate(response.iter_lines()):
            if i >= 4:
                break  # the client goes away: vLLM aborts the request
    import time

    for _ in range(100):  # the abort reaches the engine; the tree drops the partial answer
        if not any(t["active_requests"] for t in admin(server)["trees"]):
            break
        time.sleep(0.1)
    _, stats = ask(client, prompt, "stream")
    _, again = ask(client, prompt, "stream")
    assert stats["mean_acceptance_length"] < again["mean_acceptance_length"] / 2, (stats, again)


def test_eviction_bounds_each_tenants_tree(server, client):
    for i in range(5):
        ask(client, f"Please explain how speculative decoding works, part {i}", "evict")
    trees = admin(server)["trees"]
    assert trees and all(t["trees"] >= 1 for t in trees)
    _, oldest = ask(client, "Please explain how speculative decoding works, part 0", "evict")
    _, newest = ask(client, "Please explain how speculative decoding works, part 4", "evict")
    assert oldest["mean_acceptance_length"] < newest["mean_acceptance_length"] / 2, (oldest, newest)
    # at most 3 answers per tenant's tree (acme, globex, initech, stream, evict and the rest)
    assert cached(server) <= 3 * admin(server)["trees"][0]["trees"]


def test_erasing_the_captures_empties_the_trees(server, client):
    prompt = "London is the capital of"
    ask(client, prompt, "erase")
    _, warm = ask(client, prompt, "erase")
    assert warm["mean_acceptance_length"] > 4
    assert cached(server) > 0
    r = httpx.delete(server.url + "/admin/learning/captures", timeout=30)
    assert r.status_code == 200 and r.json()["suffix_trees_erased_answers"] > 0
    assert cached(server) == 0
    _, cold = ask(client, prompt, "erase")
    assert cold["mean_acceptance_length"] < warm["mean_acceptance_length"] / 2, (cold, warm)
