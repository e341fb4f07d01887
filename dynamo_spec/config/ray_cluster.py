"""Preflight for ``engine.distributed_executor_backend: ray``: what the live Ray cluster can run.

Connects to the cluster vLLM will use (``RAY_ADDRESS``, else the one started on this machine),
compares its devices with the engine's ranks, and asks vLLM's platform whether it can run over
Ray at all. One line per problem; the connection is closed again before the engine starts.
"""

from __future__ import annotations

import os
import socket
from typing import TYPE_CHECKING

from dynamo_spec.config.problems import Problem

if TYPE_CHECKING:
    from dynamo_spec.config.settings import Settings


def platform_device() -> tuple[str, str]:
    """vLLM's platform name and the Ray resource its workers ask for ("" where it cannot use Ray)."""
    from vllm.platforms import current_platform

    return current_platform.device_name, current_platform.ray_device_key


def check(settings: Settings, on_cpu: bool, ranks: int, layout: str) -> list[Problem]:
    field = "engine.distributed_executor_backend ray"
    try:
        import ray
    except ImportError:
        return [Problem("error", f"{field} needs Ray in this environment: pip install 'dynamo-spec[ray]'")]
    problems: list[Problem] = []
    platform, device = platform_device()
    if not device:
        import vllm

        problems.append(Problem("error", f"{field}: vLLM {vllm.__version__} cannot run its {platform} platform over "
                                         f"Ray (the platform names no Ray device, so vLLM stops in "
                                         f"vllm/v1/executor/ray_utils.py initialize_ray_cluster: \"current platform "
                                         f"{platform} does not support ray.\"); on one machine use the mp backend"))
        device = "CPU" if on_cpu else "GPU"
    address = os.environ.get("RAY_ADDRESS") or "auto"
    if not _answers(address):
        return [*problems, Problem("error", f"{field}: nothing answers at RAY_ADDRESS={address} (vLLM would wait for "
                                            "it); start the head there (launch/ray_leader.sh) or fix the address")]
    try:
        ray.init(address=address, logging_level="ERROR", log_to_driver=False)
    except (ConnectionError, ValueError, RuntimeError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        problems.append(Problem("warning", f"{field}: no Ray cluster at RAY_ADDRESS={address} ({first}); vLLM will "
                                           "start one with this machine's devices only"))
        return problems
    try:
        have = ray.cluster_resources().get(device, 0)
        nodes = sum(node["Alive"] for node in ray.nodes())
    finally:
        ray.shutdown()
    if have < ranks:
        problems.append(Problem("error", f"{layout}, the Ray cluster at {address} has {have:g} {device} on {nodes} "
                                         f"node(s): join more nodes (launch/ray_worker.sh) or lower them"))
    return problems


def _answers(address: str, timeout: float = 3.0) -> bool:
    """A host:port address accepts connections ("auto" and ray:// are left to Ray)."""
    if address == "auto" or "://" in address:
        return True
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host or "127.0.0.1", int(port)), timeout=timeout):
            return True
    except (OSError, ValueError):
        return False
