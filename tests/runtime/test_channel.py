"""Channel log: appends, barriers, idempotency, truncation, schema, concurrency (real files)."""

from __future__ import annotations

import json
import multiprocessing as mp
import pickle
import uuid
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from airflow_arroyo.core.exceptions import ConcurrencyConflict, ConfigurationError
from airflow_arroyo.runtime.channel import (
    Channel,
    ChannelError,
    ChannelSchemaError,
    ChannelTruncatedError,
    EntryKind,
    log_path,
)

SCHEMA = pa.schema([("id", pa.int64()), ("key", pa.string())])


def rows(start: int, n: int) -> pa.Table:
    return pa.table(
        {
            "id": pa.array(range(start, start + n), pa.int64()),
            "key": pa.array([f"k{i % 3}" for i in range(n)], pa.string()),
        }
    )


def ids(table: pa.Table) -> list[int]:
    return table.column("id").to_pylist()


@pytest.fixture
def uri(tmp_path: Path) -> str:
    return str(tmp_path / "chan")


def data_dirs(uri: str) -> list[str]:
    d = Path(uri) / "data"
    return sorted(p.name for p in d.iterdir()) if d.exists() else []


def test_append_read_round_trip(uri: str) -> None:
    ch = Channel.create(uri)
    assert ch.end_position() == 0 and ch.schema is None
    assert ch.append_table(rows(0, 3), batch_id=0, writer="src") == 0
    assert ch.append_barrier(1, writer="src") == 1
    assert ch.append_table(rows(3, 2), batch_id=1, writer="src") == 2
    assert ch.end_position() == 3

    kinds = [(e.index, e.kind, e.epoch, e.rows, e.batch_id) for e in ch.entries(0, 3)]
    assert kinds == [
        (0, EntryKind.DATA, None, 3, 0),
        (1, EntryKind.BARRIER, 1, 0, None),
        (2, EntryKind.DATA, None, 2, 1),
    ]
    assert ids(ch.read_table(0, 3)) == [0, 1, 2, 3, 4]
    assert ids(ch.read_table(1, 3)) == [3, 4]
    assert ids(ch.read_table(0, 2)) == [0, 1, 2]
    assert ch.read_table(1, 2).num_rows == 0 and ch.read_table(1, 2).schema == ch.schema

    # A fresh handle (another process in real life) sees the same log.
    other = Channel.open(uri)
    assert other.end_position() == 3
    assert ids(other.read_table()) == [0, 1, 2, 3, 4]
    assert other.schema == pa.schema([("id", pa.int64()), ("key", pa.string())])
    # The on-disk entry is the documented JSON.
    raw = json.loads((Path(uri) / log_path(1)).read_text())
    assert {k: raw[k] for k in ("kind", "epoch", "writer")} == {"kind": "barrier", "epoch": 1, "writer": "src"}
    header = json.loads((Path(uri) / "_channel.json").read_text())
    assert header["format_version"] == 2


def test_barrier_lookup_and_idempotency(uri: str) -> None:
    ch = Channel.create(uri, SCHEMA)
    ch.append_table(rows(0, 1), 0, "s")
    assert ch.append_barrier(1, "s") == 1
    assert ch.append_barrier(1, "s") == 1  # replay: same index, nothing appended
    assert ch.end_position() == 2
    ch.append_table(rows(1, 1), 1, "s")
    ch.append_table(rows(2, 1), 2, "s")
    assert ch.append_barrier(2, "s") == 4
    assert Channel.open(uri).append_barrier(2, "s") == 4  # idempotent across handles too
    with pytest.raises(ChannelError, match="backwards"):
        ch.append_barrier(1, "s")
    assert ch.end_position() == 5

    assert ch.find_barrier(1) == 1 and ch.find_barrier(2) == 4 and ch.find_barrier(3) is None
    assert ch.next_barrier_at_or_after(0) == 1
    assert ch.next_barrier_at_or_after(1) == 1
    assert ch.next_barrier_at_or_after(2) == 4
    assert ch.next_barrier_at_or_after(5) is None
    assert ch.next_barrier_at_or_after(2, end=4) is None
    with pytest.raises(ConfigurationError):
        ch.append_barrier(-1, "s")
    with pytest.raises(ConfigurationError):
        ch.append_barrier(3, "")


def test_replayed_batch_is_not_appended_twice(uri: str) -> None:
    ch = Channel.create(uri)
    assert ch.append_table(rows(0, 2), 0, "w") == 0
    assert ch.append_table(rows(2, 2), 1, "w") == 1
    assert ch.append_table(rows(100, 2), 1, "w") is None  # replay of batch 1
    assert ch.append_table(rows(100, 2), 0, "w") is None  # older batch
    assert Channel.open(uri).append_table(rows(100, 2), 1, "w") is None  # a restarted driver
    assert ch.end_position() == 2 and ids(ch.read_table()) == [0, 1, 2, 3]
    assert len(data_dirs(uri)) == 2  # the replays wrote no data files
    assert ch.last_batch_id("w") == 1 and ch.last_batch_id("other") is None
    # batch ids are per writer
    assert ch.append_table(rows(9, 1), 0, "other") == 2


def test_empty_batch_leaves_no_entry(uri: str) -> None:
    ch = Channel.create(uri)
    assert ch.append_table(rows(0, 0), 0, "w") is None
    assert ch.end_position() == 0 and data_dirs(uri) == []
    assert ch.schema is None  # an empty Arrow batch does not fix the schema (its types are guesses)
    assert ch.append_table(rows(0, 1), 1, "w") == 0
    assert ch.schema is not None
    with pytest.raises(ChannelSchemaError):  # but it is checked once the schema is known
        ch.append_table(pa.table({"x": pa.array([], pa.int8())}), 2, "w")
    assert ch.append_table(rows(0, 0), 2, "w") is None
    assert ch.end_position() == 1


def test_schema_is_fixed_and_mismatch_is_clear(uri: str) -> None:
    ch = Channel.create(uri, SCHEMA)
    assert Channel.create(uri, SCHEMA).schema == ch.schema  # idempotent create
    bad = pa.table({"id": pa.array(["x"]), "key": ["k"]})
    with pytest.raises(ChannelSchemaError, match=r"struct<id:bigint,key:string>.*struct<id:string"):
        ch.append_table(bad, 0, "w")
    assert ch.end_position() == 0 and data_dirs(uri) == []  # nothing written
    with pytest.raises(ChannelSchemaError):
        Channel.create(uri, pa.schema([("other", pa.int32())]))
    # nullability and column order of the batch do not matter; names and types do
    reordered = pa.table({"key": ["a"], "id": pa.array([7], pa.int64())})
    with pytest.raises(ChannelSchemaError):
        ch.append_table(reordered, 0, "w")
    non_null = rows(0, 2).cast(pa.schema([pa.field("id", pa.int64(), False), ("key", pa.string())]))
    assert ch.append_table(non_null, 0, "w") == 0
    # ChannelSchemaError is a ConfigurationError (bad input, raised before anything is written)
    assert issubclass(ChannelSchemaError, ConfigurationError)


def test_open_missing_and_future_version(tmp_path: Path) -> None:
    with pytest.raises(ChannelError, match="no channel at"):
        Channel.open(str(tmp_path / "nothing"))
    assert not Channel.exists(str(tmp_path / "nothing"))
    (tmp_path / "future").mkdir()
    (tmp_path / "future" / "_channel.json").write_text(json.dumps({"format_version": 3}))
    with pytest.raises(ChannelError, match="format_version 3"):
        Channel.open(str(tmp_path / "future"))


def test_truncate_from_for_restore(uri: str) -> None:
    ch = Channel.create(uri)
    ch.append_table(rows(0, 2), 0, "w")  # 0
    ch.append_barrier(1, "w")  # 1
    ch.append_table(rows(2, 2), 1, "w")  # 2
    ch.append_barrier(2, "w")  # 3
    ch.append_table(rows(4, 2), 2, "w")  # 4
    stale = Channel.open(uri)
    assert stale.end_position() == 5  # caches the end
    size_before = ch.size_bytes()

    cut = ch.find_barrier(1)
    assert cut == 1
    ch.truncate_from(cut + 1)
    assert ch.end_position() == 2 and ids(ch.read_table()) == [0, 1]
    assert len(data_dirs(uri)) == 1 and ch.size_bytes() < size_before
    assert ch.find_barrier(2) is None
    # The writer restarts from the epoch's Spark checkpoint: batch 1 comes again and is appended.
    assert ch.append_table(rows(2, 2), 1, "w") == 2
    # A handle that cached the old end notices the truncation instead of writing past a gap.
    assert stale.end_position() == 3
    assert stale.append_barrier(2, "w") == 3
    assert ids(Channel.open(uri).read_table()) == [0, 1, 2, 3]

    ch.truncate_from(4)  # at the end: nothing to do
    with pytest.raises(ChannelError, match="only 4 entries"):
        ch.truncate_from(9)


def test_truncate_before_for_retention(uri: str) -> None:
    ch = Channel.create(uri)
    ch.append_table(rows(0, 50), 0, "w")  # 0
    ch.append_barrier(1, "w")  # 1
    ch.append_table(rows(50, 50), 1, "w")  # 2
    ch.append_barrier(2, "w")  # 3
    ch.append_table(rows(100, 50), 2, "w")  # 4
    expected_freed = sum(
        p.stat().st_size for p in (Path(uri) / "data").rglob("*") if p.is_file() and "-b2-" not in str(p)
    ) + sum((Path(uri) / log_path(i)).stat().st_size for i in range(4))

    freed = ch.truncate_before(4)
    assert freed == expected_freed
    assert ch.start_position() == 4 and ch.end_position() == 5
    assert ids(ch.read_table()) == list(range(100, 150))
    assert sorted(p.name for p in (Path(uri) / "log").iterdir()) == [Path(log_path(4)).name]
    with pytest.raises(ChannelTruncatedError, match="deleted by retention"):
        ch.read_table(2, 5)
    with pytest.raises(ChannelTruncatedError):
        Channel.open(uri).entries(0, 5)
    with pytest.raises(ChannelTruncatedError):
        ch.truncate_from(2)
    # Re-running is harmless; positions stay absolute; the log keeps growing from its end.
    assert ch.truncate_before(4) == 0
    reopened = Channel.open(uri)
    assert reopened.end_position() == 5
    assert reopened.append_barrier(3, "w") == 5
    assert reopened.find_barrier(3) == 5 and reopened.find_barrier(2) is None


def test_idempotency_survives_truncating_everything(uri: str) -> None:
    ch = Channel.create(uri)
    ch.append_table(rows(0, 1), 0, "w")
    ch.append_table(rows(1, 1), 1, "w")
    ch.truncate_before(ch.end_position())
    fresh = Channel.open(uri)
    assert fresh.end_position() == 2 and fresh.start_position() == 2
    assert fresh.append_table(rows(1, 1), 1, "w") is None
    assert fresh.append_table(rows(2, 1), 2, "w") == 2


def test_interrupted_truncate_before_is_finished_by_a_rerun(uri: str) -> None:
    ch = Channel.create(uri)
    for b in range(4):
        ch.append_table(rows(b * 10, 10), b, "w")
    # Simulate a crash right after the watermark was written: entries and data are still there.
    (Path(uri) / "_truncated.json").write_text(json.dumps({"before": 3, "writers": {"w": {"batch_id": 2}}}))
    assert len(data_dirs(uri)) == 4
    fresh = Channel.open(uri)
    assert fresh.end_position() == 4
    freed = fresh.truncate_before(3)
    assert freed > 0
    assert len(data_dirs(uri)) == 1
    assert sorted(p.name for p in (Path(uri) / "log").iterdir()) == [Path(log_path(3)).name]


def test_reset_starts_over_from_position_zero(uri: str) -> None:
    ch = Channel.create(uri, SCHEMA)
    for b in range(3):
        ch.append_table(rows(b, 1), b, "w")
        ch.append_barrier(b + 1, "w")
    ch.truncate_before(4)
    (Path(uri) / "data" / "w-b9-orphan").mkdir()
    ch.reset()
    fresh = Channel.open(uri)
    assert (fresh.start_position(), fresh.end_position()) == (0, 0)
    assert data_dirs(uri) == [] and fresh.schema == ch.schema
    # a writer with a fresh Spark checkpoint starts at batch 0 and epoch 1 again: nothing is skipped
    assert fresh.append_table(rows(0, 1), 0, "w") == 0
    assert fresh.append_barrier(1, "w") == 1
    assert ids(Channel.open(uri).read_table()) == [0]


def test_remove_orphans(uri: str) -> None:
    ch = Channel.create(uri)
    ch.append_table(rows(0, 3), 0, "w")
    orphan = Path(uri) / "data" / "w-b1-deadbeef"
    orphan.mkdir()
    pq.write_table(rows(3, 3), orphan / "part-00000.parquet")
    assert ids(ch.read_table()) == [0, 1, 2]  # files no entry names are ignored
    size = (orphan / "part-00000.parquet").stat().st_size
    assert ch.remove_orphans() == size
    assert not orphan.exists() and len(data_dirs(uri)) == 1


def test_whole_life_cycle_on_an_object_store_style_filesystem() -> None:
    """The same protocol through fsspec (no rename, no hard links): puts and exclusive 'xb' creates."""
    uri = f"memory://arroyo-{uuid.uuid4().hex}/chan"
    ch = Channel.create(uri, SCHEMA)
    assert not ch.fs.is_local
    assert ch.append_table(rows(0, 3), 0, "w") == 0
    assert ch.append_barrier(1, "w") == 1
    assert ch.append_table(rows(3, 3), 1, "w") == 2
    assert ch.append_table(rows(3, 3), 1, "w") is None
    assert ch.append_barrier(2, "w") == 3
    other = Channel.open(uri)
    assert other.end_position() == 4 and ids(other.read_table()) == list(range(6))
    assert other.find_barrier(2) == 3
    assert other.truncate_before(2) > 0
    assert ids(Channel.open(uri).read_table()) == [3, 4, 5]
    other.truncate_from(3)
    assert Channel.open(uri).end_position() == 3
    assert ch.append_barrier(2, "w") == 3  # the stale handle notices the truncation
    other.reset()
    assert Channel.open(uri).end_position() == 0 and ch.fs.list_files("data") == []


def test_pickle_and_reading_past_end(uri: str) -> None:
    ch = Channel.create(uri)
    ch.append_table(rows(0, 3), 0, "w")
    clone = pickle.loads(pickle.dumps(ch))
    assert clone.uri == ch.uri and ids(clone.read_table()) == [0, 1, 2]
    with pytest.raises(ChannelError, match="past the end"):
        ch.entries(0, 5)
    with pytest.raises(ConfigurationError):
        ch.entries(2, 1)
    with pytest.raises(ConfigurationError):
        ch.append_table(rows(0, 1), -1, "w")


def test_stale_writer_loses_with_a_clear_error(uri: str) -> None:
    """Two handles both believe they may write index 1: the exclusive create lets only one commit."""
    a = Channel.create(uri)
    a.append_table(rows(0, 1), 0, "w")
    b = Channel.open(uri)
    assert b.end_position() == 1

    # The race window: a commits index 1 after b decided to write index 1, before b's create.
    original = b.fs.create_exclusive

    def a_commits_first(path: str, data: bytes) -> bool:
        if path.startswith("log/") and not a.fs.exists(path):
            a.append_table(rows(1, 1), 1, "w")
        return original(path, data)

    b.fs.create_exclusive = a_commits_first  # type: ignore[method-assign]
    with pytest.raises(ConcurrencyConflict, match="exactly one writer"):
        b.append_table(rows(100, 1), 2, "w")
    assert Channel.open(uri).end_position() == 2
    assert ids(Channel.open(uri).read_table()) == [0, 1]
    assert len(data_dirs(uri)) == 2  # the loser removed its data files


def _append_many(uri: str, writer: str, n: int, barrier: mp.synchronize.Barrier, out: mp.Queue) -> None:
    ch = Channel.open(uri)
    barrier.wait()
    won, lost = [], 0
    for b in range(n):
        try:
            idx = ch.append_table(rows(b, 1).set_column(1, "key", pa.array([writer])), b, writer)
            won.append(idx)
        except ConcurrencyConflict:
            lost += 1
    out.put((writer, won, lost))


def test_two_processes_racing_never_corrupt_the_log(uri: str) -> None:
    """Not a supported setup (one writer per channel), but the log must stay consistent."""
    Channel.create(uri, SCHEMA)
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(2)
    out: mp.Queue = ctx.Queue()
    procs = [ctx.Process(target=_append_many, args=(uri, w, 15, barrier, out)) for w in ("a", "b")]
    for p in procs:
        p.start()
    results = [out.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    won = sorted(i for _, w, _ in results for i in w)
    ch = Channel.open(uri)
    end = ch.end_position()
    assert won == list(range(end))  # every index committed exactly once, no gaps
    assert sum(lost for *_, lost in results) + end == 30
    # every committed entry's data is there and belongs to its writer; no orphan data
    by_writer = {w: set(ws) for w, ws, _ in results}
    for e in ch.entries(0, end):
        assert e.index in by_writer[e.writer]
        assert ch.read_table(e.index, e.index + 1).column("key").to_pylist() == [e.writer]
    assert len(data_dirs(uri)) == end
