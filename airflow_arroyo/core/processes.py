"""A local process identified so that a recycled pid is never mistaken for it: pid, host and start time.

The supervisor, the sensors and the submit operator record a spark-submit (or a driver) by this identity and
later ask whether it is alive, whether its process group is still the one started, and signal that group.
Read through psutil. The start time is kept as kernel clock ticks since boot, the unit of ``/proc/<pid>/stat``
that identities recorded by earlier releases hold, so they keep matching; off Linux it is not known, and a
process is then reported as unknown and never signalled.
Airflow-free.
"""

from __future__ import annotations

import os
import socket
import sys
from dataclasses import dataclass

import psutil

__all__ = ["LocalProcess"]

_GONE = (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)


@dataclass(frozen=True)
class LocalProcess:
    """A process (and its process group: it was started as a session leader, so the group id is its pid) on
    one host. Where it cannot be told (another host, no start time), it is reported as unknown and never
    signalled."""

    pid: int
    host: str
    start_ticks: int | None

    @classmethod
    def of(cls, pid: int) -> LocalProcess:
        """The process ``pid`` on this host."""
        try:
            ticks: int | None = _ticks(psutil.Process(pid))
        except psutil.Error:
            ticks = None
        return cls(pid=pid, host=socket.gethostname(), start_ticks=ticks)

    @property
    def on_this_host(self) -> bool:
        """True if the process ran on this machine (only there can it be checked)."""
        return self.host == socket.gethostname()

    def alive(self) -> bool | None:
        """True/False when it can be told here, None when not (another host, no start time)."""
        if not self.on_this_host or self.start_ticks is None:
            return None
        try:
            process = psutil.Process(self.pid)
            return _ticks(process) == self.start_ticks and process.status() not in _GONE
        except psutil.Error:
            return False

    def group_alive(self) -> bool:
        """Whether any live process is left in its process group. False when it cannot be told here."""
        if not self.on_this_host:
            return False
        for process in psutil.process_iter():
            try:
                if os.getpgid(process.pid) == self.pid and process.status() not in _GONE:
                    return True
            except (psutil.Error, ProcessLookupError, PermissionError):
                continue
        return False

    def owns_group(self) -> bool:
        """Whether the process group ``pid`` is still the one started: its leader is the same process (same
        start time), or the leader is gone and members remain (a pid is not reused while a group of that id
        exists)."""
        if not self.on_this_host or self.start_ticks is None:
            return False
        try:
            if _ticks(psutil.Process(self.pid)) != self.start_ticks:
                return False  # the pid was recycled by another process
        except psutil.Error:
            pass
        return self.group_alive()

    def signal_group(self, sig: int) -> bool:
        """Send ``sig`` to the process group if it is still ours. Returns whether a signal was sent."""
        if not self.owns_group():
            return False
        try:
            os.killpg(self.pid, sig)
        except ProcessLookupError:
            return False
        return True


def _ticks(process: psutil.Process) -> int | None:
    """Start time in clock ticks since boot (``/proc/<pid>/stat`` field 22), on Linux. Elsewhere None: the wall
    clock start time moves when the clock is stepped, so a live process could look recycled; it is then unknown,
    and never signalled."""
    if not sys.platform.startswith("linux"):
        return None
    return int(round((process.create_time() - psutil.boot_time()) * os.sysconf("SC_CLK_TCK")))
