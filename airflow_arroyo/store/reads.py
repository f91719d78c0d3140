"""Read-only queries of the epoch store, one method per page of the UI, each in one read-only snapshot.

:class:`StoreReader` is how everything that only looks at the store (the UI plugin, its JSON API, the
benchmarks) reads it: the same records (:mod:`airflow_arroyo.store.records`), column lists, connection
pool and retry rule as :class:`~airflow_arroyo.store.EpochStore`, on connections that cannot write.

Every query is parameterised, bounded (``LIMIT``) and driven by an index of migration 0001:

* a page of pipelines: ``arroyo_pipelines`` primary key (keyset pagination on ``pipeline_id``);
* the last completed epoch of each pipeline on the page: a ``LATERAL ... ORDER BY epoch DESC LIMIT 1``
  on ``arroyo_epochs_by_state (pipeline_id, state, epoch DESC)``, one index probe per pipeline;
* the in-flight epoch: the partial unique index ``arroyo_epochs_one_in_flight``;
* the few newest epochs (failure streak, overdue check): a backward scan of the primary key,
  ``LIMIT`` :data:`RECENT_WINDOW` per pipeline;
* a page of a pipeline's epochs: the primary key (keyset pagination on ``epoch``);
* an epoch's acknowledgements: the ``arroyo_acks`` primary key prefix;
* cleanup runs: ``arroyo_cleanup_runs_by_pipeline (pipeline_id, id DESC)``; the lock: its primary key;
* a supervised pipeline's newest restarts: the ``arroyo_restarts`` primary key prefix (migration 0011), one
  row per failure a supervisor noticed, ``LIMIT`` :data:`RESTARTS_SHOWN`.
* a pipeline's commit gates (migration 0014): the open ones on the partial index ``arroyo_gates_open``; the
  newest closed ones per gated sink on the primary key ``(pipeline_id, sink, epoch)``, the sinks found by a loose
  index scan of it, ``LIMIT`` :data:`CLOSED_GATES_SHOWN` each.

No page reads all epochs of a pipeline, let alone of all pipelines. The connections are opened with
``default_transaction_read_only=on``: the UI cannot write to the epoch store even by mistake.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, TypeVar

from psycopg2.extras import RealDictCursor as PgCursor

from airflow_arroyo.core.epochs import EpochState, consecutive_failures, validate_pipeline_id
from airflow_arroyo.core.exceptions import ConfigurationError, UnknownEpochError, UnknownPipelineError
from airflow_arroyo.core.gates import OPEN_GATE_STATES, GateRecord
from airflow_arroyo.core.summary import CheckpointSummary
from airflow_arroyo.store._db import Database, OnDatabase, redact_dsn
from airflow_arroyo.store.epochs import Epochs
from airflow_arroyo.store.objects import Objects
from airflow_arroyo.store.pipelines import Pipelines
from airflow_arroyo.store.records import (
    AckRecord,
    CleanupLockRecord,
    CleanupRunRecord,
    EpochRecord,
    PipelineRecord,
    RestartRecord,
    SinkCommitRecord,
    SnapshotEntry,
    epoch_columns,
    from_row,
)
from airflow_arroyo.store.shadows import ShadowRecord, Shadows
from airflow_arroyo.store.sink_commits import SinkCommits

__all__ = [
    "MAX_PAGE_SIZE",
    "RECENT_WINDOW",
    "RESTARTS_SHOWN",
    "CLOSED_GATES_SHOWN",
    "EpochDetail",
    "EpochsPage",
    "PipelineOverview",
    "PipelinePage",
    "PipelinesPage",
    "RecordReads",
    "RetentionPage",
    "StoreReader",
]

log = logging.getLogger(__name__)

T = TypeVar("T")

#: How many of a pipeline's newest epochs the overview reads (failure streak, last trigger).
RECENT_WINDOW = 10
#: The largest page any query returns, whatever the caller asks for.
MAX_PAGE_SIZE = 500
#: How many of a supervised pipeline's newest restarts its page shows (``airflow-arroyo restarts``: all).
RESTARTS_SHOWN = 50
#: How many of a pipeline's newest closed gates (committed, quarantined, superseded) its page shows, per gated
#: sink; every open gate is shown (``airflow-arroyo gate list --all``: every gate).
CLOSED_GATES_SHOWN = 20
#: A bound on the open gates read (a hold policy stops the pipeline long before: ``Gate.max_waiting``).
OPEN_GATES_SHOWN = 200

_EPOCH_COLS = epoch_columns("e")

# --------------------------------------------------------------------------- SQL (named, parameterised)

SQL_PIPELINES_PAGE = (
    "SELECT * FROM arroyo_pipelines"
    " WHERE (%(after)s::text IS NULL OR pipeline_id > %(after)s)"
    " ORDER BY pipeline_id LIMIT %(limit)s"
)
SQL_PIPELINE = "SELECT * FROM arroyo_pipelines WHERE pipeline_id = %(p)s"
SQL_FORKS = ("SELECT * FROM arroyo_pipelines WHERE forked_from_pipeline = %(p)s"
             " ORDER BY forked_from_epoch, pipeline_id")

SQL_LAST_COMPLETED = (
    f"SELECT {_EPOCH_COLS} FROM unnest(%(ids)s::text[]) AS ids(pipeline_id)"  # noqa: S608 - constant columns
    " CROSS JOIN LATERAL (SELECT * FROM arroyo_epochs x WHERE x.pipeline_id = ids.pipeline_id"
    "   AND x.state = 'completed' ORDER BY x.epoch DESC LIMIT 1) e"
)
SQL_IN_FLIGHT = (
    f"SELECT {_EPOCH_COLS} FROM arroyo_epochs e"  # noqa: S608 - constant columns
    " WHERE e.pipeline_id = ANY(%(ids)s::text[]) AND e.state = 'triggered'"
)
SQL_RECENT = (
    f"SELECT {_EPOCH_COLS} FROM unnest(%(ids)s::text[]) AS ids(pipeline_id)"  # noqa: S608 - constant columns
    " CROSS JOIN LATERAL (SELECT * FROM arroyo_epochs x WHERE x.pipeline_id = ids.pipeline_id"
    "   ORDER BY x.epoch DESC LIMIT %(window)s) e"
    " ORDER BY e.pipeline_id, e.epoch DESC"
)
#: The fork point of each fork among the pipelines (a fork that has not completed an epoch of its own still
#: needs it; a missing row is a fork point no longer recorded).
SQL_FORK_POINTS = (
    f"SELECT p.pipeline_id AS fork_id, {_EPOCH_COLS} FROM arroyo_pipelines p"  # noqa: S608 - constant columns
    " JOIN arroyo_epochs e ON e.pipeline_id = p.forked_from_pipeline AND e.epoch = p.forked_from_epoch"
    " WHERE p.pipeline_id = ANY(%(ids)s::text[])"
)
SQL_LIVE_LOCKS = (
    "SELECT * FROM arroyo_cleanup_locks"
    " WHERE pipeline_id = ANY(%(ids)s::text[]) AND expires_at > clock_timestamp()"
)
SQL_EPOCHS_BEFORE = (
    f"SELECT {_EPOCH_COLS} FROM arroyo_epochs e WHERE e.pipeline_id = %(p)s"  # noqa: S608 - constant columns
    " AND (%(before)s::bigint IS NULL OR e.epoch < %(before)s)"
    " ORDER BY e.epoch DESC LIMIT %(limit)s"
)
SQL_EPOCHS_AFTER = (
    f"SELECT {_EPOCH_COLS} FROM arroyo_epochs e WHERE e.pipeline_id = %(p)s"  # noqa: S608 - constant columns
    " AND e.epoch > %(after)s ORDER BY e.epoch ASC LIMIT %(limit)s"
)
SQL_EPOCH_EXISTS_BEFORE = "SELECT 1 FROM arroyo_epochs WHERE pipeline_id = %(p)s AND epoch < %(epoch)s LIMIT 1"
SQL_EPOCH_EXISTS_AFTER = "SELECT 1 FROM arroyo_epochs WHERE pipeline_id = %(p)s AND epoch > %(epoch)s LIMIT 1"
SQL_EPOCH = (
    f"SELECT {_EPOCH_COLS} FROM arroyo_epochs e"  # noqa: S608 - constant columns
    " WHERE e.pipeline_id = %(p)s AND e.epoch = %(epoch)s"
)
#: Flink's checkpoint summary: counts, and p50/p99 (nearest rank, as airflow_arroyo.core.summary.percentile)
#: of the duration and size of every successful checkpoint. Counted by outcome, which pruning keeps: a
#: pruned epoch still completed, failed or expired.
SQL_SUMMARY = (
    "WITH e AS (SELECT outcome, extract(epoch FROM ended_at - triggered_at)::float8 AS duration_s,"
    " bytes_total::float8 AS size, outcome IS NOT DISTINCT FROM 'completed' AS ok"
    " FROM arroyo_epochs WHERE pipeline_id = %(p)s)"
    " SELECT count(*) FILTER (WHERE ok) AS completed,"
    " count(*) FILTER (WHERE outcome = 'failed') AS failed,"
    " count(*) FILTER (WHERE outcome = 'expired') AS expired,"
    " percentile_disc(0.5) WITHIN GROUP (ORDER BY duration_s) FILTER (WHERE ok) AS duration_p50_s,"
    " percentile_disc(0.99) WITHIN GROUP (ORDER BY duration_s) FILTER (WHERE ok) AS duration_p99_s,"
    " percentile_disc(0.5) WITHIN GROUP (ORDER BY size) FILTER (WHERE ok AND size IS NOT NULL) AS size_p50,"
    " percentile_disc(0.99) WITHIN GROUP (ORDER BY size) FILTER (WHERE ok AND size IS NOT NULL) AS size_p99"
    " FROM e"
)
SQL_ACKS = "SELECT * FROM arroyo_acks WHERE pipeline_id = %(p)s AND epoch = %(epoch)s ORDER BY acked_at, stage"
SQL_LOCK = "SELECT *, expires_at > clock_timestamp() AS live FROM arroyo_cleanup_locks WHERE pipeline_id = %(p)s"
SQL_CLEANUP_RUNS = (
    "SELECT * FROM arroyo_cleanup_runs WHERE pipeline_id = %(p)s"
    " AND (%(before_id)s::bigint IS NULL OR id < %(before_id)s)"
    " ORDER BY id DESC LIMIT %(limit)s"
)
SQL_RESTARTS = (
    "SELECT * FROM arroyo_restarts WHERE pipeline_id = %(p)s"
    " ORDER BY failed_at DESC, attempt DESC LIMIT %(limit)s"
)
# ``details`` (where the output waits: possibly many file names) is left out: the page does not show it.
_GATE_COLS = ("pipeline_id, sink, epoch, run_id, uri, policy, batch_from, batch_to, state, opened_at, deadline,"
              " decided_by, reason, decided_at, closed_at, seq")
_OPEN_GATES = "ARRAY[" + ", ".join(f"'{s.value}'" for s in sorted(OPEN_GATE_STATES)) + "]"
SQL_OPEN_GATES = (
    f"SELECT {_GATE_COLS} FROM arroyo_gates WHERE pipeline_id = %(p)s"  # noqa: S608 - constant columns
    f" AND state = ANY({_OPEN_GATES}) ORDER BY epoch, sink LIMIT %(limit)s"
)
SQL_CLOSED_GATES = (
    "WITH RECURSIVE sinks(sink) AS ("  # noqa: S608 - constant columns and states
    "   (SELECT sink FROM arroyo_gates WHERE pipeline_id = %(p)s ORDER BY sink LIMIT 1)"
    "   UNION ALL SELECT (SELECT g.sink FROM arroyo_gates g WHERE g.pipeline_id = %(p)s AND g.sink > s.sink"
    "     ORDER BY g.sink LIMIT 1) FROM sinks s WHERE s.sink IS NOT NULL)"
    f" SELECT c.* FROM sinks s CROSS JOIN LATERAL (SELECT {_GATE_COLS} FROM arroyo_gates g"
    f"   WHERE g.pipeline_id = %(p)s AND g.sink = s.sink AND g.state <> ALL({_OPEN_GATES})"
    "   ORDER BY g.epoch DESC LIMIT %(limit)s) c WHERE s.sink IS NOT NULL"
    " ORDER BY c.epoch DESC, c.sink"
)
SQL_NOW = "SELECT clock_timestamp() AS now"


# --------------------------------------------------------------------------- what the pages get


@dataclass(frozen=True)
class PipelineOverview:
    """A pipeline and the few facts about its epochs that its row in a list needs."""

    pipeline: PipelineRecord
    now: datetime  # the database's clock, read in the same snapshot
    last_completed: EpochRecord | None = None
    in_flight: EpochRecord | None = None
    recent: list[EpochRecord] = field(default_factory=list)  # newest first, at most RECENT_WINDOW
    cleanup_lock: CleanupLockRecord | None = None  # an unexpired lease, if any
    fork_point: EpochRecord | None = None  # a fork's: the epoch of its source it starts from

    @property
    def consecutive_failures(self) -> int:
        """Failed/expired epochs since the newest completed one, as far as the recent window sees."""
        return consecutive_failures(r.state for r in self.recent)

    @property
    def failure_streak_capped(self) -> bool:
        """True when every epoch of the (full) recent window failed: the streak may be longer."""
        return len(self.recent) >= RECENT_WINDOW and self.consecutive_failures >= RECENT_WINDOW

    @property
    def last_failure(self) -> EpochRecord | None:
        """The newest epoch among the recent ones that failed or expired."""
        return next((r for r in self.recent if r.state.ended_unsuccessfully), None)

    @property
    def latest(self) -> EpochRecord | None:
        """The newest epoch."""
        return self.recent[0] if self.recent else None

    @property
    def last_completed_age_s(self) -> float | None:
        """Seconds since the last completed epoch ended (None if none did)."""
        if self.last_completed is None or self.last_completed.ended_at is None:
            return None
        return (self.now - self.last_completed.ended_at).total_seconds()


@dataclass(frozen=True)
class PipelinesPage:
    """One page of the pipelines list."""
    items: list[PipelineOverview]
    now: datetime
    next_after: str | None  # pass as ``after`` for the next page; None on the last page


@dataclass(frozen=True)
class EpochsPage:
    """One page of a pipeline's epochs, newest first."""
    epochs: list[EpochRecord]  # newest first
    older_before: int | None  # pass as ``before`` for older epochs; None when there are none
    newer_after: int | None  # pass as ``after`` for newer epochs; None when there are none


@dataclass(frozen=True)
class PipelinePage:
    """A pipeline's page: its overview, a page of epochs and the history's summary."""
    overview: PipelineOverview
    epochs: EpochsPage
    summary: CheckpointSummary | None = None  # of the whole history, not just this page
    forks: list[PipelineRecord] = field(default_factory=list)  # pipelines forked from this one (migration 0009)
    # a supervisor's record of its failures and restarts (migration 0011), newest first, at most RESTARTS_SHOWN
    restarts: list[RestartRecord] = field(default_factory=list)
    more_restarts: bool = False  # older restarts than those in ``restarts`` exist
    # commit gates (migration 0014): the open ones by epoch, then the newest closed ones (CLOSED_GATES_SHOWN a sink)
    gates: list[GateRecord] = field(default_factory=list)


@dataclass(frozen=True)
class EpochDetail:
    """One epoch with its acknowledgements and the stages still pending."""
    pipeline: PipelineRecord
    epoch: EpochRecord
    acks: list[AckRecord]  # in acknowledgement order
    now: datetime
    expected_stages: list[str] = field(default_factory=list)

    @property
    def pending_stages(self) -> list[str]:
        """Stages that must acknowledge and have not (the interesting part of an in-flight epoch)."""
        acked = {a.stage for a in self.acks}
        return [s for s in self.expected_stages if s not in acked]


@dataclass(frozen=True)
class RetentionPage:
    """A pipeline's cleanup lock and a page of its cleanup runs."""
    pipeline: PipelineRecord
    now: datetime
    lock: CleanupLockRecord | None  # the lock row, live or expired
    lock_live: bool
    runs: list[CleanupRunRecord]  # newest first
    next_before_id: int | None


# --------------------------------------------------------------------------- the queries


def _one_row(cur: PgCursor) -> dict[str, Any]:
    row = cur.fetchone()
    assert row is not None  # an aggregate always returns one row
    return dict(row)


def _page_size(limit: int) -> int:
    if not isinstance(limit, int) or limit < 1:
        raise ConfigurationError(f"page size must be a whole number >= 1, got {limit!r}")
    return min(limit, MAX_PAGE_SIZE)


class RecordReads:
    """The store's own record reads (the same queries as :class:`~airflow_arroyo.store.EpochStore`'s) over a
    reader's read-only database: what the Airflow-free use cases that take a store read through, for the UI
    (:mod:`airflow_arroyo.core.provenance`). Each read is its own transaction; a write cannot happen (the connections
    refuse it), and none is offered."""

    def __init__(self, db: Database) -> None:
        if not db.read_only:
            raise ConfigurationError("RecordReads needs a read-only database (Database(..., read_only=True))")
        self._pipelines, self._epochs, self._objects, self._sinks = Pipelines(db), Epochs(db), Objects(db), \
            SinkCommits(db)
        self._shadows = Shadows(db)

    def get_pipeline(self, pipeline_id: str) -> PipelineRecord:
        """:meth:`~airflow_arroyo.store.pipelines.Pipelines.get_pipeline`."""
        return self._pipelines.get_pipeline(pipeline_id)

    def get_epoch(self, pipeline_id: str, epoch: int) -> EpochRecord:
        """:meth:`~airflow_arroyo.store.epochs.Epochs.get_epoch`."""
        return self._epochs.get_epoch(pipeline_id, epoch)

    def list_epochs(self, pipeline_id: str, *, limit: int = 100, before: int | None = None,
                    states: Iterable[EpochState] | None = None) -> list[EpochRecord]:
        """:meth:`~airflow_arroyo.store.epochs.Epochs.list_epochs`."""
        return self._epochs.list_epochs(pipeline_id, limit=limit, before=before, states=states)

    def acks(self, pipeline_id: str, epoch: int) -> list[AckRecord]:
        """:meth:`~airflow_arroyo.store.epochs.Epochs.acks`."""
        return self._epochs.acks(pipeline_id, epoch)

    def snapshot_entries(self, pipeline_id: str, epoch: int, stage: str) -> list[SnapshotEntry]:
        """:meth:`~airflow_arroyo.store.objects.Objects.snapshot_entries`."""
        return self._objects.snapshot_entries(pipeline_id, epoch, stage)

    def sink_commits(self, pipeline_id: str, *, after_seq: int = 0, sink: str | None = None,
                     limit: int = 100) -> list[SinkCommitRecord]:
        """:meth:`~airflow_arroyo.store.sink_commits.SinkCommits.sink_commits`."""
        return self._sinks.sink_commits(pipeline_id, after_seq=after_seq, sink=sink, limit=limit)

    def get_shadow(self, shadow_id: str) -> ShadowRecord:
        """:meth:`~airflow_arroyo.store.shadows.Shadows.get_shadow`."""
        return self._shadows.get_shadow(shadow_id)

    def shadows_of(self, live_id: str) -> list[ShadowRecord]:
        """:meth:`~airflow_arroyo.store.shadows.Shadows.shadows_of`."""
        return self._shadows.shadows_of(live_id)


class StoreReader(OnDatabase):
    """Read-only access to the epoch store. Thread-safe; a small pool of read-only connections.

    Each public method reads everything one page needs in one ``REPEATABLE READ READ ONLY``
    transaction, so that a page is a consistent snapshot.
    """

    def __init__(self, dsn: str, *, max_connections: int = 4, retry_seconds: float = 5.0,
                 statement_timeout_ms: int = 10_000, application_name: str = "airflow-arroyo-ui") -> None:
        # the store's own Database (pool, retry rule, transaction shape), on connections that cannot write
        self._db = Database(dsn, max_connections=max_connections, retry_seconds=retry_seconds,
                            application_name=application_name, read_only=True,
                            statement_timeout_ms=statement_timeout_ms)

    @property
    def statement_timeout_ms(self) -> int:
        """Each statement's time limit."""
        return self._db.statement_timeout_ms

    def __repr__(self) -> str:
        return f"StoreReader({redact_dsn(self.dsn)!r})"

    def close(self) -> None:
        """Close the reader's connections."""
        self._db.close()

    @property
    def closed(self) -> bool:
        """True once closed."""
        return self._db.closed

    @property
    def records(self) -> RecordReads:
        """The store's record reads on this reader's read-only connections (:class:`RecordReads`)."""
        return RecordReads(self._db)

    # ------------------------------------------------------------------ plumbing

    def _read(self, fn: Callable[[PgCursor], T]) -> T:
        """Run ``fn`` in one read-only snapshot, retried briefly on transient errors."""
        return self._db.read(fn)

    @staticmethod
    def _now(cur: PgCursor) -> datetime:
        cur.execute(SQL_NOW)
        row = cur.fetchone()
        assert row is not None
        now: datetime = row["now"]
        return now

    @staticmethod
    def _pipeline(cur: PgCursor, pipeline_id: str) -> PipelineRecord:
        cur.execute(SQL_PIPELINE, {"p": pipeline_id})
        row = cur.fetchone()
        if row is None:
            raise UnknownPipelineError(pipeline_id)
        return from_row(PipelineRecord, row)

    @staticmethod
    def _overviews(cur: PgCursor, pipelines: Sequence[PipelineRecord], now: datetime) -> list[PipelineOverview]:
        ids = [p.pipeline_id for p in pipelines]
        if not ids:
            return []
        params: dict[str, Any] = {"ids": ids, "window": RECENT_WINDOW}
        cur.execute(SQL_LAST_COMPLETED, params)
        last_completed = {r["pipeline_id"]: from_row(EpochRecord, r) for r in cur.fetchall()}
        cur.execute(SQL_IN_FLIGHT, params)
        in_flight = {r["pipeline_id"]: from_row(EpochRecord, r) for r in cur.fetchall()}
        cur.execute(SQL_RECENT, params)
        recent: dict[str, list[EpochRecord]] = {}
        for r in cur.fetchall():
            recent.setdefault(r["pipeline_id"], []).append(from_row(EpochRecord, r))
        cur.execute(SQL_LIVE_LOCKS, params)
        locks = {r["pipeline_id"]: from_row(CleanupLockRecord, r) for r in cur.fetchall()}
        fork_points: dict[str, EpochRecord] = {}
        if any(p.forked_from_pipeline is not None for p in pipelines):
            cur.execute(SQL_FORK_POINTS, params)
            fork_points = {r["fork_id"]: from_row(EpochRecord, r) for r in cur.fetchall()}
        return [
            PipelineOverview(
                pipeline=p, now=now, last_completed=last_completed.get(p.pipeline_id),
                in_flight=in_flight.get(p.pipeline_id), recent=recent.get(p.pipeline_id, []),
                cleanup_lock=locks.get(p.pipeline_id), fork_point=fork_points.get(p.pipeline_id),
            )
            for p in pipelines
        ]

    # ------------------------------------------------------------------ pages

    def pipelines(self, *, after: str | None = None, limit: int = 50) -> PipelinesPage:
        """A page of pipelines ordered by id, each with its last completed epoch and health facts."""
        size = _page_size(limit)

        def read(cur: PgCursor) -> PipelinesPage:
            now = self._now(cur)
            cur.execute(SQL_PIPELINES_PAGE, {"after": after, "limit": size + 1})
            rows = [from_row(PipelineRecord, r) for r in cur.fetchall()]
            more = len(rows) > size
            rows = rows[:size]
            return PipelinesPage(items=self._overviews(cur, rows, now), now=now,
                                 next_after=rows[-1].pipeline_id if more else None)

        return self._read(read)

    def overview(self, pipeline_id: str) -> PipelineOverview:
        """One pipeline's overview (:class:`~airflow_arroyo.core.exceptions.UnknownPipelineError` if none)."""
        validate_pipeline_id(pipeline_id)

        def read(cur: PgCursor) -> PipelineOverview:
            now = self._now(cur)
            return self._overviews(cur, [self._pipeline(cur, pipeline_id)], now)[0]

        return self._read(read)

    @staticmethod
    def _epochs_page(cur: PgCursor, pipeline_id: str, before: int | None, after: int | None,
                     size: int) -> EpochsPage:
        if after is not None:
            cur.execute(SQL_EPOCHS_AFTER, {"p": pipeline_id, "after": after, "limit": size})
            epochs = [from_row(EpochRecord, r) for r in cur.fetchall()][::-1]
        else:
            cur.execute(SQL_EPOCHS_BEFORE, {"p": pipeline_id, "before": before, "limit": size})
            epochs = [from_row(EpochRecord, r) for r in cur.fetchall()]
        older = newer = None
        if epochs:
            cur.execute(SQL_EPOCH_EXISTS_BEFORE, {"p": pipeline_id, "epoch": epochs[-1].epoch})
            older = epochs[-1].epoch if cur.fetchone() else None
            cur.execute(SQL_EPOCH_EXISTS_AFTER, {"p": pipeline_id, "epoch": epochs[0].epoch})
            newer = epochs[0].epoch if cur.fetchone() else None
        elif after is not None:  # past the newest: offer the way back
            older = after + 1
        elif before is not None:  # past the oldest: offer the way back
            newer = before - 1
        return EpochsPage(epochs=epochs, older_before=older, newer_after=newer)

    def epochs(self, pipeline_id: str, *, before: int | None = None, after: int | None = None,
               limit: int = 100) -> EpochsPage:
        """A page of a pipeline's epochs, newest first: those numbered below ``before`` (default:
        the newest), or the ``limit`` just above ``after``."""
        validate_pipeline_id(pipeline_id)
        size = _page_size(limit)

        def read(cur: PgCursor) -> EpochsPage:
            self._pipeline(cur, pipeline_id)
            return self._epochs_page(cur, pipeline_id, before, after, size)

        return self._read(read)

    def pipeline_page(self, pipeline_id: str, *, before: int | None = None, after: int | None = None,
                      limit: int = 100) -> PipelinePage:
        """The overview and one page of checkpoint history, in one snapshot."""
        validate_pipeline_id(pipeline_id)
        size = _page_size(limit)

        def read(cur: PgCursor) -> PipelinePage:
            now = self._now(cur)
            overview = self._overviews(cur, [self._pipeline(cur, pipeline_id)], now)[0]
            cur.execute(SQL_SUMMARY, {"p": pipeline_id})
            summary = CheckpointSummary(**_one_row(cur))
            cur.execute(SQL_FORKS, {"p": pipeline_id})
            forks = [from_row(PipelineRecord, r) for r in cur.fetchall()]
            cur.execute(SQL_RESTARTS, {"p": pipeline_id, "limit": RESTARTS_SHOWN + 1})
            restarts = [from_row(RestartRecord, r) for r in cur.fetchall()]
            return PipelinePage(overview=overview, epochs=self._epochs_page(cur, pipeline_id, before, after, size),
                                summary=summary, forks=forks, restarts=restarts[:RESTARTS_SHOWN],
                                more_restarts=len(restarts) > RESTARTS_SHOWN, gates=self._gates(cur, pipeline_id))

        return self._read(read)

    @staticmethod
    def _gates(cur: PgCursor, pipeline_id: str) -> list[GateRecord]:
        cur.execute(SQL_OPEN_GATES, {"p": pipeline_id, "limit": OPEN_GATES_SHOWN})
        gates = [from_row(GateRecord, r) for r in cur.fetchall()]
        cur.execute(SQL_CLOSED_GATES, {"p": pipeline_id, "limit": CLOSED_GATES_SHOWN})
        return gates + [from_row(GateRecord, r) for r in cur.fetchall()]

    def epoch_detail(self, pipeline_id: str, epoch: int) -> EpochDetail:
        """One epoch, its acknowledgements, and which stages have not acknowledged yet."""
        validate_pipeline_id(pipeline_id)

        def read(cur: PgCursor) -> EpochDetail:
            now = self._now(cur)
            pipeline = self._pipeline(cur, pipeline_id)
            cur.execute(SQL_EPOCH, {"p": pipeline_id, "epoch": epoch})
            row = cur.fetchone()
            if row is None:
                raise UnknownEpochError(pipeline_id, epoch)
            record = from_row(EpochRecord, row)
            cur.execute(SQL_ACKS, {"p": pipeline_id, "epoch": epoch})
            acks = [from_row(AckRecord, r) for r in cur.fetchall()]
            expected = list(dict.fromkeys(record.stages))
            return EpochDetail(pipeline=pipeline, epoch=record, acks=acks, now=now, expected_stages=expected)

        return self._read(read)

    def retention(self, pipeline_id: str, *, before_id: int | None = None, limit: int = 50) -> RetentionPage:
        """Past cleanup runs (newest first) and the cleanup lock, live or expired."""
        validate_pipeline_id(pipeline_id)
        size = _page_size(limit)

        def read(cur: PgCursor) -> RetentionPage:
            now = self._now(cur)
            pipeline = self._pipeline(cur, pipeline_id)
            cur.execute(SQL_LOCK, {"p": pipeline_id})
            row = cur.fetchone()
            lock = from_row(CleanupLockRecord, row) if row else None
            live = bool(row["live"]) if row else False
            cur.execute(SQL_CLEANUP_RUNS, {"p": pipeline_id, "before_id": before_id, "limit": size + 1})
            runs = [from_row(CleanupRunRecord, r) for r in cur.fetchall()]
            more = len(runs) > size
            runs = runs[:size]
            return RetentionPage(pipeline=pipeline, now=now, lock=lock, lock_live=live, runs=runs,
                                 next_before_id=runs[-1].id if more else None)

        return self._read(read)
