"""Errors raised by airflow-arroyo.

The tree is small on purpose::

    ArroyoError                      base of everything this package raises
    ├── ConfigurationError           bad input from the user: raised before anything is written
    │   ├── PipelineGraphError       the pipeline graph is invalid (names the stage and the fix)
    │   ├── StateConflictError       the store's rows are not in the state the request needs (nothing changed)
    │   └── SchemaError              the store's schema is not this release's (also a StoreError)
    │       └── SchemaMissingError   missing or behind: `airflow-arroyo migrate` fixes it
    ├── NotFoundError                a named thing does not exist (also a LookupError)
    │   ├── UnknownPipelineError     no pipeline registered under that id
    │   └── UnknownEpochError        the pipeline has no epoch with that number
    ├── IllegalTransitionError       a life-cycle change the state machine does not allow
    ├── ConcurrencyConflict          another actor won the race (e.g. epoch already in flight)
    │   └── FencedError              a superseded run tried to write (a newer run registered)
    ├── CleanupLockHeld              the pipeline's cleanup lock is held by someone else
    ├── LockLostError                our cleanup lease expired or was taken over mid-run
    ├── StoreError                   a permanent epoch-store failure (not retried)
    │   ├── TransientStoreError      a transient failure that survived the bounded retries
    │   └── SchemaError              (see above: newer than this release, or an edited migration)
    ├── SnapshotError                a snapshot file is missing or corrupt (names epoch and file)
    │   └── UnrestorableEpochError   an epoch's snapshot can never rebuild a checkpoint Spark accepts
    └── PipelineFailedError          the pipeline reported failure (carries the cause)
        └── StageBuildError          a stage's source or transform raised while the pipeline was built

Messages say what most likely went wrong and how to fix it.
"""

from __future__ import annotations

import traceback

__all__ = [
    "ArroyoError",
    "CleanupLockHeld",
    "ConcurrencyConflict",
    "ConfigurationError",
    "FencedError",
    "IllegalTransitionError",
    "LockLostError",
    "NotFoundError",
    "PipelineFailedError",
    "PipelineGraphError",
    "SchemaError",
    "SchemaMissingError",
    "SnapshotError",
    "StateConflictError",
    "StageBuildError",
    "StoreError",
    "TransientStoreError",
    "UnknownEpochError",
    "UnknownPipelineError",
    "UnrestorableEpochError",
]


class ArroyoError(Exception):
    """Base class of every error raised by airflow-arroyo."""


class ConfigurationError(ArroyoError, ValueError):
    """Invalid user input. Raised before anything is written."""


class PipelineGraphError(ConfigurationError):
    """The pipeline graph is invalid (unknown channel, stage without input, ...)."""


class StateConflictError(ConfigurationError):
    """What the request names is not in the state it needs: an epoch no longer completed, a pin label
    already given, a fork point a fork still needs, a fork that already exists. Nothing was changed; the
    message says what the state is and what to do instead. A :class:`ConfigurationError`, as these were
    before they had a type of their own, so existing ``except ConfigurationError`` still catches them."""


class NotFoundError(ArroyoError, LookupError):
    """A pipeline, epoch or other named thing does not exist: not a transient failure, not bad syntax."""


class UnknownPipelineError(NotFoundError):
    """No pipeline of this id is registered in the epoch store."""
    def __init__(self, pipeline_id: str) -> None:
        super().__init__(
            f"no pipeline named {pipeline_id!r} is registered in the epoch store; "
            "check the id (see `airflow-arroyo pipelines`) or start the pipeline first so that it registers"
        )
        self.pipeline_id = pipeline_id


class UnknownEpochError(NotFoundError):
    """The pipeline has no such epoch (or not in the state asked for)."""
    def __init__(self, pipeline_id: str, epoch: int, what: str = "") -> None:
        super().__init__(
            f"pipeline {pipeline_id!r} has no epoch {epoch}{' ' + what if what else ''}; "
            "list its epochs with `airflow-arroyo epochs " + pipeline_id + "`"
        )
        self.pipeline_id = pipeline_id
        self.epoch = epoch


class IllegalTransitionError(ArroyoError):
    """A move the transition tables do not allow (a bug, or a race the database refused)."""
    def __init__(self, kind: str, current: str, target: str, *, subject: str = "") -> None:
        where = f" ({subject})" if subject else ""
        super().__init__(f"illegal {kind} transition {current!r} -> {target!r}{where}")
        self.kind = kind
        self.current = current
        self.target = target


class ConcurrencyConflict(ArroyoError):
    """Another actor changed the same rows first; the caller lost a race and should re-read."""


class FencedError(ConcurrencyConflict):
    """A write of a run that a newer run of the same pipeline has superseded (its fencing token, the
    generation the store gave it at registration, is older than the pipeline's). The run must stop at
    once and write nothing more; the newer run owns the pipeline's channels, sinks and epochs."""

    def __init__(self, pipeline_id: str, run_id: str | None, generation: int, *, by_run: str | None = None,
                 by_generation: int | None = None, what: str = "a write") -> None:
        newer = f"run {by_run!r}" if by_run else "a newer run"
        gen = f" (generation {by_generation})" if by_generation is not None else ""
        own = f" of generation {generation}" if generation >= 0 else ""
        super().__init__(
            f"run {run_id!r} of pipeline {pipeline_id!r} is no longer current: it was superseded by {newer}{gen}; "
            f"{what}{own} was refused, and the run stops without writing further"
        )
        self.pipeline_id = pipeline_id
        self.run_id = run_id
        self.generation = generation
        self.by_run = by_run
        self.by_generation = by_generation
        self.what = what


class CleanupLockHeld(ArroyoError):
    """Another cleanup holds the pipeline's cleanup lease."""
    def __init__(self, pipeline_id: str, holder: str, expires_at: object) -> None:
        super().__init__(
            f"the cleanup lock of pipeline {pipeline_id!r} is held by {holder!r} until {expires_at}; "
            "wait for that run to finish (or for its lease to expire if it crashed)"
        )
        self.pipeline_id = pipeline_id
        self.holder = holder
        self.expires_at = expires_at


class LockLostError(ArroyoError):
    """Our cleanup lease expired or was taken over; stop deleting at once."""


class StoreError(ArroyoError):
    """A permanent epoch store failure (bad SQL, constraint violation, auth failure...)."""


class TransientStoreError(StoreError):
    """A transient epoch store failure that persisted through the bounded retries."""


class SchemaError(ConfigurationError, StoreError):
    """The epoch store's schema is not the one this release ships: newer (a newer release migrated it),
    an applied migration whose text differs, or (:class:`SchemaMissingError`) missing or behind. Bad
    configuration, found before anything is written; retrying cannot fix it. The message says what to do."""


class SchemaMissingError(SchemaError):
    """The epoch store's database has no schema, or an older one than this package needs: migrate it."""

    def __init__(self, have: int, want: int, where: str = "", missing: str = "") -> None:
        what = "has no airflow-arroyo schema" if have == 0 else f"has schema version {have}, this package needs {want}"
        lacks = f" (it lacks {missing})" if missing and have else ""
        at = f" ({where})" if where else ""
        super().__init__(
            f"the epoch store's database{at} {what}{lacks}: run `airflow-arroyo migrate` against it (same DSN: "
            "--dsn or ARROYO_DSN), or let the Airflow hook migrate it, then start again"
        )
        self.have = have
        self.want = want


class SnapshotError(ArroyoError):
    """A snapshot could not be taken, verified or restored; names the epoch and path when known."""
    def __init__(self, message: str, *, epoch: int | None = None, path: str | None = None) -> None:
        super().__init__(message)
        self.epoch = epoch
        self.path = path


class UnrestorableEpochError(SnapshotError):
    """An epoch's snapshot of a stage is not a checkpoint Spark can restart from (its objects are missing or
    corrupt, or its files break Spark's own rules for a checkpoint); found before a restore's commit point, so
    nothing was changed. Restoring it again can never succeed: the driver records why in the store, and a
    supervisor stops instead of restarting into it (``stage`` and ``problems`` say where and what)."""

    def __init__(self, message: str, *, epoch: int, stage: str, problems: tuple[str, ...] = (),
                 path: str | None = None) -> None:
        super().__init__(message, epoch=epoch, path=path)
        self.stage = stage
        self.problems = problems


class PipelineFailedError(ArroyoError):
    """A pipeline run failed; ``cause`` is what the store recorded."""
    def __init__(self, pipeline_id: str, cause: str | None) -> None:
        super().__init__(f"pipeline {pipeline_id!r} failed: {cause or 'no cause reported'}")
        self.pipeline_id = pipeline_id
        self.cause = cause


class StageBuildError(PipelineFailedError):
    """A stage's source ``read`` or ``transform`` raised while the driver built the pipeline (before any
    query ran). The cause names the stage, keeps the exception's type and ends with its traceback."""

    def __init__(self, pipeline_id: str, stage: str, error: BaseException) -> None:
        detail = str(error).strip()
        head = f"stage {stage!r} could not be built: {type(error).__name__}" + (f": {detail}" if detail else "")
        trace = "".join(traceback.format_exception(error)).rstrip()
        if len(trace) > 3000:  # keep the innermost frames and the error line: where the user's code raised
            trace = "Traceback (most recent call last, outer frames cut):\n..." + trace[-3000:]
        super().__init__(pipeline_id, f"{head}\n{trace}")
        self.stage = stage
        self.error = error
