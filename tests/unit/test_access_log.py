"""The server's access log leaves the probes out (dynamo_spec/serving/server.py: ProbeAccessFilter)."""

from __future__ import annotations

import logging

import pytest

from dynamo_spec.serving.server import ProbeAccessFilter

pytestmark = pytest.mark.unit


def access(path: str, status: int = 200) -> logging.LogRecord:
    # uvicorn's access record: (client, method, path with query, HTTP version, status)
    return logging.LogRecord("uvicorn.access", logging.INFO, __file__, 1, '%s - "%s %s HTTP/%s" %d',
                             ("127.0.0.1:5000", "GET", path, "1.1", status), None)


@pytest.mark.parametrize("path, kept", [("/health", False), ("/live", False), ("/health?x=1", False),
                                        ("/v1/completions", True), ("/metrics", True), ("/healthz", True)])
def test_probe_requests_are_left_out_of_the_access_log(path, kept):
    assert ProbeAccessFilter().filter(access(path, 503)) is kept
