"""The async twin of :class:`EpochStore`, for triggers: every call runs the blocking psycopg2
driver in a worker thread, so the triggerer's event loop never blocks.

The async API is derived from the sync one in one way: each method listed in :class:`AsyncEpochStore`'s
body is ``_in_thread(EpochStore.<name>)``, the sync method of that name awaited in a worker thread, with
its signature (mypy checks the calls) and docstring. Triggers reach the store only through it (a
blocking procedure over the store, such as stopping a run and waiting for its process, through
:meth:`AsyncEpochStore.call`).

The triggers of one event loop share two things per store (``coalesce`` / ``listen``, on by
default): their ticks go to the database in batches (:mod:`airflow_arroyo.store._coalesce`), and
one LISTEN connection wakes them when an epoch ends (:mod:`airflow_arroyo.store._listen`)."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Coroutine, Iterable
from typing import Any, Concatenate, ParamSpec, TypeVar

from airflow_arroyo.core.epochs import CheckpointPolicy
from airflow_arroyo.store._coalesce import TickCoalescer
from airflow_arroyo.store._listen import EpochListener, Subscription
from airflow_arroyo.store._sync import EpochStore
from airflow_arroyo.store.records import TickRequest, TickResult

__all__ = ["AsyncEpochStore"]

P = ParamSpec("P")
R = TypeVar("R")


def _in_thread(method: Callable[Concatenate[EpochStore, P], R]
               ) -> Callable[Concatenate[AsyncEpochStore, P], Coroutine[Any, Any, R]]:
    """The async method that awaits the sync store's ``method`` (looked up by name on each call, so a
    store's own override counts) in a worker thread."""
    name = method.__name__

    @functools.wraps(method)
    async def call(self: AsyncEpochStore, /, *args: P.args, **kwargs: P.kwargs) -> R:
        result: R = await asyncio.to_thread(getattr(self.sync, name), *args, **kwargs)
        return result

    call.__qualname__ = f"AsyncEpochStore.{name}"
    return call


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
        """:meth:`EpochStore.trigger_tick`, sent with the loop's other ticks in one batch (``coalesce``)."""
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

    async def call(self, procedure: Callable[Concatenate[EpochStore, P], R], /, *args: P.args,
                   **kwargs: P.kwargs) -> R:
        """``procedure(store, *args, **kwargs)`` in a worker thread: a blocking procedure over the sync store
        that does more than one store call (asks a run to stop, then waits for its process to end)."""
        return await asyncio.to_thread(procedure, self.sync, *args, **kwargs)

    # The sync store's methods, each awaited in a worker thread.
    # pipelines and runs
    get_pipeline = _in_thread(EpochStore.get_pipeline)
    request_stop = _in_thread(EpochStore.request_stop)
    record_checkpoint_interval = _in_thread(EpochStore.record_checkpoint_interval)
    fail_run = _in_thread(EpochStore.fail_run)
    # epochs and acknowledgements
    get_epoch = _in_thread(EpochStore.get_epoch)
    list_epochs = _in_thread(EpochStore.list_epochs)
    in_flight_epoch = _in_thread(EpochStore.in_flight_epoch)
    latest_completed_epoch = _in_thread(EpochStore.latest_completed_epoch)
    acks = _in_thread(EpochStore.acks)
    # supervision
    record_failure = _in_thread(EpochStore.record_failure)
    claim_restart = _in_thread(EpochStore.claim_restart)
    record_restart = _in_thread(EpochStore.record_restart)
    end_supervision = _in_thread(EpochStore.end_supervision)
    restarts = _in_thread(EpochStore.restarts)
    expire_restart = _in_thread(EpochStore.expire_restart)
    # cleanup lease, sink commits, the database's clock
    cleanup_lock = _in_thread(EpochStore.cleanup_lock)
    sink_commits = _in_thread(EpochStore.sink_commits)
    # commit gates (a watcher of pending gates, a sensor)
    list_gates = _in_thread(EpochStore.list_gates)
    get_gate = _in_thread(EpochStore.get_gate)
    db_now = _in_thread(EpochStore.db_now)
