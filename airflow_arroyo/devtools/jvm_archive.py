"""A class-data-sharing archive of the classes a pipeline driver's JVM loads, for the test suite's JVMs.

A Spark driver's JVM spends most of its start loading, parsing and verifying the same few thousand classes of
Spark, Scala and Hadoop; the suite starts a driver JVM for every run it kills and restores. The JDK's dynamic
class-data sharing (``-XX:ArchiveClassesAtExit`` once, ``-XX:SharedArchiveFile`` after: JDK 13+) maps those
classes, already parsed and verified, from one file instead (benchmarks/results/jvm_archive.md).

``python -m airflow_arroyo.devtools.jvm_archive ensure`` (``scripts/dev.sh test``) trains the archive once per
JVM, Spark jars, provider jar and JVM options (:func:`archive_key`) with a short driver-like workload
(:func:`train`: a session as the provider starts it on a ``local`` master, a batch aggregation, a stateful
streaming query on RocksDB from the generator source, Parquet out and back), into ``<cache>/cds/``, and prints the
JVM options that use it; nothing when training fails (the suite then runs without it). The JVM only uses an
archive whose class path the starting JVM's class path begins with: every other JVM (spark-submit's launcher,
Kafka, a standalone master, worker or executor) ignores it, and ``-Xlog:cds=off`` keeps that quiet. Test tooling
only: a pipeline run outside the suite keeps the JVM's defaults.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from airflow_arroyo.jvm import JAR, artifacts, spark_home

__all__ = ["archive_key", "archive_path", "ensure", "train", "use_options"]

log = logging.getLogger(__name__)
_OPTIONS_ENV = "JDK_JAVA_OPTIONS"
#: a JVM that cannot use the archive (another class path) says so on stdout, where spark-submit's launcher prints
#: the command it builds
_QUIET = "-Xlog:cds=off -Xlog:cds+dynamic=off"
_TRAIN_TIMEOUT = 600.0
_MODULE = "airflow_arroyo.devtools.jvm_archive"


def _spark_jars() -> list[Path]:
    return sorted((spark_home() / "jars").glob("*.jar"))


def archive_key(java_options: str) -> str:
    """What an archive depends on: the JVM (``java -version``), the JVM options it runs with, pyspark's jars and the
    provider's jar (names, sizes and times: the JVM refuses an archive whose jars changed), and this module (its
    training)."""
    digest = hashlib.sha256()
    version = subprocess.run(["java", "-version"], capture_output=True, text=True, check=False,
                             env={k: v for k, v in os.environ.items() if k != _OPTIONS_ENV})
    digest.update(version.stderr.encode())
    digest.update(java_options.encode())
    for jar in [*_spark_jars(), JAR]:
        if jar.is_file():
            st = jar.stat()
            digest.update(f"{jar}:{st.st_size}:{st.st_mtime_ns}\n".encode())
    digest.update(Path(__file__).read_bytes())
    return digest.hexdigest()[:16]


def archive_path(java_options: str) -> Path:
    """Where the archive for ``java_options`` (the suite's ``JDK_JAVA_OPTIONS`` without the archive's) lives."""
    return artifacts.cache_dir() / "cds" / f"spark-driver-{archive_key(java_options)}.jsa"


def use_options(path: Path) -> str:
    """The JVM options that use the archive at ``path``."""
    return f"-XX:SharedArchiveFile={path} {_QUIET}"


def ensure(java_options: str) -> Path | None:
    """The archive for ``java_options``, trained now if missing (older ones removed); None when training failed."""
    path = archive_path(java_options)
    if path.is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    for old in path.parent.glob("spark-driver-*.jsa"):
        old.unlink()
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    env = {**os.environ, _OPTIONS_ENV: java_options}
    started = time.monotonic()
    try:
        done = subprocess.run([sys.executable, "-m", _MODULE, "train", str(tmp)], env=env, capture_output=True,
                              text=True, timeout=_TRAIN_TIMEOUT, check=False)
    except subprocess.TimeoutExpired:
        log.warning("class-data-sharing archive: training took over %.0f s; the JVMs start without one",
                    _TRAIN_TIMEOUT)
        tmp.unlink(missing_ok=True)
        return None
    if done.returncode != 0 or not tmp.is_file():
        log.warning("class-data-sharing archive: training failed (exit %s); the JVMs start without one:\n%s",
                    done.returncode, done.stderr[-2000:])
        tmp.unlink(missing_ok=True)
        return None
    tmp.replace(path)
    log.info("class-data-sharing archive %s trained in %.0f s", path, time.monotonic() - started)
    return path


def train(archive: Path) -> None:
    """Run a driver-like workload in a JVM that writes the classes it loaded to ``archive`` at its exit."""
    from pyspark.sql import SparkSession

    from airflow_arroyo.jvm import master_conf
    from airflow_arroyo.runtime.rescale import ROCKSDB_PROVIDER
    from airflow_arroyo.testing import generator_source, wait_for

    master = "local[2]"
    # the driver's JVM only: spark-submit's launcher JVM would write an archive of its own class path first
    conf = {**master_conf(master), "spark.driver.extraJavaOptions": f"-XX:ArchiveClassesAtExit={archive}",
            "spark.ui.enabled": "false", "spark.sql.shuffle.partitions": "2",
            "spark.sql.streaming.stateStore.providerClass": ROCKSDB_PROVIDER}
    builder = SparkSession.builder.master(master).appName("airflow-arroyo-jvm-archive")
    for key, value in conf.items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    with tempfile.TemporaryDirectory() as folder:
        spark.range(1000).selectExpr("id % 10 AS k").groupBy("k").count().collect()
        counts = (generator_source(spark, seed=1, total_rows=400, rows_per_batch=100)
                  .groupBy("key").count())
        query = (counts.writeStream.outputMode("update").option("checkpointLocation", f"{folder}/checkpoint")
                 .foreachBatch(lambda df, _batch: df.write.mode("append").parquet(f"{folder}/out"))
                 .start())
        wait_for(lambda: query.lastProgress is not None and query.lastProgress["batchId"] >= 2, timeout=300,
                 what="the training query's third batch")
        query.stop()
        spark.read.parquet(f"{folder}/out").count()
    spark.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m airflow_arroyo.devtools.jvm_archive", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("ensure", help="train the archive if missing; print the JVM options that use it")
    trainer = sub.add_parser("train", help="run the training workload, writing the archive to PATH")
    trainer.add_argument("path", type=Path)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="[jvm_archive] %(message)s", stream=sys.stderr)
    if args.cmd == "train":
        train(args.path)
        return 0
    path = ensure(os.environ.get(_OPTIONS_ENV, ""))
    if path is not None:
        print(use_options(path))
    return 0


if __name__ == "__main__":
    sys.exit(main())
