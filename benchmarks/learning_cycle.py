"""One learn cycle on an application's traffic, through a real server: does it pay?

    python -m benchmarks.learning_cycle --config configs/smollm2-135m-instruct-eagle3-cpu.yaml \
        [--k 3] [--max-tokens 128] [--concurrency 4] [--speedup-prompts 24] [--rounds 2] \
        [--learn-args "--steps 60"] [--swap-always] [--out runs/learning-cycle]
    python -m benchmarks.learning_cycle --tiny     # the same loop on the tiny test fixtures: a check of the script

The loop, on one server (``serve --learning.capture true``, a fresh ``learning.dir``):

1. **capture**: the captured application set (``benchmarks/learning/captured.jsonl``: a help desk
   behind one system prompt and answer format, and short Python tasks), greedy, ``--concurrency``
   clients, as tenant ``capture``: only those requests are captured (``learning.tenants``), the
   measuring ones below are not;
2. **before**: the mean acceptance length (1 + accepted / verify steps, pooled over the requests'
   ``metrics.speculative_decoding``) on the held-out application set (``heldout.jsonl``: the same
   applications, no subject shared with the captured set: checked) and on the everyday set
   (``training/everyday_eval.jsonl``, the gate's order), greedy, ``--concurrency`` clients; and
   one client's speed-up against no speculation on the same server (``vllm_xargs.max_draft_tokens:
   0``) on ``--speedup-prompts`` held-out prompts, paired: each prompt with and without, the order
   alternating, ``--rounds`` passes; a round's speed-up is its summed time without / with;
3. **cycle**: ``dynamo-spec learn-draft`` (its last stdout line, exit status, wall time) while a light
   load (``--light-clients``, everyday prompts, 64 tokens) runs; its tokens/s during the cycle
   against the same load for ``--load-window`` seconds before it;
4. **swap** (when the gate promoted, or with ``--swap-always``): ``POST /admin/draft`` with the new
   version while 4 clients stream greedy requests over a fixed set of held-out prompts: failed
   requests, requests in flight across the swap, and the fixed set's greedy output (one client)
   before and after the swap, which must be identical;
5. **after**: as before, with the new draft served.

k is fixed (``--k``, default 3: ``speculative.num_speculative_tokens`` and no batch-size schedule)
for the server, the gate and the figures alike; ``--k 0`` keeps the config's own. Progress goes to
stderr; the last stdout line is one JSON summary (also ``OUT/summary.json``), with the host (the CPU,
its cores, AVX2 / AVX-512 bf16 / AMX flags, load average): figures of a shared host move with its
load. ``docs/learning.md#figures`` has the command for the CPU default and the table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

from benchmarks.learning import traffic
from dynamo_spec.bench.managed_server import ManagedServer, free_port, serve_command

TENANT_HEADER = "X-Tenant"
CAPTURED_TENANT = "capture"
TARGETS = {"heldout_gain": 0.20, "everyday_loss": 0.05, "cycle_seconds": 15 * 60}


def log(message: str) -> None:
    print(f"learning_cycle: {message}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------ the host


def host() -> dict:
    """The CPU and what makes its figures differ: cores, the dtype-deciding flags, the load."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        out = ""
    fields = {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in out.splitlines())}
    flags = set(fields.get("Flags", "").split())
    return {"cpu": fields.get("Model name", "unknown"), "cores": len(os.sched_getaffinity(0)),
            "avx2": "avx2" in flags, "avx512f": "avx512f" in flags, "avx512_bf16": "avx512_bf16" in flags,
            "amx": bool(flags & {"amx_bf16", "amx_tile", "amx_int8"}), "load_average": list(os.getloadavg())}


# ------------------------------------------------------------------ requests


@dataclass
class Answer:
    ok: bool
    text: str = ""
    tokens: int = 0
    seconds: float = 0.0
    finish: str | None = None
    spec: dict | None = None
    error: str | None = None


async def ask(client, model: str, item: dict, max_tokens: int, *, nospec: bool = False, tenant: str | None = None,
              stream: bool = False) -> Answer:
    """One greedy chat request; ``nospec``: no draft token verified (``vllm_xargs.max_draft_tokens: 0``)."""
    body = {"model": model, "messages": item["messages"], "max_tokens": max_tokens, "temperature": 0.0}
    extra = {"extra_body": {"vllm_xargs": {"max_draft_tokens": 0}}} if nospec else {}
    if tenant is not None:
        extra["extra_headers"] = {TENANT_HEADER: tenant}
    start = time.perf_counter()
    try:
        if not stream:
            r = await client.chat.completions.create(**body, **extra)
            choice = r.choices[0]
            spec = ((r.model_extra or {}).get("metrics") or {}).get("speculative_decoding")
            answer = Answer(True, choice.message.content or "", r.usage.completion_tokens, 0.0, choice.finish_reason,
                            spec)
        else:
            answer = Answer(True)
            parts = []
            chunks = await client.chat.completions.create(**body, **extra, stream=True,
                                                          stream_options={"include_usage": True})
            async for chunk in chunks:
                if chunk.choices:
                    parts.append(chunk.choices[0].delta.content or "")
                    answer.finish = chunk.choices[0].finish_reason or answer.finish
                if chunk.usage is not None:
                    answer.tokens = chunk.usage.completion_tokens
            answer.text = "".join(parts)
        if answer.finish in ("abort", "error", None):
            answer.ok, answer.error = False, f"finish_reason {answer.finish}"
    except Exception as exc:  # a failed request is counted, not fatal
        answer = Answer(False, error=f"{type(exc).__name__}: {exc}"[:300])
    answer.seconds = time.perf_counter() - start
    return answer


async def ask_all(client, model: str, items: list[dict], max_tokens: int, concurrency: int, **kw) -> list[Answer]:
    """Every item once, at most ``concurrency`` in flight; answers in the items' order."""
    answers: list[Answer | None] = [None] * len(items)
    queue = list(range(len(items)))

    async def worker() -> None:
        while queue:
            i = queue.pop(0)
            answers[i] = await ask(client, model, items[i], max_tokens, **kw)

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return answers


def acceptance_length(answers: list[Answer]) -> dict:
    """Pooled over the requests: 1 + accepted / verify steps (the gate's figure)."""
    steps = sum((a.spec or {}).get("num_spec_steps", 0) for a in answers if a.ok)
    accepted = sum((a.spec or {}).get("num_accepted_draft_tokens", 0) for a in answers if a.ok)
    return {"al": round(1 + accepted / steps, 4) if steps else None, "steps": steps,
            "requests": sum(a.ok for a in answers), "failed": sum(not a.ok for a in answers),
            "tokens": sum(a.tokens for a in answers if a.ok)}


# ------------------------------------------------------------------ the measurements


async def speedup(client, model: str, items: list[dict], max_tokens: int, rounds: int) -> dict:
    """One client, paired: each prompt with and without speculation back to back, the order
    alternating by prompt and round. A round's speed-up: its summed time without / with."""
    per_round, spec_answers, identical, pairs = [], [], 0, 0
    for r in range(rounds):
        with_s = without_s = 0.0
        for i, item in enumerate(items):
            order = (False, True) if (i + r) % 2 else (True, False)
            got = {}
            for spec in order:
                got[spec] = await ask(client, model, item, max_tokens, nospec=not spec)
            if not (got[True].ok and got[False].ok):
                continue
            with_s += got[True].seconds
            without_s += got[False].seconds
            spec_answers.append(got[True])
            pairs += 1
            identical += got[True].text == got[False].text
        per_round.append(round(without_s / with_s, 4) if with_s else None)
    done = sorted(x for x in per_round if x is not None)
    return {"speedup": done[len(done) // 2] if done else None, "rounds": per_round, "pairs": pairs,
            "pairs_identical": identical, "al_one_client": acceptance_length(spec_answers)["al"]}


async def measure(client, model: str, heldout: list[dict], everyday: list[dict], args) -> dict:
    log(f"held-out acceptance: {len(heldout)} requests at {args.concurrency} clients")
    held = acceptance_length(await ask_all(client, model, heldout, args.max_tokens, args.concurrency))
    log(f"everyday acceptance: {len(everyday)} requests at {args.concurrency} clients")
    every = acceptance_length(await ask_all(client, model, everyday, args.max_tokens, args.concurrency))
    chosen = heldout[:args.speedup_prompts]
    log(f"speed-up, one client: {len(chosen)} held-out prompts with and without speculation, {args.rounds} round(s)")
    fast = await speedup(client, model, chosen, args.max_tokens, args.rounds)
    log(f"held-out AL {held['al']}, everyday AL {every['al']}, speed-up {fast['speedup']}")
    return {"heldout": held, "everyday": every, "speedup": fast}


async def light_load(client, model: str, items: list[dict], clients: int, max_tokens: int,
                     stop: asyncio.Event) -> dict:
    """``clients`` clients asking in turn until ``stop``; tokens/s over the time they ran."""
    tokens, failed, done = 0, 0, 0

    async def worker(w: int) -> None:
        nonlocal tokens, failed, done
        i = w
        while not stop.is_set():
            a = await ask(client, model, items[i % len(items)], max_tokens)
            tokens, failed, done = tokens + a.tokens * a.ok, failed + (not a.ok), done + 1
            i += clients

    start = time.perf_counter()
    await asyncio.gather(*(worker(w) for w in range(clients)))
    seconds = time.perf_counter() - start
    return {"tokens_per_s": round(tokens / seconds, 2) if seconds else None, "requests": done, "failed": failed,
            "seconds": round(seconds, 1)}


async def learn_cycle(client, model: str, argv: list[str], everyday: list[dict], args, out: Path) -> dict:
    """The light load alone for ``--load-window`` s, then ``learn-draft`` under it."""
    stop = asyncio.Event()
    asyncio.get_running_loop().call_later(args.load_window, stop.set)
    log(f"light load alone for {args.load_window:g} s ({args.light_clients} client(s))")
    alone = await light_load(client, model, everyday, args.light_clients, 64, stop)
    stop = asyncio.Event()
    load = asyncio.create_task(light_load(client, model, everyday, args.light_clients, 64, stop))
    log(f"learn-draft under that load: {shlex.join(argv)} (progress in {out / 'learn-draft.log'})")
    start = time.perf_counter()
    with (out / "learn-draft.log").open("w") as err:
        proc = await asyncio.create_subprocess_exec(*argv, stdout=asyncio.subprocess.PIPE, stderr=err)
        stdout, _ = await proc.communicate()
    seconds = time.perf_counter() - start
    stop.set()
    during = await load
    lines = stdout.decode(errors="replace").strip().splitlines()
    try:
        result = json.loads(lines[-1]) if lines else None
    except ValueError:
        result = None
    log(f"learn-draft exited {proc.returncode} after {seconds:.0f} s: "
        + (f"promoted={result['promoted']} ({result.get('reason')})" if result else "no JSON line"))
    return {"exit": proc.returncode, "wall_seconds": round(seconds, 1), "result": result,
            "serving_alone": alone, "serving_during": during}


async def swap_under_load(client, url: str, headers: dict, model: str, items: list[dict], path: str, args) -> dict:
    """The fixed set's greedy output (one client), then ``POST /admin/draft`` while ``--swap-clients``
    stream greedy requests over it (each goes on for ``--swap-requests`` requests after the swap),
    then the fixed set's output again."""
    import httpx

    tokens = args.swap_tokens
    before = [a.text for a in await ask_all(client, model, items, tokens, 1)]
    swapped_at: list[float] = []
    done: list[tuple[int, Answer, float, float]] = []  # item, answer, start, end

    async def streamer(w: int) -> None:
        i, after = w, 0
        while after < args.swap_requests:
            start = time.perf_counter()
            a = await ask(client, model, items[i % len(items)], tokens, stream=True)
            done.append((i % len(items), a, start, time.perf_counter()))
            after += bool(swapped_at)
            i += args.swap_clients

    async def swap() -> dict:
        while len(done) < args.swap_clients:  # every client has had a request answered
            await asyncio.sleep(0.05)
        async with httpx.AsyncClient(timeout=300) as http:
            t0 = time.perf_counter()
            r = await http.post(url + "/admin/draft", json={"path": path}, headers=headers)
            swapped_at.extend([t0, time.perf_counter()])
        return {"status": r.status_code, "seconds": round(swapped_at[1] - t0, 3),
                "answer": r.json() if r.headers.get("content-type", "").startswith("application/json") else r.text}

    posted, _ = await asyncio.gather(swap(), asyncio.gather(*(streamer(w) for w in range(args.swap_clients))))
    after = [a.text for a in await ask_all(client, model, items, tokens, 1)]
    t0, t1 = swapped_at
    failed = [a.error for _, a, _, _ in done if not a.ok]
    across = [(i, a) for i, a, s, e in done if s < t0 and e > t1]
    equal = sum(a.ok and a.text == before[i] for i, a, _, _ in done)
    log(f"swap: HTTP {posted['status']} in {posted['seconds']} s; {len(done)} streamed requests, {len(failed)} failed, "
        f"{len(across)} in flight across it; fixed set identical before/after: {before == after}")
    return {"status": posted["status"], "post_seconds": posted["seconds"], "served": posted["answer"],
            "clients": args.swap_clients, "requests": len(done), "failed": len(failed), "errors": failed[:5],
            "in_flight_across": len(across), "streamed_equal_to_before": equal,
            "outputs_identical": before == after, "fixed_set": len(items)}


# ------------------------------------------------------------------ the setup


def tiny_setup(work: Path) -> tuple[Path, list[str]]:
    """The tiny fixtures' random target (head tied to its embedding, as SmolLM2's is) and draft, in
    float32; and learn-draft options that fit them (a short training, no replay round)."""
    from safetensors.torch import load_file, save_file

    from support.server_process import tiny_config
    from support.tiny_models import build_fixture_set

    models = build_fixture_set(work / "models")
    target = work / "target-tied"
    shutil.copytree(models["target"], target)
    weights = load_file(str(target / "model.safetensors"))
    weights["lm_head.weight"] = weights["model.embed_tokens.weight"].clone()
    save_file(weights, str(target / "model.safetensors"), metadata={"format": "pt"})
    config = tiny_config(target, models["draft"], k=3, engine={"dtype": "float32", "max_model_len": 2048})
    path = work / "tiny.yaml"
    path.write_text(yaml.safe_dump(config))
    (work / "no-rounds").mkdir()
    return path, ["--steps", "30", "--lr", "1e-3", "--everyday-prompts", "4", "--max-tokens", "16",
                  "--corpus", str(work / "no-rounds")]


def everyday_items(n: int) -> list[dict]:
    """The everyday evaluation set in the gate's order (sources interleaved), the first ``n``."""
    from dynamo_spec.training.rows import EVERYDAY_EVAL, interleave_sources, read_jsonl

    return interleave_sources(read_jsonl(EVERYDAY_EVAL, split="eval"))[:n]


def serving_dtype(config: Path, overrides: list[str]) -> str:
    from dynamo_spec.config.loader import load_settings
    from dynamo_spec.learning.gate import serving_dtype as resolved

    return resolved(load_settings(config, overrides).settings)


def api_key(config: Path) -> str | None:
    from dynamo_spec.config.loader import load_settings

    key = load_settings(config).settings.server.api_key
    return key.get_secret_value() if key is not None else None


def flat(summary: dict) -> dict:
    """The headline figures, and the issue's targets met or not (None: not measured)."""
    b, a, c = summary["before"], summary.get("after"), summary["cycle"]
    swap = summary.get("swap")
    served = swap["served"] if swap else None  # POST /admin/draft's answer
    figures = {
        "heldout_al_before": b["heldout"]["al"], "heldout_al_after": a and a["heldout"]["al"],
        "everyday_al_before": b["everyday"]["al"], "everyday_al_after": a and a["everyday"]["al"],
        "speedup_before": b["speedup"]["speedup"], "speedup_after": a and a["speedup"]["speedup"],
        "cycle_seconds": (c["result"] or {}).get("seconds"), "cycle_wall_seconds": c["wall_seconds"],
        "cycle_stages": (c["result"] or {}).get("timings_s"), "promoted": (c["result"] or {}).get("promoted"),
        "serving_tokens_per_s_alone": c["serving_alone"]["tokens_per_s"],
        "serving_tokens_per_s_during_cycle": c["serving_during"]["tokens_per_s"],
        "swap_status": swap and swap["status"], "failed_during_swap": swap and swap["failed"],
        "outputs_identical": swap and swap["outputs_identical"],
        "after_draft": served.get("version") if isinstance(served, dict) else None,  # the version swapped in
        "gate": {k: (c["result"] or {}).get(k) for k in ("reason", "heldout_al_before", "heldout_al_after",
                                                         "everyday_al_before", "everyday_al_after", "heldout_rows")},
    }
    hb, ha, eb, ea = (figures[k] for k in ("heldout_al_before", "heldout_al_after", "everyday_al_before",
                                           "everyday_al_after"))
    gain = (ha / hb - 1) if ha and hb else None
    figures["heldout_gain"] = gain and round(gain, 4)
    figures["targets_met"] = {
        "heldout_gain_20pct": (gain >= TARGETS["heldout_gain"] - 1e-9) if gain is not None else None,
        "everyday_within_0.05": (eb - ea <= TARGETS["everyday_loss"]) if ea and eb else None,
        "cycle_within_15min": (figures["cycle_seconds"] <= TARGETS["cycle_seconds"]
                               if figures["cycle_seconds"] is not None else None),
        "no_failed_request_during_swap": (swap["failed"] == 0 and swap["status"] == 200) if swap else None,
        "greedy_output_unchanged": swap["outputs_identical"] if swap else None,
    }
    return figures


# ------------------------------------------------------------------ main


async def run(args, config: Path, learn_options: list[str], work: Path, out: Path) -> dict:
    import httpx
    import openai

    captured, heldout = traffic.load(args.captured), traffic.load(args.heldout)
    traffic.disjoint_subjects(captured, heldout)  # held-out subjects are never captured
    everyday = everyday_items(args.everyday)
    if args.tiny:
        captured, heldout = captured[:40], heldout[:8]
    k_overrides = ([] if args.k == 0 else ["--speculative.num_speculative_tokens", str(args.k),
                                           "--speculative.num_speculative_tokens_per_batch_size", "null"])
    learning = work / "learning"
    overrides = [*k_overrides, "--learning.capture", "true", "--learning.dir", str(learning),
                 "--learning.tenants", f"[{CAPTURED_TENANT}]", "--metrics.tenant_header", TENANT_HEADER]
    key = api_key(config)
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    summary: dict = {
        "config": str(config), "k": args.k or "config", "dtype": serving_dtype(config, k_overrides), "host": host(),
        "max_tokens": args.max_tokens,
        "traffic": {"captured": len(captured), "heldout": len(heldout), "everyday": len(everyday),
                    "captured_subjects": len({r["subject"] for r in captured}),
                    "heldout_subjects": len({r["subject"] for r in heldout}), "subjects_disjoint": True},
    }
    port = free_port()
    server = ManagedServer(serve_command(config, port, overrides), port, out / "server.log")
    log(f"starting the server ({out / 'server.log'})")
    server.start(timeout=args.start_timeout)
    try:
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=key or "unused", max_retries=0,
                                      timeout=600, http_client=httpx.AsyncClient(
                                          limits=httpx.Limits(max_connections=16), timeout=600)) as client:
            model = (await client.models.list()).data[0].id

            log(f"capture: {len(captured)} requests at {args.concurrency} clients (tenant {CAPTURED_TENANT})")
            t0 = time.perf_counter()
            sent = await ask_all(client, model, captured, args.max_tokens, args.concurrency, tenant=CAPTURED_TENANT)
            ok = sum(a.ok for a in sent)
            summary["capture"] = {"sent": len(sent), "failed": len(sent) - ok, "seconds": round(time.perf_counter() - t0, 1),
                                  "answer_tokens": sum(a.tokens for a in sent if a.ok),
                                  "rows": await captured_rows(server.url, headers, ok)}

            summary["before"] = await measure(client, model, heldout, everyday, args)

            learn_argv = [sys.executable, "-m", "dynamo_spec", "learn-draft", "--config", str(config), *learn_options,
                          *k_overrides, "--learning.dir", str(learning)]
            summary["cycle"] = cycle = await learn_cycle(client, model, learn_argv, everyday, args, out)
            result = cycle["result"] or {}
            summary["swap"] = None
            if result.get("path") and (result.get("promoted") or (args.swap_always and result.get("heldout_al_after"))):
                summary["swap"] = await swap_under_load(client, server.url, headers, model,
                                                        heldout[:args.swap_prompts], result["path"], args)
                summary["after"] = await measure(client, model, heldout, everyday, args)
            else:
                log("nothing swapped: the served draft stays (no after figures)")
                summary["after"] = None
    finally:
        server.stop()
    summary["host"]["load_average_end"] = list(os.getloadavg())
    return {**flat(summary), "host": summary.pop("host"), "details": summary}


async def captured_rows(url: str, headers: dict, expected: int, timeout: float = 60) -> int:
    """Rows the capture kept, once its writer has written the ``expected`` ones (or ``timeout`` s)."""
    import httpx

    deadline = time.monotonic() + timeout
    async with httpx.AsyncClient(timeout=10) as http:
        while True:
            rows = (await http.get(url + "/admin/learning/captures", headers=headers)).json()["rows"]
            if rows >= expected or time.monotonic() > deadline:
                return rows
            await asyncio.sleep(1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--config", type=Path)
    which.add_argument("--tiny", action="store_true", help="the tiny test fixtures (random target and draft)")
    parser.add_argument("--k", type=int, default=3, help="draft tokens per step, no schedule (0: the config's own)")
    parser.add_argument("--max-tokens", type=int, default=128, help="new tokens per request at most")
    parser.add_argument("--concurrency", type=int, default=4, help="clients of the capture and the acceptance sets")
    parser.add_argument("--everyday", type=int, default=68, help="everyday prompts measured (68: all)")
    parser.add_argument("--speedup-prompts", type=int, default=24, help="held-out prompts of the one-client speed-up")
    parser.add_argument("--rounds", type=int, default=2, help="passes of the paired speed-up")
    parser.add_argument("--light-clients", type=int, default=1, help="clients of the load during the cycle")
    parser.add_argument("--load-window", type=float, default=60, help="seconds of that load alone, before the cycle")
    parser.add_argument("--learn-args", default="", help="learn-draft options, e.g. '--steps 60 --epochs 2'")
    parser.add_argument("--swap-always", action="store_true", help="swap the new version even if the gate refused it")
    parser.add_argument("--swap-clients", type=int, default=4)
    parser.add_argument("--swap-prompts", type=int, default=8, help="held-out prompts of the fixed set")
    parser.add_argument("--swap-requests", type=int, default=3, help="requests per client after the swap")
    parser.add_argument("--swap-tokens", type=int, default=64)
    parser.add_argument("--captured", type=Path, default=traffic.CAPTURED)
    parser.add_argument("--heldout", type=Path, default=traffic.HELDOUT)
    parser.add_argument("--start-timeout", type=float, default=900)
    parser.add_argument("--out", type=Path, default=Path("runs/learning-cycle"))
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="dynamo-spec-learning-cycle-"))
    learn_options = shlex.split(args.learn_args)
    if args.tiny:
        from dynamo_spec.engine.process_env import vllm_dirs

        os.environ.update(vllm_dirs(work / "env", offline=True))  # the server's and learn-draft's caches
        config, tiny_options = tiny_setup(work)
        learn_options = tiny_options + learn_options
        for name, value in (("max_tokens", 16), ("everyday", 4), ("speedup_prompts", 4), ("rounds", 1),
                            ("load_window", 5), ("swap_prompts", 4), ("swap_requests", 2), ("swap_tokens", 16)):
            if getattr(args, name) == parser.get_default(name):
                setattr(args, name, value)
        args.swap_always = True  # the random draft may not earn a promotion; the swap is checked anyway
    else:
        config = args.config.resolve()
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    log(f"work folder {work} (captures and drafts under learning/{', removed at the end' if args.tiny else ''}), "
        f"logs in {out}")
    try:
        summary = asyncio.run(run(args, config, learn_options, work, out))
    finally:
        if args.tiny:  # the fixtures and captures of a check; a real run keeps its captures and drafts
            shutil.rmtree(work, ignore_errors=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
