"""Reductions (sum, mean, prod, amax/amin, max/min with indices, argmax/argmin, any/all,
var, vector norm, bincount) and scans (cumsum, cumprod).

One thread per output element loops over the reduced elements: no workgroup barriers,
which are expensive on CPU adapters (lavapipe); the input may be a fused expression. Past
LOOP_BUDGET elements the reduction is split across invocations and passes by its
:class:`~tapml.platforms.wgsl.folds.Fold` (platforms/wgsl/folds.py); on a GPU, rows of
``WORKGROUP_FOLD_K`` elements or more are folded by workgroups in workgroup memory instead.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import torch

from tapml.graph import TensorMeta
from tapml.platforms.wgsl.codegen import (LOOP_BUDGET, BufferView, Custom, Value, arith, cast, ctype, equal,
                                         extreme_lit, less, lit)
from tapml.platforms.wgsl.folds import Fold, fold_rows, interleave_index, moments_fold, scan_lines, workgroup_fold
from tapml.platforms.wgsl.registry import (ALL, ALL_FLOAT, ALL_INT, NUMERIC, edge_floats, edge_ints, rand, randbool, randint,
                                           register)
from tapml.platforms.wgsl.views import norm_dim


def norm_dims(dims, nd: int) -> list[int]:
    if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
        return list(range(nd))
    if isinstance(dims, int):
        dims = [dims]
    return sorted({norm_dim(d, nd) for d in dims}) if nd else []


def divide(e: str, n: int) -> str:
    """``e / n`` (an f32 expression over a count known when compiling). ``n == 0`` is spelled
    out as IEEE says (0/0 NaN, x/0 ±Inf): drivers fold a division by the literal 0.0 freely
    (llvmpipe gave 0 once the result was rounded to float16)."""
    if n:
        return f"({e} / {lit(n, 'f32')})"
    inf = f"select({lit(math.inf, 'f32')}, {lit(-math.inf, 'f32')}, {e} < 0.0)"
    return f"select({inf}, {lit(math.nan, 'f32')}, {e} == 0.0 || {e} != {e})"


def reduction(pb, name: str, x: Value, dims: Sequence[int], outs: Sequence[TensorMeta],
              init: Callable, passes: Sequence[Callable], final: Callable, fold: Fold) -> list[BufferView]:
    """Emit a kernel with one thread per kept element. ``init(k)`` declares state and returns
    it; each pass ``p(k, state, v, r)`` runs in its own loop over the reduced elements
    (``v`` the element, ``r`` its index within the reduced dims); ``final(k, state)`` returns
    one (expression, type) per output. When the passes would loop past LOOP_BUDGET, ``fold``
    (the same reduction as an associative fold) is split across invocations instead."""
    nd = len(x.shape)
    kept = [d for d in range(nd) if d not in dims]
    kept_shape = [x.shape[d] for d in kept]
    red_shape = [x.shape[d] for d in dims]
    count = math.prod(red_shape)
    if count * len(passes) > LOOP_BUDGET or workgroup_fold(pb.caps, count):
        return fold_rows(pb, name, x, dims, outs, fold)
    bufs = [pb.buffer("temp", m) for m in outs]
    views = [BufferView.whole(b, m) for b, m in zip(bufs, outs)]
    if math.prod(kept_shape) == 0:
        return views
    (x,) = pb.fit([x], len(outs))
    k = pb.kernel(name)
    kidx = k.unravel("n", kept_shape)
    state = init(k)
    for p in passes:
        k.loop("r", count)
        ridx = k.unravel("r", red_shape)
        p(k, state, x.read(k, interleave_index(nd, kept, kidx, dims, ridx)), "r")
        k.close()
    for b, (e, ty) in zip(bufs, final(k, state)):
        k.write(b, "n", e, ty)
    pb.add(k.finish(math.prod(kept_shape)))
    return views


def _red_samples(ints=True, bools=False):
    def samples():
        out = [((rand(3, 5), [1]), {}), ((rand(2, 3, 4), [0, 2], True), {}), ((rand(4, 6), [-1], False), {}),
               ((rand(5, 7), []), {})]
        if ints:
            out.append(((randint(3, 4, lo=-5, hi=5), [0]), {}))
        if bools:
            out.append(((randbool(3, 4), [1]), {}))
        return out
    return samples


def _sum_like(kind):
    def lower(pb, node, x, dim=None, keepdim=False, dtype=None):
        dims = norm_dims(dim, len(x.shape))
        t = ctype(node.outputs[0].dtype)
        count = math.prod(x.shape[d] for d in dims)
        ident = 1 if kind == "prod" else 0
        op = "*" if kind == "prod" else "+"

        def init(k):
            return k.var(t, lit(ident, t), "acc")

        def step(k, acc, v, r):
            k.emit(f"{acc} = {arith(op, acc, cast(v, x.ty, t), t)};")

        def final(k, acc):
            if kind == "mean":
                return [(divide(acc, count), t)]
            return [(acc, t)]
        fold = Fold([("acc", t, lit(ident, t))], lambda k, v, r: [cast(v, x.ty, t)],
                    lambda k, st, o, empty: k.emit(f"{st[0]} = {arith(op, st[0], o[0], t)};"),
                    lambda k, st: final(k, st[0]))
        return reduction(pb, kind, x, dims, node.outputs, init, [step], final, fold)
    return lower


# sums over no elements (OpInfo's linalg.vecdot samples of empty vectors): 0, and NaN for a mean
register(["aten.sum.dim_IntList", "aten.sum.default"], ALL, samples=lambda: _red_samples(bools=True)() + [
    ((rand(3, 4),), {}), ((rand(0, 5), [0]), {}), ((rand(5, 0), [1]), {}), ((rand(0),), {}),
    ((edge_floats(3, 4), [1]), {}), ((edge_ints(2, 5, dtype=torch.int32), [1]), {})], flops="reduce")(_sum_like("sum"))
register(["aten.mean.dim", "aten.mean.default"], ALL_FLOAT,
         samples=lambda: [((rand(3, 5), [1]), {}), ((rand(2, 3, 4, 4), [2, 3], True), {}), ((rand(4, 6),), {}),
                          ((rand(0, 5), [0]), {}), ((edge_floats(3, 4), [1]), {})], flops="reduce")(
    _sum_like("mean"))


register(["aten.prod.dim_int", "aten.prod.default"], ALL,
         samples=lambda: [((rand(3, 5, lo=0.5, hi=1.5), 1), {}), ((rand(2, 4, lo=0.5, hi=1.5),), {}),
                          ((randint(3, 4, lo=-3, hi=3), 0, True), {}), ((edge_floats(4, 5), 1), {}),
                          ((randbool(3, 4), 1), {}), ((randbool(3, 4),), {}),
                          ((edge_ints(3, 5, dtype=torch.int32), 1), {})] + [
    ((randint(3, 4, lo=-3, hi=3, dtype=getattr(torch, d)), 0), {}) for d in ("int64", "int16", "int8")] + [
    ((randint(3, 4, lo=1, hi=3, dtype=torch.uint8), 0), {})], flops="reduce")(_sum_like("prod"))


def _isnan(e: str) -> str:
    """A WGSL bool: f32 ``e`` is NaN, tested on its bits."""
    return f"((bitcast<u32>({e}) & 0x7fffffffu) > 0x7f800000u)"


def _extreme(t, is_max):
    """(identity literal, better(v, best) predicate) for max/min over type t."""
    if t == "f32":
        ident = lit(-math.inf if is_max else math.inf, "f32")
        cmp = ">" if is_max else "<"
        # NaN wins (torch propagates it); first occurrence wins ties. NaN is tested on the bits:
        # drivers may fold x != x to false (lavapipe did, on values read back from a pass)
        return ident, lambda v, b: f"({v} {cmp} {b} || ({_isnan(v)} && !{_isnan(b)}))"
    if t == "bool":
        return ("false" if is_max else "true"), lambda v, b: (f"({v} && !{b})" if is_max else f"(!{v} && {b})")
    # integers (two-word int64 included): the extreme of the type, an exact comparison
    return extreme_lit(t, not is_max), lambda v, b: less(b, v, t) if is_max else less(v, b, t)


def _amax_like(is_max):
    def lower(pb, node, x, dim=None, keepdim=False):
        dims = norm_dims(dim, len(x.shape))
        t = x.ty
        ident, better = _extreme(t, is_max)

        def init(k):
            return k.var(t, ident, "best")

        def step(k, best, v, r):
            k.emit(f"if {better(v, best)} {{ {best} = {v}; }}")
        fold = Fold([("best", t, ident)], lambda k, v, r: [v], lambda k, st, o, empty: step(k, st[0], o[0], None),
                    lambda k, st: [(st[0], t)])
        return reduction(pb, "amax" if is_max else "amin", x, dims, node.outputs, init, [step],
                         lambda k, best: [(best, t)], fold)
    return lower


register(["aten.amax.default", "aten.max.default"], ALL, samples=lambda: _red_samples(bools=True)()[:-2] + [
    ((rand(3, 4),), {})], flops="reduce")(_amax_like(True))
register(["aten.amin.default", "aten.min.default"], ALL, samples=lambda: _red_samples()()[:-1] + [
    ((rand(3, 4),), {})], flops="reduce")(_amax_like(False))


def _arg_like(is_max, values):
    def lower(pb, node, x, dim=None, keepdim=False):
        dims = norm_dims(dim, len(x.shape))
        t = x.ty
        ident, better = _extreme(t, is_max)

        def init(k):
            return k.var(t, ident, "best"), k.var("i32", "-1", "arg")

        def step(k, st, v, r):
            best, arg = st
            k.emit(f"if ({arg} < 0 || {better(v, best)}) {{ {best} = {v}; {arg} = {r}; }}")

        def final(k, st):
            return ([(st[0], t)] if values else []) + [(st[1], "i32")]

        def absorb(k, st, o, empty):
            # a later part wins only with a better value, or an equal one (NaN equals NaN here)
            # at a smaller index: the first occurrence, as torch picks
            best, arg = st
            tie = f"({o[0]} == {best} || ({_isnan(o[0])} && {_isnan(best)}))" if t == "f32" else equal(o[0], best, t)
            k.emit(f"if ({o[1]} >= 0 && ({arg} < 0 || {better(o[0], best)} || ({tie} && {o[1]} < {arg}))) "
                   f"{{ {best} = {o[0]}; {arg} = {o[1]}; }}")
        fold = Fold([("best", t, ident), ("arg", "i32", "-1")], lambda k, v, r: [v, r], absorb, final)
        return reduction(pb, "argmax" if is_max else "argmin", x, dims, node.outputs, init, [step], final, fold)
    return lower


def _dim_samples():
    return [((rand(3, 5), 1), {}), ((rand(2, 3, 4), 0, True), {}), ((randint(4, 6, lo=0, hi=4), -1), {})]


def _dim_value_samples():
    return _dim_samples() + [((randbool(3, 5), 1), {}), ((edge_ints(3, 5, dtype=torch.int32), 1), {}),
                             ((randint(3, 5, lo=0, hi=200, dtype=torch.uint8), 0), {})]


register("aten.max.dim", ALL, samples=_dim_value_samples, flops="reduce")(_arg_like(True, True))
register("aten.min.dim", ALL, samples=_dim_value_samples, flops="reduce")(_arg_like(False, True))
register("aten.argmax.default", NUMERIC, samples=lambda: _dim_samples() + [((rand(3, 4),), {})], flops="reduce")(_arg_like(True, False))
register("aten.argmin.default", NUMERIC, samples=lambda: _dim_samples() + [((rand(3, 4),), {})], flops="reduce")(_arg_like(False, False))


def _any_like(is_any):
    def lower(pb, node, x, dim=None, keepdim=False):
        dims = norm_dims(dim, len(x.shape))

        def init(k):
            return k.var("bool", "false" if is_any else "true", "acc")

        def step(k, acc, v, r):
            b = cast(v, x.ty, "bool")
            k.emit(f"{acc} = {acc} {'||' if is_any else '&&'} {b};")
        fold = Fold([("acc", "bool", "false" if is_any else "true")], lambda k, v, r: [cast(v, x.ty, "bool")],
                    lambda k, st, o, empty: k.emit(f"{st[0]} = {st[0]} {'||' if is_any else '&&'} {o[0]};"),
                    lambda k, st: [(st[0], "bool")])
        return reduction(pb, "any" if is_any else "all", x, dims, node.outputs, init, [step], lambda k, a: [(a, "bool")],
                         fold)
    return lower


def _any_samples():
    import torch
    return [((torch.rand(3, 5) > 0.8, 1), {}), ((torch.rand(2, 3, 4) > 0.9,), {}), ((randint(3, 4, lo=0, hi=2), 0, True), {}),
            ((rand(4, 3).round(), [0, 1]), {}), ((rand(4, 3).round(), 1), {}), ((rand(5, 2).round(),), {}),
            ((edge_floats(4, 6), 0), {}), ((edge_floats(4, 6) * 0,), {}), ((edge_ints(3, 5), 1), {}),
            ((edge_ints(2, 4) * 0,), {})] + [
        ((randint(4, 5, lo=0, hi=2, dtype=getattr(torch, d)), *dim), {}) for d in ALL_INT[1:] for dim in ((1,), ())]


register(["aten.any.dim", "aten.any.dims", "aten.any.default"], ALL, samples=_any_samples, flops="reduce")(_any_like(True))
register(["aten.all.dim", "aten.all.dims", "aten.all.default"], ALL, samples=_any_samples, flops="reduce")(_any_like(False))


@register(["aten.var.correction", "aten.var_mean.correction"], ALL_FLOAT,
          samples=lambda: [((rand(3, 5), [1]), {}), ((rand(2, 3, 4), [0, 2]), {"correction": 0, "keepdim": True}),
                           ((rand(4, 6),), {}), ((rand(3, 5), [1]), {"correction": 1}),
                           # OpInfo's var_mean/std_mean samples of empty tensors, and one element with
                           # correction 1: NaN, as torch gives
                           ((rand(0),), {}), ((rand(0, 5), [0]), {"correction": 1}), ((rand(0, 5),), {"correction": 0}),
                           ((rand(1, 4), [0]), {"correction": 1}), ((edge_floats(2, 4), [1]), {})], flops="reduce")
def var(pb, node, x, dim=None, *, correction=None, keepdim=False):
    return _var(pb, node, x, dim, correction, keepdim)


@register("aten.var.dim", ALL_FLOAT,
          samples=lambda: [((rand(3, 5), [1]), {}), ((rand(2, 3, 4), [0, 2], False, True), {}), ((rand(4, 6), None), {}),
                           ((rand(3, 5), [1], True), {}), ((edge_floats(2, 4), [1]), {}), ((rand(1, 4), [0]), {})],
          flops="reduce")
def var_dim(pb, node, x, dim=None, unbiased=True, keepdim=False):
    return _var(pb, node, x, dim, 1 if unbiased else 0, keepdim)


def _var(pb, node, x, dim, correction, keepdim):
    dims = norm_dims(dim, len(x.shape))
    count = math.prod(x.shape[d] for d in dims)
    corr = 1 if correction is None else correction
    with_mean = node.op == "aten.var_mean.correction"

    def init(k):
        return k.var("f32", "0.0", "s"), k.var("f32", "0.0", "q")

    def p1(k, st, v, r):
        k.emit(f"{st[0]} = {st[0]} + {v};")

    def p2(k, st, v, r):
        k.emit(f"let d{r} = {v} - {st[0]} / {lit(count, 'f32')};")
        k.emit(f"{st[1]} = {st[1]} + d{r} * d{r};")

    def final(k, st):
        out = [(divide(st[1], max(count - corr, 0)), "f32")]
        return out + ([(divide(st[0], count), "f32")] if with_mean else [])

    def fold_final(k, st):
        out = [(divide(st[2], max(count - corr, 0)), "f32")]
        return out + ([(st[1], "f32")] if with_mean else [])
    fold = moments_fold(lambda k, v: cast(v, x.ty, "f32"), fold_final)
    return reduction(pb, "var", x, dims, node.outputs, init, [p1, p2], final, fold)


def _vector_norm_samples():
    return [((rand(3, 5),), {}), ((rand(3, 5), 2, [1], True), {}), ((rand(4, 6), 1, [0]), {}),
            ((edge_floats(4, 6), math.inf, [1]), {}), ((rand(3, 5), -math.inf), {}),
            ((edge_floats(4, 6), -math.inf, [1]), {}), ((rand(2, 3, 4), -math.inf, [0, 2], True), {}),
            ((edge_floats(3, 7), 0, [1]), {}), ((rand(5, 4) * randbool(5, 4), 0), {}),
            ((rand(4, 6), 3, [1]), {}), ((edge_floats(4, 6), 0.5, [0]), {}), ((rand(3, 5), -1.5, [1]), {}),
            ((edge_floats(2, 5), 2, [1]), {}), ((rand(0, 3), 2, [0]), {})]


@register("aten.linalg_vector_norm.default", ALL_FLOAT, samples=_vector_norm_samples, flops="reduce")
def vector_norm(pb, node, x, ord=2, dim=None, keepdim=False, dtype=None):
    """torch.linalg.vector_norm: ``ord`` inf/-inf is the largest/smallest |x| (NaN propagates),
    0 counts the nonzero elements, any other p is (sum |x|^p)^(1/p), accumulated in f32."""
    dims = norm_dims(dim, len(x.shape))
    p = float(ord)

    def init(k):
        return k.var("f32", lit(math.inf, "f32") if p == -math.inf else "0.0", "acc")

    def step(k, acc, v, r):
        if p == 2:
            k.emit(f"{acc} = {acc} + {v} * {v};")
        elif p == 1:
            k.emit(f"{acc} = {acc} + abs({v});")
        elif p in (math.inf, -math.inf):
            k.emit(f"{acc} = {k.need('tap_max' if p > 0 else 'tap_min')}({acc}, abs({v}));")
        elif p == 0:
            k.emit(f"{acc} = {acc} + select(0.0, 1.0, {cast(v, 'f32', 'bool')});")
        else:
            k.emit(f"{acc} = {acc} + {k.need('tap_pow')}(abs({v}), {lit(p, 'f32')});")

    def final(k, acc):
        if p == 2:
            return [(f"sqrt({acc})", "f32")]
        if p in (1, 0, math.inf, -math.inf):
            return [(acc, "f32")]
        return [(f"{k.need('tap_pow')}({acc}, {lit(1 / p, 'f32')})", "f32")]

    def lift(k, v, r):
        if p in (math.inf, -math.inf):
            return [f"abs({v})"]
        acc = k.var("f32", "0.0", "term")
        step(k, acc, v, r)
        return [acc]

    def absorb(k, st, o, empty):
        if p in (math.inf, -math.inf):
            k.emit(f"{st[0]} = {k.need('tap_max' if p > 0 else 'tap_min')}({st[0]}, {o[0]});")
        else:
            k.emit(f"{st[0]} = {st[0]} + {o[0]};")
    fold = Fold([("acc", "f32", lit(math.inf, "f32") if p == -math.inf else "0.0")], lift, absorb,
                lambda k, st: final(k, st[0]))
    return reduction(pb, "norm", x, dims, node.outputs, init, [step], final, fold)


# --- scans -------------------------------------------------------------------------------

def _scan(kind):
    def lower(pb, node, x, dim, dtype=None):
        meta = node.outputs[0]
        nd = len(x.shape)
        dim = norm_dim(dim, nd) if nd else 0
        t = ctype(meta.dtype)
        if nd == 0:
            return [x]
        op = "*" if kind == "cumprod" else "+"
        fold = Fold([("acc", t, lit(1 if kind == "cumprod" else 0, t))], lambda k, v, r: [cast(v, x.ty, t)],
                    lambda k, st, o, empty: k.emit(f"{st[0]} = {arith(op, st[0], o[0], t)};"), lambda k, st: [(st[0], t)])
        return scan_lines(pb, kind, x, dim, [meta], fold)
    return lower


register("aten.cumsum.default", ALL, samples=lambda: [((rand(3, 5), 1), {}), ((randint(2, 6), -1), {}),
                                                      ((randbool(4, 3), 0), {}), ((rand(2, 3, 4), 1), {})], flops="reduce")(_scan("cumsum"))
register("aten.cumprod.default", ALL, samples=lambda: [((rand(3, 5, lo=0.5, hi=1.5), 1), {}), ((edge_floats(4, 5), 1), {}),
                                                        ((randbool(4, 3), 0), {}), ((randint(3, 5, lo=-3, hi=4), 1), {}),
                                                        # i32 boundaries whose running products stay in i32
                                                        ((torch.tensor([[-2**31, 2**31 - 1, -1, 0, 1], [1, 1, -1, 5, 1],
                                                                        [1, -1, 1, 1, 1]], dtype=torch.int32), 0), {})],
         flops="reduce")(
    _scan("cumprod"))


# --- bincount ----------------------------------------------------------------------------

def _bincount_samples():
    return [((torch.tensor([0, 3, 1, 3, 7, 3]),), {}), ((randint(50, hi=9),), {"minlength": 12}),
            ((randint(40, hi=6, dtype=torch.uint8), rand(40)), {}), ((randint(30, hi=5, dtype=torch.int32),), {}),
            ((randint(30, hi=5, dtype=torch.int16), edge_floats(30)), {}), ((randint(20, hi=4, dtype=torch.int8),), {}),
            ((torch.zeros(0, dtype=torch.int64),), {"minlength": 3})]


@register("aten.bincount.default", ALL_INT + ("float32",), samples=_bincount_samples, flops="reduce")
def bincount(pb, node, x, weights=None, minlength=0):
    """How often each value occurs in ``x`` (the sum of its ``weights``), one bin per value up to
    the largest: the number of bins is data-dependent, so it is the node's recorded shape. Each
    bin loops over ``x`` in order (no atomics), summing weights in f32 as torch does."""
    meta = node.outputs[0]
    n = x.shape[0]
    ty = "f32" if weights is not None else "i32"
    ins = pb.fit([x] + ([weights] if weights is not None else []), 1)

    def fn(k, idx):
        acc = k.var(ty, lit(0, ty), "bin")
        if n:
            k.loop("i", n)
            hit = f"{cast(ins[0].read(k, ['i']), ins[0].ty, 'i32')} == {idx[0]}"
            add = cast(ins[1].read(k, ["i"]), ins[1].ty, "f32") if weights is not None else "1"
            k.emit(f"if ({hit}) {{ {acc} = {acc} + {add}; }}")
            k.close()
        return acc
    return [Custom(meta.shape, meta.dtype, ins, fn, cost=9)]
