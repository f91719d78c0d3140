"""Retention against a real Postgres epoch store and real files.

Epochs are built through the store API exactly as a pipeline builds them (trigger, record the
snapshot's objects, acknowledge), with the objects written to disk at the fixed layout
``<storage_uri>/<pipeline>/snapshots/objects/<key>``. Time-dependent states (an expired epoch, an
expired lease, an old epoch) are set directly in the database: a seam we own, instead of sleeping.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import psycopg2
import pytest

from airflow_arroyo.core.epochs import CheckpointPolicy, EpochState, PipelineState, RetentionPolicy
from airflow_arroyo.core.exceptions import ConfigurationError, LockLostError, UnknownEpochError, UnknownPipelineError
from airflow_arroyo.core.retention import PruneReport, parse_duration, policy_from, prune_pipeline
from airflow_arroyo.runtime.layout import object_path
from airflow_arroyo.store import EpochStore, SnapshotEntry
from tests.support import sql

TICK = CheckpointPolicy(interval=3600)


# --------------------------------------------------------------------------- helpers


class Pipeline:
    """A registered, running pipeline whose epochs and snapshot objects the test builds."""

    def __init__(self, store: EpochStore, root: Path | str, pipeline_id: str = "orders",
                 stages: tuple[str, ...] = ("src", "agg"), channels: dict[str, str] | None = None) -> None:
        self.store = store
        self.id = pipeline_id
        self.root = root
        self.stages = stages
        store.register_pipeline(pipeline_id, stages=list(stages), run_id="run-1", storage_uri=str(root),
                                channels=channels or {})
        store.set_pipeline_state(pipeline_id, PipelineState.RUNNING)

    def path(self, key: str) -> Path:
        assert isinstance(self.root, Path)
        return self.root / object_path(self.id, key)

    def write_object(self, key: str, size: int) -> None:
        p = self.path(key)
        if not p.exists():
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_bytes(bytes(size))

    def start_count(self) -> int:
        """How many epochs the pipeline triggered so far (a fresh name for each epoch's object)."""
        return self.store.get_pipeline(self.id).last_epoch

    def start(self) -> int:
        started = self.store.trigger_tick(self.id, TICK, force=True).started
        assert started is not None
        return started.epoch

    def snapshot(self, epoch: int, stage: str, objects: dict[str, int]) -> None:
        for key, size in objects.items():
            self.write_object(key, size)
        self.store.record_snapshot(self.id, epoch, stage, [
            SnapshotEntry(rel_path=f"state/{key}", object_key=key, bytes=size) for key, size in objects.items()
        ])

    def epoch(self, objects: dict[str, dict[str, int]], *, end: str = "complete",
              cursors: dict[str, dict[str, int]] | None = None) -> int:
        """One epoch: each stage snapshots its objects (stage -> key -> bytes) and, to complete it,
        acknowledges with its cursors. ``end``: complete | fail | expire | in_flight."""
        n = self.start()
        for stage, objs in objects.items():
            self.snapshot(n, stage, objs)
        if end == "complete":
            for stage in self.stages:
                self.store.ack_epoch(self.id, n, stage, cursors=(cursors or {}).get(stage, {}))
            assert self.store.get_epoch(self.id, n).state is EpochState.COMPLETED
        elif end == "fail":
            self.store.fail_epoch(self.id, n, "stage agg could not snapshot")
        elif end == "expire":
            sql(self.store, "UPDATE arroyo_epochs SET timeout_at = triggered_at + interval '1 microsecond'"
                " WHERE pipeline_id = %s AND epoch = %s", (self.id, n))
            assert self.store.trigger_tick(self.id, TICK).expired is not None
        return n

    def age(self, epoch: int, hours: float) -> None:
        """Move an epoch's times ``hours`` into the past."""
        sql(self.store, "UPDATE arroyo_epochs SET triggered_at = triggered_at - %s,"
            " ended_at = ended_at - %s WHERE pipeline_id = %s AND epoch = %s",
            (timedelta(hours=hours), timedelta(hours=hours), self.id, epoch))

    def states(self) -> dict[int, EpochState]:
        return {e.epoch: e.state for e in self.store.list_epochs(self.id)}

    def expire_lease(self) -> None:
        sql(self.store, "UPDATE arroyo_cleanup_locks SET acquired_at = clock_timestamp() - interval '2 hours',"
            " expires_at = clock_timestamp() - interval '1 hour' WHERE pipeline_id = %s", (self.id,))


class RecordingFs:
    """The real filesystem, with a hook before each delete (the seam ``fs_for``)."""

    def __init__(self, uri: str, before_delete: Callable[[int, str], None]) -> None:
        from airflow_arroyo.core.fs import FileSystem

        self.fs = FileSystem.from_uri(uri)
        self.before_delete = before_delete
        self.deleted: list[str] = []

    def delete(self, path: str) -> bool:
        self.before_delete(len(self.deleted), path)
        self.deleted.append(path)
        return self.fs.delete(path)


@pytest.fixture
def pipe(store: EpochStore, tmp_path: Path) -> Iterator[Pipeline]:
    yield Pipeline(store, tmp_path)


def prune(store: EpochStore, pipeline_id: str = "orders", policy: RetentionPolicy | None = None,
          **kwargs: Any) -> PruneReport:
    return prune_pipeline(store, pipeline_id, policy or RetentionPolicy(keep_last=2), holder="test",
                          **kwargs)


# --------------------------------------------------------------------------- the main path


def test_prunes_only_objects_no_retained_epoch_references(store: EpochStore, pipe: Pipeline) -> None:
    # Incremental snapshots: each epoch re-references what it still needs from the one before.
    e1 = pipe.epoch({"src": {"a": 100}, "agg": {"b": 20}})
    e2 = pipe.epoch({"src": {"a": 100, "c": 300}, "agg": {"b": 20}})  # a, b shared with e1
    e3 = pipe.epoch({"src": {"c": 300, "d": 4000}, "agg": {"e": 5}})  # c shared with e2
    e4 = pipe.epoch({"src": {"d": 4000}, "agg": {"e": 5, "f": 60}})

    report = prune(store, policy=RetentionPolicy(keep_last=2))

    assert report.epochs_pruned == [e1, e2]
    assert report.kept == [e3, e4]
    assert report.skipped_reason is None
    # a and b were only referenced by pruned epochs; c is still referenced by e3
    assert not pipe.path("a").exists() and not pipe.path("b").exists()
    for key in ("c", "d", "e", "f"):
        assert pipe.path(key).exists(), key
    assert report.bytes_freed == 120 and report.objects_deleted == 2 and report.objects_missing == 0
    assert pipe.states() == {e1: EpochState.PRUNED, e2: EpochState.PRUNED,
                             e3: EpochState.COMPLETED, e4: EpochState.COMPLETED}
    # bytes are counted on the oldest pruned epoch that referenced them
    assert store.get_epoch("orders", e1).bytes_freed == 120
    assert store.get_epoch("orders", e2).bytes_freed == 0
    # every retained epoch is still restorable: each of its objects exists
    for epoch in (e3, e4):
        for stage in pipe.stages:
            for entry in store.snapshot_entries("orders", epoch, stage):
                assert pipe.path(entry.object_key).stat().st_size == entry.bytes
    # the lease is released and the run recorded
    assert store.cleanup_lock("orders") is None
    (run,) = store.list_cleanup_runs("orders")
    assert (run.id, run.state, run.epochs_pruned, run.bytes_freed, run.holder) == (
        report.cleanup_run, "succeeded", [e1, e2], 120, "test")
    assert run.policy == {"keep_last": 2, "keep_newer_than_s": None}

    # a second run with the same policy has nothing left to do
    again = prune(store, policy=RetentionPolicy(keep_last=2))
    assert (again.epochs_pruned, again.bytes_freed, again.kept) == ([], 0, [e3, e4])


def test_truncates_channels_before_the_oldest_retained_cursor(store: EpochStore, tmp_path: Path) -> None:
    import pyarrow as pa

    from airflow_arroyo.runtime.channel import Channel

    uri = str(tmp_path / "channels" / "events")
    channel = Channel.create(uri)
    pipe = Pipeline(store, tmp_path, stages=("agg",), channels={"events": uri})
    epochs = []
    for i in range(4):
        channel.append_table(pa.table({"x": list(range(i * 10, i * 10 + 10))}), batch_id=i, writer="src")
        n = pipe.start()
        channel.append_barrier(n, writer="src")
        # agg resumes right after barrier n when restored from epoch n
        pipe.snapshot(n, "agg", {f"state-{n}": 10})
        store.ack_epoch("orders", n, "agg", cursors={"events": channel.end_position()})
        epochs.append(n)
    cursor_of_e3 = 6  # entries: data, barrier 1, data, barrier 2, data, barrier 3 -> e3 resumes at 6
    channel_file_bytes = {p: p.stat().st_size for p in Path(uri).rglob("*") if p.is_file()}

    report = prune(store, policy=RetentionPolicy(keep_last=2))

    assert report.epochs_pruned == epochs[:2]
    reopened = Channel.open(uri)
    # the barrier of e3 stays (a restore from e3 finds it to cut the channel right after it)
    assert reopened.start_position() == cursor_of_e3 - 1 and reopened.find_barrier(epochs[2]) == cursor_of_e3 - 1
    # what a restore from e3 reads is intact
    assert reopened.read_table(cursor_of_e3).column("x").to_pylist() == list(range(30, 40))
    remaining = {p: p.stat().st_size for p in Path(uri).rglob("*") if p.is_file()}
    gone = sum(size for p, size in channel_file_bytes.items() if p not in remaining)
    assert gone > 0 and report.channel_bytes_freed == gone
    # channel bytes are counted on the newest pruned epoch, object bytes on their own epoch
    assert report.bytes_freed == gone + 20
    assert store.get_epoch("orders", epochs[1]).bytes_freed == gone + 10
    assert store.get_epoch("orders", epochs[0]).bytes_freed == 10


def test_latest_completed_is_never_pruned_and_failed_expired_always_are(store: EpochStore,
                                                                        pipe: Pipeline) -> None:
    e1 = pipe.epoch({"src": {"a": 1}, "agg": {"b": 2}})
    e2 = pipe.epoch({"src": {"a": 1, "partial": 7}}, end="fail")  # partial data of a failed epoch
    e3 = pipe.epoch({"src": {"a": 1}, "agg": {"x": 9}}, end="expire")
    for e in (e1, e2, e3):
        pipe.age(e, hours=48)

    # everything is older than the policy allows, yet the latest completed epoch stays
    report = prune(store, policy=RetentionPolicy(keep_newer_than=timedelta(hours=1)))

    assert report.epochs_pruned == [e2, e3]
    assert report.kept == [e1]
    assert pipe.states() == {e1: EpochState.COMPLETED, e2: EpochState.PRUNED, e3: EpochState.PRUNED}
    assert not pipe.path("partial").exists() and not pipe.path("x").exists()
    assert pipe.path("a").exists() and pipe.path("b").exists()
    assert report.bytes_freed == 16


def test_keep_newer_than_keeps_recent_epochs_beyond_keep_last(store: EpochStore, pipe: Pipeline) -> None:
    old1 = pipe.epoch({"src": {"o1": 1}})
    old2 = pipe.epoch({"src": {"o2": 2}})
    recent = pipe.epoch({"src": {"r": 3}})
    latest = pipe.epoch({"src": {"l": 4}})
    pipe.age(old1, hours=3)
    pipe.age(old2, hours=2)

    report = prune(store, policy=RetentionPolicy(keep_last=1, keep_newer_than=timedelta(hours=1)))

    assert report.epochs_pruned == [old1, old2]
    assert report.kept == [recent, latest]
    assert [pipe.path(k).exists() for k in ("o1", "o2", "r", "l")] == [False, False, True, True]


# --------------------------------------------------------------------------- pins


def test_a_pinned_epoch_survives_keep_last_1_with_its_objects_and_channel_range(store: EpochStore,
                                                                               tmp_path: Path) -> None:
    import pyarrow as pa

    from airflow_arroyo.runtime.channel import Channel

    uri = str(tmp_path / "channels" / "events")
    channel = Channel.create(uri)
    pipe = Pipeline(store, tmp_path, stages=("agg",), channels={"events": uri})
    epochs = []
    for i in range(4):
        channel.append_table(pa.table({"x": list(range(i * 10, i * 10 + 10))}), batch_id=i, writer="src")
        n = pipe.start()
        channel.append_barrier(n, writer="src")
        # incremental: each epoch shares "base" and adds its own object
        pipe.snapshot(n, "agg", {"base": 100, f"state-{n}": 10})
        store.ack_epoch("orders", n, "agg", cursors={"events": channel.end_position()})
        epochs.append(n)
    e1, e2, e3, e4 = epochs
    pinned = store.pin_epoch("orders", e2, "  before the 2.0 upgrade ")
    assert (pinned.pin_label, pinned.state) == ("before the 2.0 upgrade", EpochState.COMPLETED)
    assert pinned.pinned_at is not None

    report = prune(store, policy=RetentionPolicy(keep_last=1))

    assert report.epochs_pruned == [e1, e3]
    assert report.kept == [e2, e4]
    assert pipe.states() == {e1: EpochState.PRUNED, e2: EpochState.COMPLETED, e3: EpochState.PRUNED,
                             e4: EpochState.COMPLETED}
    # every object the pinned epoch references is still recorded and on disk, at its size
    entries = store.snapshot_entries("orders", e2, "agg")
    assert {x.object_key for x in entries} == {"base", f"state-{e2}"}
    for entry in entries:
        assert pipe.path(entry.object_key).stat().st_size == entry.bytes
    assert not pipe.path(f"state-{e1}").exists() and not pipe.path(f"state-{e3}").exists()
    # the channel range a restore from e2 reads (right after its barrier) is intact
    reopened = Channel.open(uri)
    assert reopened.find_barrier(e2) == reopened.start_position()
    assert reopened.read_table(reopened.start_position() + 1).column("x").to_pylist() == list(range(20, 40))

    # unpinned (twice: idempotent), the next run prunes it like any other epoch
    assert store.unpin_epoch("orders", e2).pin_label is None
    assert store.unpin_epoch("orders", e2).pinned_at is None
    assert prune(store, policy=RetentionPolicy(keep_last=1)).epochs_pruned == [e2]
    assert not pipe.path(f"state-{e2}").exists() and pipe.path("base").exists()


def test_pinning_refuses_what_cannot_be_restored_and_bad_labels(store: EpochStore, pipe: Pipeline) -> None:
    done = pipe.epoch({"src": {"a": 1}})
    failed = pipe.epoch({"src": {"p": 1}}, end="fail")
    flying = pipe.epoch({"src": {"q": 1}}, end="in_flight")
    with pytest.raises(ConfigurationError, match=rf"epoch {failed} of pipeline 'orders' is failed, not completed"
                       r".*airflow-arroyo epochs orders"):
        store.pin_epoch("orders", failed, "keep")
    with pytest.raises(ConfigurationError, match="is triggered, not completed.*wait for this one to end"):
        store.pin_epoch("orders", flying, "keep")
    with pytest.raises(UnknownEpochError, match="has no epoch 99 to pin"):
        store.pin_epoch("orders", 99, "keep")
    with pytest.raises(UnknownEpochError, match="has no epoch 99 to unpin"):
        store.unpin_epoch("orders", 99)
    with pytest.raises(UnknownPipelineError):
        store.pin_epoch("nope", done, "keep")
    for label in ("", "   ", "x" * 201):
        with pytest.raises(ConfigurationError, match="pin label must be 1 to 200 characters"):
            store.pin_epoch("orders", done, label)
    assert sql(store, "SELECT count(*) FROM arroyo_epochs WHERE pin_label IS NOT NULL") == [(0,)]
    # re-pinning relabels when asked to (replace=True) and keeps the first pin's time; the database refuses to
    # prune a pinned epoch
    first = store.pin_epoch("orders", done, "one")
    again = store.pin_epoch("orders", done, "two", replace=True)
    assert (again.pin_label, again.pinned_at) == ("two", first.pinned_at)
    with pytest.raises(psycopg2.errors.CheckViolation, match="arroyo_epochs_pinned_kept"):
        sql(store, "UPDATE arroyo_epochs SET state = 'pruning' WHERE pipeline_id = 'orders' AND epoch = %s",
            (done,))


def test_objects_on_an_fsspec_uri_are_deleted(store: EpochStore) -> None:
    import fsspec

    mem = fsspec.filesystem("memory")
    root = "memory://retention-test"
    pipe = Pipeline(store, root, pipeline_id="mem-pipe", stages=("src",))

    def put(key: str, size: int) -> None:
        mem.pipe(f"/retention-test/{object_path('mem-pipe', key)}", bytes(size))

    for n_key in ("k1", "k2", "k3"):
        n = pipe.start()
        put(n_key, 11)
        store.record_snapshot("mem-pipe", n, "src", [SnapshotEntry("s", n_key, 11)])
        store.ack_epoch("mem-pipe", n, "src")
    try:
        report = prune(store, "mem-pipe", RetentionPolicy(keep_last=1))
        assert report.epochs_pruned == [1, 2] and report.bytes_freed == 22
        assert [mem.exists(f"/retention-test/{object_path('mem-pipe', k)}") for k in ("k1", "k2", "k3")] == [
            False, False, True]
    finally:
        mem.rm("/retention-test", recursive=True)


# --------------------------------------------------------------------------- in-flight epochs


def test_in_flight_epoch_blocks_pruning_until_the_deadline(store: EpochStore, pipe: Pipeline) -> None:
    e1 = pipe.epoch({"src": {"a": 1}})
    pipe.epoch({"src": {"b": 2}})
    e3 = pipe.epoch({"src": {"a": 1, "c": 3}}, end="in_flight")  # references a incrementally
    now = [0.0]
    sleeps: list[float] = []

    def sleep(seconds: float) -> None:
        sleeps.append(seconds)
        now[0] += seconds

    report = prune(store, policy=RetentionPolicy(keep_last=1), wait_for_in_flight=timedelta(seconds=5),
                   poll_interval=1.0, clock=lambda: now[0], sleep=sleep)

    assert report.skipped_reason is not None and f"in-flight epoch {e3} did not finish" in report.skipped_reason
    assert sum(sleeps) == 5.0
    assert report.epochs_pruned == [] and report.bytes_freed == 0
    assert pipe.states()[e1] is EpochState.COMPLETED and pipe.states()[e3] is EpochState.TRIGGERED
    assert all(pipe.path(k).exists() for k in ("a", "b", "c"))
    assert store.cleanup_lock("orders") is None
    (run,) = store.list_cleanup_runs("orders")
    assert run.state == "succeeded" and run.error is not None and "skipped" in run.error


def test_waits_for_the_in_flight_epoch_then_prunes(store: EpochStore, pipe: Pipeline) -> None:
    e1 = pipe.epoch({"src": {"a": 1}, "agg": {"z": 1}})
    e2 = pipe.epoch({"src": {"b": 2}, "agg": {"z": 1}})
    e3 = pipe.epoch({"src": {"a": 1, "c": 3}}, end="in_flight")
    lease_seen: list[Any] = []

    def sleep(_: float) -> None:  # while we wait, the pipeline finishes epoch 3
        lease_seen.append(store.cleanup_lock("orders"))
        for stage in pipe.stages:
            store.ack_epoch("orders", e3, stage)
        # the trigger respects our lease: no new epoch can start while we prune
        assert store.trigger_tick("orders", TICK, force=True).started is None

    report = prune(store, policy=RetentionPolicy(keep_last=1), sleep=sleep)

    assert len(lease_seen) == 1 and lease_seen[0] is not None and lease_seen[0].holder == "test"
    assert report.epochs_pruned == [e1, e2] and report.kept == [e3]
    # a was referenced by the (then in-flight) epoch 3: it survives; b does not
    assert pipe.path("a").exists() and not pipe.path("b").exists() and pipe.path("c").exists()


# --------------------------------------------------------------------------- the lease


def test_lock_held_by_another_run_skips_or_waits(store: EpochStore, pipe: Pipeline) -> None:
    pipe.epoch({"src": {"a": 1}})
    pipe.epoch({"src": {"b": 2}})
    other = store.acquire_cleanup_lock("orders", "other-run", ttl=600)

    skipped = prune(store, policy=RetentionPolicy(keep_last=1))
    assert skipped.skipped_reason is not None and "other-run" in skipped.skipped_reason
    assert skipped.cleanup_run is None and pipe.path("a").exists()
    assert store.cleanup_lock("orders").holder == "other-run"  # type: ignore[union-attr]

    released: list[int] = []

    def sleep(_: float) -> None:  # the other run finishes while we wait
        released.append(store.release_cleanup_lock("orders", other.id).id)

    report = prune(store, policy=RetentionPolicy(keep_last=1), wait_for_lock=timedelta(seconds=30),
                   sleep=sleep)
    assert released == [other.id]
    assert report.epochs_pruned == [1] and not pipe.path("a").exists()


def test_crashed_cleanup_is_finished_by_the_next_run_after_its_lease_expires(store: EpochStore,
                                                                            pipe: Pipeline) -> None:
    e1 = pipe.epoch({"src": {"a": 10}, "agg": {"b": 20}})
    e2 = pipe.epoch({"src": {"c": 30}})
    e3 = pipe.epoch({"src": {"d": 40}})
    # A cleanup run crashes after marking epochs and deleting one object: lease and 'pruning' left behind.
    crashed = store.acquire_cleanup_lock("orders", "crashed-worker", ttl=600)
    plan = store.begin_prune("orders", crashed.id, [e1, e2])
    assert plan.epochs == [e1, e2]
    pipe.path("a").unlink()

    while_live = prune(store, policy=RetentionPolicy(keep_last=1))
    assert while_live.skipped_reason is not None and "crashed-worker" in while_live.skipped_reason

    pipe.expire_lease()
    report = prune(store, policy=RetentionPolicy(keep_last=5))  # keeps everything but what was pruning

    assert report.epochs_pruned == [e1, e2] and report.kept == [e3]
    assert report.objects_missing == 1 and report.objects_deleted == 2
    assert report.bytes_freed == 60  # a was freed by the crashed run, for these epochs
    assert pipe.states() == {e1: EpochState.PRUNED, e2: EpochState.PRUNED, e3: EpochState.COMPLETED}
    runs = {r.id: r for r in store.list_cleanup_runs("orders")}
    assert runs[crashed.id].state == "lock_lost"
    assert runs[report.cleanup_run].state == "succeeded"  # type: ignore[index]
    assert store.cleanup_lock("orders") is None


def test_lost_lease_stops_deleting_at_once(store: EpochStore, pipe: Pipeline, tmp_path: Path) -> None:
    e1 = pipe.epoch({"src": {"a": 1, "b": 2, "c": 3}})
    e2 = pipe.epoch({"src": {"d": 4}})

    def take_over_after_first(done: int, _: str) -> None:
        if done == 0:  # our lease expires and another run takes the lock while we delete
            pipe.expire_lease()
            store.acquire_cleanup_lock("orders", "newcomer", ttl=600)

    fs = RecordingFs(str(tmp_path), take_over_after_first)
    with pytest.raises(LockLostError):
        prune(store, policy=RetentionPolicy(keep_last=1), renew_every=0.0, fs_for=lambda _: fs)

    assert len(fs.deleted) == 1  # nothing deleted after the loss
    assert sum(pipe.path(k).exists() for k in "abc") == 2
    assert pipe.states() == {e1: EpochState.PRUNING, e2: EpochState.COMPLETED}
    runs = store.list_cleanup_runs("orders")
    ours = next(r for r in runs if r.holder == "test")
    assert ours.state == "lock_lost" and ours.error and "no longer holds" in ours.error
    assert store.cleanup_lock("orders").holder == "newcomer"  # type: ignore[union-attr]


def test_a_failing_delete_fails_the_run_and_releases_the_lease(store: EpochStore, pipe: Pipeline,
                                                               tmp_path: Path) -> None:
    e1 = pipe.epoch({"src": {"a": 1}})
    pipe.epoch({"src": {"b": 2}})

    def refuse(_: int, path: str) -> None:
        raise PermissionError(f"read-only filesystem: {path}")

    with pytest.raises(PermissionError):
        prune(store, policy=RetentionPolicy(keep_last=1), fs_for=lambda _: RecordingFs(str(tmp_path), refuse))

    (run,) = store.list_cleanup_runs("orders")
    assert run.state == "failed" and "PermissionError" in (run.error or "")
    assert store.cleanup_lock("orders") is None
    assert pipe.states()[e1] is EpochState.PRUNING and pipe.path("a").exists()
    # the next run (filesystem fixed) finishes the job
    assert prune(store, policy=RetentionPolicy(keep_last=1)).epochs_pruned == [e1]
    assert not pipe.path("a").exists()


# --------------------------------------------------------------------------- bad input


def test_unknown_pipeline_is_refused_before_anything_is_written(store: EpochStore) -> None:
    with pytest.raises(UnknownPipelineError, match="airflow-arroyo pipelines"):
        prune(store, "nope")
    assert sql(store, "SELECT count(*) FROM arroyo_cleanup_runs") == [(0,)]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"lock_ttl": 0}, "lock_ttl"),
        ({"lock_ttl": 10, "renew_every": 10}, "renew_every"),
        ({"lock_ttl": 10, "poll_interval": 20}, "poll_interval"),
        ({"holder": ""}, "holder"),
    ],
)
@pytest.mark.usefixtures("pipe")
def test_bad_run_settings_are_refused_before_anything_is_written(store: EpochStore,
                                                                 kwargs: dict[str, Any], match: str) -> None:
    args: dict[str, Any] = {"holder": "test", **kwargs}
    with pytest.raises(ConfigurationError, match=match):
        prune_pipeline(store, "orders", RetentionPolicy(keep_last=1), **args)
    assert store.list_cleanup_runs("orders") == []


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("90", 90), (90, 90), (1.5, 1.5), ("90s", 90), ("15m", 900), ("1h", 3600), ("1h30m", 5400),
     ("2d", 172800), ("1w", 604800), (" 2H ", 7200), (timedelta(minutes=3), 180)],
)
def test_parse_duration(text: Any, seconds: float) -> None:
    assert parse_duration(text) == timedelta(seconds=seconds)


@pytest.mark.parametrize("text", ["", "none", None])
def test_parse_duration_none(text: Any) -> None:
    assert parse_duration(text) is None


@pytest.mark.parametrize("text", ["1x", "h", "1h-2m", "abc", True, float("inf"), "1h 2"])
def test_parse_duration_refuses_garbage(text: Any) -> None:
    with pytest.raises(ConfigurationError, match="duration"):
        parse_duration(text)


def test_policy_from_user_input() -> None:
    assert policy_from("5", "1h") == RetentionPolicy(keep_last=5, keep_newer_than=timedelta(hours=1))
    assert policy_from(3, None) == RetentionPolicy(keep_last=3)
    assert policy_from("None", 60) == RetentionPolicy(keep_newer_than=timedelta(minutes=1))
    with pytest.raises(ConfigurationError, match="keeps nothing"):
        policy_from(None, "")
    with pytest.raises(ConfigurationError, match="whole number"):
        policy_from("five")
    with pytest.raises(ConfigurationError, match="keep_last"):
        policy_from(0)


# --------------------------------------------------------------------------- compaction (bounded store)


def _count(store: EpochStore, table: str) -> int:
    return int(sql(store, f"SELECT count(*) FROM {table} WHERE pipeline_id = %s", ("orders",))[0][0])  # noqa: S608


def _round(pipe: Pipeline, n: int, **kwargs: Any) -> PruneReport:
    """``n`` completed epochs, then retention keeping the last one."""
    for _ in range(n):
        pipe.epoch({"src": {f"o{pipe.start_count()}": 10}})
    return prune(pipe.store, policy=RetentionPolicy(keep_last=1), **kwargs)


def test_compaction_deletes_what_retention_released_and_the_history_checker_stays_clean(
        store: EpochStore, pipe: Pipeline) -> None:
    from airflow_arroyo.devtools.history import ViolationKind, check_history

    first = _round(pipe, 3, compact_after=None)
    second = _round(pipe, 3, compact_after=None)
    assert len(first.epochs_pruned) == 2 and len(second.epochs_pruned) == 3  # second prunes first's survivor
    history_before = _count(store, "arroyo_history")
    # compact everything before the newest release (second's): first's and second's pruned epochs, with
    # their acks; the history up to that release; both earlier runs. In batches of 2 rows.
    third = _round(pipe, 2, compact_after=timedelta(0), compact_batch=2)
    pruned_by_now = first.epochs_pruned + second.epochs_pruned
    assert third.rows_compacted["epochs"] == len(pruned_by_now)
    assert third.rows_compacted["cleanup_runs"] == 2
    assert third.rows_compacted["history"] == history_before  # second's release was the last event then
    assert set(pipe.states()) == set(third.epochs_pruned) | set(third.kept)
    assert sql(store, "SELECT count(*) FROM arroyo_acks WHERE pipeline_id = %s AND epoch = ANY(%s)",
               ("orders", pruned_by_now))[0][0] == 0
    assert [r.id for r in store.list_cleanup_runs("orders")] == [third.cleanup_run]
    assert store.latest_completed_epoch("orders") is not None
    check_history(store.dsn).assert_clean()  # the replay starts at the cut, seeded from the tables

    # Later runs keep compacting behind their predecessors, and the check stays clean (an epoch
    # completed before a cut and pruned after it included).
    for _ in range(2):
        later = _round(pipe, 2, compact_after=timedelta(0))
        assert later.rows_compacted["epochs"] >= 1
        check_history(store.dsn).assert_clean()
    assert _count(store, "arroyo_epochs") <= 4 and _count(store, "arroyo_cleanup_runs") == 1
    # ... and not blind after the cut: an epoch re-triggered below the cut's max_epoch is still a breach
    sql(store, "INSERT INTO arroyo_history (pipeline_id, kind, epoch, new_state) VALUES (%s, 'epoch_state', 1,"
        " 'triggered')", ("orders",))
    assert ViolationKind.EPOCH_NOT_INCREASING in check_history(store.dsn).kinds()


def test_compaction_keeps_what_is_newer_than_its_horizon(store: EpochStore, pipe: Pipeline) -> None:
    from airflow_arroyo.devtools.history import check_history

    _round(pipe, 3, compact_after=None)
    epochs, history = _count(store, "arroyo_epochs"), _count(store, "arroyo_history")
    recent = _round(pipe, 1, compact_after=timedelta(hours=1))
    assert recent.rows_compacted == {} and _count(store, "arroyo_epochs") == epochs + 1
    assert _count(store, "arroyo_history") > history
    # two hours later (every recorded time moved back, in order), the same horizon compacts
    for table, column in (("arroyo_history", "at"), ("arroyo_epochs", "pruned_at")):
        sql(store, f"UPDATE {table} SET {column} = {column} - interval '2 hours' WHERE pipeline_id = %s",  # noqa: S608
            ("orders",))
    later = _round(pipe, 1, compact_after=timedelta(hours=1))
    assert later.rows_compacted["epochs"] == 3 and later.rows_compacted["cleanup_runs"] == 2
    check_history(store.dsn).assert_clean()


@pytest.mark.parametrize("kwargs", [{"compact_after": timedelta(seconds=-1)}, {"compact_after": 3600},
                                    {"compact_batch": 0}, {"compact_batch": True}])
def test_bad_compaction_settings_are_refused(store: EpochStore, pipe: Pipeline, kwargs: dict[str, Any]) -> None:
    pipe.epoch({"src": {"a": 1}})
    with pytest.raises(ConfigurationError, match="compact_"):
        prune(store, **kwargs)
    assert store.list_cleanup_runs("orders") == []


# --------------------------------------------------------------------------- object references (issue 30, 6 a)


def test_pruning_deletes_pruned_epochs_object_references_and_keeps_what_retained_epochs_need(
        store: EpochStore, pipe: Pipeline) -> None:
    """~320 object references an epoch: a pruned epoch's go when it is pruned, not at compaction; the
    retained epochs still verify, and the objects deleted are exactly those no retained epoch references."""
    import hashlib
    import random

    from airflow_arroyo.core.scrub import verify_pipeline
    from airflow_arroyo.runtime.layout import object_key

    rng = random.Random(30)
    content: dict[str, bytes] = {}  # key -> bytes, content-addressed as capture writes them

    def new_object() -> str:
        data = rng.randbytes(rng.randrange(1, 64))
        key = object_key(hashlib.sha256(data).hexdigest())
        content[key] = data
        return key

    written: set[str] = set()

    def write(keys: list[str]) -> dict[str, int]:
        written.update(keys)
        for key in keys:
            path = pipe.path(key)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(content[key])
        return {key: len(content[key]) for key in keys}

    # incremental snapshots: each epoch keeps most of the previous one's objects and adds a few
    live = {stage: [new_object() for _ in range(160)] for stage in pipe.stages}
    epochs = []
    for _ in range(6):
        for stage in pipe.stages:
            live[stage] = rng.sample(live[stage], 150) + [new_object() for _ in range(10)]
        epochs.append(pipe.epoch({stage: write(keys) for stage, keys in live.items()}))
    refs_per_epoch = {e: {entry.object_key for stage in pipe.stages
                          for entry in store.snapshot_entries("orders", e, stage)} for e in epochs}
    assert all(len(refs) == 320 for refs in refs_per_epoch.values())

    report = prune(store, policy=RetentionPolicy(keep_last=2), compact_after=None)

    pruned, kept = epochs[:4], epochs[4:]
    assert report.epochs_pruned == pruned and report.kept == kept
    # the pruned epochs hold no object reference any more: compaction is not needed for that
    assert sql(store, "SELECT count(*) FROM arroyo_epoch_objects WHERE pipeline_id = %s AND epoch = ANY(%s)",
               ("orders", pruned))[0][0] == 0
    # the objects retention deleted are exactly those no retained epoch references ...
    retained_refs = set().union(*(refs_per_epoch[e] for e in kept))
    gone = {key for key in written if not pipe.path(key).exists()}
    assert gone == written - retained_refs
    assert report.objects_deleted == len(gone) and report.objects_missing == 0
    # ... and the store forgot them, and nothing else
    known = {r[0] for r in sql(store, "SELECT object_key FROM arroyo_objects WHERE pipeline_id = %s", ("orders",))}
    assert known == retained_refs
    # every retained epoch still verifies, object by object
    for epoch in kept:
        scrub = verify_pipeline(store, "orders", epoch=epoch)
        assert scrub.ok and scrub.objects_total == 320 and epoch in scrub.restorable_epochs, scrub
    whole = verify_pipeline(store, "orders")
    assert whole.ok and whole.restorable_epochs == kept


# --------------------------------------------------------------------------- sink commits (issue 30, 6 c)


def test_compaction_deletes_the_sink_commits_of_the_epochs_it_deletes_and_keeps_each_sinks_newest(
        store: EpochStore, pipe: Pipeline) -> None:
    """``arroyo_sink_commits`` (a row per sink per epoch) goes with its pruned epoch at compaction, except each
    sink's newest commit (the outlets' ``latest_sink_commit`` and a new watcher's starting point); a watcher
    reading by seq still sees every commit after its cursor that a retained epoch made."""
    from airflow_arroyo.devtools.history import check_history

    def commit(epoch: int, sink: str) -> int:
        return store.record_sink_commit("orders", epoch, sink, uri=f"file:///out/{sink}", batch_id=epoch,
                                        files=1, rows=10, bytes_committed=100).seq

    def epochs_with_commits(n: int, sinks: tuple[str, ...] = ("files", "table")) -> list[int]:
        out = []
        for _ in range(n):
            e = pipe.epoch({"src": {f"o{pipe.start_count()}": 10}})
            for sink in sinks:
                commit(e, sink)
            out.append(e)
        return out

    def commits() -> dict[tuple[str, int], int]:
        return {(c.sink, c.epoch): c.seq for c in store.sink_commits("orders", limit=1000)}

    first = epochs_with_commits(1, ("files", "table", "retired"))  # 'retired' never commits again
    first += epochs_with_commits(3)
    r1 = prune(store, policy=RetentionPolicy(keep_last=1), compact_after=None)
    assert r1.epochs_pruned == first[:3]
    later = epochs_with_commits(2)
    before = commits()
    # compact behind r1's release: the epochs r1 pruned go, and their sink commits with them
    r2 = prune(store, policy=RetentionPolicy(keep_last=1), compact_after=timedelta(0))
    assert r2.epochs_pruned == [first[3], later[0]]
    assert r2.rows_compacted["epochs"] == 3
    kept = commits()
    gone = {(sink, e) for sink in ("files", "table") for e in first[:3]}
    assert set(before) - set(kept) == gone
    assert r2.rows_compacted["sink_commits"] == len(gone)
    # each sink's newest commit stays, whatever its epoch (the outlets publish it)
    assert ("retired", first[0]) in kept
    assert store.latest_sink_commit("orders", "retired") is not None
    assert store.latest_sink_commit("orders", "files").epoch == later[1]  # type: ignore[union-attr]
    # a watcher's cursor: what came after it is still there, in seq order
    after = before[("table", first[2])]
    assert [(c.sink, c.epoch) for c in store.sink_commits("orders", after_seq=after, limit=1000)] == sorted(
        (k for k, seq in kept.items() if seq > after), key=kept.__getitem__)
    check_history(store.dsn).assert_clean()

    # the next compaction takes the epochs r2 pruned and their commits: the table stays flat
    epochs_with_commits(2)
    r3 = prune(store, policy=RetentionPolicy(keep_last=1), compact_after=timedelta(0))
    assert r3.rows_compacted["sink_commits"] == 4  # files and table of first[3] and later[0]
    with_rows = {e.epoch for e in store.list_epochs("orders")}
    assert {(sink, e) for sink, e in commits() if e not in with_rows} == {("retired", first[0])}
    check_history(store.dsn).assert_clean()


def test_while_a_commit_gate_waits_retention_keeps_the_epoch_a_restore_goes_back_to_and_every_later_one(
        store: EpochStore, pipe: Pipeline) -> None:
    from airflow_arroyo.core.gates import GatePolicy, GateState, record_verdict

    epochs = [pipe.epoch({"agg": {f"state-{i}": 10}}) for i in range(6)]
    e1, e2, e3, e4, e5, e6 = epochs

    def gate(epoch: int) -> None:
        store.open_gate("orders", "out", epoch, run_id="run-1", uri="file:///out", policy=GatePolicy.HOLD,
                        batch_from=epoch, batch_to=epoch, details={"kind": "files", "files": []}, timeout=None)

    gate(e2)
    record_verdict(store, "orders", "out", e2, passed=True, by="check")
    store.close_gate("orders", "out", e2, GateState.COMMITTED)
    for e in (e4, e5):
        gate(e)
    record_verdict(store, "orders", "out", e5, passed=True, by="check")  # passed, but behind e4's pending gate
    # e4's gate waits: 'latest' restores e3, and e3..e6 become that epoch in turn as verdicts pass
    report = prune(store, policy=RetentionPolicy(keep_last=1))
    assert report.epochs_pruned == [e1, e2]
    assert report.kept == [e3, e4, e5, e6]
    # every gate passed and committed: the next gate may open for e6 at any moment, so e5 (the newest epoch up to
    # the newest closed gate) stays as the epoch a restore would go back to
    record_verdict(store, "orders", "out", e4, passed=True, by="check")
    for e in (e4, e5):
        store.close_gate("orders", "out", e, GateState.COMMITTED)
    assert prune(store, policy=RetentionPolicy(keep_last=1)).epochs_pruned == [e3, e4]
    assert pipe.states()[e5] is EpochState.COMPLETED
