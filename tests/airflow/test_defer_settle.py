"""apache/airflow#67287: a healthy deferrable task must not end failed because the scheduler read the
executor's stale "success" of the deferral after the trigger had already fired.

Two defences, each proven here against a real epoch store:

* the stop task does not make the deferral round trip when the stop completes while it waits in
  the worker (a graceful stop takes one final epoch: seconds);
* every deferral of this package carries ``not_before`` (deferral time + the settle time) and its
  trigger holds an event reached earlier until then, so the scheduler has read the stale report
  while the task is still ``deferred``. (The checkpoint trigger's hold is tested in
  ``test_checkpoint_trigger.py``.)
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any
from unittest import mock

import pytest
from airflow.sdk.exceptions import TaskDeferred

from airflow_arroyo.core.epochs import PipelineState
from airflow_arroyo.hooks import arroyo as hook_module
from airflow_arroyo.operators.pipeline import StopPipelineOperator
from airflow_arroyo.sensors.pipeline import PipelineSensor
from airflow_arroyo.store import EpochStore
from airflow_arroyo.triggers import settle
from airflow_arroyo.triggers.pipeline import PipelineStateTrigger
from tests.support import running as register_running

PID = "orders"
CONN = "arroyo_settle"
STAGES = ["source", "sink"]


@pytest.fixture
def running(store: EpochStore, monkeypatch: pytest.MonkeyPatch) -> EpochStore:
    monkeypatch.setenv(f"AIRFLOW_CONN_{CONN.upper()}", store.dsn)
    hook_module._reset_shared_stores()
    register_running(store, PID, stages=STAGES)
    yield store
    hook_module._reset_shared_stores()


class _TI:
    dag_id, task_id, run_id, try_number = "d", "stop", "manual__1", 1

    def __init__(self) -> None:
        self.xcom: dict[str, Any] = {}

    def xcom_push(self, key: str, value: Any) -> None:
        self.xcom[key] = value


def _driver_stops_when_asked(store: EpochStore, after: float) -> threading.Thread:
    """A stand-in driver: once a stop is requested, it stops ``after`` seconds later."""

    def run() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if store.get_pipeline(PID).stop_requested:
                store.set_pipeline_state(PID, PipelineState.STOPPING, run_id="r1")
                time.sleep(after)  # the final epoch (a stand-in for the driver's work, not a race)
                store.set_pipeline_state(PID, PipelineState.STOPPED, run_id="r1")
                return
            time.sleep(0.05)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_a_stop_that_completes_while_the_task_waits_never_defers(running: EpochStore) -> None:
    driver = _driver_stops_when_asked(running, after=0.5)
    op = StopPipelineOperator(task_id="stop", pipeline_id=PID, conn_id=CONN, poll_interval=0.1,
                              wait_before_defer=30)
    with mock.patch.object(StopPipelineOperator, "defer", side_effect=AssertionError("deferred")):
        result = op.execute({"ti": _TI()})  # type: ignore[arg-type]
    driver.join(5)
    assert result["state"] == "stopped" and result["run_id"] == "r1"
    assert running.get_pipeline(PID).state is PipelineState.STOPPED


def test_stop_and_pin_pins_the_final_epoch_of_the_run(running: EpochStore) -> None:
    from airflow_arroyo.core.epochs import CheckpointPolicy
    from airflow_arroyo.core.exceptions import ConfigurationError

    with pytest.raises(ConfigurationError, match="pins the final epoch of a graceful stop"):
        StopPipelineOperator(task_id="stop", pipeline_id=PID, mode="immediate", pin_label="x")

    def driver() -> None:  # a graceful stop: the final epoch completes, then the run stops
        deadline = time.monotonic() + 60
        while not running.get_pipeline(PID).stop_requested and time.monotonic() < deadline:
            time.sleep(0.05)
        final = running.trigger_tick(PID, CheckpointPolicy(interval=3600), force=True, is_final=True).started
        assert final is not None
        for stage in STAGES:
            running.ack_epoch(PID, final.epoch, stage)
        running.set_pipeline_state(PID, PipelineState.STOPPED, run_id="r1")

    thread = threading.Thread(target=driver, daemon=True)
    thread.start()
    op = StopPipelineOperator(task_id="stop", pipeline_id=PID, conn_id=CONN, poll_interval=0.1,
                              wait_before_defer=30, pin_label="release 2.0")
    with mock.patch.object(StopPipelineOperator, "defer", side_effect=AssertionError("deferred")):
        result = op.execute({"ti": _TI()})  # type: ignore[arg-type]
    thread.join(5)
    assert (result["state"], result["pin_label"]) == ("stopped", "release 2.0")
    assert result["pinned_epoch"] == result["final_epoch"] is not None
    assert running.get_epoch(PID, result["pinned_epoch"]).pin_label == "release 2.0"


def test_a_slow_stop_defers_with_the_settle_time(running: EpochStore) -> None:
    op = StopPipelineOperator(task_id="stop", pipeline_id=PID, conn_id=CONN, poll_interval=0.05,
                              wait_before_defer=0.2)
    before = time.time()
    with pytest.raises(TaskDeferred) as deferred:
        op.execute({"ti": _TI()})  # type: ignore[arg-type]
    trigger = deferred.value.trigger
    assert isinstance(trigger, PipelineStateTrigger) and trigger.state == "stopped"
    assert before + settle.DEFER_SETTLE_S <= trigger.not_before <= time.time() + settle.DEFER_SETTLE_S
    assert running.get_pipeline(PID).stop_requested == "graceful"


@pytest.mark.usefixtures("running")
def test_the_sensor_defers_with_the_settle_time() -> None:
    sensor = PipelineSensor(task_id="wait", pipeline_id=PID, conn_id=CONN, epoch=3)
    with pytest.raises(TaskDeferred) as deferred:
        sensor.execute({"ti": _TI()})  # type: ignore[arg-type]
    assert deferred.value.trigger.not_before >= time.time() + settle.DEFER_SETTLE_S - 5


def _first_event(trigger: PipelineStateTrigger) -> tuple[dict[str, Any], list[float]]:
    slept: list[float] = []

    async def fake_sleep(seconds: float, *args: Any) -> None:
        slept.append(seconds)

    async def first() -> dict[str, Any]:
        gen = trigger.run()
        event = await anext(gen)
        await gen.aclose()
        return dict(event.payload)

    with mock.patch.object(asyncio, "sleep", fake_sleep):
        return asyncio.run(first()), slept


def test_the_state_trigger_holds_an_early_event_until_not_before(running: EpochStore) -> None:
    running.set_pipeline_state(PID, PipelineState.STOPPED, run_id="r1")  # the event is ready at once
    early = PipelineStateTrigger(PID, state="stopped", conn_id=CONN, not_before=time.time() + 30)
    event, slept = _first_event(early)
    assert event["status"] == "success"
    assert len(slept) == 1 and 29.0 < slept[0] <= 30.0, slept

    late = PipelineStateTrigger(PID, state="stopped", conn_id=CONN, not_before=time.time() - 1)
    event, slept = _first_event(late)
    assert event["status"] == "success" and slept == []


def test_the_settle_time_covers_the_scheduler_reading_the_deferral() -> None:
    """The scheduler reads an executor report at its next loop (about a second) after the worker's
    supervisor exits (under a second): the settle time leaves a wide margin and stays short."""
    assert 5.0 <= settle.DEFER_SETTLE_S <= 30.0
    assert settle.settle_deadline(now=100.0) == 100.0 + settle.DEFER_SETTLE_S


def test_a_graceful_stop_after_an_immediate_one_keeps_it_immediate(running: EpochStore) -> None:
    """The operator asks through the same step as ``airflow-arroyo stop``: a graceful request never turns an
    immediate one (already acted on by the driver, which takes no final epoch) back into a graceful one."""
    running.request_stop(PID, "immediate")
    op = StopPipelineOperator(task_id="stop", pipeline_id=PID, conn_id=CONN, poll_interval=0.05,
                              wait_before_defer=0.2)
    with pytest.raises(TaskDeferred):
        op.execute({"ti": _TI()})  # type: ignore[arg-type]
    assert running.get_pipeline(PID).stop_requested == "immediate"
