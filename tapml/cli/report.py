"""``tapml report``: HTML, Markdown or JUnit XML from replay verdicts, migration states, multi-target
matrices, generations, fleets, precision analyses and preflights (every document kind a user looks at)."""

from __future__ import annotations

from typing import List, Optional

import typer

from tapml.cli.common import EXIT_FINDING, EXIT_OK, JsonOpt, QuietOpt, app, command, console, fail, out, write_json
from tapml.text import shown


@app.command(name="report", short_help="Render verdicts, states, generations, precision, preflights or fleets as "
                                         "HTML, Markdown or JUnit.")
@command
def report(states: List[str] = typer.Argument(..., help="Documents tapml wrote: Verdict JSON (`replay --json`), "
                                                         "migration states (`migrate --state`), multi-target and fleet "
                                                         "JSON, `generate --json`, `precision --json`, `inspect STORE "
                                                         "--target T --json`; several give an op-coverage matrix"),
           output: Optional[str] = typer.Option(None, "-o", "--output",
                                                help="Report file to write ('-' for stdout); without it the "
                                                     "report is shown in the terminal"),
           format: Optional[str] = typer.Option(None, "--format", "-f",
                                                help="html, md or junit (default: from the -o suffix "
                                                     ".html/.md/.xml, else html)"),
           title: Optional[str] = typer.Option(None, "--title", help="Title of the HTML report"),
           json_out: Optional[str] = JsonOpt, quiet: bool = QuietOpt):
    """Render STATES as one self-contained report: culprits first, per-op table, error per module,
    op coverage across targets, time per op. Exit 0 when every state passed, 1 when one has findings."""
    from tapml.reports import guess_format, load_states, render, write_report
    if json_out == "-" and (output == "-" or (format and not output)):
        fail("--json - and a report on stdout would mix on one stream; write one of them to a file")
    loaded = load_states(states)
    if json_out:
        write_json([s.to_json() for s in loaded], json_out)
    if output and output != "-":
        fmt = guess_format(output, format)
        path = write_report(loaded, output, format=fmt, title=title)
        if not quiet:
            console.print(f"wrote {fmt} report -> {shown(str(path))}: " + "; ".join(map(shown, map(describe, loaded))),
                          highlight=False, soft_wrap=True)
        _render_terminal(loaded, console, quiet=True)
    elif output == "-" or format:
        out.file.write(render(loaded, guess_format(output, format), title=title))
        out.file.flush()
    elif json_out != "-":
        _render_terminal(loaded, out, quiet=quiet)
    raise typer.Exit(EXIT_OK if all(s.passed for s in loaded) else EXIT_FINDING)


def describe(s) -> str:
    """One document of a report, as the line after writing it says: what it is and what it holds."""
    if s.precision is not None:
        p = s.precision
        return (f"precision analysis of {s.model} in {p['dtype']} on {s.label}: {len(p['ops'])} ops, per op and per "
                f"module along the depth, {len(p['keep_float32'])} kept in float32, end to end "
                f"{p['end_to_end']['after']['status']}")
    if s.preflight is not None:
        from tapml.reports.data import preflight_line
        return f"preflight of {s.model}: {preflight_line(s.preflight)}"
    if s.bench is not None:
        from tapml.reports.data import bench_line
        return f"benchmark {s.model} on {s.label}: {bench_line(s.bench)}"
    if s.generation is not None:
        g = s.generation["summary"]
        return (f"generation of {s.model} on {s.label}: {g['steps']} steps, {g['pass']} pass, {g['near_tie']} near-tie, "
                f"{g['mismatch']} mismatch, {g['error']} error")
    culprits = sum(1 for f in s.failures if f["culprit"])
    return f"{s.kind} of {s.model} on {s.label}: {len(s.cases)} cases, {culprits} culprit(s)"


def _render_terminal(states, console, quiet: bool) -> None:
    """Precision analyses as `tapml precision` prints them, preflights as a line and a table of the ops
    that split or do not fit; every other document as render_states does."""
    from tapml.cli.precision import render_precision
    from tapml.render import render_states
    for s in states:
        if s.precision is not None:
            render_precision(s.precision, console, quiet=quiet)
        if s.preflight is not None:
            _render_preflight(s, console, quiet)
        if s.bench is not None:
            console.print(describe(s), highlight=False, soft_wrap=True)
    others = [s for s in states if s.has_cases]
    if others:
        render_states(others, console, quiet=quiet)


def _render_preflight(s, console, quiet: bool) -> None:
    from rich.table import Table

    from tapml.reports.data import preflight_findings
    console.print(describe(s), highlight=False, soft_wrap=True)
    flagged = [x for x in s.preflight["ops"] if x["splits"] or not x["fits"]]
    if quiet or not flagged:
        return
    table = Table(title="ops that split or do not fit")
    for col in ("op", "cases", "fits", "splits and limits"):
        table.add_column(col)
    for x in flagged:
        table.add_row(shown(x["op"]), str(x["cases"]), "yes" if x["fits"] else "no", shown("; ".join(preflight_findings(x))))
    console.print(table)
