"""Source stages without a read limit (issue 34, deliverable 3): under sustained overload a micro-batch reads
everything that arrived during the previous one, so batches and the epochs that wait for them grow with the
backlog. The driver reads the limit Spark plans each source with and warns, naming the option to set."""

from __future__ import annotations

import logging
import uuid
from pathlib import Path
from typing import Any

import pytest

from airflow_arroyo.core.epochs import PipelineState
from airflow_arroyo.runtime.driver import PipelineDriver
from airflow_arroyo.runtime.pipeline import Pipeline
from airflow_arroyo.runtime.read_limits import (
    SourceReadLimit,
    query_read_limits,
    unbounded_source_warning,
    unbounded_sources,
)
from airflow_arroyo.store import EpochStore
from airflow_arroyo.testing import generator_source, run_until, wait_for


def test_a_source_is_bounded_by_any_maximum_not_by_a_minimum_alone() -> None:
    limits = [
        SourceReadLimit("all", ("ReadAllAvailable",)),
        SourceReadLimit("min-only", ("ReadMinRows",)),
        SourceReadLimit("rows", ("ReadMaxRows",)),
        SourceReadLimit("files", ("ReadMaxFiles",)),
        SourceReadLimit("kafka-min-and-max", ("ReadMinRows", "ReadMaxRows")),
    ]
    assert unbounded_sources(limits) == ["all", "min-only"]


def test_the_warning_names_the_stage_the_sources_and_the_options_to_set() -> None:
    text = unbounded_source_warning("orders", "src", ["KafkaV2[Subscribe[orders]]"])
    assert "pipeline=orders stage=src" in text and "KafkaV2[Subscribe[orders]]" in text
    for option in ("maxOffsetsPerTrigger", "maxFilesPerTrigger", "rows_per_batch", "max_rows_per_batch"):
        assert option in text


@pytest.mark.spark
def test_the_limit_spark_plans_a_source_with_is_read_from_the_running_query(spark: Any, tmp_path: Path) -> None:
    paced = generator_source(spark, seed=1, rows_per_second=50)
    capped = generator_source(spark, seed=2, rows_per_second=50, rows_per_batch=7)
    # one query over both sources: one start, and Spark plans each source with its own limit
    query = (paced.unionByName(capped).writeStream.format("noop").option("checkpointLocation", str(tmp_path))
             .trigger(processingTime="100 milliseconds").start())
    try:
        wait_for(lambda: query.lastProgress is not None, timeout=120, what="the query's first trigger")
        got = query_read_limits(query)
    finally:
        query.stop()
    assert got is not None
    by_limit = {s.limits: s for s in got}
    assert sorted(by_limit) == [("ReadAllAvailable",), ("ReadMaxRows",)]
    assert not by_limit[("ReadAllAvailable",)].bounded
    assert by_limit[("ReadMaxRows",)].bounded and "7" in by_limit[("ReadMaxRows",)].text
    assert unbounded_sources(got) == [by_limit[("ReadAllAvailable",)].source]


@pytest.mark.spark
def test_the_driver_warns_for_a_fused_source_stage_without_a_read_limit(
        module_store: EpochStore, spark: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    pid = f"unbounded-{uuid.uuid4().hex[:6]}"
    p = Pipeline(pid)
    src = p.source("orders", lambda s: generator_source(s, seed=3, rows_per_second=100))
    p.stage("paid", lambda df: df.where("value >= 500"), inputs=[src])
    driver = PipelineDriver(p, module_store, storage_uri=str(tmp_path), spark=spark)
    with caplog.at_level(logging.WARNING, logger="airflow_arroyo.runtime.driver"):
        run_until(driver, module_store, lambda: module_store.get_pipeline(pid).state is PipelineState.RUNNING,
                  what="the run to go running", epochs=False, stop="immediate")
    logged = [r.getMessage() for r in caplog.records if r.name == "airflow_arroyo.runtime.driver"]
    warned = [m for m in logged if "no read limit" in m]
    assert len(warned) == 1, logged
    assert f"pipeline={pid} stage=orders" in warned[0] and "rows_per_batch" in warned[0]
