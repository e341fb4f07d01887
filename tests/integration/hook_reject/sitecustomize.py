"""Test helper, loaded by every Python process started with this folder on PYTHONPATH
(tests/integration/test_speculation_guard.py): once the file ``$DYNAMO_SPEC_HOOK_REJECT``
exists, vLLM's model runner hands the scheduler draft token 1 wherever the draft proposed
token 0, as if the draft had been swapped for one that the fixed target (which always emits
token 0) rejects. Nothing happens without that variable."""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys

_MODULE = "vllm.v1.worker.gpu_model_runner"


def _swap(module) -> None:
    trigger = os.environ["DYNAMO_SPEC_HOOK_REJECT"]
    original = module.GPUModelRunner.take_draft_token_ids

    def take_draft_token_ids(self):
        drafts = original(self)
        if drafts is not None and os.path.exists(trigger):
            drafts.draft_token_ids = [[1 if t == 0 else t for t in ids] for ids in drafts.draft_token_ids]
        return drafts

    module.GPUModelRunner.take_draft_token_ids = take_draft_token_ids


class _AfterImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != _MODULE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        exec_module = spec.loader.exec_module

        def exec_and_swap(module):
            exec_module(module)
            _swap(module)

        spec.loader.exec_module = exec_and_swap
        return spec


if os.environ.get("DYNAMO_SPEC_HOOK_REJECT"):
    sys.meta_path.insert(0, _AfterImport())
