"""Barrier alignment decisions (pure): table cases plus a property-based simulation of readers that
never cross a barrier, honour caps and advance by arbitrary amounts."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from airflow_arroyo.runtime.alignment import (
    AlignmentAction,
    AlignmentError,
    InputEnd,
    decide_alignment,
    feedback_returned,
    source_cut,
)


def test_no_barrier_means_read_freely() -> None:
    d = decide_alignment([InputEnd("a", 5), InputEnd("b", 3)], last_cut_epoch=0)
    assert d.action is AlignmentAction.NONE
    assert d.caps == {}


def test_old_barrier_is_not_delivered_again() -> None:
    # after a restore from epoch 4 both readers sit right after barrier 4
    d = decide_alignment([InputEnd("a", 7, barrier_epoch=4), InputEnd("b", 2, barrier_epoch=4)], last_cut_epoch=4)
    assert d.action is AlignmentAction.NONE


def test_one_input_delivered_is_capped_other_keeps_reading() -> None:
    d = decide_alignment([InputEnd("a", 7, barrier_epoch=5), InputEnd("b", 3)], last_cut_epoch=4)
    assert d.action is AlignmentAction.ALIGNING
    assert d.epoch == 5
    assert d.caps == {"a": 7}
    assert d.waiting_for == ("b",)


def test_all_delivered_is_the_cut_and_lifts_caps() -> None:
    d = decide_alignment([InputEnd("a", 7, barrier_epoch=5), InputEnd("b", 9, barrier_epoch=5)], last_cut_epoch=4)
    assert d.action is AlignmentAction.CUT
    assert d.epoch == 5
    assert d.caps == {}
    assert d.cursors == {"a": 7, "b": 9}


def test_single_input_cuts_on_its_barrier() -> None:
    d = decide_alignment([InputEnd("a", 1, barrier_epoch=1)], last_cut_epoch=0)
    assert (d.action, d.epoch, dict(d.cursors)) == (AlignmentAction.CUT, 1, {"a": 1})


def test_different_epochs_at_once_is_a_protocol_error() -> None:
    with pytest.raises(AlignmentError, match="different barriers"):
        decide_alignment([InputEnd("a", 7, barrier_epoch=5), InputEnd("b", 9, barrier_epoch=6)], last_cut_epoch=4)


def test_no_inputs_is_an_error() -> None:
    with pytest.raises(AlignmentError):
        decide_alignment([], last_cut_epoch=0)


def test_source_cut_injects_pending_epochs_in_order() -> None:
    assert source_cut([7, 6, 5], last_cut_epoch=5) == (6, 7)
    assert source_cut([], last_cut_epoch=5) == ()


def test_feedback_returned_needs_every_feedback_input_past_its_barrier() -> None:
    assert not feedback_returned({"loop": None}, {"loop": 10})
    assert not feedback_returned({"loop": 10}, {"loop": 10})
    assert feedback_returned({"loop": 10}, {"loop": 11})
    assert not feedback_returned({"x": 4, "y": None}, {"x": 9, "y": 9})


# ----------------------------------------------------------------------------- simulation

# A channel is a list of entries: "d" (data) or an int (a barrier of that epoch). Every channel
# carries the same barriers in the same order (every stage forwards every barrier).
channel_logs = st.integers(min_value=1, max_value=4).flatmap(
    lambda n_inputs: st.tuples(
        st.integers(min_value=1, max_value=3),  # epochs
        st.lists(st.lists(st.integers(0, 4), min_size=4, max_size=4), min_size=n_inputs, max_size=n_inputs),
    )
)


def _build(epochs: int, gaps: list[list[int]]) -> list[list[object]]:
    logs = []
    for per_input in gaps:
        log: list[object] = []
        for e in range(1, epochs + 1):
            log.extend(["d"] * per_input[e - 1])
            log.append(e)
        log.extend(["d"] * per_input[-1])
        logs.append(log)
    return logs


@settings(max_examples=300, deadline=None)
@given(channel_logs, st.randoms(use_true_random=False))
def test_simulated_alignment_cuts_exactly_on_all_barriers(spec: tuple[int, list[list[int]]], rnd) -> None:
    epochs, gaps = spec
    logs = _build(epochs, gaps)
    names = [f"in{i}" for i in range(len(logs))]
    pos = dict.fromkeys(names, 0)
    caps: dict[str, int] = {}
    last_cut = 0
    cuts: list[tuple[int, dict[str, int]]] = []
    for _ in range(500):
        # one micro-batch: every input advances by a random amount, within its cap, never past a barrier
        advanced = False
        for name, log in zip(names, logs, strict=True):
            limit = min(len(log), caps.get(name, len(log)))
            start = pos[name]
            end = start
            for _ in range(rnd.randint(1, 3)):  # a read limit never cuts below one entry
                if end >= limit:
                    break
                end += 1
                if isinstance(log[end - 1], int):
                    break  # the reader stops right after a barrier
            advanced |= end != start
            pos[name] = end
        if not advanced:
            # Spark runs no batch without new input: every reader must then be at the end of its log
            # (a reader held at a cap with nothing else to read would be a deadlock)
            assert all(pos[n] == len(log) for n, log in zip(names, logs, strict=True)), (pos, caps)
            break
        ends = [
            InputEnd(n, pos[n], log[pos[n] - 1] if pos[n] > 0 and isinstance(log[pos[n] - 1], int) else None)
            for n, log in zip(names, logs, strict=True)
        ]
        d = decide_alignment(ends, last_cut)
        # invariant: no input ever read past a barrier newer than the last cut + 1
        for n, log in zip(names, logs, strict=True):
            consumed_barriers = [x for x in log[: pos[n]] if isinstance(x, int)]
            assert all(b <= last_cut + 1 for b in consumed_barriers), (n, consumed_barriers, last_cut)
        if d.action is AlignmentAction.CUT:
            assert d.epoch == last_cut + 1
            for n, log in zip(names, logs, strict=True):
                assert log[pos[n] - 1] == d.epoch  # ends exactly on the barrier on every input
            cuts.append((d.epoch, dict(d.cursors)))
            last_cut = d.epoch
        caps = dict(d.caps)
    # no deadlock: every epoch was cut, in order
    assert [e for e, _ in cuts] == list(range(1, epochs + 1))
    for e, cursors in cuts:
        for n, log in zip(names, logs, strict=True):
            assert log[cursors[n] - 1] == e
