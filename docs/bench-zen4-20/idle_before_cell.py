"""Does a server's cell run slower the longer the server sat idle before it, and does a short
unrecorded warm-up right before the cell remove that? Two k=0 servers A and B."""
import asyncio
import json
from pathlib import Path

from dynamo_spec.bench.load import run_cell
from dynamo_spec.bench.prompts import load_sets, split
from dynamo_spec.bench.server import ManagedServer, free_port, serve_command

CFG = Path("configs/smollm2-135m-instruct-eagle3-cpu.yaml")
out = Path("runs/resident")  # server logs
out.mkdir(parents=True, exist_ok=True)
_, judge = split(load_sets())
M = "SmolLM2-135M-Instruct"

def server(name):
    port = free_port()
    return ManagedServer(serve_command(CFG, port, ["--speculative.enabled", "false"]), port, out / f"{name}.log")

async def rate(s, c, n):
    cell = await run_cell(s.url, M, judge, concurrency=c, requests=n, max_tokens=64, temperature=0.0)
    return round(cell.output_tokens / cell.wall, 1)

async def main():
    with server("A") as a, server("B") as b:
        for s in (a, b):
            await rate(s, 2, 4)
        res = {}
        for _ in range(2):
            for c, n in ((4, 16), (16, 64)):
                await rate(b, c, n)                       # B busy, A idle ~ one cell
                res.setdefault(f"c={c} A right after B", []).append(await rate(a, c, n))
                await asyncio.sleep(60)                   # everything idle
                res.setdefault(f"c={c} A after 60 s idle", []).append(await rate(a, c, n))
                await asyncio.sleep(60)
                await run_cell(a.url, M, judge, concurrency=c, requests=c, max_tokens=8, temperature=0.0)  # warm-up
                res.setdefault(f"c={c} A after 60 s idle + warm-up ({c} x 8 tokens)", []).append(await rate(a, c, n))
            print(json.dumps(res), flush=True)

asyncio.run(main())
