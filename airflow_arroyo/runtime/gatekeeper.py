"""The driver's side of commit gates (:mod:`airflow_arroyo.core.gates`): hold a gated sink's output when an epoch
completes, and act on the verdicts in epoch order.

The driver hands every completed epoch's sink cuts to :meth:`GateKeeper.hold` instead of committing a gated sink,
and calls :meth:`GateKeeper.advance` every turn; at most every :attr:`GateKeeper.poll_interval` seconds it reads
the pipeline's open gates and carries out :func:`~airflow_arroyo.core.gates.plan_gates`. Gates are named by the sink
as the user declared it (the last stage of a fused query), whatever query runs it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from airflow_arroyo.core.gates import Gate, GateAction, GatePolicy, GateRecord, GateState, plan_gates
from airflow_arroyo.runtime.sinks.files import TransactionalFileSink

if TYPE_CHECKING:
    from datetime import datetime

    from airflow_arroyo.runtime.sinks import TransactionalSink
    from airflow_arroyo.store import EpochStore, FencingToken

__all__ = ["GateKeeper", "GateStop", "GatedSink"]

log = logging.getLogger(__name__)


class GatedSink(Protocol):
    """What a gate needs of a sink beyond :class:`~airflow_arroyo.runtime.sinks.TransactionalSink`."""

    def pending_output(self, batch_from: int, batch_to: int) -> dict[str, Any]:
        """Where the pre-committed batches ``batch_from..batch_to`` wait (a gate's ``details``)."""


@dataclass(frozen=True)
class GateStop:
    """A gate stops the pipeline: ``cause`` for the record; with ``rollback_before``, every sink goes back to the
    newest completed epoch before that one first (``rollback_and_stop``)."""

    cause: str
    rollback_before: int | None = None


class GateKeeper:
    """The gated sinks of one run: ``gated`` maps a physical sink stage to (the sink's declared name, its gate)."""

    # seconds between reads of the open gates when nothing is announced (a verdict is: Gates.decide_gate notifies the
    # pipeline's channel, and the driver's loop then forces a read)
    poll_interval = 1.0

    def __init__(self, pipeline_id: str, run_id: str, store: EpochStore, sinks: Mapping[str, TransactionalSink],
                 gated: Mapping[str, tuple[str, Gate]]) -> None:
        self.pipeline_id = pipeline_id
        self.run_id = run_id
        self.store = store
        self.sinks = sinks
        self.gated = dict(gated)
        self.token: FencingToken | None = None
        self._physical = {name: physical for physical, (name, _) in self.gated.items()}
        self._covered: dict[str, int] = dict.fromkeys(self.gated, -1)  # the last batch a gate holds, per sink
        self._committed: dict[str, int] = dict.fromkeys(self.gated, -1)  # the last batch committed or set aside
        self._last_poll = 0.0
        self._open = False  # a gate of this run may be open: read them (nothing to read before the first)

    def __contains__(self, physical: object) -> bool:
        return physical in self.gated

    def start_at(self, cuts: Mapping[str, int]) -> None:
        """Where this run starts: each gated sink's cut in the restored epoch (missing: -1, nothing)."""
        for physical in self.gated:
            self._covered[physical] = self._committed[physical] = cuts.get(physical, -1)
        self._open = True  # an earlier run's passed gates before the restored epoch were settled by the restore

    def hold(self, epoch: int, cuts: Mapping[str, int]) -> None:
        """``epoch`` completed: open a gate for each gated sink that wrote batches since its last gate."""
        for physical, (name, gate) in self.gated.items():
            cut = cuts[physical]
            start = self._covered[physical] + 1
            if cut < start:
                continue  # nothing new to look at; the next gate covers it
            sink: Any = self.sinks[physical]
            record = self.store.open_gate(
                self.pipeline_id, name, epoch, run_id=self.run_id, uri=sink.uri, policy=GatePolicy(gate.policy),
                batch_from=start, batch_to=cut, details=sink.pending_output(start, cut), timeout=gate.timeout,
                token=self.token)
            self._covered[physical] = cut
            self._open = True
            log.info("pipeline=%s epoch=%s sink=%s: output of batches %s..%s waits for a verdict (gate %s)",
                     self.pipeline_id, epoch, name, start, cut, record.state)

    def trim_floor(self, physical: str, batch: int) -> int:
        """A trim of a gated sink never goes past what it committed (its pending batches are the gate's output)."""
        return min(batch, self._committed[physical]) if physical in self.gated else batch

    def advance(self, *, now: datetime, force: bool = False) -> GateStop | None:
        """Act on the verdicts (at most every ``poll_interval`` unless ``force``); a :class:`GateStop` when a gate
        stops the pipeline."""
        if not self.gated or not self._open:
            return None
        t = time.monotonic()
        if not force and t - self._last_poll < self.poll_interval:
            return None
        self._last_poll = t
        for _ in range(2):  # once more after a timeout: the gate's state is then the database's
            by_sink: dict[str, list[GateRecord]] = {}
            for g in self.store.open_gates(self.pipeline_id):
                if g.sink in self._physical:
                    by_sink.setdefault(g.sink, []).append(g)
            again = False
            for name, gates in by_sink.items():
                physical = self._physical[name]
                stop, timed_out = self._carry_out(physical, plan_gates(gates, self.gated[physical][1], now))
                if stop is not None:
                    return stop
                again = again or timed_out
            if not again:
                return None
        return None

    def _carry_out(self, physical: str, steps: list[Any]) -> tuple[GateStop | None, bool]:
        name, gate = self.gated[physical]
        sink = self.sinks[physical]
        for step in steps:
            g: GateRecord = step.gate
            if step.action is GateAction.TIME_OUT:
                after = self.store.time_out_gate(self.pipeline_id, name, g.epoch, token=self.token)
                log.warning("pipeline=%s epoch=%s sink=%s: no verdict before the gate's deadline (%s)",
                            self.pipeline_id, g.epoch, name, after.state)
                return None, True
            if step.action is GateAction.COMMIT:
                result = sink.commit_through(g.batch_to)
                if result.files or result.rows:  # what Airflow turns into an Asset event (airflow_arroyo.assets)
                    self.store.record_sink_commit(
                        self.pipeline_id, g.epoch, name, uri=sink.uri, batch_id=g.batch_to, files=result.files,
                        rows=result.rows, bytes_committed=result.bytes, run_id=self.run_id, token=self.token,
                        table_version=result.version)
                self.store.close_gate(self.pipeline_id, name, g.epoch, GateState.COMMITTED, token=self.token)
                self._committed[physical] = g.batch_to
                log.info("pipeline=%s epoch=%s sink=%s: gate passed (%s); committed batches through %s",
                         self.pipeline_id, g.epoch, name, g.decided_by, g.batch_to)
            elif step.action is GateAction.QUARANTINE:
                assert isinstance(sink, TransactionalFileSink) and gate.quarantine_path
                moved = sink.quarantine_through(g.batch_to, gate.quarantine_path)
                self.store.close_gate(self.pipeline_id, name, g.epoch, GateState.QUARANTINED, token=self.token,
                                      reason=f"{step.cause}; {moved.files} files quarantined to {gate.quarantine_path}")
                self._committed[physical] = g.batch_to
            elif step.action is GateAction.ROLLBACK_AND_STOP:
                return GateStop(step.cause, rollback_before=g.epoch), False
            elif step.action is GateAction.STOP:
                return GateStop(step.cause), False
        return None, False
