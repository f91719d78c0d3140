"""Barrier alignment: pure decisions over facts the stage runner already read. No I/O.

A channel reader's micro-batch never crosses a barrier (it ends right after one at the latest), so
after each micro-batch a stage knows, for every aligned input, the batch's end position and whether
the entry just before it is a barrier. From that alone:

* an input whose batch ended right after barrier *n* (with *n* newer than the stage's last cut) has
  **delivered** *n*; it is capped at that position so that it reads nothing past the barrier;
* when every aligned input has delivered *n*, this batch is the stage's **cut** for *n*: the barrier
  goes to the stage's output after this batch's data, the caps are lifted;
* an input that has not delivered *n* is never capped: the stage keeps reading it, so an idle input
  cannot deadlock the others (it delivers *n* as soon as its upstream forwards it).

Feedback (loop) inputs are not aligned (FLIP-16): the iteration head records their positions at its
cut, and its part of epoch *n* completes once barrier *n* came back around the loop
(:func:`feedback_returned`).

Source stages have no channel inputs: they cut at the micro-batch boundary where the driver tells
them an epoch is pending (:func:`source_cut`).

**Unaligned cuts** (Flink's unaligned checkpoints, cheap here because channels are durable logs): once
an epoch has been pending at a channel stage for ``alignment_timeout`` seconds, the stage stops waiting
for its barrier and cuts like a source stage, at its last completed micro-batch
(:func:`unaligned_cut`). Its cursor on each input is that batch's end there, at or before where the
upstream put the barrier: the records in between stay in the upstream channel, which a restore keeps
(it truncates right after the barrier) and the restored reader reads again from the cursor. The
barrier arriving later on an input is old news. Iteration heads (stages with feedback inputs) always
align.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from airflow_arroyo.core.exceptions import ArroyoError, ConfigurationError

__all__ = [
    "AlignmentAction",
    "AlignmentDecision",
    "AlignmentError",
    "InputEnd",
    "decide_alignment",
    "feedback_returned",
    "source_cut",
    "unaligned_cut",
    "validate_alignment_timeout",
]


class AlignmentError(ArroyoError):
    """The barriers on a stage's inputs break the protocol (e.g. two different epochs at once)."""


@dataclass(frozen=True)
class InputEnd:
    """Where one aligned input stands after a micro-batch.

    ``end`` is the batch's end position on the input (the reader has consumed ``[0, end)``);
    ``barrier_epoch`` is the epoch of the entry at ``end - 1`` if that entry is a barrier, else None.
    """

    channel: str
    end: int
    barrier_epoch: int | None = None


class AlignmentAction(enum.StrEnum):
    """What :func:`decide_alignment` tells a stage to do before its next micro-batch."""
    NONE = "none"  # no barrier newer than the last cut: read freely
    ALIGNING = "aligning"  # some inputs delivered barrier n: cap them, keep reading the others
    CUT = "cut"  # every input delivered barrier n: this batch is the cut


@dataclass(frozen=True)
class AlignmentDecision:
    """The answer of :func:`decide_alignment`: the action, its epoch and the caps to write."""
    action: AlignmentAction
    epoch: int | None = None
    caps: Mapping[str, int] = field(default_factory=dict)  # the complete cap set to write: channel -> position
    delivered: tuple[str, ...] = ()
    waiting_for: tuple[str, ...] = ()
    cursors: Mapping[str, int] = field(default_factory=dict)  # on CUT: channel -> position right after barrier n


def decide_alignment(inputs: Sequence[InputEnd], last_cut_epoch: int) -> AlignmentDecision:
    """Is this micro-batch the cut, should some inputs be capped, or neither?

    ``inputs``: every aligned (non-feedback) input of the stage with the batch's end on it.
    ``last_cut_epoch``: the epoch of the stage's last cut (0 before the first; after a restore from
    epoch N, N), so barriers at or below it are old news.
    """
    if not inputs:
        raise AlignmentError("a stage with no aligned input has nothing to align; use source_cut()")
    names = [i.channel for i in inputs]
    if len(set(names)) != len(names):
        raise AlignmentError(f"duplicate inputs {names}: a stage reads each channel once")
    delivered = {i.channel: i for i in inputs if i.barrier_epoch is not None and i.barrier_epoch > last_cut_epoch}
    if not delivered:
        return AlignmentDecision(AlignmentAction.NONE, waiting_for=tuple(names))
    epochs = sorted({i.barrier_epoch for i in delivered.values() if i.barrier_epoch is not None})
    if len(epochs) > 1:
        detail = ", ".join(f"{c}: barrier {i.barrier_epoch} at {i.end - 1}" for c, i in sorted(delivered.items()))
        raise AlignmentError(
            f"inputs delivered different barriers at once ({detail}) after the cut of epoch {last_cut_epoch}; "
            "an input read past a barrier it should have been capped at (were caps.json removed while the stage "
            "ran, or was a channel written by two pipelines?)"
        )
    epoch = epochs[0]
    waiting = tuple(c for c in names if c not in delivered)
    if not waiting:
        return AlignmentDecision(
            AlignmentAction.CUT, epoch=epoch, caps={}, delivered=tuple(names),
            cursors={c: i.end for c, i in delivered.items()},
        )
    return AlignmentDecision(
        AlignmentAction.ALIGNING, epoch=epoch, caps={c: i.end for c, i in delivered.items()},
        delivered=tuple(c for c in names if c in delivered), waiting_for=waiting,
    )


def source_cut(pending_epochs: Iterable[int], last_cut_epoch: int) -> tuple[int, ...]:
    """The epochs a source stage injects at this micro-batch boundary, in order.

    Every pending epoch newer than the last one injected (normally one; several only if the driver
    learned of a newer epoch before the stage reached a boundary). Barriers go out in epoch order.
    """
    return tuple(sorted({e for e in pending_epochs if e > last_cut_epoch}))


def feedback_returned(barrier_positions: Mapping[str, int | None], ends: Mapping[str, int]) -> bool:
    """Has a barrier come back on every feedback input of an iteration head?

    ``barrier_positions``: feedback channel -> index of the barrier on it (None: not there yet);
    ``ends``: feedback channel -> how far the head has read it. The barrier is back once the head's
    read position passed its entry on every feedback channel.
    """
    for channel, end in ends.items():
        pos = barrier_positions.get(channel)
        if pos is None or end <= pos:
            return False
    return True


def validate_alignment_timeout(value: object) -> float | None:
    """``alignment_timeout`` as the driver keeps it: None (always aligned) or seconds >= 0 (0: cut unaligned at
    once); anything else is refused naming the fix."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or value != value or value < 0 \
            or value == float("inf"):
        raise ConfigurationError(
            f"alignment_timeout={value!r}: give the seconds an epoch may wait for its barriers at a channel stage "
            "before the stage cuts unaligned (a number >= 0; 0 cuts unaligned at once), or None to always align"
        )
    return float(value)


def unaligned_cut(pending: Mapping[int, float], last_cut_epoch: int, now: float, timeout: float | None, *,
                  has_feedback: bool = False, has_batch: bool = True) -> tuple[int, ...]:
    """The epochs a channel stage cuts unaligned now, at its last completed micro-batch, in order.

    ``pending``: epoch -> when the stage learned it is in flight (monotonic seconds); ``last_cut_epoch``: the
    newest epoch the stage cut. Nothing while ``timeout`` is None (always aligned), for an iteration head
    (``has_feedback``: its feedback cursors follow FLIP-16), or before the stage completed any batch
    (``has_batch``: no offsets say where its inputs stand). Once the oldest uncut epoch has waited ``timeout``,
    every uncut pending epoch up to the newest due one is cut (barriers go out in epoch order, as a source's).
    """
    if timeout is None or has_feedback or not has_batch:
        return ()
    uncut = {e: since for e, since in pending.items() if e > last_cut_epoch}
    due = [e for e, since in uncut.items() if now - since >= timeout]
    if not due:
        return ()
    newest = max(due)
    return tuple(sorted(e for e in uncut if e <= newest))
