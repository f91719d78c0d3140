"""PipelineStateTrigger and PipelineSensor against a real epoch store.

The pipeline is moved through its states with the store API (the driver's calls). Trigger loops
are driven by patching the trigger's ``asyncio.sleep``: each "sleep" applies the next change of the
world, so no test waits on the clock.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from airflow.sdk.exceptions import TaskDeferred

from airflow_arroyo.core.epochs import CheckpointPolicy, PipelineState
from airflow_arroyo.core.exceptions import ArroyoError, ConfigurationError, PipelineFailedError
from airflow_arroyo.core.processes import LocalProcess
from airflow_arroyo.sensors.pipeline import PipelineSensor
from airflow_arroyo.store import EpochStore, PipelineRecord
from airflow_arroyo.testing import wait_for
from airflow_arroyo.triggers import pipeline as trigger_module
from airflow_arroyo.triggers.pipeline import (
    PipelineStateTrigger,
    Verdict,
    evaluate_wait,
    normalize_target,
)

PID = "orders"
STAGES = ["source", "sink"]
CONN = "arroyo_test"


@pytest.fixture(autouse=True)
def _no_defer_settle(monkeypatch: pytest.MonkeyPatch) -> None:
    """No settle hold here (no scheduler to race; tests/airflow/test_defer_settle.py covers it)."""
    monkeypatch.setattr("airflow_arroyo.triggers.settle.DEFER_SETTLE_S", 0.0)


@pytest.fixture
def conn(store: EpochStore, monkeypatch: pytest.MonkeyPatch) -> str:
    """An Airflow connection (environment variable) pointing at the test's epoch store."""
    monkeypatch.setenv(f"AIRFLOW_CONN_{CONN.upper()}", store.dsn)
    return CONN


def register(store: EpochStore, run_id: str = "r1", running: bool = True) -> None:
    store.register_pipeline(PID, stages=STAGES, run_id=run_id, spark_ui_url="http://driver:4040",
                            spark_app_id="app-1")
    if running:
        store.set_pipeline_state(PID, PipelineState.RUNNING, run_id=run_id)


def complete_epoch(store: EpochStore) -> int:
    tick = store.trigger_tick(PID, CheckpointPolicy(interval=1.0), force=True)
    assert tick.started is not None, tick.decision
    for stage in STAGES:
        store.ack_epoch(PID, tick.started.epoch, stage)
    return tick.started.epoch


def record(state: PipelineState, run_id: str = "r1", cause: str | None = None) -> PipelineRecord:
    return PipelineRecord(pipeline_id=PID, state=state, run_id=run_id, failure_cause=cause)


# --------------------------------------------------------------------------- the pure decision



def test_a_wait_for_a_run_of_a_pipeline_that_never_ran_never_reads_none() -> None:
    """Issue 30, finding 5 c: a fork (no run yet) reads "no run yet", not "current run None"."""
    verdict = evaluate_wait(PipelineRecord(pipeline_id=PID, state=PipelineState.STOPPED, run_id=None),
                            state=PipelineState.RUNNING, run_id="r1")
    assert verdict.verdict is Verdict.WAIT and verdict.message == "run 'r1' not registered yet (no run has run yet)"


@pytest.mark.parametrize(
    ("current", "target", "expected"),
    [
        (PipelineState.REGISTERED, PipelineState.RUNNING, Verdict.WAIT),
        (PipelineState.RUNNING, PipelineState.RUNNING, Verdict.SUCCESS),
        (PipelineState.STOPPING, PipelineState.RUNNING, Verdict.SUCCESS),
        (PipelineState.STOPPED, PipelineState.RUNNING, Verdict.UNREACHABLE),
        (PipelineState.FAILED, PipelineState.RUNNING, Verdict.FAILED),
        (PipelineState.REGISTERED, PipelineState.STOPPED, Verdict.WAIT),
        (PipelineState.RUNNING, PipelineState.STOPPED, Verdict.WAIT),
        (PipelineState.STOPPING, PipelineState.STOPPED, Verdict.WAIT),
        (PipelineState.STOPPED, PipelineState.STOPPED, Verdict.SUCCESS),
        (PipelineState.FAILED, PipelineState.STOPPED, Verdict.FAILED),
        (PipelineState.RUNNING, PipelineState.FAILED, Verdict.WAIT),
        (PipelineState.STOPPED, PipelineState.FAILED, Verdict.UNREACHABLE),
        (PipelineState.FAILED, PipelineState.FAILED, Verdict.SUCCESS),
    ],
)
def test_evaluate_wait_for_a_state(current: PipelineState, target: PipelineState, expected: Verdict) -> None:
    verdict = evaluate_wait(record(current, cause="disk full"), state=target)
    assert verdict.verdict is expected, verdict
    if current is PipelineState.FAILED:
        assert verdict.cause == "disk full"
        assert expected is Verdict.SUCCESS or "disk full" in verdict.message


def test_evaluate_wait_covers_every_state_for_every_target() -> None:
    for target in (PipelineState.RUNNING, PipelineState.STOPPED, PipelineState.FAILED):
        verdicts = {s: evaluate_wait(record(s), state=target).verdict for s in PipelineState}
        assert verdicts[target] is Verdict.SUCCESS
        # a failed pipeline never leaves a waiter waiting, nor does a stopped one
        assert verdicts[PipelineState.FAILED] is not Verdict.WAIT
        assert verdicts[PipelineState.STOPPED] is not Verdict.WAIT


def test_evaluate_wait_for_an_epoch() -> None:
    running = record(PipelineState.RUNNING)
    assert evaluate_wait(running, epoch=3, latest_completed=None).verdict is Verdict.WAIT
    assert evaluate_wait(running, epoch=3, latest_completed=2).verdict is Verdict.WAIT
    assert evaluate_wait(running, epoch=3, latest_completed=3).verdict is Verdict.SUCCESS
    assert evaluate_wait(running, epoch=3, latest_completed=5).verdict is Verdict.SUCCESS
    stopped = evaluate_wait(record(PipelineState.STOPPED), epoch=3, latest_completed=2)
    assert stopped.verdict is Verdict.UNREACHABLE and "epoch 3" in stopped.message
    # reached before the pipeline ended: still a success
    assert evaluate_wait(record(PipelineState.FAILED), epoch=3, latest_completed=3).verdict is Verdict.SUCCESS
    failed = evaluate_wait(record(PipelineState.FAILED, cause="OOM"), epoch=3, latest_completed=1)
    assert failed.verdict is Verdict.FAILED and failed.cause == "OOM"


def test_evaluate_wait_only_counts_the_given_run() -> None:
    assert evaluate_wait(None, state=PipelineState.RUNNING, run_id="r2").verdict is Verdict.WAIT
    # the previous run's state says nothing about ours, even a failure
    old = record(PipelineState.FAILED, run_id="r1", cause="old")
    assert evaluate_wait(old, state=PipelineState.RUNNING, run_id="r2").verdict is Verdict.WAIT
    assert evaluate_wait(record(PipelineState.RUNNING, run_id="r2"), state=PipelineState.RUNNING,
                         run_id="r2").verdict is Verdict.SUCCESS


def test_evaluate_wait_presumes_a_silent_driver_dead() -> None:
    running = record(PipelineState.RUNNING)
    assert evaluate_wait(running, epoch=2, heartbeat_age=100, heartbeat_timeout=120).verdict is Verdict.WAIT
    dead = evaluate_wait(running, epoch=2, heartbeat_age=130, heartbeat_timeout=120)
    assert dead.verdict is Verdict.UNREACHABLE and "heartbeat" in dead.message
    assert evaluate_wait(running, epoch=2, heartbeat_age=10_000, heartbeat_timeout=None).verdict is Verdict.WAIT


@pytest.mark.parametrize(
    ("state", "epoch", "expected"),
    [("running", None, (PipelineState.RUNNING, None)), (" Stopped ", None, (PipelineState.STOPPED, None)),
     (None, "3", (None, 3)), ("", 2, (None, 2))],
)
def test_normalize_target(state: Any, epoch: Any, expected: Any) -> None:
    assert normalize_target(state, epoch) == expected


@pytest.mark.parametrize(("state", "epoch"), [(None, None), ("running", 2), ("registered", None),
                                              ("stopping", None), (None, 0), (None, "x"), (None, True)])
def test_normalize_target_refuses(state: Any, epoch: Any) -> None:
    with pytest.raises(ConfigurationError):
        normalize_target(state, epoch)


# --------------------------------------------------------------------------- serialization


def test_trigger_serializes_exactly_its_constructor_arguments() -> None:
    from airflow.sdk._shared.module_loading import import_string

    trigger = PipelineStateTrigger(
        pipeline_id=PID, epoch=4, run_id="r9", conn_id="c", poll_interval=0.5, deadline=123.5,
        heartbeat_timeout=60.0, stop_on_kill=True, submit_pid=42, submit_host="h", submit_start_ticks=7,
        submit_log="/tmp/x.log", submit_exits=True,
    )
    path, kwargs = trigger.serialize()
    assert path == "airflow_arroyo.triggers.pipeline.PipelineStateTrigger"
    rebuilt = import_string(path)(**kwargs)
    assert rebuilt.serialize() == (path, kwargs)
    assert set(kwargs) == set(inspect.signature(PipelineStateTrigger.__init__).parameters) - {"self"}
    assert kwargs["epoch"] == 4 and kwargs["state"] is None and kwargs["submit_pid"] == 42


# --------------------------------------------------------------------------- the trigger, driven


class World:
    """Replaces the trigger's asyncio.sleep: each sleep applies the next scripted change."""

    def __init__(self, steps: list[Callable[[], None]]) -> None:
        self.steps = list(steps)
        self.sleeps = 0

    async def sleep(self, seconds: float) -> None:
        self.sleeps += 1
        if not self.steps:
            raise AssertionError(f"the trigger is still waiting after {self.sleeps} sleeps")
        await asyncio.to_thread(self.steps.pop(0))


def run_trigger(trigger: PipelineStateTrigger, world: World, monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    monkeypatch.setattr(trigger_module.asyncio, "sleep", world.sleep)

    async def collect() -> list[dict[str, Any]]:
        return [event.payload async for event in trigger.run()]

    return asyncio.run(collect())


def test_trigger_waits_for_its_run_to_be_running(store: EpochStore, conn: str,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    register(store, run_id="old")
    store.set_pipeline_state(PID, PipelineState.FAILED, failure_cause="old run's failure")
    world = World([
        lambda: None,
        lambda: register(store, run_id="new", running=False),
        lambda: store.set_pipeline_state(PID, PipelineState.RUNNING, run_id="new"),
    ])
    trigger = PipelineStateTrigger(PID, state="running", run_id="new", conn_id=conn, poll_interval=1)
    events = run_trigger(trigger, world, monkeypatch)
    assert world.sleeps == 3 and not world.steps
    assert len(events) == 1
    event = events[0]
    assert event["status"] == "success" and event["state"] == "running" and event["run_id"] == "new"
    assert event["spark_ui_url"] == "http://driver:4040" and event["spark_app_id"] == "app-1"


def test_trigger_waits_for_an_epoch(store: EpochStore, conn: str, monkeypatch: pytest.MonkeyPatch) -> None:
    register(store)
    complete_epoch(store)
    world = World([lambda: complete_epoch(store), lambda: None, lambda: complete_epoch(store)])
    events = run_trigger(PipelineStateTrigger(PID, epoch=3, conn_id=conn), world, monkeypatch)
    assert world.sleeps == 3
    assert events[0]["status"] == "success" and events[0]["latest_epoch"] == 3


def test_trigger_fails_at_once_with_the_cause(store: EpochStore, conn: str, monkeypatch: pytest.MonkeyPatch) -> None:
    register(store)
    world = World([
        lambda: complete_epoch(store),
        lambda: store.set_pipeline_state(PID, PipelineState.FAILED, failure_cause="stage sink: disk full"),
    ])
    events = run_trigger(PipelineStateTrigger(PID, epoch=5, conn_id=conn), world, monkeypatch)
    assert world.sleeps == 2
    assert events == [{**events[0], "status": "failed", "state": "failed", "cause": "stage sink: disk full",
                       "latest_epoch": 1}]
    assert "disk full" in events[0]["message"]


def test_trigger_reports_a_stop_before_the_epoch(store: EpochStore, conn: str,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    register(store)
    world = World([lambda: store.set_pipeline_state(PID, PipelineState.STOPPED)])
    events = run_trigger(PipelineStateTrigger(PID, epoch=2, conn_id=conn), world, monkeypatch)
    assert events[0]["status"] == "unreachable" and "stopped before it reached epoch 2" in events[0]["message"]


def test_trigger_times_out_at_its_deadline(store: EpochStore, conn: str, monkeypatch: pytest.MonkeyPatch) -> None:
    register(store, running=False)
    trigger = PipelineStateTrigger(PID, state="running", conn_id=conn, deadline=time.time() - 1)
    events = run_trigger(trigger, World([]), monkeypatch)
    assert events[0]["status"] == "timeout" and "did not reach state running" in events[0]["message"]


@pytest.mark.usefixtures("store")
def test_trigger_fails_when_spark_submit_exits_before_registering(
    conn: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    log = tmp_path / "submit.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-c", "print('Error: no module named orders_pipeline')"],
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        process = LocalProcess.of(proc.pid)
        proc.wait()
    trigger = PipelineStateTrigger(PID, state="running", run_id="r1", conn_id=conn, submit_pid=process.pid,
                                   submit_host=process.host, submit_start_ticks=process.start_ticks,
                                   submit_log=str(log))
    events = run_trigger(trigger, World([]), monkeypatch)
    assert events[0]["status"] == "unreachable"
    assert "exited before pipeline 'orders' reached state running" in events[0]["message"]
    assert "no module named orders_pipeline" in events[0]["message"]


def test_trigger_ignores_the_exit_of_a_cluster_mode_spark_submit(
    store: EpochStore, conn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    proc = subprocess.Popen([sys.executable, "-c", "pass"], start_new_session=True)
    process = LocalProcess.of(proc.pid)
    proc.wait()
    world = World([lambda: register(store)])
    trigger = PipelineStateTrigger(PID, state="running", run_id="r1", conn_id=conn, submit_pid=process.pid,
                                   submit_host=process.host, submit_start_ticks=process.start_ticks,
                                   submit_exits=True)
    events = run_trigger(trigger, world, monkeypatch)
    assert events[0]["status"] == "success"


@pytest.fixture
def process_group() -> Iterator[subprocess.Popen[bytes]]:
    """A real process group like spark-submit's: a leader and a child, in their own session."""
    proc = subprocess.Popen(
        [sys.executable, "-c",
         "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']);"
         " time.sleep(600)"],
        start_new_session=True,
    )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_on_kill_stops_the_run_and_its_process_group(store: EpochStore, conn: str,
                                                     process_group: subprocess.Popen[bytes]) -> None:
    register(store)
    group = LocalProcess.of(process_group.pid)
    wait_for(lambda: _group_size(group) == 2, timeout=20, what="the process group to have two members")
    trigger = PipelineStateTrigger(PID, state="running", run_id="r1", conn_id=conn, stop_on_kill=True,
                                   submit_pid=group.pid, submit_host=group.host, submit_start_ticks=group.start_ticks)
    asyncio.run(trigger.on_kill())
    assert store.get_pipeline(PID).stop_requested == "immediate"
    process_group.wait(timeout=20)
    wait_for(lambda: not group.group_alive(), timeout=20, what="the process group to end")


def test_on_kill_of_a_plain_wait_touches_nothing(store: EpochStore, conn: str,
                                                 process_group: subprocess.Popen[bytes]) -> None:
    register(store)
    group = LocalProcess.of(process_group.pid)
    trigger = PipelineStateTrigger(PID, state="running", conn_id=conn, submit_pid=group.pid,
                                   submit_host=group.host, submit_start_ticks=group.start_ticks)
    asyncio.run(trigger.on_kill())
    assert store.get_pipeline(PID).stop_requested is None
    assert process_group.poll() is None


def test_a_recycled_pid_is_never_signalled(process_group: subprocess.Popen[bytes]) -> None:
    real = LocalProcess.of(process_group.pid)
    assert real.alive() is True and real.owns_group()
    impostor = LocalProcess(real.pid, real.host, (real.start_ticks or 0) + 1)
    assert impostor.alive() is False
    assert impostor.signal_group(signal.SIGKILL) is False
    elsewhere = LocalProcess(real.pid, "another-host", real.start_ticks)
    assert elsewhere.alive() is None and elsewhere.signal_group(signal.SIGKILL) is False
    assert process_group.poll() is None


def _proc_stat(pid: int) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` after the command name (read apart from psutil, which the code uses)."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return raw[raw.rfind(")") + 2:].split()


def _group_size(process: LocalProcess) -> int:
    stats = [_proc_stat(int(p)) for p in os.listdir("/proc") if p.isdigit()]
    return sum(1 for s in stats if s is not None and int(s[2]) == process.pid and s[0] not in ("Z", "X"))


def test_the_start_time_is_the_kernels_clock_ticks(process_group: subprocess.Popen[bytes]) -> None:
    """Identities recorded by earlier releases hold /proc's start ticks (field 22): the psutil reading matches."""
    stat = _proc_stat(process_group.pid)
    assert stat is not None and LocalProcess.of(process_group.pid).start_ticks == int(stat[19])


# --------------------------------------------------------------------------- the sensor


class _TI:
    """The two task-instance calls the sensor makes in ``execute`` (a seam of this test only)."""

    def __init__(self) -> None:
        self.xcom: dict[str, Any] = {}

    def xcom_push(self, key: str, value: Any) -> None:
        self.xcom[key] = value


def test_sensor_defers_with_its_target_and_timeout(store: EpochStore, conn: str) -> None:
    register(store)
    sensor = PipelineSensor(task_id="s", pipeline_id=PID, epoch="2", conn_id=conn, wait_timeout="90",
                            trigger_poll_interval=0.5)
    with pytest.raises(TaskDeferred) as deferred:
        sensor.execute({"ti": _TI()})  # type: ignore[arg-type]
    trigger = deferred.value.trigger
    assert isinstance(trigger, PipelineStateTrigger)
    assert (trigger.pipeline_id, trigger.epoch, trigger.state, trigger.poll_interval) == (PID, 2, None, 0.5)
    assert deferred.value.timeout == timedelta(seconds=90)
    assert deferred.value.method_name == "execute_complete"


def test_sensor_does_not_defer_when_already_there(store: EpochStore, conn: str) -> None:
    register(store)
    complete_epoch(store)
    complete_epoch(store)
    ti = _TI()
    result = PipelineSensor(task_id="s", pipeline_id=PID, epoch=2, conn_id=conn).execute({"ti": ti})  # type: ignore[arg-type]
    assert result["latest_epoch"] == 2 and result["state"] == "running"
    assert ti.xcom["pipeline_id"] == PID


def test_sensor_fails_at_once_when_the_pipeline_failed(store: EpochStore, conn: str) -> None:
    register(store)
    store.set_pipeline_state(PID, PipelineState.FAILED, failure_cause="executor lost")
    sensor = PipelineSensor(task_id="s", pipeline_id=PID, state="running", conn_id=conn, soft_fail=True)
    with pytest.raises(PipelineFailedError, match="executor lost"):
        sensor.execute({"ti": _TI()})  # type: ignore[arg-type]


def test_sensor_resumes_from_each_event() -> None:
    sensor = PipelineSensor(task_id="s", pipeline_id=PID, state="stopped")
    ok = sensor.execute_complete({}, {"status": "success", "pipeline_id": PID, "state": "stopped",  # type: ignore[arg-type]
                                      "latest_epoch": 4, "run_id": "r1", "message": "stopped"})
    assert ok == {"pipeline_id": PID, "run_id": "r1", "state": "stopped", "latest_epoch": 4, "message": "stopped"}
    with pytest.raises(PipelineFailedError, match="OOM"):
        sensor.execute_complete({}, {"status": "failed", "cause": "OOM", "message": "x"})  # type: ignore[arg-type]
    with pytest.raises(ArroyoError, match="stopped before"):
        sensor.execute_complete({}, {"status": "unreachable", "message": "stopped before epoch 3"})  # type: ignore[arg-type]
    from airflow.sdk.exceptions import AirflowSensorTimeout

    with pytest.raises(AirflowSensorTimeout):
        sensor.execute_complete({}, {"status": "timeout", "message": "late"})  # type: ignore[arg-type]


def test_sensor_refuses_a_bad_target_when_the_dag_is_parsed() -> None:
    with pytest.raises(ConfigurationError):
        PipelineSensor(task_id="s", pipeline_id=PID, state="registered")
    with pytest.raises(ConfigurationError):
        PipelineSensor(task_id="s", pipeline_id=PID, state="running", epoch=3)
    # templated values are checked when they are rendered
    PipelineSensor(task_id="s", pipeline_id=PID, epoch="{{ params.epochs }}")


def test_sensor_pokes_without_deferring(store: EpochStore, conn: str) -> None:
    register(store)
    sensor = PipelineSensor(task_id="s", pipeline_id=PID, state="stopped", conn_id=conn, deferrable=False)
    assert sensor.poke({}) is False  # type: ignore[arg-type]
    store.set_pipeline_state(PID, PipelineState.STOPPED)
    value = sensor.poke({})  # type: ignore[arg-type]
    assert value and value.xcom_value["state"] == "stopped"
