"""What does a commit gate cost? The same pipeline with an ungated file sink and with a gated one whose check passes
at once, one after the other in one invocation (rounds alternate the order: ABBA...).

One SparkSession (local[2]), one throwaway PostgreSQL. The pipeline: a generator source (``--rows`` rows in
micro-batches of ``--batch``, as fast as Spark runs them) into an exactly-once JSON file sink; epochs every
``--interval`` seconds (the benchmark plays the Airflow trigger). The gated run's sink has ``Gate(policy="hold")``
and a checker thread plays the Airflow task: it polls the pending gates every ``--check-poll`` seconds and passes
each at once (no check runs: what is measured is the gate's own cost, not a check's).

Prints, per run and as gated/ungated ratios:

* throughput to visibility: rows / seconds from the driver's start until every row is committed (what a reader
  of the folder can see);
* latency to visibility: per sink commit, from the epoch's completion (``arroyo_epochs.ended_at``) to the commit's
  record (``arroyo_sink_commits.committed_at``), p50 and p95; for the gated run this includes opening the gate,
  the checker's poll, the verdict and the driver's poll of the verdicts (``GateKeeper.poll_interval``).

Figures measured here are in benchmarks/results/gates.md.

    python benchmarks/gates.py                      # 2 rounds, about 3 minutes
    python benchmarks/gates.py --rounds 4 --rows 60000
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)

from _spark import conf_pair, local_session_builder

from airflow_arroyo.core.gates import Gate, GateState, record_verdict
from airflow_arroyo.devtools.postgres import ThrowawayPostgres
from airflow_arroyo.runtime.driver import PipelineDriver
from airflow_arroyo.runtime.pipeline import Pipeline
from airflow_arroyo.runtime.sinks.files import committed_through
from airflow_arroyo.store import EpochStore
from airflow_arroyo.testing import CheckpointTicker, DriverThread, generator_source, wait_for


@dataclass
class Run:
    gated: bool
    rows: int
    seconds: float
    latencies: list[float]  # seconds from an epoch's completion to its sink commit

    @property
    def throughput(self) -> float:
        return self.rows / self.seconds


def pipeline(pid: str, out: Path, rows: int, batch: int, gated: bool) -> Pipeline:
    p = Pipeline(pid)
    src = p.source("src", lambda spark: generator_source(spark, total_rows=rows, rows_per_batch=batch,
                                                          partitions=2))
    p.sink("out", [src], format="json", options={"path": str(out)}, gate=Gate(timeout=None) if gated else None)
    return p


class Passer:
    """Plays the Airflow check task: passes every pending gate of the sink at once."""

    def __init__(self, store: EpochStore, pid: str, poll: float) -> None:
        self.store, self.pid, self.poll = store, pid, poll
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Passer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)

    def _run(self) -> None:
        while not self._stop.wait(self.poll):
            for g in self.store.list_gates(self.pid, sink="out", states=[GateState.PENDING]):
                record_verdict(self.store, self.pid, "out", g.epoch, passed=True, by="benchmark")


def committed_batches(out: Path) -> int:
    try:
        return committed_through(str(out)) + 1
    except FileNotFoundError:
        return 0


def one_run(spark: Any, store: EpochStore, tmp: Path, args: argparse.Namespace, gated: bool) -> Run:
    pid = f"gates-{'on' if gated else 'off'}-{uuid.uuid4().hex[:6]}"
    out = tmp / pid / "out"
    driver = PipelineDriver(pipeline(pid, out, args.rows, args.batch, gated), store,
                            storage_uri=str(tmp / pid / "storage"), spark=spark)
    batches = -(-args.rows // args.batch)
    passer = Passer(store, pid, args.check_poll)
    t0 = time.monotonic()
    thread = DriverThread(driver).start()
    with passer, CheckpointTicker(store, pid, interval=args.interval):
        wait_for(lambda: thread.error or committed_batches(out) >= batches, timeout=1200,
                 what=f"{batches} batches committed")
        seconds = time.monotonic() - t0
    store.request_stop(pid, "immediate")
    thread.join(300)
    ended = {e.epoch: e.ended_at for e in store.list_epochs(pid, limit=10_000) if e.ended_at is not None}
    latencies = [(c.committed_at - ended[c.epoch]).total_seconds() for c in store.sink_commits(pid, limit=10_000)
                 if c.epoch in ended]
    return Run(gated, args.rows, seconds, latencies)


def pct(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[int(q) - 1] if len(values) >= 2 else (values[0] if values else 0.0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2, help="pairs of runs (order alternates: ABBA...)")
    ap.add_argument("--rows", type=int, default=40_000)
    ap.add_argument("--batch", type=int, default=1_000, help="rows per micro-batch")
    ap.add_argument("--interval", type=float, default=2.0, help="seconds between epochs")
    ap.add_argument("--check-poll", type=float, default=0.1, help="seconds between the checker's looks")
    ap.add_argument("--conf", type=conf_pair, action="append", default=[], metavar="KEY=VALUE")
    args = ap.parse_args(argv)
    spark = local_session_builder("arroyo-gates", confs=dict(args.conf)).getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    runs: list[Run] = []
    with ThrowawayPostgres() as pg, tempfile.TemporaryDirectory(prefix="arroyo-bench-") as tmp:
        store = EpochStore(pg.dsn)
        store.migrate()
        one_run(spark, store, Path(tmp), argparse.Namespace(**{**vars(args), "rows": args.batch * 4}), False)  # warm-up
        for r in range(args.rounds):
            order = (False, True) if r % 2 == 0 else (True, False)
            for gated in order:
                run = one_run(spark, store, Path(tmp), args, gated)
                runs.append(run)
                print(f"round {r + 1} {'gated  ' if gated else 'ungated'}: {run.throughput:,.0f} rows/s "
                      f"({run.seconds:.1f} s), visibility p50 {pct(run.latencies, 50):.2f} s "
                      f"p95 {pct(run.latencies, 95):.2f} s ({len(run.latencies)} commits)", flush=True)
        store.close()
    spark.stop()
    off = [r for r in runs if not r.gated]
    on = [r for r in runs if r.gated]
    tput_off = sum(r.rows for r in off) / sum(r.seconds for r in off)
    tput_on = sum(r.rows for r in on) / sum(r.seconds for r in on)
    lat_off = [x for r in off for x in r.latencies]
    lat_on = [x for r in on for x in r.latencies]
    summary = {
        "throughput_rows_per_s": {"ungated": round(tput_off), "gated": round(tput_on),
                                  "ratio_gated_over_ungated": round(tput_on / tput_off, 3)},
        "visibility_latency_s": {"ungated_p50": round(pct(lat_off, 50), 3), "gated_p50": round(pct(lat_on, 50), 3),
                                 "ungated_p95": round(pct(lat_off, 95), 3), "gated_p95": round(pct(lat_on, 95), 3),
                                 "added_p50": round(pct(lat_on, 50) - pct(lat_off, 50), 3)},
        "settings": {k: v for k, v in vars(args).items() if k != "conf"},
    }
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
