"""``EpochStore.fail_run``: a run whose driver is gone (or never registered) is failed at once, with its
in-flight epoch, in one transaction; nothing else is touched (issue 30, findings 3 and 4)."""

from __future__ import annotations

import pytest

from airflow_arroyo.core.epochs import CheckpointPolicy, EpochState, PipelineState
from airflow_arroyo.core.exceptions import FencedError
from airflow_arroyo.store import EpochStore
from tests.support import running

PID = "orders"


def _in_flight(store: EpochStore) -> int:
    tick = store.trigger_tick(PID, CheckpointPolicy(interval=1.0, timeout=600.0))
    assert tick.started is not None
    return tick.started.epoch


def test_a_live_run_fails_with_its_in_flight_epoch_in_one_step(store: EpochStore) -> None:
    running(store, PID, run_id="r1")
    epoch = _in_flight(store)
    token = store.fencing_token(PID, "r1")
    record = store.fail_run(PID, "r1", "spark-submit exited (SIGKILL)")
    assert record is not None and (record.state, record.failure_cause) == (PipelineState.FAILED,
                                                                          "spark-submit exited (SIGKILL)")
    failed = store.get_epoch(PID, epoch)
    assert failed.state is EpochState.FAILED and "spark-submit exited" in (failed.failure_reason or "")
    assert store.get_pipeline(PID).generation == token.generation  # the same run: not a new generation
    assert store.fail_run(PID, "r1", "again") is None  # ended already: nothing to fail
    assert store.get_pipeline(PID).failure_cause == "spark-submit exited (SIGKILL)"


def test_another_run_or_an_ended_one_is_left_alone(store: EpochStore) -> None:
    running(store, PID, run_id="r2")
    epoch = _in_flight(store)
    assert store.fail_run(PID, "r1", "old news") is None
    assert store.fail_run(PID, "r1", "old news", never_registered=True) is None  # r2 is live: never replaced
    assert (store.get_pipeline(PID).run_id, store.get_pipeline(PID).state) == ("r2", PipelineState.RUNNING)
    assert store.get_epoch(PID, epoch).state is EpochState.TRIGGERED
    assert store.fail_run("unknown", "r1", "x") is None


def test_a_run_that_never_registered_becomes_the_current_run_failed(store: EpochStore) -> None:
    running(store, PID, run_id="r1", stages=("src", "sink"))
    store.set_pipeline_state(PID, PipelineState.STOPPED, run_id="r1")
    before = store.get_pipeline(PID)
    record = store.fail_run(PID, "r2", "cannot import module 'x'", never_registered=True)
    assert record is not None
    assert (record.run_id, record.state, record.failure_cause) == ("r2", PipelineState.FAILED,
                                                                   "cannot import module 'x'")
    assert record.generation == before.generation + 1 and record.stages == before.stages
    assert record.heartbeat_at is None and record.spark_ui_url is None
    with pytest.raises(FencedError):  # the old run's token is stale
        store.heartbeat(PID, "r1", token=before.token)
    # a later submit registers as usual
    store.register_pipeline(PID, stages=["src", "sink"], run_id="r3")


def test_a_run_of_an_unknown_pipeline_that_never_registered_is_recorded(store: EpochStore) -> None:
    record = store.fail_run(PID, "r1", "cannot import module 'x'", never_registered=True)
    assert record is not None and (record.run_id, record.state) == ("r1", PipelineState.FAILED)
    assert store.list_epochs(PID) == []
