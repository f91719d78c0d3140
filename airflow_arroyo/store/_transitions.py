"""Every state write of the epoch store, built from the transition tables: life cycles in one place.

A state change is one guarded UPDATE: ``SET state = <target>`` on the rows the caller names, and only
on those whose state is one that :data:`~airflow_arroyo.core.epochs.EPOCH_TRANSITIONS` or
:data:`~airflow_arroyo.core.epochs.PIPELINE_TRANSITIONS` allows to reach the target. The guard is in the
statement, so the database applies it to the row as it is when the write runs, whatever the caller
read before; a row in any other state is left alone and is simply not returned. The caller decides
what a refusal means (an error, or "it already ended": a no-op).

Callers give only which rows (``where``), what else changes with the state (``also``), an optional
``FROM`` list (``using``) and what to return. Neither the target nor the states it may come from is
written anywhere else in the store (a test checks that no other statement sets a state).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from psycopg2.extras import RealDictCursor as PgCursor

from airflow_arroyo.core.epochs import EpochState, PipelineState, epoch_states_from, pipeline_states_from

__all__ = ["transition"]

# The table each life cycle lives in, and the alias its rows have in ``where``, ``also`` and ``returning``.
_EPOCHS = ("arroyo_epochs", "e")
_PIPELINES = ("arroyo_pipelines", "p")
_RESERVED = frozenset({"_target", "_from"})


def transition(cur: PgCursor, target: EpochState | PipelineState, *, where: str, params: Mapping[str, Any],
               also: str = "", using: str = "", returning: str = "") -> list[dict[str, Any]]:
    """Move the rows matched by ``where`` to ``target`` where the transition table allows it.

    Only rows whose current state may reach ``target`` move; returns the rows moved (``returning``,
    default: their keys).

    ``target`` picks the table: an :class:`EpochState` moves rows of ``arroyo_epochs`` (alias ``e``), a
    :class:`PipelineState` rows of ``arroyo_pipelines`` (alias ``p``). ``where``, ``also`` (more
    ``column = value`` assignments), ``using`` (a ``FROM`` list) and ``returning`` are SQL fragments
    written in the store's code, never built from values: values go in ``params``, by name
    (``%(name)s``).
    """
    if isinstance(target, EpochState):
        (table, alias), allowed = _EPOCHS, epoch_states_from(target)
        keys = "e.pipeline_id, e.epoch"
    elif isinstance(target, PipelineState):
        (table, alias), allowed = _PIPELINES, pipeline_states_from(target)
        keys = "p.pipeline_id"
    else:
        raise TypeError(f"transition target must be an EpochState or a PipelineState, got {target!r}")
    clash = _RESERVED & set(params)
    if clash:
        raise ValueError(f"transition parameters {sorted(clash)} are reserved for the guard")
    sets = "state = %(_target)s" + (f", {also}" if also else "")
    query = (f"UPDATE {table} {alias} SET {sets}"  # noqa: S608 - fragments are constants of the store's code
             + (f" FROM {using}" if using else "")
             + f" WHERE ({where}) AND {alias}.state = ANY(%(_from)s)"
             + f" RETURNING {returning or keys}")
    cur.execute(query, {**params, "_target": target.value, "_from": allowed})
    return [dict(row) for row in cur.fetchall()]
