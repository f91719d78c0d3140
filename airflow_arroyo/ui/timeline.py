"""Pure: per-stage timing of one epoch, the way Flink's and Arroyo's checkpoint details show it.

For an acknowledged stage, counted from the epoch's trigger::

    |<---------------------- end to end (acked_at - triggered_at) ---------------------->|
    |<-- start delay -->|<-- alignment -->|<-- sync snapshot -->|<-- async snapshot -->|ack

The stage reports alignment, sync and async time; the start delay (the barrier travelling to the
stage, the stage's micro-batch finishing) is what is left. When the reported parts add up to more
than the end-to-end time (clocks of different hosts), the start delay is 0 and the parts are drawn
scaled down to fit, keeping their proportions.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from airflow_arroyo.core.epochs import EpochState
from airflow_arroyo.store.reads import EpochDetail

__all__ = ["StageStatus", "StageTiming", "stage_timings"]


class StageStatus(enum.StrEnum):
    """Where a stage is in an epoch."""
    ACKNOWLEDGED = "acknowledged"
    WAITING = "waiting"  # the epoch is in flight and this stage has not acknowledged yet
    MISSING = "missing"  # the epoch ended without this stage's acknowledgement


@dataclass(frozen=True)
class StageTiming:
    """When a stage acknowledged an epoch and where its time went."""
    stage: str
    status: StageStatus
    end_to_end_s: float | None = None  # for a waiting stage: time since the trigger so far
    start_delay_s: float | None = None
    alignment_s: float | None = None
    sync_s: float | None = None
    async_s: float | None = None
    bytes_new: int | None = None
    bytes_total: int | None = None
    acked_at: datetime | None = None
    snapshot_uri: str | None = None
    # the state as of the stage's cut (recorded with the acknowledgement since issue 33; None before, and
    # state_rows where Spark had not reported the cut batch's progress): 0 bytes for a stage without state
    state_bytes: int | None = None
    state_rows: int | None = None

    @property
    def segments(self) -> list[tuple[str, float, float]]:
        """``(part, start_s, length_s)`` for drawing, in order, fitted into ``end_to_end_s``."""
        if self.status is not StageStatus.ACKNOWLEDGED or self.end_to_end_s is None:
            return []
        parts = [("alignment", self.alignment_s or 0.0), ("sync", self.sync_s or 0.0),
                 ("async", self.async_s or 0.0)]
        reported = sum(length for _, length in parts)
        total = max(self.end_to_end_s, 0.0)
        scale = total / reported if reported > total and reported > 0 else 1.0
        start = self.start_delay_s or 0.0
        out: list[tuple[str, float, float]] = []
        if start > 0:
            out.append(("start_delay", 0.0, start))
        for name, length in parts:
            length *= scale
            if length > 0:
                out.append((name, start, length))
                start += length
        return out


def _ms_to_s(ms: float | None) -> float | None:
    return None if ms is None else float(ms) / 1000.0


def _count(details: dict[str, Any] | None, key: str) -> int | None:
    value = (details or {}).get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def stage_timings(detail: EpochDetail) -> list[StageTiming]:
    """One entry per expected stage, in the pipeline's stage order (then any unexpected acks)."""
    epoch = detail.epoch
    acks = {a.stage: a for a in detail.acks}
    order = list(detail.expected_stages) + [a.stage for a in detail.acks if a.stage not in detail.expected_stages]
    out: list[StageTiming] = []
    for stage in order:
        ack = acks.get(stage)
        if ack is None:
            if epoch.state is EpochState.TRIGGERED:
                out.append(StageTiming(stage, StageStatus.WAITING,
                                       end_to_end_s=max((detail.now - epoch.triggered_at).total_seconds(), 0.0)))
            else:
                out.append(StageTiming(stage, StageStatus.MISSING))
            continue
        e2e = max((ack.acked_at - epoch.triggered_at).total_seconds(), 0.0)
        align, sync, asyn = _ms_to_s(ack.alignment_ms), _ms_to_s(ack.sync_ms), _ms_to_s(ack.async_ms)
        reported = (align or 0.0) + (sync or 0.0) + (asyn or 0.0)
        out.append(StageTiming(
            stage, StageStatus.ACKNOWLEDGED, end_to_end_s=e2e, start_delay_s=max(e2e - reported, 0.0),
            alignment_s=align, sync_s=sync, async_s=asyn, bytes_new=ack.bytes_new,
            bytes_total=ack.bytes_total, acked_at=ack.acked_at, snapshot_uri=ack.snapshot_uri,
            state_bytes=_count(ack.details, "state_bytes"), state_rows=_count(ack.details, "state_rows"),
        ))
    return out
