"""`dynamo-spec bench --host-check`: how steady is this host's own speed, nothing of ours running?

    dynamo-spec bench --host-check [--workload gemm|mem] [--seconds 240] [--out DIR]

One process per usable core, pinned to it, repeats a fixed piece of work (``gemm``: a
64 x 576 by 576 x 1536 bf16 matmul, the shape of a decode step's projections, in cache;
``mem``: a sum over 256 MB, memory bound) and counts how many it finishes in each 1-s
window. A host whose compute is steady shows the same count in every window; a VM that
shares its physical cores, caches or memory with other tenants does not, and no process of
ours explains it (steal time, read from /proc/stat over the run, counts only time the
vCPU did not run at all).

Printed per core: the spread of the 1-s windows around their median, the lowest window,
and, for windows as long as a bench cell (8, 18, 30 s), how far two adjacent windows' means
lie apart: the difference one round of `dynamo-spec bench` cannot tell from a real one,
before any server runs. And how alike the cores move (correlation of their series): both
at once means the whole VM slowed. Every window's figures go to ``host-check.json``.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import statistics
import time

from dynamo_spec.bench.options import HostCheckOptions

CELLS = (8, 18, 30)
FILE = "host-check.json"


def _work(workload: str, core: int, seconds: float, queue: mp.Queue) -> None:
    import torch

    os.sched_setaffinity(0, {core})
    torch.set_num_threads(1)
    if workload == "gemm":
        a = torch.randn(64, 576, dtype=torch.bfloat16)
        w = torch.randn(576, 1536, dtype=torch.bfloat16)

        def step() -> None:
            for _ in range(25):
                a @ w
    else:
        big = torch.ones(64 * 2**20, dtype=torch.float32)

        def step() -> None:
            big.sum()
    for _ in range(10):
        step()
    rows, end = [], time.time() + seconds
    while time.time() < end:
        t0, n = time.perf_counter(), 0
        while time.perf_counter() - t0 < 1.0:
            step()
            n += 1
        rows.append((time.time(), n / (time.perf_counter() - t0)))
    queue.put((core, rows))


def _steal() -> tuple[int, int]:
    """(steal, total) jiffies of all CPUs from /proc/stat."""
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    return fields[7], sum(fields)


def adjacent_differences(series: list[float], window: int) -> list[float]:
    """|a - b| / mean(a, b) of the means of adjacent, non-overlapping windows of `window` samples."""
    means = [statistics.mean(series[i:i + window]) for i in range(0, len(series) - window + 1, window)]
    return [abs(a - b) / ((a + b) / 2) for a, b in zip(means, means[1:])]


def summarize(series: list[float]) -> dict:
    median = statistics.median(series)
    rel = [v / median for v in series]
    out = {"windows": len(series), "median_per_s": median, "stdev": statistics.pstdev(rel), "min": min(rel),
           "max": max(rel), "below_0.8": sum(v < 0.8 for v in rel) / len(rel), "relative": [round(v, 3) for v in rel]}
    for cell in CELLS:
        d = adjacent_differences(series, cell)
        if d:
            d.sort()
            out[f"adjacent_{cell}s"] = {"median": statistics.median(d), "p90": d[int(0.9 * (len(d) - 1))],
                                        "max": d[-1], "pairs": len(d)}
    return out


def _corr(x: list[float], y: list[float]) -> float | None:
    n = min(len(x), len(y))
    if n < 3:
        return None
    return statistics.correlation(x[:n], y[:n])


def figures(options: HostCheckOptions, cores: list[int], series: dict[int, list[float]],
            steal_share: float) -> dict:
    """The report of a check from each core's 1-s window counts."""
    out = {"kind": options.workload, "seconds": options.seconds, "cores": cores, "steal_share": steal_share,
           "per_core": {str(c): summarize(series[c]) for c in cores}}
    if len(cores) > 1:
        out["correlation_core0_core1"] = _corr(series[cores[0]], series[cores[1]])
    return out


def text(report: dict) -> str:
    lines = [f"{report['kind']} on {len(report['cores'])} core(s), {report['seconds']:.0f} s, "
             f"steal {report['steal_share']:.1%}"]
    for c, s in report["per_core"].items():
        cells = "; ".join(f"{cell} s windows: adjacent differ median {s[f'adjacent_{cell}s']['median']:.1%}, "
                          f"p90 {s[f'adjacent_{cell}s']['p90']:.1%}, max {s[f'adjacent_{cell}s']['max']:.1%}"
                          for cell in CELLS if f"adjacent_{cell}s" in s)
        lines.append(f"core {c}: 1-s windows stdev {s['stdev']:.1%} of the median, lowest {s['min']:.2f}x, highest "
                     f"{s['max']:.2f}x, {s['below_0.8']:.1%} below 0.8x" + (f"; {cells}" if cells else ""))
    if report.get("correlation_core0_core1") is not None:
        lines.append(f"correlation of the cores' series: {report['correlation_core0_core1']:.2f}")
    return "\n".join(lines)


def run(options: HostCheckOptions) -> int:
    cores = sorted(os.sched_getaffinity(0))
    print(f"host check: {options.workload} on {len(cores)} core(s) for {options.seconds:.0f} s")
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    steal0 = _steal()
    procs = [ctx.Process(target=_work, args=(options.workload, c, options.seconds, queue)) for c in cores]
    for p in procs:
        p.start()
    results = dict(queue.get() for _ in procs)
    for p in procs:
        p.join()
    steal1 = _steal()
    series = {c: [v for _, v in results[c]] for c in cores}
    report = figures(options, cores, series, (steal1[0] - steal0[0]) / max(1, steal1[1] - steal0[1]))
    print(text(report))
    options.out.mkdir(parents=True, exist_ok=True)
    (options.out / FILE).write_text(json.dumps(report, indent=1))
    print(f"\nWritten: {options.out / FILE}")
    return 0
