"""Idle host: an in-cache GEMM on core 0 and a memory stream on core 1 at once, per 1 s window."""
import os, sys, time, json
import torch
kind, core, dur, out = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
os.sched_setaffinity(0, {core}); torch.set_num_threads(1)
if kind == "gemm":
    a = torch.randn(64, 576, dtype=torch.bfloat16); w = torch.randn(576, 1536, dtype=torch.bfloat16)
    step = lambda: a @ w
else:
    big = torch.ones(64 * 2**20, dtype=torch.float32)  # 256 MB
    step = lambda: big.sum()
for _ in range(20): step()
t_end = time.time() + dur; rows = []
while time.time() < t_end:
    t0 = time.perf_counter(); n = 0
    while time.perf_counter() - t0 < 1.0:
        step(); n += 1
    rows.append((round(time.time(), 2), n / (time.perf_counter() - t0)))
json.dump(rows, open(out, "w"))
