"""POST /admin/draft swaps the served EAGLE-3 draft while the server serves (dynamo_spec/learning/swap.py).

One server (the fixed target, which always emits token 0, with the "never" draft: nothing
accepted); the "always" draft has every token accepted, the "partial" one exactly the first token
of each step (support/tiny_models.py), so the acceptance after a swap says exactly which draft the
engine runs. In float32, so that vLLM's CPU linear layers run on packed oneDNN weights (bf16 falls
back to torch's linear on an AVX2 host): a swap must re-pack them.
"""

from __future__ import annotations

import json
import shutil
import threading
import time
from pathlib import Path

import openai
import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from support.server_process import ServerProcess, tiny_config
from support.tiny_models import build_eagle3_draft

pytestmark = pytest.mark.integration

K = 3
KEY = "swap-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPTS = ["What is the capital of France?", "def add(a, b):", "Hello!", "Write a poem about the sea."]
MAX_TOKENS = 1 + 8 * (K + 1)
LENGTH = {"never_draft": 1.0, "always_draft": K + 1.0, "partial_draft": 2.0}  # mean acceptance length, by construction


@pytest.fixture(scope="module")
def server(tiny_models, tmp_path_factory):
    config = tiny_config(tiny_models["fixed_target"], tiny_models["never_draft"], k=K, server={"api_key": KEY},
                         engine={"dtype": "float32"})
    with ServerProcess(config, tmp_path_factory.mktemp("swap")) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def baseline(client):
    """Greedy output of each prompt before any swap."""
    return {p: complete(client, p).choices[0].text for p in PROMPTS}


def complete(client, prompt: str):
    return client.completions.create(model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                     extra_body={"ignore_eos": True})


def acceptance_length(client) -> float:
    return complete(client, PROMPTS[0]).model_extra["metrics"]["speculative_decoding"]["mean_acceptance_length"]


def post(server, path, headers=AUTH) -> requests.Response:
    return requests.post(server.url + "/admin/draft", json={"path": str(path)}, headers=headers, timeout=60)


def served(server) -> dict:
    r = requests.get(server.url + "/admin/draft", headers=AUTH, timeout=10)
    assert r.status_code == 200, r.text
    return r.json()


def serve_draft(server, path: Path) -> None:
    if served(server)["path"] != str(path.resolve()):
        assert post(server, path).status_code == 200


def samples(text: str) -> dict[tuple[str, tuple], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def stream(client, prompt: str) -> str:
    chunks = client.completions.create(model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    return "".join(c.choices[0].text for c in chunks if c.choices)


def test_get_names_the_served_draft(server, tiny_models):
    state = served(server)
    assert state["path"] == str(tiny_models["never_draft"].resolve())
    assert state["version"].startswith("sha256:") and state["loaded_by"] == "start" and state["previous"] is None
    assert requests.get(server.url + "/admin/draft", timeout=10).status_code == 401  # the API key guards /admin
    assert post(server, tiny_models["always_draft"], headers={}).status_code == 401
    assert served(server)["path"] == str(tiny_models["never_draft"].resolve())


def test_swap_under_load_keeps_every_request_and_the_output(server, client, baseline, tiny_models):
    serve_draft(server, tiny_models["never_draft"])
    assert acceptance_length(client) == LENGTH["never_draft"]
    done: list[tuple[str, str, float, float]] = []  # prompt, text, start, end
    errors: list[BaseException] = []
    stop = threading.Event()

    def clients(i: int) -> None:
        n = 0
        while not stop.is_set():
            prompt = PROMPTS[(i + n) % len(PROMPTS)]
            start = time.monotonic()
            try:
                text = stream(client, prompt)
            except BaseException as exc:  # every failure is a finding
                errors.append(exc)
                return
            done.append((prompt, text, start, time.monotonic()))
            n += 1

    threads = [threading.Thread(target=clients, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    try:
        while len(done) < 4 and not errors:
            time.sleep(0.05)
        swap_start = time.monotonic()
        r = post(server, tiny_models["always_draft"])
        swap_end = time.monotonic()
        while sum(start > swap_end for _, _, start, _ in done) < 8 and not errors:
            time.sleep(0.05)
    finally:
        stop.set()
        for t in threads:
            t.join(120)
    assert r.status_code == 200, r.text
    assert not errors, errors
    assert any(start < swap_start and end > swap_end for _, _, start, end in done), "no request was in flight"
    assert all(text == baseline[prompt] for prompt, text, _, _ in done)  # greedy output unchanged
    # The engine now drafts with the new draft: every token accepted.
    assert acceptance_length(client) == LENGTH["always_draft"]
    state = r.json()
    assert state["path"] == served(server)["path"] == str(tiny_models["always_draft"].resolve())
    assert state["loaded_by"] == "swap" and state["previous"]["path"] == str(tiny_models["never_draft"].resolve())
    assert state["version"].startswith("sha256:") and state["version"] != state["previous"]["version"]
    info = {labels for (name, labels), value in samples(server.metrics()).items() if name == "dynamo_spec_draft_info"}
    assert info == {(("model", "tiny"), ("path", state["path"]), ("version", state["version"]))}


def test_posting_the_previous_path_rolls_back_and_restarts_the_windows(server, client, tiny_models):
    serve_draft(server, tiny_models["always_draft"])
    assert acceptance_length(client) == LENGTH["always_draft"]
    previous = served(server)
    r = post(server, previous["previous"]["path"] if previous["previous"] else tiny_models["never_draft"])
    assert r.status_code == 200, r.text
    assert r.json()["path"] == str(tiny_models["never_draft"].resolve())
    assert r.json()["previous"]["version"] == previous["version"]
    values = samples(server.metrics())
    assert values[("dynamo_spec_window_drafts", (("model", "tiny"),))] == 0  # the window restarted at the swap
    assert acceptance_length(client) == LENGTH["never_draft"]
    values = samples(server.metrics())
    assert values[("dynamo_spec_acceptance_rate", (("model", "tiny"),))] == 0.0
    assert values[("dynamo_spec_mean_acceptance_length", (("model", "tiny"),))] == 1.0


def test_every_tensor_of_the_draft_is_loaded(server, client, tiny_models):
    """The "partial" draft accepts exactly one token a step only through its own fc, MLP, norm and
    lm_head (a counter built from exact zeros): any of them left from the draft before breaks that."""
    serve_draft(server, tiny_models["always_draft"])
    assert post(server, tiny_models["partial_draft"]).status_code == 200
    stats = complete(client, PROMPTS[1]).model_extra["metrics"]["speculative_decoding"]
    assert stats["mean_acceptance_length"] == LENGTH["partial_draft"]
    assert stats["acceptance_histogram"] == [0, stats["num_spec_steps"], 0, 0]


def _copy(src: Path, dst: Path, edit=None, drop: str | None = None) -> Path:
    shutil.copytree(src, dst)
    if edit:
        cfg = json.loads((dst / "config.json").read_text())
        edit(cfg)
        (dst / "config.json").write_text(json.dumps(cfg))
    if drop:
        (dst / drop).unlink()
    return dst


def _truncate(directory: Path) -> Path:
    """Weights cut short after an intact header: preflight's header reads pass; loading does not."""
    weights = directory / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    return directory


BAD_DRAFTS = {
    # name: (build(tiny_models, dir) -> path, words the 400 names)
    "another target's aux layers": (
        lambda m, d: build_eagle3_draft(d, m["fixed_target"], mode="always", aux_layer_ids=(0, 1, 2)),
        "reads the target's layers [0, 1, 2]"),
    "another draft vocabulary (d2t)": (
        lambda m, d: build_eagle3_draft(d, m["fixed_target"], mode="always", draft_vocab_size=512),
        "draft_vocab_size is 512"),
    "two layers": (
        lambda m, d: _copy(m["always_draft"], d, lambda c: c.update(num_hidden_layers=2)), "num_hidden_layers is 2"),
    "another hidden size": (
        lambda m, d: _copy(m["always_draft"], d, lambda c: c.update(hidden_size=64, target_hidden_size=64)),
        "hidden size 64"),
    "no weights file": (lambda m, d: _copy(m["always_draft"], d, drop="model.safetensors"), "no *.safetensors"),
    "no config.json": (lambda m, d: _copy(m["always_draft"], d, drop="config.json"), "no config.json"),
    "weights cut short": (lambda m, d: _truncate(_copy(m["always_draft"], d)), "could not be read"),
    "not a directory": (lambda m, d: d / "absent", "is not a directory"),
}


@pytest.mark.parametrize("case", BAD_DRAFTS)
def test_a_draft_of_the_wrong_shape_gets_400_and_the_served_draft_stays(server, client, tiny_models, tmp_path, case):
    build, words = BAD_DRAFTS[case]
    before = served(server)
    r = post(server, build(tiny_models, tmp_path / "bad"))
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "path" and words in error["message"], error["message"]
    assert served(server) == before
    name = next(n for n in LENGTH if str(tiny_models[n].resolve()) == before["path"])
    assert acceptance_length(client) == LENGTH[name]  # still serving, with the same draft
