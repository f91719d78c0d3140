"""Snapshots of Spark checkpoints: incremental, content-addressed capture and verified restore.

A stage's snapshot for epoch *n* is its Spark checkpoint **as of the cut batch b**: ``metadata``,
``offsets/<= b``, ``commits/<= b``, source logs up to b and the state store files needed to load
state version ``b + 1`` (the version batch b committed), for both state store providers:

* default (HDFS-backed): a ``V.snapshot`` at or below b+1 and the ``V.delta`` files after it: the newest
  snapshot the pipeline already holds (or none), so that a full snapshot Spark's maintenance wrote is not
  copied while the deltas it summarises are still there to chain (``max_delta_chain`` bounds the chain);
  the newest snapshot when Spark deleted part of the chain, and for self-contained epochs;
* RocksDB: the newest ``V.zip`` at or below b+1 (plus ``V.changelog`` files after it when changelog
  checkpointing is on) and the ``SSTs/`` / ``logs/`` files that zip references.

Every file is stored once as an immutable **object** named by the SHA-256 of its content
(``<storage>/<pipeline>/snapshots/objects/sha256/ab/abcdef...``). A **self-contained** epoch (asked for
when it is started: ``airflow-arroyo checkpoint --self-contained``) copies every file under keys private to
it (``objects/epochs/<n>/sha256/...``): it shares no object with any other epoch, so damage to a shared
object cannot make it unrestorable, and retention deletes its objects exactly when it prunes the epoch.
Spark rewrites ``N.delta`` and ``N.zip`` under the same names with new content after a restore, so names
alone would share the wrong file; content addresses cannot. A file whose object the pipeline already holds
(any retained epoch) is referenced, not copied: ``bytes_new`` is what this epoch added, ``bytes_total``
what it references.
Hashes are cached by (path, size, mtime) so unchanged files are not even re-read.

Before a snapshot is recorded, and again before a restore copies anything, its files are checked against
Spark's rules for a checkpoint it restarts from
(:func:`~airflow_arroyo.runtime.spark_checkpoint.check_restorable`): an epoch whose checkpoint Spark would
refuse never completes, and one recorded before the check is refused by
:class:`~airflow_arroyo.core.exceptions.UnrestorableEpochError` before anything changed.
Restore rebuilds a checkpoint folder from an epoch's entries into a fresh folder, verifying every
object's size and hash in the one read that copies it (:class:`~airflow_arroyo.core.exceptions.SnapshotError`
names the epoch and the file; nothing is deleted); where objects and checkpoints share a local file system
each object is hard-linked instead of copied and read once to verify it. Only then it points the stage at
it by rewriting its checkpoint pointer (:meth:`~airflow_arroyo.runtime.layout.StorageLayout.switch_checkpoint`):
no folder is renamed, so restore works the same on local disks, HDFS and object stores.

Objects live below the storage URI, checkpoints below the checkpoint URI (the same one unless given):
capture reads the checkpoint and writes objects, restore reads objects and writes a checkpoint folder.
An object is published only once its content hashed to its name: on a local disk it is written to a
temporary file and renamed (one file); on an object store it is hashed through a local spool file and
then put in one request (an object appears whole or not at all). Which files of a checkpoint make up
its state is :mod:`~airflow_arroyo.runtime.spark_checkpoint`'s business; where objects live is
:mod:`~airflow_arroyo.runtime.layout`'s.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import shutil
import tempfile
import threading
import time
import zipfile
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass

import pyarrow.fs as pafs

from airflow_arroyo.core.exceptions import ConfigurationError, SnapshotError, UnrestorableEpochError
from airflow_arroyo.core.fs import FileSystem
from airflow_arroyo.runtime.layout import StorageLayout, epoch_object_key, object_digest, object_key, object_path
from airflow_arroyo.runtime.spark_checkpoint import (
    check_restorable,
    commit_path,
    rocksdb_zip_references,
    select_checkpoint_files,
    snapshot_files,
)
from airflow_arroyo.store import EpochStore, FencingToken, SnapshotEntry

__all__ = [
    "CaptureResult",
    "PreparedRestore",
    "SnapshotStore",
]

log = logging.getLogger(__name__)

_CHUNK = 1 << 20
#: Objects a restore copies at once (SnapshotStore.restore_workers).
RESTORE_WORKERS = 8
_LINKED, _REUSED, _COPIED = "linked", "reused", "copied"  # how a restore placed a file (_restore_one)
_SPOOL_IN_MEMORY = 8 << 20  # objects up to this size are hashed in memory before an object-store put


@dataclass(frozen=True)
class CaptureResult:
    """What one snapshot of a stage recorded: its entries and the bytes copied and referenced."""
    entries: tuple[SnapshotEntry, ...]
    bytes_new: int
    bytes_total: int
    files_copied: int
    wait_ms: float  # waiting for Spark to commit the cut batch
    copy_ms: float  # listing, hashing and copying


@dataclass(frozen=True)
class PreparedRestore:
    """A stage's checkpoint rebuilt from an epoch's snapshot, verified, not yet switched to."""
    stage: str
    epoch: int
    folder: str  # rel to the checkpoint root: the rebuilt checkpoint, not yet live
    files: int
    bytes: int
    linked: int = 0  # files hard-linked to their objects
    reused: int = 0  # files the live checkpoint still held, hard-linked from there (the rest copied)
    seconds: float = 0.0  # rebuilding and verifying


class SnapshotStore:
    """Captures and restores stage checkpoints of one pipeline: objects below ``storage``, checkpoints
    below ``checkpoints`` (``storage`` unless given), laid out by :class:`StorageLayout`."""

    def __init__(self, storage: FileSystem, pipeline_id: str, store: EpochStore, *,
                 checkpoints: FileSystem | None = None, max_delta_chain: int | None = None) -> None:
        self.fs = storage
        self.layout = StorageLayout(storage, pipeline_id, checkpoints or storage)
        self.checkpoint_fs = self.layout.checkpoint_fs
        self.pipeline_id = pipeline_id
        self.store = store
        # the run's fencing token: recording a snapshot is refused once a newer run registered (objects are
        # content-addressed, so what a superseded run copied is at worst an object nobody references)
        self.token: FencingToken | None = None
        self._hash_cache: dict[tuple[str, int, int], str] = {}
        self._lock = threading.Lock()
        # at most this many deltas after a held snapshot before a newer snapshot is copied (restore reads the
        # chain); None: as far back as Spark keeps deltas (spark.sql.streaming.minBatchesToRetain)
        if max_delta_chain is not None and max_delta_chain < 0:
            raise ConfigurationError(f"max_delta_chain must be a number of deltas >= 0 (0: always copy the newest "
                                     f"snapshot) or None (no bound but Spark's cleanup), got {max_delta_chain!r}")
        self.max_delta_chain = max_delta_chain
        # objects a restore copies at once: on object storage each is a few requests whose latency dominates
        # (benchmarks/restore_s3.py); 1 copies one after the other
        self.restore_workers = RESTORE_WORKERS
        # objects and checkpoints on one local file system: a restore hard-links each object into the new
        # checkpoint instead of copying it (both names then share the file: nothing writes checkpoint files in
        # place, see _link); False copies
        self.link_objects = True
        # where objects are on remote storage (S3) and checkpoints on a local disk, a restore
        # takes each file the stage's live checkpoint still holds with the object's bytes from there instead
        # (Flink's local recovery: a restart on the same machine downloads only what changed); False always copies
        self.reuse_live_files = True

    # ------------------------------------------------------------------ capture

    def wait_for_commit(self, checkpoint: str, batch_id: int, *, timeout: float,
                        alive: Callable[[], bool] = lambda: True) -> float:
        """Wait until Spark wrote ``commits/<batch_id>``; returns the ms waited."""
        t0 = time.monotonic()
        if batch_id < 0:
            return 0.0
        path = commit_path(checkpoint, batch_id)
        deadline = t0 + timeout
        delay = 0.01
        while not self.checkpoint_fs.exists(path):
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
        selector = pafs.FileSelector(self.checkpoint_fs.arrow_path(checkpoint), allow_not_found=True, recursive=True)
        return [i for i in self.checkpoint_fs.arrow_fs.get_file_info(selector) if i.type == pafs.FileType.File]

    def _hash(self, info: pafs.FileInfo) -> str:
        cache_key = (info.path, int(info.size or 0), int(info.mtime_ns or 0))
        with self._lock:
            cached = self._hash_cache.get(cache_key)
        if cached is not None:
            return cached
        h = hashlib.sha256()
        with self.checkpoint_fs.arrow_fs.open_input_stream(info.path) as f:
            while chunk := f.read(_CHUNK):
                h.update(chunk)
        key = object_key(h.hexdigest())
        with self._lock:
            self._hash_cache[cache_key] = key
        return key

    def _forget_hashes(self, root: str, present: Iterable[pafs.FileInfo]) -> None:
        """Drop the hashes of files below ``root`` that are gone or changed: Spark writes new checkpoint files every
        batch and deletes old ones, so a memo of every file ever hashed would grow for as long as the driver runs."""
        keep = {(i.path, int(i.size or 0), int(i.mtime_ns or 0)) for i in present}
        prefix = root + "/"
        with self._lock:
            for key in [k for k in self._hash_cache if k[0].startswith(prefix) and k not in keep]:
                del self._hash_cache[key]

    def capture(self, stage: str, epoch: int, checkpoint: str, batch_id: int, *, commit_timeout: float = 120.0,
                alive: Callable[[], bool] = lambda: True, self_contained: bool = False) -> CaptureResult:
        """Snapshot ``checkpoint`` (rel to the storage root) as of ``batch_id`` and record it for
        ``epoch``. Runs while later batches proceed; files Spark adds meanwhile are not selected.
        ``self_contained``: copy every file under keys private to ``epoch`` (no object shared)."""
        wait_ms = self.wait_for_commit(checkpoint, batch_id, timeout=commit_timeout, alive=alive)
        t0 = time.monotonic()
        root = self.checkpoint_fs.arrow_path(checkpoint).rstrip("/")
        infos = {i.path[len(root) + 1:]: i for i in self._list(checkpoint)}
        self._forget_hashes(root, infos.values())

        def zip_refs(rel: str) -> list[str] | None:
            try:
                with self.checkpoint_fs.arrow_fs.open_input_stream(infos[rel].path) as f:
                    return rocksdb_zip_references(f.read())
            except (KeyError, zipfile.BadZipFile, json.JSONDecodeError, UnicodeDecodeError) as exc:
                log.warning("pipeline=%s epoch=%s stage=%s: cannot read RocksDB zip %s (%s); keeping every SST",
                            self.pipeline_id, epoch, stage, rel, exc)
                return None

        entries: list[SnapshotEntry] = []
        try:
            held = None if self_contained else self._held_snapshots(infos, batch_id)
            selected = select_checkpoint_files(infos, batch_id, zip_refs, held_bases=held,
                                               max_chain=self.max_delta_chain)
            problems = check_restorable(selected)
            if problems:  # an epoch that completed with it could never be restored
                raise SnapshotError(
                    f"the snapshot of stage {stage!r} as of batch {batch_id} for epoch {epoch} would not be a "
                    f"checkpoint Spark can restart from: {'; '.join(problems)}", epoch=epoch)
            for rel in selected:
                info = infos[rel]
                key = self._hash(info)
                if self_contained:
                    key = epoch_object_key(epoch, object_digest(key))
                entries.append(SnapshotEntry(rel, key, int(info.size or 0)))
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
        self.store.record_snapshot(self.pipeline_id, epoch, stage, entries, token=self.token)
        unique = {e.object_key: e.bytes for e in entries}
        result = CaptureResult(
            entries=tuple(entries), bytes_new=bytes_new, bytes_total=sum(unique.values()), files_copied=copied,
            wait_ms=wait_ms, copy_ms=(time.monotonic() - t0) * 1000,
        )
        log.info("pipeline=%s epoch=%s stage=%s: snapshot of batch %s: %s files, %s new (%s bytes of %s)",
                 self.pipeline_id, epoch, stage, batch_id, len(entries), copied, bytes_new, result.bytes_total)
        return result

    def _held_snapshots(self, infos: dict[str, pafs.FileInfo], batch_id: int) -> Callable[[str], bool]:
        """Which of the checkpoint's ``V.snapshot`` files the pipeline already holds (a retained epoch references
        the object and its file is there). Hashes each snapshot file once (cached); copies nothing."""
        keys: dict[str, SnapshotEntry] = {}
        for rel in snapshot_files(infos, batch_id):
            try:
                keys[rel] = SnapshotEntry(rel, self._hash(infos[rel]), int(infos[rel].size or 0))
            except FileNotFoundError:
                continue  # Spark's cleanup deleted it meanwhile: not a base any more
        known = self.store.known_objects(self.pipeline_id, {e.object_key for e in keys.values()})
        held = {rel for rel, e in keys.items() if e.object_key in known and self._object_present(e)}
        return held.__contains__

    def _object_present(self, entry: SnapshotEntry) -> bool:
        """A known object is referenced only if its file is really there: retention may have deleted an
        object that only a pruned (e.g. failed) epoch referenced while a later snapshot still saw its row."""
        try:
            return self.fs.size(object_path(self.pipeline_id, entry.object_key)) == entry.bytes
        except FileNotFoundError:
            return False

    def _copy_in(self, info: pafs.FileInfo, entry: SnapshotEntry, epoch: int, stage: str) -> None:
        """Copy one checkpoint file into its object, publishing it only if its content still hashes to the key
        (local disks: a temporary file renamed into place; object stores: a local spool, then one put)."""
        final = object_path(self.pipeline_id, entry.object_key)
        local = self.fs.is_local
        tmp = self.layout.snapshot_tmp()
        h = hashlib.sha256()
        size = 0
        with tempfile.SpooledTemporaryFile(max_size=_SPOOL_IN_MEMORY) as spool:
            try:
                with self.checkpoint_fs.arrow_fs.open_input_stream(info.path) as src, \
                        (self.fs.open_output(tmp) if local else contextlib.nullcontext(spool)) as dst:
                    while chunk := src.read(_CHUNK):
                        h.update(chunk)
                        size += len(chunk)
                        dst.write(chunk)
            except FileNotFoundError as exc:
                if local:
                    self.fs.delete(tmp)
                raise SnapshotError(
                    f"checkpoint file {entry.rel_path} of stage {stage!r} vanished while epoch {epoch} copied it; "
                    "Spark deleted it (raise spark.sql.streaming.minBatchesToRetain)", epoch=epoch,
                    path=entry.rel_path,
                ) from exc
            if h.hexdigest() != object_digest(entry.object_key) or size != entry.bytes:
                if local:
                    self.fs.delete(tmp)
                raise SnapshotError(
                    f"checkpoint file {entry.rel_path} of stage {stage!r} changed while epoch {epoch} copied it "
                    "(Spark's checkpoint files should be immutable once written)", epoch=epoch, path=entry.rel_path,
                )
            if local:
                self.fs.move(tmp, final)  # one file, same folder tree: a rename
                return
            spool.seek(0)
            with self.fs.open_output(final) as out:
                shutil.copyfileobj(spool, out, _CHUNK)

    # ------------------------------------------------------------------ restore

    def prepare_restore(self, stage: str, epoch: int, *, source: tuple[FileSystem, str] | None = None,
                        snapshot_stage: str | None = None) -> PreparedRestore:
        """Rebuild ``stage``'s checkpoint of ``epoch`` into a new checkpoint folder, verifying every object.
        Nothing existing is touched; :meth:`commit_restore` makes the folder live.

        ``source``: the storage root and id of the pipeline whose epoch it is, when not this one (a fork's
        first restore reads its source's snapshot objects where they are; nothing is copied to this
        pipeline's objects). ``snapshot_stage``: the epoch's stage whose snapshot it is, when renamed since."""
        return self.rebuild(stage, epoch, self.layout.new_checkpoint(stage, epoch), source=source,
                            snapshot_stage=snapshot_stage)

    def rebuild(self, stage: str, epoch: int, folder: str, *, source: tuple[FileSystem, str] | None = None,
                snapshot_stage: str | None = None) -> PreparedRestore:
        """Rebuild ``stage``'s checkpoint of ``epoch`` into ``folder`` (a new folder, relative to the checkpoint
        root), verifying every object; the objects are only read. :meth:`prepare_restore` rebuilds beside the live
        checkpoint; a state read (:mod:`airflow_arroyo.core.state`) into a scratch folder of its own."""
        storage, owner = source if source is not None else (self.fs, self.pipeline_id)
        entries = self.store.snapshot_entries(owner, epoch, snapshot_stage or stage)
        problems = check_restorable(e.rel_path for e in entries)
        if problems:
            raise UnrestorableEpochError(
                f"epoch {epoch} cannot be restored: its snapshot of stage {stage!r} is not a checkpoint Spark can "
                f"restart from ({'; '.join(problems)}); nothing was changed", epoch=epoch, stage=stage,
                problems=tuple(problems))
        if self.checkpoint_fs.list_dir(folder):  # a failed rebuild deletes its folder: never one with others' files
            raise SnapshotError(
                f"epoch {epoch} was not restored: the folder {self.checkpoint_fs.uri_of(folder)} for the rebuilt "
                f"checkpoint of stage {stage!r} already holds files, and a rebuild only fills a new, empty folder; "
                "nothing was changed: rebuild into a new folder (a restore names one itself), or delete this one if "
                "nothing uses it", epoch=epoch, path=folder)
        t0 = time.monotonic()
        live = self._live_folder(snapshot_stage or stage) if (
            self.reuse_live_files and not storage.is_local and self.checkpoint_fs.is_local) else None
        try:
            self.checkpoint_fs.makedirs(folder)
            kinds = self._restore_all(entries, epoch, stage, folder, storage, owner, None if live == folder else live)
        except BaseException:
            self.checkpoint_fs.delete_tree(folder)  # our own half-built folder, never the live checkpoint
            raise
        took = time.monotonic() - t0
        linked, reused = kinds.count(_LINKED), kinds.count(_REUSED)
        log.info("pipeline=%s epoch=%s stage=%s: checkpoint rebuilt and verified in %.2fs: %d files (%d linked, "
                 "%d reused from the live checkpoint, %d copied), %d bytes", self.pipeline_id, epoch, stage, took,
                 len(entries), linked, reused, len(entries) - linked - reused, sum(e.bytes for e in entries))
        return PreparedRestore(stage=stage, epoch=epoch, folder=folder, files=len(entries),
                               bytes=sum(e.bytes for e in entries), linked=linked, reused=reused, seconds=took)

    def _restore_all(self, entries: Sequence[SnapshotEntry], epoch: int, stage: str, folder: str,
                     storage: FileSystem, owner: str, live: str | None) -> list[str]:
        """Link, reuse or copy, and verify, every entry into ``folder``, up to :attr:`restore_workers` at once;
        returns how each was placed. The first failure is raised once the copies under way have ended (the caller
        deletes the folder)."""
        workers = max(1, min(self.restore_workers, len(entries)))
        if workers == 1:
            return [self._restore_one(e, epoch, stage, f"{folder}/{e.rel_path}", storage, owner, live)
                    for e in entries]
        with ThreadPoolExecutor(workers, thread_name_prefix=f"arroyo-restore-{stage}") as pool:
            futures = [pool.submit(self._restore_one, e, epoch, stage, f"{folder}/{e.rel_path}", storage, owner, live)
                       for e in entries]
            wait(futures, return_when=FIRST_EXCEPTION)
            errors = [exc for f in futures if f.done() and not f.cancelled() and (exc := f.exception()) is not None]
            if errors:
                for f in futures:
                    f.cancel()
                wait(futures)  # no copy may still write into the folder the caller is about to delete
                raise errors[0]
            return [f.result() for f in futures]

    def _link(self, storage: FileSystem, src: str, dest: str) -> bool:
        """Hard-link the object ``src`` as the checkpoint file ``dest`` when both are on one local file system;
        False where that cannot be (another file system or device, no hard links): the caller copies.

        Safe because neither side writes a file in place: objects are immutable once published, and Spark replaces
        a checkpoint file only by writing a new file and renaming it over the old name (its checkpoint file
        managers' ``createAtomic``), deletes by unlinking, and RocksDB never writes into an SST file it has
        closed; the provider's own rewrites of a rebuilt checkpoint (fusion, rescale) replace files the same way.
        ``tests/runtime/test_snapshot.py`` checks the objects' bytes after a restored query ran."""
        if not (self.link_objects and storage.is_local and self.checkpoint_fs.is_local):
            return False
        target = self.checkpoint_fs.arrow_path(dest)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        try:
            os.link(storage.arrow_path(src), target)
        except OSError as exc:  # a missing object (ENOENT) is the caller's error to report
            if exc.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP, errno.EOPNOTSUPP):
                raise
            return False
        return True

    def _what_is_at(self, dest: str, storage: FileSystem, src: str) -> str:
        """What a link found already at the checkpoint path ``dest`` (both sides are local files then)."""
        target = self.checkpoint_fs.arrow_path(dest)
        try:
            if os.path.samefile(target, storage.arrow_path(src)):
                return "a link to the same object"
            return f"another file ({os.path.getsize(target)} bytes)"
        except OSError:
            return "a file"

    def _live_folder(self, stage: str) -> str | None:
        """The stage's live checkpoint folder, or None where its pointer cannot be read (reuse is only a shortcut:
        the restore then downloads, and the switch reports the pointer)."""
        try:
            return self.layout.checkpoint(stage)
        except (ConfigurationError, ValueError, OSError) as exc:
            log.info("pipeline=%s stage=%s: the live checkpoint's pointer was not read (%s); every object is read "
                     "from storage", self.pipeline_id, stage, exc)
            return None

    def _reuse_live(self, e: SnapshotEntry, live: str, dest: str) -> bool:
        """Hard-link the live checkpoint's file of ``e`` as ``dest`` when it holds the object's bytes, verified
        through the link (which keeps the inode it named, whatever later replaces that name: nothing writes
        checkpoint files in place, see :meth:`_link`); False leaves ``dest`` absent for a copy from storage."""
        src = self.checkpoint_fs.arrow_path(f"{live}/{e.rel_path}")
        target = self.checkpoint_fs.arrow_path(dest)
        try:
            if os.path.getsize(src) != e.bytes:
                return False
            os.makedirs(os.path.dirname(target), exist_ok=True)
            os.link(src, target)
        except FileExistsError:
            raise  # rebuild checked the folder was empty: reported by the caller as a writer in the folder
        except OSError:  # gone since (Spark's cleanup), or no hard links here: copied from storage
            return False
        h = hashlib.sha256()
        try:
            with open(target, "rb") as f:
                while chunk := f.read(_CHUNK):
                    h.update(chunk)
        except OSError:  # a bad block in the live file: the object is the copy to read
            pass
        else:
            if h.hexdigest() == object_digest(e.object_key):
                return True
        with contextlib.suppress(FileNotFoundError):
            os.unlink(target)
        return False

    def _restore_one(self, e: SnapshotEntry, epoch: int, stage: str, dest: str, storage: FileSystem,
                     owner: str, live: str | None) -> str:
        """Reuse the live checkpoint's file (:meth:`_reuse_live`), link (:meth:`_link`) or copy one object into the
        checkpoint and verify its size and SHA-256 in the same read (a link is verified by reading the shared file
        once); returns which it did."""
        src = object_path(owner, e.object_key)
        where = f"{e.rel_path} of stage {stage!r} (object {storage.uri_of(src)})"
        linked = False
        try:
            if live is not None and self._reuse_live(e, live, dest):
                return _REUSED
            h = hashlib.sha256()
            size = 0
            linked = self._link(storage, src, dest)
            if linked:
                with storage.open_input(src) as f:
                    while chunk := f.read(_CHUNK):
                        h.update(chunk)
                        size += len(chunk)
            else:
                with storage.open_input(src) as f, self.checkpoint_fs.open_output(dest) as out:
                    while chunk := f.read(_CHUNK):
                        h.update(chunk)
                        size += len(chunk)
                        out.write(chunk)
        except FileNotFoundError:
            raise SnapshotError(
                f"epoch {epoch} cannot be restored: file {where} is missing; nothing was changed, choose an "
                "earlier epoch (restore_from=<n>)", epoch=epoch, path=src,
            ) from None
        except FileExistsError:  # only a link meets one: rebuild checked the folder was empty, so a writer is in it
            raise SnapshotError(
                f"epoch {epoch} was not restored: {self._what_is_at(dest, storage, src)} appeared at "
                f"{self.checkpoint_fs.uri_of(dest)} while stage {stage!r}'s checkpoint was being rebuilt there, so "
                "something else writes into that folder (another restore into the same folder?); the live "
                "checkpoint was not changed and the epoch is not known to be damaged: make sure one process "
                "restores this pipeline, then retry", epoch=epoch, path=dest,
            ) from None
        except OSError as exc:  # refused, timed out, denied: says nothing about the epoch itself
            raise SnapshotError(
                f"epoch {epoch} could not be restored: storage was unreachable reading file {where} "
                f"({type(exc).__name__}: {exc}); nothing was changed and the epoch is not known to be damaged: "
                "retry the same restore once the storage is reachable", epoch=epoch, path=src,
            ) from exc
        if size != e.bytes or h.hexdigest() != object_digest(e.object_key):
            raise SnapshotError(
                f"epoch {epoch} cannot be restored: file {where} is corrupt ({size} bytes, expected {e.bytes}; "
                "content does not match its SHA-256 name); nothing was changed, choose an earlier epoch",
                epoch=epoch, path=src,
            )
        return _LINKED if linked else _COPIED

    def commit_restore(self, prepared: PreparedRestore) -> str | None:
        """Make a prepared checkpoint live by rewriting the stage's checkpoint pointer (the commit point; no
        folder is renamed). Returns the folder that was live before, kept until the next switch."""
        return self.layout.switch_checkpoint(prepared.stage, prepared.folder)

    def discard(self, prepared: Sequence[PreparedRestore]) -> None:
        """Delete rebuilt checkpoints that will not be switched to."""
        for p in prepared:
            self.checkpoint_fs.delete_tree(p.folder)

