"""Hold a trigger's event until the task's deferral has settled in the scheduler.

**Why.** Airflow's scheduler can fail a healthy deferred task (apache/airflow#66374, #67287, #71580,
#72716: "finished with state success, but the task instance's state attribute is queued"). When a
task defers, its worker exits cleanly and the executor reports ``success`` for that try. If the
trigger fires *before* the scheduler has read that report, the task instance is already
``scheduled``/``queued``/``running`` again (same try number) when the stale ``success`` arrives, and
the scheduler takes it for a task killed externally: the task fails, and with it the DAG run.
Airflow 3.2.2 ignores the stale report for ``scheduled`` only; the ``queued`` case was fixed after
3.3.2 and the ``running`` case is still open.

**What we do.** Two things, in every deferrable task of this package:

1. *No round trip when the work is done*: the task looks first, in the worker, and returns without
   deferring when the pipeline is already where the task wants it (the sensor, the stop operator,
   which also waits a little in the worker for a stop to complete).
2. *No event before the deferral settled*: the operator passes ``not_before`` (the time it deferred
   plus :data:`DEFER_SETTLE_S`) and the trigger holds an event it reaches earlier until then. The
   stale report comes when the worker's supervisor exits (well under a second here) and the
   scheduler reads it at its next loop (about a second), so the task is still ``deferred`` when the
   report is read and nothing is failed. A trigger that fires later than that (almost all of them:
   a pipeline takes seconds to register, an epoch an interval) is not delayed at all.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

__all__ = ["DEFER_SETTLE_S", "hold_until", "settle_deadline"]

#: Seconds after a deferral before which a trigger of this package yields no event.
DEFER_SETTLE_S = 10.0


def settle_deadline(now: float | None = None, settle: float | None = None) -> float:
    """``not_before`` for a trigger deferred now (UNIX seconds); ``settle`` defaults to
    :data:`DEFER_SETTLE_S` (read at call time)."""
    return (time.time() if now is None else now) + (DEFER_SETTLE_S if settle is None else settle)


async def hold_until(not_before: float | None, log: Any = None, pipeline_id: str = "") -> float:
    """Sleep until ``not_before`` (UNIX seconds) if it is still ahead, saying so on ``log``; returns
    the seconds held."""
    if not_before is None:
        return 0.0
    delay = float(not_before) - time.time()
    if delay <= 0:
        return 0.0
    if log is not None:
        log.info("pipeline %s: event held %.1fs until the deferral settled (apache/airflow#67287)", pipeline_id,
                 delay)
    await asyncio.sleep(delay)
    return delay
