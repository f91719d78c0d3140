"""Check the control plane's invariants from the database's own history.

``arroyo_history`` is written by triggers in the database (every epoch state change, every cleanup
lease acquire / renew / release / takeover), never by the processes, so a check over it does not
rely on anybody's say-so. Every writer of a pipeline's history holds that pipeline's row lock, so
the pipeline's events in ``seq`` order are its events in commit order; the checker verifies that
claim first (``at`` never goes back, no transaction's events interleave with another's), then replays
each pipeline's events and reports every breach of the protocol:

* ``two_in_flight``: an epoch triggered while another was still in flight;
* ``triggered_under_cleanup_lock``: an epoch triggered while a cleanup lease was live;
* ``epoch_not_increasing``: an epoch number not above every earlier one of the pipeline;
* ``illegal_transition``: a state change :data:`~airflow_arroyo.core.epochs.EPOCH_TRANSITIONS` forbids;
* ``pruned_in_flight`` / ``pruned_latest_completed`` / ``pruned_retained``: an epoch marked
  ``pruning`` although in flight, the latest completed one, or kept by the retention policy that the
  cleanup run holding the lease recorded (``arroyo_cleanup_runs.policy``);
* ``pruned_while_in_flight``: pruning while another epoch was in flight (retention waits for it);
* ``pruned_without_lock``: pruning (or finishing a prune) without holding the lease;
* ``lock_conflict``: a lease acquired or taken over while another was live, or renewed / released
  by a run that no longer held it;
* ``history_order`` / ``interleaved_transactions`` / ``state_mismatch`` / ``table_mismatch`` /
  ``unknown_policy``: the history itself is not what the claims above need (out of order, a change
  from a state the epoch was not in, tables that disagree with the replay, a policy we cannot read).

Time rules. A trigger decides before it writes, so an epoch inserted at ``at`` while a lease
expiring after ``at`` exists is a breach, and one inserted after the lease expired is legitimate even
if no release was written (the holder crashed). A cleanup checks its lease before it writes too, so
a prune recorded just after its lease expired is legitimate unless another transaction of the
pipeline was recorded after the expiry and before the prune (the cleanup then ran after somebody
who could see the lease was dead). Retention is judged on the state just before the pruning
transaction, at its ``at``: later and with at least what the cleanup saw, so the policy keeps no
more than it kept when the cleanup decided (no false alarms).

Usage (tests, benchmarks, or ``python -m airflow_arroyo.devtools.history DSN``)::

    report = check_history(dsn)
    report.assert_clean()          # AssertionError listing every violation
    report.counts["completed"]     # figures of what the history holds
"""

from __future__ import annotations

import argparse
import enum
import json
import sys
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

import psycopg2
import psycopg2.extras
from psycopg2.extensions import connection as PgConnection

from airflow_arroyo.core.epochs import EPOCH_TRANSITIONS, EpochFacts, EpochState, RetentionPolicy, select_prunable
from airflow_arroyo.core.exceptions import ConfigurationError

__all__ = [
    "HistoryBase",
    "HistoryData",
    "HistoryEvent",
    "HistoryReport",
    "Violation",
    "ViolationKind",
    "check_history",
    "load_history",
    "replay",
]


class ViolationKind(enum.StrEnum):
    HISTORY_ORDER = "history_order"
    INTERLEAVED_TRANSACTIONS = "interleaved_transactions"
    STATE_MISMATCH = "state_mismatch"
    TWO_IN_FLIGHT = "two_in_flight"
    TRIGGERED_UNDER_LOCK = "triggered_under_cleanup_lock"
    EPOCH_NOT_INCREASING = "epoch_not_increasing"
    ILLEGAL_TRANSITION = "illegal_transition"
    PRUNED_IN_FLIGHT = "pruned_in_flight"
    PRUNED_LATEST_COMPLETED = "pruned_latest_completed"
    PRUNED_RETAINED = "pruned_retained"
    PRUNED_WHILE_IN_FLIGHT = "pruned_while_in_flight"
    PRUNED_WITHOUT_LOCK = "pruned_without_lock"
    LOCK_CONFLICT = "lock_conflict"
    UNKNOWN_POLICY = "unknown_policy"
    TABLE_MISMATCH = "table_mismatch"


@dataclass(frozen=True)
class HistoryEvent:
    """One row of ``arroyo_history``."""

    seq: int
    at: datetime
    txid: int
    pipeline_id: str
    kind: str  # epoch_state | lock_acquired | lock_renewed | lock_released
    epoch: int | None = None
    old_state: str | None = None
    new_state: str | None = None
    cleanup_run: int | None = None
    holder: str | None = None
    lock_expires_at: datetime | None = None


@dataclass(frozen=True)
class Violation:
    kind: ViolationKind
    pipeline_id: str
    seq: int | None
    message: str

    def __str__(self) -> str:
        where = f" (history seq {self.seq})" if self.seq is not None else ""
        return f"[{self.kind.value}] pipeline {self.pipeline_id}{where}: {self.message}"


@dataclass(frozen=True)
class EpochRow:
    """What the tables say of an epoch (times for the retention policy, state for the cross-check)."""

    state: str
    triggered_at: datetime
    ended_at: datetime | None


@dataclass
class HistoryData:
    """Everything the replay needs, read in one snapshot. ``epochs``/``locks``/``last_epochs`` are
    ``None`` when the tables are not to be cross-checked (synthetic histories)."""

    events: list[HistoryEvent]
    run_policies: dict[int, Mapping[str, Any]] = field(default_factory=dict)
    run_pruned: dict[int, list[int]] = field(default_factory=dict)
    epochs: dict[tuple[str, int], EpochRow] | None = None
    locks: dict[str, tuple[int, datetime]] | None = None
    last_epochs: dict[str, int] | None = None
    bases: dict[str, HistoryBase] = field(default_factory=dict)  # pipelines whose history was compacted


@dataclass(frozen=True)
class HistoryBase:
    """Where retention's compaction cut a pipeline's history (``arroyo_history_base``): events up to
    ``through_seq`` are gone (or going), epochs up to ``max_epoch`` were triggered before the cut, and
    cleanup runs up to ``cleanup_run`` ended by it. The replay starts at the cut."""

    through_seq: int
    max_epoch: int
    cleanup_run: int


@dataclass
class HistoryReport:
    violations: list[Violation]
    events: list[HistoryEvent]
    counts: Counter[str] = field(default_factory=Counter)  # over all pipelines
    per_pipeline: dict[str, Counter[str]] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.violations

    def kinds(self) -> set[ViolationKind]:
        return {v.kind for v in self.violations}

    def summary(self) -> str:
        figures = ", ".join(f"{k}={v}" for k, v in sorted(self.counts.items()))
        return f"{len(self.events)} events over {len(self.per_pipeline)} pipelines: {figures}"

    def assert_clean(self) -> None:
        if self.violations:
            shown = "\n".join(str(v) for v in self.violations[:50])
            more = f"\n... and {len(self.violations) - 50} more" if len(self.violations) > 50 else ""
            raise AssertionError(f"{len(self.violations)} protocol violations in arroyo_history "
                                 f"({self.summary()}):\n{shown}{more}")


# --------------------------------------------------------------------------- reading


def load_history(conn: PgConnection, pipeline_ids: Sequence[str] | None = None, *,
                 against_tables: bool = True) -> HistoryData:
    """Read the history (and, with ``against_tables``, the tables to cross-check) in one snapshot
    (a repeatable-read transaction of its own: ``conn`` must not be in a transaction)."""
    ids = list(pipeline_ids) if pipeline_ids is not None else None
    autocommit = conn.autocommit
    conn.autocommit = True  # so that BEGIN below opens the transaction, not psycopg2's implicit one
    with conn.cursor(cursor_factory=psycopg2.extras.RealDictCursor) as cur:
        cur.execute("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")
        try:
            cur.execute(
                "SELECT seq, at, txid, pipeline_id, kind, epoch, old_state, new_state, cleanup_run, holder,"
                " lock_expires_at FROM arroyo_history WHERE %(ids)s::text[] IS NULL OR pipeline_id = ANY(%(ids)s)"
                " ORDER BY pipeline_id, seq",
                {"ids": ids},
            )
            events = [HistoryEvent(**row) for row in cur.fetchall()]
            cur.execute(
                "SELECT id, policy, epochs_pruned FROM arroyo_cleanup_runs"
                " WHERE %(ids)s::text[] IS NULL OR pipeline_id = ANY(%(ids)s)",
                {"ids": ids},
            )
            runs = cur.fetchall()
            cur.execute(
                "SELECT pipeline_id, through_seq, max_epoch, cleanup_run FROM arroyo_history_base"
                " WHERE %(ids)s::text[] IS NULL OR pipeline_id = ANY(%(ids)s)",
                {"ids": ids},
            )
            bases = {r["pipeline_id"]: HistoryBase(int(r["through_seq"]), int(r["max_epoch"]), int(r["cleanup_run"]))
                     for r in cur.fetchall()}
            data = HistoryData(
                # compaction deletes up to the cut in batches: what is left of it is ignored
                events=[e for e in events if e.pipeline_id not in bases or e.seq > bases[e.pipeline_id].through_seq],
                run_policies={int(r["id"]): r["policy"] or {} for r in runs},
                run_pruned={int(r["id"]): [int(e) for e in r["epochs_pruned"] or []] for r in runs},
                bases=bases,
            )
            if against_tables:
                cur.execute(
                    "SELECT pipeline_id, epoch, state, triggered_at, ended_at FROM arroyo_epochs"
                    " WHERE %(ids)s::text[] IS NULL OR pipeline_id = ANY(%(ids)s)",
                    {"ids": ids},
                )
                data.epochs = {(r["pipeline_id"], int(r["epoch"])): EpochRow(r["state"], r["triggered_at"],
                                                                              r["ended_at"])
                               for r in cur.fetchall()}
                cur.execute(
                    "SELECT pipeline_id, cleanup_run, expires_at FROM arroyo_cleanup_locks"
                    " WHERE %(ids)s::text[] IS NULL OR pipeline_id = ANY(%(ids)s)",
                    {"ids": ids},
                )
                data.locks = {r["pipeline_id"]: (int(r["cleanup_run"]), r["expires_at"]) for r in cur.fetchall()}
                cur.execute(
                    "SELECT pipeline_id, last_epoch FROM arroyo_pipelines"
                    " WHERE %(ids)s::text[] IS NULL OR pipeline_id = ANY(%(ids)s)",
                    {"ids": ids},
                )
                data.last_epochs = {r["pipeline_id"]: int(r["last_epoch"]) for r in cur.fetchall()}
        finally:
            cur.execute("ROLLBACK")
            conn.autocommit = autocommit
    return data


def check_history(dsn_or_conn: str | PgConnection, pipeline_ids: Sequence[str] | None = None, *,
                  against_tables: bool = True) -> HistoryReport:
    """Load and replay the history of ``pipeline_ids`` (all pipelines when ``None``)."""
    if isinstance(dsn_or_conn, str):
        conn = psycopg2.connect(dsn_or_conn, application_name="arroyo-history-check")
        try:
            data = load_history(conn, pipeline_ids, against_tables=against_tables)
        finally:
            conn.close()
    else:
        data = load_history(dsn_or_conn, pipeline_ids, against_tables=against_tables)
    return replay(data)


# --------------------------------------------------------------------------- the replay (pure)


def policy_from_json(policy: Mapping[str, Any]) -> RetentionPolicy:
    """The :class:`RetentionPolicy` a cleanup run recorded (``keep_last``, ``keep_newer_than_s``;
    ``keep_newer_than`` as seconds or ``H:MM:SS`` is read too). Raises ConfigurationError."""
    keep_last = policy.get("keep_last")
    newer: Any = policy.get("keep_newer_than_s", policy.get("keep_newer_than"))
    keep_newer_than: timedelta | None = None
    if isinstance(newer, int | float) and not isinstance(newer, bool):
        keep_newer_than = timedelta(seconds=newer)
    elif isinstance(newer, str):
        try:
            keep_newer_than = timedelta(seconds=float(newer))
        except ValueError:
            parts = newer.split(":")
            if len(parts) != 3:
                raise ConfigurationError(f"cannot read keep_newer_than {newer!r}") from None
            h, m, s = parts
            days = 0
            if " day" in h:
                d, _, h = h.partition(", ")
                days = int(d.split()[0])
            keep_newer_than = timedelta(days=days, hours=int(h), minutes=int(m), seconds=float(s))
    elif newer is not None:
        raise ConfigurationError(f"cannot read keep_newer_than {newer!r}")
    return RetentionPolicy(keep_last=keep_last, keep_newer_than=keep_newer_than)


@dataclass
class _Lease:
    run: int
    holder: str | None
    expires_at: datetime


@dataclass
class _Pipeline:
    """The replayed state of one pipeline."""

    pipeline_id: str
    states: dict[int, EpochState] = field(default_factory=dict)
    first_at: dict[int, datetime] = field(default_factory=dict)
    ended_at: dict[int, datetime] = field(default_factory=dict)
    max_epoch: int = 0
    seeded: bool = False  # the history was compacted: the replay starts at the cut (see _Replay.seed)
    lease: _Lease | None = None
    # the transaction being replayed
    txid: int | None = None
    tx_states: dict[int, EpochState] = field(default_factory=dict)  # states just before it
    tx_prev_at: datetime | None = None  # ``at`` of the last event of the transaction before it
    tx_released: _Lease | None = None  # a lease released in it (a takeover releases, then acquires)
    seen_txids: set[int] = field(default_factory=set)
    last_at: datetime | None = None
    pruned_by_run: dict[int, set[int]] = field(default_factory=dict)

    def in_flight(self) -> list[int]:
        return sorted(e for e, s in self.states.items() if s is EpochState.TRIGGERED)


class _Replay:
    def __init__(self, data: HistoryData) -> None:
        self.data = data
        self.violations: list[Violation] = []
        self.counts: Counter[str] = Counter()
        self.per_pipeline: dict[str, Counter[str]] = {}
        self.policies: dict[int, RetentionPolicy | str] = {}

    def flag(self, kind: ViolationKind, p: _Pipeline, ev: HistoryEvent | None, message: str) -> None:
        self.violations.append(Violation(kind, p.pipeline_id, ev.seq if ev else None, message))

    def count(self, p: _Pipeline, what: str) -> None:
        self.counts[what] += 1
        self.per_pipeline.setdefault(p.pipeline_id, Counter())[what] += 1

    def policy(self, run: int) -> RetentionPolicy | str:
        if run not in self.policies:
            recorded = self.data.run_policies.get(run)
            if recorded is None:
                self.policies[run] = f"cleanup run {run} is not in arroyo_cleanup_runs"
            else:
                try:
                    self.policies[run] = policy_from_json(recorded)
                except (ConfigurationError, TypeError, ValueError) as exc:
                    self.policies[run] = f"cleanup run {run} recorded policy {dict(recorded)!r}: {exc}"
        return self.policies[run]

    # ------------------------------------------------------------------ per pipeline

    def run(self) -> list[_Pipeline]:
        by_pipeline: dict[str, list[HistoryEvent]] = {pipeline_id: [] for pipeline_id in self.data.bases}
        for ev in self.data.events:
            by_pipeline.setdefault(ev.pipeline_id, []).append(ev)
        done = []
        for pipeline_id in sorted(by_pipeline):
            p = _Pipeline(pipeline_id)
            events = sorted(by_pipeline[pipeline_id], key=lambda e: e.seq)
            base = self.data.bases.get(pipeline_id)
            if base is not None:
                events = [ev for ev in events if ev.seq > base.through_seq]
                self.seed(p, base, events)
            for ev in events:
                self.event(p, ev)
            done.append(p)
        return done

    def seed(self, p: _Pipeline, base: HistoryBase, events: Sequence[HistoryEvent]) -> None:
        """Start a compacted pipeline at its cut: no lease was held there (the cut is a release), and
        each epoch triggered by then was in the state its first later event changes it from, or, with
        no later event, the state the table has it in. Without the tables (synthetic histories), such
        an epoch is seeded from its first later event when the replay meets it (:meth:`epoch_event`)."""
        p.max_epoch = base.max_epoch
        p.seeded = True
        if self.data.epochs is None:
            return
        first_old: dict[int, str] = {}
        for ev in events:
            if ev.kind == "epoch_state" and ev.epoch is not None and ev.old_state is not None:
                first_old.setdefault(ev.epoch, ev.old_state)
        for (pipeline_id, epoch), row in self.data.epochs.items():
            if pipeline_id != p.pipeline_id or epoch > base.max_epoch:
                continue
            try:
                p.states[epoch] = EpochState(first_old.get(epoch, row.state))
            except ValueError:
                continue  # epoch_event reports the unknown state
            p.first_at[epoch] = row.triggered_at
            if row.ended_at is not None:
                p.ended_at[epoch] = row.ended_at

    def event(self, p: _Pipeline, ev: HistoryEvent) -> None:
        self.count(p, "events")
        if p.last_at is not None and ev.at < p.last_at:
            self.flag(ViolationKind.HISTORY_ORDER, p, ev,
                      f"recorded at {ev.at.isoformat()}, before the previous event ({p.last_at.isoformat()}): "
                      "seq order is not commit order, so its writers did not serialise on the pipeline")
        if ev.txid != p.txid:
            if ev.txid in p.seen_txids:
                self.flag(ViolationKind.INTERLEAVED_TRANSACTIONS, p, ev,
                          f"transaction {ev.txid} wrote events before and after another transaction's")
            p.seen_txids.add(ev.txid)
            p.tx_prev_at = p.last_at
            p.txid = ev.txid
            p.tx_states = dict(p.states)
            p.tx_released = None
        p.last_at = ev.at
        if ev.kind == "epoch_state":
            self.epoch_event(p, ev)
        elif ev.kind in ("lock_acquired", "lock_renewed", "lock_released"):
            self.lock_event(p, ev)
        else:
            self.flag(ViolationKind.STATE_MISMATCH, p, ev, f"unknown history kind {ev.kind!r}")

    def lease_live(self, p: _Pipeline, at: datetime) -> bool:
        return p.lease is not None and at < p.lease.expires_at

    def lease_held_by_writer(self, p: _Pipeline) -> bool:
        """Could the writer of the current transaction have seen the current lease as live? Not if a
        transaction recorded after the lease expired ran before it (see the module docstring)."""
        if p.lease is None:
            return False
        return p.tx_prev_at is None or p.tx_prev_at < p.lease.expires_at

    def lock_event(self, p: _Pipeline, ev: HistoryEvent) -> None:
        run = ev.cleanup_run
        if ev.kind == "lock_acquired":
            self.count(p, "lock_acquired")
            if p.lease is not None:
                self.flag(ViolationKind.LOCK_CONFLICT, p, ev,
                          f"cleanup run {run} acquired the lock while run {p.lease.run} still had it "
                          "(no release recorded)")
            elif p.tx_released is not None:
                self.count(p, "lock_takeover")
                if ev.at < p.tx_released.expires_at:
                    self.flag(ViolationKind.LOCK_CONFLICT, p, ev,
                              f"cleanup run {run} took over the lease of run {p.tx_released.run} at "
                              f"{ev.at.isoformat()}, before it expired ({p.tx_released.expires_at.isoformat()})")
            if run is None or ev.lock_expires_at is None:
                self.flag(ViolationKind.STATE_MISMATCH, p, ev, "lock event without cleanup run or expiry")
                p.lease = None
                return
            p.lease = _Lease(run, ev.holder, ev.lock_expires_at)
            return
        if p.lease is None or p.lease.run != run:
            held = f"run {p.lease.run}" if p.lease else "nobody"
            self.flag(ViolationKind.LOCK_CONFLICT, p, ev,
                      f"cleanup run {run}: {ev.kind} of a lease it does not hold ({held} holds it)")
            return
        if ev.kind == "lock_renewed":
            self.count(p, "lock_renewed")
            if not self.lease_held_by_writer(p):
                self.flag(ViolationKind.LOCK_CONFLICT, p, ev,
                          f"cleanup run {run} renewed its lease after it expired "
                          f"({p.lease.expires_at.isoformat()}) and another transaction ran")
            if ev.lock_expires_at is not None:
                p.lease = _Lease(p.lease.run, ev.holder, ev.lock_expires_at)
        else:
            self.count(p, "lock_released")
            p.tx_released = p.lease
            p.lease = None

    def epoch_event(self, p: _Pipeline, ev: HistoryEvent) -> None:
        epoch = ev.epoch
        if epoch is None:
            self.flag(ViolationKind.STATE_MISMATCH, p, ev, "epoch_state event without an epoch number")
            return
        try:
            new = EpochState(ev.new_state or "")
        except ValueError:
            self.flag(ViolationKind.ILLEGAL_TRANSITION, p, ev, f"epoch {epoch}: unknown state {ev.new_state!r}")
            return
        if ev.old_state is None:
            self.insert(p, ev, epoch, new)
            return
        try:
            old = EpochState(ev.old_state)
        except ValueError:
            self.flag(ViolationKind.ILLEGAL_TRANSITION, p, ev, f"epoch {epoch}: unknown state {ev.old_state!r}")
            return
        current = p.states.get(epoch)
        if current is None and p.seeded and epoch <= p.max_epoch:
            # triggered before the compaction cut: its earlier events are gone
            current = p.states[epoch] = old
            p.first_at.setdefault(epoch, ev.at)
        if current is None:
            self.flag(ViolationKind.STATE_MISMATCH, p, ev,
                      f"epoch {epoch} changed {old.value} -> {new.value} but was never triggered")
        elif current is not old:
            self.flag(ViolationKind.STATE_MISMATCH, p, ev,
                      f"epoch {epoch} changed from {old.value} but the history has it {current.value}")
        if new not in EPOCH_TRANSITIONS[old]:
            self.flag(ViolationKind.ILLEGAL_TRANSITION, p, ev, f"epoch {epoch}: {old.value} -> {new.value}")
        if new is EpochState.PRUNING:
            self.check_pruning(p, ev, epoch, old)
        elif new is EpochState.PRUNED:
            self.check_pruned(p, ev, epoch)
        p.states[epoch] = new
        if old is EpochState.TRIGGERED:
            p.ended_at.setdefault(epoch, ev.at)
        self.count(p, new.value)

    def insert(self, p: _Pipeline, ev: HistoryEvent, epoch: int, new: EpochState) -> None:
        self.count(p, "inserted")
        if new is not EpochState.TRIGGERED:
            self.flag(ViolationKind.ILLEGAL_TRANSITION, p, ev, f"epoch {epoch} created as {new.value}, not triggered")
        if epoch <= p.max_epoch:
            self.flag(ViolationKind.EPOCH_NOT_INCREASING, p, ev,
                      f"epoch {epoch} triggered after epoch {p.max_epoch}")
        in_flight = p.in_flight()
        if in_flight:
            self.flag(ViolationKind.TWO_IN_FLIGHT, p, ev,
                      f"epoch {epoch} triggered while epoch {', '.join(map(str, in_flight))} was in flight")
        if self.lease_live(p, ev.at):
            assert p.lease is not None
            self.flag(ViolationKind.TRIGGERED_UNDER_LOCK, p, ev,
                      f"epoch {epoch} triggered at {ev.at.isoformat()} while cleanup run {p.lease.run} "
                      f"({p.lease.holder}) held the lock until {p.lease.expires_at.isoformat()}")
        p.max_epoch = max(p.max_epoch, epoch)
        p.states[epoch] = new
        p.first_at.setdefault(epoch, ev.at)
        self.count(p, new.value)

    def check_lease_for_prune(self, p: _Pipeline, ev: HistoryEvent, what: str) -> int | None:
        if p.lease is None:
            self.flag(ViolationKind.PRUNED_WITHOUT_LOCK, p, ev, f"{what} while no cleanup run held the lock")
            return None
        if not self.lease_held_by_writer(p):
            self.flag(ViolationKind.PRUNED_WITHOUT_LOCK, p, ev,
                      f"{what} under the lease of cleanup run {p.lease.run}, which expired at "
                      f"{p.lease.expires_at.isoformat()} before another transaction of the pipeline")
        return p.lease.run

    def check_pruning(self, p: _Pipeline, ev: HistoryEvent, epoch: int, old: EpochState) -> None:
        run = self.check_lease_for_prune(p, ev, f"epoch {epoch} marked pruning")
        before = p.tx_states
        others = sorted(e for e, s in before.items() if s is EpochState.TRIGGERED and e != epoch)
        if others:
            self.flag(ViolationKind.PRUNED_WHILE_IN_FLIGHT, p, ev,
                      f"epoch {epoch} marked pruning while epoch {', '.join(map(str, others))} was in flight")
        # the rules below are checked in order of strength; a breach of one makes the next moot
        if before.get(epoch) is EpochState.TRIGGERED or old is EpochState.TRIGGERED:
            self.flag(ViolationKind.PRUNED_IN_FLIGHT, p, ev, f"epoch {epoch} was in flight when marked pruning")
            return
        completed = [e for e, s in before.items() if s is EpochState.COMPLETED]
        if completed and epoch == max(completed):
            self.flag(ViolationKind.PRUNED_LATEST_COMPLETED, p, ev,
                      f"epoch {epoch} was the latest completed epoch when marked pruning")
            return
        if run is None:
            return
        policy = self.policy(run)
        if isinstance(policy, str):
            self.flag(ViolationKind.UNKNOWN_POLICY, p, ev, f"epoch {epoch} pruned: cannot check retention: {policy}")
            return
        facts = [self.facts(p, e, s) for e, s in before.items()]
        selection = select_prunable(facts, policy, ev.at)
        if epoch in selection.keep:
            self.flag(ViolationKind.PRUNED_RETAINED, p, ev,
                      f"epoch {epoch} marked pruning by cleanup run {run} although {policy} keeps it "
                      f"({selection.reasons.get(epoch)})")

    def check_pruned(self, p: _Pipeline, ev: HistoryEvent, epoch: int) -> None:
        run = self.check_lease_for_prune(p, ev, f"epoch {epoch} marked pruned")
        if run is not None:
            p.pruned_by_run.setdefault(run, set()).add(epoch)

    def facts(self, p: _Pipeline, epoch: int, state: EpochState) -> EpochFacts:
        row = self.data.epochs.get((p.pipeline_id, epoch)) if self.data.epochs is not None else None
        if row is not None:
            return EpochFacts(epoch, state, row.triggered_at, row.ended_at)
        return EpochFacts(epoch, state, p.first_at[epoch], p.ended_at.get(epoch))

    # ------------------------------------------------------------------ against the tables

    def cross_check(self, pipelines: Iterable[_Pipeline]) -> None:
        data = self.data
        by_id = {p.pipeline_id: p for p in pipelines}
        pruned_by_run: dict[int, tuple[_Pipeline, set[int]]] = {}
        for p in by_id.values():
            for run, epochs in p.pruned_by_run.items():
                pruned_by_run[run] = (p, epochs)
        for run, listed in data.run_pruned.items():
            base = data.bases.get(pruned_by_run[run][0].pipeline_id) if run in pruned_by_run else None
            if base is not None and run <= base.cleanup_run:
                continue  # its events were before the compaction cut (the run row goes in a later batch)
            if run in pruned_by_run:
                p, seen = pruned_by_run[run]
                extra = sorted(set(listed) - seen)
                if extra:
                    self.flag(ViolationKind.TABLE_MISMATCH, p, None,
                              f"cleanup run {run} lists epochs {extra} as pruned, but they were not pruned "
                              "under its lease")
        if data.epochs is None:
            return
        for (pipeline_id, epoch), row in sorted(data.epochs.items()):
            p = by_id.get(pipeline_id) or _Pipeline(pipeline_id)
            replayed = p.states.get(epoch)
            if replayed is None:
                self.flag(ViolationKind.TABLE_MISMATCH, p, None, f"epoch {epoch} ({row.state}) has no history")
            elif replayed.value != row.state:
                self.flag(ViolationKind.TABLE_MISMATCH, p, None,
                          f"epoch {epoch} is {row.state} in arroyo_epochs but {replayed.value} in the history")
        for p in by_id.values():
            for epoch in sorted(set(p.states) - {e for (pid, e) in data.epochs if pid == p.pipeline_id}):
                self.flag(ViolationKind.TABLE_MISMATCH, p, None, f"epoch {epoch} is in the history, not the table")
            lock = (data.locks or {}).get(p.pipeline_id)
            replayed_lock = (p.lease.run, p.lease.expires_at) if p.lease else None
            if lock != replayed_lock:
                self.flag(ViolationKind.TABLE_MISMATCH, p, None,
                          f"cleanup lock is {lock} in arroyo_cleanup_locks but {replayed_lock} in the history")
            last = (data.last_epochs or {}).get(p.pipeline_id)
            if last is not None and last < p.max_epoch:
                self.flag(ViolationKind.TABLE_MISMATCH, p, None,
                          f"arroyo_pipelines.last_epoch is {last}, below epoch {p.max_epoch} in the history")


def replay(data: HistoryData) -> HistoryReport:
    """Replay every pipeline's history and report the violations (pure: no I/O)."""
    r = _Replay(data)
    pipelines = r.run()
    r.cross_check(pipelines)
    return HistoryReport(violations=r.violations, events=list(data.events), counts=r.counts,
                         per_pipeline=r.per_pipeline)


# --------------------------------------------------------------------------- command line


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Check the epoch store's history for protocol violations.")
    parser.add_argument("dsn", help="PostgreSQL DSN of the epoch store")
    parser.add_argument("--pipeline", action="append", help="only this pipeline (repeatable)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    report = check_history(args.dsn, args.pipeline)
    if args.json:
        print(json.dumps({"ok": report.ok, "counts": dict(report.counts),
                          "violations": [{"kind": v.kind.value, "pipeline_id": v.pipeline_id, "seq": v.seq,
                                          "message": v.message} for v in report.violations]}, indent=2))
    else:
        print(report.summary())
        for v in report.violations:
            print(v)
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
