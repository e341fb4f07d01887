"""Start a real `dynamo-spec serve` process for tests and stop it cleanly."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import requests
import yaml

from dynamo_spec.bench.managed_server import ManagedServer, free_port


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


class ServerProcess(ManagedServer):
    """`python -m dynamo_spec serve` in its own process group, on a free port; on stop,
    asserts that SIGTERM took the engine processes with it."""

    def __init__(self, config: dict[str, Any], workdir: Path, *, extra_args: list[str] = (), env: dict | None = None):
        self.port = free_port()
        self.config_path = workdir / f"server-{self.port}.yaml"
        self.config_path.write_text(yaml.safe_dump(config))
        argv = [sys.executable, "-m", "dynamo_spec", "serve", "--config", str(self.config_path),
                "--server.port", str(self.port), *extra_args]
        super().__init__(argv, self.port, workdir / f"server-{self.port}.log", env=env)

    def start(self, timeout: float = 600) -> ServerProcess:
        # Returns at readiness; the cap is for a start that never gets there. The suite runs two
        # modules at a time on two cores, where a compiled start beside another can take minutes.
        super().start(timeout)
        return self

    def stop(self, timeout: float = 30) -> int | None:
        """SIGTERM the server; when it has exited, none of its processes may be left."""
        if self.proc is None:
            return None
        self.terminate(timeout)
        leftovers = _group_members(self.proc.pid)
        returncode = super().stop(timeout)  # closes the log; SIGKILLs whatever is left
        assert not leftovers, f"processes left after SIGTERM: {leftovers}\n{self.log()[-3000:]}"
        return returncode

    def metrics(self) -> str:
        return requests.get(self.url + "/metrics", timeout=10).text
