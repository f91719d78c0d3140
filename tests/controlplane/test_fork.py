"""Forks against a real Postgres epoch store and real files: a fork shares its fork point's snapshot
objects, and retention of either pipeline never deletes what the other still needs."""

from __future__ import annotations

from pathlib import Path

import pytest

from airflow_arroyo.core.epochs import EpochState, PipelineState, RetentionPolicy
from airflow_arroyo.core.exceptions import ConfigurationError, UnknownEpochError, UnknownPipelineError
from airflow_arroyo.store import EpochStore
from tests.controlplane.test_retention import Pipeline, prune
from tests.support import sql


def _fork_runs(store: EpochStore, root: Path, fork_id: str) -> Pipeline:
    """The fork's first run, as the store sees it: registered and running under the fork's id."""
    fork = Pipeline.__new__(Pipeline)
    fork.store, fork.id, fork.root, fork.stages = store, fork_id, root, ("src", "agg")
    store.register_pipeline(fork_id, stages=list(fork.stages), run_id="fork-run-1", storage_uri=str(root))
    store.set_pipeline_state(fork_id, PipelineState.RUNNING)
    return fork


def test_a_fork_shares_its_fork_point_and_neither_retention_deletes_what_the_other_needs(
        store: EpochStore, tmp_path: Path) -> None:
    source = Pipeline(store, tmp_path)
    # incremental epochs: "base" shared by all, one object of their own each
    own = {source.epoch({"src": {"base": 100}, "agg": {f"state-{i}": 10}}): f"state-{i}" for i in range(4)}
    e1, e2, e3, e4 = own

    fork = store.fork_pipeline("orders", e2, "orders-b")

    assert (fork.pipeline_id, fork.state, fork.run_id, fork.forked_from_pipeline, fork.forked_from_epoch) == (
        "orders-b", PipelineState.STOPPED, None, "orders", e2)
    assert fork.forked_at is not None and fork.last_epoch == e2 and fork.stages == ["src", "agg"]
    assert fork.storage_uri == str(tmp_path)
    assert store.get_epoch("orders", e2).pin_label == "fork:orders-b"
    assert store.fork_pipeline("orders", e2, "orders-b") == fork  # a retried fork returns it
    assert [f.pipeline_id for f in store.forks_of("orders")] == ["orders-b"]
    assert store.waiting_forks("orders", e2) == ["orders-b"] and store.waiting_forks("orders", e3) == []
    # nothing was copied: the fork records no object of its own
    assert sql(store, "SELECT count(*) FROM arroyo_objects WHERE pipeline_id = 'orders-b'") == [(0,)]

    # the source's retention keeps the fork point and every object a restore of it reads
    report = prune(store, policy=RetentionPolicy(keep_last=1))
    assert (report.epochs_pruned, report.kept) == ([e1, e3], [e2, e4])
    for stage in source.stages:
        for entry in store.snapshot_entries("orders", e2, stage):
            assert source.path(entry.object_key).stat().st_size == entry.bytes
    # and the fork point cannot be unpinned while the fork still needs it
    with pytest.raises(ConfigurationError, match=rf"epoch {e2} of pipeline 'orders' is the fork point of orders-b.*"
                       r"--force"):
        store.unpin_epoch("orders", e2)

    # the fork's first run: registering keeps the fork point, its epochs are numbered after it, and its
    # snapshots are its own (its first epoch copies every file: it knows no object yet)
    runner = _fork_runs(store, tmp_path, "orders-b")
    again = store.get_pipeline("orders-b")
    assert (again.forked_from_pipeline, again.forked_from_epoch) == ("orders", e2)
    f1 = runner.epoch({"src": {"base": 100}, "agg": {"fork-state": 10}})
    assert f1 == e2 + 1
    assert runner.path("base").exists() and runner.path("base") != source.path("base")
    assert store.waiting_forks("orders") == []

    # now the fork point may be unpinned and pruned; the fork's own copy stays
    store.unpin_epoch("orders", e2)
    assert prune(store, policy=RetentionPolicy(keep_last=1)).epochs_pruned == [e2]
    assert not source.path(own[e2]).exists() and runner.path("base").exists()
    # the fork's retention deletes only its own objects, never the source's
    f2 = runner.epoch({"src": {"base": 100}, "agg": {"fork-state-2": 10}})
    assert prune(store, "orders-b", policy=RetentionPolicy(keep_last=1)).epochs_pruned == [f1]
    assert not runner.path("fork-state").exists() and runner.path("fork-state-2").exists()
    assert source.path("base").exists() and source.path(own[e4]).exists()
    assert runner.states() == {f1: EpochState.PRUNED, f2: EpochState.COMPLETED}


def test_forking_refuses_bad_input_and_changes_nothing(store: EpochStore, tmp_path: Path) -> None:
    source = Pipeline(store, tmp_path)
    done = source.epoch({"src": {"a": 1}})
    failed = source.epoch({"src": {"b": 1}}, end="fail")
    Pipeline(store, tmp_path / "other", "taken", stages=("src",))
    store.pin_epoch("orders", done, "before the upgrade")

    with pytest.raises(ConfigurationError, match=rf"epoch {failed} of pipeline 'orders' is failed, not completed"):
        store.fork_pipeline("orders", failed, "orders-b")
    with pytest.raises(UnknownEpochError, match="has no epoch 99 to fork from"):
        store.fork_pipeline("orders", 99, "orders-b")
    with pytest.raises(UnknownPipelineError):
        store.fork_pipeline("nope", 1, "orders-b")
    with pytest.raises(ConfigurationError, match="pipeline 'taken' already exists; fork to a new pipeline id"):
        store.fork_pipeline("orders", done, "taken")
    with pytest.raises(ConfigurationError, match="a fork needs a new pipeline id"):
        store.fork_pipeline("orders", done, "orders")
    with pytest.raises(ConfigurationError):
        store.fork_pipeline("orders", done, "bad id!")
    assert sql(store, "SELECT count(*) FROM arroyo_pipelines WHERE forked_from_pipeline IS NOT NULL") == [(0,)]

    # an epoch pinned already keeps its label; force unpins a fork point whose fork is abandoned
    store.fork_pipeline("orders", done, "orders-b")
    assert store.get_epoch("orders", done).pin_label == "before the upgrade"
    assert store.unpin_epoch("orders", done, force=True).pin_label is None
