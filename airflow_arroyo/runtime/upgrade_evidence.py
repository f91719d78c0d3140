"""The state schema evidence of an upgrade plan, gathered one way for every caller that has Spark: the driver, before
its restore writes anything, and ``airflow-arroyo upgrade-plan --check-state-schema``, a dry run
(docs/upgrading.md, "State schema compatibility").

For each query the plan restores whole from one of the epoch's snapshots (a stage that runs as its own query, or a
fused query, from its own snapshot or the one a rename maps to it) with at most one input channel: the stateful
operators Spark recorded in the epoch's snapshot of it (its ``state/`` objects, read where the snapshot store keeps
them; nothing is rebuilt) and those the new code's query would write (its DataFrame composed for Spark's analyzer,
planned, not run: :mod:`airflow_arroyo.runtime.state_schema`). The pure planner (``runtime/decisions.py``
``plan_upgrade``) decides with them. Reads only.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from airflow_arroyo.core.fs import FileSystem
from airflow_arroyo.runtime.layout import object_path
from airflow_arroyo.runtime.state_schema import OperatorState, own_operator_states, parse_operator_states

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

    from airflow_arroyo.runtime.decisions import UpgradePlan
    from airflow_arroyo.runtime.pipeline import PipelineGraph
    from airflow_arroyo.runtime.plan import PhysicalPlan
    from airflow_arroyo.store import EpochStore

__all__ = ["SparkAnalysis", "StateSchemas", "gather_state_schemas", "planning_session", "snapshot_state_files",
           "spark_analysis"]

#: new stage -> (the stateful operators its snapshot holds, those the new code's query would write)
StateSchemas = tuple[tuple[str, tuple[tuple[OperatorState, ...], tuple[OperatorState, ...]]], ...]


def snapshot_state_files(store: EpochStore, storage: FileSystem, pipeline_id: str, epoch: int,
                         stage: str) -> dict[str, Callable[[], bytes]]:
    """The ``state/`` files of ``stage``'s snapshot in ``epoch``: path inside the checkpoint -> a reader of its
    object below ``storage`` (the pipeline's storage root), read only when called."""
    return {e.rel_path: functools.partial(storage.read_bytes, object_path(pipeline_id, e.object_key))
            for e in store.snapshot_entries(pipeline_id, epoch, stage) if e.rel_path.startswith("state/")}


def gather_state_schemas(upgrade: UpgradePlan, graph: PipelineGraph, frames: Mapping[str, Any],
                         stateful: Mapping[str, bool | None],
                         state_files: Callable[[str], Mapping[str, Callable[[], bytes]]], *,
                         physical: PhysicalPlan | None = None) -> StateSchemas:
    """The evidence for each stage of ``upgrade`` restored from a snapshot of the same query form.

    ``graph`` is the new code's logical graph, ``frames`` its stages composed
    (:func:`~airflow_arroyo.runtime.plan.compose_stages`), ``stateful`` what
    :func:`~airflow_arroyo.runtime.plan.stateful_stages` found, ``state_files`` the epoch's stage -> its snapshot's
    ``state/`` files (:func:`snapshot_state_files`), ``physical`` the plan the new code runs
    (:func:`~airflow_arroyo.runtime.plan.decide_fusion`; None: every stage its own query). A fused query restored
    from the epoch's query of the same name (or of the name a rename maps to it) is checked as one query: Spark
    numbers its operators over the whole query, which is its last member's DataFrame above the channels it reads.
    Not checked (left out): a stage split or merged across fusion, a query known stateless, one with several input
    channels or one whose operators are not derived (joins, arbitrary state)."""
    logical = {s.name: s for s in graph.stages}
    groups = {g.name: g.stages for g in (physical.groups if physical is not None else ()) if len(g.stages) > 1}
    across = upgrade.across_fusion()
    out = []
    for stage, snap in upgrade.snapshot_of().items():
        # restored whole (its own snapshot, or the one a rename maps to it): Spark loads that state into this query
        members = groups.get(stage, (stage,) if stage in logical else ())
        if not members or stage in across or all(stateful.get(m) is False for m in members):
            continue
        channels = [c for m in members for c in logical[m].all_inputs if graph.writers.get(c, c) not in members]
        frame = frames.get(members[-1])
        inputs = [frames.get(graph.writers.get(c, c)) for c in dict.fromkeys(channels)]
        if frame is None or len(inputs) > 1 or any(f is None for f in inputs):
            continue
        new = own_operator_states(frame, inputs)
        if new is None:
            continue
        out.append((stage, (parse_operator_states(state_files(snap)), new)))
    return tuple(out)


@contextlib.contextmanager
def planning_session() -> Iterator[SparkSession]:
    """A Spark session to plan DataFrames in, for a command line: the active one, else a local one (one core, no
    UI, errors only, the provider's local settings) stopped on exit. Nothing runs in it."""
    import os
    import sys

    from pyspark.sql import SparkSession

    active = SparkSession.getActiveSession()
    if active is not None:
        yield active
        return
    from airflow_arroyo.jvm import local_master_conf

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)  # a user's own setting stands
    builder = SparkSession.builder.master("local[1]").appName("airflow-arroyo-upgrade-plan")
    # the provider's settings for a local master (its jar: the formats and file system a driver has)
    for key, value in {**local_master_conf(), "spark.ui.enabled": "false", "spark.sql.shuffle.partitions": "1",
                       "spark.ui.showConsoleProgress": "false"}.items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    try:
        yield spark
    finally:
        spark.stop()


class SparkAnalysis:
    """What Spark's analyzer says of new code, for a dry run that plans its upgrade as the driver will: its stages
    composed in ``spark`` (no query started; the sources' read functions are called), which hold state
    (:func:`~airflow_arroyo.runtime.plan.stateful_stages`), and the state schema evidence of a plan of its physical
    graph (:meth:`state_schemas`). ``graph`` is the new code's logical graph."""

    def __init__(self, store: EpochStore, pipeline_id: str, graph: PipelineGraph, spark: SparkSession) -> None:
        from airflow_arroyo.runtime.plan import compose_stages, stateful_stages

        self.store = store
        self.pipeline_id = pipeline_id
        self.graph = graph
        self.frames = compose_stages(graph, spark)
        self.stateful: Mapping[str, bool | None] = stateful_stages(graph, spark, self.frames)

    def state_schemas(self, upgrade: UpgradePlan, physical: PhysicalPlan) -> StateSchemas:
        """:func:`gather_state_schemas` for ``upgrade`` (a plan of ``physical``'s graph) restoring ``upgrade.epoch``:
        the snapshots read below the pipeline's registered storage. A fork that has not restored its fork point
        yet is not checked (its snapshots are its source's), as in the driver."""
        record = self.store.get_pipeline(self.pipeline_id)
        source, point = record.forked_from_pipeline, record.forked_from_epoch
        if not record.storage_uri or (source is not None and point is not None
                                      and self.pipeline_id in self.store.waiting_forks(source, point)):
            return ()
        if not any(upgrade.snapshot_of().values()):
            return ()
        storage = FileSystem.from_uri(record.storage_uri)
        return gather_state_schemas(upgrade, self.graph, self.frames, self.stateful, lambda snap: snapshot_state_files(
            self.store, storage, self.pipeline_id, upgrade.epoch, snap), physical=physical)


@contextlib.contextmanager
def spark_analysis(store: EpochStore, pipeline_id: str, graph: PipelineGraph) -> Iterator[SparkAnalysis]:
    """:class:`SparkAnalysis` of ``graph`` in a :func:`planning_session` (``--check-state-schema``)."""
    with planning_session() as spark:
        yield SparkAnalysis(store, pipeline_id, graph, spark)
