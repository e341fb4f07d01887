"""Measuring one cell on one server: its requests, and how far vLLM's spec-decode counters grew."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import requests
from prometheus_client.parser import text_string_to_metric_families
from tqdm import tqdm

from dynamo_spec.bench.load import CellResult, run_cell
from dynamo_spec.bench.options import BenchOptions
from dynamo_spec.bench.summary import counter_delta, summarize_rounds
from dynamo_spec.serving.metering import POLL_SECONDS as BUDGET_POLL_SECONDS

SPEC_COUNTERS = {"vllm:spec_decode_num_drafts": "drafts", "vllm:spec_decode_num_draft_tokens": "draft_tokens",
                 "vllm:spec_decode_num_accepted_tokens": "accepted",
                 # the confidence budget's (dynamo_spec.serving.budget_monitor), where it is on
                 "dynamo_spec_draft_budget_offered_tokens": "budget_offered",
                 "dynamo_spec_draft_budget_admitted_tokens": "budget_admitted"}


def read_spec_counters(url: str) -> dict[str, float]:
    """vLLM's spec-decode counters from /metrics, summed over engines: drafts, draft_tokens, accepted, pos:i."""
    out: dict[str, float] = {}
    text = requests.get(url.rstrip("/") + "/metrics", timeout=30).text
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if not s.name.endswith("_total"):
                continue
            base = s.name[: -len("_total")]
            if base in SPEC_COUNTERS:
                out[SPEC_COUNTERS[base]] = out.get(SPEC_COUNTERS[base], 0.0) + s.value
            elif base == "vllm:spec_decode_num_accepted_tokens_per_pos":
                key = f"pos:{s.labels['position']}"
                out[key] = out.get(key, 0.0) + s.value
    return out


async def measure_round(url: str, model: str, items: Sequence[dict[str, Any]], c: int, options: BenchOptions,
                        bar: tqdm, max_draft_tokens: int | None = None) -> tuple[CellResult, dict[str, float]]:
    """One round of a cell: its requests (each capped at `max_draft_tokens` draft tokens where set)
    and how far the server's spec-decode counters grew."""
    before = read_spec_counters(url)
    cell = await run_cell(url, model, items, concurrency=c, requests=options.cell_requests(c),
                          max_tokens=options.max_tokens, temperature=options.temperature, on_done=lambda: bar.update(1),
                          max_draft_tokens=max_draft_tokens)
    if "budget_offered" in before:  # the server polls the budget's counts from its engine: wait for the last step's
        await asyncio.sleep(2 * BUDGET_POLL_SECONDS)
    return cell, counter_delta(before, read_spec_counters(url))


async def measure(url: str, model: str, items: Sequence[dict[str, Any]], c: int, options: BenchOptions,
                  bar: tqdm) -> dict[str, Any]:
    """A cell in --rounds rounds, one after another, summarized."""
    return summarize_rounds([await measure_round(url, model, items, c, options, bar) for _ in range(options.rounds)])
