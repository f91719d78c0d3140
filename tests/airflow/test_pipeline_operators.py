"""SubmitPipelineOperator and StopPipelineOperator: real spark-submit (local mode), real epoch store.

The spark-submit application is a stand-in driver (``_fake_driver.py``) that speaks the runtime
driver's protocol with the store without starting Spark work, so these tests prove the operators'
own mechanics: the command the provider's hook builds, the detached process outliving the task,
the DSN reaching the driver, deferral, the failure and kill paths. The real driver runs in the
end-to-end test.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from airflow.sdk.exceptions import TaskDeferred

from airflow_arroyo.assets import asset_uri
from airflow_arroyo.core.epochs import EpochState, PipelineState
from airflow_arroyo.core.exceptions import (
    ArroyoError,
    ConcurrencyConflict,
    ConfigurationError,
    PipelineFailedError,
    UnknownPipelineError,
)
from airflow_arroyo.core.processes import LocalProcess
from airflow_arroyo.core.supervision import parse_strategy
from airflow_arroyo.links.pipeline import pipeline_page_url
from airflow_arroyo.operators.pipeline import (
    DRIVER_APPLICATION,
    StopPipelineOperator,
    SubmitPipelineOperator,
    parse_restore_from,
)
from airflow_arroyo.store import EpochStore
from airflow_arroyo.testing import wait_for
from airflow_arroyo.triggers.pipeline import PipelineStateTrigger

FAKE_DRIVER = str(Path(__file__).with_name("_fake_driver.py"))
PID = "orders"
CONN = "arroyo_test"
SPARK = "spark_test"


pytestmark = pytest.mark.usefixtures("no_defer_settle")


class _TI:
    """The task-instance calls the operators make (a seam of these tests only; dag.test below uses Airflow's)."""

    dag_id = "d"
    run_id = "manual__2026-01-01T00:00:00+00:00"
    try_number = 1

    def __init__(self) -> None:
        self.xcom: dict[str, Any] = {}

    def xcom_push(self, key: str, value: Any) -> None:
        self.xcom[key] = value


def submit_op(tmp_path: Path, **kwargs: Any) -> SubmitPipelineOperator:
    args: dict[str, Any] = dict(task_id="submit", pipeline=f"fake:{PID}", pipeline_id=PID, conn_id=CONN,
                                spark_conn_id=SPARK, application=FAKE_DRIVER, submit_log_dir=str(tmp_path),
                                register_timeout=120, poll_interval=0.2)
    args.update(kwargs)
    return SubmitPipelineOperator(**args)


def run_trigger(trigger: PipelineStateTrigger) -> dict[str, Any]:
    async def first() -> dict[str, Any]:
        async for event in trigger.run():
            return event.payload
        raise AssertionError("trigger ended without an event")

    return asyncio.run(first())


# --------------------------------------------------------------------------- pure pieces


@pytest.mark.parametrize(("value", "expected"), [(None, None), ("", None), ("None", None), ("latest", "latest"),
                                                 (" LATEST ", "latest"), (3, "3"), ("12", "12")])
def test_parse_restore_from(value: Any, expected: str | None) -> None:
    assert parse_restore_from(value) == expected


@pytest.mark.parametrize("value", [0, -1, "zero", True, "1.5"])
def test_parse_restore_from_refuses(value: Any) -> None:
    with pytest.raises(ConfigurationError):
        parse_restore_from(value)


def test_pipeline_page_url() -> None:
    assert pipeline_page_url("orders", base_url="") == "/plugin/arroyo/arroyo/pipelines/orders"
    assert (pipeline_page_url("a.b-c", base_url="https://airflow.example/")
            == "https://airflow.example/plugin/arroyo/arroyo/pipelines/a.b-c")


def test_driver_application_is_the_runtime_driver() -> None:
    assert DRIVER_APPLICATION.endswith("airflow_arroyo/runtime/driver.py") and os.path.isabs(DRIVER_APPLICATION)
    assert Path(DRIVER_APPLICATION).is_file()


# --------------------------------------------------------------------------- the command


def test_spark_submit_command_for_local_mode(conns: EpochStore, tmp_path: Path) -> None:
    op = submit_op(tmp_path, application=None, restore_from="latest", storage_uri="s3://lake/orders",
                   checkpoint_uri="hdfs:///arroyo/orders",
                   conf={"spark.sql.shuffle.partitions": 2}, application_args=["--verbose-epochs"],
                   pipeline_args={"pipeline_id": PID, "rows": "20000", "keys": 5, "tags": ["a"]}, takeover=True)
    command, env, cluster, _, secret_file = op.build_spark_submit("run-7", "latest", conns.dsn)
    assert cluster is False and secret_file is None
    assert command[:3] == ["spark-submit", "--master", "local[2]"]
    assert "spark.sql.shuffle.partitions=2" in command and "--name" in command and "arroyo-orders" in command
    app = command.index(DRIVER_APPLICATION)
    assert command[app + 1:] == ["--pipeline", f"fake:{PID}", "--run-id", "run-7", "--restore-from", "latest",
                                 "--storage-uri", "s3://lake/orders", "--checkpoint-uri", "hdfs:///arroyo/orders",
                                 "--takeover",
                                 "--arg", f"pipeline_id={PID}", "--arg", "rows=20000", "--arg", "keys=5",
                                 "--arg", 'tags=["a"]', "--verbose-epochs"]
    # the DSN travels in the environment, never on the command line
    assert env["ARROYO_DSN"] == conns.dsn and all(conns.dsn not in part for part in command)
    assert env["PATH"].split(os.pathsep)[0] == str(Path(os.sys.executable).parent)
    assert env["PYSPARK_PYTHON"]


# --------------------------------------------------------------------------- submit, for real


@pytest.mark.spark
def test_submit_defers_returns_once_running_and_on_kill_stops_it(conns: EpochStore, tmp_path: Path,
                                                                    started: list[LocalProcess]) -> None:
    store = conns
    op = submit_op(tmp_path, restore_from=2)
    ti = _TI()
    with pytest.raises(TaskDeferred) as deferred:
        op.execute({"ti": ti})  # type: ignore[arg-type]
    trigger = deferred.value.trigger
    assert isinstance(trigger, PipelineStateTrigger)
    started.append(LocalProcess(trigger.submit_pid, trigger.submit_host, trigger.submit_start_ticks))  # type: ignore[arg-type]
    run_id = "d.manual__2026-01-01T00:00:00+00:00.try1"
    assert (trigger.state, trigger.run_id) == ("running", run_id)
    assert trigger.stop_on_kill is True and trigger.submit_exits is False
    assert ti.xcom["run_id"] == run_id and ti.xcom["pipeline_id"] == PID
    log = Path(ti.xcom["submit_log"])
    assert log.is_file() and log.parent == tmp_path / PID and log.with_suffix(".pid").is_file()
    assert log.with_suffix(".pid").read_text().split()[0] == str(trigger.submit_pid)

    event = run_trigger(trigger)  # waits for the real spark-submit to start the driver
    assert event["status"] == "success", event
    assert op.execute_complete({"ti": ti}, event, **deferred.value.kwargs) == run_id  # type: ignore[arg-type]
    assert ti.xcom["spark_ui_url"] == "http://127.0.0.1:4040" and ti.xcom["spark_app_id"].startswith("local-fake-")
    assert ti.xcom["epoch_at_start"] == 0 and ti.xcom["submit_process"]["pid"] == trigger.submit_pid
    pipeline = store.get_pipeline(PID)
    assert pipeline.state is PipelineState.RUNNING and pipeline.run_id == run_id
    assert pipeline.config["restore_from"] == "2"
    # the application outlives the task: its process group is still there
    assert started[0].group_alive()

    # killing the task (Airflow calls on_kill) stops the run and ends the process group
    op.on_kill()
    assert store.get_pipeline(PID).stop_requested == "immediate"
    wait_for(lambda: not started[0].group_alive(), timeout=60, what="the process group to end")


@pytest.mark.spark
@pytest.mark.usefixtures("conns", "started")
def test_submit_fails_with_the_log_when_spark_submit_dies_before_registering(
    tmp_path: Path) -> None:
    op = submit_op(tmp_path, env_vars={"FAKE_EXIT_BEFORE_REGISTER": "cannot import orders_pipeline"})
    ti = _TI()
    with pytest.raises(TaskDeferred) as deferred:
        op.execute({"ti": ti})  # type: ignore[arg-type]
    event = run_trigger(deferred.value.trigger)
    assert event["status"] == "unreachable"
    with pytest.raises(ArroyoError, match="cannot import orders_pipeline"):
        op.execute_complete({"ti": ti}, event, **deferred.value.kwargs)  # type: ignore[arg-type]


def test_submit_refuses_while_another_run_is_live(conns: EpochStore, tmp_path: Path) -> None:
    conns.register_pipeline(PID, stages=["a"], run_id="other")
    with pytest.raises(ConcurrencyConflict, match="stop it first"):
        submit_op(tmp_path).execute({"ti": _TI()})  # type: ignore[arg-type]
    assert not (tmp_path / PID).exists()  # nothing was started


@pytest.mark.usefixtures("conns")
def test_submit_refuses_bad_input_before_starting_anything(tmp_path: Path) -> None:
    for bad in ({"pipeline": "no_colon"}, {"pipeline_id": "has space"}, {"restore_from": 0}):
        with pytest.raises(ConfigurationError):
            submit_op(tmp_path, **bad).execute({"ti": _TI()})  # type: ignore[arg-type]
    assert not (tmp_path / PID).exists()


# --------------------------------------------------------------------------- stop


@pytest.mark.usefixtures("conns")
def test_stop_of_an_unknown_pipeline_has_nothing_to_do() -> None:
    result = StopPipelineOperator(task_id="stop", pipeline_id="never-ran", conn_id=CONN).execute({"ti": _TI()})  # type: ignore[arg-type]
    assert result["state"] is None


def test_stop_of_a_stopped_pipeline_returns_at_once(conns: EpochStore) -> None:
    conns.register_pipeline(PID, stages=["a"], run_id="r1")
    conns.set_pipeline_state(PID, PipelineState.STOPPED)
    result = StopPipelineOperator(task_id="stop", pipeline_id=PID, conn_id=CONN).execute({"ti": _TI()})  # type: ignore[arg-type]
    assert result["state"] == "stopped" and result["latest_epoch"] is None


def test_stop_of_a_failed_pipeline_fails_with_its_cause_unless_told_not_to(conns: EpochStore) -> None:
    conns.register_pipeline(PID, stages=["a"], run_id="r1")
    conns.set_pipeline_state(PID, PipelineState.FAILED, failure_cause="sink: permission denied")
    with pytest.raises(PipelineFailedError, match="permission denied"):
        StopPipelineOperator(task_id="stop", pipeline_id=PID, conn_id=CONN).execute({"ti": _TI()})  # type: ignore[arg-type]
    result = StopPipelineOperator(task_id="stop2", pipeline_id=PID, conn_id=CONN,
                                  fail_if_failed=False).execute({"ti": _TI()})  # type: ignore[arg-type]
    assert result["state"] == "failed"


def test_immediate_stop_requests_immediate_and_defers(conns: EpochStore) -> None:
    conns.register_pipeline(PID, stages=["a"], run_id="r1")
    conns.set_pipeline_state(PID, PipelineState.RUNNING)
    with pytest.raises(TaskDeferred) as deferred:
        StopPipelineOperator(task_id="stop", pipeline_id=PID, conn_id=CONN, mode="immediate",
                             wait_before_defer=0.2).execute({"ti": _TI()})  # type: ignore[arg-type]
    assert conns.get_pipeline(PID).stop_requested == "immediate"
    trigger = deferred.value.trigger
    assert (trigger.state, trigger.run_id) == ("stopped", "r1")
    with pytest.raises(ConfigurationError):
        StopPipelineOperator(task_id="s", pipeline_id=PID, conn_id=CONN, mode="now").execute({"ti": _TI()})  # type: ignore[arg-type]


# --------------------------------------------------------------------------- a whole DAG run

DAG_FILE = """
from airflow.sdk import DAG

from airflow_arroyo.assets import sink_asset
from airflow_arroyo.operators.pipeline import StopPipelineOperator, SubmitPipelineOperator
from airflow_arroyo.sensors.pipeline import PipelineSensor

with DAG(dag_id="arroyo_pipeline_operators_test", schedule=None, params={{"epochs": 3}}) as dag:
    submit = SubmitPipelineOperator(
        task_id="submit", pipeline="fake:{pid}", pipeline_id="{pid}", conn_id="{conn}", spark_conn_id="{spark}",
        application={app!r}, submit_log_dir={logs!r},
        env_vars={{"FAKE_EPOCH_INTERVAL": "0.2", "FAKE_SINK_URI": {sink!r}}},
        register_timeout=120, poll_interval=0.2,
    )
    run_for = PipelineSensor(
        task_id="run_for", pipeline_id="{pid}", epoch="{{{{ params.epochs }}}}", conn_id="{conn}",
        run_id="{{{{ ti.xcom_pull(task_ids='submit', key='run_id') }}}}", trigger_poll_interval=0.2,
        wait_timeout=120,
    )
    stop = StopPipelineOperator(task_id="stop", pipeline_id="{pid}", conn_id="{conn}", poll_interval=0.2,
                                trigger_rule="all_done", outlets=[sink_asset("{pid}", "sink", {sink!r})])
    submit >> run_for >> stop
"""


@pytest.fixture
def test_dag(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """The DAG above as a file in a DAG bundle of its own (dag.test() runs only DAGs of a bundle)."""
    import importlib.util

    folder = tmp_path / "dags"
    folder.mkdir()
    path = folder / "arroyo_pipeline_operators_test.py"
    path.write_text(DAG_FILE.format(pid=PID, conn=CONN, spark=SPARK, app=FAKE_DRIVER, logs=str(tmp_path / "logs"),
                                    sink=str(tmp_path / "sink")))
    local = "airflow.dag_processing.bundles.local.LocalDagBundle"
    monkeypatch.setenv("AIRFLOW__DAG_PROCESSOR__DAG_BUNDLE_CONFIG_LIST", json.dumps([
        {"name": "dags-folder", "classpath": local, "kwargs": {}},
        {"name": "arroyo-operator-tests", "classpath": local, "kwargs": {"path": str(folder)}},
    ]))
    spec = importlib.util.spec_from_file_location("arroyo_pipeline_operators_test", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return next(v for v in vars(module).values() if type(v).__name__ == "DAG")


def _json_or_text(value: Any) -> Any:
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except ValueError:
        return value


@pytest.mark.spark
@pytest.mark.usefixtures("airflow_db")
def test_dag_submit_wait_for_epochs_stop(conns: EpochStore, test_dag: Any,
                                         started: list[LocalProcess], tmp_path: Path) -> None:
    """dag.test(): submit (real spark-submit) -> wait for epoch 3 (deferred) -> graceful stop; the
    extra links resolve to the pipeline page and the Spark UI the driver reported."""
    from airflow.models.xcom import XComModel
    from airflow.utils.session import create_session
    from airflow.utils.state import TaskInstanceState

    try:
        run = test_dag.test()
    finally:
        with contextlib.suppress(UnknownPipelineError):
            pid = conns.get_pipeline(PID).config.get("pid")
            if pid:
                started.append(LocalProcess.of(int(pid)))
    states = {ti.task_id: ti.state for ti in run.get_task_instances()}
    assert states == {"submit": TaskInstanceState.SUCCESS, "run_for": TaskInstanceState.SUCCESS,
                      "stop": TaskInstanceState.SUCCESS}
    pipeline = conns.get_pipeline(PID)
    assert pipeline.state is PipelineState.STOPPED and pipeline.run_id.startswith("arroyo_pipeline_operators_test.")
    completed = conns.list_epochs(PID, states=[EpochState.COMPLETED])
    assert len(completed) >= 4 and completed[0].is_final  # >= 3 epochs, then the final one
    with create_session() as session:
        rows = session.execute(
            XComModel.get_many(run_id=run.run_id, dag_ids=test_dag.dag_id, task_ids="submit", key=None)
            .with_only_columns(XComModel.key, XComModel.value)
        ).all()
    xcom = {key: _json_or_text(value) for key, value in rows}
    assert xcom["_link_ArroyoPipelineLink"] == f"/plugin/arroyo/arroyo/pipelines/{PID}"
    assert xcom["_link_SparkUILink"] == "http://127.0.0.1:4040"
    assert xcom["run_id"] == pipeline.run_id
    # the stop task's outlet: an Asset event of the sink carrying its final commit (the final epoch's)
    from airflow.models.asset import AssetEvent, AssetModel
    from sqlalchemy import select

    with create_session() as session:
        events = session.execute(
            select(AssetEvent.extra, AssetModel.uri).join(AssetModel, AssetEvent.asset_id == AssetModel.id)
            .where(AssetEvent.source_run_id == run.run_id)).all()
    final = conns.latest_sink_commit(PID, "sink")
    assert final is not None and final.epoch == completed[0].epoch  # the driver committed the final epoch
    assert [(uri, extra["payload"]["epoch"], extra["payload"]["rows"], extra["payload"]["bytes"])
            for extra, uri in events] == [(asset_uri(str(tmp_path / "sink")), final.epoch, final.epoch,
                                           100 * final.epoch)]


# --------------------------------------------------------------------------- the example DAG


@pytest.mark.parametrize("dag_id", ["example_streaming_pipeline", "example_kafka_pipeline"])
def test_example_dag_shape_and_arguments(dag_id: str) -> None:
    """The example DAGs parse, are wired run_for -> stop (always) with a supervised submit that nothing
    waits for (it lasts the pipeline's life), and their pipeline arguments fit the pipeline's function."""
    import importlib
    import inspect

    from airflow.dag_processing.dagbag import DagBag

    bag = DagBag(dag_folder=str(Path(__file__).resolve().parents[2] / "dags" / f"{dag_id}.py"))
    assert bag.import_errors == {}
    dag = bag.dags[dag_id]
    tasks = {t.task_id: t for t in dag.tasks}
    assert set(tasks) == {"submit", "checkpoints", "run_for", "stop"}
    assert tasks["submit"].downstream_task_ids == set() and tasks["checkpoints"].upstream_task_ids == set()
    assert tasks["run_for"].downstream_task_ids == {"stop"}
    assert tasks["submit"].run_id == tasks["checkpoints"].pipeline_run_id == tasks["run_for"].run_id
    assert parse_strategy(json.loads(dag.params["restart_strategy"])) is not None
    assert tasks["stop"].trigger_rule == "all_done" and tasks["run_for"].soft_fail is True
    submit = tasks["submit"]
    module, attr = submit.pipeline.split(":")
    function = getattr(importlib.import_module(module), attr)
    inspect.signature(function).bind(**submit.pipeline_args)
    assert submit.pipeline_args["pipeline_id"] == submit.pipeline_id == tasks["stop"].pipeline_id
    assert set(dag.params) >= {"interval", "epochs", "minutes", "restore_from"}


# --------------------------------------------------------------------------- parse time, links


@pytest.mark.parametrize(
    ("make", "needle"),
    [
        (lambda: SubmitPipelineOperator(task_id="submit_eu", pipeline="m:p", pipeline_id=PID, restore_from="lastest"),
         "task 'submit_eu': restore_from must be 'latest', an epoch number >= 1"),
        (lambda: SubmitPipelineOperator(task_id="submit_eu", pipeline="m:p", pipeline_id=PID, restore_from=0),
         "task 'submit_eu': restore_from must be"),
        (lambda: StopPipelineOperator(task_id="stop_eu", pipeline_id=PID, mode="gracefull"),
         "task 'stop_eu': stop mode must be 'graceful'"),
    ],
)
def test_bad_arguments_fail_when_the_dag_is_parsed_naming_the_task(make: Callable[[], Any], needle: str) -> None:
    with pytest.raises(ConfigurationError) as info:
        make()
    assert needle in str(info.value)


def test_templated_arguments_are_checked_once_rendered() -> None:
    submit = SubmitPipelineOperator(task_id="s", pipeline="m:p", pipeline_id=PID, restore_from="{{ params.r }}")
    submit.restore_from = "soon"  # rendered
    with pytest.raises(ConfigurationError, match="restore_from must be"):
        submit._validate()
    stop = StopPipelineOperator(task_id="t", pipeline_id=PID, mode="{{ params.mode }}")
    assert stop.mode == "{{ params.mode }}"


def test_the_links_old_import_path_still_works() -> None:
    """0.1 code imported ``airflow_arroyo.links``; the names now live in ``links.pipeline``."""
    import airflow_arroyo.links as old
    import airflow_arroyo.links.pipeline as new

    assert (old.ArroyoPipelineLink, old.SparkUILink, old.pipeline_page_url) == (
        new.ArroyoPipelineLink, new.SparkUILink, new.pipeline_page_url)
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        old.nope  # noqa: B018


def test_the_checkpoint_link_stays_inside_airflows_ui() -> None:
    """Airflow's UI frames the plugin at /plugin/arroyo and follows the path after it."""
    assert pipeline_page_url("orders", base_url="") == "/plugin/arroyo/arroyo/pipelines/orders"
    assert (pipeline_page_url("orders", base_url="https://af.example/team/")
            == "https://af.example/team/plugin/arroyo/team/arroyo/pipelines/orders")
    assert pipeline_page_url("orders", base_url="", framed=False) == "/arroyo/pipelines/orders"


def test_spark_ui_url_is_read_from_the_store_when_the_event_lacks_it(conns: EpochStore, tmp_path: Path) -> None:
    """An older driver reports its Spark UI with its first heartbeat, after `running`."""
    conns.register_pipeline(PID, stages=["a"], run_id="r9")
    conns.set_pipeline_state(PID, PipelineState.RUNNING, run_id="r9")
    conns.heartbeat(PID, "r9", spark_ui_url="http://driver:4041", spark_app_id="app-9")
    ti = _TI()
    ti.xcom_pull = lambda **kw: None  # type: ignore[attr-defined]
    op = submit_op(tmp_path)
    event = {"status": "success", "state": "running", "run_id": "r9", "spark_ui_url": None, "spark_app_id": None}
    assert op.execute_complete({"ti": ti}, event, submit={"run_id": "r9"}) == "r9"  # type: ignore[arg-type]
    assert ti.xcom["spark_ui_url"] == "http://driver:4041" and ti.xcom["spark_app_id"] == "app-9"


def test_a_retry_adopts_the_live_run_an_earlier_try_started(conns: EpochStore, tmp_path: Path) -> None:
    """If the scheduler failed a healthy submit try (apache/airflow#67287) and the task retries, the
    retry carries on with the run the first try started: no second spark-submit, no conflict."""
    first = "d.manual__2026-01-01T00:00:00+00:00.try1"
    conns.register_pipeline(PID, stages=["a"], run_id=first)
    conns.heartbeat(PID, first, spark_ui_url="http://driver:4040", spark_app_id="app-1")
    conns.set_pipeline_state(PID, PipelineState.RUNNING, run_id=first)
    ti = _TI()
    ti.try_number = 2
    ti.xcom_pull = lambda **kw: None  # type: ignore[attr-defined]
    assert submit_op(tmp_path).execute({"ti": ti}) == first  # type: ignore[arg-type]
    assert ti.xcom["run_id"] == first and ti.xcom["spark_ui_url"] == "http://driver:4040"
    assert not list(tmp_path.rglob("*.pid"))  # nothing was submitted
    # another DAG run's live run is still a conflict
    other = _TI()
    other.run_id, other.try_number = "manual__2026-02-02T00:00:00+00:00", 2
    with pytest.raises(ConcurrencyConflict):
        submit_op(tmp_path).execute({"ti": other})  # type: ignore[arg-type]


def test_the_stop_task_log_carries_the_drivers_own_log(conns: EpochStore, tmp_path: Path) -> None:
    """The driver's log (spark-submit's output, on the worker host) is reachable from the task log:
    its path, and its last lines once the pipeline stopped."""
    import structlog

    from airflow_arroyo.operators.pipeline import driver_log_path

    conns.register_pipeline(PID, stages=["a"], run_id="r1")
    conns.set_pipeline_state(PID, PipelineState.STOPPED, run_id="r1")
    log = driver_log_path(PID, "r1", str(tmp_path))
    log.parent.mkdir(parents=True)
    log.write_text("".join(f"driver line {n}\n" for n in range(1, 41)))
    op = StopPipelineOperator(task_id="stop", pipeline_id=PID, conn_id=CONN, submit_log_dir=str(tmp_path))
    with structlog.testing.capture_logs() as logs:
        op.execute_complete({"ti": _TI()}, {"status": "success", "state": "stopped", "run_id": "r1"})  # type: ignore[arg-type]
    text = "\n".join(str(e["event"]) for e in logs)
    assert str(log) in text and "driver line 40" in text and "driver line 21" in text
    assert "driver line 20\n" not in text  # the last 20 lines only


def test_the_report_dag_skips_an_event_without_a_commit() -> None:
    """The `stop` task's outlet event of a run that never committed (its driver failed to start) carries no
    commit: the report DAG has nothing new to read, and skips instead of failing."""
    from airflow.dag_processing.dagbag import DagBag
    from airflow.sdk.exceptions import AirflowSkipException

    bag = DagBag(dag_folder=str(Path(__file__).resolve().parents[2] / "dags" / "example_committed_report.py"))
    assert bag.import_errors == {}
    read = bag.dags["example_committed_report"].task_dict["read_committed_report"]
    report = next(iter(read.inlets))
    for events in (None, {report: [{"extra": {}}]}):
        with pytest.raises(AirflowSkipException, match="no commit of the report sink"):
            read.python_callable(triggering_asset_events=events)
