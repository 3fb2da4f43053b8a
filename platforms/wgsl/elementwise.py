"""Elementwise ops: unary math, activations, arithmetic, comparisons, logic, where.

Every lowering here returns a lazy :class:`Compute`, so chains of them fuse into whatever
kernel finally reads them. Inputs broadcast by index (stride 0), never by copying.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from tapml.platforms.wgsl.codegen import Compute, Value, cast, ctype, lit
from tapml.platforms.wgsl.registry import ALL, ALL_FLOAT, ALL_INT, NUMERIC, rand, randbool, randint, register
from tapml.platforms.wgsl.views import expand_to

SHAPES = [(7,), (3, 5), (2, 3, 33)]

#: float edge values every float sample set includes: signed zeros, infinities, NaN, denormals
FLOAT_EDGES = (0.0, -0.0, math.inf, -math.inf, math.nan, 1e-40, -1e-40)
#: integer edge values by dtype: the type's (or i32's) boundaries, -1, 0, 1. int64 travels as i32,
#: so its edges are the i32 boundaries (a result outside i32 would be refused, not computed).
INT_EDGES = {"int64": (-2**31 + 1, 2**31 - 1, -1, 0, 1), "int32": (-2**31, 2**31 - 1, -1, 0, 1),
             "int16": (-2**15, 2**15 - 1, -1, 0, 1), "int8": (-128, 127, -1, 0, 1), "uint8": (0, 255, 1)}
#: wrapping an i32 result into a narrower integer dtype, as torch's arithmetic wraps in it
_WRAP = {"int8": "(({e} << 24u) >> 24u)", "int16": "(({e} << 16u) >> 16u)", "uint8": "({e} & 255)"}


def typed(shape, dtype: str, lo: float = -3.0, hi: float = 3.0, edges=True) -> torch.Tensor:
    """A seeded sample tensor of ``dtype``: uniform in [lo, hi) (integers: rounded, bool: random,
    float: never zero), with the dtype's edge values (:data:`FLOAT_EDGES`, :data:`INT_EDGES`,
    True and False) in its first elements when ``edges`` (a sequence: those edge values instead).
    Floats are made in float32: the low-precision tests cast them."""
    n = math.prod(shape)
    if dtype == "bool":
        t = randbool(n)
        special = (True, False) if edges is True else tuple(edges or ())
    elif dtype in ALL_FLOAT:
        t = rand(n, lo=lo, hi=hi)
        special = FLOAT_EDGES if edges is True else tuple(edges or ())
    else:
        info = torch.iinfo(getattr(torch, dtype))
        ilo, ihi = max(math.floor(lo), info.min), min(math.ceil(hi), info.max)
        t = randint(n, lo=ilo, hi=max(ihi, ilo + 1), dtype=getattr(torch, dtype))
        special = INT_EDGES[dtype] if edges is True else tuple(v for v in (edges or ()) if info.min <= v <= info.max)
    special = special[:n]
    if special:
        t[:len(special)] = torch.tensor(special, dtype=t.dtype)
    return t.reshape(shape)


def promoted(args) -> str:
    """Expression type torch computes a mixed op in (for ops whose output is bool)."""
    if any(isinstance(a, float) or isinstance(a, Value) and a.ty == "f32" for a in args):
        return "f32"
    if any(isinstance(a, int) and not isinstance(a, bool) or isinstance(a, Value) and a.ty == "i32" for a in args):
        return "i32"
    return "bool"


def elementwise(pb, node, args, fn, compute: str | None = None, result: str | None = None, cost: int = 1,
                arg_types: Sequence[str] | None = None) -> Compute:
    """A Compute of ``node``'s output: tensor args are broadcast and cast to ``compute``
    (default: the output's type; ``arg_types`` gives one type per argument instead), scalars
    become literals; ``fn(k, *exprs)`` returns an expression of type ``result`` (default:
    ``compute``). Example: ``elementwise(pb, node, [x, 2.0], lambda k, a, b: f"({a} * {b})")``."""
    meta = node.outputs[0]
    oty = ctype(meta.dtype)
    compute = compute or oty
    result = result or compute
    types = list(arg_types) if arg_types is not None else [compute] * len(args)
    tensors = [expand_to(a, meta.shape) for a in args if isinstance(a, Value)]
    tensors = pb.fit(tensors, 1)
    it = iter(tensors)
    plan = [next(it) if isinstance(a, Value) else a for a in args]

    def emit(k, exprs, idx):
        ex = iter(exprs)
        ops = [cast(next(ex), a.ty, ty) if isinstance(a, Value) else lit(a, ty) for a, ty in zip(plan, types)]
        e = cast(fn(k, *ops), result, oty)
        return _WRAP[meta.dtype].format(e=e) if meta.dtype in _WRAP else e
    return Compute(meta.shape, meta.dtype, tensors, emit, cost=cost)


def _unary_samples(lo=-3.0, hi=3.0, dtypes=ALL_FLOAT, edges=True):
    """Samples of a unary op claiming ``dtypes``: float32 in [lo, hi) of several shapes, then the
    same range with :func:`typed`'s edge values in float32 and every other claimed dtype."""
    def samples():
        out = [((rand(*s, lo=lo, hi=hi),), {}) for s in SHAPES]
        out.append(((typed((5, 7), "float32", lo, hi),), {}))
        return out + [((typed((4, 5), d, lo, hi, edges),), {}) for d in dtypes if d not in ALL_FLOAT]
    return samples


# --- unary -------------------------------------------------------------------------------

def _f(template, *helpers):
    def fn(k, x):
        for h in helpers:
            k.need(h)
        return template.format(x=x)
    return fn


UNARY_FLOAT = {  # op -> (expression, helpers, sample range); int and bool inputs compute in f32 (torch's int-to-float ops)
    "sin": ("tap_sin({x})", ("tap_sin",), (-6, 6)), "cos": ("tap_cos({x})", ("tap_cos",), (-6, 6)),
    "tan": ("tap_tan({x})", ("tap_tan",), (-1.2, 1.2)),
    "exp": ("exp({x})", (), (-5, 5)), "exp2": ("exp2({x})", (), (-5, 5)),
    "log": ("tap_log({x})", ("tap_log",), (0.05, 8)), "log2": ("tap_log2({x})", ("tap_log2",), (0.05, 8)),
    "log10": ("(tap_log2({x}) * 0.30102999566398120)", ("tap_log2",), (0.05, 8)),
    "sqrt": ("sqrt({x})", (), (0.01, 8)), "rsqrt": ("inverseSqrt({x})", (), (0.01, 8)),
    "reciprocal": ("(1.0 / {x})", (), (0.1, 4)),
    "tanh": ("tap_tanh({x})", ("tap_tanh",), (-8, 8)), "sigmoid": ("tap_sigmoid({x})", ("tap_sigmoid",), (-8, 8)),
    "erf": ("tap_erf({x})", ("tap_erf",), (-3, 3)), "log1p": ("tap_log1p({x})", ("tap_log1p",), (-0.9, 4)),
    "expm1": ("tap_expm1({x})", ("tap_expm1",), (-3, 3)),
    "asin": ("tap_asin({x})", ("tap_asin",), (-0.95, 0.95)), "acos": ("tap_acos({x})", ("tap_acos",), (-0.95, 0.95)),
    "atan": ("tap_atan({x})", ("tap_atan",), (-5, 5)),
    "sinh": ("tap_sinh({x})", ("tap_sinh",), (-3, 3)), "cosh": ("tap_cosh({x})", ("tap_cosh",), (-3, 3)),
    "asinh": ("tap_asinh({x})", ("tap_asinh",), (-6, 6)), "acosh": ("tap_acosh({x})", ("tap_acosh",), (1.0, 8)),
    "atanh": ("tap_atanh({x})", ("tap_atanh",), (-0.95, 0.95)),
}
#: float-only unary ops (torch refuses int and bool inputs)
UNARY_FLOAT_ONLY = {"silu": ("({x} * tap_sigmoid({x}))", ("tap_sigmoid",), (-8, 8)),
                    "frac": ("({x} - trunc({x}))", (), (-5, 5))}
#: rounding ops: the identity on integers (torch keeps their dtype), refused for bool as torch does
UNARY_ROUND = {"floor": "floor({x})", "ceil": "ceil({x})", "trunc": "trunc({x})", "round": "round({x})"}

for _name, (_tpl, _helpers, (_lo, _hi)) in {**UNARY_FLOAT, **UNARY_FLOAT_ONLY}.items():
    _fn = _f(_tpl, *_helpers)

    def _lower(pb, node, x, _fn=_fn):
        return [elementwise(pb, node, [x], _fn, compute="f32", cost=2)]
    _dtypes = ALL if _name in UNARY_FLOAT else ALL_FLOAT
    register(f"aten.{_name}.default", _dtypes, samples=_unary_samples(_lo, _hi, _dtypes))(_lower)

for _name, _tpl in UNARY_ROUND.items():
    def _lower_round(pb, node, x, _fn=_f(_tpl)):
        if x.ty == "i32":
            return [elementwise(pb, node, [x], lambda k, a: a)]
        return [elementwise(pb, node, [x], _fn, compute="f32")]
    register(f"aten.{_name}.default", NUMERIC, samples=_unary_samples(-5, 5, NUMERIC))(_lower_round)


@register("aten.neg.default", NUMERIC, samples=_unary_samples(dtypes=NUMERIC))
def neg(pb, node, x):
    return [elementwise(pb, node, [x], lambda k, a: f"(-{a})")]


@register("aten.abs.default", NUMERIC, samples=_unary_samples(dtypes=NUMERIC))
def abs_(pb, node, x):
    return [elementwise(pb, node, [x], lambda k, a: f"abs({a})")]


@register("aten.sign.default", ALL, samples=_unary_samples(dtypes=ALL))
def sign(pb, node, x):
    if x.ty == "bool":
        return [elementwise(pb, node, [x], lambda k, a: a)]
    if ctype(node.outputs[0].dtype) == "f32":  # torch: (0 < x) - (x < 0), so +0 for -0 and NaN
        return [elementwise(pb, node, [x], lambda k, a: f"(select(0.0, 1.0, 0.0 < {a}) - select(0.0, 1.0, {a} < 0.0))")]
    return [elementwise(pb, node, [x], lambda k, a: f"sign({a})")]


@register("aten.relu.default", NUMERIC, samples=_unary_samples(dtypes=NUMERIC))
def relu(pb, node, x):
    t = ctype(node.outputs[0].dtype)
    if t == "f32":  # GL compiles the select into max(a, 0), which drops NaN
        return [elementwise(pb, node, [x], lambda k, a: f"select({a}, 0.0, {a} < 0.0 && !{k.need('tap_isnan')}({a}))")]
    return [elementwise(pb, node, [x], lambda k, a: f"select({a}, {lit(0, t)}, {a} < {lit(0, t)})")]


def _gelu_samples():
    return [((rand(*s, lo=-5, hi=5),), {}) for s in SHAPES] + [((rand(3, 8, lo=-5, hi=5),), {"approximate": "tanh"}),
                                                               ((typed((5, 7), "float32", -5, 5, _GELU_EDGES),), {}),
                                                               ((typed((5, 7), "float32", -5, 5, _GELU_EDGES),), {"approximate": "tanh"})]


#: torch's CPU gelu gives NaN at +Inf (its vectorized erf path), which no formula should copy
_GELU_EDGES = tuple(v for v in FLOAT_EDGES if not math.isinf(v))


@register("aten.gelu.default", ALL_FLOAT, samples=_gelu_samples)
def gelu(pb, node, x, approximate="none"):
    # 1 + tanh(u) = 2 sigmoid(2u) and 1 + erf(u) = erfc(-u): the sums cancel for very negative x
    # (torch's float32 gelu(-5) is 1.19e-6, not 1.43e-6), these do not
    if approximate == "tanh":
        def fn(k, a):
            k.need("tap_sigmoid")
            return f"({a} * tap_sigmoid(1.5957691216057308 * ({a} + 0.044715 * {a} * {a} * {a})))"
    else:
        def fn(k, a):
            k.need("tap_erfc")
            return f"(0.5 * {a} * tap_erfc({a} * -0.7071067811865476))"
    return [elementwise(pb, node, [x], fn, compute="f32", cost=3)]


@register("aten.leaky_relu.default", ALL_FLOAT, samples=lambda: [((rand(3, 5),), {}), ((rand(9), 0.2), {}),
                                                                  ((typed((5, 7), "float32"), 0.2), {})])
def leaky_relu(pb, node, x, negative_slope=0.01):
    return [elementwise(pb, node, [x, float(negative_slope)], lambda k, a, s: f"select({a}, {a} * {s}, {a} < 0.0)")]


@register("aten.hardtanh.default", NUMERIC, samples=lambda: [((rand(3, 5),), {}), ((rand(9), -0.5, 0.7), {}),
                                                             ((typed((5, 7), "float32"), -0.5, 0.7), {})] + [
    ((typed((4, 5), d, -9, 9), -2.5, 3.5), {}) for d in ALL_INT] + [((typed((4, 5), "uint8", 0, 9), 2, 5), {})])
def hardtanh(pb, node, x, min_val=-1.0, max_val=1.0):
    if x.ty == "i32":  # torch converts the bounds to the integer dtype (truncating)
        return [elementwise(pb, node, [x, int(min_val), int(max_val)], lambda k, a, lo, hi: f"min(max({a}, {lo}), {hi})")]
    return [elementwise(pb, node, [x, float(min_val), float(max_val)],
                        lambda k, a, lo, hi: f"select(min(max({a}, {lo}), {hi}), {a}, {k.need('tap_isnan')}({a}))")]


@register("aten.hardsigmoid.default", ALL_FLOAT, samples=_unary_samples(-5, 5))
def hardsigmoid(pb, node, x):
    return [elementwise(pb, node, [x], lambda k, a: f"select(clamp({a} / 6.0 + 0.5, 0.0, 1.0), {a}, {k.need('tap_isnan')}({a}))")]


@register("aten.hardswish.default", ALL_FLOAT, samples=_unary_samples(-5, 5))
def hardswish(pb, node, x):
    return [elementwise(pb, node, [x], lambda k, a: f"({a} * clamp({a} / 6.0 + 0.5, 0.0, 1.0))")]


@register("aten.elu.default", ALL_FLOAT, samples=_unary_samples(-4, 4))
def elu(pb, node, x, alpha=1.0, scale=1.0, input_scale=1.0):
    def fn(k, a):
        k.need("tap_expm1")
        return (f"select({float(scale)!r} * {a}, {float(scale * alpha)!r} * tap_expm1({a} * {float(input_scale)!r}), "
                f"{a} <= 0.0)")
    return [elementwise(pb, node, [x], fn, compute="f32", cost=2)]


@register("aten.softplus.default", ALL_FLOAT, samples=_unary_samples(-30, 30))
def softplus(pb, node, x, beta=1.0, threshold=20.0):
    def fn(k, a):
        k.need("tap_log1p")
        b = lit(beta, "f32")
        return f"select(tap_log1p(exp({a} * {b})) / {b}, {a}, {a} * {b} > {lit(threshold, 'f32')})"
    return [elementwise(pb, node, [x], fn, compute="f32", cost=2)]


def _special_samples():
    return [((rand(3, 5).log(),), {}), ((rand(3, 5) / rand(3, 5).round(),), {})] + _unary_samples(dtypes=ALL)()[3:]


@register("aten.isnan.default", ALL, samples=_special_samples)
def isnan(pb, node, x):
    if x.ty != "f32":
        return [elementwise(pb, node, [x], lambda k, a: "false", result="bool")]
    return [elementwise(pb, node, [x], lambda k, a: f"tap_isnan({k.need('tap_isnan') and a})", compute="f32",
                        result="bool")]


@register("aten.isinf.default", ALL, samples=_special_samples)
def isinf(pb, node, x):
    if x.ty != "f32":
        return [elementwise(pb, node, [x], lambda k, a: "false", result="bool")]
    return [elementwise(pb, node, [x], lambda k, a: f"((bitcast<u32>({a}) & 0x7fffffffu) == 0x7f800000u)", compute="f32",
                        result="bool")]


def _logic_samples():
    return [((randbool(3, 5),), {}), ((rand(7),), {}), ((randint(2, 3, lo=-2, hi=2),), {})] + _unary_samples(dtypes=ALL)()[3:]


@register("aten.logical_not.default", ALL, samples=_logic_samples)
def logical_not(pb, node, x):
    return [elementwise(pb, node, [x], lambda k, a: f"(!{a})", compute="bool")]


@register("aten.bitwise_not.default", ALL_INT + ("bool",),
          samples=lambda: [((randbool(3, 5),), {}), ((randint(4, 4, lo=-9, hi=9),), {})] + [
              ((typed((4, 5), d, -9, 9),), {}) for d in ALL_INT + ("bool",)])
def bitwise_not(pb, node, x):
    if node.outputs[0].dtype == "bool":
        return [elementwise(pb, node, [x], lambda k, a: f"(!{a})")]
    return [elementwise(pb, node, [x], lambda k, a: f"(~{a})")]


# --- clamp -------------------------------------------------------------------------------

def _clamp_fn(ty, has_lo, has_hi):
    def fn(k, a, *bounds):
        bounds = list(bounds)
        e = a
        if has_lo:
            lo = bounds.pop(0)
            e = f"({e} || {lo})" if ty == "bool" else f"max({e}, {lo})"
        if has_hi:
            hi = bounds.pop(0)
            e = f"({e} && {hi})" if ty == "bool" else f"min({e}, {hi})"
        return f"select({e}, {a}, {k.need('tap_isnan')}({a}))" if ty == "f32" else e
    return fn


def _narrow(v, dtype: str):
    """An int scalar converted to an integer ``dtype`` as torch converts it (wrapping)."""
    if dtype in ("int8", "int16", "uint8") and isinstance(v, int) and not isinstance(v, bool):
        bits = 8 if dtype != "int16" else 16
        v &= (1 << bits) - 1
        return v - (1 << bits) if dtype != "uint8" and v >= 1 << (bits - 1) else v
    return v


def _clamp_samples():
    out = [((rand(3, 5), -0.5, 0.5), {}), ((rand(7), None, 0.3), {}), ((rand(2, 4), -1.0), {}),
           ((randint(3, 3, lo=-9, hi=9), -2, 3), {}),
           ((rand(3, 5), rand(5, lo=-1, hi=0), rand(3, 1, lo=0, hi=1)), {}),
           ((rand(4, 2), None, rand(2)), {}), ((typed((5, 7), "float32"), -0.5, 0.5), {}),
           ((typed((5, 7), "float32"), typed((7,), "float32"), 0.5), {}),
           ((randbool(3, 4), 0, 1), {}), ((randbool(3, 4), randbool(4)), {}), ((randbool(3, 4), None, randbool(4)), {}), ((randbool(5), 0.5), {})]
    return out + [((typed((4, 5), d, -9, 9), -2, 3), {}) for d in ALL_INT] + [
        ((typed((4, 5), d, -9, 9), typed((5,), d, -3, 0, edges=False), typed((4, 1), d, 0, 5, edges=False)), {})
        for d in ALL_INT]


@register(["aten.clamp.default", "aten.clamp.Tensor"], ALL, samples=_clamp_samples)
def clamp(pb, node, x, min=None, max=None):
    dtype = node.outputs[0].dtype
    ty = ctype(dtype)
    bounds = [_narrow(b, dtype) for b in (min, max) if b is not None]
    return [elementwise(pb, node, [x] + bounds, _clamp_fn(ty, min is not None, max is not None))]


def _clamp1_samples():
    return [((rand(3, 5), 0.2), {}), ((typed((5, 7), "float32"), 0.2), {}), ((randbool(3, 4), 1), {}),
            ((randbool(3, 4), randbool(4)), {})] + [((typed((4, 5), d, -9, 9), 2), {}) for d in ALL_INT]


@register("aten.clamp_min.default", ALL, samples=_clamp1_samples)
def clamp_min(pb, node, x, min):
    return clamp(pb, node, x, min=min)


@register("aten.clamp_max.default", ALL, samples=_clamp1_samples)
def clamp_max(pb, node, x, max):
    return clamp(pb, node, x, max=max)


# --- binary arithmetic -------------------------------------------------------------------

#: int64 edges of binary samples: small enough that a result of two operands stays in i32
_BINARY_INT64_EDGES = (-2**28, 2**28 - 1, -1, 0, 1)


def _int_operands(dtype, shape, divisor=False):
    """An integer left operand with edge values and a right one of small magnitude (for a
    ``divisor``: at least 2, so that no division overflows or divides by zero)."""
    lhs = typed(shape, dtype, -20, 20, edges=_BINARY_INT64_EDGES if dtype == "int64" else True)
    rhs = randint(shape[-1], lo=2 if divisor else 1, hi=7, dtype=getattr(torch, dtype))
    if dtype != "uint8":
        rhs = rhs * (1 - 2 * randint(shape[-1], lo=0, hi=2, dtype=rhs.dtype))
    return lhs, rhs


def _binary_samples(scalar=False, dtypes=NUMERIC, lo=-3.0, hi=3.0, positive_rhs=False, divisor=False, rhs_edges=True):
    """Samples of a binary op claiming ``dtypes``: float32 of broadcasting shapes, float32 edge
    values on either side, every integer dtype (edge values on the left) and bool; ``scalar``:
    the right operand is a Python number."""
    ints = [d for d in dtypes if d in ALL_INT]

    def samples():
        rlo = 0.25 if positive_rhs else lo
        rhs = (lambda *s: rand(*s, lo=rlo, hi=hi))
        if scalar:
            out = [((rand(3, 5, lo=lo, hi=hi), 1.75), {}), ((rand(2, 3, 4, lo=lo, hi=hi), -0.5 if not positive_rhs else 3.0), {}),
                   ((typed((5, 7), "float32", lo, hi), 1.75), {})]
            out += [((_int_operands(d, (4, 5))[0], 3), {}) for d in ints]
            if ints:
                out.append(((randint(4, 6, lo=-20, hi=20), 2.5), {}))
            if "bool" in dtypes:
                out += [((randbool(4, 5), 3), {}), ((randbool(4, 5), True), {}), ((randbool(4, 5), 2.5), {})]
            return out
        out = [((rand(3, 5, lo=lo, hi=hi), rhs(3, 5)), {}),
               ((rand(2, 1, 4, lo=lo, hi=hi), rhs(3, 1)), {}),
               ((rand(6, lo=lo, hi=hi), rhs(4, 1)), {}),
               ((rand(3, 4, lo=lo, hi=hi), rhs(1)), {}),
               ((typed((5, 7), "float32", lo, hi), rhs(5, 7)), {}),
               ((rand(5, 7, lo=lo, hi=hi), typed((5, 7), "float32", rlo, hi, rhs_edges)), {})]
        out += [(_int_operands(d, (4, 5), divisor), {}) for d in ints]
        if ints:
            out.append(((randint(4, 6, lo=-20, hi=20), rand(4, 6)), {}))
        if "bool" in dtypes:
            out += [((randbool(4, 5), randbool(4, 5)), {}), ((randbool(4, 5), randint(5, lo=2, hi=7)), {}),
                    ((randbool(4, 5), rand(5, lo=rlo, hi=hi)), {})]
        return out
    return samples


def _arith(op_bool=None):
    def make(template):
        def lower(pb, node, a, b, alpha=1):
            t = ctype(node.outputs[0].dtype)
            if t == "bool" and op_bool:
                return [elementwise(pb, node, [a, b], lambda k, x, y: f"({x} {op_bool} {y})")]
            if alpha != 1:
                return [elementwise(pb, node, [a, b, alpha], lambda k, x, y, al: template.format(x=x, y=f"({al} * {y})"))]
            return [elementwise(pb, node, [a, b], lambda k, x, y: template.format(x=x, y=y))]
        return lower
    return make


register(["aten.add.Tensor"], ALL, samples=lambda: _binary_samples(dtypes=ALL)() + [((rand(3, 4), rand(3, 4)), {"alpha": 2.0})])(
    _arith("||")("({x} + {y})"))
register(["aten.add.Scalar"], ALL, samples=_binary_samples(scalar=True, dtypes=ALL))(_arith("||")("({x} + {y})"))
register(["aten.sub.Tensor"], NUMERIC, samples=lambda: _binary_samples()() + [((rand(3, 4), rand(3, 4)), {"alpha": 0.5})])(
    _arith()("({x} - {y})"))
register(["aten.sub.Scalar"], NUMERIC, samples=_binary_samples(scalar=True))(_arith()("({x} - {y})"))
register(["aten.mul.Tensor"], ALL, samples=_binary_samples(dtypes=ALL))(_arith("&&")("({x} * {y})"))
register(["aten.mul.Scalar"], ALL, samples=_binary_samples(scalar=True, dtypes=ALL))(_arith("&&")("({x} * {y})"))


@register("aten.rsub.Scalar", NUMERIC, samples=_binary_samples(scalar=True))
def rsub(pb, node, a, b, alpha=1):
    return [elementwise(pb, node, [a, b, alpha], lambda k, x, y, al: f"({y} - {al} * {x})")]


@register(["aten.div.Tensor", "aten.div.Scalar"], ALL,
          samples=lambda: _binary_samples(dtypes=ALL, positive_rhs=True, divisor=True)() +
          _binary_samples(scalar=True, dtypes=ALL, positive_rhs=True)())
def div(pb, node, a, b):
    return [elementwise(pb, node, [a, b], lambda k, x, y: f"({x} / {y})")]


def _divmode(t, mode):
    if mode is None:
        return lambda k, x, y: f"({x} / {y})"
    if mode == "trunc":
        return (lambda k, x, y: f"trunc({x} / {y})") if t == "f32" else (lambda k, x, y: f"{k.need('tap_div_i')}({x}, {y})")
    if t == "f32":
        return lambda k, x, y: f"{k.need('tap_floordiv_f')}({x}, {y})"
    return lambda k, x, y: f"{k.need('tap_floordiv_i')}({x}, {y})"


#: torch's vectorized fmod gives NaN for a denormal divisor (its scalar path the exact value)
_NORMAL_EDGES = FLOAT_EDGES[:5]


def _division_samples():
    """Samples of floor/trunc division and modulo: float32 and every integer dtype against
    divisors of either sign (integers: at least 2 in magnitude), edge values included, and bool."""
    return (_binary_samples(dtypes=ALL, lo=-9, hi=9, divisor=True, rhs_edges=_NORMAL_EDGES)() +
            [((rand(3, 5, lo=-9, hi=9), rand(3, 5, lo=-3, hi=3)), {}), ((rand(3, 5, lo=-9, hi=9), -1.5), {}),
             ((typed((5, 7), "float32", -9, 9), 2.5), {})] +
            [((_int_operands(d, (4, 5))[0], 3), {}) for d in ALL_INT] + [((randbool(4, 5), 3), {})])


def _divmode_samples():
    return [(args, {"rounding_mode": mode}) for mode in ("trunc", "floor") for args, _ in _division_samples()]


@register(["aten.div.Tensor_mode", "aten.div.Scalar_mode"], ALL, samples=_divmode_samples)
def div_mode(pb, node, a, b, rounding_mode=None):
    t = ctype(node.outputs[0].dtype)
    return [elementwise(pb, node, [a, b], _divmode(t, rounding_mode))]


@register(["aten.floor_divide.default", "aten.floor_divide.Scalar"], ALL, samples=_division_samples)
def floor_divide(pb, node, a, b):
    return [elementwise(pb, node, [a, b], _divmode(ctype(node.outputs[0].dtype), "floor"))]


@register(["aten.remainder.Tensor", "aten.remainder.Scalar"], ALL, samples=_division_samples)
def remainder(pb, node, a, b):
    t = ctype(node.outputs[0].dtype)
    h = "tap_mod_f" if t == "f32" else "tap_mod_i"
    return [elementwise(pb, node, [a, b], lambda k, x, y: f"{k.need(h)}({x}, {y})")]


@register(["aten.fmod.Tensor", "aten.fmod.Scalar"], ALL, samples=_division_samples)
def fmod(pb, node, a, b):
    t = ctype(node.outputs[0].dtype)
    if t == "f32":
        return [elementwise(pb, node, [a, b], lambda k, x, y: f"{k.need('tap_fmod_f')}({x}, {y})")]
    return [elementwise(pb, node, [a, b], lambda k, x, y: f"{k.need('tap_rem_i')}({x}, {y})")]


def _pow_expr(k, t, x, y, exponent=None):
    if t == "i32":
        return f"{k.need('tap_ipow')}({x}, {y})"
    special = {2.0: f"({x} * {x})", 3.0: f"({x} * {x} * {x})", 1.0: x, 0.5: f"sqrt({x})",
               -1.0: f"(1.0 / {x})", -0.5: f"inverseSqrt({x})", -2.0: f"(1.0 / ({x} * {x}))"}
    if exponent is not None and float(exponent) in special:
        return special[float(exponent)]
    return f"{k.need('tap_pow')}({x}, {y})"


def _pow_scalar_samples():
    out = [((rand(3, 5), 2), {}), ((rand(3, 5), 3.0), {}), ((rand(2, 7, lo=0.1, hi=3), 0.5), {}),
           ((rand(2, 7, lo=0.1, hi=3), 1.7), {}), ((rand(4, 4), -2), {}), ((rand(4, 4), 4), {}),
           ((randint(3, 4, lo=-5, hi=5), 3), {}), ((randbool(3, 4), 2), {}), ((randbool(3, 4), 2.5), {})]
    out += [((typed((5, 7), "float32"), e), {}) for e in (2, 0.5, 1.7, -1, 0)]
    # i32 boundaries wrap alike in torch's int32 and WGSL's i32; int64 squares stay inside i32
    return out + [((typed((4, 5), d, -5, 5, edges=(-2**15, 2**15 - 1, -1, 0, 1) if d == "int64" else True), 2), {})
                  for d in ALL_INT] + [((typed((4, 5), "int32", -5, 5), 3), {})]


@register("aten.pow.Tensor_Scalar", ALL, samples=_pow_scalar_samples)
def pow_tensor_scalar(pb, node, x, e):
    t = ctype(node.outputs[0].dtype)
    return [elementwise(pb, node, [x, e], lambda k, a, b: _pow_expr(k, t, a, b, e), cost=2)]


@register("aten.pow.Tensor_Tensor", NUMERIC,
          samples=lambda: [((rand(3, 5, lo=0.1, hi=3), rand(3, 5)), {}),
                           ((rand(4, 3), rand(3).round()), {}),
                           ((randint(3, 4, lo=-5, hi=5), randint(4, lo=0, hi=4)), {}),
                           ((typed((5, 7), "float32"), rand(7, lo=-2, hi=2).round()), {}),
                           ((rand(5, 7, lo=0.1, hi=3), typed((5, 7), "float32")), {})] + [
    ((typed((4, 5), d, -5, 5, edges=(-128, 127, -1, 0, 1) if d != "uint8" else True), randint(5, lo=0, hi=4, dtype=getattr(torch, d))),
     {}) for d in ALL_INT])
def pow_tensor_tensor(pb, node, x, e):
    t = ctype(node.outputs[0].dtype)
    return [elementwise(pb, node, [x, e], lambda k, a, b: _pow_expr(k, t, a, b), cost=2)]


@register("aten.pow.Scalar", ALL, samples=lambda: [((2.0, rand(3, 5)), {}), ((0.5, rand(7)), {}), ((2.0, typed((5, 7), "float32")), {}),
                                                    ((2, randbool(3, 4)), {}), ((-1.5, randbool(3, 4)), {})] + [
    ((3, randint(4, 5, lo=0, hi=6, dtype=getattr(torch, d))), {}) for d in ALL_INT])
def pow_scalar(pb, node, base, e):
    t = ctype(node.outputs[0].dtype)
    return [elementwise(pb, node, [base, e], lambda k, a, b: _pow_expr(k, t, a, b), cost=2)]


@register(["aten.maximum.default", "aten.minimum.default"], ALL, samples=_binary_samples(dtypes=ALL))
def maximum(pb, node, a, b):
    t = ctype(node.outputs[0].dtype)
    fn = "max" if node.op == "aten.maximum.default" else "min"
    if t == "f32":
        return [elementwise(pb, node, [a, b], lambda k, x, y: f"{k.need('tap_' + fn)}({x}, {y})")]
    if t == "bool":
        op = "||" if fn == "max" else "&&"
        return [elementwise(pb, node, [a, b], lambda k, x, y: f"({x} {op} {y})")]
    return [elementwise(pb, node, [a, b], lambda k, x, y: f"{fn}({x}, {y})")]


def _atan2_samples():
    edges = typed((7, 7), "float32")
    return _binary_samples(dtypes=ALL)() + [((edges, edges.t()), {})]


@register("aten.atan2.default", ALL, samples=_atan2_samples)
def atan2(pb, node, a, b):
    return [elementwise(pb, node, [a, b], lambda k, x, y: f"{k.need('tap_atan2')}({x}, {y})", compute="f32")]


# --- comparisons and logic ---------------------------------------------------------------

_CMP = {"eq": "==", "ne": "!=", "lt": "<", "le": "<=", "gt": ">", "ge": ">="}


def _cmp_samples(scalar):
    def samples():
        a = rand(3, 5).round()
        edges = typed((7, 7), "float32")
        if scalar:
            return [((a, 1.0), {}), ((rand(2, 3, 4), 0.25), {}), ((randint(4, 6, lo=-3, hi=3), 1), {}),
                    ((randint(7, lo=-3, hi=3), 0.5), {}), ((edges, 0.0), {}), ((edges, math.inf), {}),
                    ((randbool(3, 4), True), {}), ((randbool(3, 4), 0.5), {})] + [
                ((typed((4, 5), d, -3, 3), 1), {}) for d in ALL_INT]
        return [((a, rand(3, 5).round()), {}), ((rand(2, 1, 4).round(), rand(3, 1).round()), {}),
                ((randint(4, 6, lo=-3, hi=3), randint(6, lo=-3, hi=3)), {}), ((randbool(3, 4), randbool(3, 4)), {}),
                ((edges, edges.t()), {}), ((randbool(4, 5), rand(5).round()), {})] + [
            ((typed((4, 5), d, -3, 3), typed((5,), d, -3, 3, edges=False)), {}) for d in ALL_INT]
    return samples


for _name, _sym in _CMP.items():
    def _lower_cmp(pb, node, a, b, _sym=_sym):
        t = promoted([a, b])
        if t == "bool" and _sym not in ("==", "!="):
            t = "i32"
        if _sym == "!=" and t == "f32":  # NaN != anything; some drivers compile != as an ordered compare
            return [elementwise(pb, node, [a, b], lambda k, x, y: f"!({x} == {y})", compute=t, result="bool")]
        return [elementwise(pb, node, [a, b], lambda k, x, y: f"({x} {_sym} {y})", compute=t, result="bool")]
    register(f"aten.{_name}.Tensor", ALL, samples=_cmp_samples(False))(_lower_cmp)
    register(f"aten.{_name}.Scalar", ALL, samples=_cmp_samples(True))(_lower_cmp)


def _logic2_samples():
    edges = typed((7, 7), "float32")
    return [((randbool(3, 5), randbool(3, 5)), {}), ((randbool(2, 1, 4), randbool(3, 1)), {}),
            ((rand(4, 3).round(), randint(4, 3, lo=-1, hi=2)), {}), ((edges, edges.t()), {}),
            ((rand(3, 4).round(), rand(4).round()), {})] + [
        ((typed((4, 5), d, -2, 2), typed((5,), d, -2, 2, edges=False)), {}) for d in ALL_INT]


for _name, _sym in {"and": "&&", "or": "||", "xor": "!="}.items():
    def _lower_logic(pb, node, a, b, _sym=_sym):
        return [elementwise(pb, node, [a, b], lambda k, x, y: f"({x} {_sym} {y})", compute="bool")]
    register(f"aten.logical_{_name}.default", ALL, samples=_logic2_samples)(_lower_logic)


def _bitwise_samples(scalar):
    def samples():
        if scalar:
            return [((randbool(3, 5), True), {}), ((randint(4, 6, lo=-20, hi=20), 6), {})] + [
                ((typed((4, 5), d, -20, 20), 6), {}) for d in ALL_INT]
        return [((randbool(3, 5), randbool(3, 5)), {}), ((randbool(2, 1, 4), randbool(3, 1)), {}),
                ((randint(4, 6, lo=-20, hi=20), randint(6, lo=0, hi=15)), {})] + [
            ((typed((4, 5), d, -20, 20), typed((5,), d, 0, 15, edges=False)), {}) for d in ALL_INT]
    return samples


for _name, (_bsym, _isym) in {"and": ("&&", "&"), "or": ("||", "|"), "xor": ("!=", "^")}.items():
    def _lower_bitwise(pb, node, a, b, _bsym=_bsym, _isym=_isym):
        t = ctype(node.outputs[0].dtype)
        sym = _bsym if t == "bool" else _isym
        return [elementwise(pb, node, [a, b], lambda k, x, y: f"({x} {sym} {y})")]
    register(f"aten.bitwise_{_name}.Tensor", ALL_INT + ("bool",), samples=_bitwise_samples(False))(_lower_bitwise)
    register(f"aten.bitwise_{_name}.Scalar", ALL_INT + ("bool",), samples=_bitwise_samples(True))(_lower_bitwise)


# --- select ------------------------------------------------------------------------------

def _where_samples():
    return [((randbool(3, 5), rand(3, 5), rand(3, 5)), {}), ((randbool(1, 4, 1), rand(3, 1, 1), rand(5)), {}),
            ((randbool(4, 4), randint(4, 4), randint(4, 1)), {}), ((randbool(5, 7), typed((5, 7), "float32"), rand(7)), {}),
            ((randbool(4, 5), randbool(4, 5), randbool(5)), {}), ((randbool(4, 5), randint(4, 5), rand(5)), {})] + [
        ((randbool(4, 5), typed((4, 5), d), typed((5,), d, edges=False)), {}) for d in ALL_INT]


@register("aten.where.self", ALL, samples=_where_samples)
def where(pb, node, cond, a, b):
    t = ctype(node.outputs[0].dtype)
    return [elementwise(pb, node, [cond, a, b], lambda k, c, x, y: f"select({y}, {x}, {c})",
                        arg_types=("bool", t, t))]


# where.Scalar (two Python numbers) makes float32, int64 or bool, as torch's promotion of scalars does.
@register("aten.where.Scalar", ALL_FLOAT + ("int64", "bool"),
          samples=lambda: [((randbool(3, 5), 0.5, -2.0), {}), ((randbool(3, 5), 3, -2), {}), ((randbool(4), True, False), {}),
                           ((randbool(2, 3), math.inf, math.nan), {})])
def where_two_scalars(pb, node, cond, a, b):
    return where(pb, node, cond, a, b)


@register(["aten.where.ScalarSelf", "aten.where.ScalarOther"], ALL,
          samples=lambda: [((randbool(3, 5), rand(3, 5), 0.5), {}), ((randbool(3, 5), 0.5, rand(3, 5)), {}),
                           ((randbool(3, 5), 0.5, -2.0), {}), ((randbool(5, 7), typed((5, 7), "float32"), math.nan), {}),
                           ((randbool(3, 5), randint(3, 5), 2), {}), ((randbool(3, 5), 3, randbool(3, 5)), {})] + [
              ((randbool(4, 5), typed((4, 5), d), 1), {}) for d in ALL_INT] + [
              ((randbool(4, 5), 1, typed((4, 5), d)), {}) for d in ALL_INT])
def where_scalar(pb, node, cond, a, b):
    return where(pb, node, cond, a, b)


@register(["aten.masked_fill.Scalar", "aten.masked_fill.Tensor"], ALL,
          samples=lambda: [((rand(3, 5), randbool(3, 5), -1.5), {}), ((rand(2, 3, 4), randbool(3, 1), 2.0), {}),
                           ((rand(3, 4), randbool(4), rand(())), {}), ((typed((5, 7), "float32"), randbool(5, 7), math.inf), {}),
                           ((randbool(4, 5), randbool(4, 5), True), {}), ((randbool(4, 5), randbool(5), 0.0), {})] + [
              ((typed((4, 5), d), randbool(4, 5), v), {}) for d in ALL_INT for v in (-1.5, 7)] + [
              ((typed((4, 5), d), randbool(4, 5), torch.tensor(3, dtype=getattr(torch, d))), {}) for d in ALL_INT])
def masked_fill(pb, node, x, mask, value):
    dtype = node.outputs[0].dtype
    if not isinstance(value, Value):  # torch converts the fill value to the tensor's dtype
        value = bool(value) if dtype == "bool" else int(value) if dtype in ALL_INT else value
    return where(pb, node, mask, value, x)


@register("aten.copy.default", ALL, samples=lambda: [((rand(3, 5), rand(3, 5)), {}), ((rand(2, 3, 4), randint(3, 1)), {}),
                                                      ((rand(5, 7), typed((5, 7), "float32")), {}),
                                                      ((rand(4, 5), randbool(4, 5)), {})] + [
    ((typed((4, 5), d), typed((4, 5), d)), {}) for d in ALL_INT + ("bool",)])
def copy(pb, node, dst, src, non_blocking=False):
    return [elementwise(pb, node, [src], lambda k, x: x)]


@register("aten.lerp.Scalar", ALL_FLOAT, samples=lambda: [((rand(3, 5), rand(3, 5), 0.3), {}),
                                                          ((typed((5, 7), "float32"), rand(5, 7), 0.3), {})])
def lerp(pb, node, a, b, w):
    return [elementwise(pb, node, [a, b, w], lambda k, x, y, z: f"({x} + {z} * ({y} - {x}))")]


@register("aten.addcmul.default", NUMERIC, samples=lambda: [((rand(3, 5), rand(3, 5), rand(5)), {"value": 0.5}),
                                                            ((typed((5, 7), "float32"), rand(5, 7), rand(7)), {"value": 0.5})] + [
    ((typed((4, 5), d, edges=(-2**20, 2**20, -1, 0, 1)), typed((4, 5), d, edges=False), typed((5,), d, edges=False)),
     {"value": 2}) for d in ALL_INT])
def addcmul(pb, node, a, b, c, value=1):
    return [elementwise(pb, node, [a, b, c, value], lambda k, x, y, z, v: f"({x} + {v} * {y} * {z})")]


@register("aten.addcdiv.default", ALL_FLOAT,
          samples=lambda: [((rand(3, 5), rand(3, 5), rand(5, lo=0.5, hi=2)), {"value": 0.5}),
                           ((typed((5, 7), "float32"), rand(5, 7), rand(7, lo=0.5, hi=2)), {"value": 0.5})])
def addcdiv(pb, node, a, b, c, value=1):
    return [elementwise(pb, node, [a, b, c, value], lambda k, x, y, z, v: f"({x} + {v} * {y} / {z})")]

