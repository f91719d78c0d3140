"""Kafka source offsets of an epoch against what the topics still hold.

Spark's Kafka source records, in each batch's ``offsets/<b>`` entry, where it read up to per topic partition
(``{"orders": {"0": 120, "1": 98}}``), so an epoch's snapshot holds the offsets a restore resumes from. When a
topic's retention deleted records past such an offset, a restore would skip them (``failOnDataLoss=false``) or
fail after its commit point (the default). :func:`lost_offsets` finds them before anything changes, so that the
driver refuses the epoch by name (epoch, topic, partition, offsets).

The Kafka sources of a stage are read from its analyzed plan (:func:`kafka_sources`): the options the user gave
``spark.readStream.format("kafka")``. The check asks the cluster for each partition's earliest offset with the
``bootstrap.servers`` and ``security.protocol`` of those options only (librdkafka takes no JAAS configuration); a
cluster it cannot reach is logged and left to Spark's own check when the query starts.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["KafkaSource", "LostOffset", "kafka_offsets", "kafka_sources", "lost_offsets"]

log = logging.getLogger(__name__)

_TIMEOUT_S = 15.0


@dataclass(frozen=True)
class KafkaSource:
    """One ``format("kafka")`` relation: its cluster and what it reads (``subscribe``/``assign`` topics or a
    ``subscribePattern``)."""

    bootstrap_servers: str
    topics: frozenset[str]
    pattern: str | None = None
    security_protocol: str | None = None

    def reads(self, topic: str) -> bool:
        """Whether this source reads ``topic``."""
        return topic in self.topics or (self.pattern is not None and re.fullmatch(self.pattern, topic) is not None)


@dataclass(frozen=True)
class LostOffset:
    """A partition whose records from ``offset`` on are gone: the topic now starts at ``earliest``."""

    topic: str
    partition: int
    offset: int
    earliest: int

    def __str__(self) -> str:
        return f"{self.topic}[{self.partition}] at offset {self.offset} (the topic now starts at {self.earliest})"


def source_of(options: Mapping[str, str]) -> KafkaSource | None:
    """A :class:`KafkaSource` from a Kafka relation's options (None without ``kafka.bootstrap.servers``)."""
    opts = {k.lower(): v for k, v in options.items()}
    servers = opts.get("kafka.bootstrap.servers")
    if not servers:
        return None
    topics = {t.strip() for t in opts.get("subscribe", "").split(",") if t.strip()}
    if opts.get("assign"):
        with contextlib.suppress(json.JSONDecodeError, TypeError):  # Spark refuses a bad one itself
            topics |= set(json.loads(opts["assign"]))
    return KafkaSource(servers, frozenset(topics), opts.get("subscribepattern"), opts.get("kafka.security.protocol"))


def kafka_sources(df: Any) -> list[KafkaSource]:
    """The Kafka sources of a streaming DataFrame, from its analyzed plan (none for a Spark Connect one)."""
    try:
        plan = df._jdf.queryExecution().analyzed()
    except Exception:  # noqa: BLE001 - no JVM plan to read (Spark Connect): Spark's own check remains
        return []
    found: list[KafkaSource] = []
    stack = [plan]
    while stack:
        node = stack.pop()
        if node.getClass().getSimpleName() == "StreamingRelationV2" and str(node.sourceName()).lower() == "kafka":
            source = source_of(dict(node.extraOptions().asCaseSensitiveMap()))
            if source is not None:
                found.append(source)
        children = node.children()
        stack.extend(children.apply(i) for i in range(children.size()))
    return found


def kafka_offsets(offsets_log: str) -> dict[str, dict[int, int]]:
    """The Kafka-shaped offsets (``{topic: {partition: offset}}``) of one ``offsets/<b>`` file of a checkpoint."""
    out: dict[str, dict[int, int]] = {}
    for line in offsets_log.splitlines()[2:]:  # "v1", the batch metadata, then one line per source
        try:
            value = json.loads(line)
        except json.JSONDecodeError:
            continue
        if not isinstance(value, dict):
            continue
        for topic, parts in value.items():
            if isinstance(parts, dict) and parts and all(
                    isinstance(p, str) and p.lstrip("-").isdigit() and isinstance(o, int) for p, o in parts.items()):
                out.setdefault(topic, {}).update({int(p): o for p, o in parts.items()})
    return out


def lost_offsets(sources: Iterable[KafkaSource], offsets: Mapping[str, Mapping[int, int]]) -> list[LostOffset]:
    """The partitions of ``offsets`` whose records from that offset on the topic no longer holds."""
    lost: list[LostOffset] = []
    by_cluster: dict[tuple[str, str | None], dict[str, Mapping[int, int]]] = {}
    for topic, parts in offsets.items():
        source = next((s for s in sources if s.reads(topic)), None)
        if source is not None:
            by_cluster.setdefault((source.bootstrap_servers, source.security_protocol), {})[topic] = parts
    for (servers, protocol), topics in by_cluster.items():
        try:
            earliest = _earliest(servers, protocol, topics)
        except Exception as exc:  # noqa: BLE001 - librdkafka's KafkaException: Spark checks again at start
            log.warning("cannot check the Kafka offsets of %s on %s (%s); Spark's source checks them when the "
                        "query starts", ", ".join(sorted(topics)), servers, exc)
            continue
        for topic, parts in sorted(topics.items()):
            for partition, offset in sorted(parts.items()):
                first = earliest.get((topic, partition))
                if partition >= 0 and offset >= 0 and first is not None and offset < first:
                    lost.append(LostOffset(topic, partition, offset, first))
    return lost


def _earliest(servers: str, protocol: str | None,
              topics: Mapping[str, Mapping[int, int]]) -> dict[tuple[str, int], int]:
    from confluent_kafka import Consumer, TopicPartition

    conf: dict[str, Any] = {"bootstrap.servers": servers, "group.id": "arroyo-offset-check",
                            "enable.auto.commit": False}
    if protocol:
        conf["security.protocol"] = protocol
    consumer = Consumer(conf)
    try:
        return {(t, p): int(consumer.get_watermark_offsets(TopicPartition(t, p), timeout=_TIMEOUT_S)[0])
                for t, parts in topics.items() for p in parts}
    finally:
        consumer.close()
