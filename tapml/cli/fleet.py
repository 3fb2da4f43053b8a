"""``tapml fleet``: every model's carved cases on every device of a registry pool, as a matrix."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from tapml.cli.common import (EXIT_FINDING, EXIT_OK, JsonOpt, QuietOpt, TokenFileOpt, TokenMapOpt, TolOpt,
                              TrustRemoteCodeOpt, app, command, console, fail, is_store_path, out, progress_bar,
                              write_json)
from tapml.text import shown


@app.command(short_help="Run each model's cases on every device of a registry:// pool; a models x devices matrix.")
@command
def fleet(models: List[str] = typer.Argument(..., metavar="STORE_OR_MODEL...", help="Carve stores, or MODEL specs (zoo:NAME, hf:TYPE, "
                                                         "file.py:factory, file.pt2) carved first"),
          target: str = typer.Option(..., "--target", "-t", help="registry://HOST:PORT[?platform=P]: every live "
                                     "device server announced there is a column"),
          json_out: Optional[str] = JsonOpt, tol: Optional[List[str]] = TolOpt,
          token_file: Optional[str] = TokenFileOpt, token_map: Optional[str] = TokenMapOpt,
          by_op: bool = typer.Option(False, "--by-op", help="A matrix row per op (over all models), not per model"),
          all_rows: bool = typer.Option(False, "--all", help="List the rows that pass on every device too"),
          max_failures: int = typer.Option(3, "--max-failures", help="Consecutive lost-device failures after which "
                                           "a device leaves the run (its remaining cases are errors naming why)"),
          trust_remote_code: bool = TrustRemoteCodeOpt, quiet: bool = QuietOpt):
    """Run each model's carved cases on every device of the pool (devices in parallel, models
    queued) and print the models x devices matrix. Exit 0 when everything passes everywhere,
    1 otherwise (a failing case, or a device that dropped out), 2 bad input."""
    from tapml.carving import carve
    from tapml.carving.store import CarveStore
    from tapml.judging.compare import Tolerances
    from tapml.driving.fleet import run_fleet
    from tapml.remote.pool import DevicePool, is_pool_target
    from tapml.reports.data import fleet_document
    from tapml.driving.targets import check_target, read_tokens
    check_target(target)
    if not is_pool_target(target):
        fail(f"--target {target}: tapml fleet runs on a pool, registry://HOST:PORT[?platform=P]; for one device "
             "use `tapml replay STORE --target ...`")
    repeated = [m for i, m in enumerate(models) if m in models[:i]]
    if repeated:
        fail(f"{repeated[0]} is given twice; name each store or model once")
    if max_failures < 1:
        fail(f"--max-failures {max_failures}: give 1 or more")
    tolerances = Tolerances.parse(tol)
    tokens = read_tokens(token_file, token_map)
    from tapml.frontends.models import check_model_spec, is_model_file
    for m in models:
        if Path(m).exists() and not Path(m).is_dir() and not is_model_file(m):
            fail(f"{m} is a file, not a carve store or a model spec")
        if not is_store_path(m):
            check_model_spec(m)  # before any carving or pool: a missing store says so at once
    import tempfile
    with tempfile.TemporaryDirectory(prefix="tapml-fleet-") as scratch, DevicePool(target, token=tokens) as pool:
        stores = []
        for i, m in enumerate(models):
            if is_store_path(m):
                stores.append((m, CarveStore(m)))
                continue
            if not quiet:
                console.print(f"carving {shown(m)} ...", highlight=False)
            carve(m, Path(scratch) / f"store{i}")
            stores.append((m, CarveStore(Path(scratch) / f"store{i}")))
        total = sum(len(s.cases) for _, s in stores) * len(pool.devices)
        with progress_bar(quiet) as bar:
            task = bar.add_task(f"{len(stores)} model(s) on {len(pool.devices)} device(s)", total=total)
            result = run_fleet(stores, pool, tolerances=tolerances, max_failures=max_failures,
                               on_case=lambda *_: bar.advance(task))
    doc = fleet_document(**result, by_op=by_op)
    if json_out:
        write_json(doc, json_out)
    if json_out != "-":
        render_fleet(doc, by_op=by_op, all_rows=all_rows, quiet=quiet)
    raise typer.Exit(EXIT_OK if fleet_passed(doc) else EXIT_FINDING)


def fleet_passed(doc: dict) -> bool:
    """Whether every case passed on every device and no device dropped out."""
    return (all(d["status"] == "ok" for d in doc["devices"]) and
            all(v["summary"]["pass"] == len(v["cases"]) for per_device in doc["runs"].values()
                for v in per_device.values()))


def render_fleet(doc: dict, *, by_op: bool, all_rows: bool, quiet: bool) -> None:
    """The matrix (rows: models, or ops with ``by_op``; columns: devices), then a line per
    device (cases served, dropped out and why) and the summary line."""

    from tapml.reports.data import coverage_matrix, fleet_states
    from tapml.render import render_matrix
    states = fleet_states(doc["runs"], [d["target"] for d in doc["devices"]])
    if not quiet:
        render_matrix(coverage_matrix(states, by_model=not by_op), out, all_rows=all_rows, all_option="--all")
    for d in doc["devices"]:
        if d["status"] != "ok":
            out.print(f"[red]{shown(d['target'])} dropped out:[/] {shown(d['status'])}", highlight=False, soft_wrap=True)
        elif not quiet:
            out.print(f"{shown(d['target'])} ({shown(d['adapter'] or '?')}): {d['served']} cases", highlight=False)
    for target, reason in doc.get("left_out", {}).items():
        out.print(f"[yellow]{shown(target)} left out[/] (announced, not live when the run began): {shown(reason)}",
                  highlight=False, soft_wrap=True)
    cells = [v for per_device in doc["runs"].values() for v in per_device.values()]
    green = sum(v["summary"]["pass"] == len(v["cases"]) for v in cells)
    color = "green" if fleet_passed(doc) else "red"
    out.print(f"[{color}]{green}/{len(cells)} model x device cells pass[/] ({len(doc['models'])} model(s) on "
              f"{len(doc['devices'])} device(s))", highlight=False)
