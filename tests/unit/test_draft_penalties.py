"""Where the draft-side penalties (dynamo_spec/vllm_patches/draft_penalties.py) leave the drafting to vLLM,
the server's start log and ``dynamo-spec config`` / preflight say so (``features.inactive``, from
``DRAFT_PENALTIES`` in engine/features.py): never a silent bypass."""

from __future__ import annotations

import pytest

from dynamo_spec.config.settings import Settings
from dynamo_spec.engine import features, paths

pytestmark = pytest.mark.unit

CPU = {"on_cpu": True, "triton": False, "environ": {}}


def inactive_lines(method: str = "eagle3", **extra) -> list[str]:
    s = Settings(engine={"model": "t"}, speculative={"method": method, "model": "d", "extra": extra})
    return [line for line in features.inactive(s, paths.predict(s, **CPU), [])
            if line.startswith(features.DRAFT_PENALTIES.name)]


@pytest.mark.parametrize("extra, says", [
    ({"use_heterogeneous_vocab": True}, "inactive for a draft with another vocabulary "
                                        "(speculative.extra.use_heterogeneous_vocab)"),
    ({"draft_sample_method": "probabilistic"}, "inactive in steps with a sampled request "
                                               "(speculative.extra.draft_sample_method: probabilistic"),
    ({"parallel_drafting": True}, "inactive for parallel drafting (speculative.extra.parallel_drafting"),
    ({"method": "ngram"}, "inactive for speculative.method 'ngram'"),
])
def test_a_draft_vllm_samples_otherwise_is_said_inactive_at_start(extra, says):
    [line] = inactive_lines(**extra)
    assert line.startswith(f"draft-side penalties: {says}") and line.endswith("vLLM's own way runs")


@pytest.mark.parametrize("extra", [
    {},
    {"use_local_argmax_reduction": True},  # the patch builds the full logits (tests/integration/test_draft_penalties.py)
    {"draft_sample_method": "greedy"},
    {"draft_sample_method": "probabilistic", "rejection_sample_method": "synthetic"},  # vLLM drafts greedily then
])
def test_where_the_patch_acts_nothing_is_said(extra):
    assert inactive_lines(**extra) == []


def test_turned_off_it_says_nothing():
    assert inactive_lines(draft_sample_method="probabilistic") != []
    s = Settings(engine={"model": "t"}, speculative={"method": "eagle3", "model": "d", "draft_penalties": False,
                                                     "extra": {"draft_sample_method": "probabilistic"}})
    assert not [line for line in features.inactive(s, paths.predict(s, **CPU), []) if "penalties" in line]
