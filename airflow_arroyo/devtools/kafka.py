"""A throwaway Apache Kafka broker: one KRaft node (broker and controller in one JVM) on loopback ports.

Used by the test suite (the ``kafka_broker`` fixture) and the demo. It runs the broker's jars that
``scripts/dev.sh`` resolves with Maven (``airflow_arroyo/jvm/deps/kafka/pom.xml``, a class path of its own:
:func:`airflow_arroyo.jvm.artifacts.jar_folder`) with the machine's ``java``: ``kafka.tools.StorageTool format``
once with a random cluster id, then ``kafka.Kafka server.properties``, in a process group of its own that
:meth:`KafkaBroker.stop` ends. Its data (``log.dirs``), its configuration and its log (``server.log``) are
under ``base_dir``. The Python side talks to it with ``confluent-kafka`` (the ``[kafka]`` extra).

    with KafkaBroker() as kafka:
        kafka.create_topic("events", partitions=3)
        kafka.produce("events", [b"a", b"b"])
        print(kafka.bootstrap_servers)     # 127.0.0.1:PORT
"""

from __future__ import annotations

import base64
import logging
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

from airflow_arroyo.jvm import artifacts

__all__ = ["BrokerError", "KafkaBroker", "Record", "java_binary"]

log = logging.getLogger(__name__)
#: librdkafka's own log lines (a refused connection while the broker starts, ...) go here, not to stderr
client_log = logging.getLogger(f"{__name__}.client")

_SERVER_MAIN = "kafka.Kafka"
_STORAGE_TOOL = "kafka.tools.StorageTool"
_NODE_ID = 1
_LOG4J2 = """\
status = warn
appender.file.type = File
appender.file.name = file
appender.file.fileName = {log_file}
appender.file.layout.type = PatternLayout
appender.file.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = info
rootLogger.appenderRef.file.ref = file
"""


class BrokerError(RuntimeError):
    """The broker did not start, or a call to it did not complete in time."""


@dataclass(frozen=True)
class Record:
    """A record read back from a topic."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None


def java_binary() -> str:
    """``$JAVA_HOME/bin/java`` when there is one, else ``java`` on PATH."""
    home = os.environ.get("JAVA_HOME")
    if home and (Path(home) / "bin" / "java").exists():
        return str(Path(home) / "bin" / "java")
    found = shutil.which("java")
    if found is None:
        raise BrokerError("java not found: the Kafka broker needs a JRE 17 or newer (apt-get install "
                          "openjdk-17-jre-headless)")
    return found


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _cluster_id() -> str:
    """A cluster id as Kafka writes one (``Uuid``: 16 random bytes, URL-safe base64 without padding), never
    starting with ``-`` (the storage tool would read it as an option)."""
    while True:
        out = base64.urlsafe_b64encode(uuid.uuid4().bytes).rstrip(b"=").decode()
        if not out.startswith("-"):
            return out


def _wait(condition: Callable[[], bool], timeout: float, what: str, interval: float = 0.1) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise BrokerError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


class KafkaBroker:
    """A single-node Kafka (KRaft) on 127.0.0.1, PLAINTEXT, its data in ``base_dir``.

    :param base_dir: the broker's folder (data, configuration, log); a temporary one, deleted by
        :meth:`cleanup`, when not given.
    :param jars: the folder holding the broker's jars (default: the resolved ``kafka`` set).
    :param config: broker settings that replace or extend the defaults of :meth:`properties`.
    :param heap: the broker JVM's maximum heap (``-Xmx``).
    """

    def __init__(self, base_dir: str | Path | None = None, *, port: int | None = None,
                 controller_port: int | None = None, jars: str | Path | None = None,
                 config: Mapping[str, str] | None = None, heap: str = "512m", start_timeout: float = 90.0) -> None:
        self._owns_dir = base_dir is None
        self.base_dir = Path(base_dir) if base_dir else Path(tempfile.mkdtemp(prefix="arroyo-kafka-"))
        self.data_dir = self.base_dir / "data"
        self.config_file = self.base_dir / "server.properties"
        self.log_file = self.base_dir / "server.log"
        self.out_file = self.base_dir / "broker.out"
        self.port = port or _free_port()
        self.controller_port = controller_port or _free_port()
        self.jars = Path(jars) if jars else artifacts.jar_folder(artifacts.KAFKA)
        self.config = dict(config or {})
        self.heap = heap
        self.start_timeout = start_timeout
        self._proc: subprocess.Popen[bytes] | None = None
        self._producer: Any = None  # produce()'s, made once: a producer's start costs a round trip or more

    @property
    def bootstrap_servers(self) -> str:
        """``host:port`` of the PLAINTEXT listener, what clients and Spark's ``kafka.bootstrap.servers`` take."""
        return f"127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        """The broker JVM's process id while it runs."""
        return self._proc.pid if self._proc is not None and self._proc.poll() is None else None

    def properties(self) -> dict[str, str]:
        """The broker's ``server.properties``: one node that is broker and controller, loopback listeners, and
        internal topics a single node can hold (replication factor 1, few partitions)."""
        return {
            "process.roles": "broker,controller",
            "node.id": str(_NODE_ID),
            "controller.quorum.voters": f"{_NODE_ID}@127.0.0.1:{self.controller_port}",
            "listeners": f"PLAINTEXT://127.0.0.1:{self.port},CONTROLLER://127.0.0.1:{self.controller_port}",
            "advertised.listeners": f"PLAINTEXT://127.0.0.1:{self.port}",
            "controller.listener.names": "CONTROLLER",
            "inter.broker.listener.name": "PLAINTEXT",
            "listener.security.protocol.map": "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
            "log.dirs": str(self.data_dir),
            "num.partitions": "3",
            "offsets.topic.replication.factor": "1",
            # the first consumer group and the first transactional producer create these topics: 50 partitions
            # each by default, seconds of a test's time on a node that needs few
            "offsets.topic.num.partitions": "3",
            "transaction.state.log.replication.factor": "1",
            "transaction.state.log.min.isr": "1",
            "transaction.state.log.num.partitions": "3",
            "share.coordinator.state.topic.replication.factor": "1",
            "share.coordinator.state.topic.min.isr": "1",
            "group.initial.rebalance.delay.ms": "0",
            **self.config,
        }

    def _java(self, main: str, *args: str) -> list[str]:
        if not any(self.jars.glob("kafka_*.jar")):
            raise BrokerError(f"no Kafka broker jars in {self.jars}: run scripts/dev.sh setup (it resolves "
                              "airflow_arroyo/jvm/deps/kafka/pom.xml with Maven)")
        return [java_binary(), f"-Xmx{self.heap}", "-Djava.awt.headless=true",
                f"-Dlog4j2.configurationFile={self.base_dir / 'log4j2.properties'}",
                "-cp", str(self.jars / "*"), main, *args]

    def init(self) -> None:
        """Write the configuration and, on a first start, format the data folder (KRaft needs it)."""
        self.base_dir.mkdir(parents=True, exist_ok=True)
        self.config_file.write_text("".join(f"{k}={v}\n" for k, v in self.properties().items()))
        (self.base_dir / "log4j2.properties").write_text(_LOG4J2.format(log_file=self.log_file))
        if (self.data_dir / "meta.properties").exists():
            return
        proc = subprocess.run(self._java(_STORAGE_TOOL, "format", "-t", _cluster_id(), "-c", str(self.config_file)),
                              capture_output=True, text=True)
        if proc.returncode != 0:
            raise BrokerError(f"formatting {self.data_dir} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")

    def start(self) -> None:
        """Start the broker and return once a client's metadata request lists it."""
        if self.pid is not None:
            return
        self.init()
        with open(self.out_file, "ab") as out:
            # a process group of its own: stop() ends the JVM and anything it started, and a Ctrl-C in the
            # terminal that started it does not reach it
            self._proc = subprocess.Popen(self._java(_SERVER_MAIN, str(self.config_file)), stdout=out,
                                          stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                          start_new_session=True, close_fds=True)
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        log.info("Kafka broker on %s (pid %s, %s)", self.bootstrap_servers, self._proc.pid, self.base_dir)

    def _wait_ready(self) -> None:
        from confluent_kafka.admin import AdminClient

        admin = AdminClient(self.client_conf())
        deadline = time.monotonic() + self.start_timeout
        while True:
            proc = self._proc
            if proc is None or proc.poll() is not None:
                raise BrokerError(f"the Kafka broker exited ({None if proc is None else proc.returncode}) while "
                                  f"starting:\n{self._tail()}")
            try:
                if _NODE_ID in admin.list_topics(timeout=1.0).brokers:
                    return
                last: Exception | None = None
            except Exception as exc:  # noqa: BLE001 - confluent_kafka's KafkaException: not serving yet
                last = exc
            if time.monotonic() > deadline:
                raise BrokerError(f"the Kafka broker on {self.bootstrap_servers} did not answer a metadata request "
                                  f"within {self.start_timeout:.0f} s ({last}):\n{self._tail()}")
            time.sleep(0.1)

    def _tail(self, lines: int = 30) -> str:
        out = []
        for path in (self.out_file, self.log_file):
            if path.exists():
                out += path.read_text(errors="replace").splitlines()[-lines:]
        return "\n".join(out)

    def stop(self, timeout: float = 20.0) -> None:
        """End the broker's process group: SIGTERM (a controlled shutdown), SIGKILL after ``timeout`` seconds."""
        self._end(((signal.SIGTERM, timeout), (signal.SIGKILL, 10.0)))

    def kill(self) -> None:
        """SIGKILL the broker's process group at once (a crash); :meth:`start` starts it again on the same data."""
        self._end(((signal.SIGKILL, 10.0),))

    def _end(self, steps: tuple[tuple[signal.Signals, float], ...]) -> None:
        proc, self._proc, self._producer = self._proc, None, None
        if proc is None:
            return
        for sig, wait in steps:
            if proc.poll() is not None:
                break
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                proc.wait(wait)
            except subprocess.TimeoutExpired:
                continue
        if proc.poll() is None:
            raise BrokerError(f"the Kafka broker (pid {proc.pid}) did not exit")

    def restart(self) -> None:
        self.stop()
        self.start()

    def cleanup(self) -> None:
        try:
            self.stop()
        finally:
            if self._owns_dir:
                shutil.rmtree(self.base_dir, ignore_errors=True)

    def __enter__(self) -> KafkaBroker:
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.cleanup()

    # ------------------------------------------------------------------ clients

    def client_conf(self, conf: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """A confluent-kafka client's configuration for this broker, ``conf`` added; librdkafka's log lines go to
        :data:`client_log`."""
        return {"bootstrap.servers": self.bootstrap_servers, "logger": client_log, **(conf or {})}

    def admin(self) -> Any:
        """A confluent-kafka ``AdminClient``."""
        from confluent_kafka.admin import AdminClient

        return AdminClient(self.client_conf())

    def producer(self, conf: Mapping[str, Any] | None = None) -> Any:
        """A confluent-kafka ``Producer`` (``{"transactional.id": ...}`` in ``conf`` for a transactional one)."""
        from confluent_kafka import Producer

        return Producer(self.client_conf(conf))

    def consumer(self, group_id: str | None = None, *, read_committed: bool = True,
                 conf: Mapping[str, Any] | None = None) -> Any:
        """A confluent-kafka ``Consumer`` reading from the earliest offset, offsets not committed on its own."""
        from confluent_kafka import Consumer

        return Consumer(self.client_conf({
            "group.id": group_id or f"arroyo-{uuid.uuid4().hex[:12]}",
            "auto.offset.reset": "earliest",
            "enable.auto.commit": False,
            "isolation.level": "read_committed" if read_committed else "read_uncommitted",
            **(conf or {})}))

    def create_topic(self, name: str, partitions: int = 3, config: Mapping[str, str] | None = None,
                     timeout: float = 30.0) -> None:
        """Create a topic and return once every partition has a leader."""
        from confluent_kafka.admin import NewTopic

        admin = self.admin()
        futures = admin.create_topics([NewTopic(name, partitions, 1, config=dict(config or {}))],
                                      operation_timeout=timeout)
        futures[name].result(timeout)
        self._wait_partitions(admin, name, partitions, timeout)

    def add_partitions(self, name: str, total: int, timeout: float = 30.0) -> None:
        """Grow a topic to ``total`` partitions and return once each has a leader."""
        from confluent_kafka.admin import NewPartitions

        admin = self.admin()
        admin.create_partitions([NewPartitions(name, total)], operation_timeout=timeout)[name].result(timeout)
        self._wait_partitions(admin, name, total, timeout)

    def delete_topic(self, name: str, timeout: float = 30.0) -> None:
        admin = self.admin()
        admin.delete_topics([name], operation_timeout=timeout)[name].result(timeout)
        _wait(lambda: name not in admin.list_topics(timeout=5.0).topics, timeout, f"topic {name} to go")

    def _wait_partitions(self, admin: Any, name: str, partitions: int, timeout: float) -> None:
        from confluent_kafka import KafkaError, KafkaException, TopicPartition

        not_yet = {KafkaError.NOT_LEADER_FOR_PARTITION, KafkaError.LEADER_NOT_AVAILABLE,
                   KafkaError.UNKNOWN_TOPIC_OR_PART, KafkaError._TIMED_OUT}

        def ready() -> bool:
            topic = admin.list_topics(topic=name, timeout=5.0).topics.get(name)
            return (topic is not None and topic.error is None and len(topic.partitions) == partitions
                    and all(p.leader >= 0 for p in topic.partitions.values()))

        def served() -> bool:
            # a KRaft broker updates the metadata it serves before its replica manager takes the partition on:
            # in between, a client asking that leader gets NOT_LEADER_FOR_PARTITION
            try:
                for p in range(partitions):
                    consumer.get_watermark_offsets(TopicPartition(name, p), timeout=5.0)
            except KafkaException as e:
                if e.args and isinstance(e.args[0], KafkaError) and e.args[0].code() in not_yet:
                    return False
                raise
            return True

        _wait(ready, timeout, f"topic {name}'s {partitions} partitions to have a leader")
        consumer = self.consumer()
        try:
            _wait(served, timeout, f"topic {name}'s {partitions} partitions to be served by their leader")
        finally:
            consumer.close()

    def partitions(self, topic: str) -> list[int]:
        """The topic's partition numbers, sorted."""
        found = self.admin().list_topics(topic=topic, timeout=10.0).topics.get(topic)
        if found is None or found.error is not None:
            raise BrokerError(f"no topic {topic!r} on {self.bootstrap_servers}")
        return sorted(found.partitions)

    def produce(self, topic: str, values: Iterable[bytes | str | tuple[bytes | str | None, bytes | str | None]],
                *, partition: int | None = None, timeout: float = 30.0) -> int:
        """Write records (values, or ``(key, value)`` pairs) and wait until the broker has them all; how many.
        Without ``partition``, keyed records go by key and the others spread over the partitions."""
        if self._producer is None:
            self._producer = self.producer({"enable.idempotence": True})
        producer = self._producer
        errors: list[str] = []

        def delivered(err: Any, _msg: Any) -> None:
            if err is not None:
                errors.append(str(err))

        count = 0
        for item in values:
            key, value = item if isinstance(item, tuple) else (None, item)
            kwargs: dict[str, Any] = {} if partition is None else {"partition": partition}
            while True:
                try:
                    producer.produce(topic, value=value, key=key, on_delivery=delivered, **kwargs)
                    break
                except BufferError:  # the client's queue is full: let it send some first
                    producer.poll(0.05)
            producer.poll(0)
            count += 1
        left = producer.flush(timeout)
        if left or errors:
            raise BrokerError(f"{left} records not delivered to {topic} in {timeout:.0f} s; errors: {errors[:5]}")
        return count

    def end_offsets(self, topic: str) -> dict[int, int]:
        """Each partition's high watermark (the offset the next record gets)."""
        from confluent_kafka import TopicPartition

        consumer = self.consumer()
        try:
            return {p: int(consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10.0)[1])
                    for p in self.partitions(topic)}
        finally:
            consumer.close()

    def read_all(self, topic: str, *, read_committed: bool = True, timeout: float = 30.0) -> list[Record]:
        """Every record of every partition from its start to its current end, in partition then offset order:
        with ``read_committed``, what a ``read_committed`` consumer sees (records of aborted transactions and of
        transactions still open are left out)."""
        from confluent_kafka import OFFSET_BEGINNING, KafkaError, TopicPartition

        partitions = self.partitions(topic)
        # the end of a partition is known from an empty fetch: answer it at once instead of after 500 ms
        consumer = self.consumer(read_committed=read_committed,
                                 conf={"enable.partition.eof": True, "fetch.wait.max.ms": 10})
        records: list[Record] = []
        try:
            consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in partitions])
            at_end: set[int] = set()
            deadline = time.monotonic() + timeout
            while len(at_end) < len(partitions):
                if time.monotonic() > deadline:
                    raise BrokerError(f"reading {topic}: partitions {sorted(set(partitions) - at_end)} not read to "
                                      f"their end in {timeout:.0f} s")
                msg = consumer.poll(0.1)
                if msg is None:
                    continue
                if msg.error() is not None:
                    if msg.error().code() == KafkaError._PARTITION_EOF:
                        at_end.add(msg.partition())
                        continue
                    raise BrokerError(f"reading {topic}: {msg.error()}")
                at_end.discard(msg.partition())
                records.append(Record(msg.topic(), msg.partition(), msg.offset(), msg.key(), msg.value()))
        finally:
            consumer.close()
        return sorted(records, key=lambda r: (r.partition, r.offset))
