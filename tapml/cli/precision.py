"""``tapml precision``: where float16/bfloat16 precision runs out in a model on a target, and which
ops must stay in float32."""

from __future__ import annotations

import functools
from typing import List, Optional

import typer

from tapml.cli.common import (TrustRemoteCodeOpt, check_dtype, is_store_path, EXIT_FINDING, EXIT_OK, JsonOpt, QuietOpt, StoreDirOpt, TargetOpt, TokenFileOpt, TolOpt,
                              app, command, console, fail, model_store, out, write_json)
from tapml.cli.migrate import HfConfigOpt
from tapml.render import STATUS_STYLE, fmt_err
from tapml.text import shown

#: The dtype a MODEL is carved in when --dtype is not given.
DEFAULT_DTYPE = "float16"


@app.command(name="precision", short_help="Find where float16/bfloat16 runs out: headroom, overflow and error per op, "
                                          "the ops to keep in float32.")
@command
def precision(model: str = typer.Argument(..., help="A store carved in float16/bfloat16, or a MODEL spec to carve "
                                                    "in --dtype first"),
              target: str = TargetOpt,
              dtype: Optional[str] = typer.Option(None, "--dtype", help="float16 or bfloat16: the dtype to carve "
                                                  f"MODEL in (default {DEFAULT_DTYPE}); a STORE keeps its own"),
              store_dir: Optional[str] = StoreDirOpt,
              seed: int = typer.Option(0, "--seed", help="Seed for weights and inputs when carving MODEL"),
              hf_config: Optional[List[str]] = HfConfigOpt, tol: Optional[List[str]] = TolOpt,
              trust_remote_code: bool = TrustRemoteCodeOpt,
              token_file: Optional[str] = TokenFileOpt, json_out: Optional[str] = JsonOpt, quiet: bool = QuietOpt):
    """Run MODEL in float16 (or bfloat16) on TARGET with every intermediate kept and compare each op
    with the same model in float32 and float64: the largest activation and its headroom to the
    dtype's largest finite value, overflow to Inf/NaN, overflows a later op absorbed, the error.
    Lists the ops that must stay in float32 and checks the model end to end without and with them
    in float32. Exit 0 when the model passes with that list applied, 1 when it does not, 2 on bad input."""
    from tapml.judging.compare import Tolerances
    from tapml.dtypes import LOW_FLOATS
    from tapml.frontends.models import parse_hf_overrides
    from tapml.driving.precision import analyze, passed
    from tapml.driving.replay import device_info
    from tapml.driving.targets import check_target, open_target, read_token

    check_target(target)
    tolerances = Tolerances.parse(tol)
    if dtype is not None and dtype not in LOW_FLOATS:
        fail(f"--dtype {dtype}: precision analysis is about {' or '.join(LOW_FLOATS)}; float32 is what it compares with")
    if dtype is None and not is_store_path(model):  # a float16/bfloat16 checkpoint: the dtype it is stored in
        stored = check_dtype(None, model, quiet=True)
        dtype = stored if stored in LOW_FLOATS else None
    overrides = parse_hf_overrides(hf_config)
    carve = functools.partial(_carve, model, dtype=dtype or DEFAULT_DTYPE, seed=seed, hf_config=overrides, quiet=quiet)
    with model_store(model, store_dir=store_dir, hf_config=hf_config, purpose="precision", what="a carve store",
                     carve=carve) as (store, _), open_target(target, token=read_token(token_file)) as platform:
        doc = analyze(store, platform, target, dtype=dtype, tolerances=tolerances, device=device_info(platform),
                      on_round=None if quiet or json_out == "-" else _round_line)
    if json_out:
        write_json(doc, json_out)
    if json_out != "-":
        render_precision(doc, out, quiet)
    raise typer.Exit(EXIT_OK if passed(doc) else EXIT_FINDING)


def _carve(model: str, out_dir, *, dtype: str, seed: int, hf_config: dict, quiet: bool):
    from tapml.carving import CarveStore, carve
    if not quiet:
        console.print(f"carving {shown(model)} in {dtype}", highlight=False)
    carve(model, out_dir, seed=seed, hf_config=hf_config or None, dtype=dtype)
    return CarveStore(out_dir)


def _round_line(round_: int, kept: int) -> None:
    console.print(f"running with {kept} op(s) in float32 (round {round_})", highlight=False)


def render_precision(doc: dict, console, quiet: bool = False, max_rows: int = 60) -> None:
    """Print a precision document (:func:`tapml.driving.precision.analyze`, or one read back with
    :func:`tapml.judging.verdict.read_precision_document`): a table by module along the depth of the model
    (ops, largest activation, headroom, overflows, absorbed overflows, error against float64), the
    keep_float32 list, and one line per end-to-end run. ``quiet`` prints only the last line."""
    from rich.table import Table

    from tapml.reports.data import precision_modules
    dtype, e2e = doc["dtype"], doc["end_to_end"]
    if not quiet:
        table = Table(title=f"{shown(doc.get('model') or '?')} in {dtype} on {shown(doc['target'])}, by module "
                            "along the depth", title_justify="left")
        for col, justify in (("module", "left"), ("ops", "right"), ("max |x|", "right"), ("headroom", "right"),
                             ("overflow", "right"), ("absorbed", "right"), ("kept", "right"),
                             ("err vs fp64", "right")):
            table.add_column(col, justify=justify, overflow="fold")
        rows = precision_modules(doc)
        for r in rows[:max_rows]:
            bad = r["overflow"] > 0
            headroom = "-" if r["headroom"] is None else f"{r['headroom']:.3g}"
            table.add_row(shown(r["module"] or "<root>"), str(r["ops"]), fmt_err(r["max_abs"]),
                          f"[red]{headroom}[/]" if r["headroom"] is not None and r["headroom"] < 1 else headroom,
                          f"[red]{r['overflow']}[/]" if bad else "0",
                          f"[yellow]{r['absorbed']}[/]" if r["absorbed"] else "0", str(r["kept"]),
                          "[red]inf[/]" if r["err_vs_fp64"] == float("inf") else fmt_err(r["err_vs_fp64"]))
        console.print(table)
        if len(rows) > max_rows:
            console.print(f"... and {len(rows) - max_rows} more modules (--json, or tapml report, has them all)")
        keep = doc["keep_float32"]
        console.print(f"keep_float32 ({len(keep)}): " + (shown(", ".join(keep)) if keep else f"none, every op fits {dtype}"),
                      highlight=False, soft_wrap=True)
        if doc.get("keep_float32_modules"):
            console.print("whole modules: " + shown(", ".join(m or "<root>" for m in doc["keep_float32_modules"])),
                          highlight=False, soft_wrap=True)
    for label, run in ((f"end to end in {dtype}", e2e["before"]), ("with keep_float32 in float32", e2e["after"])):
        style = STATUS_STYLE.get(run["status"], "")
        line = f"{label}: [{style}]{shown(run['status'])}[/] (max abs err {fmt_err(run['max_abs_err'])})"
        if run["status"] != "pass" and run["message"] and not quiet:
            line += f": {shown(run['message'][:200])}"
        console.print(line, highlight=False, soft_wrap=True)
    if doc.get("cause"):
        console.print(f"[red]cause[/]: {shown(doc['cause']['message'])}", highlight=False, soft_wrap=True)
