"""Which epoch a new run restores: the facts read from the store, once, for every caller.

The driver (before it writes anything) and ``airflow-arroyo restore`` (a dry run) both read the facts here
and ask :func:`airflow_arroyo.runtime.decisions.plan_restore` for the decision, so the CLI can never call an
epoch restorable that the driver would refuse, or the reverse. Airflow-free; reads only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from airflow_arroyo.core.exceptions import ConfigurationError, UnknownEpochError, UnknownPipelineError
from airflow_arroyo.runtime.decisions import EpochFacts, RestoreFacts, RestoreFrom

if TYPE_CHECKING:
    from airflow_arroyo.store import EpochRecord, EpochStore, PipelineRecord

__all__ = ["RestoreSituation", "parse_restore_from", "read_restore_facts"]


@dataclass(frozen=True)
class RestoreSituation:
    """The facts for :func:`plan_restore`, and the fork's source when this run is a fork's first run (it then
    restores the fork point, an epoch of ``fork_source``)."""

    facts: RestoreFacts
    fork_source: PipelineRecord | None = None


def parse_restore_from(value: str) -> RestoreFrom:
    """``'latest'`` or an epoch number, as typed on a command line."""
    text = value.strip().lower()
    if text == "latest":
        return "latest"
    if text.isdigit():
        return int(text)
    raise ConfigurationError(f"--epoch must be an epoch number or 'latest', got {value!r}")


def _epoch_facts(record: EpochRecord) -> EpochFacts:
    return EpochFacts(record.epoch, record.state, tuple(record.stages), record.unrestorable)


def _waiting_fork(store: EpochStore, pipeline_id: str, requested: RestoreFrom) -> PipelineRecord | None:
    """The source of ``pipeline_id`` when it is a fork with no completed epoch of its own (its first run restores
    the fork point, whatever ``requested`` says but another epoch number, which is refused)."""
    try:
        record = store.get_pipeline(pipeline_id)
    except UnknownPipelineError:
        return None
    source, epoch = record.forked_from_pipeline, record.forked_from_epoch
    if source is None or epoch is None or pipeline_id not in store.waiting_forks(source, epoch):
        return None
    if requested not in (None, "latest", epoch):
        raise ConfigurationError(
            f"pipeline {pipeline_id!r} is a fork of epoch {epoch} of {source!r} with no epoch of its own: "
            f"its first run restores that epoch, not {requested!r}; restore 'latest' "
            "(restore_from='latest', --epoch latest)"
        )
    return store.get_pipeline(source)


def read_restore_facts(store: EpochStore, pipeline_id: str, requested: RestoreFrom, stages: Sequence[str] | None,
                       *, has_state: Callable[[], bool] = lambda: False, location: str = "") -> RestoreSituation:
    """What :func:`plan_restore` needs for a run of ``pipeline_id`` asked to restore ``requested``, and only that.

    ``stages``: the new run's stages (None where the code is not at hand, as in the CLI: the stage check is then
    left to the driver). ``has_state`` is called for a fresh start only (``requested`` None), ``location`` names
    where that state lives.
    """
    facts = RestoreFacts(pipeline_id, requested, None if stages is None else tuple(stages))
    source = _waiting_fork(store, pipeline_id, requested)
    if source is not None:
        me = store.get_pipeline(pipeline_id)
        assert me.forked_from_epoch is not None
        point = store.get_epoch(source.pipeline_id, me.forked_from_epoch)
        return RestoreSituation(replace(facts, requested=point.epoch, pipeline_known=True, epoch=_epoch_facts(point),
                                        fork_of=source.pipeline_id, epoch_identities=registered_identities(source)),
                                source)
    if requested is None:
        return RestoreSituation(replace(facts, has_state=has_state(), location=location))
    try:
        registered = store.get_pipeline(pipeline_id)
    except UnknownPipelineError:
        return RestoreSituation(facts)
    blocker = store.gate_blocker(pipeline_id)
    held_by = None if blocker is None else (blocker.epoch, blocker.sink, blocker.state.value)
    record: EpochRecord | None
    if requested == "latest":
        # never beyond a gate without a pass: the restore would commit the output it holds
        record = (store.latest_completed_epoch(pipeline_id) if blocker is None
                  else store.latest_completed_before(pipeline_id, blocker.epoch))
    else:
        assert isinstance(requested, int)
        try:
            record = store.get_epoch(pipeline_id, requested)
        except UnknownEpochError:  # bad input, not a store failure: plan_restore refuses it
            record = None
    return RestoreSituation(replace(facts, pipeline_known=True, held_by=held_by,
                                    epoch=None if record is None else _epoch_facts(record),
                                    epoch_identities=registered_identities(registered)))


def registered_identities(record: PipelineRecord) -> tuple[tuple[str, str], ...]:
    """Stage name -> identity (its ``uid``) as the pipeline's last run registered them, where they differ."""
    stages = (record.config or {}).get("stages") or {}
    return tuple((name, str(cfg["uid"])) for name, cfg in stages.items()
                 if isinstance(cfg, dict) and cfg.get("uid") and cfg["uid"] != name)
