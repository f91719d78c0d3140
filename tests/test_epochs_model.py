"""The model: transition tables and the retention policy, exhaustively and property-based."""

from __future__ import annotations

import itertools
from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from airflow_arroyo.core.epochs import (
    EPOCH_TRANSITIONS,
    PIPELINE_TRANSITIONS,
    EpochFacts,
    EpochState,
    PipelineState,
    RetentionPolicy,
    check_epoch_transition,
    check_pipeline_transition,
    epoch_states_from,
    pipeline_states_from,
    select_prunable,
    validate_pipeline_id,
)
from airflow_arroyo.core.exceptions import ConfigurationError, IllegalTransitionError

NOW = datetime(2026, 1, 1, tzinfo=UTC)


# ----------------------------------------------------------------------------- transitions


@pytest.mark.parametrize(("current", "target"), list(itertools.product(EpochState, EpochState)))
def test_epoch_transition_table_is_the_only_rule(current: EpochState, target: EpochState) -> None:
    legal = target in EPOCH_TRANSITIONS[current]
    if legal:
        check_epoch_transition(current, target)
        assert current.value in epoch_states_from(target)
    else:
        with pytest.raises(IllegalTransitionError, match=f"{current.value}.*{target.value}"):
            check_epoch_transition(current, target)
        assert current.value not in epoch_states_from(target)


@pytest.mark.parametrize(("current", "target"), list(itertools.product(PipelineState, PipelineState)))
def test_pipeline_transition_table_is_the_only_rule(current: PipelineState, target: PipelineState) -> None:
    if target in PIPELINE_TRANSITIONS[current]:
        check_pipeline_transition(current, target)
        assert current.value in pipeline_states_from(target)
    else:
        with pytest.raises(IllegalTransitionError):
            check_pipeline_transition(current, target)


def test_epoch_life_cycle_shape() -> None:
    # pruned is final, nothing returns to triggered, and every state can reach pruned except triggered's
    # successors must pass through an end state first.
    assert EPOCH_TRANSITIONS[EpochState.PRUNED] == frozenset()
    assert all(EpochState.TRIGGERED not in nxt for nxt in EPOCH_TRANSITIONS.values())
    assert EpochState.PRUNING not in EPOCH_TRANSITIONS[EpochState.TRIGGERED]


@pytest.mark.parametrize("bad", ["", "a/b", "x" * 201, "..", "with space", "ü"])
def test_pipeline_id_validation_names_the_fix(bad: str) -> None:
    with pytest.raises(ConfigurationError, match="letters, digits"):
        validate_pipeline_id(bad)


def test_pipeline_id_ok() -> None:
    assert validate_pipeline_id("orders.v2_eu-1") == "orders.v2_eu-1"


# ----------------------------------------------------------------------------- retention policy


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({}, "keeps nothing"),
        ({"keep_last": 0}, "keep_last"),
        ({"keep_last": -3}, "keep_last"),
        ({"keep_last": True}, "keep_last"),
        ({"keep_newer_than": timedelta(0)}, "keep_newer_than"),
        ({"keep_newer_than": 3600}, "keep_newer_than"),
    ],
)
def test_retention_policy_rejects_policies_that_keep_nothing(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ConfigurationError, match=match):
        RetentionPolicy(**kwargs)  # type: ignore[arg-type]


end_states = st.sampled_from(
    [EpochState.COMPLETED, EpochState.COMPLETED, EpochState.FAILED, EpochState.EXPIRED, EpochState.PRUNED,
     EpochState.PRUNING, EpochState.SUPERSEDED]
)


@st.composite
def epoch_histories(draw: st.DrawFn) -> list[EpochFacts]:
    n = draw(st.integers(min_value=0, max_value=30))
    facts: list[EpochFacts] = []
    t = NOW - timedelta(hours=10)
    for i in range(1, n + 1):
        t += timedelta(seconds=draw(st.integers(min_value=1, max_value=3600)))
        state = draw(end_states)
        # the store pins completed epochs only; a restore of an older epoch may supersede one later
        pin = draw(st.sampled_from([None, None, "keep", f"release {i}"])) if state in (
            EpochState.COMPLETED, EpochState.SUPERSEDED) else None
        facts.append(EpochFacts(epoch=i, state=state, triggered_at=t, ended_at=t + timedelta(seconds=1),
                                pin_label=pin))
    if n and draw(st.booleans()):  # the newest may be in flight
        last = facts[-1]
        facts[-1] = EpochFacts(epoch=last.epoch, state=EpochState.TRIGGERED, triggered_at=last.triggered_at)
    return facts


policies = st.one_of(
    st.builds(RetentionPolicy, keep_last=st.integers(min_value=1, max_value=10)),
    st.builds(RetentionPolicy, keep_newer_than=st.integers(min_value=1, max_value=36000).map(
        lambda s: timedelta(seconds=s))),
    st.builds(RetentionPolicy, keep_last=st.integers(min_value=1, max_value=10),
              keep_newer_than=st.integers(min_value=1, max_value=36000).map(lambda s: timedelta(seconds=s))),
)


@settings(max_examples=400, deadline=None)
@given(epoch_histories(), policies)
def test_select_prunable_never_prunes_what_must_stay(history: list[EpochFacts], policy: RetentionPolicy) -> None:
    sel = select_prunable(history, policy, NOW)
    by_epoch = {e.epoch: e for e in history}
    completed = sorted(e.epoch for e in history if e.state is EpochState.COMPLETED)
    pruned = set(sel.prune)

    # a partition of the epochs that are not already pruned
    assert pruned.isdisjoint(sel.keep)
    assert pruned | set(sel.keep) == {e.epoch for e in history if e.state is not EpochState.PRUNED}
    # never the latest completed, never an in-flight one
    if completed:
        assert completed[-1] not in pruned
    assert all(by_epoch[e].state is not EpochState.TRIGGERED for e in pruned)
    # the last K completed are kept
    if policy.keep_last is not None:
        assert set(completed[-policy.keep_last:]).isdisjoint(pruned)
    # completed epochs newer than T are kept
    if policy.keep_newer_than is not None:
        for e in completed:
            ended = by_epoch[e].ended_at
            assert ended is not None
            if NOW - ended < policy.keep_newer_than:
                assert e not in pruned
    # pinned epochs stay whatever the policy says, and say so
    for e in history:
        if e.pin_label is not None:
            assert e.epoch not in pruned
            assert sel.reasons[e.epoch] == f"pinned: {e.pin_label}"
    # failed/expired partial data, abandoned (superseded) epochs and unfinished pruning always go (unpinned)
    for e in history:
        if e.pin_label is None and e.state in (EpochState.FAILED, EpochState.EXPIRED, EpochState.PRUNING,
                                               EpochState.SUPERSEDED):
            assert e.epoch in pruned
    # and nothing else goes: a completed epoch is pruned only when no rule keeps it
    for e in pruned:
        if by_epoch[e].state is EpochState.COMPLETED:
            assert policy.keep_last is None or e not in completed[-policy.keep_last:]
            assert policy.keep_newer_than is None or NOW - (by_epoch[e].ended_at or NOW) >= policy.keep_newer_than


def test_select_prunable_example() -> None:
    t = NOW - timedelta(hours=5)
    history = [
        EpochFacts(1, EpochState.COMPLETED, t, t),
        EpochFacts(2, EpochState.EXPIRED, t, t),
        EpochFacts(3, EpochState.COMPLETED, t, t),
        EpochFacts(4, EpochState.COMPLETED, t, t),
        EpochFacts(5, EpochState.FAILED, t, t),
        EpochFacts(6, EpochState.TRIGGERED, t),
    ]
    sel = select_prunable(history, RetentionPolicy(keep_last=2), NOW)
    assert sel.prune == (1, 2, 5)
    assert sel.keep == (3, 4, 6)
    assert sel.reasons[6] == "in flight"
    assert sel.reasons[4] == "latest completed"


def test_select_prunable_keeps_pinned_epochs_outside_the_policy() -> None:
    t = NOW - timedelta(days=30)
    history = [
        EpochFacts(1, EpochState.COMPLETED, t, t, pin_label="before the 2.0 upgrade"),
        EpochFacts(2, EpochState.COMPLETED, t, t),
        EpochFacts(3, EpochState.SUPERSEDED, t, t, pin_label="audit"),
        EpochFacts(4, EpochState.COMPLETED, t, t),
        EpochFacts(5, EpochState.COMPLETED, NOW, NOW, pin_label="newest"),
    ]
    sel = select_prunable(history, RetentionPolicy(keep_last=1, keep_newer_than=timedelta(hours=1)), NOW)
    assert sel.prune == (2, 4)
    assert sel.keep == (1, 3, 5)
    assert sel.reasons[1] == "pinned: before the 2.0 upgrade"
    assert sel.reasons[3] == "pinned: audit"
    # unpinned, the same history loses them to the policy
    unpinned = [EpochFacts(e.epoch, e.state, e.triggered_at, e.ended_at) for e in history]
    assert select_prunable(unpinned, RetentionPolicy(keep_last=1), NOW).prune == (1, 2, 3, 4)
