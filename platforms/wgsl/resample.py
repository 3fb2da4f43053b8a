"""Resampling and padding: nearest / linear / cubic upsampling (antialiased too), grid sampling,
reflection, replication and circular padding.

Source indices follow torch's CPU kernels exactly: the per-dimension scale is computed on the host
in float32 as torch does (``1 / scale_factor`` when one is given, else ``in / out``; ``(in - 1) /
(out - 1)`` with ``align_corners``) and baked into the shader, where only correctly rounded f32
multiplications and additions touch it, so a nearest neighbour picks the element torch picks.
Interpolations sum their taps in torch's order (outer dimension first), so that an Inf or NaN
tap with a zero weight gives NaN where torch's does.

Nearest upsampling and the pads are index maps (:class:`Remap`: they fuse into their reader
like views); the interpolations are gathers (:class:`Custom`) that read their input directly,
through its bindings, so a split buffer works.

What these lowerings refuse, by design: bilinear and bicubic upsampling of uint8 (torch's CPU
kernel runs a fixed-point int16-weight path for it), and the antialiased ones in float16 and
bfloat16 (torch has no CPU kernel for them either)."""

from __future__ import annotations

import math

import numpy as np
import torch

from tapml.platforms.wgsl.codegen import Custom, Remap, cast, lit, round_low
from tapml.platforms.wgsl.elementwise import typed
from tapml.platforms.wgsl.registry import ALL_FLOAT, ALL_INT, rand, register

FLOAT_U8 = ALL_FLOAT + ("uint8",)
PADDABLE = ALL_FLOAT + ALL_INT


def _f32(v) -> float:
    return float(np.float32(v))


def _arguments(node, args, kwargs) -> dict:
    """The node's arguments by their schema names (optional ones missing: their default)."""
    from tapml.ops import resolve_op
    out = {}
    for i, a in enumerate(resolve_op(node.op)._schema.arguments):
        if i < len(args):
            out[a.name] = args[i]
        elif a.name in kwargs:
            out[a.name] = kwargs[a.name]
        else:
            out[a.name] = a.default_value if a.has_default_value() else None
    return out


def _spatial(node, args, kwargs, nsp: int):
    """``(input, align_corners, scales)`` of an upsample node of either overload: ``.vec`` takes
    ``scale_factors`` (a list or None), ``.default`` one optional scale per spatial dim."""
    a = _arguments(node, args, kwargs)
    x = a.get("input", a.get("self"))
    if "scale_factors" in a:
        factors = a["scale_factors"]
        scales = list(factors) if factors else [None] * nsp
    else:
        names = ["scales"] if nsp == 1 else ["scales_d", "scales_h", "scales_w"][3 - nsp:]
        scales = [a.get(n) for n in names]
    return x, bool(a.get("align_corners") or False), scales


def _check_batch(x, meta, nsp: int, op: str) -> int:
    """How many leading (batch, channel) dims ``x`` has; ValueError when the node's output does
    not keep them or ``x`` has no ``nsp`` spatial dims (a store from elsewhere may say anything)."""
    lead = len(x.shape) - nsp
    if lead < 1 or len(meta.shape) != len(x.shape) or tuple(meta.shape[:lead]) != tuple(x.shape[:lead]) \
            or min(meta.shape, default=1) < 1:
        raise ValueError(f"{op}: input {list(x.shape)} and output {list(meta.shape)} do not fit {nsp} spatial dims")
    return lead


def scale_value(in_size: int, out_size: int, scale) -> float:
    """torch's ``compute_scales_value`` in float32: ``1 / scale`` when a positive scale factor is
    given (the user's, not the one the sizes imply), else ``in / out``."""
    if scale is not None and scale > 0:
        return _f32(1.0 / scale)
    return float(np.float32(in_size) / np.float32(out_size))


def area_scale(in_size: int, out_size: int, align_corners: bool, scale) -> float:
    """torch's ``area_pixel_compute_scale`` in float32."""
    if align_corners:
        return float(np.float32(in_size - 1) / np.float32(out_size - 1)) if out_size > 1 else 0.0
    return scale_value(in_size, out_size, scale)


def _source_index(k, o: str, scale: float, align_corners: bool, cubic: bool) -> str:
    """torch's ``area_pixel_compute_source_index`` of output index ``o`` (an f32 expression)."""
    s = lit(scale, "f32")
    if align_corners:
        return k.let(f"{s} * f32({o})", "f32")
    src = k.let(f"{s} * (f32({o}) + 0.5) - 0.5", "f32")
    return src if cubic else k.let(f"select({src}, 0.0, {src} < 0.0)", "f32")


# --- nearest -------------------------------------------------------------------------------

def _nearest(exact: bool):
    def lower(pb, node, *args, **kwargs):
        meta = node.outputs[0]
        nsp = int(node.op.split(".")[1][-2])
        x, _, scales = _spatial(node, args, kwargs, nsp)
        lead = _check_batch(x, meta, nsp, node.op)
        ins, outs = x.shape[lead:], meta.shape[lead:]
        factors = [scale_value(i, o, s) for i, o, s in zip(ins, outs, scales)]

        def source(k, d, o):
            n, m, s = ins[d], outs[d], lit(factors[d], "f32")
            if exact:  # floorf((o + 0.5) * scale): the product of two floats is exact in double
                return k.let(f"min(i32(floor((f32({o}) + 0.5) * {s})), {n - 1})", "i32")
            if nsp == 2 and m == n:  # torch's 2-d kernel alone takes these shortcuts (nearest_idx)
                return o
            if nsp == 2 and m == 2 * n:
                return k.let(f"({o} >> 1u)", "i32")
            return k.let(f"min(i32(floor(f32({o}) * {s})), {n - 1})", "i32")

        def index(k, idx):
            return list(idx[:lead]) + [source(k, d, o) for d, o in enumerate(idx[lead:])]
        return [Remap(x, meta.shape, index)]
    return lower


def _nearest_samples(nsp: int, vec: bool):
    """Upscale and downscale, integer and not, by sizes and by scale factors (also one where the
    size stays but the factor does not: torch copies), float edge values and uint8."""
    def make():
        spatial = {1: [(7,), (5,), (3,), (9,)], 2: [(5, 7), (6, 9), (3, 3), (5, 4)],
                   3: [(3, 4, 5), (4, 6, 3), (3, 3, 3), (2, 5, 4)]}[nsp]
        plans = [("scale", [2.0] * nsp), ("size", [max(1, s * 2 // 3 + 1) for s in spatial[1]]),
                 ("scale", [1.3] * nsp), ("scale", ([1.7, 0.6, 2.5])[:nsp])]
        cases = []
        for i, (sp, (kind, val)) in enumerate(zip(spatial, plans)):
            x = typed((2, 3) + sp, "float32") if i == 0 else rand(1, 2, *sp)
            cases.append(_upsample_args(x, kind, val, vec, None))
        u8 = torch.randint(0, 256, (1, 3) + spatial[1], dtype=torch.uint8)
        u8.view(-1)[:2] = torch.tensor([0, 255], dtype=torch.uint8)
        cases.append(_upsample_args(u8, "size", [s + 3 for s in spatial[1]], vec, None))
        cases.append(_upsample_args(typed((1, 2) + spatial[0], "float32", edges=True), "size",
                                    [s * 3 + 1 for s in spatial[0]], vec, None))
        return cases
    return make


def _upsample_args(x, kind: str, val, vec: bool, align_corners):
    """One sample of an upsample op: ``kind`` "size" (output sizes) or "scale" (scale factors),
    in the ``.vec`` or the ``.default`` calling form; ``align_corners`` None for nearest."""
    nsp = len(val)
    ac = () if align_corners is None else (align_corners,)
    if vec:
        return ((x, val if kind == "size" else None, *ac, val if kind == "scale" else None), {})
    if kind == "size":
        return ((x, list(val), *ac), {})
    size = [int(s * f) for s, f in zip(x.shape[-nsp:], val)]
    return ((x, size, *ac, *val), {})


for _n in (1, 2, 3):
    for _exact, _name in ((False, f"upsample_nearest{_n}d"), (True, f"_upsample_nearest_exact{_n}d")):
        for _vec in (True, False):
            register(f"aten.{_name}.{'vec' if _vec else 'default'}", FLOAT_U8,
                     samples=_nearest_samples(_n, _vec))(_nearest(_exact))


# --- linear and cubic ---------------------------------------------------------------------

def _cubic1(x: str, a: float) -> str:
    return f"((({lit(a + 2, 'f32')} * {x} - {lit(a + 3, 'f32')}) * {x}) * {x} + 1.0)"


def _cubic2(x: str, a: float) -> str:
    return (f"((({lit(a, 'f32')} * {x} - {lit(5 * a, 'f32')}) * {x} + {lit(8 * a, 'f32')}) * {x}"
            f" - {lit(4 * a, 'f32')})")


def _linear_taps(k, o, n, m, scale, align_corners):
    """(index, weight) pairs of torch's ``compute_source_index_and_lambda`` for output index ``o``."""
    if m == n:  # torch copies: index0 = index1 = o, weights 1 and 0
        return [(o, "1.0"), (o, "0.0")]
    src = _source_index(k, o, scale, align_corners, cubic=False)
    i0 = k.let(f"min(i32(floor({src})), {n - 1})", "i32")
    l1 = k.let(f"min(max({src} - f32({i0}), 0.0), 1.0)", "f32")
    i1 = k.let(f"{i0} + select(0, 1, {i0} < {n - 1})", "i32")
    return [(i0, k.let(f"1.0 - {l1}", "f32")), (i1, l1)]


def _cubic_taps(k, o, n, m, scale, align_corners):
    """(index, weight) pairs of torch's cubic convolution (A = -0.75), indices clamped into range."""
    src = _source_index(k, o, scale, align_corners, cubic=True)
    i = k.let(f"min(i32(floor({src})), {n - 1})", "i32")
    t = k.let(f"min(max({src} - f32({i}), 0.0), 1.0)", "f32")
    t1 = k.let(f"1.0 - {t}", "f32")
    weights = [_cubic2(f"({t} + 1.0)", -0.75), _cubic1(t, -0.75), _cubic1(t1, -0.75), _cubic2(f"({t1} + 1.0)", -0.75)]
    return [(k.let(f"clamp({i} + {j - 1}, 0, {n - 1})", "i32"), k.let(w, "f32")) for j, w in enumerate(weights)]


def _interpolate(cubic: bool):
    def lower(pb, node, *args, **kwargs):
        meta = node.outputs[0]
        name = node.op.split(".")[1]
        nsp = 2 if "2d" in name else 3 if "3d" in name else 1
        x, align_corners, scales = _spatial(node, args, kwargs, nsp)
        x = pb.plain(x)  # read 2**nsp or 16 times per element: never recompute a fused chain
        (x,) = pb.fit([x], 1)
        lead = _check_batch(x, meta, nsp, node.op)
        ins, outs = x.shape[lead:], meta.shape[lead:]
        factors = [area_scale(i, o, align_corners, s) for i, o, s in zip(ins, outs, scales)]
        taps_of = _cubic_taps if cubic else _linear_taps

        def fn(k, idx):
            taps = [taps_of(k, o, ins[d], outs[d], factors[d], align_corners) for d, o in enumerate(idx[lead:])]

            def combine(d, src):
                if d == nsp:
                    return cast(x.read(k, list(idx[:lead]) + src), x.ty, "f32")
                acc = None
                for i, w in taps[d]:
                    term = f"{combine(d + 1, src + [i])} * {w}"
                    acc = term if acc is None else k.let(f"{acc} + {term}", "f32")
                return acc
            return round_low(k, combine(0, []), meta.dtype)
        return [Custom(meta.shape, meta.dtype, [x], fn, cost=4 * (4 if cubic else 2) ** nsp)]
    return lower


def _interp_samples(nsp: int, vec: bool, aa: bool = False):
    """Up and down, integer and fractional factors, sizes and factors, align_corners both ways,
    output size 1, a size that stays, and float edge values."""
    def make():
        spatial = {1: [(6,), (9,), (4,), (5,), (7,)], 2: [(5, 6), (8, 9), (4, 7), (5, 5), (6, 4)],
                   3: [(3, 4, 5), (4, 6, 3), (3, 3, 4), (2, 5, 4), (3, 2, 3)]}[nsp]
        down = [max(1, s // 2) for s in spatial[1]]
        plans = [("scale", [2.0] * nsp, False), ("size", down, True), ("scale", [1.6, 0.7, 2.5][:nsp], False),
                 ("size", [1] * nsp, False), ("size", [s + 3 for s in spatial[4]][:-1] + [spatial[4][-1]], True)]
        if aa:
            plans[0] = ("size", [max(1, s // 3) for s in spatial[0]], False)
            plans.append(("scale", [0.3] * nsp, True))
            spatial = spatial + [(17, 23)]
        cases = []
        for i, (sp, (kind, val, ac)) in enumerate(zip(spatial, plans)):
            x = typed((2, 3) + sp, "float32") if i == 0 else rand(1, 2, *sp)
            cases.append(_upsample_args(x, kind, val, vec, ac))
        return cases
    return make


for _n, _name in ((1, "upsample_linear1d"), (2, "upsample_bilinear2d"), (3, "upsample_trilinear3d")):
    for _vec in (True, False):
        register(f"aten.{_name}.{'vec' if _vec else 'default'}", ALL_FLOAT,
                 samples=_interp_samples(_n, _vec))(_interpolate(False))
for _vec in (True, False):
    register(f"aten.upsample_bicubic2d.{'vec' if _vec else 'default'}", ALL_FLOAT,
             samples=_interp_samples(2, _vec))(_interpolate(True))


# --- antialiased (PIL's separable filters) ----------------------------------------------------

def _aa_filter(x: str, cubic: bool) -> str:
    if not cubic:
        return f"max(1.0 - abs({x}), 0.0)"
    a = "abs(" + x + ")"
    return f"select(select(0.0, {_cubic2(a, -0.5)}, {a} < 2.0), {_cubic1(a, -0.5)}, {a} < 1.0)"


def _aa_dim(scale: float, cubic: bool):
    """Host-side constants of one antialiased dimension, as torch computes them in float32:
    ``(support, 1/scale or 1, max taps)``."""
    interp = 4 if cubic else 2
    support = _f32(interp * 0.5 * scale) if scale >= 1.0 else interp * 0.5
    invscale = _f32(1.0 / scale) if scale >= 1.0 else 1.0
    return support, invscale, int(math.ceil(support)) * 2 + 1


def _aa_window(k, o: str, n: int, scale: float, cubic: bool, tag: str):
    """Emit torch's ``_compute_indices_min_size_weights_aa`` for output index ``o``: returns
    ``(xmin, xsize, weight(j))``, where ``weight`` emits the normalized weight of tap ``j``."""
    support, invscale, taps = _aa_dim(scale, cubic)
    center = k.let(f"{lit(scale, 'f32')} * (f32({o}) + 0.5)", "f32")

    def trunc_half(v):  # static_cast<int64_t>(v + 0.5) of a float v, with the + 0.5 exact (in double)
        fl = k.let(f"floor({v})", "f32")
        return f"(i32({fl}) + select(0, 1, {v} - {fl} >= 0.5))"
    lo = k.let(f"{center} - {lit(support, 'f32')}", "f32")
    hi = k.let(f"{center} + {lit(support, 'f32')}", "f32")
    xmin = k.let(f"max({trunc_half(lo)}, 0)", "i32")
    xsize = k.let(f"clamp(min({trunc_half(hi)}, {n}) - {xmin}, 0, {taps})", "i32")

    def raw(j):
        return _aa_filter(f"((f32({j} + {xmin}) - {center} + 0.5) * {lit(invscale, 'f32')})", cubic)
    total = k.var("f32", "0.0", f"tot{tag}")
    k.open(f"for (var j{tag}: i32 = 0; j{tag} < {xsize}; j{tag} = j{tag} + 1)")
    k.emit(f"{total} = {total} + {raw(f'j{tag}')};")
    k.close()

    def weight(j):
        w = k.let(raw(j), "f32")
        return k.let(f"select({w}, {w} / {total}, {total} != 0.0)", "f32")
    return xmin, xsize, weight


def _antialiased(cubic: bool):
    def lower(pb, node, *args, **kwargs):
        meta = node.outputs[0]
        x, align_corners, scales = _spatial(node, args, kwargs, 2)
        _check_batch(x, meta, 2, node.op)
        x = pb.plain(x)
        (x,) = pb.fit([x], 1)
        ins, outs = x.shape[-2:], meta.shape[-2:]
        factors = [area_scale(i, o, align_corners, s) for i, o, s in zip(ins, outs, scales)]

        def fn(k, idx):
            lead, oh, ow = list(idx[:-2]), idx[-2], idx[-1]
            # torch skips the pass of a dimension whose size stays: that one is a plain copy
            hdim = None if ins[0] == outs[0] else _aa_window(k, oh, ins[0], factors[0], cubic, "h")
            wdim = None if ins[1] == outs[1] else _aa_window(k, ow, ins[1], factors[1], cubic, "w")
            acc = k.var("f32", "0.0", "acc")
            if hdim:
                k.open(f"for (var jh: i32 = 0; jh < {hdim[1]}; jh = jh + 1)")
                h = k.let(f"{hdim[0]} + jh", "i32")
            else:
                h = oh
            if wdim:
                row = k.var("f32", "0.0", "row")
                k.open(f"for (var jw: i32 = 0; jw < {wdim[1]}; jw = jw + 1)")
                v = cast(x.read(k, lead + [h, k.let(f"{wdim[0]} + jw", "i32")]), x.ty, "f32")
                k.emit(f"{row} = {row} + {v} * {wdim[2]('jw')};")
                k.close()
            else:
                row = cast(x.read(k, lead + [h, ow]), x.ty, "f32")
            if hdim:
                k.emit(f"{acc} = {acc} + {row} * {hdim[2]('jh')};")
                k.close()
            else:
                k.emit(f"{acc} = {row};")
            return round_low(k, acc, meta.dtype)
        return [Custom(meta.shape, meta.dtype, [x], fn, cost=64)]
    return lower


for _cubic, _name in ((False, "_upsample_bilinear2d_aa"), (True, "_upsample_bicubic2d_aa")):
    for _vec in (True, False):
        register(f"aten.{_name}.{'vec' if _vec else 'default'}", ("float32",),
                 samples=_interp_samples(2, _vec, aa=True))(_antialiased(_cubic))


# --- grid sampling ---------------------------------------------------------------------------

_MODES = {0: "bilinear", 1: "nearest", 2: "bicubic"}
_PADDINGS = {0: "zeros", 1: "border", 2: "reflection"}


def _grid_check(node):
    a = node.args
    mode, padding = (a[2], a[3]) if len(a) >= 4 else (None, None)
    if mode not in _MODES:
        return f"grid sampler interpolation mode {mode!r} (takes 0 bilinear, 1 nearest, 2 bicubic)"
    if padding not in _PADDINGS:
        return f"grid sampler padding mode {padding!r} (takes 0 zeros, 1 border, 2 reflection)"
    if node.op == "aten.grid_sampler_3d.default" and mode == 2:
        return "grid_sampler_3d has no bicubic mode (torch refuses it too)"
    return None


def _unnormalize(k, c: str, size: int, align_corners: bool) -> str:
    """torch's grid unnormalization as its CPU kernel computes it: ``(c + 1) * f (- 0.5)``."""
    if align_corners:
        return k.let(f"({c} + 1.0) * {lit((size - 1) / 2, 'f32')}", "f32")
    return k.let(f"({c} + 1.0) * {lit(size / 2, 'f32')} - 0.5", "f32")


def _pad_coordinate(k, c: str, size: int, padding: int, align_corners: bool) -> str:
    """torch's ``compute_coordinates``: clip (border) or reflect then clip (reflection)."""
    if padding == 0:
        return c
    if padding == 2:
        low, span = (0.0, size - 1.0) if align_corners else (-0.5, float(size))
        if span <= 0:
            c = "0.0"
        else:
            a = k.let(f"abs({c} - {lit(low, 'f32')})", "f32")
            period = lit(2 * span, "f32")
            extra = k.let(f"{a} - {period} * floor({a} / {period})", "f32")
            c = k.let(f"min({extra}, {period} - {extra}) + {lit(low, 'f32')}", "f32")
    return k.let(f"min(max({c}, 0.0), {lit(size - 1, 'f32')})", "f32")


def _grid_sampler(pb, node, x, grid, interpolation_mode, padding_mode, align_corners):
    meta = node.outputs[0]
    nsp = 2 if node.op == "aten.grid_sampler_2d.default" else 3
    n_batch = x.shape[0] if len(x.shape) == nsp + 2 else None
    if n_batch is None or tuple(grid.shape) != (n_batch, *meta.shape[2:], nsp) or \
            tuple(meta.shape[:2]) != tuple(x.shape[:2]) or len(meta.shape) != nsp + 2:
        raise ValueError(f"{node.op}: input {list(x.shape)}, grid {list(grid.shape)} and output {list(meta.shape)} "
                         "do not fit together")
    x = pb.plain(x)
    x, grid = pb.fit([x, grid], 1)
    sizes = list(x.shape[2:])  # (H, W) or (D, H, W); the grid's last axis holds (x, y[, z])

    def fn(k, idx):
        n, c, osp = idx[0], idx[1], list(idx[2:])
        coords = []
        for d in range(nsp):  # spatial dim d is grid component nsp - 1 - d
            g = cast(grid.read(k, [n] + osp + [str(nsp - 1 - d)]), grid.ty, "f32")
            coords.append(_unnormalize(k, g, sizes[d], align_corners))

        def value(ints):
            inside = " && ".join(f"{i} >= 0 && {i} < {s}" for i, s in zip(ints, sizes))
            safe = [k.let(f"clamp({i}, 0, {s - 1})", "i32") for i, s in zip(ints, sizes)]
            v = cast(x.read(k, [n, c] + safe), x.ty, "f32")
            return k.let(f"select(0.0, {v}, {inside})", "f32")

        if interpolation_mode == 2:  # bicubic: pad each tap's integer coordinate, not the point
            base = [k.let(f"floor({cd})", "f32") for cd in coords]
            coeffs = []
            for cd, b in zip(coords, base):
                t = k.let(f"{cd} - {b}", "f32")
                coeffs.append([k.let(_cubic2(f"({t} + 1.0)", -0.75), "f32"), k.let(_cubic1(t, -0.75), "f32"),
                               k.let(_cubic1(f"(1.0 - {t})", -0.75), "f32"),
                               k.let(_cubic2(f"(2.0 - {t})", -0.75), "f32")])

            def tap(d, j):
                p = _pad_coordinate(k, f"({base[d]} + {lit(j - 1, 'f32')})", sizes[d], padding_mode, align_corners)
                return k.let(f"i32({p})", "i32")
            rows = []
            for jy in range(4):
                iy = tap(0, jy)
                vals = [value([iy, tap(1, jx)]) for jx in range(4)]
                rows.append(k.let(" + ".join(f"{v} * {w}" for v, w in zip(vals, coeffs[1])), "f32"))
            e = " + ".join(f"{coeffs[0][j]} * {rows[j]}" for j in range(4))
            return round_low(k, e, meta.dtype)
        coords = [_pad_coordinate(k, cd, s, padding_mode, align_corners) for cd, s in zip(coords, sizes)]
        if interpolation_mode == 1:
            return round_low(k, value([k.let(f"i32(round({cd}))", "i32") for cd in coords]), meta.dtype)
        lows = [k.let(f"floor({cd})", "f32") for cd in coords]
        fracs = [k.let(f"{cd} - {lo}", "f32") for cd, lo in zip(coords, lows)]
        base = [k.let(f"i32({lo})", "i32") for lo in lows]
        terms = []
        for corner in range(2 ** nsp):
            bits = [(corner >> (nsp - 1 - d)) & 1 for d in range(nsp)]
            w = " * ".join(fracs[d] if b else f"(1.0 - {fracs[d]})" for d, b in enumerate(bits))
            v = value([f"({base[d]} + {b})" if b else base[d] for d, b in enumerate(bits)])
            terms.append(f"{v} * ({w})")
        return round_low(k, " + ".join(terms), meta.dtype)
    return [Custom(meta.shape, meta.dtype, [x, grid], fn, cost=80)]


def _grid(nsp: int, *shape, lo=-1.3, hi=1.3):
    """A sampling grid: points inside and outside [-1, 1], with the corners -1, 1 and the centre 0."""
    g = rand(*shape, nsp, lo=lo, hi=hi)
    g.view(-1)[:6] = torch.tensor([-1.0, 1.0, 0.0, 1.0, -1.0, 0.0])[:g.numel()]
    return g


def _grid_samples(nsp: int):
    def make():
        modes = [0, 1] + ([2] if nsp == 2 else [])
        cases = []
        for mode in modes:
            for padding in (0, 1, 2):
                for ac in (False, True):
                    sp = (5, 7) if nsp == 2 else (3, 4, 5)
                    x = typed((1, 2) + sp, "float32") if ac else rand(2, 3, *sp)
                    grid = _grid(nsp, x.shape[0], *([4, 6] if nsp == 2 else [2, 3, 4]))
                    cases.append(((x, grid, mode, padding, ac), {}))
        big = (rand(2, 4, 12, 10), _grid(2, 2, 9, 11)) if nsp == 2 else (rand(1, 3, 6, 5, 7), _grid(3, 1, 5, 6, 4))
        cases.insert(0, ((*big, 0, 0, False), {}))
        return cases
    return make


register("aten.grid_sampler_2d.default", ALL_FLOAT, samples=_grid_samples(2), check=_grid_check)(_grid_sampler)
register("aten.grid_sampler_3d.default", ALL_FLOAT, samples=_grid_samples(3), check=_grid_check)(_grid_sampler)


# --- padding -------------------------------------------------------------------------------

def _pad(mode: str):
    """Reflection (mirror without repeating the edge), replication (clamp) and circular (wrap)
    padding of the last ``len(pad) // 2`` dims; negative pads crop."""
    def lower(pb, node, x, padding):
        meta = node.outputs[0]
        nd = len(x.shape)
        npad = len(padding) // 2
        lows = {nd - 1 - i: int(padding[2 * i]) for i in range(npad)}
        highs = {nd - 1 - i: int(padding[2 * i + 1]) for i in range(npad)}
        for d in range(nd):
            size, lo, hi = x.shape[d], lows.get(d, 0), highs.get(d, 0)
            fits = len(meta.shape) == nd and meta.shape[d] == size + lo + hi and meta.shape[d] >= 1
            if mode == "reflect":
                fits = fits and lo < size and hi < size
            if mode == "circular":
                fits = fits and size - max(0, -lo) - max(0, -hi) >= 1
            if npad > nd or not fits:
                raise ValueError(f"{node.op}: padding {list(padding)} does not fit input {list(x.shape)} "
                                 f"and output {list(meta.shape)}")

        def source(k, d, o):
            if d not in lows:
                return o
            size = x.shape[d]
            i = k.let(f"{o} - {lows[d]}", "i32") if lows[d] else o
            if mode == "replicate":
                return k.let(f"clamp({i}, 0, {size - 1})", "i32")
            if mode == "circular":  # torch crops first, then wraps around what is left
                start, kept = max(0, -lows[d]), size - max(0, -lows[d]) - max(0, -highs[d])
                i = k.let(f"{o} - {max(lows[d], 0)}", "i32")
                return k.let(f"{start} + ({i} + {kept * (1 + max(lows[d], 0) // kept)}) % {kept}", "i32")
            r = k.let(f"select({i}, -{i}, {i} < 0)", "i32")
            return k.let(f"select({r}, {2 * (size - 1)} - {r}, {r} >= {size})", "i32")
        return [Remap(x, meta.shape, lambda k, idx: [source(k, d, o) for d, o in enumerate(idx)])]
    return lower


def _pad_samples(nsp: int, mode: str):
    def make():
        sp = {1: (9,), 2: (6, 7), 3: (4, 5, 6)}[nsp]
        big = [min(s - 1, 3) for s in sp]
        pads = [p for s in big for p in (s, max(s - 1, 0))][::-1]  # wide, uneven, on every padded dim
        crop = [(-1 if i % 2 == 0 else 2) for i in range(2 * nsp)]
        cases = [((typed((2, 3) + sp, "float32"), pads), {}),
                 ((rand(3, *sp), [1] * (2 * nsp)), {}),  # no batch dim
                 ((rand(1, 2, *sp), crop), {})]
        for dtype in ALL_INT:
            cases.append(((typed((1, 2) + sp, dtype, lo=-100, hi=100), pads), {}))
        if mode == "circular":
            full = [s for s in sp[::-1] for _ in range(2)]  # pad by a whole period
            cases.append(((rand(1, 2, *sp), full), {}))
            cases.append(((typed((2, 3) + sp, "bool"), pads), {}))
        return cases
    return make


for _n in (1, 2, 3):
    register(f"aten.reflection_pad{_n}d.default", PADDABLE, samples=_pad_samples(_n, "reflect"))(_pad("reflect"))
    register(f"aten.replication_pad{_n}d.default", PADDABLE, samples=_pad_samples(_n, "replicate"))(_pad("replicate"))


def _circular_samples():
    return [c for n in (1, 2, 3) for c in _pad_samples(n, "circular")()]


register("aten._pad_circular.default", PADDABLE + ("bool",), samples=_circular_samples)(_pad("circular"))

__all__ = ["scale_value", "area_scale"]
