"""How a pipeline's driver is deployed on each Spark cluster manager, and how a cluster run is found and killed.

The command itself is built by the apache-spark provider's ``SparkSubmitHook``; this module decides
what goes into it, per cluster manager and deploy mode (:func:`plan_submit`, pure), and wraps the
provider's own handles on a cluster-mode application (:class:`ClusterApplication`: the YARN
application id, the Kubernetes driver pod), read from ``spark-submit``'s output by the provider's
own parser.

* ``local[N]``: the installed ``driver.py``; ``ARROYO_DSN`` in the process environment; the
  Airflow worker's interpreter.
* client mode (``spark://``, ``yarn``, ``k8s://``): the driver runs here (the installed ``driver.py``,
  ``ARROYO_DSN`` in the process environment, this interpreter); executors use ``cluster_python``
  (``spark.pyspark.python``), else the cluster's ``python3`` (standalone: this interpreter's path).
* YARN cluster mode: a ``local://`` (or the given) application; the DSN in a 0600 file shipped with
  ``--files`` (the driver reads ``ARROYO_DSN_FILE``); ``cluster_python`` or the cluster's ``python3``.
* Kubernetes cluster mode: a ``local://`` (or the given) application; the DSN from a Kubernetes
  secret (``spark.kubernetes.driver.secretKeyRef.ARROYO_DSN``); ``cluster_python`` or the image's.
* standalone cluster mode: refused (Spark does not run Python applications that way).

The DSN is never on a command line, in a ``--conf`` value or in a log line; the interpreter of the
Airflow worker never leaks to cluster nodes (YARN's client copies ``PYSPARK_PYTHON`` from the
submitting process into the application master, so it is removed from ``spark-submit``'s
environment in cluster mode).
"""

from __future__ import annotations

import enum
import subprocess
import sys
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from airflow_arroyo.core.exceptions import ConfigurationError
from airflow_arroyo.jvm import master_conf, master_kind
from airflow_arroyo.submit import provider

if TYPE_CHECKING:
    from airflow.providers.apache.spark.hooks.spark_submit import SparkSubmitHook

__all__ = [
    "CLUSTER_DRIVER_APPLICATION",
    "DSN_FILE_ALIAS",
    "ClusterApplication",
    "ClusterManager",
    "DeployTarget",
    "SubmitPlan",
    "plan_submit",
]

#: The driver in cluster deploy mode: a path inside the cluster's image / on every node (``local://``).
#: Put it there with ``python -c "import shutil, airflow_arroyo.runtime.driver as d;
#: shutil.copy(d.__file__, '/opt/airflow-arroyo/driver.py')"`` (docs/clusters.md).
CLUSTER_DRIVER_APPLICATION = "local:///opt/airflow-arroyo/driver.py"
#: The name the DSN file gets in a YARN container's working directory (``--files path#arroyo-dsn``).
DSN_FILE_ALIAS = "arroyo-dsn"

_PYTHON_ENV = ("PYSPARK_PYTHON", "PYSPARK_DRIVER_PYTHON")


class ClusterManager(enum.StrEnum):
    """Where a Spark application runs, from the master URL."""
    LOCAL = "local"
    STANDALONE = "standalone"
    YARN = "yarn"
    KUBERNETES = "kubernetes"


@dataclass(frozen=True)
class DeployTarget:
    """Where ``spark-submit`` sends the application, as the provider's connection resolved it."""

    manager: ClusterManager
    cluster_mode: bool
    master: str
    namespace: str | None = None

    @classmethod
    def of(cls, master: str, deploy_mode: str | None, namespace: str | None = None) -> DeployTarget:
        """The target of ``master`` and ``deploy_mode`` (``namespace`` for Kubernetes)."""
        kind = master_kind(master)
        if kind is None:
            raise ConfigurationError(f"unsupported Spark master {master!r}: use local[N], spark://, yarn or k8s://")
        return cls(ClusterManager(kind), (deploy_mode or "client") == "cluster", master, namespace)

    @classmethod
    def from_hook(cls, hook: SparkSubmitHook) -> DeployTarget:
        """The target of the Spark connection of ``hook``."""
        conn = provider.connection(hook)
        return cls.of(conn["master"], conn["deploy_mode"], conn.get("namespace"))


@dataclass
class SubmitPlan:
    """What goes into the ``spark-submit`` of one run (all but the DSN may be shown)."""

    application: str
    conf: dict[str, str]
    #: environment of the spark-submit process (the DSN, in client mode: never on the command line)
    process_env: dict[str, str]
    #: environment variables to drop from the spark-submit process (they would leak to the cluster)
    drop_env: tuple[str, ...] = ()
    #: ``--files`` entries to add (YARN cluster mode: the DSN file)
    files: list[str] = field(default_factory=list)
    #: a file to write, 0600, before spark-submit runs, and delete once it has exited: (path, content)
    secret_file: tuple[str, str] | None = None


def plan_submit(
    target: DeployTarget,
    *,
    dsn: str,
    driver_application: str,
    application: str | None = None,
    conf: Mapping[str, str] | None = None,
    cluster_python: str | None = None,
    dsn_secret: str | None = None,
    secret_dir: str | None = None,
    local_python: str | None = None,
) -> SubmitPlan:
    """Decide the application, confs and environment of a run's spark-submit. Pure.

    :param dsn: the epoch store's DSN (it never appears in the plan's confs or application).
    :param driver_application: the installed runtime driver (client and local modes).
    :param application: the user's application, if given (wins in every mode).
    :param cluster_python: the Python interpreter on the cluster's nodes (executors; in cluster mode
        the driver too): ``spark.pyspark.python``.
    :param dsn_secret: Kubernetes cluster mode: the secret holding the DSN, ``"name:key"``.
    :param secret_dir: YARN cluster mode: a private folder (0700) for the DSN file.
    :param local_python: the interpreter of this host (default: this process's; ``$PYSPARK_PYTHON``
        wins for local masters).
    """
    confs = {str(k): str(v) for k, v in (conf or {}).items()}
    here = local_python or sys.executable
    if target.manager is ClusterManager.STANDALONE and target.cluster_mode:
        raise ConfigurationError(
            "Spark does not run Python applications in standalone cluster deploy mode ('Cluster deploy mode is "
            "currently not supported for python applications on standalone clusters'): use client mode with a "
            "spark:// master (the driver then runs on the Airflow worker, the executors on the cluster)"
        )
    if cluster_python:
        confs.setdefault("spark.pyspark.python", cluster_python)
    # Spark's console progress bars, redrawn every 200 ms of every stage that runs over half a second: noise in
    # the driver's log file (the user's value stands)
    confs.setdefault("spark.ui.showConsoleProgress", "false")

    if not target.cluster_mode:
        env = {"ARROYO_DSN": dsn}
        # what the provider adds on this master, the user's values kept (airflow_arroyo.jvm.master_conf)
        confs.update(master_conf(target.master, confs))
        if target.manager is ClusterManager.LOCAL:
            env["PYSPARK_PYTHON"] = here
        else:
            env["PYSPARK_DRIVER_PYTHON"] = here  # the driver runs here; executors on the cluster's nodes
            if cluster_python is None and target.manager is ClusterManager.STANDALONE:
                env["PYSPARK_PYTHON"] = here  # same path expected on the workers unless told otherwise
            confs.setdefault("spark.pyspark.driver.python", here)
        return SubmitPlan(application or driver_application, confs, env)

    # cluster mode: the driver runs on the cluster, not here
    app = application or CLUSTER_DRIVER_APPLICATION
    if cluster_python:
        confs.setdefault("spark.pyspark.driver.python", cluster_python)
    if target.manager is ClusterManager.KUBERNETES:
        if not dsn_secret or dsn_secret.count(":") != 1 or not all(dsn_secret.split(":")):
            raise ConfigurationError(
                "Kubernetes cluster mode takes the epoch store DSN from a Kubernetes secret, never from the command "
                f"line: create one (kubectl -n {target.namespace or 'NAMESPACE'} create secret generic arroyo-store "
                "--from-literal=dsn='postgresql://...') and pass dsn_secret='arroyo-store:dsn'"
                + (f" (got {dsn_secret!r})" if dsn_secret else "")
            )
        confs["spark.kubernetes.driver.secretKeyRef.ARROYO_DSN"] = dsn_secret
        return SubmitPlan(app, confs, {}, drop_env=_PYTHON_ENV)
    assert target.manager is ClusterManager.YARN
    if not secret_dir:
        raise ConfigurationError("YARN cluster mode needs a private folder for the DSN file (secret_dir)")
    path = f"{secret_dir.rstrip('/')}/{DSN_FILE_ALIAS}"
    confs["spark.yarn.appMasterEnv.ARROYO_DSN_FILE"] = DSN_FILE_ALIAS
    return SubmitPlan(app, confs, {}, drop_env=_PYTHON_ENV, files=[f"{path}#{DSN_FILE_ALIAS}"],
                      secret_file=(path, dsn))


# --------------------------------------------------------------------------- a cluster-mode application


@dataclass(frozen=True)
class ClusterApplication:
    """A cluster-mode run as its cluster manager knows it: the YARN application id or the Kubernetes
    driver pod, read from spark-submit's output by the provider's own parser. Serializable (a trigger
    argument, an XCom)."""

    manager: str
    spark_conn_id: str
    application_id: str | None = None
    driver_pod: str | None = None
    namespace: str | None = None

    @classmethod
    def from_submit_output(cls, hook: SparkSubmitHook, lines: Iterable[str], spark_conn_id: str) -> ClusterApplication:
        """Feed spark-submit's output to the provider's log parser (the one ``SparkSubmitHook.submit``
        uses) and keep the handle it found."""
        target = DeployTarget.from_hook(hook)
        # the parser also logs every line into the task log (spark-submit's output holds no DSN)
        found = provider.parse_submit_output(hook, lines)
        if target.manager is ClusterManager.YARN:
            app = cls(target.manager.value, spark_conn_id, application_id=found.yarn_application_id)
        else:
            app = cls(target.manager.value, spark_conn_id, application_id=found.kubernetes_application_id,
                      driver_pod=found.kubernetes_driver_pod, namespace=target.namespace)
        if app.application_id is None and app.driver_pod is None:
            raise ConfigurationError(
                f"spark-submit's output names no {target.manager} application (no YARN application id, no driver "
                "pod): check its log; the provider needs spark-submit's INFO output to find it"
            )
        return app

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> ClusterApplication | None:
        """Rebuild from :meth:`to_dict` (None for an empty value)."""
        return cls(**dict(data)) if data else None

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able form (for XCom and trigger arguments)."""
        return asdict(self)

    def describe(self) -> str:
        """How a log line names the application."""
        if self.manager == ClusterManager.YARN:
            return f"YARN application {self.application_id}"
        return f"driver pod {self.namespace}/{self.driver_pod}"

    def _hook(self) -> SparkSubmitHook:
        is_yarn = self.manager == ClusterManager.YARN
        return provider.tracking_hook(self.spark_conn_id, yarn=is_yarn, rm_api=is_yarn and self._rm_address(),
                                      application_id=self.application_id, driver_pod=self.driver_pod,
                                      namespace=self.namespace)

    def _rm_address(self) -> bool:
        from airflow.providers.apache.spark.hooks.spark_submit import SparkSubmitHook

        try:
            conn = SparkSubmitHook.get_connection(self.spark_conn_id)
        except Exception:  # noqa: BLE001 - no such connection: the provider falls back to the yarn CLI
            return False
        return bool(conn.extra_dejson.get("yarn_resourcemanager_webapp_address"))

    def status(self) -> tuple[bool, str] | None:
        """(ended, what the cluster manager says), or None when it cannot be told (no YARN
        ResourceManager address in the connection; the Kubernetes API unreachable). Blocking."""
        hook = self._hook()
        if self.manager == ClusterManager.YARN:
            if not self._rm_address() or not self.application_id:
                return None
            try:
                state, final, diagnostics = provider.yarn_status(hook, self.application_id)
            except RuntimeError:
                return None
            ended = state in ("FINISHED", "FAILED", "KILLED")
            why = f": {diagnostics}" if diagnostics else ""
            return ended, f"{self.describe()} is {state} (final status {final}){why}"
        from airflow.providers.cncf.kubernetes import kube_client

        try:
            pod = kube_client.get_kube_client().read_namespaced_pod(self.driver_pod, self.namespace)
        except kube_client.ApiException as exc:
            if exc.status == 404:
                return True, f"{self.describe()} no longer exists"
            return None
        except Exception:  # noqa: BLE001 - no cluster configuration here: cannot tell
            return None
        phase = pod.status.phase or "Pending"
        return phase in ("Succeeded", "Failed"), f"{self.describe()} is {phase}"

    def kill(self, log: Any) -> None:
        """End the application through its cluster manager, the provider's way: the ResourceManager's
        REST API (``yarn_resourcemanager_webapp_address`` in the connection) or ``yarn application
        -kill``; the Kubernetes API (delete the driver pod). Blocking; best effort (logged)."""
        log.info("Killing %s through its cluster manager", self.describe())
        try:
            self._kill(log)
        except Exception as exc:  # noqa: BLE001 - best effort: the stop request in the store stands
            log.warning("Could not kill %s: %s", self.describe(), exc)

    def _kill(self, log: Any) -> None:
        hook = self._hook()
        if self.manager == ClusterManager.YARN:
            if not self.application_id:
                return
            if provider.tracks_yarn_via_rm_api(hook):
                provider.kill_yarn_application(hook, self.application_id)
                return
            try:  # the provider's legacy kill (SparkSubmitHook.on_kill without yarn_track_via_rm_api)
                subprocess.run(["yarn", "application", "-kill", self.application_id], check=False, timeout=60,
                               capture_output=True)
            except (OSError, subprocess.TimeoutExpired) as exc:
                log.warning("yarn application -kill %s failed: %s", self.application_id, exc)
            return
        if self.driver_pod:
            provider.delete_driver_pod(hook)
