"""The Spark standalone cluster for the cluster tests: a master and two workers on loopback (session
scope, started only when a test asks for it; 1 core and 1 GB each, on a 2-core machine)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from airflow_arroyo.devtools.spark_cluster import StandaloneCluster


@pytest.fixture(scope="session")
def spark_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StandaloneCluster]:
    cluster = StandaloneCluster(workers=2, cores=1, memory="1g", base_dir=tmp_path_factory.mktemp("spark-cluster"))
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()
