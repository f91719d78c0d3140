"""OpenLineage run events per epoch (airflow_arroyo.lineage).

* The event of a hand-built provenance: every dataset name and every facet's values.
* Which epochs are due at a look (the newest waits for the next to complete; a first look catches up).
* End to end, without Spark: the checkpoint trigger controls a pipeline whose stand-in driver writes what a real
  one writes for each epoch (Spark offset logs and a file source's log as snapshot objects, acknowledgements with
  their cut batch, sink commits) into a real PostgreSQL epoch store; the REAL OpenLineage provider, configured
  with its file transport, writes the events, which are read back from the file and checked against the
  provenance of each epoch.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from openlineage.client.serde import Serde

from airflow_arroyo import lineage
from airflow_arroyo.core.epochs import CheckpointPolicy, EpochState, PipelineState
from airflow_arroyo.core.fs import FileSystem
from airflow_arroyo.core.provenance import (
    EpochProvenance,
    SinkProvenance,
    SourceRange,
    StageProvenance,
    epoch_provenance,
)
from airflow_arroyo.lineage import (
    PRODUCER,
    EpochLineage,
    emit_settled_epochs,
    epoch_event,
    epoch_run_id,
    pipeline_run_id,
    sink_dataset_name,
)
from airflow_arroyo.runtime.layout import object_path
from airflow_arroyo.store import AsyncEpochStore, EpochRecord, EpochStore, SnapshotEntry
from airflow_arroyo.triggers import checkpoint as trigger_module
from airflow_arroyo.triggers.checkpoint import CheckpointTrigger
from tests.airflow.test_checkpoint_trigger import VirtualClock, first_event

pytestmark = pytest.mark.timeout(120)

DOCS = f"{PRODUCER}/blob/main/docs/lineage.md"


def hand_built() -> EpochProvenance:
    return EpochProvenance(
        pipeline_id="shop", epoch=7, previous_epoch=5, previous_pruned=False,
        stages=[
            StageProvenance("orders", 12, 9, 4, 400, [SourceRange(0, {"orders": {"0": 10, "1": 3}},
                                                                  {"orders": {"0": 25, "1": 8}})]),
            StageProvenance("events", 3, 2, 2, 50, [SourceRange(0, {"logOffset": 2}, {"logOffset": 3},
                                                                ["file:///in/b/003.json", "file:///in/b/004.json"])]),
            StageProvenance("gen", 6, None, 1, 30, [SourceRange(0, None, {"id": 60})]),
            StageProvenance("dedup", 8, 6, 3, 70, [SourceRange(0, {"pos": 40}, {"pos": 55})]),
        ],
        sinks=[
            SinkProvenance("report", "file:///out/report", 8, 6, 2, 15, 2048, None,
                           ["000000000007-a.parquet", "000000000008-b.parquet"]),
            SinkProvenance("totals", "postgresql://arroyo:***@db.example:5433/warehouse#analytics.totals",
                           8, None, 0, 9, 0, None),
            SinkProvenance("table", "s3a://lake/tables/orders", 8, 6, 3, 15, 4096, 42),
            SinkProvenance("out", "kafka://broker:9092/orders_out", 8, 6, 0, 15, 0, None),
        ])


def facet(obj: dict[str, Any], name: str) -> dict[str, Any]:
    """A facet's own values, its producer and schema URL checked and left out."""
    f = dict(obj[name])
    assert f.pop("_producer") == PRODUCER, name
    assert f.pop("_schemaURL"), name
    return f


def test_the_event_of_an_epoch_names_its_datasets_and_carries_its_ranges_and_commits() -> None:
    when = datetime(2026, 5, 1, 12, 0, 3, tzinfo=UTC)
    ev = Serde.to_dict(epoch_event(hand_built(), namespace="prod", event_time=when, run_id="run-9",
                                   kafka_namespace="kafka://broker:9092"))
    assert ev["eventType"] == "COMPLETE" and ev["eventTime"] == "2026-05-01T12:00:03+00:00"
    assert ev["producer"] == PRODUCER
    assert ev["run"]["runId"] == epoch_run_id("shop", 7) != epoch_run_id("shop", 8) != epoch_run_id("shoq", 7)
    assert ev["job"]["namespace"] == "prod" and ev["job"]["name"] == "shop.epochs"
    assert facet(ev["job"]["facets"], "jobType") == {"processingType": "STREAMING", "integration": "ARROYO",
                                                     "jobType": "EPOCH"}
    run = ev["run"]["facets"]
    parent = facet(run, "parent")
    assert parent["run"]["runId"] == pipeline_run_id("shop", "run-9") != pipeline_run_id("shop", "run-8")
    assert (parent["job"]["namespace"], parent["job"]["name"]) == ("prod", "shop")
    epoch = facet(run, "arroyo_epoch")
    assert run["arroyo_epoch"]["_schemaURL"] == f"{DOCS}#arroyo_epoch"
    assert epoch == {"pipelineId": "shop", "epoch": 7, "previousEpoch": 5, "previousPruned": False,
                     "snapshotObjects": 10, "snapshotBytes": 550, "stages": [
                         {"stage": "orders", "batchId": 12, "previousBatchId": 9, "objects": 4, "bytes": 400},
                         {"stage": "events", "batchId": 3, "previousBatchId": 2, "objects": 2, "bytes": 50},
                         {"stage": "gen", "batchId": 6, "objects": 1, "bytes": 30},  # None is left out
                         {"stage": "dedup", "batchId": 8, "previousBatchId": 6, "objects": 3, "bytes": 70}]}

    # inputs: the sources; the channel the dedup stage reads is the pipeline's own, not an input
    inputs = {(d["namespace"], d["name"]): d for d in ev["inputs"]}
    assert list(inputs) == [("kafka://broker:9092", "orders"), ("file", "/in/b"), ("x-arroyo://shop", "gen/0")]
    assert facet(inputs["kafka://broker:9092", "orders"]["inputFacets"], "arroyo_sourceRange") == {
        "stage": "orders", "sourceIndex": 0, "start": {"orders": {"0": 10, "1": 3}},
        "end": {"orders": {"0": 25, "1": 8}}}
    assert facet(inputs["file", "/in/b"]["inputFacets"], "arroyo_sourceRange") == {
        "stage": "events", "sourceIndex": 0, "start": {"logOffset": 2}, "end": {"logOffset": 3},
        "files": ["file:///in/b/003.json", "file:///in/b/004.json"]}
    assert facet(inputs["x-arroyo://shop", "gen/0"]["inputFacets"], "arroyo_sourceRange") == {
        "stage": "gen", "sourceIndex": 0, "end": {"id": 60}}

    outputs = {(d["namespace"], d["name"]): d for d in ev["outputs"]}
    assert list(outputs) == [("file", "/out/report"), ("postgres://db.example:5433", "warehouse.analytics.totals"),
                             ("s3://lake", "tables/orders"), ("kafka://broker:9092", "orders_out")]
    report = outputs["file", "/out/report"]
    assert facet(report["outputFacets"], "arroyo_sinkCommit") == {
        "sink": "report", "batchId": 8, "previousBatchId": 6, "files": 2, "rows": 15, "bytes": 2048,
        "fileNames": ["000000000007-a.parquet", "000000000008-b.parquet"]}
    assert facet(report["outputFacets"], "outputStatistics") == {"rowCount": 15, "size": 2048, "fileCount": 2}
    assert report["facets"] == {}
    totals = outputs["postgres://db.example:5433", "warehouse.analytics.totals"]
    assert facet(totals["outputFacets"], "arroyo_sinkCommit") == {
        "sink": "totals", "batchId": 8, "files": 0, "rows": 9, "bytes": 0}
    table = outputs["s3://lake", "tables/orders"]
    assert facet(table["outputFacets"], "arroyo_sinkCommit")["tableVersion"] == 42
    assert facet(table["facets"], "version") == {"datasetVersion": "42"}
    assert "***" not in json.dumps(ev)  # no part of a DSN but host, port and database


def test_without_a_run_there_is_no_parent_and_kafka_brokers_unknown_are_said_so() -> None:
    ev = Serde.to_dict(epoch_event(hand_built(), namespace="default"))
    assert "parent" not in ev["run"]["facets"]
    assert ev["inputs"][0]["namespace"] == "kafka://unknown"


@pytest.mark.parametrize(("uri", "expected"), [
    ("file:///data/out", ("file", "/data/out")),
    ("/data/out", ("file", "/data/out")),
    ("s3://bucket/a/b", ("s3://bucket", "a/b")),
    ("s3a://bucket/a/b", ("s3://bucket", "a/b")),
    ("gs://bucket/a", ("gs://bucket", "/a")),
    ("kafka://k1:9093/topic.x", ("kafka://k1:9093", "topic.x")),
    ("postgresql://u:***@pg:5432/db#t", ("postgres://pg:5432", "db.public.t")),
    ("postgresql://u@pg/db#s.t", ("postgres://pg:5432", "db.s.t")),
    ("host=pg port=6432 dbname=db user=u password=***#s.t", ("postgres://pg:6432", "db.s.t")),
])
def test_sink_uris_follow_openlineages_naming(uri: str, expected: tuple[str, str]) -> None:
    assert sink_dataset_name(uri) == expected


def rec(epoch: int) -> EpochRecord:
    at = datetime(2026, 5, 1, tzinfo=UTC)
    return EpochRecord(pipeline_id="p", epoch=epoch, state=EpochState.COMPLETED, triggered_at=at, timeout_at=at)


def test_the_newest_completed_epoch_waits_for_the_next_or_the_end_and_a_first_look_catches_up() -> None:
    newest_first = [rec(n) for n in (9, 8, 6, 5)]
    due = lineage._settled
    assert [e.epoch for e in due(newest_first, 5, final=False)] == [6, 8]
    assert [e.epoch for e in due(newest_first, 5, final=True)] == [6, 8, 9]
    assert [e.epoch for e in due(newest_first, 9, final=True)] == []
    assert [e.epoch for e in due(newest_first, None, final=False)] == [5, 6, 8]
    many = [rec(n) for n in range(100, 0, -1)]
    assert [e.epoch for e in due(many, None, final=True)] == list(range(100 - lineage.CATCH_UP + 1, 101))
    assert due([], None, final=True) == []


# --------------------------------------------------------------------------- a real store and the real provider

PID = "shop"
SOURCES = ["orders", "events"]  # a Kafka source, a file source
STAGES = [*SOURCES, "dedup", "totals", "table", "out"]
TOTALS = "postgresql://arroyo:***@db.example:5433/warehouse#analytics.totals"


class StandIn:
    """Writes for each epoch what the driver writes: per stage the snapshot's Spark offset log entry of its cut
    batch (and a file source's log), the acknowledgement with that batch, then the sinks' commit records."""

    def __init__(self, store: EpochStore, storage: Path) -> None:
        self.store, self.fs = store, FileSystem.from_uri(str(storage))

    def snapshot(self, epoch: int, stage: str, files: dict[str, str]) -> None:
        entries = []
        for rel, text in files.items():
            key = f"{stage}-{epoch}-{rel.replace('/', '_')}"
            data = text.encode()
            self.fs.write_bytes_atomic(object_path(PID, key), data)
            entries.append(SnapshotEntry(rel, key, len(data)))
        self.store.record_snapshot(PID, epoch, stage, entries)

    def take(self, epoch: int) -> None:
        batch = epoch - 1  # one micro-batch per epoch
        meta = json.dumps({"batchWatermarkMs": 0, "batchTimestampMs": epoch})
        offsets = {"orders": {"orders": {"0": 10 * epoch, "1": 4 * epoch}}, "events": {"logOffset": batch},
                   "dedup": {"pos": 6 * epoch}}
        for stage in STAGES:
            if stage in offsets:
                files = {f"offsets/{batch}": f"v1\n{meta}\n{json.dumps(offsets[stage])}\n"}
                if stage == "events":  # the file source's log: one file per batch, all kept in the snapshot
                    for b in range(epoch):
                        entry = {"path": f"file:///in/events/{b:03d}.json", "timestamp": b, "batchId": b}
                        files[f"sources/0/{b}"] = f"v1\n{json.dumps(entry)}\n"
                self.snapshot(epoch, stage, files)
            self.store.ack_epoch(PID, epoch, stage, bytes_new=epoch, bytes_total=10 * epoch,
                                 details={"batch_id": batch})
        assert self.store.get_epoch(PID, epoch).state is EpochState.COMPLETED
        self.store.record_sink_commit(PID, epoch, "totals", uri=TOTALS, batch_id=batch, files=0, rows=3 * epoch,
                                      bytes_committed=0, run_id="run-1")
        self.store.record_sink_commit(PID, epoch, "table", uri="s3a://lake/tables/orders", batch_id=batch, files=1,
                                      rows=3 * epoch, bytes_committed=100 * epoch, run_id="run-1",
                                      table_version=epoch)


@pytest.fixture
def openlineage_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """The OpenLineage provider configured as a deployment would (``[openlineage]`` in Airflow's config) with its
    file transport; its cached configuration and client are dropped before and after."""
    from airflow.providers.openlineage import conf as ol_conf
    from airflow.providers.openlineage.plugins import listener

    path = tmp_path / "openlineage.jsonl"
    monkeypatch.setenv("AIRFLOW__OPENLINEAGE__TRANSPORT",
                       json.dumps({"type": "file", "log_file_path": str(path), "append": True}))
    monkeypatch.setenv("AIRFLOW__OPENLINEAGE__NAMESPACE", "arroyo-tests")
    monkeypatch.setenv("AIRFLOW__ARROYO__LINEAGE_KAFKA_NAMESPACE", "kafka://broker:9092")

    def forget() -> None:
        for fn in vars(ol_conf).values():
            if callable(getattr(fn, "cache_clear", None)):
                fn.cache_clear()
        listener.get_openlineage_listener.cache_clear()

    forget()
    yield path
    monkeypatch.undo()
    forget()


def read_events(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def without_time(event: dict[str, Any]) -> dict[str, Any]:
    """The event but its time, and the client's own ``tags`` run facet (its version), which it adds on emit."""
    run = {**event["run"], "facets": {k: v for k, v in event["run"]["facets"].items() if k != "tags"}}
    return {**{k: v for k, v in event.items() if k != "eventTime"}, "run": run}


async def test_the_checkpoint_trigger_emits_one_event_per_completed_epoch_through_the_providers_transport(
        store: EpochStore, migrated_dsn: str, tmp_path: Path, openlineage_file: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIRFLOW_CONN_ARROYO_DEFAULT", migrated_dsn)
    monkeypatch.setattr(trigger_module, "WAKE_ON_NOTIFY", False)  # virtual time: poll
    from airflow_arroyo.hooks import arroyo as hook_module

    hook_module._reset_shared_stores()
    store.register_pipeline(PID, stages=STAGES, run_id="run-1", storage_uri=str(tmp_path / "storage"))
    store.set_pipeline_state(PID, PipelineState.RUNNING, run_id="run-1")
    stand_in = StandIn(store, tmp_path / "storage")
    seen_when_completed: dict[int, int] = {}  # epoch -> events in the file when it completed

    def pipeline() -> None:
        ep = store.in_flight_epoch(PID)
        if ep is not None:
            seen_when_completed[ep.epoch] = len(read_events(openlineage_file))
            stand_in.take(ep.epoch)
        if len(store.list_epochs(PID, states=[EpochState.COMPLETED])) == 3:
            store.set_pipeline_state(PID, PipelineState.STOPPED)

    try:
        event = await first_event(CheckpointTrigger(pipeline_id=PID, interval=10.0), VirtualClock(migrated_dsn,
                                                                                                   pipeline))
    finally:
        hook_module._reset_shared_stores()
    assert event["status"] == "success", event

    events = read_events(openlineage_file)
    assert [e["run"]["facets"]["arroyo_epoch"]["epoch"] for e in events] == [1, 2, 3]  # each once, in order
    # an epoch's event waits for the next epoch (its sinks commit after it completes): none before epoch 2 did
    assert seen_when_completed[1] == seen_when_completed[2] == 0
    for n, got in enumerate(events, start=1):
        record = store.get_epoch(PID, n)
        expected = Serde.to_dict(epoch_event(epoch_provenance(store, PID, n), namespace="arroyo-tests",
                                             event_time=record.ended_at, run_id="run-1",
                                             kafka_namespace="kafka://broker:9092"))
        assert without_time(got) == without_time(expected), n
        assert got["run"]["runId"] == epoch_run_id(PID, n)
        assert got["job"] == {"namespace": "arroyo-tests", "name": "shop.epochs", "facets": got["job"]["facets"]}
        inputs = {(d["namespace"], d["name"]): d["inputFacets"]["arroyo_sourceRange"] for d in got["inputs"]}
        assert set(inputs) == {("kafka://broker:9092", "orders"), ("file", "/in/events")}
        kafka = inputs["kafka://broker:9092", "orders"]
        assert kafka["end"] == {"orders": {"0": 10 * n, "1": 4 * n}}
        assert kafka.get("start") == (None if n == 1 else {"orders": {"0": 10 * (n - 1), "1": 4 * (n - 1)}})
        assert inputs["file", "/in/events"]["files"] == [f"file:///in/events/{n - 1:03d}.json"]  # this epoch's only
        outputs = {d["name"]: d["outputFacets"]["arroyo_sinkCommit"] for d in got["outputs"]}
        assert outputs["warehouse.analytics.totals"]["rows"] == 3 * n
        assert outputs["tables/orders"]["tableVersion"] == n
        assert outputs["tables/orders"].get("previousBatchId") == (None if n == 1 else n - 2)
        assert got["run"]["facets"]["arroyo_epoch"]["snapshotObjects"] == sum(
            len(store.snapshot_entries(PID, n, s)) for s in STAGES)


async def test_a_restarted_emitter_repeats_only_the_same_runs_and_nothing_without_openlineage(
        store: EpochStore, tmp_path: Path, openlineage_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store.register_pipeline(PID, stages=STAGES, run_id="run-1", storage_uri=str(tmp_path / "storage"))
    store.set_pipeline_state(PID, PipelineState.RUNNING, run_id="run-1")
    stand_in = StandIn(store, tmp_path / "storage")
    policy = CheckpointPolicy(interval=1.0)
    for _ in range(2):
        tick = store.trigger_tick(PID, policy, force=True)
        assert tick.started is not None
        stand_in.take(tick.started.epoch)
    astore = AsyncEpochStore(store, coalesce=False, listen=False)
    first = EpochLineage(PID)
    await first.look(astore, 2)
    assert [e["run"]["runId"] for e in read_events(openlineage_file)] == [epoch_run_id(PID, 1)]  # 2 waits
    # a triggerer restart: a new emitter catches up, re-emitting epoch 1 under the same run id (a consumer keeps
    # one of each); once the run ended, epoch 2 as well
    again = EpochLineage(PID)
    await again.look(astore, 0, final=True)
    assert [e["run"]["runId"] for e in read_events(openlineage_file)] == [
        epoch_run_id(PID, 1), epoch_run_id(PID, 1), epoch_run_id(PID, 2)]
    assert again.after == 2
    # OpenLineage disabled: nothing is written, nothing fails
    monkeypatch.setenv("AIRFLOW__OPENLINEAGE__DISABLED", "True")
    from airflow.providers.openlineage import conf as ol_conf

    getattr(ol_conf.is_disabled, "cache_clear", lambda: None)()  # cached unless Airflow's unit test mode
    silent = EpochLineage(PID)
    await silent.look(astore, 0, final=True)
    assert silent.after is None and len(read_events(openlineage_file)) == 3


def test_an_epoch_whose_provenance_cannot_be_read_is_passed_with_a_warning(
        store: EpochStore, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    store.register_pipeline(PID, stages=STAGES, run_id="run-1", storage_uri=str(tmp_path / "storage"))
    store.set_pipeline_state(PID, PipelineState.RUNNING, run_id="run-1")
    stand_in = StandIn(store, tmp_path / "storage")
    for _ in range(2):
        tick = store.trigger_tick(PID, CheckpointPolicy(interval=1.0), force=True)
        assert tick.started is not None
        stand_in.take(tick.started.epoch)
    sent: list[Any] = []
    # epoch 2's snapshot objects are gone (as if deleted behind the store's back): its offsets cannot be read
    for entry in store.snapshot_entries(PID, 2, "orders"):
        Path(tmp_path / "storage" / object_path(PID, entry.object_key)).unlink()
    with caplog.at_level("WARNING", logger=lineage.__name__):
        after = emit_settled_epochs(store, PID, None, final=True, emit=sent.append, namespace="n")
    assert after == 2
    assert [Serde.to_dict(e)["run"]["facets"]["arroyo_epoch"]["epoch"] for e in sent] == [1]
    assert any("epoch 2" in r.getMessage() for r in caplog.records), caplog.text
