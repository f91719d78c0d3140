"""Fencing, write by write, without Spark: once a newer run of a pipeline registered, every write of the
older run is refused (store writes in SQL; channel entries, file-sink commits and PostgreSQL-sink
commits in storage), and readers ignore what the older run still managed to put down. The live
takeover of a running driver is in ``test_fencing_takeover.py``."""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from airflow_arroyo.core.epochs import CheckpointPolicy, EpochState, PipelineState
from airflow_arroyo.core.exceptions import ConcurrencyConflict, FencedError
from airflow_arroyo.runtime.channel import Channel, ChannelError, EntryKind, fence_applies, log_path
from airflow_arroyo.runtime.sinks.files import TransactionalFileSink, committed_files
from airflow_arroyo.runtime.sinks.postgres import PostgresTarget, TransactionalPostgresSink, _PartitionWriter
from airflow_arroyo.store import EpochStore, FencingToken, SnapshotEntry
from tests.support import sql

SCHEMA = pa.schema([("id", pa.int64())])


def rows(start: int, n: int) -> pa.Table:
    return pa.table({"id": pa.array(range(start, start + n), pa.int64())})


def ids(ch: Channel) -> list[int]:
    return sorted(ch.read_table().column("id").to_pylist())


def token(generation: int, run: str = "") -> FencingToken:
    return FencingToken("p", run or f"r{generation}", generation)


# --------------------------------------------------------------------------- channels


def test_fence_rule() -> None:
    fences = [(2, 5), (4, 9)]
    assert fence_applies(fences, 4, 1) is None  # before every fence: whoever wrote it
    assert fence_applies(fences, 5, 1) == 2 and fence_applies(fences, 5, 2) is None
    assert fence_applies(fences, 9, 3) == 4 and fence_applies(fences, 9, 1) == 4
    assert fence_applies(fences, 12, 4) is None and fence_applies(fences, 12, 5) is None


def test_a_superseded_writer_is_refused_and_what_it_slipped_in_is_ignored(tmp_path: Path) -> None:
    uri = str(tmp_path / "ch")
    old = Channel.create(uri, SCHEMA)
    old.token = token(1)
    old.append_table(rows(0, 3), 0, "src")
    old.append_barrier(1, "src")
    old.append_table(rows(3, 2), 1, "src")  # after barrier 1: the takeover restores epoch 1 and cuts here
    new = Channel.open(uri)
    new.truncate_from(2)
    new.fence(2, 2)
    # The old writer still runs: its next append is refused before anything is written.
    with pytest.raises(FencedError, match="superseded") as refused:
        old.append_table(rows(100, 5), 2, "src")
    assert refused.value.by_generation == 2 and isinstance(refused.value, ConcurrencyConflict)
    assert Channel.open(uri).end_position() == 2
    # An append that raced the fence (checked before it, committed after): a raw entry of generation 1.
    data = f"data/src-b2-{uuid.uuid4().hex[:12]}"
    (tmp_path / "ch" / data).mkdir(parents=True)
    pq.write_table(rows(100, 5), tmp_path / "ch" / data / "part-0.parquet")
    entry = {"kind": "data", "writer": "src", "batch_id": 2, "dir": data, "files": [f"{data}/part-0.parquet"],
             "rows": 5, "bytes": 1, "generation": 1}
    (tmp_path / "ch" / log_path(2)).write_text(json.dumps(entry))
    (tmp_path / "ch" / log_path(3)).write_text(json.dumps({"kind": "barrier", "writer": "src", "epoch": 2,
                                                             "generation": 1}))
    reader = Channel.open(uri)
    assert [e.kind for e in reader.entries(0)] == [EntryKind.DATA, EntryKind.BARRIER, EntryKind.FENCED,
                                                  EntryKind.FENCED]
    assert ids(reader) == [0, 1, 2]  # the superseded rows are not read
    assert reader.find_barrier(2) is None and reader.next_barrier_at_or_after(2) is None
    # The new writer replays batch 1 (its batch ids are not shadowed by the fenced batch 2) and appends
    # after the fenced entries; a writer that finds a fenced entry in its slot steps over it.
    new = Channel.open(uri)
    new.token = token(2)
    assert new.last_batch_id("src") == 0
    assert new.append_table(rows(3, 2), 1, "src") == 4
    (tmp_path / "ch" / log_path(5)).write_text(json.dumps({"kind": "barrier", "writer": "src", "epoch": 9,
                                                             "generation": 1}))
    new._refresh = lambda: 5  # type: ignore[method-assign]  # the racing entry came after it found the end
    assert new.append_barrier(2, "src") == 6
    reader = Channel.open(uri)
    assert ids(reader) == [0, 1, 2, 3, 4] and reader.find_barrier(2) == 6
    assert sum(e.kind is EntryKind.FENCED for e in reader.entries(0)) == 3
    # A second writer of the current generation is still a conflict, not a fenced entry.
    other = Channel.open(uri)
    other.token = token(2)
    other._refresh = lambda: 6  # type: ignore[method-assign]
    with pytest.raises(ConcurrencyConflict) as conflict:
        other.append_barrier(3, "other")
    assert not isinstance(conflict.value, FencedError)


def test_fencing_upgrades_a_version_1_channel_and_version_1_stays_readable(tmp_path: Path) -> None:
    uri = str(tmp_path / "v1")
    ch = Channel.create(uri, SCHEMA)
    ch.append_table(rows(0, 2), 0, "src")  # no token: an entry without a generation, as version 1 wrote
    header = tmp_path / "v1" / "_channel.json"
    header.write_text(json.dumps({**json.loads(header.read_text()), "format_version": 1}))
    assert ids(Channel.open(uri)) == [0, 1]
    assert "generation" not in json.loads((tmp_path / "v1" / log_path(0)).read_text())
    Channel.open(uri).fence(1, 1)
    assert json.loads(header.read_text())["format_version"] == 2  # an old reader now refuses it clearly
    assert ids(Channel.open(uri)) == [0, 1]  # entries before the fence stay, whoever wrote them
    assert Channel.open(uri).fences() == [(1, 1)]
    # A later generation's fence keeps the earlier one where it still matters and drops the one it implies.
    Channel.open(uri).fence(3, 1)
    assert Channel.open(uri).fences() == [(3, 1)]
    with pytest.raises(Exception, match="already fenced by generation 3"):
        Channel.open(uri).fence(2, 1)


def test_reset_forgets_fences_and_retention_deletes_fenced_entries(tmp_path: Path) -> None:
    uri = str(tmp_path / "r")
    ch = Channel.create(uri, SCHEMA)
    ch.token = token(1)
    for b in range(3):
        ch.append_table(rows(b, 1), b, "src")
    Channel.open(uri).fence(2, 1)
    reader = Channel.open(uri)
    assert ids(reader) == [0]
    assert reader.truncate_before(3) > 0  # fenced entries and their data go with retention
    assert not any((tmp_path / "r" / "data").iterdir())
    Channel.open(uri).reset()
    assert Channel.open(uri).fences() == [] and Channel.open(uri).end_position() == 0


# --------------------------------------------------------------------------- the store


def test_generation_grows_at_every_registration(store: EpochStore) -> None:
    store.register_pipeline("g", stages=["a"], run_id="r1")
    first = store.fencing_token("g", "r1")
    assert first.generation == 1
    store.set_pipeline_state("g", PipelineState.RUNNING, run_id="r1")
    store.heartbeat("g", "r1", token=first)  # updates do not move it
    store.register_pipeline("g", stages=["a"], run_id="r2", takeover=True)
    assert store.fencing_token("g", "r2").generation == 2
    with pytest.raises(FencedError, match="superseded by run 'r2'"):
        store.fencing_token("g", "r1")
    store.set_pipeline_state("g", PipelineState.STOPPED, run_id="r2")
    store.register_pipeline("g", stages=["a"], run_id="r2")  # the same run id registered again: a new token
    assert store.get_pipeline("g").generation == 3
    with pytest.raises(FencedError):
        store.heartbeat("g", "r2", token=FencingToken("g", "r2", 2))


def test_store_writes_of_a_superseded_run_are_refused(store: EpochStore) -> None:
    store.register_pipeline("f", stages=["a", "b"], run_id="old")
    old = store.fencing_token("f", "old")
    store.set_pipeline_state("f", PipelineState.RUNNING, run_id="old")
    epoch = store.trigger_tick("f", CheckpointPolicy(interval=1.0), force=True).started
    assert epoch is not None
    store.ack_epoch("f", epoch.epoch, "a", token=old)  # accepted while current
    store.register_pipeline("f", stages=["a", "b"], run_id="new", takeover=True)
    new = store.fencing_token("f", "new")
    store.set_pipeline_state("f", PipelineState.RUNNING, run_id="new")
    mine = store.trigger_tick("f", CheckpointPolicy(interval=1.0), force=True).started
    assert mine is not None
    refusals = {
        "ack": lambda: store.ack_epoch("f", mine.epoch, "a", token=old),
        "snapshot": lambda: store.record_snapshot("f", mine.epoch, "a", [SnapshotEntry("x", "sha256/00/x", 1)],
                                                  token=old),
        "fail": lambda: store.fail_epoch("f", mine.epoch, "old run", token=old),
        "sink commit": lambda: store.record_sink_commit("f", mine.epoch, "b", uri="u", batch_id=1, files=1, rows=1,
                                                        bytes_committed=1, token=old),
        "heartbeat": lambda: store.heartbeat("f", "old", token=old),
        "state": lambda: store.set_pipeline_state("f", PipelineState.STOPPED, run_id="old"),
    }
    for what, write in refusals.items():
        with pytest.raises(FencedError, match="superseded by run 'new'") as refused:
            write()
        assert refused.value.by_generation == new.generation, what
    # nothing of it landed; the current run's writes go through
    assert store.acks("f", mine.epoch) == [] and store.snapshot_entries("f", mine.epoch, "a") == []
    assert store.get_epoch("f", mine.epoch).state is EpochState.TRIGGERED
    store.ack_epoch("f", mine.epoch, "a", token=new)
    assert store.ack_epoch("f", mine.epoch, "b", token=new) is EpochState.COMPLETED


# --------------------------------------------------------------------------- sinks


def pending_batch(root: Path, name: str, start: int) -> None:
    folder = root / "_arroyo_sink" / "pending" / name
    folder.mkdir(parents=True)
    pq.write_table(rows(start, 2), folder / "part-00000.parquet")


def file_sink(path: Path, generation: int) -> TransactionalFileSink:
    sink = TransactionalFileSink("p", "out", "parquet", {"path": str(path)})
    sink.token = token(generation)
    return sink


def test_file_sink_refuses_a_superseded_generation(tmp_path: Path) -> None:
    out = tmp_path / "out"
    old = file_sink(out, 1)
    old.claim()
    pending_batch(out, "0-g1", 0)
    pending_batch(out, "1-g1", 10)
    old.commit_through(0)
    assert committed_files(str(out)) == ["000000000000-g1-part-00000.parquet"]
    new = file_sink(out, 2)
    new.rollback_to(0)  # the takeover restores the epoch whose cut is batch 0
    with pytest.raises(FencedError, match="commit through micro-batch 1"):
        old.commit_through(1)
    with pytest.raises(FencedError, match="pre-commit of micro-batch 2"):
        old.write_batch(None, 2)  # type: ignore[arg-type]  # refused before the data is looked at
    # What the old run moved anyway (it passed its check just before the new run's commit point): its own
    # manifest and commit point, both of an older generation than the trusted one, change nothing.
    pending_batch(out, "1-g1", 10)
    old_again = file_sink(out, 1)
    old_again._check_fence = lambda what: None  # type: ignore[method-assign]  # the race: check passed earlier
    old_again.commit_through(1)
    assert (out / "_arroyo_sink" / "committed-g1.json").exists()
    assert committed_files(str(out)) == ["000000000000-g1-part-00000.parquet"]
    # The new run commits its own batch 1; the older generation's file of batch 1 is removed.
    pending_batch(out, "1-g2", 20)
    new.commit_through(1)
    assert committed_files(str(out)) == ["000000000000-g1-part-00000.parquet", "000000000001-g2-part-00000.parquet"]
    assert sorted(p.name for p in out.glob("*.parquet")) == ["000000000000-g1-part-00000.parquet",
                                                             "000000000001-g2-part-00000.parquet"]


def test_a_takeover_finishes_the_commit_a_stalled_run_had_half_done(tmp_path: Path) -> None:
    """The old run moved batch 0's files, then stalled before writing the batch's manifest (a SIGSTOP
    between the two, as in the live takeover test): the new run's rollback finishes that commit, and its
    manifest names the files the old run moved, so no committed row is lost and no file is stray."""
    out = tmp_path / "out"
    old = file_sink(out, 1)
    old.claim()
    pending_batch(out, "0-g1", 0)
    (out / "_arroyo_sink" / "pending" / "0-g1" / "part-00000.parquet").rename(
        out / "000000000000-g1-part-00000.parquet")  # the move done, the manifest not written
    pending_batch(out, "1-g1", 10)
    new = file_sink(out, 2)
    new.claim()
    new.rollback_to(1)  # the takeover restores the epoch whose cut is batch 1
    files = committed_files(str(out))
    assert files == ["000000000000-g1-part-00000.parquet", "000000000001-g2-part-00000.parquet"]
    assert sorted(p.name for p in out.glob("*.parquet")) == files
    assert sorted(pq.read_table(out / f).column("id").to_pylist()[0] for f in files) == [0, 10]
    # the old run wakes up and writes the manifest it owed: of an older generation, it changes nothing
    (out / "_arroyo_sink" / "committed" / "000000000000-g1.json").write_text(
        json.dumps({"batch": 0, "files": ["000000000000-g1-part-00000.parquet"]}))
    assert committed_files(str(out)) == files


@pytest.mark.parametrize("stalled", ["after listing", "before marking"])
def test_a_superseded_commit_whose_pending_folder_the_takeover_committed_is_refused_as_superseded(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stalled: str) -> None:
    """The old run stalled in its commit (a SIGSTOP right after its epoch completed, as in the live takeover test):
    after listing its pending batch, or after its last fence check before marking it. The new run took over and its
    rollback committed and removed that folder. Woken up, the old run is refused as superseded (FencedError, naming
    the new generation), not failed on a missing file, and changes nothing readers see; the mark it may leave behind
    (writing it re-creates the folder) does not make a third run's rollback forget the batch's files."""
    out = tmp_path / "out"
    old = file_sink(out, 1)
    old.claim()
    pre_committed(out, "0-g1", 0)
    new = file_sink(out, 2)

    def take_over() -> None:
        if not new.committed_batches():
            new.rollback_to(0)  # the takeover restores the epoch whose cut is batch 0 (the driver claims after)
            new.claim()

    list_files, write = old.fs.list_files, old.fs.write_bytes_atomic

    def listing(path: str = "") -> Any:
        listed = list_files(path)
        if stalled == "after listing" and path.endswith("pending/0-g1"):
            take_over()
        return listed

    def marking(path: str, data: bytes) -> None:
        if stalled == "before marking" and path.endswith("pending/0-g1/_moved-g1"):
            take_over()
        write(path, data)

    monkeypatch.setattr(old.fs, "list_files", listing)
    monkeypatch.setattr(old.fs, "write_bytes_atomic", marking)
    with pytest.raises(FencedError, match=r"\(generation 2\); the commit "):
        old.commit_through(0)
    files = committed_files(str(out))
    assert files == ["000000000000-g2-part-00000.parquet", "000000000000-g2-part-00001.parquet"]
    assert sorted(p.name for p in out.glob("*.parquet")) == files
    leftover = out / "_arroyo_sink" / "pending" / "0-g1"
    assert leftover.exists() == (stalled == "before marking")
    third = file_sink(out, 3)
    third.rollback_to(0)
    assert committed_files(str(out)) == files
    assert not list((out / "_arroyo_sink" / "pending").iterdir())


def test_a_rollback_fences_older_generations_out_before_it_moves_their_files(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The driver rolls a sink back before it claims it: the rollback writes the new generation's commit point
    first, so an old run still committing the same batch in between the rollback's moves is refused, instead of
    moving the rest under its own name and failing on the file the rollback took."""
    out = tmp_path / "out"
    old = file_sink(out, 1)
    old.claim()
    pre_committed(out, "0-g1", 0)
    new = file_sink(out, 2)
    move = new.fs.move
    raced: list[BaseException] = []

    def old_commits_in_between(src: str, dst: str) -> None:
        move(src, dst)
        if not raced:
            with pytest.raises(FencedError) as refused:
                old.commit_through(0)
            raced.append(refused.value)

    monkeypatch.setattr(new.fs, "move", old_commits_in_between)
    new.rollback_to(0)
    assert raced and "(generation 2)" in str(raced[0])
    files = committed_files(str(out))
    assert files == ["000000000000-g2-part-00000.parquet", "000000000000-g2-part-00001.parquet"]
    assert sorted(p.name for p in out.glob("*.parquet")) == files


def pre_committed(root: Path, name: str, start: int, files: int = 2) -> Path:
    """A pending batch as the sink's pre-commit leaves it: part files and its ``_arroyo_batch.json``."""
    folder = root / "_arroyo_sink" / "pending" / name
    folder.mkdir(parents=True)
    for i in range(files):
        pq.write_table(rows(start + 2 * i, 2), folder / f"part-0000{i}.parquet")
    (folder / "_arroyo_batch.json").write_text(json.dumps({"rows": 2 * files, "moved": False}))
    return folder


def test_a_rollback_that_died_midway_is_finished_by_the_next_generation(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Generation 2's rollback commits generation 1's batch 5 and dies after one move; generation 3 (every run has
    its own) finishes it: its manifest names the file generation 2 moved, which it finds by the mark generation 2
    left on the batch (the pending folder's generation and its own are not enough)."""
    out = tmp_path / "out"
    file_sink(out, 1).claim()
    pre_committed(out, "5-g1", 0)
    second = file_sink(out, 2)
    second.claim()
    move = second.fs.move

    def dies_after_one(src: str, dst: str) -> None:
        move(src, dst)
        raise KeyboardInterrupt  # stands for the process's death

    monkeypatch.setattr(second.fs, "move", dies_after_one)
    with pytest.raises(KeyboardInterrupt):
        second.rollback_to(5)
    assert [p.name for p in out.glob("*.parquet")] == ["000000000005-g2-part-00000.parquet"]
    third = file_sink(out, 3)
    third.claim()
    third.rollback_to(5)
    files = committed_files(str(out))
    assert files == ["000000000005-g2-part-00000.parquet", "000000000005-g3-part-00001.parquet"]
    assert sorted(p.name for p in out.glob("*.parquet")) == files
    assert sorted(i for f in files for i in pq.read_table(out / f).column("id").to_pylist()) == [0, 1, 2, 3]


def test_a_superseded_runs_pending_batch_after_the_base_is_removed_and_never_committed(tmp_path: Path) -> None:
    """Generation 1's pre-commit of batch 8 raced the takeover: its pending folder stays after generation 2 claimed
    the folder. Generation 2's next commit removes it (generation 1 can no longer commit it); otherwise a later
    rollback of generation 3 to a cut at or after 8 would commit those stale rows for batch 8 in place of generation
    2's."""
    out = tmp_path / "out"
    first = file_sink(out, 1)
    first.claim()
    pre_committed(out, "7-g1", 0)
    first.commit_through(7)
    second = file_sink(out, 2)
    second.claim()  # base 7
    stale = pre_committed(out, "8-g1", 100)
    pre_committed(out, "8-g2", 20)
    second.commit_through(8)
    assert not stale.exists()
    file_sink(out, 3).rollback_to(8)
    ids_read = sorted(i for f in committed_files(str(out)) for i in pq.read_table(out / f).column("id").to_pylist())
    assert ids_read == [0, 1, 2, 3, 20, 21, 22, 23]


@pytest.fixture
def target_dsn(pg_server: Any) -> str:
    dsn = pg_server.create_database(f"fence_{uuid.uuid4().hex[:10]}")
    sql(dsn, "CREATE TABLE events (id bigint NOT NULL, key text NOT NULL, amount bigint)")
    return dsn


def pg_sink(dsn: str, generation: int) -> TransactionalPostgresSink:
    sink = TransactionalPostgresSink("p", "events_sink", PostgresTarget(table="public.events", dsn=dsn))
    sink.token = token(generation)
    return sink


def test_postgres_sink_refuses_a_superseded_generation(target_dsn: str) -> None:
    old = pg_sink(target_dsn, 1)
    old.claim()
    sql(target_dsn, "ALTER TABLE arroyo_sink_progress DROP COLUMN generation")  # as claimed before fencing
    old.claim()  # a claim adds it back
    pending = old._pending_name
    columns = "(_arroyo_batch, _arroyo_part, _arroyo_seq, id, key, amount)"
    stage = f"INSERT INTO {pending} {columns} VALUES (%s, 0, 0, %s, 'k', 1)"  # noqa: S608 - the sink's own table
    sql(target_dsn, stage, (0, 1))
    old.commit_through(0)
    new = pg_sink(target_dsn, 2)
    new.rollback_to(0)  # takes the progress row for generation 2
    sql(target_dsn, stage, (1, 2))
    with pytest.raises(FencedError, match="commit through micro-batch 1"):
        old.commit_through(1)
    with pytest.raises(FencedError):
        old.rollback_to(0)
    with pytest.raises(FencedError):
        old.claim()
    insert = f"INSERT INTO {pending} {columns} VALUES %s"  # noqa: S608 - the sink's own table
    delete = f"DELETE FROM {pending} WHERE _arroyo_batch = %s AND _arroyo_part = %s"  # noqa: S608
    fence = "SELECT generation FROM arroyo_sink_progress WHERE pipeline_id = %s AND sink = %s FOR SHARE"
    writer = _PartitionWriter(target_dsn, "events_sink", 1, ["id", "key", "amount"], [], insert, delete,
                              fence=(fence, token(1)))
    with pytest.raises(FencedError, match="pre-commit of micro-batch 1"):
        writer([(99, "x", 9)])
    assert sql(target_dsn, "SELECT id FROM events ORDER BY id") == [(1,)]
    staged = f"SELECT count(*) FROM {pending} WHERE _arroyo_batch = 1"  # noqa: S608 - the sink's own table
    assert sql(target_dsn, staged) == [(1,)]  # 99 was not staged
    assert sql(target_dsn, "SELECT generation FROM arroyo_sink_progress") == [(2,)]
    new.commit_through(1)
    assert sql(target_dsn, "SELECT id FROM events ORDER BY id") == [(1,), (2,)]


def test_channel_fencing_on_s3(bucket: str) -> None:
    """The same on a real S3 API: the slot a superseded run took is found by the conditional put."""
    uri = f"{bucket}/p/channels/fenced"
    old = Channel.create(uri, SCHEMA)
    old.token = token(1)
    old.append_table(rows(0, 2), 0, "src")
    Channel.open(uri).fence(2, 1)
    with pytest.raises(FencedError):
        old.append_table(rows(2, 2), 1, "src")
    raced = {"kind": "barrier", "writer": "src", "epoch": 5, "generation": 1}
    assert old.fs.create_exclusive(log_path(1), json.dumps(raced).encode())
    new = Channel.open(uri)
    new.token = token(2)
    new._refresh = lambda: 1  # type: ignore[method-assign]  # it found the end before the raced entry
    assert new.append_table(rows(2, 2), 1, "src") == 2
    reader = Channel.open(uri)
    assert [e.kind for e in reader.entries(0)] == [EntryKind.DATA, EntryKind.FENCED, EntryKind.DATA]
    assert ids(reader) == [0, 1, 2, 3] and reader.find_barrier(5) is None


def test_a_fork_copies_a_channel_as_readers_see_it_without_fences(tmp_path: Path) -> None:
    """``Channel.copy_to`` (a fork's first restore): the entries below the cut at the same positions, the
    retention watermark, no fences, and an entry a fence hid copied as an empty one (no superseded rows)."""
    uri = str(tmp_path / "src")
    old = Channel.create(uri, SCHEMA)
    old.token = token(1)
    for batch in range(3):
        old.append_table(rows(batch * 10, 2), batch, "src")
        old.append_barrier(batch + 1, "src")
    Channel.open(uri).truncate_before(2)  # retention dropped entries 0 and 1
    new = Channel.open(uri)
    new.fence(2, 4)  # a takeover cut after barrier 2 ...
    (tmp_path / "src" / log_path(5)).unlink()  # ... and the superseded run's data entry 4 stays, fenced
    assert [e.kind for e in Channel.open(uri).entries(2)] == [EntryKind.DATA, EntryKind.BARRIER, EntryKind.FENCED]
    writer = Channel.open(uri)
    writer.token = token(2)
    writer.append_table(rows(100, 1), 2, "src")  # entry 5
    writer.append_barrier(3, "src")  # entry 6

    copy = Channel.open(uri).copy_to(str(tmp_path / "fork"), 7)

    assert (copy.start_position(), copy.end_position(), copy.fences()) == (2, 7, [])
    assert [e.kind for e in copy.entries(2)] == [EntryKind.DATA, EntryKind.BARRIER, EntryKind.DATA,
                                                EntryKind.DATA, EntryKind.BARRIER]
    assert ids(copy) == ids(Channel.open(uri)) == [10, 11, 100]  # the fenced rows stay unread
    assert copy.find_barrier(3) == 6 and copy.find_barrier(2) == 3
    assert copy.schema == Channel.open(uri).schema
    # a repeat starts over, and a copy up to an earlier cut ends there
    again = Channel.open(uri).copy_to(str(tmp_path / "fork"), 4)
    assert (again.end_position(), ids(again)) == (4, [10, 11])
    with pytest.raises(ChannelError, match=r"cannot copy entries \[2, 9\)"):
        Channel.open(uri).copy_to(str(tmp_path / "other"), 9)
