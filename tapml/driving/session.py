"""Interactive offloading: the migration's steps one at a time, from Python.

:class:`Session` is the API (for notebooks and scripts); the ``tapml session`` REPL
(:mod:`tapml.cli.session`) is a shell on top of it.

Example::

    with Session("zoo:tiny-gpt2", target="wgpu:vulkan") as s:
        s.offload("all")
        result = s.compare_model()    # end to end on the hybrid placement
        if result["status"] != "pass":
            culprit = s.bisect()      # smallest failing sub-region
            s.fallback(*culprit["nodes"])
        s.save("gpt2-session.json")

On a generation store (``tapml carve MODEL --generate N``) the session works on its prefill
graph, or with ``graph="decode"`` on its decode graph, run on the first decode step's real
inputs with the reference's cache after the prefill (as ``tapml migrate``'s decode pass).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from tapml.carving import open_or_carve
from tapml.errors import TapmlError
from tapml.driving.hybrid import REFERENCE, TARGET, HybridRunner, placement_shares, segments
from tapml.io import write_json_atomic
from tapml.driving.migrate import check_faults
from tapml.driving.regions import CHECKED_STEP, RegionChecker, common_module, decode_step_inputs, run_model_against_reference
from tapml.driving.regions import bisect as smallest_failing_window
from tapml.judging.verdict import (CaseVerdict, Culprit, EndToEnd, MigrationState, RegionCheck, UnitVerdict, Verdict,
                           culprit_kind, outcome_verdict, summary)


class Session:
    """A model (carve store or MODEL spec) and a target, with a placement you change step by step.

    Arguments: ``model`` a carve store directory or a MODEL spec (carved into ``STATE.store/``
    beside ``state``, or into a temporary directory); ``target`` a TARGET spec; ``state`` the
    file :meth:`save` writes; ``inject``, ``kernels`` and ``tol`` as ``tapml migrate
    --inject/--kernel/--tol`` (lists of strings); ``token`` for ``remote://`` targets; ``graph`` which graph of a
    generation store to work on, ``"prefill"`` or ``"decode"`` (the first decode step, with the
    reference's cache after the prefill); ``dtype`` the ``--dtype`` a MODEL spec is carved in
    (``float32``, ``float16``, ``bfloat16``; a store given with another is refused), ``quantize``
    the ``--quantize`` scheme it is carved with (:mod:`tapml.frontends.quantize`), ``quantized_ops``
    whole or expand (``--quantized-ops``). A
    float16/bfloat16 model's regions and whole runs are judged against it in float32
    (:mod:`tapml.driving.regions`). Everything starts on the reference.
    """

    def __init__(self, model: str, target: str = "reference", state: str | None = None,
                 inject: list[str] | None = None, tol=None, token: str | None = None, platform=None,
                 hf_config: dict | None = None, graph: str = "prefill", dtype: str | None = None,
                 kernels: list[str] | None = None, quantize: str | None = None, quantized_ops: str = "whole"):
        from tapml.judging.compare import Tolerances
        from tapml.driving.targets import check_target, open_target
        check_target(target)
        if graph not in CHECKED_STEP:
            raise TapmlError(f"graph must be prefill or decode, not {str(graph)[:40]!r}")
        if graph == "decode" and not Path(str(model)).is_dir():
            raise TapmlError(f"--graph decode needs a generation store, and {str(model)[:200]} is a MODEL spec: "
                             "carve one with `tapml carve MODEL --generate N` and start the session on it")
        self.tolerances = tol if isinstance(tol, Tolerances) else Tolerances.parse(tol)
        self.inject = list(inject or [])
        self.target = target
        self.state_path = Path(state) if state else None
        from tapml.driving.journal import recorded_store
        self.store, self.store_path = open_or_carve(str(model), state, hf_config=hf_config, dtype=dtype,
                                                    recorded=recorded_store(state) if state else None,
                                                    quantize=quantize, quantized_ops=quantized_ops)
        # A model carved without --state lives in a scratch folder, removed at close unless saved.
        self._scratch = self.store_path.parent if state is None and not Path(str(model)).is_dir() else None
        if graph == "decode" and not self.store.is_generation:
            raise TapmlError(f"--graph decode: {self.store_path} is not a generation store (it has one graph); "
                             "carve one with `tapml carve MODEL --generate N`, or leave out --graph decode")
        #: The generation graph the session works on ("prefill" or "decode"); None outside a generation.
        self.graph_kind: str | None = graph if self.store.is_generation else None
        self.graph = self.store.step_graph("decode") if graph == "decode" else self.store.graph
        #: A line to show the user about what the session works on, else None.
        self.scope_note: str | None = None
        if self.graph_kind == "prefill":
            self.scope_note = ("this is a generation store: the session works on its prefill graph; "
                               "`--graph decode` works on its decode graph, `tapml generate` checks every step")
        elif self.graph_kind == "decode":
            self.scope_note = (f"the session works on the decode graph, at step {CHECKED_STEP['decode']} with the "
                               "reference's cache after the prefill")
        check_faults(self.graph, self.inject)
        self.platform = platform if platform is not None else open_target(target, token=token, inject=self.inject,
                                                                          kernels=kernels)
        inputs = (lambda: decode_step_inputs(self.store)) if graph == "decode" else None
        self.checker = RegionChecker(self.store, self.platform, self.tolerances, graph=self.graph, inputs=inputs)
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

    # runs and comparisons --------------------------------------------------------------------------------
    def status(self) -> dict:
        """The graph worked on (``graph``: prefill/decode in a generation, else None), placement
        shares, regions, per-module counts, the last check and the culprits found."""
        modules = {}
        for n in self.graph.nodes:
            top = n.module.split(".")[0] if n.module else "<root>"
            row = modules.setdefault(top, {"module": top, "nodes": 0, "on_target": 0})
            row["nodes"] += 1
            row["on_target"] += self.placement[n.name] == TARGET
        regions = [s for s in segments(self.graph, self.placement) if s.where == TARGET]
        return {"model": self.store.model, "target": self.target, "graph": self.graph_kind,
                "placement": placement_shares(self.graph, self.placement),
                "regions": [{"first": s.names[0], "last": s.names[-1], "nodes": len(s.nodes)} for s in regions],
                "modules": list(modules.values()),
                "last_check": None if self.last_check is None else self.last_check.to_json(),
                "culprits": [c.to_json() for c in self.culprits]}

    def compare_model(self) -> dict:
        """Run the whole model on the current placement and compare end to end; also compare
        each target region's outputs with the reference (errors from earlier regions included,
        as in the real hybrid run). Returns the check's unit verdict as JSON: ``status``, error
        stats, ``message``, ``regions`` (how many target regions) and ``region_checks``."""
        # The values crossing out of target regions anyway; keeping them adds no program output.
        keep = {r for s in segments(self.graph, self.placement) if s.where == TARGET
                for r in self.graph.subgraph(s.names).outputs}
        inputs, expected = self.checker.model_io() if self.graph_kind == "decode" else (None, None)
        outcome, result = run_model_against_reference(self.store, self.runner, self.placement, self.tolerances,
                                                      keep=keep, inputs=inputs, expected=expected)
        checks = []
        for run in result.regions if result is not None else ():
            rc, worst = self.checker.compare(result.values, run.outputs)
            checks.append(RegionCheck(first=run.nodes[0], last=run.nodes[-1], nodes=len(run.nodes),
                                      **{**outcome_verdict(rc).outcome(), "worst_output": worst}))
        verdict = UnitVerdict(id=f"{self._prefix}check:{len(self.units)}", kind="model", role="session", module="",
                              nodes=list(self._nodes), on_target=sum(v == TARGET for v in self.placement.values()),
                              regions=None if result is None else len(result.regions), region_checks=checks,
                              graph=self.graph_kind, **outcome.outcome())
        self.units.append(verdict)
        self.last_check = verdict
        return verdict.to_json()

    def compare_ops(self) -> dict:
        """The op stage for the nodes now on the target: their carved cases, each alone with
        the reference's inputs. Returns ``{"cases": [...], "summary": {...}}``."""
        from tapml.driving.replay import replay_case
        wanted = {self._nodes[n].case for n in self._nodes if self.placement[n] == TARGET}
        verdicts = [replay_case(self.platform, self.store, c, self.tolerances) for c in self.store.cases
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
            v = self.checker.compare_region(span, {n: TARGET for n in window}, window)
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
                             module=common_module([self._nodes[n].module for n in window]), probes=len(probes),
                             **self._where())
        self.culprits.append(culprit)
        return culprit.to_json()

    def diff(self, node: str, worst: int = 8) -> dict:
        """Error of one node's outputs on the current placement against the reference:
        stats and the worst elements (index, target, reference)."""
        if node not in self._nodes:
            raise TapmlError(f"no node named {node!r}; TAB completes node names")
        n = self._nodes[node]
        result = self.runner.run(self._inputs(), self.placement, keep=n.output_refs)
        outputs = []
        for ref, meta in zip(n.output_refs, n.outputs):
            c = self.checker.compare_ref(result.values[ref], ref, worst=worst)
            outputs.append({"ref": ref, "shape": list(meta.shape), "dtype": meta.dtype,
                            "passed": c.passed, **c.stats(), "message": c.message, "worst": c.worst})
        return {"node": node, "op": n.op, "module": n.module, "placed": self.placement[node], "outputs": outputs}

    def profile(self, repeat: int = 3) -> dict:
        """Time per target region (best of ``repeat`` runs after a warm-up that compiles)."""
        inputs = self._inputs()
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
        from tapml.driving.replay import device_info
        e = self.last_check
        return MigrationState(model=self.store.model, target=self.target, tolerances=self.tolerances.to_json(),
                              inject=self.inject, nodes=len(self.graph.nodes), cases=self.cases,
                              store=str(self.store_path), device=device_info(self.platform), stage="session",
                              units=self.units,
                              placement={"nodes": dict(self.placement), **placement_shares(self.graph, self.placement)},
                              culprits=self.culprits,
                              end_to_end=None if e is None else EndToEnd(regions=e.regions, **e.outcome()),
                              graph=self.graph_kind).to_json()

    def save(self, path: str | None = None) -> Path:
        """Write :meth:`state` atomically to ``path`` (default: the session's ``state`` file)."""
        target = Path(path) if path else self.state_path
        if target is None:
            raise TapmlError("save needs a file name (or start the session with --state FILE)")
        if not target.parent.is_dir():
            raise TapmlError(f"cannot save to {target}: directory {target.parent} does not exist")
        write_json_atomic(target, self.state())
        self._scratch = None  # the saved state points at the store: keep it
        return target


    # the graph ----------------------------------------------------------------------------
    @property
    def _prefix(self) -> str:
        """Unit ids of the decode graph start ``decode:``, as migrate's decode pass."""
        return "decode:" if self.graph_kind == "decode" else ""

    def _where(self) -> dict:
        """A culprit's ``graph`` and ``step`` in a generation (none outside one)."""
        return {} if self.graph_kind is None else {"graph": self.graph_kind, "step": CHECKED_STEP[self.graph_kind]}

    def _inputs(self) -> dict:
        """The real inputs of the session's graph: the store's program inputs, or the decode step's."""
        return self.checker.model_io()[0] if self.graph_kind == "decode" else self.store.program_inputs()


def _ancestors(path: str) -> list[str]:
    out = [path]
    while path:
        path = path.rpartition(".")[0]
        out.append(path)
    return out


__all__ = ["Session"]
