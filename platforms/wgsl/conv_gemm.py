"""Convolution as an implicit GEMM: the product of the weights (``Cout/groups x K``, K =
``Cin/groups x taps``) by the columns of im2col, whose elements are read from the input where
they are used, so no im2col buffer is ever written.

Each invocation computes a register tile: up to 16 output channels (:func:`tile_rows`) by
:data:`TILE_N` output positions (vec4 accumulators), stepping K one (channel, tap) term at a time:
per term it loads the tile's weights and TILE_N inputs for rows x TILE_N multiply-adds, where the
direct convolution (one output per invocation) loads two values per multiply-add. 16 x 16 ran a
ResNet 3x3 layer 9x faster than the direct kernel on lavapipe (8 x 16: 7x; 4 x 16: 4.5x), and fewer
rows suit groups of few channels (benchmarks/NOTES.md).

A 1x1 convolution with stride 1, no padding and one group is a plain batched matrix product of
the weights by the input viewed as ``[B, Cin, positions]``: it runs as :func:`matmul.product`,
with the tile sizes tuned for the device. Input positions in the
padding read a clamped in-bounds element and count as zero. float32 sums, whatever the storage
dtype (float16 and bfloat16 are read and written as the buffers hold them).

Used by :func:`tapml.platforms.wgsl.nn.convolution` for plain (not transposed) float
convolutions with enough output tiles to keep the device busy and a K short enough for one
invocation's loop (:func:`fits`); the rest keep the direct kernel, which splits long sums.
"""

from __future__ import annotations

import math

from tapml.platforms.wgsl.codegen import WORKGROUP, BufferView, cast

#: Output positions per invocation; output channels per invocation are :func:`tile_rows`.
TILE_N = 16
#: At most this many K terms per invocation (lavapipe ends an invocation's loops after 65 535
#: iterations; the direct kernel splits longer sums across invocations).
MAX_K = 16384
#: Fewer output tiles than this leave most of a CPU adapter's lanes idle: the direct kernel,
#: one invocation per output (and per chunk of a long sum), has more parallel work.
MIN_TILES = 64
_FLOATS = ("float32", "float16", "bfloat16")


def tile_rows(cog: int) -> int:
    """Output channels per invocation for groups of ``cog`` output channels."""
    return 16 if cog >= 16 else 8 if cog >= 8 else 4


def fits(x, w, meta, transposed: bool, groups: int) -> bool:
    """Whether the implicit GEMM takes this convolution."""
    if transposed or meta.dtype not in _FLOATS or x.dtype not in _FLOATS or w.dtype not in _FLOATS:
        return False
    cog, cig = meta.shape[1] // groups, x.shape[1] // groups
    positions = math.prod(meta.shape[2:])
    k = cig * math.prod(w.shape[2:])
    tiles = meta.shape[0] * groups * -(-cog // tile_rows(cog)) * -(-positions // TILE_N)
    return 0 < k <= MAX_K and tiles >= MIN_TILES and cog >= 4 and positions >= TILE_N


def _pointwise(pb, name: str, x: BufferView, w: BufferView, bias, meta) -> BufferView:
    """A 1x1 convolution (stride 1, no padding, one group) as ``w @ x[b]`` for each batch ``b``."""
    from tapml.graph import TensorMeta
    from tapml.platforms.wgsl import views
    from tapml.platforms.wgsl.matmul import product
    B, Cout, Cin = meta.shape[0], meta.shape[1], x.shape[1]
    P = math.prod(meta.shape[2:])
    a = views.expand_to(views.reshape(w, (1, Cout, Cin)), (B, Cout, Cin))
    b = views.reshape(x, (B, Cin, P))
    if bias is not None:
        bias = views.expand_to(views.reshape(bias, (1, Cout, 1)), (B, Cout, P))
    result = product(pb, name, a, b, TensorMeta((B, Cout, P), meta.dtype), bias=bias)
    return views.reshape(result, meta.shape)


def conv_gemm(pb, name: str, x: BufferView, w: BufferView, bias, meta, stride, padding, dilation,
              groups: int) -> BufferView:
    """The convolution ``out = conv(x, w) + bias`` of ``meta``'s shape (plain buffer operands
    ``x``: ``[B, Cin, *in]``, ``w``: ``[Cout, Cin/groups, *kernel]``, lists per spatial dim);
    returns its value (a view of the output buffer)."""
    nsp = len(x.shape) - 2
    B, Cout = meta.shape[0], meta.shape[1]
    cig, cog = x.shape[1] // groups, Cout // groups
    ksz, isz, osz = list(w.shape[2:]), list(x.shape[2:]), list(meta.shape[2:])
    taps, P = math.prod(ksz), math.prod(osz)
    if taps == 1 and groups == 1 and all(v == 1 for v in stride) and not any(padding):
        return _pointwise(pb, name, x, w, bias, meta)
    tm = tile_rows(cog)
    out = pb.buffer("temp", meta)
    k = pb.kernel(name + "_gemm")
    col_tiles, row_tiles = -(-P // TILE_N), -(-cog // tm)
    gx = -(-col_tiles // WORKGROUP)
    k.emit("let col: i32 = i32(gid.x);")
    k.emit("let bg: i32 = i32(gid.z);")  # batch x group
    k.emit(f"let b: i32 = bg / {groups};")
    k.emit(f"let g: i32 = bg % {groups};")
    k.emit(f"let m0: i32 = i32(gid.y) * {tm};")
    k.emit(f"let p0: i32 = col * {TILE_N};")
    k.emit(f"if (col >= {col_tiles}) {{ return; }}")
    # per output position of the tile: where its window starts in the input (clamped past the end)
    for j in range(TILE_N):
        o = k.unravel(k.let(f"min(p0 + {j}, {P - 1})", "i32"), osz)
        for d in range(nsp):
            k.emit(f"let s{j}_{d}: i32 = {o[d]} * {stride[d]} - {padding[d]};")
    rows = [k.let(f"g * {cog} + min(m0 + {i}, {cog - 1})", "i32") for i in range(tm)]
    for i in range(tm):
        for jb in range(TILE_N // 4):
            k.emit(f"var acc{i}_{jb}: vec4<f32> = vec4<f32>(0.0);")
    k.loop("ci", cig)
    k.emit(f"let c: i32 = g * {cig} + ci;")
    k.loop("t", taps)
    tap = k.unravel("t", ksz)
    loads = []
    for j in range(TILE_N):
        inside, at = [], []
        for d in range(nsp):
            pos = k.let(f"s{j}_{d} + {tap[d]} * {dilation[d]}", "i32")
            inside.append(f"({pos} >= 0) & ({pos} < {isz[d]})")
            at.append(k.let(f"clamp({pos}, 0, {isz[d] - 1})", "i32"))
        value = cast(x.read(k, ["b", "c", *at]), x.ty, "f32")
        # `&`, not `&&`: Chromium's GPU process (Tint on SwiftShader) crashed on this kernel with
        # short-circuit conditions in select (measured on Chromium 156; benchmarks/NOTES.md)
        loads.append(k.let(f"select(0.0, {value}, {' & '.join(inside)})", "f32"))
    cols = [f"vec4<f32>({', '.join(loads[4 * jb:4 * jb + 4])})" for jb in range(TILE_N // 4)]
    col_vecs = [k.let(c, "vec4<f32>") for c in cols]
    for i in range(tm):
        wv = k.let(cast(w.read(k, [rows[i], "ci", *tap]), w.ty, "f32"), "f32")
        for jb in range(TILE_N // 4):
            k.emit(f"acc{i}_{jb} = acc{i}_{jb} + {wv} * {col_vecs[jb]};")
    k.close()
    k.close()
    for i in range(tm):
        for j in range(TILE_N):
            k.open(f"if (m0 + {i} < {cog} && p0 + {j} < {P})")
            oc = k.let(f"g * {cog} + m0 + {i}", "i32")
            e = f"acc{i}_{j // 4}.{'xyzw'[j % 4]}"
            if bias is not None:
                e = f"({e} + {cast(bias.read(k, [oc]), bias.ty, 'f32')})"
            k.write(out, f"(b * {Cout} + {oc}) * {P} + p0 + {j}", e, "f32")
            k.close()
    pb.add(k.finish(0, workgroup=(WORKGROUP, 1, 1), groups=(gx, row_tiles, B * groups)))
    return BufferView.whole(out, meta)


__all__ = ["conv_gemm", "fits", "tile_rows", "TILE_N", "MAX_K", "MIN_TILES"]
