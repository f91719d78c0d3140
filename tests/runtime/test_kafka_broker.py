"""The test suite's Kafka broker (``airflow_arroyo.devtools.kafka``): a real single-node KRaft broker from the
jars Maven resolved, on loopback. Topics with several partitions, a produce/consume round trip, transactions as a
``read_committed`` consumer sees them, and Spark's Kafka source (the connector jar the provider hands to Spark)
reading every partition in a batch and in a stream."""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from airflow_arroyo.devtools.kafka import KafkaBroker


def _topic(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def test_a_topic_gets_the_partitions_asked_for(kafka_broker: KafkaBroker) -> None:
    topic = _topic("parts")
    kafka_broker.create_topic(topic, partitions=3)
    assert kafka_broker.partitions(topic) == [0, 1, 2]
    assert kafka_broker.end_offsets(topic) == {0: 0, 1: 0, 2: 0}
    kafka_broker.add_partitions(topic, 4)
    assert kafka_broker.partitions(topic) == [0, 1, 2, 3]


def test_records_produced_are_consumed_from_every_partition(kafka_broker: KafkaBroker) -> None:
    topic = _topic("round-trip")
    kafka_broker.create_topic(topic, partitions=3)
    for partition in range(3):
        kafka_broker.produce(topic, [(f"k{partition}", f"p{partition}-{i}") for i in range(5)], partition=partition)
    assert kafka_broker.end_offsets(topic) == {0: 5, 1: 5, 2: 5}
    records = kafka_broker.read_all(topic)
    assert [(r.partition, r.offset, r.value) for r in records] == [
        (p, i, f"p{p}-{i}".encode()) for p in range(3) for i in range(5)]
    assert {r.key for r in records} == {b"k0", b"k1", b"k2"}


def test_aborted_and_open_transactions_are_invisible_to_read_committed(kafka_broker: KafkaBroker) -> None:
    """A transactional producer's aborted records are skipped by a ``read_committed`` consumer (a
    ``read_uncommitted`` one sees them); records of a transaction still open are not visible until it commits."""
    topic = _topic("txn")
    kafka_broker.create_topic(topic, partitions=3)
    producer = kafka_broker.producer({"transactional.id": f"arroyo-test-{uuid.uuid4().hex[:8]}"})
    producer.init_transactions(30)

    def write(values: list[str]) -> None:
        producer.begin_transaction()
        for i, value in enumerate(values):
            producer.produce(topic, value=value, partition=i % 3)
        producer.flush(30)

    write(["c1", "c2", "c3"])
    producer.commit_transaction(30)
    write(["a1", "a2", "a3"])
    producer.abort_transaction(30)
    write(["o1", "o2", "o3"])  # left open

    def values(read_committed: bool) -> list[str]:
        return sorted(r.value.decode() for r in kafka_broker.read_all(topic, read_committed=read_committed)
                      if r.value is not None)

    assert values(read_committed=True) == ["c1", "c2", "c3"]
    assert values(read_committed=False) == ["a1", "a2", "a3", "c1", "c2", "c3", "o1", "o2", "o3"]
    producer.commit_transaction(30)
    assert values(read_committed=True) == ["c1", "c2", "c3", "o1", "o2", "o3"]


@pytest.mark.spark
def test_spark_reads_every_partition_in_a_batch_and_a_stream(kafka_broker: KafkaBroker, spark: Any) -> None:
    """Spark's Kafka source (``spark-sql-kafka``, from the jars the provider hands to a local master) reads the
    broker's topic: a batch read and a streaming query into the memory sink get every partition's rows."""
    topic = _topic("spark")
    kafka_broker.create_topic(topic, partitions=3)
    for partition in range(3):
        kafka_broker.produce(topic, [f"{partition}:{i}" for i in range(10)], partition=partition)
    options = {"kafka.bootstrap.servers": kafka_broker.bootstrap_servers, "subscribe": topic,
               "startingOffsets": "earliest"}

    batch = spark.read.format("kafka").options(**options).load()
    rows = batch.selectExpr("partition", "offset", "CAST(value AS STRING) AS value").collect()
    assert sorted((r.partition, r.offset, r.value) for r in rows) == [
        (p, i, f"{p}:{i}") for p in range(3) for i in range(10)]

    name = f"kafka_{uuid.uuid4().hex[:8]}"
    query = (spark.readStream.format("kafka").options(**options).load()
             .selectExpr("partition", "CAST(value AS STRING) AS value")
             .writeStream.format("memory").queryName(name).trigger(availableNow=True).start())
    try:
        assert query.awaitTermination(120), "the availableNow query did not end"
        assert query.exception() is None
        streamed = spark.table(name).collect()
    finally:
        query.stop()
        spark.catalog.dropTempView(name)
    assert {p: sorted(r.value for r in streamed if r.partition == p) for p in range(3)} == {
        p: sorted(f"{p}:{i}" for i in range(10)) for p in range(3)}
