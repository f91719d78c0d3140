"""Run a trigger to its first event in the calling thread: the non-deferrable mode of the operators.

An operator with ``deferrable=False`` waits in its worker slot with the very trigger it would defer
to, so both modes apply the same checks (deadline, a spark-submit that died, a failed pipeline) and
end with the same event, which the operator's ``execute_complete`` handles.
"""

from __future__ import annotations

import asyncio
from typing import Any

from airflow.triggers.base import BaseTrigger

__all__ = ["run_inline"]


def run_inline(trigger: BaseTrigger) -> dict[str, Any]:
    """The payload of the trigger's first event (the trigger's generator is closed afterwards)."""

    async def first() -> dict[str, Any]:
        events = trigger.run()
        try:
            async for event in events:
                return dict(event.payload)
        finally:
            await events.aclose()  # type: ignore[attr-defined]
        raise RuntimeError(f"{type(trigger).__name__} ended without an event")

    return asyncio.run(first())
