"""Kafka in, Kafka out, exactly once under SIGKILL (issue 29, items 3 and 4): the example pipeline
``kafka_orders`` (Spark's Kafka source, a deduplication by id in keyed state, the exactly-once Kafka sink) is
killed at random moments while input keeps arriving, a partition is added to the input topic between runs,
and every run restarts from the latest epoch. A ``read_committed`` consumer of the output, read after every
kill and at the end, must see every distinct order exactly once: none lost, none twice. The expectation is
computed in plain Python from what the test produced."""

from __future__ import annotations

import contextlib
import functools
import json
import random
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from airflow_arroyo.core.epochs import EpochState, PipelineState
from airflow_arroyo.core.provenance import epoch_provenance
from airflow_arroyo.examples.pipelines import kafka_order
from airflow_arroyo.store import EpochStore
from airflow_arroyo.testing import CheckpointTicker, wait_for
from tests.runtime.test_exactly_once import Driver, current

pytestmark = [pytest.mark.spark, pytest.mark.slow]


def produce_orders(kafka_broker: Any, topic: str, ids: range, *, partition: int | None = None) -> list[int]:
    """Orders ``ids`` (every tenth one twice, as an at-least-once producer would); returns the ids sent."""
    sent = [i for i in ids for _ in range(2 if i % 10 == 0 else 1)]
    records = [(f"k{i}", json.dumps(kafka_order(i))) for i in sent]
    if partition is None:
        kafka_broker.produce(topic, records)
        return sent
    # a partition just added: produce with a client whose metadata already has it
    producer = kafka_broker.producer()
    wait_for(lambda: partition in producer.list_topics(topic, timeout=5.0).topics[topic].partitions, timeout=60,
             what=f"partition {partition} of {topic} in the metadata")
    for key, value in records:
        producer.produce(topic, key=key, value=value, partition=partition)
    assert producer.flush(30) == 0
    return sent


def kafka_clients() -> int:
    """The Kafka clients alive in this process: librdkafka names each one's main thread ``rdk:main``."""
    alive = 0
    for task in Path("/proc/self/task").iterdir():
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):  # a thread that ended meanwhile
            alive += (task / "comm").read_text().strip() == "rdk:main"
    return alive


def output_ids(kafka_broker: Any, topic: str) -> Counter[int]:
    return Counter(json.loads(r.value)["id"] for r in kafka_broker.read_all(topic, read_committed=True))


def test_kafka_in_kafka_out_is_exactly_once_across_sigkills(store: EpochStore, kafka_broker: Any,
                                                             tmp_path: Path) -> None:
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    print(f"seed={seed}")
    pid = f"kk-{uuid.uuid4().hex[:8]}"
    source, out = f"orders-{pid}", f"unique-{pid}"
    kafka_broker.create_topic(source, partitions=3)
    kafka_broker.create_topic(out, partitions=3)
    logs = tmp_path / "logs"
    logs.mkdir()
    start = functools.partial(
        Driver, dsn=store.dsn, storage=tmp_path / "storage", pipeline_id=pid, logs=logs, sink=tmp_path / "unused",
        pipeline="airflow_arroyo.examples.pipelines:kafka_orders",
        args={"bootstrap_servers": kafka_broker.bootstrap_servers, "input_topic": source, "output_topic": out,
              "max_offsets_per_trigger": 60})
    produced = set(produce_orders(kafka_broker, source, range(0, 400)))

    def running(run_id: str) -> bool:
        rec = current(store, pid)
        return rec is not None and rec.run_id == run_id and rec.state is PipelineState.RUNNING

    kills = []
    with CheckpointTicker(store, pid, interval=1.0, timeout=60.0, tick=0.1):
        for k in range(3):
            run_id = f"run-{k}"
            before = store.latest_completed_epoch(pid) if current(store, pid) else None
            driver = start(run_id=run_id)
            try:
                wait_for(lambda: running(run_id) or not driver.alive(), timeout=300,  # noqa: B023
                         what=f"{run_id} to run")
                assert driver.alive(), driver.tail()

                def completed_one(run_id: str = run_id, before: Any = before) -> bool:
                    latest = store.latest_completed_epoch(pid)
                    return latest is not None and latest.run_id == run_id and (
                        before is None or latest.epoch > before.epoch)

                wait_for(lambda: completed_one() or not driver.alive(), timeout=240,  # noqa: B023
                         what=f"an epoch of {run_id}")
                assert driver.alive(), driver.tail()
                time.sleep(rng.uniform(0.0, 3.0))  # a random moment of the run, not a wait for a condition
            finally:
                driver.kill()
            seen = output_ids(kafka_broker, out)
            kills.append({"run": run_id, "visible": sum(seen.values()),
                          "restored_from": store.get_pipeline(pid).restored_from_epoch})
            print(f"killed {kills[-1]}")
            assert not [i for i, n in seen.items() if n > 1], f"after killing {run_id}: ids twice"
            assert set(seen) <= produced
            if k == 0:  # a partition added while the pipeline is down: the next runs must read it
                kafka_broker.add_partitions(source, 4)
                produced |= set(produce_orders(kafka_broker, source, range(400, 460), partition=3))
            produced |= set(produce_orders(kafka_broker, source, range(460 + k * 100, 560 + k * 100)))
        assert any(k["restored_from"] for k in kills), kills
        final = start(run_id="final")
        try:
            wait_for(lambda: len(output_ids(kafka_broker, out)) >= len(produced) or not final.alive(), timeout=300,
                     interval=1.0, what="every order in the output")
            assert final.alive(), final.tail()
        except AssertionError:
            final.kill()
            raise
    store.request_stop(pid, "graceful")
    assert final.wait(300) == 0, final.tail()
    seen = output_ids(kafka_broker, out)
    assert seen == Counter(sorted(produced)), (len(seen), len(produced))
    values = {json.loads(r.value)["id"]: json.loads(r.value) for r in kafka_broker.read_all(out)}
    assert all(values[i] == kafka_order(i) for i in produced)
    # provenance (issue 33): the completed epochs' Kafka ranges, read back from their snapshots, chain without a gap
    # or an overlap across the kills and restores, and the last one ends where the topic ends
    chained: dict[str, Any] | None = None
    for record in sorted(store.list_epochs(pid, limit=1000, states=[EpochState.COMPLETED]), key=lambda e: e.epoch):
        ranges = [r for s in epoch_provenance(store, pid, record.epoch).stages for r in s.sources
                  if r.end is not None and source in r.end]
        assert len(ranges) == 1, (record.epoch, ranges)
        if chained is not None:
            assert ranges[0].start == chained, record.epoch
        chained = ranges[0].end
    assert chained is not None
    assert {int(p): int(o) for p, o in chained[source].items()} == kafka_broker.end_offsets(source)


def test_an_epoch_whose_kafka_offsets_retention_deleted_is_refused_by_name(
        spark: Any, store: EpochStore, kafka_broker: Any, tmp_path: Path) -> None:
    """Issue 29, item 3: offsets a restore needs that the topic no longer holds are refused before anything
    changes, naming the epoch, topic, partition and offsets, never skipped; a later epoch still restores."""
    from confluent_kafka import TopicPartition

    from airflow_arroyo.core.exceptions import ConfigurationError, UnrestorableEpochError
    from airflow_arroyo.examples.pipelines import kafka_orders
    from airflow_arroyo.runtime.driver import PipelineDriver
    from airflow_arroyo.testing import run_until

    pid = f"kr-{uuid.uuid4().hex[:8]}"
    source, out = f"orders-{pid}", f"unique-{pid}"
    kafka_broker.create_topic(source, partitions=2)
    kafka_broker.create_topic(out, partitions=1)
    produced = set(produce_orders(kafka_broker, source, range(300)))

    def driver(*, allow_reemit: bool = False, **kwargs: Any) -> PipelineDriver:
        pipeline = kafka_orders(pid, kafka_broker.bootstrap_servers, source, out, max_offsets_per_trigger=20,
                                allow_reemit=allow_reemit)
        return PipelineDriver(pipeline, store, storage_uri=str(tmp_path / "storage"), spark=spark, **kwargs)

    run_until(driver(), store, lambda: len(output_ids(kafka_broker, out)) >= len(produced) and len(
        [e for e in store.list_epochs(pid, limit=100) if e.outcome is not None]) >= 3, what="every order out",
        interval=1.0)
    completed = sorted(e.epoch for e in store.list_epochs(pid, limit=100) if e.state.value == "completed")
    first, latest = completed[0], completed[-1]
    # retention deletes partition 0's records before its end offset (as a topic's retention.ms would)
    end = kafka_broker.end_offsets(source)[0]
    admin = kafka_broker.admin()
    admin.delete_records([TopicPartition(source, 0, end - 5)])[TopicPartition(source, 0, end - 5)].result(30)
    # item 4 first: the output of the epochs after the first is public in Kafka, so restoring it is refused
    with pytest.raises(ConfigurationError, match=rf"restoring epoch {first} would take back output sink .* "
                                                 rf"already made public .*epoch\(s\) {first + 1}, .*allow_reemit"):
        driver(restore_from=first, run_id="public").run()
    with pytest.raises(UnrestorableEpochError, match=rf"epoch {first} cannot be restored: stage .* offsets the "
                                                      rf"topics no longer hold: {source}\[0\] at offset \d+ \(the "
                                                      rf"topic now starts at {end - 5}\)"):
        driver(restore_from=first, run_id="lost", allow_reemit=True).run()
    assert store.get_epoch(pid, first).unrestorable is not None
    assert store.latest_completed_epoch(pid).epoch == latest  # nothing changed
    # the latest epoch read partition 0 to its end: it still restores (stopped right after the restore)
    later = driver(restore_from="latest", run_id="later")
    clients = kafka_clients()
    run_until(later, store, lambda: True, what="the restored run", epochs=False)
    assert kafka_clients() == clients, "the run ended with its sink's Kafka producer still open"
    assert store.get_pipeline(pid).restored_from_epoch == latest
    assert output_ids(kafka_broker, out) == Counter(sorted(produced))  # the refused restores emitted nothing
