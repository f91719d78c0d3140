"""The pipeline page's **Physical plan** section: the plan the driver recorded in the run's config
(``config["plan"]``, ``PhysicalPlan.as_dict()``), made here by the real planner on a small graph (no Spark:
the planner is given the statefulness facts Spark's analyzer would find)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from airflow_arroyo.runtime.pipeline import Pipeline
from airflow_arroyo.runtime.plan import Boundary, PhysicalPlan, plan_chains
from airflow_arroyo.store import EpochStore
from airflow_arroyo.ui.plan_view import ChannelRow, plan_view
from tests.support import sql
from tests.ui.html import Node, parse


def read(spark: Any) -> Any:  # never called: planning needs no Spark
    raise AssertionError("planning must not start Spark")


def ident(*dfs: Any) -> Any:
    return dfs[0]


def real_plan() -> PhysicalPlan:
    """src -> parse, read by agg and by the audit sink (fan-out); agg (stateful, update) -> fmt -> report,
    a sink that asks for a boundary (chain=False)."""
    p = Pipeline("planned", chaining=True)
    src = p.source("src", read)
    parsed = p.stage("parse", ident, inputs=[src])
    agg = p.stage("agg", ident, inputs=[parsed], output_mode="update")
    fmt = p.stage("fmt", ident, inputs=[agg])
    p.sink("report", inputs=[fmt], foreach_batch=lambda df, i: None, chain=False)
    p.sink("audit", inputs=[parsed], foreach_batch=lambda df, i: None)
    graph = p.validate()
    return plan_chains(graph, {**dict.fromkeys(graph.stage_names, False), "agg": True})


def test_the_real_plan_is_what_the_page_tests_expect() -> None:
    """The fixture plan itself (so that a planner change shows here, not as a puzzling page failure)."""
    plan = real_plan()
    assert [g.stages for g in plan.groups] == [("src", "parse"), ("agg", "fmt"), ("audit",), ("report",)]
    assert {(e.channel, r): why for e in plan.channels for r, why, _ in e.readers} == {
        ("parse", "agg"): Boundary.FAN_OUT, ("parse", "audit"): Boundary.FAN_OUT, ("fmt", "report"): Boundary.EXPLICIT}


# --------------------------------------------------------------------------- plan_view (pure)


def test_plan_view_turns_the_recorded_plan_into_rows() -> None:
    view = plan_view({"driver": "x", "plan": real_plan().as_dict()})
    assert view is not None and view.chaining is True and view.channel_count == 2 and view.unreadable == 0
    rows = {q.name: q for q in view.queries}
    assert list(rows) == ["src~parse", "agg~fmt", "audit", "report"] and view.fused_count == 2
    head, agg, audit = rows["src~parse"], rows["agg~fmt"], rows["audit"]
    assert (head.stages, head.fused, head.reads, head.writes, head.fused_channels) == (
        ("src", "parse"), True, "Spark sources", "parse", ("src",))
    assert (agg.reads, agg.writes, agg.output_mode, agg.stateful, agg.fused_channels) == (
        "parse", "fmt", "update", ("agg",), ("agg",))
    assert (audit.fused, audit.writes, audit.kind) == (False, "a sink", "sink")
    assert view.channel_rows is not None
    assert view.channel_rows[0] == ChannelRow("parse", "parse", "agg", "fan-out", "2 stages read 'parse'")
    assert view.channel_rows[2] == ChannelRow("fmt", "fmt", "report", "explicit",
                                              "'report' asked for a boundary (chain=False)")


@pytest.mark.parametrize("config", [
    None, {}, {"driver": "older"}, {"plan": None}, {"plan": "text"}, {"plan": []}, {"plan": {}},
    {"plan": {"pipeline_id": "p", "chaining": True}}, {"plan": {"queries": "q"}}, {"plan": {"queries": []}},
    {"plan": {"queries": [1, "two", None]}},
], ids=repr)
def test_plan_view_says_not_recorded_for_anything_without_usable_queries(config: Any) -> None:
    assert plan_view(config) is None


def test_plan_view_tolerates_a_partial_plan() -> None:
    view = plan_view({"plan": {"queries": [{"name": "q"}, {"stages": ["a", "b"], "output": None}, 7],
                               "channels": [{"channel": "c", "readers": [{"stage": "r"}]},
                                            {"channel": "out", "writer": "b", "readers": []},
                                            {"channel": "d", "writer": "a"}, "junk"]}})
    assert view is not None and view.chaining is None and view.unreadable == 2 and view.channel_count == 3
    q, ab = view.queries
    assert (q.name, q.stages, q.fused, q.reads, q.writes, q.output_mode, q.kind) == (
        "q", ("q",), False, "–", "–", "–", "")
    assert (ab.name, ab.stages, ab.fused, ab.writes) == ("a~b", ("a", "b"), True, "a sink")
    assert view.channel_rows == (
        ChannelRow("c", "?", "r", "", ""),
        ChannelRow("out", "b", None, "", "nobody in the pipeline reads it (an output for outside readers)"),
        ChannelRow("d", "a", None, "", "its readers were not recorded"))
    no_channels = plan_view({"plan": {"chaining": False, "queries": [{"name": "q", "stages": ["q"]}]}})
    assert no_channels is not None and no_channels.channel_rows is None and no_channels.chaining is False


# --------------------------------------------------------------------------- the page


@pytest.fixture
def registered(store: EpochStore) -> Iterator[Any]:
    """Register pipelines with a config for one test; removed afterwards (the dataset is shared)."""
    made: list[str] = []

    def register(pipeline_id: str, config: dict[str, Any] | None, stages: list[str] | None = None) -> None:
        store.register_pipeline(pipeline_id, stages=stages or ["s"], run_id=f"{pipeline_id}-1", config=config)
        made.append(pipeline_id)

    try:
        yield register
    finally:
        for pid in made:
            sql(store, "DELETE FROM arroyo_pipelines WHERE pipeline_id = %s", (pid,))


def page(client: TestClient, url: str) -> tuple[str, Node]:
    r = client.get(url)
    assert r.status_code == 200, (url, r.status_code, r.text[:500])
    return r.text, parse(r.text)


def cells(row: Node) -> list[str]:
    """The cells' text (Node.text() puts a space between elements: "<code>a</code>, ..." reads "a , ...")."""
    return [td.text().replace(" ,", ",") for td in row.find_all("td")]


@pytest.mark.airflow
def test_the_page_shows_the_fused_queries_and_why_each_channel_remains(client: TestClient, registered: Any) -> None:
    plan = real_plan()
    registered("planned", {"driver": "airflow_arroyo.runtime.driver", "plan": plan.as_dict()},
               plan.graph.stage_names)
    _, doc = page(client, "/arroyo/pipelines/planned")
    section = doc.find("section", id="plan")
    assert section.find_all(id="plan-missing") == []
    assert section.find("p", id="plan-summary").text() == "4 queries (2 fused), 2 channels · chaining on"

    queries = section.find("table", id="plan-queries").find_all("tr")[1:]
    assert [(r.attrs["data-query"], r.attrs["data-fused"], r.attrs["data-kind"]) for r in queries] == [
        ("src~parse", "true", "source"), ("agg~fmt", "true", "stage"), ("audit", "false", "sink"),
        ("report", "false", "sink")]
    head = section.find("tr", data_query="src~parse")
    assert [c.attrs["data-stage"] for c in head.find_all("code") if "data-stage" in c.attrs] == ["src", "parse"]
    assert head.find("span", **{"class": "badge fused"}).text() == "fused"
    assert cells(head) == ["src~parse", "fused src, parse", "Spark sources", "parse", "append", "none", "src"]
    assert cells(section.find("tr", data_query="agg~fmt")) == [
        "agg~fmt", "fused agg, fmt", "parse", "fmt", "update", "agg", "agg"]
    report = section.find("tr", data_query="report")
    assert cells(report) == ["report", "report", "fmt", "a sink", "append", "none", "–"]
    assert report.find_all("span", **{"class": "badge fused"}) == []

    channels = section.find("table", id="plan-channels").find_all("tr")[1:]
    assert [(r.attrs["data-channel"], r.attrs["data-writer"], r.attrs["data-reader"], r.attrs["data-reason"])
            for r in channels] == [("parse", "parse", "agg", "fan-out"), ("parse", "parse", "audit", "fan-out"),
                                   ("fmt", "fmt", "report", "explicit")]
    explicit = section.find("tr", data_channel="fmt", data_reader="report")
    assert cells(explicit) == ["fmt", "fmt → report", "explicit 'report' asked for a boundary (chain=False)"]
    assert explicit.find("span", **{"class": "badge boundary"}).text() == Boundary.EXPLICIT.value
    assert cells(section.find("tr", data_channel="parse", data_reader="audit"))[2] == "fan-out 2 stages read 'parse'"


@pytest.mark.airflow
def test_chaining_off_and_a_plan_without_channels(client: TestClient, registered: Any) -> None:
    p = Pipeline("unchained", chaining=False)
    src = p.source("src", read)
    p.sink("out", inputs=[src], foreach_batch=lambda df, i: None)
    plan = plan_chains(p.validate(), chaining=False)
    registered("unchained", {"plan": plan.as_dict()}, plan.graph.stage_names)
    _, doc = page(client, "/arroyo/pipelines/unchained")
    assert doc.find("p", id="plan-summary").text() == "2 queries, 1 channel · chaining off"
    (row,) = doc.find("table", id="plan-channels").find_all("tr")[1:]
    assert (row.attrs["data-reason"], cells(row)[1:]) == (
        "chaining-disabled", ["src → out", "chaining-disabled Pipeline(chaining=False)"])

    registered("partial", {"plan": {"queries": [{"name": "q", "stages": ["q"], "inputs": [], "output": None}]}})
    _, doc = page(client, "/arroyo/pipelines/partial")
    assert doc.find("p", id="plan-summary").text() == "1 query, channels not recorded · chaining not recorded"
    assert cells(doc.find("tr", data_query="q"))[2:4] == ["Spark sources", "a sink"]
    assert doc.find_all("table", id="plan-channels") == []


@pytest.mark.airflow
@pytest.mark.parametrize("config", [None, {"driver": "older"}, {"plan": {"pipeline_id": "old", "chaining": True}},
                                    {"plan": {"queries": ["not an object"], "channels": []}}], ids=repr)
def test_a_run_without_a_plan_says_it_was_not_recorded(client: TestClient, registered: Any, config: Any) -> None:
    registered("noplan", config)
    _, doc = page(client, "/arroyo/pipelines/noplan")
    section = doc.find("section", id="plan")
    assert section.find("p", id="plan-missing").text().startswith("Not recorded:")
    assert section.find_all("table") == [] and section.find_all(id="plan-summary") == []


@pytest.mark.airflow
def test_the_dataset_pipelines_registered_without_a_plan_say_so(client: TestClient) -> None:
    _, doc = page(client, "/arroyo/pipelines/orders")
    assert doc.find("section", id="plan").find("p", id="plan-missing")


@pytest.mark.airflow
def test_plan_text_from_the_row_is_escaped(client: TestClient, registered: Any) -> None:
    """Stage names the planner accepts cannot hold markup, but the row may come from anything."""
    evil = '<script>alert(1)</script>'
    attr = '"><img src=x onerror=alert(2)>'
    plan = real_plan().as_dict()
    plan["queries"][0]["name"] = attr
    plan["queries"][0]["stages"] = [evil, "parse"]
    plan["channels"][1]["readers"][0]["detail"] = "<b>bold</b> & 'quoted'"
    registered("escaped", {"plan": plan})
    text, doc = page(client, "/arroyo/pipelines/escaped")
    assert evil not in text and "<img" not in text and "<b>bold</b>" not in text
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in text
    row = doc.find("tr", data_query=attr)  # the attribute round-trips as text
    assert cells(row)[:2] == [attr, f"fused {evil}, parse"]
    assert [c.attrs["data-stage"] for c in row.find_all("code") if "data-stage" in c.attrs] == [evil, "parse"]
    assert doc.find_all("img") == [] and doc.find_all("b") == []
    assert cells(doc.find("tr", data_channel="fmt"))[2] == "explicit <b>bold</b> & 'quoted'"
