"""``airflow-arroyo upgrade-plan``: the new code's stages against a stored epoch, as a table or JSON, exit 0 when
the plan restores and 2 when refused; it imports the new code only to read its graph and writes nothing."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from airflow_arroyo.runtime.pipeline import Pipeline as NewCode
from airflow_arroyo.store import EpochStore
from tests.controlplane.test_cli import run
from tests.controlplane.test_retention import Pipeline


def _read(spark: Any) -> Any:
    raise AssertionError("upgrade-plan must not run the pipeline")


def added_stage() -> NewCode:
    """The stored pipeline's code ('src') with a stage and its sink added."""
    p = NewCode("orders")
    src = p.source("src", _read)
    audit = p.stage("audit", lambda df: df, inputs=[src])
    p.sink("audit_out", inputs=[audit], foreach_batch=lambda df, batch_id: None)
    return p


def src_dropped() -> NewCode:
    """New code without the stored stage 'src'."""
    p = NewCode("orders")
    feed = p.source("feed", _read)
    p.sink("feed_out", inputs=[feed], foreach_batch=lambda df, batch_id: None)
    return p


MODULE = __name__


@pytest.fixture
def orders(store: EpochStore, tmp_path: Path) -> Pipeline:
    pipe = Pipeline(store, tmp_path / "o", "orders", stages=("src",))
    pipe.epoch({"src": {"a": 1000}})
    pipe.epoch({"src": {"b": 2000}})
    return pipe


@pytest.mark.usefixtures("orders")
def test_added_stage_restores(store: EpochStore, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "--dsn", store.dsn, "upgrade-plan", "orders",
                         "--pipeline-module", f"{MODULE}:added_stage")
    assert (code, err) == (0, ""), err
    *table, note = out.strip().splitlines()
    rows = {line.split()[0]: line.split()[1] for line in table[1:]}
    assert rows == {"src": "restored", "audit": "new", "audit_out": "new"}
    # the code's stages could fuse and nothing says which hold state without Spark: the plan says it is logical
    assert note == ("planned against the logical stages, not the queries the driver will run: which stages run fused "
                    "depends on which hold state, which Spark's analyzer decides when the driver starts; "
                    "--check-state-schema plans the driver's physical graph")
    code, out, _ = run(capsys, "--dsn", store.dsn, "--json", "upgrade-plan", "orders", "--epoch", "1",
                       "--pipeline-module", f"{MODULE}:added_stage")
    plan = json.loads(out)
    assert code == 0 and (plan["epoch"], plan["restores"]) == (1, True)
    assert (plan["physical"], plan["queries"], plan["state_schema_checked"]) == (False, None, None)
    assert "Spark's analyzer decides when the driver starts" in plan["fusion"]


def unfused_added_stage() -> NewCode:
    """``added_stage`` with chaining=False: every stage its own query, known without Spark."""
    p = added_stage()
    p.chaining = False
    return p


@pytest.mark.usefixtures("orders")
def test_a_plan_whose_fusion_needs_no_spark_is_of_the_drivers_queries(store: EpochStore,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "--dsn", store.dsn, "--json", "upgrade-plan", "orders",
                       "--pipeline-module", f"{MODULE}:unfused_added_stage")
    plan = json.loads(out)
    assert (code, plan["physical"], plan["fusion"]) == (0, True, "chaining=False: every stage is its own query")
    assert plan["queries"] == {"src": ["src"], "audit": ["audit"], "audit_out": ["audit_out"]}
    code, out, _ = run(capsys, "--dsn", store.dsn, "upgrade-plan", "orders",
                       "--pipeline-module", f"{MODULE}:unfused_added_stage")
    assert out.strip().splitlines()[-1] == ("planned against the queries the driver will run (chaining=False: every "
                                            "stage is its own query): no stage fused")


@pytest.mark.usefixtures("orders")
def test_dropped_stage_refused_then_allowed_or_renamed(store: EpochStore,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    base = ("--dsn", store.dsn, "upgrade-plan", "orders", "--pipeline-module", f"{MODULE}:src_dropped")
    code, out, _ = run(capsys, *base)
    assert code == 2 and "refused: src" in out and "allow_dropped_state=['src']" in out
    code, out, _ = run(capsys, *base, "--allow-dropped-state", "src")
    assert code == 0 and "removed" in out
    code, out, _ = run(capsys, *base, "--json", "--rename", "src=feed")
    stages = {row["stage"]: row for row in json.loads(out)["stages"]}
    assert code == 0 and stages["feed"]["action"] == "restored" and stages["feed"]["snapshot"] == "src"
    for extra, needle in ((("--rename", "src"), "--rename must look like OLD=NEW"),
                          (("--allow-dropped-state", "nope"), "allow_dropped_state names nope"),
                          (("--epoch", "9"), "no epoch 9")):
        code, out, err = run(capsys, *base, *extra)
        assert (code, out) == (2, "") and needle in err, err
