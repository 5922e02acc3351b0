"""The pictures on the pages, drawn on the server as SVG geometry (no script, no library).

Each function turns figures into shapes with numbers and labels; the templates write them out
as SVG elements, escaping every label like any other text. Figures in, geometry out: nothing
here reads state.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime

from bothy.money import format_usd
from bothy.trace import STATUS_ERROR, STATUS_OK, Span

__all__ = ["Bar", "Chart", "Label", "Line", "WaterfallRow", "plan_chart", "spend_chart",
           "waterfall"]

WIDTH = 720
_LEFT, _RIGHT, _TOP, _BOTTOM = 64, 16, 16, 28
_HOURS = (0, 3, 6, 9, 12, 15, 18, 21, 24)


@dataclass(frozen=True)
class Line:
    """A straight line: an axis, the ceiling, now."""

    x1: float
    y1: float
    x2: float
    y2: float
    css: str


@dataclass(frozen=True)
class Bar:
    """A rectangle: a reservation, a window's use, a span; ``title`` is its tooltip."""

    x: float
    y: float
    width: float
    height: float
    css: str
    title: str = ""


@dataclass(frozen=True)
class Label:
    """A text at a point, anchored at its start, middle or end."""

    x: float
    y: float
    text: str
    anchor: str = "start"
    css: str = "label"


@dataclass(frozen=True)
class Chart:
    """An SVG picture: its size, a title for screen readers, and its shapes."""

    width: int
    height: int
    title: str
    lines: list[Line] = field(default_factory=list)
    bars: list[Bar] = field(default_factory=list)
    labels: list[Label] = field(default_factory=list)
    polyline: str = ""  # "x,y x,y ..." of the spend line


def spend_chart(
    spends: Sequence[tuple[int, int]], *, day_start_us: int, day_end_us: int, now_us: int,
    used_micros: int, reserved_micros: int, ceiling_micros: int,
) -> Chart:
    """Today's spend as a rising step line over the day, what is reserved now as a band from
    now to the day's end on top of it, and the ceiling as a dashed line.

    ``spends`` are (when, micro-dollars) of today's measured spend, oldest first.
    """
    height = 220
    plot_w, plot_h = WIDTH - _LEFT - _RIGHT, height - _TOP - _BOTTOM
    top_micros = max(ceiling_micros, used_micros + reserved_micros, 1) * 21 // 20
    span_us = max(day_end_us - day_start_us, 1)

    def x(at_us: int) -> float:
        return round(_LEFT + plot_w * min(max(at_us - day_start_us, 0), span_us) / span_us, 1)

    def y(micros: int) -> float:
        return round(_TOP + plot_h * (1 - micros / top_micros), 1)

    chart = Chart(WIDTH, height, f"spend today: {format_usd(used_micros, 4)} usd used,"
                  f" {format_usd(reserved_micros, 4)} usd reserved, ceiling"
                  f" {format_usd(ceiling_micros)} usd")
    _axes(chart, y(0), plot_w)
    for hour in _HOURS:
        at = x(day_start_us + span_us * hour // 24)
        chart.labels.append(Label(at, height - 8, f"{hour:02d}:00", "middle", "tick"))
    for micros in (0, ceiling_micros // 2, ceiling_micros):
        chart.labels.append(Label(_LEFT - 6, y(micros) + 4, format_usd(micros), "end", "tick"))
    total, points = 0, [(x(day_start_us), y(0))]
    for at_us, micros in spends:
        points.append((x(at_us), y(total)))
        total += micros
        points.append((x(at_us), y(total)))
    points.append((x(now_us), y(total)))
    chart = _with_polyline(chart, points)
    if reserved_micros > 0:
        chart.bars.append(Bar(x(now_us), y(used_micros + reserved_micros),
                              max(x(day_end_us) - x(now_us), 2),
                              max(y(used_micros) - y(used_micros + reserved_micros), 1),
                              "reserved", f"reserved now: {format_usd(reserved_micros, 4)} usd"))
    ceiling_y = y(ceiling_micros)
    chart.lines.append(Line(_LEFT, ceiling_y, WIDTH - _RIGHT, ceiling_y, "ceiling"))
    chart.labels.append(Label(WIDTH - _RIGHT, ceiling_y - 4,
                              f"ceiling {format_usd(ceiling_micros)} usd", "end"))
    chart.lines.append(Line(x(now_us), _TOP, x(now_us), y(0), "now"))
    return chart


def _with_polyline(chart: Chart, points: list[tuple[float, float]]) -> Chart:
    return Chart(chart.width, chart.height, chart.title, chart.lines, chart.bars, chart.labels,
                 " ".join(f"{px},{py}" for px, py in points))


def _axes(chart: Chart, base_y: float, plot_w: int) -> None:
    chart.lines.append(Line(_LEFT, _TOP, _LEFT, base_y, "axis"))
    chart.lines.append(Line(_LEFT, base_y, _LEFT + plot_w, base_y, "axis"))


def plan_chart(
    windows: Sequence[dict[str, object]], *, ceiling_percent: int, reserved_percent: int
) -> Chart:
    """Each rate-limit window as a bar of its used share (and the open reservations on top of
    it), against the plan ceiling; the figures are ``bothy status``'s."""
    rows = max(len(windows), 1)
    height = _TOP + rows * 36 + _BOTTOM
    plot_w = WIDTH - _LEFT - _RIGHT - 60

    def x(percent: float) -> float:
        return round(_LEFT + 60 + plot_w * min(max(percent, 0), 100) / 100, 1)

    chart = Chart(WIDTH, height, f"plan windows against a {ceiling_percent}% ceiling")
    for i, window in enumerate(windows):
        used = _as_int(window.get("used_percent"))
        top = _TOP + i * 36
        chart.labels.append(Label(_LEFT + 54, top + 18, str(window.get("name", "?")), "end"))
        chart.bars.append(Bar(x(0), top + 4, x(used) - x(0), 20, "used",
                              f"{window.get('name')}: {used}% used"))
        if reserved_percent and i == 0:
            chart.bars.append(Bar(x(used), top + 4, x(used + reserved_percent) - x(used), 20,
                                  "reserved", f"reserved now: {reserved_percent}%"))
        chart.labels.append(Label(x(used + (reserved_percent if i == 0 else 0)) + 6, top + 18,
                                  f"{used}%"))
    base = _TOP + rows * 36
    chart.lines.append(Line(x(ceiling_percent), _TOP, x(ceiling_percent), base, "ceiling"))
    chart.labels.append(Label(x(ceiling_percent), base + 16, f"ceiling {ceiling_percent}%",
                              "middle"))
    chart.lines.append(Line(x(0), base, x(100), base, "axis"))
    return chart


def _as_int(value: object) -> int:
    return value if isinstance(value, int) else 0


@dataclass(frozen=True)
class WaterfallRow:
    """One span: its bar, and the label beside it (indented by its depth in the tree)."""

    x: float
    y: float
    label: str
    full: str  # the whole name and summary, for the tooltip
    bar: Bar
    duration: str


def waterfall(spans: Sequence[Span]) -> tuple[Chart, list[WaterfallRow]]:
    """The run's spans as a waterfall: one row per span in tree order, each bar placed by its
    start and length against the root's."""
    ordered = _tree_order(spans)
    row_h, label_w = 22, 300
    height = _TOP + max(len(ordered), 1) * row_h + _BOTTOM
    plot_left, plot_w = label_w, WIDTH - label_w - _RIGHT
    chart = Chart(WIDTH, height, f"waterfall of {len(ordered)} spans")
    if not ordered:
        return chart, []
    root = ordered[0][0]
    start, total_s = root.start, max(root.seconds, 1e-3)
    rows = []
    for i, (span, depth) in enumerate(ordered):
        top = _TOP + i * row_h
        offset_s = max((span.start - start).total_seconds(), 0.0)
        x = plot_left + plot_w * min(offset_s / total_s, 1.0)
        width = max(plot_w * span.seconds / total_s, 2.0)
        width = min(width, plot_left + plot_w - x) if x < plot_left + plot_w else 2.0
        text = f"{span.name} {span.outcome}"
        full = f"{text}: {span.summary}" if span.summary else text
        rows.append(WaterfallRow(4 + 12 * min(depth, 6), top + 15,
                                 _shorten(text, 42 - 2 * min(depth, 6)), full,
                                 Bar(round(x, 1), top + 4, round(max(width, 2.0), 1), 14,
                                     _css(span), full), _duration(span.seconds)))
    base = _TOP + len(ordered) * row_h
    chart.lines.append(Line(plot_left, base, plot_left + plot_w, base, "axis"))
    chart.labels.append(Label(plot_left, base + 16, _moment(start), "start", "tick"))
    chart.labels.append(Label(plot_left + plot_w, base + 16, f"+{_duration(root.seconds)}",
                              "end", "tick"))
    return chart, rows


def _tree_order(spans: Sequence[Span]) -> list[tuple[Span, int]]:
    children: dict[str | None, list[Span]] = {}
    for span in spans:
        children.setdefault(span.parent, []).append(span)
    out: list[tuple[Span, int]] = []

    def walk(span: Span, depth: int) -> None:
        out.append((span, depth))
        for kid in children.get(span.key, []):
            walk(kid, depth + 1)

    for root in children.get(None, []):
        walk(root, 0)
    return out


def _css(span: Span) -> str:
    if span.status == STATUS_ERROR:
        return "span-error"
    return "span-ok" if span.status == STATUS_OK else "span-unset"


def _shorten(text: str, chars: int) -> str:
    return text if len(text) <= chars else text[:chars - 1] + "…"


def _duration(seconds: float) -> str:
    return f"{seconds * 1000:.0f} ms" if seconds < 1 else f"{seconds:.1f} s"


def _moment(ts: datetime) -> str:
    return ts.strftime("%H:%M:%S UTC")
