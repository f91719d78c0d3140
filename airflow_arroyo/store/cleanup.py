"""Cleanup: the pipeline's cleanup lease and runs, pruning epochs under it, and compacting the store's history
(a bounded store). The checkpoint controller never starts an epoch while the lease is held."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any

from airflow_arroyo.core.epochs import EpochState
from airflow_arroyo.core.exceptions import CleanupLockHeld, ConfigurationError, LockLostError
from airflow_arroyo.store._db import Concern, PgCursor, one, positive_seconds
from airflow_arroyo.store._transitions import transition
from airflow_arroyo.store.pipelines import lock_pipeline
from airflow_arroyo.store.records import CleanupLockRecord, CleanupRunRecord, CompactionCut, PrunePlan, from_row

__all__ = ["Cleanup"]


class Cleanup(Concern):
    """The cleanup lease (``arroyo_cleanup_locks``), cleanup runs, pruning and compaction."""

    def acquire_cleanup_lock(self, pipeline_id: str, holder: str, *, ttl: float = 60.0,
                             policy: Mapping[str, Any] | None = None) -> CleanupRunRecord:
        """Take the pipeline's cleanup lease for ``ttl`` seconds and open a cleanup run.

        Raises :class:`CleanupLockHeld` if another run holds an unexpired lease. An expired lease
        (its holder crashed) is taken over and that run is marked ``lock_lost``.
        """
        positive_seconds(ttl, "cleanup lock ttl")

        def tx(cur: PgCursor) -> CleanupRunRecord:
            lock_pipeline(cur, pipeline_id)
            cur.execute(
                "SELECT cleanup_run, holder, expires_at, expires_at > clock_timestamp() AS live"
                " FROM arroyo_cleanup_locks WHERE pipeline_id = %s",
                (pipeline_id,),
            )
            current = cur.fetchone()
            if current is not None and current["live"]:
                raise CleanupLockHeld(pipeline_id, current["holder"], current["expires_at"])
            cur.execute(
                "INSERT INTO arroyo_cleanup_runs (pipeline_id, holder, policy) VALUES (%s, %s, %s::jsonb)"
                " RETURNING *",
                (pipeline_id, holder, json.dumps(dict(policy or {}), default=str)),
            )
            run = from_row(CleanupRunRecord, one(cur))
            lease = timedelta(seconds=ttl)
            if current is None:
                cur.execute(
                    "INSERT INTO arroyo_cleanup_locks (pipeline_id, cleanup_run, holder, acquired_at, expires_at)"
                    " VALUES (%s, %s, %s, clock_timestamp(), clock_timestamp() + %s)",
                    (pipeline_id, run.id, holder, lease),
                )
            else:
                cur.execute(
                    "UPDATE arroyo_cleanup_runs SET state = 'lock_lost', ended_at = clock_timestamp(),"
                    " error = COALESCE(error, 'lease expired; taken over by run ' || %s)"
                    " WHERE id = %s AND state = 'running'",
                    (run.id, current["cleanup_run"]),
                )
                cur.execute(
                    "UPDATE arroyo_cleanup_locks SET cleanup_run = %s, holder = %s, acquired_at = clock_timestamp(),"
                    " expires_at = clock_timestamp() + %s WHERE pipeline_id = %s",
                    (run.id, holder, lease, pipeline_id),
                )
            return run

        return self._db.tx(tx)

    @staticmethod
    def _check_lease(cur: PgCursor, pipeline_id: str, cleanup_run: int) -> None:
        cur.execute(
            "SELECT 1 FROM arroyo_cleanup_locks WHERE pipeline_id = %s AND cleanup_run = %s"
            " AND expires_at > clock_timestamp()",
            (pipeline_id, cleanup_run),
        )
        if cur.fetchone() is None:
            raise LockLostError(
                f"cleanup run {cleanup_run} of pipeline {pipeline_id!r} no longer holds the cleanup lock "
                "(its lease expired or was taken over); it must stop deleting"
            )

    def renew_cleanup_lock(self, pipeline_id: str, cleanup_run: int, *, ttl: float = 60.0) -> datetime:
        """Extend our lease; raises :class:`LockLostError` if it already expired or was taken over."""
        positive_seconds(ttl, "cleanup lock ttl")

        def tx(cur: PgCursor) -> datetime:
            lock_pipeline(cur, pipeline_id)
            self._check_lease(cur, pipeline_id, cleanup_run)
            cur.execute(
                "UPDATE arroyo_cleanup_locks SET expires_at = clock_timestamp() + %s"
                " WHERE pipeline_id = %s AND cleanup_run = %s RETURNING expires_at",
                (timedelta(seconds=ttl), pipeline_id, cleanup_run),
            )
            expires: datetime = one(cur)["expires_at"]
            return expires

        return self._db.tx(tx)

    def release_cleanup_lock(self, pipeline_id: str, cleanup_run: int, *, state: str = "succeeded",
                             error: str | None = None) -> CleanupRunRecord:
        """Close the cleanup run and drop the lease if we still hold it."""
        if state not in ("succeeded", "failed", "lock_lost"):
            raise ConfigurationError(f"cleanup run end state must be succeeded, failed or lock_lost, got {state!r}")

        def tx(cur: PgCursor) -> CleanupRunRecord:
            lock_pipeline(cur, pipeline_id)
            cur.execute("DELETE FROM arroyo_cleanup_locks WHERE pipeline_id = %s AND cleanup_run = %s",
                        (pipeline_id, cleanup_run))
            cur.execute(
                "UPDATE arroyo_cleanup_runs SET state = CASE WHEN state = 'running' THEN %s ELSE state END,"
                " ended_at = COALESCE(ended_at, clock_timestamp()), error = COALESCE(%s, error)"
                " WHERE id = %s AND pipeline_id = %s RETURNING *",
                (state, error, cleanup_run, pipeline_id),
            )
            return from_row(CleanupRunRecord, one(cur))

        return self._db.tx(tx)

    def cleanup_lock(self, pipeline_id: str) -> CleanupLockRecord | None:
        """The unexpired cleanup lease of the pipeline, if any."""

        def tx(cur: PgCursor) -> CleanupLockRecord | None:
            cur.execute(
                "SELECT * FROM arroyo_cleanup_locks WHERE pipeline_id = %s AND expires_at > clock_timestamp()",
                (pipeline_id,),
            )
            row = cur.fetchone()
            return from_row(CleanupLockRecord, row) if row else None

        return self._db.tx(tx)

    def list_cleanup_runs(self, pipeline_id: str, *, limit: int = 50) -> list[CleanupRunRecord]:
        """The pipeline's cleanup runs, newest first, ``limit`` at most."""

        def tx(cur: PgCursor) -> list[CleanupRunRecord]:
            cur.execute("SELECT * FROM arroyo_cleanup_runs WHERE pipeline_id = %s ORDER BY id DESC LIMIT %s",
                        (pipeline_id, limit))
            return [from_row(CleanupRunRecord, r) for r in cur.fetchall()]

        return self._db.tx(tx)

    def begin_prune(self, pipeline_id: str, cleanup_run: int, epochs: Sequence[int]) -> PrunePlan:
        """Mark ``epochs`` as ``pruning`` (while we hold the lease) and say what only they reference.

        The database re-checks the rules: only ended epochs move, never the latest completed one.
        Epochs left ``pruning`` by a crashed run are included again.
        """
        wanted = sorted({int(e) for e in epochs})

        def tx(cur: PgCursor) -> PrunePlan:
            pipe = lock_pipeline(cur, pipeline_id)
            self._check_lease(cur, pipeline_id, cleanup_run)
            transition(cur, EpochState.PRUNING,
                       where="e.pipeline_id = %(p)s AND e.epoch = ANY(%(e)s) AND e.pin_label IS NULL"
                       " AND e.epoch IS DISTINCT FROM"
                       " (SELECT max(c.epoch) FROM arroyo_epochs c WHERE c.pipeline_id = %(p)s"
                       "  AND c.state = %(completed)s)",
                       params={"p": pipeline_id, "e": wanted, "completed": EpochState.COMPLETED.value})
            cur.execute(
                "SELECT epoch FROM arroyo_epochs WHERE pipeline_id = %s AND epoch = ANY(%s) AND state = 'pruning'"
                " ORDER BY epoch",
                (pipeline_id, wanted),
            )
            marked = [int(r["epoch"]) for r in cur.fetchall()]
            cur.execute(
                "SELECT o.object_key, o.bytes FROM arroyo_objects o WHERE o.pipeline_id = %(p)s"
                " AND EXISTS (SELECT 1 FROM arroyo_epoch_objects eo WHERE eo.pipeline_id = o.pipeline_id"
                "   AND eo.object_key = o.object_key AND eo.epoch = ANY(%(e)s))"
                " AND NOT EXISTS (SELECT 1 FROM arroyo_epoch_objects eo JOIN arroyo_epochs ep"
                "   USING (pipeline_id, epoch) WHERE eo.pipeline_id = o.pipeline_id"
                "   AND eo.object_key = o.object_key AND ep.state NOT IN ('pruning', 'pruned'))"
                " ORDER BY o.object_key",
                {"p": pipeline_id, "e": marked},
            )
            objects = [(r["object_key"], int(r["bytes"])) for r in cur.fetchall()]
            # The oldest position any restorable (completed, not pruning) epoch resumes a channel at; pinned epochs
            # are completed ones (a superseded one cannot be restored: its channels were cut).
            cur.execute(
                "SELECT c.key AS channel, min((c.value)::text::bigint) AS pos"
                " FROM arroyo_acks a JOIN arroyo_epochs e USING (pipeline_id, epoch)"
                " CROSS JOIN LATERAL jsonb_each(a.cursors) c"
                " WHERE a.pipeline_id = %s AND e.state = 'completed' GROUP BY c.key",
                (pipeline_id,),
            )
            channels: dict[str, str] = pipe["channels"] or {}
            low = {channels.get(r["channel"], r["channel"]): int(r["pos"]) for r in cur.fetchall()}
            return PrunePlan(epochs=marked, objects=objects, channel_low_watermarks=low,
                             storage_uri=pipe["storage_uri"])

        return self._db.tx(tx)

    def finish_prune(self, pipeline_id: str, cleanup_run: int, bytes_freed: Mapping[int, int]) -> list[int]:
        """Mark the ``pruning`` epochs in ``bytes_freed`` as ``pruned``, forget the objects that no
        epoch references any more and add the figures to the cleanup run. Needs the lease."""
        epochs = sorted(int(e) for e in bytes_freed)

        def tx(cur: PgCursor) -> list[int]:
            lock_pipeline(cur, pipeline_id)
            self._check_lease(cur, pipeline_id, cleanup_run)
            done: list[int] = []
            for epoch in epochs:
                if transition(cur, EpochState.PRUNED, where="e.pipeline_id = %(p)s AND e.epoch = %(n)s",
                              also="pruned_at = clock_timestamp(), bytes_freed = %(freed)s",
                              params={"p": pipeline_id, "n": epoch, "freed": int(bytes_freed[epoch])}):
                    done.append(epoch)
            cur.execute("DELETE FROM arroyo_epoch_objects WHERE pipeline_id = %s AND epoch = ANY(%s)",
                        (pipeline_id, done))
            cur.execute(
                "DELETE FROM arroyo_objects o WHERE o.pipeline_id = %s AND NOT EXISTS"
                " (SELECT 1 FROM arroyo_epoch_objects eo WHERE eo.pipeline_id = o.pipeline_id"
                "  AND eo.object_key = o.object_key)",
                (pipeline_id,),
            )
            cur.execute(
                "UPDATE arroyo_cleanup_runs SET epochs_pruned = epochs_pruned || %s::bigint[],"
                " bytes_freed = bytes_freed + %s WHERE id = %s",
                (done, sum(int(bytes_freed[e]) for e in done), cleanup_run),
            )
            return done

        return self._db.tx(tx)

    def begin_compaction(self, pipeline_id: str, cleanup_run: int, horizon: timedelta) -> CompactionCut | None:
        """Choose where to cut the pipeline's history and record it in ``arroyo_history_base``; needs the lease.

        The cut is the newest lease release older than ``horizon`` that is a transaction of its own (not
        a takeover), so no lease was held there. Returns None when there is no such release beyond the
        previous cut (nothing new to compact). The deletions themselves are :meth:`compact_batch`.
        """
        if not isinstance(horizon, timedelta) or horizon < timedelta(0):
            raise ConfigurationError(f"compaction horizon must be a duration >= 0, got {horizon!r}")

        def tx(cur: PgCursor) -> CompactionCut | None:
            lock_pipeline(cur, pipeline_id)
            self._check_lease(cur, pipeline_id, cleanup_run)
            cur.execute("SELECT * FROM arroyo_history_base WHERE pipeline_id = %s", (pipeline_id,))
            base = cur.fetchone()
            cur.execute(
                "SELECT h.seq, h.at, h.cleanup_run FROM arroyo_history h"
                " WHERE h.pipeline_id = %(p)s AND h.seq > %(after)s AND h.kind = 'lock_released'"
                " AND h.at < clock_timestamp() - %(horizon)s AND h.cleanup_run IS NOT NULL"
                " AND (SELECT o.txid FROM arroyo_history o WHERE o.pipeline_id = h.pipeline_id AND o.seq > h.seq"
                "      ORDER BY o.seq LIMIT 1) IS DISTINCT FROM h.txid"
                " AND (SELECT o.txid FROM arroyo_history o WHERE o.pipeline_id = h.pipeline_id AND o.seq < h.seq"
                "      ORDER BY o.seq DESC LIMIT 1) IS DISTINCT FROM h.txid"
                " ORDER BY h.seq DESC LIMIT 1",
                {"p": pipeline_id, "after": int(base["through_seq"]) if base else 0, "horizon": horizon},
            )
            cut = cur.fetchone()
            if cut is None:
                return None
            cur.execute(
                "SELECT COALESCE(max(epoch), 0) AS m FROM arroyo_history WHERE pipeline_id = %s AND seq <= %s"
                " AND kind = 'epoch_state' AND old_state IS NULL",
                (pipeline_id, cut["seq"]),
            )
            max_epoch = max(int(one(cur)["m"]), int(base["max_epoch"]) if base else 0)
            cur.execute(
                "INSERT INTO arroyo_history_base (pipeline_id, through_seq, max_epoch, cut_at, cleanup_run)"
                " VALUES (%(p)s, %(seq)s, %(max)s, %(at)s, %(run)s) ON CONFLICT (pipeline_id) DO UPDATE SET"
                " through_seq = EXCLUDED.through_seq, max_epoch = EXCLUDED.max_epoch, cut_at = EXCLUDED.cut_at,"
                " cleanup_run = EXCLUDED.cleanup_run, compacted_at = clock_timestamp()",
                {"p": pipeline_id, "seq": cut["seq"], "max": max_epoch, "at": cut["at"], "run": cut["cleanup_run"]},
            )
            return CompactionCut(through_seq=int(cut["seq"]), max_epoch=max_epoch, cut_at=cut["at"],
                                 cleanup_run=int(cut["cleanup_run"]))

        return self._db.tx(tx)

    _COMPACT_SQL = {
        # epochs pruned before the cut (their acks go with them: ON DELETE CASCADE); pruned is final
        "epochs": "DELETE FROM arroyo_epochs WHERE pipeline_id = %(p)s AND epoch IN (SELECT epoch FROM arroyo_epochs"
                  " WHERE pipeline_id = %(p)s AND state = 'pruned' AND pruned_at < %(at)s ORDER BY pruned_at"
                  " LIMIT %(n)s)",
        # the sink commits of the epochs "epochs" deletes (or deleted), before it: each sink's newest stays (the
        # outlets' latest_sink_commit, a new watcher's start); a watcher further behind than the cut misses them
        "sink_commits": "DELETE FROM arroyo_sink_commits WHERE seq IN (SELECT s.seq FROM arroyo_sink_commits s"
                        " WHERE s.pipeline_id = %(p)s AND NOT EXISTS (SELECT 1 FROM arroyo_epochs e"
                        "  WHERE e.pipeline_id = s.pipeline_id AND e.epoch = s.epoch"
                        "  AND (e.state <> 'pruned' OR e.pruned_at >= %(at)s))"
                        " AND s.epoch < (SELECT max(m.epoch) FROM arroyo_sink_commits m"
                        "  WHERE m.pipeline_id = s.pipeline_id AND m.sink = s.sink)"
                        " ORDER BY s.seq LIMIT %(n)s)",
        "history": "DELETE FROM arroyo_history WHERE pipeline_id = %(p)s AND seq IN (SELECT seq FROM arroyo_history"
                   " WHERE pipeline_id = %(p)s AND seq <= %(seq)s ORDER BY seq LIMIT %(n)s)",
        # every run up to the cut's has ended: the cut's run held the lease after them
        "cleanup_runs": "DELETE FROM arroyo_cleanup_runs WHERE id IN (SELECT id FROM arroyo_cleanup_runs"
                        " WHERE pipeline_id = %(p)s AND id <= %(run)s AND state <> 'running' ORDER BY id"
                        " LIMIT %(n)s)",
    }

    def compact_batch(self, pipeline_id: str, cleanup_run: int, cut: CompactionCut, table: str, limit: int) -> int:
        """Delete at most ``limit`` rows of ``table`` (``sink_commits``, ``epochs``, ``history`` or
        ``cleanup_runs``) that ``cut`` leaves behind, in one short transaction under the lease; returns how many
        went."""
        sql = self._COMPACT_SQL.get(table)
        if sql is None:
            raise ConfigurationError(f"cannot compact {table!r}: choose one of {sorted(self._COMPACT_SQL)}")
        if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
            raise ConfigurationError(f"compaction batch size must be a whole number >= 1, got {limit!r}")

        def tx(cur: PgCursor) -> int:
            lock_pipeline(cur, pipeline_id)
            self._check_lease(cur, pipeline_id, cleanup_run)
            cur.execute(sql, {"p": pipeline_id, "at": cut.cut_at, "seq": cut.through_seq, "run": cut.cleanup_run,
                              "n": limit})
            return int(cur.rowcount)

        return self._db.tx(tx)

