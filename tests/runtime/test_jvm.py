"""The provider's jar (``airflow_arroyo.jvm``): it holds what its Java sources compile to; sessions the
provider starts for a local master use it; and its ``file:`` file system creates the same files with the same
modes as Hadoop's, fails on a missing file with an IOException naming it as Hadoop's does, and starts no
process (real Spark, real Hadoop classes)."""

from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import pytest
from py4j.protocol import Py4JJavaError

from airflow_arroyo.jvm import (
    FS_IMPL_CONF,
    JAR,
    LOCAL_FILE_SYSTEM,
    PYTHON_WORKER_SOCKET_CONF,
    SOCKET_PATHS_PLUGIN,
    SocketPathPruner,
    artifacts,
    compile_classes,
    find_class,
    local_file_system_conf,
    local_master_conf,
    master_conf,
    s3a_conf,
    spark_home,
)
from airflow_arroyo.submit.deploy import ClusterManager, DeployTarget, plan_submit
from airflow_arroyo.testing import wait_for
from tests.runtime.conftest import S3Server, s3a_on

pytestmark = pytest.mark.spark


def _javac_major() -> int | None:
    javac = shutil.which("javac")
    if javac is None:
        return None
    out = subprocess.run([javac, "-version"], capture_output=True, text=True, check=True)
    return int((out.stdout or out.stderr).split()[1].split(".")[0])


@pytest.mark.skipif(_javac_major() != 17, reason="the jar is built with JDK 17's javac (others emit other bytes)")
def test_the_committed_jar_holds_what_the_sources_compile_to(tmp_path: Path) -> None:
    classes = compile_classes(tmp_path)
    with zipfile.ZipFile(JAR) as jar:
        held = {name: jar.read(name) for name in jar.namelist() if name.endswith(".class")}
    assert held == classes, "rebuild the jar: python -m airflow_arroyo.jvm"
    assert f"{LOCAL_FILE_SYSTEM.replace('.', '/')}.class" in held


def test_the_conf_puts_the_jar_after_the_users_class_path_and_leaves_a_chosen_file_system() -> None:
    conf = local_file_system_conf({"spark.driver.extraClassPath": "/opt/mine.jar"})
    assert conf[FS_IMPL_CONF] == LOCAL_FILE_SYSTEM
    assert conf["spark.driver.extraClassPath"] == f"/opt/mine.jar{os.pathsep}{JAR}"
    assert conf["spark.executor.extraClassPath"] == str(JAR)
    assert local_file_system_conf({FS_IMPL_CONF: "org.apache.hadoop.fs.RawLocalFileSystem"}) == {}


def test_a_class_path_or_file_system_in_spark_defaults_is_kept(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """spark-submit reads spark-defaults.conf, and a --conf replaces what it says: the defaults' class path
    is kept before the jar, and a file: implementation named there stands (nothing is added)."""
    monkeypatch.setenv("SPARK_CONF_DIR", str(tmp_path))
    (tmp_path / "spark-defaults.conf").write_text("# site\nspark.driver.extraClassPath   /opt/jdbc.jar\n")
    conf = local_file_system_conf()
    assert conf["spark.driver.extraClassPath"] == f"/opt/jdbc.jar{os.pathsep}{JAR}"
    assert conf["spark.executor.extraClassPath"] == str(JAR)
    (tmp_path / "spark-defaults.conf").write_text(f"{FS_IMPL_CONF}\torg.apache.hadoop.fs.RawLocalFileSystem\n")
    assert local_file_system_conf() == {}


@pytest.fixture
def no_artifacts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No resolved JVM artifacts (an empty cache): what a master gets besides them."""
    monkeypatch.setenv(artifacts.CACHE_ENV, str(tmp_path / "no-jvm-cache"))


@pytest.mark.usefixtures("no_artifacts")
def test_a_local_master_gets_the_jar_and_python_workers_over_a_unix_socket_unless_the_user_chose(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPARK_CONF_DIR", str(tmp_path))  # no spark-defaults.conf
    conf = local_master_conf()
    assert conf == {**local_file_system_conf(), PYTHON_WORKER_SOCKET_CONF: "true"} and conf[FS_IMPL_CONF]
    assert PYTHON_WORKER_SOCKET_CONF not in local_master_conf({PYTHON_WORKER_SOCKET_CONF: "false"})
    (tmp_path / "spark-defaults.conf").write_text(f"{PYTHON_WORKER_SOCKET_CONF} false\n")
    assert PYTHON_WORKER_SOCKET_CONF not in local_master_conf() and FS_IMPL_CONF in local_master_conf()
    # a file: implementation the user names stands, and the socket is still added, with the jar on the driver's
    # class path for the SocketPathPruner
    assert local_master_conf({FS_IMPL_CONF: "org.apache.hadoop.fs.LocalFileSystem"}) == {}
    (tmp_path / "spark-defaults.conf").unlink()
    assert local_master_conf({FS_IMPL_CONF: "org.apache.hadoop.fs.LocalFileSystem"}) == {
        PYTHON_WORKER_SOCKET_CONF: "true", "spark.driver.extraClassPath": str(JAR)}


def test_the_sessions_python_workers_are_reached_over_a_unix_socket(spark: Any) -> None:
    """The session is built as the driver builds a local one: a Python task's connection to the JVM is a Unix
    domain socket (with loopback TCP each Python task took ~40 ms more: docs/runtime.md)."""
    import pyarrow as pa

    def socket_families(batches: Any) -> Any:
        import os as os_
        import socket
        import stat as stat_

        found = set()
        for fd in range(3, 4096):
            try:
                if not stat_.S_ISSOCK(os_.fstat(fd).st_mode):
                    continue
            except OSError:
                continue
            with socket.socket(fileno=os_.dup(fd)) as sock:
                found.add(getattr(sock.family, "name", str(sock.family)))
        for _ in batches:
            pass
        yield pa.record_batch({"family": pa.array(sorted(found), pa.string())})

    families = {r["family"] for r in spark.range(1).mapInArrow(socket_families, "family string").collect()}
    assert "AF_UNIX" in families and not families & {"AF_INET", "AF_INET6"}, families


@pytest.mark.usefixtures("no_artifacts")
def test_each_master_gets_what_the_provider_adds_there(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """local: the jar and the socket; standalone: the socket (executors' workers are on their own node; the
    standalone cluster test runs the demo with it) and the executors' socket path plugin; YARN and Kubernetes:
    nothing (a container's temporary folder can exceed a socket path's 108 bytes). A value the user set stands."""
    monkeypatch.setenv("SPARK_CONF_DIR", str(tmp_path))  # no spark-defaults.conf
    assert master_conf("local[2]") == local_master_conf()
    # the jar on the driver's class path (SocketPathPruner); executors fetch it from the driver (spark.jars) for
    # the plugin that prunes theirs: their nodes need not have its path
    assert master_conf("spark://h:7077") == {PYTHON_WORKER_SOCKET_CONF: "true", "spark.driver.extraClassPath": str(JAR),
                                             "spark.plugins": SOCKET_PATHS_PLUGIN, "spark.jars": str(JAR)}
    assert master_conf("spark://h:7077", {PYTHON_WORKER_SOCKET_CONF: "false"}) == {}
    assert master_conf("spark://h:7077", {"spark.driver.extraClassPath": "/opt/mine.jar"})[
        "spark.driver.extraClassPath"] == f"/opt/mine.jar{os.pathsep}{JAR}"
    assert master_conf("yarn") == {} and master_conf("k8s://https://h:6443") == {}
    # the defaults file as Spark reads it (java.util.Properties): 'key value', 'key=value' and 'key: value'
    (tmp_path / "spark-defaults.conf").write_text("! site\nspark.jars=/opt/a.jar,/opt/b.jar\n"
                                                  "spark.plugins : com.acme.Plugin\n")
    conf = master_conf("spark://h:7077")
    assert conf["spark.jars"] == f"/opt/a.jar,/opt/b.jar,{JAR}"
    assert conf["spark.plugins"] == f"com.acme.Plugin,{SOCKET_PATHS_PLUGIN}"
    (tmp_path / "spark-defaults.conf").write_text(f"{PYTHON_WORKER_SOCKET_CONF} false\n")
    assert master_conf("spark://h:7077") == {}


def test_a_submission_carries_its_masters_confs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPARK_CONF_DIR", str(tmp_path))  # no spark-defaults.conf
    local = plan_submit(DeployTarget.of("local[2]", None), dsn="postgresql://x", driver_application="d.py")
    assert local.conf[FS_IMPL_CONF] == LOCAL_FILE_SYSTEM and str(JAR) in local.conf["spark.driver.extraClassPath"]
    assert local.conf[PYTHON_WORKER_SOCKET_CONF] == "true"
    standalone = plan_submit(DeployTarget.of("spark://h:7077", "client"), dsn="postgresql://x",
                             driver_application="d.py")
    assert FS_IMPL_CONF not in standalone.conf and standalone.conf[PYTHON_WORKER_SOCKET_CONF] == "true"
    assert standalone.conf["spark.driver.extraClassPath"] == str(JAR)
    assert "spark.executor.extraClassPath" not in standalone.conf
    assert DeployTarget.of("spark://h:7077", "client").manager is ClusterManager.STANDALONE
    mine = plan_submit(DeployTarget.of("spark://h:7077", "client"), dsn="postgresql://x", driver_application="d.py",
                       conf={PYTHON_WORKER_SOCKET_CONF: "false"})
    assert mine.conf[PYTHON_WORKER_SOCKET_CONF] == "false"
    yarn = plan_submit(DeployTarget.of("yarn", "client"), dsn="postgresql://x", driver_application="d.py")
    assert FS_IMPL_CONF not in yarn.conf and PYTHON_WORKER_SOCKET_CONF not in yarn.conf


def test_the_rule_drops_only_the_paths_of_spark_socket_files_gone_and_not_among_the_newest(spark: Any,
                                                                                           tmp_path: Path) -> None:
    """SocketPaths' rule, on a set of this test's own (in the JVM's delete-on-exit list's order, oldest first):
    a Spark-named socket file that is gone goes; one that exists stays (its socket is being served), as do
    another file's path (gone or not) and the newest ``keep_newest`` entries."""
    jvm = spark.sparkContext._jvm
    rule = jvm.airflow.arroyo.spark.SocketPaths.forgetDeletedIn
    paths = jvm.java.util.LinkedHashSet()

    def sock(n: int) -> str:
        return str(tmp_path / f".00000000-0000-4000-8000-{n:012d}.sock")

    live = tmp_path / ".00000000-0000-4000-8000-000000000009.sock"
    live.write_bytes(b"")
    for path in (sock(1), str(live), str(tmp_path / "gone.txt"), str(tmp_path / ".not-a-uuid.sock"), sock(2),
                 sock(3)):
        paths.add(path)
    assert rule(paths, 1) == 2  # sock(1) and sock(2); sock(3) is the newest
    assert list(paths) == [str(live), str(tmp_path / "gone.txt"), str(tmp_path / ".not-a-uuid.sock"), sock(3)]
    assert rule(paths, 1) == 0 and rule(paths, 0) == 1 and not paths.contains(sock(3))
    live.unlink()
    assert rule(paths, 0) == 1 and list(paths) == [str(tmp_path / "gone.txt"), str(tmp_path / ".not-a-uuid.sock")]


def test_spark_leaves_a_path_per_transfer_and_the_pruner_forgets_it(spark: Any, tmp_path: Path) -> None:
    """Spark's leak in this session (Python workers over the socket): each transfer to Python (here
    ``toArrow()``) leaves its socket file's path in the JVM's delete-on-exit list though the file is gone; the
    pruner drops those from the JVM's own list (and a path of this test's registered the same way)."""
    pruner = SocketPathPruner(spark, keep_newest=0)
    assert pruner.active  # the session is built as the driver builds a local one: the jar on its class path
    jvm = spark.sparkContext._jvm
    before = pruner.registered()
    for _ in range(5):
        spark.range(3).toArrow()
    assert pruner.registered() >= before + 5  # Spark's: one path per transfer
    mine = str(tmp_path / ".00000000-0000-4000-8000-000000000001.sock")  # never created: gone
    jvm.java.io.File(mine).deleteOnExit()
    helper = jvm.airflow.arroyo.spark.SocketPaths
    assert helper.isRegistered(mine)
    dropped = [0]

    def forgot_them() -> bool:  # Spark deletes a transfer's file just after the transfer returns
        dropped[0] += pruner.prune()
        return dropped[0] >= 5 + 1

    wait_for(forgot_them, timeout=30, what="the pruner to drop the five transfers' paths and this test's")
    assert not helper.isRegistered(mine) and pruner.forgotten == dropped[0]


def _fs(spark: Any, raw: bool, ours: bool) -> Any:
    jvm = spark.sparkContext._jvm
    hadoop = jvm.org.apache.hadoop
    conf = spark.sparkContext._jsc.hadoopConfiguration()
    if ours:
        mine = jvm.airflow.arroyo.hadoop
        fs = mine.NioRawLocalFileSystem() if raw else mine.NioLocalFileSystem()
    else:
        fs = hadoop.fs.RawLocalFileSystem() if raw else hadoop.fs.LocalFileSystem()
    fs.initialize(jvm.java.net.URI.create("file:///"), conf)
    return fs


def _modes(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): stat.S_IMODE(p.stat().st_mode) for p in sorted(root.rglob("*"))}


def test_the_sessions_file_system_is_the_providers(spark: Any, tmp_path: Path) -> None:
    jvm = spark.sparkContext._jvm
    fs = jvm.org.apache.hadoop.fs.Path(f"file://{tmp_path}").getFileSystem(spark.sparkContext._jsc.hadoopConfiguration())
    assert fs.getClass().getName() == LOCAL_FILE_SYSTEM


@pytest.mark.parametrize("raw", [True, False], ids=["raw", "checksummed"])
def test_it_writes_what_hadoops_writes_with_the_same_modes(spark: Any, tmp_path: Path, raw: bool) -> None:
    jvm = spark.sparkContext._jvm
    hadoop = jvm.org.apache.hadoop
    perm = hadoop.fs.permission.FsPermission
    trees = {}
    for ours in (False, True):
        fs = _fs(spark, raw, ours)
        root = tmp_path / ("ours" if ours else "hadoops")
        base = f"file://{root}"
        assert fs.mkdirs(hadoop.fs.Path(f"{base}/a/b"), perm.createImmutable(0o750))
        for name, mode in (("f640", 0o640), ("f755", 0o755), ("f600", 0o600)):
            out = fs.create(hadoop.fs.Path(f"{base}/a/b/{name}"), perm.createImmutable(mode), True, 4096, 1,
                            1 << 20, None)
            out.write(bytearray(b"x" * 100))
            out.close()
        fs.setPermission(hadoop.fs.Path(f"{base}/a/b/f600"), perm.createImmutable(0o604))
        (root / "a" / "g").mkdir()
        os.chmod(root / "a" / "g", 0o2755)  # a group-shared folder: what is made below it inherits setgid
        assert fs.mkdirs(hadoop.fs.Path(f"{base}/a/g/sub"), perm.createImmutable(0o750))
        with pytest.raises(Py4JJavaError) as missing:  # Hadoop's: chmod's exit status; ours: FileNotFoundException
            fs.setPermission(hadoop.fs.Path(f"{base}/missing"), perm.createImmutable(0o644))
        assert jvm.java.lang.Class.forName("java.io.IOException").isInstance(missing.value.java_exception)
        assert f"{root.name}/missing" in str(missing.value.java_exception.getMessage())
        trees[ours] = _modes(root)
    assert trees[True] == trees[False]
    assert trees[True]["a/b/f600"] == 0o604
    assert trees[True]["a/g/sub"] == 0o2750  # chmod keeps a folder's setgid bit (java.nio would clear it)
    assert any(name.endswith(".crc") for name in trees[True]) is not raw  # the checksummed one writes .crc files


def test_it_starts_no_process(spark: Any, tmp_path: Path) -> None:
    """Hadoop's own starts a chmod per permission set here (no libhadoop in the pip pyspark); the provider's
    starts none: counted in /proc/stat, which counts every process started on the machine (other processes
    may start some meanwhile, never hundreds)."""
    if not sys.platform.startswith("linux"):
        pytest.skip("counts processes in /proc/stat")
    hadoop = spark.sparkContext._jvm.org.apache.hadoop
    if hadoop.io.nativeio.NativeIO.isAvailable():
        pytest.skip("libhadoop is loaded here: Hadoop's own file system starts no chmod either")
    path = hadoop.fs.Path(f"file://{tmp_path}/f")
    (tmp_path / "f").write_text("x")
    perm = hadoop.fs.permission.FsPermission.createImmutable(0o640)

    def started(fs: Any) -> int:
        before = _processes_started()
        for _ in range(200):
            fs.setPermission(path, perm)
        return _processes_started() - before

    assert started(_fs(spark, True, ours=False)) >= 200
    assert started(_fs(spark, True, ours=True)) < 50


def test_rocksdb_sst_files_are_linked_into_the_local_folder_not_copied(spark: Any, tmp_path: Path) -> None:
    """How Spark's RocksDB state store loads a checkpoint's SST files into its working folder (copyToLocalFile):
    a hard link to the same file, its bytes untouched; any other file, and every file with the system property
    off, a copy."""
    jvm = spark.sparkContext._jvm
    hadoop = jvm.org.apache.hadoop
    fs = _fs(spark, raw=False, ours=True)
    dfs = tmp_path / "checkpoint" / "SSTs"
    dfs.mkdir(parents=True)
    for name in ("000007-a.sst", "000008-b.log", "000009-c.sst"):
        (dfs / name).write_bytes(name.encode() * 1000)
    local = tmp_path / "working"

    def load(name: str, as_name: str) -> Path:
        fs.copyToLocalFile(hadoop.fs.Path(f"file://{dfs / name}"), hadoop.fs.Path((local / as_name).as_uri()))
        return local / as_name

    sst = load("000007-a.sst", "000007.sst")  # the parent folder is made as a copy would make it
    assert os.path.samefile(sst, dfs / "000007-a.sst") and sst.read_bytes() == b"000007-a.sst" * 1000
    log_file = load("000008-b.log", "000008.log")
    assert not os.path.samefile(log_file, dfs / "000008-b.log") and log_file.read_bytes() == b"000008-b.log" * 1000
    system = jvm.java.lang.System
    system.setProperty("airflow.arroyo.linkSstFiles", "false")
    try:
        off = load("000009-c.sst", "000009.sst")
    finally:
        system.clearProperty("airflow.arroyo.linkSstFiles")
    assert not os.path.samefile(off, dfs / "000009-c.sst") and off.read_bytes() == b"000009-c.sst" * 1000
    assert load("000007-a.sst", "000007.sst") == sst and os.path.samefile(sst, dfs / "000007-a.sst")  # again: kept
    sst.unlink()  # RocksDB deletes a compacted SST file: the checkpoint's stays
    assert (dfs / "000007-a.sst").read_bytes() == b"000007-a.sst" * 1000
    # a copy over a local file that is a link never writes through it: the linked file keeps its bytes
    (dfs / "000010-d.log").write_bytes(b"d" * 5000)
    os.link(dfs / "000010-d.log", local / "000010.log")
    copied = load("000008-b.log", "000010.log")
    assert copied.read_bytes() == b"000008-b.log" * 1000 and not os.path.samefile(copied, dfs / "000010-d.log")
    assert (dfs / "000010-d.log").read_bytes() == b"d" * 5000


def _processes_started() -> int:
    with open("/proc/stat") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("processes "))


# --------------------------------------------------------------------------- the provider's JVM artifacts

_JAR_NAME = re.compile(r"^(?P<name>.+?)-(?P<version>\d+\.\d+[^/]*)\.jar$")


def _shipped(folder: Path) -> dict[str, str]:
    """Jar file name without its version -> version, for the jars in ``folder``."""
    out = {}
    for jar in folder.glob("*.jar"):
        m = _JAR_NAME.match(jar.name)
        assert m is not None, jar.name
        out[m["name"]] = m["version"]
    return out


def _spark_jars() -> list[Path]:
    jars = artifacts.resolved_jars(artifacts.SPARK)
    if not jars:
        pytest.fail(f"the provider's JVM artifacts are not resolved in {artifacts.jar_folder(artifacts.SPARK)}: "
                    "run scripts/dev.sh setup")
    return jars


def test_the_pinned_coordinates_follow_the_installed_pyspark() -> None:
    """Spark's Kafka connector for this pyspark's Spark and Scala, hadoop-aws for its Hadoop: read from the jars
    pyspark ships, against the pom (the one list)."""
    pyspark_jars = _shipped(spark_home() / "jars")
    (core,) = [name for name in pyspark_jars if name.startswith("spark-core_")]
    scala = core.removeprefix("spark-core_")
    pinned = {c.artifact: c.version for c in artifacts.coordinates(artifacts.SPARK)}
    assert pinned[f"spark-sql-kafka-0-10_{scala}"] == pyspark_jars[core]
    assert pinned["hadoop-aws"] == pyspark_jars["hadoop-client-api"]
    assert "bundle" not in pinned and "software.amazon.awssdk:bundle" in artifacts.exclusions(artifacts.SPARK)
    conf = artifacts.packages_conf()
    assert conf["spark.jars.packages"].split(",")[:2] == [
        f"org.apache.spark:spark-sql-kafka-0-10_{scala}:{pyspark_jars[core]}",
        f"org.apache.hadoop:hadoop-aws:{pyspark_jars['hadoop-client-api']}"]
    assert {c.artifact for c in artifacts.coordinates(artifacts.KAFKA)} >= {f"kafka_{scala}"}


def test_the_resolved_jars_add_nothing_pyspark_already_ships() -> None:
    """A second copy of a jar on the class path loads whichever comes first: the pom excludes what pyspark has."""
    ours = _shipped(_spark_jars()[0].parent)
    assert {"spark-sql-kafka-0-10_2.13", "kafka-clients", "hadoop-aws", "s3"} <= set(ours)
    assert not set(ours) & set(_shipped(spark_home() / "jars"))
    assert sum(j.stat().st_size for j in _spark_jars()) < 100 << 20  # SDK modules, not the 690 MB bundle


def test_local_and_standalone_masters_get_the_resolved_jars_after_the_users(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The resolved set goes to spark.jars after the user's entries (and the provider's jar, on standalone); a set
    resolved from another version of the pom, or none, adds nothing; YARN and Kubernetes get nothing."""
    monkeypatch.setenv("SPARK_CONF_DIR", str(tmp_path))  # no spark-defaults.conf
    for name in ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "AWS_REGION", "AWS_DEFAULT_REGION"):
        monkeypatch.delenv(name, raising=False)  # no S3 server named (the s3_server fixture names one)
    cache = tmp_path / "cache"
    monkeypatch.setenv(artifacts.CACHE_ENV, str(cache))
    folder = cache / artifacts.SPARK
    folder.mkdir(parents=True)
    jars = [folder / "b-1.0.jar", folder / "a-2.0.jar"]
    for jar in jars:
        jar.write_bytes(b"")
    assert "spark.jars" not in master_conf("local[2]")  # no stamp: not resolved
    (folder / ".pom-0000000000000000").touch()
    assert "spark.jars" not in master_conf("local[2]")  # another pom's stamp
    artifacts.stamp(artifacts.SPARK).touch()
    ours = f"{jars[1]},{jars[0]}"
    assert master_conf("local[2]")["spark.jars"] == ours
    assert master_conf("local[2]", {"spark.jars": "/opt/mine.jar"})["spark.jars"] == f"/opt/mine.jar,{ours}"
    assert master_conf("spark://h:7077", {"spark.jars": "/opt/mine.jar"})["spark.jars"] == f"/opt/mine.jar,{JAR},{ours}"
    # the jars without the socket's plugin where the user turned the socket off
    assert master_conf("spark://h:7077", {PYTHON_WORKER_SOCKET_CONF: "false"}) == {"spark.jars": ours}
    assert master_conf("yarn") == {} and master_conf("k8s://https://h:6443") == {}


def test_s3a_reaches_the_server_the_aws_environment_names_and_never_gets_credentials(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """S3A settings from the AWS SDK's environment (what pyarrow reads for s3:// URIs), on local and standalone
    masters with the S3A jars; a key the user set stands; the keys stay in the environment."""
    monkeypatch.setenv("SPARK_CONF_DIR", str(tmp_path))  # no spark-defaults.conf
    env = {"AWS_ENDPOINT_URL": "http://127.0.0.1:9000", "AWS_REGION": "eu-west-3",
           "AWS_ACCESS_KEY_ID": "id", "AWS_SECRET_ACCESS_KEY": "secret"}
    s3a = "spark.hadoop.fs.s3a."
    assert s3a_conf(environ=env) == {f"{s3a}endpoint": "http://127.0.0.1:9000", f"{s3a}path.style.access": "true",
                                     f"{s3a}connection.ssl.enabled": "false", f"{s3a}endpoint.region": "eu-west-3",
                                     f"{s3a}optimized.copy.from.local.enabled": "false"}
    assert s3a_conf(environ={**env, "AWS_ENDPOINT_URL_S3": "https://s3.acme:443"})[f"{s3a}endpoint"] == (
        "https://s3.acme:443")
    assert s3a_conf({f"{s3a}path.style.access": "false"}, environ=env)[f"{s3a}endpoint"] == "http://127.0.0.1:9000"
    assert f"{s3a}path.style.access" not in s3a_conf({f"{s3a}path.style.access": "false"}, environ=env)
    assert s3a_conf(environ={"AWS_DEFAULT_REGION": "us-east-1"}) == {f"{s3a}endpoint.region": "us-east-1"}
    assert s3a_conf(environ={}) == {}
    assert not any("secret" in v or k.endswith(("key", "token")) for k, v in s3a_conf(environ=env).items())
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert _spark_jars(), "scripts/dev.sh setup resolves the JVM artifacts"
    for master in ("local[2]", "spark://h:7077"):
        assert s3a_conf(environ=env).items() <= master_conf(master).items()
    assert not any(k.startswith(s3a) for k in master_conf("yarn"))


def test_the_session_has_the_kafka_connector_and_s3a(spark: Any) -> None:
    """The test session is built as the driver builds a local one, so it has the resolved jars."""
    _spark_jars()
    jvm = spark.sparkContext._jvm
    for name in ("org.apache.spark.sql.kafka010.KafkaSourceProvider", "org.apache.hadoop.fs.s3a.S3AFileSystem",
                 "software.amazon.awssdk.services.s3.S3Client"):
        assert find_class(jvm, [name]) == name


def test_s3a_writes_reads_and_renames_on_a_real_s3_api(spark: Any, bucket: str, s3_server: S3Server) -> None:
    """Hadoop's S3A file system with the SDK modules the pom resolves (no bundle) against moto's S3 over HTTP:
    a Parquet write and read by Spark, and a rename (S3 copies then deletes). The settings are the bucket's own
    (``fs.s3a.bucket.<name>.*``): the session is shared."""
    name = bucket.removeprefix("s3://")
    with s3a_on(spark, s3_server, bucket) as hadoop_conf:
        spark.range(0, 100, 1, 2).write.parquet(f"s3a://{name}/t/data")
        assert sorted(r.id for r in spark.read.parquet(f"s3a://{name}/t/data").collect()) == list(range(100))
        assert any(k.startswith("t/data/part-") and k.endswith(".parquet") for k in s3_server.keys(f"{bucket}/t/data"))
        jvm = spark.sparkContext._jvm
        src = jvm.org.apache.hadoop.fs.Path(f"s3a://{name}/t/data")
        fs = src.getFileSystem(hadoop_conf)
        assert fs.getClass().getName() == "org.apache.hadoop.fs.s3a.S3AFileSystem"
        assert fs.rename(src, jvm.org.apache.hadoop.fs.Path(f"s3a://{name}/t/moved"))
        assert spark.read.parquet(f"s3a://{name}/t/moved").count() == 100
        assert not s3_server.keys(f"{bucket}/t/data/")


def test_the_abortable_checkpoint_file_manager_writes_the_final_object_or_nothing(
        spark: Any, bucket: str, s3_server: S3Server, tmp_path: Path) -> None:
    """The jar's checkpoint file manager on S3A: a file appears whole at its final name when closed (no temporary
    object, no copy), nothing appears when the write is cancelled, an existing file is not overwritten unless asked
    (and the refusal reaches the caller); a file system whose streams cannot be aborted is refused."""
    name = bucket.removeprefix("s3://")
    jvm = spark.sparkContext._jvm
    manager_class = "airflow.arroyo.spark.AbortableCheckpointFileManager"
    with s3a_on(spark, s3_server, bucket) as hadoop_conf:
        root = jvm.org.apache.hadoop.fs.Path(f"s3a://{name}/ckpt")
        manager = jvm.airflow.arroyo.spark.AbortableCheckpointFileManager(root, hadoop_conf)

        def write(path: str, data: bytes, *, overwrite: bool = False, cancel: bool = False) -> None:
            out = manager.createAtomic(jvm.org.apache.hadoop.fs.Path(f"s3a://{name}/ckpt/{path}"), overwrite)
            out.write(bytearray(data))
            out.cancel() if cancel else out.close()

        write("offsets/0", b"v1\n{}")
        write("offsets/1", b"half", cancel=True)
        assert s3_server.keys(f"{bucket}/ckpt") == {"ckpt/offsets/0": 5}  # no temporary object, nothing cancelled
        with pytest.raises(Py4JJavaError, match="FileAlreadyExistsException"):
            write("offsets/0", b"other")
        write("commits/0", b"v1")
        write("commits/0", b"v1\n{}", overwrite=True)
        assert s3_server.keys(f"{bucket}/ckpt") == {"ckpt/offsets/0": 5, "ckpt/commits/0": 5}
    with pytest.raises(Py4JJavaError, match="abort"):
        jvm.airflow.arroyo.spark.AbortableCheckpointFileManager(jvm.org.apache.hadoop.fs.Path(tmp_path.as_uri()),
                                                                 hadoop_conf)
    assert find_class(jvm, [manager_class]) == manager_class


def test_a_set_is_resolved_once_per_version_of_its_pom_and_never_half(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """resolve() runs Maven only without the pom's stamp, and a failed run leaves the folder as it was (no stamp,
    no staging folder), so that a half-copied folder never counts as resolved. A stand-in for mvn records its
    calls and copies one jar."""
    monkeypatch.setenv(artifacts.CACHE_ENV, str(tmp_path / "cache"))
    calls = tmp_path / "calls"
    mvn = tmp_path / "mvn"
    mvn.write_text(f'#!/bin/sh\necho "$@" >> {calls}\n[ -n "$FAIL_MVN" ] && exit 3\n'
                   'for a; do case $a in -DoutputDirectory=*) touch "${a#-DoutputDirectory=}/x-1.0.jar";; esac; done\n')
    mvn.chmod(0o755)
    folder = artifacts.resolve(artifacts.SPARK, mvn=str(mvn))
    assert folder == artifacts.jar_folder(artifacts.SPARK) and artifacts.resolved_jars() == [folder / "x-1.0.jar"]
    assert f"-f {artifacts.pom(artifacts.SPARK)}" in calls.read_text()
    artifacts.resolve(artifacts.SPARK, mvn=str(mvn))
    assert len(calls.read_text().splitlines()) == 1  # stamped: not again
    artifacts.stamp(artifacts.SPARK).unlink()  # as after a change of the pom
    monkeypatch.setenv("FAIL_MVN", "1")
    with pytest.raises(RuntimeError, match="failed"):
        artifacts.resolve(artifacts.SPARK, mvn=str(mvn))
    assert artifacts.resolved_jars() == [] and (folder / "x-1.0.jar").exists()
    assert sorted(p.name for p in folder.parent.iterdir()) == [".lock", artifacts.SPARK]
