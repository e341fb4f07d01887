"""The capture store on disk (dynamo_spec/learning/captures.py) and the capture hook
(dynamo_spec/learning/capture.py) without an engine: rotation, caps, retention, erase,
permissions, a truncated tail, another target refused; the hook's rows from vLLM's own
output objects; capture off creates and costs nothing."""

from __future__ import annotations

import asyncio
import gzip
import json
import os
import stat
import time
from pathlib import Path

import pytest

from dynamo_spec.config.loader import ConfigError, load_settings
from dynamo_spec.learning import capture, captures
from dynamo_spec.learning.captures import CaptureStore, CaptureTargetMismatch

pytestmark = pytest.mark.unit

TARGET = {"name": "tiny", "checksum": "sha256:" + "ab" * 32}
DAY = 86_400.0
T0 = 1_700_000_000.0


class Clock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> float:
        return self.now


def rows(n: int, when: float, start: int = 0, answer: int = 8) -> list[dict]:
    return [{"id": f"r{start + i}", "source": "capture", "round": None, "temperature": 0.0, "time": when,
             "prompt_ids": list(range(i, i + 5)), "answer_ids": [start + i] * answer} for i in range(n)]


def store(root: Path, clock: Clock, **kw) -> CaptureStore:
    kw.setdefault("max_bytes", 10**9)
    kw.setdefault("retention_days", 30.0)
    return CaptureStore(root, target=TARGET, clock=clock, **kw)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_rows_round_trip_with_private_permissions_and_a_manifest(tmp_path):
    clock = Clock()
    s = store(tmp_path, clock)
    s.append(rows(3, clock.now))
    s.append(rows(2, clock.now + 5, start=3))
    assert [r["id"] for r in captures.iter_rows(tmp_path)] == ["r0", "r1", "r2", "r3", "r4"]
    d = tmp_path / "captures"
    assert mode(d) == 0o700
    assert {p.name: mode(p) for p in d.iterdir()} == {
        "capture-000001.jsonl.gz": 0o600, "manifest.json": 0o600, ".lock": 0o600}
    manifest = json.loads((d / "manifest.json").read_text())
    assert manifest["target"] == TARGET == captures.target_of(tmp_path)
    (entry,) = manifest["files"]
    assert entry | {"writer": None} == {"file": "capture-000001.jsonl.gz", "rows": 5, "bytes": entry["bytes"],
                                        "first_time": clock.now, "last_time": clock.now + 5, "closed": False,
                                        "writer": None}
    assert entry["bytes"] == (d / entry["file"]).stat().st_size
    s.close()
    assert captures.manifest_of(tmp_path)["files"][0]["closed"] is True


def test_a_directory_left_loose_is_made_private(tmp_path):
    (tmp_path / "captures").mkdir(mode=0o755)
    os.chmod(tmp_path / "captures", 0o755)
    store(tmp_path, Clock()).append(rows(1, T0))
    assert mode(tmp_path / "captures") == 0o700


def test_rotation_by_size_and_a_new_file_per_writer(tmp_path):
    clock = Clock()
    s = store(tmp_path, clock, rotate_bytes=300)
    for i in range(6):
        s.append(rows(4, clock.now + i, start=4 * i))
    files = captures.manifest_of(tmp_path)["files"]
    assert len(files) >= 3 and all(e["closed"] for e in files[:-1])
    assert all(e["bytes"] < 300 + max(f["bytes"] for f in files) for e in files)
    assert [r["id"] for r in captures.iter_rows(tmp_path)] == [f"r{i}" for i in range(24)]  # oldest first
    # A second writer (a restart, or another replica) never appends to the first one's file.
    before = {e["file"] for e in files}
    store(tmp_path, clock).append(rows(1, clock.now + 10, start=24))
    after = captures.manifest_of(tmp_path)["files"]
    assert after[-1]["file"] not in before and after[-1]["rows"] == 1
    assert [r["id"] for r in captures.iter_rows(tmp_path)][-1] == "r24"


def test_rotation_by_age(tmp_path):
    clock = Clock()
    s = store(tmp_path, clock, rotate_seconds=100.0)
    s.append(rows(1, clock.now))
    clock.now += 101
    s.enforce()
    s.append(rows(1, clock.now, start=1))
    files = captures.manifest_of(tmp_path)["files"]
    assert [(e["rows"], e["closed"]) for e in files] == [(1, True), (1, False)]


def test_the_size_cap_drops_the_oldest_files(tmp_path):
    clock = Clock()
    s = store(tmp_path, clock, max_bytes=1000, rotate_bytes=250)
    for i in range(20):
        s.append(rows(3, clock.now + i, start=3 * i))
        total = sum(e["bytes"] for e in captures.manifest_of(tmp_path)["files"])
        assert total <= 1000
    on_disk = sorted(p.name for p in (tmp_path / "captures").glob("capture-*"))
    assert on_disk == [e["file"] for e in captures.manifest_of(tmp_path)["files"]]
    ids = [int(r["id"][1:]) for r in captures.iter_rows(tmp_path)]
    assert ids == list(range(ids[0], 60)) and ids[0] > 0  # the newest kept, the oldest gone


def test_a_cap_smaller_than_a_file_still_holds(tmp_path):
    s = store(tmp_path, Clock(), max_bytes=200)
    for i in range(5):
        s.append(rows(5, T0, start=5 * i))
    assert sum(e["bytes"] for e in captures.manifest_of(tmp_path)["files"]) <= 200


def test_retention_drops_files_whose_rows_are_all_older(tmp_path):
    clock = Clock()
    s = store(tmp_path, clock, retention_days=2.0)
    assert s.rotate_seconds == DAY / 2  # a file spans at most a quarter of the retention
    s.append(rows(2, clock.now))
    clock.now += DAY
    s.append(rows(2, clock.now, start=2))  # the first file is half a day past its span: rotated
    clock.now += 1.5 * DAY
    assert s.enforce() == ["capture-000001.jsonl.gz"]
    assert [r["id"] for r in captures.iter_rows(tmp_path)] == ["r2", "r3"]
    clock.now += DAY
    s.enforce()
    assert list(captures.iter_rows(tmp_path)) == []


def test_no_retention_keeps_everything(tmp_path):
    clock = Clock()
    s = store(tmp_path, clock, retention_days=None)
    s.append(rows(1, clock.now))
    clock.now += 10_000 * DAY
    assert s.enforce() == []
    assert len(list(captures.iter_rows(tmp_path))) == 1


def test_erase_removes_everything_and_the_writer_starts_again(tmp_path):
    clock = Clock()
    s = store(tmp_path, clock, rotate_bytes=300)
    for i in range(4):
        s.append(rows(4, clock.now, start=4 * i))
    files = captures.manifest_of(tmp_path)["files"]
    expected = {"files": len(files), "rows": 16, "bytes": sum(e["bytes"] for e in files)}
    assert captures.erase(tmp_path) == expected  # another process (learn-draft, another replica)
    assert [p.name for p in (tmp_path / "captures").iterdir()] == [".lock"]
    assert captures.target_of(tmp_path) is None
    s.append(rows(1, clock.now, start=100))  # its open file was erased: a new one
    assert [r["id"] for r in captures.iter_rows(tmp_path)] == ["r100"]
    size = captures.manifest_of(tmp_path)["files"][0]["bytes"]
    assert s.erase() == {"files": 1, "rows": 1, "bytes": size}
    assert list(captures.iter_rows(tmp_path)) == []


def test_reading_and_erasing_nothing_creates_nothing(tmp_path):
    root = tmp_path / "learning"
    assert list(captures.iter_rows(root)) == []
    assert captures.target_of(root) is None
    assert captures.erase(root) == {"files": 0, "rows": 0, "bytes": 0}
    assert not root.exists()


def test_a_truncated_last_member_is_left_out(tmp_path):
    s = store(tmp_path, Clock())
    path = tmp_path / "captures" / "capture-000001.jsonl.gz"
    s.append(rows(2, T0))
    first = path.stat().st_size
    s.append(rows(3, T0, start=2))  # a second gzip member
    data = path.read_bytes()
    for cut in (1, 10, (len(data) - first) // 2, len(data) - first - 1):
        path.write_bytes(data[:-cut])  # as a reader finds a member being written
        assert [r["id"] for r in captures.iter_rows(tmp_path)] == ["r0", "r1"]
    path.write_bytes(data + b"\x1f\x8b garbage")  # a damaged member after whole ones
    assert [r["id"] for r in captures.iter_rows(tmp_path)] == ["r0", "r1", "r2", "r3", "r4"]


def test_a_file_missing_from_the_manifest_is_adopted(tmp_path):
    clock = Clock()
    d = tmp_path / "captures"
    d.mkdir(mode=0o700)
    (d / "capture-000007.jsonl.gz").write_bytes(gzip.compress(json.dumps(rows(1, clock.now)[0]).encode() + b"\n"))
    store(tmp_path, clock).append(rows(1, clock.now, start=1))
    files = captures.manifest_of(tmp_path)["files"]
    assert [(e["file"], e["rows"], e["closed"]) for e in files] == [
        ("capture-000007.jsonl.gz", 1, True), ("capture-000008.jsonl.gz", 1, False)]


def test_a_writer_that_died_has_its_file_closed_by_the_next(tmp_path):
    clock = Clock()
    store(tmp_path, clock).append(rows(1, clock.now))  # never closed: as if killed
    store(tmp_path, clock).append(rows(1, clock.now, start=1))
    assert [e["closed"] for e in captures.manifest_of(tmp_path)["files"]] == [True, False]


def test_captures_of_another_target_are_refused_not_mixed(tmp_path):
    store(tmp_path, Clock()).append(rows(1, T0))
    other = CaptureStore(tmp_path, max_bytes=10**9, retention_days=None,
                         target={"name": "other", "checksum": "sha256:" + "cd" * 32})
    with pytest.raises(CaptureTargetMismatch, match="DELETE /admin/learning/captures"):
        other.append(rows(1, T0, start=1))
    assert [r["id"] for r in captures.iter_rows(tmp_path)] == ["r0"]


# ------------------------------------------------------------------ the buffer and the hook


def settings_for(tmp_path: Path, write_config, **learning):
    base = {"engine": {"model": str(tmp_path / "no-model")}, "speculative": {"enabled": False},
            "learning": {"dir": str(tmp_path / "learning"), **learning}}
    return load_settings(write_config(base), [], {}).settings


def test_capture_off_creates_nothing_and_wraps_nothing(tmp_path, write_config):
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    settings = settings_for(tmp_path, write_config)
    assert settings.learning.capture is False
    app = FastAPI()
    assert capture.attach(app, settings) is None and app.state.capture is None
    assert not any(m.cls is capture.CaptureMiddleware for m in app.user_middleware)
    client = object()
    assert capture.capturing(client, None) is client  # the engine client itself: nothing paid per request
    with TestClient(app) as http:
        assert http.delete("/admin/learning/captures").json() == {
            "erased": {"files": 0, "rows": 0, "bytes": 0}, "capture": False}
        assert http.get("/admin/learning/captures").json()["capture"] is False
    assert not (tmp_path / "learning").exists()


def test_capture_on_buffers_then_writes_on_its_thread(tmp_path, write_config):
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    settings = settings_for(tmp_path, write_config, capture=True)
    app = FastAPI()
    cap = capture.attach(app, settings)
    assert any(m.cls is capture.CaptureMiddleware for m in app.user_middleware)
    with TestClient(app) as http:
        assert cap._thread is not None and cap._thread.is_alive()
        cap.record(rows(1, time.time())[0])
        assert not (tmp_path / "learning" / "captures").exists()  # nothing on the request path
        cap.record(rows(1, time.time(), start=1)[0])
        assert http.delete("/admin/learning/captures").json()["erased"]["rows"] == 2  # buffered rows too
        cap.record(rows(1, time.time(), start=2)[0])
    # Shutdown wrote the buffer and closed the file.
    assert [r["id"] for r in captures.iter_rows(tmp_path / "learning")] == ["r2"]
    assert captures.manifest_of(tmp_path / "learning")["files"][0]["closed"] is True


def test_learning_tenants_need_the_tenant_header(tmp_path, write_config):
    with pytest.raises(ConfigError, match="learning.tenants.*metrics.tenant_header"):
        settings_for(tmp_path, write_config, capture=True, tenants=["a"])


class FakeEngine:
    """Yields the given vLLM RequestOutputs: the engine's side of one request."""

    def __init__(self, outputs):
        self.outputs = outputs

    async def generate(self, *args, **kwargs):
        for o in self.outputs:
            await asyncio.sleep(0)
            yield o


def outputs_of(kind, chunks, finish):
    """RequestOutputs of one request: ``chunks[i]`` is a list of (index, token ids) pairs."""
    from vllm.outputs import CompletionOutput, RequestOutput
    from vllm.v1.metrics.stats import RequestSpecDecodeMetrics

    spec = RequestSpecDecodeMetrics.new(3)
    spec.observe(3, 2)
    spec.observe(3, 1)
    done = []
    for i, chunk in enumerate(chunks):
        last = i == len(chunks) - 1
        outs = [CompletionOutput(index=j, text="", token_ids=ids, cumulative_logprob=None, logprobs=None,
                                 finish_reason=finish.get(j) if last else None,
                                 spec_decode_metrics=spec if last else None) for j, ids in chunk]
        done.append(RequestOutput(request_id="cmpl-1", prompt=None, prompt_token_ids=[5, 6, 7], prompt_logprobs=None,
                                  outputs=outs, finished=last))
    return done


def run_hook(tmp_path, engine_outputs, params, *, tenant="a", tenants=None):
    cap = capture.Capture(store(tmp_path, Clock()), tenants)
    client = capture.CapturingEngineClient(FakeEngine(engine_outputs), cap)

    async def go():
        token = capture.request_context.set(capture.RequestContext("completions", tenant))
        try:
            return [o async for o in client.generate("prompt", params, "cmpl-1")]
        finally:
            capture.request_context.reset(token)

    seen = asyncio.run(go())
    assert seen == engine_outputs  # passed through untouched
    cap.flush()
    return list(captures.iter_rows(tmp_path))


def test_the_hook_joins_streamed_deltas_and_keeps_one_row_per_choice(tmp_path):
    from vllm.sampling_params import RequestOutputKind, SamplingParams

    params = SamplingParams(n=2, temperature=0.7, top_p=0.9, seed=3, max_tokens=4,
                            output_kind=RequestOutputKind.DELTA, extra_args={"dry_multiplier": 0.8})
    outs = outputs_of(RequestOutputKind.DELTA, [[(0, [1, 2]), (1, [9])], [(0, [3]), (1, [8, 7])]],
                      {0: "length", 1: "stop"})
    got = run_hook(tmp_path, outs, params)
    assert [(r["id"], r["answer_ids"], r["finish_reason"]) for r in got] == [
        ("cmpl-1/0", [1, 2, 3], "length"), ("cmpl-1/1", [9, 8, 7], "stop")]
    r = got[0]
    assert (r["source"], r["tenant"], r["endpoint"], r["prompt_ids"], r["temperature"]) == (
        "capture", "a", "completions", [5, 6, 7], 0.7)
    assert r["sampling"] == {
        "temperature": 0.7, "top_p": 0.9, "top_k": 0, "min_p": 0.0, "presence_penalty": 0.0,
        "frequency_penalty": 0.0, "repetition_penalty": 1.0, "seed": 3, "max_tokens": 4,
        "extra_args": {"dry_multiplier": 0.8}}
    assert r["acceptance"] == {"drafted": 6, "accepted": 3, "steps": 2}


def test_the_hook_keeps_final_outputs_whole(tmp_path):
    from vllm.sampling_params import RequestOutputKind, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=4, output_kind=RequestOutputKind.FINAL_ONLY)
    got = run_hook(tmp_path, outputs_of(RequestOutputKind.FINAL_ONLY, [[(0, [4, 5, 6])]], {0: "stop"}), params)
    assert [(r["id"], r["answer_ids"], r["temperature"]) for r in got] == [("cmpl-1", [4, 5, 6], 0.0)]


@pytest.mark.parametrize("case", ["abort", "error", "other tenant", "no request context", "unfinished"])
def test_the_hook_leaves_out(tmp_path, case):
    from vllm.sampling_params import RequestOutputKind, SamplingParams

    params = SamplingParams(max_tokens=4, output_kind=RequestOutputKind.DELTA)
    finish = {0: case} if case in ("abort", "error") else {0: "stop"}
    outs = outputs_of(RequestOutputKind.DELTA, [[(0, [1])], [(0, [2])]], finish)
    if case == "unfinished":  # the client went away: the engine's generator is closed early
        outs = outs[:1]
    tenant = "b" if case == "other tenant" else "a"
    if case == "no request context":
        cap = capture.Capture(store(tmp_path, Clock()), None)
        client = capture.CapturingEngineClient(FakeEngine(outs), cap)

        async def go():
            return [o async for o in client.generate("prompt", params, "cmpl-1")]

        asyncio.run(go())
        cap.flush()
        got = list(captures.iter_rows(tmp_path))
    else:
        got = run_hook(tmp_path, outs, params, tenant=tenant, tenants=["a"])
    assert got == []


def test_the_buffer_is_bounded(tmp_path, monkeypatch):
    monkeypatch.setattr(capture, "MAX_PENDING", 3)
    cap = capture.Capture(store(tmp_path, Clock()), None)
    for r in rows(5, T0):
        cap.record(r)
    cap.flush()
    assert [r["id"] for r in captures.iter_rows(tmp_path)] == ["r0", "r1", "r2"]


def test_the_row_is_a_corpus_round_row(tmp_path):
    from dynamo_spec.training.corpus import ROW_KEYS

    row = capture.make_row(row_id="x", context=capture.RequestContext("chat", None), when=1.0, prompt_ids=[1],
                           answer_ids=[2], sampling={"temperature": None}, finish_reason="stop", acceptance=None)
    assert set(ROW_KEYS) <= set(row) and row["temperature"] == 0.0
    assert json.loads(json.dumps(row)) == row
