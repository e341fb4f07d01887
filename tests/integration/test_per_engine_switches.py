"""Two offline engines in one process, alive at the same time, each with its own switches
(``additional_config["dynamo_spec"]``, dynamo_spec/engine/args.py ``engine_switches``): the patches
are installed process-wide, each engine decides from its own config.

The fixture pair of test_draft_penalties.py: the fixed target's logits are all 0.0 (greedy: token 0
forever; under a presence penalty 0, 1, 2, ...), the draft proposes over the whole target vocabulary
with all-zero logits (token 0 where nothing is penalised). Engine A drafts under the request's
penalties, with no guard and no budget; engine B drafts without them, with the guard (window of 30
drafted tokens) and the confidence budget (free verification: it admits everything, so it changes
no count). So, exactly, for a request with a presence penalty:

- A: every draft accepted (K per step);
- B: no draft accepted, and its guard stops drafting after the window's 30 tokens;
and a random request (temperature 1: the target's choice is uniform, the draft's token 0 is
almost never accepted) keeps drafting in A (no guard) and drafts nothing in B (guard in fallback).
"""

from __future__ import annotations

import contextlib
import json

import pytest

pytestmark = pytest.mark.integration

K = 3
STEPS = 8
MAX_TOKENS = 1 + STEPS * (K + 1)  # the prefill's token, then whole steps of K drafts + 1
WINDOW = 30  # the guard's window of drafted tokens: 10 steps of K, none accepted
GUARD = {"enabled": True, "min_acceptance_rate": 0.5, "window_draft_tokens": WINDOW, "window_seconds": 600,
         "min_draft_tokens": WINDOW, "probe_interval_seconds": 3600, "probe_draft_tokens": WINDOW}
BUDGET = {"enabled": True, "draft_token_cost": [[1, 0.0]], "min_observations": 0, "explore_every": 0}
# Long enough: a first prompt of 4 tokens or fewer crashes vLLM 0.32's AMX attention on head size 32.
PENALISED = "Count the numbers one by one, please, and do not repeat any of them."
RANDOM = "Pick any words you like, one after the other, and keep going for a while."


def run(llm, prompt: str, **params) -> dict:
    from vllm import SamplingParams

    out = llm.generate([prompt], SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, **params),
                       use_tqdm=False)[0].outputs[0]
    stats = out.spec_decode_metrics.to_dict() if out.spec_decode_metrics is not None else {}
    return {"tokens": list(out.token_ids), "drafted": stats.get("num_draft_tokens", 0),
            "accepted": stats.get("num_accepted_draft_tokens", 0)}


def utility(llm, name: str):
    """An EngineCore utility of draft_admission, asked of this engine."""
    return llm.llm_engine.engine_core.call_utility(name)


@pytest.fixture(scope="module")
def engines(tiny_models, tmp_path_factory):
    """Start A, start B; run on B, then on A (both alive); what each did."""
    from dynamo_spec.training.offline_llm import offline_llm
    from dynamo_spec.vllm_patches.draft_admission import BUDGET_UTILITY, GUARD_UTILITY
    from support.tiny_models import build_eagle3_draft

    target = tiny_models["fixed_target"]
    vocab = json.loads((target / "config.json").read_text())["vocab_size"]
    draft = build_eagle3_draft(tmp_path_factory.mktemp("full-vocab-draft"), target, mode="always",
                               draft_vocab_size=vocab)
    common = {"draft": draft, "k": K, "max_model_len": 256, "kv_cache_bytes": 64 << 20, "max_num_seqs": 4,
              "per_request_spec_decode_metrics": "summary", "generation_config": "vllm"}
    with contextlib.ExitStack() as stack:
        a = stack.enter_context(offline_llm(target, draft_penalties=True, **common))
        b = stack.enter_context(offline_llm(target, draft_penalties=False, guard=GUARD, draft_budget=BUDGET,
                                            **common))
        results = {}
        for name, llm in (("B", b), ("A", a)):
            results[name] = {"penalised": run(llm, PENALISED, temperature=0, presence_penalty=0.5),
                             "random": run(llm, RANDOM, temperature=1.0, seed=7),
                             "guard": utility(llm, GUARD_UTILITY), "budget": utility(llm, BUDGET_UTILITY),
                             "switches": llm.llm_engine.vllm_config.additional_config}
    return results


def test_each_engine_got_its_own_switches(engines):
    a, b = engines["A"]["switches"]["dynamo_spec"], engines["B"]["switches"]["dynamo_spec"]
    assert (a["draft_penalties"], a["guard"], a["draft_budget"], a["draft_confidence"]) == (True, None, None, False)
    assert b["draft_penalties"] is False and b["draft_confidence"] is True
    assert b["guard"]["window_draft_tokens"] == WINDOW and b["draft_budget"]["draft_token_cost"] == [[1, 0.0]]


def test_draft_side_penalties_act_in_the_engine_that_has_them_only(engines):
    a, b = engines["A"]["penalised"], engines["B"]["penalised"]
    assert a["tokens"] == b["tokens"] == list(range(MAX_TOKENS))  # the target's choice either way
    assert (a["drafted"], a["accepted"]) == (K * STEPS, K * STEPS)  # A: drafted under the penalty, all accepted
    assert (b["drafted"], b["accepted"]) == (WINDOW, 0)  # B: token 0 proposed, refused, until its guard stopped it


def test_the_guard_acts_in_the_engine_that_has_it_only(engines):
    guard = engines["B"]["guard"]
    assert guard["state"] == "fallback" and guard["transitions"] == {"speculating->fallback": 1}
    assert guard["last_judged"]["draft_tokens"] == WINDOW and guard["last_judged"]["accepted_tokens"] == 0
    assert engines["B"]["random"]["drafted"] == 0  # in fallback: k=0 steps
    assert engines["A"]["guard"] is None
    random = engines["A"]["random"]  # no guard: it keeps drafting at a near-zero acceptance rate
    assert random["drafted"] > 2 * WINDOW and random["accepted"] < 0.1 * random["drafted"]


def test_the_confidence_budget_learns_in_the_engine_that_has_it_only(engines):
    """B's drafts reached its scheduler with their confidences (draft_confidence on in B's proposer):
    its budget observed every verified draft token. A has none."""
    budget = engines["B"]["budget"]
    assert budget["verified"] == WINDOW and budget["admitted"] >= WINDOW
    assert [(c["position"], c["accepted"]) for c in budget["calibration"]] == [(0, 0.0)]
    assert engines["A"]["budget"] is None
