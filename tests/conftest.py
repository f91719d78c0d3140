"""Shared fixtures: one throwaway PostgreSQL server and one SparkSession per test session.

* ``pg_server``: the server (session scope); ``pg_dsn``: a fresh, empty database per test (for tests
  that migrate it themselves); ``private_pg``: a server of the test's own (to restart).
* ``migrated_db``: makes fresh databases holding the epoch store's schema, each a copy of one database
  migrated once per session (``CREATE DATABASE ... TEMPLATE``: cheaper than migrating each);
  ``migrated_dsn``: one of them per test; ``store``: an :class:`~airflow_arroyo.store.EpochStore` on it.
* ``spark``: a local-mode SparkSession shared by the whole session (JVM start costs seconds).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from airflow_arroyo.devtools.postgres import ThrowawayPostgres

os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
# A throwaway AIRFLOW_HOME for the whole test session. It must be set before anything imports
# airflow (Airflow reads its configuration at import time), hence at conftest import.
_airflow_home: str | None = None
if "ARROYO_TEST_KEEP_AIRFLOW_HOME" not in os.environ:
    _airflow_home = tempfile.mkdtemp(prefix="arroyo-airflow-home-")
    os.environ["AIRFLOW_HOME"] = _airflow_home
    os.environ["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"] = f"sqlite:///{_airflow_home}/airflow.db"
    os.environ["AIRFLOW__CORE__LOAD_EXAMPLES"] = "False"
    os.environ["AIRFLOW__CORE__UNIT_TEST_MODE"] = "False"
    # Airflow writes a JWT secret into airflow.cfg only when it creates the file; whichever test
    # happens to import Airflow first must not decide whether later ones can mint tokens.
    os.environ.setdefault("AIRFLOW__API_AUTH__JWT_SECRET", uuid.uuid4().hex + uuid.uuid4().hex)
    os.environ["AIRFLOW__CORE__DAGS_FOLDER"] = str(Path(__file__).resolve().parent.parent / "dags")
    # The suite runs the operators' waits deferred, as deployments do; tests of the non-deferrable
    # mode pass deferrable=False.
    os.environ["AIRFLOW__OPERATORS__DEFAULT_DEFERRABLE"] = "True"
# Put the venv's bin first: spark-submit's find-spark-home runs `python3` from PATH.
os.environ["PATH"] = str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", "")


def pytest_unconfigure(config: pytest.Config) -> None:
    # Every session made its own home; left behind they piled up in /tmp (hundreds on a dev machine).
    if _airflow_home is not None:
        shutil.rmtree(_airflow_home, ignore_errors=True)


def _pg_base_dir() -> Path:
    """A folder for a test server's data: in memory (``/dev/shm``) when it has room. The session's server
    gathers a database per test, a gigabyte or more; on a disk mounted with ``discard`` deleting that many
    files took minutes at the end of the session, and creating them twice as long as in memory."""
    shm = Path("/dev/shm")
    in_memory = shm.is_dir() and os.access(shm, os.W_OK) and shutil.disk_usage(shm).free > 6 << 30
    return Path(tempfile.mkdtemp(prefix="arroyo-pg-", dir=shm if in_memory else None))


def _throwaway_server() -> Iterator[ThrowawayPostgres]:
    # Its own temp folder: pytest's temp folders are 0700, closed to the postgres user that the
    # server runs as when the tests run as root.
    base_dir = _pg_base_dir()
    pg = ThrowawayPostgres(base_dir=base_dir)
    try:
        pg.start()
        yield pg
    finally:
        try:
            pg.cleanup()
        finally:
            shutil.rmtree(base_dir, ignore_errors=True)


@pytest.fixture(scope="session")
def pg_server() -> Iterator[ThrowawayPostgres]:
    yield from _throwaway_server()


@pytest.fixture
def private_pg() -> Iterator[ThrowawayPostgres]:
    """A server of this test's own, to stop and restart without disturbing the others."""
    yield from _throwaway_server()


@pytest.fixture
def pg_dsn(pg_server: ThrowawayPostgres) -> str:
    return pg_server.create_database(f"t_{uuid.uuid4().hex[:12]}")


@pytest.fixture(scope="session")
def migrated_db(pg_server: ThrowawayPostgres) -> Callable[[str], str]:
    """``migrated_db(prefix)``: the DSN of a fresh database with the epoch store's schema, copied from a
    template migrated once per session (the migrations themselves are tested on ``pg_dsn``)."""
    from airflow_arroyo.store import EpochStore

    template = f"template_{uuid.uuid4().hex[:12]}"
    s = EpochStore(pg_server.create_database(template))
    try:
        s.migrate()
    finally:
        s.close()  # a template may have no connection open while it is copied

    def create(prefix: str) -> str:
        return pg_server.create_database(f"{prefix}_{uuid.uuid4().hex[:12]}", template=template)

    return create


@pytest.fixture
def migrated_dsn(migrated_db: Callable[[str], str]) -> str:
    """A fresh database of this test's own, with the epoch store's schema."""
    return migrated_db("t")


@pytest.fixture
def store(migrated_dsn: str) -> Iterator[Any]:
    from airflow_arroyo.store import EpochStore

    s = EpochStore(migrated_dsn)
    try:
        yield s
    finally:
        s.close()


@pytest.fixture(scope="session")
def airflow_db() -> str:
    """A migrated Airflow metadata DB (SQLite) in the session's throwaway AIRFLOW_HOME, for dag.test()."""
    home = os.environ["AIRFLOW_HOME"]
    subprocess.run([str(Path(sys.executable).parent / "airflow"), "db", "migrate"], check=True,
                   capture_output=True, env=os.environ.copy())
    return home


@pytest.fixture(scope="session")
def spark(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from pyspark.sql import SparkSession

    from airflow_arroyo.jvm import local_master_conf

    warehouse = tmp_path_factory.mktemp("spark-warehouse")
    builder = SparkSession.builder
    for key, value in local_master_conf().items():  # as the driver builds a local session
        builder = builder.config(key, value)
    session = (
        builder.master("local[2]")
        .appName("airflow-arroyo-tests")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.default.parallelism", "2")
        .config("spark.ui.enabled", "false")
        .config("spark.sql.warehouse.dir", str(warehouse))
        .config("spark.driver.memory", "2g")
        .config("spark.sql.streaming.stopTimeout", "30s")
        # Spark's state store maintenance (full .snapshot files, cleanup) every 200 ms instead of 60 s, so that
        # tests see the files a long-running query has (test_snapshot.py's full-snapshot test relies on it)
        .config("spark.sql.streaming.stateStore.maintenanceInterval", "200ms")
        .getOrCreate()
    )
    session.sparkContext.setLogLevel("WARN")
    try:
        yield session
    finally:
        session.stop()


@pytest.fixture(scope="session")
def kafka_broker() -> Iterator[Any]:
    """One Kafka broker (single-node KRaft on loopback, ``airflow_arroyo.devtools.kafka.KafkaBroker``) for the
    session, started by the first test that asks for it; its jars are the ones ``scripts/dev.sh`` resolves."""
    from airflow_arroyo.devtools.kafka import KafkaBroker
    from airflow_arroyo.jvm import artifacts

    if not artifacts.resolved(artifacts.KAFKA):
        pytest.fail(f"the Kafka broker's jars are not resolved in {artifacts.jar_folder(artifacts.KAFKA)}: "
                    "run scripts/dev.sh setup")
    broker = KafkaBroker()
    try:
        broker.start()
        yield broker
    finally:
        broker.cleanup()
