"""Channels: durable, FIFO, rewindable logs of Parquet batches and barriers on a filesystem URI.

A channel is a directory (any :class:`~airflow_arroyo.core.fs.FileSystem` URI)::

    _channel.json                     header: {"format_version": 2, "schema": <Spark schema JSON> | null}
    _truncated.json                   optional: {"before": P, "writers": {...}} (retention watermark)
    _fence.json                       optional: {"fences": [{"generation": G, "from": P}, ...]} (fencing)
    log/00000000000000000000.json     entry 0
    log/00000000000000000001.json     entry 1 ...
    data/<writer>-b<batch>-<uuid>/    the Parquet files of one data entry

Entries are numbered 0, 1, 2...; a reader at position ``p`` has consumed entries ``[0, p)``. A data entry
names its Parquet files; a barrier entry carries an epoch. Data files are written first and the entry
is created exclusively afterwards, so the entry is the commit point and files no entry names are
ignored. The format is specified in ``docs/channel-format.md``.

Fencing: an entry carries the generation (fencing token) of the run that wrote it. A run that takes the
pipeline over records a fence, "generation G starts at position P" (:meth:`Channel.fence`); from then on
an entry at or after P written by an older generation is a :attr:`EntryKind.FENCED` entry: it keeps its
position but carries no rows and is no barrier, so a superseded run that is still alive cannot add
anything readers see. A writer that knows its token refuses to append once it is fenced
(:class:`~airflow_arroyo.core.exceptions.FencedError`).

Concurrency contract: one writer per channel (the graph validator enforces it); any number of readers.
:meth:`Channel.truncate_from` (restore) needs every reader and writer of the channel stopped;
:meth:`Channel.truncate_before` (retention) may run while the pipeline runs, below every live cursor.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import threading
import time
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.parquet as pq

from airflow_arroyo.core.exceptions import ArroyoError, ConcurrencyConflict, ConfigurationError, FencedError
from airflow_arroyo.core.fs import FileSystem

if TYPE_CHECKING:
    from pyspark.sql import DataFrame
    from pyspark.sql.types import StructType

    from airflow_arroyo.store.records import FencingToken

__all__ = [
    "FORMAT_VERSION",
    "Channel",
    "ChannelError",
    "ChannelSchemaError",
    "ChannelTruncatedError",
    "Entry",
    "EntryKind",
]

log = logging.getLogger(__name__)

FORMAT_VERSION = 2  # 2: entries carry a generation, _fence.json (docs/channel-format.md, "Versions")
READABLE_VERSIONS = (1, 2)  # a version-1 channel is read as one without fences; fencing it upgrades it to 2
HEADER_FILE = "_channel.json"
TRUNCATED_FILE = "_truncated.json"
FENCE_FILE = "_fence.json"
LOG_DIR = "log"
DATA_DIR = "data"
_INDEX_WIDTH = 20
_SAFE_NAME = re.compile(r"[^A-Za-z0-9_.=-]+")
_UNPLACED = -1  # the index of an entry not yet appended (Channel._append_entry places it)
_CACHE_LIMIT = 8192  # parsed entries kept per handle (a long-running reader or writer must not grow forever)


class ChannelError(ArroyoError):
    """A channel is missing, corrupt, or used against its contract (the message names the channel)."""


class ChannelSchemaError(ChannelError, ConfigurationError):
    """Data does not match the channel's schema (fixed at creation or at the first data append)."""


class ChannelTruncatedError(ChannelError):
    """A read asked for entries that retention already deleted."""


class EntryKind(StrEnum):
    """The kinds of log entries."""
    DATA = "data"
    BARRIER = "barrier"
    FENCED = "fenced"  # never stored: how a reader sees an entry a superseded run wrote after the fence


@dataclass(frozen=True)
class Entry:
    """One committed log entry. ``files`` are paths relative to the channel root."""

    index: int
    kind: EntryKind
    writer: str
    epoch: int | None = None
    files: tuple[str, ...] = ()
    rows: int = 0
    bytes: int = 0
    batch_id: int | None = None
    dir: str | None = None
    time: float | None = None
    generation: int = 0  # the writer's fencing token (0: written without one, e.g. by format version 1)

    @property
    def is_barrier(self) -> bool:
        """True for a barrier entry."""
        return self.kind is EntryKind.BARRIER

    def fenced(self) -> Entry:
        """How readers see this entry once a newer generation fenced it: no rows, no barrier; its data
        folder is kept only so that retention deletes it with the entry."""
        return Entry(self.index, EntryKind.FENCED, self.writer, dir=self.dir, time=self.time,
                     generation=self.generation)

    def to_json(self) -> dict[str, Any]:
        """The stored form of this entry (the inverse of :meth:`from_json`; the index is the file name)."""
        if self.kind is EntryKind.BARRIER:
            out: dict[str, Any] = {"kind": "barrier", "epoch": self.epoch, "writer": self.writer}
        else:
            out = {
                "kind": "data",
                "files": list(self.files),
                "dir": self.dir,
                "rows": self.rows,
                "bytes": self.bytes,
                "writer": self.writer,
                "batch_id": self.batch_id,
            }
        if self.time is not None:
            out["time"] = self.time
        if self.generation:
            out["generation"] = self.generation
        return out

    @classmethod
    def from_json(cls, index: int, raw: dict[str, Any]) -> Entry:
        """Parse the stored form of entry ``index``."""
        kind = EntryKind(raw["kind"])
        if kind is EntryKind.FENCED:
            raise ChannelError(f"entry {index} is stored as kind 'fenced', which only readers produce")
        generation = int(raw.get("generation") or 0)
        if kind is EntryKind.BARRIER:
            return cls(index, kind, str(raw["writer"]), epoch=int(raw["epoch"]), time=raw.get("time"),
                       generation=generation)
        return cls(
            index,
            kind,
            str(raw["writer"]),
            files=tuple(raw.get("files", ())),
            rows=int(raw.get("rows", 0)),
            bytes=int(raw.get("bytes", 0)),
            batch_id=None if raw.get("batch_id") is None else int(raw["batch_id"]),
            dir=raw.get("dir"),
            time=raw.get("time"),
            generation=generation,
        )


def log_path(index: int) -> str:
    """Relative path of entry ``index``."""
    return f"{LOG_DIR}/{index:0{_INDEX_WIDTH}d}.json"


# ---------------------------------------------------------------------- schema helpers (pure)
def _all_nullable(node: Any) -> Any:
    """Spark schema JSON with every field/element/value made nullable (a channel never promises non-null)."""
    if isinstance(node, dict):
        out = {k: _all_nullable(v) for k, v in node.items()}
        for key in ("nullable", "containsNull", "valueContainsNull"):
            if key in out:
                out[key] = True
        return out
    if isinstance(node, list):
        return [_all_nullable(v) for v in node]
    return node


def normalize_schema(schema: pa.Schema | StructType | dict[str, Any]) -> dict[str, Any]:
    """The channel's stored form of a schema: Spark's schema JSON, everything nullable.

    Accepts a :class:`pyarrow.Schema`, a Spark ``StructType`` or already-parsed Spark schema JSON.
    """
    from pyspark.sql.types import StructType

    if isinstance(schema, dict):
        struct = StructType.fromJson(schema)
    elif isinstance(schema, pa.Schema):
        from pyspark.sql.pandas.types import from_arrow_schema

        try:
            struct = from_arrow_schema(schema)
        except (TypeError, ValueError) as exc:  # pyspark raises its own TypeError subclasses
            raise ChannelSchemaError(
                f"the Arrow schema {schema} has a type Spark cannot read ({exc}); cast the column to a "
                "Spark-compatible type (e.g. uint64 -> int64) before appending"
            ) from exc
    elif isinstance(schema, StructType):
        struct = schema
    else:
        raise ConfigurationError(
            f"a channel schema must be a pyarrow.Schema or a pyspark StructType, got {type(schema).__name__}"
        )
    normalized: dict[str, Any] = _all_nullable(struct.jsonValue())
    return normalized


def spark_schema_of(schema_json: dict[str, Any]) -> StructType:
    from pyspark.sql.types import StructType

    return StructType.fromJson(schema_json)


def arrow_schema_of(schema_json: dict[str, Any]) -> pa.Schema:
    """The Arrow schema Spark expects from a Python data source returning ``schema_json``."""
    from pyspark.sql.pandas.types import to_arrow_schema

    return to_arrow_schema(spark_schema_of(schema_json), timezone="UTC")


def _schema_signature(schema_json: dict[str, Any]) -> str:
    """Names and types, without nullability or metadata: what must match between appends."""
    return str(spark_schema_of(schema_json).simpleString())


# ---------------------------------------------------------------------- the channel
@dataclass
class _WriterMemo:
    """What a backward scan learned about one writer, valid for entries below ``upto``."""

    upto: int
    latest_batch_id: int | None = None
    latest_barrier: Entry | None = None
    data_found: bool = False
    barrier_found: bool = False


@dataclass
class _Caches:
    end: int | None = None
    entries: dict[int, Entry] = field(default_factory=dict)
    writers: dict[str, _WriterMemo] = field(default_factory=dict)
    fences: list[tuple[int, int]] | None = None  # (generation, from position), read once per handle


def fence_applies(fences: Iterable[tuple[int, int]], index: int, generation: int) -> int | None:
    """The generation that fences an entry at ``index`` written by ``generation``, or None: a fence
    ``(G, P)`` ignores every entry at or after ``P`` of a generation older than ``G``."""
    newer = [g for g, p in fences if index >= p and generation < g]
    return max(newer) if newer else None


class Channel:
    """A channel at a filesystem URI. Build it with :meth:`create` or :meth:`open`.

    Instances cache immutable entries and the end position; they are safe to share between threads.
    After another process truncated the channel (restore), open it again.
    """

    #: A writer whose last Spark batch had at most this many rows has its next one collected to the driver
    #: and written from there (:meth:`append_spark_batch`); 0 makes the executors write every batch.
    DRIVER_WRITE_MAX_ROWS = 50_000

    def __init__(self, fs: FileSystem, header: dict[str, Any]) -> None:
        self._fs = fs
        self._header = header
        self._lock = threading.RLock()
        self._cache = _Caches()
        self._small_batches: dict[str, bool] = {}  # per writer: its last batch was small enough to collect
        # the writer's fencing token: stamped on its entries; appends are refused once a newer one fenced
        self.token: FencingToken | None = None

    # ------------------------------------------------------------------ construction
    @classmethod
    def create(cls, uri: str | FileSystem, schema: pa.Schema | StructType | None = None) -> Channel:
        """Create the channel at ``uri`` (a URI, or the channel's folder as a file system), or open it if it
        exists (idempotent).

        With ``schema``: the channel's schema is set now (so readers can start before the first batch).
        An existing channel with a different schema raises :class:`ChannelSchemaError`.
        """
        fs = FileSystem.of(uri)
        wanted = normalize_schema(schema) if schema is not None else None
        header = {"format_version": FORMAT_VERSION, "schema": wanted, "created_at": time.time()}
        if fs.create_exclusive(HEADER_FILE, json.dumps(header, sort_keys=True).encode()):
            log.info("created channel %s", fs.uri)
            return cls(fs, header)
        channel = cls.open(fs)
        if wanted is not None:
            channel._ensure_schema(wanted)
        return channel

    @classmethod
    def open(cls, uri: str | FileSystem) -> Channel:
        """Open an existing channel; :class:`ChannelError` if there is none at ``uri`` (as for :meth:`create`)."""
        fs = FileSystem.of(uri)
        return cls(fs, _read_header(fs))

    @staticmethod
    def exists(uri: str | FileSystem) -> bool:
        """True if a channel was created at ``uri`` (as for :meth:`create`)."""
        return FileSystem.of(uri).exists(HEADER_FILE)

    def __getstate__(self) -> dict[str, Any]:
        return {"fs": self._fs, "header": self._header}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._fs = state["fs"]
        self._header = state["header"]
        self._lock = threading.RLock()
        self._cache = _Caches()
        self.token = None

    def __repr__(self) -> str:
        return f"Channel({self.uri!r})"

    @property
    def uri(self) -> str:
        """The channel's URI."""
        return self._fs.uri

    @property
    def fs(self) -> FileSystem:
        """The file system rooted at the channel's folder."""
        return self._fs

    # ------------------------------------------------------------------ schema
    @property
    def schema_json(self) -> dict[str, Any] | None:
        """The stored schema (Spark schema JSON), re-reading the header while it is not yet known."""
        if self._header.get("schema") is None:
            self._header = _read_header(self._fs)
        schema: dict[str, Any] | None = self._header.get("schema")
        return schema

    @property
    def schema(self) -> pa.Schema | None:
        """The channel's Arrow schema (as Spark reads it), or None before it is known."""
        s = self.schema_json
        return None if s is None else arrow_schema_of(s)

    @property
    def spark_schema(self) -> StructType | None:
        """The channel's schema as a Spark ``StructType`` (None until the first write fixes it)."""
        s = self.schema_json
        return None if s is None else spark_schema_of(s)

    def _ensure_schema(self, wanted: dict[str, Any]) -> None:
        """Fix the schema if not yet known; raise if a different one is stored. Before any data write."""
        with self._lock:
            current = self.schema_json
            if current is None:
                self._header = {**self._header, "schema": wanted}
                self._fs.write_json_atomic(HEADER_FILE, self._header)
                log.info("channel %s: schema fixed to %s", self.uri, _schema_signature(wanted))
                return
            if _schema_signature(current) != _schema_signature(wanted):
                raise ChannelSchemaError(
                    f"channel {self.uri} has schema {_schema_signature(current)} but the data has "
                    f"{_schema_signature(wanted)}; a channel's schema is fixed at its first data append: "
                    "make the stage produce the same columns and types, or write to a new channel"
                )

    # ------------------------------------------------------------------ positions and entries
    def start_position(self) -> int:
        """The first position whose entry still exists (0 until retention truncated the channel)."""
        return int(self._truncation().get("before", 0))

    def _truncation(self) -> dict[str, Any]:
        try:
            value: dict[str, Any] = self._fs.read_json(TRUNCATED_FILE)
            return value
        except FileNotFoundError:
            return {}

    def end_position(self) -> int:
        """Number of entries ever committed (the position after the last entry)."""
        with self._lock:
            return self._refresh()

    def _refresh(self) -> int:
        end = self._cache.end
        if end is None or (end > 0 and not self._fs.exists(log_path(end - 1)) and end > self.start_position()):
            if end is not None:
                log.info("channel %s was truncated by another process; reloading its log", self.uri)
            self._cache = _Caches()
            end = self._discover_end()
        while self._fs.exists(log_path(end)):
            end += 1
        self._cache.end = end
        return end

    def _discover_end(self) -> int:
        """Exponential then binary search for the end: entries [low, end) exist, none at or above end."""
        lo = self.start_position()
        if not self._fs.exists(log_path(lo)):
            return lo
        step = 1
        while self._fs.exists(log_path(lo + step)):
            lo += step
            step *= 2
        hi = lo + step
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self._fs.exists(log_path(mid)):
                lo = mid
            else:
                hi = mid
        return hi

    def entry(self, index: int) -> Entry:
        """Entry ``index`` as readers see it (fenced entries included); cached."""
        with self._lock:
            cached = self._cache.entries.get(index)
            if cached is not None:
                return cached
            try:
                raw = self._fs.read_json(log_path(index))
            except FileNotFoundError:
                low = self.start_position()
                if index < low:
                    raise ChannelTruncatedError(
                        f"entry {index} of channel {self.uri} was deleted by retention (the channel starts "
                        f"at {low}); a restore or reader needs an epoch that is still retained"
                    ) from None
                raise ChannelError(
                    f"entry {index} of channel {self.uri} does not exist (end is {self._refresh()})"
                ) from None
            except json.JSONDecodeError as exc:
                raise ChannelError(f"entry {index} of channel {self.uri} is corrupt: {exc}") from exc
            parsed = Entry.from_json(index, raw)
            by = fence_applies(self._fences(), index, parsed.generation)
            if by is not None:
                log.info("channel %s: entry %s (%s of %r, generation %s) was written after generation %s took "
                         "over; ignored", self.uri, index, parsed.kind.value, parsed.writer, parsed.generation, by)
                parsed = parsed.fenced()
            self._remember(parsed)
            return parsed

    def _remember(self, e: Entry) -> None:
        entries = self._cache.entries
        entries[e.index] = e
        if len(entries) > _CACHE_LIMIT:
            for i in sorted(entries)[: _CACHE_LIMIT // 2]:
                del entries[i]

    def forget_before(self, pos: int) -> None:
        """Drop cached entries below ``pos`` (a reader that committed ``pos`` never reads them again)."""
        with self._lock:
            for i in [i for i in self._cache.entries if i < pos]:
                del self._cache.entries[i]

    def entries(self, start: int, end: int | None = None) -> list[Entry]:
        """Entries ``[start, end)`` in order (``end`` defaults to the end of the channel)."""
        with self._lock:
            stop = self._refresh() if end is None else end
            self._check_range(start, stop)
            return [self.entry(i) for i in range(start, stop)]

    def _check_range(self, start: int, end: int) -> None:
        if start < 0 or end < start:
            raise ConfigurationError(f"invalid position range [{start}, {end}) for channel {self.uri}")
        known = self._refresh()
        if end > known:
            raise ChannelError(
                f"position {end} is past the end ({known}) of channel {self.uri}; "
                "a reader position cannot run ahead of the log"
            )
        if start < end:
            low = self.start_position()
            if start < low:
                raise ChannelTruncatedError(
                    f"positions [{start}, {low}) of channel {self.uri} were deleted by retention; "
                    "the read needs an epoch that is still retained (restore from a newer epoch)"
                )

    def find_barrier(self, epoch: int) -> int | None:
        """Index of the barrier entry of ``epoch``, or None (scans back from the end)."""
        with self._lock:
            end = self._refresh()
            low = self.start_position()
            for i in range(end - 1, low - 1, -1):
                e = self.entry(i)
                if e.is_barrier:
                    assert e.epoch is not None
                    if e.epoch == epoch:
                        return i
                    if e.epoch < epoch:
                        return None
            return None

    def next_barrier_at_or_after(self, pos: int, end: int | None = None) -> int | None:
        """Index of the first barrier entry in ``[pos, end)`` (``end``: the channel's end), or None."""
        with self._lock:
            stop = self._refresh() if end is None else min(end, self._refresh())
            for i in range(max(pos, 0), stop):
                if self.entry(i).is_barrier:
                    return i
            return None

    # ------------------------------------------------------------------ fencing
    def _read_fences(self) -> list[tuple[int, int]]:
        try:
            raw = self._fs.read_json(FENCE_FILE)
        except FileNotFoundError:
            return []
        try:
            return [(int(f["generation"]), int(f["from"])) for f in raw.get("fences", [])]
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ChannelError(f"{FENCE_FILE} of channel {self.uri} is corrupt ({exc}); it must be "
                               '{"fences": [{"generation": G, "from": P}, ...]}') from exc

    def _fences(self) -> list[tuple[int, int]]:
        if self._cache.fences is None:
            self._cache.fences = self._read_fences()
        return self._cache.fences

    def fences(self) -> list[tuple[int, int]]:
        """The channel's fences as ``(generation, from position)``, re-read from storage."""
        with self._lock:
            self._cache.fences = self._read_fences()
            return list(self._cache.fences)

    def fence(self, generation: int, position: int) -> None:
        """Generation ``generation`` (a run's fencing token) writes from ``position`` on: from now on,
        readers ignore every entry at or after ``position`` that an older generation wrote (a superseded
        run still alive), and such a writer's appends are refused. The driver calls it after a takeover's
        restore cut the channel at ``position`` (or at the end when nothing was cut), before any stage runs.
        Upgrades a version-1 channel to version 2 first, so that an older reader refuses it clearly
        instead of reading the fenced entries."""
        if not isinstance(generation, int) or isinstance(generation, bool) or generation < 1:
            raise ConfigurationError(f"a fencing generation must be an int >= 1, got {generation!r}")
        with self._lock:
            current = self._read_fences()
            newer = [g for g, _ in current if g > generation]
            if newer:
                raise ChannelError(f"channel {self.uri} is already fenced by generation {max(newer)}; generation "
                                   f"{generation} was superseded and must not write it")
            if self._header.get("format_version") != FORMAT_VERSION:
                self._header = {**_read_header(self._fs), "format_version": FORMAT_VERSION}
                self._fs.write_json_atomic(HEADER_FILE, self._header)
            # a fence at or after `position` of an older generation is implied by the new one
            kept = sorted((g, p) for g, p in current if p < position and g != generation)
            kept.append((generation, position))
            self._fs.write_json_atomic(FENCE_FILE, {"fences": [{"generation": g, "from": p} for g, p in kept]})
            self._cache = _Caches()  # entries parsed before the fence are parsed again under it
            log.info("channel %s: fenced: generation %s writes from position %s", self.uri, generation, position)

    def _check_fenced(self) -> None:
        """Refuse an append of a writer whose generation a newer one has fenced (read fresh: one small GET)."""
        token = self.token
        if token is None:
            return
        self._cache.fences = self._read_fences()
        newer = [g for g, _ in self._cache.fences if g > token.generation]
        if newer:
            raise FencedError(token.pipeline_id, token.run_id, token.generation, by_generation=max(newer),
                              what=f"an append to channel {self.uri}")

    # ------------------------------------------------------------------ per-writer memory
    def _writer_memo(self, writer: str) -> _WriterMemo:
        """Latest data batch id and latest barrier of ``writer``, scanning only what is not yet known."""
        end = self._refresh()
        memo = self._cache.writers.get(writer)
        if memo is None:
            memo = _WriterMemo(upto=end)
            low = self.start_position()
            for i in range(end - 1, low - 1, -1):
                e = self.entry(i)
                if e.writer != writer:
                    continue
                if e.kind is EntryKind.DATA and not memo.data_found:
                    memo.data_found, memo.latest_batch_id = True, e.batch_id
                elif e.is_barrier and not memo.barrier_found:
                    memo.barrier_found, memo.latest_barrier = True, e
                if memo.data_found and memo.barrier_found:
                    break
            if not memo.data_found or not memo.barrier_found:
                gone = self._truncation().get("writers", {}).get(writer, {})
                if not memo.data_found and gone.get("batch_id") is not None:
                    memo.latest_batch_id = int(gone["batch_id"])
            self._cache.writers[writer] = memo
        for i in range(memo.upto, end):
            e = self.entry(i)
            if e.writer == writer:
                if e.kind is EntryKind.DATA:
                    memo.data_found, memo.latest_batch_id = True, e.batch_id
                else:
                    memo.barrier_found, memo.latest_barrier = True, e
        memo.upto = end
        return memo

    def last_batch_id(self, writer: str) -> int | None:
        """The batch id of ``writer``'s latest data entry (None if it never appended data)."""
        with self._lock:
            return self._writer_memo(writer).latest_batch_id

    # ------------------------------------------------------------------ appends
    def _append_entry(self, entry: Entry) -> int:
        """Commit ``entry`` at the end of the log (its ``index`` is ignored: the slot it lands in), stamped
        with the time and this writer's generation; returns its index."""
        self._check_fenced()
        end = self._refresh()
        entry = replace(entry, time=time.time(), generation=self.token.generation if self.token is not None else 0)
        data = json.dumps(entry.to_json(), sort_keys=True).encode()
        while not self._fs.create_exclusive(log_path(end), data):
            # The slot is taken: by a superseded run that appended after the fence (its entry is
            # ignored by readers: skip it), or by a second writer (a conflict).
            self._cache.entries.pop(end, None)
            self._cache.fences = None
            if self.entry(end).kind is not EntryKind.FENCED:
                self._cache.end = None
                raise ConcurrencyConflict(
                    f"another writer committed entry {end} of channel {self.uri} first; a channel has exactly "
                    "one writer: check that no two stages (or two copies of one pipeline) write it"
                )
            log.warning("channel %s: entry %s was written by a fenced run; appending after it", self.uri, end)
            end += 1
        self._cache.end = end + 1
        self._remember(replace(entry, index=end))
        return end

    def append_barrier(self, epoch: int, writer: str) -> int:
        """Append barrier ``epoch`` from ``writer``; returns its index.

        Idempotent: if ``writer``'s latest barrier already has this epoch, its index is returned and
        nothing is appended. A lower epoch than the latest barrier is a :class:`ChannelError`.
        """
        _check_writer(writer)
        if not isinstance(epoch, int) or isinstance(epoch, bool) or epoch < 0:
            raise ConfigurationError(f"a barrier epoch must be a non-negative int, got {epoch!r}")
        with self._lock:
            latest = self._writer_memo(writer).latest_barrier
            if latest is not None and latest.epoch is not None:
                if latest.epoch == epoch:
                    return latest.index
                if latest.epoch > epoch:
                    raise ChannelError(
                        f"writer {writer!r} already wrote barrier {latest.epoch} to channel {self.uri} "
                        f"(entry {latest.index}); barrier {epoch} would go backwards: barriers must be "
                        "appended in epoch order"
                    )
            index = self._append_entry(Entry(_UNPLACED, EntryKind.BARRIER, writer, epoch=epoch))
            log.info("channel %s: barrier epoch=%s writer=%s at %s", self.uri, epoch, writer, index)
            return index

    def _already_appended(self, batch_id: int, writer: str) -> bool:
        latest = self._writer_memo(writer).latest_batch_id
        if latest is not None and latest >= batch_id:
            log.info(
                "channel %s: writer=%s batch %s already appended (latest %s); skipping the replay",
                self.uri,
                writer,
                batch_id,
                latest,
            )
            return True
        return False

    def _new_data_dir(self, writer: str, batch_id: int) -> str:
        return f"{DATA_DIR}/{_SAFE_NAME.sub('_', writer)}-b{batch_id}-{uuid.uuid4().hex[:12]}"

    def _commit_data(self, data_dir: str, files: list[str], writer: str, batch_id: int) -> int | None:
        rows = 0
        size = 0
        for f in files:
            with self._fs.open_input(f) as handle:
                rows += pq.ParquetFile(handle).metadata.num_rows
            size += self._fs.size(f)
        if rows == 0:
            self._fs.delete_tree(data_dir)
            return None
        try:
            index = self._append_entry(Entry(_UNPLACED, EntryKind.DATA, writer, files=tuple(files), rows=rows,
                                             bytes=size, batch_id=batch_id, dir=data_dir))
        except ConcurrencyConflict:
            self._fs.delete_tree(data_dir)
            raise
        log.info(
            "channel %s: data writer=%s batch=%s rows=%s files=%s at %s",
            self.uri,
            writer,
            batch_id,
            rows,
            len(files),
            index,
        )
        return index

    def append_table(self, table: pa.Table, batch_id: int, writer: str) -> int | None:
        """Append an Arrow table as batch ``batch_id`` of ``writer``; returns the entry index.

        Returns None without writing when the batch was already appended (``batch_id`` not above the
        writer's latest) or when the table is empty (empty batches leave no entry).
        """
        _check_writer(writer)
        _check_batch_id(batch_id)
        with self._lock:
            if self._already_appended(batch_id, writer):
                return None
            return self._append_arrow(table, batch_id, writer)

    def _append_arrow(self, table: pa.Table, batch_id: int, writer: str) -> int | None:
        """Under the lock: write ``table`` as one Parquet file (from this process) and commit its entry."""
        if table.num_rows == 0:
            # Checked against a known schema, but never fixes it: an empty Arrow table's types
            # are often guesses (an empty Python list is the null type).
            if self.schema_json is not None:
                self._ensure_schema(normalize_schema(table.schema))
            return None
        self._ensure_schema(normalize_schema(table.schema))
        assert self.schema_json is not None
        target = arrow_schema_of(self.schema_json)
        try:
            table = table.select(target.names).cast(target)
        except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError, KeyError) as exc:
            raise ChannelSchemaError(
                f"cannot convert the batch to the schema of channel {self.uri} ({exc})"
            ) from exc
        data_dir = self._new_data_dir(writer, batch_id)
        path = f"{data_dir}/part-00000.parquet"
        self._fs.makedirs(data_dir)
        pq.write_table(table, self._fs.arrow_path(path), filesystem=self._fs.arrow_fs)
        return self._commit_data(data_dir, [path], writer, batch_id)

    def append_spark_batch(self, df: DataFrame, batch_id: int, writer: str) -> int | None:
        """Append a Spark micro-batch (call it from ``foreachBatch`` on the driver).

        Same contract as :meth:`append_table`: idempotent per ``batch_id`` (a replayed batch appends
        nothing and returns None), empty batches leave no entry. The rows are written into a fresh
        directory, and the entry is committed afterwards.

        A small batch (the writer's previous one had at most :attr:`DRIVER_WRITE_MAX_ROWS` rows) is collected to the
        driver as Arrow (``df.toArrow()``) and written as one file from here: a micro-batch of a few thousand rows
        costs one Spark job instead of a Hadoop write job's task commits, renames and marker files (figures:
        benchmarks/results/hop_breakdown.md). Otherwise (and for a writer's first batch, whose size is unknown) the
        executors write: on a local disk or HDFS Spark's own writer (``df.write.parquet``); on an object store each
        executor task writes its partition with pyarrow (one PUT per file, no Hadoop committer renaming files, no
        ``s3a://`` connector needed), and only the files of tasks that succeeded are named by the entry.
        """
        _check_writer(writer)
        _check_batch_id(batch_id)
        with self._lock:
            if self._already_appended(batch_id, writer):
                return None
            self._ensure_schema(normalize_schema(df.schema))
            if self._small_batches.get(writer, False):
                index = self._append_arrow(df.toArrow(), batch_id, writer)
            else:
                index = self._append_with_spark(df, batch_id, writer)
            rows = self.entry(index).rows if index is not None else 0
            self._small_batches[writer] = rows <= self.DRIVER_WRITE_MAX_ROWS
            return index

    def _append_with_spark(self, df: DataFrame, batch_id: int, writer: str) -> int | None:
        """Under the lock: the executors write the batch's partitions, then its entry is committed."""
        data_dir = self._new_data_dir(writer, batch_id)
        if not _hadoop_writes(self._fs):
            return self._commit_data(data_dir, _write_partitions_with_arrow(df, self._fs, data_dir), writer,
                                     batch_id)
        df.write.mode("errorifexists").parquet(self._fs.spark_uri_of(data_dir))
        files = [
            e.path
            for e in self._fs.list_dir(data_dir)
            if not e.is_dir and e.name.endswith(".parquet") and not e.name.startswith((".", "_"))
        ]
        return self._commit_data(data_dir, files, writer, batch_id)

    # ------------------------------------------------------------------ reads
    def data_entries(self, start: int, end: int) -> list[Entry]:
        """The data entries in ``[start, end)`` (barriers skipped)."""
        return [e for e in self.entries(start, end) if e.kind is EntryKind.DATA]

    def read_table(self, start: int | None = None, end: int | None = None) -> pa.Table:
        """All data rows of entries ``[start, end)`` in log order, as one table in the channel schema."""
        with self._lock:
            lo = self.start_position() if start is None else start
            hi = self._refresh() if end is None else end
            data = self.data_entries(lo, hi)
            target = self.schema
        if target is None:
            if data:
                raise ChannelError(f"channel {self.uri} has data but no schema in its header")
            return pa.table({})
        tables = [read_data_file(self._fs, f, target) for e in data for f in e.files]
        if not tables:
            return target.empty_table()
        return pa.concat_tables(tables)

    # ------------------------------------------------------------------ truncation
    def truncate_from(self, pos: int) -> None:
        """Delete entries ``>= pos`` and their data (restore: ``pos`` is right after barrier N).

        Every reader and writer of the channel must be stopped. Entries are deleted from the top down,
        so a crash leaves a consistent shorter log (and at worst orphan data files, see
        :meth:`remove_orphans`).
        """
        with self._lock:
            self._cache = _Caches()
            end = self._refresh()
            low = self.start_position()
            if pos < low:
                raise ChannelTruncatedError(
                    f"cannot truncate channel {self.uri} from {pos}: retention already deleted the entries "
                    f"below {low}; restore from an epoch that is still retained"
                )
            if pos > end:
                raise ChannelError(
                    f"cannot truncate channel {self.uri} from {pos}: it has only {end} entries "
                    "(is this the channel the epoch's cursors were recorded for?)"
                )
            doomed = [self.entry(i) for i in range(end - 1, pos - 1, -1)]
            for e in doomed:
                self._fs.delete(log_path(e.index))
            for e in doomed:
                _delete_entry_data(self._fs, e)
            self._cache = _Caches(end=pos)
            if doomed:
                log.info("channel %s: truncated from %s (%s entries removed)", self.uri, pos, len(doomed))

    def truncate_before(self, pos: int) -> int:
        """Delete the data and the entries of positions ``< pos`` (retention); returns bytes freed.

        The log is compacted: ``_truncated.json`` records the new start (and each writer's latest
        batch id and barrier epoch so idempotency survives), then data and entry files go bottom-up.
        Reading below ``pos`` afterwards raises :class:`ChannelTruncatedError`. Safe while the pipeline
        runs as long as no reader needs a position below ``pos``. Re-running finishes an interrupted run.
        """
        with self._lock:
            end = self._refresh()
            if pos > end:
                raise ConfigurationError(
                    f"cannot truncate channel {self.uri} before {pos}: it has only {end} entries"
                )
            truncation = self._truncation()
            low = int(truncation.get("before", 0))
            listed = sorted(
                int(e.name.split(".")[0])
                for e in self._fs.list_dir(LOG_DIR)
                if e.name.endswith(".json") and e.name.split(".")[0].isdigit()
            )
            doomed = [self.entry(i) for i in listed if i < pos]
            if pos > low:
                writers: dict[str, dict[str, int]] = dict(truncation.get("writers", {}))
                for e in doomed:
                    w = dict(writers.get(e.writer, {}))
                    if e.kind is EntryKind.DATA and e.batch_id is not None:
                        w["batch_id"] = max(e.batch_id, w.get("batch_id", -1))
                    elif e.epoch is not None:
                        w["epoch"] = max(e.epoch, w.get("epoch", -1))
                    writers[e.writer] = w
                self._fs.write_json_atomic(TRUNCATED_FILE, {"before": pos, "writers": writers})
            freed = 0
            for e in doomed:
                freed += _delete_entry_data(self._fs, e)
                try:
                    freed += self._fs.size(log_path(e.index))
                except FileNotFoundError:
                    continue
                self._fs.delete(log_path(e.index))
                self._cache.entries.pop(e.index, None)
            if doomed:
                log.info(
                    "channel %s: truncated before %s (%s entries, %s bytes freed)",
                    self.uri,
                    pos,
                    len(doomed),
                    freed,
                )
            return freed

    def copy_to(self, uri: str | FileSystem, end: int) -> Channel:
        """Write a new channel at ``uri`` holding this channel's entries below ``end`` as readers see them (a
        fork's first restore: ``end`` is right after the fork point's barrier), at the same positions, so that
        cursors and Spark offsets recorded for this channel hold for the copy. Whatever is at ``uri`` is
        deleted first (a repeat after an interrupted copy starts over).

        Entries keep their kind, writer, batch id and files (data copied byte for byte) but no generation:
        the copy has no fences, and an entry a fence hid here is written as an empty data entry, so that no
        superseded run's rows reappear. The retention watermark (``_truncated.json``) is copied; the header
        last, so that an interrupted copy is no channel at all. This channel must not be truncated meanwhile.
        """
        dest = FileSystem.of(uri)
        dest.delete(HEADER_FILE)  # first: an interrupted delete leaves no channel either
        for child in dest.list_dir(""):
            dest.delete_tree(child.path)
        with self._lock:
            start = self.start_position()
            if end < start or end > self._refresh():
                raise ChannelError(f"cannot copy entries [{start}, {end}) of channel {self.uri}: it holds "
                                   f"[{start}, {self._refresh()})")
            truncation = self._truncation()
            if truncation:
                dest.write_json_atomic(TRUNCATED_FILE, truncation)
            for i in range(start, end):
                e = self.entry(i)
                if e.kind is EntryKind.FENCED:
                    e = Entry(i, EntryKind.DATA, e.writer, time=e.time)
                for f in e.files:
                    with self._fs.open_input(f) as src, dest.open_output(f) as out:
                        shutil.copyfileobj(src, out, 1 << 20)
                dest.write_bytes_atomic(log_path(i), json.dumps(replace(e, generation=0).to_json(),
                                                                sort_keys=True).encode())
            header = {k: v for k, v in self._header.items() if k != "created_at"}
            dest.write_bytes_atomic(HEADER_FILE, json.dumps({**header, "created_at": time.time(),
                                                             "copied_from": self.uri}, sort_keys=True).encode())
        log.info("channel %s: copied entries [%s, %s) to %s", self.uri, start, end, uri)
        return Channel.open(uri)

    def reset(self) -> None:
        """Empty the channel completely, keeping its header (schema): positions start again at 0.

        For starting a pipeline over from nothing (fresh Spark checkpoints, so batch ids restart at 0):
        unlike ``truncate_from(start_position())`` it also forgets the retention watermark and the
        writers' batch ids recorded there. Every reader and writer must be stopped.
        """
        with self._lock:
            listed = sorted(
                (int(e.name.split(".")[0]) for e in self._fs.list_dir(LOG_DIR) if e.name.split(".")[0].isdigit()),
                reverse=True,
            )
            for i in listed:  # top down: an interrupted reset leaves a gap-free log
                self._fs.delete(log_path(i))
            self._fs.delete(TRUNCATED_FILE)
            self._fs.delete(FENCE_FILE)  # positions start again: the new run fences from 0 (Channel.fence)
            self._fs.delete_tree(DATA_DIR)
            self._cache = _Caches(end=0)
            log.info("channel %s: reset (%s entries removed)", self.uri, len(listed))

    def remove_orphans(self) -> int:
        """Delete data directories no entry names (left by a crash between data write and commit).

        Only while the channel's writer is stopped (an in-flight append looks like an orphan). Returns
        bytes freed.
        """
        with self._lock:
            end = self._refresh()
            named = {e.dir for e in self.entries(self.start_position(), end) if e.dir}
            freed = 0
            for d in self._fs.list_dir(DATA_DIR):
                if d.path not in named:
                    freed += sum(f.size for f in self._fs.list_files(d.path)) if d.is_dir else d.size
                    self._fs.delete_tree(d.path)
            return freed

    def size_bytes(self) -> int:
        """Bytes used by the channel (data, log and header)."""
        return sum(f.size for f in self._fs.list_files(""))


# ---------------------------------------------------------------------- helpers
def _hadoop_writes(fs: FileSystem) -> bool:
    """Whether Spark's own file writer is the one to use for ``fs`` (local disks, HDFS); object stores are
    written with pyarrow from the executors instead."""
    return fs.is_local or fs.uri.partition("://")[0].lower() in ("hdfs", "viewfs")


def _write_partitions_with_arrow(df: DataFrame, fs: FileSystem, data_dir: str) -> list[str]:
    """Each task of ``df`` writes its non-empty partition as one Parquet file below ``data_dir`` with pyarrow;
    returns the paths (relative to ``fs``) of the files of the tasks that succeeded, sorted."""

    def write(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        path = f"{data_dir}/part-{uuid.uuid4().hex}.parquet"
        out: pq.ParquetWriter | None = None
        try:
            for b in batches:
                if b.num_rows:
                    if out is None:
                        out = pq.ParquetWriter(fs.arrow_path(path), b.schema, filesystem=fs.arrow_fs)
                    out.write_batch(b)
        finally:
            if out is not None:
                out.close()
        if out is not None:
            yield pa.RecordBatch.from_pydict({"path": [path]})

    return sorted(str(r["path"]) for r in df.mapInArrow(write, "path string").collect())


def _read_header(fs: FileSystem) -> dict[str, Any]:
    try:
        header: dict[str, Any] = fs.read_json(HEADER_FILE)
    except FileNotFoundError:
        raise ChannelError(
            f"no channel at {fs.uri} (no {HEADER_FILE}); create it with Channel.create(uri, schema) or "
            "start the stage that writes it first"
        ) from None
    version = header.get("format_version")
    if version not in READABLE_VERSIONS:
        raise ChannelError(
            f"channel {fs.uri} has format_version {version!r}; this airflow-arroyo reads versions "
            f"{', '.join(map(str, READABLE_VERSIONS))}: upgrade airflow-arroyo on this machine (or recreate the "
            "channel)"
        )
    return header


def _check_writer(writer: str) -> None:
    if not isinstance(writer, str) or not writer:
        raise ConfigurationError(f"a channel writer must be a non-empty stage name, got {writer!r}")


def _check_batch_id(batch_id: int) -> None:
    if not isinstance(batch_id, int) or isinstance(batch_id, bool) or batch_id < 0:
        raise ConfigurationError(f"a batch id must be a non-negative int, got {batch_id!r}")


def _delete_entry_data(fs: FileSystem, e: Entry) -> int:
    """Delete the files of a data entry (its directory when it has one; a fenced entry's directory, which may
    be gone already: a restore removes orphans while a superseded run may still write); returns bytes freed."""
    if e.kind is EntryKind.BARRIER:
        return 0
    if e.dir:
        freed = sum(f.size for f in fs.list_files(e.dir)) if fs.exists(e.dir) else 0
        fs.delete_tree(e.dir)
        return freed
    freed = 0
    for f in e.files:
        try:
            freed += fs.size(f)
        except FileNotFoundError:
            continue
        fs.delete(f)
    return freed


def read_data_file(fs: FileSystem, path: str, target: pa.Schema) -> pa.Table:
    """One data file of a channel as a table cast to ``target`` (the channel's Arrow schema)."""
    table = pq.read_table(fs.arrow_path(path), filesystem=fs.arrow_fs)
    return cast_to(table, target)


def cast_to(table: pa.Table, target: pa.Schema) -> pa.Table:
    """Select ``target``'s columns in order and cast (e.g. Spark's INT96 timestamps to microseconds)."""
    return table.select(target.names).cast(target)


def iter_data_file(fs: FileSystem, path: str, target: pa.Schema, batch_size: int = 65536) -> Iterable[pa.RecordBatch]:
    """Stream one data file as record batches in ``target``'s schema (what executors yield to Spark)."""
    with fs.open_input(path) as handle:
        pf = pq.ParquetFile(handle)
        for batch in pf.iter_batches(batch_size=batch_size, columns=target.names):
            yield batch.select(target.names).cast(target)
