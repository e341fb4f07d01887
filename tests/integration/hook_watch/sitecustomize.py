"""Test helper, loaded by every Python process started with this folder on PYTHONPATH
(tests/integration/test_compile_cache.py): in vLLM's worker, count the calls of vLLM's
Python KV-cache write (a custom op the compiled graph calls 2 x layers times a step)
made from inside and from outside ``torch._dynamo.disable``'s wrapper (the wrapper a
fresh compile runs its graph in), into ``$DYNAMO_SPEC_HOOK_WATCH.<pid>``. Nothing happens
without that variable."""

from __future__ import annotations

import importlib.abc
import importlib.util
import json
import os
import sys

_MODULE = "vllm.model_executor.layers.attention.attention"


def _under_disable() -> bool:
    frame = sys._getframe(2)
    while frame is not None:
        code = frame.f_code
        if code.co_name == "_fn" and code.co_filename.endswith(os.path.join("_dynamo", "eval_frame.py")):
            return True
        frame = frame.f_back
    return False


def _watch(module) -> None:
    counts = {"under_disable": 0, "outside_disable": 0}
    path = f"{os.environ['DYNAMO_SPEC_HOOK_WATCH']}.{os.getpid()}"
    original = module.get_attention_context

    def get_attention_context(*args, **kwargs):
        counts["under_disable" if _under_disable() else "outside_disable"] += 1
        with open(path, "w") as f:
            json.dump(counts, f)
        return original(*args, **kwargs)

    module.get_attention_context = get_attention_context


class _AfterImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != _MODULE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        exec_module = spec.loader.exec_module

        def exec_and_watch(module):
            exec_module(module)
            _watch(module)

        spec.loader.exec_module = exec_and_watch
        return spec


if os.environ.get("DYNAMO_SPEC_HOOK_WATCH"):
    sys.meta_path.insert(0, _AfterImport())
