"""The exactly-once file sink's two phases and its rollback, on real files written by real Spark."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pyarrow.dataset as ds
import pytest

from airflow_arroyo.core.exceptions import ConfigurationError, PipelineGraphError
from airflow_arroyo.runtime.pipeline import Pipeline
from airflow_arroyo.runtime.sinks.files import TransactionalFileSink, committed_files
from airflow_arroyo.store import FencingToken

pytestmark = [pytest.mark.spark]


def visible_ids(path: Path) -> list[int]:
    """What a reader of the folder sees (pyarrow skips '_' and '.' names, as Spark does)."""
    if not path.exists():
        return []
    table = ds.dataset(str(path), format="parquet").to_table()
    return sorted(table.column("id").to_pylist()) if table.num_columns else []


def batch(spark: Any, start: int, end: int) -> Any:
    return spark.range(start, end).repartition(2)  # two part files per batch


@pytest.fixture
def sink(tmp_path: Path) -> TransactionalFileSink:
    s = TransactionalFileSink("p1", "out", "parquet", {"path": str(tmp_path / "out"), "compression": "snappy"})
    s.claim()
    return s


def test_batches_become_visible_only_when_committed(spark: Any, sink: TransactionalFileSink, tmp_path: Path) -> None:
    for b in range(4):
        sink.write_batch(batch(spark, b * 10, b * 10 + 10), b)
    assert visible_ids(tmp_path / "out") == []
    assert sink.pending_batches() == [0, 1, 2, 3]
    moved = sink.commit_through(1)
    assert moved.files == 4 and moved.batches == (0, 1)  # two part files per batch
    assert moved.rows == 20  # counted while pre-committing
    assert moved.bytes == sum(p.stat().st_size for p in (tmp_path / "out").glob("*.parquet"))
    assert visible_ids(tmp_path / "out") == list(range(20))
    assert sink.committed_batches() == [0, 1] and sink.pending_batches() == [2, 3]
    assert sink.commit_through(1).files == 0  # idempotent
    # Spark itself reads exactly the committed rows (it skips _arroyo_sink like pyarrow does)
    assert sorted(r.id for r in spark.read.parquet(str(tmp_path / "out")).collect()) == list(range(20))


def test_a_rerun_batch_replaces_its_earlier_attempt(spark: Any, sink: TransactionalFileSink, tmp_path: Path) -> None:
    sink.write_batch(batch(spark, 0, 10), 0)
    sink.write_batch(batch(spark, 100, 105), 0)  # after a restore, batch 0 carries other rows
    sink.commit_through(0)
    assert visible_ids(tmp_path / "out") == list(range(100, 105))


def test_rollback_keeps_exactly_the_batches_of_the_restored_cut(spark: Any, sink: TransactionalFileSink,
                                                                  tmp_path: Path) -> None:
    for b in range(5):
        sink.write_batch(batch(spark, b * 10, b * 10 + 10), b)
    sink.commit_through(3)  # a later epoch committed batches 0-3; 4 is pending
    sink.rollback_to(1)  # restore an older epoch whose cut was batch 1
    assert visible_ids(tmp_path / "out") == list(range(20))
    assert sink.committed_batches() == [0, 1] and sink.pending_batches() == []
    sink.write_batch(batch(spark, 500, 503), 2)  # the restored run re-runs batch 2 with other rows
    sink.commit_through(2)
    assert visible_ids(tmp_path / "out") == [*range(20), 500, 501, 502]


def test_rollback_finishes_the_commit_of_the_restored_epoch(spark: Any, sink: TransactionalFileSink,
                                                            tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Killed after epoch N completed but before (or while) its batches were committed."""
    for b in range(3):
        sink.write_batch(batch(spark, b * 10, b * 10 + 10), b)
    # a commit cut short: batch 0 and one file of batch 1 moved, the other not, no manifest of either written
    move, moves = sink.fs.move, [0]

    def dies_at_the_fourth(src: str, dst: str) -> None:
        moves[0] += 1
        if moves[0] == 4:
            raise KeyboardInterrupt  # stands for the process's death: nothing after it runs
        move(src, dst)

    monkeypatch.setattr(sink.fs, "move", dies_at_the_fourth)
    with pytest.raises(KeyboardInterrupt):
        sink.commit_through(1)
    monkeypatch.setattr(sink.fs, "move", move)
    assert len(list((tmp_path / "out").glob(f"{1:012d}-*.parquet"))) == 1
    assert not list((tmp_path / "out" / "_arroyo_sink" / "committed").glob("*.json"))
    restarted = TransactionalFileSink("p1", "out", "parquet", {"path": str(tmp_path / "out")})
    restarted.rollback_to(1)
    assert visible_ids(tmp_path / "out") == list(range(20))
    assert restarted.pending_batches() == []
    # the manifests name every file of both batches, those the first attempt moved too
    assert sorted(committed_files(str(tmp_path / "out"))) == sorted(
        p.name for p in (tmp_path / "out").glob("*.parquet"))


def test_start_over_removes_everything_it_wrote(spark: Any, sink: TransactionalFileSink, tmp_path: Path) -> None:
    sink.write_batch(batch(spark, 0, 10), 0)
    sink.commit_through(0)
    sink.write_batch(batch(spark, 10, 20), 1)
    sink.rollback_to(-1)
    assert visible_ids(tmp_path / "out") == [] and sink.pending_batches() == [] and not sink.has_state()


def test_a_commit_reads_neither_the_folder_nor_the_manifests_of_earlier_batches(
        spark: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A fenced run's commit looked for files a superseded run slipped in after every commit, reading the manifest
    of every batch the sink ever committed, and listed the whole folder twice (for that search and to name the
    batch's files in its manifest): a sink running for months paid for its whole output on each epoch. Now the
    folder is listed at the first two commits only, while no older generation's pending folder exists, and a file
    such a folder's run slips in is still removed."""
    out = tmp_path / "out"
    sink = TransactionalFileSink("p1", "out", "parquet", {"path": str(out)})
    sink.token = FencingToken("p1", "r2", 2)
    sink.claim()
    reads: list[str] = []
    listings: list[str] = []
    read_json, list_files = sink.fs.read_json, sink.fs.list_files

    def counted_read(path: str) -> Any:
        reads.append(path)
        return read_json(path)

    def counted_list(path: str = "") -> Any:
        listings.append(path)
        return list_files(path)

    monkeypatch.setattr(sink.fs, "read_json", counted_read)
    monkeypatch.setattr(sink.fs, "list_files", counted_list)
    per_commit = []
    for b in range(5):
        sink.write_batch(batch(spark, b * 10, b * 10 + 10), b)
        reads.clear()
        listings.clear()
        sink.commit_through(b)
        per_commit.append((len([r for r in reads if "/committed/" in r]), listings.count("")))
    assert per_commit == [(0, 1), (0, 1)] + [(0, 0)] * 3, per_commit
    assert visible_ids(out) == list(range(50))
    assert sorted(committed_files(str(out))) == sorted(p.name for p in out.glob("*.parquet"))
    # A superseded run (generation 1) whose write and commit raced the takeover: its pending batch 5 is there and
    # one of its files moved in, named by no manifest readers trust. The next commit searches and removes it.
    pending = out / "_arroyo_sink" / "pending" / "5-g1"
    pending.mkdir(parents=True)
    for i, f in enumerate(sorted(out.glob(f"{4:012d}-g2-*.parquet"))):
        shutil.copy(f, pending / f"part-0000{i}.parquet")
    stray = out / f"{5:012d}-g1-part-00000.parquet"
    (pending / "part-00000.parquet").rename(stray)
    reads.clear()
    sink.write_batch(batch(spark, 50, 60), 5)
    sink.commit_through(5)
    assert not stray.exists() and not pending.exists()
    assert visible_ids(out) == list(range(60))
    assert [r.rsplit("/", 1)[-1] for r in reads if "/committed/" in r] == [f"{5:012d}-g2.json"]  # its batch's only
    # after a search that found something, two more before the commits stop listing the folder
    per_commit.clear()
    for b in (6, 7, 8):
        sink.write_batch(batch(spark, b * 10, b * 10 + 10), b)
        listings.clear()
        sink.commit_through(b)
        per_commit.append((0, listings.count("")))
    assert per_commit == [(0, 1), (0, 1), (0, 0)], per_commit


@pytest.mark.usefixtures("sink")
def test_a_folder_has_one_writer(tmp_path: Path) -> None:
    other = TransactionalFileSink("p2", "out", "parquet", {"path": str(tmp_path / "out")})
    with pytest.raises(ConfigurationError, match="written by stage 'out' of pipeline 'p1'.*choose another path"):
        other.claim()
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "data.parquet").write_bytes(b"not ours")
    with pytest.raises(ConfigurationError, match="already holds files this sink did not write"):
        TransactionalFileSink("p1", "x", "parquet", {"path": str(foreign)}).claim()
    assert (foreign / "data.parquet").read_bytes() == b"not ours"


def test_bad_sink_options_are_refused_before_spark_starts(tmp_path: Path) -> None:
    p = Pipeline("p")
    src = p.source("src", lambda spark: spark.readStream.format("rate").load())
    p.sink("files", inputs=[src], format="parquet")
    with pytest.raises(PipelineGraphError, match=r"sink 'files': format 'parquet' writes files: give options="):
        p.validate()
    p = Pipeline("p")
    src = p.source("src", lambda spark: spark.readStream.format("rate").load())
    p.sink("a", inputs=[src], format="parquet", options={"path": str(tmp_path / "x")})
    p.sink("b", inputs=[src], format="json", options={"path": str(tmp_path / "x") + "/"})
    with pytest.raises(PipelineGraphError, match="sinks 'a' and 'b' both write"):
        p.validate()
    with pytest.raises(ConfigurationError, match="not a file format"):
        TransactionalFileSink("p", "s", "jdbc", {"path": "x"})
