"""Reading Kafka offsets out of a checkpoint's offsets log and Kafka sources out of their options (pure)."""

from __future__ import annotations

from airflow_arroyo.runtime.kafka_offsets import KafkaSource, LostOffset, kafka_offsets, lost_offsets, source_of


def test_kafka_offsets_are_read_from_an_offsets_log_and_other_sources_are_left_out() -> None:
    log = "\n".join([
        "v1",
        '{"batchWatermarkMs":0,"batchTimestampMs":1}',
        '{"orders":{"1":98,"0":120}}',
        '{"position": 7}',  # a channel reader's offset: not Kafka's shape
        "-",
        '{"payments":{"0":3},"orders":{"2":5}}',
    ])
    assert kafka_offsets(log) == {"orders": {0: 120, 1: 98, 2: 5}, "payments": {0: 3}}
    assert kafka_offsets("v1\n{}\n") == {}


def test_sources_say_which_topics_they_read() -> None:
    s = source_of({"kafka.bootstrap.servers": "b:9092", "subscribe": "orders, payments"})
    assert s == KafkaSource("b:9092", frozenset({"orders", "payments"}))
    assert s is not None and s.reads("orders") and not s.reads("other")
    assigned = source_of({"Kafka.Bootstrap.Servers": "b:9092", "assign": '{"t1":[0,1]}'})
    assert assigned is not None and assigned.reads("t1")
    pattern = source_of({"kafka.bootstrap.servers": "b:9092", "subscribePattern": "orders-.*"})
    assert pattern is not None and pattern.reads("orders-eu") and not pattern.reads("payments")
    assert source_of({"subscribe": "x"}) is None


def test_topics_no_source_reads_are_not_checked() -> None:
    """Nothing to ask a cluster about: no source reads the topic, so no client is made (none could connect)."""
    assert lost_offsets([KafkaSource("127.0.0.1:1", frozenset({"a"}))], {"b": {0: 5}}) == []
    assert str(LostOffset("t", 2, 10, 40)) == "t[2] at offset 10 (the topic now starts at 40)"
