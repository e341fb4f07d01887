"""A real Prometheus, with the repository's own prometheus.yml and alerts.yml, scrapes a real server.

Every dashboard query and every alert expression is evaluated through Prometheus'
HTTP API; the acceptance figures must equal what the fixture pair dictates.
"""

from __future__ import annotations

import re
import time

import openai
import pytest

from support.server_process import ServerProcess, tiny_config
from tests.promql import PrometheusServer, alert_rules, dashboard_queries

pytestmark = pytest.mark.e2e

K = 3
EXPECTED_RATE, EXPECTED_LENGTH = 1 / K, 2.0  # partial_draft: only position 0 is ever accepted


def value(result: list[dict]) -> float:
    assert len(result) == 1, result
    return float(result[0]["value"][1])


def core_of(expr: str) -> str:
    """An alert expression without its threshold (the figure it compares), which must return data."""
    expr = expr.split("unless")[0]
    return re.sub(r"\s*(<=|>=|==|!=|<|>)\s*[\d.]+\s*$", "", expr.strip()).strip()


@pytest.fixture(scope="module")
def stack(tiny_models, tmp_path_factory):
    # The guard on (it stays in `speculating` at this draft's rate), so its series and panels have data.
    config = tiny_config(tiny_models["fixed_target"], tiny_models["partial_draft"], k=K,
                         speculative={"guard": {"enabled": True}})
    server = ServerProcess(config, tmp_path_factory.mktemp("prom")).start()
    try:
        with PrometheusServer(f"127.0.0.1:{server.port}") as prometheus:
            prometheus.wait_for_scrapes(2, timeout=60)  # counters seen before the traffic: rate() has a baseline
            client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
            for prompt in ["What is the capital of France?", "Write a poem.", "Hello!", "def f(x):"]:
                client.completions.create(model="tiny", prompt=prompt, max_tokens=25, temperature=0,
                                          extra_body={"ignore_eos": True})
            client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=9,
                                           temperature=0, stream=True)
            time.sleep(1.5)
            prometheus.wait_for_scrapes(6, timeout=60)
            yield server, prometheus
    finally:
        server.stop()


def test_every_dashboard_query_returns_data(stack):
    _, prometheus = stack
    empty = [(title, expr) for title, expr in dashboard_queries(rate_interval="5m") if not prometheus.query(expr)]
    assert empty == []


def test_acceptance_figures_through_prometheus_equal_the_fixture(stack):
    _, prometheus = stack
    assert value(prometheus.query('dynamo_spec_acceptance_rate{model="tiny"}')) == pytest.approx(EXPECTED_RATE)
    assert value(prometheus.query('dynamo_spec_mean_acceptance_length{model="tiny"}')) == pytest.approx(EXPECTED_LENGTH)
    counters = "sum(dynamo_spec_accepted_tokens_total) / sum(dynamo_spec_draft_tokens_total)"
    assert value(prometheus.query(counters)) == pytest.approx(EXPECTED_RATE)
    per_position = prometheus.query('dynamo_spec_position_acceptance_rate{model="tiny"}')
    assert {r["metric"]["position"]: float(r["value"][1]) for r in per_position} == \
        pytest.approx({"0": 1.0, "1": 0.0, "2": 0.0})
    median = prometheus.query(
        'histogram_quantile(0.5, sum by (le) (dynamo_spec_request_acceptance_length_bucket{model="tiny"}))')
    assert 1.75 < value(median) <= EXPECTED_LENGTH
    vllm_ratio = ('sum(vllm:spec_decode_num_accepted_tokens_total{model_name="tiny"}) / '
                  'sum(vllm:spec_decode_num_draft_tokens_total{model_name="tiny"})')
    assert value(prometheus.query(vllm_ratio)) == pytest.approx(EXPECTED_RATE)


def test_alert_rules_evaluate_on_real_data(stack):
    _, prometheus = stack
    time.sleep(2)  # at least one rule evaluation (1 s interval in the test config)
    rules = {r["name"]: r for g in prometheus.api("rules")["groups"] for r in g["rules"]}
    assert set(rules) == {name for name, _ in alert_rules()}
    for name, rule in rules.items():
        assert rule["health"] == "ok", (name, rule.get("lastError"))
        assert rule["state"] == "inactive", name  # 1/3 acceptance, no errors, server up: nothing fires
    for name, expr in alert_rules():
        if name != "DynamoSpecServerDown":
            assert prometheus.query(core_of(expr)), (name, core_of(expr))


def test_server_down_alert_sees_a_stopped_server(stack):
    server, prometheus = stack
    server.stop()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if prometheus.query(dict(alert_rules())["DynamoSpecServerDown"]):
            break
        time.sleep(0.5)
    else:
        pytest.fail("up == 0 never seen after stopping the server")
