"""Operating a real server (tiny models): request bounds, admission, timeouts, readiness, drain, start-up stop.

Durations: the tiny target generates ~100-190 tokens/s per stream on the 2-core runner
(more in all when batched), so a 2,000-token request runs 10-20 s (it outlasts a 2 s
timeout or a 1 s grace period) and a 1,000-token stream 5-10 s (in flight long enough to
be seen). The fixtures warm the servers first: the first sampled request of a fresh
vLLM cache takes seconds.
"""

from __future__ import annotations

import json
import time

import openai
import pytest
import requests

from support.server_process import ServerProcess, tiny_config

pytestmark = pytest.mark.integration

API_KEY = "operate-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
# Not a one-token prompt: vLLM's CPU worker dies (SIGILL) on some one-token prompts with
# the tiny fixtures' shapes on AMX hosts (not with SmolLM2).
PROMPT = "Tell me a long story about the sea and the ships on it."
LIMITS = {"max_in_flight": 2, "max_body_bytes": 65536, "max_n": 4,
          "max_stop_sequences": 4, "max_top_logprobs": 5, "max_prompts": 4}


def config(tiny_models, **sections):
    cfg = tiny_config(tiny_models["target"], tiny_models["draft"], **sections)
    cfg["engine"]["max_model_len"] = 2048
    return cfg


@pytest.fixture(scope="module")
def server(tiny_models, tmp_path_factory):
    cfg = config(tiny_models, server={"api_key": API_KEY, "metrics_require_api_key": True}, limits=LIMITS)
    with ServerProcess(cfg, tmp_path_factory.mktemp("operate")) as srv:
        warm = client(srv, timeout=300)  # the first requests of a fresh engine on a busy host
        warm.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, logprobs=2)
        warm.completions.create(model="tiny", prompt=PROMPT, max_tokens=16, temperature=0)
        yield srv


def client(server, **kwargs) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, **kwargs)


def post(server, path: str, body: dict | bytes, headers: dict | None = None) -> requests.Response:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return requests.post(server.url + path, data=data, timeout=60,
                         headers={"Content-Type": "application/json", **AUTH, **(headers or {})})


def metric(server, name: str) -> float:
    text = requests.get(server.url + "/metrics", headers=AUTH, timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


def assert_openai_error(r: requests.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) >= {"message", "type", "param", "code"} and error["code"] == status
    return error


CHAT = {"model": "tiny", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 4}


@pytest.mark.parametrize("path, extra, field, setting", [
    ("/v1/chat/completions", {"n": 10000}, "n", "limits.max_n"),
    ("/v1/chat/completions", {"stop": ["a", "b", "c", "d", "e"]}, "stop", "limits.max_stop_sequences"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 6}, "top_logprobs", "limits.max_top_logprobs"),
    ("/v1/completions", {"prompt": [PROMPT] * 5}, "prompt", "limits.max_prompts"),
    ("/v1/completions", {"logprobs": 6}, "logprobs", "limits.max_top_logprobs"),
    ("/v1/completions", {"best_of": 5}, "best_of", "limits.max_n"),
])
def test_requests_beyond_a_limit_get_400_naming_field_and_limit(server, path, extra, field, setting):
    body = {"model": "tiny", "max_tokens": 4, **({"messages": CHAT["messages"]} if "chat" in path else
                                                  {"prompt": PROMPT}), **extra}
    before = metric(server, 'dynamo_spec_requests_rejected_total{reason="limit"}')
    error = assert_openai_error(post(server, path, body), 400)
    assert error["param"] == field and setting in error["message"], error
    assert metric(server, 'dynamo_spec_requests_rejected_total{reason="limit"}') == before + 1
    assert requests.get(server.url + "/health", timeout=5).status_code == 200


def test_within_limits_is_served(server):
    r = client(server).completions.create(model="tiny", prompt=[PROMPT] * 4, max_tokens=4, n=1, logprobs=5,
                                          stop=["x", "y", "z", "w"])
    assert len(r.choices) == 4


def test_max_tokens_beyond_the_context_is_400(server):
    assert_openai_error(post(server, "/v1/chat/completions", {**CHAT, "max_tokens": 100000}), 400)


def test_body_too_large_is_413(server):
    huge = {**CHAT, "messages": [{"role": "user", "content": "x" * 70000}]}
    assert_openai_error(post(server, "/v1/chat/completions", huge), 413)
    assert requests.get(server.url + "/health", timeout=5).status_code == 200


@pytest.mark.parametrize("route, body", [("/v1/chat/completions", CHAT), ("/v1/completions", {"model": "tiny", "prompt": "Hi"})])
@pytest.mark.parametrize("value", [False, "json", [1]])
def test_structured_outputs_not_an_object_is_400(server, route, body, value):
    """vLLM 0.32 answered 500 ("'bool' object has no attribute 'get'"; found by the fuzz test)."""
    r = post(server, route, {**body, "structured_outputs": value})
    assert_openai_error(r, 400)
    assert r.json()["error"]["param"] == "structured_outputs"
    assert requests.get(server.url + "/health", timeout=5).status_code == 200


def test_past_max_in_flight_answers_429_at_once(server):
    c = client(server)
    # 1,000 tokens (5-10 s): on a fast host two 300-token streams can end before the third request
    streams = [c.completions.create(model="tiny", prompt=PROMPT, max_tokens=1000, temperature=0, stream=True,
                                    extra_body={"ignore_eos": True}) for _ in range(2)]
    firsts = [next(iter(s)) for s in streams]  # both are running in the engine now
    assert all(f.choices for f in firsts)
    t0 = time.monotonic()
    r = post(server, "/v1/chat/completions", CHAT)
    assert time.monotonic() - t0 < 2
    assert_openai_error(r, 429)
    assert r.headers["Retry-After"] == "1"
    with pytest.raises(openai.RateLimitError):
        c.chat.completions.create(model="tiny", messages=CHAT["messages"], max_tokens=4)
    finishes = [[ch.choices[0].finish_reason for ch in s if ch.choices][-1] for s in streams]
    assert finishes == ["length", "length"]  # the admitted ones were not disturbed
    assert metric(server, 'dynamo_spec_requests_rejected_total{reason="overloaded"}') >= 2
    assert c.chat.completions.create(model="tiny", messages=CHAT["messages"], max_tokens=4).choices


def engine_stopped_generating(server, settle: float = 1.0) -> bool:
    """True when vLLM's generated-token counter stops growing (an aborted request is no longer decoded)."""
    time.sleep(settle)
    before = metric(server, "vllm:generation_tokens_total{")
    time.sleep(1.5)
    return metric(server, "vllm:generation_tokens_total{") == before


@pytest.fixture(scope="module")
def timeout_server(tiny_models, tmp_path_factory):
    cfg = config(tiny_models, limits={"request_timeout_seconds": 2})
    with ServerProcess(cfg, tmp_path_factory.mktemp("timeout")) as srv:
        for _ in range(10):  # warm-up; the first requests of a fresh cache may outlast 2 s
            try:
                client(srv).completions.create(model="tiny", prompt=PROMPT, max_tokens=4, logprobs=2)
                break
            except openai.APIStatusError:
                pass
        yield srv


def test_timeout_aborts_in_engine_and_answers_504(timeout_server):
    server = timeout_server
    before = metric(server, "dynamo_spec_request_timeouts_total")
    t0 = time.monotonic()
    r = post(server, "/v1/completions", {"model": "tiny", "prompt": PROMPT, "max_tokens": 2000, "ignore_eos": True})
    assert 1.9 < time.monotonic() - t0 < 10
    error = assert_openai_error(r, 504)
    assert "limits.request_timeout_seconds" in error["message"]
    assert engine_stopped_generating(server)  # aborted in the engine, not left running (10 s more)
    assert metric(server, "dynamo_spec_request_timeouts_total") == before + 1
    assert client(server).completions.create(model="tiny", prompt=PROMPT, max_tokens=4).choices  # still serving


def test_streaming_timeout_ends_with_an_error_event(timeout_server):
    stream = client(timeout_server).completions.create(model="tiny", prompt=PROMPT, max_tokens=2000, stream=True,
                                                       extra_body={"ignore_eos": True})
    received = 0
    with pytest.raises(openai.APIError, match="request_timeout_seconds"):
        for _ in stream:
            received += 1
    assert received > 10
    assert engine_stopped_generating(timeout_server)


def test_liveness_readiness_and_metrics_key(server):
    assert requests.get(server.url + "/live", timeout=5).json() == {"status": "alive"}
    assert requests.get(server.url + "/health", timeout=5).json() == {"status": "ok"}
    assert requests.get(server.url + "/metrics", timeout=5).status_code == 401
    assert "dynamo_spec_requests_rejected_total" in requests.get(server.url + "/metrics", headers=AUTH,
                                                                 timeout=5).text


def test_neither_key_nor_prompts_are_logged(server):
    marker = "purple-elephant-marker"
    client(server).chat.completions.create(model="tiny", messages=[{"role": "user", "content": marker}],
                                           max_tokens=2)
    log = server.log()
    assert API_KEY not in log and marker not in log and "Authorization" not in log
