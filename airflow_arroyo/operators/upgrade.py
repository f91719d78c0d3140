"""Upgrade a running pipeline to new code in one Airflow task: ``UpgradePipelineOperator``.

The task loads the new code's graph in the worker and goes through :func:`airflow_arroyo.core.upgrades.prepare_upgrade`
(plan, graceful stop with a final epoch, pin it, plan again), then submits the new code restoring the pinned epoch
as :class:`~airflow_arroyo.operators.pipeline.SubmitPipelineOperator` does (deferred until running; supervised if
configured). A failure along the way fails the task without retries, with the step it stopped at and the state the
pipeline is in (the previous version restores the pinned epoch, or ``latest``, as before): see docs/upgrading.md.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from airflow.sdk.exceptions import AirflowFailException

from airflow_arroyo.core.exceptions import ConfigurationError, UnknownPipelineError
from airflow_arroyo.core.supervision import lineage_of
from airflow_arroyo.operators.pipeline import (
    SubmitCommand,
    SubmitPipelineOperator,
    _arg_value,
    _at_parse,
    _started_by_an_earlier_try,
    _store,
    _templated,
)
from airflow_arroyo.triggers.resubmit import Resubmission

if TYPE_CHECKING:
    from airflow.sdk import Context

    from airflow_arroyo.runtime.decisions import UpgradePlan
    from airflow_arroyo.store import EpochStore

__all__ = ["UpgradePipelineOperator"]


def _check_options(renamed: Any, allow_dropped_state: Any, rescale: Any) -> None:
    """The upgrade's own arguments, as rendered; :class:`ConfigurationError` naming the bad one."""
    if renamed is not None and not (isinstance(renamed, Mapping) and all(
            isinstance(k, str) and k and isinstance(v, str) and v for k, v in renamed.items())):
        raise ConfigurationError(f"renamed must map the epoch's stage to the new code's stage, e.g. "
                                 f"{{'totals': 'totals_v2'}}, got {renamed!r}")
    if isinstance(allow_dropped_state, str) or not all(isinstance(s, str) and s for s in allow_dropped_state):
        raise ConfigurationError(f"allow_dropped_state must be a list of stage names, got {allow_dropped_state!r}")
    if rescale is not None:
        if not isinstance(rescale, Mapping):
            raise ConfigurationError(f"rescale must map a stage to its number of state partitions, got {rescale!r}")
        for stage, count in rescale.items():
            try:
                ok = int(count) >= 1 and not isinstance(count, bool)
            except (TypeError, ValueError):
                ok = False
            if not ok:
                raise ConfigurationError(f"rescale must give stage {stage!r} a number of state partitions >= 1, "
                                         f"got {count!r}")


def _plan_rows(plan: UpgradePlan) -> list[dict[str, Any]]:
    return [{"stage": r.stage, "action": r.action.value, "reason": r.reason, "snapshot": r.snapshot}
            for r in plan.stages]


def _table(rows: list[dict[str, Any]]) -> str:
    cells = [["STAGE", "ACTION", "REASON"], *[[str(r["stage"]), str(r["action"]), str(r["reason"])] for r in rows]]
    widths = [max(len(c[i]) for c in cells) for i in range(2)]
    return "\n".join(f"  {c[0]:<{widths[0]}}  {c[1]:<{widths[1]}}  {c[2]}" for c in cells)


class UpgradePipelineOperator(SubmitPipelineOperator):
    """Upgrade pipeline ``pipeline_id`` to the code ``pipeline`` names, in one task: stop the running code with a
    final epoch, pin it, check the new code's plan against it, and submit the new code restoring it.

    Takes the parameters of :class:`~airflow_arroyo.operators.pipeline.SubmitPipelineOperator` (``pipeline`` is the
    *new* code; ``restore_from`` is not given: the upgrade restores the epoch it pinned), and:

    :param renamed: the epoch's stage (its identity) -> the new code's stage that takes its state (``--rename``).
    :param allow_dropped_state: stages of the epoch the new code drops, with their state (``--allow-dropped-state``).
    :param rescale: stage -> its new number of state partitions (``--rescale``; the first launch only).
    :param pin_label: the pin label of the final epoch (default ``upgrade <dag_id>.<task_id> <ts>``: the same for
        every try of one task instance, so a retry pins nothing twice).
    :param stop_timeout: seconds the old code may take to stop with its final epoch.

    XCom: ``pinned_epoch``, ``pin_label``, ``upgrade_plan`` (a row per stage: stage, action, reason, snapshot), then
    what the submit operator pushes. A retry that finds the run an earlier try started carries on with it.

    The plan steps do not check state schemas: that starts Spark, which the worker need not have; the new code's
    driver refuses a stage whose state changed shape before it writes anything (docs/upgrading.md, "As an Airflow
    task", says how to check before the stop).

    Usage::

        upgrade = UpgradePipelineOperator(
            task_id="upgrade", pipeline="my_pkg.orders_v2:orders", pipeline_id="orders",
            renamed={"totals": "totals_v2"}, restart_strategy={"type": "fixed-delay", "attempts": 3, "delay": 10},
        )
    """

    template_fields: Sequence[str] = (*SubmitPipelineOperator.template_fields, "renamed", "allow_dropped_state",
                                      "rescale", "pin_label")
    template_fields_renderers = {**SubmitPipelineOperator.template_fields_renderers, "renamed": "json",
                                 "allow_dropped_state": "json", "rescale": "json"}
    ui_color = "#e8eef4"

    def __init__(
        self,
        *,
        renamed: Mapping[str, str] | None = None,
        allow_dropped_state: Sequence[str] = (),
        rescale: Mapping[str, int] | None = None,
        pin_label: str | None = None,
        stop_timeout: float = 600.0,
        **kwargs: Any,
    ) -> None:
        if kwargs.get("restore_from") is not None:
            raise ConfigurationError(f"task {kwargs.get('task_id')!r}: an upgrade restores the final epoch it pins; "
                                     "drop restore_from")
        super().__init__(**kwargs)
        self.renamed: Any = dict(renamed) if isinstance(renamed, Mapping) else renamed
        self.allow_dropped_state: Any = (allow_dropped_state if isinstance(allow_dropped_state, str)
                                         else list(allow_dropped_state))
        self.rescale: Any = dict(rescale) if isinstance(rescale, Mapping) else rescale
        self.pin_label = pin_label
        self.stop_timeout = stop_timeout
        if not _has_template([renamed, allow_dropped_state, rescale]):  # else checked once rendered, in execute
            _at_parse(self.task_id, _check_options, self.renamed, self.allow_dropped_state, self.rescale)
        if pin_label is not None:
            from airflow_arroyo.store import EpochStore

            _at_parse(self.task_id, EpochStore.check_pin_label, pin_label)

    # ------------------------------------------------------------------ execute

    def execute(self, context: Context) -> Any:
        """Airflow: prepare the upgrade (plan, stop, pin, plan), then submit the new code restoring the pinned epoch.
        A retry that finds the run an earlier try started goes straight to the submit operator, which adopts it."""
        from airflow_arroyo.core.upgrades import UpgradeError, fusion_note, prepare_upgrade
        from airflow_arroyo.runtime.driver import load_pipeline

        self._validate()
        _check_options(self.renamed, self.allow_dropped_state, self.rescale)
        store = _store(self.conn_id)
        try:
            current = store.get_pipeline(self.pipeline_id)
        except UnknownPipelineError:
            current = None
        if current is not None and not current.state.terminal and _started_by_an_earlier_try(
                context, str(self.run_id) if self.run_id else None, lineage_of(current)):
            return super().execute(context)
        new_code = load_pipeline(str(self.pipeline), {k: _parsed(v) for k, v in self.pipeline_args.items()})
        if new_code.pipeline_id != self.pipeline_id:
            raise ConfigurationError(f"the new code {self.pipeline!r} is pipeline {new_code.pipeline_id!r}, not "
                                     f"{self.pipeline_id!r}: nothing was changed")
        graph = new_code.validate()
        label = self.pin_label or self._default_label(context)
        self.log.info("Upgrading pipeline %s to %s: plan, stop with a final epoch, pin it (%r), plan again",
                      self.pipeline_id, self.pipeline, label)
        try:
            ready = prepare_upgrade(store, self.pipeline_id, graph, allow_dropped_state=self.allow_dropped_state,
                                    renamed=self.renamed, label=label, stop_timeout=float(self.stop_timeout),
                                    chaining=new_code.chaining)
        except UpgradeError as exc:
            # no retry: a retry would plan against what this failure left and misreport it; a person decides
            raise AirflowFailException(str(exc)) from exc
        rows = _plan_rows(ready.plan)
        self.log.info("Pipeline %s stopped with its final epoch %s pinned (%r); the new code restores it:\n%s\n  %s",
                      self.pipeline_id, ready.epoch, ready.label, _table(rows),
                      fusion_note(ready.plan, "airflow-arroyo upgrade-plan --check-state-schema"))
        ti = context["ti"]
        ti.xcom_push(key="pinned_epoch", value=ready.epoch)
        ti.xcom_push(key="pin_label", value=ready.label)
        ti.xcom_push(key="upgrade_plan", value=rows)
        self.restore_from = ready.epoch
        return super().execute(context)

    def _default_label(self, context: Context) -> str:
        ti = context["ti"]
        return f"upgrade {ti.dag_id}.{self.task_id} {context.get('ts') or ti.run_id}"[:200]

    # ------------------------------------------------------------------ the driver's arguments

    def build_spark_submit(self, run_id: str, restore: str | None, dsn: str, **kw: Any) -> SubmitCommand:
        """The submit operator's command with the upgrade's driver arguments, where they apply
        (:meth:`upgrade_args`)."""
        extra = self.upgrade_args(restore)
        if not extra:
            return super().build_spark_submit(run_id, restore, dsn, **kw)
        given = self.application_args
        self.application_args = [*given, *extra]
        try:
            return super().build_spark_submit(run_id, restore, dsn, **kw)
        finally:
            self.application_args = given

    def upgrade_args(self, restore: str | None, store: EpochStore | None = None) -> list[str]:
        """``--rename``, ``--allow-dropped-state`` and ``--rescale`` for a run restoring ``restore``.

        The renames and dropped stages name the old code's stages: they go with a restore of an epoch number (the
        first launch restores the pinned one), or of ``latest`` while the latest completed epoch still holds every
        one of them (a supervised restart before the new code completed an epoch of its own); once it did, they
        would be refused by the driver, and none is given. The rescale goes with the first launch only. Needs nothing
        but the constructor's arguments and the store: a restart after a deferral calls it too.
        """
        renamed, dropped = dict(self.renamed or {}), list(self.allow_dropped_state)
        first_launch = restore is not None and restore != "latest"
        args: list[str] = []
        if (renamed or dropped) and restore is not None and (
                first_launch or self._epoch_holds(store or _store(self.conn_id), [*renamed, *dropped])):
            for old, new in renamed.items():
                args += ["--rename", f"{old}={new}"]
            for stage in dropped:
                args += ["--allow-dropped-state", stage]
        if first_launch:
            for stage, count in (self.rescale or {}).items():
                args += ["--rescale", f"{stage}={int(count)}"]
        return args

    def _epoch_holds(self, store: EpochStore, names: Sequence[str]) -> bool:
        """Whether the epoch ``latest`` restores has a stage of each name (its name or its registered identity)."""
        from airflow_arroyo.core.restores import read_restore_facts

        facts = read_restore_facts(store, self.pipeline_id, "latest", stages=None).facts
        if facts.epoch is None:
            return False
        identity = dict(facts.epoch_identities)
        held = {*facts.epoch.stages, *(identity.get(s, s) for s in facts.epoch.stages)}
        return all(n in held for n in names)

    def _resubmission(self, context: Context) -> Resubmission | None:
        """Restarts submitted by the triggerer use one command built now; whether the upgrade's arguments go with a
        restart depends on the epoch it restores then, so with any of them the restarts go through this task."""
        if self.renamed or self.allow_dropped_state:
            self.log.warning("Pipeline %s: restarts go through this task (a worker slot), not the triggerer: whether "
                             "they take --rename/--allow-dropped-state depends on the epoch each restores",
                             self.pipeline_id)
            return None
        return super()._resubmission(context)


def _has_template(value: Any) -> bool:
    if isinstance(value, Mapping):
        return any(_has_template(k) or _has_template(v) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return any(_has_template(v) for v in value)
    return _templated(value)


def _parsed(value: Any) -> Any:
    """A pipeline argument as the driver reads it from ``--arg key=value`` (JSON, else the text)."""
    text = _arg_value(value)
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text
