"""The CPU default's sampling defaults in its generation_config.json (ensure_sampling_defaults, run at
every start): what is missing is added, what this project wrote follows its defaults, what the user
set stays, and the log says which is which."""

from __future__ import annotations

import json
import logging

import pytest

from dynamo_spec import default_model
from dynamo_spec.default_model import SAMPLING_DEFAULTS, ensure_sampling_defaults

pytestmark = pytest.mark.unit

CONVERTED = {"_from_model_config": True, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2,
             "transformers_version": "5.19.0"}


def read(model_dir) -> dict:
    return json.loads((model_dir / "generation_config.json").read_text())


def write(model_dir, config: dict) -> None:
    (model_dir / "generation_config.json").write_text(json.dumps(config))


def start(model_dir, caplog) -> tuple[bool, str]:
    """One start's call: whether the file changed, and the line it logged."""
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=default_model.__name__):
        changed = ensure_sampling_defaults(model_dir)
    (line,) = [r.getMessage() for r in caplog.records if "sampling defaults" in r.getMessage()]
    return changed, line


def test_a_file_without_them_gains_every_default_once(tmp_path, caplog):
    write(tmp_path, CONVERTED)
    changed, line = start(tmp_path, caplog)
    assert changed is True
    assert read(tmp_path) == {**CONVERTED, **SAMPLING_DEFAULTS, "_from_model_config": False}
    assert all(f"{key}={value!r} (ours, added)" in line for key, value in SAMPLING_DEFAULTS.items())
    assert start(tmp_path, caplog) == (False, line.replace(", added", ""))  # the next start changes nothing
    assert read(tmp_path) == {**CONVERTED, **SAMPLING_DEFAULTS, "_from_model_config": False}


def test_a_users_edit_survives_restarts_and_a_change_of_defaults(tmp_path, caplog, monkeypatch):
    write(tmp_path, CONVERTED)
    ensure_sampling_defaults(tmp_path)
    write(tmp_path, {**read(tmp_path), "temperature": 0.7, "presence_penalty": 0.0})
    for _ in range(2):
        changed, line = start(tmp_path, caplog)
        assert changed is False
        assert read(tmp_path)["temperature"] == 0.7 and read(tmp_path)["presence_penalty"] == 0.0
    assert "temperature=0.7 (the user's, kept; ours: 0.2)" in line
    assert f"presence_penalty=0.0 (the user's, kept; ours: {SAMPLING_DEFAULTS['presence_penalty']})" in line
    assert "top_p=0.9 (ours)" in line
    # Our defaults change: ours follow, the user's stay.
    monkeypatch.setitem(SAMPLING_DEFAULTS, "temperature", 0.3)
    monkeypatch.setitem(SAMPLING_DEFAULTS, "top_p", 0.95)
    changed, line = start(tmp_path, caplog)
    assert changed is True
    assert {key: read(tmp_path)[key] for key in ("temperature", "top_p", "presence_penalty")} == {
        "temperature": 0.7, "top_p": 0.95, "presence_penalty": 0.0}
    assert "top_p=0.95 (ours, was 0.9)" in line and "temperature=0.7 (the user's, kept; ours: 0.3)" in line


def test_a_missing_value_is_added_beside_the_users(tmp_path, caplog):
    write(tmp_path, CONVERTED)
    ensure_sampling_defaults(tmp_path)
    edited = {key: value for key, value in read(tmp_path).items() if key != "presence_penalty"}
    write(tmp_path, {**edited, "top_p": 0.5})
    changed, line = start(tmp_path, caplog)
    assert changed is True
    assert read(tmp_path) == {**edited, "top_p": 0.5, "presence_penalty": SAMPLING_DEFAULTS["presence_penalty"]}
    assert f"presence_penalty={SAMPLING_DEFAULTS['presence_penalty']} (ours, added)" in line
    assert "top_p=0.5 (the user's, kept; ours: 0.9)" in line


def test_a_file_still_as_written_follows_new_defaults(tmp_path, caplog, monkeypatch):
    write(tmp_path, CONVERTED)
    ensure_sampling_defaults(tmp_path)
    was = SAMPLING_DEFAULTS["presence_penalty"]
    monkeypatch.setitem(SAMPLING_DEFAULTS, "presence_penalty", 0.5)
    monkeypatch.setitem(SAMPLING_DEFAULTS, "repetition_penalty", 1.05)
    changed, line = start(tmp_path, caplog)
    assert changed is True
    assert read(tmp_path) == {**CONVERTED, **SAMPLING_DEFAULTS, "_from_model_config": False}
    assert f"presence_penalty=0.5 (ours, was {was})" in line and "repetition_penalty=1.05 (ours, was 1.0)" in line
    assert "(the user's" not in line


def test_a_file_from_before_the_record_keeps_the_users_values_only(tmp_path, caplog):
    """A model converted by an earlier version has no record of what was written: a value of today's or an
    earlier version's defaults (repetition_penalty 1.1) is ours, any other the user's."""
    old = {**CONVERTED, "_from_model_config": False, "do_sample": True, "temperature": 0.2, "top_p": 0.9,
           "repetition_penalty": 1.1}
    write(tmp_path, old)
    changed, line = start(tmp_path, caplog)
    assert changed is True
    assert read(tmp_path) == {**old, **SAMPLING_DEFAULTS}
    assert "repetition_penalty=1.0 (ours, was 1.1)" in line
    assert f"presence_penalty={SAMPLING_DEFAULTS['presence_penalty']} (ours, added)" in line

    (tmp_path / "other").mkdir()
    write(tmp_path / "other", {**old, "temperature": 0.6})
    changed, line = start(tmp_path / "other", caplog)
    assert read(tmp_path / "other") == {**old, **SAMPLING_DEFAULTS, "temperature": 0.6}
    assert "temperature=0.6 (the user's, kept; ours: 0.2)" in line


def test_transformers_and_so_vllm_read_every_default(tmp_path):
    """A generation_config.json written from the model's config (as transformers writes one when it
    converts a model) gets its fields read back in full: transformers drops the fields it does not
    know, presence_penalty among them, from a file marked "_from_model_config"; vLLM reads the file
    through transformers. A user's value is read as set, and the record of what was written is not
    in the file."""
    from transformers import GenerationConfig

    written = {"_from_model_config": True, "bos_token_id": 1, "eos_token_id": 2, "repetition_penalty": 1.3,
               "transformers_version": "5.19.0"}
    write(tmp_path, written)
    assert ensure_sampling_defaults(tmp_path) is True
    read_back = GenerationConfig.from_pretrained(tmp_path).to_diff_dict()
    assert {key: read_back.get(key) for key in SAMPLING_DEFAULTS} == {**SAMPLING_DEFAULTS, "repetition_penalty": 1.3}
    assert set(read(tmp_path)) == set(written) | set(SAMPLING_DEFAULTS)
    assert ensure_sampling_defaults(tmp_path) is False


def test_a_start_after_a_users_edit_writes_nothing(tmp_path):
    """Nothing to write (a model folder mounted read-only after the user's edit still starts)."""
    write(tmp_path, CONVERTED)
    ensure_sampling_defaults(tmp_path)
    write(tmp_path, {**read(tmp_path), "temperature": 0.7})
    before = {f.name: (f.stat().st_mtime_ns, f.read_bytes()) for f in tmp_path.iterdir()}
    assert ensure_sampling_defaults(tmp_path) is False
    assert {f.name: (f.stat().st_mtime_ns, f.read_bytes()) for f in tmp_path.iterdir()} == before
