"""Draft admission and the speculation guard inside vLLM's own schedulers, the asynchronous one first.

On a GPU vLLM 0.32 runs EAGLE-3 with asynchronous scheduling (``AsyncScheduler``: each scheduled
request gets k placeholder drafts that the worker fills itself); on CPU the platform turns it off, so
no engine test here ever runs it. These tests build vLLM's real schedulers from the tiny EAGLE-3
pair's config (``tiny_models``: a Llama target and its EAGLE-3 draft), apply the draft admission
patch as the engine's plugin does, and drive them the way ``EngineCore`` does: the asynchronous one
through a batch queue two steps deep (``step_with_batch_queue``: step n+1 is scheduled before step
n's output comes back), the synchronous one step by step with the worker's drafts handed to
``update_draft_token_ids`` (``post_step``). A stand-in model runner answers each step: one sampled
token per request, plus the drafts it accepts.

No engine, no model weights loaded, no forward pass.
"""

from __future__ import annotations

import functools
import os
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

pytestmark = pytest.mark.unit

pytest.importorskip("torch")
pytest.importorskip("vllm")

from dynamo_spec.vllm_patches import CONFIG_KEY, draft_admission, speculation_guard  # noqa: E402

K = 3  # num_speculative_tokens
PROMPT_LEN = 8  # one prefill step each (no chunking, no prefix-cache hits: distinct prompts)
NUM_BLOCKS = 64
BLOCK_SIZE = 16
SAMPLED = 7  # the token the stand-in runner samples
DRAFTED = 11  # the token the stand-in drafter proposes (synchronous scheduling)

# The scheduler methods the draft admission patch wraps: (owner module, class, method).
WRAPPED = (("vllm.v1.core.sched.scheduler", "Scheduler", "update_draft_token_ids"),
           ("vllm.v1.core.sched.scheduler", "Scheduler", "_update_after_schedule"),
           ("vllm.v1.core.sched.async_scheduler", "AsyncScheduler", "_update_after_schedule"),
           ("vllm.v1.core.sched.scheduler", "Scheduler", "make_spec_decoding_stats"))


# --------------------------------------------------------------------------- vLLM's config, once


def _restore_environ(saved: dict[str, str]) -> None:
    for key in set(os.environ) - set(saved):
        del os.environ[key]
    for key, value in saved.items():
        if os.environ.get(key) != value:
            os.environ[key] = value


@pytest.fixture(scope="module")
def vllm_config(tiny_models):
    """The VllmConfig an engine serving the tiny target with its EAGLE-3 draft (k=3) gets, built
    as ``EngineArgs.create_engine_config`` builds it, without loading vLLM's plugins.

    Two things are kept from leaking into the rest of the session: the CPU platform's
    ``check_and_update_config`` sets process environment variables (``LD_PRELOAD``,
    ``VLLM_WORKER_MULTIPROC_METHOD``, ...), restored here; and vLLM inspects each architecture
    in a fresh Python process (to keep CUDA out of this one), done in this process instead (CPU
    only; seconds saved, the answer is the same)."""
    from vllm.config import CacheConfig, ModelConfig, ParallelConfig, SchedulerConfig, SpeculativeConfig, VllmConfig
    from vllm.model_executor.models import registry

    saved = dict(os.environ)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(registry, "_run_in_subprocess", lambda fn: fn())
        try:
            target = ModelConfig(model=str(tiny_models["target"]), max_model_len=256)
            parallel = ParallelConfig()
            spec = SpeculativeConfig(method="eagle3", model=str(tiny_models["draft"]), num_speculative_tokens=K,
                                     target_model_config=target, target_parallel_config=parallel)
            config = VllmConfig(model_config=target, parallel_config=parallel, speculative_config=spec,
                                cache_config=CacheConfig(block_size=BLOCK_SIZE),
                                scheduler_config=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=512,
                                                                 max_model_len=256, is_encoder_decoder=False))
        finally:
            _restore_environ(saved)
    assert config.speculative_config.method == "eagle3" and config.speculative_config.use_eagle()
    assert config.num_speculative_tokens == K
    assert config.scheduler_config.async_scheduling is False  # what the CPU platform decides
    config.cache_config.num_gpu_blocks = NUM_BLOCKS  # what the engine sets after profiling
    return config


# --------------------------------------------------------------------------- the patch, applied and undone


def _upstream(method: Any) -> Any:
    while getattr(method, draft_admission._PATCHED_ATTR, False):
        method = method.__wrapped__
    return method


@pytest.fixture
def upstream_scheduler(vllm_config, monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's scheduler methods as shipped for the test, whatever this process applied before;
    put back as they were after it. The engine's switches configure no guard or budget."""
    import importlib

    from vllm.v1.engine.core import EngineCore

    for module, cls, name in WRAPPED:
        owner = getattr(importlib.import_module(module), cls)
        monkeypatch.setattr(owner, name, _upstream(owner.__dict__[name]))
    for name in (draft_admission.GUARD_UTILITY, draft_admission.BUDGET_UTILITY):
        # absent after the test if it was absent before (setattr records that; delattr alone would not)
        monkeypatch.setattr(EngineCore, name, None, raising=False)
        monkeypatch.delattr(EngineCore, name)
    monkeypatch.setattr(vllm_config, "additional_config", {})


@pytest.fixture
def patched(upstream_scheduler) -> None:
    """The draft admission patch applied as the engine's plugin applies it (undone after the test)."""
    installed = draft_admission.apply()
    assert installed[:4] == ["Scheduler.update_draft_token_ids", "Scheduler._update_after_schedule",
                             "AsyncScheduler._update_after_schedule", "Scheduler.make_spec_decoding_stats"]


# --------------------------------------------------------------------------- EngineCore, stand-in runner


def make_scheduler(config, *, asynchronous: bool):
    """The scheduler EngineCore builds: the class the config names, as EngineCore constructs it."""
    import torch
    from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    config.scheduler_config.async_scheduling = asynchronous  # the GPU's choice; the CPU platform's is False
    cls = config.scheduler_config.get_scheduler_cls()
    assert (cls is AsyncScheduler) is asynchronous
    assert config.max_concurrent_batches == (2 if asynchronous else 1)
    spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=16, dtype=torch.float32)
    kv = KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["attn"], spec)])
    block_size, hash_block_size = resolve_kv_cache_block_sizes(kv, config)
    return cls(vllm_config=config, kv_cache_config=kv, structured_output_manager=StructuredOutputManager(config),
               log_stats=True, block_size=block_size, hash_block_size=hash_block_size)


def add_requests(scheduler, caps: dict[str, int | None]) -> None:
    """One request per entry, ``max_draft_tokens`` = the cap (None: the field left out)."""
    from vllm import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    hash_fn = get_hash_fn_by_name(scheduler.cache_config.prefix_caching_hash_algo)
    init_none_hash(hash_fn)
    hasher = get_request_block_hasher(scheduler.hash_block_size, hash_fn)
    for i, (req_id, cap) in enumerate(caps.items()):
        extra = None if cap is None else {draft_admission.MAX_DRAFT_TOKENS: cap}
        params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True, extra_args=extra)
        prompt = [100 + i] * PROMPT_LEN
        scheduler.add_request(Request(req_id, prompt, params, None, block_hasher=hasher))


# How many of a request's verified drafts the stand-in runner accepts: (req_id, drafted) -> accepted.
Acceptance = Callable[[str, int], int]


def accept_none(req_id: str, drafted: int) -> int:
    return 0


def accept_all(req_id: str, drafted: int) -> int:
    return drafted


@dataclass
class Step:
    """One scheduled step: what it scheduled, and what the request objects held right after."""

    output: Any  # SchedulerOutput
    placeholders: dict[str, int]  # req_id -> len(request.spec_token_ids) after schedule()

    @property
    def k(self) -> int:
        return self.output.num_spec_tokens_to_schedule

    @property
    def spec(self) -> dict[str, int]:
        """req_id -> draft tokens scheduled for verification in this step (requests with none left out)."""
        return {r: len(ids) for r, ids in self.output.scheduled_spec_decode_tokens.items()}

    @property
    def tokens(self) -> dict[str, int]:
        return dict(self.output.num_scheduled_tokens)


@dataclass
class Engine:
    """EngineCore's loop around the scheduler, with a stand-in model runner."""

    scheduler: Any
    asynchronous: bool
    steps: list[Step] = field(default_factory=list)
    verified: list[tuple[int, int]] = field(default_factory=list)  # per update: (drafted, accepted) tokens
    _queue: deque = field(default_factory=deque)

    def _run_model(self, output, acceptance: Acceptance):
        from vllm.v1.outputs import ModelRunnerOutput

        req_ids = list(output.num_scheduled_tokens)
        sampled = []
        for req_id in req_ids:
            drafted = len(output.scheduled_spec_decode_tokens.get(req_id, ()))
            sampled.append([SAMPLED] * (1 + (min(acceptance(req_id, drafted), drafted) if drafted else 0)))
        return ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                 sampled_token_ids=sampled)

    def _update(self, output, acceptance: Acceptance) -> None:
        outputs = self.scheduler.update_from_output(output, self._run_model(output, acceptance))
        stats = [o.scheduler_stats.spec_decoding_stats for o in outputs.values()
                 if o.scheduler_stats is not None and o.scheduler_stats.spec_decoding_stats is not None]
        self.verified.append((sum(s.num_draft_tokens for s in stats), sum(s.num_accepted_tokens for s in stats)))

    def _schedule(self):
        output = self.scheduler.schedule()
        self.steps.append(Step(output, {r.request_id: len(r.spec_token_ids) for r in self.scheduler.running}))
        return output

    def step(self, acceptance: Acceptance = accept_none) -> None:
        if self.asynchronous:
            # step_with_batch_queue with max_concurrent_batches == 2: schedule, then (queue full)
            # take the oldest step's output; the worker fills the placeholders itself.
            self._queue.appendleft(self._schedule())
            if len(self._queue) < 2:
                return
            self._update(self._queue.pop(), acceptance)
        else:
            # step + post_step: the worker drafted the step's k tokens for every request in it.
            from vllm.v1.outputs import DraftTokenIds

            output = self._schedule()
            self._update(output, acceptance)
            req_ids = list(output.num_scheduled_tokens)
            self.scheduler.update_draft_token_ids(
                DraftTokenIds(req_ids, [[DRAFTED] * output.num_spec_tokens_to_schedule for _ in req_ids]))

    def run(self, n: int, acceptance: Acceptance = accept_none) -> list[Step]:
        first = len(self.steps)
        for _ in range(n):
            self.step(acceptance)
        return self.steps[first:]


@pytest.fixture
def engine(vllm_config) -> Iterator[Callable[..., Engine]]:
    def build(caps: dict[str, int | None], *, asynchronous: bool = True) -> Engine:
        scheduler = make_scheduler(vllm_config, asynchronous=asynchronous)
        add_requests(scheduler, caps)
        return Engine(scheduler, asynchronous)

    yield build
    vllm_config.scheduler_config.async_scheduling = False


CAPS = {"off": 0, "one": 1, "free": None}


# --------------------------------------------------------------------------- 1. placeholders capped per request


def test_async_placeholders_and_verified_drafts_follow_each_requests_cap(patched, engine):
    eng = engine(CAPS)
    prefill, *decode = eng.run(6, accept_none)
    assert prefill.tokens == dict.fromkeys(CAPS, PROMPT_LEN) and prefill.spec == {}
    # Right after each schedule(), the placeholders the worker fills for the next step:
    assert prefill.placeholders == {"off": 0, "one": 1, "free": K}
    for step in decode:
        assert step.k == K  # one request drafts uncapped
        assert step.placeholders == {"off": 0, "one": 1, "free": K}
        # ... which are what the next step verifies: 1 sampled token + the request's drafts
        assert step.spec == {"one": 1, "free": K}
        assert step.tokens == {"off": 1, "one": 2, "free": 1 + K}
    # What update_from_output counted as verified (the guard sees the same): 0 + 1 + 3 per decode step;
    # the first update is the prefill's.
    assert eng.verified == [(0, 0)] + [(1 + K, 0)] * 4


def test_async_partial_acceptance_keeps_the_caps(patched, engine):
    eng = engine(CAPS)
    for step in eng.run(8, lambda req_id, drafted: 1):  # one draft token accepted per request per step
        assert step.placeholders == {"off": 0, "one": 1, "free": K}
    assert all(s.spec == {"one": 1, "free": K} for s in eng.steps[1:])
    assert eng.verified[1:] == [(1 + K, 2)] * 6
    requests = eng.scheduler.requests
    # tokens out: the prefill's and the decode steps' (the last step's output is still in flight)
    assert requests["off"].num_output_tokens == 7 and requests["one"].num_output_tokens == 13


def test_without_the_patch_every_request_gets_the_steps_k(upstream_scheduler, engine):
    """The control: vLLM as shipped gives each request k placeholders, whatever its max_draft_tokens."""
    eng = engine(CAPS)
    prefill, *decode = eng.run(4)
    assert prefill.placeholders == dict.fromkeys(CAPS, K)
    assert all(s.spec == dict.fromkeys(CAPS, K) and s.k == K for s in decode)


# --------------------------------------------------------------------------- 2. the step's k lowered


@pytest.mark.parametrize("asynchronous", [True, False], ids=["async", "sync"])
@pytest.mark.parametrize("caps, k", [
    ({"off": 0, "one": 1}, 1),
    ({"off": 0, "off2": 0}, 0),
    ({"one": 1, "free": None}, K),
    ({"two": 2, "off": 0}, 2),
])
def test_the_steps_k_is_the_largest_cap_among_the_drafting_requests(patched, engine, caps, k, asynchronous):
    eng = engine(caps, asynchronous=asynchronous)
    steps = eng.run(5, accept_all)
    assert [s.k for s in steps] == [k] * 5
    capped = {r: min(K, k if cap is None else cap) for r, cap in caps.items()}
    drafting = {r: n for r, n in capped.items() if n}
    for step in steps[1:]:
        assert step.spec == drafting
        assert step.tokens == {r: 1 + n for r, n in capped.items()}
    if asynchronous:
        assert all(s.placeholders == capped for s in steps)
    if k == 0:  # a k=0 step: nothing drafted, nothing verified
        assert all(v == (0, 0) for v in eng.verified)


# --------------------------------------------------------------------------- both paths agree


def test_the_synchronous_scheduler_caps_the_same_way(patched, engine):
    sync_eng, async_eng = engine(CAPS, asynchronous=False), engine(CAPS, asynchronous=True)
    sync_steps, async_steps = sync_eng.run(5), async_eng.run(5)
    assert type(sync_eng.scheduler).__name__ == "Scheduler"
    assert type(async_eng.scheduler).__name__ == "AsyncScheduler"
    assert [s.spec for s in sync_steps] == [s.spec for s in async_steps] == [{}] + [{"one": 1, "free": K}] * 4
    assert [s.k for s in sync_steps] == [s.k for s in async_steps] == [K] * 5
    # synchronous: the worker's k drafts were cut to each cap before vLLM stored them
    assert {r.request_id: r.spec_token_ids for r in sync_eng.scheduler.running} == {
        "off": [], "one": [DRAFTED], "free": [DRAFTED] * K}


# --------------------------------------------------------------------------- 3. the guard


GUARD = speculation_guard.GuardConfig(min_acceptance_rate=0.5, window_draft_tokens=6, window_seconds=1e9,
                                      min_draft_tokens=1, probe_interval_seconds=10.0, probe_draft_tokens=6)


@pytest.fixture
def clock(patched, vllm_config, monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The guard configured as the server configures it (the engine's switches in its config), on a
    clock the test moves."""
    now = [0.0]
    monkeypatch.setattr(vllm_config, "additional_config",
                        {CONFIG_KEY: {speculation_guard.GUARD_KEY: GUARD.to_switch()}})
    monkeypatch.setattr(speculation_guard, "SpeculationGuard",
                        functools.partial(speculation_guard.SpeculationGuard, clock=lambda: now[0]))
    return now


GUARD_CAPS = {"a": None, "b": None, "one": 1}  # 3 + 3 + 1 = 7 draft tokens verified per decode step


@pytest.mark.parametrize("asynchronous", [True, False], ids=["async", "sync"])
def test_the_guard_falls_back_and_the_next_steps_schedule_no_drafts(clock, engine, asynchronous):
    eng = engine(GUARD_CAPS, asynchronous=asynchronous)
    guard = draft_admission.guard_of(eng.scheduler)
    assert guard is not None and guard.config == GUARD
    steps = eng.run(7, accept_none)
    drafting = {"a": K, "b": K, "one": 1}
    assert guard.state == speculation_guard.FALLBACK
    assert guard.transitions == {"speculating->fallback": 1}
    # judged as soon as the window held 6 drafted tokens: "a"'s and "b"'s drafts of one step, none accepted
    assert guard.last_judged == {"drafts": 2, "draft_tokens": 6, "accepted_tokens": 0, "acceptance_rate": 0.0,
                                 "mean_acceptance_length": 1.0}
    if asynchronous:
        # S1 prefill; S2, S3 verify; S2's output (7 drafted, 0 accepted) comes back after S3 is scheduled
        # and the guard falls back. S4 was drafted for while S3 ran: it still verifies those drafts, but
        # its k is 0 and it leaves no placeholders, so from S5 on nothing is verified.
        assert [s.spec for s in steps] == [{}, drafting, drafting, drafting, {}, {}, {}]
        assert [s.k for s in steps] == [K, K, K, 0, 0, 0, 0]
        assert [s.placeholders for s in steps[3:]] == [dict.fromkeys(GUARD_CAPS, 0)] * 4
        # updates: the prefill's, then S2's, S3's and S4's drafts (the last two in fallback: the guard ignores
        # them), then none; S7's output is still in flight
        assert eng.verified == [(0, 0), (7, 0), (7, 0), (7, 0), (0, 0), (0, 0)]
    else:
        # S2's drafts verified in its own update: the drafts made after S2 are cut to 0 before vLLM keeps them.
        assert [s.spec for s in steps] == [{}, drafting, {}, {}, {}, {}, {}]
        assert [s.k for s in steps] == [K, K, 0, 0, 0, 0, 0]
        assert eng.verified == [(0, 0), (7, 0)] + [(0, 0)] * 5
    assert all(s.tokens == dict.fromkeys(GUARD_CAPS, 1) for s in steps[-3:])  # plain decode steps
    assert guard.window_figures()["draft_tokens"] == 0  # nothing observed in fallback


def test_the_guard_probes_after_its_interval_and_resumes_on_good_acceptance(clock, engine):
    eng = engine(GUARD_CAPS, asynchronous=True)
    guard = draft_admission.guard_of(eng.scheduler)
    eng.run(6, accept_none)
    assert guard.state == speculation_guard.FALLBACK

    clock[0] += GUARD.probe_interval_seconds - 1
    assert all(s.k == 0 and s.spec == {} for s in eng.run(2, accept_none))  # not yet
    assert guard.state == speculation_guard.FALLBACK

    clock[0] += 1
    drafting = {"a": K, "b": K, "one": 1}  # the request's own cap still holds in a probe
    probe = eng.run(4, accept_none)  # a probe that sees no acceptance either
    # The first schedule after the interval asks the guard, which starts the probe: k back to 3, placeholders
    # again; the probe's first verified drafts (7 tokens >= probe_draft_tokens) send it back to fallback,
    # one step later, as before (the drafts already in flight are still verified).
    assert [s.k for s in probe] == [K, K, K, 0]
    assert [s.spec for s in probe] == [{}, drafting, drafting, drafting]
    assert guard.state == speculation_guard.FALLBACK
    assert guard.transitions == {"speculating->fallback": 1, "fallback->probing": 1, "probing->fallback": 1}
    assert [s.spec for s in eng.run(2)] == [{}, {}]

    clock[0] += GUARD.probe_interval_seconds
    assert [s.k for s in eng.run(6, accept_all)] == [K] * 6  # this probe sees every draft accepted
    assert guard.state == speculation_guard.SPECULATING
    assert guard.transitions["probing->speculating"] == 1
    assert all(s.k == K and s.spec == drafting for s in eng.run(3, accept_all))


def test_two_engines_in_one_process_each_follow_their_own_switches(clock, vllm_config, engine):
    """Two schedulers side by side in this process, one from a config whose switches configure the guard
    and one from a config without: the patch is process-wide, the guard only where its engine asks."""
    import copy

    plain_config = copy.copy(vllm_config)
    plain_config.additional_config = {}
    guarded = engine(GUARD_CAPS, asynchronous=False)
    plain = Engine(make_scheduler(plain_config, asynchronous=False), asynchronous=False)
    add_requests(plain.scheduler, GUARD_CAPS)
    assert vllm_config.additional_config[CONFIG_KEY] and plain_config.additional_config == {}
    for _ in range(7):  # interleaved, as two engines' steps would be
        guarded.step(accept_none)
        plain.step(accept_none)
    drafting = {"a": K, "b": K, "one": 1}
    assert draft_admission.guard_of(guarded.scheduler).state == speculation_guard.FALLBACK
    assert [s.spec for s in guarded.steps] == [{}, drafting, {}, {}, {}, {}, {}]
    assert draft_admission.guard_of(plain.scheduler) is None and draft_admission.budget_of(plain.scheduler) is None
    assert [s.spec for s in plain.steps] == [{}] + [drafting] * 6  # nothing accepted, and it keeps drafting
