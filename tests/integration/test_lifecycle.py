"""The server's life (real server, tiny models): readiness while loading, SIGTERM while loading, drain.

Each test starts its own server, since it stops it. An 800-token stream runs ~5 s on the
2-core runner (longer on hosts without native bf16): still in flight when the signal comes,
which is sent as soon as the server counts the requests in flight.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import openai
import pytest
import requests

from support.processes import Watch
from support.server_process import ServerProcess, _group_members, tiny_config
from tests.integration.test_operate import CHAT, PROMPT, assert_openai_error, config, metric, post

pytestmark = pytest.mark.integration

HOOKS = Path(__file__).parent / "hooks"


def in_flight(server) -> float:
    return metric(server, 'dynamo_spec_http_requests_in_flight{route="/v1/completions"}')


def wait_in_flight(server, n: int, results: list, stall: float = 60) -> None:
    """Until the server counts `n` requests in flight. The streams were sent together (a
    barrier), so all are in flight at once unless one already ended: that fails at once with
    what it got, rather than waiting out the timeout (a fast host finishing short streams).
    The wait takes its time from the server's progress, not the host's speed: it fails only
    when the count has not risen for `stall` seconds (a slow host admits them later, but it
    admits them)."""
    seen, moved = in_flight(server), time.monotonic()
    while seen < n:
        assert not results, f"a stream ended before {n} were in flight: {results}"
        assert time.monotonic() - moved < stall, f"{n} requests never in flight ({seen:.0f} for {stall:.0f} s)"
        time.sleep(0.05)
        if (now := in_flight(server)) > seen:
            seen, moved = now, time.monotonic()


def test_sigterm_while_loading_exits_promptly_leaving_nothing(tiny_models, tmp_path):
    # Bound to every interface without an API key: the start-up log must say so.
    srv = ServerProcess(config(tiny_models, server={"host": "0.0.0.0"}), tmp_path).launch()
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if requests.get(srv.url + "/live", timeout=2).status_code == 200:
                    break
            except requests.RequestException:
                time.sleep(0.2)
        health = requests.get(srv.url + "/health", timeout=2)
        assert health.status_code == 503 and health.json() == {"status": "loading"}
        assert_openai_error(requests.get(srv.url + "/v1/models", timeout=2), 503)
        srv.proc.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        returncode = srv.proc.wait(30)
        assert time.monotonic() - t0 < 20
        assert returncode != 0
        time.sleep(1)
        assert _group_members(srv.proc.pid) == []
        assert "server.host is 0.0.0.0 (reachable from other machines) and server.api_key is not set" in srv.log()
    finally:
        srv.stop()


def start_streams(server, n: int, max_tokens: int, results: list) -> list[threading.Thread]:
    """`n` greedy completion streams, each in a thread, sent together: every thread has its
    client built before a barrier lets them all post, so they are in flight at the same time
    whatever the host's speed. Each appends ("done", finish_reason) or ("error", ...)."""
    barrier = threading.Barrier(n)

    def run():
        try:
            client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
            barrier.wait(30)
            stream = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=max_tokens,
                                               temperature=0, stream=True, extra_body={"ignore_eos": True})
            finish = None
            for chunk in stream:
                if chunk.choices:
                    finish = chunk.choices[0].finish_reason or finish
            results.append(("done", finish))
        except Exception as exc:  # a cut stream
            results.append(("error", repr(exc)))

    threads = [threading.Thread(target=run) for _ in range(n)]
    for thread in threads:
        thread.start()
    return threads


def pytorch_libgomp() -> str:
    import torch

    [lib] = Path(torch.__file__).parent.glob("lib/libgomp*.so*")
    return str(lib)


def test_sigterm_drains_in_flight_requests_then_exits_0(tiny_models, tmp_path):
    # Started from an environment that preloads PyTorch's libgomp, as vLLM leaves it in any
    # process that ran an engine: engine.cpu_preload must not add a second OpenMP (vLLM's
    # engine asserts against two; this failed the suite's later servers in CI).
    env = {"LD_PRELOAD": pytorch_libgomp()}
    with ServerProcess(config(tiny_models, server={"shutdown_grace_seconds": 120}), tmp_path, env=env) as srv:
        results: list = []
        threads = start_streams(srv, 3, 800, results)
        wait_in_flight(srv, 3, results)
        srv.proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        health = requests.get(srv.url + "/health", timeout=5)
        assert health.status_code == 503 and health.json()["status"] == "draining"
        assert requests.get(srv.url + "/live", timeout=5).status_code == 200
        assert_openai_error(post(srv, "/v1/chat/completions", CHAT), 503)
        for t in threads:
            t.join(240)
        assert results == [("done", "length")] * 3
        assert srv.proc.wait(30) == 0
        assert "draining (up to 120 s for 3 request(s) in flight" in srv.log()
        assert "Drain: nothing in flight" in srv.log()


def test_drain_past_the_grace_cuts_and_exits_1(tiny_models, tmp_path):
    with ServerProcess(config(tiny_models, server={"shutdown_grace_seconds": 1}), tmp_path) as srv:
        results: list = []
        [thread] = start_streams(srv, 1, 2000, results)
        wait_in_flight(srv, 1, results)
        srv.proc.send_signal(signal.SIGTERM)
        thread.join(60)
        assert srv.proc.wait(30) == 1
        assert len(results) == 1 and results[0] != ("done", "length"), results  # cut, not finished
        assert "1 request(s) still in flight after 1 s" in srv.log()


@pytest.mark.serial  # a compiled engine and a slow exit: alone on every core (tests/run.sh)
def test_serve_exits_only_after_its_processes_and_shared_memory_are_gone(tiny_models, tmp_path):
    """The compiled engine, 8 streams in flight at SIGTERM, and a worker that takes 8 s to
    exit (a hook; a compiled worker's last garbage collection can take that long on a busy
    host): past vLLM's default 5 s EngineCore was killed, leaving its shared memory behind.
    When serve has exited, nothing it started runs and /dev/shm holds nothing of theirs."""
    # 60 s to stop (30 by default): on a loaded 2-core host the compiled engine's exit plus the
    # hook's 8 s can pass 30 s, and the kill past the stop time is then right, not a failure.
    cfg = tiny_config(tiny_models["target"], tiny_models["draft"], engine={"enforce_eager": False},
                      server={"engine_stop_seconds": 60})
    env = {"PYTHONPATH": os.pathsep.join([str(HOOKS), os.environ.get("PYTHONPATH", "")]),
           "DYNAMO_SPEC_HOOK_SLOW_EXIT": "8"}
    with ServerProcess(cfg, tmp_path, env=env) as srv:
        watch = Watch(srv.proc.pid)
        results: list = []
        threads = start_streams(srv, 8, 300, results)
        wait_in_flight(srv, 8, results)
        srv.proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(240)
        returncode = srv.proc.wait(120)
        running, shm = watch.running(), watch.shm_left()  # at once: nothing may be left to finish
        watch.stop()
        log = srv.log()
        assert results == [("done", "length")] * 8
        assert (returncode, running, shm) == (0, [], []), log[-3000:]
        assert len(watch.seen) >= 3  # EngineCore, the worker, the resource tracker
        assert "force killing" not in log and "leaked shared_memory" not in log and "killed:" not in log


def test_a_killed_worker_turns_health_503_ends_requests_in_flight_and_exits_1(tiny_models, tmp_path):
    """SIGKILL the model runner (vLLM's worker process), not EngineCore, with two streams in
    flight (each has sent its first chunk): /health says 503 within seconds, both streams end
    with an error instead of hanging, the server exits 1 and nothing it started is left."""
    import psutil

    def rest(stream) -> tuple[str, str | None]:
        finish = None
        try:
            for chunk in stream:
                if chunk.choices:
                    finish = chunk.choices[0].finish_reason or finish
        except openai.APITimeoutError:
            return "hung", None
        except Exception as exc:  # the stream was cut
            return "error", repr(exc)
        return "done", finish

    with ServerProcess(config(tiny_models), tmp_path) as srv:
        watch = Watch(srv.proc.pid)
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=30)
        streams = [client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2000, temperature=0, stream=True,
                                             extra_body={"ignore_eos": True}) for _ in range(2)]
        assert all(next(iter(s)).choices for s in streams)  # both are running in the engine
        [worker] = [p for p in psutil.Process(srv.proc.pid).children(recursive=True) if "Worker" in p.name()]
        worker.kill()
        killed = time.monotonic()
        while requests.get(srv.url + "/health", timeout=5).status_code == 200:
            assert time.monotonic() - killed < 15, "/health still 200 15 s after the worker died"
            time.sleep(0.2)
        outcomes = [rest(s) for s in streams]
        assert [o[0] for o in outcomes] == ["error", "error"], outcomes
        assert srv.proc.wait(60) == 1
        time.sleep(1)
        running = watch.running()
        watch.stop()
        assert running == [], srv.log()[-3000:]
        assert "The engine died" in srv.log()
