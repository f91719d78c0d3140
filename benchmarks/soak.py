"""What grows while a pipeline runs for a long time? A pipeline supervised as in production, sampled.

One driver (local[2], the provider's confs), one throwaway PostgreSQL: the demo's shape with bounded state
(:func:`bounded_pipeline`: two paced, unbounded generators, a stream-stream join under watermarks and a filter
fused in one query, the report channel, an exactly-once Parquet sink outside the pipeline's storage; the demo
itself keeps every row in its join's state, by design, so its heap and storage grow with its input), with an
epoch every ``--interval`` seconds (the benchmark plays the Airflow trigger: ``trigger_tick`` every 0.5 s) and
retention every ``--prune-every`` seconds (``prune_pipeline``, keep the last 3 completed epochs, as the
retention DAG does). Every ``--every`` seconds it samples, after a warm-up:

* the driver JVM: its live heap (what a full collection keeps, by class: ``GC.class_histogram``), Spark's status
  store entries (SQL executions, jobs, stages: what ``spark.sql.ui.retainedExecutions``, ``spark.ui.retainedJobs``
  and ``spark.ui.retainedStages`` bound), metaspace, threads (and by name), open files, the paths its
  delete-on-exit list holds and the files in Spark's block manager folders;
* this Python process (the driver loop): live objects after ``gc.collect()`` and the blocks Python's small-object
  allocator holds (strings, numbers and the other objects ``gc`` does not track), resident memory, glibc's heap in
  use and the free memory it holds, pyarrow's default pool, its resident memory by kind of mapping (glibc's
  main heap, its other arenas, other anonymous memory, mapped files), the driver's releases
  of free memory after each epoch and their total time (``--no-release`` turns them off), threads, open files;
* Spark's Python workers below the driver's JVM: processes and their resident memory;
* the pipeline's storage (checkpoints, channels, snapshots: what retention bounds) in files and bytes, the
  epoch store's database size, and its snapshot object references (rows) against the epochs not yet pruned and
  those of the newest epoch;
* the epochs completed and the micro-batches the queries ran (the rates the rest is read against: a quantity kept
  per batch grows with the second, which ``--trigger-interval`` changes).

Prints, per quantity, the first and last sample, the least-squares slope per hour over the samples of
the whole window and of its second half, side by side (a quantity that levels off has a second-half slope
well below the whole window's; one that leaks keeps the same slope), and the mean of each half (a bounded
sawtooth, such as the snapshots' delta chains, has a slope over any short window but equal means). Then the
driver JVM's threads by name and its live heap by class that grew over the second half, the store's tables
and the storage's fullest folders with the files each gained over the second half.
Figures measured here are in benchmarks/results/soak.md; what bounds each quantity, in docs/runtime.md ("Supervised for
months").

    python benchmarks/soak.py                       # 15 minutes measured after 2 of warm-up
    python benchmarks/soak.py --duration 3600       # an hour
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import logging
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
import tracemalloc
import uuid
from collections import Counter, deque
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pyarrow

os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)

from _spark import conf_pair, jvm_pid, local_session_builder, product_confs

from airflow_arroyo.core.epochs import CheckpointPolicy, RetentionPolicy
from airflow_arroyo.core.retention import DEFAULT_COMPACT_AFTER, prune_pipeline
from airflow_arroyo.devtools.postgres import ThrowawayPostgres
from airflow_arroyo.runtime import Pipeline
from airflow_arroyo.runtime import stage as stage_mod
from airflow_arroyo.runtime.channel import Channel
from airflow_arroyo.runtime.driver import PipelineDriver
from airflow_arroyo.store import EpochStore
from airflow_arroyo.testing import generator_source

_HISTOGRAM_ROW = re.compile(r"^\s*\d+:\s+(\d+)\s+(\d+)\s+(\S+)", re.M)
KEEP_LAST = 3  # completed epochs retention keeps
_HISTOGRAM_TOTAL = re.compile(r"^Total\s+\d+\s+(\d+)", re.M)
_THREAD_NAME = re.compile(r'^"(.*?)" ', re.M)
# Spark's status store (kept with the UI off too): what spark.sql.ui.retainedExecutions, spark.ui.retainedJobs and
# spark.ui.retainedStages bound
_STATUS_CLASSES = {"executions": "org.apache.spark.sql.execution.ui.SQLExecutionUIData",
                   "jobs": "org.apache.spark.status.JobDataWrapper",
                   "stages": "org.apache.spark.status.StageDataWrapper"}
_META_USED = re.compile(r"Metaspace\s+used (\d+)K")


def proc_status(pid: int, field: str) -> int:
    """A number from ``/proc/<pid>/status`` (``VmRSS`` in kB, ``Threads``)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    return 0


def open_files(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


def malloc_bytes() -> tuple[int, int]:
    """The C library's heap of this process: bytes in use (``uordblks`` + ``hblkhd``) and free bytes it holds
    (``fordblks``), from ``mallinfo2``; (-1, -1) where the C library has none. Native memory the driver's RSS holds
    that no Python object counts: what a rising RSS with flat live objects is made of."""
    try:
        mallinfo2 = ctypes.CDLL(None).mallinfo2
    except (OSError, AttributeError):
        return -1, -1
    mallinfo2.restype = _MallInfo2
    info = mallinfo2()
    return info.uordblks + info.hblkhd, info.fordblks


_STAT = re.compile(r"^# (bytes in allocated blocks|arenas allocated current)\s*=\s*([\d,]+)$", re.M)


def pymalloc_bytes() -> tuple[int, int]:
    """Python's small-object allocator (pymalloc) in this process: bytes in its blocks in use and its arenas'
    count, from ``sys._debugmallocstats()`` (which writes to the C stderr: file descriptor 2 goes to a temporary
    file for the call, and what another thread writes there meanwhile is lost). Live bytes rising with arenas
    tells live small objects from fragmentation (arenas rising, bytes flat); (0, 0) without pymalloc."""
    with tempfile.TemporaryFile() as out:
        sys.stderr.flush()
        saved = os.dup(2)
        try:
            os.dup2(out.fileno(), 2)
            sys._debugmallocstats()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        out.seek(0)
        found = {k: int(v.replace(",", "")) for k, v in _STAT.findall(out.read().decode(errors="replace"))}
    return found.get("bytes in allocated blocks", 0), found.get("arenas allocated current", 0)


_ARENA_ALIGN = 64 << 20  # glibc's non-main arenas are heaps of up to 64 MB, each aligned to its size


def resident_by_mapping(pid: int) -> dict[str, int]:
    """The process's resident bytes by kind of mapping, from ``/proc/<pid>/smaps``: glibc's main heap
    (``[heap]``), its other arenas (anonymous mappings at 64 MB-aligned addresses), other anonymous memory (Python's
    small-object arenas, which the kernel merges into larger mappings when adjacent, thread stacks, large
    allocations glibc maps on their own, other allocators' pools) and mapped files. By address, so approximate: a
    merged mapping may start at an aligned address."""
    kinds = {"heap": 0, "arenas": 0, "other anonymous": 0, "files": 0}
    kind = "files"
    try:
        lines = Path(f"/proc/{pid}/smaps").read_text().splitlines()
    except OSError:
        return {k: -1 for k in kinds}
    for line in lines:
        fields = line.split()
        if not fields:
            continue
        if "-" in fields[0] and len(fields) >= 5 and not fields[0].endswith(":"):
            name = fields[5] if len(fields) > 5 else ""
            start = int(fields[0].split("-")[0], 16)
            if name == "[heap]":
                kind = "heap"
            elif not name and start % _ARENA_ALIGN == 0:
                kind = "arenas"
            elif not name or name.startswith("["):
                kind = "other anonymous"
            else:
                kind = "files"
        elif fields[0] == "Rss:":
            kinds[kind] += int(fields[1]) * 1024
    return kinds


def heap_after_gc(pid: int) -> tuple[int, int, Counter[str], Counter[str]]:
    """The JVM's live heap: bytes of the objects a full collection keeps, by class (``GC.class_histogram`` runs
    one and counts what survived at that moment; ``GC.heap_info`` after ``GC.run`` would also count what the busy
    driver allocated in between), and its metaspace (classes: Spark generates code per query and per batch).
    Returns (live bytes, metaspace bytes, bytes by class, instances by class)."""
    out = subprocess.run(["jcmd", str(pid), "GC.class_histogram"], capture_output=True, text=True,
                         check=True).stdout
    sizes: Counter[str] = Counter()
    counts: Counter[str] = Counter()
    for match in _HISTOGRAM_ROW.finditer(out):
        counts[match.group(3)] += int(match.group(1))
        sizes[match.group(3)] += int(match.group(2))
    total = _HISTOGRAM_TOTAL.search(out)
    info = subprocess.run(["jcmd", str(pid), "GC.heap_info"], capture_output=True, text=True, check=True).stdout
    meta = _META_USED.search(info)
    if total is None or meta is None:
        raise RuntimeError(f"unexpected GC.class_histogram / GC.heap_info: {out[-300:]} {info[-300:]}")
    return int(total.group(1)), int(meta.group(1)) * 1024, sizes, counts


def thread_groups(pid: int) -> Counter[str]:
    """The JVM's threads by name with the numbers masked (``Thread-N``, ``Executor task launch worker for task
    N.N ...``): which kind of thread a rising count is."""
    out = subprocess.run(["jcmd", str(pid), "Thread.print"], capture_output=True, text=True, check=True).stdout
    return Counter(re.sub(r"[0-9a-f]*[0-9][0-9a-f]*", "N", m.group(1)) for m in _THREAD_NAME.finditer(out))


def python_workers(jvm: int) -> tuple[int, int]:
    """Spark's Python worker processes (daemons and their forks) below the JVM ``jvm`` and their resident memory
    in kB; other Spark applications' workers on the machine are not counted."""
    parents: dict[int, int] = {}
    workers: list[int] = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            parents[int(entry)] = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
        except (OSError, IndexError, ValueError):  # gone meanwhile
            continue
        if b"pyspark.daemon" in cmdline or b"pyspark.worker" in cmdline:
            workers.append(int(entry))
    count = rss = 0
    for pid in workers:
        ancestor = parents.get(pid)
        while ancestor not in (None, 0, 1, jvm):
            ancestor = parents.get(ancestor)
        if ancestor == jvm:
            count += 1
            rss += proc_status(pid, "VmRSS")
    return count, rss


def tree(path: Path) -> tuple[int, int]:
    """Files and bytes under ``path``."""
    files = size = 0
    for folder, _, names in os.walk(path):
        for name in names:
            try:
                size += os.stat(os.path.join(folder, name)).st_size
                files += 1
            except OSError:
                continue
    return files, size


def largest_folders(path: Path, depth: int = 4, top: int = 8) -> list[tuple[str, int, int]]:
    """The folders ``depth`` levels below ``path`` holding the most files: (folder, files, bytes)."""
    totals: dict[str, list[int]] = {}
    for folder, _, names in os.walk(path):
        parts = Path(folder).relative_to(path).parts[:depth]
        key = "/".join(parts) or "."
        entry = totals.setdefault(key, [0, 0])
        for name in names:
            try:
                entry[1] += os.stat(os.path.join(folder, name)).st_size
                entry[0] += 1
            except OSError:
                continue
    ranked = sorted(totals.items(), key=lambda kv: -kv[1][0])[:top]
    return [(k, v[0], v[1]) for k, v in ranked]


def slope_per_hour(points: list[tuple[float, float]]) -> float:
    """The least-squares slope of (seconds, value) points, per hour."""
    if len(points) < 2:
        return float("nan")
    n = len(points)
    mean_t = sum(t for t, _ in points) / n
    mean_v = sum(v for _, v in points) / n
    var = sum((t - mean_t) ** 2 for t, _ in points)
    return float("nan") if var == 0 else 3600 * sum((t - mean_t) * (v - mean_v) for t, v in points) / var


def bounded_pipeline(pipeline_id: str, *, rate: int, rows_per_batch: int, sink: str) -> Pipeline:
    """The demo's shape with bounded state, as a pipeline meant to run for months has: two paced generators
    (event time follows wall-clock time), a stream-stream join on ``id`` within 2 s of event time under 5 s
    watermarks (Spark drops what no later row can match), a filter, and an exactly-once Parquet sink behind
    the report channel. Fused by the graph into one query, plus the sink's (the benchmark prints the plan)."""
    ms_per_row = max(1, 1000 // rate)

    def left(spark: Any) -> Any:
        return generator_source(spark, seed=1, keys=100, total_rows=None, rows_per_batch=rows_per_batch,
                                rows_per_second=rate, ms_per_row=ms_per_row)

    def right(spark: Any) -> Any:
        df = generator_source(spark, seed=2, keys=100, total_rows=None, rows_per_batch=rows_per_batch,
                              rows_per_second=rate, ms_per_row=ms_per_row)
        return df.selectExpr("id AS rid", "value AS right_value", "ts AS rts")

    def join(lhs: Any, rhs: Any) -> Any:
        from pyspark.sql import functions as F

        # the watermarks in the stage that needs them: a stage's query has its own, none crosses a channel
        lhs, rhs = lhs.withWatermark("ts", "5 seconds"), rhs.withWatermark("rts", "5 seconds")
        cond = F.expr("id = rid AND rts BETWEEN ts - INTERVAL 2 SECONDS AND ts + INTERVAL 2 SECONDS")
        return lhs.join(rhs, cond).selectExpr("id", "key", "value AS left_value", "right_value")

    def report(joined: Any) -> Any:
        return joined.where("(left_value + right_value) % 7 <> 0")

    p = Pipeline(pipeline_id, description="the demo's shape with bounded state (soak benchmark)")
    joined = p.stage("joined", join, inputs=[p.source("left", left), p.source("right", right)])
    p.stage("report", report, inputs=[joined])
    p.sink("report_files", inputs=["report"], format="parquet", options={"path": sink}, chain=False)
    return p


def soak_compact_after(args: argparse.Namespace) -> str:
    return "the product's default" if args.compact_after is None else f"{args.compact_after:g}s"


class Soak:
    """The pipeline, its controller and retention threads, and the sampler."""

    def __init__(self, spark: Any, store: EpochStore, dsn: str, storage: Path, sink: Path, args: argparse.Namespace):
        self.spark, self.store, self.dsn, self.storage, self.args = spark, store, dsn, storage, args
        self.pid = f"soak-{uuid.uuid4().hex[:6]}"
        self.compact_after = (DEFAULT_COMPACT_AFTER if args.compact_after is None
                              else timedelta(seconds=args.compact_after))
        pipeline = bounded_pipeline(self.pid, rate=args.rate, rows_per_batch=args.rows_per_batch, sink=str(sink))
        self.driver = PipelineDriver(pipeline, store, storage_uri=str(storage), spark=spark)
        if args.no_release:
            self.driver.release_memory = None
        self.failure: list[BaseException] = []
        self.stop = threading.Event()
        self.prunes = 0
        # the driver process's live objects by type at the latest sample and at the first of the second half: only
        # these two are kept, since a history of them (one per sample) grew this very process's memory
        self.types: Counter[str] = Counter()
        self.types_half: Counter[str] | None = None
        self.containers_half: dict[int, tuple[type, int]] = {}
        # the same for the JVM's threads by name and its live heap by class (bytes)
        self.threads: Counter[str] = Counter()
        self.threads_half: Counter[str] | None = None
        self.classes: Counter[str] = Counter()
        self.classes_half: Counter[str] | None = None
        self.folders_half: dict[str, int] = {}
        self.traced_half: tracemalloc.Snapshot | None = None
        self.traced_end: tracemalloc.Snapshot | None = None
        self.traced_thirds: list[tracemalloc.Snapshot] = []  # at a third and two thirds of the window
        self.jvm_pid = jvm_pid(spark)
        # Spark's block manager folders (shuffle files: its ContextCleaner deletes them once their shuffle is
        # collected, and the samples' full collections make that prompt)
        local_dirs = spark._jvm.org.apache.spark.SparkEnv.get().blockManager().diskBlockManager().localDirs()
        self.local_dirs = [Path(str(d.getPath())) for d in local_dirs]

    def _guard(self, body: Callable[[], object]) -> Callable[[], None]:
        def run() -> None:
            try:
                body()
            except BaseException as exc:  # noqa: BLE001 - reported by the main thread
                self.failure.append(exc)
                self.stop.set()
        return run

    def _control(self) -> None:
        policy = CheckpointPolicy(interval=self.args.interval, timeout=max(60.0, 6 * self.args.interval))
        while not self.stop.wait(0.5):
            self.store.trigger_tick(self.pid, policy, triggered_by="soak")

    def _retain(self) -> None:
        while not self.stop.wait(self.args.prune_every):
            prune_pipeline(self.store, self.pid, RetentionPolicy(keep_last=KEEP_LAST), holder="soak",
                           compact_after=self.compact_after)
            self.prunes += 1

    def completed_epochs(self) -> int:
        newest = self.store.latest_completed_epoch(self.pid)
        return 0 if newest is None else newest.epoch

    def db_size(self) -> int:
        import psycopg2

        with psycopg2.connect(self.dsn) as conn, conn.cursor() as cur:
            cur.execute("SELECT pg_database_size(current_database())")
            row = cur.fetchone()
        conn.close()
        return int(row[0]) if row else 0

    def references(self) -> tuple[int, int, int]:
        """(snapshot object references, epochs not pruned, references of the newest epoch that has any): the rows
        retention bounds, counted exactly, and what one epoch adds (it follows the delta chains' sawtooth)."""
        import psycopg2

        with psycopg2.connect(self.dsn) as conn, conn.cursor() as cur:
            cur.execute("SELECT (SELECT count(*) FROM arroyo_epoch_objects WHERE pipeline_id = %(p)s),"
                        " (SELECT count(*) FROM arroyo_epochs WHERE pipeline_id = %(p)s AND state <> 'pruned'),"
                        " (SELECT count(*) FROM arroyo_epoch_objects WHERE pipeline_id = %(p)s AND epoch ="
                        "  (SELECT max(epoch) FROM arroyo_epoch_objects WHERE pipeline_id = %(p)s))",
                        {"p": self.pid})
            row = cur.fetchone()
        conn.close()
        return (int(row[0]), int(row[1]), int(row[2])) if row else (0, 0, 0)

    def channel_entries(self) -> dict[str, float]:
        """Per channel: the entries the epochs retention keeps need (from the oldest cursor the newest three
        completed epochs resume at), and the entries before that, which the next retention run truncates. Both
        bounded means the channel is: the first by the entries of three epochs, the second by a retention
        interval's worth."""
        import psycopg2

        with psycopg2.connect(self.dsn) as conn, conn.cursor() as cur:
            cur.execute("SELECT c.key, min((c.value)::text::bigint) FROM arroyo_acks a"
                        " CROSS JOIN LATERAL jsonb_each(a.cursors) c WHERE a.pipeline_id = %(p)s AND a.epoch IN"
                        " (SELECT epoch FROM arroyo_epochs WHERE pipeline_id = %(p)s AND state = 'completed'"
                        "  ORDER BY epoch DESC LIMIT %(keep)s) GROUP BY c.key", {"p": self.pid, "keep": KEEP_LAST})
            low = {str(r[0]): int(r[1]) for r in cur.fetchall()}
        conn.close()
        out: dict[str, float] = {}
        for name, uri in sorted(self.store.get_pipeline(self.pid).channels.items()):
            channel = Channel.open(uri)
            start, end = channel.start_position(), channel.end_position()
            kept_from = max(start, low.get(name, start) - 1)  # retention keeps the entry before the cursor
            out[f"channel {name} entries kept epochs need"] = end - kept_from
            out[f"channel {name} entries to truncate"] = kept_from - start
        return out

    def micro_batches(self) -> int:
        """Micro-batches every query of the pipeline has run (Spark's batch ids, from their latest progress): what
        a quantity kept per batch rather than per epoch grows with."""
        return sum(int(q.lastProgress["batchId"]) + 1 for q in self.spark.streams.active if q.lastProgress)

    def tables(self) -> list[tuple[str, int, int, int]]:
        """The epoch store's tables, largest first: (table, live rows, dead rows, bytes with indexes)."""
        import psycopg2

        with psycopg2.connect(self.dsn) as conn, conn.cursor() as cur:
            cur.execute("SELECT relname, n_live_tup, n_dead_tup, pg_total_relation_size(relid) FROM "
                        "pg_stat_user_tables ORDER BY pg_total_relation_size(relid) DESC LIMIT 8")
            rows = [(str(r[0]), int(r[1]), int(r[2]), int(r[3])) for r in cur.fetchall()]
        conn.close()
        return rows

    def sample(self) -> dict[str, float]:
        gc.collect()
        self.types = Counter(f"{type(o).__module__}.{type(o).__qualname__}" for o in gc.get_objects())
        me = os.getpid()
        workers, workers_rss = python_workers(self.jvm_pid)
        files, size = tree(self.storage)
        pruner = self.driver.socket_paths
        heap, metaspace, self.classes, instances = heap_after_gc(self.jvm_pid)
        self.threads = thread_groups(self.jvm_pid)
        references, unpruned, newest_references = self.references()
        in_use, held_free = malloc_bytes()
        small_bytes, arenas = pymalloc_bytes()
        resident = resident_by_mapping(me)
        return {
            "epochs completed": self.completed_epochs(),
            "micro-batches run": self.micro_batches(),
            "JVM heap after full GC (MB)": heap / 1e6,
            "JVM metaspace (MB)": metaspace / 1e6,
            **{f"JVM status store {kind}": instances[name] for kind, name in _STATUS_CLASSES.items()},
            "JVM threads": proc_status(self.jvm_pid, "Threads"),
            "JVM open files": open_files(self.jvm_pid),
            "JVM delete-on-exit paths": pruner.registered() if pruner is not None else -1,
            "driver Python objects": len(gc.get_objects()),
            "driver pymalloc blocks": sys.getallocatedblocks(),
            "driver pymalloc bytes in use (MB)": small_bytes / 1e6,
            "driver pymalloc arenas": arenas,
            "driver Python RSS (MB)": proc_status(me, "VmRSS") / 1e3,
            "driver malloc in use (MB)": in_use / 1e6,
            "driver malloc free held (MB)": held_free / 1e6,
            "driver pyarrow pool (MB)": pyarrow.total_allocated_bytes() / 1e6,
            **{f"driver RSS {kind} (MB)": size / 1e6 for kind, size in resident.items()},
            "driver memory releases": self.driver.memory_releases,
            "driver release time (ms)": self.driver.memory_release_seconds * 1e3,
            "driver Python threads": threading.active_count(),
            "driver Python open files": open_files(me),
            "Python workers": workers,
            "Python workers RSS (MB)": workers_rss / 1e3,
            "Spark local dir files": sum(tree(d)[0] for d in self.local_dirs),
            "storage files": files,
            "storage (MB)": size / 1e6,
            "epoch store DB (MB)": self.db_size() / 1e6,
            "epoch object references": references,
            "newest epoch's references": newest_references,
            "epochs not pruned": unpruned,
            **self.channel_entries(),
        }

    def run(self) -> list[tuple[float, dict[str, float]]]:
        threads = [threading.Thread(target=self._guard(self.driver.run), daemon=True)]
        threads[0].start()
        if not self.driver.started.wait(900) or self.failure:
            raise SystemExit(f"the pipeline did not start: {self.failure}")
        for body in (self._control, self._retain):
            threads.append(threading.Thread(target=self._guard(body), daemon=True))
            threads[-1].start()
        if self.stop.wait(self.args.warmup):
            raise SystemExit(f"failed during the warm-up: {self.failure}")
        if self.args.tracemalloc:
            tracemalloc.start(self.args.tracemalloc)
        samples: list[tuple[float, dict[str, float]]] = []
        start = time.monotonic()
        while True:
            samples.append((time.monotonic() - start, self.sample()))
            thirds = len(self.traced_thirds)
            if tracemalloc.is_tracing() and thirds < 2 and samples[-1][0] >= self.args.duration * (thirds + 1) / 3:
                self.traced_thirds.append(tracemalloc.take_snapshot())
            if self.types_half is None and samples[-1][0] >= self.args.duration / 2:
                self.types_half, self.threads_half, self.classes_half = self.types, self.threads, self.classes
                self.containers_half = container_lengths()
                self.folders_half = {f: n for f, n, _ in largest_folders(self.storage, top=1_000_000)}
                if tracemalloc.is_tracing():
                    self.traced_half = tracemalloc.take_snapshot()
            print(f"{samples[-1][0]:7.0f}s " + ", ".join(f"{k} {v:,.1f}" for k, v in samples[-1][1].items()),
                  flush=True)
            left = self.args.duration - (time.monotonic() - start)
            if left <= 0 or self.stop.wait(min(self.args.every, left)):
                break
        if tracemalloc.is_tracing():
            self.traced_end = tracemalloc.take_snapshot()
            tracemalloc.stop()
        if self.containers_half:  # while the driver still holds what it holds
            print_container_growth(self.containers_half)
        self.stop.set()
        self.store.request_stop(self.pid, "immediate")
        threads[0].join(300)
        if self.failure:
            raise SystemExit(f"the pipeline failed: {self.failure[0]}")
        return samples


_CONTAINERS = (list, dict, set, deque)


def _containers() -> dict[int, Any]:
    """Every built-in container (lists, dicts, sets, deques) that ``gc`` tracks or that a tracked object holds: a
    dict holding only strings and numbers is not tracked itself, so it is found through its holder."""
    found: dict[int, Any] = {}
    for o in gc.get_objects():
        for x in (o, *gc.get_referents(o)):
            if isinstance(x, _CONTAINERS):
                found[id(x)] = x
    return found


def container_lengths() -> dict[int, tuple[type, int]]:
    """The length of every built-in container, by id. What a container holds may be objects ``gc`` does not track
    (floats, ints, strings, small tuples): a container that grows shows here while the count of tracked objects
    stays flat."""
    return {i: (type(o), len(o)) for i, o in _containers().items()}


def owner_of(obj: object, ignore: set[int]) -> str:
    """Who holds ``obj``: an attribute of an object, a module's global, a key of a dict, or the holder's type."""
    holders = [r for r in gc.get_referrers(obj) if id(r) not in ignore]
    for ref in holders:
        if isinstance(ref, dict):
            key = next((k for k, v in ref.items() if v is obj), None)
            module = next((m.__name__ for m in list(sys.modules.values()) if getattr(m, "__dict__", None) is ref),
                          None)
            if module is not None:
                return f"{module}.{key}"
            holder = next((h for h in gc.get_referrers(ref) if getattr(h, "__dict__", None) is ref), None)
            if holder is not None:
                return f"{type(holder).__module__}.{type(holder).__qualname__}.{key}"
            return f"a dict's item {str(key)[:60]!r}"
        attrs = getattr(ref, "__dict__", None)
        if isinstance(attrs, dict) and not isinstance(ref, type):
            key = next((k for k, v in attrs.items() if v is obj), None)
            if key is not None:
                return f"{type(ref).__module__}.{type(ref).__qualname__}.{key}"
    kinds = sorted({type(r).__qualname__ for r in holders})
    return "held by " + ", ".join(kinds[:4]) if kinds else "held from C"


def print_container_growth(half: dict[int, tuple[type, int]], top: int = 10) -> None:
    """The containers that grew most since ``half`` (same id and type: an id reused by a new container of the
    same type can show as growth), with who holds them."""
    now = _containers()
    lengths = {i: len(o) for i, o in now.items()}
    grown = sorted(((lengths[i] - half[i][1], i) for i, o in now.items()
                    if i in half and half[i][0] is type(o) and lengths[i] > half[i][1]), reverse=True)[:top]
    ignore = {id(now), id(half)}
    print("\nthe built-in containers that grew most over the second half (items gained, items at the end, holder):")
    for more, i in grown:
        print(f"  {more:+8,} {lengths[i]:9,}  {type(now[i]).__qualname__:10} {owner_of(now[i], ignore)[:100]}")


def _untraced() -> list[tracemalloc.Filter]:
    """The allocations of tracemalloc itself and of this benchmark, left out of what the driver grew."""
    return [tracemalloc.Filter(False, tracemalloc.__file__), tracemalloc.Filter(False, __file__)]


def print_traced_growth(before: tracemalloc.Snapshot, after: tracemalloc.Snapshot, top: int = 12) -> None:
    """Where the Python memory still allocated grew between two snapshots, by allocating traceback."""
    ignore = _untraced()
    after, before = after.filter_traces(ignore), before.filter_traces(ignore)
    # a growth spread over many tracebacks shows first by the file that allocated it
    print("\nPython memory still allocated over the second half, by the file that allocated it (largest changes):")
    for stat in sorted(after.compare_to(before, "filename"), key=lambda s: -abs(s.size_diff))[:top]:
        print(f"  {stat.size_diff / 1e3:+10,.1f} KB in {stat.count_diff:+,} blocks  {stat.traceback[0].filename}")
    stats = after.compare_to(before, "traceback")
    print(f"\nPython memory still allocated that grew most over the second half (of "
          f"{sum(s.size_diff for s in stats) / 1e6:+,.2f} MB in all), by where it was allocated:")
    for stat in stats[:top]:
        print(f"  {stat.size_diff / 1e3:+10,.1f} KB in {stat.count_diff:+,} blocks")
        for line in stat.traceback.format(limit=6, most_recent_first=True):
            print(f"      {line}")


def print_steady_growth(snapshots: list[tracemalloc.Snapshot], top: int = 12) -> None:
    """Where the Python memory still allocated grew in every interval between the snapshots: work in flight at
    one snapshot shows as growth in one interval only; a holder that keeps gathering grows in each."""
    ignore = _untraced()
    snaps = [s.filter_traces(ignore) for s in snapshots]
    steps = [{st.traceback: st.size_diff for st in after.compare_to(before, "traceback")}
             for before, after in zip(snaps, snaps[1:], strict=False)]
    steady = sorted(((sum(step[tb] for step in steps), tb) for tb in steps[0]
                     if all(step.get(tb, 0) > 0 for step in steps)), key=lambda kv: -kv[0])
    print(f"\nPython memory still allocated that grew in each of {len(steps)} intervals "
          f"({sum(n for n, _ in steady) / 1e6:+,.2f} MB in all), by where it was allocated:")
    for size, tb in steady[:top]:
        print(f"  {size / 1e3:+10,.1f} KB ({', '.join(f'{step[tb] / 1e3:+,.1f}' for step in steps)})")
        for line in tb.format(limit=8, most_recent_first=True):
            print(f"      {line}")


def report(samples: list[tuple[float, dict[str, float]]], prunes: int) -> None:
    seconds = samples[-1][0]
    half = [s for s in samples if s[0] >= seconds / 2]
    print(f"\n{len(samples)} samples over {seconds / 60:.1f} min, {prunes} retention runs; slopes per hour "
          "(least squares), the whole window and its second half:")
    # a quantity that follows a sawtooth (the snapshots' delta chains, Spark's cleanup) has a slope over any window
    # shorter than a few of its teeth, however bounded it is: the means of the two halves tell it from a leak
    print(f"{'quantity':28} {'first':>12} {'last':>12} {'per hour':>12} {'2nd half':>12} {'2nd / whole':>12} "
          f"{'1st mean':>12} {'2nd mean':>12}")
    first_half = [s for s in samples if s[0] < seconds / 2]
    for key in samples[0][1]:
        whole = slope_per_hour([(t, v[key]) for t, v in samples])
        second = slope_per_hour([(t, v[key]) for t, v in half])
        ratio = second / whole if whole and abs(whole) > 1e-9 else float("nan")
        means = [sum(v[key] for _, v in part) / len(part) if part else float("nan") for part in (first_half, half)]
        print(f"{key:28} {samples[0][1][key]:12,.1f} {samples[-1][1][key]:12,.1f} {whole:12,.1f} {second:12,.1f} "
              f"{ratio:12.2f} {means[0]:12,.1f} {means[1]:12,.1f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=900.0, help="seconds measured (default 900)")
    parser.add_argument("--warmup", type=float, default=120.0, help="seconds before the first sample (default 120)")
    parser.add_argument("--every", type=float, default=30.0, help="seconds between samples (default 30)")
    parser.add_argument("--interval", type=float, default=5.0, help="seconds between epochs (default 5)")
    parser.add_argument("--prune-every", type=float, default=30.0, help="seconds between retention runs (default 30)")
    parser.add_argument("--compact-after", type=float, default=None, metavar="SECONDS",
                        help="retention compacts the store's rows it released longer ago than this (default: the "
                             "product's, 7 days: none within a soak)")
    parser.add_argument("--rate", type=int, default=500, help="rows per second per source (default 500)")
    parser.add_argument("--rows-per-batch", type=int, default=500, help="generator rows per micro-batch")
    parser.add_argument("--trigger-interval", type=float, default=None, metavar="SECONDS",
                        help="seconds between micro-batch starts of the query that reads the sources (default: "
                             f"the product's, {stage_mod.DEFAULT_TRIGGER_INTERVAL:g}; the channel's reader keeps "
                             f"its {stage_mod.DEFAULT_CHANNEL_TRIGGER_INTERVAL:g})")
    parser.add_argument("--no-release", action="store_true",
                        help="the driver keeps the C library's free memory (no malloc_trim after each epoch)")
    parser.add_argument("--conf", action="append", default=[], type=conf_pair, metavar="KEY=VALUE",
                        help="a Spark setting, repeatable")
    parser.add_argument("--tracemalloc", type=int, default=0, metavar="FRAMES",
                        help="trace the driver process's Python allocations after the warm-up (FRAMES frames each) "
                             "and print where the memory still held grew over the second half (slows the driver)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    if args.trigger_interval is not None:
        stage_mod.DEFAULT_TRIGGER_INTERVAL = args.trigger_interval

    spark = local_session_builder("arroyo-soak", confs=product_confs(dict(args.conf))).getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    with ThrowawayPostgres() as pg, tempfile.TemporaryDirectory(prefix="arroyo-soak-") as tmp:
        store = EpochStore(pg.dsn)
        store.migrate()
        print(f"bounded_pipeline, local[2], {args.rate} rows/s per source, epochs every {args.interval:g}s, retention "
              f"every {args.prune_every:g}s (keep {KEEP_LAST}); {args.duration:g}s sampled every {args.every:g}s after "
              f"{args.warmup:g}s; compaction after {soak_compact_after(args)}; micro-batches every "
              f"{stage_mod.DEFAULT_TRIGGER_INTERVAL:g}s at most (sources; channels "
              f"{stage_mod.DEFAULT_CHANNEL_TRIGGER_INTERVAL:g}s); free memory released after each epoch: "
              f"{not args.no_release}", flush=True)
        soak = Soak(spark, store, pg.dsn, Path(tmp) / "storage", Path(tmp) / "sink", args)
        # where to look while it runs (psql, jstack, a listing): the cluster is trust-only on 127.0.0.1
        print(f"epoch store {pg.dsn}, storage {tmp}/storage, driver JVM pid {soak.jvm_pid}", flush=True)
        print(soak.driver.pipeline.explain(spark), flush=True)
        samples = soak.run()
        report(samples, soak.prunes)
        grown = (soak.types - (soak.types_half or Counter())).most_common(8)
        print("\nthe driver's live objects that grew most over the second half, by type:")
        for name, more in grown:
            print(f"  {name:70} +{more:,}")
        print("\nthe driver JVM's threads by name at the end, and their change over the second half:")
        half_threads = soak.threads_half or Counter()
        by_change = sorted(soak.threads.items(), key=lambda kv: (-abs(kv[1] - half_threads[kv[0]]), -kv[1]))
        for name, count in by_change[:12]:
            print(f"  {name[:90]:90} {count:5,} {count - half_threads[name]:+5,}")
        half_classes = soak.classes_half or Counter()
        print("\nthe driver JVM's live heap that grew most over the second half, by class (MB):")
        grown_classes = sorted(((n, b - half_classes[n]) for n, b in soak.classes.items()), key=lambda kv: -kv[1])
        for name, more in grown_classes[:10]:
            print(f"  {name[:90]:90} {more / 1e6:+8.2f}")
        if soak.traced_half is not None and soak.traced_end is not None:
            print_traced_growth(soak.traced_half, soak.traced_end)
            if soak.traced_thirds:
                print_steady_growth([*soak.traced_thirds, soak.traced_end])
        print("\nthe epoch store's largest tables at the end (live rows, dead rows, MB):")
        for table, live, dead, size in soak.tables():
            print(f"  {table:40} {live:10,} {dead:10,} {size / 1e6:10.1f}")
        print("\nthe storage's fullest folders at the end (files, MB, files gained over the second half):")
        for folder, files, size in largest_folders(Path(tmp) / "storage"):
            print(f"  {folder:70} {files:8,} {size / 1e6:10.1f} {files - soak.folders_half.get(folder, 0):+8,}")
        store.close()
    spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
