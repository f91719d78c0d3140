"""An upgrade on real Spark (issue 32): new code restores an epoch of the old one. A renamed stateful stage takes
its old state (renamed=), a stage new in the code starts empty and reads its input channel from the epoch's
barrier, a dropped stage's state goes only when named. Output is compared with what the generator's ids give,
computed apart: a lost state would emit a key twice, a new stage reading from anywhere but the cut would miss or
repeat ids. The dropped stage is also proven after a crash: the old code SIGKILLed (its JVM with it) at a random
moment after an epoch, the new code's restore SIGKILLed at one of its steps, then retried."""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path
from typing import Any

import pytest

from airflow_arroyo.core.epochs import EpochState, PipelineState
from airflow_arroyo.core.exceptions import ConfigurationError, UnknownPipelineError
from airflow_arroyo.core.upgrades import UpgradeError, prepare_upgrade
from airflow_arroyo.runtime.channel import Channel
from airflow_arroyo.runtime.driver import PipelineDriver
from airflow_arroyo.runtime.layout import StorageLayout
from airflow_arroyo.runtime.pipeline import Pipeline
from airflow_arroyo.runtime.sinks.files import committed_files, committed_through
from airflow_arroyo.store import EpochStore
from airflow_arroyo.testing import CheckpointTicker, DriverThread, channel_row_count, generator_source, wait_for
from tests.runtime.pipeline_support import (
    Driver,
    epoch_objects,
    file_tree,
    kill_at_random_after_an_epoch,
    kill_seed,
    restore_killed_at,
    store_view,
)

pytestmark = [pytest.mark.spark]

ROWS = 600  # 15 s of input at 40 rows/s: the old code's two epochs come well before its end, even on a loaded machine
KEYS = 50


def source(spark: Any, rows: int = ROWS) -> Any:
    return generator_source(spark, total_rows=rows, rows_per_second=40, partitions=1).select("id")


def dedup(df: Any) -> Any:
    from pyspark.sql import functions as F

    return df.select((F.col("id") % KEYS).alias("k")).dropDuplicates(["k"])  # state: every key seen


def evens(df: Any) -> Any:
    from pyspark.sql import functions as F

    return df.where(F.col("id") % 2 == 0)


def v1(pid: str, root: Path) -> Pipeline:
    p = Pipeline(pid, chaining=False)
    src = p.source("src", source)
    seen = p.stage("dedup", dedup, [src])
    p.sink("out", [seen], format="json", options={"path": str(root / "out")})
    return p


def v2(pid: str, root: Path) -> Pipeline:
    """The stateful stage renamed (its channel kept: output=), and a new branch reading the source's channel."""
    p = Pipeline(pid, chaining=False)
    src = p.source("src", source)
    seen = p.stage("dedup_v2", dedup, [src], output="dedup")
    p.sink("out", [seen], format="json", options={"path": str(root / "out")})
    even = p.stage("evens", evens, [src])
    p.sink("evens_out", [even], format="json", options={"path": str(root / "evens")})
    return p


def v3(pid: str, root: Path) -> Pipeline:
    """v2 without its evens branch, and 300 more ids to read."""
    p = Pipeline(pid, chaining=False)
    src = p.source("src", lambda spark: source(spark, ROWS + 300))
    seen = p.stage("dedup_v2", dedup, [src], output="dedup")
    p.sink("out", [seen], format="json", options={"path": str(root / "out")})
    return p


def folder_values(path: Path, column: str) -> list[int]:
    out: list[int] = []
    for folder, dirs, files in os.walk(path):
        dirs[:] = [d for d in dirs if not d.startswith(("_", "."))]
        out += [json.loads(line)[column] for name in files if not name.startswith(("_", "."))
                for line in Path(folder, name).read_text().splitlines() if line]
    return out


def completed_epochs(store: EpochStore, pid: str) -> int:
    """How many epochs of ``pid`` completed (0 before it registered)."""
    try:
        return len(store.list_epochs(pid, states=[EpochState.COMPLETED]))
    except UnknownPipelineError:  # not registered yet
        return 0


def test_an_upgrade_in_one_step_renames_a_stateful_stage_and_adds_one_that_starts_at_the_final_epochs_cut(
        spark: Any, module_store: EpochStore, tmp_path: Path) -> None:
    pid = f"upgrade-{uuid.uuid4().hex[:6]}"
    storage = str(tmp_path / "storage")
    layout = StorageLayout.at(storage, pid)
    src_channel = layout.channel_uri("src")

    def completed() -> int:
        return completed_epochs(module_store, pid)

    first = DriverThread(PipelineDriver(v1(pid, tmp_path), module_store, storage_uri=storage, spark=spark)).start()
    with CheckpointTicker(module_store, pid, interval=1.0):
        wait_for(lambda: first.error or (completed() >= 2 and channel_row_count(src_channel) >= 80),
                 timeout=240, what="two epochs of the old code")
        # the rename without its mapping reads as a stage dropped: refused while the old code still runs
        with pytest.raises(UpgradeError, match=r"step 'plan': .*stage 'dedup' removed: .*Nothing was changed"):
            prepare_upgrade(module_store, pid, v2(pid, tmp_path).validate())
        assert module_store.get_pipeline(pid).state is PipelineState.RUNNING
        ready = prepare_upgrade(module_store, pid, v2(pid, tmp_path).validate(), renamed={"dedup": "dedup_v2"},
                                label="v2", stop_timeout=120)
    assert first.join(240).state is PipelineState.STOPPED
    pinned = module_store.get_epoch(pid, ready.epoch)
    assert (pinned.is_final, pinned.pin_label) == (True, "v2")
    assert ready.driver_args() == ["--restore-from", str(ready.epoch), "--rename", "dedup=dedup_v2"]
    assert {r.stage: r.action.value for r in ready.plan.stages} == {
        "src": "restored", "dedup_v2": "restored", "out": "restored", "evens": "new", "evens_out": "new"}
    channel = Channel.open(src_channel)
    barrier = channel.find_barrier(ready.epoch)
    assert barrier is not None
    before_cut = set(channel.read_table(channel.start_position(), barrier).column("id").to_pylist())
    assert 0 < len(before_cut) < ROWS

    # the driver plans the same way: without the mapping it refuses before anything is written
    with pytest.raises(ConfigurationError, match=r"stage 'dedup' removed: .*renamed=\{'dedup': 'NEW'\}"):
        PipelineDriver(v2(pid, tmp_path), module_store, storage_uri=storage, spark=spark,
                       restore_from=ready.epoch).run()

    driver = PipelineDriver(v2(pid, tmp_path), module_store, storage_uri=storage, spark=spark,
                            restore_from=ready.epoch, renamed={"dedup": "dedup_v2"})
    second = DriverThread(driver).start()
    expected_evens = sorted(i for i in range(ROWS) if i % 2 == 0 and i not in before_cut)
    with CheckpointTicker(module_store, pid, interval=1.0):
        wait_for(lambda: second.error or sorted(folder_values(tmp_path / "evens", "id")) == expected_evens,
                 timeout=300, what="the new stage's output")
    module_store.request_stop(pid, "graceful")
    result = second.join(240)
    assert result.restored_from_epoch == ready.epoch
    assert sorted(folder_values(tmp_path / "evens", "id")) == expected_evens
    # the renamed stage kept its state: every key once, though the new run read ids whose keys it saw before
    assert sorted(folder_values(tmp_path / "out", "k")) == list(range(KEYS))
    assert sorted(module_store.get_pipeline(pid).stages) == ["dedup_v2", "evens", "evens_out", "out", "src"]

    # removed: v3 drops the evens branch, refused until named, then restored without it; the state it keeps
    # (dedup_v2's) still knows every key, and the dropped branch's output stays as v2 committed it
    latest = module_store.latest_completed_epoch(pid)
    assert latest is not None
    with pytest.raises(ConfigurationError, match=r"stage 'evens' removed: .*allow_dropped_state=\['evens'\]"):
        PipelineDriver(v3(pid, tmp_path), module_store, storage_uri=storage, spark=spark,
                       restore_from="latest").run()
    evens_files = sorted(str(f.relative_to(tmp_path)) for f in (tmp_path / "evens").rglob("*") if f.is_file())
    third = DriverThread(PipelineDriver(v3(pid, tmp_path), module_store, storage_uri=storage, spark=spark,
                                        restore_from="latest", allow_dropped_state=["evens", "evens_out"])).start()
    with CheckpointTicker(module_store, pid, interval=1.0):
        wait_for(lambda: third.error or channel_row_count(src_channel) >= ROWS + 300, timeout=300,
                 what="v3 reading the 300 new ids")
    module_store.request_stop(pid, "graceful")
    result = third.join(240)
    assert result.restored_from_epoch == latest.epoch
    assert sorted(module_store.get_pipeline(pid).stages) == ["dedup_v2", "out", "src"]
    assert sorted(folder_values(tmp_path / "out", "k")) == list(range(KEYS))  # no key again: its state was kept
    assert sorted(str(f.relative_to(tmp_path)) for f in (tmp_path / "evens").rglob("*") if f.is_file()) == evens_files
    assert sorted(folder_values(tmp_path / "evens", "id")) == expected_evens


# The removed stage after a crash. Keys are the old input's ids, so that they keep coming while the old code runs
# (a kill lands among first sightings) and the new input's ids repeat some of them: a lost state emits those twice.
OLD_ROWS = 240
NEW_ROWS = 60
CRASH_KEYS = OLD_ROWS


def branched(pipeline_id: str, root: str, branch: bool, rate: int = 10) -> Pipeline:
    """The driver's ``--pipeline tests.runtime.test_upgrade_restore:branched``: with ``branch``, the old code (a
    dedup and an evens branch); without it, the new code, which reads ``NEW_ROWS`` more ids. ``rate``: the
    source's rows per second (a run's pace, not part of its state)."""
    from pyspark.sql import functions as F

    rows = OLD_ROWS if branch else OLD_ROWS + NEW_ROWS
    p = Pipeline(pipeline_id, chaining=False)
    src = p.source("src", lambda spark: generator_source(spark, total_rows=rows, rows_per_second=rate,
                                                          partitions=1).select("id"))
    seen = p.stage("dedup", lambda df: df.select((F.col("id") % CRASH_KEYS).alias("k")).dropDuplicates(["k"]),
                   [src])
    p.sink("out", [seen], format="json", options={"path": f"{root}/out"})
    if branch:
        even = p.stage("evens", evens, [src])
        p.sink("evens_out", [even], format="json", options={"path": f"{root}/evens"})
    return p


def test_a_stage_removed_after_a_sigkill_keeps_the_rest_exact_and_leaves_its_output_as_committed(
        spark: Any, module_store: EpochStore, tmp_path: Path) -> None:
    rng = kill_seed()
    pid = f"dropkill-{uuid.uuid4().hex[:6]}"
    dsn = module_store.dsn
    storage = tmp_path / "storage"
    logs = tmp_path / "logs"
    logs.mkdir()
    src = StorageLayout.at(str(storage), pid).channel_uri("src")
    evens_uri = str(tmp_path / "evens")
    drop = ["evens", "evens_out"]

    def start(branch: bool, *options: str, run_id: str, kill_at_step: str | None = None) -> Driver:
        return Driver(dsn=dsn, storage=storage, pipeline_id=pid, run_id=run_id, logs=logs,
                      pipeline="tests.runtime.test_upgrade_restore:branched",
                      args={"root": str(tmp_path), "branch": branch}, options=options, kill_at_step=kill_at_step)

    def rows_cut() -> int:
        """Rows of the source's channel before the latest completed epoch's barrier (0 before there is one)."""
        latest = module_store.latest_completed_epoch(pid)
        if latest is None or not Channel.exists(src):
            return 0
        ch = Channel.open(src)
        at = ch.find_barrier(latest.epoch)
        return 0 if at is None else sum(e.rows for e in ch.data_entries(ch.start_position(), at))

    # the old code as a process of its own, SIGKILLed at a random moment after it completed an epoch whose cut
    # holds state (an epoch taken before the first row carries none)
    with CheckpointTicker(module_store, pid, interval=1.0):
        cut = kill_at_random_after_an_epoch(start(True, run_id="old"), module_store, pid, rng,
                                            also=lambda: rows_cut() > 0).epoch
    channel = Channel.open(src)
    barrier = channel.find_barrier(cut)
    assert barrier is not None
    before_cut = set(channel.read_table(channel.start_position(), barrier).column("id").to_pylist())
    assert before_cut == set(range(len(before_cut))) and 0 < len(before_cut) <= OLD_ROWS
    objects = epoch_objects(module_store, storage, pid, cut)
    # what the dropped sink committed: through its cut of the restored epoch, or an earlier one's when the kill
    # fell between the epoch's completion and the sink's commit (its pending output after that is dropped)
    through = committed_through(evens_uri)
    cuts = {e.epoch: a.details["batch_id"] for e in module_store.list_epochs(pid, states=[EpochState.COMPLETED])
            for a in module_store.acks(pid, e.epoch) if a.stage == "evens_out"}
    assert through <= cuts[cut], (through, cuts)
    committed_epoch = max((e for e, b in cuts.items() if b == through and e <= cut), default=None)
    assert committed_epoch is not None or through == -1, (through, cuts)
    committed_ids: set[int] = set()
    if committed_epoch is not None:
        at = channel.find_barrier(committed_epoch)
        assert at is not None
        committed_ids = set(channel.read_table(channel.start_position(), at).column("id").to_pylist())
    expected_evens = sorted(i for i in committed_ids if i % 2 == 0)

    def evens_committed() -> list[int]:
        return sorted(json.loads(line)["id"] for f in committed_files(evens_uri)
                      for line in Path(evens_uri, f).read_text().splitlines() if line)

    assert evens_committed() == expected_evens
    evens_files = file_tree(tmp_path / "evens")

    # the new code without the branch: refused until the dropped stages are named, before anything is written
    view, files = store_view(module_store, pid), file_tree(tmp_path)
    with pytest.raises(ConfigurationError, match=r"stage 'evens' removed: .*allow_dropped_state=\['evens'\]"):
        PipelineDriver(branched(pid, str(tmp_path), False), module_store, storage_uri=str(storage), spark=spark,
                       restore_from="latest", takeover=True).run()
    assert (store_view(module_store, pid), file_tree(tmp_path)) == (view, files)

    # its restore SIGKILLed at a step, before or after its commit point; the retry restores the same epoch
    allow = [o for name in drop for o in ("--allow-dropped-state", name)]
    step = rng.choice(["prepared:dedup", "switched:dedup", "rolled-back:out"])
    restore_killed_at(step, lambda **kw: start(False, *allow, **kw), "new-killed")
    assert module_store.latest_completed_epoch(pid).epoch == cut

    last = DriverThread(PipelineDriver(branched(pid, str(tmp_path), False, rate=200), module_store,
                                       storage_uri=str(storage), spark=spark, restore_from="latest",
                                       allow_dropped_state=drop, takeover=True)).start()
    with CheckpointTicker(module_store, pid, interval=1.0):
        # running first: a stop asked before the run registers is not its own (registering clears it)
        wait_for(lambda: last.error or (last.driver.started.is_set()
                                        and channel_row_count(src) >= OLD_ROWS + NEW_ROWS),
                 timeout=300, what="the new code reading every id")
    module_store.request_stop(pid, "graceful")
    result = last.join(240)
    assert result.state is PipelineState.STOPPED and result.restored_from_epoch == cut
    assert sorted(module_store.get_pipeline(pid).stages) == ["dedup", "out", "src"]
    # every key once over the old and the new input: the kept state knew the old keys, the restore rolled the
    # dedup's sink back to the cut, and the new ids repeating old keys emitted nothing
    assert sorted(folder_values(tmp_path / "out", "k")) == list(range(CRASH_KEYS))
    # the dropped branch's output is as the old code committed it, untouched by both restores
    assert file_tree(tmp_path / "evens") == evens_files
    assert evens_committed() == expected_evens
    assert epoch_objects(module_store, storage, pid, cut) == objects  # the restores only read the epoch's objects
