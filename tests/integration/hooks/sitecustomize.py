"""Test hooks, loaded by every Python process started with this folder on PYTHONPATH. Each is
off unless its variable is set:

* ``DYNAMO_SPEC_HOOK_WATCH=PATH`` (tests/integration/test_compile_cache.py): in vLLM's worker,
  count the calls of vLLM's Python KV-cache write (a custom op the compiled graph calls
  2 x layers times a step) made from inside and from outside ``torch._dynamo.disable``'s
  wrapper (the wrapper a fresh compile runs its graph in), into ``PATH.<pid>``.
* ``DYNAMO_SPEC_HOOK_REJECT=FILE`` (tests/integration/test_speculation_guard.py): once FILE
  exists, vLLM's model runner hands the scheduler draft token 1 wherever the draft proposed
  token 0, as if the draft had been swapped for one that the fixed target (which always
  emits token 0) rejects.
* ``DYNAMO_SPEC_HOOK_SLOW_EXIT=SECONDS`` (tests/integration/test_lifecycle.py): vLLM's worker
  process takes that long to exit, as a compiled worker's last garbage collection can on a
  busy CPU host.
"""

from __future__ import annotations

import atexit
import importlib.abc
import importlib.util
import json
import os
import sys
import time


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


def _reject(module) -> None:
    trigger = os.environ["DYNAMO_SPEC_HOOK_REJECT"]
    original = module.GPUModelRunner.take_draft_token_ids

    def take_draft_token_ids(self):
        drafts = original(self)
        if drafts is not None and os.path.exists(trigger):
            drafts.draft_token_ids = [[1 if t == 0 else t for t in ids] for ids in drafts.draft_token_ids]
        return drafts

    module.GPUModelRunner.take_draft_token_ids = take_draft_token_ids


def _slow_exit() -> None:
    import multiprocessing

    if multiprocessing.current_process().name.startswith("VllmWorker"):
        seconds = float(os.environ["DYNAMO_SPEC_HOOK_SLOW_EXIT"])
        print(f"hook_slow_exit: the worker exits in {seconds:g} s", file=sys.stderr, flush=True)
        time.sleep(seconds)
        print("hook_slow_exit: the worker exits now", file=sys.stderr, flush=True)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs ``patch`` on module ``name`` right after its first import."""

    def __init__(self, name: str, patch) -> None:
        self.name, self.patch = name, patch

    def find_spec(self, name, path, target=None):
        if name != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        exec_module = spec.loader.exec_module

        def exec_and_patch(module):
            exec_module(module)
            self.patch(module)

        spec.loader.exec_module = exec_and_patch
        return spec


if os.environ.get("DYNAMO_SPEC_HOOK_WATCH"):
    sys.meta_path.insert(0, _AfterImport("vllm.model_executor.layers.attention.attention", _watch))
if os.environ.get("DYNAMO_SPEC_HOOK_REJECT"):
    sys.meta_path.insert(0, _AfterImport("vllm.v1.worker.gpu_model_runner", _reject))
if os.environ.get("DYNAMO_SPEC_HOOK_SLOW_EXIT"):
    atexit.register(_slow_exit)
