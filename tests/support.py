"""Small helpers shared by the test modules."""

from __future__ import annotations

from collections.abc import Sequence
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
    from airflow_arroyo.epochs import PipelineState

    for pipeline_id in pipeline_ids:
        store.register_pipeline(pipeline_id, stages=list(stages), run_id=run_id)
        store.set_pipeline_state(pipeline_id, PipelineState.RUNNING, run_id=run_id)
