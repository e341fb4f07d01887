"""The `dynamo-spec` command line (also `python -m dynamo_spec`)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from dynamo_spec.config.loader import ConfigError, LoadedSettings, effective_config, load_settings
from dynamo_spec.logs import setup_logging

if TYPE_CHECKING:
    from dynamo_spec.config.settings import Settings
    from dynamo_spec.engine.paths import EnginePath

EXIT_CONFIG = 2  # bad configuration or a failed preflight

OVERRIDES_HELP = (
    "Any setting can follow as an override: --section.field VALUE, e.g. "
    "--speculative.num_speculative_tokens 3 --server.port 9000 (highest priority, then "
    "DYNAMO_SPEC_SECTION__FIELD environment variables, then the YAML file)."
)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if not getattr(args, "accepts_overrides", False) and extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.overrides = extra
    try:
        return args.func(args) or 0
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_CONFIG


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dynamo-spec", description="Serve an LLM with speculative decoding on vLLM.")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = _with_config(sub.add_parser("serve", help="check the config, load the engine and serve the OpenAI API",
                                        epilog=OVERRIDES_HELP))
    serve.add_argument("--skip-preflight", action="store_true", help="start even if preflight finds errors")
    serve.set_defaults(func=cmd_serve)

    config = _with_config(sub.add_parser("config", help="print the effective config and where each value came from",
                                         epilog=OVERRIDES_HELP))
    config.add_argument("--json", action="store_true", help="machine-readable output")
    config.set_defaults(func=cmd_config)

    check = _with_config(sub.add_parser("check", help="preflight: catch a wrong target/draft pairing before loading",
                                        epilog=OVERRIDES_HELP))
    check.set_defaults(func=cmd_check)

    prepare = sub.add_parser("prepare-default", help="convert the embedded CPU default model (SmolLM2-135M-Instruct)")
    prepare.add_argument("--cache-dir", default=".cache/models", help="where converted models are kept (default: %(default)s)")
    prepare.set_defaults(func=cmd_prepare_default)

    from dynamo_spec.bench import command as bench
    from dynamo_spec.learning import command as learning_cli
    from dynamo_spec.learning import swap_draft
    from dynamo_spec.training import commands as training_cli
    from dynamo_spec.training import sampling_eval, verify

    bench.register(sub)
    learning_cli.register(sub)
    swap_draft.register(sub)
    training_cli.register(sub)
    verify.register(sub)
    sampling_eval.register(sub)
    return parser


def _with_config(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--config", "-c", required=True, help="YAML config file (see configs/)")
    parser.set_defaults(accepts_overrides=True)
    return parser


def _load(args: argparse.Namespace) -> LoadedSettings:
    return load_settings(args.config, args.overrides)


def cmd_config(args: argparse.Namespace) -> int:
    from dynamo_spec.config import schedule
    from dynamo_spec.engine.host import detect_host, resolve_dtype

    loaded = _load(args)
    rows = effective_config(loaded)
    # Values resolved at start-up (field -> (what vLLM gets, why)), shown beside what was written.
    dtype, why = resolve_dtype(loaded.settings.engine.dtype, detect_host())
    resolved = {"engine.dtype": (dtype, why)} if why else {}
    applied, why_schedule = schedule.for_engine(loaded.settings, dtype)
    if why_schedule:
        resolved[schedule.FIELD] = (schedule.as_lists(applied), why_schedule)
    spec = loaded.settings.speculative
    if spec.enabled and spec.suffix.enabled:
        from dynamo_spec.vllm_patches.suffix_mix import memory_bound

        per_tenant = spec.suffix.scope == "tenant" and loaded.settings.metrics.tenant_header
        trees = loaded.settings.metrics.max_tenants + 1 if per_tenant else 1
        resolved["speculative.suffix.max_cached_requests"] = (
            spec.suffix.max_cached_requests,
            memory_bound(spec.suffix.max_cached_requests, trees, loaded.settings.engine.max_model_len or 2048))
    path, path_lines = _engine_path(loaded.settings)
    if args.json:
        out = []
        for f, v, s in rows:
            out.append({"field": f, "value": v, "source": s})
            if f in resolved:
                out[-1].update(resolved=resolved[f][0], why=resolved[f][1])
        value = {"v2_runner": path.v2_runner, "async_scheduling": path.async_scheduling} if path else None
        out.append({"field": "engine path", "value": value, "source": path.source if path else None,
                    "notes": path_lines})
        print(json.dumps(out, indent=2, default=str))
        return 0
    rows = [(f, f"{_show(v)} -> {_show(resolved[f][0])}", f"{s} ({resolved[f][1]})") if f in resolved else (f, v, s)
            for f, v, s in rows]
    width = max(len(f) for f, _, _ in rows)
    vwidth = min(48, max(len(_show(v)) for _, v, _ in rows))
    for field, value, source in rows:
        print(f"{field:<{width}}  {_show(value):<{vwidth}}  {source}")
    print(f"engine path: {path or 'none: vLLM would refuse to start'}")
    for line in path_lines:
        print(f"  {line}")
    return 0


def _engine_path(settings: Settings) -> tuple[EnginePath | None, list[str]]:
    """The model runner and scheduling vLLM will pick here, and what the features declared in
    ``engine/features.py`` make of it (the lines preflight and the server refuse or log); None and
    the reason where vLLM would refuse to start."""
    from dynamo_spec.engine import features, paths
    from dynamo_spec.engine.host import on_cpu
    from dynamo_spec.vllm_patches import unapplied

    cpu = on_cpu()
    try:
        path = paths.predict(settings, on_cpu=cpu, triton=paths.has_triton(cpu))
    except paths.PredictionError as exc:
        return None, [f"error: {exc}"]
    problems = features.refusals(settings, path, unapplied(cpu))
    return path, [str(p) for p in problems] + features.inactive(settings, path, unapplied(cpu))


def _show(value: object) -> str:
    return json.dumps(value) if isinstance(value, (dict, list)) else str(value)


def cmd_check(args: argparse.Namespace) -> int:
    from dynamo_spec.config.preflight import run_preflight

    loaded = _load(args)
    for note in loaded.notes:
        print(note)
    problems = run_preflight(loaded.settings)
    for problem in problems:
        print(problem, file=sys.stderr if problem.level == "error" else sys.stdout)
    errors = sum(p.level == "error" for p in problems)
    if errors:
        print(f"preflight: {errors} error(s) in {args.config}", file=sys.stderr)
        return EXIT_CONFIG
    print(f"preflight: ok ({args.config})")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from dynamo_spec.config.preflight import run_preflight
    from dynamo_spec.engine.process_env import checkout_runtime_dirs
    from dynamo_spec.serving.server import run

    checkout_runtime_dirs(os.environ)  # the launch script's compile cache, also when started by hand

    loaded = _load(args)
    settings = loaded.settings
    setup_logging(settings.server.log_level)
    log = logging.getLogger("dynamo_spec")
    for note in loaded.notes:
        log.info("%s", note)
    problems = run_preflight(settings)
    for problem in problems:
        if problem.level == "warning":
            log.warning("\n%s\n!!! %s\n%s", "!" * 78, problem.message, "!" * 78)
        else:
            log.error("preflight: %s", problem.message)
    if any(p.level == "error" for p in problems) and not args.skip_preflight:
        log.error("preflight failed; fix the config (or pass --skip-preflight to start anyway)")
        return EXIT_CONFIG
    from dynamo_spec.engine.process_exit import exit_now

    exit_now(run(settings))  # the engine and its processes are gone: skip the interpreter's teardown


def cmd_prepare_default(args: argparse.Namespace) -> int:
    from pathlib import Path

    from dynamo_spec.default_model import prepare_default_model

    setup_logging()
    print(prepare_default_model(Path(args.cache_dir)))
    return 0
