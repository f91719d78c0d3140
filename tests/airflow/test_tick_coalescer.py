"""The tick coalescer's correctness, against a real PostgreSQL (no Airflow, no Spark; fast).

What ``test_checkpoint_wakeups.py`` and ``controlplane/test_trigger_ticks.py`` do not cover already:

* a batch's report (``TickReport``): what the triggers log and measure per epoch, read with the
  batch, equals what they would read one by one;
* a cancelled trigger leaves the batch: it is never sent (cancelled before its batch left) and never
  asked for again (cancelled while its row was locked by another transaction);
* fairness: ticks are served in the order they were asked for, a burst larger than a batch is split,
  a pipeline asked for twice waits for the next batch instead of pushing others out;
* a cleanup holding one pipeline's lock holds back that pipeline alone, not its batch; a tick waiting
  for a row another transaction holds holds back no other tick;
* two triggerers (two event loops, each with its own store and coalescer) racing over the same
  pipelines never put two epochs in flight: the history checker replays the database's history.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import replace
from datetime import UTC, datetime, timedelta

import psycopg2
import pytest

from airflow_arroyo.core.epochs import (
    CheckpointPolicy,
    EpochState,
    PipelineState,
    TriggerAction,
    TriggerDecision,
    schedule_phase,
    schedule_point_after,
)
from airflow_arroyo.devtools.history import check_history
from airflow_arroyo.metrics import slowest_alignment
from airflow_arroyo.store import EpochRecord, EpochStore, TickReport, TickRequest, TickResult, _batch, _coalesce
from airflow_arroyo.store._coalesce import TickCoalescer
from airflow_arroyo.triggers import checkpoint as trigger_module
from airflow_arroyo.triggers.checkpoint import CheckpointTrigger, _Controller, _Summary
from tests.support import running

pytestmark = pytest.mark.timeout(60)
STAGES = ["source", "sink"]
POLICY = CheckpointPolicy(interval=3600, timeout=7200)


def record_batches(monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    """The pipelines of every batch the coalescers send, in the order sent."""
    sent: list[list[str]] = []
    real = _coalesce.decide_batch

    def spy(store: EpochStore, requests: list[TickRequest]) -> list[object]:
        sent.append([r.pipeline_id for r in requests])
        return real(store, requests)  # type: ignore[return-value]

    monkeypatch.setattr(_coalesce, "decide_batch", spy)
    return sent


async def test_a_batch_reports_what_the_triggers_would_read_one_by_one(store: EpochStore) -> None:
    running(store, "seen", "unseen", "quiet", stages=STAGES)
    coalescer = TickCoalescer.for_store(store)
    first = await coalescer.tick(TickRequest("seen", POLICY))
    assert first.started is not None
    for stage, align in zip(STAGES, (12.5, 40.0), strict=True):
        store.ack_epoch("seen", first.started.epoch, stage, alignment_ms=align)
    other = store.trigger_tick("unseen", POLICY, triggered_by="another triggerer")  # an epoch this one did not start
    assert other.started is not None
    seen, unseen, quiet = await asyncio.gather(
        coalescer.tick(TickRequest("seen", POLICY, watch=(first.started.epoch,))),
        coalescer.tick(TickRequest("unseen", POLICY)),
        coalescer.tick(TickRequest("quiet", POLICY, watch=(7,))))
    assert all(r.report is not None for r in (seen, unseen, quiet))
    assert seen.report is not None and [e.epoch for e in seen.ended] == [first.started.epoch]
    # an epoch ended: the metrics' heartbeat age is measured now
    assert seen.report.heartbeat_at == store.get_pipeline("seen").heartbeat_at is not None
    assert seen.report.alignment_ms == {first.started.epoch: slowest_alignment(store.acks("seen", first.started.epoch))}
    assert seen.report.alignment_ms == {first.started.epoch: 40.0}
    assert unseen.decision.action is TriggerAction.WAIT_IN_FLIGHT and unseen.report is not None
    assert unseen.report.in_flight == store.get_epoch("unseen", other.started.epoch)
    assert unseen.report.in_flight.triggered_by == "another triggerer"
    assert quiet.report is not None and quiet.report.in_flight is None and quiet.report.alignment_ms == {}
    assert quiet.report.heartbeat_at is None  # nothing ended: nothing to measure
    # the report's reads ran in autocommit: the pooled connections are back to transactions (the
    # ticks' row locks depend on it)
    assert store._pool.idle > 0 and not any(conn.autocommit for conn in store._pool._idle)


async def test_a_trigger_cancelled_before_its_batch_left_is_never_sent(store: EpochStore,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    sent = record_batches(monkeypatch)
    pids = ["a", "b", "c"]
    running(store, *pids, stages=STAGES)
    coalescer = TickCoalescer(store, asyncio.get_running_loop(), max_concurrent=1)  # one batch, not one per slot
    tasks = {pid: asyncio.create_task(coalescer.tick(TickRequest(pid, POLICY))) for pid in pids}
    # this task resumes after the three ticks were queued and before the batch leaves (call_soon order)
    await asyncio.sleep(0)
    tasks["b"].cancel()
    done = await asyncio.gather(*tasks.values(), return_exceptions=True)
    assert isinstance(done[1], asyncio.CancelledError)
    assert all(isinstance(r, TickResult) and r.started is not None for r in (done[0], done[2]))
    coalescer.close()
    assert sent == [["a", "c"]]
    assert store.list_epochs("b") == [] and coalescer.ticks == 2


async def test_a_trigger_cancelled_while_its_row_is_locked_is_not_asked_for_again(
        store: EpochStore, migrated_dsn: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_coalesce, "SKIPS_BEFORE_WAITING", 10**6)  # keep skipping while the row is held
    sent = record_batches(monkeypatch)
    running(store, "busy", "free", stages=STAGES)
    coalescer = TickCoalescer.for_store(store)
    holder = psycopg2.connect(migrated_dsn)
    try:
        with holder.cursor() as cur:  # e.g. a cleanup in the middle of its transaction
            cur.execute("SELECT 1 FROM arroyo_pipelines WHERE pipeline_id = 'busy' FOR UPDATE")
        busy = asyncio.create_task(coalescer.tick(TickRequest("busy", POLICY)))
        free = await coalescer.tick(TickRequest("free", POLICY))
        assert free.started is not None  # the busy pipeline held back only itself
        while sum(b == ["busy"] for b in sent) < 2:  # skipped, asked again, skipped again...
            await asyncio.sleep(0.005)
        busy.cancel()
        with pytest.raises(asyncio.CancelledError):
            await busy
        await asyncio.sleep(5 * _coalesce.RETRY_SKIPPED)  # a pending retry finds it cancelled
        while coalescer.running:  # a batch still in the database skips the row: let it end first
            await asyncio.sleep(0.005)
        asked = len(sent)
        holder.rollback()  # the row is free: a tick still asked for would now start an epoch
        await asyncio.sleep(5 * _coalesce.RETRY_SKIPPED)
        assert len(sent) == asked
        assert store.list_epochs("busy") == []
    finally:
        holder.close()


async def test_ticks_are_served_in_the_order_asked_and_a_repeat_waits_for_the_next_batch(
        store: EpochStore, monkeypatch: pytest.MonkeyPatch) -> None:
    sent = record_batches(monkeypatch)
    monkeypatch.setattr(_coalesce, "LONG_QUEUE_BATCHES", 0)  # the order of one slot's batches, one after the other
    pids = [f"p{i:02d}" for i in range(10)]
    running(store, *pids, stages=STAGES)
    coalescer = TickCoalescer(store, asyncio.get_running_loop(), max_batch=4, max_concurrent=1)
    try:
        order = ["p00", "p01", "p00", "p02", "p03", "p04", "p00", *pids[5:]]
        results = await asyncio.gather(*(coalescer.tick(TickRequest(pid, POLICY)) for pid in order))
    finally:
        coalescer.close()
    # first asked, first served; a pipeline once per batch, its repeat first in line for the next
    assert sent == [["p00", "p01", "p02", "p03"], ["p00", "p04", "p05", "p06"], ["p00", "p07", "p08", "p09"]]
    start, wait = TriggerAction.START, TriggerAction.WAIT_IN_FLIGHT
    assert [r.decision.action for r in results] == [start, start, wait, start, start, start, wait, *[start] * 5]


async def test_a_cleanup_holds_back_its_pipeline_not_the_batch(store: EpochStore) -> None:
    pids = ["leased", "free-1", "free-2"]
    running(store, *pids, stages=STAGES)
    run = store.acquire_cleanup_lock("leased", "retention@w1", ttl=600)
    coalescer = TickCoalescer.for_store(store)
    leased, *free = await asyncio.gather(*(coalescer.tick(TickRequest(pid, POLICY)) for pid in pids))
    assert leased.decision.action is TriggerAction.WAIT_CLEANUP and leased.started is None
    assert all(r.started is not None for r in free)
    assert store.list_epochs("leased") == []
    store.release_cleanup_lock("leased", run.id)
    again = await coalescer.tick(TickRequest("leased", POLICY))
    assert again.started is not None


def waiting_for_a_lock(dsn: str) -> bool:
    """Whether a session waits for a lock now (read afresh: a transaction sees one snapshot of the activity)."""
    conn = psycopg2.connect(dsn)
    try:
        conn.autocommit = True
        with conn.cursor() as cur:
            cur.execute("SELECT count(*) FROM pg_locks WHERE NOT granted")
            row = cur.fetchone()
        return bool(row and row[0])
    finally:
        conn.close()


async def test_a_tick_waiting_for_a_held_row_holds_back_no_other_tick(store: EpochStore, migrated_dsn: str) -> None:
    """One batch of ticks is in the database at a time; a tick that waits for its row's lock (after
    SKIPS_BEFORE_WAITING skips) waits in a batch of its own beside it, so the other pipelines' ticks go on."""
    running(store, "held", "free-1", "free-2", stages=STAGES)
    holder = psycopg2.connect(migrated_dsn)  # another transaction holds the row (a long one)
    try:
        with holder.cursor() as cur:
            cur.execute("SELECT 1 FROM arroyo_pipelines WHERE pipeline_id = 'held' FOR UPDATE")
        coalescer = TickCoalescer.for_store(store)
        assert coalescer.max_concurrent == 1
        held = asyncio.create_task(coalescer.tick(TickRequest("held", POLICY)))
        deadline = time.monotonic() + 10
        while not waiting_for_a_lock(migrated_dsn):  # its skips are over: its batch waits for the row
            assert time.monotonic() < deadline and not held.done()
            await asyncio.sleep(0.01)
        for pid in ("free-1", "free-2"):  # two batches, one after the other, while it waits
            result = await asyncio.wait_for(coalescer.tick(TickRequest(pid, POLICY)), timeout=10)
            assert result.started is not None
        assert not held.done()
    finally:
        holder.rollback()
        holder.close()
    assert (await asyncio.wait_for(held, timeout=10)).started is not None


async def test_a_batch_whose_report_is_being_read_holds_back_no_next_batch(store: EpochStore,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch's slot is free once its ticks committed: while its report is read (after the commit, outside the
    row locks), the next batch decides and commits; each trigger still gets its result with its report."""
    running(store, "first", "second", stages=STAGES)
    reading, release = threading.Event(), threading.Event()
    real = _batch.read_reports

    def slow(on: EpochStore, requests: list[TickRequest], results: list[object]) -> list[object]:
        if any(r.pipeline_id == "first" for r in requests):
            reading.set()
            assert release.wait(30)
        return real(on, requests, results)  # type: ignore[arg-type,return-value]

    monkeypatch.setattr(_batch, "read_reports", slow)
    coalescer = TickCoalescer(store, asyncio.get_running_loop(), max_concurrent=1)
    first = asyncio.create_task(coalescer.tick(TickRequest("first", POLICY)))
    try:
        deadline = time.monotonic() + 10
        while not reading.is_set():
            assert time.monotonic() < deadline and not first.done()
            await asyncio.sleep(0.01)
        assert [e.epoch for e in store.list_epochs("first")] == [1]  # committed, its report not read yet
        second = asyncio.create_task(coalescer.tick(TickRequest("second", POLICY)))
        while not store.list_epochs("second"):
            assert time.monotonic() < deadline, "the next batch waited for the previous batch's report"
            await asyncio.sleep(0.01)
        assert not first.done()
    finally:
        release.set()
    done = await asyncio.wait_for(asyncio.gather(first, second), timeout=10)
    assert all(r.started is not None and r.started.epoch == 1 and r.report is not None for r in done)
    assert coalescer.batches == 2 and coalescer.ticks == 2
    coalescer.close()


async def test_a_second_batch_goes_only_while_a_full_batch_of_ticks_waits(store: EpochStore,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """LONG_QUEUE_BATCHES: behind the schedule (a full batch of ticks queued), more batches go beside the one in the
    database; with fewer queued, they wait for it (one larger batch costs less than several small ones)."""
    monkeypatch.setattr(_coalesce, "LONG_QUEUE_BATCHES", 1)
    pids = [f"p{i:02d}" for i in range(9)]
    running(store, *pids, stages=STAGES)
    entered: list[list[str]] = []
    inside, most = [0], [0]
    first_in, release = threading.Event(), threading.Event()
    lock = threading.Lock()
    real = _coalesce.decide_batch

    def held(on: EpochStore, requests: list[TickRequest]) -> list[object]:
        with lock:
            entered.append([r.pipeline_id for r in requests])
            inside[0] += 1
            most[0] = max(most[0], inside[0])
        try:
            if requests[0].pipeline_id == "p00":  # the first batch stays in the database until released
                first_in.set()
                assert release.wait(30)
            return real(on, requests)  # type: ignore[return-value]
        finally:
            with lock:
                inside[0] -= 1

    monkeypatch.setattr(_coalesce, "decide_batch", held)
    coalescer = TickCoalescer(store, asyncio.get_running_loop(), max_batch=4, max_concurrent=1)
    try:
        first = asyncio.create_task(coalescer.tick(TickRequest("p00", POLICY)))
        deadline = time.monotonic() + 10
        while not first_in.is_set():
            assert time.monotonic() < deadline and not first.done()
            await asyncio.sleep(0.01)
        short = [asyncio.create_task(coalescer.tick(TickRequest(p, POLICY))) for p in pids[1:4]]
        for _ in range(5):  # the turns of the loop in which a batch would be launched
            await asyncio.sleep(0)
        assert entered == [["p00"]], "a second batch went for a queue shorter than a batch"
        long = [asyncio.create_task(coalescer.tick(TickRequest(p, POLICY))) for p in pids[4:]]
        while len(entered) < 3:
            assert time.monotonic() < deadline, f"no full batches went beside the held one: {entered}"
            await asyncio.sleep(0.01)
        assert entered[1:] == [pids[1:5], pids[5:9]] and not first.done()
        release.set()
        results = await asyncio.wait_for(asyncio.gather(first, *short, *long), timeout=10)
    finally:
        release.set()
        coalescer.close()
    assert all(r.started is not None and r.started.epoch == 1 for r in results)
    assert most[0] == 2


def test_two_triggerers_coalescers_never_put_two_epochs_in_flight(store: EpochStore, migrated_dsn: str) -> None:
    """Triggerer HA through the coalescers: two event loops (threads), each with its own store (as two
    triggerer processes have), tick the same pipelines as fast as the schedule allows while a fake
    pipeline completes epochs; every epoch start is one triggerer's, never a second in flight."""
    pids = [f"p{i:02d}" for i in range(30)]
    running(store, *pids, stages=STAGES)
    policy = CheckpointPolicy(interval=0.001, timeout=60)
    stop = threading.Event()
    errors: list[BaseException] = []
    starts: list[int] = []

    async def triggerer(s: EpochStore, order: list[str]) -> None:
        coalescer = TickCoalescer.for_store(s)

        async def one(pid: str) -> None:
            while not stop.is_set():
                result = await coalescer.tick(TickRequest(pid, policy, triggered_by=f"t{id(s)}"))
                starts.append(result.started is not None)
                await asyncio.sleep(0.002)

        await asyncio.gather(*(one(pid) for pid in order))

    def run(order: list[str]) -> None:
        s = EpochStore(migrated_dsn)
        try:
            asyncio.run(triggerer(s, order))
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)
        finally:
            s.close()

    threads = [threading.Thread(target=run, args=(order,)) for order in (pids, pids[::-1])]
    for t in threads:
        t.start()
    try:
        deadline = time.monotonic() + 1.5
        while time.monotonic() < deadline:
            for ep in [e for p in pids[::3] if (e := store.in_flight_epoch(p)) is not None]:
                for stage in STAGES:
                    store.ack_epoch(ep.pipeline_id, ep.epoch, stage)
    finally:
        stop.set()
        for t in threads:
            t.join(30)
    assert errors == []
    report = check_history(migrated_dsn, pids)
    report.assert_clean()
    assert report.counts["triggered"] == sum(starts) > len(pids)
    in_flight = {p: [e.epoch for e in store.list_epochs(p, states=[EpochState.TRIGGERED])] for p in pids}
    assert all(len(v) <= 1 for v in in_flight.values())


async def test_a_copy_that_lost_the_race_follows_the_schedule_a_little_later_until_it_starts_one() -> None:
    """Triggerer HA: the copy that saw another copy start an epoch ticks ``FOLLOWER_LAG`` of the interval
    after each epoch is due (the leader has started it by then: no race for the row); it leads again as
    soon as it starts one itself. An epoch already in flight at the first tick (before a restart) does
    not make a follower. Pure: the ticks are made up, their reports carry the in-flight epochs."""

    class Stats:
        def timing(self, *args: object, **kwargs: object) -> None: ...
        def gauge(self, *args: object, **kwargs: object) -> None: ...
        def incr(self, *args: object, **kwargs: object) -> None: ...

    trigger = CheckpointTrigger("p", interval=10.0, timeout=100.0, poll_interval=20.0, triggered_by="copy")
    trigger._metrics = lambda: trigger_module.EpochMetrics("p", stats=Stats())  # type: ignore[method-assign]
    ctl = _Controller(trigger, None, _Summary(limit=10))  # type: ignore[arg-type]  # the store is never asked
    # on the pipeline's fixed-rate schedule: its points are t0 + 10 k
    t0 = schedule_point_after(datetime(2026, 1, 1, tzinfo=UTC), 10.0, schedule_phase("p", 10.0))
    lag = min(trigger_module.FOLLOWER_LAG * 10.0, trigger_module.FOLLOWER_LAG_MAX)

    def epoch(n: int, at: float, by: str = "copy") -> EpochRecord:
        return EpochRecord("p", n, EpochState.TRIGGERED, triggered_at=t0 + timedelta(seconds=at),
                           timeout_at=t0 + timedelta(seconds=at + 100), triggered_by=by)

    def done() -> tuple[EpochRecord, ...]:  # the epochs the trigger watches ended before this tick
        return tuple(replace(epoch(n, 0), state=EpochState.COMPLETED, ended_at=t0) for n in ctl.watching)

    def started(n: int, now: float) -> TickResult:
        return TickResult(TriggerDecision(TriggerAction.START, n), t0 + timedelta(seconds=now), PipelineState.RUNNING,
                          started=epoch(n, now), ended=done(), report=TickReport())

    def in_flight(n: int, at: float, now: float, by: str = "copy") -> TickResult:
        rec = epoch(n, at, by)
        return TickResult(TriggerDecision(TriggerAction.WAIT_IN_FLIGHT, n, recheck_at=rec.timeout_at),
                          t0 + timedelta(seconds=now), PipelineState.RUNNING, ended=done(),
                          report=TickReport(in_flight=rec))

    async def delay(tick: TickResult) -> float:
        await ctl._observe(tick)
        return ctl._delay(tick)

    assert await delay(in_flight(3, at=0, now=1)) == pytest.approx(9)  # from before a restart: on time
    assert await delay(started(4, now=10)) == pytest.approx(10)
    assert not ctl.follower
    # a manual checkpoint (another triggered_by) at 12 is no other copy, and does not move the schedule: next at 20
    assert await delay(in_flight(5, at=12, now=12.5, by="cli")) == pytest.approx(7.5)
    assert not ctl.follower
    # the other copy started epoch 6 (due at 20) first: follow, a lag after each due instant
    assert await delay(in_flight(6, at=20, now=20.01)) == pytest.approx(9.99 + lag)
    assert ctl.follower
    assert await delay(in_flight(7, at=30, now=30 + lag)) == pytest.approx(10)  # already lagging: due at 40 + lag
    # the leader is gone: the follower starts epoch 8 (late by the lag, once: the next is due at 50) and leads again
    assert await delay(started(8, now=40 + lag)) == pytest.approx(10 - lag)
    assert not ctl.follower


def test_a_follower_skips_only_for_a_start_heard_from_its_due_instant_and_not_across_poll() -> None:
    """The rules of a follower's skipped tick (``FOLLOWER_SKIPS``), on a made-up subscription: a start heard
    well before the due instant (a manual checkpoint) is not the leader's; a pipeline change or a failed step
    since the last tick means a tick; at most ``FOLLOWER_SKIPS`` in a row; a wait cut short by ``poll`` (an
    interval longer than it) is never followed by a skip."""

    class Heard:
        live = True

        def __init__(self) -> None:
            self.starts: list[tuple[int, float]] = []
            self.count = 0

        def changes(self) -> int:
            return self.count

        def mark(self) -> int:
            return 0

        def starts_after(self, epoch: int, heard_since: float | None = None) -> list[int]:
            return sorted(n for n, at in self.starts if n > epoch and (heard_since is None or at >= heard_since))

    def follower(poll: float) -> tuple[_Controller, Heard]:
        trigger = CheckpointTrigger("p", interval=10.0, timeout=100.0, poll_interval=poll, triggered_by="copy")
        ctl = _Controller(trigger, None, _Summary(limit=10))  # type: ignore[arg-type]  # the store is never asked
        sub = Heard()
        ctl.sub = sub  # type: ignore[assignment]
        ctl.follower, ctl.known = True, 5
        return ctl, sub

    ctl, sub = follower(poll=20.0)
    lag = ctl._lag
    assert lag == trigger_module.FOLLOWER_LAG_MAX  # 20 % of 10 s, at most 1 s
    # a follower's wait for the schedule (due 9 s after its tick) is not cut by poll: it may skip the next tick
    now = datetime(2026, 1, 1, tzinfo=UTC)
    wait = TickResult(TriggerDecision(TriggerAction.WAIT_SCHEDULE, recheck_at=now + timedelta(seconds=9)), now,
                      PipelineState.RUNNING, observed_at=time.monotonic())
    assert ctl._delay(wait) == pytest.approx(9 + lag, abs=0.05) and ctl.may_skip
    due = ctl.follow_due - lag
    sub.starts.append((6, due - 5))  # a manual checkpoint, heard 5 s before the due instant
    assert not ctl._skip()
    sub.starts.append((7, due + 0.01))  # the leader's start
    assert ctl._skip() and ctl.known == 7 and {6, 7} <= ctl.watching
    assert ctl._skipped_delay() == pytest.approx(ctl.follow_due - time.monotonic())
    assert ctl.follow_due - lag == pytest.approx(due + 10)  # the next due instant
    assert not ctl._skip()  # nothing heard since: tick
    sub.starts.append((8, ctl.follow_due - lag))
    sub.count += 1  # the pipeline changed since the last tick: tick
    assert not ctl._skip()
    sub.count -= 1
    ctl.outage_since = 1.0  # the last step failed (the store unreachable): tick
    assert not ctl._skip()
    ctl.outage_since = None
    for n in range(8, 8 + trigger_module.FOLLOWER_SKIPS - 1):  # up to FOLLOWER_SKIPS in a row
        sub.starts.append((n, ctl.follow_due - lag))
        assert ctl._skip()
        ctl._skipped_delay()
    sub.starts.append((99, ctl.follow_due - lag))
    assert not ctl._skip()
    ctl._mark()  # a tick: the count starts again, and only its _delay may allow a skip
    assert ctl.skips == 0 and not ctl.may_skip

    # poll 2 s, interval 10 s: the wait is cut at poll, not at the due instant: no skip after it
    ctl, sub = follower(poll=2.0)
    assert ctl._delay(wait) == pytest.approx(2.0) and not ctl.may_skip
    sub.starts.append((6, time.monotonic()))
    assert not ctl._skip()
