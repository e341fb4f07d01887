"""`dynamo-spec bench --url`: one running server measured per concurrency (one setting, no schedule)."""

from __future__ import annotations

import asyncio
import datetime
import json

import requests
from tqdm import tqdm

from dynamo_spec.bench.host_report import command_line
from dynamo_spec.bench.measure import measure
from dynamo_spec.bench.options import BenchOptions
from dynamo_spec.bench.prompts import load_sets
from dynamo_spec.bench.render import url_table


def run_url(options: BenchOptions) -> int:
    items = [item for items in load_sets(list(options.prompts)).values() for item in items]
    model = requests.get(options.url.rstrip("/") + "/v1/models", timeout=30).json()["data"][0]["id"]
    total = options.rounds * sum(options.cell_requests(c) for c in options.concurrencies)
    cells = {}
    with tqdm(total=total, desc=options.url, unit="req") as bar:
        for c in options.concurrencies:
            cells[str(c)] = asyncio.run(measure(options.url, model, items, c, options, bar))
    result = {"url": options.url, "model": model, "cells": cells, "command": command_line(),
              "started": datetime.datetime.now().isoformat(timespec="seconds")}
    (options.out / "bench-url.json").write_text(json.dumps(result, indent=2))
    print(url_table(cells))
    return 0
