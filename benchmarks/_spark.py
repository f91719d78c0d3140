"""The local Spark session every benchmark starts, its ``--conf KEY=VALUE`` option, the confs a product side's
session gets as the driver's would, reading a query's progress, a pipeline driven in this process with the
benchmark playing the Airflow trigger, a run in a process of its own, and the CPU of this process's tree from
``/proc``, in one place."""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pyspark.sql import SparkSession
    from pyspark.sql.streaming import StreamingQuery

    from airflow_arroyo.runtime.driver import PipelineDriver
    from airflow_arroyo.store import EpochStore

# the JVM options `scripts/dev.sh test` runs the suite's JVMs with
SUITE_JAVA_OPTIONS = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"


def conf_pair(text: str) -> tuple[str, str]:
    """``--conf`` values: ``KEY=VALUE`` (argparse names a bad one)."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expects KEY=VALUE, got {text!r}")
    return key, value


def product_confs(confs: Mapping[str, str], *, hadoop_local_fs: bool = False) -> dict[str, str]:
    """``confs`` plus what the driver adds to a local session it starts (``airflow_arroyo.jvm.local_master_conf``);
    ``hadoop_local_fs``: Hadoop's own ``file:`` file system (named, so the provider's is not added)."""
    from airflow_arroyo.jvm import FS_IMPL_CONF, local_master_conf

    out = dict(confs)
    if hadoop_local_fs:
        out.setdefault(FS_IMPL_CONF, "org.apache.hadoop.fs.LocalFileSystem")
    return {**out, **local_master_conf(out)}


def local_session_builder(app: str, *, master: str = "local[2]", driver_memory: str = "2g",
                          confs: Mapping[str, str] | None = None) -> SparkSession.Builder:
    """A builder for the benchmarks' session: ``master``, 2 shuffle partitions, no UI, then ``confs``."""
    from pyspark.sql import SparkSession

    builder = (SparkSession.builder.master(master).appName(app)
               .config("spark.sql.shuffle.partitions", "2").config("spark.default.parallelism", "2")
               .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false")
               .config("spark.driver.memory", driver_memory))
    for key, value in (confs or {}).items():
        builder = builder.config(key, value)
    return builder


def jvm_pid(spark: SparkSession) -> int:
    """The process id of ``spark``'s JVM (the driver's; in local mode every executor's too), for ``jcmd``."""
    jvm = spark.sparkContext._jvm
    assert jvm is not None
    return int(jvm.java.lang.ProcessHandle.current().pid())


def use_stage_checkpoint_manager(spark: SparkSession) -> None:
    """Give ``spark``'s queries the checkpoint file manager a stage's query uses on a local disk
    (``runtime/stage.py``), so a benchmark's own reader query writes its checkpoint as a stage would."""
    from airflow_arroyo.runtime.spark_checkpoint import CHECKPOINT_FILE_MANAGER_CONF, local_checkpoint_file_manager

    manager = local_checkpoint_file_manager(spark)
    if manager is not None:
        spark.conf.set(CHECKPOINT_FILE_MANAGER_CONF, manager)


def batches_with_rows(query: StreamingQuery, count: int) -> list[dict[str, Any]]:
    """The progress (as JSON) of ``query``'s first ``count`` micro-batches with rows, once it has run them.

    The query is stopped then; a failed query's error is raised. Spark keeps the last
    ``spark.sql.streaming.numRecentProgressUpdates`` (100 by default)."""
    try:
        progress: list[dict[str, Any]] = []
        while len(progress) < count:
            if query.exception() is not None:
                raise RuntimeError(str(query.exception()))
            progress = [json.loads(p.json) for p in query.recentProgress if p.numInputRows > 0]
            time.sleep(0.2)
    finally:
        query.stop()
    return progress


def run_in_process(target: Callable[..., None], args: tuple[Any, ...], *, timeout: float, what: str) -> dict[str, Any]:
    """``target(queue, *args)`` in a spawned process of its own (a fresh Spark driver JVM for every run), which puts
    its result (a dict) or its error's text on the queue; the result, or ``SystemExit`` naming ``what`` failed."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    child = ctx.Process(target=target, args=(out, *args))
    child.start()
    got = out.get(timeout=timeout)
    child.join(120)
    if isinstance(got, str):
        raise SystemExit(f"the {what} failed: {got}")
    return dict(got)


class DrivenPipeline:
    """A pipeline's driver run in a thread of this process, an epoch every ``interval`` seconds (the benchmark
    plays the Airflow trigger: a trigger tick every 0.5 s); started and running once the constructor returns."""

    def __init__(self, driver: PipelineDriver, store: EpochStore, interval: float) -> None:
        from airflow_arroyo.core.epochs import CheckpointPolicy

        self.driver = driver
        self.store = store
        self.pid = driver.pipeline_id
        self.failure: list[BaseException] = []
        self._stop = threading.Event()
        self.policy = CheckpointPolicy(interval=interval, timeout=max(60.0, 6 * interval))
        self._thread = threading.Thread(target=self._drive, daemon=True)
        self._thread.start()
        if not self.driver.started.wait(600) or self.failure:
            raise SystemExit(f"the pipeline did not start: {self.failure}")
        self._controller = threading.Thread(target=self._control, daemon=True)
        self._controller.start()

    def _drive(self) -> None:
        try:
            self.driver.run()
        except BaseException as exc:  # noqa: BLE001 - reported by the constructor / stop()
            self.failure.append(exc)

    def _control(self) -> None:
        while not self._stop.wait(0.5):
            self.store.trigger_tick(self.pid, self.policy, triggered_by="benchmark")

    def stop(self) -> None:
        """Stop the ticks, then the pipeline (immediately); a failure of the driver's is raised."""
        self._stop.set()
        self._controller.join()
        self.store.request_stop(self.pid, "immediate")
        self._thread.join(300)
        if self.failure:
            raise SystemExit(f"the pipeline failed: {self.failure[0]}")


@dataclass(frozen=True)
class ProcCpu:
    """One process as ``/proc/<pid>/stat`` and ``cmdline`` show it (CPU in seconds)."""

    parent: int
    own: float  # the process itself: utime + stime
    reaped: float  # its children it has waited for: cutime + cstime
    program: str  # the first word of its command line


def processes() -> dict[int, ProcCpu]:
    """Every process on the machine, by pid (one that ends while it is read is left out)."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[int, ProcCpu] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rpartition(")")[2].split()  # after the command name, which may hold spaces
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                program = f.read().split(b"\0")[0].decode(errors="replace")
        except OSError:
            continue
        out[int(entry)] = ProcCpu(parent=int(fields[1]), own=(int(fields[11]) + int(fields[12])) / tick,
                                  reaped=(int(fields[13]) + int(fields[14])) / tick, program=program)
    return out


def descendants(procs: Mapping[int, ProcCpu], root: int) -> set[int]:
    """``root``'s live descendants in ``procs`` (not ``root`` itself)."""
    found: set[int] = set()
    frontier = [root]
    while frontier:
        p = frontier.pop()
        for child, proc in procs.items():
            if proc.parent == p and child not in found and child != root:
                found.add(child)
                frontier.append(child)
    return found
