"""Life cycles in one place: every state write of the store is the guarded UPDATE that
``store._transitions.transition`` builds from the transition tables.

* The guard is the table: walking every (state, target) pair of both tables against a real database,
  a write is applied exactly when the table allows it and refused (no row moves) otherwise.
* Nothing else writes a state: no other statement in the package sets an epoch's or a pipeline's
  state or builds a guard of its own, and no production code checks a transition apart from the write.

(The store's public operations are walked over every epoch state in ``test_store.py``.)
"""

from __future__ import annotations

import ast
import functools
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import psycopg2
import psycopg2.extras
import pytest

import airflow_arroyo
from airflow_arroyo.core.epochs import EPOCH_TRANSITIONS, PIPELINE_TRANSITIONS, EpochState, PipelineState
from airflow_arroyo.store._transitions import transition

PACKAGE = Path(airflow_arroyo.__file__).resolve().parent
HELPER = PACKAGE / "store" / "_transitions.py"


@pytest.fixture(scope="module")
def cur(migrated_db: Callable[[str], str]) -> Iterator[psycopg2.extras.RealDictCursor]:
    """One connection; every case runs in a transaction of its own that is rolled back."""
    conn = psycopg2.connect(migrated_db("writes"))
    try:
        with conn.cursor(cursor_factory=psycopg2.extras.RealDictCursor) as c:
            yield c
    finally:
        conn.close()


@pytest.mark.parametrize("source", list(PipelineState))
def test_a_pipeline_state_write_is_applied_exactly_when_the_table_allows_it(
        cur: psycopg2.extras.RealDictCursor, source: PipelineState) -> None:
    try:
        for target in PipelineState:
            cur.execute("SAVEPOINT t")
            cur.execute("INSERT INTO arroyo_pipelines (pipeline_id, state) VALUES ('p', %s)", (source.value,))
            moved = transition(cur, target, where="p.pipeline_id = %(p)s", params={"p": "p"},
                               returning="p.state")
            cur.execute("SELECT state FROM arroyo_pipelines WHERE pipeline_id = 'p'")
            now = cur.fetchone()["state"]
            allowed = target in PIPELINE_TRANSITIONS[source]
            assert (moved == [{"state": target.value}]) is allowed, (source, target, moved)
            assert now == (target if allowed else source).value
            cur.execute("ROLLBACK TO SAVEPOINT t")
    finally:
        cur.connection.rollback()


@pytest.mark.parametrize("source", list(EpochState))
def test_an_epoch_state_write_is_applied_exactly_when_the_table_allows_it(
        cur: psycopg2.extras.RealDictCursor, source: EpochState) -> None:
    try:
        for target in EpochState:
            cur.execute("SAVEPOINT t")
            cur.execute("INSERT INTO arroyo_pipelines (pipeline_id, state) VALUES ('p', 'running')")
            cur.execute("INSERT INTO arroyo_epochs (pipeline_id, epoch, state, stages, timeout_at, ended_at)"
                        " VALUES ('p', 1, %(s)s, '{a}', now() + interval '1 hour',"
                        "  CASE WHEN %(s)s = 'triggered' THEN NULL ELSE now() END)", {"s": source.value})
            moved = transition(cur, target, where="e.pipeline_id = %(p)s AND e.epoch = 1", params={"p": "p"},
                               also="ended_at = COALESCE(e.ended_at, clock_timestamp())", returning="e.state")
            cur.execute("SELECT state FROM arroyo_epochs WHERE pipeline_id = 'p' AND epoch = 1")
            now = cur.fetchone()["state"]
            allowed = target in EPOCH_TRANSITIONS[source]
            assert (moved == [{"state": target.value}]) is allowed, (source, target, moved)
            assert now == (target if allowed else source).value
            cur.execute("ROLLBACK TO SAVEPOINT t")
    finally:
        cur.connection.rollback()


def test_one_statement_moves_only_the_rows_whose_state_allows_it(cur: psycopg2.extras.RealDictCursor) -> None:
    """A write over many rows (begin_prune's, the tick's expiries) is guarded row by row."""
    try:
        cur.execute("INSERT INTO arroyo_pipelines (pipeline_id, state) VALUES ('p', 'running')")
        for n, state in enumerate(EpochState, start=1):
            cur.execute("INSERT INTO arroyo_epochs (pipeline_id, epoch, state, stages, timeout_at, ended_at)"
                        " VALUES ('p', %(n)s, %(s)s, '{a}', now() + interval '1 hour',"
                        "  CASE WHEN %(s)s = 'triggered' THEN NULL ELSE now() END)", {"n": n, "s": state.value})
        moved = transition(cur, EpochState.PRUNING, where="e.pipeline_id = %(p)s", params={"p": "p"},
                           returning="e.epoch")
        expected = sorted(n for n, s in enumerate(EpochState, start=1) if EpochState.PRUNING in EPOCH_TRANSITIONS[s])
        assert sorted(r["epoch"] for r in moved) == expected and len(expected) >= 2
    finally:
        cur.connection.rollback()


def test_the_helper_refuses_what_it_cannot_guard(cur: psycopg2.extras.RealDictCursor) -> None:
    with pytest.raises(TypeError, match="EpochState or a PipelineState"):
        transition(cur, "completed", where="true", params={})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="reserved for the guard"):
        transition(cur, EpochState.FAILED, where="true", params={"_from": ["completed"]})


# ----------------------------------------------------------------------------- nothing else writes a state


@functools.cache
def _nodes(path: Path) -> list[ast.AST]:
    return list(ast.walk(ast.parse(path.read_text(encoding="utf-8"))))


def _strings(path: Path) -> Iterator[tuple[int, str]]:
    """Every string literal of a module (implicit concatenations joined; an f-string's constant parts)."""
    for node in _nodes(path):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            yield node.lineno, node.value
        elif isinstance(node, ast.JoinedStr):
            yield node.lineno, "".join(v.value for v in node.values
                                       if isinstance(v, ast.Constant) and isinstance(v.value, str))


def _calls(path: Path) -> Iterator[tuple[int, str]]:
    for node in _nodes(path):
        if isinstance(node, ast.Call):
            fn = node.func
            name = fn.attr if isinstance(fn, ast.Attribute) else fn.id if isinstance(fn, ast.Name) else ""
            yield node.lineno, name


MODULES = sorted(p for p in PACKAGE.rglob("*.py") if p != HELPER)
TABLES = re.compile(r"arroyo_(epochs|pipelines)\b", re.IGNORECASE)
STATE_WRITE = re.compile(r"UPDATE\s+arroyo_(epochs|pipelines)\b.*\bstate\s*=", re.IGNORECASE | re.DOTALL)


def test_no_other_statement_writes_an_epoch_or_pipeline_state() -> None:
    found = [f"{p.relative_to(PACKAGE)}:{line}: {text.strip()[:90]}"
             for p in MODULES if TABLES.search(p.read_text(encoding="utf-8"))
             for line, text in _strings(p) if STATE_WRITE.search(text)]
    assert not found, "state writes outside store/_transitions.py:\n" + "\n".join(found)


def test_the_scan_would_find_a_state_write() -> None:
    """The check above is not vacuous: it finds the usual spellings of a state write, and only those."""
    for text in ("UPDATE arroyo_epochs SET state = 'failed' WHERE x", "update arroyo_pipelines p set\n state=%s",
                 "UPDATE arroyo_epochs e SET ended_at = now(), state = 'expired' FROM y"):
        assert STATE_WRITE.search(text), text
    for text in ("UPDATE arroyo_pipelines SET stop_requested = %s", "UPDATE arroyo_cleanup_runs SET state = 'x'",
                 "SELECT state FROM arroyo_epochs WHERE state = 'completed'"):
        assert not STATE_WRITE.search(text), text


def test_guards_and_transition_checks_live_only_in_the_helper() -> None:
    """No module but the helper builds a guard from the table (``*_states_from``), and no production code
    checks a transition apart from the write (``check_*_transition``): the guarded write is the check."""
    names = {"epoch_states_from", "pipeline_states_from", "check_epoch_transition", "check_pipeline_transition"}
    found = [f"{p.relative_to(PACKAGE)}:{line}: {name}" for p in MODULES
             if any(n in p.read_text(encoding="utf-8") for n in names) for line, name in _calls(p) if name in names]
    assert not found, "\n".join(found)
    assert {name for _, name in _calls(HELPER)} >= {"epoch_states_from", "pipeline_states_from"}



# ----------------------------------------------------------------------------- the outcome (migration 0007)

# what an epoch's outcome is, by definition: the last state it was in that ends an epoch (not in flight,
# not retention's own pruning/pruned)
NOT_AN_OUTCOME = {EpochState.TRIGGERED, EpochState.PRUNING, EpochState.PRUNED}


def _paths(state: EpochState = EpochState.TRIGGERED) -> Iterator[list[EpochState]]:
    """Every life of an epoch the table allows, from its start to its last state (the table has no cycle)."""
    yield [state]
    for nxt in sorted(EPOCH_TRANSITIONS[state]):
        for rest in _paths(nxt):
            yield [state, *rest]


def test_the_database_records_the_outcome_along_every_life_of_an_epoch(cur: psycopg2.extras.RealDictCursor) -> None:
    paths = [p for p in _paths() if len(p) > 1]
    assert {s for p in paths for s in p} == set(EpochState)  # every state is reached by some path
    try:
        for path in paths:
            cur.execute("SAVEPOINT t")
            cur.execute("INSERT INTO arroyo_pipelines (pipeline_id, state) VALUES ('p', 'running')")
            cur.execute("INSERT INTO arroyo_epochs (pipeline_id, epoch, state, stages, timeout_at)"
                        " VALUES ('p', 1, 'triggered', '{a}', now() + interval '1 hour') RETURNING outcome")
            assert cur.fetchone()["outcome"] is None
            expected: str | None = None
            for target in path[1:]:
                (row,) = transition(cur, target, where="e.epoch = 1", params={},
                                    also="ended_at = COALESCE(e.ended_at, clock_timestamp())",
                                    returning="e.outcome")
                expected = expected if target in NOT_AN_OUTCOME else target.value
                assert row["outcome"] == expected, path
                # the outcome cannot be written on its own
                cur.execute("UPDATE arroyo_epochs SET outcome = 'failed' WHERE epoch = 1 RETURNING outcome")
                assert cur.fetchone()["outcome"] == expected, path
            cur.execute("ROLLBACK TO SAVEPOINT t")
    finally:
        cur.connection.rollback()


def test_migration_0007_records_the_outcome_of_epochs_that_ended_before_it(
        pg_dsn: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Epochs already pruned get the outcome the database's history recorded for them, not one read from
    their failure reason (epoch 3 failed with a reason that reads like an expiry)."""
    from airflow_arroyo.store import EpochStore, _migrate

    shipped = _migrate.available_migrations()
    monkeypatch.setattr(_migrate, "available_migrations", lambda: [m for m in shipped if m[0] < 7])
    store = EpochStore(pg_dsn)
    try:
        assert store.migrate() == [1, 2, 3, 4, 5, 6]
        lives = {1: ["completed", "pruning", "pruned"], 2: ["expired", "pruning", "pruned"],
                 3: ["failed", "pruning", "pruned"], 4: ["completed", "superseded", "pruning"],
                 5: ["completed"], 6: ["failed"], 7: []}
        conn = psycopg2.connect(pg_dsn)
        try:
            with conn, conn.cursor() as c:
                c.execute("INSERT INTO arroyo_pipelines (pipeline_id, state) VALUES ('old', 'running')")
                for n, life in lives.items():
                    c.execute("INSERT INTO arroyo_epochs (pipeline_id, epoch, state, stages, timeout_at)"
                              " VALUES ('old', %s, 'triggered', '{a}', now() + interval '1 hour')", (n,))
                    for state in life:
                        c.execute("UPDATE arroyo_epochs SET state = %s, ended_at = COALESCE(ended_at, now()),"
                                  " failure_reason = CASE WHEN %s IN ('failed', 'expired')"
                                  "   THEN 'not acknowledged by stage a' ELSE failure_reason END"
                                  " WHERE pipeline_id = 'old' AND epoch = %s", (state, state, n))
        finally:
            conn.close()
        monkeypatch.setattr(_migrate, "available_migrations", lambda: shipped)
        assert store.migrate() == [v for v, _, _ in shipped if v >= 7]
        outcomes = {e.epoch: e.outcome for e in store.list_epochs("old")}
        assert outcomes == {1: EpochState.COMPLETED, 2: EpochState.EXPIRED, 3: EpochState.FAILED,
                            4: EpochState.SUPERSEDED, 5: EpochState.COMPLETED, 6: EpochState.FAILED, 7: None}
    finally:
        store.close()
