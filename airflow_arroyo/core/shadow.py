"""Shadow runs: run new code beside the live pipeline, compare, then promote or discard.
Airflow-free; ``airflow-arroyo shadow ...`` calls it.

* **start**: fork a completed epoch of the live pipeline (pinned by the fork, ``fork:<shadow>``) into the shadow
  pipeline, record it as a shadow (``arroyo_shadows``) with its new code and its sinks redirected
  (:func:`plan_shadow_sinks`: a file sink's folder -> the sibling folder ``<path>.shadow-<shadow id>``; a PostgreSQL
  table -> ``<table>_shadow_<shadow id>``; Kafka, Delta and ``foreach_batch`` sinks are refused). The shadow's driver
  runs the new code through :func:`shadow_code` (``--pipeline airflow_arroyo.core.shadow:shadow_code --arg code=...
  --arg shadow_id=...``), which renames the pipeline and redirects its sinks: the shadow never writes a live target.
* **compare**: the live pipeline's epochs after the fork point and the shadow's own epochs, aligned by the input
  they covered (:func:`align_windows`, from each epoch's provenance), per sink the rows each side committed for a
  window, diffed by :func:`diff_rows` (added, removed, changed): a file sink's committed files of the window's
  epochs; a PostgreSQL sink's batches between the window's cuts, read from the sink's journal
  (:func:`~airflow_arroyo.runtime.sinks.postgres.shadow_window_rows`; the fork point's pin keeps the live journal,
  a shadow's sinks keep theirs whole), for an upsert table per key its row at each side's cut.
* **promote**: the live pipeline is upgraded to the shadow's code from its own latest epoch
  (:func:`airflow_arroyo.core.upgrades.prepare_upgrade`), then the shadow is discarded.
* **discard**: the shadow must be stopped; its fork point is unpinned (``--force`` when the shadow never completed
  an epoch of its own), the record marked ``discarded``. Its epochs and shadow sink data are left where they are.

The pure parts (:func:`plan_shadow_sinks`, :func:`align_windows`, :func:`diff_rows`) take values only.
"""

from __future__ import annotations

import copy
import dataclasses
import io
import json
import re
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from airflow_arroyo.core.epochs import EpochState, PipelineState
from airflow_arroyo.core.exceptions import ArroyoError, ConfigurationError, StateConflictError

if TYPE_CHECKING:
    from airflow_arroyo.core.provenance import EpochProvenance
    from airflow_arroyo.core.upgrades import UpgradeReady
    from airflow_arroyo.runtime.graph import StageSpec
    from airflow_arroyo.runtime.pipeline import Pipeline
    from airflow_arroyo.store import EpochStore
    from airflow_arroyo.store.shadows import ShadowRecord

__all__ = ["EpochInput", "RowDiff", "SinkDiff", "Window", "align_windows", "compare_shadow", "diff_rows",
           "discard_shadow", "plan_shadow_sinks", "promote_shadow", "shadow_code", "shadow_pipeline", "sink_dsn",
           "start_shadow"]

_FILE_FORMATS = frozenset({"parquet", "orc", "json", "csv", "text"})


# ---------------------------------------------------------------------------------------------- sinks (pure)

def _suffix(shadow_id: str) -> str:
    return re.sub(r"[^0-9A-Za-z_]", "_", shadow_id).lower()


def plan_shadow_sinks(stages: Iterable[StageSpec], shadow_id: str) -> dict[str, dict[str, Any]]:
    """Each sink of ``stages`` -> ``{"kind", "live", "shadow"[, "format"]}``: where the shadow writes instead; a
    PostgreSQL sink adds its ``key``, ``mode`` and how its database is named (``dsn_env`` or ``conn_id``, for the
    compare; a literal ``dsn=`` is not recorded: it may hold a password). Refuses (:class:`ConfigurationError`,
    naming the sink) a sink it cannot redirect."""
    out: dict[str, dict[str, Any]] = {}
    for s in stages:
        if s.kind.value != "sink":
            continue
        if s.sink_format in _FILE_FORMATS:
            live = str(s.sink_options["path"]).rstrip("/")
            out[s.name] = {"kind": "files", "format": s.sink_format, "live": live,
                           "shadow": f"{live}.shadow-{shadow_id}"}
        elif s.postgres is not None:
            out[s.name] = {"kind": "postgres", "live": s.postgres.table,
                           "shadow": f"{s.postgres.table}_shadow_{_suffix(shadow_id)}",
                           "key": list(s.postgres.key), "mode": s.postgres.mode,
                           **{n: getattr(s.postgres, n) for n in ("dsn_env", "conn_id") if getattr(s.postgres, n)}}
        else:
            what = ("a Kafka topic" if s.kafka is not None else "a Delta table" if s.table is not None
                    else "foreach_batch" if s.foreach_batch is not None else f"format {s.sink_format!r}")
            raise ConfigurationError(
                f"sink {s.name!r} writes {what}: a shadow run redirects file sinks and PostgreSQL tables only; "
                "give the new code a file or PostgreSQL sink for it, or compare it by hand")
    return out


def _redirect(s: StageSpec, target: Mapping[str, Any]) -> StageSpec:
    if target["kind"] == "files":
        return dataclasses.replace(s, sink_options={**s.sink_options, "path": target["shadow"]})
    assert s.postgres is not None
    # the journal kept whole: the compare reads each epoch's rows from it
    return dataclasses.replace(s, postgres=dataclasses.replace(s.postgres, table=target["shadow"], keep_journal=True))


def shadow_pipeline(pipeline: Pipeline, shadow_id: str) -> Pipeline:
    """A copy of ``pipeline`` named ``shadow_id`` whose sinks write their shadow targets; gates dropped (nobody
    reviews a shadow's output: it is compared)."""
    sinks = plan_shadow_sinks(pipeline.stages, shadow_id)
    shadow = copy.copy(pipeline)
    shadow.pipeline_id = shadow_id
    shadow._stages = [dataclasses.replace(_redirect(s, sinks[s.name]), gate=None) if s.name in sinks else s
                      for s in pipeline.stages]
    return shadow


def shadow_code(code: str, shadow_id: str, **kwargs: Any) -> Pipeline:
    """The driver's entry for a shadow: ``--pipeline airflow_arroyo.core.shadow:shadow_code --arg code=MODULE:ATTR
    --arg shadow_id=ID`` (other ``--arg`` go to the code's own function)."""
    from airflow_arroyo.runtime.driver import load_pipeline

    return shadow_pipeline(load_pipeline(code, kwargs or None), shadow_id)


# ---------------------------------------------------------------------------------------------- alignment (pure)

@dataclass(frozen=True)
class EpochInput:
    """An epoch and the input its cut covered: the end offsets of every Spark source (channels excluded), as a
    canonical key (a channel's ``{"key", "pos"}`` offsets are left out: positions differ between two runs that
    read the same input), and a progress figure (the sum of the numeric offsets) to tell which side is behind."""

    epoch: int
    end: tuple[str, ...]
    progress: float


def epoch_input(prov: EpochProvenance) -> EpochInput:
    """The :class:`EpochInput` of an epoch's provenance."""
    ends = sorted(json.dumps(r.end, sort_keys=True) for st in prov.stages for r in st.sources
                  if r.end is not None and not set(r.end) <= {"key", "pos"})
    return EpochInput(prov.epoch, tuple(ends), float(sum(_numbers(json.loads(e)) for e in ends)))


def _numbers(value: Any) -> float:
    if isinstance(value, bool):
        return 0.0
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return 0.0
    if isinstance(value, Mapping):
        return sum(_numbers(v) for v in value.values())
    if isinstance(value, list | tuple):
        return sum(_numbers(v) for v in value)
    return 0.0


@dataclass(frozen=True)
class Window:
    """Live epochs and shadow epochs that together covered the same input (their last cuts end at the same
    offsets). ``closed`` False: the trailing epochs of one side whose input the other has not reached yet."""

    live: tuple[int, ...]
    shadow: tuple[int, ...]
    closed: bool = True


def align_windows(live: Sequence[EpochInput], shadow: Sequence[EpochInput]) -> list[Window]:
    """Group both sides' epochs (each in epoch order, after the fork point) into windows of equal input: a window
    closes where a live cut and a shadow cut end at the same offsets. Where the two runs cut at the same input
    (a bounded or idle source, or the same epoch timing), each window is one epoch of each: epoch by epoch.
    Epochs that read nothing new join the window before them."""
    windows: list[Window] = []
    i = j = 0
    cur_l: list[int] = []
    cur_s: list[int] = []
    last_l: EpochInput | None = None
    last_s: EpochInput | None = None
    while i < len(live) or j < len(shadow):
        if last_l is not None and last_s is not None and last_l.end == last_s.end and (cur_l or cur_s):
            # absorb epochs that read nothing new on either side into the closing window
            while i < len(live) and live[i].end == last_l.end:
                cur_l.append(live[i].epoch)
                i += 1
            while j < len(shadow) and shadow[j].end == last_s.end:
                cur_s.append(shadow[j].epoch)
                j += 1
            windows.append(Window(tuple(cur_l), tuple(cur_s)))
            cur_l, cur_s = [], []
            continue
        take_live = j >= len(shadow) or (i < len(live) and (last_l is None or last_s is not None and
                                                            (last_l.progress <= last_s.progress)))
        if take_live and i < len(live):
            last_l = live[i]
            cur_l.append(live[i].epoch)
            i += 1
        else:
            last_s = shadow[j]
            cur_s.append(shadow[j].epoch)
            j += 1
    if cur_l or cur_s:
        closed = last_l is not None and last_s is not None and last_l.end == last_s.end
        windows.append(Window(tuple(cur_l), tuple(cur_s), closed))
    return windows


# ---------------------------------------------------------------------------------------------- row diff (pure)

@dataclass(frozen=True)
class RowDiff:
    """Rows the shadow has and the live pipeline has not (``added``), the other way round (``removed``), and
    keys both have with other values (``changed``; only with a key). Counts, plus a few examples of each."""

    added: int
    removed: int
    changed: int
    live_rows: int
    shadow_rows: int
    examples: dict[str, list[Any]] = field(default_factory=dict)

    @property
    def same(self) -> bool:
        """No difference."""
        return not (self.added or self.removed or self.changed)


def _canon(row: Mapping[str, Any]) -> str:
    return json.dumps({k: row[k] for k in sorted(row)}, sort_keys=True, default=str)


def diff_rows(live: Iterable[Mapping[str, Any]], shadow: Iterable[Mapping[str, Any]],
              key: Sequence[str] = (), *, examples: int = 3) -> RowDiff:
    """Diff two bags of rows. Without ``key``: multiset difference (a row twice on one side and once on the
    other is one added or removed). With ``key``: per key, a key on one side only is added/removed (each of its
    rows), a key on both sides whose bags of rows differ is one changed."""
    live, shadow = list(live), list(shadow)
    ex: dict[str, list[Any]] = {"added": [], "removed": [], "changed": []}
    if not key:
        lc, sc = Counter(map(_canon, live)), Counter(map(_canon, shadow))
        added, removed = sc - lc, lc - sc
        ex["added"] = [json.loads(r) for r in list(added)[:examples]]
        ex["removed"] = [json.loads(r) for r in list(removed)[:examples]]
        return RowDiff(sum(added.values()), sum(removed.values()), 0, len(live), len(shadow),
                       {k: v for k, v in ex.items() if v})
    by_l: dict[str, Counter[str]] = {}
    by_s: dict[str, Counter[str]] = {}
    for rows, into in ((live, by_l), (shadow, by_s)):
        for r in rows:
            k = json.dumps([r.get(c) for c in key], default=str)
            into.setdefault(k, Counter())[_canon(r)] += 1
    a = r_ = c = 0
    for k in by_s.keys() - by_l.keys():
        a += sum(by_s[k].values())
        if len(ex["added"]) < examples:
            ex["added"].append(json.loads(next(iter(by_s[k]))))
    for k in by_l.keys() - by_s.keys():
        r_ += sum(by_l[k].values())
        if len(ex["removed"]) < examples:
            ex["removed"].append(json.loads(next(iter(by_l[k]))))
    for k in sorted(by_l.keys() & by_s.keys()):
        if by_l[k] != by_s[k]:
            c += 1
            if len(ex["changed"]) < examples:
                ex["changed"].append({"key": json.loads(k), "live": [json.loads(x) for x in by_l[k]],
                                      "shadow": [json.loads(x) for x in by_s[k]]})
    return RowDiff(a, r_, c, len(live), len(shadow), {k: v for k, v in ex.items() if v})


# ---------------------------------------------------------------------------------------------- use cases (I/O)

def start_shadow(store: EpochStore, live_id: str, epoch: int, shadow_id: str, code: str,
                 pipeline: Pipeline | None = None) -> ShadowRecord:
    """Fork ``epoch`` of ``live_id`` into ``shadow_id`` (pinning it) and record the shadow running ``code`` with
    its sinks redirected. ``pipeline``: the loaded new code (default: loaded from ``code``). The sinks are planned
    before anything is written, so a sink that cannot be redirected changes nothing."""
    from airflow_arroyo.runtime.driver import load_pipeline

    new = pipeline if pipeline is not None else load_pipeline(code)
    sinks = plan_shadow_sinks(new.stages, shadow_id)
    store.fork_pipeline(live_id, epoch, shadow_id)
    return store.record_shadow(shadow_id, live_id, epoch, code, sinks)


@dataclass(frozen=True)
class SinkDiff:
    """One sink in one window."""

    sink: str
    window: Window
    diff: RowDiff | None
    note: str = ""


def _completed_after(store: EpochStore, pipeline_id: str, after: int) -> list[int]:
    epochs = store.list_epochs(pipeline_id, limit=10_000, states=[EpochState.COMPLETED])
    return sorted(e.epoch for e in epochs if e.epoch > after)


def read_file_rows(uri: str, names: Sequence[str], fmt: str) -> list[dict[str, Any]]:
    """The rows of a file sink's committed files ``names`` (relative to ``uri``)."""
    import pyarrow as pa
    import pyarrow.csv as pcsv
    import pyarrow.json as pjson
    import pyarrow.orc as porc
    import pyarrow.parquet as pq

    from airflow_arroyo.core.fs import FileSystem

    fs = FileSystem.of(uri)
    rows: list[dict[str, Any]] = []
    for name in names:
        if name.rsplit("/", 1)[-1].startswith((".", "_")) or name.endswith(".crc"):
            continue
        data = fs.read_bytes(name)
        if not data:
            continue
        if fmt == "parquet":
            table = pq.read_table(pa.BufferReader(data))
        elif fmt == "orc":
            table = porc.read_table(pa.BufferReader(data))
        elif fmt == "json":
            table = pjson.read_json(io.BytesIO(data))
        elif fmt == "csv":
            table = pcsv.read_csv(io.BytesIO(data))
        else:
            rows.extend({"value": line} for line in data.decode().splitlines())
            continue
        rows.extend(table.to_pylist())
    return rows


RowReader = Callable[[str, Sequence[str], str], list[dict[str, Any]]]


def _sink_files(prov: Mapping[int, EpochProvenance], epochs: Sequence[int], sink: str) -> tuple[str | None, list[str]]:
    """The committed file names of ``sink`` over ``epochs`` and its folder."""
    uri, out = None, []
    for e in epochs:
        for s in prov[e].sinks:
            if s.sink == sink:
                uri = s.uri
                out.extend(s.file_names or [])
    return uri, out


def sink_dsn(target: Mapping[str, Any]) -> str:
    """The DSN of a PostgreSQL shadow target's database (a :func:`plan_shadow_sinks` entry), from its ``dsn_env`` or
    ``conn_id`` read in this process's environment, as the sink's driver reads it."""
    from airflow_arroyo.runtime.sinks.postgres import PostgresTarget

    if not (target.get("dsn_env") or target.get("conn_id")):
        raise ConfigurationError(
            f"the PostgreSQL sink on {target.get('live')!r} names its database with dsn=..., which the shadow record "
            "does not keep (it may hold a password): give the sink dsn_env= or conn_id= and start a new shadow")
    return PostgresTarget(table=str(target["live"]), dsn_env=target.get("dsn_env"),
                          conn_id=target.get("conn_id")).resolve_dsn()


def _sink_cut(prov: EpochProvenance, sink: str) -> int:
    cut = next((st.batch_id for st in prov.stages if st.stage == sink), None)
    if cut is None:
        raise ConfigurationError(f"epoch {prov.epoch} of pipeline {prov.pipeline_id!r} has no cut of sink {sink!r}")
    return cut


def _fork_cut(store: EpochStore, shadow: ShadowRecord, sink: str) -> int:
    cut = next(((a.details or {}).get("batch_id") for a in store.acks(shadow.live_id, shadow.fork_epoch)
                if a.stage == sink), None)
    if not isinstance(cut, int):
        raise ConfigurationError(f"the fork point, epoch {shadow.fork_epoch} of pipeline {shadow.live_id!r}, has no "
                                 f"cut of sink {sink!r}")
    return cut


_Provenances = Mapping[int, "EpochProvenance"]


def _postgres_diffs(store: EpochStore, shadow: ShadowRecord, sink: str, target: Mapping[str, Any],
                    windows: Sequence[Window], prov: tuple[_Provenances, _Provenances], key: Sequence[str],
                    dsn_of: Callable[[Mapping[str, Any]], str]) -> list[SinkDiff]:
    """A PostgreSQL sink's diff per closed window: each side's batches from its cut before the window (the fork
    point's for the first) through its cut at the window's last epoch, read from the sinks' journals."""
    from airflow_arroyo.runtime.sinks import postgres as pg

    closed = [w for w in windows if w.closed]
    out = {w: SinkDiff(sink, w, None, "open: the other side has not reached this input yet")
           for w in windows if not w.closed}
    try:
        if "mode" not in target:
            raise ConfigurationError("the shadow was started before PostgreSQL sinks were compared (its record "
                                     "lacks the sink's mode); start a new shadow to compare this sink")
        base = _fork_cut(store, shadow, sink)
        batches, last = [], (base, base)
        for w in windows:
            live_cut = _sink_cut(prov[0][w.live[-1]], sink) if w.live else last[0]
            shadow_cut = _sink_cut(prov[1][w.shadow[-1]], sink) if w.shadow else last[1]
            if w.closed:
                batches.append(pg.BatchWindow(last[0], live_cut, last[1], shadow_cut))
            last = (live_cut, shadow_cut)
        dsn = dsn_of(target)
        mode, sink_key = target["mode"], tuple(target.get("key") or ())
        live = pg.TransactionalPostgresSink(shadow.live_id, sink, pg.PostgresTarget(
            table=target["live"], dsn=dsn, mode=mode, key=sink_key))
        shade = pg.TransactionalPostgresSink(shadow.shadow_id, sink, pg.PostgresTarget(
            table=target["shadow"], dsn=dsn, mode=mode, key=sink_key, keep_journal=True))
        rows = pg.shadow_window_rows(live, shade, base, batches)
    except ArroyoError as exc:
        out.update({w: SinkDiff(sink, w, None, str(exc)) for w in closed})
        return [out[w] for w in windows]
    for w, got in zip(closed, rows, strict=True):
        out[w] = (SinkDiff(sink, w, None, "completed, not committed yet: compare again") if got is None
                  else SinkDiff(sink, w, diff_rows(got[0], got[1], key)))
    return [out[w] for w in windows]


def compare_shadow(store: EpochStore, shadow_id: str, *, key: Mapping[str, Sequence[str]] | None = None,
                   read_rows: RowReader = read_file_rows,
                   pg_dsn: Callable[[Mapping[str, Any]], str] = sink_dsn) -> dict[str, Any]:
    """The comparison of a shadow with its live pipeline: windows of equal input and, per sink in both, per
    window, the :class:`RowDiff` of the rows each side committed. ``key``: per sink, its key columns (a
    PostgreSQL sink's key by default). ``pg_dsn``: a PostgreSQL shadow target's database (:func:`sink_dsn`: from the
    environment; the UI resolves an Airflow connection)."""
    from airflow_arroyo.core.provenance import epoch_provenance

    shadow = store.get_shadow(shadow_id)
    live_epochs = _completed_after(store, shadow.live_id, shadow.fork_epoch)
    shadow_epochs = _completed_after(store, shadow_id, shadow.fork_epoch)
    live_prov = {e: epoch_provenance(store, shadow.live_id, e) for e in live_epochs}
    shadow_prov = {e: epoch_provenance(store, shadow_id, e) for e in shadow_epochs}
    windows = align_windows([epoch_input(live_prov[e]) for e in live_epochs],
                            [epoch_input(shadow_prov[e]) for e in shadow_epochs])
    live_sinks = {s.sink for p in live_prov.values() for s in p.sinks} | set(shadow.sinks)
    result: list[SinkDiff] = []
    for sink, target in sorted(shadow.sinks.items()):
        if sink not in live_sinks:
            continue
        sink_key = tuple((key or {}).get(sink, target.get("key") or ()))
        if target["kind"] == "postgres":
            result += _postgres_diffs(store, shadow, sink, target, windows, (live_prov, shadow_prov), sink_key,
                                      pg_dsn)
            continue
        for w in windows:
            if not w.closed:
                result.append(SinkDiff(sink, w, None, "open: the other side has not reached this input yet"))
                continue

            live_uri, live_names = _sink_files(live_prov, w.live, sink)
            sh_uri, sh_names = _sink_files(shadow_prov, w.shadow, sink)
            fmt = target.get("format", "parquet")
            live_rows = read_rows(live_uri or target["live"], live_names, fmt) if live_names else []
            shadow_rows = read_rows(sh_uri or target["shadow"], sh_names, fmt) if sh_names else []
            result.append(SinkDiff(sink, w, diff_rows(live_rows, shadow_rows, sink_key)))
    return {"shadow_id": shadow_id, "live_id": shadow.live_id, "fork_epoch": shadow.fork_epoch,
            "state": shadow.state, "code": shadow.code, "sinks": shadow.sinks,
            "windows": [dataclasses.asdict(w) for w in windows],
            "diffs": [{"sink": d.sink, "live_epochs": list(d.window.live), "shadow_epochs": list(d.window.shadow),
                       "closed": d.window.closed, "note": d.note,
                       **(dataclasses.asdict(d.diff) if d.diff is not None else {})} for d in result]}


def _check_stopped(store: EpochStore, pipeline_id: str) -> None:
    state = store.get_pipeline(pipeline_id).state
    if state not in (PipelineState.STOPPED, PipelineState.FAILED):
        raise StateConflictError(f"shadow {pipeline_id!r} is {state.value}: stop it first "
                                 f"(airflow-arroyo stop {pipeline_id}); nothing was changed")


def discard_shadow(store: EpochStore, shadow_id: str, *, force: bool = False,
                   end: str = "discarded") -> ShadowRecord:
    """Discard a stopped shadow: unpin its fork point when the pin is the fork's own (``fork:<shadow>``; a pin
    someone set before stays), ``force`` when the shadow never completed an epoch of its own, and mark it
    ``end`` (``discarded``; ``promoted`` from :func:`promote_shadow`). Its epochs and its shadow sinks' data are
    left (retention prunes the epochs; remove the shadow folders/tables by hand). The live pipeline is not
    touched."""
    from airflow_arroyo.store.pins import PIN_LABEL_MAX

    shadow = store.get_shadow(shadow_id)
    if shadow.state != "active":
        return store.end_shadow(shadow_id, end)  # the same end again: a no-op; another: refused by name
    _check_stopped(store, shadow_id)
    point = store.get_epoch(shadow.live_id, shadow.fork_epoch)
    if point.pin_label is not None and point.pin_label == f"fork:{shadow_id}"[:PIN_LABEL_MAX]:
        store.unpin_epoch(shadow.live_id, shadow.fork_epoch, force=force)
    return store.end_shadow(shadow_id, end)


def promote_shadow(store: EpochStore, shadow_id: str, **upgrade: Any) -> tuple[UpgradeReady, ShadowRecord]:
    """Promote: the live pipeline is upgraded to the shadow's code from its own latest epoch
    (:func:`~airflow_arroyo.core.upgrades.prepare_upgrade`: plan, graceful stop, pin, plan again; ``upgrade`` are its
    keyword arguments), then the shadow, which must be stopped, is discarded and marked ``promoted``. Returns the
    :class:`~airflow_arroyo.core.upgrades.UpgradeReady` (how to start the code) and the record. A refused plan changes
    nothing (the shadow stays active); the caller starts the new code as ``airflow-arroyo upgrade`` does."""
    from airflow_arroyo.core.upgrades import prepare_upgrade
    from airflow_arroyo.runtime.driver import load_pipeline

    shadow = store.get_shadow(shadow_id)
    if shadow.state != "active":
        raise StateConflictError(f"shadow {shadow_id!r} is {shadow.state}; only an active shadow is promoted")
    _check_stopped(store, shadow_id)
    code = load_pipeline(shadow.code)
    ready = prepare_upgrade(store, shadow.live_id, code.validate(), chaining=code.chaining, **upgrade)
    return ready, discard_shadow(store, shadow_id, force=True, end="promoted")
