"""The async twin of :class:`EpochStore`, for triggers: every call runs the blocking psycopg2
driver in a worker thread, so the triggerer's event loop never blocks.

The triggers of one event loop share two things per store (``coalesce`` / ``listen``, on by
default): their ticks go to the database in batches (:mod:`airflow_arroyo.store._coalesce`), and
one LISTEN connection wakes them when an epoch ends (:mod:`airflow_arroyo.store._listen`)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from datetime import datetime

from airflow_arroyo.epochs import CheckpointPolicy, EpochState
from airflow_arroyo.store._coalesce import TickCoalescer
from airflow_arroyo.store._listen import EpochListener, Subscription
from airflow_arroyo.store._sync import EpochStore
from airflow_arroyo.store.records import (
    AckRecord,
    CleanupLockRecord,
    EpochRecord,
    PipelineRecord,
    SinkCommitRecord,
    TickRequest,
    TickResult,
)


class AsyncEpochStore:
    """The async twin of :class:`EpochStore`: its calls run in threads, so a trigger never blocks its loop.

    :param coalesce: send the loop's ticks in shared batches (False: one transaction per tick, each in its own
        worker thread). :param listen: let :meth:`subscribe` listen for epoch ends.
    """

    def __init__(self, store: EpochStore, *, coalesce: bool = True, listen: bool = True) -> None:
        self.sync = store
        self.coalesce = coalesce
        self.listen = listen

    async def trigger_tick(self, pipeline_id: str, policy: CheckpointPolicy, *, triggered_by: str = "trigger",
                           force: bool = False, is_final: bool = False, watch: Iterable[int] = ()) -> TickResult:
        if not self.coalesce:
            return await asyncio.to_thread(self.sync.trigger_tick, pipeline_id, policy, triggered_by=triggered_by,
                                           force=force, is_final=is_final, watch=tuple(watch))
        request = TickRequest(pipeline_id, policy, triggered_by=triggered_by, force=force, is_final=is_final,
                              watch=tuple(watch))
        return await TickCoalescer.for_store(self.sync).tick(request)

    async def subscribe(self, pipeline_id: str) -> Subscription | None:
        """Wake-ups for ``pipeline_id`` from the loop's shared listener (None if ``listen`` is off).
        Close the subscription when done."""
        if not self.listen:
            return None
        return await EpochListener.for_store(self.sync).subscribe(pipeline_id)

    async def get_pipeline(self, pipeline_id: str) -> PipelineRecord:
        return await asyncio.to_thread(self.sync.get_pipeline, pipeline_id)

    async def get_epoch(self, pipeline_id: str, epoch: int) -> EpochRecord:
        return await asyncio.to_thread(self.sync.get_epoch, pipeline_id, epoch)

    async def list_epochs(self, pipeline_id: str, *, limit: int = 100, before: int | None = None,
                          states: Iterable[EpochState] | None = None) -> list[EpochRecord]:
        return await asyncio.to_thread(self.sync.list_epochs, pipeline_id, limit=limit, before=before,
                                       states=list(states) if states is not None else None)

    async def in_flight_epoch(self, pipeline_id: str) -> EpochRecord | None:
        return await asyncio.to_thread(self.sync.in_flight_epoch, pipeline_id)

    async def latest_completed_epoch(self, pipeline_id: str) -> EpochRecord | None:
        return await asyncio.to_thread(self.sync.latest_completed_epoch, pipeline_id)

    async def cleanup_lock(self, pipeline_id: str) -> CleanupLockRecord | None:
        return await asyncio.to_thread(self.sync.cleanup_lock, pipeline_id)

    async def sink_commits(self, pipeline_id: str, *, after_seq: int = 0, sink: str | None = None,
                           limit: int = 100) -> list[SinkCommitRecord]:
        return await asyncio.to_thread(self.sync.sink_commits, pipeline_id, after_seq=after_seq, sink=sink,
                                       limit=limit)

    async def acks(self, pipeline_id: str, epoch: int) -> list[AckRecord]:
        return await asyncio.to_thread(self.sync.acks, pipeline_id, epoch)

    async def db_now(self) -> datetime:
        return await asyncio.to_thread(self.sync.db_now)

    async def request_stop(self, pipeline_id: str, mode: str = "graceful") -> PipelineRecord:
        return await asyncio.to_thread(self.sync.request_stop, pipeline_id, mode)

    async def record_checkpoint_interval(self, pipeline_id: str, run_id: str, interval: float) -> PipelineRecord:
        return await asyncio.to_thread(self.sync.record_checkpoint_interval, pipeline_id, run_id, interval)
