"""The driver's log on the worker host, rotated by size: ``python -m airflow_arroyo.operators.driver_log PATH``.

Reads spark-submit's output (the driver's and Spark's stdout and stderr) on its stdin and appends it to
``PATH``; once ``PATH`` would grow past ``--max-bytes`` it is renamed ``PATH.1`` (``PATH.1`` to ``PATH.2`` ...,
the oldest beyond ``--backups`` deleted) and a new ``PATH`` begins, at a line boundary where the output has one.
Readers of the current file (``log_tail``) keep reading ``PATH``. It ends when its input does (spark-submit and
everything that inherited its output exited); while it runs it holds an exclusive lock on ``PATH.writer``, so a
reader that saw spark-submit exit can wait for the last lines to be written (``log_tail(..., settle=...)``).
No Airflow import: it starts in milliseconds, beside spark-submit, and outlives the task that started it, as
spark-submit does.
"""

from __future__ import annotations

import argparse
import fcntl
import os
import subprocess
import sys
from pathlib import Path

__all__ = ["DEFAULT_BACKUPS", "DEFAULT_MAX_BYTES", "RotatingLog", "main", "start_writer"]

#: A driver log file's size before it is rotated, and how many rotated files are kept beside the current one.
DEFAULT_MAX_BYTES = 64 * 1024 * 1024
DEFAULT_BACKUPS = 5
_CHUNK = 64 * 1024


class RotatingLog:
    """Appends bytes to ``path``, rotating it once it would pass ``max_bytes`` (``backups`` older files kept)."""

    def __init__(self, path: Path, max_bytes: int, backups: int) -> None:
        if max_bytes < 1 or backups < 0:
            raise ValueError(f"max_bytes must be >= 1 and backups >= 0, got {max_bytes} and {backups}")
        self.path, self.max_bytes, self.backups = path, max_bytes, backups
        self._fd = self._open()
        self._size = os.fstat(self._fd).st_size

    def _open(self) -> int:
        return os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def write(self, data: bytes) -> None:
        """Append ``data``, rotating first wherever it would pass ``max_bytes``."""
        while data:
            room = self.max_bytes - self._size
            if len(data) <= room:
                self._write(data)
                return
            # fill the file up to its last whole line that fits; a line longer than a file is cut
            cut = data.rfind(b"\n", 0, room) + 1 if room > 0 else 0
            if cut == 0 and self._size == 0:
                cut = room
            self._write(data[:cut])
            data = data[cut:]
            self.rotate()

    def _write(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            n = os.write(self._fd, view)
            view = view[n:]
            self._size += n

    def rotate(self) -> None:
        """``path`` becomes ``path.1`` (and so on; the oldest beyond ``backups`` goes); a new ``path`` begins."""
        os.close(self._fd)
        if self.backups == 0:
            self.path.unlink(missing_ok=True)
        else:
            Path(f"{self.path}.{self.backups}").unlink(missing_ok=True)
            for n in range(self.backups - 1, 0, -1):
                older = Path(f"{self.path}.{n}")
                if older.exists():
                    older.rename(f"{self.path}.{n + 1}")
            self.path.rename(f"{self.path}.1")
        self._fd = self._open()
        self._size = 0

    def close(self) -> None:
        """Close the current file."""
        os.close(self._fd)


def start_writer(path: Path, *, max_bytes: int, backups: int, cwd: Path) -> subprocess.Popen[bytes]:
    """Start the writer of ``path`` in a session of its own; give its ``stdin`` to spark-submit's output, then
    close it here. ``path`` exists and ``path.writer`` is locked when this returns (the lock is handed to the
    writer), so a reader never sees a missing log nor a writer that has not started yet."""
    path.touch()
    lock = os.open(f"{path}.writer", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)  # shared with the writer through the inherited descriptor
        return subprocess.Popen(
            [sys.executable, "-m", "airflow_arroyo.operators.driver_log", str(path), "--max-bytes", str(int(max_bytes)),
             "--backups", str(int(backups)), "--lock-fd", str(lock)],
            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
            pass_fds=(lock,), cwd=cwd)
    finally:
        os.close(lock)


def main(argv: list[str] | None = None) -> int:
    """Copy stdin into the rotating log until it ends."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("path", type=Path)
    parser.add_argument("--max-bytes", type=int, default=DEFAULT_MAX_BYTES)
    parser.add_argument("--backups", type=int, default=DEFAULT_BACKUPS)
    parser.add_argument("--lock-fd", type=int, default=None,
                        help="an inherited descriptor of PATH.writer already locked for this writer")
    args = parser.parse_args(argv)
    if args.lock_fd is None:
        writing = os.open(f"{args.path}.writer", os.O_WRONLY | os.O_CREAT, 0o644)
        fcntl.flock(writing, fcntl.LOCK_EX)  # released when this process ends
    log = RotatingLog(args.path, args.max_bytes, args.backups)
    stdin = sys.stdin.fileno()
    try:
        while chunk := os.read(stdin, _CHUNK):
            log.write(chunk)
    finally:
        log.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
