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
    assert now == {**old, **SAMPLING_DEFAULTS, "_from_model_config": False}
    assert ensure_sampling_defaults(tmp_path) is False  # idempotent
    assert json.loads((tmp_path / "generation_config.json").read_text()) == now


def test_transformers_and_so_vllm_read_every_default(tmp_path):
    """A generation_config.json written from the model's config (as transformers writes one when it
    converts a model) gets its fields read back in full: transformers drops the fields it does not
    know, presence_penalty among them, from a file marked "_from_model_config"; vLLM reads the file
    through transformers."""
    from transformers import GenerationConfig

    written = {"_from_model_config": True, "bos_token_id": 1, "eos_token_id": 2, "repetition_penalty": 1.1,
               "transformers_version": "5.19.0"}
    (tmp_path / "generation_config.json").write_text(json.dumps(written))
    assert ensure_sampling_defaults(tmp_path) is True
    read = GenerationConfig.from_pretrained(tmp_path).to_diff_dict()
    assert {key: read.get(key) for key in SAMPLING_DEFAULTS} == SAMPLING_DEFAULTS
    assert ensure_sampling_defaults(tmp_path) is False
