"""A request's DRY fields at the API (``serving/dry_fields.py``): checked, moved, completed."""

from __future__ import annotations

import pytest

from dynamo_spec.sampling import dry
from dynamo_spec.serving.dry_fields import DryFieldError, DryFields

pytestmark = pytest.mark.unit

BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
ON = dry.DryParams(0.8)
OFF = dry.DryParams(0.0)


def test_nothing_changes_when_dry_is_off_and_the_request_sets_none() -> None:
    assert DryFields(OFF).rewritten(BODY) is None


def test_the_servers_default_is_written_into_vllm_xargs() -> None:
    out = DryFields(ON).rewritten({**BODY, "vllm_xargs": {"max_draft_tokens": 1}})
    assert out["vllm_xargs"] == {"max_draft_tokens": 1, **dry.as_fields(ON)}
    assert dry.parse(out["vllm_xargs"]) == ON


def test_top_level_fields_move_into_vllm_xargs_and_take_the_rest_from_the_default() -> None:
    out = DryFields(ON).rewritten({**BODY, "dry_allowed_length": 4})
    assert "dry_allowed_length" not in out
    assert dry.parse(out["vllm_xargs"]) == dry.DryParams(0.8, allowed_length=4)
    out = DryFields(OFF).rewritten({**BODY, "dry_multiplier": 1.5, "dry_base": 2})
    assert dry.parse(out["vllm_xargs"]) == dry.DryParams(1.5, base=2.0)


@pytest.mark.parametrize(("body", "param"), [
    ({"dry_multiplier": -1}, "dry_multiplier"),
    ({"vllm_xargs": {"dry_multiplier": 0.8, "dry_penalty_last_n": -5}}, "vllm_xargs.dry_penalty_last_n"),
    ({"dry_multiplier": 0.8, "vllm_xargs": {"dry_multiplier": 0.5}}, "dry_multiplier"),
    ({"dry_base": 2.0}, "dry_base"),  # DRY off here: a base without a multiplier does nothing
])
def test_bad_fields_are_refused_naming_the_field(body: dict, param: str) -> None:
    with pytest.raises(DryFieldError) as err:
        DryFields(OFF).rewritten({**BODY, **body})
    assert err.value.param == param and f"'{param}'" in str(err.value)


def test_an_engine_that_cannot_apply_dry_refuses_requests_that_ask_for_it() -> None:
    fields = DryFields(OFF)
    fields.unavailable = "vLLM's V2 model runner"
    with pytest.raises(DryFieldError, match="not available on this server: vLLM's V2 model runner"):
        fields.rewritten({**BODY, "dry_multiplier": 0.8})
    assert dry.parse(fields.rewritten({**BODY, "dry_multiplier": 0})["vllm_xargs"]).active is False


@pytest.mark.parametrize("field", dry.FIELDS)
@pytest.mark.parametrize("where", ["top", "vllm_xargs"])
def test_a_null_field_means_the_servers_default_for_it(field: str, where: str) -> None:
    """Issue 65: {"dry_multiplier": null} was a 400 about 'dry_base', a field the request never sent."""
    body = {**BODY, field: None} if where == "top" else {**BODY, "vllm_xargs": {field: None}}
    on = DryFields(ON).rewritten(body)
    assert field not in on and on["vllm_xargs"] == dry.as_fields(ON)
    off = DryFields(OFF).rewritten(body)
    assert field not in off and field not in off.get("vllm_xargs", {})
    assert dry.parse(off.get("vllm_xargs", {})) is None or not dry.parse(off["vllm_xargs"]).active


def test_a_null_field_beside_set_ones_takes_the_default_for_that_field_only() -> None:
    out = DryFields(ON).rewritten({**BODY, "dry_multiplier": None, "dry_allowed_length": 5})
    assert dry.parse(out["vllm_xargs"]) == dry.DryParams(0.8, allowed_length=5)
    with pytest.raises(DryFieldError) as err:  # DRY off: a base with a null multiplier still does nothing
        DryFields(OFF).rewritten({**BODY, "dry_multiplier": None, "dry_base": 2.0})
    assert err.value.param == "dry_base"
