"""A `dynamo-spec serve` process (or any OpenAI server command) started, waited for and stopped."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import requests


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_command(config: Path, port: int, overrides: list[str] = ()) -> list[str]:
    return [sys.executable, "-m", "dynamo_spec", "serve", "--config", str(config), "--server.host", "127.0.0.1",
            "--server.port", str(port), *overrides]


def failure_summary(log: str, tail: int = 2000) -> str:
    """The lines that say why a server died (errors of any process, first ones first), then the log's tail.

    vLLM's root cause is logged by the worker or EngineCore well above the API process's
    final traceback, so the tail alone hides it.
    """
    markers = ("Error", "error:", "Exception", "SIGILL", "Illegal instruction", "Killed", "Segmentation fault")
    causes = [line for line in log.splitlines() if any(m in line for m in markers)]
    head = "\n".join(line[:400] for line in causes[:25])
    return f"error lines:\n{head}\n--- last lines:\n{log[-tail:]}"


class ManagedServer:
    """Runs `argv` in its own process group, logging to `log_path`; ready when /health answers 200."""

    def __init__(self, argv: list[str], port: int, log_path: Path, env: dict[str, str] | None = None):
        self.argv = argv
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        self.env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen | None = None
        self.ready_after: float | None = None

    def start(self, timeout: float = 600) -> ManagedServer:
        return self.launch().wait_ready(timeout)

    def launch(self) -> ManagedServer:
        """Start the process without waiting (the port answers /live before the engine is loaded)."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = self.log_path.open("w")
        self._launched_at = time.monotonic()
        self.proc = subprocess.Popen(self.argv, stdout=self._log, stderr=subprocess.STDOUT, env=self.env,
                                     start_new_session=True)
        return self

    def wait_ready(self, timeout: float = 600) -> ManagedServer:
        """Wait until /health answers 200; raise with the log's error lines if the process exits first."""
        while time.monotonic() - self._launched_at < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with status {self.proc.returncode}; see {self.log_path}\n"
                                   + failure_summary(self.log()))
            try:
                if requests.get(self.url + "/health", timeout=2).status_code == 200:
                    self.ready_after = time.monotonic() - self._launched_at
                    return self
            except requests.RequestException:
                pass
            time.sleep(0.5)
        self.stop()
        raise TimeoutError(f"server not ready after {timeout:.0f} s; see {self.log_path}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def terminate(self, timeout: float = 30) -> None:
        """SIGTERM the server and wait up to `timeout` seconds for it to exit."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout)

    def stop(self, timeout: float = 30) -> int | None:
        """SIGTERM, then SIGKILL the whole group if anything is left."""
        if self.proc is None:
            return None
        self.terminate(timeout)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # helpers (EngineCore, workers) left behind, if any
        self.proc.wait()
        self._log.close()
        return self.proc.returncode

    def __enter__(self) -> ManagedServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def server_rss(server: ManagedServer) -> int:
    """Resident memory of a server's processes (API server, EngineCore, workers), in bytes."""
    import psutil

    procs = [psutil.Process(server.proc.pid)]
    procs += procs[0].children(recursive=True)
    total = 0
    for proc in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            total += proc.memory_info().rss
    return total


def servers_that_fit(per_server: int, wanted: int, reserve: int = 2 << 30) -> int:
    """How many more servers of `per_server` bytes the free memory holds, keeping `reserve` free
    (at most `wanted`; 0: not one)."""
    import psutil

    available = psutil.virtual_memory().available
    return max(0, min(wanted, int((available - reserve) // (per_server * 1.15))))
