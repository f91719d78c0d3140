"""Spark streaming sources on real Spark (local mode): channel reader and deterministic generator."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pyspark.sql.streaming.datasource import ReadAllAvailable, ReadMaxFiles, ReadMaxRows

from airflow_arroyo.core.exceptions import ConfigurationError
from airflow_arroyo.runtime.channel import (
    Channel,
    ChannelError,
    ChannelSchemaError,
    ChannelTruncatedError,
    Entry,
    EntryKind,
)
from airflow_arroyo.runtime.inputs import KeyedChannelReader
from airflow_arroyo.runtime.sources import (
    FREEZE_WORKER_HEAP_ENV,
    STREAM_RUNNER_ENV_KEYS,
    WARM_KEY,
    ChannelDataSource,
    ChannelStreamReader,
    plan_batch_end,
    read_cap,
    read_channel,
    register_data_source,
    write_caps,
)
from airflow_arroyo.runtime.spark_checkpoint import checkpoint_offsets
from airflow_arroyo.testing import (
    ARROW_SCHEMA,
    GeneratorOptions,
    GeneratorStreamReader,
    generate_row,
    generate_rows,
    generator_source,
)

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


@pytest.mark.spark
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
    end_offset = query.lastProgress["sources"][0]["endOffset"]
    assert (json.loads(end_offset) if isinstance(end_offset, str) else end_offset) == {"pos": 11}


@pytest.mark.spark
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


@pytest.mark.spark
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


@pytest.mark.spark
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


@pytest.mark.spark
def test_reader_without_schema_fails_clearly(spark: Any, tmp_path: Path) -> None:
    uri = str(tmp_path / "noschema")
    Channel.create(uri)
    from pyspark.errors import AnalysisException

    with pytest.raises(AnalysisException, match="has no schema yet"):
        read_channel(spark, uri)
    with pytest.raises(AnalysisException, match="no channel at"):
        read_channel(spark, str(tmp_path / "missing"))


@pytest.mark.spark
def test_available_now_trigger_drains_what_exists_and_stops(spark: Any, tmp_path: Path) -> None:
    uri = str(tmp_path / "chan")
    ch = Channel.create(uri, SCHEMA)
    for b in range(3):
        ch.append_table(rows(b * 2, 2), b, "up")
        ch.append_barrier(b + 1, "up")
    checkpoint = str(tmp_path / "ck")
    rec = Recorder(checkpoint)
    query = (
        read_channel(spark, uri)
        .writeStream.trigger(availableNow=True)
        .foreachBatch(rec)
        .option("checkpointLocation", checkpoint)
        .start()
    )
    assert query.awaitTermination(300) is True
    assert rec.ends == [2, 4, 6] and rec.ids == list(range(6))


@pytest.mark.spark
def test_starting_streams_never_changes_the_shared_env_map_of_a_source(spark: Any, tmp_path: Path) -> None:
    """Each streaming read of a Python source puts entries into a map all its reader functions share
    (`PythonStreamingSourceRunner.init`). Queries started together must only replace values there: an insert
    racing another insert, or a task being serialized, left tasks that could not be deserialized
    (`OptionalDataException` in `HashMap.readObject`). So the keys are there from registration on, and no
    query adds one. (A source of its own, under a new name: the registry is shared by every session of the
    application, and the channel sources may have been read already.)"""
    name = f"arroyo_env_probe_{uuid.uuid4().hex[:8]}"

    class Probe(ChannelDataSource):
        @classmethod
        def name(cls) -> str:
            return name

    register_data_source(spark, Probe)
    env = spark._jsparkSession.sessionState().dataSourceManager().lookupDataSource(name).dataSourceCls().envVars()
    expected = set(spark.sparkContext.environment) | set(STREAM_RUNNER_ENV_KEYS)
    assert set(env.keySet()) == expected  # before any query read the source

    uri = str(tmp_path / "chan")
    ch = Channel.create(uri, SCHEMA)
    ch.append_table(rows(0, 4), 0, "up")
    ch.append_barrier(1, "up")
    reader = spark.readStream.format(name).option("uri", uri).option("stop_at_barriers", "true")
    seen: list[int] = []
    query = (reader.load().unionByName(reader.load()).writeStream.trigger(availableNow=True)
             .foreachBatch(lambda b, _i: seen.append(b.count()))
             .option("checkpointLocation", str(tmp_path / "ck")).start())
    assert query.awaitTermination(300) is True and sum(seen) == 8  # two streams read the source
    assert set(env.keySet()) == expected  # Spark put no key the registration had not
    assert env.size() == len(list(env.entrySet()))


@pytest.mark.spark
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


def test_the_generator_is_still_exported_by_the_runtime_package() -> None:
    """0.1 documented ``from airflow_arroyo.runtime import generator_source``; it moved to ``testing``."""
    import airflow_arroyo.runtime as runtime
    import airflow_arroyo.testing as testing

    assert (runtime.generator_source, runtime.generate_rows, runtime.GeneratorDataSource) == (
        testing.generator_source, testing.generate_rows, testing.GeneratorDataSource)


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


@pytest.mark.spark
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


# ---------------------------------------------------------------------- the planner, without Spark
def fake_entries(spec: list[tuple[str, int, int]]) -> list[Entry]:
    return [
        Entry(i, EntryKind.BARRIER, "w", epoch=i)
        if kind == "b"
        else Entry(i, EntryKind.DATA, "w", files=tuple(f"f{i}-{j}" for j in range(nfiles)), rows=nrows)
        for i, (kind, nrows, nfiles) in enumerate(spec)
    ]


entry_specs = st.lists(
    st.one_of(
        st.tuples(st.just("d"), st.integers(1, 4), st.integers(1, 3)),
        st.tuples(st.just("b"), st.just(0), st.just(0)),
    ),
    max_size=25,
)


def test_plan_batch_end_examples() -> None:
    entries = fake_entries([("d", 2, 1), ("d", 2, 1), ("b", 0, 0), ("d", 1, 2), ("d", 1, 2)])
    assert plan_batch_end(0, 5, iter(entries), True) == 3
    assert plan_batch_end(0, 5, iter(entries), False) == 5
    assert plan_batch_end(0, 2, iter(entries), True) == 2  # capped
    assert plan_batch_end(3, 2, iter(entries[3:]), True) == 3  # cap below the position: no rewind
    assert plan_batch_end(0, 5, iter(entries), True, max_rows=3) == 1  # 2 + 2 > 3
    assert plan_batch_end(0, 5, iter(entries), True, max_rows=4) == 3  # 2 + 2 + 0 <= 4, barrier ends it
    assert plan_batch_end(3, 5, iter(entries[3:]), False, max_files=3) == 4
    assert plan_batch_end(3, 5, iter(entries[3:]), False, max_files=1) == 4  # at least one entry
    assert plan_batch_end(5, 5, iter([]), True) == 5


@settings(max_examples=300, deadline=None, database=None)
@given(
    spec=entry_specs,
    data=st.data(),
    stop=st.booleans(),
    max_rows=st.none() | st.integers(1, 12),
    max_files=st.none() | st.integers(1, 5),
)
def test_plan_batch_end_properties(spec, data, stop, max_rows, max_files) -> None:
    entries = fake_entries(spec)
    n = len(entries)
    begin = data.draw(st.integers(0, n))
    available = data.draw(st.integers(begin, n))
    end = plan_batch_end(begin, available, iter(entries[begin:]), stop, max_rows, max_files)
    if available == begin:
        assert end == begin
        return
    assert begin < end <= available  # progress, never past the cap
    batch = entries[begin:end]
    if stop:
        assert all(not e.is_barrier for e in batch[:-1])  # never crosses a barrier
    if len(batch) > 1:  # a limit may only be exceeded by a single entry
        assert max_rows is None or sum(e.rows for e in batch) <= max_rows
        assert max_files is None or sum(len(e.files) for e in batch) <= max_files
    if end < available and not (stop and batch[-1].is_barrier):  # it stopped for a limit: maximal
        grown = entries[begin : end + 1]
        assert (max_rows is not None and sum(e.rows for e in grown) > max_rows) or (
            max_files is not None and sum(len(e.files) for e in grown) > max_files
        )


@settings(max_examples=100, deadline=None, database=None)
@given(spec=entry_specs)
def test_reading_to_the_end_cuts_exactly_at_every_barrier(spec) -> None:
    entries = fake_entries(spec)
    pos, ends = 0, []
    while pos < len(entries):
        pos = plan_batch_end(pos, len(entries), iter(entries[pos:]), True)
        ends.append(pos)
    barrier_ends = [e.index + 1 for e in entries if e.is_barrier]
    expected = sorted(set(barrier_ends) | ({len(entries)} if entries else set()))
    assert ends == expected


def open_reader(uri: str, **options: str) -> ChannelStreamReader:
    source = ChannelDataSource({"uri": uri, **options})
    reader = source.streamReader(source.schema())
    assert isinstance(reader, ChannelStreamReader)
    return reader


def test_channel_reader_planning_without_spark(tmp_path: Path) -> None:
    uri = str(tmp_path / "chan")
    caps = str(tmp_path / "caps.json")
    ch = Channel.create(uri, SCHEMA)
    ch.append_table(rows(0, 4), 0, "up")  # 0
    ch.append_barrier(1, "up")  # 1
    ch.append_table(rows(4, 4), 1, "up")  # 2
    reader = open_reader(uri, cap_path=caps)
    assert reader.initialOffset() == {"pos": 0}
    assert reader.getDefaultReadLimit() == ReadAllAvailable()
    assert reader.latestOffset({"pos": 0}, ReadAllAvailable()) == {"pos": 2}
    assert reader.latestOffset({"pos": 2}, ReadAllAvailable()) == {"pos": 3}
    assert reader.latestOffset({"pos": 3}, ReadAllAvailable()) == {"pos": 3}  # nothing new
    assert reader.reportLatestOffset() == {"pos": 3}
    write_caps(caps, {uri: 1})
    assert reader.latestOffset({"pos": 0}, ReadAllAvailable()) == {"pos": 1}
    assert reader.latestOffset({"pos": 2}, ReadAllAvailable()) == {"pos": 2}  # cap below: no rewind

    parts = reader.partitions({"pos": 0}, {"pos": 3})
    assert [p.path for p in parts] == [f for e in ch.data_entries(0, 3) for f in e.files]
    assert reader.partitions({"pos": 1}, {"pos": 2}) == []  # a barrier-only batch
    # executors get a pickled reader and partition
    remote = pickle.loads(pickle.dumps(reader))
    got = [b for p in parts for b in remote.read(pickle.loads(pickle.dumps(p)))]
    assert pa.Table.from_batches(got).column("id").to_pylist() == list(range(8))
    assert got[0].schema == pa.schema([("id", pa.int64()), ("key", pa.string())])

    reader.commit({"pos": 3})
    with pytest.raises(ChannelError, match="without restoring this query's checkpoint"):
        reader.latestOffset({"pos": 7}, ReadAllAvailable())
    ch.truncate_before(2)
    assert open_reader(uri).initialOffset() == {"pos": 2}
    with pytest.raises(ChannelTruncatedError):
        reader.partitions({"pos": 0}, {"pos": 3})
    with pytest.raises(ChannelError, match="retention deleted"):
        list(remote.read(parts[0]))


def test_channel_reader_options_and_limits(tmp_path: Path) -> None:
    uri = str(tmp_path / "chan")
    ch = Channel.create(uri, SCHEMA)
    for b in range(4):
        ch.append_table(rows(b * 10, 10), b, "up")
    reader = open_reader(uri, max_rows_per_batch="25")
    assert reader.getDefaultReadLimit() == ReadMaxRows(25)
    assert reader.latestOffset({"pos": 0}, ReadMaxRows(25)) == {"pos": 2}
    assert reader.latestOffset({"pos": 0}, ReadMaxRows(5)) == {"pos": 1}  # at least one entry
    assert reader.latestOffset({"pos": 0}, ReadAllAvailable()) == {"pos": 4}  # the engine's limit wins
    assert open_reader(uri, max_files_per_batch="3").getDefaultReadLimit() == ReadMaxFiles(3)
    assert reader.latestOffset({"pos": 1}, ReadMaxFiles(3)) == {"pos": 4}
    reader.prepareForTriggerAvailableNow()
    ch.append_table(rows(40, 10), 4, "up")
    assert reader.latestOffset({"pos": 0}, ReadAllAvailable()) == {"pos": 4}  # AvailableNow target
    with pytest.raises(ConfigurationError, match="stop_at_barriers"):
        open_reader(uri, stop_at_barriers="maybe")
    with pytest.raises(ConfigurationError, match="max_rows_per_batch"):
        open_reader(uri, max_rows_per_batch="0")
    with pytest.raises(ConfigurationError, match="channel URI"):
        ChannelDataSource({}).schema()
    with pytest.raises(ChannelError, match="not valid JSON"):
        (tmp_path / "bad.json").write_text("{not json")
        read_cap(str(tmp_path / "bad.json"), uri)


def test_a_resumed_reader_offers_one_batch_of_no_rows_and_moves_no_position(tmp_path: Path) -> None:
    uri = str(tmp_path / "chan")
    ch = Channel.create(uri, SCHEMA)
    ch.append_table(rows(0, 4), 0, "up")  # 0
    ch.append_barrier(1, "up")  # 1: a restore cut the channel here; the checkpoint resumes at 2
    # with nothing to read: the same position, a count one higher (Spark runs a batch when an offset changes), once
    reader = open_reader(uri, warm_up="true")
    assert reader.latestOffset({"pos": 2}, ReadAllAvailable()) == {"pos": 2, WARM_KEY: 1}
    assert reader.partitions({"pos": 2}, {"pos": 2, WARM_KEY: 1}) == []  # no rows
    assert reader.latestOffset({"pos": 2, WARM_KEY: 1}, ReadAllAvailable()) == {"pos": 2, WARM_KEY: 1}  # no more
    ch.append_table(rows(4, 4), 1, "up")  # 2
    assert reader.latestOffset({"pos": 2, WARM_KEY: 1}, ReadAllAvailable()) == {"pos": 3}  # reading drops it
    # resumed again where the count still stands: one higher; with something to read no batch of no rows
    assert open_reader(uri, warm_up="true").latestOffset({"pos": 3, WARM_KEY: 1}, ReadAllAvailable()) == {
        "pos": 3, WARM_KEY: 2}
    assert open_reader(uri, warm_up="true").latestOffset({"pos": 2}, ReadAllAvailable()) == {"pos": 3}
    assert open_reader(uri).latestOffset({"pos": 3}, ReadAllAvailable()) == {"pos": 3}  # off by default
    # a stage input's offsets keep the count beside the input's key
    keyed = KeyedChannelReader(uri, {"cap_key": "src", "warm_up": "true"}, ChannelDataSource({"uri": uri}).schema())
    assert keyed.latestOffset({"pos": 3, "key": "src"}, ReadAllAvailable()) == {"pos": 3, "key": "src", WARM_KEY: 1}
    with pytest.raises(ConfigurationError, match="warm_up"):
        open_reader(uri, warm_up="maybe")


def test_generator_reader_offsets_without_spark() -> None:
    now = [100.0]
    paced = GeneratorStreamReader(
        GeneratorOptions.parse({"rows_per_second": "50", "start": "10", "total_rows": "200"}), clock=lambda: now[0]
    )
    assert paced.initialOffset() == {"id": 10}
    assert paced.latestOffset({"id": 10}, ReadAllAvailable()) == {"id": 10}  # the clock starts now
    now[0] += 1.5
    assert paced.latestOffset({"id": 10}, ReadAllAvailable()) == {"id": 85}
    assert paced.latestOffset({"id": 10}, ReadMaxRows(20)) == {"id": 30}
    now[0] += 100
    assert paced.latestOffset({"id": 85}, ReadAllAvailable()) == {"id": 210}  # total_rows ends it
    assert paced.reportLatestOffset() == {"id": 210}

    batched = GeneratorStreamReader(GeneratorOptions.parse({"rows_per_batch": "7", "seed": "5", "keys": "3"}))
    assert batched.getDefaultReadLimit() == ReadMaxRows(7)
    assert batched.latestOffset({"id": 0}, ReadMaxRows(7)) == {"id": 7}
    with pytest.raises(ConfigurationError):
        batched.latestOffset({"id": 0}, ReadAllAvailable())  # unbounded and no limit
    parts = batched.partitions({"id": 3}, {"id": 10})
    assert [(p.start, p.end) for p in parts] == [(3, 6), (6, 10)]
    got = pa.Table.from_batches([b for p in parts for b in batched.read(p)])
    assert got.equals(generate_rows(5, 3, 10, 3))
    assert batched.partitions({"id": 10}, {"id": 10}) == []


_WORKER_READS = """
import gc, json, sys
from pyspark import TaskContext
from airflow_arroyo.testing import GeneratorOptions, GeneratorPartition, GeneratorStreamReader

reader = GeneratorStreamReader(GeneratorOptions.parse({"rows_per_batch": "10"}))


def read(start):
    rows = sum(b.num_rows for b in reader.read(GeneratorPartition(start, start + 10)))
    assert rows == 10
    return gc.get_freeze_count()


def task(start):
    # as pyspark/worker.py's main runs a task: the task's context set for it and cleared after it
    TaskContext._setTaskContext(TaskContext.from_json({
        "stageId": 1, "partitionId": 0, "attemptNumber": 0, "taskAttemptId": start, "cpus": 1, "resources": {},
        "localProperties": {}}))
    try:
        return read(start)
    finally:
        TaskContext._setTaskContext(None)


outside = read(0)  # a read called directly, outside any task (a test, a driver-side tool)
counts = [outside, task(0), task(10), task(20)]  # the first read imports more (pyarrow's pandas shim)
import xml.dom.minidom  # a new import, as a later task's code may bring
counts.append(task(30))
print(json.dumps(counts))
"""


@pytest.mark.parametrize("setting", [None, "false"])
def test_a_source_read_freezes_the_worker_heap_once_per_import(setting: str | None) -> None:
    """A reused Spark Python worker runs a full gc.collect() after every task; a source's read takes what the
    process has imported out of those passes, once, and again after new imports (in a process of its own: the
    freeze is process-wide). ARROYO_FREEZE_WORKER_HEAP=false leaves the collector alone. A read outside a Spark
    task (called directly, as tests do) leaves the calling process's collector alone too."""
    env = {k: v for k, v in os.environ.items() if k != FREEZE_WORKER_HEAP_ENV}
    if setting is not None:
        env[FREEZE_WORKER_HEAP_ENV] = setting
    out = subprocess.run([sys.executable, "-c", _WORKER_READS], env=env, capture_output=True, text=True, check=True)
    outside, first, second, settled, after_import = json.loads(out.stdout.strip().splitlines()[-1])
    assert outside == 0
    if setting == "false":
        assert (first, second, settled, after_import) == (0, 0, 0, 0)
    else:
        assert first > 0  # the import-time heap is frozen by the first read in a task
        # nothing imported since: nothing more frozen (what was frozen may still be freed: the first task's context)
        assert settled == second <= first
        assert after_import > settled  # the new module's objects too


def _read_in_a_task(_: Iterator[int]) -> Iterator[tuple[int, int, bool]]:
    import gc

    from pyspark import TaskContext

    from airflow_arroyo.testing import GeneratorOptions, GeneratorPartition, GeneratorStreamReader

    reader = GeneratorStreamReader(GeneratorOptions.parse({"rows_per_batch": "10"}))
    rows = sum(b.num_rows for b in reader.read(GeneratorPartition(0, 10)))
    yield rows, gc.get_freeze_count(), TaskContext.get() is not None


@pytest.mark.spark
def test_a_source_read_in_a_real_spark_task_freezes_that_python_worker(spark: Any) -> None:
    """The other side of the task check: in a Python worker Spark started, a read runs inside a task (PySpark's
    worker.py sets the task context for RDD functions and a data source's read alike) and freezes the heap."""
    if os.environ.get(FREEZE_WORKER_HEAP_ENV):
        pytest.skip(f"{FREEZE_WORKER_HEAP_ENV} is set in this environment")
    got = spark.sparkContext.parallelize([0], 1).mapPartitions(_read_in_a_task).collect()
    assert len(got) == 1
    rows, frozen, in_task = got[0]
    assert (rows, in_task) == (10, True)
    assert frozen > 0
