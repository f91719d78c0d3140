"""A replaced driver that is still alive cannot write (issue 16): the demo pipeline runs in a driver
subprocess until an epoch completes; that driver is then stalled (SIGSTOP of its process group: a
stalled but live driver, heartbeat paused) while a second driver takes over with ``--takeover`` and
``--restore-from latest``; once the new run is running the old one is resumed, with its micro-batches,
snapshots and commits in flight. Every write it tries after the takeover is refused (counted from its
log), it exits failed naming the run that superseded it, and the new run ends with exactly the
plain-Python output, in every channel and in the Parquet sink: no row lost, none twice."""

from __future__ import annotations

import os
import re
import signal
import time
import uuid
from collections import Counter
from pathlib import Path

import pytest

from airflow_arroyo.core.epochs import EpochState, PipelineState
from airflow_arroyo.examples import OUTPUT_CHANNEL, expected_report
from airflow_arroyo.runtime.channel import Channel, EntryKind
from airflow_arroyo.runtime.layout import StorageLayout
from airflow_arroyo.runtime.sinks.files import committed_files
from airflow_arroyo.store import EpochStore
from airflow_arroyo.testing import CheckpointTicker, channel_row_count, channel_rows, committed_rows, wait_for
from tests.runtime.test_exactly_once import Driver, current
from tests.support import sql

pytestmark = [pytest.mark.spark]

ROWS = 1200
# The old run's sources are paced in time, so that it is still far from the end of its input when its first epoch
# completes and it is stalled: unpaced, they had read 900 of 1,200 rows by then on a quiet machine, all 1,200 in a CI
# run. At 20 rows/s the input lasts 60 s; epoch 1 completed 10-15 s after the sources' start on a quiet machine (the
# sink's and the other stages' queries start first, then the barrier's trip). The new run reads the rest unpaced.
OLD_RUN_RATE = {"rows_per_second": 20}


def stall(store: EpochStore, driver: Driver, pid: str) -> None:
    """SIGSTOP the driver's whole process group, never in the middle of one of its epoch-store
    transactions (a stalled transaction would hold the pipeline's row lock and block the takeover)."""
    for _ in range(50):
        os.killpg(driver.proc.pid, signal.SIGSTOP)
        busy = sql(store, "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s"
                          " AND state LIKE 'idle in transaction%%'", (f"arroyo-driver-{pid}",))[0][0]
        if not busy:
            return
        os.killpg(driver.proc.pid, signal.SIGCONT)
        time.sleep(0.05)
    raise AssertionError("the old driver was always inside a transaction")


def fenced(uri: str) -> int:
    """Entries readers skip: written by the superseded run after the new run's fence."""
    ch = Channel.open(uri)
    return sum(e.kind is EntryKind.FENCED for e in ch.entries(ch.start_position()))


def test_a_live_superseded_driver_cannot_write_and_the_output_stays_exact(store: EpochStore,
                                                                          tmp_path: Path) -> None:
    pid = f"fence-{uuid.uuid4().hex[:6]}"
    storage, sink, logs = tmp_path / "storage", tmp_path / "sink", tmp_path / "logs"
    logs.mkdir()
    layout = StorageLayout.at(str(storage), pid)
    expected = expected_report(ROWS)
    t0 = time.monotonic()
    # the old driver heartbeats once at start only: it can learn of the takeover from its refused writes alone
    old = Driver(dsn=store.dsn, storage=storage, pipeline_id=pid, run_id="run-old", logs=logs, sink=sink, rows=ROWS,
                 env={"ARROYO_HEARTBEAT_INTERVAL": "600"}, args=OLD_RUN_RATE)
    new: Driver | None = None
    controller = CheckpointTicker(store, pid, interval=1.0)
    try:
        controller.__enter__()
        wait_for(lambda: not old.alive() or (current(store, pid) is not None and any(
            e.state is EpochState.COMPLETED and e.run_id == "run-old" for e in store.list_epochs(pid))),
            timeout=480, interval=0.2, what="the old run to complete an epoch")
        assert old.alive(), old.tail()
        stall(store, old, pid)
        stalled_at = channel_row_count(layout.channel_uri("left"))
        assert stalled_at < ROWS, "the old run had read its whole input before the takeover"
        new = Driver(dsn=store.dsn, storage=storage, pipeline_id=pid, run_id="run-new", logs=logs, sink=sink,
                     rows=ROWS)
        wait_for(lambda: not new.alive() or ((rec := current(store, pid)) is not None and rec.run_id == "run-new"
                                             and rec.state is PipelineState.RUNNING),
                 timeout=480, interval=0.2, what="the new run to take over and run")
        assert new.alive(), new.tail()
        restored = store.get_pipeline(pid).restored_from_epoch
        assert restored is not None
        os.killpg(old.proc.pid, signal.SIGCONT)  # the old run wakes up with its work in flight
        assert old.wait(120) == 1, old.tail()
        wait_for(lambda: not new.alive() or channel_row_count(layout.channel_uri(OUTPUT_CHANNEL)) >= len(expected),
                 timeout=300, interval=0.5, what="the new run to reach the end of the input")
        assert new.alive(), new.tail()
    finally:
        controller.stop()
        if old.alive():
            os.killpg(old.proc.pid, signal.SIGCONT)
            old.kill()
        if new is not None and new.alive() and current(store, pid) is None:
            new.kill()
    store.request_stop(pid, "graceful")
    assert new.wait(300) == 0, new.tail()
    elapsed = time.monotonic() - t0

    # The old run: refused, told who superseded it, and it wrote nothing readers see.
    old_log = old.log_path.read_text(errors="replace")
    generation = store.get_pipeline(pid).generation
    assert re.search(rf"run 'run-old' .* superseded by run 'run-new' \(generation {generation}\)", old_log), old.tail()
    # refusals met by a stage's thread are logged with their traceback, the one that stopped the run on stderr
    refused = re.findall(r"(?:FencedError|error): run 'run-old'[^\n]*?; ([^;\n]+?) of generation \d+ was refused",
                         old_log)
    assert refused, old.tail()
    fenced_entries = {c: fenced(layout.channel_uri(c)) for c in ("left", "right", "joined", OUTPUT_CHANNEL)}
    print(f"takeover: stalled at {stalled_at} rows, restored epoch {restored}, generation {generation}; "
          f"old run's refused writes: {Counter(refused)}; fenced entries skipped by readers: {fenced_entries}; "
          f"{elapsed:.0f}s")
    assert not any(e.run_id == "run-old" and e.epoch > restored and e.state is EpochState.COMPLETED
                   for e in store.list_epochs(pid, limit=1000))

    # Exactly once: every channel holds each id once, the output and the sink exactly the plain-Python rows.
    for channel in ("left", "right", "joined"):
        ids = Channel.open(layout.channel_uri(channel)).read_table().column("id").to_pylist()
        assert sorted(ids) == list(range(ROWS)), f"{channel}: {len(ids)} ids ({len(set(ids))} distinct)"
    assert channel_rows(layout.channel_uri(OUTPUT_CHANNEL)) == expected
    assert Counter(committed_rows(sink)) == Counter(expected)  # a plain reader of the folder
    assert len(committed_files(str(sink))) == len(list(sink.glob("*.parquet")))  # no stray file of the old run
