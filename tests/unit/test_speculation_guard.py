"""The speculation guard's state machine, on a clock the test moves."""

from __future__ import annotations

import json
import math

import pytest

from dynamo_spec.config.settings import GuardSettings
from dynamo_spec.vllm_patches.speculation_guard import (
    FALLBACK,
    GUARD_KEY,
    PROBING,
    SPECULATING,
    GuardConfig,
    SpeculationGuard,
)

pytestmark = pytest.mark.unit


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def guard(**overrides) -> tuple[SpeculationGuard, Clock]:
    clock = Clock()
    config = GuardConfig(**{"min_acceptance_rate": 0.2, "window_draft_tokens": 30, "window_seconds": 10,
                            "min_draft_tokens": 9, "probe_interval_seconds": 5, "probe_draft_tokens": 12,
                            **overrides})
    return SpeculationGuard(config, clock), clock


def feed(g: SpeculationGuard, clock: Clock, steps: int, accepted: int, k: int = 3, dt: float = 0.01) -> None:
    for _ in range(steps):
        clock.now += dt
        g.observe(k, accepted)


def test_the_engine_side_takes_every_value_from_the_settings():
    """The settings model is the one source of the guard's defaults: the engine-side config has none."""
    import dataclasses

    fields = dataclasses.fields(GuardConfig)
    assert all(f.default is dataclasses.MISSING for f in fields)
    settings = GuardSettings().model_dump(exclude={"enabled"})
    assert {f.name for f in fields} == set(settings)
    config = GuardConfig(**{**settings, "window_draft_tokens": 7})
    # to the engine as plain JSON data in its switches (vLLM hashes additional_config as JSON), and back
    assert GuardConfig.from_switches(json.loads(json.dumps({GUARD_KEY: config.to_switch()}))) == config
    assert GuardConfig.from_switches({}) is None and GuardConfig.from_switches({GUARD_KEY: None}) is None


def test_good_acceptance_never_falls_back():
    g, clock = guard()
    feed(g, clock, 1000, accepted=1)  # rate 1/3
    assert g.state == SPECULATING and g.cap() is None and g.transitions == {}


def test_a_collapse_falls_back_within_the_window_then_probes_and_stays_down():
    g, clock = guard()
    feed(g, clock, 5, accepted=3)  # a good start: 15 tokens all accepted
    feed(g, clock, 5, accepted=0)  # 30 tokens, 15 accepted: 0.5, still fine
    assert g.state == SPECULATING
    feed(g, clock, 3, accepted=0)  # the window slides: 30 tokens, 6 accepted -> 0.2, not below
    assert g.state == SPECULATING
    feed(g, clock, 1, accepted=0)  # 30 tokens, 3 accepted -> 0.1 < 0.2
    assert g.state == FALLBACK and g.cap() == 0
    assert g.last_judged["draft_tokens"] == 30 and g.last_judged["acceptance_rate"] == pytest.approx(0.1)
    feed(g, clock, 50, accepted=3, dt=0)  # drafts verified after the fall (scheduled before it) are ignored
    assert g.state == FALLBACK
    clock.now += 4.9
    assert g.cap() == 0
    clock.now += 0.2
    assert g.cap() is None and g.state == PROBING  # the probe drafts as the schedule allows
    feed(g, clock, 3, accepted=0)  # 9 tokens: too few to judge
    assert g.state == PROBING
    feed(g, clock, 1, accepted=0)  # 12 tokens, 0 accepted
    assert g.state == FALLBACK
    assert g.transitions == {"speculating->fallback": 1, "fallback->probing": 1, "probing->fallback": 1}


def test_a_probe_that_finds_acceptance_recovered_resumes():
    g, clock = guard()
    feed(g, clock, 10, accepted=0)
    assert g.state == FALLBACK
    clock.now += 5
    assert g.cap() is None
    feed(g, clock, 4, accepted=1)  # 12 tokens, 4 accepted: 0.33
    assert g.state == SPECULATING
    feed(g, clock, 9, accepted=1)  # a fresh window: not judged on the probe's tokens alone
    assert g.state == SPECULATING


def test_slow_traffic_is_judged_after_the_window_seconds():
    g, clock = guard()
    feed(g, clock, 2, accepted=0, dt=1)  # 6 tokens in 2 s
    assert g.state == SPECULATING
    feed(g, clock, 1, accepted=0, dt=8)  # 9 tokens, the window spans 9 s
    assert g.state == SPECULATING
    feed(g, clock, 1, accepted=0, dt=1)  # 12 tokens over 10 s
    assert g.state == FALLBACK


def test_an_operator_pins_and_releases_a_state():
    g, clock = guard()
    snap = g.force(FALLBACK)
    assert snap["state"] == FALLBACK and snap["pinned"]
    clock.now += 60
    assert g.cap() == 0  # pinned: no probe
    g.force(SPECULATING)
    feed(g, clock, 100, accepted=0)
    assert g.state == SPECULATING and g.cap() is None  # pinned: no fallback
    g.force("auto")
    feed(g, clock, 10, accepted=0)
    assert g.state == FALLBACK and not g.pinned
    g.force(PROBING)
    assert g.state == PROBING and g.cap() is None
    with pytest.raises(ValueError, match="state must be one of"):
        g.force("off")
    assert g.transitions == {"speculating->fallback": 2, "fallback->speculating": 1, "fallback->probing": 1}


def test_the_snapshot_is_json_without_nan():
    import json

    g, _ = guard()
    snap = g.snapshot()
    assert snap["window"]["acceptance_rate"] is None
    json.dumps(snap, allow_nan=False)
    assert not any(isinstance(v, float) and math.isnan(v) for v in snap["window"].values())
