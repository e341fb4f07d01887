"""The corpus kept in the repository (dynamo_spec/training/corpus.py), on the tiny target:
rows written by one process come back identically in another, the states recomputed by
the prefill pass equal the decoder's, another target's round is refused, and evaluation
prompts never come back."""

from __future__ import annotations

import gzip
import hashlib
import json
import shutil
import subprocess
import sys

import pytest
import torch
from transformers import AutoTokenizer

from dynamo_spec.training.corpus import (
    CorpusError,
    add_round,
    corpus_states,
    load_manifest,
    read_corpus,
    target_checksum,
    work_rows,
    write_manifest,
)
from dynamo_spec.training.decode import generate_with_states
from dynamo_spec.training.hidden_states import load_shards
from dynamo_spec.training.rows import eval_texts, read_jsonl

pytestmark = pytest.mark.integration

AUX = (1, 2, 3)
GENERATOR = {"generator": "decoder", "dtype": "float32", "max_new_tokens": 12, "seed": 0}
EVAL = eval_texts()


def _prompt(i: int, source: str, *turns: str, **extra) -> dict:
    roles = ("user", "assistant")
    return {"id": f"{source}-{i}", "source": source, "split": "train",
            "messages": [{"role": roles[j % 2], "content": t} for j, t in enumerate(turns)], **extra}


PROMPTS = [
    _prompt(0, "chitchat", "hello there, how are you today?"),
    _prompt(1, "mmlu", "What is the capital of France?"),
    _prompt(2, "humaneval", "def add(a, b):"),
    _prompt(3, "chitchat", "Tell me a story about a cat who lives in a lighthouse."),
    _prompt(4, "chitchat", "hello there, how are you today?", temperature=0.9),
    _prompt(5, "magpie", "Explain how speculative decoding works."),
    # the evaluation set's own requests, as if a source had them: never kept
    _prompt(6, "chitchat", EVAL[0]),
    _prompt(7, "chitchat", "  " + EVAL[1].upper().replace(" ", "\n ") + " "),
    _prompt(8, "chitchat", EVAL[2], "Sure, here it is.", "thanks, and now shorter?"),
]
N_EVAL_PROMPTS = 3


def _generate(target, tmp, dtype: str):
    work = tmp / f"work-{dtype}"
    work.mkdir()
    (work / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in PROMPTS))
    generate_with_states(target, work / "prompts.jsonl", work, aux_layers=AUX, max_new_tokens=12,
                         batch_size=3, rows_per_shard=4, dtype=dtype)
    return work


@pytest.fixture(scope="module")
def work(tiny_models, tmp_path_factory):
    """A work dir as train-draft's decoder leaves it (fp32: answers and captured states)."""
    return _generate(tiny_models["target"], tmp_path_factory.mktemp("corpus"), "float32")


def _kept_answers(work) -> list[dict]:
    """The work dir's answers that are not evaluation prompts, as (id, prompt, answer)."""
    evals = {f"chitchat-{i}" for i in (6, 7, 8)}
    return [r for r in read_jsonl(work / "answers.jsonl") if r["id"] not in evals]


def test_rows_written_by_one_process_are_read_back_by_another(tiny_models, work, tmp_path, repo_root):
    target, data = tiny_models["target"], tmp_path / "data"
    entry = add_round(data, work_rows(work), target, GENERATOR)
    assert entry["round"] == 1 and entry["file"] == "rounds/round-001.jsonl.gz"

    script = ("import json, sys; from dynamo_spec.training.corpus import read_corpus; "
              "print(json.dumps(read_corpus(sys.argv[1], sys.argv[2])))")
    out = subprocess.run([sys.executable, "-c", script, str(data), str(target)], capture_output=True,
                         text=True, timeout=300, cwd=repo_root, check=True)
    rows = json.loads(out.stdout)
    temperature = {p["id"]: p.get("temperature", 0.0) for p in PROMPTS}
    expected = [{"id": r["id"], "source": r["source"], "round": 1, "temperature": temperature[r["id"]],
                 "prompt_ids": r["prompt_ids"], "answer_ids": r["answer_ids"]} for r in _kept_answers(work)]
    assert len(expected) == len(PROMPTS) - N_EVAL_PROMPTS
    assert rows == expected
    assert read_corpus(data, target) == expected  # and in this process

    manifest = json.loads((data / "manifest.json").read_text())
    (e,) = manifest["rounds"]
    assert e == entry and e["target"] == {"name": target.name, "checksum": target_checksum(target)}
    assert e["tokens"] == {"rows": len(expected), "prompt_tokens": sum(len(r["prompt_ids"]) for r in expected),
                           "answer_tokens": sum(len(r["answer_ids"]) for r in expected)}
    assert e["generator"] == {**GENERATOR, "temperatures": [0.0, 0.9]}
    assert e["eval_filter"]["dropped"] == N_EVAL_PROMPTS and e["duplicates_dropped"] == 0
    groups = {g["source"]: g for g in e["groups"]}
    assert sorted(groups) == ["chitchat", "humaneval", "magpie", "mmlu"]
    assert groups["mmlu"]["licence"] == "MIT" and groups["magpie"]["package"] == "the target itself"
    assert sum(g["rows"] for g in groups.values()) == len(expected)
    raw = (data / e["file"]).read_bytes()
    assert hashlib.sha256(raw).hexdigest() == e["sha256"] and len(raw) == e["bytes"]
    assert sorted(p.name for p in data.rglob("*")) == ["manifest.json", "round-001.jsonl.gz", "rounds"]
    assert str(tmp_path) not in (data / "manifest.json").read_text()  # no machine paths

    # the same answers again: nothing new, no round, the manifest untouched
    before = (data / "manifest.json").read_bytes()
    assert add_round(data, work_rows(work), target, GENERATOR) is None
    assert (data / "manifest.json").read_bytes() == before


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_prefill_states_equal_the_states_captured_while_decoding(tiny_models, work, tmp_path, dtype):
    target = tiny_models["target"]
    decoded = work if dtype == "float32" else _generate(target, tmp_path, dtype)
    add_round(tmp_path / "data", work_rows(decoded), target, {**GENERATOR, "dtype": dtype})
    cache = tmp_path / "cache"
    seqs, info = corpus_states(tmp_path / "data", target, aux_layers=AUX, dtype=dtype, cache_root=cache)
    assert info["rounds"] == [1] and info["rows"] == len(seqs) == len(PROMPTS) - N_EVAL_PROMPTS
    assert info["states_tokens"] == sum(len(s["input_ids"]) for s in seqs) and info["states_tokens_per_s"] > 0

    captured = {tuple(s["input_ids"].tolist()): s for s in load_shards(decoded / "hidden")}
    for s in seqs:
        d = captured[tuple(s["input_ids"].tolist())]
        assert s["prompt_len"] == d["prompt_len"]
        for key in ("aux", "final"):
            a, b = s[key].float(), d[key].float()
            assert a.shape == b.shape == (len(s["input_ids"]), (len(AUX) if key == "aux" else 1) * 128)
            if dtype == "float32":  # computed in fp32, both stored as bf16: at most one bf16 step apart
                torch.testing.assert_close(a, b, rtol=2**-7, atol=1e-5)
            else:  # computed in bf16 in another order: a few bf16 steps of the values' scale
                assert (a - b).abs().max() <= 4 * 2**-8 * b.abs().max(), key
                assert (a - b).abs().mean() <= 2**-7 * b.abs().mean(), key
            # one position off would not pass: the states do move along the sequence
            assert not torch.allclose(a[1:], b[:-1], rtol=0.05, atol=0.05)

    again, info = corpus_states(tmp_path / "data", target, aux_layers=AUX, dtype=dtype, cache_root=cache)
    assert info["states_tokens"] == 0 and info["states_tokens_per_s"] is None  # from the cache
    assert all(torch.equal(x["aux"], y["aux"]) for x, y in zip(seqs, again))
    assert len(list(cache.glob("*/round-001/*/hidden/shard-*.safetensors"))) >= 1


def test_a_round_of_another_target_is_refused(tiny_models, work, tmp_path):
    target, other, data = tiny_models["target"], tiny_models["fixed_target"], tmp_path / "data"
    add_round(data, work_rows(work), target, GENERATOR)
    with pytest.raises(CorpusError) as refused:
        read_corpus(data, other)
    message = str(refused.value)
    assert "round 1" in message and target_checksum(target) in message and target_checksum(other) in message
    with pytest.raises(CorpusError, match="round 1"):
        corpus_states(data, other, aux_layers=AUX, dtype="float32", cache_root=tmp_path / "cache")
    assert not (tmp_path / "cache").exists()

    # a copy elsewhere is the same target; an edited config is not
    copy = tmp_path / "elsewhere" / "copy"
    shutil.copytree(target, copy)
    assert target_checksum(copy) == target_checksum(target)
    assert len(read_corpus(data, copy)) == len(PROMPTS) - N_EVAL_PROMPTS
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 1e-6}))
    with pytest.raises(CorpusError, match="round 1"):
        read_corpus(data, copy)

    # a corpus with rounds of two targets: each target reads its own rounds only
    add_round(data, work_rows(work), other, {**GENERATOR, "generator": "other"})
    assert [r["round"] for r in read_corpus(data, other, rounds=[2])] == [2] * (len(PROMPTS) - N_EVAL_PROMPTS)
    assert len(read_corpus(data, target, rounds=[1])) == len(PROMPTS) - N_EVAL_PROMPTS
    with pytest.raises(CorpusError, match="round 2"):
        read_corpus(data, target)
    with pytest.raises(CorpusError, match="no round 3"):
        read_corpus(data, target, rounds=[1, 3])


def test_evaluation_prompts_never_come_back(tiny_models, work, tmp_path):
    """Dropped when a round is written, and again when it is read: a round file that has
    them anyway (edited by hand, or written before the evaluation set grew) keeps them out
    of training."""
    target, data = tiny_models["target"], tmp_path / "data"
    entry = add_round(data, work_rows(work), target, GENERATOR)
    assert entry["eval_filter"]["dropped"] == N_EVAL_PROMPTS

    path = data / entry["file"]
    eval_rows = [{**r, "round": 1} for r in work_rows(work) if r["id"] in {"chitchat-6", "chitchat-7", "chitchat-8"}]
    assert len(eval_rows) == N_EVAL_PROMPTS
    lines = gzip.decompress(path.read_bytes()).decode() + "".join(json.dumps(r) + "\n" for r in eval_rows)
    path.write_bytes(gzip.compress(lines.encode()))
    manifest = load_manifest(data)
    manifest["rounds"][0]["sha256"] = hashlib.sha256(path.read_bytes()).hexdigest()
    write_manifest(data, manifest)
    assert len(lines.splitlines()) == len(PROMPTS)  # they are in the file

    rows = read_corpus(data, target)
    assert len(rows) == len(PROMPTS) - N_EVAL_PROMPTS
    assert not {r["id"] for r in rows} & {r["id"] for r in eval_rows}
    seqs, info = corpus_states(data, target, aux_layers=AUX, dtype="float32", cache_root=tmp_path / "cache")
    assert info["eval_rows_dropped"] == N_EVAL_PROMPTS and len(seqs) == len(rows)
    eval_seqs = {tuple(r["prompt_ids"] + r["answer_ids"]) for r in eval_rows}
    assert not eval_seqs & {tuple(s["input_ids"].tolist()) for s in seqs}


def test_a_damaged_round_file_is_refused(tiny_models, work, tmp_path):
    data = tmp_path / "data"
    entry = add_round(data, work_rows(work), tiny_models["target"], GENERATOR)
    path = data / entry["file"]
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    path.write_bytes(bytes(raw))
    with pytest.raises(CorpusError, match="round 1: .* does not match the sha256"):
        read_corpus(data, tiny_models["target"])


def test_train_draft_adds_a_round_then_trains_on_the_corpus(tiny_models, tmp_path):
    """The command: one run generates, adds its answers as round 1 and trains on the
    corpus; a second run (another work dir, nothing to generate) trains on the corpus
    alone, its states from the cache."""
    from dynamo_spec.training.pipeline import PipelineConfig, run_pipeline

    work = tmp_path / "work"
    work.mkdir()
    (work / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in PROMPTS))
    common = {"target": tiny_models["target"], "steps": 2, "minutes": None, "aux_layers": AUX, "draft_vocab": 64,
              "corpus": tmp_path / "data", "states_cache": tmp_path / "cache", "dtype": "float32",
              "generator": "decoder"}
    first = run_pipeline(PipelineConfig(out=tmp_path / "draft1", work_dir=work, answer_minutes=None,
                                        max_new_tokens=8, add_round=True, **common))
    (entry,) = load_manifest(tmp_path / "data")["rounds"]
    assert entry["generator"]["max_new_tokens"] == 8 and entry["tokens"]["rows"] == len(PROMPTS) - N_EVAL_PROMPTS
    assert first["corpus"]["rounds"] == [1] and first["answer_sequences"] == entry["tokens"]["rows"]
    assert first["corpus"]["states_tokens"] > 0 and "corpus_states" in first["timings_s"]
    assert {s["name"] for s in first["sources"]} == {"chitchat", "humaneval", "magpie", "mmlu"}
    again = run_pipeline(PipelineConfig(out=tmp_path / "draft1", work_dir=work, answer_minutes=None,
                                        max_new_tokens=8, add_round=True, **common))  # resumed: no new round
    assert len(load_manifest(tmp_path / "data")["rounds"]) == 1 and again["corpus"]["rounds"] == [1]

    second = run_pipeline(PipelineConfig(out=tmp_path / "draft2", work_dir=tmp_path / "work2", **common))
    assert second["corpus"]["rounds"] == [1] and second["corpus"]["states_tokens"] == 0
    assert second["answer_sequences"] == first["answer_sequences"] and second["steps"] == 2
    assert not (tmp_path / "work2" / "prompts.jsonl").exists()  # nothing generated
    assert json.loads((tmp_path / "draft2" / "config.json").read_text())["draft_vocab_size"] == 64


def test_vllm_answers_at_the_shipped_defaults_with_second_turns(tiny_models, tmp_path, engines_in_process):
    """--generator vllm --answer-sampling defaults --second-turns: greedy answers under the target's
    generation_config.json penalty differ from plain greedy ones and repeat less; answered first
    turns come back as two-turn prompts; the round's manifest says how it was sampled."""
    from dynamo_spec.training.answers import generate_answers
    from dynamo_spec.training.pipeline import PipelineConfig, run_pipeline
    from dynamo_spec.training.second_turns import FOLLOW_UPS, SUFFIX

    target = tmp_path / "target"
    shutil.copytree(tiny_models["target"], target)
    work = tmp_path / "work"
    work.mkdir()
    greedy = [r for r in PROMPTS if "temperature" not in r]
    (work / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in greedy))
    plain = generate_answers(target, work / "prompts.jsonl", tmp_path / "plain.jsonl", max_new_tokens=24)
    plain = {r["id"]: r["answer_ids"] for r in read_jsonl(plain)}

    # A random target rarely ends an answer by itself, and only answers that ended get a second
    # turn: every token the plain answers never chose ends an answer here. The plain greedy
    # answers loop on a few tokens; penalised ones leave that set (and so end) within a few.
    generation = json.loads((target / "generation_config.json").read_text())
    seen = {t for ids in plain.values() for t in ids}
    stops = [t for t in range(json.loads((target / "config.json").read_text())["vocab_size"]) if t not in seen]
    (target / "generation_config.json").write_text(json.dumps(
        {**generation, "eos_token_id": [generation["eos_token_id"], *stops], "repetition_penalty": 3.0, "top_p": 0.9}))
    summary = run_pipeline(PipelineConfig(
        target=target, out=tmp_path / "draft", work_dir=work, generator="vllm", answer_sampling="defaults",
        second_turns=2, answer_minutes=None, max_new_tokens=24, steps=1, minutes=None, aux_layers=AUX,
        draft_vocab=64, corpus=tmp_path / "data", add_round=True, states_cache=tmp_path / "cache", dtype="float32"))
    (entry,) = load_manifest(tmp_path / "data")["rounds"]
    assert entry["generator"]["answer_sampling"] == "defaults"
    assert entry["generator"]["sampling_defaults"] == {"repetition_penalty": 3.0, "top_p": 0.9}
    assert summary["corpus"]["rounds"] == [1]

    tok = AutoTokenizer.from_pretrained(target)
    rows = read_corpus(tmp_path / "data", target)
    second = [r for r in rows if r["id"].endswith(SUFFIX)]
    assert len(second) == 2
    for r in second:
        text = tok.decode(r["prompt_ids"])
        assert any(f in text for f in FOLLOW_UPS) and text.count("<|im_start|>user") == 2, text

    penalised = {r["id"]: r["answer_ids"] for r in rows if r["id"] in plain}
    assert penalised and any(penalised[i] != plain[i] for i in penalised)

    def repeats(ids):
        return len(ids) - len(set(ids))

    assert sum(map(repeats, penalised.values())) < sum(repeats(plain[i]) for i in penalised)
