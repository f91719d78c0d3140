"""The provider's JVM side: one small jar, ``airflow-arroyo-hadoop.jar``, built from ``src/`` (Java).

It holds three things. Hadoop's local file system (``file:``) without its ``chmod`` processes: Hadoop's
``RawLocalFileSystem`` sets the permission of every file and folder it creates with a permission (every
checkpoint file Spark writes: ``offsets/b``, ``commits/b``, state ``.delta`` files, and their ``.crc``) through
libhadoop, and where that native library is missing, as in the pip ``pyspark``, by starting a ``chmod``
process from the JVM: one per checkpoint file, a cost a micro-batch pays on every batch (docs/runtime.md,
"Channel hops"; figures: benchmarks/results/hop_breakdown.md). ``airflow.arroyo.hadoop.NioLocalFileSystem``
is Hadoop's ``LocalFileSystem`` (checksummed, as ``file:`` is by default) whose raw file system sets the same
bits through ``java.nio``: the same files and modes, no process. Files with a setuid or setgid bit still go
Hadoop's way (``chmod`` keeps a folder's setgid bit, ``java.nio`` clears it), as does the sticky bit. Its
``copyToLocalFile``, which Spark's RocksDB state store loads a checkpoint's SST files with, hard-links an ``.sst``
file where both folders are on one local file system instead of copying the whole state (docs/runtime.md,
"Restore"; ``-Dairflow.arroyo.linkSstFiles=false`` copies). Spark's
default checkpoint file manager writes through Hadoop's ``FileContext``, whose local file system is Hadoop's
own: a stage's query switches to the ``FileSystem`` manager (``runtime/spark_checkpoint.py``); a user's own
query on the session keeps its processes.

A session uses it when its JVM starts with the jar on the class path and ``spark.hadoop.fs.file.impl`` naming
the class: :func:`local_file_system_conf`. The driver applies it to sessions it builds for a ``local`` master,
and a local-master ``spark-submit`` gets it from the operator; elsewhere it is the user's choice
(docs/clusters.md), since the jar's path must exist on every node.

And ``airflow.arroyo.spark.SocketPaths``, for Python workers over Unix domain sockets (below): it has the JVM
forget the socket files Spark registered for deletion at exit and already deleted, a path per transfer to
Python that the JDK would keep until the JVM exits (docs/runtime.md, "The JVM's delete-on-exit list").
:class:`SocketPathPruner` (a pipeline's driver runs one) calls it; it needs the jar on the driver's class path:
:func:`master_conf` puts it there on local and standalone masters. On a standalone master, whose executors are
JVMs of their own (an executor registers a path per task of a Python ``transformWithState``), the jar's Spark
plugin ``airflow.arroyo.spark.SocketPathsPlugin`` (:data:`SOCKET_PATHS_PLUGIN`) runs the same rule in each
executor: :func:`master_conf` adds it to ``spark.plugins`` and ships the jar in ``spark.jars``.

And ``airflow.arroyo.spark.AbortableCheckpointFileManager``, Spark's streaming checkpoint files on S3 written
straight to their final objects (completed on close, aborted on cancel) instead of a temporary object copied and
deleted; ``runtime/spark_checkpoint.py`` names it for a stage whose checkpoint is on S3 (docs/runtime.md, "Object
storage"). :func:`s3a_conf` is the S3A side of the same settings: S3A's endpoint, addressing and region from the
AWS SDK's environment, which :func:`master_conf` adds where it adds the S3A jars.

:func:`master_conf` is everything the provider adds to a Spark application it starts, by master, in one
place (the driver's own session and the operator's ``spark-submit`` both call it). On a ``local`` master
(:func:`local_master_conf`): the jar's file system, and Python workers reached over a Unix domain socket
(``spark.python.unix.domain.socket.enabled``, Spark 4.1+) instead of loopback TCP, where each Python task
(a channel's read, any Python data source or UDF) waited for the socket (docs/runtime.md, "Python workers over
a Unix domain socket"). On a standalone master (``spark://``): the socket (each executor's workers are on its
own node; its socket files go to the JVM's temporary folder), the jar on the driver's class path and the
executors' plugin.
On YARN and Kubernetes nothing: a container's temporary folder can make a socket's path longer than Linux
allows (108 bytes). A value the user gave stands.

On local and standalone masters :func:`master_conf` also adds the provider's JVM artifacts to ``spark.jars``,
after the user's entries: Spark's Kafka connector and Hadoop's S3A file system with the AWS SDK modules it
uses, pinned in ``deps/spark/pom.xml`` and resolved by ``scripts/dev.sh`` (:mod:`airflow_arroyo.jvm.artifacts`;
none when they are not resolved). YARN and Kubernetes applications set ``spark.jars.packages`` or ship them in
their image (docs/clusters.md).

``python -m airflow_arroyo.jvm`` rebuilds the jar (``javac`` from a JDK 17 or newer, against this pyspark's
jars: :data:`COMPILE_JARS`); ``tests/runtime/test_jvm.py`` checks that the committed jar holds what ``src/``
compiles to.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import shutil
import subprocess
import tempfile
import zipfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

__all__ = ["COMPILE_JARS", "FS_IMPL_CONF", "JAR", "LOCAL_FILE_SYSTEM", "PYTHON_WORKER_SOCKET_CONF", "SOCKET_PATHS",
           "SOCKET_PATHS_PLUGIN", "SOURCES", "SocketPathPruner", "build_jar", "compile_classes", "compile_jars",
           "find_class", "local_file_system_conf", "local_master_conf", "master_conf", "master_kind", "s3a_conf",
           "spark_defaults", "spark_home"]

JAR = Path(__file__).with_name("airflow-arroyo-hadoop.jar")
SOURCES = Path(__file__).with_name("src")
LOCAL_FILE_SYSTEM = "airflow.arroyo.hadoop.NioLocalFileSystem"
FS_IMPL_CONF = "spark.hadoop.fs.file.impl"
#: Spark 4.1+: the JVM reaches its Python workers over a Unix domain socket instead of loopback TCP
PYTHON_WORKER_SOCKET_CONF = "spark.python.unix.domain.socket.enabled"
#: the jar's class that forgets deleted socket files (:class:`SocketPathPruner`)
SOCKET_PATHS = "airflow.arroyo.spark.SocketPaths"
#: the jar's Spark plugin that runs :data:`SOCKET_PATHS` in each executor's JVM (standalone masters)
SOCKET_PATHS_PLUGIN = "airflow.arroyo.spark.SocketPathsPlugin"
_DRIVER_CLASS_PATH = "spark.driver.extraClassPath"
_PLUGINS = "spark.plugins"
_JARS = "spark.jars"
#: a line of ``spark-defaults.conf`` as ``java.util.Properties`` reads it: a key, then whitespace, ``=`` or ``:``
#: (comments start with ``#`` or ``!``; continued lines are not supported)
_PROPERTY = re.compile(r"^\s*([^\s=:#!][^\s=:]*)(?:\s*[=:]\s*|\s+|$)(.*)$")
_CLASS_PATHS = (_DRIVER_CLASS_PATH, "spark.executor.extraClassPath")
log = logging.getLogger(__name__)

#: zip entries' time (the zip format's earliest): the jar's bytes depend on the classes only
_EPOCH = (1980, 1, 1, 0, 0, 0)


def local_file_system_conf(conf: Mapping[str, str] | None = None) -> dict[str, str]:
    """The Spark confs that make a session about to start read and write ``file:`` paths through
    :data:`LOCAL_FILE_SYSTEM`, merged with ``conf`` and the ``spark-defaults.conf`` spark-submit would read
    (the user's class paths are kept, the jar after them: a ``--conf`` replaces the defaults file's value).

    Empty when either already names a ``file:`` implementation (the user's choice stands) or the jar is
    missing (an incomplete install: Hadoop's own file system, as without this module). Only for a JVM that
    starts with these confs: a running session's class path does not change."""
    return _file_system_conf(_given(conf))


def _given(conf: Mapping[str, str] | None) -> dict[str, str]:
    """What the application starts with before the provider adds anything: ``spark-defaults.conf``, then
    ``conf`` (a ``--conf`` replaces the defaults file's value)."""
    return {**spark_defaults(), **(conf or {})}


def _file_system_conf(given: Mapping[str, str]) -> dict[str, str]:
    class_paths = _jar_on(_CLASS_PATHS, given)
    if FS_IMPL_CONF in given or not class_paths:
        return {}
    return {FS_IMPL_CONF: LOCAL_FILE_SYSTEM, **class_paths}


def _jar_on(class_paths: tuple[str, ...], given: Mapping[str, str]) -> dict[str, str]:
    """The jar after the class path ``given`` has for each of ``class_paths`` (nothing without the jar)."""
    if not JAR.is_file():
        return {}
    return {key: _listed(given.get(key), str(JAR), os.pathsep) for key in class_paths}


def local_master_conf(conf: Mapping[str, str] | None = None) -> dict[str, str]:
    """The Spark confs the provider adds to an application it starts on a ``local`` master, merged with
    ``conf`` and ``spark-defaults.conf``: the jar's ``file:`` file system (:func:`local_file_system_conf`: the
    user's class paths kept before the jar, a ``file:`` implementation the user names stands), and Python
    workers over a Unix domain socket (:data:`PYTHON_WORKER_SOCKET_CONF`; a value the user set stands), with the
    jar on the driver's class path for :class:`SocketPathPruner` even where the user's ``file:`` stands; and the
    provider's JVM artifacts in ``spark.jars`` after the user's entries (:func:`_artifact_conf`)."""
    given = _given(conf)
    return _artifact_conf(given, {**_socket_conf(given), **_file_system_conf(given)})


def master_kind(master: str) -> str | None:
    """The cluster manager a Spark master URL names: ``"local"`` (``local``, ``local[N]``...), ``"standalone"``
    (``spark://``), ``"kubernetes"`` (``k8s://``), ``"yarn"``; None for any other. The one reading of a master
    URL: :func:`master_conf` and the operator's ``DeployTarget`` (``submit/deploy.py``) use it."""
    for prefix, kind in (("local", "local"), ("spark://", "standalone"), ("k8s://", "kubernetes"), ("yarn", "yarn")):
        if master.startswith(prefix):
            return kind
    return None


def master_conf(master: str, conf: Mapping[str, str] | None = None) -> dict[str, str]:
    """The Spark confs the provider adds to an application it starts on ``master`` (the master URL), merged
    with ``conf`` and ``spark-defaults.conf``: a ``local`` master's are :func:`local_master_conf`'s; a
    standalone master (``spark://``) gets Python workers over a Unix domain socket
    (:data:`PYTHON_WORKER_SOCKET_CONF`), the jar on the driver's class path (:class:`SocketPathPruner`) and the
    executors' :data:`SOCKET_PATHS_PLUGIN`, each after the user's entries; both get the provider's JVM artifacts in
    ``spark.jars`` (:func:`_artifact_conf`); other masters nothing. A value the user set for the socket stands."""
    kind = master_kind(master)
    if kind == "local":
        return local_master_conf(conf)
    if kind == "standalone":
        given = _given(conf)
        return _artifact_conf(given, _socket_conf(given, executors=True))
    return {}


#: the AWS SDK's settings (the environment pyarrow and boto3 read, docs/runtime.md "Object storage") -> S3A's
_S3A = "spark.hadoop.fs.s3a."
_ENDPOINT_ENV = ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")
_REGION_ENV = ("AWS_REGION", "AWS_DEFAULT_REGION")


def s3a_conf(conf: Mapping[str, str] | None = None, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The S3A settings (``spark.hadoop.fs.s3a.*``) that make Hadoop's ``s3a://`` reach the S3 server the AWS SDK's
    environment names (``environ``, default ``os.environ``): the one pyarrow and boto3 reach for ``s3://`` URIs, so
    that Spark's checkpoints and file writes go where the channels and snapshots go. Merged with ``conf`` and
    ``spark-defaults.conf``: a key the user set stands.

    * ``AWS_ENDPOINT_URL_S3`` or ``AWS_ENDPOINT_URL`` -> ``fs.s3a.endpoint``, with ``fs.s3a.path.style.access=true``
      (pyarrow addresses a server given by an endpoint by path, as MinIO, Ceph and moto expect) and
      ``fs.s3a.connection.ssl.enabled`` from its scheme, and ``fs.s3a.optimized.copy.from.local.enabled=false``:
      S3A's optimized upload of a local file goes through the AWS SDK's asynchronous (Netty) client, which takes
      the ``100 Continue`` such servers answer its forced ``Expect: 100-continue`` with for the final status and
      fails the upload (``S3Exception ... Status Code: 100``), and RocksDB's state store uploads every SST file
      that way; the classic path streams it through S3A's block output stream;
    * ``AWS_REGION`` or ``AWS_DEFAULT_REGION`` -> ``fs.s3a.endpoint.region``.

    Never credentials: they stay in the environment (or a profile, or an instance role), which S3A's default
    credentials chain reads (``EnvironmentVariableCredentialsProvider``, then the instance's role), and out of
    command lines and logs."""
    env = os.environ if environ is None else environ
    given = _given(conf)
    out: dict[str, str] = {}
    endpoint = next((env[k] for k in _ENDPOINT_ENV if env.get(k)), None)
    if endpoint:
        out["endpoint"] = endpoint
        out["path.style.access"] = "true"
        scheme = endpoint.partition("://")[0].lower() if "://" in endpoint else ""
        if scheme in ("http", "https"):
            out["connection.ssl.enabled"] = "true" if scheme == "https" else "false"
        out["optimized.copy.from.local.enabled"] = "false"
    region = next((env[k] for k in _REGION_ENV if env.get(k)), None)
    if region:
        out["endpoint.region"] = region
    return {_S3A + key: value for key, value in out.items() if _S3A + key not in given}


def _artifact_conf(given: Mapping[str, str], out: dict[str, str]) -> dict[str, str]:
    """``out`` with the resolved jars of :data:`artifacts.SPARK` (Kafka connector, S3A) in ``spark.jars``, after the
    user's entries and the provider's jar where ``out`` has it: executors fetch them from the driver, and in client
    and local mode spark-submit puts them on the driver's class path. Unchanged when they are not resolved."""
    # imported here: `python -m airflow_arroyo.jvm.artifacts` runs that module, which must not be imported first
    from airflow_arroyo.jvm import artifacts

    jars = artifacts.resolved_jars(artifacts.SPARK)
    if not jars:
        return out
    out = {**out, **s3a_conf(given)}  # S3A is among them: where the environment names an S3 server, reach it
    value = out.get(_JARS, given.get(_JARS))
    for jar in jars:
        value = _listed(value, str(jar))
    return {**out, _JARS: value or ""}


def _socket_conf(given: Mapping[str, str], *, executors: bool = False) -> dict[str, str]:
    """Python workers over the socket unless the user set it, and where it is on (given or added) the jar on the
    driver's class path for :class:`SocketPathPruner` (the same value :func:`_file_system_conf` gives it); with
    ``executors`` (JVMs of their own) also :data:`SOCKET_PATHS_PLUGIN` in ``spark.plugins`` and the jar in
    ``spark.jars`` (each executor fetches it from the driver before it loads its plugins: the jar's path need
    not exist on the workers), each after the user's entries. No jar, no class path and no plugin."""
    out = {} if PYTHON_WORKER_SOCKET_CONF in given else {PYTHON_WORKER_SOCKET_CONF: "true"}
    if _socket_on(given.get(PYTHON_WORKER_SOCKET_CONF, "true")) and JAR.is_file():
        out.update(_jar_on((_DRIVER_CLASS_PATH,), given))
        if executors:
            out[_PLUGINS] = _listed(given.get(_PLUGINS), SOCKET_PATHS_PLUGIN)
            out[_JARS] = _listed(given.get(_JARS), str(JAR))
    return out


def _listed(value: str | None, item: str, sep: str = ",") -> str:
    """A Spark list (``sep``-separated: a comma, or a class path's separator) with ``item`` after the user's
    entries (kept where it is if already there)."""
    items = [part.strip() for part in (value or "").split(sep) if part.strip()]
    return sep.join(items if item in items else [*items, item])


def _socket_on(value: str | None) -> bool:
    """Whether a value of :data:`PYTHON_WORKER_SOCKET_CONF` turns the socket on."""
    return (value or "").strip().lower() == "true"


def spark_home() -> Path:
    """The Spark installation spark-submit runs from: ``$SPARK_HOME`` when it holds ``bin/spark-class``, else
    the pip ``pyspark`` package folder (it holds ``bin/spark-class``, ``conf/`` and ``jars/``)."""
    env = os.environ.get("SPARK_HOME")
    if env and (Path(env) / "bin" / "spark-class").exists():
        return Path(env)
    import pyspark

    home = Path(pyspark.__file__).resolve().parent
    if not (home / "bin" / "spark-class").exists():
        raise RuntimeError(
            f"{home} has no bin/spark-class: install the full 'pyspark' package (the apache-spark provider's "
            "[pyspark] extra), not only 'pyspark-client', or set SPARK_HOME to a Spark distribution"
        )
    return home


def spark_defaults() -> dict[str, str]:
    """The properties of the ``spark-defaults.conf`` spark-submit reads (``$SPARK_CONF_DIR``, else the
    ``conf/`` folder of :func:`spark_home`); empty without one."""
    folder = os.environ.get("SPARK_CONF_DIR")
    if not folder:
        try:
            folder = str(spark_home() / "conf")
        except (ImportError, RuntimeError):  # no Spark to submit with: no defaults file either
            return {}
    path = Path(folder, "spark-defaults.conf")
    if not path.is_file():
        return {}
    out = {}
    for line in path.read_text().splitlines():
        m = _PROPERTY.match(line)
        if m is not None:
            out[m.group(1)] = m.group(2).strip()
    return out


#: what the classes compile against, by file name in the Spark installation's ``jars/``: Hadoop's client, Spark's
#: plugin API (``spark-core``) and streaming checkpoint file managers (``spark-sql``) with what their signatures
#: name (Scala, Spark's utils, metrics, slf4j)
COMPILE_JARS = ("hadoop-client-*.jar", "spark-core_*.jar", "spark-sql_*.jar", "spark-common-utils_*.jar",
                "scala-library-*.jar", "metrics-core-*.jar", "slf4j-api-*.jar")


def compile_jars() -> list[Path]:
    """The jars of the Spark installation the classes compile against (:data:`COMPILE_JARS`)."""
    folder = spark_home() / "jars"
    jars = []
    for pattern in COMPILE_JARS:
        found = sorted(folder.glob(pattern))
        if not found:
            raise FileNotFoundError(f"no {pattern} in {folder}: install pyspark")
        jars += found
    return jars


def compile_classes(out: Path) -> dict[str, bytes]:
    """Compile :data:`SOURCES` into ``out``; the class files by their path inside the jar."""
    javac = shutil.which("javac")
    if javac is None:
        raise FileNotFoundError("javac not found: building the jar needs a JDK (17 or newer)")
    sources = sorted(str(p) for p in SOURCES.rglob("*.java"))
    classpath = os.pathsep.join(str(j) for j in compile_jars())
    subprocess.run([javac, "--release", "17", "-nowarn", "-cp", classpath, "-d", str(out), *sources],
                   check=True)
    return {p.relative_to(out).as_posix(): p.read_bytes() for p in sorted(out.rglob("*.class"))}


def build_jar(target: Path = JAR) -> Path:
    """Compile the sources and write the jar, its entries in a fixed order with a fixed time."""
    with tempfile.TemporaryDirectory(prefix="arroyo-jvm-") as tmp:
        classes = compile_classes(Path(tmp))
    with zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED) as jar:
        entries = {"META-INF/MANIFEST.MF": b"Manifest-Version: 1.0\r\nCreated-By: airflow-arroyo\r\n\r\n",
                   **classes}
        for name, data in entries.items():
            jar.writestr(zipfile.ZipInfo(name, _EPOCH), data)
    return target


class SocketPathPruner:
    """Has the driver's JVM forget the socket files Spark registered for deletion at exit and already deleted
    (docs/runtime.md, "The JVM's delete-on-exit list"): a pipeline's driver calls :meth:`prune` after each
    heartbeat. It works through the jar's :data:`SOCKET_PATHS`, which leaves the newest ``keep_newest`` paths (a
    path is registered just before its socket is bound) and every path that is not a Spark socket file's alone.
    Without that class on the driver's class path it does nothing, and logs once if the session's Python workers
    use the socket (:data:`PYTHON_WORKER_SOCKET_CONF`)."""

    def __init__(self, spark: SparkSession, *, keep_newest: int = 16) -> None:
        from py4j.protocol import Py4JError

        self.keep_newest = keep_newest  # more than the transfers that can be binding their socket at one moment
        self.forgotten = 0  # paths dropped so far
        self._helper: Any = None
        try:
            jvm = spark.sparkContext._jvm
            if find_class(jvm, [SOCKET_PATHS]) is not None:
                self._helper = functools.reduce(getattr, SOCKET_PATHS.split("."), jvm)
            elif _socket_on(spark.sparkContext.getConf().get(PYTHON_WORKER_SOCKET_CONF)):
                log.warning("Python workers use Unix domain sockets (%s) but %s is not on the driver's class "
                            "path: the driver's JVM keeps the path of every socket file Spark deleted until it exits "
                            "(docs/runtime.md, \"The JVM's delete-on-exit list\"); put %s on "
                            "spark.driver.extraClassPath", PYTHON_WORKER_SOCKET_CONF, SOCKET_PATHS, JAR)
        except Py4JError as exc:
            log.warning("cannot look for %s in the driver's JVM; not pruning its delete-on-exit list: %s",
                        SOCKET_PATHS, exc)

    @property
    def active(self) -> bool:
        """Whether it prunes (the jar's class is in the driver's JVM)."""
        return self._helper is not None

    def prune(self, keep_newest: int | None = None) -> int:
        """Drop the paths of Spark's socket files that are gone now; how many were dropped."""
        if self._helper is None:
            return 0
        from py4j.protocol import Py4JError, Py4JJavaError

        try:
            dropped = int(self._helper.forgetDeleted(self.keep_newest if keep_newest is None else keep_newest))
        except Py4JJavaError as exc:  # e.g. java.io not opened to the class path (Spark's launcher opens it)
            log.warning("cannot prune the JVM's delete-on-exit list, not trying again: %s", exc)
            self._helper = None
            return 0
        except Py4JError as exc:  # the gateway: the next heartbeat tries again
            log.warning("could not prune the JVM's delete-on-exit list: %s", exc)
            return 0
        self.forgotten += dropped
        return dropped

    def registered(self) -> int:
        """How many paths the JVM's delete-on-exit list holds (-1 when not active)."""
        return -1 if self._helper is None else int(self._helper.registered())


def find_class(jvm: Any, names: Iterable[str]) -> str | None:
    """The first of ``names`` (Java class names) that the JVM behind py4j's ``jvm`` has; None when it has none
    (or there is no JVM)."""
    if jvm is None:
        return None
    loader = jvm.java.lang.Thread.currentThread().getContextClassLoader()
    for name in names:
        try:
            jvm.java.lang.Class.forName(name, False, loader)
        except Exception:  # noqa: BLE001 - py4j's error for a class this JVM does not have
            continue
        return name
    return None
