"""``dynamo-spec swap-draft``: swap the draft of several running servers (replicas) at once.

Each replica gets ``POST /admin/draft {"path": DIR}`` (``draft_admin.py``), unless ``GET
/admin/draft`` says it serves that directory already; so the command can run after every learn
job, and a replica that restarted on its configured draft is brought back to the promoted one.
``DIR`` is ``--path``, else the promoted version of ``learning.dir`` (``drafts/manifest.json``
``current``, from ``--config``): a path in the replicas' file system (the shared learning volume,
mounted at the same place everywhere).

Replicas: ``--url`` each, and/or ``--service URL`` whose host name resolves to every replica's
address (a Kubernetes headless Service: one address per ready pod). The API key: the
``DYNAMO_SPEC_SERVER__ADMIN_API_KEY`` or ``DYNAMO_SPEC_SERVER__API_KEY`` environment variable, or
``server.admin_api_key`` / ``server.api_key`` of ``--config``;
never a command-line argument. Progress goes to stderr; the last stdout line is one JSON object.
Exit 0: every replica serves the draft; 1: a replica refused it or could not be reached; 2: bad
input (no replica, no draft to swap to), one line.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import socket
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from dynamo_spec.config.settings import ENV_DELIMITER, ENV_PREFIX

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT = 0, 1, 2
API_KEY_ENV = f"{ENV_PREFIX}SERVER{ENV_DELIMITER}API_KEY"
ADMIN_KEY_ENV = f"{ENV_PREFIX}SERVER{ENV_DELIMITER}ADMIN_API_KEY"
ROUTE = "/admin/draft"


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "swap-draft", help="swap the draft of several running servers (POST /admin/draft to each replica)",
        description=__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="With --config, any setting can follow as an override (--learning.dir DIR).")
    p.add_argument("--url", action="append", default=[], help="a replica's base URL (repeat for each)")
    p.add_argument("--service", action="append", default=[],
                   help="a URL whose host name resolves to every replica (a headless Service): each address is one")
    p.add_argument("--path", help="the draft directory, as the replicas see it (default: the promoted version of "
                   "learning.dir, from --config)")
    p.add_argument("--config", "-c", help="the servers' YAML config: learning.dir, server.api_key")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds per replica (default: %(default)s)")
    p.set_defaults(func=swap_draft, accepts_overrides=True)


def replicas(urls: list[str], services: list[str]) -> list[str]:
    """``urls``, then one URL per address of each service's host name (sorted, de-duplicated)."""
    out = [u.rstrip("/") for u in urls]
    for service in services:
        parts = urlsplit(service)
        if not parts.hostname:
            raise ValueError(f"--service {service}: not a URL with a host name")
        port = parts.port or (443 if parts.scheme == "https" else 80)
        addresses = sorted({info[4][0] for info in socket.getaddrinfo(parts.hostname, port, type=socket.SOCK_STREAM)})
        for address in addresses:
            host = f"[{address}]" if ipaddress.ip_address(address).version == 6 else address
            out.append(urlunsplit((parts.scheme, f"{host}:{port}", parts.path.rstrip("/"), "", "")))
    return list(dict.fromkeys(out))


def swap_one(url: str, path: str, api_key: str | None, timeout: float) -> dict[str, Any]:
    """Swap one replica to ``path`` (nothing when it serves it already)."""
    import requests

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        served = requests.get(url + ROUTE, headers=headers, timeout=timeout)
        if served.status_code == 200 and served.json().get("path") == path:
            return {"url": url, "outcome": "serving already", "version": served.json().get("version")}
        r = requests.post(url + ROUTE, json={"path": path}, headers=headers, timeout=timeout)
    except (requests.RequestException, ValueError) as exc:
        return {"url": url, "outcome": "unreachable", "error": f"{type(exc).__name__}: {exc}"}
    if r.status_code == 200:
        return {"url": url, "outcome": "swapped", "version": r.json().get("version")}
    try:
        message = r.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = r.text[:500]
    return {"url": url, "outcome": "refused", "status": r.status_code, "error": message}


def _promoted(learning_dir: str) -> str:
    from dynamo_spec.learning.learn import current_version

    current = current_version(Path(learning_dir))
    if current is None:
        raise ValueError(f"no promoted version in {learning_dir}/drafts/manifest.json: give --path")
    return current["path"]


def swap_draft(args: argparse.Namespace) -> int:
    from dynamo_spec.config.loader import load_settings

    def bad(message: str) -> int:
        print(f"dynamo-spec swap-draft: error: {message}", file=sys.stderr)
        return EXIT_BAD_INPUT

    if args.overrides and not args.config:
        return bad(f"unrecognized arguments: {' '.join(args.overrides)} (overrides need --config)")
    settings = load_settings(args.config, args.overrides).settings if args.config else None  # ConfigError: exit 2
    api_key = os.environ.get(ADMIN_KEY_ENV) or os.environ.get(API_KEY_ENV) or None
    if api_key is None and settings is not None:  # /admin takes the admin key where one is set
        key = settings.server.admin_api_key or settings.server.api_key
        api_key = key.get_secret_value() if key is not None else None
    try:
        if args.path:
            path = os.path.abspath(os.path.expanduser(args.path))
        elif settings is not None:
            path = _promoted(settings.learning.dir)
        else:
            return bad("give --path, or --config to swap to the promoted version of its learning.dir")
        targets = replicas(args.url, args.service)
    except (OSError, ValueError) as exc:
        return bad(str(exc))
    if not targets:
        return bad("no replica: give --url (each) or --service (a name resolving to every replica)")
    results = []
    for url in targets:
        result = swap_one(url, path, api_key, args.timeout)
        results.append(result)
        detail = result.get("version") or result.get("error")
        print(f"swap-draft: {url}: {result['outcome']} ({detail})", file=sys.stderr)
    print(json.dumps({"path": path, "replicas": results}), flush=True)
    failed = [r for r in results if r["outcome"] not in ("swapped", "serving already")]
    return EXIT_FAILED if failed else EXIT_OK
