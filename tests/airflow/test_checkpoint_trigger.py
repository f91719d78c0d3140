"""CheckpointTrigger against a real PostgreSQL epoch store, with time driven by the test.

No test sleeps. ``asyncio.sleep`` in the trigger module is replaced by :class:`VirtualClock`: when the
trigger asks to sleep ``d`` seconds, the clock moves every timestamp of the pipeline's history ``d``
seconds into the past (epochs, cleanup lease) -- to the trigger, which reads ``now()`` from the
database, exactly ``d`` seconds have passed -- and then runs the test's fake pipeline (a plain
function that acknowledges, fails or stops) before the trigger ticks again.
"""

from __future__ import annotations

import asyncio
import gc
import re
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta
from typing import Any
from unittest import mock

import psycopg2
import pytest
import structlog

from airflow_arroyo.core import epochs as epochs_module
from airflow_arroyo.core.epochs import CheckpointPolicy, EpochState, PipelineState, TriggerAction, schedule_point_after
from airflow_arroyo.core.exceptions import ConfigurationError, TransientStoreError
from airflow_arroyo.hooks import arroyo as hook_module
from airflow_arroyo.store import AsyncEpochStore, EpochStore, TickResult
from airflow_arroyo.triggers import checkpoint as trigger_module
from airflow_arroyo.triggers.checkpoint import CheckpointTrigger
from tests.support import assert_on_schedule
from tests.support import running as register_running

REAL_SLEEP = asyncio.sleep
REAL_PHASE = epochs_module.schedule_phase
PID = "orders"
STAGES = ["source", "agg"]

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(autouse=True)
def polling(monkeypatch: pytest.MonkeyPatch) -> None:
    """Time here is virtual (moved by the patched ``asyncio.sleep``): the trigger must poll, not wait
    in real time for the database's announcements (tests/airflow/test_checkpoint_wakeups.py does)."""
    monkeypatch.setattr(trigger_module, "WAKE_ON_NOTIFY", False)


# --------------------------------------------------------------------------- harness


@pytest.fixture
def connection(monkeypatch: pytest.MonkeyPatch, migrated_dsn: str) -> Iterator[str]:
    monkeypatch.setenv("AIRFLOW_CONN_ARROYO_DEFAULT", migrated_dsn)
    hook_module._reset_shared_stores()
    yield migrated_dsn
    hook_module._reset_shared_stores()


@pytest.fixture
def running(store: EpochStore) -> EpochStore:
    register_running(store, PID, stages=STAGES, run_id="run-1")
    return store


class VirtualClock:
    """Stands in for ``asyncio.sleep`` in the trigger module: time passes in the database only (every stored
    time moves back by the time slept, and so does the fixed-rate schedule's grid: its phase)."""

    def __init__(self, dsn: str, pipeline: Callable[[], None] | None = None, max_sleeps: int = 200,
                 advanced: float = 0.0) -> None:
        self.dsn = dsn
        self.pipeline = pipeline or (lambda: None)
        self.sleeps: list[float] = []
        self.max_sleeps = max_sleeps
        self.advanced = advanced  # seconds the stored times were moved back already (by an earlier clock)

    def phase(self, pipeline_id: str, interval: float) -> float:
        """The schedule's phase as seen from the moved-back times."""
        return (REAL_PHASE(pipeline_id, interval) - self.advanced) % interval

    def advance(self, seconds: float) -> None:
        if seconds <= 0:
            return
        self.advanced += seconds
        d = timedelta(seconds=seconds)
        with psycopg2.connect(self.dsn) as conn, conn.cursor() as cur:
            cur.execute("UPDATE arroyo_epochs SET triggered_at = triggered_at - %(d)s,"
                        " timeout_at = timeout_at - %(d)s, ended_at = ended_at - %(d)s", {"d": d})
            cur.execute("UPDATE arroyo_cleanup_locks SET acquired_at = acquired_at - %(d)s,"
                        " expires_at = expires_at - %(d)s", {"d": d})
        conn.close()

    async def sleep(self, seconds: float, *args: Any) -> None:
        assert seconds >= 0, seconds
        self.sleeps.append(seconds)
        assert len(self.sleeps) <= self.max_sleeps, "the trigger never ended"
        self.advance(seconds)
        self.pipeline()
        await REAL_SLEEP(0)


async def first_event(trigger: CheckpointTrigger, clock: VirtualClock) -> dict[str, Any]:
    with mock.patch.object(trigger_module.asyncio, "sleep", clock.sleep), \
            mock.patch.object(epochs_module, "schedule_phase", clock.phase):
        gen = trigger.run()
        event = await anext(gen)
        await gen.aclose()
    return dict(event.payload)


def make_trigger(**kwargs: Any) -> CheckpointTrigger:
    args: dict[str, Any] = {"pipeline_id": PID, "interval": 10.0, "tolerable_failures": 3}
    args.update(kwargs)
    return CheckpointTrigger(**args)


def ack(store: EpochStore, *, bytes_new: int = 1000) -> int | None:
    """The fake pipeline acknowledges the in-flight epoch from every stage; returns its number."""
    ep = store.in_flight_epoch(PID)
    if ep is None:
        return None
    for i, stage in enumerate(ep.stages):
        store.ack_epoch(PID, ep.epoch, stage, bytes_new=bytes_new * ep.epoch + i, bytes_total=10 * bytes_new + i)
    return ep.epoch


def completed(store: EpochStore) -> list[int]:
    return sorted(e.epoch for e in store.list_epochs(PID, states=[EpochState.COMPLETED]))


def max_in_flight(dsn: str) -> int:
    """Replay the database's own history of epoch states: the most epochs ever in flight at once."""
    with psycopg2.connect(dsn) as conn, conn.cursor() as cur:
        cur.execute("SELECT epoch, old_state, new_state FROM arroyo_history WHERE kind = 'epoch_state'"
                    " ORDER BY seq")
        rows = cur.fetchall()
    conn.close()
    live: set[int] = set()
    peak = 0
    for epoch, old, new in rows:
        if new == "triggered":
            live.add(epoch)
        elif old == "triggered":
            live.discard(epoch)
        peak = max(peak, len(live))
    return peak


def messages(logs: list[dict[str, Any]]) -> list[str]:
    return [str(entry["event"]) for entry in logs]


# --------------------------------------------------------------------------- serialization and validation


def test_serialize_round_trip_rebuilds_an_equal_trigger() -> None:
    trigger = CheckpointTrigger(PID, conn_id="epochs", interval=2.5, timeout=30.0, min_pause=1.0,
                                tolerable_failures=0, poll_interval=0.5, triggered_by="airflow:d/t/r",
                                pipeline_run_id="run-7", registration_timeout=12.0, max_summary_epochs=50,
                                stop_after_epochs=3, not_before=1_700_000_000.0)
    classpath, kwargs = trigger.serialize()
    assert classpath == "airflow_arroyo.triggers.checkpoint.CheckpointTrigger"
    module, _, name = classpath.rpartition(".")
    rebuilt = getattr(__import__(module, fromlist=[name]), name)(**kwargs)
    assert rebuilt.serialize() == (classpath, kwargs)
    assert vars(rebuilt).keys() >= kwargs.keys()
    assert {k: getattr(rebuilt, k) for k in kwargs} == {k: getattr(trigger, k) for k in kwargs}
    # exactly the constructor's arguments, nothing live
    import inspect

    assert set(kwargs) == set(inspect.signature(CheckpointTrigger.__init__).parameters) - {"self"}


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"interval": 0}, "interval must be a positive"),
        ({"interval": 30, "timeout": 10}, "shorter than the interval"),
        ({"min_pause": -1}, "min_pause"),
        ({"tolerable_failures": -1}, "tolerable_failures"),
        ({"poll_interval": 0}, "poll_interval"),
        ({"pipeline_id": "no spaces"}, "pipeline id"),
    ],
)
def test_bad_configuration_is_refused_at_construction(kwargs: dict[str, Any], needle: str) -> None:
    with pytest.raises(ConfigurationError, match=needle):
        make_trigger(**kwargs)


# --------------------------------------------------------------------------- events


async def test_fires_epochs_on_schedule_and_succeeds_when_the_pipeline_stops(running: EpochStore,
                                                                            connection: str) -> None:
    def pipeline() -> None:
        ack(running)
        if len(completed(running)) == 3 and running.get_pipeline(PID).state is PipelineState.RUNNING:
            running.set_pipeline_state(PID, PipelineState.STOPPED)

    clock = VirtualClock(connection, pipeline)
    with structlog.testing.capture_logs() as logs:
        event = await first_event(make_trigger(interval=10.0), clock)

    assert event["status"] == "success" and event["reason"] == "pipeline_stopped"
    assert event["pipeline_state"] == "stopped" and event["pipeline_run_id"] == "run-1"
    summary = event["summary"]
    assert (summary["completed"], summary["failed"], summary["expired"]) == (3, 0, 0)
    epochs = running.list_epochs(PID)[::-1]
    assert [e["epoch"] for e in summary["epochs"]] == [e.epoch for e in epochs] == [1, 2, 3]
    for entry, rec in zip(summary["epochs"], epochs, strict=True):
        assert entry["state"] == "completed"
        assert entry["bytes_new"] == rec.bytes_new == sum(1000 * rec.epoch + i for i in range(len(STAGES)))
        assert entry["duration_s"] == pytest.approx(rec.duration_s)
    # each start is at its point of the fixed-rate schedule (never early; late only by the real time a tick
    # takes on a busy machine): the points are an interval apart, the first may come sooner after epoch 1
    starts = [e.triggered_at for e in epochs]
    assert_on_schedule(starts, 10.0, PID, slack=1.0, phase=clock.phase(PID, 10.0))
    gaps = [(b - a).total_seconds() for a, b in zip(starts[1:], starts[2:], strict=False)]
    assert all(9.0 < g < 11.0 for g in gaps), gaps
    assert all(s <= 10.0 for s in clock.sleeps), clock.sleeps  # never sleeps past a due start
    text = messages(logs)
    for n in (1, 2, 3):
        assert sum(bool(re.search(rf"epoch {n} started", m)) for m in text) == 1, text
        assert sum(bool(re.search(rf"epoch {n} completed in", m)) for m in text) == 1, text
    assert "stopped; 3 epochs completed" in event["message"]
    assert not any("3 epochs completed" in m for m in text), text  # said once, by the task (not here too)


async def test_failure_event_once_consecutive_failures_exceed_the_tolerance(running: EpochStore,
                                                                          connection: str) -> None:
    plan = iter(["fail", "complete", "fail", "fail", "fail", "fail"])

    def pipeline() -> None:
        ep = running.in_flight_epoch(PID)
        if ep is None:
            return
        if next(plan) == "fail":
            running.fail_epoch(PID, ep.epoch, f"stage agg could not snapshot epoch {ep.epoch}")
        else:
            ack(running)

    event = await first_event(make_trigger(tolerable_failures=2), VirtualClock(connection, pipeline))

    assert event["status"] == "failure" and event["reason"] == "too_many_failures"
    assert "3 consecutive epochs failed" in event["message"]
    summary = event["summary"]
    assert (summary["completed"], summary["failed"], summary["expired"]) == (1, 4, 0)
    assert [e["state"] for e in summary["epochs"]] == ["failed", "completed", "failed", "failed", "failed"]
    assert summary["epochs"][-1]["failure_reason"] == "stage agg could not snapshot epoch 5"
    assert [e.epoch for e in running.list_epochs(PID)] == [5, 4, 3, 2, 1]  # none started after the 3rd failure


async def test_failure_event_with_the_cause_when_the_pipeline_fails(running: EpochStore, connection: str) -> None:
    def pipeline() -> None:
        if not completed(running):
            ack(running)
        elif running.in_flight_epoch(PID) is not None:
            running.set_pipeline_state(PID, PipelineState.FAILED, failure_cause="executor lost: OOM in stage agg")

    event = await first_event(make_trigger(), VirtualClock(connection, pipeline))

    assert event["status"] == "failure" and event["reason"] == "pipeline_failed"
    assert event["cause"] == "executor lost: OOM in stage agg"
    assert event["pipeline_state"] == "failed"
    assert [(e["epoch"], e["state"]) for e in event["summary"]["epochs"]] == [(1, "completed"), (2, "failed")]


async def test_an_epoch_past_its_timeout_expires(running: EpochStore, connection: str) -> None:
    clock = VirtualClock(connection)  # a pipeline that never acknowledges
    with structlog.testing.capture_logs() as logs:
        event = await first_event(make_trigger(interval=10.0, timeout=25.0, tolerable_failures=0), clock)

    assert event["status"] == "failure" and event["reason"] == "too_many_failures"
    (rec,) = running.list_epochs(PID)
    assert rec.state is EpochState.EXPIRED and rec.failure_reason is not None and "25s" in rec.failure_reason
    assert 25.0 <= rec.duration_s < 26.0  # expired at the first tick past its timeout
    assert event["summary"]["expired"] == 1 and event["summary"]["epochs"][0]["state"] == "expired"
    assert sum(clock.sleeps) == pytest.approx(25.0, abs=1.0)
    assert any("epoch 1 expired" in m for m in messages(logs))


def test_the_summary_reads_how_a_pruned_epoch_ended_from_the_store_not_from_its_failure_reason(
        running: EpochStore, migrated_dsn: str) -> None:
    """Epochs the trigger saw end may be pruned before it reads them; their outcome is the store's record
    (migration 0007). Epoch 1 failed with a reason that reads like an expiry, epoch 2 expired."""
    policy = CheckpointPolicy(interval=1, timeout=3600)
    first = running.trigger_tick(PID, policy, force=True).started
    assert first is not None
    running.fail_epoch(PID, first.epoch, "not acknowledged: stage agg lost its executor")
    second = running.trigger_tick(PID, policy, force=True).started
    assert second is not None
    with psycopg2.connect(migrated_dsn) as conn, conn.cursor() as cur:  # epoch 2 passed its timeout
        cur.execute("UPDATE arroyo_epochs SET triggered_at = triggered_at - interval '2 hours',"
                    " timeout_at = now() - interval '1 hour' WHERE epoch = %s", (second.epoch,))
    conn.close()
    assert running.trigger_tick(PID, policy).expired is not None
    for _ in range(2):
        running.trigger_tick(PID, policy, force=True)
        ack(running)
    cleanup = running.acquire_cleanup_lock(PID, "test", ttl=60)
    plan = running.begin_prune(PID, cleanup.id, [first.epoch, second.epoch, second.epoch + 1])
    running.finish_prune(PID, cleanup.id, dict.fromkeys(plan.epochs, 0))
    summary = trigger_module._Summary(limit=10)
    for n in (first.epoch, second.epoch, second.epoch + 1):
        rec = running.get_epoch(PID, n)
        assert rec.state is EpochState.PRUNED
        summary.add(rec)
    assert [e["state"] for e in summary.entries] == ["failed", "expired", "completed"]
    assert (summary.counts["completed"], summary.counts["failed"], summary.counts["expired"]) == (1, 1, 1)


async def test_an_expired_epoch_within_the_tolerance_does_not_stop_checkpoints(running: EpochStore,
                                                                             connection: str) -> None:
    def pipeline() -> None:
        ep = running.in_flight_epoch(PID)
        if ep is not None and ep.epoch >= 2:
            ack(running)
        if len(completed(running)) == 2:
            running.set_pipeline_state(PID, PipelineState.STOPPED)

    event = await first_event(make_trigger(interval=10.0, timeout=20.0, tolerable_failures=1),
                              VirtualClock(connection, pipeline))

    assert event["status"] == "success"
    assert [(e["epoch"], e["state"]) for e in event["summary"]["epochs"]] == [
        (1, "expired"), (2, "completed"), (3, "completed")]


async def test_an_overdue_epoch_is_polled_for_in_short_doubling_steps(running: EpochStore, connection: str) -> None:
    """The next epoch is due but the previous one is still in flight: look again soon (not after a whole
    poll interval), backing off, so the lateness stays within about twice the overrun."""

    def due_after(started: datetime) -> datetime:  # the schedule's next point, as the moved-back times see it
        return schedule_point_after(started, 10.0, clock.phase(PID, 10.0))

    def pipeline() -> None:
        ep = running.in_flight_epoch(PID)
        if ep is None:
            return
        # epoch 1 is acknowledged 0.9 s after epoch 2 is due
        if ep.epoch > 1 or running.db_now() >= due_after(ep.triggered_at) + timedelta(seconds=0.9):
            ack(running)
        if len(completed(running)) == 2:
            running.set_pipeline_state(PID, PipelineState.STOPPED)

    clock = VirtualClock(connection, pipeline)
    event = await first_event(make_trigger(interval=10.0, poll_interval=5.0), clock)

    assert event["status"] == "success"
    first, second = running.list_epochs(PID)[::-1]
    late = (second.triggered_at - due_after(first.triggered_at)).total_seconds()
    assert 0.9 <= late < 2 * 0.9 + 1.0, late  # with 5 s polls it could be 5 s
    # (real time passes in the database too: the 0.8 s poll is the one that sees the acknowledgement)
    rounded = [round(s, 3) for s in clock.sleeps]
    assert any(rounded[i:i + 3] == [0.2, 0.4, 0.8] for i in range(len(rounded))), clock.sleeps  # interval/50, x2


async def test_min_pause_separates_the_end_of_an_epoch_from_the_next_start(running: EpochStore,
                                                                           connection: str) -> None:
    def pipeline() -> None:
        ack(running)
        if len(completed(running)) == 3:
            running.set_pipeline_state(PID, PipelineState.STOPPED)

    event = await first_event(make_trigger(interval=10.0, min_pause=30.0), VirtualClock(connection, pipeline))

    assert event["status"] == "success"
    epochs = running.list_epochs(PID)[::-1]
    assert len(epochs) == 3
    for prev, nxt in zip(epochs, epochs[1:], strict=False):
        assert prev.ended_at is not None
        pause = (nxt.triggered_at - prev.ended_at).total_seconds()
        assert 30.0 <= pause < 31.0, pause


async def test_waits_while_the_cleanup_lock_is_held_and_says_so_once(running: EpochStore, connection: str) -> None:
    state: dict[str, Any] = {"run": None, "held_sleeps": 0, "epochs_when_locked": None}

    def pipeline() -> None:
        ack(running)
        done = completed(running)
        if done == [1] and state["run"] is None and state["epochs_when_locked"] is None:
            state["run"] = running.acquire_cleanup_lock(PID, "retention@worker-3", ttl=300).id
            state["epochs_when_locked"] = len(running.list_epochs(PID))
        elif state["run"] is not None:
            assert len(running.list_epochs(PID)) == state["epochs_when_locked"], "an epoch started under the lock"
            state["held_sleeps"] += 1
            if state["held_sleeps"] == 6:  # about a minute of waiting
                running.release_cleanup_lock(PID, state["run"])
                state["run"] = None
        if len(done) == 2:
            running.set_pipeline_state(PID, PipelineState.STOPPED)

    with structlog.testing.capture_logs() as logs:
        event = await first_event(make_trigger(interval=10.0), VirtualClock(connection, pipeline))

    assert event["status"] == "success" and event["summary"]["completed"] == 2
    waits = [m for m in messages(logs) if "waiting for cleanup run" in m]
    assert len(waits) == 1, waits
    assert re.search(r"waiting for cleanup run \d+ held by retention@worker-3", waits[0])
    assert any("cleanup lock released" in m for m in messages(logs))
    assert state["held_sleeps"] == 6


async def test_waits_for_the_pipeline_to_register_then_runs(store: EpochStore, connection: str) -> None:
    sleeps = 0

    def pipeline() -> None:
        nonlocal sleeps
        sleeps += 1
        if sleeps == 3:
            store.register_pipeline(PID, stages=STAGES, run_id="run-1")
        elif sleeps == 5:
            store.set_pipeline_state(PID, PipelineState.RUNNING)
        if sleeps >= 3 and ack(store) == 1:
            store.set_pipeline_state(PID, PipelineState.STOPPED)

    with structlog.testing.capture_logs() as logs:
        event = await first_event(make_trigger(registration_timeout=3600), VirtualClock(connection, pipeline))

    assert event["status"] == "success" and event["summary"]["completed"] == 1
    text = messages(logs)
    assert sum("not registered yet" in m for m in text) == 1
    assert sum("pipeline is registered; no checkpoint until it runs" in m for m in text) == 1


@pytest.mark.usefixtures("store")
async def test_never_registered_ends_with_a_failure_event(connection: str) -> None:
    event = await first_event(make_trigger(registration_timeout=0), VirtualClock(connection))
    assert event["status"] == "failure" and event["reason"] == "not_registered"
    assert "not registered" in event["message"]


async def test_a_previous_run_that_stopped_is_not_mistaken_for_ours(store: EpochStore, connection: str) -> None:
    store.register_pipeline(PID, stages=STAGES, run_id="run-0")
    store.set_pipeline_state(PID, PipelineState.STOPPED)
    sleeps = 0

    def pipeline() -> None:
        nonlocal sleeps
        sleeps += 1
        if sleeps == 2:
            store.register_pipeline(PID, stages=STAGES, run_id="run-1")
            store.set_pipeline_state(PID, PipelineState.RUNNING)
        ack(store)
        if completed(store) == [1]:
            store.set_pipeline_state(PID, PipelineState.STOPPED)

    event = await first_event(make_trigger(pipeline_run_id="run-1"), VirtualClock(connection, pipeline))

    assert event["status"] == "success" and event["pipeline_run_id"] == "run-1"
    assert store.get_epoch(PID, 1).run_id == "run-1"


# --------------------------------------------------------------------------- restarts and high availability


class Crash(Exception):
    """The triggerer process dies."""


async def test_a_restart_whose_run_never_registers_ends_the_wait_once_the_strategy_gives_up(
        running: EpochStore, connection: str) -> None:
    """Issue 30, finding 6: the worker that was to restart the failed run died before the restart registered.
    The supervision said `restarting` for good and this trigger waited for the restart for ever; past the
    registration bound the restart is declared failed, and its strategy, out of attempts, gives up."""
    from airflow_arroyo.core.supervision import FixedDelay, RestartDecision, restart_pending

    running.supervise(PID, "run-1", FixedDelay(attempts=1, delay=0.0).to_dict())
    running.set_pipeline_state(PID, PipelineState.FAILED, run_id="run-1", failure_cause="executor lost")
    running.record_failure(PID, "run-1", "run-1", "executor lost",
                           lambda past, now, stop: RestartDecision(True, 0.0, "restart 1 of 1"))
    assert restart_pending(running.get_pipeline(PID))

    event = await first_event(make_trigger(registration_timeout=0.0), VirtualClock(connection))

    assert event["status"] == "failure" and event["reason"] == "pipeline_failed", event
    assert running.get_pipeline(PID).supervision == "gave_up"
    assert [(r.failed_run_id, r.gave_up) for r in running.restarts(PID)] == [("run-1.restart1", True),
                                                                            ("run-1", False)]


async def test_a_restarted_trigger_resumes_from_the_database(running: EpochStore, connection: str) -> None:
    def crash_when_epoch_2_in_flight() -> None:
        ep = running.in_flight_epoch(PID)
        if ep is not None and ep.epoch == 2:
            raise Crash
        ack(running)

    first = make_trigger(interval=10.0)
    before = VirtualClock(connection, crash_when_epoch_2_in_flight)
    with pytest.raises(Crash):
        await first_event(first, before)
    assert running.in_flight_epoch(PID) is not None

    def pipeline() -> None:
        ack(running)
        if len(completed(running)) == 3:
            running.set_pipeline_state(PID, PipelineState.STOPPED)

    classpath, kwargs = first.serialize()
    second = CheckpointTrigger(**kwargs)
    clock = VirtualClock(connection, pipeline, advanced=before.advanced)
    with structlog.testing.capture_logs() as logs:
        event = await first_event(second, clock)

    assert event["status"] == "success"
    assert [(e["epoch"], e["state"]) for e in event["summary"]["epochs"]] == [(2, "completed"), (3, "completed")]
    assert any("epoch 2 is in flight" in m for m in messages(logs))
    epochs = running.list_epochs(PID)[::-1]
    assert [e.epoch for e in epochs] == [1, 2, 3]
    # schedule kept: epoch 3 at its point of the schedule after epoch 2, not before it
    assert_on_schedule([e.triggered_at for e in epochs[1:]], 10.0, PID, phase=clock.phase(PID, 10.0))
    assert max_in_flight(connection) == 1


class RecordingStore(AsyncEpochStore):
    """Our own store seam: records each tick's result with the round it happened in."""

    def __init__(self, sync: EpochStore, name: str, rounds: list[int], ticks: list[tuple[int, str, TickResult]]):
        super().__init__(sync)
        self.name, self.rounds, self.ticks = name, rounds, ticks

    async def trigger_tick(self, *args: Any, **kwargs: Any) -> TickResult:
        result = await super().trigger_tick(*args, **kwargs)
        self.ticks.append((self.rounds[0], self.name, result))
        return result


@pytest.mark.usefixtures("monkeypatch")
async def test_two_copies_of_the_trigger_on_one_loop_never_have_two_epochs_in_flight(
        running: EpochStore, connection: str) -> None:
    """Triggerer HA runs the same trigger twice. Both copies tick at the same instants (lock-step),
    so they race for every start; the database lets exactly one win."""
    rounds = [0]
    ticks: list[tuple[int, str, TickResult]] = []
    active = {"a", "b"}
    waiting: set[str] = set()
    released = asyncio.Event()
    clock = VirtualClock(connection)

    def pipeline() -> None:
        ack(running)
        if len(completed(running)) == 5 and running.get_pipeline(PID).state is PipelineState.RUNNING:
            running.set_pipeline_state(PID, PipelineState.STOPPED)

    def release_round() -> None:
        nonlocal released
        clock.advance(min(requested.values()))
        pipeline()
        rounds[0] += 1
        waiting.clear()
        requested.clear()
        old, released = released, asyncio.Event()
        old.set()

    requested: dict[str, float] = {}

    def lockstep_sleep_for(name: str) -> Callable[[float], Any]:
        async def sleep(seconds: float, *args: Any) -> None:
            assert rounds[0] < 200, "the triggers never ended"
            requested[name] = seconds
            waiting.add(name)
            event = released
            if waiting >= active:
                release_round()
            await event.wait()
        return sleep

    sleeps = {name: lockstep_sleep_for(name) for name in ("a", "b")}
    current: dict[int, str] = {}

    async def dispatch_sleep(seconds: float, *args: Any) -> None:
        task = asyncio.current_task()
        assert task is not None
        await sleeps[current[id(task)]](seconds)

    async def run_copy(name: str) -> dict[str, Any]:
        task = asyncio.current_task()
        assert task is not None
        current[id(task)] = name
        trigger = make_trigger(interval=10.0, triggered_by=f"copy-{name}")

        async def open_store() -> AsyncEpochStore:
            return RecordingStore(running, name, rounds, ticks)

        trigger._open_store = open_store  # type: ignore[method-assign]
        try:
            gen = trigger.run()
            event = await anext(gen)
            await gen.aclose()
            return dict(event.payload)
        finally:
            active.discard(name)
            if waiting and waiting >= active:
                release_round()

    # the schedule's grid moves back with the stored times, as in first_event: without it, a grid point
    # stays in real time and one copy can tick just before it and the other just after, in one round
    with mock.patch.object(trigger_module.asyncio, "sleep", dispatch_sleep), \
            mock.patch.object(epochs_module, "schedule_phase", clock.phase):
        results = await asyncio.gather(run_copy("a"), run_copy("b"))

    assert [r["status"] for r in results] == ["success", "success"]
    epochs = running.list_epochs(PID)[::-1]
    assert [e.epoch for e in epochs] == [1, 2, 3, 4, 5]
    assert max_in_flight(connection) == 1
    # in every round where one copy started an epoch, the other saw it in flight: a real race, lost safely
    by_round: dict[int, dict[str, TickResult]] = {}
    for rnd, name, result in ticks:
        by_round.setdefault(rnd, {})[name] = result
    contested = 0
    for results_of_round in by_round.values():
        starts = [r for r in results_of_round.values() if r.started is not None]
        assert len(starts) <= 1
        if starts and len(results_of_round) == 2:
            (other,) = [r for r in results_of_round.values() if r.started is None]
            assert other.decision.action is TriggerAction.WAIT_IN_FLIGHT
            assert other.decision.epoch == starts[0].started.epoch  # type: ignore[union-attr]
            contested += 1
    assert contested == 5


# --------------------------------------------------------------------------- store failures


async def test_a_store_outage_longer_than_the_timeout_ends_with_a_failure_event(
        running: EpochStore, connection: str, monkeypatch: pytest.MonkeyPatch) -> None:
    now = [1000.0]
    monkeypatch.setattr(trigger_module._Controller, "clock", staticmethod(lambda: now[0]))

    class DownStore(AsyncEpochStore):
        async def trigger_tick(self, *args: Any, **kwargs: Any) -> TickResult:
            now[0] += 15.0  # each call spends its retry budget
            raise TransientStoreError("epoch store unreachable after retrying for up to 15s: connection refused")

    trigger = make_trigger(interval=10.0, timeout=60.0)

    async def open_store() -> AsyncEpochStore:
        return DownStore(running)

    trigger._open_store = open_store  # type: ignore[method-assign]
    clock = VirtualClock(connection)
    with structlog.testing.capture_logs() as logs:
        event = await first_event(trigger, clock)

    assert event["status"] == "failure" and event["reason"] == "store_error"
    assert "unreachable for 75s" in event["message"]
    assert sum("unreachable" in m for m in messages(logs)) == 5  # 0..60 s: warned and retried


async def test_an_unknown_connection_ends_with_a_failure_event(connection: str) -> None:
    event = await first_event(make_trigger(conn_id="no_such_connection"), VirtualClock(connection))
    assert event["status"] == "failure" and event["reason"] == "store_error"
    assert "no_such_connection" in event["message"]


@pytest.mark.parametrize("setting", ["True", "False", "nonsense"])
async def test_the_first_trigger_of_a_process_freezes_the_objects_alive_then_out_of_the_gc(
        connection: str, monkeypatch: pytest.MonkeyPatch, setting: str) -> None:
    """gc.freeze() once per process ([arroyo] triggerer_freeze_gc): a full collection no longer scans the
    imported modules."""
    freeze = setting != "False"  # an unreadable setting: the default (and a warning)
    monkeypatch.setenv("AIRFLOW__ARROYO__TRIGGERER_FREEZE_GC", setting)
    monkeypatch.setattr(trigger_module, "_gc_frozen", False)
    gc.unfreeze()
    try:
        await first_event(make_trigger(conn_id="no_such_connection"), VirtualClock(connection))
        frozen = gc.get_freeze_count()
        assert (frozen > 10_000) is freeze  # this process's modules, classes and functions
        made_later = [[i] for i in range(1000)]
        await first_event(make_trigger(conn_id="no_such_connection"), VirtualClock(connection))
        assert gc.get_freeze_count() == frozen and made_later  # once per process
    finally:
        gc.unfreeze()


async def test_failures_left_by_an_earlier_run_do_not_end_a_new_trigger(store: EpochStore, connection: str) -> None:
    # the earlier run: two epochs failed (the run was stopped, then superseded, with an epoch in flight)
    store.register_pipeline(PID, stages=STAGES, run_id="run-0")
    store.set_pipeline_state(PID, PipelineState.RUNNING)
    policy = make_trigger(interval=10.0).policy
    for _ in range(2):
        tick = store.trigger_tick(PID, policy, force=True)
        assert tick.started is not None
        store.fail_epoch(PID, tick.started.epoch, "run-0 went away")
    store.set_pipeline_state(PID, PipelineState.STOPPED)
    store.register_pipeline(PID, stages=STAGES, run_id="run-1")
    store.set_pipeline_state(PID, PipelineState.RUNNING)

    def pipeline() -> None:
        if ack(store) == 4:
            store.set_pipeline_state(PID, PipelineState.STOPPED)

    event = await first_event(make_trigger(interval=10.0, tolerable_failures=1), VirtualClock(connection, pipeline))

    assert event["status"] == "success"
    assert [(e["epoch"], e["state"]) for e in event["summary"]["epochs"]] == [(3, "completed"), (4, "completed")]


async def test_no_new_epoch_once_a_stop_is_requested(running: EpochStore, connection: str) -> None:
    sleeps = 0

    def pipeline() -> None:
        nonlocal sleeps
        sleeps += 1
        if ack(running) == 1:
            running.request_stop(PID, "graceful")
        if sleeps == 8:  # the driver stops a while later
            running.set_pipeline_state(PID, PipelineState.STOPPED)

    with structlog.testing.capture_logs() as logs:
        event = await first_event(make_trigger(interval=10.0), VirtualClock(connection, pipeline))

    assert event["status"] == "success"
    assert [e.epoch for e in running.list_epochs(PID)] == [1]  # 12 s passed (> interval): none started
    assert sum("a stop was requested" in m for m in messages(logs)) == 1


async def test_epoch_ends_are_read_in_the_tick_itself(running: EpochStore, connection: str) -> None:
    """The end of an epoch (state, duration, bytes) comes back from the tick that notices it: no extra
    transaction per epoch."""
    gets: list[int] = []

    class CountingStore(AsyncEpochStore):
        async def get_epoch(self, pipeline_id: str, epoch: int) -> Any:
            gets.append(epoch)
            return await super().get_epoch(pipeline_id, epoch)

    def pipeline() -> None:
        ack(running)
        if len(completed(running)) == 3:
            running.set_pipeline_state(PID, PipelineState.STOPPED)

    trigger = make_trigger(interval=10.0)

    async def open_store() -> AsyncEpochStore:
        return CountingStore(running)

    trigger._open_store = open_store  # type: ignore[method-assign]
    event = await first_event(trigger, VirtualClock(connection, pipeline))

    assert [(e["epoch"], e["state"], e["bytes_new"]) for e in event["summary"]["epochs"]] == [
        (n, "completed", running.get_epoch(PID, n).bytes_new) for n in (1, 2, 3)]
    assert gets == []
    tick = running.trigger_tick(PID, make_trigger().policy, watch=[1, 2, 3, 99])
    assert [rec.epoch for rec in tick.ended] == [1, 2, 3]  # ended ones only, unknown numbers ignored


# --------------------------------------------------------------------------- interval, stop after N, final epoch


def graceful_driver(store: EpochStore) -> Callable[[], None]:
    """A fake driver: acknowledges epochs; on a graceful stop request it goes `stopping`, waits for an
    in-flight epoch to end, takes a final epoch (as the real driver: a forced tick marked final) and
    stops once that completed."""
    policy = trigger_module.CheckpointPolicy(interval=1.0, timeout=60.0)

    def step() -> None:
        ack(store)
        pipe = store.get_pipeline(PID)
        if pipe.stop_requested != "graceful" or pipe.state.terminal:
            return
        if pipe.state is PipelineState.RUNNING:
            store.set_pipeline_state(PID, PipelineState.STOPPING)
        final = [e for e in store.list_epochs(PID) if e.is_final]
        if not final:
            if store.in_flight_epoch(PID) is None:
                store.trigger_tick(PID, policy, triggered_by="final-epoch", force=True, is_final=True)
        elif final[0].state is EpochState.COMPLETED:
            store.set_pipeline_state(PID, PipelineState.STOPPED)

    return step


async def test_stop_after_epochs_ends_with_exactly_that_many_completed_epochs(running: EpochStore,
                                                                           connection: str) -> None:
    """The demo's `epochs=N`: N completed epochs, the last the stop's final one, whatever the interval."""
    clock = VirtualClock(connection, graceful_driver(running))
    with structlog.testing.capture_logs() as logs:
        event = await first_event(make_trigger(interval=10.0, stop_after_epochs=4), clock)
    assert event["status"] == "success", event
    epochs = sorted(running.list_epochs(PID), key=lambda e: e.epoch)
    assert [(e.epoch, e.state) for e in epochs] == [(n, EpochState.COMPLETED) for n in (1, 2, 3, 4)]
    assert [e.is_final for e in epochs] == [False, False, False, True]
    text = messages(logs)
    assert any("requested a graceful stop" in m for m in text), text
    # the final epoch is named for what it is, not "started by another controller"
    assert any("epoch 4 is in flight (the final epoch of a graceful stop" in m for m in text), text
    assert not any("another controller" in m for m in text), text


async def test_records_its_interval_on_the_run_it_controls(running: EpochStore, connection: str) -> None:
    """The UI's Interval column and the "checkpoints overdue" warning read it."""
    assert running.get_pipeline(PID).checkpoint_interval_s is None

    def pipeline() -> None:
        ack(running)
        if completed(running):
            running.set_pipeline_state(PID, PipelineState.STOPPED)

    await first_event(make_trigger(interval=7.5), VirtualClock(connection, pipeline))
    assert running.get_pipeline(PID).checkpoint_interval_s == 7.5
    # a new run of the pipeline keeps it until a controller records another
    running.register_pipeline(PID, stages=STAGES, run_id="run-2")
    assert running.get_pipeline(PID).checkpoint_interval_s == 7.5


async def test_an_event_reached_within_the_settle_time_is_held(running: EpochStore, connection: str) -> None:
    """apache/airflow#67287: no event before ``not_before``; one reached later is not delayed."""
    import time

    running.set_pipeline_state(PID, PipelineState.STOPPED)  # the event is ready at the first tick
    clock = VirtualClock(connection)
    event = await first_event(make_trigger(not_before=time.time() + 30.0), clock)
    assert event["status"] == "success"
    assert clock.sleeps and 29.0 < clock.sleeps[-1] <= 30.0, clock.sleeps

    late = VirtualClock(connection)
    await first_event(make_trigger(not_before=time.time() - 1.0), late)
    assert late.sleeps == [], late.sleeps


# --------------------------------------------------------------------------- metrics


class RecordingStats:
    """Stands in for Airflow's Stats (a seam of EpochMetrics): records every call."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, Any, dict[str, str]]] = []

    def timing(self, stat: str, dt: Any, tags: dict[str, str]) -> None:
        self.calls.append(("timing", stat, dt.total_seconds(), tags))

    def gauge(self, stat: str, value: float, tags: dict[str, str]) -> None:
        self.calls.append(("gauge", stat, value, tags))

    def incr(self, stat: str, count: int = 1, tags: dict[str, str] | None = None) -> None:
        self.calls.append(("incr", stat, count, tags or {}))

    def values(self, kind: str, metric: str) -> list[Any]:
        return [v for k, s, v, _ in self.calls if k == kind and s == f"arroyo.{PID}.{metric}"]


@pytest.mark.parametrize("coalesce", [True, False], ids=["read-with-the-batch", "read-by-the-trigger"])
async def test_metrics_of_epochs_go_through_airflow_stats(running: EpochStore, connection: str,
                                                          coalesce: bool) -> None:
    """Duration, size, bytes new, alignment, lateness, failures and heartbeat age, per epoch, from the
    records the trigger read (checked against the database): read with the tick's batch (the coalescer's
    report), or by the trigger itself (ticks not coalesced)."""
    from airflow_arroyo.metrics import EpochMetrics

    def pipeline() -> None:
        running.heartbeat(PID, "run-1")
        ep = running.in_flight_epoch(PID)
        if ep is not None and ep.epoch == 2:
            running.fail_epoch(PID, 2, "snapshot upload failed")
        elif ep is not None:
            for i, stage in enumerate(ep.stages):
                running.ack_epoch(PID, ep.epoch, stage, bytes_new=100 * ep.epoch + i, bytes_total=1000 + i,
                                  alignment_ms=10.0 * ep.epoch + i)
        if len(completed(running)) == 2:
            running.set_pipeline_state(PID, PipelineState.FAILED, failure_cause="boom")

    stats = RecordingStats()
    trigger = make_trigger(interval=10.0)
    trigger._metrics = lambda: EpochMetrics(PID, stats=stats)  # type: ignore[method-assign]
    seen: list[bool] = []

    class Store(AsyncEpochStore):
        async def trigger_tick(self, *args: Any, **kwargs: Any) -> TickResult:
            tick = await super().trigger_tick(*args, **kwargs)
            seen.append(tick.report is not None)
            return tick

    async def open_store() -> AsyncEpochStore:
        return Store(running, coalesce=coalesce)

    trigger._open_store = open_store  # type: ignore[method-assign]
    event = await first_event(trigger, VirtualClock(connection, pipeline))

    assert event["reason"] == "pipeline_failed"
    assert seen and set(seen) == {coalesce}
    done = sorted(running.list_epochs(PID, states=[EpochState.COMPLETED]), key=lambda e: e.epoch)
    assert [e.epoch for e in done] == [1, 3]
    assert stats.values("incr", "epoch.completed") == [1, 1]
    assert stats.values("timing", "epoch.duration") == pytest.approx([e.duration_s for e in done])
    assert stats.values("gauge", "epoch.size") == [e.bytes_total for e in done]
    assert stats.values("gauge", "epoch.bytes_new") == [e.bytes_new for e in done]
    assert stats.values("timing", "epoch.alignment") == pytest.approx([0.011, 0.031])  # the slowest stage, in s
    assert [(v, t["outcome"]) for k, s, v, t in stats.calls if s.endswith("epoch.failed")] == [(1, "failed")]
    assert stats.values("incr", "pipeline.failed") == [1]
    lateness = stats.values("timing", "trigger.lateness")
    assert len(lateness) == 2 and all(0 <= v < 1.0 for v in lateness), lateness  # epochs 2, 3: on time
    ages = stats.values("gauge", "pipeline.heartbeat_age")
    assert len(ages) == 3 and all(0 <= a < 60 for a in ages), ages  # one per ended epoch
    assert all(t["pipeline_id"] == PID for _, _, _, t in stats.calls)


async def test_no_epoch_for_a_driver_whose_heartbeat_is_stale_and_the_log_says_why(running: EpochStore,
                                                                                connection: str) -> None:
    """A running pipeline whose driver went silent gets no epoch (it would only expire); the trigger says so
    once, and starts epochs again when the heartbeat is back."""
    stale = "UPDATE arroyo_pipelines SET heartbeat_at = clock_timestamp() - interval '2 minutes' WHERE pipeline_id = %s"
    with psycopg2.connect(connection) as conn, conn.cursor() as cur:
        cur.execute(stale, (PID,))
    conn.close()
    sleeps = 0

    def pipeline() -> None:
        nonlocal sleeps
        sleeps += 1
        if sleeps < 8:
            assert running.list_epochs(PID) == [], "an epoch started for a pipeline that is not alive"
        elif sleeps == 8:
            running.heartbeat(PID, "run-1")
        elif ack(running) == 1:
            running.set_pipeline_state(PID, PipelineState.STOPPED)

    with structlog.testing.capture_logs() as logs:
        event = await first_event(make_trigger(), VirtualClock(connection, pipeline))

    assert event["status"] == "success" and event["summary"]["completed"] == 1
    text = messages(logs)
    silent = [m for m in text if "not alive" in m]
    assert len(silent) == 1 and re.search(r"heartbeat is 1[23]\ds old \(more than 30s\)", silent[0]), silent
    assert sum("heartbeats again; checkpoints resume" in m for m in text) == 1
