"""Target-written prompts (Magpie) on the tiny target: the pre-query template, sampling
that does not depend on the batching, and the filters."""

from __future__ import annotations

import json

import pytest
import torch

from dynamo_spec.training.answers import chat_prompt_ids
from dynamo_spec.training.self_prompts import (
    keep_query,
    merge_prompt_files,
    pre_query_ids,
    sample_requests,
    select_queries,
    write_self_prompts,
)

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def target(tiny_models):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = tiny_models["target"]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return path, model, AutoTokenizer.from_pretrained(path)


def test_pre_query_template_is_where_a_user_message_starts(target):
    _, _, tok = target
    head = tok.decode(pre_query_ids(tok))
    full = tok.decode(chat_prompt_ids(tok, [{"role": "user", "content": "Name a cat."}]))
    assert head.endswith("user\n")
    assert full.startswith(head + "Name a cat.")


def test_sampled_requests_do_not_depend_on_the_batching(target):
    _, model, tok = target
    head, eos = pre_query_ids(tok), {tok.eos_token_id}
    heads = [head] * 5 + [head + tok.encode("Which", add_special_tokens=False)] * 2
    a = sample_requests(model, heads, eos, seed=3, max_new_tokens=12, batch_size=2)
    b = sample_requests(model, heads, eos, seed=3, max_new_tokens=12, batch_size=5)
    c = sample_requests(model, heads, eos, seed=4, max_new_tokens=12, batch_size=5)
    assert a == b
    assert a != c
    assert len({tuple(x) for x in a}) > 1  # each request has its own generator


def test_select_queries_keeps_finished_new_and_clean_requests(target):
    _, _, tok = target
    eos = tok.eos_token_id

    def req(text, end=True):
        return tok.encode(text, add_special_tokens=False) + ([eos] if end else [])

    requests = [req("How do I keep basil alive indoors?", end=False),  # cut off
                req("How do I keep basil alive?"),
                req("short"),
                req("HOW DO I KEEP BASIL ALIVE?"),  # a duplicate
                req("What is a prime number, simply put?"),
                req("Tell me a story about a fox.")]
    assert select_queries(tok, requests, {eos}, n=2, min_chars=16) == [
        "How do I keep basil alive?", "What is a prime number, simply put?"]
    assert select_queries(tok, requests, {eos}, n=10)[-1] == "Tell me a story about a fox."
    # a request an earlier run already has is not kept again
    assert select_queries(tok, requests, {eos}, n=10,
                          known={"tell me a story about a fox."})[-1] == (
        "What is a prime number, simply put?")
    # nor one close to an evaluation prompt (most of its words shared)
    assert select_queries(tok, requests, {eos}, n=10,
                          avoid=("Tell me a short story about a fox!",))[-1] == (
        "What is a prime number, simply put?")
    assert select_queries(tok, requests, {eos}, n=10,
                          avoid=("Tell me about foxes and their dens.",))[-1] == "Tell me a story about a fox."
    # a started request: start + request + end, the start counted in the checks
    kinds = [("", "")] * 5 + [("Which of the following", "\nExplain.")]
    started = requests[:5] + [req(" is a mammal? (A) cat (B) trout")]
    assert select_queries(tok, started, {eos}, n=10, kinds=kinds)[-1] == (
        "Which of the following is a mammal? (A) cat (B) trout\nExplain.")
    assert not keep_query("Explain <|im_start|>user this", 4)


def test_written_prompts_are_rows_like_the_other_sources(target, tmp_path):
    path, _, _ = target
    out = tmp_path / "self.jsonl"
    write_self_prompts(path, out, 4, seed=1, max_new_tokens=16, batch_size=3, min_chars=1,
                       attempts=3, dtype="float32")
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) <= 4
    for i, r in enumerate(rows):
        assert r["id"] == f"magpie-s1-{i:05d}" and r["split"] == "train"  # seed 1
        assert r["source"] == "magpie" and keep_query(r["messages"][0]["content"], 1)
    before = out.stat().st_mtime_ns
    write_self_prompts(path, out, 4)  # written once
    assert out.stat().st_mtime_ns == before

    other = tmp_path / "prompts.jsonl"
    other.write_text(json.dumps({"id": "chitchat-0", "source": "chitchat", "split": "train",
                                 "messages": []}) + "\n")
    merged = merge_prompt_files(tmp_path / "all.jsonl", other, out)
    assert [json.loads(x)["id"] for x in merged.read_text().splitlines()] == (
        ["chitchat-0"] + [r["id"] for r in rows])
