"""The launch script end to end: starts, answers, and leaves nothing behind."""

from __future__ import annotations

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

from support.server import free_port, tiny_config

pytestmark = pytest.mark.e2e


def launch(repo_root: Path, config: Path, port: int, log: Path) -> subprocess.Popen:
    env = {**os.environ, "DYNAMO_SPEC_VENV": sys.prefix, "DYNAMO_SPEC_DEVICE": "cpu"}
    return subprocess.Popen(
        ["bash", str(repo_root / "launch/agg_spec_decoding.sh"), "--config", str(config), "--server.port", str(port)],
        stdout=log.open("w"), stderr=subprocess.STDOUT, env=env, start_new_session=True,
    )


def wait_ready(proc: subprocess.Popen, log: Path, timeout: float = 300) -> str:
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


@pytest.fixture
def tiny_yaml(tiny_models, tmp_path) -> Path:
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(tiny_config(tiny_models["target"], tiny_models["draft"])))
    return path


def test_launch_answers_and_sigterm_leaves_no_process(repo_root, tiny_yaml, tmp_path):
    port = free_port()
    log = tmp_path / "launch.log"
    proc = launch(repo_root, tiny_yaml, port, log)
    try:
        text = wait_ready(proc, log)
        # It printed a ready-to-paste curl line for this server; run it as printed.
        curl = next(line for line in text.splitlines() if line.startswith("curl http"))
        assert f"127.0.0.1:{port}/v1/chat/completions" in curl and '"model": "tiny"' in curl
        answer = subprocess.run(curl.replace("curl ", "curl -sf ", 1), shell=True, capture_output=True, text=True,
                                timeout=120)
        assert answer.returncode == 0 and '"choices"' in answer.stdout
        spawned = descendants(proc.pid)
        assert len(spawned) >= 3  # serve + EngineCore + worker
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=60)
    assert code == 143
    time.sleep(1)
    alive = [p for p in spawned if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert alive == [], [p.cmdline() for p in alive]
    text = log.read_text()
    assert "Stopping the server" in text
    assert "Killing what is left" not in text  # the server shut its engine down by itself


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
