"""The pipeline's Shadow runs page and its JSON, against Airflow's real api-server app: each shadow's fork point,
code, state and sink redirections; an active one's comparison, or why there is none (here: no snapshot storage to
read provenance from); an ended one without a comparison. Read-only."""

from __future__ import annotations

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
