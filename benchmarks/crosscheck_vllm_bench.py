"""Cross-check `dynamo-spec bench --url` against vLLM's own `vllm bench serve` on one cell.

    python -m benchmarks.crosscheck_vllm_bench [--config FILE] [--concurrency 4] [--requests 32]
        [--rounds 2] [--out runs/crosscheck]

Starts one server from the config, writes the shipped chat prompts as a vLLM "custom"
dataset, then alternates the two load generators on the same server (streaming chat
completions, greedy, 64 tokens, the same prompts and concurrency) and prints output
tokens/s and median TTFT of each run with the ratio ours / vLLM's. Needs `pandas`
(`vllm bench serve` imports it; not a dependency of this project).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

from dynamo_spec.bench.prompts import read_prompts
from dynamo_spec.bench.server import ManagedServer, free_port, serve_command

PROMPTS = Path(__file__).resolve().parents[1] / "dynamo_spec" / "bench" / "prompts" / "chat.jsonl"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=Path("configs/smollm2-135m-instruct-eagle3-cpu.yaml"))
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("runs/crosscheck"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    dataset = args.out / "prompts.jsonl"
    dataset.write_text("".join(json.dumps({"prompt": item["messages"][-1]["content"]}) + "\n"
                               for item in read_prompts(PROMPTS)))
    port = free_port()
    rows = []
    with ManagedServer(serve_command(args.config, port), port, args.out / "server.log") as server:
        model = _get_json(server.url + "/v1/models")["data"][0]["id"]
        tokenizer = _tokenizer_of(args.config)
        for r in range(args.rounds):
            vllm_file = f"vllm-{r}.json"
            subprocess.run([sys.executable, "-m", "benchmarks.vllm_cli", "bench", "serve", "--backend", "openai-chat",
                            "--endpoint", "/v1/chat/completions", "--base-url", server.url, "--model", model,
                            "--tokenizer", tokenizer, "--dataset-name", "custom", "--dataset-path", str(dataset),
                            "--skip-chat-template", "--custom-output-len", str(args.max_tokens),
                            "--num-prompts", str(args.requests), "--max-concurrency", str(args.concurrency),
                            "--temperature", "0", "--save-result", "--result-dir", str(args.out),
                            "--result-filename", vllm_file], check=True)
            v = json.loads((args.out / vllm_file).read_text())
            ours_dir = args.out / f"ours-{r}"
            subprocess.run([sys.executable, "-m", "dynamo_spec", "bench", "--url", server.url, "--prompts", str(dataset),
                            "--concurrency", str(args.concurrency), "--requests", str(args.requests),
                            "--max-tokens", str(args.max_tokens), "--out", str(ours_dir), "--no-plots"], check=True)
            o = json.loads((ours_dir / "bench-url.json").read_text())["cells"][str(args.concurrency)]
            rows.append({"round": r, "vllm_tok_s": v["output_throughput"], "ours_tok_s": o["output_tokens_per_s"],
                         "vllm_ttft_ms": v["median_ttft_ms"], "ours_ttft_ms": 1000 * o["ttft_s"]["p50"]})
    print(f"\nconcurrency {args.concurrency}, {args.requests} requests, {args.max_tokens} tokens, {model}")
    print("| round | vllm bench serve tok/s | dynamo-spec bench tok/s | ratio | vLLM TTFT p50 ms | ours TTFT p50 ms | ratio |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['round']} | {row['vllm_tok_s']:.1f} | {row['ours_tok_s']:.1f} | "
              f"{row['ours_tok_s'] / row['vllm_tok_s']:.3f} | {row['vllm_ttft_ms']:.0f} | {row['ours_ttft_ms']:.0f} | "
              f"{row['ours_ttft_ms'] / row['vllm_ttft_ms']:.3f} |")
    print(f"median ratios: throughput {statistics.median(r['ours_tok_s'] / r['vllm_tok_s'] for r in rows):.3f}, "
          f"TTFT {statistics.median(r['ours_ttft_ms'] / r['vllm_ttft_ms'] for r in rows):.3f}")
    (args.out / "crosscheck.json").write_text(json.dumps(rows, indent=2))
    return 0


def _get_json(url: str) -> dict:
    import requests

    return requests.get(url, timeout=30).json()


def _tokenizer_of(config: Path) -> str:
    from dynamo_spec.config.loader import load_settings

    settings = load_settings(config, [], {}).settings
    return settings.engine.tokenizer or settings.engine.model


if __name__ == "__main__":
    raise SystemExit(main())
