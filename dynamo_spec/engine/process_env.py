"""The environment vLLM's engine processes start with, in one place.

Every engine this project starts, the server's ``AsyncLLM`` and the offline ``vllm.LLM`` behind
``verify`` and ``eval-draft`` alike, gets it from ``prepare_engine_processes`` just before the
engine is created (its processes inherit ``os.environ``), so that they all run under the
same conditions:

- the CPU thread binding (``cpu_threads``);
- on CPU, Intel OpenMP and tcmalloc in ``LD_PRELOAD`` where installed (``engine.cpu_preload``):
  vLLM's CPU worker warns that speculative decoding without Intel OpenMP preloaded loses
  significant performance, and that tcmalloc is not preloaded. The API process itself is not
  affected (``LD_PRELOAD`` only acts on processes started after it is set);
- the ``spawn`` start method (vLLM's CPU platform forces it; on GPU, forking beside a running
  event loop is unsafe).

``vllm_dirs`` keeps vLLM's caches, config and sockets inside one folder (vLLM otherwise writes
to ``~/.cache/vllm``, ``~/.config/vllm`` and leaves ZMQ sockets in /tmp); the launch script,
the tests, the benchmarks and the training tools all use it (``python -m
dynamo_spec.engine.process_env DIR`` prints it as shell exports).
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import logging
import os
import shlex
import sys
from collections.abc import Iterator, Mapping, MutableMapping
from pathlib import Path

from dynamo_spec.engine.cpu_threads import default_cpu_thread_binding
from dynamo_spec.engine.host import detect_host

logger = logging.getLogger("dynamo_spec.engine.process_env")

# vLLM's and torch's writable places -> their sub-folder of one root.
DIRS = {"VLLM_CACHE_ROOT": "vllm", "VLLM_CONFIG_ROOT": "vllm-config", "VLLM_RPC_BASE_PATH": "rpc",
        "TORCHINDUCTOR_CACHE_DIR": "inductor"}
QUIET = {"VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "TOKENIZERS_PARALLELISM": "false"}
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def vllm_dirs(root: Path, *, offline: bool = False) -> dict[str, str]:
    """Variables that keep vLLM's caches, config and sockets under `root` (created) and its usage
    reporting off; with `offline`, no Hugging Face Hub access either (local models only)."""
    env = {}
    for var, sub in DIRS.items():
        (Path(root) / sub).mkdir(parents=True, exist_ok=True)
        env[var] = str(Path(root) / sub)
    return {**env, **QUIET, **(OFFLINE if offline else {})}


def checkout_runtime_dirs(environ: MutableMapping[str, str]) -> Path | None:
    """`vllm_dirs` in ``<checkout>/.cache/runtime``, the folder the launch script uses, for the
    variables not set already: ``dynamo-spec serve`` started by hand then finds the compiled
    graphs the script's starts left (and the other way round). Nothing outside a checkout."""
    checkout = Path(__file__).resolve().parents[2]
    if not (checkout / "pyproject.toml").is_file() or not (checkout / "launch").is_dir():
        return None
    root = checkout / ".cache" / "runtime"
    for var, value in vllm_dirs(root).items():
        environ.setdefault(var, value)
    return root


@contextlib.contextmanager
def temporary_vllm_dirs(*, offline: bool = True) -> Iterator[dict[str, str]]:
    """`vllm_dirs` in a temp folder for the block, for the variables not set already; ``os.environ``
    as it was is restored after (with whatever the block added, such as `prepare_engine_processes`'
    choices).

    A ``VLLM_CACHE_ROOT`` already set (the launch script's, the tests', or the checkout's runtime
    folder: ``checkout_runtime_dirs``) is kept: vLLM caches there what it learns of a model class by
    importing it in a subprocess (``modelinfos``, keyed by the class's source), about 5-10 s per
    architecture at every start that misses it, two per speculative engine."""
    import tempfile

    saved = dict(os.environ)
    with tempfile.TemporaryDirectory(prefix="dynamo-spec-vllm-") as tmp:
        env = {var: value for var, value in vllm_dirs(Path(tmp), offline=offline).items()
               if var not in DIRS or not os.environ.get(var)}
        os.environ.update(env)
        try:
            yield {**env, **{var: os.environ[var] for var in DIRS}}
        finally:
            os.environ.clear()
            os.environ.update(saved)


def prepare_engine_processes(*, ranks: int = 1, cpu_preload: bool = True,
                             environ: MutableMapping[str, str] | None = None) -> None:
    """Set what the engine's processes inherit (see the module docstring); log what was chosen.

    `ranks`: tensor x pipeline parallel ranks, one process each (their cores are split)."""
    environ = os.environ if environ is None else environ
    host = detect_host()
    default_cpu_thread_binding(environ, is_cpu=host.on_cpu, ranks=ranks)
    if host.on_cpu and cpu_preload:
        wanted = cpu_preload_libraries()
        added = apply_cpu_preload(environ, wanted)
        if added:
            logger.info("LD_PRELOAD for the engine's processes: %s (engine.cpu_preload)", ":".join(added))
        if set(wanted) - set(added):
            logger.info("engine.cpu_preload: kept what LD_PRELOAD already has (%s) instead of %s",
                        environ.get("LD_PRELOAD", ""), ":".join(sorted(set(wanted) - set(added))))
    environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")


# --- preloads of vLLM's engine processes on CPU ---------------------------------------
# Intel OpenMP from the PyPI package intel-openmp (in this environment's lib/), tcmalloc from
# Debian's libtcmalloc-minimal4.
TCMALLOC_CANDIDATES = ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4", "/usr/lib/*/libtcmalloc_minimal.so.4",
                       "/usr/lib64/libtcmalloc_minimal.so.4")
OPENMP_RUNTIMES = ("libiomp", "libgomp", "libomp")


def cpu_preload_libraries(prefix: str | None = None) -> list[str]:
    """Intel OpenMP and tcmalloc shared libraries found on this machine (either may be missing)."""
    found: list[str] = []
    iomp = Path(prefix or sys.prefix) / "lib" / "libiomp5.so"
    if iomp.is_file():
        found.append(str(iomp))
    for pattern in TCMALLOC_CANDIDATES:
        hits = sorted(glob.glob(pattern))
        if hits:
            found.append(hits[0])
            break
    return found


def _is_openmp(path: str) -> bool:
    return Path(path).name.startswith(OPENMP_RUNTIMES)


def apply_cpu_preload(environ: MutableMapping[str, str], libraries: list[str]) -> list[str]:
    """Prepend `libraries` not yet in LD_PRELOAD; return those added.

    What is already preloaded wins: the same library, and for OpenMP any runtime, since
    vLLM refuses two of them (an assertion in its OMPProcessManager fails the engine's
    start). A process that ran a vLLM engine itself has PyTorch's libgomp there: vLLM's
    CPU platform adds it to its own environment, which children inherit.
    """
    current = environ.get("LD_PRELOAD", "")
    present = [p for p in current.replace(" ", ":").split(":") if p]
    names = {Path(p).name.split(".so")[0] for p in present}
    has_openmp = any(_is_openmp(p) for p in present)
    added = [lib for lib in libraries
             if Path(lib).name.split(".so")[0] not in names and not (has_openmp and _is_openmp(lib))]
    if added:
        environ["LD_PRELOAD"] = ":".join([*added, *([current] if current else [])])
    return added


def shell_exports(env: Mapping[str, str], environ: Mapping[str, str]) -> str:
    """``export`` lines for the variables of `env` that `environ` does not set already."""
    return "".join(f"export {k}={shlex.quote(v)}\n" for k, v in env.items() if not environ.get(k))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dynamo_spec.engine.process_env",
                                     description="print vllm_dirs(DIR) as shell exports (variables already set are kept)")
    parser.add_argument("root", type=Path)
    parser.add_argument("--offline", action="store_true", help="also keep the Hugging Face Hub off")
    args = parser.parse_args(argv)
    sys.stdout.write(shell_exports(vllm_dirs(args.root, offline=args.offline), os.environ))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
