"""The pages and the JSON API, served by Airflow's real api-server app over a realistic epoch store.

What a page shows is checked against the store's own API (an independent reading), and links are
followed the way a browser would.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
from fastapi.testclient import TestClient

from airflow_arroyo.core.epochs import EpochState
from airflow_arroyo.store import EpochStore
from airflow_arroyo.ui.format import bytes_human, duration_human, epoch_ranges, timestamp
from tests.ui.conftest import mounted_arroyo_app
from tests.ui.data import Dataset
from tests.ui.html import Node, parse

pytestmark = pytest.mark.airflow


def page(client: TestClient, url: str) -> Node:
    r = client.get(url)
    assert r.status_code == 200, (url, r.status_code, r.text[:500])
    assert r.headers["content-type"].startswith("text/html")
    return parse(r.text)


def row_of(doc: Node, **attrs: str) -> Node:
    return doc.find("tr", **attrs)


def stage_statuses(doc: Node) -> dict[str, str]:
    return {r.attrs["data-stage"]: r.attrs["data-status"] for r in doc.find("table", id="stages").find_all("tr")[1:]}


# --------------------------------------------------------------------------- pipelines list


def test_pipelines_list_shows_every_pipeline_with_its_last_completed_epoch(client: TestClient,
                                                                           store: EpochStore) -> None:
    doc = page(client, "/arroyo/")
    rows = doc.find("table", id="pipelines").find_all("tr")[1:]
    assert [r.attrs["data-pipeline"] for r in rows] == [p.pipeline_id for p in store.list_pipelines()]
    for p in store.list_pipelines():
        row = row_of(doc, data_pipeline=p.pipeline_id)
        cells = row.find_all("td")
        assert p.state.value in cells[1].text()
        last = store.latest_completed_epoch(p.pipeline_id)
        cell = row.find("td", **{"class": "last-completed"})
        if last is None:
            assert "none" in cell.text()
        else:
            link = cell.find("a")
            assert link.text() == f"#{last.epoch}"
            assert link.attrs["href"] == f"/arroyo/pipelines/{p.pipeline_id}/epochs/{last.epoch}"
        assert duration_human(p.checkpoint_interval_s) in cells[5].text()


def test_pipelines_list_warns_about_failing_and_overdue_pipelines(client: TestClient) -> None:
    doc = page(client, "/arroyo/")
    clicks = row_of(doc, data_pipeline="clicks").find("td", **{"class": "health"})
    assert clicks.find("span").text() == "critical"
    failing = clicks.find("div", data_kind="failing").text()
    assert "the last 4 checkpoints failed" in failing and "epoch 60 failed" in failing and "disk full" in failing
    assert clicks.find("div", data_kind="cleanup")  # the held lock is mentioned

    sessions = row_of(doc, data_pipeline="sessions").find("td", **{"class": "health"})
    assert sessions.find("span").text() == "warning"
    assert "checkpoints are overdue" in sessions.find("div", data_kind="overdue").text()
    assert "heartbeat" in sessions.find("div", data_kind="heartbeat").text()

    orders = row_of(doc, data_pipeline="orders").find("td", **{"class": "health"})
    assert not orders.find_all("div", data_kind="failing")
    assert not orders.find_all("div", data_kind="cleanup")

    payments = row_of(doc, data_pipeline="payments").find("td", **{"class": "health"})
    assert not payments.find_all("div", data_kind="heartbeat")  # stopped: no heartbeat expected
    assert not payments.find_all("div", data_kind="cleanup")  # its lease expired: not held


def test_pipelines_list_shows_the_cleanup_lock_and_the_in_flight_epoch(client: TestClient) -> None:
    doc = page(client, "/arroyo/")
    assert row_of(doc, data_pipeline="clicks").find("a", **{"class": "badge lock-held"}).text() == "held"
    assert not row_of(doc, data_pipeline="orders").find_all("a", **{"class": "badge lock-held"})
    orders_cells = row_of(doc, data_pipeline="orders").find_all("td")
    assert orders_cells[7].find("a").text() == "#241"


def test_spark_links_only_for_http_urls(client: TestClient, store: EpochStore) -> None:
    doc = page(client, "/arroyo/")
    orders = row_of(doc, data_pipeline="orders").find_all("td")[3]
    assert orders.find("a").attrs["href"] == "http://127.0.0.1:4040"
    assert orders.find("a").text() == store.get_pipeline("orders").spark_app_id
    clicks = row_of(doc, data_pipeline="clicks").find_all("td")[3]  # its spark_ui_url is javascript:...
    assert not clicks.find_all("a")
    assert "javascript:" not in client.get("/arroyo/").text


def test_pipelines_list_pages(client: TestClient) -> None:
    seen, url = [], "/arroyo/?limit=2"
    while url:
        doc = page(client, url)
        seen += [r.attrs["data-pipeline"] for r in doc.find_all("tr") if "data-pipeline" in r.attrs]
        nxt = [a for a in doc.find_all("a") if a.attrs.get("rel") == "next"]
        url = nxt[0].attrs["href"] if nxt else ""
    assert seen == ["clicks", "fresh", "orders", "payments", "sessions"]


# --------------------------------------------------------------------------- a pipeline's page


def test_pipeline_page_history_table_and_chart(client: TestClient, store: EpochStore) -> None:
    doc = page(client, "/arroyo/pipelines/orders?limit=50")
    expected = store.list_epochs("orders", limit=50)
    rows = doc.find("table", id="epochs").find_all("tr")[1:]
    assert [int(r.attrs["data-epoch"]) for r in rows] == [e.epoch for e in expected]
    for row, e in zip(rows, expected, strict=True):
        assert row.attrs["data-state"] == e.state.value
        cells = row.find_all("td")
        if e.state is not EpochState.TRIGGERED:
            assert cells[3].text() == duration_human(e.duration_s)
        assert cells[4].text() == bytes_human(e.bytes_new)
        assert cells[5].text() == bytes_human(e.bytes_total)
        if e.failure_reason:
            assert e.failure_reason in cells[7].text()
    svg = doc.find("svg")
    assert "history" in svg.attrs["class"]
    states = "|".join(s.value for s in EpochState)
    bars = [r.find("title").text() for r in svg.find_all("rect") if r.find_all("title")
            and re.match(rf"epoch \d+ · ({states}) · ", r.find("title").text())]
    assert len(bars) == 50  # one duration bar per epoch on the page
    assert [b.split(" · ")[1] for b in bars] == [e.state.value for e in reversed(expected)]
    assert sum(1 for b in bars if b.startswith("epoch 241 · triggered")) == 1
    assert len([c for c in svg.find_all("circle")]) == sum(1 for e in expected if e.bytes_total is not None)


def test_pipeline_page_facts_and_warnings(client: TestClient, store: EpochStore) -> None:
    doc = page(client, "/arroyo/pipelines/clicks")
    h1 = doc.find("h1").text()
    assert "clicks" in h1 and "running" in h1 and "critical" in h1
    kinds = [li.attrs["data-kind"] for li in doc.find("ul", **{"class": "findings"}).find_all("li")]
    assert kinds[0] == "failing"  # most severe first
    assert "cleanup" in kinds
    last = store.latest_completed_epoch("clicks")
    assert last is not None and f"#{last.epoch}" in doc.find("dd", id="last-completed").text()


def test_following_older_and_newer_links_walks_the_whole_history(client: TestClient, store: EpochStore) -> None:
    all_epochs = [e.epoch for e in store.list_epochs("orders", limit=1000)]
    url, pages_seen, seen = "/arroyo/pipelines/orders?limit=60", 0, []
    while url:
        doc = page(client, url)
        pages_seen += 1
        seen += [int(r.attrs["data-epoch"]) for r in doc.find_all("tr") if "data-epoch" in r.attrs]
        older = [a for a in doc.find_all("a") if a.attrs.get("rel") == "next"]
        url = older[0].attrs["href"] if older else ""
    assert seen == all_epochs
    assert pages_seen == 5  # 241 epochs, 60 a page
    # and one step back up from the oldest page
    newer = [a for a in doc.find_all("a") if a.attrs.get("rel") == "prev"]
    back = page(client, newer[0].attrs["href"])
    assert [int(r.attrs["data-epoch"]) for r in back.find_all("tr") if "data-epoch" in r.attrs] == all_epochs[180:240]


def test_pipeline_without_epochs(client: TestClient) -> None:
    doc = page(client, "/arroyo/pipelines/fresh")
    assert "No epochs yet" in doc.find("svg").text()
    assert "No epochs on this page" in doc.find("table", id="epochs").text()


# --------------------------------------------------------------------------- an epoch's page


def test_in_flight_epoch_page_names_the_stages_not_acknowledged(client: TestClient, dataset: Dataset) -> None:
    plan = dataset.plan("orders")
    in_flight = plan.epochs[-1]
    doc = page(client, "/arroyo/pipelines/orders/epochs/241")
    pending = [li.text() for li in doc.find("div", id="pending").find_all("li")]
    assert pending == [s for s in plan.stages if s not in in_flight.acked_stages]
    statuses = stage_statuses(doc)
    assert statuses == {s: ("acknowledged" if s in in_flight.acked_stages else "waiting") for s in plan.stages}
    svg = doc.find("svg")
    assert "timeline" in svg.attrs["class"]
    waiting = [t.text() for t in svg.find_all("title") if t.text().endswith("has not acknowledged yet")]
    assert len(waiting) == len(pending)


def test_completed_epoch_page_shows_per_stage_timings(client: TestClient, store: EpochStore) -> None:
    done = store.latest_completed_epoch("orders")
    assert done is not None
    doc = page(client, f"/arroyo/pipelines/orders/epochs/{done.epoch}")
    assert not doc.find_all("div", id="pending")
    assert doc.find("dd", id="duration").text() == duration_human(done.duration_s)
    rows = {r.attrs["data-stage"]: r.find_all("td") for r in doc.find("table", id="stages").find_all("tr")[1:]}
    acks = {a.stage: a for a in store.acks("orders", done.epoch)}
    assert set(rows) == set(acks) == set(done.stages)
    for stage, ack in acks.items():
        cells = rows[stage]
        assert cells[1].text() == "acknowledged"
        assert cells[2].text() == duration_human((ack.acked_at - done.triggered_at).total_seconds())
        assert cells[4].text() == duration_human(ack.alignment_ms / 1000)
        assert cells[5].text() == duration_human(ack.sync_ms / 1000)
        assert cells[6].text() == duration_human(ack.async_ms / 1000)
        assert cells[7].text() == bytes_human(ack.bytes_new)
        assert cells[10].text() == ack.snapshot_uri
    # the timeline has the four parts for each stage
    titles = [t.text() for t in doc.find("svg").find_all("title")]
    for stage in acks:
        for part in ("alignment", "sync snapshot", "async snapshot"):
            assert any(t.startswith(f"{stage} · {part} ") for t in titles), (stage, part)


def test_epoch_page_shows_each_stages_state_size_and_rows(client: TestClient, store: EpochStore) -> None:
    from airflow_arroyo.core.epochs import CheckpointPolicy
    from tests.support import running, sql

    running(store, "stateful-ui", stages=["src", "counts", "legacy"])
    try:
        epoch = store.trigger_tick("stateful-ui", CheckpointPolicy(interval=3600, timeout=3600), force=True).started
        assert epoch is not None
        recorded = {"src": {"batch_id": 3, "state_bytes": 0, "state_rows": None},
                    "counts": {"batch_id": 3, "state_bytes": 1_234_567, "state_rows": 42},
                    "legacy": {"batch_id": 3}}  # acknowledged by a release that did not record them
        for stage, details in recorded.items():
            store.ack_epoch("stateful-ui", epoch.epoch, stage, details=details)
        doc = page(client, f"/arroyo/pipelines/stateful-ui/epochs/{epoch.epoch}")
        headers = [th.text() for th in doc.find("table", id="stages").find_all("th")]
        rows = {r.attrs["data-stage"]: r.find_all("td") for r in doc.find("table", id="stages").find_all("tr")[1:]}
        at = headers.index("State"), headers.index("State rows")
        shown = {stage: (cells[at[0]].text(), cells[at[1]].text()) for stage, cells in rows.items()}
        assert shown == {"src": ("0 B", "–"), "counts": (bytes_human(1_234_567), "42"), "legacy": ("–", "–")}
        api = client.get(f"/arroyo/api/pipelines/stateful-ui/epochs/{epoch.epoch}").json()
        assert {s["stage"]: (s["state_bytes"], s["state_rows"]) for s in api["stages"]} == {
            "src": (0, None), "counts": (1_234_567, 42), "legacy": (None, None)}
    finally:  # the dataset is shared: other tests count its pipelines
        sql(store, "DELETE FROM arroyo_pipelines WHERE pipeline_id = 'stateful-ui'")


def test_failed_epoch_page_says_why_and_which_stages_never_acknowledged(client: TestClient, dataset: Dataset,
                                                                        store: EpochStore) -> None:
    failed = next(e for e in dataset.plan("orders").epochs if e.outcome == "failed" and e.epoch > 150)
    record = store.get_epoch("orders", failed.epoch)
    doc = page(client, f"/arroyo/pipelines/orders/epochs/{failed.epoch}")
    assert record.failure_reason and record.failure_reason in doc.text()
    statuses = stage_statuses(doc)
    assert statuses == {s: ("acknowledged" if s in failed.acked_stages else "missing")
                        for s in dataset.plan("orders").stages}


def test_epoch_navigation_links(client: TestClient) -> None:
    doc = page(client, "/arroyo/pipelines/orders/epochs/200")
    rels = {a.attrs.get("rel"): a.attrs["href"] for a in doc.find_all("a") if a.attrs.get("rel")}
    assert rels == {"prev": "/arroyo/pipelines/orders/epochs/199", "next": "/arroyo/pipelines/orders/epochs/201"}
    newest = page(client, "/arroyo/pipelines/orders/epochs/241")
    assert "next" not in {a.attrs.get("rel") for a in newest.find_all("a")}


# --------------------------------------------------------------------------- retention


def test_retention_page_of_a_pipeline_whose_lock_is_held(client: TestClient, dataset: Dataset) -> None:
    doc = page(client, "/arroyo/pipelines/clicks/retention")
    lock = doc.find("div", id="lock")
    assert lock.attrs["data-live"] == "true"
    assert "retention__clicks" in lock.text() and f"cleanup run {dataset.held_lock_run}" in lock.text()
    states = {int(r.attrs["data-run"]): r.attrs["data-state"] for r in doc.find_all("tr") if "data-run" in r.attrs}
    assert states == {dataset.held_lock_run: "running", dataset.lost_lock_run: "lock_lost"}


def test_retention_page_shows_what_was_pruned_and_freed(client: TestClient, store: EpochStore) -> None:
    doc = page(client, "/arroyo/pipelines/orders/retention")
    assert doc.find("p", id="lock").attrs["data-live"] == "false"
    for run in store.list_cleanup_runs("orders"):
        cells = row_of(doc, data_run=str(run.id)).find_all("td")
        assert cells[1].text() == "succeeded"
        assert cells[5].text() == f"{len(run.epochs_pruned)} ({epoch_ranges(run.epochs_pruned)})"
        assert cells[6].text() == bytes_human(run.bytes_freed)
        assert cells[7].text() == "keep the last 90 completed or those newer than 1d"
    expired = page(client, "/arroyo/pipelines/payments/retention").find("div", id="lock")
    assert expired.attrs["data-live"] == "false" and "expired lease" in expired.text()


# --------------------------------------------------------------------------- JSON API


def test_api_pipelines(client: TestClient, store: EpochStore) -> None:
    body = client.get("/arroyo/api/pipelines").json()
    assert [p["pipeline"]["pipeline_id"] for p in body["pipelines"]] == [p.pipeline_id for p in store.list_pipelines()]
    by_id = {p["pipeline"]["pipeline_id"]: p for p in body["pipelines"]}
    for pid, item in by_id.items():
        last = store.latest_completed_epoch(pid)
        assert (item["last_completed_epoch"] or {}).get("epoch") == (last.epoch if last else None)
    assert by_id["clicks"]["health"] == "critical" and by_id["clicks"]["consecutive_failures"] == 4
    assert by_id["clicks"]["cleanup_lock"]["holder"] == "retention__clicks"
    assert {w["kind"] for w in by_id["sessions"]["warnings"]} >= {"overdue", "heartbeat"}
    assert by_id["orders"]["in_flight_epoch"]["epoch"] == 241


def test_api_epochs_paginate(client: TestClient, store: EpochStore) -> None:
    body = client.get("/arroyo/api/pipelines/orders/epochs", params={"limit": 10, "before": 100}).json()
    assert [e["epoch"] for e in body["epochs"]] == list(range(99, 89, -1))
    assert body["older_before"] == 90 and body["newer_after"] == 99
    assert [e["state"] for e in body["epochs"]] == [e.state.value for e in store.list_epochs("orders", limit=10,
                                                                                              before=100)]


def test_api_epoch_detail(client: TestClient, dataset: Dataset) -> None:
    body = client.get("/arroyo/api/pipelines/orders/epochs/241").json()
    plan = dataset.plan("orders")
    assert body["epoch"]["state"] == "triggered"
    assert body["pending_stages"] == [s for s in plan.stages if s not in plan.epochs[-1].acked_stages]
    assert [a["stage"] for a in body["acks"]] == plan.epochs[-1].acked_stages
    acked = [s for s in body["stages"] if s["status"] == "acknowledged"]
    assert all({p["part"] for p in s["segments"]} >= {"alignment", "sync", "async"} for s in acked)


def test_api_retention(client: TestClient, dataset: Dataset) -> None:
    body = client.get("/arroyo/api/pipelines/clicks/retention").json()
    assert body["cleanup_lock"]["live"] is True
    assert body["cleanup_lock"]["cleanup_run"] == dataset.held_lock_run
    assert [r["state"] for r in body["cleanup_runs"]] == ["running", "lock_lost"]


# --------------------------------------------------------------------------- errors, headers


@pytest.mark.parametrize("url", ["/arroyo/pipelines/nope", "/arroyo/pipelines/orders/epochs/99999",
                                 "/arroyo/pipelines/bad%20id!", "/arroyo/pipelines/nope/retention"])
def test_unknown_things_are_404_pages(client: TestClient, url: str) -> None:
    r = client.get(url)
    assert r.status_code == 404 and r.headers["content-type"].startswith("text/html")
    assert "All pipelines" in r.text


def test_unknown_things_are_404_json_in_the_api(client: TestClient) -> None:
    r = client.get("/arroyo/api/pipelines/nope")
    assert r.status_code == 404 and "nope" in r.json()["detail"]
    assert client.get("/arroyo/api/pipelines/orders/epochs/99999").status_code == 404


def test_bad_parameters_are_422(client: TestClient) -> None:
    assert client.get("/arroyo/api/pipelines/orders/epochs", params={"limit": 0}).status_code == 422
    assert client.get("/arroyo/pipelines/orders", params={"before": "x"}).status_code == 422


def test_no_store_configured_is_a_503_that_says_what_to_do(client: TestClient, airflow_api: Any,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    source = mounted_arroyo_app(airflow_api).state.arroyo_source
    monkeypatch.delenv("AIRFLOW_CONN_ARROYO_DEFAULT")
    source.reset()
    try:
        r = client.get("/arroyo/api/pipelines")
        assert r.status_code == 503
        assert "arroyo_default" in r.json()["detail"]
        assert client.get("/arroyo/").status_code == 503
    finally:
        monkeypatch.undo()
        source.reset()
    assert client.get("/arroyo/api/pipelines").status_code == 200


def test_security_headers(client: TestClient) -> None:
    r = client.get("/arroyo/pipelines/orders")
    csp = r.headers["content-security-policy"]
    assert "frame-ancestors 'self'" in csp and "default-src 'none'" in csp and "script-src" not in csp
    assert r.headers["x-content-type-options"] == "nosniff"
    css = client.get("/arroyo/static/arroyo.css")
    assert css.status_code == 200 and css.headers["content-type"].startswith("text/css")


@pytest.mark.usefixtures("airflow_api")
def test_links_follow_a_deployment_path_prefix(dataset: Dataset) -> None:
    """Airflow behind ``[api] base_url = https://host/airflow``: every link keeps the prefix."""
    from fastapi import FastAPI

    from airflow_arroyo.ui.app import create_app
    from airflow_arroyo.ui.store_source import StoreSource
    from tests.ui.conftest import make_token

    source = StoreSource(lambda: dataset.dsn)
    parent = FastAPI(root_path="/airflow")
    parent.mount("/arroyo", create_app(source))
    try:
        with TestClient(parent) as c:
            c.headers["Authorization"] = f"Bearer {make_token()}"
            doc = page(c, "/airflow/arroyo/")
            hrefs = [a.attrs["href"] for a in doc.find_all("a") if a.attrs["href"].startswith("/")]
            assert hrefs and all(h.startswith("/airflow/arroyo/") for h in hrefs), hrefs
            assert doc.find("link").attrs["href"] == "/airflow/arroyo/static/arroyo.css"
            for h in sorted(set(hrefs))[:12]:
                assert c.get(h).status_code == 200, h
            assert c.get("/airflow/arroyo/api/pipelines/nope").json()["detail"].startswith("no pipeline")
    finally:
        source.close()


# --------------------------------------------------------------------------- issue 10: what a newcomer met


def test_summary_matches_an_independent_computation_over_the_whole_history(client: TestClient,
                                                                            store: EpochStore) -> None:
    """Flink-like summary: the SQL percentiles equal the pure nearest-rank ones over the store's epochs."""
    from airflow_arroyo.core.summary import summarize

    epochs = store.list_epochs("orders", limit=10_000)
    ok = [e for e in epochs if e.ended_at is not None and e.failure_reason is None]
    expected = summarize(("completed", e.duration_s, e.bytes_total) for e in ok)
    doc = page(client, "/arroyo/pipelines/orders")
    cells = {td.attrs["data-key"]: td.text() for td in doc.find("table", id="summary").find_all("td")
             if "data-key" in td.attrs}
    assert cells["completed"] == str(len(ok))
    # by how each ended: a pruned epoch that failed or expired still counts (its outcome survives pruning)
    assert cells["failed"] == (f"{sum(e.outcome is EpochState.FAILED for e in epochs)} / "
                               f"{sum(e.outcome is EpochState.EXPIRED for e in epochs)}")
    assert cells["duration_p50"] == duration_human(expected.duration_p50_s)
    assert cells["duration_p99"] == duration_human(expected.duration_p99_s)
    assert cells["size_p50"] == bytes_human(expected.size_p50)
    assert cells["size_p99"] == bytes_human(expected.size_p99)
    assert page(client, "/arroyo/pipelines/fresh").find_all("table", id="summary") == []  # no epochs: no summary


def test_pages_refresh_themselves_only_while_an_epoch_is_in_flight(client: TestClient) -> None:
    def refresh(url: str) -> str | None:
        text = client.get(url).text
        m = re.search(r'<meta http-equiv="refresh" content="(\d+)">', text)
        return m.group(1) if m else None

    assert refresh("/arroyo/pipelines/orders") == "5"  # epoch 241 in flight
    assert refresh("/arroyo/pipelines/orders/epochs/241") == "5"
    assert refresh("/arroyo/") == "5"
    assert refresh("/arroyo/pipelines/orders?before=100") is None  # older history stays still
    assert refresh("/arroyo/pipelines/orders/epochs/240") is None
    assert refresh("/arroyo/pipelines/payments") is None  # stopped


def test_a_completed_epoch_says_how_to_restore_from_it(client: TestClient, store: EpochStore,
                                                       dataset: Dataset) -> None:
    doc = page(client, "/arroyo/pipelines/orders/epochs/240")
    hint = doc.find(id="restore").text()
    assert "restore_from=240" in hint and '{"restore_from": "240"}' in hint and "--restore-from 240" in hint
    pruned = dataset.orders_pruned[0]
    assert "Not restorable: retention pruned it" in page(client, f"/arroyo/pipelines/orders/epochs/{pruned}").find(
        id="restore").text()
    failed = next(e.epoch for e in store.list_epochs("orders", limit=300) if e.state is EpochState.FAILED)
    assert "Not restorable: it failed" in page(client, f"/arroyo/pipelines/orders/epochs/{failed}").find(
        id="restore").text()
    assert page(client, "/arroyo/pipelines/orders/epochs/241").find_all(id="restore") == []  # in flight


def test_a_pinned_epoch_shows_its_label_in_the_history_and_on_its_page(client: TestClient,
                                                                        store: EpochStore) -> None:
    label = "before <the> 2.0 upgrade"  # escaped like any other text
    store.pin_epoch("orders", 240, label)
    try:
        history = page(client, "/arroyo/pipelines/orders")
        row = row_of(history, **{"data-epoch": "240"})
        assert row.attrs["data-pin"] == label and f"pinned: {label}" in row.text()
        assert [r.attrs["data-epoch"] for r in history.find("table", id="epochs").find_all("tr")
                if "data-pin" in r.attrs] == ["240"]
        pin = page(client, "/arroyo/pipelines/orders/epochs/240").find(id="pin").text()
        assert pin.startswith(label + " (since ") and "airflow-arroyo unpin orders 240" in pin
        assert client.get("/arroyo/api/pipelines/orders/epochs/240").json()["epoch"]["pin_label"] == label
    finally:
        store.unpin_epoch("orders", 240)
    assert page(client, "/arroyo/pipelines/orders/epochs/240").find_all(id="pin") == []


def test_forks_and_the_fork_point_restored_from_show_on_both_pipelines(client: TestClient,
                                                                      store: EpochStore) -> None:
    from tests.support import sql

    fork = store.fork_pipeline("orders", 240, "orders-fork")
    try:
        source = page(client, "/arroyo/pipelines/orders")
        assert source.find(id="forks").text() == "orders-fork (from epoch 240)"
        assert source.find(id="forks").find("a").attrs["href"] == "/arroyo/pipelines/orders-fork"
        assert row_of(source, **{"data-epoch": "240"}).attrs["data-pin"] == "fork:orders-fork"
        forked = page(client, "/arroyo/pipelines/orders-fork")
        link = forked.find(id="forked-from").find("a")
        assert (link.text(), link.attrs["href"]) == ("epoch 240 of orders", "/arroyo/pipelines/orders/epochs/240")
        assert forked.find_all(id="restored-from") == []  # not started yet
        # its first run restored the fork point: "restored from" names the source's epoch
        store.register_pipeline("orders-fork", stages=fork.stages, run_id="fork-run")
        store.commit_fork_restore("orders-fork", "fork-run")
        restored = page(client, "/arroyo/pipelines/orders-fork").find(id="restored-from").find("a")
        assert (restored.text(), restored.attrs["href"]) == ("epoch 240 of orders (the fork point)",
                                                             "/arroyo/pipelines/orders/epochs/240")
        api = client.get("/arroyo/api/pipelines/orders-fork").json()
        assert (api["pipeline"]["forked_from_pipeline"], api["pipeline"]["forked_from_epoch"]) == ("orders", 240)
    finally:
        store.unpin_epoch("orders", 240, force=True)
        sql(store, "DELETE FROM arroyo_pipelines WHERE pipeline_id = 'orders-fork'")
    assert page(client, "/arroyo/pipelines/orders").find_all(id="forks") == []


def test_a_supervised_pipeline_shows_its_supervision_and_every_restart(client: TestClient,
                                                                       store: EpochStore) -> None:
    from airflow_arroyo.core.epochs import CheckpointPolicy, PipelineState
    from airflow_arroyo.core.supervision import FixedDelay, PastFailure, RestartDecision, decide_restart, restart_run_id
    from tests.support import sql

    strategy = FixedDelay(attempts=2, delay=10)

    def decide(failures: list[PastFailure], now: Any, stop_requested: bool) -> RestartDecision:
        return decide_restart(strategy, failures, now, lineage="metrics-1", stop_requested=stop_requested)

    cause = ("the driver of run metrics-1 failed: stage 'agg' <b>could not</b> snapshot\n"
             "Traceback (most recent call last):\nOSError")
    store.register_pipeline("metrics", stages=["src"], run_id="metrics-1")
    try:
        store.set_pipeline_state("metrics", PipelineState.RUNNING, run_id="metrics-1")
        store.supervise("metrics", "metrics-1", strategy.to_dict())
        epoch = store.trigger_tick("metrics", CheckpointPolicy(interval=60), force=True).started
        assert epoch is not None and store.ack_epoch("metrics", epoch.epoch, "src") is EpochState.COMPLETED
        assert page(client, "/arroyo/pipelines/metrics").find_all(id="restarts") == []  # supervised, no failure yet
        store.record_failure("metrics", "metrics-1", "metrics-1", cause, decide)
        store.register_pipeline("metrics", stages=["src"], run_id=restart_run_id("metrics-1", 1), takeover=True)
        store.record_restart("metrics", "metrics-1", 1, restart_run_id("metrics-1", 1), epoch.epoch)
        store.record_failure("metrics", "metrics-1", "metrics-1.restart1", "heartbeat stopped", decide)

        doc = page(client, "/arroyo/pipelines/metrics")
        supervision = doc.find("dd", id="supervision")
        assert supervision.attrs["data-state"] == "restarting"
        assert supervision.text() == ("restarting lineage metrics-1 · restart strategy fixed-delay: up to 2 restarts, "
                                      "10s after each failure · restarts")
        rows = doc.find("table", id="restarts").find_all("tr")[1:]
        assert [(r.attrs["data-attempt"], r.attrs["data-outcome"]) for r in rows] == [("2", "pending"),
                                                                                      ("1", "restarted")]
        due, restarted = ([c.text() for c in r.find_all("td")] for r in rows)
        recorded = store.restarts("metrics")
        assert due[1:4] == [timestamp(recorded[0].failed_at), "metrics-1.restart1", "heartbeat stopped"]
        assert due[4] == "restart 2 of 2 (fixed-delay)" and due[5].startswith("pending due in ") and due[6] == "–"
        assert restarted[2] == "metrics-1" and restarted[4] == "restart 1 of 2 (fixed-delay)"
        assert (restarted[5], restarted[6]) == ("metrics-1.restart1", f"#{epoch.epoch}")
        cause_cell = rows[1].find("td", **{"class": "cause wrap"})
        assert cause_cell.find("summary").text() == cause.splitlines()[0]  # the first line; all of it when opened
        assert cause_cell.find("pre").text() == " ".join(cause.split())
        assert "<b>could not</b>" not in client.get("/arroyo/pipelines/metrics").text  # escaped like any text
        link = rows[1].find("a")
        assert link.attrs["href"] == f"/arroyo/pipelines/metrics/epochs/{epoch.epoch}"
        assert client.get(link.attrs["href"]).status_code == 200

        # the restart happens, the run fails a third time, and the strategy gives up
        store.register_pipeline("metrics", stages=["src"], run_id=restart_run_id("metrics-1", 2), takeover=True)
        store.record_restart("metrics", "metrics-1", 2, restart_run_id("metrics-1", 2), epoch.epoch)
        store.record_failure("metrics", "metrics-1", "metrics-1.restart2", "exit code 137", decide)
        doc = page(client, "/arroyo/pipelines/metrics")
        assert doc.find("dd", id="supervision").attrs["data-state"] == "gave_up"
        rows = doc.find("table", id="restarts").find_all("tr")[1:]
        assert [(r.attrs["data-attempt"], r.attrs["data-outcome"]) for r in rows] == [
            ("3", "gave_up"), ("2", "restarted"), ("1", "restarted")]
        gave_up = [c.text() for c in rows[0].find_all("td")]
        assert gave_up[3:] == ["exit code 137", "3 failures, more than the 2 restart(s) fixed-delay allows", "gave up",
                               "–"]
    finally:
        sql(store, "DELETE FROM arroyo_pipelines WHERE pipeline_id = 'metrics'")
    orders = page(client, "/arroyo/pipelines/orders")  # never supervised: neither section
    assert orders.find_all(id="supervision") == [] and orders.find_all(id="restarts") == []


def test_the_retention_policy_reads_as_words(client: TestClient) -> None:
    doc = page(client, "/arroyo/pipelines/orders/retention")
    policies = [td.text() for td in doc.find("table", id="cleanup-runs").find_all("td") if "policy" in
                td.attrs.get("class", "")]
    assert policies and all(p.startswith("keep the last ") for p in policies), policies
    assert not any("=" in p or "{" in p or "None" in p for p in policies), policies


def test_policy_text() -> None:
    from airflow_arroyo.ui.format import policy_text

    assert policy_text({"keep_last": 3, "keep_newer_than_s": None}) == "keep the last 3 completed"
    assert policy_text({"keep_last": 90, "max_age_s": 86400}) == "keep the last 90 completed or those newer than 1d"
    assert policy_text({"keep_newer_than_s": 5400.0}) == "keep those newer than 1h 30m"
    assert policy_text({}) == "–"
