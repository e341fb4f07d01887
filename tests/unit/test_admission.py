"""Request bounds, the security warning and the lifecycle: the pure parts of operating the server."""

from __future__ import annotations

import asyncio
import json

import pytest

from dynamo_spec.config.settings import LimitsSettings, Settings
from dynamo_spec.serving.admission import Refusal, check_bounds, check_types, parse_body
from dynamo_spec.serving.lifecycle import Lifecycle, Phase
from dynamo_spec.serving.server import is_loopback, security_warnings

pytestmark = pytest.mark.unit

LIMITS = LimitsSettings(max_n=4, max_tokens=100, max_stop_sequences=2, max_top_logprobs=5, max_prompts=3)


@pytest.mark.parametrize("body, field, setting", [
    ({"n": 10000}, "n", "max_n"),
    ({"best_of": 5}, "best_of", "max_n"),
    ({"max_tokens": 101}, "max_tokens", "max_tokens"),
    ({"max_completion_tokens": 101}, "max_completion_tokens", "max_tokens"),
    ({"stop": ["a", "b", "c"]}, "stop", "max_stop_sequences"),
    ({"top_logprobs": 6}, "top_logprobs", "max_top_logprobs"),
    ({"logprobs": 6}, "logprobs", "max_top_logprobs"),
    ({"prompt_logprobs": 6}, "prompt_logprobs", "max_top_logprobs"),
    ({"prompt": ["a", "b", "c", "d"]}, "prompt", "max_prompts"),
    ({"prompt": [[1, 2], [3], [4], [5]]}, "prompt", "max_prompts"),
])
def test_beyond_a_limit_names_field_value_and_setting(body, field, setting):
    with pytest.raises(Refusal) as refused:
        check_bounds(body, LIMITS)
    r = refused.value
    assert (r.status, r.reason, r.param) == (400, "limit", field)
    assert f"limits.{setting}" in r.message and str(body[field] if not isinstance(body[field], list)
                                                     else len(body[field])) in r.message


@pytest.mark.parametrize("body", [
    {"n": 4, "max_tokens": 100, "stop": ["a", "b"], "top_logprobs": 5, "prompt": ["a", "b", "c"]},
    {"logprobs": True, "top_logprobs": 5},  # chat: logprobs is a bool
    {"prompt": list(range(500))},  # one tokenized prompt, not 500 prompts
    {"stop": "one string"},
    {"n": "ten", "max_tokens": -1},  # malformed: left to vLLM's validation (400 there)
    ["not", "an", "object"],
])
def test_within_limits_or_malformed_passes(body):
    check_bounds(body, LIMITS)


@pytest.mark.parametrize("value", [False, 0, "json", [1]])
def test_structured_outputs_must_be_an_object(value):
    with pytest.raises(Refusal) as refusal:
        check_types({"structured_outputs": value})
    assert refusal.value.status == 400 and refusal.value.param == "structured_outputs"


@pytest.mark.parametrize("body", [{"structured_outputs": None}, {"structured_outputs": {"json": {}}}, {}, [1], "x"])
def test_structured_outputs_object_or_absent_passes(body):
    check_types(body)


def test_max_tokens_unbounded_by_default():
    check_bounds({"max_tokens": 10**6}, LimitsSettings())


@pytest.mark.parametrize("host, loopback", [
    ("127.0.0.1", True), ("::1", True), ("localhost", True), ("0.0.0.0", False), ("::", False),
    ("10.1.2.3", False), ("my-host", False),
])
def test_is_loopback(host, loopback):
    assert is_loopback(host) is loopback


def test_warns_when_reachable_without_a_key():
    def settings(**server):
        return Settings(engine={"model": "m"}, speculative={"enabled": False}, server=server)

    [warning] = security_warnings(settings(host="0.0.0.0"))
    assert "server.api_key" in warning and "0.0.0.0" in warning
    assert security_warnings(settings(host="0.0.0.0", api_key="k")) == []
    assert security_warnings(settings(host="127.0.0.1")) == []


def test_warns_when_capturing_without_a_key():
    """Captures are the users' prompts and answers: without a key, /admin can erase them, and
    whoever reaches even a loopback port can swap the draft."""
    def settings(**server):
        return Settings(engine={"model": "m"}, speculative={"enabled": False}, server=server,
                        learning={"capture": True, "dir": "/srv/learning"})

    [warning] = security_warnings(settings(host="127.0.0.1"))
    assert "learning.capture" in warning and "/srv/learning" in warning and "server.api_key" in warning
    assert security_warnings(settings(host="127.0.0.1", api_key="k")) == []
    assert len(security_warnings(settings(host="0.0.0.0"))) == 2


def test_key_never_shown_and_requests_not_logged_by_default():
    from dynamo_spec.engine.args import vllm_serving_args

    s = Settings(engine={"model": "m"}, speculative={"enabled": False}, server={"api_key": "s3cret"})
    assert "s3cret" not in repr(s) and "s3cret" not in str(s.model_dump())
    assert vllm_serving_args(s).enable_log_requests is False


def test_lifecycle_counts_in_flight_and_waits_for_idle():
    async def scenario():
        life = Lifecycle()
        assert life.phase is Phase.LOADING and not life.ready
        life.set_phase(Phase.READY)
        life.started()
        life.started()
        assert not await life.wait_idle(0.05)
        life.finished()
        asyncio.get_running_loop().call_later(0.05, life.finished)
        assert await life.wait_idle(2)
        life.set_phase(Phase.DEAD, "the engine died")
        life.set_phase(Phase.READY)  # dead is final
        assert (life.phase, life.reason) == (Phase.DEAD, "the engine died")

    asyncio.run(scenario())


@pytest.mark.parametrize("body, what", [
    (b"[" * 30000 + b"]" * 30000, "nests deeper"),  # RecursionError inside json.loads
    (b'{"a": ' + b"[" * 65 + b"]" * 65 + b"}", "nests deeper"),  # parses, but past the bound
    (b"{'a': 1}", "not valid JSON"),
    (b'{"a": "\xff"}', "not valid JSON"),
    (b"", "not valid JSON"),
])
def test_a_body_that_is_not_json_or_nests_too_deeply_is_refused(body, what):
    with pytest.raises(Refusal) as refused:
        parse_body(body, max_depth=64)
    assert (refused.value.status, refused.value.reason) == (400, "invalid") and what in refused.value.message


def test_a_body_at_the_depth_bound_parses():
    body = b'{"a": ' + b"[" * 63 + b"]" * 63 + b"}"  # 64 levels: the object and 63 arrays
    parsed = parse_body(body, max_depth=64)
    assert isinstance(parsed["a"], list) and json.dumps(parsed).count("[") == 63
    assert parse_body(b'{"messages": [{"content": [{"type": "text"}]}]}', max_depth=5)["messages"]


@pytest.mark.parametrize("value", [-1, True, 1.5, 2.0, "2", [1], {"n": 1}])
def test_a_cap_on_draft_tokens_that_is_not_an_integer_from_0_is_refused(value):
    with pytest.raises(Refusal) as refused:
        check_types({"prompt": "x", "vllm_xargs": {"max_draft_tokens": value}})
    r = refused.value
    assert (r.status, r.reason, r.param) == (400, "invalid", "vllm_xargs.max_draft_tokens")
    assert "'vllm_xargs.max_draft_tokens' must be an integer >= 0" in r.message


@pytest.mark.parametrize("body", [{"vllm_xargs": {"max_draft_tokens": 0}}, {"vllm_xargs": {"max_draft_tokens": 5}},
                                  {"vllm_xargs": {"max_draft_tokens": None}}, {"vllm_xargs": {"other": "x"}},
                                  {"vllm_xargs": None}, {}])
def test_a_cap_on_draft_tokens_from_0_or_absent_passes(body):
    check_types(body)


def tenant_caps(**tenants: int | None):
    from dynamo_spec.serving.draft_caps import TenantDraftCaps

    settings = Settings(engine={"model": "m"}, speculative={"model": "d", "tenants": {
        name: {"max_draft_tokens": cap} for name, cap in tenants.items()}}, metrics={"tenant_header": "X-Tenant"})
    return TenantDraftCaps.from_settings(settings)


def headers(tenant: str | None) -> list[tuple[bytes, bytes]]:
    return [(b"content-type", b"application/json")] + ([(b"x-tenant", tenant.encode())] if tenant else [])


@pytest.mark.parametrize("tenant, body, merged", [
    ("batch", {"prompt": "x"}, {"prompt": "x", "vllm_xargs": {"max_draft_tokens": 0}}),
    ("batch", {"vllm_xargs": None}, {"vllm_xargs": {"max_draft_tokens": 0}}),
    ("slow", {"vllm_xargs": {"max_draft_tokens": 3, "k": "v"}}, {"vllm_xargs": {"max_draft_tokens": 2, "k": "v"}}),
    ("slow", {"vllm_xargs": {"max_draft_tokens": 1}}, None),  # the request's value may lower it
    ("slow", {"vllm_xargs": {"max_draft_tokens": 2}}, None),
    ("chat", {"prompt": "x"}, None),  # a tenant without a default
    ("other", {"prompt": "x"}, None),  # an unknown tenant
    (None, {"prompt": "x"}, None),  # no tenant header
    ("batch", {"vllm_xargs": "not an object"}, None),  # vLLM's own 400
])
def test_a_tenant_default_is_merged_into_the_request_and_only_lowered_by_it(tenant, body, merged):
    caps = tenant_caps(batch=0, slow=2, chat=None)
    assert caps.merged(body, headers(tenant)) == merged


def test_no_tenant_defaults_no_merging():
    assert tenant_caps(chat=None) is None


def test_a_stream_whose_client_takes_nothing_is_closed_after_the_timeout(monkeypatch, caplog):
    """Past the timeout a stream ends with an error event; when the client's buffers are full
    and that send blocks, the connection is closed after FINAL_SEND_SECONDS instead of held."""
    import asyncio
    import logging

    from dynamo_spec.config.settings import LimitsSettings
    from dynamo_spec.serving import admission
    from dynamo_spec.serving.lifecycle import Lifecycle, Phase

    monkeypatch.setattr(admission, "ABORT_WAIT_SECONDS", 0.1)
    monkeypatch.setattr(admission, "FINAL_SEND_SECONDS", 0.2)
    blocked = asyncio.Event()  # never set: the client reads nothing more

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        while True:
            await send({"type": "http.response.body", "body": b"data: {}\n\n", "more_body": True})

    async def send(message):
        if message["type"] == "http.response.body":
            await blocked.wait()

    async def receive():
        await asyncio.sleep(3600)

    lifecycle = Lifecycle()
    lifecycle.set_phase(Phase.READY)
    middleware = admission.AdmissionMiddleware(app, lifecycle, LimitsSettings(request_timeout_seconds=0.2), None)
    scope = {"type": "http", "method": "GET", "path": "/v1/models", "headers": []}

    async def scenario():
        with pytest.raises(admission.SlowReaderClosed):
            await asyncio.wait_for(middleware._run_in_time(scope, receive, send), 5)

    with caplog.at_level(logging.WARNING, logger="dynamo_spec.serving.admission"):
        asyncio.run(scenario())
    assert "takes the stream too slowly; closing its connection" in caplog.text
    record = logging.LogRecord("uvicorn.error", logging.ERROR, __file__, 1, "Exception in ASGI application", (),
                               (admission.SlowReaderClosed, admission.SlowReaderClosed("x"), None))
    assert not all(f.filter(record) for f in logging.getLogger("uvicorn.error").filters)  # no traceback
