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
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING

from airflow_arroyo.core.exceptions import ArroyoError, ConfigurationError
from airflow_arroyo.core.restores import read_restore_facts
from airflow_arroyo.core.stopping import StopAsked, check_stop, request_stop, wait_until_ended
from airflow_arroyo.runtime.decisions import RestoreFrom, UpgradePlan, plan_stages
from airflow_arroyo.runtime.graph import stage_identities

if TYPE_CHECKING:
    from airflow_arroyo.runtime.graph import PipelineGraph
    from airflow_arroyo.runtime.upgrade_evidence import StateSchemas
    from airflow_arroyo.store import EpochStore

__all__ = ["UpgradeError", "UpgradeReady", "UpgradeRefused", "check_upgrade", "prepare_upgrade"]


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
                  state_schemas: StateSchemas = ()) -> UpgradePlan:
    """The plan of a restore of ``epoch`` into the code of ``graph`` (its logical stages); reads only.
    ``state_schemas``: the evidence of state compatibility where it was gathered (with Spark:
    :func:`airflow_arroyo.runtime.upgrade_evidence.upgrade_state_schemas`); without it no stage's state shape is
    checked."""
    facts = read_restore_facts(store, pipeline_id, epoch, stages=None).facts
    if facts.epoch is None:
        raise ConfigurationError(f"pipeline {pipeline_id} has no epoch {epoch} to plan an upgrade from "
                                 f"(airflow-arroyo epochs {pipeline_id} lists them)")
    new_code = dataclasses.replace(
        facts, stages=tuple(graph.stage_names), identities=stage_identities(graph.stages),
        allow_dropped_state=tuple(allow_dropped_state), renamed=tuple((renamed or {}).items()),
        state_schemas=tuple(state_schemas))
    return plan_stages(new_code, facts.epoch)


def _refusal(plan: UpgradePlan) -> str:
    return "; ".join(f"stage {r.stage!r} {r.action.value}: {r.reason}" for r in plan.refused)


def prepare_upgrade(store: EpochStore, pipeline_id: str, graph: PipelineGraph, *,
                    allow_dropped_state: Sequence[str] = (), renamed: Mapping[str, str] | None = None,
                    label: str | None = None, stop_timeout: float = 600.0, poll: float = 0.5,
                    state_schemas: Callable[[UpgradePlan], StateSchemas] | None = None) -> UpgradeReady:
    """Steps 1-4 of the module docstring; returns what the new code restores. ``state_schemas``: where the caller
    has Spark, the evidence of state compatibility for a plan (``upgrade-plan --check-state-schema``'s, from
    :mod:`airflow_arroyo.runtime.upgrade_evidence`); both plan steps then refuse a stage whose state changed shape,
    the first one while the old code still runs."""
    label = label or f"upgrade {datetime.now(UTC):%Y-%m-%dT%H:%M:%SZ}"
    check_stop("graceful", label)

    def plan(epoch: RestoreFrom, step: str, after: str) -> UpgradePlan:
        first = check_upgrade(store, pipeline_id, graph, epoch, allow_dropped_state=allow_dropped_state,
                              renamed=renamed)
        if state_schemas is None:
            return first
        try:
            evidence = state_schemas(first)
        except Exception as exc:  # Spark could not plan the new code, or a snapshot object is unreadable
            raise UpgradeError(pipeline_id, step, f"the state schema check could not run: {type(exc).__name__}: "
                               f"{exc}", after=after) from exc
        return check_upgrade(store, pipeline_id, graph, first.epoch, allow_dropped_state=allow_dropped_state,
                             renamed=renamed, state_schemas=evidence)

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
