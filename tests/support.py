"""Small helpers shared by the test modules."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import psycopg2

T = TypeVar("T")


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


def wait_for(condition: Callable[[], T], *, timeout: float = 10.0, what: str = "a condition",
             interval: float = 0.05) -> T:
    """Poll ``condition`` until it returns something truthy (returned); fail with ``what`` (an
    ``AssertionError``) after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(interval)


def running(store: Any, *pipeline_ids: str, stages: Sequence[str] = ("src", "sink"), run_id: str = "r1") -> None:
    """Register each pipeline (``stages``, run ``run_id``) and move it to RUNNING, as a driver does once its
    queries started."""
    from airflow_arroyo.epochs import PipelineState

    for pipeline_id in pipeline_ids:
        store.register_pipeline(pipeline_id, stages=list(stages), run_id=run_id)
        store.set_pipeline_state(pipeline_id, PipelineState.RUNNING, run_id=run_id)
