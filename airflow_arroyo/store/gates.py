"""Commit gates (``arroyo_gates``, migration 0014): an epoch's gated sink output and its verdict
(:mod:`airflow_arroyo.core.gates` for the rules)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from psycopg2.extras import Json

from airflow_arroyo.core.epochs import EpochState
from airflow_arroyo.core.exceptions import NotFoundError, StateConflictError
from airflow_arroyo.core.gates import (
    BLOCKING_GATE_STATES,
    GATE_TRANSITIONS,
    OPEN_GATE_STATES,
    GatePolicy,
    GateRecord,
    GateState,
)
from airflow_arroyo.store._db import Concern, PgCursor
from airflow_arroyo.store.pipelines import check_token, read_pipeline
from airflow_arroyo.store.records import EpochRecord, FencingToken, epoch_columns, from_row

__all__ = ["Gates"]

_COLS = ("pipeline_id, sink, epoch, run_id, uri, policy, batch_from, batch_to, details, state, opened_at, deadline,"
         " decided_by, reason, decided_at, closed_at, seq")
_OPEN = sorted(s.value for s in OPEN_GATE_STATES)
_BLOCKING = sorted(s.value for s in BLOCKING_GATE_STATES)


class GateNotFoundError(NotFoundError):
    """No gate of that sink for that epoch."""


class Gates(Concern):
    """Gates, one per (pipeline, sink, epoch) the driver held for a verdict."""

    def open_gate(self, pipeline_id: str, sink: str, epoch: int, *, run_id: str, uri: str, policy: GatePolicy,
                  batch_from: int, batch_to: int, details: Mapping[str, Any], timeout: float | None,
                  token: FencingToken | None = None) -> GateRecord:
        """Hold ``epoch``'s output of ``sink`` (its micro-batches ``batch_from..batch_to``) for a verdict, due within
        ``timeout`` seconds (None: no deadline). Idempotent: a repeat returns the first record."""

        def tx(cur: PgCursor) -> GateRecord:
            check_token(cur, token, f"the gate of sink {sink!r} for epoch {epoch}")
            cur.execute(
                "INSERT INTO arroyo_gates (pipeline_id, sink, epoch, run_id, uri, policy, batch_from, batch_to,"
                " details, deadline) VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s,"
                " CASE WHEN %s::float8 IS NULL THEN NULL ELSE clock_timestamp() + %s::float8 * interval '1 second' END)"
                " ON CONFLICT (pipeline_id, sink, epoch) DO NOTHING",
                (pipeline_id, sink, epoch, run_id, uri, GatePolicy(policy).value, batch_from, batch_to,
                 Json(dict(details)), timeout, timeout))
            return _get(cur, pipeline_id, sink, epoch)

        return self._db.tx(tx)

    def get_gate(self, pipeline_id: str, sink: str, epoch: int) -> GateRecord:
        """The gate of ``sink`` for ``epoch``; :class:`NotFoundError` when there is none."""
        return self._db.tx(lambda cur: _get(cur, pipeline_id, sink, epoch))

    def list_gates(self, pipeline_id: str, *, sink: str | None = None, states: Iterable[GateState] | None = None,
                   after_seq: int = 0, limit: int = 100) -> list[GateRecord]:
        """The pipeline's gates (of ``sink``, in ``states``) after ``after_seq``, in opening order."""
        wanted = None if states is None else [GateState(s).value for s in states]

        def tx(cur: PgCursor) -> list[GateRecord]:
            cur.execute(
                f"SELECT {_COLS} FROM arroyo_gates WHERE pipeline_id = %(p)s AND seq > %(after)s"  # noqa: S608
                " AND (%(sink)s::text IS NULL OR sink = %(sink)s)"
                " AND (%(states)s::text[] IS NULL OR state = ANY(%(states)s))"
                " ORDER BY seq LIMIT %(limit)s",
                {"p": pipeline_id, "after": after_seq, "sink": sink, "states": wanted, "limit": limit})
            return [from_row(GateRecord, r) for r in cur.fetchall()]

        return self._db.tx(tx)

    def open_gates(self, pipeline_id: str) -> list[GateRecord]:
        """The pipeline's gates still waiting (pending, passed but not committed, failed, timed out), by epoch."""

        def tx(cur: PgCursor) -> list[GateRecord]:
            cur.execute(f"SELECT {_COLS} FROM arroyo_gates WHERE pipeline_id = %s AND state = ANY(%s)"  # noqa: S608
                        " ORDER BY epoch, sink", (pipeline_id, _OPEN))
            return [from_row(GateRecord, r) for r in cur.fetchall()]

        return self._db.tx(tx)

    def decide_gate(self, pipeline_id: str, sink: str, epoch: int, verdict: GateState, *, by: str,
                    reason: str | None = None) -> GateRecord:
        """Record a verdict (``passed`` or ``failed``) on a gate. :class:`StateConflictError` when the gate's state
        does not allow it (nothing changed); a repeat of the verdict the gate has is a no-op."""
        verdict = GateState(verdict)
        if verdict not in (GateState.PASSED, GateState.FAILED):
            raise ValueError(f"a verdict is passed or failed, not {verdict}")

        def tx(cur: PgCursor) -> GateRecord:
            current = _get(cur, pipeline_id, sink, epoch, lock=True)
            if current.state is verdict or (verdict is GateState.PASSED and current.state is GateState.COMMITTED):
                return current
            if verdict not in GATE_TRANSITIONS[current.state]:
                raise StateConflictError(
                    f"the gate of sink {sink!r} for epoch {epoch} of pipeline {pipeline_id!r} is {current.state}"
                    f"{' by ' + current.decided_by if current.decided_by else ''}: it cannot become {verdict} "
                    "(nothing was changed); airflow-arroyo gate list shows the gates that wait")
            cur.execute("UPDATE arroyo_gates SET state = %s, decided_by = %s, reason = %s,"
                        " decided_at = clock_timestamp() WHERE pipeline_id = %s AND sink = %s AND epoch = %s",
                        (verdict.value, by, reason, pipeline_id, sink, epoch))
            # the pipeline's channel (migration 0004): the driver's epoch watch wakes and acts on the verdict at once
            cur.execute("SELECT pg_notify(arroyo_channel(%s), %s)", (pipeline_id, f"gate {sink} {epoch} {verdict}"))
            return _get(cur, pipeline_id, sink, epoch)

        return self._db.tx(tx)

    def time_out_gate(self, pipeline_id: str, sink: str, epoch: int, *,
                      token: FencingToken | None = None) -> GateRecord:
        """A pending gate past its deadline becomes ``timed_out`` (in the database's clock; a verdict that came first
        wins). Returns the gate as it is."""

        def tx(cur: PgCursor) -> GateRecord:
            check_token(cur, token, f"the timeout of the gate of sink {sink!r} for epoch {epoch}")
            cur.execute("UPDATE arroyo_gates SET state = 'timed_out', decided_by = 'timeout',"
                        " decided_at = clock_timestamp() WHERE pipeline_id = %s AND sink = %s AND epoch = %s"
                        " AND state = 'pending' AND deadline <= clock_timestamp()", (pipeline_id, sink, epoch))
            return _get(cur, pipeline_id, sink, epoch)

        return self._db.tx(tx)

    def close_gate(self, pipeline_id: str, sink: str, epoch: int, state: GateState, *,
                   token: FencingToken | None = None, reason: str | None = None) -> GateRecord:
        """The driver made the gate's output visible (``committed``) or set it aside (``quarantined``)."""
        state = GateState(state)

        def tx(cur: PgCursor) -> GateRecord:
            check_token(cur, token, f"closing the gate of sink {sink!r} for epoch {epoch}")
            current = _get(cur, pipeline_id, sink, epoch, lock=True)
            if current.state is state:
                return current
            if state not in GATE_TRANSITIONS[current.state]:
                raise StateConflictError(f"the gate of sink {sink!r} for epoch {epoch} of pipeline {pipeline_id!r} is "
                                         f"{current.state}: it cannot become {state}")
            cur.execute("UPDATE arroyo_gates SET state = %s, closed_at = clock_timestamp(),"
                        " reason = COALESCE(%s, reason) WHERE pipeline_id = %s AND sink = %s AND epoch = %s",
                        (state.value, reason, pipeline_id, sink, epoch))
            return _get(cur, pipeline_id, sink, epoch)

        return self._db.tx(tx)

    def supersede_gates(self, pipeline_id: str, *, after: int, token: FencingToken | None = None) -> int:
        """Every open gate of an epoch after ``after`` is superseded (a run that starts over recomputes their output);
        returns how many."""

        def tx(cur: PgCursor) -> int:
            check_token(cur, token, f"superseding the gates after epoch {after}")
            cur.execute("UPDATE arroyo_gates SET state = 'superseded', closed_at = clock_timestamp(),"
                        " reason = COALESCE(reason, %s) WHERE pipeline_id = %s AND epoch > %s AND state = ANY(%s)",
                        (f"superseded: the pipeline started over after epoch {after}", pipeline_id, after, _OPEN))
            return int(cur.rowcount)

        return self._db.tx(tx)

    def gate_blocker(self, pipeline_id: str) -> GateRecord | None:
        """The oldest gate that keeps restores behind it (pending, failed or timed out), if any."""

        def tx(cur: PgCursor) -> GateRecord | None:
            cur.execute(f"SELECT {_COLS} FROM arroyo_gates WHERE pipeline_id = %s AND state = ANY(%s)"  # noqa: S608
                        " ORDER BY epoch, sink LIMIT 1", (pipeline_id, _BLOCKING))
            row = cur.fetchone()
            return from_row(GateRecord, row) if row is not None else None

        return self._db.tx(tx)

    def retention_floor(self, pipeline_id: str) -> int | None:
        """The oldest epoch retention must keep for the pipeline's gates (None: no gate ever opened). While a gate
        waits, the newest completed epoch before it (what ``'latest'`` restores); otherwise the newest completed
        epoch up to the newest closed gate: the next gate may open at any moment (its epoch has completed, the driver
        has not yet seen it), and a restore then goes back to the epoch before it."""

        def tx(cur: PgCursor) -> int | None:
            cur.execute("SELECT min(epoch) FILTER (WHERE state = ANY(%s)) AS blocker,"
                        " max(epoch) FILTER (WHERE state IN ('committed', 'quarantined')) AS closed"
                        " FROM arroyo_gates WHERE pipeline_id = %s", (_BLOCKING, pipeline_id))
            row = cur.fetchone()
            if row is None or (row["blocker"] is None and row["closed"] is None):
                return None
            bound, inclusive = (row["blocker"], False) if row["blocker"] is not None else (row["closed"], True)
            cur.execute("SELECT max(epoch) AS epoch FROM arroyo_epochs WHERE pipeline_id = %s AND state = %s"
                        " AND (epoch < %s OR (%s AND epoch = %s))",
                        (pipeline_id, EpochState.COMPLETED.value, bound, inclusive, bound))
            found = cur.fetchone()
            return int(found["epoch"]) if found and found["epoch"] is not None else int(bound)

        return self._db.tx(tx)

    def latest_completed_before(self, pipeline_id: str, epoch: int) -> EpochRecord | None:
        """The newest completed epoch before ``epoch`` (what ``'latest'`` restores while a gate at ``epoch`` waits)."""

        def tx(cur: PgCursor) -> EpochRecord | None:
            cur.execute(f"SELECT {epoch_columns('e')} FROM arroyo_epochs e WHERE e.pipeline_id = %s"  # noqa: S608
                        " AND e.epoch < %s AND e.state = %s ORDER BY e.epoch DESC LIMIT 1",
                        (pipeline_id, epoch, EpochState.COMPLETED.value))
            row = cur.fetchone()
            return from_row(EpochRecord, row) if row is not None else None

        return self._db.tx(tx)


def _get(cur: PgCursor, pipeline_id: str, sink: str, epoch: int, *, lock: bool = False) -> GateRecord:
    cur.execute(f"SELECT {_COLS} FROM arroyo_gates WHERE pipeline_id = %s AND sink = %s AND epoch = %s"  # noqa: S608
                + (" FOR UPDATE" if lock else ""), (pipeline_id, sink, epoch))
    row = cur.fetchone()
    if row is None:
        read_pipeline(cur, pipeline_id)  # an unknown pipeline says so
        raise GateNotFoundError(f"pipeline {pipeline_id!r} has no gate of sink {sink!r} for epoch {epoch}; "
                                f"airflow-arroyo gate list {pipeline_id} shows its gates")
    return from_row(GateRecord, row)

