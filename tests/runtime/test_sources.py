"""Spark streaming sources on real Spark (local mode): channel reader and deterministic generator."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from airflow_arroyo.exceptions import ConfigurationError
from airflow_arroyo.runtime.channel import Channel, ChannelSchemaError
from airflow_arroyo.runtime.generator import (
    ARROW_SCHEMA,
    GeneratorOptions,
    generate_row,
    generate_rows,
    generator_source,
)
from airflow_arroyo.runtime.sources import checkpoint_offsets, read_cap, read_channel, write_caps

pytestmark = pytest.mark.spark

SCHEMA = pa.schema([("id", pa.int64()), ("key", pa.string())])


def rows(start: int, n: int) -> pa.Table:
    return pa.table(
        {
            "id": pa.array(range(start, start + n), pa.int64()),
            "key": pa.array([f"k{i % 3}" for i in range(start, start + n)], pa.string()),
        }
    )


class Recorder:
    """foreachBatch function recording each micro-batch's ids and its channel end position."""

    def __init__(self, checkpoint: str, source_index: int = 0) -> None:
        self.checkpoint = checkpoint
        self.source_index = source_index
        self.batches: list[tuple[int, list[int], int]] = []

    def __call__(self, df: Any, batch_id: int) -> None:
        got = sorted(df.toArrow().column("id").to_pylist())
        offsets = checkpoint_offsets(self.checkpoint, batch_id)
        end = offsets[self.source_index]
        assert end is not None
        self.batches.append((batch_id, got, int(end["pos"])))

    @property
    def ends(self) -> list[int]:
        return [end for _, _, end in self.batches]

    @property
    def ids(self) -> list[int]:
        return [i for _, got, _ in self.batches for i in got]


@pytest.fixture
def run_query(spark: Any) -> Iterator[Callable[..., Any]]:
    started: list[Any] = []

    def start(df: Any, fn: Callable[[Any, int], None], checkpoint: str) -> Any:
        query = df.writeStream.foreachBatch(fn).option("checkpointLocation", checkpoint).start()
        started.append(query)
        return query

    yield start
    for q in started:
        if q.isActive:
            q.stop()


def assert_never_crosses_barriers(ch: Channel, recorder: Recorder) -> None:
    start = 0
    for _, _, end in recorder.batches:
        barriers = [e.index for e in ch.entries(start, end) if e.is_barrier]
        assert all(b == end - 1 for b in barriers), (start, end, barriers)
        start = end


def test_batches_end_right_after_barriers(spark: Any, tmp_path: Path, run_query: Callable[..., Any]) -> None:
    uri = str(tmp_path / "chan")
    ch = Channel.create(uri, SCHEMA)
    ch.append_table(rows(0, 5), 0, "up")  # 0
    ch.append_table(rows(5, 5), 1, "up")  # 1
    ch.append_barrier(1, "up")  # 2
    ch.append_table(rows(10, 5), 2, "up")  # 3
    ch.append_barrier(2, "up")  # 4
    ch.append_barrier(3, "up")  # 5 (a barrier right after a barrier: a barrier-only batch)
    ch.append_table(rows(15, 5), 3, "up")  # 6
    ch.append_table(rows(20, 5), 4, "up")  # 7

    checkpoint = str(tmp_path / "ck")
    rec = Recorder(checkpoint)
    query = run_query(read_channel(spark, uri), rec, checkpoint)
    query.processAllAvailable()
    assert rec.ends == [3, 5, 6, 8]
    assert [len(got) for _, got, _ in rec.batches] == [10, 5, 0, 10]
    assert rec.ids == list(range(25))
    assert_never_crosses_barriers(ch, rec)

    # The channel keeps growing while the query runs.
    ch.append_table(rows(25, 5), 5, "up")  # 8
    ch.append_barrier(4, "up")  # 9
    ch.append_table(rows(30, 5), 6, "up")  # 10
    query.processAllAvailable()
    assert rec.ends == [3, 5, 6, 8, 10, 11]
    assert rec.ids == list(range(35))
    assert_never_crosses_barriers(ch, rec)
    assert query.lastProgress["sources"][0]["endOffset"] == json.dumps({"pos": 11}).replace(" ", "") or (
        json.loads(query.lastProgress["sources"][0]["endOffset"]) == {"pos": 11}
    )


def test_back_edge_reader_crosses_barriers_but_skips_them(
    spark: Any, tmp_path: Path, run_query: Callable[..., Any]
) -> None:
    uri = str(tmp_path / "loop")
    ch = Channel.create(uri, SCHEMA)
    ch.append_table(rows(0, 3), 0, "tail")
    ch.append_barrier(1, "tail")
    ch.append_table(rows(3, 3), 1, "tail")
    ch.append_barrier(2, "tail")
    checkpoint = str(tmp_path / "ck")
    rec = Recorder(checkpoint)
    query = run_query(read_channel(spark, uri, stop_at_barriers=False), rec, checkpoint)
    query.processAllAvailable()
    assert rec.ends == [4]
    assert rec.ids == list(range(6))


def test_cap_file_holds_the_reader_until_it_changes(
    spark: Any, tmp_path: Path, run_query: Callable[..., Any]
) -> None:
    uri = str(tmp_path / "chan")
    caps = str(tmp_path / "control" / "caps.json")
    ch = Channel.create(uri, SCHEMA)
    for b in range(4):
        ch.append_table(rows(b * 2, 2), b, "up")
    write_caps(caps, {uri: 2, "some-other-channel": 0})
    assert read_cap(caps, uri) == 2 and read_cap(caps, "absent") is None
    assert read_cap(str(tmp_path / "no-such-file.json"), uri) is None

    checkpoint = str(tmp_path / "ck")
    rec = Recorder(checkpoint)
    query = run_query(read_channel(spark, uri, cap_path=caps), rec, checkpoint)
    query.processAllAvailable()
    assert rec.ends == [2] and rec.ids == [0, 1, 2, 3]
    ch.append_table(rows(8, 2), 4, "up")
    query.processAllAvailable()
    assert rec.ends == [2]  # held: more data exists, the cap did not move

    write_caps(caps, {uri: 4})
    query.processAllAvailable()
    assert rec.ends == [2, 4]
    write_caps(caps, {})  # no cap for this channel any more: released to the end
    query.processAllAvailable()
    assert rec.ends == [2, 4, 5]
    assert rec.ids == list(range(10))


def test_cap_key_and_read_limits(spark: Any, tmp_path: Path, run_query: Callable[..., Any]) -> None:
    uri = str(tmp_path / "chan")
    caps = str(tmp_path / "caps.json")
    ch = Channel.create(uri, SCHEMA)
    for b in range(5):
        ch.append_table(rows(b * 10, 10), b, "up")
    write_caps(caps, {"orders": 4, uri: 1})  # the key named by cap_key wins over the uri
    checkpoint = str(tmp_path / "ck")
    rec = Recorder(checkpoint)
    df = read_channel(spark, uri, cap_path=caps, cap_key="orders", max_rows_per_batch=25)
    query = run_query(df, rec, checkpoint)
    query.processAllAvailable()
    assert rec.ends == [2, 4]  # 20 rows per batch (a third entry would pass 25), capped at 4
    write_caps(caps, {"orders": 5})
    query.processAllAvailable()
    assert rec.ends == [2, 4, 5] and rec.ids == list(range(50))


def test_reader_without_schema_fails_clearly(spark: Any, tmp_path: Path) -> None:
    uri = str(tmp_path / "noschema")
    Channel.create(uri)
    with pytest.raises(Exception, match="has no schema yet"):
        read_channel(spark, uri)
    with pytest.raises(Exception, match="no channel at"):
        read_channel(spark, str(tmp_path / "missing"))


def test_append_spark_batch(spark: Any, tmp_path: Path) -> None:
    uri = str(tmp_path / "chan")
    ch = Channel.create(uri)
    df = spark.createDataFrame(rows(0, 7).to_pandas()).repartition(3)
    assert ch.append_spark_batch(df, 0, "stage") == 0
    assert ch.append_spark_batch(df, 0, "stage") is None  # replay
    entry = ch.entry(0)
    assert entry.rows == 7 and 1 <= len(entry.files) <= 3
    assert all(f.startswith(entry.dir + "/") and f.endswith(".parquet") for f in entry.files)
    assert sorted(ch.read_table().column("id").to_pylist()) == list(range(7))
    assert ch.spark_schema is not None and ch.spark_schema.simpleString() == "struct<id:bigint,key:string>"

    empty = df.filter("id < 0")
    assert ch.append_spark_batch(empty, 1, "stage") is None  # empty batches leave no entry
    assert ch.end_position() == 1
    assert [p.name for p in (Path(uri) / "data").iterdir()] == [Path(entry.dir).name]
    with pytest.raises(ChannelSchemaError):
        ch.append_spark_batch(df.selectExpr("cast(id as string) as id", "key"), 2, "stage")
    assert ch.end_position() == 1


def test_generator_rows_are_a_pure_function() -> None:
    table = generate_rows(seed=42, start=1000, end=1300, keys=7, ms_per_row=3)
    assert table.schema == ARROW_SCHEMA
    reference = [generate_row(42, i, 7, 3) for i in range(1000, 1300)]
    assert table.column("id").to_pylist() == [r[0] for r in reference]
    assert table.column("key").to_pylist() == [r[1] for r in reference]
    assert table.column("value").to_pylist() == [r[2] for r in reference]
    assert table.column("ts").cast(pa.int64()).to_pylist() == [r[3] for r in reference]
    assert set(table.column("key").to_pylist()) == {f"k{i}" for i in range(7)}
    assert generate_rows(43, 1000, 1300, 7, 3).column("value") != table.column("value")
    # any sub-range is the same rows: replaying part of an offset range gives identical data
    assert generate_rows(42, 1100, 1200, 7, 3).equals(table.slice(100, 100))
    assert generate_rows(42, 5, 5, 7).num_rows == 0


def test_generator_options_are_validated() -> None:
    with pytest.raises(ConfigurationError, match="pace"):
        GeneratorOptions.parse({"seed": "1"})
    with pytest.raises(ConfigurationError, match="keys"):
        GeneratorOptions.parse({"keys": "0", "total_rows": "5"})
    with pytest.raises(ConfigurationError, match="integer"):
        GeneratorOptions.parse({"rows_per_batch": "lots"})
    opts = GeneratorOptions.parse({"SEED": "3", "total_rows": "10", "start": "5"})
    assert (opts.seed, opts.end) == (3, 15)


def test_generator_through_a_channel_replays_identically(
    spark: Any, tmp_path: Path, run_query: Callable[..., Any]
) -> None:
    """generator -> foreachBatch -> channel: batches are capped, a replayed batch has the same rows and
    is not appended twice, a restarted query continues where it stopped, and the channel reader returns
    exactly the generated rows (timestamps included)."""
    uri = str(tmp_path / "chan")
    out = Channel.create(uri)
    checkpoint = str(tmp_path / "ck-gen")
    seen: dict[int, list[pa.Table]] = {}

    def sink(df: Any, batch_id: int) -> None:
        seen.setdefault(batch_id, []).append(df.toArrow().sort_by("id"))
        out.append_spark_batch(df, batch_id, "gen")
        out.append_barrier(batch_id + 1, "gen")

    def gen(total: int) -> Any:
        return generator_source(spark, seed=11, keys=4, rows_per_batch=100, total_rows=total)

    query = run_query(gen(250), sink, checkpoint)
    query.processAllAvailable()
    query.stop()
    assert sorted(seen) == [0, 1, 2]
    assert [t.num_rows for b in sorted(seen) for t in seen[b]] == [100, 100, 50]
    assert out.end_position() == 6

    # Forget that batch 2 was committed: Spark replays it from its recorded offsets.
    (Path(checkpoint) / "commits" / "2").unlink()
    (Path(checkpoint) / "commits" / ".2.crc").unlink(missing_ok=True)
    query = run_query(gen(400), sink, checkpoint)
    query.processAllAvailable()
    query.stop()
    assert len(seen[2]) == 2 and seen[2][0].equals(seen[2][1])  # identical rows on replay
    assert sorted(seen) == [0, 1, 2, 3, 4]
    assert [t.num_rows for b in (3, 4) for t in seen[b]] == [100, 50]
    # the replay appended nothing: data, barrier per batch
    kinds = [(e.kind.value, e.batch_id if e.epoch is None else e.epoch) for e in out.entries(0)]
    assert kinds == [(k, v) for b in range(5) for k, v in (("data", b), ("barrier", b + 1))]

    expected = generate_rows(11, 0, 400, 4)
    assert out.read_table().sort_by("id").equals(expected)

    # ... and the channel source hands Spark exactly those rows, timestamps included.
    collected: list[pa.Table] = []
    checkpoint2 = str(tmp_path / "ck-read")
    reader = run_query(read_channel(spark, uri), lambda df, _b: collected.append(df.toArrow()), checkpoint2)
    reader.processAllAvailable()
    reader.stop()
    assert len(collected) == 5  # one batch per barrier
    got = pa.concat_tables(collected).sort_by("id")
    assert got.schema.names == ["id", "key", "value", "ts"]
    assert got.column("id").equals(expected.column("id"))
    assert got.column("key").equals(expected.column("key"))
    assert got.column("value").equals(expected.column("value"))
    assert got.column("ts").cast(pa.int64()).equals(expected.column("ts").cast(pa.int64()))
