"""Subcommands ``train-draft`` and ``eval-draft``; ``register(subparsers)`` adds them."""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path


def _layers(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.replace(",", " ").split())


def _ks(text: str) -> list[int]:
    return [int(x) for x in text.replace(",", " ").split()]


def register(subparsers) -> None:
    p = subparsers.add_parser("train-draft", help="train an EAGLE-3 draft for a target model",
                              description="Prompts from PyPI packages, the target's greedy answers "
                              "and hidden states, then EAGLE-3 training. "
                              "Re-running the same command resumes.")
    p.add_argument("--target", type=Path, required=True, help="target model directory")
    p.add_argument("--out", type=Path, required=True, help="where to write the draft")
    p.add_argument("--work-dir", type=Path, default=Path(".cache/train"),
                   help="intermediate data and checkpoints (default: .cache/train)")
    p.add_argument("--seed", type=int, default=0)
    budget = p.add_mutually_exclusive_group()
    budget.add_argument("--minutes", type=float, default=25.0,
                        help="training time budget (steps estimated once, then fixed)")
    budget.add_argument("--steps", type=int, help="exact number of optimizer steps")
    p.add_argument("--answer-minutes", type=float, default=26.0,
                   help="time budget for generating answers (stops early, resumable)")
    p.add_argument("--max-new-tokens", type=int, default=192)
    p.add_argument("--generator", choices=("decoder", "vllm"), default="decoder",
                   help="decoder: one transformers pass keeps the hidden states while it "
                   "decodes (default); vllm: vLLM answers, then a separate states pass")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                   help="the target's dtype in transformers (the decoder's answers and "
                   "states, the self-prompts, vllm's states pass); default: bfloat16, the "
                   "serving dtype")
    p.add_argument("--more-chitchat", type=int, default=20000,
                   help="extra chit-chat prompts (other cuts of non-held-out conversations)")
    p.add_argument("--samples", type=int, default=0,
                   help="extra sampled answers per train prompt of the small sources "
                   "(chatterbot, mtbench, humaneval, mmlu, bbh)")
    p.add_argument("--temperature", type=float, default=0.7,
                   help="sampling temperature of those extra answers")
    p.add_argument("--self-prompts", type=int, default=0,
                   help="this many extra prompts written by the target itself (Magpie: "
                   "sampled from its chat template's start of a user turn)")
    p.add_argument("--self-temperature", type=float, default=0.8,
                   help="sampling temperature of those prompts")
    p.add_argument("--self-seed", type=int,
                   help="sampling seed of those prompts (default: --seed); another seed "
                   "gives new requests while the prompt split, set by --seed, stays; "
                   "requests already in a --data-from dir are not kept again")
    p.add_argument("--init-from", type=Path,
                   help="start from this draft's weights (fc, decoder layer, norm) instead "
                   "of a random init")
    p.add_argument("--data-from", type=Path, action="append", default=[],
                   help="an earlier work dir whose answers and states are trained on too "
                   "(its prompts are not answered again); repeatable")
    p.add_argument("--aux-layers", type=_layers, default=(2, 15, 27),
                   help="target layers fed to the draft, e.g. '2,15,27'")
    p.add_argument("--draft-vocab", type=int, default=8192)
    p.set_defaults(func=_train_draft)

    e = subparsers.add_parser("eval-draft", help="acceptance and speed of a draft on held-out "
                              "prompts (vLLM, greedy)")
    e.add_argument("--target", type=Path, required=True)
    e.add_argument("--draft", type=Path, required=True)
    e.add_argument("--prompts", type=Path, default=Path(".cache/train/prompts.jsonl"),
                   help="prompt file from train-draft; its 'eval' split is used")
    e.add_argument("--n", type=int, default=100, help="held-out prompts for acceptance")
    e.add_argument("--k", type=_ks, default=[1, 2, 3, 4, 5],
                   help="k values for acceptance, e.g. '1,2,3,4,5' ('' for speed only)")
    e.add_argument("--speed-k", type=int, default=3, help="k for the tokens/s comparison")
    e.add_argument("--speed-prompts", type=int, default=8)
    e.add_argument("--speed-runs", type=int, default=3, help="0 skips the speed test")
    e.add_argument("--max-tokens", type=int, default=128, help="new tokens (acceptance)")
    e.add_argument("--speed-max-tokens", type=int, default=64, help="new tokens (speed)")
    e.add_argument("--json", type=Path, help="also write the results here")
    e.set_defaults(func=_eval_draft)


def _train_draft(args: argparse.Namespace) -> int:
    from .pipeline import PipelineConfig, run_pipeline

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: "
                        "%(message)s")
    cfg = PipelineConfig(target=args.target, out=args.out, work_dir=args.work_dir,
                         seed=args.seed, steps=args.steps,
                         minutes=None if args.steps else args.minutes,
                         answer_minutes=args.answer_minutes,
                         max_new_tokens=args.max_new_tokens, aux_layers=args.aux_layers,
                         draft_vocab=args.draft_vocab, generator=args.generator,
                         dtype=args.dtype,
                         more_chitchat=args.more_chitchat, data_from=tuple(args.data_from),
                         samples=args.samples, temperature=args.temperature,
                         self_prompts=args.self_prompts,
                         self_temperature=args.self_temperature, self_seed=args.self_seed,
                         init_from=args.init_from)
    summary = run_pipeline(cfg)
    print(json.dumps(summary, indent=2))
    return 0


def _eval_draft(args: argparse.Namespace) -> int:
    from .evaluate import evaluate_draft, format_report

    logging.basicConfig(level=logging.INFO)
    result = evaluate_draft(args.target, args.draft, args.prompts, n=args.n, ks=args.k,
                            speed_k=args.speed_k, speed_prompts=args.speed_prompts,
                            speed_runs=args.speed_runs, max_tokens=args.max_tokens,
                            speed_max_tokens=args.speed_max_tokens)
    print(format_report(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Standalone entry (``python -m dynamo_spec.training.cli``); ``dynamo-spec`` registers the same commands."""
    parser = argparse.ArgumentParser(prog="dynamo-spec")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
