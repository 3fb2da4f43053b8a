"""Scatter ops: index_put (the key/value cache update of a generation), index_copy, slice_scatter,
scatter / scatter_add / scatter_reduce along a dim, select_scatter, diagonal_scatter, masked_scatter.

All are lazy: an output element is computed where it is read. ``index_put`` and the scatters
along a dim scan the index entries for the ones that land on the element (a deterministic
loop, no atomics): with ``accumulate`` or a reduction they combine every match in index order,
otherwise the last match wins, as torch does for unique indices (it leaves duplicates
undefined). Indices are wrapped and clamped like the gathers' (platforms/wgsl/index.py), so a
bad index never writes outside a buffer."""

from __future__ import annotations

import math

import torch

from tapml.errors import Unsupported
from tapml.platforms.wgsl import views
from tapml.graph import TensorMeta
from tapml.platforms.wgsl.codegen import (I64, WIDE, BufferView, Compute, Custom, Value, arith, cast,
                                         contiguous_strides, ctype, extreme_lit, index_sum, less, lit, round_low)
from tapml.platforms.wgsl.index import advanced_layout, wrapped_index
from tapml.platforms.wgsl.registry import ALL, edge_floats, edge_ints, rand, randbool, randint, register


def _scatter(pb, meta, x, indices: list, values, accumulate: bool):
    """``x`` with ``values`` put at ``indices`` (one int tensor or None per leading dim of x)."""
    indices, pos, bshape, adjacent, start, rest = advanced_layout(x.shape, indices, "index_put")
    # the shape of x[indices]: what values broadcast to
    if adjacent:
        indexed = list(x.shape[:start]) + list(bshape) + list(x.shape[pos[-1] + 1:])
    else:
        indexed = list(bshape) + [x.shape[d] for d in rest]
    count = math.prod(bshape)
    fitted = pb.fit([x, views.expand_to(values, indexed)] + [views.expand_to(indices[d], bshape) for d in pos], 1)
    x, values, ivals = fitted[0], fitted[1], fitted[2:]
    nb = len(bshape)
    ty = ctype(meta.dtype)  # the output's: x may hold i32 where the output needs two words

    def fn(k, idx):
        acc = k.var(ty, cast(x.read(k, list(idx)), x.ty, ty), "put")
        if count == 0:
            return acc
        k.loop("b", count)
        bidx = k.unravel("b", bshape) if nb else []
        hits = [f"({wrapped_index(k, v, bidx, x.shape[d])} == {idx[d]})" for d, v in zip(pos, ivals)]
        other = [idx[d] for d in rest]
        vidx = (list(other[:start]) + bidx + list(other[start:])) if adjacent else bidx + other
        k.open(f"if ({' && '.join(hits)})")
        v = cast(values.read(k, vidx), values.ty, ty)
        if not accumulate:
            k.emit(f"{acc} = {v};")
        elif ty == "bool":
            k.emit(f"{acc} = {acc} || {v};")
        else:  # rounded per step in float16/bfloat16, as torch accumulates in the tensor's dtype
            k.emit(f"{acc} = {round_low(k, arith('+', acc, v, ty), meta.dtype)};")
        k.close()
        k.close()
        return acc
    return Custom(meta.shape, meta.dtype, [x, values] + ivals, fn)


def put_in_place(pb, node, x: BufferView, indices, values, accumulate=False) -> BufferView | None:
    """``index_put(x, indices, values)`` written into ``x``'s own buffer: one thread per put
    element, nothing else of ``x`` is touched, so a step that writes one row of a key/value cache
    costs that row, not the cache. The compiler chooses this form for a graph input that nothing
    else reads (:func:`tapml.platforms.wgsl.compile_graph`); the program lists the input's buffer
    as the output too, so a resident cache stays where it is from step to step. None where the
    lazy form must be kept: a boolean mask, ``accumulate``, or a buffer held in several parts.

    Several index entries (a prefill puts its prompt's positions) may repeat a position, and then
    the last entry wins, as in the lazy form: a first kernel sets one slot per indexed position to
    -1, a second writes each entry's number into its position's slot with ``atomicMax``, and an
    element is written only by the entry whose number its slot holds."""
    if accumulate or boolean_mask(indices, "index_put") is not None or x.buf.size > pb.max_buffer_size:
        return None
    indices, pos, bshape, adjacent, start, rest = advanced_layout(x.shape, indices, "index_put")
    count = math.prod(bshape)
    indexed = (list(x.shape[:start]) + list(bshape) + list(x.shape[pos[-1] + 1:]) if adjacent
               else list(bshape) + [x.shape[d] for d in rest])
    total = math.prod(indexed)
    if total == 0:
        return x
    fitted = pb.fit([views.expand_to(values, indexed)] + [views.expand_to(indices[d], bshape) for d in pos],
                    1 if count == 1 else 2)
    values, ivals = fitted[0], fitted[1:]
    nb = len(bshape)
    positions = [x.shape[d] for d in pos]
    slot_strides = contiguous_strides(positions)  # one slot per indexed position, row-major

    def position(k, bidx) -> list[str]:
        """The wrapped, clamped index along each indexed dim of entry ``bidx``."""
        return [wrapped_index(k, iv, bidx, x.shape[d]) for d, iv in zip(pos, ivals)]

    winners = None
    if count > 1:
        winners = pb.buffer("temp", TensorMeta((math.prod(positions),), "int32"))
        k = pb.kernel("put_slots")
        k.write(winners, "n", "-1", "i32")
        pb.add(k.finish(math.prod(positions)))
        k = pb.kernel("put_claim")
        slots = k.bind(winners, "read_write", elem="atomic<i32>")
        slot = index_sum(position(k, k.unravel("n", bshape)), slot_strides)
        k.emit(f"atomicMax(&{slots[slot]}, n);")
        pb.add(k.finish(count))
    k = pb.kernel("put_in_place")
    vidx = k.unravel("n", indexed)
    bidx, other = (vidx[start:start + nb], vidx[:start] + vidx[start + nb:]) if adjacent else (vidx[:nb], vidx[nb:])
    xidx = [""] * len(x.shape)
    for d, i in zip(pos, position(k, bidx)):
        xidx[d] = i
    for d, e in zip(rest, other):
        xidx[d] = e
    if winners is not None:  # only the last entry putting this position writes it
        entry = index_sum(bidx, contiguous_strides(bshape))
        slot = index_sum([xidx[d] for d in pos], slot_strides)
        k.open(f"if ({k.bind(winners)[slot]} == {entry})")
    k.write(x.buf, index_sum(xidx, x.strides, x.offset), cast(values.read(k, vidx), values.ty, x.ty), x.ty)
    if winners is not None:
        k.close()
    pb.add(k.finish(total))
    return x


def _index_put_samples():
    cache = rand(1, 2, 9, 4)
    return [
        # the static-cache update: cache[:, :, positions] = new keys (prefill, then one decode step)
        ((cache, [None, None, torch.arange(5)], rand(1, 2, 5, 4)), {}),
        ((cache, [None, None, torch.tensor([6])], rand(1, 2, 1, 4)), {}),
        ((rand(5, 4), [randint(3, hi=5)], rand(3, 4), True), {}),
        # duplicate indices accumulate
        ((rand(6), [torch.tensor([1, 3, 1, 1, -1])], rand(5), True), {}),
        ((rand(4, 5, 6), [randint(3, hi=4), None, randint(3, lo=-6, hi=6)], rand(3, 5)), {}),
        ((randint(6, 3), [torch.tensor([0, 4])], randint(2, 3), True), {}),
        ((randint(4, 3, dtype=torch.int32), [None, torch.tensor([2])], randint(1, dtype=torch.int32)), {}),
        ((rand(4, 3, dtype=torch.float16), [torch.tensor([3, 0])], rand(2, 3, dtype=torch.float16), True), {}),
        ((torch.zeros(5, dtype=torch.bool), [torch.tensor([1, 4])], torch.tensor([True, True])), {}),
        # edge values, accumulated onto duplicates and put
        ((edge_floats(6, 3), [torch.tensor([0, 2, 0, 5])], edge_floats(4, 3), True), {}),
        ((edge_ints(5, 2, dtype=torch.int32), [torch.tensor([4, 0, 4])], edge_ints(3, 2, dtype=torch.int32), True), {}),
        ((edge_ints(4, 3), [None, torch.tensor([2, 0])], edge_ints(4, 2)), {}),
        ((randint(5, 4, hi=200, dtype=torch.uint8), [torch.tensor([3, 1])], randint(2, 4, hi=200, dtype=torch.uint8)), {}),
    ]


@register("aten.index_put.default", ALL, samples=lambda: _index_put_samples() + _masked_put_samples())
def index_put(pb, node, x, indices, values, accumulate=False):
    if (mask := boolean_mask(indices, "index_put")) is not None:
        return [_masked_put(pb, node.outputs[0], x, *mask, values, bool(accumulate))]
    return [_scatter(pb, node.outputs[0], x, indices, values, bool(accumulate))]


# --- boolean masks: x[mask], x[mask] = v ----------------------------------------------------

def _masked_put_samples():
    x = rand(6, 4)
    return [((x, [x[:, 0] > 0], rand(4)), {}),  # x[x[:, 0] > 0] = row (SAM's prompt encoder writes so)
            ((x, [x[:, 0] > 0], torch.tensor(2.5), True), {}),
            ((x, [x[:, 0] > 0], rand(int((x[:, 0] > 0).sum()), 4), True), {}),
            ((rand(3, 5, 2), [None, randbool(3, 5)[0]], rand(1), False), {}),
            ((edge_floats(4, 3), [randbool(4, 3)], edge_floats(1)), {}),
            ((randint(5, 6, dtype=torch.int32), [randbool(5, 6)], torch.tensor(-7, dtype=torch.int32), True), {})]


def boolean_mask(indices, op: str):
    """``(d, mask)`` when ``indices`` index with one boolean mask (its dims are x's from ``d``),
    None when they hold no mask; Unsupported for a mask beside other index tensors."""
    tensors = [(d, i) for d, i in enumerate(indices) if i is not None]
    masks = [(d, i) for d, i in tensors if i.dtype in ("bool", "uint8")]
    if not masks:
        return None
    if len(tensors) > 1:
        raise Unsupported(f"{op} with a boolean mask beside other index tensors")
    return masks[0]


def truth_of(v):
    """``v`` as booleans (nonzero, NaN included, is True), computed where it is read."""
    return Compute(tuple(v.shape), "bool", [v], lambda k, e, idx: cast(e[0], v.ty, "bool"))


def mask_coordinates(pb, truth, meta: TensorMeta, fill: int | None = None) -> BufferView:
    """A ``meta``-shaped ``(count, ndim)`` integer tensor: the coordinates of ``truth``'s first
    ``count`` True elements in row-major order (``nonzero``); count is data-dependent, so it is
    the node's recorded shape, and rows past the Trues there are hold ``fill`` (not written
    when None)."""
    out = pb.buffer("temp", meta)
    result = BufferView.whole(out, meta)
    count, nd = meta.shape
    if meta.numel == 0:
        return result
    if fill is not None:
        k = pb.kernel("fill")
        k.write(out, "n", lit(int(fill), "i32"), "i32")  # Unsupported, with the reason, outside i32
        pb.add(k.finish(meta.numel))
    shape = tuple(truth.shape)
    positions = _mask_positions(pb, truth, shape)
    truth, positions = pb.fit([truth, positions], 1)
    k = pb.kernel("nonzero")
    idx = k.unravel("n", shape)
    row = k.let(positions.read(k, list(idx)), "i32")
    k.open(f"if ({cast(truth.read(k, list(idx)), truth.ty, 'bool')} && {row} < {count})")
    for d in range(nd):
        k.write(out, f"{row} * {nd} + {d}", idx[d], "i32")
    k.close()
    pb.add(k.finish(math.prod(shape)))
    return result


def masked_gather(pb, meta, x, d: int, mask):
    """``x[mask]`` for a mask over x's dims from ``d``: how many Trues there are is the node's
    recorded output shape (``meta.shape[d]``)."""
    nm = len(mask.shape)
    coords = mask_coordinates(pb, truth_of(mask), TensorMeta((meta.shape[d], nm), "int32"))
    x, coords = pb.fit([x, coords], 1)

    def fn(k, idx):
        row = idx[d]
        at = [k.let(coords.read(k, [row, str(j)]), "i32") for j in range(nm)]
        return x.read(k, list(idx[:d]) + at + list(idx[d + 1:]))
    return Custom(meta.shape, meta.dtype, [x, coords], fn)


def _masked_put(pb, meta, x, d: int, mask, values, accumulate: bool):
    """``x[mask] = values`` (``+=`` with ``accumulate``): each masked element takes the values'
    row of its rank among the Trues (a prefix count, as masked_scatter), or their broadcast."""
    nm, nd = len(mask.shape), len(x.shape)
    held = truth_of(mask)
    ranks = _mask_positions(pb, held, tuple(mask.shape))
    indexed = nd - nm + 1  # values broadcast to x.shape[:d] + [count] + x.shape[d + nm:]
    vshape = list(values.shape)
    if len(vshape) > indexed:
        raise Unsupported(f"index_put: values of {len(vshape)} dims for a masked index of {indexed}")
    # each masked element's rank, -1 where the mask is False: one buffer for the put to read
    ranked = Compute(tuple(mask.shape), "int32", [held, ranks],
                     lambda k, e, idx: f"select(-1, {e[1]}, {cast(e[0], held.ty, 'bool')})")
    x, ranked, values = pb.fit([x, ranked, values], len(pb.windows(meta.nbytes)))  # the output, in windows too
    ty = ctype(meta.dtype)  # the output's: x may hold i32 where the output needs two words

    def fn(k, idx):
        acc = k.var(ty, cast(x.read(k, list(idx)), x.ty, ty), "put")
        at = list(idx[d:d + nm])
        rank = k.let(ranked.read(k, at), "i32")
        k.open(f"if ({rank} >= 0)")
        full = list(idx[:d]) + [rank] + list(idx[d + nm:])
        pad = indexed - len(vshape)
        # a values tensor of fewer rows than Trues (a stranger's store) is read clamped, never past its end
        vidx = ["0" if size == 1 else f"min({full[pad + j]}, {size - 1})" for j, size in enumerate(vshape)]
        v = cast(values.read(k, vidx), values.ty, ty)
        if not accumulate:
            k.emit(f"{acc} = {v};")
        elif ty == "bool":
            k.emit(f"{acc} = {acc} || {v};")
        else:
            k.emit(f"{acc} = {round_low(k, arith('+', acc, v, ty), meta.dtype)};")
        k.close()
        return acc
    return Custom(meta.shape, meta.dtype, [x, ranked, values], fn)


@register("aten.index_copy.default", ALL,
          samples=lambda: [((rand(5, 4), 0, torch.tensor([4, 0, 2]), rand(3, 4)), {}),
                           ((rand(1, 2, 9, 4), 2, torch.tensor([7]), rand(1, 2, 1, 4)), {}),
                           ((randint(3, 6), 1, torch.tensor([5, 1]), randint(3, 2)), {})])
def index_copy(pb, node, x, dim, index, source):
    dim = views.norm_dim(dim, len(x.shape))
    return [_scatter(pb, node.outputs[0], x, [None] * dim + [views.reshape(index, [index.numel])], source, False)]


@register("aten.slice_scatter.default", ALL,
          samples=lambda: [((rand(6, 4), rand(2, 4), 0, 1, 3), {}),
                           ((rand(3, 8), rand(3, 3), 1, 1, 7, 2), {}),
                           ((randint(2, 5), randint(2, 2), -1, -2, None), {})])
def slice_scatter(pb, node, x, src, dim=0, start=None, end=None, step=1):
    meta = node.outputs[0]
    dim = views.norm_dim(dim, len(x.shape))
    size = x.shape[dim]
    first, stop, _ = slice(start, end, step).indices(size)
    x, src = pb.fit([x, src], 1)
    ty = ctype(meta.dtype)  # the output's: x may hold i32 where the output needs two words

    def fn(k, idx):
        i = idx[dim]
        j = k.let(f"({i} - {first}) / {step}", "i32")
        inside = f"({i} >= {first} && {i} < {stop} && ({i} - {first}) % {step} == 0)"
        sidx = list(idx)
        sidx[dim] = k.let(f"clamp({j}, 0, {max(src.shape[dim] - 1, 0)})", "i32")
        if src.shape[dim] == 0:
            return cast(x.read(k, list(idx)), x.ty, ty)
        return f"select({cast(x.read(k, list(idx)), x.ty, ty)}, {cast(src.read(k, sidx), src.ty, ty)}, {inside})"
    return [Custom(meta.shape, meta.dtype, [x, src], fn)]


# --- scatter along a dim: scatter, scatter_add, scatter_reduce ------------------------------
#
# Gather formulation, not atomics: each output element loops over the index entries of its
# line along ``dim`` and combines the ones that target it, in index order. That is what torch's
# CPU kernel does sequentially, so float sums and products round in the same order; it needs no
# float atomics (WGSL has only integer ones: a CAS loop on the f32 bits would serialize
# duplicates anyway and fix no order); and it works the same for packed float16/bfloat16, bools
# and every int width. Like torch's CPU kernels, float16/bfloat16 accumulate in f32 and round
# once at the end. The cost is one pass over the index line per output element.

#: scatter_reduce's reductions, with the aliases of scatter.reduce ("add", "multiply").
_REDUCE_ALIASES = {"add": "sum", "multiply": "prod"}
_REDUCTIONS = ("sum", "prod", "mean", "amax", "amin")


def _scalar_as(value, dtype: str):
    """A Python scalar converted to ``dtype`` the way torch converts it (truncation, rounding)."""
    from tapml.graph import torch_dtype
    return torch.tensor(value).to(torch_dtype(dtype)).item()


def _identity(reduce: str, ty: str) -> str:
    """The value torch fills a reduced element with before combining when ``include_self`` is False."""
    if ty == "bool":
        return lit(reduce in ("prod", "amin"), "bool")
    if reduce in ("sum", "mean", "prod"):
        return lit(int(reduce == "prod"), ty)
    if ty == "f32":
        return lit(-math.inf if reduce == "amax" else math.inf, ty)
    return extreme_lit(ty, reduce != "amax")


#: Bits of the int dtypes narrower than the i32 that holds them.
_NARROW = {"int8": (8, True), "uint8": (8, False), "int16": (16, True)}


def _wrap_narrow(e: str, dtype: str) -> str:
    """``e`` (i32) wrapped to ``dtype``'s width as torch's arithmetic wraps it (other dtypes: ``e``)."""
    if dtype not in _NARROW:
        return e
    bits, signed = _NARROW[dtype]
    if not signed:
        return f"({e} & {(1 << bits) - 1})"
    return f"(({e} << {32 - bits}u) >> {32 - bits}u)"


def _combine(k, reduce: str | None, ty: str, acc: str, v: str) -> str:
    """``acc`` combined with ``v`` (expressions of type ``ty``) by ``reduce`` (None: replace)."""
    if reduce is None:
        return v
    if ty == "bool":  # torch reduces bools as logic: sum and amax are or, prod and amin are and
        return f"({acc} || {v})" if reduce in ("sum", "mean", "amax") else f"({acc} && {v})"
    if reduce in ("sum", "mean"):
        e = arith("+", acc, v, ty)
    elif reduce == "prod":
        e = arith("*", acc, v, ty)
    elif ty == "f32":  # amax/amin propagate NaN, as torch's do
        e = f"{k.need('tap_max' if reduce == 'amax' else 'tap_min')}({acc}, {v})"
    elif ty == I64:
        e = f"select({acc}, {v}, {less(acc, v, ty) if reduce == 'amax' else less(v, acc, ty)})"
    else:
        e = f"{'max' if reduce == 'amax' else 'min'}({acc}, {v})"
    return e


def scatter_dim(pb, meta, x, dim: int, index, src, reduce: str | None = None, include_self: bool = True) -> Custom:
    """``x`` with ``src`` (a Value, or a Python scalar) scattered along ``dim`` at ``index``:
    torch's ``scatter`` (``reduce`` None: the last entry that targets an element wins, as torch
    does for unique indices; it leaves duplicates undefined) or ``scatter_reduce`` (``reduce`` one
    of sum, prod, mean, amax, amin; ``include_self`` False: ``x``'s own value takes no part where
    an entry lands)."""
    nd = len(x.shape)
    dim = views.norm_dim(dim, nd) if nd else 0
    x, index = (v if v.shape else views.reshape(v, [1]) for v in (x, index))
    scalar = not isinstance(src, Value)
    if not scalar and not src.shape:
        src = views.reshape(src, [1])
    shape = x.shape
    ishape = index.shape
    if len(ishape) != len(shape):
        raise Unsupported(f"scatter: index has {len(ishape)} dims, self {len(shape)}")
    ty, dtype = ctype(meta.dtype), meta.dtype
    if scalar:
        value = lit(_scalar_as(src, "int64" if dtype == WIDE else dtype), ty)
        fitted = pb.fit([x, index], 1)
    else:
        fitted = pb.fit([x, index, src], 1)
        src = fitted[2]
    x, index = fitted[0], fitted[1]
    # index entries exist only for the leading part of every other dim (index may be smaller)
    partial = [d for d in range(len(shape)) if d != dim and ishape[d] < shape[d]]
    count = ishape[dim] if all(ishape) else 0

    def fn(k, idx):
        idx = list(idx) or ["0"]
        acc = k.var(ty, cast(x.read(k, idx), x.ty, ty), "acc")
        if count == 0:
            return acc
        hits = k.var("i32", "0", "hits")
        if partial:
            k.open(f"if ({' && '.join(f'{idx[d]} < {ishape[d]}' for d in partial)})")
        k.loop("j", count)
        iidx = list(idx)
        iidx[dim] = "j"
        k.open(f"if ({wrapped_index(k, index, iidx, shape[dim], wrap=False)} == {idx[dim]})")
        v = value if scalar else cast(src.read(k, iidx), src.ty, ty)
        if reduce is not None and not include_self:
            k.emit(f"if ({hits} == 0) {{ {acc} = {_identity(reduce, ty)}; }}")
        k.emit(f"{acc} = {_combine(k, reduce, ty, acc, v)};")
        k.emit(f"{hits} = {hits} + 1;")
        k.close()
        k.close()
        if partial:
            k.close()
        total = k.let(_wrap_narrow(round_low(k, acc, dtype), dtype), ty)
        if reduce == "mean":  # torch divides the sum rounded (or wrapped) to the dtype; ints floor
            n = hits if not include_self else f"({hits} + 1)"
            mean = (f"{k.need('tap_floordiv_i')}({total}, {n})" if ty == "i32" else
                    f"{k.need('tap_i64_divmod_floor')}({total}, tap_i64_of({n})).xy" if ty == I64 else
                    round_low(k, f"({total} / f32({n}))", dtype))
            return k.let(f"select({total}, {mean}, {hits} > 0)", ty)
        return total
    return Custom(meta.shape, meta.dtype, [x, index] + ([] if scalar else [src]), fn)


def _perm_index(rows, cols, n, dim):
    """An int64 index of shape (rows, cols) whose lines along ``dim`` hold distinct values in
    [0, n) (plain scatter needs unique targets: torch leaves duplicates undefined)."""
    lines = cols if dim == 0 else rows
    length = rows if dim == 0 else cols
    idx = torch.stack([torch.randperm(n)[:length] for _ in range(lines)])
    return idx.t().contiguous() if dim == 0 else idx


def _scatter_samples():
    return [
        ((rand(4, 6), 1, _perm_index(4, 3, 6, 1), rand(4, 5)), {}),
        ((edge_floats(5, 3), 0, _perm_index(4, 3, 5, 0), edge_floats(4, 3)), {}),
        # index smaller than self in the other dim, src larger than index
        ((rand(6, 5), 0, _perm_index(3, 2, 6, 0), rand(4, 4)), {}),
        ((rand(2, 7, 3), -2, _perm_index(7, 3, 7, 0).reshape(1, 7, 3).expand(2, 7, 3).contiguous(),
          rand(2, 7, 3)), {}),
        ((edge_ints(6, 4), 0, _perm_index(5, 4, 6, 0), edge_ints(5, 4)), {}),
        ((edge_ints(3, 8, dtype=torch.int32), 1, _perm_index(3, 6, 8, 1), edge_ints(3, 6, dtype=torch.int32)), {}),
        ((randbool(4, 5), 1, _perm_index(4, 2, 5, 1), randbool(4, 2)), {}),
        ((randint(5, 3, hi=256, dtype=torch.uint8), 0, _perm_index(2, 3, 5, 0), randint(2, 3, hi=256, dtype=torch.uint8)), {}),
        ((randint(4, 4, lo=-2**15, hi=2**15, dtype=torch.int16), 1, _perm_index(4, 2, 4, 1),
          randint(4, 2, lo=-2**15, hi=2**15, dtype=torch.int16)), {}),
        ((rand(8), 0, torch.randperm(8)[:5], rand(5)), {}),
        ((torch.tensor(1.5), 0, torch.tensor(0), torch.tensor(-2.5)), {}),
    ]


def _scatter_value_samples():
    return [
        ((rand(4, 6), 1, _perm_index(4, 3, 6, 1), -1.75), {}),
        ((edge_floats(5, 3), 0, _perm_index(2, 3, 5, 0), math.inf), {}),
        ((rand(5, 3), 0, _perm_index(2, 3, 5, 0), math.nan), {}),
        ((edge_ints(6, 4), 0, _perm_index(5, 4, 6, 0), 2**31 - 1), {}),
        ((edge_ints(3, 8, dtype=torch.int32), -1, _perm_index(3, 6, 8, 1), -7), {}),
        ((randbool(4, 5), 1, _perm_index(4, 2, 5, 1), True), {}),
        ((randint(4, 5, hi=256, dtype=torch.uint8), 1, _perm_index(4, 3, 5, 1), 255), {}),
    ]


def _dup_index(*shape, hi):
    """An index with many duplicates (a reducing scatter combines them)."""
    return randint(*shape, hi=hi)


def _reduce_sources():
    """(self, dim, index, src) with duplicate indices, one per claimed kind of dtype."""
    return [
        (rand(4, 6), 1, _dup_index(4, 9, hi=6), rand(4, 9)),
        (rand(5, 3), 0, _dup_index(7, 3, hi=5), rand(7, 3, lo=0.5, hi=1.5)),
        (edge_floats(3, 4), -1, _dup_index(3, 6, hi=4), edge_floats(3, 6)),
        (rand(2, 5, 3), 1, _dup_index(2, 4, 2, hi=5), rand(2, 6, 3)),
        (randint(6, 4, lo=-9, hi=9), 0, _dup_index(8, 3, hi=6), randint(8, 4, lo=-9, hi=9)),
        (edge_ints(4, 5, dtype=torch.int32), 1, _dup_index(4, 7, hi=5), randint(4, 7, lo=-9, hi=9, dtype=torch.int32)),
        (randbool(5, 4), 0, _dup_index(6, 4, hi=5), randbool(6, 4)),
        (randint(3, 5, lo=-100, hi=100, dtype=torch.int8), 1, _dup_index(3, 8, hi=5),
         randint(3, 8, lo=-100, hi=100, dtype=torch.int8)),
    ]


def _scatter_reduce_samples():
    out = []
    for n, (x, dim, index, src) in enumerate(_reduce_sources()):
        for reduce in _REDUCTIONS:
            if x.dtype == torch.bool and reduce == "mean":
                continue  # torch has no mean of bools
            out.append(((x, dim, index, src, reduce), {"include_self": n % 2 == 0}))
            if n < 3:
                out.append(((x, dim, index, src, reduce), {"include_self": n % 2 == 1}))
    # int64 boundaries: amax/amin keep them (a sum would leave the i32 range WGSL holds)
    out += [((edge_ints(5, 3), 0, _dup_index(6, 3, hi=5), edge_ints(6, 3), r), {"include_self": s})
            for r in ("amax", "amin") for s in (True, False)]
    # amax/amin where NaN and infinities meet
    nan = torch.tensor([[math.nan, 1.0, -math.inf, 2.0, math.inf, -0.0]])
    out += [((rand(1, 3), 1, torch.tensor([[0, 0, 1, 1, 2, 2]]), nan, r), {"include_self": s})
            for r in ("amax", "amin") for s in (True, False)]
    return out


def _scatter_add_samples():
    return [((x, dim, index, src), {}) for x, dim, index, src in _reduce_sources()]


def _scatter_reduce_legacy_samples():
    out = []
    for x, dim, index, src in _reduce_sources():
        for reduce in ("add", "multiply"):
            out.append(((x, dim, index, src), {"reduce": reduce}))
            out.append(((x, dim, index, 1.5 if x.is_floating_point() else 3), {"reduce": reduce}))
    return out


@register(["aten.scatter.src", "aten.scatter.value"], ALL,
          samples=lambda: _scatter_samples() + _scatter_value_samples())
def scatter(pb, node, x, dim, index, src):
    return [scatter_dim(pb, node.outputs[0], x, dim, index, src)]


@register(["aten.scatter.reduce", "aten.scatter.value_reduce"], ALL, samples=_scatter_reduce_legacy_samples)
def scatter_legacy_reduce(pb, node, x, dim, index, src, *, reduce):
    if reduce not in _REDUCE_ALIASES:
        raise Unsupported(f"{node.op}: reduce={reduce!r}; torch takes 'add' or 'multiply'")
    return [scatter_dim(pb, node.outputs[0], x, dim, index, src, _REDUCE_ALIASES[reduce])]


@register("aten.scatter_add.default", ALL, samples=_scatter_add_samples)
def scatter_add(pb, node, x, dim, index, src):
    return [scatter_dim(pb, node.outputs[0], x, dim, index, src, "sum")]


@register("aten.scatter_reduce.two", ALL, samples=_scatter_reduce_samples)
def scatter_reduce(pb, node, x, dim, index, src, reduce, *, include_self=True):
    if reduce not in _REDUCTIONS:
        raise Unsupported(f"scatter_reduce: reduce={reduce!r}; torch takes {', '.join(_REDUCTIONS)}")
    return [scatter_dim(pb, node.outputs[0], x, dim, index, src, reduce, bool(include_self))]


# --- select_scatter, diagonal_scatter, masked_scatter --------------------------------------

@register("aten.select_scatter.default", ALL,
          samples=lambda: [((rand(4, 6), rand(6), 0, 2), {}), ((edge_floats(3, 5, 2), edge_floats(3, 5), -1, -1), {}),
                           ((rand(2, 5, 3), rand(2, 3), 1, 4), {}), ((edge_ints(4, 3), edge_ints(4), 1, 0), {}),
                           ((edge_ints(3, 3, dtype=torch.int32), randint(3, dtype=torch.int32), 0, -2), {}),
                           ((randbool(3, 4), randbool(4), 0, 1), {}), ((rand(5), torch.tensor(2.5), 0, 3), {})])
def select_scatter(pb, node, x, src, dim, index):
    meta = node.outputs[0]
    dim = views.norm_dim(dim, len(x.shape))
    index = index + x.shape[dim] if index < 0 else index
    x, src = pb.fit([x, src], 1)
    ty = ctype(meta.dtype)  # the output's: x may hold i32 where the output needs two words

    def fn(k, idx):
        v = cast(src.read(k, list(idx[:dim]) + list(idx[dim + 1:])), src.ty, ty)
        return f"select({cast(x.read(k, list(idx)), x.ty, ty)}, {v}, {idx[dim]} == {index})"
    return [Custom(meta.shape, meta.dtype, [x, src], fn)]


def _diagonal_scatter_samples():
    def diag(x, offset=0, d1=0, d2=1):
        return torch.diagonal(x, offset, d1, d2)
    x1, x2, x3, x4 = rand(4, 4), rand(3, 6), rand(2, 5, 4), edge_floats(6, 3)
    i1, b1 = edge_ints(5, 5), randbool(3, 4)
    return [((x1, rand(*diag(x1).shape)), {}),
            ((x2, rand(*diag(x2, 2).shape), 2), {}),
            ((x2, rand(*diag(x2, -1).shape), -1), {}),
            ((x3, rand(*diag(x3, 1, 0, 2).shape), 1, 0, 2), {}),
            ((x3, rand(*diag(x3, -2, -1, 1).shape), -2, -1, 1), {}),
            ((x4, edge_floats(*diag(x4, -3).shape), -3), {}),
            ((i1, edge_ints(*diag(i1, 1).shape), 1), {}),
            ((edge_ints(4, 6, dtype=torch.int32), randint(4, dtype=torch.int32)), {}),
            ((b1, randbool(*diag(b1, -1).shape), -1), {}),
            # an offset past the matrix: an empty diagonal, nothing scattered
            ((x2, rand(0), 7), {})]


@register("aten.diagonal_scatter.default", ALL, samples=_diagonal_scatter_samples)
def diagonal_scatter(pb, node, x, src, offset=0, dim1=0, dim2=1):
    meta = node.outputs[0]
    nd = len(x.shape)
    d1, d2 = views.norm_dim(dim1, nd), views.norm_dim(dim2, nd)
    x, src = pb.fit([x, src], 1)
    ty = ctype(meta.dtype)  # the output's: x may hold i32 where the output needs two words
    rest = [d for d in range(nd) if d not in (d1, d2)]

    def fn(k, idx):
        old = cast(x.read(k, list(idx)), x.ty, ty)
        if src.numel == 0:
            return old
        # element (i, i + offset) of the (d1, d2) planes is the diagonal's element i (last dim of src)
        i = idx[d1] if offset >= 0 else idx[d2]
        on = f"({idx[d2]} - {idx[d1]} == {offset})"
        last = src.shape[-1] - 1
        v = cast(src.read(k, [idx[d] for d in rest] + [k.let(f"clamp({i}, 0, {last})", "i32")]), src.ty, ty)
        return f"select({old}, {v}, {on})"
    return [Custom(meta.shape, meta.dtype, [x, src], fn)]


#: Mask elements counted by one thread of masked_scatter's prefix count.
_CHUNK = 256


def _mask_positions(pb, mask, shape) -> BufferView:
    """An int32 tensor of ``shape``: for each element, how many True elements of ``mask``
    (broadcast to ``shape``) precede it in row-major order (where it takes from ``source``).

    Three kernels, no atomics: each thread counts the Trues of one chunk of elements, one
    thread turns those counts into chunk starts, then each chunk's thread walks its elements."""
    from tapml.graph import TensorMeta
    n = math.prod(shape)
    chunks = -(-n // _CHUNK)
    mask = views.expand_to(mask, shape)
    counts = pb.buffer("temp", TensorMeta((chunks,), "int32"))
    starts = pb.buffer("temp", TensorMeta((chunks,), "int32"))
    positions = pb.buffer("temp", TensorMeta(tuple(shape), "int32"))
    counts_v, starts_v = (BufferView.whole(b, b.meta) for b in (counts, starts))

    def walk(name, body):
        (m,) = pb.fit([mask], 2)
        k = pb.kernel(name)
        total = k.var("i32", starts_v.read(k, ["n"]) if name == "mask_positions" else "0", "c")
        k.loop("e", _CHUNK)
        i = k.let(f"n * {_CHUNK} + e", "i32")
        k.emit(f"if ({i} >= {n}) {{ break; }}")
        body(k, i, total)
        k.emit(f"{total} = {total} + select(0, 1, {cast(m.read(k, k.unravel(i, shape)), m.ty, 'bool')});")
        k.close()
        return k, total

    k, total = walk("mask_count", lambda k, i, total: None)
    k.write(counts, "n", total, "i32")
    pb.add(k.finish(chunks))
    k = pb.kernel("mask_starts")
    acc = k.var("i32", "0", "acc")
    k.loop("c", chunks)
    k.write(starts, "c", acc, "i32")
    k.emit(f"{acc} = {acc} + {counts_v.read(k, ['c'])};")
    k.close()
    pb.add(k.finish(1))
    k, _ = walk("mask_positions", lambda k, i, total: k.write(positions, i, total, "i32"))
    pb.add(k.finish(chunks))
    return BufferView.whole(positions, positions.meta)


def _masked_scatter_samples():
    return [((rand(4, 5), randbool(4, 5), rand(20)), {}),
            # a mask broadcast over the last dim (the image-token merge of multimodal models)
            ((rand(2, 6, 8), randbool(2, 6, 1), rand(2, 6, 8)), {}),
            ((rand(3, 1), randbool(3, 4), rand(5, 4)), {}),
            ((edge_floats(40, 30), randbool(40, 30), edge_floats(1300)), {}),
            ((edge_ints(5, 3), randbool(5, 3), edge_ints(16)), {}),
            ((edge_ints(4, 4, dtype=torch.int32), randbool(4), randint(4, 4, dtype=torch.int32)), {}),
            ((randbool(6), randbool(6), randbool(6)), {}),
            ((rand(3, 4), torch.zeros(3, 4, dtype=torch.bool), rand(2)), {})]


@register("aten.masked_scatter.default", ALL, samples=_masked_scatter_samples)
def masked_scatter(pb, node, x, mask, source):
    meta = node.outputs[0]
    shape = tuple(meta.shape)
    if meta.numel == 0 or source.numel == 0:
        return [views.expand_to(x, shape)]
    positions = _mask_positions(pb, mask, shape)
    x, mask, source = views.expand_to(x, shape), views.expand_to(mask, shape), views.reshape(source, [source.numel])
    x, mask, source = pb.fit([x, mask, source], 2)
    ty = ctype(meta.dtype)  # the output's: x may hold i32 where the output needs two words

    def fn(k, idx):
        at = k.let(f"clamp({positions.read(k, list(idx))}, 0, {source.numel - 1})", "i32")
        taken = cast(source.read(k, [at]), source.ty, ty)
        return f"select({cast(x.read(k, list(idx)), x.ty, ty)}, {taken}, {cast(mask.read(k, list(idx)), mask.ty, 'bool')})"
    return [Custom(shape, meta.dtype, [x, mask, source, positions], fn)]


__all__ = ["index_put", "put_in_place", "index_copy", "slice_scatter", "scatter_dim", "scatter", "scatter_legacy_reduce", "scatter_add",
           "scatter_reduce", "select_scatter", "diagonal_scatter", "masked_scatter"]
