"""Byte counts and durations for people, the same on every surface: the CLI's tables, the UI, task and
trigger logs. Pure."""

from __future__ import annotations

__all__ = ["bytes_human", "duration_human"]

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def bytes_human(n: int | float | None, missing: str = "–") -> str:
    """``1536`` -> ``"1.5 KiB"``; ``None`` -> ``missing``."""
    if n is None:
        return missing
    value = float(n)
    sign = "-" if value < 0 else ""
    value = abs(value)
    for unit in _UNITS:
        if value < 1024 or unit == _UNITS[-1]:
            if unit == "B":
                return f"{sign}{int(value)} B"
            return f"{sign}{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def duration_human(seconds: float | None, missing: str = "–") -> str:
    """``0.25`` -> ``"250 ms"``, ``75`` -> ``"1m 15s"``, ``90061`` -> ``"1d 1h"``; ``None`` -> ``missing``."""
    if seconds is None:
        return missing
    s = float(seconds)
    sign = "-" if s < 0 else ""
    s = abs(s)
    if s < 1:
        return f"{sign}{s * 1000:.0f} ms"
    if s < 60:
        return f"{sign}{s:.1f} s" if s < 10 else f"{sign}{s:.0f} s"
    minutes, sec = divmod(int(round(s)), 60)
    if minutes < 60:
        return f"{sign}{minutes}m {sec}s" if sec else f"{sign}{minutes}m"
    hours, minutes = divmod(minutes, 60)
    if hours < 24:
        return f"{sign}{hours}h {minutes}m" if minutes else f"{sign}{hours}h"
    days, hours = divmod(hours, 24)
    return f"{sign}{days}d {hours}h" if hours else f"{sign}{days}d"
