"""Test helper, loaded by every Python process started with this folder on PYTHONPATH
(tests/integration/test_lifecycle.py): vLLM's worker process takes
``$DYNAMO_SPEC_HOOK_SLOW_EXIT`` seconds to exit, as a compiled worker's last garbage
collection can on a busy CPU host. Nothing happens without that variable."""

from __future__ import annotations

import atexit
import os
import sys
import time


def _slow_exit() -> None:
    import multiprocessing

    if multiprocessing.current_process().name.startswith("VllmWorker"):
        seconds = float(os.environ["DYNAMO_SPEC_HOOK_SLOW_EXIT"])
        print(f"hook_slow_exit: the worker exits in {seconds:g} s", file=sys.stderr, flush=True)
        time.sleep(seconds)
        print("hook_slow_exit: the worker exits now", file=sys.stderr, flush=True)


if os.environ.get("DYNAMO_SPEC_HOOK_SLOW_EXIT"):
    atexit.register(_slow_exit)
