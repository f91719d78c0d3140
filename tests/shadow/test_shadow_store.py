"""Shadow runs against a real PostgreSQL epoch store: start = fork + pin + record, discard unpins and leaves the
live pipeline untouched, promote refuses a running shadow; the CLI's list/discard with --json."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from airflow_arroyo.cli import main
from airflow_arroyo.core.epochs import PipelineState
from airflow_arroyo.core.exceptions import ConfigurationError, StateConflictError
from airflow_arroyo.core.shadow import discard_shadow, promote_shadow, start_shadow
from airflow_arroyo.runtime.pipeline import Pipeline as Code
from airflow_arroyo.store import EpochStore
from tests.controlplane.test_retention import Pipeline


def _new_code() -> Code:
    p = Code("orders")
    src = p.source("src", lambda spark: spark.readStream.format("rate").load())
    p.sink("agg", [src], format="parquet", options={"path": "/data/agg"})
    return p


def test_start_records_the_shadow_and_discard_unpins_leaving_the_live_pipeline_alone(
        store: EpochStore, tmp_path: Path, migrated_dsn: str) -> None:
    live = Pipeline(store, tmp_path)
    e1 = live.epoch({"src": {"a": 1}, "agg": {"b": 1}})
    e2 = live.epoch({"src": {"a": 1}, "agg": {"c": 1}})
    before = store.get_pipeline("orders")

    shadow = start_shadow(store, "orders", e1, "orders-v2", "my.code:v2", pipeline=_new_code())

    assert (shadow.live_id, shadow.fork_epoch, shadow.code, shadow.state) == ("orders", e1, "my.code:v2", "active")
    assert shadow.sinks == {"agg": {"kind": "files", "format": "parquet", "live": "/data/agg",
                                    "shadow": "/data/agg.shadow-orders-v2"}}
    assert store.get_epoch("orders", e1).pin_label == "fork:orders-v2"
    assert start_shadow(store, "orders", e1, "orders-v2", "my.code:v2", pipeline=_new_code()) == shadow  # retried
    assert [s.shadow_id for s in store.shadows_of("orders")] == ["orders-v2"]

    out = io.StringIO()
    assert main(["shadow", "list", "orders", "--dsn", migrated_dsn, "--json"], stdout=out) == 0
    assert [s["shadow_id"] for s in json.loads(out.getvalue())] == ["orders-v2"]

    store.register_pipeline("orders-v2", stages=["src", "agg"], run_id="shadow-run", storage_uri=str(tmp_path))
    store.set_pipeline_state("orders-v2", PipelineState.RUNNING)
    with pytest.raises(StateConflictError, match="stop it first"):
        discard_shadow(store, "orders-v2")
    with pytest.raises(StateConflictError, match="stop it first"):
        promote_shadow(store, "orders-v2")
    store.set_pipeline_state("orders-v2", PipelineState.STOPPED, run_id="shadow-run")

    err = io.StringIO()
    assert main(["shadow", "discard", "orders-v2", "--dsn", migrated_dsn, "--json"], stdout=out, stderr=err) == 2
    assert "has not completed an epoch of its own" in err.getvalue()  # its fork point is still needed: --force
    out = io.StringIO()
    assert main(["shadow", "discard", "orders-v2", "--force", "--dsn", migrated_dsn, "--json"], stdout=out) == 0
    assert json.loads(out.getvalue())["state"] == "discarded"
    assert store.get_epoch("orders", e1).pin_label is None
    after = store.get_pipeline("orders")
    assert (after.state, after.run_id, after.last_epoch) == (before.state, before.run_id, before.last_epoch)
    assert store.get_epoch("orders", e2).state == store.get_epoch("orders", e1).state
    assert discard_shadow(store, "orders-v2").state == "discarded"  # again: a no-op
    with pytest.raises(StateConflictError, match="discarded"):
        promote_shadow(store, "orders-v2")


def test_start_refuses_a_sink_it_cannot_redirect_before_forking(store: EpochStore, tmp_path: Path) -> None:
    live = Pipeline(store, tmp_path)
    e1 = live.epoch({"src": {"a": 1}, "agg": {"b": 1}})
    code = Code("orders")
    src = code.source("src", lambda spark: spark.readStream.format("rate").load())
    code.sink("agg", [src], foreach_batch=lambda df, b: None)
    with pytest.raises(ConfigurationError, match="sink 'agg' writes foreach_batch"):
        start_shadow(store, "orders", e1, "orders-v2", "my.code:v2", pipeline=code)
    assert store.forks_of("orders") == [] and store.get_epoch("orders", e1).pin_label is None


def test_the_cli_starts_a_shadow_and_prints_its_driver_command(store: EpochStore, tmp_path: Path,
                                                               migrated_dsn: str) -> None:
    live = Pipeline(store, tmp_path)
    e1 = live.epoch({"src": {"a": 1}, "agg": {"b": 1}})
    out = io.StringIO()
    assert main(["shadow", "start", "orders", "--epoch", str(e1), "--to", "orders-v3", "--pipeline-module",
                 "tests.shadow.test_shadow_store:_new_code", "--dsn", migrated_dsn, "--json"], stdout=out) == 0
    started = json.loads(out.getvalue())
    assert (started["shadow_id"], started["live_id"], started["fork_epoch"]) == ("orders-v3", "orders", e1)
    command = started["command"]
    assert command[command.index("--pipeline") + 1] == "airflow_arroyo.core.shadow:shadow_code"
    assert "code=tests.shadow.test_shadow_store:_new_code" in command and "shadow_id=orders-v3" in command
    assert store.get_shadow("orders-v3").sinks["agg"]["shadow"] == "/data/agg.shadow-orders-v3"
    out = io.StringIO()
    assert main(["shadow", "compare", "orders-v3", "--dsn", migrated_dsn, "--json"], stdout=out) == 0
    assert json.loads(out.getvalue())["diffs"] == []  # no epoch after the fork point on either side yet
    out = io.StringIO()
    assert main(["shadow", "compare", "orders-v3", "--dsn", migrated_dsn], stdout=out) == 0
    assert "shadow orders-v3 of orders (fork point epoch" in out.getvalue()
