"""The verdict documents: the Verdict JSON (:class:`VerdictDocument`), migration states
(:class:`MigrationState`), the Generation, Precision, Preflight and Bench JSON readers and
journal records. Each is declared once as a schema (the classes ending in ``JSON``) and validated
against it on read, since these files may come from anyone (SECURITY.md); the readers keep by
hand only what a schema cannot say: references between fields, the nesting depth and a
``format_version`` newer than this tapml reads."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field

from tapml.dtypes import MODEL_DTYPES
from tapml.quant import SCHEMES as QUANT_SCHEMES
from tapml.errors import TapmlError
from tapml.io import read_json_file
from tapml.judging.verdict.kinds import KINDS, STATE_KEYS, document_kind, stamp
from tapml.judging.verdict.reading import NonNegative, Scalar, Written, _check_depth, _Reader
from tapml.judging.verdict.results import (AgreementJSON, CULPRIT_KINDS, GRAPH_KINDS, STATUSES, CaseVerdict, CaseVerdictJSON, Culprit,
                                           CulpritJSON, EndToEnd, EndToEndJSON, UnitVerdict, UnitVerdictJSON, passed,
                                           summary)
from tapml.schema import Bool, ClosedSchema, Count, Number, Str

#: Version of the verdict and state documents this tapml writes (older files have none: 0).
FORMAT_VERSION = KINDS["verdict"]["format_version"]
#: The ``format`` key of migration states (and of their journal's header).
STATE_FORMAT = "tapml-migration/1"
STAGES = ("op", "region", "model", "done", "session")
#: Where a node runs (tapml.driving.hybrid's TARGET and REFERENCE).
PLACES = ("target", "reference")
#: Version of the precision document (``tapml precision --json``) this tapml writes and reads.
PRECISION_FORMAT_VERSION = KINDS["precision"]["format_version"]
#: Dtypes a precision analysis is about (tapml.dtypes.LOW_FLOATS).
PRECISION_DTYPES = ("float16", "bfloat16")


# --- the documents' shared parts ------------------------------------------------------------

class LowPrecisionJSON(Written):
    """How float16 and bfloat16 are held on a device."""

    float16: Str = ""
    bfloat16: Str = ""


class FloatModelJSON(ClosedSchema):
    """Whether a device keeps NaN/Inf and subnormals (no other key)."""

    nan_inf: Bool = False
    subnormals: Bool = False


class RooflineJSON(ClosedSchema):
    """What a device does at best, as its probes measured it (tapml.platforms.roofline)."""

    peak_gflops: NonNegative | None = None
    storage_gbps: NonNegative | None = None
    workgroup_gbps: NonNegative | None = None
    dispatch_us: NonNegative | None = None
    timing: Literal["device", "round trip"] | None = None


class DeviceJSON(Written):
    """A device description: adapter, backend, features, limits (name -> a number, string or
    boolean), and where known how it holds low floats, its float model, loop cap and roofline."""

    adapter: Str | None = ""
    backend: Str | None = ""
    features: list[Str] = []
    limits: dict[Str, Scalar] | None = None
    low_precision: LowPrecisionJSON | None = None
    float_model: FloatModelJSON | None = None
    loop_cap: Count | None = None
    roofline: RooflineJSON | None = None
    error: Str = ""


#: ``[rtol, atol]`` of an op.
Tolerance = tuple[Annotated[Number, Field(ge=0, le=1e300)], Annotated[Number, Field(ge=0, le=1e300)]]
#: A share of ops or FLOPs.
Share = Annotated[Number, Field(ge=0, le=1)]


class GraphPlacementJSON(Written):
    """Where each node of a graph runs, and the share of ops and FLOPs on the target."""

    ALWAYS = ("nodes", "ops_total", "ops_on_target", "ops_share", "flops_total", "flops_on_target", "flops_share")
    nodes: dict[Str, Literal[PLACES]] | None = None
    ops_total: Count | None = None
    ops_on_target: Count | None = None
    ops_share: Share | None = None
    flops_total: Count | None = None
    flops_on_target: Count | None = None
    flops_share: Share | None = None


class PlacementJSON(GraphPlacementJSON):
    """A migration's placement; a generation's has its decode graph's too."""

    decode: GraphPlacementJSON | None = None


class KeptJSON(Written):
    """The nodes of a graph kept in float32 (each a node of its placement) and the casts added."""

    keep_float32: list[Str]
    casts: Count | None = 0


class DtypePlacementJSON(KeptJSON):
    """A float16/bfloat16 migration's placement by dtype (``precision`` of a state)."""

    dtype: Literal[PRECISION_DTYPES]
    decode: KeptJSON | None = None


# preflight (a Preflight JSON, and what replay checked before it ran)

class FindingJSON(Written):
    """What preflight found for some cases of an op: a tensor split across binding windows (or
    buffers), a device limit gone over (``limit``, the ``value`` asked for, what is ``allowed``,
    in ``kernel`` and/or on ``buffer``), or why it is unsupported or fails (``reason``)."""

    cases: Count | None = 1
    message: Str | None = ""
    reason: Str | None = ""
    limit: Str | None = None
    buffer: Str | None = None
    shape: list[Count] | None = None
    dtype: Str | None = None
    bytes: Count | None = None
    buffers: Count | None = None
    windows: Count | None = None
    window_bytes: Count | None = None
    limit_value: Count | None = None
    value: Count | None = None
    allowed: Count | None = None
    kernel: Str | None = None


class PreflightOpJSON(Written):
    """One op of a preflight."""

    op: Str
    cases: Count | None = 0
    kernels: Count | None = 0
    largest_binding: Count | None = 0
    splits: list[FindingJSON] = []
    violations: list[FindingJSON] = []
    unsupported: list[FindingJSON] = []
    errors: list[FindingJSON] = []
    fits: Bool | None = None  # derived: recomputed on read
    int64_two_words: Count | None = 0


class PreflightSummaryJSON(Written):
    """A preflight's summary (recomputed from its ops on read: still of its type)."""

    ops: Count | None = None
    cases: Count | None = None
    ops_split: Count | None = None
    ops_over_limit: Count | None = None
    ops_unsupported: Count | None = None
    ops_error: Count | None = None
    largest_split: FindingJSON | None = None
    fits: Bool | None = None


class PreflightJSON(Written):
    """The Preflight JSON of ``tapml inspect STORE --target T --json`` (and, without kind, model,
    store and device, the ``preflight`` of a Verdict JSON: what replay checked before it ran)."""

    format_version: Count = 0
    target: Str
    model: Str | None = ""
    store: Str | None = ""
    device: DeviceJSON | None = None
    limits: dict[Str, Count] | None = None
    forced_limits: dict[Str, Count] | None = None
    loop_cap: Count | None = None
    ops: list[PreflightOpJSON]
    summary: PreflightSummaryJSON | None = None  # derived: recomputed on read


class PoolDeviceJSON(Written):
    """One device of a pool (``registry://``): how many cases it ``served`` and why it dropped
    out (``status``, ``ok`` when it did not)."""

    target: Annotated[Str, Field(min_length=1)]
    adapter: Str = ""
    backend: Str = ""
    platform: Str = ""
    served: Count = 0
    status: Str = ""


class VerdictDocumentJSON(Written):
    """A :class:`VerdictDocument` (``kind`` and ``format_version`` are checked before it)."""

    format_version: Count = 0
    target: Str | None = None
    cases: list[CaseVerdictJSON] = []
    device: DeviceJSON | None = None
    model: Str | None = None
    tolerances: dict[Str, Tolerance] | None = {}
    dtype: Literal[MODEL_DTYPES] | None = "float32"
    anchored: Bool = False
    # what replay checked before it ran, and the pool's devices: validated, not read
    preflight: PreflightJSON | None = None
    devices: list[PoolDeviceJSON] | None = None
    # derived, recomputed on read: still of their type
    summary: dict[Literal[STATUSES], Count] | None = None
    passed: Bool = False
    complete: Bool = False


class MigrationStateJSON(VerdictDocumentJSON):
    """A :class:`MigrationState`."""

    ALWAYS = ("model", "tolerances", "format", "inject", "nodes", "stage", "units", "placement")
    format: Literal[STATE_FORMAT] | None = None
    inject: list[Str] = []
    nodes: Count | None = None
    store: Str | None = None
    stage: Literal[STAGES] | None = None
    units: list[UnitVerdictJSON] = []
    placement: PlacementJSON | None = PlacementJSON()
    culprits: list[CulpritJSON] = []
    end_to_end: EndToEndJSON | None = None
    graph: Literal[GRAPH_KINDS] | None = None
    precision: DtypePlacementJSON | None = None


def _device(r: _Reader, m: DeviceJSON | None, path: str = "device") -> dict | None:
    if m is None:
        return None
    v = r.values(m, path)
    out = {"adapter": v["adapter"], "backend": v["backend"], "features": v["features"], "limits": v["limits"] or {}}
    if m.low_precision is not None:
        out["low_precision"] = r.present(m.low_precision, ("float16", "bfloat16"), f"{path}.low_precision")
    if m.float_model is not None:
        out["float_model"] = {k: getattr(m.float_model, k) for k in ("nan_inf", "subnormals")
                              if k in m.float_model.model_fields_set}
    if m.roofline is not None:
        out["roofline"] = {k: getattr(m.roofline, k) for k in m.roofline.model_fields_set}
    out.update({k: v[k] for k in ("loop_cap", "error") if k in m.model_fields_set})
    return out


def _placement(r: _Reader, m: PlacementJSON | None) -> dict:
    if m is None:
        return {}
    out = _graph_placement(r, m, "placement")
    if m.decode is not None:
        out["decode"] = _graph_placement(r, m.decode, "placement.decode")
    return out


def _graph_placement(r: _Reader, m: GraphPlacementJSON, path: str) -> dict:
    out = r.present(m, GraphPlacementJSON.ALWAYS, path)
    if out.get("nodes", 0) is None:
        del out["nodes"]
    return out


def _dtype_placement(r: _Reader, m: DtypePlacementJSON | None, placement: dict) -> dict | None:
    """A state's placement by dtype; every kept node must be a node of its graph's placement."""
    if m is None:
        return None
    out = {"dtype": m.dtype}
    for kept, place, key in ((m, placement, None), (m.decode, placement.get("decode") or {}, "decode")):
        if kept is None:
            continue
        path = "precision" if key is None else "precision.decode"
        v = r.values(kept, path)
        keep, nodes = v["keep_float32"], place.get("nodes")
        if len(set(keep)) != len(keep):
            r.fail(f"{path}.keep_float32 names a node twice")
        if nodes is None and keep:
            r.fail(f"{path}.keep_float32 names nodes but the placement lists none")
        unknown = [k for k in keep if nodes is not None and k not in nodes]
        if unknown:
            r.fail(f"{path}.keep_float32 names {unknown[0][:80]!r}, which is not a node of the placement")
        entry = {"keep_float32": keep, "casts": v["casts"]}
        if key is None:
            out |= entry
        else:
            out[key] = entry
    return out


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
        return stamp("verdict", {"target": self.target, "device": self.device, "model": self.model,
                                 "dtype": self.dtype, "anchored": self.anchored, "tolerances": self.tolerances,
                                 "cases": [c.to_json() for c in self.cases], "summary": self.summary})

    @classmethod
    def from_json(cls, data, where: str = "<verdicts>", *, strict: bool = False, hint: str = "",
                  required: tuple[str, ...] = ("target", "cases")) -> "VerdictDocument":
        """Validate a parsed Verdict JSON or migration state (a MigrationState when it is one)
        against :class:`VerdictDocumentJSON` or :class:`MigrationStateJSON`; TapmlError naming
        ``where``, the field's path and what is expected when it is malformed. ``strict``: every
        key the writer always writes must be there (for resuming); ``required``: keys that
        must be there in any read (a required target is a string, never null)."""
        r = _Reader(where, strict, hint, "a verdict file")
        r.document(data)
        version = data.get("format_version", 0)
        if type(version) is int and version > FORMAT_VERSION:
            r.fail(f"format_version {version} is newer than this tapml reads ({FORMAT_VERSION}); upgrade tapml")
        kind = document_kind(data, where)
        if kind not in (None, "verdict", "migration-state"):
            r.fail(f"it is a {kind} document, not a verdict file or migration state", "a verdict file")
        if kind is None:  # an older document (kinds.FALLBACK_RULES): a state has one of the state's keys
            kind = "migration-state" if any(k in data for k in STATE_KEYS) else "verdict"
        migration = cls is MigrationState or (cls is VerdictDocument and kind == "migration-state")
        m = r.check(MigrationStateJSON if migration else VerdictDocumentJSON, data)
        for key in required:
            if key not in m.model_fields_set:
                r.fail(f"the document lacks {key}")
        if "target" in required and m.target is None:
            r.fail("target is null, expected a string")
        v = r.values(m)
        common = dict(target=m.target, cases=[CaseVerdict._read(r, c, f"cases[{i}]") for i, c in enumerate(m.cases)],
                      device=_device(r, m.device), model=m.model,
                      tolerances={op: [float(t[0]), float(t[1])] for op, t in v["tolerances"].items()},
                      dtype=v["dtype"], anchored=m.anchored)
        if not migration:
            return VerdictDocument(**common)
        placement = _placement(r, m.placement)
        return MigrationState(**common, inject=m.inject, nodes=m.nodes, store=m.store, stage=m.stage,
                              units=[UnitVerdict._read(r, u, f"units[{i}]") for i, u in enumerate(m.units)],
                              placement=placement,
                              culprits=[Culprit._read(r, c, f"culprits[{i}]") for i, c in enumerate(m.culprits)],
                              end_to_end=None if m.end_to_end is None else EndToEnd._read(r, m.end_to_end, "end_to_end"),
                              graph=m.graph, precision=_dtype_placement(r, m.precision, placement))

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
        return stamp("migration-state", {**self.header(), "cases": [c.to_json() for c in self.cases],
                "store": self.store, "device": self.device, "stage": self.stage, "complete": self.complete,
                "summary": self.summary, "units": [u.to_json() for u in self.units], "placement": self.placement,
                "culprits": [c.to_json() for c in self.culprits],
                "end_to_end": None if self.end_to_end is None else self.end_to_end.to_json(), "passed": self.passed,
                **({} if self.graph is None else {"graph": self.graph}),
                **({} if self.precision is None else {"precision": self.precision})})


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


class StepJSON(Written):
    """One step of a generation: the token each side chose and the logits' error."""

    step: Count
    kind: Literal[GRAPH_KINDS]
    reference_token: Count | None = None
    target_token: Count | None = None
    max_abs_err: Number | None = None
    status: Literal[STEP_STATUSES]
    message: Str | None = ""
    kl: NonNegative | None = None


class DistributionJSON(AgreementJSON):
    """How a generation's next-token distributions agree with the reference's, over the steps that
    ran; ``judged``: its status is a verdict (a quantized model's)."""

    judged: Bool = False


class StepSummaryJSON(Written):
    """A generation's summary (recomputed from its steps on read: still of its type)."""

    steps: Count | None = None
    passed_steps: Count | None = Field(None, alias="pass")
    mismatch: Count | None = None
    near_tie: Count | None = None
    error: Count | None = None
    first_failure: Count | None = None


class GenerationCulpritJSON(Written):
    """A culprit a generation found, with the graph and step it was found in."""

    kind: Literal[CULPRIT_KINDS] | None = "op"
    op: Str
    node: Str | None = ""
    nodes: list[Str] = []
    module: Str | None = ""
    max_abs_err: Number | None = None
    message: Str | None = ""
    graph: Literal[GRAPH_KINDS] | None = None
    step: Count | None = None


class RatesJSON(Written):
    """Tokens per second on each side."""

    target: Number | None = None
    reference: Number | None = None


class LocalizationJSON(Written):
    """The migration of a generation's first failing step: which step and graph, its counts."""

    step: Count | None = None
    graph: Literal[GRAPH_KINDS] | None = None
    cases: Count | None = None
    units: Count | None = None
    end_to_end: Literal[STATUSES] | None = None
    placement: Count | None = None


class StepPlacementJSON(Written):
    """How many nodes of a generation's graph ran on the target, and the first that fell back."""

    nodes: Count | None = None
    on_target: Count | None = None
    fell_back: Count | None = None
    fell_back_nodes: list[Str] = []
    quantized: Count | None = None
    quantized_on_target: Count | None = None


class KvCacheJSON(Written):
    """Where the target keeps the decode graph's state between steps."""

    on_device: Bool | None = None
    bytes: Count | None = None
    note: Str | None = None


class GenerationJSON(Written):
    """The Generation JSON of ``tapml generate --json`` (reports read the steps, the culprits and
    the figures; the rest is declared so that all of it is validated)."""

    format_version: Count = 0
    prompt_len: Count | None = None
    tokens: Count | None = None
    dtype: Literal[MODEL_DTYPES] | None = None
    judged_against: Literal[MODEL_DTYPES] | None = None
    keep_float32: dict[Literal[GRAPH_KINDS], list[Str]] | None = None
    casts: dict[Literal[GRAPH_KINDS], Count] | None = None
    localization: LocalizationJSON | None = None
    reference_tokens: list[Count] = []
    target_tokens: list[Count] = []
    first_divergence: Count | None = None
    tokenizer: Str | None = None
    tokenizer_note: Str | None = None
    placement: dict[Literal[GRAPH_KINDS], StepPlacementJSON] | None = None
    kv_cache: KvCacheJSON | None = None
    compiled_per_shape: Str | None = None
    upload_bytes_first_decode_step: Count | None = None
    target: Str
    model: Str
    device: DeviceJSON | None = None
    mode: Str | None = None
    steps: list[StepJSON]
    summary: StepSummaryJSON
    culprits: list[GenerationCulpritJSON] = []
    programs_compiled: Count | None = None
    upload_bytes_per_decode_step: Count | None = None
    tokens_per_s: RatesJSON | None = None
    quantize: Literal[QUANT_SCHEMES] | None = None
    distribution: DistributionJSON | None = None


def _open_document(data, where: str, hint: str, kind: str, noun: str, older: bool = True) -> _Reader:
    """The (strict) reader of a parsed document that must be of ``kind`` (an object, depth checked):
    a malformed one is no ``noun``; ``older``: one without a kind (written before kinds, read by
    the fallback rules) is taken too."""
    r = _Reader(where, True, hint, noun)
    r.document(data)
    found = document_kind(data, where)
    if found is None and not older:
        r.fail(f"it lacks kind {kind}")
    if found not in (None, kind):
        r.fail(f"it is a {found} document")
    return r


def read_generation_document(data, where: str = "<generation>", hint: str = "") -> dict:
    """Validate a parsed Generation JSON (``tapml generate --json``, ARCHITECTURE.md) against
    :class:`GenerationJSON` and return the fields reports use, normalized: ``target``, ``model``,
    ``device``, ``mode``, ``steps`` (``step``, ``kind`` prefill|decode, ``reference_token``,
    ``target_token``, ``max_abs_err``, ``status`` one of :data:`STEP_STATUSES`, ``message``),
    ``summary`` (recomputed from the steps, never trusted), ``culprits`` (full culprits, kind from
    :data:`CULPRIT_KINDS`, with ``graph`` and ``step``), ``programs_compiled``,
    ``upload_bytes_per_decode_step`` and ``tokens_per_s``. TapmlError naming ``where`` and the
    field when it is malformed."""
    r = _open_document(data, where, hint, "generation", "a generation document")
    m = r.check(GenerationJSON, data)
    r.values(m.summary, "summary")
    steps = [{k: v[k] for k in ("step", "kind", "reference_token", "target_token", "max_abs_err", "status", "message")}
             for v in (r.values(st, f"steps[{i}]") for i, st in enumerate(m.steps))]
    counts = {st: sum(x["status"] == st for x in steps) for st in STEP_STATUSES}
    failing = [x["step"] for x in steps if x["status"] in ("mismatch", "error")]
    culprits = []
    for i, c in enumerate(m.culprits):
        v = r.values(c, f"culprits[{i}]")
        culprits.append(Culprit(kind=v["kind"], op=v["op"], ops=[v["op"]], node=v["node"],
                                nodes=v["nodes"] or ([v["node"]] if v["node"] else []), module=v["module"],
                                max_abs_err=v["max_abs_err"], message=v["message"], graph=v["graph"],
                                step=v["step"]).to_json())
    rates = m.tokens_per_s or RatesJSON()
    return {"target": m.target, "model": m.model, "device": _device(r, m.device), "mode": m.mode,
            "steps": steps, "culprits": culprits,
            "summary": {"steps": len(steps), "pass": counts["pass"], "mismatch": counts["mismatch"],
                        "near_tie": counts["near-tie"], "error": counts["error"],
                        "first_failure": failing[0] if failing else None},
            "programs_compiled": m.programs_compiled, "upload_bytes_per_decode_step": m.upload_bytes_per_decode_step,
            "tokens_per_s": {"target": rates.target, "reference": rates.reference}}


def is_generation_document(data) -> bool:
    """Whether parsed JSON claims to be a Generation JSON (``kind`` generation; an older one without
    ``kind``: ``steps`` and no verdict ``cases``)."""
    return _claims(data, "generation")


def _claims(data, kind: str) -> bool:
    try:
        return document_kind(data) == kind
    except TapmlError:
        return False


# --- the precision document ----------------------------------------------------------------

#: Statuses of a precision document's end-to-end runs.
END_TO_END_STATUSES = ("pass", "mismatch", "error")


class PrecisionOpJSON(Written):
    """One node of a precision analysis: its range and error against fp64 and float32."""

    op: Str
    node: Annotated[Str, Field(min_length=1)]
    module: Str | None = ""
    overflow: Bool = False
    absorbed: Bool = False
    max_abs: NonNegative | None = None
    headroom: Annotated[Number, Field(gt=0)] | None = None
    err_vs_fp64: NonNegative | None = None
    ref_err_vs_fp64: NonNegative | None = None
    err_vs_fp32: NonNegative | None = None


class PrecisionRunJSON(Written):
    """One end-to-end run of a precision analysis."""

    status: Literal[END_TO_END_STATUSES]
    max_abs_err: Number | None = None
    max_rel_err: Number | None = None
    message: Str | None = ""


class PrecisionRunsJSON(Written):
    """The end-to-end runs before and after nodes were kept in float32."""

    before: PrecisionRunJSON
    after: PrecisionRunJSON


class CauseJSON(Written):
    """The op that fails end to end in the low dtype."""

    op: Str
    node: Str
    module: Str | None = ""
    err_vs_fp64: NonNegative
    ref_err_vs_fp64: NonNegative
    ratio: NonNegative
    message: Str | None = ""


class QuantizedLayerJSON(Written):
    """One quantized linear or embedding: the SQNR of its output against the float model's (null:
    not defined, the outputs equal or the float one zero)."""

    module: Str
    kind: Literal["linear", "embedding"]
    sqnr_db: Number | None = None


class QuantizedBytesJSON(Written):
    """Bytes of a quantized model's weights: ``packed`` (codes and scales), ``float`` (everything
    left in float), ``float_of_packed`` (what the packed weights took in float)."""

    packed: Count
    float: Count
    float_of_packed: Count


class PerplexityJSON(Written):
    """Perplexity of the float and of the quantized model on the tokens (null: fewer than 2)."""

    float: NonNegative | None = None
    quantized: NonNegative | None = None


class QuantizationJSON(Written):
    """``quantization`` of a Precision JSON (``tapml precision --quantize``): the quantized
    model's quality against the float model, never a verdict (tapml/driving/quantization.py)."""

    scheme: Literal[QUANT_SCHEMES]
    reference: Str
    tokens: Count
    text: Bool = False
    layers: list[QuantizedLayerJSON]
    mean_kl: NonNegative
    max_kl: NonNegative
    top1_agreement: Annotated[Number, Field(ge=0, le=1)]
    weight_bytes: QuantizedBytesJSON
    perplexity: PerplexityJSON | None = None


class PrecisionJSON(Written):
    """The Precision JSON of ``tapml precision --json``."""

    format_version: Count = 0
    model: Str | None = ""
    dtype: Literal[PRECISION_DTYPES]
    target: Str
    device: DeviceJSON | None = None
    ops: list[PrecisionOpJSON]
    keep_float32: list[Str]
    keep_float32_modules: list[Str] = []
    rounds: Count | None = 0
    end_to_end: PrecisionRunsJSON
    cause: CauseJSON | None = None
    quantization: QuantizationJSON | None = None


def read_precision_document(data, where: str = "<precision>", hint: str = "") -> dict:
    """Validate a parsed Precision JSON (``tapml precision --json``, ARCHITECTURE.md) against
    :class:`PrecisionJSON` and return it normalized: ``format_version``, ``model``, ``dtype``
    (float16|bfloat16), ``target``, ``device``, ``ops`` (``op`` from the op vocabulary, ``node``
    unique, ``module``, ``max_abs`` >= 0, ``headroom`` > 0, ``overflow``/``absorbed`` booleans,
    ``absorbed`` only where ``overflow``, ``err_vs_fp64``/``ref_err_vs_fp64``/``err_vs_fp32`` >= 0
    or null), ``keep_float32`` (names of nodes in ``ops``), ``keep_float32_modules``, ``rounds``
    and ``end_to_end`` (``before``/``after``: ``status`` pass|mismatch|error, ``max_abs_err``,
    ``max_rel_err``, ``message``), and ``cause`` where present (``op``, ``node`` of ``ops``,
    ``module``, ``err_vs_fp64``, ``ref_err_vs_fp64``, ``ratio`` >= 0, ``message``). TapmlError
    naming ``where`` and the field when it is malformed."""
    from tapml.ops import check_op
    r = _open_document(data, where, hint, "precision", "a precision document")
    version = data.get("format_version", 0)
    if type(version) is int and version > PRECISION_FORMAT_VERSION:
        r.fail(f"format_version {version} is newer than this tapml reads ({PRECISION_FORMAT_VERSION}); upgrade tapml")
    m = r.check(PrecisionJSON, data)
    ops, nodes = [], set()
    for i, x in enumerate(m.ops):
        try:
            check_op(x.op)
        except ValueError as e:
            r.fail(f"ops[{i}].op: {e}")
        if x.node in nodes:
            r.fail(f"ops[{i}].node {x.node[:80]!r} appears twice")
        nodes.add(x.node)
        if x.absorbed and not x.overflow:
            r.fail(f"ops[{i}].absorbed is true but overflow is false (an absorbed value is one that overflowed)")
        v = r.values(x, f"ops[{i}]")
        ops.append({k: v[k] for k in ("op", "node", "module", "overflow", "absorbed", "max_abs", "headroom",
                                      "err_vs_fp64", "ref_err_vs_fp64", "err_vs_fp32")})
    unknown = [k for k in m.keep_float32 if k not in nodes]
    if unknown:
        r.fail(f"keep_float32 names {unknown[0][:80]!r}, which is not a node of ops")
    v = r.values(m)
    runs = {k: {key: run[key] for key in ("status", "max_abs_err", "max_rel_err", "message")}
            for k, run in (("before", r.values(m.end_to_end.before, "end_to_end.before")),
                           ("after", r.values(m.end_to_end.after, "end_to_end.after")))}
    doc = {"format_version": m.format_version, "model": v["model"], "dtype": m.dtype, "target": m.target,
           "device": _device(r, m.device), "ops": ops, "keep_float32": m.keep_float32,
           "keep_float32_modules": m.keep_float32_modules, "rounds": v["rounds"], "end_to_end": runs}
    if m.cause is not None:
        if m.cause.node not in nodes:
            r.fail(f"cause.node {m.cause.node[:80]!r} is not a node of ops")
        c = r.values(m.cause, "cause")
        doc["cause"] = {k: c[k] for k in ("op", "node", "module", "err_vs_fp64", "ref_err_vs_fp64", "ratio", "message")}
    if m.quantization is not None:
        doc["quantization"] = m.quantization.model_dump()
    return doc


def is_precision_document(data) -> bool:
    """Whether parsed JSON claims to be a Precision JSON (``kind`` precision; an older one without
    ``kind``: ``keep_float32`` and ``ops`` and no verdict ``cases``)."""
    return _claims(data, "precision")


# --- the preflight document ----------------------------------------------------------------

def read_preflight_document(data, where: str = "<preflight>", hint: str = "") -> dict:
    """Validate a parsed Preflight JSON (``tapml inspect STORE --target T --json``, ARCHITECTURE.md)
    against :class:`PreflightJSON` and return what reports show, normalized: ``target``, ``model``,
    ``store``, ``device``, ``limits`` (name -> integer), ``forced_limits``, ``loop_cap``, ``ops``
    (``op``, ``cases``, ``kernels``, ``largest_binding``, ``splits`` and ``violations`` each
    ``{message, cases, bytes|limit}``, ``unsupported``/``errors`` each ``{reason, cases}``,
    ``fits`` recomputed) and ``summary`` (recomputed from the ops, never trusted). TapmlError
    naming the field otherwise."""
    r = _open_document(data, where, hint, "preflight", "a preflight document")
    m = r.check(PreflightJSON, data)
    ops = []
    for i, x in enumerate(m.ops):
        v = r.values(x, f"ops[{i}]")
        entry = {k: v[k] for k in ("op", "cases", "kernels", "largest_binding")}
        entry["int64_two_words"] = v.get("int64_two_words") or 0
        for key in ("splits", "violations", "unsupported", "errors"):
            keys = ("cases", "message", "limit", "bytes") if key in ("splits", "violations") else ("cases", "reason")
            entry[key] = [{k: f[k] for k in keys}
                          for f in (r.values(y, f"ops[{i}].{key}[{j}]") for j, y in enumerate(v[key]))]
        entry["fits"] = not (entry["violations"] or entry["unsupported"] or entry["errors"])
        ops.append(entry)
    v = r.values(m)
    return {"target": m.target, "model": v["model"], "store": v["store"], "device": _device(r, m.device),
            "limits": dict(m.limits or {}), "forced_limits": dict(m.forced_limits or {}), "loop_cap": m.loop_cap,
            "ops": ops,
            "summary": {"ops": len(ops), "cases": sum(x["cases"] for x in ops),
                        **{f"ops_{k}": sum(bool(x[key]) for x in ops) for k, key in
                           (("split", "splits"), ("over_limit", "violations"), ("unsupported", "unsupported"),
                            ("error", "errors"))},
                        "fits": all(x["fits"] for x in ops)}}


# --- the bench document --------------------------------------------------------------------

#: Most figures a bench report lists (a suite's document has a few hundred).
MAX_BENCH_FIGURES = 2000


class GoalJSON(Written):
    """One goal of a benchmark: what it asks for, the value measured and whether it was met."""

    goal: Str | None = ""
    value: Number | None = None
    met: Bool | None = None


class BenchJSON(Written):
    """What a Bench JSON (``tapml bench --json`` and its subcommands) has in common: the rest
    differs by subcommand and is listed as figures. A goal that is not an object is a
    subcommand's bound, listed with the figures."""

    target: Str | None = ""
    goals: dict[Str, Any] | None = None
    passed: Bool | None = None


def read_bench_document(data, where: str = "<bench>", hint: str = "") -> dict:
    """Validate a parsed Bench JSON (``tapml bench --json`` and its subcommands; each measures other
    things) against :class:`BenchJSON` and return what reports show: ``target``, ``figures`` (every
    number, flag and short text as ``{"name": dotted path, "value"}``, in document order),
    ``goals`` (``{"name", "goal", "value", "met"}`` from its ``goals`` where they are objects) and
    ``passed`` (its ``passed``, None when it has none). TapmlError naming the field otherwise."""
    r = _open_document(data, where, hint, "bench", "a bench document", older=False)
    m = r.check(BenchJSON, data)
    figures: list[dict] = []

    def walk(value, path: str) -> None:
        if len(figures) >= MAX_BENCH_FIGURES:
            return
        if isinstance(value, dict):
            for k, v in value.items():
                walk(v, f"{path}.{k}" if path else str(k))
        elif isinstance(value, list):
            for i, v in enumerate(value):
                walk(v, f"{path}[{i}]")
        elif value is None or isinstance(value, (bool, int, float, str)):
            if isinstance(value, float) and not math.isfinite(value):
                r.fail(f"{path} is not a finite number")
            figures.append({"name": path, "value": value[:200] if isinstance(value, str) else value})

    walk({k: v for k, v in data.items() if k not in ("kind", "format_version", "goals")}, "")
    goals = []
    for name, g in (m.goals or {}).items():
        if isinstance(g, dict):
            path = f"goals.{name}"[:120]
            v = r.values(r.check(GoalJSON, g, path), path)
            goals.append({"name": name, "goal": v["goal"], "value": v["value"], "met": v["met"]})
    return {"target": r.values(m)["target"], "figures": figures, "goals": goals, "passed": m.passed}


# --- journal records -----------------------------------------------------------------------

def journal_record(key, record, where: str, hint: str):
    """The typed record of a journal line: ``device`` -> the device dict (:class:`DeviceJSON`),
    ``case:ID`` -> a :class:`CaseVerdict` with that id, ``unit:ID`` -> a :class:`UnitVerdict` with
    that id; every field the writer writes must be there. TapmlError (naming ``where`` and the
    record's field) otherwise."""
    r = _Reader(where, True, hint)  # the key is a string: the line's schema (JournalRecordLineJSON) said so
    _check_depth(record, r)
    if key == "device":
        return _device(r, r.check(DeviceJSON, record, "record"), "record")
    kind, _, ident = key.partition(":")
    cls = {"case": CaseVerdict, "unit": UnitVerdict}.get(kind)
    if cls is None or not ident:
        r.fail(f"key {key[:80]!r} is not device, case:ID or unit:ID")
    verdict = cls._read(r, r.check(cls.JSON, record, "record"), "record")
    if verdict.id != ident:
        r.fail(f"record {key[:80]!r} holds the verdict of {verdict.id[:80]!r}")
    return verdict
