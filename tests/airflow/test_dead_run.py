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

from airflow_arroyo.core.epochs import CheckpointPolicy, EpochState, PipelineState
from airflow_arroyo.core.processes import LocalProcess
from airflow_arroyo.core.supervision import restart_pending
from airflow_arroyo.store import EpochStore
from airflow_arroyo.testing import wait_for
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


def _driver_pid(group: int) -> int:
    """The Python process of the real driver in spark-submit's process group (the JVM runs it as a child)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
            pgid = os.getpgid(int(entry.name))
        except (OSError, ProcessLookupError):
            continue
        if pgid == group and any(part.endswith(b"runtime/driver.py") for part in cmdline) \
                and not any(b"java" in part for part in cmdline[:1]):
            return int(entry.name)
    raise AssertionError(f"no driver process in process group {group}")


@pytest.mark.spark
@pytest.mark.slow
def test_a_killed_real_drivers_run_and_its_in_flight_epoch_fail_at_once(
        conns: EpochStore, tmp_path: Path, started: list[LocalProcess]) -> None:
    """The same with the runtime driver and Spark (the demo pipeline, local[2]): SIGKILL of its Python process
    right after an epoch started."""
    store = conns
    op = submit_op(tmp_path, application=None, pipeline="airflow_arroyo.examples.pipelines:demo",
                   pipeline_args={"pipeline_id": PID, "rows": None, "rows_per_batch": 200, "trigger_interval": 0.5},
                   storage_uri=str(tmp_path / "data"), register_timeout=180, supervise_interval=5.0,
                   conf={"spark.sql.shuffle.partitions": "2", "spark.ui.enabled": "false"},
                   restart_strategy={"type": "fixed-delay", "attempts": 1, "delay": 0})
    supervised = _supervised_until_running(op, _TI(), started)
    policy = CheckpointPolicy(interval=1.0, timeout=600.0)
    wait_for(lambda: store.trigger_tick(PID, policy, triggered_by="test").started is not None
             or store.in_flight_epoch(PID) is not None, timeout=60, what="an epoch to start")
    in_flight = store.in_flight_epoch(PID)
    assert in_flight is not None

    events: list[dict[str, Any]] = []
    supervisor = threading.Thread(target=lambda: events.append(run_trigger(supervised.trigger)), daemon=True)
    supervisor.start()
    killed_at = time.monotonic()
    os.kill(_driver_pid(started[0].pid), signal.SIGKILL)

    def dead() -> bool:
        return (store.get_pipeline(PID).state is PipelineState.FAILED
                and store.get_epoch(PID, in_flight.epoch).state is not EpochState.TRIGGERED)

    wait_for(dead, timeout=60, what="the run and its in-flight epoch to end")
    took = time.monotonic() - killed_at
    epoch = store.get_epoch(PID, in_flight.epoch)
    print(f"\nreal driver: SIGKILL -> run failed and epoch {epoch.epoch} {epoch.state}: {took:.2f}s")
    assert took < DECLARED_DEAD_WITHIN_S
    supervisor.join(timeout=60)
    assert [e["status"] for e in events] == ["restart"], events
