"""Commit gates: a gated sink's output of an epoch waits for a verdict before it commits.

A sink declared with ``gate=Gate(...)`` (:meth:`~airflow_arroyo.runtime.pipeline.Pipeline.sink`) pre-commits as
any exactly-once sink does; when an epoch completes, the driver does not commit it but *opens a gate*: a row of
``arroyo_gates`` naming the epoch, the sink's micro-batches it covers and where they wait (the pending files of a
file sink, the pending rows of a PostgreSQL sink). Anything may then look at exactly that output, read-only
(:func:`pending_output`), and record a verdict (:func:`record_verdict`: an Airflow task, a person through the UI,
``airflow-arroyo gate``). The driver acts on the verdicts in epoch order (:func:`plan_gates`):

* **passed**: the sink commits through the epoch's cut, and only then the committed-data Asset event follows;
* **failed**, or no verdict before ``timeout``, follows the gate's policy:

  - ``hold``: the output stays pending and every later epoch of the sink waits behind it (they complete and
    are gated as usual: the controller does not stop firing epochs); a pass recorded later (a person's
    approval after a look) releases them. More than ``max_waiting`` epochs behind it stop the pipeline with
    the cause;
  - ``rollback_and_stop``: the pipeline stops, and every sink is rolled back to the last epoch before it
    whose gated output passed (the epoch the next run restores);
  - ``quarantine`` (file sinks): the epoch's files are committed to ``quarantine_path`` instead, and the
    sink goes on.

Restores never commit output a gate holds: ``restore_from='latest'`` restores the newest completed epoch before
the oldest gate without a pass (:func:`airflow_arroyo.core.restores.read_restore_facts`), the epochs after it are
recomputed under gates of their own, and retention keeps that epoch and every later one while gates are open.
Epochs that complete between two turns of the driver share one gate (the newest one's): a gate covers the
sink's output since the previous gate.

Airflow-free: the driver, the CLI and the Airflow operators all come through here.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Protocol

from airflow_arroyo.core.exceptions import ConfigurationError, StateConflictError

__all__ = [
    "GATE_TRANSITIONS",
    "OPEN_GATE_STATES",
    "Gate",
    "GateAction",
    "GatePolicy",
    "GateRecord",
    "GateState",
    "GateStep",
    "GateStore",
    "PendingOutput",
    "pending_output",
    "plan_gates",
    "record_verdict",
]


class GatePolicy(enum.StrEnum):
    """What a failed verdict (or none before the timeout) does (see the module docstring)."""

    HOLD = "hold"
    ROLLBACK_AND_STOP = "rollback_and_stop"
    QUARANTINE = "quarantine"


class GateState(enum.StrEnum):
    """The life cycle of one gate; legal moves are in :data:`GATE_TRANSITIONS`."""

    PENDING = "pending"  # waiting for a verdict
    PASSED = "passed"  # may commit, in epoch order
    FAILED = "failed"
    TIMED_OUT = "timed_out"  # no verdict before the deadline: a failure under the policy
    COMMITTED = "committed"  # the output is visible (the end of a passed gate)
    QUARANTINED = "quarantined"  # the output went to the quarantine location
    SUPERSEDED = "superseded"  # a restore to an earlier epoch: the output is recomputed under a new gate


# A failed or timed-out gate may still pass (a person's approval after a look); a late failure of a timed-out one
# keeps the reason of the check.
GATE_TRANSITIONS: dict[GateState, frozenset[GateState]] = {
    GateState.PENDING: frozenset({GateState.PASSED, GateState.FAILED, GateState.TIMED_OUT, GateState.SUPERSEDED}),
    GateState.PASSED: frozenset({GateState.COMMITTED, GateState.SUPERSEDED}),
    GateState.FAILED: frozenset({GateState.PASSED, GateState.QUARANTINED, GateState.SUPERSEDED}),
    GateState.TIMED_OUT: frozenset({GateState.PASSED, GateState.FAILED, GateState.QUARANTINED,
                                    GateState.SUPERSEDED}),
    GateState.COMMITTED: frozenset(),
    GateState.QUARANTINED: frozenset(),
    GateState.SUPERSEDED: frozenset(),
}

#: Gates whose output is neither visible nor set aside yet.
OPEN_GATE_STATES = frozenset({GateState.PENDING, GateState.PASSED, GateState.FAILED, GateState.TIMED_OUT})
#: Gates that keep a restore behind them (a passed one does not: a restore commits its output).
BLOCKING_GATE_STATES = frozenset({GateState.PENDING, GateState.FAILED, GateState.TIMED_OUT})
#: Sink kinds a gate can hold: their pre-committed output waits without a time limit of the target system.
GATEABLE_SINKS = ("files", "postgres")


@dataclass(frozen=True)
class Gate:
    """A sink's commit gate, as declared: ``pipeline.sink(..., gate=Gate(policy="hold", timeout=600))``.

    ``timeout``: seconds a verdict may take after the epoch completed (None: no limit); ``max_waiting``
    (``hold``): epochs that may wait behind a failed one before the pipeline stops; ``quarantine_path``
    (``quarantine``, file sinks): the folder or URI a failed epoch's files are committed to instead.
    """

    policy: GatePolicy | str = GatePolicy.HOLD
    timeout: float | None = 3600.0
    max_waiting: int = 10
    quarantine_path: str | None = None

    def checked(self, sink: str, kind: str) -> Gate:
        """This gate with its policy as a :class:`GatePolicy`; :class:`ConfigurationError` naming the fix."""
        try:
            policy = GatePolicy(self.policy)
        except ValueError:
            raise ConfigurationError(
                f"sink {sink!r}: gate policy {self.policy!r} is not one of "
                f"{', '.join(p.value for p in GatePolicy)}") from None
        if kind not in GATEABLE_SINKS:
            raise ConfigurationError(
                f"sink {sink!r}: a commit gate holds the output of a file or PostgreSQL sink, not of a {kind} "
                "sink (a Kafka transaction or a lakehouse commit cannot wait for a verdict without limit); "
                "gate a file or PostgreSQL sink written from the same stream, or drop gate=")
        if self.timeout is not None and not (math.isfinite(self.timeout) and self.timeout > 0):
            raise ConfigurationError(f"sink {sink!r}: gate timeout must be a positive number of seconds or None, "
                                     f"got {self.timeout!r}")
        if isinstance(self.max_waiting, bool) or not isinstance(self.max_waiting, int) or self.max_waiting < 1:
            raise ConfigurationError(f"sink {sink!r}: gate max_waiting must be a whole number >= 1, "
                                     f"got {self.max_waiting!r}")
        if policy is GatePolicy.QUARANTINE:
            if kind != "files":
                raise ConfigurationError(
                    f"sink {sink!r}: the quarantine policy moves a failed epoch's files aside, so it needs a file "
                    "sink; use policy='hold' or 'rollback_and_stop' for a PostgreSQL sink")
            if not self.quarantine_path:
                raise ConfigurationError(f"sink {sink!r}: policy='quarantine' needs quarantine_path='<folder or URI>' "
                                         "(where a failed epoch's files are committed instead)")
        elif self.quarantine_path:
            raise ConfigurationError(f"sink {sink!r}: quarantine_path is for policy='quarantine', not {policy.value!r}")
        return Gate(policy, self.timeout, self.max_waiting, self.quarantine_path)


@dataclass(frozen=True)
class GateRecord:
    """A row of ``arroyo_gates``."""

    pipeline_id: str
    sink: str
    epoch: int
    run_id: str
    uri: str
    policy: GatePolicy
    batch_from: int
    batch_to: int
    state: GateState
    opened_at: datetime
    seq: int
    details: dict[str, Any] = field(default_factory=dict)
    deadline: datetime | None = None
    decided_by: str | None = None
    reason: str | None = None
    decided_at: datetime | None = None
    closed_at: datetime | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "policy", GatePolicy(self.policy))
        object.__setattr__(self, "state", GateState(self.state))


# --------------------------------------------------------------------------- the driver's decision


class GateAction(enum.StrEnum):
    """One step of the driver for a gated sink (:func:`plan_gates`)."""

    TIME_OUT = "time_out"  # record that no verdict came before the deadline (then the policy acts)
    COMMIT = "commit"  # commit the sink through the gate's last batch
    QUARANTINE = "quarantine"  # commit the gate's batches to the quarantine location
    ROLLBACK_AND_STOP = "rollback_and_stop"  # stop; every sink back to the last passed epoch
    STOP = "stop"  # hold's limit: stop with the cause


@dataclass(frozen=True)
class GateStep:
    """Do ``action`` for ``gate`` (its epoch and batches); ``cause`` for the stopping actions."""

    action: GateAction
    gate: GateRecord
    cause: str = ""


def plan_gates(gates: Sequence[GateRecord], spec: Gate, now: datetime) -> list[GateStep]:
    """What the driver does now for one gated sink whose open gates are ``gates`` (any order): walk them in epoch
    order, committing passed ones, until one waits for a verdict or stops the pipeline. A pending gate past its
    deadline is timed out first and then treated as failed."""
    steps: list[GateStep] = []
    ordered = sorted((g for g in gates if g.state in OPEN_GATE_STATES), key=lambda g: g.epoch)
    for i, gate in enumerate(ordered):
        state = gate.state
        if state is GateState.PENDING and gate.deadline is not None and now >= gate.deadline:
            steps.append(GateStep(GateAction.TIME_OUT, gate))
            state = GateState.TIMED_OUT
        if state is GateState.PASSED:
            steps.append(GateStep(GateAction.COMMIT, gate))
            continue
        if state is GateState.PENDING:
            break
        why = _failure(gate, state)
        if spec.policy is GatePolicy.QUARANTINE:
            steps.append(GateStep(GateAction.QUARANTINE, gate, why))
            continue
        if spec.policy is GatePolicy.ROLLBACK_AND_STOP:
            steps.append(GateStep(GateAction.ROLLBACK_AND_STOP, gate,
                                  f"{why}; policy rollback_and_stop: every sink was rolled back to the last epoch "
                                  "before it whose gated output passed, and the pipeline stopped. Fix the cause, "
                                  "then start it with restore_from='latest' (it restores that epoch), or record a "
                                  f"pass for epoch {gate.epoch} first (airflow-arroyo gate pass)"))
            break
        waiting = len(ordered) - i - 1
        if waiting > spec.max_waiting:
            steps.append(GateStep(GateAction.STOP, gate,
                                  f"{why}; policy hold: {waiting} later epochs waited behind it, more than "
                                  f"max_waiting={spec.max_waiting}, so the pipeline stopped with their output "
                                  f"uncommitted. Record a pass for epoch {gate.epoch} (airflow-arroyo gate pass "
                                  f"{gate.pipeline_id} --sink {gate.sink} --epoch {gate.epoch}) and restart with "
                                  "restore_from='latest', or fix the cause and restart (the held epochs are "
                                  "recomputed)"))
        break
    return steps


def _failure(gate: GateRecord, state: GateState) -> str:
    if state is GateState.TIMED_OUT:
        return (f"gate of sink {gate.sink!r} for epoch {gate.epoch}: no verdict came before its deadline "
                f"({gate.deadline:%Y-%m-%d %H:%M:%S %Z})" if gate.deadline else
                f"gate of sink {gate.sink!r} for epoch {gate.epoch}: no verdict came in time")
    by = f" by {gate.decided_by}" if gate.decided_by else ""
    reason = f": {gate.reason}" if gate.reason else ""
    return f"gate of sink {gate.sink!r} for epoch {gate.epoch} failed{by}{reason}"


# --------------------------------------------------------------------------- use cases: verdicts and the output


class GateStore(Protocol):
    """What the use cases below need of the epoch store (:class:`~airflow_arroyo.store.EpochStore`; a protocol
    because the store builds on this module)."""

    def get_gate(self, pipeline_id: str, sink: str, epoch: int) -> GateRecord:
        """The gate (:meth:`~airflow_arroyo.store.gates.Gates.get_gate`)."""

    def decide_gate(self, pipeline_id: str, sink: str, epoch: int, verdict: GateState, *, by: str,
                    reason: str | None = None) -> GateRecord:
        """Record a verdict (:meth:`~airflow_arroyo.store.gates.Gates.decide_gate`)."""


@dataclass(frozen=True)
class PendingOutput:
    """Where an epoch's gated output waits, read-only (:func:`pending_output`).

    ``kind`` ``files``: ``files`` are the URIs of its data files (``format``: Spark's name for them); ``kind``
    ``postgres``: ``select_sql`` with ``select_params`` reads its rows (the target table's columns) from the sink's
    pending table, in the target database; ``rows``: the row count the sink recorded (None when unknown).
    """

    gate: GateRecord
    kind: str
    files: tuple[str, ...] = ()
    format: str | None = None
    select_sql: str | None = None
    select_params: tuple[int, int] | None = None
    rows: int | None = None

    def create_view(self, cursor: Any, name: str = "pending") -> None:
        """In the PostgreSQL sink's target database: a temporary view ``name`` over the pending rows (on the
        cursor's connection, gone with its session), for a check written against ``name``. PostgreSQL creates no
        view in a read-only transaction: create it first, then check read-only (:meth:`query` does both)."""
        if self.select_sql is None:
            raise ConfigurationError(f"sink {self.gate.sink!r} is a {self.kind} sink: its pending output is files "
                                     "(PendingOutput.files), not rows a view can show")
        cursor.execute(f"CREATE TEMPORARY VIEW {_quote(name)} AS {self.select_sql}", self.select_params)

    def query(self, conn: Any, statement: str, params: Any = None, *, view: str = "pending") -> list[tuple[Any, ...]]:
        """Run ``statement`` (a check written against ``view``) on psycopg2 connection ``conn`` to the sink's target
        database in a READ ONLY transaction, after creating the view in a transaction of its own; returns its rows.
        The check can read the pending rows and anything else, and write nothing (by mistake: a check that turns
        read-write on purpose can; a role with SELECT only is the boundary for checks nobody reviewed)."""
        with conn.cursor() as cur:
            self.create_view(cur, view)
            # the session read-only too: a COMMIT in the check's text ends the READ ONLY transaction, and its next
            # statement would otherwise run read-write
            cur.execute("SET SESSION CHARACTERISTICS AS TRANSACTION READ ONLY")
        conn.commit()
        was = conn.readonly
        conn.readonly = True
        try:
            with conn.cursor() as cur:
                cur.execute(statement, params)
                fetched = cur.fetchall() if cur.description else []
        finally:
            conn.rollback()
            conn.readonly = was
        with conn.cursor() as cur:  # the session as it was (the view stays until it ends)
            cur.execute("RESET default_transaction_read_only")
        conn.commit()
        return [tuple(r.values()) if isinstance(r, dict) else tuple(r) for r in fetched]


def pending_output(store: GateStore, pipeline_id: str, sink: str, epoch: int) -> PendingOutput:
    """The output gate (``pipeline_id``, ``sink``, ``epoch``) holds. Refused (:class:`StateConflictError`) once it is
    no longer waiting (committed, quarantined or superseded: the output is elsewhere or gone)."""
    gate = store.get_gate(pipeline_id, sink, epoch)
    if gate.state not in OPEN_GATE_STATES:
        raise StateConflictError(
            f"the gate of sink {sink!r} for epoch {epoch} of pipeline {pipeline_id!r} is {gate.state}: its output no "
            "longer waits (airflow-arroyo gate list shows the open ones)")
    d: Mapping[str, Any] = gate.details
    kind = str(d.get("kind", ""))
    rows = d.get("rows")
    if kind == "files":
        return PendingOutput(gate, kind, files=tuple(d.get("files", ())), format=d.get("format"),
                             rows=int(rows) if rows is not None else None)
    if kind == "postgres":
        cols = ", ".join(_quote(c) for c in d["columns"])
        select = (f"SELECT {cols} FROM {_quote(d['schema'])}.{_quote(d['pending_table'])}"  # noqa: S608 - quoted names
                  f" WHERE {_quote(d['batch_column'])} BETWEEN %s AND %s")
        return PendingOutput(gate, kind, select_sql=select, select_params=(gate.batch_from, gate.batch_to))
    raise ConfigurationError(f"the gate of sink {sink!r} for epoch {epoch} names no pending output it knows ({kind!r})")


def _quote(name: str) -> str:
    """A PostgreSQL identifier, quoted (the names the driver recorded: the sink's schema, table and columns)."""
    return '"' + str(name).replace('"', '""') + '"'


def record_verdict(store: GateStore, pipeline_id: str, sink: str, epoch: int, *, passed: bool, by: str,
                   reason: str | None = None) -> GateRecord:
    """Record a verdict on the gate (``pipeline_id``, ``sink``, ``epoch``): pass or fail, by whom (a task, a
    user) and why. Refused (:class:`StateConflictError`, naming the gate's state) when that move is not legal:
    a gate already committed, quarantined or superseded, or a fail after a pass."""
    by = (by or "").strip()
    if not by:
        raise ConfigurationError("a verdict says who gave it (by=): a task id or a user name")
    if reason is not None and len(reason) > 4000:
        reason = reason[:3997] + "..."
    return store.decide_gate(pipeline_id, sink, epoch, GateState.PASSED if passed else GateState.FAILED,
                             by=by, reason=reason)
