"""Subcommands ``train-draft`` and ``eval-draft``; ``register(subparsers)`` adds them."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
from pathlib import Path

from ..logs import setup_logging
from .rows import EVERYDAY_EVAL


def _list_of(cast):
    """An argparse type: 'a,b c' -> [cast(a), cast(b), cast(c)] ('' -> [])."""
    def parse(text: str) -> list:
        return [cast(x) for x in text.replace(",", " ").split()]

    parse.__name__ = f"{cast.__name__} list"  # argparse names the type in its error message
    return parse


_ks = _list_of(int)
_floats = _list_of(float)


def _setting(text: str) -> str | float:
    return text if text == "default" else float(text)


_setting.__name__ = "'default' or float"
_settings = _list_of(_setting)


def _layers(text: str) -> tuple[int, ...]:
    return tuple(_ks(text))


_TUPLE_OF = {"int": _layers, "float": _floats, "str": _list_of(str)}


def _add_pipeline_options(parser: argparse.ArgumentParser) -> None:
    """One option per PipelineConfig field: its default and help come from there."""
    from .pipeline import PipelineConfig

    budget = parser.add_mutually_exclusive_group()
    for f in dataclasses.fields(PipelineConfig):
        if f.metadata.get("cli", True) is False:
            continue
        flag = "--" + f.name.replace("_", "-")
        default = None if f.default is dataclasses.MISSING else f.default
        shown = default not in (None, ()) and default is not False
        kwargs = {"help": f.metadata["help"] + (" (default: %(default)s)" if shown else "")}
        if f.metadata.get("required"):
            kwargs["required"] = True
        else:
            kwargs["default"] = default
        if "choices" in f.metadata:
            kwargs["choices"] = f.metadata["choices"]
        kind = str(f.type)
        if f.name == "data_from":
            kwargs.update(type=Path, action="append", default=[])
        elif kind == "bool":
            kwargs["action"] = "store_true"
        elif kind.startswith("tuple["):  # a comma list: "1,2,3" (the element type from the annotation)
            kwargs["type"] = _TUPLE_OF[kind.split("[")[1].split(",")[0]]
        elif "Path" in kind:
            kwargs["type"] = Path
        elif "float" in kind:
            kwargs["type"] = float
        elif "int" in kind:
            kwargs["type"] = int
        (budget if f.name in ("minutes", "steps") else parser).add_argument(flag, **kwargs)


def register(subparsers) -> None:
    p = subparsers.add_parser("train-draft", help="train an EAGLE-3 draft for a target model",
                              description="Prompts from PyPI packages, the target's greedy answers "
                              "and hidden states, then EAGLE-3 training. "
                              "Re-running the same command resumes.")
    _add_pipeline_options(p)
    p.set_defaults(func=_train_draft)

    e = subparsers.add_parser("eval-draft", help="acceptance and speed of a draft on held-out "
                              "prompts (vLLM)")
    e.add_argument("--target", type=Path, required=True)
    e.add_argument("--draft", type=Path, required=True)
    e.add_argument("--prompts", type=Path, default=EVERYDAY_EVAL,
                   help="rows with 'source', 'split' and 'messages'; the 'eval' split is used "
                   "(default: the shipped everyday-instruction set; train-draft's own held-out "
                   "split: .cache/train/prompts.jsonl)")
    e.add_argument("--n", type=int, default=100, help="held-out prompts for acceptance")
    e.add_argument("--k", type=_ks, default=[1, 2, 3, 4, 5],
                   help="k values for acceptance, e.g. '1,2,3,4,5' ('' for speed only)")
    e.add_argument("--speed-k", type=int, default=3, help="k for the tokens/s comparison")
    e.add_argument("--speed-prompts", type=int, default=8)
    e.add_argument("--speed-runs", type=int, default=3, help="0 skips the speed test")
    e.add_argument("--temperatures", type=_settings, default=["default", 0.0],
                   help="sampling settings for acceptance: 'default' (a request that sets no "
                   "sampling field) or a temperature (0: greedy), e.g. 'default,0,0.7'; the "
                   "fields a request leaves out take the model's defaults (generation_config.json)"
                   " (default: default,0)")
    e.add_argument("--generation-config", choices=["auto", "vllm"], default="auto",
                   help="auto: the model's sampling defaults apply, as in the server; "
                   "vllm: vLLM's neutral ones (default: auto)")
    e.add_argument("--max-tokens", type=int, default=128, help="new tokens (acceptance)")
    e.add_argument("--speed-max-tokens", type=int, default=64, help="new tokens (speed)")
    e.add_argument("--calibration", action="store_true",
                   help="also tabulate the draft's own confidence in each token against what the "
                   "target accepted (deciles, Brier score, calibration error, AUC)")
    e.add_argument("--draft-penalties", type=_on_off, default=[True, False],
                   help="on, off or on,off: the draft drafts under the request's penalties "
                   "(speculative.draft_penalties), or as vLLM drafts; both: acceptance with and without, "
                   "one engine each (default: on,off)")
    e.add_argument("--suffix", type=_on_off, default=[False],
                   help="on, off or on,off: with the suffix-tree mix (speculative.suffix at its defaults; its trees "
                   "learn from the batch's answers as they finish), without, or each, one engine each (default: off)")
    e.add_argument("--json", type=Path, help="also write the results here")
    e.set_defaults(func=_eval_draft)


def _on_off(text: str) -> list[bool]:
    values = {"on": True, "off": False}
    try:
        return [values[v.strip()] for v in text.split(",") if v.strip()]
    except KeyError:
        raise argparse.ArgumentTypeError(f"expected on, off or on,off, not {text!r}") from None


def _one_line_errors(command: str):
    """What goes wrong for a known reason (a missing file, a bad option value, a model
    the tools cannot use) reaches the user as one line, not a traceback."""
    def wrap(fn):
        @functools.wraps(fn)
        def run(args: argparse.Namespace) -> int:
            try:
                return fn(args)
            except (OSError, ValueError, KeyError, RuntimeError) as exc:
                print(f"dynamo-spec {command}: error: {type(exc).__name__}: {exc}", file=sys.stderr)
                return 1
        return run
    return wrap


@_one_line_errors("train-draft")
def _train_draft(args: argparse.Namespace) -> int:
    from .pipeline import PipelineConfig, run_pipeline

    setup_logging()
    if not (args.target / "config.json").is_file():
        raise FileNotFoundError(f"--target {args.target}: no config.json there (a model directory is needed)")
    options = {f.name: getattr(args, f.name) for f in dataclasses.fields(PipelineConfig) if hasattr(args, f.name)}
    options["data_from"] = tuple(options["data_from"])
    if options["steps"]:
        options["minutes"] = None
    cfg = PipelineConfig(**options)
    summary = run_pipeline(cfg)
    print(json.dumps(summary, indent=2, default=str))  # paths (init_from, data_from) as text
    return 0


@_one_line_errors("eval-draft")
def _eval_draft(args: argparse.Namespace) -> int:
    from .evaluate import evaluate_draft, format_report

    setup_logging()
    result = evaluate_draft(args.target, args.draft, args.prompts, n=args.n, ks=args.k,
                            speed_k=args.speed_k, speed_prompts=args.speed_prompts,
                            speed_runs=args.speed_runs, max_tokens=args.max_tokens,
                            speed_max_tokens=args.speed_max_tokens,
                            temperatures=args.temperatures,
                            generation_config=args.generation_config,
                            calibration=args.calibration, draft_penalties=tuple(args.draft_penalties),
                            suffix=tuple(args.suffix))
    print(format_report(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Standalone entry (``python -m dynamo_spec.training.commands``); ``dynamo-spec`` registers the same commands."""
    parser = argparse.ArgumentParser(prog="dynamo-spec")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
