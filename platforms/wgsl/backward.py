"""Backward ops of training graphs: embedding, pooling, layer/group norm and convolution gradients.

Every gradient is a *gather*: each output element loops over the elements that contribute to it,
in the order torch's CPU kernel adds them, instead of scattering with atomics. That keeps float
sums deterministic and rounded like torch's (float16/bfloat16 round per step where torch's kernel
accumulates in the tensor's dtype), and works the same for packed low-precision buffers (see
``scatter_dim`` in platforms/wgsl/scatter.py).

The ops with an ``output_mask`` (norms, convolution) return None for a gradient that is not
wanted. A graph either lists every result (all wanted) or only the wanted ones; the lowering
computes exactly the results the node lists.
"""

from __future__ import annotations

import math

import torch

from tapml.errors import PlatformError
from tapml.platforms.wgsl import views
from tapml.platforms.wgsl.codegen import I64, WIDE, BufferView, Custom, arith, cast, ctype, lit, round_low
from tapml.platforms.wgsl.matmul import wrap_int
from tapml.platforms.wgsl.registry import ALL_FLOAT, edge_floats, edge_ints, rand, randint, register

# a gather's loop: like the forward pools' windows, cheap enough to fuse into the one reader
GATHER_COST = 9


def _int_list(v, n: int) -> list[int]:
    """An int or a list of one or ``n`` ints as ``n`` ints (kernel_size, stride, padding, ...)."""
    if isinstance(v, int):
        return [v] * n
    v = [int(x) for x in v]
    return v * n if len(v) == 1 else v


def _loop_range(k, var: str, lo: str, hi: str) -> None:
    """Open ``for var in [lo, hi]`` (both ends included; none when hi < lo)."""
    k.open(f"for (var {var}: i32 = {lo}; {var} <= {hi}; {var} = {var} + 1)")


def _mask_of(node, index: int) -> list[bool]:
    mask = node.args[index] if len(node.args) > index else node.kwargs.get("output_mask")
    return [bool(m) for m in mask] if isinstance(mask, list) and len(mask) == 3 else [True] * 3


def _bias_implies_weight(mask: list[bool]) -> list[bool]:
    # torch's CPU convolution_backward computes grad_weight whenever grad_bias is wanted
    return [mask[0], mask[1] or mask[2], mask[2]]


def _result_slots(node, index: int, implied=None) -> list[int] | None:
    """Which of the op's three results each of ``node.outputs`` is: all three, the ones
    ``output_mask`` wants (a graph that drops the None results), or the ones ``implied(mask)``
    says torch returns besides; None when the outputs fit none of those."""
    if len(node.outputs) == 3:
        return [0, 1, 2]
    mask = _mask_of(node, index)
    for returned in (mask, implied(mask) if implied else mask):
        slots = [i for i, m in enumerate(returned) if m]
        if len(node.outputs) == len(slots):
            return slots
    return None


def _slots(node, index: int, implied=None) -> list[int]:
    slots = _result_slots(node, index, implied)
    if slots is None:
        raise PlatformError(f"{node.op} lists {len(node.outputs)} outputs, which fit no output_mask result")
    return slots


def _mask_check(index: int, implied=None):
    def check(node):
        if _result_slots(node, index, implied) is None:
            wanted = sum(_mask_of(node, index))
            return (f"the node lists {len(node.outputs)} outputs, but its output_mask wants {wanted} "
                    "(a graph lists all three results or only the ones torch returns)")
        return None
    return check


# --- embedding ---------------------------------------------------------------------------

def _embedding_samples():
    return [((rand(4, 6, 8), randint(4, 6, hi=11), 11, -1, False), {}),
            ((rand(5, 3), torch.tensor([2, 0, 2, 2, 4]), 6, 2, False), {}),
            ((rand(3, 7, 4), randint(3, 7, hi=5), 5, -1, True), {}),
            ((rand(2, 9, 16), randint(2, 9, hi=12, dtype=torch.int32), 12, 3, True), {}),
            ((edge_floats(6, 5), torch.tensor([1, 3, 1, 0, 3, 3]), 4, -1, False), {}),
            # integers: every row hit once, so that sums stay in range at the i32 boundaries
            ((edge_ints(5, 3), torch.randperm(7)[:5], 7, -1, False), {}),
            ((randint(6, 4, lo=-99, hi=99), torch.tensor([0, 2, 0, 1, 2, 2]), 3, -1, True), {}),
            ((randint(3, 5, lo=-999, hi=999, dtype=torch.int32), torch.tensor([1, 1, 0]), 2, 0, False), {})]


@register("aten.embedding_dense_backward.default", ALL_FLOAT + ("int64", "int32"), samples=_embedding_samples,
          flops="reduce")
def embedding_dense_backward(pb, node, grad, indices, num_weights, padding_idx, scale_grad_by_freq):
    """Each weight row sums the grad rows whose index hits it, in index order (torch's CPU loop);
    ``scale_grad_by_freq`` scales each by 1/(hits of the row) (for integers: kept only for a
    single hit, as torch truncates the scale); the ``padding_idx`` row stays zero."""
    meta = node.outputs[0]
    count, D = indices.numel, meta.shape[-1]
    g2, i1 = pb.fit([views.reshape(grad, (count, D)), views.reshape(indices, (count,))], 1)
    ty = ctype(meta.dtype) if meta.dtype in ("int64", "int32", WIDE) else "f32"
    skip_row = 0 <= padding_idx < num_weights

    def fn(k, idx):
        w, d = idx
        acc = k.var(ty, lit(0, ty), "gw")
        if count == 0:
            return acc
        if skip_row:
            k.open(f"if ({w} != {padding_idx})")
        if scale_grad_by_freq:
            hits = k.var("i32", "0", "hits")
            j = k.fresh("j")
            k.loop(j, count)
            k.emit(f"if ({i1.read(k, [j])} == {w}) {{ {hits} = {hits} + 1; }}")
            k.close()
        j = k.fresh("j")
        k.loop(j, count)
        k.open(f"if ({i1.read(k, [j])} == {w})")
        g = cast(g2.read(k, [j, d]), g2.ty, ty)
        if ty in ("i32", I64):
            term = f"select({lit(0, ty)}, {g}, {hits} == 1)" if scale_grad_by_freq else g
            k.emit(f"{acc} = {arith('+', acc, term, ty)};")
        else:
            term = f"{g} * (1.0 / f32({hits}))" if scale_grad_by_freq else g
            k.emit(f"{acc} = {round_low(k, f'({acc} + {term})', meta.dtype)};")
        k.close()
        k.close()
        if skip_row:
            k.close()
        return wrap_int(acc, meta.dtype) if ty == "i32" else acc
    return [Custom(meta.shape, meta.dtype, [g2, i1], fn, cost=GATHER_COST)]


# --- pooling -----------------------------------------------------------------------------

def _avg_pool_backward_samples():
    def case(x_shape, *args):
        kernel, stride, padding, ceil_mode, include_pad, div = args
        x = rand(*x_shape)
        y = torch.ops.aten.avg_pool2d(x, kernel, stride, padding, ceil_mode, include_pad, div)
        return (rand(*y.shape), x, kernel, stride, padding, ceil_mode, include_pad, div)
    grad_edges = case((2, 5, 6), [2, 3], [1, 2], [1, 1], False, True, None)
    grad_edges = (edge_floats(*grad_edges[0].shape),) + grad_edges[1:]
    x = randint(1, 2, 7, 7, lo=-99, hi=99)
    gy = torch.ops.aten.avg_pool2d(x, [3, 3], [2, 2], [1, 1], True, False, None)
    return [(case((2, 3, 8, 8), [2, 2], [], [0, 0], False, True, None), {}),
            (case((1, 4, 9, 9), [3, 3], [2, 2], [1, 1], False, True, None), {}),
            (case((1, 2, 7, 7), [3, 3], [2, 2], [1, 1], True, False, None), {}),
            (case((1, 2, 6, 6), [2, 2], [2, 2], [0, 0], False, True, 3), {}),
            (case((2, 3, 10, 9), [3, 2], [1, 1], [1, 0], False, True, None), {}),
            (grad_edges, {}),
            # torch takes int64 too: each share truncated, the shares summed
            ((randint(*gy.shape, lo=-999, hi=999), x, [3, 3], [2, 2], [1, 1], True, False, None), {}),
            ((randint(2, 4, 3, lo=-999, hi=999), randint(2, 6, 6), [2, 3], [2, 2], [1, 1], False, True, -4), {})]


@register("aten.avg_pool2d_backward.default", ALL_FLOAT + ("int64",), samples=_avg_pool_backward_samples)
def avg_pool2d_backward(pb, node, grad, x, kernel_size, stride, padding, ceil_mode, count_include_pad,
                        divisor_override):
    """Each input element sums ``grad / divisor`` over the windows that hold it, in output order."""
    kh, kw = _int_list(kernel_size, 2)
    sh, sw = _int_list(stride, 2) if stride else (kh, kw)
    ph, pw = _int_list(padding, 2)
    meta = node.outputs[0]
    H, W = x.shape[-2:]
    OH, OW = grad.shape[-2:]
    (grad,) = pb.fit([grad], 1)
    integer = meta.dtype in ("int64", WIDE)
    ty = ctype(meta.dtype) if integer else "f32"

    def fn(k, idx):
        lead, h, w = idx[:-2], idx[-2], idx[-1]
        acc = k.var(ty, lit(0, ty), "gx")
        oh, ow = k.fresh("oh"), k.fresh("ow")
        _loop_range(k, oh, f"(max({h} + {ph - kh + 1}, 0) + {sh - 1}) / {sh}", f"min(({h} + {ph}) / {sh}, {OH - 1})")
        _loop_range(k, ow, f"(max({w} + {pw - kw + 1}, 0) + {sw - 1}) / {sw}", f"min(({w} + {pw}) / {sw}, {OW - 1})")
        hs, ws = k.let(f"{oh} * {sh} - {ph}", "i32"), k.let(f"{ow} * {sw} - {pw}", "i32")
        he, we = k.let(f"min({hs} + {kh}, {H + ph})", "i32"), k.let(f"min({ws} + {kw}, {W + pw})", "i32")
        if divisor_override:
            div = lit(divisor_override, "i32")
        elif count_include_pad:
            div = f"({he} - {hs}) * ({we} - {ws})"
        else:
            div = f"(min({he}, {H}) - max({hs}, 0)) * (min({we}, {W}) - max({ws}, 0))"
        g = cast(grad.read(k, list(lead) + [oh, ow]), grad.ty, ty)
        if ty == I64:
            k.emit(f"{acc} = {arith('+', acc, f'tap_i64_divmod_trunc({g}, tap_i64_of({div})).xy', ty)};")
        elif integer:
            k.emit(f"{acc} = {acc} + {k.need('tap_div_i')}({g}, {div});")
        else:  # torch rounds the share to the dtype, then each sum
            share = round_low(k, f"({g} / f32({div}))", meta.dtype)
            k.emit(f"{acc} = {round_low(k, f'({acc} + {share})', meta.dtype)};")
        k.close()
        k.close()
        return acc
    return [Custom(meta.shape, meta.dtype, [grad], fn, cost=GATHER_COST)]


def _max_pool_backward_samples():
    def case(x, kernel, stride=(), padding=(0, 0), dilation=(1, 1), ceil_mode=False, grad=None):
        y, ind = torch.ops.aten.max_pool2d_with_indices(x, kernel, stride, padding, dilation, ceil_mode)
        grad = rand(*y.shape) if grad is None else grad(*y.shape)
        return ((grad, x, kernel, list(stride), list(padding), list(dilation), ceil_mode, ind), {})
    ties = randint(1, 2, 7, 7, lo=-3, hi=3).float()  # windows that overlap and tie: shared maxima sum
    return [case(rand(2, 3, 8, 8), [2, 2], [2, 2]), case(rand(1, 4, 9, 9), [3, 3], [2, 2], [1, 1]),
            case(rand(1, 2, 7, 7), [2, 2], [2, 2], [0, 0], [1, 1], True),
            case(rand(1, 2, 9, 9), [3, 3], [1, 1], [1, 1], [2, 2]),
            case(ties, [3, 2], [1, 1], [1, 0], [1, 2], True),
            case(rand(2, 5, 6), [2, 3], [1, 2], [1, 1], grad=edge_floats),
            case(edge_floats(1, 3, 6, 6), [3, 3], [2, 1], [1, 1])]


def _max_pool_backward_check(node):
    if node.outputs and node.outputs[0].dtype not in ALL_FLOAT:
        return f"torch has no integer max_pool2d backward ({node.outputs[0].dtype})"
    return None


@register("aten.max_pool2d_with_indices_backward.default", ALL_FLOAT + ("int64",),
          samples=_max_pool_backward_samples, check=_max_pool_backward_check)
def max_pool2d_with_indices_backward(pb, node, grad, x, kernel_size, stride, padding, dilation, ceil_mode, indices):
    """Each input element sums the grads of the windows whose saved index is that element, in
    output order. Only windows that hold the element are looked at (an index from
    ``max_pool2d_with_indices`` always lies in its window)."""
    kh, kw = _int_list(kernel_size, 2)
    sh, sw = _int_list(stride, 2) if stride else (kh, kw)
    ph, pw = _int_list(padding, 2)
    dh, dw = _int_list(dilation, 2)
    meta = node.outputs[0]
    H, W = x.shape[-2:]
    OH, OW = grad.shape[-2:]
    grad, indices = pb.fit([grad, indices], 1)

    def fn(k, idx):
        lead, h, w = idx[:-2], idx[-2], idx[-1]
        acc = k.var("f32", "0.0", "gx")
        at = k.let(f"{h} * {W} + {w}", "i32")
        oh, ow = k.fresh("oh"), k.fresh("ow")
        _loop_range(k, oh, f"(max({h} + {ph - (kh - 1) * dh}, 0) + {sh - 1}) / {sh}",
                    f"min(({h} + {ph}) / {sh}, {OH - 1})")
        _loop_range(k, ow, f"(max({w} + {pw - (kw - 1) * dw}, 0) + {sw - 1}) / {sw}",
                    f"min(({w} + {pw}) / {sw}, {OW - 1})")
        k.open(f"if ({indices.read(k, list(lead) + [oh, ow])} == {at})")
        g = cast(grad.read(k, list(lead) + [oh, ow]), grad.ty, "f32")
        k.emit(f"{acc} = {round_low(k, f'({acc} + {g})', meta.dtype)};")
        k.close()
        k.close()
        k.close()
        return acc
    return [Custom(meta.shape, meta.dtype, [grad, indices], fn, cost=GATHER_COST)]


def _adaptive_backward_samples():
    def case(x_shape, out_hw, grad=rand):
        return ((grad(*x_shape[:-2], *out_hw), rand(*x_shape)), {})
    return [case((2, 3, 8, 8), (1, 1)), case((1, 2, 7, 9), (3, 4)), case((2, 5, 6), (4, 4)),
            case((1, 3, 5, 5), (5, 5)), case((1, 2, 6, 10), (4, 3), grad=edge_floats)]


@register("aten._adaptive_avg_pool2d_backward.default", ALL_FLOAT, samples=_adaptive_backward_samples)
def adaptive_avg_pool2d_backward(pb, node, grad, x):
    """Each input element sums ``grad / kh / kw`` over the adaptive windows that hold it."""
    meta = node.outputs[0]
    H, W = x.shape[-2:]
    OH, OW = grad.shape[-2:]
    (grad,) = pb.fit([grad], 1)

    def fn(k, idx):
        lead, h, w = idx[:-2], idx[-2], idx[-1]
        acc = k.var("f32", "0.0", "gx")
        oh, ow = k.fresh("oh"), k.fresh("ow")
        # window oh spans [oh*H/OH floored, (oh+1)*H/OH ceiled): those holding h start at h*OH/H floored
        _loop_range(k, oh, f"({h} * {OH}) / {H}", f"min((({h} + 1) * {OH} + {H - 1}) / {H} - 1, {OH - 1})")
        _loop_range(k, ow, f"({w} * {OW}) / {W}", f"min((({w} + 1) * {OW} + {W - 1}) / {W} - 1, {OW - 1})")
        h0, h1 = k.let(f"({oh} * {H}) / {OH}", "i32"), k.let(f"(({oh} + 1) * {H} + {OH - 1}) / {OH}", "i32")
        w0, w1 = k.let(f"({ow} * {W}) / {OW}", "i32"), k.let(f"(({ow} + 1) * {W} + {OW - 1}) / {OW}", "i32")
        k.open(f"if ({h} >= {h0} && {h} < {h1} && {w} >= {w0} && {w} < {w1})")
        g = cast(grad.read(k, list(lead) + [oh, ow]), grad.ty, "f32")
        share = round_low(k, f"({round_low(k, f'({g} / f32({h1} - {h0}))', meta.dtype)} / f32({w1} - {w0}))",
                          meta.dtype)
        k.emit(f"{acc} = {round_low(k, f'({acc} + {share})', meta.dtype)};")
        k.close()
        k.close()
        k.close()
        return acc
    return [Custom(meta.shape, meta.dtype, [grad], fn, cost=GATHER_COST)]


# --- normalization -----------------------------------------------------------------------

def _f32(k, v, idx) -> str:
    return cast(v.read(k, idx), v.ty, "f32")


def _layer_norm_backward_samples():
    def case(shape, norm, grad=rand, x=rand):
        xs = x(*shape)
        w, b = rand(*norm), rand(*norm)
        _, mean, rstd = torch.ops.aten.native_layer_norm(xs.nan_to_num(), norm, w, b, 1e-5)
        return ((grad(*shape), xs, list(norm), mean, rstd, w, b, [True, True, True]), {})
    return [case((2, 5, 16), [16]), case((3, 4, 6), [4, 6]), case((4, 8), [8]), case((7, 33), [33]),
            case((3, 8), [8], grad=edge_floats), case((2, 3, 8), [8], x=edge_floats)]


@register("aten.native_layer_norm_backward.default", ALL_FLOAT, samples=_layer_norm_backward_samples,
          check=_mask_check(7), flops="norm")
def native_layer_norm_backward(pb, node, dy, x, normalized_shape, mean, rstd, weight, bias, output_mask):
    """torch's formulas: per row ``ds = sum(dy*w*x)``, ``db = sum(dy*w)``,
    ``dx = rstd*dy*w + b*x + c`` with ``b = (db*mean - ds)*rstd^3/N``, ``c = -b*mean - db*rstd/N``;
    per column ``dw = sum(dy*(x - mean)*rstd)``, ``db = sum(dy)`` over the rows."""
    slots = _slots(node, 7)
    metas = dict(zip(slots, node.outputs))
    axis = len(x.shape) - len(normalized_shape)
    M, L = math.prod(x.shape[:axis]), math.prod(x.shape[axis:])
    dy2, x2 = views.reshape(dy, (M, L)), views.reshape(x, (M, L))
    mean1, rstd1 = views.reshape(mean, (M,)), views.reshape(rstd, (M,))
    w1 = views.reshape(weight, (L,)) if weight is not None else None
    bufs = {s: pb.buffer("temp", m) for s, m in metas.items()}
    if 0 in bufs and M * L:
        dy2, x2, mean1, rstd1, *rest = pb.fit([dy2, x2, mean1, rstd1] + ([w1] if w1 is not None else []), 1)
        wv = rest[0] if rest else None
        k = pb.kernel("layer_norm_backward_input")
        mu, rs = k.let(_f32(k, mean1, ["n"]), "f32"), k.let(_f32(k, rstd1, ["n"]), "f32")

        def dyw(k):
            g = _f32(k, dy2, ["n", "j"])
            return k.let(f"{g} * {_f32(k, wv, ['j'])}" if wv is not None else g, "f32")
        ds, db = k.var("f32", "0.0", "ds"), k.var("f32", "0.0", "db")
        k.loop("j", L)
        g = dyw(k)
        k.emit(f"{ds} = {ds} + {g} * {_f32(k, x2, ['n', 'j'])};")
        k.emit(f"{db} = {db} + {g};")
        k.close()
        scale = lit(1.0 / L, "f32")
        b = k.let(f"({db} * {mu} - {ds}) * {rs} * {rs} * {rs} * {scale}", "f32")
        c = k.let(f"-{b} * {mu} - {db} * {rs} * {scale}", "f32")
        k.loop("j", L)
        k.write(bufs[0], f"n * {L} + j", f"{rs} * {dyw(k)} + {b} * {_f32(k, x2, ['n', 'j'])} + {c}", "f32")
        k.close()
        pb.add(k.finish(M))
    cols = [s for s in (1, 2) if s in bufs]
    if cols and L:
        dy2, x2, mean1, rstd1 = pb.fit([dy2, x2, mean1, rstd1], len(cols))
        k = pb.kernel("layer_norm_backward_affine")
        dw, dbias = k.var("f32", "0.0", "dw"), k.var("f32", "0.0", "dbias")
        k.loop("i", M)
        g = k.let(_f32(k, dy2, ["i", "n"]), "f32")
        if 1 in bufs:
            xhat = f"({_f32(k, x2, ['i', 'n'])} - {_f32(k, mean1, ['i'])}) * {_f32(k, rstd1, ['i'])}"
            k.emit(f"{dw} = {dw} + {g} * {xhat};")
        k.emit(f"{dbias} = {dbias} + {g};")
        k.close()
        for s, acc in ((1, dw), (2, dbias)):
            if s in bufs:
                k.write(bufs[s], "n", acc, "f32")
        pb.add(k.finish(L))
    return [BufferView.whole(bufs[s], metas[s]) for s in slots]


def _group_norm_backward_samples():
    def case(N, C, spatial, G, grad=rand, x=rand):
        xs = x(N, C, *spatial)
        HxW = math.prod(spatial)
        w, b = rand(C), rand(C)
        _, mean, rstd = torch.ops.aten.native_group_norm(xs.nan_to_num(), w, b, N, C, HxW, G, 1e-5)
        return ((grad(N, C, *spatial), xs, mean, rstd, w, N, C, HxW, G, [True, True, True]), {})
    return [case(2, 6, (4, 4), 3), case(1, 4, (5,), 2), case(3, 8, (2, 3), 8), case(2, 4, (3, 3), 1),
            case(2, 4, (6,), 2, grad=edge_floats), case(2, 6, (2, 2), 3, x=edge_floats)]


@register("aten.native_group_norm_backward.default", ALL_FLOAT, samples=_group_norm_backward_samples,
          check=_mask_check(9), flops="norm")
def native_group_norm_backward(pb, node, dy, x, mean, rstd, weight, N, C, HxW, group, output_mask):
    """torch's formulas: per (n, c) ``ds = sum(dy*x)``, ``db = sum(dy)`` over HxW; per group
    ``dx = rstd*w*dy + c2*x + c3`` with ``c2 = (sum(db*w)*mean - sum(ds*w))*rstd^3/(D*HxW)``,
    ``c3 = -c2*mean - sum(db*w)*rstd/(D*HxW)``; ``dw[c] = sum_n (ds - db*mean)*rstd``, ``db[c] = sum_n db``."""
    slots = _slots(node, 9)
    metas = dict(zip(slots, node.outputs))
    D = C // group
    dy3, x3 = views.reshape(dy, (N, C, HxW)), views.reshape(x, (N, C, HxW))
    mean2, rstd2 = views.reshape(mean, (N, group)), views.reshape(rstd, (N, group))
    bufs = {s: pb.buffer("temp", m) for s, m in metas.items()}

    def channel_sums(k, n, c):
        """Emit ``ds`` and ``db`` of channel ``c`` of sample ``n``."""
        ds, db = k.var("f32", "0.0", "ds"), k.var("f32", "0.0", "db")
        p = k.fresh("p")
        k.loop(p, HxW)
        g = k.let(_f32(k, dy3, [n, c, p]), "f32")
        k.emit(f"{ds} = {ds} + {g} * {_f32(k, x3, [n, c, p])};")
        k.emit(f"{db} = {db} + {g};")
        k.close()
        return ds, db
    if 0 in bufs and N * C * HxW:
        dy3, x3, mean2, rstd2, *rest = pb.fit([dy3, x3, mean2, rstd2] + ([weight] if weight is not None else []), 1)
        wv = rest[0] if rest else None
        k = pb.kernel("group_norm_backward_input")
        k.emit(f"let b: i32 = n / {group};")
        k.emit(f"let g: i32 = n % {group};")
        mu, rs = k.let(_f32(k, mean2, ["b", "g"]), "f32"), k.let(_f32(k, rstd2, ["b", "g"]), "f32")
        sum_ds, sum_db = k.var("f32", "0.0", "sds"), k.var("f32", "0.0", "sdb")
        k.loop("ci", D)
        k.emit(f"let c: i32 = g * {D} + ci;")
        gamma = _f32(k, wv, ["c"]) if wv is not None else "1.0"
        ds, db = channel_sums(k, "b", "c")
        k.emit(f"{sum_ds} = {sum_ds} + {ds} * {gamma};")
        k.emit(f"{sum_db} = {sum_db} + {db} * {gamma};")
        k.close()
        scale = lit(1.0 / (D * HxW), "f32")
        c2 = k.let(f"({sum_db} * {mu} - {sum_ds}) * {rs} * {rs} * {rs} * {scale}", "f32")
        c3 = k.let(f"-{c2} * {mu} - {sum_db} * {rs} * {scale}", "f32")
        k.loop("ci", D)
        k.emit(f"let c: i32 = g * {D} + ci;")
        gamma = _f32(k, wv, ["c"]) if wv is not None else "1.0"
        k.loop("p", HxW)
        e = f"{rs} * {gamma} * {_f32(k, dy3, ['b', 'c', 'p'])} + {c2} * {_f32(k, x3, ['b', 'c', 'p'])} + {c3}"
        k.write(bufs[0], f"(b * {C} + c) * {HxW} + p", e, "f32")
        k.close()
        k.close()
        pb.add(k.finish(N * group))
    cols = [s for s in (1, 2) if s in bufs]
    if cols and C:
        dy3, x3, mean2, rstd2 = pb.fit([dy3, x3, mean2, rstd2], len(cols))
        k = pb.kernel("group_norm_backward_affine")
        k.emit(f"let g: i32 = n / {D};")
        dw, dbias = k.var("f32", "0.0", "dw"), k.var("f32", "0.0", "dbias")
        k.loop("b", N)
        ds, db = channel_sums(k, "b", "n")
        if 1 in bufs:
            k.emit(f"{dw} = {dw} + ({ds} - {db} * {_f32(k, mean2, ['b', 'g'])}) * {_f32(k, rstd2, ['b', 'g'])};")
        k.emit(f"{dbias} = {dbias} + {db};")
        k.close()
        for s, acc in ((1, dw), (2, dbias)):
            if s in bufs:
                k.write(bufs[s], "n", acc, "f32")
        pb.add(k.finish(C))
    return [BufferView.whole(bufs[s], metas[s]) for s in slots]


# --- convolution -------------------------------------------------------------------------

def _conv_backward_samples():
    def case(x, w, stride, padding, dilation, transposed=False, output_padding=None, groups=1, grad=rand):
        nsp = len(x.shape) - 2
        output_padding = output_padding or [0] * nsp
        y = torch.ops.aten.convolution(x, w, None, stride, padding, dilation, transposed, output_padding, groups)
        cout = y.shape[1]
        return ((grad(*y.shape), x, w, [cout], stride, padding, dilation, transposed, output_padding, groups,
                 [True, True, True]), {})
    return [case(rand(2, 3, 8, 8), rand(4, 3, 3, 3), [1, 1], [1, 1], [1, 1]),
            case(rand(1, 4, 9, 7), rand(6, 2, 3, 2), [2, 1], [1, 0], [1, 2], groups=2),
            case(rand(1, 8, 6, 6), rand(8, 1, 3, 3), [1, 1], [2, 2], [2, 2], groups=8),
            case(rand(2, 3, 16), rand(5, 3, 4), [2], [1], [1]),
            case(rand(1, 4, 5, 6, 4), rand(6, 2, 3, 2, 3), [1, 2, 1], [1, 0, 1], [1, 1, 2], groups=2),
            case(edge_floats(1, 2, 6, 6), rand(3, 2, 3, 3), [1, 1], [1, 1], [1, 1]),
            case(rand(1, 2, 7, 7), rand(3, 2, 3, 3), [2, 2], [0, 0], [1, 1], grad=edge_floats),
            # transposed: weight (Cin, Cout / groups, *kernel)
            case(rand(2, 4, 5, 6), rand(4, 3, 3, 3), [2, 2], [1, 1], [1, 1], True, [1, 0]),
            case(rand(1, 4, 4, 5), rand(4, 2, 2, 3), [3, 2], [0, 1], [2, 1], True, [2, 1], groups=2),
            case(rand(2, 3, 7), rand(3, 2, 4), [2], [1], [1], True, [1]),
            case(edge_floats(1, 2, 4, 4), rand(2, 3, 3, 3), [1, 1], [0, 0], [1, 1], True)]


@register("aten.convolution_backward.default", ALL_FLOAT, samples=_conv_backward_samples,
          check=_mask_check(10, _bias_implies_weight), flops="reduce")
def convolution_backward(pb, node, dy, x, w, bias_sizes, stride, padding, dilation, transposed, output_padding,
                         groups, output_mask):
    """Gradients of a 1-3d convolution, plain or transposed, one thread per gradient element.

    A convolution relates input position ``i`` and output position ``o`` through kernel tap ``t``
    by ``o = i * stride - padding + t * dilation`` (plain: ``i`` and ``o`` swapped). The grad of
    the tensor on the ``i`` side is a direct convolution of the other side; the grad of the
    tensor on the ``o`` side gathers the ``i`` that reach it (``o`` solved for ``i``, as the
    forward's transposed path); grad_weight correlates ``x`` with ``dy``, grad_bias sums ``dy``."""
    slots = _slots(node, 10, _bias_implies_weight)
    metas = dict(zip(slots, node.outputs))
    nsp = len(x.shape) - 2
    stride, padding, dilation = (_int_list(v, nsp) for v in (stride, padding, dilation))
    ksz = list(w.shape[2:])
    Cin, Cout = x.shape[1], dy.shape[1]
    cig, cog = Cin // groups, Cout // groups
    # i side: the positions that stride (plain: dy; transposed: x); o side: the other one
    small, big = (dy, x) if not transposed else (x, dy)
    bufs = {s: pb.buffer("temp", m) for s, m in metas.items()}
    if 0 in bufs and metas[0].numel:
        dyp, wp = pb.fit([pb.plain(dy), pb.plain(w)], 1)
        k = pb.kernel("conv_backward_input")
        idx = k.unravel("n", x.shape)
        b, c, isp = idx[0], idx[1], idx[2:]
        k.emit(f"let g: i32 = {c} / {cig};" if groups > 1 else "let g: i32 = 0;")
        k.emit(f"let ci: i32 = {c} - g * {cig};")
        acc = k.var("f32", "0.0", "acc")
        k.loop("oj", cog)
        k.emit(f"let oc: i32 = g * {cog} + oj;")
        conds = []
        for d in range(nsp):
            k.loop(f"k{d}", ksz[d])
            if transposed:  # dy is on the o side: a direct convolution
                k.emit(f"let o{d}: i32 = {isp[d]} * {stride[d]} - {padding[d]} + k{d} * {dilation[d]};")
                conds.append(f"o{d} >= 0 && o{d} < {dy.shape[2 + d]}")
            else:  # dy is on the i side: x[i] met dy[o] where i = o * stride - padding + k * dilation
                k.emit(f"let tp{d}: i32 = {isp[d]} + {padding[d]} - k{d} * {dilation[d]};")
                # tp < 0 is tested first: WGSL's % of a negative operand becomes GLSL's, which is undefined
                conds.append(f"tp{d} >= 0 && tp{d} < {dy.shape[2 + d] * stride[d]}" +
                             (f" && tp{d} % {stride[d]} == 0" if stride[d] != 1 else ""))
        k.open(f"if ({' && '.join(conds)})")
        if not transposed:
            for d in range(nsp):
                k.emit(f"let o{d}: i32 = tp{d} / {stride[d]};" if stride[d] != 1 else f"let o{d}: i32 = tp{d};")
        kv = [f"k{d}" for d in range(nsp)]
        widx = [c, "oj"] if transposed else ["oc", "ci"]
        term = f"{_f32(k, dyp, [b, 'oc'] + [f'o{d}' for d in range(nsp)])} * {_f32(k, wp, widx + kv)}"
        k.emit(f"{acc} = {acc} + {term};")
        for _ in range(nsp + 2):
            k.close()
        k.write(bufs[0], "n", acc, "f32")
        pb.add(k.finish(metas[0].numel))
    if 1 in bufs and metas[1].numel:
        smallp, bigp = pb.fit([pb.plain(small), pb.plain(big)], 1)
        k = pb.kernel("conv_backward_weight")
        idx = k.unravel("n", w.shape)
        a, j, kv = idx[0], idx[1], idx[2:]
        # plain: w[oc, ci]: dy channel oc, x channel g * cig + ci; transposed: w[c, oj]: x channel c,
        # dy channel g * cog + oj
        per_group, other = (cog, cig) if not transposed else (cig, cog)
        k.emit(f"let g: i32 = {a} / {per_group};" if groups > 1 else "let g: i32 = 0;")
        k.emit(f"let bc: i32 = g * {other} + {j};")
        acc = k.var("f32", "0.0", "acc")
        k.loop("b", x.shape[0])
        conds = []
        for d in range(nsp):
            k.loop(f"q{d}", small.shape[2 + d])
            k.emit(f"let r{d}: i32 = q{d} * {stride[d]} - {padding[d]} + {kv[d]} * {dilation[d]};")
            conds.append(f"r{d} >= 0 && r{d} < {big.shape[2 + d]}")
        k.open(f"if ({' && '.join(conds)})")
        term = (f"{_f32(k, smallp, ['b', a] + [f'q{d}' for d in range(nsp)])} * "
                f"{_f32(k, bigp, ['b', 'bc'] + [f'r{d}' for d in range(nsp)])}")
        k.emit(f"{acc} = {acc} + {term};")
        for _ in range(nsp + 2):
            k.close()
        k.write(bufs[1], "n", acc, "f32")
        pb.add(k.finish(metas[1].numel))
    if 2 in bufs and metas[2].numel:
        (dyp,) = pb.fit([dy], 1)
        k = pb.kernel("conv_backward_bias")
        acc = k.var("f32", "0.0", "acc")
        k.loop("b", dy.shape[0])
        k.loop("q", math.prod(dy.shape[2:]))
        k.emit(f"{acc} = {acc} + {_f32(k, dyp, ['b', 'n'] + k.unravel('q', dy.shape[2:]))};")
        k.close()
        k.close()
        k.write(bufs[2], "n", acc, "f32")
        pb.add(k.finish(metas[2].numel))
    return [BufferView.whole(bufs[s], metas[s]) for s in slots]


__all__ = ["embedding_dense_backward", "avg_pool2d_backward", "max_pool2d_with_indices_backward",
           "adaptive_avg_pool2d_backward", "native_layer_norm_backward", "native_group_norm_backward",
           "convolution_backward"]
