"""Shared fixtures: vLLM kept inside a temp folder and offline; tiny models built once."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

from dynamo_spec.engine.process_env import vllm_dirs
from support.cores import every_core, take_own_share
from support.tiny_models import build_fixture_set


def pytest_configure(config: pytest.Config) -> None:
    # Before any engine starts: vLLM's caches, sockets and configs go to a temp
    # folder (inherited by the engine's spawned processes and by servers we start).
    root = Path(tempfile.mkdtemp(prefix="dynamo-spec-tests-"))
    os.environ.update(vllm_dirs(root, offline=True))
    share_model_infos(Path(os.environ["VLLM_CACHE_ROOT"]))
    config.add_cleanup(lambda: shutil.rmtree(root, ignore_errors=True))
    take_own_share()  # before any engine starts: what the worker starts inherits it


# What vLLM learns of a model class by importing it in a subprocess (8-9 s per architecture, two per
# speculative engine, at every start that misses): keyed by vLLM's own source, written atomically, so
# one folder serves every worker, the serial run and the launch script (the checkout's runtime cache).
MODEL_INFOS = Path(__file__).resolve().parent.parent / ".cache" / "runtime" / "vllm" / "modelinfos"


def share_model_infos(cache_root: Path) -> None:
    MODEL_INFOS.mkdir(parents=True, exist_ok=True)
    (cache_root / "modelinfos").symlink_to(MODEL_INFOS, target_is_directory=True)


@pytest.fixture(scope="module")
def on_every_core():
    """For a module that needs the whole machine (two tensor-parallel ranks, a core each): what
    it starts runs on every core while it runs, beside the other worker's module."""
    own = os.sched_getaffinity(0)
    os.sched_setaffinity(0, every_core())
    yield
    os.sched_setaffinity(0, own)


TIERS = ("unit", "integration", "e2e")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Folder = tier: a test under tests/<tier>/ carries that tier's marker and no other."""
    here = Path(__file__).resolve().parent
    wrong = []
    for item in items:
        folder = Path(item.path).resolve().relative_to(here).parts[0]
        marks = {tier for tier in TIERS if item.get_closest_marker(tier)}
        if folder in TIERS and marks != {folder}:
            wrong.append(f"{item.nodeid}: in tests/{folder}/ but marked {sorted(marks) or 'with no tier'}")
    if wrong:
        raise pytest.UsageError("tests in the wrong tier folder:\n" + "\n".join(wrong))
    # Longest modules first: with pytest-xdist (bash tests/run.sh -n 2 --dist loadfile
    # --no-loadscope-reorder) whole modules go to the two workers in this order, so the long ones
    # do not end the run alone. Order within a module kept.
    first_seen: dict[str, int] = {}
    for item in items:
        first_seen.setdefault(_module(item, here), len(first_seen))
    items.sort(key=lambda item: (LONGEST_FIRST.index(m) if (m := _module(item, here)) in LONGEST_FIRST
                                 else len(LONGEST_FIRST) + first_seen[m]))


# By their durations in CI (`--durations`, a 2-core host, each worker on one core); a module not
# listed runs after these. Tests marked serial run after the workers, alone.
LONGEST_FIRST = [
    "integration/test_bench.py", "integration/test_lifecycle.py", "integration/test_compile_cache.py",
    "integration/test_bench_one_at_a_time.py", "e2e/test_launch.py", "integration/test_tensor_parallel.py",
    "integration/test_learning_auto.py", "integration/test_draft_budget.py", "integration/test_fuzz.py",
    "integration/test_api.py", "integration/test_zen_platform.py", "integration/test_speculation_guard.py",
    "integration/test_acceptance_metrics.py", "integration/test_operate.py", "integration/test_slow_readers.py",
    "e2e/test_ray_cluster.py", "integration/test_eval_draft.py", "integration/test_zero_draft_steps.py",
    "integration/test_learn_draft.py", "integration/test_verify_batching.py", "e2e/test_prometheus.py",
    "integration/test_per_engine_switches.py", "integration/test_draft_swap.py", "integration/test_fixtures.py",
    "integration/test_capture.py", "integration/test_suffix_mix_server.py", "integration/test_draft_caps.py",
    "integration/test_schedule.py", "integration/test_suffix_mix.py",
    "integration/test_default_model.py", "integration/test_corpus.py", "integration/test_verify.py",
    "integration/test_sampling_eval.py", "integration/test_draft_penalties.py", "integration/test_dry.py",
    "integration/test_sampling_with_speculation.py", "integration/test_seeded_sampling.py",
    "integration/test_prometheus_helper.py", "integration/test_train_data.py",
]


def _module(item: pytest.Item, here: Path) -> str:
    return Path(item.path).resolve().relative_to(here).as_posix()


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tiny target/draft pairs; see support/tiny_models.py."""
    cache = os.environ.get("DYNAMO_SPEC_TEST_MODELS")
    root = Path(cache) if cache else tmp_path_factory.mktemp("tiny-models")
    return build_fixture_set(root)


@pytest.fixture
def engines_in_process():
    """Offline vLLM engines the test builds run in this process (support/in_process.py)."""
    from support.in_process import in_process_engines

    with in_process_engines():
        yield


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return Path(__file__).resolve().parent.parent


@pytest.fixture
def write_config(tmp_path: Path):
    """Write a YAML config into the test's temp folder and return its path."""
    import yaml

    def write(data: dict, name: str = "config.yaml") -> Path:
        path = tmp_path / name
        path.write_text(yaml.safe_dump(data, sort_keys=False))
        return path

    return write
