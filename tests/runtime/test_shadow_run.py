"""A shadow run on real Spark (issue 32, deliverable 5): a live pipeline runs to the end of a bounded input; a
shadow forks its first completed epoch with code that drops some ids and changes a computed column for others;
compare reports exactly the rows the change implies over the input after the fork point, computed apart in plain
Python from what the live pipeline committed after it; discard leaves the live pipeline untouched."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest

from airflow_arroyo.core.epochs import EpochState
from airflow_arroyo.core.shadow import compare_shadow, discard_shadow, read_file_rows, shadow_pipeline, start_shadow
from airflow_arroyo.runtime.driver import PipelineDriver
from airflow_arroyo.runtime.pipeline import Pipeline
from airflow_arroyo.runtime.sinks.files import committed_files
from airflow_arroyo.store import EpochStore
from airflow_arroyo.testing import generator_source, run_until

pytestmark = [pytest.mark.spark]

ROWS = 300


def source(spark: Any) -> Any:
    return generator_source(spark, total_rows=ROWS, rows_per_second=60, partitions=1).select("id")


def calc_v1(df: Any) -> Any:
    from pyspark.sql import functions as F

    return df.select("id", (F.col("id") * 10).alias("v"))


def calc_v2(df: Any) -> Any:
    """Drops every id divisible by 11; v + 1 for ids divisible by 7."""
    from pyspark.sql import functions as F

    return df.where(F.col("id") % 11 != 0).select(
        "id", (F.col("id") * 10 + F.when(F.col("id") % 7 == 0, 1).otherwise(0)).alias("v"))


def code(pid: str, root: Path, calc: Any) -> Pipeline:
    p = Pipeline(pid, chaining=False)
    src = p.source("src", source)
    out = p.stage("calc", calc, [src])
    p.sink("out", [out], format="json", options={"path": str(root / "out")})
    return p


def _rows(path: Path) -> list[dict[str, Any]]:
    return read_file_rows(str(path), committed_files(str(path)), "json")


def test_a_shadow_reports_exactly_the_rows_its_code_changes_and_discard_leaves_the_live_pipeline(
        spark: Any, module_store: EpochStore, tmp_path: Path) -> None:
    pid, sid = f"live-{uuid.uuid4().hex[:6]}", f"shadow-{uuid.uuid4().hex[:6]}"
    live_storage, shadow_storage = tmp_path / "live-storage", tmp_path / "shadow-storage"
    live = PipelineDriver(code(pid, tmp_path, calc_v1), module_store, storage_uri=str(live_storage), spark=spark)
    run_until(live, module_store, lambda: len(_rows(tmp_path / "out")) >= ROWS, what="the live output",
              interval=1.0)
    epochs = sorted(e.epoch for e in module_store.list_epochs(pid, states=[EpochState.COMPLETED]))
    fork_point = epochs[0]
    through = next(c.batch_id for c in module_store.sink_commits(pid, sink="out") if c.epoch == fork_point)
    before_fork = {r["id"] for r in read_file_rows(str(tmp_path / "out"), committed_files(str(tmp_path / "out"),
                                                                                      through), "json")}
    after = sorted(r["id"] for r in _rows(tmp_path / "out") if r["id"] not in before_fork)
    assert after, "the fork point must leave input to compare"
    live_before = module_store.get_pipeline(pid)

    start_shadow(module_store, pid, fork_point, sid, "tests.runtime.test_shadow_run:v2",
                 pipeline=code(pid, tmp_path, calc_v2))
    shadow_out = Path(f"{tmp_path / 'out'}.shadow-{sid}")
    expected_shadow = [i for i in after if i % 11 != 0]
    shadow = PipelineDriver(shadow_pipeline(code(pid, tmp_path, calc_v2), sid), module_store,
                            storage_uri=str(shadow_storage), spark=spark, restore_from="latest")
    run_until(shadow, module_store, lambda: len(_rows(shadow_out)) >= len(expected_shadow),
              what="the shadow output", interval=1.0)
    assert sorted(r["id"] for r in _rows(shadow_out)) == expected_shadow
    assert len(_rows(tmp_path / "out")) == ROWS  # the live sink was never written by the shadow

    report = compare_shadow(module_store, sid, key={"out": ["id"]})
    diffs = [d for d in report["diffs"] if d["sink"] == "out"]
    assert diffs and all(d["closed"] for d in diffs), diffs
    total = {k: sum(d[k] for d in diffs) for k in ("added", "removed", "changed", "live_rows", "shadow_rows")}
    assert total == {"added": 0, "removed": sum(1 for i in after if i % 11 == 0),
                     "changed": sum(1 for i in after if i % 7 == 0 and i % 11 != 0),
                     "live_rows": len(after), "shadow_rows": len(expected_shadow)}

    # the UI compares through a read-only connection: the same answer
    from airflow_arroyo.store.reads import StoreReader

    reader = StoreReader(module_store.dsn)
    try:
        assert compare_shadow(reader.records, sid, key={"out": ["id"]}) == report  # type: ignore[arg-type]
        assert [s.shadow_id for s in reader.records.shadows_of(pid)] == [sid]
    finally:
        reader.close()

    discard_shadow(module_store, sid)
    assert module_store.get_shadow(sid).state == "discarded"
    assert module_store.get_epoch(pid, fork_point).pin_label is None
    now = module_store.get_pipeline(pid)
    assert (now.state, now.run_id, now.last_epoch) == (live_before.state, live_before.run_id, live_before.last_epoch)
    assert len(_rows(tmp_path / "out")) == ROWS
