"""``tapml bench``: benchmarks. The bare command runs the whole suite (:mod:`tapml.bench`); each
subcommand runs one benchmark alone."""

from __future__ import annotations

from typing import List, Optional

import typer

from tapml.cli.common import (EXIT_FINDING, EXIT_OK, ChatOpt, DtypeOpt, JsonOpt, PromptFileOpt, PromptIdsOpt, PromptOpt,
                              QuietOpt, TokenFileOpt, TrustRemoteCodeOpt, app, check_dtype, command, console, fail, out,
                              read_prompt, write_json, check_quantize)
from tapml.cli.migrate import HfConfigOpt

GenerationModelOpt = typer.Option("zoo:tiny-llama", "--generation-model",
                                  help="Causal LM whose generation is timed (zoo:tiny-llama, hf:gpt2, hf:qwen2...)")


def write_bench(doc: dict, json_out: str) -> None:
    """Write a bench document with its kind (imported here: the verdict package imports torch)."""
    from tapml.judging.verdict.kinds import stamp
    write_json(stamp("bench", doc), json_out)


bench_app = typer.Typer(help="Measure tapml's moving parts: the whole suite, or one subcommand.",
                        no_args_is_help=False, add_completion=False, pretty_exceptions_enable=False)


@bench_app.callback(invoke_without_command=True)
@command
def bench(ctx: typer.Context,
          targets: Optional[List[str]] = typer.Option(None, "--target", "-t",
                                                      help="Target whose kernels and runtime are measured: "
                                                           "wgpu[:vulkan|gl|...], reference, browser, remote://HOST:PORT, "
                                                           "an external backend (iree:vulkan...). Repeat it to run the "
                                                           "same workloads on each target side by side (peers)"),
          rounds: int = typer.Option(5, "--rounds", min=1, max=100, help="With several --target: alternated rounds "
                                                                          "(medians of them are printed)"),
          json_out: Optional[str] = JsonOpt,
          quick: bool = typer.Option(False, "--quick", help="Smoke run: few repetitions, small payloads, "
                                                            "migrate zoo:mlp only (figures not to be quoted)"),
          model: Optional[List[str]] = typer.Option(None, "--model", help="MODEL to migrate: zoo:NAME, hf:TYPE, "
                                                    "file.py:factory, file.pt2 (repeatable; default every zoo model, "
                                                    "zoo:mlp with --quick)"),
          generation_model: str = GenerationModelOpt,
          hf_config: Optional[List[str]] = HfConfigOpt, dtype: Optional[str] = DtypeOpt,
          token_file: Optional[str] = TokenFileOpt,
          check: bool = typer.Option(False, "--check", help="Exit 1 when a goal is missed"),
          scale: bool = typer.Option(False, "--scale", help="Also carve and migrate a sized hf:llama (hidden 1024, "
                                     "4 layers, 64k vocabulary): wall time, peak RSS and where the time goes"),
          trust_remote_code: bool = TrustRemoteCodeOpt, quiet: bool = QuietOpt):
    """Run every benchmark against TARGET (kernels vs torch CPU, dispatch overhead, end-to-end
    latency, a generation's decode tokens/s vs torch eager decoding, carving, migration, and
    transport for remote:// targets) and print the figures with their ratios. Subcommands run
    one benchmark alone."""
    if ctx.invoked_subcommand is not None:
        return
    targets = list(targets or ["wgpu"])
    if len(targets) > 1:
        suite_only = [flag for flag, given in (("--model", model), ("--hf-config", hf_config), ("--dtype", dtype),
                                               ("--scale", scale), ("--check", check),
                                               ("--generation-model", generation_model != GenerationModelOpt.default))
                      if given]
        if suite_only:
            fail(f"{', '.join(suite_only)} apply to one --target (the whole suite); with several targets "
                 "`tapml bench` runs the peers' workloads on each: drop them or name one target")
        _check_json_dir(json_out)
        return _bench_peers(targets, rounds, quick, token_file, json_out, quiet)
    target = targets[0]
    from tapml.bench import check_models, run_suite
    from tapml.frontends.models import parse_hf_overrides
    from tapml.driving.targets import check_target, read_token
    check_target(target)
    overrides = parse_hf_overrides(hf_config)
    dtype = check_dtype(dtype) or "float32"
    _check_json_dir(json_out)
    check_models(tuple(model or ()), generation_model, overrides, dtype=dtype)
    report = run_suite(target, quick=quick, token=read_token(token_file), models=tuple(model or ()),
                       generation_model=generation_model, hf_config=overrides, dtype=dtype, scale=scale,
                       on_step=None if quiet else (lambda msg: console.print(f"[dim]bench:[/] {msg}", highlight=False)))
    if json_out:
        write_bench(report, json_out)
    if json_out != "-":
        _render_suite(report)
        render_suite_notes(report, check)
    missed = [k for k, g in report["goals"].items() if g["met"] is False]
    raise typer.Exit(EXIT_FINDING if check and missed else EXIT_OK)


def _bench_peers(targets: list[str], rounds: int, quick: bool, token_file: Optional[str], json_out: Optional[str],
                 quiet: bool) -> None:
    """``tapml bench --target A --target B ...``: the peers' workloads on each target (tapml.peers)."""
    from tapml.driving.targets import check_target, read_token
    from tapml.peers import run_peers
    for spec in targets:
        check_target(spec)
    if len(set(targets)) != len(targets):
        fail(f"--target {' '.join(targets)}: name each target once")
    doc = run_peers(targets, rounds=rounds, quick=quick, token=read_token(token_file),
                    on_step=None if quiet else (lambda msg: console.print(f"[dim]bench:[/] {msg}", highlight=False)))
    if json_out:
        write_bench({"target": " vs ".join(targets), "peers": doc}, json_out)
    if json_out != "-":
        _render_peers(doc)
    raise typer.Exit(EXIT_OK)


def _render_peers(doc: dict) -> None:
    """One row per workload: torch eager's ms, then each target's ms with its ratio to the first
    target's (and to torch's), a workload a target failed marked so."""
    from rich.markup import escape
    from rich.table import Table

    first = doc["targets"][0]
    load = doc.get("load_avg_median")
    table = Table(title=f"peers: median of {doc['rounds']} alternated rounds (each the best of 3 runs), ms per run, "
                        f"host tensors in and out; load {load if load is not None else '?'}"
                        + (" --quick" if doc.get("quick") else ""))
    def heading(spec: str) -> str:
        return escape(spec) + ("" if spec == first else f" (/ {escape(first)})")

    table.add_column("workload")
    table.add_column("torch eager", justify="right")
    for spec in doc["targets"]:
        table.add_column(heading(spec), justify="right")
    for w in doc["workloads"]:
        cells = [w["what"], _num(w.get("torch_ms"))]
        for spec in doc["targets"]:
            e = w["targets"].get(spec, {})
            if "ms" not in e:
                cells.append(f"[red]{escape((e.get('error') or 'not run')[:40])}[/]")
                continue
            cell = _num(e["ms"]) + (f" ({w['ratios'][spec]:.2f}x)" if spec != first and w["ratios"].get(spec) else "")
            if not e.get("matches_torch", True):
                cell += " [red]wrong[/]"
            cells.append(cell)
        table.add_row(*cells)
    out.print(table)
    resident = [w for w in doc["workloads"] if any("resident_ms" in e for e in w["targets"].values())]
    if resident:
        held = Table(title="inputs resident: ms per run with the inputs already in device buffers and the outputs "
                           "left there, each run launched and waited for alone (where a target can tell)")
        held.add_column("workload")
        for spec in doc["targets"]:
            held.add_column(heading(spec), justify="right")
        for w in resident:
            cells = [w["what"]]
            for spec in doc["targets"]:
                e, ratio = w["targets"].get(spec, {}), w.get("resident_ratios", {}).get(spec)
                cells.append(_num(e["resident_ms"]) + (f" ({ratio:.2f}x)" if spec != first and ratio else "")
                             if "resident_ms" in e else "-")
            held.add_row(*cells)
        out.print(held)
    rows = [(w["what"], spec, e) for w in doc["workloads"] for spec, e in w["targets"].items() if "device_ms" in e]
    if rows:
        device = Table(title="device time, inputs resident (where a target can measure it), on its roofline")
        for col in ("workload", "target", "device ms", "bound", "of roofline"):
            device.add_column(col, justify="left" if col in ("workload", "target", "bound") else "right")
        from tapml.render import fmt_percent
        for what, spec, e in rows:
            device.add_row(what, escape(spec), _num(e["device_ms"]), e.get("roofline_bound") or "-",
                           fmt_percent(e.get("roofline_fraction")))
        out.print(device)


def render_suite_notes(report: dict, check: bool) -> None:
    """Below the table: what changed on this machine (the tuned matmul tiles), which figures were
    not measured and why, and what the missed goals mean for the exit code."""
    from rich.markup import escape
    tuned = report.get("autotune") or {}
    if tuned.get("cache"):
        out.print(f"matmul tile sizes tuned for this device were saved to {escape(tuned['cache'])}: every later compile "
                  "on this device uses them (remove the file to go back to the defaults; $TAPML_CACHE_DIR moves it)",
                  highlight=False, soft_wrap=True)
    if report.get("transport") is None:
        out.print("transport: not measured: only a remote://HOST:PORT target has one (`tapml bench transport` "
                  "measures a local device server)", highlight=False, soft_wrap=True)
    missed = [k for k, g in report["goals"].items() if g["met"] is False]
    if missed and check:
        out.print(f"[red]{len(missed)} goal(s) missed[/] ({', '.join(missed)}): exit 1 (--check)", highlight=False,
                  soft_wrap=True)
    elif missed:
        out.print(f"[yellow]{len(missed)} goal(s) missed[/] ({', '.join(missed)}): figures only; exit 0 all the "
                  "same, add --check to exit 1 on a missed goal", highlight=False, soft_wrap=True)


def _check_json_dir(json_out: Optional[str]) -> None:
    if json_out and json_out != "-":
        from pathlib import Path
        parent = Path(json_out).parent
        if not parent.is_dir():
            fail(f"cannot write --json {json_out}: directory {parent} does not exist")


def _num(x, fmt: str = ".3g") -> str:
    return "-" if x is None else format(x, fmt)


def _generation_rows(g: dict) -> list[tuple[str, str, str, str, str]]:
    """Table rows of a generation figure (tapml.bench.generation_figure): decode tokens/s and
    prefill ms against torch eager, with the load average, and the compile counts."""
    spec = g["model"]
    if g.get("error"):
        return [(f"{spec} generation [red]({g['error'][:80]})[/]", "", "", "", "")]
    load = f"load {g['load_avg_median']:.2f}"
    threads = g["torch_threads"]
    label = f"median of {g['runs']}, {load}"
    if not g["passed"] or not all(g["tokens_match"].values()):
        label += ", [red]steps did not all pass[/]"
    few, many = g["programs_compiled"]
    compiled = g["programs_compiled"]
    flat = "[green]met[/]" if g["compile_count_flat"] else "[red]missed[/]"
    return [
        (f"{spec} decode tokens/s vs torch eager CPU, {threads['decode']} thread(s) ({g['tokens']} tokens, {label})",
         _num(g["decode_tokens_per_s"]["target"]), _num(g["decode_tokens_per_s"]["torch"]), _num(g["ratios"]["decode"]),
         ""),
        (f"{spec} prefill ms vs torch eager CPU, {threads['prefill']} thread(s) ({g['prompt_len']}-token prompt)",
         _num(g["prefill_ms"]["target"]), _num(g["prefill_ms"]["torch"]), _num(g["ratios"]["prefill"]), ""),
        (f"{spec} programs compiled for {few} / {many} tokens", f"{compiled[few]} / {compiled[many]}", "", "",
         f"equal {flat}"),
        ("  upload bytes per decode step (weights stay on the device)", _num(g["upload_bytes_per_decode_step"], "d"),
         "", "", ""),
    ]


def _render_suite(r: dict) -> None:
    """One table: each figure, its baseline, the ratio and the goal where one is set (tapml.bench.GOALS)."""
    from rich.table import Table
    goals = r["goals"]

    def goal(key: str) -> str:
        g = goals.get(key)
        if not g:
            return ""
        mark = {True: "[green]met[/]", False: "[red]missed[/]", None: "[yellow]n/a[/]"}[g["met"]]
        return f"{g['goal']} {mark}"

    dev = r.get("device", {})
    table = Table(title=f"tapml bench on {r['target']} ({dev.get('adapter', '')}){' --quick' if r['quick'] else ''}, "
                        f"{r['machine']['cpus']} CPUs, {r['wall_s']:.0f} s")
    for col, justify in (("figure", "left"), ("ours", "right"), ("baseline", "right"), ("ratio", "right"),
                         ("goal", "left")):
        table.add_column(col, justify=justify)
    tune = r.get("autotune")
    if tune:
        if tune.get("error"):
            table.add_row(f"matmul tile autotune [red]({tune['error'][:60]})[/]", "", "", "", "")
        else:
            table.add_row(f"matmul tiles autotuned over {len(tune['gflops'])}: {tune['label']} (TMxTN/WG) GFLOP/s",
                          _num(tune["best_gflops"]), "", "", "")
    for m in r["matmul"]:
        key = f"{'matmul' if m['op'] == 'mm' else 'bmm'}_{m['n']}_vs_torch"
        label = f"{m['op']} {m['n']}" + (f" x{m['batch']}" if m["op"] == "bmm" else "") + " GFLOP/s vs torch CPU"
        if m.get("error"):
            label += f" [red]({m['error'][:60]})[/]"
        table.add_row(label, _num(m["ours_gflops"]), _num(m["torch_gflops"]), _num(m["ratio"]), goal(key))
    for spec, e in r["e2e"].items():
        key = f"e2e_{spec.split(':')[-1].replace('-', '_')}_vs_torch"
        label = f"{spec} forward ms vs torch eager" + (f" [red]({e['error'][:60]})[/]" if e.get("error") else "")
        table.add_row(label, _num(e["ours_ms"]), _num(e["torch_ms"]), _num(e["ratio"]), goal(key))
    for row in _generation_rows(r["generation"]) if r.get("generation") else ():
        table.add_row(*row)
    d = r["dispatch"]
    table.add_row("empty kernel round trip ms", _num(d["empty_kernel_ms"]), "", "", "")
    table.add_row(f"per kernel ms ({d['per_kernel_timing']})", _num(d["per_kernel_ms"]), "", "", "")
    table.add_row("per region ms", _num(d["per_region_ms"]), "", "", "")
    w = r["carving"]["write"]
    table.add_row("carve writer MB/s vs plain file write", _num(w["carve_write_MBps"], ".0f"),
                  _num(w["file_write_MBps"], ".0f"), _num(w["ratio"]), goal("carve_write_vs_file_write"))
    table.add_row("  + manifest (atomic, fsync) ms per store", _num(w["manifest_ms"]), "", "", "")
    for spec, c in r["carving"]["models"].items():
        table.add_row(f"carve s vs export s, {spec}", _num(c["carve_s"]), _num(c["export_s"]),
                      _num(c["carve_vs_export"]), "")
    for spec, m in r["migrate"].items():
        status = "" if m.get("passed") else " [red](did not pass)[/]"
        table.add_row(f"migrate {spec} s{status}", _num(m["s"]), "", "", f"< 60 {'[green]met[/]' if m['s'] < 60 else '[red]missed[/]'}")
    if r.get("scale"):
        for row in _scale_rows(r["scale"]):
            table.add_row(*row, "", "", "")
    t = r.get("transport")
    if t:
        table.add_row("upload MB/s vs plain socket", _num(t["tensor"]["upload_MBps"], ".0f"),
                      _num(t["socket"]["upload_MBps"], ".0f"), _num(t["ratios"]["upload_vs_socket"]), goal("upload_vs_socket"))
        table.add_row("download MB/s vs plain socket", _num(t["tensor"]["download_MBps"], ".0f"),
                      _num(t["socket"]["download_MBps"], ".0f"), _num(t["ratios"]["download_vs_socket"]),
                      goal("download_vs_socket"))
        table.add_row("empty call ms vs socket round trip", _num(t["empty_call_ms"]), _num(t["socket"]["round_trip_ms"]),
                      "", goal("empty_call_ms"))
    out.print(table)
    _render_roofline(r)


def _render_roofline(r: dict) -> None:
    """Each timed kernel on the device's roofline: what bounds its least time there and the
    fraction of that bound it reached (tapml.platforms.roofline)."""
    from rich.table import Table

    from tapml.render import fmt_percent, roofline_text
    peaks = (r.get("device") or {}).get("roofline") or {}
    rows = [(f"{m['op']} {m['n']}" + (f" x{m['batch']}" if m["op"] == "bmm" else ""), m) for m in r.get("matmul", [])]
    rows += [(row["case"], row) for row in r.get("long_rows", [])]
    rows = [(name, row) for name, row in rows if row.get("roofline_bound")]
    if not peaks or not rows:
        return
    table = Table(title=f"roofline of {r['target']}: {roofline_text(peaks)} ({peaks.get('timing', '')})")
    for col in ("kernel", "ms", "bound", "least ms", "of roofline"):
        table.add_column(col, justify="left" if col in ("kernel", "bound") else "right")
    for name, row in rows:
        ms = row["ours_ms"] if "ours_ms" in row else row["gflop"] / row["ours_gflops"] * 1e3
        table.add_row(name, _num(ms), row["roofline_bound"], _num(row["roofline_ms"]), fmt_percent(row["roofline_fraction"]))
    out.print(table)


def _scale_rows(f: dict) -> list[tuple[str, str]]:
    """(figure, value) rows of a scale figure (tapml.bench.scale_figure): migrate wall time and peak
    RSS of the sized model, the share of each kind of work and each stage."""
    config = ", ".join(f"{k}={v}" for k, v in f.get("hf_config", {}).items())
    ckpt = f.get("checkpoint")
    name = "llama checkpoint" if ckpt else f"{f['model']}"
    name += f" ({config})" if config else ""
    if f.get("error"):
        return [(f"{name} carve + migrate [red]({f['error'][:100]})[/]", "")]
    gib = 1 << 30
    label = f"{name} carve + migrate to {f['target']} s, load {' → '.join(map(str, f['load_avg']))}"
    if not f["passed"]:
        label += f" [red](did not pass: {f['ops_share']:.1%} of ops, {f['flops_share']:.1%} of FLOPs on target)[/]"
    rows = [(label, _num(f["wall_s"], ".1f"))]
    if ckpt:
        shape = ckpt["shape"]
        rows += [(f"  checkpoint GiB, bfloat16, {ckpt['shards']} shards (hidden {shape['hidden_size']}, "
                  f"{shape['num_hidden_layers']} layers, vocabulary {shape['vocab_size']}), written in s",
                  f"{ckpt['checkpoint_bytes'] / gib:.2f}, {ckpt['write_s']:.1f}"),
                 ("  load, carve, migrate s", f"{f['load_s']:.1f}, {f['carve_s']:.1f}, {f['migrate_s']:.1f}"),
                 ("  peak RSS x checkpoint bytes: carve, migrate",
                  f"x{f['peak_rss_vs_checkpoint']['carve']:.2f}, x{f['peak_rss_vs_checkpoint']['migrate']:.2f}"),
                 ("  store GiB (x checkpoint bytes)", f"{f['store_bytes'] / gib:.2f} (x{f['store_vs_checkpoint']:.2f})")]
    rows += [(f"  peak RSS GiB (x {f['param_bytes'] / gib:.2f} GiB of parameters)",
              f"{f['peak_rss_bytes'] / gib:.2f} (x{f['peak_rss_vs_params']:.2f})")]
    rows += [(f"  {kind} s ({f['shares'][kind]:.0%})", _num(f["seconds"][kind], ".1f")) for kind in f["seconds"]]
    rows += [(f"  {stage} stage s, peak RSS GiB", f"{st['s']:.1f}, {st['peak_rss_bytes'] / gib:.2f}")
             for stage, st in f["stages"].items()]
    return rows


@bench_app.command()
@command
def scale(target: str = typer.Option("wgpu", "--target", "-t", help="Target to migrate to: wgpu[:vulkan|gl|...], "
                                     "reference, browser, remote://HOST:PORT"),
          model: Optional[str] = typer.Option(None, "--model", help="MODEL to carve and migrate (any MODEL spec; "
                                              "default hf:llama)"),
          checkpoint: bool = typer.Option(False, "--checkpoint", help="Write a llama-shaped bfloat16 checkpoint "
                                          "(save_pretrained, sharded safetensors; 1B-class unless --shape) and "
                                          "load, carve and migrate it from disk: load, carve and migrate seconds, "
                                          "peak RSS and the store's size against the checkpoint's bytes"),
          shape: Optional[List[str]] = typer.Option(None, "--shape", help="KEY=VALUE over the checkpoint's "
                                                    "1B-class shape (hidden_size=2048, num_hidden_layers=16, "
                                                    "intermediate_size=8192, num_attention_heads=32, "
                                                    "num_key_value_heads=8, vocab_size=128000, "
                                                    "tie_word_embeddings=true); with --checkpoint (repeatable)"),
          workdir: Optional[str] = typer.Option(None, "--workdir", help="Folder for the checkpoint and the store "
                                                "(kept; default a temporary folder, removed)"),
          hf_config: Optional[List[str]] = HfConfigOpt, dtype: Optional[str] = DtypeOpt,
          timeout: float = typer.Option(1800, "--timeout", help="Seconds allowed to the carve, and to the migrate"),
          token_file: Optional[str] = TokenFileOpt, trust_remote_code: bool = TrustRemoteCodeOpt,
          json_out: Optional[str] = JsonOpt):
    """Time to a verdict of a sized model: MODEL carved, then migrated to TARGET, each in a fresh
    process; wall time, peak RSS (against the parameter bytes) and the share of loading, export,
    carving, compilation, device execution and comparison. hf:llama defaults to hidden 1024, 4
    layers, intermediate 2816 and a 64k vocabulary (--hf-config replaces them). With --checkpoint
    the model is a checkpoint on disk the bench writes first (--hf-config num_hidden_layers=N
    then loads its first N layers). Exit 1 when the migration does not pass."""
    from tapml.bench import SCALE_CONFIG, SCALE_MODEL, check_models, check_scale_shape, checkpoint_scale_figure, \
        scale_figure
    from tapml.frontends.models import parse_hf_overrides
    from tapml.driving.targets import check_target, read_token
    from pathlib import Path
    check_target(target)
    if timeout <= 0:
        fail("--timeout must be a positive number of seconds")
    overrides = parse_hf_overrides(hf_config)
    _check_json_dir(json_out)
    if workdir is not None and Path(workdir).exists() and not Path(workdir).is_dir():
        fail(f"--workdir {workdir} is not a folder")
    if checkpoint:
        if model is not None:
            fail("--checkpoint writes the model it measures; leave --model out (or --checkpoint, to measure MODEL)")
        sizes = check_scale_shape(parse_hf_overrides(shape, "--shape"))
        if overrides.get("num_hidden_layers", 1) not in range(1, sizes["num_hidden_layers"] + 1) or \
                set(overrides) - {"num_hidden_layers"}:
            fail(f"--hf-config with --checkpoint takes num_hidden_layers=N, N from 1 to the checkpoint's "
                 f"{sizes['num_hidden_layers']} layers")
        figure = checkpoint_scale_figure(target, workdir, shape=sizes, hf_config=overrides,
                                         dtype=check_dtype(dtype) or "bfloat16", token=read_token(token_file),
                                         timeout=timeout)
    else:
        if shape:
            fail("--shape is the shape of the checkpoint --checkpoint writes; give --checkpoint too")
        model = model or SCALE_MODEL
        dtype = check_dtype(dtype, model) or "float32"
        from tapml.frontends.checkpoint import is_checkpoint_spec
        if overrides and not model.startswith("hf:") and not is_checkpoint_spec(model):
            fail("--hf-config applies to hf:MODEL_TYPE models and checkpoints; give one with --model")
        if not model.startswith("hf:"):  # an hf: model is built by the carve itself: a sized one costs its weights
            check_models((model,), dtype=dtype)
        config = overrides or (dict(SCALE_CONFIG) if model == SCALE_MODEL else {})
        figure = scale_figure(model, target, workdir, hf_config=config, dtype=dtype, token=read_token(token_file),
                              timeout=timeout)
    carve = figure.get("carve", {})
    if carve.get("returncode") == 2:  # the carve refused the model or its config: the user's to fix
        fail(carve["tail"].removeprefix("error: "))
    if json_out:
        write_bench(figure, json_out)
    if json_out != "-":
        from rich.table import Table
        table = Table(title=f"time to a verdict on {target}")
        table.add_column("figure", justify="left")
        table.add_column("value", justify="right")
        for row in _scale_rows(figure):
            table.add_row(*row)
        out.print(table)
        out.print(scale_verdict(figure), highlight=False, soft_wrap=True)
    raise typer.Exit(EXIT_OK if not figure.get("error") and figure["passed"] else EXIT_FINDING)


def scale_verdict(figure: dict) -> str:
    """The verdict the scale figure timed: whether the migration passed, with its placement."""
    from rich.markup import escape
    if figure.get("error"):
        return f"[red]no verdict[/]: {escape(str(figure['error']))}"
    if figure["passed"]:
        return (f"[green]verdict: migrated, everything passed[/] on {figure['target']} in {figure['wall_s']:.1f} s "
                f"({figure['ops_share']:.1%} of ops, {figure['flops_share']:.1%} of FLOPs on the target)")
    return (f"[red]verdict: did not pass[/] on {figure['target']} in {figure['wall_s']:.1f} s: "
            f"{figure['ops_share']:.1%} of ops, {figure['flops_share']:.1%} of FLOPs on the target (exit 1)")


@bench_app.command()
@command
def generation(target: str = typer.Option("wgpu", "--target", "-t", help="Target that generates: wgpu[:vulkan|gl|...], "
                                          "reference, browser, remote://HOST:PORT"),
               model: str = typer.Option("zoo:tiny-llama", "--model", help="Causal LM whose generation is timed "
                                         "(zoo:tiny-llama, hf:gpt2, hf:qwen2...)"),
               hf_config: Optional[List[str]] = HfConfigOpt, dtype: Optional[str] = DtypeOpt,
               tokens: str = typer.Option("8,64", "--tokens", help="FEW,MANY: decode steps of the two generations "
                                          "whose compile counts are compared; MANY is timed"),
               prompt_len: Optional[int] = typer.Option(None, "--prompt-len", help="Random prompt tokens of the "
                                                        "prefill (default 8)"),
               prompt: Optional[str] = PromptOpt, prompt_file: Optional[str] = PromptFileOpt, chat: bool = ChatOpt,
               prompt_ids: Optional[str] = PromptIdsOpt,
               repeat: int = typer.Option(5, "--repeat", help="Alternated target and torch runs (the median is kept)"),
               context: Optional[str] = typer.Option(None, "--context", help="T[,T...]: also time decode steps at "
                                                     "these cache positions (the tokens so far), e.g. 16,256,1024,4096"),
               cache: Optional[str] = typer.Option(None, "--cache", help="C[,C...]: static cache sizes of the --context "
                                                   "timings (default 4096), one carved generation each"),
               quantize: Optional[str] = typer.Option(None, "--quantize", help="SCHEME[,SCHEME...]: also time the "
                                                      "model with its linears packed in each scheme (tapml carve "
                                                      "--quantize), next to the unquantized --dtype run"),
               token_file: Optional[str] = TokenFileOpt,
               trust_remote_code: bool = TrustRemoteCodeOpt,
               json_out: Optional[str] = JsonOpt):
    """Decode tokens/s and prefill ms of a greedy generation on TARGET next to torch eager
    decoding of the same model and steps on the CPU (alternated runs, medians, load average),
    and the programs compiled for FEW and MANY tokens (static shapes: they must be equal).
    Exit 1 when a step does not pass or the compile count grows with the tokens."""
    import tempfile
    from pathlib import Path

    from tapml.bench import CONTEXT_STEPS, check_models, context_figure, generation_figure
    from tapml.frontends.models import parse_hf_overrides
    from tapml.driving.targets import check_target, open_target, read_token
    check_target(target)
    few, _, many = tokens.partition(",")
    if not (few.strip().isdigit() and many.strip().isdigit() and 1 <= int(few) < int(many)):
        fail(f"--tokens {tokens!r}: give FEW,MANY with 1 <= FEW < MANY, e.g. 8,64")
    if (prompt_len is not None and prompt_len < 1) or repeat < 1:
        fail("--prompt-len and --repeat must be at least 1")
    from tapml.frontends.prompts import load_tokenizer
    ids = read_prompt(model, prompt=prompt, prompt_file=prompt_file, chat=chat, prompt_ids=prompt_ids,
                      prompt_len=prompt_len, tokenizer=load_tokenizer(model) if prompt or prompt_file else None)
    prompt_len = len(ids) if ids else 8 if prompt_len is None else prompt_len
    overrides = parse_hf_overrides(hf_config)
    dtype = check_dtype(dtype, model) or "float32"
    schemes = [check_quantize(s.strip(), model) for s in quantize.split(",")] if quantize else []
    contexts = _positive_list("--context", context) if context is not None else []
    caches = _positive_list("--cache", cache) if cache is not None else [4096] if contexts else []
    if caches and not contexts:
        fail("--cache sizes the caches of the --context timings: add --context T[,T...]")
    for c in caches:
        if not any(t + CONTEXT_STEPS < c for t in contexts):
            fail(f"--cache {c}: no --context fits it (a context T needs T + {CONTEXT_STEPS} < {c})")
    _check_json_dir(json_out)
    check_models((), model, overrides, tokens=int(many), prompt_len=prompt_len, dtype=dtype)
    with tempfile.TemporaryDirectory(prefix="tapml-bench-") as tmp, \
            open_target(target, token=read_token(token_file)) as platform:
        runs = [generation_figure(platform, target, Path(tmp) / f"store{i}", model, tokens=(int(few), int(many)),
                                  prompt_len=prompt_len, repeat=repeat, hf_config=overrides or None, dtype=dtype,
                                  prompt_ids=ids, quantize=scheme)
                for i, scheme in enumerate([None, *schemes])]
        rows = context_figure(platform, target, Path(tmp) / "contexts", model, contexts=contexts, caches=caches,
                              repeat=repeat, hf_config=overrides or None, dtype=dtype) if contexts else None
    figure = runs[0]
    figure["target"] = target
    if not figure.get("error"):
        figure["prefill"] = {"tokens": prompt_len, "ms": figure["prefill_ms"]["target"],
                             "torch_ms": figure["prefill_ms"]["torch"]}
    if rows is not None:
        figure["contexts"] = rows
    if schemes:
        figure["quantized"] = [{**run, "decode_vs_unquantized": _quantized_ratio(run, figure)} for run in runs[1:]]
    if json_out:
        write_bench(figure, json_out)
    if json_out != "-":
        from rich.table import Table
        table = Table(title=f"generation on {target}")
        for col, justify in (("figure", "left"), ("ours", "right"), ("torch eager CPU", "right"), ("ratio", "right"),
                             ("", "left")):
            table.add_column(col, justify=justify)
        for row in _generation_rows(figure):
            table.add_row(*row)
        out.print(table)
        if schemes:
            _print_quantized(figure, dtype)
        if rows:
            _print_contexts(rows, target)
    ok = all(not run.get("error") and run["passed"] and run["compile_count_flat"] for run in runs)
    ok = ok and all(row.get("passed") and not row.get("error") for row in rows or [])
    raise typer.Exit(EXIT_OK if ok else EXIT_FINDING)


def _positive_list(option: str, text: str) -> list[int]:
    """``16,256,1024`` as ints, each at least 1; exit 2 naming ``option`` otherwise."""
    items = [p.strip() for p in text.split(",")]
    if not items or not all(p.isdigit() and int(p) >= 1 for p in items):
        fail(f"{option} {text!r}: give whole numbers of 1 or more separated by commas, e.g. 16,256,1024")
    return [int(p) for p in items]


def _print_contexts(rows: list[dict], target: str) -> None:
    """The --context table: per cache size and context, the decode step on the target and in torch."""
    from rich.table import Table
    table = Table(title=f"decode step by context on {target} (median of {len(rows[0].get('load_avg') or [0])} "
                        f"alternated runs)")
    for col in ("model", "cache", "context", "step ms", "tokens/s", "torch tokens/s", "ratio", "kernels/step", "load"):
        table.add_column(col, justify="left" if col == "model" else "right")
    for r in rows:
        if r.get("error"):
            table.add_row(r["model"], str(r["cache"]), "", f"[red]{r['error'][:60]}[/]", "", "", "", "", "")
            continue
        ratio = r["tokens_per_s"] / r["torch_tokens_per_s"] if r["torch_tokens_per_s"] else None
        load = r.get("load_avg") or []
        table.add_row(r["model"] + ("" if r["passed"] else " [red](steps failed)[/]"), str(r["cache"]),
                      str(r["context"]), _num(r["step_ms"]), _num(r["tokens_per_s"]), _num(r["torch_tokens_per_s"]),
                      _num(ratio), str(r["kernels_per_step"]), _num(sorted(load)[len(load) // 2] if load else None))
    out.print(table)


def _quantized_ratio(run: dict, unquantized: dict):
    """Decode tokens/s of a quantized run over the unquantized one's, on the target (None if either failed)."""
    a = (run.get("decode_tokens_per_s") or {}).get("target")
    b = (unquantized.get("decode_tokens_per_s") or {}).get("target")
    return round(a / b, 4) if a and b else None


def _print_quantized(figure: dict, dtype: str) -> None:
    """One row per run: decode tokens/s on the target and in torch, the ratio to the unquantized
    run, and the bytes its weights take (medians of the alternated rounds; load average beside)."""
    from rich.table import Table
    table = Table(title=f"decode by weight format on {figure['target']} ({dtype} activations)")
    for col in ("weights", "target tok/s", "torch tok/s", "vs unquantized", "weight bytes", "load avg"):
        table.add_column(col, justify="left" if col == "weights" else "right")
    for run in [figure, *figure["quantized"]]:
        tps = run.get("decode_tokens_per_s") or {}
        wb = run.get("weight_bytes") or {}
        ratio = "1" if run is figure else ("-" if run.get("decode_vs_unquantized") is None
                                           else f"{run['decode_vs_unquantized']:.3g}")
        table.add_row(run.get("quantize") or dtype, _num(tps.get("target")), _num(tps.get("torch")), ratio,
                      str(wb.get("packed", 0) + wb.get("float", 0)) if wb else "-", _num(run.get("load_avg_median")))
    out.print(table)


@bench_app.command()
@command
def transport(target: Optional[str] = typer.Option(None, "--target", "-t",
                                                   help="remote://HOST:PORT to measure; default: a local `tapml serve` started for the run"),
              token_file: Optional[str] = TokenFileOpt,
              size_mib: int = typer.Option(64, "--size-mib", help="Tensor size for throughput"),
              repeat: int = typer.Option(10, "--repeat", help="Transfers per direction (best is kept)"),
              calls: int = typer.Option(2000, "--calls", help="Empty calls timed for latency"),
              check: bool = typer.Option(False, "--check", help="Exit 1 when a goal is missed"),
              json_out: Optional[str] = JsonOpt):
    """Tensor throughput and empty-call latency of a device server, next to a plain socket.

    Both are measured in the same run against the same server; --json writes them with a
    `ratios` object (upload_vs_socket, download_vs_socket, empty_call_ms).
    """
    import secrets

    from tapml.errors import PlatformError
    from tapml.remote.bench import measure_transport
    from tapml.remote.client import RemotePlatform
    from tapml.remote.launcher import ServerProcess
    from tapml.driving.targets import parse_remote, read_token
    if size_mib < 1 or repeat < 1 or calls < 1:
        fail("--size-mib, --repeat and --calls must be at least 1")
    server = None
    if target:
        if not target.startswith("remote://"):
            fail(f"--target {target!r}: the transport benchmark measures a device server, remote://HOST:PORT")
        host, port = parse_remote(target)
        token = read_token(token_file)
    else:
        token = secrets.token_hex(16)
        console.print("starting a local `tapml serve --platform reference` for the benchmark", highlight=False)
        server = ServerProcess(platform="reference", token=token,
                               args=("--max-message-mib", str(max(1024, size_mib + 1))))
        host, port = server.host, server.port
    try:
        with RemotePlatform(host, port, token=token) as platform:
            try:
                report = measure_transport(platform, size_mib << 20, repeat, calls)
            except ValueError as e:
                fail(str(e))
            except (PlatformError, OSError, EOFError) as e:  # the server went away mid-run
                fail(f"transport benchmark of {platform.name} failed: {e}; check that the server is still up")
    finally:
        if server:
            server.stop()
    if json_out:
        write_bench(report, json_out)
    if json_out != "-":
        _render(report)
    raise typer.Exit(EXIT_FINDING if check and not report["passed"] else EXIT_OK)


def _render(r: dict) -> None:
    from rich.table import Table

    from tapml.remote.bench import GOAL_OPS, GOALS, goal_met
    table = Table(title=f"transport to {r['target']} ({r['platform']}), {r['size_bytes'] >> 20} MiB tensors, "
                        f"{r['statistic']} ({r['repeat']})")
    for col in ("", "plain socket", "tapml", "ratio", "goal"):
        table.add_column(col, justify="right")

    def goal(key: str) -> str:
        op = {">=": "≥"}.get(GOAL_OPS[key], GOAL_OPS[key])
        return f"{op} {GOALS[key]} {'[green]ok[/]' if goal_met(key, r['ratios'][key]) else '[red]missed[/]'}"

    ratios = r["ratios"]
    table.add_row("upload MB/s", f"{r['socket']['upload_MBps']:.0f}", f"{r['tensor']['upload_MBps']:.0f}",
                  f"{ratios['upload_vs_socket']:.2f}", goal("upload_vs_socket"))
    table.add_row("download MB/s", f"{r['socket']['download_MBps']:.0f}", f"{r['tensor']['download_MBps']:.0f}",
                  f"{ratios['download_vs_socket']:.2f}", goal("download_vs_socket"))
    table.add_row("round trip ms", f"{r['socket']['round_trip_ms']:.3f}", f"{r['empty_call_ms']:.3f}", "",
                  goal("empty_call_ms"))
    out.print(table)


app.add_typer(bench_app, name="bench")
