"""Pure: server-side SVG charts (no JavaScript, no external assets: the page works offline).

* :func:`history_chart` - a pipeline's checkpoint history, epochs oldest to newest: duration per
  epoch (bars coloured by state; expired epochs, which last a whole timeout, are clipped and marked
  so that they do not flatten the rest), total checkpoint size (line), bytes new (bars).
* :func:`timeline_chart` - one epoch, one row per stage: start delay, alignment, sync and async
  parts up to the acknowledgement; stages still waiting drawn as a dashed bar up to now.

Every text is escaped; colours are attributes (no inline ``style``), so a strict CSP holds.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime

from markupsafe import Markup, escape

from airflow_arroyo.core.epochs import EpochState
from airflow_arroyo.store.records import EpochRecord
from airflow_arroyo.ui.format import bytes_human, duration_human
from airflow_arroyo.ui.timeline import StageStatus, StageTiming

__all__ = ["PART_COLOURS", "STATE_COLOURS", "duration_ticks", "history_chart", "nice_ticks", "timeline_chart"]

STATE_COLOURS: dict[EpochState, str] = {
    EpochState.COMPLETED: "#16a34a",
    EpochState.TRIGGERED: "#2563eb",
    EpochState.FAILED: "#dc2626",
    EpochState.EXPIRED: "#ea580c",
    EpochState.PRUNING: "#9ca3af",
    EpochState.PRUNED: "#9ca3af",
    EpochState.SUPERSEDED: "#a78bfa",
}
PART_COLOURS: dict[str, str] = {
    "start_delay": "#cbd5e1",
    "alignment": "#f59e0b",
    "sync": "#3b82f6",
    "async": "#10b981",
}
PART_LABELS = {"start_delay": "start delay", "alignment": "alignment", "sync": "sync snapshot",
               "async": "async snapshot"}
_TOTAL_COLOUR = "#7c3aed"
_NEW_COLOUR = "#a78bfa"
_GRID = "#e5e7eb"
_TEXT = "#4b5563"
_FONT = 'font-family="system-ui, sans-serif" font-size="11"'


def nice_ticks(top: float, count: int = 4) -> list[float]:
    """Round tick values from 0 covering ``top``: ``nice_ticks(37)`` -> ``[0, 10, 20, 30, 40]``."""
    if not math.isfinite(top) or top <= 0:
        return [0.0, 1.0]
    raw = top / count
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 2.5, 5, 10) if m * magnitude >= raw)
    n = math.ceil(top / step - 1e-9)
    return [i * step for i in range(n + 1)]


def _bytes_ticks(top: float, count: int = 4) -> list[float]:
    """Ticks on powers of 1024 so that labels read as whole KiB/MiB/GiB."""
    if top <= 0:
        return [0.0, 1.0]
    unit = 1024 ** max(0, math.floor(math.log(top, 1024)))
    ticks = nice_ticks(top / unit, count)
    if unit == 1 and any(t != int(t) for t in ticks):  # no fractions of a byte: "0 B, 0 B, 0 B, 1 B"
        ticks = [float(t) for t in range(0, math.ceil(top) + 1)]
    return [t * unit for t in ticks]


def _num(x: float) -> str:
    return f"{x:.1f}".rstrip("0").rstrip(".")


def _text(x: float, y: float, s: str, *, anchor: str = "start", extra: str = "") -> str:
    return (f'<text x="{_num(x)}" y="{_num(y)}" text-anchor="{anchor}" fill="{_TEXT}" {_FONT}{extra}>'
            f"{escape(s)}</text>")


def _duration_s(e: EpochRecord, now: datetime) -> float | None:
    if e.ended_at is not None:
        return max((e.ended_at - e.triggered_at).total_seconds(), 0.0)
    if e.state is EpochState.TRIGGERED:
        return max((now - e.triggered_at).total_seconds(), 0.0)
    return None


def _y_axis(x0: float, x1: float, y_top: float, height: float, ticks: Sequence[float],
            label: Callable[[float], str]) -> list[str]:
    top = ticks[-1] or 1.0
    out = []
    for t in ticks:
        y = y_top + height - height * t / top
        out.append(f'<line x1="{_num(x0)}" y1="{_num(y)}" x2="{_num(x1)}" y2="{_num(y)}" stroke="{_GRID}"/>')
        out.append(_text(x0 - 6, y + 4, label(t), anchor="end"))
    return out


def _legend(items: Sequence[tuple[str, str]], x: float, y: float) -> list[str]:
    out = []
    for colour, name in items:
        out.append(f'<rect x="{_num(x)}" y="{_num(y - 9)}" width="10" height="10" fill="{colour}"/>')
        out.append(_text(x + 14, y, name))
        x += 22 + 6.5 * len(name)
    return out


_TIME_STEPS = (15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 10800, 21600, 43200, 86400, 172800, 604800)


def duration_ticks(top: float, count: int = 4) -> list[float]:
    """Like :func:`nice_ticks`, on steps a clock reads well above a minute (30 s, 1m, 5m, 1h...)."""
    if not math.isfinite(top) or top <= 60:
        return nice_ticks(top, count)
    step = next((float(st) for st in _TIME_STEPS if top / st <= count), None)
    if step is None:
        return [d * 86400 for d in nice_ticks(top / 86400, count)]
    return [i * step for i in range(math.ceil(top / step - 1e-9) + 1)]


def _axis_duration(t: float) -> str:
    return "0" if t == 0 else duration_human(t)


def _axis_bytes(t: float) -> str:
    return "0" if t == 0 else bytes_human(t)


def _duration_scale(ordered: Sequence[EpochRecord], durations: Sequence[float | None]) -> list[float]:
    """Ticks for the duration panel. Ended epochs that did not expire set the scale: an expired
    epoch lasts a whole timeout and an in-flight one is still growing, so when other epochs exist
    their bars are clipped and marked instead of flattening every other bar."""
    basis = [d for e, d in zip(ordered, durations, strict=True)  # by outcome: a pruned epoch expired too
             if d is not None and (e.outcome or e.state) not in (EpochState.EXPIRED, EpochState.TRIGGERED)]
    if not basis:
        basis = [d for d in durations if d is not None]
    return duration_ticks(max(basis or [1.0]))


@dataclass(frozen=True)
class _Bands:
    """The x axis of the history chart: one band per epoch, a bar centred in each."""

    left: float
    band: float
    bar_w: float

    def bar_x(self, i: int) -> float:
        return self.left + i * self.band + (self.band - self.bar_w) / 2

    def centre(self, i: int) -> float:
        return self.left + i * self.band + self.band / 2


def history_chart(epochs: Sequence[EpochRecord], now: datetime, *, width: int = 960) -> Markup:
    """Three panels over ``epochs`` (any order; drawn oldest to newest): duration per epoch (bars by
    state), total checkpoint size (line), bytes new per epoch (bars)."""
    ordered = sorted(epochs, key=lambda e: e.epoch)
    left, right, top_pad, gap, bottom = 72, 16, 40, 44, 28
    panels = (140, 110, 80)
    height = top_pad + sum(panels) + 2 * gap + bottom
    plot_w = width - left - right
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" class="chart history" viewBox="0 0 {width} {height}" '
             f'width="100%" role="img" aria-label="Checkpoint duration and size per epoch">']
    if not ordered:
        parts.append(_text(width / 2, height / 2, "No epochs yet", anchor="middle"))
        parts.append("</svg>")
        return Markup("".join(parts))

    n = len(ordered)
    bands = _Bands(left, plot_w / n, max(1.0, plot_w / n * 0.7))
    y = top_pad
    parts += _duration_panel(ordered, now, bands, plot_w, y, panels[0])
    y += panels[0] + gap
    parts += _total_panel(ordered, bands, plot_w, y, panels[1])
    y += panels[1] + gap
    parts += _new_panel(ordered, bands, plot_w, y, panels[2])

    label_every = max(1, math.ceil(n / 10))
    for i, e in enumerate(ordered):
        if i % label_every == 0 or i == n - 1:
            parts.append(_text(bands.centre(i), height - 8, str(e.epoch), anchor="middle"))
    parts.append("</svg>")
    return Markup("".join(parts))


def _duration_panel(ordered: Sequence[EpochRecord], now: datetime, bands: _Bands, plot_w: float, y: float,
                    h_panel: float) -> list[str]:
    """Duration per epoch, bars coloured by state; bars above the scale are clipped and marked."""
    left = bands.left
    durations = [_duration_s(e, now) for e in ordered]
    d_ticks = _duration_scale(ordered, durations)
    d_top = d_ticks[-1] or 1.0
    present = sorted({e.state for e in ordered}, key=list(EpochState).index)
    parts = [_text(left, y - 8, "duration", extra=' font-weight="600"')]
    parts += _legend([(STATE_COLOURS[s], s.value) for s in present], left + 70, y - 8)
    parts += _y_axis(left, left + plot_w, y, h_panel, d_ticks, _axis_duration)
    clipped = 0
    for i, (e, d) in enumerate(zip(ordered, durations, strict=True)):
        if d is None:
            continue
        over = d > d_top
        clipped += over
        h = h_panel if over else max(h_panel * d / d_top, 0.5)
        tip = f"epoch {e.epoch} · {e.state.value} · {duration_human(d)}"
        if e.state is EpochState.TRIGGERED:
            tip += " so far"
        if e.failure_reason:
            tip += f" · {e.failure_reason}"
        parts.append(f'<rect x="{_num(bands.bar_x(i))}" y="{_num(y + h_panel - h)}" width="{_num(bands.bar_w)}" '
                     f'height="{_num(h)}" fill="{STATE_COLOURS[e.state]}"><title>{escape(tip)}</title></rect>')
        if over:
            cx = bands.bar_x(i) + bands.bar_w / 2
            parts.append(f'<polygon points="{_num(cx - 4)},{_num(y - 1)} {_num(cx + 4)},{_num(y - 1)} '
                         f'{_num(cx)},{_num(y - 7)}" fill="#111827"><title>{escape(tip)} (off the scale)</title>'
                         "</polygon>")
    if clipped:
        parts.append(_text(left + plot_w, y - 8, f"▲ {clipped} off the scale", anchor="end"))
    return parts


def _total_panel(ordered: Sequence[EpochRecord], bands: _Bands, plot_w: float, y: float,
                 h_panel: float) -> list[str]:
    """Total checkpoint size per epoch: a line, broken where an epoch reported none."""
    left = bands.left
    totals = [float(e.bytes_total) for e in ordered if e.bytes_total is not None]
    t_ticks = _bytes_ticks(max(totals or [1.0]))
    t_top = t_ticks[-1] or 1.0
    parts = [_text(left, y - 8, "checkpoint size (total)", extra=' font-weight="600"')]
    parts += _y_axis(left, left + plot_w, y, h_panel, t_ticks, _axis_bytes)
    if not totals:
        parts.append(_text(left + plot_w / 2, y + h_panel / 2, "no size reported yet", anchor="middle",
                           extra=' class="no-data"'))
    segments: list[list[str]] = [[]]
    for i, e in enumerate(ordered):
        if e.bytes_total is None:
            segments.append([])
            continue
        cx = bands.centre(i)
        cy = y + h_panel - h_panel * e.bytes_total / t_top
        segments[-1].append(f"{_num(cx)},{_num(cy)}")
        tip = f"epoch {e.epoch} · total {bytes_human(e.bytes_total)}"
        parts.append(f'<circle cx="{_num(cx)}" cy="{_num(cy)}" r="{2.5 if len(ordered) <= 120 else 1.5}" '
                     f'fill="{_TOTAL_COLOUR}"><title>{escape(tip)}</title></circle>')
    parts += [f'<polyline points="{" ".join(seg)}" fill="none" stroke="{_TOTAL_COLOUR}" stroke-width="1.5"/>'
              for seg in segments if len(seg) > 1]
    return parts


def _new_panel(ordered: Sequence[EpochRecord], bands: _Bands, plot_w: float, y: float,
               h_panel: float) -> list[str]:
    """Bytes new per epoch (what the incremental snapshot copied): bars."""
    left = bands.left
    news = [float(e.bytes_new) for e in ordered if e.bytes_new is not None]
    n_ticks = _bytes_ticks(max(news or [1.0]), 2)
    n_top = n_ticks[-1] or 1.0
    parts = [_text(left, y - 8, "bytes new (incremental)", extra=' font-weight="600"')]
    parts += _y_axis(left, left + plot_w, y, h_panel, n_ticks, _axis_bytes)
    if not news:
        parts.append(_text(left + plot_w / 2, y + h_panel / 2, "no size reported yet", anchor="middle",
                           extra=' class="no-data"'))
    for i, e in enumerate(ordered):
        if e.bytes_new is None:
            continue
        h = max(h_panel * e.bytes_new / n_top, 0.5)
        tip = f"epoch {e.epoch} · new {bytes_human(e.bytes_new)}"
        parts.append(f'<rect x="{_num(bands.bar_x(i))}" y="{_num(y + h_panel - h)}" width="{_num(bands.bar_w)}" '
                     f'height="{_num(h)}" fill="{_NEW_COLOUR}"><title>{escape(tip)}</title></rect>')
    return parts


def timeline_chart(timings: Sequence[StageTiming], *, epoch_end_s: float | None = None,
                   epoch_end_label: str = "", width: int = 960) -> Markup:
    """One row per stage: where its time to acknowledge went (see :mod:`airflow_arroyo.ui.timeline`)."""
    label_w, right, top_pad, row_h, bottom = 170, 24, 40, 28, 34
    height = top_pad + row_h * max(len(timings), 1) + bottom
    plot_w = width - label_w - right
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" class="chart timeline" viewBox="0 0 {width} {height}" '
             f'width="100%" role="img" aria-label="Per-stage checkpoint timeline">']
    parts += _legend([(PART_COLOURS[k], PART_LABELS[k]) for k in PART_COLOURS], label_w, 14)
    extent = max([t.end_to_end_s or 0.0 for t in timings] + [epoch_end_s or 0.0])
    ticks = duration_ticks(extent if extent > 0 else 1.0, 6)
    span = ticks[-1] or 1.0

    def x_of(s: float) -> float:
        return label_w + plot_w * s / span

    axis_y = top_pad + row_h * max(len(timings), 1)
    for t in ticks:
        x = x_of(t)
        parts.append(f'<line x1="{_num(x)}" y1="{top_pad - 4}" x2="{_num(x)}" y2="{_num(axis_y)}" stroke="{_GRID}"/>')
        parts.append(_text(x, axis_y + 14, _axis_duration(t), anchor="middle"))
    parts.append(_text(label_w + plot_w, axis_y + 28, "time since the epoch was triggered", anchor="end"))

    for row, timing in enumerate(timings):
        y = top_pad + row * row_h
        name = timing.stage if len(timing.stage) <= 24 else timing.stage[:23] + "…"
        parts.append(f'<text x="{label_w - 8}" y="{_num(y + row_h / 2 + 4)}" text-anchor="end" fill="{_TEXT}" '
                     f'{_FONT}><title>{escape(timing.stage)}</title>{escape(name)}</text>')
        bar_y, bar_h = y + 5, row_h - 10
        if timing.status is StageStatus.ACKNOWLEDGED:
            for part, start, length in timing.segments:
                tip = f"{timing.stage} · {PART_LABELS[part]} {duration_human(length)}"
                parts.append(f'<rect x="{_num(x_of(start))}" y="{_num(bar_y)}" '
                             f'width="{_num(max(plot_w * length / span, 1.0))}" height="{_num(bar_h)}" '
                             f'fill="{PART_COLOURS[part]}"><title>{escape(tip)}</title></rect>')
            end = timing.end_to_end_s or 0.0
            parts.append(f'<line x1="{_num(x_of(end))}" y1="{_num(bar_y - 2)}" x2="{_num(x_of(end))}" '
                         f'y2="{_num(bar_y + bar_h + 2)}" stroke="#111827" stroke-width="1.5">'
                         f"<title>{escape(f'{timing.stage} acknowledged after {duration_human(end)}')}</title></line>")
        elif timing.status is StageStatus.WAITING:
            end = timing.end_to_end_s or 0.0
            parts.append(f'<rect x="{_num(x_of(0))}" y="{_num(bar_y)}" width="{_num(max(plot_w * end / span, 1.0))}" '
                         f'height="{_num(bar_h)}" fill="#dbeafe" stroke="#2563eb" stroke-dasharray="4 3">'
                         f"<title>{escape(f'{timing.stage} has not acknowledged yet')}</title></rect>")
            parts.append(_text(x_of(end) + 6 if end / span < 0.8 else x_of(end) - 6, bar_y + bar_h / 2 + 4,
                               f"waiting {duration_human(end)}",
                               anchor="start" if end / span < 0.8 else "end"))
        else:
            parts.append(_text(x_of(0) + 4, bar_y + bar_h / 2 + 4, "no acknowledgement"))
    if epoch_end_s is not None:
        x = x_of(epoch_end_s)
        parts.append(f'<line x1="{_num(x)}" y1="{top_pad - 6}" x2="{_num(x)}" y2="{_num(axis_y)}" '
                     f'stroke="#111827" stroke-dasharray="2 2"/>')
        if epoch_end_label:
            parts.append(_text(x, top_pad - 10, epoch_end_label,
                               anchor="end" if epoch_end_s / span > 0.5 else "start"))
    parts.append("</svg>")
    return Markup("".join(parts))
