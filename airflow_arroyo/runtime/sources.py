"""Spark streaming source that reads a channel: ``spark.readStream.format("arroyo_channel")``.

A micro-batch of a channel reader covers positions ``[start, end)`` of the channel log. ``latestOffset``
chooses ``end`` as the smallest of:

* the channel's end;
* the cap for this channel in the cap file (``cap_path``), if any: the stage runner holds an input at
  a barrier this way while it aligns its other inputs;
* with ``stop_at_barriers`` (the default): one past the first barrier at or after ``start``, so a
  batch ends exactly after a barrier and never crosses one;
* the read limit (``max_rows_per_batch`` / ``max_files_per_batch`` options), never cutting below one
  entry.

Offsets are ``{"pos": <int>}``. Barrier entries carry no rows; a batch may be barrier-only (no rows).

With ``warm_up`` (the stage runner sets it on a query that resumes from a checkpoint), the reader's first
``latestOffset`` offers one batch of no rows when it has nothing to read: the same position with a ``warm``
count one higher than the start's (``{"pos": 7, "warm": 1}``). Spark only runs a batch whose offsets differ from
the committed ones, so a resumed query with nothing to read would otherwise pay its first batch (planning, code
generation, its state store's load, Python workers) only once the stage before it writes, after that stage paid
its own. The count stays while the position stays, and goes with the first batch that reads.
Planning methods run in a Python process on the driver and only read files; ``read`` runs on executors
and reads one Parquet file per partition.

Options: ``uri`` (required; ``path``, as ``load(path)`` sets it, is read too), ``cap_path``, ``cap_key``
(default: ``uri``), ``stop_at_barriers`` (``true``/``false``), ``max_rows_per_batch``, ``max_files_per_batch``,
``warm_up`` (``true``/``false``, default false).
"""

from __future__ import annotations

import gc
import json
import logging
import os
import sys
import threading
import weakref
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from pyspark import TaskContext
from pyspark.sql.datasource import DataSource, DataSourceStreamReader, InputPartition
from pyspark.sql.streaming.datasource import (
    ReadAllAvailable,
    ReadLimit,
    ReadMaxFiles,
    ReadMaxRows,
    SupportsTriggerAvailableNow,
)
from pyspark.sql.types import StructType

from airflow_arroyo.core.exceptions import ConfigurationError
from airflow_arroyo.core.fs import FileSystem
from airflow_arroyo.runtime.channel import Channel, ChannelError, Entry, iter_data_file

if TYPE_CHECKING:
    import pyarrow as pa
    from pyspark.sql import DataFrame, SparkSession

__all__ = [
    "WARM_KEY",
    "ChannelDataSource",
    "ChannelPartition",
    "ChannelStreamReader",
    "freeze_worker_heap",
    "plan_batch_end",
    "read_cap",
    "read_channel",
    "register_data_source",
    "register_data_sources",
    "write_caps",
]

log = logging.getLogger(__name__)

#: the offset's count of batches a resumed reader offered with no rows (see ``warm_up`` in the module docstring)
WARM_KEY = "warm"


# ---------------------------------------------------------------------- option parsing (pure)
def parse_bool(value: str | bool | None, *, option: str, default: bool) -> bool:
    if value is None:
        return default
    if isinstance(value, bool):
        return value
    lowered = str(value).strip().lower()
    if lowered in ("true", "1", "yes"):
        return True
    if lowered in ("false", "0", "no"):
        return False
    raise ConfigurationError(f"option {option!r} must be 'true' or 'false', got {value!r}")


def parse_positive_int(value: Any, *, option: str) -> int | None:
    if value is None or value == "":
        return None
    try:
        n = int(value)
    except (TypeError, ValueError):
        raise ConfigurationError(f"option {option!r} must be a positive integer, got {value!r}") from None
    if n <= 0:
        raise ConfigurationError(f"option {option!r} must be a positive integer, got {value!r}")
    return n


def _split_file_uri(uri: str) -> tuple[FileSystem, str]:
    head, sep, name = uri.rstrip("/").rpartition("/")
    if not sep or not name:
        raise ConfigurationError(f"{uri!r} is not the URI or path of a file")
    if not head:  # "/name"
        head = "/"
    elif head.endswith(":/") or head.endswith(":"):  # "file:///name" -> "file://", "/name"
        head = head + "/"
    return FileSystem.from_uri(head), name


# ---------------------------------------------------------------------- the batch planner (pure)
def plan_batch_end(
    begin: int,
    available: int,
    entries: Iterable[Entry],
    stop_at_barriers: bool,
    max_rows: int | None = None,
    max_files: int | None = None,
) -> int:
    """End position of the micro-batch starting at ``begin``.

    ``available`` is the furthest the reader may go (channel end, cap, trigger target, already
    combined); ``entries`` yields the entries ``begin, begin+1, ...`` (consumed only as far as needed).
    The batch stops right after the first barrier when ``stop_at_barriers``, and before the entry that
    would take it past ``max_rows`` rows or ``max_files`` files, but always takes at least one entry.
    Returns ``begin`` when nothing may be read.
    """
    pos = begin
    rows = files = 0
    if available <= begin:
        return begin
    for entry in entries:
        if pos > begin and (
            (max_rows is not None and rows + entry.rows > max_rows)
            or (max_files is not None and files + len(entry.files) > max_files)
        ):
            return pos
        rows += entry.rows
        files += len(entry.files)
        pos += 1
        if (stop_at_barriers and entry.is_barrier) or pos >= available:
            return pos
    return pos


# ---------------------------------------------------------------------- cap file
def read_cap(cap_path: str | None, key: str) -> int | None:
    """The cap for ``key`` in the cap file ``{"caps": {key: position}}``; None if no file or no entry."""
    if not cap_path:
        return None
    fs, name = _split_file_uri(cap_path)
    try:
        raw = fs.read_bytes(name)
    except FileNotFoundError:
        return None
    try:
        caps = json.loads(raw).get("caps", {})
    except (json.JSONDecodeError, AttributeError) as exc:
        raise ChannelError(
            f"cap file {cap_path} is not valid JSON of the form {{'caps': {{...}}}} ({exc}); it must be "
            "written atomically (write_caps does)"
        ) from exc
    value = caps.get(key)
    return None if value is None else int(value)


def write_caps(cap_path: str, caps: dict[str, int]) -> None:
    """Atomically replace the cap file with ``{"caps": caps}`` (keys: channel URIs or cap keys)."""
    fs, name = _split_file_uri(cap_path)
    fs.write_json_atomic(name, {"caps": {str(k): int(v) for k, v in caps.items()}})


# ---------------------------------------------------------------------- Python workers
#: set to ``false`` (in the environment Spark's Python workers start with) to leave their garbage collector as is
FREEZE_WORKER_HEAP_ENV = "ARROYO_FREEZE_WORKER_HEAP"
_frozen_modules = -1  # how many modules this process had imported when it last froze its heap


def freeze_worker_heap() -> None:
    """Called by a Python data source's ``read`` (in a Spark Python worker): take what the process has imported
    out of the cyclic garbage collector's passes (``gc.freeze``), once, and again after new imports.

    A reused PySpark worker runs a full ``gc.collect()`` after every task (``pyspark/daemon.py``), which walks
    every object the process holds, PySpark's and pyarrow's modules included; for a source read by small
    micro-batches that walk was most of a read task's CPU, paid per task, so per micro-batch. Frozen objects
    are still freed by reference counting; only cycles among them would stay, and import-time objects (modules,
    classes, functions) do not become garbage. No collection before the freeze: a worker Spark does not reuse runs
    one task, and a full walk there would cost what the freeze saves; what is garbage at a freeze stays, once per
    import. A no-op outside the first call after an import, and outside a Spark task: a ``read`` called directly
    (a test, a driver-side tool) must not change the garbage collector of the process that called it."""
    global _frozen_modules
    if TaskContext.get() is None:  # PySpark's worker sets the task's context around every task it runs
        return
    loaded = len(sys.modules)
    if loaded == _frozen_modules:
        return
    _frozen_modules = loaded
    if os.environ.get(FREEZE_WORKER_HEAP_ENV, "true").strip().lower() in ("false", "0", "no"):
        return
    gc.freeze()


# ---------------------------------------------------------------------- the data source
class ChannelPartition(InputPartition):
    """One Parquet file of one data entry."""

    def __init__(self, channel_uri: str, path: str) -> None:
        super().__init__((channel_uri, path))
        self.channel_uri = channel_uri
        self.path = path


class ChannelDataSource(DataSource):
    """``arroyo_channel``: a channel as a streaming source (see the module docstring for options)."""

    @classmethod
    def name(cls) -> str:
        """Spark: the short name of this data source."""
        return "arroyo_channel"

    def _uri(self) -> str:
        uri = self.options.get("uri") or self.options.get("path")
        if not uri:
            raise ConfigurationError(
                "the arroyo_channel source needs the channel URI: .option('uri', ...) or read_channel(spark, uri)"
            )
        return str(uri)

    def schema(self) -> StructType:
        """Spark: the channel's schema (a channel nobody wrote yet has none: an error naming the fix)."""
        uri = self._uri()
        channel = Channel.open(uri)
        schema = channel.spark_schema
        if schema is None:
            raise ChannelError(
                f"channel {uri} has no schema yet, so a reader cannot be planned; create it with "
                "Channel.create(uri, schema) before starting downstream queries (the stage runner does "
                "this from the upstream stage's output schema)"
            )
        return schema

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        """Spark: a reader of the channel."""
        return ChannelStreamReader(self._uri(), dict(self.options), schema)


class ChannelStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """Spark's streaming reader over a channel: offsets are positions, batches end at barriers and caps."""
    def __init__(self, uri: str, options: dict[str, Any], schema: StructType) -> None:
        self.uri = uri
        self.cap_path: str | None = options.get("cap_path") or None
        self.cap_key: str = str(options.get("cap_key") or uri)
        self.stop_at_barriers = parse_bool(
            options.get("stop_at_barriers"), option="stop_at_barriers", default=True
        )
        self.max_rows = parse_positive_int(options.get("max_rows_per_batch"), option="max_rows_per_batch")
        self.max_files = parse_positive_int(options.get("max_files_per_batch"), option="max_files_per_batch")
        start = options.get("start_pos")
        self.start_pos = int(start) if start not in (None, "") else None
        self.schema_json: dict[str, Any] = schema.jsonValue()
        # one batch of no rows before anything else, once per reader (so once per query start)
        self._warm_up = parse_bool(options.get("warm_up"), option="warm_up", default=False)
        self._channel: Channel | None = None
        self._target: int | None = None

    # The reader is pickled to executors: ship only the configuration.
    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_channel"] = None
        return state

    @property
    def channel(self) -> Channel:
        """The channel, opened on first use (in the process Spark runs the reader in)."""
        if self._channel is None:
            self._channel = Channel.open(self.uri)
        return self._channel

    def initialOffset(self) -> dict[str, int]:
        """Spark: the channel's start position, or ``start_pos`` when given (a stage new in an upgrade reads from
        the restored epoch's barrier on, not the history before it)."""
        start = self.channel.start_position()
        return {"pos": start if self.start_pos is None else max(start, self.start_pos)}

    def getDefaultReadLimit(self) -> ReadLimit:
        """Spark: the per-batch limit from the options (rows, files, or all available)."""
        if self.max_rows is not None:
            return ReadMaxRows(self.max_rows)
        if self.max_files is not None:
            return ReadMaxFiles(self.max_files)
        return ReadAllAvailable()

    def prepareForTriggerAvailableNow(self) -> None:
        """Spark: read up to the current end and stop there."""
        self._target = self.channel.end_position()

    def latestOffset(self, start: dict[str, Any], limit: ReadLimit) -> dict[str, int]:
        """Spark: where the next micro-batch ends (:func:`plan_batch_end`)."""
        begin = int(start["pos"])
        available = self.channel.end_position()
        if begin > available:
            raise ChannelError(
                f"this query's position {begin} is past the end ({available}) of channel {self.uri}: the "
                "channel was truncated (restore) without restoring this query's checkpoint to the same epoch; "
                "restore the whole pipeline from one epoch"
            )
        cap = read_cap(self.cap_path, self.cap_key)
        if cap is not None:
            available = min(available, cap)
        if self._target is not None:
            available = min(available, self._target)
        max_rows = limit.max_rows if isinstance(limit, ReadMaxRows) else None
        max_files = limit.max_files if isinstance(limit, ReadMaxFiles) else None
        entries = (self.channel.entry(i) for i in range(begin, available))
        end = plan_batch_end(begin, available, entries, self.stop_at_barriers, max_rows, max_files)
        out: dict[str, int] = {"pos": end}
        if end == begin:
            # A batch of no rows moves no position: no cut or alignment decision reads the count, and a
            # replay plans the same empty range. Kept while nothing is read, so that no further batch runs.
            warm = start.get(WARM_KEY)
            if self._warm_up:
                warm = int(warm or 0) + 1
            if warm is not None:
                out[WARM_KEY] = int(warm)
        self._warm_up = False
        return out

    def reportLatestOffset(self) -> dict[str, int]:
        """Spark: the channel's end position."""
        return {"pos": self.channel.end_position()}

    def partitions(self, start: dict[str, Any], end: dict[str, Any]) -> Sequence[InputPartition]:
        """Spark: one partition per data file of the entries in ``[start, end)``."""
        begin, stop = int(start["pos"]), int(end["pos"])
        if stop <= begin:
            return []
        channel_uri = self.channel.uri
        return [ChannelPartition(channel_uri, f) for e in self.channel.data_entries(begin, stop) for f in e.files]

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        """Spark (executors): the rows of one data entry as Arrow batches."""
        from pyspark.sql.pandas.types import to_arrow_schema

        assert isinstance(partition, ChannelPartition)
        freeze_worker_heap()
        target = to_arrow_schema(StructType.fromJson(self.schema_json), timezone="UTC")
        fs = FileSystem.shared(partition.channel_uri)
        try:
            yield from iter_data_file(fs, partition.path, target)
        except FileNotFoundError as exc:
            raise ChannelError(
                f"data file {partition.path} of channel {partition.channel_uri} is gone; retention deleted "
                "it while this query still needed it (the query's position is below the oldest retained "
                "epoch): restore from a retained epoch"
            ) from exc

    def commit(self, end: dict[str, Any]) -> None:
        """Spark: positions below ``end`` are done; forget their cached entries."""
        # Spark will not ask for positions below ``end`` again: drop their cached entries.
        if self._channel is not None:
            self._channel.forget_before(int(end["pos"]))


# ---------------------------------------------------------------------- registration and helpers
_registered: weakref.WeakKeyDictionary[Any, set[str]] = weakref.WeakKeyDictionary()
_registered_lock = threading.Lock()


def register_data_source(spark: SparkSession, source: type[DataSource]) -> None:
    """Register the Python data source ``source`` with ``spark`` (once per session), with its environment
    map already holding what each streaming read of it will put there (see `_prefill_source_env`)."""
    with _registered_lock:
        done = _registered.setdefault(spark, set())
        if source.name() not in done:
            spark.dataSource.register(source)
            _prefill_source_env(spark, source.name())
            done.add(source.name())


#: The keys Spark's `PythonStreamingSourceRunner.init` puts into the environment map of the registered source.
STREAM_RUNNER_ENV_KEYS = ("SPARK_LOCAL_DIRS", "SPARK_AUTH_SOCKET_TIMEOUT", "SPARK_BUFFER_SIZE", "SPARK_PYTHON_RUNTIME")


def _prefill_source_env(spark: SparkSession, name: str) -> None:
    """Put into the registered source's environment map, once, the entries each streaming query over it puts.

    Every Python function Spark makes for a registered Python data source shares ONE `java.util.HashMap`: the
    environment of the registered class (`UserDefinedPythonDataSource.createPythonFunction`). In the driver,
    each streaming query over the source puts four entries into that shared map when its stream thread opens
    the source (`PythonStreamingSourceRunner.init`, Spark 4.0-4.2), without a lock. The queries of a pipeline
    start together, so two stream threads could insert the same new keys at once (a plain HashMap then
    loses an entry but counts it: its size is wrong for good), or one could insert while another thread
    serialized a task whose reader function holds the map. Either way the tasks could not be deserialized
    (`java.io.OptionalDataException` in `HashMap.readObject`), every attempt, every batch of that query: seen
    as a restarted driver's channel write failing. With the keys already present, those puts only replace
    values (no structural change, nothing to race), and they put the same values as these."""
    jsession = getattr(spark, "_jsparkSession", None)
    jvm = spark.sparkContext._jvm if jsession is not None else None
    if jsession is None or jvm is None:  # a Spark Connect session: the server's JVM holds the map
        return
    conf = spark.sparkContext._jsc.sc().conf()
    env = jsession.sessionState().dataSourceManager().lookupDataSource(name).dataSourceCls().envVars()
    block_manager = jvm.org.apache.spark.SparkEnv.get().blockManager()
    values = {
        "SPARK_LOCAL_DIRS": ",".join(str(d.getPath()) for d in block_manager.diskBlockManager().localDirs()),
        "SPARK_AUTH_SOCKET_TIMEOUT": str(conf.getTimeAsSeconds("spark.python.authenticate.socketTimeout", "15s")),
        "SPARK_BUFFER_SIZE": str(conf.getInt("spark.buffer.size", 65536)),
        "SPARK_PYTHON_RUNTIME": "PYTHON_WORKER",
    }
    for key in STREAM_RUNNER_ENV_KEYS:
        if not env.containsKey(key):
            env.put(key, values[key])


def register_data_sources(spark: SparkSession) -> None:
    """Register ``arroyo_channel`` with ``spark`` (once per session; the generator registers itself)."""
    register_data_source(spark, ChannelDataSource)


def read_channel(
    spark: SparkSession,
    uri: str,
    cap_path: str | None = None,
    stop_at_barriers: bool = True,
    *,
    cap_key: str | None = None,
    max_rows_per_batch: int | None = None,
    max_files_per_batch: int | None = None,
) -> DataFrame:
    """A streaming DataFrame over the channel at ``uri`` (see the module docstring)."""
    register_data_sources(spark)
    reader = (
        spark.readStream.format(ChannelDataSource.name())
        .option("uri", uri)
        .option("stop_at_barriers", "true" if stop_at_barriers else "false")
    )
    if cap_path:
        reader = reader.option("cap_path", cap_path)
    if cap_key:
        reader = reader.option("cap_key", cap_key)
    if max_rows_per_batch is not None:
        reader = reader.option("max_rows_per_batch", str(max_rows_per_batch))
    if max_files_per_batch is not None:
        reader = reader.option("max_files_per_batch", str(max_files_per_batch))
    return reader.load()
