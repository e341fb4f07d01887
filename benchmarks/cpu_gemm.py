"""A Llama target's linear layers on the CPU, per GEMM path, by the rows M of the input.

    python -m benchmarks.cpu_gemm [--config configs/smollm2-135m-instruct-eagle3-cpu.yaml] [--dtype float32]

Times one pass over the config's target model's linear layers (per layer QKV, O, gate-up,
down, then the head; shapes from its config.json, random weights; SmolLM2-135M: 121 layers)
with each path vLLM's CPU backend may take (`vllm/model_executor/layers/utils.py`
`dispatch_cpu_unquantized_gemm`): oneDNN, plain `torch.nn.functional.linear`, and AMD's
zentorch when it can be imported (vLLM uses it on AVX-512 Zen CPUs). Verifying k drafts for
one request runs these at M = k + 1. Run it with the engine's preloads (LD_PRELOAD of Intel
OpenMP) and nothing else on the machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from dynamo_spec.config.loader import load_settings

ROWS = [1, 2, 3, 4, 5, 8, 16, 32]


def linear_shapes(model: Path) -> list[tuple[int, int]]:
    """(out, in) of each linear layer of a Llama-style model, in forward order."""
    c = json.loads((model / "config.json").read_text())
    hidden, heads = c["hidden_size"], c["num_attention_heads"]
    head_dim = c.get("head_dim") or hidden // heads
    qkv = (heads + 2 * c.get("num_key_value_heads", heads)) * head_dim
    layer = [(qkv, hidden), (hidden, heads * head_dim), (2 * c["intermediate_size"], hidden),
             (hidden, c["intermediate_size"])]
    return layer * c["num_hidden_layers"] + [(c["vocab_size"], hidden)]


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
    parser.add_argument("--config", type=Path, default=Path("configs/smollm2-135m-instruct-eagle3-cpu.yaml"))
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    shapes = linear_shapes(Path(load_settings(args.config).settings.engine.model))
    weights = [torch.randn(n, k, dtype=dtype) * 0.02 for n, k in shapes]
    print(f"ms per pass over {len(shapes)} linear layers ({args.dtype}, {args.threads} threads, "
          f"median of {args.repeats})")
    print("| path | " + " | ".join(f"M={m}" for m in ROWS) + " |")
    print("|---|" + "---|" * len(ROWS))
    fns = paths(weights)
    times: dict[str, dict[int, list[float]]] = {name: {m: [] for m in ROWS} for name in fns}
    for m in ROWS:
        xs = [torch.randn(m, k, dtype=dtype) for _, k in shapes]
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
