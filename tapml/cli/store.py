"""``tapml carve``, ``tapml inspect`` and ``tapml replay``: make a carve store, list it, run it on a target."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from tapml.cli.common import (EXIT_FINDING, EXIT_OK, InjectOpt, JsonOpt, QuietOpt, TokenFileOpt, TolOpt,
                              app, command, console, fail, open_store, out, progress_bar, write_json)


@app.command()
@command
def carve(model: str = typer.Argument(..., help="zoo:NAME, hf:MODEL_TYPE, path/file.py:factory or file.pt2"),
          output: str = typer.Option(..., "-o", "--output", help="Store directory to write"),
          device: str = typer.Option("cpu", "--device", help="Reference device: cpu or cuda"),
          seed: int = typer.Option(0, "--seed", help="Seed for weights and inputs"),
          hf_config: Optional[List[str]] = typer.Option(None, "--hf-config", help="KEY=VALUE config override for hf: models"),
          quiet: bool = QuietOpt, json_out: Optional[str] = JsonOpt):
    """Run MODEL on the reference and record every operator call as a test case."""
    from tapml.carving import carve as carve_model
    from tapml.models import parse_hf_overrides
    target = Path(output)
    if target.exists() and (not target.is_dir() or any(p.name != "manifest.json" and p.name != "shards"
                                                          for p in target.iterdir())):
        fail(f"{output} exists and is not an empty directory or a carve store; choose another -o")
    overrides = parse_hf_overrides(hf_config)
    with progress_bar(quiet) as bar:  # carve() leaves no half store behind
        task = bar.add_task(f"carving {model}", total=None)
        info = carve_model(model, output, seed=seed, device=device, hf_config=overrides,
                           on_start=lambda n: bar.update(task, total=n), on_node=lambda _: bar.advance(task))
    if json_out:
        write_json({"model": model, "store": str(Path(output).resolve()), **info}, json_out)
    console.print(f"carved [bold]{model}[/] -> {output}: {info['nodes']} nodes, {info['cases']} cases, "
                  f"{info['ops']} ops, {info['bytes'] / 1e6:.1f} MB "
                  f"(export {info['export_s']:.1f}s, carve {info['carve_s']:.1f}s)", highlight=False)


@app.command()
@command
def inspect(store: str = typer.Argument(..., help="Carve store directory"), json_out: Optional[str] = JsonOpt,
            quiet: bool = QuietOpt):
    """List the ops of a store: cases, instances, shapes and dtypes."""
    from rich.table import Table
    s = open_store(store)
    ops: dict[str, dict] = {}
    for c in s.cases:
        row = ops.setdefault(c["op"], {"op": c["op"], "cases": 0, "instances": 0, "shapes": [], "dtypes": set()})
        row["cases"] += 1
        row["instances"] += c["instances"]
        metas = [s.tensor_index[n] for n in c["inputs"]]
        row["shapes"].append(",".join("x".join(map(str, m["shape"])) or "()" for m in metas))
        row["dtypes"].update(m["dtype"] for m in metas + c["output_meta"])
    rows = sorted(ops.values(), key=lambda r: -r["instances"])
    if json_out:
        write_json([{**r, "dtypes": sorted(r["dtypes"])} for r in rows], json_out)
        return
    title = f"{s.model}: {len(rows)} ops, {len(s.cases)} cases, {len(s.graph.nodes)} nodes"
    if quiet:
        out.print(title, highlight=False)
        return
    table = Table(title=title)
    for col in ("op", "cases", "instances", "shapes", "dtypes"):
        table.add_column(col, justify="right" if col in ("cases", "instances") else "left")
    for r in rows:
        shapes = "; ".join(r["shapes"][:3]) + (f" (+{len(r['shapes']) - 3})" if len(r["shapes"]) > 3 else "")
        table.add_row(r["op"], str(r["cases"]), str(r["instances"]), shapes, ",".join(sorted(r["dtypes"])))
    out.print(table)


def render_verdicts(result: dict, quiet: bool = False) -> None:
    """Failures as a table, then the summary line."""
    from rich.table import Table
    bad = [v for v in result["cases"] if v["status"] != "pass"]
    if bad and not quiet:
        table = Table(title=f"cases that did not pass on {result['target']}")
        for col in ("id", "op", "node", "module", "status", "max_abs_err", "message"):
            table.add_column(col, overflow="fold")
        style = {"mismatch": "red", "error": "bold red", "unsupported": "yellow"}
        for v in bad[:50]:
            err = "" if v["max_abs_err"] is None else f"{v['max_abs_err']:.3g}"
            table.add_row(v["id"], v["op"], v["node"], v["module"], f"[{style[v['status']]}]{v['status']}[/]",
                          err, v["message"][:160])
        out.print(table)
        if len(bad) > 50:
            out.print(f"... and {len(bad) - 50} more (see --json)")
    s = result["summary"]
    total = sum(s.values())
    color = "green" if s["pass"] == total else "red"
    out.print(f"[{color}]{s['pass']}/{total} pass[/], {s['mismatch']} mismatch, {s['unsupported']} unsupported, "
              f"{s['error']} error on {result['target']} ({result['device'].get('adapter', '')})", highlight=False)


TargetsOpt = typer.Option(["reference"], "--target", "-t",
                          help="reference, wgpu[:vulkan|gl|metal|dx12], browser, remote://HOST:PORT; repeatable: several "
                               "targets run one after another into one matrix, and --inject then goes into every "
                               "target but reference")
ByCaseOpt = typer.Option(False, "--by-case", help="With several --target: a matrix row per case, not per op")
AllRowsOpt = typer.Option(False, "--all", help="With several --target: list the rows that pass everywhere too")


def check_targets(targets: Optional[List[str]]) -> list[str]:
    """The --target values, each validated and named once (exit 2 otherwise); ``reference`` when none."""
    from tapml.targets import check_target
    targets = list(targets or ["reference"])
    for t in targets:
        check_target(t)
    repeated = [t for i, t in enumerate(targets) if t in targets[:i]]
    if repeated:
        fail(f"--target {repeated[0]} is given twice; name each target once")
    return targets


def render_matrix_run(verdicts: dict[str, dict], by_case: bool, all_rows: bool, quiet: bool, json_out: Optional[str],
                      render_one) -> int:
    """Write (``--json``) and print the result of a run on several targets: ``verdicts`` is
    ``{target: Verdict JSON or state}``, ``render_one(doc, quiet)`` prints one target's own lines.
    Returns the exit code: 0 when everything passed on every target, else 1."""
    from tapml.reports.data import coverage_matrix, matrix_document, parse_state
    from tapml.render import render_matrix
    if json_out:
        write_json(matrix_document(verdicts, by_case=by_case), json_out)
    states = [parse_state(doc, f"<verdicts of {t}>") for t, doc in verdicts.items()]
    if json_out != "-":
        if not quiet:
            render_matrix(coverage_matrix(states, by_case=by_case), out, all_rows=all_rows, all_option="--all")
        for doc in verdicts.values():
            render_one(doc, True)
    return EXIT_OK if all(s.passed for s in states) else EXIT_FINDING


def replay_matrix(store, targets: list[str], *, token, inject, json_out, quiet, by_case, all_rows, cases, **options):
    """``tapml replay`` with several --target: each target in turn, then one matrix; exits."""
    from tapml.replay import replay_targets
    with progress_bar(quiet) as bar:
        tasks = [bar.add_task(f"replay on {t}", total=len(cases), visible=False) for t in targets]
        current = {}

        def start(target, i):
            current["task"] = tasks[i]
            bar.update(tasks[i], visible=True)

        verdicts = replay_targets(store, targets, token=token, inject=inject, on_target=start, cases=cases,
                                  on_case=lambda v: bar.advance(current["task"]), **options)
    raise typer.Exit(render_matrix_run(verdicts, by_case, all_rows, quiet, json_out, render_verdicts))


@app.command()
@command
def replay(store: str = typer.Argument(..., help="Carve store directory"),
           target: List[str] = TargetsOpt, json_out: Optional[str] = JsonOpt, tol: Optional[List[str]] = TolOpt,
           inject: Optional[List[str]] = InjectOpt, token_file: Optional[str] = TokenFileOpt,
           anchored: bool = typer.Option(False, "--fp64-anchored", help="Judge float errors against a float64 recomputation"),
           op: Optional[List[str]] = typer.Option(None, "--op", help="Only cases of this op (repeatable)"),
           by_case: bool = ByCaseOpt, all_rows: bool = AllRowsOpt,
           quiet: bool = QuietOpt):
    """Run every carved case of STORE on TARGET and compare with the reference. With several
    --target, every case runs on every target (one after another) and one matrix shows them."""
    from tapml.compare import Tolerances
    from tapml.replay import replay as replay_store
    from tapml.targets import open_target, read_token
    targets = check_targets(target)
    tolerances = Tolerances.parse(tol)
    s = open_store(store)
    cases = [c for c in s.cases if not op or c["op"] in op]
    if op and not cases:
        fail(f"no cases of {', '.join(op)} in {store}; `tapml inspect {store}` lists its ops")
    if len(targets) > 1:
        replay_matrix(s, targets, token=read_token(token_file), inject=inject, json_out=json_out, quiet=quiet,
                      by_case=by_case, all_rows=all_rows, tolerances=tolerances, anchored=anchored, cases=cases)
    target = targets[0]
    with open_target(target, token=read_token(token_file), inject=inject) as platform, progress_bar(quiet) as bar:
        task = bar.add_task(f"replay on {target}", total=len(cases))
        result = replay_store(s, platform, target, tolerances, anchored=anchored, cases=cases,
                              on_case=lambda v: bar.advance(task))
    if json_out:
        write_json(result, json_out)
    if json_out != "-":
        render_verdicts(result, quiet)
    raise typer.Exit(EXIT_OK if result["summary"]["pass"] == len(result["cases"]) else EXIT_FINDING)
