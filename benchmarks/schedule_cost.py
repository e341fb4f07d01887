"""What a batch-size schedule costs at the same k, engines side by side, interleaved.

    python -m benchmarks.schedule_cost --config configs/smollm2-135m-instruct-eagle3-cpu.yaml \
        [--variants fixed2,sched4,sched2] [--concurrency 1] [--rounds 6] [--prompts 6]

Every variant is its own vLLM engine (AsyncLLM, the server's engine, multiprocess), all
started in this process and kept up; then each round runs the same greedy requests
(64 tokens each, EOS ignored so every engine makes the same number; --per-client requests
per client) on each engine in turn, the order reversed every other round. Through-the-server
runs on a noisy 2-core host move by 10-45 % between servers started minutes apart; here the
engines take turns every few seconds, so host drift hits them alike and the per-round
ratio isolates the engine. Engine steps are counted as streamed deltas: equal counts
and equal text mean the drafts were the same, so a rate difference is per-step cost.

Variants:
    fixed2: num_speculative_tokens 2, no schedule (k=2 at every batch size)
    sched4: num_speculative_tokens 4, schedule [[1, max_num_seqs, 2]] (the shipped float32
            schedule's k at 1-5 requests, with the shipped num_speculative_tokens)
    sched2: num_speculative_tokens 2, schedule [[1, max_num_seqs, 2]]
    fixed4: num_speculative_tokens 4, no schedule
    sched0: the config's num_speculative_tokens, schedule [[1, max_num_seqs, 0]] (never a draft:
            what a schedule's k=0 ranges cost against speculation off)
    config: the config as it is (its schedule for this host)
    k0:     speculation off
    fixed2-drop, sched0-drop, config-drop: the same with vLLM's default for EAGLE, the last
            block of every prefix-cache hit dropped (the CPU config keeps it:
            speculative.extra.disable_eagle_block_drop)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import time
import uuid
from pathlib import Path

from dynamo_spec.bench.prompts import load_sets, split
from dynamo_spec.config.loader import load_settings
from dynamo_spec.config.preflight import effective_max_num_seqs
from dynamo_spec.engine.async_llm import open_engine
from dynamo_spec.engine.host import on_cpu

# vLLM's default for EAGLE: drop the last block of every prefix-cache hit (the CPU config keeps it)
DROP = ["--speculative.extra.disable_eagle_block_drop", "false"]


def variants(max_batch: int) -> dict[str, list[str]]:
    """Each variant's config overrides; a schedule's one range runs to `max_batch` (max_num_seqs)."""

    def schedule(k: int) -> list[str]:
        return ["--speculative.num_speculative_tokens_per_batch_size", f"[[1,{max_batch},{k}]]"]

    out = {
        "fixed2": ["--speculative.num_speculative_tokens", "2",
                   "--speculative.num_speculative_tokens_per_batch_size", "null"],
        "sched4": ["--speculative.num_speculative_tokens", "4", *schedule(2)],
        "sched2": ["--speculative.num_speculative_tokens", "2", *schedule(2)],
        "fixed4": ["--speculative.num_speculative_tokens", "4",
                   "--speculative.num_speculative_tokens_per_batch_size", "null"],
        "sched0": schedule(0),
        "config": [],
        "k0": ["--speculative.enabled", "false"],
    }
    out.update({f"{name}-drop": [*out[name], *DROP] for name in ("fixed2", "sched0", "config")})
    return out


SYSTEM_RULES = ("You are a helpful assistant for a small online shop. Answer politely and briefly. "
                "Give prices in euros, never promise delivery dates, and suggest contacting support "
                "for refunds, damaged parcels or account problems.")


def shared_system_prompt(words: int) -> str:
    """A fixed system prompt of about `words` words (a prefix every request shares, as an
    application's instructions are): what prefix caching serves from cache."""
    rules = SYSTEM_RULES.split()
    return " ".join(rules[i % len(rules)] for i in range(words))


async def one(engine, prompt: str, max_tokens: int) -> tuple[list[int], int]:
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA)
    tokens: list[int] = []
    steps = 0
    async for out in engine.generate(prompt, params, request_id=uuid.uuid4().hex):
        new = out.outputs[0].token_ids
        if new:
            steps += 1
            tokens.extend(new)
    return tokens, steps


async def run(engine, prompts: list[str], concurrency: int, max_tokens: int,
              requests: int | None = None) -> tuple[float, int, int, list]:
    """`requests` greedy requests (default: one per prompt, else cycling over them), at most
    `concurrency` in flight; returns (wall, output tokens, engine steps summed over requests, outputs)."""
    queue = [prompts[i % len(prompts)] for i in range(requests or len(prompts))]
    outputs: list = []
    steps = 0

    async def client() -> None:
        nonlocal steps
        while queue:
            tokens, s = await one(engine, queue.pop(0), max_tokens)
            outputs.append(tokens)
            steps += s

    start = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    wall = time.perf_counter() - start
    return wall, sum(len(t) for t in outputs), steps, outputs


async def main_async(args: argparse.Namespace) -> None:
    from transformers import AutoTokenizer

    names = [n for n in args.variants.split(",") if n]
    base = load_settings(args.config).settings
    known = variants(effective_max_num_seqs(base, on_cpu()))
    if unknown := [n for n in names if n not in known]:
        raise SystemExit(f"unknown variants: {unknown} (known: {', '.join(known)})")
    tokenizer = AutoTokenizer.from_pretrained(base.engine.model)
    items = split(load_sets())[1][: args.prompts]
    system = [{"role": "system", "content": shared_system_prompt(args.system_words)}] if args.system_words else []
    prompts = [tokenizer.apply_chat_template(system + i["messages"], tokenize=False, add_generation_prompt=True)
               for i in items]
    concurrency = [int(c) for c in args.concurrency.split(",")]
    async with contextlib.AsyncExitStack() as stack:
        engines = {}
        for name in names:
            settings = load_settings(args.config, known[name] + args.override).settings
            t0 = time.perf_counter()
            engines[name] = await stack.enter_async_context(open_engine(settings))
            print(f"{name}: ready in {time.perf_counter() - t0:.0f} s", flush=True)
        for engine in engines.values():  # warm-up (compiles the shapes these loads hit)
            for c in concurrency:
                await run(engine, prompts[:max(2, c)], c, 16)
        rates: dict[tuple[str, int], list[float]] = {}
        steps_seen: dict[tuple[str, int], int] = {}
        texts: dict[tuple[str, int], list] = {}
        for r in range(args.rounds):
            order = names if r % 2 == 0 else names[::-1]
            for c in concurrency:
                for name in order:
                    wall, tokens, steps, outs = await run(engines[name], prompts, c, args.max_tokens,
                                                          max(len(prompts), args.per_client * c))
                    rates.setdefault((name, c), []).append(tokens / wall)
                    steps_seen[(name, c)] = steps
                    texts[(name, c)] = outs
                line = ", ".join(f"{n} {rates[(n, c)][-1]:.1f}" for n in names)
                print(f"round {r} c={c}: tok/s {line}", flush=True)
    ref = names[0]
    print(f"\n| engine | c | tok/s median | ratio to {ref}: median (per round) | engine steps | same tokens as {ref} |")
    print("|---|---|---|---|---|---|")
    for c in concurrency:
        for name in names:
            ratios = [a / b for a, b in zip(rates[(name, c)], rates[(ref, c)])]
            same = sorted(map(tuple, texts[(name, c)])) == sorted(map(tuple, texts[(ref, c)]))
            print(f"| {name} | {c} | {statistics.median(rates[(name, c)]):.1f} | {statistics.median(ratios):.3f} "
                  f"({', '.join(f'{x:.2f}' for x in ratios)}) | {steps_seen[(name, c)]} | {same} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, required=True)
    parser.add_argument("--variants", default="fixed2,sched4,sched2")
    parser.add_argument("--concurrency", default="1")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--per-client", type=int, default=4, help="requests per client (at least one per prompt)")
    parser.add_argument("--system-words", type=int, default=0,
                        help="prepend a shared system prompt of about this many words to every request")
    parser.add_argument("--override", nargs="*", default=[], help="config overrides for every engine")
    asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    main()
