"""Pure parts of the UI: SVG charts (well-formed, proportional, escaped), the per-stage timeline,
and the formatting helpers."""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from airflow_arroyo.core.epochs import EpochState
from airflow_arroyo.store.reads import EpochDetail
from airflow_arroyo.store.records import AckRecord, EpochRecord, PipelineRecord
from airflow_arroyo.ui.charts import STATE_COLOURS, duration_ticks, history_chart, nice_ticks, timeline_chart
from airflow_arroyo.ui.format import age, bytes_human, duration_human, epoch_ranges
from airflow_arroyo.ui.timeline import StageStatus, stage_timings

SVG = "{http://www.w3.org/2000/svg}"
T0 = datetime(2024, 5, 1, 12, 0, 0, tzinfo=UTC)


def epoch(n: int, state: EpochState, duration: float | None, *, total: int | None = None, new: int | None = None,
          reason: str | None = None) -> EpochRecord:
    start = T0 + timedelta(seconds=30 * n)
    return EpochRecord("p", n, state, triggered_at=start, timeout_at=start + timedelta(seconds=300),
                       ended_at=None if duration is None else start + timedelta(seconds=duration),
                       bytes_total=total, bytes_new=new, failure_reason=reason, stages=["a", "b"])


def svg_tree(markup: str) -> ET.Element:
    return ET.fromstring(str(markup))  # raises on anything that is not well-formed


def duration_bars(root: ET.Element) -> list[tuple[str, float, str]]:
    """(title, height, fill) of the duration panel's bars."""
    out = []
    for rect in root.iter(f"{SVG}rect"):
        title = rect.find(f"{SVG}title")
        if title is not None and re.match(r"epoch \d+ · [a-z]+ · ", title.text or ""):
            out.append((title.text or "", float(rect.get("height", "0")), rect.get("fill", "")))
    return out


# --------------------------------------------------------------------------- nice_ticks


@settings(max_examples=500, deadline=None)
@given(st.floats(min_value=1e-6, max_value=1e15), st.integers(2, 8))
def test_nice_ticks(top: float, count: int) -> None:
    ticks = nice_ticks(top, count)
    assert ticks[0] == 0 and ticks[-1] >= top * (1 - 1e-9)
    steps = {round(b - a, 9 - len(str(int(top)))) for a, b in zip(ticks, ticks[1:], strict=False)}
    assert len(ticks) >= 2
    assert len(steps) == 1  # evenly spaced
    assert len(ticks) <= 2 * count + 2
    assert ticks[-2] < top  # no tick wasted past the data


@settings(max_examples=300, deadline=None)
@given(st.floats(min_value=1e-3, max_value=1e8))
def test_duration_ticks(top: float) -> None:
    ticks = duration_ticks(top)
    assert ticks[0] == 0 and ticks[-1] >= top * (1 - 1e-9) and ticks[-2] < top
    step = ticks[1] - ticks[0]
    if top > 60:
        assert step % 15 == 0 or step % 86400 == 0  # whole quarter-minutes or days: readable on a clock
    assert len(ticks) <= 10


def test_duration_ticks_examples() -> None:
    assert duration_ticks(150) == [0, 60, 120, 180]
    assert duration_ticks(40) == [0, 10, 20, 30, 40]
    assert duration_ticks(3 * 3600 + 5) == [0, 3600, 7200, 10800, 14400]


def test_nice_ticks_degenerate() -> None:
    assert nice_ticks(0) == [0.0, 1.0] and nice_ticks(float("nan")) == [0.0, 1.0]
    assert nice_ticks(37) == [0, 10, 20, 30, 40]


# --------------------------------------------------------------------------- history chart


def test_history_chart_one_bar_per_epoch_proportional_and_coloured_by_state() -> None:
    epochs = [epoch(1, EpochState.COMPLETED, 2.0, total=100, new=10),
              epoch(2, EpochState.COMPLETED, 4.0, total=110, new=10),
              epoch(3, EpochState.FAILED, 1.0, reason="disk full"),
              epoch(4, EpochState.COMPLETED, 8.0, total=130, new=20),
              epoch(5, EpochState.TRIGGERED, None)]
    now = epochs[-1].triggered_at + timedelta(seconds=3)
    root = svg_tree(history_chart(list(reversed(epochs)), now))
    bars = duration_bars(root)
    assert [t.split(" · ")[0] for t, _, _ in bars] == [f"epoch {n}" for n in range(1, 6)]  # oldest first
    heights = {int(t.split()[1]): h for t, h, _ in bars}
    assert heights[2] == pytest.approx(2 * heights[1]) and heights[4] == pytest.approx(4 * heights[1])
    assert heights[5] == pytest.approx(1.5 * heights[1])  # in flight: time so far (within the scale here)
    assert [f for _, _, f in bars] == [STATE_COLOURS[e.state] for e in epochs]
    assert any("disk full" in t for t, _, _ in bars)
    assert len(list(root.iter(f"{SVG}circle"))) == 3  # total size points of the epochs that have one


def test_expired_epochs_do_not_flatten_the_duration_scale() -> None:
    epochs = [epoch(n, EpochState.COMPLETED, 2.0 + n % 3) for n in range(1, 30)]
    epochs.append(epoch(30, EpochState.EXPIRED, 300.0, reason="not acknowledged"))
    root = svg_tree(history_chart(epochs, T0 + timedelta(hours=1)))
    bars = {int(t.split()[1]): h for t, h, _ in duration_bars(root)}
    tallest_completed = max(h for n, h in bars.items() if n < 30)
    assert bars[30] >= tallest_completed  # clipped at the top of the panel...
    assert tallest_completed > 0.5 * bars[30]  # ...and the others are still readable
    marks = [p for p in root.iter(f"{SVG}polygon")]
    assert len(marks) == 1 and "off the scale" in (marks[0].find(f"{SVG}title").text or "")  # type: ignore[union-attr]


def test_a_long_in_flight_epoch_is_clipped_too() -> None:
    epochs = [epoch(n, EpochState.COMPLETED, 2.0) for n in range(1, 10)] + [epoch(10, EpochState.TRIGGERED, None)]
    root = svg_tree(history_chart(epochs, epochs[-1].triggered_at + timedelta(minutes=10)))
    bars = {int(t.split()[1]): h for t, h, _ in duration_bars(root)}
    assert bars[1] > 0.5 * bars[10]
    assert len(list(root.iter(f"{SVG}polygon"))) == 1


def test_only_expired_epochs_set_their_own_scale() -> None:
    root = svg_tree(history_chart([epoch(1, EpochState.EXPIRED, 300.0)], T0 + timedelta(hours=1)))
    assert not list(root.iter(f"{SVG}polygon"))


def test_chart_text_is_escaped() -> None:
    evil = '<script>alert("x")</script> & "quotes"'
    root = svg_tree(history_chart([epoch(1, EpochState.FAILED, 1.0, reason=evil)], T0 + timedelta(hours=1)))
    assert not list(root.iter(f"{SVG}script")) and not list(root.iter("script"))
    assert any(evil in (t.text or "") for t in root.iter(f"{SVG}title"))


def test_empty_history() -> None:
    root = svg_tree(history_chart([], T0))
    assert "No epochs yet" in "".join(root.itertext())


# --------------------------------------------------------------------------- stage timeline


def detail(state: EpochState, acks: list[tuple[str, float, float, float, float]], stages: list[str],
           now_s: float = 60.0, ended_s: float | None = None) -> EpochDetail:
    e = EpochRecord("p", 7, state, triggered_at=T0, timeout_at=T0 + timedelta(seconds=300), stages=stages,
                    ended_at=None if ended_s is None else T0 + timedelta(seconds=ended_s))
    records = [AckRecord("p", 7, s, acked_at=T0 + timedelta(seconds=at), alignment_ms=a, sync_ms=sy, async_ms=asy)
               for s, at, a, sy, asy in acks]
    return EpochDetail(pipeline=PipelineRecord("p", "running"), epoch=e, acks=records,  # type: ignore[arg-type]
                       now=T0 + timedelta(seconds=now_s), expected_stages=stages)


def test_stage_timings_of_an_in_flight_epoch() -> None:
    d = detail(EpochState.TRIGGERED, [("src", 2.0, 100, 50, 850)], ["src", "agg", "sink"], now_s=42)
    t = stage_timings(d)
    assert [x.stage for x in t] == ["src", "agg", "sink"]
    assert [x.status for x in t] == [StageStatus.ACKNOWLEDGED, StageStatus.WAITING, StageStatus.WAITING]
    assert t[0].end_to_end_s == 2.0 and t[0].start_delay_s == pytest.approx(1.0)
    assert t[0].segments == [("start_delay", 0.0, pytest.approx(1.0)), ("alignment", pytest.approx(1.0), 0.1),
                             ("sync", pytest.approx(1.1), 0.05), ("async", pytest.approx(1.15), 0.85)]
    assert t[1].end_to_end_s == 42 and t[1].segments == []
    assert d.pending_stages == ["agg", "sink"]


def test_stage_timings_of_a_failed_epoch() -> None:
    d = detail(EpochState.FAILED, [("src", 2.0, 0, 0, 0)], ["src", "sink"], ended_s=3)
    assert [x.status for x in stage_timings(d)] == [StageStatus.ACKNOWLEDGED, StageStatus.MISSING]


@settings(max_examples=300, deadline=None)
@given(at=st.floats(0, 1000), align=st.floats(0, 10**6), sync=st.floats(0, 10**6), asyn=st.floats(0, 10**6))
def test_segments_always_fit_before_the_ack(at: float, align: float, sync: float, asyn: float) -> None:
    (t,) = stage_timings(detail(EpochState.COMPLETED, [("s", at, align, sync, asyn)], ["s"], ended_s=at))
    assert t.end_to_end_s is not None
    end = max((start + length for _, start, length in t.segments), default=0.0)
    assert end <= t.end_to_end_s * (1 + 1e-9) + 1e-9
    assert all(length > 0 and start >= 0 for _, start, length in t.segments)
    reported = (align + sync + asyn) / 1000
    if 0 < reported <= t.end_to_end_s:  # nothing scaled: the parts are what the stage reported
        parts = {name: length for name, _, length in t.segments}
        assert parts.get("async", 0.0) == pytest.approx(asyn / 1000)


def test_timeline_chart_draws_parts_and_waiting_rows() -> None:
    d = detail(EpochState.TRIGGERED, [("src", 2.0, 100, 50, 850)], ["src", "sink"], now_s=10)
    root = svg_tree(timeline_chart(stage_timings(d)))
    titles = [t.text or "" for t in root.iter(f"{SVG}title")]
    assert "src · alignment 100 ms" in titles and "src · async snapshot 850 ms" in titles
    assert "sink has not acknowledged yet" in titles
    dashed = [r for r in root.iter(f"{SVG}rect") if r.get("stroke-dasharray")]
    assert len(dashed) == 1


# --------------------------------------------------------------------------- formatting


@pytest.mark.parametrize(("n", "text"), [(None, "–"), (0, "0 B"), (1023, "1023 B"), (1536, "1.5 KiB"),
                                         (5 * 1024**3, "5.0 GiB"), (-2048, "-2.0 KiB")])
def test_bytes_human(n: int | None, text: str) -> None:
    assert bytes_human(n) == text


@pytest.mark.parametrize(("s", "text"), [(None, "–"), (0.25, "250 ms"), (2.34, "2.3 s"), (42, "42 s"),
                                         (60, "1m"), (75, "1m 15s"), (3600, "1h"), (3660, "1h 1m"),
                                         (90061, "1d 1h"), (-5, "-5.0 s")])
def test_duration_human(s: float | None, text: str) -> None:
    assert duration_human(s) == text


def test_age() -> None:
    assert age(None, T0) == "never"
    assert age(T0 - timedelta(seconds=75), T0) == "1m 15s ago"
    assert age(T0 + timedelta(seconds=30), T0) == "in 30 s"


@given(st.sets(st.integers(1, 400), max_size=60))
def test_epoch_ranges_round_trip(epochs: set[int]) -> None:
    text = epoch_ranges(epochs)
    if not epochs:
        assert text == "none"
        return
    back: set[int] = set()
    for part in text.split(", "):
        lo, _, hi = part.partition("–")
        back |= set(range(int(lo), int(hi or lo) + 1))
    assert back == epochs
    assert len(text.split(", ")) == sum(1 for e in epochs if e - 1 not in epochs)  # one part per run


def test_size_panels_without_sizes_say_so_instead_of_repeating_0_B() -> None:
    """The first epoch of a run is in flight (or failed): no size yet. The axis used to read
    "0, 0 B, 0 B, 0 B, 1 B" (fractions of a byte)."""
    root = svg_tree(history_chart([epoch(1, EpochState.TRIGGERED, None)], T0 + timedelta(seconds=45)))
    labels = [t.text for t in root.iter(f"{SVG}text")]
    assert labels.count("0 B") == 0 and labels.count("1 B") <= 2, labels
    assert labels.count("no size reported yet") == 2, labels  # total size and bytes new


@pytest.mark.parametrize("top", [0.5, 1.0, 2.0, 3.0, 7.0, 9.0, 1000.0, 1536.0, 5e6])
def test_byte_axis_labels_never_repeat(top: float) -> None:
    from airflow_arroyo.ui.charts import _axis_bytes, _bytes_ticks

    for count in (2, 4):
        labels = [_axis_bytes(t) for t in _bytes_ticks(top, count)]
        assert len(labels) == len(set(labels)), labels
        assert _bytes_ticks(top, count)[-1] >= top
