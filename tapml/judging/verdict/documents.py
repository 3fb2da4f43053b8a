"""The verdict documents: the Verdict JSON (:class:`VerdictDocument`), migration states
(:class:`MigrationState`), the Generation and Precision JSON readers and journal records, each
validated field by field on read (these files may come from anyone, SECURITY.md)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from tapml.dtypes import MODEL_DTYPES
from tapml.errors import TapmlError
from tapml.io import read_json_file
from tapml.judging.verdict.kinds import KINDS, STATE_KEYS, document_kind, stamp
from tapml.judging.verdict.reading import MAX_COUNT, _MISSING, _a, _check_depth, _Ctx, _Obj, _scalar
from tapml.judging.verdict.results import (CULPRIT_KINDS, GRAPH_KINDS, STATUSES, CaseVerdict, Culprit, EndToEnd, UnitVerdict,
                                   passed, summary)

#: Version of the verdict and state documents this tapml writes (older files have none: 0).
FORMAT_VERSION = KINDS["verdict"]["format_version"]
#: The ``format`` key of migration states (and of their journal's header).
STATE_FORMAT = "tapml-migration/1"
STAGES = ("op", "region", "model", "done", "session")
#: Where a node runs (tapml.driving.hybrid's TARGET and REFERENCE).
PLACES = ("target", "reference")


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
        """Validate a parsed Verdict JSON or migration state (a MigrationState when it is one);
        TapmlError naming ``where`` and the field when it is malformed. ``strict``: every key
        the writer always writes must be there (for resuming)."""
        ctx = _Ctx(where, strict, hint)
        o = _Obj(data, ctx, "", "a verdict file", top=True)
        _check_depth(data, ctx)
        version = o.count("format_version", 0)
        if version > FORMAT_VERSION:
            o.fail(f"format_version {version} is newer than this tapml reads ({FORMAT_VERSION}); upgrade tapml")
        kind = document_kind(data, where)
        if kind not in (None, "verdict", "migration-state"):
            o.fail(f"it is a {kind} document, not a verdict file or migration state")
        if kind is None:  # an older document (kinds.FALLBACK_RULES): a state has one of the state's keys
            kind = "migration-state" if any(k in o.data for k in STATE_KEYS) else "verdict"
        migration = cls is MigrationState or (cls is VerdictDocument and kind == "migration-state")
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



def _open_document(data, where: str, hint: str, what: str, kind: str, noun: str, older: bool = True):
    """``(ctx, top object)`` of a parsed document that must be of ``kind`` (strict reading, depth
    checked): another kind fails saying it is no ``noun``; ``older``: one without a kind (written
    before kinds, read by the fallback rules) is taken too."""
    ctx = _Ctx(where, True, hint)
    _check_depth(data, ctx)
    o = _Obj(data, ctx, "", what, top=True)
    found = document_kind(data, where)
    if found is None and not older:
        o.fail(f"it lacks kind {kind}")
    if found not in (None, kind):
        o.fail(f"it is a {found} document, not {noun}")
    return ctx, o


def read_generation_document(data, where: str = "<generation>", hint: str = "") -> dict:
    """Validate a parsed Generation JSON (``tapml generate --json``, ARCHITECTURE.md) and return
    the fields reports use, normalized: ``target``, ``model``, ``device``, ``mode``, ``steps``
    (``step``, ``kind`` prefill|decode, ``reference_token``, ``target_token``, ``max_abs_err``,
    ``status`` one of :data:`STEP_STATUSES`, ``message``), ``summary`` (recomputed from the steps,
    never trusted), ``culprits`` (full culprits, kind from :data:`CULPRIT_KINDS`, with ``graph``
    and ``step``), ``programs_compiled``, ``upload_bytes_per_decode_step`` and ``tokens_per_s``.
    TapmlError naming ``where`` and the field when it is malformed."""
    ctx, o = _open_document(data, where, hint, "a generation document", "generation", "a generation")
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
    """Whether parsed JSON claims to be a Generation JSON (``kind`` generation; an older one without
    ``kind``: ``steps`` and no verdict ``cases``)."""
    return _claims(data, "generation")


def _claims(data, kind: str) -> bool:
    try:
        return document_kind(data) == kind
    except TapmlError:
        return False


# --- the precision document ----------------------------------------------------------------

#: Version of the precision document (``tapml precision --json``) this tapml writes and reads.
PRECISION_FORMAT_VERSION = KINDS["precision"]["format_version"]
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
    ctx, o = _open_document(data, where, hint, "a precision document", "precision", "a precision analysis")
    version = o.count("format_version", 0)
    if version > PRECISION_FORMAT_VERSION:
        o.fail(f"format_version {version} is newer than this tapml reads ({PRECISION_FORMAT_VERSION}); upgrade tapml")
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
    """Whether parsed JSON claims to be a Precision JSON (``kind`` precision; an older one without
    ``kind``: ``keep_float32`` and ``ops`` and no verdict ``cases``)."""
    return _claims(data, "precision")


# --- the preflight document ----------------------------------------------------------------

def read_preflight_document(data, where: str = "<preflight>", hint: str = "") -> dict:
    """Validate a parsed Preflight JSON (``tapml inspect STORE --target T --json``, ARCHITECTURE.md)
    and return what reports show, normalized: ``target``, ``model``, ``store``, ``device``,
    ``limits`` (name -> integer), ``forced_limits``, ``loop_cap``, ``ops`` (``op``, ``cases``,
    ``kernels``, ``largest_binding``, ``splits`` and ``violations`` each ``{message, cases,
    bytes|limit}``, ``unsupported``/``errors`` each ``{reason, cases}``, ``fits`` recomputed) and
    ``summary`` (recomputed from the ops, never trusted). TapmlError naming the field otherwise."""
    ctx, o = _open_document(data, where, hint, "a preflight document", "preflight", "a preflight")

    def limits(key: str) -> dict:
        lim = o.child(key, "an object of device limits (name -> integer)")
        return {} if lim is None else {k: lim.count(k, required=True) for k in lim.data}

    if not isinstance(o._get("ops", _MISSING, True), list):
        o._bad("ops", o.data["ops"], "a list")
    ops = []
    for i, item in enumerate(o.data["ops"]):
        x = _Obj(item, ctx, f"ops[{i}]", "a preflight op")
        entry = {"op": x.string("op", required=True), "cases": x.count("cases", 0), "kernels": x.count("kernels", 0),
                 "largest_binding": x.count("largest_binding", 0)}
        for key in ("splits", "violations", "unsupported", "errors"):
            found = x.data.get(key, [])
            if not isinstance(found, list):
                x._bad(key, found, "a list")
            rows = []
            for j, it in enumerate(found):
                y = _Obj(it, ctx, f"ops[{i}].{key}[{j}]", "a preflight finding")
                row = {"cases": y.count("cases", 1)}
                if key in ("splits", "violations"):
                    row["message"] = y.string("message", "") or ""
                    row["limit"] = y.string("limit", None)
                    row["bytes"] = y.count("bytes", None)
                else:
                    row["reason"] = y.string("reason", "") or ""
                rows.append(row)
            entry[key] = rows
        entry["fits"] = not (entry["violations"] or entry["unsupported"] or entry["errors"])
        ops.append(entry)
    return {"target": o.string("target", required=True), "model": o.string("model", "") or "",
            "store": o.string("store", "") or "", "device": _device(o), "limits": limits("limits"),
            "forced_limits": limits("forced_limits"), "loop_cap": o.count("loop_cap", None), "ops": ops,
            "summary": {"ops": len(ops), "cases": sum(x["cases"] for x in ops),
                        **{f"ops_{k}": sum(bool(x[key]) for x in ops) for k, key in
                           (("split", "splits"), ("over_limit", "violations"), ("unsupported", "unsupported"),
                            ("error", "errors"))},
                        "fits": all(x["fits"] for x in ops)}}


# --- the bench document --------------------------------------------------------------------

#: Most figures a bench report lists (a suite's document has a few hundred).
MAX_BENCH_FIGURES = 2000


def read_bench_document(data, where: str = "<bench>", hint: str = "") -> dict:
    """Validate a parsed Bench JSON (``tapml bench --json`` and its subcommands; each measures other
    things) and return what reports show: ``target``, ``figures`` (every number, flag and short
    text as ``{"name": dotted path, "value"}``, in document order), ``goals`` (``{"name", "goal",
    "value", "met"}`` from its ``goals`` where they have that form) and ``passed`` (its ``passed``,
    None when it has none). TapmlError naming the field otherwise."""
    ctx, o = _open_document(data, where, hint, "a bench document", "bench", "a bench document", older=False)
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
                o.fail(f"{path} is not a finite number")
            figures.append({"name": path, "value": value[:200] if isinstance(value, str) else value})

    walk({k: v for k, v in o.data.items() if k not in ("kind", "format_version", "goals")}, "")
    goals = []
    g = o.child("goals", "an object of goals")
    for name in (g.data if g is not None else {}):
        if not isinstance(g.data[name], dict):
            continue  # a subcommand's goals are its bounds alone; the report's figures list them
        x = _Obj(g.data[name], ctx, f"goals.{name}"[:120], "a goal ({goal, value, met})")
        met = x.data.get("met")
        if met is not None and not isinstance(met, bool):
            x._bad("met", met, "true, false or null")
        goals.append({"name": name, "goal": x.string("goal", "") or "", "value": x.number("value"), "met": met})
    passed = o.data.get("passed")
    if passed is not None and not isinstance(passed, bool):
        o._bad("passed", passed, "true, false or null")
    return {"target": o.string("target", "") or "", "figures": figures, "goals": goals, "passed": passed}


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



# --- the documents' fields ------------------------------------------------------------------

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
