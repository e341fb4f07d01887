"""`dynamo-spec serve`: bind at once, load the engine behind /health "loading", serve, drain on SIGTERM.

Exit status: 0 after a clean stop; 1 if the engine died or failed to load, if a
signal stopped the server while it was loading, or if the drain had to cut
requests still in flight after `server.shutdown_grace_seconds`.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import signal
import socket
import threading
from types import FrameType

import uvicorn
from prometheus_client import REGISTRY, CollectorRegistry

from dynamo_spec.config.settings import Settings
from dynamo_spec.engine.async_llm import open_engine, stop_loading
from dynamo_spec.serving.app import attach_engine, create_app
from dynamo_spec.serving.lifecycle import Lifecycle, Phase
from dynamo_spec.serving.metering import build_metrics

logger = logging.getLogger("dynamo_spec.serving.server")

# After the drain, uvicorn closes what is left; requests still running then are cancelled
# (and so aborted in the engine) after this many seconds.
CLOSE_SECONDS = 1.0


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def security_warnings(settings: Settings) -> list[str]:
    warnings = []
    if settings.server.api_key is None and not is_loopback(settings.server.host):
        warnings.append(f"server.host is {settings.server.host} (reachable from other machines) and server.api_key is "
                        "not set: anyone who reaches this port can use the model. Set server.api_key (or "
                        "DYNAMO_SPEC_SERVER__API_KEY), or bind to 127.0.0.1.")
    if settings.learning.capture and settings.server.api_key is None:
        warnings.append(f"learning.capture is on and server.api_key is not set: the users' prompts and answers are "
                        f"kept under {settings.learning.dir}, and /admin (erase them, swap the draft) is open to "
                        "whoever reaches this port. Set server.api_key.")
    return warnings


class DrainingServer(uvicorn.Server):
    """uvicorn, with SIGTERM/SIGINT starting a drain instead of cutting connections.

    First signal while serving: the phase becomes draining (/health and new requests
    503), in-flight requests get up to `grace` seconds, then the server exits. First
    signal while loading: exit at once (the engine's start is stopped). A second
    signal: exit now.
    """

    def __init__(self, config: uvicorn.Config, lifecycle: Lifecycle, grace: float):
        super().__init__(config)
        self.lifecycle = lifecycle
        self.grace = grace
        self.cut = 0
        self.stopped_by_signal = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain: asyncio.Task | None = None

    @contextlib.contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        self._loop = asyncio.get_running_loop()
        original = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)

    def _on_signal(self, sig: int, frame: FrameType | None) -> None:
        name = signal.Signals(sig).name
        if self.stopped_by_signal:
            logger.warning("%s again: stopping now", name)
            self.should_exit = self.force_exit = True
            return
        self.stopped_by_signal = True
        if self.lifecycle.ready:
            logger.info("%s: draining (up to %g s for %d request(s) in flight; new ones get 503)",
                        name, self.grace, self.lifecycle.in_flight)
            self.lifecycle.set_phase(Phase.DRAINING)
            self._loop.call_soon_threadsafe(self._start_drain)
        else:
            logger.info("%s while %s: stopping", name, self.lifecycle.phase.value)
            self.should_exit = True

    def _start_drain(self) -> None:
        self._drain = asyncio.ensure_future(self.drain())

    async def drain(self) -> None:
        if not await self.lifecycle.wait_idle(self.grace):
            self.cut = self.lifecycle.in_flight
            logger.error("Drain: %d request(s) still in flight after %g s (server.shutdown_grace_seconds): cut",
                         self.cut, self.grace)
        else:
            logger.info("Drain: nothing in flight; stopping")
        self.should_exit = True


PROBE_PATHS = ("/health", "/live")


class ProbeAccessFilter(logging.Filter):
    """Leaves the probes' requests out of the access log: the launch script asks /health every 2 s
    while the engine loads (minutes) and Kubernetes asks both all the time, which would bury
    vLLM's progress lines. /health's state is on /metrics and in the server's own log lines."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        path = str(args[2]).split("?", 1)[0] if len(args) >= 3 else ""
        return path not in PROBE_PATHS


async def serve(settings: Settings) -> int:
    for warning in security_warnings(settings):
        logger.warning(warning)
    registry = CollectorRegistry()
    metrics = build_metrics(settings, registry) if settings.metrics.enabled else None
    stat_loggers = [metrics.stat_logger_factory()] if metrics is not None else []
    lifecycle = Lifecycle()
    app = create_app(settings, lifecycle, metrics, metrics_registries=[registry, REGISTRY])
    config = uvicorn.Config(app, host=settings.server.host, port=settings.server.port,
                            log_level=settings.server.log_level, timeout_graceful_shutdown=CLOSE_SECONDS,
                            timeout_keep_alive=settings.server.keep_alive_seconds)
    logging.getLogger("uvicorn.access").addFilter(ProbeAccessFilter())
    server = DrainingServer(config, lifecycle, grace=settings.server.shutdown_grace_seconds)
    app.state.server = server  # vLLM's engine-error handler stops the server through it

    def engine_died() -> None:
        lifecycle.set_phase(Phase.DEAD, "the engine died")
        server.should_exit = True

    sock = bind(settings.server.host, settings.server.port)
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    logger.info("Listening on http://%s:%d (/live; /health answers 503 until the engine is loaded)",
                settings.server.host, settings.server.port)
    async with contextlib.AsyncExitStack() as stack:
        loading = asyncio.create_task(stack.enter_async_context(open_engine(settings, stat_loggers=stat_loggers)))
        await asyncio.wait({loading, serving}, return_when=asyncio.FIRST_COMPLETED)
        if not loading.done():  # stopped (or failed to bind) while loading
            stopped = await asyncio.to_thread(stop_loading)
            logger.info("Stopped the engine's start-up (%d process(es))", stopped)
            with contextlib.suppress(BaseException):
                await loading
            await serving
            return 1
        if loading.exception() is not None:
            lifecycle.set_phase(Phase.DEAD, "the engine failed to load")
            logger.error("The engine failed to load: %s", loading.exception())
            server.should_exit = True
            await serving
            return 1
        engine = loading.result()
        if server.should_exit:
            await serving
            return 1
        await attach_engine(app, engine, metrics, settings, on_engine_dead=engine_died)
        logger.info("Serving %s on http://%s:%d", settings.served_model_name, settings.server.host,
                    settings.server.port)
        await serving
    if lifecycle.phase is Phase.DEAD:
        return 1
    if server.cut:
        logger.error("Stopped; %d request(s) were cut", server.cut)
        return 1
    logger.info("Stopped cleanly")
    return 0


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound before the engine loads (uvicorn's own way of binding)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.set_inheritable(True)
    return sock


def run(settings: Settings) -> int:
    try:
        return asyncio.run(serve(settings))
    finally:
        reap_resource_tracker()


def reap_resource_tracker(timeout: float = 10.0) -> None:
    """Stop multiprocessing's resource tracker and wait for it to exit.

    Starting the engine's processes starts it, as a child of this process; it exits once every
    holder of its pipe (this process, the engine's processes) has closed it. Python 3.11 never
    waits for it (python/cpython#88887; later Pythons do, at exit), so it outlived the server:
    an orphan, left for init to remove.
    """
    from multiprocessing import resource_tracker

    stop = getattr(resource_tracker._resource_tracker, "_stop", None)  # CPython's own, 3.11 and later
    if stop is None:
        return
    stopper = threading.Thread(target=stop, daemon=True)
    stopper.start()
    stopper.join(timeout)  # an engine process still holding the pipe must not hang the exit
