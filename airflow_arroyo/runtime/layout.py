"""Where a pipeline keeps its files: the path rules (:class:`PipelinePaths`, pure), the checkpoint pointers
(:class:`CheckpointPointers`, their only reader and writer) and both roots as file systems (:class:`StorageLayout`).

Two roots, which may be the same URI (the default) or differ:

* the **storage URI** (channels, caps, snapshots): read and written with pyarrow / fsspec only, from
  the driver and the executors, so it may be any :class:`~airflow_arroyo.core.fs.FileSystem` URI
  (local, ``s3://``, ``gs://``, ``hdfs://``...);
* the **checkpoint URI** (Spark's own streaming checkpoints): written by Spark through a Hadoop
  filesystem and read by this package with pyarrow (snapshots copy from it, restores write into it),
  so it must be a URI both understand: a local or shared path, ``hdfs://``, or ``s3a://`` with the
  hadoop-aws jars (see ``docs/runtime.md``).

Paths below are relative to their root::

    storage URI
      <pipeline>/channels/<channel>/                   a channel (docs/channel-format.md)
      <pipeline>/stages/<stage>/caps-g<G>.json         the stage's read caps (alignment) of run generation G
      <pipeline>/snapshots/objects/sha256/ab/<sha256>  an immutable snapshot object, named by content
      <pipeline>/snapshots/objects/epochs/<n>/sha256/ab/<sha256>
                                                       an object private to self-contained epoch n
      <pipeline>/snapshots/tmp/<uuid>                  an object being copied in (local disks only)

    checkpoint URI
      <pipeline>/stages/<stage>/checkpoint.json        the pointer: {"current": <folder>, "previous": <folder>}
      <pipeline>/stages/<stage>/checkpoint             the first checkpoint folder (no pointer yet)
      <pipeline>/stages/<stage>/checkpoint-<epoch>-<id> a folder a restore rebuilt (epoch 0: a start over)

**No folder is ever renamed** (object stores cannot rename a folder; HDFS can, but one protocol for
all is simpler). A restore or a start over builds a *new* checkpoint folder next to the live one and
then rewrites the stage's pointer (one small file, written whole): that write is the commit point. The
folder the pointer named before stays as ``previous`` (kept for inspection) until the next switch; folders
the pointer names neither as current nor previous are leftovers of an interrupted restore, deleted at the
next start.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from airflow_arroyo.core.exceptions import ConfigurationError
from airflow_arroyo.core.fs import FileSystem

__all__ = [
    "CHECKPOINT_DIR",
    "SNAPSHOT_OBJECTS_DIR",
    "CheckpointPointers",
    "PipelinePaths",
    "StorageLayout",
    "epoch_object_key",
    "object_digest",
    "object_key",
    "object_path",
]

CHANNELS_DIR = "channels"
STAGES_DIR = "stages"
SNAPSHOTS_DIR = "snapshots"
SNAPSHOT_OBJECTS_DIR = f"{SNAPSHOTS_DIR}/objects"
SNAPSHOT_TMP_DIR = f"{SNAPSHOTS_DIR}/tmp"
CHECKPOINT_DIR = "checkpoint"  # the first checkpoint folder of a stage; later ones are CHECKPOINT_DIR-<...>
CHECKPOINT_POINTER = "checkpoint.json"
CAPS_FILE = "caps.json"
# later checkpoint folders; "checkpoint.restoring-" is what versions before the pointer left half-built
_GENERATIONS = (f"{CHECKPOINT_DIR}-", f"{CHECKPOINT_DIR}.restoring-")


def object_key(digest: str) -> str:
    """The object key of content with SHA-256 ``digest`` (relative to the objects folder)."""
    return f"sha256/{digest[:2]}/{digest}"


def epoch_object_key(epoch: int, digest: str) -> str:
    """The key of content with SHA-256 ``digest`` private to self-contained epoch ``epoch``: no other epoch
    references it (incremental snapshots name content by :func:`object_key`), so damage to a shared object
    cannot reach it, and retention deletes it with the epoch."""
    return f"epochs/{int(epoch)}/{object_key(digest)}"


def object_digest(key: str) -> str:
    """The SHA-256 an object's content must hash to (the last part of its key, shared or private)."""
    return key.rstrip("/").rsplit("/", 1)[-1]


def object_path(pipeline_id: str, key: str) -> str:
    """Path of a snapshot object below the pipeline's storage URI (what capture writes, restore reads and
    retention deletes). Refuses a key that is not a relative path below the objects folder."""
    key = key.strip("/")
    if not key or ".." in key.split("/"):
        raise ConfigurationError(f"snapshot object key {key!r} of pipeline {pipeline_id!r} is not a "
                                 "relative path below the snapshot root")
    return f"{pipeline_id}/{SNAPSHOT_OBJECTS_DIR}/{key}"


@dataclass(frozen=True)
class PipelinePaths:
    """Where each of a pipeline's files lives, relative to its root: the path rules, and nothing else (no I/O;
    pyiceberg's ``LocationProvider`` is the model). Storage-root paths and checkpoint-root paths are told apart
    in the names; a stage's folder has the same relative path below both roots."""

    pipeline_id: str

    # ------------------------------------------------------------------ storage root

    def channel(self, name: str) -> str:
        """Channel ``name``."""
        return f"{self.pipeline_id}/{CHANNELS_DIR}/{name}"

    def stage_dir(self, stage: str) -> str:
        """The stage's folder."""
        return f"{self.pipeline_id}/{STAGES_DIR}/{stage}"

    def caps(self, stage: str, generation: int = 0) -> str:
        """The stage's caps file; one per run generation (``caps-g<G>.json``), so that a superseded run still
        alive never moves the caps of the run that took over."""
        if not generation:
            return f"{self.stage_dir(stage)}/{CAPS_FILE}"
        stem, _, ext = CAPS_FILE.rpartition(".")
        return f"{self.stage_dir(stage)}/{stem}-g{generation}.{ext}"

    def object_path(self, key: str) -> str:
        """Snapshot object ``key``."""
        return object_path(self.pipeline_id, key)

    @property
    def snapshots_dir(self) -> str:
        """The pipeline's snapshot folder."""
        return f"{self.pipeline_id}/{SNAPSHOTS_DIR}"

    @property
    def snapshot_tmp_dir(self) -> str:
        """Where copies in progress wait (removed at start-up)."""
        return f"{self.pipeline_id}/{SNAPSHOT_TMP_DIR}"

    def snapshot_tmp(self) -> str:
        """A fresh temporary path for an object being copied in."""
        return f"{self.snapshot_tmp_dir}/{uuid.uuid4().hex}"

    # ------------------------------------------------------------------ checkpoint root

    def checkpoint_pointer(self, stage: str) -> str:
        """A stage's checkpoint pointer."""
        return f"{self.stage_dir(stage)}/{CHECKPOINT_POINTER}"

    def checkpoint_folder(self, stage: str, name: str = CHECKPOINT_DIR) -> str:
        """The checkpoint folder ``name`` of ``stage`` (the first one by default)."""
        return f"{self.stage_dir(stage)}/{name}"

    def new_checkpoint(self, stage: str, epoch: int) -> str:
        """A fresh, unused checkpoint folder for ``stage`` rebuilt from ``epoch`` (0: empty)."""
        stamp = time.strftime("%Y%m%dT%H%M%S")
        return self.checkpoint_folder(stage, f"{CHECKPOINT_DIR}-{epoch}-{stamp}-{uuid.uuid4().hex[:8]}")


class CheckpointPointers:
    """The stages' checkpoint pointers, read and written here only: which folder is live, the switch that is a
    restore's commit point, and the folders an interrupted restore left."""

    def __init__(self, fs: FileSystem, paths: PipelinePaths) -> None:
        self.fs = fs
        self.paths = paths

    def read(self, stage: str) -> dict[str, str]:
        """The pointer of ``stage`` (``{}`` before the first switch)."""
        path = self.paths.checkpoint_pointer(stage)
        try:
            value = self.fs.read_json(path)
        except FileNotFoundError:
            return {}
        if not isinstance(value, dict) or not isinstance(value.get("current"), str):
            raise ConfigurationError(
                f"{self.fs.uri_of(path)} is not a checkpoint pointer "
                '({"current": <folder>, ...}); restore the file or delete the stage folder to start over'
            )
        return {k: v for k, v in value.items() if isinstance(v, str)}

    def current(self, stage: str) -> str:
        """The stage's live checkpoint folder (what its pointer names; the first folder without one)."""
        return self.paths.checkpoint_folder(stage, self.read(stage).get("current", CHECKPOINT_DIR))

    def switch(self, stage: str, folder: str) -> str | None:
        """Make ``folder`` (from :meth:`PipelinePaths.new_checkpoint`) the live checkpoint: the commit point of
        a restore. Returns the folder that was live before (kept as ``previous``); deletes the one that was
        ``previous`` until now."""
        prefix = f"{self.paths.stage_dir(stage)}/"
        if not folder.startswith(prefix) or "/" in folder[len(prefix):]:
            raise ConfigurationError(f"{folder!r} is not a checkpoint folder of stage {stage!r}")
        before = self.read(stage)
        old = self.current(stage)
        live_before = old if self.fs.exists(old) else None
        pointer = {"current": folder[len(prefix):]}
        if live_before is not None:
            pointer["previous"] = live_before[len(prefix):]
        self.fs.write_json_atomic(self.paths.checkpoint_pointer(stage), pointer)
        dropped = before.get("previous")
        if dropped and dropped not in pointer.values():
            self.fs.delete_tree(f"{prefix}{dropped}")
        return live_before

    def strays(self, stage: str) -> list[str]:
        """Checkpoint folders the pointer names neither as current nor as previous: what an interrupted
        restore left (never the live folder, never the one kept for inspection)."""
        named = set(self.read(stage).values()) or {CHECKPOINT_DIR}
        return [e.path for e in self.fs.list_dir(self.paths.stage_dir(stage))
                if e.is_dir and (e.name == CHECKPOINT_DIR or e.name.startswith(_GENERATIONS))
                and e.name not in named]


@dataclass(frozen=True)
class StorageLayout:
    """A pipeline's two roots as file systems, resolved once per run (:meth:`at`), with its path rules
    (:class:`PipelinePaths`) and checkpoint pointers (:class:`CheckpointPointers`).

    ``fs`` is the storage root (channels, caps, snapshots), ``checkpoint_fs`` the root of Spark's
    checkpoints (the storage root unless given). Methods return paths relative to their root, and
    ``*_uri`` methods full URIs.
    """

    fs: FileSystem
    pipeline_id: str
    checkpoint_fs: FileSystem = field(default=None)  # type: ignore[assignment]  # set in __post_init__
    paths: PipelinePaths = field(init=False, repr=False, compare=False)
    pointers: CheckpointPointers = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.checkpoint_fs is None:
            object.__setattr__(self, "checkpoint_fs", self.fs)
        object.__setattr__(self, "paths", PipelinePaths(self.pipeline_id))
        object.__setattr__(self, "pointers", CheckpointPointers(self.checkpoint_fs, self.paths))

    @classmethod
    def at(cls, storage_uri: str, pipeline_id: str, checkpoint_uri: str | None = None) -> StorageLayout:
        """The layout of ``pipeline_id`` under ``storage_uri`` (checkpoints under ``checkpoint_uri`` if given)."""
        fs = FileSystem.from_uri(storage_uri)
        checkpoints = FileSystem.from_uri(checkpoint_uri) if checkpoint_uri else fs
        return cls(fs, pipeline_id, checkpoints)

    # ------------------------------------------------------------------ storage URI

    def channel(self, name: str) -> str:
        """The path of channel ``name``, relative to the storage root."""
        return self.paths.channel(name)

    def channel_uri(self, name: str) -> str:
        """The URI of channel ``name`` (for another process; this one opens :meth:`channel_fs`)."""
        return self.fs.uri_of(self.paths.channel(name))

    def channel_fs(self, name: str) -> FileSystem:
        """The folder of channel ``name`` as a file system sharing the storage root's backend."""
        return self.fs.child(self.paths.channel(name))

    def stage_dir(self, stage: str) -> str:
        """The stage's folder (the same relative path below both roots)."""
        return self.paths.stage_dir(stage)

    def caps(self, stage: str, generation: int = 0) -> str:
        """The stage's caps file for run generation ``generation``, relative to the storage root."""
        return self.paths.caps(stage, generation)

    def caps_uri(self, stage: str, generation: int = 0) -> str:
        """The URI of a stage's caps file for run generation ``generation``."""
        return self.fs.uri_of(self.paths.caps(stage, generation))

    def object_path(self, key: str) -> str:
        """The path of snapshot object ``key``, relative to the storage root."""
        return self.paths.object_path(key)

    @property
    def snapshots_dir(self) -> str:
        """The pipeline's snapshot folder, relative to the storage root."""
        return self.paths.snapshots_dir

    @property
    def snapshot_tmp_dir(self) -> str:
        """Where copies in progress wait (removed at start-up), relative to the storage root."""
        return self.paths.snapshot_tmp_dir

    def snapshot_tmp(self) -> str:
        """A fresh temporary path for an object being copied in."""
        return self.paths.snapshot_tmp()

    # ------------------------------------------------------------------ checkpoint URI

    def checkpoint_pointer(self, stage: str) -> str:
        """The path of a stage's checkpoint pointer, relative to the checkpoint root."""
        return self.paths.checkpoint_pointer(stage)

    def checkpoint(self, stage: str) -> str:
        """The stage's live checkpoint folder (what its pointer names; the first folder without one)."""
        return self.pointers.current(stage)

    def checkpoint_uri(self, stage: str) -> str:
        """The live checkpoint as Spark spells its URI (``checkpointLocation``)."""
        return self.checkpoint_fs.spark_uri_of(self.pointers.current(stage))

    def new_checkpoint(self, stage: str, epoch: int) -> str:
        """A fresh, unused checkpoint folder for ``stage`` rebuilt from ``epoch`` (0: empty)."""
        return self.paths.new_checkpoint(stage, epoch)

    def switch_checkpoint(self, stage: str, folder: str) -> str | None:
        """Make ``folder`` the live checkpoint: the commit point of a restore (:meth:`CheckpointPointers.switch`)."""
        return self.pointers.switch(stage, folder)

    def stray_checkpoints(self, stage: str) -> list[str]:
        """What an interrupted restore left (:meth:`CheckpointPointers.strays`)."""
        return self.pointers.strays(stage)
