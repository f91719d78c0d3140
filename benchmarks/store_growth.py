"""Store growth over many epochs: does the epoch store stay flat with retention and compaction running?

    .venv/bin/python benchmarks/store_growth.py                     # 10,000 epochs, compaction on and off
    .venv/bin/python benchmarks/store_growth.py --epochs 2000 --modes on

What runs: a throwaway PostgreSQL server with one database per mode (so each mode's table sizes are
its own), and one pipeline per mode driven through the real :class:`~airflow_arroyo.store.EpochStore`
API as drivers and triggers drive it (no Spark): per epoch a forced ``trigger_tick``, per stage a
``record_snapshot`` (``--entries`` files, ``--new`` of them new objects, the rest shared with the
previous epoch, as incremental snapshots are) and an ``ack_epoch`` with a cursor and details. Every
``--retention-every`` epochs :func:`~airflow_arroyo.core.retention.prune_pipeline` runs (keep_last 5) with
``compact_after=0`` (mode ``on``: compact everything behind the previous cleanup run) or ``None``
(mode ``off``); snapshot files are not on disk (the ``fs_for`` seam says each delete succeeded).

Printed every ``--report-every`` epochs per mode: live rows of each ``arroyo_`` table, their
``pg_total_relation_size`` and the total, the rows inserted per epoch since the last report
(``pg_stat_user_tables``) and the bytes the tables grew per epoch; at the end the history checker's
verdict (:mod:`airflow_arroyo.devtools.history`) on what is kept (mode ``on`` only: the checker
replays a whole uncompacted history, which takes it many minutes at 10,000 epochs).
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from datetime import timedelta
from typing import Any

import psycopg2

from airflow_arroyo.core.epochs import CheckpointPolicy, PipelineState, RetentionPolicy
from airflow_arroyo.core.retention import prune_pipeline
from airflow_arroyo.devtools.history import check_history
from airflow_arroyo.devtools.postgres import ThrowawayPostgres
from airflow_arroyo.store import EpochStore, SnapshotEntry

TABLES = ("arroyo_epochs", "arroyo_acks", "arroyo_objects", "arroyo_epoch_objects", "arroyo_history",
          "arroyo_cleanup_runs", "arroyo_history_base")
TICK = CheckpointPolicy(interval=3600)
STAGES = ("source", "join", "sink")


class _NoFiles:
    """The ``fs_for`` seam: the snapshot files are not on disk; every delete 'succeeds'."""

    def delete(self, path: str) -> bool:  # noqa: ARG002
        return True


def _stats(dsn: str) -> dict[str, tuple[int, int, int]]:
    """Per table: (live rows, total bytes, rows inserted ever)."""
    conn = psycopg2.connect(dsn)
    try:
        with conn, conn.cursor() as cur:
            cur.execute("SELECT pg_stat_clear_snapshot()")
            out = {}
            for table in TABLES:
                cur.execute(f"SELECT count(*), pg_total_relation_size(%s) FROM {table}", (table,))  # noqa: S608
                rows, size = cur.fetchone()  # type: ignore[misc]
                cur.execute("SELECT COALESCE(n_tup_ins, 0) FROM pg_stat_user_tables WHERE relname = %s", (table,))
                ins = cur.fetchone()
                out[table] = (int(rows), int(size), int(ins[0]) if ins else 0)
            return out
    finally:
        conn.close()


def run_mode(dsn: str, mode: str, args: argparse.Namespace) -> dict[str, Any]:
    store = EpochStore(dsn)
    pid = f"growth-{mode}"
    store.register_pipeline(pid, stages=list(STAGES), run_id="run-1", storage_uri="file:///nonexistent")
    store.set_pipeline_state(pid, PipelineState.RUNNING)
    compact = timedelta(0) if mode == "on" else None
    shared: dict[str, list[str]] = {s: [] for s in STAGES}
    last = _stats(dsn)
    t0 = time.monotonic()
    print(f"\n== compaction {mode}: {args.epochs} epochs, {len(STAGES)} stages, {args.entries} files per "
          f"stage snapshot ({args.new} new), retention every {args.retention_every} epochs", flush=True)
    print(f"{'epochs':>7} {'rows':>7} {'MB':>7} {'ins/ep':>7} {'B/ep':>8}  " +
          "  ".join(f"{t.removeprefix('arroyo_')}(rows/kB)" for t in TABLES), flush=True)
    summary: list[tuple[int, int, int]] = []
    for i in range(1, args.epochs + 1):
        if i % 50 == 1:
            store.heartbeat(pid, "run-1")  # a live driver (the trigger starts no epoch for a dead one)
        tick = store.trigger_tick(pid, TICK, force=True)
        started = tick.started
        assert started is not None, f"epoch {i}: no epoch started: {tick}"
        n = started.epoch
        for stage in STAGES:
            keys = (shared[stage] + [f"{stage}/{n}/{j}.sst" for j in range(args.new)])[-args.entries:]
            shared[stage] = keys
            store.record_snapshot(pid, n, stage, [SnapshotEntry(rel_path=f"state/{k}", object_key=k, bytes=4096)
                                                  for k in keys])
            store.ack_epoch(pid, n, stage, cursors={"in": n * 100}, alignment_ms=1.0, sync_ms=2.0, async_ms=3.0,
                            bytes_new=4096 * args.new, bytes_total=4096 * len(keys),
                            details={"batch_id": n, "rows": 100})
        if i % args.retention_every == 0:
            prune_pipeline(store, pid, RetentionPolicy(keep_last=5), holder="benchmark", fs_for=lambda _: _NoFiles(),
                           open_channel=lambda _: None, compact_after=compact)
        if i % args.report_every == 0:
            now = _stats(dsn)
            rows = sum(v[0] for v in now.values())
            size = sum(v[1] for v in now.values())
            ins = sum(now[t][2] - last[t][2] for t in TABLES) / args.report_every
            grew = (size - sum(v[1] for v in last.values())) / args.report_every
            print(f"{i:>7} {rows:>7} {size / 2**20:>7.2f} {ins:>7.1f} {grew:>8.0f}  " +
                  "  ".join(f"{now[t][0]}/{now[t][1] // 1024}" for t in TABLES), flush=True)
            summary.append((i, rows, size))
            last = now
    elapsed = time.monotonic() - t0
    ok = True
    if compact is not None:  # uncompacted, 10,000 epochs' history takes the checker many minutes to replay
        history = check_history(dsn, [pid])
        ok = history.ok
        print(f"history checker on what is kept: {'clean' if ok else history.summary()} "
              f"({history.counts['events']} events)", flush=True)
    print(f"{elapsed:.0f} s", flush=True)
    store.close()
    return {"mode": mode, "summary": summary, "history_ok": ok}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=10_000)
    parser.add_argument("--entries", type=int, default=12, help="files per stage snapshot")
    parser.add_argument("--new", type=int, default=2, help="new objects per stage snapshot")
    parser.add_argument("--retention-every", type=int, default=100)
    parser.add_argument("--report-every", type=int, default=1000)
    parser.add_argument("--modes", default="on,off")
    args = parser.parse_args(argv)
    logging.getLogger("airflow_arroyo.core.retention").setLevel(logging.ERROR)  # no channels: one warning per run
    results = []
    with ThrowawayPostgres() as pg:
        for mode in args.modes.split(","):
            dsn = pg.create_database(f"growth_{mode}")
            EpochStore(dsn).migrate()
            results.append(run_mode(dsn, mode, args))
    print("\nside by side (epochs: live rows / MB of the arroyo_ tables)")
    for rows in zip(*[r["summary"] for r in results], strict=True):
        print(f"{rows[0][0]:>7}  " + "  ".join(f"{r['mode']}: {row[1]:>7} / {row[2] / 2**20:6.2f}"
                                                for r, row in zip(results, rows, strict=True)))
    return 0 if all(r["history_ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
