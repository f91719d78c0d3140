"""The local Spark session every benchmark starts, its ``--conf KEY=VALUE`` option, the confs a product side's
session gets as the driver's would, and reading a query's progress, in one place."""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pyspark.sql import SparkSession
    from pyspark.sql.streaming import StreamingQuery


def conf_pair(text: str) -> tuple[str, str]:
    """``--conf`` values: ``KEY=VALUE`` (argparse names a bad one)."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expects KEY=VALUE, got {text!r}")
    return key, value


def product_confs(confs: Mapping[str, str], *, hadoop_local_fs: bool = False) -> dict[str, str]:
    """``confs`` plus what the driver adds to a local session it starts (``airflow_arroyo.jvm.local_master_conf``);
    ``hadoop_local_fs``: Hadoop's own ``file:`` file system (named, so the provider's is not added)."""
    from airflow_arroyo.jvm import FS_IMPL_CONF, local_master_conf

    out = dict(confs)
    if hadoop_local_fs:
        out.setdefault(FS_IMPL_CONF, "org.apache.hadoop.fs.LocalFileSystem")
    return {**out, **local_master_conf(out)}


def local_session_builder(app: str, *, master: str = "local[2]", driver_memory: str = "2g",
                          confs: Mapping[str, str] | None = None) -> SparkSession.Builder:
    """A builder for the benchmarks' session: ``master``, 2 shuffle partitions, no UI, then ``confs``."""
    from pyspark.sql import SparkSession

    builder = (SparkSession.builder.master(master).appName(app)
               .config("spark.sql.shuffle.partitions", "2").config("spark.default.parallelism", "2")
               .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false")
               .config("spark.driver.memory", driver_memory))
    for key, value in (confs or {}).items():
        builder = builder.config(key, value)
    return builder


def jvm_pid(spark: SparkSession) -> int:
    """The process id of ``spark``'s JVM (the driver's; in local mode every executor's too), for ``jcmd``."""
    jvm = spark.sparkContext._jvm
    assert jvm is not None
    return int(jvm.java.lang.ProcessHandle.current().pid())


def use_stage_checkpoint_manager(spark: SparkSession) -> None:
    """Give ``spark``'s queries the checkpoint file manager a stage's query uses on a local disk
    (``runtime/stage.py``), so a benchmark's own reader query writes its checkpoint as a stage would."""
    from airflow_arroyo.runtime.spark_checkpoint import CHECKPOINT_FILE_MANAGER_CONF, local_checkpoint_file_manager

    manager = local_checkpoint_file_manager(spark)
    if manager is not None:
        spark.conf.set(CHECKPOINT_FILE_MANAGER_CONF, manager)


def batches_with_rows(query: StreamingQuery, count: int) -> list[dict[str, Any]]:
    """The progress (as JSON) of ``query``'s first ``count`` micro-batches with rows, once it has run them.

    The query is stopped then; a failed query's error is raised. Spark keeps the last
    ``spark.sql.streaming.numRecentProgressUpdates`` (100 by default)."""
    try:
        progress: list[dict[str, Any]] = []
        while len(progress) < count:
            if query.exception() is not None:
                raise RuntimeError(str(query.exception()))
            progress = [json.loads(p.json) for p in query.recentProgress if p.numInputRows > 0]
            time.sleep(0.2)
    finally:
        query.stop()
    return progress
