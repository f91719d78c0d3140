"""Restore across a change of fusion: a fused query's checkpoint split into its stages' queries
(:func:`split_checkpoint`), or stages' checkpoints merged into the query that fuses them (:func:`merge_checkpoint`,
renumbered: see there).

An epoch taken with stages fused holds one Spark checkpoint for the fused query (docs/upgrading.md, "Across a
change of fusion"). When the new code runs those stages as several queries, each new query starts from a copy of
that checkpoint (rebuilt from the epoch's objects into a new folder of this run, before the restore's commit
point; the objects are only read), made into its own:

* ``state/`` stays only in the query holding the fused query's stateful stage: the fusion rules keep every other
  member stateless, so that stage's operators keep their ids (Spark numbers a query's stateful operators in plan
  order) and their versions (the new query keeps the fused query's batch ids);
* a query that now reads a channel instead of the source gets, in each ``offsets/<b>``, the channel's offset at
  position 0 in place of the source's line (the channel is new and starts empty at the cut: a fused query cuts
  at one micro-batch boundary, so nothing was between its members), and loses the source's ``sources/`` log;
* each query gets a query id of its own (``metadata``): Spark refuses to run two queries with the same id.

In a split, batch ids are kept, so each new query resumes at the fused query's next batch, and a sink's batch ids
continue where the fused query's stopped. The format is Spark's (:mod:`~airflow_arroyo.runtime.spark_checkpoint`).
"""

from __future__ import annotations

import json
import posixpath
import re
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING

from airflow_arroyo.core.exceptions import ConfigurationError
from airflow_arroyo.core.fs import FileSystem

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

__all__ = ["empty_delta_file", "merge_checkpoint", "split_checkpoint"]


def split_checkpoint(fs: FileSystem, folder: str, *, stage: str, keep_state: bool, channel_input: str | None) -> int:
    """Make ``folder`` (a rebuilt copy of a fused query's checkpoint, this run's own) the checkpoint of ``stage``,
    one of the queries it splits into; ``channel_input``: the channel it now reads (None: it reads the source).
    Returns the number of offset log entries rewritten."""
    if not keep_state:
        fs.delete_tree(FileSystem.join(folder, "state"))
    fs.write_bytes_atomic(FileSystem.join(folder, "metadata"), json.dumps({"id": str(uuid.uuid4())}).encode())
    if channel_input is None:
        return 0
    fs.delete_tree(FileSystem.join(folder, "sources"))
    rewritten = 0
    offsets = FileSystem.join(folder, "offsets")
    for entry in fs.list_dir(offsets):
        name = entry.name
        if not name.isdigit():
            continue
        lines = fs.read_bytes(entry.path).decode().split("\n")
        if len(lines) != 3:  # "v1", the batch's metadata, one line per source
            raise ConfigurationError(
                f"stage {stage!r}: the fused query's offsets/{name} holds {len(lines) - 2} source lines; a split "
                "carries the offsets of a query with one source only (restore with the epoch's fusion)")
        lines[2] = json.dumps({"pos": 0, "key": channel_input})
        fs.write_bytes_atomic(entry.path, "\n".join(lines).encode())
        rewritten += 1
    return rewritten


_DELTA_CHAIN = re.compile(r"^(\d+)\.(delta|snapshot)$")


def _latest(fs: FileSystem, folder: str, log: str) -> int:
    batches = [int(e.name) for e in fs.list_dir(FileSystem.join(folder, log)) if e.name.isdigit()]
    if not batches:
        raise ConfigurationError(f"{folder} has no {log} entry to merge from")
    return max(batches)


def _text(fs: FileSystem, folder: str, log: str, batch: int) -> str:
    return fs.read_bytes(FileSystem.join(folder, log, str(batch))).decode()


def merge_checkpoint(fs: FileSystem, folder: str, *, stage: str, source: str, state: str | None,
                     empty_delta: Callable[[], bytes]) -> int:
    """Make ``folder`` (a rebuilt copy of the merged query's last member's checkpoint) the checkpoint of ``stage``,
    the query that fuses stages which each ran as their own query: the source's offsets from ``source`` (the
    rebuilt checkpoint of the member reading the source), the state from ``state`` (the stateful member's, or None),
    renumbered to one batch numbering: the merged query continues at the next batch after the newest of the
    members' (a sink's batch ids only grow), the state's versions shifted with it (the default store's
    ``V.delta`` / ``V.snapshot``; the caller refuses other stores). A partition whose chain starts at a delta (no
    snapshot yet) gets ``empty_delta()`` (a delta file with no change, in the query's codec) for each version the
    shift leaves below it: the store replays deltas from version 1. Returns the batch the merged query resumes after.
    """
    tail = _latest(fs, folder, "commits")
    head = _latest(fs, source, "commits")
    held = _latest(fs, state, "commits") if state is not None else tail
    resume = max(tail, head, held)
    meta_from = state if state is not None else folder
    meta = _text(fs, meta_from, "offsets", held).split("\n")[1]  # watermark, conf: the stateful stage's
    commit = _text(fs, meta_from, "commits", held)
    for log in ("offsets", "commits"):
        for e in fs.list_dir(FileSystem.join(folder, log)):
            fs.delete(e.path)
    for batch, at in ((resume, head), (resume - 1, head - 1)):
        if batch < 0:
            continue
        src = _text(fs, source, "offsets", at if at >= 0 and fs.exists(FileSystem.join(source, "offsets", str(at)))
                    else head).split("\n")
        if len(src) != 3:
            raise ConfigurationError(f"stage {stage!r}: the source stage's offsets hold {len(src) - 2} source "
                                     "lines; a merge carries a query with one source only")
        fs.write_bytes_atomic(FileSystem.join(folder, "offsets", str(batch)),
                              "\n".join([src[0], meta, src[2]]).encode())
        fs.write_bytes_atomic(FileSystem.join(folder, "commits", str(batch)), commit.encode())
    fs.delete_tree(FileSystem.join(folder, "state"))
    if state is not None:
        shift = resume - held
        root = FileSystem.join(state, "state")
        chains: dict[str, list[tuple[int, str]]] = {}
        for e in fs.list_files(root):
            rel = posixpath.relpath(e.path, root)
            parent, _, name = rel.rpartition("/")
            m = _DELTA_CHAIN.match(name)
            if m:
                name = f"{int(m.group(1)) + shift}.{m.group(2)}"
                chains.setdefault(parent, []).append((int(m.group(1)) + shift, m.group(2)))
            fs.copy_file(e.path, FileSystem.join(folder, "state", parent, name))
        filler: bytes | None = None
        for parent, chain in chains.items():
            if shift == 0 or any(kind == "snapshot" for _, kind in chain):
                continue
            filler = empty_delta() if filler is None else filler
            for version in range(1, min(v for v, _ in chain)):
                fs.write_bytes_atomic(FileSystem.join(folder, "state", parent, f"{version}.delta"), filler)
    return resume


def empty_delta_file(spark: SparkSession, codec: str) -> bytes:
    """The bytes of a default state store delta file that changes nothing (``HDFSBackedStateStoreProvider``: the
    end marker alone, compressed with ``codec``), written by Spark's own codec through the JVM."""
    jvm = spark._jvm  # Spark's own codec, so that the store reads the file as it reads its own
    assert jvm is not None
    compression = jvm.org.apache.spark.io.CompressionCodec.createCodec(spark.sparkContext._conf._jconf, codec)
    buffer = jvm.java.io.ByteArrayOutputStream()
    out = jvm.java.io.DataOutputStream(compression.compressedOutputStream(buffer))
    out.writeInt(-1)
    out.close()
    return bytes(buffer.toByteArray())
