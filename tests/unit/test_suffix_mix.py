"""The suffix mix's pieces without an engine: its settings, the engine arguments they make, the feature
check, the server's tree names, the per-source metrics, and the trees themselves (``suffix_mix.Trees``)
over arctic-inference's real ``SuffixDecodingCache`` with a runner's batch laid out as vLLM's is.
The engine path is tests/integration/test_suffix_mix.py and test_suffix_mix_server.py."""

from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from dynamo_spec.config.settings import Settings
from dynamo_spec.engine import features
from dynamo_spec.engine.args import engine_kwargs
from dynamo_spec.engine.paths import EnginePath
from dynamo_spec.serving.suffix_trees import TreeNames
from dynamo_spec.vllm_patches.suffix_mix import (
    DEFAULT_TREE,
    NO_TREE,
    REQUEST_KEY_FIELD,
    SUFFIX_KEY,
    TREE_FIELD,
    MixConfig,
    Trees,
)

pytestmark = pytest.mark.unit


def settings(**suffix) -> Settings:
    return Settings(engine={"model": "t"}, speculative={"model": "d", "num_speculative_tokens": 3,
                                                        "suffix": {"enabled": True, **suffix}})


@pytest.mark.parametrize("field, value", [("max_tokens", 33), ("max_tokens", 0), ("min_score", -1),
                                          ("max_cached_requests", 0), ("scope", "tenants"), ("include_prompt", "x")])
def test_a_bad_value_names_its_field(field, value):
    with pytest.raises(ValueError, match=f"suffix.{field}"):
        settings(**{field: value})


def test_the_mix_needs_an_eagle_draft():
    with pytest.raises(ValueError, match="speculative.suffix: the tree's drafts are mixed with an EAGLE"):
        Settings(engine={"model": "t"}, speculative={"method": "ngram", "suffix": {"enabled": True}})


def test_vllm_gets_the_trees_longest_draft_and_a_schedule_that_keeps_eagle_at_its_k():
    spec = engine_kwargs(settings(max_tokens=16))["speculative_config"]
    assert spec["num_speculative_tokens"] == 16
    assert spec["num_speculative_tokens_per_batch_size"] == [[1, 1, 3]]  # vLLM carries k=3 to every batch size
    off = engine_kwargs(Settings(engine={"model": "t"}, speculative={"model": "d"}))["speculative_config"]
    assert off["num_speculative_tokens"] == 3 and "num_speculative_tokens_per_batch_size" not in off


def test_a_configured_schedule_is_kept_and_the_switch_carries_the_settings():
    s = Settings(engine={"model": "t"}, speculative={
        "model": "d", "num_speculative_tokens": 4, "num_speculative_tokens_per_batch_size": [[1, 2, 4], [3, 64, 0]],
        "suffix": {"enabled": True, "max_tokens": 8, "min_score": 1.5, "scope": "global"}})
    kwargs = engine_kwargs(s)
    assert kwargs["speculative_config"]["num_speculative_tokens"] == 8
    assert kwargs["speculative_config"]["num_speculative_tokens_per_batch_size"] == [[1, 2, 4], [3, 64, 0]]
    switch = kwargs["additional_config"]["dynamo_spec"][SUFFIX_KEY]
    assert MixConfig(**switch) == MixConfig(max_tokens=8, min_score=1.5, scope="global", draft_k=4)
    assert s.speculative.longest_draft == 8


def test_refused_on_model_runner_v2_and_asynchronous_scheduling():
    problems = features.refusals(settings(), EnginePath(True, True, "GPU default"), [])
    (line,) = [p.message for p in problems if "speculative.suffix" in p.message]
    assert "V1 model runner" in line and "synchronous scheduling" in line
    assert not [p for p in features.refusals(settings(), EnginePath(False, False, "CPU"), []) if p.level == "error"]


def test_refused_in_one_line_where_the_tree_cannot_be_imported(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "arctic_inference" else real(name, *a))
    (problem,) = features.refusals(settings(), None, [])
    assert problem.level == "error" and "\n" not in problem.message
    assert "arctic_inference" in problem.message and "--no-build-isolation" in problem.message


def test_arctic_inferences_vllm_plugin_stays_off():
    """arctic-inference registers a vLLM plugin; without ARCTIC_INFERENCE_ENABLED it patches nothing
    (it would force the V1 runner and replace vLLM's own classes)."""
    code = "\n".join([
        "import os, sys",
        "import vllm.plugins as p",
        "from vllm.v1.worker import gpu_model_runner as g",
        "before = dict(vars(g.GPUModelRunner))",
        "p.load_general_plugins()",
        "assert 'arctic_inference.vllm.plugin' in sys.modules  # vLLM did call it",
        "assert 'VLLM_USE_V2_MODEL_RUNNER' not in os.environ",
        "assert dict(vars(g.GPUModelRunner)) == before",
        "assert not [m for m in sys.modules if m.startswith('arctic_inference.vllm.') and m.count('.') > 2]",
    ])
    env = {k: v for k, v in os.environ.items() if not k.startswith("ARCTIC_INFERENCE")}
    env.pop("VLLM_USE_V2_MODEL_RUNNER", None)
    env["VLLM_PLUGINS"] = "arctic_inference"  # its plugin alone (this project's own patches the runner)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


# --- the server's tree names --------------------------------------------------------------------

def test_a_request_drafts_from_its_tenants_tree_whatever_it_sends():
    names = TreeNames("X-Tenant", per_tenant=True, max_trees=2)
    spoofed = {"model": "m", "vllm_xargs": {TREE_FIELD: "acme", "max_draft_tokens": 2, REQUEST_KEY_FIELD: "k"}}
    xargs = names.merged(spoofed, [(b"x-tenant", b"globex")])["vllm_xargs"]
    assert xargs[TREE_FIELD] == "globex" and xargs["max_draft_tokens"] == 2
    assert len(xargs[REQUEST_KEY_FIELD]) == 32 and xargs[REQUEST_KEY_FIELD] != "k"  # the server's own key
    assert names.merged(spoofed, [])["vllm_xargs"][TREE_FIELD] == DEFAULT_TREE
    assert names.merged({"model": "m"}, [(b"x-tenant", b"acme")])["vllm_xargs"][TREE_FIELD] == "acme"
    # past max_trees tenants, a new tenant gets no shared tree (not another's, not the default one)
    assert names.name([(b"x-tenant", b"initech")]) == NO_TREE
    assert names.name([(b"x-tenant", b"acme")]) == "acme"
    assert names.merged({"vllm_xargs": "nonsense"}, []) is None  # vLLM's own 400
    assert TreeNames("X-Tenant", per_tenant=False, max_trees=2).name([(b"x-tenant", b"acme")]) == DEFAULT_TREE


def test_per_source_counts_on_metrics():
    from dynamo_spec.serving.metrics import DynamoSpecMetrics

    registry = CollectorRegistry()
    metrics = DynamoSpecMetrics(registry, model="m", draft_model="d", method="eagle3", num_speculative_tokens=16,
                                version="v")
    assert b"dynamo_spec_source_" not in generate_latest(registry)
    metrics.record_sources({"suffix": {"steps": 4, "draft_tokens": 40, "accepted_tokens": 30},
                            "draft": {"steps": 10, "draft_tokens": 30, "accepted_tokens": 9}})
    text = generate_latest(registry).decode()
    assert 'dynamo_spec_source_verify_steps_total{model="m",source="suffix"} 4.0' in text
    assert 'dynamo_spec_source_accepted_tokens_total{model="m",source="draft"} 9.0' in text
    assert 'dynamo_spec_source_draft_tokens_total{model="m",source="suffix"} 40.0' in text


# --- the trees over a runner's batch --------------------------------------------------------------

class Runner:
    """What Trees reads of vLLM's GPUModelRunner: input_batch (token_ids_cpu, num_tokens_no_spec,
    num_prompt_tokens, req_id_to_index) and requests[req_id].sampling_params.extra_args."""

    def __init__(self, rows: int = 8, width: int = 256):
        self.input_batch = SimpleNamespace(token_ids_cpu=np.zeros((rows, width), np.int32),
                                           num_tokens_no_spec=np.zeros(rows, np.int32),
                                           num_prompt_tokens=np.zeros(rows, np.int32), req_id_to_index={})
        self.requests = {}

    def add(self, req_id: str, prompt: list[int], tree: str | None = None) -> None:
        batch = self.input_batch
        row = min(set(range(len(batch.num_tokens_no_spec))) - set(batch.req_id_to_index.values()))
        batch.req_id_to_index[req_id] = row
        batch.token_ids_cpu[row, :len(prompt)] = prompt
        batch.num_tokens_no_spec[row] = batch.num_prompt_tokens[row] = len(prompt)
        extra = {TREE_FIELD: tree} if tree is not None else None
        self.requests[req_id] = SimpleNamespace(sampling_params=SimpleNamespace(extra_args=extra))

    def emit(self, req_id: str, tokens: list[int]) -> None:
        batch = self.input_batch
        row, n = batch.req_id_to_index[req_id], batch.num_tokens_no_spec[batch.req_id_to_index[req_id]]
        batch.token_ids_cpu[row, n:n + len(tokens)] = tokens
        batch.num_tokens_no_spec[row] = n + len(tokens)

    def drop(self, req_id: str) -> None:
        del self.input_batch.req_id_to_index[req_id]
        del self.requests[req_id]


ANSWER = [50 + i for i in range(40)]


def serve(trees: Trees, runner: Runner, req_id: str, prompt: list[int], answer: list[int], tree: str | None = None,
          aborted: bool = False) -> list[tuple[str, list[int]]]:
    """A request through the runner step by step (one token a step, EAGLE drafting [1, 2, 3]): what
    each step drafted, and from where; then its finish."""
    runner.add(req_id, prompt, tree)
    drafted = []
    for token in answer:
        runner.emit(req_id, [token])
        drafts = [[1, 2, 3]]
        sources = trees.mix(runner, [req_id], drafts, None)
        drafted.append((sources[0], drafts[0]))
    trees.finish(runner, [req_id], [req_id] if aborted else [])
    runner.drop(req_id)
    return drafted


def new_trees(**config) -> Trees:
    return Trees(MixConfig(**{"min_score": 2.0, "max_tokens": 8, **config}), max_model_len=4096)


def test_a_repeated_answer_is_drafted_by_the_tree_and_the_rest_by_the_draft():
    trees, runner = new_trees(), Runner()
    first = serve(trees, runner, "a", [1, 2, 3], ANSWER)
    assert {s for s, _ in first} == {"draft"}  # nothing to copy yet (the answer does not repeat itself)
    second = serve(trees, runner, "b", [9, 9, 9], ANSWER)
    tree_steps = [(i, d) for i, (s, d) in enumerate(second) if s == "suffix"]
    assert len(tree_steps) > len(ANSWER) // 2
    for i, drafts in tree_steps:  # the continuation of the earlier answer, up to max_tokens
        assert drafts == ANSWER[i + 1:i + 1 + 8][:len(drafts)] and 2 <= len(drafts) <= 8


def test_tenants_do_not_see_each_others_trees():
    trees, runner = new_trees(), Runner()
    serve(trees, runner, "a", [1, 2, 3], ANSWER, tree="acme")
    other = serve(trees, runner, "b", [9, 9, 9], ANSWER, tree="globex")
    assert {s for s, _ in other} == {"draft"}
    same = serve(trees, runner, "c", [9, 9, 9], ANSWER, tree="acme")
    assert "suffix" in {s for s, _ in same}
    assert serve(trees, runner, "d", [9], ANSWER, tree=NO_TREE) == [("draft", [1, 2, 3])] * len(ANSWER)


def test_global_scope_shares_one_tree():
    trees, runner = new_trees(scope="global"), Runner()
    serve(trees, runner, "a", [1, 2, 3], ANSWER, tree="acme")
    assert "suffix" in {s for s, _ in serve(trees, runner, "b", [9], ANSWER, tree="globex")}


def test_an_aborted_answer_is_not_kept():
    trees, runner = new_trees(), Runner()
    serve(trees, runner, "a", [1, 2, 3], ANSWER, aborted=True)
    assert trees.stats()["cached_answers"] == 0
    assert {s for s, _ in serve(trees, runner, "b", [9], ANSWER)} == {"draft"}


def test_eviction_keeps_at_most_max_cached_requests_oldest_out_first():
    trees, runner = new_trees(max_cached_requests=3), Runner()
    answers = [[100 * (i + 1) + j for j in range(30)] for i in range(5)]
    for i, answer in enumerate(answers):
        serve(trees, runner, f"r{i}", [1], answer)
        assert trees.stats()["cached_answers"] == min(i + 1, 3)
    assert {s for s, _ in serve(trees, runner, "old", [7], answers[0])} == {"draft"}  # evicted
    assert "suffix" in {s for s, _ in serve(trees, runner, "new", [7], answers[4])}


def test_clear_empties_every_tree_and_in_flight_requests_stay_out():
    trees, runner = new_trees(), Runner()
    serve(trees, runner, "a", [1], ANSWER, tree="acme")
    serve(trees, runner, "b", [1], ANSWER, tree="globex")
    runner.add("live", [4, 5], "acme")
    runner.emit("live", ANSWER[:5])
    trees.mix(runner, ["live"], [[1, 2, 3]], None)
    assert trees.clear() == {"erased_answers": 3}  # the live one's answer so far is in its tree too
    assert trees.stats()["cached_answers"] == 0
    runner.emit("live", ANSWER[5:10])
    assert trees.mix(runner, ["live"], [[1, 2, 3]], None) == ["draft"]
    trees.finish(runner, ["live"], [])
    runner.drop("live")
    assert trees.stats()["cached_answers"] == 0  # in flight at the erase: never kept
    assert {s for s, _ in serve(trees, runner, "c", [1], ANSWER, tree="acme")} == {"draft"}


def test_the_prompt_is_copied_only_with_include_prompt():
    prompt = [7] + ANSWER
    on = serve(new_trees(), Runner(), "a", prompt, ANSWER)
    off = serve(new_trees(include_prompt=False), Runner(), "a", prompt, ANSWER)
    assert "suffix" in {s for s, _ in on} and {s for s, _ in off} == {"draft"}


def test_no_drafts_where_the_step_has_none_and_none_past_the_model_length():
    trees, runner = new_trees(), Runner()
    serve(trees, runner, "a", [1], ANSWER)
    runner.add("b", [2])
    runner.emit("b", ANSWER[:10])
    assert trees.mix(runner, ["b"], [[]], None) == ["draft"]  # a k=0 step (or a prefill chunk): no tree draft
    short = Trees(MixConfig(min_score=0, max_tokens=8), max_model_len=13)
    runner2 = Runner()
    serve(short, runner2, "a", [1], ANSWER[:12])
    runner2.add("b", [2])
    runner2.emit("b", ANSWER[:10])  # 11 tokens: room for 13 - 11 - 1 = 1
    drafts = [[1, 2, 3]]
    assert short.mix(runner2, ["b"], drafts, None) == ["suffix"] and drafts == [[ANSWER[10]]]


def test_confidences_of_a_tree_draft_are_the_trees_per_token_probabilities():
    trees, runner = new_trees(), Runner()
    serve(trees, runner, "a", [1], ANSWER)
    runner.add("b", [2])
    runner.emit("b", ANSWER[:12])
    drafts, confidences = [[1, 2, 3]], [[0.9, 0.8, 0.7]]
    assert trees.mix(runner, ["b"], drafts, confidences) == ["suffix"]
    assert len(confidences[0]) == len(drafts[0]) and all(0 < c <= 1 for c in confidences[0])


def test_the_memory_bound_dynamo_spec_config_shows():
    from dynamo_spec.vllm_patches.suffix_mix import BYTES_PER_ANSWER_TOKEN, memory_bound

    line = memory_bound(2000, 21, 2048)
    assert line.startswith("memory: 21 tree(s) x 2000 answers")
    assert f"~{21 * 2000 * 160 * BYTES_PER_ANSWER_TOKEN / 2**20:,.0f} MiB at 160 tokens" in line
    assert f"at most {21 * 2000 * 2048 * BYTES_PER_ANSWER_TOKEN / 2**20:,.0f} MiB" in line


def test_the_schedule_scales_the_trees_longest_draft_as_it_scales_k():
    config = MixConfig(max_tokens=16, draft_k=4)
    assert [config.longest(k) for k in (0, 1, 2, 3, 4)] == [0, 4, 8, 12, 16]
    assert MixConfig(max_tokens=3, draft_k=4).longest(1) == 1  # never below the step's own k
    assert MixConfig(max_tokens=16).longest(1) == 16  # an engine without the draft's k: unscaled
    trees, runner = Trees(MixConfig(min_score=0, max_tokens=16, draft_k=4), max_model_len=4096), Runner()
    serve(trees, runner, "a", [1], ANSWER)
    runner.add("b", [2])
    runner.emit("b", ANSWER[:20])
    drafts = [[1]]  # a k=1 step
    assert trees.mix(runner, ["b"], drafts, None) == ["suffix"] and drafts == [ANSWER[20:24]]


def test_a_responses_stats_gain_the_requests_split_by_source():
    from vllm.entrypoints.generate.base.serving import build_spec_decoding_metrics
    from vllm.v1.metrics.stats import RequestSpecDecodeMetrics

    from dynamo_spec.serving.suffix_trees import attach_sources

    stats = RequestSpecDecodeMetrics.new(16)
    stats.observe(num_draft_tokens=10, num_accepted=8)
    stats.observe(num_draft_tokens=3, num_accepted=1)
    output = SimpleNamespace(outputs=[SimpleNamespace(spec_decode_metrics=stats)])
    attach_sources(output, {"suffix": {"steps": 1, "draft_tokens": 10, "accepted_tokens": 8},
                            "draft": {"steps": 1, "draft_tokens": 3, "accepted_tokens": 1}})
    body = build_spec_decoding_metrics(output).model_dump()  # what vLLM's OpenAI layer puts in the response
    assert body["mean_acceptance_length"] == 1 + 9 / 2 and body["num_draft_tokens"] == 13
    assert body["sources"]["suffix"] == {"steps": 1, "draft_tokens": 10, "accepted_tokens": 8, "acceptance_length": 9.0}
    assert body["sources"]["draft"]["acceptance_length"] == 2.0
