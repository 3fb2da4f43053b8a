"""View transforms on Values: on a BufferView they change strides/offset (no copy); on a
computed value they re-index it lazily (:class:`Remap`). The view ops that exist only as such a
transform (``diagonal``, ``as_strided``) are registered here too."""

from __future__ import annotations

import math
from typing import Sequence

import torch

from tapml.errors import Unsupported
from tapml.platforms.wgsl.codegen import ITEMSIZE, BufferView, Remap, Value, contiguous_strides
from tapml.platforms.wgsl.registry import ALL, edge_floats, edge_ints, rand, randbool, register


def norm_dim(d: int, ndim: int) -> int:
    """``d`` in ``[0, ndim)`` (negative dims count from the end; a 0-d tensor takes 0 and -1)."""
    if not -max(ndim, 1) <= d < max(ndim, 1):
        raise IndexError(f"dim {d} out of range for {ndim}-d tensor")
    return d % max(ndim, 1)


def expand_to(v: Value, shape: Sequence[int]) -> Value:
    """Broadcast ``v`` to ``shape`` (numpy rules, aligned right)."""
    shape = tuple(int(s) for s in shape)
    if tuple(v.shape) == shape:
        return v
    lead = len(shape) - len(v.shape)
    if lead < 0:
        raise ValueError(f"cannot expand {v.shape} to {shape}")
    bcast = [i < lead or v.shape[i - lead] == 1 and shape[i] != 1 for i in range(len(shape))]
    if isinstance(v, BufferView):
        strides = [0 if bcast[i] else v.strides[i - lead] for i in range(len(shape))]
        return BufferView(v.buf, shape, strides, v.offset, v.dtype)

    def fn(k, idx):
        return ["0" if bcast[i] else idx[i] for i in range(lead, len(shape))]
    return Remap(v, shape, fn, in_order=math.prod(shape) == v.numel,  # only new dims of size 1
                 axes={i: i - lead for i in range(lead, len(shape)) if not bcast[i]})


def permute(v: Value, dims: Sequence[int]) -> Value:
    """``v`` with its dimensions in the order ``dims``."""
    nd = len(v.shape)
    dims = [norm_dim(d, nd) for d in dims]
    shape = [v.shape[d] for d in dims]
    if isinstance(v, BufferView):
        return BufferView(v.buf, shape, [v.strides[d] for d in dims], v.offset, v.dtype)
    inv = [dims.index(i) for i in range(nd)]
    return Remap(v, shape, lambda k, idx: [idx[inv[i]] for i in range(nd)], axes=dict(enumerate(dims)))


def _view_strides(shape, strides, new_shape):
    """Strides of ``new_shape`` viewing a tensor with ``shape``/``strides``, or None when no
    such view exists (torch's computeStride)."""
    if math.prod(shape) == 0:
        return contiguous_strides(new_shape)
    new_strides = [0] * len(new_shape)
    view_d = len(new_shape) - 1
    chunk_base = strides[-1] if strides else 1
    tensor_numel, view_numel = 1, 1
    for d in range(len(shape) - 1, -1, -1):
        tensor_numel *= shape[d]
        if d == 0 or (shape[d - 1] != 1 and strides[d - 1] != tensor_numel * chunk_base):
            while view_d >= 0 and (view_numel < tensor_numel or new_shape[view_d] == 1):
                new_strides[view_d] = view_numel * chunk_base
                view_numel *= new_shape[view_d]
                view_d -= 1
            if view_numel != tensor_numel:
                return None
            if d > 0:
                chunk_base = strides[d - 1]
                tensor_numel, view_numel = 1, 1
    if view_d != -1:
        return None
    return new_strides


def reshape(v: Value, shape: Sequence[int]) -> Value:
    """``v`` as ``shape`` (one -1 allowed): a strided view where torch could view it, else a remap."""
    shape = list(shape)
    if -1 in shape:
        known = math.prod(s for s in shape if s != -1)
        shape[shape.index(-1)] = v.numel // known if known else 0
    shape = tuple(int(s) for s in shape)
    if tuple(v.shape) == shape:
        return v
    if math.prod(shape) != v.numel:
        raise ValueError(f"cannot view {v.shape} as {shape}")
    same_kind = v.reshaped(shape)
    if same_kind is not None:
        return same_kind
    if isinstance(v, BufferView):
        st = _view_strides(v.shape, v.strides, shape) if v.shape else contiguous_strides(shape)
        if st is not None:
            return BufferView(v.buf, shape, st, v.offset, v.dtype)
    src_shape = tuple(v.shape)
    groups = _reshape_groups(src_shape, shape) if v.numel else [(range(len(src_shape)), range(len(shape)))]

    def fn(k, idx):
        # each group of dims maps on its own: only a group that merges source dims divides
        out: list[str] = []
        for src, dst in groups:
            sizes = [shape[d] for d in dst]
            terms = [f"{idx[d]} * {s}" if s != 1 else idx[d]
                     for d, s in zip(dst, contiguous_strides(sizes)) if idx[d] != "0"]
            linear = "0" if not terms else terms[0] if len(terms) == 1 else k.let(f"({' + '.join(terms)})", "i32")
            out.extend([linear] if len(src) == 1 else k.unravel(linear, [src_shape[d] for d in src]))
        return out
    return Remap(v, shape, fn, in_order=True, axes={dst[0]: src[0] for src, dst in groups if len(src) == len(dst) == 1})


def _reshape_groups(src: tuple, dst: tuple) -> list[tuple[range, range]]:
    """The shortest runs of source and target dims whose sizes multiply to the same number, in
    order (sizes all at least 1): ``(2, 2, 8) -> (4, 8)`` is ``[(range(0, 2), range(0, 1)),
    (range(2, 3), range(1, 2))]`` (source dims 0 and 1 merge into target dim 0)."""
    groups, i, j = [], 0, 0
    while i < len(src) or j < len(dst):
        i0, j0 = i, j
        ps, pd = (src[i] if i < len(src) else 1), (dst[j] if j < len(dst) else 1)
        i, j = min(i + 1, len(src)), min(j + 1, len(dst))
        while ps != pd:
            if ps < pd:
                ps, i = ps * src[i], i + 1
            else:
                pd, j = pd * dst[j], j + 1
        groups.append((range(i0, i), range(j0, j)))
    return groups


def slice_(v: Value, dim: int, start, end, step: int = 1) -> Value:
    """``v[start:end:step]`` along ``dim``, with Python's clamping of out-of-range bounds."""
    nd = len(v.shape)
    dim = norm_dim(dim, nd)
    size = v.shape[dim]
    start = 0 if start is None else start
    end = size if end is None else end
    start = start + size if start < 0 else start
    end = end + size if end < 0 else end
    start, end = min(max(start, 0), size), min(max(end, 0), size)
    n = max(0, -(-(end - start) // step))
    shape = list(v.shape)
    shape[dim] = n
    if isinstance(v, BufferView):
        strides = list(v.strides)
        strides[dim] *= step
        return BufferView(v.buf, shape, strides, v.offset + start * v.strides[dim], v.dtype)

    def fn(k, idx):
        out = list(idx)
        i = idx[dim]
        e = i if step == 1 else f"{i} * {step}"
        out[dim] = k.let(f"({e} + {start})", "i32") if start else (e if i != "0" else "0")
        return out
    return Remap(v, shape, fn)


def select(v: Value, dim: int, index: int) -> Value:
    """``v`` at ``index`` along ``dim``, that dimension dropped."""
    nd = len(v.shape)
    dim = norm_dim(dim, nd)
    index = index + v.shape[dim] if index < 0 else index
    shape = v.shape[:dim] + v.shape[dim + 1:]
    if isinstance(v, BufferView):
        return BufferView(v.buf, shape, v.strides[:dim] + v.strides[dim + 1:],
                          v.offset + index * v.strides[dim], v.dtype)
    return Remap(v, shape, lambda k, idx: list(idx[:dim]) + [str(index)] + list(idx[dim:]))


def unsqueeze(v: Value, dim: int) -> Value:
    """``v`` with a new dimension of size 1 at ``dim``."""
    dim = dim % (len(v.shape) + 1)
    shape = v.shape[:dim] + (1,) + v.shape[dim:]
    if isinstance(v, BufferView):
        return BufferView(v.buf, shape, v.strides[:dim] + (0,) + v.strides[dim:], v.offset, v.dtype)
    same_kind = v.reshaped(shape)
    if same_kind is not None:
        return same_kind
    return Remap(v, shape, lambda k, idx: list(idx[:dim]) + list(idx[dim + 1:]), in_order=True)


def squeeze(v: Value, dims: Sequence[int] | None = None) -> Value:
    """``v`` without the size-1 dimensions among ``dims`` (all of them when None)."""
    nd = len(v.shape)
    if dims is None:
        dims = [d for d in range(nd) if v.shape[d] == 1]
    dims = {norm_dim(d, nd) for d in dims if v.shape[norm_dim(d, nd)] == 1} if nd else set()
    keep = [d for d in range(nd) if d not in dims]
    shape = tuple(v.shape[d] for d in keep)
    if isinstance(v, BufferView):
        return BufferView(v.buf, shape, [v.strides[d] for d in keep], v.offset, v.dtype)

    def fn(k, idx):
        out, j = [], 0
        for d in range(nd):
            if d in dims:
                out.append("0")
            else:
                out.append(idx[j])
                j += 1
        return out
    return Remap(v, shape, fn)


def diagonal(v: Value, offset: int = 0, dim1: int = 0, dim2: int = 1) -> Value:
    """``torch.diagonal``: the elements ``(i, i + offset)`` of the planes of ``dim1`` and ``dim2``
    (``(i - offset, i)`` for a negative offset), as a new last dimension; both dims dropped."""
    nd = len(v.shape)
    d1, d2 = norm_dim(dim1, nd), norm_dim(dim2, nd)
    if d1 == d2:
        raise ValueError(f"diagonal dimensions cannot be identical {dim1}, {dim2}")
    rest = [d for d in range(nd) if d not in (d1, d2)]
    length = max(0, min(v.shape[d1] + min(offset, 0), v.shape[d2] - max(offset, 0)))
    shape = tuple(v.shape[d] for d in rest) + (length,)
    row, col = max(-offset, 0), max(offset, 0)  # where the diagonal starts
    if isinstance(v, BufferView):
        start = v.offset + (row * v.strides[d1] + col * v.strides[d2] if length else 0)
        return BufferView(v.buf, shape, [v.strides[d] for d in rest] + [v.strides[d1] + v.strides[d2]], start, v.dtype)

    def fn(k, idx):
        out = [None] * nd
        for d, i in zip(rest, idx[:-1]):
            out[d] = i
        i = idx[-1]
        out[d1] = k.let(f"({i} + {row})", "i32") if row else i
        out[d2] = k.let(f"({i} + {col})", "i32") if col else i
        return out
    return Remap(v, shape, fn)


def as_strided(v: Value, size: Sequence[int], stride: Sequence[int], storage_offset: int | None = None) -> Value:
    """``torch.as_strided``: elements ``storage[storage_offset + sum(i * stride)]`` of ``v``'s storage.

    A buffer view's storage is its buffer, as a torch view's is its base's (the storage offset
    defaults to the view's own, as in torch). A computed value has no storage yet: it is read
    as the contiguous tensor torch makes of a fresh result. Unsupported when an element would
    lie outside that storage (torch raises there)."""
    size, stride = [int(s) for s in size], [int(s) for s in stride]
    if len(size) != len(stride):
        raise ValueError(f"as_strided: {len(size)} sizes but {len(stride)} strides")
    if any(s < 0 for s in size) or any(s < 0 for s in stride):
        raise Unsupported("as_strided with negative sizes or strides (torch refuses them too)")
    base = (v.offset if isinstance(v, BufferView) else 0) if storage_offset is None else int(storage_offset)
    if isinstance(v, BufferView):  # a buffer's size is padded to whole words: its meta counts elements
        elements = v.buf.meta.numel if v.buf.meta is not None else v.buf.size // ITEMSIZE[v.buf.dtype]
    else:
        elements = v.numel
    if math.prod(size):
        last = base + sum((n - 1) * st for n, st in zip(size, stride))
        if base < 0 or last >= elements:
            raise Unsupported(f"as_strided reads element {last} of a storage of {elements} elements "
                              f"(size {size}, stride {stride}, storage offset {base})")
    if isinstance(v, BufferView):
        return BufferView(v.buf, size, stride, base, v.dtype)
    src_shape = v.shape

    def fn(k, idx):
        terms = [str(base)] if base else []
        terms += [i if st == 1 else f"{i} * {st}" for i, st in zip(idx, stride) if st and i != "0"]
        return k.unravel(k.let(f"({' + '.join(terms) or '0'})", "i32"), src_shape)
    return Remap(v, size, fn)


# --- the view ops registered here ----------------------------------------------------------

def _diagonal_samples():
    return [((rand(4, 4),), {}), ((rand(3, 6), 2), {}), ((rand(5, 3), -1), {}), ((rand(3, 6), -2), {}),
            ((rand(2, 5, 4), 1, 0, 2), {}), ((rand(2, 3, 4, 5), -2, -1, 1), {}), ((rand(3, 4, 5), 0, 2, 0), {}),
            ((edge_floats(6, 6), 0, -1, -2), {}), ((edge_ints(5, 7), 3), {}),
            ((edge_ints(4, 4, dtype=torch.int32), -3), {}), ((randbool(3, 5), 1), {}),
            # an offset past the matrix: an empty diagonal
            ((rand(3, 4), 5), {})]


@register("aten.diagonal.default", ALL, samples=_diagonal_samples, view=True)
def diagonal_op(pb, node, x, offset=0, dim1=0, dim2=1):
    return [diagonal(x, offset, dim1, dim2)]


def _as_strided_samples():
    x = rand(2, 8, 6, 6)
    return [
        # overlapping windows (a 2x2 pooling window view with stride 1, as unfold makes)
        ((rand(5, 6), [4, 5, 2, 2], [6, 1, 6, 1]), {}),
        # channels-last read of a contiguous NCHW tensor (what adaptive pooling emits)
        ((x, [2, 8, 6, 6], [288, 1, 48, 8]), {}),
        ((x, [2, 8, 3, 3], [288, 36, 12, 2], 1), {}),
        ((rand(24), [3, 4], [1, 3]), {}),
        ((rand(4, 6), [2, 3], [0, 2], 5), {}),  # a zero stride repeats
        ((edge_floats(3, 5), [5, 3], [1, 5]), {}),
        ((edge_ints(4, 5), [3, 3], [6, 1], 2), {}),
        ((edge_ints(12, dtype=torch.int32), [2, 2, 3], [6, 3, 1]), {}),
        ((randbool(3, 4), [4, 3], [1, 4]), {}),
        ((rand(3, 3), [], [], 4), {}),  # one element, as a 0-d tensor
        ((rand(3, 3), [0, 4], [4, 1]), {}),
    ]


@register("aten.as_strided.default", ALL, samples=_as_strided_samples, view=True)
def as_strided_op(pb, node, x, size, stride, storage_offset=None):
    return [as_strided(x, size, stride, storage_offset)]
