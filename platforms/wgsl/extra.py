"""Ops that stay in exported graphs without a core-ATen decomposition: the ``*_copy`` forms of
views and ``unfold`` (lazy views here: a consumer reads through them), ``new_empty_strided``,
``addmv``/``addbmm`` (matrix products of matmul.py), ``dist`` (a vector norm of a difference),
``masked_select`` (a data-dependent length, like ``nonzero``), ``put``,
``as_strided_scatter`` and ``index_reduce`` (the gather-formulated scatters of scatter.py)."""

from __future__ import annotations

import math

import torch

from tapml.errors import Unsupported
from tapml.graph import TensorMeta
from tapml.platforms.wgsl import views
from tapml.platforms.wgsl.codegen import BufferView, Compute, Custom, Remap, Value, cast, ctype, lit
from tapml.platforms.wgsl.matmul import product
from tapml.platforms.wgsl.reduce import vector_norm
from tapml.platforms.wgsl.registry import (ALL, ALL_FLOAT, NUMERIC, edge_floats, edge_ints, rand, randbool, randint,
                                           register)
from tapml.platforms.wgsl.scatter import _mask_positions, _scatter, scatter_dim
from tapml.platforms.wgsl.shape import empty
from tapml.platforms.wgsl.views import _as_strided_samples


# --- the copy forms of views ---------------------------------------------------------------

@register("aten.view_copy.default", ALL,
          samples=lambda: [((rand(2, 3, 4), [6, 4]), {}), ((edge_floats(4, 6), [-1]), {}),
                           ((rand(4, 6).t(), [3, 8]), {}), ((edge_ints(3, 4), [2, 1, 6]), {}),
                           ((edge_ints(12, dtype=torch.int32), [3, 4]), {}), ((randbool(2, 6), [12]), {}),
                           ((torch.tensor(1.5), [1, 1]), {}), ((rand(0, 3), [3, 0]), {})])
def view_copy(pb, node, x, size):
    return [views.reshape(x, size)]


@register("aten.permute_copy.default", ALL,
          samples=lambda: [((rand(2, 3, 4), [2, 0, 1]), {}), ((edge_floats(4, 5), [1, 0]), {}),
                           ((rand(2, 3, 4, 5), [3, 1, 0, -2]), {}), ((edge_ints(3, 4, 2), [1, 2, 0]), {}),
                           ((edge_ints(5, 3, dtype=torch.int32), [-1, 0]), {}), ((randbool(3, 4), [1, 0]), {})])
def permute_copy(pb, node, x, dims):
    return [views.permute(x, dims)]


@register("aten.narrow_copy.default", ALL,
          samples=lambda: [((rand(4, 10), 1, 2, 5), {}), ((edge_floats(6, 5), 0, -3, 2), {}),
                           ((rand(3, 4, 5), -1, 0, 5), {}), ((edge_ints(5, 4), 0, 1, 3), {}),
                           ((edge_ints(4, 7, dtype=torch.int32), 1, 6, 1), {}), ((randbool(6, 3), 0, 2, 0), {})])
def narrow_copy(pb, node, x, dim, start, length):
    dim = views.norm_dim(dim, len(x.shape))
    start = start + x.shape[dim] if start < 0 else start
    return [views.slice_(x, dim, start, start + length)]


@register("aten.unbind_copy.int", ALL,
          samples=lambda: [((rand(3, 4), 0), {}), ((edge_floats(2, 5), 1), {}), ((rand(2, 3, 4), -1), {}),
                           ((edge_ints(4, 2, 3), 1), {}), ((edge_ints(3, 3, dtype=torch.int32),), {}),
                           ((randbool(2, 4), 0), {})])
def unbind_copy(pb, node, x, dim=0):
    return [views.select(x, dim, i) for i in range(x.shape[views.norm_dim(dim, len(x.shape))])]


@register("aten.as_strided_copy.default", ALL, samples=_as_strided_samples)
def as_strided_copy(pb, node, x, size, stride, storage_offset=None):
    return [views.as_strided(x, size, stride, storage_offset)]


def unfold(v: Value, dim: int, size: int, step: int) -> Value:
    """``Tensor.unfold(dim, size, step)``: the windows of ``size`` elements every ``step`` along
    ``dim``, that dim holding the windows and a new last dim the elements of each."""
    if step <= 0 or size < 0:
        raise Unsupported(f"unfold with size {size} and step {step} (torch needs size >= 0 and step > 0)")
    nd = len(v.shape)
    if nd == 0:  # torch unfolds a 0-d tensor as a 1-d one of one element, without the window dim
        return views.reshape(v, [1]) if size == 1 else Compute((0,), v.dtype, [], lambda k, e, idx: lit(0, v.ty), cost=0)
    dim = views.norm_dim(dim, nd)
    if size > v.shape[dim]:
        raise Unsupported(f"unfold: window size {size} is larger than dimension {dim} of size {v.shape[dim]}")
    shape = list(v.shape) + [size]
    shape[dim] = (v.shape[dim] - size) // step + 1
    if isinstance(v, BufferView):
        strides = list(v.strides) + [v.strides[dim]]
        strides[dim] = v.strides[dim] * step
        return BufferView(v.buf, shape, strides, v.offset, v.dtype)

    def fn(k, idx):
        out = list(idx[:-1])
        out[dim] = k.let(f"({idx[dim]} * {step} + {idx[-1]})", "i32")
        return out
    return Remap(v, shape, fn)


@register("aten.unfold.default", ALL,
          samples=lambda: [((rand(4, 10), 1, 3, 2), {}), ((edge_floats(7, 3), 0, 2, 1), {}),
                           ((rand(2, 9, 4), -2, 4, 3), {}), ((rand(5, 6).t(), 1, 5, 5), {}),
                           ((edge_ints(3, 8), 1, 8, 1), {}), ((edge_ints(6, dtype=torch.int32), 0, 2, 4), {}),
                           ((randbool(4, 5), 1, 2, 2), {}), ((rand(3, 4), 1, 0, 1), {}),
                           ((torch.tensor(2.5), 0, 1, 1), {})], view=True)
def unfold_op(pb, node, x, dimension, size, step):
    return [unfold(x, dimension, size, step)]


# --- uninitialized memory ------------------------------------------------------------------

def _new_empty_strided_samples():
    return [((rand(2), [3, 4], [4, 1]), {}), ((randint(3), [2, 3, 4], [1, 2, 6]), {}), ((rand(1), [], []), {}),
            ((rand(2), [0, 3], [3, 1]), {})] + [
        ((rand(2), [3, 2], [1, 3]), {"dtype": getattr(torch, d)}) for d in ALL if d != "float32"]


@register("aten.new_empty_strided.default", ALL, samples=_new_empty_strided_samples, compare_values=False)
def new_empty_strided(pb, node, x, size, stride, **kwargs):
    """Uninitialized in torch; zeros here, laid out contiguously (any value is right)."""
    return empty(pb, node)


# --- matrix products -------------------------------------------------------------------------

def _int_triples(*shapes):
    """(input, a, b) of every integer dtype torch multiplies, of ``shapes``, values that keep i32
    sums (int8/uint8/int16 wrap as torch's do)."""
    out = []
    for dtype, lo, hi in ((torch.int64, -300, 300), (torch.int32, -300, 300), (torch.int16, -2**15, 2**15),
                          (torch.int8, -128, 128), (torch.uint8, 0, 256)):
        out.append(tuple(randint(*s, lo=lo, hi=hi, dtype=dtype) for s in shapes))
    return out


def _addmv_samples():
    return [((rand(5), rand(5, 7), rand(7)), {}), ((rand(1), rand(33, 64), rand(64)), {"beta": 0.5, "alpha": -2.0}),
            ((rand(6), rand(9, 6).t(), rand(9)), {}), ((edge_floats(4), rand(4, 3), rand(3)), {}),
            ((edge_floats(4), rand(4, 3), rand(3)), {"beta": 0}),
            ((rand(3), rand(3, 5), edge_floats(5)), {}), ((rand(4), rand(4, 0), rand(0)), {"beta": 2.0}),
            *[(t, {}) for t in _int_triples((6,), (6, 5), (5,))],
            ((edge_ints(4, dtype=torch.int32), randint(4, 3, lo=-9, hi=9, dtype=torch.int32),
              randint(3, lo=-9, hi=9, dtype=torch.int32)), {"beta": 2, "alpha": -3})]


@register("aten.addmv.default", NUMERIC, samples=_addmv_samples, flops="addmm")
def addmv(pb, node, bias, mat, vec, *, beta=1, alpha=1):
    meta = node.outputs[0]
    (n,) = meta.shape
    bias = views.reshape(views.expand_to(bias, (n,)), (1, n, 1))
    return [product(pb, "addmv", views.unsqueeze(mat, 0), views.reshape(vec, (1, vec.numel, 1)),
                    TensorMeta((n,), meta.dtype), bias=bias, alpha=alpha, beta=beta)]


def _addbmm_samples():
    return [((rand(3, 5), rand(2, 3, 4), rand(2, 4, 5)), {}),
            ((rand(5), rand(4, 8, 16), rand(4, 16, 5)), {"beta": 0.5, "alpha": 0.25}),
            ((rand(3, 1), rand(3, 4, 3).transpose(1, 2), rand(3, 4, 6)), {}),
            ((edge_floats(3, 4), rand(2, 3, 5), rand(2, 5, 4)), {}),
            ((edge_floats(3, 4), rand(2, 3, 5), rand(2, 5, 4)), {"beta": 0}),
            ((rand(2, 3), rand(0, 2, 4), rand(0, 4, 3)), {}),
            *[(t, {}) for t in _int_triples((3, 4), (2, 3, 5), (2, 5, 4))],
            ((edge_ints(3, 2, dtype=torch.int32), randint(3, 3, 4, lo=-9, hi=9, dtype=torch.int32),
              randint(3, 4, 2, lo=-9, hi=9, dtype=torch.int32)), {"beta": -1, "alpha": 2})]


@register("aten.addbmm.default", NUMERIC, samples=_addbmm_samples, flops="addmm")
def addbmm(pb, node, bias, batch1, batch2, *, beta=1, alpha=1):
    """beta·bias + alpha·sum_b batch1[b] @ batch2[b]: one product over K = B·K, the batches laid
    side by side along the reduced dim."""
    meta = node.outputs[0]
    B, N, K = batch1.shape
    P = batch2.shape[2]
    a = views.reshape(views.permute(batch1, [1, 0, 2]), (1, N, B * K))
    b = views.reshape(batch2, (1, B * K, P))
    bias = views.unsqueeze(views.expand_to(bias, meta.shape), 0)
    return [product(pb, "addbmm", a, b, meta, bias=bias, alpha=alpha, beta=beta)]


# --- dist ------------------------------------------------------------------------------------

def _dist_samples():
    return [((rand(3, 5), rand(3, 5)), {}), ((rand(4, 6), rand(6), 3), {}), ((rand(2, 3, 4), rand(3, 1), 1), {}),
            ((edge_floats(4, 5), rand(4, 5), math.inf), {}), ((rand(4, 5), rand(4, 5), -math.inf), {}),
            ((edge_floats(4, 5), rand(5), -math.inf), {}), ((edge_floats(3, 4), rand(3, 4), 0), {}),
            ((rand(6), rand(6).round(), 0), {}), ((rand(5, 5), edge_floats(5, 5), 0.5), {}),
            ((rand(4, 4), rand(4, 4), -2.5), {}), ((rand(0, 3), rand(3)), {}), ((torch.tensor(1.5), rand(3)), {})]


@register("aten.dist.default", ALL_FLOAT, samples=_dist_samples, flops="reduce")
def dist(pb, node, a, b, p=2):
    shape = tuple(torch.broadcast_shapes(tuple(a.shape), tuple(b.shape)))
    a, b = views.expand_to(a, shape), views.expand_to(b, shape)
    diff = Compute(shape, node.outputs[0].dtype, [a, b], lambda k, e, idx: f"({e[0]} - {e[1]})")
    return vector_norm(pb, node, diff, p)


# --- masked_select -------------------------------------------------------------------------

def _masked_select_samples():
    return [((rand(4, 5), randbool(4, 5)), {}), ((edge_floats(3, 6), randbool(6)), {}),
            ((rand(3, 1), randbool(2, 3, 4)), {}), ((edge_floats(40, 30), randbool(40, 30)), {}),
            ((edge_ints(5, 3), randbool(5, 3)), {}), ((edge_ints(4, 4, dtype=torch.int32), randbool(4, 1)), {}),
            ((randbool(7), randbool(7)), {}), ((rand(3, 4), torch.zeros(3, 4, dtype=torch.bool)), {}),
            ((rand(2, 3), torch.ones(2, 3, dtype=torch.bool)), {}), ((torch.tensor(2.5), torch.tensor(True)), {})]


@register("aten.masked_select.default", ALL, samples=_masked_select_samples)
def masked_select(pb, node, x, mask):
    """The elements of ``x`` where ``mask`` (broadcast together) is True, in row-major order. How
    many there are is data-dependent: the node's recorded output shape says it (as for nonzero);
    a prefix count of the mask gives each selected element its place."""
    meta = node.outputs[0]
    out = pb.buffer("temp", meta)
    result = BufferView.whole(out, meta)
    (count,) = meta.shape
    shape = tuple(torch.broadcast_shapes(tuple(x.shape), tuple(mask.shape)))
    if count == 0 or math.prod(shape) == 0:
        return [result]
    positions = _mask_positions(pb, mask, shape)
    x, mask, positions = pb.fit([views.expand_to(x, shape), views.expand_to(mask, shape), positions], 1)
    k = pb.kernel("masked_select")
    idx = k.unravel("n", shape)
    row = k.let(positions.read(k, list(idx)), "i32")
    k.open(f"if ({cast(mask.read(k, list(idx)), mask.ty, 'bool')} && {row} < {count})")
    k.write(out, row, x.read(k, list(idx)), x.ty)
    k.close()
    pb.add(k.finish(math.prod(shape)))
    return [result]


# --- put, as_strided_scatter, index_reduce -------------------------------------------------

def _put_samples():
    return [((rand(4, 5), torch.tensor([0, 7, 19, -1]), rand(4)), {}),
            ((rand(3, 4), torch.tensor([[1, 5], [5, 1]]), rand(2, 2), True), {}),
            ((edge_floats(6), torch.tensor([2, 2, 5, -6]), edge_floats(4), True), {}),
            ((edge_floats(2, 3), torch.tensor([4, 0, 3]), rand(3)), {}),
            ((edge_ints(4, 3), torch.tensor([11, 0, 11, 2]), edge_ints(4), True), {}),
            ((edge_ints(3, 3, dtype=torch.int32), torch.tensor([8, 1]), randint(2, dtype=torch.int32)), {}),
            ((randint(5, hi=200, dtype=torch.uint8), torch.tensor([1, 1, 3]), randint(3, hi=200, dtype=torch.uint8), True), {}),
            ((randbool(2, 4), torch.tensor([0, 6, 6]), randbool(3), True), {}),
            ((randbool(2, 4), torch.tensor([3, 5]), randbool(2)), {}),
            ((rand(3), torch.tensor(1), torch.tensor(-4.5)), {}),
            ((rand(2, 2), torch.zeros(0, dtype=torch.int64), rand(0), True), {})]


@register("aten.put.default", ALL, samples=_put_samples)
def put(pb, node, x, index, source, accumulate=False):
    """``x`` seen flat with ``source`` put at ``index`` (negative indices count from the end);
    ``accumulate`` adds duplicates in index order, else the last one wins (torch leaves that
    undefined)."""
    meta = node.outputs[0]
    flat = TensorMeta((meta.numel,), meta.dtype)
    if index.numel == 0:
        return [x]
    out = _scatter(pb, flat, views.reshape(x, [x.numel]), [views.reshape(index, [index.numel])],
                   views.reshape(source, [source.numel]), bool(accumulate))
    return [views.reshape(out, meta.shape)]


def _nested(size, stride) -> bool:
    """Whether every stride is larger than the farthest reach of the smaller ones: then each
    storage element is hit at most once and its multi-index follows from dividing greedily."""
    reach = 0
    for n, st in sorted(((n, st) for n, st in zip(size, stride) if n > 1), key=lambda t: t[1]):
        if st <= reach:
            return False
        reach += (n - 1) * st
    return True


def _as_strided_scatter_samples():
    return [((rand(3, 4), rand(2, 2), [2, 2], [1, 2]), {}),
            ((rand(3, 4), rand(2, 2), [2, 2], [1, 2], 3), {}),
            ((edge_floats(4, 5), edge_floats(5, 4), [5, 4], [1, 5]), {}),  # a transposed write
            ((rand(6, 6), rand(6), [6], [7]), {}),  # the diagonal
            ((rand(2, 8, 3), rand(2, 3, 3), [2, 3, 3], [24, 6, 1], 1), {}),
            ((rand(12), rand(2, 3), [2, 3], [3, 2]), {}),  # strides that are not nested
            ((rand(6), rand(2, 2), [2, 2], [1, 1]), {}),  # overlapping: the last write wins, as in torch
            ((edge_ints(4, 4), edge_ints(2, 4), [2, 4], [8, 1], 4), {}),
            ((edge_ints(9, dtype=torch.int32), randint(3, dtype=torch.int32), [3], [3], 2), {}),
            ((randbool(3, 3), randbool(3), [3], [4]), {}),
            ((rand(2, 3), torch.tensor(7.5), [], [], 5), {}),
            ((rand(3, 3), rand(0, 2), [0, 2], [3, 1]), {})]


@register("aten.as_strided_scatter.default", ALL, samples=_as_strided_scatter_samples)
def as_strided_scatter(pb, node, x, src, size, stride, storage_offset=None):
    """A copy of ``x`` with ``src`` written where ``as_strided(size, stride, storage_offset)`` of
    that (contiguous) copy reads. Nested strides invert by division; others (possibly
    overlapping) scan every element of ``src``, the last that lands on an element winning, in the
    row-major order torch copies in."""
    meta = node.outputs[0]
    size, stride = [int(s) for s in size], [int(s) for s in stride]
    base = int(storage_offset or 0)
    total = math.prod(size)
    if total and (min(stride, default=0) < 0 or base < 0 or
                  base + sum((n - 1) * st for n, st in zip(size, stride)) >= meta.numel):
        raise Unsupported(f"as_strided_scatter writes outside the {meta.numel} elements of its input "
                          f"(size {size}, stride {stride}, storage offset {base})")
    if total == 0:
        return [x]
    x, src = pb.fit([x, views.reshape(src, size)], 1)
    strides = [math.prod(meta.shape[d + 1:]) for d in range(len(meta.shape))]
    ty = ctype(meta.dtype)  # the output's: x may hold i32 where the output needs two words
    nested = _nested(size, stride)
    order = sorted(range(len(size)), key=lambda d: -stride[d])

    def fn(k, idx):
        old = cast(x.read(k, list(idx)), x.ty, ty)
        p = k.let(" + ".join([f"{i} * {s}" for i, s in zip(idx, strides) if i != "0"] or ["0"]), "i32")
        if nested:
            rem = k.var("i32", f"{p} - {base}", "rem")
            hit = k.var("bool", f"{rem} >= 0", "hit")
            sidx = ["0"] * len(size)
            for d in order:
                if size[d] == 1:
                    continue
                i = k.let(f"{rem} / {stride[d]}", "i32")
                k.emit(f"{hit} = {hit} && {i} < {size[d]};")
                k.emit(f"{rem} = {rem} - {i} * {stride[d]};")
                sidx[d] = k.let(f"clamp({i}, 0, {size[d] - 1})", "i32")
            taken = cast(src.read(k, sidx), src.ty, ty)
            return f"select({old}, {taken}, {hit} && {rem} == 0)"
        acc = k.var(ty, old, "acc")
        k.loop("j", total)
        sidx = k.unravel("j", size)
        at = " + ".join([f"{i} * {st}" for i, st in zip(sidx, stride) if i != "0" and st] + [str(base)])
        k.open(f"if ({at} == {p})")
        k.emit(f"{acc} = {cast(src.read(k, sidx), src.ty, ty)};")
        k.close()
        k.close()
        return acc
    return [Custom(meta.shape, meta.dtype, [x, src], fn)]


_INDEX_REDUCTIONS = ("prod", "mean", "amax", "amin")


def _index_reduce_samples():
    nan = torch.tensor([[math.nan, 1.0, -math.inf, 2.0, math.inf, -0.0]]).t()
    cases = [(rand(5, 3), 0, randint(7, hi=5), rand(7, 3, lo=0.5, hi=1.5)),
             (rand(4, 6), 1, randint(9, hi=6), rand(4, 9)),
             (edge_floats(4, 5), -1, randint(6, hi=5), edge_floats(4, 6)),
             (rand(2, 5, 3), 1, randint(4, hi=5), rand(2, 4, 3)),
             (rand(3, 1), 0, torch.tensor([0, 0, 1, 1, 2, 2]), nan),
             (randint(6, 4, lo=-9, hi=9), 0, randint(8, hi=6), randint(8, 4, lo=-9, hi=9)),
             (edge_ints(4, 5, dtype=torch.int32), 1, randint(7, hi=5), randint(4, 7, lo=-9, hi=9, dtype=torch.int32)),
             (randint(3, 5, lo=-100, hi=100, dtype=torch.int8), 1, randint(8, hi=5),
              randint(3, 8, lo=-100, hi=100, dtype=torch.int8)),
             (randbool(5, 4), 0, randint(6, hi=5), randbool(6, 4))]
    out = []
    for x, dim, index, src in cases:
        for reduce in _INDEX_REDUCTIONS:
            if x.dtype == torch.bool and reduce == "mean":
                continue  # torch has no mean of bools
            for include_self in (True, False):
                out.append(((x, dim, index, src, reduce), {"include_self": include_self}))
    return out


@register("aten.index_reduce.default", ALL, samples=_index_reduce_samples)
def index_reduce(pb, node, x, dim, index, source, reduce, *, include_self=True):
    """``x`` with the slices of ``source`` reduced into the slices ``index`` names along ``dim``:
    scatter_reduce with the index spread over the source's other dims."""
    if reduce not in _INDEX_REDUCTIONS:
        raise Unsupported(f"index_reduce: reduce={reduce!r}; torch takes {', '.join(_INDEX_REDUCTIONS)}")
    nd = len(x.shape)
    if nd == 0:
        spread = views.reshape(index, [])
    else:
        dim = views.norm_dim(dim, nd)
        line = [1] * nd
        line[dim] = index.numel
        spread = views.expand_to(views.reshape(index, line), source.shape)
    return [scatter_dim(pb, node.outputs[0], x, dim, spread, source, reduce, bool(include_self))]


__all__ = ["view_copy", "permute_copy", "narrow_copy", "unbind_copy", "as_strided_copy", "unfold", "unfold_op",
           "new_empty_strided", "addmv", "addbmm", "dist", "masked_select", "put", "as_strided_scatter",
           "index_reduce"]
