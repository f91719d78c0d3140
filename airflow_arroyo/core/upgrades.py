"""Upgrading a running pipeline to new code in one step, for every surface:
:class:`~airflow_arroyo.operators.upgrade.UpgradePipelineOperator` and ``airflow-arroyo upgrade`` go through
:func:`prepare_upgrade` and only choose how the new code starts. Airflow-free.

1. **plan** against the latest completed epoch, before anything is asked: new code that cannot take the pipeline's
   state is refused while the old code still runs (nothing changed);
2. **stop** the running code gracefully (a final epoch) and wait until it ended;
3. **pin** that final epoch (retention keeps it: it is the way back to the old code);
4. **plan** again against the pinned epoch: it is the one the new code restores.

Then the caller starts the new code with :meth:`UpgradeReady.driver_args` (``--restore-from`` the pinned epoch,
``--rename`` and ``--allow-dropped-state`` as planned). A failure at any step raises :class:`UpgradeError` naming
the step and what the old code can do from there: before the stop it still runs; after it the pipeline is stopped
and the old code restores the pinned epoch (or ``latest``) as before.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Protocol

from airflow_arroyo.core.exceptions import ArroyoError, ConfigurationError
from airflow_arroyo.core.restores import read_restore_facts
from airflow_arroyo.core.stopping import StopAsked, check_stop, request_stop, wait_until_ended
from airflow_arroyo.runtime.decisions import RestoreFrom, UpgradePlan, plan_stages
from airflow_arroyo.runtime.graph import StageKind, stage_identities
from airflow_arroyo.runtime.plan import decide_fusion

if TYPE_CHECKING:
    from airflow_arroyo.runtime.graph import PipelineGraph
    from airflow_arroyo.runtime.plan import PhysicalPlan
    from airflow_arroyo.runtime.upgrade_evidence import StateSchemas
    from airflow_arroyo.store import EpochStore

__all__ = ["Analysis", "UpgradeError", "UpgradeReady", "UpgradeRefused", "check_upgrade", "fusion_note",
           "prepare_upgrade"]


class Analysis(Protocol):
    """What Spark's analyzer says of the new code (:class:`airflow_arroyo.runtime.upgrade_evidence.SparkAnalysis`):
    which of its logical stages hold state, and the state schema evidence of a plan of its physical graph."""

    stateful: Mapping[str, bool | None]

    def state_schemas(self, upgrade: UpgradePlan, physical: PhysicalPlan) -> StateSchemas:
        """New stage -> (the stateful operators its snapshot holds, those the new code's query would write)."""
        ...


class UpgradeError(ArroyoError):
    """An upgrade stopped at ``step`` (``plan``, ``stop``, ``pin``, ``final plan``); the message says what state the
    pipeline is in and how the old code goes on."""

    def __init__(self, pipeline_id: str, step: str, detail: str, *, after: str) -> None:
        super().__init__(f"upgrade of pipeline {pipeline_id!r} stopped at step '{step}': {detail}. {after}")
        self.pipeline_id = pipeline_id
        self.step = step


class UpgradeRefused(UpgradeError, ConfigurationError):
    """The new code's plan is refused before anything was asked (bad input: exit status 2 in the CLI)."""


@dataclass(frozen=True)
class UpgradeReady:
    """The old code stopped with ``epoch`` pinned as ``label``; ``plan`` is what the new code's restore of it does."""

    pipeline_id: str
    epoch: int
    label: str
    plan: UpgradePlan
    allow_dropped_state: tuple[str, ...]
    renamed: tuple[tuple[str, str], ...]
    storage_uri: str | None
    checkpoint_uri: str | None

    def driver_args(self) -> list[str]:
        """The driver's restore arguments for the new code (after ``--pipeline``)."""
        args = ["--restore-from", str(self.epoch)]
        for old, new in self.renamed:
            args += ["--rename", f"{old}={new}"]
        for stage in self.allow_dropped_state:
            args += ["--allow-dropped-state", stage]
        return args


def check_upgrade(store: EpochStore, pipeline_id: str, graph: PipelineGraph, epoch: RestoreFrom = "latest", *,
                  allow_dropped_state: Sequence[str] = (), renamed: Mapping[str, str] | None = None,
                  chaining: bool | None = None,
                  analysis: Callable[[], AbstractContextManager[Analysis]] | None = None) -> UpgradePlan:
    """The plan of a restore of ``epoch`` into the code of ``graph`` (its logical stages, of a
    ``Pipeline(chaining=chaining)``); reads only.

    The plan is of the physical graph the driver will run (:func:`~airflow_arroyo.runtime.plan.decide_fusion`,
    the driver's own decision): with ``analysis`` (where the caller has Spark, ``upgrade-plan
    --check-state-schema``: :func:`airflow_arroyo.runtime.upgrade_evidence.spark_analysis`) from the stages Spark
    finds stateful, and each restored query's state schemas are compared; without it only where the fusion does not
    depend on which stages hold state (``chaining=False``, a restore of an epoch taken unfused, a graph with a
    boundary at every channel), else of the logical stages, which the plan says (``queries`` None, ``fusion``)."""
    facts = read_restore_facts(store, pipeline_id, epoch, stages=None).facts
    held = facts.epoch
    if held is None:
        raise ConfigurationError(f"pipeline {pipeline_id} has no epoch {epoch} to plan an upgrade from "
                                 f"(airflow-arroyo epochs {pipeline_id} lists them)")
    options = dataclasses.replace(
        facts, allow_dropped_state=tuple(allow_dropped_state), renamed=tuple((renamed or {}).items()),
        sources=tuple(s.name for s in graph.stages if s.kind is StageKind.SOURCE))

    def plan(physical: PipelineGraph, state_schemas: StateSchemas = ()) -> UpgradePlan:
        new_code = dataclasses.replace(options, stages=tuple(physical.stage_names),
                                       identities=stage_identities(physical.stages), state_schemas=tuple(state_schemas))
        return plan_stages(new_code, held)

    def queries(physical: PhysicalPlan) -> tuple[tuple[str, tuple[str, ...]], ...]:
        return tuple((g.name, g.stages) for g in physical.groups)

    def restoring() -> tuple[int, tuple[str, ...]]:
        return held.epoch, held.stages

    static = decide_fusion(graph, None, chaining=chaining, restoring=restoring)
    if static.plan is None and analysis is None:
        return dataclasses.replace(plan(graph), fusion=static.why)
    if static.plan is not None:  # the driver's plan without Spark: bad input is refused before a JVM starts
        known = dataclasses.replace(plan(static.plan.graph), queries=queries(static.plan), fusion=static.why)
        if analysis is None or not known.restores:
            return known
    assert analysis is not None  # both returns above cover its absence
    with analysis() as spark:
        fusion = decide_fusion(graph, spark.stateful, chaining=chaining, restoring=restoring)
        assert fusion.plan is not None  # decided with Spark's facts
        first = plan(fusion.plan.graph)
        evidence = spark.state_schemas(first, fusion.plan)
    upgrade = plan(fusion.plan.graph, evidence) if evidence else first
    return dataclasses.replace(upgrade, queries=queries(fusion.plan), fusion=fusion.why,
                               state_schema_checked=tuple(stage for stage, _ in evidence))


def fusion_note(plan: UpgradePlan, exact: str = "--check-state-schema") -> str:
    """One line under a plan's table: which queries it was planned against, the driver's or the logical stages
    (then naming ``exact``, what plans the driver's)."""
    if plan.queries is None:
        return (f"planned against the logical stages, not the queries the driver will run: {plan.fusion}; "
                f"{exact} plans the driver's physical graph")
    fused = [f"{q} ({', '.join(m)})" for q, m in plan.queries if len(m) > 1]
    return (f"planned against the queries the driver will run ({plan.fusion}): "
            f"{', '.join(fused) + ' fused' if fused else 'no stage fused'}")


def _refusal(plan: UpgradePlan) -> str:
    return "; ".join(f"stage {r.stage!r} {r.action.value}: {r.reason}" for r in plan.refused)


def prepare_upgrade(store: EpochStore, pipeline_id: str, graph: PipelineGraph, *,
                    allow_dropped_state: Sequence[str] = (), renamed: Mapping[str, str] | None = None,
                    label: str | None = None, stop_timeout: float = 600.0, poll: float = 0.5,
                    chaining: bool | None = None,
                    analysis: Callable[[], AbstractContextManager[Analysis]] | None = None) -> UpgradeReady:
    """Steps 1-4 of the module docstring; returns what the new code restores. Each plan step is
    :func:`check_upgrade` (``chaining``: the new code's ``Pipeline(chaining=...)``). ``analysis``: where the
    caller has Spark (``upgrade --check-state-schema``), both plan steps plan the physical graph the driver will
    run and refuse a stage whose state changed shape, the first one while the old code still runs."""
    label = label or f"upgrade {datetime.now(UTC):%Y-%m-%dT%H:%M:%SZ}"
    check_stop("graceful", label)

    def plan(epoch: RestoreFrom, step: str, after: str) -> UpgradePlan:
        try:
            return check_upgrade(store, pipeline_id, graph, epoch, allow_dropped_state=allow_dropped_state,
                                 renamed=renamed, chaining=chaining, analysis=analysis)
        except ConfigurationError:
            raise
        except Exception as exc:  # Spark could not plan the new code, or a snapshot object is unreadable
            raise UpgradeError(pipeline_id, step, f"the state schema check could not run: {type(exc).__name__}: "
                               f"{exc}", after=after) from exc

    before = plan("latest", "plan", "Nothing was changed: the old code still runs")
    if not before.restores:
        raise UpgradeRefused(pipeline_id, "plan", f"the new code cannot restore epoch {before.epoch}: "
                           f"{_refusal(before)}", after="Nothing was changed: the old code still runs")
    asked = request_stop(store, pipeline_id, "graceful")
    if asked.asked is StopAsked.RESTART_CANCELLED or asked.mode != "graceful":
        raise UpgradeError(pipeline_id, "stop", f"the run could not take a final epoch ({asked.asked}, "
                           f"{asked.mode} stop)", after="Restore 'latest' with the old or the new code by hand")
    end = wait_until_ended(store, asked.pipeline, stop_timeout, poll)
    if not end.ended:
        raise UpgradeError(pipeline_id, "stop", f"run {asked.pipeline.run_id} did not stop within {stop_timeout:g}s",
                           after="It was asked to stop gracefully and may still do so; nothing else was changed")
    try:
        if asked.asked is StopAsked.ENDED:  # stopped already: its latest completed epoch is the one to go on from
            pinned = store.pin_epoch(pipeline_id, before.epoch, label)
        else:
            pinned = store.pin_final_epoch(pipeline_id, asked.pipeline.run_id, label)
    except ConfigurationError as exc:
        raise UpgradeError(pipeline_id, "pin", str(exc), after="The pipeline is stopped; the old code restores "
                           "'latest' as before") from exc
    after = plan(pinned.epoch, "final plan", f"The pipeline is stopped with epoch {pinned.epoch} pinned ({label!r}); "
                 f"the old code restores it (restore_from={pinned.epoch})")
    if not after.restores:
        raise UpgradeError(pipeline_id, "final plan", f"the new code cannot restore the final epoch {pinned.epoch}: "
                           f"{_refusal(after)}", after=f"The pipeline is stopped with epoch {pinned.epoch} pinned "
                           f"({label!r}); the old code restores it (restore_from={pinned.epoch})")
    record = store.get_pipeline(pipeline_id)
    return UpgradeReady(pipeline_id, pinned.epoch, label, after, tuple(allow_dropped_state),
                        tuple((renamed or {}).items()), record.storage_uri,
                        (record.config or {}).get("checkpoint_uri"))
