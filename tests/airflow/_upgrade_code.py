"""New code for the upgrade operator tests: the stand-in driver's stages ('source', 'sink') with the sink renamed
(``sink=`` names it otherwise). The attribute is named after the pipeline: the stand-in driver takes its pipeline id
from it."""

from __future__ import annotations

from typing import Any

from airflow_arroyo.runtime.pipeline import Pipeline


def up_op(sink: str = "sink_v2", **_: Any) -> Pipeline:
    p = Pipeline("up_op", chaining=False)
    src = p.source("source", lambda spark: spark.readStream.format("rate").load())
    p.sink(sink, [src], foreach_batch=lambda df, batch: None)
    return p
