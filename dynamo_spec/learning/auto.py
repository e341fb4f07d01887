"""``learning.auto``: the server runs its own learn cycles and swaps in what the gate promotes.

With ``learning.auto`` on (it needs ``learning.capture``), the server counts the answer tokens it
captured (written to ``learning.dir/captures``; ``Capture.answer_tokens``) since its last cycle
started. Past ``learning.every_tokens``, while the server is ready and fewer than
``learning.max_in_flight`` requests are in flight, it starts one cycle: ``python -m dynamo_spec
learn-draft`` in a child process (its own process group) with the server's resolved settings in a
private YAML file (0600, removed when the cycle ends; without the API key), the environment the
server had before its engine started (vLLM sets its engine processes' there: ``LD_PRELOAD``, thread
binding) less the ``DYNAMO_SPEC_<SECTION>__<FIELD>`` variables (the file is all it reads), and
``learning.learn_args``. One cycle at a time (and one per ``learning.dir`` across processes:
learn-draft's ``learn.lock``).

Exit 0 (promoted): the new version is swapped in through :func:`draft_admin.swap`, the way
``POST /admin/draft`` swaps. Exit 3 (the gate refused), 1 or 2 (failed, bad input), or a killed
child: nothing is swapped, and nothing was promoted unless learn-draft's manifest write (write,
fsync, rename: its last step) had happened. The server serves on either way. One INFO line per
cycle; the child's stdout and stderr go to ``learning.dir/cycle-logs/<start>.log`` (0600, the
newest :data:`KEEP` kept); every cycle is appended to ``learning.dir/cycles.jsonl`` (0600), of
which ``GET /admin/learning`` (``auto_admin.py``) shows the newest :data:`KEEP`. At shutdown a
running cycle is stopped (SIGTERM to its group, SIGKILL after :data:`STOP_SECONDS`). At start the
promoted version of this target (``drafts/manifest.json`` ``current``), if any, is swapped in once
the engine is ready: the draft the cycles learn from is the one served.

Runner limits: the swap needs the V1 model runner (``engine/features.py`` ``LEARNING_AUTO``,
refused at start elsewhere).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import signal
import sys
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import yaml

from dynamo_spec.config.settings import ENV_DELIMITER, ENV_PREFIX, Settings

logger = logging.getLogger("dynamo_spec.learning.auto")

POLL_SECONDS = 1.0
KEEP = 20  # cycles shown by GET /admin/learning, and cycle logs kept
CYCLES = "cycles.jsonl"
LOGS = "cycle-logs"
STOP_SECONDS = 5.0  # at shutdown: SIGTERM, then SIGKILL after this
ERROR_PREFIX = "dynamo-spec learn-draft: error: "
FIGURES = ("heldout_al_before", "heldout_al_after", "everyday_al_before", "everyday_al_after", "rows", "heldout_rows",
           "steps")


# ------------------------------------------------------------------ the child's command


def child_config(settings: Settings) -> str:
    """The server's resolved settings as YAML for ``learn-draft --config``, without the API key.
    Paths given as ``./x`` or ``../x`` (an override or variable; the loader resolves a file's
    against its folder) are made absolute against the working directory, as the server read them."""
    from dynamo_spec.config.loader import resolve_relative_paths

    data = settings.model_dump(mode="json", exclude={"server": {"api_key", "admin_api_key"}})
    return "# learning.auto: the server's settings for one learn cycle (removed when it ends)\n" + yaml.safe_dump(
        resolve_relative_paths(data, Path.cwd()), sort_keys=False)


def child_env(environ: dict[str, str]) -> dict[str, str]:
    """The server's environment less its settings variables (the config file holds their values)."""
    return {k: v for k, v in environ.items() if not (k.upper().startswith(ENV_PREFIX) and ENV_DELIMITER in k)}


def learn_command(config: Path, learn_args: list[str]) -> list[str]:
    return [sys.executable, "-m", "dynamo_spec", "learn-draft", "--config", str(config), *learn_args]


def _private(path: Path, flags: int) -> int:
    return os.open(path, flags, 0o600)


# ------------------------------------------------------------------ cycles


def _stamp(t: float | None) -> str | None:
    return None if t is None else time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


@dataclasses.dataclass
class Cycle:
    """One automatic cycle, as ``GET /admin/learning`` and ``cycles.jsonl`` show it."""

    start: float  # Unix time
    tokens: int  # answer tokens captured since the cycle before, when it started
    pid: int | None = None
    log: str | None = None
    end: float | None = None
    exit: int | None = None  # learn-draft's status (0 promoted, 3 refused, 2 bad input, 1 failed); -N: signal N
    promoted: bool = False  # the gate promoted the version (learn-draft's manifest names it current)
    swapped: bool = False  # ... and the server serves it
    version: str | None = None
    path: str | None = None
    reason: str | None = None
    figures: dict[str, Any] | None = None
    seconds: float | None = None

    def as_json(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "start": _stamp(self.start), "end": _stamp(self.end)}


def read_cycles(root: Path, keep: int = KEEP) -> list[dict[str, Any]]:
    """The newest ``keep`` cycles of ``cycles.jsonl``, oldest first (a torn last line is skipped)."""
    rows: deque[dict[str, Any]] = deque(maxlen=keep)
    with contextlib.suppress(FileNotFoundError), open(Path(root) / CYCLES, encoding="utf-8") as f:
        for line in f:
            with contextlib.suppress(ValueError):
                row = json.loads(line)
                if isinstance(row, dict):
                    rows.append(row)
    return list(rows)


def _append_cycle(root: Path, row: dict[str, Any]) -> None:
    fd = _private(root / CYCLES, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        os.write(fd, (json.dumps(row) + "\n").encode())
        os.fsync(fd)
    finally:
        os.close(fd)


def _error_line(log: Path) -> str | None:
    """learn-draft's one-line error (exit 1 or 2), the last in its log."""
    with contextlib.suppress(OSError):
        lines = [line for line in log.read_text(errors="replace").splitlines() if line.startswith(ERROR_PREFIX)]
        if lines:
            return lines[-1][len(ERROR_PREFIX):]
    return None


def _signal_name(number: int) -> str:
    with contextlib.suppress(ValueError):
        return signal.Signals(number).name
    return f"signal {number}"


# ------------------------------------------------------------------ the loop


class AutoLearner:
    """Counts, starts one cycle at a time, swaps what it promotes, and records every cycle.

    ``capture``: the server's (``answer_tokens``); ``swap(path)``: :func:`draft_admin.swap` on the
    app's engine; ``command(config, learn_args)``: the child's argv (:func:`learn_command`)."""

    def __init__(self, settings: Settings, capture: Any, swap: Callable[[str], Awaitable[Any]],
                 command: Callable[[Path, list[str]], list[str]] = learn_command):
        self.settings = settings
        self.learning = settings.learning
        self.root = Path(settings.learning.dir)
        self.capture = capture
        self._swap = swap
        self._command = command
        self.counted_at_last_cycle = 0
        self.cycles: deque[dict[str, Any]] = deque(read_cycles(self.root), maxlen=KEEP)
        self.running: Cycle | None = None
        self._proc: asyncio.subprocess.Process | None = None
        self._task: asyncio.Task | None = None
        self._closing = False
        # The environment before the engine starts: vLLM's CPU platform and prepare_engine_processes then
        # set its processes' (LD_PRELOAD, thread binding), which the cycle's own engine must choose anew.
        self._environ = child_env(dict(os.environ))

    # ---------------------------------------------------------------- the trigger

    @property
    def tokens_since_last_cycle(self) -> int:
        return self.capture.answer_tokens - self.counted_at_last_cycle

    def due(self, in_flight: int) -> bool:
        """Past ``every_tokens`` since the last cycle, fewer than ``max_in_flight`` requests in
        flight, no cycle running."""
        return (self._task is None and not self._closing
                and self.tokens_since_last_cycle >= self.learning.every_tokens
                and in_flight < self.learning.max_in_flight)

    def maybe_start(self, in_flight: int) -> bool:
        """Start a cycle when :meth:`due`; True when one started."""
        if not self.due(in_flight):
            return False
        cycle = Cycle(start=time.time(), tokens=self.tokens_since_last_cycle)
        self.counted_at_last_cycle = self.capture.answer_tokens
        self.running = cycle
        self._task = asyncio.create_task(self._run_cycle(cycle), name="dynamo-spec-learn-cycle")
        return True

    async def wait(self) -> dict[str, Any] | None:
        """Wait for the running cycle, if any; its record."""
        if self._task is not None:
            await asyncio.shield(self._task)
        return self.cycles[-1] if self.cycles else None

    # ---------------------------------------------------------------- one cycle

    async def _run_cycle(self, cycle: Cycle) -> None:
        try:
            await self._learn(cycle)
        except Exception as exc:  # the server serves on whatever a cycle does
            logger.exception("Learn cycle failed")
            cycle.reason = cycle.reason or f"{type(exc).__name__}: {exc}"
        finally:
            cycle.end = time.time()
            cycle.seconds = round(cycle.end - cycle.start, 1)
            row = cycle.as_json()
            self.cycles.append(row)
            with contextlib.suppress(OSError):
                _append_cycle(self.root, row)
            self.running, self._proc, self._task = None, None, None
            self._log(cycle)

    async def _learn(self, cycle: Cycle) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        logs = self.root / LOGS
        logs.mkdir(exist_ok=True)
        os.chmod(logs, 0o700)
        stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(cycle.start)) + f".{int(cycle.start * 1000) % 1000:03d}Z"
        log_path = logs / f"{stamp}-{os.getpid()}.log"
        cycle.log = str(log_path.resolve())
        config = self.root / f".auto-config-{os.getpid()}.yaml"
        config.unlink(missing_ok=True)  # a killed server's
        fd = _private(config, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        with os.fdopen(fd, "w") as f:
            f.write(child_config(self.settings))
        try:
            with open(_private(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND), "ab", buffering=0) as log:
                last = await self._child(cycle, config, log)
        finally:
            config.unlink(missing_ok=True)
            _prune(logs)
        self._outcome(cycle, last, log_path)
        if cycle.promoted and not self._closing:
            await self._swap_in(cycle)

    async def _child(self, cycle: Cycle, config: Path, log: Any) -> bytes | None:
        """Run learn-draft; its last stdout line (the JSON result). Its stdout (vLLM's lines, then the
        result) is copied into the log, where its stderr goes."""
        proc = await asyncio.create_subprocess_exec(
            *self._command(config, list(self.learning.learn_args)), stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE, stderr=log, env=self._environ, process_group=0,
            limit=1 << 22)
        self._proc, cycle.pid = proc, proc.pid
        last: list[bytes] = []

        async def copy() -> None:
            async for line in proc.stdout:
                log.write(line)
                if line.strip():
                    last[:] = [line]

        reader = asyncio.create_task(copy())
        try:
            cycle.exit = await _exited(proc)
        finally:
            _kill_group(proc.pid, signal.SIGKILL)  # what it started and left (its engine's processes)
            with contextlib.suppress(asyncio.TimeoutError, ValueError):
                await asyncio.wait_for(reader, 10)  # cancelled past it: a process that left the group holds stdout
        return last[0] if last else None

    def _outcome(self, cycle: Cycle, last: bytes | None, log: Path) -> None:
        result: dict[str, Any] = {}
        if cycle.exit in (0, 3) and last:
            with contextlib.suppress(ValueError):
                result = json.loads(last)
        if result:
            cycle.version, cycle.path = result.get("version"), result.get("path")
            cycle.figures = {k: result[k] for k in FIGURES if k in result}
        if cycle.exit == 0 and result.get("promoted"):
            cycle.promoted = True
            cycle.reason = result.get("reason")
        elif cycle.exit == 3:
            cycle.reason = result.get("reason") or "the gate refused it"
        elif cycle.exit is not None and cycle.exit < 0:
            cycle.reason = f"killed by {_signal_name(-cycle.exit)}" + (" at shutdown" if self._closing else "")
        else:
            cycle.reason = _error_line(log) or f"learn-draft exited with status {cycle.exit} (see {log})"

    async def _swap_in(self, cycle: Cycle) -> None:
        from dynamo_spec.learning.draft_admin import Unavailable
        from dynamo_spec.learning.swap import SwapRefused

        try:
            await self._swap(cycle.path)
            cycle.swapped = True
        except (SwapRefused, Unavailable) as exc:
            cycle.reason = f"{cycle.reason}; promoted but not swapped: {exc}"

    def _log(self, cycle: Cycle) -> None:
        figures = cycle.figures or {}

        def al(name: str) -> str:
            before, after = figures.get(f"{name}_al_before"), figures.get(f"{name}_al_after")
            return f"{name} AL {before} -> {after}" if before is not None else f"{name} AL -"

        outcome = ("promoted and swapped in" if cycle.swapped else "promoted, not swapped" if cycle.promoted
                   else "not promoted")
        logger.info("Learn cycle %s: %s (%s; %s, %s; exit %s, %.1f s, %d answer tokens captured before it)",
                    cycle.version or "-", outcome, cycle.reason, al("heldout"), al("everyday"), cycle.exit,
                    cycle.seconds or 0.0, cycle.tokens)

    # ---------------------------------------------------------------- lifetime

    async def resume(self, target: Callable[[], dict]) -> None:
        """Serve the promoted version of this target (``drafts/manifest.json`` ``current``), if any,
        as the cycles learn from it. ``target()``: the served target's name and checksum."""
        from dynamo_spec.learning.draft_admin import Unavailable
        from dynamo_spec.learning.learn import LearnInputError, current_version
        from dynamo_spec.learning.swap import SwapRefused

        try:
            current = await asyncio.to_thread(current_version, self.root)
        except (OSError, ValueError, LearnInputError) as exc:
            logger.warning("learning.auto: %s/drafts/manifest.json unreadable (%s): serving %s", self.root, exc,
                           self.settings.speculative.model)
            return
        if current is None:
            return
        theirs = (current.get("target") or {}).get("checksum")
        if theirs != (await asyncio.to_thread(target)).get("checksum"):
            logger.info("learning.auto: the promoted version %s is another target's: serving %s", current["version"],
                        self.settings.speculative.model)
            return
        try:
            await self._swap(current["path"])
        except (SwapRefused, Unavailable) as exc:
            logger.warning("learning.auto: the promoted version %s was not swapped in (%s): serving %s",
                           current["version"], exc, self.settings.speculative.model)

    async def run(self, ready: Callable[[], bool], in_flight: Callable[[], int], target: Callable[[], dict]) -> None:
        """The loop: once the server is ready, the promoted version, then a cycle whenever one is due."""
        while not ready():
            await asyncio.sleep(POLL_SECONDS)
        await self.resume(target)
        while True:
            if ready():
                self.maybe_start(in_flight())
            await asyncio.sleep(POLL_SECONDS)

    async def close(self) -> None:
        """Stop a running cycle (it promotes nothing unless its last write was done) and wait for its record."""
        self._closing = True
        proc = self._proc
        if proc is not None and proc.returncode is None:
            _kill_group(proc.pid, signal.SIGTERM)
            if await _exited(proc, STOP_SECONDS) is None:
                _kill_group(proc.pid, signal.SIGKILL)
        if self._task is not None:
            with contextlib.suppress(Exception):
                await self._task

    def state(self, in_flight: int) -> dict[str, Any]:
        running = self.running
        return {
            "auto": True, "dir": str(self.root), "every_tokens": self.learning.every_tokens,
            "tokens_since_last_cycle": self.tokens_since_last_cycle, "counted": "answer tokens this server captured",
            "max_in_flight": self.learning.max_in_flight, "in_flight": in_flight,
            "running": None if running is None else {"pid": running.pid, "since": _stamp(running.start),
                                                     "log": running.log},
            "cycles": list(self.cycles),
        }


async def _exited(proc: asyncio.subprocess.Process, timeout: float | None = None) -> int | None:
    """The child's status once it exited (None past ``timeout``). Not ``proc.wait()``: asyncio
    answers that only once the child's pipes are closed, and what it started may hold its stdout."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while proc.returncode is None:
        if deadline is not None and time.monotonic() > deadline:
            return None
        await asyncio.sleep(0.1)
    return proc.returncode


def _kill_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _prune(logs: Path, keep: int = KEEP) -> None:
    for old in sorted(logs.glob("*.log"))[:-keep]:
        old.unlink(missing_ok=True)


# ------------------------------------------------------------------ wiring


def attach(app: Any, settings: Settings, swapper: Any) -> AutoLearner | None:
    """``GET /admin/learning``, and with ``learning.auto`` on the learner (``app.state.learner``),
    run for the app's lifetime. Reads ``app.state.capture`` (``capture.attach`` first)."""
    from dynamo_spec.learning import auto_admin, draft_admin

    learner = None
    if settings.learning.auto:
        learner = AutoLearner(settings, app.state.capture,
                              lambda path: draft_admin.swap(swapper, app.state.engine, path))
    app.state.learner = learner
    app.include_router(auto_admin.router(settings.learning.dir, learner))
    return learner


@contextlib.asynccontextmanager
async def running(app: Any, learner: AutoLearner | None) -> AsyncIterator[None]:
    """The learner's loop for the app's lifetime; at shutdown a running cycle is stopped."""
    if learner is None:
        yield
        return
    lifecycle = app.state.lifecycle
    loop = asyncio.create_task(learner.run(lambda: lifecycle.ready and app.state.engine is not None,
                                           lambda: lifecycle.in_flight, learner.capture.store.target),
                               name="dynamo-spec-learning-auto")
    try:
        yield
    finally:
        loop.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await loop
        await learner.close()
