"""The pipeline graph: named stages joined by channels, validated before Spark starts.

A pipeline is built from plain functions, the way a bytewax dataflow is::

    from airflow_arroyo.runtime import Pipeline
    from airflow_arroyo.testing import generator_source

    p = Pipeline("orders")
    left = p.source("left", lambda spark: generator_source(spark, seed=1, total_rows=10_000, rows_per_batch=500))
    right = p.source("right", lambda spark: generator_source(spark, seed=2, total_rows=10_000, rows_per_batch=500))
    joined = p.stage("joined", lambda l, r: l.join(r, "id"), inputs=[left, right])
    p.stage("report", lambda j: j.where("l_value > 10"), inputs=[joined])

Three kinds of stage; the stages the graph allows run fused in one Structured Streaming query (operator
chaining, decided by the graph: see :mod:`~airflow_arroyo.runtime.plan` and :meth:`Pipeline.explain`;
``Pipeline(..., chaining=False)`` runs one query per stage):

* **source** (:meth:`Pipeline.source`): ``read(spark) -> streaming DataFrame`` over any Spark streaming
  source (or the replayable generator); its output goes to a channel.
* **stage** (:meth:`Pipeline.stage`): ``transform(*input_dataframes) -> streaming DataFrame``; any
  Spark transformation, stateful ones included. Inputs are channels; its output goes to a channel.
* **sink** (:meth:`Pipeline.sink`): reads channels like a stage but writes to a Spark sink (a
  ``foreach_batch`` function or a batch writer ``format``) instead of a channel.

Every stage's output is the channel named after the stage (``output=`` names it otherwise); a stage
reads channels by the name of the stage that writes them (a :class:`Stream` handle or a string).
A loop needs an **iteration head**: the stage that closes it lists the loop's last channel in
``feedback=[...]`` instead of ``inputs`` (FLIP-16); the head does not align on its feedback inputs.

:meth:`Pipeline.validate` (called by the driver before Spark starts) raises
:class:`~airflow_arroyo.exceptions.PipelineGraphError` naming the stage and the fix for: an unknown
channel, a stage without input, a loop without an iteration head, two writers on one channel, a
duplicate or unusable stage name, a feedback edge that closes no loop.
"""

from __future__ import annotations

import difflib
import enum
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from airflow_arroyo.epochs import validate_pipeline_id
from airflow_arroyo.exceptions import ConfigurationError, PipelineGraphError
from airflow_arroyo.runtime.delta_sink import DeltaTarget
from airflow_arroyo.runtime.file_sink import FILE_SINK_FORMATS
from airflow_arroyo.runtime.kafka_sink import KafkaTarget
from airflow_arroyo.runtime.pg_sink import PostgresTarget

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

    from airflow_arroyo.runtime.plan import PhysicalPlan

__all__ = [
    "OUTPUT_MODES",
    "STATE_STORES",
    "Pipeline",
    "PipelineGraph",
    "StageKind",
    "StageSpec",
    "Stream",
]

OUTPUT_MODES = ("append", "update", "complete")
STATE_STORES: dict[str, str] = {
    "hdfs": "org.apache.spark.sql.execution.streaming.state.HDFSBackedStateStoreProvider",
    "rocksdb": "org.apache.spark.sql.execution.streaming.state.RocksDBStateStoreProvider",
}
_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,99}$")

ReadFn = Callable[["SparkSession"], "DataFrame"]
TransformFn = Callable[..., "DataFrame"]
ForeachBatchFn = Callable[["DataFrame", int], None]


class StageKind(enum.StrEnum):
    """What a stage reads and writes."""
    SOURCE = "source"  # reads a Spark streaming source, writes a channel
    STAGE = "stage"  # reads channels, writes a channel
    SINK = "sink"  # reads channels, writes a Spark sink


@dataclass(frozen=True)
class Stream:
    """A handle on a stage's output channel, to pass as another stage's input."""

    pipeline_id: str
    channel: str

    def __str__(self) -> str:
        return self.channel


@dataclass(frozen=True)
class StageSpec:
    """One stage as the user declared it (unvalidated until :meth:`Pipeline.validate`)."""

    name: str
    kind: StageKind
    fn: Callable[..., Any] | None
    inputs: tuple[str, ...] = ()
    feedback: tuple[str, ...] = ()
    output: str | None = None  # channel written (None for sinks)
    output_mode: str = "append"
    state_store: str | None = None  # "hdfs" | "rocksdb" | None (the session's default)
    trigger_interval: float | None = None  # seconds between micro-batch starts (None: as fast as possible)
    foreach_batch: ForeachBatchFn | None = None  # sinks
    sink_format: str | None = None  # sinks: a batch writer format, e.g. "parquet"
    sink_options: Mapping[str, str] = field(default_factory=dict)
    postgres: PostgresTarget | None = None  # sinks: an exactly-once PostgreSQL table
    kafka: KafkaTarget | None = None  # sinks: an exactly-once Kafka topic
    table: DeltaTarget | None = None  # sinks: an exactly-once Delta Lake table
    spark_conf: Mapping[str, str] = field(default_factory=dict)  # SQL confs set for this stage's query only
    chain: bool = True  # False: keep a channel before this stage even where it could fuse (runtime/plan.py)

    @property
    def is_iteration_head(self) -> bool:
        """True for a stage that reads feedback channels (the head of a loop)."""
        return bool(self.feedback)

    @property
    def all_inputs(self) -> tuple[str, ...]:
        """Aligned inputs first, then feedback inputs: the order of the transform's arguments."""
        return self.inputs + self.feedback


def _names(items: Iterable[Stream | str], *, stage: str, what: str) -> tuple[str, ...]:
    out: list[str] = []
    for item in items:
        if isinstance(item, Stream):
            out.append(item.channel)
        elif isinstance(item, str):
            out.append(item)
        else:
            raise PipelineGraphError(
                f"stage {stage!r}: {what} must be Stream handles (returned by source()/stage()) or channel "
                f"names, got {type(item).__name__} {item!r}"
            )
    return tuple(out)


class Pipeline:
    """A graph of named stages. Build it with :meth:`source`, :meth:`stage` and :meth:`sink`."""

    def __init__(self, pipeline_id: str, *, description: str = "", chaining: bool | None = None) -> None:
        """``chaining``: which stages run fused in one Structured Streaming query (operator chaining,
        :mod:`~airflow_arroyo.runtime.plan`). ``None`` (the default): the graph decides, fusing what its rules
        allow, except that a run restoring an epoch taken unfused runs unfused (so a pipeline checkpointed
        before chaining keeps restoring). ``True``: always fuse what the rules allow (a restore of an epoch
        taken in another form is refused, naming the stages). ``False``: every stage its own query, every
        channel kept (``chain=False`` on a stage keeps only the channel before it)."""
        try:
            validate_pipeline_id(pipeline_id)
        except ConfigurationError as exc:
            raise PipelineGraphError(str(exc)) from exc
        self.pipeline_id = pipeline_id
        self.description = description
        self.chaining = chaining
        self._stages: list[StageSpec] = []

    def __repr__(self) -> str:
        return f"Pipeline({self.pipeline_id!r}, stages={[s.name for s in self._stages]})"

    @property
    def stages(self) -> list[StageSpec]:
        """The stages defined so far, in definition order."""
        return list(self._stages)

    def _add(self, spec: StageSpec) -> Stream | None:
        self._stages.append(spec)
        return Stream(self.pipeline_id, spec.output) if spec.output is not None else None

    # ------------------------------------------------------------------ builders

    def source(self, name: str, read: ReadFn, *, output: str | None = None,
               trigger_interval: float | None = None, spark_conf: Mapping[str, str] | None = None) -> Stream:
        """A stage that reads a Spark streaming source: ``read(spark)`` returns a streaming DataFrame.

        Any Spark streaming source works (files, rate, a Python data source, the replayable
        :func:`~airflow_arroyo.testing.generator_source`); the source must be replayable
        from the offsets in its checkpoint for a restore to be exactly-once (the generator, files and
        Kafka are; ``rate`` with wall-clock timestamps is not byte-identical).
        """
        spec = StageSpec(name=name, kind=StageKind.SOURCE, fn=read, output=output or name,
                         trigger_interval=trigger_interval, spark_conf=dict(spark_conf or {}))
        stream = self._add(spec)
        assert stream is not None
        return stream

    def stage(self, name: str, transform: TransformFn, inputs: Sequence[Stream | str], *,
              feedback: Sequence[Stream | str] = (), output: str | None = None,
              output_mode: Literal["append", "update", "complete"] = "append",
              state_store: Literal["hdfs", "rocksdb"] | None = None, trigger_interval: float | None = None,
              spark_conf: Mapping[str, str] | None = None, chain: bool = True) -> Stream:
        """A stage over channels: ``transform(*inputs, *feedback)`` returns a streaming DataFrame.

        ``output_mode`` is Spark's (``update`` for an aggregation's running results). ``state_store``
        picks the state store provider for this stage's query. ``feedback`` makes the stage an
        iteration head: those inputs close a loop and are not aligned. ``chain=False`` keeps a channel
        before this stage when the pipeline chains (:mod:`~airflow_arroyo.runtime.plan`).
        """
        spec = StageSpec(
            name=name, kind=StageKind.STAGE, fn=transform,
            inputs=_names(inputs, stage=name, what="inputs"),
            feedback=_names(feedback, stage=name, what="feedback inputs"),
            output=output or name, output_mode=output_mode, state_store=state_store,
            trigger_interval=trigger_interval, spark_conf=dict(spark_conf or {}), chain=chain,
        )
        stream = self._add(spec)
        assert stream is not None
        return stream

    def sink(self, name: str, inputs: Sequence[Stream | str], *, foreach_batch: ForeachBatchFn | None = None,
             format: str | None = None, options: Mapping[str, str] | None = None,
             postgres: PostgresTarget | None = None, kafka: KafkaTarget | None = None,
             table: DeltaTarget | None = None, transform: TransformFn | None = None,
             output_mode: Literal["append", "update", "complete"] = "append",
             state_store: Literal["hdfs", "rocksdb"] | None = None, trigger_interval: float | None = None,
             spark_conf: Mapping[str, str] | None = None, chain: bool = True) -> None:
        """A stage that writes to a Spark sink instead of a channel.

        Give one of ``foreach_batch(df, batch_id)``, a batch writer ``format`` (+ ``options``), a
        ``postgres=PostgresTarget(table=..., dsn_env=..., mode="append"|"upsert", key=(...))`` or a
        ``kafka=KafkaTarget(topic=..., bootstrap_servers=...)`` or a ``table=DeltaTarget(path=...)``.
        ``transform`` (default: the single input as is) shapes what is written.

        A file format (``parquet``, ``orc``, ``json``, ``csv``, ``text``; ``options={"path": ...}``) is
        **exactly-once**: batches are committed into the folder when an epoch covering them completes,
        and a restore rolls the folder back to the restored epoch
        (:mod:`~airflow_arroyo.runtime.file_sink`). So is a PostgreSQL table: rows are staged per
        micro-batch from the executors and committed in one transaction per epoch; a restore rolls the
        table back (:mod:`~airflow_arroyo.runtime.pg_sink`). So is a Kafka topic: each epoch's output is
        produced in one Kafka transaction when the epoch completes, which a ``read_committed`` consumer sees
        whole or not at all (:mod:`~airflow_arroyo.runtime.kafka_sink`). So is a Delta Lake table: the executors
        write each micro-batch's Parquet files, and each epoch is one Delta commit carrying the pipeline's
        application transaction; a restore restores the table's version (:mod:`~airflow_arroyo.runtime.delta_sink`).
        ``foreach_batch`` and other formats are
        at-least-once across a restore: a re-run batch id may carry other rows (see docs/runtime.md).
        ``chain=False`` keeps a channel before the sink when the pipeline chains.
        """
        spec = StageSpec(
            name=name, kind=StageKind.SINK, fn=transform, inputs=_names(inputs, stage=name, what="inputs"),
            output=None, output_mode=output_mode, state_store=state_store, trigger_interval=trigger_interval,
            foreach_batch=foreach_batch, sink_format=format, sink_options=dict(options or {}), postgres=postgres,
            kafka=kafka, table=table, spark_conf=dict(spark_conf or {}), chain=chain,
        )
        self._add(spec)

    # ------------------------------------------------------------------ validation

    def validate(self) -> PipelineGraph:
        """Check the graph; return it in a form the driver runs. Raises :class:`PipelineGraphError`."""
        return PipelineGraph.build(self.pipeline_id, self._stages)

    def physical_plan(self, spark: SparkSession | None = None) -> PhysicalPlan:
        """Which stages run fused in one query and which channels remain (:mod:`~airflow_arroyo.runtime.plan`).

        With ``spark``, each stage's statefulness comes from Spark's analyzed plan: the plan the driver runs.
        Without it no stage is known to be stateless, so only the rules that need no Spark apply and no two
        stages fuse (say so by passing a session).
        """
        from airflow_arroyo.runtime.plan import plan_chains, stateful_stages

        graph = self.validate()
        facts = stateful_stages(graph, spark) if spark is not None and self.chains else None
        return plan_chains(graph, facts, chaining=self.chains)

    @property
    def chains(self) -> bool:
        """Whether the graph's rules may fuse stages (``chaining`` is not ``False``)."""
        return self.chaining is not False

    def explain(self, spark: SparkSession | None = None) -> str:
        """The physical plan as text: each query and its stages, each remaining channel and why."""
        return self.physical_plan(spark).explain()

    def describe(self, spark: SparkSession | None = None) -> dict[str, Any]:
        """The physical plan as JSON-ready data (what :meth:`explain` prints)."""
        return self.physical_plan(spark).as_dict()


@dataclass(frozen=True)
class PipelineGraph:
    """A validated pipeline: stages in topological order (feedback edges excluded), channel writers."""

    pipeline_id: str
    stages: tuple[StageSpec, ...]  # topological order over non-feedback edges
    writers: Mapping[str, str]  # channel -> the stage writing it

    @property
    def stage_names(self) -> list[str]:
        """Stage names in topological order."""
        return [s.name for s in self.stages]

    @property
    def channels(self) -> list[str]:
        """Every channel, in the order of the stages that write them."""
        return [s.output for s in self.stages if s.output is not None]

    def stage(self, name: str) -> StageSpec:
        """The stage called ``name`` (``KeyError`` if none)."""
        for s in self.stages:
            if s.name == name:
                return s
        raise KeyError(name)

    def readers(self, channel: str) -> list[str]:
        """The stages that read ``channel``."""
        return [s.name for s in self.stages if channel in s.all_inputs]

    @classmethod
    def build(cls, pipeline_id: str, specs: Sequence[StageSpec]) -> PipelineGraph:
        """Validate ``specs`` and order them; :class:`PipelineGraphError` names the stage and the fix."""
        if not specs:
            raise PipelineGraphError(
                f"pipeline {pipeline_id!r} has no stages; add at least one with Pipeline.source(...)"
            )
        _check_names(pipeline_id, specs)
        writers = _writers(specs)
        _check_sink_targets(specs)
        _check_inputs(specs, writers)
        order = _topological_order(pipeline_id, specs, writers)
        _check_feedback(specs, writers)
        return cls(pipeline_id=pipeline_id, stages=tuple(order), writers=dict(writers))


def _check_spec(s: StageSpec) -> None:
    if not isinstance(s.name, str) or not _NAME.match(s.name):
        raise PipelineGraphError(
            f"stage name {s.name!r} cannot name a folder: use 1-100 letters, digits, '_', '.' or '-' "
            "(not starting with '.' or '-')"
        )
    if s.output is not None and (not isinstance(s.output, str) or not _NAME.match(s.output)):
        raise PipelineGraphError(
            f"stage {s.name!r}: output channel name {s.output!r} cannot name a folder: use letters, digits, "
            "'_', '.' or '-'"
        )
    if s.kind is StageKind.SOURCE:
        if not callable(s.fn):
            raise PipelineGraphError(
                f"source {s.name!r} needs read=<function(spark) returning a streaming DataFrame>, got {s.fn!r}"
            )
    else:
        if not s.inputs:
            what = "sink" if s.kind is StageKind.SINK else "stage"
            fix = (
                "pass inputs=[...] (it may not read only feedback channels)"
                if s.feedback
                else "pass inputs=[<stream or channel name>, ...], or use Pipeline.source(...) for a stage that "
                "reads a Spark source"
            )
            raise PipelineGraphError(f"{what} {s.name!r} has no input; {fix}")
        if s.kind is StageKind.STAGE and not callable(s.fn):
            raise PipelineGraphError(
                f"stage {s.name!r} needs transform=<function(*input DataFrames) returning a DataFrame>, got {s.fn!r}"
            )
        if s.kind is StageKind.SINK:
            _check_sink(s)
    if s.feedback and s.kind is not StageKind.STAGE:
        raise PipelineGraphError(
            f"{s.kind.value} {s.name!r} has feedback inputs; only a Pipeline.stage(...) can be an iteration head"
        )
    if s.output_mode not in OUTPUT_MODES:
        raise PipelineGraphError(
            f"stage {s.name!r}: output_mode {s.output_mode!r} is not one of {', '.join(OUTPUT_MODES)}"
        )
    if s.state_store is not None and s.state_store not in STATE_STORES:
        raise PipelineGraphError(
            f"stage {s.name!r}: state_store {s.state_store!r} is not one of {', '.join(STATE_STORES)} "
            "(or None for the session's default)"
        )
    if s.trigger_interval is not None and (
        not isinstance(s.trigger_interval, int | float) or isinstance(s.trigger_interval, bool)
        or s.trigger_interval < 0
    ):
        raise PipelineGraphError(
            f"stage {s.name!r}: trigger_interval must be a number of seconds >= 0, got {s.trigger_interval!r}"
        )


def _check_sink(s: StageSpec) -> None:
    """A sink has exactly one usable target, and one input unless a transform combines them."""
    if s.fn is not None and not callable(s.fn):
        raise PipelineGraphError(f"sink {s.name!r}: transform must be callable, got {s.fn!r}")
    if [s.foreach_batch, s.sink_format, s.postgres, s.kafka, s.table].count(None) != 4:
        raise PipelineGraphError(
            f"sink {s.name!r} needs exactly one of foreach_batch=<function(df, batch_id)>, "
            "format='<batch writer format>' (with options={'path': ...}), postgres=PostgresTarget(...), "
            "kafka=KafkaTarget(...) or table=DeltaTarget(path=...)"
        )
    targets: tuple[tuple[str, PostgresTarget | KafkaTarget | None, type, str], ...] = (
        ("postgres", s.postgres, PostgresTarget, "PostgresTarget(table=..., ...)"),
        ("kafka", s.kafka, KafkaTarget, "KafkaTarget(topic=..., bootstrap_servers=...)"))
    for arg, target, kind, example in targets:
        if target is None:
            continue
        if not isinstance(target, kind):
            raise PipelineGraphError(f"sink {s.name!r}: {arg}= takes a {example}, got {target!r}")
        problem = target.problem()
        if problem:
            raise PipelineGraphError(f"sink {s.name!r}: {problem}")
    if s.table is not None:
        if not isinstance(s.table, DeltaTarget):
            raise PipelineGraphError(f"sink {s.name!r}: table= takes a DeltaTarget(path=...), got {s.table!r}")
        problem = s.table.problem()
        if problem:
            raise PipelineGraphError(f"sink {s.name!r}: {problem}")
    if s.sink_format in FILE_SINK_FORMATS and not s.sink_options.get("path"):
        raise PipelineGraphError(
            f"sink {s.name!r}: format {s.sink_format!r} writes files: "
            "give options={'path': '<folder or URI>'}"
        )
    if s.foreach_batch is not None and not callable(s.foreach_batch):
        raise PipelineGraphError(f"sink {s.name!r}: foreach_batch must be callable, got {s.foreach_batch!r}")
    if s.fn is None and len(s.all_inputs) != 1:
        raise PipelineGraphError(
            f"sink {s.name!r} reads {len(s.all_inputs)} channels; give transform=<function(*inputs)> "
            "that combines them into one DataFrame"
        )


def _check_names(pipeline_id: str, specs: Sequence[StageSpec]) -> None:
    """Each stage is well formed and has a name of its own."""
    names: dict[str, StageSpec] = {}
    for s in specs:
        _check_spec(s)
        if s.name in names:
            raise PipelineGraphError(
                f"stage {s.name!r} is defined twice in pipeline {pipeline_id!r}; give each stage a unique name"
            )
        names[s.name] = s


def _writers(specs: Sequence[StageSpec]) -> dict[str, str]:
    """Channel -> the one stage that writes it."""
    writers: dict[str, str] = {}
    for s in specs:
        if s.output is None:
            continue
        other = writers.get(s.output)
        if other is not None:
            raise PipelineGraphError(
                f"two writers on channel {s.output!r}: stages {other!r} and {s.name!r}; a channel has exactly "
                f"one writer: give stage {s.name!r} its own output (output='{s.name}')"
            )
        writers[s.output] = s.name
    return writers


def _check_sink_targets(specs: Sequence[StageSpec]) -> None:
    """A sink folder or table has one exactly-once writer."""
    paths: dict[str, str] = {}
    for s in specs:
        if s.sink_format in FILE_SINK_FORMATS:
            path = s.sink_options["path"].rstrip("/")
            if path in paths:
                raise PipelineGraphError(
                    f"sinks {paths[path]!r} and {s.name!r} both write {path!r}; a sink folder has one writer: "
                    "give each sink its own path"
                )
            paths[path] = s.name
        elif s.table is not None and isinstance(s.table, DeltaTarget):
            path = s.table.path.rstrip("/")
            if path in paths:
                raise PipelineGraphError(
                    f"sinks {paths[path]!r} and {s.name!r} both write {path!r}; a Delta table has one exactly-once "
                    "writer: give each sink its own path"
                )
            paths[path] = s.name
        elif s.postgres is not None and isinstance(s.postgres, PostgresTarget):
            where = f"{s.postgres.dsn or s.postgres.dsn_env or s.postgres.conn_id}#{s.postgres.table}"
            if where in paths:
                raise PipelineGraphError(
                    f"sinks {paths[where]!r} and {s.name!r} both write table {s.postgres.table!r}; a table has one "
                    "exactly-once writer: give each sink its own table"
                )
            paths[where] = s.name


def _check_inputs(specs: Sequence[StageSpec], writers: dict[str, str]) -> None:
    """Every input is a channel some stage writes, read once, and not the stage's own output."""
    sinks = {s.name for s in specs if s.kind is StageKind.SINK}
    for s in specs:
        for channel in s.all_inputs:
            if channel in writers:
                continue
            if channel in sinks:
                raise PipelineGraphError(
                    f"stage {s.name!r} reads {channel!r}, which is a sink: sinks write to Spark sinks, not "
                    f"channels; make {channel!r} a Pipeline.stage(...) to read its output"
                )
            hint = difflib.get_close_matches(channel, list(writers), n=1)
            did_you_mean = f" (did you mean {hint[0]!r}?)" if hint else ""
            raise PipelineGraphError(
                f"stage {s.name!r} reads channel {channel!r}, which no stage writes{did_you_mean}; "
                f"channels are named after the stage that writes them: known channels are "
                f"{', '.join(sorted(writers)) or 'none'}"
            )
        if len(set(s.all_inputs)) != len(s.all_inputs):
            dup = sorted({c for c in s.all_inputs if s.all_inputs.count(c) > 1})
            raise PipelineGraphError(
                f"stage {s.name!r} lists channel(s) {', '.join(dup)} twice in its inputs/feedback; read a channel "
                "once and reuse the DataFrame inside the transform"
            )
        if s.output is not None and s.output in s.all_inputs:
            raise PipelineGraphError(
                f"stage {s.name!r} reads its own output channel {s.output!r}; a loop needs at least one stage "
                "between the iteration head and its feedback"
            )


def _topological_order(pipeline_id: str, specs: Sequence[StageSpec], writers: Mapping[str, str]) -> list[StageSpec]:
    """Kahn's algorithm over the aligned (non-feedback) edges; a leftover cycle has no iteration head."""
    by_name = {s.name: s for s in specs}
    deps = {s.name: [writers[c] for c in s.inputs] for s in specs}
    indegree = {n: len(d) for n, d in deps.items()}
    downstream: dict[str, list[str]] = {n: [] for n in by_name}
    for n, d in deps.items():
        for up in d:
            downstream[up].append(n)
    ready = [s.name for s in specs if indegree[s.name] == 0]
    order: list[str] = []
    while ready:
        n = ready.pop(0)
        order.append(n)
        for down in downstream[n]:
            indegree[down] -= 1
            if indegree[down] == 0:
                ready.append(down)
    if len(order) < len(specs):
        cycle = _find_cycle({n: d for n, d in deps.items() if n not in order})
        first = min(cycle, key=[s.name for s in specs].index)  # start the loop where the user declared it
        cycle = cycle[cycle.index(first):] + cycle[: cycle.index(first)]
        loop = " -> ".join([*cycle, cycle[0]])
        head, back = cycle[0], cycle[-1]
        raise PipelineGraphError(
            f"pipeline {pipeline_id!r} has a loop without an iteration head: {loop}; "
            f"make one stage the iteration head by moving the loop's closing channel to feedback, e.g. "
            f"stage {head!r} with feedback=[{_channel_of(by_name[back])!r}] instead of inputs"
        )
    return [by_name[n] for n in order]


def _channel_of(spec: StageSpec) -> str:
    return spec.output or spec.name


def _find_cycle(deps: Mapping[str, Sequence[str]]) -> list[str]:
    """One cycle among ``deps`` (stage -> upstream stages), in data-flow order."""
    start = sorted(deps)[0]
    path: list[str] = []
    seen: dict[str, int] = {}
    node = start
    while node not in seen:
        seen[node] = len(path)
        path.append(node)
        node = next(u for u in deps[node] if u in deps)
    cycle_upstream_order = path[seen[node]:]
    # path follows upstream edges; data flows the other way
    return list(reversed(cycle_upstream_order))


def _check_feedback(specs: Sequence[StageSpec], writers: Mapping[str, str]) -> None:
    """A feedback channel must be written downstream of its head (it must close a loop)."""
    downstream: dict[str, set[str]] = {s.name: set() for s in specs}
    for s in specs:
        for c in s.inputs:
            downstream[writers[c]].add(s.name)

    def reachable(start: str) -> set[str]:
        seen: set[str] = set()
        stack = [start]
        while stack:
            n = stack.pop()
            for d in downstream[n]:
                if d not in seen:
                    seen.add(d)
                    stack.append(d)
        return seen

    for s in specs:
        if not s.feedback:
            continue
        below = reachable(s.name)
        for c in s.feedback:
            if writers[c] not in below:
                raise PipelineGraphError(
                    f"stage {s.name!r} lists channel {c!r} as feedback, but its writer {writers[c]!r} is not "
                    f"downstream of {s.name!r}, so it closes no loop; list {c!r} in inputs instead"
                )
