"""SmolLM2-135M's linear layers on the CPU, per GEMM path, by the rows M of the input.

    python -m benchmarks.cpu_gemm [--dtype float32]

Times one pass over the target's 121 linear layers (30 layers of QKV, O, gate-up, down, and
the 49,152-row head; random weights) with each path vLLM's CPU backend may take
(`vllm/model_executor/layers/utils.py` `dispatch_cpu_unquantized_gemm`): oneDNN, plain
`torch.nn.functional.linear`, and AMD's zentorch when it can be imported (vLLM uses it on
AVX-512 Zen CPUs). Verifying k drafts for one request runs these at M = k + 1. Run it with
the engine's preloads (LD_PRELOAD of Intel OpenMP) and nothing else on the machine.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

HIDDEN, INTERMEDIATE, QKV, LAYERS, VOCAB = 576, 1536, 960, 30, 49152
SHAPES = [(QKV, HIDDEN), (HIDDEN, HIDDEN), (2 * INTERMEDIATE, HIDDEN), (HIDDEN, INTERMEDIATE)] * LAYERS
SHAPES.append((VOCAB, HIDDEN))
ROWS = [1, 2, 3, 4, 5, 8, 16, 32]


def paths(weights: list[torch.Tensor]) -> dict[str, list]:
    import vllm._custom_ops as ops

    out = {"torch": [lambda x, w=w: torch.nn.functional.linear(x, w) for w in weights]}
    try:
        handlers = [ops.create_onednn_mm(w.t(), 32) for w in weights]
        out["onednn"] = [lambda x, h=h: ops.onednn_mm(h, x, None) for h in handlers]
    except (RuntimeError, AttributeError) as e:
        print(f"oneDNN not available: {e}")
    try:
        import zentorch  # noqa: F401
    except ImportError:
        pass
    else:
        packed = [torch.ops.zentorch.zentorch_weight_prepack_for_linear(w) for w in weights]
        out["zentorch"] = [lambda x, w=w: torch.ops.zentorch.zentorch_linear_unary(x, w, None, is_weight_prepacked=True)
                           for w in packed]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    weights = [torch.randn(n, k, dtype=dtype) * 0.02 for n, k in SHAPES]
    print(f"ms per pass over {len(SHAPES)} linear layers ({args.dtype}, {args.threads} threads, "
          f"median of {args.repeats})")
    print("| path | " + " | ".join(f"M={m}" for m in ROWS) + " |")
    print("|---|" + "---|" * len(ROWS))
    fns = paths(weights)
    times: dict[str, dict[int, list[float]]] = {name: {m: [] for m in ROWS} for name in fns}
    for m in ROWS:
        xs = [torch.randn(m, k, dtype=dtype) for _, k in SHAPES]
        for _ in range(args.repeats + 1):  # the paths interleaved, so a drifting machine hits them alike
            for name, layer_fns in fns.items():
                start = time.perf_counter()
                for f, x in zip(layer_fns, xs):
                    f(x)
                times[name][m].append(time.perf_counter() - start)
    for name, by_rows in times.items():  # the first pass of each is a warm-up
        print(f"| {name} | " + " | ".join(f"{statistics.median(by_rows[m][1:]) * 1e3:.1f}" for m in ROWS) + " |")

if __name__ == "__main__":
    main()
