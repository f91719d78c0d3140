"""The triggers of one event loop share the store's work: their due ticks go out as batches.

Every :class:`~airflow_arroyo.triggers.checkpoint.CheckpointTrigger` of a triggerer asks for its tick
through the loop's :class:`TickCoalescer`. The coalescer gathers the ticks asked for in the same turn
of the event loop (and those asked for while the previous batch was in the database), and sends them as
one :meth:`~airflow_arroyo.store.EpochStore.trigger_ticks` transaction in a worker thread of its own; once it
committed, the next batch may go, and another thread reads the batch's report
(:mod:`airflow_arroyo.store._batch`) before the triggers get their results. Under light
load a batch holds one tick and costs what a tick always cost; under heavy load the batches grow and
the cost per tick falls, where one thread-pool call and one transaction per tick used to queue up.

One batch is in the database at a time (``MAX_CONCURRENT``): a batch's cost is mostly per batch (its
round trips, the server's and the client's work per statement), so on a busy machine three smaller
batches in parallel cost more CPU than one larger one and made ticks later, not earlier
(``benchmarks/trigger_load.py``, docs/controller.md "Load"). A tick that must wait for its row lock
(after ``SKIPS_BEFORE_WAITING`` skips) goes in a batch of its own, alone, beside it (``MAX_WAITING`` of
those), so that a row held for long holds back only the tick waiting for it. While a full batch of ticks or more
is queued (the triggerer is behind its schedule), ``LONG_QUEUE_BATCHES`` more batches go beside the one in the
database: then the next batch's work in this process overlaps the previous one's in the server.

Safety is unchanged: each pipeline is still decided by the pure ``decide_trigger`` under its own row
lock, and the partial unique index still admits one in-flight epoch per pipeline.

* A pipeline appears once per batch (two copies of a trigger on one loop go in successive batches).
* A pipeline whose row another transaction holds (a cleanup, a driver's acknowledgement, a batch of
  another triggerer) is skipped rather than waited for, and asked for again a moment later
  (``RETRY_SKIPPED`` seconds; those transactions are short); after ``SKIPS_BEFORE_WAITING`` skips its
  batch waits for the lock. So a busy pipeline delays only itself, and two triggerers' batches do
  not queue behind each other's locks.
* A trigger cancelled while its tick waits leaves the queue: it is not sent, or (after a skip) not
  asked for again; a batch already in the database completes, and its result is dropped.
* A permanent error of a batch is retried pipeline by pipeline, so that it reaches only the trigger
  whose pipeline caused it; a transient one (after the store's retries) reaches every trigger of the
  batch, which handle it as before (retry at their next tick).
"""

from __future__ import annotations

import asyncio
import collections
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

from airflow_arroyo.core.exceptions import ArroyoError, StoreError, TransientStoreError
from airflow_arroyo.store._batch import attach_reports, decide_batch, tick_batch
from airflow_arroyo.store._sync import EpochStore
from airflow_arroyo.store.records import TickRequest, TickResult

__all__ = ["TickCoalescer"]

RETRY_SKIPPED = 0.01  # seconds before a tick whose row was locked is asked for again
SKIPS_BEFORE_WAITING = 3  # then it goes in a batch that waits for the lock
MAX_BATCH = 128  # most ticks in one batch
MAX_CONCURRENT = 1  # batches of ticks that never wait for a lock, in the database at once
# more batches that never wait, besides, while at least a full batch of ticks waits in the queue (behind on the
# schedule: the per-batch cost is then shared by full batches, and the next batch need not wait for the one before)
LONG_QUEUE_BATCHES = 1
MAX_WAITING = 2  # batches of one tick that waits for its row's lock, besides
# The batch's slot is free again once its ticks committed; its report is read after, beside the next batch,
# so the report's round trips are not in front of every next tick. True: the report is read in the slot.
REPORT_IN_SLOT = False

log = logging.getLogger(__name__)


@dataclass
class _Pending:
    request: TickRequest
    future: asyncio.Future[TickResult]
    skipped: int = 0  # batches that found the pipeline's row locked by another transaction


class TickCoalescer:
    """Batches the ticks of one event loop against one store (get it with :meth:`for_store`).

    :param max_batch: most ticks in one transaction. Default ``MAX_BATCH``.
    :param max_concurrent: batches of ticks that do not wait for locks in the database at once (each holds
        one pooled connection and one worker thread); a burst is split evenly over them. Default
        ``MAX_CONCURRENT``.
    :param max_waiting: batches of one tick waiting for its row's lock, besides. Default ``MAX_WAITING``.
    """

    def __init__(self, store: EpochStore, loop: asyncio.AbstractEventLoop, *, max_batch: int | None = None,
                 max_concurrent: int | None = None, max_waiting: int | None = None) -> None:
        self.store = store
        self.loop = loop
        self.max_batch = MAX_BATCH if max_batch is None else max_batch
        self.max_concurrent = MAX_CONCURRENT if max_concurrent is None else max_concurrent
        self.max_waiting = MAX_WAITING if max_waiting is None else max_waiting
        if self.max_concurrent < 1 or self.max_waiting < 1:
            raise ValueError("a tick coalescer needs at least one batch of each kind in flight")
        # lane False: ticks that skip locked rows; lane True: ticks that wait for their rows' locks
        self._queues: dict[bool, collections.deque[_Pending]] = {False: collections.deque(), True: collections.deque()}
        self._running_in: dict[bool, int] = {False: 0, True: 0}
        self._scheduled = False
        self._tasks: set[asyncio.Task[None]] = set()
        # the batches' own threads: they never queue behind the loop's other blocking calls
        self._executor = ThreadPoolExecutor(self.max_concurrent + self.max_waiting,
                                            thread_name_prefix="arroyo-tick-batch")
        # the reports, one at a time, in the order their batches committed (outside the batches' slots)
        self._report_executor = ThreadPoolExecutor(1, thread_name_prefix="arroyo-tick-report")
        self.batches = 0  # figures for benchmarks and tests
        self.ticks = 0
        self.skipped = 0  # ticks whose row another transaction held (asked for again)
        self.waiting_batches = 0  # batches of one tick that waited for its row's lock

    @classmethod
    def for_store(cls, store: EpochStore) -> TickCoalescer:
        """The coalescer of ``store`` on the running event loop (one per store and loop)."""
        loop = asyncio.get_running_loop()
        return store.loop_helper(loop, "tick-coalescer", lambda: cls(store, loop))

    @property
    def running(self) -> int:
        """Batches in the database now."""
        return self._running_in[False] + self._running_in[True]

    def _limit(self, waits: bool) -> int:
        if waits:
            return self.max_waiting
        return self.max_concurrent + (LONG_QUEUE_BATCHES if len(self._queues[False]) >= self.max_batch else 0)

    def close(self) -> None:
        """Let the worker threads end once their batches are done (pending batches end with their loop)."""
        self._executor.shutdown(wait=False)
        self._report_executor.shutdown(wait=False)

    async def tick(self, request: TickRequest) -> TickResult:
        """The result of ``request``'s tick, decided in the next batch."""
        future: asyncio.Future[TickResult] = self.loop.create_future()
        self._queues[False].append(_Pending(replace(request, skip_if_locked=True), future))
        self._schedule()
        return await future

    def _schedule(self) -> None:
        if not self._scheduled and any(self._queues[w] and self._running_in[w] < self._limit(w) for w in (False, True)):
            self._scheduled = True
            # not now: the other triggers woken in this turn of the loop ask for their ticks first
            self.loop.call_soon(self._launch)

    def _launch(self) -> None:
        self._scheduled = False
        for waits in (False, True):
            self._launch_lane(waits)

    def _launch_lane(self, waits: bool) -> None:
        queue, limit = self._queues[waits], self._limit(waits)
        while queue and self._running_in[waits] < limit:
            free = limit - self._running_in[waits]
            # a waiting tick waits alone: its lock wait holds back no other tick's
            size = 1 if waits else min(self.max_batch, -(-len(queue) // free))
            batch: list[_Pending] = []
            later: list[_Pending] = []
            seen: set[str] = set()
            while queue and len(batch) < size:
                pending = queue.popleft()
                if pending.future.done():  # its trigger was cancelled
                    continue
                if pending.request.pipeline_id in seen:
                    later.append(pending)  # once per batch
                    continue
                seen.add(pending.request.pipeline_id)
                batch.append(pending)
            queue.extendleft(reversed(later))
            if not batch:
                break
            self._running_in[waits] += 1
            task = self.loop.create_task(self._run(batch, waits))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            if later and len(batch) < size:
                break  # only duplicates left: they go in the next batch

    async def _run(self, batch: list[_Pending], waits: bool) -> None:
        try:
            try:
                results = await self._send([p.request for p in batch])
            finally:
                self._running_in[waits] -= 1
                self._schedule()  # a slot is free (after a failed batch too: the queued ticks go on)
            decided = self._decided(batch, results, waits)
            if decided and not REPORT_IN_SLOT:  # committed: read the report beside the next batch, not before it
                reported = await self.loop.run_in_executor(self._report_executor, attach_reports, self.store,
                                                           [p.request for p, _ in decided], [r for _, r in decided])
                decided = list(zip([p for p, _ in decided], reported, strict=True))
        except BaseException as exc:  # not the store's (a bug, the loop closing): no trigger waits forever
            for pending in batch:
                if pending.future.done():
                    continue
                if isinstance(exc, asyncio.CancelledError):
                    pending.future.cancel()
                else:
                    pending.future.set_exception(exc)
            raise
        for pending, result in decided:
            if pending.future.done():
                continue
            if isinstance(result, BaseException):
                pending.future.set_exception(result)
            elif result is not None:  # a decided tick (skipped ones are asked for again by _decided)
                pending.future.set_result(result)

    def _decided(self, batch: list[_Pending], results: list[TickResult | ArroyoError | None], waits: bool
                 ) -> list[tuple[_Pending, TickResult | ArroyoError | None]]:
        """Count a batch that came back, ask again at once for the ticks whose rows were held, and return the
        others with their results."""
        self.batches += 1
        self.waiting_batches += waits
        retry: list[_Pending] = []
        decided: list[tuple[_Pending, TickResult | ArroyoError | None]] = []
        for pending, result in zip(batch, results, strict=True):
            if result is None:  # its row was locked by another transaction: again in a moment
                pending.skipped += 1
                self.skipped += 1
                if pending.skipped >= SKIPS_BEFORE_WAITING:
                    pending.request = replace(pending.request, skip_if_locked=False)
                retry.append(pending)
                continue
            self.ticks += 1
            decided.append((pending, result))
        if retry:
            self.loop.call_later(RETRY_SKIPPED, self._requeue, retry)
        self._schedule()
        return decided

    def _requeue(self, retry: list[_Pending]) -> None:
        for waits in (False, True):  # each at the head of its lane, in the order they were asked for
            self._queues[waits].extendleft(reversed([p for p in retry if p.request.skip_if_locked is not waits]))
        self._schedule()

    async def _send(self, requests: list[TickRequest]) -> list[TickResult | ArroyoError | None]:
        try:
            work = tick_batch if REPORT_IN_SLOT else decide_batch
            return await self.loop.run_in_executor(self._executor, work, self.store, requests)
        except TransientStoreError as exc:
            return [exc] * len(requests)
        except StoreError as exc:
            if len(requests) == 1:
                return [exc]
            log.warning("epoch store: a batch of %s ticks failed (%s); ticking them one by one", len(requests), exc)
            return await self.loop.run_in_executor(self._executor, self._one_by_one, requests)

    def _one_by_one(self, requests: list[TickRequest]) -> list[TickResult | ArroyoError | None]:
        out: list[TickResult | ArroyoError | None] = []
        for request in requests:
            try:
                out.extend((tick_batch if REPORT_IN_SLOT else decide_batch)(self.store, [request]))
            except ArroyoError as exc:
                out.append(exc)
        return out
