"""What capture (``learning.capture``) costs, measured through the server.

    python -m benchmarks.capture_cost --config configs/smollm2-135m-instruct-eagle3-cpu.yaml \
        [--concurrency 1,16] [--rounds 4] [--max-tokens 64] [--capture-first]
    python -m benchmarks.capture_cost --tiny [--rounds 2]    # the tiny test fixtures: a quick try
    python -m benchmarks.capture_cost --hook [--prompt 512 --answer 256]   # the capture's own CPU time, no server

Two servers from the same config, up at once: capture off, and capture on for every tenant
(``learning.dir`` in a temp folder). Each round runs each concurrency on each server in
turn (paired rounds, ``runtime_options.interleave``: a host's drift over minutes moves both
alike). The load is the bench's (streaming chat, official openai client, greedy, judge prompts).
Prints every round, then per concurrency the median output tokens/s of each server and the
median of the per-round ratios on/off, and the rows the capture kept. The host is shared: run
it on an idle one, or read the spread of the rounds.

``--hook`` times what capture adds per request without a server, so a busy host cannot hide it:
the engine-client wrapper over a streamed request (one output per token, vLLM's own output
objects) against the bare generator, and the writer thread's encoding, compression and append
of its row. Divide by a request's time on the server for the share of throughput.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import tempfile
from pathlib import Path

import yaml

from benchmarks.runtime_options import interleave
from dynamo_spec.engine.process_env import vllm_dirs
from dynamo_spec.learning import captures


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return platform.processor() or "unknown CPU"
    fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    return f"{fields.get('Model name', '?').strip()}, {os.cpu_count()} cores"


def tiny_config_file(work: Path) -> Path:
    from support.server_process import tiny_config
    from support.tiny_models import build_fixture_set

    models = build_fixture_set(work / "models")
    path = work / "tiny.yaml"
    path.write_text(yaml.safe_dump(tiny_config(models["target"], models["draft"])))
    return path


def hook_cost(prompt: int, answer: int, repeats: int) -> dict:
    """Microseconds per request: the wrapper's extra time on the event loop, the writer's time per row."""
    import asyncio
    import time

    from vllm.outputs import CompletionOutput, RequestOutput
    from vllm.sampling_params import RequestOutputKind, SamplingParams

    from dynamo_spec.learning import capture

    params = SamplingParams(max_tokens=answer, output_kind=RequestOutputKind.DELTA)
    prompt_ids = list(range(1000, 1000 + prompt))
    outputs = [RequestOutput(request_id="r", prompt=None, prompt_token_ids=prompt_ids, prompt_logprobs=None,
                             outputs=[CompletionOutput(index=0, text="", token_ids=[7 + i % 50], cumulative_logprob=None,
                                                       logprobs=None, finish_reason="length" if i == answer - 1 else None)],
                             finished=i == answer - 1) for i in range(answer)]

    class Engine:
        async def generate(self, *args, **kwargs):
            for o in outputs:
                yield o

    store = captures.CaptureStore(tempfile.mkdtemp(prefix="capture-hook-"), max_bytes=2**40, retention_days=None,
                                  target={"name": "bench", "checksum": None})
    cap = capture.Capture(store, None)
    bare, wrapped = Engine(), capture.CapturingEngineClient(Engine(), cap)

    async def one(client) -> float:
        t0 = time.perf_counter()
        async for _ in client.generate("p", params, "r"):
            pass
        return time.perf_counter() - t0

    async def run() -> tuple[list[float], list[float]]:
        capture.request_context.set(capture.RequestContext("chat", None))
        a, b = [], []
        for _ in range(repeats):  # paired: bare then wrapped
            a.append(await one(bare))
            b.append(await one(wrapped))
        return a, b

    a, b = asyncio.run(run())
    t0 = time.perf_counter()
    cap.flush()  # every row of the run: what the writer thread does for them
    write = (time.perf_counter() - t0) / repeats
    return {"loop_us": 1e6 * (statistics.median(b) - statistics.median(a)), "writer_us": 1e6 * write,
            "bare_us": 1e6 * statistics.median(a)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--config", type=Path)
    which.add_argument("--tiny", action="store_true", help="the tiny test fixtures (random target and draft)")
    which.add_argument("--hook", action="store_true", help="the capture's own CPU time per request, no server")
    parser.add_argument("--prompt", type=int, default=512, help="--hook: prompt tokens")
    parser.add_argument("--answer", type=int, default=256, help="--hook: answer tokens (one streamed output each)")
    parser.add_argument("--concurrency", default="1,16")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, default=Path("runs/capture-cost"))
    parser.add_argument("--capture-first", action="store_true",
                        help="start and measure the capture-on server first (a difference that follows the order "
                        "is the order's, not the capture's)")
    args = parser.parse_args()
    if args.hook:
        got = hook_cost(args.prompt, args.answer, repeats=200)
        print(f"Host: {cpu_name()}; a request of {args.prompt} prompt and {args.answer} streamed answer tokens: "
              f"capture adds {got['loop_us']:.0f} us on the event loop (the bare generator: {got['bare_us']:.0f} us) "
              f"and {got['writer_us']:.0f} us on its writer thread")
        return

    work = Path(tempfile.mkdtemp(prefix="dynamo-spec-capture-cost-"))
    if args.tiny:
        os.environ.update(vllm_dirs(work / "env", offline=True))
    config = tiny_config_file(work) if args.tiny else args.config
    learning = work / "learning"
    plan = {
        "capture off": ({}, []),
        "capture on": ({}, ["--learning.capture", "true", "--learning.dir", str(learning)]),
    }
    if args.capture_first:  # the same pair in the other order: what of a difference is the order's
        plan = dict(reversed(plan.items()))
    cs = [int(c) for c in args.concurrency.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    results = interleave(config, plan, cs, args.rounds, args.max_tokens, args.out)

    kept = captures.manifest_of(learning)["files"]
    print(f"\nHost: {cpu_name()}; config {config}; {args.rounds} paired rounds, {args.max_tokens} new tokens a request")
    print("\n| clients | capture off tok/s | capture on tok/s | on/off (median of rounds; min-max) | cost |")
    print("|---|---|---|---|---|")
    for c in cs:
        off = [r[c] for r in results["capture off"]]
        on = [r[c] for r in results["capture on"]]
        ratios = [a / b for a, b in zip(on, off)]
        ratio = statistics.median(ratios)
        print(f"| {c} | {statistics.median(off):.1f} | {statistics.median(on):.1f} | {ratio:.3f} "
              f"({min(ratios):.3f}-{max(ratios):.3f}) | {100 * (1 - ratio):+.1f} % |")
    print(f"\nCaptured: {sum(e['rows'] for e in kept)} rows in {len(kept)} file(s), "
          f"{sum(e['bytes'] for e in kept) / 1024:.0f} KiB ({learning})")


if __name__ == "__main__":
    main()
