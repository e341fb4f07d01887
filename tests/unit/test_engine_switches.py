"""Per-engine switches: the settings -> ``additional_config["dynamo_spec"]`` function
(dynamo_spec/engine/args.py ``engine_switches``) and each patch deciding from its own engine's config
(dynamo_spec/vllm_patches: ``switches_of``). Stand-in engine objects; the engines are in
tests/integration/test_per_engine_switches.py."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from dynamo_spec.config.settings import GuardSettings, Settings
from dynamo_spec.engine.args import engine_kwargs, engine_switches
from dynamo_spec.vllm_patches import CONFIG_KEY, switches_of

pytestmark = pytest.mark.unit


def settings(engine_extra: dict | None = None, **speculative) -> Settings:
    return Settings(engine={"model": "t", "extra": engine_extra or {}}, speculative={"model": "d", **speculative})


def engine_config(**switches) -> SimpleNamespace:
    """What a patch sees of its engine's VllmConfig."""
    return SimpleNamespace(additional_config={CONFIG_KEY: switches})


# --------------------------------------------------------------------------- settings -> switches


def test_the_switches_come_from_the_settings_as_plain_json():
    on = engine_switches(settings(guard={"enabled": True, "window_draft_tokens": 60}, draft_penalties=False,
                                  draft_budget={"enabled": True, "draft_token_cost": [[1, 0.2]]}))
    assert on == json.loads(json.dumps(on))  # vLLM hashes additional_config as a JSON dump
    assert on["draft_penalties"] is False and on["draft_confidence"] is True  # the budget needs confidences
    assert on["guard"] == {**GuardSettings().model_dump(exclude={"enabled"}), "window_draft_tokens": 60}
    assert on["draft_budget"]["draft_token_cost"] == [[1, 0.2]]
    assert engine_switches(settings()) == {"draft_penalties": True, "guard": None, "draft_budget": None,
                                           "suffix": None, "draft_confidence": False}


def test_a_users_additional_config_is_kept_beside_the_switches():
    user = {"kda_prefill_backend": "auto", CONFIG_KEY: {"zero_draft_steps": False, "confidence_log": "/tmp/c.jsonl"}}
    kwargs = engine_kwargs(settings({"additional_config": user}))
    assert kwargs["additional_config"]["kda_prefill_backend"] == "auto"
    switches = kwargs["additional_config"][CONFIG_KEY]
    assert switches["zero_draft_steps"] is False and switches["confidence_log"] == "/tmp/c.jsonl"
    assert switches["draft_confidence"] is True  # a confidence log needs the confidences
    assert user[CONFIG_KEY] == {"zero_draft_steps": False, "confidence_log": "/tmp/c.jsonl"}  # not modified
    # without speculation there is nothing to switch: the user's additional_config as given
    off = Settings(engine={"model": "t", "extra": {"additional_config": {"kda_prefill_backend": "auto"}}},
                   speculative={"enabled": False})
    assert engine_kwargs(off)["additional_config"] == {"kda_prefill_backend": "auto"}
    assert "additional_config" not in engine_kwargs(Settings(engine={"model": "t"}, speculative={"enabled": False}))


@pytest.mark.parametrize("given, named", [
    ({"guard": None}, "dynamo_spec.guard"),  # has a settings field: speculative.guard
    ({"draft_penalties": False}, "dynamo_spec.draft_penalties"),
    ({"zero_draft_steps": "no"}, "dynamo_spec.zero_draft_steps"),  # not a bool
])
def test_a_switch_with_a_settings_field_or_of_the_wrong_type_is_refused_where_it_was_set(given, named):
    with pytest.raises(ValueError, match=f"engine.extra.additional_config.{named}: only zero_draft_steps"):
        engine_switches(settings({"additional_config": {CONFIG_KEY: given}}))


def test_vllms_config_hash_keys_on_the_switches():
    """The compile cache (vllm_patches/compile_cache.py) keys on VllmConfig.compute_hash, which dumps
    additional_config whole: an engine with other switches compiles its own graphs once."""
    from vllm.config import VllmConfig

    guard = engine_switches(settings(guard={"enabled": True}))
    hashes = {VllmConfig(additional_config={CONFIG_KEY: s}).compute_hash() for s in (engine_switches(settings()), guard)}
    assert len(hashes) == 2
    assert VllmConfig(additional_config={CONFIG_KEY: dict(guard)}).compute_hash() in hashes  # same switches, same hash


# --------------------------------------------------------------------------- each patch, per engine


def test_switches_of_an_engine_built_without_them_are_empty():
    assert switches_of(None) == {} and switches_of(SimpleNamespace(additional_config={})) == {}
    assert switches_of(SimpleNamespace(additional_config={CONFIG_KEY: "x"})) == {}
    assert switches_of(engine_config(guard=None)) == {"guard": None}


@pytest.mark.parametrize("switches, on", [({"draft_confidence": True}, True), ({"draft_confidence": False}, False),
                                          ({}, False)])
def test_a_proposer_keeps_confidences_only_where_its_engine_asks(switches, on):
    import torch

    from dynamo_spec.vllm_patches import draft_confidence as dc

    seen = []

    def propose(self):  # vLLM's propose, with one greedy sample that keeps its confidence where asked
        kept = self.__dict__.get(dc._KEPT_ATTR)
        seen.append(kept is not None)
        if kept is not None:
            kept.append(torch.tensor([0.25]))
        return torch.zeros(1, 1, dtype=torch.long)

    wrapped = dc._propose_stacking_confidence(propose)
    proposer, other = SimpleNamespace(vllm_config=engine_config(**switches)), SimpleNamespace(
        vllm_config=engine_config(draft_confidence=not on))
    for _ in range(2):  # two engines' proposers in one process, called in turn
        wrapped(proposer)
        wrapped(other)
    assert seen == [on, not on] * 2
    last = proposer.__dict__.get(dc._LAST_ATTR)
    assert (last.tolist() == [[0.25]]) if on else last is None


@pytest.mark.parametrize("switches, on", [({"draft_penalties": True}, True), ({"draft_penalties": False}, False),
                                          ({}, True)])
def test_a_runner_drafts_under_the_penalties_unless_its_engine_turns_them_off(switches, on):
    import torch

    from dynamo_spec.vllm_patches import draft_penalties as dp

    contexts = []
    wrapped = dp._propose_draft_token_ids_keeping_outputs(
        lambda self, *args: contexts.append(self.drafter.__dict__.get(dp._CONTEXT_ATTR)))
    runner = SimpleNamespace(drafter=SimpleNamespace(), vllm_config=engine_config(**switches),
                             model_config=SimpleNamespace(get_vocab_size=lambda: 16),
                             input_batch=SimpleNamespace(req_ids=["r"], num_reqs=1), requests={})  # no DRY request
    metadata = SimpleNamespace(no_penalties=False, prompt_token_ids=torch.zeros(1, 2), output_token_ids=[[3]])
    wrapped(runner, SimpleNamespace(num_spec_tokens_to_schedule=3), torch.tensor([[4, -1]]), metadata)
    assert (contexts[0] is not None) == on
    if on:
        assert contexts[0].outputs == [[3, 4]]
    assert runner.drafter.__dict__.get(dp._CONTEXT_ATTR) is None  # only for the call


def test_zero_draft_steps_follow_each_engines_switch():
    from dynamo_spec.vllm_patches import zero_draft_steps as zds

    sample = zds._sample_without_drafts(lambda self, logits, metadata: "rejection sampler")
    schedule = zds._schedule_recording_k(lambda self: SimpleNamespace(num_spec_tokens_to_schedule=0))

    def runner(**switches):
        return SimpleNamespace(vllm_config=engine_config(**switches), sampler=lambda logits, sampling_metadata: "plain",
                               input_batch=SimpleNamespace(update_async_output_token_ids=lambda: None,
                                                           sampling_metadata=None))

    no_drafts = SimpleNamespace(max_spec_len=0)
    ours, vllms = runner(), runner(zero_draft_steps=False)
    assert sample(ours, None, no_drafts) == "plain" and sample(vllms, None, no_drafts) == "rejection sampler"
    ours_sched, vllms_sched = SimpleNamespace(vllm_config=ours.vllm_config), SimpleNamespace(
        vllm_config=vllms.vllm_config)
    schedule(ours_sched), schedule(vllms_sched)
    assert ours_sched._dynamo_spec_last_k == 0  # post_step skips the draft round trip after it
    assert not hasattr(vllms_sched, "_dynamo_spec_last_k")  # post_step as vLLM's


def test_each_scheduler_writes_the_confidence_log_its_engine_names(tmp_path):
    from dynamo_spec.vllm_patches import draft_admission as da

    observed = da._observed(lambda self, *args: None)
    log = tmp_path / "confidence.jsonl"
    request = SimpleNamespace(**{da._CONFIDENCE_ATTR: [0.9, 0.5, 0.1]})
    logging_one = SimpleNamespace(vllm_config=engine_config(confidence_log=str(log)), requests={"r": request})
    silent_one = SimpleNamespace(vllm_config=engine_config(), requests={"r": request})
    for scheduler in (logging_one, silent_one, logging_one):
        observed(scheduler, None, 3, 1, None, "r")
    assert [json.loads(line) for line in log.read_text().splitlines()] == [
        {"confidence": [0.9, 0.5, 0.1], "accepted": 1}] * 2
    assert da._confidence_log(silent_one) is None and da.guard_of(silent_one) is None
