"""The metrics module on a fresh registry: windows, NaN when idle, tenants, exposition."""

from __future__ import annotations

import math

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from dynamo_spec.serving.metrics import DynamoSpecMetrics

pytestmark = pytest.mark.unit


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


@pytest.fixture
def metrics(registry, clock) -> DynamoSpecMetrics:
    return DynamoSpecMetrics(
        registry, model="m", draft_model="d", method="eagle3", num_speculative_tokens=3,
        version="test", window_seconds=60, max_tenants=2, clock=clock,
    )


def value(registry: CollectorRegistry, name: str, **labels: str) -> float:
    v = registry.get_sample_value(name, {"model": "m", **labels})
    assert v is not None, f"{name}{labels} not exposed"
    return v


def test_window_gauges_follow_vllm_definitions(metrics, registry):
    metrics.record_step(drafts=2, draft_tokens=6, accepted=3, accepted_per_pos=[2, 1, 0])
    metrics.record_step(drafts=1, draft_tokens=3, accepted=3, accepted_per_pos=[1, 1, 1])
    assert value(registry, "dynamo_spec_acceptance_rate") == pytest.approx(6 / 9)
    assert value(registry, "dynamo_spec_mean_acceptance_length") == pytest.approx(1 + 6 / 3)
    assert [value(registry, "dynamo_spec_position_acceptance_rate", position=str(i)) for i in range(3)] == \
        pytest.approx([3 / 3, 2 / 3, 1 / 3])
    assert value(registry, "dynamo_spec_window_drafts") == 3
    assert value(registry, "dynamo_spec_drafts_total") == 3
    assert value(registry, "dynamo_spec_draft_tokens_total") == 9
    assert value(registry, "dynamo_spec_accepted_tokens_total") == 6
    assert value(registry, "dynamo_spec_accepted_tokens_per_position_total", position="0") == 3


def test_window_forgets_old_steps_and_says_nan_when_idle(metrics, registry, clock):
    assert math.isnan(value(registry, "dynamo_spec_acceptance_rate"))  # nothing yet: no made-up 0
    metrics.record_step(drafts=1, draft_tokens=3, accepted=0, accepted_per_pos=[0, 0, 0])
    clock.now += 30
    metrics.record_step(drafts=1, draft_tokens=3, accepted=3, accepted_per_pos=[1, 1, 1])
    assert value(registry, "dynamo_spec_acceptance_rate") == pytest.approx(0.5)
    clock.now += 45  # the first step is now older than the 60 s window
    assert value(registry, "dynamo_spec_acceptance_rate") == pytest.approx(1.0)
    clock.now += 60  # an idle hour later: no stale value
    assert math.isnan(value(registry, "dynamo_spec_acceptance_rate"))
    assert math.isnan(value(registry, "dynamo_spec_mean_acceptance_length"))
    assert value(registry, "dynamo_spec_window_drafts") == 0
    assert value(registry, "dynamo_spec_accepted_tokens_total") == 3  # counters keep counting


def test_per_request_histograms_and_tenants(metrics, registry):
    spec = {"mean_acceptance_length": 2.5, "draft_acceptance_rate": 0.5, "num_spec_steps": 4, "num_draft_tokens": 12}
    for tenant in ("a", "b", "c", "d"):
        metrics.observe_request(metrics.tenants.label(tenant), prompt_tokens=5, completion_tokens=10,
                                e2e_seconds=0.5, ttft_seconds=0.1, itl_seconds=0.01, spec=[spec])
    metrics.observe_request(metrics.tenants.label(None), prompt_tokens=1, completion_tokens=1,
                            e2e_seconds=0.1, ttft_seconds=None, itl_seconds=None, spec=[])
    assert value(registry, "dynamo_spec_request_acceptance_length_count", tenant="a") == 1
    assert value(registry, "dynamo_spec_request_acceptance_length_bucket", tenant="a", le="2.5") == 1
    assert value(registry, "dynamo_spec_request_acceptance_length_bucket", tenant="a", le="2.25") == 0
    assert value(registry, "dynamo_spec_request_acceptance_rate_sum", tenant="b") == 0.5
    assert value(registry, "dynamo_spec_request_acceptance_length_count", tenant="other") == 2  # max_tenants=2
    assert value(registry, "dynamo_spec_request_completion_tokens_total", tenant="default") == 1
    assert value(registry, "dynamo_spec_time_to_first_token_seconds_count", tenant="a") == 1


def test_stat_logger_reads_vllm_spec_decoding_stats(metrics, registry):
    from vllm.v1.metrics.stats import SchedulerStats
    from vllm.v1.spec_decode.metrics import SpecDecodingStats

    stats = SpecDecodingStats.new(3)
    stats.observe_draft(num_draft_tokens=3, num_accepted_tokens=2)
    stats.observe_draft(num_draft_tokens=3, num_accepted_tokens=0)
    logger = metrics.stat_logger_factory()(None, 0)
    logger.record(SchedulerStats(spec_decoding_stats=stats), None)
    logger.record(SchedulerStats(), None)  # a step without speculation
    assert value(registry, "dynamo_spec_drafts_total") == 2
    assert value(registry, "dynamo_spec_accepted_tokens_total") == 2
    assert value(registry, "dynamo_spec_mean_acceptance_length") == pytest.approx(2.0)
    assert value(registry, "dynamo_spec_position_acceptance_rate", position="1") == pytest.approx(0.5)


def test_exposition_names_and_info(metrics, registry):
    text = generate_latest(registry).decode()
    assert 'dynamo_spec_info{draft_model="d",method="eagle3",model="m",num_speculative_tokens="3",version="test"} 1.0' in text
    for name in ("dynamo_spec_drafts_total", "dynamo_spec_draft_tokens_total", "dynamo_spec_accepted_tokens_total"):
        assert f'{name}{{model="m"}} 0.0' in text
    assert "# TYPE dynamo_spec_acceptance_rate gauge" in text
    assert "# TYPE dynamo_spec_request_acceptance_length histogram" in text


def test_log_line(metrics):
    assert metrics.log_window() is None
    metrics.record_step(drafts=4, draft_tokens=12, accepted=6, accepted_per_pos=[3, 2, 1])
    line = metrics.log_window()
    assert "acceptance rate 50.0%" in line and "mean acceptance length 2.50" in line and "0.75, 0.50, 0.25" in line
