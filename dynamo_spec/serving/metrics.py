"""Every dynamo-spec metric, on one injected registry.

Sources: vLLM's per-step stat-logger records (``SpecDecodingStats``) feed the
speculative counters and the trailing-window gauges; per-request outputs
(``CompletionOutput.spec_decode_metrics``) feed the per-request histograms; the
HTTP middleware feeds the request counters. Definitions follow vLLM's:

- acceptance rate        = accepted draft tokens / drafted tokens
- mean acceptance length = 1 + accepted draft tokens / drafts   (counts the bonus token)
- position i acceptance  = drafts whose token i was accepted / drafts

Beside each metric: the PromQL that derives the same figure from the counters.
"""

from __future__ import annotations

import contextvars
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

logger = logging.getLogger("dynamo_spec.serving.metrics")

# Tenant of the request being served (set by the HTTP middleware).
current_tenant: contextvars.ContextVar[str] = contextvars.ContextVar("dynamo_spec_tenant", default="default")

ACCEPTANCE_LENGTH_BUCKETS = (1.0, 1.25, 1.5, 1.75, 2.0, 2.25, 2.5, 2.75, 3.0, 3.5, 4.0, 4.5, 5.0, 6.0, 7.0, 8.0, 9.0)
ACCEPTANCE_RATE_BUCKETS = tuple(round(0.1 * i, 1) for i in range(11))
LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.2, 0.4, 0.8, 1.6)


@dataclass
class WindowTotals:
    drafts: int = 0
    draft_tokens: int = 0
    accepted: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.draft_tokens if self.draft_tokens else math.nan

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + self.accepted / self.drafts if self.drafts else math.nan

    def position_rates(self) -> list[float]:
        return [n / self.drafts if self.drafts else math.nan for n in self.accepted_per_pos]


class SpecDecodeWindow:
    """Speculative-decoding step records over a trailing time window."""

    def __init__(self, seconds: float, num_positions: int, clock: Callable[[], float] = time.monotonic):
        self.seconds = seconds
        self.num_positions = num_positions
        self._clock = clock
        self._steps: deque[tuple[float, int, int, int, tuple[int, ...]]] = deque()
        self._lock = threading.Lock()

    def add(self, drafts: int, draft_tokens: int, accepted: int, accepted_per_pos: Sequence[int]) -> None:
        with self._lock:
            self._steps.append((self._clock(), drafts, draft_tokens, accepted, tuple(accepted_per_pos)))

    def restart(self) -> None:
        """Forget every step: the window holds only what comes after (a draft swap)."""
        with self._lock:
            self._steps.clear()

    def totals(self) -> WindowTotals:
        horizon = self._clock() - self.seconds
        totals = WindowTotals(accepted_per_pos=[0] * self.num_positions)
        with self._lock:
            while self._steps and self._steps[0][0] < horizon:
                self._steps.popleft()
            for _, drafts, draft_tokens, accepted, per_pos in self._steps:
                totals.drafts += drafts
                totals.draft_tokens += draft_tokens
                totals.accepted += accepted
                for i, n in enumerate(per_pos[: self.num_positions]):
                    totals.accepted_per_pos[i] += n
        return totals


class _WindowCollector(Collector):
    """Computes the window gauges at scrape time, so they are never stale."""

    def __init__(self, window: SpecDecodeWindow, model: str):
        self.window, self.model = window, model

    def collect(self) -> Iterable[GaugeMetricFamily]:
        totals = self.window.totals()
        # PromQL: sum(rate(dynamo_spec_accepted_tokens_total[1m])) / sum(rate(dynamo_spec_draft_tokens_total[1m]))
        rate = GaugeMetricFamily(
            "dynamo_spec_acceptance_rate",
            f"Accepted / drafted tokens over the last {self.window.seconds:g} s (NaN when nothing was drafted).",
            labels=["model"],
        )
        rate.add_metric([self.model], totals.acceptance_rate)
        # PromQL: 1 + sum(rate(dynamo_spec_accepted_tokens_total[1m])) / sum(rate(dynamo_spec_drafts_total[1m]))
        length = GaugeMetricFamily(
            "dynamo_spec_mean_acceptance_length",
            f"1 + accepted tokens / drafts over the last {self.window.seconds:g} s, counting the bonus token "
            "(NaN when nothing was drafted).",
            labels=["model"],
        )
        length.add_metric([self.model], totals.mean_acceptance_length)
        # PromQL: sum by (position) (rate(dynamo_spec_accepted_tokens_per_position_total[1m]))
        #         / on() group_left sum(rate(dynamo_spec_drafts_total[1m]))
        position = GaugeMetricFamily(
            "dynamo_spec_position_acceptance_rate",
            f"Share of drafts whose token at this position was accepted, last {self.window.seconds:g} s.",
            labels=["model", "position"],
        )
        for i, value in enumerate(totals.position_rates()):
            position.add_metric([self.model, str(i)], value)
        # PromQL: sum(increase(dynamo_spec_drafts_total[1m]))
        drafts = GaugeMetricFamily(
            "dynamo_spec_window_drafts",
            f"Drafts verified in the last {self.window.seconds:g} s; 0 means no speculation ran in the window.",
            labels=["model"],
        )
        drafts.add_metric([self.model], totals.drafts)
        return [rate, length, position, drafts]


GUARD_STATES = ("speculating", "fallback", "probing")


class _GuardCollector(Collector):
    """The speculation guard's state and transitions, as last read from the engine
    (``serving.metering.poll`` reads it); nothing before the first reading."""

    def __init__(self, model: str):
        self.model = model
        self.snapshot: dict | None = None

    def collect(self) -> Iterable[GaugeMetricFamily | CounterMetricFamily]:
        snap = self.snapshot
        if snap is None:
            return []
        # PromQL (share of the last hour in fallback): avg_over_time(dynamo_spec_speculation_state{state="fallback"}[1h])
        state = GaugeMetricFamily(
            "dynamo_spec_speculation_state",
            "The speculation guard's state: 1 for the current one (speculating, fallback: k capped at 0, probing).",
            labels=["model", "state"],
        )
        for name in GUARD_STATES:
            state.add_metric([self.model, name], 1.0 if snap["state"] == name else 0.0)
        pinned = GaugeMetricFamily(
            "dynamo_spec_speculation_state_pinned", "1 while an operator has pinned the guard's state.",
            labels=["model"])
        pinned.add_metric([self.model], 1.0 if snap.get("pinned") else 0.0)
        # PromQL: increase(dynamo_spec_speculation_transitions_total{to="fallback"}[1h])
        transitions = CounterMetricFamily(
            "dynamo_spec_speculation_transitions", "Transitions of the speculation guard's state.",
            labels=["model", "from", "to"])
        for a in GUARD_STATES:
            for b in GUARD_STATES:
                if a != b:
                    transitions.add_metric([self.model, a, b], snap["transitions"].get(f"{a}->{b}", 0))
        return [state, pinned, transitions]


class _BudgetCollector(Collector):
    """The confidence draft budget's counts, as last read from the engine
    (``serving.metering.poll`` reads them); nothing before the first reading."""

    def __init__(self, model: str):
        self.model = model
        self.snapshot: dict | None = None

    def collect(self) -> Iterable[CounterMetricFamily]:
        snap = self.snapshot
        if snap is None:
            return []
        out = []
        # PromQL (share of drafted tokens the budget verified):
        #   rate(dynamo_spec_draft_budget_admitted_tokens_total[5m]) / rate(dynamo_spec_draft_budget_offered_tokens_total[5m])
        for key, what in (("offered", "Draft tokens the draft proposed and the other caps left to the budget."),
                          ("admitted", "Draft tokens the budget let through to verification."),
                          ("explored", "Of the admitted, those verified to learn their acceptance rather than for their worth."),
                          ("verified", "Draft tokens the target verified and the budget learnt from (the admitted, "
                                       "less those vLLM dropped: a finished request's, the last steps' before max_tokens).")):
            family = CounterMetricFamily(f"dynamo_spec_draft_budget_{key}_tokens", what, labels=["model"])
            family.add_metric([self.model], snap[key])
            out.append(family)
        return out


class _SourceCollector(Collector):
    """The suffix mix's counts per draft source (suffix: the tree's drafts, draft: the EAGLE-3 draft's),
    as last read from the engine (``serving.metering.poll`` reads them); nothing before."""

    def __init__(self, model: str):
        self.model = model
        self.snapshot: dict | None = None

    def collect(self) -> Iterable[CounterMetricFamily]:
        snap = self.snapshot
        if not snap:
            return []
        # PromQL, acceptance length of the tree's drafts:
        #   1 + rate(dynamo_spec_source_accepted_tokens_total{source="suffix"}[5m])
        #     / rate(dynamo_spec_source_verify_steps_total{source="suffix"}[5m])
        # share of verify steps the tree drafted:
        #   rate(dynamo_spec_source_verify_steps_total{source="suffix"}[5m])
        #     / sum(rate(dynamo_spec_source_verify_steps_total[5m]))
        out = []
        for key, what in (("verify_steps", "Requests' verify steps, by where their drafts came from."),
                          ("draft_tokens", "Draft tokens verified, by source."),
                          ("accepted_tokens", "Draft tokens accepted, by source.")):
            family = CounterMetricFamily(f"dynamo_spec_source_{key}", what, labels=["model", "source"])
            for source, counts in snap.items():
                family.add_metric([self.model, source], counts[key.removeprefix("verify_")])
            out.append(family)
        return out


class TenantLabels:
    """Maps a header value to a bounded set of label values."""

    def __init__(self, max_tenants: int):
        self.max_tenants = max_tenants
        self._seen: set[str] = set()
        self._lock = threading.Lock()

    def label(self, value: str | None) -> str:
        if not value:
            return "default"
        with self._lock:
            if value in self._seen:
                return value
            if len(self._seen) < self.max_tenants:
                self._seen.add(value)
                return value
        return "other"


class DynamoSpecMetrics:
    """The metrics of one served model, registered on `registry`."""

    def __init__(
        self,
        registry: CollectorRegistry,
        *,
        model: str,
        draft_model: str,
        method: str,
        num_speculative_tokens: int,
        version: str,
        window_seconds: float = 60.0,
        max_tenants: int = 20,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.model = model
        self.num_speculative_tokens = num_speculative_tokens
        self.window = SpecDecodeWindow(window_seconds, num_speculative_tokens, clock)
        self.tenants = TenantLabels(max_tenants)
        registry.register(_WindowCollector(self.window, model))
        self._guard = _GuardCollector(model)
        registry.register(self._guard)
        self._budget = _BudgetCollector(model)
        registry.register(self._budget)
        self._sources = _SourceCollector(model)
        registry.register(self._sources)

        info = Gauge(
            "dynamo_spec_info",
            "Served model and speculative set-up (value is always 1).",
            ["model", "draft_model", "method", "num_speculative_tokens", "version"],
            registry=registry,
        )
        info.labels(model, draft_model, method, str(num_speculative_tokens), version).set(1)
        # PromQL (acceptance by served draft): dynamo_spec_mean_acceptance_length * on(model) group_left(version)
        #   dynamo_spec_draft_info
        self.draft_info = Gauge(
            "dynamo_spec_draft_info",
            "The draft being served, by directory and version (value 1; replaced when POST /admin/draft swaps it).",
            ["model", "path", "version"], registry=registry,
        )

        # Cumulative counters: rate() over any window. Mirrors vllm:spec_decode_*_total.
        self.drafts = Counter("dynamo_spec_drafts", "Drafts verified by the target.", ["model"], registry=registry)
        self.draft_tokens = Counter("dynamo_spec_draft_tokens", "Tokens proposed by the draft.", ["model"], registry=registry)
        self.accepted_tokens = Counter(
            "dynamo_spec_accepted_tokens", "Draft tokens accepted by the target.", ["model"], registry=registry
        )
        self.accepted_per_position = Counter(
            "dynamo_spec_accepted_tokens_per_position",
            "Drafts whose token at this position (0-based) was accepted.",
            ["model", "position"],
            registry=registry,
        )
        for counter in (self.drafts, self.draft_tokens, self.accepted_tokens):
            counter.labels(model)
        for i in range(num_speculative_tokens):
            self.accepted_per_position.labels(model, str(i))

        # Per finished request, labelled by tenant.
        # PromQL (median): histogram_quantile(0.5, sum by (le) (rate(..._bucket[5m])))
        def per_request(kind, name: str, documentation: str, **kwargs: Any):
            return kind(name, documentation, ["model", "tenant"], registry=registry, **kwargs)

        self.request_acceptance_length = per_request(
            Histogram, "dynamo_spec_request_acceptance_length",
            "Mean acceptance length of each finished request (1 = nothing accepted, k+1 = everything).",
            buckets=ACCEPTANCE_LENGTH_BUCKETS)
        self.request_acceptance_rate = per_request(
            Histogram, "dynamo_spec_request_acceptance_rate", "Draft acceptance rate of each finished request.",
            buckets=ACCEPTANCE_RATE_BUCKETS)
        self.prompt_tokens = per_request(Counter, "dynamo_spec_request_prompt_tokens", "Prompt tokens of finished requests.")
        self.completion_tokens = per_request(
            Counter, "dynamo_spec_request_completion_tokens", "Generated tokens of finished requests.")
        self.ttft = per_request(Histogram, "dynamo_spec_time_to_first_token_seconds",
                                "Time from request arrival to its first generated token.", buckets=LATENCY_BUCKETS)
        self.itl = per_request(Histogram, "dynamo_spec_inter_token_latency_seconds",
                               "Mean time between generated tokens of each request, after the first.", buckets=ITL_BUCKETS)
        self.e2e = per_request(Histogram, "dynamo_spec_e2e_request_latency_seconds",
                               "Time from request arrival to its last token.", buckets=LATENCY_BUCKETS)
        # Series exist from the start (at 0), so rate() sees the first requests too.
        for family in (self.prompt_tokens, self.completion_tokens, self.request_acceptance_length,
                       self.request_acceptance_rate, self.ttft, self.itl, self.e2e):
            family.labels(model, "default")
        # HTTP. PromQL error ratio: sum(rate(..{status=~"5.."}[5m])) / sum(rate(..[5m]))
        self.http_requests = Counter(
            "dynamo_spec_http_requests", "HTTP requests by route, method and status code.",
            ["route", "method", "status"], registry=registry,
        )
        self.http_in_flight = Gauge(
            "dynamo_spec_http_requests_in_flight", "HTTP requests being served.", ["route"], registry=registry
        )
        # Admission (dynamo_spec.serving.admission). PromQL shed ratio:
        #   sum(rate(dynamo_spec_requests_rejected_total{reason="overloaded"}[5m]))
        #   / sum(rate(dynamo_spec_http_requests_total{route=~"/v1/(chat/)?completions"}[5m]))
        self.rejected = Counter(
            "dynamo_spec_requests_rejected",
            "Requests answered without reaching the engine, by reason: overloaded (429), loading, draining, "
            "dead (503), limit (400), invalid (400: not JSON, nested too deeply, or a field of a type vLLM would crash on), "
            "body_too_large (413).",
            ["reason"], registry=registry,
        )
        for reason in ("overloaded", "loading", "draining", "dead", "limit", "invalid", "body_too_large"):
            self.rejected.labels(reason)
        self.timeouts = Counter(
            "dynamo_spec_request_timeouts", "Requests aborted at limits.request_timeout_seconds.", registry=registry
        )

    # --- per-step records from vLLM's stat loggers ---------------------------

    def record_step(self, drafts: int, draft_tokens: int, accepted: int, accepted_per_pos: Sequence[int]) -> None:
        if not drafts:
            return
        self.drafts.labels(self.model).inc(drafts)
        self.draft_tokens.labels(self.model).inc(draft_tokens)
        self.accepted_tokens.labels(self.model).inc(accepted)
        for i, n in enumerate(accepted_per_pos[: self.num_speculative_tokens]):
            if n:
                self.accepted_per_position.labels(self.model, str(i)).inc(n)
        self.window.add(drafts, draft_tokens, accepted, accepted_per_pos)

    def stat_logger_factory(self):
        """A vLLM StatLoggerFactory feeding this object (pass to AsyncLLM.from_engine_args)."""
        from vllm.v1.metrics.loggers import StatLoggerBase

        metrics = self

        class SpecDecodeStatLogger(StatLoggerBase):
            def __init__(self, vllm_config, engine_index: int = 0):
                self.engine_index = engine_index

            def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0, *args, **kwargs):
                stats = getattr(scheduler_stats, "spec_decoding_stats", None)
                if stats is not None:
                    metrics.record_step(
                        stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens,
                        stats.num_accepted_tokens_per_pos,
                    )

            def log_engine_initialized(self) -> None:
                pass

        return SpecDecodeStatLogger

    def record_draft(self, path: str, version: str) -> None:
        """The draft now served (at start, and after each swap): its info series, and acceptance
        windows that restart so that they hold only its steps. Counters run on."""
        self.draft_info.clear()
        self.draft_info.labels(self.model, path, version).set(1)
        self.window.restart()

    def record_guard(self, snapshot: dict | None) -> None:
        """The speculation guard's latest snapshot (None: no guard)."""
        self._guard.snapshot = snapshot

    def record_sources(self, snapshot: dict | None) -> None:
        """The suffix mix's latest per-source counts (None: the mix off)."""
        self._sources.snapshot = snapshot

    def record_budget(self, snapshot: dict | None) -> None:
        """The confidence draft budget's latest snapshot (None: no budget)."""
        self._budget.snapshot = snapshot

    # --- per request ---------------------------------------------------------

    def observe_request(
        self,
        tenant: str,
        *,
        prompt_tokens: int,
        completion_tokens: int,
        e2e_seconds: float,
        ttft_seconds: float | None,
        itl_seconds: float | None,
        spec: Sequence[dict] = (),
    ) -> None:
        labels = (self.model, tenant)
        self.prompt_tokens.labels(*labels).inc(prompt_tokens)
        self.completion_tokens.labels(*labels).inc(completion_tokens)
        self.e2e.labels(*labels).observe(e2e_seconds)
        if ttft_seconds is not None:
            self.ttft.labels(*labels).observe(ttft_seconds)
        if itl_seconds is not None:
            self.itl.labels(*labels).observe(itl_seconds)
        for s in spec:
            if s.get("num_spec_steps"):
                self.request_acceptance_length.labels(*labels).observe(s["mean_acceptance_length"])
            if s.get("num_draft_tokens"):
                self.request_acceptance_rate.labels(*labels).observe(s["draft_acceptance_rate"])

    # --- HTTP ----------------------------------------------------------------

    def observe_http(self, route: str, method: str, status: int) -> None:
        self.http_requests.labels(route, method, str(status)).inc()

    # --- log line ------------------------------------------------------------

    def log_window(self) -> str | None:
        totals = self.window.totals()
        if not totals.drafts:
            return None
        line = (
            f"Speculative decoding, last {self.window.seconds:g} s: acceptance rate {totals.acceptance_rate:.1%}, "
            f"mean acceptance length {totals.mean_acceptance_length:.2f}, per-position "
            f"{', '.join(f'{r:.2f}' for r in totals.position_rates())}, drafts {totals.drafts}, "
            f"drafted {totals.draft_tokens}, accepted {totals.accepted}"
        )
        logger.info(line)
        return line
