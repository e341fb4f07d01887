"""The speculation guard against a real server: dynamo_spec/vllm_patches/speculation_guard.py,
draft_admission.py (its cap and its observations) and dynamo_spec/serving/guard.py (metrics,
admin route).

The fixed target always emits token 0 (support/tiny_models.py): the always-accepting draft
proposes it at every position (rate 1), the never-accepting one never does (rate 0), and the
hook in hooks/ (DYNAMO_SPEC_HOOK_REJECT) turns the always-accepting draft into a rejecting one while a file exists.
Each verified step drafts exactly k = 3 tokens a request, so vLLM's drafted-token counter
tells exactly when the guard stopped drafting: after the window's 60 tokens, and after a
probe's 30.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import requests

from support.server_process import ServerProcess, tiny_config
from tests.integration.test_operate import assert_openai_error

pytestmark = pytest.mark.integration

HOOKS = Path(__file__).parent / "hooks"
KEY = "guard-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
# Long enough: a first prompt of 4 tokens or fewer crashes vLLM 0.32's AMX attention on head size 32
# (the tiny fixtures) with SIGILL on some AMX hosts.
PROMPT = "Tell me about the guard that watches the drafts of this server."
GUARD = {"enabled": True, "min_acceptance_rate": 0.5, "window_draft_tokens": 60, "window_seconds": 600,
         "min_draft_tokens": 20, "probe_interval_seconds": 12, "probe_draft_tokens": 30}


def config(tiny_models, draft: str) -> dict:
    return tiny_config(tiny_models["fixed_target"], tiny_models[draft], k=3,
                       speculative={"guard": GUARD}, server={"api_key": KEY})


def complete(server: ServerProcess, max_tokens: int) -> None:
    r = requests.post(server.url + "/v1/completions", headers=AUTH, timeout=120, json={
        "model": "tiny", "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == max_tokens


def guard(server: ServerProcess) -> dict:
    r = requests.get(server.url + "/admin/speculation", headers=AUTH, timeout=10)
    assert r.status_code == 200, r.text
    return r.json()


def drafted(server: ServerProcess) -> float:
    line = next(line for line in server.metrics().splitlines()
                if line.startswith("vllm:spec_decode_num_draft_tokens_total{"))
    return float(line.rsplit(" ", 1)[1])


def state_on_metrics(server: ServerProcess, expected: str, timeout: float = 10) -> dict[str, float]:
    """The state gauges once /metrics shows `expected` (it polls the engine every second)."""
    deadline = time.monotonic() + timeout
    while True:
        gauges = {line.split('state="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
                  for line in server.metrics().splitlines()
                  if line.startswith("dynamo_spec_speculation_state{")}
        if gauges.get(expected) == 1.0 or time.monotonic() > deadline:
            return gauges
        time.sleep(0.2)


def wait_for_probe_time(server: ServerProcess) -> None:
    snap = guard(server)
    assert snap["state"] == "fallback"
    time.sleep(max(0.0, GUARD["probe_interval_seconds"] - snap["seconds_in_state"]) + 0.5)


def test_a_draft_that_is_never_accepted_falls_back_and_its_probe_falls_back_again(tiny_models, tmp_path):
    with ServerProcess(config(tiny_models, "never_draft"), tmp_path) as srv:
        assert guard(srv)["state"] == "speculating"
        complete(srv, 100)
        snap = guard(srv)
        assert snap["state"] == "fallback" and snap["transitions"] == {"speculating->fallback": 1}
        assert snap["last_judged"]["draft_tokens"] == 60 and snap["last_judged"]["accepted_tokens"] == 0
        assert drafted(srv) == 60  # nothing drafted after the window was judged
        complete(srv, 40)  # well inside the probe interval: k=0 steps
        assert guard(srv)["seconds_in_state"] < GUARD["probe_interval_seconds"], "too slow to test the fallback"
        assert drafted(srv) == 60
        assert state_on_metrics(srv, "fallback") == {"speculating": 0.0, "fallback": 1.0, "probing": 0.0}

        wait_for_probe_time(srv)
        complete(srv, 60)  # the probe drafts its 30 tokens, finds them all rejected
        snap = guard(srv)
        assert snap["state"] == "fallback"
        assert snap["transitions"] == {"speculating->fallback": 1, "fallback->probing": 1, "probing->fallback": 1}
        assert drafted(srv) == 90
        log = srv.log()
    assert "speculation guard: speculating -> fallback: acceptance rate 0.0%" in log
    assert "fallback -> probing" in log and "probing -> fallback" in log


def test_an_accepted_draft_never_falls_back_until_it_is_swapped_then_the_probe_resumes(tiny_models, tmp_path):
    trigger = tmp_path / "reject"
    env = {"PYTHONPATH": str(HOOKS), "DYNAMO_SPEC_HOOK_REJECT": str(trigger)}
    with ServerProcess(config(tiny_models, "always_draft"), tmp_path, env=env) as srv:
        complete(srv, 200)
        snap = guard(srv)
        assert snap["state"] == "speculating" and snap["transitions"] == {}
        assert snap["window"]["acceptance_rate"] == 1.0

        trigger.touch()  # from now on every draft token is rejected
        complete(srv, 100)
        snap = guard(srv)
        assert snap["state"] == "fallback" and snap["transitions"] == {"speculating->fallback": 1}
        # The window slid over the rejected drafts until fewer than half of its 60 were accepted.
        assert snap["last_judged"]["acceptance_rate"] < 0.5

        trigger.unlink()  # the draft is good again: the next probe resumes speculation
        wait_for_probe_time(srv)
        complete(srv, 100)
        snap = guard(srv)
        assert snap["state"] == "speculating"
        assert snap["transitions"] == {"speculating->fallback": 1, "fallback->probing": 1,
                                       "probing->speculating": 1}
        assert state_on_metrics(srv, "speculating")["speculating"] == 1.0

        # An operator pins a state; the route needs the API key and a known state.
        assert_openai_error(requests.post(srv.url + "/admin/speculation", json={"state": "fallback"}, timeout=10), 401)
        r = requests.post(srv.url + "/admin/speculation", headers=AUTH, json={"state": "off"}, timeout=10)
        assert assert_openai_error(r, 400)["param"] == "state"
        r = requests.post(srv.url + "/admin/speculation", headers=AUTH, json={"state": "fallback"}, timeout=10)
        assert r.status_code == 200 and r.json()["state"] == "fallback" and r.json()["pinned"]
        before = drafted(srv)
        complete(srv, 40)
        assert drafted(srv) == before  # pinned fallback: nothing drafted
        assert "dynamo_spec_speculation_state_pinned{model=\"tiny\"} 1.0" in srv.metrics()
        r = requests.post(srv.url + "/admin/speculation", headers=AUTH, json={"state": "auto"}, timeout=10)
        assert r.json()["pinned"] is False
        text = srv.metrics()
    assert 'dynamo_spec_speculation_transitions_total{from="speculating",model="tiny",to="fallback"} 2.0' in text

