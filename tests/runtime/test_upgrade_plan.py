"""The upgrade plan (``runtime/decisions.py`` ``plan_upgrade``), without Spark or a store: each stage of the new
code's graph against an epoch's snapshots is restored, new, removed or incompatible, and the options that move or
drop state refuse names that match nothing."""

from __future__ import annotations

import pytest

from airflow_arroyo.core.exceptions import ConfigurationError
from airflow_arroyo.runtime.decisions import StageAction, UpgradePlan, plan_upgrade

EPOCH = ("orders", "enrich", "files")


def _ids(*names: str) -> dict[str, str]:
    return {n: n for n in names}


def _rows(plan: UpgradePlan) -> dict[str, tuple[StageAction, bool]]:
    return {r.stage: (r.action, r.refused) for r in plan.stages}


def test_same_graph_restores_every_stage() -> None:
    plan = plan_upgrade(4, EPOCH, _ids(*EPOCH))
    assert plan.restores
    assert _rows(plan) == {s: (StageAction.RESTORED, False) for s in EPOCH}
    assert plan.snapshot_of() == {s: s for s in EPOCH}


def test_added_stage_is_new_and_restores() -> None:
    plan = plan_upgrade(4, EPOCH, _ids(*EPOCH, "audit", "audit_files"))
    assert plan.restores
    assert _rows(plan)["audit"] == (StageAction.NEW, False)
    assert _rows(plan)["audit_files"] == (StageAction.NEW, False)
    assert "audit" not in plan.snapshot_of()


def test_removed_stage_is_refused_naming_the_fix() -> None:
    plan = plan_upgrade(4, EPOCH, _ids("orders", "files"))
    assert not plan.restores
    [row] = plan.refused
    assert (row.stage, row.action) == ("enrich", StageAction.REMOVED)
    assert "allow_dropped_state=['enrich']" in row.reason


def test_removed_stage_allowed_by_name() -> None:
    plan = plan_upgrade(4, EPOCH, _ids("orders", "files"), allow_dropped_state=["enrich"])
    assert plan.restores
    assert _rows(plan)["enrich"] == (StageAction.REMOVED, False)


def test_dropping_a_stage_the_epoch_lacks_is_refused() -> None:
    with pytest.raises(ConfigurationError, match=r"allow_dropped_state names enirch.*no snapshot"):
        plan_upgrade(4, EPOCH, _ids(*EPOCH), allow_dropped_state=["enirch"])


def test_rename_kept_by_uid() -> None:
    # the stage is now called 'enriched' but keeps uid 'enrich': its identity is unchanged
    plan = plan_upgrade(4, EPOCH, {"orders": "orders", "enriched": "enrich", "files": "files"})
    assert plan.restores
    assert plan.snapshot_of()["enriched"] == "enrich"


def test_rename_by_mapping() -> None:
    plan = plan_upgrade(4, EPOCH, _ids("orders", "enriched", "files"), renamed={"enrich": "enriched"})
    assert plan.restores
    assert _rows(plan)["enriched"] == (StageAction.RESTORED, False)
    assert plan.snapshot_of()["enriched"] == "enrich"
    assert "renamed from 'enrich'" in next(r.reason for r in plan.stages if r.stage == "enriched")


def test_rename_without_mapping_is_a_removal_and_a_new_stage() -> None:
    plan = plan_upgrade(4, EPOCH, _ids("orders", "enriched", "files"))
    assert _rows(plan)["enriched"] == (StageAction.NEW, False)
    assert _rows(plan)["enrich"] == (StageAction.REMOVED, True)
    assert "renamed={'enrich': 'NEW'}" in plan.refused[0].reason


@pytest.mark.parametrize(("renamed", "match"), [
    ({"nope": "enriched"}, r"renamed names 'nope'"),
    ({"enrich": "nope"}, r"'nope', which is no stage of the new graph"),
    ({"enrich": "orders"}, r"stage 'orders' would take the snapshots of both 'orders' and 'enrich'"),
])
def test_bad_rename_is_refused(renamed: dict[str, str], match: str) -> None:
    with pytest.raises(ConfigurationError, match=match):
        plan_upgrade(4, EPOCH, _ids("orders", "enriched", "files"), renamed=renamed)


def test_two_stages_with_one_uid_are_refused() -> None:
    with pytest.raises(ConfigurationError, match=r"same identity 'orders'; give each stage its own uid"):
        plan_upgrade(4, EPOCH, {"orders": "orders", "orders2": "orders", "files": "files"})


def test_fusion_change_is_incompatible_by_name() -> None:
    fused = [("orders", "enrich"), ("files",)]
    unfused = [("orders",), ("enrich",), ("files",)]
    plan = plan_upgrade(4, EPOCH, _ids(*EPOCH), epoch_fusion=fused, graph_fusion=unfused)
    assert not plan.restores
    assert {r.stage for r in plan.refused} == {"orders", "enrich"}
    assert all(r.action is StageAction.INCOMPATIBLE and "fusion changed" in r.reason for r in plan.refused)
    assert _rows(plan)["files"] == (StageAction.RESTORED, False)


def test_same_fusion_under_a_rename_restores() -> None:
    plan = plan_upgrade(4, EPOCH, _ids("orders", "enriched", "files"), renamed={"enrich": "enriched"},
                        epoch_fusion=[("orders", "enrich"), ("files",)],
                        graph_fusion=[("orders", "enriched"), ("files",)])
    assert plan.restores


def test_fusion_compared_through_uids() -> None:
    # the new graph's groups are by stage name; 'enriched' keeps uid 'enrich', so its group is the same
    plan = plan_upgrade(4, EPOCH, {"orders": "orders", "enriched": "enrich", "files": "files"},
                        epoch_fusion=[("orders", "enrich"), ("files",)],
                        graph_fusion=[("orders", "enriched"), ("files",)])
    assert plan.restores
    moved = plan_upgrade(4, EPOCH, {"orders": "orders", "enriched": "enrich", "files": "files"},
                         epoch_fusion=[("orders", "enrich"), ("files",)],
                         graph_fusion=[("orders",), ("enriched", "files")])
    assert {r.stage for r in moved.refused} == {"orders", "enriched", "files"}
