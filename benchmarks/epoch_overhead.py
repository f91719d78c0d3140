"""What do checkpoint epochs cost? The demo pipeline with epochs every 10 s and without, side by side.

One invocation, one SparkSession (local[2]), one throwaway PostgreSQL. Two copies of the demo pipeline
(two unbounded generators -> stream-stream join -> filter) run at the same time in the same Spark
application, one without epochs and one with an epoch every ``--interval`` seconds (the benchmark
plays the Airflow trigger: ``trigger_tick`` every 0.5 s). Running them together means both see the
same machine (on a shared machine, load changes from one minute to the next would otherwise decide the
ratio). After a warm-up, the rows reaching each final channel are counted over ``--rounds`` windows
of ``--duration`` seconds. Prints throughput of both (records/s), their ratio per window and overall
(target >= 0.95), epoch duration p50/p95, bytes new/total per epoch and, per stage, when it
acknowledged after the trigger and how long alignment, the wait for Spark's commit and the copy took.

``--mode alternate`` runs the two one after the other instead (rounds alternate the order: ABBA...).
In concurrent mode the pipelines share Spark's job scheduler and the snapshot threads' CPU, which
pulls the ratio towards 1; on an idle machine alternate mode is the sharper comparison. Figures
measured here are in benchmarks/results/epoch_overhead.md.

    python benchmarks/epoch_overhead.py                 # about 3 minutes
    python benchmarks/epoch_overhead.py --mode alternate --rounds 2 --duration 45   # about 7 minutes
    python benchmarks/epoch_overhead.py --long          # 3 windows of 3 minutes
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)

from _spark import conf_pair, local_session_builder

from airflow_arroyo.core.epochs import CheckpointPolicy, EpochState
from airflow_arroyo.devtools.postgres import ThrowawayPostgres
from airflow_arroyo.examples import OUTPUT_CHANNEL, demo
from airflow_arroyo.runtime.channel import Channel
from airflow_arroyo.runtime.driver import PipelineDriver
from airflow_arroyo.runtime.spark_checkpoint import state_file_version
from airflow_arroyo.store import EpochStore


@dataclass
class RunResult:
    name: str
    epochs: bool
    rows: int
    seconds: float
    source_rows: int
    epoch_durations: list[float] = field(default_factory=list)
    # per epoch: its duration / the cut micro-batches' durations (Spark's triggerExecution) summed along the
    # longest path of the physical graph (issue 12's target: <= 1.5x)
    duration_per_path: list[float] = field(default_factory=list)
    stages: list[str] = field(default_factory=list)  # the physical graph's (fused) stages
    bytes_new: list[int] = field(default_factory=list)
    bytes_total: list[int] = field(default_factory=list)
    # per epoch: bytes of state Spark wrote for it (the .delta/.changelog files of the state versions after the
    # previous completed epoch's cut, summed over stages) and whether Spark also wrote a full .snapshot/.zip then
    state_written: list[int] = field(default_factory=list)
    full_snapshot: list[bool] = field(default_factory=list)
    # per stage, per completed epoch: seconds from trigger to ack, alignment ms, commit wait ms, copy ms
    stage_times: dict[str, list[tuple[float, float, float, float]]] = field(default_factory=dict)

    @property
    def throughput(self) -> float:
        return self.rows / self.seconds if self.seconds else 0.0


def state_written(checkpoint: Path, after: int, upto: int) -> tuple[int, bool]:
    """Bytes of the incremental state files (``.delta``, ``.changelog``) of versions ``after < v <= upto`` in a
    stage's checkpoint, and whether a full snapshot (``.snapshot``, ``.zip``) of such a version is there too."""
    written, full = 0, False
    for p in (checkpoint / "state").rglob("*"):
        parsed = state_file_version(p.name)
        if parsed is None or not after < parsed[0] <= upto:
            continue
        if parsed[1] in ("delta", "changelog"):
            written += p.stat().st_size
        else:
            full = True
    return written, full


def channel_rows(ch: Channel) -> int:
    return sum(e.rows for e in ch.data_entries(ch.start_position(), ch.end_position()))


class Running:
    """One copy of the demo pipeline running in a driver thread (with or without a controller)."""

    def __init__(self, spark: Any, store: EpochStore, storage: Path, *, epochs: bool, interval: float,
                 rows_per_batch: int, max_backlog: int, copy_full_snapshots: bool = False) -> None:
        self.name = "epochs" if epochs else "no-epochs"
        self.spark = spark
        self.storage = storage
        self.epochs = epochs
        self.store = store
        self.pid = f"bench-{self.name}-{uuid.uuid4().hex[:6]}"
        self.interval = interval
        self.driver = PipelineDriver(demo(self.pid, rows=None, rows_per_batch=rows_per_batch), store,
                                     storage_uri=str(storage), spark=spark, max_backlog_entries=max_backlog)
        if copy_full_snapshots:  # the rule before issue 12 item 5: always the newest snapshot, copied when new
            self.driver.snapshots.max_delta_chain = 0
        self.failure: list[BaseException] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._drive, daemon=True)
        self._controller = threading.Thread(target=self._control, daemon=True)
        self.batch_ms: dict[tuple[str, int], float] = {}  # (stage, batch id) -> Spark's triggerExecution

    def sample_batches(self) -> None:
        """Remember the micro-batch durations Spark still lists (its last 100 per query)."""
        prefix = f"{self.pid}."
        for q in self.spark.streams.active:
            if (q.name or "").startswith(prefix):
                for p in q.recentProgress:
                    self.batch_ms[(q.name[len(prefix):], int(p.batchId))] = float(p.durationMs["triggerExecution"])

    def longest_path_ms(self, cut: dict[str, int]) -> float | None:
        """The cut batches' durations summed along the longest path of the physical graph (None: one unknown)."""
        graph, best = self.driver.graph, dict[str, float]()
        for s in graph.stages:  # topological order
            ms = self.batch_ms.get((s.name, cut.get(s.name, -1)))
            if ms is None:
                return None
            best[s.name] = ms + max((best[graph.writers[c]] for c in s.inputs if c in graph.writers), default=0.0)
        return max(best.values(), default=None)

    def _drive(self) -> None:
        try:
            self.driver.run()
        except BaseException as exc:  # noqa: BLE001 - reported by wait_started()/stop()
            self.failure.append(exc)

    def _control(self) -> None:
        policy = CheckpointPolicy(interval=self.interval, timeout=max(60.0, 6 * self.interval))
        ticks = 0
        while not self._stop.wait(0.5):
            self.store.trigger_tick(self.pid, policy, triggered_by="benchmark")
            ticks += 1
            if ticks % 10 == 0:
                self.sample_batches()

    def start(self) -> None:
        self._thread.start()

    def wait_started(self) -> None:
        if not self.driver.started.wait(900) or self.failure:
            raise SystemExit(f"{self.name}: the pipeline did not start: {self.failure}")
        self.report = Channel.open(self.driver.layout.channel_uri(OUTPUT_CHANNEL))
        if self.epochs:
            self._controller.start()

    def rows(self) -> int:
        return channel_rows(self.report)

    def stop(self) -> None:
        self._stop.set()
        if self._controller.is_alive():
            self._controller.join()
        self.store.request_stop(self.pid, "immediate")
        self._thread.join(300)
        if self.failure:
            raise SystemExit(f"{self.name}: the pipeline failed: {self.failure[0]}")

    def epochs_since(self, first_epoch: int, result: RunResult) -> None:
        cut: dict[str, int] = {}  # stage -> state version of the previous completed epoch
        for e in sorted(self.store.list_epochs(self.pid, limit=10_000), key=lambda e: e.epoch):
            if e.state is not EpochState.COMPLETED:
                continue
            acks = self.store.acks(self.pid, e.epoch)
            written, full = 0, False
            for a in acks:
                version = int(a.details.get("batch_id", -1)) + 1
                if e.epoch > first_epoch:
                    w, f = state_written(self.storage / self.driver.layout.checkpoint(a.stage), cut.get(a.stage, 0),
                                         version)
                    written, full = written + w, full or f
                cut[a.stage] = version
            if e.epoch > first_epoch and e.duration_s is not None:
                result.epoch_durations.append(e.duration_s)
                path_ms = self.longest_path_ms({a.stage: int(a.details.get("batch_id", -1)) for a in acks})
                if path_ms:
                    result.duration_per_path.append(e.duration_s * 1000 / path_ms)
                result.bytes_new.append(int(e.bytes_new or 0))
                result.bytes_total.append(int(e.bytes_total or 0))
                result.state_written.append(written)
                result.full_snapshot.append(full)
                for a in acks:
                    result.stage_times.setdefault(a.stage, []).append((
                        (a.acked_at - e.triggered_at).total_seconds(), a.alignment_ms or 0.0,
                        float(a.details.get("commit_wait_ms", 0.0)), float(a.details.get("copy_ms", 0.0))))


def measure(runs: list[Running], *, warmup: float, duration: float, windows: int) -> list[list[RunResult]]:
    """Count final-channel rows of every run over ``windows`` consecutive windows (after a warm-up)."""
    time.sleep(warmup)
    out: list[list[RunResult]] = []
    for w in range(windows):
        t0 = time.monotonic()
        r0 = [r.rows() for r in runs]
        e0 = [r.store.get_pipeline(r.pid).last_epoch for r in runs]
        time.sleep(duration)
        t1 = time.monotonic()
        window = []
        for r, rows0, epoch0 in zip(runs, r0, e0, strict=True):
            r.sample_batches()
            result = RunResult(r.name, r.epochs, r.rows() - rows0, t1 - t0, 0, stages=r.driver.graph.stage_names)
            r.epochs_since(epoch0, result)
            window.append(result)
            print(f"  window {w + 1}: {r.name:10s} {result.throughput:8.0f} records/s ({result.rows} rows in "
                  f"{result.seconds:.0f}s, {len(result.epoch_durations)} epochs completed)", flush=True)
        out.append(window)
    return out


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = max(0, min(len(ordered) - 1, round(q * (len(ordered) - 1))))
    return ordered[k]


def _concurrent(make: Callable[[bool, str], Running], args: argparse.Namespace) -> tuple[list[RunResult], list[float]]:
    """Both pipelines at once, measured in the same windows."""
    results: list[RunResult] = []
    ratios: list[float] = []
    runs = [make(False, "off"), make(True, "on")]
    for r in runs:
        r.start()
    for r in runs:
        r.wait_started()
    windows = measure(runs, warmup=args.warmup, duration=args.duration, windows=args.rounds)
    for r in runs:
        r.stop()
    for window in windows:
        results.extend(window)
        off, on = window
        ratios.append(on.throughput / off.throughput if off.throughput else float("nan"))
    return results, ratios


def _alternate(make: Callable[[bool, str], Running], args: argparse.Namespace) -> tuple[list[RunResult], list[float]]:
    """One pipeline at a time, the order swapped every round."""
    results: list[RunResult] = []
    ratios: list[float] = []
    for rnd in range(args.rounds):
        pair: dict[bool, RunResult] = {}
        for with_epochs in ([False, True] if rnd % 2 == 0 else [True, False]):
            run = make(with_epochs, f"r{rnd}-{int(with_epochs)}")
            run.start()
            run.wait_started()
            (window,) = measure([run], warmup=args.warmup, duration=args.duration, windows=1)
            run.stop()
            pair[with_epochs] = window[0]
            results.append(window[0])
        ratios.append(pair[True].throughput / pair[False].throughput if pair[False].throughput
                      else float("nan"))
    return results, ratios


def _report(results: list[RunResult], ratios: list[float], *, json_too: bool) -> None:
    base = [r for r in results if not r.epochs]
    with_e = [r for r in results if r.epochs]
    # overall: all rows over all measured time (robust to the lumpiness of big micro-batches at window edges)
    tp_base = sum(r.rows for r in base) / sum(r.seconds for r in base)
    tp_e = sum(r.rows for r in with_e) / sum(r.seconds for r in with_e)
    durations = [d for r in with_e for d in r.epoch_durations]
    new = [b for r in with_e for b in r.bytes_new]
    total = [b for r in with_e for b in r.bytes_total]
    ratio = tp_e / tp_base if tp_base else float("nan")
    print()
    print(f"ratio per window/round: {', '.join(f'{r:.3f}' for r in ratios)}")
    print(f"{'':28s}{'without epochs':>16s}{'with epochs':>16s}")
    print(f"{'throughput (records/s)':28s}{tp_base:16.0f}{tp_e:16.0f}")
    print(f"ratio with/without          {ratio:.3f}   (target >= 0.95)")
    print(f"epochs completed            {len(durations)}")
    print(f"epoch duration p50 / p95    {percentile(durations, 0.5):.2f} s / {percentile(durations, 0.95):.2f} s")
    per_path = [x for r in with_e for x in r.duration_per_path]
    if per_path:
        print(f"epoch duration / its cut micro-batches along the longest path: median "
              f"{statistics.median(per_path):.2f}x, max {max(per_path):.2f}x over {len(per_path)} epochs   "
              f"(target <= 1.5x; stages {', '.join(with_e[0].stages)})")
    if new:
        fractions = [n / t for n, t in zip(new, total, strict=True) if t]
        print(f"bytes new / total per epoch median {statistics.median(new):,.0f} / {statistics.median(total):,.0f} "
              f"(new = {100 * statistics.median(fractions):.1f}% of total; last epoch {new[-1]:,} / {total[-1]:,})")
    per_epoch = [(n / w, full) for r in with_e for n, w, full in zip(r.bytes_new, r.state_written, r.full_snapshot,
                                                                      strict=True) if w]
    if per_epoch:
        worst = max(per_epoch)
        with_full = [x for x, full in per_epoch if full]
        print(f"bytes new / state Spark wrote, per epoch: median {statistics.median(x for x, _ in per_epoch):.2f}x, "
              f"max {worst[0]:.2f}x{' (an epoch with a full snapshot)' if worst[1] else ''}   (target <= 1.2x in "
              f"every epoch); {len(with_full)} of {len(per_epoch)} epochs had a full snapshot by Spark"
              + (f", max there {max(with_full):.2f}x" if with_full else ""))
    stage_times: dict[str, list[tuple[float, float, float, float]]] = {}
    for res in with_e:
        for stage, rows in res.stage_times.items():
            stage_times.setdefault(stage, []).extend(rows)
    if stage_times:
        print("where an epoch's time goes, per stage (medians over the completed epochs):")
        print(f"  {'stage':10s}{'acked after':>14s}{'alignment':>12s}{'commit wait':>14s}{'copy':>10s}")
        for stage, rows in sorted(stage_times.items(), key=lambda kv: statistics.median(t[0] for t in kv[1])):
            med = [statistics.median(t[i] for t in rows) for i in range(4)]
            print(f"  {stage:10s}{med[0]:12.2f} s{med[1]:10.0f} ms{med[2]:12.0f} ms{med[3]:8.0f} ms")
    if json_too:
        print(json.dumps({"throughput_without": tp_base, "throughput_with": tp_e, "ratio": ratio,
                          "epoch_p50_s": percentile(durations, 0.5), "epoch_p95_s": percentile(durations, 0.95),
                          "ratios": ratios, "bytes_new": new, "bytes_total": total,
                          "bytes_new_per_state_written": [x for x, _ in per_epoch],
                          "runs": [r.__dict__ for r in results]}, default=str))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--interval", type=float, default=10.0, help="seconds between epochs (default 10)")
    parser.add_argument("--duration", type=float, default=50.0, help="seconds per measured window (default 50)")
    parser.add_argument("--warmup", type=float, default=20.0, help="seconds before measuring (default 20)")
    parser.add_argument("--rounds", type=int, default=2, help="measured windows (concurrent) or rounds of "
                        "(no-epochs, epochs) runs (alternate); default 2")
    parser.add_argument("--mode", choices=("concurrent", "alternate"), default="concurrent")
    parser.add_argument("--rows-per-batch", type=int, default=5000, help="generator rows per micro-batch")
    parser.add_argument("--max-backlog", type=int, default=PipelineDriver.DEFAULT_MAX_BACKLOG,
                        help="flow control: entries a channel may hold unread (default: the driver's)")
    parser.add_argument("--conf", action="append", default=[], type=conf_pair, metavar="KEY=VALUE",
                        help="a Spark setting, repeatable; e.g. spark.sql.streaming.stateStore.maintenanceInterval=5s "
                        "and spark.sql.streaming.stateStore.minDeltasForSnapshot=3 make Spark write full state "
                        "snapshots often (defaults 60s and 10)")
    parser.add_argument("--copy-full-snapshots", action="store_true", help="for comparison: snapshot the newest "
                        ".snapshot Spark wrote (copying it), as before issue 12 item 5 (max_delta_chain=0)")
    parser.add_argument("--long", action="store_true", help="3 windows of 180 s")
    parser.add_argument("--json", action="store_true", help="also print the results as JSON")
    args = parser.parse_args(argv)
    if args.long:
        args.rounds, args.duration = 3, 180.0
    logging.basicConfig(level=logging.WARNING)

    spark = local_session_builder("arroyo-epoch-overhead", confs=dict(args.conf)).getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    with ThrowawayPostgres() as pg, tempfile.TemporaryDirectory(prefix="arroyo-bench-") as tmp:
        store = EpochStore(pg.dsn)
        store.migrate()
        print(f"demo pipeline, local[2], epochs every {args.interval:g}s, mode {args.mode}, "
              f"{args.rounds} x {args.duration:g}s measured", flush=True)

        def make(epochs: bool, tag: str) -> Running:
            return Running(spark, store, Path(tmp) / tag, epochs=epochs, interval=args.interval,
                           rows_per_batch=args.rows_per_batch, max_backlog=args.max_backlog,
                           copy_full_snapshots=args.copy_full_snapshots)

        run = _concurrent if args.mode == "concurrent" else _alternate
        results, ratios = run(make, args)
        store.close()
    spark.stop()

    _report(results, ratios, json_too=args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
