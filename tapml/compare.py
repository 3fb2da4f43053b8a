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


def compare_tensor(target: torch.Tensor, ref: torch.Tensor, rtol: float | None = None,
                   atol: float | None = None, worst: int = 5) -> Comparison:
    """Compare one tensor. ``rtol``/``atol`` None means the dtype's default."""
    if tuple(target.shape) != tuple(ref.shape):
        return Comparison(False, message=f"shape {tuple(target.shape)} != reference {tuple(ref.shape)}")
    if target.dtype != ref.dtype:
        return Comparison(False, message=f"dtype {dtype_name(target.dtype)} != reference {dtype_name(ref.dtype)}")
    n = ref.numel()
    if n == 0:
        return Comparison(True, 0.0, 0.0, 0.0)
    t, r = target.detach().cpu().reshape(-1), ref.detach().cpu().reshape(-1)
    if torch.equal(t, r):  # bitwise-equal outputs (copies, views, exact ops): nothing to measure (NaN never is)
        return Comparison(True, 0.0, 0.0, 0.0)
    exact = not (ref.dtype.is_floating_point or ref.dtype.is_complex)
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
        bad = special_bad | (both_finite & (diff > atol + rtol * r64.abs()))
        acc.special += int(special_bad.sum())
        inf = torch.full_like(diff, math.inf)
        acc.add(at, bad, torch.where(special_bad, inf, diff), rel.where(~special_bad, inf))
    if exact:
        n_wide = acc.wide_bad
        if not n_wide:
            return acc.result(t, r, ref.shape, "values differ (exact match required)")
        if acc.bad > n_wide:
            return acc.result(t, r, ref.shape, f"values differ (exact match required; "
                              f"{n_wide} of them where the reference's int64 value lies outside the i32 range)")
        result = acc.result(t, r, ref.shape, f"{INT64_OUTSIDE_I32} ({n_wide} elements)")
        first = acc.first_wide
        index = [int(x) for x in torch.unravel_index(torch.tensor(first), tuple(ref.shape))] if ref.shape else []
        result.unsupported = (f"{INT64_OUTSIDE_I32}: the reference holds {int(r[first])} at {index} "
                              f"({n_wide} such elements differ; i32 holds [{I32_RANGE[0]}, {I32_RANGE[1]}])")
        return result
    msg = f"values exceed rtol={rtol:g} atol={atol:g}"
    if acc.special:
        msg += f"; NaN/Inf differ at {acc.special} positions"
    return acc.result(t, r, ref.shape, msg)


class _Tally:
    """What a comparison keeps of each chunk: counts, largest errors, the worst candidates."""

    def __init__(self, worst: int):
        self.worst, self.n, self.bad, self.special, self.wide_bad = worst, 0, 0, 0, 0
        self.first_wide: int | None = None
        self.max_abs = self.max_rel = -math.inf
        self.candidates: list[tuple[float, int]] = []  # (error, flat index) of mismatching elements

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
    # a real mismatch in any output outweighs outputs the target cannot hold
    unsupported = "; ".join(f"output {i}: {c.unsupported}" for i, c in failed) \
        if failed and all(c.unsupported for _, c in failed) else ""
    return Comparison(passed=not failed, max_abs_err=worst_of("max_abs_err"), max_rel_err=worst_of("max_rel_err"),
                      mismatch_fraction=worst_of("mismatch_fraction"),
                      message="; ".join(f"output {i}: {c.message}" for i, c in failed),
                      worst=failed[0][1].worst if failed else [], unsupported=unsupported)


#: fp64-anchored mode: a target may be this many times as far from the float64 result as the reference is.
ANCHOR_FACTOR = 4.0
#: fp64-anchored mode: the error always allowed on top, per dtype of the output (the dtype's
#: default atol for the low floats; 1e-6 for float32, whose default atol would hide real errors).
ANCHOR_FLOOR = {"float32": 1e-6, "float16": DEFAULT_TOLERANCES["float16"][1],
                "bfloat16": DEFAULT_TOLERANCES["bfloat16"][1], "float64": 1e-12}


def compare_anchored(targets: list[torch.Tensor], refs32: list[torch.Tensor], refs64: list[torch.Tensor],
                     factor: float = ANCHOR_FACTOR, floor: float | None = None) -> Comparison:
    """fp64-anchored check: the target passes when its error against the float64 result is
    within ``factor`` (:data:`ANCHOR_FACTOR`, 4) times the reference's own error (the float32,
    float16 or bfloat16 reference ``refs32`` against ``refs64``) plus ``floor`` (None: the
    output dtype's :data:`ANCHOR_FLOOR`). Where the reference itself overflowed (±Inf or NaN
    where the float64 result is finite: the dtype's own range, not the target's fault) the
    target must match the reference there, as in the plain comparison.

    Example: ``compare_anchored([t16], [r16], [r64]).passed``."""
    if len(targets) != len(refs32):
        return Comparison(False, message=f"{len(targets)} outputs != reference {len(refs32)}")
    results = []
    for t, r32, r64 in zip(targets, refs32, refs64):
        if not r32.dtype.is_floating_point or tuple(t.shape) != tuple(r32.shape) or t.dtype != r32.dtype:
            results.append(compare_tensor(t, r32))  # exact, or a shape/dtype mismatch: no anchoring needed
            continue
        name = dtype_name(r32.dtype)
        bound_floor = ANCHOR_FLOOR.get(name, ANCHOR_FLOOR["float32"]) if floor is None else floor
        low, anchor = r32.detach().cpu().double(), r64.detach().cpu().double()
        overflowed = ~torch.isfinite(low) & torch.isfinite(anchor)
        anchor = torch.where(overflowed, low, anchor)
        both = torch.isfinite(low) & torch.isfinite(anchor)
        ref_err = float((low - anchor).abs()[both].max()) if bool(both.any()) else 0.0
        bound = factor * ref_err + bound_floor
        c = compare_tensor(t.double(), anchor, rtol=0.0, atol=bound)
        c.message = c.message and (f"{c.message} (fp64-anchored: reference {name} error {ref_err:.3g}, "
                                   f"factor {factor:g}, floor {bound_floor:g})")
        results.append(c)
    return merge(results)


#: Ops whose index output may order equal values any way (torch leaves the order of ties
#: unspecified): ``op -> (position of dim in args, its default)``. ``sort.stable`` with
#: ``stable=True`` is not one of them: its ties must come in input order.
TIE_ORDERED = {"aten.sort.default": (1, -1), "aten.sort.stable": (None, -1), "aten.topk.default": (2, -1)}


def tie_dim(op: str, args: list, kwargs: dict) -> int | None:
    """The dim along which ``op`` (a :data:`TIE_ORDERED` op, else None) may order ties freely."""
    if op not in TIE_ORDERED or (op == "aten.sort.stable" and kwargs.get("stable")):
        return None
    pos, default = TIE_ORDERED[op]
    dim = args[pos] if pos is not None and len(args) > pos else kwargs.get("dim", default)
    return dim if isinstance(dim, int) and not isinstance(dim, bool) else None


def indices_pick_equal_values(x: torch.Tensor, dim: int, indices: torch.Tensor, values: torch.Tensor) -> bool:
    """Whether ``indices`` (a sort's or topk's index output) are a valid answer: distinct along
    ``dim`` and picking from ``x`` exactly the reference's ``values`` (NaN matching NaN). So an
    index output that differs from the reference only in the order of equal values passes."""
    if indices.shape != values.shape or indices.dtype not in (torch.int64, torch.int32) or x.dim() == 0:
        return False
    size = x.shape[dim]
    if indices.numel() and (int(indices.min()) < 0 or int(indices.max()) >= size):
        return False
    picked = x.gather(dim, indices.to(torch.int64))
    same = (picked == values) | (picked.isnan() & values.isnan()) if values.is_floating_point() else picked == values
    if not bool(same.all()):
        return False
    ordered = indices.sort(dim).values  # distinct: no index twice in a row
    return not bool((ordered.narrow(dim, 1, max(0, ordered.shape[dim] - 1)) ==
                     ordered.narrow(dim, 0, max(0, ordered.shape[dim] - 1))).any())
