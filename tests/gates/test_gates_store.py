"""Commit gates in the epoch store (a real PostgreSQL): opening, verdicts, timeouts, closing, what a restore does
to them and which epoch ``'latest'`` restores while one waits."""

from __future__ import annotations

import psycopg2.errors
import pytest

from airflow_arroyo.core.exceptions import NotFoundError, StateConflictError, UnknownPipelineError
from airflow_arroyo.core.gates import GatePolicy, GateState, pending_output, record_verdict
from airflow_arroyo.core.restores import read_restore_facts
from airflow_arroyo.runtime.decisions import RestoreAction, plan_restore
from airflow_arroyo.store import EpochStore
from airflow_arroyo.testing import wait_for
from tests.controlplane.test_store import complete
from tests.support import running, sql

FILES = {"kind": "files", "format": "json", "files": ["file:///tmp/x/part-0.json"], "rows": 3}


def _pipeline(store: EpochStore, pid: str, epochs: int) -> list[int]:
    running(store, pid, stages=("src", "out"))
    return [complete(store, pid) for _ in range(epochs)]


def _open(store: EpochStore, pid: str, epoch: int, *, timeout: float | None = 600.0, batches: tuple[int, int] = (0, 1),
          sink: str = "out") -> None:
    store.open_gate(pid, sink, epoch, run_id="r1", uri="file:///tmp/x", policy=GatePolicy.HOLD,
                    batch_from=batches[0], batch_to=batches[1], details=FILES, timeout=timeout)


def test_a_gate_opens_once_and_shows_its_pending_output(store: EpochStore) -> None:
    (e1,) = _pipeline(store, "g-open", 1)
    _open(store, "g-open", e1)
    _open(store, "g-open", e1, batches=(5, 9))  # a repeat (a driver that died after opening) changes nothing
    gate = store.get_gate("g-open", "out", e1)
    assert (gate.state, gate.batch_from, gate.batch_to, gate.policy) == (GateState.PENDING, 0, 1, GatePolicy.HOLD)
    assert gate.deadline is not None and gate.deadline > gate.opened_at
    out = pending_output(store, "g-open", "out", e1)
    assert (out.kind, out.files, out.format, out.rows) == ("files", ("file:///tmp/x/part-0.json",), "json", 3)
    with pytest.raises(NotFoundError, match="no gate of sink 'out' for epoch 99"):
        store.get_gate("g-open", "out", 99)
    with pytest.raises(UnknownPipelineError):
        store.get_gate("nobody", "out", 1)


def test_verdicts_follow_the_gate_life_cycle(store: EpochStore) -> None:
    e1, e2 = _pipeline(store, "g-verdict", 2)
    _open(store, "g-verdict", e1)
    _open(store, "g-verdict", e2, batches=(2, 3))
    failed = record_verdict(store, "g-verdict", "out", e1, passed=False, by="check_rows", reason="3 null keys")
    assert (failed.state, failed.decided_by, failed.reason) == (GateState.FAILED, "check_rows", "3 null keys")
    assert failed.decided_at is not None
    # a person's approval after a look: a failed gate may still pass
    passed = record_verdict(store, "g-verdict", "out", e1, passed=True, by="ana")
    assert (passed.state, passed.decided_by) == (GateState.PASSED, "ana")
    assert record_verdict(store, "g-verdict", "out", e1, passed=True, by="bo").decided_by == "ana"  # a repeat: no-op
    with pytest.raises(StateConflictError, match="is passed by ana: it cannot become failed"):
        record_verdict(store, "g-verdict", "out", e1, passed=False, by="late check")
    store.close_gate("g-verdict", "out", e1, GateState.COMMITTED)
    with pytest.raises(StateConflictError, match="is committed"):
        pending_output(store, "g-verdict", "out", e1)
    with pytest.raises(StateConflictError, match="is committed"):
        record_verdict(store, "g-verdict", "out", e1, passed=False, by="x")
    with pytest.raises(StateConflictError, match="pending: it cannot become quarantined"):
        store.close_gate("g-verdict", "out", e2, GateState.QUARANTINED)
    assert [g.epoch for g in store.open_gates("g-verdict")] == [e2]
    assert [g.epoch for g in store.list_gates("g-verdict", states=[GateState.COMMITTED])] == [e1]


def test_a_verdict_needs_who_gave_it(store: EpochStore) -> None:
    (e1,) = _pipeline(store, "g-who", 1)
    _open(store, "g-who", e1)
    with pytest.raises(Exception, match="who gave it"):
        record_verdict(store, "g-who", "out", e1, passed=True, by="  ")
    assert store.get_gate("g-who", "out", e1).state is GateState.PENDING


def test_a_gate_times_out_only_after_its_deadline_and_a_verdict_that_came_first_wins(store: EpochStore) -> None:
    e1, e2 = _pipeline(store, "g-timeout", 2)
    _open(store, "g-timeout", e1, timeout=0.2)
    _open(store, "g-timeout", e2, timeout=0.2, batches=(2, 3))
    _open(store, "g-timeout", e2, timeout=None, sink="other", batches=(2, 3))
    assert store.time_out_gate("g-timeout", "out", e1).state is GateState.PENDING  # not yet
    record_verdict(store, "g-timeout", "out", e2, passed=True, by="check")
    wait_for(lambda: store.db_now() > store.get_gate("g-timeout", "out", e1).deadline, what="the deadline")  # type: ignore[operator]
    assert store.time_out_gate("g-timeout", "out", e1).state is GateState.TIMED_OUT
    assert store.time_out_gate("g-timeout", "out", e2).state is GateState.PASSED
    assert store.time_out_gate("g-timeout", "other", e2).state is GateState.PENDING  # no deadline
    late = record_verdict(store, "g-timeout", "out", e1, passed=True, by="ana", reason="checked by hand")
    assert late.state is GateState.PASSED


def test_latest_restores_behind_the_oldest_gate_without_a_pass_and_the_restore_settles_the_gates(
        store: EpochStore) -> None:
    e1, e2, e3, e4 = _pipeline(store, "g-restore", 4)
    for e in (e2, e3, e4):
        _open(store, "g-restore", e, batches=(e, e))
    record_verdict(store, "g-restore", "out", e2, passed=True, by="check")  # passed, not yet committed
    record_verdict(store, "g-restore", "out", e4, passed=True, by="check")  # passed, but behind e3
    assert store.gate_blocker("g-restore").epoch == e3  # type: ignore[union-attr]
    situation = read_restore_facts(store, "g-restore", "latest", ["src", "out"])
    plan = plan_restore(situation.facts)
    assert (plan.action, plan.epoch) == (RestoreAction.RESTORE, e2)
    with pytest.raises(StateConflictError, match=f"gate of sink 'out' for epoch {e3} is pending"):
        plan_restore(read_restore_facts(store, "g-restore", e4, ["src", "out"]).facts)
    store.register_pipeline("g-restore", stages=["src", "out"], run_id="r2", takeover=True)
    store.commit_restore("g-restore", "r2", e2)
    states = {g.epoch: g.state for g in store.list_gates("g-restore")}
    assert states == {e2: GateState.COMMITTED, e3: GateState.SUPERSEDED, e4: GateState.SUPERSEDED}
    assert store.gate_blocker("g-restore") is None
    assert e1 < e2


def test_the_database_refuses_gates_that_break_its_rules(store: EpochStore, migrated_dsn: str) -> None:
    (e1,) = _pipeline(store, "g-rules", 1)
    with pytest.raises(psycopg2.errors.CheckViolation):
        sql(migrated_dsn, "INSERT INTO arroyo_gates (pipeline_id, sink, epoch, run_id, uri, policy, batch_from,"
                          " batch_to) VALUES ('g-rules', 'out', %s, 'r', 'u', 'maybe', 0, 0)", (e1,))
    with pytest.raises(psycopg2.errors.CheckViolation):
        sql(migrated_dsn, "INSERT INTO arroyo_gates (pipeline_id, sink, epoch, run_id, uri, policy, batch_from,"
                          " batch_to, state) VALUES ('g-rules', 'out', %s, 'r', 'u', 'hold', 0, 0, 'failed')", (e1,))
