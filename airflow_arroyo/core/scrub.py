"""Scrubbing: re-hash the snapshot objects of the retained epochs and say which epochs damage reaches.

Incremental epochs share objects, so one corrupt or missing object can make every epoch that references
it unrestorable at once, and a restore is the worst moment to find out. A scrub reads every object the
retained epochs reference (or one epoch's), checks its size and that its content hashes to the SHA-256 in
its key (the check a restore makes), and records the outcome per object in the store (``verified_at``,
``verify_state``; migration 0005). Objects are taken least recently verified first, so scrubs with a time
budget (the retention run) cover every object in turn, over as many runs as it takes.

The report names every damaged object still referenced by a retained epoch (found now or by an earlier
scrub and not found sound since), the epochs that depend on it, and the completed epochs that remain
restorable. A damaged shared object is repaired by the next epoch whose stage still has the file in its live
checkpoint (capture copies a known object again when a scrub found it damaged), which makes the older epochs
that reference it restorable again; a self-contained epoch (``docs/runtime.md``) shares no object, so damage
elsewhere never reaches it.

Usage::

    from airflow_arroyo.core.scrub import verify_pipeline
    report = verify_pipeline(EpochStore(dsn), "orders", budget=60.0)
    print(report.damaged_epochs, report.restorable_epochs)
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from airflow_arroyo.core.epochs import EpochState
from airflow_arroyo.core.exceptions import ConfigurationError
from airflow_arroyo.runtime.layout import object_digest, object_path

if TYPE_CHECKING:
    from airflow_arroyo.core.fs import FileSystem
    from airflow_arroyo.store import EpochStore, ObjectRecord

__all__ = ["DamagedObject", "ScrubReport", "check_object", "verify_pipeline"]

log = logging.getLogger(__name__)

_CHUNK = 1 << 20
_RECORD_EVERY = 200  # results written to the store in batches of this many


@dataclass(frozen=True)
class DamagedObject:
    """A snapshot object that is missing or does not hash to its name."""
    object_key: str
    state: str  # "missing" or "corrupt"
    detail: str
    epochs: tuple[int, ...]  # the retained epochs whose snapshot references it


@dataclass(frozen=True)
class ScrubReport:
    """What one scrub found. ``damaged`` is all known damage in scope, not only this run's findings."""

    pipeline_id: str
    epoch: int | None  # the epoch scrubbed, None: every retained epoch
    objects_checked: int
    bytes_checked: int
    objects_total: int  # objects in scope
    objects_unverified: int  # in scope and never verified (a budget stopped the run first)
    elapsed_s: float
    damaged: list[DamagedObject] = field(default_factory=list)
    damaged_epochs: list[int] = field(default_factory=list)
    restorable_epochs: list[int] = field(default_factory=list)  # completed, every object verified sound
    unverified_epochs: list[int] = field(default_factory=list)  # completed, no damage seen, not all verified

    @property
    def ok(self) -> bool:
        """True if nothing is damaged."""
        return not self.damaged

    def advice(self) -> str:
        """One sentence for a person: what is damaged and what to do."""
        if self.ok:
            if self.unverified_epochs:
                return (f"no damage found; {self.objects_unverified} objects not verified yet (epochs "
                        f"{_epochs(self.unverified_epochs)}): run again, or without a budget, to check them")
            return "no damage found"
        restorable = (f"restore from epoch {self.restorable_epochs[-1]} (restorable: "
                      f"{_epochs(self.restorable_epochs)})" if self.restorable_epochs
                      else "no completed epoch is verified restorable")
        return (f"{len(self.damaged)} damaged objects; epochs {_epochs(self.damaged_epochs)} cannot be restored. "
                f"{restorable}. The next epoch copies a damaged object again if its stage still has the file; "
                "take one (airflow-arroyo checkpoint PIPELINE --self-contained) and verify again")

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able form (``--json``), with ``ok`` and the advice."""
        out = asdict(self)
        out["ok"] = self.ok
        out["advice"] = self.advice()
        return out


def _epochs(epochs: list[int]) -> str:
    return ",".join(str(e) for e in epochs) if epochs else "-"


def check_object(fs: FileSystem, pipeline_id: str, key: str, size: int) -> tuple[str, str | None]:
    """``("ok", None)``, ``("missing", why)`` or ``("corrupt", why)`` for one object: the size and SHA-256
    a restore checks. Other read errors (storage unreachable) are raised: they say nothing about the object."""
    path = object_path(pipeline_id, key)
    h = hashlib.sha256()
    n = 0
    try:
        with fs.open_input(path) as f:
            while chunk := f.read(_CHUNK):
                h.update(chunk)
                n += len(chunk)
    except FileNotFoundError:
        return "missing", f"{fs.uri_of(path)} does not exist"
    if n != size:
        return "corrupt", f"{fs.uri_of(path)} has {n} bytes, expected {size}"
    if h.hexdigest() != object_digest(key):
        return "corrupt", f"{fs.uri_of(path)}: content does not hash to its SHA-256 name"
    return "ok", None


def verify_pipeline(store: EpochStore, pipeline_id: str, *, epoch: int | None = None, budget: float | None = None,
                    fs: FileSystem | None = None, clock: Callable[[], float] = time.monotonic) -> ScrubReport:
    """Re-hash the objects of the retained epochs (or of ``epoch``), least recently verified first, for at
    most ``budget`` seconds (None: all; at least one object is checked), record the outcomes and report."""
    if budget is not None and not budget > 0:
        raise ConfigurationError(f"scrub budget must be a positive number of seconds, got {budget!r}")
    pipe = store.get_pipeline(pipeline_id)
    if fs is None:
        if not pipe.storage_uri:
            raise ConfigurationError(f"pipeline {pipeline_id!r} has no storage URI recorded: it never ran, "
                                     "so it has no snapshot objects to verify")
        from airflow_arroyo.core.fs import FileSystem

        fs = FileSystem.from_uri(pipe.storage_uri)
    t0 = clock()
    todo = store.objects_to_verify(pipeline_id, epoch=epoch)
    checked = 0
    bytes_checked = 0
    results: list[tuple[str, str, str | None]] = []
    try:
        for obj in todo:
            if budget is not None and checked and clock() - t0 >= budget:
                break
            state, detail = check_object(fs, pipeline_id, obj.object_key, obj.bytes)
            if state != "ok":
                log.warning("pipeline=%s: snapshot object %s is %s (%s); epochs %s depend on it", pipeline_id,
                            obj.object_key, state, detail, _epochs(list(obj.epochs)))
            results.append((obj.object_key, state, detail))
            checked += 1
            bytes_checked += obj.bytes
            if len(results) >= _RECORD_EVERY:
                store.record_verification(pipeline_id, results)
                results = []
    finally:
        store.record_verification(pipeline_id, results)
    after = store.objects_to_verify(pipeline_id, epoch=epoch)
    report = _report(store, pipeline_id, epoch, after, checked=checked, bytes_checked=bytes_checked,
                     elapsed=clock() - t0)
    log.info("pipeline=%s: scrub checked %s of %s objects (%s bytes) in %.1fs: %s", pipeline_id, checked,
             len(after), bytes_checked, report.elapsed_s, report.advice())
    return report


def _report(store: EpochStore, pipeline_id: str, epoch: int | None, objects: list[ObjectRecord], *, checked: int,
            bytes_checked: int, elapsed: float) -> ScrubReport:
    damaged = [DamagedObject(o.object_key, o.verify_state or "", o.verify_detail or "", o.epochs)
               for o in objects if o.verify_state not in (None, "ok")]
    hit = {e for d in damaged for e in d.epochs}
    unverified = {e for o in objects if o.verify_state is None for e in o.epochs}
    completed = sorted(r.epoch for r in store.unpruned_epochs(pipeline_id) if r.state is EpochState.COMPLETED
                       and (epoch is None or r.epoch == epoch))
    return ScrubReport(
        pipeline_id=pipeline_id, epoch=epoch, objects_checked=checked, bytes_checked=bytes_checked,
        objects_total=len(objects), objects_unverified=sum(1 for o in objects if o.verify_state is None),
        elapsed_s=round(elapsed, 3), damaged=damaged,
        damaged_epochs=sorted(hit),
        restorable_epochs=[e for e in completed if e not in hit and e not in unverified],
        unverified_epochs=[e for e in completed if e not in hit and e in unverified],
    )
