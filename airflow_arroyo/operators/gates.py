"""Verdicts on commit gates from Airflow (:mod:`airflow_arroyo.core.gates`): check an epoch's pending output, or record
a verdict reached elsewhere.

* :class:`EpochGateCheckOperator` runs a check on exactly one epoch's pending output of a gated sink, read-only, and
  records ``passed`` or ``failed`` (by ``<dag_id>.<task_id>``, with the reason). A SQL check (PostgreSQL sinks)
  runs in the sink's target database against a temporary view ``pending`` of the epoch's pending rows, in a READ
  ONLY transaction, with :class:`~airflow.providers.common.sql.operators.sql.SQLCheckOperator`'s rule: it passes
  when its first row exists and every value in it is truthy. A Python check gets the
  :class:`~airflow_arroyo.core.gates.PendingOutput` (the pending files of a file sink, or the rows' query) and returns
  ``bool`` or ``(bool, reason)``::

      EpochGateCheckOperator(task_id="check_orders", pipeline_id="orders", sink="orders_pg", conn_id="orders_db",
                             sql="SELECT count(*) > 0, count(*) = count(order_id) FROM pending")
      EpochGateCheckOperator(task_id="check_report", pipeline_id="orders", sink="report",
                             check=lambda out: (len(out.files) > 0, f"{len(out.files)} files"))

  Which epochs: ``epoch=`` (templated), else those the triggering Asset events of
  :func:`~airflow_arroyo.assets.gate_asset` announce, else the oldest pending gate of the sink.

  **A failed check fails the task** after its verdict is recorded (``fail_task_on_failed_check=True``, the
  default), as a data-quality check does, so a failed epoch is red in the grid and alerts like any failed task; it
  is not retried (the verdict is recorded and the data does not change). ``False`` records the verdict and
  succeeds (the gate's policy is the reaction). A check that cannot run (bad SQL, a write the read-only
  transaction refuses, an unreachable database) records nothing and fails the task, which retries as configured.
  A gate somebody else decided already (a person's approval) is not checked again.
* :class:`RecordGateVerdictOperator` records a verdict decided elsewhere (an upstream task, a parameter).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from functools import cached_property
from typing import TYPE_CHECKING, Any

from airflow.sdk import BaseHook, BaseOperator
from airflow.sdk.exceptions import AirflowFailException, AirflowSkipException

from airflow_arroyo import config
from airflow_arroyo.core.connections import extra_of, postgres_dsn
from airflow_arroyo.core.epochs import validate_pipeline_id
from airflow_arroyo.core.exceptions import ConfigurationError, StateConflictError
from airflow_arroyo.core.gates import GateRecord, GateState, PendingOutput, pending_output, record_verdict
from airflow_arroyo.links.pipeline import XCOM_PIPELINE_ID, ArroyoPipelineLink
from airflow_arroyo.triggers.gates import first_pending

if TYPE_CHECKING:
    from airflow.sdk import Context

    from airflow_arroyo.hooks.arroyo import ArroyoHook
    from airflow_arroyo.store import EpochStore

__all__ = ["EpochGateCheckOperator", "GateCheck", "RecordGateVerdictOperator", "sql_check_verdict"]

#: A Python check: the pending output in, ``passed`` or ``(passed, reason)`` out.
GateCheck = Callable[[PendingOutput], "bool | tuple[bool, str | None]"]
_AWAITING = (GateState.PENDING, GateState.TIMED_OUT)  # gates that wait for a verdict
_TARGET_CONN_TYPES = ("postgres", "postgresql", "arroyo")
_MAX_SHOWN = 500  # characters of a row in a reason


def _templated(value: object) -> bool:
    return isinstance(value, str) and ("{{" in value or "{%" in value)


def _epoch_numbers(value: object) -> list[int]:
    """``epoch=`` as rendered: a number, text of one, or a list of them (an XCom of several)."""
    items: Iterable[Any] = value if isinstance(value, list | tuple) else str(value).replace(",", " ").split()
    out = []
    for item in items:
        try:
            number = int(str(item).strip())
        except ValueError:
            number = 0
        if number < 1 or isinstance(item, bool):
            raise ConfigurationError(f"epoch must be an epoch number >= 1 (or a list of them), got {value!r}")
        out.append(number)
    if not out:
        raise ConfigurationError(f"epoch must be an epoch number >= 1 (or a list of them), got {value!r}")
    return sorted(set(out))


def sql_check_verdict(rows: Sequence[Sequence[Any]]) -> tuple[bool, str]:
    """SQLCheckOperator's rule over a check's rows: passed iff a first row exists and every value in it is truthy.
    Pure; the reason shows the first row."""
    if not rows:
        return False, "the check returned no row"
    first = tuple(rows[0])
    shown = repr(first)
    if len(shown) > _MAX_SHOWN:
        shown = shown[:_MAX_SHOWN - 3] + "..."
    if all(bool(v) for v in first):
        return True, f"check passed: {shown}"
    falsy = [i + 1 for i, v in enumerate(first) if not v]
    return False, f"check failed: column{'s' if len(falsy) > 1 else ''} {', '.join(map(str, falsy))} of {shown}"


def _target_dsn(conn_id: str) -> str:
    """The DSN of the PostgreSQL sink's target database behind Airflow connection ``conn_id``."""
    conn = BaseHook.get_connection(conn_id)
    if (conn.conn_type or "").lower() not in _TARGET_CONN_TYPES or not conn.host:
        raise ConfigurationError(f"connection {conn_id!r} (type {conn.conn_type!r}) is not a PostgreSQL connection "
                                 "with a host: a SQL gate check runs in the sink's target PostgreSQL database")
    return postgres_dsn(conn_id, host=conn.host, port=conn.port, schema=conn.schema, login=conn.login,
                        password=conn.password, extra=extra_of(conn_id, conn.conn_type, conn.extra))


class _GateOperator(BaseOperator):
    """What both operators share: the gate's pipeline and sink, the store, who a verdict is by."""

    operator_extra_links = (ArroyoPipelineLink(),)
    ui_color = "#f4eee8"

    def __init__(self, *, pipeline_id: str, sink: str, arroyo_conn_id: str | None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.pipeline_id = pipeline_id
        self.sink = sink
        self.arroyo_conn_id = arroyo_conn_id or config.get("conn_id")

    @cached_property
    def hook(self) -> ArroyoHook:
        """The hook of the epoch store's connection."""
        from airflow_arroyo.hooks.arroyo import ArroyoHook

        return ArroyoHook(self.arroyo_conn_id)

    def _by(self) -> str:
        return f"{self.dag_id}.{self.task_id}"

    def _start(self, context: Context) -> EpochStore:
        validate_pipeline_id(self.pipeline_id)
        if not self.sink:
            raise ConfigurationError(f"task {self.task_id!r}: sink must name the gated sink")
        with contextlib.suppress(KeyError, AttributeError):  # a bare context in unit tests
            context["ti"].xcom_push(key=XCOM_PIPELINE_ID, value=self.pipeline_id)
        return self.hook.get_store()


class EpochGateCheckOperator(_GateOperator):
    """Check the pending output of a gated sink's epoch(s), read-only, and record the verdict (module docstring).

    :param pipeline_id: the pipeline (templated).
    :param sink: the gated sink's name (templated).
    :param epoch: the epoch to check (templated; a number or a list). Default: the epochs of the triggering
        :func:`~airflow_arroyo.assets.gate_asset` events, else the oldest pending gate of the sink.
    :param sql: a SQL check against the view ``view`` (templated; ``.sql`` files are read). PostgreSQL sinks.
    :param parameters: the SQL's parameters (templated).
    :param conn_id: Airflow connection (``postgres``) of the sink's target database, where ``sql`` runs.
    :param check: a Python check instead of ``sql``: ``check(pending_output) -> bool | (bool, reason)``.
    :param arroyo_conn_id: the epoch store's connection (default ``[arroyo] conn_id``).
    :param fail_task_on_failed_check: fail the task (no retry) once a failed verdict is recorded.
    :param view: the temporary view's name the SQL reads.

    The XCom value is a list of ``{"epoch", "verdict": "passed" | "failed" | "skipped", "reason", "by"}``.
    """

    template_fields: Sequence[str] = ("pipeline_id", "sink", "epoch", "sql", "parameters", "conn_id",
                                      "arroyo_conn_id")
    template_ext: Sequence[str] = (".sql",)
    template_fields_renderers = {"sql": "sql"}

    def __init__(self, *, pipeline_id: str, sink: str, epoch: int | str | Sequence[int] | None = None,
                 sql: str | None = None, parameters: Mapping[str, Any] | Sequence[Any] | None = None,
                 conn_id: str | None = None, check: GateCheck | None = None, arroyo_conn_id: str | None = None,
                 fail_task_on_failed_check: bool = True, view: str = "pending", **kwargs: Any) -> None:
        super().__init__(pipeline_id=pipeline_id, sink=sink, arroyo_conn_id=arroyo_conn_id, **kwargs)
        self.epoch = epoch
        self.sql = sql
        self.parameters = parameters
        self.conn_id = conn_id
        self.check = check
        self.fail_task_on_failed_check = fail_task_on_failed_check
        self.view = view
        # bad arguments fail when the DAG is parsed, naming the task
        problem = None
        if (sql is None) == (check is None):
            problem = "give exactly one check: sql='SELECT ... FROM pending' (with conn_id=) or check=<callable>"
        elif sql is not None and not conn_id:
            problem = "a SQL check runs in the sink's target database: give conn_id=<its Airflow connection>"
        elif check is not None and not callable(check):
            problem = f"check must be a callable taking the PendingOutput, got {check!r}"
        elif epoch not in (None, "") and not _templated(epoch):
            try:
                _epoch_numbers(epoch)
            except ConfigurationError as exc:
                problem = str(exc)
        if problem:
            raise ConfigurationError(f"task {self.task_id!r}: {problem}")

    def execute(self, context: Context) -> list[dict[str, Any]]:
        """Airflow: check each epoch's pending output and record its verdict."""
        store = self._start(context)
        epochs = self._epochs(context, store)
        if not epochs:
            raise AirflowSkipException(f"no gate of sink {self.sink!r} of {self.pipeline_id!r} waits for a verdict")
        by = self._by()
        results = [self._check_one(store, epoch, by) for epoch in epochs]
        failed = [r for r in results if r["verdict"] == GateState.FAILED.value]
        if failed and self.fail_task_on_failed_check:
            raise AirflowFailException("; ".join(f"epoch {r['epoch']} of sink {self.sink!r} failed its gate check "
                                                 f"({r['reason']})" for r in failed))
        if all(r["verdict"] == "skipped" for r in results):
            raise AirflowSkipException(f"no gate checked: {'; '.join(r['reason'] for r in results)}")
        return results

    def _epochs(self, context: Context, store: EpochStore) -> list[int]:
        if self.epoch not in (None, ""):
            return _epoch_numbers(self.epoch)
        from airflow_arroyo.assets import pending_gates

        events = context.get("triggering_asset_events") or {}
        announced = pending_gates(e for evs in events.values() for e in evs)
        mine = {int(g["epoch"]) for g in announced
                if g.get("pipeline_id") == self.pipeline_id and g.get("sink") == self.sink}
        if mine:
            return sorted(mine)
        oldest = first_pending(store.list_gates(self.pipeline_id, sink=self.sink, states=[GateState.PENDING],
                                                limit=1000))
        return [oldest.epoch] if oldest is not None else []

    def _result(self, epoch: int, verdict: str, reason: str | None, by: str | None) -> dict[str, Any]:
        return {"epoch": epoch, "verdict": verdict, "reason": reason, "by": by}

    def _check_one(self, store: EpochStore, epoch: int, by: str) -> dict[str, Any]:
        gate = store.get_gate(self.pipeline_id, self.sink, epoch)
        if gate.state not in _AWAITING:
            if gate.decided_by == by and gate.state in (GateState.PASSED, GateState.FAILED):
                # this task decided it already (an earlier try): the same outcome, without running the check again
                self.log.info("epoch %s of sink %s: %s by this task already (%s)", epoch, self.sink, gate.state,
                              gate.reason)
                return self._result(epoch, gate.state.value, gate.reason, by)
            return self._skipped(gate)
        output = pending_output(store, self.pipeline_id, self.sink, epoch)
        passed, reason = self._run(output)
        try:
            recorded = record_verdict(store, self.pipeline_id, self.sink, epoch, passed=passed, by=by, reason=reason)
        except StateConflictError:  # decided (or closed) by someone else while the check ran
            return self._skipped(store.get_gate(self.pipeline_id, self.sink, epoch))
        log = self.log.info if passed else self.log.error
        log("pipeline %s epoch %s of sink %s: %s (%s)", self.pipeline_id, epoch, self.sink, recorded.state, reason)
        return self._result(epoch, recorded.state.value, reason, by)

    def _skipped(self, gate: GateRecord) -> dict[str, Any]:
        reason = (f"the gate of epoch {gate.epoch} is {gate.state}"
                  f"{' by ' + gate.decided_by if gate.decided_by else ''}: not checked")
        self.log.warning("pipeline %s sink %s: %s", self.pipeline_id, self.sink, reason)
        return self._result(gate.epoch, "skipped", reason, gate.decided_by)

    def _run(self, output: PendingOutput) -> tuple[bool, str | None]:
        if self.check is not None:
            result = self.check(output)
            if isinstance(result, tuple):
                passed, reason = bool(result[0]), (str(result[1]) if result[1] is not None else None)
            else:
                passed, reason = bool(result), None
            return passed, reason or ("check passed" if passed else "check returned False")
        import psycopg2

        assert self.sql is not None and self.conn_id is not None  # the constructor's rule
        conn = psycopg2.connect(_target_dsn(self.conn_id), application_name="airflow-arroyo-gate-check")
        try:
            rows = output.query(conn, self.sql, self.parameters, view=self.view)
        finally:
            conn.close()
        return sql_check_verdict(rows)


class RecordGateVerdictOperator(_GateOperator):
    """Record a verdict on the gate of ``sink`` for ``epoch``, decided elsewhere.

    :param pipeline_id: the pipeline (templated).
    :param sink: the gated sink's name (templated).
    :param epoch: the gate's epoch (templated).
    :param passed: the verdict (templated: ``True``/``False`` or text such as ``"true"``, ``"fail"``).
    :param reason: why (templated).
    :param by: who (templated; default ``<dag_id>.<task_id>``).
    :param arroyo_conn_id: the epoch store's connection (default ``[arroyo] conn_id``).

    Refused (the task fails) when the gate cannot take that verdict: committed, superseded, or a fail after a pass.
    The XCom value: ``{"epoch", "verdict", "reason", "by"}``.
    """

    template_fields: Sequence[str] = ("pipeline_id", "sink", "epoch", "passed", "reason", "by", "arroyo_conn_id")

    def __init__(self, *, pipeline_id: str, sink: str, epoch: int | str, passed: bool | str,
                 reason: str | None = None, by: str | None = None, arroyo_conn_id: str | None = None,
                 **kwargs: Any) -> None:
        super().__init__(pipeline_id=pipeline_id, sink=sink, arroyo_conn_id=arroyo_conn_id, **kwargs)
        self.epoch = epoch
        self.passed = passed
        self.reason = reason
        self.by = by
        try:
            if not _templated(epoch):
                _epoch_numbers(epoch)
            if not _templated(passed):
                _verdict(passed)
        except ConfigurationError as exc:
            raise ConfigurationError(f"task {self.task_id!r}: {exc}") from None

    def execute(self, context: Context) -> dict[str, Any]:
        """Airflow: record the verdict."""
        store = self._start(context)
        try:
            epochs = _epoch_numbers(self.epoch)
            passed = _verdict(self.passed)
            if len(epochs) != 1:
                raise ConfigurationError(f"a verdict is for one epoch, got {self.epoch!r}")
        except ConfigurationError as exc:  # rendered values: the DAG parsed, so no retry helps
            raise AirflowFailException(f"task {self.task_id!r}: {exc}") from exc
        epoch = epochs[0]
        by = str(self.by or "").strip() or self._by()
        try:
            rec = record_verdict(store, self.pipeline_id, self.sink, epoch, passed=passed, by=by,
                                 reason=self.reason or None)
        except StateConflictError as exc:
            raise AirflowFailException(str(exc)) from exc
        self.log.info("pipeline %s epoch %s of sink %s: %s by %s (%s)", self.pipeline_id, epoch, self.sink, rec.state,
                      rec.decided_by, rec.reason)
        return {"epoch": epoch, "verdict": rec.state.value, "reason": rec.reason, "by": rec.decided_by}


_TRUE = ("true", "1", "yes", "pass", "passed")
_FALSE = ("false", "0", "no", "fail", "failed")


def _verdict(value: object) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise ConfigurationError(f"passed must be True or False (or text: {'/'.join(_TRUE)} or {'/'.join(_FALSE)}), "
                             f"got {value!r}")
