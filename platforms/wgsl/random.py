"""Random ops: rand, randn, bernoulli, native_dropout, randint, randperm (and their ``_like``s).

Every element is drawn by a counter-based generator on the device: Philox-4x32-10 (the
generator torch uses on CUDA) of the element's row-major index under a 64-bit key. The key is
baked into the shader per node (a hash of the node's name and op), so a program gives the same
values on every run and on every device, and a tensor split across buffers or read through a
view draws the same values as a whole one. It cannot reproduce torch's CPU stream (a Mersenne
Twister whose state is host-side), so these ops are judged on shape, dtype and distribution,
never on values (``compare_values=False`` here; :func:`tapml.compare.compare_distribution`).

- uniform [0, 1): the top 24 random bits times 2**-24 (float16: 11 bits, bfloat16: 8 bits, so
  the value is exact in its dtype and rounding never reaches 1.0, as torch does);
- normal: Box-Muller of two 24-bit uniforms, ``sqrt(-2 ln u1) * cos(2 pi u2)``, u1 in (0, 1];
- bernoulli and dropout: a 24-bit uniform ``u``, ``u < p`` (bernoulli) or kept when ``u >= p``
  (dropout: output ``x * mask * 1/(1-p)``, 0 scale for p = 1, as torch computes it);
- randint: ``low + r mod (high - low)`` of one 32-bit draw;
- randperm: the stable sort of random keys (:func:`tapml.platforms.wgsl.sort.sorted_indices`).
"""

from __future__ import annotations

import zlib

import torch

from tapml.graph import Node
from tapml.platforms.wgsl.codegen import Compute, contiguous_strides, index_sum, lit
from tapml.platforms.wgsl.elementwise import typed
from tapml.platforms.wgsl.registry import ALL, ALL_FLOAT, NUMERIC, edge_floats, rand, randbool, register

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


def normal(node: Node, shape, dtype: str) -> Compute:
    """Standard normal by Box-Muller, rounded to ``dtype``."""
    def fn(k, r, ex):
        u1 = k.let(f"(f32(({r}.x >> 8u) + 1u) * 5.9604644775390625e-08)", "f32")  # (0, 1]: log stays finite
        u2 = k.let(_uniform24(f"{r}.y"), "f32")
        return f"(sqrt(-2.0 * log({u1})) * cos(6.283185307179586 * {u2}))"
    return _random(node, dtype, shape, fn)


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
    if low < -2**31 or high > 2**31:
        return f"{node.op}: the range [{low}, {high}) leaves i32 (WGSL has no 64-bit integers)"
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


#: Every op this module lowers (their values are random: judged by distribution).
RANDOM_LOWERINGS = ("aten.rand.default", "aten.rand_like.default", "aten.randn.default", "aten.randn_like.default",
                    "aten.bernoulli.p", "aten.bernoulli.default", "aten.native_dropout.default",
                    "aten.randint.default", "aten.randint.low", "aten.randint_like.default",
                    "aten.randint_like.low_dtype", "aten.randperm.default")

__all__ = ["node_key", "uniform", "normal", "RANDOM_LOWERINGS"]
