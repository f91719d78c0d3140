"""The checkpoint trigger's decision (``decide_trigger``), ``consecutive_failures`` and ``CheckpointPolicy``:
property-based over every kind of fact the store can hand in, plus the exhaustive product of the discrete
situations (pipeline state x in-flight epoch x cleanup lease x stop request x schedule, each asked for
by the schedule, forced, and as a graceful stop's final epoch)."""

from __future__ import annotations

import itertools
import math
from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from airflow_arroyo.core.epochs import (
    CheckpointPolicy,
    CleanupLease,
    EpochState,
    PipelineState,
    TriggerAction,
    TriggerFacts,
    consecutive_failures,
    decide_trigger,
    next_start_at,
    schedule_phase,
    schedule_point_after,
)
from airflow_arroyo.core.exceptions import ConfigurationError

NOW = datetime(2026, 3, 1, 12, 0, 0, tzinfo=UTC)
WAITS = {TriggerAction.WAIT_IN_FLIGHT, TriggerAction.WAIT_CLEANUP, TriggerAction.WAIT_SCHEDULE,
         TriggerAction.PIPELINE_NOT_RUNNING, TriggerAction.PIPELINE_NOT_ALIVE}

offsets = st.floats(min_value=-3600, max_value=3600, allow_nan=False).map(lambda s: NOW + timedelta(seconds=s))


@st.composite
def policies(draw: st.DrawFn) -> CheckpointPolicy:
    interval = draw(st.floats(min_value=0.001, max_value=3600, allow_nan=False))
    timeout = draw(st.none() | st.floats(min_value=interval, max_value=interval * 100, allow_nan=False))
    min_pause = draw(st.sampled_from([0.0]) | st.floats(min_value=0, max_value=3600, allow_nan=False))
    return CheckpointPolicy(interval=interval, timeout=timeout, min_pause=min_pause,
                            tolerable_failures=draw(st.integers(0, 10)),
                            heartbeat_timeout=draw(st.none() | st.floats(min_value=0.001, max_value=3600)))


@st.composite
def facts(draw: st.DrawFn) -> TriggerFacts:
    last_epoch = draw(st.integers(0, 10_000))
    in_flight = draw(st.booleans()) and last_epoch > 0
    lease = draw(st.none() | st.builds(CleanupLease, holder=st.sampled_from(["retention@w1", "ops"]),
                                       expires_at=offsets))
    return TriggerFacts(
        now=NOW,
        pipeline_state=draw(st.sampled_from(list(PipelineState))),
        last_epoch=last_epoch,
        in_flight_epoch=last_epoch if in_flight else None,
        in_flight_timeout_at=draw(offsets) if in_flight else None,
        last_triggered_at=draw(offsets) if last_epoch > 0 else None,
        last_ended_at=draw(st.none() | offsets) if last_epoch > 0 else None,
        cleanup_lease=lease,
        stop_requested=draw(st.booleans()),
        heartbeat_at=draw(st.none() | offsets),
        force=draw(st.booleans()),
        final_epoch=draw(st.booleans()),
    )


def _due(f: TriggerFacts, p: CheckpointPolicy) -> bool:
    if f.force:
        return True
    too_soon = f.last_triggered_at is not None and not _grid_point_between(f.last_triggered_at, f.now, p.interval,
                                                                           schedule_phase(f.pipeline_id, p.interval))
    pausing = (f.last_ended_at is not None and p.min_pause > 0
               and f.now < f.last_ended_at + timedelta(seconds=p.min_pause))
    return not (too_soon or pausing)


def _grid_point_between(start: datetime, end: datetime, interval: float, phase: float) -> bool:
    """Whether a point of the schedule ``phase + k * interval`` lies in ``(start, end]`` (counted, not searched)."""
    def crossed(t: datetime) -> int:
        return math.floor(((t - datetime(1970, 1, 1, tzinfo=UTC)).total_seconds() - phase) / interval)
    return crossed(end) > crossed(start)


def _lease_live(f: TriggerFacts) -> bool:
    return f.cleanup_lease is not None and f.cleanup_lease.expires_at > f.now


def _runs(f: TriggerFacts) -> bool:
    """Running, or stopping and forced; and not asked to stop, unless this is the stop's final epoch."""
    state_ok = f.pipeline_state is PipelineState.RUNNING or (f.force and f.pipeline_state is PipelineState.STOPPING)
    return state_ok and (not f.stop_requested or f.final_epoch)


def _alive(f: TriggerFacts, p: CheckpointPolicy) -> bool:
    return (p.heartbeat_timeout is None or f.heartbeat_at is None
            or (f.now - f.heartbeat_at).total_seconds() <= p.heartbeat_timeout)


@settings(max_examples=400, deadline=None)
@given(facts(), policies())
def test_start_only_when_every_rule_allows_it_and_always_then(f: TriggerFacts, p: CheckpointPolicy) -> None:
    d = decide_trigger(f, p)
    may_start = f.in_flight_epoch is None and _runs(f) and not _lease_live(f) and _due(f, p) and _alive(f, p)
    assert (d.action is TriggerAction.START) == may_start
    if d.action is TriggerAction.START:
        assert d.epoch == f.last_epoch + 1
        assert f.in_flight_epoch is None  # never a second epoch in flight
        assert not _lease_live(f)  # never under a live cleanup lease, forced or not
        assert f.pipeline_state in (PipelineState.RUNNING, PipelineState.STOPPING)  # never for an ended pipeline
        assert f.pipeline_state is PipelineState.RUNNING or f.force
        assert not f.stop_requested or f.final_epoch
        assert _alive(f, p)  # never for a driver whose heartbeat is stale: the epoch could only expire


@settings(max_examples=400, deadline=None)
@given(facts(), policies())
def test_expire_exactly_when_the_in_flight_epoch_is_past_its_timeout(f: TriggerFacts, p: CheckpointPolicy) -> None:
    d = decide_trigger(f, p)
    past = f.in_flight_epoch is not None and f.in_flight_timeout_at is not None and f.now >= f.in_flight_timeout_at
    assert (d.action is TriggerAction.EXPIRE) == past
    if past:
        assert d.epoch == f.in_flight_epoch
    elif f.in_flight_epoch is not None:
        assert d.action is TriggerAction.WAIT_IN_FLIGHT and d.epoch == f.in_flight_epoch
        assert d.recheck_at == f.in_flight_timeout_at  # next look: when it would time out


@settings(max_examples=400, deadline=None)
@given(facts(), policies())
def test_a_decision_is_total_and_each_wait_says_when_to_look_again(f: TriggerFacts, p: CheckpointPolicy) -> None:
    d = decide_trigger(f, p)
    assert d == decide_trigger(f, p)  # deterministic
    assert d.reason
    if f.in_flight_epoch is None and f.pipeline_state.terminal:
        assert d.action is TriggerAction.PIPELINE_ENDED
    if d.action is TriggerAction.PIPELINE_ENDED:
        assert f.pipeline_state.terminal and f.in_flight_epoch is None
    if d.action is TriggerAction.PIPELINE_NOT_RUNNING:
        assert not _runs(f)
        assert d.recheck_at is not None and d.recheck_at > f.now
    if d.action is TriggerAction.PIPELINE_NOT_ALIVE:
        assert _runs(f) and not _alive(f, p)
        assert d.recheck_at is not None and d.recheck_at > f.now and "heartbeat" in d.reason
    if d.action is TriggerAction.WAIT_CLEANUP:
        assert f.cleanup_lease is not None and d.recheck_at == f.cleanup_lease.expires_at > f.now
    if d.action is TriggerAction.WAIT_SCHEDULE:
        assert not f.force  # a forced epoch never waits for the schedule
        assert d.recheck_at == next_start_at(f, p) and d.recheck_at is not None and d.recheck_at > f.now
    if d.action in WAITS - {TriggerAction.WAIT_IN_FLIGHT}:
        assert d.epoch is None


@settings(max_examples=300, deadline=None)
@given(facts(), policies())
def test_waiting_until_recheck_at_then_starts_if_nothing_else_changed(f: TriggerFacts, p: CheckpointPolicy) -> None:
    d = decide_trigger(f, p)
    if d.action is not TriggerAction.WAIT_SCHEDULE:
        return
    assert d.recheck_at is not None

    def at(now: datetime) -> TriggerFacts:  # the driver kept heartbeating meanwhile
        beat = None if f.heartbeat_at is None else f.heartbeat_at + (now - f.now)
        return TriggerFacts(**{**f.__dict__, "now": now, "heartbeat_at": beat})

    later = at(d.recheck_at)
    assert decide_trigger(later, p).action is TriggerAction.START
    just_before = at(d.recheck_at - timedelta(microseconds=1))
    assert decide_trigger(just_before, p).action is TriggerAction.WAIT_SCHEDULE


@settings(max_examples=300, deadline=None)
@given(facts(), policies(), st.text(max_size=20))
def test_the_schedule_is_the_next_point_of_a_fixed_rate_grid_and_the_min_pause_after_an_end(
        f: TriggerFacts, p: CheckpointPolicy, pipeline_id: str) -> None:
    f = TriggerFacts(**{**f.__dict__, "pipeline_id": pipeline_id})
    due = next_start_at(f, p)
    if f.last_triggered_at is None and (f.last_ended_at is None or p.min_pause == 0):
        assert due is None
        return
    assert due is not None
    point = None
    if f.last_triggered_at is not None:
        phase = schedule_phase(pipeline_id, p.interval)
        assert 0 <= phase < p.interval
        point = schedule_point_after(f.last_triggered_at, p.interval, phase)
        # the first point of the grid after the last start: after it, at most an interval after it, on the grid
        assert f.last_triggered_at < point <= f.last_triggered_at + timedelta(seconds=p.interval, microseconds=1)
        assert _grid_point_between(f.last_triggered_at, point + timedelta(microseconds=1), p.interval, phase)
        assert not _grid_point_between(f.last_triggered_at, point - timedelta(microseconds=2), p.interval, phase)
        assert due >= point
    if f.last_ended_at is not None and p.min_pause > 0:
        assert due >= f.last_ended_at + timedelta(seconds=p.min_pause)
    assert due in {point, f.last_ended_at + timedelta(seconds=p.min_pause) if f.last_ended_at else None}


@settings(max_examples=300, deadline=None)
@given(st.floats(min_value=0.01, max_value=3600), st.floats(min_value=0, max_value=0.999), st.text(max_size=20),
       st.integers(1, 50))
def test_lateness_does_not_add_up_and_a_missed_point_is_not_caught_up(interval: float, late: float, pipeline_id: str,
                                                                      epochs: int) -> None:
    """Epochs each started late by up to an interval stay on the grid: the n-th is due n intervals after the
    first point, whatever the lateness before it (Flink's fixed-rate scheduler); one started several intervals
    late is followed one point later, not by a burst."""
    p = CheckpointPolicy(interval=interval)
    f = TriggerFacts(now=NOW, pipeline_state=PipelineState.RUNNING, last_epoch=1, pipeline_id=pipeline_id,
                     last_triggered_at=NOW)
    first = next_start_at(f, p)
    assert first is not None
    due = first
    for _ in range(epochs):
        started = due + timedelta(seconds=late * interval)
        nxt = next_start_at(TriggerFacts(**{**f.__dict__, "last_triggered_at": started}), p)
        assert nxt is not None
        assert abs((nxt - due).total_seconds() - interval) < 1e-5 + 1e-9 * interval
        due = nxt
    assert abs((due - first).total_seconds() - epochs * interval) < 1e-4
    very_late = due + timedelta(seconds=3.5 * interval)
    after = next_start_at(TriggerFacts(**{**f.__dict__, "last_triggered_at": very_late}), p)
    assert after is not None and abs((after - due).total_seconds() - 4 * interval) < 1e-4


def test_pipelines_are_spread_over_the_interval() -> None:
    """The phase comes from the pipeline id: the same in every process, and 1000 pipelines fall evenly over
    the interval (each tenth holds 70-130 of them) instead of all at once."""
    assert schedule_phase("orders", 30.0) == schedule_phase("orders", 30.0)
    phases = [schedule_phase(f"pipeline-{i}", 1.0) for i in range(1000)]
    tenths = [sum(1 for x in phases if k / 10 <= x < (k + 1) / 10) for k in range(10)]
    assert all(70 <= n <= 130 for n in tenths), tenths


# --------------------------------------------------------------------------- exhaustive product

IN_FLIGHT = {"none": None, "live": NOW + timedelta(seconds=5), "timed_out": NOW - timedelta(seconds=1),
             "at_timeout": NOW}
LEASE = {"none": None, "live": CleanupLease("retention", NOW + timedelta(seconds=30)),
         "expired": CleanupLease("retention", NOW - timedelta(seconds=1)),
         "expires_now": CleanupLease("retention", NOW)}
# "not_due": the last epoch started right on its point of the schedule (interval 10 s), the latest at or before NOW
ON_TIME = schedule_point_after(NOW - timedelta(seconds=10), 10, schedule_phase("", 10))
SCHEDULE = {"never": (None, None), "not_due": (ON_TIME, None),
            "due": (NOW - timedelta(seconds=10), None), "due_but_paused": (NOW - timedelta(seconds=60), NOW),
            "due_after_pause": (NOW - timedelta(seconds=60), NOW - timedelta(seconds=30))}
HEARTBEAT = {"never": None, "fresh": NOW - timedelta(seconds=2), "at_bound": NOW - timedelta(seconds=30),
             "stale": NOW - timedelta(seconds=31)}
POLICY = CheckpointPolicy(interval=10, timeout=60, min_pause=20, heartbeat_timeout=30)


def _product() -> list[tuple[PipelineState, str, str, bool, str, str]]:
    """Every combination, the heartbeat fresh; and every heartbeat against what decides before or after it."""
    fresh = [(*c, "fresh") for c in itertools.product(list(PipelineState), IN_FLIGHT, LEASE, [False, True], SCHEDULE)]
    beats = [(st_, fl, ls, stop, "due", hb) for st_, fl, ls, stop, hb in itertools.product(
        list(PipelineState), IN_FLIGHT, ("none", "live"), [False, True], HEARTBEAT) if hb != "fresh"]
    return fresh + beats


# how the epoch is asked for: (force, final_epoch)
ASKED = {"by the schedule": (False, False), "forced": (True, False), "final epoch": (True, True),
         "final, not forced": (False, True)}


@pytest.mark.parametrize(("state", "in_flight", "lease", "stop", "schedule", "heartbeat"), _product())
def test_every_discrete_situation(state: PipelineState, in_flight: str, lease: str, stop: bool,
                                  schedule: str, heartbeat: str) -> None:
    """Each situation asked for in each way (a loop, not more parameters: one decision costs microseconds)."""
    last_triggered, last_ended = SCHEDULE[schedule]
    for asked, (force, final) in ASKED.items():
        f = TriggerFacts(now=NOW, pipeline_state=state, last_epoch=7,
                         in_flight_epoch=7 if IN_FLIGHT[in_flight] is not None else None,
                         in_flight_timeout_at=IN_FLIGHT[in_flight], last_triggered_at=last_triggered,
                         last_ended_at=last_ended, cleanup_lease=LEASE[lease], stop_requested=stop,
                         heartbeat_at=HEARTBEAT[heartbeat], force=force, final_epoch=final)
        d = decide_trigger(f, POLICY)
        if in_flight in ("timed_out", "at_timeout"):
            expected = TriggerAction.EXPIRE
        elif in_flight == "live":
            expected = TriggerAction.WAIT_IN_FLIGHT
        elif state.terminal:
            expected = TriggerAction.PIPELINE_ENDED
        elif state is PipelineState.REGISTERED or (state is PipelineState.STOPPING and not force) or stop and not final:
            expected = TriggerAction.PIPELINE_NOT_RUNNING
        elif heartbeat == "stale":
            expected = TriggerAction.PIPELINE_NOT_ALIVE
        elif lease == "live":
            expected = TriggerAction.WAIT_CLEANUP
        elif schedule in ("not_due", "due_but_paused") and not force:
            expected = TriggerAction.WAIT_SCHEDULE
        else:
            expected = TriggerAction.START
        assert d.action is expected, (asked, d, f)
        if expected in (TriggerAction.EXPIRE, TriggerAction.WAIT_IN_FLIGHT):
            assert d.epoch == 7
        if expected is TriggerAction.START:
            assert d.epoch == 8


def test_a_graceful_stops_final_epoch_starts_while_the_pipeline_is_stopping() -> None:
    """The driver's final epoch: stopping, the stop requested, the last epoch a second ago."""
    f = TriggerFacts(now=NOW, pipeline_state=PipelineState.STOPPING, last_epoch=3, stop_requested=True,
                     last_triggered_at=NOW - timedelta(seconds=1), last_ended_at=NOW, heartbeat_at=NOW)
    assert decide_trigger(f, POLICY).action is TriggerAction.PIPELINE_NOT_RUNNING
    forced = TriggerFacts(**{**f.__dict__, "force": True})
    assert decide_trigger(forced, POLICY).action is TriggerAction.PIPELINE_NOT_RUNNING  # the stop request holds
    final = TriggerFacts(**{**f.__dict__, "force": True, "final_epoch": True})
    d = decide_trigger(final, POLICY)
    assert (d.action, d.epoch) == (TriggerAction.START, 4)


# --------------------------------------------------------------------------- consecutive failures

epoch_states = st.lists(st.sampled_from(list(EpochState)), max_size=30)


@given(epoch_states)
def test_consecutive_failures_by_induction_on_the_newest_epoch(newest_first: list[EpochState]) -> None:
    """f([]) = 0; an in-flight newest epoch is skipped; a failed/expired one adds one; anything else
    (completed, pruning, pruned) ends the streak. These four facts define the function completely."""
    assert consecutive_failures([]) == 0
    rest = consecutive_failures(newest_first)
    assert consecutive_failures([EpochState.TRIGGERED, *newest_first]) == rest
    assert consecutive_failures([EpochState.FAILED, *newest_first]) == rest + 1
    assert consecutive_failures([EpochState.EXPIRED, *newest_first]) == rest + 1
    for ender in (EpochState.COMPLETED, EpochState.PRUNING, EpochState.PRUNED):
        assert consecutive_failures([ender, *newest_first]) == 0
    assert consecutive_failures(iter(newest_first)) == rest  # any iterable, read once
    assert 0 <= rest <= sum(s.ended_unsuccessfully for s in newest_first)


def test_consecutive_failures_examples() -> None:
    F, E, C, T = EpochState.FAILED, EpochState.EXPIRED, EpochState.COMPLETED, EpochState.TRIGGERED
    assert consecutive_failures([T, F, E, F, C, F, F]) == 3
    assert consecutive_failures([C, F, F]) == 0
    assert consecutive_failures([F, T, E]) == 2


# --------------------------------------------------------------------------- policy validation


@given(st.one_of(st.floats(max_value=0), st.integers(max_value=0), st.just(math.nan), st.just(math.inf),
                 st.just(-math.inf)))
def test_non_positive_or_non_finite_interval_is_refused(interval: float) -> None:
    with pytest.raises(ConfigurationError, match="interval must be a positive number"):
        CheckpointPolicy(interval=interval)


@given(st.floats(min_value=0.001, max_value=1e6), st.floats(min_value=0, max_value=0.999))
def test_a_timeout_shorter_than_the_interval_is_refused(interval: float, fraction: float) -> None:
    timeout = interval * fraction
    if timeout >= interval:
        return
    with pytest.raises(ConfigurationError, match="shorter than the interval"):
        CheckpointPolicy(interval=interval, timeout=timeout)


@given(st.floats(min_value=0.001, max_value=1e6), st.floats(min_value=1, max_value=100))
def test_a_timeout_at_least_the_interval_is_accepted_and_defaults_are_sane(interval: float, factor: float) -> None:
    assert CheckpointPolicy(interval=interval, timeout=interval * factor).effective_timeout == interval * factor
    default = CheckpointPolicy(interval=interval).effective_timeout
    assert default >= interval and default >= 60.0 and default == max(10 * interval, 60.0)


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"interval": True}, "interval must be a positive"),
        ({"interval": "30"}, "interval must be a positive"),
        ({"interval": 10, "timeout": math.nan}, "shorter than the interval"),
        ({"interval": 10, "min_pause": -0.5}, "min_pause"),
        ({"interval": 10, "min_pause": math.inf}, "min_pause"),
        ({"interval": 10, "tolerable_failures": -1}, "tolerable_failures"),
        ({"interval": 10, "tolerable_failures": 1.5}, "tolerable_failures"),
    ],
)
def test_other_bad_policies_are_refused(kwargs: dict[str, object], needle: str) -> None:
    with pytest.raises(ConfigurationError, match=needle):
        CheckpointPolicy(**kwargs)  # type: ignore[arg-type]
