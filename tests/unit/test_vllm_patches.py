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
# The methods draft_confidence wraps (each proposer then asks its engine's switch), as its apply() names them.
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
    # the wrapping patches (installed in every process now; each engine's switches decide at run time)
    from dynamo_spec.vllm_patches import draft_penalties

    markers = (zero_draft_steps._PATCHED_ATTR, draft_admission._PATCHED_ATTR, draft_confidence._PATCHED_ATTR,
               draft_penalties._PATCHED_ATTR)
    while any(getattr(obj, marker, False) for marker in markers):
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


def test_draft_confidence_installs_on_a_checked_vllm_only(running, caplog, upstream_state) -> None:
    """Installed whatever the engine asks (tests/unit/test_engine_switches.py: each proposer keeps the
    confidences only where its own engine's switches ask)."""
    wrapped = DRAFT_CONFIDENCE_WRAPPED
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


# One propose call of k = 3 for a batch of four requests, vocabulary 16: what each has output so far,
# what this step accepted (vLLM's sampled row: accepted drafts and the bonus, -1 for the rejected slots),
# its prompt and its penalties (presence, frequency, repetition). The last one has none.
PENALTY_K, PENALTY_VOCAB = 3, 16
PENALTY_BATCH = [
    # prompt,  outputs so far, sampled row,         presence, frequency, repetition
    ([3, 5], [6], [7, -1, -1, -1], 0.0, 0.0, 2.0),
    ([2], [8, 9], [10, 11, -1, -1], 1.5, 0.0, 1.0),
    ([1], [12, 12], [13, -1, -1, -1], 0.0, 1.5, 1.0),
    ([4], [0], [0, 1, 2, 3], 0.0, 0.0, 1.0),
]
# Per draft position and request: the token its draft logits favour (3.0) and a fresh one (2.0, never seen
# by that request). At position 0 the favoured token is one the request's penalty counts: a prompt token
# (repetition counts the prompt), one accepted this step, one in the output so far; after that, the token
# drafted at the position before. Each penalty takes more than 1.0 off it, so the drafts are the fresh
# tokens; the request without penalties drafts the favoured one.
PENALTY_FAVOURED_FIRST = [3, 11, 13, 0]
PENALTY_FRESH = [[14, 15, 10, 5], [15, 14, 9, 6], [0, 3, 4, 7]]


def _penalty_metadata(outputs: list[list[int]], spec_token_ids=None, neutral: bool = False) -> Any:
    """vLLM's SamplingMetadata of the batch above (greedy), with these outputs so far."""
    import torch
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata

    prompts = [row[0] for row in PENALTY_BATCH]
    width = max(map(len, prompts))
    column = (lambda i: torch.tensor([0.0 if i < 5 else 1.0] * len(PENALTY_BATCH))) if neutral else (
        lambda i: torch.tensor([row[i] for row in PENALTY_BATCH]))
    return SamplingMetadata(
        temperature=None, all_greedy=True, all_random=False, top_p=None, top_k=None, generators={},
        max_num_logprobs=None, no_penalties=neutral,
        prompt_token_ids=torch.tensor([p + [PENALTY_VOCAB] * (width - len(p)) for p in prompts]),  # vLLM's padding
        presence_penalties=column(3), frequency_penalties=column(4), repetition_penalties=column(5),
        output_token_ids=outputs, allowed_token_ids_mask=None, bad_words_token_ids={},
        logitsprocs=LogitsProcessors(), spec_token_ids=spec_token_ids)


def _penalty_draft_logits() -> Any:
    """The draft's logits at each position, [k, batch, vocab]: small noise, then the favoured and fresh tokens."""
    import torch

    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(PENALTY_K, len(PENALTY_BATCH), PENALTY_VOCAB, generator=generator) * 0.1
    for j in range(PENALTY_K):
        for i in range(len(PENALTY_BATCH)):
            penalised = i < 3
            before = (PENALTY_FRESH[j - 1][i] if penalised else PENALTY_FAVOURED_FIRST[i]) if j else None
            logits[j, i, PENALTY_FAVOURED_FIRST[i] if j == 0 else before] = 3.0
            logits[j, i, PENALTY_FRESH[j][i]] = 2.0
    return logits


def _penalised_drafts(metadata: Any, logits: Any, sampled: Any = None) -> tuple[list[list[int]], list[Any]]:
    """The patch's penalised greedy sampling over one propose call: per position the drafts and the logits.
    ``sampled``: this step's tokens as vLLM hands them to the drafter (default: the padded batch's tensor of
    sampled rows, placeholders in the rejected slots)."""
    import torch

    from dynamo_spec.vllm_patches import draft_penalties as dp

    if sampled is None:
        sampled = torch.tensor([row[2] for row in PENALTY_BATCH])
    context = dp.PenaltyContext(metadata, dp.accepted_outputs(metadata, sampled), vocab_size=PENALTY_VOCAB)
    drafts, penalised = [], []
    for position in logits:
        ids, out = dp.penalized_argmax(position.clone(), context)
        drafts.append(ids.tolist())
        penalised.append(out)
    return drafts, penalised


def _accepted(row: list[int]) -> list[int]:
    return [t for t in row if t != -1]


def _drafted_before_bookkeeping() -> tuple[list[list[int]], Any]:
    """vLLM's default (the padded drafter batch): the output lists without this step's tokens, which come
    as the sampled rows' tensor."""
    import torch

    return [list(row[1]) for row in PENALTY_BATCH], torch.tensor([row[2] for row in PENALTY_BATCH])


def _drafted_after_bookkeeping() -> tuple[list[list[int]], Any]:
    """``disable_padded_drafter_batch``: the bookkeeping (``_bookkeeping_sync``) has already appended this
    step's tokens to the output lists, and the drafter gets the lists of valid tokens."""
    return [list(row[1]) + _accepted(row[2]) for row in PENALTY_BATCH], [_accepted(row[2]) for row in PENALTY_BATCH]


@pytest.mark.parametrize("when", [_drafted_before_bookkeeping, _drafted_after_bookkeeping],
                         ids=["padded drafter batch", "disable_padded_drafter_batch"])
def test_the_draft_chooses_what_vllms_verify_will_choose_under_the_penalties(when):
    """The patch's penalised greedy draft, position by position, against vLLM's rejection sampler verifying
    those drafts at the next step on the same logits: its penalties (RejectionSampler.apply_logits_processors:
    prompt, output so far with this step's accepted tokens, and the drafts before each position), then greedy,
    choose every draft (all accepted), with the same penalised logits. Each penalty changes the argmax here, so
    drafting without the penalties fails this; so does counting this step's tokens twice where vLLM drafts
    after its bookkeeping (the frequency request's logits differ)."""
    import torch
    from vllm.v1.sample.rejection_sampler import RejectionSampler
    from vllm.v1.sample.sampler import Sampler

    logits = _penalty_draft_logits()
    outputs, sampled = when()  # the runner's output lists when the drafter runs, and this step's tokens
    drafts, penalised = _penalised_drafts(_penalty_metadata(outputs), logits, sampled)

    plain = logits.argmax(dim=-1).tolist()
    assert drafts == [row[:3] + [plain[j][3]] for j, row in enumerate(PENALTY_FRESH)]
    assert all(plain[j][i] != drafts[j][i] for j in range(PENALTY_K) for i in range(3))  # the penalties decide

    # The next step as vLLM verifies it: the outputs now hold the accepted tokens; the drafts are spec tokens.
    after = [list(row[1]) + _accepted(row[2]) for row in PENALTY_BATCH]
    per_request = [[drafts[j][i] for j in range(PENALTY_K)] for i in range(len(PENALTY_BATCH))]
    rows = logits.transpose(0, 1).reshape(-1, PENALTY_VOCAB)  # request-major, as the target's verify rows
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

    verify = SpecDecodeMetadata.make_dummy(per_request, torch.device("cpu"))
    target = RejectionSampler(Sampler()).apply_logits_processors(
        rows.clone(), _penalty_metadata(after, spec_token_ids=per_request), verify)
    assert target.argmax(dim=-1).view(len(PENALTY_BATCH), PENALTY_K).tolist() == per_request
    ours = torch.stack(penalised).transpose(0, 1).reshape(-1, PENALTY_VOCAB)
    torch.testing.assert_close(ours, target, rtol=0, atol=0)  # vLLM's own arithmetic: the same values


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_penalised_logits_are_vllms_to_the_bit_on_random_batches(dtype):
    """Counts built once per call and only the entries a penalty can change: at every position the same
    logits as vLLM's apply_all_penalties over the prompt, the outputs (placeholders among them) and the drafts
    before it, for random batches mixing the three penalties (some rows neutral), logits of both signs, -inf
    entries (an EAGLE-3 draft's tokens outside its vocabulary) and repeated tokens."""
    import torch
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata
    from vllm.v1.sample.ops.penalties import apply_all_penalties

    from dynamo_spec.vllm_patches import draft_penalties as dp

    vocab, rows, k = 300, 6, 4
    for seed in range(5):
        g = torch.Generator().manual_seed(seed)
        prompts = [torch.randint(0, 40, (int(n),), generator=g).tolist() for n in torch.randint(1, 30, (rows,), generator=g)]
        outputs = [torch.randint(0, 40, (int(n),), generator=g).tolist() + [-1] * (i % 2)
                   for i, n in enumerate(torch.randint(0, 30, (rows,), generator=g))]
        kinds = torch.rand(3, rows, generator=g) < 0.6
        presence = torch.where(kinds[0], torch.rand(rows, generator=g) * 2 - 0.5, 0.0)
        frequency = torch.where(kinds[1], torch.rand(rows, generator=g) * 2 - 0.5, 0.0)
        repetition = torch.where(kinds[2], torch.rand(rows, generator=g) + 0.5, 1.0)
        width = max(map(len, prompts))
        prompt_ids = torch.tensor([p + [vocab] * (width - len(p)) for p in prompts])
        metadata = SamplingMetadata(
            temperature=None, all_greedy=True, all_random=False, top_p=None, top_k=None, generators={},
            max_num_logprobs=None, no_penalties=False, prompt_token_ids=prompt_ids, presence_penalties=presence,
            frequency_penalties=frequency, repetition_penalties=repetition, output_token_ids=outputs,
            allowed_token_ids_mask=None, bad_words_token_ids={}, logitsprocs=LogitsProcessors())
        context = dp.PenaltyContext(metadata, [list(o) for o in outputs], vocab)
        drafted: list[list[int]] = []
        for _ in range(k):
            logits = (torch.randn(rows, vocab, generator=g) * 3).to(getattr(torch, dtype))
            logits[:, 200:] = float("-inf")
            logits[:, :40] += 4.0  # the drafts come from the seen tokens, which then repeat
            for i in range(rows):  # and often one the prompt, the outputs or a draft holds wins despite the penalty
                seen = prompts[i] + [t for t in outputs[i] if t >= 0] + [d[i] for d in drafted]
                logits[i, seen[int(torch.randint(0, len(seen), (1,), generator=g))]] += 20.0
            want = apply_all_penalties(logits.clone(), prompt_ids, presence, frequency, repetition,
                                       [o + [d[i] for d in drafted] for i, o in enumerate(outputs)])
            ids, got = dp.penalized_argmax(logits.clone(), context)
            assert torch.equal(got, want), seed
            assert ids.tolist() == want.argmax(dim=-1).tolist()
            drafted.append(ids.tolist())


def test_without_penalties_the_draft_is_the_plain_argmax():
    """Neutral penalties (presence and frequency 0, repetition 1): the logits and the argmax are the draft's own."""
    logits = _penalty_draft_logits()
    drafts, penalised = _penalised_drafts(
        _penalty_metadata([list(row[1]) for row in PENALTY_BATCH], neutral=True), logits)
    assert drafts == logits.argmax(dim=-1).tolist()
    for position, out in zip(logits, penalised):
        assert (out == position).all()


def test_draft_penalties_can_be_turned_off_for_the_engine():
    """Read from the engine's own config (``additional_config["dynamo_spec"]``); on where it says nothing."""
    from types import SimpleNamespace

    from dynamo_spec.vllm_patches import draft_penalties as dp

    def runner(additional_config):  # a model runner, as the patch sees it: its engine's config
        return SimpleNamespace(vllm_config=SimpleNamespace(additional_config=additional_config))

    assert dp.enabled(runner({vllm_patches.CONFIG_KEY: {}})) and dp.enabled(runner({}))
    assert dp.enabled(runner({vllm_patches.CONFIG_KEY: {"draft_penalties": True}}))
    assert not dp.enabled(runner({vllm_patches.CONFIG_KEY: {"draft_penalties": False}}))
