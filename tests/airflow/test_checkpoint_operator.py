"""CheckpointOperator: validation at parse time, deferral, the task log per epoch, failing with the cause,
the extra link, and one real dag.test() run through the trigger against a pipeline acked by a thread."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import structlog
from airflow.sdk.exceptions import AirflowException, TaskDeferred

from airflow_arroyo.core.epochs import EpochState, PipelineState
from airflow_arroyo.core.exceptions import ArroyoError, ConfigurationError, PipelineFailedError
from airflow_arroyo.hooks import arroyo as hook_module
from airflow_arroyo.operators.checkpoint import ArroyoCheckpointsLink, CheckpointOperator
from airflow_arroyo.store import EpochStore
from airflow_arroyo.triggers.checkpoint import CheckpointTrigger
from tests.support import assert_on_schedule

PID = "orders"


@pytest.fixture(autouse=True)
def _no_defer_settle(monkeypatch: pytest.MonkeyPatch) -> None:
    """No settle hold here (no scheduler to race; tests/airflow/test_defer_settle.py covers it)."""
    monkeypatch.setattr("airflow_arroyo.triggers.settle.DEFER_SETTLE_S", 0.0)


def operator(**kwargs: Any) -> CheckpointOperator:
    args: dict[str, Any] = {"task_id": "checkpoints", "pipeline_id": PID, "interval": 30}
    args.update(kwargs)
    return CheckpointOperator(**args)


def context() -> dict[str, Any]:
    ti = SimpleNamespace(dag_id="etl", task_id="checkpoints", run_id="manual__2026-01-01T00:00:00+00:00")
    return {"ti": ti}


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"interval": 0}, "interval must be a positive"),
        ({"interval": -5}, "interval must be a positive"),
        ({"interval": 60, "timeout": 30}, "shorter than the interval"),
        ({"min_pause": -1}, "min_pause"),
        ({"tolerable_failures": -2}, "tolerable_failures"),
        ({"poll_interval": 0}, "poll_interval"),
        ({"pipeline_id": "orders/eu"}, "pipeline id"),
    ],
)
def test_bad_configuration_fails_when_the_dag_is_parsed(kwargs: dict[str, Any], needle: str) -> None:
    with pytest.raises(ConfigurationError, match=needle):
        operator(**kwargs)


def test_templated_values_are_checked_once_rendered() -> None:
    op = operator(interval="{{ params.interval }}", tolerable_failures="{{ params.failures }}")
    op.interval, op.tolerable_failures = "0", "1"  # what rendering produced
    with pytest.raises(ConfigurationError, match="interval must be a positive"):
        op.execute(context())  # type: ignore[arg-type]
    op.interval, op.tolerable_failures = "15", "x"
    with pytest.raises(ConfigurationError, match="tolerable_failures"):
        op.execute(context())  # type: ignore[arg-type]


def test_execute_defers_to_the_checkpoint_trigger() -> None:
    op = operator(conn_id="epochs", interval="15", timeout=120, min_pause=2, tolerable_failures="1",
                  poll_interval=0.5, pipeline_run_id="etl.manual__2026-01-01")
    with pytest.raises(TaskDeferred) as info:
        op.execute(context())  # type: ignore[arg-type]
    assert info.value.method_name == "execute_complete"
    trigger = info.value.trigger
    assert isinstance(trigger, CheckpointTrigger)
    kwargs = trigger.serialize()[1]
    assert kwargs.pop("not_before") is not None  # the settle time (test_defer_settle.py)
    assert kwargs == {
        "pipeline_id": PID, "conn_id": "epochs", "interval": 15.0, "timeout": 120, "min_pause": 2,
        "tolerable_failures": 1, "poll_interval": 0.5, "triggered_by": "airflow:etl/checkpoints/"
        "manual__2026-01-01T00:00:00+00:00", "pipeline_run_id": "etl.manual__2026-01-01",
        "registration_timeout": 600.0, "max_summary_epochs": 1000, "stop_after_epochs": None,
    }
    assert set(CheckpointOperator.template_fields) >= {"pipeline_id", "conn_id", "interval", "timeout", "min_pause",
                                                        "tolerable_failures", "pipeline_run_id"}


def _entry(epoch: int, state: str, duration: float, bytes_new: int, reason: str | None = None) -> dict[str, Any]:
    return {"epoch": epoch, "state": state, "triggered_at": "2026-01-01T00:00:00+00:00", "duration_s": duration,
            "bytes_new": bytes_new, "bytes_total": 10 * bytes_new, "failure_reason": reason}


def _event(status: str, reason: str, epochs: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    counts = {s: sum(e["state"] == s for e in epochs) for s in ("completed", "failed", "expired")}
    return {"status": status, "reason": reason, "message": extra.pop("message", "pipeline orders stopped"),
            "cause": extra.pop("cause", None), "pipeline_id": PID, "pipeline_state": "stopped",
            "pipeline_run_id": "r1", "summary": {**counts, "epochs": epochs, "omitted": 0}, **extra}


def test_execute_complete_logs_one_summary_line_and_returns_the_figures() -> None:
    """The trigger's log (shown in the task log) has a line per epoch; the task adds one summary, once."""
    epochs = [_entry(1, "completed", 0.25, 1024), _entry(2, "expired", 60.0, 0, "not acknowledged within 60s"),
              _entry(3, "completed", 1.5, 3 * 1024 * 1024)]
    with structlog.testing.capture_logs() as logs:
        result = operator().execute_complete(context(), _event("success", "pipeline_stopped", epochs))  # type: ignore[arg-type]
    lines = [str(entry["event"]) for entry in logs]
    assert lines == ["pipeline orders stopped: 2 epochs completed, 0 failed, 1 expired; duration p50 250 ms, "
                     "p99 1.5 s; size p50 10.0 KiB, p99 30.0 MiB"]
    assert result == {"pipeline_id": PID, "pipeline_run_id": "r1", "completed": 2, "failed": 0, "expired": 1,
                      "last_epoch": 3}


def test_stop_after_epochs_is_checked_when_parsed_and_rendered() -> None:
    with pytest.raises(ConfigurationError, match="stop_after_epochs must be a whole number >= 1"):
        operator(stop_after_epochs=0)
    op = operator(stop_after_epochs="{{ params.epochs }}")
    op.stop_after_epochs = "5"  # rendered
    assert op._trigger_kwargs()["stop_after_epochs"] == 5


def test_execute_complete_fails_with_the_pipeline_failure_as_cause() -> None:
    event = _event("failure", "pipeline_failed", [_entry(1, "failed", 2.0, 0, "pipeline failed")],
                   message="pipeline orders failed: executor lost", cause="executor lost")
    with pytest.raises(AirflowException, match="executor lost") as info:
        operator().execute_complete(context(), event)  # type: ignore[arg-type]
    cause = info.value.__cause__
    assert isinstance(cause, PipelineFailedError) and cause.cause == "executor lost"


def test_execute_complete_fails_when_too_many_epochs_failed() -> None:
    event = _event("failure", "too_many_failures", [_entry(n, "failed", 1.0, 0, "snapshot failed") for n in (1, 2)],
                   message="pipeline orders: 2 consecutive epochs failed or expired, more than the 1 tolerated")
    with pytest.raises(AirflowException, match="2 consecutive epochs failed") as info:
        operator().execute_complete(context(), event)  # type: ignore[arg-type]
    assert isinstance(info.value.__cause__, ArroyoError)
    assert not isinstance(info.value.__cause__, PipelineFailedError)


def test_extra_link_points_at_the_pipeline_page(monkeypatch: pytest.MonkeyPatch) -> None:
    link = ArroyoCheckpointsLink()
    ti_key = SimpleNamespace(dag_id="etl", task_id="checkpoints", run_id="r", try_number=1, map_index=-1)
    monkeypatch.setenv("AIRFLOW__API__BASE_URL", "https://airflow.example.com/team-a/")
    assert link.get_link(operator(pipeline_id="orders.eu-1"), ti_key=ti_key) == (  # type: ignore[arg-type]
        "https://airflow.example.com/team-a/plugin/arroyo/team-a/arroyo/pipelines/orders.eu-1")
    assert link.get_link(operator(pipeline_id="{{ params.p }}"), ti_key=ti_key) == ""  # type: ignore[arg-type]
    assert ArroyoCheckpointsLink in {type(lk) for lk in CheckpointOperator.operator_extra_links}


# --------------------------------------------------------------------------- dag.test(): the real path

DAG_FILE = """
from airflow.sdk import DAG

from airflow_arroyo.operators.checkpoint import CheckpointOperator

with DAG(dag_id="arroyo_checkpoint_operator_test", schedule=None, params={{"interval": 0.3}}) as dag:
    CheckpointOperator(task_id="checkpoints", pipeline_id="{pid}", interval="{{{{ params.interval }}}}",
                       poll_interval=0.1, pipeline_run_id="run-1")
"""


@pytest.fixture
def checkpoint_dag(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """The DAG above as a file in a DAG bundle of its own (dag.test() runs only DAGs of a bundle)."""
    import importlib.util

    folder = tmp_path / "dags"
    folder.mkdir()
    path = folder / "arroyo_checkpoint_operator_test.py"
    path.write_text(DAG_FILE.format(pid=PID))
    local = "airflow.dag_processing.bundles.local.LocalDagBundle"
    monkeypatch.setenv("AIRFLOW__DAG_PROCESSOR__DAG_BUNDLE_CONFIG_LIST", json.dumps([
        {"name": "dags-folder", "classpath": local, "kwargs": {}},
        {"name": "arroyo-checkpoint-tests", "classpath": local, "kwargs": {"path": str(folder)}},
    ]))
    spec = importlib.util.spec_from_file_location("arroyo_checkpoint_operator_test", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return next(v for v in vars(module).values() if type(v).__name__ == "DAG")


class FakePipeline(threading.Thread):
    """A pipeline driver in a thread: registers, runs, acknowledges every epoch, stops after ``epochs``."""

    def __init__(self, store: EpochStore, epochs: int, deadline_s: float = 120.0) -> None:
        super().__init__(daemon=True)
        self.store, self.epochs, self.deadline = store, epochs, time.monotonic() + deadline_s
        self.error: BaseException | None = None
        self.done = threading.Event()

    def run(self) -> None:
        try:
            self.store.register_pipeline(PID, stages=["source", "sink"], run_id="run-1")
            self.store.set_pipeline_state(PID, PipelineState.RUNNING)
            while time.monotonic() < self.deadline:
                ep = self.store.in_flight_epoch(PID)
                if ep is not None:
                    for stage in ep.stages:
                        self.store.ack_epoch(PID, ep.epoch, stage, bytes_new=2048 * ep.epoch, bytes_total=4096)
                if len(self.store.list_epochs(PID, states=[EpochState.COMPLETED])) >= self.epochs:
                    self.store.set_pipeline_state(PID, PipelineState.STOPPED)
                    return
                self.done.wait(0.02)  # poll the store for the next epoch
            raise TimeoutError("the checkpoint trigger did not fire the expected epochs in time")
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            self.error = exc
        finally:
            self.done.set()


@pytest.mark.airflow
@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.usefixtures("airflow_db")
def test_dag_test_runs_the_deferred_controller_until_the_pipeline_stops(
        checkpoint_dag: Any, store: EpochStore, migrated_dsn: str,
        monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]) -> None:
    from airflow.models.xcom import XComModel
    from airflow.utils.session import create_session
    from airflow.utils.state import TaskInstanceState

    monkeypatch.setenv("AIRFLOW_CONN_ARROYO_DEFAULT", migrated_dsn)
    hook_module._reset_shared_stores()
    driver = FakePipeline(store, epochs=3)
    driver.start()
    try:
        run = checkpoint_dag.test()
    finally:
        driver.done.wait(130)
        hook_module._reset_shared_stores()
    assert driver.error is None, driver.error

    (ti,) = run.get_task_instances()
    assert ti.state == TaskInstanceState.SUCCESS
    epochs = store.list_epochs(PID)[::-1]
    completed = [e for e in epochs if e.state is EpochState.COMPLETED]
    assert len(completed) >= 3
    assert {e.triggered_by for e in epochs} == {f"airflow:{checkpoint_dag.dag_id}/checkpoints/{run.run_id}"}
    starts = [e.triggered_at for e in epochs]
    assert_on_schedule(starts, 0.3, PID)

    with create_session() as session:
        rows = session.execute(
            XComModel.get_many(run_id=run.run_id, dag_ids=checkpoint_dag.dag_id, task_ids="checkpoints", key=None)
            .with_only_columns(XComModel.key, XComModel.value)
        ).all()
    xcom = dict(rows)
    assert xcom["return_value"]["completed"] == len(completed)
    assert xcom["return_value"]["failed"] == sum(e.state is EpochState.FAILED for e in epochs)
    assert xcom["_link_ArroyoCheckpointsLink"] == f"/plugin/arroyo/arroyo/pipelines/{PID}"

    out = capfd.readouterr()
    text = out.out + out.err
    for rec in completed:  # the trigger logged start and end as they happened; the task does not repeat them
        assert f"pipeline {PID} epoch {rec.epoch} started at" in text
        assert text.count(f"pipeline {PID} epoch {rec.epoch} completed in") == 1
    assert text.count(f"epochs completed, {xcom['return_value']['failed']} failed") == 1  # one summary line
