"""A throwaway Spark standalone cluster on loopback, started from the pip ``pyspark``.

A master and N workers, each a JVM started with the ``spark-class`` script that the pip ``pyspark``
ships (``SPARK_HOME`` is the installed ``pyspark/`` folder): no Spark distribution needed. Everything
listens on 127.0.0.1 only, on ports the JVMs pick themselves (``--port 0``; the master's address is
read from its log), with the master's REST submission server off (Python applications cannot use
standalone cluster mode anyway, see ``docs/clusters.md``). Each process is the leader of its own
process group, so :meth:`kill_worker` and :meth:`stop` take the JVM and everything it started
(executors, their Python workers) with one signal.

    with StandaloneCluster(workers=2, cores=1, memory="1g") as cluster:
        print(cluster.master_url)    # spark://127.0.0.1:PORT
        cluster.kill_worker(0)       # SIGKILL a worker and its executors

Used by the cluster tests (``tests/cluster/``).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from airflow_arroyo.jvm import spark_home

__all__ = ["StandaloneCluster", "spark_home"]

_MASTER_URL = re.compile(r"Starting Spark master at (spark://[\w.\-]+:\d+)")
_REGISTERED = "Successfully registered with master"


@dataclass
class _Daemon:
    name: str
    proc: subprocess.Popen[bytes]
    log: Path

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self, sig: int = signal.SIGKILL) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, sig)  # started as a session leader: its group id is its pid

    def log_text(self) -> str:
        try:
            return self.log.read_text(errors="replace")
        except OSError:
            return ""


class StandaloneCluster:
    """A Spark standalone master and ``workers`` workers on 127.0.0.1, in a private folder."""

    def __init__(self, workers: int = 2, *, cores: int = 1, memory: str = "1g", base_dir: str | Path | None = None,
                 start_timeout: float = 120.0) -> None:
        if workers < 1 or cores < 1:
            raise ValueError("a cluster needs at least one worker with at least one core")
        self.spark_home = spark_home()
        self.workers_wanted = workers
        self.cores = cores
        self.memory = memory
        self.start_timeout = start_timeout
        self._owns_dir = base_dir is None
        self.base_dir = Path(base_dir) if base_dir else Path(tempfile.mkdtemp(prefix="arroyo-spark-cluster-"))
        self.master: _Daemon | None = None
        self.workers: list[_Daemon] = []
        self.master_url = ""

    # ------------------------------------------------------------------ life cycle

    def _env(self, work_dir: Path) -> dict[str, str]:
        env = dict(os.environ)
        env.update({
            "SPARK_HOME": str(self.spark_home),
            "SPARK_LOCAL_IP": "127.0.0.1",
            "SPARK_LOCAL_HOSTNAME": "127.0.0.1",  # what executors and the UI advertise
            "SPARK_LOG_DIR": str(work_dir),
            "SPARK_WORKER_DIR": str(work_dir),
            # the master's REST submission server (default port 6066, fixed) stays off
            "SPARK_MASTER_OPTS": "-Dspark.master.rest.enabled=false",
            "SPARK_DAEMON_MEMORY": "256m",
        })
        return env

    def _spawn(self, name: str, main_class: str, *args: str) -> _Daemon:
        folder = self.base_dir / name
        folder.mkdir(parents=True, exist_ok=True)
        log = folder / f"{name}.log"
        with open(log, "ab") as out:
            proc = subprocess.Popen(
                [str(self.spark_home / "bin" / "spark-class"), main_class, *args],
                env=self._env(folder), cwd=folder, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True, close_fds=True,
            )
        return _Daemon(name, proc, log)

    def _wait(self, daemon: _Daemon, what: str, found: re.Pattern[str] | str) -> str:
        deadline = time.monotonic() + self.start_timeout
        while True:
            text = daemon.log_text()
            if isinstance(found, str):
                if found in text:
                    return found
            elif (m := found.search(text)) is not None:
                return m.group(1)
            if not daemon.alive():
                raise RuntimeError(f"Spark {daemon.name} exited before {what}; its log:\n{text[-3000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"Spark {daemon.name}: no {what} after {self.start_timeout:g}s; its log:\n"
                                   f"{text[-3000:]}")
            time.sleep(0.2)

    def start(self) -> None:
        try:
            self.master = self._spawn("master", "org.apache.spark.deploy.master.Master",
                                      "--host", "127.0.0.1", "--port", "0", "--webui-port", "0")
            self.master_url = self._wait(self.master, "master address", _MASTER_URL)
            for i in range(self.workers_wanted):  # all JVMs start at once, then each must register
                self._spawn_worker(i)
            for i in range(self.workers_wanted):
                self._wait_registered(i, 0)
        except BaseException:
            self.stop()
            raise

    def start_worker(self, index: int) -> None:
        """Start worker ``index`` (again, e.g. after :meth:`kill_worker`) and wait until it registered."""
        offset = self._spawn_worker(index)
        self._wait_registered(index, offset)

    def _spawn_worker(self, index: int) -> int:
        name = f"worker{index}"
        work = self.base_dir / name / "work"
        work.mkdir(parents=True, exist_ok=True)
        log = self.base_dir / name / f"{name}.log"
        offset = log.stat().st_size if log.exists() else 0  # a restarted worker appends to its log
        worker = self._spawn(name, "org.apache.spark.deploy.worker.Worker",
                             "--host", "127.0.0.1", "--port", "0", "--webui-port", "0",
                             "--cores", str(self.cores), "--memory", self.memory, "--work-dir", str(work),
                             self.master_url)
        while len(self.workers) <= index:
            self.workers.append(worker)
        self.workers[index] = worker
        return offset

    def _wait_registered(self, index: int, offset: int) -> None:
        worker = self.workers[index]
        deadline = time.monotonic() + self.start_timeout
        while _REGISTERED not in worker.log_text()[offset:]:
            if not worker.alive() or time.monotonic() > deadline:
                raise RuntimeError(f"Spark {worker.name} did not register with {self.master_url}; its log:\n"
                                   f"{worker.log_text()[-3000:]}")
            time.sleep(0.2)

    def kill_worker(self, index: int) -> None:
        """SIGKILL worker ``index`` and its process group (the executors it launched, their Python workers)."""
        worker = self.workers[index]
        worker.kill(signal.SIGKILL)
        worker.proc.wait(30)

    def executor_pids(self, index: int) -> list[int]:
        """Pids of the executor JVMs worker ``index`` launched (children of its JVM)."""
        parent = self.workers[index].proc.pid
        pids = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                stat = (entry / "stat").read_text()
                cmdline = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            fields = stat[stat.rfind(")") + 2:].split()
            if int(fields[1]) == parent and b"CoarseGrainedExecutorBackend" in cmdline:
                pids.append(int(entry.name))
        return pids

    def logs(self) -> str:
        """The tail of every daemon's log (for failure messages)."""
        parts = []
        for daemon in [d for d in [self.master, *self.workers] if d is not None]:
            parts.append(f"--- {daemon.name} ---\n{daemon.log_text()[-2000:]}")
        return "\n".join(parts)

    def stop(self) -> None:
        """Kill every process group (workers first, then the master) and remove the folder if it is ours."""
        for daemon in [*self.workers, *([self.master] if self.master else [])]:
            daemon.kill(signal.SIGTERM)
        for daemon in [*self.workers, *([self.master] if self.master else [])]:
            try:
                daemon.proc.wait(15)
            except subprocess.TimeoutExpired:
                daemon.kill(signal.SIGKILL)
                daemon.proc.wait(15)
            daemon.kill(signal.SIGKILL)  # whatever is left in its group (executors)
        self.workers.clear()
        self.master = None
        if self._owns_dir:
            shutil.rmtree(self.base_dir, ignore_errors=True)

    def __enter__(self) -> StandaloneCluster:
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
