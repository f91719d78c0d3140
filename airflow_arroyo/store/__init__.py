"""The epoch store: PostgreSQL, the single source of truth for pipelines, epochs, acknowledgements,
snapshot objects and cleanup runs. Never imports Airflow (Spark drivers use it too)."""

from airflow_arroyo.store._async import AsyncEpochStore
from airflow_arroyo.store._listen import EpochWatch, Subscription, channel_of
from airflow_arroyo.store._migrate import available_migrations
from airflow_arroyo.store._retry import is_transient, retrying
from airflow_arroyo.store._sync import EpochStore, redact_dsn
from airflow_arroyo.store.reads import StoreReader
from airflow_arroyo.store.records import (
    AckOutcome,
    AckRecord,
    AckResult,
    CleanupLockRecord,
    CleanupRunRecord,
    CompactionCut,
    EpochRecord,
    FencingToken,
    ObjectRecord,
    PipelineRecord,
    PrunePlan,
    RestartRecord,
    SinkCommitRecord,
    SnapshotEntry,
    TickReport,
    TickRequest,
    TickResult,
)

__all__ = [
    "AckOutcome",
    "AckRecord",
    "AckResult",
    "AsyncEpochStore",
    "CleanupLockRecord",
    "CleanupRunRecord",
    "CompactionCut",
    "EpochRecord",
    "EpochStore",
    "EpochWatch",
    "FencingToken",
    "ObjectRecord",
    "PipelineRecord",
    "PrunePlan",
    "RestartRecord",
    "SinkCommitRecord",
    "SnapshotEntry",
    "StoreReader",
    "Subscription",
    "TickReport",
    "TickRequest",
    "TickResult",
    "available_migrations",
    "channel_of",
    "is_transient",
    "redact_dsn",
    "retrying",
]
