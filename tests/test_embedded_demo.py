"""The demo (``scripts/dev.sh demo``, airflow_arroyo/devtools/embedded.py) keeps what a person needs to read when
it fails (issue 30, finding 5 l): its temporary AIRFLOW_HOME, with the log it pointed at, and says where."""

from __future__ import annotations

import shutil
from collections.abc import Callable

import pytest

from airflow_arroyo.devtools.embedded import EmbeddedAirflow, EmbeddedSettings


def test_a_demo_that_ended_well_removes_its_temporary_home(capsys: pytest.CaptureFixture[str]) -> None:
    demo = EmbeddedAirflow(EmbeddedSettings())
    demo.log_path.write_text("airflow standalone's output\n")
    demo.__exit__(None, None, None)
    assert not demo.home.exists()


def test_a_demo_that_failed_keeps_its_home_and_says_where_the_log_is(capsys: pytest.CaptureFixture[str]) -> None:
    demo = EmbeddedAirflow(EmbeddedSettings())
    demo.log_path.write_text("airflow standalone's output\n")
    error = RuntimeError(f"airflow standalone exited (1); see {demo.log_path}")
    demo.__exit__(RuntimeError, error, None)
    try:
        assert demo.log_path.read_text() == "airflow standalone's output\n"
        assert f"kept {demo.home}" in capsys.readouterr().out and str(demo.log_path) in str(error)
    finally:
        shutil.rmtree(demo.home, ignore_errors=True)


def test_a_dag_run_that_did_not_succeed_keeps_the_home_too(capsys: pytest.CaptureFixture[str]) -> None:
    demo = EmbeddedAirflow(EmbeddedSettings())
    demo.log_path.write_text("airflow standalone's output\n")
    demo.failed = True  # what main() records when the example DAG run ends in another state than success
    demo.__exit__(None, None, None)
    try:
        assert demo.log_path.exists()
        out = capsys.readouterr().out
        assert f"kept {demo.home}" in out and str(demo.log_path) in out
    finally:
        shutil.rmtree(demo.home, ignore_errors=True)


def test_the_demo_shows_the_newest_epoch_that_committed_output(migrated_db: Callable[[str], str]) -> None:
    from airflow_arroyo.devtools.embedded import _EpochFollower
    from airflow_arroyo.store import EpochStore
    from tests.controlplane.test_store import complete
    from tests.support import running

    dsn = migrated_db("demo")
    store = EpochStore(dsn, max_connections=1)
    follower = _EpochFollower(dsn, "demo")
    try:
        running(store, "demo", stages=["src", "out"])
        epochs = [complete(store, "demo") for _ in range(3)]
        follower()
        assert follower.worth_showing() == epochs[-1]  # nothing committed: the newest completed
        store.record_sink_commit("demo", epochs[1], "out", uri="file:///tmp/out", batch_id=4, files=1, rows=3,
                                 bytes_committed=10)
        assert follower.worth_showing() == epochs[1]
    finally:
        follower.close()
        store.close()
