"""The pipeline's Shadow runs page and its JSON, against Airflow's real api-server app: each shadow's fork point,
code, state and sink redirections; an active one's comparison, or why there is none (here: no snapshot storage to
read provenance from); an ended one without a comparison. Read-only. A PostgreSQL sink's per-window diff is shown
like a file sink's, its database reached through the sink's Airflow connection (the comparison itself, on real
Spark and PostgreSQL, is tests/runtime/test_shadow_run.py)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest

from airflow_arroyo.store import EpochStore
from tests.controlplane.test_store import complete
from tests.support import running

pytestmark = pytest.mark.airflow

PID = "shadowed-ui"
SINKS = {"out": {"kind": "files", "format": "json", "live": "/data/out", "shadow": "/data/out.shadow-x"}}


def test_the_shadows_page_lists_each_shadow_and_its_comparison_or_why_not(store: EpochStore, client: Any) -> None:
    running(store, PID, stages=["src", "out"])
    e1 = complete(store, PID)
    complete(store, PID)
    for sid in (f"{PID}-v2", f"{PID}-v3"):
        store.fork_pipeline(PID, e1, sid)
        store.record_shadow(sid, PID, e1, "my.code:v2", SINKS)
    store.end_shadow(f"{PID}-v3", "discarded")

    page = client.get(f"/arroyo/pipelines/{PID}/shadows")
    assert page.status_code == 200, page.text
    html = page.text
    assert f'id="shadow-{PID}-v2"' in html and f'id="shadow-{PID}-v3"' in html
    assert "/data/out.shadow-x" in html and "my.code:v2" in html and "discarded" in html
    assert 'id="shadows-link"' in client.get(f"/arroyo/pipelines/{PID}").text

    answer = client.get(f"/arroyo/api/pipelines/{PID}/shadows")
    assert answer.status_code == 200
    by_id = {e["shadow"]["shadow_id"]: e for e in answer.json()}
    assert by_id[f"{PID}-v3"]["shadow"]["state"] == "discarded" and by_id[f"{PID}-v3"]["compare"] is None
    active = by_id[f"{PID}-v2"]
    assert active["shadow"]["sinks"] == SINKS
    assert (active["compare"] is None) == (active["error"] is not None)
    assert client.get("/arroyo/api/pipelines/no-such-pipeline/shadows").status_code == 404


def test_a_postgresql_sinks_diff_is_shown_and_its_database_reached_through_airflow(
        store: EpochStore, client: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    pid, sid = f"{PID}-pg", f"{PID}-pg-v2"
    sinks = {"totals": {"kind": "postgres", "live": "totals", "shadow": "totals_shadow_x", "key": ["k"],
                        "mode": "upsert", "conn_id": "shadow_ui_warehouse"}}
    running(store, pid, stages=["src", "totals"])
    e1 = complete(store, pid)
    store.fork_pipeline(pid, e1, sid)
    store.record_shadow(sid, pid, e1, "my.code:v2", sinks)
    monkeypatch.setenv("AIRFLOW_CONN_SHADOW_UI_WAREHOUSE", "postgresql://reader:pw@warehouse.example:5433/dw")
    reached: list[str] = []

    def compare(records: Any, shadow_id: str, *, pg_dsn: Any, **_: Any) -> dict[str, Any]:
        """The seam the page calls: what the page does with the result, and the resolver it hands on."""
        target: Mapping[str, Any] = records.get_shadow(shadow_id).sinks["totals"]
        reached.append(pg_dsn(target))
        diff = {"sink": "totals", "live_epochs": [e1 + 1], "shadow_epochs": [e1 + 1], "closed": True, "note": "",
                "added": 1, "removed": 2, "changed": 17, "live_rows": 40, "shadow_rows": 39, "examples": {}}
        return {"shadow_id": shadow_id, "live_id": pid, "fork_epoch": e1, "state": "active", "code": "my.code:v2",
                "sinks": sinks, "windows": [], "diffs": [diff]}

    monkeypatch.setattr("airflow_arroyo.core.shadow.compare_shadow", compare)
    page = client.get(f"/arroyo/pipelines/{pid}/shadows")
    assert page.status_code == 200, page.text
    assert "totals_shadow_x" in page.text and "<td>17</td>" in page.text and "<td>39</td>" in page.text
    assert len(reached) == 1 and "warehouse.example" in reached[0] and "5433" in reached[0], reached

    monkeypatch.delenv("AIRFLOW_CONN_SHADOW_UI_WAREHOUSE")
    entry = {e["shadow"]["shadow_id"]: e for e in client.get(f"/arroyo/api/pipelines/{pid}/shadows").json()}[sid]
    assert "shadow_ui_warehouse" in entry["error"] and "api-server" in entry["error"], entry
