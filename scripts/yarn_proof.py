#!/usr/bin/env python
"""The demo pipeline on YARN in cluster mode, supervised: a killed application comes back from its latest epoch.

A proof outside CI (issue 29, item 8; docs/clusters.md, "YARN: the mini-cluster proof"), run on one machine, all on
loopback:

1. Hadoop's mini-cluster (``scripts/MiniYarnHdfs.java`` on the ``minicluster`` artifact set, resolved here by name:
   one NameNode + DataNode, one ResourceManager + NodeManager in one JVM) writes ``core-site.xml`` /
   ``yarn-site.xml`` into a ``HADOOP_CONF_DIR``; a throwaway PostgreSQL is the epoch store.
2. ``SubmitPipelineOperator`` submits ``airflow_arroyo.examples.pipelines:demo`` with a Spark connection whose
   host is ``yarn`` and deploy mode ``cluster``, with a fixed-delay restart strategy: the driver runs in the
   application master's container, the DSN travels as a file through the application's HDFS staging folder. The
   operator is driven as Airflow would (execute, the trigger until the run is running, execute_complete, the
   supervisor trigger), with :class:`~airflow_arroyo.testing.CheckpointTicker` as the checkpoint controller.
3. Once epochs complete, the YARN application is killed through the ResourceManager's REST API
   (``PUT /ws/v1/cluster/apps/{id}/state {"state": "KILLED"}``, what ``yarn application -kill`` does). The
   supervisor sees the application end (the RM says KILLED), and the operator resubmits ``<lineage>.restart1`` with
   ``restore_from="latest"``: a new YARN application restores the latest completed epoch and runs to the end of
   the input; the report channel and the Parquet sink are checked row for row against plain Python.
4. A graceful stop ends the supervision; everything started is stopped (the mini-cluster and PostgreSQL by process
   group, any application left by the RM's REST kill).

How the driver gets the package in its container: the NodeManager runs on this machine, so the application uses
this checkout as a node would use an image with ``airflow-arroyo`` installed: ``cluster_python`` is this venv's
interpreter (the package is installed in it), the application is the installed ``driver.py`` by its path
(uploaded to the application's HDFS staging folder: a ``local://`` one is not found by the AM, see below),
``spark.yarn.jars`` names pyspark's jars as ``local:`` (nothing is uploaded) and ``PYSPARK_ARCHIVES_PATH`` names
this checkout and the venv's site-packages as ``local:`` (the pip pyspark has no ``python/lib/pyspark.zip``, which
Spark's YARN client otherwise requires for a Python application; its entries go on the containers' PYTHONPATH, so
the containers import the package from the checkout the script is in, e.g. a ``git archive`` of a commit). On a
real cluster: a packed environment in ``archives``
(docs/clusters.md, "YARN").

    .venv/bin/python scripts/yarn_proof.py [--rows 2000] [--rows-per-batch 50] [--keep]

Exit status 0 when every check held; the timings and the outcome are printed as one JSON object at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
# the package from this checkout, here and in the YARN containers (PYSPARK_ARCHIVES_PATH below), before the venv's
# install: the script can then prove a clean export of a commit while the venv's editable install is edited
sys.path.insert(0, str(ROOT))
PID = "on-yarn"
CONN = "arroyo_yarn_proof"
SPARK = "spark_yarn_proof"
T0 = time.monotonic()
TIMINGS: dict[str, float] = {}


def say(message: str) -> None:
    """A progress line, with the seconds since the script started."""
    print(f"[yarn_proof {time.monotonic() - T0:7.1f}s] {message}", flush=True)


def mark(name: str) -> None:
    """Record the time a phase ended."""
    TIMINGS[name] = round(time.monotonic() - T0, 1)
    say(f"-- {name}")


class _TI:
    """The task-instance calls the operator makes (as tests/airflow does: no metadata database needed)."""

    dag_id = "yarn_proof"
    run_id = "manual__2026-01-01T00:00:00+00:00"
    try_number = 1

    def __init__(self) -> None:
        self.xcom: dict[str, Any] = {}

    def xcom_push(self, key: str, value: Any) -> None:
        self.xcom[key] = value


def _environment(base: Path) -> None:
    """Airflow's and Spark's environment, before anything imports Airflow."""
    home = base / "airflow"
    home.mkdir(parents=True)
    (base / "dags").mkdir()
    os.environ.update({
        "AIRFLOW_HOME": str(home), "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{home}/airflow.db",
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False", "AIRFLOW__CORE__UNIT_TEST_MODE": "False",
        "AIRFLOW__CORE__DAGS_FOLDER": str(base / "dags"), "AIRFLOW__OPERATORS__DEFAULT_DEFERRABLE": "True",
        "PYSPARK_PYTHON": sys.executable, "PYSPARK_DRIVER_PYTHON": sys.executable,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        "PATH": str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", ""),
    })


def _stop_group(proc: subprocess.Popen[bytes], what: str, grace: float = 30.0) -> None:
    """SIGTERM the process group of ``proc`` (its own session), SIGKILL after ``grace`` seconds."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        say(f"{what} did not stop in {grace:g}s: SIGKILL to its group")
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
    except ProcessLookupError:
        pass


def _rm(rm_web: str, path: str, method: str = "GET", body: dict[str, Any] | None = None) -> Any:
    request = urllib.request.Request(
        f"{rm_web}/ws/v1/cluster/{path}", method=method, data=json.dumps(body).encode() if body else None,
        headers={"Content-Type": "application/json", "Accept": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read() or b"null")


def _app_state(rm_web: str, app_id: str) -> str:
    return str(_rm(rm_web, f"apps/{app_id}")["app"]["state"])


def _kill_app(rm_web: str, app_id: str) -> None:
    _rm(rm_web, f"apps/{app_id}/state", "PUT", {"state": "KILLED"})


def _running_apps(rm_web: str) -> list[str]:
    apps = (_rm(rm_web, "apps?states=NEW,NEW_SAVING,SUBMITTED,ACCEPTED,RUNNING") or {}).get("apps") or {}
    return [str(a["id"]) for a in apps.get("app", [])]


def _start_minicluster(base: Path, nm_memory_mb: int) -> tuple[subprocess.Popen[bytes], Path, str]:
    """Resolve the ``minicluster`` set (once per version of its pom) and start HDFS + YARN; the process, the
    ``HADOOP_CONF_DIR`` and the ResourceManager's web address."""
    from airflow_arroyo.jvm import artifacts

    folder = artifacts.resolve(artifacts.MINICLUSTER)
    conf_dir = base / "hadoop-conf"
    log = open(base / "minicluster.log", "wb")  # noqa: SIM115 - the launcher's output for its whole life
    proc = subprocess.Popen(
        ["java", "-Xmx1g", "-cp", f"{folder}/*", str(ROOT / "scripts" / "MiniYarnHdfs.java"), str(base / "mini"),
         str(conf_dir), str(nm_memory_mb)],
        stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=base)
    deadline = time.monotonic() + 240
    while not (conf_dir / "ready").is_file():
        if proc.poll() is not None:
            raise RuntimeError(f"the mini-cluster exited ({proc.returncode}): see {base / 'minicluster.log'}")
        if time.monotonic() > deadline:
            _stop_group(proc, "the mini-cluster")
            raise RuntimeError(f"the mini-cluster was not up in 240 s: see {base / 'minicluster.log'}")
        time.sleep(0.5)
    web, default_fs = (conf_dir / "ready").read_text().split()[:2]
    rm_web = "http://" + web.replace("localhost", "127.0.0.1")
    say(f"mini-cluster up: HDFS {default_fs}, ResourceManager {rm_web}; HADOOP_CONF_DIR={conf_dir}")
    return proc, conf_dir, rm_web


def _wait(condition: Callable[[], Any], timeout: float, what: str, interval: float = 0.5) -> Any:
    from airflow_arroyo.testing import wait_for

    return wait_for(condition, timeout=timeout, interval=interval, what=what)


def prove(base: Path, rows: int, rows_per_batch: int, nm_memory_mb: int) -> dict[str, Any]:
    """The proof (the module's docstring), in ``base``; what happened, or an ``AssertionError`` naming what did not."""
    _environment(base)
    import pyspark
    from airflow.sdk.exceptions import TaskDeferred

    import airflow_arroyo.runtime.driver as driver_module
    import airflow_arroyo.triggers.settle as settle
    from airflow_arroyo.core.epochs import PipelineState
    from airflow_arroyo.devtools.postgres import ThrowawayPostgres
    from airflow_arroyo.examples import OUTPUT_CHANNEL, expected_report
    from airflow_arroyo.operators.pipeline import SubmitPipelineOperator
    from airflow_arroyo.runtime.layout import StorageLayout
    from airflow_arroyo.store import EpochStore
    from airflow_arroyo.testing import CheckpointTicker, channel_row_count, channel_rows, committed_rows
    from airflow_arroyo.triggers.supervise import PipelineSupervisorTrigger

    settle.DEFER_SETTLE_S = 0.0  # no scheduler to race here (tests/airflow does the same)
    result: dict[str, Any] = {"rows": rows, "rows_per_batch": rows_per_batch, "base": str(base)}
    started: list[subprocess.Popen[bytes]] = []
    pg = ThrowawayPostgres()  # a folder of its own (as root, initdb runs as postgres: not under 0700 ``base``)
    rm_web = ""
    ticker: CheckpointTicker | None = None
    try:
        cluster, conf_dir, rm_web = _start_minicluster(base, nm_memory_mb)
        started.append(cluster)
        mark("minicluster_up")
        pg.init()
        pg.start()
        store = EpochStore(pg.dsn)
        store.migrate()
        mark("postgres_up")

        site_packages = Path(pyspark.__file__).resolve().parents[1]
        os.environ.update({
            "HADOOP_CONF_DIR": str(conf_dir), "YARN_CONF_DIR": str(conf_dir),
            # the pip pyspark has no python/lib/pyspark.zip, which Spark's YARN client requires for a Python
            # application unless this names the archives: the venv's site-packages, local to every "node" here
            # (Spark puts them on the PYTHONPATH of the AM's and the executors' containers; this checkout first)
            "PYSPARK_ARCHIVES_PATH": f"local:{ROOT},local:{site_packages}",
            f"AIRFLOW_CONN_{CONN.upper()}": pg.dsn,
            f"AIRFLOW_CONN_{SPARK.upper()}": json.dumps({
                "conn_type": "spark", "host": "yarn",
                "extra": {"deploy-mode": "cluster", "yarn_resourcemanager_webapp_address": rm_web}}),
        })
        layout = StorageLayout.at(str(base / "storage"), PID)
        expected = expected_report(rows)
        op = SubmitPipelineOperator(
            task_id="submit", pipeline="airflow_arroyo.examples.pipelines:demo", pipeline_id=PID,
            pipeline_args={"pipeline_id": PID, "rows": rows, "rows_per_batch": rows_per_batch,
                           "sink_path": str(base / "report_files")},
            storage_uri=str(base / "storage"), conn_id=CONN, spark_conn_id=SPARK,
            # a path without a scheme: spark-submit uploads it to the application's HDFS staging folder and YARN
            # localizes it into the AM's container. A local:// application does not work for Python in YARN cluster
            # mode: the AM runs `--primary-py-file <basename>` from its working folder, where nothing localized it
            # ("can't open file '.../container_..._000001/driver.py'", Spark's yarn Client.scala).
            application=str(Path(driver_module.__file__).resolve()), cluster_python=sys.executable,
            conf={"spark.yarn.jars": f"local:{site_packages / 'pyspark' / 'jars'}/*",
                  # one attempt: YARN must not bring the application back itself; the supervisor's strategy does
                  "spark.yarn.maxAppAttempts": "1",
                  "spark.executor.instances": "1", "spark.executor.cores": "2", "spark.executor.memory": "768m",
                  "spark.driver.memory": "768m", "spark.sql.shuffle.partitions": "2"},
            submit_log_dir=str(base / "logs"), register_timeout=300, poll_interval=1.0,
            restart_strategy={"type": "fixed-delay", "attempts": 2, "delay": 1},
            heartbeat_timeout=120, supervise_interval=1.0,
        )
        ti = _TI()
        ticker = CheckpointTicker(store, PID, interval=2.0, timeout=90.0, tick=0.25).__enter__()

        # 1. submit on YARN, until the run is running; then the supervisor watches it
        say("submitting the demo to YARN (cluster mode) through SubmitPipelineOperator")
        first = _deferred(TaskDeferred, op.execute, {"ti": ti})
        event = _run_trigger(first.trigger)
        if event["status"] != "success":
            raise AssertionError(f"the first run did not reach running: {event}")
        app1 = str(ti.xcom["cluster_application"]["application_id"])
        result["application_1"] = app1
        mark("run1_running")
        supervised = _deferred(TaskDeferred, op.execute_complete, {"ti": ti}, event, **first.kwargs)
        assert isinstance(supervised.trigger, PipelineSupervisorTrigger), supervised.trigger
        lineage = str(supervised.trigger.lineage)
        say(f"run {lineage} running as YARN application {app1} ({_app_state(rm_web, app1)}); supervised")
        _wait(lambda: (e := store.latest_completed_epoch(PID)) is not None and e.epoch >= 2, 300,
              "two completed epochs on YARN")
        mark("run1_two_epochs")

        # 2. kill the YARN application (the ResourceManager's REST kill: yarn application -kill)
        before = store.latest_completed_epoch(PID)
        assert before is not None
        rows_before = channel_row_count(layout.channel_uri(OUTPUT_CHANNEL))
        say(f"killing {app1}: latest completed epoch {before.epoch}, {rows_before} report rows so far")
        _kill_app(rm_web, app1)
        _wait(lambda: _app_state(rm_web, app1) == "KILLED", 60, f"{app1} KILLED")
        result.update(killed_after_epoch=before.epoch, report_rows_at_kill=rows_before)
        mark("app1_killed")

        # 3. the supervisor notices, the strategy restarts it from the latest completed epoch
        event = _run_trigger(supervised.trigger)
        say(f"supervisor: {event.get('status')} (attempt {event.get('attempt')}): {event.get('cause')}")
        if event["status"] != "restart":
            raise AssertionError(f"the supervisor did not decide a restart: {event}")
        mark("supervisor_restart_decided")
        latest = store.latest_completed_epoch(PID)
        restarted = _deferred(TaskDeferred, op.supervise_complete, {"ti": ti}, event, **supervised.kwargs)
        trigger = restarted.trigger
        assert isinstance(trigger, PipelineSupervisorTrigger)
        app2 = str(ti.xcom["cluster_application"]["application_id"])
        result.update(application_2=app2, restart_run_id=trigger.run_id)
        say(f"resubmitted as run {trigger.run_id}, YARN application {app2}")
        _wait(lambda: store.get_pipeline(PID).run_id == trigger.run_id
              and store.get_pipeline(PID).state is PipelineState.RUNNING, 300, "the restart to run")
        mark("run2_running")
        record = store.get_pipeline(PID)
        [restart] = store.restarts(PID)
        result.update(restored_from_epoch=record.restored_from_epoch, restart_record={
            "attempt": restart.attempt, "restored_epoch": restart.restored_epoch, "cause": restart.cause})
        assert latest is not None and record.restored_from_epoch == latest.epoch == restart.restored_epoch, (
            record.restored_from_epoch, latest, restart)
        assert app2 != app1 and _app_state(rm_web, app2) == "RUNNING"
        _wait(lambda: channel_row_count(layout.channel_uri(OUTPUT_CHANNEL)) >= len(expected), 600,
              "the restored run to reach the end of the input", interval=1.0)
        mark("run2_end_of_input")

        # 4. a graceful stop ends the supervision
        store.request_stop(PID, "graceful")
        event = _run_trigger(trigger)
        assert event["status"] == "stopped", event
        assert op.supervise_complete({"ti": ti}, event, **restarted.kwargs) == lineage  # type: ignore[typeddict-item]
        mark("stopped")
        # the driver stopped its queries and recorded it; its application then ends on its own (SparkContext stop,
        # the AM unregistering): bounded, and what YARN says is part of the outcome
        result["application_2_final"] = _wait(
            lambda: (state := _app_state(rm_web, app2)) in ("FINISHED", "FAILED", "KILLED") and state, 120,
            f"{app2} to end after the graceful stop", interval=1.0)
        mark("app2_ended")
        final = store.get_pipeline(PID)
        result.update(final_state=final.state.value, supervision=final.supervision,
                      latest_epoch=(e.epoch if (e := store.latest_completed_epoch(PID)) else None))
        report = channel_rows(layout.channel_uri(OUTPUT_CHANNEL))
        sink = committed_rows(base / "report_files")
        result.update(report_rows=len(report), expected_rows=len(expected), report_exact=report == expected,
                      sink_exact=Counter(sink) == Counter(expected))
        assert final.state is PipelineState.STOPPED, final.failure_cause
        assert report == expected, "the report channel is not exactly the expected rows"
        assert Counter(sink) == Counter(expected), "the Parquet sink is not exactly the expected rows"
        result["ok"] = True
        return result
    finally:
        if ticker is not None:
            ticker.stop()
            if ticker.errors:
                say(f"checkpoint ticker errors: {ticker.errors[:3]}")
        if rm_web:
            try:
                for app in _running_apps(rm_web):
                    say(f"killing {app}, still running")
                    _kill_app(rm_web, app)
            except OSError as exc:
                say(f"could not list or kill applications: {exc}")
        for proc in started:
            _stop_group(proc, "the mini-cluster")
        pg.cleanup()
        result["timings_s"] = dict(TIMINGS)


def _deferred(kind: type[BaseException], call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Run ``call``; the ``TaskDeferred`` it raises (Airflow would hand it to the triggerer)."""
    try:
        call(*args, **kwargs)
    except kind as deferred:
        return deferred
    raise AssertionError(f"{call.__name__} did not defer")


def _run_trigger(trigger: Any) -> dict[str, Any]:
    """The trigger's first event, as the triggerer would run it."""
    import asyncio

    async def first() -> dict[str, Any]:
        async for event in trigger.run():
            return dict(event.payload)
        raise AssertionError("the trigger ended without an event")

    return asyncio.run(first())


def main(argv: list[str] | None = None) -> int:
    """Run the proof once; 0 when every check held."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=2000, help="the demo's input rows (default 2000)")
    parser.add_argument("--rows-per-batch", type=int, default=50, help="rows per source micro-batch (default 50)")
    parser.add_argument("--nm-memory-mb", type=int, default=4096,
                        help="the NodeManager's memory for containers (default 4096)")
    parser.add_argument("--keep", action="store_true", help="keep the working folder (logs, storage) at the end")
    args = parser.parse_args(argv)
    base = Path(tempfile.mkdtemp(prefix="arroyo-yarn-"))
    say(f"working folder {base}")
    result: dict[str, Any] = {"ok": False}
    try:
        result = prove(base, args.rows, args.rows_per_batch, args.nm_memory_mb)
    except BaseException as exc:  # noqa: BLE001 - reported with the timings, then the exit status says it
        result.update(ok=False, error=f"{type(exc).__name__}: {exc}"[:4000], timings_s=dict(TIMINGS),
                      logs=str(base), kept=True)
        print(json.dumps(result, indent=2, default=str))
        return 1
    finally:
        if not args.keep and result.get("ok"):
            shutil.rmtree(base, ignore_errors=True)
    result["total_s"] = round(time.monotonic() - T0, 1)
    print(json.dumps(result, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
