"""Errors raised by airflow-arroyo.

The tree is small on purpose::

    ArroyoError                      base of everything this package raises
    ├── ConfigurationError           bad input from the user: raised before anything is written
    │   ├── PipelineGraphError       the pipeline graph is invalid (names the stage and the fix)
    │   └── SchemaMissingError       the epoch store's database lacks (part of) the schema: migrate it
    ├── UnknownPipelineError         no pipeline registered under that id
    ├── IllegalTransitionError       a life-cycle change the state machine does not allow
    ├── ConcurrencyConflict          another actor won the race (e.g. epoch already in flight)
    ├── CleanupLockHeld              the pipeline's cleanup lock is held by someone else
    ├── LockLostError                our cleanup lease expired or was taken over mid-run
    ├── StoreError                   a permanent epoch-store failure (not retried)
    │   └── TransientStoreError      a transient failure that survived the bounded retries
    ├── SnapshotError                a snapshot file is missing or corrupt (names epoch and file)
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
    "IllegalTransitionError",
    "LockLostError",
    "PipelineFailedError",
    "PipelineGraphError",
    "SchemaMissingError",
    "SnapshotError",
    "StageBuildError",
    "StoreError",
    "TransientStoreError",
    "UnknownPipelineError",
]


class ArroyoError(Exception):
    """Base class of every error raised by airflow-arroyo."""


class ConfigurationError(ArroyoError, ValueError):
    """Invalid user input. Raised before anything is written."""


class PipelineGraphError(ConfigurationError):
    """The pipeline graph is invalid (unknown channel, stage without input, ...)."""


class SchemaMissingError(ConfigurationError):
    """The epoch store's database has no schema, or an older one than this package needs."""

    def __init__(self, have: int, want: int, where: str = "") -> None:
        what = "has no airflow-arroyo schema" if have == 0 else f"has schema version {have}, this package needs {want}"
        at = f" ({where})" if where else ""
        super().__init__(
            f"the epoch store's database{at} {what}: run `airflow-arroyo migrate` against it (same DSN: --dsn or "
            "ARROYO_DSN), or let the Airflow hook migrate it, then start again"
        )
        self.have = have
        self.want = want


class UnknownPipelineError(ArroyoError, LookupError):
    def __init__(self, pipeline_id: str) -> None:
        super().__init__(
            f"no pipeline named {pipeline_id!r} is registered in the epoch store; "
            "check the id (see `airflow-arroyo pipelines`) or start the pipeline first so that it registers"
        )
        self.pipeline_id = pipeline_id


class IllegalTransitionError(ArroyoError):
    def __init__(self, kind: str, current: str, target: str, *, subject: str = "") -> None:
        where = f" ({subject})" if subject else ""
        super().__init__(f"illegal {kind} transition {current!r} -> {target!r}{where}")
        self.kind = kind
        self.current = current
        self.target = target


class ConcurrencyConflict(ArroyoError):
    """Another actor changed the same rows first; the caller lost a race and should re-read."""


class CleanupLockHeld(ArroyoError):
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


class SnapshotError(ArroyoError):
    def __init__(self, message: str, *, epoch: int | None = None, path: str | None = None) -> None:
        super().__init__(message)
        self.epoch = epoch
        self.path = path


class PipelineFailedError(ArroyoError):
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
