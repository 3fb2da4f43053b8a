"""Loading the documents tapml writes into one model that every report format renders.

A file is read by its ``kind`` (ARCHITECTURE.md "Documents"; an older file without one by the key
rules of :data:`tapml.judging.verdict.FALLBACK_RULES`): a Verdict JSON from ``tapml replay --json``, a
migration state from ``tapml migrate --state`` (a Verdict JSON plus ``units``, ``placement``,
``culprits`` and ``end_to_end``), a document holding one of them per target (``replay``/``migrate``
with several ``--target``, :func:`matrix_document`), a fleet, a generation, a precision analysis,
a preflight or a benchmark (:data:`READERS`). Optional keys may be missing; a file that is not
such a document, or one with a field of the wrong type, raises :class:`~tapml.errors.TapmlError`
naming the file and the field (the schema is :mod:`tapml.judging.verdict`'s).

Example::

    states = load_states(["gpt2-vulkan.json", "gpt2-gl.json"])
    states[0].failures[0]["op"]      # the culprit the report puts at the top
    coverage_matrix(states)          # op -> status and worst error on every target
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from tapml.errors import TapmlError
from tapml.judging.verdict import (KINDS, document_kind, stamp, CULPRIT_KINDS, JUDGE_KEYS, NEAR_FAILING, STAT_KEYS, STATUSES, MigrationState, VerdictDocument,
                           passed, read_bench_document, read_generation_document, read_preflight_document,
                           read_precision_document, summary)

#: Order of culprit kinds at the top of a report: the most specific finding first.
KIND_ORDER = {kind: i for i, kind in enumerate(CULPRIT_KINDS)}


@dataclass
class StateReport:
    """One replay verdict or migration state, normalized: every case and unit has every key."""

    path: str
    kind: str  # "migration", "replay", "generation", "precision" or "preflight"
    target: str
    model: str
    device: dict
    cases: list[dict]
    units: list[dict] = field(default_factory=list)
    culprits: list[dict] = field(default_factory=list)
    placement: dict = field(default_factory=dict)
    end_to_end: dict | None = None
    tolerances: dict = field(default_factory=dict)
    reference: dict = field(default_factory=dict)
    stage: str | None = None
    complete: bool = True
    inject: list[str] = field(default_factory=list)
    display: str = ""
    #: A generation (``tapml generate --json``): its steps, summary, programs_compiled, uploads
    #: and tokens/s (:func:`tapml.judging.verdict.read_generation_document`); None for other documents.
    generation: dict | None = None
    #: A precision analysis (``tapml precision --json``, :func:`tapml.judging.verdict.read_precision_document`);
    #: None for other documents.
    precision: dict | None = None
    #: A float16/bfloat16 migration's placement by dtype (``precision`` of the state: ``dtype``,
    #: ``keep_float32``, ``casts``, and ``decode`` in a generation); None otherwise.
    dtype_placement: dict | None = None
    #: A preflight (``tapml inspect STORE --target T --json``, :func:`tapml.judging.verdict.read_preflight_document`):
    #: what splits and what is over a device limit, per op; None for other documents.
    preflight: dict | None = None
    #: A benchmark (``tapml bench --json``, :func:`tapml.judging.verdict.read_bench_document`): its
    #: figures, goals and verdict; None for other documents.
    bench: dict | None = None

    @property
    def has_cases(self) -> bool:
        """Whether the document has carved cases to put in an op-coverage matrix (a precision
        analysis and a preflight have none)."""
        return self.precision is None and self.preflight is None and self.bench is None

    @property
    def label(self) -> str:
        """A short name for columns and headings: the target, plus the file when targets repeat."""
        return self.display or self.target

    @property
    def summary(self) -> dict:
        return summary(self.cases)

    @property
    def passed(self) -> bool:
        """:func:`tapml.judging.verdict.passed`: every case passed, nothing was blamed, and the end-to-end
        check passed (a migration needs one; a replay has none). A generation passed when no step
        mismatched or failed (near-ties are reported, not failures)."""
        if self.generation is not None:
            g = self.generation["summary"]
            return g["mismatch"] == 0 and g["error"] == 0
        if self.precision is not None:
            return self.precision["end_to_end"]["after"]["status"] == "pass"
        if self.preflight is not None:
            return self.preflight["summary"]["fits"]
        if self.bench is not None:
            return self.bench["passed"] is not False and all(g["met"] is not False for g in self.bench["goals"])
        return passed(self.cases, self.culprits, self.end_to_end, needs_end_to_end=self.kind == "migration")

    @property
    def shares(self) -> dict:
        """Share of ops and FLOPs on the target. A replay has no placement: its op share is the
        share of op calls (instances) whose case passed, and its FLOP share is unknown."""
        p = self.placement
        if "ops_share" in p:
            return {"ops_share": p.get("ops_share"), "flops_share": p.get("flops_share"),
                    "ops_on_target": p.get("ops_on_target"), "ops_total": p.get("ops_total"),
                    "flops_on_target": p.get("flops_on_target"), "flops_total": p.get("flops_total"),
                    "basis": "placement"}
        total = sum(c["instances"] for c in self.cases)
        good = sum(c["instances"] for c in self.cases if c["status"] == "pass")
        return {"ops_share": good / total if total else None, "flops_share": None,
                "ops_on_target": good, "ops_total": total, "flops_on_target": None, "flops_total": None,
                "basis": "passing cases"}

    @property
    def failures(self) -> list[dict]:
        """What went wrong, culprits first (most specific kind, then largest error), each with
        its evidence's worst elements. A replay verdict has no culprits: its failing cases are."""
        by_case = {c["id"]: c for c in self.cases}
        by_unit = {u["id"]: u for u in self.units}
        out = []
        for i, c in enumerate(self.culprits):
            evidence = _evidence(c, by_case, by_unit)
            out.append({"culprit": True, "rank": i, "kind": c["kind"], "op": c["op"], "ops": c["ops"],
                        "node": c["node"], "nodes": c["nodes"], "module": c["module"], "status": c["status"],
                        "message": c["message"] or (evidence or {}).get("message", ""),
                        "unit": c.get("unit") or "", "region": c.get("region"),
                        **_stats({"status": c["status"],
                                  **{k: c[k] if c[k] is not None else (evidence or {}).get(k) for k in STAT_KEYS}}),
                        "worst": list((evidence or {}).get("worst") or c["worst"]),
                        **{k: c.get(k) if c.get(k) is not None else (evidence or {}).get(k) for k in JUDGE_KEYS}})
        out.sort(key=lambda f: (KIND_ORDER.get(f["kind"], 9), -_sortable(f["max_abs_err"]), f["rank"]))
        blamed = {f["op"] for f in out} | {op for f in out for op in f["ops"]}
        for c in self.cases:
            if c["status"] == "pass" or (self.culprits and c["op"] in blamed):
                continue
            kind = "op" if c["status"] == "mismatch" else c["status"]
            out.append({"culprit": not self.culprits, "rank": len(out), "kind": kind, "op": c["op"],
                        "ops": [c["op"]], "node": c["node"], "nodes": [c["node"]], "module": c["module"],
                        "status": c["status"], "message": c["message"], "unit": f"case:{c['id']}", "region": None,
                        **{k: c[k] for k in STAT_KEYS}, "worst": c["worst"], **{k: c.get(k) for k in JUDGE_KEYS}})
        if not self.culprits:
            status_rank = {"error": 0, "mismatch": 1, "unsupported": 2}
            out.sort(key=lambda f: (status_rank.get(f["status"], 3), -_sortable(f["max_abs_err"])))
        return out

    @property
    def decode_units(self) -> list[dict]:
        """The units of a generation store's decode pass (``graph`` decode), in order."""
        return [u for u in self.units if u.get("graph") == "decode"]

    @property
    def culprit_modules(self) -> set[str]:
        """Module paths of the culprits, including those of the blamed op's other nodes."""
        blamed = [f for f in self.failures if f["culprit"]]
        modules = {f["module"] for f in blamed if f["module"]}
        nodes = {n for f in blamed for n in f["nodes"]}
        modules |= {u["module"] for u in self.units if u["kind"] == "op" and u["nodes"] and set(u["nodes"]) <= nodes}
        return modules

    def op_times(self) -> list[dict]:
        """Per-op time on the target: cases, calls, mean ms per call and estimated ms per model
        run (case time × instances), largest first."""
        rows: dict[str, dict] = {}
        for c in self.cases:
            r = rows.setdefault(c["op"], {"op": c["op"], "cases": 0, "instances": 0, "timed": 0,
                                          "ms_per_model": 0.0, "ms_sum": 0.0, "statuses": set()})
            r["cases"] += 1
            r["instances"] += c["instances"]
            r["statuses"].add(c["status"])
            if c["time_ms"] is not None:
                r["timed"] += 1
                r["ms_sum"] += c["time_ms"]
                r["ms_per_model"] += c["time_ms"] * c["instances"]
        total = sum(r["ms_per_model"] for r in rows.values()) or 1.0
        out = []
        for r in rows.values():
            out.append({"op": r["op"], "cases": r["cases"], "instances": r["instances"],
                        "mean_ms": r["ms_sum"] / r["timed"] if r["timed"] else None,
                        "ms_per_model": r["ms_per_model"] if r["timed"] else None,
                        "share": r["ms_per_model"] / total, "status": _worst_status(r["statuses"])})
        out.sort(key=lambda r: (-(r["ms_per_model"] or 0.0), r["op"]))
        return out

    def op_speeds(self) -> list[dict]:
        """Per-op speed of a profiled replay (:func:`op_speeds`); empty when it was not profiled."""
        return op_speeds(self.cases)

    def module_errors(self) -> list[dict]:
        """Error per module along the depth of the model: one point per module that runs ops of
        its own (or has no sub-modules), in the order the model first runs it, with the
        largest error of its cases and of its op and region checks."""
        order = {n: i for i, n in enumerate(self.placement.get("nodes") or {})}
        points: dict[str, dict] = {}

        def point(module: str, first: float) -> dict:
            p = points.setdefault(module, {"module": module, "max_abs_err": None, "status": "pass", "ops": set(),
                                           "checks": 0, "first": first, "direct": False})
            p["first"] = min(p["first"], first)
            return p

        for i, c in enumerate(self.cases):
            p = point(c["module"], order.get(c["node"], i))
            p["direct"] = True
            p["ops"].add(c["op"])
            _fold(p, c)
        for u in self.units:
            if u["kind"] == "model" or u["role"] == "bisect":
                continue
            first = min((order[n] for n in u["nodes"] if n in order), default=len(order) + len(points))
            _fold(point(u["module"], first), u)
        paths = set(points)
        keep = [p for p in points.values()
                if p["direct"] or not any(q.startswith(p["module"] + ".") or not p["module"] for q in paths - {p["module"]})]
        keep.sort(key=lambda p: p["first"])
        culprits = self.culprit_modules
        return [{"module": p["module"], "max_abs_err": p["max_abs_err"], "status": p["status"], "ops": sorted(p["ops"]),
                 "checks": p["checks"], "depth": depth, "culprit": p["module"] in culprits}
                for depth, p in enumerate(keep)]

    def to_json(self) -> dict:
        """The normalized report data (what ``tapml report --json`` writes); non-finite numbers
        become None so that the document is strict JSON."""
        return _finite({"path": self.path, "kind": self.kind, "target": self.target, "model": self.model,
                "device": self.device, "reference": self.reference, "summary": self.summary,
                "passed": self.passed, "shares": self.shares, "end_to_end": self.end_to_end,
                "failures": self.failures, "op_times": self.op_times(),
                "module_errors": [{**m} for m in self.module_errors()],
                "cases": self.cases, "units": self.units,
                **({"generation": self.generation} if self.generation is not None else {}),
                **({"precision": self.precision, "precision_modules": precision_modules(self.precision)}
                   if self.precision is not None else {})})


def _finite(x):
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


def _fold(point: dict, check: dict) -> None:
    point["checks"] += 1
    err = check.get("max_abs_err")
    if check["status"] != "pass" and err is None:
        err = math.inf  # a NaN/Inf or shape mismatch has no finite error: show it as the worst
    if err is not None and (point["max_abs_err"] is None or err > point["max_abs_err"]):
        point["max_abs_err"] = err
    point["status"] = _worst_status({point["status"], check["status"]})


def _speed_number(x) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x >= 0 else None


def op_speeds(cases: list[dict]) -> list[dict]:
    """Per op of the profiled cases (those with ``device_ms``, ``replay --profile``): cases, the
    sum of their device ms, GFLOP/s and GB/s over that time, where the device's roofline was
    known the ``roofline_bound`` of most of the op's least time and the ``roofline_fraction`` reached
    (the sum of the cases' ``roofline_ms`` over the sum of their device ms), and against a baseline
    (cases with ``baseline_ms``) the sum of their baseline ms and the ratio of their device time
    to it; the slowest op first."""
    rows: dict[str, dict] = {}
    for c in cases:
        ms = _speed_number(c.get("device_ms"))
        if ms is None:
            continue
        r = rows.setdefault(c.get("op", "?"), {"op": c.get("op", "?"), "cases": 0, "device_ms": 0.0, "gflop": 0.0,
                                               "gbytes": 0.0, "rated": 0.0, "baseline_ms": None, "compared_ms": 0.0,
                                               "bounds": {}, "placed_ms": 0.0})
        r["cases"] += 1
        r["device_ms"] += ms
        gflops, gbps = _speed_number(c.get("gflops")), _speed_number(c.get("gbps"))
        if gflops is not None and gbps is not None:
            r["gflop"] += gflops * ms / 1e3
            r["gbytes"] += gbps * ms / 1e3
            r["rated"] += ms
        bound, bound_ms = c.get("roofline_bound"), _speed_number(c.get("roofline_ms"))
        if isinstance(bound, str) and bound_ms is not None:
            r["bounds"][bound] = r["bounds"].get(bound, 0.0) + bound_ms
            r["placed_ms"] += ms
        base = _speed_number(c.get("baseline_ms"))
        if base is not None:
            r["baseline_ms"] = (r["baseline_ms"] or 0.0) + base
            r["compared_ms"] += ms
    out = []
    for r in rows.values():
        per_s = 1e3 / r["rated"] if r["rated"] > 0 else None
        base = r["baseline_ms"]
        out.append({"op": r["op"], "cases": r["cases"], "device_ms": r["device_ms"],
                    "gflops": None if per_s is None else r["gflop"] * per_s,
                    "gbps": None if per_s is None else r["gbytes"] * per_s, "baseline_ms": base,
                    "roofline_bound": max(r["bounds"], key=r["bounds"].get) if r["bounds"] else None,
                    "roofline_fraction": sum(r["bounds"].values()) / r["placed_ms"] if r["placed_ms"] > 0 else None,
                    "ratio": r["compared_ms"] / base if base else None})
    out.sort(key=lambda r: (-r["device_ms"], r["op"]))
    return out


def judged(v: dict | None) -> str:
    """How a failing or near-failing verdict (margin >= :data:`~tapml.judging.verdict.NEAR_FAILING`) was
    judged: its rule, bound and margin, for reports ("" for a clear pass or an unknown rule)."""
    if not v or not v.get("rule"):
        return ""
    margin = v.get("margin")
    if v.get("status") == "pass" and (margin is None or margin < NEAR_FAILING):
        return ""
    bound = "" if v.get("bound") is None else f", bound {v['bound']:.3g}"
    return f"{v['rule']}{bound}" + ("" if margin is None else f", margin {margin:.3g}")


def _worst_status(statuses: set[str]) -> str:
    return min(statuses, key=status_rank, default="pass")


def _evidence(culprit: dict, by_case: dict, by_unit: dict) -> dict | None:
    unit = culprit.get("unit") or ""
    if unit.startswith("case:") and unit[5:] in by_case:
        return by_case[unit[5:]]
    if unit in by_unit:
        return by_unit[unit]
    if culprit.get("case") in by_case:
        return by_case[culprit["case"]]
    return None


def _sortable(x) -> float:
    return -1.0 if x is None else x


def _stats(v: dict) -> dict:
    stats = {k: v.get(k) for k in STAT_KEYS}
    if v.get("status") == "mismatch" and stats["max_abs_err"] is None:
        stats["max_abs_err"] = math.inf  # NaN/Inf where the reference is finite, or shapes differ
    return stats


def _reference_info(store: str | None, path: Path) -> dict:
    """The reference side, from the store a migration state names (when it is still there)."""
    from tapml.io import read_json_file
    info = {"device": "cpu", "torch": None, "store": store}
    if store:
        manifest = (path.parent / store if not Path(store).is_absolute() else Path(store)) / "manifest.json"
        try:
            m = read_json_file(manifest, str(manifest), follow_links=False)
        except (TapmlError, OSError, ValueError):
            return info
        if isinstance(m, dict):
            device, torch = m.get("reference_device"), m.get("torch_version")
            info.update(device=device if isinstance(device, str) and device else "cpu",
                        torch=torch if isinstance(torch, str) else None)
    return info


HINT = "expected a Verdict JSON (`tapml replay --json`) or a migration state (`tapml migrate --state`)"


def parse_state(data, path: str = "<state>") -> StateReport:
    """Normalize an already-parsed Verdict JSON or migration state; TapmlError naming the field
    when it is neither (optional keys may be missing; present ones must have their type)."""
    doc = VerdictDocument.from_json(data, path, hint=HINT)
    migration = isinstance(doc, MigrationState)

    def verdict(v) -> dict:
        return {**v.to_json(), **_stats(v.to_json())}

    device = {"adapter": "", "backend": "", "features": [], "limits": {}, "error": "", **(doc.device or {})}
    return StateReport(path=path, kind="migration" if migration else "replay", target=doc.target,
                       model=doc.model or "?", device=device, cases=[verdict(c) for c in doc.cases],
                       units=[verdict(u) for u in doc.units] if migration else [],
                       culprits=[c.to_json() for c in doc.culprits] if migration else [],
                       placement=doc.placement if migration else {},
                       end_to_end=verdict(doc.end_to_end) if migration and doc.end_to_end else None,
                       tolerances=doc.tolerances, reference=_reference_info(doc.store if migration else None, Path(path)),
                       stage=doc.stage if migration else None, complete=doc.complete if migration and doc.stage else True,
                       inject=doc.inject if migration else [],
                       dtype_placement=doc.precision if migration else None)


def parse_generation(data, path: str = "<generation>") -> StateReport:
    """A Generation JSON (``tapml generate --json``) as a report: no cases; its steps, culprits
    and figures in ``generation`` (validated by :func:`tapml.judging.verdict.read_generation_document`)."""
    doc = read_generation_document(data, path, "expected the JSON of `tapml generate --json`")
    device = {"adapter": "", "backend": "", "features": [], "limits": {}, "error": "", **(doc["device"] or {})}
    return StateReport(path=path, kind="generation", target=doc["target"], model=doc["model"], device=device,
                       cases=[], culprits=doc["culprits"], reference={"device": "cpu", "torch": None, "store": None},
                       generation={k: doc[k] for k in ("mode", "steps", "summary", "culprits", "programs_compiled",
                                                       "upload_bytes_per_decode_step", "tokens_per_s")})


def parse_precision(data, path: str = "<precision>") -> StateReport:
    """A Precision JSON (``tapml precision --json``) as a report: no cases; the analysis in
    ``precision`` (validated by :func:`tapml.judging.verdict.read_precision_document`)."""
    doc = read_precision_document(data, path, "expected the JSON of `tapml precision --json`")
    device = {"adapter": "", "backend": "", "features": [], "limits": {}, "error": "", **(doc["device"] or {})}
    return StateReport(path=path, kind="precision", target=doc["target"], model=doc["model"] or "?", device=device,
                       cases=[], reference={"device": "cpu", "torch": None, "store": None}, precision=doc)


def parse_preflight(data, path: str = "<preflight>") -> StateReport:
    """A Preflight JSON (``tapml inspect STORE --target T --json``) as a report: no cases; per op
    what splits and what is over a limit in ``preflight`` (:func:`tapml.judging.verdict.read_preflight_document`)."""
    doc = read_preflight_document(data, path, "expected the JSON of `tapml inspect STORE --target T --json`")
    device = {"adapter": "", "backend": "", "features": [], "limits": {}, "error": "", **(doc["device"] or {})}
    return StateReport(path=path, kind="preflight", target=doc["target"], model=doc["model"] or "?", device=device,
                       cases=[], reference={"device": "cpu", "torch": None, "store": doc["store"] or None}, preflight=doc)


def parse_bench(data, path: str = "<bench>") -> StateReport:
    """A Bench JSON (``tapml bench --json``) as a report: no cases; its figures, goals and verdict in
    ``bench`` (:func:`tapml.judging.verdict.read_bench_document`)."""
    doc = read_bench_document(data, path, "expected the JSON of `tapml bench --json`")
    model = next((str(f["value"]) for f in doc["figures"] if f["name"] in ("model", "generation_model")), "tapml bench")
    return StateReport(path=path, kind="bench", target=doc["target"] or "?", model=model,
                       device={"adapter": "", "backend": "", "features": [], "limits": {}, "error": ""}, cases=[],
                       reference={"device": "cpu", "torch": None, "store": None}, bench=doc)


def bench_line(doc: dict) -> str:
    """A benchmark's verdict in words: how many figures and goals, which goals were missed."""
    missed = [g["name"] for g in doc["goals"] if g["met"] is False]
    verdict = ("passed" if doc["passed"] else "did not pass") if doc["passed"] is not None else "no verdict"
    return (f"{len(doc['figures'])} figures, {len(doc['goals'])} goals"
            + (f", missed: {', '.join(missed)}" if missed else "") + f"; {verdict}")


def preflight_line(doc: dict) -> str:
    """A preflight's verdict in words: ``"6 ops, 10 cases: 1 op split, 1 op over a device limit"``,
    ``"... everything fits"``."""
    sm = doc["summary"]
    parts = [f"{sm[f'ops_{k}']} op{'s' * (sm[f'ops_{k}'] != 1)} {what}" for k, what in
             (("split", "split"), ("over_limit", "over a device limit"), ("unsupported", "unsupported"),
              ("error", "failing to compile")) if sm[f"ops_{k}"]]
    return f"{sm['ops']} ops, {sm['cases']} cases on {doc['target']}: " + (", ".join(parts) or "nothing split, everything fits")


def preflight_findings(op: dict) -> list[str]:
    """What a preflight found in one op, one phrase each: splits, limits gone over, unsupported, errors."""
    return ([f"split: {x['message']} ({x['cases']} cases)" for x in op["splits"]]
            + [f"over {x['limit']}: {x['message']} ({x['cases']} cases)" for x in op["violations"]]
            + [f"unsupported: {x['reason']} ({x['cases']} cases)" for x in op["unsupported"]]
            + [f"error: {x['reason']} ({x['cases']} cases)" for x in op["errors"]])


def precision_modules(doc: dict) -> list[dict]:
    """A precision document's ops grouped by module along the depth of the model (in the order
    the model first runs each module): ``module``, ``depth``, ``ops`` (how many), ``max_abs``
    (largest), ``headroom`` (smallest), ``overflow``/``absorbed``/``kept`` (how many ops),
    ``err_vs_fp64`` (largest; ``inf`` when an op's error is unbounded: it overflowed)."""
    keep = set(doc["keep_float32"])
    rows: dict[str, dict] = {}
    for x in doc["ops"]:
        r = rows.setdefault(x["module"], {"module": x["module"], "depth": len(rows), "ops": 0, "max_abs": None,
                                          "headroom": None, "overflow": 0, "absorbed": 0, "kept": 0,
                                          "err_vs_fp64": None})
        r["ops"] += 1
        r["overflow"] += x["overflow"]
        r["absorbed"] += x["absorbed"]
        r["kept"] += x["node"] in keep
        if x["max_abs"] is not None:
            r["max_abs"] = x["max_abs"] if r["max_abs"] is None else max(r["max_abs"], x["max_abs"])
        if x["headroom"] is not None:
            r["headroom"] = x["headroom"] if r["headroom"] is None else min(r["headroom"], x["headroom"])
        err = math.inf if x["overflow"] and x["err_vs_fp64"] is None else x["err_vs_fp64"]
        if err is not None:
            r["err_vs_fp64"] = err if r["err_vs_fp64"] is None else max(r["err_vs_fp64"], err)
    return list(rows.values())


def step_error_points(state: StateReport) -> list[dict]:
    """A generation's steps as points of :func:`tapml.reports.plot.module_error_svg`: one per
    step, labelled ``step N kind``, near-ties shown as passing, the first failure marked."""
    g = state.generation or {"steps": [], "summary": {}}
    first = g["summary"].get("first_failure")
    return [{"module": f"step {x['step']} {x['kind']}", "max_abs_err": x["max_abs_err"],
             "status": "pass" if x["status"] == "near-tie" else x["status"], "culprit": x["step"] == first, "ops": []}
            for x in g["steps"]]


def load_state(path: str | Path) -> StateReport:
    """Read one Verdict JSON or migration state file (see :func:`parse_state`)."""
    states = load_documents(path)
    if len(states) > 1:
        raise TapmlError(f"{path} holds the verdicts of {len(states)} targets; read it with load_documents")
    return states[0]


def load_documents(path: str | Path) -> list[StateReport]:
    """The states one file holds: one for a Verdict JSON or migration state, one per target for
    a multi-target document (:func:`matrix_document`)."""
    from tapml.io import read_json_file
    p = Path(path)
    if not p.is_file():
        raise TapmlError(f"{path} does not exist; pass a file written by `tapml replay --json` or "
                         "`tapml migrate --state`")
    data = read_json_file(p, str(path), "pass a verdict or state JSON file")
    kind = document_kind(data, str(path))
    if kind == "fleet":
        return parse_fleet_document(data, str(path))
    if kind == "matrix":
        return parse_matrix_document(data, str(path))
    if kind in READERS:
        return [READERS[kind](data, str(path))]
    if kind in KINDS:
        raise TapmlError(f"{path} is a {kind} document ({KINDS[kind]['writer']}), which tapml report does not "
                         f"render; pass one of {', '.join(RENDERED)}")
    return [parse_state(data, str(path))]  # no kind tapml knows: parse_state says what is missing


#: The reader of each kind of document that is one state (fleet and matrix documents hold several).
READERS = {"verdict": parse_state, "migration-state": parse_state, "generation": parse_generation,
           "precision": parse_precision, "preflight": parse_preflight, "bench": parse_bench}
#: The kinds ``tapml report`` renders.
RENDERED = (*READERS, "matrix", "fleet")


def load_states(paths) -> list[StateReport]:
    """Read several state files (a multi-target document gives one state per target); each
    keeps its order (it becomes a column of the coverage matrix)."""
    if not paths:
        raise TapmlError("no state files given; pass one or more STATE.json files")
    states = [s for p in paths for s in load_documents(p)]
    _label_repeats(states)
    return states


def _label_repeats(states: list[StateReport]) -> None:
    """Columns must tell states of the same target apart: add the file's name where it differs."""
    targets = [s.target for s in states]
    for s in states:
        if targets.count(s.target) > 1:
            s.display = f"{s.target} ({Path(s.path).stem})"


#: Order of statuses from worst to best, for a cell that stands for several cases. Statuses a
#: later tapml adds (a reader only meets them once :data:`tapml.judging.verdict.STATUSES` has them)
#: rank between ``mismatch`` and ``unsupported``: a finding, but not a wrong number.
STATUS_RANK = {"error": 0, "mismatch": 1, "flaky": 2, "slower": 3, "unsupported": 5, "pass": 9}
#: Row groups of a coverage matrix, in the order it lists them: a case that passes on one
#: target and fails on another (what a driver or browser engineer can act on), then rows
#: failing on every target that ran them, then rows passing everywhere.
MATRIX_GROUPS = ("differs", "fails", "passes")


def status_rank(status: str) -> int:
    """Rank of ``status`` from worst (0) to best (``pass``); see :data:`STATUS_RANK`."""
    return STATUS_RANK.get(status, 4)


def coverage_matrix(states: list[StateReport], by_case: bool = False, by_model: bool = False) -> dict:
    """The op (or case) by target matrix over several states, one column per state.

    Returns ``{"labels", "columns": [{"target", "adapter", "backend"}], "rows": [{"op", "case"
    (with ``by_case``), "group", "cells": [cell | None]}], "totals", "groups"}``. A cell is
    ``{"status", "max_abs_err", "pass", "total"}``: the worst status of the row's cases on that
    target, their largest error (``inf`` for a mismatch without a finite one), how many of them
    pass; None where the target ran none of them. ``group`` is one of :data:`MATRIX_GROUPS`:
    ``differs`` when one of the row's cases passes on one target and not on another, ``fails``
    when no target passes all of them (or they fail alike everywhere), else ``passes``. Rows are
    ordered by group, then worst status, then op and case. ``totals`` count rows passing per
    column; ``groups`` count rows per group; ``rows_are`` says what a row stands for (``ops``,
    ``cases`` or ``models``). The one matrix of the terminal, JSON and HTML.
    ``by_model``: a row per model (its ``op`` is the model's label), for the per-device states of
    a fleet run (:func:`fleet_states`, whose cases carry their ``model``).

    Example::

        m = coverage_matrix(load_states(["vulkan.json", "gl.json"]))
        [r["op"] for r in m["rows"] if r["group"] == "differs"]   # ops only one target gets wrong
    """
    rows: dict[tuple, list[list[dict]]] = {}
    for i, s in enumerate(states):
        for c in s.cases:
            key = (c.get("model", "?"),) if by_model else (c["op"], c["id"]) if by_case else (c["op"],)
            rows.setdefault(key, [[] for _ in states])[i].append(c)
    out = []
    for key, per_state in rows.items():
        cells = [_cell(cases) if cases else None for cases in per_state]
        row = {"op": key[0], **({"case": key[1]} if by_case else {}), "group": _group(per_state, cells), "cells": cells}
        out.append(row)

    def order(r):
        worst = min(status_rank(c["status"]) for c in r["cells"] if c)
        return MATRIX_GROUPS.index(r["group"]), worst, r["op"], r.get("case", "")

    out.sort(key=order)
    totals = [{"pass": sum(1 for r in out if r["cells"][i] and r["cells"][i]["status"] == "pass"),
               "total": sum(1 for r in out if r["cells"][i])} for i in range(len(states))]
    return {"labels": [s.label for s in states], "rows_are": "models" if by_model else "cases" if by_case else "ops",
            "columns": [{"target": s.target, "adapter": s.device.get("adapter") or "",
                         "backend": s.device.get("backend") or ""} for s in states],
            "rows": out, "totals": totals, "groups": {g: sum(r["group"] == g for r in out) for g in MATRIX_GROUPS}}


def _cell(cases: list[dict]) -> dict:
    errors = [c["max_abs_err"] for c in cases if c["max_abs_err"] is not None]
    return {"status": min((c["status"] for c in cases), key=status_rank),
            "max_abs_err": max(errors) if errors else None,
            "pass": sum(c["status"] == "pass" for c in cases), "total": len(cases)}


def _group(per_state: list[list[dict]], cells: list) -> str:
    passing: dict[str, set[bool]] = {}
    for cases in per_state:
        for c in cases:
            passing.setdefault(c["id"], set()).add(c["status"] == "pass")
    present = [c for c in cells if c]
    whole = {c["status"] == "pass" for c in present}
    if any(len(p) > 1 for p in passing.values()) or len(whole) > 1:
        return "differs"
    return "passes" if whole == {True} else "fails"


def matrix_json(matrix: dict) -> dict:
    """The ``matrix`` of a multi-target document: columns and rows of :func:`coverage_matrix`,
    with non-finite errors as None so that it is strict JSON."""
    return _finite({"columns": matrix["columns"], "rows": matrix["rows"]})


def matrix_document(verdicts: dict[str, dict], by_case: bool = False) -> dict:
    """The JSON of a run on several targets (``replay --target A --target B --json``): ``{"format_version",
    "targets", "verdicts": {target: Verdict JSON or migration state, unchanged}, "matrix"}``.

    Example: ``matrix_document({"wgpu:vulkan": v1, "wgpu:gl": v2})["matrix"]["rows"][0]["cells"]``."""
    states = [parse_state(doc, f"<verdicts of {target}>") for target, doc in verdicts.items()]
    return stamp("matrix", {"targets": list(verdicts), "verdicts": dict(verdicts),
                            "matrix": matrix_json(coverage_matrix(states, by_case=by_case))})


def is_matrix_document(data) -> bool:
    """Whether parsed JSON is a multi-target document (:func:`matrix_document`) rather than one
    Verdict JSON or migration state."""
    try:
        return document_kind(data) == "matrix"
    except TapmlError:
        return False


def _check(schema, data, bad):
    """``data`` validated against ``schema`` (a document of several targets); ``bad(problem)``
    when it is refused, or its ``format_version`` is newer than this tapml reads."""
    from tapml.judging.verdict import FORMAT_VERSION, check_depth
    from tapml.schema import SchemaError, validate
    if not isinstance(data, dict):
        bad("its JSON is not an object")
    try:
        m = validate(schema, data)
    except SchemaError as e:
        bad(str(e))
    if m.format_version > FORMAT_VERSION:
        bad(f"format_version {m.format_version} is newer than this tapml reads ({FORMAT_VERSION}); upgrade tapml")
    return m


def parse_matrix_document(data, path: str = "<document>") -> list[StateReport]:
    """The per-target states of a multi-target document, in its ``targets`` order; each is
    validated as a Verdict JSON or migration state. The stored ``matrix`` is derived data: it
    must be an object, and is recomputed from the verdicts, never trusted. TapmlError naming
    the field when the document is malformed."""
    from tapml.judging.verdict import check_depth
    from tapml.reports.schemas import MatrixJSON
    hint = "expected the --json of `tapml replay` or `tapml migrate` with several --target"
    check_depth(data, path, hint)

    def bad(problem: str):
        raise TapmlError(f"{path} is not a multi-target document: {problem}; {hint}")

    m = _check(MatrixJSON, data, bad)
    targets, verdicts = m.targets, m.verdicts
    if len(set(targets)) != len(targets):
        bad("a target appears twice in targets")
    if set(verdicts) != set(targets):
        bad("verdicts is not an object with one entry per target in targets")
    states = []
    for t in targets:
        state = parse_state(verdicts[t], f"{path}: verdicts[{t[:80]!r}]")
        if state.target != t:
            bad(f"verdicts[{t[:80]!r}] holds the verdicts of target {str(state.target)[:80]!r}")
        state.path = path
        states.append(state)
    return states


def fleet_states(runs: dict[str, dict[str, dict]], devices: list[str], path: str = "<fleet>") -> list[StateReport]:
    """One state per device of a fleet run (``runs``: ``{model: {device target: Verdict JSON}}``),
    in ``devices`` order: the cases of every model that device ran, each tagged with its
    ``model`` and with an id prefixed by it (``"zoo:mlp::c3"``), so that :func:`coverage_matrix`
    with ``by_model`` has a row per model and a column per device."""
    states = []
    for target in devices:
        cases, device, tolerances = [], None, {}
        for model, per_device in runs.items():
            if target not in per_device:
                continue
            s = parse_state(per_device[target], f"{path}: runs[{model[:80]!r}][{target[:80]!r}]")
            if s.target != target:
                raise TapmlError(f"{path} is not a fleet document: runs[{model[:80]!r}][{target[:80]!r}] holds the "
                                 f"verdicts of target {str(s.target)[:80]!r}; {FLEET_HINT}")
            device = device or s.device
            tolerances = tolerances or s.tolerances
            cases += [{**c, "id": f"{model}::{c['id']}", "model": model} for c in s.cases]
        states.append(StateReport(path=path, kind="replay", target=target, model=f"{len(runs)} model(s)",
                                  device=device or {"adapter": "", "backend": "", "features": [], "limits": {},
                                                    "error": ""},
                                  cases=cases, tolerances=tolerances, reference={"device": "cpu", "torch": None,
                                                                                 "store": None}))
    return states


def fleet_document(runs: dict[str, dict[str, dict]], devices: list[dict], by_op: bool = False,
                   left_out: dict[str, str] | None = None) -> dict:
    """The JSON of ``tapml fleet``: ``{"format_version", "kind": "fleet", "models", "devices":
    [{"target", "adapter", "backend", "platform", "served", "status"}], "left_out": {target:
    reason}, "runs": {model: {device target: Verdict JSON}}, "matrix"}``; the matrix has a row per
    model (per op with ``by_op``) and a column per device. ``status`` is ``ok`` or why the device
    dropped out of the run; ``left_out`` names the servers announced but not live when it began."""
    states = fleet_states(runs, [d["target"] for d in devices])
    return stamp("fleet", {"models": list(runs), "devices": devices, "left_out": dict(left_out or {}), "runs": runs,
                           "matrix": matrix_json(coverage_matrix(states, by_model=not by_op))})


def is_fleet_document(data) -> bool:
    """Whether parsed JSON is the document of ``tapml fleet --json`` (:func:`fleet_document`)."""
    return isinstance(data, dict) and data.get("kind") == "fleet"  # fleet documents always had their kind


FLEET_HINT = "expected the --json of `tapml fleet`"


def parse_fleet_document(data, path: str = "<fleet>") -> list[StateReport]:
    """The per-device states of a fleet document (:func:`fleet_states`), in its ``devices``
    order; every verdict is validated, the stored ``matrix`` is recomputed, never trusted.
    TapmlError naming the field when the document is malformed."""
    from tapml.judging.verdict import check_depth
    from tapml.reports.schemas import FleetJSON
    check_depth(data, path, FLEET_HINT)

    def bad(problem: str):
        raise TapmlError(f"{path} is not a fleet document: {problem}; {FLEET_HINT}")

    doc = _check(FleetJSON, data, bad)
    models, runs = doc.models, doc.runs
    if len(set(models)) != len(models):
        bad("models names a model twice")
    targets = [d.target for d in doc.devices]
    if len(set(targets)) != len(targets):
        bad("a device appears twice in devices")
    if set(runs) != set(models):
        bad("runs is not an object with one entry per model in models")
    for m in models:
        if not set(runs[m]) <= set(targets):
            bad(f"runs[{m[:80]!r}] is not an object keyed by targets of devices")
    return fleet_states({m: runs[m] for m in models}, targets, path)


__all__ = ["StateReport", "load_state", "load_states", "load_documents", "parse_state", "parse_generation",
           "parse_precision", "parse_preflight", "parse_bench", "bench_line", "preflight_line", "preflight_findings", "precision_modules", "READERS", "RENDERED",
           "step_error_points", "coverage_matrix",
           "matrix_json", "matrix_document", "is_matrix_document", "parse_matrix_document", "status_rank",
           "STATUS_RANK", "MATRIX_GROUPS", "STATUSES", "op_speeds", "fleet_states", "fleet_document",
           "is_fleet_document", "parse_fleet_document"]
