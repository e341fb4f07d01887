"""A default model converted before the sampling defaults existed gets them in place."""

from __future__ import annotations

import json

import pytest

from dynamo_spec.default_model import SAMPLING_DEFAULTS, ensure_sampling_defaults

pytestmark = pytest.mark.unit


def test_old_generation_config_gains_the_defaults_once(tmp_path):
    old = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2, "do_sample": False}
    (tmp_path / "generation_config.json").write_text(json.dumps(old))
    assert ensure_sampling_defaults(tmp_path) is True
    now = json.loads((tmp_path / "generation_config.json").read_text())
    assert now == {**old, **SAMPLING_DEFAULTS}
    assert ensure_sampling_defaults(tmp_path) is False  # idempotent
    assert json.loads((tmp_path / "generation_config.json").read_text()) == now
