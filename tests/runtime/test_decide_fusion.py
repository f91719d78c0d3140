"""``decide_fusion`` (runtime/plan.py): the one decision of which stages run fused that the driver and the upgrade's
dry runs share. Pure: the statefulness facts are given as Spark's analyzer would find them, or withheld (a dry run
without Spark), and the epoch a run restores is asked only when the answer depends on it."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from airflow_arroyo.runtime.pipeline import Pipeline
from airflow_arroyo.runtime.plan import decide_fusion

from .test_plan import STATELESS, groups, ident, linear, read

UNFUSED = [("src",), ("a",), ("b",), ("out",)]
ONE_STATEFUL = {**STATELESS, "a": True}


class Epoch:
    """The ``restoring`` answer, counting the calls."""

    def __init__(self, stages: Sequence[str] | None, epoch: int = 7) -> None:
        self.answer = None if stages is None else (epoch, tuple(stages))
        self.calls = 0

    def __call__(self) -> tuple[int, Sequence[str]] | None:
        self.calls += 1
        return self.answer


def test_chaining_false_runs_every_stage_alone_without_asking_anything() -> None:
    epoch = Epoch(["src~a~b~out"])
    for stateful in (None, STATELESS):
        fusion = decide_fusion(linear(chaining=False).validate(), stateful, chaining=False, restoring=epoch)
        assert fusion.plan is not None and groups(fusion.plan) == UNFUSED
        assert (fusion.why, fusion.unfused_for_epoch) == ("chaining=False: every stage is its own query", None)
    assert epoch.calls == 0


@pytest.mark.parametrize("chaining", [None, True])
def test_with_spark_the_rules_fuse_a_fresh_start_or_a_fused_epoch(chaining: bool | None) -> None:
    for epoch in (Epoch(None), Epoch(["src~a~b~out"]), Epoch(["src~a", "b~out"])):
        fusion = decide_fusion(linear(chaining=chaining).validate(), ONE_STATEFUL, chaining=chaining,
                               restoring=epoch)
        assert fusion.plan is not None and groups(fusion.plan) == [("src", "a", "b", "out")]
        assert fusion.unfused_for_epoch is None and "Spark's analyzer" in fusion.why
        assert fusion.plan.stateful == ONE_STATEFUL


def test_chaining_none_restoring_an_unfused_epoch_runs_unfused_with_or_without_spark() -> None:
    graph = linear(chaining=None).validate()
    for stateful in (ONE_STATEFUL, None):
        epoch = Epoch(["out", "b", "a", "src"])  # order does not matter
        fusion = decide_fusion(graph, stateful, chaining=None, restoring=epoch)
        assert fusion.plan is not None and groups(fusion.plan) == UNFUSED
        assert fusion.unfused_for_epoch == 7 and epoch.calls == 1
        assert fusion.why == ("epoch 7 was taken with every stage its own query: a restore of it runs unfused "
                              "(chaining=None)")
    # chaining=True fuses all the same (the restore across fusion then decides), and never asks
    epoch = Epoch(["src", "a", "b", "out"])
    fusion = decide_fusion(linear(chaining=True).validate(), ONE_STATEFUL, chaining=True, restoring=epoch)
    assert fusion.plan is not None and groups(fusion.plan) == [("src", "a", "b", "out")] and epoch.calls == 0


def test_without_spark_the_plan_is_unknown_where_state_decides_it() -> None:
    graph = linear(chaining=None).validate()
    for epoch in (Epoch(None), Epoch(["src~a~b~out"]), Epoch(["src", "a"])):
        fusion = decide_fusion(graph, None, chaining=None, restoring=epoch)
        assert fusion.plan is None and fusion.unfused_for_epoch is None
        assert "Spark's analyzer decides when the driver starts" in fusion.why


def test_without_spark_a_graph_with_a_boundary_at_every_channel_is_known_and_asks_no_epoch() -> None:
    p = Pipeline("walls")
    src = p.source("src", read)
    a = p.stage("a", ident, inputs=[src], chain=False)
    p.sink("x", inputs=[a], foreach_batch=lambda df, i: None)
    p.sink("y", inputs=[a], foreach_batch=lambda df, i: None)  # fan-out: neither sink fuses with a
    epoch = Epoch(["src~a"])
    fusion = decide_fusion(p.validate(), None, chaining=None, restoring=epoch)
    assert fusion.plan is not None and groups(fusion.plan) == [("src",), ("a",), ("x",), ("y",)]
    assert "no two stages can fuse" in fusion.why and epoch.calls == 0
    # with Spark the same: the driver's plan, whatever the stages hold
    spark_facts = {"src": False, "a": True, "x": False, "y": False}
    fused = decide_fusion(p.validate(), spark_facts, chaining=None, restoring=epoch).plan
    assert fused is not None and groups(fused) == groups(fusion.plan)
