"""Pure: a checkpoint summary like Flink's checkpoint tab (count, and p50/p99 of duration and size).

Shared by the checkpoint task's log line and the UI's pipeline page. No I/O, no Airflow.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

__all__ = ["CheckpointSummary", "percentile", "summarize"]


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0-100) by the nearest-rank method; None for no values.

    Nearest rank (not interpolation): the figure is always a value that was measured, and p99 of
    fewer than 100 values is the largest, as Flink shows it.
    """
    if not values:
        return None
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be within 0..100, got {q}")
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


@dataclass(frozen=True)
class CheckpointSummary:
    """Counts and figures over a pipeline's epoch history."""
    completed: int
    failed: int
    expired: int
    duration_p50_s: float | None
    duration_p99_s: float | None
    size_p50: float | None
    size_p99: float | None


def summarize(epochs: Iterable[tuple[str, float | None, int | None]]) -> CheckpointSummary:
    """From ``(state, duration_s, bytes_total)`` of ended epochs: counts per outcome, and the p50/p99
    duration and size of the **completed** ones (a failed epoch's duration says little)."""
    counts = {"completed": 0, "failed": 0, "expired": 0}
    durations: list[float] = []
    sizes: list[float] = []
    for state, duration, size in epochs:
        if state in counts:
            counts[state] += 1
        if state != "completed":
            continue
        if duration is not None:
            durations.append(float(duration))
        if size is not None:
            sizes.append(float(size))
    return CheckpointSummary(
        completed=counts["completed"], failed=counts["failed"], expired=counts["expired"],
        duration_p50_s=percentile(durations, 50), duration_p99_s=percentile(durations, 99),
        size_p50=percentile(sizes, 50), size_p99=percentile(sizes, 99),
    )
