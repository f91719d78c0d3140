"""An exactly-once Kafka sink: micro-batches staged durably, each epoch's output produced and committed in one
Kafka transaction together with a commit marker.

Flink's ``KafkaSink`` pre-commits into an open Kafka transaction per checkpoint and, after a failure, a new
process *resumes* that transaction to commit it (it reaches into the Java client's internals to do so). The
Python client (librdkafka) cannot resume a transaction another process opened, so a transaction here never
outlives the process that opened it: the pre-commit is durable staging, and the commit is one transaction.

* **Pre-commit** (the sink stage's ``foreachBatch``, on the driver, micro-batch *b*): the batch's rows
  (columns ``value``, and optionally ``key``, ``topic``, ``partition``, as Spark's own Kafka sink takes them)
  are written as one Parquet file ``<staging>/<b:012d>-g<G>.parquet`` (``G``: the run's fencing generation),
  appearing whole (a rename on a local disk, one put on an object store). A re-run of *b* replaces it.
* **Commit** (the driver, when an epoch whose sink cut is *c* completes): ONE producer with the sink's
  transactional id ``arroyo.<pipeline>.<sink>`` produces every staged batch in ``(M, c]`` in batch order, and
  a marker ``{"batch": c}`` keyed by the sink into the control topic, in one transaction, then commits it.
  ``M`` is the newest marker of the sink, read ``read_committed``: the batches whose rows Kafka already holds.
  A consumer reading ``read_committed`` sees a whole epoch or nothing of it, across partitions and topics
  (Flink's commits are per subtask; here one transaction per epoch and sink).
* **Fencing and lingering transactions**: before anything else a run writes ``claim-g<G>`` into the staging
  folder (an older run's pre-commits are refused from then on) and calls ``init_transactions`` on the
  sink's transactional id: Kafka aborts a transaction an earlier producer with that id left open (a driver
  killed mid-commit) and fences that producer, so a superseded driver still alive cannot commit. Only then is
  ``M`` read: no earlier run can move it afterwards. Marker and rows are in one transaction, so Kafka never
  holds half of a commit, and a commit cut short is simply produced again by the next one.
* **Rollback** (restore of an epoch whose sink cut is *r*): with ``M <= r``, commit ``(M, r]`` (the restored
  epoch completed; its commit may not have run) and drop the staged batches after *r*. With ``M > r`` the
  output of batches ``(r, M]`` is public and a consumer may have acted on it: Kafka cannot take it back, so
  the restore is refused before its commit point (:meth:`KafkaSink.public_after`), unless the target says
  ``allow_reemit=True``: then a marker ``{"batch": r, "rewind": true}`` is committed and those batches are
  produced again when they run again (a consumer sees them twice).
* **Trim**: staged files of batches at or before the oldest completed epoch's cut are deleted.

The sink never creates its output topics (:meth:`KafkaSink.check_writable` refuses a missing one); it creates
the control topic (one partition, compacted) on first use.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.parquet as pq

from airflow_arroyo.core.exceptions import ConfigurationError, FencedError
from airflow_arroyo.core.fs import FileSystem
from airflow_arroyo.runtime.sinks.base import SinkCommit, newest_generations

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

    from airflow_arroyo.store.records import FencingToken

__all__ = ["CONTROL_TOPIC", "KafkaTarget", "TransactionalKafkaSink"]

log = logging.getLogger(__name__)

#: Where the sinks' commit markers go unless the target names another topic.
CONTROL_TOPIC = "arroyo-sink-commits"
_STAGED = re.compile(r"^(\d{12})-g(\d+)\.parquet$")
_CLAIM = re.compile(r"^claim-g(\d+)$")  # written by a run when it fences: older runs' pre-commits are refused
_COLUMNS = ("key", "value", "topic", "partition")
_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class KafkaTarget:
    """Where a Kafka sink writes: ``topic`` (the default for rows without a ``topic`` column) on
    ``bootstrap_servers``. ``config``: more librdkafka settings for the producer and the marker reader (no
    secrets: those go in ``config_env``, the name of an environment variable holding a JSON object of settings,
    so they stay off command lines and out of logs). ``control_topic``: where commit markers go.
    ``allow_reemit``: accept that a restore to an epoch older than what Kafka already made public produces that
    output again (refused by default). ``transaction_timeout_ms``: Kafka aborts a transaction open longer
    (one epoch's output must be produced within it)."""

    topic: str
    bootstrap_servers: str
    config: Mapping[str, str] = field(default_factory=dict)
    config_env: str | None = None
    control_topic: str = CONTROL_TOPIC
    allow_reemit: bool = False
    transaction_timeout_ms: int = 60_000

    def problem(self) -> str | None:
        """What is wrong with this target (None: nothing), for the graph's validation."""
        if not self.topic or not isinstance(self.topic, str):
            return "topic= must name the output topic"
        if not self.bootstrap_servers:
            return "bootstrap_servers= must name at least one broker (host:port[,host:port])"
        secret = [k for k in self.config if any(w in k.lower() for w in ("password", "secret", "jaas"))]
        if secret:
            return (f"config= holds {', '.join(sorted(secret))}: put credentials in an environment variable "
                    "named by config_env= (a JSON object), not in the pipeline's code")
        if self.transaction_timeout_ms <= 0:
            return "transaction_timeout_ms must be > 0"
        return None

    def client_config(self) -> dict[str, Any]:
        """The settings every client of this target gets (``config_env``'s last)."""
        conf: dict[str, Any] = {"bootstrap.servers": self.bootstrap_servers}
        conf.update({k: str(v) for k, v in self.config.items()})
        if self.config_env:
            raw = os.environ.get(self.config_env)
            if raw is None:
                raise ConfigurationError(f"Kafka sink: environment variable {self.config_env} (config_env) is not set")
            try:
                extra = json.loads(raw)
            except json.JSONDecodeError as exc:
                raise ConfigurationError(f"Kafka sink: {self.config_env} is not a JSON object of settings: "
                                         f"{exc.msg}") from None
            if not isinstance(extra, dict):
                raise ConfigurationError(f"Kafka sink: {self.config_env} must hold a JSON object of settings")
            conf.update({str(k): str(v) for k, v in extra.items()})
        return conf


class TransactionalKafkaSink:
    """The Kafka output of one sink stage (see the module docstring)."""

    def __init__(self, pipeline_id: str, stage: str, target: KafkaTarget, staging: FileSystem) -> None:
        self.pipeline_id = pipeline_id
        self.stage = stage
        self.target = target
        self.staging = staging
        self.uri = f"kafka://{target.bootstrap_servers.split(',')[0]}/{target.topic}"
        self.transactional_id = f"arroyo.{pipeline_id}.{stage}"
        self.token: FencingToken | None = None
        self._producer: Any = None
        self._committed: int | None = None  # M, once fenced and read

    def __repr__(self) -> str:
        return f"TransactionalKafkaSink({self.pipeline_id}/{self.stage} -> {self.uri})"

    @property
    def generation(self) -> int:
        """The fencing generation this sink stages with (0 without a token)."""
        return self.token.generation if self.token is not None else 0

    # ------------------------------------------------------------------ checks

    def check_writable(self) -> None:
        """Refuse (before anything is written) an output topic that does not exist or a broker not reached."""
        from confluent_kafka.admin import AdminClient

        admin = AdminClient(self.target.client_config())
        try:
            topics = admin.list_topics(timeout=_TIMEOUT_S).topics
        except Exception as exc:  # noqa: BLE001 - librdkafka raises KafkaException; say what was tried
            raise ConfigurationError(f"sink {self.stage!r}: cannot reach Kafka at {self.target.bootstrap_servers} "
                                     f"({exc}); check bootstrap_servers and the network") from None
        if self.target.topic not in topics:
            raise ConfigurationError(
                f"sink {self.stage!r}: topic {self.target.topic!r} does not exist on {self.target.bootstrap_servers}; "
                "create it with the partitions and retention you want (the sink never creates its output topic)")

    def has_state(self) -> bool:
        """Whether an earlier run staged batches (a fresh start over them must be asked for)."""
        return bool(self._staged())

    def public_after(self, batch_id: int) -> int | None:
        """The newest batch whose output Kafka already made public, when it is after ``batch_id`` and the target
        does not allow re-emission (a restore to ``batch_id`` would produce it again); else None. Read-only."""
        if self.target.allow_reemit:
            return None
        committed = self._read_marker()
        return committed if committed > batch_id else None

    def close(self) -> None:
        """Let go of the transactional producer (its threads and broker connections). No transaction is open
        between calls; a later use fences anew (``init_transactions``)."""
        producer, self._producer, self._committed = self._producer, None, None
        if producer is not None:
            producer.close()

    # ------------------------------------------------------------------ phases

    def claim(self) -> None:
        """Fence earlier producers of this sink and read what Kafka holds (idempotent)."""
        self._fence()

    def write_batch(self, df: DataFrame, batch_id: int) -> None:
        """Pre-commit micro-batch ``batch_id``: its rows staged as one Parquet file (an earlier attempt replaced)."""
        columns = set(df.columns)
        if "value" not in columns:
            raise ConfigurationError(
                f"sink {self.stage!r}: a Kafka sink writes a 'value' column (string or binary) and optionally "
                f"'key', 'topic', 'partition'; the stage's output has {', '.join(df.columns)}: select or rename "
                "the columns in the sink's transform")
        unknown = columns - set(_COLUMNS)
        if unknown:
            raise ConfigurationError(
                f"sink {self.stage!r}: a Kafka sink takes only the columns {', '.join(_COLUMNS)}; drop or fold "
                f"{', '.join(sorted(unknown))} into 'value' (e.g. to_json(struct(...)))")
        table = df.select(*[c for c in _COLUMNS if c in columns]).toArrow()
        self._check_fence("a pre-commit")
        sink = pa.BufferOutputStream()
        pq.write_table(table, sink)
        self.staging.write_bytes_atomic(_staged_name(batch_id, self.generation), sink.getvalue().to_pybytes())

    def commit_through(self, batch_id: int) -> SinkCommit:
        """Produce and commit every staged batch up to ``batch_id`` not yet in Kafka, in one transaction."""
        committed = self._fence()
        if batch_id <= committed:
            return SinkCommit(files=0, bytes=0, rows=0, batches=())
        staged = self._newest_staged()
        batches = [b for b in sorted(staged) if committed < b <= batch_id]
        self._check_fence("a commit")
        rows = self._transaction(batch_id, (staged[b] for b in batches))
        self._committed = batch_id
        log.info("pipeline=%s sink=%s: committed batches %s..%s to Kafka (%d rows, transactional id %s)",
                 self.pipeline_id, self.stage, committed + 1, batch_id, rows, self.transactional_id)
        return SinkCommit(files=0, bytes=0, rows=rows, batches=tuple(batches))

    def rollback_to(self, batch_id: int) -> None:
        """Keep exactly the batches ``<= batch_id`` in Kafka: commit what is missing of them, drop staged batches
        after it. Refused when Kafka already made later batches public (unless ``allow_reemit``)."""
        committed = self._fence()
        if committed > batch_id:
            if not self.target.allow_reemit:
                raise ConfigurationError(self._public_message(batch_id, committed))
            self._transaction(batch_id, (), rewind=True)
            self._committed = batch_id
            log.warning("pipeline=%s sink=%s: batches %s..%s were public in Kafka and will be produced again "
                        "(allow_reemit)", self.pipeline_id, self.stage, batch_id + 1, committed)
        else:
            self.commit_through(batch_id)
        for b, paths in self._staged().items():
            if b > batch_id:
                for path in paths.values():
                    self.staging.delete(path)

    def trim_through(self, batch_id: int) -> None:
        """Delete the staged files of batches ``<= batch_id`` (committed; no restore goes behind them)."""
        for b, paths in self._staged().items():
            if b <= batch_id:
                for path in paths.values():
                    self.staging.delete(path)

    # ------------------------------------------------------------------ Kafka

    def _fence(self) -> int:
        """``init_transactions`` once per sink object (aborts and fences earlier producers of the id), then the
        newest marker: the last batch Kafka holds."""
        if self._committed is None:
            from confluent_kafka import Producer

            self._ensure_control_topic()
            conf = {**self.target.client_config(), "transactional.id": self.transactional_id,
                    "transaction.timeout.ms": str(self.target.transaction_timeout_ms), "linger.ms": "5"}
            if self.generation:
                self.staging.write_bytes_atomic(f"claim-g{self.generation}", b"")
            self._producer = Producer(conf)
            self._producer.init_transactions(_TIMEOUT_S)
            self._committed = self._read_marker()
            log.info("pipeline=%s sink=%s: fenced earlier producers of %s; Kafka holds batches through %s",
                     self.pipeline_id, self.stage, self.transactional_id, self._committed)
        return self._committed

    def _transaction(self, batch_id: int, tables: Iterable[str], *, rewind: bool = False) -> int:
        """One transaction: every row of the staged files ``tables``, then the marker; returns the rows sent."""
        from confluent_kafka import KafkaException

        producer = self._producer
        rows = 0
        producer.begin_transaction()
        try:
            for path in tables:
                rows += self._produce(pq.read_table(self.staging.open_input(path)))
            marker = {"batch": batch_id, "generation": self.generation, **({"rewind": True} if rewind else {})}
            producer.produce(self.target.control_topic, key=self.transactional_id.encode(),
                             value=json.dumps(marker).encode())
            producer.commit_transaction(self.target.transaction_timeout_ms / 1000)
        except KafkaException as exc:
            error = exc.args[0] if exc.args else None
            if error is not None and getattr(error, "fatal", lambda: False)():
                self._committed = None  # fenced or fatal: a new producer is needed (and a new read of M)
                raise FencedError(self.pipeline_id, self.token.run_id if self.token else None, self.generation,
                                  what=f"the Kafka commit of sink {self.stage!r} ({error})") from None
            producer.abort_transaction(_TIMEOUT_S)
            raise
        return rows

    def _produce(self, table: pa.Table) -> int:
        producer = self._producer
        cols = {name: table.column(name).to_pylist() for name in table.column_names}
        values = cols["value"]
        for i, value in enumerate(values):
            kwargs: dict[str, Any] = {"value": _bytes(value)}
            if "key" in cols and cols["key"][i] is not None:
                kwargs["key"] = _bytes(cols["key"][i])
            if "partition" in cols and cols["partition"][i] is not None:
                kwargs["partition"] = int(cols["partition"][i])
            topic = cols["topic"][i] if "topic" in cols and cols["topic"][i] else self.target.topic
            while True:
                try:
                    producer.produce(topic, **kwargs)
                    break
                except BufferError:  # the local queue is full: let it drain
                    producer.poll(0.05)
            producer.poll(0)
        return len(values)

    def _read_marker(self) -> int:
        """The newest marker of this sink in the control topic, read ``read_committed`` up to its end (-1: none)."""
        from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, TopicPartition

        conf = {**self.target.client_config(), "group.id": f"{self.transactional_id}.marker-reader",
                "enable.auto.commit": "false", "isolation.level": "read_committed", "enable.partition.eof": "true"}
        consumer = Consumer(conf)
        key = self.transactional_id.encode()
        batch = -1
        try:
            meta = consumer.list_topics(self.target.control_topic, timeout=_TIMEOUT_S).topics.get(
                self.target.control_topic)
            if meta is None or meta.error is not None:
                return -1
            parts = sorted(meta.partitions)
            consumer.assign([TopicPartition(self.target.control_topic, p, OFFSET_BEGINNING) for p in parts])
            ended: set[int] = set()
            deadline = time.monotonic() + _TIMEOUT_S
            while len(ended) < len(parts):
                if time.monotonic() > deadline:
                    raise ConfigurationError(
                        f"sink {self.stage!r}: could not read the commit markers in {self.target.control_topic!r} "
                        f"within {_TIMEOUT_S:g}s (an open transaction of another writer holds it back?)")
                msg = consumer.poll(0.5)
                if msg is None:
                    continue
                error = msg.error()
                if error is not None:
                    if error.code() == KafkaError._PARTITION_EOF:
                        ended.add(msg.partition() or 0)
                        continue
                    raise ConfigurationError(f"sink {self.stage!r}: reading {self.target.control_topic!r}: {error}")
                if msg.key() == key:
                    batch = int(json.loads(msg.value() or b"{}")["batch"])
        finally:
            consumer.close()
        return batch

    def _ensure_control_topic(self) -> None:
        from confluent_kafka.admin import AdminClient, NewTopic

        admin = AdminClient(self.target.client_config())
        if self.target.control_topic in admin.list_topics(timeout=_TIMEOUT_S).topics:
            return
        futures = admin.create_topics([NewTopic(self.target.control_topic, num_partitions=1, replication_factor=-1,
                                                config={"cleanup.policy": "compact"})])
        for future in futures.values():
            try:
                future.result(_TIMEOUT_S)
            except Exception as exc:  # noqa: BLE001 - another sink may have created it meanwhile
                if "TOPIC_ALREADY_EXISTS" not in str(exc):
                    raise ConfigurationError(f"sink {self.stage!r}: cannot create the control topic "
                                             f"{self.target.control_topic!r}: {exc}") from None

    # ------------------------------------------------------------------ staging

    def _staged(self) -> dict[int, dict[int, str]]:
        """Staged files: batch -> generation -> path."""
        out: dict[int, dict[int, str]] = {}
        for e in self.staging.list_dir():
            m = _STAGED.match(e.name)
            if m is not None and not e.is_dir:
                out.setdefault(int(m.group(1)), {})[int(m.group(2))] = e.name
        return out

    def _newest_staged(self) -> dict[int, str]:
        """Per batch, the file of the highest generation not above this run's (a newer run's re-run wins)."""
        staged = self._staged()
        return {b: staged[b][g] for b, g in newest_generations(staged, self.generation).items()}

    def _check_fence(self, what: str) -> None:
        """Refuse a write when a newer generation staged or committed for this sink."""
        if not self.generation:
            return
        claims = [int(m.group(1)) for e in self.staging.list_dir() if (m := _CLAIM.match(e.name)) is not None]
        newest = max([*claims, *(g for gens in self._staged().values() for g in gens)], default=0)
        if newest > self.generation:
            token = self.token
            raise FencedError(self.pipeline_id, token.run_id if token else None, self.generation,
                              by_generation=newest, what=f"{what} of sink {self.stage!r} ({self.uri})")

    def _public_message(self, batch_id: int, committed: int) -> str:
        return (f"sink {self.stage!r}: Kafka already made batches {batch_id + 1}..{committed} public in topic "
                f"{self.target.topic!r} (a read_committed consumer may have acted on them), and a restore to batch "
                f"{batch_id} would produce them again; restore a later epoch, or set allow_reemit=True on the "
                "sink's KafkaTarget to accept that consumers see them twice")


def _staged_name(batch_id: int, generation: int) -> str:
    return f"{batch_id:012d}-g{generation}.parquet"


def _bytes(value: object) -> bytes:
    if isinstance(value, bytes | bytearray):
        return bytes(value)
    return str(value).encode()
