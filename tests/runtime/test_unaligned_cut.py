"""Unaligned cuts (issue 34, deliverable 3), pure: when a channel stage stops waiting for its barriers, and a
simulation of readers that never cross a barrier, honour caps and are cut unaligned at random, checking what a
restore and channel retention rely on: every cursor is at or before its epoch's barrier on its input."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from airflow_arroyo.core.exceptions import ConfigurationError
from airflow_arroyo.runtime.alignment import (
    AlignmentAction,
    InputEnd,
    decide_alignment,
    unaligned_cut,
    validate_alignment_timeout,
)
from tests.runtime.test_alignment import _build as _logs  # per input: data entries ("d") and barriers (ints)


def test_no_timeout_means_always_aligned() -> None:
    assert unaligned_cut({5: 0.0}, last_cut_epoch=4, now=1e9, timeout=None) == ()


def test_an_epoch_is_cut_unaligned_once_it_waited_the_timeout() -> None:
    assert unaligned_cut({5: 10.0}, last_cut_epoch=4, now=11.9, timeout=2.0) == ()
    assert unaligned_cut({5: 10.0}, last_cut_epoch=4, now=12.0, timeout=2.0) == (5,)
    assert unaligned_cut({5: 10.0}, last_cut_epoch=4, now=10.0, timeout=0.0) == (5,)


def test_epochs_already_cut_are_not_cut_again() -> None:
    assert unaligned_cut({5: 0.0}, last_cut_epoch=5, now=100.0, timeout=0.0) == ()


def test_every_uncut_epoch_up_to_the_newest_due_one_goes_out_in_order() -> None:
    # 6 is due; 5 (requested earlier, same timeout) is too; 7 is not yet: barriers leave in epoch order
    assert unaligned_cut({7: 9.5, 5: 0.0, 6: 1.0}, last_cut_epoch=4, now=10.0, timeout=5.0) == (5, 6)


def test_an_iteration_head_and_a_stage_with_no_batch_yet_always_align() -> None:
    assert unaligned_cut({5: 0.0}, last_cut_epoch=4, now=100.0, timeout=0.0, has_feedback=True) == ()
    assert unaligned_cut({5: 0.0}, last_cut_epoch=4, now=100.0, timeout=0.0, has_batch=False) == ()


@pytest.mark.parametrize("value", [-1, -0.001, math.nan, math.inf, "5", True, [1]])
def test_bad_timeouts_are_refused_naming_the_fix(value: object) -> None:
    with pytest.raises(ConfigurationError, match="alignment_timeout=.*a number >= 0.*None to always align"):
        validate_alignment_timeout(value)


@pytest.mark.parametrize(("value", "kept"), [(None, None), (0, 0.0), (2, 2.0), (0.5, 0.5)])
def test_good_timeouts_are_kept_as_seconds(value: object, kept: float | None) -> None:
    assert validate_alignment_timeout(value) == kept


# ----------------------------------------------------------------------------- simulation

def _barrier_at(log: list[object], index: int) -> int | None:
    entry = log[index] if index >= 0 else None
    return entry if isinstance(entry, int) else None


def _retain(log: list[object], low: int) -> list[tuple[int, object]]:
    """What channel retention keeps of ``log`` for a low watermark ``low`` (core/retention.py: the entries from
    ``low - 1`` on)."""
    return [(i, x) for i, x in enumerate(log) if i >= max(0, low - 1)]


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 4), st.integers(1, 3), st.data(), st.randoms(use_true_random=False))
def test_simulated_unaligned_cuts_keep_every_record_exactly_once(n_inputs: int, epochs: int, data: st.DataObject,
                                                                 rnd: random.Random) -> None:
    gaps = data.draw(st.lists(st.lists(st.integers(0, 4), min_size=epochs + 1, max_size=epochs + 1),
                              min_size=n_inputs, max_size=n_inputs))
    logs = _logs(epochs, gaps)
    names = [f"in{i}" for i in range(len(logs))]
    pos = dict.fromkeys(names, 0)
    caps: dict[str, int] = {}
    last_cut = 0
    cuts: list[tuple[int, dict[str, int], bool]] = []
    for _ in range(500):
        advanced = False
        for name, log in zip(names, logs, strict=True):
            limit = min(len(log), caps.get(name, len(log)))
            end = pos[name]
            for _ in range(rnd.randint(1, 3)):
                if end >= limit:
                    break
                end += 1
                if isinstance(log[end - 1], int):
                    break  # the reader stops right after a barrier
            advanced |= end != pos[name]
            pos[name] = end
        ends = [InputEnd(n, pos[n], _barrier_at(log, pos[n] - 1)) for n, log in zip(names, logs, strict=True)]
        d = decide_alignment(ends, last_cut)  # never a protocol error, whatever was cut unaligned before
        if d.action is AlignmentAction.CUT:
            cuts.append((d.epoch or 0, dict(d.cursors), False))
            last_cut, caps = d.epoch or 0, {}
        else:
            caps = dict(d.caps)
            # the next epoch was requested; whether it waited past the timeout is chance
            due = unaligned_cut({last_cut + 1: 0.0}, last_cut, now=rnd.choice([0.0, 1.0]), timeout=1.0) \
                if last_cut < epochs else ()
            for e in due:
                cuts.append((e, dict(pos), True))
                last_cut, caps = e, {}
        if not advanced and last_cut == epochs:
            assert all(pos[n] == len(log) for n, log in zip(names, logs, strict=True)), (pos, caps)
            break
    assert [e for e, _, _ in cuts] == list(range(1, epochs + 1))
    previous = dict.fromkeys(names, 0)
    for e, cursors, unaligned in cuts:
        for n, log in zip(names, logs, strict=True):
            barrier = log.index(e)
            assert previous[n] <= cursors[n] <= barrier + 1, (n, e, cursors[n], barrier)
            if not unaligned:
                assert cursors[n] == barrier + 1
            previous[n] = cursors[n]
            # what the stage read before its cut is the log before its cursor; a restore of e truncates the input
            # right after barrier e and the stage reads again from its cursor: every data entry of the upstream's
            # epochs <= e once, whatever retention (keyed on the oldest retained cursor) deleted before it
            kept = dict(_retain(log, cursors[n]))
            replayed = [i for i in range(cursors[n], barrier + 1) if log[i] == "d"]
            assert all(i in kept for i in replayed) and barrier in kept
            before = [i for i in range(cursors[n]) if log[i] == "d"]
            assert sorted(before + replayed) == [i for i in range(barrier + 1) if log[i] == "d"]


# ----------------------------------------------------------------------------- where users give it

def test_the_driver_refuses_a_bad_timeout_before_anything(monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    from typing import Any, cast

    from airflow_arroyo.runtime import driver
    from airflow_arroyo.runtime.pipeline import Pipeline

    with pytest.raises(ConfigurationError, match="alignment_timeout=-1"):
        # no store, no Spark: refused before either is touched
        driver.PipelineDriver(Pipeline("p"), cast(Any, None), storage_uri="/nowhere", alignment_timeout=-1)
    monkeypatch.setenv("ARROYO_DSN", "postgresql://nobody@127.0.0.1:1/none")  # never connected to
    code = driver.main(["--pipeline", "tests.runtime.test_unaligned_exactly_once:pipeline", "--arg", "pipeline_id=p",
                        "--arg", "root=/nowhere", "--arg", "rows=1", "--arg", "rate=1", "--arg", "delay=0",
                        "--storage-uri", "/nowhere", "--alignment-timeout", "-1"])
    assert code == 2
    assert "alignment_timeout=-1.0: give the seconds" in capsys.readouterr().err
