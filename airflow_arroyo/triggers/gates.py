"""Triggers of commit gates (:mod:`airflow_arroyo.core.gates`): a gate of a sink waits for a verdict.

* :class:`GateOpenedTrigger`: the event trigger of :func:`airflow_arroyo.assets.gate_asset`'s ``AssetWatcher``;
  one event per gate the driver opens ("epoch N pending for sink S"), so a DAG scheduled on the Asset runs its
  check on exactly that epoch's pending output.
* :class:`PendingGateTrigger`: behind the deferrable :class:`~airflow_arroyo.sensors.gates.PendingGateSensor`;
  one event once a gate of the sink is pending (after a given epoch).

The payload of both is :func:`gate_payload`: ``pipeline_id``, ``sink``, ``epoch``, ``batch_from``, ``batch_to``,
``uri``, ``deadline``, ``policy``, ``run_id``, ``seq``, ``output`` (``files`` or ``postgres``).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator, Iterable
from typing import Any

from airflow.triggers.base import BaseEventTrigger, BaseTrigger, TriggerEvent

from airflow_arroyo.core.epochs import validate_pipeline_id
from airflow_arroyo.core.exceptions import ArroyoError, ConfigurationError, UnknownPipelineError
from airflow_arroyo.core.gates import GateRecord, GateState
from airflow_arroyo.store import AsyncEpochStore
from airflow_arroyo.triggers.asset_cursor import AssetCursor
from airflow_arroyo.triggers.settle import hold_until

__all__ = ["KIND_GATE", "GateOpenedTrigger", "PendingGateTrigger", "first_pending", "gate_payload"]

KIND_GATE = "gate"
SETTLE_AFTER = 10.0  # seconds without a new gate after which a still pending last one is announced once more
_PAGE = 1000


def gate_payload(rec: GateRecord) -> dict[str, Any]:
    """The event payload of one gate: which epoch's output of which sink waits, and until when."""
    return {
        "kind": KIND_GATE, "pipeline_id": rec.pipeline_id, "sink": rec.sink, "epoch": rec.epoch,
        "batch_from": rec.batch_from, "batch_to": rec.batch_to, "uri": rec.uri, "policy": rec.policy.value,
        "deadline": rec.deadline.isoformat() if rec.deadline else None, "run_id": rec.run_id, "seq": rec.seq,
        "opened_at": rec.opened_at.isoformat(), "output": str(rec.details.get("kind") or ""),
    }


def first_pending(gates: Iterable[GateRecord], after_epoch: int | None = None) -> GateRecord | None:
    """The oldest pending gate (by epoch) after ``after_epoch`` among ``gates``. Pure."""
    waiting = [g for g in gates if g.state is GateState.PENDING and (after_epoch is None or g.epoch > after_epoch)]
    return min(waiting, key=lambda g: g.epoch) if waiting else None


def _check(pipeline_id: str, sink: str, poll_interval: float) -> None:
    validate_pipeline_id(pipeline_id)
    if not sink:
        raise ConfigurationError("a gate trigger needs the gated sink's name (sink=...)")
    if not (isinstance(poll_interval, int | float) and poll_interval > 0):
        raise ConfigurationError(f"poll_interval must be a positive number of seconds, got {poll_interval!r}")


async def _open_store(conn_id: str) -> AsyncEpochStore:
    from airflow_arroyo.hooks.arroyo import ArroyoHook

    return await ArroyoHook(conn_id).aget_store()


class GateOpenedTrigger(AssetCursor, BaseEventTrigger):
    """An event trigger for an ``AssetWatcher``: one event per gate of ``sink`` the driver opens, while it is
    still pending when seen (a gate already decided, e.g. by a person, needs no check).

    Its position is the gates' ``seq`` (opening order). At its first start it announces the gates that are pending
    then (they wait for a verdict), not the history. On Airflow >= 3.3 it keeps its position in the Asset's state
    store, moved once the triggerer took an event, so a restarted triggerer resumes after the last gate it handed
    over (at least once: recording the same verdict twice is a no-op). When no gate opened for
    :data:`SETTLE_AFTER` seconds, the last one is announced once more if it is still pending (``"repeat": True``):
    Airflow can leave the last event of a burst without a DAG run (see
    :class:`~airflow_arroyo.assets.CommittedDataTrigger`), and a gate nobody checks holds the sink.
    """

    def __init__(self, pipeline_id: str, sink: str, conn_id: str, poll_interval: float = 5.0) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # BaseTrigger.__init__ has no annotations
        _check(pipeline_id, sink, poll_interval)
        self.pipeline_id = pipeline_id
        self.sink = sink
        self.conn_id = conn_id
        self.poll_interval = poll_interval

    def serialize(self) -> tuple[str, dict[str, Any]]:
        """Airflow: the class path and exactly the constructor arguments."""
        return (f"{type(self).__module__}.{type(self).__qualname__}",
                {"pipeline_id": self.pipeline_id, "sink": self.sink, "conn_id": self.conn_id,
                 "poll_interval": self.poll_interval})

    async def _open_store(self) -> AsyncEpochStore:
        """The store client, built here (never serialized). A seam for tests."""
        return await _open_store(self.conn_id)

    async def _present(self, store: AsyncEpochStore) -> int:
        """Where to start: before the oldest gate still pending, else after the newest gate of the sink."""
        pending = await store.list_gates(self.pipeline_id, sink=self.sink, states=[GateState.PENDING], limit=1)
        if pending:
            return pending[0].seq - 1
        last = 0
        while True:
            page = await store.list_gates(self.pipeline_id, sink=self.sink, after_seq=last, limit=_PAGE)
            if not page:
                return last
            last = page[-1].seq

    async def run(self) -> AsyncIterator[TriggerEvent]:
        """Airflow: yield one event per newly opened, still pending gate, from the stored cursor on."""
        store: AsyncEpochStore | None = None
        cursor = await self._load_cursor()
        last: GateRecord | None = None  # the last gate announced, until it was repeated once
        quiet = 0
        settle = max(1, math.ceil(SETTLE_AFTER / self.poll_interval))
        while True:
            # A watcher lives as long as a DAG is scheduled on its Asset and is not restarted when it raises: a
            # failed look is logged and the next one tries again.
            gates: list[GateRecord] = []
            try:
                if store is None:
                    store = await self._open_store()
                if cursor is None:
                    cursor = await self._present(store)
                    self.log.info("pipeline %s sink %s: announcing gates after seq %s", self.pipeline_id, self.sink,
                                  cursor)
                gates = await store.list_gates(self.pipeline_id, sink=self.sink, after_seq=cursor, limit=_PAGE)
                if not gates and last is not None:
                    quiet += 1
                    if quiet >= settle:
                        again = await store.get_gate(self.pipeline_id, self.sink, last.epoch)
                        if again.state is GateState.PENDING:
                            self.log.info("pipeline %s: nothing new for %gs; announcing the gate of epoch %s of "
                                          "sink %s once more", self.pipeline_id, SETTLE_AFTER, last.epoch, self.sink)
                            yield TriggerEvent({**gate_payload(again), "repeat": True})
                        last = None
            except UnknownPipelineError:
                pass  # not registered yet
            except Exception as exc:  # see above: keep watching
                self.log.warning("pipeline %s: error while watching the gates of sink %s (looking again in %gs): %s",
                                 self.pipeline_id, self.sink, self.poll_interval, exc,
                                 exc_info=not isinstance(exc, ArroyoError))
            for gate in gates:
                if gate.state is GateState.PENDING:
                    self.log.info("pipeline %s: epoch %s pending for sink %s (batches %s-%s, deadline %s)",
                                  self.pipeline_id, gate.epoch, self.sink, gate.batch_from, gate.batch_to,
                                  gate.deadline)
                    yield TriggerEvent(gate_payload(gate))
                    last, quiet = gate, 0
                else:
                    self.log.info("pipeline %s: the gate of epoch %s of sink %s is %s already; not announced",
                                  self.pipeline_id, gate.epoch, self.sink, gate.state)
                cursor = gate.seq
                try:
                    await self._save_cursor(cursor)
                except Exception as exc:  # a lost cursor costs a repeated event, not the watcher
                    self.log.warning("pipeline %s: could not save the gate watcher's position %s: %s",
                                     self.pipeline_id, cursor, exc, exc_info=True)
            await asyncio.sleep(self.poll_interval)


class PendingGateTrigger(BaseTrigger):
    """Wait until a gate of ``sink`` of ``pipeline_id`` is pending (of an epoch after ``after_epoch``, if given);
    one event ``{"status": "success", "gate": <gate_payload>}`` for the oldest such gate.

    A failed look (the store unreachable) is logged and tried again: the deferring sensor's timeout bounds the
    wait. ``not_before``: see :mod:`airflow_arroyo.triggers.settle`.
    """

    def __init__(self, pipeline_id: str, sink: str, conn_id: str, after_epoch: int | None = None,
                 poll_interval: float = 5.0, not_before: float | None = None) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # BaseTrigger.__init__ has no annotations
        _check(pipeline_id, sink, poll_interval)
        self.pipeline_id = pipeline_id
        self.sink = sink
        self.conn_id = conn_id
        self.after_epoch = after_epoch
        self.poll_interval = float(poll_interval)
        self.not_before = not_before

    def serialize(self) -> tuple[str, dict[str, Any]]:
        """Airflow: the class path and exactly the constructor arguments."""
        return (f"{type(self).__module__}.{type(self).__qualname__}",
                {"pipeline_id": self.pipeline_id, "sink": self.sink, "conn_id": self.conn_id,
                 "after_epoch": self.after_epoch, "poll_interval": self.poll_interval,
                 "not_before": self.not_before})

    async def _open_store(self) -> AsyncEpochStore:
        """The store client, built here (never serialized). A seam for tests."""
        return await _open_store(self.conn_id)

    async def run(self) -> AsyncIterator[TriggerEvent]:
        """Airflow: poll the store until a pending gate shows up, then yield it once."""
        store: AsyncEpochStore | None = None
        while True:
            found: GateRecord | None = None
            try:
                if store is None:
                    store = await self._open_store()
                found = first_pending(await store.list_gates(self.pipeline_id, sink=self.sink,
                                                             states=[GateState.PENDING], limit=_PAGE),
                                      self.after_epoch)
            except UnknownPipelineError:
                pass  # not registered yet
            except Exception as exc:  # the sensor's timeout bounds the wait; the next look may succeed
                self.log.warning("pipeline %s: error while waiting for a gate of sink %s (looking again in %gs): %s",
                                 self.pipeline_id, self.sink, self.poll_interval, exc,
                                 exc_info=not isinstance(exc, ArroyoError))
            if found is not None:
                await hold_until(self.not_before, self.log, self.pipeline_id)
                yield TriggerEvent({"status": "success", "gate": gate_payload(found)})
                return
            await asyncio.sleep(self.poll_interval)
