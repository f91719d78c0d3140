"""Restore across a change of fusion: a fused query's checkpoint rebuilt for one of the queries it splits into.

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

Batch ids are kept, so each new query resumes at the fused query's next batch, and a sink's batch ids continue
where the fused query's stopped. The format is Spark's (:mod:`~airflow_arroyo.runtime.spark_checkpoint`).
"""

from __future__ import annotations

import json
import uuid

from airflow_arroyo.exceptions import ConfigurationError
from airflow_arroyo.fs import FileSystem

__all__ = ["split_checkpoint"]


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
