"""What the UI shows of history retention has pruned (issue 30, finding 5 h, i, j): an epoch's outcome
survives pruning (migration 0007), so the summary counts, the history chart's scale, a fork's health
and an epoch's timeline read it, not the ``pruned`` state."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest

from airflow_arroyo.core.epochs import EpochState, RetentionPolicy
from airflow_arroyo.core.retention import prune_pipeline
from airflow_arroyo.store import EpochStore
from airflow_arroyo.store.reads import StoreReader
from airflow_arroyo.ui import charts
from airflow_arroyo.ui.health import Severity, assess, worst
from tests.controlplane.test_retention import Pipeline


@pytest.fixture
def store(migrated_dsn: str) -> Iterator[EpochStore]:
    """A database of this test's own (tests/ui's ``store`` is the shared, read-only dataset's)."""
    s = EpochStore(migrated_dsn)
    try:
        yield s
    finally:
        s.close()


@pytest.fixture
def reader(store: EpochStore) -> Iterator[StoreReader]:
    r = StoreReader(store.dsn)
    try:
        yield r
    finally:
        r.close()


@pytest.fixture
def pruned(store: EpochStore, tmp_path: Path) -> Pipeline:
    """``orders``: epochs 1 completed, 2 expired, 3 failed, 4-6 completed; 1-3 pruned (keep_last=3)."""
    pipe = Pipeline(store, tmp_path, "orders", stages=("src",))
    pipe.epoch({"src": {"a": 10}})
    pipe.epoch({"src": {"b": 10}}, end="expire")
    pipe.epoch({"src": {"c": 10}}, end="fail")
    for key in "def":
        pipe.epoch({"src": {key: 10}})
    report = prune_pipeline(store, "orders", RetentionPolicy(keep_last=3), holder="test")
    assert sorted(report.epochs_pruned) == [1, 2, 3]
    assert [store.get_epoch("orders", n).state for n in (1, 2, 3)] == [EpochState.PRUNED] * 3
    return pipe


def test_the_summary_counts_pruned_epochs_by_their_outcome(reader: StoreReader, pruned: Pipeline) -> None:
    summary = reader.pipeline_page("orders").summary
    assert (summary.completed, summary.expired, summary.failed) == (4, 1, 1)


def test_a_pruned_expired_epoch_is_still_clipped_in_the_history_chart() -> None:
    from tests.ui.test_charts import T0, epoch

    epochs = [epoch(n, EpochState.COMPLETED, 2.0 + n % 3) for n in range(1, 30)]
    expired = dataclasses.replace(epoch(30, EpochState.EXPIRED, 300.0), state=EpochState.PRUNED,
                                  outcome=EpochState.EXPIRED, pruned_at=T0 + timedelta(hours=1))
    epochs.append(expired)
    scale = charts._duration_scale(epochs, [e.duration_s for e in epochs])
    assert scale[-1] < 60  # the completed ones set the scale; the expired bar is clipped and marked
    assert "off the scale" in str(charts.history_chart(epochs, T0 + timedelta(hours=2)))


def test_an_epoch_page_shows_how_a_pruned_epoch_ended_and_when_it_was_pruned(reader: StoreReader,
                                                                             pruned: Pipeline) -> None:
    from airflow_arroyo.ui.app import _epoch_context

    context = _epoch_context(reader.epoch_detail("orders", 1))
    chart = str(context["chart"])
    assert "completed after" in chart and "pruned after" not in chart
    assert context["e"].pruned_at is not None  # the page's facts show when, apart from how it ended


def test_a_fork_waiting_on_a_pruned_fork_point_is_not_healthy(store: EpochStore, reader: StoreReader,
                                                              tmp_path: Path) -> None:
    pipe = Pipeline(store, tmp_path, "orders", stages=("src",))
    point = pipe.epoch({"src": {"a": 10}})
    store.fork_pipeline("orders", point, "orders-b")
    assert worst(assess(reader.overview("orders-b"))) is Severity.OK  # its fork point is there
    store.unpin_epoch("orders", point, force=True)
    for key in "bc":
        n = pipe.start()
        pipe.snapshot(n, "src", {key: 10})
        store.ack_epoch("orders", n, "src")
    report = prune_pipeline(store, "orders", RetentionPolicy(keep_last=1), holder="test")
    assert point in report.epochs_pruned
    findings = assess(reader.overview("orders-b"))
    assert worst(findings) is Severity.CRITICAL, findings
    assert any(f"fork point, epoch {point} of orders, was pruned" in f.message for f in findings), findings
