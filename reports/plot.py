"""A small inline SVG plot of error per module along the depth of the model (no matplotlib).

The x axis is the order in which the model first runs each module, the y axis the largest
absolute error of that module's checks on a log scale. Culprit modules get a highlighted band
so that the eye lands on them first; an error of exactly zero sits on the floor line.
"""

from __future__ import annotations

import math
from html import escape

STATUS_COLORS = {"pass": "#2e9d5b", "mismatch": "#d2373c", "error": "#8e1116", "unsupported": "#d99a00",
                 "flaky": "#8a3ffc"}
FLOOR = 1e-9  # errors below this (including exact zeros) are drawn on the floor line


def _short(module: str) -> str:
    if not module:
        return "<root>"
    return ".".join(module.split(".")[-3:])


def _fmt(x: float | None) -> str:
    if x is None:
        return "not compared"
    if math.isinf(x):
        return "inf (NaN/Inf or shape mismatch)"
    return f"{x:.3g}"


#: Rotation of the x labels (degrees, down to the right), their font's average character width and
#: line height at 11 px (px), the least distance between two labels across their lines, and the
#: least width of the plotted area: two modules get a readable plot, not 150 px of a wide panel.
LABEL_ANGLE, CHAR_W, LINE_H, MIN_PLOT_W = 55, 6.6, 13, 640


def _x_layout(labels: list[str]) -> dict:
    """Where the x labels go: ``step`` (px per module), ``every`` (label every k-th module so
    that rotated neighbours never overlap), and the ``right`` margin and ``label_h`` that the
    longest label needs so that none is cut at the right or bottom edge."""
    n = max(len(labels), 1)
    step = max(26, min(56, 1100 // n)) if n <= 60 else max(8, 1560 // n)
    step = max(step, MIN_PLOT_W / n)
    across = math.sin(math.radians(LABEL_ANGLE))  # distance between neighbours across the text lines, per px of step
    every = max(1, math.ceil(LINE_H / (step * across)))
    longest = max([len(t) for t in labels] + [1]) * CHAR_W
    right = max(24, math.ceil(longest * math.cos(math.radians(LABEL_ANGLE))) + 12)
    label_h = math.ceil(longest * math.sin(math.radians(LABEL_ANGLE))) + 24
    return {"step": step, "every": every, "right": right, "label_h": label_h}


def module_error_svg(points: list[dict], end_to_end: dict | None = None, title: str = "") -> str:
    """SVG markup for ``points`` (from :meth:`StateReport.module_errors`): ``module``,
    ``max_abs_err`` (None, a float or inf), ``status``, ``culprit``, ``ops``. ``end_to_end``
    adds a final diamond for the model output's error."""
    items = [dict(p) for p in points]
    if end_to_end is not None:
        items.append({"module": "model output", "max_abs_err": end_to_end.get("max_abs_err"),
                      "status": end_to_end.get("status") or "pass", "culprit": False, "ops": [], "e2e": True})
    n = max(len(items), 1)
    xs = _x_layout([_short(p["module"]) for p in items])
    step, right, label_h, label_every = xs["step"], xs["right"], xs["label_h"], xs["every"]
    left, top, plot_h = 64, 28, 220
    width = round(left + right + step * n)
    height = top + plot_h + label_h
    finite = [p["max_abs_err"] for p in items if p["max_abs_err"] is not None and math.isfinite(p["max_abs_err"])
              and p["max_abs_err"] > FLOOR]
    lo = math.floor(math.log10(min(finite))) if finite else -6
    hi = math.ceil(math.log10(max(finite))) if finite else 0
    hi = max(hi, lo + 1)
    floor_y = top + plot_h  # exact zeros (and errors below FLOOR) sit on this line, apart from the decades
    low_y, high_y = floor_y - 26, top + 4

    def decade_y(exponent: float) -> float:
        frac = (exponent - lo) / (hi - lo)
        return low_y - max(0.0, min(1.0, frac)) * (low_y - high_y)

    def y_of(err: float | None) -> float:
        if err is None or err <= FLOOR:
            return floor_y
        if math.isinf(err):
            return top - 10
        return decade_y(math.log10(err))

    def x_of(i: int) -> float:
        return left + step * i + step / 2

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" class="module-plot" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" role="img" aria-label="{escape(title or "error per module")}">']
    out.append(f'<rect x="{left}" y="{top - 16}" width="{step * n}" height="{plot_h + 16}" class="plot-bg"/>')
    for i, p in enumerate(items):
        if p.get("culprit"):
            out.append(f'<rect class="culprit-band" x="{x_of(i) - step / 2:.1f}" y="{top - 16}" width="{step}" '
                       f'height="{plot_h + 16 + label_h - 10}"/>')
    for d in range(lo, hi + 1):
        y = decade_y(d)
        out.append(f'<line class="grid" x1="{left}" x2="{left + step * n}" y1="{y:.1f}" y2="{y:.1f}"/>'
                   f'<text class="tick" x="{left - 6}" y="{y + 4:.1f}" text-anchor="end">1e{d}</text>')
    out.append(f'<line class="grid floor" x1="{left}" x2="{left + step * n}" y1="{floor_y}" y2="{floor_y}"/>'
               f'<text class="tick" x="{left - 6}" y="{floor_y + 4}" text-anchor="end">0</text>')
    out.append(f'<text class="axis-title" x="14" y="{top + plot_h / 2:.0f}" '
               f'transform="rotate(-90 14 {top + plot_h / 2:.0f})" text-anchor="middle">max abs error</text>')
    path = " ".join(f"{x_of(i):.1f},{y_of(p['max_abs_err']):.1f}" for i, p in enumerate(items)
                    if p["max_abs_err"] is not None and not p.get("e2e"))
    if path:
        out.append(f'<polyline class="trend" points="{path}"/>')
    for i, p in enumerate(items):
        x, y = x_of(i), y_of(p["max_abs_err"])
        color = STATUS_COLORS.get(p["status"], "#666")
        classes = "pt" + (" culprit" if p.get("culprit") else "") + (" e2e" if p.get("e2e") else "")
        tip = f"{p['module'] or '<root>'}: max abs error {_fmt(p['max_abs_err'])}, {p['status']}"
        if p.get("ops"):
            tip += "\nops: " + ", ".join(p["ops"])
        if p.get("culprit"):
            tip += "\nCULPRIT"
        out.append(f'<g class="{classes}" data-module="{escape(p["module"])}" data-status="{escape(p["status"])}">'
                   f'<title>{escape(tip)}</title>')
        if p.get("e2e"):
            out.append(f'<path d="M{x:.1f} {y - 7:.1f} L{x + 7:.1f} {y:.1f} L{x:.1f} {y + 7:.1f} '
                       f'L{x - 7:.1f} {y:.1f} Z" fill="{color}"/>')
        elif p["max_abs_err"] is None:
            out.append(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="4" fill="none" stroke="{color}" stroke-width="1.5"/>')
        else:
            r = 7 if p.get("culprit") else 4.5
            out.append(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="{r}" fill="{color}"'
                       + (' stroke="#111" stroke-width="2"' if p.get("culprit") else "") + "/>")
        if p.get("culprit") and step >= 48:  # the word needs room; narrower, the band and ring mark it
            out.append(f'<text class="culprit-label" x="{x:.1f}" y="{y - 12:.1f}" text-anchor="middle">culprit</text>')
        if (i % label_every == 0 and i <= n - 1 - label_every) or i == n - 1:  # the last one always
            ly = floor_y + 12
            out.append(f'<text class="xlabel{" culprit-text" if p.get("culprit") else ""}" x="{x:.1f}" y="{ly}" '
                       f'transform="rotate({LABEL_ANGLE} {x:.1f} {ly})">{escape(_short(p["module"]))}</text>')
        out.append("</g>")
    out.append("</svg>")
    return "".join(out)


#: Colours of a precision plot's points: fits, overflows to Inf/NaN, overflows but absorbed.
PRECISION_COLORS = {"fits": STATUS_COLORS["pass"], "overflow": STATUS_COLORS["mismatch"],
                    "absorbed": STATUS_COLORS["unsupported"]}


def precision_svg(rows: list[dict], dtype: str, title: str = "") -> str:
    """SVG markup of headroom (top panel) and error against float64 (bottom panel) per module
    along the depth of the model, both on log scales; ``rows`` from
    :func:`tapml.reports.data.precision_modules`. A dashed line marks headroom 1 (the dtype's
    largest finite value); modules with overflowing ops are red, absorbed ones amber, modules
    holding kept ops shaded. Unbounded errors sit above the bottom panel's top."""
    n = max(len(rows), 1)
    xs = _x_layout([_short(r["module"]) for r in rows])
    step, right, label_h, label_every = xs["step"], xs["right"], xs["label_h"], xs["every"]
    left, top, panel_h, gap = 72, 24, 150, 36
    width = round(left + right + step * n)
    height = top + 2 * panel_h + gap + label_h
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" class="module-plot precision-plot" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" role="img" aria-label="{escape(title or "headroom and error per module")}">']

    def x_of(i: int) -> float:
        return left + step * i + step / 2

    def panel(y0: float, values: list, name: str, mark_one: bool) -> list[float | None]:
        finite = [v for v in values if v is not None and math.isfinite(v) and v > 0]
        lo = math.floor(math.log10(min(finite + ([1.0] if mark_one else [])))) if finite else -6
        hi = math.ceil(math.log10(max(finite + ([1.0] if mark_one else [])))) if finite else 0
        hi = max(hi, lo + 1)
        bottom, top_y = y0 + panel_h - 8, y0 + 8

        def y_of(v: float) -> float:
            return bottom - (math.log10(v) - lo) / (hi - lo) * (bottom - top_y)

        for d in range(lo, hi + 1, max(1, (hi - lo) // 6)):
            y = y_of(10.0 ** d)
            out.append(f'<line class="grid" x1="{left}" x2="{left + step * n}" y1="{y:.1f}" y2="{y:.1f}"/>'
                       f'<text class="tick" x="{left - 6}" y="{y + 4:.1f}" text-anchor="end">1e{d}</text>')
        if mark_one:
            y = y_of(1.0)
            out.append(f'<line class="limit" x1="{left}" x2="{left + step * n}" y1="{y:.1f}" y2="{y:.1f}" '
                       f'stroke="{STATUS_COLORS["mismatch"]}" stroke-dasharray="6 4"/>'
                       f'<text class="tick" x="{left + step * n - 4}" y="{y - 4:.1f}" text-anchor="end">'
                       f'{escape(dtype)} max</text>')
        out.append(f'<text class="axis-title" x="14" y="{y0 + panel_h / 2:.0f}" '
                   f'transform="rotate(-90 14 {y0 + panel_h / 2:.0f})" text-anchor="middle">{escape(name)}</text>')
        if any(v is not None and math.isinf(v) for v in values):
            out.append(f'<text class="tick" x="{left - 6}" y="{y0 - 2}" text-anchor="end">∞</text>')
        return [None if v is None or not v > 0 else (y0 - 6 if math.isinf(v) else y_of(v)) for v in values]

    for y0 in (top, top + panel_h + gap):
        out.append(f'<rect x="{left}" y="{y0}" width="{step * n}" height="{panel_h}" class="plot-bg"/>')
    for i, r in enumerate(rows):
        if r.get("kept"):
            out.append(f'<rect class="culprit-band" x="{x_of(i) - step / 2:.1f}" y="{top}" width="{step}" '
                       f'height="{2 * panel_h + gap + label_h - 10}"/>')
    head_y = panel(top, [r["headroom"] for r in rows], "headroom", True)
    err_y = panel(top + panel_h + gap, [r["err_vs_fp64"] for r in rows], "error vs fp64", False)
    for ys, cls in ((head_y, "headroom"), (err_y, "error")):
        path = " ".join(f"{x_of(i):.1f},{y:.1f}" for i, y in enumerate(ys) if y is not None)
        if path:
            out.append(f'<polyline class="trend {cls}" points="{path}"/>')
    floor_y = top + 2 * panel_h + gap
    for i, r in enumerate(rows):
        kind = "absorbed" if r["absorbed"] else "overflow" if r["overflow"] else "fits"
        color = PRECISION_COLORS[kind]
        tip = (f"{r['module'] or '<root>'}: {r['ops']} ops, max |x| {_fmt(r['max_abs'])}, headroom {_fmt(r['headroom'])}, "
               f"error vs fp64 {_fmt(r['err_vs_fp64'])}, {r['overflow']} overflow, {r['absorbed']} absorbed, "
               f"{r['kept']} kept in float32")
        out.append(f'<g class="pt {kind}" data-module="{escape(r["module"])}"><title>{escape(tip)}</title>')
        for y in (head_y[i], err_y[i]):
            if y is not None:
                out.append(f'<circle cx="{x_of(i):.1f}" cy="{y:.1f}" r="{6 if kind != "fits" else 4.5}" fill="{color}"/>')
        ly = floor_y + 12
        if (i % label_every == 0 and i <= n - 1 - label_every) or i == n - 1:  # the last one always
            out.append(f'<text class="xlabel" x="{x_of(i):.1f}" y="{ly}" '
                       f'transform="rotate({LABEL_ANGLE} {x_of(i):.1f} {ly})">{escape(_short(r["module"]))}</text>')
        out.append("</g>")
    out.append("</svg>")
    return "".join(out)


__all__ = ["module_error_svg", "precision_svg", "STATUS_COLORS", "PRECISION_COLORS"]
