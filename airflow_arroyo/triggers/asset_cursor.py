"""An Asset watcher's position, kept in the Asset's state store so that a restarted triggerer resumes after the
last event it handed over.

Airflow >= 3.3 gives an event trigger run by an ``AssetWatcher`` an ``asset_state_store``; before that there is
none, and a watcher starts from the present. Both of this package's watchers (sink commits and completed epochs,
:class:`~airflow_arroyo.assets.CommittedDataTrigger`; gates opened,
:class:`~airflow_arroyo.triggers.gates.GateOpenedTrigger`) keep their position this one way.
"""

from __future__ import annotations

__all__ = ["CURSOR_KEY", "AssetCursor"]

CURSOR_KEY = "arroyo_cursor"


class AssetCursor:
    """Mixin of an event trigger: its position (an integer sequence number) in the Asset's state store."""

    async def _load_cursor(self) -> int | None:
        state = getattr(self, "asset_state_store", None)
        if state is None:
            return None
        value = await state.aget(CURSOR_KEY)
        return int(value) if isinstance(value, int | str) and str(value).lstrip("-").isdigit() else None

    async def _save_cursor(self, value: int) -> None:
        state = getattr(self, "asset_state_store", None)
        if state is not None:
            await state.aset(CURSOR_KEY, value)
