"""The UI's read-only queries against a real Postgres holding realistic history (tests/ui/data.py).

Every answer is checked against what the store's own API says (a second, independent reading), and
the query plans are checked to read a bounded number of epoch rows through indexes.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import psycopg2
import pytest

from airflow_arroyo.core.epochs import EpochState
from airflow_arroyo.core.exceptions import StoreError, UnknownEpochError, UnknownPipelineError
from airflow_arroyo.store import EpochStore
from airflow_arroyo.store import reads as q
from airflow_arroyo.store.reads import RECENT_WINDOW, StoreReader
from tests.ui.data import Dataset

PIPELINES = ["clicks", "fresh", "orders", "payments", "sessions"]


@pytest.fixture(scope="module")
def ui(dataset: Dataset) -> Iterator[StoreReader]:
    queries = StoreReader(dataset.dsn)
    try:
        yield queries
    finally:
        queries.close()


@pytest.fixture(scope="module")
def store(dataset: Dataset) -> Iterator[EpochStore]:
    s = EpochStore(dataset.dsn)
    try:
        yield s
    finally:
        s.close()


def test_pipelines_page_agrees_with_the_store(ui: StoreReader, store: EpochStore) -> None:
    page = ui.pipelines()
    assert [o.pipeline.pipeline_id for o in page.items] == PIPELINES
    assert page.next_after is None
    for o in page.items:
        pid = o.pipeline.pipeline_id
        assert o.pipeline == store.get_pipeline(pid)
        assert o.last_completed == store.latest_completed_epoch(pid)
        assert o.in_flight == store.in_flight_epoch(pid)
        assert o.cleanup_lock == store.cleanup_lock(pid)
        newest = store.list_epochs(pid, limit=RECENT_WINDOW) if pid != "fresh" else []
        assert [(r.epoch, r.state) for r in o.recent] == [(e.epoch, e.state) for e in newest]


def test_overview_facts_follow_the_history_that_was_written(ui: StoreReader, dataset: Dataset) -> None:
    by_id = {o.pipeline.pipeline_id: o for o in ui.pipelines().items}
    for pid, plan in dataset.plans.items():
        o = by_id[pid]
        ended = [e for e in plan.epochs if e.outcome != "in_flight"]
        completed = [e.epoch for e in ended if e.outcome == "completed"]
        streak = 0
        for e in reversed(ended):
            if e.outcome == "completed":
                break
            streak += 1
        assert (o.last_completed.epoch if o.last_completed else None) == (max(completed) if completed else None)
        assert o.consecutive_failures == streak, pid
        in_flight = [e.epoch for e in plan.epochs if e.outcome == "in_flight"]
        assert (o.in_flight.epoch if o.in_flight else None) == (in_flight[0] if in_flight else None)
    assert by_id["clicks"].consecutive_failures == 4
    lock = by_id["clicks"].cleanup_lock
    assert lock is not None and lock.cleanup_run == dataset.held_lock_run
    assert by_id["payments"].cleanup_lock is None  # its lease expired: not held
    assert by_id["orders"].last_completed_age_s is not None and by_id["orders"].last_completed_age_s > 0


def test_pipelines_are_paged_by_id_without_gaps_or_repeats(ui: StoreReader) -> None:
    seen, after, pages = [], None, 0
    while True:
        page = ui.pipelines(after=after, limit=2)
        pages += 1
        assert len(page.items) <= 2
        seen += [o.pipeline.pipeline_id for o in page.items]
        if page.next_after is None:
            break
        after = page.next_after
    assert seen == PIPELINES
    assert pages == 3


def test_epoch_history_pages_walk_all_epochs_both_ways(ui: StoreReader, store: EpochStore) -> None:
    everything = [e.epoch for e in store.list_epochs("orders", limit=10_000)]
    assert len(everything) == 241
    older: list[list[int]] = []
    page = ui.epochs("orders", limit=37)
    assert page.newer_after is None
    while True:
        older.append([e.epoch for e in page.epochs])
        if page.older_before is None:
            break
        page = ui.epochs("orders", before=page.older_before, limit=37)
    assert [n for chunk in older for n in chunk] == everything
    assert all(len(chunk) == 37 for chunk in older[:-1])
    # and back up, from the oldest page, through ``after``
    newer: list[list[int]] = [older[-1]]
    while page.newer_after is not None:
        page = ui.epochs("orders", after=page.newer_after, limit=37)
        newer.append([e.epoch for e in page.epochs])
    assert sorted(n for chunk in newer for n in chunk) == sorted(everything)
    assert newer[-1][0] == 241
    # the records are the store's records
    assert ui.epochs("orders", limit=5).epochs == store.list_epochs("orders", limit=5)


def test_pipeline_page_is_one_snapshot_of_overview_and_history(ui: StoreReader) -> None:
    page = ui.pipeline_page("clicks", limit=10)
    assert [e.epoch for e in page.epochs.epochs] == list(range(60, 50, -1))
    assert page.epochs.older_before == 51 and page.epochs.newer_after is None
    assert [e.state for e in page.epochs.epochs[:4]] == [EpochState.FAILED, EpochState.FAILED,
                                                          EpochState.EXPIRED, EpochState.FAILED]
    assert page.overview.consecutive_failures == 4


def test_epoch_detail_of_an_in_flight_epoch_names_the_stages_still_missing(ui: StoreReader, store: EpochStore,
                                                                           dataset: Dataset) -> None:
    plan = dataset.plan("orders").epochs[-1]
    assert plan.outcome == "in_flight" and plan.epoch == 241
    d = ui.epoch_detail("orders", 241)
    assert d.epoch.state is EpochState.TRIGGERED
    assert d.acks == store.acks("orders", 241)
    assert [a.stage for a in d.acks] == plan.acked_stages
    assert d.pending_stages == [s for s in dataset.plan("orders").stages if s not in plan.acked_stages]
    assert d.pending_stages  # there is something to wait for


def test_epoch_detail_of_a_completed_epoch(ui: StoreReader, store: EpochStore) -> None:
    done = store.latest_completed_epoch("orders")
    assert done is not None
    d = ui.epoch_detail("orders", done.epoch)
    assert d.epoch == done
    assert d.pending_stages == []
    assert sorted(a.stage for a in d.acks) == sorted(done.stages)
    assert sum(a.bytes_new or 0 for a in d.acks) == done.bytes_new


def test_unknown_pipeline_and_epoch(ui: StoreReader) -> None:
    with pytest.raises(UnknownPipelineError):
        ui.pipeline_page("nope")
    with pytest.raises(UnknownPipelineError):
        ui.epoch_detail("nope", 1)
    with pytest.raises(UnknownEpochError):
        ui.epoch_detail("orders", 10_000)
    with pytest.raises(UnknownPipelineError):
        ui.retention("nope")


def test_retention_page(ui: StoreReader, store: EpochStore, dataset: Dataset) -> None:
    orders = ui.retention("orders")
    assert [r.id for r in orders.runs] == sorted(dataset.orders_cleanup_runs, reverse=True)
    assert orders.runs == store.list_cleanup_runs("orders")
    pruned = sorted(e for r in orders.runs for e in r.epochs_pruned)
    assert pruned == sorted(dataset.orders_pruned)
    assert pruned == [e.epoch for e in store.list_epochs("orders", limit=1000, states=[EpochState.PRUNED])][::-1]
    assert sum(r.bytes_freed for r in orders.runs) == sum(1_000_000 + 1000 * e for e in pruned)
    assert orders.lock is None and not orders.lock_live

    clicks = ui.retention("clicks")
    assert clicks.lock_live and clicks.lock is not None and clicks.lock.cleanup_run == dataset.held_lock_run
    states = {r.id: r.state for r in clicks.runs}
    assert states == {dataset.held_lock_run: "running", dataset.lost_lock_run: "lock_lost"}

    payments = ui.retention("payments")
    assert payments.lock is not None and not payments.lock_live  # an expired lease is shown, not "held"

    first = ui.retention("orders", limit=1)
    assert len(first.runs) == 1 and first.next_before_id == first.runs[0].id
    second = ui.retention("orders", before_id=first.next_before_id, limit=1)
    assert [r.id for r in second.runs] == [min(dataset.orders_cleanup_runs)] and second.next_before_id is None


def test_the_ui_cannot_write(ui: StoreReader) -> None:
    def write(cur: Any) -> None:
        cur.execute("UPDATE arroyo_pipelines SET failure_cause = 'x' WHERE pipeline_id = 'orders'")

    with pytest.raises(StoreError, match="25006|read-only"):
        ui._read(write)


def test_page_sizes_are_capped(ui: StoreReader) -> None:
    assert len(ui.epochs("orders", limit=10_000).epochs) == min(241, q.MAX_PAGE_SIZE)
    with pytest.raises(ValueError):
        ui.epochs("orders", limit=0)


# --------------------------------------------------------------------------- plans: indexes, bounded reads


def _plan(dsn: str, sql: str, params: dict[str, Any]) -> dict[str, Any]:
    conn = psycopg2.connect(dsn)
    try:
        with conn.cursor() as cur:
            cur.execute("SET enable_seqscan = off")  # plan as for a big table: an index must exist
            cur.execute("EXPLAIN (ANALYZE, FORMAT JSON) " + cur.mogrify(sql, params).decode())
            raw = cur.fetchone()[0]
        return (raw if isinstance(raw, list) else json.loads(raw))[0]["Plan"]
    finally:
        conn.close()


def _nodes(plan: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield plan
    for child in plan.get("Plans", []):
        yield from _nodes(child)


def _epoch_rows_read(plan: dict[str, Any]) -> int:
    rows = 0
    for node in _nodes(plan):
        if node.get("Relation Name") == "arroyo_epochs":
            assert node["Node Type"] != "Seq Scan", node
            assert "Index" in node["Node Type"], node
            rows += int(node["Actual Rows"]) * int(node["Actual Loops"]) + int(node.get("Rows Removed by Filter", 0))
    return rows


@pytest.mark.parametrize("name", ["SQL_LAST_COMPLETED", "SQL_IN_FLIGHT", "SQL_RECENT"])
def test_pipeline_list_queries_read_a_bounded_number_of_epochs_through_indexes(name: str, dataset: Dataset) -> None:
    total = sum(len(p.epochs) for p in dataset.plans.values())
    assert total > 300
    plan = _plan(dataset.dsn, getattr(q, name), {"ids": PIPELINES, "window": RECENT_WINDOW})
    read = _epoch_rows_read(plan)
    bound = {"SQL_LAST_COMPLETED": len(PIPELINES), "SQL_IN_FLIGHT": len(PIPELINES),
             "SQL_RECENT": len(PIPELINES) * RECENT_WINDOW}[name]
    assert read <= bound, (name, read, bound)


def test_last_completed_uses_the_state_index(dataset: Dataset) -> None:
    plan = _plan(dataset.dsn, q.SQL_LAST_COMPLETED, {"ids": PIPELINES})
    indexes = {n.get("Index Name") for n in _nodes(plan) if n.get("Relation Name") == "arroyo_epochs"}
    assert indexes == {"arroyo_epochs_by_state"}


def test_epoch_history_page_reads_one_page(dataset: Dataset) -> None:
    plan = _plan(dataset.dsn, q.SQL_EPOCHS_BEFORE, {"p": "orders", "before": 200, "limit": 25})
    assert _epoch_rows_read(plan) == 25
