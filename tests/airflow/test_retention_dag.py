"""The retention DAG and PruneEpochsOperator in real Airflow (``dag.test()``) against a real epoch store."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from airflow.sdk.exceptions import AirflowFailException

from airflow_arroyo.core.epochs import EpochState
from airflow_arroyo.core.exceptions import ConfigurationError
from airflow_arroyo.hooks import arroyo as hook_module
from airflow_arroyo.operators.retention import PruneEpochsOperator
from airflow_arroyo.store import EpochStore
from tests.controlplane.test_retention import Pipeline

DAG_FILE = Path(__file__).resolve().parents[2] / "dags" / "arroyo_retention.py"

pytestmark = pytest.mark.airflow


@pytest.fixture(autouse=True)
def fresh_shared_stores() -> Iterator[None]:
    hook_module._reset_shared_stores()
    yield
    hook_module._reset_shared_stores()


def load_dag_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("arroyo_retention_dag_under_test", DAG_FILE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_dag_shape(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIRFLOW_VAR_ARROYO_RETENTION_SCHEDULE", "@hourly")
    dag = load_dag_module().dag
    assert dag.dag_id == "arroyo_retention"
    assert dag.max_active_runs == 1 and dag.catchup is False
    assert dag.timetable.expression == "0 * * * *"  # the Variable (@hourly) wins over the default
    assert {t.task_id for t in dag.tasks} == {"registered_pipelines", "prune_epochs"}
    assert dag.get_task("prune_epochs").upstream_task_ids == {"registered_pipelines"}
    prune = dag.get_task("prune_epochs").partial_kwargs
    assert "arroyo_retention_compact_after" in prune["compact_after"] and dag.params["compact_after"] == "7d"


@pytest.mark.usefixtures("airflow_db")
def test_retention_dag_prunes_every_registered_pipeline(
    store: EpochStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AIRFLOW_CONN_ARROYO_DEFAULT", store.dsn)
    monkeypatch.setenv("AIRFLOW_VAR_ARROYO_RETENTION_KEEP_LAST", "1")
    orders = Pipeline(store, tmp_path / "a", "orders", stages=("src",))
    clicks = Pipeline(store, tmp_path / "b", "clicks", stages=("src",))
    for pipe in (orders, clicks):
        pipe.epoch({"src": {"k1": 100}})
        pipe.epoch({"src": {"k1": 100, "k2": 10}})  # k1 shared with the latest epoch: survives
        pipe.epoch({"src": {"k1": 100, "k3": 1}})

    dag = load_dag_module().dag
    run = dag.test()

    assert run.state == "success"
    for pipe in (orders, clicks):
        assert pipe.states() == {1: EpochState.PRUNED, 2: EpochState.PRUNED, 3: EpochState.COMPLETED}
        assert [pipe.path(k).exists() for k in ("k1", "k2", "k3")] == [True, False, True]
        (cleanup,) = store.list_cleanup_runs(pipe.id)
        assert cleanup.state == "succeeded" and cleanup.bytes_freed == 10
        assert cleanup.holder.startswith("airflow:arroyo_retention/prune_epochs[")
        assert store.cleanup_lock(pipe.id) is None
    reports = {ti.map_index: ti.xcom_pull(task_ids="prune_epochs", map_indexes=ti.map_index)
               for ti in run.get_task_instances() if ti.task_id == "prune_epochs"}
    assert sorted(r["pipeline_id"] for r in reports.values()) == ["clicks", "orders"]
    assert all(r["epochs_pruned"] == [1, 2] and r["bytes_freed"] == 10 for r in reports.values())
    # then it scrubbed (the [arroyo] retention_scrub_budget default): these test objects are zeros under
    # made-up keys, so nothing hashes to its name and the retained epoch is reported damaged
    assert all((r["objects_verified"], r["damaged_epochs"], r["restorable_epochs"]) == (2, [3], [])
               for r in reports.values())


class _NoStore:
    def get_store(self) -> Any:
        raise AssertionError("the store must not be touched before the arguments are valid")


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({}, "keeps nothing"),
        ({"keep_last": "0"}, "keep_last must be a whole number >= 1"),
        ({"keep_last": -3}, "keep_last must be a whole number >= 1"),
        ({"keep_newer_than": "soon"}, "not a duration"),
    ],
)
def test_bad_policy_fails_when_the_dag_is_parsed_naming_the_task(kwargs: dict[str, Any], needle: str) -> None:
    with pytest.raises(ConfigurationError) as info:
        PruneEpochsOperator(task_id="prune_orders", pipeline_id="orders", **kwargs)
    assert str(info.value).startswith("task 'prune_orders': ") and needle in str(info.value)


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"keep_last": "{{ not rendered }}x"}, "whole number"),
        ({"keep_last": 1, "lock_wait": "forever"}, "lock_wait"),
        ({"keep_last": 1, "scrub_budget": "often"}, "scrub_budget"),
    ],
)
def test_bad_rendered_arguments_fail_without_touching_the_store(kwargs: dict[str, Any], needle: str) -> None:
    op = PruneEpochsOperator(task_id="prune", pipeline_id="orders", **kwargs)
    op.hook = _NoStore()  # type: ignore[assignment]
    with pytest.raises(AirflowFailException, match=needle):
        op.execute({})  # type: ignore[arg-type]


def test_unknown_pipeline_fails_without_retries(store: EpochStore, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIRFLOW_CONN_ARROYO_DEFAULT", store.dsn)
    op = PruneEpochsOperator(task_id="prune", pipeline_id="nope", keep_last=3)
    with pytest.raises(AirflowFailException, match="no pipeline named 'nope'"):
        op.execute({})  # type: ignore[arg-type]


def test_operator_reports_a_skip_when_the_lock_stays_held(store: EpochStore, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIRFLOW_CONN_ARROYO_DEFAULT", store.dsn)
    pipe = Pipeline(store, tmp_path, "orders", stages=("src",))
    pipe.epoch({"src": {"a": 1}})
    pipe.epoch({"src": {"b": 1}})
    store.acquire_cleanup_lock("orders", "someone-else", ttl=600)
    op = PruneEpochsOperator(task_id="prune", pipeline_id="orders", keep_last="1", lock_wait=0)
    report = op.execute({})  # type: ignore[arg-type]
    assert report["skipped_reason"] and "someone-else" in report["skipped_reason"]
    assert report["epochs_pruned"] == [] and pipe.path("a").exists()
