"""The OpenAI-compatible API of a real server (real vLLM engine, tiny models), via the official client."""

from __future__ import annotations

import http.client
import json
import shutil
import time

import openai
import pytest
import requests

from dynamo_spec.default_model import SAMPLING_DEFAULTS, ensure_sampling_defaults
from support.server_process import ServerProcess, tiny_config

pytestmark = pytest.mark.integration

API_KEY = "test-key"
PROMPTS = ["What is the capital of France?", "Write a poem about the sea.", "def add(a, b):"]


@pytest.fixture(scope="module")
def target(tiny_models, tmp_path_factory):
    """The tiny target with the sampling defaults prepare-default writes into the CPU
    default's generation_config.json (temperature, top_p, presence penalty)."""
    out = tmp_path_factory.mktemp("target-with-defaults")
    for f in tiny_models["target"].iterdir():
        if f.name == "generation_config.json":
            shutil.copy(f, out / f.name)
        else:
            (out / f.name).symlink_to(f)
    assert ensure_sampling_defaults(out)
    return out


@pytest.fixture(scope="module")
def server(target, tiny_models, tmp_path_factory):
    config = tiny_config(
        target, tiny_models["draft"],
        server={"api_key": API_KEY}, metrics={"tenant_header": "X-Tenant"},
    )
    with ServerProcess(config, tmp_path_factory.mktemp("api")) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)


def spec_stats(response) -> dict:
    return response.model_extra["metrics"]["speculative_decoding"]


def test_models(client):
    assert [m.id for m in client.models.list().data] == ["tiny"]


def test_chat_completion_with_speculative_stats(client):
    response = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hello! How are you today?"}], max_tokens=16, temperature=0,
    )
    assert response.choices[0].message.role == "assistant"
    assert response.usage.completion_tokens > 0
    stats = spec_stats(response)
    assert stats["num_spec_tokens"] == 3 and stats["num_spec_steps"] > 0
    assert stats["num_draft_tokens"] == 3 * stats["num_spec_steps"]
    assert 1.0 <= stats["mean_acceptance_length"] <= 4.0


def test_chat_completion_streaming_ends_with_stats(client):
    chunks = list(client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Write a poem about the sea."}], max_tokens=16,
        temperature=0, stream=True, stream_options={"include_usage": True},
    ))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text
    final = chunks[-1]
    assert final.choices == [] and final.usage.completion_tokens == 16
    assert final.model_extra["metrics"]["speculative_decoding"]["num_spec_steps"] > 0


def test_completion_streaming_equals_non_streaming(client):
    full = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=20, temperature=0)
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="tiny", prompt=PROMPTS[0], max_tokens=20, temperature=0, stream=True) if c.choices)
    assert streamed == full.choices[0].text
    assert spec_stats(full)["num_spec_steps"] > 0


# server.frontend reaches vLLM's serving layer: a chat template that ignores the messages
# and a response role of our own (completions, which the lossless test uses, read neither).
FIXED_TEMPLATE = "{{ 'Q: tell me a story. A:' }}"


@pytest.fixture(scope="module")
def plain(target, tmp_path_factory):
    config = tiny_config(target, None,
                         server={"frontend": {"chat_template": FIXED_TEMPLATE, "response_role": "narrator"}})
    with ServerProcess(config, tmp_path_factory.mktemp("plain")) as srv:
        yield srv


def test_greedy_output_identical_without_speculation(client, plain):
    # Both serve the target with its sampling defaults: greedy under the presence penalty.
    with_spec = [client.completions.create(model="tiny", prompt=p, max_tokens=32, temperature=0,
                                           extra_body={"ignore_eos": True}).choices[0].text for p in PROMPTS]
    plain_client = openai.OpenAI(base_url=plain.url + "/v1", api_key="unused", max_retries=0)
    without = [plain_client.completions.create(model="tiny", prompt=p, max_tokens=32, temperature=0,
                                               extra_body={"ignore_eos": True}).choices[0].text for p in PROMPTS]
    plain_response = plain_client.completions.create(model="tiny", prompt="x", max_tokens=2)
    assert (plain_response.model_extra.get("metrics") or {}).get("speculative_decoding") is None
    assert with_spec == without


def test_dry_through_the_api_is_lossless_under_speculation(client, plain):
    """DRY's fields, top-level (llama.cpp's way) or in vllm_xargs, reach the engine: the answers change,
    and the speculative server's greedy answers are the plain server's."""
    dry = {"dry_multiplier": 1.0, "dry_allowed_length": 2}
    plain_client = openai.OpenAI(base_url=plain.url + "/v1", api_key="unused", max_retries=0)

    def answers(c, extra: dict) -> list[str]:
        return [c.completions.create(model="tiny", prompt=p, max_tokens=48, temperature=0,
                                     extra_body={"ignore_eos": True, "presence_penalty": 0.0, **extra}).choices[0].text
                for p in PROMPTS]

    top_level, in_xargs = answers(client, dry), answers(client, {"vllm_xargs": dry})
    assert top_level == in_xargs
    assert top_level != answers(client, {})  # a random tiny target repeats itself: DRY changes its answers
    assert top_level == answers(plain_client, dry)


def test_greedy_output_is_the_same_whatever_the_cap(client):
    """A random target and draft: the caps change what is drafted and verified, never what the
    target emits (the cap-0 request is verified without drafts: the k=0 reference). Requests of
    each prompt are sent together, so capped and uncapped ones share the engine's steps.
    (Moved from test_draft_caps.py, whose fixed target emits one token whatever happens.)"""
    from concurrent.futures import ThreadPoolExecutor

    def complete(prompt: str, cap: int | None):
        extra = {"ignore_eos": True, **({"vllm_xargs": {"max_draft_tokens": cap}} if cap is not None else {})}
        return client.completions.create(model="tiny", prompt=prompt, max_tokens=32, temperature=0, extra_body=extra)

    caps = [None, 0, 1, 2]
    for prompt in PROMPTS:
        with ThreadPoolExecutor(len(caps)) as pool:
            responses = list(pool.map(lambda cap, p=prompt: complete(p, cap), caps))
        drafted = [spec_stats(r)["num_draft_tokens"] for r in responses]
        assert drafted[1] == 0 and drafted[0] > 0, drafted  # cap 0: no drafts; no cap: drafts
        assert len({r.choices[0].text for r in responses}) == 1, [r.choices[0].text for r in responses]


def test_frontend_options_reach_vllm(plain):
    def chat(content: str) -> dict:
        r = requests.post(plain.url + "/v1/chat/completions", timeout=60, json={
            "model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": 8, "temperature": 0})
        assert r.status_code == 200, r.text
        return r.json()

    first, second = chat("Hello there"), chat("Something else entirely, and much longer than the first one")
    assert first["choices"][0]["message"]["role"] == "narrator"
    # The template renders the same prompt whatever the messages say.
    assert first["usage"]["prompt_tokens"] == second["usage"]["prompt_tokens"]
    assert first["choices"][0]["message"]["content"] == second["choices"][0]["message"]["content"]


def test_generation_config_defaults_reach_sampling_and_a_request_overrides_them(client):
    """What a request leaves out comes from generation_config.json; what it sets wins."""
    default_penalty = SAMPLING_DEFAULTS["presence_penalty"]
    sampled = {"temperature": SAMPLING_DEFAULTS["temperature"], "top_p": SAMPLING_DEFAULTS["top_p"]}

    def answers(penalty: float | None = None, **fields) -> list[str]:
        extra = {"ignore_eos": True} | ({} if penalty is None else {"presence_penalty": penalty})
        return [client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": p}], max_tokens=24, extra_body=extra,
            **fields).choices[0].message.content for p in PROMPTS]

    greedy = answers(temperature=0)  # the penalty from the file
    assert greedy == answers(default_penalty, temperature=0)
    assert greedy != answers(0.0, temperature=0)
    # No sampling field at all (the README's curl): temperature, top_p and penalty from the file.
    unset = answers(seed=3)
    assert unset == answers(default_penalty, seed=3, **sampled)
    # the request's own fields win (a presence penalty changes nothing in these short sampled answers,
    # which repeat no token: the temperature is the field that shows it)
    assert unset != answers(seed=3, temperature=1.5, top_p=1.0)


@pytest.mark.parametrize(
    "body, status, param",
    [
        (b"{not json", 400, None),
        ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": "ten"}, 400, "max_tokens"),
        ({"model": "tiny"}, 400, None),
        ({"model": "tiny", "messages": "hello"}, 400, None),
        ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 100000}, 400, None),
        ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": -1}, 400, None),
        ({"model": "nope", "messages": [{"role": "user", "content": "hi"}]}, 404, "model"),
        ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "dry_multiplier": -1}, 400, "dry_multiplier"),
        ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "dry_base": 2.0}, 400, "dry_base"),
        ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
          "vllm_xargs": {"dry_multiplier": 0.8, "dry_allowed_length": 0}}, 400, "vllm_xargs.dry_allowed_length"),
        ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "dry_multiplier": 0.8,
          "dry_sequence_breakers": "\n"}, 400, "dry_sequence_breakers"),
    ],
)
def test_bad_requests_get_openai_errors_and_server_stays_up(server, body, status, param):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = requests.post(server.url + "/v1/chat/completions", data=data, timeout=30,
                      headers={"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) >= {"message", "type", "param", "code"} and error["message"]
    if param:
        assert param in (error["param"] or "")
    assert requests.get(server.url + "/health", timeout=5).status_code == 200


def test_unknown_route_and_wrong_method_are_openai_shaped(server):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    r = requests.get(server.url + "/v1/nope", headers=headers, timeout=10)
    assert r.status_code == 404 and r.json()["error"]["code"] == 404
    r = requests.get(server.url + "/v1/chat/completions", headers=headers, timeout=10)
    assert r.status_code == 405 and r.json()["error"]["code"] == 405


def test_an_idle_connection_outlives_the_clients_own_keep_alive(server):
    """Idle past httpx's 5 s (the openai client's pool), the connection is still open: the server never
    closes one at the moment a client reuses it ("Server disconnected without sending a response")."""
    connection = http.client.HTTPConnection("127.0.0.1", int(server.url.rsplit(":", 1)[1]), timeout=10)
    try:
        for _ in range(2):
            connection.request("GET", "/health")
            response = connection.getresponse()
            assert response.status == 200 and response.read()
            time.sleep(6)
        assert connection.sock is not None  # the same connection served both
    finally:
        connection.close()


def test_api_key_is_required_on_v1_only(server):
    r = requests.get(server.url + "/v1/models", timeout=10)
    assert r.status_code == 401 and r.json()["error"]["type"] == "Unauthorized"
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    assert requests.get(server.url + "/health", timeout=10).json() == {"status": "ok"}


def test_metrics_endpoint_serves_ours_and_vllms(server, client):
    client.completions.create(model="tiny", prompt="Hello", max_tokens=8, temperature=0,
                              extra_headers={"X-Tenant": "team-a"})
    text = server.metrics()
    assert 'vllm:spec_decode_num_drafts_total{engine="0",model_name="tiny"}' in text
    assert 'method="eagle3",model="tiny",num_speculative_tokens="3"' in text  # dynamo_spec_info
    assert 'dynamo_spec_http_requests_total{method="POST",route="/v1/completions",status="200"}' in text
    assert 'dynamo_spec_http_requests_total{method="GET",route="/v1/models",status="401"}' in text
    assert 'dynamo_spec_request_completion_tokens_total{model="tiny",tenant="team-a"} 8.0' in text
    assert 'dynamo_spec_time_to_first_token_seconds_count{model="tiny",tenant="team-a"} 1.0' in text
