"""The confidence draft budget (dynamo_spec/vllm_patches/draft_budget.py): which draft tokens a
step verifies, how the calibration learns, and how draft admission applies the cut. No engine:
stand-in requests and schedulers (the engine is in tests/integration/test_draft_budget.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from dynamo_spec.vllm_patches import draft_admission as da
from dynamo_spec.vllm_patches import draft_budget as db

pytestmark = pytest.mark.unit


def rate_after(survivals, kept, cost):
    """Tokens per plain-step time of a step that verifies `kept` (the model the budget maximises)."""
    b = len(survivals)
    gained = sum(sum(s[:k]) for s, k in zip(survivals, kept))
    return (b + gained) / (1 + cost * sum(kept) / b)


def test_the_first_token_needs_a_survival_above_the_cost():
    assert db.best_prefixes([[0.31]], 0.3) == [1]
    assert db.best_prefixes([[0.29]], 0.3) == [0]
    assert db.best_prefixes([[0.9, 0.5, 0.2]], 0.0) == [3]  # free verification: everything


def test_the_bar_rises_with_the_steps_yield():
    # Alone, a token of survival 0.35 pays at cost 0.3; beside three sure tokens it no longer does:
    # the step already yields more than a plain one, and every verified token slows all of it.
    assert db.best_prefixes([[0.35]], 0.3) == [1]
    assert db.best_prefixes([[0.35], [0.99, 0.98, 0.97]], 0.3) == [0, 3]


@pytest.mark.parametrize("survivals, cost", [
    ([[0.9, 0.72, 0.07], [0.5, 0.1, 0.01], [0.05, 0.04, 0.04]], 0.12),
    ([[0.6, 0.3], [0.55, 0.5], [0.2, 0.19]], 0.25),
    ([[0.99, 0.9, 0.8, 0.7, 0.5, 0.3], [0.4]], 0.38),
])
def test_the_greedy_cut_is_the_best_set_of_prefixes(survivals, cost):
    kept = db.best_prefixes(survivals, cost)
    best = rate_after(survivals, kept, cost)
    import itertools
    for choice in itertools.product(*(range(len(s) + 1) for s in survivals)):
        assert rate_after(survivals, choice, cost) <= best + 1e-12, (choice, kept)


def test_tokens_given_are_kept_and_count_towards_the_bar():
    assert db.best_prefixes([[0.01, 0.001]], 0.3, given=[2]) == [2]
    assert db.best_prefixes([[0.9, 0.8], [0.1]], 0.3, given=[0, 1]) == [2, 1]


def test_the_cost_is_linear_between_measured_points_and_flat_beyond():
    points = ((1, 0.1), (4, 0.1), (8, 0.3), (16, 0.5))
    assert db.cost_at(points, 1) == 0.1
    assert db.cost_at(points, 6) == pytest.approx(0.2)
    assert db.cost_at(points, 12) == pytest.approx(0.4)
    assert db.cost_at(points, 64) == 0.5
    assert db.cost_at(((2, 0.2),), 1) == 0.2


def test_calibration_starts_at_the_confidence_and_learns_the_accepted_share():
    cal = db.Calibration(bins=10, prior_weight=4.0)
    assert cal.survival([0.5, 0.5]) == [0.5, 0.25]
    for _ in range(36):
        cal.observe([0.55, 0.55, 0.55], accepted=1)  # first accepted, second rejected, third not judged
    assert cal.rate(0, 0.55) == pytest.approx((36 + 4 * 0.55) / 40)
    assert cal.rate(1, 0.55) == pytest.approx((0 + 4 * 0.55) / 40)
    assert cal.rate(2, 0.55) == 0.55  # never judged: the prior alone
    assert cal.rate(0, 0.05) == 0.05  # another decile: its own cell
    assert [c["judged"] for c in cal.table()] == [36, 36]


def test_calibration_counts_are_halved_past_max_count_so_it_follows_drift():
    cal = db.Calibration(bins=10, prior_weight=0.0, max_count=10)
    for _ in range(10):
        cal.observe([0.5], accepted=1)
    for _ in range(10):
        cal.observe([0.5], accepted=0)
    accepted, judged, _ = cal.cells[(0, 5)]
    assert judged <= 10 and accepted / judged < 0.5  # recent rejections weigh more than the old acceptances


def test_unseen_cells_are_explored_then_judged_by_their_worth():
    def run(cost: float) -> tuple[list[int], dict]:
        budget = db.DraftBudget(db.BudgetConfig(draft_token_cost=((1, cost),), min_observations=3, explore_every=0))
        verdicts = []
        # Confidence 0.01 everywhere, but every token is accepted: the prior says "never", the target "always".
        for _ in range(20):
            kept = budget.admit([[0.01, 0.01, 0.01]])[0]
            verdicts.append(kept)
            budget.observe([0.01] * kept, accepted=kept)
        return verdicts, budget.snapshot()

    # each cell is explored until it holds 3 judgements (with the tokens before it), then judged by worth
    cheap, snap = run(0.1)
    assert cheap == [1, 1, 1, 2, 2, 2] + [3] * 14
    # explored: only the tokens kept beyond their worth (one learnt judgement already makes the first
    # worth 0.34 > 0.1): the first token once, the second once, the third twice
    assert (snap["steps"], snap["offered"], snap["admitted"], snap["explored"]) == (20, 60, sum(cheap), 4)
    # dearer verification: after 3 judgements the third token's learnt survival (0.82 x 0.75 x 0.60 = 0.37)
    # is below the bar of a step that already yields 2.4 tokens (0.3 x 2.43 / 1.6 = 0.46)
    dear, _ = run(0.3)
    assert dear == [1, 1, 1, 2, 2, 2, 3, 3, 3] + [2] * 11


def test_a_draft_the_target_always_rejects_is_cut_once_its_cells_are_known():
    budget = db.DraftBudget(db.BudgetConfig(draft_token_cost=((1, 0.3),), min_observations=3, explore_every=0))
    kept = []
    for _ in range(10):
        k = budget.admit([[0.95, 0.95]])[0]
        kept.append(k)
        budget.observe([0.95] * k, accepted=0)
    # confident (prior 0.95, worth 2 judgements): verified, the second token to learn its cell, until the
    # first cell's learnt rate (0 + 2 x 0.95) / (n + 2) falls below the cost: after 5 rejections
    assert kept == [2] * 5 + [0] * 5


def test_every_nth_draft_is_verified_whole():
    budget = db.DraftBudget(db.BudgetConfig(draft_token_cost=((1, 0.9),), min_observations=0, explore_every=4))
    kept = [budget.admit([[0.1, 0.1, 0.1]])[0] for _ in range(8)]
    assert kept == [0, 0, 0, 3, 0, 0, 0, 3]


def test_the_config_reaches_the_engine_as_plain_data_in_its_switches():
    import json

    config = db.BudgetConfig(draft_token_cost=((1, 0.2), (8, 0.4)), min_observations=2, explore_every=64)
    switch = config.to_switch()
    assert switch == json.loads(json.dumps(switch))  # what vLLM's config hash (a JSON dump) sees is what arrives
    assert db.BudgetConfig.from_switches({db.BUDGET_KEY: switch}) == config
    assert db.BudgetConfig.from_switches({}) is None and db.BudgetConfig.from_switches({db.BUDGET_KEY: None}) is None


def test_draft_admission_cuts_each_request_to_what_the_budget_admits():
    from vllm.v1.outputs import DraftTokenIds

    from dynamo_spec.vllm_patches import CONFIG_KEY

    config = db.BudgetConfig(draft_token_cost=((1, 0.3),), min_observations=0, explore_every=0)
    engine = SimpleNamespace(additional_config={CONFIG_KEY: {db.BUDGET_KEY: config.to_switch()}})
    seen = []
    wrapped = da._update_draft_token_ids_capped(lambda self, drafts: seen.append(drafts))
    req = lambda cap=None: SimpleNamespace(  # noqa: E731
        sampling_params=SimpleNamespace(extra_args={"max_draft_tokens": cap} if cap is not None else None),
        is_finished=lambda: False, is_prefill_chunk=False)
    sched = SimpleNamespace(requests={"sure": req(), "unsure": req(), "capped": req(1)}, num_spec_tokens=3,
                            vllm_config=engine)
    drafts = DraftTokenIds(["sure", "unsure", "capped"], [[5, 6, 7]] * 3)
    drafts.confidence = [[0.99, 0.98, 0.97], [0.2, 0.9, 0.9], [0.99, 0.99, 0.99]]
    wrapped(sched, drafts)
    assert seen[0].draft_token_ids == [[5, 6, 7], [], [5]]  # the request's own cap comes first
    budget = da.budget_of(sched)
    assert budget.config == config and da.guard_of(sched) is None  # its engine asks for no guard
    assert (budget.offered, budget.admitted) == (7, 4)
    # a request that finished in this step (or is gone) is not offered: vLLM drops its drafts
    sched.requests["sure"].is_finished = lambda: True
    drafts = DraftTokenIds(["sure", "gone", "unsure"], [[5, 6, 7]] * 3)
    drafts.confidence = [[0.99, 0.98, 0.97]] * 2 + [[0.9, 0.9, 0.9]]
    wrapped(sched, drafts)
    assert (budget.offered, budget.admitted) == (10, 7)
    assert seen[1].draft_token_ids[2] == [5, 6, 7]
    seen.clear()
    # drafts without confidences (the confidence patch not installed): the budget does not cut
    wrapped(sched, DraftTokenIds(["unsure"], [[5, 6, 7]]))
    assert seen[0].draft_token_ids == [[5, 6, 7]]


def test_the_engines_switches_carry_the_budget_only_while_it_is_on():
    """The server's and the offline engines' arguments (engine_kwargs) give the engine its budget and the
    drafts' confidences it needs in its own config, and write nothing to this process's environment."""
    import os

    from dynamo_spec.config.settings import Settings
    from dynamo_spec.engine.args import engine_kwargs
    from dynamo_spec.vllm_patches import CONFIG_KEY, switches_of
    from dynamo_spec.vllm_patches.draft_confidence import CONFIDENCE_KEY

    on = Settings(engine={"model": "t"}, speculative={"model": "d", "draft_budget": {
        "enabled": True, "draft_token_cost": [[1, 0.2], [8, 0.4]], "min_observations": 2}})
    off = Settings(engine={"model": "t"}, speculative={"model": "d"})
    environ = dict(os.environ)
    switches = [engine_kwargs(s)["additional_config"][CONFIG_KEY] for s in (on, off)]
    assert dict(os.environ) == environ
    assert switches[0][CONFIDENCE_KEY] is True and switches[1][CONFIDENCE_KEY] is False
    config = db.BudgetConfig.from_switches(switches_of(SimpleNamespace(additional_config={CONFIG_KEY: switches[0]})))
    assert (config.draft_token_cost, config.min_observations) == (((1, 0.2), (8, 0.4)), 2)
    assert db.BudgetConfig.from_switches(switches[1]) is None
