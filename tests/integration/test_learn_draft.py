"""``dynamo-spec learn-draft`` end to end on a tiny target: captures written by the capture store,
a replay round in a corpus folder, a served draft trained briefly, then learn cycles through the
command line: the gate refusing (exit 3, the version kept), the same captures promoted (exit 0,
the vocabulary kept, the served draft's figures reused), bad input (exit 2, one line), and a
cycle killed after writing its version (nothing promoted).

The target is the tiny fixture target with its head tied to its embedding (as SmolLM2's is: the
training's target distribution is the embedding's); its greedy answers repeat one token, which a
draft learns in a few steps and a draft trained for one step does not predict."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from dynamo_spec.learning.captures import CaptureStore
from dynamo_spec.training.corpus import add_round, target_checksum
from dynamo_spec.training.precision import training_dtype
from dynamo_spec.training.rows import write_jsonl
from support.in_process import in_process_env
from support.learning_world import AUX, build_tied_target, greedy_answers, train_served_draft

pytestmark = pytest.mark.integration

SYSTEM = "You are the help desk of Lighthouse Books. Answer in two short lines."
WORDS = ("cat", "dog", "sea", "sun", "tree", "city", "river", "book", "code", "list", "sort", "sum", "map", "file",
         "loop", "road", "bird", "rain", "snow", "star")
OPTIONS = ["--steps", "30", "--lr", "1e-3", "--everyday-prompts", "4", "--max-tokens", "16"]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A tied tiny target, a corpus round of its everyday answers, a draft trained one step on
    them (the served draft), and 40 answered requests of one application (to capture)."""
    root = tmp_path_factory.mktemp("learn")
    target = build_tied_target(root / "target")

    everyday = [[{"role": "user", "content": "Tell me about " + " and ".join(WORDS[i % 7:i % 7 + 3]) + f", take {i}."}]
                for i in range(24)]
    app = [[{"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"order {i}: {WORDS[i % 20]} {WORDS[(3 * i) % 20]}?"}] for i in range(40)]
    answered = greedy_answers(target, everyday + app, new_tokens=16)
    replay = [{"id": f"magpie-{i}", "source": "magpie", "round": None, "temperature": 0.0, "prompt_ids": p,
               "answer_ids": a} for i, (p, a) in enumerate(answered[:len(everyday)])]
    add_round(root / "data", replay, target, {"generator": "decoder", "dtype": "float32"})
    write_jsonl(root / "replay.jsonl", replay)
    train_served_draft(target, root / "replay.jsonl", root / "served", AUX)
    rows = [{"id": f"req-{i}", "prompt_ids": p, "answer_ids": a} for i, (p, a) in enumerate(answered[len(everyday):])]
    return {"root": root, "target": target, "data": root / "data", "served": root / "served", "rows": rows,
            "checksum": target_checksum(target)}


def _capture(learning: Path, rows: list[dict], target: dict) -> None:
    store = CaptureStore(learning, max_bytes=2**30, retention_days=None, target=target)
    now = time.time()
    store.append([{**r, "source": "capture", "tenant": None, "time": now - len(rows) + i, "endpoint": "chat",
                   "temperature": 0.0, "sampling": {"temperature": 0.0}, "acceptance": {"drafted": 3, "accepted": 1}}
                  for i, r in enumerate(rows)])
    store.close()


def _config(world, tmp_path: Path, **learning) -> Path:
    config = {"engine": {"model": str(world["target"]), "dtype": "auto", "max_model_len": 512,
                         "kv_cache_memory_bytes": "64MiB"},
              "speculative": {"method": "eagle3", "model": str(world["served"]), "num_speculative_tokens": 3,
                              "aux_hidden_state_layer_ids": list(AUX)},
              "learning": {"dir": str(tmp_path / "learning"), "threads": len(os.sched_getaffinity(0)), **learning}}
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _learn(world, config: Path, *extra: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dynamo_spec", "learn-draft", "--config", str(config),
                           "--corpus", str(world["data"]), *OPTIONS, *extra],
                          capture_output=True, text=True, timeout=timeout, env=in_process_env())


def _manifest(learning: Path) -> dict:
    return json.loads((learning / "drafts" / "manifest.json").read_text())


def test_the_gate_refuses_then_the_same_captures_are_promoted(world, tmp_path):
    learning = tmp_path / "learning"
    _capture(learning, world["rows"], {"name": world["target"].name, "checksum": world["checksum"]})
    config = _config(world, tmp_path)

    refused = _learn(world, config, "--learning.min_gain", "5")
    assert refused.returncode == 3, refused.stderr[-3000:]
    result = json.loads(refused.stdout.strip().splitlines()[-1])
    assert result["promoted"] is False and "below learning.min_gain 5" in result["reason"]
    assert (result["rows"], result["heldout_rows"], result["replay_rows"]) == (36, 4, 24)
    assert result["heldout_al_after"] > result["heldout_al_before"]  # a gain, but not the one asked for
    v1 = learning / "drafts" / "v001"
    assert result["path"] == str(v1.resolve()) and (v1 / "model.safetensors").is_file()  # kept ...
    manifest = _manifest(learning)
    assert manifest["current"] is None and [v["version"] for v in manifest["versions"]] == ["v001"]  # ... not promoted
    assert manifest["versions"][0]["gate"]["promoted"] is False
    assert not (learning / "learn-state.json").exists()  # its rows are learnt again next time
    assert "learn-draft: states" in refused.stderr and "train" in refused.stderr  # progress on stderr

    promoted = _learn(world, config)
    assert promoted.returncode == 0, promoted.stderr[-3000:]
    result = json.loads(promoted.stdout.strip().splitlines()[-1])
    for key in ("path", "promoted", "heldout_al_before", "heldout_al_after", "everyday_al_before",
                "everyday_al_after", "rows", "seconds"):
        assert key in result, key
    assert result["promoted"] is True and result["version"] == "v002" and result["rows"] == 36
    assert result["heldout_al_after"] - result["heldout_al_before"] >= 0.05  # learning.min_gain's default
    assert result["everyday_al_before"] - result["everyday_al_after"] <= 0.05
    manifest = _manifest(learning)
    assert manifest["current"] == "v002"
    entry = manifest["versions"][-1]
    assert entry["gate"]["before_from_cache"] is True  # the served draft, the same sets: measured once
    assert entry["gate"]["before"] == manifest["versions"][0]["gate"]["before"]
    assert entry["parent"] == {"path": str(world["served"].resolve()), "version": None}
    assert entry["dtype"]["training"] == training_dtype("auto")[0]
    assert entry["captures"]["rows"] == 36 and entry["captures"]["heldout_rows"] == 4
    assert set(entry["timings_s"]) == {"captures", "replay", "states", "train", "write", "gate"}
    assert entry["replay"]["rows"] == 24 and entry["training"]["steps"] == 30

    # the served draft's vocabulary and shape, exactly; its layers trained
    new, old = load_file(str(learning / "drafts/v002/model.safetensors")), load_file(str(world["served"] / "model.safetensors"))
    assert set(new) == set(old)
    for name in ("lm_head.weight", "d2t"):
        assert new[name].dtype == old[name].dtype and torch.equal(new[name], old[name]), name
    assert not torch.equal(new["fc.weight"], old["fc.weight"])
    served_config = json.loads((world["served"] / "config.json").read_text())
    assert json.loads((learning / "drafts/v002/config.json").read_text()) == served_config
    # the training rows are learnt; the held-out ones never were
    learnt = set(json.loads((learning / "learn-state.json").read_text())["learnt"])
    assert learnt == {f"req-{i}" for i in range(36)}
    assert not (learning / "work").exists() or not any((learning / "work").iterdir())


def test_bad_input_is_one_line_and_exit_2(world, tmp_path):
    config = _config(world, tmp_path)
    nothing = _learn(world, config, timeout=300)
    assert nothing.returncode == 2 and nothing.stdout == ""
    assert nothing.stderr.strip().splitlines()[-1].startswith("dynamo-spec learn-draft: error: no captures to learn from")

    _capture(tmp_path / "learning", world["rows"], {"name": "another-model", "checksum": "sha256:" + "0" * 64})
    other = _learn(world, config, timeout=300)
    assert other.returncode == 2 and other.stdout == "" and "Traceback" not in other.stderr
    line = other.stderr.strip().splitlines()[-1]
    assert "written by target 'another-model'" in line and world["checksum"] in line
    assert not (tmp_path / "learning" / "drafts" / "manifest.json").exists()


def test_a_killed_cycle_promotes_nothing(world, tmp_path):
    learning = tmp_path / "learning"
    _capture(learning, world["rows"], {"name": world["target"].name, "checksum": world["checksum"]})
    config = _config(world, tmp_path)
    proc = subprocess.Popen([sys.executable, "-m", "dynamo_spec", "learn-draft", "--config", str(config),
                             "--corpus", str(world["data"]), *OPTIONS], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True, env=in_process_env())
    try:
        for line in proc.stderr:  # killed once its version is written, before the gate decides
            if "learn-draft: gate ..." in line:
                os.killpg(proc.pid, signal.SIGKILL)
                break
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    assert (learning / "drafts" / "v001" / "model.safetensors").is_file()  # written ...
    assert not (learning / "drafts" / "manifest.json").exists()  # ... never promoted
    assert not (learning / "learn-state.json").exists()
    assert any((learning / "work").glob("cycle-*"))  # its work folder, until the next cycle

    from dynamo_spec.learning.learn import load_manifest, next_version

    assert load_manifest(learning)["current"] is None
    assert next_version(learning / "drafts", load_manifest(learning)) == "v002"
