"""RocksDB state on S3A, against an S3-compatible server given by an endpoint (moto's, on loopback).

RocksDB's state store uploads each SST file with ``copyFromLocalFile``; S3A's optimized path for it goes through the
AWS SDK's asynchronous client, which failed every upload against such a server (``Status Code: 100``): the settings
the provider derives from the AWS environment (``airflow_arroyo.jvm.s3a_conf``, applied by ``s3a_on``) take the
classic path. A stateful query commits its state on S3 and a second run restores it from there.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from tests.runtime.conftest import S3Server, s3a_on

pytestmark = [pytest.mark.spark]

ROCKSDB = "org.apache.spark.sql.execution.streaming.state.RocksDBStateStoreProvider"
PROVIDER = "spark.sql.streaming.stateStore.providerClass"


def test_rocksdb_state_commits_to_and_restores_from_s3a(spark: Any, s3_server: S3Server, bucket: str,
                                                        tmp_path: Path) -> None:
    from pyspark.sql import functions as F

    inbox = tmp_path / "in"
    inbox.mkdir()
    files = [[{"k": "a", "v": 1}, {"k": "b", "v": 2}], [{"k": "a", "v": 3}, {"k": "c", "v": 4}]]
    checkpoint = f"{bucket.replace('s3://', 's3a://', 1)}/checkpoint"
    batches: list[dict[str, int]] = []

    def run_available() -> None:
        df = spark.readStream.schema("k string, v long").json(str(inbox))
        query = (df.groupBy("k").agg(F.sum("v").alias("total")).writeStream.outputMode("complete")
                 .foreachBatch(lambda out, _b: batches.append({r["k"]: r["total"] for r in out.collect()}))
                 .option("checkpointLocation", checkpoint).trigger(availableNow=True).start())
        query.awaitTermination(300)
        assert query.exception() is None, query.exception()

    saved = spark.conf.get(PROVIDER, None)
    spark.conf.set(PROVIDER, ROCKSDB)
    try:
        with s3a_on(spark, s3_server, bucket):
            for n, rows in enumerate(files):
                (inbox / f"{n}.json").write_text("".join(json.dumps(r) + "\n" for r in rows))
                run_available()  # the second run is a restart: its state comes from S3
    finally:
        if saved is None:
            spark.conf.unset(PROVIDER)
        else:
            spark.conf.set(PROVIDER, saved)

    expected: Counter[str] = Counter()
    for rows in files:
        for r in rows:
            expected[r["k"]] += r["v"]
    assert batches[-1] == dict(expected)
    keys = s3_server.keys(f"{bucket}/checkpoint/state")
    assert any(k.endswith(".sst") for k in keys), keys  # RocksDB's files, uploaded to S3
    assert any(k.endswith(".zip") for k in keys), keys
