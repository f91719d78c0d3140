"""End to end on real Airflow 3: ``airflow standalone`` (scheduler, triggerer, dag-processor,
api-server; LocalExecutor on PostgreSQL), a throwaway PostgreSQL for the epoch store, the real
runtime driver under spark-submit in local mode, everything driven through the REST API v2.

It uses the embedded launcher (``airflow_arroyo.devtools.embedded``, the README's run command) so
that both stay true. The story:

1. the example DAG is triggered (a JWT from ``/auth/token``); ``submit`` starts the demo pipeline;
2. at least 3 epochs complete, fired by ``CheckpointTrigger`` in the triggerer;
3. the retention DAG runs meanwhile; while its prune task holds the pipeline's cleanup lock the
   checkpoint trigger defers (its trigger log says so, and no epoch starts inside the lock window
   recorded in ``arroyo_history``) and resumes afterwards;
7. supervision: the Python driver is SIGKILLed; the ``submit`` task, supervising in the triggerer,
   resubmits the pipeline restoring the latest completed epoch; the restart is in the store and on the
   UI's pipeline page, the restarted run completes epochs, and the report (6) is still exact; then a
   second DAG run (restored from the latest epoch) whose strategy gives up (``none``) is SIGKILLed too:
   its ``submit`` task fails, with the cause in its log;
4. an operator ends the run by marking ``run_for`` success; ``stop`` stops the pipeline gracefully
   (a final epoch), which ends the ``checkpoints`` task; the DAG run succeeds;
5. epochs and their states are checked in PostgreSQL; leaving the launcher stops everything;
6. data awareness: the demo writes its report to an exactly-once Parquet sink whose Asset gets an
   event per commit (the Asset watcher in the triggerer, and the ``stop`` task's outlet); the
   ``example_committed_report`` DAG, scheduled on that Asset, runs while the pipeline runs and after
   it stopped, and reads exactly the committed rows: the rows the store recorded for the commits up to
   the one it was triggered by, and after the final commit the whole report computed in plain Python;
   the final epoch's provenance page, served by the api-server from the snapshot objects, shows what
   ``airflow_arroyo.core.provenance`` computes for it;
8. a gate: the demo's ``--gated`` run (``example_gated_pipeline``, ``example_gate_check`` unpaused): each epoch's
   orders wait behind the PostgreSQL sink's gate until the check DAG, scheduled by the gate's Asset event, passes
   them; once two gates committed the run is ended; the table holds exactly the committed gates' orders, the
   generator's first ones, each once, and the pipeline page lists the gates.
"""

from __future__ import annotations

import ast
import json
import os
import signal
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any, TypeVar

import psycopg2
import psycopg2.extras
import pytest

from airflow_arroyo.core.epochs import EpochState, PipelineState
from airflow_arroyo.core.exceptions import UnknownPipelineError
from airflow_arroyo.core.gates import GateState
from airflow_arroyo.core.processes import LocalProcess
from airflow_arroyo.core.provenance import epoch_provenance
from airflow_arroyo.devtools.embedded import (
    EXAMPLE_DAG,
    GATE_CHECK_DAG,
    GATED_DAG,
    RETENTION_DAG,
    EmbeddedAirflow,
    EmbeddedSettings,
    gated_result,
)
from airflow_arroyo.examples import SINK_STAGE, expected_report
from airflow_arroyo.examples.names import GATED_PIPELINE_ID, GATED_SINK
from airflow_arroyo.store import EpochStore
from airflow_arroyo.triggers.pipeline import log_tail

pytestmark = [pytest.mark.slow, pytest.mark.e2e, pytest.mark.spark, pytest.mark.timeout(1200)]

PIPELINE = "arroyo-demo"
REPORT_DAG = "example_committed_report"
ROWS = 4000
INTERVAL = 1.0
CLEANUP_WAIT_LINE = "waiting for cleanup run"
T = TypeVar("T")


def wait_for(what: str, check: Callable[[], T | None], timeout: float, diagnose: Callable[[], str],
             interval: float = 1.0) -> T:
    """Poll ``check`` until it returns something truthy; fail with ``diagnose()`` at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:g}s waiting for {what}\n{diagnose()}")
        time.sleep(interval)


def rows(dsn: str, sql: str, *params: Any) -> list[dict[str, Any]]:
    conn = psycopg2.connect(dsn)
    try:
        with conn.cursor(cursor_factory=psycopg2.extras.RealDictCursor) as cur:
            cur.execute(sql, params)
            return [dict(r) for r in cur.fetchall()]
    finally:
        conn.close()


def trigger_logs(home: Path) -> str:
    """Every trigger log of the example DAG's checkpoint task (beside the task logs)."""
    return "\n".join(p.read_text(errors="replace")
                     for p in sorted((home / "logs").rglob("*.trigger.*.log")) if "task_id=checkpoints" in str(p))


def test_example_dag_on_airflow_standalone() -> None:
    settings = EmbeddedSettings(
        retention_schedule="0 0 1 1 *",  # only the runs this test triggers (and one at start-up, with no pipeline)
        retention_keep_last=2,
        startup_timeout=300,
    )
    with EmbeddedAirflow(settings) as airflow:
        store = EpochStore(airflow.store_dsn, max_connections=2)
        home = airflow.home
        try:
            _run(airflow, store, home)
            restarted = sum(1 for r in store.restarts(PIPELINE) if r.new_run_id)
            _gated(airflow, store)
        finally:
            store.close()
        pid_files = sorted((home / "logs" / "arroyo").glob(f"{PIPELINE}/*.pid"))
        # the first DAG run's first run and each restart the supervisor recorded (one for the kill; more if a
        # restart itself failed, e.g. a slow start at load), and the second DAG run: no other spark-submit
        assert restarted >= 1 and len(pid_files) == 2 + restarted, (restarted, pid_files)
        every = sorted((home / "logs" / "arroyo").glob("*/*.pid"))  # the gated pipeline's too
        assert len(every) > len(pid_files), every
        groups = [LocalProcess(int(pid), host, int(ticks))
                  for pid, ticks, host in (f.read_text().split() for f in every)]
    # leaving the launcher stopped everything it started, the spark-submit process groups included
    assert not any(group.group_alive() for group in groups)
    assert airflow.process is None and airflow.pg is None and not home.exists()


def _run(airflow: EmbeddedAirflow, store: EpochStore, home: Path) -> None:
    run_id = airflow.trigger(EXAMPLE_DAG, {
        "interval": INTERVAL, "epochs": 100_000, "minutes": 15,
        "rows": ROWS, "rows_per_batch": 200, "trigger_interval": 0.5,
    })

    def diagnose() -> str:
        parts = [f"task instances: {airflow.task_instances(EXAMPLE_DAG, run_id)}"]
        for log in sorted((home / "logs" / "arroyo").glob("*/*.log")):
            parts.append(f"--- {log.name} (tail)\n{log_tail(str(log), 40)}")
        log = [line for line in airflow.log_path.read_text(errors="replace").splitlines()
               if "request finished" not in line]  # the API's access log would fill the tail
        parts.append("--- standalone.log (tail, no access log)\n" + "\n".join(log[-40:]))
        parts.append(f"--- {REPORT_DAG} runs\n{_report_run_states(airflow)}")
        mentions = [line for line in log if "committed_report" in line or "arroyo-arroyo-demo" in line]
        parts.append("--- standalone.log lines on the report DAG and its Asset watcher (last 40)\n"
                     + "\n".join(mentions[-40:]))
        return "\n".join(parts)

    def run_state() -> str:
        state = str(airflow.dag_run(EXAMPLE_DAG, run_id)["state"])
        if state == "failed":
            pytest.fail(f"the example DAG run failed\n{diagnose()}")
        return state

    def completed_epochs() -> list[int]:
        run_state()
        try:
            epochs = store.list_epochs(PIPELINE, states=[EpochState.COMPLETED])
        except UnknownPipelineError:  # not registered yet
            return []
        return [e.epoch for e in epochs]

    # -- 1 + 2: running, and epochs completing, fired by the trigger of the `checkpoints` task
    wait_for("3 completed epochs", lambda: len(completed_epochs()) >= 3, 420, diagnose)
    # submit supervises the run in the triggerer for its whole life: once the run is up, its task resumes on a
    # worker for a moment and defers again, to the supervisor (the fused form's epochs can complete before that)
    # one read for the wait and the assertion: the supervisor resumes the submit task for a moment when the run
    # changes, so a second read can catch it between two deferrals ('scheduled')
    tis: dict[str, Any] = {}

    def submit_deferred() -> bool:
        tis.update(airflow.task_instances(EXAMPLE_DAG, run_id))
        return bool(tis["submit"] == "deferred")

    wait_for("the submit task to defer to its supervisor", submit_deferred, 120, diagnose)
    assert tis["submit"] == "deferred" and tis["checkpoints"] == "deferred" and tis["run_for"] == "deferred", tis
    pipeline = store.get_pipeline(PIPELINE)
    assert pipeline.state is PipelineState.RUNNING and pipeline.spark_ui_url
    fired_by = {e.triggered_by for e in store.list_epochs(PIPELINE)}
    assert fired_by == {f"airflow:{EXAMPLE_DAG}/checkpoints/{run_id}"}, fired_by

    # -- 6a: a sink commit while the pipeline runs schedules the report DAG (Asset watcher)
    first = wait_for("a report DAG run on a commit", lambda: _report_runs(airflow), 300, diagnose)[0]
    _check_report(store, first)

    # -- 3: the trigger defers while the cleanup lock is held. A retention run holds it for a moment only, so a
    # tick landing inside one is luck; the test holds the same lease (as any holder could) until the trigger has
    # logged that it waits, then releases it, and a retention run prunes under its own lease
    def trigger_waits() -> bool:
        run_state()
        return CLEANUP_WAIT_LINE in trigger_logs(home)

    held = store.acquire_cleanup_lock(PIPELINE, "e2e-test", ttl=600)
    try:
        wait_for("the checkpoint trigger to wait for the held cleanup lock", trigger_waits, 300, diagnose)
    finally:
        store.release_cleanup_lock(PIPELINE, held.id)
    retention_run = airflow.trigger(RETENTION_DAG, {"keep_last": "2"})
    final = airflow.wait_run(RETENTION_DAG, retention_run, timeout=300, on_poll=run_state)
    assert final == "success", (final, airflow.task_instances(RETENTION_DAG, retention_run))
    runs = store.list_cleanup_runs(PIPELINE)
    print("cleanup runs (the test's lease, then the retention DAG's): "
          f"{[(r.id, r.started_at.isoformat(), r.ended_at, r.epochs_pruned) for r in runs]}")
    assert runs and all(r.state == "succeeded" for r in runs), runs
    assert any(r.epochs_pruned for r in runs), runs  # keep_last=2 pruned the older epochs
    _check_no_epoch_started_under_the_lock(airflow.store_dsn)
    # checkpoints resumed after the lock was released
    last_release = max(r.ended_at for r in runs if r.ended_at is not None)
    wait_for("an epoch started after the cleanup", lambda: any(
        e.triggered_at > last_release for e in store.list_epochs(PIPELINE, limit=5)), 120, diagnose)
    assert "cleanup lock released; checkpoints resume" in trigger_logs(home)

    # -- 7: SIGKILL the driver: the supervisor restarts the pipeline from its latest completed epoch
    before = store.get_pipeline(PIPELINE)
    latest = store.latest_completed_epoch(PIPELINE)
    assert before.supervision == "watching" and before.run_id is not None and latest is not None, before
    for pid in _driver_pids(before.run_id):
        os.kill(pid, signal.SIGKILL)
    restart = wait_for("the supervisor's restart", lambda: next(
        (r for r in store.restarts(PIPELINE) if r.new_run_id and r.attempt == 1), None), 300, diagnose)
    assert (restart.attempt, restart.failed_run_id, restart.gave_up) == (1, before.run_id, False), restart
    assert restart.new_run_id == f"{before.run_id}.restart1" and restart.restored_epoch is not None
    assert restart.restored_epoch >= latest.epoch, (restart, latest)
    # running a restart of the lineage (restart1, or a later one if restart1 itself failed)
    wait_for("the restarted run to run", lambda: (lambda p: str(p.run_id).startswith(f"{before.run_id}.restart")
                                                  and p.state is PipelineState.RUNNING)(store.get_pipeline(PIPELINE)),
             300, diagnose)
    assert (store.get_pipeline(PIPELINE).restored_from_epoch or 0) >= restart.restored_epoch
    wait_for("an epoch completed by the restarted run", lambda: any(
        e.epoch > restart.restored_epoch for e in store.list_epochs(PIPELINE, states=[EpochState.COMPLETED])),
             300, diagnose)  # type: ignore[operator]
    assert airflow.task_instances(EXAMPLE_DAG, run_id)["submit"] == "deferred"
    page = _ui_page(airflow, f"/arroyo/pipelines/{PIPELINE}")  # the plugin app itself (no frame)
    assert restart.new_run_id in page and "Restarts" in page, page[:2000]

    # the input (bounded) is all processed and committed before the operator ends the run: a graceful stop
    # takes its final epoch where the pipeline stands, it does not drain the sources (with the fused form the
    # steps above can take less time than the restarted run needs to get to the end)
    wait_for("every report row committed", lambda: sum(
        c.rows_committed or 0 for c in store.sink_commits(PIPELINE, sink=SINK_STAGE, limit=10_000))
        >= len(expected_report(ROWS)), 300, diagnose)

    # -- 4: end the run the way an operator would: mark `run_for` success -> `stop` -> graceful stop
    airflow.api("PATCH", f"/dags/{EXAMPLE_DAG}/dagRuns/{run_id}/taskInstances/run_for",
                json={"new_state": "success"})
    final_state = airflow.wait_run(EXAMPLE_DAG, run_id, timeout=300)
    tis = airflow.task_instances(EXAMPLE_DAG, run_id)
    assert final_state == "success", (final_state, tis, diagnose())
    assert tis == {"submit": "success", "checkpoints": "success", "run_for": "success", "stop": "success"}

    # -- 5: what PostgreSQL says
    pipeline = store.get_pipeline(PIPELINE)
    assert pipeline.state is PipelineState.STOPPED and pipeline.failure_cause is None
    epochs = sorted(store.list_epochs(PIPELINE, limit=10_000), key=lambda e: e.epoch)
    states = {e.epoch: e.state for e in epochs}
    assert all(s in (EpochState.COMPLETED, EpochState.PRUNED, EpochState.EXPIRED, EpochState.FAILED)
               for s in states.values()), states
    assert sum(1 for s in states.values() if s in (EpochState.COMPLETED, EpochState.PRUNED)) >= 4, states
    final = epochs[-1]
    assert final.is_final and final.state is EpochState.COMPLETED, final
    assert [e.epoch for e in epochs] == list(range(epochs[0].epoch, final.epoch + 1))  # no gaps, increasing
    checkpoints = next(ti for ti in airflow.api("GET", f"/dags/{EXAMPLE_DAG}/dagRuns/{run_id}/taskInstances")
                       ["task_instances"] if ti["task_id"] == "checkpoints")
    assert final.ended_at is not None
    assert datetime.fromisoformat(checkpoints["end_date"]) >= final.ended_at  # the stop ended the checkpoint task

    # -- 6b: the final commit schedules the report DAG once more; it reads the whole report, exactly once
    last_commit = store.latest_sink_commit(PIPELINE, SINK_STAGE)
    assert last_commit is not None and last_commit.epoch == final.epoch, (last_commit, final)
    report = wait_for("the report DAG on the final commit", lambda: next(
        (r for r in _report_runs(airflow) if r["seq"] == last_commit.seq), None), 300, diagnose)
    _check_report(store, report)
    expected = expected_report(ROWS)
    assert (report["rows"], report["distinct_ids"], report["total"]) == (
        len(expected), len(expected), sum(r[4] for r in expected)), report

    # -- 6c: the final epoch's provenance, as the api-server reads it from the snapshot objects
    prov = epoch_provenance(store, PIPELINE, final.epoch)
    page = _ui_page(airflow, f"/arroyo/pipelines/{PIPELINE}/epochs/{final.epoch}/provenance")
    report_sink = next(s for s in prov.sinks if s.sink == SINK_STAGE)
    assert report_sink.batch_id == last_commit.batch_id, (report_sink, last_commit)
    assert all(name in page for name in report_sink.file_names or []), page[:3000]
    ends = [json.dumps(r.end, sort_keys=True, separators=(",", ":")) for s in prov.stages for r in s.sources if r.end]
    assert ends and all(end.replace('"', "&#34;") in page for end in ends), (ends, page[:3000])

    # -- 7b: a strategy that gives up: a second DAG run, restored from the latest epoch, killed once
    first_runs = {pipeline.run_id, *(r.new_run_id for r in store.restarts(PIPELINE))}
    second = airflow.trigger(EXAMPLE_DAG, {
        "interval": INTERVAL, "epochs": 100_000, "minutes": 15, "rows": ROWS, "rows_per_batch": 200,
        "trigger_interval": 0.5, "restore_from": "latest", "restart_strategy": '{"type": "none"}',
    })
    running = wait_for("the second DAG run's pipeline to run, supervised", lambda: (lambda p: p if (
        p.run_id not in first_runs and p.state is PipelineState.RUNNING and p.supervision == "watching"
        and p.supervised_run == p.run_id) else None)(store.get_pipeline(PIPELINE)), 300, diagnose)
    assert running.restored_from_epoch == final.epoch, running
    for pid in _driver_pids(str(running.run_id)):
        os.kill(pid, signal.SIGKILL)
    assert airflow.wait_run(EXAMPLE_DAG, second, timeout=300) == "failed"
    assert airflow.task_instances(EXAMPLE_DAG, second)["submit"] == "failed"
    [gave_up] = store.restarts(PIPELINE, lineage=str(running.run_id))
    assert gave_up.gave_up and gave_up.new_run_id is None and "exited" in gave_up.cause, gave_up
    log = json.dumps(airflow.api("GET", f"/dags/{EXAMPLE_DAG}/dagRuns/{second}/taskInstances/submit/logs/1"))
    assert "PipelineFailedError" in log and "exited while the run was running" in log, log[-3000:]
    assert store.get_pipeline(PIPELINE).supervision == "gave_up"


def _gated(airflow: EmbeddedAirflow, store: EpochStore) -> None:
    """-- 8: the demo's gate (``--gated``): checks scheduled by the gates' Asset events pass each epoch."""
    airflow.wait_dag(GATE_CHECK_DAG)  # unpaused, as the demo does
    run_id = airflow.trigger(GATED_DAG, {"interval": 2.0, "epochs": 100_000, "minutes": 10, "rows": 3000,
                                         "rows_per_batch": 100})

    def committed() -> list[int]:
        state = str(airflow.dag_run(GATED_DAG, run_id)["state"])
        assert state != "failed", airflow.task_instances(GATED_DAG, run_id)
        return [g.epoch for g in store.list_gates(GATED_PIPELINE_ID, states=[GateState.COMMITTED])]

    wait_for("two gates passed by the check DAG and committed", lambda: len(committed()) >= 2, 420,
             lambda: f"gates: {store.list_gates(GATED_PIPELINE_ID)}\n{airflow.task_instances(GATED_DAG, run_id)}")
    airflow.api("PATCH", f"/dags/{GATED_DAG}/dagRuns/{run_id}/taskInstances/run_for", json={"new_state": "success"})
    assert airflow.wait_run(GATED_DAG, run_id, timeout=300) == "success", airflow.task_instances(GATED_DAG, run_id)
    result = gated_result(airflow.store_dsn)
    gates = store.list_gates(GATED_PIPELINE_ID, limit=10_000)
    assert result.exact and result.orders > 0, result
    assert result.deciders == {"example_gate_check.check_orders"}, result
    assert all(g.state in (GateState.COMMITTED, GateState.PASSED, GateState.PENDING) for g in gates), gates
    # the table holds exactly what the committed gates let through, nothing of a gate still waiting
    commits = store.sink_commits(GATED_PIPELINE_ID, sink=GATED_SINK, limit=10_000)
    assert sorted(c.epoch for c in commits) == sorted(result.gates["committed"]), (commits, result)
    assert sum(c.rows_committed or 0 for c in commits) == result.orders, (commits, result)
    page = _ui_page(airflow, f"/arroyo/pipelines/{GATED_PIPELINE_ID}")
    assert 'id="gate-table"' in page and "example_gate_check.check_orders" in page, page[:3000]


def _driver_pids(run_id: str) -> list[int]:
    """The Python driver process(es) of a run: ``python .../runtime/driver.py ... --run-id <run_id>``
    (spark-submit's JVM carries the same arguments; it is not the driver's Python process)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        args = [a.decode(errors="replace") for a in argv if a]
        if (args and "java" not in Path(args[0]).name and any(a.endswith("runtime/driver.py") for a in args)
                and run_id in args):
            found.append(int(entry.name))
    assert found, f"no driver process of run {run_id}"
    return found


def _ui_page(airflow: EmbeddedAirflow, path: str) -> str:
    """A page of the UI plugin, as the admin (the plugin accepts Airflow's JWT)."""
    with airflow._client() as client:
        resp = client.get(path, headers={"Authorization": f"Bearer {airflow.token()}"})
    assert resp.status_code == 200, (resp.status_code, resp.text[:500])
    return resp.text


def _report_dag_runs(airflow: EmbeddedAirflow, **params: str) -> list[dict[str, Any]]:
    """Every run of the report DAG the API lists with ``params``, page by page: a pipeline commits more often than
    one page holds."""
    runs: list[dict[str, Any]] = []
    while True:
        page = airflow.api("GET", f"/dags/{REPORT_DAG}/dagRuns", params={**params, "limit": 100, "offset": len(runs)})
        runs += page["dag_runs"]
        if not page["dag_runs"] or len(runs) >= page["total_entries"]:
            return runs


def _report_runs(airflow: EmbeddedAirflow) -> list[dict[str, Any]]:
    """What each successful run of the report DAG read (its XCom)."""
    out = []
    for run in _report_dag_runs(airflow, state="success"):
        entry = airflow.api("GET", f"/dags/{REPORT_DAG}/dagRuns/{run['dag_run_id']}/taskInstances/"
                                   "read_committed_report/xcomEntries/return_value", params={"deserialize": True})
        value = entry["value"]
        out.append(value if isinstance(value, dict) else ast.literal_eval(value))
    return out


def _report_run_states(airflow: EmbeddedAirflow) -> str:
    """Every run of the report DAG, whatever its state, with its task's state (for a failure's diagnosis)."""
    try:
        runs = _report_dag_runs(airflow)
        return "\n".join(f"{r['dag_run_id']}: {r['state']} {airflow.task_instances(REPORT_DAG, r['dag_run_id'])}"
                         for r in runs)
    except Exception as exc:  # noqa: BLE001 - a diagnosis must not hide the failure it explains
        return f"(could not list them: {exc!r})"


def _check_report(store: EpochStore, report: dict[str, Any]) -> None:
    """The report DAG read exactly the rows the sink committed up to the commit it was triggered by."""
    commits = [c for c in store.sink_commits(PIPELINE, sink=SINK_STAGE, limit=10_000) if c.seq <= report["seq"]]
    assert commits and commits[-1].batch_id == report["batch_id"] and commits[-1].epoch == report["epoch"], report
    assert report["rows"] == sum(c.rows_committed or 0 for c in commits) == report["distinct_ids"], (report, commits)


def _check_no_epoch_started_under_the_lock(dsn: str) -> None:
    """From the database's own history: no epoch was triggered between a lock acquisition and its release."""
    history = rows(dsn, "SELECT seq, at, kind, epoch, old_state, new_state, cleanup_run FROM arroyo_history"
                        " WHERE pipeline_id = %s ORDER BY seq", PIPELINE)
    windows: list[tuple[datetime, datetime, int]] = []
    open_at: dict[int, datetime] = {}
    for h in history:
        if h["kind"] == "lock_acquired":
            open_at[h["cleanup_run"]] = h["at"]
        elif h["kind"] == "lock_released" and h["cleanup_run"] in open_at:
            windows.append((open_at.pop(h["cleanup_run"]), h["at"], h["cleanup_run"]))
    assert windows and not open_at, history
    starts = [h["at"] for h in history if h["kind"] == "epoch_state" and h["old_state"] is None]
    for acquired, released, run in windows:
        inside = [s for s in starts if acquired < s < released]
        assert not inside, f"epochs started while cleanup run {run} held the lock: {inside}"
