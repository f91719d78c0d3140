"""The triggers of one event loop share the store's work: their due ticks go out as batches.

Every :class:`~airflow_arroyo.triggers.checkpoint.CheckpointTrigger` of a triggerer asks for its tick
through the loop's :class:`TickCoalescer`. The coalescer gathers the ticks asked for in the same turn
of the event loop (and those asked for while earlier batches were in the database), and sends them as
one :meth:`~airflow_arroyo.store.EpochStore.trigger_ticks` transaction, followed by one read of the
batch's report (:mod:`airflow_arroyo.store._batch`), in a worker thread of its own. Under light
load a batch holds one tick and costs what a tick always cost; under heavy load the batches grow and
the cost per tick falls, where one thread-pool call and one transaction per tick used to queue up.

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

from airflow_arroyo.exceptions import ArroyoError, StoreError, TransientStoreError
from airflow_arroyo.store._batch import tick_batch
from airflow_arroyo.store._sync import EpochStore
from airflow_arroyo.store.records import TickRequest, TickResult

__all__ = ["TickCoalescer"]

RETRY_SKIPPED = 0.01  # seconds before a tick whose row was locked is asked for again
SKIPS_BEFORE_WAITING = 3  # then its batch waits for the lock

log = logging.getLogger(__name__)


@dataclass
class _Pending:
    request: TickRequest
    future: asyncio.Future[TickResult]
    skipped: int = 0  # batches that found the pipeline's row locked by another transaction


class TickCoalescer:
    """Batches the ticks of one event loop against one store (get it with :meth:`for_store`).

    :param max_batch: most ticks in one transaction.
    :param max_concurrent: batches in the database at once (each holds one pooled connection and
        one worker thread); a burst is split evenly over them.
    """

    def __init__(self, store: EpochStore, loop: asyncio.AbstractEventLoop, *, max_batch: int = 128,
                 max_concurrent: int = 3) -> None:
        self.store = store
        self.loop = loop
        self.max_batch = max_batch
        self.max_concurrent = max_concurrent
        self._queue: collections.deque[_Pending] = collections.deque()
        self._running = 0
        self._scheduled = False
        self._tasks: set[asyncio.Task[None]] = set()
        # the batches' own threads: they never queue behind the loop's other blocking calls
        self._executor = ThreadPoolExecutor(max_concurrent, thread_name_prefix="arroyo-tick-batch")
        self.batches = 0  # figures for benchmarks and tests
        self.ticks = 0

    @classmethod
    def for_store(cls, store: EpochStore) -> TickCoalescer:
        """The coalescer of ``store`` on the running event loop (one per store and loop)."""
        loop = asyncio.get_running_loop()
        return store.loop_helper(loop, "tick-coalescer", lambda: cls(store, loop))

    @property
    def running(self) -> int:
        """Batches in the database now."""
        return self._running

    def close(self) -> None:
        """Let the worker threads end once their batches are done (pending batches end with their loop)."""
        self._executor.shutdown(wait=False)

    async def tick(self, request: TickRequest) -> TickResult:
        """The result of ``request``'s tick, decided in the next batch."""
        future: asyncio.Future[TickResult] = self.loop.create_future()
        self._queue.append(_Pending(replace(request, skip_if_locked=True), future))
        self._schedule()
        return await future

    def _schedule(self) -> None:
        if not self._scheduled and self._queue and self._running < self.max_concurrent:
            self._scheduled = True
            # not now: the other triggers woken in this turn of the loop ask for their ticks first
            self.loop.call_soon(self._launch)

    def _launch(self) -> None:
        self._scheduled = False
        while self._queue and self._running < self.max_concurrent:
            free = self.max_concurrent - self._running
            size = min(self.max_batch, -(-len(self._queue) // free))
            batch: list[_Pending] = []
            later: list[_Pending] = []
            seen: set[str] = set()
            while self._queue and len(batch) < size:
                pending = self._queue.popleft()
                if pending.future.done():  # its trigger was cancelled
                    continue
                if pending.request.pipeline_id in seen:
                    later.append(pending)  # once per batch
                    continue
                seen.add(pending.request.pipeline_id)
                batch.append(pending)
            self._queue.extendleft(reversed(later))
            if not batch:
                break
            self._running += 1
            task = self.loop.create_task(self._run(batch))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            if later and len(batch) < size:
                break  # only duplicates left: they go in the next batch

    async def _run(self, batch: list[_Pending]) -> None:
        try:
            results = await self._send([p.request for p in batch])
        except BaseException as exc:  # not the store's (a bug, the loop closing): no trigger waits forever
            for pending in batch:
                if pending.future.done():
                    continue
                if isinstance(exc, asyncio.CancelledError):
                    pending.future.cancel()
                else:
                    pending.future.set_exception(exc)
            raise
        finally:
            self._running -= 1
        self.batches += 1
        retry: list[_Pending] = []
        for pending, result in zip(batch, results, strict=True):
            if result is None:  # its row was locked by another transaction: again in a moment
                pending.skipped += 1
                if pending.skipped >= SKIPS_BEFORE_WAITING:
                    pending.request = replace(pending.request, skip_if_locked=False)
                retry.append(pending)
                continue
            self.ticks += 1
            if pending.future.done():
                continue
            if isinstance(result, BaseException):
                pending.future.set_exception(result)
            else:
                pending.future.set_result(result)
        if retry:
            self.loop.call_later(RETRY_SKIPPED, self._requeue, retry)
        self._schedule()

    def _requeue(self, retry: list[_Pending]) -> None:
        self._queue.extendleft(reversed(retry))
        self._schedule()

    async def _send(self, requests: list[TickRequest]) -> list[TickResult | ArroyoError | None]:
        try:
            return await self.loop.run_in_executor(self._executor, tick_batch, self.store, requests)
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
                out.extend(tick_batch(self.store, [request]))
            except ArroyoError as exc:
                out.append(exc)
        return out
