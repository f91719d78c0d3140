"""A batch of ticks as a triggerer's coalescer sends it: the decisions, then what the triggers report.

:meth:`EpochStore.trigger_ticks` decides and applies many pipelines' ticks in one transaction. A
trigger then reports on the epochs its tick saw: a log line for an epoch in flight it did not start,
and per ended epoch the metrics (``airflow_arroyo.metrics``: the slowest stage's alignment, the
driver's heartbeat age). Read one trigger at a time, those were two or three transactions and
worker-thread hops per epoch, more than the tick itself, queueing in front of the next batches.
:func:`attach_reports` reads them for the whole batch in one short read-only transaction right after
the ticks commit (:func:`decide_batch`), in a worker thread, while the coalescer's next batch may already
decide (one statement, two when a tick saw an epoch in flight it did not watch; none when no tick saw
anything to report), and hands each :class:`TickResult` its :class:`TickReport`; :func:`tick_batch` does
both in one call.

The report is read after the commit, outside the row locks: it never delays a decision, and it is
what the controller reports, not what it decides on. If reading it fails, the results go back
without a report (the trigger then asks the store itself, as it did before); the ticks, already
committed, are never reported as failed because of it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import psycopg2

from airflow_arroyo.core.epochs import EpochState, TriggerAction
from airflow_arroyo.core.exceptions import ArroyoError
from airflow_arroyo.store._db import dict_rows
from airflow_arroyo.store._sync import EpochStore
from airflow_arroyo.store.records import EpochRecord, TickReport, TickRequest, TickResult, epoch_columns, from_row

__all__ = ["attach_reports", "decide_batch", "read_reports", "tick_batch"]

log = logging.getLogger(__name__)

Outcome = TickResult | ArroyoError | None

# The pipelines' heartbeats, and per completed epoch (pipeline, epoch) its stages' slowest alignment
# (as metrics.slowest_alignment computes it from the acknowledgements).
# Not prepared: a generic plan made while arroyo_acks is nearly empty (a new store) would scan it.
_HEARTBEATS_AND_ALIGNMENT = (
    "SELECT p.pipeline_id, p.heartbeat_at, w.epoch,"
    " (SELECT max(a.alignment_ms) FROM arroyo_acks a WHERE a.pipeline_id = w.pipeline_id AND a.epoch = w.epoch)"
    "   AS slowest"
    " FROM arroyo_pipelines p"
    " LEFT JOIN unnest(%s::text[], %s::bigint[]) AS w(pipeline_id, epoch) ON w.pipeline_id = p.pipeline_id"
    " WHERE p.pipeline_id = ANY(%s)"
)
_EPOCHS = (
    f"SELECT {epoch_columns('e')} FROM arroyo_epochs e"  # noqa: S608
    " JOIN unnest(%s::text[], %s::bigint[]) AS w(pipeline_id, epoch) USING (pipeline_id, epoch)"
)


def tick_batch(store: EpochStore, requests: Sequence[TickRequest]) -> list[Outcome]:
    """``store.trigger_ticks(requests)``, each result with its :class:`TickReport` (blocking: run it
    in a worker thread)."""
    return attach_reports(store, requests, decide_batch(store, requests))


def decide_batch(store: EpochStore, requests: Sequence[TickRequest]) -> list[Outcome]:
    """The batch's decisions alone (``store.trigger_ticks``): what holds its pipelines' row locks."""
    return store.trigger_ticks(requests)


def attach_reports(store: EpochStore, requests: Sequence[TickRequest], results: Sequence[Outcome]) -> list[Outcome]:
    """:func:`read_reports` for results whose ticks committed; without their report if it cannot be read."""
    try:
        return read_reports(store, requests, results)
    except (psycopg2.Error, ArroyoError) as exc:  # the ticks committed: report them without their report
        log.warning("epoch store: could not read the report of %s ticks (%s); the triggers read it themselves",
                    len(requests), type(exc).__name__)
        return list(results)


def read_reports(store: EpochStore, requests: Sequence[TickRequest], results: Sequence[Outcome]) -> list[Outcome]:
    """Attach a :class:`TickReport` to every :class:`TickResult` of ``results``: at most two statements
    on a pooled connection in autocommit (no BEGIN/COMMIT round trips; each statement reads committed
    rows), none when no tick saw an epoch end or an epoch it did not watch. No retry."""
    ticked = [(req, res) for req, res in zip(requests, results, strict=True) if isinstance(res, TickResult)]
    # the heartbeat age and the alignment are measured when an epoch ends (completed, failed or expired)
    ended = [(req.pipeline_id, [rec for rec in (*res.ended, res.expired) if rec is not None]) for req, res in ticked]
    pids = [pid for pid, recs in ended if recs]
    completed = [(rec.pipeline_id, rec.epoch) for _, recs in ended for rec in recs if rec.state is EpochState.COMPLETED]
    unseen = [(req.pipeline_id, res.decision.epoch) for req, res in ticked
              if res.decision.action is TriggerAction.WAIT_IN_FLIGHT and res.decision.epoch is not None
              and res.decision.epoch not in req.watch]
    heartbeats: dict[str, Any] = {}
    alignment: dict[str, dict[int, float]] = {}
    in_flight: dict[tuple[str, int], EpochRecord] = {}
    if pids or unseen:
        with store._connection() as conn:
            conn.autocommit = True
            try:
                with conn.cursor() as cur:
                    if pids:
                        cur.execute(_HEARTBEATS_AND_ALIGNMENT,
                                    ([p for p, _ in completed], [e for _, e in completed], pids))
                        for row in dict_rows(cur):
                            heartbeats[row["pipeline_id"]] = row["heartbeat_at"]
                            if row["slowest"] is not None:
                                alignment.setdefault(row["pipeline_id"], {})[int(row["epoch"])] = float(row["slowest"])
                    if unseen:
                        cur.execute(_EPOCHS, ([p for p, _ in unseen], [e for _, e in unseen]))
                        for row in dict_rows(cur):
                            rec = from_row(EpochRecord, row)
                            in_flight[(rec.pipeline_id, rec.epoch)] = rec
            finally:
                if not conn.closed:
                    conn.autocommit = False
    out: list[Outcome] = []
    for req, res in zip(requests, results, strict=True):
        if not isinstance(res, TickResult):
            out.append(res)
            continue
        seen = in_flight.get((req.pipeline_id, res.decision.epoch)) if res.decision.epoch is not None else None
        out.append(replace(res, report=TickReport(heartbeat_at=heartbeats.get(req.pipeline_id),
                                                  alignment_ms=alignment.get(req.pipeline_id, {}), in_flight=seen)))
    return out
