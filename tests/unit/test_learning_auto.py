"""``learning.auto`` without an engine (dynamo_spec/learning/auto.py): the count of captured answer
tokens (a real capture writing real files), the threshold and the in-flight condition, one cycle
at a time, the child's settings (a private file without the API key), and what each end of a
child does: refused, crashed, killed, stopped at shutdown (nothing swapped, the record kept in
cycles.jsonl for the next start). The child is a stand-in script through the learner's own
process code; learn-draft itself, a promoted cycle's swap and a killed real cycle are
tests/integration/test_learning_auto.py."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import stat
import sys
import time
from pathlib import Path

import psutil
import pytest
import yaml

from dynamo_spec.config.loader import ConfigError, load_settings
from dynamo_spec.engine import features
from dynamo_spec.engine.paths import EnginePath
from dynamo_spec.learning import auto, swap_draft
from dynamo_spec.learning.capture import Capture, RequestContext, make_row
from dynamo_spec.learning.captures import CaptureStore
from dynamo_spec.learning.swap import SwapRefused
from dynamo_spec.serving.lifecycle import Lifecycle, Phase

pytestmark = pytest.mark.unit

TARGET = {"name": "tiny", "checksum": "sha256:" + "ab" * 32}
KEY = "auto-key"
# learn-draft's stand-in: says what it was given, then ends as its first argument after --config asks.
CHILD = r"""
import json, os, subprocess, sys, time
config, how = sys.argv[1], sys.argv[2]
seen = {"mode": oct(os.stat(config).st_mode & 0o777), "config": open(config).read(),
        "settings_env": sorted(k for k in os.environ if k.startswith("DYNAMO_SPEC_") and "__" in k),
        "argv": sys.argv[2:], "bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND")}
result = {"path": "/drafts/v007", "version": "v007", "heldout_al_before": 2.0, "heldout_al_after": 2.4,
          "everyday_al_before": 1.7, "everyday_al_after": 1.69, "rows": 36, "seen": seen}
print("INFO a vLLM line on stdout", flush=True)
if how == "refused":
    print(json.dumps({**result, "promoted": False, "reason": "held-out +0.010, below learning.min_gain 0.05"}))
    sys.exit(3)
if how == "promoted":
    print(json.dumps({**result, "promoted": True, "reason": "held-out +0.400"}))
    sys.exit(0)
if how == "crash":
    print("dynamo-spec learn-draft: error: RuntimeError: out of memory", file=sys.stderr)
    sys.exit(1)
grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
print(f"running {grandchild.pid}", file=sys.stderr, flush=True)
time.sleep(120)
"""


def settings(tmp_path: Path, write_config, *learn_args: str, **learning):
    config = {"server": {"api_key": KEY},
              "engine": {"model": str(tmp_path / "target")},
              "speculative": {"method": "eagle3", "model": str(tmp_path / "draft")},
              "learning": {"capture": True, "auto": True, "dir": str(tmp_path / "learning"), "every_tokens": 10,
                           "max_in_flight": 2, "learn_args": list(learn_args), **learning}}
    return load_settings(write_config(config), [], {}).settings


def stand_in(config: Path, learn_args: list[str]) -> list[str]:
    return [sys.executable, "-c", CHILD, str(config), *learn_args]


class Swaps:
    """The swap the learner is given (the app's: draft_admin.swap on its engine)."""

    def __init__(self, refuse: str | None = None):
        self.paths: list[str] = []
        self.refuse = refuse

    async def __call__(self, path: str) -> dict:
        if self.refuse:
            raise SwapRefused(self.refuse)
        self.paths.append(path)
        return {"path": path}


def learner(s, swaps: Swaps | None = None) -> auto.AutoLearner:
    capture = Capture(CaptureStore(s.learning.dir, max_bytes=2**30, retention_days=None, target=TARGET), None)
    return auto.AutoLearner(s, capture, swaps or Swaps(), command=stand_in)


def captured(cap: Capture, answer_tokens: int, n: int = 1) -> None:
    """``n`` finished requests of ``answer_tokens`` each, written as the capture's thread writes them."""
    for i in range(n):
        cap.record(make_row(row_id=f"req-{time.monotonic_ns()}-{i}", context=RequestContext("chat", None),
                            when=time.time(), prompt_ids=list(range(40)), answer_ids=[7] * answer_tokens,
                            sampling={"temperature": 0.0}, finish_reason="stop", acceptance=None))
    cap.flush()


def test_a_cycle_is_due_past_every_tokens_of_answers_and_below_max_in_flight(tmp_path, write_config):
    async def go():
        a = learner(settings(tmp_path, write_config, "refused"))
        captured(a.capture, 6)  # the 40 prompt tokens do not count
        assert a.tokens_since_last_cycle == 6 and not a.due(in_flight=0)
        a.capture.record(make_row(row_id="late", context=RequestContext("chat", None), when=time.time(),
                                  prompt_ids=[1], answer_ids=[7] * 4, sampling={"temperature": 0.0},
                                  finish_reason="stop", acceptance=None))
        assert a.tokens_since_last_cycle == 6  # buffered, not written yet: not counted
        a.capture.flush()
        assert a.tokens_since_last_cycle == 10
        assert not a.due(in_flight=2) and not a.maybe_start(in_flight=3)  # learning.max_in_flight: 2
        assert a.due(in_flight=1) and a.maybe_start(in_flight=1)
        assert a.running is not None and a.tokens_since_last_cycle == 0  # counted from the cycle's start
        captured(a.capture, 30)
        assert not a.due(in_flight=0) and not a.maybe_start(in_flight=0)  # one cycle at a time
        assert a.state(0)["running"]["since"] and a.state(0)["tokens_since_last_cycle"] == 30
        row = await a.wait()
        assert row["tokens"] == 10 and a.running is None
        assert a.maybe_start(in_flight=0)  # the 30 captured during the cycle count for the next one
        await a.wait()
        assert [c["tokens"] for c in a.cycles] == [10, 30]

    asyncio.run(go())


def test_a_refused_cycle_swaps_nothing_and_its_record_survives_a_restart(tmp_path, write_config, monkeypatch):
    monkeypatch.setenv("DYNAMO_SPEC_SERVER__API_KEY", KEY)
    monkeypatch.setenv("DYNAMO_SPEC_LEARNING__MIN_GAIN", "9")  # the server's value is in the file, not this
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    s = settings(tmp_path, write_config, "refused", min_gain=0.07)
    swaps = Swaps()

    async def go():
        a = learner(s, swaps)
        monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0,1")  # set for the server's engine once it starts
        captured(a.capture, 12)
        assert a.maybe_start(in_flight=0)
        return await a.wait()

    row = asyncio.run(go())
    assert swaps.paths == []
    assert (row["exit"], row["promoted"], row["swapped"], row["version"]) == (3, False, False, "v007")
    assert row["reason"] == "held-out +0.010, below learning.min_gain 0.05"
    assert row["figures"]["heldout_al_before"] == 2.0 and row["figures"]["everyday_al_after"] == 1.69
    assert row["seconds"] >= 0 and row["start"].endswith("Z") and row["end"].endswith("Z") and row["pid"] > 0
    root = tmp_path / "learning"
    assert stat.S_IMODE((root / auto.CYCLES).stat().st_mode) == 0o600
    assert stat.S_IMODE(Path(row["log"]).stat().st_mode) == 0o600
    assert stat.S_IMODE((root / auto.LOGS).stat().st_mode) == 0o700
    assert "a vLLM line on stdout" in Path(row["log"]).read_text()  # the child's stdout too
    # what the child was given: a private file with the server's settings, no key, no settings variables
    seen = json.loads(Path(row["log"]).read_text().strip().splitlines()[-1])["seen"]
    assert seen["mode"] == "0o600" and seen["settings_env"] == [] and seen["argv"] == ["refused"]
    assert seen["bind"] is None  # the environment from before the engine: the cycle's engine binds its own cores
    assert KEY not in seen["config"] and "api_key:" not in seen["config"].replace("metrics_require_api_key", "")
    child = yaml.safe_load(seen["config"])
    assert child["learning"]["min_gain"] == 0.07 and child["learning"]["dir"] == str(root)
    assert not list(root.glob(".auto-config-*"))  # removed when the cycle ended
    # a restart shows it
    again = learner(s)
    assert list(again.cycles) == [row] == auto.read_cycles(root)
    assert again.state(0)["cycles"] == [row]


def test_a_promoted_cycle_is_swapped_in_and_a_refused_swap_is_said(tmp_path, write_config):
    async def one(swaps: Swaps) -> dict:
        a = learner(settings(tmp_path, write_config, "promoted"), swaps)
        captured(a.capture, 10)
        a.maybe_start(in_flight=0)
        return await a.wait()

    swaps = Swaps()
    row = asyncio.run(one(swaps))
    assert swaps.paths == ["/drafts/v007"] and (row["exit"], row["promoted"], row["swapped"]) == (0, True, True)
    row = asyncio.run(one(Swaps(refuse="its d2t is torch.float32")))
    assert (row["promoted"], row["swapped"]) == (True, False)
    assert row["reason"] == "held-out +0.400; promoted but not swapped: its d2t is torch.float32"


def test_a_crashed_or_killed_cycle_swaps_nothing(tmp_path, write_config):
    swaps = Swaps()

    async def crash() -> dict:
        a = learner(settings(tmp_path, write_config, "crash"), swaps)
        captured(a.capture, 10)
        a.maybe_start(in_flight=0)
        return await a.wait()

    row = asyncio.run(crash())
    assert (row["exit"], row["promoted"], row["swapped"]) == (1, False, False)
    assert row["reason"] == "RuntimeError: out of memory" and row["version"] is None

    async def killed() -> dict:
        a = learner(settings(tmp_path, write_config, "hang"), swaps)
        captured(a.capture, 10)
        a.maybe_start(in_flight=0)
        grandchild = await _grandchild(a)
        os.kill(a.running.pid, signal.SIGKILL)
        row = await a.wait()
        _gone(grandchild)  # what the killed child started goes with it
        return row

    row = asyncio.run(killed())
    assert (row["exit"], row["promoted"], row["swapped"], row["reason"]) == (-9, False, False, "killed by SIGKILL")
    assert swaps.paths == []
    assert [r["exit"] for r in auto.read_cycles(tmp_path / "learning")] == [1, -9]


def test_shutdown_stops_a_running_cycle(tmp_path, write_config):
    async def go():
        a = learner(settings(tmp_path, write_config, "hang"))
        captured(a.capture, 10)
        a.maybe_start(in_flight=0)
        grandchild = await _grandchild(a)
        pid = a.running.pid
        t0 = time.monotonic()
        await a.close()
        assert time.monotonic() - t0 < auto.STOP_SECONDS
        _gone(pid)
        _gone(grandchild)
        assert not a.maybe_start(in_flight=0)  # none starts while closing
        return a.cycles[-1]

    row = asyncio.run(go())
    assert (row["exit"], row["promoted"], row["reason"]) == (-15, False, "killed by SIGTERM at shutdown")


async def _grandchild(a: auto.AutoLearner) -> int:
    """The pid of what the hanging stand-in started (it says so in its log)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if a.running and a.running.pid and Path(a.running.log).exists():
            for line in Path(a.running.log).read_text().splitlines():
                if line.startswith("running "):
                    return int(line.split()[1])
        await asyncio.sleep(0.05)
    raise AssertionError("the stand-in did not start")


def _gone(pid: int, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return
        except psutil.NoSuchProcess:
            return
        time.sleep(0.05)
    raise AssertionError(f"process {pid} still runs")


def test_the_child_config_makes_relative_paths_absolute(tmp_path, write_config, monkeypatch):
    monkeypatch.chdir(tmp_path)
    s = settings(tmp_path, write_config).model_copy(update={"engine": settings(tmp_path, write_config).engine
                                                            .model_copy(update={"model": "./models/target"})})
    path = tmp_path / "elsewhere" / "child.yaml"
    path.parent.mkdir()
    path.write_text(auto.child_config(s))
    child = load_settings(path, [], {}).settings
    assert child.engine.model == str(tmp_path / "models" / "target")  # not relative to the file's folder
    assert child.server.api_key is None
    assert child.learning == s.learning and child.speculative == s.speculative


def test_auto_needs_capture_an_eagle3_draft_and_the_v1_runner(tmp_path, write_config):
    with pytest.raises(ConfigError, match="learning.auto: automatic cycles learn from the captured traffic: set "
                                          "learning.capture: true"):
        settings(tmp_path, write_config, capture=False)
    with pytest.raises(ConfigError, match="learning.auto: a cycle fine-tunes the served EAGLE-3 draft"):
        load_settings(write_config({"engine": {"model": "m"}, "speculative": {"enabled": False},
                                    "learning": {"capture": True, "auto": True}}), [], {})
    with pytest.raises(ConfigError, match="learning.learn_args.*leave --config out"):
        settings(tmp_path, write_config, "--config", "x.yaml")
    s = settings(tmp_path, write_config)
    v2 = [p.message for p in features.refusals(s, EnginePath(True, True, "GPU default"), [])]
    assert [m for m in v2 if m.startswith("learning.auto: ")] == [m for m in v2 if "VLLM_USE_V2_MODEL_RUNNER=0" in m]
    assert len([m for m in v2 if m.startswith("learning.auto: ")]) == 1
    assert not features.refusals(s, EnginePath(False, False, "CPU"), [])
    off = load_settings(write_config({"engine": {"model": "m"}, "speculative": {"enabled": False}}), [], {}).settings
    assert off.learning.auto is False and off.learning.learn_args == []


def test_get_admin_learning_with_auto_on_and_off(tmp_path, write_config):
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from dynamo_spec.learning import capture

    root = tmp_path / "learning"
    root.mkdir()
    (root / auto.CYCLES).write_text(json.dumps({"version": "v001", "exit": 3}) + "\n{torn")
    s = settings(tmp_path, write_config, every_tokens=1000)
    app = FastAPI()
    app.state.lifecycle, app.state.engine = Lifecycle(), None
    capture.attach(app, s)
    learner_ = auto.attach(app, s, None)
    with TestClient(app) as http:
        body = http.get("/admin/learning").json()
        assert body["auto"] is True and body["every_tokens"] == 1000 and body["tokens_since_last_cycle"] == 0
        assert body["running"] is None and body["cycles"] == [{"version": "v001", "exit": 3}]
        assert body["max_in_flight"] == 2 and body["in_flight"] == 0
        app.state.lifecycle.set_phase(Phase.READY)
        app.state.lifecycle.started()
        assert http.get("/admin/learning").json()["in_flight"] == 1
        assert learner_ is app.state.learner
    off = load_settings(write_config({"engine": {"model": "m"}, "speculative": {"enabled": False},
                                      "learning": {"dir": str(root)}}), [], {}).settings
    app = FastAPI()
    app.state.lifecycle = Lifecycle()
    assert auto.attach(app, off, None) is None
    with TestClient(app) as http:
        assert http.get("/admin/learning").json() == {"auto": False, "dir": str(root), "running": None,
                                                      "cycles": [{"version": "v001", "exit": 3}]}


def test_swap_draft_finds_every_replica_and_refuses_bad_input(tmp_path, capsys, monkeypatch):
    assert swap_draft.replicas(["http://a:8000/"], ["http://localhost:8001"])[:2] == ["http://a:8000",
                                                                                      "http://127.0.0.1:8001"]
    from dynamo_spec.cli import main

    assert main(["swap-draft", "--path", str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip() == ("dynamo-spec swap-draft: error: no replica: give --url (each) or "
                                               "--service (a name resolving to every replica)")
    assert main(["swap-draft", "--url", "http://127.0.0.1:9"]) == 2
    assert "give --path" in capsys.readouterr().err
    monkeypatch.setenv("DYNAMO_SPEC_SERVER__API_KEY", KEY)
    assert main(["swap-draft", "--url", "http://127.0.0.1:9", "--path", str(tmp_path), "--timeout", "2"]) == 1
    out = capsys.readouterr()
    (replica,) = json.loads(out.out.strip().splitlines()[-1])["replicas"]
    assert replica["outcome"] == "unreachable" and KEY not in out.out + out.err


def test_at_start_the_promoted_version_of_this_target_is_swapped_in(tmp_path, write_config):
    from dynamo_spec.learning.learn import FORMAT_VERSION

    s = settings(tmp_path, write_config)
    drafts = tmp_path / "learning" / "drafts"
    drafts.mkdir(parents=True)

    def promoted(checksum: str) -> None:
        entry = {"version": "v002", "path": str(drafts / "v002"), "target": {"name": "tiny", "checksum": checksum}}
        (drafts / "manifest.json").write_text(json.dumps({"format": FORMAT_VERSION, "current": "v002",
                                                          "versions": [entry]}))

    async def start() -> list[str]:
        swaps = Swaps()
        await learner(s, swaps).resume(lambda: TARGET)
        return swaps.paths

    assert asyncio.run(start()) == []  # nothing promoted yet
    promoted(TARGET["checksum"])
    assert asyncio.run(start()) == [str(drafts / "v002")]
    promoted("sha256:" + "cd" * 32)  # another target's
    assert asyncio.run(start()) == []
