"""``tapml carve``, ``tapml inspect`` and ``tapml replay``: make a carve store, list it, run it on a target."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from tapml.cli.common import (CacheOpt, TrustRemoteCodeOpt, ChatOpt, PromptFileOpt, PromptIdsOpt, PromptOpt, read_prompt, EXIT_FINDING, EXIT_OK, DeviceLimitOpt, DtypeOpt, InjectOpt, JsonOpt, KernelOpt, QuietOpt,
                              TokenFileOpt, TokenMapOpt, TolOpt, app, check_dtype, command, console, fail, open_store,
                              QuantizeOpt, QuantizedOpsOpt, check_quantize,
                              out, parse_device_limits, progress_bar, write_json)
from tapml.render import fmt_percent, keep_names_whole, roofline_text
from tapml.text import shown


@app.command(short_help="Run MODEL on the reference and record every operator call as a test case (--generate N: a generation).")
@command
def carve(model: str = typer.Argument(..., help="zoo:NAME, hf:MODEL_TYPE, hf:ORG/NAME, a checkpoint folder, "
                                               "FILE.gguf, path/file.py:factory or file.pt2"),
          output: str = typer.Option(..., "-o", "--output", help="Store directory to write"),
          device: str = typer.Option("cpu", "--device", help="Reference device: cpu or cuda"),
          seed: int = typer.Option(0, "--seed", help="Seed for weights and inputs"),
          hf_config: Optional[List[str]] = typer.Option(None, "--hf-config", help="KEY=VALUE config override for hf: "
                                                    "models and checkpoints (num_hidden_layers=N: the first N layers)"),
          generate: Optional[int] = typer.Option(None, "--generate", help="Record a generation instead: the prefill "
                                                 "and N greedy decode steps against a static key/value cache "
                                                 "(N+1 steps; a causal LM)"),
          prompt_len: Optional[int] = typer.Option(None, "--prompt-len", help="With --generate: random prompt tokens "
                                                   "of the prefill (default 8)"),
          prompt: Optional[str] = PromptOpt, prompt_file: Optional[str] = PromptFileOpt, chat: bool = ChatOpt,
          prompt_ids: Optional[str] = PromptIdsOpt, cache: Optional[int] = CacheOpt,
          dtype: Optional[str] = DtypeOpt, trust_remote_code: bool = TrustRemoteCodeOpt, quantize: Optional[str] = QuantizeOpt,
          quantized_ops: str = QuantizedOpsOpt, quiet: bool = QuietOpt, json_out: Optional[str] = JsonOpt):
    """Run MODEL on the reference and record every operator call as a test case. With
    --generate N, record a generation: prefill plus N decode steps (`tapml generate` checks it)."""
    from tapml.carving import carve as carve_model
    from tapml.frontends.models import parse_hf_overrides
    target = Path(output)
    if target.exists() and (not target.is_dir() or any(p.name != "manifest.json" and p.name != "shards"
                                                          for p in target.iterdir())):
        fail(f"{output} exists and is not an empty directory or a carve store; choose another -o")
    overrides = parse_hf_overrides(hf_config)
    dtype = check_dtype(dtype, model, quiet) or "float32"
    quantize = check_quantize(quantize, model, quantized_ops)
    asked = any(v is not None for v in (prompt, prompt_file, prompt_ids)) or chat
    if generate is not None:
        tokenizer = None
        if prompt is not None or prompt_file is not None:
            from tapml.frontends.prompts import load_tokenizer
            tokenizer = load_tokenizer(model)
        ids = read_prompt(model, prompt=prompt, prompt_file=prompt_file, chat=chat, prompt_ids=prompt_ids,
                          prompt_len=prompt_len, tokenizer=tokenizer)
        if ids:
            prompt_len = len(ids)
        carve_generation_command(model, output, tokens=generate, prompt_len=8 if prompt_len is None else prompt_len,
                                 seed=seed, device=device, hf_config=overrides, quiet=quiet, json_out=json_out,
                                 dtype=dtype, prompt_ids=ids, quantize=quantize, quantized_ops=quantized_ops, cache=cache)
        return
    if asked or prompt_len is not None or cache is not None:
        fail("--prompt, --prompt-file, --chat, --prompt-ids, --prompt-len and --cache belong to a generation: "
             "add --generate N")
    with progress_bar(quiet) as bar:  # carve() leaves no half store behind
        task = bar.add_task(f"carving {shown(model)}", total=None)
        info = carve_model(model, output, seed=seed, device=device, hf_config=overrides, dtype=dtype, quantize=quantize,
                           quantized_ops=quantized_ops, on_start=lambda n: bar.update(task, total=n), on_node=lambda _: bar.advance(task))
    if json_out:
        write_json({"model": model, "store": str(Path(output).resolve()), "dtype": dtype, "quantize": quantize,
                    **info}, json_out)
    from tapml.driving.preflight import format_bytes
    in_dtype = ("" if dtype == "float32" else f" in {dtype}") + (f", quantized {quantize}" if quantize else "")
    console.print(f"carved [bold]{shown(model)}[/]{in_dtype} -> {shown(output)}: {info['nodes']} nodes, {info['cases']} cases, "
                  f"{info['ops']} ops, {format_bytes(info['bytes'])} "
                  f"(export {info['export_s']:.1f}s, carve {info['carve_s']:.1f}s)", highlight=False)


def carve_generation_command(model: str, output: str, *, tokens: int, prompt_len: int, seed: int, device: str,
                             hf_config: dict, quiet: bool, json_out: Optional[str], dtype: str = "float32",
                             prompt_ids: Optional[List[int]] = None, quantize: Optional[str] = None,
                             quantized_ops: str = "whole", cache: Optional[int] = None) -> None:
    """``tapml carve MODEL --generate N``: carve the prefill and N decode steps into ``output``
    (the model in ``dtype``)."""
    from tapml.carving.generation import carve_generation
    if tokens < 1 or prompt_len < 1:
        fail(f"--generate {tokens} --prompt-len {prompt_len}: both must be 1 or more (N decode steps after an "
             "L-token prompt)")
    with progress_bar(quiet) as bar:  # carve_generation() leaves no half store behind
        task = bar.add_task(f"carving a generation of {shown(model)}", total=tokens + 1)
        info = carve_generation(model, output, tokens=tokens, prompt_len=prompt_len, seed=seed, device=device,
                                hf_config=hf_config or None, on_step=lambda _: bar.advance(task), dtype=dtype,
                                prompt_ids=prompt_ids, quantize=quantize, quantized_ops=quantized_ops, cache=cache)
    if json_out:
        write_json({"model": model, "store": str(Path(output).resolve()), "dtype": dtype, "quantize": quantize,
                    **info}, json_out)
    from tapml.driving.preflight import format_bytes
    in_dtype = ("" if dtype == "float32" else f" in {dtype}") + (f", quantized {quantize}" if quantize else "")
    console.print(f"carved a generation of [bold]{shown(model)}[/]{in_dtype} -> {shown(output)}: {info['steps']} steps (prefill + {tokens} "
                  f"decode), {info['nodes']} prefill and {info['decode_nodes']} decode nodes, {info['cases']} cases, "
                  f"{format_bytes(info['bytes'])} (export {info['export_s']:.1f}s, carve {info['carve_s']:.1f}s)",
                  highlight=False)


@app.command()
@command
def inspect(store: str = typer.Argument(..., help="Carve store directory"), json_out: Optional[str] = JsonOpt,
            target: Optional[str] = typer.Option(None, "--target", "-t", help="Preflight on this target: compile "
                                                 "every case (run nothing) and show per op its kernels, largest "
                                                 "binding, the tensors split across binding windows and why, and "
                                                 "anything over a device limit or unsupported"),
            device_limit: Optional[List[str]] = DeviceLimitOpt, token_file: Optional[str] = TokenFileOpt,
            token_map: Optional[str] = TokenMapOpt, quiet: bool = QuietOpt):
    """List the ops of a store: cases, instances, shapes and dtypes. With --target, the limits
    preflight instead: exit 0 when every case compiles within the target's limits, 1 when some
    case cannot run there (over a limit, unsupported, or failing to compile)."""
    from rich.table import Table
    limits = parse_device_limits(device_limit)
    if (limits or token_file or token_map) and not target:
        fail("--device-limit, --token-file and --token-map apply to the preflight: add --target T")
    s = open_store(store)
    if target:
        raise typer.Exit(inspect_target(s, store, target, limits=limits, token_file=token_file, token_map=token_map,
                                        json_out=json_out, quiet=quiet))
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
    title = f"{shown(s.model)}: {len(rows)} ops, {len(s.cases)} cases, {len(s.graph.nodes)} nodes"
    if quiet:
        out.print(title, highlight=False)
        return
    table = Table(title=title)
    for col in ("op", "cases", "instances", "shapes", "dtypes"):
        table.add_column(col, justify="right" if col in ("cases", "instances") else "left")
    for r in rows:
        shapes = "; ".join(r["shapes"][:3]) + (f" (+{len(r['shapes']) - 3})" if len(r["shapes"]) > 3 else "")
        table.add_row(shown(r["op"]), str(r["cases"]), str(r["instances"]), shapes, ",".join(sorted(r["dtypes"])))
    keep_names_whole(table)
    out.print(table)


def check_device_limits(device_limit: Optional[List[str]], targets: list[str]) -> dict[str, int]:
    """``--device-limit`` values for ``targets`` (exit 2 when bad, or when every target is the
    reference, which compiles no WGSL and has no device limits)."""
    limits = parse_device_limits(device_limit)
    if limits and not any(limits_for(t, limits) for t in targets):
        fail("--device-limit lowers the limits of a WGSL device (wgpu, browser, remote://, registry://); "
             "the reference has none: add such a --target")
    return limits


def limits_for(target: str, limits: dict[str, int]) -> Optional[dict[str, int]]:
    """The ``--device-limit`` values that go into ``target``: none for the reference."""
    if not limits or target == "reference" or target.startswith("reference:"):
        return None
    return limits


def show_preflight(report, quiet: bool = False, with_target: bool = False) -> None:
    """Print a StorePreflight's summary line (:mod:`tapml.driving.preflight`), after its target when
    several run, when something was split or is over a limit."""
    line = report.summary_line()
    if line and not quiet:
        console.print(f"{shown(report.target)} {shown(line)}" if with_target else shown(line), highlight=False,
                      soft_wrap=True)


def run_preflight(store, platform, target: str, quiet: bool = False) -> None:
    """Print the limits preflight of ``store`` on ``platform`` before a migration
    (:func:`tapml.driving.preflight.preflight_before_run`)."""
    from tapml.driving.preflight import preflight_before_run
    report = preflight_before_run(store, platform, target)
    if report is not None:
        show_preflight(report, quiet)


def inspect_target(s, store: str, target: str, *, limits: dict, token_file, token_map, json_out, quiet) -> int:
    """``tapml inspect STORE --target T``: the limits preflight per op; returns the exit code."""
    from rich.table import Table

    from tapml.driving.preflight import checks_limits, format_bytes, format_limit, preflight_store
    from tapml.driving.replay import device_info
    from tapml.driving.targets import check_target, open_target, read_tokens
    check_target(target)
    if limits and not limits_for(target, limits):
        fail("--device-limit lowers the limits of a WGSL device (wgpu, browser, remote://, registry://); "
             f"{target} has none")
    token = read_tokens(token_file, token_map)
    with open_target(target, token=token, limits=limits) as platform, progress_bar(quiet) as bar:
        if not checks_limits(platform):
            fail(f"{target} reports no device limits to check; give a WGSL target (wgpu, browser, remote://...)")
        task = bar.add_task(f"compiling on {shown(target)}", total=len(s.cases))
        report = preflight_store(s, platform, target, on_case=lambda c: bar.advance(task))
        device = device_info(platform)
    from tapml.judging.verdict.kinds import stamp
    doc = stamp("preflight", {"store": str(Path(store).resolve()), "model": s.model, "device": device,
                              **report.to_json()})
    code = EXIT_OK if report.fits else EXIT_FINDING
    if json_out:
        write_json(doc, json_out)
        if json_out == "-":
            return code
    binding = report.limits.get("max-storage-buffer-binding-size")
    forced = ", ".join(f"{k}={format_limit(v, k)}" for k, v in sorted(report.forced_limits.items()))
    title = (f"preflight of {s.model} on {target} ({device.get('adapter', '')}): {len(report.ops)} ops, "
             f"{len(s.cases)} cases" + (f"; --device-limit {forced}" if forced else ""))
    if not quiet:
        table = Table(title=shown(title))
        largest = "largest binding" + (f" (limit {format_limit(binding)})" if binding else "")
        split_col = any(o.splits for o in report.ops)
        wide_col = any(o.int64_two_words for o in report.ops)
        problem_col = not report.fits
        for col in ("op", "cases", "kernels", largest) + (("int64 in two words",) if wide_col else ()) + \
                (("split",) if split_col else ()) + \
                (("over a limit / unsupported",) if problem_col else ()):
            table.add_column(col, justify="right" if col in ("cases", "kernels", largest, "int64 in two words") else "left",
                             overflow="fold")
        for o in report.ops:
            j = o.to_json()
            cells = [shown(o.op), str(o.cases), str(o.kernels), format_bytes(j["largest_binding"])]
            if wide_col:
                n = o.int64_two_words
                cells.append(f"{n} case{'s' * (n != 1)}" if n else "")
            if split_col:
                cells.append(shown("; ".join(x["message"] + (f" ({x['cases']} cases)" if x["cases"] > 1 else "")
                                              for x in j["splits"][:3])
                                    + (f" (+{len(j['splits']) - 3})" if len(j["splits"]) > 3 else "")))
            if problem_col:
                cells.append("\n".join([f"[red]{shown(v['message'])}[/]" for v in j["violations"][:3]] +
                                       [f"[yellow]unsupported:[/] {shown(u['reason'])}" for u in j["unsupported"][:2]] +
                                       [f"[red]error:[/] {shown(e['reason'][:160])}" for e in j["errors"][:2]]))
            table.add_row(*cells)
        keep_names_whole(table)
        out.print(table)
    summary = report.summary()
    line = report.summary_line() or "preflight: nothing split, nothing over a device limit"
    color = "green" if report.fits else "red"
    out.print(f"{shown(line)}\n[{color}]{len(report.ops) - sum(not o.fits for o in report.ops)}/{len(report.ops)} "
              f"ops fit {shown(target)}[/]" + (f", {summary['ops_unsupported']} with unsupported cases"
                                                 if summary["ops_unsupported"] else "")
              + (f", {summary['ops_error']} failing to compile" if summary["ops_error"] else ""), highlight=False)
    return code


def render_verdicts(result: dict, quiet: bool = False) -> None:
    """Failures as a table, then the summary line."""
    from rich.table import Table
    bad = [v for v in result["cases"] if v["status"] != "pass"]
    if bad and not quiet:
        table = Table(title=f"cases that did not pass on {shown(result['target'])}")
        wide = out.width >= 140  # on narrow terminals (CI logs, pipes) messages go below the table, whole
        for col in ("id", "op", "node", "module", "status", "max_abs_err") + (("message",) if wide else ()):
            table.add_column(col, overflow="fold", min_width=len(col) if col == "max_abs_err" else None)
        style = {"mismatch": "red", "error": "bold red", "unsupported": "yellow", "flaky": "magenta"}
        for v in bad[:50]:
            err = "" if v["max_abs_err"] is None else f"{v['max_abs_err']:.3g}"
            table.add_row(shown(v["id"]), shown(v["op"]), shown(v["node"]), shown(v["module"]),
                          f"[{style.get(v['status'], 'magenta')}]{shown(v['status'])}[/]", err,
                          *((shown(v["message"].split("\n")[0][:160]),) if wide else ()))
        keep_names_whole(table, ("id", "op"))
        out.print(table)
        for v in [v for v in bad[:50] if v["status"] != "flaky"] if not wide else ():  # flaky: render_flaky's map
            out.print(f"{shown(v['id'])} {shown(v['op'])}: {shown(v['message'].split(chr(10))[0][:300])}",
                      highlight=False, soft_wrap=True)
        if len(bad) > 50:
            out.print(f"... and {len(bad) - 50} more (see --json)")
        render_flaky([v for v in bad if v["status"] == "flaky"])
    s = result["summary"]
    total = sum(s.values())
    color = "green" if s["pass"] == total else "red"
    out.print(f"[{color}]{s['pass']}/{total} pass[/], {s['mismatch']} mismatch, {s['unsupported']} unsupported, "
              f"{s['error']} error" + (f", {s['flaky']} flaky" if s.get("flaky") else "") +
              f" on {shown(result['target'])} ({shown(result['device'].get('adapter', ''))})", highlight=False)
    timed = [c for c in result["cases"] if c.get("compile_s") is not None]
    if timed:  # an external backend: where the time went
        cached = sum(bool(c.get("compile_cached")) for c in timed)
        out.print(f"compile {sum(c['compile_s'] for c in timed):.2f} s ({len(timed) - cached} compiled, {cached} from "
                  f"the compile cache), run {sum(c.get('run_s') or 0 for c in timed):.3f} s", highlight=False)
    blamed = [c for c in result["cases"] if c.get("blame")]
    if blamed:
        counts = {b: sum(c["blame"] == b for c in blamed) for b in ("device compiler", "route")}
        out.print(f"blame, by a re-run on the control {shown(blamed[0].get('control') or '')}: "
                  + ", ".join(f"{n} {b}" for b, n in counts.items() if n), highlight=False, soft_wrap=True)
    dtype = result.get("dtype", "float32")
    if dtype != "float32":
        how = (result.get("device") or {}).get("low_precision", {}).get(dtype)
        out.print(f"{dtype} cases judged {'fp64-anchored' if result.get('anchored') else 'against the reference'}"
                  + (f"; the device holds {dtype} as {shown(how)}" if how else ""), highlight=False)


def render_run_checks(result: dict, repeat: int, guards: bool) -> None:
    """What ``--repeat K`` and ``--guards`` checked and found, below the summary line."""
    cases = result["cases"]
    if repeat > 1:
        flaky = sum(v["status"] == "flaky" for v in cases)
        out.print(f"[{'magenta' if flaky else 'green'}]repeat: {len(cases)} cases run {repeat} times each, {flaky} of them "
                  "flaky[/] (outputs not bit-identical run to run)", highlight=False, soft_wrap=True)
    if guards:
        past = sum(v["status"] == "error" and "wrote past buffer" in (v["message"] or "") for v in cases)
        out.print(f"[{'red' if past else 'green'}]guards: {len(cases)} cases checked, {past} of them wrote out of "
                  "bounds[/] (a sentinel after every buffer a kernel writes)", highlight=False, soft_wrap=True)


def render_flaky(flaky: list[dict], most: int = 5) -> None:
    """Each flaky case's report: how many runs differed, the pattern and map of what varied."""
    for v in flaky[:most]:
        out.print(f"[magenta]flaky[/] {shown(v['id'])} {shown(v['op'])} at {shown(v['node'])}:", highlight=False)
        out.print(shown(v["message"]), highlight=False, soft_wrap=True)
    if len(flaky) > most:
        out.print(f"... and {len(flaky) - most} more flaky cases (see --json)")


TargetsOpt = typer.Option(["reference"], "--target", "-t",
                          help="reference, wgpu[:vulkan|gl|metal|dx12], browser, remote://HOST:PORT; repeatable: several "
                               "targets run one after another into one matrix, and --inject then goes into every "
                               "target but reference")
ByCaseOpt = typer.Option(False, "--by-case", help="With several --target: a matrix row per case, not per op")
AllRowsOpt = typer.Option(False, "--all", help="With several --target: list the rows that pass everywhere too")


def check_targets(targets: Optional[List[str]]) -> list[str]:
    """The --target values, each validated and named once (exit 2 otherwise); ``reference`` when none."""
    from tapml.driving.targets import check_target
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
    ``{target: Verdict JSON or migration state}``, ``render_one(doc)`` prints one target's own lines
    after the matrix.
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
            render_one(doc)
    return EXIT_OK if all(s.passed for s in states) else EXIT_FINDING


def replay_matrix(store, targets: list[str], *, token, inject, json_out, quiet, by_case, all_rows, cases, limits=None,
                  kernels=None, **options):
    """``tapml replay`` with several --target: each target in turn, then one matrix; exits."""
    from tapml.driving.replay import replay_targets
    with progress_bar(quiet) as bar:
        tasks = [bar.add_task(f"replay on {shown(t)}", total=len(cases), visible=False) for t in targets]
        current = {}

        def start(target, i):
            current["task"] = tasks[i]
            bar.update(tasks[i], visible=True)

        verdicts = replay_targets(store, targets, token=token, inject=inject, kernels=kernels, on_target=start, cases=cases,
                                  on_case=lambda v: bar.advance(current["task"]), limits=limits,
                                  preflight=lambda report: show_preflight(report, quiet, with_target=True), **options)
    # The matrix shows what failed where; each target adds its summary line.
    def render_target(doc: dict) -> None:
        render_verdicts(doc, quiet=True)
        render_run_checks(doc, options.get("repeat", 1), options.get("guards", False))
    raise typer.Exit(render_matrix_run(verdicts, by_case, all_rows, quiet, json_out, render_target))


@app.command(short_help="Run every carved case on one or more targets and compare with the reference.")
@command
def replay(store: str = typer.Argument(..., help="Carve store directory"),
           target: List[str] = TargetsOpt, json_out: Optional[str] = JsonOpt, tol: Optional[List[str]] = TolOpt,
           inject: Optional[List[str]] = InjectOpt, kernel: Optional[List[str]] = KernelOpt,
           token_file: Optional[str] = TokenFileOpt, token_map: Optional[str] = TokenMapOpt,
           anchored: Optional[bool] = typer.Option(
               None, "--fp64-anchored/--no-fp64-anchored",
               help="Judge float errors against a float64 recomputation: a case passes when its error is within 4x "
                    "the reference's own error plus a floor (the dtype's atol; 1e-6 for float32). Default: on for "
                    "float16/bfloat16 stores, off for float32 ones"),
           op: Optional[List[str]] = typer.Option(None, "--op", help="Only cases of this op (repeatable)"),
           per_op: Optional[int] = typer.Option(None, "--per-op", help="Only the first N cases of each op, in the "
                                                "store's order: a quick pass over every op of a large store"),
           by_case: bool = ByCaseOpt, all_rows: bool = AllRowsOpt,
           profile: bool = typer.Option(False, "--profile", help="Record each case's device time (median of 5 runs; "
                                        "GPU timestamps where the device has them), GFLOP/s and GB/s"),
           baseline: Optional[str] = typer.Option(None, "--baseline", help="A `replay --profile --json` file to compare "
                                                  "device times with (implies --profile); slower cases are findings"),
           slower_than: float = typer.Option(25.0, "--slower-than", help="With --baseline: percent slower that makes "
                                             "a case a finding"),
           repeat: int = typer.Option(1, "--repeat", help="Run each case K times: a case whose outputs are not "
                                      "bit-identical run to run is flaky (with a map of the elements that varied)"),
           guards: bool = typer.Option(False, "--guards", help="Guard the end of every buffer a kernel writes with a "
                                       "sentinel: a kernel that writes past its tensor is an error (wgpu and browser targets)"),
           device_limit: Optional[List[str]] = DeviceLimitOpt, quiet: bool = QuietOpt):
    """Run every carved case of STORE on TARGET and compare with the reference. With several
    --target, every case runs on every target (one after another) and one matrix shows them.
    With --baseline, cases more than --slower-than percent (and 0.5 ms) slower than the same
    case of the baseline, in repeated timings beside control cases with a sign test's confidence,
    are findings (exit 1)."""
    from tapml.judging.compare import Tolerances
    from tapml.driving.replay import first_cases, replay as replay_store
    from tapml.driving.targets import open_target, read_tokens
    targets = check_targets(target)
    limits = check_device_limits(device_limit, targets)
    tolerances = Tolerances.parse(tol)
    token = read_tokens(token_file, token_map)
    s = open_store(store)
    cases = [c for c in s.cases if not op or c["op"] in op]
    if op and not cases:
        fail(f"no cases of {', '.join(op)} in {store}; `tapml inspect {store}` lists its ops")
    if per_op is not None:
        if per_op < 1:
            fail(f"--per-op {per_op}: give a number of cases of 1 or more (--per-op 1 runs each op's first case)")
        cases = first_cases(cases, per_op)
    if repeat < 1:
        fail(f"--repeat {repeat}: give a number of runs of 1 or more (e.g. --repeat 20 to find flaky kernels)")
    unguarded = [t for t in targets if t.split(":")[0] not in ("wgpu", "browser")]
    if guards and unguarded:
        fail(f"--guards checks for out-of-bounds writes on wgpu and browser targets only, not on {', '.join(unguarded)}; "
             "drop --guards or those targets")
    from tapml.driving.profile import RUNS, compare_with_baseline, read_baseline, unmatched_cases
    if not slower_than >= 0:
        fail(f"--slower-than {slower_than}: give a percentage of 0 or more (25 flags cases 25% slower)")
    if baseline and len(targets) > 1:
        fail("--baseline compares one target with its baseline; give one --target")
    old = read_baseline(baseline) if baseline else None
    runs = RUNS if profile or baseline else 0
    if len(targets) > 1:
        replay_matrix(s, targets, token=token, inject=inject, json_out=json_out, quiet=quiet,
                      by_case=by_case, all_rows=all_rows, tolerances=tolerances, anchored=anchored, cases=cases,
                      profile=runs, repeat=repeat, guards=guards, limits=limits, kernels=kernel)
    target = targets[0]
    with open_target(target, token=token, inject=inject, limits=limits_for(target, limits), kernels=kernel) as platform, \
            progress_bar(quiet) as bar:
        task = bar.add_task(f"replay on {shown(target)}", total=len(cases))
        result = replay_store(s, platform, target, tolerances, anchored=anchored, cases=cases,
                              on_case=lambda v: bar.advance(task), profile=runs, repeat=repeat, guards=guards,
                              preflight=lambda report: show_preflight(report, quiet))
        if old is not None and old.target != target:
            console.print(f"[yellow]note:[/] the baseline ran on {shown(old.target)}, this replay on {shown(target)}",
                          highlight=False)
        slower = compare_with_baseline(s, platform, result, old, slower_than) if old is not None else []
        missing = unmatched_cases(result, old) if old is not None else 0
        if missing:
            console.print(f"[yellow]note:[/] {missing} profiled case(s) have no case of the same id, op and shapes "
                          f"in {shown(baseline)}: not compared", highlight=False)
    if old is not None:
        result["slower"] = slower
    if json_out:
        write_json(result, json_out)
    if json_out != "-":
        if runs:
            render_speed(result, slower, baseline, slower_than, quiet)
        render_verdicts(result, quiet)
        render_run_checks(result, repeat, guards)
        if old is not None:
            render_speed_verdict(result, slower, slower_than)
    passed = result["summary"]["pass"] == len(result["cases"])
    raise typer.Exit(EXIT_OK if passed and not slower else EXIT_FINDING)


def render_speed(result: dict, slower: list[dict], baseline: Optional[str], slower_than: float, quiet: bool) -> None:
    """Per-op device time, GFLOP/s and GB/s (against the baseline when there is one), then the
    cases that got slower."""
    from rich.table import Table

    from tapml.reports.data import op_speeds
    rows = op_speeds(result["cases"])
    if rows and not quiet:
        timing = ", ".join(sorted({c["timing"] for c in result["cases"] if c.get("timing")}))
        placed = any(r["roofline_bound"] for r in rows)
        table = Table(title=f"device time per op on {shown(result['target'])} ({timing}; median of each case's runs)"
                            + (f"; roofline {roofline_text((result.get('device') or {}).get('roofline') or {})}"
                               if placed else ""))
        for col in ("op", "cases", "device ms", "GFLOP/s", "GB/s") + (("bound", "of roofline") if placed else ()) + \
                (("baseline ms", "ratio") if baseline else ()):
            table.add_column(col, justify="left" if col in ("op", "bound") else "right")
        for r in rows:
            cells = [shown(r["op"]), str(r["cases"]), f"{r['device_ms']:.4f}", _num(r["gflops"]), _num(r["gbps"])]
            if placed:
                cells += [r["roofline_bound"] or "", fmt_percent(r["roofline_fraction"])]
            if baseline:
                cells += [_num(r["baseline_ms"], ".4f"), _num(r["ratio"], ".2f")]
            table.add_row(*cells)
        keep_names_whole(table)
        out.print(table)
    if slower and not quiet:
        table = Table(title=f"cases more than {slower_than:g}% slower than {shown(baseline or '')}")
        for col in ("id", "op", "baseline ms", "device ms", "ratio"):
            table.add_column(col, justify="left" if col in ("id", "op") else "right")
        for f in slower[:50]:
            table.add_row(shown(f["id"]), shown(f["op"]), f"{f['baseline_ms']:.4f}", f"{f['device_ms']:.4f}", f"[red]{f['ratio']:.2f}x[/]")
        keep_names_whole(table, ("id", "op"))
        out.print(table)


def render_speed_verdict(result: dict, slower: list[dict], slower_than: float) -> None:
    """The last line of a replay against a baseline: how many cases are slower, how sure that is,
    and that an exit 1 from it is about speed, not values."""
    check = result.get("speed_check") or {}
    drift = result.get("drift") or 1.0
    rule = (f"by more than {slower_than:g}% and {check.get('min_diff_ms', 0):g} ms, in {check.get('rounds', 0)} "
            f"more rounds of timings beside control cases (sign test p <= {check.get('max_p', 0):g})")
    note = (f"; every case ran {drift:.2f}x the baseline's time (a loaded machine, or a change that slows all alike): "
            "cases are judged against that") if drift > 1 + slower_than / 100 else ""
    if slower:
        worst = slower[0]
        out.print(f"[red]{len(slower)} slower[/] than the baseline {rule}; the worst {shown(worst['op'])} "
                  f"{worst['ratio']:.2f}x (p = {worst['p_value']:g}){note}. Exit 1 is about speed: "
                  + ("the values of every case pass" if result["summary"]["pass"] == len(result["cases"])
                     else "values are judged above"), highlight=False, soft_wrap=True)
    else:
        cleared = check.get("suspects", 0)
        out.print(f"[green]0 slower[/] than the baseline {rule}"
                  + (f"; {cleared} case(s) looked slower at first and were cleared by the repeated timings"
                     if cleared else "") + note, highlight=False, soft_wrap=True)


def _num(x, spec: str = ".3g") -> str:
    return "—" if x is None else format(x, spec)
