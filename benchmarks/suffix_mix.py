"""The suffix mix on an application's traffic, through real servers: does it pay, and does it harm?

    python -m benchmarks.suffix_mix --config configs/smollm2-135m-instruct-eagle3-cpu.yaml \
        [--max-tokens 128] [--capture-clients 4] [--concurrency 4,16,32] [--rounds 2] \
        [--suffix-alone configs/smollm2-135m-instruct-suffix-cpu.yaml] [--out runs/suffix-mix]
    python -m benchmarks.suffix_mix --tiny        # the same on the tiny test fixtures: a check of the script

Two servers from one config, alive together and asked in turn (one at a time, so each has the
cores while it answers): ``draft`` (``speculative.suffix.enabled false``: the EAGLE-3 draft alone)
and ``mix`` (``speculative.suffix.enabled true``, trees per tenant of ``X-Tenant``). Greedy.

1. **traffic**: the application set (``benchmarks/learning/captured.jsonl``: a help desk behind one
   system prompt and answer format, short Python tasks; 336 requests) served by ``mix`` as tenant
   ``app`` at ``--capture-clients`` clients (its tree learns them); ``draft`` serves its first 8
   (the same system prompts in its prefix cache).
2. **held-out, one client**: the held-out set (``heldout.jsonl``, 72 requests on subjects the
   traffic never names), each prompt on both servers back to back, the order alternating; ``mix``
   as tenant ``app``. Acceptance length (1 + accepted / verify steps, pooled), tokens/s, greedy
   output equal on both, and the speed-up in 4 rounds (prompts by index mod 4): a round's summed
   time on ``draft`` / on ``mix``.
3. **everyday, one client**: ``training/everyday_eval.jsonl`` (68), the same way, after the traffic.
4. **clients**: for each ``--concurrency`` N, ``--rounds`` rounds: the held-out set at N clients on
   each server (order alternating by round), tokens/s over the pass; ``mix`` as a new tenant each
   round (a cold tree: it learns only from that pass, so no answer it drafts from is the same
   prompt's from an earlier pass).
5. **trees**: ``GET /admin/suffix`` (per-source counts, the trees' own time) of ``mix``.
6. With ``--suffix-alone CONFIG``: vLLM's own ``method: suffix`` (no draft model) on a third server,
   after the others stop: the traffic, then the held-out and everyday sets at one client.

The last stdout line is one JSON summary (also ``OUT/summary.json``), with the host.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

import yaml

from benchmarks.learning import traffic
from benchmarks.learning_cycle import Answer, acceptance_length, ask, ask_all, everyday_items, host
from dynamo_spec.bench.managed_server import ManagedServer, free_port, serve_command

TENANT_HEADER = "X-Tenant"
TARGETS = {"heldout_al": 2.5, "heldout_al_ratio": 1.25, "everyday_al_loss": 0.02, "speedup_one_client": 1.3}


def log(message: str) -> None:
    print(f"suffix_mix: {message}", file=sys.stderr, flush=True)


def start(name: str, config: Path, overrides: list[str], out: Path) -> ManagedServer:
    port = free_port()
    log(f"starting {name} on :{port} ({' '.join(overrides)})")
    t0 = time.perf_counter()
    server = ManagedServer(serve_command(config, port, overrides), port, out / f"{name}.log").start()
    log(f"{name} ready in {time.perf_counter() - t0:.0f} s")
    return server


def client_of(server: ManagedServer):
    import openai

    return openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", timeout=600,
                              max_retries=0)


def model_of(config: Path) -> str:
    from dynamo_spec.config.loader import load_settings

    return load_settings(config).settings.served_model_name


def tokens_per_s(answers: list[Answer]) -> float | None:
    seconds = sum(a.seconds for a in answers if a.ok)
    return round(sum(a.tokens for a in answers if a.ok) / seconds, 2) if seconds else None


async def paired(clients: dict, model: str, items: list[dict], max_tokens: int, tenant: str) -> dict:
    """Each item on ``draft`` and ``mix`` back to back (order alternating), one client."""
    got: dict[str, list[Answer]] = {"draft": [], "mix": []}
    for i, item in enumerate(items):
        for name in (("draft", "mix") if i % 2 else ("mix", "draft")):
            got[name].append(await ask(clients[name], model, item, max_tokens,
                                       tenant=tenant if name == "mix" else None))
    rounds = []
    for r in range(4):
        d = sum(a.seconds for i, a in enumerate(got["draft"]) if i % 4 == r)
        m = sum(a.seconds for i, a in enumerate(got["mix"]) if i % 4 == r)
        rounds.append(round(d / m, 4) if m else None)
    ok = [i for i in range(len(items)) if got["draft"][i].ok and got["mix"][i].ok]
    different = [items[i].get("id", i) for i in ok if got["draft"][i].text != got["mix"][i].text]
    return {name: {**acceptance_length(a), "tokens_per_s": tokens_per_s(a)} for name, a in got.items()} | {
        "speedup_rounds": rounds, "speedup": round(sum(a.seconds for a in got["draft"]) /
                                                   max(1e-9, sum(a.seconds for a in got["mix"])), 4),
        "pairs": len(ok), "identical": len(ok) - len(different), "different": different[:10]}


async def at_clients(clients: dict, model: str, items: list[dict], max_tokens: int, n: int, rounds: int) -> dict:
    per = {"draft": [], "mix": []}
    for r in range(rounds):
        for name in (("draft", "mix") if r % 2 else ("mix", "draft")):
            t0 = time.perf_counter()
            answers = await ask_all(clients[name], model, items, max_tokens, n,
                                    tenant=f"c{n}-r{r}" if name == "mix" else None)
            wall = time.perf_counter() - t0
            per[name].append({"tokens_per_s": round(sum(a.tokens for a in answers if a.ok) / wall, 2),
                              "failed": sum(not a.ok for a in answers), **{"al": acceptance_length(answers)["al"]}})
    ratios = [round(m["tokens_per_s"] / d["tokens_per_s"], 4) for m, d in zip(per["mix"], per["draft"])]
    log(f"{n} clients: mix/draft tokens/s per round {ratios}")
    return {"clients": n, "draft": per["draft"], "mix": per["mix"], "mix_over_draft": ratios}


async def suffix_stats(server: ManagedServer) -> dict:
    import httpx

    async with httpx.AsyncClient(timeout=60) as http:
        r = await http.get(f"{server.url}/admin/suffix")
        return r.json()


async def run(args, config: Path, out: Path) -> dict:
    captured, heldout = traffic.load(traffic.CAPTURED), traffic.load(traffic.HELDOUT)
    traffic.disjoint_subjects(captured, heldout)
    everyday = everyday_items(args.everyday)
    if args.limit:
        captured, heldout, everyday = captured[:args.limit], heldout[:args.limit], everyday[:args.limit]
    model = model_of(config)
    summary: dict = {"host": host(), "config": str(config), "max_tokens": args.max_tokens,
                     "captured": len(captured), "heldout": len(heldout), "everyday": len(everyday)}
    mix_overrides = ["--speculative.suffix.enabled", "true", "--metrics.tenant_header", TENANT_HEADER,
                     *args.mix_override]
    draft = start("draft", config, ["--speculative.suffix.enabled", "false"], out)
    mix = start("mix", config, mix_overrides, out)
    try:
        clients = {"draft": client_of(draft), "mix": client_of(mix)}
        log(f"traffic: {len(captured)} requests on mix at {args.capture_clients} clients")
        t0 = time.perf_counter()
        served = await ask_all(clients["mix"], model, captured, args.max_tokens, args.capture_clients, tenant="app")
        summary["traffic"] = {**acceptance_length(served), "seconds": round(time.perf_counter() - t0, 1)}
        await ask_all(clients["draft"], model, captured[:8], args.max_tokens, args.capture_clients)
        log(f"traffic served: AL {summary['traffic']['al']} in {summary['traffic']['seconds']} s")
        summary["heldout_one_client"] = await paired(clients, model, heldout, args.max_tokens, "app")
        h = summary["heldout_one_client"]
        log(f"held-out: AL draft {h['draft']['al']} mix {h['mix']['al']}; speed-up {h['speedup']} "
            f"{h['speedup_rounds']}; identical {h['identical']}/{h['pairs']}")
        summary["everyday_one_client"] = await paired(clients, model, everyday, args.max_tokens, "app")
        e = summary["everyday_one_client"]
        log(f"everyday: AL draft {e['draft']['al']} mix {e['mix']['al']}; speed-up {e['speedup']} "
            f"{e['speedup_rounds']}; identical {e['identical']}/{e['pairs']}")
        summary["trees_after_one_client"] = await suffix_stats(mix)
        summary["clients"] = [await at_clients(clients, model, heldout, args.max_tokens, n, args.rounds)
                              for n in args.concurrency]
        summary["trees"] = await suffix_stats(mix)
    finally:
        draft.stop()
        mix.stop()
    if args.suffix_alone:
        alone = start("suffix-alone", Path(args.suffix_alone), [], out)
        try:
            c = client_of(alone)
            served = await ask_all(c, model, captured, args.max_tokens, args.capture_clients)
            held = await ask_all(c, model, heldout, args.max_tokens, 1)
            every = await ask_all(c, model, everyday, args.max_tokens, 1)
            summary["suffix_alone"] = {"traffic": acceptance_length(served),
                                       "heldout": {**acceptance_length(held), "tokens_per_s": tokens_per_s(held)},
                                       "everyday": {**acceptance_length(every), "tokens_per_s": tokens_per_s(every)}}
            log(f"vLLM's method suffix alone: held-out AL {summary['suffix_alone']['heldout']['al']}, "
                f"everyday AL {summary['suffix_alone']['everyday']['al']}")
        finally:
            alone.stop()
    h, e = summary["heldout_one_client"], summary["everyday_one_client"]
    summary["targets"] = {
        "heldout_al": {"value": h["mix"]["al"], "target": TARGETS["heldout_al"]},
        "heldout_al_ratio": {"value": round(h["mix"]["al"] / h["draft"]["al"], 4) if h["draft"]["al"] else None,
                             "target": TARGETS["heldout_al_ratio"]},
        "everyday_al_loss": {"value": round(e["draft"]["al"] - e["mix"]["al"], 4) if e["draft"]["al"] else None,
                             "target": TARGETS["everyday_al_loss"]},
        "speedup_one_client": {"value": h["speedup"], "rounds": h["speedup_rounds"],
                               "target": TARGETS["speedup_one_client"]},
        "greedy_identical": {"value": f"{h['identical']}/{h['pairs']}"},
    }
    summary["host"]["load_average_end"] = list(__import__("os").getloadavg())
    return summary


def tiny_config(work: Path) -> Path:
    from support.server_process import tiny_config as config_for
    from support.tiny_models import build_fixture_set

    models = build_fixture_set(work / "models")
    path = work / "tiny.yaml"
    path.write_text(yaml.safe_dump(config_for(models["target"], models["draft"], k=3,
                                              engine={"dtype": "float32", "max_model_len": 2048})))
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", type=Path)
    parser.add_argument("--tiny", action="store_true", help="the tiny test fixtures (a check of the script)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--capture-clients", type=int, default=4)
    parser.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",") if x], default=[4, 16, 32])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--everyday", type=int, default=68)
    parser.add_argument("--limit", type=int, default=0, help="at most this many requests of each set (0: all)")
    parser.add_argument("--mix-override", action="append", default=[], help="another override of the mix server")
    parser.add_argument("--suffix-alone", help="a config of vLLM's method suffix, run after the others")
    parser.add_argument("--out", type=Path, default=Path("runs/suffix-mix"))
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.tiny:
        work = Path(tempfile.mkdtemp(prefix="suffix-mix-"))
        config = tiny_config(work)
        args.limit = args.limit or 8
    elif args.config is None:
        parser.error("--config or --tiny")
    else:
        config = args.config
    summary = asyncio.run(run(args, config, args.out))
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
