"""The console's two charts, drawn as SVG on the server: no script, no inline style (the CSP forbids both).

Every text in a chart is escaped here (``markupsafe.escape``): lane names come
from a published archive's metadata and are a publisher's choice. Colours are
classes styled by ``console.css``; geometry is presentation attributes, which
the CSP does not govern.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from markupsafe import Markup, escape

from cgstore_client.lanes import fit_requirement_bytes

GIB = 1 << 30
#: The card sizes the fit chart draws its lanes against (GiB of device memory): the common datacenter cards.
CARD_SIZES_GIB = (16, 24, 40, 48, 80, 96, 141, 192)

_LABEL_W, _BAR_W, _ROW_H, _TOP = 190, 520, 22, 26


def fit_chart(kernel_lane: Mapping[str, Any] | None) -> Markup | None:
    """Bars of each lane's quantized peak (and the memory the fit rule asks for it) against card sizes.

    None when the verdict has no fit block (no peaks were recorded).
    """
    fit = (kernel_lane or {}).get("fit")
    peaks = fit.get("peaks") if isinstance(fit, Mapping) else None
    if not isinstance(peaks, Mapping) or not peaks:
        return None
    lanes = [(str(lane), int(peak)) for lane, peak in peaks.items() if isinstance(peak, int) and peak > 0]
    if not lanes:
        return None
    winner = kernel_lane.get("winner")
    largest = max(fit_requirement_bytes(peak) for _, peak in lanes)
    cards = [gib for gib in CARD_SIZES_GIB if gib * GIB <= largest * 1.25] or [CARD_SIZES_GIB[0]]
    scale = _BAR_W / max(largest, max(cards) * GIB)
    height = _TOP + _ROW_H * len(lanes) + 8
    parts = [
        f'<svg class="fit" xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {_LABEL_W + _BAR_W + 70} {height}"'
        f' width="{_LABEL_W + _BAR_W + 70}" height="{height}" role="img"'
        f' aria-label="quantized peak per lane against card sizes">'
    ]
    for gib in cards:
        x = _LABEL_W + gib * GIB * scale
        parts.append(
            f'<line class="cardsize" x1="{x:.1f}" y1="14" x2="{x:.1f}" y2="{height - 4}"/>'
            f'<text class="cardsize" x="{x:.1f}" y="11" text-anchor="middle">{gib} GiB</text>'
        )
    for row, (lane, peak) in enumerate(lanes):
        y = _TOP + row * _ROW_H
        kind = "bar winner" if lane == winner else "bar"
        need = fit_requirement_bytes(peak) * scale
        parts.append(
            f'<text class="lane" x="{_LABEL_W - 6}" y="{y + 13}" text-anchor="end">{escape(lane)}</text>'
            f'<rect class="need" x="{_LABEL_W}" y="{y + 2}" width="{need:.1f}" height="14"/>'
            f'<rect class="{kind}" x="{_LABEL_W}" y="{y + 4}" width="{peak * scale:.1f}" height="10">'
            f"<title>{escape(lane)}: quantized peak {peak / GIB:.2f} GiB, needs {need / scale / GIB:.2f} GiB</title>"
            f"</rect>"
            f'<text class="value" x="{_LABEL_W + need + 4:.1f}" y="{y + 13}">{peak / GIB:.2f} GiB</text>'
        )
    parts.append("</svg>")
    return Markup("".join(parts))


def growth_chart(days: Sequence[tuple[str, int]]) -> Markup:
    """Bytes stored per day as columns (``(label, bytes)``, oldest first); an empty frame when none."""
    width, height, base = 720, 160, 130
    largest = max((size for _, size in days), default=0) or 1
    step = width / max(len(days), 1)
    parts = [
        f'<svg class="growth" xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {width} {height}"'
        f' width="{width}" height="{height}" role="img" aria-label="bytes stored per day">',
        f'<line class="axis" x1="0" y1="{base}" x2="{width}" y2="{base}"/>',
    ]
    for index, (label, size) in enumerate(days):
        bar = (base - 10) * size / largest
        x = index * step
        parts.append(
            f'<rect class="bar" x="{x + 2:.1f}" y="{base - bar:.1f}" width="{max(step - 4, 1):.1f}" height="{bar:.1f}">'
            f"<title>{escape(label)}: {size} bytes</title></rect>"
        )
        if index == 0:
            parts.append(f'<text class="day" x="{x + 2:.1f}" y="{base + 16}">{escape(label)}</text>')
        elif index == len(days) - 1:  # anchored at its end, so the last label stays inside the frame
            parts.append(
                f'<text class="day" x="{x + step - 2:.1f}" y="{base + 16}" text-anchor="end">{escape(label)}</text>'
            )
    parts.append("</svg>")
    return Markup("".join(parts))
