"""Airflow's data awareness: completed epochs and file-sink commits as Asset events.

Two kinds of Assets describe what a pipeline makes durable:

* :func:`sink_asset`: the folder of an exactly-once file sink. One event per commit (the driver moves
  the files of an epoch's batches into the folder, then records the commit in the epoch store):
  ``extra`` carries the sink's URI, the epoch, ``batch_id`` (the folder holds exactly the committed
  files of batches ``<= batch_id``, named ``<batch:012d>-...``), ``rows``, ``bytes`` and ``files``
  that commit made visible. A Delta Lake table sink's events also carry ``table_version``, the version
  the commit made (time travel reads exactly it, whatever the table holds by then).
* :func:`epochs_asset`: the pipeline's checkpoints. One event per completed epoch (``epoch``,
  ``bytes_new``, ``bytes_total``, ``duration_s``): a restorable, consistent cut.
* :func:`gate_asset`: a gated sink's epochs waiting for a verdict (:mod:`airflow_arroyo.core.gates`). One event per
  gate the driver opens, for a DAG that checks that epoch's pending output (:func:`pending_gates` reads them).

Two ways to emit them, because a deferred task cannot write Asset events (Airflow registers a task's
``outlet_events`` only when the task succeeds, and a trigger's events only resume its task):

* **While the pipeline runs**: an Asset built with ``watch=True`` (the default) carries an
  ``AssetWatcher`` with :class:`CommittedDataTrigger`, an event trigger that the triggerer runs for as
  long as a DAG is scheduled on the Asset; every event it yields becomes an Asset event (Airflow 3's
  event-driven scheduling), with the payload in ``extra["payload"]``. A DAG scheduled on the Asset
  runs after each commit and reads ``triggering_asset_events``.
* **When a task ends**: operators of this provider given such an Asset in ``outlets`` (e.g. the stop
  task) attach the latest commit or epoch to the Asset event Airflow records for them
  (:func:`publish_outlet_events`).

Helpers for the consumer: :func:`committed_payloads` reads the payloads of the triggering events (both
ways), and :func:`committed_files` lists the files of a sink that a given commit covers.
"""

from __future__ import annotations

import asyncio
import math
import os
from collections.abc import AsyncIterator, Iterable, Mapping
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

from airflow.sdk import Asset, AssetWatcher
from airflow.triggers.base import BaseEventTrigger, TriggerEvent

from airflow_arroyo import config
from airflow_arroyo.core.epochs import EpochState, validate_pipeline_id
from airflow_arroyo.core.exceptions import ArroyoError, ConfigurationError, UnknownPipelineError
from airflow_arroyo.triggers.asset_cursor import AssetCursor

if TYPE_CHECKING:
    from airflow.sdk import Context

    from airflow_arroyo.store import AsyncEpochStore, EpochRecord, EpochStore, SinkCommitRecord

__all__ = [
    "CommittedDataTrigger",
    "committed_files",
    "committed_payloads",
    "epoch_payload",
    "epochs_asset",
    "gate_asset",
    "pending_gates",
    "publish_outlet_events",
    "sink_asset",
    "sink_commit_payload",
]

KIND_SINK = "sink"
KIND_EPOCHS = "epochs"
SETTLE_AFTER = 10.0  # seconds without a new commit after which the last one is announced once more


def asset_uri(location: str) -> str:
    """A sink location as an Asset URI: a plain path becomes ``file://<absolute path>``."""
    if urlparse(location).scheme:
        return location.rstrip("/") or location
    return "file://" + os.path.abspath(location)


def sink_asset(pipeline_id: str, sink: str, uri: str, *, conn_id: str | None = None, watch: bool = True,
               poll_interval: float = 5.0) -> Asset:
    """The Asset of file sink ``sink`` (the sink stage's name) of ``pipeline_id``, writing to ``uri``."""
    validate_pipeline_id(pipeline_id)
    conn = conn_id or config.get("conn_id")
    meta: dict[str, Any] = {"arroyo": {"pipeline_id": pipeline_id, "kind": KIND_SINK, "sink": sink, "conn_id": conn}}
    trigger = CommittedDataTrigger(pipeline_id=pipeline_id, kind=KIND_SINK, sink=sink, conn_id=conn,
                                   poll_interval=poll_interval)
    watchers = [AssetWatcher(name=f"arroyo-{pipeline_id}-{sink}", trigger=trigger)] if watch else []
    return Asset(name=f"arroyo-{pipeline_id}-{sink}", uri=asset_uri(uri), group="arroyo", extra=meta,
                 watchers=watchers)


def epochs_asset(pipeline_id: str, *, conn_id: str | None = None, watch: bool = True,
                 poll_interval: float = 5.0) -> Asset:
    """The Asset of the completed epochs (checkpoints) of ``pipeline_id``."""
    validate_pipeline_id(pipeline_id)
    conn = conn_id or config.get("conn_id")
    meta: dict[str, Any] = {"arroyo": {"pipeline_id": pipeline_id, "kind": KIND_EPOCHS, "conn_id": conn}}
    watchers = [AssetWatcher(name=f"arroyo-{pipeline_id}-epochs", trigger=CommittedDataTrigger(
        pipeline_id=pipeline_id, kind=KIND_EPOCHS, conn_id=conn, poll_interval=poll_interval))] if watch else []
    return Asset(name=f"arroyo-{pipeline_id}-epochs", uri=f"x-arroyo://{pipeline_id}/epochs", group="arroyo",
                 extra=meta, watchers=watchers)


def gate_asset(pipeline_id: str, sink: str, *, conn_id: str | None = None, watch: bool = True,
               poll_interval: float = 5.0) -> Asset:
    """The Asset "an epoch's output of gated sink ``sink`` of ``pipeline_id`` is pending": one event per gate the
    driver opens (:class:`~airflow_arroyo.triggers.gates.GateOpenedTrigger`; payload: ``epoch``, ``batch_from``,
    ``batch_to``, ``uri``, ``deadline``...), for a DAG that checks it (:func:`pending_gates`)."""
    from airflow_arroyo.triggers.gates import KIND_GATE, GateOpenedTrigger

    validate_pipeline_id(pipeline_id)
    conn = conn_id or config.get("conn_id")
    meta: dict[str, Any] = {"arroyo": {"pipeline_id": pipeline_id, "kind": KIND_GATE, "sink": sink, "conn_id": conn}}
    name = f"arroyo-{pipeline_id}-{sink}-gates"
    watchers = [AssetWatcher(name=name, trigger=GateOpenedTrigger(
        pipeline_id=pipeline_id, sink=sink, conn_id=conn, poll_interval=poll_interval))] if watch else []
    return Asset(name=name, uri=f"x-arroyo://{pipeline_id}/gates/{sink}", group="arroyo", extra=meta,
                 watchers=watchers)


def sink_commit_payload(rec: SinkCommitRecord) -> dict[str, Any]:
    """The Asset event extra of one file-sink commit."""
    return {
        "kind": KIND_SINK, "pipeline_id": rec.pipeline_id, "sink": rec.sink, "uri": asset_uri(rec.uri),
        "epoch": rec.epoch, "batch_id": rec.batch_id, "rows": rec.rows_committed, "bytes": rec.bytes_committed,
        "files": rec.files, "run_id": rec.run_id, "committed_at": rec.committed_at.isoformat(), "seq": rec.seq,
        **({"table_version": rec.table_version} if rec.table_version is not None else {}),
    }


def epoch_payload(rec: EpochRecord) -> dict[str, Any]:
    """The Asset event extra of one completed epoch."""
    return {
        "kind": KIND_EPOCHS, "pipeline_id": rec.pipeline_id, "epoch": rec.epoch, "run_id": rec.run_id,
        "bytes_new": rec.bytes_new, "bytes_total": rec.bytes_total, "duration_s": rec.duration_s,
        "is_final": rec.is_final, "completed_at": rec.ended_at.isoformat() if rec.ended_at else None,
    }


class CommittedDataTrigger(AssetCursor, BaseEventTrigger):
    """An event trigger for an ``AssetWatcher``: one event per file-sink commit (``kind="sink"``) or per
    completed epoch (``kind="epochs"``) of ``pipeline_id``, as the epoch store records them.

    It starts after what the store holds when it first starts (no replay of the history). On Airflow
    >= 3.3 it keeps its position in the Asset's state store, moved once the triggerer has taken an
    event (asked for the next one), so a restarted triggerer resumes after the last event it took: at
    least once (an event yielded just before a stop may come again; reading a commit's files is
    idempotent). Without a state store it resumes from the store's present (commits made while no
    triggerer ran are not announced; they are in the folder all the same).

    When no new commit came for :data:`SETTLE_AFTER` seconds (the pipeline stopped or idles), the last
    one is announced once more (``"repeat": True`` in the payload). Airflow (3.3) can leave the last
    events of a burst without a DAG run: an Asset event that arrives while the DAG's queue row for the
    Asset exists (``AssetDagRunQueue``, inserted with ``ON CONFLICT DO NOTHING``) does not move that
    row's time, the run is created with its event window ending at that time, and the row is deleted,
    so a later event in the burst (typically the final commit of a stopped pipeline) is consumed by no
    run until another event comes. The repeat is that other event.
    """

    def __init__(self, pipeline_id: str, kind: str = KIND_SINK, sink: str | None = None,
                 conn_id: str | None = None, poll_interval: float = 5.0) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # BaseTrigger.__init__ has no annotations
        validate_pipeline_id(pipeline_id)
        if kind not in (KIND_SINK, KIND_EPOCHS):
            raise ConfigurationError(f"kind must be {KIND_SINK!r} or {KIND_EPOCHS!r}, got {kind!r}")
        if kind == KIND_SINK and not sink:
            raise ConfigurationError("a sink watcher needs the sink stage's name (sink=...)")
        if not (isinstance(poll_interval, int | float) and poll_interval > 0):
            raise ConfigurationError(f"poll_interval must be a positive number of seconds, got {poll_interval!r}")
        self.pipeline_id = pipeline_id
        self.kind = kind
        self.sink = sink
        self.conn_id = conn_id or config.get("conn_id")
        self.poll_interval = poll_interval

    def serialize(self) -> tuple[str, dict[str, Any]]:
        """Airflow: the class path and exactly the constructor arguments."""
        return (f"{type(self).__module__}.{type(self).__qualname__}",
                {"pipeline_id": self.pipeline_id, "kind": self.kind, "sink": self.sink, "conn_id": self.conn_id,
                 "poll_interval": self.poll_interval})

    async def _open_store(self) -> AsyncEpochStore:
        """The store client, built here (never serialized). A seam for tests."""
        from airflow_arroyo.hooks.arroyo import ArroyoHook

        return await ArroyoHook(self.conn_id).aget_store()

    async def run(self) -> AsyncIterator[TriggerEvent]:
        """Airflow: yield one event per new sink commit or completed epoch, from the stored cursor on."""
        store: AsyncEpochStore | None = None
        cursor = await self._load_cursor()
        last: dict[str, Any] | None = None  # the last payload announced, until it was repeated once
        quiet = 0  # looks without a new commit since it was announced
        settle = max(1, math.ceil(SETTLE_AFTER / self.poll_interval))
        while True:
            # A watcher lives as long as a DAG is scheduled on its Asset, and the triggerer does not
            # restart one that raised: whatever fails here (the store unreachable, a connection lost
            # in the middle of a read) is logged, and the next look tries again.
            payloads: list[tuple[int, dict[str, Any]]] = []
            try:
                if store is None:
                    store = await self._open_store()
                if cursor is None:
                    cursor = await self._present(store)
                    self.log.info("pipeline %s %s: announcing commits after %s", self.pipeline_id,
                                  self.sink or "epochs", cursor)
                payloads = await self._since(store, cursor)
            except UnknownPipelineError:
                pass  # not registered yet
            except Exception as exc:  # see above: keep watching, the next look may succeed
                self.log.warning("pipeline %s: error while watching commits (looking again in %gs): %s",
                                 self.pipeline_id, self.poll_interval, exc, exc_info=not isinstance(exc, ArroyoError))
            for position, payload in payloads:
                self.log.info("pipeline %s: %s epoch %s committed (%s rows, %s bytes)", self.pipeline_id,
                              payload.get("sink") or "checkpoint", payload["epoch"], payload.get("rows"),
                              payload.get("bytes", payload.get("bytes_new")))
                yield TriggerEvent(payload)
                last, quiet = payload, 0
                cursor = position
                try:
                    await self._save_cursor(cursor)
                except Exception as exc:  # a lost cursor costs a repeated event, not the watcher
                    self.log.warning("pipeline %s: could not save the watcher's position %s: %s", self.pipeline_id,
                                     cursor, exc, exc_info=True)
            if not payloads and last is not None:
                quiet += 1
                if quiet >= settle:
                    self.log.info("pipeline %s: nothing new for %gs; announcing epoch %s once more", self.pipeline_id,
                                  SETTLE_AFTER, last["epoch"])
                    yield TriggerEvent({**last, "repeat": True})
                    last = None
            await asyncio.sleep(self.poll_interval)

    async def _present(self, store: AsyncEpochStore) -> int:
        """Where the store is now: the last commit's seq, or the latest completed epoch."""
        if self.kind == KIND_SINK:
            last = 0
            while True:
                page = await store.sink_commits(self.pipeline_id, after_seq=last, sink=self.sink, limit=1000)
                if not page:
                    return last
                last = page[-1].seq
        try:
            latest = await store.latest_completed_epoch(self.pipeline_id)
        except UnknownPipelineError:
            return 0
        return latest.epoch if latest is not None else 0

    async def _since(self, store: AsyncEpochStore, cursor: int) -> list[tuple[int, dict[str, Any]]]:
        if self.kind == KIND_SINK:
            commits = await store.sink_commits(self.pipeline_id, after_seq=cursor, sink=self.sink)
            return [(c.seq, sink_commit_payload(c)) for c in commits]
        # completed epochs after the cursor, oldest first (pruned ones too, if they had completed: their outcome)
        epochs = await store.list_epochs(self.pipeline_id, limit=100,
                                         states=[EpochState.COMPLETED, EpochState.PRUNING, EpochState.PRUNED])
        newer = sorted((e for e in epochs if e.epoch > cursor and e.outcome is EpochState.COMPLETED),
                       key=lambda e: e.epoch)
        return [(e.epoch, epoch_payload(e)) for e in newer]


# ---------------------------------------------------------------- tasks: outlets


def _arroyo_meta(asset: object) -> Mapping[str, Any] | None:
    extra = getattr(asset, "extra", None)
    meta = extra.get("arroyo") if isinstance(extra, Mapping) else None
    return meta if isinstance(meta, Mapping) else None


def publish_outlet_events(context: Context, outlets: Iterable[object], store: EpochStore, pipeline_id: str) -> int:
    """Attach the latest commit (sink Assets) or completed epoch (epochs Assets) of ``pipeline_id`` to the
    Asset events Airflow records for the task's ``outlets`` when it succeeds; returns how many."""
    done = 0
    for asset in outlets:
        meta = _arroyo_meta(asset)
        if meta is None or meta.get("pipeline_id") != pipeline_id:
            continue
        payload: dict[str, Any] | None = None
        if meta.get("kind") == KIND_SINK:
            commit = store.latest_sink_commit(pipeline_id, str(meta.get("sink")))
            payload = sink_commit_payload(commit) if commit is not None else None
        elif meta.get("kind") == KIND_EPOCHS:
            latest = store.latest_completed_epoch(pipeline_id)
            payload = epoch_payload(latest) if latest is not None else None
        if payload is not None:
            context["outlet_events"][asset].extra = {"payload": payload}  # type: ignore[index]
            done += 1
    return done


# ---------------------------------------------------------------- consumers


def committed_payloads(events: Iterable[Any]) -> list[dict[str, Any]]:
    """The Arroyo payloads of Asset events (``triggering_asset_events[asset]``), oldest epoch first.

    Events from a watcher carry the payload in ``extra["payload"]`` (Airflow's ``from_trigger``
    events), events of a task's outlets the same way."""
    out = []
    for event in events:
        extra = getattr(event, "extra", None) or (event.get("extra") if isinstance(event, Mapping) else None) or {}
        payload = extra.get("payload") if isinstance(extra, Mapping) else None
        if isinstance(payload, Mapping) and "epoch" in payload:
            out.append(dict(payload))
    return sorted(out, key=lambda p: (int(p["epoch"]), int(p.get("seq") or 0)))


def pending_gates(events: Iterable[Any]) -> list[dict[str, Any]]:
    """The gates announced by :func:`gate_asset` events (``triggering_asset_events[asset]``), one per epoch (a
    repeated announcement counts once), oldest epoch first."""
    from airflow_arroyo.triggers.gates import KIND_GATE

    by_epoch: dict[tuple[str, str, int], dict[str, Any]] = {}
    for event in events:
        extra = getattr(event, "extra", None) or (event.get("extra") if isinstance(event, Mapping) else None) or {}
        payload = extra.get("payload") if isinstance(extra, Mapping) else None
        if isinstance(payload, Mapping) and payload.get("kind") == KIND_GATE and "epoch" in payload:
            key = (str(payload.get("pipeline_id")), str(payload.get("sink")), int(payload["epoch"]))
            by_epoch.setdefault(key, {k: v for k, v in payload.items() if k != "repeat"})
    return [by_epoch[k] for k in sorted(by_epoch, key=lambda k: (k[2], k[0], k[1]))]


def committed_files(uri: str, batch_id: int) -> list[str]:
    """The data files of a sink folder that a commit through ``batch_id`` made visible (and those of earlier
    commits), as the sink's own reader sees them (:func:`airflow_arroyo.runtime.sinks.files.committed_files`:
    by its manifests, so neither pending files nor a superseded run's are listed). Paths are relative to
    the folder."""
    from airflow_arroyo.runtime.sinks.files import committed_files as sink_files

    return sink_files(uri, through=batch_id)
