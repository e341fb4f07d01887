"""A compiled CPU engine's second start loads what the first compiled: dynamo_spec/vllm_patches/compile_cache.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dynamo_spec.engine.host import on_cpu

HOOKS = Path(__file__).parent / "hooks"

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(not on_cpu(), reason="the load failure it fixes is vLLM's CPU platform's")]


def start(spec: dict, cache: dict) -> tuple[dict, str]:
    proc = subprocess.run([sys.executable, "-m", "tests.integration.zero_draft_probe", json.dumps(spec)],
                          capture_output=True, text=True, timeout=600, env={**os.environ, **cache})
    log = proc.stdout + proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line.startswith("PROBE ")]
    assert proc.returncode == 0 and lines, log[-4000:]
    return json.loads(lines[-1][len("PROBE "):]), log


def test_second_start_loads_the_compiled_target_and_draft(tiny_models, tmp_path):
    """Two starts of a compiled speculative engine on one fresh compile cache: the first
    compiles and saves the target (backbone) and the draft (eagle_head); the second
    loads both instead of compiling again, runs them inside torch._dynamo.disable as the
    first start ran its fresh compile (without it the loaded model serves fewer tokens/s),
    and gives the same tokens."""
    cache = {"VLLM_CACHE_ROOT": str(tmp_path / "vllm"), "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"),
             # the worker in a process of its own, as in a server
             "VLLM_ENABLE_V1_MULTIPROCESSING": "1",
             "PYTHONPATH": os.pathsep.join([str(HOOKS), os.environ.get("PYTHONPATH", "")])}
    requests = [{"prompt": p, "max_tokens": 12} for p in ("The capital of France is", "def fibonacci(n):")]
    spec = {"target": str(tiny_models["target"]), "draft": str(tiny_models["draft"]), "k": 3,
            "compiled": True, "phases": [requests]}
    first, first_log = start(spec, {**cache, "DYNAMO_SPEC_HOOK_WATCH": str(tmp_path / "first")})
    second, second_log = start(spec, {**cache, "DYNAMO_SPEC_HOOK_WATCH": str(tmp_path / "second")})
    assert first_log.count("saved AOT compiled function") == 2, first_log[-4000:]
    assert "load failure" not in second_log, second_log[-4000:]
    assert second_log.count("Directly load AOT compilation") == 2, second_log[-4000:]
    assert second["phases"] == first["phases"]
    for run in ("first", "second"):
        counts = [json.loads(p.read_text()) for p in tmp_path.glob(f"{run}.*")]
        assert counts and sum(c["under_disable"] for c in counts) > 0, (run, counts)
        assert sum(c["outside_disable"] for c in counts) == 0, (run, counts)

    saved = [p for p in (tmp_path / "vllm").rglob("*") if p.is_file() and "torch_aot_compile" in p.parts]
    assert saved
    for path in saved:
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    third, third_log = start(spec, cache)
    assert third_log.count("Compiling model again due to a load failure") == 2, third_log[-4000:]
    assert third["phases"] == first["phases"]
