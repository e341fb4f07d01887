"""vLLM resolves its platform through our plugin entry point (dynamo_spec/zen_platform.py), in a
fresh process as vLLM's own processes do: the Zen CPU platform on an AMD CPU with zentorch, vLLM's
own choice everywhere else and when turned off."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from dynamo_spec import zen_platform

pytestmark = pytest.mark.integration

PROBE = "from vllm.platforms import current_platform; print('PLATFORM', type(current_platform).__name__)"


def resolved(**env: str) -> str:
    environ = {k: v for k, v in os.environ.items() if k not in ("DYNAMO_SPEC_ZENTORCH", "VLLM_TARGET_DEVICE")}
    proc = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300,
                          env={**environ, **env})
    lines = [line for line in proc.stdout.splitlines() if line.startswith("PLATFORM ")]
    assert proc.returncode == 0 and lines, (proc.stdout + proc.stderr)[-4000:]
    return lines[-1].split()[1]


def vllm_own_choice() -> str | None:
    from vllm.platforms import cpu_platform_plugin

    return cpu_platform_plugin()


def test_the_platform_vllm_resolves_is_the_plugins_choice():
    own = vllm_own_choice()
    forced = zen_platform.choose(own, zen_platform.is_amd_cpu(), {})
    expected = (forced or own or "").rsplit(".", 1)[-1]
    if not expected:
        pytest.skip("not vLLM's CPU build: the plugin names nothing and vLLM's GPU detection decides")
    assert resolved() == expected


def test_turned_off_vllm_keeps_its_own_choice():
    own = vllm_own_choice()
    if own is None:
        pytest.skip("not vLLM's CPU build")
    assert resolved(DYNAMO_SPEC_ZENTORCH="0") == own.rsplit(".", 1)[-1]
