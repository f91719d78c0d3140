"""A replayable, deterministic generator source: ``spark.readStream.format("arroyo_generator")``.

Row ``id`` is a pure function of ``(seed, id)``::

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
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
from pyspark.sql.datasource import DataSource, DataSourceStreamReader, InputPartition
from pyspark.sql.streaming.datasource import (
    ReadAllAvailable,
    ReadLimit,
    ReadMaxRows,
    SupportsTriggerAvailableNow,
)

from airflow_arroyo.exceptions import ConfigurationError

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

__all__ = [
    "GENERATOR_SCHEMA",
    "GeneratorDataSource",
    "GeneratorOptions",
    "generate_row",
    "generate_rows",
    "generator_source",
]

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
        return None if self.total_rows is None else self.start + self.total_rows


# ---------------------------------------------------------------------- the data source
class GeneratorPartition(InputPartition):
    def __init__(self, start: int, end: int) -> None:
        super().__init__((start, end))
        self.start = start
        self.end = end


class GeneratorDataSource(DataSource):
    """``arroyo_generator``: deterministic rows (see the module docstring)."""

    @classmethod
    def name(cls) -> str:
        return "arroyo_generator"

    def schema(self) -> str:
        GeneratorOptions.parse(dict(self.options))  # fail at load() on bad options
        return GENERATOR_SCHEMA

    def streamReader(self, schema: Any) -> DataSourceStreamReader:
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
        o = self.options
        table = generate_rows(o.seed, partition.start, partition.end, o.keys, o.ms_per_row)
        yield from table.to_batches(max_chunksize=65536)

    def commit(self, end: dict[str, Any]) -> None:
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
    from airflow_arroyo.runtime.sources import register_data_sources

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
    register_data_sources(spark)
    reader = spark.readStream.format(GeneratorDataSource.name())
    for name, value in options.items():
        if value is not None:
            reader = reader.option(name, str(value))
    return reader.load()
