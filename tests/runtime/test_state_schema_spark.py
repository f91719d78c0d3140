"""State schema compatibility on real Spark: the schemas derived from a new stage's DataFrame (its optimized plan,
without running it) against what Spark wrote in a real checkpoint of the old one, and Spark's own verdict when
the new code restores a copy of that checkpoint, so the rule is checked against Spark rather than against itself;
the compatible restore's output is compared with plain Python's totals."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from airflow_arroyo.runtime.state_schema import new_operator_states, read_operator_states, stage_refusal

pytestmark = [pytest.mark.spark]

ROWS = [{"id": i, "v": i * 3} for i in range(40)]


def _input(spark: Any, folder: Path) -> Any:
    return spark.readStream.schema("id long, v long").json(str(folder))


def totals(df: Any) -> Any:
    from pyspark.sql import functions as F

    return df.groupBy((F.col("id") % 4).alias("k")).agg(F.count("*").alias("n"), F.sum("v").alias("s"))


def totals_renamed_output(df: Any) -> Any:
    """A stateless change upstream and a changed output column after the aggregation: compatible."""
    from pyspark.sql import functions as F

    return (df.where(F.col("v") >= 0).groupBy((F.col("id") % 4).alias("key")).agg(F.count("*").alias("rows"),
                                                                                 F.sum("v").alias("total"))
            .select(F.col("key"), (F.col("rows") + F.col("total") * 2).alias("out")))


def totals_read_in_another_order(df: Any) -> Any:
    """The same aggregates read sum first: the optimizer collapses the projection into the aggregation, whose
    state then holds sum before count; Spark refuses it (types in another order)."""
    from pyspark.sql import functions as F

    return (df.groupBy((F.col("id") % 4).alias("k")).agg(F.count("*").alias("n"), F.sum("v").alias("s"))
            .select(F.col("k"), (F.col("s") * 2 + F.col("n")).alias("out")))


def totals_without_count(df: Any) -> Any:
    """The count no longer read after the aggregation: the optimizer prunes it from the state, which Spark refuses."""
    from pyspark.sql import functions as F

    return (df.groupBy((F.col("id") % 4).alias("k")).agg(F.count("*").alias("n"), F.sum("v").alias("s"))
            .select("k", "s"))


def totals_by_two_keys(df: Any) -> Any:
    from pyspark.sql import functions as F

    return df.groupBy((F.col("id") % 4).alias("k"), (F.col("id") % 3).alias("j")).agg(
        F.count("*").alias("n"), F.sum("v").alias("s"))


def totals_as_double(df: Any) -> Any:
    from pyspark.sql import functions as F

    return df.groupBy((F.col("id") % 4).alias("k")).agg(F.count("*").alias("n"), F.avg("v").alias("s"))


def dedup(df: Any) -> Any:
    from pyspark.sql import functions as F

    return df.select((F.col("id") % 4).alias("k")).dropDuplicates(["k"])


@pytest.fixture(scope="module")
def checkpoint(spark: Any, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("state-schema")
    (root / "in").mkdir()
    (root / "in" / "part.json").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    query = (totals(_input(spark, root / "in")).writeStream.format("memory").queryName("state_schema_totals")
             .outputMode("update").option("checkpointLocation", str(root / "ck")).trigger(availableNow=True).start())
    query.awaitTermination(120)
    return root / "in", root / "ck"


def test_the_same_code_and_a_compatible_change_pass_and_a_changed_shape_is_refused(
        spark: Any, checkpoint: tuple[Path, Path]) -> None:
    folder, ck = checkpoint
    stored = read_operator_states(str(ck))
    assert [(o.op_id, o.operator) for o in stored] == [(0, "stateStoreSave")]

    def verdict(code: Any) -> str | None:
        new = new_operator_states(code(_input(spark, folder)))
        assert new is not None
        return stage_refusal(stored, new)

    assert verdict(totals) is None
    assert verdict(totals_renamed_output) is None
    key = verdict(totals_by_two_keys)
    assert key is not None and "key schema (_groupingexpression: long) in the epoch, (" in key
    value = verdict(totals_as_double)
    assert value is not None and "value schema" in value and "double" in value
    pruned = verdict(totals_without_count)
    assert pruned is not None and "value schema (count: long not null, sum: long) in the epoch, (sum: long)" in pruned
    swapped = verdict(totals_read_in_another_order)
    assert swapped is not None and "(sum: long, count: long not null) in the new code" in swapped
    op = verdict(dedup)
    assert op is not None and "was 'stateStoreSave' in the epoch and is 'dedupe'" in op


@pytest.mark.parametrize(("code", "compatible"), [
    (totals_renamed_output, True), (totals_by_two_keys, False), (totals_without_count, False),
    (totals_read_in_another_order, False)])
def test_spark_itself_agrees(spark: Any, checkpoint: tuple[Path, Path], tmp_path: Path, code: Any,
                             compatible: bool) -> None:
    """A copy of the checkpoint restored by the new code with one more input row: Spark loads the state (and the
    compatible code's output carries the old totals: plain Python's sum over every row) or refuses it, exactly
    where the rule says."""
    import shutil

    folder, ck = checkpoint
    new = new_operator_states(code(_input(spark, folder)))
    assert new is not None
    assert (stage_refusal(read_operator_states(str(ck)), new) is None) is compatible
    shutil.copytree(ck, tmp_path / "ck")
    out: list[tuple[int, int]] = []

    def collect(batch: Any, _: int) -> None:
        out.extend((r[0], r[1]) for r in batch.collect())

    (folder / "more.json").write_text(json.dumps({"id": 100, "v": 1}) + "\n")
    try:
        query = (code(_input(spark, folder)).writeStream.foreachBatch(collect).outputMode("update")
                 .option("checkpointLocation", str(tmp_path / "ck")).trigger(availableNow=True).start())
        if compatible:
            query.awaitTermination(120)
            assert query.exception() is None
            zeros = [r for r in ROWS if r["id"] % 4 == 0]
            assert out == [(0, 2 * (sum(r["v"] for r in zeros) + 1) + len(zeros) + 1)]
        else:
            with pytest.raises(Exception, match="(?i)schema"):
                query.awaitTermination(120)
            assert out == []
    finally:
        (folder / "more.json").unlink()
