"""Terminal renderings of verdicts and states with rich, shared by commands that show results.

Failures come first and are coloured by status; ``quiet`` keeps only the final line of each
state, for scripts that read the exit code (and ``--json`` for the data itself).
"""

from __future__ import annotations

from tapml.text import shown

STATUS_STYLE = {"pass": "green", "mismatch": "red", "error": "bold red", "unsupported": "yellow", "flaky": "magenta"}


def fmt_err(x: float | None) -> str:
    """An error statistic for the terminal: 3 significant digits, ``-`` when not compared.

    Example: ``fmt_err(0.000123456)`` -> ``'0.000123'``, ``fmt_err(None)`` -> ``'-'``."""
    return "-" if x is None else f"{x:.3g}"


def fmt_percent(x: float | None) -> str:
    """A fraction as a percentage with one decimal, ``-`` when unknown: ``fmt_percent(0.4567)`` -> ``'45.7%'``."""
    return "-" if x is None else f"{100 * x:.1f}%"


def roofline_text(peaks: dict) -> str:
    """A device's probed roofline (tapml.platforms.roofline) in one phrase, empty when unknown:
    ``'peak 105 GFLOP/s, loads 10.4 GB/s, workgroup memory 17.6 GB/s, dispatch 28 us'``."""
    if not peaks.get("peak_gflops"):
        return ""
    return (f"peak {peaks['peak_gflops']:.3g} GFLOP/s, loads {peaks.get('storage_gbps') or 0:.3g} GB/s, "
            f"workgroup memory {peaks.get('workgroup_gbps') or 0:.3g} GB/s, dispatch {peaks.get('dispatch_us') or 0:.3g} us")


def keep_names_whole(table, headers=("op",)) -> None:
    """Never wrap or cut the cells of the columns named ``headers`` of a rich ``table`` (op names are
    what a user greps for): at 80 columns (CI logs, pipes) the other columns fold instead. Call it
    once the rows are in."""
    from rich.text import Text
    for column in table.columns:
        if str(column.header) in headers:
            column.no_wrap = True
            column.min_width = max([len(str(column.header))] +
                                   [Text.from_markup(c).cell_len if isinstance(c, str) else 0 for c in column.cells])


GROUP_TITLES = {"differs": "differs between targets", "fails": "fails on every target",
                "passes": "passes on every target"}


def render_matrix(matrix: dict, console, all_rows: bool = False, max_rows: int | None = None,
                  all_option: str | None = None) -> None:
    """Print a :func:`~tapml.reports.data.coverage_matrix`: a header naming each target's adapter,
    then a table with a column per target and a row per op (per case when the matrix has them)
    whose cell is the worst status, passing cases and largest error there. Rows that pass on one
    target and fail on another come first, then rows failing everywhere; rows passing everywhere
    are one count line unless ``all_rows`` (naming ``all_option``, the option that lists them, when
    there is one). ``max_rows`` caps the rows of each group (None: no cap)."""
    from rich.table import Table
    rows, groups = matrix["rows"], matrix["groups"]
    by_case = any("case" in r for r in rows)
    what = matrix.get("rows_are") or ("cases" if by_case else "ops")
    row_name = "model" if what == "models" else "op"
    console.print(f"[bold]{row_name} coverage: {len(rows)} {what} on {len(matrix['columns'])} targets[/]; {groups['differs']} "
                  f"differ between targets, {groups['fails']} fail everywhere, {groups['passes']} pass everywhere",
                  highlight=False)
    for label, col in zip(matrix["labels"], matrix["columns"]):
        backend = f" [{col['backend']}]" if col["backend"] else ""
        console.print(f"  {shown(label)}: {shown((col['adapter'] or '?') + backend)}", highlight=False, soft_wrap=True)
    table = Table()
    table.add_column(row_name, no_wrap=True)
    if by_case:
        table.add_column("case")
    for label in matrix["labels"]:
        table.add_column(shown(label), justify="center", overflow="fold")
    blank = [""] * (by_case + len(matrix["columns"]))
    for group in ("differs", "fails") + (("passes",) if all_rows else ()):
        members = [r for r in rows if r["group"] == group]
        if not members:
            continue
        table.add_row(f"[bold]{GROUP_TITLES[group]}[/]", *blank)
        listed = members if max_rows is None else members[:max_rows]
        for r in listed:
            table.add_row(shown(r["op"]), *([shown(r["case"])] if by_case else []), *map(_matrix_cell, r["cells"]))
        if len(listed) < len(members):
            table.add_row(f"[dim]... and {len(members) - len(listed)} more[/]", *blank)
        table.add_section()
    table.add_row("[bold]passing[/]", *([""] if by_case else []),
                  *[f"{t['pass']}/{t['total']} {what}" for t in matrix["totals"]])
    keep_names_whole(table, (row_name,))
    console.print(table)
    if groups["passes"] and not all_rows:
        console.print(f"[green]{groups['passes']} {what} pass on every target[/]" +
                      (f" ({all_option} lists them)" if all_option else ""), highlight=False)


def _matrix_cell(cell: dict | None) -> str:
    if cell is None:
        return "[dim]not run[/]"
    style = STATUS_STYLE.get(cell["status"], "magenta")
    err = "" if cell["status"] == "pass" or cell["max_abs_err"] is None else f" {fmt_err(cell['max_abs_err'])}"
    return f"[{style}]{shown(cell['status'])} {cell['pass']}/{cell['total']}{err}[/]"


def render_states(states, console, quiet: bool = False, max_rows: int = 30) -> None:
    """Print each :class:`~tapml.reports.data.StateReport`: its findings as a table (culprits
    first, marked), an op-coverage table when several states are given, and one summary line
    per state."""
    from rich.table import Table
    if not quiet:
        for s in states:
            failures = s.failures
            if not failures:
                continue
            table = Table(title=f"findings: {shown(s.model)} on {shown(s.label)}", title_justify="left")
            for col in ("", "kind", "op", "node", "module", "status", "max_abs_err", "mismatch"):
                table.add_column(col, overflow="fold")
            for f in failures[:max_rows]:
                frac = "-" if f["mismatch_fraction"] is None else f"{f['mismatch_fraction']:.1%}"
                style = STATUS_STYLE.get(f["status"], "")
                table.add_row("[bold red]culprit[/]" if f["culprit"] else "", shown(f["kind"]), shown(f["op"]),
                              shown(f["node"]), shown(f["module"] or "<root>"),
                              f"[{style}]{shown(f['status'])}[/]", fmt_err(f["max_abs_err"]), frac)
            keep_names_whole(table, ("", "op"))  # the culprit mark, too, is a word to grep for
            console.print(table)
            if len(failures) > max_rows:
                console.print(f"... and {len(failures) - max_rows} more (see the HTML report)")
        if len(states) > 1:
            from tapml.reports.data import coverage_matrix
            render_matrix(coverage_matrix(states), console, max_rows=max_rows)
    for s in states:
        if s.generation is not None:
            g = s.generation["summary"]
            color = "green" if s.passed else "red"
            console.print(f"[{color}]{shown(s.model)} on {shown(s.label)}: {g['pass']}/{g['steps']} steps pass[/], "
                          f"{g['near_tie']} near-tie, {g['mismatch']} mismatch, {g['error']} error"
                          + ("" if g.get("first_failure") is None else f"; first failure at step {g['first_failure']}"),
                          highlight=False)
            continue
        summary, shares, e2e = s.summary, s.shares, s.end_to_end
        total = sum(summary.values())
        color = "green" if s.passed else "red"
        line = (f"[{color}]{shown(s.model)} on {shown(s.label)}: {summary['pass']}/{total} cases pass[/]"
                f", {summary['mismatch']} mismatch, {summary['unsupported']} unsupported, {summary['error']} error"
                + (f", {summary['flaky']} flaky" if summary.get("flaky") else ""))
        if shares["basis"] == "placement" and shares["ops_share"] is not None:
            flops = "" if shares["flops_share"] is None else f", {shares['flops_share']:.1%} of FLOPs"
            line += f"; {shares['ops_share']:.1%} of ops{flops} on the target"
        if e2e is not None:
            line += (f"; end to end [{STATUS_STYLE.get(e2e['status'], '')}]{shown(e2e['status'])}[/] "
                     f"(max abs err {fmt_err(e2e['max_abs_err'])})")
        console.print(line, highlight=False)


__all__ = ["render_states", "render_matrix", "fmt_err", "STATUS_STYLE"]
