"""What the draft-side penalties (``speculative.draft_penalties``) cost per engine step, and what they buy.

    python -m benchmarks.draft_penalties_cost [--parts function,engine] [--concurrency 1,16] [--k 2]
        [--config configs/smollm2-135m-instruct-eagle3-cpu.yaml] [--target PATH] [--rounds 4]

``function``: the processing of one step's draft logits alone, no engine (k positions, one row per
request, the target's vocabulary, presence penalty 0.8 as the CPU default ships it, prompts and outputs
of ``--context`` tokens): vLLM's ``apply_all_penalties`` at each position (what the patch did until the
counts were built once per step) against ``penalized_argmax`` (the patch now), and the full-vocabulary
row that both need (the EAGLE-3 draft's logits scattered into the target's vocabulary) against the local
argmax over the draft's own vocabulary (``use_local_argmax_reduction``, what runs with the patch off).
Microseconds per step, median of ``--repeats`` paired repeats.

``engine``: two offline engines built from the config (as the server builds its engine), draft-side
penalties on and off, open side by side. Each round, each serves the same ``--concurrency`` requests in
turn (the everyday set's first prompts, the model's shipped sampling from its generation_config, seeded,
``ignore_eos``, ``--max-tokens`` each), the order reversed every other round. Each engine step is timed
where the engine hands its output (``LLMEngine.step``). Per round and engine: the median step (ms), tokens
per second and the acceptance length; then the median over rounds of the ratio on/off. The schedule is
fixed at ``--k`` for every batch size (the shipped fp32 schedule drafts nothing from 12 requests on, where
the patch returns at once and costs nothing).

The host is shared: run it on an idle one, or read the spread of the rounds.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from pathlib import Path

from dynamo_spec.config import schedule as schedules
from dynamo_spec.config.loader import load_settings

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs/smollm2-135m-instruct-eagle3-cpu.yaml"
PRESENCE = 0.8  # the CPU default's generation_config


# --------------------------------------------------------------------------- the processing alone


def _median_us(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def function_cost(rows: int, k: int, vocab: int, draft_vocab: int, context: int, repeats: int) -> dict:
    """Microseconds per step of k draft positions for ``rows`` requests, each way."""
    import torch
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata
    from vllm.v1.sample.ops.penalties import apply_all_penalties

    from dynamo_spec.vllm_patches.draft_penalties import PenaltyContext, penalized_argmax

    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, vocab, (rows, context), generator=g)
    outputs = torch.randint(0, vocab, (rows, context), generator=g).tolist()
    presence = torch.full((rows,), PRESENCE)
    zeros, ones = torch.zeros(rows), torch.ones(rows)
    metadata = SamplingMetadata(
        temperature=None, all_greedy=True, all_random=False, top_p=None, top_k=None, generators={},
        max_num_logprobs=None, no_penalties=False, prompt_token_ids=prompts, presence_penalties=presence,
        frequency_penalties=zeros, repetition_penalties=ones, output_token_ids=outputs,
        allowed_token_ids_mask=None, bad_words_token_ids={}, logitsprocs=LogitsProcessors())
    draft_logits = [torch.randn(rows, draft_vocab, generator=g) for _ in range(k)]
    targets = torch.randperm(vocab, generator=g)[:draft_vocab]

    def full_row(small):  # what llama_eagle3's compute_logits builds from the draft's own logits
        full = small.new_full((rows, vocab), float("-inf"))
        full[:, targets] = small
        return full

    def each_position():  # vLLM's penalties rebuilt at every position (the patch before)
        drafted: list[list[int]] = []
        for small in draft_logits:
            logits = apply_all_penalties(full_row(small), prompts, presence, zeros, ones,
                                         [o + [p[i] for p in drafted] for i, o in enumerate(outputs)])
            drafted.append(logits.argmax(dim=-1).tolist())

    def once_per_step():  # the patch now
        context_ = PenaltyContext(metadata, [list(o) for o in outputs], vocab)
        for small in draft_logits:
            penalized_argmax(full_row(small), context_)

    def full_argmax():  # the full row without penalties
        for small in draft_logits:
            full_row(small).argmax(dim=-1).tolist()

    def local_argmax():  # use_local_argmax_reduction with the patch off
        for small in draft_logits:
            targets[small.argmax(dim=-1)].tolist()

    ways = {"penalties at each position": each_position, "penalties once per step": once_per_step,
            "full row, argmax": full_argmax, "local argmax": local_argmax}
    for fn in ways.values():
        fn()  # warm-up
    results = {name: [] for name in ways}
    for _ in range(repeats):  # paired: each way once per repeat
        for name, fn in ways.items():
            results[name].append(_median_us(fn, 1))
    return {name: statistics.median(us) for name, us in results.items()}


# --------------------------------------------------------------------------- engine steps


def engine(config: Path, target: Path | None, on: bool, k: int, max_batch: int):
    """The config's engine with the draft-side penalties on or off and a fixed k (a context manager)."""
    from dynamo_spec.training.offline_llm import llm_for

    overrides = ["--speculative.draft_penalties", str(on).lower(),
                 "--" + schedules.FIELD, json.dumps([[1, max_batch, k]])]
    if target is not None:
        overrides += ["--engine.model", str(target)]
    return llm_for(load_settings(config, overrides).settings)


def serve(llm, prompts: list[list[int]], max_tokens: int, tag: str) -> dict:
    """The requests at once; each engine step timed where the engine hands its output."""
    from vllm.inputs import TokensPrompt

    from dynamo_spec.training.evaluate import acceptance
    from dynamo_spec.training.offline_llm import request_params

    core = llm.llm_engine
    for i, prompt in enumerate(prompts):
        core.add_request(f"{tag}-{i}", TokensPrompt(prompt_token_ids=prompt),
                         request_params(llm, max_tokens=max_tokens, seed=i, ignore_eos=True))
    steps, finished = [], []
    start = last = time.perf_counter()
    while core.has_unfinished_requests():
        outputs = core.step()
        now = time.perf_counter()
        steps.append(now - last)
        last = now
        finished += [o for o in outputs if o.finished]
    tokens = sum(len(o.outputs[0].token_ids) for o in finished)
    k = max((len(o.outputs[0].spec_decode_metrics.to_dict()["acceptance_histogram"]) - 1 for o in finished
             if o.outputs[0].spec_decode_metrics is not None), default=0)
    return {"step_ms": statistics.median(steps) * 1e3, "steps": len(steps), "tok_s": tokens / (last - start),
            "acceptance_length": acceptance(finished, k)["mean_acceptance_length"] if k else 1.0}


def engine_cost(config: Path, target: Path | None, cs: list[int], k: int, rounds: int, max_tokens: int) -> dict:
    from dynamo_spec.training.evaluate import held_out_prompts
    from dynamo_spec.training.rows import EVERYDAY_EVAL

    max_batch = max(cs)
    settings = load_settings(config, ["--engine.model", str(target)] if target else []).settings
    _, prompts = held_out_prompts(Path(settings.engine.model), EVERYDAY_EVAL, max_batch)
    runs: dict = {c: {True: [], False: []} for c in cs}
    with contextlib.ExitStack() as stack:
        llms = {on: stack.enter_context(engine(config, target, on, k, max_batch)) for on in (True, False)}
        for on, llm in llms.items():
            serve(llm, prompts[:2], 16, f"warm-{on}")
        for r in range(rounds):
            for c in cs:
                order = (True, False) if r % 2 == 0 else (False, True)
                for on in order:
                    runs[c][on].append(serve(llms[on], prompts[:c], max_tokens, f"r{r}-c{c}"))
                    print(json.dumps({"round": r, "concurrency": c, "draft_penalties": on, **runs[c][on][-1]}),
                          flush=True)
    return runs


def _ratio(runs: dict, key: str) -> tuple[float, float, float]:
    ratios = sorted(a[key] / b[key] for a, b in zip(runs[True], runs[False]))
    return statistics.median(ratios), ratios[0], ratios[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default="function,engine")
    parser.add_argument("--config", type=Path, default=CONFIG)
    parser.add_argument("--target", type=Path, default=None, help="the target model (default: the config's)")
    parser.add_argument("--concurrency", default="1,16")
    parser.add_argument("--k", type=int, default=2, help="draft tokens per step at every batch size")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--context", type=int, default=200, help="function: prompt and output tokens per request")
    parser.add_argument("--repeats", type=int, default=200, help="function: paired repeats")
    parser.add_argument("--threads", type=int, default=None, help="function: torch threads (default: torch's)")
    args = parser.parse_args()
    cs = [int(c) for c in args.concurrency.split(",")]
    parts = args.parts.split(",")
    if "function" in parts:
        import torch

        if args.threads:
            torch.set_num_threads(args.threads)
        target = args.target or Path(load_settings(args.config).settings.engine.model)
        vocab = json.loads((target / "config.json").read_text())["vocab_size"]
        draft = json.loads((Path(load_settings(args.config).settings.speculative.model) / "config.json").read_text())
        print(f"\nfunction: k={args.k}, vocabulary {vocab} (draft {draft['draft_vocab_size']}), "
              f"{args.context} prompt and {args.context} output tokens per request; us per step, median of "
              f"{args.repeats}, {torch.get_num_threads()} threads")
        print("| requests | " + " | ".join(("penalties at each position", "penalties once per step",
                                            "full row, argmax", "local argmax")) + " |")
        print("|---|---|---|---|---|")
        for c in cs:
            us = function_cost(c, args.k, vocab, draft["draft_vocab_size"], args.context, args.repeats)
            print(f"| {c} | " + " | ".join(f"{v:.0f}" for v in us.values()) + " |", flush=True)
    if "engine" in parts:
        runs = engine_cost(args.config, args.target, cs, args.k, args.rounds, args.max_tokens)
        print(f"\nengine: k={args.k}, {args.rounds} rounds of {args.max_tokens} tokens per request; "
              "on/off: median ratio of the rounds (lowest-highest)")
        print("| requests | step ms on | step ms off | step on/off | tok/s on/off | acceptance length on, off |")
        print("|---|---|---|---|---|---|")
        for c in cs:
            on, off = runs[c][True], runs[c][False]
            step, tok = _ratio(runs[c], "step_ms"), _ratio(runs[c], "tok_s")
            print(f"| {c} | {statistics.median(r['step_ms'] for r in on):.1f} | "
                  f"{statistics.median(r['step_ms'] for r in off):.1f} | {step[0]:.3f} ({step[1]:.3f}-{step[2]:.3f}) | "
                  f"{tok[0]:.3f} ({tok[1]:.3f}-{tok[2]:.3f}) | "
                  f"{statistics.median(r['acceptance_length'] for r in on):.2f}, "
                  f"{statistics.median(r['acceptance_length'] for r in off):.2f} |")


if __name__ == "__main__":
    main()
