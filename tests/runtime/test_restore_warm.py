"""A restored stage that reads a channel pays its first micro-batch while the queries start (issue 34, deliverable 2),
on real Spark with a real epoch store.

After a restore the channels end at the restored epoch's barrier, so a stage reading them has nothing to read until
the stage before it writes, and Spark runs no batch for it: its first batch (planning, code generation, its state
store's load of the restored version, Python workers) came only after the stage before it paid its own, one stage
after another. The channel reader of a resumed query now offers one batch of no rows at its start (``warm_up``), so
every stage is warm before the run goes ``running``. That batch moves no position, so it must not shift a cut: the
test restores a counting pipeline with two channel hops after SIGKILLs and compares what its exactly-once sink committed
with a count in plain Python; one run, to keep it short, which then restores once more with no input left."""

from __future__ import annotations

import json
import os
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from airflow_arroyo.core.epochs import EpochState, PipelineState
from airflow_arroyo.runtime.driver import PipelineDriver
from airflow_arroyo.runtime.layout import StorageLayout
from airflow_arroyo.runtime.pipeline import Pipeline
from airflow_arroyo.store import EpochStore
from airflow_arroyo.testing import CheckpointTicker, DriverThread, channel_row_count, generator_source, wait_for
from tests.runtime.pipeline_support import Driver, kill_at_random_after_an_epoch, kill_seed

pytestmark = [pytest.mark.spark]

KEYS = 12


def counts(df: Any) -> Any:
    from pyspark.sql import functions as F

    return df.groupBy((F.col("id") % KEYS).alias("k")).agg(F.count(F.lit(1)).alias("n"))


def pipeline(pipeline_id: str, root: str, rows: int, rate: int = 200) -> Pipeline:
    """The driver's ``--pipeline tests.runtime.test_restore_warm:pipeline``: a generator of ``rows`` ids (``rate`` a
    second) into a per-key count (a stage reading a channel, its state in RocksDB) whose updates a file sink writes
    exactly once, through a second channel."""
    p = Pipeline(pipeline_id, chaining=False)
    src = p.source("src", lambda spark: generator_source(spark, total_rows=rows, rows_per_second=rate,
                                                          partitions=1).select("id"))
    agg = p.stage("counts", counts, [src], output_mode="update", state_store="rocksdb",
                  spark_conf={"spark.sql.shuffle.partitions": "2"})
    p.sink("out", [agg], format="json", options={"path": f"{root}/out"})
    return p


def emitted(path: Path) -> list[tuple[int, int]]:
    """Every (k, n) row the sink committed."""
    out: list[tuple[int, int]] = []
    for folder, dirs, files in os.walk(path):
        dirs[:] = [d for d in dirs if not d.startswith(("_", "."))]
        for name in files:
            if not name.startswith(("_", ".")):
                rows = (json.loads(line) for line in Path(folder, name).read_text().splitlines() if line)
                out += [(int(r["k"]), int(r["n"])) for r in rows]
    return out


def check_exactly_once(rows: list[tuple[int, int]], expected: dict[int, int]) -> None:
    """An update-mode count emits a key's new count once per batch that changed it: never the same (k, n) twice (a
    replay committed twice, or a count restarted by lost state, would), and the newest count of every key is what
    plain Python counts."""
    assert len(rows) == len(set(rows)), sorted(k for k, c in Counter(rows).items() if c > 1)
    final: dict[int, int] = {}
    for k, n in rows:
        final[k] = max(final.get(k, 0), n)
    assert final == expected


def run_in_process(spark: Any, store: EpochStore, pid: str, root: Path, rows: int, *, run_id: str, rate: int,
                   until: Any, restore_from: str | None = None) -> Any:
    """Run (or restore) in this process until ``until()``, then stop gracefully (a final epoch, which the next
    restore takes)."""
    driver = PipelineDriver(pipeline(pid, str(root), rows, rate), store, storage_uri=str(root / "storage"),
                            spark=spark, run_id=run_id, restore_from=restore_from, takeover=restore_from is not None)
    thread = DriverThread(driver).start()
    with CheckpointTicker(store, pid, interval=1.0):
        wait_for(lambda: thread.error or (driver.started.is_set() and until()), timeout=240,
                 what=f"run {run_id} to read its input", interval=0.2)
    store.request_stop(pid, "graceful")
    result = thread.join(240)
    assert result.state is PipelineState.STOPPED
    return result


def test_restored_after_sigkills_the_counts_are_exact_and_a_stage_with_nothing_to_read_is_warm_before_running(
        spark: Any, module_store: EpochStore, tmp_path: Path) -> None:
    rng = kill_seed()
    rows = 2400  # a run's first batch reads what the source's pace made exist since its reader started: slow starts
    expected = dict(Counter(i % KEYS for i in range(rows)))
    pid = f"warm-{uuid.uuid4().hex[:6]}"
    layout = StorageLayout.at(str(tmp_path / "storage"), pid)
    logs = tmp_path / "logs"
    logs.mkdir()

    def read() -> int:
        return channel_row_count(layout.channel_uri("src"))

    def counted() -> bool:
        final: dict[int, int] = {}
        for k, n in emitted(tmp_path / "out"):
            final[k] = max(final.get(k, 0), n)
        return final == expected

    def start(run_id: str) -> Driver:
        # slowly: input must be left for the run after each kill
        return Driver(dsn=module_store.dsn, storage=tmp_path / "storage", pipeline_id=pid, run_id=run_id, logs=logs,
                      pipeline="tests.runtime.test_restore_warm:pipeline",
                      args={"root": str(tmp_path), "rows": rows, "rate": 8})

    # a first run in this process, then a restore in a driver process of its own, SIGKILLed (its JVM with it) at a
    # random moment after an epoch of its own, then a restore in this process to the end of the input
    run_in_process(spark, module_store, pid, tmp_path, rows, run_id="first", rate=8, until=lambda: read() >= 60)
    with CheckpointTicker(module_store, pid, interval=1.0):
        for run in ("killed",):
            before = read()
            kill_at_random_after_an_epoch(start(run), module_store, pid, rng, also=lambda b=before: read() > b)
            assert read() < rows  # input is left for the next run
    last = run_in_process(spark, module_store, pid, tmp_path, rows, run_id="last", rate=300, until=counted,
                          restore_from="latest")
    assert last.restored_from_epoch is not None
    committed = sorted(emitted(tmp_path / "out"))
    check_exactly_once(committed, expected)

    # a restore with no input left: no stage has a row to read, yet each stage reading a channel runs a batch
    restored_epoch = module_store.latest_completed_epoch(pid).epoch
    driver = PipelineDriver(pipeline(pid, str(tmp_path), rows), module_store, storage_uri=str(tmp_path / "storage"),
                            spark=spark, run_id="restored", restore_from="latest", takeover=True)
    seen: dict[str, Any] = {}

    def on_step(name: str) -> None:
        if name == "warm":  # the step right before the run goes running (and an epoch may start)
            seen["warm"] = {r.name: r.warm for r in driver.runners}
            query = next(r.query for r in driver.runners if r.name == "counts")
            seen["progress"] = list(query.recentProgress) if query is not None else []

    driver.on_step = on_step
    thread = DriverThread(driver).start()
    with CheckpointTicker(module_store, pid, interval=1.0):
        # the cuts are where they were: the run's first epoch completes, its barriers through both channels
        wait_for(lambda: thread.error or any(
            e.run_id == "restored" and e.state is EpochState.COMPLETED
            for e in module_store.list_epochs(pid, limit=20)), timeout=180, what="an epoch of the restored run")
    module_store.request_stop(pid, "graceful")
    result = thread.join(240)
    assert result.state is PipelineState.STOPPED and result.restored_from_epoch == restored_epoch

    # both stages that read a channel completed a batch before running: no rows, the count's state loaded
    assert seen["warm"]["counts"] and seen["warm"]["out"], seen["warm"]
    first = seen["progress"][0]
    assert first["numInputRows"] == 0
    assert sum(int(o["numRowsTotal"]) for o in first["stateOperators"]) == KEYS
    # the batch of no rows emitted nothing and the later epochs committed nothing again
    assert sorted(emitted(tmp_path / "out")) == committed
