"""Steps without draft tokens (k=0 from the batch-size schedule): dynamo_spec/vllm_patches/zero_draft_steps.py.

Each case runs offline engines in subprocesses (tests/integration/zero_draft_probe.py):
every request of a phase enters the engine before its first step, so the batch sizes,
and the k the schedule picks for them, are exact.
"""

from __future__ import annotations

import pytest

from tests.integration.zero_draft_probe import run as probe

pytestmark = pytest.mark.integration

K = 3
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, a small robot",
           "Summarise: the meeting moved to Tuesday because"]


def test_k0_steps_sample_as_an_engine_without_speculation(tiny_models):
    """k=0 everywhere: greedy tokens and logprobs, and seeded random samples, are those of
    the same target served without speculation; nothing is drafted."""
    requests = [{"prompt": p, "max_tokens": 12, "logprobs": 3} for p in PROMPTS]
    requests += [{"prompt": p, "max_tokens": 12, "temperature": 0.9, "seed": 7 + i} for i, p in enumerate(PROMPTS)]
    in_process = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}  # one process each: the sampling path is the same
    plain = probe({"target": str(tiny_models["target"]), "phases": [requests]}, env=in_process)["phases"][0]
    k0 = probe({"target": str(tiny_models["target"]), "draft": str(tiny_models["draft"]), "k": K,
                "schedule": [[1, 128, 0]], "phases": [requests]}, env=in_process)["phases"][0]
    assert k0["drafts"] == 0
    for ours, theirs in zip(k0["outputs"], plain["outputs"], strict=True):
        assert ours["token_ids"] == theirs["token_ids"]
        assert len(ours["logprobs"]) == len(theirs["logprobs"])
        for step_ours, step_theirs in zip(ours["logprobs"], theirs["logprobs"]):
            assert step_ours.keys() == step_theirs.keys()
            assert all(abs(step_ours[t] - step_theirs[t]) < 1e-5 for t in step_ours)


def test_k0_steps_skip_the_rejection_sampler_and_the_draft_round_trip(tiny_models):
    """Batch of 8 (k=0 by the schedule), then a lone request (k=3), then a lone request
    that asks for no drafts (``max_draft_tokens`` 0: draft_admission makes its steps k=0).
    With our changes the k=0 steps neither sample through the rejection sampler nor ask
    the worker for draft tokens; the k=3 steps do. vLLM by itself (the changes off) does
    both in every step of the schedule's k=0. The tokens are the same either way."""
    together = [{"prompt": p, "max_tokens": 9} for p in PROMPTS * 2]
    alone = [{"prompt": "Another lone request:", "max_tokens": 25}]
    opted_out = [{"prompt": "A lone request without drafts:", "max_tokens": 9, "max_draft_tokens": 0}]
    spec = {"target": str(tiny_models["fixed_target"]), "draft": str(tiny_models["always_draft"]), "k": K,
            "schedule": [[1, 1, K], [2, 128, 0]], "phases": [together, alone, opted_out], "count_calls": True}
    in_process = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}  # so the probe can count calls in the worker
    ours = probe(spec, env=in_process)
    vllm_own = probe({**spec, "switches": {"zero_draft_steps": False}}, env=in_process)
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


@pytest.mark.parametrize("chunk", [None, 24], ids=["whole-prefills", "chunked-prefills"])
def test_k0_steps_fill_the_draft_kv_cache_as_vllm_does(tiny_models, chunk):
    """Random target and draft (the draft's proposals depend on everything in its KV
    cache). Eight requests share k=0 steps, then the long one is alone and drafts (k=3)
    over positions whose draft KV entries were written by those k=0 steps: the drafts
    are token for token those of vLLM's full draft pass. The control, k=0 steps writing
    nothing there (skipping the draft pass), changes them. With at most 24 tokens a
    step, the prompts are prefilled in chunks: steps with requests part-way through their
    prompt, whose next draft input is a prompt token, not a sampled one."""
    together = [{"prompt": p, "max_tokens": 3} for p in (PROMPTS * 2)[:7]]
    together.append({"prompt": "Tell me about the sea, the wind and the boats.", "max_tokens": 40})
    spec = {"target": str(tiny_models["target"]), "draft": str(tiny_models["draft"]), "k": K,
            "schedule": [[1, 1, K], [2, 128, 0]], "phases": [together], "count_calls": True,
            "max_num_batched_tokens": chunk}
    in_process = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    ours = probe(spec, env=in_process)
    vllm_own = probe({**spec, "switches": {"zero_draft_steps": False}}, env=in_process)
    skipped = probe({**spec, "skip_k0_draft_pass": True}, env=in_process)
    assert len(vllm_own["calls"]["drafts"]) >= 5
    assert ours["calls"]["drafts"] == vllm_own["calls"]["drafts"]
    assert skipped["calls"]["drafts"] != vllm_own["calls"]["drafts"]
    assert ours["phases"][0]["outputs"] == vllm_own["phases"][0]["outputs"]
