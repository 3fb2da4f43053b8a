"""Neural-network ops: softmax, layer/group/batch norm, convolution, pooling.

Softmax and the norms loop over a row in one thread while it is short; past LOOP_BUDGET they
are row statistics folded across invocations (platforms/wgsl/folds.py) and one elementwise
pass. A convolution whose sum has more than LOOP_BUDGET terms is summed in chunks, then the
chunks' partial sums are folded.
"""

from __future__ import annotations

import math

from tapml.platforms.wgsl import views
from tapml.graph import TensorMeta
from tapml.platforms.wgsl.codegen import (CHUNK, I64, LOOP_BUDGET, BufferView, Compute, Custom, Value, arith, cast,
                                          contiguous_strides, ctype, extreme_lit, index_sum, less, lit)
from tapml.platforms.wgsl.folds import Fold, fold_rows, moments_fold, softmax_fold
from tapml.platforms.wgsl.matmul import wrap_int
from tapml.platforms.wgsl.registry import ALL_FLOAT, ALL_INT, NUMERIC, edge_floats, edge_ints, rand, randint, register


def _rows(pb, name, x, dim, meta, body):
    """One thread per line of ``x`` along ``dim``; ``body(k, read, write)`` gets
    ``read(j_expr)`` (the element at position j of the line) and ``write(j_expr, expr)``."""
    nd = len(x.shape)
    dim = views.norm_dim(dim, nd) if nd else 0
    out = pb.buffer("temp", meta)
    view = BufferView.whole(out, meta)
    if meta.numel == 0:
        return view
    (x,) = pb.fit([x], 1)
    lines = [x.shape[d] for d in range(nd) if d != dim]
    k = pb.kernel(name)
    lidx = k.unravel("n", lines)
    ostrides = contiguous_strides(meta.shape)

    def full(j):
        return list(lidx[:dim]) + [j] + list(lidx[dim:]) if nd else []

    def read(j):
        return cast(x.read(k, full(j)), x.ty, "f32")

    def write(j, e):
        k.write(out, index_sum(full(j), ostrides), e, "f32")
    body(k, read, write, x.shape[dim] if nd else 1)
    pb.add(k.finish(math.prod(lines)))
    return view


def row_statistics(pb, name: str, x: Value, dims, fold: Fold, outputs: int) -> list[tuple[Value, Value]]:
    """``fold`` of ``x`` (read as f32) over ``dims``: per output of the fold (it has ``outputs``),
    the float32 statistic (``dims`` kept as 1) and the same broadcast back to ``x``'s shape."""
    xf = x if x.ty == "f32" else Compute(x.shape, "float32", [x], lambda k, e, idx: cast(e[0], x.ty, "f32"), cost=0)
    kept = TensorMeta(tuple(1 if d in dims else s for d, s in enumerate(x.shape)), "float32")
    stats = fold_rows(pb, name, xf, dims, [kept] * outputs, fold)
    return [(stat, views.expand_to(stat, x.shape)) for stat in stats]


def _long_softmax(pb, x, dim, meta, log: bool) -> Value:
    """Softmax over a row past LOOP_BUDGET: its max and sum of exponentials in one fold across
    invocations (:func:`~tapml.platforms.wgsl.folds.softmax_fold`), then one elementwise pass."""
    (_, m), (_, s) = row_statistics(pb, "softmax", x, [dim], softmax_fold(lambda k, st: [(st[0], "f32"), (st[1], "f32")]), 2)
    shifted = Compute(x.shape, "float32", [x, m], lambda k, e, idx: f"({cast(e[0], x.ty, 'f32')} - {e[1]})")
    if log:
        return Compute(meta.shape, meta.dtype, [shifted, s], lambda k, e, idx: f"({e[0]} - log({e[1]}))")
    return Compute(meta.shape, meta.dtype, [shifted, s], lambda k, e, idx: f"(exp({e[0]}) / {e[1]})")


def _softmax(log):
    def lower(pb, node, x, dim, half_to_float=False):
        nd = len(x.shape)
        if nd and x.shape[views.norm_dim(dim, nd)] * 3 > LOOP_BUDGET:
            return [_long_softmax(pb, x, views.norm_dim(dim, nd), node.outputs[0], log)]

        def body(k, read, write, L):
            m = k.var("f32", lit(-math.inf, "f32"), "mx")
            k.loop("j", L)
            k.emit(f"{m} = max({m}, {read('j')});")
            k.close()
            s = k.var("f32", "0.0", "sm")
            k.loop("j", L)
            k.emit(f"{s} = {s} + exp({read('j')} - {m});")
            k.close()
            k.loop("j", L)
            if log:
                write("j", f"({read('j')} - {m} - log({s}))")
            else:
                write("j", f"(exp({read('j')} - {m}) / {s})")
            k.close()
        return [_rows(pb, "log_softmax" if log else "softmax", x, dim, node.outputs[0], body)]
    return lower


def _softmax_samples():
    return [((rand(3, 5, lo=-5, hi=5), -1, False), {}), ((rand(2, 4, 16, 16, lo=-8, hi=8), -1, False), {}),
            ((rand(4, 6), 0, False), {}), ((edge_floats(4, 6), -1, False), {})]


register("aten._softmax.default", ALL_FLOAT, samples=_softmax_samples, flops="softmax")(_softmax(False))
register("aten._log_softmax.default", ALL_FLOAT, samples=_softmax_samples, flops="softmax")(_softmax(True))


@register("aten.native_layer_norm.default", ALL_FLOAT,
          samples=lambda: [((rand(2, 5, 16), [16], rand(16), rand(16), 1e-5), {}),
                           ((rand(3, 4, 6), [4, 6], rand(4, 6), None, 1e-6), {}),
                           ((rand(4, 8), [8], None, None, 1e-12), {}),
                           ((edge_floats(3, 8), [8], rand(8), rand(8), 1e-5), {})], flops="norm")
def native_layer_norm(pb, node, x, normalized_shape, weight, bias, eps):
    nd = len(x.shape)
    axis = nd - len(normalized_shape)
    rows_shape, norm_shape = list(x.shape[:axis]), list(x.shape[axis:])
    L = math.prod(norm_shape)
    metas = node.outputs
    if L * 3 > LOOP_BUDGET and math.prod(rows_shape):
        xr = views.reshape(x, rows_shape + [L])
        w = views.reshape(weight, [L]) if weight is not None else None
        b = views.reshape(bias, [L]) if bias is not None else None
        y, mean, rstd = _long_norm(pb, "layer_norm", xr, [len(rows_shape)], eps, w, b, [len(rows_shape)])
        return [views.reshape(y, metas[0].shape), _as(mean, metas[1]), _as(rstd, metas[2])]
    bufs = [pb.buffer("temp", m) for m in metas]
    result = [BufferView.whole(b, m) for b, m in zip(bufs, metas)]
    if math.prod(rows_shape) * L == 0:
        return result
    x, weight, bias = _fit_affine(pb, x, weight, bias)
    k = pb.kernel("layer_norm")
    ridx = k.unravel("n", rows_shape)

    def read(k):
        jidx = k.unravel("j", norm_shape)
        return jidx, cast(x.read(k, list(ridx) + jidx), x.ty, "f32")
    mean, rstd = _moments(k, L, eps, lambda k: read(k)[1])
    k.loop("j", L)
    jidx, v = read(k)
    e = _affine(k, f"({v} - {mean}) * {rstd}", weight, bias, jidx)
    k.write(bufs[0], f"n * {L} + j", e, "f32")
    k.close()
    k.write(bufs[1], "n", mean, "f32")
    k.write(bufs[2], "n", rstd, "f32")
    pb.add(k.finish(math.prod(rows_shape)))
    return result


def _as(stat: Value, meta) -> Value:
    """A row statistic (float32, one per row) as an output of ``meta``: its shape and dtype."""
    v = views.reshape(stat, meta.shape)
    return v if meta.dtype == "float32" else Compute(meta.shape, meta.dtype, [v], lambda k, e, idx: e[0], cost=0)


def _long_norm(pb, name: str, x: Value, dims, eps: float, weight, bias, param_dims) -> tuple[Value, Value, Value]:
    """``(x - mean) / sqrt(var + eps) * weight + bias`` with the mean and biased variance over
    ``dims`` folded across invocations in one pass (:func:`~tapml.platforms.wgsl.folds.moments_fold`),
    ``weight``/``bias`` indexed by ``x``'s ``param_dims``. Returns the normalized value and the
    mean and rstd (float32, ``dims`` kept as 1)."""
    fold = moments_fold(lambda k, v: v, lambda k, st: [
        (st[1], "f32"), (f"inverseSqrt({st[2]} / {st[0]} + {lit(eps, 'f32')})", "f32")])
    (mean_stat, mean), (rstd_stat, rstd) = row_statistics(pb, name, x, dims, fold, 2)
    params = [p for p in (weight, bias) if p is not None]

    def spread(p):
        shape = [x.shape[d] if d in param_dims else 1 for d in range(len(x.shape))]
        return views.expand_to(views.reshape(p, shape), x.shape)

    def emit(k, e, idx):
        out = f"({cast(e[0], x.ty, 'f32')} - {e[1]}) * {e[2]}"
        rest = list(e[3:])
        if weight is not None:
            out = f"({out}) * {cast(rest.pop(0), weight.ty, 'f32')}"
        if bias is not None:
            out = f"{out} + {cast(rest.pop(0), bias.ty, 'f32')}"
        return out
    y = Compute(x.shape, x.dtype, [x, mean, rstd] + [spread(p) for p in params], emit, cost=2)
    return y, mean_stat, rstd_stat


def _fit_affine(pb, x, weight, bias):
    """``x`` and the optional ``weight`` and ``bias`` of a norm kernel that also writes three
    outputs, materialized as far as the binding limit needs."""
    x, *params = pb.fit([x] + [p for p in (weight, bias) if p is not None], 3)
    weight = params.pop(0) if weight is not None else None
    bias = params.pop(0) if bias is not None else None
    return x, weight, bias


def _affine(k, e: str, weight, bias, idx) -> str:
    """``e * weight[idx] + bias[idx]`` in f32, for whichever of weight and bias is given."""
    if weight is not None:
        e = f"({e}) * {cast(weight.read(k, idx), weight.ty, 'f32')}"
    if bias is not None:
        e = f"{e} + {cast(bias.read(k, idx), bias.ty, 'f32')}"
    return e


def _moments(k, L: int, eps: float, read) -> tuple[str, str]:
    """Mean and 1/sqrt(biased variance + eps) over ``j`` in [0, L), two passes as torch does;
    ``read(k)`` emits the f32 value at index ``j``."""
    mean, q = _mean_and_square_sum(k, L, read)
    return mean, k.let(f"inverseSqrt({q} / {lit(L, 'f32')} + {lit(eps, 'f32')})", "f32")


def _mean_and_square_sum(k, L: int, read) -> tuple[str, str]:
    """Mean and sum of squared deviations from it over ``j`` in [0, L) (two passes, f32)."""
    s = k.var("f32", "0.0", "s")
    k.loop("j", L)
    k.emit(f"{s} = {s} + {read(k)};")
    k.close()
    mean = k.let(f"{s} / {lit(L, 'f32')}", "f32")
    q = k.var("f32", "0.0", "q")
    k.loop("j", L)
    d = k.let(f"{read(k)} - {mean}", "f32")
    k.emit(f"{q} = {q} + {d} * {d};")
    k.close()
    return mean, q


@register("aten.native_group_norm.default", ALL_FLOAT,
          samples=lambda: [((rand(2, 6, 4, 4), rand(6), rand(6), 2, 6, 16, 3, 1e-5), {}),
                           ((rand(1, 4, 5), None, None, 1, 4, 5, 2, 1e-5), {}),
                           ((edge_floats(2, 4, 6), rand(4), rand(4), 2, 4, 6, 2, 1e-5), {})], flops="norm")
def native_group_norm(pb, node, x, weight, bias, N, C, HxW, group, eps):
    metas = node.outputs
    if C // group * HxW * 3 > LOOP_BUDGET and N * C * HxW:
        xg = views.reshape(x, (N, group, C // group, HxW))
        params = [views.reshape(p, (group, C // group)) if p is not None else None for p in (weight, bias)]
        y, mean, rstd = _long_norm(pb, "group_norm", xg, [2, 3], eps, *params, [1, 2])
        return [views.reshape(y, metas[0].shape), _as(mean, metas[1]), _as(rstd, metas[2])]
    bufs = [pb.buffer("temp", m) for m in metas]
    result = [BufferView.whole(b, m) for b, m in zip(bufs, metas)]
    if N * C * HxW == 0:
        return result
    xf, weight, bias = _fit_affine(pb, views.reshape(x, (N, C, HxW)), weight, bias)
    cg = C // group
    L = cg * HxW
    k = pb.kernel("group_norm")
    k.emit(f"let bn: i32 = n / {group};")
    k.emit(f"let g: i32 = n % {group};")

    def read(k):
        k.emit(f"let c: i32 = g * {cg} + j / {HxW};")
        k.emit(f"let p: i32 = j % {HxW};")
        return cast(xf.read(k, ["bn", "c", "p"]), xf.ty, "f32")
    mean, rstd = _moments(k, L, eps, read)
    k.loop("j", L)
    e = _affine(k, f"({read(k)} - {mean}) * {rstd}", weight, bias, ["c"])
    k.write(bufs[0], f"(bn * {C} + c) * {HxW} + p", e, "f32")
    k.close()
    k.write(bufs[1], "n", mean, "f32")
    k.write(bufs[2], "n", rstd, "f32")
    pb.add(k.finish(N * group))
    return result


def _bn_samples():
    return [((rand(2, 4, 5, 5), rand(4), rand(4), rand(4), rand(4, lo=0.5, hi=2), 0.1, 1e-5), {}),
            ((rand(3, 6), None, None, rand(6), rand(6, lo=0.5, hi=2), 0.1, 1e-3), {}),
            ((edge_floats(2, 3, 4), rand(3), rand(3), rand(3), rand(3, lo=0.5, hi=2), 0.1, 1e-5), {})]


def normalize_channels(pb, x: Value, meta, mean: Value, spread: Value, weight, bias, scale) -> Compute:
    """``(x - mean) * scale(spread) * weight + bias`` per channel (dim 1) of ``x``, as one fused
    value: ``scale`` turns the WGSL expression of a channel's ``spread`` (a variance, or already
    1/std) into its multiplier; ``weight`` and ``bias`` may be None."""
    C = x.shape[1] if len(x.shape) > 1 else 1

    def chan(v):
        return views.expand_to(views.reshape(v, [C] + [1] * (len(x.shape) - 2)), meta.shape)
    ins = pb.fit([x, chan(mean), chan(spread)] + [chan(p) for p in (weight, bias) if p is not None], 1)
    has_w, has_b = weight is not None, bias is not None

    def emit(k, e, idx):
        xv, mv, sv, *rest = [cast(a, v.ty, "f32") for a, v in zip(e, ins)]
        out = f"({xv} - {mv}) * {scale(sv)}"
        if has_w:
            out = f"({out}) * {rest.pop(0)}"
        if has_b:
            out = f"{out} + {rest.pop(0)}"
        return out
    return Compute(meta.shape, meta.dtype, ins, emit, cost=2)


@register("aten._native_batch_norm_legit_no_training.default", ALL_FLOAT, samples=_bn_samples, flops="norm")
def batch_norm(pb, node, x, weight, bias, running_mean, running_var, momentum, eps):
    meta = node.outputs[0]
    y = normalize_channels(pb, x, meta, running_mean, running_var, weight, bias,
                           lambda var: f"inverseSqrt({var} + {lit(eps, 'f32')})")
    empties = [BufferView.whole(pb.buffer("temp", m), m) for m in node.outputs[1:]]
    return [y] + empties


# --- convolution -------------------------------------------------------------------------

def _conv_samples():
    import torch
    ints = [((randint(2, 4, 7, 6, lo=lo, hi=hi, dtype=dt), randint(6, 2, 3, 2, lo=lo, hi=hi, dtype=dt),
              randint(6, lo=lo, hi=hi, dtype=dt), [2, 1], [1, 1], [1, 2], False, [0, 0], 2), {})
            for dt, lo, hi in ((torch.int16, -2**15, 2**15), (torch.int8, -128, 128), (torch.uint8, 0, 256),
                               (torch.int64, -999, 999))]
    return [((rand(2, 3, 8, 8), rand(4, 3, 3, 3), rand(4), [1, 1], [1, 1], [1, 1], False, [0, 0], 1), {}),
            ((rand(1, 4, 9, 7), rand(6, 2, 3, 2), None, [2, 1], [1, 0], [1, 2], False, [0, 0], 2), {}),
            ((rand(1, 8, 6, 6), rand(8, 1, 3, 3), rand(8), [1, 1], [2, 2], [2, 2], False, [0, 0], 8), {}),
            ((rand(2, 3, 16), rand(5, 3, 4), rand(5), [2], [1], [1], False, [0], 1), {}),
            ((rand(1, 3, 7, 6), rand(4, 3, 3, 2), rand(4), [2], [0], [1], False, [0], 1), {}),  # padding="valid"
            ((rand(1, 4, 5, 6, 4), rand(6, 2, 3, 2, 3), rand(6), [1, 2, 1], [1, 0, 1], [1, 1, 2], False, [0, 0, 0], 2),
             {}),
            ((edge_floats(1, 2, 6, 6), rand(3, 2, 3, 3), rand(3), [1, 1], [1, 1], [1, 1], False, [0, 0], 1), {}),
            ((edge_ints(2, 3, 9, dtype=torch.int32), randint(4, 3, 3, lo=-999, hi=999, dtype=torch.int32),
              None, [1], [2], [2], False, [0], 1), {}),
            *ints,
            # transposed: weight (Cin, Cout / groups, *kernel); output_padding only lengthens the output
            ((rand(2, 4, 5, 6), rand(4, 3, 3, 3), rand(3), [2, 2], [1, 1], [1, 1], True, [1, 0], 1), {}),
            ((rand(1, 4, 4, 5), rand(4, 2, 2, 3), None, [3, 2], [0, 1], [2, 1], True, [2, 1], 2), {}),
            ((rand(2, 3, 7), rand(3, 2, 4), rand(2), [2], [1], [1], True, [1], 1), {}),
            ((rand(1, 6, 3, 4, 3), rand(6, 1, 2, 3, 2), rand(3), [2, 1, 2], [0, 1, 1], [1, 2, 1], True, [1, 0, 0], 3),
             {}),
            ((rand(1, 8, 16, 16), rand(8, 4, 2, 2), rand(4), [2, 2], [0, 0], [1, 1], True, [0, 0], 1), {}),
            ((edge_floats(1, 2, 4, 4), rand(2, 3, 3, 3), None, [1, 1], [0, 0], [1, 1], True, [0, 0], 1), {}),
            # torch takes only int64 among the integers for a transposed convolution
            ((randint(1, 4, 5, 4, lo=-999, hi=999), randint(4, 1, 3, 2, lo=-999, hi=999), randint(2, lo=-9, hi=9),
              [2, 1], [1, 0], [1, 1], True, [1, 0], 2), {})]


@register("aten.convolution.default", NUMERIC, samples=_conv_samples, flops="conv")
def convolution(pb, node, x, w, bias, stride, padding, dilation, transposed, output_padding, groups):
    """A plain float convolution with enough outputs is an implicit GEMM (register tiles of output
    channels by positions, :mod:`tapml.platforms.wgsl.conv_gemm`). Otherwise a direct
    convolution, one thread per output element. Transposed, each output gathers the
    inputs that scatter onto it: ``o = i * stride - padding + k * dilation`` solved for ``i``.
    Integers accumulate in i32 wrapping as torch's integer arithmetic does. A sum of more than
    LOOP_BUDGET terms (Cin/groups x kernel taps) is split: about CHUNK terms per invocation (whole
    input channels, or (channel, tap) terms when one channel has more taps), then the partial
    sums folded (platforms/wgsl/folds.py) and the bias added."""
    meta = node.outputs[0]
    acc_ty = "i32" if meta.dtype in ALL_INT else "f32"
    x, w = pb.plain(x), pb.plain(w)
    if bias is not None:
        (bias,) = pb.fit([bias], 3)
    nsp = len(x.shape) - 2
    # torch applies a one-element list to every spatial dim (padding="valid" exports as [0])
    stride, padding, dilation, output_padding = (list(v) * nsp if len(v) == 1 else list(v)
                                                 for v in (stride, padding, dilation, output_padding))
    from tapml.platforms.wgsl import conv_gemm
    if meta.numel and conv_gemm.fits(x, w, meta, transposed, groups):
        return [conv_gemm.conv_gemm(pb, "conv", x, w, bias, meta, stride, padding, dilation, groups)]
    Cin = x.shape[1]
    Cout = meta.shape[1]
    cig, cog = Cin // groups, Cout // groups
    ksz = list(w.shape[2:])
    isz = list(x.shape[2:])
    name = "conv_transpose" if transposed else "conv"
    taps = math.prod(ksz)
    if cig * taps <= LOOP_BUDGET:
        chunks, per = 1, cig
    elif taps <= CHUNK:  # whole input channels per invocation: the tap loops stay as they are
        per = CHUNK // taps
        chunks = -(-cig // per)
    else:  # a kernel of more than CHUNK taps: CHUNK (channel, tap) terms per invocation
        chunks = -(-(cig * taps) // CHUNK)
        per = -(-(cig * taps) // chunks)
    if chunks == 1 or meta.numel == 0:
        out = pb.buffer("temp", meta)
        result = BufferView.whole(out, meta)
    if meta.numel == 0:
        return [result]
    k = pb.kernel(name)
    if chunks > 1:  # neighbouring invocations: neighbouring outputs over the same channels
        k.emit(f"let o: i32 = n % {meta.numel};")
        k.emit(f"let part: i32 = n / {meta.numel};")
    idx = k.unravel("o" if chunks > 1 else "n", meta.shape)
    b, oc, osp = idx[0], idx[1], idx[2:]
    k.emit(f"let g: i32 = {oc} / {cog};" if groups > 1 else "let g: i32 = 0;")
    acc = k.var(acc_ty, lit(0, acc_ty), "acc")
    nested = chunks == 1 or taps <= CHUNK
    if nested:
        if chunks == 1:
            k.loop("ci", cig)
        else:  # this invocation's channels; the partial sums are folded below
            k.loop("cj", per)
            k.emit(f"let ci: i32 = part * {per} + cj;")
            k.open(f"if (ci < {cig})")
        for d in range(nsp):
            k.loop(f"k{d}", ksz[d])
    else:
        k.loop("j", per)
        k.emit(f"let r: i32 = part * {per} + j;")
        k.open(f"if (r < {cig * taps})")
        for name_, i in zip(["ci"] + [f"k{d}" for d in range(nsp)], k.unravel("r", [cig] + ksz)):
            k.emit(f"let {name_}: i32 = {i};")
    k.emit(f"let c: i32 = g * {cig} + ci;")
    conds = []
    for d in range(nsp):
        if transposed:
            k.emit(f"let tp{d}: i32 = {osp[d]} + {padding[d]} - k{d} * {dilation[d]};")
            # tp < 0 is tested first: WGSL's % of a negative operand becomes GLSL's, which is undefined
            conds.append(f"tp{d} >= 0 && tp{d} < {isz[d] * stride[d]}" +
                         (f" && tp{d} % {stride[d]} == 0" if stride[d] != 1 else ""))
        else:
            k.emit(f"let i{d}: i32 = {osp[d]} * {stride[d]} - {padding[d]} + k{d} * {dilation[d]};")
            conds.append(f"i{d} >= 0 && i{d} < {isz[d]}")
    k.open(f"if ({' && '.join(conds)})")
    if transposed:
        for d in range(nsp):
            k.emit(f"let i{d}: i32 = tp{d} / {stride[d]};" if stride[d] != 1 else f"let i{d}: i32 = tp{d};")
        widx = ["c", k.let(f"{oc} - g * {cog}", "i32") if groups > 1 else oc]
    else:
        widx = [oc, "ci"]
    xv = cast(x.read(k, [b, "c"] + [f"i{d}" for d in range(nsp)]), x.ty, acc_ty)
    wv = cast(w.read(k, widx + [f"k{d}" for d in range(nsp)]), w.ty, acc_ty)
    k.emit(f"{acc} = {acc} + {xv} * {wv};")
    k.close()
    for _ in range((nsp + 1 if nested else 1) + (chunks > 1)):
        k.close()
    if chunks == 1:
        e = acc
        if bias is not None:
            e = f"{acc} + {cast(bias.read(k, [oc]), bias.ty, acc_ty)}"
        k.write(out, "n", wrap_int(e, meta.dtype), acc_ty)
        pb.add(k.finish(meta.numel))
        return [result]
    acc_dtype = "int32" if acc_ty == "i32" else "float32"
    partial = pb.buffer("temp", TensorMeta((meta.numel * chunks,), acc_dtype))
    k.write(partial, "n", acc, acc_ty)
    pb.add(k.finish(meta.numel * chunks))
    sums = BufferView(partial, (meta.numel, chunks), (1, meta.numel), 0, acc_dtype)
    fold = Fold([("acc", acc_ty, lit(0, acc_ty))], lambda k, v, r: [v],
                lambda k, st, o, empty: k.emit(f"{st[0]} = {st[0]} + {o[0]};"), lambda k, st: [(st[0], acc_ty)])
    (total,) = fold_rows(pb, f"{name}_sum", sums, [1], [TensorMeta(tuple(meta.shape), acc_dtype)], fold)
    ins = [total] + ([views.expand_to(views.reshape(bias, [meta.shape[1]] + [1] * nsp), meta.shape)]
                     if bias is not None else [])
    return [Compute(meta.shape, meta.dtype, ins,
                    lambda k, e, idx: wrap_int(" + ".join(cast(v, i.ty, acc_ty) for v, i in zip(e, ins)), meta.dtype))]


# --- pooling -----------------------------------------------------------------------------

def _pair(v, n=2):
    if isinstance(v, int):
        return [v] * n
    v = list(v)
    return v * n if len(v) == 1 else v


def _max_pool_samples():
    import torch
    ints = [((randint(2, 3, 8, 8, lo=lo, hi=hi, dtype=dt), [2, 2], [2, 2]), {})
            for dt, lo, hi in ((torch.int16, -2**15, 2**15), (torch.int8, -128, 128), (torch.uint8, 0, 256))]
    two_nans = rand(1, 2, 4, 4)
    two_nans[0, 0, 0, 1] = two_nans[0, 0, 1, 0] = two_nans[0, 1, 2, 2] = math.nan
    return [((rand(2, 3, 8, 8), [2, 2], [2, 2]), {}), ((rand(1, 4, 9, 9), [3, 3], [2, 2], [1, 1]), {}),
            ((rand(1, 2, 7, 7), [2, 2], [2, 2], [0, 0], [1, 1], True), {}),
            ((rand(1, 2, 9, 9), [3, 3], [1, 1], [1, 1], [2, 2]), {}),
            ((edge_floats(2, 5, 6), [2, 3], [1, 2], [1, 1]), {}),
            ((two_nans, [2, 2]), {}),
            ((edge_ints(2, 3, 9, 9, dtype=torch.int32), [3, 3], [2, 2], [1, 1]), {}),
            # a narrow range, so that windows hold ties: the first maximum's index wins, as in torch
            ((randint(1, 2, 7, 7, lo=-3, hi=3), [3, 2], [2, 2], [1, 0], [1, 2], True), {}),
            ((edge_ints(3, 6, 6), [2, 2]), {}), *ints]


@register("aten.max_pool2d_with_indices.default", ALL_FLOAT + ALL_INT, samples=_max_pool_samples)
def max_pool2d(pb, node, x, kernel_size, stride=(), padding=0, dilation=1, ceil_mode=False):
    kh, kw = _pair(kernel_size)
    sh, sw = _pair(stride) if stride else (kh, kw)
    ph, pw = _pair(padding)
    dh, dw = _pair(dilation)
    vmeta, imeta = node.outputs
    H, W = x.shape[-2:]
    vb, ib = pb.buffer("temp", vmeta), pb.buffer("temp", imeta)
    res = [BufferView.whole(vb, vmeta), BufferView.whole(ib, imeta)]
    if vmeta.numel == 0:
        return res
    (x,) = pb.fit([x], 2)
    k = pb.kernel("max_pool2d")
    idx = k.unravel("n", vmeta.shape)
    lead, oh, ow = idx[:-2], idx[-2], idx[-1]
    ty, best = _pool_max_start(k, vmeta)
    arg = k.var("i32", "-1", "arg")
    k.loop("a", kh)
    k.loop("b", kw)
    k.emit(f"let ih: i32 = {oh} * {sh} - {ph} + a * {dh};")
    k.emit(f"let iw: i32 = {ow} * {sw} - {pw} + b * {dw};")
    k.open(f"if (ih >= 0 && ih < {H} && iw >= 0 && iw < {W})")
    v = cast(x.read(k, list(lead) + ["ih", "iw"]), x.ty, ty)
    # as in torch, a NaN always takes the place (the last NaN's index wins); tested on the bits,
    # since drivers may fold v != v to false
    nan = f" || {k.need('tap_isnan')}({v})" if ty == "f32" else ""
    k.emit(f"if ({arg} < 0 || {less(best, v, ty)}{nan}) {{ {best} = {v}; {arg} = ih * {W} + iw; }}")
    k.close()
    k.close()
    k.close()
    k.write(vb, "n", best, ty)
    k.write(ib, "n", arg, "i32")
    pb.add(k.finish(vmeta.numel))
    return res


def _pool_max_start(k, vmeta) -> tuple[str, str]:
    """The expression type of a max pool's values and its running maximum, declared at the least
    value of that type."""
    ty = ctype(vmeta.dtype)
    return ty, k.var(ty, lit(-math.inf, ty) if ty == "f32" else extreme_lit(ty, False), "best")


def _loops(k, names, starts, ends) -> None:
    """Open one ``for`` loop per name over ``[start, end)`` (close them with ``k.close()``)."""
    for name, s, e in zip(names, starts, ends):
        k.open(f"for (var {name}: i32 = {s}; {name} < {e}; {name} = {name} + 1)")


def _window_sum(k, x, lead, names, starts, ends, ty: str) -> str:
    """Emit the sum (in ``ty``) of ``x[lead..., starts:ends]``; returns the accumulator's name."""
    acc = k.var(ty, lit(0, ty), "acc")
    _loops(k, names, starts, ends)
    k.emit(f"{acc} = {arith('+', acc, cast(x.read(k, list(lead) + names), x.ty, ty), ty)};")
    for _ in names:
        k.close()
    return acc


def _int_window_mean(k, x, lead, names, starts, ends, div: str, out_ty: str = "i32") -> str:
    """torch's integer mean ``sum / div`` (truncated) of a window, exact although the sum may
    pass the i32 range (int64 in torch): the quotients and remainders of the elements by ``div``
    are summed apart, the remainders' sum divided after. Values held in two words: their sum in
    two words (wrapping as torch's int64 sum), divided after."""
    if x.ty == I64:
        total = _window_sum(k, x, lead, names, starts, ends, I64)
        return cast(f"tap_i64_divmod_trunc({total}, tap_i64_of({div})).xy", I64, out_ty)
    div_i, rem_i = k.need("tap_div_i"), k.need("tap_rem_i")
    d = k.let(div, "i32")
    q, r = k.var("i32", "0", "q"), k.var("i32", "0", "r")
    _loops(k, names, starts, ends)
    v = cast(x.read(k, list(lead) + names), x.ty, "i32")
    k.emit(f"{q} = {q} + {div_i}({v}, {d});")
    k.emit(f"{r} = {r} + {rem_i}({v}, {d});")
    for _ in names:
        k.close()
    # sum = Q * d + R with |R| < |d|; truncation wants R of the sum's sign
    big_q = k.let(f"{q} + {div_i}({r}, {d})", "i32")
    big_r = k.let(f"{rem_i}({r}, {d})", "i32")
    wrong_sign = f"{big_q} != 0 && {big_r} != 0 && sign({big_r}) != sign({big_q}) * sign({d})"
    return cast(k.let(f"{big_q} - select(0, sign({big_q}), {wrong_sign})", "i32"), "i32", out_ty)


def _avg_pool_samples():
    import torch
    return [((rand(2, 3, 8, 8), [2, 2]), {}), ((rand(1, 4, 9, 9), [3, 3], [2, 2], [1, 1]), {}),
            ((rand(1, 2, 7, 7), [3, 3], [2, 2], [1, 1], True, False), {}),
            ((rand(1, 2, 6, 6), [2, 2], [2, 2], [0, 0], False, True, 3), {}),
            ((edge_floats(2, 5, 6), [2, 3], [1, 2], [1, 1]), {}),
            # torch averages only int64 among the integers: the sum in int64, divided with truncation
            ((edge_ints(2, 3, 6, 6), [2, 2]), {}),
            ((torch.tensor([[[2**31 - 1, 2**31 - 1, -2**31, -7], [2**31 - 1, 5, -2**31, -2**31], [-3, 4, 9, -1]]]),
              [2, 2], [1, 2], [1, 1], True, True), {}),
            ((randint(1, 3, 7, 7, lo=-99, hi=99), [3, 3], [2, 2], [1, 1], True, False), {}),
            ((randint(2, 6, 6, lo=-99, hi=99), [2, 3], [2, 2], [1, 1], False, True, -4), {}),
            ((randint(1, 2, 5, 5, lo=-99, hi=99), [2, 2], [1, 1], [0, 0], False, True, 3), {})]


@register("aten.avg_pool2d.default", ALL_FLOAT + ("int64",), samples=_avg_pool_samples)
def avg_pool2d(pb, node, x, kernel_size, stride=(), padding=0, ceil_mode=False, count_include_pad=True,
               divisor_override=None):
    kh, kw = _pair(kernel_size)
    sh, sw = _pair(stride) if stride else (kh, kw)
    ph, pw = _pair(padding)
    meta = node.outputs[0]
    H, W = x.shape[-2:]

    def fn(k, idx):
        lead, oh, ow = idx[:-2], idx[-2], idx[-1]
        hs, ws = k.fresh("hs"), k.fresh("ws")
        k.emit(f"let {hs}: i32 = {oh} * {sh} - {ph};")
        k.emit(f"let {ws}: i32 = {ow} * {sw} - {pw};")
        he = k.let(f"min({hs} + {kh}, {H + ph})", "i32")
        we = k.let(f"min({ws} + {kw}, {W + pw})", "i32")
        pool = k.let(f"({he} - {hs}) * ({we} - {ws})", "i32")
        h0, w0 = k.let(f"max({hs}, 0)", "i32"), k.let(f"max({ws}, 0)", "i32")
        h1, w1 = k.let(f"min({he}, {H})", "i32"), k.let(f"min({we}, {W})", "i32")
        if divisor_override:
            div = lit(divisor_override, "i32")
        elif count_include_pad:
            div = pool
        else:
            div = f"({h1} - {h0}) * ({w1} - {w0})"
        if ctype(meta.dtype) in ("i32", I64):
            return _int_window_mean(k, x, lead, ["a", "b"], [h0, w0], [h1, w1], div, ctype(meta.dtype))
        acc = _window_sum(k, x, lead, ["a", "b"], [h0, w0], [h1, w1], "f32")
        return f"({acc} / f32({div}))"
    return [Custom(meta.shape, meta.dtype, [x], fn, cost=9)]


@register("aten._adaptive_avg_pool2d.default", ALL_FLOAT,
          samples=lambda: [((rand(2, 3, 8, 8), [1, 1]), {}), ((rand(1, 2, 7, 9), [3, 4]), {}),
                           ((edge_floats(1, 2, 5, 6), [2, 3]), {})])
def adaptive_avg_pool2d(pb, node, x, output_size):
    meta = node.outputs[0]
    H, W = x.shape[-2:]
    OH, OW = meta.shape[-2:]

    def fn(k, idx):
        lead, oh, ow = idx[:-2], idx[-2], idx[-1]
        h0 = k.let(f"({oh} * {H}) / {OH}", "i32")
        h1 = k.let(f"(({oh} + 1) * {H} + {OH - 1}) / {OH}", "i32")
        w0 = k.let(f"({ow} * {W}) / {OW}", "i32")
        w1 = k.let(f"(({ow} + 1) * {W} + {OW - 1}) / {OW}", "i32")
        acc = _window_sum(k, x, lead, ["a", "b"], [h0, w0], [h1, w1], "f32")
        return f"({acc} / f32(({h1} - {h0}) * ({w1} - {w0})))"
    return [Custom(meta.shape, meta.dtype, [x], fn, cost=9)]
