"""The local Spark session every benchmark starts, and its ``--conf KEY=VALUE`` option, in one place."""

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
