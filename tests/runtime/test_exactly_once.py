"""Exactly-once under SIGKILL: the whole driver (Python, JVM, Python workers) is killed at moments chosen
by watching the epoch store and the channels: while it restores and starts its queries, while stages
align, while a snapshot is being copied, between epochs, at a random time. Each time it restarts with
``--restore-from latest``; at the end the final channel must hold exactly the rows computed in plain
Python: none lost, none twice; so must the demo's exactly-once Parquet sink (whose folder, read after
every kill, never shows a row twice), and so must its two exactly-once PostgreSQL sinks (an append table
of the report and an upsert table of per-key totals, in a database of their own), which, read after every
kill, hold exactly what some completed epoch's cut holds. The test plays the checkpoint controller
(``trigger_tick`` in a loop).

The S3 proof runs the demo's **fused** form (operator chaining, issue 12: both sources, the join and the
filter in one query, one channel before the sinks), the local proof the unfused one: both must end with
the same plain-Python output.

Set ``ARROYO_TEST_SEED`` to replay a run's choice of moments, ``ARROYO_TEST_KILLS`` for a longer campaign
(default: one kill per kind of moment).
"""

from __future__ import annotations

import functools
import json
import os
import random
import re
import time
import uuid
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from airflow_arroyo.core.epochs import EpochState, PipelineState
from airflow_arroyo.examples import (
    OUTPUT_CHANNEL,
    PG_REPORT_DDL,
    PG_TOTALS_DDL,
    expected_report,
    expected_totals,
    totals_of,
)
from airflow_arroyo.runtime.channel import Channel
from airflow_arroyo.runtime.layout import StorageLayout
from airflow_arroyo.store import EpochStore
from airflow_arroyo.testing import CheckpointTicker, channel_row_count, channel_rows, committed_rows, wait_for
from tests.runtime.pipeline_support import DEMO_ROWS, Driver, check_barriers_follow_cuts, current, settled_files
from tests.support import sql

pytestmark = [pytest.mark.spark, pytest.mark.slow]

ROWS = DEMO_ROWS
S3_ROWS = 600  # the S3 run: fewer rows, one kill (every request goes through moto's HTTP server)
STAGES = ("left", "right", "joined", "report")
FUSED = "~".join(STAGES)  # the fused form's one physical stage before the sinks (runtime/plan.py names it)
MOMENTS = ("between", "starting", "aligning", "snapshot", "random")


def moment_condition(moment: str, store: EpochStore, pid: str, run_id: str, layout: StorageLayout,
                     completed_before: int, rng: random.Random, *, chaining: bool = False) -> Callable[[], bool]:
    """A condition that is true at the moment to kill."""
    # the first stage, and the channel it writes: its barrier there and no ack yet = its snapshot is copied
    head, head_channel = (FUSED, OUTPUT_CHANNEL) if chaining else ("left", "left")
    head_uri = layout.channel_uri(head_channel)
    physical = 2 if chaining else len(STAGES)  # physical stages before the sink (fused: one) + the sink's
    random_at: list[float] = []

    def ours_running() -> bool:
        rec = current(store, pid)
        return rec is not None and rec.run_id == run_id and rec.state is PipelineState.RUNNING

    def starting() -> bool:  # registered, restoring or starting its queries, not yet running
        rec = current(store, pid)
        return rec is not None and rec.run_id == run_id and rec.state is PipelineState.REGISTERED

    def aligning() -> bool:
        e = store.in_flight_epoch(pid)
        if e is None or e.run_id != run_id:
            return False
        n = len(store.acks(pid, e.epoch))
        return 1 <= n < physical

    def snapshot() -> bool:  # after an epoch of this run completed, so that there is one to restore from
        e = store.in_flight_epoch(pid)
        latest = store.latest_completed_epoch(pid)
        if e is None or e.run_id != run_id or latest is None or latest.epoch <= completed_before:
            return False
        acked = {a.stage for a in store.acks(pid, e.epoch)}
        return (head not in acked and Channel.exists(head_uri)
                and Channel.open(head_uri).find_barrier(e.epoch) is not None)

    def between() -> bool:
        latest = store.latest_completed_epoch(pid)
        return (latest is not None and latest.epoch > completed_before and latest.run_id == run_id
                and store.in_flight_epoch(pid) is None)

    def at_random() -> bool:
        if not ours_running():
            return False
        if not random_at:
            random_at.append(time.monotonic() + rng.uniform(1.0, 12.0))
        return time.monotonic() >= random_at[0]

    chosen = {"starting": starting, "aligning": aligning, "snapshot": snapshot, "between": between,
              "random": at_random}[moment]
    if moment in ("aligning", "snapshot", "between"):
        # armed a random while after the run started processing, so that kills (and the epochs
        # restored from) spread over the input instead of clustering at start-up
        delay = rng.uniform(0.0, 6.0)
        armed: list[float] = []

        def after_delay() -> bool:
            if not armed:
                if not ours_running():
                    return False
                armed.append(time.monotonic() + delay)
            return time.monotonic() >= armed[0] and chosen()

        return lambda: current(store, pid) is not None and after_delay()
    return lambda: current(store, pid) is not None and chosen()  # nothing to watch before it registers


def pg_tables_match_a_completed_epoch(store: EpochStore, pid: str, report_uri: str, sink_dsn: str) -> int | None:
    """The epoch whose cut the append table holds (exactly the report channel's rows before that epoch's
    barrier; -1: empty), provided the upsert table also holds the totals of some completed epoch's cut (the
    sinks commit one after the other: a kill between them leaves one an epoch ahead); else ``None``."""
    report = Counter(sql(sink_dsn, "SELECT id, key, left_value, right_value, total FROM report_rows"))
    totals = {k: (n, t) for k, n, t in sql(sink_dsn, "SELECT key, n, total FROM key_totals")}
    channel = Channel.open(report_uri)
    cuts: dict[int, list[tuple[Any, ...]]] = {-1: []}
    for e in store.list_epochs(pid, limit=1000, states=[EpochState.COMPLETED]):
        pos = channel.find_barrier(e.epoch)
        if pos is not None:
            cuts[e.epoch] = [tuple(r.values()) for r in channel.read_table(end=pos).to_pylist()]
    if not any(totals_of(rows) == totals for rows in cuts.values()):
        return None
    return next((epoch for epoch, rows in cuts.items() if Counter(rows) == report), None)


def test_sigkill_at_random_moments_then_restore_latest_is_exactly_once(store: EpochStore, pg_server: Any,
                                                                        tmp_path: Path) -> None:
    """With the demo's Parquet sink and its two PostgreSQL sinks (in a database that is not the epoch
    store's)."""
    seed = int(os.environ.get("ARROYO_TEST_SEED", random.randrange(1 << 30)))
    rng = random.Random(seed)
    print(f"ARROYO_TEST_SEED={seed}")
    # every kind of moment once, in random order after a first "between" (so that every later run has
    # a completed epoch to restore from)
    rest = list(MOMENTS[1:])
    rng.shuffle(rest)
    # a longer campaign on request (the 20 kills: ARROYO_TEST_KILLS=20): more moments drawn at random
    rest += [rng.choice(MOMENTS) for _ in range(int(os.environ.get("ARROYO_TEST_KILLS", len(MOMENTS))) - len(MOMENTS))]
    sink_dsn = pg_server.create_database(f"sink_{uuid.uuid4().hex[:10]}")
    sql(sink_dsn, PG_REPORT_DDL.format(table="report_rows"))
    sql(sink_dsn, PG_TOTALS_DDL.format(table="key_totals"))
    kill_and_restore(store, tmp_path, [MOMENTS[0], *rest], rng, storage=tmp_path / "storage", rows=ROWS,
                     sink_dsn=sink_dsn)


def test_sigkill_with_everything_on_s3_is_exactly_once(store: EpochStore, tmp_path: Path, bucket: str,
                                                       s3_server: Any) -> None:
    """The same proof with every byte of state on S3 (moto's server): channels and snapshots (pyarrow, from the
    driver and the executors), Spark's own checkpoints (``s3a://``, derived from the storage URI: hadoop-aws,
    written by the provider's abortable-stream checkpoint file manager) and the Parquet sink (Spark's batch writer
    into its pending folder through ``s3a://``, committed with pyarrow). The driver gets only the AWS SDK's
    environment, as a user gives it; the S3A settings come from it (``airflow_arroyo.jvm.s3a_conf``). Killed while
    the snapshots of an epoch are copied to S3, after an earlier epoch completed, then restored from S3.
    (One kill: every moment is covered by the local proof above; this one is about object storage, and
    about the fused form: the sources, the join and the filter compiled into one query.)"""
    seed = int(os.environ.get("ARROYO_TEST_SEED", random.randrange(1 << 30)))
    print(f"ARROYO_TEST_SEED={seed}")
    storage, sink = f"{bucket}/storage", f"{bucket}/report_files"
    kill_and_restore(store, tmp_path, ["snapshot"], random.Random(seed), storage=storage, rows=S3_ROWS,
                     env=s3_server.env, chaining=True, sink=sink)
    keys = s3_server.keys(storage)
    assert any("/snapshots/objects/" in k for k in keys)
    # Spark's checkpoints are on S3, each stage's live folder named by its pointer (restores switched them), and
    # written without temporary objects (Hadoop's are hidden names: '.<name>.<uuid>.tmp')
    assert any(k.endswith("/checkpoint.json") for k in keys)
    assert any("/checkpoint" in k and "/commits/" in k for k in keys)
    assert not [k for k in keys if k.rsplit("/", 1)[-1].endswith(".tmp")]
    assert not list(tmp_path.rglob("checkpoint*"))  # nothing of a checkpoint on the local disk
    # the sink's committed files are on S3, outside its hidden folder
    assert any(k.endswith(".parquet") and "/_" not in k for k in s3_server.keys(sink))


def test_sigkill_with_snapshots_on_s3_and_checkpoints_local_restores_from_the_live_files(
        store: EpochStore, tmp_path: Path, bucket: str, s3_server: Any) -> None:
    """Local recovery under a SIGKILL: channels and snapshots on S3, Spark's checkpoints on the local disk
    (``--checkpoint-uri``). Each restart on this machine takes the files its stages' live checkpoints still hold
    from there (hashed through the link), which a kill can leave in any state; the output is exact, and the logs
    show files reused."""
    seed = int(os.environ.get("ARROYO_TEST_SEED", random.randrange(1 << 30)))
    print(f"ARROYO_TEST_SEED={seed}")
    kill_and_restore(store, tmp_path, ["snapshot"], random.Random(seed), storage=f"{bucket}/storage", rows=S3_ROWS,
                     checkpoints=tmp_path / "checkpoints", env=s3_server.env, chaining=True)
    rebuilt = [line for log in (tmp_path / "logs").glob("*.log") for line in log.read_text().splitlines()
               if "checkpoint rebuilt and verified" in line]
    assert rebuilt, "no restore rebuilt a checkpoint"
    reused = [int(m.group(1)) for line in rebuilt if (m := re.search(r"(\d+) reused from the live", line))]
    assert reused and max(reused) > 0, rebuilt


def kill_and_restore(store: EpochStore, tmp_path: Path, plan: list[str], rng: random.Random, *, storage: Path | str,
                     rows: int, checkpoints: Path | None = None, env: dict[str, str] | None = None,
                     sink_dsn: str | None = None, chaining: bool = False, sink: Path | str | None = None) -> None:
    """Kill the driver at each moment of ``plan`` and restart it from the latest epoch, then run to the end
    and stop gracefully; every channel and the sinks (with ``sink_dsn``, the PostgreSQL ones too) must hold
    the plain-Python result exactly once."""
    pid = f"eo-{uuid.uuid4().hex[:8]}"
    logs = tmp_path / "logs"
    logs.mkdir()
    sink = sink or tmp_path / "report_files"  # the demo's exactly-once Parquet sink
    layout = StorageLayout.at(str(storage), pid)
    expected = expected_report(rows)
    start = functools.partial(Driver, dsn=store.dsn, storage=storage, pipeline_id=pid, logs=logs, sink=sink, rows=rows,
                              checkpoints=checkpoints, env=env, sink_dsn=sink_dsn, chaining=chaining)
    kills: list[dict[str, Any]] = []
    inner_channels = () if chaining else ("left", "right", "joined")  # the fused form compiles them away
    with CheckpointTicker(store, pid, interval=1.5, timeout=60.0, tick=0.2):
        for k, moment in enumerate(plan):
            run_id = f"run-{k}-{moment}"
            latest = store.latest_completed_epoch(pid) if current(store, pid) else None
            completed_before = latest.epoch if latest else 0
            driver = start(run_id=run_id)
            condition = moment_condition(moment, store, pid, run_id, layout, completed_before, rng, chaining=chaining)
            try:
                wait_for(lambda: condition() or not driver.alive(), timeout=300, interval=0.01,  # noqa: B023
                         what=f"moment {moment!r} in run {run_id}")
            except AssertionError:
                driver.kill()
                raise AssertionError(f"{moment!r} never happened in {run_id}:\n{driver.tail()}") from None
            assert driver.alive(), f"driver {run_id} ended by itself:\n{driver.tail()}"
            driver.kill()
            rec = store.get_pipeline(pid)
            visible = committed_rows(sink)
            kills.append({"run": run_id, "moment": moment, "restored_from": rec.restored_from_epoch,
                          "completed_before": completed_before,
                          "report_rows": channel_row_count(layout.channel_uri(OUTPUT_CHANNEL)),
                          "sink_rows": len(visible)})
            # read-committed: what the sink shows after a kill holds no duplicate and nothing unexpected
            assert not Counter(visible) - Counter(expected), f"sink after killing {run_id}: rows twice or unexpected"
            if sink_dsn:
                pg_epoch = pg_tables_match_a_completed_epoch(store, pid, layout.channel_uri(OUTPUT_CHANNEL), sink_dsn)
                assert pg_epoch is not None, f"PostgreSQL sinks after killing {run_id} hold no completed epoch's cut"
                kills[-1]["pg_epoch"] = pg_epoch
            print(f"{time.strftime('%H:%M:%S')} killed: {kills[-1]}", flush=True)
        print(json.dumps(kills, indent=1))
        # the last run: to the end of the input, then a graceful stop with a final epoch
        latest_before_final = store.latest_completed_epoch(pid)
        assert latest_before_final is not None, f"no epoch completed in {len(plan)} killed runs: {kills}"
        final = start(run_id="run-final")
        try:
            # channels are read only once the driver restored them and runs
            wait_for(lambda: not final.alive() or (
                (rec := current(store, pid)) is not None and rec.run_id == "run-final"
                and rec.state is PipelineState.RUNNING), timeout=300, what="the final run to start")
            wait_for(lambda: not final.alive() or (
                all(channel_row_count(layout.channel_uri(c)) >= rows for c in inner_channels)
                and channel_row_count(layout.channel_uri(OUTPUT_CHANNEL)) >= len(expected)), timeout=600, interval=0.5,
                what="the final run to reach the end of the input")
        except AssertionError:
            final.kill()
            raise
        assert final.alive(), final.tail()
    store.request_stop(pid, "graceful")
    code = final.wait(300)
    assert code == 0, final.tail()

    # every run after the first restored from the latest epoch completed before it started, unless it was
    # killed while starting before its restore's commit point: then it changed no epoch (restored_from unset),
    # and the next run restored from the same latest epoch
    for i, k in enumerate(kills[1:], start=1):
        after = kills[i + 1] if i + 1 < len(kills) else None
        if k["restored_from"] is None:
            assert k["moment"] == "starting", kills
            assert after is None or after["completed_before"] == k["completed_before"], kills
        else:
            assert k["restored_from"] == k["completed_before"], kills
    record = store.get_pipeline(pid)
    assert record.state is PipelineState.STOPPED
    assert record.restored_from_epoch == latest_before_final.epoch, (record, kills)
    epochs = store.list_epochs(pid, limit=1000)
    final_epoch = max(e.epoch for e in epochs if e.state is EpochState.COMPLETED)
    assert store.get_epoch(pid, final_epoch).is_final

    # exactly once: no record lost, none duplicated, on every channel
    assert (FUSED in store.get_pipeline(pid).stages) == chaining  # the form that ran is the one asked for
    for channel in inner_channels:
        ids = Channel.open(layout.channel_uri(channel)).read_table().column("id").to_pylist()
        dup = [i for i, n in Counter(ids).items() if n > 1]
        assert not dup, f"{channel}: ids written twice: {dup[:10]}"
        assert sorted(ids) == list(range(rows)), f"{channel}: {len(ids)} ids, expected {rows}"
    got = channel_rows(layout.channel_uri(OUTPUT_CHANNEL))
    assert Counter(got) == Counter(expected)
    assert got == expected
    # the Parquet sink too: its committed files hold each row exactly once
    assert Counter(committed_rows(sink)) == Counter(expected)
    if len(plan) > 2:  # a long plan: commits happened between kills, not only at the end
        assert any(k["sink_rows"] for k in kills), kills
    if sink_dsn:  # the append table holds each row once, the upsert table the plain-Python totals
        got_pg = sql(sink_dsn, "SELECT id, key, left_value, right_value, total FROM report_rows")
        assert Counter(got_pg) == Counter(expected)
        assert {k: (n, t) for k, n, t in sql(sink_dsn, "SELECT key, n, total FROM key_totals")} == expected_totals(rows)
        assert any(k["pg_epoch"] > 0 for k in kills), kills
    # and every barrier of a completed epoch sits right after its stage's cut batch, across the restores
    writers = {FUSED: OUTPUT_CHANNEL} if chaining else {c: c for c in STAGES}  # physical stage -> its channel
    assert check_barriers_follow_cuts(store, pid, {s: layout.channel_uri(c) for s, c in writers.items()}) > 0


def test_killed_right_after_an_epoch_cut_while_batch_0_ran_then_restored_from_latest_is_exact(
        store: EpochStore, tmp_path: Path) -> None:
    """Issue 30, finding 1, as found: Spark's JSON file sources over empty folders, a stream-stream join, epochs
    every 0.5 s; files arrive once the pipeline runs, so epochs are cut while the join's batch 0 runs (at
    batch -1) after batch 0 wrote state files. The driver is SIGKILLed right after such an epoch completed and
    restarted from 'latest' (that epoch): it must start (Spark refused the restored checkpoint before the fix:
    STATE_STORE_CHECKPOINT_LOCATION_NOT_EMPTY), and the sink must end with the join exactly once."""
    from tests.runtime import files_join

    def attempt(n: int) -> tuple[Any, ...] | None:
        """One first run: the epoch cut at batch -1 after batch 0 wrote state, or None when batch 0 finished
        before an epoch was cut during it (a fast batch 0 leaves no such window: try again with a fresh pipeline)."""
        pid = f"b0-{uuid.uuid4().hex[:8]}"
        inputs, sink, logs = tmp_path / f"in{n}", tmp_path / f"out{n}", tmp_path / f"logs{n}"
        logs.mkdir()
        for side in ("orders", "payments"):
            (inputs / side).mkdir(parents=True)
        storage = tmp_path / f"storage{n}"
        layout = StorageLayout.at(str(storage), pid)
        start = functools.partial(Driver, dsn=store.dsn, storage=storage, pipeline_id=pid, logs=logs, sink=sink,
                                  pipeline="tests.runtime.files_join:pipeline",
                                  args={"input_path": str(inputs), "sink_path": str(sink)})

        def join_cut() -> tuple[Any, int | None, float | None]:
            latest = store.latest_completed_epoch(pid)
            stage = next((s for s in store.get_pipeline(pid).stages if "joined" in s), None)
            if latest is None or stage is None:
                return None, None, None
            ack = {a.stage: a for a in store.acks(pid, latest.epoch)}.get(stage)
            # settled: a temporary file Spark renamed between the listing and its stat is skipped
            state = settled_files(storage / layout.checkpoint(stage) / "state")
            first_state = min((st.st_mtime for _, st in state), default=None)
            return latest, (None if ack is None else ack.details.get("batch_id")), first_state

        def found() -> Any:
            latest, batch, first_state = join_cut()
            if latest is None or batch is None:
                return None
            if batch == -1 and first_state is not None and latest.triggered_at.timestamp() > first_state:
                return ("found", latest)
            return ("missed", latest) if batch >= 0 else None

        with CheckpointTicker(store, pid, interval=0.5, timeout=60.0, tick=0.1):
            first = start(run_id="first")
            try:
                wait_for(lambda: running(pid, "first") or not first.alive(), timeout=300,
                         what="the first run to start")
                drop(inputs, 0, range(0, 150))
                outcome = wait_for(lambda: found() or (not first.alive() and ("dead", None)), timeout=240,
                                   interval=0.02, what="an epoch cut at batch -1 after batch 0 wrote state")
                assert outcome[0] != "dead", first.tail()
            finally:
                first.kill()
        latest = store.latest_completed_epoch(pid)
        if outcome[0] == "missed" or latest is None or latest.epoch != outcome[1].epoch:
            return None  # missed, or a later epoch completed before the kill: not the moment this test is about
        return pid, inputs, sink, start, outcome[1]

    def running(pid: str, run_id: str) -> bool:
        rec = current(store, pid)
        return rec is not None and rec.run_id == run_id and rec.state is PipelineState.RUNNING

    def drop(inputs: Path, part: int, ids: range) -> None:
        files_join.write_file(inputs / "orders", f"o{part}.json", map(files_join.order, ids))
        files_join.write_file(inputs / "payments", f"p{part}.json", map(files_join.payment, ids))

    tried = [attempt(n) for n in range(1)]
    for n in range(1, 4):
        if tried[-1] is not None:
            break
        tried.append(attempt(n))
    chosen = tried[-1]
    assert chosen is not None, f"batch 0 finished before an epoch was cut during it in {len(tried)} pipelines"
    pid, inputs, sink, start, epoch = chosen
    with CheckpointTicker(store, pid, interval=0.5, timeout=60.0, tick=0.1):
        print(f"killed after epoch {epoch.epoch} (cut at batch -1 with state on disk), attempt {len(tried)}")
        second = start(run_id="second")
        try:
            wait_for(lambda: running(pid, "second") or not second.alive(), timeout=300,
                     what="the restored run to start")
            assert second.alive(), second.tail()
            assert store.get_pipeline(pid).restored_from_epoch == epoch.epoch
            drop(inputs, 1, range(150, 300))
            want = files_join.expected(range(300))
            wait_for(lambda: len(committed_rows(sink)) >= len(want) or not second.alive(), timeout=300,
                     interval=0.5, what="every joined row committed")
            assert second.alive(), second.tail()
        except AssertionError:
            second.kill()
            raise
    store.request_stop(pid, "graceful")
    assert second.wait(300) == 0, second.tail()
    assert sorted(committed_rows(sink)) == want
