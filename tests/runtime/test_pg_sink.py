"""The exactly-once PostgreSQL sink, phase by phase, on a real PostgreSQL with batches written by real Spark
executors: nothing visible before a commit, a re-run batch replaces its earlier attempt, a commit cut short
changes nothing and is finished once, rollback to an older cut (append and upsert), trimming, bad input
refused before any write. The whole pipeline under SIGKILL is in ``test_exactly_once.py``."""

from __future__ import annotations

import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from airflow_arroyo.core.epochs import EpochState
from airflow_arroyo.core.exceptions import ConfigurationError, PipelineGraphError
from airflow_arroyo.examples import (
    OUTPUT_CHANNEL,
    PG_REPORT_DDL,
    PG_TOTALS_DDL,
    demo,
    expected_report,
    expected_totals,
    totals_of,
)
from airflow_arroyo.runtime.channel import Channel
from airflow_arroyo.runtime.driver import PipelineDriver
from airflow_arroyo.runtime.pipeline import Pipeline
from airflow_arroyo.runtime.sinks.postgres import (
    BatchWindow,
    PostgresTarget,
    TransactionalPostgresSink,
    shadow_window_rows,
)
from airflow_arroyo.testing import DriverThread, channel_row_count, run_until, wait_for
from tests.support import sql

pytestmark = [pytest.mark.spark]

SCHEMA = "id BIGINT, key STRING, amount BIGINT"


@pytest.fixture
def target_dsn(pg_server: Any) -> str:
    """A database of its own (not the epoch store's), with the tables the tests write."""
    dsn = pg_server.create_database(f"sink_{uuid.uuid4().hex[:10]}")
    sql(dsn, "CREATE TABLE events (id bigint NOT NULL, key text NOT NULL, amount bigint)")
    sql(dsn, "CREATE TABLE totals (key text PRIMARY KEY, amount bigint NOT NULL, id bigint)")
    return dsn


def batch(spark: Any, rows: list[tuple[int, str, int | None]], partitions: int = 2) -> Any:
    df = spark.createDataFrame(rows, SCHEMA)
    return df.coalesce(1) if partitions == 1 else df.repartition(partitions)  # coalesce keeps the rows' order


def make(dsn: str, table: str, mode: str = "append", key: tuple[str, ...] = (), stage: str = "out",
         pipeline: str = "p1", keep_journal: bool = False) -> TransactionalPostgresSink:
    sink = TransactionalPostgresSink(pipeline, stage, PostgresTarget(table=table, dsn=dsn, mode=mode,  # type: ignore[arg-type]
                                                                      key=key, keep_journal=keep_journal))
    sink.check_writable()
    sink.claim()
    return sink


def events(dsn: str) -> Counter[tuple[Any, ...]]:
    return Counter(sql(dsn, "SELECT id, key, amount FROM events"))


def rows_of_batches(*batches: list[tuple[int, str, int | None]]) -> Counter[tuple[Any, ...]]:
    return Counter(r for b in batches for r in b)


def test_append_commit_replay_rollback_and_trim(spark: Any, target_dsn: str) -> None:
    sink = make(target_dsn, "events")
    b = {i: [(i * 10 + j, f"k{j % 3}", j) for j in range(5)] for i in range(4)}
    for i in range(3):
        sink.write_batch(batch(spark, b[i]), i)
    assert events(target_dsn) == Counter(), "pre-committed rows are visible before the commit"
    # a re-run of batch 2 (after a restore it may carry other rows) replaces its earlier attempt
    b[2] = [(200 + j, "k9", j) for j in range(3)]
    sink.write_batch(batch(spark, b[2], partitions=1), 2)
    assert sink.commit_through(1).rows == 10
    assert events(target_dsn) == rows_of_batches(b[0], b[1])
    assert sink.commit_through(1).rows == 0, "a commit is idempotent"
    sink.write_batch(batch(spark, b[3]), 3)
    sink.commit_through(3)
    assert events(target_dsn) == rows_of_batches(b[0], b[1], b[2], b[3])
    # rows equal to committed ones that the sink did not write survive a rollback (it deletes by count)
    sql(target_dsn, "INSERT INTO events VALUES (30, 'k0', 0), (999, 'x', NULL)")
    sink.rollback_to(1)
    assert events(target_dsn) == rows_of_batches(b[0], b[1]) + Counter([(30, "k0", 0), (999, "x", None)])
    assert sink.committed_batch() == 1
    # the restored run re-runs batches 2, 3 and commits them again: each row once
    sink.write_batch(batch(spark, b[2]), 2)
    sink.write_batch(batch(spark, b[3]), 3)
    sink.commit_through(3)
    assert events(target_dsn) == rows_of_batches(b[0], b[1], b[2], b[3]) + Counter([(30, "k0", 0), (999, "x", None)])
    # trimming forgets what only rollbacks behind batch 2 need; a rollback to 2 still works
    sink.trim_through(2)
    sink.rollback_to(2)
    assert events(target_dsn) == rows_of_batches(b[0], b[1], b[2]) + Counter([(30, "k0", 0), (999, "x", None)])
    pending = sql(target_dsn, f"SELECT count(*) FROM {sink._pending_name}")[0][0]  # noqa: S608
    assert pending == 0, "journal rows of trimmed batches are kept"
    # a batch at or before the committed one is refused: the stage's checkpoint is behind the table
    with pytest.raises(ConfigurationError, match="already committed"):
        sink.write_batch(batch(spark, b[2]), 2)



def test_the_journal_answers_a_shadow_compare_until_a_trim_reaches_it(spark: Any, target_dsn: str) -> None:
    """What each side committed per window comes from the journals; the live trim is recorded and named when it
    reached a window, a shadow's sink (keep_journal) trims nothing, an uncommitted window is None."""
    sql(target_dsn, "CREATE TABLE events_shadow (LIKE events INCLUDING ALL)")
    live, shadow = make(target_dsn, "events", pipeline="live"), make(target_dsn, "events_shadow", pipeline="shadow",
                                                                      keep_journal=True)
    b = {i: [(i * 10 + j, f"k{j}", j) for j in range(3)] for i in range(4)}
    for i in range(4):
        live.write_batch(batch(spark, b[i], partitions=1), i)
    live.commit_through(2)
    live.trim_through(0)  # batch 0 is the fork point's cut: nothing after it is forgotten
    for i in (1, 2):  # the shadow's batches continue after the fork point's cut, one id changed
        shadow.write_batch(batch(spark, [(r[0] + (i == 2 and r[0] == 20), *r[1:]) for r in b[i]], partitions=1), i)
    shadow.commit_through(2)
    shadow.trim_through(2)
    progress = dict(sql(target_dsn, "SELECT pipeline_id, trimmed_batch FROM arroyo_sink_progress"))
    assert progress == {"live": 0, "shadow": -1}

    def read(rows: list[dict[str, Any]]) -> Counter[tuple[Any, ...]]:
        return Counter((r["id"], r["key"], r["amount"]) for r in rows)

    got = shadow_window_rows(live, shadow, 0, [BatchWindow(0, 1, 0, 1), BatchWindow(1, 2, 1, 2),
                                               BatchWindow(2, 3, 2, 2)])
    assert got[2] is None, "batch 3 of the live sink is staged, not committed"
    assert [(read(w[0]), read(w[1])) for w in got[:2] if w is not None] == [
        (Counter(b[1]), Counter(b[1])), (Counter(b[2]), Counter([(21, "k0", 0), *b[2][1:]]))]
    with pytest.raises(ConfigurationError, match="trimmed through batch 0"):
        shadow_window_rows(live, shadow, -1, [BatchWindow(-1, 0, -1, -1)])


def test_an_upsert_window_gives_each_key_its_row_at_each_sides_cut(spark: Any, target_dsn: str) -> None:
    """Per key either side wrote in a window: each table's row at its cut (a pre-image of a later batch, or the row
    now); a key the shadow has not written since the fork: the live row at the fork point."""
    sql(target_dsn, "CREATE TABLE totals_shadow (LIKE totals INCLUDING ALL)")
    live = make(target_dsn, "totals", "upsert", ("key",), pipeline="live")
    shadow = make(target_dsn, "totals_shadow", "upsert", ("key",), pipeline="shadow", keep_journal=True)
    live_batches = {0: [(1, "a", 10), (2, "b", 20)], 1: [(3, "a", 11), (4, "c", 30)], 2: [(5, "a", 12), (6, "b", 21)]}
    shadow_batches = {1: [(3, "a", 11), (4, "c", 31)], 2: [(5, "a", 13)]}  # batch 0 is the fork point's cut
    for batches, sink in ((live_batches, live), (shadow_batches, shadow)):
        for i, rows in batches.items():
            sink.write_batch(batch(spark, rows, partitions=1), i)
        sink.commit_through(2)

    def table_at(batches: dict[int, list[tuple[int, str, int]]], cut: int) -> dict[str, tuple[int, str, int]]:
        return {r[1]: r for i in sorted(batches) if i <= cut for r in batches[i]}

    got = shadow_window_rows(live, shadow, 0, [BatchWindow(0, 1, 0, 1), BatchWindow(1, 2, 1, 2)])
    for w, cut in enumerate((1, 2)):
        keys = {r[1] for r in live_batches[cut] + shadow_batches[cut]}  # written in the window by either side
        shadow_now = {**table_at(live_batches, 0), **table_at(shadow_batches, cut)}
        window = got[w]
        assert window is not None
        assert {(r["id"], r["key"], r["amount"]) for r in window[0]} == {table_at(live_batches, cut)[k] for k in keys}
        assert {(r["id"], r["key"], r["amount"]) for r in window[1]} == {shadow_now[k] for k in keys}


@pytest.mark.parametrize("mode", ["append", "upsert"])
def test_a_superseded_run_cannot_trim_the_journal_of_the_run_that_took_over(spark: Any, target_dsn: str,
                                                                           mode: str) -> None:
    """Issue 30, finding 6 e: every write of a fenced run is refused, trimming the staging tables included. A run
    stalled between its commit and its trim (which it computed from the epochs it knew) woke up after a newer run
    had restored an older epoch and re-used those batch ids: its trim deleted the new run's journal (append) or
    pre-images (upsert), so a later restore of that epoch could not take the new batches back out."""
    from airflow_arroyo.core.exceptions import FencedError
    from airflow_arroyo.store import FencingToken

    table, key = ("events", ()) if mode == "append" else ("totals", ("key",))

    def rows(dsn: str) -> Counter[tuple[Any, ...]]:
        return Counter(sql(dsn, f"SELECT id, key, amount FROM {table}"))  # noqa: S608 - the test's own tables

    old = make(target_dsn, table, mode, key)
    old.token = FencingToken("p1", "old", 1)
    old.claim()
    b: dict[int, list[tuple[int, str, int | None]]] = {i: [(i * 10 + j, f"k{j}", j) for j in range(3)]
                                                       for i in range(3)}
    for i in range(3):
        old.write_batch(batch(spark, b[i], partitions=1), i)
    old.commit_through(0)  # epoch 1 cut at batch 0
    restorable = rows(target_dsn)
    old.commit_through(2)  # epoch 2 cut at batch 2; the trim through epoch 1's cut comes next: the run stalls here

    new = make(target_dsn, table, mode, key)
    new.token = FencingToken("p1", "new", 2)
    new.rollback_to(0)  # a takeover restoring epoch 1; its batches 1 and 2 are new data
    n: dict[int, list[tuple[int, str, int | None]]] = {i: [(100 + i * 10 + j, f"k{j}", 100 + j) for j in range(3)]
                                                       for i in (1, 2)}
    for i in (1, 2):
        new.write_batch(batch(spark, n[i], partitions=1), i)
    new.commit_through(2)
    assert rows(target_dsn) != restorable

    with pytest.raises(FencedError, match="trim"):
        old.trim_through(2)  # the old run wakes up
    new.rollback_to(0)  # epoch 1 is still restorable: its restore takes the new batches back out
    assert rows(target_dsn) == restorable


def test_upsert_keeps_the_last_row_per_key_and_rolls_back_to_pre_images(spark: Any, target_dsn: str) -> None:
    sql(target_dsn, "INSERT INTO totals VALUES ('old', 1, NULL), ('k1', 5, NULL)")
    sink = make(target_dsn, "totals", mode="upsert", key=("key",))
    sink.write_batch(batch(spark, [(1, "k1", 10), (2, "k2", 20)]), 0)
    sink.write_batch(batch(spark, [(3, "k2", 21), (4, "k3", 30), (5, "k3", 31)], partitions=1), 1)
    sink.write_batch(batch(spark, [(6, "k1", 11), (7, "old", 2)]), 2)
    assert (sink.commit_through(2).rows or 0) > 0

    def totals() -> dict[str, int]:
        return dict(sql(target_dsn, "SELECT key, amount FROM totals"))

    # the last row of a key within a batch wins (a batch's order within a partition)
    assert totals() == {"old": 2, "k1": 11, "k2": 21, "k3": 31}
    sink.rollback_to(0)
    assert totals() == {"old": 1, "k1": 10, "k2": 20}, "k3 was new after batch 0: it must go; 'old' comes back"
    sink.rollback_to(-1)
    assert totals() == {"old": 1, "k1": 5}, "rows the sink never wrote are put back as they were"
    sink.write_batch(batch(spark, [(1, "k1", 10), (2, "k2", 20)]), 0)
    sink.commit_through(0)
    assert totals() == {"old": 1, "k1": 10, "k2": 20}


def test_a_commit_cut_short_changes_nothing_and_is_finished_once(spark: Any, target_dsn: str) -> None:
    sink = make(target_dsn, "events")
    rows = [(i, "k", i) for i in range(50)]
    sink.write_batch(batch(spark, rows[:25]), 0)
    sink.write_batch(batch(spark, rows[25:]), 1)
    # the 40th row inserted by the commit fails it, as a crash of the commit's transaction would
    sql(target_dsn, """
        CREATE FUNCTION fail_at_40() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
          IF (SELECT count(*) FROM events) >= 39 THEN RAISE EXCEPTION 'commit cut short'; END IF;
          RETURN NEW;
        END $$;
        CREATE TRIGGER cut_short BEFORE INSERT ON events FOR EACH ROW EXECUTE FUNCTION fail_at_40();
    """)
    with pytest.raises(ConfigurationError, match="commit cut short"):
        sink.commit_through(1)
    assert events(target_dsn) == Counter() and sink.committed_batch() == -1, "a failed commit left rows behind"
    sql(target_dsn, "DROP TRIGGER cut_short ON events")
    sink.commit_through(1)
    assert events(target_dsn) == Counter(rows)


def test_bad_input_is_refused_before_any_write(spark: Any, target_dsn: str) -> None:
    with pytest.raises(ConfigurationError, match="'missing' does not exist"):
        make(target_dsn, "missing")
    with pytest.raises(ConfigurationError, match="PRIMARY KEY or UNIQUE"):
        make(target_dsn, "events", mode="upsert", key=("id",))
    sink = make(target_dsn, "events")
    with pytest.raises(ConfigurationError, match="'amount': the output is string but the table's column is int8"):
        sink.write_batch(spark.createDataFrame([(1, "k", "x")], "id BIGINT, key STRING, amount STRING"), 0)
    with pytest.raises(ConfigurationError, match="output column 'extra' is not a column"):
        sink.write_batch(spark.createDataFrame([(1, "k", 1, 2)], f"{SCHEMA}, extra INT"), 0)
    with pytest.raises(ConfigurationError, match="column 'key' of 'events' is NOT NULL without a default"):
        sink.write_batch(spark.createDataFrame([(1, 1)], "id BIGINT, amount BIGINT"), 0)
    assert sql(target_dsn, f"SELECT count(*) FROM {sink._pending_name}")[0][0] == 0  # noqa: S608
    # another sink (of another pipeline) on the same table is refused: one exactly-once writer per table
    with pytest.raises(ConfigurationError, match="is written by sink 'out' of pipeline 'p1'"):
        make(target_dsn, "events", pipeline="p2")


def test_graph_validation_names_the_sink() -> None:
    def build(target: Any) -> None:
        p = Pipeline("v")
        src = p.source("src", lambda spark: spark)
        p.sink("to_pg", inputs=[src], postgres=target)
        p.validate()

    with pytest.raises(PipelineGraphError, match="sink 'to_pg': give exactly one of dsn="):
        build(PostgresTarget(table="t"))
    with pytest.raises(PipelineGraphError, match="sink 'to_pg': mode='upsert' needs key="):
        build(PostgresTarget(table="t", dsn_env="X", mode="upsert"))
    with pytest.raises(PipelineGraphError, match="takes a PostgresTarget"):
        build({"table": "t"})
    p = Pipeline("v2")
    src = p.source("src", lambda spark: spark)
    p.sink("a", inputs=[src], postgres=PostgresTarget(table="t", dsn_env="X"))
    p.sink("b", inputs=[src], postgres=PostgresTarget(table="t", dsn_env="X"))
    with pytest.raises(PipelineGraphError, match="sinks 'a' and 'b' both write table 't'"):
        p.validate()


def test_dsn_from_environment_and_airflow_connection(monkeypatch: pytest.MonkeyPatch, target_dsn: str) -> None:
    monkeypatch.setenv("SINK_DSN", target_dsn)
    assert PostgresTarget(table="t", dsn_env="SINK_DSN").resolve_dsn() == target_dsn
    monkeypatch.setenv("AIRFLOW_CONN_WAREHOUSE", '{"conn_type": "postgres", "host": "db", "login": "u", '
                                                  '"password": "p@ss", "port": 5433, "schema": "w"}')
    assert PostgresTarget(table="t", conn_id="warehouse").resolve_dsn() == "postgresql://u:p%40ss@db:5433/w"
    # the connection's libpq extras reach the database (sslmode was dropped on this path: issue 31)
    monkeypatch.setenv("AIRFLOW_CONN_WAREHOUSE", '{"conn_type": "postgres", "host": "db", "login": "u", "schema": '
                                                  '"w", "extra": {"sslmode": "require", "connect_timeout": 5}}')
    assert PostgresTarget(table="t", conn_id="warehouse").resolve_dsn() == (
        "postgresql://u@db/w?connect_timeout=5&sslmode=require")
    monkeypatch.setenv("AIRFLOW_CONN_WAREHOUSE", '{"conn_type": "postgres", "host": "db", "extra": '
                                                  '"{\\"sslmode\\": \\"verify-full\\"}"}')
    assert PostgresTarget(table="t", conn_id="warehouse").resolve_dsn() == "postgresql://db/?sslmode=verify-full"
    monkeypatch.setenv("AIRFLOW_CONN_WAREHOUSE", "postgres://u:p@db:5432/w?sslmode=require")
    assert PostgresTarget(table="t", conn_id="warehouse").resolve_dsn() == "postgresql://u:p@db:5432/w?sslmode=require"
    with pytest.raises(ConfigurationError, match="set AIRFLOW_CONN_NOPE"):
        PostgresTarget(table="t", conn_id="nope").resolve_dsn()
    sink = TransactionalPostgresSink("p", "s", PostgresTarget(table="events", dsn_env="SINK_DSN"))
    assert "p@ss" not in repr(PostgresTarget(table="t", dsn="postgresql://u:p@ss@h/d"))
    assert "postgresql" not in repr(sink)


def test_restore_from_an_older_epoch_rolls_the_tables_back_then_recommits(
        spark: Any, module_store: Any, target_dsn: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The demo with both PostgreSQL sinks runs to the end with epochs; a restore of a middle epoch first rolls
    both tables back to exactly that epoch's cut (append: rows after it deleted; upsert: totals as they were),
    then, run to the end, commits the same rows again: each once."""
    rows, per_batch = 1200, 150
    monkeypatch.setenv("ARROYO_TEST_SINK_DSN", target_dsn)
    sql(target_dsn, PG_REPORT_DDL.format(table="report_rows"))
    sql(target_dsn, PG_TOTALS_DDL.format(table="key_totals"))
    pid = f"pgr-{uuid.uuid4().hex[:8]}"
    expected = expected_report(rows)

    def driver(**kw: Any) -> PipelineDriver:
        p = demo(pid, rows=rows, rows_per_batch=per_batch, pg_dsn_env="ARROYO_TEST_SINK_DSN",
                 pg_report_table="report_rows", pg_totals_table="key_totals")
        return PipelineDriver(p, module_store, storage_uri=str(tmp_path), spark=spark, **kw)

    def report() -> Counter[tuple[Any, ...]]:
        return Counter(sql(target_dsn, "SELECT id, key, left_value, right_value, total FROM report_rows"))

    def totals() -> dict[str, tuple[int, int]]:
        return {k: (n, t) for k, n, t in sql(target_dsn, "SELECT key, n, total FROM key_totals")}

    first = driver(run_id="first")
    run_until(first, module_store, lambda: len(report()) >= len(expected), what="every row committed")
    assert report() == Counter(expected) and totals() == expected_totals(rows)
    completed = sorted(e.epoch for e in module_store.list_epochs(pid) if e.state is EpochState.COMPLETED)
    middle = next(e for e in completed if 0 < sum(report_cut(first, e).values()) < len(expected))

    restored = driver(run_id="restored", restore_from=middle)
    thread = DriverThread(restored).start()
    try:
        wait_for(lambda: restored.started.is_set() or thread.error, timeout=300, what="the restored run to start")
        # no controller: nothing commits before the final epoch, so the tables show the rollback
        cut = report_cut(restored, middle)
        assert report() == cut, "the append table was not rolled back to the restored epoch's cut"
        assert totals() == totals_of(cut.elements()), "the upsert table was not rolled back to the restored epoch's cut"
        out = restored.layout.channel_uri(OUTPUT_CHANNEL)
        wait_for(lambda: thread.error or channel_row_count(out) >= len(expected), timeout=600,
                 what="the restored run to reach the end")
    finally:
        module_store.request_stop(pid, "graceful")
    thread.join(300)
    assert report() == Counter(expected), "rows after the restored epoch were committed twice or lost"
    assert totals() == expected_totals(rows)


def report_cut(driver: PipelineDriver, epoch: int) -> Counter[tuple[Any, ...]]:
    """The report channel's rows before barrier ``epoch``: what the sinks hold once that epoch committed."""
    channel = Channel.open(driver.layout.channel_uri(OUTPUT_CHANNEL))
    pos = channel.find_barrier(epoch)
    assert pos is not None
    return Counter(tuple(r.values()) for r in channel.read_table(end=pos).to_pylist())



def test_a_table_in_a_mixed_case_schema_keeps_its_progress(spark: Any, target_dsn: str) -> None:
    """The sink's own tables live in the target's schema, created under its exact (quoted) name; finding them
    again must quote it too, or a schema such as "Sinks" reads as sinks and the sink forgets what it committed."""
    sql(target_dsn, 'CREATE SCHEMA "Sinks"')
    sql(target_dsn, 'CREATE TABLE "Sinks".events (id bigint NOT NULL, key text NOT NULL, amount bigint)')
    sink = make(target_dsn, '"Sinks".events')
    rows = [(j, f"k{j}", j) for j in range(3)]
    sink.write_batch(batch(spark, rows), 0)
    assert sink.commit_through(0).rows == 3
    assert sink.committed_batch() == 0
    assert Counter(sql(target_dsn, 'SELECT id, key, amount FROM "Sinks".events')) == Counter(rows)
    assert make(target_dsn, '"Sinks".events').committed_batch() == 0  # a new claim finds the same progress
