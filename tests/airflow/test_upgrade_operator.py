"""UpgradePipelineOperator: the old code stopped with a final epoch that is pinned, the new code submitted restoring
it with the upgrade's driver arguments, a refused plan failing the task before anything is asked, and which restarts
take those arguments. Real epoch store, real spark-submit (local mode) starting the stand-in driver
(``_fake_driver.py``) as the new code, the stand-in driver as a plain process as the old code; no Spark work."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from airflow.sdk.exceptions import AirflowFailException, TaskDeferred

from airflow_arroyo.core.epochs import CheckpointPolicy, EpochState, PipelineState
from airflow_arroyo.core.exceptions import ConfigurationError
from airflow_arroyo.core.processes import LocalProcess
from airflow_arroyo.operators.upgrade import UpgradePipelineOperator
from airflow_arroyo.store import EpochStore
from airflow_arroyo.testing import wait_for
from airflow_arroyo.triggers.pipeline import PipelineStateTrigger
from tests.airflow.test_pipeline_operators import _TI

FAKE_DRIVER = str(Path(__file__).with_name("_fake_driver.py"))
NEW_CODE = "tests.airflow._upgrade_code:up_op"
PID = "up_op"
CONN = "arroyo_test"
SPARK = "spark_test"
TS = "2026-01-01T00:00:00+00:00"

pytestmark = pytest.mark.usefixtures("no_defer_settle")


def upgrade_op(tmp_path: Path, **kwargs: Any) -> UpgradePipelineOperator:
    args: dict[str, Any] = dict(task_id="upgrade", pipeline=NEW_CODE, pipeline_id=PID, conn_id=CONN,
                                spark_conn_id=SPARK, application=FAKE_DRIVER, submit_log_dir=str(tmp_path),
                                register_timeout=120, poll_interval=0.2, stop_timeout=60)
    args.update(kwargs)
    return UpgradePipelineOperator(**args)


def run_trigger(trigger: PipelineStateTrigger) -> dict[str, Any]:
    async def first() -> dict[str, Any]:
        async for event in trigger.run():
            return event.payload
        raise AssertionError("trigger ended without an event")

    return asyncio.run(first())


def driver_args(command: list[str]) -> list[str]:
    """The arguments after the application (the stand-in driver) in a spark-submit command."""
    return command[command.index(FAKE_DRIVER) + 1:]


def upgrade_options(command: list[str]) -> list[str]:
    args = driver_args(command)
    return [f"{a} {b}" for a, b in zip(args, args[1:], strict=False)
            if a in ("--rename", "--allow-dropped-state", "--rescale")]


@pytest.fixture
def old_run(conns: EpochStore, tmp_path: Path) -> Iterator[subprocess.Popen[bytes]]:
    """The old code running as pipeline 'up_op' (run 'old'), taking an epoch every 0.2 s."""
    env = {**os.environ, "ARROYO_DSN": conns.dsn, "FAKE_EPOCH_INTERVAL": "0.2"}
    with open(tmp_path / "old.log", "wb") as log:
        process = subprocess.Popen([sys.executable, FAKE_DRIVER, "--pipeline", f"old:{PID}", "--run-id", "old"],
                                   stdout=log, stderr=subprocess.STDOUT, env=env)

    def epochs() -> int:
        try:
            return len(conns.list_epochs(PID, states=[EpochState.COMPLETED]))
        except Exception:  # noqa: BLE001 - not registered yet
            return 0

    try:
        wait_for(lambda: process.poll() is not None or epochs() >= 2, timeout=60, what="two epochs of the old code")
        assert process.poll() is None, (tmp_path / "old.log").read_text()
        yield process
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(30)


def _complete_epoch(store: EpochStore, stages: list[str]) -> int:
    tick = store.trigger_tick(PID, CheckpointPolicy(interval=1.0), triggered_by="test", force=True)
    assert tick.started is not None
    for stage in stages:
        store.ack_epoch(PID, tick.started.epoch, stage)
    assert store.get_epoch(PID, tick.started.epoch).state is EpochState.COMPLETED
    return tick.started.epoch


# --------------------------------------------------------------------------- the whole upgrade


@pytest.mark.spark
def test_upgrade_stops_pins_and_starts_the_new_code_restoring_the_final_epoch(
        conns: EpochStore, old_run: subprocess.Popen[bytes], tmp_path: Path, started: list[LocalProcess]) -> None:
    op = upgrade_op(tmp_path, renamed={"sink": "sink_v2"}, rescale={"sink_v2": 4},
                    env_vars={"FAKE_STAGES": "source,sink_v2"})
    ti = _TI()
    with pytest.raises(TaskDeferred) as deferred:
        op.execute({"ti": ti, "ts": TS})  # type: ignore[arg-type]
    trigger = deferred.value.trigger
    assert isinstance(trigger, PipelineStateTrigger)
    started.append(LocalProcess(trigger.submit_pid, trigger.submit_host, trigger.submit_start_ticks))  # type: ignore[arg-type]

    # the old code was asked to stop gracefully: it took a final epoch and ended by itself
    assert old_run.wait(30) == 0
    pinned = conns.get_epoch(PID, ti.xcom["pinned_epoch"])
    assert (pinned.is_final, pinned.run_id, pinned.stages) == (True, "old", ["source", "sink"])
    assert pinned.pin_label == ti.xcom["pin_label"] == f"upgrade d.upgrade {TS}"
    assert pinned.epoch == conns.latest_completed_epoch(PID).epoch  # type: ignore[union-attr]
    assert [(r["stage"], r["action"], r["snapshot"]) for r in ti.xcom["upgrade_plan"]] == [
        ("source", "restored", "source"), ("sink_v2", "restored", "sink")]

    # the new code runs, restoring the pinned epoch with the rename (and the rescale: its first launch)
    event = run_trigger(trigger)
    assert event["status"] == "success", event
    run_id = "d.manual__2026-01-01T00:00:00+00:00.try1"
    assert op.execute_complete({"ti": ti}, event, **deferred.value.kwargs) == run_id  # type: ignore[arg-type]
    new = conns.get_pipeline(PID)
    assert (new.run_id, new.state) == (run_id, PipelineState.RUNNING)
    assert new.config["restore_from"] == str(pinned.epoch)
    assert (new.config["rename"], new.config["allow_dropped_state"], new.config["rescale"]) == (
        ["sink=sink_v2"], [], ["sink_v2=4"])

    # a restart now restores the pinned epoch again ('latest'): it needs the rename, not the rescale
    assert upgrade_options(op.build_spark_submit("r2", "latest", conns.dsn).command) == ["--rename sink=sink_v2"]
    # once the new code completed an epoch of its own, 'latest' has no stage 'sink': nothing is added
    conns.trigger_tick(PID, CheckpointPolicy(interval=1.0), triggered_by="test", force=True)
    latest = wait_for(lambda: (e := conns.latest_completed_epoch(PID)) is not None and e.epoch > pinned.epoch and e,
                      timeout=30, what="an epoch of the new code")
    assert latest.stages == ["source", "sink_v2"]
    assert upgrade_options(op.build_spark_submit("r3", "latest", conns.dsn).command) == []

    conns.request_stop(PID, "immediate")
    wait_for(lambda: not started[0].group_alive(), timeout=60, what="the new run's process group to end")


# --------------------------------------------------------------------------- failures


def test_a_refused_plan_fails_the_task_before_anything_is_asked(
        conns: EpochStore, old_run: subprocess.Popen[bytes], tmp_path: Path) -> None:
    # the new code names its sink 'sink_v3' and neither maps nor drops the epoch's 'sink'
    op = upgrade_op(tmp_path, pipeline_args={"sink": "sink_v3"})
    with pytest.raises(AirflowFailException, match="step 'plan'") as info:
        op.execute({"ti": _TI(), "ts": TS})  # type: ignore[arg-type]
    assert "stage 'sink' removed" in str(info.value) and "the old code still runs" in str(info.value)
    pipeline = conns.get_pipeline(PID)
    assert (pipeline.run_id, pipeline.state, pipeline.stop_requested) == ("old", PipelineState.RUNNING, None)
    assert old_run.poll() is None
    assert [e.epoch for e in conns.list_epochs(PID) if e.pin_label is not None] == []
    assert not (tmp_path / PID).exists()  # nothing was submitted


def test_new_code_of_another_pipeline_is_refused_before_anything_is_asked(
        conns: EpochStore, old_run: subprocess.Popen[bytes], tmp_path: Path) -> None:
    conns.register_pipeline("other", stages=["source"], run_id="o1")
    with pytest.raises(ConfigurationError, match="is pipeline 'up_op', not 'other'"):
        upgrade_op(tmp_path, pipeline_id="other").execute({"ti": _TI(), "ts": TS})  # type: ignore[arg-type]
    assert conns.get_pipeline(PID).stop_requested is None and old_run.poll() is None


# --------------------------------------------------------------------------- which run takes which arguments


def test_restarts_take_the_upgrade_arguments_only_while_the_latest_epoch_holds_the_old_stages(
        conns: EpochStore, tmp_path: Path) -> None:
    # the old code: stage 'counts' registered with the identity 'totals' (its uid), and a stage 'legacy'
    conns.register_pipeline(PID, stages=["source", "counts", "legacy"], run_id="old",
                            config={"stages": {"source": {}, "counts": {"uid": "totals"}, "legacy": {}}})
    conns.set_pipeline_state(PID, PipelineState.RUNNING, run_id="old")
    old_epoch = _complete_epoch(conns, ["source", "counts", "legacy"])
    op = upgrade_op(tmp_path, renamed={"totals": "totals_v2"}, allow_dropped_state=["legacy"],
                    rescale={"totals_v2": 8})
    upgrade = ["--rename totals=totals_v2", "--allow-dropped-state legacy"]

    def options(restore: str | None) -> list[str]:
        return upgrade_options(op.build_spark_submit("r", restore, conns.dsn).command)

    # the first launch restores the pinned epoch by number: everything, the rescale too
    assert options(str(old_epoch)) == [*upgrade, "--rescale totals_v2=8"]
    # a restart while 'latest' is still the old code's epoch (by the identity 'totals', not the name 'counts')
    assert options("latest") == upgrade
    assert options(None) == []
    assert op.application_args == []  # the operator's own arguments are left as given

    # the new code ran and completed an epoch of its own stages: a restart of 'latest' takes none of them
    conns.set_pipeline_state(PID, PipelineState.STOPPED, run_id="old")
    conns.register_pipeline(PID, stages=["source", "totals_v2"], run_id="new",
                            config={"stages": {"source": {}, "totals_v2": {}}})
    conns.set_pipeline_state(PID, PipelineState.RUNNING, run_id="new")
    _complete_epoch(conns, ["source", "totals_v2"])
    assert options("latest") == []
    assert options(str(old_epoch)) == [*upgrade, "--rescale totals_v2=8"]  # an explicit epoch still takes them


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"restore_from": "latest"}, "drop restore_from"),
        ({"renamed": {"sink": ""}}, "renamed must map"),
        ({"allow_dropped_state": "legacy"}, "allow_dropped_state must be a list"),
        ({"rescale": {"counts": 0}}, "number of state partitions >= 1"),
        ({"pin_label": " "}, "pin label must be"),
    ],
)
def test_bad_arguments_fail_when_the_dag_is_parsed(kwargs: dict[str, Any], needle: str) -> None:
    with pytest.raises(ConfigurationError, match=needle):
        UpgradePipelineOperator(task_id="upgrade", pipeline=NEW_CODE, pipeline_id=PID, **kwargs)


def test_the_upgrade_arguments_are_templated() -> None:
    op = UpgradePipelineOperator(task_id="upgrade", pipeline=NEW_CODE, pipeline_id=PID,
                                 renamed={"sink": "{{ params.new }}"}, allow_dropped_state=["{{ params.drop }}"])
    assert {"renamed", "allow_dropped_state", "rescale", "pin_label", "pipeline"} <= set(op.template_fields)
    assert op.renamed == {"sink": "{{ params.new }}"}  # checked once rendered


def test_with_renames_restarts_are_submitted_by_the_task_not_the_triggerer(conns: EpochStore, tmp_path: Path) -> None:
    """The triggerer would reuse one restart command built in advance; the renames depend on the epoch restored."""
    quiet = {"restart_in_triggerer": True, "openlineage_inject_parent_job_info": False,
             "openlineage_inject_transport_info": False}
    assert upgrade_op(tmp_path, renamed={"sink": "sink_v2"}, **quiet)._resubmission({"ti": _TI()}) is None  # type: ignore[arg-type]
    assert upgrade_op(tmp_path, **quiet)._resubmission({"ti": _TI()}) is not None  # type: ignore[arg-type]
