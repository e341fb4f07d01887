"""A learn cycle's parts that need no engine: which captures it learns from, the held-out split,
the gate's decision, version numbers and crash-safe writes (dynamo_spec/learning/learn.py, gate.py)."""

from __future__ import annotations

import json
import os

import pytest

from dynamo_spec.learning import learn
from dynamo_spec.learning.captures import CaptureStore
from dynamo_spec.learning.gate import Figures, decide, heldout_set

pytestmark = pytest.mark.unit

TARGET = {"name": "tiny", "checksum": "sha256:" + "1" * 64}


def _row(i: int, t: float, prompt=(1, 2), answer=None) -> dict:
    return {"id": f"r{i}", "source": "capture", "tenant": None, "time": t, "endpoint": "chat",
            "prompt_ids": list(prompt), "answer_ids": list(answer if answer is not None else (10 + i, 11 + i)),
            "temperature": 0.0, "sampling": {}, "acceptance": {"drafted": 0, "accepted": 0}}


def _capture(root, rows, target=TARGET):
    store = CaptureStore(root, max_bytes=2**30, retention_days=None, target=target)
    store.append(rows)
    store.close()


def test_new_rows_are_the_unlearnt_ones_once_each_oldest_first(tmp_path):
    rows = [_row(0, 100.0), _row(1, 103.0), _row(2, 101.0),
            _row(3, 104.0, answer=(10, 11)),  # the same prompt and answer as r0: a repeat
            _row(4, 105.0, answer=(12, 13)),  # the same as r2, which was learnt before: nothing new
            _row(5, 106.0, answer=())]  # nothing answered
    _capture(tmp_path, rows)
    got, counts = learn.new_rows(tmp_path, learnt={"r2"})
    assert [r["id"] for r in got] == ["r0", "r1"]
    assert counts == {"read": 6, "learnt_before": 1, "repeats": 3}
    got, _ = learn.new_rows(tmp_path, learnt=set())
    assert [r["id"] for r in got] == ["r0", "r2", "r1"]  # by time


def test_the_newest_tenth_is_held_out():
    rows = [_row(i, float(i)) for i in range(25)]
    train, held = learn.split_heldout(rows, 0.1)
    assert [r["id"] for r in held] == ["r22", "r23", "r24"] and len(train) == 22
    train, held = learn.split_heldout(rows[:3], 0.1)
    assert len(held) == 1 and len(train) == 2  # at least one held out
    with pytest.raises(learn.LearnInputError, match="at least 2"):
        learn.split_heldout(rows[:1], 0.1)


def test_captures_of_another_target_are_refused(tmp_path):
    _capture(tmp_path, [_row(0, 1.0)])
    learn.check_target(tmp_path, TARGET["checksum"], "tiny")
    with pytest.raises(learn.LearnInputError, match="written by target 'tiny'.*engine.model 'other'") as exc:
        learn.check_target(tmp_path, "sha256:" + "2" * 64, "other")
    assert "2" * 64 in str(exc.value) and "DELETE /admin/learning/captures" in str(exc.value)
    learn.check_target(tmp_path / "none", "sha256:x", "other")  # no captures: nothing to refuse


@pytest.mark.parametrize(("after", "promoted", "why"), [
    (Figures(2.10, 1.70), True, "held-out +0.100"),
    (Figures(2.04, 1.74), False, "below learning.min_gain 0.05"),
    (Figures(2.50, 1.68), False, "above learning.max_loss 0.05"),
    (Figures(2.05, 1.69), True, "everyday -0.050"),  # both on the boundary
])
def test_the_gate_decides_on_both_sets(after, promoted, why):
    verdict = decide(Figures(2.00, 1.74), after, min_gain=0.05, max_loss=0.05)
    assert verdict.promoted is promoted and why in verdict.reason


def test_held_out_requests_take_their_answers_length_within_the_context():
    rows = [{"prompt_ids": [1] * 10, "answer_ids": [2] * 40}, {"prompt_ids": [1] * 10, "answer_ids": [2] * 300},
            {"prompt_ids": [1] * 500, "answer_ids": [2] * 40}, {"prompt_ids": [1] * 511, "answer_ids": [2] * 4}]
    s = heldout_set(rows, max_tokens=128, max_model_len=512)
    assert s.max_tokens == [40, 128, 11] and len(s.prompts) == 3


def test_versions_are_numbered_past_every_one_on_disk(tmp_path):
    drafts = tmp_path / "drafts"
    assert learn.next_version(drafts, learn.load_manifest(tmp_path)) == "v001"
    (drafts / "v001").mkdir(parents=True)
    (drafts / ".v002.tmp-123").mkdir()  # a killed cycle's
    assert learn.next_version(drafts, learn.load_manifest(tmp_path)) == "v003"
    manifest = {"format": 1, "current": "v007", "versions": [{"version": "v007"}]}
    assert learn.next_version(drafts, manifest) == "v008"


def test_atomic_writes_leave_the_old_file_or_the_new_one(tmp_path):
    path = tmp_path / "drafts" / "manifest.json"
    learn.write_atomic(path, b'{"a": 1}\n')
    learn.write_atomic(path, b'{"a": 2}\n', mode=0o600)
    assert json.loads(path.read_text()) == {"a": 2}
    assert os.listdir(path.parent) == ["manifest.json"]  # no temp file left


def test_one_cycle_at_a_time(tmp_path):
    with learn.cycle_lock(tmp_path), pytest.raises(learn.LearnInputError, match="another learn cycle"), \
            learn.cycle_lock(tmp_path):
        pass
    with learn.cycle_lock(tmp_path):  # released
        pass


def test_learn_draft_options_come_from_learn_options():
    import dataclasses

    from dynamo_spec.cli import build_parser

    args, extra = build_parser().parse_known_args(["learn-draft", "--config", "c.yaml", "--steps", "7",
                                                   "--learning.min_gain", "0.1"])
    assert args.steps == 7 and extra == ["--learning.min_gain", "0.1"] and args.accepts_overrides
    defaults = learn.LearnOptions()
    for f in dataclasses.fields(learn.LearnOptions):
        if f.name != "steps":
            assert getattr(args, f.name) == getattr(defaults, f.name), f.name


def test_the_draft_learnt_from_is_the_promoted_version_else_the_configured_one(tmp_path):
    from dynamo_spec.config.settings import Settings

    configured = tmp_path / "shipped"
    configured.mkdir()
    (configured / "model.safetensors").write_bytes(b"")
    settings = Settings(engine={"model": str(tmp_path / "target")},
                        speculative={"method": "eagle3", "model": str(configured), "num_speculative_tokens": 3},
                        learning={"dir": str(tmp_path / "learning")})
    root = tmp_path / "learning"
    assert learn.served_draft(settings, root, TARGET["checksum"]) == (configured, None)
    v2 = root / "drafts" / "v002"
    v2.mkdir(parents=True)
    manifest = {"format": 1, "current": "v002", "versions": [
        {"version": "v001", "path": str(root / "drafts" / "v001"), "target": TARGET},
        {"version": "v002", "path": str(v2), "target": TARGET}]}
    learn.write_atomic(root / "drafts" / "manifest.json", json.dumps(manifest).encode())
    assert learn.served_draft(settings, root, TARGET["checksum"]) == (v2, "v002")
    # a version promoted for another target is not this target's draft
    assert learn.served_draft(settings, root, "sha256:" + "2" * 64) == (configured, None)
    off = settings.model_copy(update={"speculative": settings.speculative.model_copy(update={"enabled": False})})
    with pytest.raises(learn.LearnInputError, match="speculative"):
        learn.served_draft(off, tmp_path / "none", TARGET["checksum"])
