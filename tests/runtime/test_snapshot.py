"""Snapshots of real Spark checkpoints: which files, content addressing, incrementality, verified restore.

The Spark tests run a stateful aggregation over the deterministic generator, snapshot its checkpoint
as of a middle batch, restore that snapshot and run to the end: the result must equal the result
computed in plain Python, for both state store providers.
"""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from airflow_arroyo.core.epochs import CheckpointPolicy, PipelineState, RetentionPolicy
from airflow_arroyo.core.exceptions import SnapshotError
from airflow_arroyo.core.fs import FileSystem
from airflow_arroyo.core.retention import prune_pipeline
from airflow_arroyo.core.scrub import verify_pipeline
from airflow_arroyo.runtime.channel import Channel
from airflow_arroyo.runtime.layout import object_digest, object_path
from airflow_arroyo.runtime.pipeline import STATE_STORES
from airflow_arroyo.runtime.snapshot import SnapshotStore
from airflow_arroyo.runtime.sources import read_channel
from airflow_arroyo.runtime.spark_checkpoint import (
    BATCH_LOG_ENTRIES,
    check_restorable,
    select_checkpoint_files,
    snapshot_files,
)
from airflow_arroyo.testing import generate_rows, generator_source

# ----------------------------------------------------------------------------- which files (pure)


def no_zips(rel: str) -> list[str] | None:
    raise AssertionError(f"no zip expected, asked for {rel}")


def test_selection_hdfs_layout_keeps_newest_snapshot_and_later_deltas() -> None:
    files = [
        "metadata", ".metadata.crc",
        *[f"offsets/{i}" for i in range(8)], *[f"commits/{i}" for i in range(7)], "offsets/.3.crc",
        "sources/0/0", "sources/0/6",
        "state/0/_metadata/metadata",
        "state/0/0/_metadata/schema",
        *[f"state/0/0/{v}.delta" for v in range(1, 9)], "state/0/0/5.snapshot", "state/0/0/.6.delta.crc",
        "state/0/0/.7.delta.3f2a.tmp",
        *[f"state/0/1/{v}.delta" for v in range(1, 9)],
    ]
    got = select_checkpoint_files(files, 4, no_zips)  # cut at batch 4 -> state version 5
    assert got == sorted([
        # the batch logs' last two entries up to the cut (what a restarted query reads), all source logs
        "metadata", "offsets/3", "offsets/4", "commits/3", "commits/4", "sources/0/0",
        "state/0/_metadata/metadata", "state/0/0/_metadata/schema",
        "state/0/0/5.snapshot",  # newest base at or below 5: no deltas needed in partition 0
        *[f"state/0/1/{v}.delta" for v in range(1, 6)],  # no snapshot in partition 1: deltas 1..5
    ])


def test_selection_join_store_folders_and_rocksdb_zip_references() -> None:
    files = [
        "metadata", "offsets/0", "offsets/1", "commits/0", "commits/1",
        "state/0/0/left-keyToNumValues/1.zip", "state/0/0/left-keyToNumValues/2.zip",
        "state/0/0/left-keyToNumValues/3.zip",
        "state/0/0/left-keyToNumValues/SSTs/000008-a.sst", "state/0/0/left-keyToNumValues/SSTs/000009-b.sst",
        "state/0/0/left-keyToNumValues/SSTs/000010-c.sst",
        "state/0/0/left-keyToNumValues/SSTs/.000010-c.sst.crc",
    ]
    refs = {"state/0/0/left-keyToNumValues/2.zip": ["SSTs/000008-a.sst", "SSTs/000009-b.sst"]}
    got = select_checkpoint_files(files, 1, refs.__getitem__)
    assert got == [
        "commits/0", "commits/1", "metadata", "offsets/0", "offsets/1",
        "state/0/0/left-keyToNumValues/2.zip",
        "state/0/0/left-keyToNumValues/SSTs/000008-a.sst",
        "state/0/0/left-keyToNumValues/SSTs/000009-b.sst",
    ]


def test_selection_rocksdb_unreadable_zip_keeps_every_sst_and_missing_sst_is_an_error() -> None:
    files = ["state/0/0/1.zip", "state/0/0/SSTs/a.sst", "state/0/0/SSTs/b.sst"]
    assert select_checkpoint_files(files, 0, lambda rel: None) == files
    with pytest.raises(SnapshotError, match="references"):
        select_checkpoint_files(files, 0, lambda rel: ["SSTs/gone.sst"])


def test_selection_before_any_batch_keeps_only_metadata() -> None:
    assert select_checkpoint_files(["metadata", "offsets/0", "state/0/0/1.delta"], -1, no_zips) == ["metadata"]


#: What a stream-stream join's checkpoint holds while its batch 0 runs (issue 30, finding 1): the operator
#: metadata, the state schemas and the first state files are written before ``commits/0``.
BATCH_0_RUNNING = [
    "metadata", "offsets/0", "sources/0/0",
    "state/0/_metadata/metadata",
    "state/0/_stateSchema/default/0_5d8e7f2a-51c4-4bd0-9d55-7f3d4c1a2b3c",
    *[f"state/0/{p}/{store}/_metadata/schema" for p in range(2)
      for store in ("left-keyToNumValues", "left-keyWithIndexToValue")],
    "state/0/0/left-keyToNumValues/1.delta",
]


def test_selection_cut_before_batch_0_takes_no_state_file_batch_0_wrote() -> None:
    assert select_checkpoint_files(BATCH_0_RUNNING, -1, no_zips) == ["metadata"]


def test_selection_drops_schema_files_written_after_the_cut() -> None:
    files = ["metadata", "offsets/2", "commits/2", "offsets/3", "state/0/_stateSchema/default/0_a",
             "state/0/_stateSchema/default/3_b", "state/0/0/3.delta", "state/0/0/4.delta",
             *[f"state/0/0/{v}.delta" for v in (1, 2)]]
    assert select_checkpoint_files(files, 2, no_zips) == [
        "commits/2", "metadata", "offsets/2", "state/0/0/1.delta", "state/0/0/2.delta", "state/0/0/3.delta",
        "state/0/_stateSchema/default/0_a"]


def test_restorable_checkpoints_pass_the_check() -> None:
    files = ["metadata", "offsets/3", "offsets/4", "commits/3", "commits/4", "sources/0/0",
             "state/0/_metadata/metadata", "state/0/0/_metadata/schema", "state/0/0/5.snapshot",
             *[f"state/0/1/{v}.delta" for v in range(1, 6)], "state/0/2/3.zip", "state/0/2/4.changelog",
             "state/0/2/5.changelog", "state/0/3/5.zip"]
    assert check_restorable(files) == []
    assert check_restorable(["metadata"]) == []  # a cut before any batch: Spark starts at batch 0
    assert check_restorable(["metadata", "offsets/0", "commits/0", "state/0/0/1.delta"]) == []


@pytest.mark.parametrize(("files", "problem"), [
    (["metadata", *BATCH_0_RUNNING[3:]], "no committed batch"),
    (["offsets/0", "commits/0"], "no 'metadata'"),
    (["metadata", "offsets/4", "commits/4"], "offsets/3 is missing"),
    (["metadata", "offsets/3", "commits/3", "commits/4"], "offsets/4 is missing"),
    (["metadata", "offsets/0", "commits/0", "offsets/1"], "after the committed batch 0: offsets/1"),
    (["metadata", "offsets/0", "offsets/1", "commits/1", "state/0/0/2.delta"],
     "no delta or changelog for version(s) 1"),
    (["metadata", "offsets/0", "offsets/1", "commits/1", "state/0/0/1.zip"], "no file for version(s) 2"),
    (["metadata", "offsets/0", "commits/0", "state/0/0/1.delta", "state/0/0/2.delta"], "later versions (2)"),
])
def test_unrestorable_checkpoints_are_named(files: list[str], problem: str) -> None:
    problems = check_restorable(files)
    assert any(problem in p for p in problems), problems


def test_every_selection_is_restorable() -> None:
    """Whatever batch a cut falls on, the files selected from a checkpoint Spark wrote pass the check."""
    deltas = [f"state/0/{p}/{v}.delta" for p in range(2) for v in range(1, 9)]
    written = ["metadata", *[f"offsets/{b}" for b in range(8)], *[f"commits/{b}" for b in range(7)],
               "state/0/_metadata/metadata", "state/0/0/_metadata/schema", "state/0/0/4.snapshot", *deltas]
    for cut in range(-1, 7):
        selected = select_checkpoint_files(written, cut, no_zips)
        assert check_restorable(selected) == [], (cut, selected)


def test_selection_changelog_checkpointing() -> None:
    files = [f"state/0/0/{v}.changelog" for v in range(1, 8)] + ["state/0/0/3.zip", "state/0/0/6.zip"]
    assert select_checkpoint_files(files, 4, lambda rel: []) == [
        "state/0/0/3.zip", "state/0/0/4.changelog", "state/0/0/5.changelog"]


def test_selection_chains_deltas_from_a_held_snapshot_instead_of_a_new_one() -> None:
    """Incremental: a snapshot Spark wrote is not taken while the deltas it summarises are there to chain."""
    part = [*[f"state/0/0/{v}.delta" for v in range(1, 13)], "state/0/0/4.snapshot", "state/0/0/8.snapshot"]
    files = ["metadata", *part]
    deltas = [f"state/0/0/{v}.delta" for v in range(1, 11)]
    held_4 = {"state/0/0/4.snapshot"}.__contains__
    assert snapshot_files(files, 9) == ["state/0/0/4.snapshot", "state/0/0/8.snapshot"]
    # nothing held: every delta from version 1 (no snapshot) rather than the new 8.snapshot
    assert select_checkpoint_files(files, 9, no_zips, held_bases=lambda rel: False) == ["metadata", *sorted(deltas)]
    # 4.snapshot held (an earlier epoch copied it): it and deltas 5..10, not 8.snapshot
    assert select_checkpoint_files(files, 9, no_zips, held_bases=held_4) == sorted(
        ["metadata", "state/0/0/4.snapshot", *deltas[4:]])
    # the chain is bounded: 10 - 4 > 5 deltas, so the newest snapshot is taken (copied)
    assert select_checkpoint_files(files, 9, no_zips, held_bases=held_4, max_chain=5) == sorted(
        ["metadata", "state/0/0/8.snapshot", "state/0/0/9.delta", "state/0/0/10.delta"])
    # Spark's cleanup deleted deltas 1..7: no chain from 0 or from 4 -> the newest snapshot
    cleaned = ["metadata", "state/0/0/8.snapshot", *[f"state/0/0/{v}.delta" for v in range(8, 13)]]
    assert select_checkpoint_files(cleaned, 9, no_zips, held_bases=lambda rel: False) == sorted(
        ["metadata", "state/0/0/8.snapshot", "state/0/0/9.delta", "state/0/0/10.delta"])
    # a held snapshot at the version itself needs no delta; without held_bases: the newest base as before
    assert select_checkpoint_files(files, 7, no_zips, held_bases={"state/0/0/8.snapshot"}.__contains__) == [
        "metadata", "state/0/0/8.snapshot"]
    assert select_checkpoint_files(files, 9, no_zips) == select_checkpoint_files(
        files, 9, no_zips, held_bases=held_4, max_chain=0)
    # RocksDB folders never chain
    rocks = [f"state/0/0/{v}.changelog" for v in range(1, 8)] + ["state/0/0/6.zip"]
    assert select_checkpoint_files(rocks, 5, lambda rel: [], held_bases=lambda rel: False) == ["state/0/0/6.zip"]


# ----------------------------------------------------------------------------- Spark helpers

KEYS = 40


def expected_totals(seed: int, total: int, keys: int = KEYS) -> dict[str, tuple[int, int]]:
    t = generate_rows(seed, 0, total, keys).to_pydict()
    out: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for k, v in zip(t["key"], t["value"], strict=True):
        out[k][0] += 1
        out[k][1] += v
    return {k: (c, s) for k, (c, s) in out.items()}


class Collect:
    """foreachBatch: keep every micro-batch's rows by batch id."""

    def __init__(self) -> None:
        self.batches: dict[int, list[tuple[str, int, int]]] = {}

    def __call__(self, df: Any, batch_id: int) -> None:
        self.batches[batch_id] = [(r["key"], r["n"], r["total"]) for r in df.collect()]

    def totals(self, *others: Collect) -> dict[str, tuple[int, int]]:
        merged = dict(self.batches)
        for o in others:
            merged.update(o.batches)
        last: dict[str, tuple[int, int]] = {}
        for b in sorted(merged):
            for k, n, s in merged[b]:
                last[k] = (n, s)
        return last


def run_aggregation(spark: Any, checkpoint: Path, provider: str, *, df: Any = None, seed: int = 1,
                    total: int = 1200, per_batch: int = 200) -> Collect:
    from pyspark.sql import functions as F

    collect = Collect()
    previous = spark.conf.get("spark.sql.streaming.stateStore.providerClass")
    spark.conf.set("spark.sql.streaming.stateStore.providerClass", STATE_STORES[provider])
    try:
        if df is None:
            df = generator_source(spark, seed=seed, keys=KEYS, total_rows=total, rows_per_batch=per_batch)
        agg = df.groupBy("key").agg(F.count("*").alias("n"), F.sum("value").alias("total"))
        q = (agg.writeStream.outputMode("update").foreachBatch(collect)
             .option("checkpointLocation", str(checkpoint)).trigger(availableNow=True).start())
        q.awaitTermination(240)
        assert not q.isActive, "the query did not finish in time"
        assert q.exception() is None, q.exception()
    finally:
        spark.conf.set("spark.sql.streaming.stateStore.providerClass", previous)
    return collect


@pytest.fixture
def pipeline(store: Any) -> Iterator[str]:
    pid = f"snap-{uuid.uuid4().hex[:8]}"
    store.register_pipeline(pid, stages=["agg"], run_id="r1")
    store.set_pipeline_state(pid, PipelineState.RUNNING)
    yield pid


def new_epoch(store: Any, pid: str) -> int:
    store.heartbeat(pid, "r1")  # as the driver does while its queries run: a Spark run longer than 30 s on a
    # loaded machine otherwise leaves the pipeline "not alive" and the trigger starts no epoch
    tick = store.trigger_tick(pid, CheckpointPolicy(interval=1), force=True)
    assert tick.started is not None, tick
    return int(tick.started.epoch)


def complete(store: Any, pid: str, epoch: int, result: Any) -> None:
    store.ack_epoch(pid, epoch, "agg", bytes_new=result.bytes_new, bytes_total=result.bytes_total)


# ----------------------------------------------------------------------------- Spark tests


@pytest.mark.spark
@pytest.mark.parametrize("provider", ["hdfs", "rocksdb"])
def test_restore_from_a_middle_batch_gives_the_same_result(spark: Any, store: Any, pipeline: str, tmp_path: Path,
                                                           provider: str) -> None:
    fs = FileSystem.from_uri(str(tmp_path))
    snaps = SnapshotStore(fs, pipeline, store)
    ckpt = snaps.layout.checkpoint("agg")
    straight = run_aggregation(spark, tmp_path / ckpt, provider)
    assert sorted(straight.batches) == list(range(6))
    expected = expected_totals(1, 1200)
    assert straight.totals() == expected

    epoch = new_epoch(store, pipeline)
    result = snaps.capture("agg", epoch, ckpt, 2)  # the checkpoint as of batch 2

    def obj(e: Any) -> Path:
        return tmp_path / object_path(pipeline, e.object_key)

    complete(store, pipeline, epoch, result)
    rels = {e.rel_path for e in result.entries}
    assert "offsets/2" in rels and "commits/2" in rels and "offsets/3" not in rels and "commits/3" not in rels
    assert "offsets/0" not in rels and "commits/0" not in rels  # only the cut batch and the one before it
    assert result.bytes_new == result.bytes_total > 0

    snaps.link_objects = False  # copied: same files, none shares its object's inode
    copied = snaps.prepare_restore("agg", epoch)
    assert copied.linked == 0 and copied.files == len(result.entries)
    assert all(os.stat(tmp_path / copied.folder / e.rel_path).st_ino != os.stat(obj(e)).st_ino
               for e in result.entries)
    snaps.discard([copied])
    snaps.link_objects = True
    prepared = snaps.prepare_restore("agg", epoch)
    # objects and checkpoint on one local disk: every file is its object, hard-linked
    assert prepared.linked == prepared.files == len(result.entries)
    assert all(os.stat(tmp_path / prepared.folder / e.rel_path).st_ino == os.stat(obj(e)).st_ino
               for e in result.entries)
    previous = snaps.commit_restore(prepared)
    assert previous == ckpt and (tmp_path / ckpt / "commits" / "5").exists()  # the old one, kept as it was
    restored = snaps.layout.checkpoint("agg")
    assert restored == prepared.folder != ckpt
    assert (tmp_path / restored / "commits" / "2").exists() and not (tmp_path / restored / "commits" / "3").exists()

    # Spark runs on the linked files: it writes new versions, deletes old batch logs (minBatchesToRetain 1) and
    # state files (maintenance every 200 ms in these tests); RocksDB loads its SSTs through the provider's file
    # system, linked too
    spark.conf.set("spark.sql.streaming.minBatchesToRetain", "1")
    try:
        resumed = run_aggregation(spark, tmp_path / restored, provider)
    finally:
        spark.conf.unset("spark.sql.streaming.minBatchesToRetain")
    assert min(resumed.batches) == 3  # Spark resumed after the snapshot's batch
    first_half = Collect()
    first_half.batches = {b: r for b, r in straight.batches.items() if b <= 2}
    assert first_half.totals(resumed) == expected
    assert not (tmp_path / restored / "offsets" / "1").exists()  # Spark deleted a linked file
    # every object is as it was published: its bytes still hash to its name
    for e in result.entries:
        data = obj(e).read_bytes()
        assert len(data) == e.bytes and hashlib.sha256(data).hexdigest() == object_digest(e.object_key), e.rel_path
    snaps.checkpoint_fs.delete_tree(restored)  # what cleanup does to an old checkpoint folder: objects stay
    assert all(obj(e).stat().st_size == e.bytes for e in result.entries)


@pytest.mark.spark
def test_cut_before_batch_0_restores_to_an_empty_state_spark_accepts(spark: Any, store: Any, pipeline: str,
                                                                      tmp_path: Path) -> None:
    """Issue 30, finding 1: a barrier that reaches a stateful stage while its batch 0 runs cuts at batch -1; the
    snapshot must hold none of the state files batch 0 (and later ones) wrote, or Spark refuses the restored
    checkpoint (STATE_STORE_CHECKPOINT_LOCATION_NOT_EMPTY) and the epoch blocks every later restore."""
    fs = FileSystem.from_uri(str(tmp_path))
    snaps = SnapshotStore(fs, pipeline, store)
    ckpt = snaps.layout.checkpoint("agg")
    run_aggregation(spark, tmp_path / ckpt, "hdfs", total=400, per_batch=200)
    assert list((tmp_path / ckpt / "state").rglob("schema")), "the premise: batch 0 wrote state metadata"
    epoch = new_epoch(store, pipeline)
    result = snaps.capture("agg", epoch, ckpt, -1)
    assert [e.rel_path for e in result.entries] == ["metadata"]
    complete(store, pipeline, epoch, result)
    snaps.commit_restore(snaps.prepare_restore("agg", epoch))
    resumed = run_aggregation(spark, tmp_path / snaps.layout.checkpoint("agg"), "hdfs", total=400, per_batch=200)
    assert min(resumed.batches) == 0
    assert resumed.totals() == expected_totals(1, 400)


def test_epoch_recorded_with_an_unrestorable_snapshot_is_refused_before_anything_changes(
        store: Any, pipeline: str, tmp_path: Path) -> None:
    """An epoch that completed before the check (its snapshot holds batch 0's state metadata and no batch) is
    refused by name before a file is copied, and the live checkpoint stays as it was."""
    from airflow_arroyo.core.exceptions import UnrestorableEpochError
    from airflow_arroyo.store import SnapshotEntry

    snaps = SnapshotStore(FileSystem.from_uri(str(tmp_path)), pipeline, store)
    epoch = new_epoch(store, pipeline)
    entries = [SnapshotEntry(rel, f"sha256/{i:02x}/{i:064x}", 10) for i, rel in enumerate(
        ["metadata", "state/0/_metadata/metadata", "state/0/0/left-keyToNumValues/_metadata/schema"])]
    store.record_snapshot(pipeline, epoch, "agg", entries)
    store.ack_epoch(pipeline, epoch, "agg", bytes_new=30, bytes_total=30)
    before = snaps.layout.checkpoint("agg")
    with pytest.raises(UnrestorableEpochError, match=f"epoch {epoch} cannot be restored.*no committed batch") as info:
        snaps.prepare_restore("agg", epoch)
    assert info.value.stage == "agg" and info.value.epoch == epoch
    assert snaps.layout.checkpoint("agg") == before
    assert not list(tmp_path.rglob("metadata")), "nothing was rebuilt"


@pytest.mark.spark
def test_incremental_snapshot_of_large_mostly_unchanged_state(spark: Any, store: Any, pipeline: str,
                                                              tmp_path: Path) -> None:
    """A large state (50k keys) then small batches touching few keys: the second epoch copies a small
    fraction of what it references."""
    from pyspark.sql import functions as F

    fs = FileSystem.from_uri(str(tmp_path))
    snaps = SnapshotStore(fs, pipeline, store)
    uri = str(tmp_path / "input")
    ch = Channel.create(uri, pa.schema([("key", pa.string()), ("value", pa.int64())]))

    def rows(keys: range) -> pa.Table:
        return pa.table({"key": [f"key-{i:06d}" for i in keys], "value": list(keys)})

    ch.append_table(rows(range(50_000)), 0, "test")  # batch 0: the large state
    collect = Collect()

    def start() -> Any:
        df = read_channel(spark, uri)
        agg = df.groupBy("key").agg(F.count("*").alias("n"), F.sum("value").alias("total"))
        return (agg.writeStream.outputMode("update").foreachBatch(collect)
                .option("checkpointLocation", str(tmp_path / "ckpt")).trigger(availableNow=True).start())

    q = start()
    q.awaitTermination(240)
    e1 = new_epoch(store, pipeline)
    r1 = snaps.capture("agg", e1, "ckpt", 0)
    complete(store, pipeline, e1, r1)
    for b in range(1, 4):  # three small batches touching 20 keys each
        ch.append_table(rows(range(b * 20, b * 20 + 20)), b, "test")
        q = start()
        q.awaitTermination(240)
        assert q.exception() is None
    last = max(collect.batches)
    e2 = new_epoch(store, pipeline)
    r2 = snaps.capture("agg", e2, "ckpt", last)
    complete(store, pipeline, e2, r2)
    assert r1.bytes_new == r1.bytes_total
    assert r2.bytes_total > r1.bytes_total
    assert r2.bytes_new < 0.05 * r2.bytes_total, (r2.bytes_new, r2.bytes_total)
    # the big delta files of batch 0 are referenced by both epochs, stored once
    shared = {e.object_key for e in r1.entries} & {e.object_key for e in r2.entries}
    assert sum(e.bytes for e in r1.entries if e.object_key in shared) > 0.9 * r1.bytes_total
    stored = list((tmp_path / pipeline / "snapshots" / "objects").rglob("*"))
    assert sum(p.stat().st_size for p in stored if p.is_file()) == r1.bytes_new + r2.bytes_new
    rec = store.get_epoch(pipeline, e2)
    assert (rec.bytes_new, rec.bytes_total) == (r2.bytes_new, r2.bytes_total)


@pytest.mark.spark
def test_full_snapshot_spark_wrote_is_not_copied_and_restore_after_retention_is_exact(
        spark: Any, store: Any, tmp_path: Path) -> None:
    """Spark's maintenance writes full ``.snapshot`` files (minDeltasForSnapshot 2, maintenance every 200 ms in
    the session): every epoch still copies at most 1.2x the state (``.delta`` bytes) Spark wrote since the
    previous epoch, and the newest epoch, whose delta chain is its own, restores exactly and verifies after
    retention pruned the older ones."""
    pid = f"snapinc-{uuid.uuid4().hex[:8]}"
    store.register_pipeline(pid, stages=["agg"], run_id="r1", storage_uri=str(tmp_path))
    store.set_pipeline_state(pid, PipelineState.RUNNING)
    snaps = SnapshotStore(FileSystem.from_uri(str(tmp_path)), pid, store)
    ckpt = snaps.layout.checkpoint("agg")
    keys, total, per_batch = 8000, 7000, 1000  # 7 batches, each updating ~940 keys
    conf = "spark.sql.streaming.stateStore.minDeltasForSnapshot"
    before = spark.conf.get(conf)
    spark.conf.set(conf, "2")
    try:
        straight = run_aggregation(spark, tmp_path / ckpt, "hdfs", df=generator_source(
            spark, seed=3, keys=keys, total_rows=total, rows_per_batch=per_batch))
    finally:
        spark.conf.set(conf, before)
    expected = expected_totals(3, total, keys)
    assert straight.totals() == expected
    root = tmp_path / ckpt
    files = sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())

    def delta_bytes(after: int, upto: int) -> int:
        return sum(p.stat().st_size for p in (root / "state").rglob("*.delta")
                   if after < int(p.name.split(".")[0]) <= upto)

    epochs: list[int] = []
    old_rule_copies_a_snapshot = False
    version = 0
    for cut in (1, 3, 5):  # state versions 2, 4, 6
        epoch = new_epoch(store, pid)
        result = snaps.capture("agg", epoch, ckpt, cut)
        complete(store, pid, epoch, result)
        written = delta_bytes(version, cut + 1)
        print(f"epoch {epoch}: bytes new {result.bytes_new}, state written {written}, "
              f"ratio {result.bytes_new / written:.3f}")
        assert 0 < result.bytes_new <= 1.2 * written, (epoch, result.bytes_new, written)
        assert not any(e.rel_path.endswith(".snapshot") for e in result.entries)
        old_rule = select_checkpoint_files(files, cut, no_zips)  # the newest snapshot, copied whole
        old_rule_copies_a_snapshot |= any(r.endswith(".snapshot") and int(r.rsplit("/", 1)[1].split(".")[0]) > version
                                          for r in old_rule)
        epochs.append(epoch)
        version = cut + 1
    assert old_rule_copies_a_snapshot, f"Spark's maintenance wrote no .snapshot in time: {files}"

    report = prune_pipeline(store, pid, RetentionPolicy(keep_last=1), holder="test")
    assert report.epochs_pruned == epochs[:2]
    assert verify_pipeline(store, pid).ok
    prepared = snaps.prepare_restore("agg", epochs[-1])
    snaps.commit_restore(prepared)
    restored = tmp_path / snaps.layout.checkpoint("agg")
    assert not list(restored.rglob("*.snapshot"))  # Spark loads version 6 from deltas 1..6
    resumed = run_aggregation(spark, restored, "hdfs", df=generator_source(
        spark, seed=3, keys=keys, total_rows=total, rows_per_batch=per_batch))
    assert min(resumed.batches) == 6
    first = Collect()
    first.batches = {b: r for b, r in straight.batches.items() if b <= 5}
    assert first.totals(resumed) == expected


@pytest.mark.spark
def test_rewritten_state_file_gets_a_new_object_after_restore(spark: Any, store: Any, pipeline: str,
                                                              tmp_path: Path) -> None:
    """After a restore Spark writes N.delta again with other content: content addressing keeps both."""
    from pyspark.sql import functions as F

    fs = FileSystem.from_uri(str(tmp_path))
    snaps = SnapshotStore(fs, pipeline, store)
    uri = str(tmp_path / "input")
    schema = pa.schema([("key", pa.string()), ("value", pa.int64())])
    ch = Channel.create(uri, schema)

    def run(collect: Collect) -> None:
        df = read_channel(spark, uri)
        agg = df.groupBy("key").agg(F.count("*").alias("n"), F.sum("value").alias("total"))
        q = (agg.writeStream.outputMode("update").foreachBatch(collect)
             .option("checkpointLocation", str(tmp_path / live())).trigger(availableNow=True).start())
        q.awaitTermination(240)
        assert q.exception() is None

    def live() -> str:
        return snaps.layout.checkpoint("agg")

    ch.append_table(pa.table({"key": ["a", "b"], "value": [1, 2]}), 0, "t")
    c1 = Collect()
    run(c1)
    e1 = new_epoch(store, pipeline)
    complete(store, pipeline, e1, snaps.capture("agg", e1, live(), 0))
    ch.append_table(pa.table({"key": ["a"], "value": [10]}), 1, "t")
    run(c1)
    e2 = new_epoch(store, pipeline)
    r2 = snaps.capture("agg", e2, live(), 1)
    complete(store, pipeline, e2, r2)
    # restore epoch 1; the input after it changes (like a different batching after a restore)
    snaps.commit_restore(snaps.prepare_restore("agg", e1))
    ch.truncate_from(1)
    ch = Channel.open(uri)
    ch.append_table(pa.table({"key": ["a", "b"], "value": [100, 200]}), 1, "t")
    c2 = Collect()
    run(c2)
    assert {k: (n, t) for k, n, t in c2.batches[1]} == {"a": (2, 101), "b": (2, 202)}
    e3 = new_epoch(store, pipeline)
    r3 = snaps.capture("agg", e3, live(), 1)
    complete(store, pipeline, e3, r3)
    deltas2 = {e.rel_path: e.object_key for e in r2.entries if e.rel_path.endswith("2.delta")}
    deltas3 = {e.rel_path: e.object_key for e in r3.entries if e.rel_path.endswith("2.delta")}
    assert deltas2 and set(deltas2) == set(deltas3)
    assert any(deltas2[p] != deltas3[p] for p in deltas2), "same name, new content: must be a new object"
    # epoch 2 still restores to its own content
    snaps.commit_restore(snaps.prepare_restore("agg", e2))
    ch.truncate_from(2)
    c3 = Collect()
    ch = Channel.open(uri)
    ch.append_table(pa.table({"key": ["b"], "value": [5]}), 2, "t")
    run(c3)
    assert dict((k, (n, s)) for k, n, s in c3.batches[2]) == {"b": (2, 7)}  # 2 + 5 from epoch 2's state


@pytest.mark.spark
def test_missing_or_corrupt_object_names_epoch_and_file_and_changes_nothing(spark: Any, store: Any, pipeline: str,
                                                                           tmp_path: Path) -> None:
    fs = FileSystem.from_uri(str(tmp_path))
    snaps = SnapshotStore(fs, pipeline, store)
    run_aggregation(spark, tmp_path / "ckpt", "hdfs", total=400, per_batch=200)
    epoch = new_epoch(store, pipeline)
    result = snaps.capture("agg", epoch, "ckpt", 1)
    complete(store, pipeline, epoch, result)
    before = sorted(str(p.relative_to(tmp_path)) for p in (tmp_path / "ckpt").rglob("*"))

    victim = next(e for e in result.entries if e.rel_path.endswith(".delta"))
    obj = tmp_path / object_path(pipeline, victim.object_key)
    good = obj.read_bytes()
    obj.write_bytes(good[:-1] + bytes([good[-1] ^ 0xFF]))
    pattern = rf"epoch {epoch} cannot be restored: file {victim.rel_path}.*corrupt"
    with pytest.raises(SnapshotError, match=pattern) as ei:
        snaps.prepare_restore("agg", epoch)
    assert ei.value.epoch == epoch and ei.value.path is not None
    obj.unlink()
    with pytest.raises(SnapshotError, match=rf"epoch {epoch} cannot be restored: file {victim.rel_path}.*missing"):
        snaps.prepare_restore("agg", epoch)
    after = sorted(str(p.relative_to(tmp_path)) for p in (tmp_path / "ckpt").rglob("*"))
    assert after == before  # the live checkpoint is untouched
    assert list((tmp_path / pipeline / "stages" / "agg").iterdir()) == []  # no half-built checkpoint folder left
    obj.write_bytes(good)
    prepared = snaps.prepare_restore("agg", epoch)
    assert prepared.files == len(result.entries)
    snaps.discard([prepared])
    assert json.loads((tmp_path / "ckpt" / "metadata").read_text())["id"]


def test_known_object_whose_file_is_gone_is_copied_again(store: Any, pipeline: str, tmp_path: Path) -> None:
    """Retention may delete an object that only a pruned epoch referenced while a later snapshot still
    sees its row: a snapshot references a known object only if its file is really there."""
    fs = FileSystem.from_uri(str(tmp_path))
    snaps = SnapshotStore(fs, pipeline, store)
    for rel, text in {"metadata": '{"id":"q"}', "offsets/0": "v1\n{}\n{\"pos\":1}", "commits/0": "v1\n{}"}.items():
        (tmp_path / "ckpt" / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "ckpt" / rel).write_text(text)
    e1 = new_epoch(store, pipeline)
    r1 = snaps.capture("agg", e1, "ckpt", 0)
    complete(store, pipeline, e1, r1)
    assert r1.files_copied == 3
    victim = r1.entries[0]
    (tmp_path / object_path(pipeline, victim.object_key)).unlink()
    e2 = new_epoch(store, pipeline)
    r2 = snaps.capture("agg", e2, "ckpt", 0)
    assert (r2.files_copied, r2.bytes_new) == (1, victim.bytes)
    assert (tmp_path / object_path(pipeline, victim.object_key)).read_bytes() == (tmp_path / "ckpt" /
                                                                                  victim.rel_path).read_bytes()


def test_new_full_snapshot_is_chained_over_not_copied_until_the_chain_is_too_long(store: Any, pipeline: str,
                                                                                 tmp_path: Path) -> None:
    """Capture end to end without Spark: a new ``.snapshot`` is hashed but not copied while the deltas it
    summarises are there; once it is copied (the chain bound), later epochs chain from it."""
    snaps = SnapshotStore(FileSystem.from_uri(str(tmp_path)), pipeline, store)
    ckpt = tmp_path / "ckpt"

    def write(rel: str, data: bytes) -> int:
        (ckpt / rel).parent.mkdir(parents=True, exist_ok=True)
        (ckpt / rel).write_bytes(data)
        return len(data)

    def batches(upto: int) -> int:
        """Offsets and commits of batches 0..upto; the bytes of the new ones a snapshot at upto keeps
        (the last BATCH_LOG_ENTRIES of each log)."""
        return sum(write(f"{log}/{b}", f"v1\n{log} of batch {b}".encode()) * (b > upto - BATCH_LOG_ENTRIES)
                   for b in range(upto + 1) for log in ("offsets", "commits") if not (ckpt / log / str(b)).exists())

    def capture(cut: int) -> Any:
        epoch = new_epoch(store, pipeline)
        result = snaps.capture("agg", epoch, "ckpt", cut)
        complete(store, pipeline, epoch, result)
        return result

    write("metadata", b'{"id":"q"}')
    deltas = {v: write(f"state/0/0/{v}.delta", bytes([v]) * 1000) for v in range(1, 5)}
    logs = batches(3)
    r1 = capture(3)
    assert r1.bytes_new == sum(deltas.values()) + logs + len('{"id":"q"}')
    deltas |= {v: write(f"state/0/0/{v}.delta", bytes([v]) * 1000) for v in (5, 6)}
    write("state/0/0/5.snapshot", b"S" * 50_000)  # Spark's maintenance: the whole state, 10x a delta
    logs = batches(5)
    r2 = capture(5)
    assert r2.bytes_new == deltas[5] + deltas[6] + logs  # not the snapshot
    assert {e.rel_path for e in r2.entries if e.rel_path.startswith("state/")} == {
        f"state/0/0/{v}.delta" for v in range(1, 7)}
    snaps.max_delta_chain = 3  # the chain 1..7 is now too long: the newest snapshot is copied, once
    deltas[7] = write("state/0/0/7.delta", b"\x07" * 1000)
    logs = batches(6)
    r3 = capture(6)
    assert r3.bytes_new == 50_000 + deltas[7] + logs
    assert {e.rel_path for e in r3.entries if e.rel_path.startswith("state/")} == {
        "state/0/0/5.snapshot", "state/0/0/6.delta", "state/0/0/7.delta"}
    deltas[8] = write("state/0/0/8.delta", b"\x08" * 1000)
    write("state/0/0/8.snapshot", b"T" * 50_000)
    logs = batches(7)
    r4 = capture(7)  # chains from the held 5.snapshot, not the new 8.snapshot
    assert r4.bytes_new == deltas[8] + logs
    assert {e.rel_path for e in r4.entries if e.rel_path.startswith("state/")} == {
        "state/0/0/5.snapshot", *(f"state/0/0/{v}.delta" for v in (6, 7, 8))}


def test_the_snapshot_store_remembers_hashes_only_of_files_still_in_the_checkpoint(store: Any, pipeline: str,
                                                                                   tmp_path: Path) -> None:
    """A driver runs for months: Spark writes new checkpoint files every batch and deletes old ones, so what the
    snapshot store keeps per file (its hash memo) must follow the checkpoint, not the run's history."""
    snaps = SnapshotStore(FileSystem.from_uri(str(tmp_path)), pipeline, store)
    ckpt = tmp_path / "ckpt"
    (ckpt / "state/0/0").mkdir(parents=True)
    (ckpt / "offsets").mkdir()
    (ckpt / "commits").mkdir()
    (ckpt / "metadata").write_text('{"id":"q"}')
    sizes: list[int] = []
    retained = 4  # batches Spark keeps (minBatchesToRetain)
    for batch in range(40):
        for rel, data in {f"offsets/{batch}": f"v1\n{{}}\n{{\"pos\":{batch}}}", f"commits/{batch}": "v1\n{}",
                          f"state/0/0/{batch + 1}.delta": f"delta {batch + 1}"}.items():
            (ckpt / rel).write_text(data)
        old = batch - retained
        if old >= 0:  # Spark's cleanup; the chain then starts at a snapshot of the state it wrote
            for rel in (f"offsets/{old}", f"commits/{old}", f"state/0/0/{old + 1}.delta", f"state/0/0/{old}.snapshot"):
                (ckpt / rel).unlink(missing_ok=True)
            (ckpt / f"state/0/0/{old + 1}.snapshot").write_text(f"state {old + 1}")
        epoch = new_epoch(store, pipeline)
        complete(store, pipeline, epoch, snaps.capture("agg", epoch, "ckpt", batch))
        sizes.append(max([len(v) for v in vars(snaps).values() if isinstance(v, dict | list | set)], default=0))
    files = sum(1 for p in ckpt.rglob("*") if p.is_file())
    assert max(sizes) <= files + 4, sizes  # what one listing holds (plus files deleted between two captures)
    assert sizes[-1] == sizes[-10], sizes  # flat, not one more entry per batch


def test_a_restore_from_unreachable_storage_says_retry_not_an_earlier_epoch(
        store: Any, pipeline: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 30, finding 5 g: storage that refuses the connection is not a damaged epoch."""
    import socket

    fs = FileSystem.from_uri(str(tmp_path))
    snaps = SnapshotStore(fs, pipeline, store)
    for rel, text in {"metadata": '{"id":"q"}', "offsets/0": "v1\n{}\n{\"pos\":1}", "commits/0": "v1\n{}"}.items():
        (tmp_path / "ckpt" / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "ckpt" / rel).write_text(text)
    e1 = new_epoch(store, pipeline)
    complete(store, pipeline, e1, snaps.capture("agg", e1, "ckpt", 0))
    with socket.socket() as nobody:  # bound, not listening: connections to it are refused
        nobody.bind(("127.0.0.1", 0))
        for key, value in {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{nobody.getsockname()[1]}",
                           "AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s", "AWS_DEFAULT_REGION": "us-east-1",
                           "AWS_EC2_METADATA_DISABLED": "true"}.items():
            monkeypatch.setenv(key, value)
        unreachable = FileSystem.from_uri("s3://arroyo-unreachable/storage")
        with pytest.raises(SnapshotError) as info:
            snaps.prepare_restore("agg", e1, source=(unreachable, pipeline))
    message = str(info.value)
    assert f"epoch {e1} could not be restored: storage was unreachable reading file " in message, message
    assert "retry" in message and "earlier epoch" not in message
    assert "Could not connect" in message or "NETWORK_CONNECTION" in message  # what the storage said


def _one_epoch_of_a_small_checkpoint(store: Any, pipeline: str, tmp_path: Path) -> tuple[SnapshotStore, int]:
    snaps = SnapshotStore(FileSystem.from_uri(str(tmp_path)), pipeline, store)
    for rel, text in {"metadata": '{"id":"q"}', "offsets/0": "v1\n{}\n{\"pos\":1}", "commits/0": "v1\n{}"}.items():
        (tmp_path / "ckpt" / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "ckpt" / rel).write_text(text)
    epoch = new_epoch(store, pipeline)
    complete(store, pipeline, epoch, snaps.capture("agg", epoch, "ckpt", 0))
    return snaps, epoch


def test_a_rebuild_into_a_folder_that_holds_files_is_refused_and_leaves_them(store: Any, pipeline: str,
                                                                             tmp_path: Path) -> None:
    """A file already where a rebuild links an object is not unreachable storage; and the folder is not the
    rebuild's own to delete when it fails."""
    snaps, e1 = _one_epoch_of_a_small_checkpoint(store, pipeline, tmp_path)
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "metadata").write_text("someone else's")
    with pytest.raises(SnapshotError) as info:
        snaps.rebuild("agg", e1, "taken")
    message = str(info.value)
    assert f"epoch {e1} was not restored: the folder {snaps.checkpoint_fs.uri_of('taken')} " in message, message
    assert "already holds files" in message and "nothing was changed" in message and "unreachable" not in message
    assert [p.name for p in (tmp_path / "taken").iterdir()] == ["metadata"]
    assert (tmp_path / "taken" / "metadata").read_text() == "someone else's"


@pytest.mark.parametrize("same", [True, False])
def test_a_file_that_appears_where_a_restore_links_is_named_as_another_writer(
        store: Any, pipeline: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, same: bool) -> None:
    """A file that appears in the folder while it is rebuilt (another restore into the same folder: a link to the
    same object, or any other file) is named, not reported as unreachable storage."""
    snaps, e1 = _one_epoch_of_a_small_checkpoint(store, pipeline, tmp_path)
    snaps.restore_workers = 1
    metadata = next(e for e in store.snapshot_entries(pipeline, e1, "agg") if e.rel_path == "metadata")
    made = snaps.checkpoint_fs.makedirs

    def another_writer(path: str) -> None:  # after the rebuild found the folder empty
        made(path)
        if same:
            os.link(tmp_path / object_path(pipeline, metadata.object_key), tmp_path / path / "metadata")
        else:
            (tmp_path / path / "metadata").write_text("xyz")

    monkeypatch.setattr(snaps.checkpoint_fs, "makedirs", another_writer)
    with pytest.raises(SnapshotError) as info:
        snaps.prepare_restore("agg", e1)
    message = str(info.value)
    what = "a link to the same object" if same else "another file (3 bytes)"
    assert f"epoch {e1} was not restored: {what} appeared at " in message, message
    assert "something else writes into that folder" in message and "unreachable" not in message
