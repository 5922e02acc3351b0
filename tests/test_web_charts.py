"""The pictures the status pages draw (``bothy.web.charts``): figures in, geometry out."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from bothy.trace import Span
from bothy.web.charts import plan_chart, spend_chart, waterfall

DAY = datetime(2026, 12, 1, tzinfo=UTC)
US = 1_000_000


def _us(moment: datetime) -> int:
    return int(moment.timestamp()) * US


def test_the_spend_line_rises_by_each_spend_and_the_reservation_sits_on_top() -> None:
    """Two spends make two steps; the line ends at now at their total; the reserved band runs
    from now to the day's end on top of the used figure; the ceiling is the top dashed line."""
    chart = spend_chart(
        [(_us(DAY + timedelta(hours=6)), 5 * US), (_us(DAY + timedelta(hours=12)), 5 * US)],
        day_start_us=_us(DAY), day_end_us=_us(DAY + timedelta(days=1)),
        now_us=_us(DAY + timedelta(hours=18)), used_micros=10 * US, reserved_micros=5 * US,
        ceiling_micros=20 * US)
    points = [tuple(map(float, pair.split(","))) for pair in chart.polyline.split()]
    xs, ys = [x for x, _ in points], [y for _, y in points]
    assert xs == sorted(xs) and ys == sorted(ys, reverse=True)  # rightwards, upwards only
    assert xs[-1] == 544.0 and len(points) == 6  # 18:00 of a 640 px day starting at 64
    [band] = chart.bars
    ceiling = next(line for line in chart.lines if line.css == "ceiling")
    assert band.x == 544.0 and band.x + band.width == 704.0
    assert round(band.y + band.height, 1) == ys[-1]  # sits on the used line
    assert ceiling.y1 < band.y
    assert chart.title == ("spend today: 10.0000 usd used, 5.0000 usd reserved, ceiling"
                           " 20.00 usd")


def test_a_plan_window_over_the_ceiling_is_drawn_past_its_line() -> None:
    """A window at 90% against an 85% ceiling: its bar ends right of the ceiling's line."""
    chart = plan_chart([{"name": "primary", "used_percent": 90},
                        {"name": "secondary", "used_percent": 10}],
                       ceiling_percent=85, reserved_percent=0)
    primary, secondary = chart.bars
    ceiling = next(line for line in chart.lines if line.css == "ceiling")
    assert primary.x + primary.width > ceiling.x1 > secondary.x + secondary.width
    assert [label.text for label in chart.labels][:2] == ["primary", "90%"]


def test_the_waterfall_lists_spans_in_tree_order_placed_by_their_times() -> None:
    """Children follow their parent; a span's bar starts where it started within the run."""
    spans = [Span("run", "run r", DAY, DAY + timedelta(seconds=10)),
             Span("worker.1", "worker", DAY + timedelta(seconds=1), DAY + timedelta(seconds=9),
                  parent="run"),
             Span("settlement.1", "settlement", DAY + timedelta(seconds=10),
                  DAY + timedelta(seconds=10), parent="run"),
             Span("turn.1", "turn 1", DAY + timedelta(seconds=2), DAY + timedelta(seconds=8),
                  parent="worker.1", outcome="failed", summary="<b>boom</b>")]
    chart, rows = waterfall(spans)
    assert [row.full for row in rows] == ["run r ok", "worker ok", "turn 1 failed: <b>boom</b>",
                                          "settlement ok"]
    run, worker, turn, _ = (row.bar for row in rows)
    assert run.x < worker.x < turn.x and turn.x + turn.width < worker.x + worker.width
    assert turn.css == "span-error" and run.css == "span-ok"
    assert [row.x for row in rows] == [4, 16, 28, 16]
    assert chart.height > 4 * 22
