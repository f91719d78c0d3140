"""Which sources of a running query read without a read limit, and the warning that names the option to set.

Spark plans a micro-batch up to the latest offset each source allows (``latestOffset(start, limit)``); with no
read limit (``ReadAllAvailable``) that is everything available. When input arrives faster than the query drains
it, each batch then reads what arrived during the previous one, so batches grow with the backlog, and so do epochs:
a source stage cuts at its last completed micro-batch or when the running one ends ("One epoch, step by step" in
docs/runtime.md), so an epoch lasts what is left of the running batch. With a read limit each batch, and the
epochs with it, stays bounded while the backlog waits in the source. The driver reads each source stage's limits
once its queries are warm and logs :func:`unbounded_source_warning` for those without one.

Spark keeps the limit it asked each source for in ``StreamExecution.uniqueSources`` (a map from source to
``ReadLimit``, set when the query plans its first batch; sources that do not support admission control are
there with ``ReadAllAvailable``). A Python data source's limit is there as ``PythonStreamingSourceReadLimit``
holding the JSON of the limit its reader returned (``{"_type": "ReadMaxRows", ...}``), whose type is what counts.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["SourceReadLimit", "query_read_limits", "unbounded_source_warning", "unbounded_sources"]

#: Spark's ``ReadLimit`` classes that put no upper bound on a batch (a minimum alone only delays it)
UNBOUNDED_LIMITS = frozenset({"ReadAllAvailable", "ReadMinRows"})


@dataclass(frozen=True)
class SourceReadLimit:
    """One source of a query and the read limit Spark plans its batches with."""

    source: str  # Spark's description of the source
    limits: tuple[str, ...]  # the limit's class names (a CompositeReadLimit: its parts)
    text: str = ""  # the limit as Spark prints it

    @property
    def bounded(self) -> bool:
        """Whether a micro-batch of this source has an upper bound."""
        return any(name not in UNBOUNDED_LIMITS for name in self.limits)


def unbounded_sources(limits: Sequence[SourceReadLimit]) -> list[str]:
    """The descriptions of the sources in ``limits`` that read everything available in each micro-batch."""
    return [s.source for s in limits if not s.bounded]


def unbounded_source_warning(pipeline_id: str, stage: str, sources: Sequence[str]) -> str:
    """The warning for a source stage whose ``sources`` read without a read limit: what it costs, the fix."""
    return (
        f"pipeline={pipeline_id} stage={stage}: source(s) {', '.join(sources)} read everything available in each "
        "micro-batch (no read limit); if input arrives faster than the stage drains it, each micro-batch reads what "
        "arrived during the previous one and grows with the backlog, and so does every epoch (an epoch waits for "
        "the source stage's running micro-batch). Set a read limit sized to a few seconds of throughput: "
        "maxOffsetsPerTrigger (Kafka), maxFilesPerTrigger or maxBytesPerTrigger (files), rows_per_batch "
        "(generator_source), max_rows_per_batch (a channel); see 'Epochs under backpressure' in docs/runtime.md"
    )


def _limit_names(limit: Any) -> tuple[str, ...]:
    name = str(limit.getClass().getSimpleName())
    if name == "CompositeReadLimit":
        return tuple(n for part in limit.getReadLimits() for n in _limit_names(part))
    if name == "PythonStreamingSourceReadLimit":  # a Python data source's limit, as its reader returned it
        try:
            return (str(json.loads(str(limit.json())).get("_type", name)),)
        except (ValueError, AttributeError):
            return (name,)
    return (name,)


def query_read_limits(query: Any) -> list[SourceReadLimit] | None:
    """The read limit of each source of the running streaming ``query`` (a PySpark ``StreamingQuery``), from
    Spark's ``uniqueSources``; None where it cannot be read (a Spark Connect query, no plan yet)."""
    jquery = getattr(query, "_jsq", None)
    if jquery is None:
        return None
    try:
        unique = jquery.streamingQuery().uniqueSources()
    except Exception:  # noqa: BLE001 - another Spark's internals: the check is advice, never a failure
        return None
    if unique is None:
        return None
    out = []
    entries = unique.iterator()
    while entries.hasNext():
        pair = entries.next()
        source, limit = pair._1(), pair._2()
        out.append(SourceReadLimit(source=str(source.toString()), limits=_limit_names(limit),
                                   text=str(limit.toString())))
    return out
