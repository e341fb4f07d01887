"""The launch script end to end: starts, answers, and leaves nothing behind."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import requests
import yaml

from support.processes import Watch
from support.server_process import free_port, tiny_config

pytestmark = pytest.mark.e2e


def launch(repo_root: Path, config: Path, port: int, log: Path, venv: str = sys.prefix) -> subprocess.Popen:
    env = {**os.environ, "DYNAMO_SPEC_VENV": venv, "DYNAMO_SPEC_DEVICE": "cpu"}
    return subprocess.Popen(
        ["bash", str(repo_root / "launch/agg_spec_decoding.sh"), "--config", str(config), "--server.port", str(port)],
        stdout=log.open("w"), stderr=subprocess.STDOUT, env=env, start_new_session=True,
    )


def wait_ready(proc: subprocess.Popen, log: Path, timeout: float = 600) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = log.read_text(errors="replace")
        if "curl http" in text:
            return text
        assert proc.poll() is None, f"launch script exited with {proc.returncode}:\n{text[-4000:]}"
        time.sleep(0.5)
    raise TimeoutError(log.read_text()[-4000:])


def descendants(pid: int) -> list[psutil.Process]:
    return psutil.Process(pid).children(recursive=True)


def session(proc: psutil.Process) -> int | None:
    try:
        return os.getsid(proc.pid) if proc.is_running() else None
    except ProcessLookupError:
        return None


def orphans_are_reaped(timeout: float = 5.0) -> bool:
    """Whether this machine's init removes the zombies orphans leave (a container's PID 1 may not)."""
    pid = int(subprocess.run(["sh", "-c", "sleep 0 & echo $!"], capture_output=True, text=True, check=True).stdout)
    deadline = time.monotonic() + timeout
    while psutil.pid_exists(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not psutil.pid_exists(pid)


def left_behind(spawned: list[psutil.Process]) -> list[str]:
    """What is still there of `spawned` once the launch script has returned: nothing may be,
    not even a zombie (an orphan's: nothing waited for it), unless init never removes those."""
    left = []
    for proc in spawned:
        with contextlib.suppress(psutil.NoSuchProcess):
            if proc.is_running():  # the same process (pid and start time); a zombie too
                left.append((proc.status(), f"{proc.pid} {proc.status()} ppid={proc.ppid()} {proc.name()}"))
    if any(status == psutil.STATUS_ZOMBIE for status, _ in left) and not orphans_are_reaped():
        left = [(status, line) for status, line in left if status != psutil.STATUS_ZOMBIE]
    return [line for _, line in left]


def kill(spawned: list[psutil.Process]) -> None:
    """What a failing test found left behind: gone before the next test."""
    for proc in spawned:
        with contextlib.suppress(psutil.Error):
            proc.kill()


def sigterm_and_collect(proc: subprocess.Popen, watch: Watch, timeout: float = 120) -> tuple[int, list, list[str]]:
    """SIGTERM the launch script; (its exit status, what it started, what of that is left)."""
    proc.send_signal(signal.SIGTERM)
    code = proc.wait(timeout=timeout)
    spawned = watch.stop()
    left = left_behind(spawned)
    kill(spawned)
    return code, spawned, left


@pytest.fixture
def tiny_yaml(tiny_models, tmp_path) -> Path:
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(tiny_config(tiny_models["target"], tiny_models["draft"])))
    return path


def test_launch_answers_and_sigterm_leaves_no_process(repo_root, tiny_models, tmp_path):
    """The compiled engine (torch.compile, the CPU default's setting): the script prints a curl
    line that works as printed; after SIGTERM it returns only once nothing it started is left,
    not even multiprocessing's resource tracker (Python 3.11 never waits for it; the server
    does), and no shared memory its processes held (vLLM's queues, Intel OpenMP's files)."""
    config = tmp_path / "tiny-compiled.yaml"
    config.write_text(yaml.safe_dump(tiny_config(tiny_models["target"], tiny_models["draft"],
                                                 engine={"enforce_eager": False})))
    port = free_port()
    log = tmp_path / "launch.log"
    proc = launch(repo_root, config, port, log)
    watch = Watch(proc.pid)
    try:
        text = wait_ready(proc, log, timeout=900)  # a first compile: about 2 min alone on 2 cores, longer beside another module
        curl = next(line for line in text.splitlines() if line.startswith("curl http"))
        assert f"127.0.0.1:{port}/v1/chat/completions" in curl and '"model": "tiny"' in curl
        answer = subprocess.run(curl.replace("curl ", "curl -sf ", 1), shell=True, capture_output=True, text=True,
                                timeout=120)
        assert answer.returncode == 0 and '"choices"' in answer.stdout
    finally:
        code, spawned, left = sigterm_and_collect(proc, watch)
    assert code == 143
    assert len(spawned) >= 3  # serve + EngineCore + worker
    assert left == [], log.read_text()[-3000:]
    assert watch.shm_left() == [], log.read_text()[-3000:]
    text = log.read_text()
    assert "Stopping the server" in text
    assert "Killing what is left" not in text  # the server stopped its engine itself
    assert "force killing" not in text and "leaked shared_memory" not in text
    # the script's readiness polling stays out of the log (the probes' access lines are filtered);
    # the curl line's own request is there
    assert '"GET /health' not in text and '"POST /v1/chat/completions HTTP/1.1" 200' in text


# `serve` for the test below: starts helpers (two sleeps) in a session of their own, out of
# reach of its process group, answers /health and, on SIGTERM, exits without stopping them.
LEAVING_SERVER = """
import http.server, signal, subprocess, sys, threading
port = int(sys.argv[sys.argv.index("--server.port") + 1])
subprocess.Popen(["sh", "-c", "sleep 600 & exec sleep 601"], start_new_session=True)
signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGTERM])  # for sigwait, here and in the thread
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers()
    def log_message(self, *args):
        pass
server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Health)
threading.Thread(target=server.serve_forever, daemon=True).start()
signal.sigwait([signal.SIGTERM])
"""


def test_sigterm_stops_what_left_the_servers_session(repo_root, tiny_yaml, tmp_path):
    """What the server started is stopped even where it left the server's process group and
    session: here a server (a stand-in, no engine) that leaves such helpers behind."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    for stamp in Path(sys.prefix).glob(".dynamo-spec-*"):  # the environment is ready
        (venv / stamp.name).touch()
    (tmp_path / "leaving_server.py").write_text(LEAVING_SERVER)
    python = venv / "bin/python"
    python.write_text(f"""#!/bin/sh
[ "$1 $2 $3" = "-m dynamo_spec serve" ] && exec {sys.executable} {tmp_path / 'leaving_server.py'} "$@"
exec {sys.executable} "$@"
""")
    python.chmod(0o755)
    port = free_port()
    log = tmp_path / "launch.log"
    proc = launch(repo_root, tiny_yaml, port, log, venv=str(venv))
    watch = Watch(proc.pid)
    try:
        wait_ready(proc, log, timeout=120)
        def outside() -> list[str]:  # seen, running, in another session than the script's
            return [p.name() for p in list(watch.seen.values()) if session(p) not in (None, proc.pid)]
        deadline = time.monotonic() + 10
        while len(outside()) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert outside() == ["sleep", "sleep"]
    finally:
        code, spawned, left = sigterm_and_collect(proc, watch)
    assert code == 143
    assert left == [], log.read_text()[-3000:]
    assert "Killing what is left of the server: " in log.read_text()


def test_engine_death_turns_health_503_and_stops_the_server(repo_root, tiny_yaml, tmp_path):
    port = free_port()
    log = tmp_path / "launch.log"
    proc = launch(repo_root, tiny_yaml, port, log)
    try:
        wait_ready(proc, log)
        engine_core = [p for p in descendants(proc.pid) if "EngineCore" in " ".join(p.cmdline()) or p.name().startswith("VLLM")]
        if not engine_core:  # spawned processes are named by vLLM; fall back to the serve process' children
            serve = next(p for p in descendants(proc.pid) if "dynamo_spec" in " ".join(p.cmdline()))
            engine_core = serve.children()
        engine_core[0].kill()
        seen_503 = False
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if requests.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 503:
                    seen_503 = True
            except requests.ConnectionError:
                pass
            time.sleep(0.2)
        code = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=60)
    text = log.read_text()
    assert seen_503 or re.search(r"engine died", text), text[-3000:]
    assert code != 0
    assert "The engine died; shutting the server down." in text
