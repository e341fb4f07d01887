"""How long a server takes to stop (SIGTERM to exit, reaped) while every core is busy.

    python -m benchmarks.stop_under_load [--rounds 3] [--config FILE] [--against TREE]

Starts `dynamo-spec serve` (the tiny fixtures unless --config), waits until ready, busies every
core with one spinning process each, sends SIGTERM and times until the server has exited. With
--against, another checkout (e.g. a `git worktree` of an earlier commit) is measured in turn,
round by round, on the same ports' pattern and the same load.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import requests
import yaml

from dynamo_spec.bench.managed_server import free_port

ROOT = Path(__file__).resolve().parents[1]


def tiny_config(work: Path) -> Path:
    from support.server_process import tiny_config as config_for
    from support.tiny_models import build_fixture_set

    models = build_fixture_set(work / "models")
    path = work / "tiny.yaml"
    path.write_text(yaml.safe_dump(config_for(models["fixed_target"], models["partial_draft"], k=3)))
    return path


def stop_time(tree: Path, config: Path, log: Path) -> tuple[float, int]:
    port = free_port()
    env = dict(os.environ, PYTHONPATH=str(tree))
    with log.open("w") as out:
        server = subprocess.Popen([sys.executable, "-m", "dynamo_spec", "serve", "--config", str(config),
                                   "--server.port", str(port)], cwd=tree, env=env, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            try:
                if requests.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except requests.RequestException:
                pass
            time.sleep(0.25)
        spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 1)]
        time.sleep(2)
        start = time.monotonic()
        server.send_signal(signal.SIGTERM)
        code = server.wait()
        took = time.monotonic() - start
        for spinner in spinners:
            spinner.kill()
            spinner.wait()
    return took, code


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--config", type=Path, help="a config to serve (default: the tiny fixtures)")
    parser.add_argument("--against", type=Path, help="another checkout, measured in turn")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="stop-under-load-") as tmp:
        work = Path(tmp)
        config = args.config.resolve() if args.config else tiny_config(work)
        trees = [("this tree", ROOT)] + ([("against", args.against.resolve())] if args.against else [])
        for r in range(args.rounds):
            for name, tree in trees:
                took, code = stop_time(tree, config, work / f"{r}-{name.replace(' ', '_')}.log")
                print(f"round {r + 1} {name}: {took:.2f} s to exit (code {code})", flush=True)


if __name__ == "__main__":
    main()
