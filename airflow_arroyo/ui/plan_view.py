"""The physical plan a run recorded (``config["plan"]``, :meth:`PhysicalPlan.as_dict
<airflow_arroyo.runtime.plan.PhysicalPlan.as_dict>`) as rows for the pipeline page.

Pure and tolerant: the row was written by whatever registered the run (an older driver without a plan, a
fork, another tool), so any key may be missing or of the wrong type. :func:`plan_view` returns None when
no usable plan is there (the page says it was not recorded); a plan with queries but without channels or
without ``chaining`` is shown with those parts marked as not recorded; a query or channel entry that is
not an object is counted in :attr:`PlanView.unreadable` instead of failing the page.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["ChannelRow", "PlanView", "QueryRow", "plan_view"]

NOT_RECORDED = "–"


@dataclass(frozen=True)
class QueryRow:
    """One Structured Streaming query: the logical stages fused into it and what it reads and writes."""

    name: str
    stages: tuple[str, ...]  # logical stages, data-flow order (head first)
    kind: str  # source | stage | sink, or "" when not recorded
    reads: str  # its input channels, "Spark sources", or "–"
    writes: str  # its output channel, "a sink", or "–"
    output_mode: str
    stateful: tuple[str, ...]  # stateful stages, or not known to be stateless
    fused_channels: tuple[str, ...]  # channels compiled away inside the query

    @property
    def fused(self) -> bool:
        """Several logical stages run as this one query."""
        return len(self.stages) > 1


@dataclass(frozen=True)
class ChannelRow:
    """A channel that remains, once per reader: why it was not compiled away."""

    channel: str
    writer: str
    reader: str | None  # None: nobody in the pipeline reads it (an output for outside readers)
    reason: str  # a Boundary value ("fan-out", "stateful", ...); "" when none was recorded
    detail: str


@dataclass(frozen=True)
class PlanView:
    """What the pipeline page shows of a recorded plan."""

    chaining: bool | None  # None: not recorded
    queries: tuple[QueryRow, ...]
    channel_rows: tuple[ChannelRow, ...] | None  # None: not recorded
    channel_count: int  # distinct remaining channels
    unreadable: int = 0  # entries that were not objects, left out

    @property
    def fused_count(self) -> int:
        """Queries that run several logical stages."""
        return sum(1 for q in self.queries if q.fused)


def _text(value: Any, default: str = NOT_RECORDED) -> str:
    if value is None or isinstance(value, list | dict):
        return default
    return str(value)


def _names(value: Any) -> tuple[str, ...]:
    if not isinstance(value, list):
        return ()
    return tuple(str(v) for v in value if v is not None and not isinstance(v, list | dict))


def _query(q: Mapping[str, Any]) -> QueryRow:
    stages = _names(q.get("stages"))
    name = _text(q.get("name"), "~".join(stages) or "?")
    if not stages and "name" in q:
        stages = (name,)
    kind = _text(q.get("kind"), "")
    inputs = q.get("inputs")
    reads = (", ".join(_names(inputs)) or "Spark sources") if isinstance(inputs, list) else NOT_RECORDED
    if "output" not in q:
        writes = NOT_RECORDED
    elif q["output"] is None:
        writes = "a sink"
    else:
        writes = _text(q["output"])
    return QueryRow(name=name, stages=stages, kind=kind, reads=reads, writes=writes,
                    output_mode=_text(q.get("output_mode")), stateful=_names(q.get("stateful")),
                    fused_channels=_names(q.get("fused_channels")))


def _channel_rows(c: Mapping[str, Any]) -> list[ChannelRow]:
    channel, writer = _text(c.get("channel"), "?"), _text(c.get("writer"), "?")
    readers = c.get("readers")
    rows = [ChannelRow(channel, writer, _text(r.get("stage"), "?"), _text(r.get("reason"), ""),
                       _text(r.get("detail"), ""))
            for r in (readers if isinstance(readers, list) else []) if isinstance(r, Mapping)]
    if not rows:
        detail = ("nobody in the pipeline reads it (an output for outside readers)" if readers == []
                  else "its readers were not recorded")
        rows.append(ChannelRow(channel, writer, None, "", detail))
    return rows


def plan_view(config: Mapping[str, Any] | None) -> PlanView | None:
    """The rows of the plan in a pipeline row's ``config``; None when no usable plan was recorded."""
    plan = config.get("plan") if isinstance(config, Mapping) else None
    if not isinstance(plan, Mapping) or not isinstance(plan.get("queries"), list):
        return None
    raw_queries: list[Any] = plan["queries"]
    queries = tuple(_query(q) for q in raw_queries if isinstance(q, Mapping))
    if not queries:
        return None
    unreadable = len(raw_queries) - len(queries)
    raw_channels = plan.get("channels")
    channel_rows: tuple[ChannelRow, ...] | None = None
    channel_count = 0
    if isinstance(raw_channels, list):
        entries = [c for c in raw_channels if isinstance(c, Mapping)]
        unreadable += len(raw_channels) - len(entries)
        channel_rows = tuple(row for c in entries for row in _channel_rows(c))
        channel_count = len(entries)
    chaining = plan.get("chaining")
    return PlanView(chaining=chaining if isinstance(chaining, bool) else None, queries=queries,
                    channel_rows=channel_rows, channel_count=channel_count, unreadable=unreadable)
