"""Pure formatting helpers for the UI (also registered as template filters)."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from datetime import UTC, datetime
from typing import Any

from airflow_arroyo.core.units import bytes_human, duration_human

__all__ = ["age", "bytes_human", "duration_human", "epoch_ranges", "offsets", "policy_text", "timestamp"]

def age(then: datetime | None, now: datetime) -> str:
    """How long ago ``then`` was, relative to ``now`` (the database's clock): ``"3m 5s ago"``."""
    if then is None:
        return "never"
    delta = (now - then).total_seconds()
    if delta < 0:
        return f"in {duration_human(-delta)}"
    return f"{duration_human(delta)} ago"


def timestamp(value: datetime | None) -> str:
    """An ISO-like UTC timestamp to the second: ``"2024-05-01 12:00:03 UTC"``."""
    if value is None:
        return "–"
    if value.tzinfo is not None:
        value = value.astimezone(UTC)
        return value.strftime("%Y-%m-%d %H:%M:%S UTC")
    return value.strftime("%Y-%m-%d %H:%M:%S")


def epoch_ranges(epochs: Iterable[int]) -> str:
    """Compact, sorted ranges: ``[5, 1, 2, 3, 7]`` -> ``"1–3, 5, 7"``; nothing -> ``"none"``."""
    ordered = sorted(set(int(e) for e in epochs))
    if not ordered:
        return "none"
    parts: list[str] = []
    start = prev = ordered[0]
    for e in ordered[1:]:
        if e == prev + 1:
            prev = e
            continue
        parts.append(f"{start}" if start == prev else f"{start}–{prev}")
        start = prev = e
    parts.append(f"{start}" if start == prev else f"{start}–{prev}")
    return ", ".join(parts)


_DURATION_KEYS = ("keep_newer_than_s", "max_age_s")


def policy_text(policy: Mapping[str, Any] | None) -> str:
    """A cleanup run's retention policy in words: ``{"keep_last": 3, "keep_newer_than_s": 86400}`` ->
    ``"keep the last 3 completed or those newer than 1d"``; unset rules are left out."""
    rules: list[str] = []
    other: list[str] = []
    for key, value in sorted((policy or {}).items()):
        if value is None:
            continue
        if key == "keep_last":
            rules.append(f"the last {value} completed")
        elif key in _DURATION_KEYS and isinstance(value, int | float):
            rules.append(f"those newer than {duration_human(float(value))}")
        else:
            other.append(f"{key.replace('_', ' ')}: {value}")
    text = f"keep {' or '.join(rules)}" if rules else ""
    return "; ".join(([text] if text else []) + other) or "–"


def offsets(value: Mapping[str, Any] | None) -> str:
    """A source's offsets as its own compact JSON (``{"orders":{"0":12,"1":9}}``); ``–`` for none."""
    return "–" if value is None else json.dumps(value, sort_keys=True, separators=(",", ":"))
