"""Neural-network ops: softmax, layer/group/batch norm, convolution, pooling."""

from __future__ import annotations

import math

from tapml.platforms.wgsl import views
from tapml.platforms.wgsl.codegen import BufferView, Compute, Custom, cast, contiguous_strides, index_sum, lit
from tapml.platforms.wgsl.registry import ALL_FLOAT, rand, register


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


def _softmax(log):
    def lower(pb, node, x, dim, half_to_float=False):
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
            ((rand(4, 6), 0, False), {})]


register("aten._softmax.default", ALL_FLOAT, samples=_softmax_samples, flops="softmax")(_softmax(False))
register("aten._log_softmax.default", ALL_FLOAT, samples=_softmax_samples, flops="softmax")(_softmax(True))


@register("aten.native_layer_norm.default", ALL_FLOAT,
          samples=lambda: [((rand(2, 5, 16), [16], rand(16), rand(16), 1e-5), {}),
                           ((rand(3, 4, 6), [4, 6], rand(4, 6), None, 1e-6), {}),
                           ((rand(4, 8), [8], None, None, 1e-12), {})], flops="norm")
def native_layer_norm(pb, node, x, normalized_shape, weight, bias, eps):
    nd = len(x.shape)
    axis = nd - len(normalized_shape)
    rows_shape, norm_shape = list(x.shape[:axis]), list(x.shape[axis:])
    L = math.prod(norm_shape)
    metas = node.outputs
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
    return mean, k.let(f"inverseSqrt({q} / {lit(L, 'f32')} + {lit(eps, 'f32')})", "f32")


@register("aten.native_group_norm.default", ALL_FLOAT,
          samples=lambda: [((rand(2, 6, 4, 4), rand(6), rand(6), 2, 6, 16, 3, 1e-5), {}),
                           ((rand(1, 4, 5), None, None, 1, 4, 5, 2, 1e-5), {})], flops="norm")
def native_group_norm(pb, node, x, weight, bias, N, C, HxW, group, eps):
    metas = node.outputs
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
            ((rand(3, 6), None, None, rand(6), rand(6, lo=0.5, hi=2), 0.1, 1e-3), {})]


@register("aten._native_batch_norm_legit_no_training.default", ALL_FLOAT, samples=_bn_samples, flops="norm")
def batch_norm(pb, node, x, weight, bias, running_mean, running_var, momentum, eps):
    meta = node.outputs[0]
    C = x.shape[1] if len(x.shape) > 1 else 1

    def chan(v):
        return views.expand_to(views.reshape(v, [C] + [1] * (len(x.shape) - 2)), meta.shape)
    ins = [x, chan(running_mean), chan(running_var)] + [chan(p) for p in (weight, bias) if p is not None]
    ins = pb.fit(ins, 1)
    has_w, has_b = weight is not None, bias is not None

    def emit(k, e, idx):
        xv, mv, vv, *rest = [cast(a, v.ty, "f32") for a, v in zip(e, ins)]
        out = f"({xv} - {mv}) * inverseSqrt({vv} + {lit(eps, 'f32')})"
        if has_w:
            out = f"({out}) * {rest.pop(0)}"
        if has_b:
            out = f"{out} + {rest.pop(0)}"
        return out
    y = Compute(meta.shape, meta.dtype, ins, emit, cost=2)
    empties = [BufferView.whole(pb.buffer("temp", m), m) for m in node.outputs[1:]]
    return [y] + empties


@register("aten.native_batch_norm.default", ALL_FLOAT,
          samples=lambda: [((rand(2, 4, 5, 5), rand(4), rand(4), rand(4), rand(4, lo=0.5, hi=2), False, 0.1, 1e-5), {})],
          check=lambda node: "native_batch_norm in training mode" if node.args[5] else None, flops="norm")
def native_batch_norm(pb, node, x, weight, bias, running_mean, running_var, training, momentum, eps):
    return batch_norm(pb, node, x, weight, bias, running_mean, running_var, momentum, eps)


# --- convolution -------------------------------------------------------------------------

def _conv_check(node):
    if node.args[6]:
        return "transposed convolution has no WGSL lowering yet"
    return None


def _conv_samples():
    return [((rand(2, 3, 8, 8), rand(4, 3, 3, 3), rand(4), [1, 1], [1, 1], [1, 1], False, [0, 0], 1), {}),
            ((rand(1, 4, 9, 7), rand(6, 2, 3, 2), None, [2, 1], [1, 0], [1, 2], False, [0, 0], 2), {}),
            ((rand(1, 8, 6, 6), rand(8, 1, 3, 3), rand(8), [1, 1], [2, 2], [2, 2], False, [0, 0], 8), {}),
            ((rand(2, 3, 16), rand(5, 3, 4), rand(5), [2], [1], [1], False, [0], 1), {})]


@register("aten.convolution.default", ALL_FLOAT, samples=_conv_samples, check=_conv_check, flops="conv")
def convolution(pb, node, x, w, bias, stride, padding, dilation, transposed, output_padding, groups):
    meta = node.outputs[0]
    x, w = pb.plain(x), pb.plain(w)
    if bias is not None:
        (bias,) = pb.fit([bias], 3)
    nsp = len(x.shape) - 2
    Nb, Cin = x.shape[:2]
    Cout = w.shape[0]
    cig, cog = Cin // groups, Cout // groups
    ksz = list(w.shape[2:])
    isz = list(x.shape[2:])
    out = pb.buffer("temp", meta)
    result = BufferView.whole(out, meta)
    if meta.numel == 0:
        return result
    k = pb.kernel("conv")
    idx = k.unravel("n", meta.shape)
    b, oc, osp = idx[0], idx[1], idx[2:]
    k.emit(f"let g: i32 = {oc} / {cog};" if groups > 1 else "let g: i32 = 0;")
    acc = k.var("f32", "0.0", "acc")
    k.loop("ci", cig)
    k.emit(f"let c: i32 = g * {cig} + ci;")
    kv = []
    for d in range(nsp):
        k.loop(f"k{d}", ksz[d])
        e = f"{osp[d]} * {stride[d]} - {padding[d]} + k{d} * {dilation[d]}"
        k.emit(f"let i{d}: i32 = {e};")
        kv.append(f"k{d}")
    cond = " && ".join(f"i{d} >= 0 && i{d} < {isz[d]}" for d in range(nsp))
    k.open(f"if ({cond})")
    xv = cast(x.read(k, [b, "c"] + [f"i{d}" for d in range(nsp)]), x.ty, "f32")
    wv = cast(w.read(k, [oc, "ci"] + kv), w.ty, "f32")
    k.emit(f"{acc} = {acc} + {xv} * {wv};")
    k.close()
    for _ in range(nsp):
        k.close()
    k.close()
    e = acc
    if bias is not None:
        e = f"{acc} + {cast(bias.read(k, [oc]), bias.ty, 'f32')}"
    k.write(out, "n", e, "f32")
    pb.add(k.finish(meta.numel))
    return [result]


# --- pooling -----------------------------------------------------------------------------

def _pair(v, n=2):
    if isinstance(v, int):
        return [v] * n
    v = list(v)
    return v * n if len(v) == 1 else v


@register("aten.max_pool2d_with_indices.default", ALL_FLOAT,
          samples=lambda: [((rand(2, 3, 8, 8), [2, 2], [2, 2]), {}), ((rand(1, 4, 9, 9), [3, 3], [2, 2], [1, 1]), {}),
                           ((rand(1, 2, 7, 7), [2, 2], [2, 2], [0, 0], [1, 1], True), {}),
                           ((rand(1, 2, 9, 9), [3, 3], [1, 1], [1, 1], [2, 2]), {})])
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
    best = k.var("f32", lit(-math.inf, "f32"), "best")
    arg = k.var("i32", "-1", "arg")
    k.loop("a", kh)
    k.loop("b", kw)
    k.emit(f"let ih: i32 = {oh} * {sh} - {ph} + a * {dh};")
    k.emit(f"let iw: i32 = {ow} * {sw} - {pw} + b * {dw};")
    k.open(f"if (ih >= 0 && ih < {H} && iw >= 0 && iw < {W})")
    v = cast(x.read(k, list(lead) + ["ih", "iw"]), x.ty, "f32")
    k.emit(f"if ({arg} < 0 || {v} > {best} || ({v} != {v} && {best} == {best})) {{ {best} = {v}; {arg} = ih * {W} + iw; }}")
    k.close()
    k.close()
    k.close()
    k.write(vb, "n", best, "f32")
    k.write(ib, "n", arg, "i32")
    pb.add(k.finish(vmeta.numel))
    return res


def _window_sum(k, x, lead, h0: str, h1: str, w0: str, w1: str) -> str:
    """Emit the f32 sum of ``x[lead..., h0:h1, w0:w1]``; returns the accumulator's name."""
    acc = k.var("f32", "0.0", "acc")
    k.open(f"for (var a: i32 = {h0}; a < {h1}; a = a + 1)")
    k.open(f"for (var b: i32 = {w0}; b < {w1}; b = b + 1)")
    k.emit(f"{acc} = {acc} + {cast(x.read(k, list(lead) + ['a', 'b']), x.ty, 'f32')};")
    k.close()
    k.close()
    return acc


@register("aten.avg_pool2d.default", ALL_FLOAT,
          samples=lambda: [((rand(2, 3, 8, 8), [2, 2]), {}), ((rand(1, 4, 9, 9), [3, 3], [2, 2], [1, 1]), {}),
                           ((rand(1, 2, 7, 7), [3, 3], [2, 2], [1, 1], True, False), {}),
                           ((rand(1, 2, 6, 6), [2, 2], [2, 2], [0, 0], False, True, 3), {})])
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
        acc = _window_sum(k, x, lead, h0, h1, w0, w1)
        if divisor_override:
            div = lit(divisor_override, "f32")
        elif count_include_pad:
            div = f"f32({pool})"
        else:
            div = f"f32(({h1} - {h0}) * ({w1} - {w0}))"
        return f"({acc} / {div})"
    return [Custom(meta.shape, meta.dtype, [x], fn, cost=9)]


@register("aten._adaptive_avg_pool2d.default", ALL_FLOAT,
          samples=lambda: [((rand(2, 3, 8, 8), [1, 1]), {}), ((rand(1, 2, 7, 9), [3, 4]), {})])
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
        acc = _window_sum(k, x, lead, h0, h1, w0, w1)
        return f"({acc} / f32(({h1} - {h0}) * ({w1} - {w0})))"
    return [Custom(meta.shape, meta.dtype, [x], fn, cost=9)]
