"""Random ops: rand, randn, bernoulli, native_dropout, randint, randperm (and their ``_like``s),
normal (every overload), uniform, exponential, multinomial, cauchy, log_normal, geometric and
rrelu_with_noise_functional.

Every element is drawn by a counter-based generator on the device: Philox-4x32-10 (the
generator torch uses on CUDA) of the element's row-major index under a 64-bit key. The key is
baked into the shader per node (a hash of the node's name and op), so a program gives the same
values on every run and on every device, and a tensor split across buffers or read through a
view draws the same values as a whole one. It cannot reproduce torch's CPU stream (a Mersenne
Twister whose state is host-side), so these ops are judged on shape, dtype and distribution,
never on values (``compare_values=False`` here; :func:`tapml.judging.compare.compare_distribution`).

- uniform [0, 1): the top 24 random bits times 2**-24 (float16: 11 bits, bfloat16: 8 bits, so
  the value is exact in its dtype and rounding never reaches 1.0, as torch does);
- normal: Box-Muller of two 24-bit uniforms, ``sqrt(-2 ln u1) * cos(2 pi u2)``, u1 in (0, 1];
- bernoulli and dropout: a 24-bit uniform ``u``, ``u < p`` (bernoulli) or kept when ``u >= p``
  (dropout: output ``x * mask * 1/(1-p)``, 0 scale for p = 1, as torch computes it);
- randint: ``low + r mod (high - low)`` of one 32-bit draw;
- randperm: the stable sort of random keys (:func:`tapml.platforms.wgsl.sort.sorted_indices`);
- normal with a mean and a std: ``mean + std * z`` of the Box-Muller normal ``z``;
- uniform on [a, b): ``a + (b - a) * u`` of a 24-bit uniform, rounded to the dtype (as torch does);
- exponential: ``-log(u) / lambda`` with u in (0, 1), at least the smallest normal f32 (never 0,
  which would make the Gumbel trick divide by zero);
- multinomial with replacement: each draw inverts its row's cumulative sum with a 24-bit uniform;
  without: the top ``num_samples`` of ``log(p) - log(E)`` per row, E exponential (the Gumbel-top-k
  trick: the same law as drawing one by one without replacement, and what torch does on CPU);
- cauchy: ``median + sigma * tan(pi * (u - 0.5))``, log_normal: ``exp(mean + std * z)``,
  geometric: ``ceil(log(u) / log1p(-p))`` (u in (0, 1), as torch draws them);
- rrelu in training: a slope uniform in [lower, upper) for each element ``<= 0`` (as torch).
"""

from __future__ import annotations

import math
import zlib

import torch

from tapml.judging.compare import NORMAL_ARGUMENTS
from tapml.errors import Unsupported
from tapml.graph import Node, decode_arg
from tapml.platforms.wgsl.codegen import I64, WIDE, Compute, Custom, Value, cast, contiguous_strides, index_sum, lit
from tapml.platforms.wgsl.elementwise import typed
from tapml.platforms.wgsl.registry import ALL, ALL_FLOAT, NUMERIC, edge_floats, rand, randbool, register
from tapml.platforms.wgsl.views import expand_to

# a*b's high 32 bits from 16-bit halves: WGSL has no widening multiply
_PHILOX = """
fn tap_mulhi(a: u32, b: u32) -> u32 {
  let a0 = a & 0xffffu;
  let a1 = a >> 16u;
  let b0 = b & 0xffffu;
  let b1 = b >> 16u;
  let p01 = a0 * b1;
  let p10 = a1 * b0;
  let mid = ((a0 * b0) >> 16u) + (p01 & 0xffffu) + (p10 & 0xffffu);
  return a1 * b1 + (p01 >> 16u) + (p10 >> 16u) + (mid >> 16u);
}

fn tap_philox(counter: u32, key0: u32, key1: u32) -> vec4<u32> {
  var c = vec4<u32>(counter, 0u, 0u, 0u);
  var k0 = key0;
  var k1 = key1;
  for (var r: i32 = 0; r < 10; r = r + 1) {
    let hi0 = tap_mulhi(0xD2511F53u, c.x);
    let hi1 = tap_mulhi(0xCD9E8D57u, c.z);
    c = vec4<u32>(hi1 ^ c.y ^ k0, 0xCD9E8D57u * c.z, hi0 ^ c.w ^ k1, 0xD2511F53u * c.x);
    k0 = k0 + 0x9E3779B9u;
    k1 = k1 + 0xBB67AE85u;
  }
  return c;
}"""

#: random bits of a uniform in [0, 1) by output dtype: exact in that dtype, below 1.0
_UNIFORM_BITS = {"float32": 24, "float16": 11, "bfloat16": 8}


def node_key(node: Node) -> tuple[int, int]:
    """The generator key of ``node``: two u32 words hashed from its name and op (so every node
    of a model draws its own stream, the same on every run)."""
    text = f"{node.name}\0{node.op}".encode()
    return zlib.crc32(text), zlib.crc32(text[::-1] + b"\1")


def _bits(k, node: Node, idx: list[str], shape) -> str:
    """A ``vec4<u32>`` of random bits for the element at ``idx`` of a tensor of ``shape``."""
    k.helpers.setdefault("tap_philox", _PHILOX)
    k0, k1 = node_key(node)
    linear = index_sum(idx, contiguous_strides(shape))
    return k.let(f"tap_philox(u32({linear}), {k0}u, {k1}u)", "vec4<u32>")


def _uniform24(word: str) -> str:
    return f"(f32(({word}) >> 8u) * 5.9604644775390625e-08)"


def _random(node: Node, dtype: str, shape, fn, inputs=()) -> Compute:
    """A Compute of ``shape``/``dtype`` whose element is ``fn(k, bits, exprs)``: ``bits`` the
    element's random ``vec4<u32>``, ``exprs`` the inputs' elements at the same index."""
    def emit(k, exprs, idx):
        return fn(k, _bits(k, node, idx, shape), exprs)
    return Compute(shape, dtype, list(inputs), emit, cost=8)


def _float_out(node: Node) -> str | None:
    dtype = node.outputs[0].dtype
    if dtype not in ALL_FLOAT:
        return f"{node.op} draws float32, float16 or bfloat16 values, not {dtype}"
    return None


def uniform(node: Node, shape, dtype: str) -> Compute:
    """Uniform in [0, 1) in ``dtype`` (see :data:`_UNIFORM_BITS`)."""
    bits = _UNIFORM_BITS[dtype]
    scale = repr(2.0 ** -bits)
    return _random(node, dtype, shape, lambda k, r, ex: f"(f32({r}.x >> {32 - bits}u) * {scale})")


def _box_muller(k, r: str) -> str:
    """A standard normal f32 expression from the random ``vec4<u32>`` ``r``."""
    u1 = k.let(f"(f32(({r}.x >> 8u) + 1u) * 5.9604644775390625e-08)", "f32")  # (0, 1]: log stays finite
    u2 = k.let(_uniform24(f"{r}.y"), "f32")
    return f"(sqrt(-2.0 * log({u1})) * cos(6.283185307179586 * {u2}))"


def normal(node: Node, shape, dtype: str) -> Compute:
    """Standard normal by Box-Muller, rounded to ``dtype``."""
    return _random(node, dtype, shape, lambda k, r, ex: _box_muller(k, r))


# --- samples -------------------------------------------------------------------------------

SHAPES = [[7], [3, 5], [2, 3, 33], [64, 64]]
LOW = (torch.float16, torch.bfloat16)


def _sized_samples():
    return [(([*s],), {}) for s in SHAPES] + [(([40, 50],), {"dtype": d}) for d in LOW] + [(([],), {})]


def _like_samples():
    return ([((rand(*s),), {}) for s in SHAPES[:3]] + [((edge_floats(64, 64),), {})] +
            [((rand(40, 50),), {"dtype": d}) for d in LOW])


def _draws(values):
    """A lowering whose output is ``values(node, shape, dtype)``: the shape and dtype of the node's output."""
    def lower(pb, node, *args, **kwargs):
        meta = node.outputs[0]
        return [values(node, meta.shape, meta.dtype)]
    return lower


for _op, _values, _samples in (("aten.rand.default", uniform, _sized_samples),
                               ("aten.rand_like.default", uniform, _like_samples),
                               ("aten.randn.default", normal, _sized_samples),
                               ("aten.randn_like.default", normal, _like_samples)):
    register(_op, ALL_FLOAT, samples=_samples, check=_float_out, compare_values=False)(_draws(_values))


# --- bernoulli and dropout -----------------------------------------------------------------

def _probabilities(*shape) -> torch.Tensor:
    """Probabilities in [0, 1] with the exact 0 and 1 in the first elements."""
    t = torch.rand(*shape).reshape(-1)
    t[:2] = torch.tensor([0.0, 1.0])[:t.numel()]
    return t.reshape(shape)


def _bernoulli_samples():
    out = [((_probabilities(*s),), {}) for s in SHAPES]  # bernoulli.default: self is p
    out += [((rand(*s), p), {}) for s, p in zip(SHAPES, (0.5, 0.2, 0.9, 0.3))]
    out += [((edge_floats(3, 5), 0.0), {}), ((edge_floats(3, 5), 1.0), {})]
    return out + [((typed((40, 50), d), 0.25), {}) for d in ("int64", "int32", "int16", "int8", "uint8", "bool")]


def _bernoulli_check(node: Node) -> str | None:
    p = node.args[1] if node.op == "aten.bernoulli.p" and len(node.args) > 1 else node.kwargs.get("p", 0.5)
    if isinstance(p, (int, float)) and not 0 <= p <= 1:
        return f"bernoulli: p={p} is not a probability in [0, 1]"
    return None


@register(["aten.bernoulli.p"], ALL, samples=_bernoulli_samples, check=_bernoulli_check, compare_values=False)
def bernoulli_p(pb, node, x, p=0.5, **kwargs):
    meta = node.outputs[0]
    threshold = lit(float(p), "f32")
    return [_random(node, meta.dtype, meta.shape,
                    lambda k, r, ex: _cast_bool(f"({_uniform24(f'{r}.x')} < {threshold})", meta.dtype))]


@register(["aten.bernoulli.default"], ALL_FLOAT, samples=_bernoulli_samples, compare_values=False)
def bernoulli(pb, node, p, **kwargs):
    """Each element is 1 with the probability its input says (torch raises for one outside
    [0, 1]; here such an element is 1 above 1, 0 below 0 or NaN)."""
    meta = node.outputs[0]
    (p,) = pb.fit([p], 1)
    return [_random(node, meta.dtype, meta.shape,
                    lambda k, r, ex: _cast_bool(f"({_uniform24(f'{r}.x')} < {ex[0]})", meta.dtype), [p])]


def _cast_bool(expr: str, dtype: str) -> str:
    if dtype == "bool":
        return expr
    return f"select({'0.0' if dtype in ALL_FLOAT else '0'}, {'1.0' if dtype in ALL_FLOAT else '1'}, {expr})"


def _dropout_samples():
    out = [((rand(*s), p, True), {}) for s, p in zip(SHAPES, (0.5, 0.1, 0.3, 0.2))]
    out += [((edge_floats(5, 7), 0.5, True), {}), ((rand(3, 5), 0.0, True), {}), ((rand(3, 5), 1.0, True), {}),
            ((rand(3, 5), 0.4, False), {}), ((edge_floats(5, 7), 0.3, None), {})]
    return out


def _dropout_check(node: Node) -> str | None:
    p = node.args[1] if len(node.args) > 1 else None
    if not isinstance(p, (int, float)) or isinstance(p, bool) or not 0 <= p <= 1:
        return f"native_dropout: p={p!r} is not a probability in [0, 1]"
    return None


@register(["aten.native_dropout.default"], ALL_FLOAT, samples=_dropout_samples, check=_dropout_check,
          compare_values=False)
def native_dropout(pb, node, x, p, train):
    """Training (``train`` True or None): each element kept with probability ``1 - p`` and scaled
    by ``1 / (1 - p)``, the mask says which; evaluation: the input and an all-True mask."""
    out_meta, mask_meta = node.outputs
    if train is False:
        return [x, Compute(mask_meta.shape, "bool", [], lambda k, exprs, idx: "true")]
    (x,) = pb.fit([x], 1)
    p = float(p)
    scale = lit(0.0 if p >= 1.0 else 1.0 / (1.0 - p), "f32")
    keep = (lambda k, r: f"({_uniform24(f'{r}.x')} >= {lit(p, 'f32')})")
    # the mask in f32 multiplies, so that a dropped NaN or Inf stays NaN as in torch
    out = _random(node, out_meta.dtype, out_meta.shape,
                  lambda k, r, ex: f"(({ex[0]} * select(0.0, 1.0, {keep(k, r)})) * {scale})", [x])
    mask = _random(node, "bool", mask_meta.shape, lambda k, r, ex: keep(k, r))
    return [out, mask]


# --- integers ------------------------------------------------------------------------------

def _randint_bounds(node: Node) -> tuple[int, int]:
    a = node.args
    if node.op == "aten.randint.default":
        return 0, a[0]
    if node.op == "aten.randint.low":
        return a[0], a[1]
    if node.op == "aten.randint_like.default":
        return 0, a[1]
    return a[1], a[2]  # randint_like.low_dtype


def _randint_check(node: Node) -> str | None:
    try:
        low, high = _randint_bounds(node)
    except IndexError:
        return f"{node.op}: missing low/high"
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (low, high)):
        return f"{node.op}: low and high must be integers, not {low!r} and {high!r}"
    if not low < high:
        return f"{node.op}: empty range [{low}, {high})"
    if (low < -2**31 or high > 2**31) and node.outputs[0].dtype not in ("int64", WIDE):
        return f"{node.op}: the range [{low}, {high}) leaves i32, and the output is {node.outputs[0].dtype}"
    if node.outputs[0].dtype == "float64":
        return "float64: WGSL has no 64-bit floats"
    return None


def _randint_samples():
    ints = [(10, [7]), (3, [3, 5]), (1000, [2, 3, 33]), (2**31 - 1, [64, 64])]
    out = [((high, size), {}) for high, size in ints]  # randint.default
    out += [((high, [40, 50]), {"dtype": getattr(torch, d)}) for high, d in (
        (100, "float32"), (1000, "float16"), (100, "bfloat16"), (7, "int32"), (2**15, "int16"), (128, "int8"),
        (256, "uint8"), (2, "bool"))]
    out += [((-5, 5, [3, 5]), {}), ((-2**31, 2**31, [40, 50]), {}), ((0, 7, [40, 50]), {"dtype": torch.int32}),
            ((-100, 100, [40, 50]), {"dtype": torch.float32}), ((0, 2, [64]), {"dtype": torch.bool})]  # .low
    out += [((lo, hi, [40, 50]), {"dtype": d}) for lo, hi, d in ((-2**15, 2**15, torch.int16), (-128, 128, torch.int8),
                                                                 (0, 256, torch.uint8), (-1000, 1000, torch.float16),
                                                                 (-100, 100, torch.bfloat16))]
    out += [((rand(40, 50), 0, 3), {}), ((typed((40, 50), "int64"), -7, 9), {}), ((randbool(64), 0, 2), {}),
            ((rand(40, 50), 100), {}), ((typed((3, 5), "uint8"), 200), {}), ((randbool(64), 2), {}),
            ((rand(40, 50).half(), 0, 1000), {}), ((rand(40, 50).bfloat16(), -50, 50), {})]  # randint_like
    out += [((typed((40, 50), d), -3, 4), {}) for d in ("int32", "int16", "int8")]
    return out


@register(["aten.randint.default", "aten.randint.low", "aten.randint_like.default", "aten.randint_like.low_dtype"],
          ALL, samples=_randint_samples, check=_randint_check, compare_values=False)
def randint(pb, node, *args, **kwargs):
    """``low + r mod (high - low)`` of a 32-bit draw, in u32 arithmetic (a range of 2**32 takes r as is)."""
    meta = node.outputs[0]
    low, high = _randint_bounds(node)
    span = high - low
    if meta.dtype == WIDE:  # low + a 64-bit draw mod the span, in two words
        wrapped = lit(span - 2**64 if span >= 2**63 else span, I64)

        def wide(k, r, ex):
            r64 = f"{I64}({r}.x, {r}.y)"
            drawn = r64 if span == 2**64 else f"tap_u64_divmod({r64}, {wrapped}).zw"
            return f"tap_i64_add({lit(low, I64)}, {drawn})"
        return [_random(node, meta.dtype, meta.shape, wide)]
    drawn = "{r}.x" if span == 2**32 else f"({{r}}.x % {span}u)"
    value = f"bitcast<i32>({low % 2**32}u + {drawn})"

    def fn(k, r, ex):
        v = value.format(r=r)
        if meta.dtype == "bool":
            return f"({v} != 0)"
        return f"f32({v})" if meta.dtype in ALL_FLOAT else v
    return [_random(node, meta.dtype, meta.shape, fn)]


def _randperm_check(node: Node) -> str | None:
    n = node.args[0] if node.args else None
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        return f"randperm: n={n!r} is not a size"
    if node.outputs[0].dtype == "float64":
        return "float64: WGSL has no 64-bit floats"
    return None


@register(["aten.randperm.default"], NUMERIC, check=_randperm_check, flops="reduce", compare_values=False,
          samples=lambda: [((n,), {}) for n in (1, 7, 100, 3000)] +
          [((n,), {"dtype": d}) for n, d in ((500, torch.int32), (300, torch.int16), (100, torch.int8),
                                             (200, torch.uint8), (300, torch.float32), (1000, torch.float16),
                                             (200, torch.bfloat16))])
def randperm(pb, node, n, **kwargs):
    """A stable sort of random i32 keys: their order is a uniformly random permutation (ties,
    one in 2**31 per pair, keep index order)."""
    from tapml.platforms.wgsl.sort import sorted_indices
    if n == 0:
        return [Compute((0,), node.outputs[0].dtype, [], lambda k, exprs, idx: "0")]
    keys = _random(node, "int32", (n,), lambda k, r, ex: f"bitcast<i32>({r}.x >> 1u)")
    return [sorted_indices(pb, keys, 0, False, n)]


# --- normal, uniform, exponential ----------------------------------------------------------

def _scalar(node: Node, i: int, name: str, default):
    """Argument ``i`` (keyword ``name``) of ``node`` decoded, tensors as None."""
    v = node.args[i] if len(node.args) > i else node.kwargs.get(name, default)
    return decode_arg(v, lambda ref: None)


def _real(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _normal_check(node: Node) -> str | None:
    (mi, mname, mdef), (si, sname, sdef) = NORMAL_ARGUMENTS[node.op]
    mean, std = _scalar(node, mi, mname, mdef), _scalar(node, si, sname, sdef)
    if mean is not None and not _real(mean):
        return f"{node.op}: mean={mean!r} is not a number"
    if std is not None and not (_real(std) and std >= 0):
        return f"{node.op}: std={std!r} is not a standard deviation (a number >= 0)"
    return _float_out(node)


def _lower_normal(pb, node, *args, **kwargs):
    """``mean + std * z`` with ``z`` standard normal (Box-Muller); mean and std are tensors
    (broadcast to the output) or numbers, as the overload takes them."""
    meta = node.outputs[0]
    (mi, mname, mdef), (si, sname, sdef) = NORMAL_ARGUMENTS[node.op]
    mean = args[mi] if len(args) > mi else kwargs.get(mname, mdef)
    std = args[si] if len(args) > si else kwargs.get(sname, sdef)
    tensors = pb.fit([expand_to(v, meta.shape) for v in (mean, std) if isinstance(v, Value)], 1)

    def fn(k, r, ex):
        ex = iter(ex)
        m, s = (cast(next(ex), v.ty, "f32") if isinstance(v, Value) else lit(float(v), "f32") for v in (mean, std))
        return f"({m} + {s} * {_box_muller(k, r)})"
    return [_random(node, meta.dtype, meta.shape, fn, tensors)]


def _stds(*shape) -> torch.Tensor:
    """Standard deviations in [0.1, 2) with 0, -0.0, +inf and a subnormal in the first elements."""
    t = rand(*shape, lo=0.1, hi=2.0).reshape(-1)
    edges = torch.tensor([0.0, -0.0, math.inf, 1e-40])[:t.numel()]
    t[:len(edges)] = edges
    return t.reshape(shape)


def _normal_samples(op: str):
    means = (0.0, 1.5, -3.0, 10.0)
    if op == "aten.normal.Tensor_float":
        out = [((rand(*s), std), {}) for s, std in zip(SHAPES, (1.0, 0.5, 2.0, 0.1))]
        out += [((edge_floats(5, 7), 0.5), {}), ((rand(3, 5), 0.0), {}), ((rand(40, 50, lo=-100, hi=100), 3.0), {})]
        return out + [((rand(40, 50).to(d), 2.0), {}) for d in LOW] + [((torch.tensor(1.5),), {})]
    if op == "aten.normal.float_Tensor":
        out = [((m, rand(*s, lo=0.1, hi=2.0)), {}) for s, m in zip(SHAPES, means)]
        return out + [((0.5, _stds(5, 7)), {})] + [((-1.0, rand(40, 50, lo=0.1, hi=3.0).to(d)), {}) for d in LOW]
    if op == "aten.normal.Tensor_Tensor":
        out = [((rand(*s), rand(*s, lo=0.1, hi=2.0)), {}) for s in SHAPES]
        out += [((rand(3, 1), _stds(6)), {}), ((edge_floats(5, 7), _stds(5, 7)), {}),
                ((rand(40, 50), rand(50, lo=0.1, hi=1.0).half()), {})]  # float32 and float16: float32 out
        return out + [((rand(40, 50).to(d), rand(40, 50, lo=0.1, hi=3.0).to(d)), {}) for d in LOW]
    if op == "aten.normal.float_float":
        out = [((m, std, s), {}) for s, m, std in zip(SHAPES, means, (1.0, 0.5, 3.0, 0.1))]
        out += [((1.0, 0.0, [3, 5]), {}), ((0.0, 1.0, []), {})]
        return out + [((-2.0, 4.0, [40, 50]), {"dtype": d}) for d in LOW]
    out = [((rand(*s),), {}) for s in SHAPES]  # normal_functional: self gives the shape and dtype
    out += [((edge_floats(64, 64), 2.0, 3.0), {}), ((rand(3, 5), 1.0, 0.0), {}), ((rand(5, 7), -4.0, 0.25), {})]
    return out + [((rand(40, 50).to(d), 1.0, 2.0), {}) for d in LOW]


for _op in NORMAL_ARGUMENTS:
    register(_op, ALL_FLOAT, samples=lambda op=_op: _normal_samples(op), check=_normal_check,
             compare_values=False)(_lower_normal)


def _uniform_check(node: Node) -> str | None:
    low, high = _scalar(node, 1, "from", 0.0), _scalar(node, 2, "to", 1.0)
    if not (_real(low) and _real(high) and math.isfinite(low) and math.isfinite(high) and low <= high):
        return f"uniform: [{low!r}, {high!r}) is not a range of finite numbers with from <= to"
    reason = _float_out(node)
    if reason is None and high - low > torch.finfo(getattr(torch, node.outputs[0].dtype)).max:
        return f"uniform: to - from = {high - low:g} overflows {node.outputs[0].dtype}"
    return reason


@register(["aten.uniform.default"], ALL_FLOAT, check=_uniform_check, compare_values=False,
          samples=lambda: [((rand(*s), a, b), {}) for s, (a, b) in zip(SHAPES, ((0.0, 1.0), (-1.0, 2.0), (5.0, 6.5),
                                                                                  (-100.0, 100.0)))] +
          [((edge_floats(64, 64), -0.5, 0.5), {}), ((rand(3, 5),), {}), ((rand(3, 5), 2.0, 2.0), {})] +
          [((rand(40, 50).to(d), -1.0, 3.0), {}) for d in LOW])
def uniform_range(pb, node, x, low=0.0, high=1.0, **kwargs):
    """``x.uniform_(from, to)`` functionalized: ``from + (to - from) * u``, u a 24-bit uniform in
    [0, 1), rounded to the dtype (so, as in torch, ``to`` itself only by that rounding)."""
    meta = node.outputs[0]
    low, high = kwargs.get("from", low), kwargs.get("to", high)  # keywords Python cannot name
    a, span = lit(float(low), "f32"), lit(float(high) - float(low), "f32")
    return [_random(node, meta.dtype, meta.shape, lambda k, r, ex: f"({a} + {span} * {_uniform24(f'{r}.x')})")]


def _exponential_check(node: Node) -> str | None:
    lambd = _scalar(node, 1, "lambd", 1.0)
    if not (_real(lambd) and math.isfinite(lambd) and lambd > 0):
        return f"exponential: lambd={lambd!r} is not a finite rate > 0"
    return _float_out(node)


@register(["aten.exponential.default"], ALL_FLOAT, check=_exponential_check, compare_values=False,
          samples=lambda: [((rand(*s), lam), {}) for s, lam in zip(SHAPES, (1.0, 0.5, 2.0, 10.0))] +
          [((edge_floats(64, 64), 3.0), {}), ((rand(3, 5),), {}), ((rand(40, 50), 1e-3), {})] +
          [((rand(40, 50).to(d), 1.0), {}) for d in LOW])
def exponential(pb, node, x, lambd=1.0, **kwargs):
    """``x.exponential_(lambd)`` functionalized: ``-log(u) / lambd``, u in (0, 1)."""
    meta = node.outputs[0]
    rate = lit(float(lambd), "f32")

    def fn(k, r, ex):
        u = k.let(f"((f32({r}.x >> 8u) + 0.5) * 5.9604644775390625e-08)", "f32")
        return f"max(-log({u}) / {rate}, 1.1754943508222875e-38)"
    return [_random(node, meta.dtype, meta.shape, fn)]


# --- bernoulli with a tensor p, multinomial ------------------------------------------------

@register(["aten.bernoulli.Tensor"], ALL, compare_values=False,
          samples=lambda: [((rand(*s), _probabilities(*s)), {}) for s in SHAPES] +
          [((rand(3, 5), _probabilities(5)), {}), ((edge_floats(5, 7), _probabilities(5, 7)), {})] +
          [((typed((40, 50), d), _probabilities(40, 50)), {}) for d in ("int64", "int32", "int16", "int8", "uint8",
                                                                        "bool")] +
          [((rand(40, 50).to(d), _probabilities(40, 50).to(d)), {}) for d in LOW])
def bernoulli_tensor(pb, node, x, p, **kwargs):
    """``x.bernoulli_(p)`` functionalized: 1 where a 24-bit uniform is below ``p`` (broadcast to
    ``x``), in ``x``'s dtype."""
    meta = node.outputs[0]
    (p,) = pb.fit([expand_to(p, meta.shape)], 1)
    return [_random(node, meta.dtype, meta.shape, lambda k, r, ex: _cast_bool(
        f"({_uniform24(f'{r}.x')} < {cast(ex[0], p.ty, 'f32')})", meta.dtype), [p])]


def _multinomial_check(node: Node) -> str | None:
    n, replacement = _scalar(node, 1, "num_samples", None), _scalar(node, 2, "replacement", False)
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        return f"multinomial: num_samples={n!r} is not a count >= 1"
    if not isinstance(replacement, bool):
        return f"multinomial: replacement={replacement!r} is not a bool"
    if len(node.outputs[0].shape) not in (1, 2):
        return "multinomial: the probabilities must be one row or a matrix of rows"
    return None


def _weights(rows: int, k: int, zeros: int = 0) -> torch.Tensor:
    """Unnormalized category weights (torch takes any), every ``zeros``-th category weightless."""
    w = torch.rand(rows, k) + 0.05
    if zeros:
        w[:, ::zeros] = 0.0
    return w


def _multinomial_samples():
    return [((torch.softmax(torch.randn(4, 10), -1), 1), {}), ((_weights(8, 16, 3), 5, True), {}),
            ((_weights(1, 100)[0], 20), {}), ((_weights(1, 1000, 2)[0], 3, True), {}),
            ((_weights(64, 64, 4), 48), {}), ((torch.tensor([[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]]), 1), {}),
            ((torch.tensor([0.0, 1.0, 2.0]), 2), {}), ((torch.softmax(torch.randn(1, 5000), -1), 1), {}),
            ((torch.softmax(torch.randn(1, 5000), -1), 4, True), {}), ((_weights(0, 5), 2), {})] + \
        [((torch.softmax(torch.randn(6, 30), -1).to(d), 3, r), {}) for d, r in zip(LOW, (False, True))]


@register(["aten.multinomial.default"], ALL_FLOAT, samples=_multinomial_samples, check=_multinomial_check,
          flops="reduce", compare_values=False)
def multinomial(pb, node, p, num_samples, replacement=False, **kwargs):
    """int64 indices of categories drawn from each row of weights ``p`` (torch's conditions on
    ``p`` -- finite, >= 0, a positive sum -- are torch's to enforce; weights that are not > 0 are
    never drawn). With replacement, each draw walks its row's cumulative sum to a uniform point
    of it; without, the row's categories are sorted by a Gumbel key ``log(p) - log(E)``."""
    meta = node.outputs[0]
    count = p.shape[-1]
    if not replacement:
        from tapml.platforms.wgsl.sort import sorted_indices
        if num_samples > count:
            raise Unsupported(f"multinomial: {num_samples} samples without replacement from {count} categories")

        def key(k, r, ex):
            u = k.let(f"((f32({r}.x >> 8u) + 0.5) * 5.9604644775390625e-08)", "f32")
            w = cast(ex[0], p.ty, "f32")
            return f"select(-1e30, log({w}) - log(-log({u})), {w} > 0.0)"  # keys lie in [-110, 110]
        keys = _random(node, "float32", p.shape, key, pb.fit([p], 0))
        return [sorted_indices(pb, keys, len(p.shape) - 1, True, num_samples)]
    p = pb.plain(p)  # every draw reads its whole row: computed once

    def draw(k, idx):
        row = list(idx[:-1])
        total, last = k.var("f32", "0.0", "total"), k.var("i32", "0", "last")
        j = k.fresh("j")
        k.loop(j, count)
        w = k.let(cast(p.read(k, row + [j]), p.ty, "f32"), "f32")
        k.emit(f"if ({w} > 0.0) {{ {total} = {total} + {w}; {last} = {j}; }}")
        k.close()
        point = k.let(f"({_uniform24(f'{_bits(k, node, idx, meta.shape)}.x')} * {total})", "f32")
        acc, pick = k.var("f32", "0.0", "acc"), k.var("i32", last, "pick")  # past the sum by rounding: the last
        j = k.fresh("j")
        k.loop(j, count)
        w = k.let(cast(p.read(k, row + [j]), p.ty, "f32"), "f32")
        k.open(f"if ({w} > 0.0)")
        k.emit(f"{acc} = {acc} + {w};")
        k.emit(f"if ({acc} > {point}) {{ {pick} = {j}; break; }}")
        k.close()
        k.close()
        return pick
    return [Custom(meta.shape, meta.dtype, [p], draw, cost=8)]


# --- cauchy, log_normal, geometric, rrelu -------------------------------------------------

def _open_uniform(k, r: str) -> str:
    """A 24-bit uniform in (0, 1) (never 0 nor 1: the logs and tangents below stay finite)."""
    return k.let(f"((f32({r}.x >> 8u) + 0.5) * 5.9604644775390625e-08)", "f32")


def _positive_check(name: str, i: int, keyword: str, default):
    def check(node: Node) -> str | None:
        v = _scalar(node, i, keyword, default)
        if not (_real(v) and math.isfinite(v) and v > 0):
            return f"{node.op}: {keyword}={v!r} is not a finite number > 0"
        if not _real(_scalar(node, 1, name, 0.0)) or not math.isfinite(_scalar(node, 1, name, 0.0)):
            return f"{node.op}: {name} is not a finite number"
        return _float_out(node)
    return check


def _located_samples(a: float, b: float):
    return ([((rand(*s), a + i, b * (i + 1)), {}) for i, s in enumerate(SHAPES)] +
            [((edge_floats(64, 64),), {}), ((rand(3, 5), -2.0, 0.01), {})] +
            [((rand(40, 50).to(d), a, b), {}) for d in LOW])


@register(["aten.cauchy.default"], ALL_FLOAT, check=_positive_check("median", 2, "sigma", 1.0),
          compare_values=False, samples=lambda: _located_samples(0.0, 1.0))
def cauchy(pb, node, x, median=0.0, sigma=1.0, **kwargs):
    """``x.cauchy_(median, sigma)`` functionalized: ``median + sigma * tan(pi * (u - 0.5))``, u in (0, 1)."""
    meta = node.outputs[0]
    m, s = lit(float(median), "f32"), lit(float(sigma), "f32")
    return [_random(node, meta.dtype, meta.shape,
                    lambda k, r, ex: f"({m} + {s} * tan(3.141592653589793 * ({_open_uniform(k, r)} - 0.5)))")]


@register(["aten.log_normal.default"], ALL_FLOAT, check=_positive_check("mean", 2, "std", 2.0),
          compare_values=False, samples=lambda: _located_samples(-1.0, 0.5))
def log_normal(pb, node, x, mean=1.0, std=2.0, **kwargs):
    """``x.log_normal_(mean, std)`` functionalized: ``exp(mean + std * z)``, z standard normal (Box-Muller)."""
    meta = node.outputs[0]
    m, s = lit(float(mean), "f32"), lit(float(std), "f32")
    return [_random(node, meta.dtype, meta.shape, lambda k, r, ex: f"exp({m} + {s} * {_box_muller(k, r)})")]


#: -log of the smallest open uniform drawn, 2**-25: no geometric draw is above this / -log1p(-p)
_MAX_NEG_LOG_U = 25 * math.log(2)


def _geometric_check(node: Node) -> str | None:
    p = _scalar(node, 1, "p", None)
    if not (_real(p) and 0 < p < 1):
        return f"geometric: p={p!r} is not a probability in (0, 1)"
    dtype = node.outputs[0].dtype
    if dtype == "bool" or dtype == "float64":
        return f"geometric draws float32, float16, bfloat16 or integer values, not {dtype}"
    if dtype in NUMERIC and dtype not in ALL_FLOAT:
        largest = torch.iinfo(getattr(torch, dtype)).max
        if math.ceil(_MAX_NEG_LOG_U / -math.log1p(-p)) > min(largest, 2**31 - 1):
            return f"geometric: p={p:g} draws values past {dtype}'s range (torch wraps them around)"
    return None


@register(["aten.geometric.default"], NUMERIC, check=_geometric_check, compare_values=False,
          samples=lambda: [((rand(*s), p), {}) for s, p in zip(SHAPES, (0.5, 0.2, 0.9, 0.05))] +
          [((edge_floats(64, 64), 0.3), {}), ((rand(40, 50), 1e-4), {})] +
          [((rand(40, 50).to(d), 0.1), {}) for d in LOW] +
          [((typed((40, 50), d), p), {}) for d, p in (("int64", 0.01), ("int32", 0.3), ("int16", 0.05),
                                                      ("int8", 0.5), ("uint8", 0.4))])
def geometric(pb, node, x, p, **kwargs):
    """``x.geometric_(p)`` functionalized: ``ceil(log(u) / log1p(-p))`` (at least 1), u in (0, 1);
    ``log1p(-p)`` is computed here, in double precision."""
    meta = node.outputs[0]
    rate = lit(math.log1p(-float(p)), "f32")

    def fn(k, r, ex):
        v = f"max(ceil(log({_open_uniform(k, r)}) / {rate}), 1.0)"
        return v if meta.dtype in ALL_FLOAT else f"i32({v})"
    return [_random(node, meta.dtype, meta.shape, fn)]


def _rrelu_check(node: Node) -> str | None:
    lower, upper = _scalar(node, 2, "lower", 0.125), _scalar(node, 3, "upper", 1 / 3)
    if not (_real(lower) and _real(upper) and math.isfinite(lower) and math.isfinite(upper) and lower <= upper):
        return f"rrelu: [{lower!r}, {upper!r}] is not a range of finite numbers with lower <= upper"
    training = _scalar(node, 4, "training", False)
    if not isinstance(training, bool):
        return f"rrelu: training={training!r} is not a bool"
    return _float_out(node)


def _rrelu_samples():
    out = [((rand(*s), torch.zeros(s), lo, hi, True), {}) for s, (lo, hi) in zip(
        SHAPES, ((0.125, 1 / 3), (0.1, 0.3), (0.0, 1.0), (-0.5, 2.0)))]
    out += [((edge_floats(64, 64), rand(64, 64), 0.2, 0.4, True), {}), ((rand(3, 5), rand(3, 5), 0.25, 0.25, True), {}),
            ((edge_floats(5, 7), rand(5, 7), 0.1, 0.3, False), {}), ((rand(3, 5), rand(3, 5)), {})]
    return out + [((rand(40, 50).bfloat16(), torch.zeros(40, 50).bfloat16(), 0.1, 0.5, True), {}),
                  ((rand(40, 50).bfloat16(), rand(40, 50).bfloat16(), 0.1, 0.5, False), {}),
                  ((edge_floats(40, 50).half(), rand(40, 50).half(), 0.2, 0.3, False), {})]  # torch: no f16 training


@register(["aten.rrelu_with_noise_functional.default"], ALL_FLOAT, check=_rrelu_check, compare_values=False,
          samples=_rrelu_samples)
def rrelu_with_noise(pb, node, x, noise, lower=0.125, upper=1 / 3, training=False, generator=None):
    """Training: where ``x <= 0`` a slope ``r`` uniform in [lower, upper) draws ``x * r`` (r in
    f32, as torch multiplies before rounding) and the noise output holds ``r``; elsewhere ``x``
    and 1. Evaluation: ``leaky_relu(x, (lower + upper) / 2)`` and the noise unchanged."""
    out_meta, noise_meta = node.outputs
    (x,) = pb.fit([x], 1)
    if not training:
        slope = lit((float(lower) + float(upper)) / 2, "f32")
        return [Compute(out_meta.shape, out_meta.dtype, [x], lambda k, e, idx: (
            f"select({cast(e[0], x.ty, 'f32')} * {slope}, {cast(e[0], x.ty, 'f32')}, {cast(e[0], x.ty, 'f32')} > 0.0)")),
            noise]
    a, span = lit(float(lower), "f32"), lit(float(upper) - float(lower), "f32")

    def slope(k, r):
        return k.let(f"({a} + {span} * {_uniform24(f'{r}.x')})", "f32")

    def out(k, r, ex):
        v = k.let(cast(ex[0], x.ty, "f32"), "f32")
        return f"select({v}, {v} * {slope(k, r)}, {v} <= 0.0)"

    def drawn(k, r, ex):
        return f"select(1.0, {slope(k, r)}, {cast(ex[0], x.ty, 'f32')} <= 0.0)"
    return [_random(node, out_meta.dtype, out_meta.shape, out, [x]),
            _random(node, noise_meta.dtype, noise_meta.shape, drawn, [x])]


#: Every op this module lowers (their values are random: judged by distribution).

__all__ = ["node_key", "uniform", "normal"]
