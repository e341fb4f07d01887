"""Does a server that has already served the grid's concurrencies serve more than a fresh one?
Two k=0 servers, A and B, started alike; A alone serves one cell at each concurrency of the
default grid (2, 4, 8, 16, 32 clients, judge prompts, not recorded); then A and B take turns at
16 and 32 clients for three rounds, B first."""
import asyncio
import json
from pathlib import Path

from dynamo_spec.bench.load import run_cell
from dynamo_spec.bench.prompts import load_sets, split
from dynamo_spec.bench.server import ManagedServer, free_port, serve_command

CFG = Path("configs/smollm2-135m-instruct-eagle3-cpu.yaml")
out = Path("runs/fresh-server")  # server logs
out.mkdir(parents=True, exist_ok=True)
_, judge = split(load_sets())
M = "SmolLM2-135M-Instruct"


def server(name, overrides):
    port = free_port()
    return ManagedServer(serve_command(CFG, port, overrides), port, out / f"{name}.log")


async def rate(s, c, n):
    cell = await run_cell(s.url, M, judge, concurrency=c, requests=n, max_tokens=64, temperature=0.0)
    return round(cell.output_tokens / cell.wall, 1)


async def main():
    k0 = ["--speculative.enabled", "false"]
    with server("A", k0) as a, server("B", k0) as b:
        for x in (a, b):  # the bench's warm-up
            await run_cell(x.url, M, judge, concurrency=2, requests=4, max_tokens=16, temperature=0.0)
        for c in (1, 2, 4, 8, 16, 32):  # A only
            await rate(a, c, 4 * c)
        res = {}
        for _ in range(3):
            for c in (16, 32):
                for name, x in (("B (fresh)", b), ("A (served the grid)", a)):
                    res.setdefault(f"c={c} {name}", []).append(await rate(x, c, 4 * c))
            print(json.dumps(res), flush=True)


asyncio.run(main())
