"""Indexing ops: embedding, gather, index_select, index.Tensor (advanced indexing).

All are lazy gathers: the consumer kernel reads the index, then the source. Indices are
clamped into range so a bad index can never read outside a buffer (torch would raise)."""

from __future__ import annotations

import torch

from tapml.errors import Unsupported
from tapml.platforms.wgsl import views
from tapml.platforms.wgsl.codegen import Custom, cast
from tapml.platforms.wgsl.registry import ALL, ALL_INT, edge_floats, edge_ints, rand, randbool, randint, register


def wrapped_index(k, v, idx, size, wrap=True):
    """The i32 index read from ``v`` at ``idx``: negative ones wrapped by ``size``, then clamped into range."""
    i = cast(v.read(k, idx), v.ty, "i32")
    if wrap:
        i = k.let(f"select({i}, {i} + {size}, {i} < 0)", "i32")
    return k.let(f"clamp({i}, 0, {size - 1})", "i32")


@register("aten.embedding.default", ALL,
          samples=lambda: [((rand(10, 4), randint(3, 5, hi=10)), {}), ((rand(256, 16), randint(1, 16, hi=256), 1), {})])
def embedding(pb, node, weight, indices, padding_idx=-1, scale_grad_by_freq=False, sparse=False):
    meta = node.outputs[0]
    V = weight.shape[0]

    def fn(k, idx):
        i = wrapped_index(k, indices, list(idx[:-1]), V, wrap=False)
        return weight.read(k, [i, idx[-1]])
    weight, indices = pb.fit([weight, indices], 1)
    return [Custom(meta.shape, meta.dtype, [weight, indices], fn)]


@register("aten.gather.default", ALL,
          samples=lambda: [((rand(3, 5), 1, randint(3, 4, hi=5)), {}), ((rand(4, 3), 0, randint(2, 3, hi=4)), {}),
                           ((randint(2, 6), 1, randint(2, 6, hi=6)), {}),
                           # 0-d tensors gather as 1-d ones (OpInfo's gather samples)
                           ((torch.tensor(2.5), 0, torch.tensor([0])), {}), ((torch.tensor(7), 0, torch.tensor(0)), {}),
                           ((rand(4), 0, torch.tensor(3)), {})])
def gather(pb, node, x, dim, index, sparse_grad=False):
    meta = node.outputs[0]
    dim = views.norm_dim(dim, len(x.shape))

    def fn(k, idx):
        idx = list(idx) or ["0"]  # torch gathers 0-d tensors as 1-d ones of one element
        i = wrapped_index(k, index, idx, x.shape[dim], wrap=False)
        src = list(idx)
        src[dim] = i
        return x.read(k, src)
    x, index = pb.fit([x, index], 1)
    x, index = (v if v.shape else views.reshape(v, [1]) for v in (x, index))
    return [Custom(meta.shape, meta.dtype, [x, index], fn)]


@register("aten.index_select.default", ALL,
          samples=lambda: [((rand(5, 4), 0, randint(3, hi=5)), {}), ((rand(2, 6, 3), 1, randint(4, hi=6)), {}),
                           # a 0-d input and a 0-d index (OpInfo's index_select samples)
                           ((torch.tensor(3.5), 0, torch.tensor([0])), {}), ((rand(5), 0, torch.tensor(2)), {}),
                           ((edge_floats(5, 3), 0, randint(4, hi=5)), {}),
                           ((edge_ints(6, 2, dtype=torch.int32), 0, randint(5, hi=6)), {}),
                           ((edge_ints(6), 0, randint(5, hi=6)), {})])
def index_select(pb, node, x, dim, index):
    meta = node.outputs[0]
    if not x.shape:  # a 0-d tensor: torch lets the index be 0 (or -1) only, so the result is x
        return [x]
    dim = views.norm_dim(dim, len(x.shape))
    index = views.reshape(index, [index.numel])

    def fn(k, idx):
        src = list(idx)
        src[dim] = wrapped_index(k, index, [idx[dim]], x.shape[dim])
        return x.read(k, src)
    x, index = pb.fit([x, index], 1)
    return [Custom(meta.shape, meta.dtype, [x, index], fn)]


def advanced_layout(shape, indices, op: str):
    """Where ``x[indices]``'s index dims go (torch's advanced indexing): ``(indices`` padded with
    None to ``len(shape)``, the positions that hold an index tensor, their broadcast shape, whether
    they are adjacent, the first result dim they fill, the dims left as they are)``. Boolean masks
    are :func:`tapml.platforms.wgsl.scatter.boolean_mask`'s."""
    nd = len(shape)
    indices = list(indices) + [None] * (nd - len(indices))
    pos = [d for d, i in enumerate(indices) if i is not None]
    if not pos:
        raise Unsupported(f"{op} without any index tensor")
    for d in pos:
        if indices[d].dtype not in ALL_INT:
            raise Unsupported(f"{op} with a boolean mask beside other index tensors")
    bshape = tuple(torch.broadcast_shapes(*[tuple(indices[d].shape) for d in pos]))
    adjacent = pos == list(range(pos[0], pos[-1] + 1))
    return indices, pos, bshape, adjacent, pos[0] if adjacent else 0, [d for d in range(nd) if d not in pos]


def _index_samples():
    return [((rand(5, 4), [randint(3, hi=5)]), {}), ((rand(3, 5, 4), [None, randint(2, 2, hi=5)]), {}),
            ((rand(4, 5, 6), [randint(3, hi=4), None, randint(3, lo=-6, hi=6)]), {}),
            ((rand(4, 5, 6), [randint(2, 1, hi=4), randint(3, hi=5)]), {}),
            ((randint(6, 2), [randint(4, hi=6)]), {}),
            # boolean masks: x[mask] has as many rows as the mask has Trues (the recorded shape)
            ((rand(6, 4), [torch.tensor([True, False, True, True, False, True])]), {}),
            ((rand(3, 5, 2), [None, randbool(3, 5)[1]]), {}), ((edge_floats(4, 3), [randbool(4, 3)]), {}),
            ((randint(5, 6, dtype=torch.int16), [randbool(5, 6)]), {}), ((rand(4, 2), [torch.zeros(4, dtype=torch.bool)]), {})]


@register("aten.index.Tensor", ALL, samples=_index_samples)
def index_tensor(pb, node, x, indices):
    meta = node.outputs[0]
    from tapml.platforms.wgsl.scatter import boolean_mask, masked_gather  # scatter builds on this module
    if (mask := boolean_mask(indices, "index.Tensor")) is not None:
        return [masked_gather(pb, meta, x, *mask)]
    nd = len(x.shape)
    indices, pos, bshape, adjacent, start, rest = advanced_layout(x.shape, indices, "index.Tensor")
    idx_vals = pb.fit([x] + [views.expand_to(indices[d], bshape) for d in pos], 1)
    x, ivals = idx_vals[0], idx_vals[1:]
    nb = len(bshape)

    def fn(k, idx):
        bidx = list(idx[start:start + nb])
        other = list(idx[:start]) + list(idx[start + nb:])
        src = [None] * nd
        for d, v in zip(pos, ivals):
            src[d] = wrapped_index(k, v, bidx, x.shape[d])
        for d, i in zip(rest, other):
            src[d] = i
        return x.read(k, src)
    return [Custom(meta.shape, meta.dtype, [x] + ivals, fn)]

