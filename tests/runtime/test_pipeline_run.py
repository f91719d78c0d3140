"""The demo pipeline run in-process on real Spark with a real epoch store: epochs while it runs, the
output against plain Python, every stage's acks and barriers, a graceful stop with a final epoch, a
restore from a middle epoch that gives the same output, and the refusals of impossible restores.

The steps of a restore are walked with a failure injected at each and a kill simulated at each (the driver
blocks at the step while the test looks: nothing after it happens, as after a SIGKILL), through the driver's
step hook (``PipelineDriver.on_step``) and without running a Spark query (issue 16: a failed restore superseded
the newer epochs, and a later 'latest' rolled the sink back). Before the commit point the store (epoch states,
restored_from_epoch, the latest completed epoch) and every file's size and mtime (channels, checkpoint pointers
and folders, snapshots, the sink's folder) are unchanged; after it the next 'latest' picks the same epoch,
finishes the restore and runs to the exact output."""

from __future__ import annotations

import json
import re
import shutil
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from airflow_arroyo.core.epochs import EpochState, PipelineState
from airflow_arroyo.core.exceptions import (
    ConfigurationError,
    PipelineFailedError,
    SnapshotError,
    UnrestorableEpochError,
)
from airflow_arroyo.devtools.history import check_history
from airflow_arroyo.examples import OUTPUT_CHANNEL, SINK_STAGE, demo, expected_report
from airflow_arroyo.runtime.channel import Channel
from airflow_arroyo.runtime.driver import PipelineDriver
from airflow_arroyo.runtime.layout import StorageLayout, object_path
from airflow_arroyo.runtime.sinks.files import committed_files, committed_through
from airflow_arroyo.store import EpochStore
from airflow_arroyo.testing import channel_barriers, channel_row_count, channel_rows, committed_rows, run_until
from tests.runtime.pipeline_support import (
    check_barriers_follow_cuts,
    fail_at,
    file_tree,
    interrupted_restore,
    restore_steps,
    sigkill_restore_at,
    store_view,
)

pytestmark = [pytest.mark.spark]

ROWS = 2400
PER_BATCH = 150
CHANNELS = ["left", "right", "joined", "report"]
STAGES = [*CHANNELS, SINK_STAGE]  # the demo with its exactly-once Parquet sink


def pipeline_kwargs(pipeline_id: str, storage: Path) -> dict[str, Any]:
    return {"pipeline_id": pipeline_id, "rows": ROWS, "rows_per_batch": PER_BATCH,
            "sink_path": str(storage / "report_files")}


def pipeline(pipeline_id: str, storage: Path, *, chaining: bool | None = False) -> Any:
    return demo(**pipeline_kwargs(pipeline_id, storage), chaining=chaining)


def sigkill_restore(store: EpochStore, pipeline_id: str, storage: Path, restore_from: Any, step: str) -> None:
    """A real SIGKILL of a restore at ``step`` (in a process of its own; a restore runs no Spark query)."""
    sigkill_restore_at(step, dsn=store.dsn, storage=storage, pipeline="airflow_arroyo.examples.pipelines:demo",
                       kwargs=pipeline_kwargs(pipeline_id, storage), restore_from=restore_from,
                       run_id=f"sigkill-{step.replace(':', '-')}")


def sink_rows(storage: Path) -> list[tuple[Any, ...]]:
    """What a reader of the sink's folder sees (committed batches only)."""
    return committed_rows(storage / "report_files")


@dataclass
class Ran:
    pipeline_id: str
    storage: Path
    result: Any
    expected: list[tuple[Any, ...]]
    layout: StorageLayout
    driver: PipelineDriver


def driver_for(spark: Any, store: EpochStore, pipeline_id: str, storage: Path, *, restore_from: Any = None,
               run_id: str | None = None, on_step: Callable[[str], None] | None = None,
               takeover: bool = False, chaining: bool | None = False) -> PipelineDriver:
    driver = PipelineDriver(pipeline(pipeline_id, storage, chaining=chaining), store, storage_uri=str(storage),
                            run_id=run_id, restore_from=restore_from, spark=spark, takeover=takeover)
    driver.on_step = on_step
    return driver


def run_to_end(spark: Any, store: EpochStore, pipeline_id: str, storage: Path, *, restore_from: Any = None,
               epochs: bool = True, run_id: str | None = None, stop: str = "graceful",
               on_step: Callable[[str], None] | None = None, self_contained_every: int = 0,
               chaining: bool | None = False) -> Any:
    """Run the demo until its report has every expected row, then stop (graceful: with a final epoch)."""
    driver = driver_for(spark, store, pipeline_id, storage, restore_from=restore_from, run_id=run_id,
                        on_step=on_step, chaining=chaining)
    return run_driver_to_end(driver, store, epochs=epochs, stop=stop, self_contained_every=self_contained_every)


def run_driver_to_end(driver: PipelineDriver, store: EpochStore, *, epochs: bool = True, stop: str = "graceful",
                      self_contained_every: int = 0) -> Any:
    """Run the demo's ``driver`` until its report has every expected row, then stop."""
    expected = len(expected_report(ROWS))
    return run_until(driver, store, lambda: channel_row_count(driver.layout.channel_uri(OUTPUT_CHANNEL)) >= expected,
                     what=f"{expected} rows in the report channel", epochs=epochs, stop=stop,
                     self_contained_every=self_contained_every)


@pytest.fixture(scope="module")
def ran(spark: Any, module_store: EpochStore, tmp_path_factory: pytest.TempPathFactory) -> Ran:
    pid = f"run-{uuid.uuid4().hex[:8]}"
    storage = tmp_path_factory.mktemp("storage")
    driver = driver_for(spark, module_store, pid, storage, run_id="straight")
    result = run_driver_to_end(driver, module_store, self_contained_every=2)
    return Ran(pid, storage, result, expected_report(ROWS), StorageLayout.at(str(storage), pid), driver)


def test_the_driver_has_the_jvm_forget_the_socket_files_spark_deleted(ran: Ran) -> None:
    """Each micro-batch a stage collects to the driver leaves its socket file's path in the JVM's delete-on-exit
    list (Spark 4.2, Python workers over the socket); the driver's loop has the JVM forget the paths of files
    already gone, every heartbeat (airflow_arroyo.jvm.SocketPathPruner; test_jvm.py checks its rule)."""
    pruner = ran.driver.socket_paths
    assert pruner is not None and pruner.active
    assert pruner.forgotten >= len(ran.result.epochs_seen), pruner.forgotten  # at least one batch per epoch


def test_output_equals_plain_python(ran: Ran) -> None:
    got = channel_rows(ran.layout.channel_uri(OUTPUT_CHANNEL))
    assert len(got) == len(ran.expected)
    assert got == ran.expected
    # the Parquet sink committed every batch with the final epoch; nothing is left pending
    assert sink_rows(ran.storage) == ran.expected
    assert not list((ran.storage / "report_files" / "_arroyo_sink" / "pending").iterdir())


def test_the_sink_commits_recorded_in_the_store_are_what_the_folder_holds(ran: Ran, module_store: EpochStore) -> None:
    """Each commit is recorded (what Airflow's Asset events carry): rows counted at pre-commit add up to
    the rows a reader sees, files and bytes to the committed files; the final epoch committed last."""
    commits = module_store.sink_commits(ran.pipeline_id, sink=SINK_STAGE, limit=10_000)
    assert len(commits) >= 2 and [c.epoch for c in commits] == sorted({c.epoch for c in commits})
    assert [c.batch_id for c in commits] == sorted(c.batch_id for c in commits)
    files = [p for p in (ran.storage / "report_files").rglob("*")
             if p.is_file() and not any(part.startswith(("_", ".")) for part in p.relative_to(ran.storage).parts)]
    assert sum(c.rows_committed or 0 for c in commits) == len(sink_rows(ran.storage)) == len(ran.expected)
    assert sum(c.files for c in commits) == len(files)
    assert sum(c.bytes_committed for c in commits) == sum(p.stat().st_size for p in files)
    final = module_store.latest_completed_epoch(ran.pipeline_id)
    assert final is not None and final.is_final and commits[-1].epoch == final.epoch


def test_self_contained_epochs_share_no_object_and_every_epoch_verifies(ran: Ran, module_store: EpochStore) -> None:
    """Every second epoch of the run was asked for self-contained: each stage's snapshot of it copied every file
    under keys private to it; the others are incremental; a scrub of the whole run finds every object sound."""
    from airflow_arroyo.core.scrub import verify_pipeline

    epochs = [e for e in module_store.list_epochs(ran.pipeline_id) if e.state is EpochState.COMPLETED]
    whole = [e.epoch for e in epochs if e.self_contained]
    assert whole and len(whole) < len(epochs)
    keys = {e.epoch: {x.object_key for s in STAGES for x in module_store.snapshot_entries(ran.pipeline_id, e.epoch, s)}
            for e in epochs}
    for n in whole:
        assert keys[n] and all(k.startswith(f"epochs/{n}/sha256/") for k in keys[n])
        assert all(keys[n].isdisjoint(keys[m]) for m in keys if m != n)
    assert all(k.startswith("sha256/") for n in keys if n not in whole for k in keys[n])
    report = verify_pipeline(module_store, ran.pipeline_id)
    assert report.ok and report.restorable_epochs == sorted(keys) and report.objects_checked == report.objects_total


def test_graceful_stop_took_a_completed_final_epoch(ran: Ran, module_store: EpochStore) -> None:
    assert ran.result.state is PipelineState.STOPPED
    assert ran.result.final_epoch is not None
    final = module_store.get_epoch(ran.pipeline_id, ran.result.final_epoch)
    assert final.state is EpochState.COMPLETED and final.is_final
    assert module_store.get_pipeline(ran.pipeline_id).state is PipelineState.STOPPED


def test_epochs_completed_while_running_with_every_stage_acknowledged(ran: Ran, module_store: EpochStore) -> None:
    epochs = module_store.list_epochs(ran.pipeline_id)
    completed = sorted(e.epoch for e in epochs if e.state is EpochState.COMPLETED)
    assert len(completed) >= 3, [(e.epoch, e.state, e.failure_reason) for e in epochs]
    layout = ran.layout
    positions = {c: dict((e, i) for i, e in channel_barriers(layout.channel_uri(c))) for c in CHANNELS}
    for n in completed:
        acks = {a.stage: a for a in module_store.acks(ran.pipeline_id, n)}
        assert sorted(acks) == sorted(STAGES)
        # cursors: right after barrier n on each input channel
        assert acks["joined"].cursors == {"left": positions["left"][n] + 1, "right": positions["right"][n] + 1}
        assert acks["report"].cursors == {"joined": positions["joined"][n] + 1}
        assert acks[SINK_STAGE].cursors == {"report": positions["report"][n] + 1}
        assert acks["left"].cursors == {}
        for a in acks.values():
            assert a.bytes_total is not None and a.bytes_total > 0 and a.bytes_new is not None
            assert a.alignment_ms is not None and a.sync_ms is not None and a.async_ms is not None
        epoch = module_store.get_epoch(ran.pipeline_id, n)
        assert epoch.bytes_total == sum(a.bytes_total for a in acks.values())
    for c in CHANNELS:
        seen = [e for _, e in channel_barriers(layout.channel_uri(c))]
        assert seen == sorted(seen), f"barriers out of order in {c}: {seen}"
        assert set(completed) <= set(seen)


def test_barrier_n_separates_the_data_of_epoch_n(ran: Ran, module_store: EpochStore) -> None:
    """Consistency of the cut across stages: the joined rows before barrier n in 'joined' are exactly the
    join of the left and right rows before barrier n (nothing in flight is lost or counted twice)."""
    from airflow_arroyo.runtime.channel import Channel

    layout = ran.layout
    completed = [e.epoch for e in module_store.list_epochs(ran.pipeline_id) if e.state is EpochState.COMPLETED]
    left, right, joined = (Channel.open(layout.channel_uri(c)) for c in ("left", "right", "joined"))
    for n in completed:
        ids_l = set(left.read_table(0, left.find_barrier(n)).column("id").to_pylist())
        ids_r = set(right.read_table(0, right.find_barrier(n)).column("id").to_pylist())
        ids_j = joined.read_table(0, joined.find_barrier(n)).column("id").to_pylist()
        assert len(ids_j) == len(set(ids_j))
        assert set(ids_j) == ids_l & ids_r


def test_straight_run_without_epochs_gives_the_same_output(ran: Ran, module_store: EpochStore, spark: Any,
                                                           tmp_path: Path) -> None:
    """Straight (no epoch at all), with checkpoints (``ran``) and restored (below): one golden output."""
    pid = f"straight-{uuid.uuid4().hex[:8]}"
    result = run_to_end(spark, module_store, pid, tmp_path, epochs=False, stop="immediate")
    assert result.final_epoch is None and module_store.list_epochs(pid) == []
    layout = StorageLayout.at(str(tmp_path), pid)
    assert channel_rows(layout.channel_uri(OUTPUT_CHANNEL)) == channel_rows(ran.layout.channel_uri(OUTPUT_CHANNEL))
    for c in CHANNELS:
        assert channel_barriers(layout.channel_uri(c)) == []
    assert sink_rows(tmp_path) == []  # no epoch, no commit: the sink's batches stay pending
    # no completed epoch to restore from: 'latest' starts over (checkpoints set aside, channels reset)
    again = run_to_end(spark, module_store, pid, tmp_path, restore_from="latest", epochs=False, stop="immediate")
    assert again.restored_from_epoch is None
    assert channel_rows(layout.channel_uri(OUTPUT_CHANNEL)) == ran.expected
    # the start over switched the stage's checkpoint pointer to a new folder; the old one stays as 'previous'
    pointer = json.loads((tmp_path / pid / "stages" / "joined" / "checkpoint.json").read_text())
    assert pointer["current"] != "checkpoint" and pointer.get("previous") == "checkpoint", pointer


def test_the_fused_form_gives_the_same_output_checkpointed_and_restored(ran: Ran, module_store: EpochStore,
                                                                      spark: Any, tmp_path: Path) -> None:
    """Operator chaining (issue 12): the demo with both sources, the join and the filter fused into one query
    (the join's state and both sources' offsets in that query's checkpoint, no channel before the report) gives
    the unfused run's output with epochs, and again restored from a middle epoch; in the report channel and in
    the exactly-once sink. The first run leaves chaining to the graph (the default): it fuses."""
    pid = f"fused-{uuid.uuid4().hex[:8]}"
    fused = [f"left~right~joined~{OUTPUT_CHANNEL}", SINK_STAGE]
    first = run_to_end(spark, module_store, pid, tmp_path, run_id="fused", chaining=None)
    layout = StorageLayout.at(str(tmp_path), pid)
    record = module_store.get_pipeline(pid)
    assert sorted(record.stages) == sorted(fused)
    assert [q["stages"] for q in record.config["plan"]["queries"]] == [
        ["left", "right", "joined", OUTPUT_CHANNEL], [SINK_STAGE]]
    assert not any(Channel.exists(layout.channel_uri(c)) for c in ("left", "right", "joined"))  # compiled away
    assert channel_rows(layout.channel_uri(OUTPUT_CHANNEL)) == ran.expected
    assert sink_rows(tmp_path) == ran.expected
    completed = completed_epochs(module_store, pid)
    assert completed and completed[-1] == first.final_epoch
    for n in completed:
        assert sorted(a.stage for a in module_store.acks(pid, n)) == sorted(fused), n
    middle = completed[(len(completed) - 1) // 2]
    again = run_to_end(spark, module_store, pid, tmp_path, restore_from=middle, epochs=False, run_id="fused-again",
                       chaining=True)
    assert again.restored_from_epoch == middle
    assert channel_rows(layout.channel_uri(OUTPUT_CHANNEL)) == ran.expected
    assert sink_rows(tmp_path) == ran.expected
    # the unfused form's checkpoints are not the fused one's: a restore across the change is refused by name
    with pytest.raises(ConfigurationError, match="joined"):
        driver_for(spark, module_store, pid, tmp_path, restore_from="latest", takeover=True).run()


def test_each_barrier_sits_right_after_its_cut_batch(ran: Ran, module_store: EpochStore) -> None:
    """Barrier n follows the output of the stage's cut batch and precedes any later batch's output."""
    uris = {c: ran.layout.channel_uri(c) for c in CHANNELS}
    assert check_barriers_follow_cuts(module_store, ran.pipeline_id, uris) >= 3 * len(CHANNELS)


def copy_of(ran: Ran, tmp_path: Path) -> Path:
    target = tmp_path / "storage"
    shutil.copytree(ran.storage, target)
    return target


def completed_epochs(store: EpochStore, pipeline_id: str) -> list[int]:
    return sorted(e.epoch for e in store.list_epochs(pipeline_id, limit=1000) if e.state is EpochState.COMPLETED)


def test_a_restore_failed_or_killed_before_its_commit_point_changes_nothing(ran: Ran, module_store: EpochStore,
                                                                          spark: Any, tmp_path: Path) -> None:
    storage, pid = copy_of(ran, tmp_path), ran.pipeline_id
    completed = completed_epochs(module_store, pid)
    target = completed[0]  # the oldest: restoring it would supersede every other epoch
    store_before, files_before = store_view(module_store, pid), file_tree(storage)
    assert store_before["latest"] == completed[-1] > target and store_before["restored_from_epoch"] is None

    def make(run_id: str, hook: Callable[[str], None]) -> PipelineDriver:
        return driver_for(spark, module_store, pid, storage, restore_from=target, run_id=run_id, on_step=hook)

    before, _ = restore_steps(make("names", fail_at("")))
    for step in before:
        for mode in ("fail", "kill"):
            def look(step: str = step, mode: str = mode) -> None:
                assert store_view(module_store, pid) == store_before, (mode, step)
                files = file_tree(storage)
                assert {k: files.get(k) for k in files_before} == files_before, (mode, step)  # nothing touched
                # only a killed restore leaves something: the checkpoint folders it was rebuilding (never named
                # by a pointer; the next run removes them)
                added = sorted(set(files) - set(files_before))
                assert mode == "kill" or not added, (step, added[:5])
                assert all(f"/checkpoint-{target}-" in k for k in added), (step, added[:5])
            interrupted_restore(make, step, mode, look)
    # a real SIGKILL at the last step before the commit point: the same
    sigkill_restore(module_store, pid, storage, target, before[-1])
    record = module_store.get_pipeline(pid)
    assert (record.state, record.run_id) == (PipelineState.REGISTERED, f"sigkill-{before[-1].replace(':', '-')}")
    look(before[-1], "kill")
    # the next run takes the dead one over and removes what it left; still nothing else changed
    with pytest.raises(PipelineFailedError, match="injected at verified"):
        driver_for(spark, module_store, pid, storage, restore_from=target, run_id="after-kill",
                   on_step=fail_at("verified"), takeover=True).run()
    assert store_view(module_store, pid) == store_before and file_tree(storage) == files_before


def test_an_unreachable_snapshot_object_fails_the_restore_and_every_newer_epoch_stays_restorable(
        ran: Ran, module_store: EpochStore, spark: Any, tmp_path: Path) -> None:
    """The issue's case: a restore of an older epoch fails because a snapshot object is briefly unreachable;
    every newer epoch is still completed and restorable, and 'latest' is still the newest."""
    storage, pid = copy_of(ran, tmp_path), ran.pipeline_id
    completed = completed_epochs(module_store, pid)
    target = completed[0]
    victim = next(e for e in module_store.snapshot_entries(pid, target, "joined") if e.rel_path.startswith("state/"))
    obj = storage / object_path(pid, victim.object_key)
    # objects are content-addressed: files with the same bytes share the object, and the check names the first
    # of them it meets
    sharing = sorted({e.rel_path for s in STAGES for e in module_store.snapshot_entries(pid, target, s)
                      if e.object_key == victim.object_key})
    named = "|".join(map(re.escape, sharing))
    store_before = store_view(module_store, pid)
    shutil.move(obj, tmp_path / "away")
    files_before = file_tree(storage)
    try:
        with pytest.raises(SnapshotError, match=rf"epoch {target} cannot be restored: file ({named}) .* is missing; "
                                                 "nothing was changed"):
            driver_for(spark, module_store, pid, storage, restore_from=target, run_id="unreachable").run()
        assert file_tree(storage) == files_before
    finally:
        shutil.move(tmp_path / "away", obj)
    assert store_view(module_store, pid) == store_before
    assert store_before["latest"] == completed[-1] and store_before["restored_from_epoch"] is None
    # every newer epoch, and 'latest', verifies and prepares everything (stopped right before its commit point)
    before, _ = restore_steps(driver_for(spark, module_store, pid, storage))
    for n in [*completed[1:], "latest"]:
        with pytest.raises(PipelineFailedError, match=f"injected at {before[-1]}"):
            driver_for(spark, module_store, pid, storage, restore_from=n, run_id=f"check-{n}",
                       on_step=fail_at(before[-1])).run()
    assert store_view(module_store, pid) == store_before


def test_an_epoch_spark_would_refuse_is_marked_before_the_commit_point_and_then_refused_by_name(
        ran: Ran, module_store: EpochStore, spark: Any, tmp_path: Path) -> None:
    """Issue 30, finding 1: an epoch recorded with a snapshot Spark cannot restart from (here: state files and
    no committed batch, what a cut before batch 0 used to keep) fails its restore before the commit point,
    changes nothing, and is recorded, so that the next restore of it is refused by name before registering."""
    import psycopg2

    storage, pid = copy_of(ran, tmp_path), ran.pipeline_id
    target = completed_epochs(module_store, pid)[0]
    store_before = store_view(module_store, pid)
    with psycopg2.connect(module_store.dsn) as conn, conn.cursor() as cur:
        cur.execute("DELETE FROM arroyo_epoch_objects WHERE pipeline_id = %s AND epoch = %s AND stage = %s"
                    " AND (rel_path LIKE 'commits/%%' OR rel_path LIKE 'offsets/%%') RETURNING *",
                    (pid, target, "joined"))
        removed = cur.fetchall()
    conn.close()
    assert removed
    files_before = file_tree(storage)
    try:
        with pytest.raises(UnrestorableEpochError, match=rf"epoch {target} cannot be restored: its snapshot of "
                                                          "stage 'joined' .*no committed batch.*nothing was changed"):
            driver_for(spark, module_store, pid, storage, restore_from=target, run_id="unrestorable").run()
        assert file_tree(storage) == files_before
        assert store_view(module_store, pid) == store_before
        assert "no committed batch" in (module_store.get_epoch(pid, target).unrestorable or "")
        with pytest.raises(UnrestorableEpochError, match=rf"epoch {target} of pipeline .* \(found by an earlier "
                                                          r"restore, which changed nothing: its snapshot of stage "
                                                          r"'joined': \d+ state file"):
            driver_for(spark, module_store, pid, storage, restore_from=target, run_id="refused").run()
        assert module_store.get_pipeline(pid).run_id == "unrestorable"  # refused before registering
    finally:
        with psycopg2.connect(module_store.dsn) as conn, conn.cursor() as cur:
            cur.executemany("INSERT INTO arroyo_epoch_objects VALUES (%s, %s, %s, %s, %s)", removed)
            cur.execute("UPDATE arroyo_epochs SET unrestorable = NULL WHERE pipeline_id = %s", (pid,))
        conn.close()


def test_restore_from_a_middle_epoch_gives_the_same_output(ran: Ran, module_store: EpochStore, spark: Any,
                                                           tmp_path: Path) -> None:
    """Walked first: a failure and a kill at each step after the commit point; each time the store holds the
    restore, and the next 'latest' (same epoch) carries it on. The last one finishes it and runs to the end."""
    storage, pid = copy_of(ran, tmp_path), ran.pipeline_id
    completed = completed_epochs(module_store, pid)
    middle = completed[len(completed) // 2 - 1] if len(completed) > 1 else completed[0]
    newer = [n for n in completed if n > middle]
    layout = StorageLayout.at(str(storage), pid)

    def make(restore_from: Any) -> Callable[[str, Callable[[str], None]], PipelineDriver]:
        return lambda run_id, hook: driver_for(spark, module_store, pid, storage, restore_from=restore_from,
                                               run_id=run_id, on_step=hook, takeover=True)

    def committed() -> None:
        view = store_view(module_store, pid)
        assert view["latest"] == middle and view["restored_from_epoch"] == middle
        assert all(view["epochs"][n][0] is EpochState.SUPERSEDED for n in newer), view["epochs"]

    probe = driver_for(spark, module_store, pid, storage)
    before, after = restore_steps(probe)
    # a real SIGKILL half-way through the roll-forward (pointers switched, one channel truncated)
    sigkill_restore(module_store, pid, storage, middle, f"truncated:{CHANNELS[0]}")
    committed()
    restore_from: Any = "latest"
    for step in after:
        for mode in ("fail", "kill"):
            interrupted_restore(make(restore_from), step, mode, committed)  # 'latest' is `middle` now

    seen: list[str] = []
    restored: dict[str, Any] = {}

    def watch(name: str) -> None:
        seen.append(name)
        if name == "restored":  # before any query starts: what the restore left
            sink = storage / "report_files"
            restored["ends"] = {c: Channel.open(layout.channel_uri(c)).end_position() for c in CHANNELS}
            restored["checkpoints"] = {
                s: sorted(str(p.relative_to(storage / layout.checkpoint(s)))
                          for p in (storage / layout.checkpoint(s)).rglob("*") if p.is_file()) for s in STAGES}
            restored["sink"] = (committed_through(str(sink)),
                                committed_files(str(sink)),
                                sorted(str(p.relative_to(sink)) for p in sink.rglob("*")
                                       if p.is_file() and not str(p.relative_to(sink)).startswith(("_", "."))))

    result = run_to_end(spark, module_store, pid, storage, restore_from="latest", epochs=False,
                        run_id="restored", on_step=watch)
    assert seen == [*before, *after, "restored", "queries-started", "warm"]  # then the queries start and warm up
    assert result.restored_from_epoch == middle
    assert module_store.get_pipeline(pid).restored_from_epoch == middle
    # what the restore left: channels end right after barrier `middle`, pointers name its rebuilt checkpoints,
    # the sink's folder holds exactly the batches up to its cut in `middle`
    for c, end in restored["ends"].items():
        assert end == Channel.open(layout.channel_uri(c)).find_barrier(middle) + 1, c
    for stage, files in restored["checkpoints"].items():
        assert files == sorted({e.rel_path for e in module_store.snapshot_entries(pid, middle, stage)}), stage
    (cut,) = [a.details["batch_id"] for a in module_store.acks(pid, middle) if a.stage == SINK_STAGE]
    through, listed, visible = restored["sink"]
    assert through == cut and visible == sorted(listed), (through, cut, visible[:3], listed[:3])
    assert all(int(f.split("-", 1)[0]) <= cut for f in visible)  # later batches' files are gone
    # and from there: the plain-Python output
    assert channel_rows(layout.channel_uri(OUTPUT_CHANNEL)) == ran.expected
    assert sink_rows(storage) == ran.expected  # the sink was rolled back to `middle`, then re-committed
    # the channels were cut right after barrier `middle`: no later barrier of the first run survived
    for c in CHANNELS:
        seen_barriers = [e for _, e in channel_barriers(layout.channel_uri(c))]
        later = [e for e in seen_barriers if middle < e < result.final_epoch]
        assert later == [], (c, seen_barriers)
    check_history(module_store.dsn, [pid]).assert_clean()


def test_fresh_start_over_existing_state_is_refused_before_anything_is_written(ran: Ran, module_store: EpochStore,
                                                                                  spark: Any, tmp_path: Path) -> None:
    storage = copy_of(ran, tmp_path)
    before = module_store.get_pipeline(ran.pipeline_id)
    driver = PipelineDriver(pipeline(ran.pipeline_id, storage), module_store,
                            storage_uri=str(storage), spark=spark)
    with pytest.raises(ConfigurationError, match="restore_from='latest'"):
        driver.run()
    assert module_store.get_pipeline(ran.pipeline_id).run_id == before.run_id
    with pytest.raises(ConfigurationError, match="not completed|has no epoch"):
        PipelineDriver(demo(ran.pipeline_id), module_store, storage_uri=str(storage), spark=spark,
                       restore_from=999).run()


def test_corrupt_snapshot_fails_the_restore_naming_epoch_and_file_and_deletes_nothing(
        ran: Ran, module_store: EpochStore, spark: Any, tmp_path: Path) -> None:
    storage = copy_of(ran, tmp_path)
    pid = ran.pipeline_id
    # the oldest epoch: still completed whatever the restores of the tests above superseded
    epoch = min(e.epoch for e in module_store.list_epochs(pid, limit=1000) if e.state is EpochState.COMPLETED)
    entries = module_store.snapshot_entries(pid, epoch, "joined")
    victim = next(e for e in entries if e.rel_path.startswith("state/"))
    obj = storage / object_path(pid, victim.object_key)
    obj.write_bytes(b"garbage")
    files_before = sorted(str(p.relative_to(storage)) for p in storage.rglob("*") if p.is_file())
    driver = PipelineDriver(pipeline(pid, storage), module_store, storage_uri=str(storage),
                            spark=spark, restore_from=epoch, run_id="corrupt")
    # content-addressed: files with the same bytes (e.g. two state stores' empty deltas) share the one object, and
    # the restore, copying in parallel, names whichever of them it verified first
    sharing = "|".join(re.escape(e.rel_path) for e in entries if e.object_key == victim.object_key)
    with pytest.raises(SnapshotError, match=rf"epoch {epoch} cannot be restored: file ({sharing}) ") as err:
        driver.run()
    assert err.value.epoch == epoch
    assert sorted(str(p.relative_to(storage)) for p in storage.rglob("*") if p.is_file()) == files_before
    record = module_store.get_pipeline(pid)
    assert record.state is PipelineState.FAILED and f"epoch {epoch} cannot be restored" in (record.failure_cause or "")


def test_a_failing_stage_fails_the_pipeline_with_its_cause(module_store: EpochStore, spark: Any,
                                                           tmp_path: Path) -> None:
    from pyspark.sql import functions as F
    from pyspark.sql.types import LongType

    from airflow_arroyo.runtime.pipeline import Pipeline
    from airflow_arroyo.testing import generator_source

    def explode_at_500(i: int) -> int:
        if i == 500:
            raise ValueError("row 500 is cursed")
        return i

    boom = F.udf(explode_at_500, LongType())
    pid = f"fail-{uuid.uuid4().hex[:8]}"
    p = Pipeline(pid)
    src = p.source("src", lambda s: generator_source(s, seed=3, total_rows=1000, rows_per_batch=200))
    p.stage("boom", lambda df: df.select(boom("id").alias("id")), inputs=[src])
    driver = PipelineDriver(p, module_store, storage_uri=str(tmp_path), spark=spark)
    with pytest.raises(PipelineFailedError, match="boom") as err:
        driver.run()
    assert "row 500 is cursed" in str(err.value)
    record = module_store.get_pipeline(pid)
    assert record.state is PipelineState.FAILED
    # the user's error leads, before Spark's and py4j's traces; the stage runs fused with its source (the graph
    # decides), and the cause names the query and the stages in it
    cause = record.failure_cause or ""
    assert cause.startswith("stage 'src~boom' (fused: src, boom) failed: ValueError: row 500 is cursed\n"), cause[:500]


def test_a_pinned_epoch_survives_keep_last_1_and_a_fork_of_it_gives_the_same_output(
        module_store: EpochStore, spark: Any, tmp_path: Path) -> None:
    """What production does: the pipeline dies mid-way; its oldest completed epoch P was pinned and forked
    (airflow-arroyo pin / fork); the retention DAG prunes with keep_last=1 (snapshot objects of the other
    epochs and channel entries before the oldest kept barrier go). Restored from P, the pipeline runs to the
    plain-Python rows in its Parquet sink; the fork, started from P in storage of its own (reading P's
    snapshot objects where they are), produces the same: the report channel as the original's, and in its
    sink exactly the rows the original committed after P's cut."""
    from airflow_arroyo.core.epochs import RetentionPolicy
    from airflow_arroyo.core.retention import prune_pipeline

    pid = f"pruned-{uuid.uuid4().hex[:8]}"
    fork_id, fork_storage = f"{pid}-fork", tmp_path / "fork"
    expected = expected_report(ROWS)
    driver = PipelineDriver(pipeline(pid, tmp_path), module_store, storage_uri=str(tmp_path), spark=spark,
                            run_id="first")
    run_until(driver, module_store, lambda: len(completed_epochs(module_store, pid)) >= 3,
              what="three completed epochs", stop="immediate")
    pinned, *middle, latest = completed_epochs(module_store, pid)
    report_channel = Channel.open(driver.layout.channel_uri(OUTPUT_CHANNEL))
    barrier = report_channel.find_barrier(pinned)
    assert barrier is not None
    at_pinned = sum(e.rows for e in report_channel.data_entries(report_channel.start_position(), barrier))
    assert at_pinned < len(expected)  # restoring the pinned epoch leaves work to redo (the run may have finished)
    module_store.pin_epoch(pid, pinned, "before the upgrade")
    module_store.fork_pipeline(pid, pinned, fork_id)
    report = prune_pipeline(module_store, pid, RetentionPolicy(keep_last=1), holder="test")
    assert middle and set(middle) <= set(report.epochs_pruned) and report.kept == [pinned, latest]

    prefix: list[tuple[Any, ...]] = []

    def at_restored(step: str) -> None:
        if step == "restored":  # the sink rolled back to P's cut: what it committed up to P
            prefix.extend(sink_rows(tmp_path))

    # left to the graph (the default), a run restoring an epoch taken unfused runs unfused: that epoch has a
    # snapshot per stage, none for a fused query
    again = driver_for(spark, module_store, pid, tmp_path, restore_from=pinned, run_id="from-pin",
                       on_step=at_restored, chaining=None)
    result = run_until(again, module_store, lambda: len(sink_rows(tmp_path)) >= len(expected),
                       what="the sink to commit every row")
    assert result.restored_from_epoch == pinned
    assert again.graph.stage_names == again.logical.stage_names
    assert sorted(module_store.get_pipeline(pid).stages) == sorted(again.logical.stage_names)
    assert sink_rows(tmp_path) == expected
    # retention truncated the channels' heads (below the pinned epoch's cursors): what is left of the report
    original = channel_rows(again.layout.channel_uri(OUTPUT_CHANNEL))
    assert 0 < len(original) <= len(expected)

    fork = PipelineDriver(pipeline(fork_id, fork_storage, chaining=None), module_store, storage_uri=str(fork_storage),
                          spark=spark, restore_from="latest", run_id="fork-first")
    forked = run_until(fork, module_store, lambda: len(prefix) + len(sink_rows(fork_storage)) >= len(expected),
                       what="the fork's sink to commit the rows after the fork point")
    assert forked.restored_from_epoch == pinned
    assert fork.graph.stage_names == fork.logical.stage_names  # the fork point was taken unfused
    assert channel_rows(fork.layout.channel_uri(OUTPUT_CHANNEL)) == original  # same rows, same positions
    assert sorted(prefix + sink_rows(fork_storage)) == expected
    # the fork's epochs are its own (numbered after the fork point), and so are its snapshot objects
    own = completed_epochs(module_store, fork_id)
    assert own and min(own) > pinned and module_store.waiting_forks(pid) == []
    assert module_store.snapshot_entries(fork_id, own[-1], SINK_STAGE)
    assert not (tmp_path / object_path(fork_id, "x")).parent.exists()  # nothing written below the source
    check_history(module_store.dsn, [pid, fork_id]).assert_clean()
