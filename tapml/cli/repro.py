"""``tapml repro``: one case or region as a folder that reproduces it without tapml."""

from __future__ import annotations

from typing import List, Optional

import typer

from tapml.cli.common import (EXIT_OK, InjectOpt, JsonOpt, QuietOpt, TokenFileOpt, TolOpt, app, command, console,
                              open_store, out, write_json)
from tapml.text import shown


@app.command(short_help="Write a folder that reproduces one case or region without tapml (WGSL, run.py, a WebGPU page).")
@command
def repro(store: str = typer.Argument(..., help="Carve store directory"),
          what: str = typer.Argument(..., metavar="CASE_OR_NODE",
                                     help="A case id (c63), a node name (its case), a region FIRST..LAST or a module path"),
          output: str = typer.Option(..., "-o", "--output", help="Folder to create (must not exist, or be empty)"),
          target: str = typer.Option("wgpu", "--target", "-t",
                                     help="wgpu[:vulkan|gl|metal|dx12], browser or remote://HOST:PORT: the device "
                                          "the WGSL is compiled for and run on once; or an external backend "
                                          "(iree:vulkan, ort, tinygrad:webgpu, PREFIX, file.py:Class): its own input and runner"),
          inject: Optional[List[str]] = InjectOpt, tol: Optional[List[str]] = TolOpt,
          token_file: Optional[str] = TokenFileOpt, json_out: Optional[str] = JsonOpt, quiet: bool = QuietOpt):
    """Write a self-contained folder that reproduces CASE_OR_NODE of STORE on TARGET without tapml:
    the WGSL of each kernel, plan.json (buffers, dispatches, tolerances), the inputs and the
    reference outputs (.npy), run.py (needs only wgpu and numpy), index.html + run.js (any WebGPU
    browser) and a README naming the device. Exit 0 once the folder is written, whatever the case's
    outcome (the README and the last line say what tapml saw on TARGET). On an external backend the
    folder holds the backend's own input (MLIR, ONNX, ...; also when its compile failed), the inputs,
    the expected outputs, plan.json and run.py + runner.py, which need only that backend."""
    import shlex
    import sys

    from tapml.judging.compare import Tolerances
    from tapml.driving.repro import check_output_dir, find_subject, write_repro
    from tapml.driving.targets import check_target, open_target, read_token
    check_target(target)
    if target.startswith("reference"):
        from tapml.errors import TapmlError
        raise TapmlError(f"target {target} runs torch, not WGSL; pick a WGSL target such as wgpu, wgpu:vulkan, "
                         "wgpu:gl or browser")
    check_output_dir(output)
    tolerances = Tolerances.parse(tol)
    s = open_store(store)
    subject = find_subject(s, what, tolerances)
    command_line = "tapml " + shlex.join(sys.argv[1:])
    from tapml.platforms.targets import backend_prefix
    write = write_repro
    if backend_prefix(target) is not None:  # an external backend: its own input (MLIR, ONNX) and runner
        from tapml.driving.backend_repro import write_backend_repro as write
    with open_target(target, token=read_token(token_file), inject=inject) as platform:
        info = write(s, subject, platform, output, target=target, inject=inject or [], command=command_line)
    if json_out:
        write_json(info, json_out)
    seen = info["observed"]
    stats = "" if seen["max_abs_err"] is None else (f", max_abs_err {seen['max_abs_err']:.3g}, "
                                                    f"mismatch_fraction {seen['mismatch_fraction']:.3g}")
    made = f"{info['kernels']} kernel(s)" if "artifact" not in info else f"the backend's input {info['artifact'] or '(none given)'}"
    if not quiet:
        console.print(f"wrote {shown(output)}: {shown(subject.kind)} {shown(subject.label)}, {made} "
                      f"for {shown(info['device'])} ({shown(info['backend'])})", highlight=False, soft_wrap=True)
    if json_out != "-":
        out.print(f"{shown(target)} gives {shown(seen['status'])}{stats}; reproduce it: cd {shown(output)} && python run.py",
                  highlight=False, soft_wrap=True)
    raise typer.Exit(EXIT_OK)
