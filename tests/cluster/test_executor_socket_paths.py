"""Executors' delete-on-exit lists on a real standalone cluster (the session's loopback master and two workers).

With Python workers over Unix domain sockets (the provider's default on standalone masters), each Python
``transformWithState`` task binds its state server to a socket file that Spark registers with
``File.deleteOnExit()`` and deletes when the task ends: the executor's JVM would keep every such path until it
exits. The application here runs such a query with the confs the provider adds on a standalone master
(``airflow_arroyo.jvm.master_conf``), which load the jar's ``SocketPathsPlugin`` into each executor from
``spark.jars``; the plugin's gauges, written by Spark's own CSV metrics sink in the executors, show the paths
it dropped and that the list stays small.
"""

from __future__ import annotations

import csv
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import IO

import pytest

from airflow_arroyo.devtools.spark_cluster import StandaloneCluster
from airflow_arroyo.testing import wait_for
from tests.cluster._socket_paths_app import KEEP_NEWEST, PARTITIONS

pytestmark = [pytest.mark.spark, pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(600)]

APP = Path(__file__).with_name("_socket_paths_app.py")
BATCHES = 12
GAUGES = "plugin.airflow.arroyo.spark.SocketPathsPlugin"


def gauge(metrics: Path, name: str) -> dict[str, int]:
    """The last value of an executor gauge, by file (one per executor), from the CSV sink's files."""
    values = {}
    for path in metrics.glob(f"*.{GAUGES}.{name}.csv"):
        with open(path, newline="") as f:
            rows = [r["value"] for r in csv.DictReader(f) if (r.get("value") or "").strip().lstrip("-").isdigit()]
        if rows:  # a line being written does not parse yet: the last whole one
            values[path.name] = int(rows[-1])
    return values


def first_line(stream: IO[str], timeout: float) -> str:
    """The first line of ``stream``, or "" when none comes within ``timeout`` seconds."""
    got: list[str] = []
    reader = threading.Thread(target=lambda: got.append(stream.readline()), daemon=True)
    reader.start()
    reader.join(timeout)
    return got[0] if got else ""


def test_executors_forget_the_socket_files_of_transform_with_state_tasks(
        spark_cluster: StandaloneCluster, tmp_path: Path) -> None:
    metrics = tmp_path / "metrics"
    metrics.mkdir()
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable, "PYSPARK_DRIVER_PYTHON": sys.executable,
           "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).parents[2]), os.environ.get("PYTHONPATH")]))}
    with subprocess.Popen([sys.executable, str(APP), spark_cluster.master_url, str(metrics), str(tmp_path / "ckpt"),
                           str(BATCHES)], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) as app:
        assert app.stdin is not None and app.stdout is not None
        try:
            assert first_line(app.stdout, 300).strip() == "ready", "the application ended or hung before its batches"
            # each batch ran a task per partition, each registering its state server's socket file
            tasks = BATCHES * PARTITIONS

            def pruned() -> bool:
                forgotten = gauge(metrics, "forgotten")
                return sum(forgotten.values()) >= tasks - 2 * (KEEP_NEWEST + PARTITIONS)

            wait_for(pruned, timeout=60, what="the executors' plugins to forget the tasks' socket paths")
            assert len(gauge(metrics, "forgotten")) >= 2, gauge(metrics, "forgotten")  # both executors pruned
            # what each list holds after a prune: the newest few and paths that are not Spark's socket files
            assert all(0 <= n <= KEEP_NEWEST + PARTITIONS + 8 for n in gauge(metrics, "registered").values()), \
                gauge(metrics, "registered")
        finally:
            try:
                app.stdin.write("stop\n")
                app.stdin.flush()
                app.wait(timeout=120)
            except (OSError, subprocess.TimeoutExpired):  # gone already, or stuck: the assertion above says why
                app.kill()
    assert app.returncode == 0
