"""One self-contained HTML report: CSS, JavaScript and SVG inlined, nothing fetched.

Example::

    from tapml.reports import load_states, render_html
    Path("reports/gpt2.html").write_text(render_html(load_states(["s.json"])))
"""

from __future__ import annotations

import datetime
import math
import re
from pathlib import Path

from tapml.reports.data import (judged, MATRIX_GROUPS, STATUSES, StateReport, coverage_matrix, precision_modules, bench_line, preflight_findings, preflight_line,
                                step_error_points)
from tapml.reports.plot import PRECISION_COLORS, STATUS_COLORS, module_error_svg, precision_svg

TEMPLATES = Path(__file__).parent / "templates"


# Characters no report shows raw: C0/C1 controls but tab, newline and carriage return, lone
# surrogates (unencodable), U+FFFE/U+FFFF (not XML), line/paragraph separators (they end lines
# and JavaScript strings) and the bidirectional controls that make text display other than it reads.
_UNSHOWABLE = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\ud800-\udfff\ufffe\uffff"
                         "\u2028\u2029\u200e\u200f\u061c\u202a-\u202e\u2066-\u2069]")


def _visible_escape(m: re.Match) -> str:
    code = ord(m.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def visible_text(text) -> str:
    """``str(text)`` with every control, surrogate, line-separator and bidi-override character
    written as a visible escape (``"a\\x01b"`` -> ``"a\\\\x01b"``): what any report format may embed.
    Tab, newline and carriage return are kept; each format decides about line breaks."""
    return _UNSHOWABLE.sub(_visible_escape, str(text))


def _number(x) -> float | None:
    """``x`` as a float when it is a real number (not a bool), else None: report data comes from
    files anyone may write, so a statistic can be a string or an object."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return None
    return float(x)


def fmt_err(x) -> str:
    """An error statistic for people: 3 significant digits, ``—`` when not compared."""
    x = _number(x)
    if x is None or math.isnan(x):
        return "—"
    if math.isinf(x):
        return "∞" if x > 0 else "-∞"
    if x == 0:
        return "0"
    return f"{x:.3g}" if 1e-3 <= abs(x) < 1e4 else f"{x:.2e}"


def fmt_pct(x, digits: int = 1) -> str:
    """A fraction as a percentage (``0.25`` -> ``25.0%``), ``—`` when missing."""
    x = _number(x)
    return "—" if x is None or not math.isfinite(x) else f"{100 * x:.{digits}f}%"


def fmt_ms(x) -> str:
    """Milliseconds for people, ``—`` when missing."""
    x = _number(x)
    if x is None or not math.isfinite(x):
        return "—"
    return f"{x:.3f}" if x < 10 else f"{x:.1f}"


def sort_value(x) -> str:
    """The ``data-v`` a sortable cell carries: a number, or empty (sorted last) when missing."""
    x = _number(x)
    if x is None or math.isnan(x):
        return ""
    if math.isinf(x):
        return "1e308" if x > 0 else "-1e308"
    return repr(x)


def bar_width(fraction, scale: float = 100.0) -> float:
    """Width of a bar for ``fraction`` (clamped to 0..1) on ``scale``; 0 when it is not a number."""
    x = _number(fraction)
    return 0.0 if x is None or math.isnan(x) else round(scale * min(1.0, max(0.0, x)), 1)


def worst_rows(worst) -> list[dict]:
    """Worst elements as rows a template can show whatever a state file put there: ``index`` a
    list of strings, ``target``/``reference`` as given, ``difference`` a number or None."""
    rows = []
    for w in worst or []:
        if not isinstance(w, dict):
            continue
        index = w.get("index")
        index = [str(i) for i in index] if isinstance(index, list) else ([] if index is None else [str(index)])
        t, r = _number(w.get("target")), _number(w.get("reference"))
        rows.append({"index": index, "target": w.get("target"), "reference": w.get("reference"),
                     "difference": t - r if t is not None and r is not None and math.isfinite(t - r) else None})
    return rows


def _strings(items) -> list[str]:
    return [str(x) for x in items] if isinstance(items, (list, tuple)) else [str(items)]


def tolerance_rows(tolerances) -> list[dict]:
    """``{op: [rtol, atol]}`` of a state as rows; a malformed entry shows what it holds."""
    rows = []
    for key, value in (tolerances or {}).items():
        pair = value if isinstance(value, (list, tuple)) and len(value) == 2 else (value, None)
        rows.append({"op": key, "rtol": pair[0], "atol": pair[1]})
    return rows


def breakable(name) -> "object":
    """A dotted name (a module path) escaped, with a line-break opportunity after each dot: a
    narrow column wraps it between its parts, not inside one."""
    from markupsafe import Markup, escape
    return Markup(".<wbr>").join(escape(part) for part in str(name or "").split("."))


def _environment():
    import jinja2
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(TEMPLATES)), autoescape=True,
                             undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True)
    env.filters.update(judged=judged, err=fmt_err, pct=fmt_pct, ms=fmt_ms, v=sort_value, width=bar_width,
                       breakable=breakable)
    return env


#: How the HTML report names each row group of the coverage matrix.
GROUP_TEXT = {"differs": "differs", "fails": "fails on all", "passes": "passes on all"}


def _matrix(states: list[StateReport], by_case: bool) -> dict:
    # The per-device states of a fleet run (fleet_states) tag every case with its model: a row per model.
    by_model = all(s.cases and all("model" in c for c in s.cases) for s in states)
    m = coverage_matrix(states, by_case=by_case and not by_model, by_model=by_model)
    return {**m, "by_case": by_case, "group_text": GROUP_TEXT, "group_order": {g: i for i, g in enumerate(MATRIX_GROUPS)}}


def render_html(states: list[StateReport], title: str | None = None, by_case: bool = False) -> str:
    """The report of one or more states as one HTML document (a string); with several states,
    the coverage matrix (:func:`~tapml.reports.data.coverage_matrix`) has a row per op, or per
    case with ``by_case``."""
    from markupsafe import Markup

    from tapml import version
    tapml_version = version()
    env = _environment()
    sections = []
    for i, s in enumerate(states):
        failures = [{**f, "worst": worst_rows(f["worst"]), "ops": _strings(f["ops"]), "nodes": _strings(f["nodes"])}
                    for f in s.failures]
        sections.append({"state": s, "anchor": f"s{i}", "failures": failures, "shares": s.shares,
                         "flaky": [c for c in s.cases if c["status"] == "flaky"],
                         "summary": s.summary, "op_times": s.op_times(), "op_speeds": s.op_speeds(), "tolerances": tolerance_rows(s.tolerances),
                         "plot": Markup(module_error_svg(s.module_errors(), s.end_to_end,
                                                         title=f"error per module, {s.model} on {s.label}")),
                         "step_plot": Markup(module_error_svg(step_error_points(s), title=f"error per step, {s.model} on "
                                                              f"{s.label}")) if s.generation else ""})
        if s.bench is not None:
            sections[-1].update(bench_line=bench_line(s.bench))
        if s.preflight is not None:
            sections[-1].update(preflight_line=preflight_line(s.preflight), preflight_ops=[
                {**x, "findings": preflight_findings(x)} for x in sorted(s.preflight["ops"], key=lambda x: (x["fits"], not x["splits"]))])
        if s.precision is not None:
            rows = precision_modules(s.precision)
            sections[-1].update(precision_rows=rows, precision_colors=PRECISION_COLORS, precision_plot=Markup(
                precision_svg(rows, s.precision["dtype"], title=f"headroom and error per module, {s.model} in "
                              f"{s.precision['dtype']} on {s.label}")))
    findings = [{**f, "state": sec["state"], "anchor": sec["anchor"]} for sec in sections for f in sec["failures"]]
    findings.sort(key=lambda f: not f["culprit"])  # stable: each state's order kept, culprits first
    models = sorted({s.model for s in states})
    verdicts = [s for s in states if s.has_cases]
    # Jinja escapes every value (autoescape); what is left to neutralize are the characters
    # that no escaping touches: controls, lone surrogates, line separators, bidi overrides.
    return visible_text(env.get_template("report.html.j2").render(
        title=title or f"tapml report: {', '.join(models)} on {', '.join(s.label for s in states)}",
        sections=sections, findings=findings, states=states, sources=list(dict.fromkeys(Path(s.path).name for s in states)),
        statuses=STATUSES, colors=STATUS_COLORS, matrix=_matrix(verdicts, by_case) if len(verdicts) > 1 else None,
        css=Markup((TEMPLATES / "report.css").read_text()), js=Markup((TEMPLATES / "report.js").read_text()),
        version=tapml_version, generated=datetime.datetime.now().strftime("%Y-%m-%d %H:%M")))


__all__ = ["render_html", "fmt_err", "fmt_pct", "fmt_ms", "visible_text"]
