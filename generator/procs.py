"""nvcc child processes that never outlive the build that started them.

Each compile runs in a process group of its own (nvcc and the cicc/ptxas it spawns). A build
owns one :class:`Children`, which

* kills every running group when the build is interrupted (``KeyboardInterrupt`` or an exception
  escaping the build), and
* starts a small watchdog process in a session of its own, connected to the build by a pipe.
  The build tells it each group it starts and ends; when the pipe closes with groups still
  registered -- the build exited, or was killed with SIGKILL and could clean nothing up -- the
  watchdog kills those groups. Nothing else survives a ``kill -9`` of the build.

Linux/POSIX only (process groups, ``os.killpg``), like the rest of the build (nvcc for sm_90a).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

# The watchdog: reads "+PGID" / "-PGID" lines; at EOF kills the groups still registered.
_WATCHDOG = r"""
import os, signal, sys
groups = set()
for line in sys.stdin:
    line = line.strip()
    if line[:1] == "+":
        groups.add(int(line[1:]))
    elif line[:1] == "-":
        groups.discard(int(line[1:]))
for g in groups:
    try:
        os.killpg(g, signal.SIGKILL)
    except OSError:
        pass
"""


class Children:
    """Runs commands in their own process groups, all killed if the owning build dies.

    Use as a context manager around the compiles of one build; :meth:`run` may be called from
    any number of threads."""

    def __init__(self):
        self._lock = threading.Lock()
        self._running: dict[int, subprocess.Popen] = {}
        self._watchdog: subprocess.Popen | None = None

    def __enter__(self) -> "Children":
        self._watchdog = subprocess.Popen(
            [sys.executable, "-S", "-c", _WATCHDOG], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL, start_new_session=True, text=True, bufsize=1)
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is not None:
            self.kill_all()
        wd, self._watchdog = self._watchdog, None
        if wd is not None:
            try:
                wd.stdin.close()  # EOF: the watchdog kills what is left (nothing, normally) and exits
            except OSError:
                pass
            wd.wait()
        return False

    def _tell(self, line: str) -> None:
        wd = self._watchdog
        if wd is not None:
            try:
                wd.stdin.write(line + "\n")
                wd.stdin.flush()
            except (OSError, ValueError):
                pass

    def run(self, cmd: list[str]) -> subprocess.CompletedProcess:
        """Run ``cmd`` to completion in a new process group; returns its output as text."""
        with self._lock:  # registered before anything can kill the build between start and record
            p = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 text=True, start_new_session=True)
            self._running[p.pid] = p
            self._tell(f"+{p.pid}")
        try:
            out, err = p.communicate()
        finally:
            with self._lock:
                self._running.pop(p.pid, None)
                self._tell(f"-{p.pid}")
        return subprocess.CompletedProcess(cmd, p.returncode, out, err)

    def kill_all(self) -> None:
        """SIGKILL every running group (their ``run`` calls then return)."""
        with self._lock:
            pids = list(self._running)
        for pid in pids:
            try:
                os.killpg(pid, signal.SIGKILL)
            except OSError:
                pass
