"""What the driver and a sink stage need of an exactly-once (two-phase-commit) sink.

A sink stage *pre-commits* each micro-batch (:meth:`TransactionalSink.write_batch`); the driver
*commits* every batch up to the sink's cut when an epoch completes, *rolls back* to a restored epoch's
cut, and *trims* what no restore can need. Four kinds exist: files
(:mod:`~airflow_arroyo.runtime.sinks.files`), PostgreSQL tables (:mod:`~airflow_arroyo.runtime.sinks.postgres`),
Kafka topics (:mod:`~airflow_arroyo.runtime.sinks.kafka`) and Delta Lake tables
(:mod:`~airflow_arroyo.runtime.sinks.delta`).
Other Spark sinks (``foreach_batch``, non-file formats) are at-least-once.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

    from airflow_arroyo.core.fs import FileSystem
    from airflow_arroyo.store.records import FencingToken

__all__ = ["SINK_META", "SinkCommit", "TransactionalSink", "folder_owner", "newest_generations"]

#: The folder a sink that writes to storage keeps its own files in (claims, manifests, staging), below its target.
SINK_META = "_arroyo_sink"


@dataclass(frozen=True)
class SinkCommit:
    """What one commit made visible: files (0 for a table), bytes (0 when not known), rows (None when a
    batch's count is unknown), the micro-batches it covered, and the table version it made (a lakehouse
    table's commit; None for other sinks)."""

    files: int
    bytes: int
    rows: int | None
    batches: tuple[int, ...]
    version: int | None = None


class TransactionalSink(Protocol):
    """A sink that commits with epochs (batch ids are the sink stage's micro-batch ids).

    Fencing: the driver sets ``token`` (its run's fencing token) before the sink's first write; from the
    moment a newer run claimed or rolled back the sink, every pre-commit, commit and rollback of the older
    run is refused with :class:`~airflow_arroyo.core.exceptions.FencedError` (the PostgreSQL sink in SQL, on
    its progress row; the file sink by per-generation names and commit points).
    """

    token: FencingToken | None

    @property
    def uri(self) -> str:
        """Where it writes (no credentials)."""

    def check_writable(self) -> None:
        """Read-only: refuse (``ConfigurationError``) a target this sink may not write."""

    def claim(self) -> None:
        """Record this sink as the target's one writer; prepare what it needs."""

    def has_state(self) -> bool:
        """Has an earlier run of this sink written anything?"""

    def write_batch(self, df: DataFrame, batch_id: int) -> None:
        """Pre-commit a micro-batch (replacing an earlier attempt of it)."""

    def commit_through(self, batch_id: int) -> SinkCommit:
        """Make every pre-committed batch ``<= batch_id`` visible (idempotent); says what it made visible."""

    def rollback_to(self, batch_id: int) -> None:
        """Keep exactly the batches ``<= batch_id``, all committed (``-1``: nothing)."""

    def trim_through(self, batch_id: int) -> None:
        """Forget what is kept only to roll back batches ``<= batch_id``."""

    def public_after(self, batch_id: int) -> int | None:
        """Read-only, before a restore's commit point: the newest batch after ``batch_id`` whose output readers
        have seen and a rollback cannot take back (None: a rollback to ``batch_id`` is possible)."""

    def close(self) -> None:
        """Let go of the clients it keeps between calls (the driver calls it when its run ends); a later call
        opens them again."""


def newest_generations(staged: Mapping[int, Iterable[int]], mine: int) -> dict[int, int]:
    """Per staged batch, the generation whose pre-commit counts: the highest not above this run's ``mine`` (a newer
    run's re-run of a batch wins over an older run's; a still newer run's is not this run's to commit). 0: no
    fencing token, every generation counts."""
    out: dict[int, int] = {}
    for batch, generations in staged.items():
        eligible = [g for g in generations if g <= mine or not mine]
        if eligible:
            out[batch] = max(eligible)
    return out


def folder_owner(fs: FileSystem) -> dict[str, str] | None:
    """Who claimed a sink's folder (``pipeline``, ``stage``, ...: its ``owner.json``), or None if nobody did."""
    try:
        value = fs.read_json(f"{SINK_META}/owner.json")
    except FileNotFoundError:
        return None
    return dict(value) if isinstance(value, dict) else None
