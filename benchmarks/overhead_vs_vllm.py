"""Our server against vLLM's own OpenAI server: same model, engine and speculative settings, same load.

    python -m benchmarks.overhead_vs_vllm --config configs/smollm2-135m-instruct-eagle3-cpu.yaml \
        [--rounds 3] [--concurrency 1,16] [--max-tokens 64]
    python -m benchmarks.overhead_vs_vllm --tiny [...]     # the tiny fixed target + partial draft

Both servers get the engine arguments our settings build (`engine_kwargs`, dtype
resolved for the host) and the same thread binding; they start alternately on one
port (the order flips each round). The load is the bench's: streaming chat
completions through the official openai client, greedy, on the bench's judge prompts.
Prints per-round figures and the median ratios ours / vLLM's of output tokens/s,
TTFT p50 and ITL p50 per concurrency.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

import yaml

from dynamo_spec.bench.load import run_cell
from dynamo_spec.bench.managed_server import ManagedServer, free_port, serve_command
from dynamo_spec.bench.prompts import load_sets, read_prompts, split
from dynamo_spec.bench.summary import percentiles
from dynamo_spec.config.loader import load_settings
from dynamo_spec.engine.args import engine_kwargs
from dynamo_spec.engine.host import detect_host
from dynamo_spec.engine.process_env import prepare_engine_processes


def vllm_serve_argv(config: Path, port: int) -> list[str]:
    """`vllm serve` with the engine arguments our settings build."""
    settings = load_settings(config).settings
    kwargs = engine_kwargs(settings, detect_host())
    argv = [sys.executable, "-m", "benchmarks.vllm_cli", "serve", kwargs.pop("model"),
            "--host", "127.0.0.1", "--port", str(port), "--served-model-name", *kwargs.pop("served_model_name")]
    for key, value in kwargs.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            argv.append(flag)
        elif value is False:
            continue
        elif isinstance(value, dict):
            argv += [flag, json.dumps(value)]
        else:
            argv += [flag, str(value)]
    return argv


def tiny_config(work: Path) -> Path:
    from dynamo_spec.engine.process_env import vllm_dirs
    from support.tiny_models import build_fixture_set

    os.environ.update(vllm_dirs(work / "env", offline=True))
    models = build_fixture_set(work / "models")
    config = {
        "server": {"served_model_name": "tiny"},
        "engine": {"model": str(models["fixed_target"]), "dtype": "bfloat16", "max_model_len": 512,
                   "kv_cache_memory_bytes": "256MiB", "enforce_eager": True},
        "speculative": {"method": "eagle3", "model": str(models["partial_draft"]), "num_speculative_tokens": 3},
    }
    path = work / "tiny.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


async def measure(url: str, model: str, items: list[dict], concurrency: list[int], max_tokens: int) -> dict:
    await run_cell(url, model, items, concurrency=2, requests=4, max_tokens=16, temperature=0)  # warm-up
    out = {}
    for c in concurrency:
        cell = await run_cell(url, model, items, concurrency=c, requests=max(8, 2 * c), max_tokens=max_tokens,
                              temperature=0)
        ok = cell.completed
        out[c] = {"tokens_per_s": cell.output_tokens / cell.wall,
                  "ttft_p50": percentiles([r.ttft for r in ok if r.ttft is not None])["p50"],
                  "itl_p50": percentiles([r.itl for r in ok if r.itl is not None])["p50"],
                  "failed": len(cell.requests) - len(ok)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", default="1,16")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prompts", type=Path, help="JSONL prompts (default: the bench's judge prompts)")
    parser.add_argument("--out", type=Path, default=Path("runs/overhead"))
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="dynamo-spec-overhead-"))
    config = tiny_config(work) if args.tiny else args.config
    settings = load_settings(config).settings
    model = settings.served_model_name
    items = read_prompts(args.prompts) if args.prompts else split(load_sets())[1]
    concurrency = [int(c) for c in args.concurrency.split(",")]
    # The same thread binding and preloads for both servers (ours sets them the same way itself).
    prepare_engine_processes(cpu_preload=settings.engine.cpu_preload)
    rows: dict[str, list[dict]] = {"ours": [], "vllm": []}
    for r in range(args.rounds):
        order = ("ours", "vllm") if r % 2 == 0 else ("vllm", "ours")
        for name in order:
            port = free_port()
            argv = serve_command(config, port) if name == "ours" else vllm_serve_argv(config, port)
            with ManagedServer(argv, port, args.out / f"{name}-{r}.log") as server:
                result = asyncio.run(measure(server.url, model, items, concurrency, args.max_tokens))
            rows[name].append(result)
            print(f"round {r} {name}: " + "; ".join(
                f"c={c} {v['tokens_per_s']:.1f} tok/s, TTFT {1000 * v['ttft_p50']:.0f} ms, ITL {1000 * v['itl_p50']:.1f} ms"
                for c, v in result.items()), flush=True)
    print(f"\n| c | throughput ours/vLLM | TTFT p50 ours/vLLM | ITL p50 ours/vLLM |  ({args.rounds} rounds, median) |")
    print("|---|---|---|---|")
    for c in concurrency:
        ratios = {key: statistics.median(o[c][key] / v[c][key] for o, v in zip(rows["ours"], rows["vllm"], strict=True))
                  for key in ("tokens_per_s", "ttft_p50", "itl_p50")}
        print(f"| {c} | {ratios['tokens_per_s']:.3f} | {ratios['ttft_p50']:.3f} | {ratios['itl_p50']:.3f} |")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "overhead.json").write_text(json.dumps({"config": str(config), "rows": rows}, indent=2, default=str))


if __name__ == "__main__":
    main()
