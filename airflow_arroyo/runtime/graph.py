"""A pipeline's graph as the driver runs it: stage specs, the channels joining them, and the checks
:meth:`~airflow_arroyo.runtime.pipeline.Pipeline.validate` runs before Spark starts (raising
:class:`~airflow_arroyo.core.exceptions.PipelineGraphError` naming the stage and the fix).

Built by :class:`~airflow_arroyo.runtime.pipeline.Pipeline`; read by the physical plan
(:mod:`~airflow_arroyo.runtime.plan`), the driver and the stages. Imports neither of the first two.
"""

from __future__ import annotations

import difflib
import enum
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from airflow_arroyo.core.exceptions import ConfigurationError, PipelineGraphError
from airflow_arroyo.core.gates import Gate
from airflow_arroyo.runtime.sinks.delta import DeltaTarget
from airflow_arroyo.runtime.sinks.files import FILE_SINK_FORMATS
from airflow_arroyo.runtime.sinks.kafka import KafkaTarget
from airflow_arroyo.runtime.sinks.postgres import PostgresTarget

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession


__all__ = ["OUTPUT_MODES", "STATE_STORES", "PipelineGraph", "StageKind", "StageSpec", "Stream"]


OUTPUT_MODES = ("append", "update", "complete")
STATE_STORES: dict[str, str] = {
    "hdfs": "org.apache.spark.sql.execution.streaming.state.HDFSBackedStateStoreProvider",
    "rocksdb": "org.apache.spark.sql.execution.streaming.state.RocksDBStateStoreProvider",
}
STAGE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,99}$")

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
    trigger_interval: float | None = None  # seconds between micro-batch starts (None: stage.trigger_interval's default)
    foreach_batch: ForeachBatchFn | None = None  # sinks
    sink_format: str | None = None  # sinks: a batch writer format, e.g. "parquet"
    sink_options: Mapping[str, str] = field(default_factory=dict)
    postgres: PostgresTarget | None = None  # sinks: an exactly-once PostgreSQL table
    kafka: KafkaTarget | None = None  # sinks: an exactly-once Kafka topic
    table: DeltaTarget | None = None  # sinks: an exactly-once Delta Lake table
    spark_conf: Mapping[str, str] = field(default_factory=dict)  # SQL confs set for this stage's query only
    chain: bool = True  # False: keep a channel before this stage even where it could fuse (runtime/plan.py)
    gate: Gate | None = None  # sinks: each epoch's output waits for a verdict before it commits (core/gates.py)
    uid: str | None = None  # the stage's identity across code versions (None: its name); see plan_upgrade

    @property
    def identity(self) -> str:
        """Who this stage is to a restore of an older epoch: its ``uid``, else its name."""
        return self.uid or self.name

    @property
    def is_iteration_head(self) -> bool:
        """True for a stage that reads feedback channels (the head of a loop)."""
        return bool(self.feedback)

    @property
    def all_inputs(self) -> tuple[str, ...]:
        """Aligned inputs first, then feedback inputs: the order of the transform's arguments."""
        return self.inputs + self.feedback


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
    if not isinstance(s.name, str) or not STAGE_NAME.match(s.name):
        raise PipelineGraphError(
            f"stage name {s.name!r} cannot name a folder: use 1-100 letters, digits, '_', '.' or '-' "
            "(not starting with '.' or '-')"
        )
    if s.uid is not None and (not isinstance(s.uid, str) or not STAGE_NAME.match(s.uid)):
        raise PipelineGraphError(
            f"stage {s.name!r}: uid {s.uid!r} must be 1-100 letters, digits, '_', '.' or '-' (not starting with "
            "'.' or '-'), and stay the same across versions of the code"
        )
    if s.output is not None and (not isinstance(s.output, str) or not STAGE_NAME.match(s.output)):
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
    if s.gate is not None:
        _check_gate(s)
    if s.fn is None and len(s.all_inputs) != 1:
        raise PipelineGraphError(
            f"sink {s.name!r} reads {len(s.all_inputs)} channels; give transform=<function(*inputs)> "
            "that combines them into one DataFrame"
        )


def sink_kind(s: StageSpec) -> str | None:
    """What an exactly-once sink writes (``files``, ``postgres``, ``kafka``, ``delta``); None for other stages."""
    if s.sink_format in FILE_SINK_FORMATS:
        return "files"
    for kind, target in (("postgres", s.postgres), ("kafka", s.kafka), ("delta", s.table)):
        if target is not None:
            return kind
    return None


def _check_gate(s: StageSpec) -> None:
    if not isinstance(s.gate, Gate):
        raise PipelineGraphError(f"sink {s.name!r}: gate= takes a Gate(policy=..., timeout=...), got {s.gate!r}")
    kind = sink_kind(s)
    try:
        s.gate.checked(s.name, kind or "foreach_batch or other at-least-once")
    except ConfigurationError as exc:
        raise PipelineGraphError(str(exc)) from None
    quarantine = (s.gate.quarantine_path or "").rstrip("/")
    if quarantine and kind == "files" and quarantine == s.sink_options["path"].rstrip("/"):
        raise PipelineGraphError(f"sink {s.name!r}: quarantine_path must differ from the sink's path (failed "
                                 "epochs would be committed where passed ones are)")


def _check_names(pipeline_id: str, specs: Sequence[StageSpec]) -> None:
    """Each stage is well formed and has a name and an identity of its own."""
    names: dict[str, StageSpec] = {}
    identities: dict[str, str] = {}
    for s in specs:
        _check_spec(s)
        if s.name in names:
            raise PipelineGraphError(
                f"stage {s.name!r} is defined twice in pipeline {pipeline_id!r}; give each stage a unique name"
            )
        names[s.name] = s
        other = identities.setdefault(s.identity, s.name)
        if other != s.name:
            raise PipelineGraphError(f"stages {other!r} and {s.name!r} of pipeline {pipeline_id!r} have the same "
                                     f"identity {s.identity!r} (a uid, or a name another stage has as uid); give "
                                     "each stage a uid of its own")


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
    writers: dict[str, str] = {}
    for s in specs:
        target = _sink_target(s)
        if target is None:
            continue
        key, what, kind = target
        if key in writers:
            raise PipelineGraphError(
                f"sinks {writers[key]!r} and {s.name!r} both write {what}; {kind} has one exactly-once writer: "
                f"give each sink its own {'table' if kind == 'a table' else 'path'}"
            )
        writers[key] = s.name


def _sink_target(s: StageSpec) -> tuple[str, str, str] | None:
    """(identity, how a message names it, what it is) of an exactly-once sink's target; None for other stages."""
    if s.sink_format in FILE_SINK_FORMATS:
        path = s.sink_options["path"].rstrip("/")
        return path, repr(path), "a sink folder"
    if s.table is not None and isinstance(s.table, DeltaTarget):
        path = s.table.path.rstrip("/")
        return path, repr(path), "a Delta table"
    if s.postgres is not None and isinstance(s.postgres, PostgresTarget):
        where = f"{s.postgres.dsn or s.postgres.dsn_env or s.postgres.conn_id}#{s.postgres.table}"
        return where, f"table {s.postgres.table!r}", "a table"
    return None


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


def stage_identities(stages: Iterable[StageSpec]) -> tuple[tuple[str, str], ...]:
    """(name, uid) of each stage whose identity is not its name: what a restore's plan needs to know of new code
    (:class:`~airflow_arroyo.runtime.decisions.RestoreFacts` ``identities``)."""
    return tuple((s.name, s.identity) for s in stages if s.identity != s.name)
