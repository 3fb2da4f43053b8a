"""``tapml precision``: where float16/bfloat16 precision runs out in a model on a target, and which
ops must stay in float32."""

from __future__ import annotations

import functools
from typing import List, Optional

import typer

from tapml.cli.common import (TrustRemoteCodeOpt, check_dtype, is_store_path, EXIT_FINDING, EXIT_OK, JsonOpt, QuietOpt, StoreDirOpt, TargetOpt, TokenFileOpt, TolOpt,
                              app, command, console, fail, model_store, out, write_json, QuantizeOpt, check_quantize)
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
              trust_remote_code: bool = TrustRemoteCodeOpt, quantize: Optional[str] = QuantizeOpt,
              text_file: Optional[str] = typer.Option(None, "--text-file", help="With --quantize: a UTF-8 text whose "
                                                      "tokens (the model's own tokenizer) both models run for the "
                                                      "quality figures and perplexity (default: the example inputs)"),
              token_file: Optional[str] = TokenFileOpt, json_out: Optional[str] = JsonOpt, quiet: bool = QuietOpt):
    """Run MODEL in float16 (or bfloat16) on TARGET with every intermediate kept and compare each op
    with the same model in float32 and float64: the largest activation and its headroom to the
    dtype's largest finite value, overflow to Inf/NaN, overflows a later op absorbed, the error.
    Lists the ops that must stay in float32 and checks the model end to end without and with them
    in float32. Exit 0 when the model passes with that list applied, 1 when it does not, 2 on bad input.

    With --quantize SCHEME the model is carved quantized, and its quality against the float model is
    added apart (never a verdict): per quantized layer the SQNR of its output, on the logits the mean
    KL divergence and the share of the same top-1 token, and each model's perplexity on the tokens."""
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
    quantize = check_quantize(quantize, model)
    if text_file is not None and quantize is None:
        fail("--text-file belongs to --quantize: the text the float and the quantized model are compared on")
    quality = _quality(model, quantize, seed=seed, hf_config=overrides, text_file=text_file, quiet=quiet) \
        if quantize else None
    carve = functools.partial(_carve, model, dtype=dtype or DEFAULT_DTYPE, seed=seed, hf_config=overrides, quiet=quiet,
                              quantize=quantize)
    with model_store(model, store_dir=store_dir, hf_config=hf_config, purpose="precision", what="a carve store",
                     carve=carve) as (store, _), open_target(target, token=read_token(token_file)) as platform:
        doc = analyze(store, platform, target, dtype=dtype, tolerances=tolerances, device=device_info(platform),
                      on_round=None if quiet or json_out == "-" else _round_line)
    if quality is not None:
        doc["quantization"] = quality
    if json_out:
        write_json(doc, json_out)
    if json_out != "-":
        render_precision(doc, out, quiet)
    raise typer.Exit(EXIT_OK if passed(doc) else EXIT_FINDING)


def _carve(model: str, out_dir, *, dtype: str, seed: int, hf_config: dict, quiet: bool, quantize: Optional[str] = None):
    from tapml.carving import CarveStore, carve
    if not quiet:
        console.print(f"carving {shown(model)} in {dtype}" + (f", quantized {quantize}" if quantize else ""),
                      highlight=False)
    carve(model, out_dir, seed=seed, hf_config=hf_config or None, dtype=dtype, quantize=quantize)
    return CarveStore(out_dir)


def _quality(model: str, scheme: str, *, seed: int, hf_config: dict, text_file: Optional[str], quiet: bool) -> dict:
    """The quantization quality part (tapml.driving.quantization), on the text's tokens when given."""
    from tapml.driving.quantization import quantization_quality
    ids = None
    if text_file is not None:
        from tapml.frontends.prompts import load_tokenizer, read_text_file
        tokenizer = load_tokenizer(model)
        if tokenizer is None:
            fail(f"--text-file needs a tokenizer, and {shown(model)} has none (zoo: and hf: models have random weights "
                 "and no vocabulary; a checkpoint or GGUF brings its own)")
        ids = list(tokenizer(read_text_file(text_file, "--text-file"))["input_ids"])
        if len(ids) < 2:
            fail(f"--text-file {shown(text_file)}: its text is {len(ids)} token(s); perplexity needs 2 or more")
    if not quiet:
        console.print(f"comparing {shown(model)} quantized {scheme} with it in float32 on the reference "
                      f"({'the text' if ids else 'its example inputs'})", highlight=False)
    return quantization_quality(model, scheme, seed=seed, hf_config=hf_config or None, token_ids=ids)


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
    if doc.get("quantization"):
        render_quantization(doc["quantization"], console, quiet, max_rows)


def render_quantization(q: dict, console, quiet: bool = False, max_rows: int = 60) -> None:
    """Print the ``quantization`` part of a precision document: SQNR per quantized layer, then one line
    with the mean KL divergence, the top-1 agreement, the perplexities and the weight bytes."""
    from rich.table import Table
    if not quiet:
        table = Table(title=f"{q['scheme']} against float32 ({shown(q['reference'])}), per quantized layer",
                      title_justify="left")
        for col, justify in (("module", "left"), ("kind", "left"), ("SQNR dB", "right")):
            table.add_column(col, justify=justify, overflow="fold")
        for layer in q["layers"][:max_rows]:
            sqnr = "-" if layer["sqnr_db"] is None else f"{layer['sqnr_db']:.1f}"
            table.add_row(shown(layer["module"]), layer["kind"], sqnr)
        console.print(table)
        if len(q["layers"]) > max_rows:
            console.print(f"... and {len(q['layers']) - max_rows} more layers (--json has them all)")
    b = q["weight_bytes"]
    ppl = q.get("perplexity")
    ppl_text = "" if not ppl or ppl.get("float") is None else \
        f", perplexity {ppl['float']:.4g} (float32) -> {ppl['quantized']:.4g} ({q['scheme']})"
    console.print(f"quantization {q['scheme']} (quality, not a verdict): mean KL {q['mean_kl']:.3g} nats, same top-1 "
                  f"{q['top1_agreement']:.1%} of {q['tokens']} positions{ppl_text}; weights {b['packed']} bytes packed "
                  f"for {b['float_of_packed']} in float32", highlight=False, soft_wrap=True)
