"""The ``airflow-arroyo`` ops CLI against a real Postgres epoch store: tables, JSON, exit codes."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import pytest

from airflow_arroyo.cli import main
from airflow_arroyo.core.epochs import CheckpointPolicy, EpochState, PipelineState
from airflow_arroyo.core.supervision import PastFailure, RestartDecision
from airflow_arroyo.store import EpochStore
from tests.controlplane.test_retention import Pipeline, sql

VENV_BIN = Path(sys.executable).parent


@pytest.fixture(autouse=True)
def no_dsn_in_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ARROYO_DSN", raising=False)


# An info line of Airflow's logging: once a test imported Airflow, its handler may write to the stream the
# CLI points at stderr (by design, so that tables and --json stay clean); whether it does depends on which
# stream the handler caught when it was set up, i.e. on the order tests ran in. Warnings and errors count.
_INFO_LOG = re.compile(r"^\S+ \[info\s*\] ")


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    err = "".join(line for line in captured.err.splitlines(keepends=True) if not _INFO_LOG.match(line))
    return code, captured.out, err


def lines(text: str) -> list[list[str]]:
    return [line.split() for line in text.strip().splitlines()]


@pytest.fixture
def two_pipelines(store: EpochStore, tmp_path: Path) -> Iterator[tuple[Pipeline, Pipeline]]:
    orders = Pipeline(store, tmp_path / "o", "orders", stages=("src",))
    clicks = Pipeline(store, tmp_path / "c", "clicks", stages=("src",))
    for pipe in (orders, clicks):
        pipe.epoch({"src": {"a": 1000}})
        pipe.epoch({"src": {"b": 2000}})
        pipe.epoch({"src": {"c": 3000}})
    yield orders, clicks


def test_migrate_then_up_to_date(pg_dsn: str, capsys: pytest.CaptureFixture[str]) -> None:
    from airflow_arroyo.store import available_migrations

    versions = [v for v, _, _ in available_migrations()]
    assert versions[:2] == [1, 2]
    code, out, _ = run(capsys, "--dsn", pg_dsn, "migrate")
    assert code == 0 and out == f"applied migrations {', '.join(map(str, versions))}; schema version {versions[-1]}\n"
    code, out, _ = run(capsys, "migrate", "--dsn", pg_dsn, "--json")  # options after the command too
    assert code == 0 and json.loads(out) == {"applied": [], "schema_version": versions[-1]}


def test_unmigrated_store_is_bad_input(pg_dsn: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "--dsn", pg_dsn, "epochs", "orders")
    assert (code, out) == (2, "")
    assert "has no airflow-arroyo schema: run `airflow-arroyo migrate`" in err


@pytest.mark.usefixtures("two_pipelines")
def test_pipelines_table_and_json(store: EpochStore,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "--dsn", store.dsn, "pipelines")
    assert code == 0
    rows = lines(out)
    assert rows[0][:3] == ["PIPELINE", "STATE", "RUN"]
    assert [(r[0], r[1], r[2], r[3]) for r in rows[1:]] == [("clicks", "running", "run-1", "3"),
                                                           ("orders", "running", "run-1", "3")]
    code, out, _ = run(capsys, "pipelines", "--json", "--dsn", store.dsn)
    data = json.loads(out)
    assert [(p["pipeline_id"], p["state"], p["last_epoch"]) for p in data] == [("clicks", "running", 3),
                                                                               ("orders", "running", 3)]


def test_epochs_newest_first_with_limit(store: EpochStore, two_pipelines: tuple[Pipeline, Pipeline],
                                        capsys: pytest.CaptureFixture[str]) -> None:
    orders, _ = two_pipelines
    orders.epoch({"src": {"d": 1}}, end="fail")
    code, out, _ = run(capsys, "--dsn", store.dsn, "epochs", "orders", "--limit", "2")
    assert code == 0
    rows = lines(out)
    assert rows[0][:2] == ["EPOCH", "STATE"] and len(rows) == 3
    assert [r[:2] for r in rows[1:]] == [["4", "failed"], ["3", "completed"]]
    assert "stage agg could not snapshot" in out
    code, out, _ = run(capsys, "--dsn", store.dsn, "--json", "epochs", "orders")
    assert [(e["epoch"], e["state"]) for e in json.loads(out)] == [(4, "failed"), (3, "completed"),
                                                                   (2, "completed"), (1, "completed")]


CAUSE = ("the driver of run stream-1 failed: stage 'enrich' could not be built: KeyError: 'customer_id' while "
         "joining the orders with the customers table\nTraceback (most recent call last):\n  File \"enrich.py\", "
         "line 3, in transform\nKeyError: 'customer_id'")


def supervised_with_restarts(store: EpochStore, while_restarting: Callable[[], None] = lambda: None) -> None:
    """``stream``: lineage ``stream-1`` under fixed-delay (1 restart); it failed, was restarted as
    ``stream-1.restart1`` restoring its completed epoch 1, failed again, and the strategy gave up.
    ``while_restarting`` is called between the first failure and its restart."""
    from airflow_arroyo.core.epochs import CheckpointPolicy
    from airflow_arroyo.core.supervision import FixedDelay, decide_restart, restart_run_id

    strategy = FixedDelay(attempts=1, delay=5)

    def decide(failures: list[PastFailure], now: datetime, stop_requested: bool) -> RestartDecision:
        return decide_restart(strategy, failures, now, lineage="stream-1", stop_requested=stop_requested)

    store.register_pipeline("stream", stages=["src"], run_id="stream-1")
    store.set_pipeline_state("stream", PipelineState.RUNNING, run_id="stream-1")
    store.supervise("stream", "stream-1", strategy.to_dict())
    started = store.trigger_tick("stream", CheckpointPolicy(interval=60), force=True).started
    assert started is not None
    assert store.ack_epoch("stream", started.epoch, "src") is EpochState.COMPLETED
    first = store.record_failure("stream", "stream-1", "stream-1", CAUSE, decide)
    assert not first.gave_up and store.get_pipeline("stream").supervision == "restarting"
    while_restarting()
    store.register_pipeline("stream", stages=["src"], run_id=restart_run_id("stream-1", 1), takeover=True)
    store.record_restart("stream", "stream-1", 1, restart_run_id("stream-1", 1), started.epoch)
    store.set_pipeline_state("stream", PipelineState.RUNNING, run_id="stream-1.restart1")
    second = store.record_failure("stream", "stream-1", "stream-1.restart1", "heartbeat stopped", decide)
    assert second.gave_up


@pytest.mark.usefixtures("two_pipelines")
def test_restarts_table_and_json_newest_first(store: EpochStore, capsys: pytest.CaptureFixture[str]) -> None:
    def restart_due() -> None:
        code, out, _ = run(capsys, "--dsn", store.dsn, "restarts", "stream")
        assert code == 0 and len(out.splitlines()) == 3
        assert out.splitlines()[1].split()[-2:] == ["pending", "-"]  # decided, not resubmitted yet
        assert "supervision of lineage stream-1: restarting;" in out

    supervised_with_restarts(store, restart_due)
    code, out, err = run(capsys, "--dsn", store.dsn, "restarts", "stream")
    assert (code, err) == (0, "")
    table = out.splitlines()
    header = table[0]
    assert re.split(r"\s{2,}", header) == ["ATTEMPT", "FAILED AT", "FAILED RUN", "CAUSE", "DECISION", "RESTARTED AS",
                                          "RESTORED EPOCH"]
    cols = {name: header.index(name) for name in ("FAILED RUN", "CAUSE", "DECISION", "RESTARTED AS", "RESTORED EPOCH")}

    def cell(line: str, name: str) -> str:
        names = list(cols)
        end = cols[names[names.index(name) + 1]] if name != names[-1] else None
        return line[cols[name]:end].strip()

    newest, oldest = table[1], table[2]
    assert newest.split()[0] == "2" and oldest.split()[0] == "1"  # newest first
    assert cell(newest, "FAILED RUN") == "stream-1.restart1" and cell(oldest, "FAILED RUN") == "stream-1"
    assert cell(newest, "CAUSE") == "heartbeat stopped"
    shown = cell(oldest, "CAUSE")  # the first line, cut: the traceback is only in --json
    assert shown.endswith("...") and len(shown) <= 60
    assert shown[:-3] in CAUSE.splitlines()[0].replace("run stream-1 ", "this run ")  # its run is in FAILED RUN
    assert "Traceback" not in out and "KeyError: 'customer_id'\n" not in out
    assert cell(oldest, "DECISION") == "restart 1 of 1 (fixed-delay)"
    assert cell(newest, "DECISION").startswith("2 failures, more than the 1 restart(s)")
    assert (cell(oldest, "RESTARTED AS"), cell(oldest, "RESTORED EPOCH")) == ("stream-1.restart1", "1")
    assert (cell(newest, "RESTARTED AS"), cell(newest, "RESTORED EPOCH")) == ("gave up", "-")
    assert table[3] == ("supervision of lineage stream-1: gave_up; restart strategy fixed-delay: up to 1 restart, "
                        "5s after each failure")

    code, out, _ = run(capsys, "--dsn", store.dsn, "restarts", "stream", "--json")
    data = json.loads(out)
    assert code == 0
    assert [(r["attempt"], r["failed_run_id"], r["gave_up"], r["new_run_id"], r["restored_epoch"]) for r in data] == [
        (2, "stream-1.restart1", True, None, None), (1, "stream-1", False, "stream-1.restart1", 1)]
    assert data[1]["cause"] == CAUSE and data[1]["delay_s"] == 5.0  # the whole cause
    assert data[1]["failed_at"] <= data[1]["restarted_at"] <= data[0]["failed_at"]

    code, out, _ = run(capsys, "--dsn", store.dsn, "--json", "restarts", "stream", "--lineage", "stream-1")
    assert [r["attempt"] for r in json.loads(out)] == [2, 1]
    code, out, _ = run(capsys, "--dsn", store.dsn, "restarts", "stream", "--lineage", "other")
    assert (code, out) == (0, "pipeline stream has no failures or restarts recorded of lineage other\n")
    code, out, _ = run(capsys, "--dsn", store.dsn, "restarts", "orders")
    assert code == 0 and out.startswith("pipeline orders has no failures or restarts recorded (it has never been")
    code, out, err = run(capsys, "--dsn", store.dsn, "restarts", "nope")
    assert (code, out) == (2, "") and "no pipeline named 'nope'" in err


@pytest.mark.usefixtures("two_pipelines")
def test_pipelines_show_supervision_and_restart_count(store: EpochStore, capsys: pytest.CaptureFixture[str]) -> None:
    supervised_with_restarts(store)
    code, out, _ = run(capsys, "--dsn", store.dsn, "pipelines")
    assert code == 0
    header, *rows = out.splitlines()
    assert re.split(r"\s{2,}", header) == ["PIPELINE", "STATE", "RUN", "LAST EPOCH", "HEARTBEAT", "SUPERVISION",
                                          "RESTARTS", "STORAGE"]
    at = header.index("SUPERVISION"), header.index("RESTARTS"), header.index("STORAGE")
    by_id = {r.split()[0]: (r[at[0]:at[1]].strip(), r[at[1]:at[2]].strip()) for r in rows}
    assert by_id == {"clicks": ("-", "-"), "orders": ("-", "-"), "stream": ("gave_up", "1")}
    code, out, _ = run(capsys, "--dsn", store.dsn, "--json", "pipelines")
    data = {p["pipeline_id"]: p for p in json.loads(out)}
    assert (data["stream"]["supervision"], data["stream"]["supervised_run"], data["stream"]["restarts"]) == (
        "gave_up", "stream-1", 1)
    assert data["stream"]["restart_strategy"] == {"type": "fixed-delay", "attempts": 1, "delay": 5.0}
    assert (data["orders"]["supervision"], data["orders"]["restarts"], data["orders"]["last_epoch"]) == (None, None, 3)


def test_pin_shows_in_epochs_survives_prune_and_unpins(store: EpochStore, two_pipelines: tuple[Pipeline, Pipeline],
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    orders, _ = two_pipelines
    code, out, err = run(capsys, "--dsn", store.dsn, "pin", "orders", "1", "--label", "before upgrade")
    assert (code, err) == (0, "")
    assert out == "pinned epoch 1 of pipeline orders (before upgrade); retention keeps it until " \
                  "`airflow-arroyo unpin orders 1`\n"
    code, out, _ = run(capsys, "--dsn", store.dsn, "epochs", "orders")
    rows = lines(out)
    assert rows[0] == ["EPOCH", "STATE", "TRIGGERED", "DURATION", "SIZE", "FREED", "PIN", "REASON"]
    assert "before upgrade" in out.splitlines()[3] and "before upgrade" not in out.splitlines()[2]
    code, out, _ = run(capsys, "--dsn", store.dsn, "--json", "epochs", "orders")
    assert [(e["epoch"], e["pin_label"], e["pinned_at"] is not None) for e in json.loads(out)] == [
        (3, None, False), (2, None, False), (1, "before upgrade", True)]

    code, out, _ = run(capsys, "--dsn", store.dsn, "prune", "orders", "--keep-last", "1")
    assert code == 0
    assert orders.states() == {1: EpochState.COMPLETED, 2: EpochState.PRUNED, 3: EpochState.COMPLETED}

    code, out, _ = run(capsys, "--dsn", store.dsn, "--json", "unpin", "orders", "1")
    assert code == 0 and json.loads(out)["pin_label"] is None
    code, out, _ = run(capsys, "--dsn", store.dsn, "unpin", "orders", "1")
    assert (code, out) == (0, "epoch 1 of pipeline orders was not pinned; nothing changed\n")
    run(capsys, "--dsn", store.dsn, "prune", "orders", "--keep-last", "1")
    assert orders.states()[1] is EpochState.PRUNED


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["pin", "orders", "2"], "--label"),
        (["pin", "orders", "2", "--label", " "], "pin label must be 1 to 200 characters"),
        (["pin", "orders", "9", "--label", "x"], "pipeline 'orders' has no epoch 9 to pin"),
        (["pin", "orders", "4", "--label", "x"], "epoch 4 of pipeline 'orders' is failed, not completed"),
        (["unpin", "nope", "1"], "nope"),
    ],
)
def test_pin_bad_input_exits_2_and_pins_nothing(store: EpochStore, two_pipelines: tuple[Pipeline, Pipeline],
                                                capsys: pytest.CaptureFixture[str], argv: list[str],
                                                needle: str) -> None:
    orders, _ = two_pipelines
    orders.epoch({"src": {"d": 1}}, end="fail")
    code, out, err = run(capsys, "--dsn", store.dsn, *argv)
    assert (code, out) == (2, "")
    assert needle in err
    assert sql(store, "SELECT count(*) FROM arroyo_epochs WHERE pin_label IS NOT NULL") == [(0,)]


def test_prune_one_pipeline(store: EpochStore, two_pipelines: tuple[Pipeline, Pipeline],
                            capsys: pytest.CaptureFixture[str]) -> None:
    orders, clicks = two_pipelines
    code, out, err = run(capsys, "--dsn", store.dsn, "prune", "orders", "--keep-last", "1")
    assert (code, err) == (0, "")
    rows = lines(out)
    assert rows[0] == ["PIPELINE", "CLEANUP", "RUN", "PRUNED", "FREED", "KEPT", "NOTE"]
    assert rows[1] == ["orders", "1", "1,2", "2.9", "KiB", "3"]
    assert orders.states() == {1: EpochState.PRUNED, 2: EpochState.PRUNED, 3: EpochState.COMPLETED}
    assert clicks.states()[1] is EpochState.COMPLETED  # only the named pipeline
    assert not orders.path("a").exists() and clicks.path("a").exists()
    assert store.list_cleanup_runs("orders")[0].holder.startswith("cli:")


def test_prune_all_json(store: EpochStore, two_pipelines: tuple[Pipeline, Pipeline],
                        capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "--dsn", store.dsn, "--json", "prune", "--all", "--keep-newer-than", "1h",
                       "--keep-last", "2")
    assert code == 0
    reports = json.loads(out)
    assert [(r["pipeline_id"], r["epochs_pruned"], r["kept"], r["error"]) for r in reports] == [
        ("clicks", [], [1, 2, 3], None), ("orders", [], [1, 2, 3], None)]  # all newer than 1h
    for pipe in two_pipelines:
        pipe.age(1, hours=2)
    code, out, _ = run(capsys, "--dsn", store.dsn, "--json", "prune", "--all", "--keep-newer-than", "1h")
    reports = json.loads(out)
    assert [(r["pipeline_id"], r["epochs_pruned"], r["bytes_freed"]) for r in reports] == [
        ("clicks", [1], 1000), ("orders", [1], 1000)]


def test_prune_reports_a_skip(store: EpochStore, two_pipelines: tuple[Pipeline, Pipeline],
                              capsys: pytest.CaptureFixture[str]) -> None:
    store.acquire_cleanup_lock("orders", "ops:bob", ttl=600)
    code, out, _ = run(capsys, "--dsn", store.dsn, "prune", "orders", "--keep-last", "1")
    assert code == 0 and "skipped: cleanup lock held by ops:bob" in out
    assert two_pipelines[0].states()[1] is EpochState.COMPLETED


@pytest.mark.usefixtures("two_pipelines")
def test_stop_asks_the_driver_and_waits_for_the_run_to_end(store: EpochStore,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "--dsn", store.dsn, "stop", "orders")
    assert code == 0 and "asked pipeline orders (run run-1) to stop (graceful); pass --wait" in out
    assert store.get_pipeline("orders").stop_requested == "graceful"
    # nobody acts on the request: --wait runs out, exit 1, and the message says what to check
    code, out, _ = run(capsys, "--dsn", store.dsn, "stop", "orders", "--wait", "1s")
    assert code == 1 and "still running after 1s" in out

    stop_seen = threading.Event()

    def driver() -> None:  # what a driver's loop does with the request (here: no final epoch)
        while store.get_pipeline("clicks").stop_requested != "immediate":
            if stop_seen.wait(0.05):
                return
        store.set_pipeline_state("clicks", PipelineState.STOPPED, run_id="run-1")

    thread = threading.Thread(target=driver)
    thread.start()
    try:
        code, out, _ = run(capsys, "--dsn", store.dsn, "--json", "stop", "clicks", "--immediate", "--wait", "1m")
    finally:
        stop_seen.set()
        thread.join()
    assert code == 0
    assert json.loads(out) == {"pipeline_id": "clicks", "run_id": "run-1", "mode": "immediate", "state": "stopped",
                               "stopped": True, "latest_completed_epoch": store.latest_completed_epoch("clicks").epoch,
                               "failure_cause": None}
    code, _, err = run(capsys, "--dsn", store.dsn, "stop", "clicks")
    assert code == 2 and "pipeline clicks is not running: its run run-1 is already stopped; nothing to stop" in err
    code, _, err = run(capsys, "--dsn", store.dsn, "stop", "nope")
    assert code == 2 and "no pipeline named 'nope'" in err


def test_stop_of_a_failed_run_with_a_restart_pending_cancels_the_restart(store: EpochStore,
                                                                         capsys: pytest.CaptureFixture[str]) -> None:
    store.register_pipeline("sup", stages=["a"], run_id="L")
    store.set_pipeline_state("sup", PipelineState.RUNNING, run_id="L")
    store.supervise("sup", "L", {"type": "fixed-delay"})
    store.set_pipeline_state("sup", PipelineState.FAILED, run_id="L", failure_cause="OOM")
    code, out, _ = run(capsys, "--dsn", store.dsn, "stop", "sup")
    assert code == 0 and "run L failed (OOM); its supervisor's restart is cancelled" in out
    assert store.get_pipeline("sup").stop_requested == "graceful"  # what the supervisor reads before restarting


@pytest.mark.usefixtures("two_pipelines")
def test_lock_shows_the_holder(store: EpochStore,
                               capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "--dsn", store.dsn, "lock", "orders")
    assert (code, out) == (0, "pipeline orders: no cleanup lock held\n")
    held = store.acquire_cleanup_lock("orders", "ops:alice@host:42", ttl=600)
    code, out, _ = run(capsys, "--dsn", store.dsn, "lock", "orders")
    rows = lines(out)
    assert rows[0][:3] == ["PIPELINE", "HOLDER", "CLEANUP"]
    assert rows[1][:3] == ["orders", "ops:alice@host:42", str(held.id)]
    assert f"last cleanup run {held.id}: running" in out
    code, out, _ = run(capsys, "--dsn", store.dsn, "lock", "orders", "--json")
    data = json.loads(out)
    assert data["lock"]["holder"] == "ops:alice@host:42" and data["lock"]["cleanup_run"] == held.id
    assert data["last_run"]["state"] == "running"


@pytest.mark.usefixtures("two_pipelines")
def test_dsn_from_the_environment(store: EpochStore,
                                  capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ARROYO_DSN", store.dsn)
    code, out, _ = run(capsys, "pipelines", "--json")
    assert code == 0 and len(json.loads(out)) == 2


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["pipelines"], "no epoch store given"),
        (["--dsn", "{dsn}", "prune", "orders"], "say what to keep: --keep-last K and/or --keep-newer-than"),
        (["--dsn", "{dsn}", "prune", "orders", "--keep-last", "0"], "--keep-last must be a whole number >= 1"),
        (["--dsn", "{dsn}", "prune", "orders", "--keep-last", "-2"], "--keep-last must be a whole number >= 1"),
        (["--dsn", "{dsn}", "prune", "orders", "--keep-newer-than", "soon"], "--keep-newer-than 'soon' is not a"),
        (["--dsn", "{dsn}", "prune", "orders", "--keep-newer-than", "-1h"], "--keep-newer-than must be a positive"),
        (["--dsn", "{dsn}", "prune", "orders", "--keep-newer-than=-1h"], "--keep-newer-than must be a positive"),
        (["--dsn", "{dsn}", "prune", "orders", "--keep-newer-than", "0"], "--keep-newer-than must be a positive"),
        (["--dsn", "{dsn}", "prune", "--keep-last", "3"], "name one PIPELINE to prune, or --all"),
        (["--dsn", "{dsn}", "prune", "orders", "--all", "--keep-last", "3"], "either a PIPELINE (orders) or --all"),
        (["--dsn", "not a dsn", "pipelines"], "expected postgresql://user[:password]@host[:port]/database"),
        (["--dsn", "postgresql://u@h:port/db", "pipelines"], "expected postgresql://"),
        (["--dsn", "mysql://u@h/db", "pipelines"], "got a mysql:// URI"),
        (["--dsn", "{dsn}", "prune", "nope", "--keep-last", "3"], "no pipeline named 'nope'"),
        (["--dsn", "{dsn}", "epochs", "nope"], "no pipeline named 'nope'"),
        (["--dsn", "{dsn}", "lock", "nope"], "no pipeline named 'nope'"),
        (["--dsn", "{dsn}", "epochs", "orders", "--limit", "0"], "--limit"),
        (["--dsn", "{dsn}", "epochs", "orders", "--limit", "x"], "invalid int"),
        (["--dsn", "{dsn}", "--conn-id", "x", "pipelines"], "not both"),
        (["--dsn", "{dsn}", "vacuum"], "invalid choice"),
        (["--dsn", "{dsn}"], "required"),
    ],
)
@pytest.mark.usefixtures("two_pipelines")
def test_bad_input_exits_2_before_anything_is_written(store: EpochStore,
                                                      capsys: pytest.CaptureFixture[str], argv: list[str],
                                                      needle: str) -> None:
    code, out, err = run(capsys, *[a.replace("{dsn}", store.dsn) for a in argv])
    assert (code, out) == (2, "")
    assert needle in err
    assert "timedelta" not in err and "keep_newer_than" not in err and "keep_last" not in err
    assert sql(store, "SELECT count(*) FROM arroyo_cleanup_runs") == [(0,)]


def test_store_errors_exit_1_and_never_print_the_password(pg_dsn: str, capsys: pytest.CaptureFixture[str]) -> None:
    parts = urlsplit(pg_dsn)
    secret = "Sup3r-s3cret"
    bad = urlunsplit(parts._replace(netloc=f"{parts.username}:{secret}@{parts.hostname}:{parts.port}",
                                    path="/no_such_database"))
    code, out, err = run(capsys, "--dsn", bad, "pipelines")
    assert code == 1 and out == ""
    assert "no_such_database" in err and secret not in err


@pytest.mark.usefixtures("two_pipelines")
def test_conn_id_resolves_an_airflow_connection(store: EpochStore,
                                                capsys: pytest.CaptureFixture[str],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    from airflow_arroyo.hooks import arroyo as hook_module

    monkeypatch.setenv("AIRFLOW_CONN_ARROYO_OPS", store.dsn)
    try:
        code, out, _ = run(capsys, "--conn-id", "arroyo_ops", "--json", "pipelines")
        assert code == 0 and [p["pipeline_id"] for p in json.loads(out)] == ["clicks", "orders"]
        code, _, err = run(capsys, "--conn-id", "no_such_conn", "pipelines")
        assert code == 2 and "no Airflow connection 'no_such_conn'" in err
    finally:
        hook_module._reset_shared_stores()


@pytest.mark.usefixtures("two_pipelines")
def test_console_script_without_airflow(store: EpochStore) -> None:
    """The --dsn path never imports Airflow (ops hosts and Spark nodes may not have it)."""
    probe = (
        "import sys\n"
        "from airflow_arroyo.cli import main\n"
        "rc = main(sys.argv[1:])\n"
        "leaked = sorted(m for m in sys.modules if m == 'airflow' or m.startswith('airflow.'))\n"
        "assert not leaked, leaked[:5]\n"
        "sys.exit(rc)\n"
    )
    done = subprocess.run([sys.executable, "-c", probe, "--dsn", store.dsn, "--json", "epochs", "orders",
                           "--limit", "1"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert [e["epoch"] for e in json.loads(done.stdout)] == [3]
    script = subprocess.run([str(VENV_BIN / "airflow-arroyo"), "--help"], capture_output=True, text=True,
                            timeout=120)
    assert script.returncode == 0 and "prune" in script.stdout


@pytest.mark.usefixtures("two_pipelines")
def test_conn_id_from_an_environment_uri_does_not_import_airflow(store: EpochStore) -> None:
    """``--conn-id`` took ~15 s: it imported Airflow to read a connection the environment already
    holds as a URI. Now that case is read directly (other sources still go through Airflow)."""
    probe = (
        "import sys, time\n"
        "from airflow_arroyo.cli import main\n"
        "rc = main(sys.argv[1:])\n"
        "leaked = sorted(m for m in sys.modules if m == 'airflow' or m.startswith('airflow.'))\n"
        "assert not leaked, leaked[:5]\n"
        "sys.exit(rc)\n"
    )
    env = {**os.environ, "AIRFLOW_CONN_ARROYO_FAST": store.dsn}
    done = subprocess.run([sys.executable, "-c", probe, "--conn-id", "arroyo_fast", "--json", "pipelines"],
                          capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    assert [p["pipeline_id"] for p in json.loads(done.stdout)] == ["clicks", "orders"]
    # the JSON form, with a libpq extra, is read the same way (connections.dsn_from_env_value, the one path)
    parts = urlsplit(store.dsn)
    as_json = json.dumps({"conn_type": "arroyo", "host": parts.hostname, "port": parts.port, "login": parts.username,
                          "password": parts.password, "schema": parts.path.lstrip("/"),
                          "extra": {"connect_timeout": 7}})
    done = subprocess.run([sys.executable, "-c", probe, "--conn-id", "arroyo_fast", "--json", "pipelines"],
                          capture_output=True, text=True, timeout=120, env={**env, "AIRFLOW_CONN_ARROYO_FAST": as_json})
    assert done.returncode == 0, done.stderr
    assert [p["pipeline_id"] for p in json.loads(done.stdout)] == ["clicks", "orders"]


def test_fork_table_and_json_and_its_fork_point_cannot_be_unpinned(
        store: EpochStore, two_pipelines: tuple[Pipeline, Pipeline], capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "--dsn", store.dsn, "fork", "orders", "--epoch", "2", "--to", "orders-b")
    assert (code, err) == (0, "")
    assert lines(out)[:2] == [["FORK", "FROM", "EPOCH", "STATE", "SOURCE", "PIN"],
                              ["orders-b", "orders", "2", "stopped", "fork:orders-b"]]
    assert out.splitlines()[2] == ("epoch 2 of orders stays pinned until orders-b completes an epoch of its own; "
                                   "orders-b's epochs are numbered from 3")
    code, out, _ = run(capsys, "--dsn", store.dsn, "--json", "fork", "orders", "--epoch", "2", "--to", "orders-b")
    fork = json.loads(out)
    assert code == 0 and (fork["pipeline_id"], fork["forked_from_pipeline"], fork["forked_from_epoch"],
                          fork["source_pin_label"], fork["state"]) == ("orders-b", "orders", 2, "fork:orders-b",
                                                                       "stopped")
    code, _, err = run(capsys, "--dsn", store.dsn, "unpin", "orders", "2")
    assert code == 2 and "is the fork point of orders-b" in err
    assert store.get_epoch("orders", 2).pin_label == "fork:orders-b"
    code, _, err = run(capsys, "--dsn", store.dsn, "fork", "orders", "--epoch", "2", "--to", "clicks")
    assert code == 2 and "pipeline 'clicks' already exists" in err
    # a fork's first run restores its fork point
    code, out, _ = run(capsys, "--dsn", store.dsn, "--json", "restore", "orders-b")
    plan = json.loads(out)
    assert code == 0 and (plan["epoch"], plan["epoch_of"], plan["restore_from"], plan["pin_label"]) == (
        2, "orders", "latest", "fork:orders-b")
    code, _, err = run(capsys, "--dsn", store.dsn, "restore", "orders-b", "--epoch", "1")
    assert code == 2 and "its first run restores that epoch, not 1; restore 'latest'" in err
    code, out, _ = run(capsys, "--dsn", store.dsn, "unpin", "orders", "2", "--force")
    assert code == 0 and store.get_epoch("orders", 2).pin_label is None


def test_restore_checks_the_epoch_and_prints_how_to_launch_it(
        store: EpochStore, two_pipelines: tuple[Pipeline, Pipeline], capsys: pytest.CaptureFixture[str]) -> None:
    orders, _ = two_pipelines
    code, _, err = run(capsys, "--dsn", store.dsn, "restore", "orders", "--epoch", "2")
    assert code == 2 and "pipeline orders is running (run run-1): stop it first" in err
    orders.epoch({"src": {"d": 1}}, end="fail")
    store.set_pipeline_state("orders", PipelineState.STOPPED)
    store.pin_epoch("orders", 2, "before upgrade")

    code, out, err = run(capsys, "--dsn", store.dsn, "restore", "orders", "--epoch", "2")
    assert (code, err) == (0, "")
    header, row = out.splitlines()[:2]
    assert header.split() == ["PIPELINE", "RESTORE", "FROM", "EPOCH", "OF", "ENDED", "PIN", "SUPERSEDES"]
    assert row.split()[:3] == ["orders", "2", "orders"] and row.rstrip().endswith("before upgrade  3")
    assert f"--restore-from 2 --storage-uri {orders.root}" in out and "restore_from=2" in out
    code, out, _ = run(capsys, "--dsn", store.dsn, "--json", "restore", "orders")
    plan = json.loads(out)
    assert code == 0 and (plan["epoch"], plan["restore_from"], plan["supersedes"]) == (3, "latest", [])
    assert plan["driver_args"][-4:] == ["--restore-from", "latest", "--storage-uri", str(orders.root)]
    for epoch, needle in (("4", "epoch 4 of pipeline 'orders' is failed, not completed"),
                          ("9", "has no epoch 9"), ("x", "--epoch must be an epoch number or 'latest'")):
        code, out, err = run(capsys, "--dsn", store.dsn, "restore", "orders", "--epoch", epoch)
        assert (code, out) == (2, "") and needle in err, err
    # the driver's own rule decides: an epoch a restore proved unrestorable is refused here too, and 'latest'
    # then names it rather than silently picking an older one (the driver would refuse it the same way)
    store.mark_unrestorable("orders", 3, "state/0/0/1.delta is missing")
    for wanted in ("3", "latest"):
        code, out, err = run(capsys, "--dsn", store.dsn, "restore", "orders", "--epoch", wanted)
        assert (code, out) == (2, "") and "epoch 3 of pipeline 'orders' cannot be restored" in err, err
        assert "state/0/0/1.delta is missing" in err
    code, out, _ = run(capsys, "--dsn", store.dsn, "--json", "restore", "orders", "--epoch", "2")
    assert code == 0 and json.loads(out)["epoch"] == 2


def test_stop_with_pin_pins_the_final_epoch_once_the_run_stopped(
        store: EpochStore, two_pipelines: tuple[Pipeline, Pipeline], capsys: pytest.CaptureFixture[str]) -> None:
    from airflow_arroyo.core.epochs import CheckpointPolicy

    orders, clicks = two_pipelines
    code, _, err = run(capsys, "--dsn", store.dsn, "stop", "orders", "--immediate", "--pin", "x")
    assert code == 2 and "a pin label pins the final epoch of a graceful stop" in err
    code, _, err = run(capsys, "--dsn", store.dsn, "stop", "orders", "--pin", " ")
    assert code == 2 and "pin label must be 1 to 200 characters" in err
    assert store.get_pipeline("orders").stop_requested is None  # refused before asking

    def driver(pipe: Pipeline, final: str, done: threading.Event) -> None:
        """What a driver does on a graceful stop: a final epoch (completed or failed), then stopped."""
        while store.get_pipeline(pipe.id).stop_requested != "graceful":
            if done.wait(0.05):
                return
        tick = store.trigger_tick(pipe.id, CheckpointPolicy(interval=3600), force=True, is_final=True)
        assert tick.started is not None and tick.started.is_final
        if final == "complete":
            for stage in pipe.stages:
                store.ack_epoch(pipe.id, tick.started.epoch, stage)
        else:
            store.fail_epoch(pipe.id, tick.started.epoch, "final snapshot failed")
        store.set_pipeline_state(pipe.id, PipelineState.STOPPED, run_id="run-1")

    for pipe, final in ((orders, "complete"), (clicks, "fail")):
        done = threading.Event()
        thread = threading.Thread(target=driver, args=(pipe, final, done))
        thread.start()
        try:
            code, out, err = run(capsys, "--dsn", store.dsn, "--json", "stop", pipe.id, "--pin", "release 2.0",
                                 "--wait", "1m")
        finally:
            done.set()
            thread.join()
        if final == "complete":
            result = json.loads(out)
            assert code == 0 and (result["state"], result["pinned_epoch"], result["pin_label"]) == (
                "stopped", 4, "release 2.0")
            assert store.get_epoch("orders", 4).pin_label == "release 2.0"
        else:
            assert (code, out) == (1, "")
            assert "pipeline clicks (run run-1) is stopped, but run run-1 of pipeline 'clicks' completed no final " \
                   "epoch" in err
            assert "pin the latest completed epoch instead: airflow-arroyo pin clicks 3" in err
            assert store.get_pipeline("clicks").state is PipelineState.STOPPED
            assert sql(store, "SELECT count(*) FROM arroyo_epochs WHERE pipeline_id = 'clicks'"
                       " AND pin_label IS NOT NULL") == [(0,)]


# --------------------------------------------------------------------------- issue 30, finding 5


def test_a_second_stop_says_the_run_is_already_stopping_or_stopped(store: EpochStore,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """A supervised run whose supervisor still watches it: a second stop names the stop under way or the ended
    run, never "failed (None)", and exits 2 once there is nothing to stop."""
    store.register_pipeline("sup", stages=["a"], run_id="L")
    store.set_pipeline_state("sup", PipelineState.RUNNING, run_id="L")
    store.supervise("sup", "L", {"type": "fixed-delay"})
    code, out, _ = run(capsys, "--dsn", store.dsn, "stop", "sup")
    assert code == 0 and "asked pipeline sup (run L) to stop (graceful)" in out
    code, out, _ = run(capsys, "--dsn", store.dsn, "stop", "sup")
    assert code == 0 and "pipeline sup (run L) was already asked to stop (graceful); it is running" in out
    store.set_pipeline_state("sup", PipelineState.STOPPING, run_id="L")
    code, out, _ = run(capsys, "--dsn", store.dsn, "stop", "sup")
    assert code == 0 and "pipeline sup (run L) was already asked to stop (graceful); it is stopping" in out
    store.set_pipeline_state("sup", PipelineState.STOPPED, run_id="L")
    assert store.get_pipeline("sup").supervision == "watching"
    code, out, err = run(capsys, "--dsn", store.dsn, "stop", "sup")
    assert (code, out) == (2, "")
    assert "pipeline sup is not running: its run L is already stopped; nothing to stop" in err
    assert "failed" not in err and "None" not in err


def test_a_failed_run_without_a_cause_and_a_pipeline_without_a_run_never_read_none(
        store: EpochStore, capsys: pytest.CaptureFixture[str]) -> None:
    store.register_pipeline("sup", stages=["a"], run_id="L")
    store.set_pipeline_state("sup", PipelineState.RUNNING, run_id="L")
    store.supervise("sup", "L", {"type": "fixed-delay"})
    store.set_pipeline_state("sup", PipelineState.FAILED, run_id="L")
    code, out, _ = run(capsys, "--dsn", store.dsn, "stop", "sup")
    assert code == 0 and "run L failed (no cause recorded); its supervisor's restart is cancelled" in out
    store.register_pipeline("orders", stages=["a"], run_id="r1")
    store.set_pipeline_state("orders", PipelineState.RUNNING, run_id="r1")
    started = store.trigger_tick("orders", CheckpointPolicy(interval=60), force=True).started
    assert started is not None and store.ack_epoch("orders", started.epoch, "a") is EpochState.COMPLETED
    store.set_pipeline_state("orders", PipelineState.STOPPED, run_id="r1")
    store.fork_pipeline("orders", started.epoch, "orders-b")  # a fork has no run until its first one registers
    code, out, err = run(capsys, "--dsn", store.dsn, "stop", "orders-b")
    assert code == 2 and "pipeline orders-b is not running: it has not run yet; nothing to stop" in err, err
    assert "None" not in err


def test_checkpoint_of_a_stopped_pipeline_names_the_state_and_the_fix(store: EpochStore,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    store.register_pipeline("orders", stages=["a"], run_id="r1")
    store.set_pipeline_state("orders", PipelineState.STOPPED, run_id="r1")
    code, out, err = run(capsys, "--dsn", store.dsn, "checkpoint", "orders", "--timeout", "5s")
    assert (code, out) == (1, "")
    assert err == ("error: no epoch started for pipeline 'orders': its run r1 is stopped; start its driver "
                   "(SubmitPipelineOperator, or python -m airflow_arroyo.runtime.driver) and checkpoint again\n"), err


def test_pin_refuses_to_replace_a_label_unless_asked(store: EpochStore, two_pipelines: tuple[Pipeline, Pipeline],
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    code, _, _ = run(capsys, "--dsn", store.dsn, "pin", "orders", "1", "--label", "before upgrade")
    assert code == 0
    code, out, _ = run(capsys, "--dsn", store.dsn, "pin", "orders", "1", "--label", "before upgrade")
    assert code == 0  # the same label again: nothing to replace
    code, out, err = run(capsys, "--dsn", store.dsn, "pin", "orders", "1", "--label", "audit")
    assert (code, out) == (2, "")
    assert ("epoch 1 of pipeline 'orders' is already pinned with label 'before upgrade'; pass --replace to "
            "replace that label") in err
    assert store.get_epoch("orders", 1).pin_label == "before upgrade"
    code, out, _ = run(capsys, "--dsn", store.dsn, "pin", "orders", "1", "--label", "audit", "--replace")
    assert code == 0 and out.startswith("pinned epoch 1 of pipeline orders (audit; was: before upgrade);")
    assert store.get_epoch("orders", 1).pin_label == "audit"


def test_restarts_table_keeps_run_ids_whole_and_shortens_the_cause(store: EpochStore,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    from airflow_arroyo.core.supervision import FixedDelay, decide_restart

    lineage = "orders-20261128T124040-9140a7c1"
    strategy = FixedDelay(attempts=3, delay=5)

    def decide(failures: list[PastFailure], now: datetime, stop_requested: bool) -> RestartDecision:
        return decide_restart(strategy, failures, now, lineage=lineage, stop_requested=stop_requested)

    store.register_pipeline("orders", stages=["src"], run_id=lineage)
    store.set_pipeline_state("orders", PipelineState.RUNNING, run_id=lineage)
    store.supervise("orders", lineage, strategy.to_dict())
    cause = (f"the driver of run {lineage} failed: stage 'enrich' failed: KeyError: 'customer_id' while joining "
             f"the orders with the customers table of run {lineage}.restart7")
    store.record_failure("orders", lineage, lineage, cause, decide)
    code, out, _ = run(capsys, "--dsn", store.dsn, "restarts", "orders")
    assert code == 0
    row = out.splitlines()[1]
    assert f" {lineage} " in row  # the FAILED RUN column, whole
    shown = re.split(r"\s{2,}", row)[3]
    assert shown.startswith("the driver of this run failed: stage 'enrich'") and shown.endswith("..."), shown
    # the cut falls between words: no run id is cut inside
    assert all(word in cause.split() or word == "this" for word in shown.removesuffix("...").split()), shown
