"""A restore changes nothing until its commit point, and a restore cut short after it is finished by the next
``restore_from='latest'`` (issue 16: a failed restore superseded the newer epochs and a later 'latest' rolled the
sink back: data loss).

One small run of the demo (with its exactly-once Parquet sink) completes a few epochs; then restores are walked
step by step through the driver's step hook (``PipelineDriver.on_step``), a failure (an exception) injected at
each step in turn and a kill simulated at each step (the driver blocks there while the test looks: nothing after
that step happens, as after a SIGKILL). None of these attempts runs a Spark query; only the last run, which
finishes the restore and runs to the end, does.

* before the commit point (register, verify, prepare every stage): the store (epoch states, failure reasons,
  restored_from_epoch, the latest completed epoch) and the storage (every file's size and mtime: channels,
  checkpoint pointers and folders, snapshots, the sink's folder) are unchanged; a killed attempt may have added
  new checkpoint folders, nothing else;
* after it (switch pointers, truncate channels, roll sinks back): the store holds the restore (newer epochs
  superseded, restored_from_epoch, latest = the restored epoch), and the next 'latest' picks the same epoch,
  completes the restore (channels end right after its barrier, pointers name its rebuilt checkpoints, the sink
  is committed through its cut) and the output is exactly the plain-Python one.
"""

from __future__ import annotations

import json
import shutil
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from airflow_arroyo.devtools.history import check_history
from airflow_arroyo.epochs import EpochState, PipelineState
from airflow_arroyo.examples import OUTPUT_CHANNEL, SINK_STAGE, demo, expected_report
from airflow_arroyo.exceptions import PipelineFailedError, SnapshotError
from airflow_arroyo.runtime.channel import Channel
from airflow_arroyo.runtime.driver import PipelineDriver
from airflow_arroyo.runtime.file_sink import committed_files
from airflow_arroyo.runtime.layout import StorageLayout, object_path
from airflow_arroyo.store import EpochStore
from tests.runtime.pipeline_support import DriverThread, committed_rows, row_count, rows_of, run_until, wait_for

pytestmark = [pytest.mark.spark]

ROWS = 600
PER_BATCH = 100


class Injected(Exception):
    """The failure a test injects at a step."""


@dataclass
class Ran:
    pipeline_id: str
    storage: Path
    layout: StorageLayout
    completed: list[int]

    def pipeline(self) -> Any:
        return demo(self.pipeline_id, rows=ROWS, rows_per_batch=PER_BATCH, sink_path=str(self.storage / "report_files"))

    def driver(self, store: EpochStore, spark: Any, restore_from: Any, run_id: str,
               on_step: Callable[[str], None] | None = None) -> PipelineDriver:
        driver = PipelineDriver(self.pipeline(), store, storage_uri=str(self.storage), spark=spark,
                                restore_from=restore_from, run_id=run_id)
        driver.on_step = on_step
        return driver


def completed_epochs(store: EpochStore, pid: str) -> list[int]:
    return sorted(e.epoch for e in store.list_epochs(pid, limit=1000) if e.state is EpochState.COMPLETED)


@pytest.fixture(scope="module")
def ran(spark: Any, module_store: EpochStore, tmp_path_factory: pytest.TempPathFactory) -> Ran:
    """The demo run to its end with at least three completed epochs (the last one the final epoch)."""
    pid = f"steps-{uuid.uuid4().hex[:8]}"
    storage = tmp_path_factory.mktemp("storage")
    r = Ran(pid, storage, StorageLayout.at(str(storage), pid), [])
    driver = r.driver(module_store, spark, None, "first")
    expected = len(expected_report(ROWS))
    run_until(driver, module_store,
              lambda: row_count(driver.layout.channel_uri(OUTPUT_CHANNEL)) >= expected
              and len(completed_epochs(module_store, pid)) >= 2,
              what=f"{expected} report rows and two completed epochs")
    r.completed = completed_epochs(module_store, pid)
    assert len(r.completed) >= 3, r.completed
    assert committed_rows(storage / "report_files") == expected_report(ROWS)
    return r


# ----------------------------------------------------------------------------- what a step may change


def store_view(store: EpochStore, pid: str) -> dict[str, Any]:
    latest = store.latest_completed_epoch(pid)
    return {
        "epochs": {e.epoch: (e.state, e.failure_reason) for e in store.list_epochs(pid, limit=1000)},
        "restored_from_epoch": store.get_pipeline(pid).restored_from_epoch,
        "latest": latest.epoch if latest is not None else None,
    }


def tree(root: Path) -> dict[str, tuple[int, int]]:
    """Every file below ``root``: size and mtime (a rewrite, even to the same bytes, shows)."""
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*")
            if p.is_file()}


def steps_of(driver: PipelineDriver) -> tuple[list[str], list[str]]:
    """The steps of a restore with this pipeline, before and after the commit point (in the driver's order)."""
    before = ["registered", "verified", *(f"prepared:{s}" for s in driver.graph.stage_names)]
    after = ["committed", *(f"switched:{s}" for s in driver.graph.stage_names),
             *(f"truncated:{c}" for c in driver.graph.channels), *(f"rolled-back:{k}" for k in driver.sinks)]
    return before, after


def fail_at(step: str) -> Callable[[str], None]:
    def hook(name: str) -> None:
        if name == step:
            raise Injected(f"injected at {step}")
    return hook


class KillAt:
    """Blocks the driver at ``step`` (as if killed there: nothing after it happens) until released."""

    def __init__(self, step: str) -> None:
        self.step = step
        self.reached = threading.Event()
        self.release = threading.Event()

    def __call__(self, name: str) -> None:
        if name == self.step:
            self.reached.set()
            self.release.wait(120)
            raise Injected(f"killed at {self.step}")  # lets the frozen thread end once the test looked


def attempt(ran: Ran, store: EpochStore, spark: Any, restore_from: Any, step: str, mode: str,
            look: Callable[[], None]) -> None:
    """One restore attempt that fails (``mode='fail'``) or is killed (``'kill'``) at ``step``; ``look`` checks
    what it left: after the failure, or while the driver is frozen at the step."""
    run_id = f"{mode}-{step.replace(':', '-')}-{uuid.uuid4().hex[:4]}"
    if mode == "fail":
        driver = ran.driver(store, spark, restore_from, run_id, fail_at(step))
        with pytest.raises(PipelineFailedError, match=f"injected at {step}"):
            driver.run()
        record = store.get_pipeline(ran.pipeline_id)
        assert record.state is PipelineState.FAILED and f"injected at {step}" in (record.failure_cause or "")
        look()
        return
    kill = KillAt(step)
    thread = DriverThread(ran.driver(store, spark, restore_from, run_id, kill)).start()
    try:
        wait_for(lambda: kill.reached.is_set() or thread.error, timeout=120, what=f"the restore to reach {step}")
        assert kill.reached.is_set(), thread.error
        look()
    finally:
        kill.release.set()
        with pytest.raises(PipelineFailedError, match=f"killed at {step}"):
            thread.join(120)


# ----------------------------------------------------------------------------- the tests


def test_a_restore_failed_or_killed_before_its_commit_point_changes_nothing(ran: Ran, module_store: EpochStore,
                                                                          spark: Any) -> None:
    pid, storage = ran.pipeline_id, ran.storage
    target = ran.completed[0]  # the oldest: restoring it would supersede every other epoch
    store_before, files_before = store_view(module_store, pid), tree(storage)
    assert store_before["latest"] == ran.completed[-1] and store_before["restored_from_epoch"] is None
    before, _ = steps_of(ran.driver(module_store, spark, target, "names"))
    for step in before:
        for mode in ("fail", "kill"):
            def look(step: str = step, mode: str = mode) -> None:
                assert store_view(module_store, pid) == store_before, (mode, step)
                files = tree(storage)
                added = set(files) - set(files_before)
                assert {k: files[k] for k in files_before if k in files} == files_before, (mode, step)
                assert set(files_before) <= set(files), (mode, step)
                # only a killed attempt leaves something: checkpoint folders it was rebuilding (additive; the
                # next run removes them), never named by a pointer
                assert mode == "kill" or not added, (step, sorted(added)[:5])
                assert all(f"/checkpoint-{target}-" in k for k in added), (step, sorted(added)[:5])
            attempt(ran, module_store, spark, target, step, mode, look)
    check_history(module_store.dsn, [pid]).assert_clean()


def test_an_unreachable_snapshot_object_fails_the_restore_and_every_newer_epoch_stays_restorable(
        ran: Ran, module_store: EpochStore, spark: Any, tmp_path: Path) -> None:
    """The issue's case: epochs completed, a restore of an older one fails because a snapshot object is
    briefly unreachable; every newer epoch is still completed and restorable, and 'latest' is the newest."""
    pid, storage = ran.pipeline_id, ran.storage
    target = ran.completed[0]
    entries = module_store.snapshot_entries(pid, target, "joined")
    victim = next(e for e in entries if e.rel_path.startswith("state/"))
    obj = storage / object_path(pid, victim.object_key)
    store_before = store_view(module_store, pid)
    shutil.move(obj, tmp_path / "away")
    files_before = tree(storage)
    try:
        with pytest.raises(SnapshotError, match=rf"epoch {target} cannot be restored: file {victim.rel_path}.* is "
                                                 "missing; nothing was changed"):
            ran.driver(module_store, spark, target, "unreachable").run()
        assert tree(storage) == files_before
    finally:
        shutil.move(tmp_path / "away", obj)
    assert store_view(module_store, pid) == store_before
    assert module_store.get_pipeline(pid).restored_from_epoch is None
    assert store_before["latest"] == ran.completed[-1]
    # every newer epoch is restorable: its restore verifies and prepares everything (stopped right before it
    # would commit), and 'latest' plans the newest
    before, _ = steps_of(ran.driver(module_store, spark, target, "names"))
    for n in [*ran.completed[1:], "latest"]:
        with pytest.raises(PipelineFailedError, match=f"injected at {before[-1]}"):
            ran.driver(module_store, spark, n, f"check-{n}", fail_at(before[-1])).run()
    assert store_view(module_store, pid) == store_before


def test_a_restore_cut_short_after_its_commit_point_is_finished_by_the_next_latest_exactly(
        ran: Ran, module_store: EpochStore, spark: Any) -> None:
    pid, storage, layout = ran.pipeline_id, ran.storage, ran.layout
    target = ran.completed[1]  # completed epochs before and after it
    newer = [n for n in ran.completed if n > target]
    probe = ran.driver(module_store, spark, target, "names")
    before, after = steps_of(probe)

    def committed() -> None:
        view = store_view(module_store, pid)
        assert view["latest"] == target and view["restored_from_epoch"] == target
        assert all(view["epochs"][n][0] is EpochState.SUPERSEDED for n in newer), view["epochs"]
        assert all(view["epochs"][n][0] is EpochState.COMPLETED for n in ran.completed if n <= target)

    restore_from: Any = target
    for step in after:
        for mode in ("fail", "kill"):
            attempt(ran, module_store, spark, restore_from, step, mode, committed)
            restore_from = "latest"  # from now on 'latest' is the target: it finishes what was cut short

    # the next 'latest' finishes the restore (same epoch, every step) and runs to the end: exact output
    seen: list[str] = []
    restored: dict[str, Any] = {}

    def watch(name: str) -> None:
        seen.append(name)
        if name == "restored":  # before any query starts: what the restore left
            restored["ends"] = {c: Channel.open(layout.channel_uri(c)).end_position() for c in probe.graph.channels}
            restored["checkpoints"] = {s: sorted(str(p.relative_to(storage / layout.checkpoint(s)))
                                                 for p in (storage / layout.checkpoint(s)).rglob("*") if p.is_file())
                                       for s in probe.graph.stage_names}
            sink = storage / "report_files"
            restored["sink"] = (json.loads((sink / "_arroyo_sink" / "committed.json").read_text())["through"],
                                committed_files(str(sink)),
                                sorted(str(p.relative_to(sink)) for p in sink.rglob("*")
                                       if p.is_file() and not str(p.relative_to(sink)).startswith(("_", "."))))

    driver = ran.driver(module_store, spark, "latest", "finish", watch)
    expected = expected_report(ROWS)
    result = run_until(driver, module_store, lambda: len(committed_rows(storage / "report_files")) >= len(expected),
                       what="the sink to commit every row")
    assert seen == [*before, *after, "restored"]
    assert result.restored_from_epoch == target
    # what the restore left: channels end right after barrier `target`, pointers name its rebuilt checkpoints,
    # the sink holds exactly the batches up to its cut in `target`
    for c, end in restored["ends"].items():
        assert end == Channel.open(layout.channel_uri(c)).find_barrier(target) + 1, c
    for s, files in restored["checkpoints"].items():
        assert files == sorted({e.rel_path for e in module_store.snapshot_entries(pid, target, s)}), s
    (cut,) = [a.details["batch_id"] for a in module_store.acks(pid, target) if a.stage == SINK_STAGE]
    through, listed, visible = restored["sink"]
    assert through == cut and visible and visible == sorted(listed), (through, cut, visible[:3], listed[:3])
    assert max(int(f.split("-", 1)[0]) for f in visible) <= cut  # later batches' files are gone
    # and the run from there: exactly the plain-Python output, in the final channel and in the sink
    assert rows_of(layout.channel_uri(OUTPUT_CHANNEL)) == expected
    assert committed_rows(storage / "report_files") == expected
    check_history(module_store.dsn, [pid]).assert_clean()
