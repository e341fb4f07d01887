"""``dynamo-spec verify``: is speculative decoding lossless for this target + draft?

Greedy-decodes the same prompts twice, without and with speculation (two engines, one
after the other, each fully shut down), and compares the tokens. The requests set only the
temperature (0), so the model's other sampling defaults (``generation_config.json``: a
repetition penalty, say) apply, as they do in the server. At the first
differing token it reports the log-prob margin of the reference run between the
token it chose and the one the speculative run chose: in bf16, verifying several
tokens in one pass rounds differently from one-token steps, so a near-tie (margin
below ``--tie-nats``) is numerical noise, while a clear margin is a real bug.

Under batching (``--concurrency 1,4,16``): at each concurrency N both engines have at most N
requests in flight (a new one enters as one finishes, as N clients keep a server, so batches
keep N requests and mix prefills with decodes; one engine per variant serves every N in turn),
the speculative one with a fixed k and, with
``--schedule`` or ``--config``, with a batch-size schedule whose ranges the batch crosses as
requests finish, and where the config turns it on, with the confidence budget too. What
else moves greedy output between two runs is reported with the results: vLLM's CPU
split-KV attention (``VLLM_CPU_ATTN_SPLIT_KV``), the chunked-prefill
budget (draft tokens share it, so chunk boundaries move) and the threads.
Exit status: 0 when no real difference, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..logs import setup_logging
from .rows import interleave_sources

logger = logging.getLogger(__name__)


@dataclass
class Difference:
    prompt: int
    position: int  # index into the generated tokens
    reference_token: int
    speculative_token: int
    margin: float  # reference logprob(chosen) - logprob(speculative's token), >= 0

    def near_tie(self, tie_nats: float) -> bool:
        return self.margin <= tie_nats


def load_prompts(path: Path, n: int) -> list[list[dict]]:
    """Chat message lists from a prompt file: JSON lines with ``messages`` (the eval
    split, sources interleaved, when rows carry one) or ``prompt``, or plain text, one
    user message a line."""
    lines = [line for line in Path(path).read_text().splitlines() if line.strip()]
    if path.suffix != ".jsonl":
        return [[{"role": "user", "content": line}] for line in lines[:n]]
    rows = [json.loads(line) for line in lines]
    if any("split" in r for r in rows):
        rows = interleave_sources([r for r in rows if r.get("split") == "eval"])
    return [r.get("messages") or [{"role": "user", "content": r["prompt"]}] for r in rows][:n]


def _run(target: Path, prompt_ids, max_tokens: int, dtype: str, draft: Path | None, k: int,
         generation_config: str = "auto", concurrency: list[int] | None = None, schedule=None,
         draft_budget: dict | None = None):
    """Greedy outputs [(tokens, logprobs)] of one engine: all prompts at once, or with `concurrency`
    a list of them per N ({N: outputs}), N requests in flight at a time; and the penalties applied."""
    from .offline_llm import offline_llm, request_params

    # The log-probs the greedy choice was made from (after the model's penalties), not vLLM's
    # default raw ones: a margin is only meaningful on the distribution that chose.
    with offline_llm(target, draft=draft, k=k, dtype=dtype, generation_config=generation_config,
                     max_num_seqs=max(concurrency) if concurrency else max(8, len(prompt_ids)), schedule=schedule,
                     draft_budget=draft_budget, logprobs_mode="processed_logprobs") as llm:
        params = request_params(llm, temperature=0.0, max_tokens=max_tokens, logprobs=5)
        if concurrency:
            outs = {n: in_flight(llm, prompt_ids, params, n) for n in concurrency}
        else:
            outs = [(list(o.outputs[0].token_ids), o.outputs[0].logprobs)
                    for o in llm.generate([_prompt(p) for p in prompt_ids], params, use_tqdm=False)]
    return outs, penalties(params)


def _prompt(ids: list[int]):
    from vllm.inputs import TokensPrompt

    return TokensPrompt(prompt_token_ids=ids)


def in_flight(llm, prompt_ids: list[list[int]], params, n: int) -> list[tuple[list[int], Any]]:
    """The prompts in order with at most `n` requests in the engine: the next one enters in the step
    after one finishes, as with `n` clients (or ``max_num_seqs`` n and all submitted at once)."""
    engine, todo, results = llm.llm_engine, list(enumerate(prompt_ids)), {}

    def add() -> None:  # outputs carry the id given here (vLLM's own internal id is another)
        i, ids = todo.pop(0)
        engine.add_request(str(i), _prompt(ids), params)

    for _ in range(min(n, len(todo))):
        add()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                results[int(out.request_id)] = (list(out.outputs[0].token_ids), out.outputs[0].logprobs)
                if todo:
                    add()
    return [results[i] for i in range(len(prompt_ids))]


def penalties(params) -> dict:
    """The penalties of ``params`` that differ from none."""
    neutral = {"repetition_penalty": 1.0, "frequency_penalty": 0.0, "presence_penalty": 0.0}
    return {k: getattr(params, k) for k, v in neutral.items() if getattr(params, k) != v}


def _margin(logprobs_at, chosen: int, other: int) -> float:
    """logprob(chosen) - logprob(other) at one position; if ``other`` is outside the
    returned top log-probs, the gap to the lowest one returned (a lower bound)."""
    lp = {tok: entry.logprob for tok, entry in logprobs_at.items()}
    floor = min(lp.values())
    return lp.get(chosen, max(lp.values())) - lp.get(other, floor)


def compare(reference, speculative) -> list[Difference]:
    diffs = []
    for i, ((ref_toks, ref_lps), (spec_toks, _)) in enumerate(zip(reference, speculative)):
        for pos, (a, b) in enumerate(zip(ref_toks, spec_toks)):
            if a != b:
                diffs.append(Difference(i, pos, a, b, _margin(ref_lps[pos], a, b)))
                break
        else:
            if len(ref_toks) != len(spec_toks):
                pos = min(len(ref_toks), len(spec_toks))
                diffs.append(Difference(i, pos, -1, -1, float("inf")))
    return diffs


def _prompt_ids(target: Path, prompts: list[list[dict]]) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(target)
    return [list(tok.apply_chat_template(m, add_generation_prompt=True, tokenize=True,
                                         return_dict=False)) for m in prompts]


def verify(target: Path, draft: Path, k: int, prompts: list[list[dict]], *,
           max_tokens: int = 128, dtype: str = "bfloat16",
           generation_config: str = "auto") -> tuple[list[Difference], dict]:
    """The first difference of each prompt that differs, and the penalties both runs
    applied (from the model's defaults)."""
    ids = _prompt_ids(target, prompts)
    reference, applied = _run(target, ids, max_tokens, dtype, None, k, generation_config)
    speculative, _ = _run(target, ids, max_tokens, dtype, draft, k, generation_config)
    return compare(reference, speculative), applied


def verify_batched(target: Path, draft: Path, k: int, prompts: list[list[dict]], concurrency: list[int], *,
                   schedule=None, max_tokens: int = 128, dtype: str = "bfloat16",
                   generation_config: str = "auto", draft_budget: dict | None = None) -> tuple[list[dict], dict]:
    """At each concurrency: the reference, then fixed k (and the schedule when given, and the
    schedule with the confidence budget when given), each compared token for token with the
    reference. One engine each, serving every concurrency in turn. Rows of {concurrency, variant, diffs}."""
    ids = _prompt_ids(target, prompts)
    variants = [(f"k={k}", None, None)] + ([(f"schedule {json.dumps(schedule)}", schedule, None)] if schedule else [])
    if draft_budget:
        variants.append(((f"schedule {json.dumps(schedule)}" if schedule else f"k={k}") + " + confidence budget",
                         schedule, draft_budget))
    reference, applied = _run(target, ids, max_tokens, dtype, None, k, generation_config, concurrency)
    speculative = {name: _run(target, ids, max_tokens, dtype, draft, k, generation_config, concurrency, sched,
                              budget)[0] for name, sched, budget in variants}
    rows = [{"concurrency": n, "variant": name, "diffs": compare(reference[n], outs[n])}
            for n in concurrency for name, outs in speculative.items()]
    return rows, applied


def conditions(dtype: str) -> str:
    """What moves greedy output between runs besides speculation, as this run had it."""
    import os

    split_kv = os.environ.get("VLLM_CPU_ATTN_SPLIT_KV", "1")
    threads = os.environ.get("VLLM_CPU_OMP_THREADS_BIND") or os.environ.get("OMP_NUM_THREADS") or "vLLM's"
    return (f"{dtype}, VLLM_CPU_ATTN_SPLIT_KV={split_kv}, threads {threads}, chunked prefill with "
            "vLLM's token budget (the draft tokens share it)")


def _print_diffs(diffs: list[Difference], tie_nats: float, prefix: str = "") -> int:
    real = [d for d in diffs if not d.near_tie(tie_nats)]
    for d in diffs:
        kind = "near-tie" if d.near_tie(tie_nats) else "REAL DIFFERENCE"
        print(f"{prefix}prompt {d.prompt}: first difference at generated token {d.position}: "
              f"reference {d.reference_token} vs speculative {d.speculative_token}, "
              f"margin {d.margin:.3f} nats ({kind})")
    return len(real)


def _schedule(args: argparse.Namespace):
    if args.schedule:
        return json.loads(args.schedule)
    if args.config:
        from ..config import schedule as schedules
        from ..config.loader import load_settings

        settings = load_settings(args.config).settings
        torch_dtype = "bfloat16" if args.dtype == "bfloat16" else "float32"
        applied, _ = schedules.for_engine(settings, torch_dtype)
        return schedules.as_lists(applied) if applied else None
    return None


def _draft_budget(args: argparse.Namespace) -> dict | None:
    """The config's confidence budget, where it turns it on."""
    if not args.config:
        return None
    from ..config.loader import load_settings

    budget = load_settings(args.config).settings.speculative.draft_budget
    return budget.model_dump() if budget.enabled else None


def _cmd(args: argparse.Namespace) -> int:
    setup_logging()
    prompts = load_prompts(args.prompts, args.n)
    if not args.concurrency:
        diffs, applied = verify(args.target, args.draft, args.k, prompts, max_tokens=args.max_tokens,
                                dtype=args.dtype, generation_config=args.generation_config)
        real = _print_diffs(diffs, args.tie_nats)
        shown = ", ".join(f"{k} {v:g}" for k, v in applied.items()) or "no penalty"
        print(f"verify: {len(prompts)} prompts, k={args.k}, {args.dtype}, greedy, {shown}: "
              f"{len(prompts) - len(diffs)} identical, {len(diffs) - real} near-ties "
              f"(<= {args.tie_nats} nats), {real} real differences")
        return 1 if real else 0
    rows, applied = verify_batched(args.target, args.draft, args.k, prompts, args.concurrency,
                                   schedule=_schedule(args), max_tokens=args.max_tokens, dtype=args.dtype,
                                   generation_config=args.generation_config, draft_budget=_draft_budget(args))
    shown = ", ".join(f"{k} {v:g}" for k, v in applied.items()) or "no penalty"
    print(f"verify: {len(prompts)} prompts, greedy, {shown}; {conditions(args.dtype)}")
    print("\n| concurrency | speculation | identical | near-ties | real differences |\n|---|---|---|---|---|")
    total = 0
    for row in rows:
        real = sum(not d.near_tie(args.tie_nats) for d in row["diffs"])
        total += real
        print(f"| {row['concurrency']} | {row['variant']} | {len(prompts) - len(row['diffs'])} | "
              f"{len(row['diffs']) - real} | {real} |")
    print(f"\n(near-tie: the reference's top-2 log-prob gap at the first difference <= {args.tie_nats} nats)")
    for row in rows:
        _print_diffs(row["diffs"], args.tie_nats, prefix=f"concurrency {row['concurrency']}, {row['variant']}: ")
    return 1 if total else 0


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def register(subparsers) -> None:
    p = subparsers.add_parser("verify", help="check that speculation does not change "
                              "greedy output", description=__doc__.split("\n\n")[0])
    p.add_argument("--target", type=Path, required=True, help="target model directory")
    p.add_argument("--draft", type=Path, required=True, help="EAGLE-3 draft directory")
    p.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    p.add_argument("--prompts", type=Path, required=True,
                   help="JSON lines (messages or prompt; the eval split if marked) or text")
    p.add_argument("--n", type=int, default=50, help="number of prompts")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--generation-config", choices=["auto", "vllm"], default="auto",
                   help="auto: the model's sampling defaults other than the temperature apply "
                   "(its penalties), as in the server; vllm: none (default: auto)")
    p.add_argument("--concurrency", type=_ints, default=None,
                   help="e.g. 1,4,16: at each, both engines decode at most that many requests at once "
                   "(all prompts submitted together); default: all at once, fixed k only")
    p.add_argument("--schedule", help="with --concurrency: also a batch-size schedule of k, JSON [[lo, hi, k], ...]")
    p.add_argument("--config", type=Path, help="with --concurrency: also the schedule this config applies "
                   "for --dtype, and with it the config's confidence budget where it is on")
    p.add_argument("--tie-nats", type=float, default=0.25,
                   help="a first difference within this log-prob margin is a near-tie")
    p.set_defaults(func=_cmd)
