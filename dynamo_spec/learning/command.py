"""``dynamo-spec learn-draft --config FILE [overrides]``: one learn cycle (``learn.py``) beside a
serving engine: niced, on ``learning.threads`` cores (default: half of them). Progress goes to
stderr; the last stdout line is one JSON object. Exit 0: promoted; 3: the gate refused (the
version is kept, not promoted); 2: bad input, one line (no captures, captures of another
target, a config error); 1: the cycle failed, one line."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

from .learn import EXIT_BAD_INPUT, EXIT_ERROR, EXIT_PROMOTED, EXIT_REFUSED, LearnOptions

NICENESS = 10


def register(subparsers) -> None:
    from ..cli import OVERRIDES_HELP

    p = subparsers.add_parser(
        "learn-draft", help="fine-tune the served draft on the captured traffic; promote it if the gate passes",
        description="One learn cycle: the captures not yet learnt from (the newest tenth held out), a replay slice of "
        "the data/ rounds, the target's hidden states, a warm start from the served draft keeping its vocabulary, a "
        "new version under learning.dir/drafts/, and the gate (held-out gain >= learning.min_gain, everyday loss <= "
        "learning.max_loss). Exit 0: promoted, 3: refused, 2: bad input.", epilog=OVERRIDES_HELP)
    p.add_argument("--config", "-c", required=True, help="YAML config file of the server (see configs/)")
    defaults = LearnOptions()
    helps = {
        "steps": "optimizer steps (default: --epochs passes over the training rows)",
        "epochs": "passes over the training rows (captures and replay) when --steps is not given",
        "lr": "peak learning rate (warm-up, then cosine)",
        "replay": "replayed data/ tokens per captured training token, so everyday acceptance holds (0: none)",
        "corpus": "the data/ rounds to replay (rounds of this target only)",
        "heldout_share": "share of the newest captures held out for the gate",
        "k": "draft tokens per step when measuring (default: speculative.num_speculative_tokens)",
        "everyday_prompts": "prompts of the everyday evaluation set measured (68: all)",
        "max_tokens": "new tokens per measured request at most",
        "seed": "seed of the replay slice and of training",
    }
    for f in dataclasses.fields(LearnOptions):
        kind = {"int | None": int, "float": float, "int": int, "Path": Path}[str(f.type)]
        p.add_argument("--" + f.name.replace("_", "-"), type=kind, default=getattr(defaults, f.name),
                       help=helps[f.name] + (" (default: %(default)s)" if getattr(defaults, f.name) is not None else ""))
    p.set_defaults(func=learn_draft, accepts_overrides=True)


def _cap_cores(threads: int | None) -> int:
    """Run on ``threads`` of this process's cores (default half), the last ones: the engines the
    cycle starts inherit it (vLLM binds its threads to them)."""
    import torch

    cores = sorted(os.sched_getaffinity(0))
    n = min(len(cores), threads or max(1, len(cores) // 2))
    os.sched_setaffinity(0, cores[-n:])
    torch.set_num_threads(n)
    return n


def learn_draft(args: argparse.Namespace) -> int:
    from ..config.loader import load_settings
    from ..logs import setup_logging
    from .learn import LearnInputError, run_cycle

    setup_logging()
    settings = load_settings(args.config, args.overrides).settings  # a ConfigError: cli.main, exit 2
    os.nice(NICENESS)
    threads = _cap_cores(settings.learning.threads)
    options = LearnOptions(**{f.name: getattr(args, f.name) for f in dataclasses.fields(LearnOptions)})
    print(f"learn-draft: niced by {NICENESS}, {threads} thread(s)", file=sys.stderr)
    try:
        result = run_cycle(settings, options)
    except LearnInputError as exc:
        print(f"dynamo-spec learn-draft: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except (OSError, ValueError, KeyError, RuntimeError) as exc:
        print(f"dynamo-spec learn-draft: error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_ERROR
    print(json.dumps(result), flush=True)
    return EXIT_PROMOTED if result["promoted"] else EXIT_REFUSED
