"""Operator chaining (runtime/plan.py): which stages fuse into one query and why each remaining channel stays.

The planner is pure: these tests give it the statefulness facts Spark's analyzer would. One test asks the
analyzer itself (the session ``spark`` fixture; analysis only, no query runs)."""

from __future__ import annotations

from typing import Any

import pytest

from airflow_arroyo.examples import OUTPUT_CHANNEL, SINK_STAGE, demo
from airflow_arroyo.runtime import stage
from airflow_arroyo.runtime.pipeline import Pipeline, StageKind
from airflow_arroyo.runtime.plan import Boundary, ChainedTransform, PhysicalPlan, plan_chains, plan_nodes


def read(spark: Any) -> Any:  # never called: planning needs no Spark
    raise AssertionError("planning must not start Spark")


def ident(*dfs: Any) -> Any:
    return dfs[0]


def reasons(plan: PhysicalPlan) -> dict[tuple[str, str], Boundary]:
    """(channel, reader) -> why the channel remains."""
    return {(e.channel, r): why for e in plan.channels for r, why, _ in e.readers}


def groups(plan: PhysicalPlan) -> list[tuple[str, ...]]:
    return [g.stages for g in plan.groups]


def linear(*, chaining: bool | None = True, **sink: Any) -> Pipeline:
    p = Pipeline("lin", chaining=chaining)
    src = p.source("src", read)
    a = p.stage("a", ident, inputs=[src])
    b = p.stage("b", ident, inputs=[a])
    p.sink("out", inputs=[b], foreach_batch=lambda df, i: None, **sink)
    return p


STATELESS = {"src": False, "a": False, "b": False, "out": False}


def test_a_stateless_line_fuses_into_one_query_that_reads_the_source_and_writes_the_sink() -> None:
    plan = plan_chains(linear().validate(), STATELESS)
    (group,) = plan.groups
    assert group.stages == ("src", "a", "b", "out") and group.name == "src~a~b~out"
    assert group.fused_channels == ("src", "a", "b") and plan.channels == ()
    spec = group.spec
    assert spec.kind is StageKind.SOURCE and spec.output is None and spec.foreach_batch is not None
    assert spec.inputs == () and isinstance(spec.fn, ChainedTransform)
    graph = plan.graph
    assert graph.stage_names == ["src~a~b~out"] and graph.channels == [] and dict(graph.writers) == {}
    text = plan.explain()
    assert "query src~a~b~out: src -> a -> b -> out; reads Spark sources; writes a sink" in text
    assert plan.as_dict()["queries"][0]["fused_channels"] == ["src", "a", "b"]


def test_the_composed_transform_applies_each_member_in_order_and_a_sink_without_transform_passes_through() -> None:
    fns = (lambda spark: [spark], lambda x: [*x, "a"], lambda x: [*x, "b"], None)
    assert ChainedTransform(("src", "a", "b", "out"), fns)("S") == ["S", "a", "b"]
    two = ChainedTransform(("j", "c"), (lambda left, right: [left, right], lambda x: [*x, "c"]))
    assert two("L", "R") == ["L", "R", "c"]
    merged = ChainedTransform(("l", "r", "j", "c"), (lambda left, right: [left, right], lambda x: [*x, "c"]),
                              branches=(lambda spark: spark + "L", lambda spark: spark + "R"))
    assert merged("S") == ["SL", "SR", "c"]


def test_the_graph_decides_by_default() -> None:
    """Operator chaining is decided by the graph unless the pipeline says otherwise."""
    assert Pipeline("p").chaining is None and Pipeline("p").chains
    assert not Pipeline("p", chaining=False).chains
    assert groups(plan_chains(linear(chaining=None).validate(), STATELESS, chaining=linear(chaining=None).chains)) \
        == groups(plan_chains(linear().validate(), STATELESS))


def test_chaining_off_keeps_every_stage_and_channel_as_declared() -> None:
    graph = linear(chaining=False).validate()
    plan = plan_chains(graph, STATELESS, chaining=False)
    assert plan.graph.stages == graph.stages and dict(plan.graph.writers) == dict(graph.writers)
    assert set(reasons(plan).values()) == {Boundary.DISABLED} and len(plan.channels) == 3
    assert "(chaining disabled)" in plan.explain()


def test_unknown_statefulness_counts_as_stateful_so_nothing_fuses_without_spark() -> None:
    plan = linear().physical_plan()  # no SparkSession: no stage is known to be stateless
    assert groups(plan) == [("src",), ("a",), ("b",), ("out",)]
    assert set(reasons(plan).values()) == {Boundary.STATEFUL}
    assert "not known to be stateless" in plan.explain()


def test_a_stage_spark_could_not_analyze_runs_alone_so_that_its_errors_name_it() -> None:
    """A transform that raised while analyzed (it will raise again when built) is not fused into a neighbour's
    query: the build error then names the stage, not a fused group."""
    plan = plan_chains(linear().validate(), {**STATELESS, "a": None})
    assert groups(plan) == [("src",), ("a",), ("b", "out")]
    assert reasons(plan)[("src", "a")] is reasons(plan)[("a", "b")] is Boundary.STATEFUL
    assert "a could not be analyzed" in plan.explain()


def test_a_stateful_stage_fuses_with_stateless_neighbours_but_never_with_another_stateful_one() -> None:
    graph = linear().validate()
    plan = plan_chains(graph, {**STATELESS, "a": True})
    assert groups(plan) == [("src", "a", "b", "out")]
    plan = plan_chains(graph, {**STATELESS, "a": True, "out": True})
    assert groups(plan) == [("src", "a", "b"), ("out",)]
    assert reasons(plan) == {("b", "out"): Boundary.STATEFUL}


def test_the_demo_runs_its_sources_join_and_filter_as_one_query() -> None:
    p = demo("d", sink_path="/tmp/never-written", chaining=True)
    facts = {"left": False, "right": False, "joined": True, OUTPUT_CHANNEL: False, SINK_STAGE: False}
    plan = plan_chains(p.validate(), facts)
    # both inputs of the join come from source queries: one query reads both sources (a consistent cut, nothing
    # to align); the sink asks for a boundary (chain=False) so that the report channel stays readable
    assert groups(plan) == [("left", "right", "joined", OUTPUT_CHANNEL), (SINK_STAGE,)]
    assert reasons(plan) == {(OUTPUT_CHANNEL, SINK_STAGE): Boundary.EXPLICIT}
    fused = plan.group_of("joined")
    assert fused.name == f"left~right~joined~{OUTPUT_CHANNEL}" and fused.spec.inputs == ()
    assert fused.spec.output == OUTPUT_CHANNEL and fused.spec.kind is StageKind.SOURCE
    assert plan.fused_channels == ["left", "right", "joined"]
    assert f"(left, right) -> joined* -> {OUTPUT_CHANNEL};" in plan.explain()


def test_a_join_merges_source_queries_only_when_every_input_comes_from_one() -> None:
    p = Pipeline("j", chaining=True)
    a = p.source("a", read)
    mapped = p.stage("mapped", ident, inputs=[a])
    b = p.source("b", read)
    p.stage("j", lambda x, y: x, inputs=[mapped, b])
    graph = p.validate()
    stateless = dict.fromkeys(graph.stage_names, False)
    plan = plan_chains(graph, {**stateless, "j": True})
    assert groups(plan) == [("a", "mapped", "b", "j")] and plan.groups[0].shape == "(a -> mapped, b) -> j*"
    # a second stateful stage in a branch keeps the join's channels (and the branch's own chain)
    plan = plan_chains(graph, {**stateless, "j": True, "mapped": True})
    assert groups(plan) == [("a", "mapped"), ("b",), ("j",)]
    assert reasons(plan) == {("mapped", "j"): Boundary.STATEFUL, ("b", "j"): Boundary.STATEFUL}
    # an input from a channel stage's query (not a source's) keeps the alignment
    q = Pipeline("k", chaining=True)
    x = q.source("x", read)
    q.stage("y", ident, inputs=[x])
    q.stage("z", ident, inputs=[x])
    q.stage("k", lambda y, z: y, inputs=["y", "z"])
    graph = q.validate()
    plan = plan_chains(graph, dict.fromkeys(graph.stage_names, False))
    assert reasons(plan)[("y", "k")] is Boundary.MULTI_INPUT and reasons(plan)[("x", "y")] is Boundary.FAN_OUT


def test_fan_out_loops_and_multi_input_keep_their_channels() -> None:
    p = Pipeline("g", chaining=True)
    src = p.source("src", read)
    head = p.stage("head", ident, inputs=[src], feedback=["back"])
    body = p.stage("body", ident, inputs=[head])
    p.stage("back", ident, inputs=[body])
    p.stage("tap1", ident, inputs=[src])  # src is read by head and tap1: fan-out
    after = p.stage("after", ident, inputs=["tap1"])
    p.stage("both", lambda x, y: x, inputs=[after, "tap1x"])
    p.stage("tap1x", ident, inputs=[src])
    graph = p.validate()
    plan = plan_chains(graph, dict.fromkeys(graph.stage_names, False))
    why = reasons(plan)
    assert why[("src", "head")] is Boundary.LOOP and why[("src", "tap1")] is Boundary.FAN_OUT
    assert why[("head", "body")] is Boundary.LOOP and why[("body", "back")] is Boundary.LOOP
    assert why[("back", "head")] is Boundary.LOOP
    assert why[("after", "both")] is Boundary.MULTI_INPUT and why[("tap1x", "both")] is Boundary.MULTI_INPUT
    assert ("tap1", "after") in [g.stages for g in plan.groups]  # the one edge that may fuse does


@pytest.mark.parametrize(("change", "boundary"), [
    ({"chain": False}, Boundary.EXPLICIT),
    ({"trigger_interval": 1.0}, Boundary.TRIGGER),
    ({"state_store": "rocksdb"}, None),  # one stage naming a store: the query uses it
    ({"spark_conf": {"spark.sql.shuffle.partitions": "3"}}, Boundary.SPARK_CONF),
    ({"output_mode": "update"}, None),  # a stateless stage's mode alone: the query's mode
])
def test_per_stage_options_that_apply_to_a_whole_query_keep_a_boundary(change: dict[str, Any],
                                                                       boundary: Boundary | None) -> None:
    plan = plan_chains(linear(**change).validate(), STATELESS)
    if boundary is None:
        assert groups(plan) == [("src", "a", "b", "out")]
        for key, value in change.items():
            assert getattr(plan.groups[0].spec, key) == value
    else:
        assert groups(plan) == [("src", "a", "b"), ("out",)]
        assert reasons(plan) == {("b", "out"): boundary}


def test_a_stage_set_to_the_default_cadence_keeps_its_boundary_with_an_unset_one_and_says_so() -> None:
    # fusion compares what the stages set, so a plan does not change when the default cadence does
    plan = plan_chains(linear(trigger_interval=stage.DEFAULT_TRIGGER_INTERVAL).validate(), STATELESS)
    assert groups(plan) == [("src", "a", "b"), ("out",)]
    ((reader, why, detail),) = plan.channels[0].readers
    assert (reader, why) == ("out", Boundary.TRIGGER)
    assert detail == f"'src' triggers at the default cadence, 'out' every {stage.DEFAULT_TRIGGER_INTERVAL:g}s", detail


def test_a_query_that_reads_spark_sources_and_one_that_reads_channels_default_to_their_own_cadences() -> None:
    plan = plan_chains(linear(chain=False).validate(), STATELESS)
    fused, sink = (g.spec for g in plan.groups)
    assert fused.kind is StageKind.SOURCE and sink.kind is StageKind.SINK
    assert stage.trigger_interval(fused) == stage.DEFAULT_TRIGGER_INTERVAL
    assert stage.trigger_interval(sink) == stage.DEFAULT_CHANNEL_TRIGGER_INTERVAL
    assert stage.DEFAULT_CHANNEL_TRIGGER_INTERVAL < stage.DEFAULT_TRIGGER_INTERVAL
    set_one = plan_chains(linear(chain=False, trigger_interval=2.0).validate(), STATELESS)
    assert stage.trigger_interval(set_one.groups[-1].spec) == 2.0


def test_output_modes_and_state_stores_that_differ_keep_a_boundary() -> None:
    p = Pipeline("m", chaining=True)
    src = p.source("src", read)
    agg = p.stage("agg", ident, inputs=[src], output_mode="update", state_store="hdfs")
    p.sink("out", inputs=[agg], foreach_batch=lambda df, i: None)  # append, stateless: adopts update
    p2 = Pipeline("m2", chaining=True)
    s2 = p2.source("src", read)
    a2 = p2.stage("agg", ident, inputs=[s2], output_mode="update", state_store="hdfs")
    p2.sink("out", inputs=[a2], foreach_batch=lambda df, i: None, output_mode="complete", state_store="rocksdb")
    facts = {"src": False, "agg": True, "out": False}
    (one,) = plan_chains(p.validate(), facts).groups
    assert one.spec.output_mode == "update" and one.spec.state_store == "hdfs"
    assert reasons(plan_chains(p2.validate(), facts)) == {("agg", "out"): Boundary.OUTPUT_MODE}


def test_plan_nodes_reads_spark_tree_strings() -> None:
    tree = ("~Project [id#0L, key#1]\n+- ~Join Inner, (id#0L = id#4L)\n"
            "   :- ~StreamingRelationV2 org.apache.spark...PythonDataSourceV2@34, arroyo_generator\n"
            "   +- StreamingRelation FileSource[/tmp/x], [id#15L]\n")
    assert plan_nodes(tree) == ["Project", "Join", "StreamingRelationV2", "StreamingRelation"]


@pytest.mark.spark
def test_spark_analysis_finds_the_stateful_stages(spark: Any, tmp_path: Any) -> None:
    """Analysis only (no query runs): the join and a watermark count, projections and sinks do not, and a
    transform that raises is unknown."""
    from airflow_arroyo.runtime.plan import stateful_stages

    p = demo("d", sink_path=str(tmp_path / "out"), chaining=True)
    p.stage("late", lambda df: df.selectExpr("id", "timestamp_seconds(id) AS t").withWatermark("t", "1 second"),
            inputs=["left"])
    p.stage("broken", lambda df: df.select("no_such_column"), inputs=["right"])
    facts = stateful_stages(p.validate(), spark)
    assert facts == {"left": False, "right": False, "joined": True, OUTPUT_CHANNEL: False, SINK_STAGE: False,
                     "late": True, "broken": None}
    plan = p.physical_plan(spark)
    assert plan.group_of(OUTPUT_CHANNEL).stages == ("joined", OUTPUT_CHANNEL)


def _watermark_warnings(p: Pipeline, spark: Any) -> list[str]:
    """What the driver warns at start (its _plan_chains: the same calls)."""
    from airflow_arroyo.runtime.plan import compose_stages, stateful_stages, watermarks_not_crossing

    graph = p.validate()
    frames = compose_stages(graph, spark)
    stateful = stateful_stages(graph, spark, frames)
    return watermarks_not_crossing(graph, plan_chains(graph, stateful, chaining=p.chains), frames, stateful)


@pytest.mark.spark
def test_a_watermark_set_before_a_remaining_channel_is_named_where_a_stateful_stage_relies_on_it(spark: Any) -> None:
    """A channel does not carry a watermark: a join reading a channel whose writer set one runs without it (its
    state then grows without bound). The driver warns, naming the stage, the channel and the column; not where
    the reader sets its own watermark, nor for a stateless reader."""
    from airflow_arroyo.testing import generator_source

    def left(spark: Any) -> Any:
        return generator_source(spark, seed=1, rows_per_batch=10).withWatermark("ts", "5 seconds")

    def right(spark: Any) -> Any:
        return generator_source(spark, seed=2, rows_per_batch=10).selectExpr("id AS rid", "ts AS rts")

    def join(lhs: Any, rhs: Any) -> Any:
        return lhs.join(rhs, lhs["id"] == rhs["rid"])

    def join_with_watermarks(lhs: Any, rhs: Any) -> Any:
        return join(lhs.withWatermark("ts", "5 seconds"), rhs.withWatermark("rts", "5 seconds"))

    relies = Pipeline("wm-relies")  # the watermark makes 'left' stateful: a channel remains before the join
    relies.stage("joined", join, inputs=[relies.source("left", left), relies.source("right", right)])
    [warning] = _watermark_warnings(relies, spark)
    assert "stage 'joined' reads channel 'left'" in warning and "'ts' (5000 ms)" in warning
    assert "withWatermark in 'joined'" in warning

    own = Pipeline("wm-own", chaining=False)  # every channel remains; the join sets its own watermarks
    own.stage("joined", join_with_watermarks, inputs=[own.source("left", left), own.source("right", right)])
    assert _watermark_warnings(own, spark) == []

    stateless = Pipeline("wm-stateless", chaining=False)
    stateless.stage("filtered", lambda df: df.where("value > 10"), inputs=[stateless.source("left", left)])
    assert _watermark_warnings(stateless, spark) == []


def test_a_long_chain_gets_a_short_stable_name_that_no_stage_can_take() -> None:
    p = Pipeline("long", chaining=True)
    prev = p.source("s" * 40, read)
    for i in range(4):
        prev = p.stage(f"{i}" * 40, ident, inputs=[prev])
    graph = p.validate()
    first = plan_chains(graph, dict.fromkeys(graph.stage_names, False)).groups[0].name
    again = plan_chains(p.validate(), dict.fromkeys(graph.stage_names, False)).groups[0].name
    assert first == again and len(first) <= 120 and first.startswith("s" * 40 + "~3-more-")
    assert first.endswith("~" + "3" * 40) and "~" not in "".join(graph.stage_names)
