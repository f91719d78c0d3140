"""Commit gates from Airflow (issue 33): the Asset watcher of pending gates, the sensor, the check and verdict
operators, in real Airflow (``dag.test()`` on a real metadata DB) against a real epoch store and a real target
PostgreSQL database. No Spark: gates are opened in the store as the driver opens them, over a pending table shaped
like the PostgreSQL sink's (the target's columns and ``_arroyo_batch``) holding batches inside and outside the
gate's range."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import psycopg2
import pytest
from airflow.sdk.exceptions import AirflowFailException, AirflowSkipException, TaskDeferred

from airflow_arroyo.assets import gate_asset, pending_gates
from airflow_arroyo.core.exceptions import ConfigurationError
from airflow_arroyo.core.gates import GatePolicy, GateState, PendingOutput, record_verdict
from airflow_arroyo.hooks import arroyo as hook_module
from airflow_arroyo.operators.gates import EpochGateCheckOperator, RecordGateVerdictOperator, sql_check_verdict
from airflow_arroyo.sensors.gates import PendingGateSensor
from airflow_arroyo.store import AsyncEpochStore, EpochStore
from airflow_arroyo.testing import wait_for
from airflow_arroyo.triggers import gates as gate_triggers
from airflow_arroyo.triggers.asset_cursor import CURSOR_KEY
from airflow_arroyo.triggers.gates import GateOpenedTrigger, PendingGateTrigger
from tests.controlplane.test_store import complete
from tests.support import running

PID = "orders"
SINK = "orders_pg"
STORE_CONN = "arroyo_gates_test"
TARGET_CONN = "orders_db"
PENDING = "arroyo_sink_pending_t"
DETAILS = {"kind": "postgres", "schema": "public", "pending_table": PENDING, "target": "orders",
           "columns": ["order_id", "customer", "amount"], "batch_column": "_arroyo_batch"}
FILES = {"kind": "files", "format": "parquet", "files": ["file:///lake/report/_arroyo_sink/pending/2/p-0.parquet",
                                                         "file:///lake/report/_arroyo_sink/pending/3/p-0.parquet"],
         "rows": 7}
# The epoch under a gate covers batches 2-3 (order ids 3, 4, 5; customer of 5 missing); batches 0-1 committed
# before it, batch 4 belongs to a later epoch.
ROWS = [(1, "a", 10, 0), (2, "b", 20, 1), (3, "c", 30, 2), (4, "d", 40, 2), (5, None, 50, 3), (6, None, 60, 4)]
GATE_BATCHES = (2, 3)
EXACTLY_THE_EPOCH = ("SELECT count(*) = 3, sum(amount) = 120, min(order_id) = 3, max(order_id) = 5, "
                     "count(*) - count(customer) = 1 FROM pending")
NO_NULL_CUSTOMERS = "SELECT count(*) = count(customer) AS complete, count(*) AS rows FROM pending"
REAL_SLEEP = asyncio.sleep

pytestmark = pytest.mark.airflow


@pytest.fixture(autouse=True)
def fresh_shared_stores(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr("airflow_arroyo.triggers.settle.DEFER_SETTLE_S", 0.0)  # no scheduler to race here
    hook_module._reset_shared_stores()
    yield
    hook_module._reset_shared_stores()


@pytest.fixture
def target(pg_dsn: str) -> str:
    """The PostgreSQL sink's target database (not the store's): the pending table with rows of several batches."""
    with psycopg2.connect(pg_dsn) as conn, conn.cursor() as cur:
        cur.execute("CREATE TABLE arroyo_sink_pending_t (order_id bigint, customer text, amount bigint,"
                    " _arroyo_batch bigint NOT NULL, _arroyo_part int NOT NULL DEFAULT 0, _arroyo_seq bigint)")
        cur.executemany("INSERT INTO arroyo_sink_pending_t (order_id, customer, amount, _arroyo_batch)"
                        " VALUES (%s, %s, %s, %s)", ROWS)
    conn.close()
    return pg_dsn


@pytest.fixture
def conns(store: EpochStore, target: str, monkeypatch: pytest.MonkeyPatch) -> EpochStore:
    monkeypatch.setenv(f"AIRFLOW_CONN_{STORE_CONN.upper()}", store.dsn)
    monkeypatch.setenv(f"AIRFLOW_CONN_{TARGET_CONN.upper()}", target)
    return store


def pipeline(store: EpochStore, epochs: int = 2) -> list[int]:
    running(store, PID, stages=("orders", SINK))
    return [complete(store, PID) for _ in range(epochs)]


def open_gate(store: EpochStore, epoch: int, *, batches: tuple[int, int] = GATE_BATCHES, details: Any = None,
              policy: GatePolicy = GatePolicy.HOLD, timeout: float | None = 600.0, sink: str = SINK) -> None:
    store.open_gate(PID, sink, epoch, run_id="r1", uri="postgresql:public.orders", policy=policy,
                    batch_from=batches[0], batch_to=batches[1], details=details or DETAILS, timeout=timeout)


def check_op(task_id: str = "check", **kwargs: Any) -> EpochGateCheckOperator:
    kwargs.setdefault("sql", EXACTLY_THE_EPOCH)
    if "check" in kwargs:
        kwargs.pop("sql")
    else:
        kwargs.setdefault("conn_id", TARGET_CONN)
    return EpochGateCheckOperator(task_id=task_id, pipeline_id=PID, sink=SINK, arroyo_conn_id=STORE_CONN, **kwargs)


def target_rows(dsn: str) -> int:
    with psycopg2.connect(dsn) as conn, conn.cursor() as cur:
        cur.execute("SELECT count(*) FROM arroyo_sink_pending_t")
        (n,) = cur.fetchone()  # type: ignore[misc]
    conn.close()
    return int(n)


# --------------------------------------------------------------------------- the check operator (execute)


def test_a_sql_check_sees_exactly_the_epochs_pending_rows_and_records_a_pass(conns: EpochStore) -> None:
    e1, e2 = pipeline(conns)
    open_gate(conns, e2)
    result = check_op(epoch=e2).execute({})  # type: ignore[arg-type]
    gate = conns.get_gate(PID, SINK, e2)
    # the check's conditions hold only for the rows of batches 2-3: the rows before and after are not in the view
    assert (gate.state, gate.decided_by) == (GateState.PASSED, "adhoc_airflow.check")
    assert gate.reason == "check passed: (True, True, True, True, True)"
    assert result == [{"epoch": e2, "verdict": "passed", "reason": gate.reason, "by": "adhoc_airflow.check"}]
    assert e1 < e2


def test_a_failing_sql_check_records_failed_with_the_row_and_fails_the_task(conns: EpochStore) -> None:
    (e1,) = pipeline(conns, 1)
    open_gate(conns, e1)
    with pytest.raises(AirflowFailException, match=rf"epoch {e1} of sink 'orders_pg' failed its gate check"):
        check_op(sql=NO_NULL_CUSTOMERS, epoch=e1).execute({})  # type: ignore[arg-type]
    gate = conns.get_gate(PID, SINK, e1)
    assert (gate.state, gate.reason) == (GateState.FAILED, "check failed: column 1 of (False, 3)")
    # fail_task_on_failed_check=False: the verdict alone, the task succeeds
    (e2,) = [complete(conns, PID)]
    open_gate(conns, e2)
    result = check_op(sql=NO_NULL_CUSTOMERS, epoch=e2, fail_task_on_failed_check=False).execute({})  # type: ignore[arg-type]
    assert [r["verdict"] for r in result] == ["failed"] and conns.get_gate(PID, SINK, e2).state is GateState.FAILED


def test_the_checks_connection_is_read_write_again_after_a_check(conns: EpochStore, target: str) -> None:
    from airflow_arroyo.core.gates import pending_output

    (e1,) = pipeline(conns, 1)
    open_gate(conns, e1)
    conn = psycopg2.connect(target)
    try:
        assert pending_output(conns, PID, SINK, e1).query(conn, "SELECT count(*) FROM pending") == [(3,)]
        with conn.cursor() as cur:
            cur.execute("SHOW default_transaction_read_only")
            assert cur.fetchone() == ("off",)
    finally:
        conn.close()


def test_a_check_that_returns_no_row_fails() -> None:
    assert sql_check_verdict([]) == (False, "the check returned no row")
    assert sql_check_verdict([(1, "x", True)]) == (True, "check passed: (1, 'x', True)")
    assert sql_check_verdict([(0, None, True), (1, 1, 1)]) == (False, "check failed: columns 1, 2 of (0, None, True)")


@pytest.mark.parametrize("statement", [
    "INSERT INTO arroyo_sink_pending_t (order_id, amount, _arroyo_batch) VALUES (99, 1, 2) RETURNING true",
    "DELETE FROM pending RETURNING true",
    "CREATE TABLE sneaky (x int)",
    # its own COMMIT ends the read-only transaction, not the read-only session
    "COMMIT; DELETE FROM arroyo_sink_pending_t; SELECT true",
])
def test_a_check_that_tries_to_write_fails_and_records_nothing(conns: EpochStore, target: str, statement: str) -> None:
    (e1,) = pipeline(conns, 1)
    open_gate(conns, e1)
    with pytest.raises(psycopg2.errors.ReadOnlySqlTransaction):
        check_op(sql=statement, epoch=e1).execute({})  # type: ignore[arg-type]
    gate = conns.get_gate(PID, SINK, e1)
    assert (gate.state, gate.decided_by, gate.reason) == (GateState.PENDING, None, None)
    assert target_rows(target) == len(ROWS)


@pytest.mark.parametrize(("policy", "details"), [(GatePolicy.HOLD, DETAILS), (GatePolicy.ROLLBACK_AND_STOP, DETAILS),
                                                 (GatePolicy.QUARANTINE, FILES)])
def test_a_python_check_decides_under_each_policy(conns: EpochStore, policy: GatePolicy, details: Any) -> None:
    e1, e2 = pipeline(conns)
    open_gate(conns, e1, policy=policy, details=details)
    open_gate(conns, e2, policy=policy, details=details, batches=(4, 4))
    seen: list[PendingOutput] = []

    def check(out: PendingOutput) -> tuple[bool, str]:
        seen.append(out)
        return out.gate.epoch != e1, f"looked at batches {out.gate.batch_from}-{out.gate.batch_to}"

    result = check_op(check=check, epoch=f"{e1},{e2}", fail_task_on_failed_check=False).execute({})  # type: ignore[arg-type]
    assert [(r["epoch"], r["verdict"], r["reason"]) for r in result] == [
        (e1, "failed", "looked at batches 2-3"), (e2, "passed", "looked at batches 4-4")]
    assert [(g.state, g.policy) for g in conns.list_gates(PID)] == [(GateState.FAILED, policy),
                                                                    (GateState.PASSED, policy)]
    assert {o.kind for o in seen} == {details["kind"]}
    if details is FILES:
        assert seen[0].files == tuple(FILES["files"]) and seen[0].rows == 7


def test_a_gate_past_its_timeout_still_takes_a_checks_pass(conns: EpochStore) -> None:
    (e1,) = pipeline(conns, 1)
    open_gate(conns, e1, timeout=0.2)
    wait_for(lambda: conns.db_now() > conns.get_gate(PID, SINK, e1).deadline, what="the gate's deadline")  # type: ignore[operator]
    assert conns.time_out_gate(PID, SINK, e1).state is GateState.TIMED_OUT  # the driver's part
    check_op(epoch=e1).execute({})  # type: ignore[arg-type]
    assert conns.get_gate(PID, SINK, e1).state is GateState.PASSED  # a late pass releases a held epoch


def test_which_epochs_events_else_the_oldest_pending_gate_and_others_verdicts_stand(conns: EpochStore) -> None:
    e1, e2, e3 = pipeline(conns, 3)
    for e in (e1, e2, e3):
        open_gate(conns, e)
    # the triggering events of the gate Asset name e2 (twice: a repeated announcement) and another sink's gate
    events = {"asset": [{"extra": {"payload": {"kind": "gate", "pipeline_id": PID, "sink": SINK, "epoch": e2}}},
                        {"extra": {"payload": {"kind": "gate", "pipeline_id": PID, "sink": SINK, "epoch": e2,
                                               "repeat": True}}},
                        {"extra": {"payload": {"kind": "gate", "pipeline_id": PID, "sink": "other", "epoch": e3}}}]}
    result = check_op().execute({"triggering_asset_events": events})  # type: ignore[arg-type]
    assert [r["epoch"] for r in result] == [e2]
    # no events: the oldest pending gate
    assert [r["epoch"] for r in check_op().execute({})] == [e1]  # type: ignore[arg-type]
    # a person failed e3 after a look: the check does not overrule them, and with nothing checked the task skips
    record_verdict(conns, PID, SINK, e3, passed=False, by="ana", reason="looked: wrong currency")
    with pytest.raises(AirflowSkipException, match=f"the gate of epoch {e3} is failed by ana: not checked"):
        check_op(epoch=e3).execute({})  # type: ignore[arg-type]
    assert conns.get_gate(PID, SINK, e3).decided_by == "ana"
    with pytest.raises(AirflowSkipException, match="no gate of sink 'orders_pg'"):
        check_op().execute({})  # type: ignore[arg-type]


def test_a_retry_of_a_failed_check_fails_again_without_checking_again(conns: EpochStore) -> None:
    (e1,) = pipeline(conns, 1)
    open_gate(conns, e1)
    calls: list[int] = []

    def check(out: PendingOutput) -> bool:
        calls.append(out.gate.epoch)
        return False

    for _ in range(2):
        with pytest.raises(AirflowFailException, match="check returned False"):
            check_op(check=check, epoch=e1).execute({})  # type: ignore[arg-type]
    assert calls == [e1]


@pytest.mark.parametrize(("kwargs", "needle"), [
    ({}, "give exactly one check"),
    ({"sql": "SELECT 1", "check": bool}, "give exactly one check"),
    ({"sql": "SELECT 1"}, "give conn_id="),
    ({"check": "not callable"}, "check must be a callable"),
    ({"check": bool, "epoch": "zero"}, "epoch must be an epoch number"),
])
def test_bad_arguments_fail_when_the_dag_is_parsed(kwargs: dict[str, Any], needle: str) -> None:
    with pytest.raises(ConfigurationError, match=needle) as info:
        EpochGateCheckOperator(task_id="check_orders", pipeline_id=PID, sink=SINK, **kwargs)
    assert str(info.value).startswith("task 'check_orders': ")
    with pytest.raises(ConfigurationError, match="passed must be True or False"):
        RecordGateVerdictOperator(task_id="v", pipeline_id=PID, sink=SINK, epoch=1, passed="maybe")


def test_record_gate_verdict_operator(conns: EpochStore) -> None:
    e1, e2 = pipeline(conns)
    open_gate(conns, e1)
    op = RecordGateVerdictOperator(task_id="approve", pipeline_id=PID, sink=SINK, epoch=str(e1), passed="true",
                                   reason="looked at it", arroyo_conn_id=STORE_CONN)
    assert op.execute({}) == {"epoch": e1, "verdict": "passed", "reason": "looked at it",  # type: ignore[arg-type]
                              "by": "adhoc_airflow.approve"}
    late = RecordGateVerdictOperator(task_id="late", pipeline_id=PID, sink=SINK, epoch=e1, passed=False,
                                     arroyo_conn_id=STORE_CONN)
    with pytest.raises(AirflowFailException, match="is passed by adhoc_airflow.approve: it cannot become failed"):
        late.execute({})  # type: ignore[arg-type]
    assert conns.get_gate(PID, SINK, e1).state is GateState.PASSED
    assert e2 > e1


# --------------------------------------------------------------------------- the Asset watcher


class StateStore:
    """Stands in for the Asset state store Airflow >= 3.3 injects into event triggers."""

    def __init__(self) -> None:
        self.values: dict[str, Any] = {}

    async def aget(self, key: str, default: Any = None) -> Any:
        return self.values.get(key, default)

    async def aset(self, key: str, value: Any) -> None:
        self.values[key] = value


async def collect(trigger: Any, store: EpochStore, between: list[Any], count: int) -> list[dict[str, Any]]:
    """Run ``trigger`` until ``count`` events; each of its sleeps runs the next step of ``between``."""
    steps = iter(between)

    async def sleep(seconds: float, *args: Any) -> None:
        await asyncio.to_thread(next(steps, lambda: None))
        await REAL_SLEEP(0)

    async def open_store() -> AsyncEpochStore:
        return AsyncEpochStore(store)

    trigger._open_store = open_store
    out = []
    with mock.patch.object(gate_triggers.asyncio, "sleep", sleep):
        gen = trigger.run()
        try:
            while len(out) < count:
                out.append(dict((await asyncio.wait_for(anext(gen), 30)).payload))
        finally:
            await gen.aclose()
    return out


async def test_the_watcher_announces_each_opened_gate_once_and_resumes_after_its_cursor(store: EpochStore) -> None:
    e1, e2, e3, e4, e5 = pipeline(store, 5)
    open_gate(store, e1)
    record_verdict(store, PID, SINK, e1, passed=True, by="check")  # decided before the watcher started: history
    open_gate(store, e2)  # pending when it starts: announced (it waits for a verdict)
    state = StateStore()
    trigger = GateOpenedTrigger(PID, SINK, conn_id="x")
    trigger.asset_state_store = state  # type: ignore[assignment]

    def e3_opens_and_is_decided_at_once() -> None:
        open_gate(store, e3)
        record_verdict(store, PID, SINK, e3, passed=False, by="ana")

    events = await collect(trigger, store, [lambda: open_gate(store, e3, sink="other"), e3_opens_and_is_decided_at_once,
                                            lambda: open_gate(store, e4)], 2)
    assert [(e["kind"], e["epoch"], e["sink"], e["batch_from"], e["batch_to"], e["policy"]) for e in events] == [
        ("gate", e2, SINK, 2, 3, "hold"), ("gate", e4, SINK, 2, 3, "hold")]
    gate = store.get_gate(PID, SINK, e2)
    assert events[0]["deadline"] == gate.deadline.isoformat() and events[0]["seq"] == gate.seq  # type: ignore[union-attr]
    assert events[0]["uri"] == "postgresql:public.orders" and events[0]["output"] == "postgres"
    # the cursor moved once the triggerer took an event (past e3's gate, skipped); e4's not yet
    assert state.values[CURSOR_KEY] == store.get_gate(PID, SINK, e3).seq
    open_gate(store, e5)
    again = GateOpenedTrigger(PID, SINK, conn_id="x")
    again.asset_state_store = state  # type: ignore[assignment]
    assert [e["epoch"] for e in await collect(again, store, [], 2)] == [e4, e5]  # at least once, then the new one


async def test_a_still_pending_last_gate_is_announced_once_more_after_a_quiet_while(store: EpochStore) -> None:
    e1, e2 = pipeline(store, 2)
    trigger = GateOpenedTrigger(PID, SINK, conn_id="x")
    noop = lambda: None  # noqa: E731
    events = await collect(trigger, store, [lambda: open_gate(store, e1), noop, noop, noop, noop,
                                            lambda: open_gate(store, e2)], 3)
    assert [(e["epoch"], e.get("repeat", False)) for e in events] == [(e1, False), (e1, True), (e2, False)]
    # a decided gate is not repeated
    record_verdict(store, PID, SINK, e2, passed=True, by="check")
    state = StateStore()
    state.values[CURSOR_KEY] = store.get_gate(PID, SINK, e1).seq
    later = GateOpenedTrigger(PID, SINK, conn_id="x")
    later.asset_state_store = state  # type: ignore[assignment]
    (e3,) = [complete(store, PID)]
    steps = [noop] * 6 + [lambda: open_gate(store, e3)]
    assert [(e["epoch"], e.get("repeat", False)) for e in await collect(later, store, steps, 1)] == [(e3, False)]


def test_the_gate_asset_and_the_consumer_helper() -> None:
    asset = gate_asset(PID, SINK, conn_id="c", poll_interval=2.0)
    assert (asset.name, asset.uri) == (f"arroyo-{PID}-{SINK}-gates", f"x-arroyo://{PID}/gates/{SINK}")
    assert asset.extra["arroyo"] == {"pipeline_id": PID, "kind": "gate", "sink": SINK, "conn_id": "c"}
    (watcher,) = asset.watchers
    classpath, kwargs = watcher.trigger.serialize()
    assert classpath == "airflow_arroyo.triggers.gates.GateOpenedTrigger"
    assert GateOpenedTrigger(**kwargs).serialize() == (classpath, kwargs)
    classpath, kwargs = PendingGateTrigger(PID, SINK, conn_id="c", after_epoch=3, not_before=1.0).serialize()
    assert PendingGateTrigger(**kwargs).serialize() == (classpath, kwargs)
    events = [{"extra": {"payload": {"kind": "gate", "pipeline_id": PID, "sink": SINK, "epoch": 4}}},
              {"extra": {"payload": {"kind": "sink", "epoch": 2}}},
              {"extra": {"payload": {"kind": "gate", "pipeline_id": PID, "sink": SINK, "epoch": 3}}}]
    assert [g["epoch"] for g in pending_gates(events)] == [3, 4]


# --------------------------------------------------------------------------- the sensor


class _TI:
    def __init__(self) -> None:
        self.xcom: dict[str, Any] = {}

    def xcom_push(self, key: str, value: Any) -> None:
        self.xcom[key] = value


async def test_the_sensors_trigger_fires_when_a_gate_after_the_epoch_opens(store: EpochStore) -> None:
    e1, e2 = pipeline(store, 2)
    open_gate(store, e1)
    trigger = PendingGateTrigger(PID, SINK, conn_id="x", after_epoch=e1, poll_interval=1.0)
    noop = lambda: None  # noqa: E731
    (event,) = await collect(trigger, store, [noop, lambda: open_gate(store, e2, sink="other"),
                                              lambda: open_gate(store, e2)], 1)
    assert event["status"] == "success" and (event["gate"]["epoch"], event["gate"]["sink"]) == (e2, SINK)


def test_the_sensor_returns_a_pending_gate_at_once_or_defers(conns: EpochStore) -> None:
    (e1,) = pipeline(conns, 1)
    sensor = PendingGateSensor(task_id="wait_gate", pipeline_id=PID, sink=SINK, conn_id=STORE_CONN, deferrable=True)
    with pytest.raises(TaskDeferred) as deferred:
        sensor.execute({"ti": _TI()})  # type: ignore[arg-type]
    assert isinstance(deferred.value.trigger, PendingGateTrigger) and deferred.value.trigger.sink == SINK
    open_gate(conns, e1)
    ti = _TI()
    assert sensor.execute({"ti": ti})["epoch"] == e1 and ti.xcom["epoch"] == e1  # type: ignore[arg-type]
    later = PendingGateSensor(task_id="w", pipeline_id=PID, sink=SINK, conn_id=STORE_CONN, after_epoch=e1,
                              deferrable=False, poke_interval=0.05)
    assert later.poke({"ti": _TI()}) is False  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="after_epoch must be"):
        PendingGateSensor(task_id="w", pipeline_id=PID, sink=SINK, after_epoch="-1")


# --------------------------------------------------------------------------- real Airflow: dag.test()

DAG_FILE = """
from airflow.sdk import DAG

from airflow_arroyo.operators.gates import EpochGateCheckOperator
from airflow_arroyo.sensors.gates import PendingGateSensor

with DAG(dag_id="arroyo_gate_check_test", schedule=None, params={{"sql": "SELECT 1"}}) as dag:
    wait = PendingGateSensor(task_id="wait_gate", pipeline_id="{pid}", sink="{sink}", conn_id="{store}",
                             deferrable=True, trigger_poll_interval=0.1, timeout=120)
    check = EpochGateCheckOperator(task_id="check", pipeline_id="{pid}", sink="{sink}", arroyo_conn_id="{store}",
                                   conn_id="{target}", sql="{{{{ params.sql }}}}",
                                   epoch="{{{{ ti.xcom_pull(task_ids='wait_gate', key='epoch') }}}}")
    wait >> check
"""


@pytest.fixture
def gate_dag(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """The DAG above as a file in a DAG bundle of its own (dag.test() runs only DAGs of a bundle)."""
    folder = tmp_path / "dags"
    folder.mkdir()
    path = folder / "arroyo_gate_check_test.py"
    path.write_text(DAG_FILE.format(pid=PID, sink=SINK, store=STORE_CONN, target=TARGET_CONN))
    local = "airflow.dag_processing.bundles.local.LocalDagBundle"
    monkeypatch.setenv("AIRFLOW__DAG_PROCESSOR__DAG_BUNDLE_CONFIG_LIST", json.dumps([
        {"name": "dags-folder", "classpath": local, "kwargs": {}},
        {"name": "arroyo-gate-tests", "classpath": local, "kwargs": {"path": str(folder)}},
    ]))
    spec = importlib.util.spec_from_file_location("arroyo_gate_check_test", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return next(v for v in vars(module).values() if type(v).__name__ == "DAG")


def _task_states(run: Any) -> dict[str, str]:
    return {ti.task_id: str(ti.state) for ti in run.get_task_instances()}


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.usefixtures("airflow_db")
def test_dag_test_waits_for_the_gate_checks_it_and_records_a_pass(gate_dag: Any, conns: EpochStore,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The sensor defers (no gate yet), a gate opens while its trigger waits, the check passes it."""
    (e1,) = pipeline(conns, 1)
    waiting = threading.Event()  # the sensor's trigger runs: the sensor deferred
    real_run = PendingGateTrigger.run

    async def observed_run(self: PendingGateTrigger) -> Any:
        waiting.set()
        async for event in real_run(self):
            yield event

    monkeypatch.setattr(PendingGateTrigger, "run", observed_run)

    def driver() -> None:  # opens the gate once the sensor waits in its trigger
        if waiting.wait(120):
            open_gate(conns, e1)

    thread = threading.Thread(target=driver, daemon=True)
    thread.start()
    run = gate_dag.test(run_conf={"sql": EXACTLY_THE_EPOCH})
    thread.join(5)
    assert waiting.is_set()
    assert _task_states(run) == {"wait_gate": "success", "check": "success"}
    gate = conns.get_gate(PID, SINK, e1)
    assert (gate.state, gate.decided_by) == (GateState.PASSED, f"{gate_dag.dag_id}.check")


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.usefixtures("airflow_db")
def test_dag_test_a_failed_check_records_failed_and_fails_the_task(gate_dag: Any, conns: EpochStore) -> None:
    (e1,) = pipeline(conns, 1)
    open_gate(conns, e1)
    run = gate_dag.test(run_conf={"sql": NO_NULL_CUSTOMERS})
    assert _task_states(run) == {"wait_gate": "success", "check": "failed"}
    gate = conns.get_gate(PID, SINK, e1)
    assert (gate.state, gate.decided_by, gate.reason) == (GateState.FAILED, f"{gate_dag.dag_id}.check",
                                                          "check failed: column 1 of (False, 3)")


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.usefixtures("airflow_db")
def test_dag_test_a_check_that_writes_fails_and_records_nothing(gate_dag: Any, conns: EpochStore,
                                                                target: str) -> None:
    (e1,) = pipeline(conns, 1)
    open_gate(conns, e1)
    run = gate_dag.test(run_conf={"sql": "DELETE FROM pending RETURNING true"})
    assert _task_states(run) == {"wait_gate": "success", "check": "failed"}
    assert conns.get_gate(PID, SINK, e1).state is GateState.PENDING
    assert target_rows(target) == len(ROWS)


# --------------------------------------------------------------------------- the example DAGs

DAGS = Path(__file__).resolve().parents[2] / "dags"


def test_the_example_dags_import_and_fit_the_gated_pipeline() -> None:
    import inspect

    from airflow.dag_processing.dagbag import DagBag

    from airflow_arroyo.examples.gated import gated_orders

    for name in ("example_gated_pipeline", "example_gate_check"):
        bag = DagBag(dag_folder=str(DAGS / f"{name}.py"))
        assert bag.import_errors == {}
    producer = DagBag(dag_folder=str(DAGS / "example_gated_pipeline.py")).dags["example_gated_pipeline"]
    submit = producer.task_dict["submit"]
    assert submit.pipeline == "airflow_arroyo.examples.gated:gated_orders"
    assert producer.task_dict["create_table"].downstream_task_ids == {"submit"}
    inspect.signature(gated_orders).bind(**submit.pipeline_args)
    (sink,) = [s for s in gated_orders().validate().stage_names if s == "orders_pg"]
    consumer = DagBag(dag_folder=str(DAGS / "example_gate_check.py")).dags["example_gate_check"]
    check = consumer.task_dict["check_orders"]
    assert (check.pipeline_id, check.sink) == (submit.pipeline_id, sink)
    (asset,) = consumer.timetable.asset_condition.objects  # schedule=[asset]: all of one
    assert asset.uri == f"x-arroyo://{submit.pipeline_id}/gates/{sink}"
    assert isinstance(asset.watchers[0].trigger, GateOpenedTrigger)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.usefixtures("airflow_db")
def test_the_example_check_dag_passes_a_good_epoch_and_holds_a_bad_one(store: EpochStore,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The example's check in dag.test(), on the pending rows of a sink shaped like the example's (the table the
    PostgreSQL sink stages in, in the epoch store's database as in the example)."""
    from airflow_arroyo.examples.names import GATED_PIPELINE_ID, GATED_SINK

    monkeypatch.setenv("AIRFLOW_CONN_ARROYO_DEFAULT", store.dsn)
    with psycopg2.connect(store.dsn) as conn, conn.cursor() as cur:
        cur.execute("CREATE TABLE arroyo_sink_pending_g (order_id bigint, customer text, amount bigint,"
                    " _arroyo_batch bigint NOT NULL)")
        cur.executemany("INSERT INTO arroyo_sink_pending_g VALUES (%s, %s, %s, %s)",
                        [(1, "k1", 5, 0), (2, "k2", 7, 0), (3, "k3", 1, 1), (3, "k3", 1, 1)])  # batch 1: a duplicate
    conn.close()
    running(store, GATED_PIPELINE_ID, stages=("orders", GATED_SINK))
    e1, e2 = complete(store, GATED_PIPELINE_ID), complete(store, GATED_PIPELINE_ID)
    details = {**DETAILS, "pending_table": "arroyo_sink_pending_g"}
    for epoch, batch in ((e1, 0), (e2, 1)):
        store.open_gate(GATED_PIPELINE_ID, GATED_SINK, epoch, run_id="r1", uri="postgresql:arroyo_gated_orders",
                        policy=GatePolicy.HOLD, batch_from=batch, batch_to=batch, details=details, timeout=600)
    spec = importlib.util.spec_from_file_location("example_gate_check_under_test", DAGS / "example_gate_check.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)

    first = module.dag.test()  # no triggering events here: the oldest pending gate, e1
    assert _task_states(first) == {"check_orders": "success"}
    assert store.get_gate(GATED_PIPELINE_ID, GATED_SINK, e1).state is GateState.PASSED
    second = module.dag.test()
    assert _task_states(second) == {"check_orders": "failed"}
    gate = store.get_gate(GATED_PIPELINE_ID, GATED_SINK, e2)
    assert (gate.state, gate.decided_by, gate.reason) == (GateState.FAILED, "example_gate_check.check_orders",
                                                          "check failed: column 2 of (True, False, True)")
