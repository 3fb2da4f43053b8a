"""Interactive offloading: the migration's steps one at a time, from Python or a REPL.

:class:`Session` is the API (for notebooks and scripts); :class:`SessionShell` is the
``tapml session`` REPL on top of it, with history and tab completion of node names, module
paths and op names.

Example::

    with Session("zoo:tiny-gpt2", target="wgpu:vulkan") as s:
        s.offload("all")
        result = s.check()            # end to end on the hybrid placement
        if result["status"] != "pass":
            culprit = s.bisect()      # smallest failing sub-region
            s.fallback(*culprit["nodes"])
        s.save("gpt2-session.json")
"""

from __future__ import annotations

import cmd
import os
import shlex
import shutil
import time
from pathlib import Path

from rich.markup import escape

from tapml.errors import TapmlError
from tapml.hybrid import REFERENCE, TARGET, HybridRunner, placement_shares, segments
from tapml.migrate import RegionChecker, check_faults, check_model, common_module, open_or_carve
from tapml.migrate import bisect as smallest_failing_window
from tapml.render import fmt_err
from tapml.verdict import (CaseVerdict, Culprit, EndToEnd, MigrationState, RegionCheck, UnitVerdict, Verdict,
                           culprit_kind, outcome_verdict, summary)


class Session:
    """A model (carve store or MODEL spec) and a target, with a placement you change step by step.

    Arguments: ``model`` a carve store directory or a MODEL spec (carved into ``STATE.store/``
    beside ``state``, or into a temporary directory); ``target`` a TARGET spec; ``state`` the
    file :meth:`save` writes; ``inject`` and ``tol`` as ``tapml migrate --inject/--tol``
    (lists of strings); ``token`` for ``remote://`` targets. Everything starts on the reference.
    """

    def __init__(self, model: str, target: str = "reference", state: str | None = None,
                 inject: list[str] | None = None, tol=None, token: str | None = None, platform=None):
        from tapml.compare import Tolerances
        from tapml.targets import check_target, open_target
        check_target(target)
        self.tolerances = tol if isinstance(tol, Tolerances) else Tolerances.parse(tol)
        self.inject = list(inject or [])
        self.target = target
        self.state_path = Path(state) if state else None
        self.store, self.store_path = open_or_carve(str(model), state)
        # A model carved without --state lives in a scratch folder, removed at close unless saved.
        self._scratch = self.store_path.parent if state is None and not Path(str(model)).is_dir() else None
        self.graph = self.store.graph
        check_faults(self.graph, self.inject)
        self.platform = platform if platform is not None else open_target(target, token=token, inject=self.inject)
        self.checker = RegionChecker(self.store, self.platform, self.tolerances)
        self.runner = HybridRunner(self.graph, self.platform)
        self.placement: dict[str, str] = {n.name: REFERENCE for n in self.graph.nodes}
        self.cases: list[CaseVerdict] = []
        self.units: list[UnitVerdict] = []
        self.culprits: list[Culprit] = []
        self.last_check: UnitVerdict | None = None
        self._nodes = {n.name: n for n in self.graph.nodes}
        self._ops = sorted({n.op for n in self.graph.nodes})
        self._modules = sorted({p for n in self.graph.nodes for p in _ancestors(n.module)} - {""})

    def close(self) -> None:
        """Release the target (and the scratch store of an unsaved session)."""
        self.platform.close()
        if self._scratch is not None:
            shutil.rmtree(self._scratch, ignore_errors=True)
            self._scratch = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # placement -----------------------------------------------------------------------------
    def names(self) -> list[str]:
        """Everything a selection can name: node names, module paths, op names, ``all``."""
        return ["all", *self._nodes, *self._modules, *self._ops]

    def select(self, *what: str) -> list[str]:
        """Node names (topological order) that NODE, MODULE, OP, case id or ``all`` select."""
        if not what:
            raise TapmlError("name what to select: a node, a module path, an op, a case id or 'all'")
        chosen: set[str] = set()
        for w in what:
            if w in ("all", "<root>", "<model>"):
                chosen.update(self._nodes)
            elif w in self._nodes:
                chosen.add(w)
            elif w in self._ops:
                chosen.update(n for n, node in self._nodes.items() if node.op == w)
            elif w in self._modules:
                chosen.update(n for n, node in self._nodes.items() if node.module == w or node.module.startswith(w + "."))
            elif any(node.case == w for node in self._nodes.values()):
                chosen.update(n for n, node in self._nodes.items() if node.case == w)
            else:
                import difflib
                close = [x for x in self.names() if w in x][:5] or difflib.get_close_matches(w, self.names(), 5)
                hint = f"; did you mean {', '.join(close)}?" if close else "; `status` lists modules, TAB completes"
                raise TapmlError(f"no node, module, op or case named {w!r}{hint}")
        return [n for n in self._nodes if n in chosen]

    def offload(self, *what: str) -> list[str]:
        """Place the selected nodes on the target; returns those that moved."""
        return self._place(TARGET, what)

    def fallback(self, *what: str) -> list[str]:
        """Place the selected nodes back on the reference; returns those that moved."""
        return self._place(REFERENCE, what)

    def _place(self, where: str, what) -> list[str]:
        moved = [n for n in self.select(*what) if self.placement[n] != where]
        for n in moved:
            self.placement[n] = where
        return moved

    # checks --------------------------------------------------------------------------------
    def status(self) -> dict:
        """Placement shares, regions, per-module counts, the last check and the culprits found."""
        modules = {}
        for n in self.graph.nodes:
            top = n.module.split(".")[0] if n.module else "<root>"
            row = modules.setdefault(top, {"module": top, "nodes": 0, "on_target": 0})
            row["nodes"] += 1
            row["on_target"] += self.placement[n.name] == TARGET
        regions = [s for s in segments(self.graph, self.placement) if s.where == TARGET]
        return {"model": self.store.model, "target": self.target, "placement": placement_shares(self.graph, self.placement),
                "regions": [{"first": s.names[0], "last": s.names[-1], "nodes": len(s.nodes)} for s in regions],
                "modules": list(modules.values()),
                "last_check": None if self.last_check is None else self.last_check.to_json(),
                "culprits": [c.to_json() for c in self.culprits]}

    def check(self) -> dict:
        """Run the whole model on the current placement and compare end to end; also compare
        each target region's outputs with the reference (errors from earlier regions included,
        as in the real hybrid run). Returns the check's unit verdict as JSON: ``status``, error
        stats, ``message``, ``regions`` (how many target regions) and ``region_checks``."""
        # The values crossing out of target regions anyway; keeping them adds no program output.
        keep = {r for s in segments(self.graph, self.placement) if s.where == TARGET
                for r in self.graph.subgraph(s.names).outputs}
        outcome, result = check_model(self.store, self.runner, self.placement, self.tolerances, keep=keep)
        checks = []
        for run in result.regions if result is not None else ():
            rc, worst = self.checker.compare(result.values, run.outputs)
            checks.append(RegionCheck(first=run.nodes[0], last=run.nodes[-1], nodes=len(run.nodes),
                                      **{**outcome_verdict(rc).outcome(), "worst_output": worst}))
        verdict = UnitVerdict(id=f"check:{len(self.units)}", kind="model", role="session", module="",
                              nodes=list(self._nodes), on_target=sum(v == TARGET for v in self.placement.values()),
                              regions=None if result is None else len(result.regions), region_checks=checks,
                              **outcome.outcome())
        self.units.append(verdict)
        self.last_check = verdict
        return verdict.to_json()

    def check_ops(self) -> dict:
        """The op stage for the nodes now on the target: their carved cases, each alone with
        the reference's inputs. Returns ``{"cases": [...], "summary": {...}}``."""
        from tapml.replay import check_case
        wanted = {self._nodes[n].case for n in self._nodes if self.placement[n] == TARGET}
        verdicts = [check_case(self.platform, self.store, c, self.tolerances) for c in self.store.cases
                    if c["id"] in wanted]
        done = {v.id for v in verdicts}
        self.cases = [c for c in self.cases if c.id not in done] + verdicts
        return {"cases": [v.to_json() for v in verdicts], "summary": summary(verdicts)}

    def bisect(self) -> dict | None:
        """Find the smallest failing sub-region of the nodes on the target (each probe runs
        with the reference's values at its inputs). Returns the culprit, or None when the
        target nodes pass together."""
        nodes = [n for n in self._nodes if self.placement[n] == TARGET]
        if not nodes:
            raise TapmlError("nothing is on the target; `offload NODE|MODULE|OP|all` first")
        probes: list[tuple[list[str], Verdict]] = []

        order = list(self._nodes)
        position = {n: i for i, n in enumerate(order)}

        def fails(window: list[str]) -> bool:
            # The model from the window on, as it would run with only the window on the target and
            # the reference's values at its inputs; judged at the window's outputs and the model's,
            # since an error within tolerance at the window can grow past it downstream.
            span = order[position[window[0]]:]
            v = self.checker.check(span, {n: TARGET for n in window}, window)
            probes.append((window, v))
            return v.status != "pass"

        if not fails(nodes):
            return None
        window = smallest_failing_window(nodes, fails)
        evidence = next(v for w, v in reversed(probes) if w == window)
        surface = self.checker.producer.get(evidence.worst_output or "", self._nodes[window[-1]])
        culprit = Culprit.of(culprit_kind(evidence.status, len(window), alone=False), evidence, op=surface.op,
                             ops=sorted({self._nodes[n].op for n in window}),
                             node=window[0] if len(window) == 1 else f"{window[0]}..{window[-1]}", nodes=window,
                             module=common_module([self._nodes[n].module for n in window]), probes=len(probes))
        self.culprits.append(culprit)
        return culprit.to_json()

    def diff(self, node: str, worst: int = 8) -> dict:
        """Error of one node's outputs on the current placement against the reference:
        stats and the worst elements (index, target, reference)."""
        if node not in self._nodes:
            raise TapmlError(f"no node named {node!r}; TAB completes node names")
        n = self._nodes[node]
        result = self.runner.run(self.store.program_inputs(), self.placement, keep=n.output_refs)
        outputs = []
        for ref, meta in zip(n.output_refs, n.outputs):
            c = self.checker.compare_ref(result.values[ref], ref, worst=worst)
            outputs.append({"ref": ref, "shape": list(meta.shape), "dtype": meta.dtype,
                            "passed": c.passed, **c.stats(), "message": c.message, "worst": c.worst})
        return {"node": node, "op": n.op, "module": n.module, "placed": self.placement[node], "outputs": outputs}

    def profile(self, repeat: int = 3) -> dict:
        """Time per target region (best of ``repeat`` runs after a warm-up that compiles)."""
        inputs = self.store.program_inputs()
        self.runner.run(inputs, self.placement)
        best: list | None = None
        ref_ms = None
        for _ in range(max(1, repeat)):
            result = self.runner.run(inputs, self.placement)
            if best is None:
                best, ref_ms = [r.to_json() for r in result.regions], result.reference_ms
            else:
                for b, r in zip(best, result.regions):
                    b["run_ms"] = min(b["run_ms"], round(r.run_ms, 3))
                ref_ms = min(ref_ms, result.reference_ms)
        for b in best:
            b["compile_ms"] = round(self.runner.compile_ms.get((b["first"], b["last"]), 0.0), 3)
        return {"regions": best, "target_ms": round(sum(b["run_ms"] for b in best), 3),
                "reference_ms": round(ref_ms, 3)}

    # output --------------------------------------------------------------------------------
    def state(self) -> dict:
        """The session as a migration state document (same schema as ``tapml migrate --state``)."""
        from tapml.replay import device_info
        e = self.last_check
        return MigrationState(model=self.store.model, target=self.target, tolerances=self.tolerances.to_json(),
                              inject=self.inject, nodes=len(self.graph.nodes), cases=self.cases,
                              store=str(self.store_path), device=device_info(self.platform), stage="session",
                              units=self.units,
                              placement={"nodes": dict(self.placement), **placement_shares(self.graph, self.placement)},
                              culprits=self.culprits,
                              end_to_end=None if e is None else EndToEnd(regions=e.regions, **e.outcome())).to_json()

    def save(self, path: str | None = None) -> Path:
        """Write :meth:`state` atomically to ``path`` (default: the session's ``state`` file)."""
        from tapml.carving.store import write_json_atomic
        target = Path(path) if path else self.state_path
        if target is None:
            raise TapmlError("save needs a file name (or start the session with --state FILE)")
        if not target.parent.is_dir():
            raise TapmlError(f"cannot save to {target}: directory {target.parent} does not exist")
        write_json_atomic(target, self.state())
        self._scratch = None  # the saved state points at the store: keep it
        return target

    def report(self, path: str | None = None) -> Path | None:
        """Write a report of the session through ``tapml.reports`` when that package provides
        a writer (format from the suffix; default ``STATE.html`` beside the state file, else
        ``tapml-session.html``) and return its path; None when there is no writer."""
        try:
            from tapml.reports import write_report
        except ImportError:
            return None
        if path is None:
            path = self.state_path.with_suffix(".html") if self.state_path else Path("tapml-session.html")
        return Path(write_report(self.state(), path))


def _ancestors(path: str) -> list[str]:
    out = [path]
    while path:
        path = path.rpartition(".")[0]
        out.append(path)
    return out


class SessionShell(cmd.Cmd):
    """The ``tapml session`` REPL. Reads commands from stdin (a terminal or a script)."""

    intro_text = "tapml session: `help` lists commands, TAB completes names, `quit` leaves."

    def __init__(self, session: Session, console=None, stdin=None):
        super().__init__(stdin=stdin)
        from rich.console import Console
        self.s = session
        self.console = console or Console(highlight=False, emoji=False)
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
        self.console.print(f"{self.s.store.model}: {len(self.s.graph.nodes)} nodes, target {self.s.target}; "
                           "everything starts on the reference")

    def postloop(self) -> None:
        if self._history is not None:
            import readline
            try:
                readline.write_history_file(self._history)
            except OSError:
                pass

    def precmd(self, line: str) -> str:
        if not self.interactive and line.strip() and line != "EOF":
            self.console.print(f"[dim]> {escape(line.strip())}[/]")
        return line

    def onecmd(self, line: str) -> bool:
        try:
            return super().onecmd(line)
        except TapmlError as e:
            self.errors += 1
            self.console.print(f"[bold red]error:[/] {escape(str(e))}")
        except Exception as e:  # noqa: BLE001 - one failing command must not end the session
            self.errors += 1
            self.console.print(f"[bold red]error:[/] {type(e).__name__}: {escape(str(e))}")
        return False

    def emptyline(self) -> bool:
        return False

    def default(self, line: str) -> None:
        self.errors += 1
        self.console.print(f"[bold red]error:[/] unknown command {escape(repr(line.split()[0]))}; `help` lists commands")

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
        self.console.print(f"{st['model']} on {st['target']}: {p['ops_on_target']}/{p['ops_total']} ops "
                           f"({p['ops_share']:.1%}), {p['flops_share']:.1%} of FLOPs on the target, "
                           f"{len(st['regions'])} target region(s)")
        table = Table(title="modules")
        for col in ("module", "nodes", "on target"):
            table.add_column(col)
        for m in st["modules"]:
            table.add_row(m["module"], str(m["nodes"]), str(m["on_target"]))
        self.console.print(table)
        if st["last_check"]:
            c = st["last_check"]
            self.console.print(f"last check: {c['status']} max_abs_err {fmt_err(c['max_abs_err'])}")
        for c in st["culprits"]:
            self.console.print(f"culprit: {c['kind']} {c['op']} at {c['node']} ({c['module']}) "
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
            r = self.s.check_ops()
            s = r["summary"]
            self.console.print(f"{s['pass']}/{len(r['cases'])} cases pass, {s['mismatch']} mismatch, "
                               f"{s['unsupported']} unsupported, {s['error']} error")
            for v in r["cases"]:
                if v["status"] != "pass":
                    self.console.print(f"  {v['id']} {v['op']} ({v['node']}): {v['status']} "
                                       f"{escape(v['message'][:120])}")
            return
        if arg.strip():
            raise TapmlError("check takes no argument, or `ops`")
        start = time.perf_counter()
        v = self.s.check()
        color = "green" if v["status"] == "pass" else "red"
        self.console.print(f"end to end: [{color}]{v['status']}[/] max_abs_err {fmt_err(v['max_abs_err'])} "
                           f"max_rel_err {fmt_err(v['max_rel_err'])} ({time.perf_counter() - start:.2f}s)")
        if v["message"]:
            self.console.print(f"  {escape(v['message'][:300])}")
        for r in v["region_checks"]:
            if r["status"] != "pass":
                self.console.print(f"  region {r['first']}..{r['last']} ({r['nodes']} nodes): first differs at "
                                   f"{r['worst_output']} max_abs_err {fmt_err(r['max_abs_err'])}")

    def do_bisect(self, arg):
        """bisect: find the smallest failing sub-region of the nodes on the target."""
        c = self.s.bisect()
        if c is None:
            self.console.print("[green]the nodes on the target pass with reference inputs[/]; nothing to bisect")
            return
        self.console.print(f"culprit ({c['probes']} runs): {c['kind']} {c['op']} at {c['node']} ({c['module']}) "
                           f"max_abs_err {fmt_err(c['max_abs_err'])}; `fallback {' '.join(c['nodes'][:8])}` "
                           "places it on the reference")

    def do_diff(self, arg):
        """diff NODE: error of NODE's outputs on the current placement, and the worst elements."""
        from rich.table import Table
        args = shlex.split(arg)
        if len(args) != 1:
            raise TapmlError("diff takes one node name")
        d = self.s.diff(args[0])
        self.console.print(f"{d['node']} ({d['op']}, {d['module'] or '<root>'}) on the {d['placed']}")
        for o in d["outputs"]:
            state = "[green]pass[/]" if o["passed"] else "[red]mismatch[/]"
            self.console.print(f"  {o['ref']} {o['dtype']}{o['shape']}: {state} max_abs_err {fmt_err(o['max_abs_err'])} "
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
            table.add_row(r["first"], r["last"], str(r["nodes"]), f"{r['run_ms']:.3f}", f"{r['compile_ms']:.1f}",
                          str(r["bytes_in"]), str(r["bytes_out"]))
        self.console.print(table)

    def do_save(self, arg):
        """save [FILE]: write the session state (migration state JSON)."""
        path = self.s.save(arg.strip() or None)
        self.console.print(f"saved {path}")

    def do_report(self, arg):
        """report [FILE.html]: an HTML report when tapml.reports can write one, else a summary table."""
        from rich.table import Table
        path = self.s.report(arg.strip() or None)
        if path is not None:
            self.console.print(f"report written to {path}")
        st = self.s.state()
        table = Table(title=f"{st['model']} on {st['target']}")
        table.add_column("item")
        table.add_column("value")
        p = st["placement"]
        table.add_row("ops on target", f"{p['ops_on_target']}/{p['ops_total']} ({p['ops_share']:.1%})")
        table.add_row("FLOPs on target", f"{p['flops_share']:.1%}")
        s = st["summary"]
        table.add_row("cases checked", f"{sum(s.values())} ({s['pass']} pass)")
        table.add_row("checks run", str(len(st["units"])))
        e = st["end_to_end"]
        table.add_row("end to end", "not checked" if e is None else f"{e['status']} max_abs_err {fmt_err(e['max_abs_err'])}")
        for c in st["culprits"]:
            table.add_row("culprit", f"{c['kind']} {c['op']} at {c['node']} ({c['module']})")
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
            self.console.print(escape(doc or f"no command {arg!r}"))
            return
        for name in ("status", "offload", "fallback", "check", "bisect", "diff", "profile", "save", "report", "help",
                     "quit"):
            self.console.print("  " + escape(getattr(self, f"do_{name}").__doc__.splitlines()[0]))


__all__ = ["Session", "SessionShell"]
