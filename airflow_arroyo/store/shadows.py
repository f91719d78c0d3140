"""Shadow runs (``arroyo_shadows``, migration 0015): which pipeline is a shadow of which live one, the new code it
runs, where its sinks write instead of the live ones, and whether it is active, promoted or discarded. The use
cases are in :mod:`airflow_arroyo.core.shadow`."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from airflow_arroyo.core.exceptions import NotFoundError, StateConflictError, UnknownPipelineError
from airflow_arroyo.store._db import Concern, PgCursor, one
from airflow_arroyo.store.records import from_row

__all__ = ["ShadowRecord", "Shadows"]


@dataclass(frozen=True)
class ShadowRecord:
    """A row of ``arroyo_shadows``."""

    shadow_id: str
    live_id: str
    fork_epoch: int
    code: str
    sinks: dict[str, Any] = field(default_factory=dict)
    state: str = "active"
    created_at: datetime | None = None
    ended_at: datetime | None = None


class Shadows(Concern):
    """The shadow records."""

    def record_shadow(self, shadow_id: str, live_id: str, fork_epoch: int, code: str,
                      sinks: Mapping[str, Any]) -> ShadowRecord:
        """Record that ``shadow_id`` (a fork of ``live_id`` at ``fork_epoch``) is its shadow running ``code``.
        Idempotent for the same fork; refused (:class:`StateConflictError`) when ``shadow_id`` is a shadow of
        something else or is not that fork."""

        def tx(cur: PgCursor) -> ShadowRecord:
            cur.execute("SELECT forked_from_pipeline, forked_from_epoch FROM arroyo_pipelines WHERE pipeline_id = %s",
                        (shadow_id,))
            fork = cur.fetchone()
            if fork is None:
                raise UnknownPipelineError(shadow_id)
            if fork["forked_from_pipeline"] != live_id or fork["forked_from_epoch"] != fork_epoch:
                raise StateConflictError(f"pipeline {shadow_id!r} is not a fork of epoch {fork_epoch} of {live_id!r}; "
                                         "a shadow is one")
            cur.execute(
                "INSERT INTO arroyo_shadows (shadow_id, live_id, fork_epoch, code, sinks)"
                " VALUES (%s, %s, %s, %s, %s::jsonb) ON CONFLICT (shadow_id) DO NOTHING",
                (shadow_id, live_id, fork_epoch, code, json.dumps(dict(sinks))),
            )
            cur.execute("SELECT * FROM arroyo_shadows WHERE shadow_id = %s", (shadow_id,))
            return from_row(ShadowRecord, one(cur))

        return self._db.tx(tx)

    def get_shadow(self, shadow_id: str) -> ShadowRecord:
        """The shadow's record; :class:`NotFoundError` when ``shadow_id`` is no shadow."""

        def tx(cur: PgCursor) -> ShadowRecord:
            cur.execute("SELECT * FROM arroyo_shadows WHERE shadow_id = %s", (shadow_id,))
            row = cur.fetchone()
            if row is None:
                raise _no_shadow(shadow_id)
            return from_row(ShadowRecord, row)

        return self._db.tx(tx)

    def shadows_of(self, live_id: str) -> list[ShadowRecord]:
        """The shadows of ``live_id``, oldest first (every state)."""

        def tx(cur: PgCursor) -> list[ShadowRecord]:
            cur.execute("SELECT * FROM arroyo_shadows WHERE live_id = %s ORDER BY created_at, shadow_id", (live_id,))
            return [from_row(ShadowRecord, r) for r in cur.fetchall()]

        return self._db.tx(tx)

    def end_shadow(self, shadow_id: str, state: str) -> ShadowRecord:
        """Mark an active shadow ``promoted`` or ``discarded`` (repeating the same end is a no-op; another end of an
        ended shadow is refused with :class:`StateConflictError`)."""
        if state not in ("promoted", "discarded"):
            raise ValueError(f"a shadow ends promoted or discarded, not {state!r}")

        def tx(cur: PgCursor) -> ShadowRecord:
            cur.execute("SELECT * FROM arroyo_shadows WHERE shadow_id = %s FOR UPDATE", (shadow_id,))
            row = cur.fetchone()
            if row is None:
                raise _no_shadow(shadow_id)
            if row["state"] == state:
                return from_row(ShadowRecord, row)
            if row["state"] != "active":
                raise StateConflictError(f"shadow {shadow_id!r} is {row['state']} already; nothing was changed")
            cur.execute("UPDATE arroyo_shadows SET state = %s, ended_at = clock_timestamp() WHERE shadow_id = %s"
                        " RETURNING *", (state, shadow_id))
            return from_row(ShadowRecord, one(cur))

        return self._db.tx(tx)


def _no_shadow(shadow_id: str) -> NotFoundError:
    return NotFoundError(f"pipeline {shadow_id!r} is no shadow run (airflow-arroyo shadow list LIVE lists a pipeline's "
                         "shadows)")
