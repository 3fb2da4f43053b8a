"""The result vocabulary: what one check ends in (:class:`Verdict` and its kinds), what a failure
is blamed on (:class:`Culprit`), the closed sets their fields draw from, the schemas they are read
by (:class:`VerdictJSON` and the other classes ending in ``JSON``, one per type) and the one
mapping from a run's outcome to a verdict (:func:`outcome_verdict`)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Annotated, ClassVar, Iterable, Literal

from pydantic import Field

from tapml.errors import DeviceLost, PlatformError, Unsupported
from tapml.judging.verdict.reading import NonNegative, Scalar, Written, _Reader
from tapml.schema import Bool, Count, Int, Number, Str

if TYPE_CHECKING:
    from tapml.judging.compare import Comparison

#: ``flaky``: outputs that differ from run to run (``replay --repeat K``, :mod:`tapml.judging.flaky`), kept
#: apart from ``mismatch`` (a wrong but repeatable result).
STATUSES = ("pass", "mismatch", "unsupported", "error", "flaky")
STAT_KEYS = ("max_abs_err", "max_rel_err", "mismatch_fraction")
#: The rules a comparison is decided by (tapml.judging.compare.RULES): exact, the tolerances,
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
#: How a profiled case's ``device_ms`` was taken (tapml.driving.profile): GPU timestamps or the host clock.
TIMINGS = ("timestamp", "wall")
#: What bounds a profiled case's least time on its device's roofline (tapml.platforms.roofline).
BOUNDS = ("compute", "memory", "dispatch")
#: Kinds of culprit, in the order reports list them: a wrong op (alone), a wrong node (in its
#: model's context), an op that fails to compile or run, a window of nodes that fails to run
#: together (fusion), error that builds up along a window of nodes that each pass, and last an
#: op the target does not support (a gap, not a bug).
CULPRIT_KINDS = ("op", "node", "error", "fusion", "accumulated", "unsupported")
UNIT_KINDS = ("op", "region", "model")
#: The graphs of a generation store a migration checks, one pass each (units and culprits say which).
GRAPH_KINDS = ("prefill", "decode")



# --- the schemas they are read by ----------------------------------------------------------

class WorstJSON(Written):
    """One of the elements a comparison found furthest off: its index and both values."""

    index: list[Int]
    target: Scalar = None
    reference: Scalar = None


class EvidenceJSON(Written):
    """What a verdict and a culprit both say of a failure: error statistics, the message, the
    worst elements and how it was judged (a rule of :data:`RULES`, its bound and margin)."""

    max_abs_err: Number | None = None
    max_rel_err: Number | None = None
    mismatch_fraction: Number | None = None
    message: Str | None = ""
    worst: list[WorstJSON] = []
    rule: Literal[RULES] | None = None
    bound: NonNegative | None = None
    margin: NonNegative | None = None


class AgreementJSON(Written):
    """Next-token distributions against the reference's: mean and largest KL divergence (nats), the
    share with the same top-1 token, how many had NaN or infinite logits (no distribution: a failure,
    left out of the KL figures), and the ``status`` they get against ``thresholds``."""

    mean_kl: NonNegative
    max_kl: NonNegative
    top1_agreement: Annotated[Number, Field(ge=0, le=1)]
    nonfinite: Count = 0
    thresholds: dict[Literal["mean_kl", "top1_agreement"], NonNegative]
    status: Literal["pass", "fail"]


class LogitsAgreementJSON(AgreementJSON):
    """How a model's logits agree with the reference's at each of its ``positions``
    (:func:`tapml.judging.compare.logits_agreement`): a quantized model's whole-model verdict."""

    positions: Count


class VerdictJSON(EvidenceJSON):
    """A :class:`Verdict`: a status of :data:`STATUSES`, its evidence and run time."""

    ALWAYS = STAT_KEYS + ("message", "time_ms")
    status: Literal[STATUSES]
    time_ms: Number | None = None
    worst_output: Str | None = None
    distribution: LogitsAgreementJSON | None = None


class CaseVerdictJSON(VerdictJSON):
    """A :class:`CaseVerdict`."""

    ALWAYS = ("id", "node", "module", "instances") + VerdictJSON.ALWAYS
    id: Str | None = ""
    op: Str
    node: Str | None = ""
    module: Str | None = ""
    instances: Count | None = 1
    device_ms: NonNegative | None = None
    gflops: NonNegative | None = None
    gbps: NonNegative | None = None
    roofline_bound: Literal[BOUNDS] | None = None
    roofline_ms: NonNegative | None = None
    roofline_fraction: NonNegative | None = None
    baseline_ms: NonNegative | None = None
    compile_s: NonNegative | None = None
    run_s: NonNegative | None = None
    timing: Literal[TIMINGS] | None = None
    shapes: Str | None = None
    device: Str | None = None
    compile_cached: Bool | None = None
    blame: Literal[BLAME] | None = None
    control: Str | None = None
    control_status: Literal[STATUSES] | None = None
    int64_two_words: list[Str] | None = None


class RegionCheckJSON(VerdictJSON):
    """A :class:`RegionCheck`."""

    first: Str | None = ""
    last: Str | None = ""
    nodes: Count | None = 0


class UnitVerdictJSON(VerdictJSON):
    """A :class:`UnitVerdict`."""

    ALWAYS = ("id", "kind", "role", "module", "nodes", "on_target") + VerdictJSON.ALWAYS
    id: Str | None = ""
    kind: Literal[UNIT_KINDS] | None = "region"
    role: Str | None = ""
    module: Str | None = ""
    nodes: list[Str] = []
    on_target: Count | None = None
    regions: Count | None = None
    region_checks: list[RegionCheckJSON] | None = None
    graph: Literal[GRAPH_KINDS] | None = None


class EndToEndJSON(VerdictJSON):
    """An :class:`EndToEnd`."""

    regions: Count | None = None


class CulpritJSON(EvidenceJSON):
    """A :class:`Culprit` (an older one may lack its ``ops`` and ``nodes``: its op and node are)."""

    kind: Literal[CULPRIT_KINDS] | None = "op"
    op: Str | None = "?"
    ops: list[Str] = []
    node: Str | None = ""
    nodes: list[Str] = []
    module: Str | None = ""
    status: Literal[STATUSES] | None = "mismatch"
    unit: Str | None = None
    case: Str | None = None
    region: Str | None = None
    probes: Count | None = None
    graph: Literal[GRAPH_KINDS] | None = None
    step: Count | None = None


def _agreement(m: LogitsAgreementJSON | None) -> dict | None:
    return None if m is None else m.model_dump()


def _worst(worst: list[WorstJSON]) -> list[dict]:
    return [{"index": w.index, "target": w.target, "reference": w.reference} for w in worst]

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
    #: A quantized model's logits judged as distributions (:class:`LogitsAgreementJSON`); None elsewhere.
    distribution: dict | None = None

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
        if self.distribution is not None:
            out["distribution"] = dict(self.distribution)
        return out

    #: The schema a verdict of this class is read by.
    JSON: ClassVar[type[VerdictJSON]] = VerdictJSON

    @classmethod
    def from_json(cls, data, where: str = "<verdict>", *, strict: bool = False, hint: str = "") -> "Verdict":
        """Validate a parsed verdict against :attr:`JSON` (see :class:`MigrationState.from_json`)."""
        r = _Reader(where, strict, hint)
        return cls._read(r, r.check(cls.JSON, data))

    @classmethod
    def _read(cls, r: _Reader, m: VerdictJSON, path: str = "") -> "Verdict":
        """The verdict of the validated ``m`` (at ``path`` of its document)."""
        return cls(**{**r.values(m, path), "worst": _worst(m.worst), "distribution": _agreement(m.distribution)})


@dataclass(kw_only=True)
class CaseVerdict(Verdict):
    """The verdict on one carved case run alone (``id``, ``op``, ``node``, ``module`` of the
    case, ``instances``: how many calls of the model it stands for). A profiled case
    (``replay --profile``, :mod:`tapml.driving.profile`) adds its median ``device_ms``, ``gflops``,
    ``gbps``, ``timing`` (one of :data:`TIMINGS`), input ``shapes``, where the device's roofline
    is known the ``roofline_bound`` (one of :data:`BOUNDS`) of the least time ``roofline_ms`` the
    device allows it and the ``roofline_fraction`` reached (``roofline_ms / device_ms``), and,
    compared with a baseline,
    ``baseline_ms``; all None otherwise and then not written."""

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
    roofline_bound: str | None = None
    roofline_ms: float | None = None
    roofline_fraction: float | None = None
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
    #: the case's int64 tensors (refs of its graph) a WGSL target held in two 32-bit words, their
    #: values being past i32 (64-bit emulation, platforms/wgsl/int64.py); None when none was
    int64_two_words: list[str] | None = None

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
        for k in ("roofline_bound", "roofline_ms", "roofline_fraction", "compile_s", "run_s", "compile_cached", "blame", "control",
                  "control_status", "int64_two_words"):
            if getattr(self, k) is not None:
                out[k] = getattr(self, k)
        return out

    JSON = CaseVerdictJSON


@dataclass(kw_only=True)
class RegionCheck(Verdict):
    """One target region of a session's end-to-end check, compared at its outputs."""

    first: str = ""
    last: str = ""
    nodes: int = 0

    def to_json(self) -> dict:
        return {"first": self.first, "last": self.last, "nodes": self.nodes, **super().to_json()}

    JSON = RegionCheckJSON


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

    JSON = UnitVerdictJSON

    @classmethod
    def _read(cls, r: _Reader, m: UnitVerdictJSON, path: str = "") -> "UnitVerdict":
        checks = m.region_checks
        return cls(**{**r.values(m, path), "worst": _worst(m.worst), "distribution": _agreement(m.distribution),
                      "region_checks": None if checks is None else
                      [RegionCheck._read(r, c, f"{path}.region_checks[{i}]") for i, c in enumerate(checks)]})


@dataclass(kw_only=True)
class EndToEnd(Verdict):
    """The end-to-end comparison of the whole model on its final placement."""

    regions: int | None = None

    def to_json(self) -> dict:
        return {**super().to_json(), "regions": self.regions}

    JSON = EndToEndJSON


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
    def _read(cls, r: _Reader, m: CulpritJSON, path: str = "") -> "Culprit":
        """The culprit of the validated ``m``; an older one without ``ops``/``nodes`` has its op and node."""
        v = r.values(m, path)
        return cls(**{**v, "ops": v["ops"] or [v["op"]], "nodes": v["nodes"] or ([v["node"]] if v["node"] else []),
                      "worst": _worst(m.worst)})


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
    of :mod:`tapml.judging.compare`) is ``unsupported`` with that reason. :class:`Unsupported`
    is ``unsupported``, any other exception ``error``; the message names the region the error
    came from (``e.region``, set by :class:`~tapml.driving.hybrid.HybridRunner`) and, for an error that
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
    unsupported = not outcome.passed and getattr(outcome, "unsupported", "")  # tapml.judging.compare's int64 policy
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
