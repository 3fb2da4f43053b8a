"""``tapml targets``: every kind of target this environment can open, and what each needs."""

from __future__ import annotations

from typing import List, Optional

import typer

from tapml.cli.common import EXIT_FINDING, EXIT_OK, JsonOpt, app, command, out, write_json


@app.command(short_help="List every target kind (built-in, backends, entry points, file.py:Class) and what each needs.")
@command
def targets(specs: Optional[List[str]] = typer.Argument(
                None, metavar="[BACKEND_SPEC]...",
                help="Also describe these backend TARGET specs (path/to/file.py:Class runs that file's code)"),
            json_out: Optional[str] = JsonOpt):
    """List the target kinds: the built-in platforms, the built-in backends (iree, ort), the backends
    installed packages register in the ``tapml.backends`` entry-point group, and each BACKEND_SPEC
    given, with the forms each takes, what it needs and whether it can be imported now. No device is
    opened. Exit 0, or 1 when a BACKEND_SPEC given cannot be loaded."""
    from rich.table import Table
    from rich.text import Text

    from tapml.platforms.targets import describe_targets
    from tapml.text import plain
    rows = describe_targets(tuple(specs or ()))
    if json_out:
        write_json({"targets": rows}, json_out)
    table = Table(title="targets", title_justify="left")
    for column in ("target", "kind", "forms", "needs", "importable"):
        table.add_column(column, overflow="fold")
    for row in rows:
        ok = "yes" if row["importable"] else f"no: {'; '.join(row['missing'])}"
        table.add_row(*(Text(plain(x)) for x in (row["target"], row["kind"], ", ".join(row["forms"]),
                                                   row["needs"] + (f" (control: {row['control']})" if row["control"] else ""),
                                                   ok)))
    out.print(table)
    given = [r for r in rows if r["target"] in (specs or ())]
    raise typer.Exit(EXIT_FINDING if any(not r["importable"] for r in given) else EXIT_OK)
