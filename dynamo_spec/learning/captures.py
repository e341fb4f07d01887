"""The captures on disk: the users' prompts and answers as token ids, kept private.

``learning.dir/captures/`` (mode 0700) holds ``capture-NNNNNN.jsonl.gz`` files (0600): gzipped
JSON lines, one row per finished request (``capture.row`` makes them; the keys of a ``data/``
round row plus tenant, time, endpoint, sampling and acceptance). A file is a series of gzip
members, one per flush, each of whole lines, so a reader tolerates a last member still being
written. A file is closed (rotated) at :data:`ROTATE_BYTES`, after :data:`ROTATE_SECONDS` or
when its writer stops; a writer starts a new file. ``manifest.json`` (0600) names the target
that wrote them and each file's rows, bytes, first and last row time and whether it is closed.

Every change (append, rotation, the caps, erase) holds an exclusive ``flock`` on
``captures/.lock``: replicas sharing a volume each write their own files, and a file of
another writer that disappears (erased, dropped by a cap) is noticed before the next append.
Caps: past ``max_bytes`` the oldest files are dropped; a file whose newest row is older than
``retention_days`` is dropped. Nothing here logs a row's content.

The reader API (``learn-draft`` uses it): :func:`iter_rows`, :func:`target_of`, :func:`erase`.
"""

from __future__ import annotations

import contextlib
import fcntl
import gzip
import json
import logging
import os
import re
import socket
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path

logger = logging.getLogger(__name__)

CAPTURES = "captures"
MANIFEST = "manifest.json"
LOCK = ".lock"
FORMAT_VERSION = 1
FILE_RE = re.compile(r"^capture-(\d{6,})\.jsonl\.gz$")
ROTATE_BYTES = 8 * 2**20
ROTATE_SECONDS = 86_400.0  # a day: rows outlive retention_days by at most this
DIR_MODE = 0o700
FILE_MODE = 0o600


class CaptureTargetMismatch(RuntimeError):
    """The directory holds captures of another target: they are never mixed."""


def captures_dir(root: str | os.PathLike) -> Path:
    return Path(root) / CAPTURES


def file_name(number: int) -> str:
    return f"capture-{number:06d}.jsonl.gz"


def _number(name: str) -> int | None:
    m = FILE_RE.match(name)
    return int(m.group(1)) if m else None


def _files_on_disk(d: Path) -> list[str]:
    """Capture files in ``d``, oldest (lowest number) first."""
    try:
        names = [n for n in os.listdir(d) if _number(n) is not None]
    except FileNotFoundError:
        return []
    return sorted(names, key=_number)


# ------------------------------------------------------------------ reading


def members(data: bytes) -> Iterator[bytes]:
    """The decompressed gzip members of ``data``; a truncated or damaged last one is left out."""
    while data:
        d = zlib.decompressobj(16 + zlib.MAX_WBITS)
        try:
            out = d.decompress(data)
        except zlib.error:
            return
        if not d.eof:  # still being written (or cut by a crash)
            return
        yield out
        data = d.unused_data


def _file_rows(path: Path) -> Iterator[dict]:
    try:
        data = path.read_bytes()
    except FileNotFoundError:  # dropped by a cap or erased meanwhile
        return
    for member in members(data):
        for line in member.split(b"\n"):
            if line:
                yield json.loads(line)


def iter_rows(root: str | os.PathLike) -> Iterator[dict]:
    """Every row of every capture file under ``root`` (``learning.dir``), oldest first."""
    d = captures_dir(root)
    for name in _files_on_disk(d):
        yield from _file_rows(d / name)


def _read_manifest(d: Path) -> dict:
    try:
        manifest = json.loads((d / MANIFEST).read_text())
    except (FileNotFoundError, ValueError):
        return {"format": FORMAT_VERSION, "target": None, "files": []}
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_VERSION:
        raise ValueError(f"{d / MANIFEST}: format {manifest.get('format')!r}, this code reads {FORMAT_VERSION}")
    return manifest


def target_of(root: str | os.PathLike) -> dict | None:
    """The target (``{"name", "checksum"}``, as ``data/`` rounds name it) that wrote the captures, or None."""
    return _read_manifest(captures_dir(root)).get("target")


def manifest_of(root: str | os.PathLike) -> dict:
    """The manifest as it is now (an empty one where there are no captures)."""
    return _read_manifest(captures_dir(root))


# ------------------------------------------------------------------ writing


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _write_manifest(d: Path, manifest: dict, sync: bool = False) -> None:
    tmp = d / f".{MANIFEST}.tmp-{os.getpid()}-{threading.get_ident()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, FILE_MODE)
    try:
        _write_all(fd, (json.dumps(manifest, indent=1) + "\n").encode())
        if sync:
            os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, d / MANIFEST)


def _make_dir(d: Path) -> None:
    d.parent.mkdir(parents=True, exist_ok=True)
    d.mkdir(mode=DIR_MODE, exist_ok=True)
    if d.stat().st_mode & 0o777 != DIR_MODE:
        os.chmod(d, DIR_MODE)


@contextlib.contextmanager
def _locked(d: Path) -> Iterator[None]:
    fd = os.open(d / LOCK, os.O_RDWR | os.O_CREAT, FILE_MODE)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def erase(root: str | os.PathLike) -> dict:
    """Delete every capture file and the manifest under ``root``; what was erased
    (``files``, ``rows``, ``bytes``). Creates nothing where there are no captures."""
    d = captures_dir(root)
    if not d.is_dir():
        return {"files": 0, "rows": 0, "bytes": 0}
    with _locked(d):
        manifest = _read_manifest_lenient(d)
        rows = {e["file"]: e.get("rows", 0) for e in manifest.get("files", [])}
        erased = {"files": 0, "rows": 0, "bytes": 0}
        for name in _files_on_disk(d):
            with contextlib.suppress(FileNotFoundError):
                size = (d / name).stat().st_size
                counted = rows[name] if name in rows else sum(1 for _ in _file_rows(d / name))
                (d / name).unlink()
                erased["files"] += 1
                erased["bytes"] += size
                erased["rows"] += counted
        with contextlib.suppress(FileNotFoundError):
            (d / MANIFEST).unlink()
    return erased


def _read_manifest_lenient(d: Path) -> dict:
    try:
        return _read_manifest(d)
    except ValueError:
        return {"format": FORMAT_VERSION, "target": None, "files": []}


class CaptureStore:
    """One writer of the captures under ``root`` (``learning.dir``). Not for the event loop:
    `append`, `enforce`, `erase` and `close` do file I/O (``capture.Capture`` calls them on
    its thread). Thread-safe."""

    def __init__(self, root: str | os.PathLike, *, max_bytes: int, retention_days: float | None,
                 target: dict | Callable[[], dict], rotate_bytes: int = ROTATE_BYTES,
                 rotate_seconds: float = ROTATE_SECONDS, clock: Callable[[], float] = time.time):
        self.dir = captures_dir(root)
        self.max_bytes = int(max_bytes)
        self.retention_seconds = retention_days * 86_400.0 if retention_days is not None else None
        self.rotate_bytes = min(int(rotate_bytes), self.max_bytes)  # a file past the cap can be dropped whole
        # a file spans at most a day (a quarter of the retention when shorter): it is dropped whole
        self.rotate_seconds = min(rotate_seconds, self.retention_seconds / 4) if self.retention_seconds else rotate_seconds
        self.clock = clock
        self._target = target
        self._lock = threading.Lock()
        self._fd: int | None = None
        self._name: str | None = None
        self._ino: int | None = None
        self._host = socket.gethostname()
        self.writer = f"{self._host}:{os.getpid()}"
        self._started = False

    def target(self) -> dict:
        """The target's name and checksum, computed once (it reads the target's weights)."""
        if callable(self._target):
            self._target = self._target()
        return self._target

    # ---------------------------------------------------------------- appends

    def append(self, rows: list[dict]) -> None:
        """Write ``rows`` (one gzip member) to this writer's open file, then apply the caps."""
        if not rows:
            return
        target = self.target()  # before the lock: the first time it reads the target's weights
        data = gzip.compress(b"".join(json.dumps(r, separators=(",", ":"), default=str).encode() + b"\n"
                                      for r in rows), compresslevel=6, mtime=0)
        times = [r["time"] for r in rows]
        with self._lock:
            _make_dir(self.dir)
            with _locked(self.dir):
                manifest = self._load(target)
                now = self.clock()
                self._rotate_if_due(manifest, now)
                entry = self._open_entry(manifest)
                _write_all(self._fd, data)
                entry["rows"] += len(rows)
                entry["bytes"] += len(data)
                entry["first_time"] = min(times) if entry["first_time"] is None else entry["first_time"]
                entry["last_time"] = max(times + ([entry["last_time"]] if entry["last_time"] else []))
                self._enforce(manifest, now)
                _write_manifest(self.dir, manifest)

    def enforce(self) -> list[str]:
        """Apply rotation by age, retention and the size cap now; the files dropped."""
        with self._lock:
            if not self.dir.is_dir():
                return []
            with _locked(self.dir):
                manifest = _read_manifest_lenient(self.dir)
                if not manifest["files"] and self._name is None:
                    return []
                dropped = self._enforce(manifest, self.clock())
                _write_manifest(self.dir, manifest)
                return dropped

    def close(self) -> None:
        """Close this writer's open file and mark it closed in the manifest."""
        with self._lock:
            if self._fd is None:
                return
            with _locked(self.dir):
                manifest = _read_manifest_lenient(self.dir)
                entry = self._entry(manifest, self._name)
                self._close_file(entry)
                _write_manifest(self.dir, manifest, sync=True)

    def erase(self) -> dict:
        """Erase every capture (this writer's open file too); what was erased."""
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = self._name = self._ino = None
            return erase(self.dir.parent)

    # ---------------------------------------------------------------- under the locks

    def _load(self, target: dict) -> dict:
        manifest = _read_manifest_lenient(self.dir)
        theirs = manifest.get("target")
        if theirs and theirs.get("checksum") != target.get("checksum"):
            raise CaptureTargetMismatch(
                f"{self.dir} holds captures of target {theirs.get('name')!r} ({theirs.get('checksum')}), not of the "
                f"served target {target.get('name')!r} ({target.get('checksum')}): erase them "
                "(DELETE /admin/learning/captures) or set another learning.dir")
        manifest["target"] = target
        if not self._started:
            self._adopt(manifest)
            self._started = True
        return manifest

    def _adopt(self, manifest: dict) -> None:
        """On this writer's first append: list files the manifest lacks (a crash between a file's
        creation and the manifest's update), and close this host's files whose writer is gone."""
        known = {e["file"] for e in manifest["files"]}
        for name in _files_on_disk(self.dir):
            if name not in known:
                rows = list(_file_rows(self.dir / name))
                times = [r.get("time") for r in rows if isinstance(r.get("time"), (int, float))]
                manifest["files"].append({
                    "file": name, "rows": len(rows), "bytes": (self.dir / name).stat().st_size,
                    "first_time": min(times, default=None), "last_time": max(times, default=None),
                    "closed": True, "writer": None})
        for e in manifest["files"]:
            host, _, pid = (e.get("writer") or "").rpartition(":")
            if not e["closed"] and host == self._host and (int(pid) == os.getpid() or not _pid_alive(int(pid))):
                e["closed"] = True
        manifest["files"].sort(key=lambda e: _number(e["file"]))

    @staticmethod
    def _entry(manifest: dict, name: str | None) -> dict | None:
        return next((e for e in manifest["files"] if e["file"] == name), None)

    def _open_entry(self, manifest: dict) -> dict:
        """This writer's open file's manifest entry; a new file if it has none, or if its file
        was dropped or erased by another writer."""
        entry = self._entry(manifest, self._name)
        if self._fd is not None and entry is not None and not entry["closed"]:
            try:
                if os.stat(self.dir / self._name).st_ino == self._ino:
                    return entry
            except FileNotFoundError:
                pass
        if self._fd is not None:
            os.close(self._fd)
            self._fd = self._name = self._ino = None
        if entry is not None:
            manifest["files"].remove(entry)  # its file is gone
        numbers = [_number(n) for n in _files_on_disk(self.dir)] + [_number(e["file"]) for e in manifest["files"]]
        number = max(numbers, default=0) + 1
        name = file_name(number)
        self._fd = os.open(self.dir / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, FILE_MODE)
        self._name, self._ino = name, os.fstat(self._fd).st_ino
        entry = {"file": name, "rows": 0, "bytes": 0, "first_time": None, "last_time": None, "closed": False,
                 "writer": self.writer}
        manifest["files"].append(entry)
        return entry

    def _close_file(self, entry: dict | None) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.fsync(self._fd)
            os.close(self._fd)
        self._fd = self._name = self._ino = None
        if entry is not None:
            entry["closed"] = True

    def _rotate_if_due(self, manifest: dict, now: float) -> dict | None:
        """Close this writer's file when it is full or old enough; its entry while it stays open."""
        own = self._entry(manifest, self._name) if self._fd is not None else None
        if own is not None and (own["bytes"] >= self.rotate_bytes or (
                own["first_time"] is not None and now - own["first_time"] >= self.rotate_seconds)):
            self._close_file(own)
            return None
        return own

    def _enforce(self, manifest: dict, now: float) -> list[str]:
        """Rotate this writer's file when due, then drop files past retention and the size cap."""
        own = self._rotate_if_due(manifest, now)
        dropped = []
        if self.retention_seconds is not None:
            cutoff = now - self.retention_seconds
            for e in list(manifest["files"]):
                if e is not own and e["last_time"] is not None and e["last_time"] < cutoff:
                    dropped.append(self._drop(manifest, e))
        total = sum(e["bytes"] for e in manifest["files"])
        for e in list(manifest["files"]):
            if total <= self.max_bytes:
                break
            if e is not own:
                total -= e["bytes"]
                dropped.append(self._drop(manifest, e))
        return dropped

    def _drop(self, manifest: dict, entry: dict) -> str:
        with contextlib.suppress(FileNotFoundError):
            (self.dir / entry["file"]).unlink()
        manifest["files"].remove(entry)
        return entry["file"]

