"""The patches of vLLM (dynamo_spec/vllm_patches/): each was written for the upstream signatures it
declares, and applies only on the vLLM versions it was checked on.

No engine: the patched classes are imported, patched and restored in this process.
"""

from __future__ import annotations

import importlib
import logging
from typing import Any

import pytest

pytestmark = pytest.mark.unit

pytest.importorskip("torch")
pytest.importorskip("vllm")

from dynamo_spec import vllm_patches  # noqa: E402
from dynamo_spec.vllm_patches import (  # noqa: E402
    _upstream,
    compile_cache,
    cpu_expand_kernel,
    draft_admission,
    draft_confidence,
    zen_platform,
    zero_draft_steps,
)

UNCHECKED = "0.99.0+cpu"
LOGGER = "vllm.dynamo_spec_plugin"
# The methods zero_draft_steps wraps, as its apply() names them.
ZERO_DRAFT_WRAPPED = ("vllm.v1.worker.gpu_model_runner:GPUModelRunner._sample",
                      "vllm.v1.worker.gpu_model_runner:GPUModelRunner.propose_draft_token_ids",
                      "vllm.v1.core.sched.scheduler:Scheduler.schedule",
                      "vllm.v1.engine.core:EngineCore.post_step")
# The methods draft_admission wraps, as its apply() names them.
DRAFT_ADMISSION_WRAPPED = ("vllm.v1.core.sched.scheduler:Scheduler.update_draft_token_ids",
                           "vllm.v1.core.sched.scheduler:Scheduler._update_after_schedule",
                           "vllm.v1.core.sched.async_scheduler:AsyncScheduler._update_after_schedule",
                           "vllm.v1.core.sched.scheduler:Scheduler.make_spec_decoding_stats")
# The methods draft_confidence wraps (when its variable asks for it), as its apply() names them.
DRAFT_CONFIDENCE_WRAPPED = ("vllm.v1.spec_decode.llm_base_proposer:SpecDecodeBaseProposer._greedy_sample",
                            "vllm.v1.spec_decode.llm_base_proposer:SpecDecodeBaseProposer.propose",
                            "vllm.v1.worker.gpu_model_runner:GPUModelRunner.take_draft_token_ids")
# What draft_admission adds (no upstream original).
DRAFT_ADMISSION_ADDED = ("vllm.v1.engine.core:EngineCore.dynamo_spec_guard",
                         "vllm.v1.engine.core:EngineCore.dynamo_spec_draft_budget")


PATCH_MODULES = [p.module for p in vllm_patches.PATCHES] + list(vllm_patches.PLATFORM_PATCHES)


def patch_module(name: str) -> Any:
    return importlib.import_module(f"dynamo_spec.vllm_patches.{name}")


def upstream(qualified: str) -> Any:
    """The upstream object ``qualified`` names, as vLLM (or torch) shipped it: where one of the
    patches has replaced it in this process, the original it saved."""
    obj = _upstream.resolve(qualified)
    if obj is cpu_expand_kernel.expand_kernel_impl:
        obj = cpu_expand_kernel._original_expand_impl
    if getattr(obj, compile_cache._WRAPPED_ATTR, False):
        obj = compile_cache._original_deserialize
    while getattr(obj, zero_draft_steps._PATCHED_ATTR, False) or getattr(obj, draft_admission._PATCHED_ATTR, False):
        obj = obj.__wrapped__
    return obj


# --------------------------------------------------------------------------- upstream signatures


@pytest.mark.parametrize("patch", PATCH_MODULES)
def test_the_upstream_functions_keep_the_signatures_the_patch_was_written_for(patch: str) -> None:
    """A changed signature means upstream changed what the patch replaces or calls: check the
    patch against the new code, then update UPSTREAM_SIGNATURES (and CHECKED_ON)."""
    module = patch_module(patch)
    assert module.UPSTREAM_SIGNATURES
    changed = {}
    for qualified, expected in module.UPSTREAM_SIGNATURES.items():
        try:
            found = _upstream.bare_signature(upstream(qualified))
        except (ImportError, AttributeError) as e:
            found = f"gone: {e!r}"
        if found != expected:
            changed[qualified] = {"expected": expected, "installed vLLM": found}
    assert not changed, f"{patch}: upstream changed: {changed}"


@pytest.mark.parametrize("patch", PATCH_MODULES)
def test_the_installed_vllm_is_one_the_patch_was_checked_on(patch: str) -> None:
    """Otherwise every patch is inactive here (the guard): the fixes they carry are gone."""
    module = patch_module(patch)
    assert _upstream.release(_upstream.vllm_version()) in module.CHECKED_ON, (
        f"{patch} was checked on vLLM {module.CHECKED_ON}, this is {_upstream.vllm_version()}: "
        "check it against this vLLM, then add the version to its CHECKED_ON")


@pytest.mark.parametrize("patch", vllm_patches.PATCHES, ids=lambda p: p.module)
def test_the_versions_read_from_a_patchs_source_are_its_checked_on(patch) -> None:
    """Preflight reads CHECKED_ON without importing the patch (vllm_patches.checked_on)."""
    assert vllm_patches.checked_on(patch) == patch_module(patch.module).CHECKED_ON


def test_bare_signature_keeps_names_kinds_and_defaults_only() -> None:
    def f(self, a: int, b: str = "x", *args: Any, c: float = 1.0, **kwargs: Any) -> None: ...

    assert _upstream.bare_signature(f) == "(self, a, b='x', *args, c=1.0, **kwargs)"


# --------------------------------------------------------------------------- the version guard


@pytest.fixture
def running(monkeypatch: pytest.MonkeyPatch):
    """Sets the version the running vLLM reports (vllm.version.__version__)."""
    import vllm.version

    monkeypatch.delenv(_upstream.FORCE_ENV, raising=False)
    monkeypatch.delenv(vllm_patches.ZERO_DRAFT_STEPS_ENV, raising=False)
    # vLLM's logging config stops its records at the "vllm" logger; caplog listens at the root.
    monkeypatch.setattr(logging.getLogger("vllm"), "propagate", True)

    def set_version(version: str) -> None:
        monkeypatch.setattr(vllm.version, "__version__", version)

    return set_version


def inactive_lines(caplog: pytest.LogCaptureFixture, module: str) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == LOGGER and module in r.getMessage() and "inactive" in r.getMessage()]


@pytest.mark.parametrize("version", ["0.32.0", "0.32.0+cpu"])
def test_a_checked_release_applies_with_or_without_a_local_suffix(running, caplog, version) -> None:
    running(version)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        assert _upstream.checked("some_patch", ("0.32.0",))
    assert not caplog.records


def test_an_unchecked_version_is_refused_in_one_line(running, caplog) -> None:
    running(UNCHECKED)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        assert not _upstream.checked("some_patch", ("0.32.0", "0.32.1"))
    assert len(caplog.records) == 1
    line = caplog.records[0].getMessage()
    assert "some_patch inactive" in line and UNCHECKED in line and "0.32.0, 0.32.1" in line
    assert _upstream.FORCE_ENV in line


def test_the_force_variable_applies_on_an_unchecked_version_and_says_so(running, caplog, monkeypatch) -> None:
    running(UNCHECKED)
    monkeypatch.setenv(_upstream.FORCE_ENV, "1")
    with caplog.at_level(logging.INFO, logger=LOGGER):
        assert _upstream.checked("some_patch", ("0.32.0",))
    assert len(caplog.records) == 1 and "applied on vLLM 0.99.0+cpu" in caplog.records[0].getMessage()


@pytest.fixture
def upstream_state(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Everything the patches change, put back to what vLLM and torch shipped for the test and
    restored after it, so a test can apply the patches here. Returns the upstream objects."""
    from torch._dynamo.aot_compile_types import BundledAOTAutogradSerializableCallable
    from torch._functorch._aot_autograd import aot_autograd_result
    from vllm.utils import cpu_triton_utils

    state: dict[str, Any] = {}
    expand = upstream("vllm.utils.cpu_triton_utils:_expand_kernel_impl")
    monkeypatch.setattr(cpu_triton_utils, "_expand_kernel_impl", expand)
    monkeypatch.setattr(cpu_expand_kernel, "_original_expand_impl", None)
    monkeypatch.setattr(cpu_expand_kernel, "_patched", False)
    state["expand"] = expand

    # finalize_loading: absent upstream (torch 2.11); removed again after the test either way.
    monkeypatch.setattr(BundledAOTAutogradSerializableCallable, "finalize_loading", None, raising=False)
    monkeypatch.delattr(BundledAOTAutogradSerializableCallable, "finalize_loading")
    deserialize = upstream("torch._functorch._aot_autograd.aot_autograd_result:deserialize_bundled_cache_entry")
    monkeypatch.setattr(aot_autograd_result, "deserialize_bundled_cache_entry", deserialize)
    monkeypatch.setattr(compile_cache, "_original_deserialize", None)
    state["deserialize"] = deserialize

    for qualified in ZERO_DRAFT_WRAPPED + DRAFT_ADMISSION_WRAPPED + DRAFT_CONFIDENCE_WRAPPED:
        owner, name = qualified.rsplit(".", 1)
        original = upstream(qualified)
        monkeypatch.setattr(_upstream.resolve(owner), name, original)
        state[qualified] = original
    for qualified in DRAFT_ADMISSION_ADDED:
        owner, name = qualified.rsplit(".", 1)
        monkeypatch.delattr(_upstream.resolve(owner), name, raising=False)
    return state


def current(qualified: str) -> Any:
    return _upstream.resolve(qualified)


def test_unchecked_vllm_cpu_expand_kernel_is_not_replaced(running, caplog, upstream_state, monkeypatch) -> None:
    from vllm.triton_utils import HAS_TRITON
    from vllm.triton_utils.dispatcher import _registry

    running(UNCHECKED)
    registered = _registry.get(cpu_expand_kernel.EXPAND_KERNEL)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        assert cpu_expand_kernel.apply_cpu_fixes() is False
    assert current("vllm.utils.cpu_triton_utils:_expand_kernel_impl") is upstream_state["expand"]
    assert _registry.get(cpu_expand_kernel.EXPAND_KERNEL) == registered
    assert len(inactive_lines(caplog, cpu_expand_kernel.__name__)) == 1
    assert len(caplog.records) == 1

    if HAS_TRITON:
        pytest.skip("with Triton the patch has nothing to replace")
    # The same call on the checked version does replace it (the registry part aside: it is
    # re-registered only where the overrides are active, which this test leaves alone).
    running("0.32.0")
    monkeypatch.setattr(cpu_expand_kernel, "_overrides_active", lambda: False)
    assert cpu_expand_kernel.apply_cpu_fixes() is True
    assert current("vllm.utils.cpu_triton_utils:_expand_kernel_impl") is cpu_expand_kernel.expand_kernel_impl


def test_unchecked_vllm_compile_cache_changes_nothing(running, caplog, upstream_state) -> None:
    from torch._dynamo.aot_compile_types import BundledAOTAutogradSerializableCallable

    deserialize = "torch._functorch._aot_autograd.aot_autograd_result:deserialize_bundled_cache_entry"
    running(UNCHECKED)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        assert compile_cache.apply() == []
    assert not hasattr(BundledAOTAutogradSerializableCallable, "finalize_loading")
    assert current(deserialize) is upstream_state["deserialize"]
    assert len(inactive_lines(caplog, compile_cache.__name__)) == 1
    assert len(caplog.records) == 1

    running("0.32.0")
    assert len(compile_cache.apply()) == 2
    assert hasattr(BundledAOTAutogradSerializableCallable, "finalize_loading")
    assert current(deserialize) is not upstream_state["deserialize"]


def test_unchecked_vllm_zero_draft_steps_changes_nothing(running, caplog, upstream_state) -> None:
    wrapped = ZERO_DRAFT_WRAPPED
    running(UNCHECKED)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        assert zero_draft_steps.apply() == []
    assert all(current(q) is upstream_state[q] for q in wrapped)
    assert len(inactive_lines(caplog, zero_draft_steps.__name__)) == 1
    assert len(caplog.records) == 1

    running("0.32.0")
    assert zero_draft_steps.apply() == [q.split(":")[1] for q in wrapped]
    assert all(current(q) is not upstream_state[q] for q in wrapped)


def test_unchecked_vllm_draft_admission_changes_nothing(running, caplog, upstream_state) -> None:
    wrapped = DRAFT_ADMISSION_WRAPPED
    running(UNCHECKED)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        assert draft_admission.apply() == []
    assert all(current(q) is upstream_state[q] for q in wrapped)
    assert not any(hasattr(_upstream.resolve(q.rsplit(".", 1)[0]), q.rsplit(".", 1)[1]) for q in DRAFT_ADMISSION_ADDED)
    assert len(inactive_lines(caplog, draft_admission.__name__)) == 1
    assert len(caplog.records) == 1

    running("0.32.0")
    assert draft_admission.apply() == [q.split(":")[1] for q in wrapped + DRAFT_ADMISSION_ADDED]
    assert all(current(q) is not upstream_state[q] for q in wrapped)
    assert draft_admission.apply() == []  # idempotent


def test_draft_confidence_installs_only_where_asked_and_on_a_checked_vllm(running, caplog, upstream_state,
                                                                         monkeypatch) -> None:
    wrapped = DRAFT_CONFIDENCE_WRAPPED
    running("0.32.0")
    monkeypatch.delenv(draft_confidence.CONFIDENCE_ENV, raising=False)
    assert draft_confidence.apply() == []  # not asked: drafting stays vLLM's own
    monkeypatch.setenv(draft_confidence.CONFIDENCE_ENV, "1")
    running(UNCHECKED)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        assert draft_confidence.apply() == []
    assert all(current(q) is upstream_state[q] for q in wrapped)
    assert len(inactive_lines(caplog, draft_confidence.__name__)) == 1

    running("0.32.0")
    assert draft_confidence.apply() == [q.split(":")[1] for q in wrapped]
    assert all(current(q) is not upstream_state[q] for q in wrapped)
    assert draft_confidence.apply() == []  # idempotent


def test_unchecked_vllm_the_zen_platform_plugin_names_nothing(running, caplog, monkeypatch) -> None:
    # As on an AMD CPU with zentorch, where the plugin names its platform on a checked vLLM.
    monkeypatch.setattr(zen_platform, "choose", lambda *args, **kwargs: zen_platform.ZEN_PLATFORM)
    running(UNCHECKED)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        assert zen_platform.platform_plugin() is None
    assert len(inactive_lines(caplog, zen_platform.__name__)) == 1
    assert len(caplog.records) == 1

    running("0.32.0")
    assert zen_platform.platform_plugin() == zen_platform.ZEN_PLATFORM


def test_unchecked_vllm_the_general_plugin_registers_nothing_and_does_not_fail(running, caplog,
                                                                               upstream_state) -> None:
    """vLLM's entry point on an unchecked vLLM: one inactive line per patch, no error, nothing patched."""
    from dynamo_spec.engine.host import on_cpu

    on_cpu()  # resolve the platform first: its own log lines are not the plugin's
    running(UNCHECKED)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        vllm_patches.register()
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    expected = [zero_draft_steps, draft_admission] + ([cpu_expand_kernel, compile_cache] if on_cpu() else [])
    assert all(len(inactive_lines(caplog, m.__name__)) == 1 for m in expected)
    assert current("vllm.utils.cpu_triton_utils:_expand_kernel_impl") is upstream_state["expand"]
    assert all(current(q) is upstream_state[q] for q in ZERO_DRAFT_WRAPPED + DRAFT_ADMISSION_WRAPPED)


# --------------------------------------------------------------------------- failing closed


def patched_settings(**speculative):
    from dynamo_spec.config.settings import Settings

    return Settings(engine={"model": "t", **speculative.pop("engine", {})},
                    speculative={"method": "eagle3", "model": "d", **speculative},
                    metrics={"tenant_header": "X-Tenant"})


def test_on_an_unchecked_vllm_preflight_refuses_to_serve_without_the_correctness_fixes(running) -> None:
    """Each correctness fix that cannot apply is one error line naming what breaks and how to serve
    anyway; the explicit setting turns them into warnings. On a GPU the CPU fixes do not apply."""
    from dynamo_spec.config.preflight import check_patches

    running(UNCHECKED)
    errors = [p.message for p in check_patches(patched_settings(), on_cpu=True) if p.level == "error"]
    assert len(errors) == 2, errors
    assert any("cpu_expand_kernel" in e and "garbage" in e for e in errors)
    assert any("seeded_sampling" in e and "stops the CPU engine" in e for e in errors)
    assert all(f"vLLM {UNCHECKED}" in e and "engine.allow_unpatched_vllm: true" in e for e in errors)
    allowed = check_patches(patched_settings(engine={"allow_unpatched_vllm": True}), on_cpu=True)
    assert [p.level for p in allowed] == ["warning", "warning"]
    assert check_patches(patched_settings(), on_cpu=False) == []
    running("0.32.0")
    assert check_patches(patched_settings(), on_cpu=True) == []


@pytest.mark.parametrize("speculative, field", [
    ({"guard": {"enabled": True}}, "speculative.guard"),
    ({"tenants": {"free": {"max_draft_tokens": 1}}}, "speculative.tenants"),
    ({"draft_budget": {"enabled": True}}, "speculative.draft_budget"),
])
def test_on_an_unchecked_vllm_a_feature_its_patch_backs_is_refused(running, speculative, field) -> None:
    from dynamo_spec.config.preflight import check_patches

    running(UNCHECKED)
    errors = [p.message for p in check_patches(patched_settings(**speculative), on_cpu=False)]
    assert errors and all(e.startswith(f"{field}: vLLM {UNCHECKED} is not a version") for e in errors), errors
    assert check_patches(patched_settings(**speculative, enabled=False), on_cpu=False) == []
    running("0.32.0")
    assert check_patches(patched_settings(**speculative), on_cpu=False) == []


def test_on_an_unchecked_vllm_a_requests_cap_is_a_400_not_ignored(running) -> None:
    from dynamo_spec.serving.admission import Refusal, check_types
    from dynamo_spec.serving.draft_caps import unavailable

    body = {"model": "m", "prompt": "p", "vllm_xargs": {"max_draft_tokens": 1}}
    running(UNCHECKED)
    reason = unavailable(on_cpu=False)
    assert reason and UNCHECKED in reason
    with pytest.raises(Refusal) as refused:
        check_types(body, reason)
    assert refused.value.status == 400 and refused.value.param == "vllm_xargs.max_draft_tokens"
    check_types({"model": "m", "prompt": "p"}, reason)  # a request without a cap is served
    running("0.32.0")
    assert unavailable(on_cpu=False) is None


# --------------------------------------------------------------------------- draft-side penalties


def test_the_draft_counts_the_outputs_the_target_will_count():
    """The outputs so far, this step's accepted tokens (vLLM's -1 placeholders dropped), then the drafts
    already made in the step: what the rejection sampler's penalties see at each position."""
    import torch

    from dynamo_spec.vllm_patches import draft_penalties as dp

    metadata = type("Metadata", (), {"output_token_ids": [[5, 6], [], [7]]})()
    sampled = torch.tensor([[8, 9, -1], [3, -1, -1], [4, 4, 4]])
    context = dp.PenaltyContext(metadata, dp.accepted_outputs(metadata, sampled), vocab_size=16)
    assert context.outputs_at(3) == [[5, 6, 8, 9], [3], [7, 4, 4, 4]]
    context.drafted.append([1, 2, 3])
    context.drafted.append([10, 11, 12])
    assert context.outputs_at(2) == [[5, 6, 8, 9, 1, 10], [3, 2, 11]]


def test_draft_penalties_can_be_turned_off_for_the_engine(monkeypatch):
    from dynamo_spec.vllm_patches import draft_penalties as dp

    monkeypatch.delenv(dp.PENALTIES_ENV, raising=False)
    assert dp.enabled()
    monkeypatch.setenv(dp.PENALTIES_ENV, "0")
    assert not dp.enabled()
