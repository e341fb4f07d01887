"""Capture (``learning.capture``) against one real server: the rows of finished chat and
completions requests, streaming or not, hold the token ids the client got back
(``return_token_ids``); another tenant's, a header-less and an aborted request are not
captured; ``DELETE /admin/learning/captures`` erases them behind the API key.
dynamo_spec/learning/capture.py, captures.py, capture_admin.py. Capture off (nothing written,
nothing wrapped) is tests/unit/test_captures.py.
"""

from __future__ import annotations

import json
import stat
import time

import httpx
import openai
import pytest
import requests

from dynamo_spec.learning import captures
from dynamo_spec.training.corpus import target_checksum
from support.server_process import ServerProcess, tiny_config

pytestmark = pytest.mark.integration

API_KEY = "capture-key"
TENANT = "alpha"
IDS = {"return_token_ids": True}


def client(server: ServerProcess, tenant: str | None = TENANT) -> openai.OpenAI:
    headers = {"X-Tenant": tenant} if tenant else {}
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, default_headers=headers)


def chat(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def rows_when(root, predicate, timeout: float = 60.0) -> list[dict]:
    """The captured rows once ``predicate(rows)`` holds (the capture writes every second)."""
    deadline = time.monotonic() + timeout
    while True:
        rows = list(captures.iter_rows(root))
        if predicate(rows) or time.monotonic() > deadline:
            return rows
        time.sleep(0.2)


@pytest.fixture(scope="module")
def served(tiny_models, tmp_path_factory):
    work = tmp_path_factory.mktemp("capture")
    root = work / "learning"
    config = tiny_config(tiny_models["target"], tiny_models["draft"], k=3,
                         server={"api_key": API_KEY}, metrics={"tenant_header": "X-Tenant"},
                         learning={"capture": True, "dir": str(root), "tenants": [TENANT]})
    with ServerProcess(config, work) as server:
        yield server, root, tiny_models["target"]


@pytest.fixture(scope="module")
def traffic(served):
    """Every kind of request once; returns what each client saw, as (prompt ids, answer ids)."""
    server, root, _ = served
    alpha = client(server)
    seen = {}
    r = alpha.chat.completions.create(model="tiny", messages=chat("chat, whole"), max_tokens=12, temperature=0,
                                      extra_body=IDS)
    seen["chat"] = [(r.model_extra["prompt_token_ids"], r.choices[0].model_extra["token_ids"])]
    r = alpha.completions.create(model="tiny", prompt="completions, two choices", max_tokens=10, n=2,
                                 temperature=0.8, seed=7, extra_body=IDS)
    seen["completions n=2"] = [(c.model_extra["prompt_token_ids"], c.model_extra["token_ids"]) for c in r.choices]
    prompt, answer = None, []
    for chunk in alpha.chat.completions.create(model="tiny", messages=chat("chat, streamed"), max_tokens=14,
                                               temperature=0, stream=True, extra_body=IDS,
                                               stream_options={"include_usage": True}):
        prompt = prompt or chunk.model_extra.get("prompt_token_ids")
        for c in chunk.choices:
            answer += c.model_extra.get("token_ids") or []
    seen["chat streamed"] = [(prompt, answer)]
    prompt, answer = None, []
    for chunk in alpha.completions.create(model="tiny", prompt="completions, streamed", max_tokens=9, temperature=0,
                                          stream=True, extra_body=IDS):
        for c in chunk.choices:
            prompt = prompt or c.model_extra.get("prompt_token_ids")
            answer += c.model_extra.get("token_ids") or []
    seen["completions streamed"] = [(prompt, answer)]

    # Not captured: another tenant, no tenant, and a stream the client walks away from.
    skipped = {}
    for name, tenant in (("beta", "beta"), ("no tenant", None)):
        r = client(server, tenant).completions.create(model="tiny", prompt=f"not captured: {name}", max_tokens=5,
                                                      temperature=0, extra_body=IDS)
        skipped[name] = r.choices[0].model_extra["prompt_token_ids"]
    with httpx.stream("POST", server.url + "/v1/completions", timeout=60,
                      headers={"Authorization": f"Bearer {API_KEY}", "X-Tenant": TENANT},
                      json={"model": "tiny", "prompt": "aborted by its client", "max_tokens": 480,
                            "ignore_eos": True, "stream": True, "return_token_ids": True}) as stream:
        lines = stream.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        skipped["aborted"] = json.loads(first[6:])["choices"][0]["prompt_token_ids"]
    # A last captured request: once its row is written, so would the others' be.
    r = alpha.completions.create(model="tiny", prompt="the last one", max_tokens=4, temperature=0, extra_body=IDS)
    last = r.choices[0].model_extra["prompt_token_ids"]
    rows = rows_when(root, lambda rows: any(row["prompt_ids"] == last for row in rows))
    return seen, skipped, rows


def test_finished_requests_are_captured_with_the_clients_token_ids(traffic):
    seen, _, rows = traffic
    by_prompt = {}
    for row in rows:
        by_prompt.setdefault(tuple(row["prompt_ids"]), []).append(row)
    for name, pairs in seen.items():
        got = by_prompt.get(tuple(pairs[0][0]), [])
        assert sorted(r["answer_ids"] for r in got) == sorted(answer for _, answer in pairs), name
        assert all(answer for _, answer in pairs), name
    (whole,) = by_prompt[tuple(seen["chat"][0][0])]
    assert (whole["source"], whole["tenant"], whole["endpoint"], whole["temperature"]) == ("capture", TENANT, "chat", 0.0)
    assert whole["finish_reason"] == "length" and whole["sampling"]["max_tokens"] == 12
    assert whole["acceptance"]["drafted"] > 0  # per-request speculative stats
    two = by_prompt[tuple(seen["completions n=2"][0][0])]
    assert len({r["id"] for r in two}) == 2
    assert all((r["endpoint"], r["temperature"], r["sampling"]["seed"]) == ("completions", 0.8, 7) for r in two)
    assert by_prompt[tuple(seen["completions streamed"][0][0])][0]["endpoint"] == "completions"


def test_other_tenants_and_aborted_requests_are_not_captured(traffic):
    _, skipped, rows = traffic
    prompts = {tuple(r["prompt_ids"]) for r in rows}
    for name, prompt in skipped.items():
        assert tuple(prompt) not in prompts, name


def test_the_files_are_private_and_name_the_target(served, traffic):
    _, root, target = served
    d = root / "captures"
    assert stat.S_IMODE(d.stat().st_mode) == 0o700
    assert {p.name: stat.S_IMODE(p.stat().st_mode) for p in d.iterdir() if not p.name.startswith(".")} == {
        "capture-000001.jsonl.gz": 0o600, "manifest.json": 0o600}
    assert captures.target_of(root) == {"name": target.name, "checksum": target_checksum(target)}
    (entry,) = captures.manifest_of(root)["files"]
    assert entry["rows"] == len(traffic[2]) and entry["closed"] is False


def test_delete_erases_the_captures_behind_the_api_key(served, traffic):
    server, root, _ = served
    url = server.url + "/admin/learning/captures"
    assert requests.delete(url, timeout=30).status_code == 401
    assert list(captures.iter_rows(root))
    before = requests.get(url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30).json()
    assert before["capture"] is True and before["rows"] == len(traffic[2])
    r = requests.delete(url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30)
    assert r.status_code == 200
    assert r.json() == {"erased": {"files": before["files"], "rows": before["rows"], "bytes": before["bytes"]},
                        "capture": True}
    assert list(captures.iter_rows(root)) == [] and captures.target_of(root) is None
    # Capture goes on after an erase, into a new file.
    client(server).completions.create(model="tiny", prompt="after the erase", max_tokens=3, temperature=0)
    assert len(rows_when(root, bool)) == 1
