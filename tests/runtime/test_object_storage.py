"""Channels, snapshots, restore, retention and the file sink on a real S3 API (moto's server on loopback).

Everything is reached through plain ``s3://bucket/...`` URIs and the AWS SDK settings a user gives
(``AWS_ENDPOINT_URL`` and credentials, set by the ``s3_server`` fixture). No Spark here: these tests drive
the Python side (what touches the storage URI, and what reads and rebuilds checkpoints), with Spark-shaped files
written by pyarrow, so that every corner (an interrupted commit, a corrupt object) is reached on purpose; the
SIGKILL test in ``test_exactly_once.py`` runs a whole pipeline with everything on S3 (Spark writing its
checkpoints and the sink's micro-batches through ``s3a://``).
"""

from __future__ import annotations

import hashlib
import io
import uuid
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest

from airflow_arroyo.core.epochs import CheckpointPolicy, PipelineState, RetentionPolicy
from airflow_arroyo.core.exceptions import SnapshotError
from airflow_arroyo.core.fs import FileSystem
from airflow_arroyo.core.retention import prune_pipeline
from airflow_arroyo.runtime.channel import Channel
from airflow_arroyo.runtime.layout import StorageLayout
from airflow_arroyo.runtime.sinks.files import TransactionalFileSink, committed_files
from airflow_arroyo.runtime.snapshot import SnapshotStore
from airflow_arroyo.runtime.spark_checkpoint import BATCH_LOG_ENTRIES
from airflow_arroyo.store import EpochStore
from tests.runtime.conftest import S3Server

SCHEMA = pa.schema([("id", pa.int64()), ("key", pa.string())])


def table(start: int, end: int) -> pa.Table:
    return pa.table({"id": list(range(start, end)), "key": [f"k{i % 3}" for i in range(start, end)]}, schema=SCHEMA)


# --------------------------------------------------------------------------- channels


def test_channel_append_read_truncate_on_s3(bucket: str, s3_server: S3Server) -> None:
    uri = f"{bucket}/p/channels/c"
    ch = Channel.create(uri, SCHEMA)
    for b in range(4):
        ch.append_table(table(b * 10, b * 10 + 10), b, "w")
        if b in (1, 3):
            ch.append_barrier(b, "w")
    assert ch.append_table(table(0, 10), 2, "w") is None  # a replayed batch appends nothing
    reader = Channel.open(uri)  # another process's view: everything comes from the server
    assert reader.end_position() == 6
    assert reader.read_table().column("id").to_pylist() == list(range(40))
    assert reader.find_barrier(1) == 2 and reader.find_barrier(3) == 5
    keys = s3_server.keys(uri)
    assert "p/channels/c/_channel.json" in keys and sum(k.startswith("p/channels/c/log/") for k in keys) == 6

    reader.truncate_from(3)  # restore to epoch 1: what follows its barrier goes
    reader.remove_orphans()
    assert Channel.open(uri).read_table().column("id").to_pylist() == list(range(20))
    assert not any("-b2-" in k or "-b3-" in k for k in s3_server.keys(uri))
    freed = Channel.open(uri).truncate_before(1)  # retention: below a low watermark
    assert freed > 0
    after = Channel.open(uri)
    assert after.start_position() == 1 and after.read_table(1).column("id").to_pylist() == list(range(10, 20))
    assert not any("-b0-" in k for k in s3_server.keys(uri))
    after.reset()
    assert Channel.open(uri).end_position() == 0


def test_exclusive_create_on_s3_is_a_conditional_put(bucket: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two writers racing for the same log entry: with check-then-put both checks pass and the second put
    overwrites the first; the conditional put (If-None-Match) lets exactly one win."""
    fs = FileSystem.from_uri(f"{bucket}/x")
    assert fs.is_s3
    monkeypatch.setattr(FileSystem, "exists", lambda self, path: False)  # both racers passed the check
    assert fs.create_exclusive("log/0.json", b"first") is True
    assert fs.create_exclusive("log/0.json", b"second") is False
    assert fs.read_bytes("log/0.json") == b"first"


# --------------------------------------------------------------------------- snapshots and restore


def write_checkpoint(fs: FileSystem, root: str, batches: int, state: dict[str, bytes]) -> None:
    """A Spark-shaped checkpoint as of ``batches - 1`` (offsets, commits, default state store files)."""
    fs.write_bytes_atomic(f"{root}/metadata", b'{"id":"q"}')
    for b in range(batches):
        fs.write_bytes_atomic(f"{root}/offsets/{b}", f'v1\n{{}}\n{{"pos":{b}}}'.encode())
        fs.write_bytes_atomic(f"{root}/commits/{b}", b"v1\n{}")
    for rel, data in state.items():
        fs.write_bytes_atomic(f"{root}/state/0/0/{rel}", data)


def tree(fs: FileSystem, root: str, cut: int | None = None) -> dict[str, str]:
    """The checkpoint's files and hashes; with ``cut``, what a snapshot at that batch keeps of them (the
    batch logs' last BATCH_LOG_ENTRIES entries)."""
    files = {e.path[len(root) + 1:]: hashlib.sha256(fs.read_bytes(e.path)).hexdigest() for e in fs.list_files(root)}
    if cut is None:
        return files
    return {rel: h for rel, h in files.items() if rel.split("/")[0] not in ("offsets", "commits")
            or int(rel.rsplit("/", 1)[1]) > cut - BATCH_LOG_ENTRIES}


@pytest.fixture
def pipeline(store: EpochStore, bucket: str) -> str:
    pid = f"s3-{uuid.uuid4().hex[:8]}"
    store.register_pipeline(pid, stages=["agg"], run_id="r1", storage_uri=f"{bucket}/data")
    store.set_pipeline_state(pid, PipelineState.RUNNING)
    return pid


def snapshot_epoch(store: EpochStore, snaps: SnapshotStore, pid: str, checkpoint: str, batch: int) -> Any:
    tick = store.trigger_tick(pid, CheckpointPolicy(interval=1), force=True)
    assert tick.started is not None
    result = snaps.capture("agg", tick.started.epoch, checkpoint, batch)
    store.ack_epoch(pid, tick.started.epoch, "agg", bytes_new=result.bytes_new, bytes_total=result.bytes_total)
    return tick.started.epoch, result


@pytest.mark.parametrize("checkpoints_on", ["s3", "local"])
def test_snapshot_capture_and_verified_restore_on_s3(store: EpochStore, pipeline: str, bucket: str,
                                                      s3_server: S3Server, tmp_path: Path, checkpoints_on: str) -> None:
    """Objects on S3; checkpoints on S3 too (restore without any folder rename) or on a local disk (the
    split a Spark without the S3A connector needs). Restore the latest and an older epoch, both exact."""
    storage = f"{bucket}/data"
    layout = StorageLayout.at(storage, pipeline, None if checkpoints_on == "s3" else str(tmp_path / "ckpts"))
    snaps = SnapshotStore(layout.fs, pipeline, store, checkpoints=layout.checkpoint_fs)
    cfs = layout.checkpoint_fs
    live = layout.checkpoint("agg")
    write_checkpoint(cfs, live, 2, {"1.delta": b"a" * 3000, "2.delta": b"b" * 2000})
    e1, r1 = snapshot_epoch(store, snaps, pipeline, live, 1)
    as_of_e1 = tree(cfs, live, cut=1)
    write_checkpoint(cfs, live, 4, {"3.delta": b"c" * 1000, "4.delta": b"d" * 500})
    e2, r2 = snapshot_epoch(store, snaps, pipeline, live, 3)
    as_of_e2 = tree(cfs, live, cut=3)
    assert r1.bytes_new == r1.bytes_total and r2.bytes_new < r2.bytes_total  # incremental: 1,2.delta shared
    objects = {k: v for k, v in s3_server.keys(storage).items() if "/snapshots/objects/" in k}
    assert len(objects) == len({e.object_key for e in r1.entries + r2.entries})
    assert not any("/snapshots/tmp/" in k for k in s3_server.keys(storage))  # put directly, no temp object

    for epoch, expected in ((e2, as_of_e2), (e1, as_of_e1)):  # the latest, then an older one
        before = layout.checkpoint("agg")
        previous = snaps.commit_restore(snaps.prepare_restore("agg", epoch))
        now = layout.checkpoint("agg")
        assert previous == before and now != before
        assert tree(cfs, now) == expected
    assert cfs.read_json(layout.checkpoint_pointer("agg"))["current"] == layout.checkpoint("agg").rsplit("/", 1)[1]
    assert not cfs.exists(live)  # the first folder was "previous" once, then dropped at the next switch

    # a corrupt object: the restore names it and leaves the live checkpoint as it was
    victim = next(e for e in r2.entries if e.rel_path.endswith("4.delta"))
    layout.fs.write_bytes_atomic(layout.object_path(victim.object_key), b"x" * victim.bytes)
    live_before = layout.checkpoint("agg")
    with pytest.raises(SnapshotError, match=rf"epoch {e2} cannot be restored: file state/0/0/4.delta.*corrupt"):
        snaps.prepare_restore("agg", e2)
    assert layout.checkpoint("agg") == live_before and tree(cfs, live_before) == as_of_e1
    assert layout.stray_checkpoints("agg") == []


def test_a_restore_on_the_same_machine_downloads_only_what_the_live_checkpoint_lost(
        store: EpochStore, pipeline: str, bucket: str, tmp_path: Path) -> None:
    """Objects on S3, checkpoints on a local disk (a supervised restart on the same machine): each file the live
    checkpoint still holds with its object's bytes is hard-linked from there and verified, and only the rest is
    downloaded. Shown by deleting from S3 every object the live checkpoint still holds: the restore succeeds, and
    fails naming a missing object once reuse is off."""
    layout = StorageLayout.at(f"{bucket}/data", pipeline, str(tmp_path / "ckpts"))
    snaps = SnapshotStore(layout.fs, pipeline, store, checkpoints=layout.checkpoint_fs)
    cfs = layout.checkpoint_fs
    live = layout.checkpoint("agg")
    write_checkpoint(cfs, live, 4, {"1.delta": b"a" * 3000, "2.delta": b"b" * 2000, "3.delta": b"c" * 1000,
                                    "4.delta": b"d" * 500})
    epoch, result = snapshot_epoch(store, snaps, pipeline, live, 3)
    expected = tree(cfs, live, cut=3)
    # since the epoch: Spark's cleanup deleted one file, a bad disk (or a bug) changed another in place of its name
    cfs.delete(f"{live}/state/0/0/1.delta")
    cfs.write_bytes_atomic(f"{live}/state/0/0/2.delta", b"x" * 2000)
    lost = {"state/0/0/1.delta", "state/0/0/2.delta"}
    needed = {e.object_key for e in result.entries if e.rel_path in lost}
    for key in {e.object_key for e in result.entries} - needed:  # files of equal bytes share one object
        assert layout.fs.delete(layout.object_path(key))

    prepared = snaps.prepare_restore("agg", epoch)
    assert (prepared.reused, prepared.linked, prepared.files) == (len(result.entries) - 2, 0, len(result.entries))
    assert tree(cfs, prepared.folder) == expected  # the two lost files downloaded with the epoch's bytes
    root = Path(cfs.arrow_path(""))
    for e in result.entries:
        if e.rel_path not in lost:
            assert (root / prepared.folder / e.rel_path).samefile(root / live / e.rel_path), e.rel_path
    snaps.discard([prepared])

    snaps.reuse_live_files = False
    with pytest.raises(SnapshotError, match=rf"epoch {epoch} cannot be restored: file .* is missing"):
        snaps.prepare_restore("agg", epoch)
    assert layout.stray_checkpoints("agg") == []


def test_retention_on_s3_deletes_only_unreferenced_objects(store: EpochStore, pipeline: str, bucket: str,
                                                           s3_server: S3Server) -> None:
    storage = f"{bucket}/data"
    layout = StorageLayout.at(storage, pipeline)
    snaps = SnapshotStore(layout.fs, pipeline, store)
    live = layout.checkpoint("agg")
    write_checkpoint(layout.fs, live, 1, {"1.snapshot": b"a" * 4000})
    e1, _ = snapshot_epoch(store, snaps, pipeline, live, 0)
    write_checkpoint(layout.fs, live, 2, {"2.snapshot": b"b" * 3000})
    e2, r2 = snapshot_epoch(store, snaps, pipeline, live, 1)
    as_of_e2 = tree(layout.fs, live)
    objects_before = {k for k in s3_server.keys(storage) if "/snapshots/objects/" in k}

    report = prune_pipeline(store, pipeline, RetentionPolicy(keep_last=1), holder="test")
    assert report.epochs_pruned == [e1] and report.objects_deleted == 1  # 1.snapshot: the rest is shared
    objects_after = {k for k in s3_server.keys(storage) if "/snapshots/objects/" in k}
    assert objects_after < objects_before
    assert objects_after == {f"data/{layout.object_path(e.object_key)}" for e in r2.entries}
    prepared = snaps.prepare_restore("agg", e2)  # the retained epoch is whole
    snaps.commit_restore(prepared)
    # the checkpoint as of batch 1: 2.snapshot is its state, 1.snapshot (older) is not part of it
    wanted = {e.rel_path for e in r2.entries}
    assert "state/0/0/1.snapshot" not in wanted
    assert tree(layout.fs, layout.checkpoint("agg")) == {k: v for k, v in as_of_e2.items() if k in wanted}


# --------------------------------------------------------------------------- the exactly-once file sink


def pre_commit(fs: FileSystem, batch: int, parts: list[pa.Table]) -> None:
    """What Spark's batch writer leaves in ``pending/<batch>`` (here written with pyarrow: a commit cut short
    is set up by hand below)."""
    for i, t in enumerate(parts):
        buf = io.BytesIO()
        pq.write_table(t, buf)
        fs.write_bytes_atomic(f"_arroyo_sink/pending/{batch}/part-{i:05d}.snappy.parquet", buf.getvalue())
    fs.write_bytes_atomic(f"_arroyo_sink/pending/{batch}/_SUCCESS", b"")


def plain_read(uri: str) -> list[int]:
    """What a plain pyarrow reader of the folder sees (it skips '_' names)."""
    fs = FileSystem.from_uri(uri)
    got = ds.dataset(fs.arrow_path(""), filesystem=fs.arrow_fs, format="parquet").to_table()
    return sorted(got.column("id").to_pylist()) if got.num_columns else []


def manifest_read(uri: str) -> list[int]:
    fs = FileSystem.from_uri(uri)
    files = [fs.arrow_path(p) for p in committed_files(uri)]
    if not files:
        return []
    return sorted(ds.dataset(files, filesystem=fs.arrow_fs, format="parquet").to_table().column("id").to_pylist())


def test_file_sink_commit_and_rollback_on_s3(bucket: str, s3_server: S3Server) -> None:
    uri = f"{bucket}/out"
    sink = TransactionalFileSink("p1", "out", "parquet", {"path": uri})
    sink.claim()
    for b in range(4):
        pre_commit(sink.fs, b, [table(b * 10, b * 10 + 5), table(b * 10 + 5, b * 10 + 10)])
    assert plain_read(uri) == [] and manifest_read(uri) == []
    assert sink.commit_through(1).files == 4
    assert plain_read(uri) == manifest_read(uri) == list(range(20))
    assert sink.committed_batches() == [0, 1] and sink.pending_batches() == [2, 3]
    assert sink.commit_through(1).files == 0  # idempotent

    # a commit cut short on S3: one file of batch 2 already copied to its final name, the manifest not
    # written: a plain reader sees part of the batch, a manifest reader does not
    first = sorted(e.path for e in sink.fs.list_files("_arroyo_sink/pending/2") if "part-" in e.path)[0]
    sink.fs.move(first, f"{2:012d}-{first.rsplit('/', 1)[1]}")
    assert plain_read(uri) == list(range(25)) and manifest_read(uri) == list(range(20))
    sink.commit_through(3)  # the next commit finishes it: every row once
    assert plain_read(uri) == manifest_read(uri) == list(range(40))
    finals = [k for k in s3_server.keys(uri) if not k.startswith("out/_arroyo_sink/")]
    assert len(finals) == 8 and len(set(finals)) == 8

    sink.rollback_to(1)  # restore of an older epoch whose cut was batch 1
    assert plain_read(uri) == manifest_read(uri) == list(range(20))
    pre_commit(sink.fs, 2, [table(100, 105)])  # the re-run batch 2 carries other rows
    sink.commit_through(2)
    assert manifest_read(uri) == [*range(20), *range(100, 105)] == plain_read(uri)
    sink.rollback_to(-1)
    assert plain_read(uri) == manifest_read(uri) == [] and not sink.has_state()
