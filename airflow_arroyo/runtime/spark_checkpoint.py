"""Spark's streaming checkpoint folder: the one module that knows its format.

Layout (written by Spark; this package reads it and copies it, never writes into it)::

    metadata                          the query id
    offsets/<b>                       written before batch b runs: "v1", the batch metadata, then one
                                      line per source (JSON offset, or "-" when it has none yet)
    commits/<b>                       written after batch b committed (its sink ran)
    sources/<i>/...                   source logs (file sources), by batch id
    state/<operator>/<partition>/     state store files: ``V.delta`` and ``V.snapshot`` (default
                                      provider), ``V.zip`` / ``V.changelog`` plus ``SSTs/`` and ``logs/``
                                      (RocksDB), ``_metadata`` and ``_stateSchema`` folders
    asyncOffsets/, asyncCommits/      the same logs under asynchronous progress tracking

Batch b commits state store version ``b + 1``. Hidden files (``.crc``, ``.tmp``, ``_temporary``) are
Hadoop's write-then-rename scaffolding and never part of a checkpoint's content.
"""

from __future__ import annotations

import io
import json
import logging
import re
import zipfile
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from airflow_arroyo.core.exceptions import SnapshotError
from airflow_arroyo.core.fs import FileSystem
from airflow_arroyo.jvm import find_class
from airflow_arroyo.runtime.channel import ChannelError

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

__all__ = [
    "CHECKPOINT_FILE_MANAGER_CONF",
    "OBJECT_STORE_CHECKPOINT_FILE_MANAGERS",
    "checkpoint_file_manager",
    "checkpoint_offsets",
    "check_restorable",
    "commit_path",
    "latest_commit",
    "local_checkpoint_file_manager",
    "object_store_checkpoint_file_manager",
    "offsets_path",
    "rocksdb_zip_references",
    "select_checkpoint_files",
    "snapshot_files",
    "state_bytes",
    "state_file_version",
    "state_operators",
]

log = logging.getLogger(__name__)
_VERSIONED = re.compile(r"^(\d+)(?:_[^.]*)?\.(delta|snapshot|zip|changelog)$")
_BASE_KINDS = frozenset({"snapshot", "zip"})
_BATCH_LOGS = frozenset({"offsets", "commits", "asyncOffsets", "asyncCommits"})
#: Entries of each batch log a snapshot keeps: the cut batch and the one before it. A restarted query
#: reads only those (``MicroBatchExecution.populateStartOffsets``: the latest offsets and commit, and the
#: second-latest offsets as the committed offsets); the older ones are kept by Spark only for
#: ``minBatchesToRetain`` and would cost one object row per file per stage per epoch (up to ~400).
BATCH_LOG_ENTRIES = 2
OFFSETS_DIR = "offsets"
COMMITS_DIR = "commits"


#: The SQL conf naming the class that writes a query's checkpoint files (its offsets and commits logs, its
#: state files); Spark reads it when the query starts, so it applies per query.
CHECKPOINT_FILE_MANAGER_CONF = "spark.sql.streaming.checkpointFileManagerClass"
#: Spark's checkpoint file manager over Hadoop's ``FileSystem`` API, by Spark version.
_FILE_SYSTEM_MANAGERS = (
    "org.apache.spark.sql.execution.streaming.checkpointing.FileSystemBasedCheckpointFileManager",  # 4.1+
    "org.apache.spark.sql.execution.streaming.FileSystemBasedCheckpointFileManager",  # 3.x, 4.0
)
#: Checkpoint file managers that write a file straight to its final name through an output stream that can be
#: aborted (S3A), in order of preference: the provider's (its jar, ``airflow_arroyo/jvm/src``), then
#: spark-hadoop-cloud's, where a Spark distribution ships that module (none is published for Spark 4.2.0).
OBJECT_STORE_CHECKPOINT_FILE_MANAGERS = (
    "airflow.arroyo.spark.AbortableCheckpointFileManager",
    "org.apache.spark.internal.io.cloud.AbortableStreamBasedCheckpointFileManager",
)
_file_system_manager: dict[str, str | None] = {}
_object_store_manager: dict[str, str | None] = {}


def local_checkpoint_file_manager(spark: SparkSession) -> str | None:
    """The class name of Spark's ``FileSystem``-based checkpoint file manager, for checkpoints on a local disk
    (None where it cannot be found, e.g. a Spark Connect session).

    *Why:* Spark's default manager writes each checkpoint file through Hadoop's ``FileContext``, which on a
    local disk without Hadoop's native library starts processes: ``readlink`` and ``chmod`` for the file and
    its ``.crc``, ten per file (Spark 4.2). Every micro-batch writes two such files (``offsets/b`` before it
    runs, ``commits/b`` after); through ``FileSystem`` each costs two ``chmod`` (figures:
    benchmarks/results/hop_breakdown.md).
    The ``FileSystem`` manager writes the same temporary file and renames it (``rename(2)``: atomic); where
    the ``FileContext`` rename refuses an existing target, it checks for the target first, which only a
    second writer of the same checkpoint folder could race, and the driver never runs two (a restore or a
    takeover writes a new folder)."""
    try:
        context = spark.sparkContext
    except Exception:  # noqa: BLE001 - a Spark Connect session has none: its server writes the checkpoints
        return None
    key = str(context.applicationId)
    if key not in _file_system_manager:
        _file_system_manager[key] = find_class(getattr(context, "_jvm", None), _FILE_SYSTEM_MANAGERS)
    return _file_system_manager[key]


def object_store_checkpoint_file_manager(spark: SparkSession) -> str | None:
    """The class name of the first of :data:`OBJECT_STORE_CHECKPOINT_FILE_MANAGERS` the session's JVM has, for
    checkpoints on S3 (None where none is found; warned once per application).

    *Why:* on S3A Spark's default manager writes each checkpoint file to a temporary object and renames it, a copy
    and a delete on S3: about three requests more per file (two files per micro-batch, plus state files), and a
    temporary object left behind by a crash in between. An S3 object appears whole when its upload completes, so
    writing the final name directly, completing the upload on close and aborting it on cancel, is as atomic (Spark's
    cloud integration guide recommends this manager for S3A). A second writer of the same folder could race it;
    the driver never runs two (a restore or a takeover writes a new folder)."""
    try:
        context = spark.sparkContext
    except Exception:  # noqa: BLE001 - a Spark Connect session has none: its server writes the checkpoints
        return None
    key = str(context.applicationId)
    if key not in _object_store_manager:
        found = find_class(getattr(context, "_jvm", None), OBJECT_STORE_CHECKPOINT_FILE_MANAGERS)
        if found is None:
            log.warning("none of %s is on the driver's class path: Spark's checkpoints on S3 are written to a "
                        "temporary object then copied (docs/runtime.md, \"Object storage\"); put the provider's jar "
                        "on it (airflow_arroyo.jvm.local_file_system_conf)",
                        ", ".join(OBJECT_STORE_CHECKPOINT_FILE_MANAGERS))
        _object_store_manager[key] = found
    return _object_store_manager[key]


def checkpoint_file_manager(spark: SparkSession, fs: FileSystem) -> str | None:
    """The checkpoint file manager for a query whose checkpoint is on ``fs``: the ``FileSystem``-based one on a
    local disk (:func:`local_checkpoint_file_manager`), the abortable-stream one on S3
    (:func:`object_store_checkpoint_file_manager`); None elsewhere (Spark's default) or where it is not found."""
    if fs.is_local:
        return local_checkpoint_file_manager(spark)
    if fs.is_s3:
        return object_store_checkpoint_file_manager(spark)
    return None


def offsets_path(checkpoint: str, batch_id: int) -> str:
    """``offsets/<batch_id>`` below ``checkpoint`` (a path relative to some filesystem root, or "")."""
    return f"{checkpoint}/{OFFSETS_DIR}/{batch_id}" if checkpoint else f"{OFFSETS_DIR}/{batch_id}"


def commit_path(checkpoint: str, batch_id: int) -> str:
    """``commits/<batch_id>`` below ``checkpoint``: present once Spark committed the batch."""
    return f"{checkpoint}/{COMMITS_DIR}/{batch_id}" if checkpoint else f"{COMMITS_DIR}/{batch_id}"


def latest_commit(fs: FileSystem, checkpoint: str) -> int:
    """The newest committed batch id of the checkpoint at ``checkpoint`` in ``fs`` (-1: none)."""
    latest = -1
    for e in fs.list_dir(f"{checkpoint}/{COMMITS_DIR}"):
        if not e.is_dir and e.name.isdigit():
            latest = max(latest, int(e.name))
    return latest


def checkpoint_offsets(checkpoint_uri: str | FileSystem, batch_id: int) -> list[dict[str, Any] | None]:
    """The end offsets of micro-batch ``batch_id``, one per source in the query's source order.

    Reads ``offsets/<batch_id>`` of a Spark streaming checkpoint (written before the batch runs, so it
    is available inside ``foreachBatch``). A source without an offset yet gives None.
    """
    fs = FileSystem.of(checkpoint_uri)
    try:
        text = fs.read_bytes(offsets_path("", batch_id)).decode()
    except FileNotFoundError:
        raise ChannelError(
            f"no offsets for batch {batch_id} in checkpoint {fs.uri}; is it the query's "
            "checkpointLocation?"
        ) from None
    lines = text.splitlines()
    if not lines or not lines[0].startswith("v"):
        raise ChannelError(f"unrecognised offset log format in {fs.uri_of(offsets_path('', batch_id))}")
    out: list[dict[str, Any] | None] = []
    for line in lines[2:]:
        if line.strip() in ("", "-"):
            out.append(None)
        else:
            parsed = json.loads(line)
            out.append(parsed if isinstance(parsed, dict) else None)
    return out


# --------------------------------------------------------------------------- which files (pure)


def _hidden(name: str) -> bool:
    return name.startswith(".") or name.startswith("_temporary") or name.endswith((".crc", ".tmp"))


def state_file_version(name: str) -> tuple[int, str] | None:
    """``(version, kind)`` of a state store file name (``12.delta`` -> ``(12, "delta")``; kinds ``delta``,
    ``snapshot``, ``zip``, ``changelog``), None for any other name."""
    m = _VERSIONED.match(name)
    return (int(m.group(1)), m.group(2)) if m is not None else None


def _state_file(rel: str) -> bool:
    parts = rel.split("/")
    return parts[0] == "state" and len(parts) >= 3 and not any(_hidden(p) for p in parts)


def state_bytes(files: Iterable[tuple[str, str, int]]) -> int:
    """Bytes of state store files among a snapshot's ``(rel_path, object_key, bytes)`` entries: what the state of
    the cut takes (base and deltas, RocksDB files, operator metadata and schemas), each object counted once."""
    return sum({key: size for rel, key, size in files if _state_file(rel)}.values())


def state_operators(rel_paths: Iterable[str]) -> list[int]:
    """The stateful operator ids of a checkpoint's files (``state/<operator>/...``), sorted; empty for a query
    without state (or a cut before its first batch, which holds no state file)."""
    return sorted({int(rel.split("/")[1]) for rel in rel_paths if _state_file(rel) and rel.split("/")[1].isdigit()})


def snapshot_files(rel_paths: Iterable[str], batch_id: int) -> list[str]:
    """The default provider's ``V.snapshot`` files at or below the state version of batch ``batch_id``
    (sorted): the bases :func:`select_checkpoint_files` may start a delta chain from if they are held."""
    version = batch_id + 1
    out = []
    for rel in rel_paths:
        parts = rel.split("/")
        if parts[0] != "state" or len(parts) < 4 or any(_hidden(p) for p in parts):
            continue
        m = _VERSIONED.match(parts[-1])
        if m is not None and m.group(2) == "snapshot" and int(m.group(1)) <= version:
            out.append(rel)
    return sorted(out)


def select_checkpoint_files(
    rel_paths: Iterable[str],
    batch_id: int,
    zip_references: Callable[[str], Iterable[str] | None],
    held_bases: Callable[[str], bool] | None = None,
    max_chain: int | None = None,
) -> list[str]:
    """The files of a Spark checkpoint that make up its state as of batch ``batch_id`` (sorted): the
    ``metadata``, the last :data:`BATCH_LOG_ENTRIES` entries up to ``batch_id`` of each batch log, the
    source logs up to it, and the state store files that load its version.

    ``rel_paths``: every file below the checkpoint folder, relative to it, ``/``-separated.
    ``zip_references(rel_path_of_zip)``: the ``SSTs/...`` and ``logs/...`` files (relative to the
    zip's folder) a RocksDB ``V.zip`` references, or None if it cannot be read (then every such file
    in the folder is kept). ``batch_id`` -1 means no batch ran yet (only ``metadata`` is kept).

    ``held_bases`` (incremental snapshots; None: always the newest base): whether the pipeline already
    holds a ``V.snapshot`` (from :func:`snapshot_files`). A default-provider partition is then made of
    the newest *held* snapshot (or none: version 0, the empty state) and every ``.delta`` after it, as
    long as those deltas are all present and there are at most ``max_chain`` of them (None: no bound
    but Spark's own cleanup); a newer snapshot Spark wrote is not taken, because the deltas it
    summarises are what earlier epochs already hold. Otherwise the newest snapshot and the deltas
    after it, as without ``held_bases``. Spark loads version V from whatever snapshot is present at
    or below V and the deltas after it (an absent snapshot is not an error), so both load the same state.
    """
    version = batch_id + 1  # batch b commits state store version b + 1
    keep: list[str] = []
    partitions: dict[str, list[tuple[int, str, str]]] = {}  # folder -> [(version, kind, rel)]
    side_files: dict[str, list[str]] = {}  # folder -> SSTs/..., logs/... files (rel to folder)
    for rel in rel_paths:
        parts = rel.split("/")
        name = parts[-1]
        if any(_hidden(p) for p in parts):
            continue
        top = parts[0]
        if top in _BATCH_LOGS or top == "sources":
            n = _leading_int(name)
            if n is None:
                if top in _BATCH_LOGS:
                    continue  # not a batch file
                keep.append(rel)
            elif n <= batch_id and (top not in _BATCH_LOGS or n > batch_id - BATCH_LOG_ENTRIES):
                keep.append(rel)
            continue
        if top == "state" and batch_id < 0:
            continue  # batch 0 writes state files as it runs: none belongs to a cut before it
        if top == "state" and len(parts) >= 4:
            if "_metadata" in parts or any(p.startswith("_stateSchema") for p in parts):
                # operator metadata and state schemas; v2 operator metadata and v3 schema files are named by
                # the batch that wrote them
                n = _leading_int(name) if "v2" in parts or any(p.startswith("_stateSchema") for p in parts) else None
                if n is None or n <= batch_id:
                    keep.append(rel)
                continue
            m = _VERSIONED.match(name)
            folder = "/".join(parts[:-1])
            if m is not None:
                partitions.setdefault(folder, []).append((int(m.group(1)), m.group(2), rel))
                continue
            if len(parts) >= 5 and parts[-2] in ("SSTs", "logs"):
                owner = "/".join(parts[:-2])
                side_files.setdefault(owner, []).append(f"{parts[-2]}/{name}")
                continue
            keep.append(rel)  # an unknown immutable file: keep it
            continue
        keep.append(rel)  # metadata and anything unknown
    for folder, files in partitions.items():
        keep += _state_as_of(folder, files, side_files.get(folder, []), version, zip_references,
                             _held_chain_base(files, version, held_bases, max_chain))
    return sorted(set(keep))


def check_restorable(rel_paths: Iterable[str]) -> list[str]:
    """What keeps a rebuilt checkpoint (its files, relative to it) from being one Spark restarts from; empty
    when nothing does. Checked before a snapshot is recorded and before a restore's commit point, so an epoch
    whose restore Spark would refuse never completes, and one that did (before this check) fails its restore
    before anything changed.

    The rules are Spark's own for a restart (``MicroBatchExecution.populateStartOffsets`` and the state
    store's load): the query's ``metadata``; with a committed batch *b*, ``offsets/b`` and ``offsets/b-1``;
    with none, no state files at all (Spark requires an empty state folder for batch 0:
    ``STATE_STORE_CHECKPOINT_LOCATION_NOT_EMPTY``); no batch log entry after *b*; and in every state store
    partition a base at or below version *b + 1* with every delta or changelog after it up to *b + 1*.
    """
    files = [rel for rel in rel_paths if not any(_hidden(p) for p in rel.split("/"))]
    logs: dict[str, set[int]] = {d: set() for d in _BATCH_LOGS}
    partitions: dict[str, list[tuple[int, str]]] = {}
    state_files = 0
    for rel in files:
        parts = rel.split("/")
        n = _leading_int(parts[-1])
        if parts[0] in _BATCH_LOGS and len(parts) == 2 and n is not None:
            logs[parts[0]].add(n)
        elif parts[0] == "state":
            state_files += 1
            version = state_file_version(parts[-1])
            if version is not None and not any(p.startswith(("_metadata", "_stateSchema")) for p in parts):
                partitions.setdefault("/".join(parts[:-1]), []).append(version)
    problems = [] if "metadata" in files else ["no 'metadata' file (the query's id)"]
    committed = logs[COMMITS_DIR] | logs["asyncCommits"]
    batch = max(committed, default=-1)
    if batch < 0 and state_files:
        problems.append(f"{state_files} state file(s) but no committed batch: Spark refuses a non-empty state "
                        "folder for batch 0 (STATE_STORE_CHECKPOINT_LOCATION_NOT_EMPTY)")
    offsets = logs[OFFSETS_DIR] | logs["asyncOffsets"]
    needed = [b for b in (batch - 1, batch) if b >= 0]
    problems += [f"offsets/{b} is missing (Spark reads it to restart after batch {batch})"
                 for b in needed if b not in offsets]
    later = sorted(f"{d}/{b}" for d, ids in logs.items() for b in ids if b > batch)
    if later:
        problems.append(f"batch log entries after the committed batch {batch}: {', '.join(later[:4])}")
    if batch >= 0:
        for folder, versions in sorted(partitions.items()):
            gap = _chain_gap(versions, batch + 1)
            if gap is not None:
                problems.append(f"{folder} cannot load state version {batch + 1}: {gap}")
    return problems


def _chain_gap(versions: list[tuple[int, str]], version: int) -> str | None:
    """Why one state store partition's files cannot load ``version`` (None: they can)."""
    bases = [v for v, kind in versions if kind in _BASE_KINDS and v <= version]
    base = max(bases, default=0)
    steps = {v for v, kind in versions if kind in ("delta", "changelog")}
    missing = [v for v in range(base + 1, version + 1) if v not in steps]
    if missing:
        return (f"no {'delta or changelog' if steps or not bases else 'file'} for version(s) "
                f"{', '.join(map(str, missing[:4]))}{' ...' if len(missing) > 4 else ''} after base {base}")
    beyond = sorted(v for v, _ in versions if v > version)
    if beyond:
        return f"files of later versions ({', '.join(map(str, beyond[:4]))})"
    return None


def _held_chain_base(files: list[tuple[int, str, str]], version: int, held_bases: Callable[[str], bool] | None,
                     max_chain: int | None) -> int | None:
    """The base version of the delta chain that loads ``version`` without a snapshot the pipeline does not
    hold: the newest held ``V.snapshot`` (or 0) with every delta after it up to ``version`` present, within
    ``max_chain`` deltas. None: no such chain (or not the default provider), take the newest base."""
    if held_bases is None or any(kind not in ("delta", "snapshot") for _, kind, _ in files):
        return None
    deltas = {v for v, kind, _ in files if kind == "delta"}
    low = version  # deltas low+1 .. version are all present
    while low > 0 and low in deltas:
        low -= 1
    if max_chain is not None:
        low = max(low, version - max_chain)
    snapshots = sorted(((v, rel) for v, kind, rel in files if kind == "snapshot" and low <= v <= version), reverse=True)
    for v, rel in snapshots:
        if held_bases(rel):
            return v
    return 0 if low == 0 else None


def _state_as_of(folder: str, files: list[tuple[int, str, str]], side_files: list[str], version: int,
                 zip_references: Callable[[str], Iterable[str] | None], base: int | None = None) -> list[str]:
    """The files of one state-store partition ``folder`` that make up ``version``: the base (snapshot or zip;
    the newest at or below it unless ``base`` names one, 0: none), the deltas after that base, and the
    ``SSTs``/``logs`` files its RocksDB zips reference (``side_files``: those present, relative to the folder)."""
    eligible = [f for f in files if f[0] <= version]
    if base is None:
        bases = [f[0] for f in eligible if f[1] in _BASE_KINDS]
        base = max(bases) if bases else 0
    chosen = [f for f in eligible if (f[1] in _BASE_KINDS and f[0] == base) or
              (f[1] not in _BASE_KINDS and base < f[0] <= version)]
    zips = [rel for _, kind, rel in chosen if kind == "zip"]
    available = set(side_files)
    wanted: set[str] = set()
    for z in zips:
        refs = zip_references(z)
        wanted |= available if refs is None else set(refs)
    missing = wanted - available
    if missing:
        raise SnapshotError(
            f"RocksDB checkpoint {zips} references {sorted(missing)[:3]} which are not in {folder}; "
            "the checkpoint folder is incomplete (did something delete state files?)"
        )
    return [rel for _, _, rel in chosen] + [f"{folder}/{s}" for s in sorted(wanted)]


def _leading_int(name: str) -> int | None:
    m = re.match(r"^(\d+)(?:$|[._])", name)
    return int(m.group(1)) if m else None


def rocksdb_zip_references(data: bytes) -> list[str]:
    """The ``SSTs/...`` and ``logs/...`` files a RocksDB ``V.zip`` checkpoint references."""
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        text = z.read("metadata").decode()
    lines = text.splitlines()
    body = "\n".join(lines[1:]) if lines and lines[0].startswith("v") else text
    meta = json.loads(body)
    refs: list[str] = []

    def walk(node: object) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                if isinstance(v, str) and k.startswith("dfs") and k.endswith("FileName"):
                    refs.append(("SSTs/" if v.endswith(".sst") else "logs/") + v)
                else:
                    walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(meta)
    return refs
