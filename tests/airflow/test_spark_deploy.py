"""Cluster deploy modes: the spark-submit command of each cluster manager and deploy mode, built by the
provider's real ``SparkSubmitHook`` from real Airflow connections; the DSN never on it; cluster runs
found in spark-submit's output by the provider's parser, tracked and killed through their cluster
manager. No YARN or Kubernetes here: the YARN ResourceManager is a small HTTP server speaking its REST
API (``/ws/v1/cluster/apps/{id}``, the calls the provider makes), which records what it was asked.
"""

from __future__ import annotations

import asyncio
import json
import os
import stat
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from airflow_arroyo.core.epochs import PipelineState
from airflow_arroyo.core.exceptions import ArroyoError, ConfigurationError
from airflow_arroyo.operators.pipeline import DRIVER_APPLICATION, SubmitPipelineOperator, _write_private
from airflow_arroyo.runtime.driver import dsn_from_environment
from airflow_arroyo.store import EpochStore
from airflow_arroyo.submit.deploy import (
    CLUSTER_DRIVER_APPLICATION,
    DSN_FILE_ALIAS,
    ClusterApplication,
    ClusterManager,
    DeployTarget,
    plan_submit,
)
from airflow_arroyo.triggers.pipeline import PipelineStateTrigger, stop_run

DSN = "postgresql://arroyo:s3cret-pw@db.internal:5432/arroyo"
PID = "orders"


def _conn(monkeypatch: pytest.MonkeyPatch, conn_id: str, host: str, **extra: Any) -> str:
    monkeypatch.setenv(f"AIRFLOW_CONN_{conn_id.upper()}", json.dumps({"conn_type": "spark", "host": host,
                                                                      "extra": extra}))
    return conn_id


def _op(spark_conn_id: str, **kwargs: Any) -> SubmitPipelineOperator:
    return SubmitPipelineOperator(task_id="submit", pipeline=f"pkg.pipes:{PID}", pipeline_id=PID,
                                  spark_conn_id=spark_conn_id, **kwargs)


def _no_secret(command: list[str], env: dict[str, str]) -> None:
    assert all("s3cret" not in part for part in command), command
    assert all("s3cret" not in f"{k}={v}" for k, v in env.items() if k != "ARROYO_DSN")


def _confs(command: list[str]) -> dict[str, str]:
    return dict(command[i + 1].split("=", 1) for i, part in enumerate(command) if part == "--conf")


# --------------------------------------------------------------------------- the commands


def test_standalone_client_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    conn = _conn(monkeypatch, "spark_sa", "spark://10.0.0.5:7077")
    command, env, cluster, _, secret = _op(conn).build_spark_submit("r1", None, DSN)
    assert cluster is False and secret is None
    assert command[1:3] == ["--master", "spark://10.0.0.5:7077"] and "--deploy-mode" not in command
    assert command[command.index(DRIVER_APPLICATION) + 1:][:4] == ["--pipeline", f"pkg.pipes:{PID}", "--run-id", "r1"]
    _no_secret(command, env)
    assert env["ARROYO_DSN"] == DSN  # the driver runs here: the process environment only
    assert env["PYSPARK_DRIVER_PYTHON"] == sys.executable and env["PYSPARK_PYTHON"] == sys.executable
    assert _confs(command)["spark.pyspark.driver.python"] == sys.executable


def test_a_driver_class_path_stays_with_the_providers_jar(monkeypatch: pytest.MonkeyPatch) -> None:
    """--driver-class-path is spark.driver.extraClassPath and the hook writes it after the --confs: it would
    drop the provider's jar while fs.file.impl names its class. It travels as the conf, the jar after it."""
    from airflow_arroyo.jvm import FS_IMPL_CONF, JAR, LOCAL_FILE_SYSTEM

    conn = _conn(monkeypatch, "spark_local", "local[2]")
    command, *_ = _op(conn, spark_submit_kwargs={"driver_class_path": "/opt/mine.jar"}).build_spark_submit(
        "r1", None, DSN)
    assert "--driver-class-path" not in command
    assert _confs(command)["spark.driver.extraClassPath"] == f"/opt/mine.jar{os.pathsep}{JAR}"
    assert _confs(command)[FS_IMPL_CONF] == LOCAL_FILE_SYSTEM
    conn = _conn(monkeypatch, "spark_sa", "spark://10.0.0.5:7077")
    command, *_ = _op(conn, spark_submit_kwargs={"driver_class_path": "/opt/mine.jar"}).build_spark_submit(
        "r1", None, DSN)
    # a standalone driver gets the jar too (the socket's SocketPathPruner), not the file system
    assert _confs(command)["spark.driver.extraClassPath"] == f"/opt/mine.jar{os.pathsep}{JAR}"
    assert FS_IMPL_CONF not in _confs(command)


def test_standalone_executors_get_the_socket_path_plugin_after_the_users_jars_and_plugins(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Executors on a standalone master register a socket path per Python transformWithState task: the jar's
    plugin prunes their delete-on-exit lists, shipped in spark.jars (--jars would win over that conf: it travels
    as the conf, the jar after the user's). A local master's one JVM is the driver's own pruner's: no plugin."""
    from airflow_arroyo.jvm import JAR, SOCKET_PATHS_PLUGIN, artifacts

    # the provider's jar, then the resolved Kafka/S3A set (issue 29), after the user's
    ours = ",".join([str(JAR), *map(str, artifacts.resolved_jars(artifacts.SPARK))])
    conn = _conn(monkeypatch, "spark_sa", "spark://10.0.0.5:7077")
    op = _op(conn, spark_submit_kwargs={"jars": "/opt/a.jar,/opt/b.jar"},
             conf={"spark.plugins": "com.acme.Plugin"})
    command, *_ = op.build_spark_submit("r1", None, DSN)
    assert "--jars" not in command
    confs = _confs(command)
    assert confs["spark.jars"] == f"/opt/a.jar,/opt/b.jar,{ours}"
    assert confs["spark.plugins"] == f"com.acme.Plugin,{SOCKET_PATHS_PLUGIN}"
    command, *_ = _op(conn).build_spark_submit("r1", None, DSN)
    assert _confs(command)["spark.jars"] == ours and _confs(command)["spark.plugins"] == SOCKET_PATHS_PLUGIN
    # the socket turned off: nothing to prune, no plugin nor the provider's jar (the Kafka/S3A set stays)
    resolved = ",".join(map(str, artifacts.resolved_jars(artifacts.SPARK)))
    command, *_ = _op(conn, conf={"spark.python.unix.domain.socket.enabled": "false"}).build_spark_submit(
        "r1", None, DSN)
    assert "spark.plugins" not in _confs(command) and _confs(command).get("spark.jars", "") == resolved
    conn = _conn(monkeypatch, "spark_local", "local[2]")
    command, *_ = _op(conn, spark_submit_kwargs={"jars": "/opt/a.jar"}).build_spark_submit("r1", None, DSN)
    assert "spark.plugins" not in _confs(command)
    assert _confs(command)["spark.jars"] == ",".join(filter(None, ["/opt/a.jar", resolved]))


def test_yarn_client_mode_keeps_the_dsn_off_the_command_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """The provider sends env_vars to YARN as spark.yarn.appMasterEnv.* --conf values: the DSN must not
    go that way (the driver runs here in client mode)."""
    conn = _conn(monkeypatch, "spark_yc", "yarn", queue="streaming")
    command, env, cluster, _, _ = _op(conn, cluster_python="/opt/venv/bin/python",
                                      env_vars={"TZ": "UTC"}).build_spark_submit("r1", None, DSN)
    assert cluster is False
    _no_secret(command, env)
    assert env["ARROYO_DSN"] == DSN and not any("ARROYO_DSN" in part for part in command)
    confs = _confs(command)
    assert confs["spark.pyspark.python"] == "/opt/venv/bin/python"  # executors: the cluster's interpreter
    assert confs["spark.pyspark.driver.python"] == sys.executable  # the driver: this one
    assert confs["spark.yarn.appMasterEnv.TZ"] == "UTC"  # the user's env_vars still travel the provider's way


def test_yarn_cluster_mode(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    conn = _conn(monkeypatch, "spark_yarn", "yarn", **{"deploy-mode": "cluster", "queue": "q"})
    monkeypatch.setenv("PYSPARK_PYTHON", "/home/airflow/.venv/bin/python")  # the worker's: must not leak
    op = _op(conn, cluster_python="./environment/bin/python", spark_submit_kwargs={"files": "hdfs:///conf/app.ini"})
    command, env, cluster, hook, secret = op.build_spark_submit("r1", "latest", DSN, secret_dir=str(tmp_path))
    assert cluster is True
    assert command[1:3] == ["--master", "yarn"] and command[command.index("--deploy-mode") + 1] == "cluster"
    assert CLUSTER_DRIVER_APPLICATION in command and DRIVER_APPLICATION not in command  # no worker path
    assert command[command.index("--files") + 1] == f"hdfs:///conf/app.ini,{tmp_path}/{DSN_FILE_ALIAS}#{DSN_FILE_ALIAS}"
    confs = _confs(command)
    assert confs["spark.yarn.appMasterEnv.ARROYO_DSN_FILE"] == DSN_FILE_ALIAS
    assert confs["spark.yarn.submit.waitAppCompletion"] == "false"  # spark-submit returns once accepted
    assert confs["spark.pyspark.python"] == confs["spark.pyspark.driver.python"] == "./environment/bin/python"
    # the DSN: in the file only (written 0600 by execute, then deleted), nowhere else
    assert secret == (f"{tmp_path}/{DSN_FILE_ALIAS}", DSN)
    _no_secret(command, env)
    assert "ARROYO_DSN" not in env and "PYSPARK_PYTHON" not in env and "PYSPARK_DRIVER_PYTHON" not in env
    assert hook._mask_cmd(command).count("s3cret") == 0


def test_kubernetes_cluster_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    conn = _conn(monkeypatch, "spark_k8s", "k8s://https://k8s.example:6443", **{"deploy-mode": "cluster",
                                                                                 "namespace": "spark"})
    op = _op(conn, dsn_secret="arroyo-store:dsn", conf={"spark.kubernetes.container.image": "acme/arroyo:1"})
    command, env, cluster, _, secret = op.build_spark_submit("r1", None, DSN)
    assert cluster is True and secret is None
    assert command[1:3] == ["--master", "k8s://https://k8s.example:6443"]
    assert CLUSTER_DRIVER_APPLICATION in command and DRIVER_APPLICATION not in command
    confs = _confs(command)
    assert confs["spark.kubernetes.driver.secretKeyRef.ARROYO_DSN"] == "arroyo-store:dsn"
    assert confs["spark.kubernetes.namespace"] == "spark"
    assert confs["spark.kubernetes.submission.waitAppCompletion"] == "false"
    assert "spark.pyspark.python" not in confs  # the image's python3 unless told
    _no_secret(command, env)
    assert "ARROYO_DSN" not in env and "PYSPARK_PYTHON" not in env
    # a user application (e.g. another path in the image) wins
    command, *_ = _op(conn, dsn_secret="s:k", application="local:///app/driver.py").build_spark_submit("r", None, DSN)
    assert "local:///app/driver.py" in command


def test_kubernetes_cluster_mode_needs_a_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    conn = _conn(monkeypatch, "spark_k8s", "k8s://https://k8s.example:6443", **{"deploy-mode": "cluster",
                                                                                 "namespace": "spark"})
    for bad in (None, "no-key", ":dsn"):
        with pytest.raises(ConfigurationError, match="dsn_secret='arroyo-store:dsn'"):
            _op(conn, dsn_secret=bad).build_spark_submit("r1", None, DSN)


def test_standalone_cluster_mode_is_refused_with_the_way_out(monkeypatch: pytest.MonkeyPatch) -> None:
    conn = _conn(monkeypatch, "spark_sac", "spark://10.0.0.5:7077", **{"deploy-mode": "cluster"})
    with pytest.raises(ConfigurationError, match="use client mode"):
        _op(conn).build_spark_submit("r1", None, DSN)


@pytest.mark.parametrize(("master", "mode", "manager", "cluster"), [
    ("local[2]", None, ClusterManager.LOCAL, False), ("spark://h:7077", "client", ClusterManager.STANDALONE, False),
    ("yarn", "cluster", ClusterManager.YARN, True), ("k8s://https://h", "cluster", ClusterManager.KUBERNETES, True),
])
def test_deploy_target(master: str, mode: str | None, manager: ClusterManager, cluster: bool) -> None:
    target = DeployTarget.of(master, mode)
    assert (target.manager, target.cluster_mode) == (manager, cluster)
    plan = plan_submit(target, dsn=DSN, driver_application="/x/driver.py", dsn_secret="s:k", secret_dir="/private")
    assert DSN not in json.dumps(plan.conf) and DSN not in plan.application


def test_dsn_file_is_private_and_the_driver_reads_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / DSN_FILE_ALIAS
    _write_private(str(path), DSN)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    monkeypatch.delenv("ARROYO_DSN", raising=False)
    monkeypatch.chdir(tmp_path)  # a YARN container's working directory holds the --files
    monkeypatch.setenv("ARROYO_DSN_FILE", DSN_FILE_ALIAS)
    assert dsn_from_environment() == DSN
    monkeypatch.setenv("ARROYO_DSN_FILE", "missing")
    with pytest.raises(ConfigurationError, match="ARROYO_DSN_FILE='missing'"):
        dsn_from_environment()


# --------------------------------------------------------------------------- finding a cluster run

YARN_OUTPUT = """\
26/11/23 13:00:01 INFO Client: Requesting a new application from cluster with 3 NodeManagers
26/11/23 13:00:02 INFO Client: Submitting application application_1763900000000_0042 to ResourceManager
26/11/23 13:00:02 INFO YarnClientImpl: Submitted application application_1763900000000_0042
26/11/23 13:00:03 INFO Client: Application report for application_1763900000000_0042 (state: ACCEPTED)
"""
K8S_OUTPUT = (  # the pod status watcher indents its fields with a tab
    "26/11/23 13:00:05 INFO LoggingPodStatusWatcherImpl: State changed, new state:\n"
    "\t pod name: arroyo-orders-7f3c2a9e1b0d4c55-driver\n"
    "\t namespace: spark\n"
    "\t labels: spark-app-name -> arroyo-orders, spark-app-selector -> spark-5d1e9c0a7b3f4e21, spark-role -> driver\n"
    "26/11/23 13:00:06 INFO LoggingPodStatusWatcherImpl: Deployed Spark application arroyo-orders into Kubernetes\n"
)


def test_cluster_application_from_the_providers_parser(monkeypatch: pytest.MonkeyPatch) -> None:
    yarn = _conn(monkeypatch, "spark_yarn", "yarn", **{"deploy-mode": "cluster"})
    hook = _op(yarn).build_spark_submit("r", None, DSN, secret_dir="/private").hook
    app = ClusterApplication.from_submit_output(hook, YARN_OUTPUT.splitlines(), yarn)
    assert (app.manager, app.application_id) == ("yarn", "application_1763900000000_0042")
    k8s = _conn(monkeypatch, "spark_k8s", "k8s://https://h:6443", **{"deploy-mode": "cluster", "namespace": "spark"})
    hook = _op(k8s, dsn_secret="s:k").build_spark_submit("r", None, DSN).hook
    app = ClusterApplication.from_submit_output(hook, K8S_OUTPUT.splitlines(), k8s)
    assert (app.driver_pod, app.namespace, app.application_id) == (
        "arroyo-orders-7f3c2a9e1b0d4c55-driver", "spark", "spark-5d1e9c0a7b3f4e21")
    assert ClusterApplication.from_dict(app.to_dict()) == app
    fresh = _op(k8s, dsn_secret="s:k").build_spark_submit("r", None, DSN).hook
    with pytest.raises(ConfigurationError, match="names no"):
        ClusterApplication.from_submit_output(fresh, ["nothing useful"], k8s)


def test_cluster_submission_waits_for_spark_submit_and_reports_its_failure(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """_await_cluster_submission: spark-submit's exit (here a stand-in process printing what YARN's
    client prints) gives the handle; a non-zero exit fails with its output."""
    import subprocess

    yarn = _conn(monkeypatch, "spark_yarn", "yarn", **{"deploy-mode": "cluster"})
    op = _op(yarn, register_timeout=60)
    submit_cmd = op.build_spark_submit("r", None, DSN, secret_dir=str(tmp_path))
    for code, expect in ((0, "application_1763900000000_0042"), (1, "exit code 1")):
        log = tmp_path / f"submit-{code}.log"
        with open(log, "wb") as out:
            script = f"import sys; print({YARN_OUTPUT!r}); sys.exit({code})"
            op._popen = subprocess.Popen([sys.executable, "-c", script], stdout=out)
        if code == 0:
            assert op._await_cluster_submission(submit_cmd, log).application_id == expect
        else:
            with pytest.raises(ArroyoError, match=expect):
                op._await_cluster_submission(submit_cmd, log)


# --------------------------------------------------------------------------- tracking and killing on YARN


class _ResourceManager(BaseHTTPRequestHandler):
    """The two ResourceManager REST calls the provider makes: GET an application's report, PUT its state."""

    apps: dict[str, dict[str, str]] = {}
    kills: list[str] = []

    def _reply(self, code: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        app_id = self.path.rstrip("/").rsplit("/", 1)[-1]
        if app_id not in self.apps:
            self._reply(404, {"RemoteException": {"message": f"no {app_id}"}})
            return
        self._reply(200, {"app": {"id": app_id, **self.apps[app_id]}})

    def do_PUT(self) -> None:
        app_id = self.path.rstrip("/").split("/")[-2]
        length = int(self.headers.get("Content-Length", 0))
        assert json.loads(self.rfile.read(length)) == {"state": "KILLED"}
        self.kills.append(app_id)
        self.apps[app_id] = {"state": "KILLED", "finalStatus": "KILLED", "diagnostics": "Application killed by user."}
        self._reply(202, {"state": "KILLED"})

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def resource_manager() -> Iterator[str]:
    _ResourceManager.apps, _ResourceManager.kills = {}, []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _ResourceManager)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_yarn_run_that_dies_before_registering_is_reported_with_the_rm_diagnostics(
    store: EpochStore, resource_manager: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AIRFLOW_CONN_ARROYO_T", store.dsn)
    yarn = _conn(monkeypatch, "spark_yarn", "yarn", **{"deploy-mode": "cluster",
                                                       "yarn_resourcemanager_webapp_address": resource_manager})
    app = ClusterApplication("yarn", yarn, application_id="application_1_0001")
    _ResourceManager.apps["application_1_0001"] = {"state": "FAILED", "finalStatus": "FAILED",
                                                    "diagnostics": "AM container exited with exitCode: 2"}
    trigger = PipelineStateTrigger(pipeline_id=PID, state="running", run_id="r1", conn_id="arroyo_t",
                                   poll_interval=0.05, submit_exits=True, cluster_application=app.to_dict(),
                                   cluster_poll_interval=0.0)
    assert PipelineStateTrigger(**trigger.serialize()[1]).cluster_application == app.to_dict()

    async def first() -> dict[str, Any]:
        async for event in trigger.run():
            return event.payload
        raise AssertionError("no event")

    event = asyncio.run(first())
    assert event["status"] == "unreachable" and "exitCode: 2" in event["message"], event


def test_killing_a_yarn_run_goes_through_the_resource_manager(
    store: EpochStore, resource_manager: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    yarn = _conn(monkeypatch, "spark_yarn", "yarn", **{"deploy-mode": "cluster",
                                                       "yarn_resourcemanager_webapp_address": resource_manager})
    _ResourceManager.apps["application_1_0002"] = {"state": "RUNNING", "finalStatus": "UNDEFINED", "diagnostics": ""}
    app = ClusterApplication("yarn", yarn, application_id="application_1_0002")
    assert app.status() == (False, "YARN application application_1_0002 is RUNNING (final status UNDEFINED)")
    store.register_pipeline(PID, stages=["a"], run_id="r1")
    store.set_pipeline_state(PID, PipelineState.RUNNING)

    class _Log:
        def info(self, *a: Any) -> None: ...
        def warning(self, *a: Any) -> None: ...

    # the driver does not stop by itself within the grace period: the RM kills the application
    stop_run(store, PID, "r1", None, log=_Log(), grace=0.3, cluster_app=app)
    assert store.get_pipeline(PID).stop_requested == "immediate"
    assert _ResourceManager.kills == ["application_1_0002"]
    assert app.status() is not None and app.status()[0] is True  # type: ignore[index]
    # a run that stopped by itself in time is not killed
    store.set_pipeline_state(PID, PipelineState.STOPPED)
    stop_run(store, PID, "r1", None, log=_Log(), grace=0.3, cluster_app=app)
    assert _ResourceManager.kills == ["application_1_0002"]


def test_no_rm_address_means_status_unknown(monkeypatch: pytest.MonkeyPatch) -> None:
    yarn = _conn(monkeypatch, "spark_yarn", "yarn", **{"deploy-mode": "cluster"})
    assert ClusterApplication("yarn", yarn, application_id="application_1_0003").status() is None
    assert os.environ  # the connection came from the environment only


def test_kubernetes_run_without_a_reachable_cluster(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No Kubernetes configuration here: the status is unknown (the trigger keeps waiting on the store)
    and a kill is logged, not raised (the stop request in the store stands)."""
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "none"))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    k8s = _conn(monkeypatch, "spark_k8s", "k8s://https://127.0.0.1:1", **{"deploy-mode": "cluster",
                                                                          "namespace": "spark"})
    app = ClusterApplication("kubernetes", k8s, driver_pod="arroyo-orders-1-driver", namespace="spark")
    assert app.status() is None
    warnings: list[str] = []

    class _Log:
        def info(self, *a: Any) -> None: ...
        def warning(self, msg: str, *a: Any) -> None:
            warnings.append(msg % a)

    app.kill(_Log())
    assert warnings and "arroyo-orders-1-driver" in warnings[0]
