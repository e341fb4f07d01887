"""deploy/: Prometheus config and alerts, compose file, Grafana dashboard."""

import json
import re

import pytest
import yaml

from tests.promql import ALERTS, ALERTS_TEST, COMPOSE, DASHBOARD, PROMETHEUS_CONFIG, alert_rules, dashboard_queries

pytestmark = pytest.mark.unit

# The server's metric contract; histograms expose _bucket, _sum and _count.
METRICS = {
    "dynamo_spec_acceptance_rate",
    "dynamo_spec_mean_acceptance_length",
    "dynamo_spec_position_acceptance_rate",
    "dynamo_spec_window_drafts",
    "dynamo_spec_drafts_total",
    "dynamo_spec_draft_tokens_total",
    "dynamo_spec_accepted_tokens_total",
    "dynamo_spec_accepted_tokens_per_position_total",
    "dynamo_spec_request_prompt_tokens_total",
    "dynamo_spec_request_completion_tokens_total",
    "dynamo_spec_http_requests_total",
    "dynamo_spec_http_requests_in_flight",
    "dynamo_spec_info",
    "dynamo_spec_speculation_state",
    "dynamo_spec_speculation_state_pinned",
    "dynamo_spec_speculation_transitions_total",
    "up",
}
HISTOGRAMS = {
    "dynamo_spec_request_acceptance_length",
    "dynamo_spec_request_acceptance_rate",
    "dynamo_spec_time_to_first_token_seconds",
    "dynamo_spec_inter_token_latency_seconds",
    "dynamo_spec_e2e_request_latency_seconds",
}
KNOWN = METRICS | {f"{h}_{suffix}" for h in HISTOGRAMS for suffix in ("bucket", "sum", "count")}
# Series without a `model` label, which the dashboard cannot filter by $model.
UNLABELLED = {"dynamo_spec_http_requests_total", "dynamo_spec_http_requests_in_flight", "up"}

KEYWORDS = {
    "sum",
    "min",
    "max",
    "avg",
    "count",
    "group",
    "stddev",
    "stdvar",
    "topk",
    "bottomk",
    "quantile",
    "count_values",
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "and",
    "or",
    "unless",
    "bool",
    "offset",
}


def metric_names(expr: str) -> set[str]:
    """Metric names in a PromQL expression (not functions, keywords or labels)."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', "", expr)  # string literals
    expr = re.sub(r"\{[^}]*\}|\[[^\]]*\]", "", expr)  # matchers, ranges
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", expr)
    names = re.findall(r"(?<![\w:.])([A-Za-z_:][\w:]*)(?![\w:])(?!\s*\()", expr)
    return {name for name in names if name not in KEYWORDS}


def test_compose_mounts_prometheus_config_and_dashboards():
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    assert "9090:9090" in services["prometheus"]["ports"]
    assert "3000:3000" in services["grafana"]["ports"]
    assert any(v.startswith("./prometheus:") for v in services["prometheus"]["volumes"])
    assert any(v.startswith("./grafana/dashboards:") for v in services["grafana"]["volumes"])
    assert "host.docker.internal:host-gateway" in services["prometheus"]["extra_hosts"]


def test_prometheus_config_scrapes_dynamo_spec():
    config = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    assert config["rule_files"] == ["alerts.yml"]
    (job,) = config["scrape_configs"]
    assert job["job_name"] == "dynamo-spec"
    assert job["metrics_path"] == "/metrics"
    assert job["static_configs"] == [{"targets": ["host.docker.internal:8000"]}]


def test_every_alert_fires_and_clears_in_unit_tests():
    fired, quiet = set(), set()
    for test in yaml.safe_load(ALERTS_TEST.read_text())["tests"]:
        for case in test.get("alert_rule_test", []):
            (fired if case.get("exp_alerts") else quiet).add(case["alertname"])
    alerts = {name for name, _ in alert_rules(ALERTS)}
    assert alerts == {
        "DynamoSpecLowAcceptanceRate",
        "DynamoSpecSpeculationStopped",
        "DynamoSpecSpeculationFallback",
        "DynamoSpecServerDown",
        "DynamoSpecHighErrorRate",
    }
    assert alerts - fired == set(), "alerts no unit test fires"
    assert alerts - quiet == set(), "alerts no unit test sees clear"


def test_alerts_are_documented_and_use_known_metrics():
    for group in yaml.safe_load(ALERTS.read_text())["groups"]:
        assert group["name"] == "dynamo-spec"
        for rule in group["rules"]:
            assert rule["labels"]["severity"] in {"warning", "critical"}, rule["alert"]
            assert {"summary", "description"} <= set(rule["annotations"]), rule["alert"]
            assert metric_names(rule["expr"]) <= KNOWN, rule["alert"]


def test_dashboard_structure():
    dashboard = json.loads(DASHBOARD.read_text())
    panels = dashboard["panels"]
    ids = [panel["id"] for panel in panels]
    assert len(ids) == len(set(ids)), "duplicate panel ids"
    for panel in panels:
        assert panel["title"] and panel["description"], panel["id"]
        assert panel["datasource"]["uid"] == "prometheus", panel["title"]
        assert any(t.get("expr") for t in panel["targets"]), panel["title"]
        for t in panel["targets"]:
            assert t.get("datasource", {"uid": "prometheus"})["uid"] == "prometheus", panel["title"]
    (variable,) = dashboard["templating"]["list"]
    assert variable["name"] == "model"
    assert variable["query"]["query"] == "label_values(dynamo_spec_info, model)"


def test_dashboard_has_the_documented_panels():
    exprs = " ".join(expr for _, expr in dashboard_queries(DASHBOARD))
    for needed in [
        "dynamo_spec_acceptance_rate{",
        "rate(dynamo_spec_accepted_tokens_total",
        "dynamo_spec_mean_acceptance_length{",
        "dynamo_spec_position_acceptance_rate{",
        "dynamo_spec_request_acceptance_length_bucket",
        "dynamo_spec_time_to_first_token_seconds_bucket",
        "dynamo_spec_inter_token_latency_seconds_bucket",
        "dynamo_spec_e2e_request_latency_seconds_bucket",
        "dynamo_spec_http_requests_total",
        "dynamo_spec_http_requests_in_flight",
        "dynamo_spec_info",
    ]:
        assert needed in exprs, needed
    heatmaps = [p for p in json.loads(DASHBOARD.read_text())["panels"] if p["type"] == "heatmap"]
    assert heatmaps and all(t["format"] == "heatmap" for p in heatmaps for t in p["targets"])


def test_dashboard_metrics_are_documented_and_filtered_by_model():
    raw = dashboard_queries(DASHBOARD, rate_interval="$__rate_interval", model="$model")
    for title, expr in raw:
        names = metric_names(expr)
        unknown = {n for n in names - KNOWN if not n.startswith("vllm:")}
        assert not unknown, f"{title}: undocumented metrics {unknown}"
        if names - UNLABELLED:
            assert '=~"$model"' in expr, f"{title}: not filtered by $model: {expr}"


def test_dashboard_queries_substitute_grafana_variables():
    queries = dashboard_queries(DASHBOARD, rate_interval="30s", model="llama")
    assert queries and all("$" not in expr for _, expr in queries)
    assert any("[30s]" in expr and 'model=~"llama"' in expr for _, expr in queries)


def test_metric_names():
    expr = (
        'sum by (model, le) (rate(a_total{x="b c"}[5m]))'
        " / on (model) group_left () (vllm:y > 0) unless up"
    )
    assert metric_names(expr) == {"a_total", "vllm:y", "up"}
