"""The bench's options, typed and checked, built once from the parsed command line (bench.command)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from dynamo_spec.bench.verdict import Targets


@dataclass(frozen=True)
class BenchOptions:
    """One `dynamo-spec bench` run: what to start (`config`) or to measure (`url`), the cells, the output."""

    config: Path | None
    url: str | None
    ks: tuple[int, ...]  # always with 0, the reference of every speed-up
    concurrencies: tuple[int, ...]
    prompts: tuple[Path, ...]  # empty: the shipped sets
    requests: int
    per_client: int
    max_tokens: int
    temperature: float
    margin: float
    out: Path
    together: int | None  # None: as many as free memory holds on CPU, 0 on GPU
    rounds: int
    plots: bool
    targets: Targets
    overrides: tuple[str, ...] = ()  # --section.field VALUE for every server

    def cell_requests(self, c: int) -> int:
        """Requests of one cell at concurrency `c`: --requests, and --per-client for each client."""
        return max(self.requests, self.per_client * c)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> BenchOptions:
        if bool(args.config) == bool(args.url):
            raise SystemExit("error: give --config FILE (start servers) or --url URL (a running server)")
        if args.rounds < 1:
            raise SystemExit(f"error: --rounds: expected 1 or more, got {args.rounds}")
        if args.together is not None and args.together < 0:
            raise SystemExit(f"error: --together: expected 0 or more, got {args.together}")
        if args.target_floor_from < 2:
            raise SystemExit(f"error: --target-floor-from: expected 2 or more, got {args.target_floor_from}")
        ks = ints(args.k, "k")
        return cls(
            config=Path(args.config) if args.config else None, url=args.url,
            ks=tuple(ks if ks[0] == 0 else [0, *ks]), concurrencies=tuple(ints(args.concurrency, "concurrency")),
            prompts=tuple(args.prompts or ()), requests=args.requests, per_client=args.per_client,
            max_tokens=args.max_tokens, temperature=args.temperature, margin=args.margin, out=args.out,
            together=args.together, rounds=args.rounds, plots=not args.no_plots,
            targets=Targets(speedup=args.target_speedup or None, floor=args.target_floor or None,
                            floor_from=args.target_floor_from),
            overrides=tuple(getattr(args, "overrides", None) or ()))


@dataclass(frozen=True)
class HostCheckOptions:
    """`dynamo-spec bench --host-check`: the work each core repeats, for how long, and where the figures go."""

    workload: str = "gemm"
    seconds: float = 240
    out: Path = Path("runs/bench")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> HostCheckOptions:
        if args.config or args.url:
            raise SystemExit("error: --host-check measures the host alone: no --config or --url")
        seconds = cls.seconds if args.seconds is None else args.seconds
        if seconds <= 0:
            raise SystemExit(f"error: --seconds: expected more than 0, got {seconds}")
        return cls(workload=args.workload or cls.workload, seconds=seconds, out=args.out)


def ints(text: str, name: str) -> list[int]:
    """Sorted distinct integers of a comma-separated option (--k, --concurrency)."""
    try:
        values = sorted({int(v) for v in text.split(",") if v.strip()})
    except ValueError:
        raise SystemExit(f"error: --{name}: expected comma-separated integers, got '{text}'") from None
    if not values or values[0] < 0 or (name == "concurrency" and values[0] < 1):
        raise SystemExit(f"error: --{name}: out of range: '{text}'")
    return values
