"""More neural-network ops: 3-D and adaptive pooling, pairwise distances (cdist, pdist),
embedding bags, col2im (fold), training-mode batch norm (with and without running stats), nonzero."""

from __future__ import annotations

import dataclasses
import math

import torch

from tapml.graph import Node, TensorMeta, decode_arg
from tapml.platforms.wgsl import views
from tapml.platforms.wgsl.codegen import (I64, LOOP_BUDGET, BufferView, Compute, Custom, cast, ctype, less, lit,
                                         round_low)
from tapml.platforms.wgsl.folds import fold_rows, moments_fold
from tapml.platforms.wgsl.registry import (ALL, ALL_FLOAT, ALL_INT, edge_floats, edge_ints, rand, randbool, randint,
                                           register)
from tapml.platforms.wgsl.nn import (_int_window_mean, _mean_and_square_sum, _pool_max_start, _window_sum,
                                     adaptive_avg_pool2d, avg_pool2d, batch_norm, normalize_channels)
# the coordinates of a mask's True elements, shared with x[mask]
from tapml.platforms.wgsl.scatter import mask_coordinates, truth_of


def _tuple(v, n: int) -> list[int]:
    if isinstance(v, int):
        return [v] * n
    v = list(v)
    return v * n if len(v) == 1 else v


def _flat(names, sizes) -> str:
    """Row-major flat index of ``names`` in a block of ``sizes``."""
    e = names[0]
    for name, size in zip(names[1:], sizes[1:]):
        e = f"({e}) * {size} + {name}"
    return e


# --- pooling -----------------------------------------------------------------------------

def _max_pool(pb, node, x, nsp: int, window, name: str):
    """Values and flat spatial indices of the maximum over each window; ``window(k, o, d)``
    emits the start and end of dimension ``d``'s window for output index ``o`` and returns
    ``(start, end, step)`` (the window skips positions outside the input itself). As in torch,
    the first maximum wins, and a NaN always takes the place (tested on the bits, since drivers
    may fold ``v != v``)."""
    vmeta, imeta = node.outputs
    sizes = list(x.shape[-nsp:])
    vb, ib = pb.buffer("temp", vmeta), pb.buffer("temp", imeta)
    res = [BufferView.whole(vb, vmeta), BufferView.whole(ib, imeta)]
    if vmeta.numel == 0:
        return res
    (x,) = pb.fit([x], 2)
    k = pb.kernel(name)
    idx = k.unravel("n", vmeta.shape)
    lead, out = idx[:-nsp], idx[-nsp:]
    ty, best = _pool_max_start(k, vmeta)
    arg = k.var("i32", "-1", "arg")
    names = [f"i{d}" for d in range(nsp)]
    for d in range(nsp):
        s, e, step = window(k, out[d], d)
        k.open(f"for (var i{d}: i32 = {s}; i{d} < {e}; i{d} = i{d} + {step})")
    v = cast(x.read(k, list(lead) + names), x.ty, ty)
    nan = f" || {k.need('tap_isnan')}({v})" if ty == "f32" else ""
    k.emit(f"if ({arg} < 0 || {less(best, v, ty)}{nan}) {{ {best} = {v}; {arg} = {_flat(names, sizes)}; }}")
    for _ in range(nsp):
        k.close()
    k.write(vb, "n", best, ty)
    k.write(ib, "n", arg, "i32")
    pb.add(k.finish(vmeta.numel))
    return res


def _max_pool3d_samples():
    ints = [((randint(1, 2, 5, 6, 6, lo=lo, hi=hi, dtype=dt), [2, 2, 2]), {})
            for dt, lo, hi in ((torch.int16, -2**15, 2**15), (torch.int8, -128, 128), (torch.uint8, 0, 256))]
    nans = rand(1, 2, 4, 4, 4)
    nans[0, 0, 0, 0, 1] = nans[0, 0, 1, 1, 0] = nans[0, 1, 2, 2, 3] = math.nan
    return [((rand(2, 3, 6, 8, 8), [2, 2, 2]), {}),
            ((rand(1, 2, 7, 9, 9), [3, 3, 2], [2, 2, 1], [1, 1, 0]), {}),
            ((rand(2, 5, 7, 7), [2, 2, 2], [2, 2, 2], [0, 0, 0], [1, 1, 1], True), {}),
            ((rand(1, 2, 7, 8, 9), [2, 3, 3], [1, 2, 1], [1, 1, 1], [2, 1, 2]), {}),
            ((edge_floats(1, 2, 4, 5, 6), [2, 2, 3], [1, 2, 2], [1, 1, 1]), {}),
            ((nans, [2, 2, 2]), {}),
            ((edge_ints(1, 2, 5, 6, 6, dtype=torch.int32), [3, 3, 3], [2, 2, 2], [1, 1, 1]), {}),
            # a narrow range, so that windows hold ties: the first maximum's index wins
            ((randint(1, 2, 5, 7, 7, lo=-3, hi=3), [2, 3, 2], [2, 2, 2], [1, 1, 0], [1, 1, 2], True), {}),
            ((edge_ints(2, 4, 4, 4), [2, 2, 2]), {}), *ints]


@register("aten.max_pool3d_with_indices.default", ALL_FLOAT + ALL_INT, samples=_max_pool3d_samples)
def max_pool3d(pb, node, x, kernel_size, stride=(), padding=0, dilation=1, ceil_mode=False):
    ks = _tuple(kernel_size, 3)
    st = _tuple(stride, 3) if stride else ks
    pad, dil = _tuple(padding, 3), _tuple(dilation, 3)
    sizes = list(x.shape[-3:])

    def window(k, o, d):
        # the first tap inside the input: tap a >= ceil((pad - o*stride) / dilation)
        s = k.let(f"{o} * {st[d]} - {pad[d]}", "i32")
        skip = k.let(f"(max(-{s}, 0) + {dil[d] - 1}) / {dil[d]}", "i32")
        e = k.let(f"min({s} + {(ks[d] - 1) * dil[d] + 1}, {sizes[d]})", "i32")
        return f"{s} + {skip} * {dil[d]}", e, dil[d]
    return _max_pool(pb, node, x, 3, window, "max_pool3d")


def _adaptive_bounds(k, o, size_in: int, size_out: int) -> tuple[str, str]:
    """torch's adaptive window of output index ``o``: [floor(o*I/O), ceil((o+1)*I/O))."""
    s = k.let(f"({o} * {size_in}) / {size_out}", "i32")
    e = k.let(f"(({o} + 1) * {size_in} + {size_out - 1}) / {size_out}", "i32")
    return s, e


def _adaptive_max(nsp: int):
    def lower(pb, node, x, output_size):
        sizes = list(x.shape[-nsp:])
        outs = list(node.outputs[0].shape[-nsp:])

        def window(k, o, d):
            s, e = _adaptive_bounds(k, o, sizes[d], outs[d])
            return s, e, 1
        return _max_pool(pb, node, x, nsp, window, f"adaptive_max_pool{nsp}d")
    return lower


def _adaptive_max_samples(nsp: int):
    def samples():
        nans = rand(1, 2, *[5] * nsp)
        nans.view(-1)[[1, 7, 30]] = math.nan
        shapes = [(2, 3, 8, 8, 8), (1, 2, 7, 9, 10)] if nsp == 3 else [(2, 3, 8, 8), (1, 4, 7, 9), (3, 10, 11)]
        outs = [[2, 3, 4], [3, 4, 5]] if nsp == 3 else [[2, 3], [3, 4], [4, 5]]
        return [((rand(*s), o), {}) for s, o in zip(shapes, outs)] + [
            ((rand(1, 2, *[4] * nsp), [1] * nsp), {}),
            ((edge_floats(1, 3, *[6] * nsp), [4] * nsp), {}),  # overlapping windows
            ((nans, [2] * nsp), {})]
    return samples


register("aten.adaptive_max_pool2d.default", ALL_FLOAT, samples=_adaptive_max_samples(2))(_adaptive_max(2))
register("aten.adaptive_max_pool3d.default", ALL_FLOAT, samples=_adaptive_max_samples(3))(_adaptive_max(3))


def _avg_pool3d_samples():
    return [((rand(2, 3, 6, 8, 8), [2, 2, 2]), {}),
            ((rand(1, 2, 7, 9, 9), [3, 3, 2], [2, 2, 1], [1, 1, 0]), {}),
            ((rand(1, 2, 7, 7, 6), [3, 3, 3], [2, 2, 2], [1, 1, 1], True, False), {}),
            ((rand(2, 5, 6, 6), [2, 2, 2], [2, 2, 2], [0, 0, 0], False, True, 3), {}),
            ((rand(1, 2, 5, 7, 7), [2, 3, 3], [2, 2, 2], [1, 1, 1], True, True), {}),
            ((edge_floats(1, 2, 4, 5, 6), [2, 2, 3], [1, 2, 2], [1, 1, 1]), {}),
            # torch averages only int64 among the integers: the sum in int64, divided with truncation
            ((edge_ints(1, 2, 4, 6, 6), [2, 2, 2]), {}),
            ((torch.tensor([[[[2**31 - 1, 2**31 - 1, -2**31], [2**31 - 1, 5, -2**31]],
                             [[-2**31, -2**31, 7], [2**31 - 1, -3, 4]]]]), [2, 2, 2], [1, 1, 1], [1, 1, 1], True, True),
             {}),
            ((randint(1, 2, 5, 7, 7, lo=-99, hi=99), [3, 3, 3], [2, 2, 2], [1, 1, 1], True, False), {}),
            ((randint(2, 4, 6, 6, lo=-99, hi=99), [2, 2, 3], [2, 2, 2], [1, 1, 1], False, True, -4), {})]


@register("aten.avg_pool3d.default", ("float32", "int64"), samples=_avg_pool3d_samples)
def avg_pool3d(pb, node, x, kernel_size, stride=(), padding=0, ceil_mode=False, count_include_pad=True,
               divisor_override=None):
    """torch's CPU kernel takes float32 and int64 only (float16 and bfloat16 are refused there)."""
    ks = _tuple(kernel_size, 3)
    st = _tuple(stride, 3) if stride else ks
    pad = _tuple(padding, 3)
    meta = node.outputs[0]
    sizes = list(x.shape[-3:])

    def fn(k, idx):
        lead, out = idx[:-3], idx[-3:]
        starts, ends, clipped_s, clipped_e = [], [], [], []
        for d in range(3):
            s = k.let(f"{out[d]} * {st[d]} - {pad[d]}", "i32")
            e = k.let(f"min({s} + {ks[d]}, {sizes[d] + pad[d]})", "i32")
            starts.append(s)
            ends.append(e)
            clipped_s.append(k.let(f"max({s}, 0)", "i32"))
            clipped_e.append(k.let(f"min({e}, {sizes[d]})", "i32"))
        if divisor_override:
            div = lit(divisor_override, "i32")
        elif count_include_pad:
            div = " * ".join(f"({e} - {s})" for s, e in zip(starts, ends))
        else:
            div = " * ".join(f"({e} - {s})" for s, e in zip(clipped_s, clipped_e))
        names = [k.fresh("p") for _ in range(3)]
        if ctype(meta.dtype) in ("i32", I64):
            return _int_window_mean(k, x, lead, names, clipped_s, clipped_e, div, ctype(meta.dtype))
        acc = _window_sum(k, x, lead, names, clipped_s, clipped_e, "f32")
        return f"({acc} / f32({div}))"
    return [Custom(meta.shape, meta.dtype, [x], fn, cost=9)]


@register("aten._adaptive_avg_pool3d.default", ALL_FLOAT,
          samples=lambda: [((rand(2, 3, 8, 8, 8), [1, 1, 1]), {}), ((rand(1, 2, 7, 9, 10), [3, 4, 5]), {}),
                           ((rand(3, 5, 6, 7), [2, 4, 3]), {}), ((edge_floats(1, 2, 5, 6, 4), [2, 3, 3]), {})])
def adaptive_avg_pool3d(pb, node, x, output_size):
    meta = node.outputs[0]
    sizes = list(x.shape[-3:])
    outs = list(meta.shape[-3:])

    def fn(k, idx):
        lead, out = idx[:-3], idx[-3:]
        bounds = [_adaptive_bounds(k, out[d], sizes[d], outs[d]) for d in range(3)]
        names = [k.fresh("p") for _ in range(3)]
        acc = _window_sum(k, x, lead, names, [b[0] for b in bounds], [b[1] for b in bounds], "f32")
        return f"({acc} / f32({' * '.join(f'({e} - {s})' for s, e in bounds)}))"
    return [Custom(meta.shape, meta.dtype, [x], fn, cost=9)]


# --- pairwise distances ------------------------------------------------------------------

def _distance(k, p: float, M: int, diffs, nan_max: bool) -> str:
    """Emit the p-norm distance of the differences ``diffs(k)`` yields for ``m`` in [0, M).
    As torch: p = 0 counts nonzero differences (a NaN difference
    makes it NaN), p = inf is the largest magnitude (NaN taken only when ``nan_max``: pdist
    takes it, cdist skips it)."""
    isnan = k.need("tap_isnan")
    acc = k.var("f32", "0.0", "dist")
    k.loop("m", M)
    d = k.let(f"abs({diffs(k)})", "f32")
    if p == 0:
        k.emit(f"{acc} = {acc} + select(select(0.0, 1.0, {d} != 0.0), {d}, {isnan}({d}));")
    elif p == 1:
        k.emit(f"{acc} = {acc} + {d};")
    elif p == 2:
        k.emit(f"{acc} = {acc} + {d} * {d};")
    elif math.isinf(p):
        taken = f"{d} > {acc}" + (f" || {isnan}({d})" if nan_max else "")
        k.emit(f"if ({taken}) {{ {acc} = {d}; }}")
    else:
        k.emit(f"{acc} = {acc} + {k.need('tap_pow')}({d}, {lit(p, 'f32')});")
    k.close()
    if p == 2:
        return f"sqrt({acc})"
    if p in (0, 1) or math.isinf(p):
        return acc
    return f"{k.need('tap_pow')}({acc}, {lit(1.0 / p, 'f32')})"


def _p_reason(node, at: int) -> str | None:
    args = list(node.args)
    p = decode_arg(args[at], None) if len(args) > at else node.kwargs.get("p", 2.0)
    if not isinstance(p, (int, float)):
        return f"p = {p!r} is not a number"
    if math.isnan(p) or p < 0:
        return f"p = {p}: torch refuses a negative p"
    return None


def _cdist_samples():
    edge1, edge2 = edge_floats(4, 5), rand(6, 5)
    edge2[2, 1], edge2[3, 0] = math.inf, 0.0
    return [((rand(3, 4), rand(5, 4), p, None), {}) for p in (0.0, 1.0, 2.0, math.inf, 0.5, 3.0)] + [
        ((rand(2, 7, 3), rand(2, 6, 3), 2.0, 2), {}),
        # batch dims broadcast
        ((rand(2, 1, 5, 4), rand(3, 6, 4), 1.0, None), {}),
        # more than 25 rows: torch computes the euclidean distance with a matrix product
        ((rand(30, 6), rand(8, 6), 2.0, None), {}), ((rand(4, 6), rand(9, 6), 2.0, 1), {}),
        ((rand(40, 8), rand(33, 8), 2.0, 2), {}),
        *[((edge1, edge2, p, 2), {}) for p in (0.0, 1.0, 2.0, math.inf, 1.5)],
        ((edge1, edge2, 2.0, 1), {})]


@register("aten._cdist_forward.default", ("float32",), samples=_cdist_samples,
          check=lambda node: _p_reason(node, 2))
def cdist_forward(pb, node, x1, x2, p, compute_mode=None):
    """torch's CPU kernel takes float32 only. With p = 2 and more than 25 rows (compute_mode
    None or 0) or compute_mode 1, torch computes ``sqrt(max(|a|² + |b|² - 2 a·b, 1e-30))`` (a
    matrix product); that formula is followed, its rounding and special values included."""
    meta = node.outputs[0]
    P, M = x1.shape[-2:]
    R = x2.shape[-2]
    batch = list(meta.shape[:-2])
    x1 = views.expand_to(x1, batch + [P, M])
    x2 = views.expand_to(x2, batch + [R, M])
    (x1, x2) = pb.fit([x1, x2], 1)
    mode = 0 if compute_mode is None else compute_mode
    use_mm = p == 2 and (mode == 1 or (mode == 0 and (P > 25 or R > 25)))

    def fn(k, idx):
        lead, i, j = list(idx[:-2]), idx[-2], idx[-1]
        a, b = (lambda k: cast(x1.read(k, lead + [i, "m"]), x1.ty, "f32")), \
            (lambda k: cast(x2.read(k, lead + [j, "m"]), x2.ty, "f32"))
        if M == 0:
            return lit(0, "f32")
        if use_mm:
            na, nb, dot = k.var("f32", "0.0", "na"), k.var("f32", "0.0", "nb"), k.var("f32", "0.0", "dot")
            k.loop("m", M)
            av, bv = k.let(a(k), "f32"), k.let(b(k), "f32")
            k.emit(f"{na} = {na} + {av} * {av};")
            k.emit(f"{nb} = {nb} + {bv} * {bv};")
            k.emit(f"{dot} = {dot} + (-2.0 * {av}) * {bv};")
            k.close()
            sq = k.let(f"{dot} + {na} + {nb}", "f32")
            return f"sqrt(select(max({sq}, {lit(1e-30, 'f32')}), {sq}, {k.need('tap_isnan')}({sq})))"
        return _distance(k, p, M, lambda k: f"{a(k)} - {b(k)}", nan_max=False)
    return [Custom(meta.shape, meta.dtype, [x1, x2], fn, cost=9)]


@register("aten._pdist_forward.default", ("float32",),
          samples=lambda: [((rand(5, 4), p), {}) for p in (0.0, 1.0, 2.0, math.inf, 0.5, 3.0)] +
          [((rand(40, 7), 2.0), {}), ((rand(1, 3), 2.0), {})] +
          [((edge_floats(6, 5), p), {}) for p in (0.0, 1.0, 2.0, math.inf, 1.5)],
          check=lambda node: _p_reason(node, 1))
def pdist_forward(pb, node, x, p=2.0):
    """Distances of the pairs i < j of rows, in row-major order of (i, j); float32 only, as
    torch's CPU kernel."""
    meta = node.outputs[0]
    N, M = x.shape
    if meta.numel == 0:
        return [BufferView.whole(pb.buffer("temp", meta), meta)]
    (x,) = pb.fit([x], 1)

    def fn(k, idx):
        # pair t is (i, j) where row i's pairs start at i * (2N - i - 1) / 2
        i = k.var("i32", "0", "row")
        k.emit(f"loop {{ if ({i} + 1 >= {N - 1} || ({i} + 1) * {2 * N - 2} - ({i} + 1) * {i} > {idx[0]} * 2) "
               f"{{ break; }} {i} = {i} + 1; }}")
        j = k.let(f"{idx[0]} - ({i} * {2 * N - 1} - {i} * {i}) / 2 + {i} + 1", "i32")
        if M == 0:
            return lit(0, "f32")
        return _distance(k, p, M, lambda k: f"{cast(x.read(k, [i, 'm']), x.ty, 'f32')} - "
                                         f"{cast(x.read(k, [j, 'm']), x.ty, 'f32')}", nan_max=True)
    return [Custom(meta.shape, meta.dtype, [x], fn, cost=9)]


# --- embedding bags ----------------------------------------------------------------------

def _embedding_bag_samples():
    w, ids = rand(12, 5), randint(9, hi=12)
    ends = torch.tensor([0, 3, 3, 7])  # an empty bag
    samples = []
    for mode in (0, 1, 2):
        samples += [((w, ids, ends, False, mode), {}),
                    ((w, ids, ends, False, mode, False, None, True), {}),  # the last offset ends the bags
                    ((w, ids, ends, False, mode, False, None, False, int(ids[1])), {}),  # padding_idx
                    ((w, ids, torch.tensor([0, 3, 3, 6]), False, mode, False, None, True, int(ids[4])), {})]
    edge = edge_floats(10, 4)
    edge[3, 1] = math.nan
    edge_ids = torch.tensor([0, 1, 2, 3, 4, 3, 0, 9, 1], dtype=torch.int32)
    for mode in (0, 1, 2):
        samples.append(((edge, edge_ids, torch.tensor([0, 2, 5, 5], dtype=torch.int32), False, mode), {}))
    big = rand(300, 16)
    samples += [((w, ids, ends, False, 0, False, rand(9)), {}),  # per_sample_weights (sum only)
                ((edge, edge_ids, torch.tensor([0, 4], dtype=torch.int32), False, 0, False, edge_floats(9)), {}),
                ((big, randint(40, hi=300), torch.tensor([0, 10, 25, 25, 31]), False, 1), {}),
                ((big, randint(40, hi=300), torch.tensor([0, 12, 30]), False, 2), {})]
    return samples


def _embedding_bag(pb, node, weight, indices, offsets, scale_grad_by_freq=False, mode=0, sparse=False,
                   per_sample_weights=None, include_last_offset=False, padding_idx=-1):
    """The four outputs of torch's CPU kernel: the bags, ``offset2bag`` (each index's bag; empty
    in sum mode without padding_idx), ``bag_size`` (indices in each bag but padding ones; zeros in
    sum mode), ``max_indices`` (the row each maximum came from in max mode, 0 for an empty bag;
    bag_size in mean mode, zeros in sum mode).

    As torch, when ``include_last_offset`` and the last offset is not the number of indices, the
    last bag of a sum or mean without padding_idx ends at the last offset, while bag_size,
    offset2bag and max mode run it to the last index."""
    out_meta, o2b_meta, size_meta, arg_meta = node.outputs
    V, D = weight.shape
    n, n_off = indices.shape[0], offsets.shape[0]
    nb = out_meta.shape[0]
    pad = padding_idx if padding_idx is not None and padding_idx >= 0 else -1
    fast = mode in (0, 1) and pad < 0
    psw = per_sample_weights
    ins = [weight, indices, offsets] + ([psw] if psw is not None else [])
    weight, indices, offsets, *rest = pb.fit(ins, 1)
    psw = rest[0] if rest else None

    def offset(k, b):
        return k.let(f"clamp({cast(offsets.read(k, [b]), offsets.ty, 'i32')}, 0, {n})", "i32")

    def bounds(k, b, bag_end_limit):
        s = offset(k, b)
        if n_off == 0:
            return s, s
        e = k.let(f"select({n}, {offset(k, f'min({b} + 1, {n_off - 1})')}, {b} + 1 < {bag_end_limit})", "i32")
        return s, k.let(f"max({e}, {s})", "i32")

    def row(k, i):
        return k.let(f"clamp({cast(indices.read(k, [i]), indices.ty, 'i32')}, 0, {V - 1})", "i32")

    def count(k, b):
        s, e = bounds(k, b, nb)
        c = k.var("i32", "0", "cnt")
        k.open(f"for (var i: i32 = {s}; i < {e}; i = i + 1)")
        k.emit(f"if ({row(k, 'i')} != {pad}) {{ {c} = {c} + 1; }}")
        k.close()
        return c

    def bag(k, b, d, want_arg):
        s, e = bounds(k, b, n_off if fast else nb)
        acc = k.var("f32", "0.0", "acc")
        arg = k.var("i32", "0", "arg")
        first = k.var("bool", "true", "first")
        k.open(f"for (var i: i32 = {s}; i < {e}; i = i + 1)")
        j = row(k, "i")
        k.open(f"if ({j} != {pad})")
        v = cast(weight.read(k, [j, d]), weight.ty, "f32")
        if psw is not None:
            v = f"{v} * {cast(psw.read(k, ['i']), psw.ty, 'f32')}"
        v = k.let(v, "f32")
        if mode == 2:
            k.emit(f"if ({first} || {v} > {acc}) {{ {acc} = {v}; {arg} = {j}; }}")
        else:
            k.emit(f"{acc} = {acc} + {v};")
        k.emit(f"{first} = false;")
        k.close()
        k.close()
        if want_arg:
            return arg
        if mode == 1:
            c = count(k, b)
            return f"select({acc}, {acc} / f32({c}), {c} > 0)"
        return acc

    def zeros(meta):
        return Custom(meta.shape, meta.dtype, [], lambda k, idx: lit(0, "i32"))

    out = Custom(out_meta.shape, out_meta.dtype, [weight, indices, offsets] + ([psw] if psw is not None else []),
                 lambda k, idx: bag(k, idx[0], idx[1], False), cost=9)
    if o2b_meta.numel == 0:
        o2b = zeros(o2b_meta)
    else:
        def bag_of(k, idx):
            c = k.var("i32", "-1", "bag")
            k.loop("b", nb)
            k.emit(f"if ({offset(k, 'b')} <= {idx[0]}) {{ {c} = {c} + 1; }}")
            k.close()
            return c
        o2b = Custom(o2b_meta.shape, o2b_meta.dtype, [offsets], bag_of, cost=9)
    if mode == 0:
        sizes, args = zeros(size_meta), zeros(arg_meta)
    else:
        sizes = Custom(size_meta.shape, size_meta.dtype, [indices, offsets], lambda k, idx: count(k, idx[0]), cost=9)
        args = sizes if mode == 1 else Custom(arg_meta.shape, arg_meta.dtype, [weight, indices, offsets],
                                              lambda k, idx: bag(k, idx[0], idx[1], True), cost=9)
    return [out, o2b, sizes, args]


for _op in ("aten._embedding_bag.default", "aten._embedding_bag_forward_only.default"):
    register(_op, ALL_FLOAT + ("int64", "int32"), samples=_embedding_bag_samples,
             check=lambda node: None if node.outputs[0].dtype in ALL_FLOAT else
             f"embedding_bag of {node.outputs[0].dtype} weights (torch takes float weights only)")(_embedding_bag)


# --- col2im ------------------------------------------------------------------------------

def _col2im_samples():
    def cols(C, out, ks, dil, pad, st, fn=rand, dtype=None):
        L = math.prod((o + 2 * p - (d * (k - 1) + 1)) // s + 1 for o, k, d, p, s in zip(out, ks, dil, pad, st))
        t = fn(2, C * ks[0] * ks[1], L) if dtype is None else fn(2, C * ks[0] * ks[1], L, dtype=dtype)
        return (t, out, ks, dil, pad, st)
    return [(cols(3, [4, 5], [2, 2], [1, 1], [0, 0], [1, 1]), {}),
            (cols(2, [8, 7], [3, 2], [1, 2], [1, 0], [2, 1]), {}),
            (cols(4, [9, 9], [3, 3], [2, 1], [2, 1], [2, 3]), {}),
            (cols(2, [6, 6], [2, 2], [1, 1], [0, 0], [2, 2]), {}),  # no overlap
            ((rand(12, 20), [5, 6], [2, 2], [1, 1], [0, 0], [1, 1]), {}),  # unbatched
            (cols(2, [5, 6], [3, 3], [1, 1], [1, 1], [1, 1], edge_floats), {}),
            (cols(2, [5, 6], [2, 3], [1, 1], [0, 1], [1, 2], lambda *s, dtype: randbool(*s), torch.bool), {})]


@register("aten.col2im.default", ALL_FLOAT + ("bool",), samples=_col2im_samples)
def col2im(pb, node, x, output_size, kernel_size, dilation, padding, stride):
    """Each output pixel gathers the columns that land on it, in torch's order (kernel row,
    then column), rounded per step in float16/bfloat16 as torch adds in the tensor's dtype;
    bool adds are ors. torch's CPU kernel takes no integer dtype."""
    meta = node.outputs[0]
    kh, kw = _tuple(kernel_size, 2)
    dh, dw = _tuple(dilation, 2)
    ph, pw = _tuple(padding, 2)
    sh, sw = _tuple(stride, 2)
    H, W = meta.shape[-2:]
    hcol = (H + 2 * ph - (dh * (kh - 1) + 1)) // sh + 1
    wcol = (W + 2 * pw - (dw * (kw - 1) + 1)) // sw + 1
    ty = "bool" if meta.dtype == "bool" else "f32"
    (x,) = pb.fit([x], 1)

    def fn(k, idx):
        lead, c, y, xx = list(idx[:-3]), idx[-3], idx[-2], idx[-1]
        acc = k.var(ty, lit(0, ty), "acc")
        k.loop("a", kh)
        k.loop("b", kw)
        k.emit(f"let th: i32 = {y} + {ph} - a * {dh};")
        k.emit(f"let tw: i32 = {xx} + {pw} - b * {dw};")
        # the sign is tested first: % of a negative operand is undefined in GLSL
        conds = [f"th >= 0 && th < {hcol * sh}", f"tw >= 0 && tw < {wcol * sw}"]
        if sh != 1:
            conds.append(f"th % {sh} == 0")
        if sw != 1:
            conds.append(f"tw % {sw} == 0")
        k.open(f"if ({' && '.join(conds)})")
        col = k.let(f"({c} * {kh} + a) * {kw} + b", "i32")
        pos = k.let(f"(th / {sh}) * {wcol} + tw / {sw}", "i32")
        v = cast(x.read(k, lead + [col, pos]), x.ty, ty)
        if ty == "bool":
            k.emit(f"{acc} = {acc} || {v};")
        else:
            k.emit(f"{acc} = {round_low(k, f'({acc} + {v})', meta.dtype)};")
        k.close()
        k.close()
        k.close()
        return acc
    return [Custom(meta.shape, meta.dtype, [x], fn, cost=9)]


# --- batch norm from batch statistics ----------------------------------------------------

def _bn_stats_samples():
    return [((rand(4, 3, 5, 5), rand(3), rand(3), True, 0.1, 1e-5), {}),
            ((rand(8, 6), None, None, True, 0.1, 1e-3), {}),
            ((rand(2, 4, 3, 4, 5), rand(4), None, True, 0.1, 1e-5), {}),
            ((rand(3, 5, 7, lo=-40, hi=60), None, rand(5), True, 0.1, 1e-5), {}),
            ((edge_floats(3, 2, 4), rand(2), rand(2), True, 0.1, 1e-5), {})]


def _batch_statistics(pb, x, eps: float) -> tuple[BufferView, BufferView, BufferView]:
    """Each channel's (dim 1) mean, 1/sqrt(biased variance + eps) and sum of squared deviations
    from the mean, over the batch and spatial dims: three f32 buffers of shape (C,) written by
    one kernel, a thread per channel making two passes over its values (as torch's CPU kernel);
    past LOOP_BUDGET, folded across invocations in one pass (platforms/wgsl/folds.py)."""
    N, C = x.shape[0], x.shape[1]
    S = math.prod(x.shape[2:])
    if 2 * N * S > LOOP_BUDGET and C:  # a long channel: Chan's (count, mean, M2) folded across invocations
        fold = moments_fold(lambda k, v: v, lambda k, st: [
            (st[1], "f32"), (f"inverseSqrt({st[2]} / {st[0]} + {lit(eps, 'f32')})", "f32"), (st[2], "f32")])
        xs = views.reshape(x, (N, C, S))
        xf = xs if xs.ty == "f32" else Compute(xs.shape, "float32", [xs], lambda k, e, idx: cast(e[0], xs.ty, "f32"), cost=0)
        return tuple(fold_rows(pb, "batch_stats", xf, [0, 2], [TensorMeta((C,), "float32")] * 3, fold))
    bufs = [pb.buffer("temp", TensorMeta((C,), "float32")) for _ in range(3)]
    stats = tuple(BufferView.whole(b, b.meta) for b in bufs)
    if N * C * S == 0:  # torch refuses an empty input
        return stats
    (xf,) = pb.fit([views.reshape(x, (N, C, S))], 3)
    k = pb.kernel("batch_stats")
    L = N * S

    def read(k):
        return cast(xf.read(k, [k.let(f"j / {S}", "i32"), "n", k.let(f"j % {S}", "i32")]), xf.ty, "f32")
    mean, squares = _mean_and_square_sum(k, L, read)
    rstd = k.let(f"inverseSqrt({squares} / {lit(L, 'f32')} + {lit(eps, 'f32')})", "f32")
    for buf, e in zip(bufs, (mean, rstd, squares)):
        k.write(buf, "n", e, "f32")
    pb.add(k.finish(C))
    return stats


@register("aten._native_batch_norm_legit.no_stats", ALL_FLOAT, samples=_bn_stats_samples,
          check=lambda node: None if node.args[3] else
          "_native_batch_norm_legit.no_stats without training: there are no statistics to normalize with",
          flops="norm")
def batch_norm_no_stats(pb, node, x, weight, bias, training, momentum, eps):
    """Training-mode batch norm without running statistics: ``(x - mean) * invstd`` with the
    affine parameters, from each channel's batch statistics; returns the output, the mean and
    the inverse std."""
    return batch_norm_training(pb, node, x, weight, bias, None, None, momentum, eps)


def batch_norm_training(pb, node, x, weight, bias, running_mean, running_var, momentum, eps) -> list:
    """Batch norm by the batch's own statistics (training mode): the output, each channel's
    mean and inverse std, then, when running statistics are given, torch's update of them:
    ``(1 - momentum) * running + momentum * batch``, the batch variance unbiased (the sum of
    squared deviations over L - 1, L the values per channel; NaN when L = 1, as torch)."""
    mean, rstd, squares = _batch_statistics(pb, x, eps)
    outs = [normalize_channels(pb, x, node.outputs[0], mean, rstd, weight, bias, lambda rstd: rstd), mean, rstd]
    if running_mean is None or running_var is None:
        return outs
    L = x.numel // x.shape[1]
    unbiased = Compute(squares.shape, "float32", [squares],
                       lambda k, e, idx: f"{e[0]} / {lit(L - 1, 'f32')}" if L > 1 else lit(math.nan, "f32"))
    return outs + [_running_update(running, batch, meta, momentum)
                   for running, batch, meta in ((running_mean, mean, node.outputs[3]),
                                                (running_var, unbiased, node.outputs[4]))]


def _running_update(running, batch, meta, momentum: float) -> Compute:
    """``momentum * batch + (1 - momentum) * running`` in f32, torch's order of operations."""
    m = lit(momentum, "f32")
    return Compute(meta.shape, meta.dtype, [running, batch],
                   lambda k, e, idx: f"{m} * {cast(e[1], batch.ty, 'f32')} + "
                                     f"(1.0 - {m}) * {cast(e[0], running.ty, 'f32')}")


def batch_norm_running(pb, node, x, weight, bias, running_mean, running_var, momentum, eps) -> list:
    """Batch norm by the running statistics (not training): the output, empty (0,) batch
    statistics, and the running statistics as they are."""
    y, *empties = batch_norm(pb, node, x, weight, bias, running_mean, running_var, momentum, eps)
    return [y] + empties[:2] + [running_mean, running_var]


def _bn_running_samples():
    """(input, weight, bias, running_mean, running_var, training, momentum, eps): 2-d to 5-d,
    affine parameters or none, momentum 0 to 1, edge values in one channel only (so that the
    others show), a constant channel (zero variance), subnormal values, a large common offset
    (the two passes matter), float16/bfloat16 inputs with float32 parameters, and not training."""
    def stats(C):
        return rand(C), rand(C, lo=0.5, hi=2)
    odd = rand(4, 3, 6)
    odd[:, 1] = 0.0
    odd[1:, 1] = -0.0  # ±0 and no spread: 1/sqrt(eps)
    odd[:, 2] = rand(4, 6) * 1e-39  # subnormal
    return [((rand(4, 3, 5, 5), rand(3), rand(3), *stats(3), True, 0.1, 1e-5), {}),
            ((rand(8, 6), None, None, *stats(6), True, 0.3, 1e-3), {}),
            ((rand(2, 4, 3, 4, 5), rand(4), None, *stats(4), True, 0.0, 1e-5), {}),
            ((rand(3, 5, 7, lo=-40, hi=60), None, rand(5), *stats(5), True, 1.0, 1e-5), {}),
            ((rand(5, 2, 6, lo=100, hi=104), rand(2), rand(2), *stats(2), True, 0.1, 1e-5), {}),
            ((edge_floats(2, 3, 8), rand(3), rand(3), *stats(3), True, 0.1, 1e-5), {}),
            ((odd, rand(3), rand(3), *stats(3), True, 0.5, 1e-5), {}),
            ((rand(1, 4), None, None, *stats(4), True, 0.1, 1e-5), {}),  # one value per channel
            ((rand(4, 3, 5).half(), rand(3), rand(3), *stats(3), True, 0.1, 1e-5), {}),
            ((rand(4, 3, 5).bfloat16(), None, None, *stats(3), True, 0.1, 1e-5), {}),
            ((rand(2, 4, 5, 5), rand(4), rand(4), *stats(4), False, 0.1, 1e-5), {}),
            ((edge_floats(3, 6), None, None, *stats(6), False, 0.1, 1e-3), {})]


@register("aten._native_batch_norm_legit_functional.default", ALL_FLOAT, samples=_bn_running_samples, flops="norm")
def batch_norm_functional(pb, node, x, weight, bias, running_mean, running_var, training, momentum, eps):
    """What ``torch.export`` gives for batch norm in train() mode: training, the batch's
    statistics and the updated running ones (:func:`batch_norm_training`); not training, the
    running statistics (:func:`batch_norm_running`)."""
    lower = batch_norm_training if training else batch_norm_running
    return lower(pb, node, x, weight, bias, running_mean, running_var, momentum, eps)


def _native_batch_norm_reason(node) -> str | None:
    if not node.args[5] and (node.args[3] is None or node.args[4] is None):
        return "native_batch_norm without training and without running statistics: nothing to normalize with"
    return None


@register("aten.native_batch_norm.default", ALL_FLOAT, check=_native_batch_norm_reason, flops="norm",
          samples=lambda: _bn_running_samples() +
          [((rand(4, 3, 5, 5), rand(3), rand(3), None, None, True, 0.1, 1e-5), {})])
def native_batch_norm(pb, node, x, weight, bias, running_mean, running_var, training, momentum, eps):
    """Batch norm as the eager op: training, by the batch's statistics (the running ones, which
    eager torch updates in place, are not outputs of the op); else by the running statistics."""
    if training:
        return batch_norm_training(pb, node, x, weight, bias, None, None, momentum, eps)
    return batch_norm(pb, node, x, weight, bias, running_mean, running_var, momentum, eps)


def _with_update_samples():
    return [(args[:5] + args[6:], kwargs) for args, kwargs in _bn_running_samples() if args[5]]


@register("aten._batch_norm_with_update_functional.default", ALL_FLOAT, samples=_with_update_samples, flops="norm")
def batch_norm_with_update(pb, node, x, weight, bias, running_mean, running_var, momentum, eps):
    """torch's training batch norm before its decomposition: :func:`batch_norm_training`'s
    results with an empty ``reserve`` (uint8, for cuDNN) before the running statistics."""
    out, save_mean, save_rstd, reserve, mean_out, var_out = node.outputs
    shifted = dataclasses.replace(node, outputs=[out, save_mean, save_rstd, mean_out, var_out])
    y, mean, rstd, running_mean, running_var = batch_norm_training(pb, shifted, x, weight, bias, running_mean,
                                                                   running_var, momentum, eps)
    return [y, mean, rstd, BufferView.whole(pb.buffer("temp", reserve), reserve), running_mean, running_var]


# --- nonzero -----------------------------------------------------------------------------

def _nonzero_samples():
    zs = rand(5, 7)
    zs[zs.abs() < 1] = 0.0
    mixed = edge_floats(4, 6)
    mixed.view(-1)[[6, 9, 13]] = 0.0
    ints = edge_ints(6, 5)
    ints[1] = 0
    return [((zs,), {}), ((mixed,), {}), ((randbool(3, 4, 5),), {}), ((ints,), {}),
            ((edge_ints(40, 30, dtype=torch.int32) * randbool(40, 30),), {}),
            ((randint(7, 9, lo=-1, hi=2, dtype=torch.int16),), {}),
            ((randint(9, lo=-1, hi=2, dtype=torch.int8),), {}),
            ((randint(4, 4, hi=3, dtype=torch.uint8),), {}),
            ((torch.zeros(3, 3),), {}), ((torch.tensor(2.5),), {}), ((torch.tensor([-0.0, 0.0, 1.0, -0.0]),), {}),
            ((rand(2, 3, 2, 4) * randbool(2, 3, 2, 4),), {})]


@register("aten.nonzero.default", ALL, samples=_nonzero_samples)
def nonzero(pb, node, x):
    """The coordinates of the nonzero elements (NaN is nonzero, -0 is zero) in row-major order.
    How many there are is data-dependent: the node's recorded output shape says it (a carve
    records the concrete shape). A prefix count over the elements (no atomics) gives each
    nonzero element its row; rows past the recorded count are not written."""
    return [mask_coordinates(pb, truth_of(x), node.outputs[0])]


@register("aten.nonzero_static.default", ALL,
          samples=lambda: [((args[0],), {"size": size, "fill_value": fill}) for args, _ in _nonzero_samples()[:6]
                           for size, fill in ((3, -1), (40, -7))] + [((rand(3, 4),), {"size": 0})])
def nonzero_static(pb, node, x, size, fill_value=-1):
    """``nonzero`` padded (or cut) to ``size`` rows, the rows past the nonzero elements ``fill_value``."""
    return [mask_coordinates(pb, truth_of(x), node.outputs[0], fill=fill_value)]


__all__ = ["max_pool3d", "avg_pool3d", "adaptive_avg_pool3d", "cdist_forward", "pdist_forward", "col2im",
           "batch_norm_no_stats", "batch_norm_training", "batch_norm_running", "batch_norm_functional",
           "native_batch_norm", "batch_norm_with_update", "nonzero", "nonzero_static"]


# --- 1-d average pools: the 2-d lowerings over a height of 1 -------------------------------

def _over_height_1(node, x, pool_2d):
    """``pool_2d(node2d, x2d)`` on ``x`` [..., L] seen as [..., 1, L], read back as [..., L_out]."""
    meta = node.outputs[0]
    high = TensorMeta(tuple(meta.shape[:-1]) + (1, meta.shape[-1]), meta.dtype)
    (out,) = pool_2d(Node(node.name, node.op, node.args, node.kwargs, [high]), views.unsqueeze(x, -2))
    return [views.reshape(out, meta.shape)]


@register("aten.avg_pool1d.default", ALL_FLOAT + ("int64",),
          samples=lambda: [((rand(2, 3, 9), [3]), {}), ((rand(1, 4, 10), [3], [2], [1]), {}),
                           ((rand(3, 7), [2], [2], [1], True, False), {}),
                           ((edge_floats(2, 3, 8), [2], [1], [1]), {}),
                           ((edge_ints(2, 3, 8), [3], [2], [1], True, True), {})])
def avg_pool1d(pb, node, x, kernel_size, stride=(), padding=0, ceil_mode=False, count_include_pad=True):
    k = _tuple(kernel_size, 1)[0]
    s = _tuple(stride, 1)[0] if list(stride) else k
    p = _tuple(padding, 1)[0]
    return _over_height_1(node, x, lambda n, v: avg_pool2d(pb, n, v, [1, k], [1, s], [0, p], ceil_mode,
                                                           count_include_pad))


@register("aten.adaptive_avg_pool1d.default", ALL_FLOAT,
          samples=lambda: [((rand(2, 3, 9), [1]), {}), ((rand(1, 4, 10), [4]), {}), ((edge_floats(2, 7), [3]), {})])
def adaptive_avg_pool1d(pb, node, x, output_size):
    return _over_height_1(node, x, lambda n, v: adaptive_avg_pool2d(pb, n, v, [1, _tuple(output_size, 1)[0]]))
