"""Retention: prune old checkpoint epochs of one pipeline under its cleanup lock.

The decision (which epochs go) is the pure :func:`~airflow_arroyo.core.epochs.select_prunable`; this module
is the I/O around it, in the order that keeps every retained epoch restorable::

    acquire the cleanup lease ──> wait for an in-flight epoch to end (renewing the lease)
      ──> select_prunable(epoch facts, policy, DB time) ──> begin_prune (epochs -> pruning)
      ──> delete the snapshot objects only pruned epochs reference (renewing the lease)
      ──> truncate each channel before its low watermark
      ──> finish_prune (epochs -> pruned, bytes freed)
      ──> compact (``compact_after``: delete the history before the newest lease release older than
          that horizon, the epochs pruned before it with their acks and sink commits, and the cleanup
          runs that ended by it, in batches of ``compact_batch`` rows, each a short transaction under the lease)
      ──> release the lease
      ──> scrub for at most ``scrub_budget`` seconds (:mod:`airflow_arroyo.core.scrub`; no lease needed: it reads)

* While we hold the lease the trigger starts no epoch. An epoch already in flight may reference
  (incrementally) an object we would delete before it records it, so nothing is deleted while one
  is in flight: we wait for it with a deadline, then skip.
* A crash anywhere leaves the lease to expire (``lock_ttl``) and epochs ``pruning``; the next run
  takes the lease over, selects those epochs again and finishes them (deleting tolerates files a
  crashed run already deleted).
* If the lease is lost mid-run (:class:`~airflow_arroyo.core.exceptions.LockLostError`), deleting stops
  at once and the run ends ``lock_lost``.

Usage::

    from datetime import timedelta
    from airflow_arroyo.core.epochs import RetentionPolicy
    from airflow_arroyo.core.retention import prune_pipeline
    from airflow_arroyo.store import EpochStore

    report = prune_pipeline(EpochStore(dsn), "orders", RetentionPolicy(keep_last=5),
                            holder="ops:alice")
    print(report.epochs_pruned, report.bytes_freed)
"""

from __future__ import annotations

import logging
import math
import re
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Protocol

from airflow_arroyo.core.epochs import EpochFacts, RetentionPolicy, select_prunable, validate_pipeline_id
from airflow_arroyo.core.exceptions import ArroyoError, CleanupLockHeld, ConfigurationError, LockLostError
from airflow_arroyo.runtime.layout import object_path

if TYPE_CHECKING:
    from airflow_arroyo.store import CleanupRunRecord, EpochRecord, EpochStore

__all__ = [
    "DEFAULT_COMPACT_AFTER",
    "PruneReport",
    "parse_duration",
    "policy_from",
    "prune_pipeline",
]

log = logging.getLogger(__name__)

#: How long pruned epochs, history and cleanup runs stay in the store after retention released them:
#: long enough to look at (UI, ``airflow-arroyo epochs``, the history checker), short enough that the
#: tables stay flat. ``compact_after=None`` turns compaction off.
DEFAULT_COMPACT_AFTER = timedelta(days=7)
DEFAULT_COMPACT_BATCH = 1000
_COMPACTED_TABLES = ("history", "sink_commits", "epochs", "cleanup_runs")  # sink commits before their epochs



class ObjectFileSystem(Protocol):
    """What retention needs of a filesystem (:class:`airflow_arroyo.core.fs.FileSystem` fits)."""

    def delete(self, path: str) -> bool: ...


class TruncatableChannel(Protocol):
    """What retention needs of a channel (:class:`airflow_arroyo.runtime.channel.Channel` fits)."""

    def truncate_before(self, pos: int) -> int: ...


def _default_fs_for(uri: str) -> ObjectFileSystem:
    from airflow_arroyo.core.fs import FileSystem

    return FileSystem.from_uri(uri)


def _default_open_channel(uri: str) -> TruncatableChannel | None:
    """The channel at ``uri``, or None when there is none (deleted by hand: nothing left to truncate)."""
    from airflow_arroyo.runtime.channel import Channel

    if not Channel.exists(uri):
        return None
    return Channel.open(uri)


# --------------------------------------------------------------------------- input parsing (pure)

_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)\s*(w|d|h|m|s)", re.IGNORECASE)
_UNIT_SECONDS = {"w": 7 * 86400, "d": 86400, "h": 3600, "m": 60, "s": 1}


def parse_duration(value: timedelta | float | int | str | None, *, name: str = "duration") -> timedelta | None:
    """A duration from a timedelta, a number of seconds, or text such as ``90``, ``15m``, ``1h30m``, ``2d``.

    ``None``, ``""`` and ``"none"`` mean no duration. Raises :class:`ConfigurationError` otherwise.
    """
    if value is None:
        return None
    if isinstance(value, timedelta):
        return value
    if isinstance(value, bool):
        raise ConfigurationError(f"{name} must be a duration such as 3600, '1h' or '30m', got {value!r}")
    if isinstance(value, int | float):
        if not math.isfinite(value):
            raise ConfigurationError(f"{name} must be a finite number of seconds, got {value!r}")
        return timedelta(seconds=value)
    if isinstance(value, str):
        text = value.strip()
        if text.lower() in ("", "none", "null"):
            return None
        try:
            return parse_duration(float(text), name=name)
        except ValueError:
            pass
        compact = text.replace(" ", "")
        parts = _DURATION_PART.findall(compact)
        if parts and "".join(n + u for n, u in parts).lower() == compact.lower():
            return timedelta(seconds=sum(float(n) * _UNIT_SECONDS[u.lower()] for n, u in parts))
    raise ConfigurationError(
        f"{name} {value!r} is not a duration: use seconds (3600) or a number with a unit "
        "s, m, h, d or w (e.g. '90s', '15m', '1h30m', '7d')"
    )


def policy_from(keep_last: int | str | None = None,
                keep_newer_than: timedelta | float | int | str | None = None) -> RetentionPolicy:
    """A :class:`RetentionPolicy` from user input (possibly rendered template strings).

    Raises :class:`ConfigurationError` for values that are not numbers/durations, or when the policy
    would keep nothing.
    """
    last: int | None
    if keep_last is None or (isinstance(keep_last, str) and keep_last.strip().lower() in ("", "none", "null")):
        last = None
    elif isinstance(keep_last, str):
        try:
            last = int(keep_last.strip())
        except ValueError:
            raise ConfigurationError(
                f"keep_last {keep_last!r} is not a whole number; give the number of completed epochs to keep, "
                "e.g. 5"
            ) from None
    else:
        last = keep_last
    return RetentionPolicy(keep_last=last, keep_newer_than=parse_duration(keep_newer_than, name="keep_newer_than"))


def _policy_json(policy: RetentionPolicy) -> dict[str, Any]:
    return {
        "keep_last": policy.keep_last,
        "keep_newer_than_s": None if policy.keep_newer_than is None else policy.keep_newer_than.total_seconds(),
    }


# --------------------------------------------------------------------------- report


@dataclass
class PruneReport:
    """What one retention run of one pipeline did.

    ``bytes_freed`` counts snapshot objects (by their recorded size; ones a crashed earlier run
    already deleted included: they were freed for these epochs) plus channel data truncated.
    ``skipped_reason`` is set when the run pruned nothing on purpose (lock held, epoch in flight).
    """

    pipeline_id: str
    cleanup_run: int | None = None
    epochs_pruned: list[int] = field(default_factory=list)
    bytes_freed: int = 0
    kept: list[int] = field(default_factory=list)
    skipped_reason: str | None = None
    objects_deleted: int = 0
    objects_missing: int = 0
    channel_bytes_freed: int = 0
    # the scrub after the prune (scrub_budget): objects re-hashed now, and all known damage
    objects_verified: int = 0
    damaged_epochs: list[int] = field(default_factory=list)
    restorable_epochs: list[int] = field(default_factory=list)
    scrub: str | None = None  # the scrub's advice (or why it failed); None: no scrub asked for
    # compaction (compact_after): rows deleted per table (history, sink_commits, epochs, cleanup_runs)
    rows_compacted: dict[str, int] = field(default_factory=dict)

    @property
    def skipped(self) -> bool:
        """True if the run pruned nothing on purpose (``skipped_reason`` says why)."""
        return self.skipped_reason is not None

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly (XCom, ``--json``)."""
        return asdict(self)


# --------------------------------------------------------------------------- the lease


class _Lease:
    """Our cleanup lease: renewed when ``renew_every`` seconds passed since the last renewal.

    Checked before every deletion, so a deletion starts at most ``renew_every`` after the lease was
    last extended to ``ttl`` (``renew_every`` < ``ttl``): we never delete on an expired lease unless
    one deletion alone outlasts ``ttl - renew_every``.
    """

    def __init__(self, store: EpochStore, pipeline_id: str, run: CleanupRunRecord, *, ttl: float,
                 renew_every: float, clock: Callable[[], float]) -> None:
        self._store = store
        self.pipeline_id = pipeline_id
        self.run_id = run.id
        self._ttl = ttl
        self._renew_every = renew_every
        self._clock = clock
        self._renewed_at = clock()

    def renew(self) -> None:
        self._store.renew_cleanup_lock(self.pipeline_id, self.run_id, ttl=self._ttl)
        self._renewed_at = self._clock()

    def keep(self) -> None:
        if self._clock() - self._renewed_at >= self._renew_every:
            self.renew()


# --------------------------------------------------------------------------- the run


def prune_pipeline(
    store: EpochStore,
    pipeline_id: str,
    policy: RetentionPolicy,
    *,
    holder: str,
    lock_ttl: float = 60.0,
    wait_for_lock: timedelta = timedelta(0),
    wait_for_in_flight: timedelta = timedelta(minutes=5),
    poll_interval: float = 1.0,
    renew_every: float | None = None,
    fs_for: Callable[[str], ObjectFileSystem] = _default_fs_for,
    open_channel: Callable[[str], TruncatableChannel | None] = _default_open_channel,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
    scrub_budget: float | None = None,
    compact_after: timedelta | None = DEFAULT_COMPACT_AFTER,
    compact_batch: int = DEFAULT_COMPACT_BATCH,
) -> PruneReport:
    """Prune the epochs of ``pipeline_id`` that ``policy`` does not keep, then scrub for at most
    ``scrub_budget`` seconds (None: no scrub). See the module docstring.

    * ``holder`` names this run in the lease (shown by ``airflow-arroyo lock``).
    * ``lock_ttl``: lease length in seconds; a crashed run blocks cleanup and checkpoints this long.
    * ``wait_for_lock``: how long to retry while another run holds the lease, then skip.
    * ``wait_for_in_flight``: how long to wait for an in-flight epoch to end, then skip.
    * ``renew_every``: seconds between lease renewals while deleting (default ``lock_ttl / 3``).
    * ``compact_after``: after pruning, compact what retention released longer ago than this
      (``None``: never); ``compact_batch``: rows deleted per transaction.
    * ``fs_for`` / ``open_channel`` / ``clock`` / ``sleep``: seams (filesystem, channels, time).

    Bad input (unknown pipeline, a policy that is not a :class:`RetentionPolicy`, bad durations)
    raises before anything is written. :class:`LockLostError` is raised after the run is closed
    as ``lock_lost``; any other failure closes the run as ``failed`` and is re-raised.
    """
    validate_pipeline_id(pipeline_id)
    if not isinstance(policy, RetentionPolicy):
        raise ConfigurationError(f"policy must be a RetentionPolicy, got {type(policy).__name__}; "
                                 "build one with policy_from(keep_last=..., keep_newer_than=...)")
    if not isinstance(lock_ttl, int | float) or not math.isfinite(lock_ttl) or lock_ttl <= 0:
        raise ConfigurationError(f"lock_ttl must be a positive number of seconds, got {lock_ttl!r}")
    renew = lock_ttl / 3 if renew_every is None else renew_every
    if not 0 <= renew < lock_ttl:
        raise ConfigurationError(f"renew_every ({renew!r}s) must be >= 0 and shorter than lock_ttl ({lock_ttl}s)")
    if not 0 < poll_interval < lock_ttl:
        raise ConfigurationError(f"poll_interval ({poll_interval!r}s) must be positive and shorter than "
                                 f"lock_ttl ({lock_ttl}s), or the lease expires while we wait")
    if not holder:
        raise ConfigurationError("holder must name this cleanup run (e.g. 'airflow:<dag>/<task>/<run>')")
    if scrub_budget is not None and not (isinstance(scrub_budget, int | float) and scrub_budget > 0):
        raise ConfigurationError(f"scrub_budget must be a positive number of seconds (or None), got {scrub_budget!r}")
    if compact_after is not None and (not isinstance(compact_after, timedelta) or compact_after < timedelta(0)):
        raise ConfigurationError(f"compact_after must be a duration >= 0 (e.g. timedelta(days=7)) or None to keep "
                                 f"everything, got {compact_after!r}")
    if not isinstance(compact_batch, int) or isinstance(compact_batch, bool) or compact_batch < 1:
        raise ConfigurationError(
            f"compact_batch must be a whole number of rows >= 1 (e.g. 1000), got {compact_batch!r}")
    store.get_pipeline(pipeline_id)  # UnknownPipelineError before anything is written
    report = _prune(store, pipeline_id, policy, holder=holder, lock_ttl=lock_ttl, wait_for_lock=wait_for_lock,
                    wait_for_in_flight=wait_for_in_flight, poll_interval=poll_interval, renew=renew, fs_for=fs_for,
                    open_channel=open_channel, clock=clock, sleep=sleep, compact_after=compact_after,
                    compact_batch=compact_batch)
    if scrub_budget is not None:
        _scrub(store, report, scrub_budget)
    return report


def _scrub(store: EpochStore, report: PruneReport, budget: float) -> None:
    """Scrub after the prune; a scrub that cannot read the storage is reported, the prune stands."""
    from airflow_arroyo.core.scrub import verify_pipeline

    try:
        scrub = verify_pipeline(store, report.pipeline_id, budget=budget)
    except (ArroyoError, OSError) as exc:
        report.scrub = f"scrub failed: {type(exc).__name__}: {exc}"
        log.error("pipeline %s: %s", report.pipeline_id, report.scrub)
        return
    report.objects_verified = scrub.objects_checked
    report.damaged_epochs = scrub.damaged_epochs
    report.restorable_epochs = scrub.restorable_epochs
    report.scrub = scrub.advice()
    if not scrub.ok:
        log.error("pipeline %s: scrub: %s", report.pipeline_id, report.scrub)


def _prune(store: EpochStore, pipeline_id: str, policy: RetentionPolicy, *, holder: str, lock_ttl: float,
           wait_for_lock: timedelta, wait_for_in_flight: timedelta, poll_interval: float, renew: float,
           fs_for: Callable[[str], ObjectFileSystem], open_channel: Callable[[str], TruncatableChannel | None],
           clock: Callable[[], float], sleep: Callable[[float], None], compact_after: timedelta | None = None,
           compact_batch: int = DEFAULT_COMPACT_BATCH) -> PruneReport:
    report = PruneReport(pipeline_id)
    run = _acquire(store, pipeline_id, policy, holder=holder, ttl=lock_ttl, wait=wait_for_lock,
                   poll_interval=poll_interval, clock=clock, sleep=sleep, report=report)
    if run is None:
        return report
    report.cleanup_run = run.id
    lease = _Lease(store, pipeline_id, run, ttl=lock_ttl, renew_every=renew, clock=clock)
    log.info("pipeline %s: cleanup run %s holds the cleanup lock (holder %s, ttl %ss, policy %s)",
             pipeline_id, run.id, holder, lock_ttl, _policy_json(policy))
    try:
        blocked = _wait_no_in_flight(store, lease, wait_for_in_flight, poll_interval, clock, sleep)
        if blocked is not None:
            report.skipped_reason = blocked
            log.warning("pipeline %s: cleanup run %s skipped: %s", pipeline_id, run.id, blocked)
            store.release_cleanup_lock(pipeline_id, run.id, state="succeeded", error=f"skipped: {blocked}")
            return report
        _prune_under_lease(store, lease, policy, fs_for, open_channel, report)
        if compact_after is not None:
            _compact(store, lease, compact_after, compact_batch, report)
    except LockLostError as exc:
        log.error("pipeline %s: cleanup run %s lost its cleanup lock; stopped deleting (epochs %s stay "
                  "'pruning' for the next run): %s", pipeline_id, run.id, report.epochs_pruned, exc)
        _close_quietly(store, pipeline_id, run.id, "lock_lost", str(exc))
        raise
    except BaseException as exc:
        log.error("pipeline %s: cleanup run %s failed: %s", pipeline_id, run.id, exc)
        _close_quietly(store, pipeline_id, run.id, "failed", f"{type(exc).__name__}: {exc}"[:2000])
        raise
    store.release_cleanup_lock(pipeline_id, run.id, state="succeeded")
    log.info("pipeline %s: cleanup run %s pruned epochs %s, freed %s bytes (%s objects deleted, %s already "
             "missing, %s channel bytes); kept %s", pipeline_id, run.id, report.epochs_pruned, report.bytes_freed,
             report.objects_deleted, report.objects_missing, report.channel_bytes_freed, report.kept)
    return report


def _close_quietly(store: EpochStore, pipeline_id: str, run_id: int, state: str, error: str) -> None:
    """Close a run that is failing anyway; a store error here must not hide the original one (the
    lease then simply expires)."""
    try:
        store.release_cleanup_lock(pipeline_id, run_id, state=state, error=error)
    except ArroyoError as exc:
        log.error("pipeline %s: could not close cleanup run %s as %s (its lease will expire): %s",
                  pipeline_id, run_id, state, exc)


def _acquire(store: EpochStore, pipeline_id: str, policy: RetentionPolicy, *, holder: str, ttl: float,
             wait: timedelta, poll_interval: float, clock: Callable[[], float], sleep: Callable[[float], None],
             report: PruneReport) -> CleanupRunRecord | None:
    deadline = clock() + wait.total_seconds()
    while True:
        try:
            return store.acquire_cleanup_lock(pipeline_id, holder, ttl=ttl, policy=_policy_json(policy))
        except CleanupLockHeld as held:
            remaining = deadline - clock()
            if remaining <= 0:
                report.skipped_reason = (f"cleanup lock held by {held.holder} until {held.expires_at}"
                                         f" (waited {wait.total_seconds():g}s)")
                log.warning("pipeline %s: retention skipped: %s", pipeline_id, report.skipped_reason)
                return None
            log.info("pipeline %s: cleanup lock held by %s until %s; retrying", pipeline_id, held.holder,
                     held.expires_at)
            sleep(min(poll_interval, remaining))


def _wait_no_in_flight(store: EpochStore, lease: _Lease, wait: timedelta, poll_interval: float,
                       clock: Callable[[], float], sleep: Callable[[float], None]) -> str | None:
    """Wait (renewing the lease) until no epoch is in flight; the reason to skip if one still is."""
    deadline = clock() + wait.total_seconds()
    while True:
        in_flight = store.in_flight_epoch(lease.pipeline_id)
        if in_flight is None:
            return None
        remaining = deadline - clock()
        if remaining <= 0:
            return (f"in-flight epoch {in_flight.epoch} did not finish within {wait.total_seconds():g}s "
                    f"(it times out at {in_flight.timeout_at}; if it stays in flight past that, check that "
                    "the pipeline's checkpoint trigger is running)")
        log.info("pipeline %s: waiting for in-flight epoch %s before pruning", lease.pipeline_id, in_flight.epoch)
        lease.renew()
        sleep(min(poll_interval, remaining))


def _facts(records: Iterable[EpochRecord], keep_from: int | None = None) -> list[EpochFacts]:
    """The epochs as :func:`select_prunable` sees them; those from ``keep_from`` on are kept as pinned."""
    held = "commit gates: a restore may go back to it"
    return [EpochFacts(r.epoch, r.state, r.triggered_at, r.ended_at,
                       held if r.pin_label is None and keep_from is not None and r.epoch >= keep_from else r.pin_label)
            for r in records]


def _prune_under_lease(store: EpochStore, lease: _Lease, policy: RetentionPolicy,
                       fs_for: Callable[[str], ObjectFileSystem],
                       open_channel: Callable[[str], TruncatableChannel | None], report: PruneReport) -> None:
    pipeline_id = lease.pipeline_id
    records = store.unpruned_epochs(pipeline_id)
    selection = select_prunable(_facts(records, store.retention_floor(pipeline_id)), policy, store.db_now())
    report.kept = list(selection.keep)
    if not selection.prune:
        log.info("pipeline %s: nothing to prune (kept %s)", pipeline_id, report.kept)
        return
    lease.renew()
    plan = store.begin_prune(pipeline_id, lease.run_id, selection.prune)
    if not plan.epochs:
        log.info("pipeline %s: the store refused to prune %s (state changed); nothing to do",
                 pipeline_id, list(selection.prune))
        return
    log.info("pipeline %s: pruning epochs %s (%s objects only they reference, channel watermarks %s)",
             pipeline_id, plan.epochs, len(plan.objects), plan.channel_low_watermarks)
    freed = dict.fromkeys(plan.epochs, 0)
    if plan.objects:
        owner = _object_owners(store, pipeline_id, plan.epochs, {r.epoch: r.stages for r in records},
                               {k for k, _ in plan.objects})
        if not plan.storage_uri:
            raise ConfigurationError(
                f"pipeline {pipeline_id!r} has snapshot objects but no storage_uri; register the pipeline "
                "with the storage_uri its snapshots were written to, then run retention again"
            )
        fs = fs_for(plan.storage_uri)
        for key, nbytes in plan.objects:
            lease.keep()
            if fs.delete(object_path(pipeline_id, key)):
                report.objects_deleted += 1
            else:
                report.objects_missing += 1
            freed[owner.get(key, plan.epochs[0])] += nbytes
    newest = max(plan.epochs)
    for uri, pos in sorted(plan.channel_low_watermarks.items()):
        lease.keep()
        channel = open_channel(uri)
        if channel is None:
            log.warning("pipeline %s: channel %s does not exist any more; nothing to truncate", pipeline_id, uri)
            continue
        # pos is the oldest retained epoch's ack cursor, where its reader resumes: right after its barrier (which a
        # restore looks up to cut the channel there: keep that entry), or before it after an unaligned cut, whose
        # records in flight a restore reads again; no retained epoch's barrier lies before pos - 1
        start = max(0, pos - 1)
        channel_freed = channel.truncate_before(start)
        report.channel_bytes_freed += channel_freed
        freed[newest] += channel_freed
        log.info("pipeline %s: channel %s truncated before %s (%s bytes)", pipeline_id, uri, start, channel_freed)
    lease.renew()
    done = store.finish_prune(pipeline_id, lease.run_id, freed)
    report.epochs_pruned = done
    report.bytes_freed = sum(freed[e] for e in done)


def _compact(store: EpochStore, lease: _Lease, horizon: timedelta, batch: int, report: PruneReport) -> None:
    """Delete what no restore and no check needs any more, in short batches (the lease is renewed
    between them, so a long backlog never holds locks for long nor outlives the lease)."""
    lease.renew()
    cut = store.begin_compaction(lease.pipeline_id, lease.run_id, horizon)
    if cut is None:
        return
    for table in _COMPACTED_TABLES:
        total = 0
        while True:
            lease.keep()
            n = store.compact_batch(lease.pipeline_id, lease.run_id, cut, table, batch)
            total += n
            if n < batch:
                break
        report.rows_compacted[table] = total
    log.info("pipeline %s: compacted the store up to history seq %s (cut at %s): %s", lease.pipeline_id,
             cut.through_seq, cut.cut_at, report.rows_compacted)


def _object_owners(store: EpochStore, pipeline_id: str, epochs: list[int], stages: Mapping[int, list[str]],
                   keys: set[str]) -> dict[str, int]:
    """Which pruned epoch each object's bytes are counted on: the oldest one referencing it."""
    owner: dict[str, int] = {}
    for epoch in sorted(epochs):
        for stage in stages.get(epoch, []):
            for entry in store.snapshot_entries(pipeline_id, epoch, stage):
                if entry.object_key in keys:
                    owner.setdefault(entry.object_key, epoch)
    return owner
