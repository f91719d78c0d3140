"""Spark's stateful operators inside epochs: dropDuplicates, an event-time window aggregation with a
watermark (default state store) and transformWithState (RocksDB, with its state schema files),
each a stage. Run with epochs, then restored from a middle epoch: every output equals plain Python."""

from __future__ import annotations

import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from airflow_arroyo.core.epochs import EpochState
from airflow_arroyo.examples import STATEFUL_OUTPUTS, expected_stateful, stateful_ops
from airflow_arroyo.runtime.driver import PipelineDriver
from airflow_arroyo.runtime.layout import StorageLayout
from airflow_arroyo.store import EpochStore
from airflow_arroyo.testing import channel_barriers, channel_row_count, channel_rows, run_until

pytestmark = [pytest.mark.spark, pytest.mark.slow]

ROWS = 2000
PER_BATCH = 200
STAGES = ["events", *STATEFUL_OUTPUTS]


@dataclass
class Ran:
    pipeline_id: str
    storage: Path
    final_epoch: int
    layout: StorageLayout


EXPECTED = expected_stateful(ROWS)


def outputs(layout: StorageLayout) -> dict[str, list[tuple[Any, ...]]]:
    return {c: channel_rows(layout.channel_uri(c)) for c in STATEFUL_OUTPUTS}


def run_to_end(spark: Any, store: EpochStore, pipeline_id: str, storage: Path, *, restore_from: Any = None,
               epochs: bool = True, run_id: str) -> Any:
    driver = PipelineDriver(stateful_ops(pipeline_id, rows=ROWS, rows_per_batch=PER_BATCH), store,
                            storage_uri=str(storage), run_id=run_id, restore_from=restore_from, spark=spark)

    def done() -> bool:
        return all(channel_row_count(driver.layout.channel_uri(c)) >= len(EXPECTED[c]) for c in STATEFUL_OUTPUTS)

    return run_until(driver, store, done, what="every expected row in the output channels", epochs=epochs)


@pytest.fixture(scope="module")
def ran(spark: Any, module_store: EpochStore, tmp_path_factory: pytest.TempPathFactory) -> Ran:
    pid = f"stateful-{uuid.uuid4().hex[:8]}"
    storage = tmp_path_factory.mktemp("storage")
    result = run_to_end(spark, module_store, pid, storage, run_id="first")
    return Ran(pid, storage, result.final_epoch, StorageLayout.at(str(storage), pid))


def test_expectation_is_not_trivial() -> None:
    assert 1000 < len(EXPECTED["distinct_buckets"]) < 20 * 100  # 2000 rows over 2000 (key, bucket) pairs
    assert len(EXPECTED["windows"]) > 100 and len(EXPECTED["milestones"]) > 50
    window_starts = {w for _, w, _, _ in EXPECTED["windows"]}
    assert len(window_starts) == ROWS // 200 - 1  # 2 s windows at 10 ms per row; the last stays open


def test_outputs_with_epochs_equal_plain_python(ran: Ran, module_store: EpochStore) -> None:
    assert outputs(ran.layout) == EXPECTED
    completed = [e.epoch for e in module_store.list_epochs(ran.pipeline_id) if e.state is EpochState.COMPLETED]
    assert len(completed) >= 3
    for n in completed:
        assert sorted(a.stage for a in module_store.acks(ran.pipeline_id, n)) == sorted(STAGES)


def test_transform_with_state_snapshot_holds_rocksdb_files_and_state_schema(ran: Ran,
                                                                            module_store: EpochStore) -> None:
    paths = [e.rel_path for e in module_store.snapshot_entries(ran.pipeline_id, ran.final_epoch, "milestones")]
    assert any(p.endswith(".zip") for p in paths), paths
    assert any("/SSTs/" in p for p in paths), paths
    assert any("_stateSchema" in p for p in paths), paths


def test_restore_from_a_middle_epoch_gives_the_same_outputs(ran: Ran, module_store: EpochStore, spark: Any,
                                                            tmp_path: Path) -> None:
    storage = tmp_path / "storage"
    shutil.copytree(ran.storage, storage)
    layout = StorageLayout.at(str(storage), ran.pipeline_id)
    completed = sorted(e.epoch for e in module_store.list_epochs(ran.pipeline_id) if e.state is EpochState.COMPLETED)
    # an epoch whose cut left work to redo in every stage (else the restore proves nothing)
    unfinished = [n for n in completed
                  if all(len(rows_of_prefix(layout, c, n)) < len(EXPECTED[c]) for c in STATEFUL_OUTPUTS)]
    assert unfinished, f"every completed epoch {completed} came after some output was complete"
    middle = unfinished[len(unfinished) // 2]
    result = run_to_end(spark, module_store, ran.pipeline_id, storage, restore_from=middle, epochs=False,
                        run_id="restored")
    assert result.restored_from_epoch == middle
    assert outputs(layout) == EXPECTED
    for c in STAGES:
        later = [e for _, e in channel_barriers(layout.channel_uri(c)) if middle < e < result.final_epoch]
        assert later == [], (c, later)


def rows_of_prefix(layout: StorageLayout, channel: str, epoch: int) -> list[dict[str, Any]]:
    from airflow_arroyo.runtime.channel import Channel

    ch = Channel.open(layout.channel_uri(channel))
    return ch.read_table(0, ch.find_barrier(epoch)).to_pylist()
