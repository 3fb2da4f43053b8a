"""Migration: offload a carved model to a target in three checked stages (ARCHITECTURE.md).

1. **op** — every carved case alone on the target with the reference's real inputs. A case
   that fails is re-checked node by node in the model's own context, so that a fault in one
   instance (``--inject OP@NODE=...``) does not move the op's other instances off the target.
2. **region** — regions grow along the module tree (children before their parent, up to the
   root); each runs on a hybrid placement (what already failed stays on the reference) with
   the reference's values at its inputs, and is compared with the reference at its outputs.
   A region that fails while its ops pass is bisected — halving its target nodes in
   topological order — to the smallest failing sub-region, which goes back to the reference.
3. **model** — the whole model on the final placement, compared end to end.

Random ops (rand, dropout in training, ...) are judged alone, in the op stage, by distribution
(:func:`tapml.judging.compare.compare_distribution`); in the region and model stages they stay on the
reference with the reference's own values fed in (:func:`tapml.driving.regions.random_nodes`), since
nothing computed from random draws can be compared by value. Their units say so.

A generation store (``tapml carve --generate``) runs the three stages once per step kind: the
prefill graph first, as above, then the decode graph — its cases (and the prefill's cases that
its nodes share) localized in the decode graph's own context, its module regions, and the
decode step end to end, all on the first decode step's real inputs with the reference's cache
after the prefill. The decode pass's unit ids start ``decode:``; units and culprits of a
generation say their ``graph`` (and culprits their ``step``); its placement is
``placement["decode"]``.

A float16/bfloat16 store may keep nodes in float32 (``keep_float32``, *mixed placement by
dtype*, :func:`tapml.dtypes.keep_float32`): the op stage is unchanged (each case alone, in the
store's dtype), while the region and model stages (and the decode pass) run the mixed graph, its
cast nodes placed on the target like their neighbours and judged against the float32 twin. The
placement's node list and shares count the model's own nodes (casts are bookkeeping); the
state's ``precision`` records which nodes computed in float32.

Every verdict is appended to a JSON-lines journal (``STATE.json.journal``, flushed and
fsynced per line) the moment it is made, and the state file is rewritten atomically. The
algorithm is deterministic given its verdicts, so ``resume=True`` replays it with the
journaled verdicts in place of runs: a run killed at any instant resumes to the same state.

Example::

    store = CarveStore("stores/gpt2")
    with open_target("wgpu:vulkan", inject=["aten.tanh.default=scale:1.01"]) as platform:
        state = Migration(store, platform, "wgpu:vulkan", state_path="gpt2.json").run()
    state["culprits"][0]["op"]  # 'aten.tanh.default'
"""

from __future__ import annotations

import hashlib
import time
from pathlib import Path
from typing import Callable, Iterable

from tapml.judging.compare import Tolerances, is_random_op
from tapml.dtypes import cast_nodes, keep_float32 as keep_float32_graph
from tapml.errors import DeviceLost, TapmlError
from tapml.graph import Graph
from tapml.driving.hybrid import REFERENCE, TARGET, HybridRunner, placement_shares
from tapml.io import ExclusiveLock, write_json_atomic, write_text_atomic
from tapml.driving.journal import START_OVER, Journal, journal_path, journal_text
from tapml.driving.precision import resolve_keep_float32
from tapml.driving.regions import (CHECKED_STEP, RegionChecker, bisect, common_module, decode_step_inputs, low_dtype,
                           module_regions, run_model_against_reference)
from tapml.judging.verdict import (STATE_FORMAT, CaseVerdict, Culprit, EndToEnd, MigrationState, UnitVerdict, culprit_kind,
                           keep_float32_header)

#: Bisect-and-recheck rounds per region before giving up on it.
MAX_ROUNDS = 8


class GraphPass:
    """One graph a migration checks: the model's graph, or one step kind of a generation
    (``kind`` ``"prefill"``/``"decode"``; None for a store without generation). Unit ids of the
    decode pass start with ``prefix``. ``graph`` is the graph that runs (with ``keep_float32``,
    the mixed one, casts included); ``original`` the store's, which placement shares count."""

    def __init__(self, kind: str | None, graph: Graph, checker: RegionChecker, original: Graph | None = None,
                 keep_float32: list[str] | None = None):
        self.kind = kind
        self.graph = graph
        self.original = original or graph
        self.keep_float32 = list(keep_float32 or [])
        self.checker = checker
        self.prefix = "decode:" if kind == "decode" else ""
        # a random op is checked alone by distribution; in regions and the model run it stays on
        # the reference, pinned to the reference's values (tapml.driving.regions.random_nodes)
        self.placement = {n.name: REFERENCE if is_random_op(n.op) else TARGET for n in graph.nodes}
        self.end_to_end: EndToEnd | None = None

    def where(self) -> dict:
        """The ``graph`` field of its units (none outside a generation)."""
        return {} if self.kind is None else {"graph": self.kind}


class MigrationInterrupted(TapmlError):
    """The device went away mid-migration: nothing about it was recorded as a verdict, and
    ``resume=True`` continues where it stopped."""


# --- the migration -------------------------------------------------------------------------

class Migration:
    """One migration of a store's model to a platform, journaled beside ``state_path``.

    ``on_event(kind, data)`` is called with ``("stage", {"stage", "total", "journaled"})`` (how many
    of them a resumed journal already holds),
    ``("step", {"stage", "label", "status"})`` and ``("finding", culprit JSON)`` for live displays.
    ``keep_float32``: node names, module paths or op names to run in float32 in the region and
    model stages of a float16/bfloat16 store (:func:`tapml.driving.precision.resolve_keep_float32`;
    TapmlError when one names nothing, or the store is float32).
    ``clock``: a :class:`tapml.driving.profile.StageClock` given the seconds of reference runs and
    comparisons (``tapml bench`` splits a migration's time with it).
    ``kernels``: the ``--kernel OP=FILE.wgsl`` values ``platform`` was opened with; the journal's header
    records each file's digest, so that ``--resume`` with other or changed files is refused.
    :meth:`run` returns the final state (the same document it writes to ``state_path``); then
    ``reused`` and ``checked`` count the verdicts the journal supplied and those made in this run.
    """

    def __init__(self, store, platform, target: str, state_path: str | Path, *,
                 tolerances: Tolerances | None = None, inject: list[str] | None = None, resume: bool = False,
                 on_event: Callable[[str, dict], None] | None = None, store_path: str | None = None,
                 keep_float32: Iterable[str] = (), clock=None, kernels: list[str] | None = None):
        self.store = store
        self.platform = platform
        self.target = target
        self.state_path = Path(state_path)
        self.tolerances = tolerances or Tolerances()
        self.inject = list(inject or [])
        self.on_event = on_event or (lambda kind, data: None)
        self.graph = store.graph
        from tapml.carving.store import CarveStore
        # A view of one step of a generation (tapml.driving.generate.StepStore) is checked as a plain store.
        self.generation = isinstance(store, CarveStore) and store.is_generation
        graphs = {"model": self.graph, **({"decode": store.step_graph("decode")} if self.generation else {})}
        self.keep_float32 = resolve_keep_float32(graphs, keep_float32)
        self.mixed = {kind: keep_float32_graph(g, self.keep_float32[kind]) for kind, g in graphs.items()}
        self.clock = clock
        self.reused = self.checked = 0
        self.checker = RegionChecker(store, platform, self.tolerances, graph=self.mixed["model"], clock=clock)
        self.header = {"format": STATE_FORMAT, "model": store.model, "target": target,
                       "tolerances": self.tolerances.to_json(), "inject": self.inject,
                       "nodes": len(self.graph.nodes), "cases": len(store.cases)}
        self.header |= keep_float32_header(self._precision_json())
        if kernels:  # the user's own kernel files (--kernel) the platform runs: a resume must run the same
            from tapml.platforms.wgsl.user_kernels import kernel_fingerprints
            self.header["kernels"] = kernel_fingerprints(kernels)
        if getattr(store, "manifest_sha256", None):  # which store this state's verdicts are of (and carved)
            self.header["store_manifest_sha256"] = store.manifest_sha256
        self.store_path = str(store_path or store.path)
        if not self.state_path.parent.is_dir():
            raise TapmlError(f"cannot write --state {state_path}: directory {self.state_path.parent} does not exist")
        self.resume = resume
        self.journal: Journal | None = None
        self._last_write = 0.0
        self._reset()

    def _reset(self) -> None:
        self.stage = "op"
        self.cases: list[CaseVerdict] = []
        self.units: list[UnitVerdict] = []
        self._unit_ids: set[str] = set()
        self.culprits: list[Culprit] = []
        self.prefill = GraphPass("prefill" if self.generation else None, self.mixed["model"], self.checker,
                                 self.graph, self.keep_float32["model"])
        self.passes = [self.prefill]
        if self.generation:
            decode = self.mixed["decode"]
            self.passes.append(GraphPass("decode", decode, RegionChecker(
                self.store, self.platform, self.tolerances, graph=decode,
                inputs=lambda: decode_step_inputs(self.store, self._prefill_cache_values()), clock=self.clock),
                self.store.step_graph("decode"), self.keep_float32["decode"]))
        self.placement = self.prefill.placement
        self.device: dict | None = None

    @property
    def end_to_end(self) -> EndToEnd | None:
        return self.prefill.end_to_end

    def _prefill_cache_values(self) -> dict:
        """The prefill's reference values with each cache entry as the mixed prefill hands it on
        (in the store's dtype, after the cast back from a node kept in float32)."""
        from tapml.graph import torch_dtype
        ref = self.checker.ref
        prefill = self.store.step_graph("prefill")
        return {**ref, **{r: ref[r].to(torch_dtype(prefill.meta[r].dtype)) for r in prefill.state.values()
                          if hasattr(ref[r], "to") and ref[r].dtype != torch_dtype(prefill.meta[r].dtype)}}

    def _precision_json(self) -> dict | None:
        """The placement by dtype (``precision`` of the state); None for a float32 store."""
        dtype = low_dtype(self.store)
        if dtype is None:
            return None
        graphs = {"model": self.graph, **({"decode": self.store.step_graph("decode")} if self.generation else {})}
        lists = {kind: {"keep_float32": list(self.keep_float32[kind]),
                        "casts": len(cast_nodes(g, self.mixed[kind]))} for kind, g in graphs.items()}
        return {"dtype": dtype, **lists["model"], **({"decode": lists["decode"]} if "decode" in lists else {})}

    # records -------------------------------------------------------------------------------
    def _memo(self, key: str, compute: Callable[[], object]):
        record = self.journal.get(key)
        if key != "device":  # what a resume owes to the journal and what it checked now
            self.reused += record is not None
            self.checked += record is None
        if record is None:
            try:
                record = compute()
            except DeviceLost:  # once more, on a re-opened device (new connection, fresh page)
                try:
                    self.platform.reconnect()
                except DeviceLost:
                    pass
                record = compute()  # DeviceLost again: the device's absence, not a verdict on the code
            self.journal.put(key, record)
        return record

    def _unit(self, gp: GraphPass, uid: str, kind: str, role: str, module: str | None, names: list[str],
              placement: dict[str, str], window: list[str] | None = None) -> UnitVerdict:
        nodes = list(window or names)
        uid = gp.prefix + uid

        def compute():
            v = gp.checker.compare_region(names, placement, window)
            return UnitVerdict(id=uid, kind=kind, role=role, module=module, nodes=nodes,
                               on_target=sum(placement.get(n) == TARGET for n in names), **gp.where(), **v.outcome())
        unit = self._memo(f"unit:{uid}", compute)
        self._check_record(unit, kind=kind, role=role, module=module, nodes=nodes, graph=gp.kind)
        if uid not in self._unit_ids:
            self._unit_ids.add(uid)
            self.units.append(unit)
        self._save()
        return unit

    def _check_record(self, record, **expected) -> None:
        """A journaled verdict must be about what this migration asks (its resume is trusted)."""
        wrong = [k for k, v in expected.items() if getattr(record, k) != v]
        if wrong:
            raise TapmlError(f"journal {self.journal.path}: the record of {record.id[:80]!r} has another "
                             f"{', '.join(wrong)} than this migration computes; {START_OVER}")

    # stages --------------------------------------------------------------------------------
    def run(self) -> dict:
        """Run (or resume) every stage; returns the final state. Holds the state's lock
        (:class:`~tapml.io.ExclusiveLock`) throughout: a second writer of the same state and
        journal is refused (TapmlError naming the holder's pid)."""
        with ExclusiveLock(self.state_path, f"--state {self.state_path}"):
            return self._run()

    def _run(self) -> dict:
        from tapml.driving.replay import device_info
        if self.resume and not journal_path(self.state_path).exists() and self.state_path.exists():
            self._journal_from_state()
        self.journal = Journal(journal_path(self.state_path), self.header, self.resume)
        from tapml.driving.replay import ControlTarget
        self.control = ControlTarget.of(self.platform, self.target)  # a failed case is re-run on the backend's control
        try:
            self.device = self._memo("device", lambda: device_info(self.platform))
            self._save(force=True)
            for gp in self.passes:
                self._op_stage(gp)
                self._region_stage(gp)
                self._model_stage(gp)
            self.stage = "done"
            self._save(force=True)
        except DeviceLost as e:
            self._save(force=True)
            raise MigrationInterrupted(
                f"{e}; the migration stopped there and its {len(self.journal.records)} verdicts so far are kept "
                f"in {self.journal.path}: when the device is back, rerun the same command with --resume") from None
        finally:
            self.control.close()
            self.journal.close()
        return self.state()

    def _journal_from_state(self) -> None:
        """Rebuild a journal from a state file alone (its journal was removed); TapmlError
        when the state is not a migration state that fits its schema."""
        hint = f"remove {self.state_path} to start over, or run without --resume"
        state = MigrationState.read(self.state_path, what="--state", strict=True, hint=hint)
        if not isinstance(state, MigrationState):
            raise TapmlError(f"--state {self.state_path} is not a migration state; {hint}")
        # The state's "cases" is the verdict list, not the header's case count; the count is the
        # store's, which "model" and "nodes" already vouch for (and so for the store's digest).
        header = state.header() | {k: self.header[k] for k in ("cases", "store_manifest_sha256", "kernels")
                                   if k in self.header}
        records: dict[str, object] = {} if state.device is None else {"device": state.device}
        records |= {f"case:{c.id}": c for c in state.cases}
        records |= {f"unit:{u.id}": u for u in state.units}
        write_text_atomic(journal_path(self.state_path), journal_text(header, records))

    def _op_stage(self, gp: GraphPass) -> None:
        from tapml.driving.replay import replay_case
        self.stage = "op"
        nodes_of: dict[str, list[str]] = {}
        for n in gp.graph.nodes:
            if n.case is not None:
                nodes_of.setdefault(n.case, []).append(n.name)
        if gp.kind == "decode":  # its own cases, and the prefill's that its nodes share
            cases = [c for c in self.store.cases if c.get("graph") == "decode" or c["id"] in nodes_of]
        else:
            cases = [c for c in self.store.cases if c.get("graph", "prefill") == "prefill"]
        self._stage_event(gp, "op", len(cases),
                          sum(self.journal.get(f"case:{c['id']}") is not None for c in cases))
        self._spread_cases([c for c in cases if self.journal.get(f"case:{c['id']}") is None])
        done = {c.id for c in self.cases}
        for case in cases:
            verdict = self._memo(f"case:{case['id']}", lambda: self.control.blame(
                self.store, case, replay_case(self.platform, self.store, case, self.tolerances, clock=self.clock),
                self.tolerances))
            self._check_record(verdict, op=case["op"], node=case["node"], module=case["module"])
            if case["id"] not in done:
                self.cases.append(verdict)
                done.add(case["id"])
            self.on_event("step", {"stage": "op", "label": f"{gp.prefix}{case['id']} {case['op']}",
                                   "status": verdict.status})
            if verdict.status != "pass":
                self._localize_case(gp, case, verdict, nodes_of.get(case["id"], []))
            self._save()

    def _spread_cases(self, cases: list[dict]) -> None:
        """On a pool (``registry://``), check ``cases`` spread over its devices and journal each
        verdict (with the device that made it) as it arrives, so that the op stage reads them
        back in order; a lost device's case runs again on another. Elsewhere nothing happens."""
        from tapml.driving.replay import replay_case
        from tapml.driving.targets import spread

        def journal(i: int, verdict: CaseVerdict, ran_on: str) -> None:
            verdict.device = ran_on
            self.journal.put(f"case:{cases[i]['id']}", verdict)
        spread(self.platform, cases, lambda device, case: replay_case(device, self.store, case, self.tolerances,
                                                                      clock=self.clock),
               on_result=journal)

    def _stage_event(self, gp: GraphPass, stage: str, total: int, journaled: int = 0) -> None:
        self.on_event("stage", {"stage": f"{gp.kind} {stage}" if gp.kind == "decode" else stage, "total": total,
                                "journaled": journaled})

    def _culprit_where(self, gp: GraphPass, case: dict | None = None) -> dict:
        """A generation culprit's ``graph`` and ``step``: the first step of its kind the case
        occurs in, else the step the pass checks."""
        if gp.kind is None:
            return {}
        steps = [s for s in (case or {}).get("steps", []) if (s == 0) == (gp.kind == "prefill")]
        return {"graph": gp.kind, "step": steps[0] if steps else CHECKED_STEP[gp.kind]}

    def _localize_case(self, gp: GraphPass, case: dict, verdict: CaseVerdict, nodes: list[str]) -> None:
        """Which of a failing case's nodes fail in the model's own context (all of them for
        an unsupported op); those go back to the reference."""
        if verdict.status == "unsupported" or len(nodes) <= 1:
            failing = nodes
        else:
            failing = []
            for name in nodes:
                unit = self._unit(gp, f"op:{name}", "op", "instance", gp.graph.node(name).module, [name],
                                  {name: TARGET})
                if unit.status != "pass":
                    failing.append(name)
            if not failing:  # passes in every context but not alone: keep the case's verdict honest
                failing = [case["node"]] if case["node"] in nodes else nodes[:1]
        for name in failing:
            gp.placement[name] = REFERENCE
        node = case["node"] if case["node"] in nodes or not failing else failing[0]
        self._finding(Culprit.of(culprit_kind(verdict.status, len(failing), alone=True), verdict, op=case["op"],
                                 ops=[case["op"]], node=node, nodes=failing, module=case["module"],
                                 case=case["id"], unit=f"case:{case['id']}", **self._culprit_where(gp, case)))

    def _region_stage(self, gp: GraphPass) -> None:
        self.stage = "region"
        regions = module_regions(gp.graph)
        self._stage_event(gp, "region", len(regions))
        for path, names in regions:
            label = path or "<model>"
            if not any(gp.placement[n] == TARGET for n in names):
                self.on_event("step", {"stage": "region", "label": label, "status": "skipped"})
                continue
            # A region can hold several independent failures: bisect, fall back, check again.
            for attempt in range(1, MAX_ROUNDS + 1):
                uid = f"region:{label}" + (f"#{attempt}" if attempt > 1 else "")
                unit = self._unit(gp, uid, "region", "module", path, names, dict(gp.placement))
                self.on_event("step", {"stage": "region", "label": gp.prefix + label, "status": unit.status})
                if unit.status == "pass":
                    break
                self._bisect_region(gp, label, path, names, unit)
                if not any(gp.placement[n] == TARGET for n in names):
                    break
            self._save()

    def _bisect_region(self, gp: GraphPass, label: str, path: str, names: list[str], unit: UnitVerdict) -> None:
        target_nodes = [n for n in names if gp.placement[n] == TARGET]
        probes: list[UnitVerdict] = []

        def probe(window: list[str]) -> UnitVerdict:
            # The region as it will run, with only the window on the target.
            digest = hashlib.sha1("\n".join(window).encode()).hexdigest()[:8]
            uid = f"bisect:{label}:{window[0]}..{window[-1]}:{digest}"
            v = self._unit(gp, uid, "region", "bisect", path, names, {n: TARGET for n in window}, window)
            probes.append(v)
            self.on_event("step", {"stage": "bisect", "label": uid, "status": v.status})
            return v

        window = bisect(target_nodes, lambda w: probe(w).status != "pass")
        evidence = next((p for p in reversed(probes) if p.nodes == window), unit)
        for n in window:
            gp.placement[n] = REFERENCE
        nodes = [gp.graph.node(n) for n in window]
        surface = gp.checker.producer.get(evidence.worst_output or "", nodes[-1])
        self._finding(Culprit.of(culprit_kind(evidence.status, len(window), alone=False), evidence,
                                 op=surface.op if len(window) > 1 else nodes[0].op, ops=sorted({n.op for n in nodes}),
                                 node=window[0] if len(window) == 1 else f"{window[0]}..{window[-1]}",
                                 nodes=window, module=common_module([n.module for n in nodes]), region=label,
                                 unit=evidence.id, probes=len(probes), **self._culprit_where(gp)))

    def _model_stage(self, gp: GraphPass) -> None:
        self.stage = "model"
        self._stage_event(gp, "model", 1)
        names = [n.name for n in gp.graph.nodes]
        uid = gp.prefix + "model"

        def compute():
            inputs, expected = gp.checker.model_io() if gp.kind == "decode" else (gp.checker.input_values(), None)
            verdict, result = run_model_against_reference(self.store, HybridRunner(gp.graph, self.platform),
                                                          gp.placement, self.tolerances, inputs=inputs,
                                                          expected=expected, clock=self.clock)
            return UnitVerdict(id=uid, kind="model", role="end-to-end", module="", nodes=names,
                               on_target=sum(gp.placement[n] == TARGET for n in names),
                               regions=None if result is None else len(result.regions), **gp.where(),
                               **verdict.outcome())

        unit = self._memo(f"unit:{uid}", compute)
        self._check_record(unit, kind="model", nodes=names, graph=gp.kind)
        self.units.append(unit)
        gp.end_to_end = EndToEnd(regions=unit.regions, **unit.outcome())
        self.on_event("step", {"stage": "model", "label": f"{gp.kind} end to end" if gp.kind else "end to end",
                               "status": unit.status})

    def _finding(self, culprit: Culprit) -> None:
        self.culprits.append(culprit)
        self.on_event("finding", culprit.to_json())

    # state ---------------------------------------------------------------------------------
    def migration_state(self) -> MigrationState:
        """The migration state, typed (see :meth:`state`)."""
        return MigrationState(model=self.store.model, target=self.target, tolerances=self.tolerances.to_json(),
                              inject=self.inject, nodes=len(self.graph.nodes), cases=self.cases,
                              store=self.store_path, device=self.device, stage=self.stage, units=self.units,
                              placement=self._placement_json(),
                              culprits=self.culprits, end_to_end=self.end_to_end, precision=self._precision_json())

    def _placement_json(self) -> dict:
        def of(gp: GraphPass) -> dict:  # the store's own nodes: casts kept_float32 added are bookkeeping
            nodes = {n.name: gp.placement[n.name] for n in gp.original.nodes}
            return {"nodes": nodes, **placement_shares(gp.original, nodes)}
        placement = of(self.prefill)
        for gp in self.passes[1:]:
            placement[gp.kind] = of(gp)
        return placement

    def state(self) -> dict:
        """The migration state: the Verdict JSON of ARCHITECTURE.md plus units, placement,
        culprits and the end-to-end result."""
        return self.migration_state().to_json()

    def passed(self) -> bool:
        """Everything checked passed (:func:`tapml.judging.verdict.passed`)."""
        return self.migration_state().passed

    def _save(self, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self._last_write > 0.5:
            write_json_atomic(self.state_path, self.state())
            self._last_write = now


def check_faults(graph: Graph, inject: list[str] | None) -> None:
    """Every ``--inject`` fault must name an op (and node) of this model, or it proves nothing."""
    from tapml.driving.inject import parse_faults
    nodes = {n.name: n for n in graph.nodes}
    ops = {n.op for n in graph.nodes}
    for item, fault in zip(inject or [], parse_faults(inject or [])):
        if fault.op not in ops:
            close = sorted(o for o in ops if fault.op.split(".")[1] in o)[:5]
            raise TapmlError(f"--inject {item!r}: the model has no {fault.op} node" +
                             (f"; it has {', '.join(close)}" if close else "; `tapml inspect STORE` lists its ops"))
        if fault.node is not None and (fault.node not in nodes or nodes[fault.node].op != fault.op):
            same = [n.name for n in graph.nodes if n.op == fault.op][:6]
            raise TapmlError(f"--inject {item!r}: no {fault.op} node named {fault.node!r}; "
                             f"its nodes are {', '.join(same)}")


def exit_code(state: dict) -> int:
    """0 when everything checked passed, else 1 (a finding)."""
    return 0 if state.get("passed") else 1


__all__ = ["Migration", "MigrationInterrupted", "GraphPass", "check_faults", "exit_code", "MAX_ROUNDS", "CHECKED_STEP"]
