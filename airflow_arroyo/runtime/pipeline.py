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
:class:`~airflow_arroyo.core.exceptions.PipelineGraphError` naming the stage and the fix for: an unknown
channel, a stage without input, a loop without an iteration head, two writers on one channel, a
duplicate or unusable stage name, a feedback edge that closes no loop.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

from airflow_arroyo.core.epochs import validate_pipeline_id
from airflow_arroyo.core.exceptions import ConfigurationError, PipelineGraphError
from airflow_arroyo.core.gates import Gate
from airflow_arroyo.runtime.graph import (
    OUTPUT_MODES,
    STATE_STORES,
    ForeachBatchFn,
    PipelineGraph,
    ReadFn,
    StageKind,
    StageSpec,
    Stream,
    TransformFn,
)
from airflow_arroyo.runtime.plan import PhysicalPlan, plan_chains, stateful_stages
from airflow_arroyo.runtime.sinks.delta import DeltaTarget
from airflow_arroyo.runtime.sinks.kafka import KafkaTarget
from airflow_arroyo.runtime.sinks.postgres import PostgresTarget

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

__all__ = [
    "OUTPUT_MODES",
    "STATE_STORES",
    "Pipeline",
    "PipelineGraph",
    "StageKind",
    "StageSpec",
    "Stream",
]


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
               trigger_interval: float | None = None, spark_conf: Mapping[str, str] | None = None,
               uid: str | None = None) -> Stream:
        """A stage that reads a Spark streaming source: ``read(spark)`` returns a streaming DataFrame.

        Any Spark streaming source works (files, rate, a Python data source, the replayable
        :func:`~airflow_arroyo.testing.generator_source`); the source must be replayable
        from the offsets in its checkpoint for a restore to be exactly-once (the generator, files and
        Kafka are; ``rate`` with wall-clock timestamps is not byte-identical).

        ``uid`` (every builder takes it): the stage's identity across code versions, Flink's operator uid. A
        restore of an older epoch gives a stage the state of the epoch's stage with the same identity, whatever
        its name is now (docs/upgrading.md); without one the identity is the name.
        """
        spec = StageSpec(name=name, kind=StageKind.SOURCE, fn=read, output=output or name,
                         trigger_interval=trigger_interval, spark_conf=dict(spark_conf or {}), uid=uid)
        stream = self._add(spec)
        assert stream is not None
        return stream

    def stage(self, name: str, transform: TransformFn, inputs: Sequence[Stream | str], *,
              feedback: Sequence[Stream | str] = (), output: str | None = None,
              output_mode: Literal["append", "update", "complete"] = "append",
              state_store: Literal["hdfs", "rocksdb"] | None = None, trigger_interval: float | None = None,
              spark_conf: Mapping[str, str] | None = None, chain: bool = True, uid: str | None = None) -> Stream:
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
            trigger_interval=trigger_interval, spark_conf=dict(spark_conf or {}), chain=chain, uid=uid,
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
             spark_conf: Mapping[str, str] | None = None, chain: bool = True, gate: Gate | None = None,
             uid: str | None = None) -> None:
        """A stage that writes to a Spark sink instead of a channel.

        Give one of ``foreach_batch(df, batch_id)``, a batch writer ``format`` (+ ``options``), a
        ``postgres=PostgresTarget(table=..., dsn_env=..., mode="append"|"upsert", key=(...))`` or a
        ``kafka=KafkaTarget(topic=..., bootstrap_servers=...)`` or a ``table=DeltaTarget(path=...)``.
        ``transform`` (default: the single input as is) shapes what is written.

        A file format (``parquet``, ``orc``, ``json``, ``csv``, ``text``; ``options={"path": ...}``) is
        **exactly-once**: batches are committed into the folder when an epoch covering them completes,
        and a restore rolls the folder back to the restored epoch
        (:mod:`~airflow_arroyo.runtime.sinks.files`). So is a PostgreSQL table: rows are staged per
        micro-batch from the executors and committed in one transaction per epoch; a restore rolls the
        table back (:mod:`~airflow_arroyo.runtime.sinks.postgres`). So is a Kafka topic: each epoch's output is
        produced in one Kafka transaction when the epoch completes, which a ``read_committed`` consumer sees
        whole or not at all (:mod:`~airflow_arroyo.runtime.sinks.kafka`). So is a Delta Lake table: the executors
        write each micro-batch's Parquet files, and each epoch is one Delta commit carrying the pipeline's
        application transaction; a restore restores the table's version (:mod:`~airflow_arroyo.runtime.sinks.delta`).
        ``foreach_batch`` and other formats are
        at-least-once across a restore: a re-run batch id may carry other rows (see docs/runtime.md).
        ``chain=False`` keeps a channel before the sink when the pipeline chains. ``gate=Gate(...)`` (a file or
        PostgreSQL sink) holds each epoch's output until a verdict passes it (:mod:`airflow_arroyo.core.gates`).
        """
        spec = StageSpec(
            name=name, kind=StageKind.SINK, fn=transform, inputs=_names(inputs, stage=name, what="inputs"),
            output=None, output_mode=output_mode, state_store=state_store, trigger_interval=trigger_interval,
            foreach_batch=foreach_batch, sink_format=format, sink_options=dict(options or {}), postgres=postgres,
            kafka=kafka, table=table, spark_conf=dict(spark_conf or {}), chain=chain, gate=gate, uid=uid,
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
