"""The engine processes' environment (dynamo_spec.engine.process_env): one definition for the server,
the offline engines of the training tools, the launch script, the tests and the benchmarks."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dynamo_spec.engine import process_env
from dynamo_spec.engine.cpu_threads import VAR as THREADS_VAR
from dynamo_spec.engine.host import detect_host

pytestmark = pytest.mark.unit


def test_vllm_dirs_creates_one_folder_per_writable_place(tmp_path):
    env = process_env.vllm_dirs(tmp_path)
    assert set(process_env.DIRS) <= set(env) and env["VLLM_NO_USAGE_STATS"] == "1"
    assert all((tmp_path / sub).is_dir() for sub in process_env.DIRS.values())
    assert "HF_HUB_OFFLINE" not in env and process_env.vllm_dirs(tmp_path, offline=True)["HF_HUB_OFFLINE"] == "1"


def test_shell_exports_keep_what_is_set_and_quote_paths(tmp_path):
    root = tmp_path / "a b"
    environ = {k: v for k, v in os.environ.items() if k not in process_env.DIRS}
    out = subprocess.run([sys.executable, "-m", "dynamo_spec.engine.process_env", str(root)], check=True,
                         capture_output=True, text=True, env={**environ, "VLLM_CACHE_ROOT": "/mine"}).stdout
    assert "VLLM_CACHE_ROOT" not in out
    assert f"export VLLM_RPC_BASE_PATH='{root / 'rpc'}'" in out.splitlines()
    bash = shutil.which("bash") or "/bin/bash"
    shown = subprocess.run([bash, "-c", f'{out}\necho "$TORCHINDUCTOR_CACHE_DIR"'], check=True, capture_output=True,
                           text=True).stdout.strip()
    assert shown == str(root / "inductor")


def test_temporary_dirs_restore_the_environment_with_what_the_block_added():
    before = dict(os.environ)
    with process_env.temporary_vllm_dirs() as env:
        assert os.environ["VLLM_CACHE_ROOT"] == env["VLLM_CACHE_ROOT"]
        os.environ["LD_PRELOAD"] = "/x/libtcmalloc_minimal.so.4"
    assert dict(os.environ) == before


def test_temporary_dirs_keep_a_cache_root_already_set(tmp_path, monkeypatch):
    """vLLM's model-info cache (VLLM_CACHE_ROOT/modelinfos) is shared with the engines started before:
    a fresh one would cost a subprocess importing each model class at every start."""
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "cache"))
    monkeypatch.delenv("VLLM_RPC_BASE_PATH", raising=False)
    with process_env.temporary_vllm_dirs() as env:
        assert os.environ["VLLM_CACHE_ROOT"] == env["VLLM_CACHE_ROOT"] == str(tmp_path / "cache")
        rpc = Path(os.environ["VLLM_RPC_BASE_PATH"])
        assert rpc.is_dir() and tmp_path not in rpc.parents  # what was not set still gets the temp folder
    assert "VLLM_RPC_BASE_PATH" not in os.environ and not rpc.exists()


def test_prepare_sets_threads_preloads_and_spawn_for_the_engine_processes(tmp_path):
    environ: dict[str, str] = {}
    process_env.prepare_engine_processes(environ=environ)
    assert environ["VLLM_WORKER_MULTIPROC_METHOD"] == "spawn"
    if detect_host().on_cpu:
        wanted = process_env.cpu_preload_libraries()
        assert environ.get("LD_PRELOAD", "").split(":")[: len(wanted)] == wanted
        if len(os.sched_getaffinity(0)) <= 4:
            assert environ[THREADS_VAR]
    off: dict[str, str] = {}
    process_env.prepare_engine_processes(environ=off, cpu_preload=False)
    assert "LD_PRELOAD" not in off


def test_serve_by_hand_uses_the_launch_scripts_runtime_folder(repo_root):
    """`dynamo-spec serve` started by hand compiles into the folder the launch script uses
    (launch/env.sh: vllm_runtime_env), not vLLM's default cache; variables already set are kept."""
    from dynamo_spec.engine.process_env import checkout_runtime_dirs

    environ = {"TORCHINDUCTOR_CACHE_DIR": "/elsewhere"}
    root = checkout_runtime_dirs(environ)
    assert root == repo_root / ".cache" / "runtime"
    assert environ["VLLM_CACHE_ROOT"] == str(root / "vllm") and environ["TORCHINDUCTOR_CACHE_DIR"] == "/elsewhere"
    assert '"$DYNAMO_SPEC_ROOT/.cache/runtime"' in (repo_root / "launch/env.sh").read_text()
