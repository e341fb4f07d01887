"""Steps without draft tokens (k=0 from the batch-size schedule): dynamo_spec/vllm_patches/zero_draft_steps.py.

The cases' offline engines run one after another in one subprocess (tests/integration/zero_draft_probe.py,
the engine in that process, each with its own switches): every request of a phase enters the engine
before its first step, so the batch sizes, and the k the schedule picks for them, are exact.
"""

from __future__ import annotations

import pytest

from tests.integration.zero_draft_probe import run as probe

pytestmark = pytest.mark.integration

K = 3
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, a small robot",
           "Summarise: the meeting moved to Tuesday because"]
IN_PROCESS = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}  # the engine in the probe's process: it counts calls there


def sampling_specs(models) -> dict[str, dict]:
    requests = [{"prompt": p, "max_tokens": 12, "logprobs": 3} for p in PROMPTS]
    requests += [{"prompt": p, "max_tokens": 12, "temperature": 0.9, "seed": 7 + i} for i, p in enumerate(PROMPTS)]
    return {"plain": {"target": str(models["target"]), "phases": [requests]},
            "k0": {"target": str(models["target"]), "draft": str(models["draft"]), "k": K,
                   "schedule": [[1, 128, 0]], "phases": [requests]}}


def round_trip_specs(models) -> dict[str, dict]:
    together = [{"prompt": p, "max_tokens": 9} for p in PROMPTS * 2]
    alone = [{"prompt": "Another lone request:", "max_tokens": 25}]
    opted_out = [{"prompt": "A lone request without drafts:", "max_tokens": 9, "max_draft_tokens": 0}]
    spec = {"target": str(models["fixed_target"]), "draft": str(models["always_draft"]), "k": K,
            "schedule": [[1, 1, K], [2, 128, 0]], "phases": [together, alone, opted_out], "count_calls": True}
    return {"ours": spec, "vllm_own": {**spec, "switches": {"zero_draft_steps": False}}}


def kv_cache_specs(models, chunk: int | None) -> dict[str, dict]:
    together = [{"prompt": p, "max_tokens": 3} for p in (PROMPTS * 2)[:7]]
    together.append({"prompt": "Tell me about the sea, the wind and the boats.", "max_tokens": 40})
    spec = {"target": str(models["target"]), "draft": str(models["draft"]), "k": K,
            "schedule": [[1, 1, K], [2, 128, 0]], "phases": [together], "count_calls": True,
            "max_num_batched_tokens": chunk}
    return {"ours": spec, "vllm_own": {**spec, "switches": {"zero_draft_steps": False}},
            "skipped": {**spec, "skip_k0_draft_pass": True}}


CHUNKS = {"whole-prefills": None, "chunked-prefills": 24}


@pytest.fixture(scope="module")
def probed(tiny_models) -> dict[str, dict[str, dict]]:
    """Every case's engines, one after another in one probe process: {case: {engine: what it did}}."""
    cases = {"sampling": sampling_specs(tiny_models), "round trip": round_trip_specs(tiny_models),
             **{f"kv {name}": kv_cache_specs(tiny_models, chunk) for name, chunk in CHUNKS.items()}}
    specs = [(case, engine, spec) for case, engines in cases.items() for engine, spec in engines.items()]
    results = probe([spec for _, _, spec in specs], env=IN_PROCESS)
    out: dict[str, dict[str, dict]] = {}
    for (case, engine, _), result in zip(specs, results, strict=True):
        out.setdefault(case, {})[engine] = result
    return out


def test_k0_steps_sample_as_an_engine_without_speculation(probed):
    """k=0 everywhere: greedy tokens and logprobs, and seeded random samples, are those of
    the same target served without speculation; nothing is drafted."""
    plain, k0 = probed["sampling"]["plain"]["phases"][0], probed["sampling"]["k0"]["phases"][0]
    assert k0["drafts"] == 0
    for ours, theirs in zip(k0["outputs"], plain["outputs"], strict=True):
        assert ours["token_ids"] == theirs["token_ids"]
        assert len(ours["logprobs"]) == len(theirs["logprobs"])
        for step_ours, step_theirs in zip(ours["logprobs"], theirs["logprobs"]):
            assert step_ours.keys() == step_theirs.keys()
            assert all(abs(step_ours[t] - step_theirs[t]) < 1e-5 for t in step_ours)


def test_k0_steps_skip_the_rejection_sampler_and_the_draft_round_trip(probed):
    """Batch of 8 (k=0 by the schedule), then a lone request (k=3), then a lone request
    that asks for no drafts (``max_draft_tokens`` 0: draft_admission makes its steps k=0).
    With our changes the k=0 steps neither sample through the rejection sampler nor ask
    the worker for draft tokens; the k=3 steps do. vLLM by itself (the changes off) does
    both in every step of the schedule's k=0. The tokens are the same either way."""
    ours, vllm_own = probed["round trip"]["ours"], probed["round trip"]["vllm_own"]
    steps_together = 9  # a prefill step and 8 decode steps, no drafts
    steps_alone = 1 + (25 - 1) // (K + 1)  # a prefill step, then six k=3 steps of 4 tokens
    steps_opted_out = 9  # a prefill step and 8 decode steps, no drafts
    assert [p["drafts"] for p in ours["phases"]] == [p["drafts"] for p in vllm_own["phases"]] == \
        [0, steps_alone - 1, 0]
    assert [(p["calls"]["rejection_sampler"], p["calls"]["take_draft_token_ids"]) for p in vllm_own["phases"]] == \
        [(steps_together, steps_together), (steps_alone, steps_alone), (steps_opted_out, steps_opted_out)]
    # Ours: the rejection sampler only where there are draft tokens (not in the lone
    # request's prefill step), the round trip after every step scheduled with k > 0.
    assert [(p["calls"]["rejection_sampler"], p["calls"]["take_draft_token_ids"]) for p in ours["phases"]] == \
        [(0, 0), (steps_alone - 1, steps_alone), (0, 0)]
    assert [o["token_ids"] for p in ours["phases"] for o in p["outputs"]] == \
        [o["token_ids"] for p in vllm_own["phases"] for o in p["outputs"]]


@pytest.mark.parametrize("chunk", CHUNKS)
def test_k0_steps_fill_the_draft_kv_cache_as_vllm_does(probed, chunk):
    """Random target and draft (the draft's proposals depend on everything in its KV
    cache). Eight requests share k=0 steps, then the long one is alone and drafts (k=3)
    over positions whose draft KV entries were written by those k=0 steps: the drafts
    are token for token those of vLLM's full draft pass. The control, k=0 steps writing
    nothing there (skipping the draft pass), changes them. With at most 24 tokens a
    step, the prompts are prefilled in chunks: steps with requests part-way through their
    prompt, whose next draft input is a prompt token, not a sampled one."""
    ours, vllm_own, skipped = (probed[f"kv {chunk}"][engine] for engine in ("ours", "vllm_own", "skipped"))
    assert len(vllm_own["calls"]["drafts"]) >= 5
    assert ours["calls"]["drafts"] == vllm_own["calls"]["drafts"]
    assert skipped["calls"]["drafts"] != vllm_own["calls"]["drafts"]
    assert ours["phases"][0]["outputs"] == vllm_own["phases"][0]["outputs"]
