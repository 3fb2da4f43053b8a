"""Comparison of target outputs with the reference: the one place tolerances live.

Shapes and dtypes first, then values. Integers and bools must be equal. Floats pass when
``|t - r| <= atol + rtol * |r|`` elementwise; NaN and ±Inf must match in position (and sign).
Every result carries error statistics, whether it passed or not.

int64 policy (one for inputs and outputs): WGSL targets hold int64 as i32, so an int64 value
outside the i32 range makes a case ``unsupported`` with the reason :data:`INT64_OUTSIDE_I32`.
An input is refused where it is uploaded (``platforms/wgsl/tensors.py``, using
:func:`first_outside_i32`); an output is judged here: where every element that differs is one
whose reference value lies outside the i32 range, the comparison is ``unsupported`` rather
than a mismatch (a target with 64-bit integers that gets those values right still passes).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from tapml.errors import TapmlError
from tapml.graph import dtype_name

#: The range of i32, WGSL's widest integer: int64 tensors live as i32 on WGSL targets.
I32_RANGE = (-2**31, 2**31 - 1)
#: Why an int64 value outside :data:`I32_RANGE` makes a case ``unsupported`` (inputs and outputs alike).
INT64_OUTSIDE_I32 = "int64 values outside the i32 range: WGSL has no 64-bit integers"

#: dtype -> (rtol, atol)
DEFAULT_TOLERANCES = {
    "float32": (1e-3, 1e-4),
    "float16": (1e-2, 1e-3),
    "bfloat16": (2e-2, 1e-2),
    "float64": (1e-7, 1e-10),
}


@dataclass
class Tolerances:
    """Default tolerances per dtype, overridable for all ops (key ``"*"``) or per op
    (key = aten overload name, or a prefix such as ``aten.mm``).

    Example::

        tol = Tolerances.parse(["aten.mm=1e-2,1e-3", "1e-4,1e-5"])
        tol.get("aten.mm.default", "float32")  # (0.01, 0.001)
        tol.get("aten.add.Tensor", "float32")  # (0.0001, 1e-05)
    """

    overrides: dict[str, tuple[float, float]] = field(default_factory=dict)

    def get(self, op: str | None, dtype: str) -> tuple[float, float]:
        """``(rtol, atol)`` for outputs of ``op`` (None: no op) with dtype name ``dtype``: the
        override for the op, else for its overload packet, else for ``"*"``, else the dtype's default."""
        if op is not None:
            for key in (op, op.rsplit(".", 1)[0]):
                if key in self.overrides:
                    return self.overrides[key]
        if "*" in self.overrides:
            return self.overrides["*"]
        return DEFAULT_TOLERANCES.get(dtype, DEFAULT_TOLERANCES["float32"])

    def against_float32(self, op: str | None, dtype: str, expected: torch.Tensor) -> tuple[float, float]:
        """``(rtol, atol)`` for a value of a float16/bfloat16 run judged against the same model
        in float32 (``expected``): the low ``dtype``'s defaults with atol raised to at least
        ``rtol * max|expected|`` (finite elements). A low float keeps about as many digits of a
        tensor's largest element as rtol says, so after a reduction its small elements carry
        errors at that scale; an Inf, a NaN or a wrong value at the tensor's own scale still
        fails. An override (``--tol``) applies as given."""
        if op is not None and any(k in self.overrides for k in (op, op.rsplit(".", 1)[0])) or "*" in self.overrides:
            return self.get(op, dtype)
        rtol, atol = DEFAULT_TOLERANCES.get(dtype, DEFAULT_TOLERANCES["float32"])
        if expected.is_floating_point() and expected.numel():
            finite = expected[torch.isfinite(expected)]
            if finite.numel():
                atol = max(atol, rtol * float(finite.abs().max()))
        return rtol, atol

    @classmethod
    def parse(cls, items: list[str] | None) -> "Tolerances":
        """Parse ``--tol`` values: ``OP=RTOL,ATOL`` or ``RTOL,ATOL`` (every op)."""
        overrides = {}
        for item in items or []:
            op, sep, values = item.rpartition("=")
            op = op.strip() if sep else "*"
            parts = values.split(",")
            try:
                if len(parts) != 2:
                    raise ValueError
                rtol, atol = float(parts[0]), float(parts[1])
                if not (math.isfinite(rtol) and math.isfinite(atol)) or rtol < 0 or atol < 0:
                    raise ValueError
            except ValueError:
                raise TapmlError(f"--tol {item!r}: expected OP=RTOL,ATOL or RTOL,ATOL with two "
                                 "non-negative numbers, e.g. aten.mm.default=1e-3,1e-4") from None
            if not op or op.count(".") > 2 or " " in op:
                raise TapmlError(f"--tol {item!r}: {op!r} is not an op name such as aten.mm.default")
            overrides[op] = (rtol, atol)
        return cls(overrides)

    def to_json(self) -> dict:
        return {k: list(v) for k, v in self.overrides.items()}


@dataclass
class Comparison:
    """Outcome of comparing target outputs with the reference. ``unsupported`` (a reason) when
    the outputs differ only where the target cannot hold the reference's values (see the
    int64 policy above): the verdict is then ``unsupported``, not ``mismatch``."""

    passed: bool
    max_abs_err: float | None = None
    max_rel_err: float | None = None
    mismatch_fraction: float | None = None
    message: str = ""
    worst: list[dict] = field(default_factory=list)
    unsupported: str = ""
    #: Which rule decided (``exact``, ``tolerance``: ``|t - r| <= atol + rtol |r|``,
    #: ``fp64-anchored``: :mod:`tapml.judging.compare.anchored`, ``arithmetic``: :mod:`tapml.judging.compare.bounds`;
    #: "" where none applies, e.g. a shape mismatch; :data:`tapml.judging.verdict.RULES`),
    #: the error it allowed at the element nearest to (or furthest past) its bound, and that
    #: element's error over the bound (``margin``: above 1 fails, 0.5 or more is near-failing).
    rule: str = ""
    bound: float | None = None
    margin: float | None = None

    def stats(self) -> dict:
        """The error statistics as verdict fields: ``max_abs_err``, ``max_rel_err``, ``mismatch_fraction``."""
        return {"max_abs_err": self.max_abs_err, "max_rel_err": self.max_rel_err,
                "mismatch_fraction": self.mismatch_fraction}


def outside_i32(t: torch.Tensor) -> torch.Tensor | None:
    """Mask of the elements of an int64 tensor outside :data:`I32_RANGE`; None for other dtypes."""
    if t.dtype != torch.int64:
        return None
    return (t < I32_RANGE[0]) | (t > I32_RANGE[1])


def first_outside_i32(t: torch.Tensor) -> int | None:
    """The first value of an int64 tensor outside :data:`I32_RANGE` (None when all fit or
    ``t`` is not int64). Example: ``first_outside_i32(torch.tensor([1, 2**40]))`` -> ``2**40``."""
    mask = outside_i32(t)
    if mask is None or not bool(mask.any()):
        return None
    return int(t.reshape(-1)[mask.reshape(-1)][0])


def _finite_or_none(x: float) -> float | None:
    return float(x) if math.isfinite(x) else None


#: Elements compared at a time: the float64 temporaries of a comparison stay a few tens of MB
#: however large the tensor (a [64000, 1024] logits or weight tensor would need GBs at once).
CHUNK = 1 << 22


@dataclass
class Rule:
    """A second way an element may pass: its error against ``exact`` (float64, the output's
    shape) within ``allowed`` (a tensor of that shape or a number). ``name`` is the rule's
    (``fp64-anchored``, ``arithmetic``); ``why`` says in a failure message how the bound was made."""

    name: str
    exact: torch.Tensor
    allowed: torch.Tensor | float
    why: str = ""

    def chunk(self, at: int, size: int) -> tuple[torch.Tensor, torch.Tensor | float]:
        exact = self.exact.detach().cpu().double().reshape(-1)[at:at + size]
        if isinstance(self.allowed, torch.Tensor):
            return exact, self.allowed.detach().cpu().double().reshape(-1)[at:at + size]
        return exact, float(self.allowed)


def _pairs(rule: Rule) -> Rule:
    """``rule`` for a complex output compared as (real, imaginary) pairs: its bound holds for each part."""
    exact = torch.view_as_real(rule.exact.resolve_conj()) if rule.exact.is_complex() else rule.exact
    allowed = rule.allowed.unsqueeze(-1).expand(exact.shape) if isinstance(rule.allowed, torch.Tensor) else rule.allowed
    return Rule(rule.name, exact, allowed, rule.why)


def _ratio(err: torch.Tensor, allowed) -> torch.Tensor:
    """``err / allowed`` with 0/0 = 0 and x/0 = inf (NaN, from an error or a bound, counts as inf)."""
    allowed = torch.as_tensor(allowed, dtype=torch.float64)
    r = torch.where(err == 0, torch.zeros_like(err), err / allowed)
    return torch.nan_to_num(r, nan=math.inf)


def compare_tensor(target: torch.Tensor, ref: torch.Tensor, rtol: float | None = None,
                   atol: float | None = None, worst: int = 5, rules: list[Rule] = (),
                   fast: str | None = "tolerance", in_float64: bool = False) -> Comparison:
    """Compare one tensor. ``rtol``/``atol`` None means the dtype's default. A float element
    passes within the tolerance (the fast path, named ``fast`` in the result) or, failing that,
    within any of ``rules`` (each element by its own error against the rule's float64 result).
    ``fast=None``: no fast path, ``rules`` alone decide (an element equal to the reference passes).
    The result's ``rule``/``bound``/``margin`` say which rule decided and how closely.
    ``in_float64``: a floating ``target`` of any dtype against a float64 ``ref`` (the caller
    checked its dtype), converted a chunk at a time rather than copied whole."""
    if tuple(target.shape) != tuple(ref.shape):
        return Comparison(False, message=f"shape {tuple(target.shape)} != reference {tuple(ref.shape)}")
    if in_float64 and not (ref.dtype == torch.float64 and target.is_floating_point()):
        raise ValueError("in_float64 compares a floating target with a float64 reference")
    if target.dtype != ref.dtype and not in_float64:
        return Comparison(False, message=f"dtype {dtype_name(target.dtype)} != reference {dtype_name(ref.dtype)}")
    if ref.is_complex() and not in_float64:  # real and imaginary parts, each as a float of that width
        return compare_tensor(torch.view_as_real(target.detach().cpu().resolve_conj()),
                              torch.view_as_real(ref.detach().cpu().resolve_conj()), rtol, atol, worst,
                              [_pairs(rule) for rule in rules], fast)
    n = ref.numel()
    if n == 0:
        return Comparison(True, 0.0, 0.0, 0.0)
    t, r = target.detach().cpu().reshape(-1), ref.detach().cpu().reshape(-1)
    exact = not (ref.dtype.is_floating_point or ref.dtype.is_complex)
    same = torch.equal(t, r) if t.dtype == r.dtype else \
        all(torch.equal(t[at:at + CHUNK].double(), r[at:at + CHUNK]) for at in range(0, n, CHUNK))
    if same:  # bitwise-equal outputs (copies, views, exact ops): nothing to measure (NaN never is)
        return Comparison(True, 0.0, 0.0, 0.0, rule="exact" if exact else fast, margin=0.0)
    if not exact:
        dflt_rtol, dflt_atol = DEFAULT_TOLERANCES.get(dtype_name(ref.dtype), DEFAULT_TOLERANCES["float32"])
        rtol = dflt_rtol if rtol is None else rtol
        atol = dflt_atol if atol is None else atol
    acc = _Tally(worst)
    for at in range(0, n, CHUNK):
        ts, rs = t[at:at + CHUNK], r[at:at + CHUNK]
        if exact:
            bad = ts != rs
            diff = (ts.double() - rs.double()).abs()
            rel = diff / rs.double().abs().clamp_min(1e-300)
            wide = outside_i32(rs)
            if wide is not None:
                acc.wide_bad += int((bad & wide).sum())
                if acc.first_wide is None and bool((bad & wide).any()):
                    acc.first_wide = at + int(torch.nonzero(bad & wide)[0])
            acc.add(at, bad, diff, rel)
            continue
        t64, r64 = ts.double(), rs.double()
        special_bad = (torch.isnan(t64) != torch.isnan(r64)) | (torch.isinf(t64) != torch.isinf(r64)) | \
            (torch.isinf(r64) & (t64 != r64))
        both_finite = torch.isfinite(t64) & torch.isfinite(r64)
        diff = torch.where(both_finite, (t64 - r64).abs(), torch.zeros_like(t64))
        rel = diff / r64.abs().clamp_min(1e-30)
        allowed = atol + rtol * r64.abs() if fast else torch.zeros_like(r64)
        score, bound, by = _ratio(diff, allowed), allowed, torch.zeros_like(diff, dtype=torch.int8)
        for k, rule in enumerate(rules, 1):
            anchor, ok = rule.chunk(at, ts.numel())
            err = (t64 - anchor).abs()
            s2 = torch.where(torch.isfinite(anchor) & both_finite, _ratio(err, ok), torch.full_like(err, math.inf))
            better = s2 < score
            score = torch.where(better, s2, score)
            bound = torch.where(better, torch.as_tensor(ok, dtype=torch.float64).expand_as(err), bound)
            by = torch.where(better, torch.full_like(by, k), by)
        bad = special_bad | (both_finite & (score > 1))
        acc.special += int(special_bad.sum())
        acc.margin(both_finite & ~special_bad, score, bound, by)
        inf = torch.full_like(diff, math.inf)
        acc.add(at, bad, torch.where(special_bad, inf, diff), rel.where(~special_bad, inf))
    if exact:
        n_wide = acc.wide_bad
        if not n_wide:
            return _exact_rule(acc.result(t, r, ref.shape, "values differ (exact match required)"))
        if acc.bad > n_wide:
            return _exact_rule(acc.result(t, r, ref.shape, f"values differ (exact match required; "
                              f"{n_wide} of them where the reference's int64 value lies outside the i32 range)"))
        result = acc.result(t, r, ref.shape, f"{INT64_OUTSIDE_I32} ({n_wide} elements)")
        first = acc.first_wide
        index = [int(x) for x in torch.unravel_index(torch.tensor(first), tuple(ref.shape))] if ref.shape else []
        result.unsupported = (f"{INT64_OUTSIDE_I32}: the reference holds {int(r[first])} at {index} "
                              f"({n_wide} such elements differ; i32 holds [{I32_RANGE[0]}, {I32_RANGE[1]}])")
        return _exact_rule(result)
    names = [fast or "exact"] + [rule.name for rule in rules]
    msg = f"values exceed rtol={rtol:g} atol={atol:g}" if fast == "tolerance" else \
        f"values exceed the {fast} bound" if fast else "values differ"
    for rule in rules:
        msg += f"{' and' if fast else ':'} the {rule.name} bound" + (f" ({rule.why})" if rule.why else "")
    if acc.special:
        msg += f"; NaN/Inf differ at {acc.special} positions"
    result = acc.result(t, r, ref.shape, msg)
    # a pass is decided by the last rule any element needed; a failure by the rule that came
    # closest at the element furthest past its bound
    result.rule = names[acc.used_rules if result.passed else acc.deciding]
    if acc.worst_score >= 0:
        result.bound, result.margin = _finite_or_none(acc.worst_bound), _finite_or_none(acc.worst_score)
    if not result.passed and result.bound is not None:
        result.message += (f" (worst element: error {acc.worst_err:.3g} > {result.rule} bound {result.bound:.3g}, "
                           f"margin {acc.worst_score:.3g})")
    return result


def _exact_rule(c: Comparison) -> Comparison:
    c.rule = "exact"
    return c


class _Tally:
    """What a comparison keeps of each chunk: counts, largest errors, the worst candidates."""

    def __init__(self, worst: int):
        self.worst, self.n, self.bad, self.special, self.wide_bad = worst, 0, 0, 0, 0
        self.first_wide: int | None = None
        self.max_abs = self.max_rel = -math.inf
        self.candidates: list[tuple[float, int]] = []  # (error, flat index) of mismatching elements
        # the element furthest past (or nearest to) its bound: score = error / bound, the bound,
        # its error against what the bound is measured from, and which rule (0: the fast path)
        self.worst_score, self.worst_bound, self.worst_err, self.deciding = -1.0, math.inf, 0.0, 0
        self.used_rules = 0  # the highest rule any element needed

    def margin(self, judged: torch.Tensor, score: torch.Tensor, bound: torch.Tensor, by: torch.Tensor) -> None:
        if not bool(judged.any()):
            return
        s = torch.where(judged, score, torch.full_like(score, -1.0))
        i = int(s.argmax())
        self.used_rules = max(self.used_rules, int(by[judged].max()))
        if float(s[i]) > self.worst_score:
            self.worst_score, self.worst_bound = float(s[i]), float(bound[i])
            self.worst_err = float(s[i]) * float(bound[i]) if math.isfinite(float(s[i])) else math.inf
            self.deciding = int(by[i])

    def add(self, at: int, bad: torch.Tensor, diff: torch.Tensor, rel: torch.Tensor) -> None:
        n_bad = int(bad.sum())
        self.n += bad.numel()
        self.bad += n_bad
        self.max_abs = max(self.max_abs, float(diff.max()))
        self.max_rel = max(self.max_rel, float(rel.max()))
        if n_bad and self.worst:
            score = torch.where(bad, diff, torch.full_like(diff, -1.0))
            top = torch.topk(score, min(self.worst, n_bad))
            self.candidates.extend((v, at + i) for v, i in zip(top.values.tolist(), top.indices.tolist()))
            self.candidates = sorted(self.candidates, key=lambda c: -c[0])[:self.worst]

    def result(self, t, r, shape, msg: str) -> Comparison:
        worst_list = []
        for _, i in self.candidates:
            index = [int(x) for x in torch.unravel_index(torch.tensor(i), tuple(shape))] if shape else []
            worst_list.append({"index": index, "target": _py(t[i]), "reference": _py(r[i])})
        return Comparison(passed=self.bad == 0, max_abs_err=_finite_or_none(self.max_abs),
                          max_rel_err=_finite_or_none(self.max_rel), mismatch_fraction=self.bad / self.n,
                          message="" if self.bad == 0 else f"{self.bad}/{self.n} elements mismatch: {msg}",
                          worst=worst_list)


def _py(x: torch.Tensor):
    v = x.item()
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return v


def compare_outputs(targets: list[torch.Tensor], refs: list[torch.Tensor], op: str | None = None,
                    tolerances: Tolerances | None = None) -> Comparison:
    """Compare every output of a case or region; stats are the worst over outputs."""
    if len(targets) != len(refs):
        return Comparison(False, message=f"{len(targets)} outputs != reference {len(refs)}")
    tolerances = tolerances or Tolerances()
    results = []
    for t, r in zip(targets, refs):
        rtol, atol = tolerances.get(op, dtype_name(r.dtype))
        results.append(compare_tensor(t, r, rtol, atol))
    return merge(results)


def merge(results: list[Comparison]) -> Comparison:
    """One Comparison for several outputs: fails if any fails; worst stats; messages name outputs."""
    if not results:
        return Comparison(True, 0.0, 0.0, 0.0)
    if len(results) == 1:
        return results[0]

    def worst_of(key):
        vals = [getattr(c, key) for c in results]
        if any(v is None for v in vals):
            return None
        return max(vals)

    failed = [(i, c) for i, c in enumerate(results) if not c.passed]
    # the rule and bound of the output closest to (or furthest past) its bound
    deciding = max((c for _, c in failed) if failed else results,
                   key=lambda c: -1.0 if c.margin is None and c.passed else math.inf if c.margin is None else c.margin)
    # a real mismatch in any output outweighs outputs the target cannot hold
    unsupported = "; ".join(f"output {i}: {c.unsupported}" for i, c in failed) \
        if failed and all(c.unsupported for _, c in failed) else ""
    return Comparison(passed=not failed, max_abs_err=worst_of("max_abs_err"), max_rel_err=worst_of("max_rel_err"),
                      mismatch_fraction=worst_of("mismatch_fraction"),
                      message="; ".join(f"output {i}: {c.message}" for i, c in failed),
                      worst=failed[0][1].worst if failed else [], unsupported=unsupported,
                      rule=deciding.rule, bound=deciding.bound, margin=deciding.margin)



#: Op packets whose result is uninitialized memory in torch (``torch.empty*``): any value is
#: right, so only shapes and dtypes are compared, and nothing reads the reference's values.
UNINITIALIZED_PACKETS = frozenset({"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided",
                                   "empty_permuted"})
UNINITIALIZED_NOTE = "uninitialized memory (torch.empty): compared on shape and dtype, any value is right"


def is_uninitialized_op(op: str) -> bool:
    """Whether ``op`` (an aten overload name) returns uninitialized memory (:data:`UNINITIALIZED_PACKETS`)."""
    parts = op.split(".") if isinstance(op, str) else []
    return len(parts) == 3 and parts[0] == "aten" and parts[1] in UNINITIALIZED_PACKETS


def metadata_mismatch(targets: list[torch.Tensor], refs: list[torch.Tensor]) -> str:
    """How the shapes and dtypes of ``targets`` differ from the reference's ``refs`` ("" if not)."""
    if len(targets) != len(refs):
        return f"{len(targets)} outputs, the reference has {len(refs)}"
    for i, (t, r) in enumerate(zip(targets, refs)):
        if tuple(t.shape) != tuple(r.shape) or t.dtype != r.dtype:
            return (f"output {i} is {dtype_name(t.dtype)}{list(t.shape)}, "
                    f"the reference {dtype_name(r.dtype)}{list(r.shape)}")
    return ""


def compare_metadata(targets: list[torch.Tensor], refs: list[torch.Tensor]) -> Comparison:
    """Shapes and dtypes of ``targets`` against the reference's ``refs``, never their values
    (for :func:`is_uninitialized_op` outputs)."""
    if why := metadata_mismatch(targets, refs):
        return Comparison(False, message=f"{UNINITIALIZED_NOTE}: {why}")
    return Comparison(True, 0.0, 0.0, 0.0, message=UNINITIALIZED_NOTE)



# --- the device's float model ----------------------------------------------------------------

def float_model_note(model: dict, tensors: list[torch.Tensor]) -> str:
    """Why a mismatch may be the device's float model rather than a wrong kernel: ``model`` is
    :meth:`~tapml.platforms.base.Platform.float_model`'s, ``tensors`` the case's
    inputs and reference outputs. The WGSL spec lets a device assume no NaN or Inf and flush
    subnormals; "" when the device keeps what these tensors hold."""
    floats = [t for t in tensors if t.is_floating_point() and t.numel()]
    held = []
    if model.get("nan_inf") is False and any(not bool(torch.isfinite(t).all()) for t in floats):
        held.append("NaN or Inf")
    if model.get("subnormals") is False and any(
            bool(((t != 0) & (t.abs() < torch.finfo(t.dtype).tiny)).any()) for t in floats):
        held.append("subnormal numbers")
    if not held:
        return ""
    return (f"the case holds {' and '.join(held)}, which this device does not keep (the WGSL spec lets it "
            "assume no NaN/Inf and flush subnormals: device float_model); the mismatch may be that, not the kernel")
