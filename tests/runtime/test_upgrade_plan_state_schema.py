"""``airflow-arroyo upgrade-plan --check-state-schema`` on real Spark: an epoch of a ``dropDuplicates`` keyed by one
column against new code keying it by two is *incompatible*, naming the stage, the operator and both key schemas, in
the table and the JSON (without the option the same plan says *restored*: only the driver would refuse it); a
compatible change (a filter upstream) is *restored*. The dry run writes nothing: the storage tree and every store
row of the pipeline are the same before and after. ``airflow-arroyo upgrade --check-state-schema`` refuses the
incompatible code at its first plan step, the old code still running and not asked to stop."""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import psycopg2
import pytest

from airflow_arroyo.core.epochs import EpochState, PipelineState
from airflow_arroyo.core.exceptions import ConfigurationError, PipelineFailedError, UnknownPipelineError
from airflow_arroyo.runtime.driver import PipelineDriver
from airflow_arroyo.runtime.pipeline import Pipeline
from airflow_arroyo.store import EpochStore
from airflow_arroyo.testing import CheckpointTicker, DriverThread, wait_for
from tests.controlplane.test_cli import run

from .test_state_schema_restore import dedup_after_a_filter, dedup_by_two_keys, tree, version
from .test_upgrade_restore import dedup, source

pytestmark = [pytest.mark.spark]

MODULE = __name__
_RUN: dict[str, Any] = {}  # the pipeline id and folder of this module's run: the new code below is built for them


def refused_code() -> Pipeline:
    return version(_RUN["pid"], _RUN["root"], dedup_by_two_keys)


def compatible_code() -> Pipeline:
    return version(_RUN["pid"], _RUN["root"], dedup_after_a_filter)


def store_rows(dsn: str, pid: str) -> dict[str, list[str]]:
    """Every row of every store table with a pipeline_id column that belongs to ``pid``, as text."""
    with psycopg2.connect(dsn) as conn, conn.cursor() as cur:
        cur.execute("SELECT table_name FROM information_schema.columns WHERE column_name = 'pipeline_id' "
                    "AND table_schema = current_schema() ORDER BY table_name")
        tables = [t for (t,) in cur.fetchall()]
        out = {}
        for table in tables:
            cur.execute(f"SELECT * FROM {table} WHERE pipeline_id = %s", (pid,))  # noqa: S608 - catalog's names
            out[table] = sorted(repr(r) for r in cur.fetchall())
    conn.close()
    return out


def test_upgrade_plan_reports_a_changed_state_key_as_incompatible_and_writes_nothing(
        spark: Any, module_store: EpochStore, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pid = f"plan-schema-{uuid.uuid4().hex[:6]}"
    _RUN.update(pid=pid, root=tmp_path)
    storage = tmp_path / "storage"

    def completed() -> list[int]:
        try:
            return [e.epoch for e in module_store.list_epochs(pid, states=[EpochState.COMPLETED])]
        except UnknownPipelineError:
            return []

    old = DriverThread(PipelineDriver(version(pid, tmp_path, dedup), module_store, storage_uri=str(storage),
                                      spark=spark)).start()
    with CheckpointTicker(module_store, pid, interval=1.0):
        wait_for(lambda: old.error or len(completed()) >= 2, timeout=240, what="two epochs of the old code")
        # the one-step upgrade with the check refuses at its first plan step: the old code is not asked to stop
        code, out, err = run(capsys, "--dsn", module_store.dsn, "upgrade", pid, "--pipeline-module",
                             f"{MODULE}:refused_code", "--check-state-schema", "--wait", "30s")
        assert (code, out) == (2, ""), (out, err)
        assert f"upgrade of pipeline {pid!r} stopped at step 'plan'" in err
        assert "stage 'dedup' incompatible: state changed shape" in err and "the old code still runs" in err
        record = module_store.get_pipeline(pid)
        assert (record.state, record.stop_requested, old.error) == (PipelineState.RUNNING, None, None)
        assert all(e.pin_label is None for e in module_store.list_epochs(pid))
    module_store.request_stop(pid, "graceful")
    assert old.join(240).state is PipelineState.STOPPED
    epoch = max(completed())
    files, rows = tree(storage), store_rows(module_store.dsn, pid)
    assert any("/state/" in f for f, _ in files)

    base = ("--dsn", module_store.dsn, "upgrade-plan", pid, "--epoch", str(epoch))
    code, out, err = run(capsys, *base, "--pipeline-module", f"{MODULE}:refused_code")
    assert (code, err) == (0, ""), err  # the store alone cannot tell: the stage's state is not looked at
    assert next(line for line in out.splitlines() if line.startswith("dedup ")).split()[:2] == ["dedup", "restored"]

    code, out, err = run(capsys, *base, "--pipeline-module", f"{MODULE}:refused_code", "--check-state-schema")
    assert code == 2, (out, err)
    row = next(line for line in out.splitlines() if line.startswith("dedup "))
    assert "incompatible (refused)" in row
    assert (f"state changed shape since epoch {epoch}: state operator 0 (dedupe): key schema (k: long) in the "
            "epoch, (k: long, j: long) in the new code") in row
    assert "state schemas checked: dedup " in out and "refused: dedup " in out

    code, out, _ = run(capsys, *base, "--pipeline-module", f"{MODULE}:refused_code", "--check-state-schema",
                       "--json")
    plan = json.loads(out)
    stages = {r["stage"]: r for r in plan["stages"]}
    assert (code, plan["restores"], plan["state_schema_checked"]) == (2, False, ["dedup"])
    assert (stages["dedup"]["action"], stages["dedup"]["refused"], stages["dedup"]["snapshot"]) == (
        "incompatible", True, "dedup")
    assert "state operator 0 (dedupe): key schema (k: long)" in stages["dedup"]["reason"]
    assert {s: r["action"] for s, r in stages.items() if s != "dedup"} == {"src": "restored", "out": "restored"}

    code, out, _ = run(capsys, *base, "--pipeline-module", f"{MODULE}:compatible_code", "--check-state-schema",
                       "--json")
    plan = json.loads(out)
    assert (code, plan["restores"], plan["state_schema_checked"]) == (0, True, ["dedup"])
    assert {r["stage"]: r["action"] for r in plan["stages"]} == {"src": "restored", "dedup": "restored",
                                                                  "out": "restored"}

    assert tree(storage) == files  # no checkpoint folder, channel or snapshot object written
    assert store_rows(module_store.dsn, pid) == rows


def fused(pid: str, root: Path, code: Any) -> Pipeline:
    """``version``'s graph run as one query: src~dedup~out."""
    p = Pipeline(pid, chaining=True)
    src = p.source("src", source)
    seen = p.stage("dedup", code, [src])
    p.sink("out", [seen], format="json", options={"path": str(root / "out")})
    return p


class _Registered(Exception):
    """Raised at the driver's first step after its restore plan: the plan admitted the code."""


def test_the_driver_checks_a_fused_query_restored_with_the_same_fusion(
        spark: Any, module_store: EpochStore, tmp_path: Path) -> None:
    pid = f"fused-schema-{uuid.uuid4().hex[:6]}"
    storage = str(tmp_path / "storage")

    def completed() -> list[int]:
        try:
            return [e.epoch for e in module_store.list_epochs(pid, states=[EpochState.COMPLETED])]
        except UnknownPipelineError:
            return []

    old = DriverThread(PipelineDriver(fused(pid, tmp_path, dedup), module_store, storage_uri=storage,
                                      spark=spark)).start()
    with CheckpointTicker(module_store, pid, interval=1.0):
        wait_for(lambda: old.error or len(completed()) >= 2, timeout=240, what="two epochs of the fused old code")
    module_store.request_stop(pid, "graceful")
    assert old.join(240).state is PipelineState.STOPPED
    epoch = max(completed())
    assert module_store.get_epoch(pid, epoch).stages == ["src~dedup~out"]
    files, rows = tree(tmp_path / "storage"), store_rows(module_store.dsn, pid)

    with pytest.raises(ConfigurationError, match=(
            r"stage 'src~dedup~out' incompatible: state changed shape since epoch \d+: state operator 0 \(dedupe\): "
            r"key schema \(k: long\) in the epoch, \(k: long, j: long\) in the new code")):
        PipelineDriver(fused(pid, tmp_path, dedup_by_two_keys), module_store, storage_uri=storage, spark=spark,
                       restore_from=epoch).run()
    assert tree(tmp_path / "storage") == files
    assert store_rows(module_store.dsn, pid) == rows

    def stop_at(step: str) -> None:
        if step == "registered":
            raise _Registered

    compatible = PipelineDriver(fused(pid, tmp_path, dedup_after_a_filter), module_store, storage_uri=storage,
                                spark=spark, restore_from=epoch)
    compatible.on_step = stop_at
    with pytest.raises(PipelineFailedError, match="_Registered"):  # schemas compared, admitted: it registered
        compatible.run()
