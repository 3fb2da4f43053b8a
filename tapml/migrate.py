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
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterable

from tapml.compare import Comparison, Tolerances, compare_outputs, compare_tensor, merge
from tapml.errors import DeviceLost, TapmlError
from tapml.graph import Graph, dtype_name
from tapml.hybrid import REFERENCE, TARGET, HybridResult, HybridRunner, placement_shares, reference_values
from tapml.verdict import (STATE_FORMAT, CaseVerdict, Culprit, EndToEnd, MigrationState, UnitVerdict, Verdict,
                           culprit_kind, journal_record, outcome_verdict, parse_json)
#: Bisect-and-recheck rounds per region before giving up on it.
MAX_ROUNDS = 8


# --- journal -------------------------------------------------------------------------------

def journal_path(state_path: str | Path) -> Path:
    """The JSON-lines journal kept beside a state file."""
    state_path = Path(state_path)
    return state_path.with_name(state_path.name + ".journal")


#: What a refused journal's message tells the user to do.
START_OVER = "remove it and its state file to start over"


class Journal:
    """An append-only JSON-lines file of ``{"key", "record"}`` lines, each flushed and fsynced.

    The first line is a header (the options the migration was started with). Reading tolerates
    a torn last line, which is what a kill in the middle of a write leaves behind, and nothing
    else: a record that does not fit its schema (:func:`~tapml.verdict.journal_record`) makes
    the whole journal refused. Records are typed: the device dict, :class:`CaseVerdict`,
    :class:`UnitVerdict`.
    """

    def __init__(self, path: Path, header: dict, resume: bool):
        self.path = Path(path)
        self.records: dict[str, object] = {}
        if resume and self.path.exists():
            old_header, self.records = self.read(self.path)
            if old_header is not None and old_header != header:
                raise TapmlError(_option_mismatch(old_header, header, self.path))
        # A fresh file, or the old records without a torn tail, so that appends start on a new line.
        self._rewrite(header)
        self._file = open(self.path, "a")

    @staticmethod
    def read(path: Path) -> tuple[dict | None, dict[str, object]]:
        """``(header, {key: typed record})`` of a journal file; TapmlError when a line other than
        the last is not JSON, or any line does not fit its schema."""
        from tapml.verdict import MAX_FILE_BYTES, _check_depth, _Ctx
        header, records = None, {}
        try:
            if path.stat().st_size > MAX_FILE_BYTES:
                raise TapmlError(f"journal {path} is larger than {MAX_FILE_BYTES >> 20} MiB; {START_OVER}")
            with open(path, "rb") as f:
                text = f.read().decode("utf-8")
        except UnicodeDecodeError:
            raise TapmlError(f"journal {path} is not a text file; {START_OVER}") from None
        except OSError as e:
            raise TapmlError(f"cannot read journal {path}: {e.strerror}") from None
        lines = text.split("\n")
        for i, line in enumerate(lines):
            if not line.strip():
                continue
            where = f"journal {path} line {i + 1}"
            try:
                item = json.loads(line, parse_constant=_no_constant)
            except json.JSONDecodeError:
                if i >= len(lines) - 2:  # torn final line from a kill mid-write
                    break
                raise TapmlError(f"journal {path} is corrupt at line {i + 1}; {START_OVER}") from None
            except (ValueError, RecursionError):
                parse_json(line, where, START_OVER)  # raises TapmlError saying what is wrong
                raise
            _check_depth(item, _Ctx(where, True, START_OVER))
            if isinstance(item, dict) and set(item) == {"header"} and isinstance(item["header"], dict) \
                    and header is None and not records:
                header = item["header"]
            elif isinstance(item, dict) and set(item) == {"key", "record"} and header is not None:
                records[item["key"]] = journal_record(item["key"], item["record"], where, START_OVER)
            else:
                raise TapmlError(f"{where} is not a journal line (a header first, then {{\"key\", \"record\"}} "
                                 f"lines); {START_OVER}")
        return header, records

    def _rewrite(self, header: dict) -> None:
        tmp = self.path.with_name(f".{self.path.name}.tmp{os.getpid()}")
        with open(tmp, "w") as f:
            f.write(json.dumps({"header": header}, allow_nan=False) + "\n")
            for key, record in self.records.items():
                f.write(json.dumps({"key": key, "record": _plain(record)}, allow_nan=False) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)

    def get(self, key: str):
        return self.records.get(key)

    def put(self, key: str, record) -> None:
        """Record ``record`` (a device dict or a verdict) under ``key`` and make the line
        durable before returning."""
        self.records[key] = record
        self._file.write(json.dumps({"key": key, "record": _plain(record)}, allow_nan=False) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()


def _no_constant(name: str):
    raise ValueError(f"{name} is not a number JSON allows")


def _plain(record):
    return record if isinstance(record, dict) else record.to_json()


def _option_mismatch(old: dict, new: dict, path: Path) -> str:
    diffs = [f"{k}: journal has {old.get(k)!r}, now {new.get(k)!r}" for k in sorted(set(old) | set(new))
             if old.get(k) != new.get(k)]
    return (f"cannot resume from {path}: it was made with other options ({'; '.join(diffs)}); "
            "rerun with the same options, or without --resume to start over")


# --- region checks -------------------------------------------------------------------------

class RegionChecker:
    """Runs sub-regions of a store's model on a platform with reference values at their
    inputs and compares their outputs with the reference. Shared by migrate and the session."""

    def __init__(self, store, platform, tolerances: Tolerances | None = None):
        self.store = store
        self.graph: Graph = store.graph
        self.platform = platform
        self.tolerances = tolerances or Tolerances()
        self.producer = self.graph.producer()
        self.order = {n.name: i for i, n in enumerate(self.graph.nodes)}
        self._ref: dict | None = None
        self._runners: dict[tuple, HybridRunner] = {}

    @property
    def ref(self) -> dict:
        """Every reference value of the model (computed once)."""
        if self._ref is None:
            self._ref = reference_values(self.graph, self.store.program_inputs())
        return self._ref

    def runner(self, names: list[str]) -> HybridRunner:
        """The (cached) runner of the region made of ``names``, in topological order."""
        key = tuple(names)
        if key not in self._runners:
            self._runners[key] = HybridRunner(self.graph.subgraph(names), self.platform)
        return self._runners[key]

    def compare_ref(self, value, ref: str, worst: int = 5) -> Comparison:
        """Compare ``value`` with the reference's value at ``ref``, with the tolerance of the op
        that produces it (``worst``: how many of the worst elements to list)."""
        expected = self.ref[ref]
        op = self.producer[ref].op if ref in self.producer else None
        rtol, atol = self.tolerances.get(op, dtype_name(expected.dtype))
        return compare_tensor(value, expected, rtol, atol, worst=worst)

    def compare(self, values: dict, refs: list[str]) -> tuple[Comparison, str | None]:
        """Compare values at ``refs`` with the reference (see :meth:`compare_ref`); returns the
        merged comparison and the ref of the worst failing output."""
        results, worst_ref, worst_err = [], None, -1.0
        for r in refs:
            c = self.compare_ref(values[r], r)
            results.append(c)
            if not c.passed:
                err = float("inf") if c.max_abs_err is None else c.max_abs_err
                if err > worst_err:
                    worst_ref, worst_err = r, err
        return merge(results), worst_ref

    def check(self, names: list[str], placement: dict[str, str], window: list[str] | None = None) -> Verdict:
        """Run the region made of ``names`` (each placed as ``placement`` says) and return its
        verdict (status, error stats, message, time_ms, worst elements, worst output); a run
        that raises is a verdict too (:func:`~tapml.verdict.outcome_verdict`), DeviceLost is raised.

        The region's outputs are compared with the reference; with ``window`` (a subset of
        ``names``), the values leaving the window are compared too, so an error is pinned
        to the window even where later reference ops would hide it."""
        names = sorted(names, key=self.order.__getitem__)
        runner = self.runner(names)
        sub = runner.graph
        refs = list(sub.outputs)
        if window:
            known = set(refs)
            refs += [r for r in sub.subgraph(window).outputs if r not in known]
        inputs = {r: self.ref[r] for r, _ in sub.inputs}
        try:
            result = runner.run(inputs, placement, keep=refs)
        except Exception as e:  # noqa: BLE001 - a failing region is a verdict, not a crash
            return outcome_verdict(e)
        comparison, worst_ref = self.compare(result.values, refs)
        verdict = outcome_verdict(comparison, round(sum(r.run_ms for r in result.regions), 4))
        verdict.worst_output = worst_ref
        return verdict


def check_model(store, runner: HybridRunner, placement: dict[str, str], tolerances: Tolerances,
                keep: Iterable[str] = ()) -> tuple[Verdict, HybridResult | None]:
    """Run the whole model of ``store`` with ``runner`` on ``placement`` and compare its outputs
    with the reference's. Shared by migrate's model stage and the session's ``check``.

    Returns the verdict and the run, which is None when the run raised: a failing run is a
    verdict (:func:`~tapml.verdict.outcome_verdict`), except DeviceLost, which is raised.

    Example::

        verdict, result = check_model(store, HybridRunner(store.graph, platform), placement, Tolerances())
        verdict.status  # 'pass'
    """
    try:
        result = runner.run(store.program_inputs(), placement, keep=keep)
    except Exception as e:  # noqa: BLE001 - a failing model is a verdict, not a crash
        return outcome_verdict(e), None
    expected = store.model_outputs()
    c = compare_outputs([result.values[r] for r in expected], list(expected.values()), tolerances=tolerances)
    return outcome_verdict(c, round(sum(r.run_ms for r in result.regions) + result.reference_ms, 4)), result


class MigrationInterrupted(TapmlError):
    """The device went away mid-migration: nothing about it was recorded as a verdict, and
    ``resume=True`` continues where it stopped."""


def bisect(names: list[str], fails: Callable[[list[str]], bool]) -> list[str]:
    """The smallest failing window of ``names`` (a failing sequence in topological order).

    Halves while one half fails on its own; when neither half does (the failure needs both,
    as accumulated error does), shrinks the window from each end by binary search. Each step
    costs one ``fails`` call: O(log n) in all.
    """
    while len(names) > 1:
        mid = len(names) // 2
        left, right = names[:mid], names[mid:]
        if fails(left):
            names = left
        elif fails(right):
            names = right
        else:
            lo, hi = 0, mid  # names[lo:] fails, names[hi:] does not
            while hi - lo > 1:
                m = (lo + hi) // 2
                lo, hi = (m, hi) if fails(names[m:]) else (lo, m)
            names = names[lo:]
            lo, hi = mid - lo, len(names)  # names[:lo] does not fail, names[:hi] does
            while hi - lo > 1:
                m = (lo + hi) // 2
                lo, hi = (lo, m) if fails(names[:m]) else (m, hi)
            return names[:hi]
    return names


def module_regions(graph: Graph) -> list[tuple[str, list[str]]]:
    """(module path, node names) for every module of the model, children before their parent
    (post-order, siblings in execution order); a module with the same nodes as one already
    listed is left out. The root module (path ``""``) comes last: the whole model."""
    members: dict[str, list[str]] = {}
    first: dict[str, int] = {}
    children: dict[str, set[str]] = {}
    for i, n in enumerate(graph.nodes):
        path = n.module
        while True:
            members.setdefault(path, []).append(n.name)
            first.setdefault(path, i)
            if not path:
                break
            parent = path.rpartition(".")[0]
            children.setdefault(parent, set()).add(path)
            path = parent
    out, seen = [], set()

    def visit(path: str) -> None:
        for child in sorted(children.get(path, ()), key=first.__getitem__):
            visit(child)
        key = tuple(members[path])
        if key not in seen:
            seen.add(key)
            out.append((path, members[path]))

    visit("")
    return out


# --- the migration -------------------------------------------------------------------------

class Migration:
    """One migration of a store's model to a platform, journaled beside ``state_path``.

    ``on_event(kind, data)`` is called with ``("stage", {"stage", "total"})``,
    ``("step", {"stage", "label", "status"})`` and ``("finding", culprit JSON)`` for live displays.
    :meth:`run` returns the final state (the same document it writes to ``state_path``).
    """

    def __init__(self, store, platform, target: str, state_path: str | Path, *,
                 tolerances: Tolerances | None = None, inject: list[str] | None = None, resume: bool = False,
                 on_event: Callable[[str, dict], None] | None = None, store_path: str | None = None):
        self.store = store
        self.platform = platform
        self.target = target
        self.state_path = Path(state_path)
        self.tolerances = tolerances or Tolerances()
        self.inject = list(inject or [])
        self.on_event = on_event or (lambda kind, data: None)
        self.checker = RegionChecker(store, platform, self.tolerances)
        self.graph = store.graph
        self.header = {"format": STATE_FORMAT, "model": store.model, "target": target,
                       "tolerances": self.tolerances.to_json(), "inject": self.inject,
                       "nodes": len(self.graph.nodes), "cases": len(store.cases)}
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
        self.end_to_end: EndToEnd | None = None
        self.placement = {n.name: TARGET for n in self.graph.nodes}
        self.device: dict | None = None

    # records -------------------------------------------------------------------------------
    def _memo(self, key: str, compute: Callable[[], object]):
        record = self.journal.get(key)
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

    def _unit(self, uid: str, kind: str, role: str, module: str | None, names: list[str],
              placement: dict[str, str], window: list[str] | None = None) -> UnitVerdict:
        nodes = list(window or names)

        def compute():
            v = self.checker.check(names, placement, window)
            return UnitVerdict(id=uid, kind=kind, role=role, module=module, nodes=nodes,
                               on_target=sum(placement.get(n) == TARGET for n in names), **v.outcome())
        unit = self._memo(f"unit:{uid}", compute)
        self._check_record(unit, kind=kind, role=role, module=module, nodes=nodes)
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
        """Run (or resume) every stage; returns the final state."""
        from tapml.replay import device_info
        if self.resume and not journal_path(self.state_path).exists() and self.state_path.exists():
            self._journal_from_state()
        self.journal = Journal(journal_path(self.state_path), self.header, self.resume)
        try:
            self.device = self._memo("device", lambda: device_info(self.platform))
            self._save(force=True)
            self._op_stage()
            self._region_stage()
            self._model_stage()
            self.stage = "done"
            self._save(force=True)
        except DeviceLost as e:
            self._save(force=True)
            raise MigrationInterrupted(
                f"{e}; the migration stopped there and its {len(self.journal.records)} verdicts so far are kept "
                f"in {self.journal.path}: when the device is back, rerun the same command with --resume") from None
        finally:
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
        # store's, which "model" and "nodes" already vouch for.
        header = state.header() | {"cases": self.header["cases"]}
        lines = [{"header": header}]
        if state.device is not None:
            lines.append({"key": "device", "record": state.device})
        lines += [{"key": f"case:{c.id}", "record": c.to_json()} for c in state.cases]
        lines += [{"key": f"unit:{u.id}", "record": u.to_json()} for u in state.units]
        with open(journal_path(self.state_path), "w") as f:
            f.write("\n".join(json.dumps(x, allow_nan=False) for x in lines) + "\n")

    def _op_stage(self) -> None:
        from tapml.replay import check_case
        self.stage = "op"
        self.on_event("stage", {"stage": "op", "total": len(self.store.cases)})
        nodes_of: dict[str, list[str]] = {}
        for n in self.graph.nodes:
            if n.case is not None:
                nodes_of.setdefault(n.case, []).append(n.name)
        for case in self.store.cases:
            verdict = self._memo(f"case:{case['id']}",
                                 lambda: check_case(self.platform, self.store, case, self.tolerances))
            self._check_record(verdict, op=case["op"], node=case["node"], module=case["module"])
            self.cases.append(verdict)
            self.on_event("step", {"stage": "op", "label": f"{case['id']} {case['op']}", "status": verdict.status})
            if verdict.status != "pass":
                self._localize_case(case, verdict, nodes_of.get(case["id"], []))
            self._save()

    def _localize_case(self, case: dict, verdict: CaseVerdict, nodes: list[str]) -> None:
        """Which of a failing case's nodes fail in the model's own context (all of them for
        an unsupported op); those go back to the reference."""
        if verdict.status == "unsupported" or len(nodes) <= 1:
            failing = nodes
        else:
            failing = []
            for name in nodes:
                unit = self._unit(f"op:{name}", "op", "instance", self.graph.node(name).module, [name],
                                  {name: TARGET})
                if unit.status != "pass":
                    failing.append(name)
            if not failing:  # passes in every context but not alone: keep the case's verdict honest
                failing = [case["node"]] if case["node"] in nodes else nodes[:1]
        for name in failing:
            self.placement[name] = REFERENCE
        self._finding(Culprit.of(culprit_kind(verdict.status, len(failing), alone=True), verdict, op=case["op"],
                                 ops=[case["op"]], node=case["node"], nodes=failing, module=case["module"],
                                 case=case["id"], unit=f"case:{case['id']}"))

    def _region_stage(self) -> None:
        self.stage = "region"
        regions = module_regions(self.graph)
        self.on_event("stage", {"stage": "region", "total": len(regions)})
        for path, names in regions:
            label = path or "<model>"
            if not any(self.placement[n] == TARGET for n in names):
                self.on_event("step", {"stage": "region", "label": label, "status": "skipped"})
                continue
            # A region can hold several independent failures: bisect, fall back, check again.
            for attempt in range(1, MAX_ROUNDS + 1):
                uid = f"region:{label}" + (f"#{attempt}" if attempt > 1 else "")
                unit = self._unit(uid, "region", "module", path, names, dict(self.placement))
                self.on_event("step", {"stage": "region", "label": label, "status": unit.status})
                if unit.status == "pass":
                    break
                self._bisect_region(label, path, names, unit)
                if not any(self.placement[n] == TARGET for n in names):
                    break
            self._save()

    def _bisect_region(self, label: str, path: str, names: list[str], unit: UnitVerdict) -> None:
        target_nodes = [n for n in names if self.placement[n] == TARGET]
        probes: list[UnitVerdict] = []

        def probe(window: list[str]) -> UnitVerdict:
            # The region as it will run, with only the window on the target.
            digest = hashlib.sha1("\n".join(window).encode()).hexdigest()[:8]
            uid = f"bisect:{label}:{window[0]}..{window[-1]}:{digest}"
            v = self._unit(uid, "region", "bisect", path, names, {n: TARGET for n in window}, window)
            probes.append(v)
            self.on_event("step", {"stage": "bisect", "label": uid, "status": v.status})
            return v

        window = bisect(target_nodes, lambda w: probe(w).status != "pass")
        evidence = next((p for p in reversed(probes) if p.nodes == window), unit)
        for n in window:
            self.placement[n] = REFERENCE
        nodes = [self.graph.node(n) for n in window]
        surface = self.checker.producer.get(evidence.worst_output or "", nodes[-1])
        self._finding(Culprit.of(culprit_kind(evidence.status, len(window), alone=False), evidence,
                                 op=surface.op if len(window) > 1 else nodes[0].op, ops=sorted({n.op for n in nodes}),
                                 node=window[0] if len(window) == 1 else f"{window[0]}..{window[-1]}",
                                 nodes=window, module=common_module([n.module for n in nodes]), region=label,
                                 unit=evidence.id, probes=len(probes)))

    def _model_stage(self) -> None:
        self.stage = "model"
        self.on_event("stage", {"stage": "model", "total": 1})
        names = [n.name for n in self.graph.nodes]
        uid = "model"

        def compute():
            verdict, result = check_model(self.store, HybridRunner(self.graph, self.platform), self.placement,
                                          self.tolerances)
            return UnitVerdict(id=uid, kind="model", role="end-to-end", module="", nodes=names,
                               on_target=sum(self.placement[n] == TARGET for n in names),
                               regions=None if result is None else len(result.regions), **verdict.outcome())

        unit = self._memo(f"unit:{uid}", compute)
        self._check_record(unit, kind="model", nodes=names)
        self.units.append(unit)
        self.end_to_end = EndToEnd(regions=unit.regions, **unit.outcome())
        self.on_event("step", {"stage": "model", "label": "end to end", "status": unit.status})

    def _finding(self, culprit: Culprit) -> None:
        self.culprits.append(culprit)
        self.on_event("finding", culprit.to_json())

    # state ---------------------------------------------------------------------------------
    def migration_state(self) -> MigrationState:
        """The migration state, typed (see :meth:`state`)."""
        return MigrationState(model=self.store.model, target=self.target, tolerances=self.tolerances.to_json(),
                              inject=self.inject, nodes=len(self.graph.nodes), cases=self.cases,
                              store=self.store_path, device=self.device, stage=self.stage, units=self.units,
                              placement={"nodes": dict(self.placement),
                                         **placement_shares(self.graph, self.placement)},
                              culprits=self.culprits, end_to_end=self.end_to_end)

    def state(self) -> dict:
        """The migration state: the Verdict JSON of ARCHITECTURE.md plus units, placement,
        culprits and the end-to-end result."""
        return self.migration_state().to_json()

    def passed(self) -> bool:
        """Everything checked passed (:func:`tapml.verdict.passed`)."""
        return self.migration_state().passed

    def _save(self, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self._last_write > 0.5:
            from tapml.carving.store import write_json_atomic
            write_json_atomic(self.state_path, self.state())
            self._last_write = now


def common_module(paths: list[str]) -> str:
    """The deepest module path that contains every one of ``paths``: ``["a.b.c", "a.b.d"]`` -> ``"a.b"``."""
    parts = [p.split(".") if p else [] for p in paths]
    common = []
    for items in zip(*parts):
        if len(set(items)) != 1:
            break
        common.append(items[0])
    return ".".join(common)


def open_or_carve(model_or_store: str, state_path: str | Path | None = None,
                  on_carve: Callable[[str, Path], None] | None = None):
    """A CarveStore for MODEL|STORE: an existing store directory is opened as it is; a model
    spec is carved into ``STATE.store/`` beside the state file (reused when it already holds
    that model). Carving writes to a temporary directory renamed at the end, so a kill never
    leaves a half store behind. Returns ``(store, path)``."""
    from tapml.carving import CarveStore, carve
    path = Path(model_or_store)
    if path.is_dir():
        return CarveStore(path), path
    if path.exists():
        raise TapmlError(f"{model_or_store} is a file, not a carve store or a model spec")
    if state_path is None:
        base = Path(tempfile.mkdtemp(prefix="tapml-session-"))
        out = base / "store"
    else:
        state_path = Path(state_path)
        if not state_path.parent.is_dir():
            raise TapmlError(f"cannot write --state {state_path}: directory {state_path.parent} does not exist")
        out = state_path.with_name(state_path.stem + ".store")
    if out.is_dir():
        store = CarveStore(out)
        if store.model != model_or_store:
            raise TapmlError(f"{out} holds a store of {store.model}, not {model_or_store}; remove it or "
                             "use another --state")
        return store, out
    if on_carve:
        on_carve(model_or_store, out)
    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        carve(model_or_store, tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    os.replace(tmp, out)
    return CarveStore(out), out


def check_faults(graph: Graph, inject: list[str] | None) -> None:
    """Every ``--inject`` fault must name an op (and node) of this model, or it proves nothing."""
    from tapml.inject import parse_faults
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


__all__ = ["Migration", "MigrationInterrupted", "open_or_carve", "check_faults", "check_model",
           "RegionChecker", "Journal", "bisect", "module_regions", "common_module", "journal_path", "exit_code",
           "STATE_FORMAT"]
