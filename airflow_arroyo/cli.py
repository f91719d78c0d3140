"""``airflow-arroyo``: a small ops CLI for the epoch store.

::

    airflow-arroyo [--dsn DSN | --conn-id CONN_ID] [--json] COMMAND

    migrate                                   apply missing schema migrations
    pipelines                                 list registered pipelines (with supervision and restart count)
    epochs PIPELINE [--limit N]               a pipeline's epochs, newest first
    restarts PIPELINE [--lineage L]           a supervised pipeline's failures and restarts, newest first
    prune (PIPELINE | --all) [--keep-last K] [--keep-newer-than 1h]
                                              prune old epochs under the cleanup lock
    lock PIPELINE                             who holds the pipeline's cleanup lock
    stop PIPELINE [--immediate] [--wait 2m] [--pin LABEL]
                                              ask a running pipeline to stop (graceful: after a final epoch,
                                              which --pin pins once the run has stopped)
    pin PIPELINE EPOCH --label TEXT [--replace] / unpin PIPELINE EPOCH [--force]
                                              keep an epoch out of retention / let the policy apply again
    fork SOURCE --epoch N --to NEW            a new pipeline starting from epoch N of SOURCE (snapshots shared)
    restore PIPELINE [--epoch N|latest]       check that an epoch can be restored; print how to launch it
    verify PIPELINE [--epoch N] [--budget DURATION]
                                              re-hash snapshot objects; name damaged epochs (exit 3)
    checkpoint PIPELINE [--self-contained] [--timeout DURATION]
                                              fire one epoch now and wait for its end
    state PIPELINE --epoch N --stage S [--operator ID] [--limit N] [--diff M]
                                              a stage's state as of a completed epoch (or its diff against
                                              epoch M), read by a local Spark session from the epoch's snapshot
    provenance PIPELINE --epoch N | --file PATH | --table-version V --sink S
                                              what an epoch read (source offsets, file names), snapshotted and
                                              committed; which epoch wrote a sink's file or table version
    gate list PIPELINE [--sink S] [--all]     a pipeline's commit gates that wait (--all: every gate)
    gate show PIPELINE --sink S --epoch N     one gate and its pending output (files, or the SELECT of its rows)
    gate pass|fail PIPELINE --sink S --epoch N [--reason TEXT] [--by NAME]
                                              record a verdict on a gate (--by: default the OS user name)

The store is a PostgreSQL URI (``--dsn`` or the ``ARROYO_DSN`` environment variable) or an Airflow
connection id (``--conn-id``, resolved through :class:`~airflow_arroyo.hooks.arroyo.ArroyoHook`;
Airflow is imported only on that path). Output is a table, or JSON with ``--json`` (options may
come before or after the command). Exit codes: 0 ok, 2 bad input (the message names the problem and
the fix), 3 ``verify`` found damage, 1 any other error (``checkpoint``: the epoch failed or expired).
Passwords are never printed.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import enum
import getpass
import json
import logging
import os
import shlex
import socket
import sys
import time
from collections.abc import Callable, Sequence
from datetime import datetime, timedelta
from typing import IO, TYPE_CHECKING, Any, NoReturn
from urllib.parse import urlsplit

import psycopg2

from airflow_arroyo.core.connections import dsn_from_env_value
from airflow_arroyo.core.exceptions import ArroyoError, ConfigurationError, NotFoundError
from airflow_arroyo.core.units import bytes_human

if TYPE_CHECKING:
    from airflow_arroyo.core.epochs import RetentionPolicy
    from airflow_arroyo.core.gates import GateRecord
    from airflow_arroyo.core.upgrades import Analysis
    from airflow_arroyo.runtime.graph import PipelineGraph
    from airflow_arroyo.store import EpochStore, RestartRecord

__all__ = ["main"]

EXIT_OK, EXIT_ERROR, EXIT_BAD_INPUT, EXIT_DAMAGED = 0, 1, 2, 3
DSN_ENV = "ARROYO_DSN"
CLI_RETRY_SECONDS = 10.0
STOP_PIN_WAIT = timedelta(minutes=5)  # `stop --pin` without --wait: pinning needs the run to have ended


class UsageError(Exception):
    """Bad command-line usage (exit code 2)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{self.prog}: {message} (see `{self.prog} --help`)")


# --------------------------------------------------------------------------- formatting


def _jsonable(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, timedelta):
        return value.total_seconds()
    return value


def _size(n: int | None) -> str:
    return bytes_human(n, missing="-")  # "-" as every empty cell of the tables


def _when(value: datetime | None) -> str:
    return "-" if value is None else value.astimezone().strftime("%Y-%m-%d %H:%M:%S%z")


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, list | tuple):
        return ",".join(str(v) for v in value) or "-"
    return str(value)


def _table(headers: Sequence[str], rows: Sequence[Sequence[Any]], out: IO[str]) -> None:
    cells = [[_cell(v) for v in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    for row in [list(headers), *cells]:
        out.write("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() + "\n")


# --------------------------------------------------------------------------- the store


def _open_store(args: argparse.Namespace) -> EpochStore:
    dsn = args.dsn or None
    if args.conn_id and dsn:
        raise ConfigurationError("give either --dsn or --conn-id, not both")
    if args.conn_id:
        return _store_from_connection(args.conn_id)
    source = "--dsn" if dsn else f"${DSN_ENV}"
    dsn = dsn or os.environ.get(DSN_ENV)
    if not dsn:
        raise ConfigurationError(
            f"no epoch store given: pass --dsn postgresql://user@host:5432/db (or set {DSN_ENV}), "
            "or --conn-id <airflow connection id>"
        )
    _check_dsn(dsn, source)
    return _cli_store(dsn)


def _cli_store(dsn: str) -> EpochStore:
    from airflow_arroyo.store import EpochStore

    return EpochStore(dsn, max_connections=2, retry_seconds=CLI_RETRY_SECONDS, application_name="airflow-arroyo-cli")


def _check_dsn(dsn: str, source: str) -> None:
    """Refuse a malformed DSN before connecting, saying what is expected (never echoing it: it may
    hold a password)."""
    from psycopg2.extensions import parse_dsn

    expected = (f"{source} is not a PostgreSQL connection string: expected "
                "postgresql://user[:password]@host[:port]/database (or libpq's 'host=... dbname=...')")
    scheme = dsn.split("://", 1)[0].lower() if "://" in dsn else None
    if scheme is not None and scheme not in ("postgresql", "postgres"):
        raise ConfigurationError(f"{expected}; got a {scheme}:// URI")
    try:
        parse_dsn(dsn)
        if scheme is not None:
            _ = urlsplit(dsn).port  # a port that is not a number
    except (psycopg2.ProgrammingError, ValueError):
        raise ConfigurationError(expected) from None


def _env_connection_dsn(conn_id: str) -> str | None:
    """The DSN of connection ``conn_id`` when the environment defines it (``AIRFLOW_CONN_<ID>``, a URI or
    JSON): read without importing Airflow, which takes seconds. None when the variable is not set."""
    var = f"AIRFLOW_CONN_{conn_id.upper()}"
    value = os.environ.get(var, "").strip()
    return dsn_from_env_value(value, var) if value else None


def _store_from_connection(conn_id: str) -> EpochStore:
    """Resolve an Airflow connection like Airflow's own server-side CLI does (environment, secrets
    backends and the metadata database), then open the store. A URI in ``AIRFLOW_CONN_<ID>`` is read
    directly (fast); otherwise Airflow is imported, which takes seconds."""
    dsn = _env_connection_dsn(conn_id)
    if dsn is not None:
        _check_dsn(dsn, f"connection {conn_id!r}")
        return _cli_store(dsn)
    try:
        from airflow.sdk.exceptions import AirflowNotFoundException

        from airflow_arroyo.hooks.arroyo import ArroyoHook
    except ImportError as exc:
        raise ConfigurationError(
            f"--conn-id needs Airflow installed ({exc}); use --dsn postgresql://... instead"
        ) from exc
    previous = os.environ.get("_AIRFLOW_PROCESS_CONTEXT")
    if previous is None:  # outside Airflow's own processes: include the metadata database backend
        os.environ["_AIRFLOW_PROCESS_CONTEXT"] = "server"
    try:
        return ArroyoHook(conn_id, migrate=False, retry_seconds=CLI_RETRY_SECONDS).get_store()
    except AirflowNotFoundException:
        raise ConfigurationError(
            f"no Airflow connection {conn_id!r}; create it (`airflow connections add {conn_id} "
            "--conn-uri postgresql://...`) or pass --dsn instead"
        ) from None
    finally:
        if previous is None:
            os.environ.pop("_AIRFLOW_PROCESS_CONTEXT", None)


def _require_schema(store: EpochStore) -> None:
    store.check_schema()  # SchemaError says what to do: migrate (missing, behind), or the release (newer, edited)


# --------------------------------------------------------------------------- commands


def _cmd_migrate(store: EpochStore, args: argparse.Namespace, out: IO[str]) -> int:
    applied = store.migrate()
    version = store.schema_version()
    if args.json:
        json.dump({"applied": applied, "schema_version": version}, out)
        out.write("\n")
    elif applied:
        out.write(f"applied migrations {', '.join(map(str, applied))}; schema version {version}\n")
    else:
        out.write(f"schema up to date (version {version})\n")
    return EXIT_OK


def _cmd_pipelines(store: EpochStore, args: argparse.Namespace, out: IO[str]) -> int:
    _require_schema(store)
    pipelines = store.list_pipelines()
    restarts = store.restart_counts()  # supervised pipelines only: restarts of their current lineage
    if args.json:
        json.dump([{**_jsonable(p), "restarts": restarts.get(p.pipeline_id)} for p in pipelines], out)
        out.write("\n")
        return EXIT_OK
    if not pipelines:
        out.write("no pipelines registered\n")
        return EXIT_OK
    _table(
        ["PIPELINE", "STATE", "RUN", "LAST EPOCH", "HEARTBEAT", "SUPERVISION", "RESTARTS", "STORAGE"],
        [[p.pipeline_id, p.state.value, p.run_id, p.last_epoch, _when(p.heartbeat_at), p.supervision,
          restarts.get(p.pipeline_id), p.storage_uri] for p in pipelines],
        out,
    )
    return EXIT_OK


def _cmd_epochs(store: EpochStore, args: argparse.Namespace, out: IO[str]) -> int:
    _require_schema(store)
    if args.limit < 1:
        raise ConfigurationError(f"--limit must be at least 1, got {args.limit}")
    epochs = store.list_epochs(args.pipeline, limit=args.limit)
    if args.json:
        json.dump(_jsonable(epochs), out)
        out.write("\n")
        return EXIT_OK
    if not epochs:
        out.write(f"pipeline {args.pipeline} has no epochs yet\n")
        return EXIT_OK
    _table(
        ["EPOCH", "STATE", "TRIGGERED", "DURATION", "SIZE", "FREED", "PIN", "REASON"],
        [[e.epoch, e.state.value, _when(e.triggered_at),
          "-" if e.duration_s is None else f"{e.duration_s:.1f}s",
          _size(e.bytes_total), _size(e.bytes_freed), e.pin_label, e.failure_reason] for e in epochs],
        out,
    )
    return EXIT_OK


#: The longest cause the ``restarts`` table shows (its first line; ``--json`` has the whole cause).
CAUSE_WIDTH = 60


def _headline(text: str | None, width: int, *, run_id: str | None = None) -> str | None:
    """The first line of ``text``, cut to ``width`` characters between words, so that a run id or a path is
    never cut inside ("..." marks a cut, or more lines). ``run_id``, shown in a column of its own, reads
    "this run" in the text."""
    if text is None:
        return None
    if run_id:
        text = text.replace(f"run {run_id} ", "this run ").replace(f"run {run_id!r} ", "this run ")
    lines = text.strip().splitlines() or [""]
    first = lines[0].strip()
    if len(first) > width:
        cut = first[: width - 2]
        space = cut.rfind(" ")
        return (cut[:space] if space > width // 3 else cut[: width - 3]).rstrip() + "..."
    return first + (" ..." if len(lines) > 1 else "")


def _cmd_restarts(store: EpochStore, args: argparse.Namespace, out: IO[str]) -> int:
    """A supervised pipeline's failures and what its supervisor did about each, newest first."""
    from airflow_arroyo.core.supervision import restart_due, strategy_text

    _require_schema(store)
    pipe = store.get_pipeline(args.pipeline)  # unknown pipeline: exit 2
    restarts = store.restarts(args.pipeline, args.lineage)
    if args.json:
        json.dump(_jsonable(restarts), out)
        out.write("\n")
        return EXIT_OK
    of_lineage = f" of lineage {args.lineage}" if args.lineage else ""
    if not restarts:
        never = "" if pipe.supervised_run else " (it has never been supervised: see SubmitPipelineOperator's " \
                                                "restart_strategy)"
        out.write(f"pipeline {args.pipeline} has no failures or restarts recorded{of_lineage}{never}\n")
        return EXIT_OK
    due = restart_due(pipe, restarts)

    def restarted_as(r: RestartRecord) -> str | None:
        if r.gave_up:
            return "gave up"
        return "pending" if r is due else r.new_run_id

    _table(
        ["ATTEMPT", "FAILED AT", "FAILED RUN", "CAUSE", "DECISION", "RESTARTED AS", "RESTORED EPOCH"],
        [[r.attempt, _when(r.failed_at), r.failed_run_id, _headline(r.cause, CAUSE_WIDTH, run_id=r.failed_run_id),
          r.decision,
          restarted_as(r), r.restored_epoch] for r in restarts],
        out,
    )
    if pipe.supervised_run and (not args.lineage or args.lineage == pipe.supervised_run):
        state = pipe.supervision or "not supervised now (another run took over)"
        out.write(f"supervision of lineage {pipe.supervised_run}: {state}; "
                  f"restart strategy {strategy_text(pipe.restart_strategy)}\n")
    return EXIT_OK


def _cmd_pin(store: EpochStore, args: argparse.Namespace, out: IO[str]) -> int:
    """Pin a completed epoch: retention keeps it (and what a restore of it reads) until it is unpinned."""
    _require_schema(store)
    try:
        before = store.get_epoch(args.pipeline, args.epoch).pin_label
    except NotFoundError:  # pin_epoch says it, as for any pin
        before = None
    record = store.pin_epoch(args.pipeline, args.epoch, args.label, replace=args.replace)
    if args.json:
        json.dump(_jsonable(record), out)
        out.write("\n")
    else:
        was = f"; was: {before}" if before is not None and before != record.pin_label else ""
        out.write(f"pinned epoch {record.epoch} of pipeline {record.pipeline_id} ({record.pin_label}{was}); retention "
                  f"keeps it until `airflow-arroyo unpin {record.pipeline_id} {record.epoch}`\n")
    return EXIT_OK


def _cmd_unpin(store: EpochStore, args: argparse.Namespace, out: IO[str]) -> int:
    """Unpin an epoch (a no-op when it is not pinned); retention's policy applies to it again."""
    _require_schema(store)
    before = store.get_epoch(args.pipeline, args.epoch)
    record = store.unpin_epoch(args.pipeline, args.epoch, force=args.force)
    if args.json:
        json.dump(_jsonable(record), out)
        out.write("\n")
    elif before.pin_label is None:
        out.write(f"epoch {record.epoch} of pipeline {record.pipeline_id} was not pinned; nothing changed\n")
    else:
        out.write(f"unpinned epoch {record.epoch} of pipeline {record.pipeline_id} (was: {before.pin_label}); "
                  "the retention policy applies to it again\n")
    return EXIT_OK


def _cmd_stop(store: EpochStore, args: argparse.Namespace, out: IO[str]) -> int:
    """Ask a live pipeline to stop (graceful: its driver takes a final epoch first); with ``--wait``,
    wait for its run to end and report how (the steps of :mod:`airflow_arroyo.core.stopping`)."""
    from airflow_arroyo.core.retention import parse_duration
    from airflow_arroyo.core.stopping import StopAsked, check_stop, finish_stop, request_stop, wait_until_ended

    _require_schema(store)
    wait = parse_duration(args.wait, name="--wait") or timedelta(0)
    mode = check_stop("immediate" if args.immediate else "graceful", args.pin)  # bad input before anything is asked
    if args.pin is not None and wait.total_seconds() <= 0:
        wait = STOP_PIN_WAIT  # pinning needs the run to have ended
    asked = request_stop(store, args.pipeline, mode)
    current = asked.pipeline
    if asked.asked is StopAsked.RESTART_CANCELLED:
        out.write(f"pipeline {args.pipeline}: run {current.run_id} failed "
                  f"({current.failure_cause or 'no cause recorded'}); its supervisor's restart is cancelled\n")
        return EXIT_OK
    if asked.asked is StopAsked.ENDED:
        whose = "it has not run yet" if current.run_id is None else (
            f"its run {current.run_id} is already {current.state.value}")
        raise ConfigurationError(f"pipeline {args.pipeline} is not running: {whose}; nothing to stop")
    if asked.asked is StopAsked.ALREADY_REQUESTED and wait.total_seconds() <= 0 and args.pin is None \
            and not args.json:
        # a second stop: the first request stands (an immediate one is never made graceful again)
        more = f"; now {asked.mode}" if asked.mode != asked.previous else ""
        out.write(f"pipeline {args.pipeline} (run {current.run_id}) was already asked to stop "
                  f"({asked.previous}{more}); it is {current.state.value}: pass --wait DURATION to wait for it "
                  "to end\n")
        return EXIT_OK
    end = wait_until_ended(store, current, wait.total_seconds())
    record, ended = end.record, end.ended
    state = record.state.value if end.superseded_by is None else f"ended (run {end.superseded_by} registered since)"
    try:
        outcome = finish_stop(store, args.pipeline, current.run_id, args.pin, ended=ended)
    except ConfigurationError as exc:  # the stop happened: not bad input, a failed second half (exit 1)
        raise _NotPinned(f"pipeline {args.pipeline} (run {current.run_id}) is {state}, but {exc}") from None
    latest, pinned = outcome.latest_epoch, outcome.pinned
    result: dict[str, Any] = {
        "pipeline_id": args.pipeline, "run_id": current.run_id, "mode": mode, "state": state,
        "stopped": ended, "latest_completed_epoch": latest, "failure_cause": record.failure_cause}
    if args.pin is not None:
        result["pinned_epoch"] = pinned.epoch if pinned is not None else None
        result["pin_label"] = pinned.pin_label if pinned is not None else None
    if args.json:
        json.dump(result, out)
        out.write("\n")
    elif not ended and wait.total_seconds() > 0:
        out.write(f"asked pipeline {args.pipeline} (run {current.run_id}) to stop ({mode}); it is still "
                  f"{record.state.value} after {args.wait}: its driver acts on the request at its next heartbeat; "
                  "check it is alive (airflow-arroyo pipelines)\n")
    elif not ended:
        out.write(f"asked pipeline {args.pipeline} (run {current.run_id}) to stop ({mode}); "
                  "pass --wait DURATION to wait for it\n")
    else:
        cause = f": {record.failure_cause}" if record.failure_cause else ""
        out.write(f"pipeline {args.pipeline} (run {current.run_id}) is {state}{cause}; "
                  f"latest completed epoch {latest if latest is not None else '-'}\n")
        if pinned is not None:
            out.write(f"pinned its final epoch {pinned.epoch} ({pinned.pin_label}); retention keeps it until "
                      f"`airflow-arroyo unpin {args.pipeline} {pinned.epoch}`\n")
    return EXIT_OK if ended or wait.total_seconds() == 0 else EXIT_ERROR


def _cmd_fork(store: EpochStore, args: argparse.Namespace, out: IO[str]) -> int:
    """Fork a new pipeline from a completed epoch of another; the epoch's snapshots are shared, not copied."""
    _require_schema(store)
    fork = store.fork_pipeline(args.source, args.epoch, args.to)
    point = store.get_epoch(args.source, args.epoch)
    if args.json:
        json.dump({**_jsonable(fork), "source_pin_label": point.pin_label}, out)
        out.write("\n")
        return EXIT_OK
    _table(["FORK", "FROM", "EPOCH", "STATE", "SOURCE PIN"],
           [[fork.pipeline_id, fork.forked_from_pipeline, fork.forked_from_epoch, fork.state.value, point.pin_label]],
           out)
    out.write(f"epoch {args.epoch} of {args.source} stays pinned until {fork.pipeline_id} completes an epoch of its "
              f"own; {fork.pipeline_id}'s epochs are numbered from {fork.last_epoch + 1}\n")
    return EXIT_OK


def _cmd_restore(store: EpochStore, args: argparse.Namespace, out: IO[str]) -> int:
    """Check that ``PIPELINE`` can restore ``--epoch`` now (exit 2 saying why not) and print how to launch it:
    the driver's arguments, or the submit operator's ``restore_from``. Changes nothing."""
    _require_schema(store)
    plan = _restore_plan(store, args.pipeline, args.epoch)
    if args.json:
        json.dump(_jsonable(plan), out)
        out.write("\n")
        return EXIT_OK
    _table(["PIPELINE", "RESTORE FROM", "EPOCH OF", "ENDED", "PIN", "SUPERSEDES"],
           [[plan.pipeline_id, plan.epoch, plan.epoch_of, _when(plan.ended_at), plan.pin_label,
             list(plan.supersedes)]], out)
    out.write(f"launch its driver with: {' '.join(plan.driver_args)}\n"
              f"or from Airflow: SubmitPipelineOperator(..., restore_from={plan.restore_from!r}) "
              f"(the example DAGs take it as the restore_from param)\n")
    return EXIT_OK


def _cmd_upgrade_plan(store: EpochStore, args: argparse.Namespace, out: IO[str]) -> int:
    """Dry run: the new code's stages (``--pipeline-module``) against an epoch of ``PIPELINE``, each restored, new,
    removed or incompatible (:func:`~airflow_arroyo.core.upgrades.check_upgrade`), for the physical graph the driver
    will run where it is known. ``--check-state-schema`` asks Spark's analyzer in a local session which stages hold
    state, so it plans the driver's fusion exactly, and compares each restored query's state schemas with the
    epoch's snapshots (:mod:`airflow_arroyo.runtime.upgrade_evidence`). Touches nothing; exit 0 when the plan
    restores, 2 when it is refused."""
    from airflow_arroyo.core.restores import parse_restore_from
    from airflow_arroyo.core.upgrades import check_upgrade, fusion_note
    from airflow_arroyo.runtime.driver import load_pipeline

    _require_schema(store)
    code = load_pipeline(args.pipeline_module)
    graph = code.validate()
    plan = check_upgrade(store, args.pipeline, graph, parse_restore_from(args.epoch),
                         allow_dropped_state=args.allow_dropped_state or (), renamed=_renames(args.rename),
                         chaining=code.chaining,
                         analysis=_analysis(store, args.pipeline, graph) if args.check_state_schema else None)
    checked = None if plan.state_schema_checked is None else list(plan.state_schema_checked)
    if args.json:
        json.dump({"pipeline": args.pipeline, "epoch": plan.epoch, "restores": plan.restores,
                   "physical": plan.queries is not None, "fusion": plan.fusion,
                   "queries": None if plan.queries is None else {q: list(m) for q, m in plan.queries},
                   "state_schema_checked": checked, "stages": [_jsonable(row) for row in plan.stages]}, out)
        out.write("\n")
    else:
        _table(["STAGE", "ACTION", "REASON"],
               [[r.stage, r.action.value + (" (refused)" if r.refused else ""), r.reason] for r in plan.stages], out)
        out.write(fusion_note(plan) + "\n")
        if checked is not None:
            out.write(f"state schemas checked: {', '.join(checked) or 'none'} (docs/upgrading.md, 'State schema "
                      "compatibility', says which stages are not)\n")
        if not plan.restores:
            out.write(f"refused: {', '.join(r.stage for r in plan.refused)} (see each reason for the fix)\n")
    return EXIT_OK if plan.restores else EXIT_BAD_INPUT


def _analysis(store: EpochStore, pipeline_id: str,
              graph: PipelineGraph) -> Callable[[], contextlib.AbstractContextManager[Analysis]]:
    """Spark's analysis of ``graph`` in a local session (``--check-state-schema``;
    :mod:`airflow_arroyo.runtime.upgrade_evidence`), opened when a plan asks for it."""
    from airflow_arroyo.runtime.upgrade_evidence import spark_analysis

    return lambda: spark_analysis(store, pipeline_id, graph)


def _renames(pairs: Sequence[str] | None) -> dict[str, str]:
    renamed: dict[str, str] = {}
    for pair in pairs or ():
        old, sep, new = pair.partition("=")
        if not sep or not old or not new:
            raise ConfigurationError(f"--rename must look like OLD=NEW (the epoch's stage=the new stage), got {pair!r}")
        renamed[old] = new
    return renamed


def _cmd_upgrade(store: EpochStore, args: argparse.Namespace, out: IO[str]) -> int:
    """Upgrade a running pipeline to new code in one step (:func:`airflow_arroyo.core.upgrades.prepare_upgrade`: plan,
    graceful stop, pin the final epoch, plan again), then print how to start the new code, or with ``--start``
    start it as a local driver process and wait until it runs."""
    from airflow_arroyo.core.retention import parse_duration
    from airflow_arroyo.core.upgrades import fusion_note, prepare_upgrade
    from airflow_arroyo.runtime.driver import load_pipeline

    _require_schema(store)
    wait = (parse_duration(args.wait, name="--wait") or timedelta(minutes=10)).total_seconds()
    code = load_pipeline(args.pipeline_module)
    graph = code.validate()
    ready = prepare_upgrade(store, args.pipeline, graph, allow_dropped_state=args.allow_dropped_state or (),
                            renamed=_renames(args.rename), label=args.label, stop_timeout=wait,
                            chaining=code.chaining,
                            analysis=_analysis(store, args.pipeline, graph) if args.check_state_schema else None)
    command = [sys.executable, *(["-m", "airflow_arroyo.runtime.driver"] if args.driver is None else [args.driver]),
               "--pipeline", args.pipeline_module, "--run-id", f"upgrade-{datetime.now():%Y%m%dT%H%M%S}",
               *ready.driver_args()]
    if ready.storage_uri:
        command += ["--storage-uri", ready.storage_uri]
    if ready.checkpoint_uri and ready.checkpoint_uri != ready.storage_uri:
        command += ["--checkpoint-uri", str(ready.checkpoint_uri)]
    if args.master:
        command += ["--master", args.master]
    result: dict[str, Any] = {"pipeline_id": args.pipeline, "pinned_epoch": ready.epoch, "pin_label": ready.label,
                              "stages": [_jsonable(r) for r in ready.plan.stages],
                              "physical": ready.plan.queries is not None, "fusion": ready.plan.fusion,
                              "command": command}
    if args.start:
        result.update(_start_driver(store, args.pipeline, command, args.log, wait))
    if args.json:
        json.dump(result, out)
        out.write("\n")
    else:
        out.write(f"pipeline {args.pipeline}: stopped with its final epoch {ready.epoch} pinned ({ready.label!r});"
                  " the new code restores it:\n")
        _table(["STAGE", "ACTION", "REASON"], [[r.stage, r.action.value, r.reason] for r in ready.plan.stages], out)
        out.write(fusion_note(ready.plan) + "\n")
        if args.start:
            out.write(f"started run {result['run_id']} ({result['state']}); its log: {result['log']}\n")
        else:
            out.write("start the new code with (the epoch store's DSN in ARROYO_DSN, as for any driver):\n  "
                      + " ".join(shlex.quote(c) for c in command) + "\n")
    return EXIT_OK if not args.start or result["state"] == "running" else EXIT_ERROR


def _cmd_shadow(store: EpochStore, args: argparse.Namespace, out: IO[str]) -> int:
    """Shadow runs (:mod:`airflow_arroyo.core.shadow`): start, list, compare, promote, discard."""
    from airflow_arroyo.core import shadow as shadows

    _require_schema(store)
    verb = args.shadow_command
    result: Any
    if verb == "start":
        record = shadows.start_shadow(store, args.live, args.epoch, args.to, args.pipeline_module)
        live = store.get_pipeline(args.live)
        command = [sys.executable, "-m", "airflow_arroyo.runtime.driver", "--pipeline",
                   "airflow_arroyo.core.shadow:shadow_code", "--arg", f"code={record.code}", "--arg",
                   f"shadow_id={record.shadow_id}", "--run-id", f"shadow-{datetime.now():%Y%m%dT%H%M%S}",
                   *(["--storage-uri", live.storage_uri] if live.storage_uri else [])]
        result = {**_jsonable(record), "command": command}
        if not args.json:
            _table(["SHADOW", "OF", "FORK EPOCH", "CODE"], [[record.shadow_id, record.live_id, record.fork_epoch,
                                                            record.code]], out)
            _table(["SINK", "KIND", "LIVE", "SHADOW"],
                   [[k, v["kind"], v["live"], v["shadow"]] for k, v in sorted(record.sinks.items())], out)
            out.write("start the shadow with (ARROYO_DSN set, as for any driver):\n  "
                      + " ".join(shlex.quote(c) for c in command) + "\n")
    elif verb == "list":
        result = [_jsonable(r) for r in store.shadows_of(args.live)]
        if not args.json:
            _table(["SHADOW", "FORK EPOCH", "STATE", "CODE", "CREATED"],
                   [[r["shadow_id"], r["fork_epoch"], r["state"], r["code"], r["created_at"]] for r in result], out)
    elif verb == "compare":
        keys: dict[str, list[str]] = {}
        for item in args.key or ():
            sink, sep, cols = item.partition("=")
            if not sep or not sink or not cols:
                raise ConfigurationError(f"--key must look like SINK=COL[,COL...], got {item!r}")
            keys[sink] = cols.split(",")
        result = shadows.compare_shadow(store, args.shadow, key=keys)
        if not args.json:
            out.write(f"shadow {result['shadow_id']} of {result['live_id']} (fork point epoch "
                      f"{result['fork_epoch']}, {result['state']}), code {result['code']}\n")
            _table(["SINK", "LIVE EPOCHS", "SHADOW EPOCHS", "LIVE ROWS", "SHADOW ROWS", "ADDED", "REMOVED",
                    "CHANGED", "NOTE"],
                   [[d["sink"], d["live_epochs"], d["shadow_epochs"], d.get("live_rows", "-"),
                     d.get("shadow_rows", "-"), d.get("added", "-"), d.get("removed", "-"), d.get("changed", "-"),
                     d["note"]] for d in result["diffs"]], out)
    elif verb == "promote":
        from airflow_arroyo.core.retention import parse_duration

        wait = (parse_duration(args.wait, name="--wait") or timedelta(minutes=10)).total_seconds()
        ready, record = shadows.promote_shadow(store, args.shadow, label=args.label, stop_timeout=wait)
        command = [sys.executable, "-m", "airflow_arroyo.runtime.driver", "--pipeline", record.code, "--run-id",
                   f"upgrade-{datetime.now():%Y%m%dT%H%M%S}", *ready.driver_args(),
                   *(["--storage-uri", ready.storage_uri] if ready.storage_uri else [])]
        result = {**_jsonable(record), "pinned_epoch": ready.epoch, "pin_label": ready.label,
                  "stages": [_jsonable(r) for r in ready.plan.stages], "command": command}
        if not args.json:
            out.write(f"pipeline {record.live_id}: stopped with its final epoch {ready.epoch} pinned "
                      f"({ready.label!r}); shadow {record.shadow_id} promoted. Start the shadow's code on it with:\n  "
                      + " ".join(shlex.quote(c) for c in command) + "\n")
    else:  # discard
        record = shadows.discard_shadow(store, args.shadow, force=args.force)
        result = _jsonable(record)
        if not args.json:
            out.write(f"shadow {record.shadow_id} of {record.live_id}: {record.state}; its epochs and shadow sink "
                      "data are left (remove the shadow folders/tables by hand)\n")
    if args.json:
        json.dump(result, out, default=str)
        out.write("\n")
    return EXIT_OK


def _start_driver(store: EpochStore, pipeline_id: str, command: list[str], log: str | None,
                  wait: float) -> dict[str, Any]:
    """Start ``command`` (a driver) detached, its output in ``log``, the store's DSN in its environment (never on
    its command line); wait until the run it registers is running, or the process ended, or ``wait`` passed."""
    import subprocess

    from airflow_arroyo.core.epochs import PipelineState

    before = store.get_pipeline(pipeline_id).run_id
    path = log or f"{pipeline_id}-upgrade-{int(time.time())}.log"
    with open(path, "ab") as sink:
        process = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True,
                                   env={**os.environ, DSN_ENV: store.dsn})

    def settled() -> bool:
        record = store.get_pipeline(pipeline_id)
        return process.poll() is not None or (record.run_id != before and record.state is not PipelineState.REGISTERED)

    deadline = time.monotonic() + wait
    while not settled() and time.monotonic() < deadline:
        time.sleep(0.5)
    record = store.get_pipeline(pipeline_id)
    mine = record.run_id != before
    state = record.state.value if mine else ("exited" if process.poll() is not None else "starting")
    return {"run_id": record.run_id if mine else None, "state": state, "pid": process.pid, "log": path,
            "exit_code": process.poll()}


def _cmd_prune(store: EpochStore, args: argparse.Namespace, out: IO[str]) -> int:
    from airflow_arroyo.core.retention import parse_duration, prune_pipeline

    if args.all and args.pipeline:
        raise ConfigurationError(f"give either a PIPELINE ({args.pipeline}) or --all, not both")
    if not args.all and not args.pipeline:
        raise ConfigurationError("name one PIPELINE to prune, or --all for every registered pipeline")
    policy = _cli_policy(args.keep_last, args.keep_newer_than)
    wait_for_lock = parse_duration(args.wait_for_lock, name="--wait-for-lock") or timedelta(0)
    wait_for_in_flight = parse_duration(args.wait_for_in_flight, name="--wait-for-in-flight") or timedelta(0)
    compact_after = parse_duration(args.compact_after, name="--compact-after")
    if compact_after is not None and compact_after < timedelta(0):
        raise ConfigurationError(
            f"--compact-after must be a duration >= 0 (e.g. 7d) or 'none', got {args.compact_after}")
    if args.lock_ttl <= 0:
        raise ConfigurationError(f"--lock-ttl must be a positive number of seconds, got {args.lock_ttl}")
    _require_schema(store)
    if args.all:
        targets = [p.pipeline_id for p in store.list_pipelines()]
    else:
        store.get_pipeline(args.pipeline)  # unknown pipeline: exit 2 before anything is written
        targets = [args.pipeline]
    holder = f"cli:{getpass.getuser()}@{socket.gethostname()}:{os.getpid()}"
    results: list[dict[str, Any]] = []
    failed = False
    for pipeline_id in targets:
        try:
            report = prune_pipeline(store, pipeline_id, policy, holder=holder, lock_ttl=args.lock_ttl,
                                    wait_for_lock=wait_for_lock, wait_for_in_flight=wait_for_in_flight,
                                    compact_after=compact_after)
            results.append({**report.to_dict(), "error": None})
        except (ArroyoError, OSError) as exc:
            if not args.all:
                raise
            failed = True
            results.append({"pipeline_id": pipeline_id, "error": f"{type(exc).__name__}: {exc}"})
    if args.json:
        json.dump(results, out)
        out.write("\n")
    elif not results:
        out.write("no pipelines registered\n")
    else:
        _table(
            ["PIPELINE", "CLEANUP RUN", "PRUNED", "FREED", "KEPT", "NOTE"],
            [[r["pipeline_id"], r.get("cleanup_run"), r.get("epochs_pruned"),
              _size(r["bytes_freed"]) if "bytes_freed" in r else "-", r.get("kept"),
              r["error"] or (f"skipped: {r['skipped_reason']}" if r.get("skipped_reason") else "")]
             for r in results],
            out,
        )
    return EXIT_ERROR if failed else EXIT_OK


def _cli_policy(keep_last: str | None, keep_newer_than: str | None) -> RetentionPolicy:
    """The retention policy from the command line, every message in the options' own words."""
    from airflow_arroyo.core.epochs import RetentionPolicy
    from airflow_arroyo.core.retention import parse_duration

    last: int | None = None
    if keep_last is not None:
        try:
            last = int(keep_last.strip())
        except ValueError:
            last = 0
        if last < 1:
            raise ConfigurationError(
                f"--keep-last must be a whole number >= 1 (how many completed epochs to keep), got {keep_last!r}"
            )
    negative = keep_newer_than is not None and keep_newer_than.strip().startswith("-")
    newer = None if negative else parse_duration(keep_newer_than, name="--keep-newer-than")
    if negative or (newer is not None and newer.total_seconds() <= 0):
        raise ConfigurationError(
            f"--keep-newer-than must be a positive duration such as 90m, 6h or 7d (epochs that ended within it "
            f"are kept), got {keep_newer_than!r}"
        )
    if last is None and newer is None:
        raise ConfigurationError(
            "say what to keep: --keep-last K and/or --keep-newer-than DURATION (e.g. --keep-last 5, "
            "--keep-newer-than 7d); the latest completed epoch is always kept"
        )
    return RetentionPolicy(keep_last=last, keep_newer_than=newer)


def _cmd_lock(store: EpochStore, args: argparse.Namespace, out: IO[str]) -> int:
    _require_schema(store)
    store.get_pipeline(args.pipeline)
    lock = store.cleanup_lock(args.pipeline)
    runs = store.list_cleanup_runs(args.pipeline, limit=1)
    last = runs[0] if runs else None
    if args.json:
        json.dump({"pipeline_id": args.pipeline, "lock": _jsonable(lock), "last_run": _jsonable(last)}, out)
        out.write("\n")
        return EXIT_OK
    if lock is None:
        out.write(f"pipeline {args.pipeline}: no cleanup lock held\n")
    else:
        _table(["PIPELINE", "HOLDER", "CLEANUP RUN", "ACQUIRED", "EXPIRES"],
               [[lock.pipeline_id, lock.holder, lock.cleanup_run, _when(lock.acquired_at), _when(lock.expires_at)]],
               out)
    if last is not None:
        out.write(f"last cleanup run {last.id}: {last.state} (holder {last.holder}, started {_when(last.started_at)}, "
                  f"pruned {_cell(last.epochs_pruned)}, freed {_size(last.bytes_freed)})"
                  + (f": {last.error}" if last.error else "") + "\n")
    return EXIT_OK


def _cmd_verify(store: EpochStore, args: argparse.Namespace, out: IO[str]) -> int:
    from airflow_arroyo.core.retention import parse_duration
    from airflow_arroyo.core.scrub import verify_pipeline

    budget = parse_duration(args.budget, name="--budget") if args.budget is not None else None
    if budget is not None and budget.total_seconds() <= 0:
        raise ConfigurationError(f"--budget must be a positive duration such as 30s or 5m, got {args.budget!r}")
    _require_schema(store)
    report = verify_pipeline(store, args.pipeline, epoch=args.epoch,
                             budget=budget.total_seconds() if budget is not None else None)
    if args.json:
        json.dump(_jsonable(report.to_dict()), out)
        out.write("\n")
    else:
        scope = f"epoch {args.epoch}" if args.epoch is not None else "retained epochs"
        out.write(f"pipeline {args.pipeline} ({scope}): checked {report.objects_checked} of {report.objects_total} "
                  f"objects ({_size(report.bytes_checked)}) in {report.elapsed_s:.1f}s\n")
        if report.damaged:
            _table(["OBJECT", "STATE", "EPOCHS", "DETAIL"],
                   [[d.object_key, d.state, list(d.epochs), d.detail] for d in report.damaged], out)
        out.write(f"damaged epochs: {_cell(report.damaged_epochs)}\n"
                  f"restorable epochs: {_cell(report.restorable_epochs)}\n")
        if report.unverified_epochs:
            out.write(f"not fully verified yet: {_cell(report.unverified_epochs)}\n")
        out.write(f"{report.advice()}\n")
    return EXIT_OK if report.ok else EXIT_DAMAGED


def _cmd_checkpoint(store: EpochStore, args: argparse.Namespace, out: IO[str]) -> int:
    """Fire one epoch now (after an in-flight one ends, or a cleanup releases its lock), wait for its end."""
    from airflow_arroyo.core.epochs import CheckpointPolicy, EpochState, TriggerAction
    from airflow_arroyo.core.retention import parse_duration

    timeout = parse_duration(args.timeout, name="--timeout")
    if timeout is None or timeout.total_seconds() <= 0:
        raise ConfigurationError(f"--timeout must be a positive duration such as 90s or 5m, got {args.timeout!r}")
    _require_schema(store)
    store.get_pipeline(args.pipeline)  # unknown pipeline: exit 2
    seconds = timeout.total_seconds()
    # the epoch times out with the command: a tick after the deadline expires it (the trigger's own rule)
    policy = CheckpointPolicy(interval=seconds, timeout=seconds)
    by = f"cli:{getpass.getuser()}@{socket.gethostname()}:{os.getpid()}"
    deadline = time.monotonic() + seconds
    delay = 0.05
    while True:
        tick = store.trigger_tick(args.pipeline, policy, triggered_by=by, force=True,
                                  self_contained=args.self_contained)
        if tick.started is not None:
            break
        action = tick.decision.action
        if action in (TriggerAction.PIPELINE_ENDED, TriggerAction.PIPELINE_NOT_RUNNING):
            pipe = store.get_pipeline(args.pipeline)
            whose = "it has not run yet" if pipe.run_id is None else f"its run {pipe.run_id} is {pipe.state.value}"
            fix = ("start its driver (SubmitPipelineOperator, or python -m airflow_arroyo.runtime.driver) and "
                   "checkpoint again") if pipe.state.terminal else "wait for it to be running and checkpoint again"
            raise _NotStarted(f"no epoch started for pipeline {args.pipeline!r}: {whose}; {fix}")
        if action is TriggerAction.PIPELINE_NOT_ALIVE:
            raise _NotStarted(f"no epoch started for pipeline {args.pipeline!r}: {tick.decision.reason}")
        if time.monotonic() >= deadline:
            raise _NotStarted(f"no epoch started for pipeline {args.pipeline!r} within {seconds:g}s: "
                              f"{tick.decision.reason}")
        time.sleep(delay)  # an epoch in flight or a cleanup lock: wait for it, then start ours
        delay = min(delay * 2, 1.0)
    epoch = tick.started.epoch
    deadline = time.monotonic() + seconds + 1.0
    delay = 0.05
    record = store.get_epoch(args.pipeline, epoch)
    while record.state is EpochState.TRIGGERED:
        if time.monotonic() >= deadline:
            store.trigger_tick(args.pipeline, policy, triggered_by=by, watch=[epoch])  # expires it
        time.sleep(delay)
        delay = min(delay * 2, 0.5)
        record = store.get_epoch(args.pipeline, epoch)
    if args.json:
        json.dump(_jsonable(record), out)
        out.write("\n")
    else:
        _table(["PIPELINE", "EPOCH", "STATE", "SELF-CONTAINED", "DURATION", "SIZE", "REASON"],
               [[record.pipeline_id, record.epoch, record.state.value, "yes" if record.self_contained else "no",
                 "-" if record.duration_s is None else f"{record.duration_s:.1f}s", _size(record.bytes_total),
                 record.failure_reason]], out)
    return EXIT_OK if record.state is EpochState.COMPLETED else EXIT_ERROR


@dataclasses.dataclass(frozen=True)
class RestorePlan:
    """What ``restore`` checked: the epoch a new run of ``pipeline_id`` restores and how to launch it."""
    pipeline_id: str
    epoch: int
    epoch_of: str  # the pipeline whose epoch it is: this one, or, for a fork's first run, its source
    restore_from: str | int  # what to give the driver / the submit operator
    ended_at: datetime | None
    pin_label: str | None
    supersedes: tuple[int, ...]  # completed epochs after it, which the restore abandons
    driver_args: tuple[str, ...]


def _restore_plan(store: EpochStore, pipeline_id: str, wanted: str) -> RestorePlan:
    """Check that ``pipeline_id`` can restore ``wanted`` ('latest' or an epoch number) now: the pipeline is not
    running, and the driver's own decision (:func:`~airflow_arroyo.core.restores.read_restore_facts`, then
    :func:`~airflow_arroyo.runtime.decisions.plan_restore`) restores an epoch. Raises :class:`ConfigurationError`
    saying why not and what to do."""
    from airflow_arroyo.core.epochs import EpochState
    from airflow_arroyo.core.exceptions import UnrestorableEpochError
    from airflow_arroyo.core.restores import parse_restore_from, read_restore_facts
    from airflow_arroyo.runtime.decisions import RestoreAction, plan_restore

    requested = parse_restore_from(wanted)
    pipe = store.get_pipeline(pipeline_id)
    if not pipe.state.terminal:
        raise ConfigurationError(
            f"pipeline {pipeline_id} is {pipe.state.value} (run {pipe.run_id}): stop it first "
            f"(airflow-arroyo stop {pipeline_id} --wait 2m), or launch the restore with --takeover if its driver "
            "is dead"
        )
    situation = read_restore_facts(store, pipeline_id, requested, stages=None)
    try:
        decided = plan_restore(situation.facts)
    except UnrestorableEpochError as exc:  # a refusal of this choice (exit 2), as for any other epoch
        raise ConfigurationError(str(exc)) from None
    if decided.action is not RestoreAction.RESTORE:
        raise ConfigurationError(
            f"pipeline {pipeline_id} has no completed epoch to restore: a run with --restore-from latest starts "
            "over from the beginning (empty checkpoints and channels)")
    assert decided.epoch is not None
    source = situation.fork_source
    owner = pipeline_id if source is None else source.pipeline_id
    record = store.get_epoch(owner, decided.epoch)
    after = [] if source is not None else [
        e.epoch for e in store.list_epochs(pipeline_id, limit=10_000, states=[EpochState.COMPLETED])
        if e.epoch > record.epoch]
    restore_from: str | int = "latest" if requested == "latest" or source is not None else record.epoch
    args = ["python", "-m", "airflow_arroyo.runtime.driver", "--pipeline", "<module:attr>",
            "--restore-from", str(restore_from)]
    if pipe.storage_uri:
        args += ["--storage-uri", pipe.storage_uri]
    checkpoint_uri = (pipe.config or {}).get("checkpoint_uri")
    if checkpoint_uri and checkpoint_uri != pipe.storage_uri:
        args += ["--checkpoint-uri", str(checkpoint_uri)]
    return RestorePlan(pipeline_id, record.epoch, owner, restore_from, record.ended_at, record.pin_label,
                       tuple(sorted(after)), tuple(args))


def _cmd_provenance(store: EpochStore, args: argparse.Namespace, out: IO[str]) -> int:
    """Print what an epoch read, snapshotted and committed (:mod:`airflow_arroyo.core.provenance`), or the epoch whose
    commit made a file sink's file or a table sink's version."""
    from airflow_arroyo.core import provenance

    _require_schema(store)
    if args.epoch is None:
        if args.table_version is not None and not args.sink:
            raise ConfigurationError("--table-version needs --sink: name the table sink whose version it is")
        commit = (provenance.epoch_of_file(store, args.pipeline, args.file) if args.file is not None
                  else provenance.epoch_of_table_version(store, args.pipeline, args.sink, args.table_version))
        if args.json:
            json.dump(_jsonable(commit), out)
            out.write("\n")
            return EXIT_OK
        _table(["EPOCH", "SINK", "BATCH", "TABLE VERSION", "FILES", "ROWS", "COMMITTED"],
               [[commit.epoch, commit.sink, commit.batch_id, commit.table_version, commit.files,
                 commit.rows_committed, _when(commit.committed_at)]], out)
        return EXIT_OK
    p = provenance.epoch_provenance(store, args.pipeline, args.epoch, storage_uri=args.storage_uri)
    if args.json:
        json.dump(_jsonable(p), out)
        out.write("\n")
        return EXIT_OK
    pruned = ", pruned: where the ranges start is unknown" if p.previous_pruned else ""
    out.write(f"epoch {p.epoch} of {p.pipeline_id} (after epoch {_cell(p.previous_epoch)}{pruned})\n")
    _table(["STAGE", "BATCHES", "OBJECTS", "BYTES", "SOURCE", "FROM (EXCL.)", "TO (INCL.)", "FILES"],
           [[s.stage, f"{_cell(s.previous_batch_id)}..{_cell(s.batch_id)}", s.objects, _size(s.bytes)]
            + ([r.index, json.dumps(r.start), json.dumps(r.end), r.files] if r is not None else [None] * 4)
            for s in p.stages for r in ([*s.sources] if s.sources else [None])], out)
    if p.sinks:
        _table(["SINK", "BATCHES", "FILES", "ROWS", "BYTES", "TABLE VERSION", "FILE NAMES"],
               [[k.sink, f"{_cell(k.previous_batch_id)}..{k.batch_id}", k.files, k.rows, _size(k.bytes),
                 k.table_version, k.file_names] for k in p.sinks], out)
    return EXIT_OK


#: Rows ``state`` prints unless --limit says otherwise.
STATE_ROWS = 20


def _state_cell(value: Any) -> str:
    """A state key or value (a Spark struct) as compact JSON."""
    return json.dumps(_jsonable(value), default=str, separators=(",", ":"))


def _cmd_state(store: EpochStore, args: argparse.Namespace, out: IO[str]) -> int:
    """Print a stage's state as of a completed epoch (Spark's state data source over the epoch's snapshot,
    rebuilt in a scratch folder: :mod:`airflow_arroyo.core.state`), or its diff against epoch ``--diff``."""
    from airflow_arroyo.core import state

    if args.limit is not None and args.limit < 1:
        raise ConfigurationError(f"--limit must be at least 1, got {args.limit}")
    limit = args.limit if args.limit is not None else (None if args.json else STATE_ROWS)
    _require_schema(store)
    # every refusal (unknown, not completed, pruned, no state) before the seconds a JVM takes to start
    for n in (args.epoch, args.diff):
        if n is not None:
            state.resolve_state(store, args.pipeline, n, args.stage, storage_uri=args.storage_uri)
    spark = state.local_spark()
    kwargs: dict[str, Any] = {"spark": spark, "operator_id": args.operator, "storage_uri": args.storage_uri}
    if args.diff is not None:
        diff = state.read_state_diff(store, args.pipeline, args.diff, args.epoch, args.stage, **kwargs)
        counts = state.diff_counts(diff)
        ordered = diff.orderBy("change", "key")
        rows = [r.asDict(recursive=True) for r in (ordered if limit is None else ordered.limit(limit)).collect()]
        if args.json:
            json.dump({"before": args.diff, "after": args.epoch, "counts": counts, "sample": rows}, out,
                      default=str)
            out.write("\n")
            return EXIT_OK
        _table(["CHANGE", "KEY", "BEFORE", "AFTER"],
               [[r["change"], _state_cell(r["key"]), _state_cell(r["before"]), _state_cell(r["after"])]
                for r in rows], out)
        out.write(f"epoch {args.diff} -> {args.epoch} of stage {args.stage}: {counts['added']} keys added, "
                  f"{counts['removed']} removed, {counts['changed']} changed\n")
        return EXIT_OK
    df = state.read_state(store, args.pipeline, args.epoch, args.stage, **kwargs)
    total = df.count()
    ordered = df.orderBy("key")
    rows = [r.asDict(recursive=True) for r in (ordered if limit is None else ordered.limit(limit)).collect()]
    if args.json:
        json.dump(rows, out, default=str)
        out.write("\n")
        return EXIT_OK
    _table(["KEY", "VALUE", "PARTITION"],
           [[_state_cell(r["key"]), _state_cell(r["value"]), r["partition_id"]] for r in rows], out)
    out.write(f"{total} rows in the state of stage {args.stage} as of epoch {args.epoch}"
              + (f" (first {len(rows)} by key; --limit N for more)" if len(rows) < total else "") + "\n")
    return EXIT_OK


def _gate_row(g: GateRecord) -> list[Any]:
    return [g.epoch, g.sink, g.state.value, f"{g.batch_from}..{g.batch_to}", _when(g.opened_at), _when(g.deadline),
            g.decided_by, _headline(g.reason, CAUSE_WIDTH)]


_GATE_HEADERS = ["EPOCH", "SINK", "STATE", "BATCHES", "OPENED", "DEADLINE", "DECIDED BY", "REASON"]


def _cmd_gate(store: EpochStore, args: argparse.Namespace, out: IO[str]) -> int:
    """Commit gates (:mod:`airflow_arroyo.core.gates`): list them, show one's pending output, record a verdict."""
    _require_schema(store)
    store.get_pipeline(args.pipeline)  # unknown pipeline: exit 2 (a list of its gates would just be empty)
    if args.gate_command == "list":
        return _gate_list(store, args, out)
    if args.gate_command == "show":
        return _gate_show(store, args, out)
    return _gate_verdict(store, args, out)


def _gate_list(store: EpochStore, args: argparse.Namespace, out: IO[str]) -> int:
    if args.all:
        gates: list[GateRecord] = []
        while True:  # every gate, in opening order, a page at a time
            page = store.list_gates(args.pipeline, sink=args.sink, after_seq=gates[-1].seq if gates else 0,
                                    limit=500)
            gates += page
            if len(page) < 500:
                break
    else:
        gates = [g for g in store.open_gates(args.pipeline) if args.sink is None or g.sink == args.sink]
    if args.json:
        json.dump(_jsonable(gates), out)
        out.write("\n")
        return EXIT_OK
    if not gates:
        of_sink = f" of sink {args.sink}" if args.sink else ""
        which = "no gates" if args.all else "no gates waiting (--all lists the closed ones too)"
        out.write(f"pipeline {args.pipeline} has {which}{of_sink}\n")
        return EXIT_OK
    _table(_GATE_HEADERS, [_gate_row(g) for g in gates], out)
    return EXIT_OK


def _gate_show(store: EpochStore, args: argparse.Namespace, out: IO[str]) -> int:
    from airflow_arroyo.core.gates import OPEN_GATE_STATES, pending_output

    gate = store.get_gate(args.pipeline, args.sink, args.epoch)
    pending = pending_output(store, args.pipeline, args.sink, args.epoch) if gate.state in OPEN_GATE_STATES \
        else None
    if args.json:
        json.dump({"gate": _jsonable(gate),
                   "pending": None if pending is None else {
                       "kind": pending.kind, "files": list(pending.files), "format": pending.format,
                       "select_sql": pending.select_sql,
                       "select_params": list(pending.select_params) if pending.select_params else None,
                       "rows": pending.rows}}, out)
        out.write("\n")
        return EXIT_OK
    _table(_GATE_HEADERS, [_gate_row(g) for g in [gate]], out)
    out.write(f"policy {gate.policy.value}; run {gate.run_id}; sink {gate.uri}\n")
    if gate.reason and len(gate.reason) > CAUSE_WIDTH:
        out.write(f"reason: {gate.reason}\n")
    if pending is None:
        out.write(f"its output no longer waits: the gate is {gate.state.value}\n")
    elif pending.kind == "files":
        rows = "" if pending.rows is None else f", {pending.rows} rows"
        out.write(f"pending output: {len(pending.files)} {pending.format or ''} files{rows}\n".replace("  ", " "))
        for f in pending.files:
            out.write(f"  {f}\n")
    else:
        assert pending.select_sql is not None and pending.select_params is not None
        out.write("pending rows (in the sink's target database; a check reads them read-only):\n"
                  f"  {pending.select_sql}\n  -- with batches {pending.select_params[0]} and "
                  f"{pending.select_params[1]} for the two %s\n")
    if pending is not None:
        out.write(f"record a verdict: airflow-arroyo gate pass|fail {gate.pipeline_id} --sink {gate.sink} "
                  f"--epoch {gate.epoch} --reason TEXT\n")
    return EXIT_OK


def _gate_verdict(store: EpochStore, args: argparse.Namespace, out: IO[str]) -> int:
    from airflow_arroyo.core.gates import record_verdict

    by = args.by
    if by is None:
        try:
            by = getpass.getuser()
        except (OSError, KeyError):  # no user name in the environment and none in the password database
            raise ConfigurationError("cannot tell who gives this verdict (no OS user name): pass --by NAME") from None
    before = store.get_gate(args.pipeline, args.sink, args.epoch)
    gate = record_verdict(store, args.pipeline, args.sink, args.epoch, passed=args.gate_command == "pass", by=by,
                          reason=args.reason)
    if args.json:
        json.dump({**_jsonable(gate), "changed": gate.state is not before.state}, out)
        out.write("\n")
        return EXIT_OK
    what = f"the gate of sink {gate.sink} for epoch {gate.epoch} of pipeline {gate.pipeline_id}"
    if gate.state is before.state:
        by_whom = f" by {gate.decided_by}" if gate.decided_by else ""
        out.write(f"{what} is already {gate.state.value}{by_whom}; nothing changed\n")
    else:
        reason = f" ({gate.reason})" if gate.reason else ""
        out.write(f"{what} is {gate.state.value} by {gate.decided_by}{reason}; the pipeline's driver acts on it "
                  f"(was {before.state.value})\n")
    return EXIT_OK


class _NotStarted(ArroyoError):
    """``checkpoint`` could not start an epoch (exit 1)."""


class _NotPinned(ArroyoError):
    """``stop --pin`` stopped the run but found no final epoch to pin (exit 1)."""


# --------------------------------------------------------------------------- parser and main


def _build_parser() -> _Parser:
    common = _Parser(add_help=False)
    common.add_argument("--dsn", default=argparse.SUPPRESS,
                        help=f"PostgreSQL URI of the epoch store (default: ${DSN_ENV})")
    common.add_argument("--conn-id", default=argparse.SUPPRESS,
                        help="an Airflow connection id instead of --dsn (needs Airflow)")
    common.add_argument("--json", action="store_true", default=argparse.SUPPRESS,
                        help="print JSON instead of a table")

    parser = _Parser(prog="airflow-arroyo", parents=[common],
                     description="Operate the airflow-arroyo epoch store: schema, pipelines, epochs, retention.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    sub.add_parser("migrate", parents=[common], help="apply missing schema migrations")
    sub.add_parser("pipelines", parents=[common], help="list registered pipelines")
    epochs = sub.add_parser("epochs", parents=[common], help="list a pipeline's epochs, newest first")
    epochs.add_argument("pipeline")
    epochs.add_argument("--limit", type=int, default=20, help="at most this many epochs (default 20)")
    restarts = sub.add_parser("restarts", parents=[common],
                              help="list a supervised pipeline's failures and restarts, newest first")
    restarts.add_argument("pipeline")
    restarts.add_argument("--lineage", metavar="L",
                          help="only this lineage's (the first run id of a supervised chain of runs)")
    prune = sub.add_parser("prune", parents=[common], help="prune old epochs under the cleanup lock")
    prune.add_argument("pipeline", nargs="?")
    prune.add_argument("--all", action="store_true", help="every registered pipeline")
    prune.add_argument("--keep-last", metavar="K", help="keep the last K completed epochs")
    prune.add_argument("--keep-newer-than", metavar="DURATION", help="keep epochs newer than e.g. 90m, 6h, 7d")
    prune.add_argument("--lock-ttl", type=float, default=60.0, help="cleanup lease in seconds (default 60)")
    prune.add_argument("--wait-for-lock", default="0", metavar="DURATION",
                       help="retry this long while another cleanup holds the lock (default 0: skip)")
    prune.add_argument("--wait-for-in-flight", default="5m", metavar="DURATION",
                       help="wait this long for an in-flight epoch to end (default 5m)")
    prune.add_argument("--compact-after", default="7d", metavar="DURATION",
                       help="then delete pruned epochs, history and cleanup runs released longer ago than this "
                            "(default 7d; 'none': keep them)")
    pin = sub.add_parser("pin", parents=[common],
                         help="pin a completed epoch: retention never prunes it or what a restore of it reads")
    pin.add_argument("pipeline")
    pin.add_argument("epoch", type=int)
    pin.add_argument("--label", required=True, metavar="TEXT", help="why it is kept, e.g. 'before the 2.0 upgrade'")
    pin.add_argument("--replace", action="store_true",
                     help="replace the label of an epoch already pinned with another (refused without it)")
    unpin = sub.add_parser("unpin", parents=[common], help="unpin an epoch; the retention policy applies again")
    unpin.add_argument("pipeline")
    unpin.add_argument("epoch", type=int)
    unpin.add_argument("--force", action="store_true",
                       help="unpin even the fork point of a fork that has not completed an epoch of its own")
    fork = sub.add_parser("fork", parents=[common],
                          help="fork a new pipeline from a completed epoch of another (its snapshots shared)")
    fork.add_argument("source")
    fork.add_argument("--epoch", type=int, required=True, help="the completed epoch of SOURCE to start from")
    fork.add_argument("--to", required=True, metavar="NEW", help="the new pipeline's id")
    restore = sub.add_parser("restore", parents=[common],
                             help="check that a pipeline can restore an epoch now and print how to launch it")
    restore.add_argument("pipeline")
    restore.add_argument("--epoch", default="latest", help="an epoch number or 'latest' (default)")
    upgrade = sub.add_parser("upgrade-plan", parents=[common],
                             help="dry run: which stages of new pipeline code restore an epoch's state")
    upgrade.add_argument("pipeline")
    upgrade.add_argument("--pipeline-module", required=True, metavar="MODULE:ATTR",
                         help="the new code's Pipeline (or a function returning one), as the driver's --pipeline")
    upgrade.add_argument("--epoch", default="latest", help="an epoch number or 'latest' (default)")
    upgrade.add_argument("--allow-dropped-state", action="append", metavar="STAGE",
                         help="a stage of the epoch the new code drops, with its state (repeatable)")
    upgrade.add_argument("--rename", action="append", metavar="OLD=NEW",
                         help="the epoch's stage OLD restores into the new stage NEW (repeatable)")
    upgrade.add_argument("--check-state-schema", action="store_true",
                         help="plan as the driver will: starts a local Spark session to plan the new code's "
                              "DataFrames (nothing runs, nothing is written), so that the plan is of the queries "
                              "the driver fuses and each restored query's state shape is checked")
    up = sub.add_parser("upgrade", parents=[common],
                        help="upgrade a running pipeline to new code: plan, stop with a final epoch, pin it, plan "
                             "again, then start the new code (--start) or print how")
    up.add_argument("pipeline")
    up.add_argument("--pipeline-module", required=True, metavar="MODULE:ATTR", help="the new code's Pipeline")
    up.add_argument("--allow-dropped-state", action="append", metavar="STAGE",
                    help="a stage of the epoch the new code drops, with its state (repeatable)")
    up.add_argument("--rename", action="append", metavar="OLD=NEW",
                    help="the epoch's stage OLD restores into the new stage NEW (repeatable)")
    up.add_argument("--label", help="the pin label of the final epoch (default: 'upgrade <time>')")
    up.add_argument("--wait", default="10m", metavar="DURATION",
                    help="how long the old run may take to stop, and the new one to run (default 10m)")
    up.add_argument("--start", action="store_true",
                    help="start the new code as a local driver process (output to --log) and wait until it runs")
    up.add_argument("--master", help="the Spark master of the started driver, e.g. 'local[2]'")
    up.add_argument("--log", help="the started driver's log file (default: ./<pipeline>-upgrade-<time>.log)")
    up.add_argument("--driver", help="the driver script to start (default: the runtime driver module)")
    up.add_argument("--check-state-schema", action="store_true",
                    help="both plan steps also check each restored stage's state shape in a local Spark session, "
                         "as upgrade-plan --check-state-schema does: a refusal comes while the old code still runs")
    lock = sub.add_parser("lock", parents=[common], help="show who holds a pipeline's cleanup lock")
    lock.add_argument("pipeline")
    stop = sub.add_parser("stop", parents=[common],
                          help="ask a running pipeline to stop (graceful: after a final epoch)")
    stop.add_argument("pipeline")
    stop.add_argument("--immediate", action="store_true", help="stop without a final epoch")
    stop.add_argument("--wait", default="0", metavar="DURATION",
                      help="wait this long for the run to end, e.g. 2m (default 0: only ask; 5m with --pin); "
                           "exit 1 if it has not")
    stop.add_argument("--pin", metavar="LABEL", help="once stopped, pin the final epoch with this label")
    verify = sub.add_parser("verify", parents=[common],
                            help="re-hash the snapshot objects of the retained epochs; name damaged epochs")
    verify.add_argument("pipeline")
    verify.add_argument("--epoch", type=int, help="only this epoch's objects")
    verify.add_argument("--budget", metavar="DURATION",
                        help="stop after this long (least recently verified objects first; default: check all)")
    checkpoint = sub.add_parser("checkpoint", parents=[common], help="fire one epoch now and wait for its end")
    checkpoint.add_argument("pipeline")
    checkpoint.add_argument("--self-contained", action="store_true",
                            help="the epoch's snapshot copies every object (shares none with other epochs)")
    checkpoint.add_argument("--timeout", default="5m", metavar="DURATION",
                            help="give up (and expire the epoch) after this long (default 5m)")
    state = sub.add_parser("state", parents=[common],
                           help="print a stage's state as of a completed epoch (needs pyspark: a local Spark session)")
    state.add_argument("pipeline")
    state.add_argument("--epoch", type=int, required=True, help="a completed, retained epoch")
    state.add_argument("--stage", required=True, help="a stateful stage of the pipeline")
    state.add_argument("--operator", type=int, metavar="ID",
                       help="the stateful operator (needed when the stage's query has several)")
    state.add_argument("--limit", type=int,
                       help=f"print at most this many rows, by key (default {STATE_ROWS}; --json prints them all "
                            "unless given)")
    state.add_argument("--diff", type=int, metavar="M",
                       help="print the keys added, removed and changed from epoch M to --epoch instead")
    state.add_argument("--storage-uri", metavar="URI",
                       help="where the snapshot objects are, when not the storage URI the pipeline registered")
    prov = sub.add_parser("provenance", parents=[common],
                          help="what an epoch read, snapshotted and committed; which epoch wrote a file or version")
    prov.add_argument("pipeline")
    asked = prov.add_mutually_exclusive_group(required=True)
    asked.add_argument("--epoch", type=int, help="a completed, retained epoch: its input ranges and commits")
    asked.add_argument("--file", metavar="PATH", help="a file sink's committed file: the epoch that wrote it")
    asked.add_argument("--table-version", type=int, metavar="V",
                       help="a table sink's version (with --sink): the epoch that made it")
    prov.add_argument("--sink", help="the table sink of --table-version")
    prov.add_argument("--storage-uri", metavar="URI",
                      help="where the snapshot objects are, when not the storage URI the pipeline registered")
    gate = sub.add_parser("gate", parents=[common],
                          help="commit gates: list them, show one's pending output, record a pass or a fail")
    verbs = gate.add_subparsers(dest="gate_command", metavar="VERB", parser_class=_Parser)
    verbs.required = True
    gate_list = verbs.add_parser("list", parents=[common], help="the gates that wait (--all: every gate)")
    gate_list.add_argument("pipeline")
    gate_list.add_argument("--sink", help="only this sink's gates")
    gate_list.add_argument("--all", action="store_true",
                           help="every gate, also committed, quarantined and superseded ones, in opening order")
    for verb, text in (("show", "one gate and its pending output"),
                       ("pass", "record a pass: the gate's output commits"),
                       ("fail", "record a fail: the gate's policy acts (hold, rollback_and_stop, quarantine)")):
        one = verbs.add_parser(verb, parents=[common], help=text)
        one.add_argument("pipeline")
        one.add_argument("--sink", required=True, help="the gated sink")
        one.add_argument("--epoch", type=int, required=True, help="the gate's epoch")
        if verb != "show":
            one.add_argument("--reason", metavar="TEXT", help="why (shown in the UI and the listing)")
            one.add_argument("--by", metavar="NAME", help="who gives the verdict (default: the OS user name)")
    shadow = sub.add_parser("shadow", parents=[common],
                            help="shadow runs: fork a pinned epoch into new code with shadow sinks, compare, "
                                 "promote or discard")
    shadow_verbs = shadow.add_subparsers(dest="shadow_command", metavar="VERB", parser_class=_Parser)
    shadow_verbs.required = True
    sh_start = shadow_verbs.add_parser("start", parents=[common],
                                       help="fork an epoch of LIVE into a shadow running new code")
    sh_start.add_argument("live")
    sh_start.add_argument("--epoch", type=int, required=True, help="the completed epoch of LIVE to fork")
    sh_start.add_argument("--to", required=True, metavar="SHADOW", help="the shadow pipeline's id")
    sh_start.add_argument("--pipeline-module", required=True, metavar="MODULE:ATTR", help="the new code's Pipeline")
    sh_list = shadow_verbs.add_parser("list", parents=[common], help="the shadows of LIVE")
    sh_list.add_argument("live")
    sh_cmp = shadow_verbs.add_parser("compare", parents=[common],
                                     help="rows added, removed, changed per sink per epoch, shadow vs live")
    sh_cmp.add_argument("shadow")
    sh_cmp.add_argument("--key", action="append", metavar="SINK=COL[,COL]",
                        help="a sink's key columns: rows with the same key and other values count as changed")
    sh_prom = shadow_verbs.add_parser("promote", parents=[common],
                                      help="upgrade LIVE to the shadow's code from its latest epoch; end the shadow")
    sh_prom.add_argument("shadow")
    sh_prom.add_argument("--label", help="the pin label of the live pipeline's final epoch")
    sh_prom.add_argument("--wait", default="10m", metavar="DURATION", help="how long the live run may take to stop")
    sh_disc = shadow_verbs.add_parser("discard", parents=[common],
                                      help="end a stopped shadow: unpin its fork point; its data is left")
    sh_disc.add_argument("shadow")
    sh_disc.add_argument("--force", action="store_true",
                         help="unpin the fork point even though the shadow never completed an epoch of its own")
    return parser


#: Options whose value may start with "-" (a negative duration or number, refused with a clear message
#: instead of argparse's "expected one argument").
_VALUE_OPTIONS = ("--keep-last", "--keep-newer-than", "--wait-for-lock", "--wait-for-in-flight", "--lock-ttl",
                  "--compact-after",
                  "--limit", "--wait", "--budget", "--timeout", "--epoch", "--diff", "--operator", "--reason")


def _attach_dash_values(argv: list[str]) -> list[str]:
    """``--keep-newer-than -1h`` -> ``--keep-newer-than=-1h`` (argparse takes "-1h" for an option)."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg in _VALUE_OPTIONS and i + 1 < len(argv) and argv[i + 1].startswith("-") and argv[i + 1] != "--":
            out.append(f"{arg}={argv[i + 1]}")
            i += 2
            continue
        out.append(arg)
        i += 1
    return out


_COMMANDS: dict[str, Callable[[EpochStore, argparse.Namespace, IO[str]], int]] = {
    "migrate": _cmd_migrate,
    "pipelines": _cmd_pipelines,
    "epochs": _cmd_epochs,
    "restarts": _cmd_restarts,
    "prune": _cmd_prune,
    "lock": _cmd_lock,
    "pin": _cmd_pin,
    "unpin": _cmd_unpin,
    "stop": _cmd_stop,
    "fork": _cmd_fork,
    "restore": _cmd_restore,
    "upgrade-plan": _cmd_upgrade_plan,
    "upgrade": _cmd_upgrade,
    "verify": _cmd_verify,
    "checkpoint": _cmd_checkpoint,
    "state": _cmd_state,
    "provenance": _cmd_provenance,
    "gate": _cmd_gate,
    "shadow": _cmd_shadow,
}


def _scrub(message: str, args: argparse.Namespace | None) -> str:
    """Belt and braces: no password from --dsn / ARROYO_DSN in any message we print."""
    from urllib.parse import unquote

    for dsn in (getattr(args, "dsn", None), os.environ.get(DSN_ENV)):
        if not dsn:
            continue
        secrets: list[str] = []
        if "://" in dsn:
            try:
                password = urlsplit(dsn).password
            except ValueError:
                password = None
            if password:
                secrets += [password, unquote(password)]
        else:
            secrets += [p.split("=", 1)[1] for p in dsn.split() if p.startswith("password=")]
        for secret in secrets:
            if secret:
                message = message.replace(secret, "***")
    return message


class _LogsToStderr:
    """Point root logging handlers that write to stdout at ``err`` while the CLI runs (restored after).

    :meth:`rescan` catches handlers added meanwhile (importing Airflow adds one that logs to stdout).
    """

    def __init__(self, err: IO[str], stdout: IO[str]) -> None:
        self._err = err
        self._stdouts = (stdout, sys.__stdout__)
        self._moved: list[tuple[logging.StreamHandler[Any], Any]] = []

    def rescan(self) -> None:
        for handler in logging.getLogger().handlers:
            if isinstance(handler, logging.StreamHandler) and handler.stream in self._stdouts:
                self._moved.append((handler, handler.setStream(self._err)))

    def __enter__(self) -> _LogsToStderr:
        self.rescan()
        return self

    def __exit__(self, *exc: object) -> None:
        for handler, stream in reversed(self._moved):
            handler.setStream(stream)
        self._moved.clear()


def main(argv: Sequence[str] | None = None, *, stdout: IO[str] | None = None, stderr: IO[str] | None = None) -> int:
    """Entry point of the ``airflow-arroyo`` console script; returns the exit code."""
    out = stdout or sys.stdout
    err = stderr or sys.stderr
    args: argparse.Namespace | None = None
    try:
        args = _build_parser().parse_args(_attach_dash_values(list(sys.argv[1:] if argv is None else argv)))
        for name, default in (("dsn", None), ("conn_id", None), ("json", False)):
            if not hasattr(args, name):
                setattr(args, name, default)
        # Results go to ``out``; anything else that prints (Airflow's logging, once imported, logs
        # to stdout) goes to stderr, so that tables and --json stay clean.
        with contextlib.redirect_stdout(err), _LogsToStderr(err, out) as logs:
            store = _open_store(args)
            logs.rescan()
            try:
                return _COMMANDS[args.command](store, args, out)
            finally:
                if not args.conn_id:  # hook stores are shared per process; ours is private
                    store.close()
    except SystemExit as exc:  # --help
        return int(exc.code or 0)
    except UsageError as exc:
        err.write(f"{_scrub(str(exc), args)}\n")
        return EXIT_BAD_INPUT
    except (ConfigurationError, NotFoundError) as exc:  # SchemaError is a ConfigurationError
        err.write(f"error: {_scrub(str(exc), args)}\n")
        return EXIT_BAD_INPUT
    except (ArroyoError, psycopg2.Error, OSError) as exc:
        # the CLI's own errors (_NotStarted, _NotPinned) say everything in their message
        name = "" if type(exc).__name__.startswith("_") else f"{type(exc).__name__}: "
        err.write(f"error: {_scrub(f'{name}{exc}' if str(exc) else f'{type(exc).__name__} (no message)', args)}\n")
        return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
