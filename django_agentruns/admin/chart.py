"""The overview's chart: finished and dead-lettered runs per bucket, as inline SVG.

Server-rendered, no JavaScript: two polylines over a baseline, the time axis labelled at
its ends, the peak labelled on the left. Every number is formatted here; nothing from a
run reaches the markup.
"""

from __future__ import annotations

from django.utils import timezone
from django.utils.html import format_html
from django.utils.safestring import SafeString, mark_safe

from ..ops.triage import Series

WIDTH, HEIGHT, PAD = 720, 160, 28
COLOURS = {"finished": "#1f6fb2", "dead": "#c62828"}


def _points(values: list[int], peak: int) -> str:
    span = max(1, len(values) - 1)
    inner_w, inner_h = WIDTH - 2 * PAD, HEIGHT - 2 * PAD
    return " ".join(f"{PAD + inner_w * i / span:.1f},{HEIGHT - PAD - inner_h * v / peak:.1f}"
                    for i, v in enumerate(values))


def svg(series: Series) -> SafeString:
    """The chart of `series`, sized for a laptop's overview column."""
    peak = max([1, *series.finished, *series.dead])
    end = series.start + series.bucket * max(0, len(series.finished) - 1)
    unit = "hour" if series.bucket.total_seconds() >= 3600 else "minute"
    first = timezone.localtime(series.start).strftime("%H:%M")
    last = timezone.localtime(end).strftime("%H:%M")
    lines = "".join(
        f'<polyline fill="none" stroke="{COLOURS[name]}" stroke-width="1.5" '
        f'class="agentruns-line-{name}" points="{_points(values, peak)}"/>'
        for name, values in (("finished", series.finished), ("dead", series.dead)))
    # Only numbers and fixed words go into this markup, so it is safe to mark as such.
    body = mark_safe(
        f'<line x1="{PAD}" y1="{HEIGHT - PAD}" x2="{WIDTH - PAD}" y2="{HEIGHT - PAD}" '
        f'stroke="#999"/>{lines}'
        f'<text x="{PAD}" y="{HEIGHT - 8}" font-size="11">{first}</text>'
        f'<text x="{WIDTH - PAD}" y="{HEIGHT - 8}" font-size="11" text-anchor="end">{last}</text>'
        f'<text x="{PAD - 4}" y="{PAD}" font-size="11" text-anchor="end">{peak}</text>'
        f'<text x="{PAD - 4}" y="{HEIGHT - PAD}" font-size="11" text-anchor="end">0</text>')
    return format_html(
        '<svg id="agentruns-chart" xmlns="http://www.w3.org/2000/svg" width="{}" height="{}" '
        'viewBox="0 0 {} {}" role="img" aria-label="{}">{}</svg>',
        WIDTH, HEIGHT, WIDTH, HEIGHT,
        f"Runs finished (blue) and dead-lettered (red) per {unit}, {first} to {last}; "
        f"peak {peak}", body)
