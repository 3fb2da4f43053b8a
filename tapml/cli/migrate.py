"""``tapml migrate``: offload a model to a target, checked step by step."""

from __future__ import annotations

from typing import List, Optional

import typer

from tapml.cli.common import (TrustRemoteCodeOpt, DeviceLimitOpt, DtypeOpt, InjectOpt, JsonOpt, KeepFloat32Opt, KernelOpt, QuietOpt, TokenFileOpt,
                              TokenMapOpt, TolOpt, app, check_dtype, command, console, fail, is_store_path, out,
                              write_json, QuantizeOpt, QuantizedOpsOpt, check_quantize)
from tapml.cli.store import check_device_limits, check_targets, limits_for, render_matrix_run, run_preflight
from tapml.render import fmt_err, keep_names_whole
from tapml.text import plain, shown

HfConfigOpt = typer.Option(None, "--hf-config", help="KEY=VALUE config override when MODEL is an hf: spec or a "
                                                    "checkpoint to carve, e.g. num_hidden_layers=2 (repeatable)")
ModelArg = typer.Argument(..., help="Carve store directory, or a MODEL spec (zoo:NAME, hf:TYPE, hf:ORG/NAME, a "
                                    "checkpoint folder, FILE.gguf, file.py:factory, file.pt2) to carve first")


class MigrationDisplay:
    """Live view on stderr: the stage, its progress and the findings so far. Falls back to
    one line per stage and finding when stderr is not a terminal."""

    def __init__(self, title: str, quiet: bool = False):
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
        self.title = title
        self.quiet = quiet
        self.live_mode = console.is_terminal and not quiet
        self.progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("{task.fields[label]}"), TimeElapsedColumn(), console=console)
        self.task = None
        self.findings: list[dict] = []
        self.live = None

    def __enter__(self):
        if self.live_mode:
            from rich.live import Live
            self.live = Live(self._render(), console=console, refresh_per_second=8, transient=True)
            self.live.__enter__()
        return self

    def __exit__(self, *exc):
        if self.live is not None:
            self.live.__exit__(*exc)

    def _render(self):
        from rich.console import Group
        from rich.table import Table
        from rich.text import Text
        parts = [Text(self.title, style="bold"), self.progress]
        if self.findings:
            table = Table(title="findings", title_justify="left", expand=False)
            for col in ("kind", "op", "node", "module", "max_abs_err"):
                table.add_column(col, overflow="fold")
            for f in self.findings[-8:]:
                table.add_row(*map(shown, (f["kind"], f["op"], f["node"], f["module"])), fmt_err(f["max_abs_err"]))
            keep_names_whole(table)
            parts.append(table)
        return Group(*parts)

    def event(self, kind: str, data: dict) -> None:
        """The ``on_event`` callback of :class:`~tapml.driving.migrate.Migration`."""
        if kind == "stage":
            if self.task is not None:
                self.progress.update(self.task, visible=False)
            self.task = self.progress.add_task(f"{shown(data['stage'])} stage", total=data["total"], label="")
            if not self.live_mode and not self.quiet:
                journaled = f" ({data['journaled']} already in the journal)" if data.get("journaled") else ""
                console.print(f"{data['stage']} stage: {data['total']} to check{journaled}", highlight=False)
        elif kind == "step":
            if data["stage"] == "bisect":
                self.progress.update(self.task, label=f"bisect {shown(data['label'])}")
            else:
                self.progress.update(self.task, advance=1, label=shown(data["label"]))
        elif kind == "finding":
            self.findings.append(data)
            if not self.live_mode and not self.quiet:
                console.print(f"  finding: {shown(data['kind'])} {shown(data['op'])} at {shown(data['node'])} "
                              f"({shown(data['module'] or '<root>')}) "
                              f"max_abs_err {fmt_err(data['max_abs_err'])}", highlight=False)
        if self.live is not None:
            self.live.update(self._render())


def render_state(state: dict, quiet: bool = False) -> None:
    """The end of a migration: placement share, each failure with its culprit, end-to-end error."""
    from rich.table import Table
    p = state["placement"]
    culprits = state["culprits"]
    if culprits and not quiet:
        table = Table(title=f"failures on {shown(state['target'])} and their culprits")
        wide = out.width >= 140  # messages stay in the state file on narrow terminals
        graphs = any(c.get("graph") for c in culprits)
        for col in (("graph",) if graphs else ()) + ("kind", "op", "node", "module", "max_abs_err", "max_rel_err",
                                                     "mismatch") + (("message",) if wide else ()):
            table.add_column(col, overflow="fold")
        for c in culprits:
            frac = "-" if c["mismatch_fraction"] is None else f"{c['mismatch_fraction']:.1%}"
            if c["kind"] in ("accumulated", "fusion") or len(c["nodes"]) <= 1:
                nodes = c["node"]
            elif len(c["nodes"]) <= 3:
                nodes = ", ".join(c["nodes"])
            else:
                nodes = f"{c['nodes'][0]} (+{len(c['nodes']) - 1})"
            where = (shown(f"{c.get('graph') or '-'}" + (f" step {c['step']}" if c.get("step") is not None else "")),) \
                if graphs else ()
            table.add_row(*where, shown(c["kind"]), shown(c["op"]), shown(nodes), shown(c["module"] or "<root>"),
                          fmt_err(c["max_abs_err"]), fmt_err(c["max_rel_err"]), frac,
                          *((shown((c["message"] or "")[:120]),) if wide else ()))
        keep_names_whole(table)
        out.print(table)
    s = state["summary"]
    total = sum(s.values())
    out.print(f"op stage: {s['pass']}/{total} cases pass, {s['mismatch']} mismatch, {s['unsupported']} unsupported, "
              f"{s['error']} error", highlight=False)
    regions = [u for u in state["units"] if u["kind"] == "region"]
    modules = [u for u in regions if u.get("role") == "module"]
    out.print(f"region stage: {len(modules)} regions, {sum(u['status'] != 'pass' for u in modules)} failed, "
              f"{len(regions) - len(modules)} bisection runs", highlight=False)
    out.print(f"placement: {p['ops_on_target']}/{p['ops_total']} ops ({p['ops_share']:.1%}) and "
              f"{p['flops_share']:.1%} of FLOPs on {shown(state['target'])}", highlight=False)
    line = dtype_placement_line(state.get("precision"))
    if line:
        out.print(line, highlight=False)
    e = state["end_to_end"] or {"status": "not run", "max_abs_err": None, "max_rel_err": None, "message": ""}
    color = "green" if e["status"] == "pass" else "red"
    out.print(f"end to end: [{color}]{shown(e['status'])}[/] max_abs_err {fmt_err(e['max_abs_err'])} "
              f"max_rel_err {fmt_err(e['max_rel_err'])}" + (f" ({shown(e['message'])})" if e.get("message") else ""),
              highlight=False)
    if e.get("distribution") and e["status"] == "pass":  # a failing one's message says it already
        from tapml.judging.compare import agreement_note
        out.print(f"  a quantized model: its {agreement_note(e['distribution'])}", highlight=False)
    decode = next((u for u in state["units"] if u["kind"] == "model" and u.get("graph") == "decode"), None)
    if decode is not None:  # a generation store: its decode graph was a second pass
        d = p.get("decode") or {}
        color = "green" if decode["status"] == "pass" else "red"
        out.print(f"decode graph: {d.get('ops_on_target', '?')}/{d.get('ops_total', '?')} ops on {shown(state['target'])}; "
                  f"decode step end to end: [{color}]{shown(decode['status'])}[/] max_abs_err "
                  f"{fmt_err(decode['max_abs_err'])}" + (f" ({shown(decode['message'])})" if decode.get("message") else ""),
                  highlight=False)
    matches = e["status"] == "pass" and (decode is None or decode["status"] == "pass")
    verdict = "[green]migrated: everything passed[/]" if state["passed"] else \
        f"[red]{len(culprits)} finding(s)[/]" + ("" if matches else "; the model does not match end to end")
    out.print(verdict, highlight=False)


def render_resumed(migration, target: str) -> None:
    """What ``--resume`` owed to the journal and what it checked now."""
    from tapml.driving.journal import journal_path
    journal = shown(str(journal_path(migration.state_path)))
    if not migration.reused:
        out.print(f"resumed on {shown(target)}: nothing usable in {journal}; all {migration.checked} verdicts "
                  "checked now", highlight=False, soft_wrap=True)
    else:
        out.print(f"resumed on {shown(target)}: {migration.reused} verdicts from {journal}, {migration.checked} "
                  "checked now", highlight=False, soft_wrap=True)


def dtype_placement_line(precision: dict | None) -> str:
    """``"4 nodes kept in float32, the rest in float16 (6 casts added, not counted above)"`` for a
    state's ``precision`` with a keep_float32 list; empty otherwise."""
    if not precision or not (precision["keep_float32"] or (precision.get("decode") or {}).get("keep_float32")):
        return ""
    decode = precision.get("decode")
    kept = f"{len(precision['keep_float32'])} nodes" + \
        (f" ({len(decode['keep_float32'])} in the decode graph)" if decode else "")
    casts = precision.get("casts", 0) + (decode or {}).get("casts", 0)
    return (f"precision: {kept} kept in float32, the rest in {precision['dtype']} ({casts} casts added: bookkeeping, "
            "not counted in the placement)")


def state_for_target(state: str, target: str) -> str:
    """The state file of one target when a migration runs on several: the target spec, its
    punctuation turned into dashes, before the suffix (``s.json``, ``wgpu:vulkan`` -> ``s.wgpu-vulkan.json``)."""
    import re
    from pathlib import Path
    path = Path(state)
    slug = re.sub(r"[^A-Za-z0-9]+", "-", target).strip("-")
    return str(path.with_name(f"{path.stem}.{slug}{path.suffix or '.json'}"))


MigrateTargetsOpt = typer.Option(["reference"], "--target", "-t",
                                 help="reference, wgpu[:vulkan|gl|metal|dx12], browser, remote://HOST:PORT; "
                                      "repeatable: one migration per target, one after another, each with its own "
                                      "state file named from --state (s.json -> s.wgpu-vulkan.json) and one matrix "
                                      "at the end; --inject then goes into every target but reference, --kernel into "
                                      "the WGSL ones")


@app.command(name="migrate")
@command
def migrate(model: str = ModelArg, target: List[str] = MigrateTargetsOpt,
            state: str = typer.Option(..., "--state", help="Migration state file (JSON) to write; its journal "
                                                           "is kept beside it as STATE.journal"),
            resume: bool = typer.Option(False, "--resume", help="Continue from the state's journal, skipping what is done"),
            inject: Optional[List[str]] = InjectOpt, kernel: Optional[List[str]] = KernelOpt,
            tol: Optional[List[str]] = TolOpt,
            token_file: Optional[str] = TokenFileOpt, token_map: Optional[str] = TokenMapOpt,
            hf_config: Optional[List[str]] = HfConfigOpt, dtype: Optional[str] = DtypeOpt, trust_remote_code: bool = TrustRemoteCodeOpt,
            keep_float32: Optional[List[str]] = KeepFloat32Opt, device_limit: Optional[List[str]] = DeviceLimitOpt,
            quantize: Optional[str] = QuantizeOpt, quantized_ops: str = QuantizedOpsOpt, quiet: bool = QuietOpt, json_out: Optional[str] = JsonOpt):
    """Offload MODEL to TARGET: each op, then growing regions, then the whole model, checking each step.
    Before it starts, a limits preflight says which tensors the target's limits made split."""
    from pathlib import Path

    from tapml.judging.compare import Tolerances
    from tapml.driving.inject import parse_faults
    from tapml.carving import open_or_carve
    from tapml.driving.precision import read_keep_items
    from tapml.driving.targets import read_tokens
    targets = check_targets(target)
    limits = check_device_limits(device_limit, targets)
    tolerances = Tolerances.parse(tol)
    token = read_tokens(token_file, token_map)
    parse_faults(inject or [])
    if kernel:
        from tapml.platforms.wgsl.user_kernels import parse_kernel_options
        from tapml.driving.targets import takes_kernels
        parse_kernel_options(kernel)
        if not any(takes_kernels(t) for t in targets):
            fail(f"--kernel replaces a lowering of tapml's WGSL compiler, and none of {', '.join(targets)} runs it: "
                 "add a wgpu, browser or remote:// target")
    keep = read_keep_items(keep_float32 or [])
    dtype = check_dtype(dtype, None if is_store_path(model) else model, quiet)
    quantize = check_quantize(quantize, model, quantized_ops)
    if keep and not is_store_path(model) and not model.endswith(".pt2") and (dtype or "float32") == "float32":
        fail("--keep-float32 needs a float16/bfloat16 carve: add --dtype float16")
    if Path(state).is_dir():
        fail(f"--state {state} is a directory; give a file name such as {Path(state) / 'state.json'}")
    if not Path(state).parent.is_dir():
        fail(f"cannot write --state {state}: directory {Path(state).parent} does not exist")
    from tapml.io import ExclusiveLock
    from tapml.driving.journal import recorded_store
    from tapml.driving.migrate import Migration, check_faults, exit_code
    from tapml.frontends.models import parse_hf_overrides
    from tapml.driving.precision import resolve_keep_float32
    from tapml.driving.replay import injects_into
    from tapml.driving.targets import open_target, takes_kernels
    # One writer of this state, its journal and the store carved beside it, for the whole command.
    with ExclusiveLock(state, f"--state {state}"):
        store, store_path = open_or_carve(model, state, on_carve=lambda spec, path: None if quiet else console.print(
            f"carving {shown(spec)} into {shown(path)}", highlight=False), hf_config=parse_hf_overrides(hf_config),
            dtype=dtype, recorded=recorded_store(state), quantize=quantize, quantized_ops=quantized_ops)
        check_faults(store.graph, inject)
        resolve_keep_float32({"model": store.graph, **({"decode": store.step_graph("decode")}
                                                       if store.is_generation else {})}, keep)
        if len(targets) > 1:
            paths = {t: state_for_target(state, t) for t in targets}
            results = {}
            for t in targets:
                faults = inject if injects_into(t) else None
                with open_target(t, token=token, inject=faults, limits=limits_for(t, limits),
                                 kernels=kernel if takes_kernels(t) else None) as platform:
                    run_preflight(store, platform, t, quiet=quiet)
                    with MigrationDisplay(f"migrating {plain(store.model)} to {plain(t)} ({plain(paths[t])})",
                                          quiet) as display:
                        migration = Migration(store, platform, t, paths[t], tolerances=tolerances, inject=faults,
                                              resume=resume, on_event=display.event, store_path=str(store_path),
                                              keep_float32=keep, kernels=kernel if takes_kernels(t) else None)
                        results[t] = migration.run()
                    if resume:
                        render_resumed(migration, t)

            def render_target(doc: dict) -> None:
                out.print(f"[bold]{shown(doc['target'])}[/] ({shown(paths[doc['target']])})", highlight=False)
                render_state(doc, quiet)

            raise typer.Exit(render_matrix_run(results, False, False, quiet, json_out, render_target))
        target = targets[0]
        with open_target(target, token=token, inject=inject, limits=limits_for(target, limits), kernels=kernel) as platform:
            run_preflight(store, platform, target, quiet=quiet)
            with MigrationDisplay(f"migrating {plain(store.model)} to {plain(target)}", quiet) as display:
                migration = Migration(store, platform, target, state, tolerances=tolerances, inject=inject,
                                      resume=resume, on_event=display.event, store_path=str(store_path),
                                      keep_float32=keep, kernels=kernel)
                result = migration.run()
        if resume:
            render_resumed(migration, target)
    if json_out:
        write_json(result, json_out)
    if json_out != "-":
        render_state(result, quiet)
    raise typer.Exit(exit_code(result))


__all__ = ["render_state", "MigrationDisplay", "ModelArg", "HfConfigOpt", "state_for_target", "dtype_placement_line"]
