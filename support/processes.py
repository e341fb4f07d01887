"""Watching what a process starts: every descendant, and the shared memory they hold."""

from __future__ import annotations

import contextlib
import glob
import os
import threading
import time

import psutil

SHM = "/dev/shm"


class Watch:
    """Every process started under `pid` while it runs, seen every 0.2 s: also one that
    leaves its process group or session, or whose parent exits, once seen; and every file
    under /dev/shm those processes map."""

    def __init__(self, pid: int):
        self.pid, self.seen, self.shm = pid, {}, set()
        # Registration files already there (from killed processes of earlier tests or runs):
        # pids are reused on a long run, so one may carry the number of a process seen here.
        self._before = {path: _identity(path) for path in glob.glob(os.path.join(SHM, "__KMP_REGISTERED_LIB_*"))}
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._done.is_set():
            try:
                children = psutil.Process(self.pid).children(recursive=True)
            except psutil.NoSuchProcess:
                return
            for child in children:
                self.seen.setdefault(child.pid, child)
                with contextlib.suppress(psutil.Error):
                    self.shm.update(m.path for m in child.memory_maps() if m.path.startswith(SHM + "/"))
            time.sleep(0.2)

    def stop(self) -> list[psutil.Process]:
        self._done.set()
        self._thread.join()
        return list(self.seen.values())

    def running(self) -> list[str]:
        """Those seen that still run (zombies aside: a parent may not have waited yet)."""
        left = []
        for proc in list(self.seen.values()):
            try:
                if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                    left.append(f"{proc.pid} {proc.name()} {' '.join(proc.cmdline()[:4])}")
            except psutil.NoSuchProcess:
                pass
        return left

    def shm_left(self) -> list[str]:
        """Shared memory of the processes seen still in /dev/shm: files they mapped, and
        Intel OpenMP's registration files (named by pid; removed at a normal exit), but not
        a file that was there, unchanged, before the watch began."""
        left = {path for path in self.shm if os.path.exists(path)}
        for pid in list(self.seen):
            left.update(path for path in glob.glob(os.path.join(SHM, f"__KMP_REGISTERED_LIB_{pid}_*"))
                        if self._before.get(path) is None or self._before[path] != _identity(path))
        return sorted(left)


def _identity(path: str) -> tuple[int, int] | None:
    """(inode, modification time) of `path`, None when it is gone."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return st.st_ino, st.st_mtime_ns
