"""A supervised SubmitPipelineOperator: real spark-submit (local mode) of the stand-in driver
(``_fake_driver.py``), real epoch store, the supervisor trigger run as the triggerer runs it.

The driver is SIGKILLed; the supervisor notices (its spark-submit exited), the operator resubmits
restoring the latest completed epoch as ``<lineage>.restart1``; a driver that keeps failing makes the
strategy give up and the task fail with the driver's cause. The real driver and Spark: the
airflow-standalone end-to-end test (tests/e2e)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from airflow.sdk.exceptions import TaskDeferred

from airflow_arroyo.core.epochs import PipelineState
from airflow_arroyo.core.exceptions import PipelineFailedError
from airflow_arroyo.core.processes import LocalProcess
from airflow_arroyo.operators.pipeline import StopPipelineOperator, driver_log_path
from airflow_arroyo.store import EpochStore
from airflow_arroyo.testing import wait_for
from airflow_arroyo.triggers.resubmit import RUN_ID_SLOT, Resubmission
from airflow_arroyo.triggers.supervise import PipelineSupervisorTrigger
from tests.airflow.test_pipeline_operators import _TI, PID, run_trigger, submit_op

pytestmark = pytest.mark.usefixtures("no_defer_settle")

LINEAGE = "d.manual__2026-01-01T00:00:00+00:00.try1"


def _deferred(call: Any, *args: Any, **kwargs: Any) -> TaskDeferred:
    with pytest.raises(TaskDeferred) as deferred:
        call(*args, **kwargs)
    return deferred.value


def _supervised_until_running(op: Any, ti: _TI, started: list[LocalProcess]) -> TaskDeferred:
    first = _deferred(op.execute, {"ti": ti})
    started.append(LocalProcess(first.trigger.submit_pid, first.trigger.submit_host, first.trigger.submit_start_ticks))
    event = run_trigger(first.trigger)
    assert event["status"] == "success", event
    supervised = _deferred(op.execute_complete, {"ti": ti}, event, **first.kwargs)
    assert isinstance(supervised.trigger, PipelineSupervisorTrigger)
    assert (supervised.trigger.lineage, supervised.trigger.run_id) == (LINEAGE, LINEAGE)
    return supervised


@pytest.mark.spark
def test_a_killed_driver_comes_back_from_the_latest_epoch_and_the_task_ends_when_it_stops(
        conns: EpochStore, tmp_path: Path, started: list[LocalProcess]) -> None:
    store = conns
    op = submit_op(tmp_path, supervise_interval=0.2,
                   restart_strategy={"type": "fixed-delay", "attempts": 2, "delay": 0.5},
                   env_vars={"FAKE_EPOCH_INTERVAL": "0.3"})
    ti = _TI()
    supervised = _supervised_until_running(op, ti, started)
    assert store.get_pipeline(PID).supervision == "watching"
    wait_for(lambda: (store.latest_completed_epoch(PID) or 0) and store.latest_completed_epoch(PID).epoch >= 2,
             timeout=60, what="two completed epochs")  # type: ignore[union-attr]
    os.kill(int(store.get_pipeline(PID).config["pid"]), signal.SIGKILL)

    event = run_trigger(supervised.trigger)  # notices that spark-submit exited, records it, waits 0.5 s
    assert (event["status"], event["attempt"], event["run_id"]) == ("restart", 1, LINEAGE), event
    assert "exited" in event["cause"]
    latest = store.latest_completed_epoch(PID)
    assert latest is not None
    restarted = _deferred(op.supervise_complete, {"ti": ti}, event, **supervised.kwargs)
    trigger = restarted.trigger
    assert isinstance(trigger, PipelineSupervisorTrigger)
    started.append(LocalProcess(trigger.submit_pid, trigger.submit_host, trigger.submit_start_ticks))  # type: ignore[arg-type]
    assert trigger.run_id == f"{LINEAGE}.restart1" and trigger.start_deadline is not None
    assert ti.xcom["run_id"] == trigger.run_id
    wait_for(lambda: store.get_pipeline(PID).run_id == trigger.run_id
             and store.get_pipeline(PID).state is PipelineState.RUNNING, timeout=120, what="the restart to run")
    pipeline = store.get_pipeline(PID)
    assert pipeline.config["restore_from"] == "latest" and pipeline.supervised_run == LINEAGE
    [restart] = store.restarts(PID)
    assert (restart.attempt, restart.new_run_id, restart.restored_epoch, restart.gave_up) == (
        1, trigger.run_id, latest.epoch, False)
    assert restart.restarted_at is not None and restart.delay_s == 0.5

    store.request_stop(PID, "graceful")
    event = run_trigger(trigger)
    assert event["status"] == "stopped", event
    assert op.supervise_complete({"ti": ti}, event, **restarted.kwargs) == LINEAGE
    assert store.get_pipeline(PID).supervision == "ended"


@pytest.mark.spark
def test_a_strategy_that_gives_up_fails_the_task_with_the_last_cause(
        conns: EpochStore, tmp_path: Path, started: list[LocalProcess]) -> None:
    store = conns
    op = submit_op(tmp_path, supervise_interval=0.2,
                   restart_strategy={"type": "fixed-delay", "attempts": 1, "delay": 0},
                   env_vars={"FAKE_EPOCH_INTERVAL": "1.5", "FAKE_FAIL_AFTER_EPOCHS": "2",
                             "FAKE_FAIL_CAUSE": "division by zero in stage join"})
    ti = _TI()
    supervised = _supervised_until_running(op, ti, started)
    event = run_trigger(supervised.trigger)
    assert (event["status"], event["attempt"]) == ("restart", 1), event
    assert "division by zero in stage join" in event["cause"]
    restarted = _deferred(op.supervise_complete, {"ti": ti}, event, **supervised.kwargs)
    started.append(LocalProcess(restarted.trigger.submit_pid, restarted.trigger.submit_host,
                                restarted.trigger.submit_start_ticks))
    event = run_trigger(restarted.trigger)  # the restart fails the same way: one restart allowed, no more
    assert (event["status"], event["attempt"]) == ("gave_up", 2), event
    with pytest.raises(PipelineFailedError, match="division by zero in stage join"):
        op.supervise_complete({"ti": ti}, event, **restarted.kwargs)
    records = store.restarts(PID)
    assert [(r.attempt, r.gave_up) for r in records] == [(2, True), (1, False)]
    assert "more than the 1 restart(s)" in (records[0].decision or "")
    assert store.get_pipeline(PID).supervision == "gave_up"


def test_a_retry_reattaches_to_a_restart_of_its_run_and_supervises_it_again(conns: EpochStore,
                                                                           tmp_path: Path) -> None:
    restart = f"{LINEAGE}.restart2"
    conns.register_pipeline(PID, stages=["a"], run_id=restart)
    conns.set_pipeline_state(PID, PipelineState.RUNNING, run_id=restart)
    conns.supervise(PID, LINEAGE, {"type": "fixed-delay"})
    ti = _TI()
    ti.try_number = 2
    ti.xcom_pull = lambda **kw: None  # type: ignore[attr-defined]
    op = submit_op(tmp_path, supervise_interval=0.2, restart_strategy="fixed-delay")
    deferred = _deferred(op.execute, {"ti": ti})
    assert isinstance(deferred.trigger, PipelineSupervisorTrigger)
    assert (deferred.trigger.lineage, deferred.trigger.run_id) == (LINEAGE, restart)
    assert not list(tmp_path.rglob("*.pid"))  # nothing was submitted


def _supervised_run(store: EpochStore, run_id: str = LINEAGE) -> None:
    store.register_pipeline(PID, stages=["a"], run_id=run_id)
    store.set_pipeline_state(PID, PipelineState.RUNNING, run_id=run_id)
    store.supervise(PID, LINEAGE, {"type": "fixed-delay"})


def _trigger(**kwargs: Any) -> PipelineSupervisorTrigger:
    args: dict[str, Any] = dict(pipeline_id=PID, lineage=LINEAGE, run_id=LINEAGE, conn_id="arroyo_test",
                                strategy={"type": "fixed-delay", "delay": 0}, poll_interval=0.1)
    return PipelineSupervisorTrigger(**{**args, **kwargs})


def test_a_stop_cancels_a_pending_restart_and_the_task_succeeds(conns: EpochStore, tmp_path: Path) -> None:
    _supervised_run(conns)
    conns.set_pipeline_state(PID, PipelineState.FAILED, run_id=LINEAGE, failure_cause="executor lost")
    # the stop operator finds it failed with a restart pending: its stop request cancels the restart
    result = StopPipelineOperator(task_id="stop", pipeline_id=PID, conn_id="arroyo_test",
                                  fail_if_failed=False).execute({"ti": _TI()})  # type: ignore[arg-type]
    assert result["state"] == "failed" and conns.get_pipeline(PID).stop_requested == "graceful"
    event = run_trigger(_trigger())
    assert (event["status"], event["attempt"]) == ("cancelled", 1), event
    assert "executor lost" in event["message"]
    op = submit_op(tmp_path, restart_strategy="fixed-delay")
    assert op.supervise_complete({"ti": _TI()}, event, submit={}, lineage=LINEAGE) == LINEAGE
    pipeline = conns.get_pipeline(PID)
    assert pipeline.supervision == "ended" and pipeline.run_id == LINEAGE  # not restarted
    assert [(r.gave_up, r.new_run_id) for r in conns.restarts(PID)] == [(True, None)]


def test_a_takeover_ends_the_supervision_whatever_state_the_new_run_is_in(conns: EpochStore) -> None:
    _supervised_run(conns)
    conns.register_pipeline(PID, stages=["a"], run_id="someone-else", takeover=True)
    conns.set_pipeline_state(PID, PipelineState.FAILED, run_id="someone-else", failure_cause="x")  # ended already
    event = run_trigger(_trigger())
    assert event["status"] == "superseded" and "someone-else" in event["message"], event
    assert conns.restarts(PID) == []  # nothing recorded against the other run


def test_a_restart_that_restores_longer_than_the_heartbeat_timeout_is_not_a_failure(conns: EpochStore) -> None:
    """A registered run restores before its first heartbeat; only the start deadline bounds it."""
    _supervised_run(conns)
    restart = f"{LINEAGE}.restart1"
    conns.register_pipeline(PID, stages=["a"], run_id=restart, takeover=True)  # registered: restoring
    trigger = _trigger(run_id=restart, heartbeat_timeout=0.01, start_deadline=time.time() + 1.0)
    event = run_trigger(trigger)  # no heartbeat for far longer than 0.01 s: only the deadline fails it
    assert event["status"] == "restart" and "did not reach running in time" in event["cause"], event


# --------------------------------------------------------------------------- restarts submitted from the triggerer


class _Running:
    """A trigger's run() in a thread with its own event loop, as the triggerer runs it: its first event, if any."""

    def __init__(self, trigger: PipelineSupervisorTrigger) -> None:
        self.trigger = trigger
        self.event: dict[str, Any] | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="triggerer", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        async def first() -> None:
            async for event in self.trigger.run():
                self.event = event.payload
                return

        try:
            asyncio.run(first())
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            self.error = exc

    def result(self, timeout: float) -> dict[str, Any]:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), f"the trigger yielded nothing within {timeout:g}s"
        if self.error is not None:
            raise self.error
        assert self.event is not None
        return self.event


@pytest.mark.spark
def test_a_restart_submitted_from_the_triggerer_needs_no_worker_and_keeps_supervising(
        conns: EpochStore, tmp_path: Path, started: list[LocalProcess]) -> None:
    store = conns
    op = submit_op(tmp_path, supervise_interval=0.2, restart_in_triggerer=True,
                   restart_strategy={"type": "fixed-delay", "attempts": 2, "delay": 0.5},
                   env_vars={"FAKE_EPOCH_INTERVAL": "0.3"})
    ti = _TI()
    supervised = _supervised_until_running(op, ti, started)
    trigger = supervised.trigger
    assert isinstance(trigger, PipelineSupervisorTrigger) and trigger.restart_submit is not None
    stored = json.dumps(trigger.serialize()[1])  # what Airflow keeps in its database
    assert store.dsn not in stored and "ARROYO_DSN" not in stored and "127.0.0.1:" not in stored
    assert "{arroyo_run_id}" in stored and "--takeover" in stored
    wait_for(lambda: (store.latest_completed_epoch(PID) or 0) and store.latest_completed_epoch(PID).epoch >= 2,
             timeout=60, what="two completed epochs")  # type: ignore[union-attr]
    latest = store.latest_completed_epoch(PID)
    assert latest is not None
    running = _Running(trigger)
    os.kill(int(store.get_pipeline(PID).config["pid"]), signal.SIGKILL)

    restart = f"{LINEAGE}.restart1"
    wait_for(lambda: running.error or (store.get_pipeline(PID).run_id == restart
                                       and store.get_pipeline(PID).state is PipelineState.RUNNING),
             timeout=120, what="the restart, submitted by the trigger, to run")
    assert running.thread.is_alive() and running.event is None  # no event: the task was never asked for anything
    started.append(LocalProcess(trigger.submit_pid, trigger.submit_host, trigger.submit_start_ticks))  # type: ignore[arg-type]
    pipeline = store.get_pipeline(PID)
    assert pipeline.config["restore_from"] == "latest" and pipeline.supervised_run == LINEAGE
    assert pipeline.supervision == "watching"
    [record] = store.restarts(PID)
    assert (record.attempt, record.new_run_id, record.restored_epoch, record.gave_up) == (1, restart, latest.epoch,
                                                                                         False)
    assert trigger.run_id == restart and trigger.submit_log == str(driver_log_path(PID, restart, str(tmp_path)))
    assert f"run {restart} running" in Path(str(trigger.submit_log)).read_text()  # the fake driver's line

    store.request_stop(PID, "graceful")
    event = running.result(60)
    assert (event["status"], event["run_id"]) == ("stopped", restart), event
    assert op.supervise_complete({"ti": ti}, event, **supervised.kwargs) == LINEAGE
    assert store.get_pipeline(PID).supervision == "ended"


def test_a_trigger_recreated_after_it_restarted_the_run_watches_the_restart(conns: EpochStore,
                                                                            tmp_path: Path) -> None:
    """A triggerer that restarts re-creates the trigger from the arguments it was deferred with, which name the run
    before the restart it submitted: it takes up that restart."""
    store = conns
    _supervised_run(store)
    store.set_pipeline_state(PID, PipelineState.FAILED, run_id=LINEAGE, failure_cause="driver killed")
    resubmission = Resubmission(PID, ["spark-submit", "--run-id", RUN_ID_SLOT], {}, str(tmp_path))
    first = _trigger(restart_submit=resubmission.to_dict())
    failure = store.record_failure(PID, LINEAGE, LINEAGE, "driver killed", first._decide_in_tx)
    restart = f"{LINEAGE}.restart1"
    assert store.claim_restart(PID, LINEAGE, failure.attempt) is None
    store.record_restart(PID, LINEAGE, failure.attempt, restart, None)
    store.register_pipeline(PID, stages=["a"], run_id=restart, takeover=True)
    store.set_pipeline_state(PID, PipelineState.RUNNING, run_id=restart)
    store.heartbeat(PID, restart)
    store.request_stop(PID, "graceful")
    store.set_pipeline_state(PID, PipelineState.STOPPING, run_id=restart)
    store.set_pipeline_state(PID, PipelineState.STOPPED, run_id=restart)
    again = _trigger(restart_submit=resubmission.to_dict())  # the arguments of the deferral: run_id=LINEAGE
    event = _Running(again).result(30)
    assert (event["status"], event["run_id"]) == ("stopped", restart), event


def test_restarts_stay_in_the_task_when_the_trigger_would_store_a_secret(conns: EpochStore, tmp_path: Path) -> None:
    ti = _TI()
    op = submit_op(tmp_path, restart_strategy="fixed-delay", restart_in_triggerer=True,
                   env_vars={"AWS_SECRET_ACCESS_KEY": "not-for-the-database"})
    op._validate()
    deferred = _deferred(op._supervise, {"ti": ti}, LINEAGE, LINEAGE, {}, starting=False)
    assert isinstance(deferred.trigger, PipelineSupervisorTrigger) and deferred.trigger.restart_submit is None
    assert "not-for-the-database" not in json.dumps(deferred.trigger.serialize()[1])
    plain = submit_op(tmp_path, restart_strategy="fixed-delay", restart_in_triggerer=True,
                      env_vars={"FAKE_EPOCH_INTERVAL": "1"})
    plain._validate()
    deferred = _deferred(plain._supervise, {"ti": ti}, LINEAGE, LINEAGE, {}, starting=False)
    assert isinstance(deferred.trigger, PipelineSupervisorTrigger)
    assert deferred.trigger.restart_submit is not None
    assert deferred.trigger.restart_submit["env"].get("FAKE_EPOCH_INTERVAL") == "1"
