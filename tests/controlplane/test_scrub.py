"""Scrubbing and self-contained epochs against a real PostgreSQL and real snapshot objects on disk.

Snapshots are captured by the real :class:`SnapshotStore` from a checkpoint folder the test writes (what
Spark would have written: metadata, offsets, commits, state deltas), so no Spark is needed: one corrupt
shared object must be named with every epoch that depends on it, a self-contained epoch must stay
restorable byte for byte, retention must keep its private objects while it is retained and delete them
with it, and a budgeted scrub must cover every object over several runs.
"""

from __future__ import annotations

import json
import threading
import uuid
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest

from airflow_arroyo.cli import main
from airflow_arroyo.core.epochs import CheckpointPolicy, EpochState, PipelineState, RetentionPolicy
from airflow_arroyo.core.exceptions import SnapshotError
from airflow_arroyo.core.fs import FileSystem
from airflow_arroyo.core.retention import prune_pipeline
from airflow_arroyo.core.scrub import verify_pipeline
from airflow_arroyo.runtime.layout import object_path
from airflow_arroyo.runtime.snapshot import CaptureResult, SnapshotStore
from airflow_arroyo.store import EpochStore
from tests.support import sql

CHECKPOINT = {  # what Spark left after batch 1 of a stateful query: two partitions, two state versions
    "metadata": '{"id":"q"}',
    "offsets/0": 'v1\n{}\n{"pos":1}', "offsets/1": 'v1\n{}\n{"pos":2}',
    "commits/0": "v1\n{}", "commits/1": "v1\n{}",
    "state/0/0/1.delta": "p0 v1 " * 50, "state/0/0/2.delta": "p0 v2 " * 50,
    "state/0/1/1.delta": "p1 v1 " * 40, "state/0/1/2.delta": "p1 v2 " * 40,
}


class Snapshots:
    """A running pipeline with one stage whose checkpoint folder the test owns."""

    def __init__(self, store: EpochStore, root: Path) -> None:
        self.store, self.root = store, root
        self.id = f"scrub-{uuid.uuid4().hex[:8]}"
        store.register_pipeline(self.id, stages=["agg"], run_id="r1", storage_uri=str(root))
        store.set_pipeline_state(self.id, PipelineState.RUNNING)
        for rel, text in CHECKPOINT.items():
            (root / "ckpt" / rel).parent.mkdir(parents=True, exist_ok=True)
            (root / "ckpt" / rel).write_text(text)
        self.snaps = SnapshotStore(FileSystem.from_uri(str(root)), self.id, store)

    def epoch(self, *, self_contained: bool = False) -> tuple[int, CaptureResult]:
        tick = self.store.trigger_tick(self.id, CheckpointPolicy(interval=1), force=True, self_contained=self_contained)
        assert tick.started is not None and tick.started.self_contained is self_contained
        n = tick.started.epoch
        result = self.snaps.capture("agg", n, "ckpt", 1, self_contained=self_contained)
        assert self.store.ack_epoch(self.id, n, "agg", bytes_new=result.bytes_new,
                                    bytes_total=result.bytes_total) is EpochState.COMPLETED
        return n, result

    def object_file(self, key: str) -> Path:
        return self.root / object_path(self.id, key)

    def restore_bytes(self, epoch: int) -> dict[str, bytes]:
        prepared = self.snaps.prepare_restore("agg", epoch)
        folder = self.root / prepared.folder
        out = {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}
        self.snaps.discard([prepared])
        return out


@pytest.fixture
def snapshots(store: EpochStore, tmp_path: Path) -> Iterator[Snapshots]:
    yield Snapshots(store, tmp_path)


def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_one_corrupt_shared_object_names_every_epoch_and_the_self_contained_epoch_survives(
        store: EpochStore, snapshots: Snapshots, capsys: pytest.CaptureFixture[str]) -> None:
    s = snapshots
    e1, r1 = s.epoch()
    e2, r2 = s.epoch()
    e3, r3 = s.epoch(self_contained=True)
    e4, r4 = s.epoch()
    # incremental epochs share every object; the self-contained one copied all of its own
    assert r1.files_copied == len(CHECKPOINT) - 1 and (r2.files_copied, r4.files_copied) == (0, 0)  # commits same
    assert r3.files_copied == r1.files_copied and r3.bytes_new == r1.bytes_new
    assert {e.object_key for e in r3.entries}.isdisjoint(e.object_key for e in r1.entries)
    assert all(e.object_key.startswith(f"epochs/{e3}/sha256/") for e in r3.entries)
    original = {rel: (s.root / "ckpt" / rel).read_bytes() for rel in (e.rel_path for e in r1.entries)}
    assert s.restore_bytes(e3) == original

    code, out, _ = cli(capsys, "--dsn", store.dsn, "verify", s.id, "--json")
    report = json.loads(out)
    assert (code, report["ok"], report["restorable_epochs"], report["damaged"]) == (0, True, [e1, e2, e3, e4], [])
    assert report["objects_checked"] == report["objects_total"] == 2 * r1.files_copied

    # same size, other content: only the hash can tell
    victim = next(e for e in r1.entries if e.rel_path == "state/0/1/2.delta")
    s.object_file(victim.object_key).write_bytes(b"X" * victim.bytes)
    code, out, _ = cli(capsys, "--dsn", store.dsn, "verify", s.id, "--json")
    report = json.loads(out)
    assert code == 3 and not report["ok"]
    assert [(d["object_key"], d["state"], d["epochs"]) for d in report["damaged"]] == [
        (victim.object_key, "corrupt", [e1, e2, e4])]
    assert (report["damaged_epochs"], report["restorable_epochs"]) == ([e1, e2, e4], [e3])
    assert f"restore from epoch {e3}" in report["advice"]
    # the table says the same, and a restore agrees with the scrub
    code, out, _ = cli(capsys, "--dsn", store.dsn, "verify", s.id)
    assert code == 3
    assert f"damaged epochs: {e1},{e2},{e4}" in out and f"restorable epochs: {e3}" in out
    assert victim.object_key in out
    for n in (e1, e2, e4):
        with pytest.raises(SnapshotError, match="corrupt"):
            s.restore_bytes(n)
    assert s.restore_bytes(e3) == original
    # one epoch only: the self-contained one is sound; another names every epoch its damaged object reaches
    code, out, _ = cli(capsys, "--dsn", store.dsn, "verify", s.id, "--epoch", str(e3), "--json")
    assert (code, json.loads(out)["restorable_epochs"], json.loads(out)["damaged"]) == (0, [e3], [])
    code, out, _ = cli(capsys, "--dsn", store.dsn, "verify", s.id, "--epoch", str(e2), "--json")
    assert (code, json.loads(out)["restorable_epochs"], json.loads(out)["damaged_epochs"]) == (3, [], [e1, e2, e4])

    # the retention run scrubs after pruning and reports the same
    pruned = prune_pipeline(store, s.id, RetentionPolicy(keep_last=10), holder="test", scrub_budget=30)
    assert (pruned.epochs_pruned, pruned.damaged_epochs, pruned.restorable_epochs) == ([], [e1, e2, e4], [e3])
    assert pruned.objects_verified == 2 * r1.files_copied and f"restore from epoch {e3}" in (pruned.scrub or "")

    # the next epoch copies the damaged object again from the live checkpoint: the older epochs heal
    e5, r5 = s.epoch()
    assert [e.rel_path for e in r5.entries if e.object_key == victim.object_key] == [victim.rel_path]
    assert r5.files_copied == 1
    report_after = verify_pipeline(store, s.id)
    assert report_after.ok and report_after.restorable_epochs == [e1, e2, e3, e4, e5]
    assert s.restore_bytes(e1) == original

    # retention keeps a retained self-contained epoch's private objects and deletes them with it
    private = [s.object_file(e.object_key) for e in r3.entries]
    prune_pipeline(store, s.id, RetentionPolicy(keep_last=3), holder="test")
    assert {e.epoch: e.state for e in store.list_epochs(s.id)}[e3] is EpochState.COMPLETED
    assert all(p.exists() for p in private)
    report = prune_pipeline(store, s.id, RetentionPolicy(keep_last=1), holder="test")
    assert e3 in report.epochs_pruned
    assert not any(p.exists() for p in private)
    assert s.restore_bytes(e5) == original  # the shared objects the retained epoch needs are all there


def test_a_budgeted_scrub_covers_every_object_over_runs_oldest_verified_first(store: EpochStore,
                                                                            snapshots: Snapshots) -> None:
    s = snapshots
    e1, r1 = s.epoch()
    total = len({e.object_key for e in r1.entries})
    ticks = iter(range(10_000))
    clock = lambda: float(next(ticks))  # noqa: E731 - one second per look at the clock
    batches: list[set[str]] = []
    while True:
        before = {o.object_key: o.verified_at for o in store.objects_to_verify(s.id)}
        report = verify_pipeline(store, s.id, budget=2.5, clock=clock)
        after = {o.object_key: o.verified_at for o in store.objects_to_verify(s.id)}
        batches.append({k for k in after if after[k] != before[k]})
        assert len(batches[-1]) == report.objects_checked == 3  # budget 2.5 s, one second per object
        if report.objects_unverified == 0:
            break
        assert report.unverified_epochs == [e1] and report.restorable_epochs == []
    # never-verified objects first: no object is checked twice before every object was checked once, and
    # what the last run had time for beyond those was the least recently verified (the first run's)
    assert len(batches) == -(-total // 3)
    earlier = set.union(set(), *batches[:-1])
    assert sum(len(b) for b in batches[:-1]) == len(earlier)
    assert earlier | batches[-1] == {e.object_key for e in r1.entries}
    assert batches[-1] & earlier <= batches[0]
    runs = len(batches)
    assert report.restorable_epochs == [e1]
    # a missing object is found by a later budgeted run and stays reported until it is sound again
    gone = r1.entries[-1]
    s.object_file(gone.object_key).unlink()
    for _ in range(runs):
        report = verify_pipeline(store, s.id, budget=2.5, clock=clock)
    assert [(d.object_key, d.state) for d in report.damaged] == [(gone.object_key, "missing")]
    assert report.damaged_epochs == [e1]


def test_checkpoint_fires_one_epoch_and_waits_for_it(store: EpochStore, snapshots: Snapshots,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """``airflow-arroyo checkpoint``: the stage's part (capture and acknowledge the in-flight epoch) is
    played by a thread, as the driver would."""
    s = snapshots
    acked: list[int] = []

    def stage() -> None:
        for _ in range(600):
            rec = store.in_flight_epoch(s.id)
            if rec is not None:
                result = s.snaps.capture("agg", rec.epoch, "ckpt", 1, self_contained=rec.self_contained)
                store.ack_epoch(s.id, rec.epoch, "agg", bytes_total=result.bytes_total)
                acked.append(rec.epoch)
                return
            threading.Event().wait(0.02)

    worker = threading.Thread(target=stage)
    worker.start()
    code, out, err = cli(capsys, "--dsn", store.dsn, "checkpoint", s.id, "--self-contained", "--json")
    worker.join()
    record = json.loads(out)
    assert (code, record["state"], record["self_contained"], [record["epoch"]]) == (0, "completed", True, acked)
    assert record["triggered_by"].startswith("cli:")
    assert verify_pipeline(store, s.id).restorable_epochs == acked

    # nobody acknowledges: the epoch expires with the command's timeout, exit 1
    code, out, _ = cli(capsys, "--dsn", store.dsn, "checkpoint", s.id, "--timeout", "1s")
    assert code == 1
    row = out.splitlines()[1].split()
    assert row[:3] == [s.id, str(acked[0] + 1), "expired"]

    # a driver that stopped heartbeating gets no epoch, and the command says why
    sql(store, "UPDATE arroyo_pipelines SET heartbeat_at = clock_timestamp() - %s WHERE pipeline_id = %s",
        (timedelta(minutes=5), s.id))
    code, out, err = cli(capsys, "--dsn", store.dsn, "checkpoint", s.id)
    assert (code, out) == (1, "") and "heartbeat is 300s old" in err and "not alive" in err
    store.set_pipeline_state(s.id, PipelineState.STOPPING)
    store.set_pipeline_state(s.id, PipelineState.STOPPED)
    code, out, err = cli(capsys, "--dsn", store.dsn, "checkpoint", s.id)
    assert code == 1 and "its run r1 is stopped" in err and "start its driver" in err and "_NotStarted" not in err
    assert [e.state.value for e in store.list_epochs(s.id)] == ["expired", "completed"]
    code, _, err = cli(capsys, "--dsn", store.dsn, "checkpoint", "nope")
    assert code == 2 and "nope" in err
