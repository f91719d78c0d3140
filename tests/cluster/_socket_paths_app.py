"""A Spark application for ``test_executor_socket_paths.py``: a streaming ``transformWithState`` query on the
standalone master given, with the confs the provider adds there (``master_conf``) and the executors' metrics
written as CSV. Prints ``ready`` once ``batches`` micro-batches completed, then keeps the application (and its
executors) up until a line arrives on stdin.

    python _socket_paths_app.py MASTER METRICS_DIR CHECKPOINT BATCHES
"""

from __future__ import annotations

import sys

from pyspark.sql import SparkSession

from airflow_arroyo.examples.pipelines import _milestone_processor
from airflow_arroyo.jvm import master_conf

PRUNE_EVERY = "300ms"
KEEP_NEWEST = 2
PARTITIONS = 4  # a transformWithState task, and its state server's socket file, per partition per batch


def main(master: str, metrics_dir: str, checkpoint: str, batches: int) -> None:
    sink = "spark.metrics.conf.executor.sink.csv"
    confs = {
        "spark.sql.shuffle.partitions": str(PARTITIONS),
        "spark.sql.streaming.stateStore.providerClass":
            "org.apache.spark.sql.execution.streaming.state.RocksDBStateStoreProvider",
        "spark.executor.memory": "512m",
        "spark.airflow.arroyo.socketPaths.interval": PRUNE_EVERY,
        "spark.airflow.arroyo.socketPaths.keepNewest": str(KEEP_NEWEST),
        f"{sink}.class": "org.apache.spark.metrics.sink.CsvSink",
        f"{sink}.period": "1",
        f"{sink}.unit": "seconds",
        f"{sink}.directory": metrics_dir,
    }
    confs.update(master_conf(master, confs))
    builder = SparkSession.builder.master(master).appName("arroyo-socket-paths")
    for key, value in confs.items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    rows = (spark.readStream.format("rate").option("rowsPerSecond", 40).load()
            .selectExpr("CAST(value % 8 AS STRING) AS key", "value"))
    query = (rows.groupBy("key")
             .transformWithState(statefulProcessor=_milestone_processor(),
                                 outputStructType="key string, milestone long", outputMode="Append", timeMode="None")
             .writeStream.format("noop").option("checkpointLocation", checkpoint)
             .trigger(processingTime="200 milliseconds").start())
    while query.lastProgress is None or query.lastProgress["batchId"] < batches - 1:
        if query.awaitTermination(0.2):
            raise RuntimeError(f"the query ended: {query.exception()}")
    print("ready", flush=True)
    sys.stdin.readline()
    query.stop()
    spark.stop()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]))
