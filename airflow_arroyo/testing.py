"""Testing a pipeline: a replayable source, the checkpoint trigger played by a thread, what sinks hold.

The model is bytewax's ``testing`` module: an abort-and-resume scenario is a few lines. ::

    from airflow_arroyo.runtime import Pipeline, PipelineDriver
    from airflow_arroyo.testing import channel_row_count, channel_rows, generate_rows, generator_source, run_until

    p = Pipeline("orders")
    p.source("src", lambda spark: generator_source(spark, seed=1, total_rows=2_000, rows_per_batch=100))
    p.stage("big", lambda df: df.where("value >= 500"), inputs=["src"])
    driver = PipelineDriver(p, store, storage_uri=root, spark=spark)
    out = driver.layout.channel_uri("big")
    # with epochs, until some rows went through; then a graceful stop (its final epoch completes)
    run_until(driver, store, lambda: channel_row_count(out) > 0, what="the first rows")
    # restore the latest epoch and run to the end: the output equals plain Python, row for row
    driver = PipelineDriver(p, store, storage_uri=root, spark=spark, restore_from="latest")
    expected = [r for r in generate_rows(1, 0, 2_000, keys=10).to_pylist() if r["value"] >= 500]
    run_until(driver, store, lambda: channel_row_count(out) >= len(expected), what="every row")
    assert channel_rows(out) == sorted(tuple(r.values()) for r in expected)

Everything here runs without Airflow (the same side as the runtime: ``tests/test_layering.py``).

The generator source
--------------------
:func:`generator_source` (``format("arroyo_generator")``). Row ``id`` is a pure function of ``(seed, id)``::

    id    BIGINT      the row number (offsets are {"id": next id})
    key   STRING      "k<h mod keys>"
    value BIGINT      (h >> 32) mod 1000
    ts    TIMESTAMP   2024-01-01T00:00:00Z + id * ms_per_row milliseconds

where ``h = splitmix64(seed * 0xD1B54A32D192ED03 + id)`` (64-bit wrap-around arithmetic). A restored
query that re-reads an offset range therefore gets identical rows, which is what exactly-once proofs
compare against (:func:`generate_rows` computes the same rows without Spark).

Options: ``seed`` (0), ``keys`` (10), ``start`` (0), ``total_rows`` (unbounded), ``rows_per_batch``
(a per-micro-batch cap, applied as Spark's default read limit), ``rows_per_second`` (rows become
available at this rate since the reader started), ``partitions`` (2), ``ms_per_row`` (10). An unbounded
generator needs ``rows_per_batch`` or ``rows_per_second``.

Helpers
-------
* :func:`wait_for`: poll a condition with a deadline (no bare sleeps in tests).
* :class:`CheckpointTicker`: plays the checkpoint trigger (one ``trigger_tick`` per tick) in a thread.
* :class:`DriverThread` and :func:`run_until`: run a driver in a thread until a condition holds, then
  stop it (gracefully or immediately) and return its result or raise its error.
* :func:`channel_rows`, :func:`channel_row_count`, :func:`channel_barriers`: what a channel holds;
  :func:`committed_rows`: what a reader of a file sink's folder sees.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
import pyarrow as pa
from pyspark.sql.datasource import DataSource, DataSourceStreamReader, InputPartition
from pyspark.sql.streaming.datasource import (
    ReadAllAvailable,
    ReadLimit,
    ReadMaxRows,
    SupportsTriggerAvailableNow,
)

from airflow_arroyo.core.epochs import CheckpointPolicy
from airflow_arroyo.core.exceptions import ArroyoError, ConfigurationError
from airflow_arroyo.core.fs import FileSystem
from airflow_arroyo.runtime.channel import Channel
from airflow_arroyo.runtime.sources import freeze_worker_heap, register_data_source

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

__all__ = [
    "GENERATOR_SCHEMA",
    "CheckpointTicker",
    "DriverThread",
    "GeneratorDataSource",
    "GeneratorOptions",
    "channel_barriers",
    "channel_row_count",
    "channel_rows",
    "committed_rows",
    "generate_row",
    "generate_rows",
    "generator_source",
    "run_until",
    "wait_for",
]

T = TypeVar("T")

GENERATOR_SCHEMA = "id BIGINT, key STRING, value BIGINT, ts TIMESTAMP"
ARROW_SCHEMA = pa.schema(
    [
        ("id", pa.int64()),
        ("key", pa.string()),
        ("value", pa.int64()),
        ("ts", pa.timestamp("us", tz="UTC")),
    ]
)
_BASE_US = 1_704_067_200_000_000  # 2024-01-01T00:00:00Z
_SEED_MULT = 0xD1B54A32D192ED03
_MASK = (1 << 64) - 1


# ---------------------------------------------------------------------- the pure rows
def _splitmix64_py(x: int) -> int:
    z = (x + 0x9E3779B97F4A7C15) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


def generate_row(seed: int, row_id: int, keys: int, ms_per_row: int = 10) -> tuple[int, str, int, int]:
    """Row ``row_id`` in plain Python: ``(id, key, value, ts_micros_since_epoch)`` (the reference)."""
    h = _splitmix64_py((seed * _SEED_MULT + row_id) & _MASK)
    return row_id, f"k{h % keys}", (h >> 32) % 1000, _BASE_US + row_id * ms_per_row * 1000


def _splitmix64_np(x: np.ndarray) -> np.ndarray:
    z = x + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def generate_rows(seed: int, start: int, end: int, keys: int, ms_per_row: int = 10) -> pa.Table:
    """Rows ``[start, end)`` as an Arrow table (schema :data:`ARROW_SCHEMA`), vectorised."""
    if end <= start:
        return ARROW_SCHEMA.empty_table()
    ids = np.arange(start, end, dtype=np.int64)
    with np.errstate(over="ignore"):
        x = ids.astype(np.uint64) + np.uint64((seed * _SEED_MULT) & _MASK)
        h = _splitmix64_np(x)
    key_idx = (h % np.uint64(keys)).astype(np.int64)
    names = pa.array([f"k{i}" for i in range(keys)], pa.string())
    value = ((h >> np.uint64(32)) % np.uint64(1000)).astype(np.int64)
    ts = (ids * (ms_per_row * 1000) + _BASE_US).astype(np.int64)
    return pa.Table.from_arrays(
        [
            pa.array(ids, pa.int64()),
            names.take(pa.array(key_idx)),
            pa.array(value, pa.int64()),
            pa.array(ts, pa.int64()).cast(pa.timestamp("us", tz="UTC")),
        ],
        schema=ARROW_SCHEMA,
    )


# ---------------------------------------------------------------------- options (pure)
def _int_option(options: dict[str, Any], name: str, default: int | None, *, minimum: int) -> int | None:
    raw = options.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except (TypeError, ValueError):
        raise ConfigurationError(f"generator option {name!r} must be an integer, got {raw!r}") from None
    if value < minimum:
        raise ConfigurationError(f"generator option {name!r} must be >= {minimum}, got {value}")
    return value


@dataclass(frozen=True)
class GeneratorOptions:
    """The generator's options, parsed and checked (see "The generator source" above)."""
    seed: int = 0
    keys: int = 10
    start: int = 0
    total_rows: int | None = None
    rows_per_batch: int | None = None
    rows_per_second: int | None = None
    partitions: int = 2
    ms_per_row: int = 10

    @classmethod
    def parse(cls, options: dict[str, Any]) -> GeneratorOptions:
        """Parse Spark reader options (strings); :class:`ConfigurationError` names a bad one."""
        opts = {str(k).lower(): v for k, v in options.items()}
        parsed = cls(
            seed=_int_option(opts, "seed", 0, minimum=0) or 0,
            keys=_int_option(opts, "keys", 10, minimum=1) or 10,
            start=_int_option(opts, "start", 0, minimum=0) or 0,
            total_rows=_int_option(opts, "total_rows", None, minimum=0),
            rows_per_batch=_int_option(opts, "rows_per_batch", None, minimum=1),
            rows_per_second=_int_option(opts, "rows_per_second", None, minimum=1),
            partitions=_int_option(opts, "partitions", 2, minimum=1) or 2,
            ms_per_row=_int_option(opts, "ms_per_row", 10, minimum=0) or 0,
        )
        if parsed.total_rows is None and parsed.rows_per_batch is None and parsed.rows_per_second is None:
            raise ConfigurationError(
                "an unbounded generator needs a pace: set rows_per_batch or rows_per_second (or total_rows "
                "to end the input)"
            )
        return parsed

    @property
    def end(self) -> int | None:
        """The id after the last row (None: unbounded)."""
        return None if self.total_rows is None else self.start + self.total_rows


# ---------------------------------------------------------------------- the data source
class GeneratorPartition(InputPartition):
    def __init__(self, start: int, end: int) -> None:
        super().__init__((start, end))
        self.start = start
        self.end = end


class GeneratorDataSource(DataSource):
    """``arroyo_generator``: deterministic rows (see "The generator source" in the module docstring)."""

    @classmethod
    def name(cls) -> str:
        """Spark: the short name of this data source."""
        return "arroyo_generator"

    def schema(self) -> str:
        """Spark: the generator's schema (checks the options first)."""
        GeneratorOptions.parse(dict(self.options))  # fail at load() on bad options
        return GENERATOR_SCHEMA

    def streamReader(self, schema: Any) -> DataSourceStreamReader:  # noqa: ARG002 - Spark's signature
        """Spark: a reader with the parsed options."""
        return GeneratorStreamReader(GeneratorOptions.parse(dict(self.options)))


class GeneratorStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    def __init__(self, options: GeneratorOptions, clock: Callable[[], float] = time.monotonic) -> None:
        self.options = options
        self.clock = clock
        self._t0: float | None = None
        self._first: int | None = None
        self._target: int | None = None

    def initialOffset(self) -> dict[str, int]:
        return {"id": self.options.start}

    def getDefaultReadLimit(self) -> ReadLimit:
        if self.options.rows_per_batch is not None:
            return ReadMaxRows(self.options.rows_per_batch)
        return ReadAllAvailable()

    def _available(self, begin: int) -> int | None:
        """The end of what exists now (None: unbounded)."""
        end = self.options.end
        if self.options.rows_per_second is not None:
            now = self.clock()
            if self._t0 is None or self._first is None:
                self._t0, self._first = now, begin
            paced = self._first + int((now - self._t0) * self.options.rows_per_second)
            end = paced if end is None else min(end, paced)
        return end

    def prepareForTriggerAvailableNow(self) -> None:
        self._target = self._available(self.options.start)

    def latestOffset(self, start: dict[str, Any], limit: ReadLimit) -> dict[str, int]:
        begin = int(start["id"])
        end = self._available(begin)
        if self._target is not None:
            end = self._target if end is None else min(end, self._target)
        if isinstance(limit, ReadMaxRows):
            end = begin + limit.max_rows if end is None else min(end, begin + limit.max_rows)
        if end is None:
            raise ConfigurationError("the generator has no read limit and no end; set rows_per_batch")
        return {"id": max(begin, end)}

    def reportLatestOffset(self) -> dict[str, int] | None:
        end = self.options.end
        return None if end is None else {"id": end}

    def partitions(self, start: dict[str, Any], end: dict[str, Any]) -> Sequence[InputPartition]:
        begin, stop = int(start["id"]), int(end["id"])
        if stop <= begin:
            return []
        n = min(self.options.partitions, stop - begin)
        bounds = [begin + (stop - begin) * i // n for i in range(n + 1)]
        return [GeneratorPartition(bounds[i], bounds[i + 1]) for i in range(n)]

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        assert isinstance(partition, GeneratorPartition)
        freeze_worker_heap()
        o = self.options
        table = generate_rows(o.seed, partition.start, partition.end, o.keys, o.ms_per_row)
        yield from table.to_batches(max_chunksize=65536)

    def commit(self, end: dict[str, Any]) -> None:  # noqa: ARG002 - Spark's signature; nothing to release
        return None


def generator_source(
    spark: SparkSession,
    *,
    seed: int = 0,
    keys: int = 10,
    rows_per_batch: int | None = None,
    total_rows: int | None = None,
    start: int = 0,
    rows_per_second: int | None = None,
    partitions: int = 2,
    ms_per_row: int = 10,
) -> DataFrame:
    """A streaming DataFrame of generator rows (registers the data source with ``spark`` once)."""
    options: dict[str, Any] = {
        "seed": seed,
        "keys": keys,
        "rows_per_batch": rows_per_batch,
        "total_rows": total_rows,
        "start": start,
        "rows_per_second": rows_per_second,
        "partitions": partitions,
        "ms_per_row": ms_per_row,
    }
    GeneratorOptions.parse(options)  # ConfigurationError before Spark is touched
    register_data_source(spark, GeneratorDataSource)
    reader = spark.readStream.format(GeneratorDataSource.name())
    for name, value in options.items():
        if value is not None:
            reader = reader.option(name, str(value))
    return reader.load()


# ---------------------------------------------------------------------- helpers
def wait_for(condition: Callable[[], T], *, timeout: float = 10.0, what: str = "a condition",
             interval: float = 0.05) -> T:
    """Poll ``condition`` until it returns something truthy (returned); fail with ``what`` (an
    ``AssertionError``) after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(interval)


class CheckpointTicker:
    """Plays the checkpoint trigger: one ``trigger_tick`` every ``tick`` seconds (what the Airflow trigger does)."""

    def __init__(self, store: Any, pipeline_id: str, *, interval: float = 1.5, timeout: float = 120.0,
                 tick: float = 0.25, self_contained_every: int = 0) -> None:
        self.store = store
        self.self_contained_every = self_contained_every  # every k-th epoch (the 2nd, k+2nd...) self-contained
        self.pipeline_id = pipeline_id
        self.policy = CheckpointPolicy(interval=interval, timeout=timeout)
        self.tick = tick
        self.started: list[int] = []
        self.errors: list[BaseException] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"controller-{pipeline_id}", daemon=True)

    def __enter__(self) -> CheckpointTicker:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        """Stop ticking and wait for the thread."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(30)

    def _run(self) -> None:
        while not self._stop.wait(self.tick):
            try:
                k = self.self_contained_every
                result = self.store.trigger_tick(self.pipeline_id, self.policy, triggered_by="test-controller",
                                                 self_contained=bool(k) and len(self.started) % k == 1 % k)
            except ArroyoError as exc:  # e.g. the pipeline is not registered yet
                self.errors.append(exc)
                continue
            if result.started is not None:
                self.started.append(result.started.epoch)


class DriverThread:
    """Runs ``driver.run()`` in a thread and keeps its result or exception."""

    def __init__(self, driver: Any) -> None:
        self.driver = driver
        self.result: Any = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="driver", daemon=True)

    def _run(self) -> None:
        try:
            self.result = self.driver.run()
        except BaseException as exc:  # noqa: BLE001 - handed to the test, which re-raises it in join()
            self.error = exc

    def start(self) -> DriverThread:
        """Start the thread; returns self."""
        self.thread.start()
        return self

    def join(self, timeout: float) -> Any:
        """Wait for the driver; return its result or raise its error."""
        self.thread.join(timeout)
        assert not self.thread.is_alive(), f"the driver did not end within {timeout:g}s"
        if self.error is not None:
            raise self.error
        return self.result


def channel_rows(uri: str) -> list[tuple[Any, ...]]:
    """Every row committed to the channel at ``uri``, sorted (what its readers see)."""
    table = Channel.open(uri).read_table()
    return sorted(tuple(r.values()) for r in table.to_pylist())


def channel_row_count(uri: str) -> int:
    """Rows committed to a channel (from its entries; no data file is read)."""
    if not Channel.exists(uri):
        return 0
    ch = Channel.open(uri)
    return sum(e.rows for e in ch.data_entries(ch.start_position(), ch.end_position()))


def channel_barriers(uri: str) -> list[tuple[int, int]]:
    """(index, epoch) of every barrier entry, in log order."""
    ch = Channel.open(uri)
    return [(e.index, int(e.epoch)) for e in ch.entries(ch.start_position()) if e.is_barrier and e.epoch is not None]


def run_until(driver: Any, store: Any, done: Callable[[], bool], *, what: str, epochs: bool = True,
              stop: str = "graceful", interval: float = 1.5, self_contained_every: int = 0) -> Any:
    """Run ``driver`` in a thread (with a checkpoint controller if ``epochs``) until ``done()``, then
    request ``stop`` and return the driver's result. ``done`` is first called once the driver started
    (a restore truncates channels, so they are read only after it)."""
    pipeline_id = driver.pipeline.pipeline_id
    thread = DriverThread(driver).start()
    controller = CheckpointTicker(store, pipeline_id, interval=interval, self_contained_every=self_contained_every)
    if epochs:
        controller.__enter__()
    try:
        wait_for(lambda: driver.started.is_set() or thread.error, timeout=300, what="the queries to start")
        wait_for(lambda: thread.error or done(), timeout=600, what=what)
    finally:
        controller.stop()
    store.request_stop(pipeline_id, stop)
    return thread.join(300)


def committed_rows(path: Any) -> list[tuple[Any, ...]]:
    """What a reader of a file sink's Parquet folder sees, sorted: its files outside hidden folders and
    files (as pyarrow's dataset discovery skips ``_`` and ``.`` names: '_arroyo_sink', where pending batches
    wait while Spark writes them). Listed with :meth:`FileSystem.list_files`, which lists again when a
    folder vanishes during the listing (Spark's job commit deleting ``_temporary``), as pyarrow's own
    discovery does not."""
    import pyarrow.dataset as ds  # here: it imports pandas, which a generator's planning process never needs

    fs = FileSystem.from_uri(str(path))  # a local folder or any URI the package reads (s3://...)
    if not fs.exists(""):
        return []
    files = [fs.arrow_path(e.path) for e in fs.list_files()
             if not any(part.startswith(("_", ".")) for part in e.path.split("/"))]
    if not files:
        return []
    table = ds.dataset(files, format="parquet", filesystem=fs.arrow_fs).to_table()
    return sorted(tuple(r.values()) for r in table.to_pylist())
