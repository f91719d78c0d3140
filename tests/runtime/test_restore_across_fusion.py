"""A restore across a change of fusion on real Spark (issue 32, deliverable 2), there and back: an epoch taken
with the source, a stateful dedup and a sink fused as one query restores into the same code unfused (three
queries, two new channels), and an epoch of the unfused run restores into the fused code again (one query merged
from three, renumbered to one batch numbering); each restore is first killed after its split or merge, before its
commit point, changing nothing. The dedup keeps its state throughout (no key emitted twice, though each run reads
ids of keys an earlier one saw), and each run's source resumes at the previous run's cut (the unfused run's new
channel holds exactly the ids between the two cuts; the merged query resumes at the unfused source's offset). A
merge the renumbering does not carry (a member that was not its own query) is refused by name before anything is
written."""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path
from typing import Any

import pytest

from airflow_arroyo.core.epochs import EpochState, PipelineState
from airflow_arroyo.core.exceptions import ConfigurationError, UnknownPipelineError
from airflow_arroyo.runtime.channel import Channel
from airflow_arroyo.runtime.driver import PipelineDriver
from airflow_arroyo.runtime.layout import StorageLayout
from airflow_arroyo.runtime.pipeline import Pipeline
from airflow_arroyo.runtime.spark_checkpoint import checkpoint_offsets, latest_commit
from airflow_arroyo.store import EpochStore
from airflow_arroyo.testing import CheckpointTicker, DriverThread, channel_rows, generator_source, wait_for
from tests.runtime.pipeline_support import interrupted_restore

pytestmark = [pytest.mark.spark]

ROWS = 500
KEYS = 40
FUSED = "src~dedup~out"


def source(spark: Any) -> Any:
    return generator_source(spark, total_rows=ROWS, rows_per_second=20, partitions=1).select("id")


def dedup(df: Any) -> Any:
    from pyspark.sql import functions as F

    return df.select("id", (F.col("id") % KEYS).alias("k")).dropDuplicates(["k"])  # state: every key seen


def pipeline(pid: str, root: Path, *, chaining: bool, dedup_name: str = "dedup") -> Pipeline:
    p = Pipeline(pid, chaining=chaining)
    src = p.source("src", source)
    seen = p.stage(dedup_name, dedup, [src])
    p.sink("out", [seen], format="json", options={"path": str(root / "out")})
    return p


def emitted(path: Path) -> list[dict[str, int]]:
    out: list[dict[str, int]] = []
    for folder, dirs, files in os.walk(path):
        dirs[:] = [d for d in dirs if not d.startswith(("_", "."))]
        out += [json.loads(line) for name in files if not name.startswith(("_", "."))
                for line in Path(folder, name).read_text().splitlines() if line]
    return out


def test_an_epoch_taken_fused_restores_unfused_with_its_state_and_back_is_refused(
        spark: Any, module_store: EpochStore, tmp_path: Path) -> None:
    pid = f"refuse-{uuid.uuid4().hex[:6]}"
    storage = str(tmp_path / "storage")
    layout = StorageLayout.at(storage, pid)

    def completed() -> int:
        try:
            return len(module_store.list_epochs(pid, states=[EpochState.COMPLETED]))
        except UnknownPipelineError:  # not registered yet
            return 0

    fused = DriverThread(PipelineDriver(pipeline(pid, tmp_path, chaining=True), module_store, storage_uri=storage,
                                        spark=spark)).start()
    with CheckpointTicker(module_store, pid, interval=1.0):
        wait_for(lambda: fused.error or completed() >= 2, timeout=240, what="two epochs of the fused query")
    module_store.request_stop(pid, "graceful")
    assert fused.join(240).state is PipelineState.STOPPED
    assert module_store.get_pipeline(pid).stages == [FUSED]
    final = module_store.latest_completed_epoch(pid)
    assert final is not None
    checkpoint = layout.checkpoint_uri(FUSED)
    cut = checkpoint_offsets(checkpoint, latest_commit(layout.checkpoint_fs, layout.checkpoint(FUSED)))[0]
    assert cut is not None and 0 < cut["id"] < ROWS
    before = emitted(tmp_path / "out")
    assert {r["k"] for r in before} == {i % KEYS for i in range(cut["id"])}  # the fused run's output, each key once

    unfused = {"src": "restored-across-fusion", "dedup": "restored-across-fusion", "out": "restored-across-fusion"}

    # killed after the split of the last stage, before the commit point: nothing the store or the live checkpoints
    # hold has changed, and the next restore starts again from the epoch
    def look() -> None:
        assert module_store.latest_completed_epoch(pid) == final
        assert layout.checkpoint_fs.exists(layout.checkpoint(FUSED))
        assert not layout.checkpoint_fs.list_dir(layout.checkpoint("dedup"))

    def make(run_id: str, hook: Any) -> PipelineDriver:
        driver = PipelineDriver(pipeline(pid, tmp_path, chaining=False), module_store, storage_uri=storage,
                                spark=spark, restore_from="latest", run_id=run_id)
        driver.on_step = hook
        return driver

    interrupted_restore(make, "split:out", "kill", look)

    driver = PipelineDriver(pipeline(pid, tmp_path, chaining=False), module_store, storage_uri=storage, spark=spark,
                            restore_from="latest")
    done = completed()
    second = DriverThread(driver).start()
    src_channel = layout.channel_uri("src")
    with CheckpointTicker(module_store, pid, interval=1.0):
        wait_for(lambda: second.error or (driver.started.is_set()
                                          and len(channel_rows(src_channel)) >= KEYS and completed() > done),
                 timeout=240, what="the unfused run to read some input and complete an epoch")
    assert driver._upgrade is not None
    assert {r.stage: r.action.value for r in driver._upgrade.stages} == unfused
    # at once, without a final epoch (one would come after the source read everything): the next restore takes
    # the run's latest completed epoch, well before the end of the input
    module_store.request_stop(pid, "immediate")
    result = second.join(240)
    assert result.state is PipelineState.STOPPED and result.restored_from_epoch == final.epoch
    assert sorted(module_store.get_pipeline(pid).stages) == ["dedup", "out", "src"]
    unfused_final = module_store.latest_completed_epoch(pid)
    assert unfused_final is not None
    channel = Channel.open(src_channel)
    barrier = channel.find_barrier(unfused_final.epoch)
    assert barrier is not None
    ids = sorted(channel.read_table(channel.start_position(), barrier).column("id").to_pylist())
    # the source resumed at the fused query's offset: the new channel holds exactly the ids after that cut
    assert ids and ids == list(range(cut["id"], ids[-1] + 1))
    second_cut = ids[-1] + 1
    assert second_cut < ROWS
    # the dedup kept its state: every key exactly once over both runs (the unfused run read ids of keys seen before)
    assert sorted(r["k"] for r in emitted(tmp_path / "out")) == list(range(KEYS))

    # a merge the renumbering does not carry is refused by name before anything is written
    tree = sorted(e.path for e in layout.checkpoint_fs.list_files(""))
    with pytest.raises(ConfigurationError, match=r"fusion changed: .*dedup2 did not run as its own query"):
        PipelineDriver(pipeline(pid, tmp_path, chaining=True, dedup_name="dedup2"), module_store,
                       storage_uri=storage, spark=spark, restore_from="latest").run()
    assert sorted(e.path for e in layout.checkpoint_fs.list_files("")) == tree
    assert module_store.latest_completed_epoch(pid) == unfused_final
    assert sorted(module_store.get_pipeline(pid).stages) == ["dedup", "out", "src"]

    # back to fused, killed after the merge first
    def look_merged() -> None:
        assert module_store.latest_completed_epoch(pid) == unfused_final
        assert layout.checkpoint_fs.list_dir(layout.checkpoint("dedup"))

    def make_fused(run_id: str, hook: Any) -> PipelineDriver:
        driver = PipelineDriver(pipeline(pid, tmp_path, chaining=True), module_store, storage_uri=storage,
                                spark=spark, restore_from="latest", run_id=run_id)
        driver.on_step = hook
        return driver

    interrupted_restore(make_fused, f"merged:{FUSED}", "kill", look_merged)

    driver = PipelineDriver(pipeline(pid, tmp_path, chaining=True), module_store, storage_uri=storage, spark=spark,
                            restore_from="latest")
    third = DriverThread(driver).start()

    def read_to() -> int:
        folder = layout.checkpoint(FUSED)
        if not driver.started.is_set() or not layout.checkpoint_fs.list_dir(f"{folder}/commits"):
            return 0
        end = checkpoint_offsets(layout.checkpoint_uri(FUSED), latest_commit(layout.checkpoint_fs, folder))[0]
        return int(end["id"]) if end else 0

    with CheckpointTicker(module_store, pid, interval=1.0):
        wait_for(lambda: third.error or read_to() >= ROWS, timeout=240, what="the merged query to read the input")
    assert driver._upgrade is not None
    assert {r.stage: r.action.value for r in driver._upgrade.stages} == {FUSED: "restored-across-fusion"}
    module_store.request_stop(pid, "graceful")
    result = third.join(240)
    assert result.state is PipelineState.STOPPED and result.restored_from_epoch == unfused_final.epoch
    assert module_store.get_pipeline(pid).stages == [FUSED]
    # the merged query resumed at the unfused source's cut: the first batch of its renumbered log ends there
    folder = layout.checkpoint(FUSED)
    logged = sorted(int(e.name) for e in layout.checkpoint_fs.list_dir(f"{folder}/offsets") if e.name.isdigit())
    assert checkpoint_offsets(layout.checkpoint_uri(FUSED), logged[1])[0] == {"id": second_cut}
    # the merged query kept the dedup's state: still every key exactly once
    assert sorted(r["k"] for r in emitted(tmp_path / "out")) == list(range(KEYS))
