"""tests/promql.PrometheusServer against a real Prometheus and a tiny exporter."""

import pytest
from prometheus_client import CollectorRegistry, Counter, start_http_server

from tests.promql import ALERTS, PrometheusServer, alert_rules, dashboard_queries

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def prometheus():
    registry = CollectorRegistry()
    drafts = Counter("dynamo_spec_drafts_total", "Drafts.", ["model"], registry=registry)
    drafts.labels(model="tiny").inc(7)
    server, thread = start_http_server(0, addr="127.0.0.1", registry=registry)
    try:
        with PrometheusServer(f"127.0.0.1:{server.server_port}") as prom:
            prom.wait_for_scrapes(2, timeout=30)
            yield prom
    finally:
        server.shutdown()
        thread.join(timeout=5)


def test_query_returns_scraped_value(prometheus):
    (series,) = prometheus.query('dynamo_spec_drafts_total{model="tiny"}')
    assert series["metric"]["job"] == "dynamo-spec"
    assert float(series["value"][1]) == 7


def test_query_raises_on_bad_expression(prometheus):
    with pytest.raises(RuntimeError, match="bad_data"):
        prometheus.query("sum(")


def test_alert_rules_are_loaded(prometheus):
    groups = prometheus.api("rules")["groups"]
    loaded = {rule["name"] for group in groups for rule in group["rules"]}
    assert loaded == {name for name, _ in alert_rules(ALERTS)}


@pytest.mark.parametrize("title, expr", dashboard_queries())
def test_dashboard_query_is_valid_promql(prometheus, title, expr):
    prometheus.query(expr)
