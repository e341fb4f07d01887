"""``learning.auto`` and replicas (dynamo_spec/learning/auto.py, swap_draft.py) with two real servers
sharing one ``learning.dir``: both capture one application's traffic; the one with auto on runs a
learn cycle (learn-draft in a child process, a tiny cycle whose gate promotes), swaps itself to the
version it promoted with greedy output unchanged, and shows the cycle on ``GET /admin/learning``;
then ``dynamo-spec swap-draft`` brings the other server to the same version (one learn, both
swapped) and fails on a replica that refuses. A second cycle killed after writing its version
promotes nothing, and the server serves on.

The target is the tiny fixture target with its head tied to its embedding (tests/integration/
test_learn_draft.py says why); its greedy answers repeat one token, which a draft learns in a few
steps and the served draft (trained one step) does not predict."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest
import requests

from dynamo_spec.training.rows import write_jsonl
from support.learning_world import AUX, build_tied_target, greedy_answers, train_served_draft
from support.server_process import ServerProcess, tiny_config

pytestmark = pytest.mark.integration

KEY = "auto-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
SYSTEM = "You are the help desk of Lighthouse Books. Answer in two short lines."
WORDS = ("cat", "dog", "sea", "sun", "tree", "city", "river", "book", "code", "list", "sort", "sum", "map", "file",
         "loop", "road", "bird", "rain", "snow", "star")
ANSWER_TOKENS = 16
REQUESTS = 40  # to the auto server per cycle: every_tokens is their answer tokens
# a tiny cycle; the gate asks for no loss on the held-out captures and lets the everyday set go
LEARN_ARGS = ["--steps", "30", "--lr", "1e-3", "--everyday-prompts", "4", "--max-tokens", str(ANSWER_TOKENS),
              "--replay", "0"]
PROMPTS = ["What is the capital of France?", "Tell me about the sea.", "Hello!"]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A tied tiny target and its served draft (trained one step on everyday answers), and two
    servers of them capturing into one learning.dir: ``auto`` (learning.auto on) and ``replica``."""
    root = tmp_path_factory.mktemp("auto")
    target = build_tied_target(root / "target")
    everyday = [[{"role": "user", "content": "Tell me about " + " and ".join(WORDS[i % 7:i % 7 + 3]) + f", take {i}."}]
                for i in range(16)]
    rows = [{"id": f"e-{i}", "prompt_ids": p, "answer_ids": a} for i, (p, a) in enumerate(
        greedy_answers(target, everyday, ANSWER_TOKENS, stop_at_eos=False))]
    write_jsonl(root / "everyday.jsonl", rows)
    train_served_draft(target, root / "everyday.jsonl", root / "served", AUX)

    learning = root / "learning"

    def config(auto: bool) -> dict:
        return tiny_config(target, root / "served", k=3, server={"api_key": KEY},
                           engine={"dtype": "auto", "kv_cache_memory_bytes": "128MiB"},
                           speculative={"aux_hidden_state_layer_ids": list(AUX)},
                           metrics={"tenant_header": "X-Tenant"},
                           learning={"capture": True, "dir": str(learning), "tenants": ["app"], "auto": auto,
                                     "every_tokens": REQUESTS * ANSWER_TOKENS, "learn_args": LEARN_ARGS,
                                     "min_gain": 0.0, "max_loss": 10.0, "threads": len(os.sched_getaffinity(0))})

    auto, replica = ServerProcess(config(True), root), ServerProcess(config(False), root)
    try:
        auto.launch()
        replica.launch()
        auto.wait_ready()
        replica.wait_ready()
        yield {"root": root, "target": target, "served": root / "served", "learning": learning, "auto": auto,
               "replica": replica}
    finally:
        auto.stop()
        replica.stop()


def client(server: ServerProcess, tenant: str | None = None) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0,
                         default_headers={"X-Tenant": tenant} if tenant else {})


def greedy(server: ServerProcess) -> list[str]:
    """Greedy answers to PROMPTS (no tenant header: not captured)."""
    c = client(server)
    return [c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": p}], max_tokens=24,
                                      temperature=0).choices[0].message.content for p in PROMPTS]


def traffic(server: ServerProcess, n: int, start: int) -> None:
    """``n`` requests of the application (captured: tenant "app"), ANSWER_TOKENS answer tokens each."""
    c = client(server, "app")
    for i in range(start, start + n):
        out = c.chat.completions.create(
            model="tiny", messages=[{"role": "system", "content": SYSTEM},
                                    {"role": "user", "content": f"order {i}: {WORDS[i % 20]} {WORDS[(3 * i) % 20]}?"}],
            max_tokens=ANSWER_TOKENS, temperature=0, extra_body={"ignore_eos": True})
        assert out.usage.completion_tokens == ANSWER_TOKENS


def get(server: ServerProcess, route: str) -> dict:
    r = requests.get(server.url + route, headers=AUTH, timeout=10)
    assert r.status_code == 200, r.text
    return r.json()


def learning_when(server: ServerProcess, predicate, timeout: float = 600) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        state = get(server, "/admin/learning")
        if predicate(state):
            return state
        assert time.monotonic() < deadline, f"{state}\n{server.log()[-3000:]}"
        time.sleep(0.5)


def swap_draft(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dynamo_spec", "swap-draft", *args], capture_output=True, text=True,
                          timeout=120, env={**os.environ, **(env or {})})


@pytest.fixture(scope="module")
def before(world):
    return {name: greedy(world[name]) for name in ("auto", "replica")}


@pytest.fixture(scope="module")
def first_cycle(world, before):
    """Traffic to both servers; the auto server's count reaches every_tokens with its last request."""
    traffic(world["replica"], 20, start=1000)
    state = get(world["auto"], "/admin/learning")
    assert state["auto"] is True and state["cycles"] == [] and state["running"] is None
    assert state["every_tokens"] == REQUESTS * ANSWER_TOKENS and state["tokens_since_last_cycle"] == 0
    traffic(world["auto"], REQUESTS, start=0)
    state = learning_when(world["auto"], lambda s: s["cycles"])
    (cycle,) = state["cycles"]
    return cycle


def test_the_auto_server_learns_promotes_and_swaps_itself(world, before, first_cycle):
    cycle, auto = first_cycle, world["auto"]
    assert (cycle["exit"], cycle["promoted"], cycle["swapped"], cycle["version"]) == (0, True, True, "v001"), cycle
    assert cycle["tokens"] == REQUESTS * ANSWER_TOKENS and cycle["seconds"] > 0 and cycle["pid"] > 0
    # the rows of both servers (one shared volume), the newest tenth held out
    assert (cycle["figures"]["rows"], cycle["figures"]["heldout_rows"]) == (54, 6)
    assert cycle["figures"]["heldout_al_after"] >= cycle["figures"]["heldout_al_before"]
    v001 = world["learning"] / "drafts" / "v001"
    assert cycle["path"] == str(v001.resolve())
    served = get(auto, "/admin/draft")
    assert (served["path"], served["version"], served["loaded_by"]) == (cycle["path"], "v001", "swap")
    assert served["gate"]["promoted"] is True and served["previous"]["path"] == str(world["served"].resolve())
    assert greedy(auto) == before["auto"]  # a draft changes what is proposed, never the output
    # the cycle's record, its log and the server's one line; nothing of a prompt in either log
    learning = world["learning"]
    assert json.loads((learning / "cycles.jsonl").read_text().splitlines()[0]) == cycle
    assert stat.S_IMODE((learning / "cycles.jsonl").stat().st_mode) == 0o600
    log = Path(cycle["log"])
    assert stat.S_IMODE(log.stat().st_mode) == 0o600 and "learn-draft: gate" in log.read_text()
    lines = [line for line in auto.log().splitlines() if "Learn cycle" in line]
    assert len(lines) == 1 and "v001: promoted and swapped in" in lines[0], lines
    for text in (auto.log(), log.read_text()):
        assert "Lighthouse" not in text and "capital of France" not in text
    assert not list(learning.glob(".auto-config-*"))
    # the replica serves on with its own draft until it is told
    assert get(world["replica"], "/admin/draft")["path"] == str(world["served"].resolve())


def test_swap_draft_brings_every_replica_to_the_promoted_version(world, before, first_cycle, tmp_path):
    auto, replica = world["auto"], world["replica"]
    config = replica.config_path  # learning.dir (its promoted version) and the API key
    swapped = swap_draft("--config", str(config), "--url", auto.url, "--url", replica.url)
    assert swapped.returncode == 0, swapped.stderr
    result = json.loads(swapped.stdout.strip().splitlines()[-1])
    assert result["path"] == first_cycle["path"]
    assert [(r["url"], r["outcome"], r["version"]) for r in result["replicas"]] == [
        (auto.url, "serving already", "v001"), (replica.url, "swapped", "v001")]
    assert get(replica, "/admin/draft")["version"] == "v001" and get(auto, "/admin/draft")["swaps"] == 1
    assert greedy(replica) == before["replica"]

    # a replica that refuses (a target is not a draft): exit 1, it serves on with what it had
    refused = swap_draft("--url", replica.url, "--path", str(world["target"]), env={"DYNAMO_SPEC_SERVER__API_KEY": KEY})
    assert refused.returncode == 1
    (r,) = json.loads(refused.stdout.strip().splitlines()[-1])["replicas"]
    assert r["outcome"] == "refused" and r["status"] == 400 and KEY not in refused.stdout + refused.stderr
    assert get(replica, "/admin/draft")["version"] == "v001"
    no_key = swap_draft("--url", replica.url, "--path", first_cycle["path"])
    assert no_key.returncode == 1 and json.loads(no_key.stdout.splitlines()[-1])["replicas"][0]["status"] == 401


def test_a_killed_cycle_promotes_nothing_and_the_server_serves_on(world, before, first_cycle):
    auto, learning = world["auto"], world["learning"]
    swaps = get(auto, "/admin/draft")["swaps"]
    traffic(auto, REQUESTS, start=100)
    running = learning_when(auto, lambda s: s["running"] and s["running"]["pid"], timeout=60)["running"]
    log = Path(running["log"])
    deadline = time.monotonic() + 300
    while "learn-draft: gate ..." not in log.read_text():  # killed once its version is written
        assert time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.2)
    os.killpg(running["pid"], signal.SIGKILL)
    state = learning_when(auto, lambda s: len(s["cycles"]) == 2 and s["running"] is None, timeout=60)
    cycle = state["cycles"][-1]
    assert (cycle["exit"], cycle["promoted"], cycle["swapped"], cycle["reason"]) == (
        -signal.SIGKILL, False, False, "killed by SIGKILL")
    assert (learning / "drafts" / "v002" / "model.safetensors").is_file()  # written, never promoted
    assert json.loads((learning / "drafts" / "manifest.json").read_text())["current"] == "v001"
    served = get(auto, "/admin/draft")
    assert served["version"] == "v001" and served["swaps"] == swaps
    assert greedy(auto) == before["auto"]
    assert requests.get(auto.url + "/health", timeout=10).status_code == 200
