"""Operator chaining: which stages of a pipeline run fused as one Structured Streaming query.

Flink chains operators into one task when the graph allows it; here stages are **fused** into one
query when the graph allows it, and a channel remains only where it is needed. A stage ``s`` fuses into
the stage ``w`` that writes its input channel ``c`` when all of these hold (else the channel stays, and
:class:`Boundary` says why):

* ``Pipeline(chaining=True)`` (the pipeline asks for chaining; :attr:`Boundary.DISABLED`);
* each channel ``s`` reads has exactly one reader (:attr:`Boundary.FAN_OUT`);
* ``s`` reads only ``c``, or every channel it reads is written by a query that starts at a Spark source
  (those queries merge into one, whose micro-batch is a consistent cut across its sources: nothing to
  align); otherwise it aligns its inputs' barriers (:attr:`Boundary.MULTI_INPUT`);
* neither ``w`` nor ``s`` is part of a loop, the FLIP-16 iteration head and its feedback included
  (:attr:`Boundary.LOOP`);
* ``s`` did not ask for a boundary with ``chain=False`` (:attr:`Boundary.EXPLICIT`);
* both have the same trigger interval (:attr:`Boundary.TRIGGER`);
* the fused query holds **at most one stateful stage** (:attr:`Boundary.STATEFUL`). Spark 4 can run
  several stateful operators in one query only in append mode with event-time watermarks, and a
  watermark of one stage would change which rows a later stage's operator sees as late; so the rule is
  conservative: a stateful stage fuses only with stateless neighbours. A stage is *stateful* when its
  own part of the analyzed plan holds a node that is not a known stateless one (aggregations,
  deduplication, joins, ``*WithState``, limits, sorts, and event-time watermarks are all counted);
  a stage whose plan could not be analyzed (no session, on or below a loop, or its read or transform
  raised) fuses with nothing, so that its errors name it (:func:`stateful_stages`);
* the output modes agree: a stateless stage's ``append`` adopts the stateful stage's mode, any other
  difference keeps the channel (:attr:`Boundary.OUTPUT_MODE`); so do ``state_store`` and ``spark_conf``,
  which apply to a whole query (:attr:`Boundary.STATE_STORE`, :attr:`Boundary.SPARK_CONF`).

A fused group runs as one stage whose transform is the composition of its members' transforms, named
after its members joined by ``~`` (``left~right~joined~report``); a single stage keeps its own name
and spec, so an unfused pipeline runs exactly as before. The group's checkpoint holds every member's
state, its micro-batch is a consistent cut across its inputs, and it cuts, snapshots and acknowledges
epochs as one stage (the store counts the physical stages). Changing which stages fuse changes the
physical stage names, so a restore across such a change is refused with the names that differ.

:func:`plan_chains` is pure (unit-tested without Spark); :func:`stateful_stages` asks Spark's analyzer.
"""

from __future__ import annotations

import enum
import hashlib
import logging
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from airflow_arroyo.runtime.graph import PipelineGraph, StageKind, StageSpec

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

__all__ = ["WATERMARK_DELAY_KEY", "Boundary", "ChainedTransform", "ChannelEdge", "FusedGroup", "Fusion",
           "PhysicalPlan", "compose_stages", "decide_fusion", "plan_chains", "stateful_stages",
           "watermarks_not_crossing"]

log = logging.getLogger(__name__)

SEPARATOR = "~"  # joins member names into a fused stage's name; never part of a stage name
_MAX_NAME = 120


class Boundary(enum.StrEnum):
    """Why a channel remains between its writer and its reader."""

    DISABLED = "chaining-disabled"  # Pipeline(chaining=False)
    FAN_OUT = "fan-out"  # the channel has several readers
    MULTI_INPUT = "multi-input"  # the reader reads several channels and aligns their barriers
    LOOP = "loop"  # writer or reader is part of a loop (iteration head, feedback)
    EXPLICIT = "explicit"  # the reader asked for chain=False
    TRIGGER = "trigger-interval"  # writer and reader have different trigger intervals
    STATEFUL = "stateful"  # the fused query would hold two stateful stages (or one of unknown state)
    OUTPUT_MODE = "output-mode"
    STATE_STORE = "state-store"
    SPARK_CONF = "spark-conf"


@dataclass(frozen=True)
class ChannelEdge:
    """A channel that remains, with the reason for each of its readers."""

    channel: str
    writer: str  # logical stage
    readers: tuple[tuple[str, Boundary, str], ...]  # (reader stage, reason, detail)


@dataclass(frozen=True)
class ChainedTransform:
    """The composition of a fused group's transforms. A chain: the head's ``fn`` on the query's arguments
    (``spark``, or the input DataFrames), then each later member's on the previous output. Merged source
    queries: each of ``branches`` on ``spark``, the first of ``fns`` on their outputs, then the rest. A sink
    without ``transform`` passes its input on."""

    names: tuple[str, ...]
    fns: tuple[Callable[..., Any] | None, ...]
    branches: tuple[Callable[..., Any], ...] = ()

    def __call__(self, *args: Any) -> Any:
        """The group's DataFrame from the query's arguments."""
        frames = [b(*args) for b in self.branches] if self.branches else list(args)
        first, *rest = self.fns
        df = first(*frames) if first is not None else frames[0]
        for fn in rest:
            if fn is not None:
                df = fn(df)
        return df

    def __repr__(self) -> str:
        return f"ChainedTransform({' -> '.join(self.names)})"


@dataclass(frozen=True)
class FusedGroup:
    """Stages run as one query: ``stages`` in data-flow order (head first), ``spec`` the physical stage."""

    stages: tuple[str, ...]
    spec: StageSpec
    fused_channels: tuple[str, ...]  # channels inside the group, compiled away
    shape: str = ""  # how the members compose, stateful ones starred: "(left, right) -> joined* -> report"

    @property
    def name(self) -> str:
        """The physical stage's name (its checkpoint folder, its acknowledgements)."""
        return self.spec.name


@dataclass(frozen=True)
class PhysicalPlan:
    """What the driver runs: one query per group, channels only between groups."""

    pipeline_id: str
    chaining: bool
    groups: tuple[FusedGroup, ...]  # topological order
    channels: tuple[ChannelEdge, ...]  # the channels that remain (each written by a group's tail)
    stateful: Mapping[str, bool | None] = field(default_factory=dict)  # None: unknown (counted as stateful)

    @property
    def graph(self) -> PipelineGraph:
        """The physical graph: a stage per group, channels between them."""
        specs = tuple(g.spec for g in self.groups)
        writers = {s.output: s.name for s in specs if s.output is not None}
        return PipelineGraph(pipeline_id=self.pipeline_id, stages=specs, writers=writers)

    @property
    def fused_channels(self) -> list[str]:
        """Channels compiled away (no files: the data passes inside one query)."""
        return [c for g in self.groups for c in g.fused_channels]

    def group_of(self, stage: str) -> FusedGroup:
        """The group running logical stage ``stage`` (``KeyError`` if none)."""
        for g in self.groups:
            if stage in g.stages:
                return g
        raise KeyError(stage)

    def as_dict(self) -> dict[str, Any]:
        """The plan as JSON-ready data (the driver records it with the run; the UI may show it)."""
        return {
            "pipeline_id": self.pipeline_id,
            "chaining": self.chaining,
            "queries": [{"name": g.name, "stages": list(g.stages), "kind": g.spec.kind.value,
                         "inputs": list(g.spec.all_inputs), "output": g.spec.output,
                         "output_mode": g.spec.output_mode, "fused_channels": list(g.fused_channels),
                         "stateful": [s for s in g.stages if self.stateful.get(s) is not False]}
                        for g in self.groups],
            "channels": [{"channel": e.channel, "writer": e.writer,
                          "readers": [{"stage": r, "reason": b.value, "detail": d} for r, b, d in e.readers]}
                         for e in self.channels],
        }

    def explain(self) -> str:
        """The plan as text: one line per query, then each remaining channel and why it remains."""
        lines = [f"pipeline {self.pipeline_id}: {len(self.groups)} queries, {len(self.channels)} channels"
                 + ("" if self.chaining else " (chaining disabled)")]
        for g in self.groups:
            inputs = ", ".join(g.spec.all_inputs) or "Spark sources"
            out = g.spec.output if g.spec.output is not None else "a sink"
            fused = f" (fused; channels {', '.join(g.fused_channels)} compiled away)" if g.fused_channels else ""
            lines.append(f"  query {g.name}: {g.shape or g.name}; reads {inputs}; writes {out}; "
                         f"{g.spec.output_mode}{fused}")
        for e in self.channels:
            for reader, why, detail in e.readers:
                lines.append(f"  channel {e.channel}: {e.writer} -> {reader}: {why.value}: {detail}")
        lines.append("  (* stateful, or not known to be stateless)")
        return "\n".join(lines)


# --------------------------------------------------------------------------- planning (pure)


def _in_loops(graph: PipelineGraph) -> set[str]:
    """Stages on some loop (feedback edges included): strongly connected components of size > 1."""
    down: dict[str, set[str]] = {s.name: set() for s in graph.stages}
    for s in graph.stages:
        for c in s.all_inputs:
            down[graph.writers[c]].add(s.name)
    # a stage is on a loop when it reaches itself
    out: set[str] = set()
    for start in down:
        seen: set[str] = set()
        stack = list(down[start])
        while stack:
            n = stack.pop()
            if n == start:
                out.add(start)
                break
            if n not in seen:
                seen.add(n)
                stack.extend(down[n])
    return out


@dataclass
class _Building:
    members: list[StageSpec]
    fused_channels: list[str]
    branches: tuple[Callable[..., Any], ...]  # the composed reads of merged source queries (empty: a chain)
    fns: list[Callable[..., Any] | None]  # then these, in order
    shape: str

    @classmethod
    def of(cls, s: StageSpec, stateful: Mapping[str, bool | None]) -> _Building:
        return cls([s], [], (), [s.fn], _marked(s.name, stateful))

    def transform(self) -> Callable[..., Any]:
        if len(self.members) == 1 and self.members[0].fn is not None:
            return self.members[0].fn
        return ChainedTransform(tuple(m.name for m in self.members), tuple(self.fns), self.branches)


def _is_stateful(stateful: Mapping[str, bool | None], name: str) -> bool:
    return stateful.get(name) is not False


def _marked(name: str, stateful: Mapping[str, bool | None]) -> str:
    return f"{name}*" if _is_stateful(stateful, name) else name


def _cadence(s: StageSpec) -> str:
    # fusion compares the values the stages set, not what they run at: plans stay as they were when the default moves
    return "at the default cadence" if s.trigger_interval is None else f"every {s.trigger_interval:g}s"


def _merge_reason(upstream: Sequence[_Building], s: StageSpec,
                  stateful: Mapping[str, bool | None]) -> tuple[Boundary, str] | None:
    """Why ``s`` cannot join the ``upstream`` groups (whose tails write its inputs), or None when it can."""
    members = [*(m for g in upstream for m in g.members), s]
    other = next((m for m in members if m.trigger_interval != s.trigger_interval), None)
    if other is not None:
        return Boundary.TRIGGER, (f"{other.name!r} triggers {_cadence(other)}, {s.name!r} {_cadence(s)}")
    unknown = [m.name for m in members if stateful.get(m.name) is None]
    if unknown:  # not analyzed (no session, on or below a loop) or its read/transform raised: it runs alone, so
        # that what it does (an error while it is built included) is its own and names it
        return Boundary.STATEFUL, (f"{', '.join(unknown)} could not be analyzed (statefulness unknown); a stage "
                                   "Spark could not analyze runs as its own query")
    holders = [m.name for m in members if _is_stateful(stateful, m.name)]
    if len(holders) > 1:
        return Boundary.STATEFUL, (f"one query would hold stateful stages {', '.join(holders)}; a stateful "
                                   "stage fuses only with stateless neighbours")
    modes = {m.output_mode for m in members if m.output_mode != "append" or _is_stateful(stateful, m.name)}
    if len(modes) > 1:
        return Boundary.OUTPUT_MODE, f"output modes differ ({', '.join(sorted(modes))})"
    stores = {m.state_store for m in members if m.state_store is not None}
    if len(stores) > 1:
        return Boundary.STATE_STORE, f"state stores differ ({', '.join(sorted(stores))})"
    if any(dict(m.spark_conf) != dict(s.spark_conf) for m in members):
        return Boundary.SPARK_CONF, "spark_conf differs (it applies to a whole query)"
    return None


def _group_name(names: Sequence[str]) -> str:
    name = SEPARATOR.join(names)
    if len(names) == 1 or len(name) <= _MAX_NAME:
        return name
    digest = hashlib.sha1(name.encode()).hexdigest()[:8]
    return SEPARATOR.join([names[0], f"{len(names) - 2}-more-{digest}", names[-1]])


def _fused_spec(group: _Building, stateful: Mapping[str, bool | None]) -> StageSpec:
    """One physical stage for ``group`` (the stage itself when alone)."""
    members = group.members
    if len(members) == 1:
        return members[0]
    head, tail = members[0], members[-1]
    modes = {m.output_mode for m in members if m.output_mode != "append" or _is_stateful(stateful, m.name)}
    stores = {m.state_store for m in members if m.state_store is not None}
    kind = head.kind if head.kind is StageKind.SOURCE else tail.kind
    return replace(
        tail, name=_group_name([m.name for m in members]), kind=kind, fn=group.transform(),
        inputs=() if group.branches else head.inputs, feedback=() if group.branches else head.feedback,
        output_mode=next(iter(modes), "append"), state_store=next(iter(stores), None),
        trigger_interval=head.trigger_interval, spark_conf=dict(head.spark_conf),
        uid=None,  # a fused query is known by its group's name (its members' uids describe the logical stages)
    )


def _boundary(graph: PipelineGraph, s: StageSpec, groups: Mapping[str, _Building], loops: set[str],
              facts: Mapping[str, bool | None], chaining: bool) -> tuple[Boundary, str] | None:
    """Why channel stage ``s`` cannot fuse with the queries writing its inputs (None: it can)."""
    if not chaining:
        return Boundary.DISABLED, "Pipeline(chaining=False)"
    if s.feedback:
        return Boundary.LOOP, f"{s.name!r} is an iteration head"
    writers = [graph.writers[c] for c in s.inputs]
    for c in s.inputs:
        if len(graph.readers(c)) > 1:
            return Boundary.FAN_OUT, f"{len(graph.readers(c))} stages read {c!r}"
    on_loop = next((n for n in (*writers, s.name) if n in loops), None)
    if on_loop is not None:
        return Boundary.LOOP, f"{on_loop!r} is on a loop"
    if not s.chain:
        return Boundary.EXPLICIT, f"{s.name!r} asked for a boundary (chain=False)"
    upstream = [groups[w] for w in writers]
    if len(upstream) > 1 and any(g.members[0].kind is not StageKind.SOURCE for g in upstream):
        return Boundary.MULTI_INPUT, (f"{s.name!r} reads {len(upstream)} channels and aligns their barriers (it "
                                     "fuses only when every input comes from a source's query)")
    return _merge_reason(upstream, s, facts)


def plan_chains(graph: PipelineGraph, stateful: Mapping[str, bool | None] | None = None, *,
                chaining: bool = True) -> PhysicalPlan:
    """Group ``graph``'s stages into fused queries (see the module's rules).

    ``stateful`` maps a stage to whether its own transform holds state (None or missing: unknown, counted
    as stateful; :func:`stateful_stages` finds it with Spark). ``chaining=False`` keeps every channel.
    """
    facts: dict[str, bool | None] = {s.name: (stateful or {}).get(s.name) for s in graph.stages}
    loops = _in_loops(graph)
    groups: dict[str, _Building] = {}  # tail stage -> its group
    order: list[_Building] = []
    kept: dict[str, list[tuple[str, Boundary, str]]] = {}
    for s in graph.stages:
        if s.kind is StageKind.SOURCE:
            group = _Building.of(s, facts)
            order.append(group)
            groups[s.name] = group
            continue
        reason = _boundary(graph, s, groups, loops, facts, chaining)
        if reason is not None:
            for c in s.all_inputs:
                kept.setdefault(c, []).append((s.name, reason[0], reason[1]))
            group = _Building.of(s, facts)
            order.append(group)
        else:
            upstream = [groups.pop(graph.writers[c]) for c in s.inputs]
            if len(upstream) == 1:
                group = upstream[0]
                group.members.append(s)
                group.fused_channels.append(s.inputs[0])
                group.fns.append(s.fn)
                group.shape = f"{group.shape} -> {_marked(s.name, facts)}"
            else:
                group = _Building([m for g in upstream for m in g.members], [*(c for g in upstream
                                                                               for c in g.fused_channels), *s.inputs],
                                  tuple(g.transform() for g in upstream), [s.fn],
                                  f"({', '.join(g.shape for g in upstream)}) -> {_marked(s.name, facts)}")
                group.members.append(s)
                at = min(order.index(g) for g in upstream)
                order[at] = group
                order[:] = [g for g in order if not any(g is u for u in upstream)]
        groups[s.name] = group
    built = tuple(FusedGroup(tuple(m.name for m in g.members), _fused_spec(g, facts), tuple(g.fused_channels),
                             g.shape) for g in order)
    channels = tuple(ChannelEdge(c, graph.writers[c], tuple(readers)) for c in graph.channels
                     if (readers := kept.get(c)))
    # a channel nobody reads (an output for outside readers) remains too
    unread = tuple(ChannelEdge(c, graph.writers[c], ()) for c in graph.channels
                   if not graph.readers(c))
    return PhysicalPlan(graph.pipeline_id, chaining, built, channels + unread, facts)



@dataclass(frozen=True)
class Fusion:
    """What :func:`decide_fusion` answers: the physical plan a run executes (None: it depends on which stages
    hold state, and Spark was not asked), and how that was decided, in words for a user."""

    plan: PhysicalPlan | None
    why: str
    unfused_for_epoch: int | None = None  # the epoch taken unfused that keeps this run unfused (chaining=None)


def decide_fusion(graph: PipelineGraph, stateful: Mapping[str, bool | None] | None, *, chaining: bool | None,
                  restoring: Callable[[], tuple[int, Sequence[str]] | None]) -> Fusion:
    """The physical plan the driver runs for ``graph`` (the logical graph of ``Pipeline(chaining=chaining)``), the
    one decision the driver and the upgrade's dry runs share (docs/upgrading.md, "Checking a plan").

    ``stateful`` is what :func:`stateful_stages` found (None: Spark was not asked). ``restoring`` answers the epoch
    the run restores and its stages (None: it restores none); it is called only when the answer depends on it.
    ``chaining=False`` runs every stage as its own query. Otherwise the rules fuse (:func:`plan_chains`), except
    that with ``chaining=None`` a restore of an epoch taken unfused (its stages are the graph's) runs unfused: that
    epoch holds a snapshot per stage, not per fused query. Without ``stateful`` the plan is known only where no
    two stages could fuse whatever Spark finds, or where that exception applies."""
    if chaining is False:
        return Fusion(plan_chains(graph, chaining=False), "chaining=False: every stage is its own query")
    fused = plan_chains(graph, stateful, chaining=True) if stateful is not None else None
    # without Spark: the most any statefulness could fuse (stateless stages meet the fewest boundaries)
    if fused is None and len(plan_chains(graph, dict.fromkeys(graph.stage_names, False)).groups) == len(
            graph.stages):
        return Fusion(plan_chains(graph), "no two stages can fuse, whichever hold state (a boundary at every "
                      "channel)")
    if chaining is None and (fused is None or len(fused.groups) < len(graph.stages)):
        epoch = restoring()
        if epoch is not None and set(epoch[1]) == set(graph.stage_names):
            return Fusion(plan_chains(graph), f"epoch {epoch[0]} was taken with every stage its own query: a "
                          "restore of it runs unfused (chaining=None)", unfused_for_epoch=epoch[0])
    if fused is None:
        return Fusion(None, "which stages run fused depends on which hold state, which Spark's analyzer decides "
                      "when the driver starts")
    return Fusion(fused, "fused as Spark's analyzer found the stages' state (runtime/plan.py's rules)")


# --------------------------------------------------------------------------- statefulness (asks Spark)

# Logical plan nodes that hold no state across micro-batches (Spark 4.x names). Anything else in a stage's own
# part of the analyzed plan counts as state: aggregations, Deduplicate*, Join, *WithState*, limits, sorts,
# windows, and EventTimeWatermark (a watermark changes what a later stateful operator of the query drops).
STATELESS_NODES = frozenset({
    "Project", "Filter", "SubqueryAlias", "View", "ResolvedHint", "Union", "Generate", "Expand", "Sample",
    "Repartition", "RepartitionByExpression", "RebalancePartitions", "SerializeFromObject",
    "DeserializeToObject", "MapElements", "MapPartitions", "TypedFilter", "AppendColumns",
    "MapPartitionsInPandas", "MapInPandas", "MapInArrow", "PythonMapInArrow", "BatchEvalPython",
    "ArrowEvalPython", "StreamingRelation", "StreamingRelationV2", "StreamingDataSourceV2Relation",
    "StreamingDataSourceV2ScanRelation", "StreamingExecutionRelation", "LocalRelation", "LogicalRDD",
    "LogicalRelation", "Range", "OneRowRelation", "WithCTE", "CTERelationRef", "CTERelationDef",
})
_NODE = re.compile(r"^[\s:|+\-~]*([A-Za-z][A-Za-z0-9_]*)")  # "~" marks a streaming node


def plan_nodes(tree: str) -> list[str]:
    """The node names of a logical plan's ``treeString`` (one node per line)."""
    return [m.group(1) for line in tree.splitlines() if (m := _NODE.match(line))]


def _stateful_count(df: DataFrame) -> int:
    tree = str(df._jdf.queryExecution().analyzed().treeString())
    return sum(1 for n in plan_nodes(tree) if n not in STATELESS_NODES)


def compose_stages(graph: PipelineGraph, spark: SparkSession) -> dict[str, DataFrame | None]:
    """Every stage composed over its inputs' DataFrames (a source's ``read(spark)``, then the transforms in
    topological order, with no channel in between), for Spark's analyzer; None for a stage on a loop or below
    one, or whose read/transform raised (the driver's build reports the error)."""
    frames: dict[str, DataFrame | None] = {}
    for s in graph.stages:
        inputs = [frames.get(graph.writers[c]) for c in s.all_inputs]
        df: DataFrame | None = None
        if s.kind is StageKind.SOURCE or (not s.feedback and all(f is not None for f in inputs)):
            try:
                if s.kind is StageKind.SOURCE:
                    assert s.fn is not None
                    df = s.fn(spark)
                else:
                    df = s.fn(*inputs) if s.fn is not None else inputs[0]
                assert df is not None
                df.schema  # noqa: B018 - analyzes the plan: an error shows here, not later
            except Exception as exc:  # noqa: BLE001 - user code: the build reports it by stage; here it only blocks fusion
                log.info("pipeline=%s stage=%s: could not analyze the stage (%s: %s); counted as stateful",
                         graph.pipeline_id, s.name, type(exc).__name__, str(exc)[:200])
                df = None
        frames[s.name] = df
    return frames


def stateful_stages(graph: PipelineGraph, spark: SparkSession,
                    frames: Mapping[str, DataFrame | None] | None = None) -> dict[str, bool | None]:
    """Whether each stage's own transform holds state, from Spark's analyzed plans.

    A stage is stateful when its plan, composed over its inputs' (:func:`compose_stages`, or ``frames`` from
    it), holds more non-stateless nodes than its inputs' plans together. A stage that could not be composed is
    None (unknown: counted as stateful).
    """
    frames = compose_stages(graph, spark) if frames is None else frames
    counts: dict[str, int] = {}
    out: dict[str, bool | None] = {}
    for s in graph.stages:
        df = frames.get(s.name)
        if df is None:
            out[s.name] = None
            continue
        try:
            counts[s.name] = _stateful_count(df)
        except Exception as exc:  # noqa: BLE001 - py4j: unknown, counted as stateful
            log.info("pipeline=%s stage=%s: could not read the stage's plan (%s); counted as stateful",
                     graph.pipeline_id, s.name, exc)
            out[s.name] = None
            continue
        below = sum(counts.get(graph.writers[c], 0) for c in s.all_inputs)
        out[s.name] = counts[s.name] > below
    return out


#: the column metadata Spark gives an event-time column under a watermark (``EventTimeWatermark.delayKey``)
WATERMARK_DELAY_KEY = "spark.watermarkDelayMs"


def _watermarks(df: DataFrame) -> dict[str, int]:
    """The event-time columns of ``df``'s output that carry a watermark, with its delay in ms."""
    return {f.name: int(f.metadata[WATERMARK_DELAY_KEY]) for f in df.schema.fields
            if WATERMARK_DELAY_KEY in (f.metadata or {})}


def watermarks_not_crossing(graph: PipelineGraph, plan: PhysicalPlan, frames: Mapping[str, DataFrame | None],
                            stateful: Mapping[str, bool | None]) -> list[str]:
    """A warning for each remaining channel read by a stateful stage that relies on a watermark set before the
    channel: each query has its own event-time watermark and a channel's reader starts with none, so such a
    stage runs without it (a stream-stream join or deduplication then keeps every row in its state; an
    append-mode aggregation is refused by Spark). None where the reader sets its own watermark. ``graph`` is the
    logical graph ``plan`` was made from, ``frames`` its stages composed (:func:`compose_stages`), ``stateful``
    what :func:`stateful_stages` found (a stage known stateless needs no watermark)."""
    out = []
    for edge in plan.channels:
        for reader, _, _ in edge.readers:
            try:
                marks = _lost_watermarks(graph, frames, edge.writer, reader, stateful)
            except Exception as exc:  # noqa: BLE001 - a warning's check: never the reason a run does not start
                log.info("pipeline=%s: could not check the watermarks of channel %s: %s", graph.pipeline_id,
                         edge.channel, exc)
                continue
            if not marks:
                continue
            cols = ", ".join(f"{c!r} ({ms} ms)" for c, ms in sorted(marks.items()))
            out.append(f"stage {reader!r} reads channel {edge.channel!r}, whose rows carry an event-time watermark on "
                       f"{cols} set before the channel; a channel does not carry a watermark (each query has its "
                       f"own), so {reader!r} runs without one and its state is not bounded by it: call "
                       f"withWatermark in {reader!r} on its input")
    return out


def _lost_watermarks(graph: PipelineGraph, frames: Mapping[str, DataFrame | None], writer: str, reader: str,
                     stateful: Mapping[str, bool | None]) -> dict[str, int]:
    """The watermarks on ``writer``'s output that stateful ``reader``, reading it through a channel, relies on
    and does not set itself (empty: none)."""
    written, df = frames.get(writer), frames.get(reader)
    if written is None or df is None or stateful.get(reader) is False:
        return {}
    marks = _watermarks(written)
    below = sum(_watermark_nodes(frames.get(graph.writers[c])) for c in graph.stage(reader).all_inputs)
    return {} if not marks or _watermark_nodes(df) > below else marks


def _watermark_nodes(df: DataFrame | None) -> int:
    if df is None:
        return 0
    return plan_nodes(str(df._jdf.queryExecution().analyzed().treeString())).count("EventTimeWatermark")
