"""Host speed probe: a fixed bf16 GEMM loop pinned to one core, throughput per 2 s window."""
import os, sys, time, json
import torch
core = int(sys.argv[1]); dur = float(sys.argv[2]); out = sys.argv[3]
os.sched_setaffinity(0, {core}); torch.set_num_threads(1)
a = torch.randn(64, 576, dtype=torch.bfloat16); w = torch.randn(576, 1536, dtype=torch.bfloat16)
for _ in range(200): a @ w
t_end = time.time() + dur; rows = []
while time.time() < t_end:
    t0 = time.perf_counter(); n = 0
    while time.perf_counter() - t0 < 2.0:
        for _ in range(50): a @ w
        n += 50
    rows.append((round(time.time(), 2), n / (time.perf_counter() - t0)))
json.dump(rows, open(out, "w"))
