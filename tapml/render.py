"""Terminal renderings of verdicts and states with rich, shared by commands that show results.

Failures come first and are coloured by status; ``quiet`` keeps only the final line of each
state, for scripts that read the exit code (and ``--json`` for the data itself).
"""

from __future__ import annotations

STATUS_STYLE = {"pass": "green", "mismatch": "red", "error": "bold red", "unsupported": "yellow"}


def fmt_err(x: float | None) -> str:
    """An error statistic for the terminal: 3 significant digits, ``-`` when not compared.

    Example: ``fmt_err(0.000123456)`` -> ``'0.000123'``, ``fmt_err(None)`` -> ``'-'``."""
    return "-" if x is None else f"{x:.3g}"


def render_states(states, console, quiet: bool = False, max_rows: int = 30) -> None:
    """Print each :class:`~tapml.reports.data.StateReport`: its findings as a table (culprits
    first, marked), an op-coverage table when several states are given, and one summary line
    per state."""
    from rich.markup import escape
    from rich.table import Table
    if not quiet:
        for s in states:
            failures = s.failures
            if not failures:
                continue
            table = Table(title=f"findings: {escape(s.model)} on {escape(s.label)}", title_justify="left")
            for col in ("", "kind", "op", "node", "module", "status", "max_abs_err", "mismatch"):
                table.add_column(col, overflow="fold")
            for f in failures[:max_rows]:
                frac = "-" if f["mismatch_fraction"] is None else f"{f['mismatch_fraction']:.1%}"
                style = STATUS_STYLE.get(f["status"], "")
                table.add_row("[bold red]culprit[/]" if f["culprit"] else "", escape(f["kind"]), escape(f["op"]),
                              escape(f["node"]), escape(f["module"] or "<root>"),
                              f"[{style}]{escape(f['status'])}[/]", fmt_err(f["max_abs_err"]), frac)
            console.print(table)
            if len(failures) > max_rows:
                console.print(f"... and {len(failures) - max_rows} more (see the HTML report)")
        if len(states) > 1:
            from tapml.reports.data import coverage_matrix
            m = coverage_matrix(states)
            bad = [r for r in m["rows"] if any(c is None or c["status"] != "pass" for c in r["cells"])]
            table = Table(title=f"op coverage ({len(m['rows'])} ops, {len(bad)} not passing everywhere)",
                          title_justify="left")
            table.add_column("op")
            for label in m["labels"]:
                table.add_column(escape(label), justify="center")
            for r in bad[:max_rows]:
                table.add_row(escape(r["op"]), *[
                    "[dim]not run[/]" if c is None else
                    f"[{STATUS_STYLE[c['status']]}]{c['status']} {c['pass']}/{c['total']}[/]" for c in r["cells"]])
            table.add_row("[bold]cases passing[/]", *[f"{t['pass']}/{t['total']} ops" for t in m["totals"]])
            console.print(table)
    for s in states:
        summary, shares, e2e = s.summary, s.shares, s.end_to_end
        total = sum(summary.values())
        color = "green" if s.passed else "red"
        line = (f"[{color}]{escape(s.model)} on {escape(s.label)}: {summary['pass']}/{total} cases pass[/]"
                f", {summary['mismatch']} mismatch, {summary['unsupported']} unsupported, {summary['error']} error")
        if shares["basis"] == "placement" and shares["ops_share"] is not None:
            flops = "" if shares["flops_share"] is None else f", {shares['flops_share']:.1%} of FLOPs"
            line += f"; {shares['ops_share']:.1%} of ops{flops} on the target"
        if e2e is not None:
            line += (f"; end to end [{STATUS_STYLE.get(e2e['status'], '')}]{e2e['status']}[/] "
                     f"(max abs err {fmt_err(e2e['max_abs_err'])})")
        console.print(line, highlight=False)


__all__ = ["render_states", "fmt_err", "STATUS_STYLE"]
