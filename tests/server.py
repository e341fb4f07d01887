"""Start a real `dynamo-spec serve` process for tests and stop it cleanly."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import requests
import yaml

from dynamo_spec.bench.server import free_port


def tiny_config(target: Path, draft: Path | None, *, k: int = 3, **sections: dict[str, Any]) -> dict[str, Any]:
    """A config for the tiny fixtures (CPU settings from the notes)."""
    config: dict[str, Any] = {
        "server": {"host": "127.0.0.1", "served_model_name": "tiny"},
        "engine": {
            "model": str(target), "dtype": "bfloat16", "max_model_len": 512,
            "kv_cache_memory_bytes": "256MiB", "enforce_eager": True,
        },
        "speculative": (
            {"method": "eagle3", "model": str(draft), "num_speculative_tokens": k}
            if draft is not None else {"enabled": False}
        ),
    }
    for name, values in sections.items():
        config.setdefault(name, {}).update(values)
    return config


def _group_members(pgid: int) -> list[str]:
    """Live processes of a process group (the server and what it spawned)."""
    import psutil

    members = []
    for proc in psutil.process_iter(["pid", "name", "status"]):
        try:
            if os.getpgid(proc.pid) == pgid and proc.info["status"] != psutil.STATUS_ZOMBIE:
                members.append(f"{proc.pid} {proc.info['name']}")
        except (ProcessLookupError, psutil.Error):
            pass
    return members


class ServerProcess:
    """`python -m dynamo_spec serve` in its own process group, on a free port."""

    def __init__(self, config: dict[str, Any], workdir: Path, *, extra_args: list[str] = (), env: dict | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.config_path = workdir / f"server-{self.port}.yaml"
        self.config_path.write_text(yaml.safe_dump(config))
        self.log_path = workdir / f"server-{self.port}.log"
        self.argv = [sys.executable, "-m", "dynamo_spec", "serve", "--config", str(self.config_path),
                     "--server.port", str(self.port), *extra_args]
        self.env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 240) -> ServerProcess:
        self._log = self.log_path.open("w")
        self.proc = subprocess.Popen(self.argv, stdout=self._log, stderr=subprocess.STDOUT, env=self.env,
                                     start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()[-4000:]}")
            try:
                if requests.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except requests.ConnectionError:
                pass
            time.sleep(0.5)
        self.stop()
        raise TimeoutError(f"server not ready after {timeout} s:\n{self.log()[-4000:]}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, timeout: float = 30) -> int | None:
        """SIGTERM the server; it must exit and take its engine processes with it."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        deadline = time.monotonic() + 5  # let helper processes (e.g. the resource tracker) exit
        while (leftovers := _group_members(self.proc.pid)) and time.monotonic() < deadline:
            time.sleep(0.2)
        if leftovers:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self._log.close()
        assert not leftovers, f"processes left after SIGTERM: {leftovers}\n{self.log()[-3000:]}"
        return self.proc.returncode

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def metrics(self) -> str:
        return requests.get(self.url + "/metrics", timeout=10).text
