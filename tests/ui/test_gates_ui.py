"""A person's verdict on a commit gate through the UI, against Airflow's real api-server app and auth manager: the
pipeline page lists the gates with Approve and Reject for the open ones, and the verdict endpoint (JSON, and the
page's form) needs an authenticated user allowed to answer a human-in-the-loop task, records that user's name,
and refuses an illegal move (409), an unknown gate (404) and a request another site could forge."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from airflow_arroyo.core.gates import GatePolicy, GateState
from airflow_arroyo.store import EpochStore
from tests.controlplane.test_store import complete
from tests.support import running, sql
from tests.ui.conftest import make_token
from tests.ui.html import Node, parse

pytestmark = pytest.mark.airflow

PID = "gated-ui"
FILES = {"kind": "files", "format": "json", "files": ["file:///tmp/gated/part-0.json"], "rows": 3}
SAME_ORIGIN = {"Sec-Fetch-Site": "same-origin"}


def api(sink: str, epoch: int, pid: str = PID) -> str:
    return f"/arroyo/api/pipelines/{pid}/gates/{sink}/{epoch}/verdict"


def form(sink: str, epoch: int) -> str:
    return f"/arroyo/pipelines/{PID}/gates/{sink}/{epoch}/verdict"


def bearer(username: str, role: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {make_token(username, role)}"}


@pytest.fixture
def gates(store: EpochStore) -> Iterator[list[int]]:
    """Pipeline PID: four completed epochs, a gate of sink 'out' on each: the first committed, the second failed,
    the third and fourth pending; the dataset is shared, so the pipeline goes again afterwards."""
    running(store, PID, stages=["src", "out"])
    try:
        epochs = [complete(store, PID) for _ in range(4)]
        for i, e in enumerate(epochs):
            store.open_gate(PID, "out", e, run_id="r1", uri="file:///tmp/gated", policy=GatePolicy.HOLD,
                            batch_from=i, batch_to=i, details=FILES, timeout=600.0)
        store.decide_gate(PID, "out", epochs[0], GateState.PASSED, by="check_rows")
        store.close_gate(PID, "out", epochs[0], GateState.COMMITTED)
        store.decide_gate(PID, "out", epochs[1], GateState.FAILED, by="check_rows", reason="3 null keys")
        yield epochs
    finally:
        sql(store, "DELETE FROM arroyo_pipelines WHERE pipeline_id = %s", (PID,))


def state(store: EpochStore, epoch: int) -> tuple[GateState, str | None, str | None]:
    g = store.get_gate(PID, "out", epoch)
    return g.state, g.decided_by, g.reason


def gate_rows(doc: Node) -> list[Node]:
    return doc.find("table", id="gate-table").find_all("tr")[1:]


def test_the_pipeline_page_lists_the_gates_open_first_with_buttons_only_where_a_verdict_can_move(
        client: TestClient, gates: list[int]) -> None:
    e1, e2, e3, e4 = gates
    doc = parse(client.get(f"/arroyo/pipelines/{PID}").text)
    rows = gate_rows(doc)
    assert [(r.attrs["data-epoch"], r.attrs["data-state"]) for r in rows] == [
        (str(e2), "failed"), (str(e3), "pending"), (str(e4), "pending"), (str(e1), "committed")]
    buttons = {int(r.attrs["data-epoch"]): sorted(b.attrs["value"] for b in r.find_all("button")) for r in rows}
    # a failed gate may still pass (a person's approval after a look); a committed one takes no verdict
    assert buttons == {e1: [], e2: ["pass"], e3: ["fail", "pass"], e4: ["fail", "pass"]}
    pending = next(r for r in rows if r.attrs["data-epoch"] == str(e3))
    f = pending.find("form")
    assert (f.attrs["method"], f.attrs["action"]) == ("post", form("out", e3))
    assert f.find("input", name="reason")
    assert [b.text() for b in f.find_all("button")] == ["Approve", "Reject"]
    failed = next(r for r in rows if r.attrs["data-epoch"] == str(e2))
    assert "check_rows" in failed.text() and "3 null keys" in failed.text()
    assert not next(r for r in rows if r.attrs["data-epoch"] == str(e1)).find_all("form")


def test_anonymous_and_read_only_users_cannot_decide_and_nothing_is_recorded(
        anon: TestClient, store: EpochStore, gates: list[int]) -> None:
    e3 = gates[2]
    assert anon.post(api("out", e3), json={"passed": True}).status_code == 401
    assert anon.post(form("out", e3), data={"verdict": "pass"}, headers=SAME_ORIGIN).status_code == 401
    forged = make_token("admin", "admin")[:-4] + "AAAA"
    assert anon.post(api("out", e3), json={"passed": True},
                     headers={"Authorization": f"Bearer {forged}"}).status_code in (401, 403)
    # a viewer may read every page, and not decide
    viewer = bearer("viewer_vera", "viewer")
    assert anon.get(f"/arroyo/pipelines/{PID}", headers=viewer).status_code == 200
    r = anon.post(api("out", e3), json={"passed": True}, headers=viewer)
    assert r.status_code == 403, r.text
    assert anon.post(form("out", e3), data={"verdict": "pass"}, headers={**viewer, **SAME_ORIGIN}).status_code == 403
    assert state(store, e3) == (GateState.PENDING, None, None)


def test_an_approval_records_the_authenticated_users_name(anon: TestClient, store: EpochStore,
                                                          gates: list[int]) -> None:
    e3 = gates[2]
    who = bearer("ana", "user")
    # who decides comes from the token only: a body naming someone is refused
    r = anon.post(api("out", e3), json={"passed": True, "by": "somebody else"}, headers=who)
    assert r.status_code == 422
    assert state(store, e3) == (GateState.PENDING, None, None)
    r = anon.post(api("out", e3), json={"passed": True, "reason": "looked at the sample"}, headers=who)
    assert r.status_code == 200, r.text
    assert (r.json()["gate"]["state"], r.json()["gate"]["decided_by"]) == ("passed", "ana")
    assert state(store, e3) == (GateState.PASSED, "ana", "looked at the sample")


def test_a_rejection_from_the_page_records_the_reason_and_goes_back_to_the_page(
        airflow_api: Any, store: EpochStore, gates: list[int]) -> None:
    e4 = gates[3]
    with TestClient(airflow_api, follow_redirects=False) as browser:
        browser.cookies.set("_token", make_token("bo", "user"))  # the Airflow UI's sign-in cookie
        r = browser.post(form("out", e4), data={"verdict": "fail", "reason": "amounts < 0 in 12 rows"},
                         headers=SAME_ORIGIN)
        assert r.status_code == 303, r.text
        assert r.headers["location"] == f"/arroyo/pipelines/{PID}#gates"
        assert state(store, e4) == (GateState.FAILED, "bo", "amounts < 0 in 12 rows")
        row = next(r for r in gate_rows(parse(browser.get(f"/arroyo/pipelines/{PID}").text))
                   if r.attrs["data-epoch"] == str(e4))
        assert row.attrs["data-state"] == "failed" and "amounts < 0 in 12 rows" in row.text() and "bo" in row.text()


def test_the_form_refuses_a_post_another_site_could_forge(airflow_api: Any, store: EpochStore,
                                                          gates: list[int]) -> None:
    e4 = gates[3]
    with TestClient(airflow_api, follow_redirects=False) as browser:
        browser.cookies.set("_token", make_token("bo", "user"))
        for headers in ({"Sec-Fetch-Site": "cross-site"}, {"Sec-Fetch-Site": "same-site"},
                        {"Origin": "https://evil.example"}, {}):
            r = browser.post(form("out", e4), data={"verdict": "pass"}, headers=headers)
            assert r.status_code == 403, (headers, r.status_code)
        # the JSON route takes JSON only (a cross-site form cannot send it)
        r = browser.post(api("out", e4), content="passed=true", headers={"Content-Type": "text/plain"})
        assert r.status_code in (415, 422), r.status_code
        ok = browser.post(form("out", e4), data={"verdict": "pass"}, headers={"Origin": "http://testserver"})
        assert ok.status_code == 303, ok.text
    assert state(store, e4)[:2] == (GateState.PASSED, "bo")


def test_an_illegal_move_is_a_409_and_an_unknown_gate_a_404(anon: TestClient, store: EpochStore,
                                                            gates: list[int]) -> None:
    e1, e2 = gates[:2]
    who = bearer("ana", "user")
    r = anon.post(api("out", e1), json={"passed": False, "reason": "too late"}, headers=who)
    assert r.status_code == 409
    assert f"the gate of sink 'out' for epoch {e1} of pipeline '{PID}' is committed" in r.json()["detail"]
    r = anon.post(form("out", e1), data={"verdict": "fail"}, headers={**who, **SAME_ORIGIN})
    assert r.status_code == 409 and "is committed" in r.text
    assert state(store, e1) == (GateState.COMMITTED, "check_rows", None)
    r = anon.post(api("out", 999), json={"passed": True}, headers=who)
    assert r.status_code == 404 and "no gate of sink 'out' for epoch 999" in r.json()["detail"]
    assert anon.post(api("nope", e2), json={"passed": True}, headers=who).status_code == 404
    assert anon.post(api("out", e2, pid="nobody"), json={"passed": True}, headers=who).status_code == 404
    assert state(store, e2) == (GateState.FAILED, "check_rows", "3 null keys")


def test_the_page_reads_the_open_gates_and_the_newest_closed_ones_of_each_sink_through_indexes(
        store: EpochStore) -> None:
    from airflow_arroyo.store import reads as q
    from airflow_arroyo.store.reads import CLOSED_GATES_SHOWN, StoreReader
    from tests.ui.test_queries import _nodes, _plan

    running(store, "many-gates", stages=["src", "a", "b"])
    reader = StoreReader(store.dsn)
    try:
        # 150 committed gates on each of two sinks, and two that wait on 'b'
        sql(store, "INSERT INTO arroyo_gates (pipeline_id, sink, epoch, run_id, uri, policy, batch_from, batch_to,"
                   " state, decided_by, decided_at, closed_at) SELECT 'many-gates', s, e, 'r1', 'u', 'hold', e, e,"
                   " 'committed', 'check', now(), now() FROM unnest(ARRAY['a', 'b']) s, generate_series(1, 150) e")
        for e in (151, 152):
            store.open_gate("many-gates", "b", e, run_id="r1", uri="u", policy=GatePolicy.HOLD, batch_from=e,
                            batch_to=e, details=FILES, timeout=None)
        shown = [(g.sink, g.epoch, g.state) for g in reader.pipeline_page("many-gates").gates]
        newest = [(s, e, GateState.COMMITTED) for e in range(150, 150 - CLOSED_GATES_SHOWN, -1) for s in ("a", "b")]
        assert shown == [("b", 151, GateState.PENDING), ("b", 152, GateState.PENDING), *newest]
        for name, bound in (("SQL_OPEN_GATES", 2), ("SQL_CLOSED_GATES", 2 * CLOSED_GATES_SHOWN + 2 * 2)):
            plan = _plan(store.dsn, getattr(q, name), {"p": "many-gates", "limit": CLOSED_GATES_SHOWN})
            nodes = [n for n in _nodes(plan) if n.get("Relation Name") == "arroyo_gates"]
            assert nodes and all("Index" in n["Node Type"] for n in nodes), (name, nodes)
            read = sum(int(n["Actual Rows"]) * int(n["Actual Loops"]) + int(n.get("Rows Removed by Filter", 0))
                       for n in nodes)
            assert read <= bound, (name, read, bound)  # not the 302 rows the pipeline has
    finally:
        reader.close()
        sql(store, "DELETE FROM arroyo_pipelines WHERE pipeline_id = 'many-gates'")
