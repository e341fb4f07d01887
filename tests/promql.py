"""PromQL of deploy/ (dashboard, alerts) and a real Prometheus server for tests."""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
PROMETHEUS_CONFIG = REPO / "deploy" / "prometheus" / "prometheus.yml"
ALERTS = REPO / "deploy" / "prometheus" / "alerts.yml"
DASHBOARD = REPO / "deploy" / "grafana" / "dashboards" / "speculative-decoding.json"
ALERTS_TEST = REPO / "deploy" / "prometheus" / "alerts_test.yml"
COMPOSE = REPO / "deploy" / "docker-compose.yml"

_VARIABLE = re.compile(r"\$(?:\{([A-Za-z_]\w*)\}|([A-Za-z_]\w*))")


def _panels(panels: list[dict]) -> list[dict]:
    """Panels in order, with the panels of (collapsed) rows flattened in."""
    flat = []
    for panel in panels:
        flat.append(panel)
        flat.extend(_panels(panel.get("panels", [])))
    return flat


def dashboard_queries(
    path: Path = DASHBOARD, rate_interval: str = "1m", model: str = ".*"
) -> list[tuple[str, str]]:
    """(panel title, expr) of every target, Grafana variables substituted.

    `$__rate_interval` and `$__interval` become `rate_interval`, `$model` becomes
    `model` (a regex, as the dashboard matches it with `=~`). Any other variable
    raises ValueError.
    """
    values = {"__rate_interval": rate_interval, "__interval": rate_interval, "model": model}

    def substitute(match: re.Match) -> str:
        name = match.group(1) or match.group(2)
        if name not in values:
            raise ValueError(f"unknown Grafana variable ${name} in {path}")
        return values[name]

    dashboard = json.loads(Path(path).read_text())
    return [
        (panel.get("title", ""), _VARIABLE.sub(substitute, target["expr"]))
        for panel in _panels(dashboard.get("panels", []))
        for target in panel.get("targets", [])
        if target.get("expr")
    ]


def alert_rules(path: Path = ALERTS) -> list[tuple[str, str]]:
    """(alert name, expr) of every alerting rule of a Prometheus rule file."""
    groups = yaml.safe_load(Path(path).read_text())["groups"]
    return [
        (rule["alert"], rule["expr"])
        for group in groups
        for rule in group["rules"]
        if "alert" in rule
    ]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class PrometheusServer:
    """A real Prometheus scraping `target` with the repo's config and alert rules.

    The config is the repo's, with the scrape target of every job replaced by
    `target`, scrape and evaluation intervals of 1s, and its rule files made
    absolute. Use as a context manager; the process is stopped on exit.
    """

    def __init__(self, target: str, config: Path = PROMETHEUS_CONFIG, startup_timeout: float = 30):
        self.target = target
        self.config = Path(config)
        self.startup_timeout = startup_timeout
        self.url = ""
        self._tmp: tempfile.TemporaryDirectory | None = None
        self._process: subprocess.Popen | None = None
        self._log = None

    def _write_config(self, directory: Path) -> Path:
        config = yaml.safe_load(self.config.read_text())
        config.setdefault("global", {}).update(scrape_interval="1s", evaluation_interval="1s")
        config["rule_files"] = [
            str((self.config.parent / rule).resolve()) for rule in config.get("rule_files", [])
        ]
        for job in config["scrape_configs"]:
            job["static_configs"] = [{"targets": [self.target]}]
        path = directory / "prometheus.yml"
        path.write_text(yaml.safe_dump(config))
        return path

    def __enter__(self) -> PrometheusServer:
        binary = shutil.which("prometheus") or "/usr/bin/prometheus"
        self._tmp = tempfile.TemporaryDirectory(prefix="prometheus-")
        directory = Path(self._tmp.name)
        address = f"127.0.0.1:{_free_port()}"
        self.url = f"http://{address}"
        self._log = open(directory / "prometheus.log", "wb")
        try:
            self._process = subprocess.Popen(
                [
                    binary,
                    f"--config.file={self._write_config(directory)}",
                    f"--storage.tsdb.path={directory / 'data'}",
                    f"--web.listen-address={address}",
                    "--web.enable-lifecycle",
                ],
                stdout=self._log,
                stderr=subprocess.STDOUT,
            )
            self._wait_ready()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise RuntimeError(
                    f"prometheus exited with {self._process.returncode}:\n{self.log()}"
                )
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=1) as response:
                    if response.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"prometheus not ready after {self.startup_timeout}s:\n{self.log()}")

    def __exit__(self, *exc_info) -> None:
        if self._process is not None:
            self._process.terminate()
            try:
                self._process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
            self._process = None
        if self._tmp is not None:
            self._log.close()
            self._tmp.cleanup()
            self._tmp = None

    def log(self) -> str:
        """Prometheus's own log so far."""
        self._log.flush()
        return (Path(self._tmp.name) / "prometheus.log").read_text(errors="replace")

    def api(self, endpoint: str, **params: str):
        """`data` of GET /api/v1/<endpoint>; raises RuntimeError on an error status."""
        url = f"{self.url}/api/v1/{endpoint}?{urllib.parse.urlencode(params)}"
        try:
            with urllib.request.urlopen(url, timeout=10) as response:
                body = json.load(response)
        except urllib.error.HTTPError as error:
            body = json.load(error)
        if body.get("status") != "success":
            raise RuntimeError(f"{endpoint} {params}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query(self, expr: str) -> list[dict]:
        """Result of an instant query: dicts with `metric` and `value` (vector) or one scalar."""
        data = self.api("query", query=expr)
        result = data["result"]
        return result if data["resultType"] in ("vector", "matrix") else [{"value": result}]

    def wait_for_scrapes(self, n: int = 2, timeout: float = 30) -> None:
        """Wait until the target has been scraped successfully at least `n` times."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            result = self.query('sum_over_time(up{job="dynamo-spec"}[1h])')
            if result and float(result[0]["value"][1]) >= n:
                return
            time.sleep(0.2)
        targets = [
            (t["scrapeUrl"], t["health"], t["lastError"])
            for t in self.api("targets")["activeTargets"]
        ]
        raise TimeoutError(f"fewer than {n} successful scrapes after {timeout}s: {targets}")
