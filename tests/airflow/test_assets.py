"""Data awareness and provider conventions: sink commits in the store, the Asset watcher trigger,
Asset definitions, the consumer helpers, the [arroyo] config section, the non-deferrable mode and
OpenLineage injection. Real PostgreSQL; the Asset state store and OpenLineage are the seams."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path
from typing import Any
from unittest import mock

import psycopg2
import pytest

from airflow_arroyo import assets as assets_module
from airflow_arroyo import config
from airflow_arroyo.assets import (
    CommittedDataTrigger,
    asset_uri,
    committed_files,
    committed_payloads,
    epochs_asset,
    sink_asset,
)
from airflow_arroyo.core.epochs import PipelineState
from airflow_arroyo.core.exceptions import ConfigurationError, TransientStoreError
from airflow_arroyo.store import AsyncEpochStore, EpochStore
from airflow_arroyo.triggers.asset_cursor import CURSOR_KEY

PID = "orders"
REAL_SLEEP = asyncio.sleep


@pytest.fixture
def pipeline(store: EpochStore) -> EpochStore:
    store.register_pipeline(PID, stages=["src", "out"], run_id="run-1")
    store.set_pipeline_state(PID, PipelineState.RUNNING)
    return store


def commit(store: EpochStore, epoch: int, sink: str = "out", rows: int | None = None) -> None:
    store.record_sink_commit(PID, epoch, sink, uri="/data/out", batch_id=epoch * 2, files=2,
                             rows=rows if rows is not None else 10 * epoch, bytes_committed=1000 * epoch,
                             run_id="run-1")


def complete_epoch(store: EpochStore) -> int:
    from airflow_arroyo.core.epochs import CheckpointPolicy

    tick = store.trigger_tick(PID, CheckpointPolicy(interval=1.0), force=True)
    assert tick.started is not None
    for stage in tick.started.stages:
        store.ack_epoch(PID, tick.started.epoch, stage, bytes_new=5, bytes_total=50)
    return tick.started.epoch


# --------------------------------------------------------------------------- the store


def test_sink_commits_are_recorded_once_and_listed_in_order(pipeline: EpochStore) -> None:
    commit(pipeline, 1)
    commit(pipeline, 1, rows=999)  # a repeat (a driver retrying after a crash) keeps the first record
    commit(pipeline, 2)
    commit(pipeline, 2, sink="other")
    rows = pipeline.sink_commits(PID, sink="out")
    assert [(c.epoch, c.rows_committed, c.bytes_committed, c.batch_id) for c in rows] == [(1, 10, 1000, 2),
                                                                                         (2, 20, 2000, 4)]
    assert [c.sink for c in pipeline.sink_commits(PID, after_seq=rows[0].seq)] == ["out", "other"]
    latest = pipeline.latest_sink_commit(PID, "out")
    assert latest is not None and latest.epoch == 2
    assert pipeline.latest_sink_commit(PID, "missing") is None


# --------------------------------------------------------------------------- the watcher trigger


class StateStore:
    """Stands in for the Asset state store Airflow >= 3.3 injects into event triggers."""

    def __init__(self) -> None:
        self.values: dict[str, Any] = {}

    async def aget(self, key: str, default: Any = None) -> Any:
        return self.values.get(key, default)

    async def aset(self, key: str, value: Any) -> None:
        self.values[key] = value


async def collect(trigger: CommittedDataTrigger, store: EpochStore, between: list[Any], count: int,
                  open_failures: dict[str, int] | None = None) -> list[dict]:
    """Run the trigger until ``count`` events; each sleep of the trigger runs the next step of ``between``
    (``open_failures["open"]``: how many times opening the store fails first)."""
    steps = iter(between)

    async def sleep(seconds: float, *args: Any) -> None:
        next(steps, lambda: None)()
        await REAL_SLEEP(0)

    async def open_store() -> AsyncEpochStore:
        if open_failures and open_failures["open"]:
            open_failures["open"] -= 1
            raise TransientStoreError("the epoch store is unreachable")
        return AsyncEpochStore(store)

    trigger._open_store = open_store  # type: ignore[method-assign]
    out = []
    with mock.patch.object(assets_module.asyncio, "sleep", sleep):
        gen = trigger.run()
        try:
            while len(out) < count:
                out.append(dict((await asyncio.wait_for(anext(gen), 30)).payload))
        finally:
            await gen.aclose()
    return out


async def test_the_watcher_announces_each_new_commit_once_and_resumes_after_its_cursor(pipeline: EpochStore) -> None:
    commit(pipeline, 1)  # before the watcher started: history, not announced
    state = StateStore()
    trigger = CommittedDataTrigger(PID, sink="out", conn_id="x")
    trigger.asset_state_store = state  # type: ignore[assignment]
    events = await collect(trigger, pipeline, [lambda: commit(pipeline, 2), lambda: commit(pipeline, 3, sink="other"),
                                               lambda: commit(pipeline, 4)], 2)
    assert [(e["epoch"], e["rows"], e["bytes"], e["batch_id"], e["uri"]) for e in events] == [
        (2, 20, 2000, 4, "file:///data/out"), (4, 40, 4000, 8, "file:///data/out")]
    # the cursor moves once the triggerer took the event (asked for the next one): epoch 2's is saved,
    # epoch 4's not (the trigger was stopped right after yielding it)
    assert state.values[CURSOR_KEY] == events[0]["seq"]
    # a triggerer restart: a new instance with the same state store resumes after the cursor, so an
    # event the triggerer may not have stored is announced again (at least once), then the new ones
    commit(pipeline, 5)
    again = CommittedDataTrigger(PID, sink="out", conn_id="x")
    again.asset_state_store = state  # type: ignore[assignment]
    assert [e["epoch"] for e in await collect(again, pipeline, [], 2)] == [4, 5]


async def test_the_watcher_survives_failures_of_the_store_and_of_its_state_store(pipeline: EpochStore) -> None:
    """The triggerer does not restart a watcher that raised: a failed look is logged and tried again."""
    failures = {"open": 1, "read": 2, "save": 1}

    class Flaky(StateStore):
        async def aset(self, key: str, value: Any) -> None:
            if failures["save"]:
                failures["save"] -= 1
                raise OSError("the API server is restarting")
            await super().aset(key, value)

    class FlakyTrigger(CommittedDataTrigger):
        async def _since(self, store: AsyncEpochStore, cursor: int) -> list[tuple[int, dict[str, Any]]]:
            if failures["read"]:
                failures["read"] -= 1
                raise (psycopg2.OperationalError if failures["read"] else RuntimeError)("connection lost")
            return await super()._since(store, cursor)

    trigger = FlakyTrigger(PID, sink="out", conn_id="x")
    trigger.asset_state_store = Flaky()  # type: ignore[assignment]
    steps = [lambda: None, lambda: commit(pipeline, 1), lambda: None, lambda: commit(pipeline, 2)]
    events = await collect(trigger, pipeline, steps, 2, open_failures=failures)
    assert [e["epoch"] for e in events] == [1, 2]
    assert failures == {"open": 0, "read": 0, "save": 0}


async def test_after_a_quiet_while_the_last_commit_is_announced_once_more(pipeline: EpochStore) -> None:
    """Airflow can leave the last events of a burst without a DAG run (see CommittedDataTrigger): once no
    commit came for SETTLE_AFTER seconds (here two looks 5 s apart), the last one comes once more, once."""
    trigger = CommittedDataTrigger(PID, sink="out", conn_id="x")
    noop = lambda: None  # noqa: E731
    events = await collect(trigger, pipeline, [lambda: commit(pipeline, 1), noop, noop, noop, noop,
                                               lambda: commit(pipeline, 2)], 3)
    assert [(e["epoch"], e.get("repeat", False)) for e in events] == [(1, False), (1, True), (2, False)]
    assert events[1]["seq"] == events[0]["seq"]


async def test_the_epochs_watcher_announces_completed_epochs(pipeline: EpochStore) -> None:
    complete_epoch(pipeline)
    trigger = CommittedDataTrigger(PID, kind="epochs", conn_id="x")
    events = await collect(trigger, pipeline, [lambda: complete_epoch(pipeline)] * 2, 2)
    assert [(e["kind"], e["epoch"], e["bytes_new"], e["bytes_total"]) for e in events] == [
        ("epochs", 2, 10, 100), ("epochs", 3, 10, 100)]  # two stages, 5 and 50 bytes each


def test_trigger_serializes_its_arguments_and_refuses_bad_ones() -> None:
    trigger = CommittedDataTrigger(PID, kind="sink", sink="out", conn_id="c", poll_interval=1.5)
    classpath, kwargs = trigger.serialize()
    assert classpath == "airflow_arroyo.assets.CommittedDataTrigger"
    assert CommittedDataTrigger(**kwargs).serialize() == (classpath, kwargs)
    with pytest.raises(ConfigurationError, match="sink stage"):
        CommittedDataTrigger(PID, kind="sink")
    with pytest.raises(ConfigurationError, match="kind"):
        CommittedDataTrigger(PID, kind="rows")


# --------------------------------------------------------------------------- Assets and consumers


def test_assets_carry_a_watcher_and_what_their_events_mean(tmp_path: Path) -> None:
    report = sink_asset(PID, "out", str(tmp_path / "out"), conn_id="c")
    assert report.uri == f"file://{tmp_path}/out" and report.name == f"arroyo-{PID}-out"
    assert report.extra["arroyo"] == {"pipeline_id": PID, "kind": "sink", "sink": "out", "conn_id": "c"}
    (watcher,) = report.watchers
    assert isinstance(watcher.trigger, CommittedDataTrigger) and watcher.trigger.sink == "out"
    assert sink_asset(PID, "out", "s3://bucket/out/", watch=False).uri == "s3://bucket/out"
    assert epochs_asset(PID).uri == f"x-arroyo://{PID}/epochs"
    assert asset_uri("relative/path") == f"file://{Path('relative/path').resolve()}"


def test_consumer_helpers_read_payloads_and_only_committed_files(tmp_path: Path) -> None:
    events = [{"extra": {"from_trigger": True, "payload": {"epoch": 3, "seq": 9}}},
              {"extra": {"payload": {"epoch": 2, "seq": 7}}}, {"extra": {}}]
    assert [p["epoch"] for p in committed_payloads(events)] == [2, 3]
    # a sink folder as the file sink leaves it (docs/runtime.md, "File sink"): batches 1-3 committed by
    # generation 2, batch 4 pending, and a file a superseded generation 1 moved in after the takeover
    out = tmp_path / "out"
    meta = out / "_arroyo_sink"
    (meta / "pending" / "4-g2").mkdir(parents=True)
    (meta / "pending" / "4-g2" / "part-0.parquet").write_bytes(b"x")
    (meta / "committed").mkdir()
    for b in (1, 2, 3):
        name = f"{b:012d}-g2-part-0.parquet"
        (out / name).write_bytes(b"x")
        (meta / "committed" / f"{b:012d}-g2.json").write_text(json.dumps({"batch": b, "files": [name]}))
    (out / "000000000002-g1-part-0.parquet").write_bytes(b"x")
    (out / ".000000000001-g2-part-0.parquet.crc").write_bytes(b"x")
    (meta / "committed-g2.json").write_text(json.dumps({"through": 3, "base": 0}))
    assert committed_files(str(out), 2) == ["000000000001-g2-part-0.parquet", "000000000002-g2-part-0.parquet"]
    assert committed_files(str(out), 9) == [f"{b:012d}-g2-part-0.parquet" for b in (1, 2, 3)]


# --------------------------------------------------------------------------- provider info and config


def test_provider_info_declares_the_connection_form_and_the_config_section() -> None:
    from airflow_arroyo.provider import get_provider_info

    info = get_provider_info()
    (conn,) = info["connection-types"]
    assert conn["hook-name"] == "Arroyo epoch store" and conn["connection-type"] == "arroyo"
    assert {"sslmode", "sslrootcert", "connect_timeout"} <= set(conn["conn-fields"])
    assert conn["ui-field-behaviour"]["relabeling"] == {"schema": "Database"}
    options = info["config"]["arroyo"]["options"]
    assert set(options) == set(config.OPTIONS)
    assert options["conn_id"]["default"] == "arroyo_default"


def test_arroyo_options_come_from_airflow_configuration(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from airflow_arroyo.operators.pipeline import SubmitPipelineOperator

    monkeypatch.setenv("AIRFLOW__ARROYO__CONN_ID", "epochs_prod")
    monkeypatch.setenv("AIRFLOW__ARROYO__STORAGE_URI", "s3://bucket/arroyo")
    monkeypatch.setenv("AIRFLOW__ARROYO__SUBMIT_LOG_DIR", str(tmp_path))
    op = SubmitPipelineOperator(task_id="s", pipeline="m:p", pipeline_id=PID)
    assert (op.conn_id, op.storage_uri, op.spark_conn_id) == ("epochs_prod", "s3://bucket/arroyo", "spark_default")
    assert SubmitPipelineOperator(task_id="t", pipeline="m:p", pipeline_id=PID, conn_id="mine").conn_id == "mine"
    assert {"conf", "env_vars", "application_args", "spark_submit_kwargs"} <= set(op.template_fields)


def test_deferrable_follows_operators_default_deferrable(monkeypatch: pytest.MonkeyPatch) -> None:
    from airflow_arroyo.operators.pipeline import StopPipelineOperator
    from airflow_arroyo.sensors.pipeline import PipelineSensor

    monkeypatch.setenv("AIRFLOW__OPERATORS__DEFAULT_DEFERRABLE", "False")
    assert not StopPipelineOperator(task_id="a", pipeline_id=PID).deferrable
    assert not PipelineSensor(task_id="b", pipeline_id=PID, state="running").deferrable
    monkeypatch.setenv("AIRFLOW__OPERATORS__DEFAULT_DEFERRABLE", "True")
    assert StopPipelineOperator(task_id="a", pipeline_id=PID).deferrable


class _TI:
    def __init__(self) -> None:
        self.xcom: dict[str, Any] = {}

    def xcom_push(self, key: str, value: Any) -> None:
        self.xcom[key] = value


def test_a_non_deferrable_stop_waits_in_the_worker(pipeline: EpochStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """deferrable=False runs the same trigger inline: the task returns once the driver stopped."""
    from airflow_arroyo.hooks import arroyo as hook_module
    from airflow_arroyo.operators.pipeline import StopPipelineOperator

    monkeypatch.setenv("AIRFLOW_CONN_ARROYO_T", pipeline.dsn)
    hook_module._reset_shared_stores()

    def driver() -> None:  # stops once asked to, as the driver does
        deadline = time.monotonic() + 30
        while pipeline.get_pipeline(PID).stop_requested is None and time.monotonic() < deadline:
            time.sleep(0.05)
        pipeline.set_pipeline_state(PID, PipelineState.STOPPING)
        pipeline.set_pipeline_state(PID, PipelineState.STOPPED)

    thread = threading.Thread(target=driver)
    thread.start()
    try:
        op = StopPipelineOperator(task_id="stop", pipeline_id=PID, conn_id="arroyo_t", poll_interval=0.1,
                                  deferrable=False)
        result = op.execute({"ti": _TI()})  # type: ignore[arg-type]
    finally:
        thread.join()
        hook_module._reset_shared_stores()
    assert result["state"] == "stopped" and pipeline.get_pipeline(PID).stop_requested == "graceful"


def test_openlineage_parent_job_confs_are_injected_like_the_spark_provider(monkeypatch: pytest.MonkeyPatch) -> None:
    from airflow.providers.common.compat.openlineage.utils import spark as ol_spark

    from airflow_arroyo.operators.pipeline import SubmitPipelineOperator, openlineage_conf

    seen: list[Any] = []

    def inject(properties: dict[str, Any], context: Any) -> dict[str, Any]:
        seen.append(context)
        return {**properties, "spark.openlineage.parentJobName": "d.submit", "spark.openlineage.parentRunId": "r"}

    monkeypatch.setattr(ol_spark, "inject_parent_job_information_into_spark_properties", inject)
    context: Any = {"ti": "ti"}
    conf = openlineage_conf({"spark.x": "1"}, context, parent=True, transport=False)
    assert conf == {"spark.x": "1", "spark.openlineage.parentJobName": "d.submit", "spark.openlineage.parentRunId": "r"}
    assert seen == [context]
    assert openlineage_conf({"a": "b"}, context, parent=False, transport=False) == {"a": "b"}
    monkeypatch.setenv("AIRFLOW__OPENLINEAGE__SPARK_INJECT_PARENT_JOB_INFO", "True")
    op = SubmitPipelineOperator(task_id="s", pipeline="m:p", pipeline_id=PID)
    assert op.openlineage_inject_parent_job_info and not op.openlineage_inject_transport_info
