"""Does a k=0 server's cell run slower right after a speculative server's cell than right after
another k=0 server's, and does the speculative server keep using the CPU after its cell? Servers
A, B (k=0) and S (fixed k=2); per round and concurrency: B, A, S, A, with the CPU time of each
server's processes during A's cells."""
import asyncio
import json
from pathlib import Path

import psutil

from dynamo_spec.bench.load import run_cell
from dynamo_spec.bench.prompts import load_sets, split
from dynamo_spec.bench.server import ManagedServer, free_port, serve_command

CFG = Path("configs/smollm2-135m-instruct-eagle3-cpu.yaml")
out = Path("runs/after-whom")  # server logs
out.mkdir(parents=True, exist_ok=True)
_, judge = split(load_sets())
M = "SmolLM2-135M-Instruct"


def server(name, overrides):
    port = free_port()
    return ManagedServer(serve_command(CFG, port, overrides), port, out / f"{name}.log")


def cpu(s):
    procs = [psutil.Process(s.proc.pid), *psutil.Process(s.proc.pid).children(recursive=True)]
    return sum(t.user + t.system for t in (p.cpu_times() for p in procs))


async def rate(s, c, n):
    cell = await run_cell(s.url, M, judge, concurrency=c, requests=n, max_tokens=64, temperature=0.0)
    return round(cell.output_tokens / cell.wall, 1)


async def main():
    k0 = ["--speculative.enabled", "false"]
    spec = ["--speculative.num_speculative_tokens", "2", "--speculative.num_speculative_tokens_per_batch_size", "null"]
    with server("A", k0) as a, server("B", k0) as b, server("S", spec) as s:
        for x in (a, b, s):
            await run_cell(x.url, M, judge, concurrency=2, requests=4, max_tokens=16, temperature=0.0)
        res = {}
        for _ in range(3):
            for c, n in ((4, 16), (16, 64)):
                for before in (b, s):
                    await rate(before, c, n)
                    others = {"B": cpu(b), "S": cpu(s)}
                    r = await rate(a, c, n)
                    name = "B (k=0)" if before is b else "S (k=2)"
                    res.setdefault(f"c={c} A after {name}", []).append(r)
                    for key, x in (("B", b), ("S", s)):
                        res.setdefault(f"c={c} CPU s of {key} during A's cell after {name}", []).append(
                            round(cpu(x) - others[key], 2))
            print(json.dumps(res), flush=True)


asyncio.run(main())
