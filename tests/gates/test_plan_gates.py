"""The driver's decision for a gated sink (:func:`airflow_arroyo.core.gates.plan_gates`) and the gate's declaration."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from airflow_arroyo.core.exceptions import ConfigurationError, PipelineGraphError
from airflow_arroyo.core.gates import Gate, GateAction, GatePolicy, GateRecord, GateState, plan_gates
from airflow_arroyo.runtime.pipeline import Pipeline
from airflow_arroyo.runtime.sinks.kafka import KafkaTarget
from airflow_arroyo.runtime.sinks.postgres import PostgresTarget

NOW = datetime(2026, 11, 28, 12, 0, tzinfo=UTC)


def gate(epoch: int, state: GateState, *, deadline: datetime | None = None, by: str | None = None,
         reason: str | None = None) -> GateRecord:
    return GateRecord("p", "out", epoch, "r", "file:///x", GatePolicy.HOLD, epoch * 10, epoch * 10 + 9, state,
                      NOW - timedelta(minutes=5), epoch, deadline=deadline, decided_by=by, reason=reason)


def actions(gates: list[GateRecord], spec: Gate) -> list[tuple[GateAction, int]]:
    return [(s.action, s.gate.epoch) for s in plan_gates(gates, spec.checked("out", "files"), NOW)]


HOLD = Gate(policy="hold", max_waiting=2)


def test_passed_gates_commit_in_epoch_order_up_to_the_first_that_waits() -> None:
    gates = [gate(3, GateState.PASSED), gate(1, GateState.PASSED), gate(2, GateState.PASSED),
             gate(4, GateState.PENDING), gate(5, GateState.PASSED)]
    assert actions(gates, HOLD) == [(GateAction.COMMIT, 1), (GateAction.COMMIT, 2), (GateAction.COMMIT, 3)]


def test_a_pass_behind_a_pending_gate_waits() -> None:
    assert actions([gate(1, GateState.PENDING), gate(2, GateState.PASSED)], HOLD) == []


def test_hold_keeps_later_epochs_waiting_until_more_than_max_waiting_then_stops_with_the_cause() -> None:
    failed = gate(1, GateState.FAILED, by="check_rows", reason="3 rows without a key")
    assert actions([failed, gate(2, GateState.PASSED), gate(3, GateState.PENDING)], HOLD) == []
    steps = plan_gates([failed, gate(2, GateState.PASSED), gate(3, GateState.PENDING), gate(4, GateState.PENDING)],
                       HOLD.checked("out", "files"), NOW)
    assert [(s.action, s.gate.epoch) for s in steps] == [(GateAction.STOP, 1)]
    cause = steps[0].cause
    assert "gate of sink 'out' for epoch 1 failed by check_rows: 3 rows without a key" in cause
    assert "3 later epochs waited behind it, more than max_waiting=2" in cause
    assert "airflow-arroyo gate pass p --sink out --epoch 1" in cause


def test_a_pending_gate_past_its_deadline_times_out_and_then_follows_the_policy() -> None:
    late = gate(1, GateState.PENDING, deadline=NOW - timedelta(seconds=1))
    not_yet = gate(1, GateState.PENDING, deadline=NOW + timedelta(seconds=1))
    assert actions([not_yet], HOLD) == []
    assert actions([late], HOLD) == [(GateAction.TIME_OUT, 1)]
    quarantine = Gate(policy="quarantine", quarantine_path="/q")
    assert actions([late, gate(2, GateState.PASSED)], quarantine) == [
        (GateAction.TIME_OUT, 1), (GateAction.QUARANTINE, 1), (GateAction.COMMIT, 2)]
    steps = plan_gates([late], Gate(policy="rollback_and_stop").checked("out", "files"), NOW)
    assert [s.action for s in steps] == [GateAction.TIME_OUT, GateAction.ROLLBACK_AND_STOP]
    assert "no verdict came before its deadline" in steps[1].cause


def test_rollback_and_stop_stops_at_the_failed_gate_after_committing_the_passed_ones_before_it() -> None:
    spec = Gate(policy="rollback_and_stop")
    gates = [gate(1, GateState.PASSED), gate(2, GateState.TIMED_OUT), gate(3, GateState.PASSED)]
    assert actions(gates, spec) == [(GateAction.COMMIT, 1), (GateAction.ROLLBACK_AND_STOP, 2)]


def test_quarantine_sets_each_failed_epoch_aside_and_goes_on() -> None:
    spec = Gate(policy="quarantine", quarantine_path="s3://bucket/quarantine")
    gates = [gate(1, GateState.FAILED), gate(2, GateState.PASSED), gate(3, GateState.FAILED),
             gate(4, GateState.PENDING)]
    assert actions(gates, spec) == [(GateAction.QUARANTINE, 1), (GateAction.COMMIT, 2), (GateAction.QUARANTINE, 3)]


def test_closed_gates_are_not_acted_on() -> None:
    gates = [gate(1, GateState.COMMITTED), gate(2, GateState.QUARANTINED), gate(3, GateState.SUPERSEDED)]
    assert actions(gates, HOLD) == []


@pytest.mark.parametrize(("spec", "kind", "message"), [
    (Gate(policy="maybe"), "files", "gate policy 'maybe' is not one of hold, rollback_and_stop, quarantine"),
    (Gate(), "kafka", "not of a kafka sink"),
    (Gate(timeout=0), "files", "timeout must be a positive number"),
    (Gate(max_waiting=0), "files", "max_waiting must be a whole number >= 1"),
    (Gate(policy="quarantine"), "files", "needs quarantine_path="),
    (Gate(policy="quarantine", quarantine_path="/q"), "postgres", "needs a file sink"),
    (Gate(policy="hold", quarantine_path="/q"), "files", "quarantine_path is for policy='quarantine'"),
])
def test_a_gate_that_cannot_work_is_refused_with_the_fix(spec: Gate, kind: str, message: str) -> None:
    with pytest.raises(ConfigurationError, match=message.replace("(", r"\(").replace(")", r"\)")):
        spec.checked("out", kind)


def test_the_graph_refuses_a_gate_on_a_sink_that_cannot_hold_output() -> None:
    p = Pipeline("gated")
    src = p.source("src", lambda spark: spark.readStream.format("rate").load())
    p.sink("to_kafka", [src], kafka=KafkaTarget(topic="t", bootstrap_servers="127.0.0.1:9"), gate=Gate())
    with pytest.raises(PipelineGraphError, match="not of a kafka sink"):
        p.validate()
    q = Pipeline("gated2")
    src = q.source("src", lambda spark: spark.readStream.format("rate").load())
    q.sink("files", [src], format="json", options={"path": "/tmp/out"},
           gate=Gate(policy="quarantine", quarantine_path="/tmp/out/"))
    with pytest.raises(PipelineGraphError, match="quarantine_path must differ from the sink's path"):
        q.validate()
    ok = Pipeline("gated3")
    src = ok.source("src", lambda spark: spark.readStream.format("rate").load())
    ok.sink("rows", [src], postgres=PostgresTarget(table="t", dsn="postgresql://x@127.0.0.1/db"),
            gate=Gate(policy="rollback_and_stop", timeout=None))
    assert ok.validate().stage("rows").gate == Gate(policy="rollback_and_stop", timeout=None)
