"""Patch: vLLM's CPU engine loads its saved torch.compile artifacts, and runs them as a fresh
compile runs its graphs.

Upstream: a compiled engine (``engine.enforce_eager: false``) saves its compiled model (AOT
compile, ``VLLM_CACHE_ROOT/torch_compile_cache/torch_aot_compile``) so that the next start
loads it instead of compiling again. On CPU:

1. The load always fails ("Compiling model again due to a load failure ... 'function'
   object has no attribute 'finalize_loading'"), and every start compiles from the
   beginning. The CPU platform compiles with ``CompilationMode.DYNAMO_TRACE_ONCE`` and the
   plain ``inductor`` backend, not vLLM's ``VllmBackend``: the saved function's
   ``compiled_fn`` is torch's ``BundledAOTAutogradSerializableCallable``, not vLLM's
   ``VllmSerializableFunction``, and ``vllm.compilation.decorators._try_load_aot_compiled_fn``
   calls ``compiled_fn.finalize_loading(vllm_config)`` on it unconditionally. That method
   builds a ``VllmBackend`` for vLLM's own artifacts; torch's bundled callable is complete
   once deserialised.
2. A loaded model runs slower than a fresh compile: a fresh compile runs the compiled
   graph inside ``torch._dynamo.disable``'s wrapper, the graph torch deserialises
   (``torch._functorch._aot_autograd.aot_autograd_result.deserialize_bundled_cache_entry``)
   runs without it, and vLLM's Python-level KV-cache write (``unified_kv_cache_update``,
   called per layer from the graph) costs more there. Why the wrapper matters there was
   not pinned down: dynamo's frame callback reads None inside that op either way.

Change:
1. ``BundledAOTAutogradSerializableCallable`` gets a ``finalize_loading`` that does
   nothing, only where the class has none. vLLM's own checks on the loaded function stay
   (the source hash of every traced file, the guards as vLLM configures them).
2. ``deserialize_bundled_cache_entry`` returns the deserialised forward wrapped in
   ``torch._dynamo.disable``, as a fresh compile runs it (its ``serialize`` kept).

Checked on vLLM 0.32.0 with the torch it pins, 2.13 (``CHECKED_ON``). Goes away when vLLM calls
``finalize_loading`` only on its own ``VllmSerializableFunction`` (or torch's callable has
one) and a loaded graph runs as a fresh one does (tests/integration/test_compile_cache.py
checks both).
"""

from __future__ import annotations

from typing import Any

from dynamo_spec.vllm_patches._upstream import checked

CHECKED_ON = ("0.32.0",)
# The upstream functions this patch replaces, extends or relies on, with the parameters it was written for.
UPSTREAM_SIGNATURES = {
    "torch._functorch._aot_autograd.aot_autograd_result:deserialize_bundled_cache_entry": "(entry)",
    # the call our finalize_loading answers, and the method of vLLM's own callable it stands in for
    "vllm.compilation.decorators:_try_load_aot_compiled_fn": "(model, aot_compilation_path)",
    "vllm.compilation.caching:VllmSerializableFunction.finalize_loading": "(self, vllm_config)",
}

_WRAPPED_ATTR = "_dynamo_spec_disabled"
# torch's deserialize_bundled_cache_entry, saved before wrapping (for tests).
_original_deserialize: Any = None


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
    global _original_deserialize
    try:
        import torch
        from torch._functorch._aot_autograd import aot_autograd_result
    except ImportError:
        return False
    original = getattr(aot_autograd_result, "deserialize_bundled_cache_entry", None)
    if original is None or getattr(original, _WRAPPED_ATTR, False):
        return False

    _original_deserialize = original

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
    if not checked(__name__, CHECKED_ON):
        return []
    installed = []
    if _add_finalize_loading():
        installed.append("BundledAOTAutogradSerializableCallable.finalize_loading")
    if _run_loaded_graphs_under_disable():
        installed.append("deserialize_bundled_cache_entry under torch._dynamo.disable")
    return installed
