"""The two phases of a run, and the two ways of running them: side by side, or one server at a time.

First phase (`Compared`): k=0, k=1.., k=0 in a speculative engine (speculation on, schedule
k=0 at every batch size: what the schedule's k=0 ranges serve, and the k=0 a schedule's k > 0
must beat), each on the derive and the judge prompts. Then the schedule derived from them
(`Derived`). Second phase (`Judged`): that schedule, the config's own schedule where it has
one for the engine's dtype (as the config serves it; not when the derived one is the same),
and k=0 again (the run-to-run noise), on the judge prompts.

On CPU the servers run side by side: a k=0 server up the whole run, the others in groups
beside it taking turns cell by cell, each speed-up against the k=0 cell measured alongside
(`side_by_side`). With --together 0 (GPU) one server at a time, k=0 first and last
(`one_at_a_time`).
"""

from __future__ import annotations

import contextlib
import itertools
import json
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from tqdm import tqdm

from dynamo_spec.bench.choose import choose_k, schedule_from_choice
from dynamo_spec.bench.managed_server import ManagedServer, server_rss, servers_that_fit
from dynamo_spec.bench.prompts import load_sets, split
from dynamo_spec.bench.result import Cells, Column, Compared, Derived, Judged, SideBySide, assemble, columns_json, write
from dynamo_spec.bench.runner import Plan, Prompts, Runner, run_header
from dynamo_spec.bench.schedule_config import FILE as SCHEDULE_CONFIG
from dynamo_spec.bench.schedule_config import write_schedule_config
from dynamo_spec.bench.speedups import BASELINE, BUDGET, CONFIGURED, REPEAT, SCHEDULE, SPEC_K0, verify_cost
from dynamo_spec.config import schedule as schedules
from dynamo_spec.config.settings import MAX_DRAFT_TOKEN_COST

if TYPE_CHECKING:
    from dynamo_spec.bench.options import BenchOptions

Measured = tuple[Compared, Derived, Judged]
Group = list[tuple[str, list[str]]]  # (column name, the server's overrides)
K0 = ["--speculative.enabled", "false"]


def overrides_for(k: int, schedule: list[list[int]] | None = None) -> list[str]:
    """A server's overrides: no speculation at k=0, else k tokens and `schedule` (None: a fixed k)."""
    if k == 0:
        return list(K0)
    return ["--speculative.enabled", "true", "--" + schedules.K_FIELD, str(k),
            "--" + schedules.FIELD, json.dumps(schedule) if schedule else "null"]


def schedule_overrides(schedule: list[list[int]]) -> list[str]:
    top = schedules.top_k(schedule)
    return overrides_for(top, schedule) if top else overrides_for(0)


def first_phase(ks: tuple[int, ...], max_batch: int) -> Group:
    """The first phase's columns besides k=0: each fixed k, then the speculative engine at k=0."""
    group = [(f"k={k}", overrides_for(k)) for k in ks if k]
    if max(ks) > 0:
        group.append((SPEC_K0, overrides_for(max(ks), [[1, max_batch, 0]])))  # speculation on, never a draft
    return group


def capped_first_phase(ks: tuple[int, ...], max_batch: int) -> tuple[Group, dict[str, int]]:
    """The first phase's columns besides k=0 on one server (servers one at a time): the largest k,
    as a batch-size schedule of that k everywhere, serves each smaller k and the speculative engine
    at k=0 through each request's cap (``vllm_xargs.max_draft_tokens``: draft_admission lowers the
    step's k to the largest cap in the batch, and a step without drafts takes the k=0 path), one
    start instead of one per column. A schedule and not a fixed k: vLLM pads a fixed-k engine's
    first decode step of a fully cached prompt with k drafts whatever the cap. The columns and
    each one's cap."""
    top = max(ks)
    shared = overrides_for(top, [[1, max_batch, top]])
    group = [(f"k={k}", shared) for k in ks if k] + [(SPEC_K0, shared)]
    return group, {**{f"k={k}": k for k in ks if 0 < k < top}, SPEC_K0: 0}


def derive(run: Runner, columns: Mapping[str, Column]) -> Derived:
    """The schedule from the first phase's columns, and the confidence budget's cost of a verified
    draft token, written as a config beside the results."""
    options = run.options
    as_json = columns_json(columns)
    choice = choose_k(as_json, options.ks, options.concurrencies, options.margin)
    schedule = schedule_from_choice(choice, run.plan.max_batch)
    costs = draft_token_cost(as_json, options.concurrencies)
    config_file = write_schedule_config(options.config, schedule, options.out / SCHEDULE_CONFIG, run.plan.dtype,
                                        draft_token_cost=costs)
    return Derived(choice=choice, schedule=schedule, margin=options.margin, config_file=str(config_file),
                   draft_token_cost=costs,
                   budget_schedule=budget_schedule(run.plan.configured or schedule) if costs else None)


def draft_token_cost(columns: Mapping[str, Any], concurrencies: Sequence[int]) -> list[list[float]] | None:
    """[[concurrency, cost], ...]: `speedups.verify_cost` on the derive prompts, never falling as the
    batch grows (a verified token does not get cheaper in a fuller step: a dip is noise), capped at
    the setting's bound (k=1 many times slower than k=0 means: never verify)."""
    points, top = [], 0.0
    for c in concurrencies:
        cost = verify_cost(columns, "derive", c)
        if cost is not None:
            top = min(MAX_DRAFT_TOKEN_COST, max(top, cost))
            points.append([c, round(top, 3)])
    return points or None


def budget_schedule(schedule: list[list[int]]) -> list[list[int]]:
    """The schedule the confidence budget's column drafts under: one token more than `schedule` (the
    config's own where it has one, else the derived one) wherever it drafts (the budget trims what
    does not pay), k=0 ranges kept. Not the derived schedule alone: where it measured k=0 as best
    (a noisy cell or a weak draft at that load) the budget would have nothing to choose from."""
    return [[lo, hi, k + 1 if k else 0] for lo, hi, k in schedule]


def budget_overrides(derived: Derived) -> list[str]:
    return [*schedule_overrides(derived.budget_schedule), "--speculative.draft_budget.enabled", "true",
            "--speculative.draft_budget.draft_token_cost", json.dumps(derived.draft_token_cost)]


def second_phase(run: Runner, derived: Derived) -> Group:
    """The second phase's columns but the repeat: the derived schedule, the confidence budget (where
    its cost was measured and it drafts somewhere), then the config's own (as it serves, no override)
    where it has one that the derived one is not."""
    group = [(SCHEDULE, schedule_overrides(derived.schedule))]
    if derived.budget_schedule and schedules.top_k(derived.budget_schedule):
        group.append((BUDGET, budget_overrides(derived)))
    if run.plan.configured is not None and run.plan.configured != derived.schedule:
        group.append((CONFIGURED, []))
    return group


# --- one server at a time ----------------------------------------------------------


async def one_at_a_time(run: Runner) -> Measured:
    """One server at a time: k=0, the others (the speculative columns on one server where caps
    stand in for its k: `Plan.capped`), the schedule, the config's own, k=0 again (the noise)."""
    ks, caps = run.options.ks, {}
    if run.plan.capped and max(ks) > 0:
        others, caps = capped_first_phase(ks, run.plan.max_batch)
    else:
        others = first_phase(ks, run.plan.max_batch)
    first = [(BASELINE, overrides_for(0)), *others]
    run.grow(run.requests(len(first)) + run.requests(2, splits=1))
    compared = Compared(await _each_alone(run, first, run.splits, {}, caps))
    derived = derive(run, compared.columns)
    second = second_phase(run, derived)
    run.grow(run.requests(len(second) - 1, splits=1))
    columns = await _each_alone(run, [*second, (REPEAT, overrides_for(0))], run.judge_split, compared.columns)
    return compared, derived, Judged(columns)


async def _each_alone(run: Runner, group: Group, splits: dict[str, Prompts], done: Mapping[str, Column],
                      caps: Mapping[str, int] | None = None) -> dict[str, Column]:
    """`group`'s servers one after another, each alone (columns next to each other with the same
    overrides: one server, taking turns, each column's requests capped as `caps` says); bench.json
    saved after each server (with `done`)."""
    caps = caps or {}
    columns: dict[str, Column] = {}
    for overrides, shared in itertools.groupby(group, key=lambda column: column[1]):
        names = [name for name, _ in shared]
        run.bar.set_description(f"start {' + '.join(names)}")
        with run.server(names[0], overrides) as server:
            await run.warm_up(server)
            cells = await run.take_turns([(name, server) for name in names], splits, caps=caps)
        for name in names:
            columns[name] = Column(overrides, server.ready_after, cells[name], max_draft_tokens=caps.get(name))
        run.checkpoint({**done, **columns})
    return columns


# --- side by side ------------------------------------------------------------------


async def side_by_side(run: Runner, together: int | None) -> Measured | None:
    """A k=0 server up the whole run; the other columns in groups of `together` servers beside
    it, taking turns cell by cell in a fixed order, each group's speed-ups against the k=0 cells
    measured with it; the schedule last, beside the k=0 server and a second one (the noise).
    None, having measured nothing, if `together` is None and free memory holds no second server.
    """
    others = first_phase(run.options.ks, run.plan.max_batch)
    with run.server(BASELINE, overrides_for(0)) as reference:
        await run.warm_up(reference)
        rss = server_rss(reference)
        together = together or servers_that_fit(rss, len(others))
        if not together:
            tqdm.write(f"bench: free memory holds no second server of {rss / 2**30:.1f} GiB: one server at a time")
            return None
        groups = [others[i:i + together] for i in range(0, len(others), together)]
        layout = SideBySide(together=together, groups=[[n for n, _ in g] for g in groups],
                            reference_rss_gib=round(rss / 2**30, 2))
        configured = run.plan.configured
        tqdm.write(f"bench: a k=0 server ({rss / 2**30:.1f} GiB) up the whole run; beside it "
                   f"{' then '.join('+'.join(n for n, _ in g) for g in groups)}, then the schedule"
                   + (f" and the config's own {configured} (if not the same)" if configured else ""))
        run.grow(run.requests(len(others) + len(groups)) + run.requests(3, splits=1))
        columns: dict[str, Column] = {}
        for g, group in enumerate(groups):
            with contextlib.ExitStack() as stack:
                servers = await run.start(stack, group)
                columns |= await _beside(run, reference, BASELINE, servers, group, run.splits, columns, layout,
                                         baseline=reference if g == 0 else None)
        compared = Compared(columns, layout)
        derived = derive(run, compared.columns)
        judged = await _judge_beside(run, reference, rss, derived, compared)
    return compared, derived, judged


async def _judge_beside(run: Runner, reference: ManagedServer, rss: int, derived: Derived,
                        compared: Compared) -> Judged:
    """The second phase beside the k=0 server: its cells just before the schedule's are the reference.

    Beside the derived schedule: the config's own, as it serves (no override), and the repeat, a
    second k=0 server, so that every cell follows another server's (a server's first cell after
    another's runs a few per cent slower on a 2-core VM), as far as free memory holds them (the
    derived schedule's server always starts)."""
    second = second_phase(run, derived)
    extras = [*second[1:], (REPEAT, overrides_for(0))]
    room = max(0, servers_that_fit(rss, len(extras) + 1) - 1)
    group = [second[0], *extras[:room]]
    if len(second) > 1 and room == 0:
        tqdm.write(f"bench: free memory holds no server for {CONFIGURED}: not measured")
    if any(name == CONFIGURED for name, _ in group):
        run.grow(run.requests(1, splits=1))
    with contextlib.ExitStack() as stack:
        servers = await run.start(stack, group)
        if REPEAT not in servers:  # no room for it: the k=0 server again, before its own next cell
            group.append((REPEAT, overrides_for(0)))
            servers[REPEAT] = reference
        columns = await _beside(run, reference, "before", servers, group, run.judge_split, compared.columns,
                                compared.side_by_side)
    repeat = "k=0 server" if servers[REPEAT] is reference else "second k=0 server"
    return Judged(columns, repeat=repeat, final=[name for name, _ in group])


async def _beside(run: Runner, reference: ManagedServer, reference_name: str, servers: dict[str, ManagedServer],
                  group: Group, splits: dict[str, Prompts], done: Mapping[str, Column], layout: SideBySide | None,
                  baseline: ManagedServer | None = None) -> dict[str, Column]:
    """`group`'s servers taking turns with the k=0 `reference` (its turn first, as `reference_name`):
    their columns, bench.json saved (with `done`) as the cells come."""
    def as_columns(cells: dict[str, Cells]) -> dict[str, Column]:
        """The k=0 cells taken alongside are each column's reference; with `baseline` they are the k=0 column too."""
        ref = cells[reference_name]
        out = {BASELINE: Column(overrides_for(0), baseline.ready_after, ref)} if baseline is not None else {}
        for name, overrides in group:
            out[name] = Column(overrides, servers[name].ready_after, cells[name], reference=ref)
        return out

    turns = [(reference_name, reference), *servers.items()]
    cells = await run.take_turns(turns, splits, on_cells=lambda cells: run.checkpoint({**done, **as_columns(cells)},
                                                                                       layout))
    return as_columns(cells)


# --- a run from its config ---------------------------------------------------------


def caps_stand_in(settings: Any, on_cpu: bool) -> bool:
    """Whether per-request caps can serve the smaller k's columns on one server: the engine honours
    them here (serving.draft_caps), and no engine-wide cap would carry one column's acceptance
    into the next (the speculation guard, the confidence budget: then a server per column)."""
    from dynamo_spec.serving.draft_caps import unavailable

    spec = settings.speculative
    return not spec.guard.enabled and not spec.draft_budget.enabled and unavailable(on_cpu) is None


async def run_config(options: BenchOptions) -> int:
    """Servers started from --config: both phases, then bench.json, bench.md and the plots."""
    from dynamo_spec.config.loader import load_settings
    from dynamo_spec.config.preflight import effective_max_num_seqs
    from dynamo_spec.engine.host import detect_host, resolve_dtype

    prompt_sets = load_sets(list(options.prompts))
    settings = load_settings(options.config, list(options.overrides)).settings
    host = detect_host()
    dtype = resolve_dtype(settings.engine.dtype, host)[0]
    configured = schedules.for_engine(settings, dtype)[0] if settings.speculative.enabled else None
    derive, judge = split(prompt_sets)
    plan = Plan(model=settings.served_model_name, max_batch=effective_max_num_seqs(settings, host.on_cpu),
                dtype=dtype, configured=schedules.as_lists(configured), derive=derive, judge=judge,
                capped=caps_stand_in(settings, host.on_cpu))
    header = run_header(options, plan, settings, prompt_sets)
    # --together as given; else as many as memory holds on CPU, and one at a time on GPU,
    # where one server takes the device's memory
    together = options.together if options.together is not None else None if host.on_cpu else 0
    runner = Runner(options, plan, header)
    try:
        measured = None if together == 0 else await side_by_side(runner, together)
        measured = measured or await one_at_a_time(runner)
    finally:
        runner.bar.close()
    write(assemble(header, *measured, options), options.out, options.plots)
    return 0
