"""``tapml gen-tests``: write a standalone pytest regression suite from a carve store."""

from __future__ import annotations

from typing import List, Optional

import typer

from tapml.cli.common import KernelOpt, TolOpt, app, command, console
from tapml.text import shown


@app.command("gen-tests")
@command
def gen_tests(store: str = typer.Argument(..., help="Carve store directory"),
              output: str = typer.Option(..., "-o", "--output", help="Directory to write the suite into"),
              state: Optional[str] = typer.Option(None, "--state", help="Migration state (Verdict JSON from "
                                                  "`tapml replay --json` or `tapml migrate --state`)"),
              known_failures: str = typer.Option("xfail", "--known-failures", help="How cases that failed in "
                                                 "--state are marked: xfail (strict), fail or skip"),
              copy_data: bool = typer.Option(False, "--copy-data/--link-data", help="Copy the store into "
                                             "DIR/data, or reference it by absolute path (default)"),
              tol: Optional[List[str]] = TolOpt, kernel: Optional[List[str]] = KernelOpt):
    """Write a pytest suite with one test per carved case of STORE: `pytest DIR --tapml-target T`."""
    from tapml.carving.gentests import generate_suite
    from tapml.judging.compare import Tolerances
    from tapml.driving.targets import check_target
    kernels = []
    if kernel:
        from tapml.platforms.wgsl.user_kernels import parse_kernel_options
        kernels = [(k.op, k.path, k.source.encode()) for files in parse_kernel_options(kernel).values() for k in files]
    info = generate_suite(store, output, state=state, known_failures=known_failures, copy_data=copy_data,
                          tolerances=Tolerances.parse(tol), check_target=check_target, kernels=kernels)
    known = (f", {info['known_failures']} known failure(s) marked {known_failures}" if state else "")
    if info["kernels"]:
        known += f", {len(info['kernels'])} kernel file(s) of yours in kernels/ (on WGSL targets)"
    import shlex
    import sys
    # the Python running tapml has pytest and the tapml plugin; a bare `pytest` may be another's
    run = shlex.join([sys.executable, "-m", "pytest", str(info["dir"]), "--tapml-target", info["default_target"]])
    console.print(f"wrote {len(info['files'])} files to {shown(info['dir'])}: {info['cases']} tests for "
                  f"{info['ops']} ops{known}, data {info['data']}; run: {shown(run)}", highlight=False, soft_wrap=True)
