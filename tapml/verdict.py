"""The result vocabulary: verdicts, culprits and migration states, typed and validated.

Every check tapml makes (a carved case alone, a region, the whole model) ends in a
:class:`Verdict` whose ``status`` is one of :data:`STATUSES`. :func:`outcome_verdict` is the
one mapping from what a run produced (an exception or a comparison) to a verdict;
:class:`DeviceLost` is never turned into one: it is re-raised, because it says nothing about
the code under test. Culprits have a ``kind`` from :data:`CULPRIT_KINDS`, in the order reports
list them. :class:`VerdictDocument` (``replay --json``) and :class:`MigrationState`
(``migrate --state``, ``session save``) are the files; their ``from_json`` validates every
field (types, required keys, closed sets, finite numbers, nesting depth) and raises
:class:`~tapml.errors.TapmlError` naming the file and the field, since these files may come
from anyone (SECURITY.md).

Example::

    state = MigrationState.read("gpt2.json")      # TapmlError (exit 2) when malformed
    state.passed, summary(state.cases)             # False, {"pass": 73, "mismatch": 1, ...}
    state.culprits[0].kind                         # 'op'
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Iterable

from tapml.dtypes import MODEL_DTYPES
from tapml.errors import DeviceLost, PlatformError, TapmlError, Unsupported
from tapml.io import read_json_file

if TYPE_CHECKING:
    from tapml.compare import Comparison

#: Version of the verdict and state documents this tapml writes (older files have none: 0).
FORMAT_VERSION = 1
#: The ``format`` key of migration states (and of their journal's header).
STATE_FORMAT = "tapml-migration/1"
#: ``flaky``: outputs that differ from run to run (``replay --repeat K``, :mod:`tapml.flaky`), kept
#: apart from ``mismatch`` (a wrong but repeatable result).
STATUSES = ("pass", "mismatch", "unsupported", "error", "flaky")
STAT_KEYS = ("max_abs_err", "max_rel_err", "mismatch_fraction")
#: The rules a comparison is decided by (tapml.compare.RULES): exact, the tolerances,
#: fp64-anchored, or the arithmetic bound of an accumulating op.
RULES = ("exact", "tolerance", "fp64-anchored", "arithmetic")
#: What a verdict says of how it was judged: the rule, its bound and the margin (written when known).
JUDGE_KEYS = ("rule", "bound", "margin")
#: A margin (error over bound) at or above this is near-failing: reports show its rule and bound
#: as they do a failure's.
NEAR_FAILING = 0.5
#: Which layer a failure on an external backend is blamed on, by a re-run on its control target
#: (the same route on a mature device): ``route`` when the control fails too (the export route
#: or front end), ``device compiler`` when the control passes.
BLAME = ("route", "device compiler")
#: How a profiled case's ``device_ms`` was taken (tapml.profile): GPU timestamps or the host clock.
TIMINGS = ("timestamp", "wall")
#: Kinds of culprit, in the order reports list them: a wrong op (alone), a wrong node (in its
#: model's context), an op that fails to compile or run, a window of nodes that fails to run
#: together (fusion), error that builds up along a window of nodes that each pass, and last an
#: op the target does not support (a gap, not a bug).
CULPRIT_KINDS = ("op", "node", "error", "fusion", "accumulated", "unsupported")
UNIT_KINDS = ("op", "region", "model")
#: The graphs of a generation store a migration checks, one pass each (units and culprits say which).
GRAPH_KINDS = ("prefill", "decode")
STAGES = ("op", "region", "model", "done", "session")
#: Where a node runs (tapml.hybrid's TARGET and REFERENCE).
PLACES = ("target", "reference")
#: Bounds on what a reader accepts from a file.
MAX_DEPTH = 32
MAX_COUNT = (1 << 63) - 1


# --- the verdict ---------------------------------------------------------------------------

@dataclass(kw_only=True)
class Verdict:
    """The outcome of one check: ``status`` (one of :data:`STATUSES`), error statistics
    (None where unknown), a message, the run time, the worst elements
    (``[{"index", "target", "reference"}]``) and the worst output's ref, if known."""

    status: str
    max_abs_err: float | None = None
    max_rel_err: float | None = None
    mismatch_fraction: float | None = None
    message: str = ""
    time_ms: float | None = None
    worst: list[dict] = field(default_factory=list)
    worst_output: str | None = None
    #: Which rule of :data:`RULES` decided, the error it allowed at the element nearest to (or
    #: furthest past) its bound, and that element's error over it (> 1 fails); None: not known.
    rule: str | None = None
    bound: float | None = None
    margin: float | None = None

    def outcome(self) -> dict:
        """The verdict's own fields as keyword arguments (for a :class:`CaseVerdict` or
        :class:`UnitVerdict` made of it)."""
        return {f.name: getattr(self, f.name) for f in fields(Verdict)}

    def to_json(self) -> dict:
        out = {"status": self.status, "max_abs_err": self.max_abs_err, "max_rel_err": self.max_rel_err,
               "mismatch_fraction": self.mismatch_fraction, "message": self.message, "time_ms": self.time_ms,
               "worst": [dict(w) for w in self.worst]}
        if self.worst_output is not None:
            out["worst_output"] = self.worst_output
        out.update({k: getattr(self, k) for k in JUDGE_KEYS if getattr(self, k) is not None})
        return out

    @classmethod
    def _read_outcome(cls, o: "_Obj") -> dict:
        strict = o.ctx.strict
        return {"status": o.choice("status", STATUSES, required=True),
                **{k: o.number(k, required=strict) for k in STAT_KEYS},
                "message": o.string("message", "", required=strict),
                "time_ms": o.number("time_ms", required=strict),
                "worst": o.worst("worst"), "worst_output": o.string("worst_output", None), **_judged(o)}

    @classmethod
    def from_json(cls, data, where: str = "<verdict>", *, strict: bool = False, hint: str = "") -> "Verdict":
        """Validate a parsed verdict (see :class:`MigrationState.from_json`)."""
        return cls._read(_Obj(data, _Ctx(where, strict, hint), "", "a verdict"))

    @classmethod
    def _read(cls, o: "_Obj") -> "Verdict":
        return cls(**cls._read_outcome(o))


@dataclass(kw_only=True)
class CaseVerdict(Verdict):
    """The verdict on one carved case run alone (``id``, ``op``, ``node``, ``module`` of the
    case, ``instances``: how many calls of the model it stands for). A profiled case
    (``replay --profile``, :mod:`tapml.profile`) adds its median ``device_ms``, ``gflops``,
    ``gbps``, ``timing`` (one of :data:`TIMINGS`), input ``shapes`` and, compared with a
    baseline, ``baseline_ms``; all None otherwise and then not written."""

    id: str = ""
    op: str = "?"
    node: str = ""
    module: str = ""
    instances: int = 1
    device_ms: float | None = None
    gflops: float | None = None
    gbps: float | None = None
    timing: str | None = None
    shapes: str | None = None
    baseline_ms: float | None = None
    device: str | None = None  # the pool device (remote://HOST:PORT) that ran it; None off a pool
    #: on an external backend: seconds its compile took (a load when ``compile_cached``: from the
    #: on-disk compile cache) and its first run; None elsewhere and then not written
    compile_s: float | None = None
    run_s: float | None = None
    compile_cached: bool | None = None
    #: on a failure re-run on the backend's control target: ``route`` or ``device compiler``
    #: (:data:`BLAME`), the control target and its status there; None otherwise and then not written
    blame: str | None = None
    control: str | None = None
    control_status: str | None = None

    def to_json(self) -> dict:
        out = {"id": self.id, "op": self.op, "node": self.node, "module": self.module,
               "instances": self.instances, **super().to_json()}
        if self.device is not None:
            out["device"] = self.device
        if self.device_ms is not None:
            out.update(device_ms=self.device_ms, gflops=self.gflops, gbps=self.gbps, timing=self.timing,
                       shapes=self.shapes)
        if self.baseline_ms is not None:
            out["baseline_ms"] = self.baseline_ms
        for k in ("compile_s", "run_s", "compile_cached", "blame", "control", "control_status"):
            if getattr(self, k) is not None:
                out[k] = getattr(self, k)
        return out

    @classmethod
    def _read(cls, o: "_Obj") -> "CaseVerdict":
        strict = o.ctx.strict
        speed = {k: o.number(k) for k in ("device_ms", "gflops", "gbps", "baseline_ms", "compile_s", "run_s")}
        for k, v in speed.items():
            if v is not None and v < 0:
                o.fail(f"{k} is {v}, expected a time or rate of 0 or more")
        return cls(id=o.string("id", "", required=strict), op=o.string("op", required=True),
                   node=o.string("node", "", required=strict), module=o.string("module", "", required=strict),
                   instances=o.count("instances", 1, required=strict), **speed,
                   timing=o.choice("timing", TIMINGS, None), shapes=o.string("shapes", None),
                   device=o.string("device", None), compile_cached=o.boolean("compile_cached", None),
                   blame=o.choice("blame", BLAME, None), control=o.string("control", None),
                   control_status=o.choice("control_status", STATUSES, None), **cls._read_outcome(o))


@dataclass(kw_only=True)
class RegionCheck(Verdict):
    """One target region of a session's end-to-end check, compared at its outputs."""

    first: str = ""
    last: str = ""
    nodes: int = 0

    def to_json(self) -> dict:
        return {"first": self.first, "last": self.last, "nodes": self.nodes, **super().to_json()}

    @classmethod
    def _read(cls, o: "_Obj") -> "RegionCheck":
        return cls(first=o.string("first", ""), last=o.string("last", ""), nodes=o.count("nodes", 0),
                   **cls._read_outcome(o))


@dataclass(kw_only=True)
class UnitVerdict(Verdict):
    """The verdict on a unit of the migration: one node in context (``kind`` op), a region or
    a bisection probe (region), the whole model (model). ``nodes`` are the nodes it judges,
    ``on_target`` how many of them ran on the target, ``regions`` how many target regions the
    model ran as, ``region_checks`` each target region's own comparison (session checks),
    ``graph`` the graph of a generation it is about (one of :data:`GRAPH_KINDS`; None otherwise)."""

    id: str = ""
    kind: str = "region"
    role: str = ""
    module: str = ""
    nodes: list[str] = field(default_factory=list)
    on_target: int | None = None
    regions: int | None = None
    region_checks: list[RegionCheck] | None = None
    graph: str | None = None

    def to_json(self) -> dict:
        out = {"id": self.id, "kind": self.kind, "role": self.role, "module": self.module,
               "nodes": list(self.nodes), "on_target": self.on_target, **super().to_json()}
        if self.graph is not None:
            out["graph"] = self.graph
        if self.regions is not None:
            out["regions"] = self.regions
        if self.region_checks is not None:
            out["region_checks"] = [r.to_json() for r in self.region_checks]
        return out

    @classmethod
    def _read(cls, o: "_Obj") -> "UnitVerdict":
        strict = o.ctx.strict
        checks = o.objects("region_checks", RegionCheck, "a region check", required=False)
        return cls(id=o.string("id", "", required=strict), kind=o.choice("kind", UNIT_KINDS, "region", required=strict),
                   role=o.string("role", "", required=strict), module=o.string("module", "", required=strict),
                   nodes=o.strings("nodes", required=strict), on_target=o.count("on_target", None, required=strict),
                   regions=o.count("regions", None), region_checks=checks if "region_checks" in o.data else None,
                   graph=o.choice("graph", GRAPH_KINDS, None), **cls._read_outcome(o))


@dataclass(kw_only=True)
class EndToEnd(Verdict):
    """The end-to-end comparison of the whole model on its final placement."""

    regions: int | None = None

    def to_json(self) -> dict:
        return {**super().to_json(), "regions": self.regions}

    @classmethod
    def _read(cls, o: "_Obj") -> "EndToEnd":
        return cls(regions=o.count("regions", None), **cls._read_outcome(o))


@dataclass(kw_only=True)
class Culprit:
    """The smallest piece found to cause a failure: ``kind`` (one of :data:`CULPRIT_KINDS`),
    the op (where its error surfaces), every op and node of it, its module, the verdict that
    shows it (``status``, error stats, ``message``, ``worst``) and where that verdict is
    (``unit``, ``case``, ``region``; ``probes``: the runs bisection took). In a generation,
    ``graph`` (one of :data:`GRAPH_KINDS`) and ``step`` say which graph and step it was found in."""

    kind: str
    op: str
    ops: list[str]
    node: str
    nodes: list[str]
    module: str
    status: str = "mismatch"
    max_abs_err: float | None = None
    max_rel_err: float | None = None
    mismatch_fraction: float | None = None
    message: str = ""
    worst: list[dict] = field(default_factory=list)
    unit: str | None = None
    case: str | None = None
    region: str | None = None
    probes: int | None = None
    graph: str | None = None
    step: int | None = None
    rule: str | None = None
    bound: float | None = None
    margin: float | None = None

    @classmethod
    def of(cls, kind: str, evidence: Verdict, *, op: str, ops: list[str], node: str, nodes: list[str], module: str,
           **where) -> "Culprit":
        """A culprit shown by ``evidence`` (its status, stats, message and worst elements)."""
        if kind not in CULPRIT_KINDS:
            raise ValueError(f"culprit kind {kind!r} is not one of {CULPRIT_KINDS}")
        return cls(kind=kind, op=op, ops=list(ops), node=node, nodes=list(nodes), module=module,
                   status=evidence.status, message=evidence.message, worst=list(evidence.worst),
                   **{k: getattr(evidence, k) for k in STAT_KEYS + JUDGE_KEYS}, **where)

    def to_json(self) -> dict:
        out = {"kind": self.kind, "op": self.op, "ops": list(self.ops), "node": self.node, "nodes": list(self.nodes),
               "module": self.module}
        out.update({k: getattr(self, k) for k in ("case", "unit", "region") if getattr(self, k) is not None})
        out["status"] = self.status
        if self.probes is not None:
            out["probes"] = self.probes
        out.update({k: getattr(self, k) for k in ("graph", "step") if getattr(self, k) is not None})
        out.update({k: getattr(self, k) for k in STAT_KEYS})
        out.update(message=self.message, worst=[dict(w) for w in self.worst])
        out.update({k: getattr(self, k) for k in JUDGE_KEYS if getattr(self, k) is not None})
        return out

    @classmethod
    def _read(cls, o: "_Obj") -> "Culprit":
        op = o.string("op", "?")
        node = o.string("node", "")
        return cls(kind=o.choice("kind", CULPRIT_KINDS, "op"), op=op, ops=o.strings("ops") or [op], node=node,
                   nodes=o.strings("nodes") or ([node] if node else []), module=o.string("module", ""),
                   status=o.choice("status", STATUSES, "mismatch"), **{k: o.number(k) for k in STAT_KEYS},
                   message=o.string("message", ""), worst=o.worst("worst"), unit=o.string("unit", None),
                   case=o.string("case", None), region=o.string("region", None), probes=o.count("probes", None),
                   graph=o.choice("graph", GRAPH_KINDS, None), step=o.count("step", None),
                   **_judged(o))


def _judged(o: "_Obj") -> dict:
    """The :data:`JUDGE_KEYS` of a verdict or culprit: a rule of :data:`RULES`, bound and margin >= 0."""
    judged = {"rule": o.choice("rule", RULES, None), **{k: o.number(k) for k in ("bound", "margin")}}
    for k in ("bound", "margin"):
        if judged[k] is not None and judged[k] < 0:
            o.fail(f"{k} is {judged[k]}, expected 0 or more")
    return judged


def culprit_kind(status: str, nodes: int, alone: bool) -> str:
    """The kind of a culprit whose evidence has ``status``: ``alone`` when a carved case failed
    run alone (op, error or unsupported), else by the size of the failing window (node for
    one node; accumulated when a longer window mismatches, fusion when it fails to run)."""
    if alone:
        return {"unsupported": "unsupported", "error": "error"}.get(status, "op")
    if nodes == 1:
        return "node"
    return "accumulated" if status == "mismatch" else "fusion"


def outcome_verdict(outcome: "BaseException | Comparison", time_ms: float | None = None) -> Verdict:
    """The verdict on a run that raised ``outcome`` or whose outputs compared as ``outcome``.

    A comparison passes or mismatches, with its stats and worst elements; one whose only
    differences are values the target cannot hold (``Comparison.unsupported``, the int64 policy
    of :mod:`tapml.compare`) is ``unsupported`` with that reason. :class:`Unsupported`
    is ``unsupported``, any other exception ``error``; the message names the region the error
    came from (``e.region``, set by :class:`~tapml.hybrid.HybridRunner`) and, for an error that
    is not the platform's own, the exception type. :class:`DeviceLost` is re-raised: it is
    about the device, not the code under test.

    Example: ``outcome_verdict(Unsupported("no f64"))`` -> ``Verdict(status="unsupported", message="no f64")``.
    """
    if isinstance(outcome, DeviceLost):
        raise outcome
    if isinstance(outcome, BaseException):
        region = getattr(outcome, "region", None)
        if not region:
            where = ""
        elif len(region) > 1:
            where = f"in region {region[0]}..{region[-1]} ({len(region)} nodes): "
        else:
            where = f"in {region[0]}: "
        own = isinstance(outcome, (Unsupported, PlatformError))
        text = str(outcome) if own else f"{type(outcome).__name__}: {outcome}"
        return Verdict(status="unsupported" if isinstance(outcome, Unsupported) else "error", message=where + text,
                       time_ms=time_ms)
    unsupported = not outcome.passed and getattr(outcome, "unsupported", "")  # tapml.compare's int64 policy
    return Verdict(status="unsupported" if unsupported else "pass" if outcome.passed else "mismatch",
                   max_abs_err=outcome.max_abs_err, max_rel_err=outcome.max_rel_err,
                   mismatch_fraction=outcome.mismatch_fraction, message=unsupported or outcome.message,
                   time_ms=time_ms, worst=list(outcome.worst), rule=getattr(outcome, "rule", "") or None,
                   bound=getattr(outcome, "bound", None), margin=getattr(outcome, "margin", None))


def _status(v) -> str:
    return v["status"] if isinstance(v, dict) else v.status


def summary(verdicts: Iterable) -> dict:
    """``{"pass": n, "mismatch": n, "unsupported": n, "error": n, "flaky": n}`` over verdicts (typed or JSON)."""
    counts = dict.fromkeys(STATUSES, 0)
    for v in verdicts:
        counts[_status(v)] += 1
    return counts


def passed(cases: Iterable, culprits: Iterable = (), end_to_end=None, needs_end_to_end: bool = False) -> bool:
    """Everything checked passed: every case, no culprit, and the end-to-end comparison (which a
    migration or session needs; a replay has none). Verdicts may be typed or JSON."""
    if end_to_end is None and needs_end_to_end:
        return False
    return (all(_status(c) == "pass" for c in cases) and not list(culprits)
            and (end_to_end is None or _status(end_to_end) == "pass"))


# --- the documents -------------------------------------------------------------------------

@dataclass(kw_only=True)
class VerdictDocument:
    """The Verdict JSON of ``tapml replay --json``: the target, its device, a verdict per case."""

    target: str | None
    cases: list[CaseVerdict]
    device: dict | None = None
    model: str | None = None
    tolerances: dict = field(default_factory=dict)
    #: The dtype the store was carved in, and whether float cases were judged fp64-anchored.
    dtype: str = "float32"
    anchored: bool = False

    @property
    def summary(self) -> dict:
        return summary(self.cases)

    @property
    def passed(self) -> bool:
        return passed(self.cases)

    def to_json(self) -> dict:
        return {"format_version": FORMAT_VERSION, "target": self.target, "device": self.device, "model": self.model,
                "dtype": self.dtype, "anchored": self.anchored, "tolerances": self.tolerances,
                "cases": [c.to_json() for c in self.cases], "summary": self.summary}

    @classmethod
    def from_json(cls, data, where: str = "<verdicts>", *, strict: bool = False, hint: str = "",
                  required: tuple[str, ...] = ("target", "cases")) -> "VerdictDocument":
        """Validate a parsed Verdict JSON or migration state (a MigrationState when it is one);
        TapmlError naming ``where`` and the field when it is malformed. ``strict``: every key
        the writer always writes must be there (for resuming)."""
        ctx = _Ctx(where, strict, hint)
        o = _Obj(data, ctx, "", "a verdict file", top=True)
        _check_depth(data, ctx)
        version = o.count("format_version", 0)
        if version > FORMAT_VERSION:
            o.fail(f"format_version {version} is newer than this tapml reads ({FORMAT_VERSION}); upgrade tapml")
        migration = cls is MigrationState or (cls is VerdictDocument and any(
            k in o.data for k in ("format", "units", "culprits", "placement", "end_to_end")))
        # a required target is a string: null is no target (reports and resumes name it)
        target = o.string("target", required=True) if "target" in required else o.string("target", None)
        common = dict(target=target,
                      cases=o.objects("cases", CaseVerdict, "a verdict", required="cases" in required),
                      device=_device(o), model=o.string("model", None, required=strict and migration),
                      tolerances=_tolerances(o, required=strict and migration),
                      dtype=o.choice("dtype", MODEL_DTYPES, "float32"), anchored=o.boolean("anchored", False))
        _derived(o)
        if not migration:
            return VerdictDocument(**common)
        fmt = o.string("format", None, required=strict)
        if fmt is not None and fmt != STATE_FORMAT:
            o.fail(f"its format is {fmt!r}, expected {STATE_FORMAT!r}")
        placement = _placement(o)
        return MigrationState(**common, inject=o.strings("inject", required=strict),
                              nodes=o.count("nodes", None, required=strict), store=o.string("store", None),
                              stage=o.choice("stage", STAGES, None, required=strict),
                              units=o.objects("units", UnitVerdict, "a unit verdict", required=strict),
                              placement=placement, culprits=o.objects("culprits", Culprit, "a culprit"),
                              end_to_end=o.object("end_to_end", EndToEnd, "an end-to-end verdict"),
                              graph=o.choice("graph", GRAPH_KINDS, None), precision=_precision(o, placement))

    @classmethod
    def read(cls, path: str | Path, *, what: str = "", strict: bool = False, hint: str = "",
             required: tuple[str, ...] = ("target", "cases")) -> "VerdictDocument":
        """Read and validate a verdict or state file (``what`` names it in messages, e.g. ``--state``)."""
        where = f"{what} {path}".strip()
        return cls.from_json(read_json_file(path, where, hint), where, strict=strict, hint=hint, required=required)


@dataclass(kw_only=True)
class MigrationState(VerdictDocument):
    """A migration state (``tapml migrate --state``, ``Session.save``): the Verdict JSON plus the
    options it ran with, its stage, units, placement, culprits and end-to-end result.
    ``graph`` (one of :data:`GRAPH_KINDS`; None outside a generation) is the graph of a
    generation a session worked on, which its placement and end-to-end result are about.
    ``complete``, ``summary`` and ``passed`` are derived, never read."""

    inject: list[str] = field(default_factory=list)
    nodes: int | None = None
    store: str | None = None
    stage: str | None = None
    units: list[UnitVerdict] = field(default_factory=list)
    placement: dict = field(default_factory=dict)
    culprits: list[Culprit] = field(default_factory=list)
    end_to_end: EndToEnd | None = None
    graph: str | None = None
    #: Placement by dtype of a float16/bfloat16 migration: ``{"dtype", "keep_float32": [nodes that
    #: computed in float32], "casts": count}``, plus ``"decode": {"keep_float32", "casts"}`` in a
    #: generation; None for a float32 model.
    precision: dict | None = None

    @property
    def complete(self) -> bool:
        return self.stage == "done"

    @property
    def passed(self) -> bool:
        # a generation has an end-to-end unit per graph; end_to_end is the prefill's
        return (passed(self.cases, self.culprits, self.end_to_end, needs_end_to_end=True)
                and all(u.status == "pass" for u in self.units if u.kind == "model"))

    def header(self) -> dict:
        """The options the migration ran with, as its journal's header holds them (``keep_float32``
        only when nodes were kept in float32)."""
        header = {"format": STATE_FORMAT, "model": self.model, "target": self.target, "tolerances": self.tolerances,
                  "inject": list(self.inject), "nodes": self.nodes}
        return header | keep_float32_header(self.precision)

    def to_json(self) -> dict:
        return {**self.header(), "format_version": FORMAT_VERSION, "cases": [c.to_json() for c in self.cases],
                "store": self.store, "device": self.device, "stage": self.stage, "complete": self.complete,
                "summary": self.summary, "units": [u.to_json() for u in self.units], "placement": self.placement,
                "culprits": [c.to_json() for c in self.culprits],
                "end_to_end": None if self.end_to_end is None else self.end_to_end.to_json(), "passed": self.passed,
                **({} if self.graph is None else {"graph": self.graph}),
                **({} if self.precision is None else {"precision": self.precision})}


def keep_float32_header(precision: dict | None) -> dict:
    """The journal header's record of a migration's keep_float32 lists (``{"keep_float32":
    {graph: names}}``; empty when nothing was kept, so older journals still resume)."""
    if not precision:
        return {}
    lists = {"model": list(precision.get("keep_float32", []))}
    if "decode" in precision:
        lists["decode"] = list(precision["decode"].get("keep_float32", []))
    return {"keep_float32": lists} if any(lists.values()) else {}


# --- the generation document ---------------------------------------------------------------

#: Statuses of a generation step (``tapml generate``): ``near-tie`` is a different token where
#: the reference's own top-2 logit gap is within the tolerance, reported but not a failure.
STEP_STATUSES = ("pass", "mismatch", "near-tie", "error")
#: The keys of a generation document's ``summary``, besides ``first_failure``.
STEP_SUMMARY_KEYS = ("steps", "pass", "mismatch", "near_tie", "error")


def read_generation_document(data, where: str = "<generation>", hint: str = "") -> dict:
    """Validate a parsed Generation JSON (``tapml generate --json``, ARCHITECTURE.md) and return
    the fields reports use, normalized: ``target``, ``model``, ``device``, ``mode``, ``steps``
    (``step``, ``kind`` prefill|decode, ``reference_token``, ``target_token``, ``max_abs_err``,
    ``status`` one of :data:`STEP_STATUSES`, ``message``), ``summary`` (recomputed from the steps,
    never trusted), ``culprits`` (full culprits, kind from :data:`CULPRIT_KINDS`, with ``graph``
    and ``step``), ``programs_compiled``, ``upload_bytes_per_decode_step`` and ``tokens_per_s``.
    TapmlError naming ``where`` and the field when it is malformed."""
    ctx = _Ctx(where, True, hint)
    _check_depth(data, ctx)
    o = _Obj(data, ctx, "", "a generation document", top=True)
    steps = []
    for key in ("steps", "culprits"):
        if not isinstance(o.data.get(key, []), list):
            o._bad(key, o.data[key], "a list")
    for i, item in enumerate(o._get("steps", _MISSING, True)):
        st = _Obj(item, ctx, f"steps[{i}]", "a generation step")
        step = st.count("step", required=True)
        ref_token, target_token = st.count("reference_token", None), st.count("target_token", None)
        steps.append({"step": step, "kind": st.choice("kind", GRAPH_KINDS, required=True),
                      "reference_token": ref_token, "target_token": target_token,
                      "max_abs_err": st.number("max_abs_err"), "status": st.choice("status", STEP_STATUSES, required=True),
                      "message": st.string("message", "") or ""})
    s = o.child("summary", "a generation summary", required=True)
    for k in STEP_SUMMARY_KEYS:
        s.count(k, None)
    s.count("first_failure", None)
    counts = {st: sum(x["status"] == st for x in steps) for st in STEP_STATUSES}
    failing = [x["step"] for x in steps if x["status"] in ("mismatch", "error")]
    culprits = []
    for i, item in enumerate(o.data.get("culprits") or []):
        c = _Obj(item, ctx, f"culprits[{i}]", "a generation culprit")
        op, node = c.string("op", required=True), c.string("node", "") or ""
        culprits.append(Culprit(kind=c.choice("kind", CULPRIT_KINDS, "op"), op=op, ops=[op], node=node,
                                nodes=c.strings("nodes") or ([node] if node else []), module=c.string("module", "") or "",
                                max_abs_err=c.number("max_abs_err"), message=c.string("message", "") or "",
                                graph=c.choice("graph", GRAPH_KINDS, None), step=c.count("step", None)).to_json())
    rates = o.child("tokens_per_s", "tokens per second ({target, reference})")
    return {"target": o.string("target", required=True), "model": o.string("model", required=True),
            "device": _device(o), "mode": o.string("mode", None),
            "steps": steps, "culprits": culprits,
            "summary": {"steps": len(steps), "pass": counts["pass"], "mismatch": counts["mismatch"],
                        "near_tie": counts["near-tie"], "error": counts["error"],
                        "first_failure": failing[0] if failing else None},
            "programs_compiled": o.count("programs_compiled", None),
            "upload_bytes_per_decode_step": o.count("upload_bytes_per_decode_step", None),
            "tokens_per_s": {k: rates.number(k) if rates else None for k in ("target", "reference")}}


def is_generation_document(data) -> bool:
    """Whether parsed JSON claims to be a Generation JSON (``steps`` and no verdict ``cases``)."""
    return isinstance(data, dict) and "steps" in data and "cases" not in data


# --- the precision document ----------------------------------------------------------------

#: Version of the precision document (``tapml precision --json``) this tapml writes and reads.
PRECISION_FORMAT_VERSION = 1
#: Dtypes a precision analysis is about (tapml.dtypes.LOW_FLOATS).
PRECISION_DTYPES = ("float16", "bfloat16")
#: Statuses of a precision document's end-to-end runs.
END_TO_END_STATUSES = ("pass", "mismatch", "error")


def read_precision_document(data, where: str = "<precision>", hint: str = "") -> dict:
    """Validate a parsed Precision JSON (``tapml precision --json``, ARCHITECTURE.md) and return
    it normalized: ``format_version``, ``model``, ``dtype`` (float16|bfloat16), ``target``,
    ``device``, ``ops`` (``op`` from the op vocabulary, ``node`` unique, ``module``, ``max_abs`` >= 0,
    ``headroom`` > 0, ``overflow``/``absorbed`` booleans, ``absorbed`` only where ``overflow``,
    ``err_vs_fp64``/``ref_err_vs_fp64``/``err_vs_fp32`` >= 0 or null), ``keep_float32`` (names of
    nodes in ``ops``), ``keep_float32_modules``, ``rounds`` and ``end_to_end`` (``before``/``after``:
    ``status`` pass|mismatch|error, ``max_abs_err``, ``max_rel_err``, ``message``), and ``cause``
    where present (``op``, ``node`` of ``ops``, ``module``, ``err_vs_fp64``, ``ref_err_vs_fp64``,
    ``ratio`` >= 0, ``message``). TapmlError naming ``where`` and the field when it is malformed."""
    from tapml.ops import check_op
    ctx = _Ctx(where, True, hint)
    _check_depth(data, ctx)
    o = _Obj(data, ctx, "", "a precision document", top=True)
    version = o.count("format_version", 0)
    if version > PRECISION_FORMAT_VERSION:
        o.fail(f"format_version {version} is newer than this tapml reads ({PRECISION_FORMAT_VERSION}); upgrade tapml")
    o.choice("kind", ("precision",), None)
    if not isinstance(o._get("ops", _MISSING, True), list):
        o._bad("ops", o.data["ops"], "a list")
    ops, nodes = [], set()
    for i, item in enumerate(o.data["ops"]):
        x = _Obj(item, ctx, f"ops[{i}]", "a precision entry")
        op = x.string("op", required=True)
        try:
            check_op(op)
        except ValueError as e:
            x.fail(f"op: {e}")
        node = x.string("node", required=True)
        if not node or node in nodes:
            x.fail(f"node {node[:80]!r} is empty or appears twice")
        nodes.add(node)
        entry = {"op": op, "node": node, "module": x.string("module", "") or "",
                 "overflow": x.boolean("overflow", False), "absorbed": x.boolean("absorbed", False)}
        for k in ("max_abs", "headroom", "err_vs_fp64", "ref_err_vs_fp64", "err_vs_fp32"):
            v = x.number(k)
            if v is not None and (v < 0 or k == "headroom" and v == 0):
                x.fail(f"{k} is {v}, expected {'a positive number' if k == 'headroom' else 'a number of 0 or more'}")
            entry[k] = v
        if entry["absorbed"] and not entry["overflow"]:
            x.fail("absorbed is true but overflow is false (an absorbed value is one that overflowed)")
        ops.append(entry)
    keep = o.strings("keep_float32", required=True)
    unknown = [k for k in keep if k not in nodes]
    if unknown:
        o.fail(f"keep_float32 names {unknown[0][:80]!r}, which is not a node of ops")
    e2e = o.child("end_to_end", "end-to-end results ({before, after})", required=True)
    runs = {}
    for k in ("before", "after"):
        r = e2e.child(k, "an end-to-end result", required=True)
        runs[k] = {"status": r.choice("status", END_TO_END_STATUSES, required=True),
                   "max_abs_err": r.number("max_abs_err"), "max_rel_err": r.number("max_rel_err"),
                   "message": r.string("message", "") or ""}
    doc = {"format_version": version, "model": o.string("model", "") or "",
           "dtype": o.choice("dtype", PRECISION_DTYPES, required=True), "target": o.string("target", required=True),
           "device": _device(o), "ops": ops, "keep_float32": keep, "keep_float32_modules": o.strings("keep_float32_modules"),
           "rounds": o.count("rounds", 0), "end_to_end": runs}
    c = o.child("cause", "the op that fails end to end ({op, node, module, err_vs_fp64, ref_err_vs_fp64, ratio, message})")
    if c is not None:
        node = c.string("node", required=True)
        if node not in nodes:
            c.fail(f"node {node[:80]!r} is not a node of ops")
        doc["cause"] = {"op": c.string("op", required=True), "node": node, "module": c.string("module", "") or "",
                        **{k: c.number(k, required=True) for k in ("err_vs_fp64", "ref_err_vs_fp64", "ratio")},
                        "message": c.string("message", "") or ""}
        if any(doc["cause"][k] < 0 for k in ("err_vs_fp64", "ref_err_vs_fp64", "ratio")):
            c.fail("err_vs_fp64, ref_err_vs_fp64 and ratio must be 0 or more")
    return doc


def is_precision_document(data) -> bool:
    """Whether parsed JSON claims to be a Precision JSON (``kind`` precision, or ``keep_float32``
    and no verdict ``cases``)."""
    return isinstance(data, dict) and (data.get("kind") == "precision" or ("keep_float32" in data and "cases" not in data))


# --- journal records -----------------------------------------------------------------------

def journal_record(key, record, where: str, hint: str):
    """The typed record of a journal line: ``device`` -> the device dict, ``case:ID`` -> a
    :class:`CaseVerdict` with that id, ``unit:ID`` -> a :class:`UnitVerdict` with that id;
    every field the writer writes must be there. TapmlError (naming ``where``) otherwise."""
    ctx = _Ctx(where, True, hint)
    if not isinstance(key, str):
        raise TapmlError(f"{where}: its key is {_a(key)}, not a string; {hint}")
    _check_depth(record, ctx)
    if key == "device":
        holder = _Obj({"device": record}, ctx, "", "a journal record")
        device = _device(holder, required=True)
        if device is None:
            holder.fail("the device record is null")
        return device
    kind, _, ident = key.partition(":")
    cls = {"case": CaseVerdict, "unit": UnitVerdict}.get(kind)
    if cls is None or not ident:
        raise TapmlError(f"{where}: key {key[:80]!r} is not device, case:ID or unit:ID; {hint}")
    verdict = cls._read(_Obj(record, ctx, f"record {key[:80]!r}", "a verdict"))
    if verdict.id != ident:
        raise TapmlError(f"{where}: record {key[:80]!r} holds the verdict of {verdict.id[:80]!r}; {hint}")
    return verdict


# --- reading and validation ----------------------------------------------------------------

@dataclass
class _Ctx:
    file: str
    strict: bool
    hint: str


def _a(x) -> str:
    name = {dict: "object", list: "list", str: "string", bool: "boolean", int: "integer", float: "number",
            type(None): "null"}.get(type(x), type(x).__name__)
    return f"an {name}" if name[0] in "aeiou" else f"a {name}"


def check_depth(data, where: str, hint: str = "") -> None:
    """TapmlError naming ``where`` when parsed JSON ``data`` nests deeper than :data:`MAX_DEPTH`."""
    _check_depth(data, _Ctx(where, True, hint))


def _check_depth(data, ctx: _Ctx) -> None:
    stack = [(data, 1)]
    while stack:
        x, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise TapmlError(f"{ctx.file} is not a tapml file: it nests deeper than {MAX_DEPTH} levels" +
                             (f"; {ctx.hint}" if ctx.hint else ""))
        if isinstance(x, dict):
            stack.extend((v, depth + 1) for v in x.values())
        elif isinstance(x, list):
            stack.extend((v, depth + 1) for v in x)


_MISSING = object()


class _Obj:
    """Typed access to one JSON object of a document; every problem is a TapmlError naming the
    file, the object's path (``cases[3]``) and the key."""

    def __init__(self, data, ctx: _Ctx, path: str, what: str, top: bool = False):
        self.ctx, self.path, self.what = ctx, path, what
        if not isinstance(data, dict):
            self.fail(f"{'its JSON' if top else 'it'} is {_a(data)}, not an object")
        self.data = data

    def fail(self, problem: str):
        where = f"{self.ctx.file}: {self.path}" if self.path else self.ctx.file
        raise TapmlError(f"{where} is not {self.what}: {problem}" + (f"; {self.ctx.hint}" if self.ctx.hint else ""))

    def _get(self, key: str, default, required: bool):
        if key not in self.data:
            if required or default is _MISSING:
                self.fail(f"it lacks {key}")
            return _MISSING
        return self.data[key]

    def _bad(self, key: str, value, expected: str):
        self.fail(f"{key} is {_a(value)}, expected {expected}")

    def string(self, key: str, default=_MISSING, required: bool = False) -> str | None:
        v = self._get(key, default, required)
        if v is _MISSING or (v is None and self._null_ok(default)):
            return default
        if not isinstance(v, str):
            self._bad(key, v, "a string")
        return v

    def _null_ok(self, default) -> bool:
        # null where a field may be null; in a lenient read, null also stands for "not given"
        return default is None or (default is not _MISSING and not self.ctx.strict)

    def choice(self, key: str, choices: tuple[str, ...], default=_MISSING, required: bool = False) -> str | None:
        v = self.string(key, default, required)
        if v is not None and v not in choices:
            self.fail(f"{key} is {v[:80]!r}, expected one of {', '.join(choices)}")
        return v

    def number(self, key: str, required: bool = False) -> float | None:
        v = self._get(key, None, required)
        if v is _MISSING or v is None:
            return None
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            self._bad(key, v, "a number or null")
        try:
            f = float(v)
        except OverflowError:
            f = math.inf
        if not math.isfinite(f):
            self.fail(f"{key} is not a finite number")
        return f

    def count(self, key: str, default=_MISSING, required: bool = False) -> int | None:
        v = self._get(key, default, required)
        if v is _MISSING or (v is None and self._null_ok(default)):
            return default
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= MAX_COUNT:
            self.fail(f"{key} is {_a(v) if not isinstance(v, int) or isinstance(v, bool) else 'out of range'}, "
                      "expected a non-negative integer")
        return v

    def boolean(self, key: str, default=_MISSING) -> bool:
        v = self._get(key, default, False)
        if v is _MISSING:
            return default
        if not isinstance(v, bool):
            self._bad(key, v, "true or false")
        return v

    def strings(self, key: str, required: bool = False) -> list[str]:
        v = self._get(key, [], required)
        if v is _MISSING or v is None:
            return []
        if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
            self.fail(f"{key} is not a list of strings")
        return list(v)

    def objects(self, key: str, cls, what: str, required: bool = False) -> list:
        v = self._get(key, [], required)
        if v is _MISSING or v is None:
            return []
        if not isinstance(v, list):
            self._bad(key, v, "a list")
        prefix = f"{self.path}." if self.path else ""
        return [cls._read(_Obj(item, self.ctx, f"{prefix}{key}[{i}]", what)) for i, item in enumerate(v)]

    def object(self, key: str, cls, what: str):
        v = self._get(key, None, False)
        if v is _MISSING or v is None:
            return None
        prefix = f"{self.path}." if self.path else ""
        return cls._read(_Obj(v, self.ctx, prefix + key, what))

    def child(self, key: str, what: str, required: bool = False) -> "_Obj | None":
        v = self._get(key, None, required)
        if v is None and required:
            self._bad(key, v, what)
        if v is _MISSING or v is None:
            return None
        prefix = f"{self.path}." if self.path else ""
        return _Obj(v, self.ctx, prefix + key, what)

    def worst(self, key: str) -> list[dict]:
        v = self._get(key, [], False)
        if v is _MISSING or v is None:
            return []
        if not isinstance(v, list):
            self._bad(key, v, "a list")
        out = []
        for i, w in enumerate(v):
            if not (isinstance(w, dict) and isinstance(w.get("index"), list)
                    and all(isinstance(x, int) and not isinstance(x, bool) for x in w["index"])
                    and all(_scalar(w.get(k)) for k in ("target", "reference"))):
                self.fail(f"{key}[{i}] is not a worst element ({{\"index\": [ints], \"target\", \"reference\"}})")
            out.append({"index": list(w["index"]), "target": w.get("target"), "reference": w.get("reference")})
        return out


def _scalar(x) -> bool:
    if isinstance(x, float):
        return math.isfinite(x)
    return x is None or isinstance(x, (str, bool, int))


def _device(o: _Obj, required: bool = False) -> dict | None:
    d = o.child("device", "a device description", required)
    if d is None:
        return None
    out = {"adapter": d.string("adapter", ""), "backend": d.string("backend", ""),
           "features": d.strings("features"), "limits": {}}
    limits = d.child("limits", "a table of device limits")
    for k, v in (limits.data.items() if limits else ()):
        if not _scalar(v) or isinstance(v, int) and not isinstance(v, bool) and abs(v) > MAX_COUNT:
            limits.fail(f"{k[:80]} is not a number, string or boolean")
        out["limits"][k] = v
    paths = d.child("low_precision", "how float16 and bfloat16 are held on the device")
    if paths is not None:
        out["low_precision"] = {k: paths.string(k) for k in ("float16", "bfloat16") if k in paths.data}
    model = d.child("float_model", "whether the device keeps NaN/Inf and subnormals")
    if model is not None:
        for k, v in model.data.items():
            if k not in ("nan_inf", "subnormals") or not isinstance(v, bool):
                model.fail(f"{k[:80]} is not nan_inf or subnormals with a true/false value")
        out["float_model"] = dict(model.data)
    if "loop_cap" in d.data:
        cap = d.data["loop_cap"]
        if cap is not None and (type(cap) is not int or not 0 <= cap <= MAX_COUNT):
            d.fail("loop_cap is not a count of loop iterations or null")
        out["loop_cap"] = cap
    if "error" in d.data:
        out["error"] = d.string("error")
    return out


def _tolerances(o: _Obj, required: bool = False) -> dict:
    t = o.child("tolerances", "a table of tolerances ({op: [rtol, atol]})", required)
    out = {}
    for op, v in (t.data.items() if t else ()):
        if not (isinstance(v, list) and len(v) == 2 and all(
                isinstance(x, (int, float)) and not isinstance(x, bool) and _scalar(x) and 0 <= x <= 1e300 for x in v)):
            t.fail(f"{op[:80]} is not [rtol, atol] (two non-negative numbers)")
        out[op] = [float(v[0]), float(v[1])]
    return out


def _derived(o: _Obj) -> None:
    """Fields a reader recomputes (never trusts) must still have their type."""
    s = o.child("summary", "a summary ({status: count})")
    for k in s.data if s else ():
        if k not in STATUSES:
            s.fail(f"{k[:80]} is not a status; expected {', '.join(STATUSES)}")
        s.count(k)
    o.boolean("passed", False)
    o.boolean("complete", False)


_SHARE_KEYS = ("ops_total", "ops_on_target", "ops_share", "flops_total", "flops_on_target", "flops_share")


def _placement(o: _Obj) -> dict:
    p = o.child("placement", "a placement", o.ctx.strict)
    if p is None:
        return {}
    out = _graph_placement(p, o.ctx.strict)
    decode = p.child("decode", "the placement of a generation's decode graph")
    if decode is not None:
        out["decode"] = _graph_placement(decode, o.ctx.strict)
    return out


def _precision(o: _Obj, placement: dict) -> dict | None:
    """A state's placement by dtype; every kept node must be a node of its graph's placement."""
    p = o.child("precision", "a placement by dtype ({dtype, keep_float32, casts})")
    if p is None:
        return None
    out = {"dtype": p.choice("dtype", PRECISION_DTYPES, required=True)}
    for holder, place, key in ((p, placement, None), (p.child("decode", "the decode graph's placement by dtype"),
                                                      placement.get("decode") or {}, "decode")):
        if holder is None:
            continue
        keep = holder.strings("keep_float32", required=True)
        nodes = place.get("nodes")
        if len(set(keep)) != len(keep):
            holder.fail("keep_float32 names a node twice")
        if nodes is None and keep:
            holder.fail("keep_float32 names nodes but the placement lists none")
        unknown = [k for k in keep if nodes is not None and k not in nodes]
        if unknown:
            holder.fail(f"keep_float32 names {unknown[0][:80]!r}, which is not a node of the placement")
        entry = {"keep_float32": keep, "casts": holder.count("casts", 0)}
        if key is None:
            out |= entry
        else:
            out[key] = entry
    return out


def _graph_placement(p: _Obj, strict: bool) -> dict:
    out: dict = {}
    nodes = p.child("nodes", "a placement of nodes", strict)
    if nodes is not None:
        for name, where in nodes.data.items():
            if where not in PLACES:
                nodes.fail(f"{name[:80]} is placed on {str(where)[:40]!r}, expected {' or '.join(PLACES)}")
        out["nodes"] = dict(nodes.data)
    for k in _SHARE_KEYS:
        if k.endswith("_share"):
            v = p.number(k, required=strict)
            if v is not None and not 0.0 <= v <= 1.0:
                p.fail(f"{k} is {v}, expected a share between 0 and 1")
        else:
            v = p.count(k, None, required=strict)
        if k in p.data:
            out[k] = v
    return out


__all__ = ["Verdict", "CaseVerdict", "UnitVerdict", "RegionCheck", "EndToEnd", "Culprit", "VerdictDocument",
           "MigrationState", "read_generation_document", "is_generation_document", "STEP_STATUSES",
           "read_precision_document", "is_precision_document", "PRECISION_FORMAT_VERSION", "PRECISION_DTYPES",
           "END_TO_END_STATUSES", "outcome_verdict", "culprit_kind", "summary", "passed", "journal_record", "check_depth",
           "STATUSES", "STAT_KEYS", "TIMINGS", "CULPRIT_KINDS", "UNIT_KINDS", "GRAPH_KINDS", "STAGES", "STATE_FORMAT",
           "FORMAT_VERSION", "keep_float32_header"]
