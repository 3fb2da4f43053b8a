"""``tapml session``: the REPL over :class:`tapml.driving.session.Session`, with history and tab
completion of node names, module paths and op names. Reads a script from stdin when stdin is
not a terminal (every command echoed, exit 2 when one failed)."""

from __future__ import annotations

import cmd
import os
import shlex
import time
from pathlib import Path
from typing import List, Optional

import typer

from tapml.cli.common import (TrustRemoteCodeOpt, DtypeOpt, InjectOpt, KernelOpt, TargetOpt, TokenFileOpt, TolOpt, app, check_dtype, command, fail,
                              make_console, QuantizeOpt, QuantizedOpsOpt, check_quantize)
from tapml.cli.migrate import HfConfigOpt, ModelArg
from tapml.errors import TapmlError
from tapml.render import fmt_err
from tapml.text import shown


@app.command(name="session")
@command
def session(model: str = ModelArg, target: str = TargetOpt,
            state: Optional[str] = typer.Option(None, "--state", help="State file that `save` writes (and next to "
                                                                      "which a MODEL spec is carved)"),
            inject: Optional[List[str]] = InjectOpt, kernel: Optional[List[str]] = KernelOpt,
            tol: Optional[List[str]] = TolOpt, token_file: Optional[str] = TokenFileOpt, hf_config: Optional[List[str]] = HfConfigOpt,
            graph: str = typer.Option("prefill", "--graph", help="The graph of a generation store to work on: "
                                      "prefill, or decode (its first decode step, with the reference's cache "
                                      "after the prefill)"),
            dtype: Optional[str] = DtypeOpt, trust_remote_code: bool = TrustRemoteCodeOpt,
            quantize: Optional[str] = QuantizeOpt, quantized_ops: str = QuantizedOpsOpt):
    """Interactive offloading: place nodes, modules or ops on TARGET and check them step by step."""
    from tapml.frontends.models import parse_hf_overrides
    from tapml.driving.session import Session
    from tapml.driving.targets import read_token
    with Session(model, target=target, state=state, inject=inject, kernels=kernel, tol=tol, token=read_token(token_file),
                 hf_config=parse_hf_overrides(hf_config), graph=graph, dtype=check_dtype(dtype, model),
                 quantize=check_quantize(quantize, model, quantized_ops), quantized_ops=quantized_ops) as s:
        shell = SessionShell(s)
        shell.cmdloop()
    if shell.errors and not shell.interactive:
        fail(f"{shell.errors} scripted command(s) failed (see above)")


class SessionShell(cmd.Cmd):
    """The ``tapml session`` REPL. Reads commands from stdin (a terminal or a script)."""

    intro_text = "tapml session: `help` lists commands, TAB completes names, `quit` leaves."

    def __init__(self, session, console=None, stdin=None):
        super().__init__(stdin=stdin)
        self.s = session
        self.console = console or make_console(highlight=False)
        self.interactive = stdin is None and os.isatty(0)
        self.use_rawinput = stdin is None
        self.prompt = "tapml> " if self.interactive else ""
        self.errors = 0
        self._history = None

    # loop plumbing -------------------------------------------------------------------------
    def preloop(self) -> None:
        if self.interactive:
            try:
                import readline
            except ImportError:
                readline = None
            if readline is not None:
                readline.set_completer_delims(" \t\n")
                self._history = Path(os.environ.get("TAPML_HISTORY", Path.home() / ".tapml_history"))
                try:
                    readline.read_history_file(self._history)
                except OSError:
                    pass
            self.console.print(self.intro_text)
        graph = f" ({self.s.graph_kind} graph)" if self.s.graph_kind else ""
        self.console.print(f"{shown(self.s.store.model)}{graph}: {len(self.s.graph.nodes)} nodes, target {shown(self.s.target)}; "
                           "everything starts on the reference")
        if self.s.scope_note:
            self.console.print(shown(self.s.scope_note), highlight=False)

    def postloop(self) -> None:
        if self._history is not None:
            import readline
            try:
                readline.write_history_file(self._history)
            except OSError:
                pass

    def precmd(self, line: str) -> str:
        if not self.interactive and line.strip() and line != "EOF":
            self.console.print(f"[dim]> {shown(line.strip())}[/]")
        return line

    def onecmd(self, line: str) -> bool:
        try:
            return super().onecmd(line)
        except TapmlError as e:
            self.errors += 1
            self.console.print(f"[bold red]error:[/] {shown(str(e))}")
        except Exception as e:  # noqa: BLE001 - one failing command must not end the session
            self.errors += 1
            self.console.print(f"[bold red]error:[/] {type(e).__name__}: {shown(str(e))}")
        return False

    def emptyline(self) -> bool:
        return False

    def default(self, line: str) -> None:
        self.errors += 1
        self.console.print(f"[bold red]error:[/] unknown command {shown(repr(line.split()[0]))}; `help` lists commands")

    def _complete_names(self, text: str) -> list[str]:
        return [n for n in self.s.names() if n.startswith(text)]

    complete_offload = complete_fallback = lambda self, text, *a: self._complete_names(text)  # noqa: E731

    def complete_diff(self, text, *a):
        return [n for n in self.s._nodes if n.startswith(text)]

    # commands ------------------------------------------------------------------------------
    def do_status(self, arg):
        """status: placement shares, target regions, per-module counts, last check, culprits."""
        from rich.table import Table
        st = self.s.status()
        p = st["placement"]
        self.console.print(f"{shown(st['model'])} on {shown(st['target'])}: {p['ops_on_target']}/{p['ops_total']} ops "
                           f"({p['ops_share']:.1%}), {p['flops_share']:.1%} of FLOPs on the target, "
                           f"{len(st['regions'])} target region(s)")
        table = Table(title="modules")
        for col in ("module", "nodes", "on target"):
            table.add_column(col)
        for m in st["modules"]:
            table.add_row(shown(m["module"]), str(m["nodes"]), str(m["on_target"]))
        self.console.print(table)
        if st["last_check"]:
            c = st["last_check"]
            self.console.print(f"last check: {shown(c['status'])} max_abs_err {fmt_err(c['max_abs_err'])}")
        for c in st["culprits"]:
            self.console.print(f"culprit: {shown(c['kind'])} {shown(c['op'])} at {shown(c['node'])} ({shown(c['module'])}) "
                               f"max_abs_err {fmt_err(c['max_abs_err'])}")

    def do_offload(self, arg):
        """offload NODE|MODULE|OP|CASE|all ...: place nodes on the target."""
        moved = self.s.offload(*shlex.split(arg))
        self.console.print(f"{len(moved)} node(s) moved to the target; "
                           f"{self.s.status()['placement']['ops_on_target']} on the target now")

    def do_fallback(self, arg):
        """fallback NODE|MODULE|OP|CASE|all ...: place nodes back on the reference."""
        moved = self.s.fallback(*shlex.split(arg))
        self.console.print(f"{len(moved)} node(s) moved to the reference; "
                           f"{self.s.status()['placement']['ops_on_target']} on the target now")

    def do_check(self, arg):
        """check [ops]: run the model on the current placement and compare end to end
        (`check ops`: the carved cases of the nodes on the target, each alone)."""
        if arg.strip() == "ops":
            r = self.s.compare_ops()
            s = r["summary"]
            self.console.print(f"{s['pass']}/{len(r['cases'])} cases pass, {s['mismatch']} mismatch, "
                               f"{s['unsupported']} unsupported, {s['error']} error")
            for v in r["cases"]:
                if v["status"] != "pass":
                    self.console.print(f"  {shown(v['id'])} {shown(v['op'])} ({shown(v['node'])}): {shown(v['status'])} "
                                       f"{shown(v['message'][:120])}")
            return
        if arg.strip():
            raise TapmlError("check takes no argument, or `ops`")
        start = time.perf_counter()
        v = self.s.compare_model()
        color = "green" if v["status"] == "pass" else "red"
        self.console.print(f"end to end: [{color}]{shown(v['status'])}[/] max_abs_err {fmt_err(v['max_abs_err'])} "
                           f"max_rel_err {fmt_err(v['max_rel_err'])} ({time.perf_counter() - start:.2f}s)")
        if v["message"]:
            self.console.print(f"  {shown(v['message'][:300])}")
        for r in v["region_checks"]:
            if r["status"] != "pass":
                self.console.print(f"  region {shown(r['first'])}..{shown(r['last'])} ({r['nodes']} nodes): first differs at "
                                   f"{shown(r['worst_output'])} max_abs_err {fmt_err(r['max_abs_err'])}")

    def do_bisect(self, arg):
        """bisect: find the smallest failing sub-region of the nodes on the target."""
        c = self.s.bisect()
        if c is None:
            self.console.print("[green]the nodes on the target pass with reference inputs[/]; nothing to bisect")
            return
        self.console.print(f"culprit ({c['probes']} runs): {shown(c['kind'])} {shown(c['op'])} at {shown(c['node'])} ({shown(c['module'])}) "
                           f"max_abs_err {fmt_err(c['max_abs_err'])}; `fallback {shown(' '.join(c['nodes'][:8]))}` "
                           "places it on the reference")

    def do_diff(self, arg):
        """diff NODE: error of NODE's outputs on the current placement, and the worst elements."""
        from rich.table import Table
        args = shlex.split(arg)
        if len(args) != 1:
            raise TapmlError("diff takes one node name")
        d = self.s.diff(args[0])
        self.console.print(f"{shown(d['node'])} ({shown(d['op'])}, {shown(d['module'] or '<root>')}) on the {shown(d['placed'])}")
        for o in d["outputs"]:
            state = "[green]pass[/]" if o["passed"] else "[red]mismatch[/]"
            self.console.print(f"  {shown(o['ref'])} {shown(o['dtype'])}{o['shape']}: {state} max_abs_err {fmt_err(o['max_abs_err'])} "
                               f"max_rel_err {fmt_err(o['max_rel_err'])} mismatch {fmt_err(o['mismatch_fraction'])}")
            if o["worst"]:
                table = Table(title="worst elements")
                for col in ("index", "target", "reference"):
                    table.add_column(col)
                for w in o["worst"]:
                    table.add_row(str(w["index"]), str(w["target"]), str(w["reference"]))
                self.console.print(table)

    def do_profile(self, arg):
        """profile: time per target region on the current placement."""
        from rich.table import Table
        p = self.s.profile()
        if not p["regions"]:
            self.console.print("nothing is on the target")
            return
        table = Table(title=f"target regions: {p['target_ms']:.2f} ms on the target, {p['reference_ms']:.2f} ms "
                            "on the reference")
        for col in ("first", "last", "nodes", "run_ms", "compile_ms", "bytes_in", "bytes_out"):
            table.add_column(col)
        for r in p["regions"]:
            table.add_row(shown(r["first"]), shown(r["last"]), str(r["nodes"]), f"{r['run_ms']:.3f}", f"{r['compile_ms']:.1f}",
                          str(r["bytes_in"]), str(r["bytes_out"]))
        self.console.print(table)

    def do_save(self, arg):
        """save [FILE]: write the session state (migration state JSON)."""
        path = self.s.save(arg.strip() or None)
        self.console.print(f"saved {shown(path)}")

    def do_report(self, arg):
        """report [FILE]: write a report (HTML, Markdown or JUnit XML by suffix) and print a summary.

        FILE defaults to STATE.html beside the state file, else tapml-session.html."""
        from rich.table import Table

        from tapml.reports import write_report
        path = Path(arg.strip()) if arg.strip() else \
            self.s.state_path.with_suffix(".html") if self.s.state_path else Path("tapml-session.html")
        self.console.print(f"report written to {shown(write_report(self.s.state(), path))}")
        st = self.s.state()
        table = Table(title=f"{shown(st['model'])} on {shown(st['target'])}")
        table.add_column("item")
        table.add_column("value")
        p = st["placement"]
        table.add_row("ops on target", f"{p['ops_on_target']}/{p['ops_total']} ({p['ops_share']:.1%})")
        table.add_row("FLOPs on target", f"{p['flops_share']:.1%}")
        s = st["summary"]
        table.add_row("cases checked", f"{sum(s.values())} ({s['pass']} pass)")
        table.add_row("checks run", str(len(st["units"])))
        e = st["end_to_end"]
        table.add_row("end to end", "not checked" if e is None else f"{shown(e['status'])} max_abs_err {fmt_err(e['max_abs_err'])}")
        for c in st["culprits"]:
            table.add_row("culprit", f"{shown(c['kind'])} {shown(c['op'])} at {shown(c['node'])} ({shown(c['module'])})")
        self.console.print(table)

    def do_quit(self, arg):
        """quit: leave the session."""
        return True

    do_exit = do_quit

    def do_EOF(self, arg):  # noqa: N802 - cmd's name for end of input
        if self.interactive:
            self.console.print()
        return True

    def do_help(self, arg):
        """help [COMMAND]: list commands, or describe one."""
        if arg:
            doc = getattr(getattr(self, f"do_{arg}", None), "__doc__", None)
            self.console.print(shown(doc or f"no command {arg!r}"))
            return
        for name in ("status", "offload", "fallback", "check", "bisect", "diff", "profile", "save", "report", "help",
                     "quit"):
            self.console.print("  " + shown(getattr(self, f"do_{name}").__doc__.splitlines()[0]))


__all__ = ["SessionShell"]
