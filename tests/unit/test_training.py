"""Fast tests of the EAGLE-3 training code on toy shapes (no engine, no downloads)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open

from dynamo_spec.config.eagle3_format import draft_config
from dynamo_spec.default_model import random_draft_weights
from dynamo_spec.training.model import Eagle3Draft, ttt_loss
from dynamo_spec.training.train import TrainConfig, batch_at, epoch_rows, make_batch, save_draft
from dynamo_spec.training.verify import compare
from dynamo_spec.training.vocab import choose_draft_vocab, d2t_from_ids, target_to_draft

pytestmark = pytest.mark.unit

TARGET = {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4,
          "num_key_value_heads": 2, "head_dim": 8, "rms_norm_eps": 1e-5, "vocab_size": 100,
          "max_position_embeddings": 256, "hidden_act": "silu", "num_hidden_layers": 6,
          "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}


def toy_draft(seed: int = 0, vocab: int = 16) -> Eagle3Draft:
    torch.manual_seed(seed)
    return Eagle3Draft(draft_config(TARGET, (1, 3, 4), vocab))


def toy_seq(n: int, prompt_len: int, seed: int, vocab: int = 16) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"input_ids": torch.randint(0, 100, (n,), generator=g), "prompt_len": prompt_len,
            "aux": torch.randn(n, 96, generator=g), "final": torch.randn(n, 32, generator=g)}


def test_d2t_maps_draft_ids_to_frequent_target_ids():
    tokens = [[5, 5, 5, 7, 7, 9, 42], [42, 42, 42, 42]]
    ids = choose_draft_vocab(tokens, size=4, vocab_size=100, always=[2])
    assert ids.tolist() == [2, 5, 7, 42]  # eos forced in, then by frequency, sorted
    d2t = d2t_from_ids(ids)
    assert d2t.dtype == torch.int64
    assert (torch.arange(4) + d2t).tolist() == ids.tolist()  # vLLM: target = draft + d2t
    assert target_to_draft(ids, 100)[42] == 3 and target_to_draft(ids, 100)[6] == -1


def test_d2t_pads_with_unused_ids_when_few_tokens_seen():
    ids = choose_draft_vocab([[9]], size=3, vocab_size=100)
    assert ids.tolist() == [0, 1, 9]


def test_ttt_loss_shapes_and_gradients():
    draft = toy_draft()
    embed = torch.randn(100, 32)
    seqs = [toy_seq(12, 4, 1), toy_seq(9, 3, 2)]
    batch = make_batch(seqs, [0, 1], 64, torch.randn(16, 32))
    assert batch["input_ids"].shape == (1, 21) and batch["target_probs"].shape == (1, 21, 16)
    loss, accs, losses = ttt_loss(draft, embed, batch, steps=3)
    assert loss.ndim == 0 and torch.isfinite(loss)
    assert len(accs) == len(losses) == 3
    loss.backward()
    assert draft.fc.weight.grad is not None and draft.midlayer.self_attn.q_proj.weight.grad.abs().sum() > 0


def test_packed_sequences_do_not_see_each_other():
    """A sequence's loss is the same alone or packed next to another one."""
    draft, embed, emb_d = toy_draft(), torch.randn(100, 32), torch.randn(16, 32)
    a, b = toy_seq(10, 3, 1), toy_seq(8, 2, 2)
    with torch.no_grad():
        _, _, alone = ttt_loss(draft, embed, make_batch([a], [0], 64, emb_d), steps=2)
        # b's loss is zeroed out of the packed row by masking its answer tokens.
        b_masked = dict(b, prompt_len=len(b["input_ids"]))
        _, _, packed = ttt_loss(draft, embed, make_batch([a, b_masked], [0, 1], 64, emb_d),
                                steps=2)
    assert alone == pytest.approx(packed, rel=1e-4)


def test_batches_are_deterministic_and_resumable():
    seqs = [toy_seq(5 + i % 7, 2, i) for i in range(40)]
    cfg = TrainConfig(seed=3, row_tokens=24)
    idx = list(range(40))
    first = [batch_at(seqs, idx, s, cfg, {}) for s in range(30)]
    cache: dict = {}
    again = [batch_at(seqs, idx, s, cfg, cache) for s in range(30)]
    assert first == again
    assert epoch_rows(seqs, idx, 0, cfg) != epoch_rows(seqs, idx, 1, cfg)


def test_checkpoint_has_the_layout_vllm_loads(tmp_path):
    draft = toy_draft()
    cfg = draft_config(TARGET, (1, 3, 4), 16)
    save_draft(draft, cfg, tmp_path)
    expected = random_draft_weights(cfg, seed=0)  # the names/shapes llama_eagle3.py loads
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        assert names == set(expected)
        for name in names:
            assert list(f.get_slice(name).get_shape()) == list(expected[name].shape), name
        assert str(f.get_slice("d2t").get_dtype()) == "I64"
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["architectures"] == ["LlamaForCausalLMEagle3"]
    assert saved["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]
    assert "dynamo_spec_untrained" not in saved


def test_verify_compare_reports_margin_at_first_difference():
    lp = lambda d: {t: SimpleNamespace(logprob=v) for t, v in d.items()}  # noqa: E731
    reference = [([1, 2, 3], [lp({1: -0.1}), lp({2: -0.50, 7: -0.55}), lp({3: -0.2})]),
                 ([4, 5], [lp({4: -0.1}), lp({5: -0.1})])]
    speculative = [([1, 7, 3], None), ([4, 5], None)]
    (diff,) = compare(reference, speculative)
    assert (diff.prompt, diff.position, diff.reference_token, diff.speculative_token) == (0, 1, 2, 7)
    assert diff.margin == pytest.approx(0.05) and diff.near_tie(0.25)


def test_more_chitchat_prompts_never_touch_held_out_conversations(tmp_path):
    import zipfile

    from dynamo_spec.training.data import more_chitchat_prompts

    def conv(*texts):
        return {"messages": [[{"text": t}] for t in texts]}

    convs = {"a": conv("hi", "hello", "how are you", "fine", "bye"),
             "b": conv("held out question", "an answer", "more"),
             "c": conv("what time is it", "noon")}
    with zipfile.ZipFile(tmp_path / "chitchat_dataset-0.9.0-py3-none-any.whl", "w") as zf:
        zf.writestr("chitchat_dataset/dataset.json", json.dumps(convs))
    existing = [{"id": "x", "split": "eval", "source": "chitchat",
                 "messages": [{"role": "user", "content": "held out question"}]},
                {"id": "y", "split": "train", "source": "chitchat",
                 "messages": [{"role": "user", "content": "hi"}]}]
    rows = more_chitchat_prompts(tmp_path, existing, 100, seed=0)
    texts = [[m["content"] for m in r["messages"]] for r in rows]
    # conversation b is held out; a's first cut is already a train prompt
    assert sorted(texts) == sorted([["hi", "hello", "how are you"],
                                    ["hi", "hello", "how are you", "fine", "bye"],
                                    ["what time is it"]])
    assert all(r["split"] == "train" and r["messages"][-1]["role"] == "user" for r in rows)
    assert len({r["id"] for r in rows}) == len(rows)
    assert more_chitchat_prompts(tmp_path, existing, 100, seed=0) == rows  # deterministic


def test_warm_start_takes_the_layers_but_not_the_vocabulary(tmp_path):
    from safetensors.torch import save_file

    from dynamo_spec.training.train import build_draft

    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text(json.dumps(TARGET))
    embed = torch.randn(100, 32)
    save_file({"model.embed_tokens.weight": embed, "model.norm.weight": torch.ones(32)},
              str(target / "model.safetensors"))
    earlier = toy_draft(seed=1)
    save_draft(earlier, draft_config(TARGET, (1, 3, 4), 16), tmp_path / "earlier")
    seqs = [toy_seq(40, 5, seed=s) for s in range(3)]
    cfg = TrainConfig(draft_vocab=16, aux_layers=(1, 3, 4), init_from=tmp_path / "earlier")
    draft, _, d2t_ids, _ = build_draft(target, seqs, cfg, eos_id=0)
    torch.testing.assert_close(draft.fc.weight, earlier.fc.weight.to(torch.bfloat16).float())
    torch.testing.assert_close(draft.midlayer.mlp.down_proj.weight,
                               earlier.midlayer.mlp.down_proj.weight.to(torch.bfloat16).float())
    # the head follows this run's vocabulary (the target's embedding rows), not the file's
    torch.testing.assert_close(draft.lm_head.weight, embed[d2t_ids])
    cold = build_draft(target, seqs, TrainConfig(draft_vocab=16, aux_layers=(1, 3, 4)), 0)[0]
    assert not torch.equal(cold.fc.weight, draft.fc.weight)

    other = draft_config({**TARGET, "intermediate_size": 48}, (1, 3, 4), 16)
    save_draft(Eagle3Draft(other), other, tmp_path / "other")
    with pytest.raises((ValueError, RuntimeError)):
        build_draft(target, seqs, TrainConfig(draft_vocab=16, aux_layers=(1, 3, 4),
                                              init_from=tmp_path / "other"), 0)


def _wheel(path, files: dict):
    import zipfile

    with zipfile.ZipFile(path, "w") as zf:
        for name, text in files.items():
            zf.writestr(name, text)
    return zipfile.ZipFile(path)


def test_code_prompts_are_documented_public_functions(tmp_path):
    import random

    from dynamo_spec.training.data import _read_code

    doc = "Return the chunks of *items*, each of size *n*.\n\n    >>> list(chunks([1, 2, 3], 2))\n    [[1, 2], [3]]\n    "
    src = (f'import os\n\n@decorator\ndef chunks(items, n=2):\n    """{doc}"""\n    return items\n\n'
           'def short(x):\n    """Too short."""\n\n'
           f'def _private(x):\n    """{doc}"""\n\n'
           f'class Thing:\n    def method(self):\n        """{doc}"""\n')
    zf = _wheel(tmp_path / "lib.whl", {"lib/core.py": src, "lib/_impl.py": src,
                                         "lib/tests/test_core.py": src})
    (prompt,) = _read_code(zf, random.Random(0))
    text = prompt[0]["content"]
    assert prompt[0]["role"] == "user"
    assert text.startswith("Complete the following Python function.\n\n```python\n"
                           "def chunks(items, n=2):\n    \"\"\"\n    Return the chunks")
    assert "@decorator" not in text and "return items" not in text
    assert ">>> list(chunks([1, 2, 3], 2))" in text and text.endswith('    """\n```')


def test_bbh_prompts_and_sampled_rows(tmp_path):
    import random

    import yaml

    from dynamo_spec.training.data import _read_bbh, sampled_rows

    task = {"fewshot_config": {"samples": [{"input": "Is 3 odd?\nOptions:\n- Yes\n- No",
                                            "target": "3 is odd. So the answer is Yes."}]}}
    zf = _wheel(tmp_path / "lm_eval.whl", {"lm_eval/tasks/bbh/cot_fewshot/odd.yaml":
                                           yaml.safe_dump(task)})
    (prompt,) = _read_bbh(zf, random.Random(0))
    assert prompt[0]["content"].startswith("Is 3 odd?\nOptions:")
    assert "3 is odd" not in prompt[0]["content"]  # the worked answer is not the prompt

    rows = [{"id": "mmlu-00001", "source": "mmlu", "split": "train", "messages": prompt},
            {"id": "mmlu-00000", "source": "mmlu", "split": "eval", "messages": prompt},
            {"id": "chitchat-00001", "source": "chitchat", "split": "train",
             "messages": prompt}]
    extra = sampled_rows(rows, 2, 0.7)
    # only train prompts of the small sources; held-out prompts never get answers
    assert [r["id"] for r in extra] == ["mmlu-00001-t1", "mmlu-00001-t2"]
    assert all(r["temperature"] == 0.7 and r["split"] == "train" for r in extra)


def test_training_on_nothing_is_refused(tmp_path):
    from dynamo_spec.training.train import train

    with pytest.raises(ValueError, match="no answered sequences"):
        train(tmp_path / "target", [], tmp_path / "out", tmp_path / "ck.pt", TrainConfig(), 0)


def test_aux_layer_rule_is_one_rule():
    from dynamo_spec.config.eagle3_format import aux_layer_problem

    # vLLM's id i is the hidden state after i layers: 0..n are all valid for n layers.
    assert aux_layer_problem([0, 3, 5], 5) is None
    assert "outside 0..5" in aux_layer_problem([1, 6], 5)
    assert "repeat" in aux_layer_problem([2, 2, 3], 5)
    assert draft_config(TARGET, (1, 3, TARGET["num_hidden_layers"]), 16)["eagle_config"][
        "eagle_aux_hidden_state_layer_ids"][-1] == TARGET["num_hidden_layers"]
    with pytest.raises(ValueError, match="outside"):
        draft_config(TARGET, (1, 3, TARGET["num_hidden_layers"] + 1), 16)


def test_train_draft_options_come_from_the_pipeline_config():
    import argparse
    import dataclasses

    from dynamo_spec.training import commands as cli
    from dynamo_spec.training.pipeline import PipelineConfig

    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["train-draft", "--target", "t", "--out", "o", "--aux-layers", "1,2,3"])
    for f in dataclasses.fields(PipelineConfig):
        if f.name in ("target", "out", "aux_layers", "data_from", "timings"):
            continue
        assert getattr(args, f.name) == f.default, f.name
    assert args.aux_layers == (1, 2, 3) and args.data_from == []
    args = parser.parse_args(["train-draft", "--target", "t", "--out", "o", "--self-kinds", "instructions",
                              "--self-answer-temperatures", "0,0.7,1", "--answer-sources", "magpie,mtbench"])
    assert args.self_answer_temperatures == [0.0, 0.7, 1.0]
    assert args.answer_sources == ["magpie", "mtbench"] and args.self_kinds == "instructions"


def test_train_draft_errors_are_one_line(tmp_path):
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-m", "dynamo_spec", "train-draft", "--target", str(tmp_path / "none"),
                             "--out", str(tmp_path / "out"), "--work-dir", str(tmp_path / "work")],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("dynamo-spec train-draft: error: FileNotFoundError")
    assert not (tmp_path / "work").exists()


def test_save_draft_in_the_speculators_format(tmp_path):
    from dynamo_spec.config.eagle3_format import vllm_view

    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text(json.dumps({**TARGET, "architectures": ["LlamaForCausalLM"]}))
    cfg = draft_config(TARGET, (1, 3, 4), 16)
    draft = Eagle3Draft(cfg)
    save_draft(draft, cfg, tmp_path / "vllm")
    save_draft(draft, cfg, tmp_path / "spec", draft_format="speculators", target=target)
    spec = json.loads((tmp_path / "spec" / "config.json").read_text())
    assert spec["speculators_config"]["verifier"] == {"name_or_path": str(target), "architectures": ["LlamaForCausalLM"]}
    view = vllm_view(spec)
    for key, value in cfg.items():
        if key not in ("architectures", "eagle_config"):
            assert view[key] == value, key
    assert view["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]
    assert (tmp_path / "spec" / "model.safetensors").read_bytes() == (tmp_path / "vllm" / "model.safetensors").read_bytes()
    with pytest.raises(ValueError, match="verifier"):
        save_draft(draft, cfg, tmp_path / "x", draft_format="speculators")


def test_corpus_options_and_their_checks():
    import argparse
    from pathlib import Path

    from dynamo_spec.training import commands as cli
    from dynamo_spec.training.pipeline import PipelineConfig

    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["train-draft", "--target", "t", "--out", "o", "--corpus", "data", "--rounds", "1,3",
                              "--add-round"])
    assert (args.corpus, args.rounds, args.add_round) == (Path("data"), (1, 3), True)
    with pytest.raises(ValueError, match="--add-round needs --corpus"):
        PipelineConfig(target=Path("t"), out=Path("o"), add_round=True)
    with pytest.raises(ValueError, match="--rounds needs --corpus"):
        PipelineConfig(target=Path("t"), out=Path("o"), rounds=(1,))


def test_target_checksum_is_the_weights_and_config_not_the_place(tmp_path):
    """The same tensors and config give the same checksum wherever the copy lies, whichever
    transformers version wrote config.json, however the safetensors files split and order
    the tensors; another tensor value, dtype or config value gives another."""
    import shutil

    import torch
    from safetensors.torch import save_file

    from dynamo_spec.training.corpus import target_checksum

    tensors = {"a.weight": torch.arange(6, dtype=torch.float32).view(2, 3), "b.weight": torch.ones(4)}
    target = tmp_path / "a" / "model"
    target.mkdir(parents=True)
    (target / "config.json").write_text(json.dumps({**TARGET, "transformers_version": "5.19.0"}))
    save_file(tensors, target / "model.safetensors")
    (target / "README.md").write_text("not part of it")
    first = target_checksum(target)
    assert first.startswith("sha256:") and len(first) == 7 + 64

    other = tmp_path / "b" / "model"
    shutil.copytree(target, other)
    (other / "README.md").write_text("changed")
    (other / "config.json").write_text(json.dumps({"transformers_version": "6.0.1", **TARGET}, indent=2))
    (other / "model.safetensors").unlink()  # two shards, another order, metadata
    save_file({"b.weight": tensors["b.weight"]}, other / "model-00001-of-00002.safetensors", metadata={"format": "pt"})
    save_file({"a.weight": tensors["a.weight"]}, other / "model-00002-of-00002.safetensors")
    assert target_checksum(other) == first

    save_file({**tensors, "b.weight": torch.ones(4) * 2}, target / "model.safetensors")
    assert target_checksum(target) != first
    save_file({**tensors, "b.weight": torch.ones(4, dtype=torch.bfloat16)}, target / "model.safetensors")
    assert target_checksum(target) != first
    save_file(tensors, target / "model.safetensors")
    assert target_checksum(target) == first
    (target / "config.json").write_text(json.dumps({**TARGET, "hidden_size": TARGET["hidden_size"] + 1}))
    assert target_checksum(target) != first
    (target / "model.safetensors").write_bytes(b"not safetensors")  # hashed by its bytes
    assert target_checksum(target).startswith("sha256:")
    (target / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="weight files"):
        target_checksum(target)


def test_training_dtype_follows_the_host_as_serving_does():
    from dynamo_spec.engine.host import Host
    from dynamo_spec.training.precision import training_dtype

    def host(flags, **environ):
        return Host(on_cpu=True, cpu_model="x", cpu_flags=frozenset(flags), environ=environ)

    assert training_dtype("auto", host({"avx2", "fma"}))[0] == "float32"  # AVX2 only: bf16 would be emulated
    assert training_dtype("auto", host({"avx512f", "avx512_bf16"}))[0] == "bfloat16"
    assert training_dtype("auto", host({"amx_bf16"}, ATEN_CPU_CAPABILITY="avx2"))[0] == "float32"
    assert training_dtype("bfloat16", host({"avx2"})) == ("bfloat16", "as asked")
    with pytest.raises(ValueError, match="dtype"):
        training_dtype("float16")


def test_train_draft_computes_in_the_host_dtype_by_default():
    from dynamo_spec.training.pipeline import PipelineConfig

    assert PipelineConfig(target="t", out="o").dtype == "auto"  # resolved by precision.training_dtype


def test_a_training_step_in_float32_has_no_bf16_autocast():
    from dynamo_spec.training.train import step_loss

    draft = toy_draft()
    seq = toy_seq(24, 4, seed=0)
    embed = torch.randn(100, 32)
    batch = make_batch([seq], [0], 64, embed[:16])
    fp32, _, _ = step_loss(draft, embed, batch, TrainConfig(dtype="float32"))
    plain, _, _ = ttt_loss(draft, embed, batch, 3)
    bf16, _, _ = step_loss(draft, embed, batch, TrainConfig(dtype="bfloat16"))
    assert fp32.dtype == torch.float32 and torch.equal(fp32, plain)  # bit for bit: nothing cast to bf16
    assert not torch.equal(bf16, plain)
    with pytest.raises(ValueError, match="bfloat16 or float32"):
        step_loss(draft, embed, batch, TrainConfig(dtype="float16"))


def test_a_warm_start_that_keeps_the_vocabulary_keeps_it_exactly(tmp_path):
    """A learn cycle's warm start: lm_head, d2t and t2d as the served draft has them, byte for byte, its
    config.json as it is, so the new draft loads in its place; fc and the layer trained."""
    from safetensors.torch import load_file, save_file

    from dynamo_spec.training.train import train

    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text(json.dumps(TARGET))
    save_file({"model.embed_tokens.weight": torch.randn(100, 32), "model.norm.weight": torch.ones(32)},
              str(target / "model.safetensors"))
    served = toy_draft(seed=1)
    with torch.no_grad():
        served.d2t.copy_(torch.arange(16) * 5)  # draft id i -> target id 6 i: not what these rows would choose
    cfg = {**draft_config(TARGET, (1, 3, 4), 16), "fixture": "kept as written"}
    t2d = torch.zeros(100, dtype=torch.bool)
    t2d[torch.arange(16) * 6] = True
    save_draft(served, cfg, tmp_path / "served", extra={"t2d": t2d})
    seqs = [toy_seq(40, 5, seed=s) for s in range(4)]
    run = TrainConfig(steps=2, draft_vocab=8, aux_layers=(1, 3, 4), init_from=tmp_path / "served", keep_vocab=True,
                      dtype="float32", val_sequences=0)
    train(target, seqs, tmp_path / "new", tmp_path / "ck.pt", run, eos_id=0)
    old, new = load_file(str(tmp_path / "served" / "model.safetensors")), load_file(str(tmp_path / "new" / "model.safetensors"))
    assert set(new) == set(old)
    for name in ("lm_head.weight", "d2t", "t2d"):
        assert new[name].dtype == old[name].dtype and torch.equal(new[name], old[name]), name
    assert not torch.equal(new["fc.weight"], old["fc.weight"])
    assert json.loads((tmp_path / "new" / "config.json").read_text()) == cfg
    with pytest.raises(ValueError, match="init_from"):
        train(target, seqs, tmp_path / "x", tmp_path / "x.pt", TrainConfig(keep_vocab=True), eos_id=0)
