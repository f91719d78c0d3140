r"""The demo pipeline: two replayable generator sources, a keyed two-input stage, a downstream stage.

::

    left  (generator, seed 1) ─┐
                               ├─> joined (stream-stream join on id: keyed state) ─> report (channel)
    right (generator, seed 2) ─┘                                   [─> report_files (Parquet sink)]

Every row id appears once on each side, so ``joined`` emits each id exactly once whatever the
micro-batch boundaries are, and ``report`` keeps the rows whose total is not a multiple of 7. The final
channel's content is therefore independent of batching, restores and timing: exactly what the
exactly-once proof compares with :func:`expected_report` (plain Python over the generator's rows).

Run it with the driver::

    ARROYO_DSN=postgresql://... python -m airflow_arroyo.runtime.driver \
        --pipeline airflow_arroyo.examples.pipelines:demo --storage-uri /tmp/arroyo --master 'local[2]' \
        --arg rows=20000
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Literal

from airflow_arroyo.examples.names import OUTPUT_CHANNEL, SINK_STAGE
from airflow_arroyo.runtime.pipeline import Pipeline
from airflow_arroyo.runtime.sinks.kafka import KafkaTarget
from airflow_arroyo.runtime.sinks.postgres import PostgresTarget
from airflow_arroyo.testing import generate_rows, generator_source

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

__all__ = [
    "OUTPUT_CHANNEL", "PG_REPORT_DDL", "PG_REPORT_STAGE", "PG_TOTALS_DDL", "PG_TOTALS_STAGE", "SINK_STAGE",
    "STATEFUL_OUTPUTS", "demo", "expected_report", "expected_stateful", "expected_totals", "kafka_order",
    "kafka_orders", "stateful_ops", "totals_of",
]

PG_REPORT_STAGE = "report_pg"
PG_TOTALS_STAGE = "totals_pg"
# The demo's PostgreSQL target tables ({table} is the table's name): the sinks never create tables.
PG_REPORT_DDL = ("CREATE TABLE {table} (id bigint NOT NULL, key text NOT NULL, left_value bigint, "
                 "right_value bigint, total bigint)")
PG_TOTALS_DDL = "CREATE TABLE {table} (key text PRIMARY KEY, n bigint NOT NULL, total bigint NOT NULL)"
LEFT_SEED = 1
RIGHT_SEED = 2


def demo(
    pipeline_id: str = "arroyo-demo",
    rows: int | None = 20_000,
    rows_per_batch: int = 1_000,
    rows_per_second: int | None = None,
    keys: int = 100,
    state_store: Literal["hdfs", "rocksdb"] | None = None,
    trigger_interval: float | None = None,
    partitions: int = 2,
    sink_path: str | None = None,
    pg_dsn_env: str | None = None,
    pg_report_table: str = "arroyo_demo_report",
    pg_totals_table: str = "arroyo_demo_totals",
    chaining: bool | None = None,
) -> Pipeline:
    """The demo pipeline. ``rows=None`` makes the generators unbounded (benchmarks); ``rows_per_batch``
    paces them (rows per micro-batch of each source), ``rows_per_second`` in time (each source's rows exist at
    that rate from its query's start). ``sink_path`` adds an exactly-once Parquet sink
    ``report_files`` writing the report there (committed epoch by epoch). ``pg_dsn_env`` (the name of an
    environment variable holding a PostgreSQL DSN) adds two exactly-once PostgreSQL sinks: ``report_pg``
    appends the report's rows to ``pg_report_table`` (:data:`PG_REPORT_DDL`), ``totals_pg`` upserts per key
    the count and sum of ``total`` into ``pg_totals_table`` (:data:`PG_TOTALS_DDL`; update output mode).
    ``chaining`` is the pipeline's (:class:`~airflow_arroyo.runtime.Pipeline`): by default the graph fuses both
    sources, ``joined`` and ``report`` into one query (runtime/plan.py); ``chaining=False`` runs one query per
    stage. The sinks ask for a boundary (``chain=False``) so that the report channel stays in either form."""

    def left(spark: SparkSession) -> DataFrame:
        df = generator_source(spark, seed=LEFT_SEED, keys=keys, total_rows=rows, rows_per_batch=rows_per_batch,
                              rows_per_second=rows_per_second, partitions=partitions)
        return df.selectExpr("id", "key", "value AS left_value")

    def right(spark: SparkSession) -> DataFrame:
        df = generator_source(spark, seed=RIGHT_SEED, keys=keys, total_rows=rows, rows_per_batch=rows_per_batch,
                              rows_per_second=rows_per_second, partitions=partitions)
        return df.selectExpr("id", "value AS right_value")

    def join(lhs: DataFrame, rhs: DataFrame) -> DataFrame:
        return lhs.join(rhs, "id")  # stream-stream inner join: both sides kept in keyed state

    def report(joined: DataFrame) -> DataFrame:
        return (joined.selectExpr("id", "key", "left_value", "right_value", "left_value + right_value AS total")
                .where("total % 7 <> 0"))

    p = Pipeline(pipeline_id, description="two generators, a stream-stream join, a filter", chaining=chaining)
    lhs = p.source("left", left, trigger_interval=trigger_interval)
    rhs = p.source("right", right, trigger_interval=trigger_interval)
    joined = p.stage("joined", join, inputs=[lhs, rhs], state_store=state_store, trigger_interval=trigger_interval)
    p.stage(OUTPUT_CHANNEL, report, inputs=[joined], trigger_interval=trigger_interval)
    if sink_path is not None:
        p.sink(SINK_STAGE, inputs=[OUTPUT_CHANNEL], format="parquet", options={"path": sink_path},
               trigger_interval=trigger_interval, chain=False)
    if pg_dsn_env is not None:
        p.sink(PG_REPORT_STAGE, inputs=[OUTPUT_CHANNEL], trigger_interval=trigger_interval, chain=False,
               postgres=PostgresTarget(table=pg_report_table, dsn_env=pg_dsn_env, mode="append"))
        p.sink(PG_TOTALS_STAGE, inputs=[OUTPUT_CHANNEL], transform=_totals, output_mode="update",
               trigger_interval=trigger_interval,
               postgres=PostgresTarget(table=pg_totals_table, dsn_env=pg_dsn_env, mode="upsert", key=("key",)))
    return p


def _totals(report: DataFrame) -> DataFrame:
    return report.groupBy("key").agg({"*": "count", "total": "sum"}).withColumnsRenamed(
        {"count(1)": "n", "sum(total)": "total"})


def expected_totals(rows: int, keys: int = 100) -> dict[str, tuple[int, int]]:
    """What ``totals_pg`` ends with, in plain Python: :func:`totals_of` :func:`expected_report`."""
    return totals_of(expected_report(rows, keys))


def totals_of(report_rows: Iterable[tuple[Any, ...]]) -> dict[str, tuple[int, int]]:
    """Per key, (count, sum of total) over report rows ``(id, key, left_value, right_value, total)``: what
    ``totals_pg`` holds once those rows are committed."""
    out: dict[str, tuple[int, int]] = {}
    for _, k, _, _, total in report_rows:
        n, s = out.get(k, (0, 0))
        out[k] = (n + 1, s + total)
    return out


def expected_report(rows: int, keys: int = 100) -> list[tuple[int, str, int, int, int]]:
    """The demo's final output computed in plain Python, sorted by id."""
    lhs = generate_rows(LEFT_SEED, 0, rows, keys).to_pydict()
    rhs = generate_rows(RIGHT_SEED, 0, rows, keys).to_pydict()
    right_value = dict(zip(rhs["id"], rhs["value"], strict=True))
    out = []
    for i, k, lv in zip(lhs["id"], lhs["key"], lhs["value"], strict=True):
        rv = right_value[i]
        if (lv + rv) % 7 != 0:
            out.append((i, k, lv, rv, lv + rv))
    return sorted(out)


# ---------------------------------------------------------------------------------------------------------
# Stateful operators: dropDuplicates, an event-time window aggregation and transformWithState, each a stage.

MILESTONE_EVERY = 25
WINDOW_SECONDS = 2
STATEFUL_SEED = 5
STATEFUL_OUTPUTS = ("distinct_buckets", "windows", "milestones")


def _milestone_processor() -> Any:
    """A ``StatefulProcessor`` (built lazily so importing this module does not import pyspark)."""
    from pyspark.sql import Row
    from pyspark.sql.streaming.stateful_processor import StatefulProcessor, StatefulProcessorHandle

    class Milestones(StatefulProcessor):
        """Counts rows per key in a value state; emits (key, m) each time the count reaches a multiple of
        :data:`MILESTONE_EVERY`. What it emits depends only on the counts, not on micro-batch boundaries."""

        def init(self, handle: StatefulProcessorHandle) -> None:
            self.count = handle.getValueState("count", "n long")

        def handleInputRows(self, key: Any, rows: Any, timerValues: Any) -> Any:  # noqa: ARG002 - Spark's signature
            held = self.count.get()
            before = int(held[0]) if held is not None else 0
            after = before + sum(1 for _ in rows)
            self.count.update((after,))
            for m in range((before // MILESTONE_EVERY + 1) * MILESTONE_EVERY, after + 1, MILESTONE_EVERY):
                yield Row(key=key[0], milestone=m)

        def close(self) -> None:
            pass

    return Milestones()


def stateful_ops(
    pipeline_id: str = "arroyo-stateful",
    rows: int = 3_000,
    rows_per_batch: int = 200,
    keys: int = 20,
    trigger_interval: float | None = None,
) -> Pipeline:
    """One generator source read by three stateful stages, each writing a channel.

    ::

        events ─┬─> distinct_buckets   dropDuplicates over (key, value % 100)       (default state store)
                ├─> windows            2 s tumbling event-time windows, watermark 0  (default state store)
                └─> milestones         transformWithState, a count per key       (RocksDB, required)

    Every output is independent of batching (see :func:`expected_stateful`)."""

    def events(spark: SparkSession) -> DataFrame:
        return generator_source(spark, seed=STATEFUL_SEED, keys=keys, total_rows=rows,
                                rows_per_batch=rows_per_batch)

    def distinct_buckets(df: DataFrame) -> DataFrame:
        return df.selectExpr("key", "value % 100 AS bucket").dropDuplicates()

    def windows(df: DataFrame) -> DataFrame:
        from pyspark.sql import functions as F

        return (df.withWatermark("ts", "0 seconds")
                .groupBy(F.window("ts", f"{WINDOW_SECONDS} seconds"), "key")
                .agg(F.count("*").alias("n"), F.sum("value").alias("total"))
                .selectExpr("key", "window.start AS window_start", "n", "total"))

    def milestones(df: DataFrame) -> DataFrame:
        return df.groupBy("key").transformWithState(
            statefulProcessor=_milestone_processor(), outputStructType="key string, milestone long",
            outputMode="Append", timeMode="None")

    p = Pipeline(pipeline_id, description="dropDuplicates, event-time windows and transformWithState on one source")
    src = p.source("events", events, trigger_interval=trigger_interval)
    p.stage("distinct_buckets", distinct_buckets, inputs=[src], trigger_interval=trigger_interval)
    p.stage("windows", windows, inputs=[src], trigger_interval=trigger_interval)
    p.stage("milestones", milestones, inputs=[src], state_store="rocksdb", trigger_interval=trigger_interval)
    return p


def expected_stateful(rows: int = 3_000, keys: int = 20) -> dict[str, list[tuple[Any, ...]]]:
    """The final content of each :func:`stateful_ops` output channel, computed in plain Python (sorted)."""
    import datetime as dt
    from collections import Counter, defaultdict

    t = generate_rows(STATEFUL_SEED, 0, rows, keys).to_pydict()
    buckets = sorted({(k, v % 100) for k, v in zip(t["key"], t["value"], strict=True)})
    counts = Counter(t["key"])
    milestones = sorted((k, m) for k, n in counts.items() for m in range(MILESTONE_EVERY, n + 1, MILESTONE_EVERY))
    # append mode emits a window once the watermark (the largest event time seen, delay 0) reaches its end
    width = WINDOW_SECONDS * 1_000_000
    watermark = max(_micros(ts) for ts in t["ts"])
    agg: dict[tuple[str, int], list[int]] = defaultdict(lambda: [0, 0])
    for k, v, ts in zip(t["key"], t["value"], t["ts"], strict=True):
        cell = agg[(k, _micros(ts) // width * width)]
        cell[0] += 1
        cell[1] += v
    epoch = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)
    windows = sorted((k, epoch + dt.timedelta(microseconds=start), n, total)
                     for (k, start), (n, total) in agg.items() if start + width <= watermark)
    return {"distinct_buckets": buckets, "windows": windows, "milestones": milestones}


def _micros(ts: Any) -> int:
    import datetime as dt

    return int((ts - dt.datetime(1970, 1, 1, tzinfo=dt.UTC)) // dt.timedelta(microseconds=1))


def kafka_orders(
    pipeline_id: str = "arroyo-kafka-orders",
    bootstrap_servers: str = "127.0.0.1:9092",
    input_topic: str = "orders",
    output_topic: str = "orders-deduplicated",
    max_offsets_per_trigger: int | None = 500,
    chaining: bool | None = None,
    allow_reemit: bool = False,
) -> Pipeline:
    """Kafka in, Kafka out, exactly once: orders (JSON values ``{"id", "key", "amount"}``, some delivered more
    than once, as at-least-once producers do) read with Spark's Kafka source, deduplicated by id (keyed state),
    written to ``output_topic`` by the exactly-once Kafka sink (each epoch's output in one Kafka transaction; a
    ``read_committed`` consumer sees every id once). The epoch's cut holds the source's offsets (Spark's
    checkpoint), so a restore reads on from exactly there. ``allow_reemit``: the sink's (a restore behind output
    Kafka made public produces it again instead of being refused)."""

    def orders(spark: SparkSession) -> DataFrame:
        reader = (spark.readStream.format("kafka").option("kafka.bootstrap.servers", bootstrap_servers)
                  .option("subscribe", input_topic).option("startingOffsets", "earliest"))
        if max_offsets_per_trigger:
            reader = reader.option("maxOffsetsPerTrigger", str(max_offsets_per_trigger))
        return reader.load().selectExpr(
            "CAST(get_json_object(CAST(value AS STRING), '$.id') AS BIGINT) AS id",
            "get_json_object(CAST(value AS STRING), '$.key') AS key",
            "CAST(get_json_object(CAST(value AS STRING), '$.amount') AS BIGINT) AS amount")

    def first_of_each(o: DataFrame) -> DataFrame:
        return o.dropDuplicates(["id"])

    def to_kafka(o: DataFrame) -> DataFrame:
        return o.selectExpr("key", "to_json(struct(id, key, amount)) AS value")

    p = Pipeline(pipeline_id, description="Kafka orders deduplicated by id into Kafka, exactly once",
                 chaining=chaining)
    src = p.source("orders", orders)
    p.stage("unique_orders", first_of_each, inputs=[src])
    p.sink("orders_out", inputs=["unique_orders"], transform=to_kafka,
           kafka=KafkaTarget(output_topic, bootstrap_servers, allow_reemit=allow_reemit))
    return p


def kafka_order(i: int) -> dict[str, Any]:
    """Order ``i`` of :func:`kafka_orders`'s input (the tests and the demo produce these)."""
    return {"id": i, "key": f"k{i % 13}", "amount": (i * 37) % 1000}
