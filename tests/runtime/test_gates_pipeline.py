"""Commit gates on real Spark with a real epoch store: a checker thread plays the Airflow task (it reads exactly the
gate's pending output through :func:`pending_output` and records a verdict), the driver commits, holds, quarantines
or rolls back. Every test compares what readers see with the generator's ids, computed apart: each id once, and none
visible before its gate passed."""

from __future__ import annotations

import json
import os
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg2
import pytest

from airflow_arroyo.core.epochs import PipelineState
from airflow_arroyo.core.fs import FileSystem
from airflow_arroyo.core.gates import Gate, GateRecord, GateState, pending_output, record_verdict
from airflow_arroyo.runtime.driver import PipelineDriver
from airflow_arroyo.runtime.pipeline import Pipeline
from airflow_arroyo.runtime.sinks.postgres import PostgresTarget
from airflow_arroyo.store import EpochStore
from airflow_arroyo.testing import CheckpointTicker, DriverThread, generator_source, wait_for

pytestmark = [pytest.mark.spark]

ROWS = 360
PACE = 40  # rows per second: about nine seconds of input, so that epochs (every second) cut it into several gates

Decide = Callable[[GateRecord, list[int]], "bool | None"]


def json_ids(uris: list[str]) -> list[int]:
    out: list[int] = []
    for uri in uris:
        fs = FileSystem.from_uri(uri.rsplit("/", 1)[0])
        out += [json.loads(line)["id"] for line in fs.read_bytes(uri.rsplit("/", 1)[1]).decode().splitlines() if line]
    return out


def folder_ids(path: Path) -> list[int]:
    """What a reader of a file folder sees (hidden names skipped, as Spark and pyarrow do: pending batches are being
    written under them)."""
    out: list[int] = []
    for root, dirs, files in os.walk(path):
        dirs[:] = [d for d in dirs if not d.startswith(("_", "."))]
        for name in files:
            if not name.startswith(("_", ".")):
                out += [json.loads(line)["id"] for line in Path(root, name).read_text().splitlines() if line]
    return out


def table_ids(dsn: str, table: str) -> list[int]:
    conn = psycopg2.connect(dsn)
    try:
        with conn, conn.cursor() as cur:
            cur.execute(f"SELECT id FROM {table}")  # noqa: S608 - the test's own table name
            return [r[0] for r in cur.fetchall()]
    finally:
        conn.close()


@dataclass
class Seen:
    """One look of the checker at a gate: the ids it held, and what readers saw at that moment."""

    gate: GateRecord
    ids: list[int]
    visible: list[int]


@dataclass
class Checker:
    """Plays the Airflow check task: every pending gate of ``sink`` it has not looked at is read and decided."""

    store: EpochStore
    pipeline_id: str
    sink: str
    read: Callable[[GateRecord], list[int]]
    visible: Callable[[], list[int]]
    decide: Decide
    seen: list[Seen] = field(default_factory=list)
    errors: list[BaseException] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)

    def __enter__(self) -> Checker:
        self._thread = threading.Thread(target=self._run, daemon=True, name="gate-checker")
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)
        if self.errors:
            raise self.errors[0]

    def _run(self) -> None:
        looked: set[int] = set()
        while not self._stop.wait(0.1):
            try:
                for gate in self.store.list_gates(self.pipeline_id, sink=self.sink, states=[GateState.PENDING]):
                    if gate.epoch in looked:
                        continue
                    looked.add(gate.epoch)
                    visible = self.visible()
                    ids = self.read(gate)
                    self.seen.append(Seen(gate, ids, visible))
                    verdict = self.decide(gate, ids)
                    if verdict is not None:
                        record_verdict(self.store, self.pipeline_id, self.sink, gate.epoch, passed=verdict,
                                       by="checker", reason=None if verdict else f"{len(ids)} rows rejected")
            except BaseException as exc:  # noqa: BLE001 - re-raised in the test
                self.errors.append(exc)
                return


def files_pipeline(pid: str, out: Path, gate: Gate) -> Pipeline:
    p = Pipeline(pid)
    src = p.source("src", lambda spark: generator_source(spark, total_rows=ROWS, rows_per_second=PACE,
                                                          partitions=1).select("id", "value"))
    p.sink("out", [src], format="json", options={"path": str(out)}, gate=gate)
    return p


def run(driver: PipelineDriver, store: EpochStore, until: Callable[[], bool], *, what: str) -> Any:
    """Run ``driver`` with epochs every second until ``until()`` (or the driver ends), then stop it gracefully."""
    thread = DriverThread(driver).start()
    with CheckpointTicker(store, driver.pipeline_id, interval=1.0):
        wait_for(lambda: thread.error or not thread.thread.is_alive() or until(), timeout=240, what=what)
    if thread.thread.is_alive():
        store.request_stop(driver.pipeline_id, "graceful")
    return thread.join(240)


def assert_checks_saw_unseen_disjoint_output(seen: list[Seen]) -> None:
    """Each gate held ids nobody could read yet, and no two gates held the same id. A gate may hold nothing: an
    epoch whose cut covers only a micro-batch without rows (a first one that ran before the source had any)."""
    held: list[int] = []
    for s in seen:
        assert not set(s.ids) & set(s.visible), f"epoch {s.gate.epoch}'s output was visible before its verdict"
        held += s.ids
    assert held, "no gate held any row"
    assert len(held) == len(set(held))


def test_hold_commits_passed_epochs_in_order_and_a_persons_approval_releases_a_failed_one(
        spark: Any, module_store: EpochStore, tmp_path: Path) -> None:
    pid = f"gate-hold-{uuid.uuid4().hex[:6]}"
    out = tmp_path / "out"
    failed: list[GateRecord] = []

    def decide(gate: GateRecord, ids: list[int]) -> bool | None:
        if len(failed) == 0 and len(ids) > 0 and gate.epoch > 1:  # the first gate that is not the first epoch
            failed.append(gate)
            return False
        return True

    driver = PipelineDriver(files_pipeline(pid, out, Gate(policy="hold", timeout=None, max_waiting=50)), module_store,
                            storage_uri=str(tmp_path / "storage"), spark=spark)
    checker = Checker(module_store, pid, "out", lambda g: json_ids(list(pending_output(module_store, pid, "out",
                                                                                      g.epoch).files)),
                      lambda: folder_ids(out), decide)
    approved = threading.Event()

    def done() -> bool:
        if failed and not approved.is_set():
            behind = [g for g in module_store.list_gates(pid, sink="out") if g.epoch > failed[0].epoch]
            if not behind:
                return False
            # a later epoch is gated (it may have passed): none may commit while the failed one holds
            visible = set(folder_ids(out))
            assert not visible & {i for s in checker.seen if s.gate.epoch >= failed[0].epoch for i in s.ids}
            assert all(g.state is not GateState.COMMITTED for g in behind)
            record_verdict(module_store, pid, "out", failed[0].epoch, passed=True, by="ana", reason="looked: fine")
            approved.set()
        return len(folder_ids(out)) >= ROWS

    with checker:
        result = run(driver, module_store, done, what=f"{ROWS} rows committed")
    assert result.state is PipelineState.STOPPED and result.failure_cause is None
    assert sorted(folder_ids(out)) == list(range(ROWS))
    assert_checks_saw_unseen_disjoint_output(checker.seen)
    gates = module_store.list_gates(pid, sink="out")
    assert len(gates) >= 3 and all(g.state is GateState.COMMITTED for g in gates)
    approval = module_store.get_gate(pid, "out", failed[0].epoch)
    assert (approval.decided_by, approval.reason) == ("ana", "looked: fine")
    commits = module_store.sink_commits(pid)
    assert [c.epoch for c in commits] == sorted(c.epoch for c in commits)  # in epoch order, the failed one included
    # by the sink's own name, though it ran fused with its source: what sink_asset(pid, "out") and provenance ask
    assert driver.plan.groups[0].name == "src~out" and {c.sink for c in commits} == {"out"}
    assert failed[0].epoch in {c.epoch for c in commits}


def test_quarantine_sets_a_failed_and_a_timed_out_epoch_aside_and_commits_the_rest(
        spark: Any, module_store: EpochStore, tmp_path: Path) -> None:
    pid = f"gate-quarantine-{uuid.uuid4().hex[:6]}"
    out, quarantine = tmp_path / "out", tmp_path / "quarantine"
    verdicts: list[bool | None] = [False, None]  # the first gate fails, the second gets no verdict; then passes

    def decide(gate: GateRecord, ids: list[int]) -> bool | None:
        return verdicts.pop(0) if verdicts else True

    gate = Gate(policy="quarantine", quarantine_path=str(quarantine), timeout=3.0)
    driver = PipelineDriver(files_pipeline(pid, out, gate), module_store, storage_uri=str(tmp_path / "storage"),
                            spark=spark)
    checker = Checker(module_store, pid, "out", lambda g: json_ids(list(pending_output(module_store, pid, "out",
                                                                                      g.epoch).files)),
                      lambda: folder_ids(out), decide)
    with checker:
        result = run(driver, module_store, lambda: len(folder_ids(out)) + len(folder_ids(quarantine)) >= ROWS,
                     what=f"{ROWS} rows committed or quarantined")
    assert result.state is PipelineState.STOPPED and result.failure_cause is None
    committed, set_aside = folder_ids(out), folder_ids(quarantine)
    assert sorted(committed + set_aside) == list(range(ROWS))
    first, second = checker.seen[0], checker.seen[1]
    assert sorted(set_aside) == sorted(first.ids + second.ids)
    states = {g.epoch: g for g in module_store.list_gates(pid, sink="out")}
    assert states[first.gate.epoch].state is GateState.QUARANTINED
    assert "failed by checker: " in (states[first.gate.epoch].reason or "")
    assert states[second.gate.epoch].state is GateState.QUARANTINED
    assert states[second.gate.epoch].decided_by == "timeout"
    assert "no verdict came before its deadline" in (states[second.gate.epoch].reason or "")
    assert {c.epoch for c in module_store.sink_commits(pid)}.isdisjoint({first.gate.epoch, second.gate.epoch})
    assert_checks_saw_unseen_disjoint_output(checker.seen)


def test_rollback_and_stop_on_a_postgres_sink_then_a_restore_gives_every_row_once(
        spark: Any, module_store: EpochStore, tmp_path: Path) -> None:
    pid = f"gate-rollback-{uuid.uuid4().hex[:6]}"
    table = f"gated_{uuid.uuid4().hex[:8]}"
    dsn = module_store.dsn
    conn = psycopg2.connect(dsn)
    with conn, conn.cursor() as cur:
        cur.execute(f"CREATE TABLE {table} (id bigint NOT NULL, value bigint)")
    conn.close()

    def pipeline() -> Pipeline:
        p = Pipeline(pid)
        src = p.source("src", lambda spark: generator_source(spark, total_rows=ROWS, rows_per_second=PACE,
                                                              partitions=1).select("id", "value"))
        p.sink("out", [src], postgres=PostgresTarget(table=table, dsn=dsn), gate=Gate(policy="rollback_and_stop"))
        return p

    def read_pending(gate: GateRecord) -> list[int]:
        view = pending_output(module_store, pid, "out", gate.epoch)
        c = psycopg2.connect(dsn)
        try:
            return [r[0] for r in view.query(c, "SELECT id FROM pending")]
        finally:
            c.close()

    fail_at = 3  # the third gate with rows fails

    def decide(gate: GateRecord, ids: list[int]) -> bool | None:
        return not (ids and len([s for s in checker.seen if s.ids]) == fail_at)

    storage = tmp_path / "storage"
    checker = Checker(module_store, pid, "out", read_pending, lambda: table_ids(dsn, table), decide)
    with checker:
        first = run(PipelineDriver(pipeline(), module_store, storage_uri=str(storage), spark=spark), module_store,
                    lambda: False, what="the gate to stop the pipeline")
    assert first.state is PipelineState.STOPPED
    assert first.failure_cause is not None and "policy rollback_and_stop" in first.failure_cause
    passed = [s for s in checker.seen if s.ids][: fail_at - 1]
    # back to the last epoch before the failed one: exactly the rows of the gates that passed before it
    assert sorted(table_ids(dsn, table)) == sorted(i for s in passed for i in s.ids)
    assert_checks_saw_unseen_disjoint_output(checker.seen)

    checker2 = Checker(module_store, pid, "out", read_pending, lambda: table_ids(dsn, table), lambda g, ids: True)
    with checker2:
        second = run(PipelineDriver(pipeline(), module_store, storage_uri=str(storage), spark=spark,
                                    restore_from="latest"), module_store,
                     lambda: len(table_ids(dsn, table)) >= ROWS, what=f"{ROWS} rows in {table}")
    assert second.state is PipelineState.STOPPED and second.failure_cause is None
    assert second.restored_from_epoch is not None and second.restored_from_epoch < checker.seen[-1].gate.epoch
    assert sorted(table_ids(dsn, table)) == list(range(ROWS))
    states = {g.epoch: g.state for g in module_store.list_gates(pid, sink="out")}
    assert {states[s.gate.epoch] for s in checker.seen if s.gate.epoch > second.restored_from_epoch} == {
        GateState.SUPERSEDED}
