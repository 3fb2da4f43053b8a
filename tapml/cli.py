"""The ``tapml`` command line. Thin: each command parses, calls the library, renders.

Torch, wgpu and transformers are imported inside commands so ``tapml --help`` is instant.
Exit codes: 0 everything checked passed, 1 something did not pass, 2 bad usage or input,
3 an internal error: one line on stderr, the traceback in a private file
(``$XDG_CACHE_HOME/tapml/tapml-crash-*.txt``, else ``~/.cache/tapml/``, else the temp dir), 130 Ctrl-C.
"""

from __future__ import annotations

import functools
import json
import os
import warnings
from pathlib import Path
from typing import List, Optional

import typer
from rich.console import Console

app = typer.Typer(no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
                  help="Port PyTorch models to WebGPU, Vulkan, Metal and OpenGL: carve, migrate, verify.")
# No emoji codes: user text such as `file.py:boom` must print as it is.
console = Console(stderr=True, emoji=False)
out = Console(emoji=False)

EXIT_OK, EXIT_FINDING, EXIT_USAGE, EXIT_INTERNAL = 0, 1, 2, 3

TargetOpt = typer.Option("reference", "--target", "-t", help="reference, wgpu[:vulkan|gl|metal|dx12], browser, remote://HOST:PORT")
TolOpt = typer.Option(None, "--tol", help="Tolerance override OP=RTOL,ATOL or RTOL,ATOL (repeatable)")
InjectOpt = typer.Option(None, "--inject", help="Fault OP[@NODE]=scale:F|offset:F|nan|compile-error (repeatable)")
TokenFileOpt = typer.Option(None, "--token-file", help="File holding the device server token (else $TAPML_TOKEN)")
JsonOpt = typer.Option(None, "--json", help="Write the result as JSON to this file ('-' for stdout)")
QuietOpt = typer.Option(False, "--quiet", "-q", help="Print only errors and the final line")


def fail(message: str, code: int = EXIT_USAGE):
    """Print ``message`` as one error line on stderr and exit with ``code`` (default 2, bad usage)."""
    from rich.markup import escape
    console.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


def command(fn):
    """Decorator for every command: TapmlError -> one clear line and exit 2; Ctrl-C -> exit 130;
    any other exception -> ``internal error: TYPE: MESSAGE — details in FILE`` and exit 3, with
    the traceback in FILE (never on the terminal); quiet libraries. Typer's and click's own exits
    (``typer.Exit``, usage errors, aborts) pass through unchanged."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        import click

        from tapml.errors import TapmlError
        warnings.filterwarnings("ignore")
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
        try:
            return fn(*args, **kwargs)
        except TapmlError as e:
            fail(str(e))
        except KeyboardInterrupt:
            console.print("[yellow]interrupted[/]")
            raise typer.Exit(130)
        except (typer.Exit, click.exceptions.Exit, click.exceptions.Abort, click.exceptions.ClickException):
            raise
        except BrokenPipeError:  # `tapml inspect S | head`: the reader left; not a bug of ours
            import sys
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            raise typer.Exit(141)  # 128 + SIGPIPE, as a shell reports it
        except Exception as e:  # noqa: BLE001 - the one place that turns a bug into exit 3
            from rich.markup import escape
            lines = str(e).strip().splitlines()
            summary = type(e).__name__ + (f": {lines[0][:300]}" if lines else "")
            report = write_crash_report(e)
            where = f"details in {report}" if report else "no details file could be written"
            console.print(f"[bold red]internal error:[/] {escape(summary)} — {escape(where)}",
                          highlight=False, soft_wrap=True)
            raise typer.Exit(EXIT_INTERNAL)
    return wrapper


def write_crash_report(error: BaseException) -> Optional[str]:
    """Write the command line and traceback of ``error`` to a new file only its owner can read
    (mode 0600) under ``$XDG_CACHE_HOME/tapml`` (default ``~/.cache/tapml``), else the temp dir.

    Returns the file's path, or None when neither place is writable.
    """
    import shlex
    import sys
    import tempfile
    import time
    import traceback

    from tapml import version
    text = (f"tapml {version()}, Python {sys.version.split()[0]}, {time.strftime('%Y-%m-%d %H:%M:%S %z')}\n"
            f"command: {shlex.join(sys.argv)}\n\n" + "".join(traceback.format_exception(error)))
    cache = os.environ.get("XDG_CACHE_HOME", "")
    cache = cache if os.path.isabs(cache) else os.path.join(os.path.expanduser("~"), ".cache")
    name = f"tapml-crash-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.txt"
    folders = [Path(cache) / "tapml"] if os.path.isabs(cache) else []  # "~" stays relative without a home
    for folder in folders + [Path(tempfile.gettempdir())]:
        try:
            folder.mkdir(mode=0o700, parents=True, exist_ok=True)
            fd = os.open(folder / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
            with os.fdopen(fd, "w", encoding="utf-8", errors="replace") as f:
                f.write(text)
            return str(folder / name)
        except OSError:
            continue
    return None


def write_json(data, path: str) -> None:
    """Write JSON to a file atomically, or to stdout when path is '-'."""
    if path == "-":
        out.print_json(json.dumps(data, allow_nan=False))
        return
    from tapml.carving.store import write_json_atomic
    target = Path(path)
    if not target.parent.is_dir():
        fail(f"cannot write {path}: directory {target.parent} does not exist")
    write_json_atomic(target, data)


def open_store(path: str):
    from tapml.carving.store import CarveStore
    return CarveStore(path)


def progress_bar(quiet: bool = False):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=console, transient=True, disable=quiet or not console.is_terminal)


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
    created = not target.exists()
    try:
        with progress_bar(quiet) as bar:
            task = bar.add_task(f"carving {model}", total=None)
            info = carve_model(model, output, seed=seed, device=device, hf_config=overrides,
                               on_start=lambda n: bar.update(task, total=n),
                               on_node=lambda _: bar.advance(task))
    except BaseException:
        if created:  # no half-written store left behind
            import shutil
            shutil.rmtree(target, ignore_errors=True)
        raise
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


@app.command()
@command
def replay(store: str = typer.Argument(..., help="Carve store directory"),
           target: str = TargetOpt, json_out: Optional[str] = JsonOpt, tol: Optional[List[str]] = TolOpt,
           inject: Optional[List[str]] = InjectOpt, token_file: Optional[str] = TokenFileOpt,
           anchored: bool = typer.Option(False, "--fp64-anchored", help="Judge float errors against a float64 recomputation"),
           op: Optional[List[str]] = typer.Option(None, "--op", help="Only cases of this op (repeatable)"),
           quiet: bool = QuietOpt):
    """Run every carved case of STORE on TARGET and compare with the reference."""
    from tapml.compare import Tolerances
    from tapml.replay import replay as replay_store
    from tapml.targets import check_target, open_target, read_token
    check_target(target)
    tolerances = Tolerances.parse(tol)
    s = open_store(store)
    cases = [c for c in s.cases if not op or c["op"] in op]
    if op and not cases:
        fail(f"no cases of {', '.join(op)} in {store}; `tapml inspect {store}` lists its ops")
    with open_target(target, token=read_token(token_file), inject=inject) as platform, progress_bar(quiet) as bar:
        task = bar.add_task(f"replay on {target}", total=len(cases))
        result = replay_store(s, platform, target, tolerances, anchored=anchored, cases=cases,
                              on_case=lambda v: bar.advance(task))
    if json_out:
        write_json(result, json_out)
    if json_out != "-":
        render_verdicts(result, quiet)
    raise typer.Exit(EXIT_OK if result["summary"]["pass"] == len(result["cases"]) else EXIT_FINDING)


# Commands of other subsystems live in their own modules; each has ``register(app)``.
COMMAND_MODULES: list[str] = ["tapml.cli_gentests", "tapml.cli_migrate", "tapml.cli_remote", "tapml.cli_bench", "tapml.cli_report"]


def main() -> None:
    import importlib
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(app)
    app(prog_name="tapml")


if __name__ == "__main__":
    main()
