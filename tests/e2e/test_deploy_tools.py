"""deploy/ checked by the tools that run it: promtool (the Debian package prometheus) and
docker-compose; tests/run.sh installs both."""

import shutil
import subprocess

import pytest

from tests.promql import ALERTS, ALERTS_TEST, COMPOSE, PROMETHEUS_CONFIG, REPO

pytestmark = pytest.mark.e2e


def promtool(*args: str) -> subprocess.CompletedProcess:
    binary = shutil.which("promtool")
    assert binary, "promtool not found: install the Debian package prometheus (tests/run.sh does)"
    return subprocess.run([binary, *args], cwd=REPO, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize(
    "args",
    [
        ("check", "config", str(PROMETHEUS_CONFIG)),
        ("check", "rules", str(ALERTS)),
        ("test", "rules", str(ALERTS_TEST)),
    ],
    ids=["check-config", "check-rules", "test-rules"],
)
def test_promtool(args):
    result = promtool(*args)
    assert result.returncode == 0, result.stdout + result.stderr


def test_compose_file_is_valid():
    binary = shutil.which("docker-compose")
    if binary is None:
        pytest.skip("docker-compose binary not installed (Debian package docker-compose)")
    result = subprocess.run(
        [binary, "-f", str(COMPOSE), "config", "-q"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr
