"""``airflow-arroyo gate``: listing commit gates, showing one's pending output and recording verdicts, against a
real PostgreSQL store with gates opened as the driver opens them."""

from __future__ import annotations

import getpass
import json

import pytest

from airflow_arroyo.core.gates import GatePolicy, GateState
from airflow_arroyo.store import EpochStore
from tests.controlplane.test_cli import lines, run
from tests.gates.test_gates_store import _open, _pipeline

PG_DETAILS = {"kind": "postgres", "schema": "public", "pending_table": "orders__pending", "batch_column": "_batch",
              "columns": ["id", "amount"]}


@pytest.fixture
def gated(store: EpochStore) -> list[int]:
    """Pipeline 'shop': three completed epochs, a gate on sink 'out' for each, and a gate of sink 'pg' for the
    second; the first gate passed and committed."""
    epochs = _pipeline(store, "shop", 3)
    for i, e in enumerate(epochs):
        _open(store, "shop", e, batches=(2 * i, 2 * i + 1))
    store.open_gate("shop", "pg", epochs[1], run_id="r1", uri="postgresql://db/orders", policy=GatePolicy.HOLD,
                    batch_from=4, batch_to=7, details=PG_DETAILS, timeout=None)
    store.decide_gate("shop", "out", epochs[0], GateState.PASSED, by="check_rows")
    store.close_gate("shop", "out", epochs[0], GateState.COMMITTED)
    return epochs


def test_list_shows_the_gates_that_wait_and_all_with_all(store: EpochStore, gated: list[int],
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    e1, e2, e3 = gated
    code, out, err = run(capsys, "--dsn", store.dsn, "gate", "list", "shop")
    assert (code, err) == (0, "")
    rows = lines(out)
    assert rows[0] == ["EPOCH", "SINK", "STATE", "BATCHES", "OPENED", "DEADLINE", "DECIDED", "BY", "REASON"]
    assert [r[:4] for r in rows[1:]] == [[str(e2), "out", "pending", "2..3"], [str(e2), "pg", "pending", "4..7"],
                                         [str(e3), "out", "pending", "4..5"]]
    code, out, _ = run(capsys, "--dsn", store.dsn, "gate", "list", "shop", "--sink", "out", "--all", "--json")
    listed = json.loads(out)
    assert code == 0
    assert [(g["epoch"], g["state"], g["decided_by"]) for g in listed] == [
        (e1, "committed", "check_rows"), (e2, "pending", None), (e3, "pending", None)]
    code, out, _ = run(capsys, "--dsn", store.dsn, "gate", "list", "shop", "--sink", "nope")
    assert (code, out) == (0, "pipeline shop has no gates waiting (--all lists the closed ones too) of sink nope\n")


def test_show_gives_the_pending_files_or_the_select_of_the_pending_rows(
        store: EpochStore, gated: list[int], capsys: pytest.CaptureFixture[str]) -> None:
    e1, e2, _ = gated
    code, out, _ = run(capsys, "--dsn", store.dsn, "gate", "show", "shop", "--sink", "out", "--epoch", str(e2))
    assert code == 0
    assert "pending output: 1 json files, 3 rows\n  file:///tmp/x/part-0.json\n" in out
    assert f"airflow-arroyo gate pass|fail shop --sink out --epoch {e2}" in out
    code, out, _ = run(capsys, "--dsn", store.dsn, "--json", "gate", "show", "shop", "--sink", "pg", "--epoch", str(e2))
    shown = json.loads(out)
    assert code == 0 and shown["gate"]["state"] == "pending"
    assert shown["pending"]["select_sql"] == ('SELECT "id", "amount" FROM "public"."orders__pending" '
                                              'WHERE "_batch" BETWEEN %s AND %s')
    assert shown["pending"]["select_params"] == [4, 7]
    code, out, _ = run(capsys, "--dsn", store.dsn, "gate", "show", "shop", "--sink", "out", "--epoch", str(e1))
    assert code == 0 and "its output no longer waits: the gate is committed" in out


def test_pass_and_fail_record_who_and_why(store: EpochStore, gated: list[int],
                                          capsys: pytest.CaptureFixture[str]) -> None:
    _, e2, e3 = gated
    code, out, err = run(capsys, "--dsn", store.dsn, "gate", "fail", "shop", "--sink", "out", "--epoch", str(e2),
                         "--reason", "-3 rows: negative amounts")  # a reason starting with '-' is a value
    assert (code, err) == (0, "")
    assert out == (f"the gate of sink out for epoch {e2} of pipeline shop is failed by {getpass.getuser()} "
                   "(-3 rows: negative amounts); the pipeline's driver acts on it (was pending)\n")
    gate = store.get_gate("shop", "out", e2)
    assert (gate.state, gate.decided_by, gate.reason) == (GateState.FAILED, getpass.getuser(),
                                                          "-3 rows: negative amounts")
    # a person's approval after a look
    code, out, _ = run(capsys, "--dsn", store.dsn, "--json", "gate", "pass", "shop", "--sink", "out", "--epoch",
                       str(e2), "--by", "ana", "--reason", "refunds, expected")
    recorded = json.loads(out)
    assert code == 0 and (recorded["state"], recorded["decided_by"], recorded["changed"]) == ("passed", "ana", True)
    code, out, _ = run(capsys, "--dsn", store.dsn, "gate", "pass", "shop", "--sink", "out", "--epoch", str(e2),
                       "--by", "bo")
    assert (code, out) == (0, f"the gate of sink out for epoch {e2} of pipeline shop is already passed by ana; "
                              "nothing changed\n")
    assert store.get_gate("shop", "out", e3).state is GateState.PENDING  # only the gate named


def test_bad_input_names_the_problem_and_the_fix(store: EpochStore, gated: list[int],
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    e1, e2, _ = gated
    code, out, err = run(capsys, "--dsn", store.dsn, "gate", "list", "nobody")
    assert (code, out) == (2, "") and "nobody" in err
    code, out, err = run(capsys, "--dsn", store.dsn, "gate", "pass", "shop", "--sink", "out", "--epoch", "99")
    assert (code, out) == (2, "")
    assert err == ("error: pipeline 'shop' has no gate of sink 'out' for epoch 99; airflow-arroyo gate list shop "
                   "shows its gates\n")
    code, out, err = run(capsys, "--dsn", store.dsn, "gate", "fail", "shop", "--sink", "out", "--epoch", str(e1))
    assert (code, out) == (2, "")
    assert f"the gate of sink 'out' for epoch {e1} of pipeline 'shop' is committed by check_rows: it cannot " \
           "become failed (nothing was changed)" in err
    assert store.get_gate("shop", "out", e1).state is GateState.COMMITTED
    code, _, err = run(capsys, "--dsn", store.dsn, "gate", "pass", "shop", "--sink", "out", "--epoch", str(e2),
                       "--by", " ")
    assert code == 2 and "who gave it" in err
    assert store.get_gate("shop", "out", e2).state is GateState.PENDING
    code, _, err = run(capsys, "--dsn", store.dsn, "gate", "pass", "shop", "--epoch", str(e2))
    assert code == 2 and "--sink" in err
    code, _, err = run(capsys, "--dsn", store.dsn, "gate", "approve", "shop")
    assert code == 2 and "invalid choice: 'approve'" in err


def test_without_an_os_user_name_by_is_asked_for(store: EpochStore, gated: list[int], monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    def no_user() -> str:
        raise OSError("No username set in the environment")

    monkeypatch.setattr(getpass, "getuser", no_user)
    code, _, err = run(capsys, "--dsn", store.dsn, "gate", "pass", "shop", "--sink", "out", "--epoch", str(gated[1]))
    assert (code, err) == (2, "error: cannot tell who gives this verdict (no OS user name): pass --by NAME\n")
    assert store.get_gate("shop", "out", gated[1]).state is GateState.PENDING
