"""The driver's decisions (``runtime/decisions.py``), without Spark or a store: ``plan_restore`` over every kind of
request and what the store knows, ``decide_stop`` over the exhaustive product of the discrete situations and over
whole graceful stops played out, ``epoch_to_commit`` / ``sinks_to_commit`` / ``sink_cuts`` over the epochs a run
saw and the sinks' cuts. The Spark tests (``test_pipeline_run.py``) show the driver applying them."""

from __future__ import annotations

import itertools
import subprocess
import sys
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from airflow_arroyo.core.epochs import EpochState
from airflow_arroyo.core.exceptions import ConfigurationError, UnrestorableEpochError
from airflow_arroyo.runtime.decisions import (
    FINAL_EPOCH_ATTEMPTS,
    EpochFacts,
    RestoreAction,
    RestoreFacts,
    SinkCommit,
    StopAction,
    StopFacts,
    StopMode,
    decide_stop,
    epoch_to_commit,
    plan_restore,
    sink_cuts,
    sinks_to_commit,
)

STAGES = ("left", "right", "joined", "files")

# --------------------------------------------------------------------------- plan_restore


def _facts(requested: str | int | None, *, known: bool = True, epoch: EpochFacts | None = None,
           has_state: bool = False) -> RestoreFacts:
    return RestoreFacts("orders", requested, STAGES, pipeline_known=known, epoch=epoch, has_state=has_state,
                        location="/data/orders")


def _epoch(n: int, state: EpochState = EpochState.COMPLETED, stages: tuple[str, ...] = STAGES) -> EpochFacts:
    return EpochFacts(n, state, stages)


@pytest.mark.parametrize(
    ("facts", "action", "epoch"),
    [
        (_facts(None, known=False), RestoreAction.FRESH, None),
        (_facts(None), RestoreAction.FRESH, None),  # registered before, but its storage was deleted
        (_facts("latest", known=False), RestoreAction.START_OVER, None),
        (_facts("latest"), RestoreAction.START_OVER, None),  # no completed epoch
        (_facts("latest", epoch=_epoch(7)), RestoreAction.RESTORE, 7),
        # a stage removed, its state dropped by name (unnamed: refused, below)
        (replace(_facts("latest", epoch=_epoch(7, stages=(*STAGES, "gone"))), allow_dropped_state=("gone",)),
         RestoreAction.RESTORE, 7),
        (_facts("latest", epoch=_epoch(7, stages=("left", "right", "joined"))), RestoreAction.RESTORE, 7),  # a new one
        (_facts(3, epoch=_epoch(3)), RestoreAction.RESTORE, 3),
    ],
)
def test_plan_restore_picks(facts: RestoreFacts, action: RestoreAction, epoch: int | None) -> None:
    plan = plan_restore(facts)
    assert (plan.action, plan.epoch) == (action, epoch)
    assert plan.reason


@pytest.mark.parametrize(
    ("facts", "needle"),
    [
        (_facts(None, has_state=True),
         "has state of an earlier run under /data/orders; start with restore_from='latest'"),
        (_facts(None, known=False, has_state=True), "has state of an earlier run"),
        (_facts(3, known=False), "pipeline 'orders' has no epoch 3 to restore from"),
        (_facts(3), "pipeline 'orders' has no epoch 3; list its epochs with `airflow-arroyo epochs orders`; "
                    "restore from a completed epoch"),
        (_facts(3, epoch=_epoch(3, EpochState.FAILED)), "epoch 3 of pipeline 'orders' is failed, not completed"),
        (_facts(3, epoch=_epoch(3, EpochState.TRIGGERED)), "is triggered, not completed; restore from a completed"),
        (_facts(3, epoch=_epoch(3, EpochState.SUPERSEDED)), "is superseded, not completed"),
        (_facts(3, epoch=_epoch(3, EpochState.PRUNED)), "is pruned, not completed"),
        (_facts(3, epoch=_epoch(3, stages=("left", "right", "joined", "files", "old"))),
         r"epoch 3 of pipeline 'orders' does not restore into this code's graph \(its stages: left, right, joined, "
         r"files, old\): stage 'old' removed: not in the new graph but epoch 3 holds its state; drop it with "
         r"allow_dropped_state=\['old'\]"),
        (_facts("latest", epoch=_epoch(7, stages=("left", "renamed_join"))),
         r"epoch 7 .*stage 'renamed_join' removed: .*renamed=\{'renamed_join': 'NEW'\}"),
        (_facts("newest"), "restore_from must be 'latest', an epoch number or None, got 'newest'"),
        (_facts(True), "restore_from must be"),
    ],
)
def test_plan_restore_refuses_naming_the_problem_and_the_fix(facts: RestoreFacts, needle: str) -> None:
    with pytest.raises(ConfigurationError, match=needle):
        plan_restore(facts)


@pytest.mark.parametrize("requested", ["latest", 7])
def test_plan_restore_refuses_an_epoch_a_restore_proved_unrestorable(requested: str | int) -> None:
    facts = _facts(requested, epoch=replace(_epoch(7), unrestorable="no committed batch"))
    with pytest.raises(UnrestorableEpochError, match=r"epoch 7 of pipeline 'orders' cannot be restored .*no "
                                                     r"committed batch.*restore_from=<n>") as info:
        plan_restore(facts)
    assert info.value.epoch == 7


restore_facts = st.builds(
    RestoreFacts,
    pipeline_id=st.just("p"),
    requested=st.none() | st.just("latest") | st.integers(1, 9),
    stages=st.just(STAGES),
    pipeline_known=st.booleans(),
    epoch=st.none() | st.builds(EpochFacts, epoch=st.integers(1, 9), state=st.sampled_from(list(EpochState)),
                                stages=st.sampled_from([STAGES, STAGES[:2], (*STAGES, "x")])),
    has_state=st.booleans(),
    location=st.just("/data/p"),
)


@settings(max_examples=100, deadline=None)
@given(restore_facts)
def test_plan_restore_restores_only_a_known_completed_epoch_whose_state_the_graph_keeps(f: RestoreFacts) -> None:
    try:
        plan = plan_restore(f)
    except ConfigurationError as exc:
        assert "'p'" in str(exc)  # names the pipeline
        refused = True
    else:
        refused = False
    # every stage the epoch holds state of is in the graph (none dropped unasked); the graph's others start empty
    complete = f.epoch is not None and set(f.epoch.stages) <= set(STAGES)
    if f.requested is None:
        assert refused == f.has_state  # a fresh start never guesses over state that is there
        if not refused:
            assert (plan.action, plan.epoch) == (RestoreAction.FRESH, None)
    elif f.requested == "latest" and (f.epoch is None or not f.pipeline_known):
        assert not refused and (plan.action, plan.epoch) == (RestoreAction.START_OVER, None)
    elif f.requested == "latest":
        assert refused != complete
    else:
        assert refused != (f.pipeline_known and complete and f.epoch is not None
                           and f.epoch.state is EpochState.COMPLETED)
    if not refused and plan.action is RestoreAction.RESTORE:
        assert f.epoch is not None and plan.epoch == f.epoch.epoch and f.pipeline_known and complete
        assert f.requested == "latest" or f.epoch.state is EpochState.COMPLETED


# --------------------------------------------------------------------------- decide_stop

FINAL = 9
DEADLINE = 100.0
TIMES = {"before": DEADLINE - 1, "at": DEADLINE, "after": DEADLINE + 0.001}


def test_every_discrete_stop_situation() -> None:
    """The product of stop mode x marked stopping x final epoch in flight x its state x attempts x the clock
    against its deadline (one test: ~1,400 cases would cost more in pytest's bookkeeping than in deciding)."""
    situations = itertools.product([None, *StopMode], [False, True], [False, True], [None, *EpochState],
                                   range(FINAL_EPOCH_ATTEMPTS + 2), TIMES)
    for mode, stopping, in_flight, state, attempts, time in situations:
        _check_stop_situation(mode, stopping, in_flight, state, attempts, time)


def _check_stop_situation(mode: StopMode | None, stopping: bool, in_flight: bool, state: EpochState | None,
                          attempts: int, time: str) -> None:
    f = StopFacts(mode=mode, stopping=stopping, final_epoch=FINAL if in_flight else None,
                  final_state=state if in_flight else None, final_attempts=attempts, final_deadline=DEADLINE,
                  now=TIMES[time])
    d = decide_stop(f)
    if mode is None:
        expected = StopAction.RUN
    elif mode is StopMode.IMMEDIATE:
        expected = StopAction.STOP
    elif not in_flight:
        expected = StopAction.START_FINAL
    elif state is EpochState.COMPLETED:
        expected = StopAction.FINISH  # even after its deadline: it completed
    elif state is EpochState.TRIGGERED and time != "after":
        expected = StopAction.WAIT_FINAL
    elif attempts >= FINAL_EPOCH_ATTEMPTS:
        expected = StopAction.GIVE_UP
    else:
        expected = StopAction.RETRY_FINAL
    assert d.action is expected, (d, f)
    assert d.reason
    assert d.mark_stopping == (mode is StopMode.GRACEFUL and not stopping)
    assert d.fail_epoch == (expected is StopAction.RETRY_FINAL and state is EpochState.TRIGGERED)
    if expected is StopAction.STOP:
        assert d.epoch == f.final_epoch  # the final epoch in flight, if any, is reported
    if expected in (StopAction.FINISH, StopAction.WAIT_FINAL, StopAction.RETRY_FINAL, StopAction.GIVE_UP):
        assert d.epoch == FINAL
    assert (d.cause is not None) == (expected is StopAction.GIVE_UP)
    if expected is StopAction.GIVE_UP:
        assert d.cause == f"final epoch {FINAL} {state}"


# A final epoch's fate, as the store reports it turn after turn: the states it passes through.
FATES = {
    "completes": [EpochState.TRIGGERED, EpochState.COMPLETED],
    "completes_at_once": [EpochState.COMPLETED],
    "fails": [EpochState.TRIGGERED, EpochState.FAILED],
    "expires": [EpochState.TRIGGERED, EpochState.EXPIRED],
    "times_out": [EpochState.TRIGGERED] * 5,  # still in flight at its deadline (after 3 turns)
    "not_started": [],  # the tick started no epoch (one was in flight, the cleanup lock was held)
}


@settings(max_examples=100, deadline=None)
@given(st.lists(st.sampled_from(list(FATES)), min_size=1, max_size=8), st.integers(0, 3))
def test_a_graceful_stop_played_out(fates: list[str], running_turns: int) -> None:
    """The driver's loop with the store played by a script: each START_FINAL starts the next scripted final epoch
    (or none), whose state then follows its fate; three turns after a start its deadline passes."""
    mode: StopMode | None = None
    stopping, final, attempts, deadline, now = False, None, 0, 0.0, 0.0
    marked, started, failed = 0, [], []
    states: list[EpochState] = []
    script = iter(fates)
    for turn in range(200):
        if turn == running_turns:
            mode = StopMode.GRACEFUL
        state = None
        if final is not None:  # the store's answer this turn; the last state of a fate sticks
            state = states[0] if len(states) == 1 else states.pop(0)
        d = decide_stop(StopFacts(mode=mode, stopping=stopping, final_epoch=final, final_state=state,
                                  final_attempts=attempts, final_deadline=deadline, now=now))
        if mode is None:
            assert d.action is StopAction.RUN
        if d.mark_stopping:
            assert not stopping and not started  # marked once, before the first final epoch
            stopping, marked = True, marked + 1
        if d.action is StopAction.START_FINAL:
            assert final is None
            fate = next(script, "fails")  # past the script: the store starts one, which fails
            if FATES[fate]:
                attempts += 1
                final = 100 + len(started)
                started.append((final, fate))
                states, deadline = list(FATES[fate]), now + 2.5
        elif d.action is StopAction.RETRY_FINAL:
            assert final is not None and d.epoch == final
            if d.fail_epoch:
                failed.append(final)
            final = None
        elif d.action in (StopAction.FINISH, StopAction.GIVE_UP):
            break
        now += 1.0
    else:
        pytest.fail("the stop never ended")
    assert marked == 1
    assert 1 <= len(started) <= FINAL_EPOCH_ATTEMPTS  # never more final epochs than allowed
    outcomes = [fate for _, fate in started]
    if d.action is StopAction.FINISH:
        assert outcomes[-1] in ("completes", "completes_at_once") and d.epoch == started[-1][0]
        assert all(o not in ("completes", "completes_at_once") for o in outcomes[:-1])
    else:
        assert len(started) == FINAL_EPOCH_ATTEMPTS
        assert all(o not in ("completes", "completes_at_once") for o in outcomes)
        assert d.cause is not None and d.cause.startswith(f"final epoch {started[-1][0]} ")
    # exactly the final epochs still in flight at their deadline were failed (before the next one started);
    # the last one given up is left to the trigger's timeout, as before decide_stop existed
    assert failed == [e for e, fate in started[:-1] if fate == "times_out"]


def test_an_immediate_stop_overrides_a_graceful_one_in_progress() -> None:
    waiting = StopFacts(mode=StopMode.GRACEFUL, stopping=True, final_epoch=FINAL, final_state=EpochState.TRIGGERED,
                        final_attempts=1, final_deadline=DEADLINE, now=0.0)
    assert decide_stop(waiting).action is StopAction.WAIT_FINAL
    now = decide_stop(replace(waiting, mode=StopMode.IMMEDIATE))
    assert (now.action, now.epoch, now.mark_stopping) == (StopAction.STOP, FINAL, False)


# --------------------------------------------------------------------------- sink commits

seen_epochs = st.lists(st.integers(1, 30), unique=True, max_size=12).map(sorted)


@settings(max_examples=100, deadline=None)
@given(seen_epochs, st.integers(0, 30), st.data())
def test_the_epoch_to_commit_is_the_newest_completed_one_this_run_saw(seen: list[int], committed: int,
                                                                      data: st.DataObject) -> None:
    states = {e: data.draw(st.sampled_from(list(EpochState))) for e in seen if e > committed}
    unseen = {e: EpochState.COMPLETED for e in range(committed + 1, 32) if e not in seen}  # earlier runs' epochs
    got = epoch_to_commit(committed, seen, {**unseen, **states})
    completed = [e for e, s in states.items() if s is EpochState.COMPLETED]
    assert got == (max(completed) if completed else None)
    if got is not None:
        assert got in seen and got > committed  # never an epoch of another run, never one already committed


def test_an_epoch_whose_state_was_not_read_is_not_committed() -> None:
    assert epoch_to_commit(3, [2, 3, 4, 5], {4: EpochState.COMPLETED}) == 4
    assert epoch_to_commit(3, [4, 5], {}) is None
    assert epoch_to_commit(5, [4, 5], {4: EpochState.COMPLETED, 5: EpochState.COMPLETED}) is None


def test_sinks_commit_in_their_order_then_trim_through_the_oldest_completed_epoch() -> None:
    cuts = {"totals_pg": 41, "files": 40, "rows_pg": 39}
    plan = sinks_to_commit(12, cuts, 8, {"rows_pg": 20, "files": 21, "totals_pg": 22})
    assert plan.epoch == 12
    assert plan.commits == (SinkCommit("totals_pg", 41), SinkCommit("files", 40), SinkCommit("rows_pg", 39))
    assert plan.trims == (SinkCommit("totals_pg", 22), SinkCommit("files", 21), SinkCommit("rows_pg", 20))
    same = sinks_to_commit(12, cuts, 12)  # the only completed epoch: trim through its own cuts
    assert same.trims == same.commits
    assert sinks_to_commit(12, cuts).trims == ()  # no completed epoch known (e.g. all pruned meanwhile)
    nothing = sinks_to_commit(12, {}, 8, {})  # no exactly-once sink
    assert (nothing.commits, nothing.trims) == ((), ())
    with pytest.raises(ValueError, match="rows_pg"):
        sinks_to_commit(12, cuts, 8, {"files": 21, "totals_pg": 22})


@pytest.mark.parametrize(
    ("details", "needle"),
    [
        ({"joined": {"batch_id": 3}}, "has no cut batch of sink 'files'"),
        ({"files": None}, "has no cut batch of sink 'files'"),
        ({"files": {"files": 2}}, "has no cut batch of sink 'files'"),
    ],
)
def test_a_sink_without_its_cut_batch_is_refused(details: dict[str, dict[str, int] | None], needle: str) -> None:
    with pytest.raises(ConfigurationError, match=f"epoch 4 of pipeline 'p' {needle}; .* choose another epoch"):
        sink_cuts("p", 4, ["files"], details)


def test_sink_cuts_read_every_sink_from_its_ack() -> None:
    details = {"files": {"batch_id": 7, "files": 2}, "pg": {"batch_id": "9"}, "joined": {"batch_id": 1}}
    assert sink_cuts("p", 4, ["pg", "files"], details) == {"pg": 9, "files": 7}
    assert list(sink_cuts("p", 4, ["pg", "files"], details)) == ["pg", "files"]  # the sinks' order
    assert sink_cuts("p", 4, [], details) == {}


def test_the_decisions_import_neither_spark_nor_the_store_nor_airflow() -> None:
    """Pure: importing the module loads no Spark, no store (no database driver) and no Airflow."""
    code = ("import sys, airflow_arroyo.runtime.decisions; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('pyspark', 'py4j', 'psycopg2', 'airflow') "
            "or m.startswith(('airflow_arroyo.store', 'airflow_arroyo.runtime.driver'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize(("point", "error", "needle"), [
    (replace(_epoch(3), state=EpochState.PRUNED), ConfigurationError,
     "the fork point of 'orders', epoch 3 of 'src', is pruned: the fork cannot start; fork src again"),
    (replace(_epoch(3), unrestorable="state/0/0/1.delta is missing"), UnrestorableEpochError,
     "the fork point of 'orders', epoch 3 of 'src', cannot be restored"),
])
def test_a_forks_bad_fork_point_advises_another_fork(point: EpochFacts, error: type[Exception], needle: str) -> None:
    """'latest' would pick the same fork point again, and another epoch number is refused for a fork's first run:
    the only way on is a new fork."""
    facts = replace(_facts("latest", epoch=point), requested=3, fork_of="src")
    with pytest.raises(error, match=needle) as raised:
        plan_restore(facts)
    assert "restore_from='latest' picks" not in str(raised.value) and "restore_from=<n>" not in str(raised.value)


def test_a_restore_into_new_code_plans_each_stage() -> None:
    """An epoch of an older graph restores: stages it has no snapshot of start empty, a dropped stage's state goes
    only when named, and a renamed stage takes the old one's snapshot (plan_upgrade decides, plan_restore applies)."""
    older = _epoch(5, stages=("left", "right", "joined_v1", "legacy"))
    facts = replace(_facts(5, epoch=older), allow_dropped_state=("legacy",), renamed=(("joined_v1", "joined"),))
    plan = plan_restore(facts)
    assert (plan.action, plan.epoch) == (RestoreAction.RESTORE, 5)
    assert plan.upgrade is not None
    assert {s.stage: s.action.value for s in plan.upgrade.stages} == {
        "left": "restored", "right": "restored", "joined": "restored", "files": "new", "legacy": "removed"}
    assert plan.upgrade.snapshot_of() == {"left": "left", "right": "right", "joined": "joined_v1"}
    with pytest.raises(ConfigurationError, match=r"stage 'legacy' removed: .*allow_dropped_state=\['legacy'\]"):
        plan_restore(replace(facts, allow_dropped_state=()))


def test_a_uid_carries_a_stages_state_across_a_rename_without_a_mapping() -> None:
    """The epoch's stage 'agg' was registered with uid 'totals'; the new code calls the stage 'agg_v2' with the same
    uid: it takes 'agg''s snapshot (by name: snapshots are kept by the name they were taken under)."""
    older = _epoch(5, stages=("left", "right", "joined", "agg"))
    facts = replace(_facts(5, epoch=older), epoch_identities=(("agg", "totals"),),
                    identities=(("files", "totals"),))
    plan = plan_restore(facts)
    assert plan.upgrade is not None and plan.upgrade.restores
    assert plan.upgrade.snapshot_of() == {"left": "left", "right": "right", "joined": "joined", "files": "agg"}
    # the same code without the uid: 'totals' (the epoch's 'agg') would be dropped: refused
    with pytest.raises(ConfigurationError, match=r"stage 'totals' removed: .*allow_dropped_state=\['totals'\]"):
        plan_restore(replace(facts, identities=()))


def test_two_stages_cannot_share_an_identity() -> None:
    from airflow_arroyo.core.exceptions import PipelineGraphError
    from airflow_arroyo.runtime.pipeline import Pipeline

    p = Pipeline("ids")
    src = p.source("src", lambda spark: spark.readStream.format("rate").load(), uid="input")
    p.stage("input", lambda df: df, [src])
    with pytest.raises(PipelineGraphError, match="stages 'src' and 'input' .* same identity 'input'"):
        p.validate()
    q = Pipeline("ids2")
    with pytest.raises(PipelineGraphError, match="uid '-x' must be"):
        q.source("src", lambda spark: spark.readStream.format("rate").load(), uid="-x")
        q.validate()
