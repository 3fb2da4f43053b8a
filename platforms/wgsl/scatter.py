"""Scatter ops: index_put (the key/value cache update of a generation), index_copy, slice_scatter.

All are lazy: an output element is computed where it is read. ``index_put`` scans the index
entries for the ones that land on the element (a deterministic loop, no atomics): with
``accumulate`` it adds every match to the input, otherwise the last match wins, as torch does
for unique indices (it leaves duplicates undefined). Indices are wrapped and clamped like the
gathers' (platforms/wgsl/index.py), so a bad index never writes outside a buffer."""

from __future__ import annotations

import math

import torch

from tapml.platforms.wgsl import views
from tapml.platforms.wgsl.codegen import Custom, cast
from tapml.platforms.wgsl.index import advanced_layout, wrapped_index
from tapml.platforms.wgsl.registry import ALL, rand, randint, register


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
    ty = x.ty

    def fn(k, idx):
        acc = k.var(ty, x.read(k, list(idx)), "put")
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
        else:
            k.emit(f"{acc} = {acc} + {v};")
        k.close()
        k.close()
        return acc
    return Custom(meta.shape, meta.dtype, [x, values] + ivals, fn)


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
    ]


@register("aten.index_put.default", ALL, samples=_index_put_samples)
def index_put(pb, node, x, indices, values, accumulate=False):
    return [_scatter(pb, node.outputs[0], x, indices, values, bool(accumulate))]


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
    ty = x.ty

    def fn(k, idx):
        i = idx[dim]
        j = k.let(f"({i} - {first}) / {step}", "i32")
        inside = f"({i} >= {first} && {i} < {stop} && ({i} - {first}) % {step} == 0)"
        sidx = list(idx)
        sidx[dim] = k.let(f"clamp({j}, 0, {max(src.shape[dim] - 1, 0)})", "i32")
        if src.shape[dim] == 0:
            return x.read(k, list(idx))
        return f"select({x.read(k, list(idx))}, {cast(src.read(k, sidx), src.ty, ty)}, {inside})"
    return [Custom(meta.shape, meta.dtype, [x, src], fn)]


__all__ = ["index_put", "index_copy", "slice_scatter"]
