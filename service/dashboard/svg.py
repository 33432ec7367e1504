"""Server-side SVG plots for the dashboard: no JavaScript, no CDN, and CSP-safe (no inline styles)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from html import escape
from typing import Any

SERIES = (
    ("exposed", "main_grad exposed by maingrad", "#2b7bb9"),
    ("none", "main_grad is None", "#e08a00"),
    ("missing", "main_grad missing", "#8e44ad"),
)
ANOMALY_COLOR = "#c0392b"
MAX_POINTS = 600


@dataclass(frozen=True)
class Box:
    width: int = 820
    height: int = 280
    left: int = 56
    right: int = 16
    top: int = 36
    bottom: int = 40

    @property
    def inner_w(self) -> int:
        return self.width - self.left - self.right

    @property
    def inner_h(self) -> int:
        return self.height - self.top - self.bottom


def downsample(points: list[dict[str, Any]], limit: int = MAX_POINTS) -> list[dict[str, Any]]:
    """At most `limit` points: consecutive steps merge into one bin keeping each series' maximum."""
    if len(points) <= limit:
        return points
    size = -(-len(points) // limit)
    out = []
    for i in range(0, len(points), size):
        chunk = points[i : i + size]
        merged = {"step": chunk[0]["step"]}
        for key in ("exposed", "none", "missing", "anomalies", "records"):
            merged[key] = max(p.get(key, 0) for p in chunk)
        out.append(merged)
    return out


def _ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    """Round tick values (1, 2, 5 x 10^k apart, integers only) covering [lo, hi]."""
    if hi <= lo:
        return [lo]
    raw = (hi - lo) / count
    magnitude = 10 ** math.floor(math.log10(raw))
    step = max(1.0, next(m * magnitude for m in (1, 2, 5, 10) if m * magnitude >= raw))
    start = math.ceil(lo / step) * step
    return [start + i * step for i in range(int((hi - start) // step) + 1)]


def timeline_svg(points: list[dict[str, Any]], title: str = "main_grad per step") -> str:
    """A line chart of exposed / None / missing counts per step, with anomaly markers."""
    box = Box()
    pts = downsample(points)
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" class="plot" role="img" viewBox="0 0 {box.width} {box.height}" '
        f'width="{box.width}" height="{box.height}" aria-label="{escape(title)}" data-points="{len(pts)}">',
        f"<title>{escape(title)}</title>",
        f'<rect x="{box.left}" y="{box.top}" width="{box.inner_w}" height="{box.inner_h}" fill="#fafafa" stroke="#ccc"/>',
    ]
    if not pts:
        parts.append(
            f'<text x="{box.width / 2}" y="{box.height / 2}" text-anchor="middle" fill="#666">no records yet</text>'
        )
        parts.append("</svg>")
        return "".join(parts)
    steps = [p["step"] for p in pts]
    lo, hi = min(steps), max(steps)
    top = max(1, max(max(p.get(k, 0) for k, _, _ in SERIES) for p in pts))

    def x(step: float) -> float:
        return box.left + (box.inner_w * (step - lo) / (hi - lo) if hi > lo else box.inner_w / 2)

    def y(value: float) -> float:
        return box.top + box.inner_h * (1 - value / top)

    for tick in _ticks(0, top):
        parts.append(
            f'<line x1="{box.left}" x2="{box.left + box.inner_w}" y1="{y(tick):.1f}" y2="{y(tick):.1f}" stroke="#e5e5e5"/>'
            f'<text x="{box.left - 6}" y="{y(tick) + 4:.1f}" text-anchor="end" font-size="11" fill="#555">{int(tick)}</text>'
        )
    for tick in _ticks(lo, hi, 8):
        parts.append(
            f'<text x="{x(tick):.1f}" y="{box.top + box.inner_h + 16}" text-anchor="middle" font-size="11" '
            f'fill="#555">{int(tick)}</text>'
        )
    parts.append(
        f'<text x="{box.left + box.inner_w / 2}" y="{box.height - 6}" text-anchor="middle" font-size="12" '
        f'fill="#333">step</text>'
    )
    for key, label, color in SERIES:
        coords = " ".join(f"{x(p['step']):.1f},{y(p.get(key, 0)):.1f}" for p in pts)
        parts.append(
            f'<polyline class="series series-{key}" data-series="{key}" points="{coords}" fill="none" '
            f'stroke="{color}" stroke-width="2"><title>{escape(label)}</title></polyline>'
        )
        if len(pts) == 1:
            p = pts[0]
            parts.append(
                f'<circle cx="{x(p["step"]):.1f}" cy="{y(p.get(key, 0)):.1f}" r="3" fill="{color}"/>'
            )
    for p in pts:
        if p.get("anomalies"):
            cx = x(p["step"])
            parts.append(
                f'<path class="anomaly" d="M{cx:.1f},{box.top + 2} l5,9 l-10,0 z" fill="{ANOMALY_COLOR}">'
                f"<title>step {p['step']}: {p['anomalies']} anomalies</title></path>"
            )
    legend_x = box.left
    for _key, label, color in (*SERIES, ("anomalies", "anomaly", ANOMALY_COLOR)):
        parts.append(
            f'<rect x="{legend_x}" y="12" width="12" height="12" fill="{color}"/>'
            f'<text x="{legend_x + 16}" y="22" font-size="12" fill="#333">{escape(label)}</text>'
        )
        legend_x += 24 + 7 * len(label)
    parts.append("</svg>")
    return "".join(parts)
