"""An exactly-once file sink: Spark's batch file writers with a two-phase commit over epochs.

Spark's own streaming file sink remembers batch ids in ``_spark_metadata`` and skips a batch id it has
seen; after a restore the same batch id can carry other rows, so it would lose or duplicate them. This
sink instead follows Flink's two-phase commit sink: a micro-batch is *pre-committed* to a pending
folder, and *committed* (made visible) only when an epoch whose cut covers it completes. A restore
rolls it back to the restored epoch's cut.

Layout under the sink's ``path`` (any URI :class:`~airflow_arroyo.core.fs.FileSystem` understands)::

    <path>/<batch:012d>-<part file>                committed data files (what readers read)
    <path>/_arroyo_sink/owner.json                 {"pipeline": ..., "stage": ..., "format": ...}
    <path>/_arroyo_sink/pending/<batch>/           a pre-committed micro-batch, as Spark's batch writer left it,
                                                   and _arroyo_batch.json: {"rows": n, "moved": false}
                                                   (and _moved-g<G>, empty, once generation G's commit began)
    <path>/_arroyo_sink/committed/<batch:012d>.json  the batch's manifest: {"batch": b, "files": [...]}
    <path>/_arroyo_sink/committed.json             {"through": c}: the newest committed batch (the commit point)

Spark, pyarrow and pandas skip files and folders starting with ``_`` or ``.``, so ``_arroyo_sink`` is
invisible to readers of ``<path>``.

* **Pre-commit** (the stage's writer, micro-batch *b*): ``df.write.mode("overwrite")`` into
  ``pending/b``: a re-run of *b* after a restore replaces what an earlier attempt left.
* **Commit** (the driver, when epoch *n* completes, with *c* = the sink stage's cut batch of *n*):
  every file of every ``pending/b`` with ``b <= c`` is moved into ``<path>`` under a name prefixed by
  *b* (one file at a time: a rename on a local disk, a copy and a delete on an object store; no folder
  is renamed; before the first, the committing generation marks the batch with a file of its own,
  ``_moved-g<G>``: two runs that mark one batch never overwrite each other's mark), then the batch's manifest
  (naming every file of *b* moved so far: those this commit moved or, for a batch already marked, every file of
  *b* of the marking generations
  found by listing the folder, so also those an earlier, interrupted attempt of the commit moved, and those the
  batch's newest manifest from the pending folder's generation up names) is written and
  ``pending/b`` removed; last, ``committed.json``
  is rewritten with ``through = c``. Every step is idempotent: a commit cut short by a crash is
  finished by the next one, and a final name is written only from its one pending file, so no file
  ever appears under two names.
* **Rollback** (restore of epoch *N*, cut *c*): finish the commit of ``pending/b <= c`` (epoch *N*
  completed; its commit may not have run), set ``through = c``, then delete the manifests, pending
  folders and committed files of batches ``> c`` (left by epochs after *N* when an older epoch is
  restored).

Fencing (a run taken over while still alive must not change what readers see). The sink carries its
run's generation ``G`` (the fencing token; 0 = none, the layout above): its pending folders are
``pending/<batch>-g<G>/``, its final names ``<batch:012d>-g<G>-<part file>``, its manifests
``committed/<batch:012d>-g<G>.json`` and its commit point ``committed-g<G>.json`` = ``{"through": c,
"generation": G, "base": r}``, so an older generation can never overwrite any of them. The commit point
readers trust is the one of the highest generation; a manifest counts if its generation is not above it
(per batch the highest such one). A new generation writes its commit point when it claims the folder or
rolls it back (``base`` = the batch it starts from): from then on an older generation's commit is
refused (:class:`~airflow_arroyo.core.exceptions.FencedError`), and whatever it still moves in a race is named
by no manifest readers trust; the newer generation's next commit deletes such files (batches after
``base`` with an older generation's name that no trusted manifest names; an older generation's pending folders
after the base are deleted first; searched at its first two commits and after any that found something). A
commit the older generation
left half done (files moved, its manifest not yet written: it stalled in between) is finished by the
newer one's rollback, whose manifest names the files the older one moved. A commit the older generation had
listed when the newer one's rollback committed and removed its folder meets a missing file: it checks the fence
and is refused; the mark it may leave behind does not make a later rollback forget the batch's files (above).

What readers see. :func:`committed_files` lists exactly the files of the batches ``<= through``
(from their manifests): whole epochs only, on every backend, even while a commit runs or after a
crash in the middle of one. A plain reader of the folder (``spark.read.parquet(path)``,
``pyarrow.dataset``) lists the files themselves: it never sees a pending file (hidden folder) nor a
file twice, but while a commit is moving files (and, after a crash mid-commit, until the next run
finishes it) it can see part of an epoch; after a restore to an older epoch it stops seeing the later
epochs' files as they are deleted. On S3 that window is one copy request per file.
"""

from __future__ import annotations

import logging
import posixpath
import re
import uuid
from collections.abc import Collection, Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, NamedTuple

from airflow_arroyo.core.exceptions import ConfigurationError, FencedError
from airflow_arroyo.core.fs import FileSystem
from airflow_arroyo.runtime.sinks.base import SINK_META, SinkCommit, folder_owner

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

    from airflow_arroyo.store.records import FencingToken

__all__ = ["FILE_SINK_FORMATS", "SinkCommit", "TransactionalFileSink", "committed_files", "committed_through"]

log = logging.getLogger(__name__)

# Spark batch writers that write files into a folder (what ships with pyspark; avro needs a jar).
FILE_SINK_FORMATS = frozenset({"parquet", "orc", "json", "csv", "text"})
_META = SINK_META
_MANIFESTS = f"{_META}/committed"
_THROUGH = f"{_META}/committed.json"
_BATCH_DIGITS = 12
# in pending/<batch>/: {"rows": n, "moved": false}, written at pre-commit (earlier builds of this release marked a
# commit's start in it: "moved": true, "movers": [G, ...]; still read)
_BATCH_MANIFEST = "_arroyo_batch.json"
# in pending/<batch>/: _moved-g<G>, written by a commit of generation G before its first move of the batch's files
_MOVER = re.compile(r"^_moved-g(\d+)$")
_PENDING_NAME = re.compile(r"^(\d+)(?:-g(\d+))?$")  # pending/<batch>[-g<generation>]
_COMMIT_POINT = re.compile(r"^committed(?:-g(\d+))?\.json$")  # _arroyo_sink/committed[-g<generation>].json
_FINAL_GEN = re.compile(r"^g(\d+)-")  # <batch>-g<generation>-<part file>


class _Pending(NamedTuple):
    batch: int
    generation: int
    path: str


def _gen_suffix(generation: int) -> str:
    return f"-g{generation}" if generation else ""


def _hidden(name: str) -> bool:
    return name.startswith(("_", "."))


class TransactionalFileSink:
    """The files of one sink stage (see the module docstring)."""

    def __init__(self, pipeline_id: str, stage: str, fmt: str, options: Mapping[str, str]) -> None:
        if fmt not in FILE_SINK_FORMATS:
            raise ConfigurationError(
                f"sink {stage!r}: format {fmt!r} is not a file format this sink commits "
                f"({', '.join(sorted(FILE_SINK_FORMATS))})"
            )
        path = options.get("path")
        if not path:
            raise ConfigurationError(f"sink {stage!r}: format {fmt!r} needs options={{'path': '<folder or URI>'}}")
        self.pipeline_id = pipeline_id
        self.stage = stage
        self.format = fmt
        self.options = {k: v for k, v in options.items() if k != "path"}
        self.fs = FileSystem.from_uri(path)
        self.uri = self.fs.uri
        self.token: FencingToken | None = None  # the run's fencing token (set by the driver before any write)
        # the stage that wrote the folder before a restore across a change of fusion (the fused query's name):
        # this sink takes the folder over, its batch ids continuing the fused query's
        self.previous_stage: str | None = None
        # searches in a row that found no file an older generation slipped in and nothing it could still move
        self._clean_searches = 0

    @property
    def generation(self) -> int:
        """The fencing generation this sink writes with (0 without a token)."""
        return self.token.generation if self.token is not None else 0

    def __repr__(self) -> str:
        return f"TransactionalFileSink({self.pipeline_id}/{self.stage} -> {self.uri})"

    # ------------------------------------------------------------------ ownership

    def owner(self) -> dict[str, str] | None:
        """Who claimed the sink folder (pipeline, stage), or None if nobody did."""
        return folder_owner(self.fs)

    def check_writable(self) -> None:
        """Refuse (before anything is written or rolled back) a folder another pipeline or stage writes,
        or one that holds files this sink did not write."""
        current = self.owner()
        if current is None:
            if any(not _hidden(e.name) for e in self.fs.list_dir()):
                raise ConfigurationError(
                    f"sink {self.stage!r}: {self.uri} already holds files this sink did not write; give the sink "
                    "an empty or new folder (its content is replaced epoch by epoch on restore)"
                )
            return
        if current.get("pipeline") == self.pipeline_id and current.get("stage") in (self.stage, self.previous_stage):
            return
        raise ConfigurationError(
            f"sink {self.stage!r} of pipeline {self.pipeline_id!r}: {self.uri} is written by stage "
            f"{current.get('stage')!r} of pipeline {current.get('pipeline')!r}; one folder has one writer: "
            "choose another path"
        )

    def claim(self) -> None:
        """Record this pipeline and stage as the folder's writer (after :meth:`check_writable`); with a
        fencing token, also fence older generations out (this generation's commit point)."""
        self.check_writable()
        owner = self.owner()
        if owner is None or owner.get("stage") != self.stage:  # new, or taken over from the fused query
            self.fs.write_json_atomic(f"{_META}/owner.json",
                                      {"pipeline": self.pipeline_id, "stage": self.stage, "format": self.format})
        self._fence_older_generations()

    # ------------------------------------------------------------------ fencing

    def _check_fence(self, what: str) -> None:
        """Refuse a write of a generation older than the folder's newest commit point."""
        newest = _commit_point(self.fs)[1]
        if newest > self.generation:
            token = self.token
            raise FencedError(self.pipeline_id, token.run_id if token else None, self.generation,
                              by_generation=newest, what=f"{what} of sink {self.stage!r} ({self.uri})")

    def _fence_older_generations(self) -> None:
        """Write this generation's commit point, unchanged ``through`` as its base, unless it has one: from then on
        an older generation's writes are refused."""
        if self.generation and _commit_point(self.fs)[1] != self.generation:
            through = self._through()
            self._write_commit_point(through, base=through)

    def _write_commit_point(self, through: int, *, base: int | None = None) -> None:
        """Write this generation's commit point (the legacy ``committed.json`` without a token)."""
        self._check_fence("the commit point")
        value: dict[str, int] = {"through": through}
        if self.generation:
            if base is None:
                base = int(_read_commit_point(self.fs, self.generation).get("base", through))
            value.update(generation=self.generation, base=base)
        self.fs.write_json_atomic(_commit_point_path(self.generation), value)

    def has_state(self) -> bool:
        """True if the folder holds pending or committed batches of its owner."""
        return self.owner() is not None and (bool(self.pending_batches()) or bool(self.committed_batches()))

    # ------------------------------------------------------------------ phases

    def write_batch(self, df: DataFrame, batch_id: int) -> None:
        """Pre-commit micro-batch ``batch_id`` (overwrites an earlier attempt of the same batch), counting
        its rows on the way (an observed metric of the write itself: no second pass over the data)."""
        from pyspark.sql import Observation
        from pyspark.sql import functions as F

        self._check_fence(f"the pre-commit of micro-batch {batch_id}")
        target = self.fs.spark_uri_of(self._pending(batch_id))
        observation = Observation(f"arroyo_rows_{uuid.uuid4().hex}")
        observed = df.observe(observation, F.count(F.lit(1)).alias("rows"))
        observed.write.format(self.format).options(**self.options).mode("overwrite").save(target)
        rows = observation.get.get("rows")
        self.fs.write_json_atomic(f"{self._pending(batch_id)}/{_BATCH_MANIFEST}",
                                  {"rows": int(rows) if rows is not None else None, "moved": False})

    def commit_through(self, batch_id: int, *, any_generation: bool = False) -> SinkCommit:
        """Make every pending batch ``<= batch_id`` of this generation visible (``any_generation``: of any,
        what a restore finishes for the run that completed the epoch); says what it moved. The commit point
        (written last) is this generation's; a commit cut short is finished by the next call."""
        what = f"the commit through micro-batch {batch_id}"
        self._check_fence(what)
        with self._refused_if_superseded(what):
            return self._commit_through(batch_id, any_generation=any_generation)

    @contextmanager
    def _refused_if_superseded(self, what: str) -> Iterator[None]:
        """A write that fails because a run that took over meanwhile committed or removed what it had listed (a
        missing file: ``FileNotFoundError`` on a local disk, an ``OSError`` naming ``NO_SUCH_KEY`` on S3) is refused
        as superseded (``FencedError``), not failed on that file; any other failure is raised as it is."""
        try:
            yield
        except Exception:
            self._check_fence(what)
            raise

    def _commit_through(self, batch_id: int, *, any_generation: bool) -> SinkCommit:
        chosen = [p for p in self._pending_dirs()
                  if p.batch <= batch_id and (any_generation or p.generation == self.generation)]
        pending = sorted({p.batch for p in chosen})
        moved = size = 0
        rows: int | None = 0
        finals: dict[int, list[str]] = {b: [] for b in pending}
        resumed: set[int] = set()  # batches whose files an earlier commit may have moved in part
        movers: dict[int, set[int]] = {}  # of those: the generations that marked them
        for p in sorted(chosen):
            self._check_fence(f"the commit of micro-batch {p.batch}")
            # listed before anything is read: a superseded run that marks the folder and moves a file after this
            # listing fails one of the two moves of that file, or is seen as a mark here
            entries = self.fs.list_files(p.path)
            tops = {e.path[len(p.path) + 1:] for e in entries if e.path.startswith(p.path + "/")}
            # listed but gone: a run that took over committed the folder meanwhile (FileNotFoundError: the fence)
            info = dict(self.fs.read_json(f"{p.path}/{_BATCH_MANIFEST}") or {}) if _BATCH_MANIFEST in tops else {}
            counted = info.get("rows")
            rows = rows + int(counted) if rows is not None and counted is not None else None
            # the generations that moved files of this folder (a mark file each; earlier builds of this release
            # listed them in the batch's json): their final names are this batch's too
            marked = {int(m.group(1)) for t in tops if (m := _MOVER.match(t))}
            marked |= {int(g) for g in info.get("movers", ())}
            if marked or info.get("moved") is not False:  # marked, or pre-committed before the mark existed
                resumed.add(p.batch)
                movers.setdefault(p.batch, set()).update(marked)
            if self.generation not in marked:
                # a file of its own per generation: two runs that mark one batch never overwrite each other's mark
                self._check_fence(f"the commit of micro-batch {p.batch}")
                self.fs.write_bytes_atomic(f"{p.path}/{_mover(self.generation)}", b"")
            for e in entries:
                rel = e.path[len(p.path) + 1:] if e.path.startswith(p.path + "/") else e.path
                if any(_hidden(part) for part in rel.split("/")):
                    continue  # _SUCCESS, .crc files, an unfinished _temporary, the batch's row count
                final = self._committed_name(p.batch, rel, self.generation)
                self.fs.move(e.path, final)
                finals[p.batch].append(final)
                moved += 1
                size += e.size
        if resumed:
            finals.update(self._moved_files(chosen, resumed, movers))
        if chosen:
            for b in pending:
                self.fs.write_json_atomic(self._manifest(b, self.generation),
                                          {"batch": b, "files": sorted(finals.get(b, ()))})
            for p in chosen:
                self.fs.delete_tree(p.path)
        if chosen or self._through() < batch_id:
            self._write_commit_point(max(batch_id, self._through()))
        if self.generation:
            self._remove_fenced_files()
        if moved:
            log.info("pipeline=%s sink=%s: committed batches <= %s (%d files, %d bytes, %s rows) to %s",
                     self.pipeline_id, self.stage, batch_id, moved, size, rows, self.uri)
        return SinkCommit(files=moved, bytes=size, rows=rows if chosen else 0, batches=tuple(pending))

    def pending_output(self, batch_from: int, batch_to: int) -> dict[str, Any]:
        """Where this generation's pre-committed batches ``batch_from..batch_to`` wait, for a commit gate: the URIs of
        their data files, Spark's format name and their rows (None when a batch's count is unknown)."""
        files: list[str] = []
        rows: int | None = 0
        for p in sorted(self._pending_dirs()):
            if not batch_from <= p.batch <= batch_to or p.generation != self.generation:
                continue
            counted = self._manifest_rows(p.path)
            rows = rows + counted if rows is not None and counted is not None else None
            files += [self.fs.uri_of(e.path) for e in self.fs.list_files(p.path)
                      if not any(_hidden(part) for part in e.path[len(p.path) + 1:].split("/"))]
        return {"kind": "files", "format": self.format, "files": sorted(files), "rows": rows}

    def quarantine_through(self, batch_id: int, target: str) -> SinkCommit:
        """A gate's failed output goes to ``target`` instead of the sink's folder: this generation's pending batches
        ``<= batch_id`` are copied there (named as a commit names them), then removed, and the commit point moves
        past them, so readers of the sink never see them and a later commit does not pick them up."""
        what = f"the quarantine through micro-batch {batch_id}"
        self._check_fence(what)
        with self._refused_if_superseded(what):
            return self._quarantine_through(batch_id, target)

    def _quarantine_through(self, batch_id: int, target: str) -> SinkCommit:
        dest = FileSystem.of(target)
        chosen = sorted(p for p in self._pending_dirs() if p.batch <= batch_id and p.generation == self.generation)
        moved = size = 0
        for p in chosen:
            for e in self.fs.list_files(p.path):
                rel = e.path[len(p.path) + 1:]
                if any(_hidden(part) for part in rel.split("/")):
                    continue
                # a copy, not a move: the quarantine may be on another file system; re-copying after a crash is
                # harmless (same name, same bytes), and the pending folder goes only once all are copied
                dest.write_bytes_atomic(self._committed_name(p.batch, rel, self.generation), self.fs.read_bytes(e.path))
                moved += 1
                size += e.size
            self.fs.delete_tree(p.path)
        if chosen or self._through() < batch_id:
            self._write_commit_point(max(batch_id, self._through()))
        log.warning("pipeline=%s sink=%s: quarantined batches <= %s (%d files, %d bytes) to %s",
                    self.pipeline_id, self.stage, batch_id, moved, size, dest.uri)
        return SinkCommit(files=moved, bytes=size, rows=None, batches=tuple(sorted({p.batch for p in chosen})))

    def _moved_files(self, chosen: list[_Pending], resumed: set[int],
                     movers: Mapping[int, set[int]]) -> dict[int, list[str]]:
        """The committed files of the ``resumed`` batches, listed after all moves. A batch's manifest names its files
        of this generation, of the generation whose pending folder is committed and of every generation that marked
        it: files an interrupted commit moved (this run's, an earlier run's that died in its rollback, or a
        superseded run's that stalled between its moves and its manifest) are among them. And the files its newest
        manifest of a generation from the pending folder's to this one names: a superseded run whose folder the run
        that took over had already committed and removed can leave its mark behind (a write re-creates the folder on
        a local disk; an object store has no folders), naming only itself. Only for those batches: the folder holds
        the sink's whole output, and a commit must not cost more each epoch."""
        owners: dict[int, set[int]] = {}
        for p in chosen:
            owners.setdefault(p.batch, {self.generation}).add(p.generation)
            owners[p.batch].update(movers.get(p.batch, ()))
        oldest = {b: min(p.generation for p in chosen if p.batch == b) for b in resumed}
        newest: dict[int, tuple[int, str]] = {}
        for b, manifest in _manifests(self.fs):
            gen = _manifest_generation(manifest)
            if b in resumed and oldest[b] <= gen <= self.generation and gen >= newest.get(b, (-1, ""))[0]:
                newest[b] = (gen, manifest)
        found: dict[int, list[str]] = {b: [] for b in resumed}
        present: set[str] = set()
        for b, path in self._committed_files():
            present.add(path)
            if b in resumed and _final_generation(path) in owners[b]:
                found[b].append(path)
        for b, (_, manifest) in newest.items():
            named = set(self.fs.read_json(manifest)["files"])
            found[b].extend(sorted((named & present) - set(found[b])))
        return found

    def _remove_fenced_files(self) -> None:
        """Delete files an older generation moved in after this one took over (a race the fence check
        cannot close on storage without conditional writes): batches after this generation's base named
        by an older generation and named by no manifest readers trust (never a newer one's: a superseded run
        that raced its check deletes nothing of the run that took over); plain folder readers stop seeing them.

        An older generation moves files only out of its own pending folders. Those after the base are never
        committed (an older commit checks the fence before each batch; a later rollback would take one for the
        batch this generation committed), so they are deleted here first (a rollback deletes them too), and then
        nothing more can arrive but a move already under way. So the folder is searched at this sink's first two
        commits (two: an object store's copy that was under way at the first lands before the second) and after
        any that found an older generation's pending folder or file: not the sink's whole output on every commit."""
        mine = _read_commit_point(self.fs, self.generation)
        if "base" not in mine:
            return
        base = int(mine["base"])
        older = [p for p in self._pending_dirs() if p.generation < self.generation and p.batch > base]
        if self._clean_searches >= 2 and not older:
            return
        for p in older:
            self.fs.delete_tree(p.path)
        # read the manifests of the suspect batches only, not the sink's history
        suspects = [(b, path) for b, path in self._committed_files()
                    if b > base and _final_generation(path) < self.generation]
        self._clean_searches = 0 if older or suspects else self._clean_searches + 1
        if older:
            log.warning("pipeline=%s sink=%s: removed %d pending batches a superseded run wrote after the takeover",
                        self.pipeline_id, self.stage, len(older))
        if not suspects:
            return
        named = set(_trusted_files(self.fs, batches={b for b, _ in suspects}))
        stray = [path for _, path in suspects if path not in named]
        for path in stray:
            self.fs.delete(path)
        if stray:
            log.warning("pipeline=%s sink=%s: removed %d files a superseded run committed after the takeover",
                        self.pipeline_id, self.stage, len(stray))

    def _manifest_rows(self, folder: str) -> int | None:
        rows = self._batch_info(folder).get("rows")
        return int(rows) if rows is not None else None

    def _batch_info(self, folder: str) -> dict[str, Any]:
        """What the pre-commit wrote about a pending batch; {} when it wrote nothing (an older version)."""
        try:
            return dict(self.fs.read_json(f"{folder}/{_BATCH_MANIFEST}") or {})
        except FileNotFoundError:
            return {}

    def rollback_to(self, batch_id: int) -> None:
        """Restore: keep exactly the batches ``<= batch_id`` (``-1``: nothing), all of them committed."""
        # before any of an older generation's pending files is moved (the driver rolls back before it claims): a
        # superseded run still committing is refused from here on
        self._fence_older_generations()
        self.commit_through(batch_id, any_generation=True)
        self._write_commit_point(batch_id, base=batch_id)  # readers stop seeing later batches first
        for b, path in _manifests(self.fs):
            if b > batch_id:
                self.fs.delete(path)
        for p in self._pending_dirs():
            if p.batch > batch_id:
                self.fs.delete_tree(p.path)
        dropped = 0
        for b, path in self._committed_files():
            if b > batch_id:
                self.fs.delete(path)
                dropped += 1
        self._clean_searches = 0  # the new base: the next commits search again
        log.info("pipeline=%s sink=%s: rolled back to batch %s (%d committed files of later batches removed)",
                 self.pipeline_id, self.stage, batch_id, dropped)

    def public_after(self, batch_id: int) -> int | None:  # noqa: ARG002 - the protocol's signature
        """None: a rollback takes back whatever was committed after ``batch_id`` (readers see it go)."""
        return None

    def trim_through(self, batch_id: int) -> None:
        """Nothing to forget: committed files are the sink's output, and a rollback deletes by batch id."""

    def close(self) -> None:
        """Nothing kept open between calls."""

    # ------------------------------------------------------------------ listing

    def pending_batches(self) -> list[int]:
        """The pre-committed batches of every generation."""
        return sorted({p.batch for p in self._pending_dirs()})

    def _pending_dirs(self) -> list[_Pending]:
        out = []
        for e in self.fs.list_dir(f"{_META}/pending"):
            m = _PENDING_NAME.match(e.name) if e.is_dir else None
            if m:
                out.append(_Pending(int(m.group(1)), int(m.group(2) or 0), e.path))
        return out

    def committed_batches(self) -> list[int]:
        """The batch ids whose files are committed, ascending."""
        return sorted({b for b, _ in self._committed_files()})

    def _committed_files(self) -> list[tuple[int, str]]:
        out = []
        for e in self.fs.list_files():
            if any(_hidden(part) for part in e.path.split("/")):
                continue
            head, _, _ = posixpath.basename(e.path).partition("-")
            if len(head) == _BATCH_DIGITS and head.isdigit():
                out.append((int(head), e.path))
        return out

    def _pending(self, batch_id: int) -> str:
        return f"{_META}/pending/{batch_id}{_gen_suffix(self.generation)}"

    @staticmethod
    def _manifest(batch_id: int, generation: int = 0) -> str:
        return f"{_MANIFESTS}/{batch_id:0{_BATCH_DIGITS}d}{_gen_suffix(generation)}.json"

    def _through(self) -> int:
        return _through(self.fs)

    @staticmethod
    def _committed_name(batch_id: int, rel: str, generation: int = 0) -> str:
        folder, name = posixpath.split(rel)  # partitioned writes keep their key=value folders
        tag = f"g{generation}-" if generation else ""
        return posixpath.join(folder, f"{batch_id:0{_BATCH_DIGITS}d}-{tag}{name}")


def _mover(generation: int) -> str:
    return f"_moved-g{generation}"


def _final_generation(path: str) -> int:
    """The generation in a committed file's name (``<batch>-g<G>-<part>``; 0 without one)."""
    _, _, rest = posixpath.basename(path).partition("-")
    m = _FINAL_GEN.match(rest)
    return int(m.group(1)) if m else 0


def _manifests(fs: FileSystem) -> list[tuple[int, str]]:
    """(batch, path) of every manifest of every generation."""
    out = []
    for e in fs.list_dir(_MANIFESTS):
        head, _, gen = e.name.removesuffix(".json").partition("-g")
        if e.name.endswith(".json") and head.isdigit() and (not gen or gen.isdigit()):
            out.append((int(head), e.path))
    return sorted(out)


def _commit_point_path(generation: int) -> str:
    return f"{_META}/committed-g{generation}.json" if generation else _THROUGH


def _commit_point(fs: FileSystem) -> tuple[int, int]:
    """``(through, generation)`` of the commit point readers trust: the one of the highest generation."""
    generations = [int(m.group(1) or 0) for e in fs.list_dir(_META) if (m := _COMMIT_POINT.match(e.name))]
    if not generations:
        return -1, 0
    newest = max(generations)
    return int(_read_commit_point(fs, newest)["through"]), newest


def _read_commit_point(fs: FileSystem, generation: int) -> dict[str, int]:
    try:
        return dict(fs.read_json(_commit_point_path(generation)))
    except FileNotFoundError:
        return {}


def _through(fs: FileSystem) -> int:
    return _commit_point(fs)[0]


def committed_through(uri: str | FileSystem) -> int:
    """The newest batch the trusted commit point (the highest generation's) says is committed; -1 for none."""
    return _through(FileSystem.of(uri))


def committed_files(uri: str | FileSystem, through: int | None = None) -> list[str]:
    """The data files of a file sink folder that belong to committed epochs (paths relative to ``uri``, in
    batch order): what a reader that must never see part of an epoch reads, e.g.
    ``spark.read.parquet(*[f"{uri}/{p}" for p in committed_files(uri)])``. Per batch, the manifest of the
    highest generation not above the trusted commit point's (a superseded run's later ones are ignored).
    ``through``: only the batches up to it (what a given commit, e.g. an Asset event's ``batch_id``, covered)."""
    return _trusted_files(FileSystem.of(uri), through)


def _trusted_files(fs: FileSystem, limit: int | None = None, *, batches: Collection[int] | None = None) -> list[str]:
    """``batches``: only those (a manifest is read per batch: a caller that asks about a few batches must not pay
    for the sink's whole history)."""
    through, generation = _commit_point(fs)
    if limit is not None:
        through = min(through, limit)
    chosen: dict[int, tuple[int, str]] = {}
    for b, path in _manifests(fs):
        gen = _manifest_generation(path)
        if batches is not None and b not in batches:
            continue
        if b <= through and gen <= generation and gen >= chosen.get(b, (-1, ""))[0]:
            chosen[b] = (gen, path)
    out: list[str] = []
    for b in sorted(chosen):
        out.extend(fs.read_json(chosen[b][1])["files"])
    return out


def _manifest_generation(path: str) -> int:
    _, _, gen = posixpath.basename(path).removesuffix(".json").partition("-g")
    return int(gen) if gen.isdigit() else 0
