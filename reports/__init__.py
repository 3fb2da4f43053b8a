"""Reports of replay verdicts and migration states: HTML, Markdown, JUnit XML and the terminal.

Example::

    from tapml.reports import write_report
    write_report(["gpt2.json"], "reports/gpt2.html")             # format from the suffix
    write_report(["vulkan.json", "gl.json"], "cov.md", format="md")
"""

from __future__ import annotations

from pathlib import Path

from tapml.errors import TapmlError
from tapml.io import write_text_atomic
from tapml.reports.data import StateReport, coverage_matrix, load_state, load_states, parse_state

FORMATS = ("html", "md", "junit")
SUFFIXES = {".html": "html", ".htm": "html", ".md": "md", ".markdown": "md", ".xml": "junit"}


def guess_format(out: str | Path | None, format: str | None = None) -> str:
    """The format asked for, else the one the output's suffix names, else html."""
    if format is not None:
        if format not in FORMATS:
            raise TapmlError(f"unknown report format {format!r}; use one of {', '.join(FORMATS)}")
        return format
    if out is None or str(out) == "-":
        return "md"
    return SUFFIXES.get(Path(out).suffix.lower(), "html")


def render(states: list[StateReport], format: str = "html", title: str | None = None) -> str:
    """The report of ``states`` as text in ``format`` (html, md or junit)."""
    if format == "html":
        from tapml.reports.html import render_html
        return render_html(states, title=title)
    if format == "md":
        from tapml.reports.markdown import render_markdown
        return render_markdown(states)
    if format == "junit":
        from tapml.reports.junit import render_junit
        return render_junit(states)
    raise TapmlError(f"unknown report format {format!r}; use one of {', '.join(FORMATS)}")


def write_report(states, out: str | Path, format: str | None = None, title: str | None = None) -> Path:
    """Write the report of ``states`` (one or a list of StateReports, state dicts or paths of
    state files) to ``out``, atomically; parent directories are created. Returns the path."""
    items = [states] if isinstance(states, (dict, str, Path, StateReport)) else list(states)
    if not items:
        raise TapmlError("no state files given; pass one or more STATE.json files")
    loaded = [s if isinstance(s, StateReport) else parse_state(s) if isinstance(s, dict) else None for s in items]
    paths = [p for p, s in zip(items, loaded) if s is None]
    if paths:
        from_files = iter(load_states(paths))
        loaded = [s if s is not None else next(from_files) for s in loaded]
    fmt = guess_format(out, format)
    text = render(loaded, fmt, title=title)
    target = Path(out)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(target, text)
    except OSError as e:
        raise TapmlError(f"cannot write report {out}: {e.strerror}") from None
    return target


__all__ = ["write_report", "render", "guess_format", "load_state", "load_states", "parse_state", "coverage_matrix",
           "StateReport", "FORMATS"]
