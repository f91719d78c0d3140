"""The local Spark session every benchmark starts, its ``--conf KEY=VALUE`` option, and the confs a product side's
session gets as the driver's would, in one place."""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pyspark.sql import SparkSession


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
