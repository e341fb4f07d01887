"""How long servers of the CPU default take to answer /health 200, started one, two and three at once
(fixed k=1..3, no schedule; the compile cache warm). Logs under runs/starts/."""
import time
from pathlib import Path

from dynamo_spec.bench.server import ManagedServer, free_port, serve_command

CFG = Path("configs/smollm2-135m-instruct-eagle3-cpu.yaml")
out = Path("runs/starts")


def run(ks):
    servers = []
    for i, k in enumerate(ks):
        port = free_port()
        overrides = ["--speculative.num_speculative_tokens", str(k),
                     "--speculative.num_speculative_tokens_per_batch_size", "null"]
        servers.append(ManagedServer(serve_command(CFG, port, overrides), port, out / f"s{i}.log").launch())
    t0 = time.monotonic()
    for s in servers:
        s.wait_ready()
    print(len(ks), "at once:", [round(s.ready_after, 1) for s in servers], "wall", round(time.monotonic() - t0, 1),
          flush=True)
    for s in servers:
        s.stop()


for ks in ([1], [2], [1, 2], [1, 2, 3]):
    run(ks)
