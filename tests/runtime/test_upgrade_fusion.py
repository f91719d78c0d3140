"""Restoring across a change of fusion (issue 32, deliverable 2), in the pure plan (``plan_upgrade``): a fused
query's stage is named after its members joined by ``~``, so the plan sees an epoch taken fused and code run
unfused (or the other way) by their names, and refuses each stage whose state sits in another query form, naming
the epoch's query, why (docs/upgrading.md's matrix) and the way through; dropping the state by name still works."""

from __future__ import annotations

from airflow_arroyo.runtime.decisions import FUSED_SEPARATOR, StageAction, UpgradePlan, plan_upgrade
from airflow_arroyo.runtime.plan import SEPARATOR


def _ids(*names: str) -> dict[str, str]:
    return {n: n for n in names}


def _rows(plan: UpgradePlan) -> dict[str, tuple[StageAction, bool, str | None]]:
    return {r.stage: (r.action, r.refused, r.snapshot) for r in plan.stages}


def test_separator_is_the_planners() -> None:
    assert FUSED_SEPARATOR == SEPARATOR


def test_fused_epoch_into_unfused_code_is_refused_by_name_with_the_way_through() -> None:
    plan = plan_upgrade(7, ["src~dedup~out"], _ids("src", "dedup", "out"))
    assert not plan.restores
    assert _rows(plan) == {s: (StageAction.INCOMPATIBLE, True, "src~dedup~out") for s in ("src", "dedup", "out")}
    reason = plan.refused[1].reason
    assert "epoch 7 ran src, dedup, out as one Spark query 'src~dedup~out'" in reason
    assert "'dedup' as its own query" in reason
    assert "state/<operator id>" in reason  # what Spark's layout allows
    assert "allow_dropped_state=['src~dedup~out']" in reason  # the way through


def test_unfused_epoch_into_fused_code_is_refused_by_name() -> None:
    plan = plan_upgrade(3, ["src", "dedup", "out"], _ids("src~dedup~out"))
    assert not plan.restores
    assert _rows(plan) == {"src~dedup~out": (StageAction.INCOMPATIBLE, True, "src")}
    reason = plan.refused[0].reason
    assert "epoch 3 ran src, dedup, out as separate Spark queries" in reason
    assert "renumber" in reason
    assert "allow_dropped_state=['src', 'dedup', 'out']" in reason


def test_regrouping_names_each_stage_whose_query_changed() -> None:
    plan = plan_upgrade(2, ["src~agg", "out"], _ids("src", "agg~out"))
    rows = _rows(plan)
    assert rows["src"] == (StageAction.INCOMPATIBLE, True, "src~agg")
    assert rows["agg~out"] == (StageAction.INCOMPATIBLE, True, "src~agg")
    assert "out" not in rows  # accounted for by the query that now fuses it, not a removed stage
    assert "it also fuses out, which epoch 2 ran as their own queries" in plan.refused[-1].reason


def test_dropping_the_fused_state_by_name_starts_its_stages_empty() -> None:
    plan = plan_upgrade(7, ["src~dedup~out"], _ids("src", "dedup", "out"), allow_dropped_state=["src~dedup~out"])
    assert plan.restores
    assert _rows(plan) == {"src": (StageAction.NEW, False, None), "dedup": (StageAction.NEW, False, None),
                           "out": (StageAction.NEW, False, None),
                           "src~dedup~out": (StageAction.REMOVED, False, None)}


def test_same_fusion_restores_and_unrelated_new_stages_stay_new() -> None:
    plan = plan_upgrade(5, ["src~out"], _ids("src~out", "audit"))
    assert plan.restores
    assert _rows(plan) == {"src~out": (StageAction.RESTORED, False, "src~out"), "audit": (StageAction.NEW, False, None)}


def test_a_fused_query_with_one_source_splits_into_the_unfused_stages() -> None:
    plan = plan_upgrade(7, ["src~dedup~out"], _ids("src", "dedup", "out"), sources=["src"])
    assert plan.restores
    assert _rows(plan) == {s: (StageAction.ACROSS_FUSION, False, "src~dedup~out") for s in ("src", "dedup", "out")}
    assert plan.across_fusion() == plan.snapshot_of() == {s: "src~dedup~out" for s in ("src", "dedup", "out")}


def test_a_split_into_other_groups_of_the_same_members_splits_too() -> None:
    plan = plan_upgrade(7, ["src~dedup~out"], _ids("src", "dedup~out"), sources=["src"])
    assert plan.across_fusion() == {"src": "src~dedup~out", "dedup~out": "src~dedup~out"}


def test_splits_that_spark_cannot_map_are_refused_naming_why() -> None:
    merged = plan_upgrade(1, ["a~b~j"], _ids("a", "b", "j"), sources=["a", "b"])
    assert not merged.restores
    assert "read 2 sources (a, b)" in merged.refused[0].reason
    lost = plan_upgrade(1, ["src~dedup~out"], _ids("src", "dedup"), sources=["src"])
    assert "out of that query is not in the new code" in lost.refused[0].reason
    joined = plan_upgrade(2, ["src~agg", "out"], _ids("src", "agg~out"), sources=["src"])
    assert "out would join it from outside that query" in joined.refused[0].reason
    assert not joined.restores


def test_stages_that_each_ran_as_their_own_query_merge_into_a_fused_one() -> None:
    plan = plan_upgrade(3, ["src", "dedup", "out"], _ids("src~dedup~out"), sources=["src"])
    assert plan.restores
    assert _rows(plan) == {"src~dedup~out": (StageAction.ACROSS_FUSION, False, "out")}  # the tail's batch ids go on
    assert plan.across_fusion() == {"src~dedup~out": "out"}


def test_merges_that_cannot_be_renumbered_are_refused_naming_why() -> None:
    partly = plan_upgrade(3, ["src~dedup", "out"], _ids("src~dedup~out"), sources=["src"])
    assert not partly.restores
    two = plan_upgrade(3, ["a", "b", "j"], _ids("a~b~j"), sources=["a", "b"])
    assert "the new query would read 2 sources (a, b)" in two.refused[0].reason
