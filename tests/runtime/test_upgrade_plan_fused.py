"""The upgrade's dry runs plan the queries the driver will run (issue 32), on real Spark.

A default pipeline (``chaining=None``: ``src -> dedup -> out``, the ``dropDuplicates`` its one stateful stage) runs
fused as one query ``src~dedup~out`` and takes its epochs that way. Against new code keying the ``dropDuplicates``
by one more column, ``airflow-arroyo upgrade-plan --check-state-schema`` reports the fused query incompatible, naming
it, the state operator and both key schemas, and writes nothing (the storage tree and the store's rows of the
pipeline are the same before and after); the one-step upgrade with the check refuses at its first plan step while
the old code runs. Without the option the dry run cannot know which stages fuse and says that its plan is of the
logical stages. Against a compatible change (a filter upstream) the dry run's plan is the one the driver then
decides when it restores the epoch (its rows, and the queries the driver registers in the store). One run of the
old code serves every test (a module-scoped fixture)."""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import pytest

from airflow_arroyo.core.epochs import EpochState, PipelineState
from airflow_arroyo.core.exceptions import PipelineFailedError, UnknownPipelineError
from airflow_arroyo.core.upgrades import UpgradeRefused, prepare_upgrade
from airflow_arroyo.runtime.driver import PipelineDriver
from airflow_arroyo.runtime.pipeline import Pipeline
from airflow_arroyo.runtime.upgrade_evidence import spark_analysis
from airflow_arroyo.store import EpochStore
from airflow_arroyo.testing import CheckpointTicker, DriverThread, wait_for
from tests.controlplane.test_cli import run

from .test_state_schema_restore import dedup_after_a_filter, dedup_by_two_keys, tree
from .test_upgrade_plan_state_schema import store_rows
from .test_upgrade_restore import dedup, source

pytestmark = [pytest.mark.spark]

MODULE = __name__
FUSED = "src~dedup~out"
RENAMED = "src~dedup_v2~out"  # the fused query of the code whose stateful stage is renamed dedup_v2
_RUN: dict[str, Any] = {}  # the pipeline id and folder of this module's run: the new code below is built for them


def default(pid: str, root: Path, code: Callable[[Any], Any], *, name: str = "dedup",
            chaining: bool | None = None) -> Pipeline:
    """The pipeline with the default chaining (the graph decides): Spark's analyzer fuses it into src~dedup~out.
    A renamed stateful stage renames the fused query, which then writes a folder of its own (the driver refuses a
    folder another stage wrote: one folder, one writer)."""
    p = Pipeline(pid, chaining=chaining)
    src = p.source("src", source)
    seen = p.stage(name, code, [src])
    p.sink("out", [seen], format="json", options={"path": str(root / ("out" if name == "dedup" else f"out_{name}"))})
    return p


def refused_code() -> Pipeline:
    return default(_RUN["pid"], _RUN["root"], dedup_by_two_keys)


def compatible_code() -> Pipeline:
    return default(_RUN["pid"], _RUN["root"], dedup_after_a_filter)


def renamed_refused_code() -> Pipeline:
    return default(_RUN["pid"], _RUN["root"], dedup_by_two_keys, name="dedup_v2")


def renamed_compatible_code() -> Pipeline:
    return default(_RUN["pid"], _RUN["root"], dedup_after_a_filter, name="dedup_v2")


def unfused_compatible_code() -> Pipeline:
    """Every stage its own query: the epoch's fused query is split (restored-across-fusion)."""
    return default(_RUN["pid"], _RUN["root"], dedup_after_a_filter, chaining=False)


@dataclass(frozen=True)
class OldRun:
    pid: str
    root: Path
    epoch: int  # the latest completed epoch, taken fused
    upgrade_refusal: str  # what the one-step upgrade with the check said while the old code ran
    state_while_refused: tuple[PipelineState, str | None]  # the pipeline's state and stop request right after


@pytest.fixture(scope="module")
def old_run(spark: Any, module_store: EpochStore, tmp_path_factory: pytest.TempPathFactory) -> Iterator[OldRun]:
    pid = f"plan-fused-{uuid.uuid4().hex[:6]}"
    root = tmp_path_factory.mktemp("plan-fused")
    _RUN.update(pid=pid, root=root)

    def completed() -> list[int]:
        try:
            return [e.epoch for e in module_store.list_epochs(pid, states=[EpochState.COMPLETED])]
        except UnknownPipelineError:
            return []

    old = DriverThread(PipelineDriver(default(pid, root, dedup), module_store, storage_uri=str(root / "storage"),
                                      spark=spark)).start()
    with CheckpointTicker(module_store, pid, interval=1.0):
        wait_for(lambda: old.error or len(completed()) >= 2, timeout=240, what="two epochs of the fused old code")
        graph = refused_code().validate()
        with pytest.raises(UpgradeRefused) as refused:
            prepare_upgrade(module_store, pid, graph, chaining=None, stop_timeout=30,
                            analysis=lambda: spark_analysis(module_store, pid, graph))
        record = module_store.get_pipeline(pid)
        state = (record.state, record.stop_requested)
    module_store.request_stop(pid, "graceful")
    assert old.join(240).state is PipelineState.STOPPED
    yield OldRun(pid, root, max(completed()), str(refused.value), state)


def test_the_dry_run_reports_a_changed_state_key_inside_a_fused_query_and_writes_nothing(
        old_run: OldRun, module_store: EpochStore, capsys: pytest.CaptureFixture[str]) -> None:
    pid, epoch = old_run.pid, old_run.epoch
    assert module_store.get_epoch(pid, epoch).stages == [FUSED]  # taken fused: the driver's default
    files, rows = tree(old_run.root / "storage"), store_rows(module_store.dsn, pid)
    assert any("/state/" in f for f, _ in files)
    base = ("--dsn", module_store.dsn, "upgrade-plan", pid, "--epoch", str(epoch), "--pipeline-module",
            f"{MODULE}:refused_code")

    code, out, err = run(capsys, *base, "--check-state-schema")
    assert code == 2, (out, err)
    row = next(line for line in out.splitlines() if line.startswith(f"{FUSED} "))
    assert "incompatible (refused)" in row
    assert (f"state changed shape since epoch {epoch}: state operator 0 (dedupe): key schema (k: long) in the "
            "epoch, (k: long, j: long) in the new code") in row
    assert (f"planned against the queries the driver will run (fused as Spark's analyzer found the stages' state "
            f"(runtime/plan.py's rules)): {FUSED} (src, dedup, out) fused") in out
    assert f"state schemas checked: {FUSED} " in out and f"refused: {FUSED} " in out

    code, out, _ = run(capsys, *base, "--check-state-schema", "--json")
    plan = json.loads(out)
    assert (code, plan["restores"], plan["physical"], plan["state_schema_checked"]) == (2, False, True, [FUSED])
    assert plan["queries"] == {FUSED: ["src", "dedup", "out"]}
    (stage,) = plan["stages"]
    assert (stage["stage"], stage["action"], stage["refused"], stage["snapshot"]) == (
        FUSED, "incompatible", True, FUSED)
    assert "state operator 0 (dedupe): key schema (k: long) in the epoch, (k: long, j: long)" in stage["reason"]

    # without Spark nothing says which stages hold state, so which fuse: the plan says it is of the logical stages
    code, out, _ = run(capsys, *base, "--json")
    plan = json.loads(out)
    assert (code, plan["physical"], plan["queries"], plan["state_schema_checked"]) == (0, False, None, None)
    assert {r["stage"]: (r["action"], r["snapshot"]) for r in plan["stages"]} == {
        s: ("restored-across-fusion", FUSED) for s in ("src", "dedup", "out")}
    code, out, _ = run(capsys, *base)
    assert out.strip().splitlines()[-1].startswith("planned against the logical stages, not the queries the driver "
                                                   "will run: ")
    assert out.strip().endswith("--check-state-schema plans the driver's physical graph")

    # a rename of the epoch's fused query into the new code's (its stateful stage renamed): checked the same way
    renamed = ("--dsn", module_store.dsn, "upgrade-plan", pid, "--epoch", str(epoch), "--pipeline-module",
               f"{MODULE}:renamed_refused_code", "--rename", f"{FUSED}={RENAMED}")
    code, out, _ = run(capsys, *renamed, "--check-state-schema", "--json")
    plan = json.loads(out)
    assert (code, plan["state_schema_checked"]) == (2, [RENAMED])
    assert plan["queries"] == {RENAMED: ["src", "dedup_v2", "out"]}
    (stage,) = plan["stages"]
    assert (stage["stage"], stage["action"], stage["snapshot"]) == (RENAMED, "incompatible", FUSED)
    assert "state operator 0 (dedupe): key schema (k: long) in the epoch, (k: long, j: long)" in stage["reason"]
    # without Spark the fused name is unknown: refused by name, the option named in the docs (upgrading.md)
    code, out, err = run(capsys, *renamed)
    assert (code, out) == (2, "") and f"renamed maps {FUSED!r} to {RENAMED!r}, which is no stage" in err

    assert tree(old_run.root / "storage") == files  # no checkpoint folder, channel or snapshot object written
    assert store_rows(module_store.dsn, pid) == rows


def test_the_one_step_upgrade_refuses_it_at_its_first_plan_step_while_the_old_code_runs(old_run: OldRun) -> None:
    assert f"upgrade of pipeline {old_run.pid!r} stopped at step 'plan'" in old_run.upgrade_refusal
    assert f"stage {FUSED!r} incompatible: state changed shape" in old_run.upgrade_refusal
    assert "(k: long, j: long) in the new code" in old_run.upgrade_refusal
    assert old_run.state_while_refused == (PipelineState.RUNNING, None)


class _Registered(Exception):
    """Raised at the driver's first step after its restore plan: the plan admitted the code."""


@pytest.mark.parametrize(("new_code", "rename", "queries"), [
    (compatible_code, {}, {FUSED: ["src", "dedup", "out"]}),
    (renamed_compatible_code, {FUSED: RENAMED}, {RENAMED: ["src", "dedup_v2", "out"]}),
    (unfused_compatible_code, {}, {"src": ["src"], "dedup": ["dedup"], "out": ["out"]}),
], ids=["same-fusion", "renamed-fused-query", "split"])
def test_a_compatible_change_plans_in_the_dry_run_what_the_driver_decides(
        old_run: OldRun, module_store: EpochStore, spark: Any, capsys: pytest.CaptureFixture[str],
        new_code: Callable[[], Pipeline], rename: dict[str, str], queries: dict[str, list[str]]) -> None:
    pid, epoch = old_run.pid, old_run.epoch
    code, out, err = run(capsys, "--dsn", module_store.dsn, "upgrade-plan", pid, "--epoch", str(epoch),
                         "--pipeline-module", f"{MODULE}:{new_code.__name__}", "--check-state-schema", "--json",
                         *(f"--rename={old}={new}" for old, new in rename.items()))
    assert code == 0, (out, err)
    dry = json.loads(out)
    assert (dry["restores"], dry["physical"], dry["queries"]) == (True, True, queries)

    def stop_at(step: str) -> None:
        if step == "registered":
            raise _Registered

    driver = PipelineDriver(new_code(), module_store, storage_uri=str(old_run.root / "storage"), spark=spark,
                            restore_from=epoch, renamed=rename)
    driver.on_step = stop_at
    with pytest.raises(PipelineFailedError, match="_Registered"):  # planned, admitted, registered: then stopped
        driver.run()
    assert driver._upgrade is not None
    assert dry["stages"] == [{**asdict(r), "action": r.action.value} for r in driver._upgrade.stages]
    registered = module_store.get_pipeline(pid).config["plan"]["queries"]
    assert {q["name"]: q["stages"] for q in registered} == queries
    if len(queries) == 1:  # restored whole: its state schemas compared (a split is not checked)
        assert dry["state_schema_checked"] == list(queries)
        assert [(r["stage"], r["action"], r["snapshot"]) for r in dry["stages"]] == [(*queries, "restored", FUSED)]
    else:
        assert dry["state_schema_checked"] == []
        assert {r["stage"]: (r["action"], r["snapshot"]) for r in dry["stages"]} == {
            s: ("restored-across-fusion", FUSED) for s in queries}
