"""Small helpers shared by the test modules."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from datetime import datetime, timedelta
from typing import Any

import psycopg2


def sql(target: Any, query: str, params: Sequence[Any] | dict[str, Any] = ()) -> list[tuple[Any, ...]]:
    """Run one statement in its own connection and transaction on ``target`` (a DSN, or anything with a
    ``dsn``, e.g. an ``EpochStore``); returns its rows (``[]`` for a statement without a result)."""
    dsn = target if isinstance(target, str) else target.dsn
    conn = psycopg2.connect(dsn)
    try:
        with conn, conn.cursor() as cur:
            cur.execute(query, params)
            return cur.fetchall() if cur.description else []
    finally:
        conn.close()


def running(store: Any, *pipeline_ids: str, stages: Sequence[str] = ("src", "sink"), run_id: str = "r1") -> None:
    """Register each pipeline (``stages``, run ``run_id``) and move it to RUNNING, as a driver does once its
    queries started."""
    from airflow_arroyo.core.epochs import PipelineState

    for pipeline_id in pipeline_ids:
        store.register_pipeline(pipeline_id, stages=list(stages), run_id=run_id)
        store.set_pipeline_state(pipeline_id, PipelineState.RUNNING, run_id=run_id)


def assert_on_schedule(starts: Sequence[datetime], interval: float, pipeline_id: str,
                       slack: float | None = None, phase: float | None = None) -> None:
    """Each epoch start after the first is at the point of the pipeline's fixed-rate schedule that follows the
    start before it (``airflow_arroyo.core.epochs.next_start_at``): never before it, and (``slack``) late by less.
    ``phase``: the schedule's phase when the times were moved (a virtual clock), else the pipeline's."""
    from airflow_arroyo.core.epochs import schedule_phase, schedule_point_after

    phase = schedule_phase(pipeline_id, interval) if phase is None else phase
    for before, start in zip(starts, starts[1:], strict=False):
        due = schedule_point_after(before, interval, phase)
        assert start >= due, (before, start, due)
        assert slack is None or start < due + timedelta(seconds=slack), (before, start, due, slack)


@contextmanager
def running_stage(spark: Any, store: Any, layout: Any, spec: Any, *, workers: int = 1) -> Iterator[Any]:
    """A :class:`~airflow_arroyo.runtime.stage.StageRunner` of ``spec`` started on ``spark`` (its query
    running), stopped on exit."""
    from airflow_arroyo.runtime.snapshot import SnapshotStore
    from airflow_arroyo.runtime.stage import StageRunner

    with ThreadPoolExecutor(workers) as executor:
        runner = StageRunner(spec, layout=layout, store=store,
                             snapshots=SnapshotStore(layout.fs, layout.pipeline_id, store), executor=executor)
        runner.start(spark, runner.build(spark))
        try:
            yield runner
        finally:
            runner.stop()
