"""The triggers of one event loop share the store's work, in real time against a real PostgreSQL.

* the coalescer: many triggers' ticks go out in fewer transactions, each gets its own result, and a
  permanent error of one pipeline reaches only its trigger;
* the listener: a trigger waiting for an overdue epoch wakes when the database announces its end
  (not by polling), an end committed while the tick was in flight is not missed, other pipelines'
  announcements do not wake it, and it survives a PostgreSQL restart (polling meanwhile);
* triggerer HA: a copy that follows another skips the ticks whose epochs it heard the leader start, and
  takes over when the leader is gone;
* the driver's EpochWatch: wakes on an epoch start, polls when it cannot listen.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from typing import Any

import psycopg2
import pytest

from airflow_arroyo.core.epochs import CheckpointPolicy, PipelineState, TriggerAction
from airflow_arroyo.core.exceptions import StoreError
from airflow_arroyo.devtools.postgres import ThrowawayPostgres
from airflow_arroyo.store import AsyncEpochStore, EpochStore, EpochWatch, TickResult
from airflow_arroyo.store._coalesce import TickCoalescer
from airflow_arroyo.triggers import checkpoint as trigger_module
from airflow_arroyo.triggers.checkpoint import CheckpointTrigger
from tests.support import running

pytestmark = pytest.mark.timeout(120)
STAGES = ["source", "sink"]
POLICY = CheckpointPolicy(interval=3600, timeout=7200)


def ack_all(store: EpochStore, pid: str) -> int | None:
    ep = store.in_flight_epoch(pid)
    if ep is None:
        return None
    for stage in ep.stages:
        store.ack_epoch(pid, ep.epoch, stage)
    return ep.epoch


# --------------------------------------------------------------------------- the coalescer


async def test_many_triggers_ticks_go_out_in_few_transactions(store: EpochStore) -> None:
    pids = [f"p{i:02d}" for i in range(30)]
    running(store, *pids, stages=STAGES)
    astore = AsyncEpochStore(store)
    results = await asyncio.gather(*(astore.trigger_tick(pid, POLICY, triggered_by=f"t-{pid}") for pid in pids))
    coalescer = TickCoalescer.for_store(store)
    assert coalescer.ticks == 30
    # asked for in one turn of the loop: one batch per free slot at most
    assert coalescer.batches <= coalescer.max_concurrent < 30
    for pid, result in zip(pids, results, strict=True):
        assert result.started is not None and result.started.pipeline_id == pid
        assert result.started.triggered_by == f"t-{pid}"
    # a second tick of each: the epochs are in flight
    again = await asyncio.gather(*(astore.trigger_tick(pid, POLICY) for pid in pids))
    assert {r.decision.action for r in again} == {TriggerAction.WAIT_IN_FLIGHT}


async def test_a_permanent_error_reaches_only_the_trigger_whose_pipeline_caused_it(store: EpochStore) -> None:
    running(store, "fine-1", "broken", "fine-2", stages=STAGES)
    astore = AsyncEpochStore(store)
    # a timeout the database cannot add to a timestamp: the batch's INSERT fails for everybody
    absurd = CheckpointPolicy(interval=1.0, timeout=1e15)
    results = await asyncio.gather(astore.trigger_tick("fine-1", POLICY), astore.trigger_tick("broken", absurd),
                                   astore.trigger_tick("fine-2", POLICY), return_exceptions=True)
    fine_1, broken, fine_2 = results
    assert isinstance(broken, StoreError)
    assert isinstance(fine_1, TickResult) and fine_1.started is not None
    assert isinstance(fine_2, TickResult) and fine_2.started is not None
    assert store.in_flight_epoch("broken") is None


# --------------------------------------------------------------------------- the listener


async def test_a_subscription_wakes_on_its_pipelines_epoch_end_only(store: EpochStore) -> None:
    running(store, "mine", "other", stages=STAGES)
    astore = AsyncEpochStore(store)
    mine = await astore.subscribe("mine")
    assert mine is not None and mine.live
    try:
        for pid in ("mine", "other"):
            await astore.trigger_tick(pid, POLICY)
        mark = mine.mark()
        await asyncio.to_thread(ack_all, store, "other")
        assert await mine.wait(mark, 0.3) is False  # another pipeline's end does not wake it
        # an end committed after the mark (while a tick would be in flight) ends the wait at once
        await asyncio.to_thread(ack_all, store, "mine")
        t0 = time.monotonic()
        while mine.mark() == mark and time.monotonic() - t0 < 5:
            await asyncio.sleep(0.01)
        assert await mine.wait(mark, 5.0) is True
        assert time.monotonic() - t0 < 2.0
        # an epoch start is no reason to wake a trigger; a follower hears it (once it listens to starts)
        mark, changes = mine.mark(), mine.changes()
        forced = await astore.trigger_tick("mine", POLICY, force=True)
        assert forced.started is not None
        assert await mine.wait(mark, 0.3) is False
        assert mine.starts_after(0) == []  # not listening to starts
        mine.follow_starts(True)
        while len(mine.listener._listening) < 2:  # the LISTEN is in effect
            await asyncio.sleep(0.01)
        mark = mine.mark()
        await asyncio.to_thread(ack_all, store, "mine")
        assert await mine.wait(mark, 5.0) is True  # its end
        mark = mine.mark()
        again = await astore.trigger_tick("mine", POLICY, force=True)
        assert again.started is not None and again.last_epoch == again.started.epoch
        t0 = time.monotonic()
        while not mine.starts_after(forced.started.epoch) and time.monotonic() - t0 < 5:
            await asyncio.sleep(0.01)
        assert mine.starts_after(forced.started.epoch) == [again.started.epoch]
        assert mine.starts_after(again.started.epoch) == []
        assert await mine.wait(mark, 0.3) is False and mine.changes() == changes  # heard, not woken
        # a change of the pipeline is a wake-up, and a change
        await asyncio.to_thread(store.request_stop, "mine")
        assert await mine.wait(mark, 5.0) is True
        t0 = time.monotonic()
        while mine.changes() == changes and time.monotonic() - t0 < 5:
            await asyncio.sleep(0.01)
        assert mine.changes() == changes + 1
    finally:
        mine.close()


@pytest.mark.usefixtures("migrated_dsn")
async def test_an_overdue_epoch_wakes_the_trigger_when_it_ends(store: EpochStore,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Epochs overrun their interval (0.1 s) by 0.4 s: the trigger learns each end from the database's
    announcement, about one tick at the due time and one at the end, and starts the next epoch at once."""
    monkeypatch.setattr(trigger_module, "WAKE_ON_NOTIFY", True)
    running(store, "slow", stages=STAGES)
    stop = threading.Event()

    def pipeline() -> None:  # acknowledges every epoch 0.5 s after it started; stops after 5 epochs
        while not stop.is_set():
            ep = store.in_flight_epoch("slow")
            if ep is not None and (store.db_now() - ep.triggered_at).total_seconds() >= 0.5:
                if ep.epoch >= 5:
                    store.request_stop("slow", "immediate")  # no epoch after this one
                ack_all(store, "slow")
                if ep.epoch >= 5:
                    store.set_pipeline_state("slow", PipelineState.STOPPED)
                    return
            stop.wait(0.01)

    ticks: list[TickResult] = []

    class Counting(AsyncEpochStore):
        async def trigger_tick(self, *args: Any, **kwargs: Any) -> TickResult:
            result = await super().trigger_tick(*args, **kwargs)
            ticks.append(result)
            return result

    trigger = CheckpointTrigger("slow", interval=0.1, timeout=30, poll_interval=5.0)

    async def open_store() -> AsyncEpochStore:
        return Counting(store)

    trigger._open_store = open_store  # type: ignore[method-assign]
    thread = threading.Thread(target=pipeline)
    thread.start()
    try:
        gen = trigger.run()
        event = await asyncio.wait_for(anext(gen), 30)
        await gen.aclose()
    finally:
        stop.set()
        thread.join(10)
    assert event.payload["status"] == "success"
    epochs = store.list_epochs("slow")[::-1]
    assert [e.state.value for e in epochs] == ["completed"] * 5
    # without the wake-up a 5 s poll would follow each overdue tick
    gaps = [(b.triggered_at - a.ended_at).total_seconds() for a, b in itertools.pairwise(epochs) if a.ended_at]
    assert max(gaps) < 1.0, gaps
    starts = sum(t.started is not None for t in ticks)
    assert starts == 5 and len(ticks) <= 3 * starts + 2, [t.decision.action.value for t in ticks]


async def test_the_listener_survives_a_server_restart(private_pg: ThrowawayPostgres) -> None:
    store = EpochStore(private_pg.dsn, retry_seconds=20)
    store.migrate()
    running(store, "p", stages=STAGES)
    astore = AsyncEpochStore(store)
    sub = await astore.subscribe("p")
    assert sub is not None
    try:
        assert sub.live
        mark = sub.mark()
        await asyncio.to_thread(private_pg.restart)
        t0 = time.monotonic()
        # the lost connection wakes the waiter (announcements may be lost: read the tables), then it listens again
        assert await sub.wait(mark, 10.0) is True
        while not sub.live and time.monotonic() - t0 < 20:
            await asyncio.sleep(0.05)
        assert sub.live
        await astore.trigger_tick("p", POLICY)
        mark = sub.mark()
        await asyncio.to_thread(ack_all, store, "p")
        assert await sub.wait(mark, 5.0) is True
    finally:
        sub.close()
        store.close()


# --------------------------------------------------------------------------- triggerer HA


@pytest.mark.parametrize("leader_dies", [False, True], ids=["both-live", "leader-dies"])
async def test_a_follower_skips_the_ticks_whose_epochs_it_heard_the_leader_start(
        store: EpochStore, migrated_dsn: str, monkeypatch: pytest.MonkeyPatch, leader_dies: bool) -> None:
    """Two copies of one trigger (triggerer HA) on one loop, a pipeline acknowledging each epoch at once:
    the copy that follows hears the leader's starts and ticks about once per ``FOLLOWER_SKIPS + 1``
    epochs instead of once per epoch; the history has one epoch in flight at most. When the leader is
    cancelled (its triggerer died) the follower hears no start, ticks, and keeps the schedule."""
    from airflow_arroyo.devtools.history import check_history

    monkeypatch.setattr(trigger_module, "WAKE_ON_NOTIFY", True)
    skips = trigger_module.FOLLOWER_SKIPS
    assert skips >= 2
    epochs_wanted, interval = 24, 0.25
    running(store, "ha", stages=STAGES)
    stop = threading.Event()

    def pipeline() -> None:  # acknowledges every epoch as soon as it sees it; stops after the last
        while not stop.is_set():
            epoch = ack_all(store, "ha")
            if epoch is not None and epoch >= epochs_wanted:
                store.request_stop("ha", "immediate")
                store.set_pipeline_state("ha", PipelineState.STOPPED)
                return
            stop.wait(0.005)

    ticks: dict[str, list[TickResult]] = {"a": [], "b": []}

    def copy(name: str) -> CheckpointTrigger:
        class Counting(AsyncEpochStore):
            async def trigger_tick(self, *args: Any, **kwargs: Any) -> TickResult:
                result = await super().trigger_tick(*args, **kwargs)
                ticks[name].append(result)
                return result

        async def open_store() -> AsyncEpochStore:
            return Counting(store)

        trigger = CheckpointTrigger("ha", interval=interval, timeout=30, triggered_by="copy")
        trigger._open_store = open_store  # type: ignore[method-assign]
        return trigger

    async def first_event(trigger: CheckpointTrigger) -> Any:
        gen = trigger.run()
        try:
            return await anext(gen)
        finally:
            await gen.aclose()

    def started(name: str) -> int:
        return sum(t.started is not None for t in ticks[name])

    thread = threading.Thread(target=pipeline)
    thread.start()
    try:
        a, b = (asyncio.create_task(first_event(copy(n))) for n in ("a", "b"))
        killed = None
        if leader_dies:
            while store.in_flight_epoch("ha") is None or max(e.epoch for e in store.list_epochs("ha")) < 8:
                await asyncio.sleep(0.01)
            killed, survivor = (a, b) if started("a") >= started("b") else (b, a)
            killed.cancel()
            events = [await asyncio.wait_for(survivor, 60)]
        else:
            events = list(await asyncio.wait_for(asyncio.gather(a, b), 60))
    finally:
        stop.set()
        thread.join(10)
    assert [e.payload["status"] for e in events] == ["success"] * len(events)
    check_history(migrated_dsn, ["ha"]).assert_clean()
    epochs = store.list_epochs("ha")[::-1]
    assert [e.epoch for e in epochs] == list(range(1, epochs_wanted + 1))
    assert {e.state.value for e in epochs} == {"completed"}
    if leader_dies:
        # the survivor started every epoch after the death, on schedule: no gap of more than an interval and a lag
        late = [e for e in epochs if e.epoch > 9]
        gaps = [(b.triggered_at - a.triggered_at).total_seconds() for a, b in itertools.pairwise(late)]
        assert max(gaps) < interval * 3, gaps
        return
    leader, follower = sorted(ticks, key=started, reverse=True)
    # the epochs it heard starting, the follower watched: its summary has them though it ticked for few
    # (all but those that started and ended before it followed)
    assert min(e.payload["summary"]["completed"] for e in events) >= epochs_wanted // 2
    # without skips a follower ticks once per epoch (as many ticks as the leader); with them about once
    # per FOLLOWER_SKIPS + 1 epochs, plus its first ticks and one when the pipeline stops
    assert len(ticks[follower]) <= epochs_wanted / (skips + 1) + 6, (len(ticks[leader]), len(ticks[follower]))
    assert len(ticks[leader]) >= epochs_wanted - started(follower)


# --------------------------------------------------------------------------- the driver's watch


def test_a_drivers_watch_wakes_on_an_epoch_start_and_polls_when_it_cannot_listen(store: EpochStore) -> None:
    running(store, "p", stages=STAGES)
    watch = EpochWatch(store, "p")
    try:
        assert watch.wait(0.05) is True  # the first call: read the store (nothing was heard before)
        assert watch.wait(0.05) is False  # nothing happened
        threading.Timer(0.1, lambda: store.trigger_tick("p", POLICY)).start()
        t0 = time.monotonic()
        assert watch.wait(5.0) is True
        assert time.monotonic() - t0 < 2.0
    finally:
        watch.close()

    conn = psycopg2.connect(store.dsn)
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT port FROM (SELECT setting::int AS port FROM pg_settings WHERE name = 'port') s")
            (port,) = cur.fetchone()  # type: ignore[misc]
    finally:
        conn.close()
    unreachable = EpochStore(store.dsn.replace(f":{port}/", ":1/"))
    waited: list[float] = []
    blind = EpochWatch(unreachable, "p", idle=waited.append)
    assert blind.wait(0.15) is True and blind.wait(0.15) is True  # polls: the caller reads every time
    assert waited == [0.15, 0.15] and not blind.live
