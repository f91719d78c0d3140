"""A submit that fails before its run registers fails every task waiting for that run at once (issue 30,
finding 4), and a pipeline module reaches the driver the way docs/airflow.md says.

Real spark-submit (local mode) of the **real** runtime driver, real epoch store, and the three triggers
of the example DAG (the submit task's wait, the checkpoint controller, the ``run_for`` sensor) run
together in one event loop, as the triggerer runs them. The driver fails before Spark starts (it loads
the pipeline module first), so no Spark work is done.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from airflow.sdk.exceptions import TaskDeferred

from airflow_arroyo.core.epochs import PipelineState
from airflow_arroyo.core.exceptions import ArroyoError
from airflow_arroyo.core.processes import LocalProcess
from airflow_arroyo.hooks import arroyo as hook_module
from airflow_arroyo.store import EpochStore
from airflow_arroyo.triggers.checkpoint import CheckpointTrigger
from airflow_arroyo.triggers.pipeline import PipelineStateTrigger
from tests.airflow.test_pipeline_operators import _TI, CONN, PID, submit_op

pytestmark = [pytest.mark.usefixtures("no_defer_settle"), pytest.mark.timeout(240)]

RUN_ID = "d.manual__2026-01-01T00:00:00+00:00.try1"
#: How long the waiters may take to notice, after the submit's own wait ended: a few of their polls.
NOTICED_WITHIN_S = 15.0


@pytest.fixture
def shared_stores() -> Iterator[None]:
    """Each asyncio.run is a triggerer of its own: no store client shared across them."""
    hook_module._reset_shared_stores()
    yield
    hook_module._reset_shared_stores()


def _waiters() -> tuple[CheckpointTrigger, PipelineStateTrigger]:
    """The example DAG's ``checkpoints`` and ``run_for``: they wait for the run by its known id."""
    checkpoints = CheckpointTrigger(pipeline_id=PID, conn_id=CONN, interval=2.0, poll_interval=0.5,
                                    pipeline_run_id=RUN_ID, registration_timeout=600.0)
    run_for = PipelineStateTrigger(pipeline_id=PID, conn_id=CONN, state="stopped", run_id=RUN_ID, poll_interval=0.5)
    return checkpoints, run_for


async def _first(trigger: Any) -> tuple[dict[str, Any], float]:
    async for event in trigger.run():
        return event.payload, time.monotonic()
    raise AssertionError("trigger ended without an event")


def _submit_and_wait(op: Any, started: list[LocalProcess]) -> tuple[Any, dict[str, Any], list[tuple[dict[str, Any],
                                                                                                   float]]]:
    """Submit, then run the submit's wait and both waiters in one loop, bounded in time (a waiter that waits
    for the registration timeout fails the test instead of hanging it)."""
    ti = _TI()
    with pytest.raises(TaskDeferred) as deferred:
        op.execute({"ti": ti})
    submit_trigger = deferred.value.trigger
    assert isinstance(submit_trigger, PipelineStateTrigger)
    started.append(LocalProcess(submit_trigger.submit_pid, submit_trigger.submit_host,  # type: ignore[arg-type]
                                submit_trigger.submit_start_ticks))
    checkpoints, run_for = _waiters()

    async def together() -> list[tuple[dict[str, Any], float]]:
        tasks = [asyncio.ensure_future(_first(t)) for t in (submit_trigger, checkpoints, run_for)]
        done, pending = await asyncio.wait(tasks, timeout=120)
        for task in pending:
            task.cancel()
        if pending:
            ended = [task.result()[0].get("message") for task in done]
            raise AssertionError(f"{len(pending)} of the three triggers still wait 120 s after the submit; "
                                 f"ended: {ended}")
        return [task.result() for task in tasks]

    results = asyncio.run(together())
    return deferred.value, {"ti": ti}, results


@pytest.mark.spark
@pytest.mark.usefixtures("shared_stores")
def test_a_pipeline_module_the_driver_cannot_import_fails_the_submit_and_its_waiters_at_once(
        conns: EpochStore, tmp_path: Path, started: list[LocalProcess]) -> None:
    op = submit_op(tmp_path, application=None, pipeline="arroyo_no_such_pipeline_module:build", run_id=RUN_ID,
                   storage_uri=str(tmp_path / "data"))
    deferred, context, [(submitted, t_submit), (checkpoints, t_cp), (run_for, t_rf)] = _submit_and_wait(op, started)

    assert submitted["status"] == "unreachable", submitted
    # the driver's own error leads, and names the module, where it must live and how to ship it
    for text in (submitted["message"], checkpoints["message"], run_for["message"]):
        assert "cannot import module 'arroyo_no_such_pipeline_module'" in text, text
        assert "py-files" in text and "DAGs folder" in text, text
    assert (checkpoints["status"], checkpoints["reason"]) == ("failure", "pipeline_failed"), checkpoints
    assert run_for["status"] == "failed", run_for
    waited = max(t_cp, t_rf) - t_submit
    print(f"\nwaiters failed {waited:.1f}s after the submit's wait ended")
    assert waited < NOTICED_WITHIN_S

    # the store says what happened: the run failed before it registered, with the driver's error
    record = conns.get_pipeline(PID)
    assert (record.run_id, record.state) == (RUN_ID, PipelineState.FAILED)
    assert "cannot import module 'arroyo_no_such_pipeline_module'" in (record.failure_cause or "")
    with pytest.raises(ArroyoError, match="arroyo_no_such_pipeline_module"):
        op.execute_complete(context, submitted, **deferred.kwargs)


@pytest.mark.spark
@pytest.mark.usefixtures("shared_stores")
def test_a_pipeline_module_in_the_dags_folder_reaches_the_driver_on_a_local_master(
        conns: EpochStore, tmp_path: Path, started: list[LocalProcess], monkeypatch: pytest.MonkeyPatch) -> None:
    """The module is only in the DAGs folder (not installed, not shipped). Its function raises a
    distinctive error instead of building a pipeline, so the driver ends before Spark starts: the error
    reaching the waiters proves the driver imported the module."""
    dags = tmp_path / "dags"
    dags.mkdir()
    (dags / "arroyo_dags_folder_pipeline.py").write_text(
        "from airflow_arroyo.core.exceptions import ConfigurationError\n\n"
        "def build(**kwargs):\n"
        "    raise ConfigurationError('imported from the DAGs folder by the driver')\n")
    monkeypatch.setenv("AIRFLOW__CORE__DAGS_FOLDER", str(dags))
    monkeypatch.delitem(sys.modules, "arroyo_dags_folder_pipeline", raising=False)
    op = submit_op(tmp_path, application=None, pipeline="arroyo_dags_folder_pipeline:build", run_id=RUN_ID,
                   storage_uri=str(tmp_path / "data"))
    _, _, [(submitted, _), (checkpoints, _), (run_for, _)] = _submit_and_wait(op, started)
    for event in (submitted, checkpoints, run_for):
        assert "imported from the DAGs folder by the driver" in event["message"], event


# --------------------------------------------------------------------------- the pieces


def test_the_driver_names_the_module_where_it_looked_and_how_to_ship_it(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    from airflow_arroyo.core.exceptions import ConfigurationError
    from airflow_arroyo.runtime.driver import load_pipeline

    with pytest.raises(ConfigurationError) as missing:
        load_pipeline("arroyo_no_such_pipeline_module.sub:build")
    text = str(missing.value)
    assert text.startswith("cannot import module 'arroyo_no_such_pipeline_module.sub'")
    assert "--py-files" in text and "DAGs folder" in text and "sys.path: " in text and "\n" not in text

    # a module that is there but imports what is not: that dependency is named, not the module
    (tmp_path / "arroyo_needs_a_dependency.py").write_text("import arroyo_missing_dependency\n")
    (tmp_path / "arroyo_broken_module.py").write_text("raise RuntimeError('bad pipeline code')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigurationError, match=r"importing module 'arroyo_needs_a_dependency' .* failed: No "
                                                 r"module named 'arroyo_missing_dependency' \(a module it imports"):
        load_pipeline("arroyo_needs_a_dependency:build")
    with pytest.raises(ConfigurationError, match="importing module 'arroyo_broken_module' .* RuntimeError: bad "
                                                 "pipeline code"):
        load_pipeline("arroyo_broken_module:build")


def test_the_dags_folder_is_on_the_drivers_pythonpath_on_a_local_master_only(
        conns: EpochStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    dags = tmp_path / "dags"
    (dags / "orders_pipelines").mkdir(parents=True)
    monkeypatch.setenv("AIRFLOW__CORE__DAGS_FOLDER", str(dags))
    monkeypatch.setenv("PYTHONPATH", "/opt/mine")
    op = submit_op(tmp_path, application=None, pipeline="orders_pipelines.flows:build")
    env = op.build_spark_submit("r1", None, conns.dsn).env
    assert env["PYTHONPATH"].split(os.pathsep) == ["/opt/mine", str(dags)]

    monkeypatch.setenv("AIRFLOW_CONN_SPARK_TEST", '{"conn_type": "spark", "host": "spark://master:7077"}')
    env = op.build_spark_submit("r1", None, conns.dsn).env
    assert env["PYTHONPATH"] == "/opt/mine"  # a cluster has no DAGs folder: said in the task log instead
    logged = capsys.readouterr().out  # Airflow's task logging writes to stdout here
    assert "is in the DAGs folder" in logged and "py_files" in logged
