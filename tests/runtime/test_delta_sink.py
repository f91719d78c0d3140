"""The exactly-once Delta Lake sink's phases on real Spark: a table commit per epoch, an idempotent retry, rollback
by the table's own restore, fencing of a superseded run, and Spark reading the table."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("deltalake")

from deltalake import DeltaTable

from airflow_arroyo.core.exceptions import ConfigurationError, FencedError, PipelineGraphError
from airflow_arroyo.runtime.pipeline import Pipeline
from airflow_arroyo.runtime.sinks.delta import DeltaTarget, TransactionalDeltaSink, table_files
from airflow_arroyo.store.records import FencingToken

pytestmark = [pytest.mark.spark]


def ids(path: Path, version: int | None = None) -> list[int]:
    """What a Delta reader (delta-rs) sees."""
    table = DeltaTable(str(path), version=version).to_pyarrow_table()
    return sorted(table.column("id").to_pylist())


def batch(spark: Any, start: int, end: int) -> Any:
    return spark.range(start, end).selectExpr("id", "CAST(id % 3 AS STRING) AS key").repartition(2)


def sink_at(path: Path, generation: int = 0) -> TransactionalDeltaSink:
    s = TransactionalDeltaSink("p1", "out", DeltaTarget(str(path)))
    if generation:
        s.token = FencingToken("p1", f"run{generation}", generation)
    return s


@pytest.fixture
def sink(tmp_path: Path) -> TransactionalDeltaSink:
    s = sink_at(tmp_path / "t")
    s.claim()
    return s


def test_one_table_commit_per_epoch_visible_only_when_committed(spark: Any, sink: TransactionalDeltaSink,
                                                                tmp_path: Path) -> None:
    table = tmp_path / "t"
    for b in range(4):
        sink.write_batch(batch(spark, b * 10, b * 10 + 10), b)
    assert not DeltaTable.is_deltatable(str(table))  # pre-committed files are no table yet
    first = sink.commit_through(1)
    assert first.batches == (0, 1) and first.rows == 20 and first.files == 4 and first.version == 1
    assert ids(table) == list(range(20))
    second = sink.commit_through(3)
    assert second.batches == (2, 3) and second.rows == 20 and second.version == 2  # one version per commit
    dt = DeltaTable(str(table))
    assert dt.version() == 2 and dt.transaction_version("arroyo.p1.out") == 3
    assert dt.count() == 40  # each file's numRecords statistic, from its Parquet footer
    info = dt.history(1)[0]
    assert (info["arroyo.pipeline"], info["arroyo.batch"], info["arroyo.rows"]) == ("p1", "3", "20")
    assert ids(table, version=1) == list(range(20))  # time travel to the first epoch's version
    # Spark reads the table: its current files, from the log, as Parquet
    assert sorted(r.id for r in spark.read.parquet(*table_files(str(table))).collect()) == list(range(40))


def test_a_retried_commit_is_not_made_twice(spark: Any, tmp_path: Path) -> None:
    """Killed between the table commit and the driver's record: the next run's commit of the same cut (or the
    rollback to it) finds the batch in the table's transaction and commits nothing."""
    sink = sink_at(tmp_path / "t", 1)
    sink.claim()
    for b in range(3):
        sink.write_batch(batch(spark, b * 10, b * 10 + 10), b)
    assert sink.commit_through(2).version == 1
    again = sink_at(tmp_path / "t", 1)  # the same run, a fresh sink object: what it knows comes from the table
    retry = again.commit_through(2)
    assert retry.rows == 0 and retry.batches == () and retry.version is None
    assert DeltaTable(str(tmp_path / "t")).version() == 1 and ids(tmp_path / "t") == list(range(30))
    later = sink_at(tmp_path / "t", 2)  # the next run restores the epoch whose cut is 2: nothing to redo
    later.rollback_to(2)
    later.claim()
    assert ids(tmp_path / "t") == list(range(30))


def test_rollback_restores_the_table_version_of_the_restored_cut(spark: Any, tmp_path: Path) -> None:
    table = tmp_path / "t"
    run1 = sink_at(table, 1)
    run1.claim()
    for b in range(6):
        run1.write_batch(batch(spark, b * 10, b * 10 + 10), b)
    run1.commit_through(1)  # version 1
    run1.commit_through(4)  # version 2 (an epoch whose cut was 3 was never committed on its own); 5 pending
    run2 = sink_at(table, 2)
    run2.rollback_to(3)  # restore the epoch whose cut is 3: back to version 1, then batches 2-3 again
    run2.claim()
    assert ids(table) == list(range(40))
    dt = DeltaTable(str(table))
    assert dt.transaction_version("arroyo.p1.out") == 3
    assert [h["operation"] for h in dt.history(2)] == ["WRITE", "RESTORE"]
    assert not (table / f"{5:012d}-g1").exists()  # never committed: deleted
    assert (table / f"{4:012d}-g1").exists()  # held by version 2: left for VACUUM (time travel still reads it)
    assert ids(table, version=2) == list(range(50))
    run2.write_batch(batch(spark, 500, 503), 4)  # the restored run re-runs batch 4 with other rows
    made = run2.commit_through(4)
    assert made.batches == (4,) and made.rows == 3
    assert ids(table) == [*range(40), 500, 501, 502]
    run3 = sink_at(table, 3)
    run3.rollback_to(-1)  # a start over: the empty table
    assert ids(table) == []


def test_a_superseded_run_can_neither_pre_commit_nor_commit(spark: Any, tmp_path: Path) -> None:
    table = tmp_path / "t"
    old = sink_at(table, 1)
    old.claim()
    for b in range(3):
        old.write_batch(batch(spark, b * 10, b * 10 + 10), b)
    old.commit_through(0)
    new = sink_at(table, 2)
    new.rollback_to(0)
    new.claim()  # a commit carrying generation 2
    with pytest.raises(FencedError, match="superseded"):
        old.write_batch(batch(spark, 100, 110), 3)
    with pytest.raises(FencedError, match="generation 2"):
        old.commit_through(2)
    assert ids(table) == list(range(10))


def test_a_commit_based_on_an_older_version_fails_fenced(spark: Any, tmp_path: Path) -> None:
    """The race the claim file cannot close: the old run checked, then the new run claimed and committed, then
    the old run's commit reaches the log. It is based on an older version: the log refuses it."""
    table = tmp_path / "t"
    old = sink_at(table, 1)
    old.claim()
    for b in range(2):
        old.write_batch(batch(spark, b * 10, b * 10 + 10), b)
    old.commit_through(0)
    stale = old._table()  # the old run's view of the table, loaded before the takeover
    assert stale is not None
    new = sink_at(table, 2)
    new.rollback_to(0)
    new.claim()
    with pytest.raises(FencedError):
        old._commit(stale, [], 1, rows=None, what="a late commit")  # its batch 1 was dropped
    assert ids(table) == list(range(10))


def test_refused_targets(spark: Any, tmp_path: Path) -> None:
    other = TransactionalDeltaSink("p2", "out", DeltaTarget(str(tmp_path / "t")))
    mine = sink_at(tmp_path / "t")
    mine.claim()
    with pytest.raises(ConfigurationError, match="written by stage 'out' of pipeline 'p1'"):
        other.check_writable()
    DeltaTable.create(str(tmp_path / "foreign"), schema=batch(spark, 0, 1).toArrow().schema)
    with pytest.raises(ConfigurationError, match="did not create"):
        sink_at(tmp_path / "foreign").check_writable()
    (tmp_path / "files").mkdir()
    (tmp_path / "files" / "data.csv").write_text("x\n")
    with pytest.raises(ConfigurationError, match="holds files"):
        sink_at(tmp_path / "files").check_writable()


def test_graph_validation_names_the_fix(tmp_path: Path) -> None:
    def build(**target: Any) -> None:
        p = Pipeline("p")
        s = p.source("src", lambda spark: spark)
        p.sink("out", inputs=[s], **target)
        p.validate()

    with pytest.raises(PipelineGraphError, match=r"table= takes a DeltaTarget\(path=...\)"):
        build(table=str(tmp_path))
    with pytest.raises(PipelineGraphError, match="path= must name the table's folder"):
        build(table=DeltaTarget(""))
    with pytest.raises(PipelineGraphError, match="keep credentials in the driver's environment"):
        build(table=DeltaTarget(str(tmp_path), storage_options={"AWS_SECRET_ACCESS_KEY": "x"}))
    with pytest.raises(PipelineGraphError, match="exactly one of"):
        build(table=DeltaTarget(str(tmp_path)), format="parquet", options={"path": str(tmp_path)})
    build(table=DeltaTarget(str(tmp_path / "ok")))
