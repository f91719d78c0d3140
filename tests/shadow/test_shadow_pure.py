"""Shadow runs, the pure parts: the sink redirection plan, the alignment of epochs by input, the row diff."""

from __future__ import annotations

import pytest

from airflow_arroyo.core.exceptions import ConfigurationError
from airflow_arroyo.core.shadow import (
    EpochInput,
    Window,
    align_windows,
    diff_rows,
    plan_shadow_sinks,
    shadow_pipeline,
    sink_dsn,
)
from airflow_arroyo.runtime.pipeline import Pipeline
from airflow_arroyo.runtime.sinks.kafka import KafkaTarget
from airflow_arroyo.runtime.sinks.postgres import PostgresTarget


def _code(kafka: bool = False) -> Pipeline:
    p = Pipeline("orders")
    src = p.source("src", lambda spark: spark.readStream.format("rate").load())
    p.sink("out", [src], format="parquet", options={"path": "/data/out/"})
    p.sink("totals", [src], postgres=PostgresTarget(table="public.totals", dsn_env="PG", mode="upsert", key=("k",)))
    if kafka:
        p.sink("events", [src], kafka=KafkaTarget(topic="t", bootstrap_servers="b:9092"))
    return p


def test_plan_redirects_file_folders_and_postgres_tables_never_a_live_target() -> None:
    plan = plan_shadow_sinks(_code().stages, "orders-v2")
    assert plan == {
        "out": {"kind": "files", "format": "parquet", "live": "/data/out", "shadow": "/data/out.shadow-orders-v2"},
        "totals": {"kind": "postgres", "live": "public.totals", "shadow": "public.totals_shadow_orders_v2",
                   "key": ["k"], "mode": "upsert", "dsn_env": "PG"},
    }
    shadow = shadow_pipeline(_code(), "orders-v2")
    assert shadow.pipeline_id == "orders-v2"
    sinks = {s.name: s for s in shadow.stages}
    assert sinks["out"].sink_options["path"] == "/data/out.shadow-orders-v2"
    assert sinks["totals"].postgres is not None and sinks["totals"].postgres.table == "public.totals_shadow_orders_v2"
    assert sinks["totals"].postgres.keep_journal, "the compare reads each epoch's rows from the shadow's journal"
    assert not any(s.postgres.keep_journal for s in _code().stages if s.postgres is not None)
    shadow.validate()  # still a valid pipeline


def test_a_literal_dsn_is_never_recorded_and_the_compare_says_how_to_reach_the_table() -> None:
    p = Pipeline("orders")
    src = p.source("src", lambda spark: spark.readStream.format("rate").load())
    p.sink("t", [src], postgres=PostgresTarget(table="t", dsn="postgresql://u:secret@h/db"))
    plan = plan_shadow_sinks(p.stages, "v2")
    assert "secret" not in repr(plan) and set(plan["t"]) == {"kind", "live", "shadow", "key", "mode"}
    with pytest.raises(ConfigurationError, match="give the sink dsn_env= or conn_id="):
        sink_dsn(plan["t"])


def test_plan_refuses_a_sink_it_cannot_redirect_by_name() -> None:
    with pytest.raises(ConfigurationError, match="sink 'events' writes a Kafka topic"):
        plan_shadow_sinks(_code(kafka=True).stages, "v2")


def _in(epoch: int, n: int) -> EpochInput:
    return EpochInput(epoch, (f'{{"id": {n}}}',), float(n))


def test_same_cuts_align_epoch_by_epoch() -> None:
    assert align_windows([_in(5, 10), _in(6, 20)], [_in(5, 10), _in(6, 20)]) == [
        Window((5,), (5,)), Window((6,), (6,))]


def test_different_cuts_merge_into_windows_of_equal_input_and_the_tail_stays_open() -> None:
    live = [_in(5, 10), _in(6, 20), _in(7, 30), _in(8, 40)]
    shadow = [_in(5, 15), _in(6, 30), _in(7, 35)]
    assert align_windows(live, shadow) == [Window((5, 6, 7), (5, 6)), Window((8,), (7,), closed=False)]


def test_idle_epochs_join_the_window_before_them() -> None:
    assert align_windows([_in(5, 10), _in(6, 10), _in(7, 12)], [_in(5, 10), _in(6, 12)]) == [
        Window((5, 6), (5,)), Window((7,), (6,))]
    assert align_windows([], []) == []
    assert align_windows([_in(5, 10)], []) == [Window((5,), (), closed=False)]


def test_diff_without_key_is_a_multiset_difference() -> None:
    live = [{"k": 1, "v": "a"}, {"k": 1, "v": "a"}, {"k": 2, "v": "b"}]
    shadow = [{"v": "a", "k": 1}, {"k": 3, "v": "c"}]
    d = diff_rows(live, shadow)
    assert (d.added, d.removed, d.changed, d.live_rows, d.shadow_rows) == (1, 2, 0, 3, 2)
    assert d.examples["added"] == [{"k": 3, "v": "c"}]
    assert diff_rows(live, list(reversed(live))).same


def test_diff_with_key_counts_changed_keys() -> None:
    live = [{"k": 1, "v": 10}, {"k": 2, "v": 20}, {"k": 3, "v": 30}]
    shadow = [{"k": 1, "v": 10}, {"k": 2, "v": 21}, {"k": 4, "v": 40}]
    d = diff_rows(live, shadow, ("k",))
    assert (d.added, d.removed, d.changed) == (1, 1, 1)
    assert d.examples["changed"] == [{"key": [2], "live": [{"k": 2, "v": 20}], "shadow": [{"k": 2, "v": 21}]}]
