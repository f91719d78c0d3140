"""``PendingGateSensor``: wait until an epoch's output of a gated sink waits for a verdict (a commit gate is pending).

The other way to run a check on each gate than a DAG scheduled on :func:`airflow_arroyo.assets.gate_asset`: a DAG
that loops (or runs on a schedule) waits here, then checks the epoch the sensor returns::

    wait = PendingGateSensor(task_id="wait_gate", pipeline_id="orders", sink="orders_pg", timeout=3600)
    check = EpochGateCheckOperator(task_id="check", pipeline_id="orders", sink="orders_pg",
                                   epoch="{{ ti.xcom_pull(task_ids='wait_gate', key='epoch') }}", ...)

Deferrable when ``deferrable=True`` (default: ``[operators] default_deferrable``): one look in the worker (a gate
already pending? then no deferral), then :class:`~airflow_arroyo.triggers.gates.PendingGateTrigger` waits in the
triggerer; otherwise it pokes. Running out of time is an ordinary sensor timeout.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from airflow.sdk import BaseSensorOperator, PokeReturnValue

from airflow_arroyo import config
from airflow_arroyo.config import default_deferrable
from airflow_arroyo.core.epochs import validate_pipeline_id
from airflow_arroyo.core.exceptions import ArroyoError, ConfigurationError, UnknownPipelineError
from airflow_arroyo.core.gates import GateState
from airflow_arroyo.links.pipeline import XCOM_PIPELINE_ID, ArroyoPipelineLink
from airflow_arroyo.triggers.gates import PendingGateTrigger, first_pending, gate_payload
from airflow_arroyo.triggers.settle import settle_deadline

if TYPE_CHECKING:
    from airflow.sdk import Context

    from airflow_arroyo.store import EpochStore

__all__ = ["PendingGateSensor"]


def _after_epoch(value: int | str | None) -> int | None:
    if value in (None, ""):
        return None
    try:
        number = int(str(value).strip())
    except ValueError:
        number = -1
    if number < 0 or isinstance(value, bool):
        raise ConfigurationError(f"after_epoch must be a whole number >= 0 (wait for a gate of a later epoch), "
                                 f"got {value!r}")
    return number


class PendingGateSensor(BaseSensorOperator):
    """Wait until a gate of ``sink`` of ``pipeline_id`` is pending, of an epoch after ``after_epoch`` if given.

    :param pipeline_id: the pipeline (templated).
    :param sink: the gated sink's name, as declared in the pipeline (templated).
    :param after_epoch: only a gate of a later epoch counts (templated; e.g. the epoch the last check saw).
    :param conn_id: Airflow connection of the epoch store (default ``[arroyo] conn_id``).
    :param deferrable: wait in the triggerer instead of poking (default ``[operators] default_deferrable``).
    :param trigger_poll_interval: seconds between two looks at the store while deferred.

    The XCom value is the oldest such gate (``pipeline_id``, ``sink``, ``epoch``, ``batch_from``, ``batch_to``,
    ``uri``, ``deadline``, ``policy``, ``run_id``, ``seq``); its epoch is also pushed under the key ``epoch``.
    """

    template_fields: Sequence[str] = ("pipeline_id", "sink", "after_epoch", "conn_id")
    operator_extra_links = (ArroyoPipelineLink(),)
    ui_color = "#f4eee8"

    def __init__(self, *, pipeline_id: str, sink: str, after_epoch: int | str | None = None,
                 conn_id: str | None = None, deferrable: bool | None = None, trigger_poll_interval: float = 5.0,
                 poke_interval: timedelta | float = 10.0, **kwargs: Any) -> None:
        super().__init__(poke_interval=poke_interval, **kwargs)
        self.pipeline_id = pipeline_id
        self.sink = sink
        self.after_epoch = after_epoch
        self.conn_id = conn_id or config.get("conn_id")
        self.deferrable = default_deferrable() if deferrable is None else deferrable
        self.trigger_poll_interval = trigger_poll_interval
        if "{{" not in str(after_epoch):  # fail at parse time, naming the task
            try:
                _after_epoch(after_epoch)
            except ConfigurationError as exc:
                raise ConfigurationError(f"task {self.task_id!r}: {exc}") from None

    def _store(self) -> EpochStore:
        from airflow_arroyo.hooks.arroyo import ArroyoHook

        return ArroyoHook(self.conn_id).get_store()

    def _look(self) -> dict[str, Any] | None:
        try:
            gates = self._store().list_gates(self.pipeline_id, sink=self.sink, states=[GateState.PENDING], limit=1000)
        except UnknownPipelineError:
            return None
        found = first_pending(gates, _after_epoch(self.after_epoch))
        return gate_payload(found) if found is not None else None

    def execute(self, context: Context) -> Any:
        """Airflow: look once, then defer until a gate is pending."""
        validate_pipeline_id(self.pipeline_id)
        if not self.sink:
            raise ConfigurationError(f"task {self.task_id!r}: sink must name the gated sink")
        context["ti"].xcom_push(key=XCOM_PIPELINE_ID, value=self.pipeline_id)
        if not self.deferrable:
            return super().execute(context)
        found = self._look()
        if found is not None:
            return self.execute_complete(context, {"status": "success", "gate": found})
        self.log.info("pipeline %s: no gate of sink %s pending%s; deferring", self.pipeline_id, self.sink,
                      f" after epoch {self.after_epoch}" if self.after_epoch not in (None, "") else "")
        self.defer(
            trigger=PendingGateTrigger(pipeline_id=self.pipeline_id, sink=self.sink, conn_id=self.conn_id,
                                       after_epoch=_after_epoch(self.after_epoch),
                                       poll_interval=self.trigger_poll_interval, not_before=settle_deadline()),
            method_name="execute_complete",
            timeout=timedelta(seconds=float(self.timeout)),
        )

    def poke(self, context: Context) -> Any:
        """Airflow: done once a gate is pending."""
        found = self._look()
        if found is None:
            self.log.info("pipeline %s: no gate of sink %s pending yet", self.pipeline_id, self.sink)
            return False
        return PokeReturnValue(True, self.execute_complete(context, {"status": "success", "gate": found}))

    def execute_complete(self, context: Context, event: dict[str, Any]) -> dict[str, Any]:
        """Airflow: the end of the deferral; returns the gate and pushes its epoch (key ``epoch``)."""
        gate = event.get("gate")
        if event.get("status") != "success" or not isinstance(gate, dict):
            raise ArroyoError(f"waiting for a gate of sink {self.sink!r} of {self.pipeline_id!r} failed: {event!r}")
        self.log.info("pipeline %s: epoch %s pending for sink %s (deadline %s)", self.pipeline_id, gate["epoch"],
                      self.sink, gate.get("deadline"))
        context["ti"].xcom_push(key="epoch", value=gate["epoch"])
        return gate
