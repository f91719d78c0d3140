"""Stage inputs: the channel reader with the input's name in every offset.

``offsets/<b>`` of a checkpoint lists source offsets in the query's plan order, which depends on the
user's transform (``b.join(a)`` puts ``b`` first). Carrying the input's name in the offset
(``{"pos": 5, "key": "left"}``) lets the stage runner map the offsets of a micro-batch to its inputs
without guessing.

Kept in a module of its own with light imports: Spark unpickles the data source in a fresh Python
process that must connect back to the JVM within a fixed 10 s.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from pyspark.sql.datasource import DataSourceStreamReader
from pyspark.sql.streaming.datasource import ReadLimit
from pyspark.sql.types import StructType

from airflow_arroyo.runtime.sources import (
    WARM_KEY,
    ChannelDataSource,
    ChannelStreamReader,
    register_data_source,
    register_data_sources,
)

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

__all__ = ["KeyedChannelReader", "StageInputDataSource", "read_stage_input"]


class StageInputDataSource(ChannelDataSource):
    """``arroyo_stage_input``: :class:`ChannelDataSource` whose offsets carry the input's name."""

    @classmethod
    def name(cls) -> str:
        """Spark: the short name of this data source."""
        return "arroyo_stage_input"

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        """Spark: a reader whose offsets carry the input's cap key."""
        return KeyedChannelReader(self._uri(), dict(self.options), schema)


class KeyedChannelReader(ChannelStreamReader):
    """A channel reader whose offsets name the input it reads (a stage reading two inputs tells them apart)."""
    def _keyed(self, offset: Mapping[str, Any]) -> dict[str, Any]:
        keyed: dict[str, Any] = {"pos": int(offset["pos"]), "key": self.cap_key}
        if WARM_KEY in offset:
            keyed[WARM_KEY] = int(offset[WARM_KEY])
        return keyed

    def initialOffset(self) -> dict[str, Any]:
        """Spark: the channel's start position, with the key."""
        return self._keyed(super().initialOffset())

    def latestOffset(self, start: dict[str, Any], limit: ReadLimit) -> dict[str, Any]:
        """Spark: where the next micro-batch ends, with the key."""
        return self._keyed(super().latestOffset(start, limit))

    def reportLatestOffset(self) -> dict[str, Any]:
        """Spark: the channel's end, with the key."""
        return self._keyed(super().reportLatestOffset())


def read_stage_input(spark: SparkSession, uri: str, *, key: str, cap_path: str | None,
                     stop_at_barriers: bool, start_pos: int | None = None, warm_up: bool = False) -> DataFrame:
    """A streaming DataFrame over channel ``uri`` for the stage input named ``key`` (also its cap key);
    ``start_pos``: where a query without a checkpoint starts (default: the channel's start); ``warm_up``: offer one
    batch of no rows first when there is nothing to read (a query resuming from its checkpoint)."""
    register_data_sources(spark)
    register_data_source(spark, StageInputDataSource)
    reader = (spark.readStream.format(StageInputDataSource.name()).option("uri", uri).option("cap_key", key)
              .option("stop_at_barriers", "true" if stop_at_barriers else "false"))
    if cap_path:
        reader = reader.option("cap_path", cap_path)
    if start_pos is not None:
        reader = reader.option("start_pos", str(start_pos))
    if warm_up:
        reader = reader.option("warm_up", "true")
    return reader.load()
