"""The warning rules (pure): each rule at its boundary, and properties over random facts."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from airflow_arroyo.core.epochs import EpochState, PipelineState
from airflow_arroyo.store.reads import RECENT_WINDOW, PipelineOverview
from airflow_arroyo.store.records import CleanupLockRecord, EpochRecord, PipelineRecord
from airflow_arroyo.ui.health import HealthThresholds, Severity, assess, worst

NOW = datetime(2024, 5, 1, 12, 0, 0, tzinfo=UTC)
T = HealthThresholds()


def ago(seconds: float) -> datetime:
    return NOW - timedelta(seconds=seconds)


def pipeline(state: PipelineState = PipelineState.RUNNING, *, interval: float | None = 30.0,
             heartbeat_s: float | None = 5.0, updated_s: float = 3 * 3600, **kw: object) -> PipelineRecord:
    return PipelineRecord(pipeline_id="p", state=state, checkpoint_interval_s=interval,
                          heartbeat_at=None if heartbeat_s is None else ago(heartbeat_s),
                          updated_at=ago(updated_s), **kw)  # type: ignore[arg-type]


def completed(epoch: int, ended_s: float) -> EpochRecord:
    return EpochRecord("p", epoch, EpochState.COMPLETED, triggered_at=ago(ended_s + 2),
                       timeout_at=ago(ended_s - 300), ended_at=ago(ended_s), stages=["a"])


def overview(p: PipelineRecord | None = None, *, last: EpochRecord | None = None, in_flight: EpochRecord | None = None,
             recent: list[tuple[int, EpochState]] | None = None, lock: CleanupLockRecord | None = None,
             reason: str | None = "disk full") -> PipelineOverview:
    rec = [EpochRecord("p", n, s, triggered_at=ago(100), timeout_at=ago(-200),
                       ended_at=None if s is EpochState.TRIGGERED else ago(90),
                       failure_reason=reason if s.ended_unsuccessfully else None) for n, s in (recent or [])]
    return PipelineOverview(pipeline=p or pipeline(), now=NOW, last_completed=last, in_flight=in_flight,
                            recent=rec, cleanup_lock=lock)


def kinds(o: PipelineOverview) -> dict[str, Severity]:
    return {f.kind: f.severity for f in assess(o)}


def test_a_healthy_pipeline_has_no_findings() -> None:
    o = overview(last=completed(10, 20), recent=[(10, EpochState.COMPLETED), (9, EpochState.COMPLETED)])
    assert assess(o) == []
    assert worst(assess(o)) is Severity.OK


def test_failed_pipeline_is_critical_with_its_cause() -> None:
    o = overview(pipeline(PipelineState.FAILED, failure_cause="driver OOM"), last=completed(3, 20))
    (f,) = [f for f in assess(o) if f.kind == "failed"]
    assert f.severity is Severity.CRITICAL and "driver OOM" in f.message


@pytest.mark.parametrize(("states", "severity", "count"), [
    ([EpochState.FAILED, EpochState.COMPLETED], Severity.WARNING, "1 checkpoint"),
    ([EpochState.EXPIRED, EpochState.FAILED, EpochState.COMPLETED], Severity.WARNING, "2 checkpoints"),
    ([EpochState.FAILED, EpochState.EXPIRED, EpochState.FAILED, EpochState.COMPLETED], Severity.CRITICAL,
     "3 checkpoints"),
    ([EpochState.TRIGGERED, EpochState.FAILED, EpochState.COMPLETED], Severity.WARNING, "1 checkpoint"),
    ([EpochState.FAILED] * RECENT_WINDOW, Severity.CRITICAL, f"at least {RECENT_WINDOW} checkpoints"),
])
def test_failing_checkpoints(states: list[EpochState], severity: Severity, count: str) -> None:
    recent = [(100 - i, s) for i, s in enumerate(states)]
    o = overview(last=completed(1, 20), recent=recent)
    (f,) = [f for f in assess(o) if f.kind == "failing"]
    assert f.severity is severity
    assert f"the last {count} failed" in f.message and "disk full" in f.message
    newest_failure = next(n for n, s in recent if s.ended_unsuccessfully)
    assert f"epoch {newest_failure} " in f.message


def test_a_completed_epoch_ends_the_streak() -> None:
    o = overview(last=completed(5, 20), recent=[(5, EpochState.COMPLETED), (4, EpochState.FAILED)])
    assert "failing" not in kinds(o)


def test_overdue_boundary() -> None:
    limit = T.overdue_intervals * 30 + T.overdue_grace_s  # 150 s for a 30 s interval
    assert "overdue" not in kinds(overview(last=completed(9, limit - 1)))
    assert "overdue" not in kinds(overview(last=completed(9, limit)))
    o = overview(last=completed(9, limit + 1))
    assert kinds(o)["overdue"] is Severity.WARNING
    assert "interval 30 s" in next(f.message for f in assess(o) if f.kind == "overdue")


def test_overdue_counts_from_the_start_of_a_new_run() -> None:
    # the last completed epoch is from an older run; this run started 100 s ago: not overdue yet
    o = overview(pipeline(updated_s=100), last=completed(9, 3600))
    assert "overdue" not in kinds(o)
    o = overview(pipeline(updated_s=1000), last=completed(9, 3600))
    msg = next(f.message for f in assess(o) if f.kind == "overdue")
    assert "in this run" in msg and "16m 40s" in msg
    # never completed at all
    o = overview(pipeline(updated_s=1000), last=None)
    assert "overdue" in kinds(o)


@pytest.mark.parametrize("state", [PipelineState.REGISTERED, PipelineState.STOPPING, PipelineState.STOPPED,
                                   PipelineState.FAILED])
def test_only_a_running_pipeline_can_be_overdue(state: PipelineState) -> None:
    assert "overdue" not in kinds(overview(pipeline(state), last=completed(9, 99_999)))


def test_no_interval_no_overdue() -> None:
    assert "overdue" not in kinds(overview(pipeline(interval=None), last=completed(9, 99_999)))


def test_in_flight_past_its_timeout() -> None:
    flying = EpochRecord("p", 11, EpochState.TRIGGERED, triggered_at=ago(400), timeout_at=ago(1), stages=["a"])
    assert kinds(overview(last=completed(10, 20), in_flight=flying))["timed_out"] is Severity.WARNING
    not_yet = EpochRecord("p", 11, EpochState.TRIGGERED, triggered_at=ago(10), timeout_at=ago(-290), stages=["a"])
    assert "timed_out" not in kinds(overview(last=completed(10, 20), in_flight=not_yet))


@pytest.mark.parametrize(("state", "interval", "silent", "warned"), [
    (PipelineState.RUNNING, 30.0, 119.0, False),   # threshold max(120, 90) = 120
    (PipelineState.RUNNING, 30.0, 121.0, True),
    (PipelineState.RUNNING, 60.0, 179.0, False),   # threshold max(120, 180) = 180
    (PipelineState.RUNNING, 60.0, 181.0, True),
    (PipelineState.REGISTERED, 30.0, 500.0, True),
    (PipelineState.STOPPING, 30.0, 500.0, True),
    (PipelineState.STOPPED, 30.0, 99_999.0, False),
    (PipelineState.FAILED, 30.0, 99_999.0, False),
])
def test_stale_heartbeat(state: PipelineState, interval: float, silent: float, warned: bool) -> None:
    o = overview(pipeline(state, interval=interval, heartbeat_s=silent), last=completed(9, 20))
    assert ("heartbeat" in kinds(o)) is warned


def test_never_a_heartbeat() -> None:
    assert "heartbeat" in kinds(overview(pipeline(heartbeat_s=None), last=completed(9, 20)))


def test_cleanup_lock_and_stop_requested_are_information() -> None:
    lock = CleanupLockRecord("p", 7, "retention__p", acquired_at=ago(30), expires_at=ago(-30))
    o = overview(pipeline(stop_requested="graceful"), last=completed(9, 20), lock=lock)
    k = kinds(o)
    assert k["cleanup"] is Severity.INFO and k["stopping"] is Severity.INFO
    assert "cleanup run 7 (retention__p)" in next(f.message for f in assess(o) if f.kind == "cleanup")


_states = st.sampled_from(list(EpochState))


@settings(max_examples=300, deadline=None)
@given(
    state=st.sampled_from(list(PipelineState)),
    interval=st.one_of(st.none(), st.floats(1, 3600)),
    heartbeat=st.one_of(st.none(), st.floats(0, 10**6)),
    last_ended=st.one_of(st.none(), st.floats(0, 10**6)),
    recent=st.lists(_states, max_size=RECENT_WINDOW),
)
def test_properties(state: PipelineState, interval: float | None, heartbeat: float | None,
                    last_ended: float | None, recent: list[EpochState]) -> None:
    o = overview(pipeline(state, interval=interval, heartbeat_s=heartbeat),
                 last=None if last_ended is None else completed(1, last_ended),
                 recent=[(100 - i, s) for i, s in enumerate(recent)])
    findings = assess(o)
    severities = [f.severity for f in findings]
    assert severities == sorted(severities, reverse=True)
    assert worst(findings) == max(severities, default=Severity.OK)
    k = kinds(o)
    assert len(k) == len(findings)  # one finding per kind
    if "overdue" in k:
        assert state is PipelineState.RUNNING and interval
    if "heartbeat" in k:
        assert not state.terminal
    assert ("failing" in k) == (o.consecutive_failures > 0)
    assert ("failed" in k) == (state is PipelineState.FAILED)
