"""Graph API and validation: every PipelineGraphError names the stage and the fix, before Spark starts."""

from __future__ import annotations

import pytest

from airflow_arroyo.core.exceptions import ConfigurationError, PipelineGraphError
from airflow_arroyo.runtime.pipeline import Pipeline, StageKind


def read(spark):  # never called: validation needs no Spark
    raise AssertionError("validation must not start Spark")


def ident(*dfs):
    return dfs[0]


def test_valid_graph_in_topological_order() -> None:
    p = Pipeline("demo")
    # defined out of order on purpose: inputs may be names of stages defined later
    p.stage("report", ident, inputs=["joined"])
    left = p.source("left", read)
    right = p.source("right", read)
    p.stage("joined", ident, inputs=[left, right])
    p.sink("out", inputs=["report"], foreach_batch=lambda df, b: None)
    g = p.validate()
    order = g.stage_names
    assert order.index("left") < order.index("joined") < order.index("report") < order.index("out")
    assert order.index("right") < order.index("joined")
    assert g.channels == ["left", "right", "joined", "report"]
    assert g.writers["joined"] == "joined"
    assert g.readers("joined") == ["report"]
    assert g.stage("out").kind is StageKind.SINK


def test_unknown_channel_suggests_the_close_name() -> None:
    p = Pipeline("demo")
    p.source("right", read)
    p.stage("joined", ident, inputs=["rigth"])
    with pytest.raises(PipelineGraphError, match=r"stage 'joined' reads channel 'rigth'.*did you mean 'right'"):
        p.validate()


def test_reading_a_sink_is_explained() -> None:
    p = Pipeline("demo")
    src = p.source("src", read)
    p.sink("out", inputs=[src], foreach_batch=lambda df, b: None)
    p.stage("after", ident, inputs=["out"])
    with pytest.raises(PipelineGraphError, match="'out', which is a sink"):
        p.validate()


def test_stage_without_input() -> None:
    p = Pipeline("demo")
    p.source("src", read)
    p.stage("lonely", ident, inputs=[])
    with pytest.raises(PipelineGraphError, match=r"stage 'lonely' has no input; pass inputs=.*Pipeline.source"):
        p.validate()


def test_loop_without_iteration_head_names_the_loop_and_the_fix() -> None:
    p = Pipeline("demo")
    src = p.source("src", read)
    p.stage("a", ident, inputs=[src, "c"])
    p.stage("b", ident, inputs=["a"])
    p.stage("c", ident, inputs=["b"])
    with pytest.raises(PipelineGraphError, match=r"loop without an iteration head: a -> b -> c -> a.*feedback=\['c'\]"):
        p.validate()


def test_loop_with_iteration_head_is_valid() -> None:
    p = Pipeline("demo")
    src = p.source("src", read)
    p.stage("a", ident, inputs=[src], feedback=["c"])
    p.stage("b", ident, inputs=["a"])
    p.stage("c", ident, inputs=["b"])
    g = p.validate()
    assert g.stage_names == ["src", "a", "b", "c"]
    assert g.stage("a").is_iteration_head
    assert g.stage("a").all_inputs == ("src", "c")


def test_feedback_that_closes_no_loop() -> None:
    p = Pipeline("demo")
    src = p.source("src", read)
    other = p.source("other", read)
    p.stage("a", ident, inputs=[src], feedback=[other])
    with pytest.raises(PipelineGraphError, match="closes no loop; list 'other' in inputs"):
        p.validate()


def test_two_writers_on_one_channel() -> None:
    p = Pipeline("demo")
    p.source("a", read, output="events")
    p.source("b", read, output="events")
    with pytest.raises(PipelineGraphError, match=r"two writers on channel 'events': stages 'a' and 'b'.*output='b'"):
        p.validate()


def test_duplicate_stage_name() -> None:
    p = Pipeline("demo")
    p.source("a", read)
    p.source("a", read)
    with pytest.raises(PipelineGraphError, match="stage 'a' is defined twice"):
        p.validate()


@pytest.mark.parametrize("name", ["", "../up", "a b", ".hidden", "x" * 101])
def test_stage_names_must_name_folders(name: str) -> None:
    p = Pipeline("demo")
    p.source(name, read)
    with pytest.raises(PipelineGraphError, match="cannot name a folder"):
        p.validate()


def test_sink_needs_exactly_one_writer() -> None:
    p = Pipeline("demo")
    src = p.source("src", read)
    p.sink("out", inputs=[src])
    with pytest.raises(PipelineGraphError, match="sink 'out' needs exactly one of foreach_batch"):
        p.validate()


def test_bad_options_are_named() -> None:
    p = Pipeline("demo")
    src = p.source("src", read)
    p.stage("agg", ident, inputs=[src], output_mode="upsert")  # type: ignore[arg-type]
    with pytest.raises(PipelineGraphError, match="stage 'agg': output_mode 'upsert'"):
        p.validate()
    p2 = Pipeline("demo")
    src = p2.source("src", read)
    p2.stage("agg", ident, inputs=[src], state_store="leveldb")  # type: ignore[arg-type]
    with pytest.raises(PipelineGraphError, match="state_store 'leveldb'"):
        p2.validate()


def test_empty_pipeline_and_bad_id() -> None:
    with pytest.raises(PipelineGraphError, match="has no stages"):
        Pipeline("demo").validate()
    with pytest.raises(PipelineGraphError):
        Pipeline("no spaces please")
    assert issubclass(PipelineGraphError, ConfigurationError)


def test_reading_own_output() -> None:
    p = Pipeline("demo")
    src = p.source("src", read)
    p.stage("a", ident, inputs=[src], feedback=["a"])
    with pytest.raises(PipelineGraphError, match="reads its own output"):
        p.validate()
