"""Does a server serve less while other (idle) servers are resident? k=0 servers A and B take
turns (each cell follows the other's, as in the bench); measured alone, with 4 idle speculative
servers resident (the bench's phase 1 has 4-5 beside the k=0 server), and alone again."""
import asyncio
import contextlib
import json
from pathlib import Path

from dynamo_spec.bench.load import run_cell
from dynamo_spec.bench.prompts import load_sets, split
from dynamo_spec.bench.server import ManagedServer, free_port, serve_command

CFG = Path("configs/smollm2-135m-instruct-eagle3-cpu.yaml")
out = Path("runs/resident")  # server logs
out.mkdir(parents=True, exist_ok=True)
_, judge = split(load_sets())

def server(name, overrides):
    port = free_port()
    return ManagedServer(serve_command(CFG, port, overrides), port, out / f"{name}.log")

async def measure(servers, label, rounds=2):
    res = {}
    for c, n in ((4, 16), (16, 64)):
        for _ in range(rounds):
            for name, s in servers:
                cell = await run_cell(s.url, "SmolLM2-135M-Instruct", judge, concurrency=c, requests=n,
                                      max_tokens=64, temperature=0.0)
                res.setdefault(f"{name} c={c}", []).append(round(cell.output_tokens / cell.wall, 1))
    print(label, json.dumps(res), flush=True)

async def main():
    k0 = ["--speculative.enabled", "false"]
    with server("A", k0) as a, server("B", k0) as b:
        for s in (a, b):
            await run_cell(s.url, "SmolLM2-135M-Instruct", judge, concurrency=2, requests=4, max_tokens=16, temperature=0.0)
        pair = [("A", a), ("B", b)]
        await measure(pair, "alone")
        with contextlib.ExitStack() as stack:
            for k in (1, 2, 3, 4):
                s = stack.enter_context(server(f"idle{k}", ["--speculative.num_speculative_tokens", str(k),
                                                            "--speculative.num_speculative_tokens_per_batch_size", "null"]))
                await run_cell(s.url, "SmolLM2-135M-Instruct", judge, concurrency=2, requests=4, max_tokens=16, temperature=0.0)
            await measure(pair, "with 4 idle speculative servers resident")
        await measure(pair, "alone again")

asyncio.run(main())
