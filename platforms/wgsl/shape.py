"""Shape ops (views are strides, not copies), copies/casts, cat/split, padding, and tensor
creation (arange, full, zeros/ones/empty and their _like variants)."""

from __future__ import annotations

import math

from tapml.errors import Unsupported
from tapml.platforms.wgsl import views
from tapml.platforms.wgsl.codegen import I64, BufferView, Compute, Custom, Remap, Value, cast, ctype, index_sum, lit
from tapml.platforms.wgsl.registry import ALL, ALL_INT, NUMERIC, rand, randbool, randint, register


def _x(*shape):
    return rand(*shape)


@register(["aten.view.default", "aten._unsafe_view.default", "aten.reshape.default"], ALL,
          samples=lambda: [((_x(2, 3, 4), [6, 4]), {}), ((_x(24), [2, -1, 3]), {}), ((randint(4, 6), [24]), {})], view=True)
def view(pb, node, x, shape):
    return [views.reshape(x, shape)]


@register("aten.permute.default", ALL, samples=lambda: [((_x(2, 3, 4), [2, 0, 1]), {}), ((_x(5, 6), [1, 0]), {})], view=True)
def permute(pb, node, x, dims):
    return [views.permute(x, dims)]


@register("aten.t.default", ALL, samples=lambda: [((_x(5, 6),), {}), ((_x(4),), {})], view=True)
def t(pb, node, x):
    return [views.permute(x, [1, 0]) if len(x.shape) == 2 else x]


@register("aten.transpose.int", ALL, samples=lambda: [((_x(2, 3, 4), 0, 2), {}), ((_x(5, 6), -1, -2), {})], view=True)
def transpose(pb, node, x, d0, d1):
    nd = len(x.shape)
    dims = list(range(nd))
    a, b = views.norm_dim(d0, nd), views.norm_dim(d1, nd)
    dims[a], dims[b] = dims[b], dims[a]
    return [views.permute(x, dims)]


@register("aten.expand.default", ALL, samples=lambda: [((_x(3, 1), [2, 3, 4]), {}), ((_x(1, 4), [-1, 5, -1]), {})], view=True)
def expand(pb, node, x, size, implicit=False):
    return [views.expand_to(x, node.outputs[0].shape)]


@register("aten.slice.Tensor", ALL,
          samples=lambda: [((_x(4, 10), 1, 2, 9), {}), ((_x(6, 5), 0, 1, None, 2), {}), ((_x(8, 3), 0, -3), {}),
                           ((_x(5, 4), -1, 0, 9223372036854775807), {})], view=True)
def slice_(pb, node, x, dim=0, start=None, end=None, step=1):
    return [views.slice_(x, dim, start, end, step)]


@register("aten.select.int", ALL, samples=lambda: [((_x(4, 10), 1, 2), {}), ((_x(3, 5, 2), 0, -1), {})], view=True)
def select(pb, node, x, dim, index):
    return [views.select(x, dim, index)]


@register("aten.unsqueeze.default", ALL, samples=lambda: [((_x(4, 5), 1), {}), ((_x(3), -1), {}), ((_x(3), 0), {})], view=True)
def unsqueeze(pb, node, x, dim):
    return [views.unsqueeze(x, dim)]


@register(["aten.squeeze.dim", "aten.squeeze.dims", "aten.squeeze.default"], ALL,
          samples=lambda: [((_x(4, 1, 5), 1), {}), ((_x(1, 3, 1),), {}), ((_x(1, 3, 1), [0, 2]), {})], view=True)
def squeeze(pb, node, x, dim=None):
    dims = None if dim is None else ([dim] if isinstance(dim, int) else list(dim))
    return [views.squeeze(x, dims)]


@register(["aten.alias.default", "aten.detach.default"], ALL, samples=lambda: [((_x(3, 5),), {}), ((randint(4, 2),), {})],
          view=True)
@register(["aten.clone.default", "aten.lift_fresh_copy.default", "aten.contiguous.default"], ALL,
          samples=lambda: [((_x(3, 5),), {}), ((randint(4, 2),), {})])
def identity(pb, node, x, **kwargs):
    return [x]


def _to_copy_samples():
    import torch
    return [((_x(3, 5),), {"dtype": torch.int64}), ((randint(2, 7, lo=-5, hi=5),), {"dtype": torch.float32}),
            ((randbool(3, 4),), {"dtype": torch.float32}), ((_x(4, 2),), {"dtype": torch.bool}),
            ((_x(4, 2),), {}), ((randint(3, 3),), {"dtype": torch.int32}), ((_x(5),), {"dtype": torch.float16})]


@register(["aten._to_copy.default", "aten.to.dtype"], ALL, samples=_to_copy_samples)
def to_copy(pb, node, x, dtype=None, **kwargs):
    out = node.outputs[0].dtype
    if out == x.dtype:
        return [x]
    src, dst = x.ty, ctype(out)
    return [Compute(x.shape, out, [x], lambda k, e, idx: cast(e[0], src, dst))]


# --- cat / split -------------------------------------------------------------------------

def _cat_samples():
    return [(([_x(2, 3), _x(2, 5)], 1), {}), (([_x(2, 3), _x(4, 3), _x(1, 3)],), {}),
            (([randint(3, 2), randint(3, 4)], -1), {}), (([_x(3, 2)] * 9, 0), {}),
            # parts with no elements (OpInfo's stack samples of (0, 1, 0) tensors)
            (([_x(0, 1, 0), _x(0, 1, 0)], 1), {}), (([_x(0, 3), _x(2, 3)], 0), {})]


@register("aten.cat.default", ALL, samples=_cat_samples)
def cat(pb, node, tensors, dim=0):
    meta = node.outputs[0]
    parts = [t for t in tensors if not (len(t.shape) == 1 and t.shape[0] == 0)]
    dim = views.norm_dim(dim, len(meta.shape))
    if meta.numel and len([t for t in parts if t.shape[dim]]) <= LAZY_CAT_PARTS:
        return [_lazy_cat(pb, meta, [t for t in parts if t.shape[dim]], dim)]
    out = pb.buffer("temp", meta)
    whole = BufferView.whole(out, meta)
    start = 0
    for t in parts:  # one copy kernel per input keeps every kernel within the binding limit
        n = t.shape[dim]
        if t.numel:  # a part with no elements copies nothing (and its kernel would bind an empty buffer)
            dst = views.slice_(whole, dim, start, start + n)
            k = pb.kernel("cat")
            idx = k.unravel("n", t.shape)
            src = t if t.dtype == meta.dtype else Compute(t.shape, meta.dtype, [t],
                                                           lambda kk, e, i, s=t.ty: cast(e[0], s, ctype(meta.dtype)))
            e = src.read(k, idx)
            k.write(out, index_sum(idx, dst.strides, dst.offset), e, src.ty)
            pb.add(k.finish(t.numel))
        start += n
    return [whole]


#: Most parts a cat is read through lazily (an element picks its part where it is read, so a
#: rotary embedding's ``cat((-x2, x1))`` fuses into the kernel that reads it); more are copied.
LAZY_CAT_PARTS = 4


def _lazy_cat(pb, meta, parts: list, dim: int) -> Value:
    parts = pb.fit(parts, 1)
    ty = ctype(meta.dtype)
    starts = [0]
    for t in parts[:-1]:
        starts.append(starts[-1] + t.shape[dim])

    def fn(k, idx):
        element = k.var(ty, lit(0, ty), "cat")
        for j, (t, start) in enumerate(zip(parts, starts)):
            last = j == len(parts) - 1
            cond = f"({idx[dim]} < {start + t.shape[dim]})"
            k.open("else" if last and j else "if (true)" if last else ("if " if j == 0 else "else if ") + cond)
            at = list(idx)
            at[dim] = f"({idx[dim]} - {start})" if start else idx[dim]
            k.emit(f"{element} = {cast(t.read(k, at), t.ty, ty)};")
            k.close()
        return element
    return Custom(meta.shape, meta.dtype, parts, fn)


@register("aten.split_with_sizes.default", ALL,
          samples=lambda: [((_x(4, 9), [2, 3, 4], 1), {}), ((_x(5, 2), [1, 4]), {})], view=True)
def split_with_sizes(pb, node, x, sizes, dim=0):
    out, start = [], 0
    for s in sizes:
        out.append(views.slice_(x, dim, start, start + s))
        start += s
    return out


@register("aten.split.Tensor", ALL, samples=lambda: [((_x(4, 9), 4, 1), {}), ((_x(6, 2), 3), {})], view=True)
def split(pb, node, x, size, dim=0):
    return split_with_sizes(pb, node, x, [m.shape[views.norm_dim(dim, len(x.shape))] for m in node.outputs], dim)


@register("aten.unbind.int", ALL, samples=lambda: [((_x(3, 4), 0), {}), ((_x(2, 3), 1), {})], view=True)
def unbind(pb, node, x, dim=0):
    return [views.select(x, dim, i) for i in range(x.shape[views.norm_dim(dim, len(x.shape))])]


@register("aten.constant_pad_nd.default", ALL,
          samples=lambda: [((_x(2, 3, 4), [1, 2]), {}), ((_x(2, 3, 4), [1, 0, 0, 2], 1.5), {}),
                           ((_x(3, 6), [-1, 2]), {})])
def constant_pad_nd(pb, node, x, pad, value=0):
    meta = node.outputs[0]
    nd = len(meta.shape)
    lows = [0] * nd
    for i in range(len(pad) // 2):
        lows[nd - 1 - i] = pad[2 * i]
    src_shape = x.shape
    ty = ctype(meta.dtype)

    class Pad(Value):
        shape, dtype, cost = meta.shape, meta.dtype, 1 + x.cost

        def bufs(self):
            return x.bufs()

        def read(self, k, idx):
            src_idx, conds = [], []
            for i, lo, size in zip(idx, lows, src_shape):
                j = k.let(f"({i} + {-lo})", "i32") if lo else i
                src_idx.append(f"clamp({j}, 0, {size - 1})")
                if lo != 0 or size != meta.shape[len(src_idx) - 1]:
                    conds.append(f"({j} >= 0 && {j} < {size})")
            inside = " && ".join(conds) or "true"
            clamped = [k.let(s, "i32") for s in src_idx]
            v = cast(x.read(k, clamped), x.ty, ty)
            return k.let(f"select({lit(scalar_as(value, meta.dtype), ty)}, {v}, {inside})", ty)
    return [Pad()]


@register("aten.repeat.default", ALL, samples=lambda: [((_x(2, 3), [2, 2]), {}), ((_x(3), [2, 1, 2]), {})])
def repeat(pb, node, x, repeats):
    meta = node.outputs[0]
    lead = len(meta.shape) - len(x.shape)

    def fn(k, idx):
        return [f"({i} % {s})" if s != 1 else "0" for i, s in zip(idx[lead:], x.shape)]
    return [Remap(x, meta.shape, fn)]


@register("aten.flip.default", ALL, samples=lambda: [((_x(3, 4), [1]), {}), ((_x(2, 3, 2), [0, 2]), {})])
def flip(pb, node, x, dims):
    nd = len(x.shape)
    dims = {views.norm_dim(d, nd) for d in dims}
    return [Remap(x, x.shape, lambda k, idx: [f"({x.shape[d] - 1} - {i})" if d in dims else i
                                               for d, i in enumerate(idx)])]


@register(["aten.tril.default", "aten.triu.default"], ALL,
          samples=lambda: [((_x(4, 5),), {}), ((_x(2, 5, 3), 1), {}), ((_x(4, 4), -1), {})])
def tril(pb, node, x, diagonal=0):
    lower = node.op == "aten.tril.default"
    zero = lit(0, x.ty)

    def emit(k, e, idx):
        r, c = idx[-2], idx[-1]
        keep = f"({c} - {r} <= {diagonal})" if lower else f"({c} - {r} >= {diagonal})"
        return f"select({zero}, {e[0]}, {keep})"
    return [Compute(x.shape, x.dtype, [x], emit)]


# --- creation ----------------------------------------------------------------------------

def scalar_as(value, dtype: str):
    """A Python scalar as torch stores it in a tensor of ``dtype``: truncated toward zero for the
    integers (fill 1.5 into an int tensor gives 1), a truth value for bool."""
    if dtype == "bool":
        return bool(value)
    if dtype in ALL_INT and isinstance(value, float):
        if not math.isfinite(value):
            raise Unsupported(f"{value} cannot be stored in a {dtype} tensor")
        return math.trunc(value)
    return value


def _fill(meta, value):
    ty = ctype(meta.dtype)
    v = lit(scalar_as(value, meta.dtype), ty)
    return Compute(meta.shape, meta.dtype, [], lambda k, e, idx: v, cost=0)


def _in_every_dtype(args, dtypes=ALL_INT + ("bool",)):
    """One sample of a creation op per dtype (its dtype is an argument, not an input's)."""
    import torch
    return [(args, {"dtype": getattr(torch, d)}) for d in dtypes]


def _creation_samples():
    import torch
    return [(([3, 4], 1.5), {}), (([2, 2], 7), {"dtype": torch.int64}), (([5], True), {"dtype": torch.bool}),
            (([], -3.4028234663852886e+38), {"dtype": torch.float32}), (([2, 3], 200), {"dtype": torch.uint8}),
            (([4], -2.75), {"dtype": torch.int8}), (([3, 2], 2**31 - 1), {"dtype": torch.int32}),
            (([2, 5], -2**15), {"dtype": torch.int16})]


@register("aten.full.default", ALL, samples=_creation_samples)
def full(pb, node, size, fill_value, **kwargs):
    return [_fill(node.outputs[0], fill_value)]


@register("aten.scalar_tensor.default", ALL, samples=lambda: [((2.5,), {}), ((-3.4028234663852886e+38,), {}),
                                                              ((float("-inf"),), {})] + _in_every_dtype((-7,)))
def scalar_tensor(pb, node, value, **kwargs):
    return [_fill(node.outputs[0], value)]


@register(["aten.full_like.default", "aten.new_full.default"], ALL,
          samples=lambda: [((_x(3, 4), 2.0), {}), ((randint(2, 3), -1), {}), ((_x(3, 4), [2, 5], 2.0), {})])
def full_like(pb, node, x, *args, **kwargs):
    value = args[0] if node.op == "aten.full_like.default" else args[1]
    return [_fill(node.outputs[0], value)]


@register(["aten.zeros_like.default", "aten.new_zeros.default", "aten.zeros.default"], ALL,
          samples=lambda: [((_x(3, 4),), {}), ((randint(2, 3),), {}), (([3, 4],), {}), ((_x(2), [3, 4]), {})] +
          _in_every_dtype(([3, 4],)))
def zeros(pb, node, *args, **kwargs):
    return [_fill(node.outputs[0], 0)]


@register(["aten.empty_like.default", "aten.new_empty.default", "aten.empty.memory_format",
           "aten.empty_strided.default", "aten.empty_permuted.default"], ALL,
          samples=lambda: [((_x(3, 4),), {}), (([3, 4],), {}), ((_x(2), [3, 4]), {}), (([2, 3], [3, 1]), {}),
                           (([2, 3, 4], [0, 2, 1]), {})] +
          _in_every_dtype(([3, 4],)) + _in_every_dtype(([2, 3], [3, 1])) + _in_every_dtype(([3, 4], [1, 0])),
          compare_values=False)
def empty(pb, node, *args, **kwargs):
    """Uninitialized in torch; zeros here (any value is right, so tests check only metadata)."""
    return [_fill(node.outputs[0], 0)]


@register(["aten.ones_like.default", "aten.new_ones.default", "aten.ones.default"], ALL,
          samples=lambda: [((_x(3, 4),), {}), ((randint(2, 3),), {}), (([3, 4],), {}), ((_x(2), [3, 4]), {})] +
          _in_every_dtype(([3, 4],)))
def ones(pb, node, *args, **kwargs):
    return [_fill(node.outputs[0], 1)]


@register("aten.fill.Scalar", ALL, samples=lambda: [((_x(3, 4), 0.5), {})])
def fill(pb, node, x, value):
    return [_fill(node.outputs[0], value)]


def _arange_samples():
    import torch
    return [((10,), {}), ((2, 12), {}), ((1, 20, 3), {}), ((0.0, 2.0, 0.25), {}), ((5,), {"dtype": torch.float32}),
            ((10, 0, -2), {}), ((0.5, 6.0), {})] + [
        (args, {"dtype": getattr(torch, d)}) for d in NUMERIC for args in ((12,), (-5, 7), (100, 3, -7))]


# torch has no bool arange ("arange_cpu" not implemented for 'Bool')
@register(["aten.arange.default", "aten.arange.start", "aten.arange.start_step"], NUMERIC, samples=_arange_samples)
def arange(pb, node, *args, **kwargs):
    nums = [a for a in args if isinstance(a, (int, float))]
    if node.op == "aten.arange.default":
        start, step = 0, 1
    elif node.op == "aten.arange.start":
        start, step = nums[0], 1
    else:
        start, step = nums[0], (nums[2] if len(nums) > 2 else kwargs.get("step", 1))
    meta = node.outputs[0]
    ty = ctype(meta.dtype)
    if ty == "f32":
        # torch computes start + i * step in double; f32 rounding of that matches for small i
        s, st = lit(start, "f32"), lit(step, "f32")
        return [Compute(meta.shape, meta.dtype, [], lambda k, e, idx: f"({s} + f32({idx[0]}) * {st})", cost=0)]
    if ty == I64:  # past i32: start + i * step in two words
        s, st = lit(start, I64), lit(step, I64)
        return [Compute(meta.shape, meta.dtype, [], lambda k, e, idx: f"tap_i64_add({s}, tap_i64_mul(tap_i64_of({idx[0]}), {st}))",
                        cost=0)]
    s, st = lit(start, "i32"), lit(step, "i32")
    return [Compute(meta.shape, meta.dtype, [], lambda k, e, idx: f"({s} + {idx[0]} * {st})", cost=0)]

