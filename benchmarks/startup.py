"""Server start-up time, memory and first answer for a config.

    python -m benchmarks.startup --config configs/smollm2-135m-instruct-eagle3-cpu.yaml \
        [--temperature T] [overrides]

Starts `dynamo-spec serve`, measures the time until /health answers 200, the RSS of
the whole process tree (API process, EngineCore, worker), and the first chat answer.
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import time

import psutil
import requests

from dynamo_spec.bench.managed_server import free_port


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", required=True)
    parser.add_argument("--temperature", type=float,
                        help="the chat request's temperature (default: the request's default, 1)")
    args, overrides = parser.parse_known_args()
    port = free_port()
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "dynamo_spec", "serve", "--config", args.config,
                             "--server.port", str(port), *overrides],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        while True:
            assert proc.poll() is None, "server exited"
            try:
                if requests.get(url + "/health", timeout=1).status_code == 200:
                    break
            except requests.ConnectionError:
                pass
            time.sleep(0.2)
        ready = time.monotonic() - t0
        name = requests.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
        t1 = time.monotonic()
        body = {"model": name, "max_tokens": 250,
                "messages": [{"role": "user",
                              "content": "Write a poem about why Sakura trees are beautiful."}]}
        if args.temperature is not None:
            body["temperature"] = args.temperature
        answer = requests.post(url + "/v1/chat/completions", timeout=300, json=body).json()
        first = time.monotonic() - t1
        tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
        rss = sum(p.memory_info().rss for p in tree)
        print(f"ready after {ready:.1f} s; first answer ({answer['usage']['completion_tokens']} tokens) in {first:.2f} s; "
              f"RSS {rss / 2**30:.2f} GiB over {len(tree)} processes")
        print("speculative_decoding:", answer.get("metrics", {}).get("speculative_decoding"))
        print("answer:", answer["choices"][0]["message"]["content"][:300].replace("\n", " / "))
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)


if __name__ == "__main__":
    main()
