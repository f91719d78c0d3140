"""Restart strategies (pure) and the store's record of a supervised lineage's failures and restarts."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from airflow_arroyo.core.epochs import CheckpointPolicy, PipelineState
from airflow_arroyo.core.exceptions import ConcurrencyConflict, ConfigurationError
from airflow_arroyo.core.supervision import (
    ExponentialDelay,
    FailureRate,
    FixedDelay,
    NoRestart,
    PastFailure,
    RestartDecision,
    decide_restart,
    in_lineage,
    is_run_of,
    lineage_of,
    parse_strategy,
    restart_pending,
    restart_run_id,
)
from airflow_arroyo.store import EpochStore
from airflow_arroyo.triggers.pipeline import Verdict, evaluate_wait

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def failures(*pairs: tuple[float, float | None]) -> list[PastFailure]:
    return [PastFailure(at(f), None if r is None else at(r)) for f, r in pairs]


# --------------------------------------------------------------------------- strategies


def test_fixed_delay_restarts_attempts_times_then_gives_up() -> None:
    s = FixedDelay(attempts=2, delay=5)
    assert decide_restart(s, failures((0, None)), at(0)) == RestartDecision(True, 5.0, "restart 1 of 2 (fixed-delay)")
    assert decide_restart(s, failures((0, 5), (10, None)), at(10)).restart
    gave_up = decide_restart(s, failures((0, 5), (10, 15), (20, None)), at(20))
    assert not gave_up.restart and "more than the 2 restart(s)" in gave_up.reason


def test_exponential_delay_doubles_up_to_max_and_resets_after_a_long_healthy_run() -> None:
    s = ExponentialDelay(initial=1, max=5, multiplier=2, reset_after=100, jitter=0)
    history: list[tuple[float, float | None]] = []
    delays = []
    t = 0.0
    for _ in range(5):  # quick failures: 1, 2, 4, 5 (max), 5
        history.append((t, None))
        d = decide_restart(s, failures(*history), at(t), lineage="L")
        delays.append(d.delay)
        history[-1] = (t, t + d.delay)
        t += d.delay + 1  # up only one second before failing again
    assert delays == [1, 2, 4, 5, 5]
    # up for 100 s or more since the last restart: the backoff starts over
    history.append((history[-1][1] + 100, None))  # type: ignore[operator]
    assert decide_restart(s, failures(*history), at(history[-1][0]), lineage="L").delay == 1
    bounded = ExponentialDelay(initial=1, max=5, reset_after=100, attempts=2, jitter=0)
    assert not decide_restart(bounded, failures((0, 1), (2, 4), (5, None)), at(5)).restart


def test_exponential_jitter_stays_within_its_fraction_and_repeats_for_the_same_failure() -> None:
    s = ExponentialDelay(initial=10, max=100, jitter=0.5)
    seen = {decide_restart(s, failures((0, None)), at(0), lineage=f"L{i}").delay for i in range(50)}
    assert all(5 <= d <= 15 for d in seen) and len(seen) > 10
    one = failures((0, None))
    assert decide_restart(s, one, at(0), lineage="X").delay == decide_restart(s, one, at(0), lineage="X").delay


def test_failure_rate_counts_failures_within_the_interval() -> None:
    s = FailureRate(max_failures=2, interval=60, delay=3)
    assert decide_restart(s, failures((0, 3), (10, None)), at(10)) == RestartDecision(
        True, 3.0, "2 of 2 failures within 60 s (failure-rate)")
    assert not decide_restart(s, failures((0, 3), (10, 13), (20, None)), at(20)).restart
    assert decide_restart(s, failures((0, 3), (10, 13), (100, None)), at(100)).restart  # the first two are old


def test_no_restart_and_a_requested_stop_never_restart() -> None:
    assert not decide_restart(NoRestart(), failures((0, None)), at(0)).restart
    stop = decide_restart(FixedDelay(), failures((0, None)), at(0), stop_requested=True)
    assert not stop.restart and "stop was requested" in stop.reason


@pytest.mark.parametrize(("value", "expected"), [
    (None, None), ("", None), ("none", NoRestart()), ("fixed-delay", FixedDelay()),
    ({"type": "fixed_delay", "attempts": "4", "delay": "2.5"}, FixedDelay(attempts=4, delay=2.5)),
    ({"type": "failure-rate", "max_failures": 1}, FailureRate(max_failures=1)),
    ({"type": "exponential-delay", "attempts": "None", "max": 60}, ExponentialDelay(max=60)),
    ('{"type": "failure-rate", "delay": 1}', FailureRate(delay=1)),  # a rendered template: JSON ...
    ("{'type': 'fixed-delay', 'attempts': 5}", FixedDelay(attempts=5)),  # ... or a dict's repr
])
def test_parse_strategy(value: Any, expected: Any) -> None:
    parsed = parse_strategy(value)
    assert parsed == expected
    if parsed is not None:
        assert parse_strategy(parsed.to_dict()) == parsed  # round trip through the trigger's kwargs


@pytest.mark.parametrize(("value", "needle"), [
    ({"type": "fixed"}, "type 'fixed' is unknown"),
    ({"type": "fixed-delay", "tries": 3}, "no setting 'tries'"),
    ({"type": "fixed-delay", "delay": -1}, "delay must be a number of seconds >= 0"),
    ({"type": "fixed-delay", "attempts": 1.5}, "attempts must be a whole number"),
    ({"type": "fixed-delay", "attempts": "\u00b2"}, "attempts must be a whole number"),
    ({"type": "exponential-delay", "initial": 10, "max": 5}, "max (5 s) is below initial"),
    ({"type": "exponential-delay", "jitter": 2}, "jitter must be a fraction"),
    ({"type": "failure-rate", "max_failures": 0}, "max_failures must be a whole number >= 1"),
    (42, "restart_strategy must be a dict"),
    ("{type: fixed}", "neither JSON nor a dict"),
])
def test_parse_strategy_refuses_bad_settings_naming_them(value: Any, needle: str) -> None:
    with pytest.raises(ConfigurationError) as err:
        parse_strategy(value)
    assert needle in str(err.value)


def test_lineage_rules() -> None:
    assert restart_run_id("d.r.try1", 2) == "d.r.try1.restart2"
    assert is_run_of("d.r.try1", "d.r.try1") and is_run_of("d.r.try1.restart12", "d.r.try1")
    assert not is_run_of("d.r.try12", "d.r.try1") and not is_run_of("d.r.try1.restartx", "d.r.try1")
    assert not is_run_of("d.r.try1", None) and not is_run_of("d.r.try1.restart\uff11", "d.r.try1")


# --------------------------------------------------------------------------- the store's record


def _always(delay: float = 0.0) -> Any:
    seen: list[list[PastFailure]] = []

    def decide(past: list[PastFailure], now: datetime, stop_requested: bool) -> RestartDecision:
        seen.append(list(past))
        if stop_requested:
            return RestartDecision(False, 0.0, "stop")
        return RestartDecision(True, delay, f"restart {len(past)}")

    decide.seen = seen  # type: ignore[attr-defined]
    return decide


def test_the_store_records_failures_once_and_restarts_of_a_lineage(store: EpochStore) -> None:
    store.register_pipeline("p", stages=["a"], run_id="L")
    store.set_pipeline_state("p", PipelineState.RUNNING, run_id="L")
    record = store.supervise("p", "L", FixedDelay(attempts=2).to_dict())
    assert (record.supervision, record.supervised_run, record.restart_strategy["type"]) == (
        "watching", "L", "fixed-delay")
    decide = _always(1.5)
    first = store.record_failure("p", "L", "L", "heartbeat stopped", decide)
    assert (first.attempt, first.delay_s, first.gave_up, first.decision) == (1, 1.5, False, "restart 1")
    again = store.record_failure("p", "L", "L", "noticed again by another triggerer", decide)
    assert again == first and len(decide.seen) == 1  # recorded once; the decision was not taken twice
    pipeline = store.get_pipeline("p")
    assert restart_pending(pipeline) and pipeline.supervision == "restarting"
    # the restart registers with takeover: same lineage, the supervision is kept
    store.register_pipeline("p", stages=["a"], run_id=restart_run_id("L", 1), takeover=True)
    store.record_restart("p", "L", 1, restart_run_id("L", 1), 7)
    pipeline = store.get_pipeline("p")
    assert (pipeline.supervision, lineage_of(pipeline)) == ("watching", "L") and in_lineage(pipeline, "L")
    second = store.record_failure("p", "L", "L.restart1", "failed", decide)
    assert second.attempt == 2 and [f.restarted_at is not None for f in decide.seen[-1]] == [True, False]
    assert [(r.attempt, r.new_run_id, r.restored_epoch) for r in store.restarts("p")] == [
        (2, None, None), (1, "L.restart1", 7)]
    assert store.claim_restart("p", "L", 2) is None  # due, nothing against it
    store.request_stop("p", "graceful")  # a stop during the backoff cancels the restart
    assert "a stop (graceful) was requested" in (store.claim_restart("p", "L", 2) or "")
    # a run of another lineage takes over: nobody supervises it, the old supervisor is refused
    store.register_pipeline("p", stages=["a"], run_id="other", takeover=True)
    pipeline = store.get_pipeline("p")
    assert pipeline.supervision is None and not restart_pending(pipeline) and not in_lineage(pipeline, "L")
    with pytest.raises(ConcurrencyConflict, match="took it over"):
        store.supervise("p", "L", FixedDelay().to_dict())
    with pytest.raises(ConcurrencyConflict, match="took it over"):
        store.record_failure("p", "L", "L.restart2", "late", decide)
    assert "took it over" in (store.claim_restart("p", "L", 2) or "")


def test_a_supervisor_never_restarts_into_an_epoch_a_restore_proved_unrestorable(store: EpochStore) -> None:
    """Issue 30: every restart restores the latest completed epoch; once a restore proved it unrestorable, a
    restart would fail the same way for ever: the failure is recorded as given up, naming the epoch."""
    store.register_pipeline("u", stages=["a"], run_id="L")
    store.set_pipeline_state("u", PipelineState.RUNNING, run_id="L")
    store.supervise("u", "L", FixedDelay(attempts=5).to_dict())
    store.heartbeat("u", "L")
    for _ in range(2):
        epoch = store.trigger_tick("u", CheckpointPolicy(interval=1), force=True).started
        assert epoch is not None
        store.ack_epoch("u", epoch.epoch, "a")
    decide = _always()
    first = store.record_failure("u", "L", "L", "executor lost", decide)
    assert (first.gave_up, len(decide.seen)) == (False, 1)  # restorable: the strategy decides
    store.mark_unrestorable("u", epoch.epoch, "no committed batch")
    store.mark_unrestorable("u", epoch.epoch, "a later reason")  # the first reason stays
    assert store.get_epoch("u", epoch.epoch).unrestorable == "no committed batch"
    second = store.record_failure("u", "L", "L.restart1", "restore failed", decide)
    assert second.gave_up and len(decide.seen) == 1
    assert f"latest completed epoch {epoch.epoch}" in (second.decision or "")
    assert "no committed batch" in (second.decision or "") and "restore_from=<n>" in (second.decision or "")
    assert store.get_pipeline("u").supervision == "gave_up"


def test_a_lineage_supervised_again_counts_its_failures_afresh(store: EpochStore) -> None:
    """A cleared DAG run reuses its run id: its failures are not the earlier supervision's (which gave up)."""
    store.register_pipeline("r", stages=["a"], run_id="L")
    store.set_pipeline_state("r", PipelineState.RUNNING, run_id="L")
    store.supervise("r", "L", FixedDelay(attempts=0).to_dict())
    decide = _always()
    gave_up = store.record_failure("r", "L", "L", "boom", lambda p, n, s: RestartDecision(False, 0.0, "no"))
    assert gave_up.gave_up and store.get_pipeline("r").supervision == "gave_up"
    store.set_pipeline_state("r", PipelineState.FAILED, run_id="L", failure_cause="boom")
    store.register_pipeline("r", stages=["a"], run_id="L")  # the same run id again
    store.set_pipeline_state("r", PipelineState.RUNNING, run_id="L")
    again = store.supervise("r", "L", FixedDelay(attempts=1).to_dict())
    assert again.supervision == "watching"
    first = store.record_failure("r", "L", "L", "boom again", decide)
    assert (first.attempt, first.gave_up, first.cause) == (1, False, "boom again")  # not the old row
    assert len(decide.seen[-1]) == 1
    # a retried task reattaching keeps counting this supervision's failures
    assert store.supervise("r", "L", FixedDelay(attempts=1).to_dict()).supervised_since == store.get_pipeline(
        "r").supervised_since
    assert [r.attempt for r in store.restarts("r", "L")] == [1, 1]  # one per supervision


def test_a_wait_for_a_supervised_run_goes_on_while_it_restarts(store: EpochStore) -> None:
    store.register_pipeline("w", stages=["a"], run_id="L")
    store.set_pipeline_state("w", PipelineState.RUNNING, run_id="L")
    store.supervise("w", "L", FixedDelay().to_dict())
    store.set_pipeline_state("w", PipelineState.FAILED, run_id="L", failure_cause="boom")
    failed = store.get_pipeline("w")
    assert evaluate_wait(failed, state=PipelineState.STOPPED, run_id="L").verdict is Verdict.WAIT
    store.end_supervision("w", "L")  # e.g. the strategy gave up
    gone = store.get_pipeline("w")
    assert evaluate_wait(gone, state=PipelineState.STOPPED, run_id="L").verdict is Verdict.FAILED
    store.register_pipeline("w", stages=["a"], run_id="L.restart1", takeover=True)
    assert evaluate_wait(store.get_pipeline("w"), state=PipelineState.STOPPED, run_id="L").verdict is Verdict.WAIT


def test_a_restart_that_never_registers_is_declared_failed(store: EpochStore) -> None:
    """Issue 30, finding 6: the worker submitting a restart dies between the failure and the restart's
    registration. Past a bound the restart's run is the lineage's next failure, which the strategy decides on:
    a restart again, then, its attempts used up, giving up, which ends every wait for the run (failed)."""
    store.register_pipeline("x", stages=["a"], run_id="L")
    store.set_pipeline_state("x", PipelineState.RUNNING, run_id="L")
    store.supervise("x", "L", FixedDelay(attempts=2, delay=0.0).to_dict())
    store.set_pipeline_state("x", PipelineState.FAILED, run_id="L", failure_cause="executor lost")
    store.record_failure("x", "L", "L", "executor lost", _always())
    assert store.expire_restart("x", grace=3600) is None  # within the bound: the restart may still come
    # restart 1 was due and never submitted
    first = store.expire_restart("x", grace=0)
    assert first is not None and (first.attempt, first.failed_run_id, first.gave_up) == (2, "L.restart1", False)
    assert "restart 1 (run L.restart1) was due" in first.cause and "did not register within 0s" in first.cause
    assert store.get_pipeline("x").supervision == "restarting" and store.expire_restart("x", grace=3600) is None
    # restart 2 was submitted and its run never registered: attempts used up, the supervision gives up
    store.record_restart("x", "L", 2, "L.restart2", None)
    assert store.get_pipeline("x").supervision == "watching"
    second = store.expire_restart("x", grace=0)
    assert second is not None and (second.attempt, second.failed_run_id, second.gave_up) == (3, "L.restart2", True)
    assert "was submitted" in second.cause
    pipeline = store.get_pipeline("x")
    assert pipeline.supervision == "gave_up" and not restart_pending(pipeline)
    assert evaluate_wait(pipeline, state=PipelineState.STOPPED, run_id="L").verdict is Verdict.FAILED
    assert store.expire_restart("x", grace=0) is None  # nothing more to declare


def test_a_restart_that_registered_is_not_declared_failed(store: EpochStore) -> None:
    """The restart's run registered (its submitter may have died before recording the restart): not overdue."""
    store.register_pipeline("y", stages=["a"], run_id="L")
    store.set_pipeline_state("y", PipelineState.RUNNING, run_id="L")
    store.supervise("y", "L", FixedDelay(attempts=2, delay=0.0).to_dict())
    store.record_failure("y", "L", "L", "boom", _always())
    store.register_pipeline("y", stages=["a"], run_id=restart_run_id("L", 1), takeover=True)
    assert store.expire_restart("y", grace=0) is None
    store.record_restart("y", "L", 1, restart_run_id("L", 1), None)
    assert store.expire_restart("y", grace=0) is None
    with pytest.raises(ConfigurationError, match="grace"):
        store.expire_restart("y", grace=-1)
