"""Draft admission (dynamo_spec/vllm_patches/draft_admission.py): how caps combine, and what the
wrapped scheduler methods hand on to vLLM's own. No engine: stand-in requests and schedulers."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from dynamo_spec.vllm_patches import draft_admission as da

pytestmark = pytest.mark.unit

STEP = da.StepContext(num_requests=4, k=3)


def request(cap=None, *, extra=None, prefilling=False, spec=None):
    extra_args = extra if extra is not None else ({} if cap is None else {"max_draft_tokens": cap})
    return SimpleNamespace(sampling_params=SimpleNamespace(extra_args=extra_args or None),
                           is_prefill_chunk=prefilling, spec_token_ids=spec or [], is_finished=lambda: False)


@pytest.mark.parametrize("extra, cap", [
    ({"max_draft_tokens": 0}, 0), ({"max_draft_tokens": 2}, 2), ({"max_draft_tokens": 9}, 9),
    ({}, None), ({"other": 1}, None), ({"max_draft_tokens": None}, None),
    # what the server refuses (400), should it reach the engine another way: no cap
    ({"max_draft_tokens": -1}, None), ({"max_draft_tokens": True}, None), ({"max_draft_tokens": "1"}, None),
    ({"max_draft_tokens": 1.0}, None),
])
def test_the_request_cap_is_its_max_draft_tokens(extra, cap):
    assert da.request_cap(request(extra=extra), STEP) == cap


def test_a_request_without_sampling_params_has_no_cap():
    assert da.request_cap(SimpleNamespace(sampling_params=None), STEP) is None


def test_caps_combine_by_taking_the_smallest_and_none_means_no_cap():
    def fixed(value):
        return lambda req, step: value

    r = request()
    assert da.draft_cap(r, STEP, []) is None
    assert da.draft_cap(r, STEP, [fixed(None), fixed(None)]) is None
    assert da.draft_cap(r, STEP, [fixed(None), fixed(2)]) == 2
    assert da.draft_cap(r, STEP, [fixed(3), fixed(1), fixed(None), fixed(2)]) == 1
    assert da.draft_cap(request(0), STEP, [da.request_cap, fixed(2)]) == 0
    # a source sees the step: e.g. an engine-wide cap that depends on the batch
    by_batch = lambda req, step: 0 if step.num_requests > 2 else None  # noqa: E731
    assert da.draft_cap(r, STEP, [by_batch]) == 0
    assert da.draft_cap(r, da.StepContext(num_requests=1, k=3), [by_batch]) is None


@pytest.mark.parametrize("caps, k", [
    ([0, 0], 0), ([0, 1], 1), ([2, 1, 0], 2), ([0, None], 3), ([None], 3), ([5, 0], 3), ([], 3),
])
def test_the_steps_k_is_lowered_to_the_largest_cap(caps, k):
    assert da.admitted_k([request(c) for c in caps], STEP, (da.request_cap,)) == k


def scheduler(requests: dict, cls=SimpleNamespace):
    return cls(requests=requests)


def test_drafts_handed_to_the_scheduler_are_cut_to_each_requests_cap():
    from vllm.v1.outputs import DraftTokenIds

    seen = []
    wrapped = da._update_draft_token_ids_capped(lambda self, drafts: seen.append(drafts))
    reqs = {"off": request(0), "one": request(1), "free": request(), "big": request(7)}
    drafts = DraftTokenIds(["off", "one", "free", "big", "gone"], [[5, 6, 7]] * 5)
    wrapped(scheduler(reqs), drafts)
    assert seen[0].req_ids == drafts.req_ids
    assert seen[0].draft_token_ids == [[], [5], [5, 6, 7], [5, 6, 7], [5, 6, 7]]


def test_the_steps_k_follows_the_requests_that_will_draft():
    def schedule_step(reqs: dict, k: int) -> int:
        output = SimpleNamespace(num_spec_tokens_to_schedule=k, num_scheduled_tokens=dict.fromkeys(reqs, 1))
        upstream_calls = []
        wrapped = da._update_after_schedule_admitting_k(lambda self, out: upstream_calls.append(out))
        wrapped(scheduler(reqs), output)
        assert upstream_calls == [output]
        return output.num_spec_tokens_to_schedule

    assert schedule_step({"a": request(0), "b": request(0)}, 3) == 0  # none wants drafts: a k=0 step
    assert schedule_step({"a": request(0), "b": request(1)}, 3) == 1
    assert schedule_step({"a": request(0), "b": request()}, 3) == 3
    assert schedule_step({"a": request(1)}, 0) == 0  # the schedule's k=0 stays
    # a request part-way through its prompt drafts nothing in this step: it does not count
    assert schedule_step({"a": request(0), "b": request(prefilling=True)}, 3) == 0
    assert schedule_step({"b": request(prefilling=True)}, 3) == 3  # nothing to decide: vLLM's k


def test_async_placeholders_are_cut_to_each_requests_cap():
    reqs = {"off": request(0, spec=[-1] * 3), "one": request(1, spec=[-1] * 3), "free": request(spec=[-1] * 3),
            "pre": request(0, prefilling=True)}
    output = SimpleNamespace(num_spec_tokens_to_schedule=3, num_scheduled_tokens=dict.fromkeys(reqs, 1))
    da._async_placeholders_capped(lambda self, out: None)(scheduler(reqs), output)
    assert {r: len(req.spec_token_ids) for r, req in reqs.items()} == {"off": 0, "one": 1, "free": 3, "pre": 0}


def test_the_cap_sources_are_built_once_per_scheduler(monkeypatch):
    built = []
    monkeypatch.setattr(da, "build_cap_sources", lambda s: built.append(s) or (da.request_cap,))
    first, second = scheduler({}), scheduler({})
    assert da._sources(first) is da._sources(first)
    da._sources(second)
    assert built == [first, second]
