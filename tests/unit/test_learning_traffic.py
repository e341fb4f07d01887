"""The application traffic of the learn-cycle benchmark (benchmarks/learning/traffic.py) and the
benchmark's own arithmetic (benchmarks/learning_cycle.py): the stored sets are what the generator
writes, big enough, of both applications, with no held-out subject captured and no everyday prompt;
acceptance length pooled as the gate pools it; the issue's targets read from the figures."""

from __future__ import annotations

import pytest

from benchmarks.learning import traffic
from benchmarks.learning_cycle import Answer, acceptance_length, flat
from dynamo_spec.training.rows import EVERYDAY_EVAL, read_jsonl

pytestmark = pytest.mark.unit


def test_the_stored_sets_are_the_generators():
    captured, heldout = traffic.build()
    assert traffic.load(traffic.CAPTURED) == captured
    assert traffic.load(traffic.HELDOUT) == heldout


def test_sizes_applications_and_format():
    captured, heldout = traffic.load(traffic.CAPTURED), traffic.load(traffic.HELDOUT)
    assert len(captured) >= 300 and len(heldout) >= 60
    for rows in (captured, heldout):
        assert {r["app"] for r in rows} == {"support", "code"}
        assert len({r["id"] for r in rows}) == len(rows)
        assert len({r["messages"][1]["content"] for r in rows}) == len(rows)  # no prompt twice
        for r in rows:
            assert [m["role"] for m in r["messages"]] == ["system", "user"] and r["subject"]
    systems: dict[str, set[str]] = {}
    for r in captured + heldout:
        systems.setdefault(r["app"], set()).add(r["messages"][0]["content"])
    assert all(len(s) == 1 for s in systems.values())  # one fixed system prompt per application
    assert "Summary:" in traffic.SUPPORT_SYSTEM and "Steps:" in traffic.SUPPORT_SYSTEM


def test_no_held_out_subject_is_captured_and_no_everyday_prompt_is_used():
    captured, heldout = traffic.load(traffic.CAPTURED), traffic.load(traffic.HELDOUT)
    traffic.disjoint_subjects(captured, heldout)
    assert not {r["subject"] for r in captured} & {r["subject"] for r in heldout}
    everyday = {m["content"] for r in read_jsonl(EVERYDAY_EVAL) for m in r["messages"]}
    assert not everyday & {m["content"] for r in captured + heldout for m in r["messages"]}
    with pytest.raises(ValueError, match="held-out subjects also captured"):
        traffic.disjoint_subjects(captured, heldout + [{**heldout[0], "subject": captured[3]["subject"].upper()}])


def test_acceptance_length_is_pooled_over_verify_steps():
    def answer(accepted: int, steps: int, ok: bool = True) -> Answer:
        return Answer(ok, tokens=accepted + steps,
                      spec={"num_accepted_draft_tokens": accepted, "num_spec_steps": steps})

    got = acceptance_length([answer(30, 10), answer(0, 30), answer(99, 1, ok=False)])
    assert got["al"] == pytest.approx(1 + 30 / 40) and got["failed"] == 1 and got["requests"] == 2
    assert acceptance_length([Answer(True, spec=None)])["al"] is None  # nothing drafted: no figure


def _summary(heldout_after: float, everyday_after: float, seconds: float, failed: int, identical: bool) -> dict:
    def figures(h: float, e: float) -> dict:
        return {"heldout": {"al": h}, "everyday": {"al": e}, "speedup": {"speedup": 1.2}}

    load = {"tokens_per_s": 10.0}
    return {"before": figures(2.0, 1.74), "after": figures(heldout_after, everyday_after),
            "cycle": {"wall_seconds": seconds + 1, "result": {"seconds": seconds, "timings_s": {}, "promoted": True},
                      "serving_alone": load, "serving_during": load},
            "swap": {"failed": failed, "outputs_identical": identical, "served": {"version": "v001"}, "status": 200}}


def test_the_targets():
    met = flat(_summary(2.4, 1.70, 900, 0, True))
    assert met["heldout_gain"] == pytest.approx(0.2) and all(met["targets_met"].values())
    assert met["after_draft"] == "v001" and met["cycle_seconds"] == 900
    missed = flat(_summary(2.3, 1.68, 901, 1, False))["targets_met"]
    assert not any(missed.values())
    refused = flat({**_summary(2.0, 1.74, 60, 0, True), "after": None, "swap": None})
    assert set(refused["targets_met"].values()) == {None, True}  # only the cycle's time is known
