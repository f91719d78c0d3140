"""SIGKILL and restore of a pipeline writing a Delta Lake table: after the kill the table holds whole epochs, no
row twice; the restored run ends with exactly the generator's rows (computed without Spark), every epoch one table
version, and each commit's record (the Asset event's source) names the version that holds its batches."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("deltalake")

from deltalake import DeltaTable

from airflow_arroyo.core.epochs import PipelineState
from airflow_arroyo.store import EpochStore
from airflow_arroyo.testing import CheckpointTicker, generate_rows, wait_for
from tests.runtime import delta_pipeline
from tests.runtime.test_exactly_once import Driver, current

pytestmark = [pytest.mark.spark, pytest.mark.timeout(600)]

ROWS, PER_BATCH, PER_SECOND = 2400, 100, 300  # about 8 s of input: the kill comes while rows still arrive


def table_rows(path: Path) -> list[tuple[Any, ...]]:
    if not DeltaTable.is_deltatable(str(path)):
        return []
    t = DeltaTable(str(path)).to_pyarrow_table(columns=["id", "key", "value"])
    return sorted(zip(*(t.column(c).to_pylist() for c in ("id", "key", "value")), strict=True))


def test_killed_after_a_table_commit_then_restored_is_exact(store: EpochStore, tmp_path: Path) -> None:
    pid, table, logs = f"delta-{uuid.uuid4().hex[:8]}", tmp_path / "table", tmp_path / "logs"
    logs.mkdir()
    args = {"table_path": str(table), "rows": ROWS, "rows_per_batch": PER_BATCH, "rows_per_second": PER_SECOND}

    def start(run_id: str) -> Driver:
        return Driver(dsn=store.dsn, storage=tmp_path / "storage", pipeline_id=pid, run_id=run_id, logs=logs,
                      sink=table, pipeline="tests.runtime.delta_pipeline:pipeline", args=args)

    def running(run_id: str) -> bool:
        rec = current(store, pid)
        return rec is not None and rec.run_id == run_id and rec.state is PipelineState.RUNNING

    def kill_moment() -> str | None:
        """Once the table holds rows: whether the driver has recorded the commit that put them there yet."""
        if not DeltaTable.is_deltatable(str(table)):
            return None
        dt = DeltaTable(str(table))
        if not dt.count():  # from the numRecords statistic of each committed file
            return None
        held = next((int(h["arroyo.batch"]) for h in dt.history(5) if "arroyo.batch" in h), None)  # the newest
        recorded = max((c.batch_id for c in store.sink_commits(pid, limit=1000)), default=-1)
        return ("between a table commit and its record" if held is not None and held > recorded
                else "right after a recorded commit")

    want = [(r["id"], r["key"], r["value"]) for r in generate_rows(delta_pipeline.SEED, 0, ROWS, delta_pipeline.KEYS)
            .select(["id", "key", "value"]).to_pylist()]
    with CheckpointTicker(store, pid, interval=0.5, timeout=60.0, tick=0.1):
        first = start("first")
        try:
            wait_for(lambda: running("first") or not first.alive(), timeout=300, what="the first run to start")
            assert first.alive(), first.tail()
            # killed at the first table commit holding rows: between it and its record when the poll sees that
            def moment() -> str | None:
                return "dead" if not first.alive() else kill_moment()

            found = wait_for(moment, timeout=120, interval=0.01, what="a table commit")
            assert found != "dead", first.tail()
        finally:
            first.kill()
        seen = table_rows(table)
        print(f"killed {found}; the table held {len(seen)} rows")
        assert 0 < len(seen) < ROWS, "the kill must come while the table holds some of the rows, not all"
        assert seen == want[:len(seen)], "after the kill the table must hold whole epochs of the rows, none twice"
        second = start("second")
        try:
            wait_for(lambda: running("second") or not second.alive(), timeout=300, what="the restored run to start")
            assert second.alive(), second.tail()
            wait_for(lambda: len(table_rows(table)) >= ROWS or not second.alive(), timeout=300, interval=0.5,
                     what="every row committed to the table")
            assert second.alive(), second.tail()
        finally:
            second.kill()
    assert table_rows(table) == want  # exactly once, against the generator's own rows
    dt = DeltaTable(str(table))
    history = {h["version"]: h for h in dt.history()}
    commits = store.sink_commits(pid, limit=1000)
    assert commits and all(c.table_version is not None for c in commits)
    for c in commits:  # each record names the version that holds its batches
        assert history[c.table_version]["arroyo.batch"] == str(c.batch_id)
