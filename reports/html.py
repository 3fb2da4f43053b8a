"""One self-contained HTML report: CSS, JavaScript and SVG inlined, nothing fetched.

Example::

    from tapml.reports import load_states, render_html
    Path("reports/gpt2.html").write_text(render_html(load_states(["s.json"])))
"""

from __future__ import annotations

import datetime
import math
from pathlib import Path

from tapml.reports.data import STATUSES, StateReport, coverage_matrix
from tapml.reports.plot import STATUS_COLORS, module_error_svg

TEMPLATES = Path(__file__).parent / "templates"


def fmt_err(x) -> str:
    """An error statistic for people: 3 significant digits, ``—`` when not compared."""
    if x is None:
        return "—"
    if isinstance(x, float) and math.isinf(x):
        return "∞"
    if x == 0:
        return "0"
    return f"{x:.3g}" if 1e-3 <= abs(x) < 1e4 else f"{x:.2e}"


def fmt_pct(x, digits: int = 1) -> str:
    return "—" if x is None else f"{100 * x:.{digits}f}%"


def fmt_ms(x) -> str:
    if x is None:
        return "—"
    return f"{x:.3f}" if x < 10 else f"{x:.1f}"


def sort_value(x) -> str:
    """The ``data-v`` a sortable cell carries: a number, or empty (sorted last) when missing."""
    if x is None:
        return ""
    if isinstance(x, float) and math.isinf(x):
        return "1e308"
    return repr(float(x))


def _environment():
    import jinja2
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(TEMPLATES)), autoescape=True,
                             undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True)
    env.filters.update(err=fmt_err, pct=fmt_pct, ms=fmt_ms, v=sort_value)
    return env


def render_html(states: list[StateReport], title: str | None = None) -> str:
    """The report of one or more states as one HTML document (a string)."""
    from markupsafe import Markup

    from tapml import version
    tapml_version = version()
    env = _environment()
    sections = []
    for i, s in enumerate(states):
        sections.append({"state": s, "anchor": f"s{i}", "failures": s.failures, "shares": s.shares,
                         "summary": s.summary, "op_times": s.op_times(),
                         "plot": Markup(module_error_svg(s.module_errors(), s.end_to_end,
                                                         title=f"error per module, {s.model} on {s.label}"))})
    findings = [{**f, "state": sec["state"], "anchor": sec["anchor"]} for sec in sections for f in sec["failures"]]
    findings.sort(key=lambda f: not f["culprit"])  # stable: each state's order kept, culprits first
    models = sorted({s.model for s in states})
    return env.get_template("report.html.j2").render(
        title=title or f"tapml report: {', '.join(models)} on {', '.join(s.label for s in states)}",
        sections=sections, findings=findings, states=states, sources=[Path(s.path).name for s in states], statuses=STATUSES, colors=STATUS_COLORS,
        matrix=coverage_matrix(states) if len(states) > 1 else None,
        css=Markup((TEMPLATES / "report.css").read_text()), js=Markup((TEMPLATES / "report.js").read_text()),
        version=tapml_version, generated=datetime.datetime.now().strftime("%Y-%m-%d %H:%M"))


__all__ = ["render_html", "fmt_err", "fmt_pct", "fmt_ms"]
