"""A supervised run whose driver dies is declared dead at once: the run reads ``failed`` and its in-flight
epoch ``failed`` (one transaction) as soon as the supervisor sees its spark-submit gone, instead of reading
``running`` until the heartbeat timeout and holding the epoch until its own timeout (issue 30, finding 3).

Real spark-submit (local mode) of the stand-in driver (``_fake_driver.py``), real epoch store, the supervisor
trigger run in a thread as the triggerer runs it; the driver is SIGKILLed with an epoch in flight.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from airflow_arroyo.epochs import CheckpointPolicy, EpochState, PipelineState
from airflow_arroyo.store import EpochStore
from airflow_arroyo.supervision import restart_pending
from airflow_arroyo.testing import wait_for
from airflow_arroyo.triggers.pipeline import LocalProcess
from tests.airflow.test_pipeline_operators import _TI, PID, run_trigger, submit_op
from tests.airflow.test_supervised_submit import _supervised_until_running

pytestmark = [pytest.mark.usefixtures("no_defer_settle"), pytest.mark.timeout(240)]

#: From the SIGKILL to the run and its epoch failed: the JVM's exit after its Python driver's, and one look.
DECLARED_DEAD_WITHIN_S = 10.0


@pytest.mark.spark
@pytest.mark.parametrize("wake", ["on_exit", "poll"])
def test_a_killed_drivers_run_and_its_in_flight_epoch_fail_at_once(
        conns: EpochStore, tmp_path: Path, started: list[LocalProcess], wake: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``on_exit``: the supervisor wakes when spark-submit exits (a pidfd); ``poll``: where it cannot, it sees the
    exit at its next look. Both at the operator's default ``supervise_interval`` (5 s)."""
    if wake == "poll":
        monkeypatch.delattr(os, "pidfd_open", raising=False)
    supervise_interval = 5.0
    store = conns
    op = submit_op(tmp_path, supervise_interval=supervise_interval, heartbeat_timeout=60.0,
                   restart_strategy={"type": "fixed-delay", "attempts": 1, "delay": 0},
                   env_vars={"FAKE_HOLD_EPOCHS": "1"})
    supervised = _supervised_until_running(op, _TI(), started)
    tick = store.trigger_tick(PID, CheckpointPolicy(interval=1.0, timeout=600.0), triggered_by="test")
    assert tick.started is not None
    epoch = tick.started.epoch

    events: list[dict[str, Any]] = []
    supervisor = threading.Thread(target=lambda: events.append(run_trigger(supervised.trigger)), daemon=True)
    supervisor.start()
    wait_for(lambda: store.get_pipeline(PID).heartbeat_at is not None, what="a heartbeat")
    killed_at = time.monotonic()
    os.kill(int(store.get_pipeline(PID).config["pid"]), signal.SIGKILL)

    def dead() -> bool:
        return (store.get_pipeline(PID).state is PipelineState.FAILED
                and store.get_epoch(PID, epoch).state is EpochState.FAILED)

    wait_for(dead, timeout=60, what="the run and its in-flight epoch to be failed")
    took = time.monotonic() - killed_at
    print(f"\nSIGKILL -> run failed and epoch {epoch} failed: {took:.2f}s (wake {wake}, supervise_interval "
          f"{supervise_interval}s)")
    assert took < DECLARED_DEAD_WITHIN_S

    record = store.get_pipeline(PID)
    assert "exited" in (record.failure_cause or "") and restart_pending(record)  # the waiters wait for the restart
    assert "exited" in (store.get_epoch(PID, epoch).failure_reason or "")
    supervisor.join(timeout=60)
    assert [e["status"] for e in events] == ["restart"], events
