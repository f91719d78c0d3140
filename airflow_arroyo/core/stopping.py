"""Stopping a pipeline, once for every surface: ``airflow-arroyo stop`` and :class:`~airflow_arroyo.operators.
StopPipelineOperator` ask, wait and pin through these steps and only choose how to report. Airflow-free.

1. :func:`check_stop` — the mode and the pin label, refused before anything is asked;
2. :func:`request_stop` — asks the live run to stop; a failed run whose supervisor would restart it has that
   restart cancelled; an ended run is left alone (the outcome says which). An immediate request already made
   is never turned back into a graceful one;
3. :func:`wait_until_ended` — polls until that run has ended (the operator may wait in the triggerer instead);
4. :func:`finish_stop` — the latest completed epoch, whether it is the run's final epoch, and the pin.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from airflow_arroyo.core.epochs import PipelineState
from airflow_arroyo.core.exceptions import ConfigurationError
from airflow_arroyo.core.supervision import restart_pending

if TYPE_CHECKING:
    from airflow_arroyo.store import EpochRecord, EpochStore, PipelineRecord

__all__ = ["RunEnd", "StopAsked", "StopOutcome", "StopRequest", "check_stop", "finish_stop", "request_stop",
           "wait_until_ended"]

_MODES = ("graceful", "immediate")


def check_stop(mode: str, pin_label: str | None = None) -> str:
    """The stop mode, normalised; :class:`ConfigurationError` for an unknown mode, a pin with an immediate
    stop (it takes no final epoch) or a bad pin label."""
    from airflow_arroyo.store import EpochStore

    text = str(mode).strip().lower()
    if text not in _MODES:
        raise ConfigurationError(
            f"stop mode must be 'graceful' (a final epoch, then stop) or 'immediate' (stop now), got {mode!r}")
    if pin_label is not None:
        if text == "immediate":
            raise ConfigurationError("a pin label pins the final epoch of a graceful stop; an immediate stop takes "
                                     "none: stop gracefully or drop the pin label")
        EpochStore.check_pin_label(pin_label)
    return text


class StopAsked(enum.StrEnum):
    """What :func:`request_stop` did."""

    REQUESTED = "requested"  # the live run was asked to stop
    ALREADY_REQUESTED = "already_requested"  # it had been asked before; the request stands (made immediate)
    RESTART_CANCELLED = "restart_cancelled"  # the run had failed; its supervisor's restart is cancelled
    ENDED = "ended"  # the run had ended (or none ran): nothing was asked


@dataclass(frozen=True)
class StopRequest:
    """The answer of :func:`request_stop`: what was done, the pipeline's record after it, the mode in force
    and the request made before this one (None: none)."""

    asked: StopAsked
    pipeline: PipelineRecord
    mode: str
    previous: str | None = None


def request_stop(store: EpochStore, pipeline_id: str, mode: str) -> StopRequest:
    """Ask the current run of ``pipeline_id`` to stop (``mode`` as :func:`check_stop` returned it)."""
    current = store.get_pipeline(pipeline_id)
    if current.state is PipelineState.FAILED and restart_pending(current):
        # a stopped run is never restarted, though its supervisor may still read "watching" for a moment
        return StopRequest(StopAsked.RESTART_CANCELLED, store.request_stop(pipeline_id, mode), mode)
    if current.state.terminal:
        return StopRequest(StopAsked.ENDED, current, mode)
    previous = current.stop_requested
    in_force = "immediate" if previous == "immediate" else mode
    record = store.request_stop(pipeline_id, in_force)
    asked = StopAsked.REQUESTED if previous is None else StopAsked.ALREADY_REQUESTED
    return StopRequest(asked, record, in_force, previous)


@dataclass(frozen=True)
class RunEnd:
    """What :func:`wait_until_ended` saw: the run's last record read, whether the run ended, and the run that
    registered after it (then it ended, though its own record, replaced, was last read unended)."""

    record: PipelineRecord
    ended: bool
    superseded_by: str | None = None


def wait_until_ended(store: EpochStore, run: PipelineRecord, seconds: float, poll: float = 0.5) -> RunEnd:
    """Poll until the run of ``run`` (a pipeline's record) has ended, at most ``seconds``."""
    deadline = time.monotonic() + max(0.0, seconds)
    record = run
    while not record.state.terminal and time.monotonic() < deadline:
        time.sleep(min(poll, max(0.0, deadline - time.monotonic())))
        record = store.get_pipeline(run.pipeline_id)
        if record.run_id != run.run_id:
            return RunEnd(run, True, record.run_id)
    return RunEnd(record, record.state.terminal)


@dataclass(frozen=True)
class StopOutcome:
    """After a run ended: the latest completed epoch, whether it is a final epoch, and the epoch pinned."""

    latest_epoch: int | None
    final_epoch: int | None
    pinned: EpochRecord | None = None


def finish_stop(store: EpochStore, pipeline_id: str, run_id: str | None, pin_label: str | None = None,
                *, ended: bool = True) -> StopOutcome:
    """The latest completed epoch of ``pipeline_id`` and, when ``pin_label`` is given and the run ``ended``,
    pin that run's final epoch (:meth:`EpochStore.pin_final_epoch`, whose :class:`ConfigurationError` names
    the epoch that can be pinned instead when the run took no final epoch)."""
    latest = store.latest_completed_epoch(pipeline_id)
    pinned = store.pin_final_epoch(pipeline_id, run_id, pin_label) if pin_label is not None and ended else None
    return StopOutcome(latest.epoch if latest is not None else None,
                       latest.epoch if latest is not None and latest.is_final else None, pinned)
