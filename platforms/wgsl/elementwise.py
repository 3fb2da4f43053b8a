"""Elementwise ops: unary math, activations, arithmetic, comparisons, logic, where.

Every lowering here returns a lazy :class:`Compute`, so chains of them fuse into whatever
kernel finally reads them. Inputs broadcast by index (stride 0), never by copying.
"""

from __future__ import annotations

from typing import Sequence

from tapml.platforms.wgsl.codegen import Compute, Value, cast, ctype, lit
from tapml.platforms.wgsl.registry import ALL, ALL_FLOAT, ALL_INT, NUMERIC, rand, randbool, randint, register
from tapml.platforms.wgsl.views import expand_to

SHAPES = [(7,), (3, 5), (2, 3, 33)]


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
        return cast(fn(k, *ops), result, oty)
    return Compute(meta.shape, meta.dtype, tensors, emit, cost=cost)


def _unary_samples(lo=-3.0, hi=3.0, ints=False):
    def samples():
        out = [((rand(*s, lo=lo, hi=hi),), {}) for s in SHAPES]
        if ints:
            out.append(((randint(4, 5, lo=-20, hi=20),), {}))
        return out
    return samples


# --- unary -------------------------------------------------------------------------------

def _f(template, *helpers):
    def fn(k, x):
        for h in helpers:
            k.need(h)
        return template.format(x=x)
    return fn


UNARY_FLOAT = {  # op -> (expression, helpers, sample range)
    "sin": ("sin({x})", (), (-6, 6)), "cos": ("cos({x})", (), (-6, 6)), "tan": ("tan({x})", (), (-1.2, 1.2)),
    "exp": ("exp({x})", (), (-5, 5)), "exp2": ("exp2({x})", (), (-5, 5)),
    "log": ("log({x})", (), (0.05, 8)), "log2": ("log2({x})", (), (0.05, 8)),
    "log10": ("(log2({x}) * 0.30102999566398120)", (), (0.05, 8)),
    "sqrt": ("sqrt({x})", (), (0.01, 8)), "rsqrt": ("inverseSqrt({x})", (), (0.01, 8)),
    "reciprocal": ("(1.0 / {x})", (), (0.1, 4)),
    "tanh": ("tap_tanh({x})", ("tap_tanh",), (-8, 8)), "sigmoid": ("tap_sigmoid({x})", ("tap_sigmoid",), (-8, 8)),
    "silu": ("({x} * tap_sigmoid({x}))", ("tap_sigmoid",), (-8, 8)),
    "erf": ("tap_erf({x})", ("tap_erf",), (-3, 3)), "log1p": ("tap_log1p({x})", ("tap_log1p",), (-0.9, 4)),
    "expm1": ("tap_expm1({x})", ("tap_expm1",), (-3, 3)),
    "asin": ("asin({x})", (), (-0.95, 0.95)), "acos": ("acos({x})", (), (-0.95, 0.95)), "atan": ("atan({x})", (), (-5, 5)),
    "sinh": ("sinh({x})", (), (-3, 3)), "cosh": ("cosh({x})", (), (-3, 3)),
    "floor": ("floor({x})", (), (-5, 5)), "ceil": ("ceil({x})", (), (-5, 5)), "trunc": ("trunc({x})", (), (-5, 5)),
    "round": ("round({x})", (), (-5, 5)), "frac": ("({x} - trunc({x}))", (), (-5, 5)),
}

for _name, (_tpl, _helpers, (_lo, _hi)) in UNARY_FLOAT.items():
    _ops = [f"aten.{_name}.default"]
    _fn = _f(_tpl, *_helpers)

    def _lower(pb, node, x, _fn=_fn):
        return [elementwise(pb, node, [x], _fn, compute="f32", cost=2)]
    _ints = _name not in ("floor", "ceil", "trunc", "round", "frac")
    register(_ops, NUMERIC if _ints else ALL_FLOAT, samples=_unary_samples(_lo, _hi, ints=_ints and _lo < 0))(_lower)


@register("aten.neg.default", NUMERIC, samples=_unary_samples(ints=True))
def neg(pb, node, x):
    return [elementwise(pb, node, [x], lambda k, a: f"(-{a})")]


@register("aten.abs.default", NUMERIC, samples=_unary_samples(ints=True))
def abs_(pb, node, x):
    return [elementwise(pb, node, [x], lambda k, a: f"abs({a})")]


@register("aten.sign.default", NUMERIC, samples=_unary_samples(ints=True))
def sign(pb, node, x):
    return [elementwise(pb, node, [x], lambda k, a: f"sign({a})")]


@register("aten.relu.default", NUMERIC, samples=_unary_samples(ints=True))
def relu(pb, node, x):
    t = ctype(node.outputs[0].dtype)
    return [elementwise(pb, node, [x], lambda k, a: f"select({a}, {lit(0, t)}, {a} < {lit(0, t)})")]


def _gelu_samples():
    return [((rand(*s, lo=-5, hi=5),), {}) for s in SHAPES] + [((rand(3, 8, lo=-5, hi=5),), {"approximate": "tanh"})]


@register("aten.gelu.default", ALL_FLOAT, samples=_gelu_samples)
def gelu(pb, node, x, approximate="none"):
    if approximate == "tanh":
        def fn(k, a):
            k.need("tap_tanh")
            return f"(0.5 * {a} * (1.0 + tap_tanh(0.7978845608028654 * ({a} + 0.044715 * {a} * {a} * {a}))))"
    else:
        def fn(k, a):
            k.need("tap_erf")
            return f"(0.5 * {a} * (1.0 + tap_erf({a} * 0.7071067811865476)))"
    return [elementwise(pb, node, [x], fn, compute="f32", cost=3)]


@register("aten.leaky_relu.default", ALL_FLOAT, samples=lambda: [((rand(3, 5),), {}), ((rand(9), 0.2), {})])
def leaky_relu(pb, node, x, negative_slope=0.01):
    return [elementwise(pb, node, [x, float(negative_slope)], lambda k, a, s: f"select({a}, {a} * {s}, {a} < 0.0)")]


@register("aten.hardtanh.default", ALL_FLOAT, samples=lambda: [((rand(3, 5),), {}), ((rand(9), -0.5, 0.7), {})])
def hardtanh(pb, node, x, min_val=-1.0, max_val=1.0):
    return [elementwise(pb, node, [x, float(min_val), float(max_val)],
                        lambda k, a, lo, hi: f"select(min(max({a}, {lo}), {hi}), {a}, {a} != {a})")]


@register("aten.hardsigmoid.default", ALL_FLOAT, samples=_unary_samples(-5, 5))
def hardsigmoid(pb, node, x):
    return [elementwise(pb, node, [x], lambda k, a: f"clamp({a} / 6.0 + 0.5, 0.0, 1.0)")]


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


@register("aten.isnan.default", ALL_FLOAT, samples=lambda: [((rand(3, 5).log(),), {})])
def isnan(pb, node, x):
    return [elementwise(pb, node, [x], lambda k, a: f"tap_isnan({k.need('tap_isnan') and a})", compute="f32",
                        result="bool")]


@register("aten.isinf.default", ALL_FLOAT, samples=lambda: [((rand(3, 5) / rand(3, 5).round(),), {})])
def isinf(pb, node, x):
    return [elementwise(pb, node, [x], lambda k, a: f"((bitcast<u32>({a}) & 0x7fffffffu) == 0x7f800000u)", compute="f32",
                        result="bool")]


def _logic_samples():
    return [((randbool(3, 5),), {}), ((rand(7),), {}), ((randint(2, 3, lo=-2, hi=2),), {})]


@register("aten.logical_not.default", ALL, samples=_logic_samples)
def logical_not(pb, node, x):
    return [elementwise(pb, node, [x], lambda k, a: f"(!{a})", compute="bool")]


@register("aten.bitwise_not.default", ALL_INT + ("bool",),
          samples=lambda: [((randbool(3, 5),), {}), ((randint(4, 4, lo=-9, hi=9),), {})])
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
            e = f"max({e}, {lo})"
        if has_hi:
            hi = bounds.pop(0)
            e = f"min({e}, {hi})"
        return f"select({e}, {a}, {a} != {a})" if ty == "f32" else e
    return fn


@register(["aten.clamp.default", "aten.clamp.Tensor"], NUMERIC,
          samples=lambda: [((rand(3, 5), -0.5, 0.5), {}), ((rand(7), None, 0.3), {}), ((rand(2, 4), -1.0), {}),
                           ((randint(3, 3, lo=-9, hi=9), -2, 3), {}),
                           ((rand(3, 5), rand(5, lo=-1, hi=0), rand(3, 1, lo=0, hi=1)), {}),
                           ((rand(4, 2), None, rand(2)), {})])
def clamp(pb, node, x, min=None, max=None):
    ty = ctype(node.outputs[0].dtype)
    bounds = [b for b in (min, max) if b is not None]
    return [elementwise(pb, node, [x] + bounds, _clamp_fn(ty, min is not None, max is not None))]


@register("aten.clamp_min.default", NUMERIC, samples=lambda: [((rand(3, 5), 0.2), {})])
def clamp_min(pb, node, x, min):
    return clamp(pb, node, x, min=min)


@register("aten.clamp_max.default", NUMERIC, samples=lambda: [((rand(3, 5), 0.2), {})])
def clamp_max(pb, node, x, max):
    return clamp(pb, node, x, max=max)


# --- binary arithmetic -------------------------------------------------------------------

def _binary_samples(scalar=False, ints=True, lo=-3.0, hi=3.0, positive_rhs=False):
    def samples():
        rlo = 0.25 if positive_rhs else lo
        rhs = (lambda *s: rand(*s, lo=rlo, hi=hi))
        if scalar:
            out = [((rand(3, 5, lo=lo, hi=hi), 1.75), {}), ((rand(2, 3, 4, lo=lo, hi=hi), -0.5 if not positive_rhs else 3.0), {})]
            if ints:
                out.append(((randint(4, 6, lo=-20, hi=20), 3), {}))
            return out
        out = [((rand(3, 5, lo=lo, hi=hi), rhs(3, 5)), {}),
               ((rand(2, 1, 4, lo=lo, hi=hi), rhs(3, 1)), {}),
               ((rand(6, lo=lo, hi=hi), rhs(4, 1)), {}),
               ((rand(3, 4, lo=lo, hi=hi), rhs(1)), {})]
        if ints:
            out.append(((randint(4, 6, lo=-20, hi=20), randint(6, lo=1, hi=7)), {}))
            out.append(((randint(4, 6, lo=-20, hi=20), rand(4, 6)), {}))
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


register(["aten.add.Tensor"], ALL, samples=lambda: _binary_samples()() + [((rand(3, 4), rand(3, 4)), {"alpha": 2.0}),
                                                                         ((randbool(5), randbool(5)), {})])(_arith("||")("({x} + {y})"))
register(["aten.add.Scalar"], NUMERIC, samples=_binary_samples(scalar=True))(_arith("||")("({x} + {y})"))
register(["aten.sub.Tensor"], NUMERIC, samples=lambda: _binary_samples()() + [((rand(3, 4), rand(3, 4)), {"alpha": 0.5})])(
    _arith()("({x} - {y})"))
register(["aten.sub.Scalar"], NUMERIC, samples=_binary_samples(scalar=True))(_arith()("({x} - {y})"))
register(["aten.mul.Tensor"], ALL, samples=lambda: _binary_samples()() + [((randbool(5), randbool(5)), {})])(
    _arith("&&")("({x} * {y})"))
register(["aten.mul.Scalar"], NUMERIC, samples=_binary_samples(scalar=True))(_arith("&&")("({x} * {y})"))


@register("aten.rsub.Scalar", NUMERIC, samples=_binary_samples(scalar=True))
def rsub(pb, node, a, b, alpha=1):
    return [elementwise(pb, node, [a, b, alpha], lambda k, x, y, al: f"({y} - {al} * {x})")]


@register(["aten.div.Tensor", "aten.div.Scalar"], NUMERIC,
          samples=lambda: _binary_samples(positive_rhs=True)() + _binary_samples(scalar=True, positive_rhs=True)())
def div(pb, node, a, b):
    return [elementwise(pb, node, [a, b], lambda k, x, y: f"({x} / {y})")]


def _divmode(t, mode):
    if mode is None:
        return lambda k, x, y: f"({x} / {y})"
    if mode == "trunc":
        return (lambda k, x, y: f"trunc({x} / {y})") if t == "f32" else (lambda k, x, y: f"{k.need('tap_div_i')}({x}, {y})")
    if t == "f32":
        return lambda k, x, y: f"floor({x} / {y})"
    return lambda k, x, y: f"{k.need('tap_floordiv_i')}({x}, {y})"


def _divmode_samples():
    out = []
    for mode in ("trunc", "floor"):
        out += [((rand(3, 5, lo=-9, hi=9), rand(3, 5, lo=0.5, hi=3)), {"rounding_mode": mode}),
                ((randint(4, 6, lo=-20, hi=20), randint(6, lo=1, hi=7) * (1 - 2 * randint(6, lo=0, hi=2))),
                 {"rounding_mode": mode}),
                ((rand(3, 5, lo=-9, hi=9), -1.5), {"rounding_mode": mode}),
                ((randint(4, 6, lo=-20, hi=20), 3), {"rounding_mode": mode})]
    return out


@register(["aten.div.Tensor_mode", "aten.div.Scalar_mode"], NUMERIC, samples=_divmode_samples)
def div_mode(pb, node, a, b, rounding_mode=None):
    t = ctype(node.outputs[0].dtype)
    return [elementwise(pb, node, [a, b], _divmode(t, rounding_mode))]


@register(["aten.floor_divide.default", "aten.floor_divide.Scalar"], NUMERIC,
          samples=lambda: [((randint(4, 6, lo=-20, hi=20), randint(6, lo=1, hi=7)), {}),
                           ((rand(3, 5, lo=-9, hi=9), rand(3, 5, lo=0.5, hi=3)), {}),
                           ((randint(4, 6, lo=-20, hi=20), 3), {}), ((rand(3, 5, lo=-9, hi=9), -1.5), {})])
def floor_divide(pb, node, a, b):
    return [elementwise(pb, node, [a, b], _divmode(ctype(node.outputs[0].dtype), "floor"))]


def _mod_samples():
    return [((randint(4, 6, lo=-20, hi=20), randint(6, lo=1, hi=7) * (1 - 2 * randint(6, lo=0, hi=2))), {}),
            ((rand(3, 5, lo=-9, hi=9), rand(3, 5, lo=0.5, hi=3)), {}),
            ((rand(3, 5, lo=-9, hi=9), -1.5), {})]


@register(["aten.remainder.Tensor", "aten.remainder.Scalar"], NUMERIC, samples=_mod_samples)
def remainder(pb, node, a, b):
    t = ctype(node.outputs[0].dtype)
    h = "tap_mod_f" if t == "f32" else "tap_mod_i"
    return [elementwise(pb, node, [a, b], lambda k, x, y: f"{k.need(h)}({x}, {y})")]


@register(["aten.fmod.Tensor", "aten.fmod.Scalar"], NUMERIC, samples=_mod_samples)
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


@register("aten.pow.Tensor_Scalar", NUMERIC,
          samples=lambda: [((rand(3, 5), 2), {}), ((rand(3, 5), 3.0), {}), ((rand(2, 7, lo=0.1, hi=3), 0.5), {}),
                           ((rand(2, 7, lo=0.1, hi=3), 1.7), {}), ((rand(4, 4), -2), {}), ((rand(4, 4), 4), {}),
                           ((randint(3, 4, lo=-5, hi=5), 3), {})])
def pow_tensor_scalar(pb, node, x, e):
    t = ctype(node.outputs[0].dtype)
    return [elementwise(pb, node, [x, e], lambda k, a, b: _pow_expr(k, t, a, b, e), cost=2)]


@register("aten.pow.Tensor_Tensor", NUMERIC,
          samples=lambda: [((rand(3, 5, lo=0.1, hi=3), rand(3, 5)), {}),
                           ((rand(4, 3), rand(3).round()), {}),
                           ((randint(3, 4, lo=-5, hi=5), randint(4, lo=0, hi=4)), {})])
def pow_tensor_tensor(pb, node, x, e):
    t = ctype(node.outputs[0].dtype)
    return [elementwise(pb, node, [x, e], lambda k, a, b: _pow_expr(k, t, a, b), cost=2)]


@register("aten.pow.Scalar", NUMERIC, samples=lambda: [((2.0, rand(3, 5)), {}), ((0.5, rand(7)), {})])
def pow_scalar(pb, node, base, e):
    t = ctype(node.outputs[0].dtype)
    return [elementwise(pb, node, [base, e], lambda k, a, b: _pow_expr(k, t, a, b), cost=2)]


@register(["aten.maximum.default", "aten.minimum.default"], NUMERIC,
          samples=lambda: [((rand(3, 5), rand(3, 5)), {}), ((rand(2, 1, 4), rand(3, 1)), {}),
                           ((randint(4, 6, lo=-20, hi=20), randint(6, lo=-5, hi=7)), {})])
def maximum(pb, node, a, b):
    t = ctype(node.outputs[0].dtype)
    fn = "max" if node.op == "aten.maximum.default" else "min"
    if t == "f32":
        return [elementwise(pb, node, [a, b], lambda k, x, y: f"{k.need('tap_' + fn)}({x}, {y})")]
    if t == "bool":
        op = "||" if fn == "max" else "&&"
        return [elementwise(pb, node, [a, b], lambda k, x, y: f"({x} {op} {y})")]
    return [elementwise(pb, node, [a, b], lambda k, x, y: f"{fn}({x}, {y})")]


@register("aten.atan2.default", NUMERIC, samples=lambda: [((rand(3, 5), rand(3, 5)), {})])
def atan2(pb, node, a, b):
    return [elementwise(pb, node, [a, b], lambda k, x, y: f"atan2({x}, {y})", compute="f32")]


# --- comparisons and logic ---------------------------------------------------------------

_CMP = {"eq": "==", "ne": "!=", "lt": "<", "le": "<=", "gt": ">", "ge": ">="}


def _cmp_samples(scalar):
    def samples():
        a = rand(3, 5).round()
        if scalar:
            return [((a, 1.0), {}), ((rand(2, 3, 4), 0.25), {}), ((randint(4, 6, lo=-3, hi=3), 1), {}),
                    ((randint(7, lo=-3, hi=3), 0.5), {})]
        return [((a, rand(3, 5).round()), {}), ((rand(2, 1, 4).round(), rand(3, 1).round()), {}),
                ((randint(4, 6, lo=-3, hi=3), randint(6, lo=-3, hi=3)), {}), ((randbool(3, 4), randbool(3, 4)), {})]
    return samples


for _name, _sym in _CMP.items():
    def _lower_cmp(pb, node, a, b, _sym=_sym):
        t = promoted([a, b])
        if t == "bool" and _sym not in ("==", "!="):
            t = "i32"
        return [elementwise(pb, node, [a, b], lambda k, x, y: f"({x} {_sym} {y})", compute=t, result="bool")]
    register(f"aten.{_name}.Tensor", ALL, samples=_cmp_samples(False))(_lower_cmp)
    register(f"aten.{_name}.Scalar", ALL, samples=_cmp_samples(True))(_lower_cmp)


def _logic2_samples():
    return [((randbool(3, 5), randbool(3, 5)), {}), ((randbool(2, 1, 4), randbool(3, 1)), {}),
            ((rand(4, 3).round(), randint(4, 3, lo=-1, hi=2)), {})]


for _name, _sym in {"and": "&&", "or": "||", "xor": "!="}.items():
    def _lower_logic(pb, node, a, b, _sym=_sym):
        return [elementwise(pb, node, [a, b], lambda k, x, y: f"({x} {_sym} {y})", compute="bool")]
    register(f"aten.logical_{_name}.default", ALL, samples=_logic2_samples)(_lower_logic)


def _bitwise_samples(scalar):
    def samples():
        if scalar:
            return [((randbool(3, 5), True), {}), ((randint(4, 6, lo=-20, hi=20), 6), {})]
        return [((randbool(3, 5), randbool(3, 5)), {}), ((randbool(2, 1, 4), randbool(3, 1)), {}),
                ((randint(4, 6, lo=-20, hi=20), randint(6, lo=0, hi=15)), {})]
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
            ((randbool(4, 4), randint(4, 4), randint(4, 1)), {})]


@register("aten.where.self", ALL, samples=_where_samples)
def where(pb, node, cond, a, b):
    t = ctype(node.outputs[0].dtype)
    return [elementwise(pb, node, [cond, a, b], lambda k, c, x, y: f"select({y}, {x}, {c})",
                        arg_types=("bool", t, t))]


@register(["aten.where.ScalarSelf", "aten.where.ScalarOther", "aten.where.Scalar"], ALL,
          samples=lambda: [((randbool(3, 5), rand(3, 5), 0.5), {}), ((randbool(3, 5), 0.5, rand(3, 5)), {}),
                           ((randbool(3, 5), 0.5, -2.0), {})])
def where_scalar(pb, node, cond, a, b):
    return where(pb, node, cond, a, b)


@register(["aten.masked_fill.Scalar", "aten.masked_fill.Tensor"], ALL,
          samples=lambda: [((rand(3, 5), randbool(3, 5), -1.5), {}), ((rand(2, 3, 4), randbool(3, 1), 2.0), {}),
                           ((rand(3, 4), randbool(4), rand(())), {})])
def masked_fill(pb, node, x, mask, value):
    return where(pb, node, mask, value, x)


@register("aten.copy.default", ALL, samples=lambda: [((rand(3, 5), rand(3, 5)), {}), ((rand(2, 3, 4), randint(3, 1)), {})])
def copy(pb, node, dst, src, non_blocking=False):
    return [elementwise(pb, node, [src], lambda k, x: x)]


@register("aten.lerp.Scalar", ALL_FLOAT, samples=lambda: [((rand(3, 5), rand(3, 5), 0.3), {})])
def lerp(pb, node, a, b, w):
    return [elementwise(pb, node, [a, b, w], lambda k, x, y, z: f"({x} + {z} * ({y} - {x}))")]


@register("aten.addcmul.default", ALL_FLOAT, samples=lambda: [((rand(3, 5), rand(3, 5), rand(5)), {"value": 0.5})])
def addcmul(pb, node, a, b, c, value=1):
    return [elementwise(pb, node, [a, b, c, value], lambda k, x, y, z, v: f"({x} + {v} * {y} * {z})")]


@register("aten.addcdiv.default", ALL_FLOAT,
          samples=lambda: [((rand(3, 5), rand(3, 5), rand(5, lo=0.5, hi=2)), {"value": 0.5})])
def addcdiv(pb, node, a, b, c, value=1):
    return [elementwise(pb, node, [a, b, c, value], lambda k, x, y, z, v: f"({x} + {v} * {y} / {z})")]

