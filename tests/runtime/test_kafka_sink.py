"""The exactly-once Kafka sink against a real broker: staged micro-batches become visible to a read_committed
consumer only when committed, whole epochs at once; a superseded run is fenced; a transaction a killed
driver left open is aborted by the next run and its rows produced once; a restore behind what Kafka made
public is refused unless re-emission is allowed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from airflow_arroyo.core.exceptions import ConfigurationError, FencedError
from airflow_arroyo.core.fs import FileSystem
from airflow_arroyo.runtime.sinks.kafka import KafkaTarget, TransactionalKafkaSink
from airflow_arroyo.store import FencingToken

pytestmark = pytest.mark.spark


@pytest.fixture
def topic(kafka_broker: Any) -> str:
    name = f"out-{uuid.uuid4().hex[:8]}"
    kafka_broker.create_topic(name, partitions=3)
    return name


def make_sink(kafka_broker: Any, topic: str, staging: Path, *, generation: int = 1, **target: Any
              ) -> TransactionalKafkaSink:
    pipeline = f"p-{staging.name}"  # one pipeline per test: its transactional id and markers are its own
    sink = TransactionalKafkaSink(pipeline, "out", KafkaTarget(topic, kafka_broker.bootstrap_servers, **target),
                                  FileSystem.from_uri(str(staging)))
    sink.token = FencingToken(pipeline, f"run-{generation}", generation)
    return sink


def batch(spark: Any, ids: range) -> Any:
    return spark.createDataFrame([(f"k{i % 5}", json.dumps({"id": i})) for i in ids], "key string, value string")


def visible(kafka_broker: Any, topic: str) -> list[int]:
    return sorted(json.loads(r.value)["id"] for r in kafka_broker.read_all(topic, read_committed=True))


def test_batches_become_visible_only_when_committed_each_once(spark: Any, kafka_broker: Any, topic: str,
                                                               tmp_path: Path) -> None:
    sink = make_sink(kafka_broker, topic, tmp_path)
    sink.check_writable()
    sink.claim()
    for b in range(3):
        sink.write_batch(batch(spark, range(b * 10, b * 10 + 10)), b)
    assert visible(kafka_broker, topic) == []  # pre-committed: staged, nothing in Kafka yet
    result = sink.commit_through(1)
    assert (result.rows, result.batches) == (20, (0, 1))
    assert visible(kafka_broker, topic) == list(range(20))
    assert sink.commit_through(1).rows == 0  # idempotent
    sink.write_batch(batch(spark, range(20, 30)), 2)  # a re-run of batch 2 replaces its staged rows
    sink.commit_through(2)
    assert visible(kafka_broker, topic) == list(range(30))
    # a new run (the next generation) reads the marker from Kafka: nothing is produced twice
    again = make_sink(kafka_broker, topic, tmp_path, generation=2)
    again.claim()
    assert again.commit_through(2).rows == 0
    again.trim_through(2)
    assert not again.has_state()
    assert visible(kafka_broker, topic) == list(range(30))
    assert {r.key for r in kafka_broker.read_all(topic)} == {f"k{i}".encode() for i in range(5)}


def test_a_superseded_run_cannot_commit(spark: Any, kafka_broker: Any, topic: str, tmp_path: Path) -> None:
    old = make_sink(kafka_broker, topic, tmp_path, generation=1)
    old.claim()
    old.write_batch(batch(spark, range(10)), 0)
    new = make_sink(kafka_broker, topic, tmp_path, generation=2)
    new.claim()  # init_transactions on the same transactional id: the old producer is fenced
    with pytest.raises(FencedError):
        old.commit_through(0)
    with pytest.raises(FencedError):
        old.write_batch(batch(spark, range(10, 20)), 1)  # the newer run's claim fences its staging too
    new.write_batch(batch(spark, range(10)), 0)
    new.commit_through(0)
    assert visible(kafka_broker, topic) == list(range(10))


_LINGER = """
import sys, time
from confluent_kafka import Producer
producer = Producer({"bootstrap.servers": sys.argv[1], "transactional.id": sys.argv[2]})
producer.init_transactions(30)
producer.begin_transaction()
for i in range(100, 110):
    producer.produce(sys.argv[3], value=('{"id": %d}' % i).encode())
producer.flush(30)
print("open", flush=True)
time.sleep(600)
"""


def test_a_transaction_a_killed_driver_left_open_is_aborted_and_its_output_produced_once(
        spark: Any, kafka_broker: Any, topic: str, tmp_path: Path) -> None:
    """A driver SIGKILLed between producing an epoch's rows and committing them leaves its transaction open
    (read_committed consumers stall behind it); the next run's claim aborts it, and its commit produces the
    staged rows once."""
    first = make_sink(kafka_broker, topic, tmp_path, generation=1)
    first.claim()
    first.write_batch(batch(spark, range(100, 110)), 0)
    proc = subprocess.Popen([sys.executable, "-c", _LINGER, kafka_broker.bootstrap_servers,
                             first.transactional_id, topic], stdout=subprocess.PIPE, start_new_session=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == b"open"
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
    assert Counter(r.value for r in kafka_broker.read_all(topic, read_committed=False)).total() == 10
    second = make_sink(kafka_broker, topic, tmp_path, generation=2)
    second.claim()  # aborts the killed driver's transaction
    second.commit_through(0)
    assert visible(kafka_broker, topic) == list(range(100, 110))


def test_a_restore_behind_public_output_is_refused_unless_reemission_is_allowed(
        spark: Any, kafka_broker: Any, topic: str, tmp_path: Path) -> None:
    sink = make_sink(kafka_broker, topic, tmp_path)
    sink.claim()
    for b in range(4):
        sink.write_batch(batch(spark, range(b * 10, b * 10 + 10)), b)
    sink.commit_through(3)
    restored = make_sink(kafka_broker, topic, tmp_path, generation=2)
    assert restored.public_after(1) == 3 and restored.public_after(3) is None
    with pytest.raises(ConfigurationError, match=r"already made batches 2\.\.3 public .*allow_reemit=True"):
        restored.rollback_to(1)
    assert visible(kafka_broker, topic) == list(range(40))  # nothing changed
    reemit = make_sink(kafka_broker, topic, tmp_path, generation=3, allow_reemit=True)
    assert reemit.public_after(1) is None
    reemit.rollback_to(1)
    assert not {b for b in reemit._staged() if b > 1}  # staged batches after the cut dropped
    reemit.write_batch(batch(spark, range(20, 25)), 2)  # the re-run of batch 2 carries other rows
    reemit.commit_through(2)
    assert Counter(visible(kafka_broker, topic)) == Counter([*range(40), *range(20, 25)])


def test_a_missing_topic_or_a_bad_column_is_refused_naming_the_fix(spark: Any, kafka_broker: Any,
                                                                    tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match="topic 'nope' does not exist .* never creates its output topic"):
        make_sink(kafka_broker, "nope", tmp_path).check_writable()
    sink = make_sink(kafka_broker, "nope", tmp_path)
    with pytest.raises(ConfigurationError, match="writes a 'value' column"):
        sink.write_batch(spark.createDataFrame([(1,)], "id int"), 0)
    with pytest.raises(ConfigurationError, match="only the columns key, value, topic, partition; drop or fold id"):
        sink.write_batch(spark.createDataFrame([(1, "x")], "id int, value string"), 0)
    assert KafkaTarget("t", "h:1", config={"sasl.password": "x"}).problem() is not None
