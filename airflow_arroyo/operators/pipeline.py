"""Start and stop long-running pipelines: ``SubmitPipelineOperator`` and ``StopPipelineOperator``.

**Submit.** The pipeline runs as a long-running Spark application (the runtime driver,
``airflow_arroyo/runtime/driver.py``) started with ``spark-submit``. The command is built by the
apache-spark provider's ``SparkSubmitHook`` from the ``spark_default`` connection (any master and
deploy mode the provider supports: ``local[*]``, ``spark://``, ``yarn``, ``k8s://``), but the
operator starts it itself, **detached**: in its own session (``start_new_session``), with its output
in a log file and stdin closed, so that it survives the task. ``SparkSubmitHook.submit`` would block
until the application ends, holding a worker slot for the pipeline's whole life, and ties the
process to the task. Then the operator defers to
:class:`~airflow_arroyo.triggers.pipeline.PipelineStateTrigger` until *this* run (``run_id``) is
``running``, and returns: no worker slot is held while it waits.

* In client/local deploy mode the driver runs inside the ``spark-submit`` process group on the
  worker host. If that process exits before the run registers, the task fails at once with the tail
  of its log. In cluster deploy modes ``spark-submit`` exits once the application is submitted
  (``spark.yarn.submit.waitAppCompletion`` / ``spark.kubernetes.submission.waitAppCompletion`` are
  set to ``false`` unless given): the operator waits for that, reads the application's handle (YARN
  application id, driver pod) with the provider's parser, and the trigger tracks and kills it
  through its cluster manager (:class:`~airflow_arroyo.submit.deploy.ClusterApplication`).
* The store DSN is never on the command line: ``ARROYO_DSN`` in the process environment (local and
  client mode), a 0600 file shipped with ``--files`` (YARN cluster mode), a Kubernetes secret
  (``dsn_secret``, Kubernetes cluster mode). Application, interpreter and DSN per mode:
  :func:`~airflow_arroyo.submit.deploy.plan_submit` (``docs/clusters.md``).
* XCom: ``pipeline_id``, ``run_id`` (also the return value), ``spark_ui_url``, ``spark_app_id``,
  ``epoch_at_start`` (the pipeline's last epoch number when this run started: epoch numbers go on
  across runs), ``submit_log``, ``submit_process`` (pid, host, start time and log of the local
  ``spark-submit``), ``cluster_application`` (cluster mode). Extra links: the pipeline's
  checkpoint page and the Spark UI.
* Killing the task stops the pipeline: ``on_kill`` (while ``execute`` runs) and the trigger's
  ``on_kill`` (while deferred) request an immediate stop and, for a local ``spark-submit``, end its
  process group. A run that never reaches ``running`` (timeout, failure) is stopped the same way.

**Supervision** (``restart_strategy``, Flink's restart strategies: :mod:`airflow_arroyo.core.supervision`).
Once the run is ``running`` the task does not end: it defers to
:class:`~airflow_arroyo.triggers.supervise.PipelineSupervisorTrigger` for the pipeline's whole life
(no worker slot held). When the driver fails (it reports ``failed``, its heartbeat stops, its
``spark-submit`` or cluster application ends), the strategy decides: after its delay the task resubmits
the pipeline as run ``<lineage>.restart<n>`` restoring the latest completed epoch (taking over the dead
run), logs the restart (attempt, cause, restored epoch; the UI and ``airflow-arroyo restarts`` show it
too) and defers again. The task succeeds when the pipeline stops, and fails with the last cause when the
strategy gives up. Downstream tasks that need the pipeline running wait for it with sensors, not with
a dependency on this task (``dags/example_streaming_pipeline.py``).

**Reattach.** A retried or cleared submit task that finds the run an earlier try started (or a restart
of it) still live carries on with it instead of submitting again.

**Stop.** ``mode="graceful"`` asks the driver to take a final epoch and stop; ``"immediate"``
stops without one. The operator then defers until the pipeline is ``stopped``.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from airflow.sdk import BaseOperator

from airflow_arroyo import config
from airflow_arroyo.assets import publish_outlet_events
from airflow_arroyo.core.epochs import PipelineState, validate_pipeline_id
from airflow_arroyo.core.exceptions import (
    ArroyoError,
    ConcurrencyConflict,
    ConfigurationError,
    PipelineFailedError,
    UnknownPipelineError,
)
from airflow_arroyo.core.processes import LocalProcess
from airflow_arroyo.core.stopping import StopAsked, check_stop, finish_stop, request_stop
from airflow_arroyo.core.supervision import (
    RestartStrategy,
    SupervisionState,
    lineage_of,
    parse_strategy,
    restart_run_id,
)
from airflow_arroyo.links.pipeline import XCOM_PIPELINE_ID, XCOM_SPARK_UI_URL, ArroyoPipelineLink, SparkUILink
from airflow_arroyo.operators.driver_log import DEFAULT_BACKUPS, DEFAULT_MAX_BYTES
from airflow_arroyo.submit import provider
from airflow_arroyo.submit.deploy import ClusterApplication, ClusterManager, DeployTarget, plan_submit
from airflow_arroyo.triggers.inline import run_inline
from airflow_arroyo.triggers.pipeline import (
    PipelineStateTrigger,
    Verdict,
    WaitVerdict,
    evaluate_wait,
    log_tail,
    stop_run,
)
from airflow_arroyo.triggers.resubmit import RUN_ID_SLOT, Resubmission, end_failed_run, resubmission_of
from airflow_arroyo.triggers.resubmit import start_detached as start_detached_process
from airflow_arroyo.triggers.settle import settle_deadline
from airflow_arroyo.triggers.supervise import PipelineSupervisorTrigger

if TYPE_CHECKING:
    from airflow.providers.apache.spark.hooks.spark_submit import SparkSubmitHook
    from airflow.sdk import Context

    from airflow_arroyo.store import EpochStore, PipelineRecord

__all__ = [
    "DRIVER_APPLICATION", "StopPipelineOperator", "SubmitCommand", "SubmitPipelineOperator", "parse_restore_from",
]

#: The runtime driver: a spark-submit application (absolute path of the installed file).
DRIVER_APPLICATION = str(Path(__file__).resolve().parent.parent / "runtime" / "driver.py")

_CLUSTER_WAIT_CONFS = ("spark.yarn.submit.waitAppCompletion", "spark.kubernetes.submission.waitAppCompletion")



class SubmitCommand(NamedTuple):
    """A run's spark-submit: the command, its process environment, whether it exits once the
    application is submitted (cluster deploy mode), the provider's hook that built it, and the DSN
    file to write before it runs and delete after (YARN cluster mode; never logged)."""

    command: list[str]
    env: dict[str, str]
    cluster: bool
    hook: SparkSubmitHook
    secret_file: tuple[str, str] | None = None


def parse_restore_from(value: str | int | None) -> str | None:
    """``"latest"``, an epoch number (>= 1) or None/"" (a fresh start), as a driver argument."""
    if value is None or (isinstance(value, str) and value.strip() in ("", "None", "none")):
        return None
    if isinstance(value, bool):
        raise ConfigurationError(f"restore_from must be 'latest', an epoch number or None, got {value!r}")
    text = str(value).strip().lower()
    if text == "latest":
        return text
    try:
        number = int(text)
    except ValueError:
        number = 0
    if number < 1:
        raise ConfigurationError(
            f"restore_from must be 'latest', an epoch number >= 1 or None (a fresh start), got {value!r}"
        )
    return str(number)


def _arg_value(value: Any) -> str:
    """A pipeline argument as the driver reads it: JSON, except plain strings (rendered templates
    arrive as strings: "20000" is sent as is and the driver reads the number)."""
    return value if isinstance(value, str) else json.dumps(value)


def _default_run_id(context: Context) -> str:
    ti = context["ti"]
    raw = f"{ti.dag_id}.{ti.run_id}.try{ti.try_number}"
    return re.sub(r"[^A-Za-z0-9_.:+-]", "_", raw)[:200]


def _started_by_an_earlier_try(context: Context, explicit_run_id: str | None, current_run_id: str | None) -> bool:
    """Whether the live run was started by an earlier try of this same task instance (a retry after
    the scheduler failed a healthy try, apache/airflow#67287, or after a worker died post-submit)."""
    if not current_run_id:
        return False
    if explicit_run_id:
        return current_run_id == explicit_run_id
    ti = context["ti"]
    prefix = re.sub(r"[^A-Za-z0-9_.:+-]", "_", f"{ti.dag_id}.{ti.run_id}.try")
    rest = current_run_id[len(prefix):]
    return current_run_id.startswith(prefix) and rest.isdigit() and int(rest) < int(ti.try_number)


def _log_dir(submit_log_dir: str | None) -> Path:
    submit_log_dir = submit_log_dir or config.get("submit_log_dir")
    if submit_log_dir:
        return Path(submit_log_dir)
    home = os.environ.get("AIRFLOW_HOME") or str(Path.home() / "airflow")
    return Path(home) / "logs" / "arroyo"


def driver_log_path(pipeline_id: str, run_id: str, submit_log_dir: str | None = None) -> Path:
    """Where the submit task put the driver's own log (``spark-submit``'s output) of a run, on the
    host that ran it: ``<submit_log_dir or $AIRFLOW_HOME/logs/arroyo>/<pipeline_id>/<run_id>.log``."""
    return _log_dir(submit_log_dir) / pipeline_id / f"{re.sub(r'[^A-Za-z0-9_.+-]', '_', run_id)}.log"


def _log_driver_tail(log: Any, pipeline_id: str, run_id: str | None, submit_log_dir: str | None,
                     lines: int = 20) -> None:
    """Put the driver log's path and last lines into this task's log (when this host has the file)."""
    if not run_id:
        return
    path = driver_log_path(pipeline_id, run_id, submit_log_dir)
    tail = log_tail(str(path), lines)
    if tail:
        log.info("Driver log of pipeline %s run %s: %s; its last %s lines:\n%s", pipeline_id, run_id, path,
                 len(tail.splitlines()), tail)
    else:
        log.info("Driver log of pipeline %s run %s: %s on the host that ran the submit task", pipeline_id,
                 run_id, path)


def _templated(value: object) -> bool:
    return isinstance(value, str) and ("{{" in value or "{%" in value)


def _at_parse(task_id: str, check: Any, *args: Any) -> None:
    """Run a check when the DAG is parsed, naming the task in the error (templated values are checked
    once rendered, in execute)."""
    if any(_templated(a) for a in args):
        return
    try:
        check(*args)
    except ConfigurationError as exc:
        raise ConfigurationError(f"task {task_id!r}: {exc}") from None


_DETACHED: list[subprocess.Popen[bytes]] = []


def _reap_detached() -> None:
    _DETACHED[:] = [p for p in _DETACHED if p.poll() is None]


def _write_private(path: str, content: str) -> None:
    """Write a secret file only its owner can read (created 0600, never world-readable in between)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(content)


def openlineage_conf(conf: Mapping[str, Any], context: Context, *, parent: bool, transport: bool) -> dict[str, Any]:
    """The Spark conf with OpenLineage's parent job (and transport) properties added, through the same
    functions the apache-spark provider's SparkSubmitOperator uses (a no-op with a warning when the
    OpenLineage provider is not installed; properties already set are kept)."""
    out = dict(conf)
    if not (parent or transport):
        return out
    from airflow.providers.common.compat.openlineage.utils import spark as ol_spark

    if parent:
        out = ol_spark.inject_parent_job_information_into_spark_properties(out, context)
    if transport:
        out = ol_spark.inject_transport_information_into_spark_properties(out, context)
    return out


def _watch_args(submit: Mapping[str, Any]) -> dict[str, Any]:
    """The triggers' ``submit_*`` / ``cluster_application`` arguments (``WatchesSubmission``) from what
    ``SubmitPipelineOperator._launch`` returned (an adopted run has none of them)."""
    return {"submit_pid": submit.get("pid"), "submit_host": submit.get("host"),
            "submit_start_ticks": submit.get("start_ticks"), "submit_log": submit.get("log"),
            "submit_exits": bool(submit.get("exits")), "cluster_application": submit.get("cluster_application")}


def _store(conn_id: str) -> EpochStore:
    from airflow_arroyo.hooks.arroyo import ArroyoHook

    return ArroyoHook(conn_id).get_store()


def _dsn(conn_id: str) -> str:
    from airflow_arroyo.hooks.arroyo import ArroyoHook

    return ArroyoHook(conn_id).get_dsn()


class SubmitPipelineOperator(BaseOperator):
    """Submit a pipeline as a long-running Spark application; succeed once it is running.

    :param pipeline: the pipeline, ``"module:attribute"`` importable by the Spark driver: a
        ``Pipeline`` or a function returning one.
    :param pipeline_id: the id the pipeline registers under (the one its object declares).
    :param pipeline_args: keyword arguments for the pipeline function (``--arg key=value``; values
        are sent as JSON), e.g. ``{"pipeline_id": "orders", "rows": 20000}``.
    :param takeover: supersede a run that is still registered (its driver is known to be dead).
    :param run_id: id of this run (default ``<dag_id>.<dag run id>.try<n>``).
    :param restore_from: ``"latest"``, an epoch number, or None for a fresh start.
    :param storage_uri: root of the pipeline's channels and snapshots (default ``[arroyo] storage_uri``;
        without either, the driver needs ``ARROYO_STORAGE_URI`` in its environment).
    :param checkpoint_uri: root of the stages' Spark checkpoints, when not under ``storage_uri``
        (default ``[arroyo] checkpoint_uri``; see docs/runtime.md, "Object storage").
    :param conn_id: Airflow connection of the epoch store (default ``[arroyo] conn_id``).
    :param spark_conn_id: the provider's Spark connection (master, deploy mode, queue...; default
        ``[arroyo] spark_conn_id``).
    :param conf: Spark configuration (``--conf``).
    :param env_vars: extra environment of the driver (``ARROYO_DSN`` is added).
    :param application: the spark-submit application (default: the runtime driver).
    :param application_args: extra arguments appended to the driver's.
    :param spark_submit_kwargs: further ``SparkSubmitHook`` arguments (``py_files``, ``jars``,
        ``driver_memory``, ``executor_memory``, ``num_executors``, ``deploy_mode``, ``verbose``...).
    :param name: the Spark application name (default ``arroyo-<pipeline_id>``).
    :param submit_log_dir: where the ``spark-submit`` log goes on the worker host
        (default ``[arroyo] submit_log_dir``, else ``$AIRFLOW_HOME/logs/arroyo``; one
        ``<pipeline_id>/<run_id>.log`` and ``.pid`` per run).
    :param driver_log_max_bytes: the size at which that log is rotated (``<run_id>.log.1`` ...; default 64 MiB).
    :param driver_log_backups: how many rotated files are kept beside the current one (default 5).
    :param register_timeout: seconds the run may take to reach ``running`` before the task fails
        (and the run is stopped).
    :param poll_interval: seconds between two looks at the epoch store while deferred.
    :param cluster_python: the Python interpreter on the cluster's nodes (``spark.pyspark.python``;
        in cluster deploy mode the driver's too). Default: the cluster's own ``python3`` (the
        Airflow worker's interpreter only for local masters and standalone client mode).
    :param dsn_secret: Kubernetes cluster mode: the Kubernetes secret holding the epoch store DSN,
        ``"name:key"`` (the driver pod gets it as ``ARROYO_DSN``; the DSN is never on the command line).
    :param deferrable: wait for ``running`` in the triggerer (default ``[operators] default_deferrable``);
        otherwise in this worker slot, with the same checks.
    :param openlineage_inject_parent_job_info: add this task as the OpenLineage parent job of the Spark
        application (``spark.openlineage.parent*`` confs), as the apache-spark provider's
        ``SparkSubmitOperator`` does (default ``[openlineage] spark_inject_parent_job_info``).
    :param openlineage_inject_transport_info: pass Airflow's OpenLineage transport to the Spark
        application (default ``[openlineage] spark_inject_transport_info``).
    :param restart_strategy: supervise the pipeline and restart it when it fails, e.g.
        ``{"type": "fixed-delay", "attempts": 3, "delay": 10}``, ``{"type": "exponential-delay",
        "initial": 1, "max": 300}``, ``{"type": "failure-rate", "max_failures": 3, "interval": 300}``
        (:func:`~airflow_arroyo.core.supervision.parse_strategy`); None (default): succeed once running.
    :param heartbeat_timeout: supervised: a run whose driver has not heartbeated for this many seconds
        has failed (the driver heartbeats every 2 s).
    :param supervise_interval: supervised: seconds between two looks at the run (two store reads each;
        a local spark-submit's exit is noticed at once on Linux, elsewhere at the next look).
    :param restart_in_triggerer: supervised, local and client deploy modes: the supervisor trigger submits each
        restart itself, in the triggerer, with no worker slot (the restarted driver then runs on the triggerer's
        host; :mod:`airflow_arroyo.triggers.resubmit`). Off by default; in cluster deploy modes restarts go through
        the task. A spark-submit environment or command whose names look like secrets (``env_vars``,
        ``--conf``) keeps the restarts in the task: they would be stored in the trigger's arguments.

    Usage::

        submit = SubmitPipelineOperator(
            task_id="submit",
            pipeline="airflow_arroyo.examples.pipelines:demo_pipeline",
            pipeline_id="demo",
            restore_from="{{ params.restore_from }}",
            conf={"spark.sql.shuffle.partitions": "2"},
        )
        # downstream: "{{ ti.xcom_pull(task_ids='submit', key='run_id') }}"
    """

    template_fields: Sequence[str] = (
        "pipeline", "pipeline_id", "pipeline_args", "run_id", "restore_from", "storage_uri", "checkpoint_uri",
        "conn_id",
        "spark_conn_id", "conf", "env_vars", "application", "application_args", "spark_submit_kwargs", "name",
        "submit_log_dir", "cluster_python", "dsn_secret", "restart_strategy",
    )
    template_fields_renderers = {"conf": "json", "env_vars": "json", "application_args": "json",
                                 "pipeline_args": "json", "spark_submit_kwargs": "json", "restart_strategy": "json"}
    operator_extra_links = (ArroyoPipelineLink(), SparkUILink())
    ui_color = "#e8f4ea"

    def __init__(
        self,
        *,
        pipeline: str,
        pipeline_id: str,
        pipeline_args: Mapping[str, Any] | None = None,
        takeover: bool = False,
        run_id: str | None = None,
        restore_from: str | int | None = None,
        storage_uri: str | None = None,
        checkpoint_uri: str | None = None,
        conn_id: str | None = None,
        spark_conn_id: str | None = None,
        conf: Mapping[str, Any] | None = None,
        env_vars: Mapping[str, str] | None = None,
        application: str | None = None,
        application_args: Sequence[str] | None = None,
        spark_submit_kwargs: Mapping[str, Any] | None = None,
        name: str | None = None,
        submit_log_dir: str | None = None,
        register_timeout: float = 600.0,
        driver_log_max_bytes: int = DEFAULT_MAX_BYTES,
        driver_log_backups: int = DEFAULT_BACKUPS,
        poll_interval: float = 2.0,
        cluster_python: str | None = None,
        dsn_secret: str | None = None,
        deferrable: bool | None = None,
        openlineage_inject_parent_job_info: bool | None = None,
        openlineage_inject_transport_info: bool | None = None,
        restart_strategy: RestartStrategy | Mapping[str, Any] | str | None = None,
        heartbeat_timeout: float = 60.0,
        supervise_interval: float = 5.0,
        restart_in_triggerer: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.pipeline = pipeline
        self.restart_strategy = restart_strategy
        self.heartbeat_timeout = heartbeat_timeout
        self.supervise_interval = supervise_interval
        self.restart_in_triggerer = restart_in_triggerer
        self.pipeline_id = pipeline_id
        self.pipeline_args = dict(pipeline_args or {})
        self.takeover = takeover
        self.run_id = run_id
        self.restore_from = restore_from
        self.storage_uri = storage_uri or config.get("storage_uri") or None
        self.checkpoint_uri = checkpoint_uri or config.get("checkpoint_uri") or None
        self.conn_id = conn_id or config.get("conn_id")
        self.spark_conn_id = spark_conn_id or config.get("spark_conn_id")
        self.conf = dict(conf or {})
        self.env_vars = dict(env_vars or {})
        self.application = application
        self.application_args = list(application_args or [])
        self.spark_submit_kwargs = dict(spark_submit_kwargs or {})
        self.name = name
        self.submit_log_dir = submit_log_dir
        self.register_timeout = register_timeout
        self.driver_log_max_bytes = driver_log_max_bytes
        self.driver_log_backups = driver_log_backups
        self.poll_interval = poll_interval
        self.cluster_python = cluster_python
        self.dsn_secret = dsn_secret
        self.deferrable = config.default_deferrable() if deferrable is None else deferrable
        self.openlineage_inject_parent_job_info = (
            config.openlineage_flag("spark_inject_parent_job_info") if openlineage_inject_parent_job_info is None
            else openlineage_inject_parent_job_info)
        self.openlineage_inject_transport_info = (
            config.openlineage_flag("spark_inject_transport_info") if openlineage_inject_transport_info is None
            else openlineage_inject_transport_info)
        self._process: LocalProcess | None = None
        self._popen: subprocess.Popen[bytes] | None = None
        self._log_writer: subprocess.Popen[bytes] | None = None  # rotates the driver's log (operators/driver_log.py)
        self._cluster_app: ClusterApplication | None = None
        self._submitted_run: str | None = None
        self._strategy: RestartStrategy | None = None
        _at_parse(self.task_id, parse_restore_from, restore_from)
        _at_parse(self.task_id, validate_pipeline_id, pipeline_id)
        _at_parse(self.task_id, parse_strategy, restart_strategy)

    # ------------------------------------------------------------------ pieces

    def _validate(self) -> str | None:
        validate_pipeline_id(self.pipeline_id)
        if not isinstance(self.pipeline, str) or ":" not in self.pipeline:
            raise ConfigurationError(
                f"pipeline must name the pipeline object as 'module:attribute', got {self.pipeline!r}"
            )
        if min(self.register_timeout, self.poll_interval, self.heartbeat_timeout, self.supervise_interval) <= 0:
            raise ConfigurationError("register_timeout, poll_interval, heartbeat_timeout and supervise_interval must "
                                     "be positive numbers of seconds")
        self._strategy = parse_strategy(self.restart_strategy)
        return parse_restore_from(self.restore_from)

    def build_spark_submit(self, run_id: str, restore: str | None, dsn: str, *,
                           secret_dir: str | None = None, takeover: bool | None = None) -> SubmitCommand:
        """The spark-submit command of a run, built by the provider's hook; what goes into it per
        cluster manager and deploy mode is :func:`~airflow_arroyo.submit.deploy.plan_submit`'s
        decision (application, interpreter, where the DSN travels)."""
        from airflow.providers.apache.spark.hooks.spark_submit import SparkSubmitHook

        args = ["--pipeline", self.pipeline, "--run-id", run_id]
        if restore is not None:
            args += ["--restore-from", restore]
        if self.storage_uri:
            args += ["--storage-uri", str(self.storage_uri)]
        if self.checkpoint_uri:
            args += ["--checkpoint-uri", str(self.checkpoint_uri)]
        if self.takeover if takeover is None else takeover:
            args += ["--takeover"]
        for key, value in self.pipeline_args.items():
            args += ["--arg", f"{key}={_arg_value(value)}"]
        args += [str(a) for a in self.application_args]
        conf = {str(k): str(v) for k, v in self.conf.items()}
        hook = SparkSubmitHook(
            conf=conf,
            conn_id=self.spark_conn_id,
            name=self.name or f"arroyo-{self.pipeline_id}",
            application_args=args,
            env_vars={str(k): str(v) for k, v in self.env_vars.items()} or None,
            **self.spark_submit_kwargs,
        )
        target = DeployTarget.from_hook(hook)
        # one conf value instead of the hook's option, which the plan may extend (airflow_arroyo.jvm.master_conf)
        conf.update(provider.take_conf_arguments(hook))
        if target.cluster_mode and target.manager is ClusterManager.YARN and secret_dir is None:
            secret_dir = tempfile.mkdtemp(prefix="arroyo-submit-")  # 0700: only this user reads the DSN file
        plan = plan_submit(
            target, dsn=dsn, driver_application=DRIVER_APPLICATION,
            application=str(self.application) if self.application else None, conf=conf,
            cluster_python=self.cluster_python, dsn_secret=self.dsn_secret, secret_dir=secret_dir,
            local_python=os.environ.get("PYSPARK_PYTHON") if target.manager is ClusterManager.LOCAL else None,
        )
        submit_conf = provider.spark_conf(hook)
        submit_conf.update(plan.conf)
        if target.cluster_mode:
            for key in _CLUSTER_WAIT_CONFS:
                submit_conf.setdefault(key, "false")
        if plan.files:
            provider.add_files(hook, plan.files)
        command = provider.build_command(hook, plan.application)
        process_env = {k: v for k, v in os.environ.items() if k not in plan.drop_env}
        # spark-submit is found on PATH, and its find-spark-home runs `python3` from PATH: the
        # interpreter that has pyspark installed must come first.
        process_env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), process_env.get("PATH", "")])
        process_env.update(plan.process_env)
        process_env.update(provider.env_vars(hook))
        self._pipeline_module_path(target, process_env)
        return SubmitCommand(command, process_env, target.cluster_mode, hook, plan.secret_file)

    def _pipeline_module_path(self, target: DeployTarget, process_env: dict[str, str]) -> None:
        """Where the driver finds the pipeline module (docs/airflow.md, "Where a pipeline module lives"). On a
        local master the driver and its executors run on this host, which has the DAGs folder: it goes on the
        driver's ``PYTHONPATH`` (after the user's), as Airflow puts it on its own ``sys.path``. Elsewhere the
        cluster has no DAGs folder: a module found only there is worth a warning before the driver fails."""
        dags = os.path.expanduser(config.dags_folder())
        if not dags:
            return
        if target.manager is ClusterManager.LOCAL:
            process_env["PYTHONPATH"] = os.pathsep.join(filter(None, [process_env.get("PYTHONPATH"), dags]))
            return
        top = str(self.pipeline).partition(":")[0].split(".")[0]
        if top and (Path(dags, f"{top}.py").is_file() or Path(dags, top).is_dir()) \
                and not self.spark_submit_kwargs.get("py_files"):
            self.log.warning(
                "The pipeline module %r is in the DAGs folder (%s), which a %s master's driver and executors do "
                "not have: ship it with spark_submit_kwargs={'py_files': ...} or install it on the cluster "
                "(docs/airflow.md, 'Where a pipeline module lives')", top, dags, target.manager.value)

    def start_detached(self, command: list[str], env: Mapping[str, str], run_id: str) -> tuple[LocalProcess, Path]:
        """Start spark-submit in its own session so it outlives this task; its output goes to a log file rotated
        by size (:func:`~airflow_arroyo.triggers.resubmit.start_detached`)."""
        log_path = driver_log_path(self.pipeline_id, run_id, self.submit_log_dir)
        proc, writer = start_detached_process(command, env, log_path, max_bytes=self.driver_log_max_bytes,
                                              backups=self.driver_log_backups)
        _DETACHED.append(writer)
        self._log_writer = writer
        # Not waited for: it is meant to outlive this task. Keep the Popen so that, should this
        # process live on (dag.test()), the child is reaped once it exits instead of lingering.
        _reap_detached()
        _DETACHED.append(proc)
        self._popen = proc
        return LocalProcess.of(proc.pid), log_path

    # ------------------------------------------------------------------ execute

    def execute(self, context: Context) -> Any:
        """Airflow: submit the driver (or adopt the run an earlier try started), then wait for it as configured."""
        restore = self._validate()
        run_id = str(self.run_id) if self.run_id else _default_run_id(context)
        store = _store(self.conn_id)
        try:
            current = store.get_pipeline(self.pipeline_id)
        except UnknownPipelineError:
            current = None
        wanted_run = str(self.run_id) if self.run_id else None
        if (current is not None and not current.state.terminal and not self.takeover
                and _started_by_an_earlier_try(context, wanted_run, lineage_of(current))):
            return self._adopt(context, current)
        if current is not None and not current.state.terminal and not self.takeover:
            raise ConcurrencyConflict(
                f"pipeline {self.pipeline_id!r} is already {current.state} (run {current.run_id!r}); stop it first "
                "(StopPipelineOperator or `airflow-arroyo stop`) before submitting a new run"
            )
        self.conf = openlineage_conf(self.conf, context, parent=self.openlineage_inject_parent_job_info,
                                     transport=self.openlineage_inject_transport_info)
        submit = self._launch(context, run_id, restore, takeover=self.takeover)
        self.log.info("The driver's own log (spark-submit output): %s on %s; its last lines are copied here once "
                      "the run is running", submit["log"], submit["host"])
        trigger = PipelineStateTrigger(
            pipeline_id=self.pipeline_id, state=PipelineState.RUNNING.value, run_id=run_id,
            conn_id=self.conn_id, poll_interval=self.poll_interval,
            deadline=time.time() + float(self.register_timeout), stop_on_kill=True,
            **_watch_args(submit),
            not_before=settle_deadline() if self.deferrable else None,  # no deferral round trip inline
        )
        kwargs: dict[str, Any] = {"submit": submit, "lineage": run_id}
        if not self.deferrable:  # wait in this worker slot, with the trigger's own checks
            return self.execute_complete(context, run_inline(trigger), **kwargs)
        self.defer(trigger=trigger, method_name="execute_complete", kwargs=kwargs)

    def _launch(self, context: Context, run_id: str, restore: str | None, *, takeover: bool) -> dict[str, Any]:
        """Start spark-submit for run ``run_id`` (detached; in cluster mode until the cluster accepted the
        application) and publish it in XCom; returns what the triggers and a later restart need of it."""
        submit_cmd = self.build_spark_submit(run_id, restore, _dsn(self.conn_id), takeover=takeover)
        cluster_app: ClusterApplication | None = None
        try:
            if submit_cmd.secret_file is not None:
                _write_private(*submit_cmd.secret_file)
            process, log_path = self.start_detached(submit_cmd.command, submit_cmd.env, run_id)
            self._process, self._submitted_run = process, run_id
            self.log.info("Pipeline %s run %s: spark-submit started (pid %s), log %s", self.pipeline_id, run_id,
                          process.pid, log_path)
            if submit_cmd.cluster:
                cluster_app = self._cluster_app = self._await_cluster_submission(submit_cmd, log_path)
        finally:
            if submit_cmd.secret_file is not None:  # spark-submit has shipped it (or failed): delete it here
                shutil.rmtree(Path(submit_cmd.secret_file[0]).parent, ignore_errors=True)
        ti = context["ti"]
        ti.xcom_push(key=XCOM_PIPELINE_ID, value=self.pipeline_id)
        ti.xcom_push(key="run_id", value=run_id)
        ti.xcom_push(key="submit_log", value=str(log_path))
        ti.xcom_push(key=XCOM_SPARK_UI_URL, value=None)  # known once the driver reports it
        submit = {"pid": process.pid, "host": process.host, "start_ticks": process.start_ticks,
                  "log": str(log_path), "run_id": run_id, "exits": submit_cmd.cluster,
                  "cluster_application": cluster_app.to_dict() if cluster_app else None}
        ti.xcom_push(key="submit_process", value=submit)
        if cluster_app is not None:
            ti.xcom_push(key="cluster_application", value=cluster_app.to_dict())
        return submit

    def _adopt(self, context: Context, current: PipelineRecord) -> Any:
        """A retry finds the run an earlier try started (or a supervisor's restart of it) still live:
        carry on with it (no second submit), and supervise it again if configured."""
        run_id = str(current.run_id)
        lineage = lineage_of(current)
        self.log.warning("Pipeline %s run %s was started by an earlier try of this task and is %s: adopting it "
                         "instead of submitting again", self.pipeline_id, run_id, current.state)
        ti = context["ti"]
        ti.xcom_push(key=XCOM_PIPELINE_ID, value=self.pipeline_id)
        ti.xcom_push(key="run_id", value=run_id)
        submit = {"run_id": run_id, "log": str(driver_log_path(self.pipeline_id, run_id, self.submit_log_dir))}
        ti.xcom_push(key="submit_process", value=submit)
        verdict = evaluate_wait(current, state=PipelineState.RUNNING, run_id=run_id)
        if verdict.verdict is Verdict.SUCCESS:
            return self.execute_complete(context, {"status": "success", "state": current.state.value, "run_id": run_id,
                                                   "spark_ui_url": current.spark_ui_url,
                                                   "spark_app_id": current.spark_app_id}, submit=submit,
                                         lineage=lineage)
        self.defer(
            trigger=PipelineStateTrigger(
                pipeline_id=self.pipeline_id, state=PipelineState.RUNNING.value, run_id=run_id, conn_id=self.conn_id,
                poll_interval=self.poll_interval, deadline=time.time() + float(self.register_timeout),
                stop_on_kill=True, not_before=settle_deadline(),
            ),
            method_name="execute_complete",
            kwargs={"submit": submit, "lineage": lineage},
        )

    def _await_cluster_submission(self, submit_cmd: SubmitCommand, log_path: Path) -> ClusterApplication:
        """Cluster deploy mode: spark-submit exits once the cluster accepted the application
        (``waitAppCompletion=false``). Wait for that (bounded by ``register_timeout``), then read the
        application's handle from its output with the provider's own parser."""
        popen = self._popen
        assert popen is not None
        try:
            code = popen.wait(timeout=self.register_timeout)
        except subprocess.TimeoutExpired:
            stop_run(_store(self.conn_id), self.pipeline_id, self._submitted_run, self._process, log=self.log)
            raise ArroyoError(
                f"spark-submit of pipeline {self.pipeline_id!r} did not return within {self.register_timeout:g}s "
                f"in cluster deploy mode (it should exit once the application is accepted); see {log_path}"
            ) from None
        if code != 0:
            raise ArroyoError(
                f"spark-submit of pipeline {self.pipeline_id!r} failed (exit code {code}); its last lines:\n"
                f"{log_tail(str(log_path), settle=2.0)}"
            )
        with open(log_path, encoding="utf-8", errors="replace") as lines:
            app = ClusterApplication.from_submit_output(submit_cmd.hook, lines, self.spark_conn_id)
        self.log.info("Pipeline %s: submitted as %s", self.pipeline_id, app.describe())
        return app

    def execute_complete(self, context: Context, event: dict[str, Any], submit: dict[str, Any] | None = None,
                         lineage: str | None = None) -> Any:
        """Airflow: the end of the wait; returns the run id, or fails with the driver's cause and log tail.
        Supervised: goes on supervising the run instead (:meth:`supervise_complete` ends the task)."""
        ti = context["ti"]
        # Airflow passes the defer kwargs back; dag.test() does not, hence the XCom fallback.
        submit = submit or ti.xcom_pull(task_ids=self.task_id, key="submit_process") or {}
        run_id = str(submit.get("run_id") or event.get("run_id"))
        if event.get("status") != "success":
            store = _store(self.conn_id)
            self._stop_submitted(store, run_id, submit)
            if event.get("status") == "failed":
                raise PipelineFailedError(self.pipeline_id, event.get("cause") or event.get("message"))
            message = f"pipeline {self.pipeline_id!r} run {run_id!r} did not start: {event.get('message')}"
            # the tasks waiting for this run fail now with this cause (the trigger records it already when the
            # submission ended; a timeout is recorded here)
            with contextlib.suppress(ArroyoError):
                store.fail_run(self.pipeline_id, run_id, message, never_registered=True)
            raise ArroyoError(message)
        # The driver reports its Spark UI before `running`; an older driver only with its first heartbeat:
        # read the record again rather than leave the "Spark UI" link empty.
        record = _store(self.conn_id).get_pipeline(self.pipeline_id)
        same_run = record.run_id == run_id
        ui_url = event.get("spark_ui_url") or (record.spark_ui_url if same_run else None)
        ti.xcom_push(key=XCOM_SPARK_UI_URL, value=ui_url)
        ti.xcom_push(key="spark_app_id", value=event.get("spark_app_id") or (record.spark_app_id if same_run else None))
        # Epoch numbers go on across runs: downstream tasks count this run's epochs from here,
        # e.g. PipelineSensor(epoch="{{ ti.xcom_pull(task_ids='submit', key='epoch_at_start') + 3 }}").
        ti.xcom_push(key="epoch_at_start", value=record.last_epoch)
        self.log.info("Pipeline %s run %s is %s; Spark UI: %s", self.pipeline_id, run_id, event.get("state"),
                      ui_url or "not reported")
        if submit.get("log"):
            tail = log_tail(str(submit["log"]), 20)
            self.log.info("Driver log: %s on %s%s", submit["log"], submit.get("host") or "the worker",
                          f"; its last lines:\n{tail}" if tail else "")
        self._strategy = parse_strategy(self.restart_strategy)
        if self._strategy is not None:
            lineage = lineage or run_id
            _store(self.conn_id).supervise(self.pipeline_id, lineage, self._strategy.to_dict())
            self.log.info("Pipeline %s: supervised as lineage %s with restart strategy %s; this task now lasts "
                          "until the pipeline stops", self.pipeline_id, lineage, self._strategy.to_dict())
            return self._supervise(context, lineage, run_id, submit, starting=False)
        return run_id

    # ------------------------------------------------------------------ supervision

    def _supervise(self, context: Context, lineage: str, run_id: str, submit: Mapping[str, Any], *,
                   starting: bool) -> Any:
        """Watch run ``run_id`` of the lineage in the triggerer (inline when not deferrable)."""
        assert self._strategy is not None
        resubmission = self._resubmission(context) if self.restart_in_triggerer and self.deferrable else None
        trigger = PipelineSupervisorTrigger(
            pipeline_id=self.pipeline_id, lineage=lineage, run_id=run_id, strategy=self._strategy.to_dict(),
            conn_id=self.conn_id, poll_interval=self.supervise_interval, heartbeat_timeout=self.heartbeat_timeout,
            start_deadline=time.time() + float(self.register_timeout) if starting else None,
            **_watch_args(submit), not_before=settle_deadline() if self.deferrable else None,
            restart_submit=resubmission.to_dict() if resubmission is not None else None,
            register_timeout=float(self.register_timeout),
        )
        kwargs: dict[str, Any] = {"submit": dict(submit), "lineage": lineage}
        if not self.deferrable:
            return self.supervise_complete(context, run_inline(trigger), **kwargs)
        self.defer(trigger=trigger, method_name="supervise_complete", kwargs=kwargs)

    def _resubmission(self, context: Context) -> Resubmission | None:
        """What the supervisor trigger needs to submit restarts itself (``restart_in_triggerer``): a restart's
        spark-submit command, built as :meth:`_restart` would build it with the run id left open, and the
        environment this task adds to its own, without the DSN. None, with the reason in the log, in cluster
        deploy modes and when a name in them looks like a secret: restarts then go through this task."""
        self.conf = openlineage_conf(self.conf, context, parent=self.openlineage_inject_parent_job_info,
                                     transport=self.openlineage_inject_transport_info)
        submit_cmd = self.build_spark_submit(RUN_ID_SLOT, "latest", "", takeover=True)
        if submit_cmd.secret_file is not None:
            shutil.rmtree(Path(submit_cmd.secret_file[0]).parent, ignore_errors=True)
        why_not: str | None
        if submit_cmd.cluster:
            why_not = "a cluster deploy mode"
            resubmission: Resubmission | str | None = None
        else:
            resubmission = resubmission_of(
                self.pipeline_id, submit_cmd.command, submit_cmd.env, os.environ, run_id=RUN_ID_SLOT,
                log_dir=str(_log_dir(self.submit_log_dir)), log_max_bytes=self.driver_log_max_bytes,
                log_backups=self.driver_log_backups)
            why_not = resubmission if isinstance(resubmission, str) else None
        if why_not is not None or not isinstance(resubmission, Resubmission):
            self.log.warning("Pipeline %s: restarts go through this task (a worker slot), not the triggerer: %s",
                             self.pipeline_id, why_not)
            return None
        self.log.info("Pipeline %s: restarts are submitted from the triggerer (the restarted driver runs on its "
                      "host; logs under %s)", self.pipeline_id, resubmission.log_dir)
        return resubmission

    def supervise_complete(self, context: Context, event: dict[str, Any], submit: dict[str, Any] | None = None,
                           lineage: str | None = None) -> Any:
        """Airflow: the supervisor's event: succeed (stopped; a stop cancelled a restart), fail (gave up,
        superseded, store error), or restart the pipeline from its latest completed epoch and supervise the
        new run. Whatever ends the task otherwise ends the supervision too (waits stop expecting a restart)."""
        self._validate()
        submit = submit or {}
        lineage = str(lineage or event.get("lineage"))
        status = event.get("status")
        store = _store(self.conn_id)
        if status == "stopped":
            self.log.info("Pipeline %s run %s stopped (latest completed epoch %s); supervision ends",
                          self.pipeline_id, event.get("run_id"), event.get("latest_epoch"))
            return lineage
        try:
            if status in ("gave_up", "cancelled", "restart"):
                failed_run = str(event.get("run_id"))
                why_not = (store.claim_restart(self.pipeline_id, lineage, int(event["attempt"]))
                           if status == "restart" else None)
                if status != "restart" or why_not is not None:
                    self._end_failed_run(store, failed_run, submit, str(event.get("cause")))
                if status == "gave_up":
                    self._log_restarts(store, lineage)
                    raise PipelineFailedError(self.pipeline_id, str(event.get("cause") or event.get("message")))
                if status == "cancelled" or why_not is not None:
                    store.end_supervision(self.pipeline_id, lineage)
                    self.log.warning("Pipeline %s: not restarted: %s", self.pipeline_id,
                                     why_not or event.get("message"))
                    return lineage
                return self._restart(context, store, lineage, int(event["attempt"]), failed_run, submit,
                                     str(event.get("cause")))
            raise ArroyoError(str(event.get("message")))
        except Exception:
            store.end_supervision(self.pipeline_id, lineage, SupervisionState.GAVE_UP)
            raise

    def _end_failed_run(self, store: EpochStore, failed_run: str, submit: Mapping[str, Any], cause: str) -> None:
        """End what is left of a failed run and record it failed (:func:`~airflow_arroyo.triggers.resubmit.
        end_failed_run`)."""
        process = None
        if submit.get("pid") is not None and submit.get("host"):
            process = LocalProcess(int(submit["pid"]), str(submit["host"]), submit.get("start_ticks"))
        end_failed_run(store, self.pipeline_id, failed_run, process,
                       ClusterApplication.from_dict(submit.get("cluster_application")), cause, self.log)

    def _restart(self, context: Context, store: EpochStore, lineage: str, attempt: int, failed_run: str,
                 submit: Mapping[str, Any], cause: str) -> Any:
        self._end_failed_run(store, failed_run, submit, cause)
        # Always "latest": the newest completed epoch, or a start over when none completed (the failed run
        # left state behind, which a fresh start would refuse).
        latest = store.latest_completed_epoch(self.pipeline_id)
        new_run = restart_run_id(lineage, attempt)
        self.log.warning("Pipeline %s: restart %s of lineage %s after: %s; restoring %s as run %s",
                         self.pipeline_id, attempt, lineage, cause,
                         f"epoch {latest.epoch}" if latest is not None else "no epoch (none completed: a start over)",
                         new_run)
        self.conf = openlineage_conf(self.conf, context, parent=self.openlineage_inject_parent_job_info,
                                     transport=self.openlineage_inject_transport_info)
        new_submit = self._launch(context, new_run, "latest", takeover=True)
        store.record_restart(self.pipeline_id, lineage, attempt, new_run, latest.epoch if latest is not None else None)
        return self._supervise(context, lineage, new_run, new_submit, starting=True)

    def _stop_submitted(self, store: EpochStore, run_id: str, submit: Mapping[str, Any]) -> None:
        """:func:`stop_run` for run ``run_id`` and what :meth:`_launch` started for it (``submit``)."""
        process = None
        if submit.get("pid") is not None and submit.get("host"):
            process = LocalProcess(int(submit["pid"]), str(submit["host"]), submit.get("start_ticks"))
        stop_run(store, self.pipeline_id, run_id, process, log=self.log,
                 cluster_app=ClusterApplication.from_dict(submit.get("cluster_application")))

    def _log_restarts(self, store: EpochStore, lineage: str) -> None:
        for r in reversed(store.restarts(self.pipeline_id, lineage)):
            self.log.info("  failure %s at %s: run %s: %s -> %s", r.attempt, r.failed_at, r.failed_run_id, r.cause,
                          f"restarted as {r.new_run_id} from epoch {r.restored_epoch}" if r.new_run_id
                          else r.decision)

    def on_kill(self) -> None:
        """Airflow: the task was killed: stop the run this task submitted."""
        if self._submitted_run is None:
            return
        stop_run(_store(self.conn_id), self.pipeline_id, self._submitted_run, self._process, log=self.log,
                 cluster_app=self._cluster_app)


class StopPipelineOperator(BaseOperator):
    """Stop a running pipeline and wait (deferred) until it is stopped.

    :param pipeline_id: the pipeline to stop.
    :param mode: ``"graceful"``: the driver takes a final epoch, then stops; ``"immediate"``: it
        stops without a final epoch.
    :param conn_id: Airflow connection of the epoch store (default ``[arroyo] conn_id``).
    :param fail_if_failed: fail the task if the pipeline failed (before or while stopping), with the
        pipeline's cause; with False the task just reports it.
    :param poll_interval: seconds between two looks at the epoch store while deferred.
    :param stop_timeout: seconds to wait for ``stopped`` before the task fails.
    :param wait_before_defer: seconds the task first waits in the worker (polling every
        ``poll_interval``) before it defers: a stop that ends in that time (a graceful stop takes one
        final epoch, usually seconds) never makes the deferral round trip that apache/airflow#67287
        can fail. 0 defers at once.
    :param submit_log_dir: the submit task's ``submit_log_dir``: where the driver's log is (its last
        lines are copied into this task's log).
    :param deferrable: wait in the triggerer (default ``[operators] default_deferrable``); otherwise in
        this worker slot.
    :param pin_label: once the run has stopped, pin the final epoch it took with this label (stop and pin in
        one step, like ``airflow-arroyo stop --pin``); graceful stops only. No completed final epoch fails the
        task (the pipeline is stopped; nothing is pinned).

    Returns (XCom) the pipeline's final state and its latest completed epoch (and ``pinned_epoch`` with
    ``pin_label``). Sink or epochs Assets of
    the pipeline (:mod:`airflow_arroyo.assets`) in ``outlets`` get an event carrying the final commit.

    Usage::

        stop = StopPipelineOperator(task_id="stop", pipeline_id="demo", mode="graceful",
                                    trigger_rule="all_done")
    """

    template_fields: Sequence[str] = ("pipeline_id", "mode", "conn_id", "pin_label")
    operator_extra_links = (ArroyoPipelineLink(),)
    ui_color = "#f4e8e8"

    def __init__(
        self,
        *,
        pipeline_id: str,
        mode: str = "graceful",
        conn_id: str | None = None,
        fail_if_failed: bool = True,
        poll_interval: float = 2.0,
        stop_timeout: float = 600.0,
        wait_before_defer: float = 30.0,
        submit_log_dir: str | None = None,
        deferrable: bool | None = None,
        pin_label: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.pipeline_id = pipeline_id
        self.mode = mode
        self.pin_label = pin_label
        self.conn_id = conn_id or config.get("conn_id")
        self.deferrable = config.default_deferrable() if deferrable is None else deferrable
        self.fail_if_failed = fail_if_failed
        self.poll_interval = poll_interval
        self.stop_timeout = stop_timeout
        self.wait_before_defer = wait_before_defer
        self.submit_log_dir = submit_log_dir
        _at_parse(self.task_id, check_stop, mode, pin_label)
        _at_parse(self.task_id, validate_pipeline_id, pipeline_id)

    def execute(self, context: Context) -> dict[str, Any]:
        """Airflow: ask the pipeline to stop, then wait for its run to end as configured."""
        validate_pipeline_id(self.pipeline_id)
        mode = check_stop(self.mode, self.pin_label)
        context["ti"].xcom_push(key=XCOM_PIPELINE_ID, value=self.pipeline_id)
        store = _store(self.conn_id)
        try:
            asked = request_stop(store, self.pipeline_id, mode)
        except UnknownPipelineError:
            self.log.warning("Pipeline %s is not registered: nothing to stop", self.pipeline_id)
            return {"pipeline_id": self.pipeline_id, "run_id": None, "state": None, "latest_epoch": None,
                    "final_epoch": None}
        pipeline = asked.pipeline
        if asked.asked in (StopAsked.RESTART_CANCELLED, StopAsked.ENDED):
            if asked.asked is StopAsked.RESTART_CANCELLED:
                self.log.info("Pipeline %s run %s failed and its supervisor was to restart it: the restart is "
                              "cancelled", self.pipeline_id, pipeline.run_id)
            self.log.info("Pipeline %s is already %s", self.pipeline_id, pipeline.state)
            return self._published(context, self._result(
                {"state": pipeline.state.value, "cause": pipeline.failure_cause, "run_id": pipeline.run_id,
                 "message": f"already {pipeline.state}"}, store))
        mode = asked.mode
        self.log.info("Requested a %s stop of pipeline %s (run %s)", mode, self.pipeline_id, pipeline.run_id)
        done = self._wait_in_worker(store, pipeline.run_id)
        if done is not None:
            return self.execute_complete(context, done)
        trigger = PipelineStateTrigger(
            pipeline_id=self.pipeline_id, state=PipelineState.STOPPED.value, run_id=pipeline.run_id,
            conn_id=self.conn_id, poll_interval=self.poll_interval,
            deadline=time.time() + float(self.stop_timeout),
            not_before=settle_deadline() if self.deferrable else None,  # no deferral round trip inline
        )
        if not self.deferrable:
            return self.execute_complete(context, run_inline(trigger))
        self.defer(trigger=trigger, method_name="execute_complete")

    def _wait_in_worker(self, store: EpochStore, run_id: str | None) -> dict[str, Any] | None:
        """Poll for ``stopped`` up to ``wait_before_defer`` seconds; the event if it ended, else None."""
        deadline = time.monotonic() + min(float(self.wait_before_defer), float(self.stop_timeout))
        while True:
            try:
                pipeline = store.get_pipeline(self.pipeline_id)
            except UnknownPipelineError:
                pipeline = None
            verdict: WaitVerdict = evaluate_wait(pipeline, state=PipelineState.STOPPED, run_id=run_id)
            if verdict.verdict is not Verdict.WAIT and pipeline is not None:
                return {"status": verdict.verdict.value, "state": pipeline.state.value, "run_id": pipeline.run_id,
                        "message": verdict.message, "cause": verdict.cause}
            if time.monotonic() >= deadline:
                return None
            time.sleep(min(float(self.poll_interval), max(0.0, deadline - time.monotonic())))

    def execute_complete(self, context: Context, event: dict[str, Any]) -> dict[str, Any]:
        """Airflow: the end of the wait; returns the final state, or fails with the cause."""
        _log_driver_tail(self.log, self.pipeline_id, event.get("run_id"), self.submit_log_dir)
        status = event.get("status")
        if status == "success":
            return self._published(context, self._result(event, None))
        if status == "failed":
            return self._published(context, self._result({**event, "state": PipelineState.FAILED.value}, None))
        raise ArroyoError(f"stopping pipeline {self.pipeline_id!r} did not finish: {event.get('message')}")

    def _published(self, context: Context, result: dict[str, Any]) -> dict[str, Any]:
        """Sink and epochs Assets of this pipeline in ``outlets`` get the final commit in their event."""
        if self.outlets:
            publish_outlet_events(context, self.outlets, _store(self.conn_id), self.pipeline_id)
        return result

    def _result(self, event: Mapping[str, Any], store: EpochStore | None) -> dict[str, Any]:
        store = store or _store(self.conn_id)
        stopped = event.get("state") == PipelineState.STOPPED.value
        outcome = finish_stop(store, self.pipeline_id, event.get("run_id"), self.pin_label, ended=stopped)
        result = {
            "pipeline_id": self.pipeline_id,
            "run_id": event.get("run_id"),
            "state": event.get("state"),
            "latest_epoch": outcome.latest_epoch,
            "final_epoch": outcome.final_epoch,
        }
        if event.get("state") == PipelineState.FAILED.value:
            cause = event.get("cause") or event.get("message")
            if self.fail_if_failed:
                raise PipelineFailedError(self.pipeline_id, cause)
            self.log.warning("Pipeline %s had failed: %s", self.pipeline_id, cause)
        else:
            self.log.info("Pipeline %s is %s; latest completed epoch %s%s", self.pipeline_id, event.get("state"),
                          result["latest_epoch"], " (final)" if result["final_epoch"] else "")
            if outcome.pinned is not None:
                result["pinned_epoch"], result["pin_label"] = outcome.pinned.epoch, outcome.pinned.pin_label
                self.log.info("Pinned the final epoch %s of pipeline %s (%s)", outcome.pinned.epoch, self.pipeline_id,
                              outcome.pinned.pin_label)
        return result
