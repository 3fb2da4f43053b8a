"""Matrix products: mm, bmm, addmm, baddbmm.

A register-blocked kernel: each thread computes a 4x4 output tile, stepping K by 4 with
vec4 loads where the operand is contiguous and aligned along the loaded axis. No workgroup
shared memory: barriers are expensive on CPU adapters (PLATFORM_NOTES: lavapipe 16x16
shared tiles 0.16 GFLOP/s vs 4x4 register blocking 1.09). Operands are strided buffer views,
so transposed weights (``t``, ``permute``) are read in place.
"""

from __future__ import annotations

from tapml.platforms.wgsl import views
from tapml.platforms.wgsl.codegen import BufferView, Value, cast, lit, store
from tapml.platforms.wgsl.registry import ALL_FLOAT, rand, register

TILE = 4
WG = (8, 8, 1)  # 8x8 threads of 4x4 tiles; measured best overall on lavapipe among 4..32-wide shapes


def _vec_ok(v: BufferView, axis: int, size: int) -> bool:
    """Whether 4 consecutive elements along ``axis`` can be one aligned vec4 load."""
    others = [s for i, s in enumerate(v.strides) if i != axis and v.shape[i] > 1]
    return (v.strides[axis] == 1 and size % 4 == 0 and v.offset % 4 == 0 and all(s % 4 == 0 for s in others)
            and v.buf.dtype in ("f32", "f16"))


def matmul(pb, name: str, a: Value, b: Value, meta, bias: Value | None = None, alpha=1, beta=1) -> BufferView:
    """out[z, m, n] = beta * bias[z, m, n] + alpha * sum_k a[z, m, k] * b[z, k, n]; ``a`` and
    ``b`` are 3-d (batch first), ``meta`` the output's (2-d or 3-d) meta."""
    a, b = pb.plain(a), pb.plain(b)
    Z, M, K = a.shape
    N = b.shape[2]
    out = pb.buffer("temp", meta)
    result = BufferView.whole(out, meta)
    if M * N * Z == 0:
        return result
    if bias is not None:
        bias = views.expand_to(bias, (Z, M, N))
        (bias,) = pb.fit([bias], 3)
    k = pb.kernel(name)
    o = k.bind(out, "read_write")
    vec_a = _vec_ok(a, 2, K)
    vec_bn = _vec_ok(b, 2, N)
    vec_bk = not vec_bn and _vec_ok(b, 1, K)
    A = k.bind(a.buf, elem=f"vec4<{a.buf.dtype}>" if vec_a else None)
    B = k.bind(b.buf, elem=f"vec4<{b.buf.dtype}>" if (vec_bn or vec_bk) else None)
    sab, sam, sak = a.strides
    sbb, sbk, sbn = b.strides

    def f4(e, dt):
        return e if dt == "f32" else f"vec4<f32>({e})"

    def f1(e, dt):
        return e if dt == "f32" else f"f32({e})"

    k.emit("let z: i32 = i32(gid.z);")
    k.emit(f"let m0: i32 = i32(gid.y) * {TILE};")
    k.emit(f"let n0: i32 = i32(gid.x) * {TILE};")
    k.emit(f"if (m0 >= {M} || n0 >= {N}) {{ return; }}")
    for i in range(TILE):  # rows past the end are clamped for loads; their results are dropped
        k.emit(f"let ra{i}: i32 = {a.offset} + z * {sab} + min(m0 + {i}, {M - 1}) * {sam};")
    if vec_bn:
        k.emit(f"let cb: i32 = {b.offset} + z * {sbb} + min(n0, {N - 4});")
    else:
        for j in range(TILE):
            k.emit(f"let cb{j}: i32 = {b.offset} + z * {sbb} + min(n0 + {j}, {N - 1}) * {sbn};")
    for i in range(TILE):
        k.emit(f"var acc{i}: vec4<f32> = vec4<f32>(0.0);")
    k4 = K - K % 4
    if k4:
        k.emit(f"for (var k: i32 = 0; k < {k4}; k = k + 4) {{")
        for i in range(TILE):
            if vec_a:
                k.emit(f"  let a{i} = {f4(f'{A}[(ra{i} + k) / 4]', a.buf.dtype)};")
            else:
                parts = ", ".join(f1(f"{A}[ra{i} + (k + {q}) * {sak}]", a.buf.dtype) for q in range(4))
                k.emit(f"  let a{i} = vec4<f32>({parts});")
        if vec_bk:
            for j in range(TILE):
                k.emit(f"  let b{j} = {f4(f'{B}[(cb{j} + k) / 4]', b.buf.dtype)};")
            for i in range(TILE):
                k.emit(f"  acc{i} = acc{i} + vec4<f32>(dot(a{i}, b0), dot(a{i}, b1), dot(a{i}, b2), dot(a{i}, b3));")
        else:
            for q in range(4):
                if vec_bn:
                    k.emit(f"  let b{q} = {f4(f'{B}[(cb + (k + {q}) * {sbk}) / 4]', b.buf.dtype)};")
                else:
                    parts = ", ".join(f1(f"{B}[cb{j} + (k + {q}) * {sbk}]", b.buf.dtype) for j in range(4))
                    k.emit(f"  let b{q} = vec4<f32>({parts});")
            for i in range(TILE):
                k.emit(f"  acc{i} = acc{i} + a{i}.x * b0 + a{i}.y * b1 + a{i}.z * b2 + a{i}.w * b3;")
        k.emit("}")
    if K % 4:
        k.emit(f"for (var k: i32 = {k4}; k < {K}; k = k + 1) {{")
        if vec_bn:
            bq = f4(f"{B}[(cb + k * {sbk}) / 4]", b.buf.dtype)
        else:
            bq = "vec4<f32>(" + ", ".join(f1(f"{B}[cb{j} + k * {sbk}]", b.buf.dtype) for j in range(4)) + ")"
        k.emit(f"  let bk = {bq};")
        for i in range(TILE):
            k.emit(f"  acc{i} = acc{i} + {f1(f'{A}[ra{i} + k * {sak}]', a.buf.dtype)} * bk;")
        k.emit("}")
    comps = "xyzw"
    for i in range(TILE):
        k.open(f"if (m0 + {i} < {M})")
        for j in range(TILE):
            k.open(f"if (n0 + {j} < {N})")
            e = f"acc{i}.{comps[j]}"
            if alpha != 1:
                e = f"({lit(alpha, 'f32')} * {e})"
            if bias is not None and beta != 0:
                bv = cast(bias.read(k, ["z", k.let(f"m0 + {i}", "i32"), k.let(f"n0 + {j}", "i32")]), bias.ty, "f32")
                e = f"({e} + {bv})" if beta == 1 else f"({e} + {lit(beta, 'f32')} * {bv})"
            k.emit(f"{o}[(z * {M} + m0 + {i}) * {N} + n0 + {j}] = {store(e, 'f32', out.dtype)};")
            k.close()
        k.close()
    groups = (-(-N // (TILE * WG[0])), -(-M // (TILE * WG[1])), Z)
    pb.add(k.finish(0, workgroup=WG, groups=groups))
    return result


def _mm_samples():
    return [((rand(5, 7), rand(7, 3)), {}), ((rand(16, 64), rand(64, 32)), {}), ((rand(9, 12), rand(20, 12).t()), {}),
            ((rand(33, 8).t(), rand(33, 10)), {})]


@register("aten.mm.default", ALL_FLOAT, samples=_mm_samples)
def mm(pb, node, a, b):
    return [matmul(pb, "mm", views.unsqueeze(a, 0), views.unsqueeze(b, 0), node.outputs[0])]


@register("aten.bmm.default", ALL_FLOAT,
          samples=lambda: [((rand(2, 5, 7), rand(2, 7, 3)), {}), ((rand(4, 16, 16), rand(4, 16, 16)), {}),
                           ((rand(3, 8, 6), rand(3, 5, 6).transpose(1, 2)), {})])
def bmm(pb, node, a, b):
    return [matmul(pb, "bmm", a, b, node.outputs[0])]


@register("aten.addmm.default", ALL_FLOAT,
          samples=lambda: [((rand(3), rand(5, 7), rand(7, 3)), {}), ((rand(64), rand(16, 32), rand(64, 32).t()), {}),
                           ((rand(5, 1), rand(5, 4), rand(4, 6)), {"beta": 0.5, "alpha": 2.0})])
def addmm(pb, node, bias, a, b, beta=1, alpha=1):
    return [matmul(pb, "addmm", views.unsqueeze(a, 0), views.unsqueeze(b, 0), node.outputs[0],
                   bias=views.unsqueeze(views.expand_to(bias, node.outputs[0].shape), 0), alpha=alpha, beta=beta)]


@register("aten.baddbmm.default", ALL_FLOAT,
          samples=lambda: [((rand(2, 5, 3), rand(2, 5, 7), rand(2, 7, 3)), {"beta": 0.5, "alpha": 0.25})])
def baddbmm(pb, node, bias, a, b, beta=1, alpha=1):
    return [matmul(pb, "baddbmm", a, b, node.outputs[0], bias=views.expand_to(bias, node.outputs[0].shape),
                   alpha=alpha, beta=beta)]
