"""A long soak with churn against one server: nothing lost, nothing leaks, metrics stay exact.

    python -m benchmarks.soak --config FILE [--minutes 30] [--concurrency 32] [--out DIR] [overrides]
    python -m benchmarks.soak --tiny [--minutes 30] ...   # the tests' tiny models (built under .cache/)

``--concurrency`` clients loop, each request drawn in turn from a mix: streaming chat,
non-streaming completions, a stream the client drops after a few chunks (aborted), and a
request over a limit (``max_tokens`` past the context: must be a 400). Every minute it
records the server's resident memory (the whole process tree) and open file descriptors.
At the end: requests by outcome (a 5xx, a connection error or an unexpected status counts
as lost), memory and descriptors at the start and the end, and whether
``dynamo_spec_draft_tokens_total`` / ``_accepted_tokens_total`` equal vLLM's
``vllm:spec_decode_num_draft_tokens_total`` / ``..._accepted_tokens_total``. Written to
``soak.json`` in ``--out``; exit 1 when anything was lost or the counters differ.
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import sys
import threading
import time
from pathlib import Path

import openai
import psutil
import requests
import yaml

from dynamo_spec.bench.managed_server import ManagedServer, free_port, serve_command

PROMPTS = ["Tell me a long story about the sea and the ships on it.", "How does a refrigerator keep food cold?",
           "Write a short poem about autumn leaves.", "Explain what a CPU cache does, in simple terms.",
           "Give me three tips for sleeping better.", "def fibonacci(n):"]
KINDS = ("stream", "complete", "abort", "over_limit")


def tiny_config(out: Path) -> Path:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from support.server_process import tiny_config as make
    from support.tiny_models import build_fixture_set

    models = build_fixture_set(Path(".cache/soak-tiny-models"))
    cfg = make(models["target"], models["draft"])
    cfg["engine"]["max_model_len"] = 2048
    path = out / "tiny.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def tree(pid: int) -> tuple[int, int, dict[str, int]]:
    """RSS (bytes) and open file descriptors of the process and its descendants, and RSS by process."""
    rss = fds = 0
    each: dict[str, int] = {}
    for proc in [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]:
        try:
            mem = proc.memory_info().rss
            fds += proc.num_fds()
            rss += mem
            name = "server" if proc.pid == pid else proc.name()
            each[name] = each.get(name, 0) + mem
        except psutil.Error:
            pass
    return rss, fds, each


def counter(text: str, prefix: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(prefix))


def one(client: openai.OpenAI, model: str, kind: str, rng: random.Random) -> str:
    prompt = rng.choice(PROMPTS)
    messages = [{"role": "user", "content": prompt}]
    tokens = rng.randint(16, 128)
    try:
        if kind == "stream":
            chunks = list(client.chat.completions.create(model=model, messages=messages, max_tokens=tokens,
                                                         stream=True))
            return "ok" if chunks else "lost: empty stream"
        if kind == "complete":
            answer = client.completions.create(model=model, prompt=prompt, max_tokens=tokens)
            return "ok" if answer.choices else "lost: no choice"
        if kind == "abort":
            stream = client.chat.completions.create(model=model, messages=messages, max_tokens=512, stream=True)
            for i, _ in enumerate(stream):
                if i == 3:
                    break
            stream.close()
            return "ok"
        client.completions.create(model=model, prompt=prompt, max_tokens=100_000)
        return "lost: over-limit request answered 200"
    except openai.BadRequestError:
        return "ok" if kind == "over_limit" else "lost: 400"
    except openai.APIStatusError as exc:
        return f"lost: {exc.status_code}"
    except openai.APIConnectionError as exc:
        cause = exc.__cause__ or exc.__context__
        return f"lost: connection ({type(exc).__name__}: {type(cause).__name__}: {str(cause)[:80]})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path)
    parser.add_argument("--tiny", action="store_true", help="serve the tests' tiny models")
    parser.add_argument("--minutes", type=float, default=30)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--out", type=Path, default=Path("runs/soak"))
    args, overrides = parser.parse_known_args()
    args.out.mkdir(parents=True, exist_ok=True)
    config = tiny_config(args.out) if args.tiny else args.config
    if config is None:
        parser.error("--config or --tiny")
    port = free_port()
    outcomes: collections.Counter = collections.Counter()
    lost: collections.Counter = collections.Counter()
    samples: list[dict] = []
    lock = threading.Lock()
    with ManagedServer(serve_command(config, port, overrides), port, args.out / "server.log") as server:
        model = requests.get(server.url + "/v1/models", timeout=10).json()["data"][0]["id"]
        stop = time.monotonic() + 60 * args.minutes

        def worker(i: int) -> None:
            rng = random.Random(i)
            client = openai.OpenAI(base_url=server.url + "/v1", api_key="soak", max_retries=0, timeout=300)
            n = i
            while time.monotonic() < stop:
                kind = KINDS[n % len(KINDS)]
                n += 1
                result = one(client, model, kind, rng)
                with lock:
                    outcomes[kind] += 1
                    if result != "ok":
                        lost[f"{kind}: {result}"] += 1
            client.close()  # its pooled connection too: the descriptors at the end are the server's own

        pid = server.proc.pid
        start_rss, start_fds, start_each = tree(pid)
        threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(args.concurrency)]
        t0 = time.monotonic()
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads):
            time.sleep(60 if time.monotonic() + 60 < stop else 5)
            rss, fds, each = tree(pid)
            samples.append({"minute": round((time.monotonic() - t0) / 60, 1), "rss_gib": round(rss / 2**30, 3),
                            "fds": fds, "requests": sum(outcomes.values()),
                            "rss_mib": {name: round(mem / 2**20) for name, mem in each.items()}})
            print(json.dumps(samples[-1]), flush=True)
        time.sleep(2)
        end_rss, end_fds, end_each = tree(pid)
        text = requests.get(server.url + "/metrics", timeout=10).text
        ours = (counter(text, "dynamo_spec_draft_tokens_total{"), counter(text, "dynamo_spec_accepted_tokens_total{"))
        vllm = (counter(text, "vllm:spec_decode_num_draft_tokens_total{"),
                counter(text, "vllm:spec_decode_num_accepted_tokens_total{"))
        health = requests.get(server.url + "/health", timeout=10).status_code
    result = {"config": str(config), "minutes": args.minutes, "concurrency": args.concurrency,
              "requests": dict(outcomes), "lost": dict(lost),
              "rss_gib": {"start": round(start_rss / 2**30, 3), "end": round(end_rss / 2**30, 3)},
              "rss_mib_by_process": {"start": {k: round(v / 2**20) for k, v in start_each.items()},
                                     "end": {k: round(v / 2**20) for k, v in end_each.items()}},
              "fds": {"start": start_fds, "end": end_fds}, "health_at_end": health,
              "draft_tokens": {"dynamo_spec": ours[0], "vllm": vllm[0]},
              "accepted_tokens": {"dynamo_spec": ours[1], "vllm": vllm[1]}, "samples": samples}
    (args.out / "soak.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "samples"}, indent=2))
    return 0 if not lost and ours == vllm and health == 200 else 1


if __name__ == "__main__":
    raise SystemExit(main())
