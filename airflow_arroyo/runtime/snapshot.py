"""Snapshots of Spark checkpoints: incremental, content-addressed capture and verified restore.

A stage's snapshot for epoch *n* is its Spark checkpoint **as of the cut batch b**: ``metadata``,
``offsets/<= b``, ``commits/<= b``, source logs up to b and the state store files needed to load
state version ``b + 1`` (the version batch b committed), for both state store providers:

* default (HDFS-backed): the newest ``V.snapshot`` at or below b+1 and the ``V.delta`` files after it;
* RocksDB: the newest ``V.zip`` at or below b+1 (plus ``V.changelog`` files after it when changelog
  checkpointing is on) and the ``SSTs/`` / ``logs/`` files that zip references.

Every file is stored once as an immutable **object** named by the SHA-256 of its content
(``<storage>/<pipeline>/snapshots/objects/sha256/ab/abcdef...``). Spark rewrites ``N.delta`` and
``N.zip`` under the same names with new content after a restore, so names alone would share the wrong
file; content addresses cannot. A file whose object the pipeline already holds (any retained epoch) is
referenced, not copied: ``bytes_new`` is what this epoch added, ``bytes_total`` what it references.
Hashes are cached by (path, size, mtime) so unchanged files are not even re-read.

Restore rebuilds a checkpoint folder from an epoch's entries into a fresh folder, verifying every
object's size and hash (:class:`~airflow_arroyo.exceptions.SnapshotError` names the epoch and the
file; nothing is deleted), and only then swaps it in, moving the old folder aside.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import posixpath
import re
import threading
import time
import uuid
import zipfile
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import pyarrow.fs as pafs

from airflow_arroyo.exceptions import SnapshotError
from airflow_arroyo.fs import FileSystem
from airflow_arroyo.store import EpochStore, SnapshotEntry

__all__ = [
    "CaptureResult",
    "PreparedRestore",
    "SnapshotStore",
    "object_path",
    "select_checkpoint_files",
]

log = logging.getLogger(__name__)

_CHUNK = 1 << 20
_VERSIONED = re.compile(r"^(\d+)(?:_[^.]*)?\.(delta|snapshot|zip|changelog)$")
_BASE_KINDS = frozenset({"snapshot", "zip"})
_BATCH_LOGS = frozenset({"offsets", "commits", "asyncOffsets", "asyncCommits"})


# --------------------------------------------------------------------------- which files (pure)


def _hidden(name: str) -> bool:
    return name.startswith(".") or name.startswith("_temporary") or name.endswith((".crc", ".tmp"))


def select_checkpoint_files(
    rel_paths: Iterable[str],
    batch_id: int,
    zip_references: Callable[[str], Iterable[str] | None],
) -> list[str]:
    """The files of a Spark checkpoint that make up its state as of batch ``batch_id`` (sorted).

    ``rel_paths``: every file below the checkpoint folder, relative to it, ``/``-separated.
    ``zip_references(rel_path_of_zip)``: the ``SSTs/...`` and ``logs/...`` files (relative to the
    zip's folder) a RocksDB ``V.zip`` references, or None if it cannot be read (then every such file
    in the folder is kept). ``batch_id`` -1 means no batch ran yet (only ``metadata`` is kept).
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
            elif n <= batch_id:
                keep.append(rel)
            continue
        if top == "state" and len(parts) >= 4:
            if "_metadata" in parts or any(p.startswith("_stateSchema") for p in parts):
                # operator metadata and state schemas; v2 operator metadata files are named by batch id
                n = _leading_int(name) if "v2" in parts else None
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
        eligible = [f for f in files if f[0] <= version]
        bases = [f[0] for f in eligible if f[1] in _BASE_KINDS]
        base = max(bases) if bases else 0
        chosen = [f for f in eligible if (f[1] in _BASE_KINDS and f[0] == base) or
                  (f[1] not in _BASE_KINDS and base < f[0] <= version)]
        keep.extend(rel for _, _, rel in chosen)
        zips = [rel for _, kind, rel in chosen if kind == "zip"]
        available = set(side_files.get(folder, []))
        wanted: set[str] = set()
        for z in zips:
            refs = zip_references(z)
            if refs is None:
                wanted |= available
            else:
                wanted |= set(refs)
        missing = wanted - available
        if missing:
            raise SnapshotError(
                f"RocksDB checkpoint {zips} references {sorted(missing)[:3]} which are not in {folder}; "
                "the checkpoint folder is incomplete (did something delete state files?)"
            )
        keep.extend(f"{folder}/{s}" for s in sorted(wanted))
    return sorted(set(keep))


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


# --------------------------------------------------------------------------- objects


def object_key(digest: str) -> str:
    """The object key of content with SHA-256 ``digest`` (relative to the objects folder)."""
    return f"sha256/{digest[:2]}/{digest}"


def object_path(pipeline_id: str, key: str) -> str:
    """Path of an object relative to the storage root (the layout retention deletes from)."""
    return f"{pipeline_id}/snapshots/objects/{key}"


@dataclass(frozen=True)
class CaptureResult:
    entries: tuple[SnapshotEntry, ...]
    bytes_new: int
    bytes_total: int
    files_copied: int
    wait_ms: float  # waiting for Spark to commit the cut batch
    copy_ms: float  # listing, hashing and copying


@dataclass(frozen=True)
class PreparedRestore:
    stage: str
    epoch: int
    staging: str  # rel to storage root: the rebuilt checkpoint, not yet in place
    target: str  # rel to storage root: where it goes
    files: int
    bytes: int


class SnapshotStore:
    """Captures and restores stage checkpoints of one pipeline under ``storage`` (a FileSystem root)."""

    def __init__(self, storage: FileSystem, pipeline_id: str, store: EpochStore) -> None:
        self.fs = storage
        self.pipeline_id = pipeline_id
        self.store = store
        self._hash_cache: dict[tuple[str, int, int], str] = {}
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ capture

    def wait_for_commit(self, checkpoint: str, batch_id: int, *, timeout: float,
                        alive: Callable[[], bool] = lambda: True) -> float:
        """Wait until Spark wrote ``commits/<batch_id>``; returns the ms waited."""
        t0 = time.monotonic()
        if batch_id < 0:
            return 0.0
        path = f"{checkpoint}/commits/{batch_id}"
        deadline = t0 + timeout
        delay = 0.01
        while not self.fs.exists(path):
            if not alive():
                raise SnapshotError(f"the query stopped before committing batch {batch_id} ({path})", path=path)
            if time.monotonic() > deadline:
                raise SnapshotError(
                    f"Spark did not commit batch {batch_id} within {timeout:g}s ({path} missing)", path=path
                )
            time.sleep(delay)
            delay = min(delay * 2, 0.1)
        return (time.monotonic() - t0) * 1000

    def _list(self, checkpoint: str) -> list[pafs.FileInfo]:
        selector = pafs.FileSelector(self.fs.arrow_path(checkpoint), allow_not_found=True, recursive=True)
        return [i for i in self.fs.arrow_fs.get_file_info(selector) if i.type == pafs.FileType.File]

    def _hash(self, info: pafs.FileInfo) -> str:
        cache_key = (info.path, int(info.size or 0), int(info.mtime_ns or 0))
        with self._lock:
            cached = self._hash_cache.get(cache_key)
        if cached is not None:
            return cached
        h = hashlib.sha256()
        with self.fs.arrow_fs.open_input_stream(info.path) as f:
            while chunk := f.read(_CHUNK):
                h.update(chunk)
        key = object_key(h.hexdigest())
        with self._lock:
            self._hash_cache[cache_key] = key
        return key

    def capture(self, stage: str, epoch: int, checkpoint: str, batch_id: int, *, commit_timeout: float = 120.0,
                alive: Callable[[], bool] = lambda: True) -> CaptureResult:
        """Snapshot ``checkpoint`` (rel to the storage root) as of ``batch_id`` and record it for
        ``epoch``. Runs while later batches proceed; files Spark adds meanwhile are not selected."""
        wait_ms = self.wait_for_commit(checkpoint, batch_id, timeout=commit_timeout, alive=alive)
        t0 = time.monotonic()
        root = self.fs.arrow_path(checkpoint).rstrip("/")
        infos = {i.path[len(root) + 1:]: i for i in self._list(checkpoint)}

        def zip_refs(rel: str) -> list[str] | None:
            try:
                with self.fs.arrow_fs.open_input_stream(infos[rel].path) as f:
                    return rocksdb_zip_references(f.read())
            except (KeyError, zipfile.BadZipFile, json.JSONDecodeError, UnicodeDecodeError) as exc:
                log.warning("pipeline=%s epoch=%s stage=%s: cannot read RocksDB zip %s (%s); keeping every SST",
                            self.pipeline_id, epoch, stage, rel, exc)
                return None

        selected = select_checkpoint_files(infos, batch_id, zip_refs)
        entries: list[SnapshotEntry] = []
        try:
            for rel in selected:
                info = infos[rel]
                entries.append(SnapshotEntry(rel, self._hash(info), int(info.size or 0)))
        except FileNotFoundError as exc:
            raise SnapshotError(
                f"checkpoint file vanished while snapshotting epoch {epoch} of stage {stage!r}: {exc}; Spark deleted "
                "it (raise spark.sql.streaming.minBatchesToRetain)", epoch=epoch,
            ) from exc
        # Only the store says what is held: an object this process copied earlier may since have been
        # deleted by retention (if only a failed epoch referenced it), so no local memory of copies.
        known = self.store.known_objects(self.pipeline_id, {e.object_key for e in entries})
        bytes_new = 0
        copied = 0
        done: set[str] = set()
        for e in entries:
            if e.object_key in done:
                continue
            if e.object_key in known and self._object_present(e):
                done.add(e.object_key)
                continue
            self._copy_in(infos[e.rel_path], e, epoch, stage)
            done.add(e.object_key)
            bytes_new += e.bytes
            copied += 1
        self.store.record_snapshot(self.pipeline_id, epoch, stage, entries)
        unique = {e.object_key: e.bytes for e in entries}
        result = CaptureResult(
            entries=tuple(entries), bytes_new=bytes_new, bytes_total=sum(unique.values()), files_copied=copied,
            wait_ms=wait_ms, copy_ms=(time.monotonic() - t0) * 1000,
        )
        log.info("pipeline=%s epoch=%s stage=%s: snapshot of batch %s: %s files, %s new (%s bytes of %s)",
                 self.pipeline_id, epoch, stage, batch_id, len(entries), copied, bytes_new, result.bytes_total)
        return result

    def _object_present(self, entry: SnapshotEntry) -> bool:
        """A known object is referenced only if its file is really there: retention may have deleted an
        object that only a pruned (e.g. failed) epoch referenced while a later snapshot still saw its row."""
        try:
            return self.fs.size(object_path(self.pipeline_id, entry.object_key)) == entry.bytes
        except FileNotFoundError:
            return False

    def _copy_in(self, info: pafs.FileInfo, entry: SnapshotEntry, epoch: int, stage: str) -> None:
        """Copy one checkpoint file into its object, verifying that the content still hashes to the key."""
        final = object_path(self.pipeline_id, entry.object_key)
        tmp = f"{self.pipeline_id}/snapshots/tmp/{uuid.uuid4().hex}"
        h = hashlib.sha256()
        size = 0
        try:
            with self.fs.arrow_fs.open_input_stream(info.path) as src, self.fs.open_output(tmp) as dst:
                while chunk := src.read(_CHUNK):
                    h.update(chunk)
                    size += len(chunk)
                    dst.write(chunk)
        except FileNotFoundError as exc:
            self.fs.delete(tmp)
            raise SnapshotError(
                f"checkpoint file {entry.rel_path} of stage {stage!r} vanished while epoch {epoch} copied it; "
                "Spark deleted it (raise spark.sql.streaming.minBatchesToRetain)", epoch=epoch, path=entry.rel_path,
            ) from exc
        if object_key(h.hexdigest()) != entry.object_key or size != entry.bytes:
            self.fs.delete(tmp)
            raise SnapshotError(
                f"checkpoint file {entry.rel_path} of stage {stage!r} changed while epoch {epoch} copied it "
                "(Spark's checkpoint files should be immutable once written)", epoch=epoch, path=entry.rel_path,
            )
        self.fs.makedirs(posixpath.dirname(final))
        self.fs.arrow_fs.move(self.fs.arrow_path(tmp), self.fs.arrow_path(final))

    # ------------------------------------------------------------------ restore

    def prepare_restore(self, stage: str, epoch: int, target: str) -> PreparedRestore:
        """Rebuild ``stage``'s checkpoint of ``epoch`` into a staging folder next to ``target``,
        verifying every object. Nothing existing is touched."""
        entries = self.store.snapshot_entries(self.pipeline_id, epoch, stage)
        staging = f"{target}.restoring-{epoch}-{uuid.uuid4().hex[:8]}"
        total = 0
        try:
            self.fs.makedirs(staging)
            for e in entries:
                self._restore_one(e, epoch, stage, f"{staging}/{e.rel_path}")
                total += e.bytes
        except BaseException:
            self.fs.delete_tree(staging)  # our own half-built folder, never the old checkpoint
            raise
        return PreparedRestore(stage=stage, epoch=epoch, staging=staging, target=target, files=len(entries),
                               bytes=total)

    def _restore_one(self, e: SnapshotEntry, epoch: int, stage: str, dest: str) -> None:
        src = object_path(self.pipeline_id, e.object_key)
        where = f"{e.rel_path} of stage {stage!r} (object {self.fs.uri_of(src)})"
        try:
            h = hashlib.sha256()
            size = 0
            with self.fs.open_input(src) as f, self.fs.open_output(dest) as out:
                while chunk := f.read(_CHUNK):
                    h.update(chunk)
                    size += len(chunk)
                    out.write(chunk)
        except FileNotFoundError:
            raise SnapshotError(
                f"epoch {epoch} cannot be restored: file {where} is missing; nothing was changed, choose an "
                "earlier epoch (restore_from=<n>)", epoch=epoch, path=src,
            ) from None
        if size != e.bytes or object_key(h.hexdigest()) != e.object_key:
            raise SnapshotError(
                f"epoch {epoch} cannot be restored: file {where} is corrupt ({size} bytes, expected {e.bytes}; "
                "content does not match its SHA-256 name); nothing was changed, choose an earlier epoch",
                epoch=epoch, path=src,
            )

    def commit_restore(self, prepared: PreparedRestore) -> str | None:
        """Put a prepared checkpoint in place; the old one is moved aside (returned), not deleted.
        Older set-aside folders of the same stage are removed once the new one is in place."""
        aside: str | None = None
        arrow = self.fs.arrow_fs
        if self.fs.exists(prepared.target):
            aside = f"{prepared.target}.replaced-{time.strftime('%Y%m%dT%H%M%S')}-{uuid.uuid4().hex[:6]}"
            arrow.move(self.fs.arrow_path(prepared.target), self.fs.arrow_path(aside))
        arrow.move(self.fs.arrow_path(prepared.staging), self.fs.arrow_path(prepared.target))
        parent, name = posixpath.split(prepared.target)
        for entry in self.fs.list_dir(parent):
            if entry.is_dir and entry.name.startswith(f"{name}.replaced-") and entry.path != aside:
                self.fs.delete_tree(entry.path)
        return aside

    def discard(self, prepared: Sequence[PreparedRestore]) -> None:
        for p in prepared:
            self.fs.delete_tree(p.staging)
