"""Matrix products: mm, bmm, addmm, baddbmm.

A register-blocked kernel: each thread computes a TM x TN output tile (TN a multiple of 4,
held as vec4 accumulators), stepping K by 4 with vec4 loads where the operand is contiguous
and aligned along the loaded axis. No workgroup shared memory: barriers are expensive on CPU
adapters (PLATFORM_NOTES: lavapipe 16x16 shared tiles 0.16 GFLOP/s vs 4x4 register blocking
1.09). Operands are strided buffer views, so transposed weights (``t``, ``permute``) are read
in place.

On devices with the ``subgroup`` feature a variant stacks a workgroup's threads along M so
that B's tile is the same for all of them: each lane loads a share and ``subgroupBroadcast``
hands it around (on lavapipe every storage load is a per-lane loop, so fewer loads is what
counts). It assumes a subgroup size, checks it at run time (NaN outputs otherwise, never a
quiet error), and is only ever chosen by :func:`tune` after giving right results on the device.

Tile sizes are per device: :func:`tune` times a few candidates on the device and caches the
fastest in ``~/.cache/tapml/matmul-tiles.json`` (``$TAPML_CACHE_DIR`` overrides the folder),
keyed by backend and adapter; compilation only reads that file, so it needs no device, and
a device never tuned gets :data:`DEFAULT_TILES` (the best measured on lavapipe).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from tapml.graph import Node
from tapml.platforms.wgsl import views
from tapml.platforms.wgsl.codegen import (LANE_GROUP, LANE_ROW_K, LAZY_ROW_COST, MAIN, MAIN_WITH_GROUP_IDS,
                                          MAX_GROUPS, WORKGROUP, BufferView, Compute, ForcedSetting, Value, cast,
                                          combine_lanes, ctype, gemv_rows, lit, load_at, quarter, slow_wide_compiles,
                                          vec4_f32, vec4_ok)
from tapml.platforms.wgsl.norms import NormedRow
from tapml.platforms.wgsl.registry import ALL_INT, NUMERIC, edge_floats, edge_ints, rand, randint, register

#: (TM, TN, workgroup x, workgroup y, subgroup, K tile): rows and columns per thread, threads per
#: workgroup, 0 or the subgroup size S over which lanes share B's tile (subgroupBroadcast), and 0
#: or the depth of the K slices that the workgroup stages in workgroup memory.
SMALL_TILES = (4, 4, 8, 8, 0, 0)
DEFAULT_TILES = (8, 16, 8, 4, 0, 0)
CANDIDATES = [(4, 4, 8, 8, 0, 0), (8, 8, 8, 4, 0, 0), (16, 8, 8, 4, 0, 0), (8, 16, 8, 4, 0, 0), (16, 8, 16, 2, 0, 0),
              (8, 16, 16, 2, 0, 0), (16, 16, 8, 2, 0, 0)]
#: Tried only on devices with the ``subgroup`` feature; kept only where their results are right.
SUBGROUP_CANDIDATES = [(4, 32, 8, 1, 8, 0), (4, 32, 16, 1, 8, 0), (8, 32, 8, 1, 8, 0), (8, 32, 16, 1, 8, 0),
                       (8, 16, 8, 1, 8, 0), (8, 64, 8, 1, 8, 0)]
#: Tiles of A and B staged in workgroup memory (:func:`_workgroup_tiled`): what GPUs want; on
#: llvmpipe every workgroup-memory load is a per-lane loop like a storage load, so these lose
#: there (benchmarks/NOTES.md) and the tuner keeps the register tiles.
WORKGROUP_CANDIDATES = [(4, 4, 16, 16, 0, 16), (8, 8, 8, 8, 0, 16), (4, 8, 16, 8, 0, 16), (8, 8, 16, 16, 0, 8)]
#: The workgroup memory every WebGPU device offers (maxComputeWorkgroupStorageSize's default).
WORKGROUP_BYTES = 16384
#: Outputs with fewer rows or columns than this use SMALL_TILES (more threads for small work).
LARGE = 64
_CACHE: dict = {}


def cache_path() -> Path:
    """Where tuned tile sizes are kept."""
    base = os.environ.get("TAPML_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "tapml")
    return Path(base) / "matmul-tiles.json"


def device_key(caps: dict) -> str:
    return f"{caps.get('backend', '')}|{caps.get('adapter', '')}"


def _read_cache() -> dict:
    path = cache_path()
    try:
        stamp = path.stat().st_mtime_ns
    except OSError:
        return {}
    if _CACHE.get("stamp") != (str(path), stamp):
        try:
            data = json.loads(path.read_text())
            devices = data.get("devices", {}) if isinstance(data, dict) else {}
        except (OSError, ValueError):
            devices = {}
        _CACHE.update(stamp=(str(path), stamp), devices=devices)
    return _CACHE["devices"]


def is_tuned(caps: dict) -> bool:
    """Whether the tile cache holds a choice for the device with ``caps`` (:func:`tune` made one)."""
    return device_key(caps) in _read_cache()


def full_tiles(tiles) -> tuple[int, ...]:
    """``tiles`` with the fields an older cache entry lacks (subgroup, K tile) as 0."""
    tiles = tuple(tiles)
    return tiles + (0,) * (6 - len(tiles))


#: Forced tiles (the tuner compiles one graph under each candidate) and a forced GEMV shape.
_TILES = ForcedSetting("tiles", prepare=full_tiles)
_GEMV_SHAPE = ForcedSetting("GEMV shape", ("lane", "split"))


def tiles_label(tiles) -> str:
    """``(8, 16, 8, 4, 0, 0)`` -> ``"8x16/8x4"``; subgroup variants end in ``"/sg8"``, workgroup-
    memory ones in ``"/wm16"`` (the K tile)."""
    tm, tn, wx, wy, sg, bk = full_tiles(tiles)
    return f"{tm}x{tn}/{wx}x{wy}" + (f"/sg{sg}" if sg else "") + (f"/wm{bk}" if bk else "")


def workgroup_span(tiles) -> tuple[int, int]:
    """Output rows and columns one workgroup of ``tiles`` covers (a subgroup variant stacks its
    lanes along the rows)."""
    tm, tn, wx, wy, sg, _ = full_tiles(tiles)
    return (tm * wx, tn) if sg else (tm * wy, tn * wx)


def tiles_for(caps: dict, m: int, n: int) -> tuple[int, int, int, int, int, int]:
    """Tile sizes for an m x n output on a device with ``caps``: the tuned choice, or where one
    of its workgroups would cover more rows or columns than the output has (a linear over 64
    tokens under tiles tuned on 512 x 512), the fastest tuned candidate whose workgroup fits."""
    if _TILES.value is not None:
        return _TILES.value
    if m < LARGE or n < LARGE:
        return SMALL_TILES
    entry = _read_cache().get(device_key(caps or {}))
    known = {tuple(c): c for c in CANDIDATES + SUBGROUP_CANDIDATES + WORKGROUP_CANDIDATES}
    tiles = entry.get("tiles") if isinstance(entry, dict) else None
    if not (isinstance(tiles, list) and 5 <= len(tiles) <= 6 and all(type(t) is int for t in tiles)
            and full_tiles(tiles) in known):
        return DEFAULT_TILES
    best = full_tiles(tiles)
    rows, cols = workgroup_span(best)
    if rows <= m and cols <= n:
        return best
    table = entry.get("gflops")
    timed = {tiles_label(c): c for c in known} if isinstance(table, dict) else {}
    ranked = sorted((c for label, c in timed.items() if type(table.get(label)) in (int, float)),
                    key=lambda c: -table[tiles_label(c)])
    for c in ranked:
        rows, cols = workgroup_span(c)
        if rows <= m and cols <= n:
            return c
    return best


def tiles_state(caps: dict) -> list:
    """What the tile choice for a device with ``caps`` depends on besides the graph and the forced
    settings (:func:`codegen.forced_state`): the tuned entry for the device. A compiled program is
    reused only while this is unchanged."""
    entry = _read_cache().get(device_key(caps or {}))
    return [entry.get("tiles"), entry.get("gflops")] if isinstance(entry, dict) else [None]


def forced_tiles(tiles: tuple[int, ...]):
    """Compile every matmul with ``tiles`` inside the block (for tuning)."""
    return _TILES.forced(tiles)


def forced_gemv(shape: str):
    """Compile every GEMV inside the block with one lane a column group (``"lane"``) or with
    ``GEMV_LANES`` lanes splitting K (``"split"``), whatever the device (for tests and probes)."""
    return _GEMV_SHAPE.forced(shape)


def tune(platform, n: int = 512, repeat: int = 3, candidates=None) -> dict:
    """Time each candidate tile shape on ``platform`` (an ``n`` x ``n`` x ``n`` mm), keep the
    fastest correct one in the cache file for this device, and return
    ``{"device", "tiles", "gflops": {"TMxTN/WXxWY": GFLOP/s}}``."""
    import torch

    from tapml.graph import Graph, Node, TensorMeta
    meta = TensorMeta((n, n), "float32")
    graph = Graph([("a", meta), ("b", meta)], [Node("mm", "aten.mm.default", [{"ref": "a"}, {"ref": "b"}], {}, [meta])],
                  ["mm"])
    gen = torch.Generator().manual_seed(0)
    a, b = torch.rand(n, n, generator=gen), torch.rand(n, n, generator=gen)
    expected = a @ b
    results = {}
    if candidates is None:
        candidates = CANDIDATES + WORKGROUP_CANDIDATES + \
            (SUBGROUP_CANDIDATES if "subgroup" in platform.caps().get("features", []) else [])
    for tiles in map(full_tiles, candidates):
        with forced_tiles(tiles):
            program = platform.compile(graph)
        got = platform.run(program, [a, b])[0]
        if not torch.allclose(got, expected, rtol=1e-3, atol=1e-3):
            continue
        results[tuple(tiles)] = 2 * n ** 3 / platform.benchmark(program, [a, b], repeat=repeat) / 1e9
    if not results:
        raise RuntimeError("no matmul tile candidate gave correct results")
    best = max(results, key=results.get)
    key = device_key(platform.caps())
    path = cache_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        data = json.loads(path.read_text())
        if not isinstance(data, dict) or not isinstance(data.get("devices"), dict):
            data = {}
    except (OSError, ValueError):
        data = {}
    data = {"format": 1, "devices": {**data.get("devices", {}), key: {"tiles": list(best), "n": n,
            "gflops": {tiles_label(t): round(g, 3) for t, g in results.items()}}}}
    from tapml.io import write_json_atomic
    write_json_atomic(path, data)
    return {"device": key, "tiles": list(best), "label": tiles_label(best), "best_gflops": round(results[best], 3),
            **data["devices"][key]}


def wrap_int(expr: str, dtype: str) -> str:
    """The i32 expression ``expr`` wrapped to the range of the integer ``dtype`` (two's
    complement, as torch's integer arithmetic wraps): int8, uint8 and int16 results live in i32
    words, so a value past their range must be brought back before another kernel reads it."""
    if dtype == "int8":
        return f"(({expr}) << 24u) >> 24u"
    if dtype == "int16":
        return f"(({expr}) << 16u) >> 16u"
    if dtype == "uint8":
        return f"(({expr}) & 255)"
    return expr


def _operands(pb, a: Value, b: Value, meta, bias: Value | None, plain_a: bool = True):
    """A matrix product's plain 3-d operands (``a`` as it is unless ``plain_a``), its bias
    expanded to the output, the output buffer and its view, and the sizes ``(Z, M, K, N)``."""
    a, b = pb.plain(a) if plain_a else a, pb.plain(b)
    Z, M, K = a.shape
    N = b.shape[2]
    out = pb.buffer("temp", meta)
    if bias is not None and M * N * Z:
        bias = views.expand_to(bias, (Z, M, N))
        (bias,) = pb.fit([bias], 3)
    return a, b, bias, out, BufferView.whole(out, meta), (Z, M, K, N)


def int_matmul(pb, name: str, a: Value, b: Value, meta, bias: Value | None = None, alpha=1, beta=1) -> BufferView:
    """:func:`matmul` for integer dtypes: i32 products and sums that wrap as torch's do, so the
    result is exact modulo 2**32 (an int64 result outside i32 is the comparison's unsupported
    verdict), then wrapped to the output dtype. ``alpha`` and ``beta`` are truncated to
    integers, as torch does for integer tensors."""
    a, b, bias, out, result, (Z, M, K, N) = _operands(pb, a, b, meta, bias)
    alpha, beta = int(alpha), int(beta)
    if M * N * Z == 0:
        return result
    if K == 0:
        return _empty_product(pb, out, meta, (Z, M, N), bias if beta != 0 else None, beta)
    k = pb.kernel(name)
    z, m, n = k.unravel("n", (Z, M, N))
    acc = k.var("i32", "0", "acc")
    k.loop("kk", K)
    av = cast(a.read(k, [z, m, "kk"]), a.ty, "i32")
    bv = cast(b.read(k, [z, "kk", n]), b.ty, "i32")
    k.emit(f"{acc} = {acc} + {av} * {bv};")
    k.close()
    e = acc if alpha == 1 else f"{lit(alpha, 'i32')} * {acc}"
    if bias is not None and beta != 0:
        bv = cast(bias.read(k, [z, m, n]), bias.ty, "i32")
        e = f"{e} + {bv}" if beta == 1 else f"{e} + {lit(beta, 'i32')} * {bv}"
    k.write(out, "n", wrap_int(e, meta.dtype), "i32")
    pb.add(k.finish(Z * M * N))
    return result


def matmul(pb, name: str, a: Value, b: Value, meta, bias: Value | None = None, alpha=1, beta=1) -> BufferView:
    """out[z, m, n] = beta * bias[z, m, n] + alpha * sum_k a[z, m, k] * b[z, k, n]; ``a`` and
    ``b`` are 3-d (batch first), ``meta`` the output's (2-d or 3-d) meta."""
    Z, M, K = a.shape
    # a GEMV takes the product (wid.z: its batches and blocks of rows)
    few_rows = _TILES.value is None and gemv_rows(M, K, b.shape[2]) and Z * M <= MAX_GROUPS
    lazy_row = few_rows and not isinstance(a, BufferView) and a.dtype in ("float32", "float16") and \
        a.cost <= LAZY_ROW_COST and (not isinstance(a, NormedRow) or a.rows == Z * M)
    a, b, bias, out, result, (Z, M, K, N) = _operands(pb, a, b, meta, bias, plain_a=not lazy_row)
    if M * N * Z == 0:
        return result
    if K == 0:  # an empty sum: torch gives beta * bias (zeros without one); the operands are empty buffers
        return _empty_product(pb, out, meta, (Z, M, N), bias if beta != 0 else None, beta)
    vec_bn = vec4_ok(b, 2, N)
    vec_bk = not vec_bn and vec4_ok(b, 1, K)
    if lazy_row and vec_bk:  # the rows are computed where the GEMV reads them (a norm, SiLU x up)
        return _gemv(pb, name, a, b, out, result, (Z, M, K, N), bias, alpha, beta)
    a = pb.plain(a)
    vec_a = vec4_ok(a, 2, K)
    if few_rows and vec_a and vec_bk:
        return _gemv(pb, name, a, b, out, result, (Z, M, K, N), bias, alpha, beta)
    tiles = tiles_for(pb.caps, M, N)
    if tiles[5]:
        _workgroup_tiled(pb, name, a, b, bias, alpha, beta, out, (Z, M, K, N), tiles)
        return result
    k = pb.kernel(name)
    A = k.bind(a.buf, elem=f"vec4<{a.buf.dtype}>" if vec_a else None)
    B = k.bind(b.buf, elem=f"vec4<{b.buf.dtype}>" if (vec_bn or vec_bk) else None)
    sab, sam, sak = a.strides
    sbb, sbk, sbn = b.strides

    f4 = vec4_f32

    def f1(name, index, dt):
        return load_at(name, index, dt, "f32")

    tm, tn, wx, wy, sg, _ = tiles
    nb = tn // 4
    sg = sg if (sg and "subgroup" in pb.features and (vec_bn or vec_bk) and tn % sg == 0) else 0
    k.emit("let z: i32 = i32(gid.z);")
    if sg:
        # one workgroup = one column block; its threads stack along M (no early return: subgroup
        # operations need every lane of the subgroup active)
        wy = 1
        k.emit(f"let m0: i32 = (i32(gid.y) * {wx} + i32(gid.x) % {wx}) * {tm};")
        k.emit(f"let n0: i32 = (i32(gid.x) / {wx}) * {tn};")
        k.emit("let lane: i32 = i32(sg_id);")
    else:
        k.emit(f"let m0: i32 = i32(gid.y) * {tm};")
        k.emit(f"let n0: i32 = i32(gid.x) * {tn};")
        k.emit(f"if (m0 >= {M} || n0 >= {N}) {{ return; }}")
    # rows and columns past the end read past the operands (WGSL's bounds-checked loads give a value
    # of the buffer or zero); their results are dropped. Not clamped, a lane's rows and columns stay
    # one stride apart, which lavapipe loads faster (benchmarks/NOTES.md)
    for i in range(tm):
        k.emit(f"let ra{i}: i32 = {a.offset} + z * {sab} + (m0 + {i}) * {sam};")
    if vec_bn:
        for jb in range(nb):
            k.emit(f"let cb{jb}: i32 = {b.offset} + z * {sbb} + n0 + {4 * jb};")
    else:
        for j in range(tn):
            k.emit(f"let cb{j}: i32 = {b.offset} + z * {sbb} + (n0 + {j}) * {sbn};")
    for i in range(tm):
        for jb in range(nb):
            k.emit(f"var acc{i}_{jb}: vec4<f32> = vec4<f32>(0.0);")

    def b_row(jb: int, kk: str) -> str:
        """Columns 4jb..4jb+3 of B's row ``kk`` as a vec4<f32>."""
        if vec_bn:
            return f4(B[quarter(f"cb{jb} + ({kk}) * {sbk}")], b.buf.dtype)
        return "vec4<f32>(" + ", ".join(f1(B, f"cb{4 * jb + j} + ({kk}) * {sbk}", b.buf.dtype) for j in range(4)) + ")"

    # a weight split across binding windows (an LM head past the binding limit) is read window by
    # window where a workgroup's column block lies in one (read along K only: a block of a weight
    # read along N spans every window)
    block_columns = tn if sg else tn * wx  # a workgroup's columns
    runs = window_runs(B, b, N, block_columns, K, Z) if vec_bk else [(None, -(-N // block_columns))]
    windowed = len(runs) > 1  # the kernel branches on its workgroup's id

    def k_steps(weights) -> None:
        """The K loop in steps of 4, reading B through ``weights``."""
        k.open(f"for (var k: i32 = 0; k < {k4}; k = k + 4)", k4 // 4)
        for i in range(tm):
            if vec_a:
                k.emit(f"  let a{i} = {f4(A[quarter(f'ra{i} + k')], a.buf.dtype)};")
            else:
                parts = ", ".join(f1(A, f"ra{i} + (k + {q}) * {sak}", a.buf.dtype) for q in range(4))
                k.emit(f"  let a{i} = vec4<f32>({parts});")
        if sg:
            # the tile of B (tn vec4s per k step) is the same for every lane of the
            # workgroup; each lane loads tn/S of them and subgroupBroadcast shares them
            for r in range(tn // sg):
                k.emit(f"  let e{r}: i32 = lane + {sg * r};")
                if vec_bn:
                    addr = quarter(f"{b.offset} + z * {sbb} + n0 + 4 * (e{r} % {nb}) + (k + e{r} / {nb}) * {sbk}")
                else:
                    addr = quarter(f"{b.offset} + z * {sbb} + (n0 + e{r}) * {sbn} + k")
                k.emit(f"  let mine{r} = {f4(weights[addr], b.buf.dtype)};")
        if vec_bk:
            for j in range(tn):
                if sg:
                    k.emit(f"  let b{j} = subgroupBroadcast(mine{j // sg}, {j % sg}u);")
                else:
                    k.emit(f"  let b{j} = {f4(weights[quarter(f'cb{j} + k')], b.buf.dtype)};")
            for i in range(tm):
                for jb in range(nb):
                    dots = ", ".join(f"dot(a{i}, b{4 * jb + j})" for j in range(4))
                    k.emit(f"  acc{i}_{jb} = acc{i}_{jb} + vec4<f32>({dots});")
        else:
            for q in range(4):
                for jb in range(nb):
                    e = q * nb + jb
                    if sg:
                        k.emit(f"  let b{q}_{jb} = subgroupBroadcast(mine{e // sg}, {e % sg}u);")
                    else:
                        k.emit(f"  let b{q}_{jb} = {b_row(jb, f'k + {q}')};")
            for i in range(tm):
                for jb in range(nb):
                    terms = " + ".join(f"a{i}.{'xyzw'[q]} * b{q}_{jb}" for q in range(4))
                    k.emit(f"  acc{i}_{jb} = acc{i}_{jb} + {terms};")
        k.close()

    k4 = K - K % 4
    if k4:
        by_window(k, runs, B, "i32(wid.x)", k_steps)  # wid.x: the workgroup's column block
    if K % 4:
        k.open(f"for (var k: i32 = {k4}; k < {K}; k = k + 1)", K - k4)
        for jb in range(nb):
            k.emit(f"  let bk{jb} = {b_row(jb, 'k')};")
        for i in range(tm):
            k.emit(f"  let ak{i} = {f1(A, f'ra{i} + k * {sak}', a.buf.dtype)};")
            for jb in range(nb):
                k.emit(f"  acc{i}_{jb} = acc{i}_{jb} + ak{i} * bk{jb};")
        k.close()
    for i in range(tm):
        for j in range(tn):
            e = f"acc{i}_{j // 4}.{'xyzw'[j % 4]}"
            if sg:  # another subgroup size would have shared the wrong tiles: NaN, never a quiet error
                e = f"select(bitcast<f32>(0x7fc00000u), {e}, sg_size == {sg}u)"
            _write_tile(k, out, i, j, e, "m0", "n0", (M, N), bias, alpha, beta)
    if sg:
        groups = (-(-N // tn), -(-M // (tm * wx)), Z)
    else:
        groups = (-(-N // (tn * wx)), -(-M // (tm * wy)), Z)
    kern = k.finish(0, workgroup=(wx, wy, 1), groups=groups, group_ids=windowed)
    pb.add(with_subgroup_ids(kern, windowed) if sg else kern)
    return result


def _write_tile(k, out, i: int, j: int, e: str, rows: str, cols: str, sizes, bias, alpha, beta) -> None:
    """Write output element ``(rows + i, cols + j)`` of the current batch from the f32 sum ``e``
    (scaled by ``alpha``, plus ``beta * bias``) when it lies inside the ``(M, N)`` output."""
    M, N = sizes
    m, n = k.let(f"{rows} + {i}", "i32"), k.let(f"{cols} + {j}", "i32")
    k.open(f"if ({m} < {M} && {n} < {N})")
    if alpha != 1:
        e = f"({lit(alpha, 'f32')} * {e})"
    if bias is not None and beta != 0:
        bv = cast(bias.read(k, ["z", m, n]), bias.ty, "f32")
        e = f"({e} + {bv})" if beta == 1 else f"({e} + {lit(beta, 'f32')} * {bv})"
    k.write(out, f"(z * {M} + {m}) * {N} + {n}", e, "f32")
    k.close()


def _workgroup_tiled(pb, name: str, a: BufferView, b: BufferView, bias, alpha, beta, out, sizes, tiles) -> None:
    """:func:`matmul` with A and B staged in workgroup memory: for each slice of ``bk`` along K,
    the workgroup's lanes load the (BM x bk) tile of A and the (bk x BN) tile of B together (the
    lanes that load neighbouring elements are those whose addresses are neighbours, for either
    operand layout), wait at a barrier, and every lane computes its TM x TN register tile from
    the shared copies. Elements past K are zeros; rows and columns past the output are clamped
    for loads and dropped at the write. Control flow stays uniform around the barriers."""
    Z, M, K, N = sizes
    tm, tn, wx, wy, _, bk = tiles
    BM, BN, lanes = wy * tm, wx * tn, wx * wy
    if tm % 4 or tn % 4 or bk * (BM + BN) * 4 > WORKGROUP_BYTES:
        raise ValueError(f"workgroup-memory tiles {tiles_label(tiles)} need TM and TN multiples of 4 and "
                         f"{bk * (BM + BN) * 4} bytes of workgroup memory (at most {WORKGROUP_BYTES})")
    k = pb.kernel(name)
    A, B = k.bind(a.buf), k.bind(b.buf)
    sab, sam, sak = a.strides
    sbb, sbk, sbn = b.strides
    k.helpers["mm_tiles"] = (f"var<workgroup> tile_a: array<vec4<f32>, {bk * BM // 4}>;\n"
                             f"var<workgroup> tile_b: array<vec4<f32>, {bk * BN // 4}>;")
    k.emit("let z: i32 = i32(wid.z);")
    k.emit("let tx: i32 = i32(lid.x);")
    k.emit("let ty: i32 = i32(lid.y);")
    k.emit(f"let lane: i32 = ty * {wx} + tx;")
    k.emit(f"let m0: i32 = i32(wid.y) * {BM};")
    k.emit(f"let n0: i32 = i32(wid.x) * {BN};")
    for i in range(tm):
        for j in range(tn // 4):
            k.emit(f"var acc{i}_{j}: vec4<f32> = vec4<f32>(0.0);")

    def fill(tile: str, slots_per_k: int, along_k: bool, element) -> None:
        """Each lane stores its share of the ``bk x slots_per_k`` vec4 slots of ``tile``;
        ``element(kk, q)`` is the load of the slot's ``q``-th element at K index ``kk``."""
        slots = bk * slots_per_k
        for r in range(-(-slots // lanes)):
            k.open("")
            k.emit(f"let e: i32 = lane + {r * lanes};")
            if (r + 1) * lanes > slots:
                k.open(f"if (e < {slots})")
            if along_k:  # neighbouring lanes take neighbouring K indices
                k.emit(f"let kk: i32 = e % {bk};")
                k.emit(f"let q4: i32 = (e / {bk}) * 4;")
            else:
                k.emit(f"let kk: i32 = e / {slots_per_k};")
                k.emit(f"let q4: i32 = (e % {slots_per_k}) * 4;")
            k.emit(f"let kc: i32 = min(k0 + kk, {K - 1});")
            parts = ", ".join(element("kc", q) for q in range(4))
            k.emit(f"{tile}[kk * {slots_per_k} + q4 / 4] = select(vec4<f32>(0.0), vec4<f32>({parts}), k0 + kk < {K});")
            if (r + 1) * lanes > slots:
                k.close()
            k.close()

    k.open(f"for (var k0: i32 = 0; k0 < {K}; k0 = k0 + {bk})", -(-K // bk))
    fill("tile_a", BM // 4, sak == 1,
         lambda kk, q: load_at(A, f"{a.offset} + z * {sab} + min(m0 + q4 + {q}, {M - 1}) * {sam} + {kk} * {sak}",
                               a.buf.dtype, "f32"))
    fill("tile_b", BN // 4, sbn != 1,
         lambda kk, q: load_at(B, f"{b.offset} + z * {sbb} + {kk} * {sbk} + min(n0 + q4 + {q}, {N - 1}) * {sbn}",
                               b.buf.dtype, "f32"))
    k.emit("workgroupBarrier();")
    k.open(f"for (var kk: i32 = 0; kk < {bk}; kk = kk + 1)", bk)
    for i in range(tm // 4):
        k.emit(f"let a{i} = tile_a[kk * {BM // 4} + ty * {tm // 4} + {i}];")
    for j in range(tn // 4):  # a lane's columns are wx vec4s apart: neighbouring lanes, neighbouring slots
        k.emit(f"let b{j} = tile_b[kk * {BN // 4} + tx + {j * wx}];")
    for i in range(tm):
        for j in range(tn // 4):
            k.emit(f"acc{i}_{j} = acc{i}_{j} + a{i // 4}.{'xyzw'[i % 4]} * b{j};")
    k.close()
    k.emit("workgroupBarrier();")
    k.close()
    for i in range(tm):
        for j in range(tn // 4):
            for q in range(4):
                _write_tile(k, out, i, q, f"acc{i}_{j}.{'xyzw'[q]}", f"m0 + ty * {tm}", f"n0 + (tx + {j * wx}) * 4",
                            (M, N), bias, alpha, beta)
    pb.add(k.finish(0, workgroup=(wx, wy, 1), groups=(-(-N // BN), -(-M // BM), Z), group_ids=True))


#: Lanes that split K for one output column, and columns per lane group, of the one-row product
#: (:func:`_gemv`); 8 x 4 measured fastest on lavapipe (benchmarks/NOTES.md, "One-row products").
GEMV_LANES, GEMV_COLUMNS = 8, 4
# a computed row (codegen.LAZY_ROW_COST) is recomputed by at most this many column blocks (of
# GEMV_LANES x GEMV_COLUMNS columns): an LM head of 128 256 columns has 4008, each recomputing the
# row (a norm's squares: a barrier tree) cost more than its own kernel (NOTES.md)
COMPUTED_ROW_BLOCKS = 128
#: Rows a GEMV workgroup takes (codegen.gemv_rows): each load of the weight serves all of them.
GEMV_ROW_BLOCK = 8
#: The same, with 4 columns a lane, where wide kernels compile slowly (codegen.slow_wide_compiles):
#: tiny-llama's forward took 8.4 s to compile on llvmpipe's GL with 8 rows and 8 columns, 1.1 s with
#: 2 and 4 (benchmarks/NOTES.md).
NARROW_ROW_BLOCK = 2
#: Lanes of a SIMD group on the CPU adapters here (llvmpipe's 256-bit vectors of f32).
SIMD_GROUP = 8
#: Columns a lane takes in a GEMV of several rows on a CPU adapter, where the products are wide enough.
GEMV_ROW_COLUMNS = 8


def gemv_shape(caps: dict | None, normed: bool, K: int, N: int) -> tuple[int, int, int]:
    """``(lanes per column group, column groups per workgroup, columns per group)`` of a GEMV
    over ``K`` with ``N`` columns in all on a device with ``caps``: on a CPU adapter one lane a
    group of 4 columns (8 where there are enough to fill two workgroups: 8 share each load of the
    row), with no barrier, unless the row is normed and longer than ``LANE_ROW_K`` (each lane
    would add all its squares); elsewhere ``GEMV_LANES`` lanes split K (codegen.LANE_GROUP)."""
    one_lane = (caps or {}).get("cpu_adapter") and (not normed or K <= LANE_ROW_K)
    if _GEMV_SHAPE.value is not None:
        one_lane = _GEMV_SHAPE.value == "lane"
    if one_lane:
        return 1, LANE_GROUP, 8 if N >= 2 * LANE_GROUP * 8 else 4
    return GEMV_LANES, WORKGROUP // GEMV_LANES, GEMV_COLUMNS


@dataclass
class GemvPart:
    """One product of a GEMV kernel: ``out[z, 0, n] = beta * bias + alpha * sum_k a[z, 0, k] * b[z, k, n]``."""

    b: BufferView
    out: object  # the output buffer
    n: int
    bias: Value | None = None
    alpha: float = 1
    beta: float = 1


def _gemv(pb, name: str, a: BufferView, b: BufferView, out, result, sizes, bias, alpha, beta) -> BufferView:
    """:func:`matmul` of a few rows by a matrix read along K (decode's linears and LM head, a
    short prompt through a small model: ``codegen.gemv_rows``)."""
    Z, M, K, N = sizes
    gemv_kernel(pb, name, a, [GemvPart(b, out, N, bias, alpha, beta)], Z, K, M)
    return result


def gemv_kernel(pb, name: str, a: Value, parts: list[GemvPart], Z: int, K: int, M: int = 1) -> None:
    """One kernel for the products of the ``M`` rows of ``a`` (a ``Z, M, K`` value) by each part's
    matrix, read along K: the ``GEMV_LANES`` lanes of a column split K, so neighbouring lanes load
    neighbouring vec4s of the weight's row (the tiled kernel's lanes each stream rows of their
    own), and add their sums in workgroup memory; on a CPU adapter one lane takes all of K
    (:func:`gemv_shape`). A workgroup takes up to ``GEMV_ROW_BLOCK`` rows (``wid.z`` spans batches
    and row blocks), each weight load serving all of them. Each part has its own column blocks; a
    workgroup's block says which part it computes (uniform), so products that share their input
    (q, k and v; gate and up) run as one dispatch reading that input once per block. A computed
    ``a`` (not a buffer) is computed where it is read, four elements at a time, by each workgroup:
    past ``COMPUTED_ROW_BLOCKS`` column blocks (an LM head) it is written first instead."""
    if not isinstance(a, BufferView) and \
            sum(-(-part.n // (WORKGROUP // GEMV_LANES * GEMV_COLUMNS)) for part in parts) > COMPUTED_ROW_BLOCKS:
        a = pb.plain(a)
    plain, normed = isinstance(a, BufferView), isinstance(a, NormedRow)
    lanes, per_group, tn = gemv_shape(pb.caps, normed, K, sum(part.n for part in parts))
    if normed and M > 1 and lanes > 1 and gemv_shape(pb.caps, False, K, 1)[0] == 1:
        # rows too long for one lane's squares on a CPU adapter: a barrier tree for each row's
        # squares costs more there than the norm's own kernel, and the rows written take one lane
        a, plain, normed = pb.plain(a), True, False
        lanes, per_group, tn = gemv_shape(pb.caps, False, K, sum(part.n for part in parts))
    narrow = slow_wide_compiles(pb.caps)
    if lanes == 1 and M > 1 and max(part.n for part in parts) >= GEMV_ROW_COLUMNS * SIMD_GROUP and not narrow:
        tn = GEMV_ROW_COLUMNS  # each load of a row serves as many columns as the rows a weight load serves
    if lanes == 1:  # narrow products (a small model's k and v) fill a SIMD group or two, not 32 lanes
        widest = max(-(-part.n // tn) for part in parts)
        per_group = min(per_group, max(SIMD_GROUP, 1 << (widest - 1).bit_length()))
    row_blocks = -(-M // (NARROW_ROW_BLOCK if narrow else GEMV_ROW_BLOCK))
    rows = -(-M // row_blocks)  # 17 rows: three blocks of 6, not 8, 8 and 1
    starts, blocks = [], 0
    for part in parts:
        starts.append(blocks)
        blocks += -(-part.n // (per_group * tn))
    k = pb.kernel(name + "_gemv")
    A = k.bind(a.buf, elem=f"vec4<{a.buf.dtype}>") if plain else None
    gx = min(blocks, MAX_GROUPS)
    f4 = vec4_f32

    k.emit("let lane: i32 = i32(lid.x);" if lanes > 1 else "let lane: i32 = 0;")
    column = "i32(lid.y)" if lanes > 1 else "i32(lid.x)"
    if row_blocks == 1:
        k.emit("let z: i32 = i32(wid.z);\nlet mb: i32 = 0;")
    else:
        k.emit(f"let z: i32 = i32(wid.z) / {row_blocks};\nlet mb: i32 = i32(wid.z) % {row_blocks} * {rows};")
    # one lane a column group, all lanes of a workgroup on the same rows: where the device has
    # subgroups, lane r of each subgroup reads (or computes) row r and subgroupBroadcast shares it, so
    # a row costs each lane one load, not one per row; a subgroup smaller than the rows takes the
    # other branch, where every lane reads every row (no subgroup on the device: only that one)
    share = lanes == 1 and rows > 1 and "subgroup" in pb.features
    for r in range(rows):  # rows past the end read the last one; their sums are written nowhere
        k.emit(f"let m{r}: i32 = min(mb + {r}, {M - 1});")
        if plain:
            k.emit(f"let ra{r}: i32 = {a.offset} + z * {a.strides[0]} + m{r} * {a.strides[1]};")
    if share:
        k.emit(f"let m_mine: i32 = min(mb + min(i32(sg_id), {rows - 1}), {M - 1});")
        if plain:
            k.emit(f"let ra_mine: i32 = {a.offset} + z * {a.strides[0]} + m_mine * {a.strides[1]};")
    k.emit(f"let block: i32 = i32(wid.y) * {gx} + i32(wid.x);")
    scales, scale_mine = [], None
    if normed and share:  # the scale of this lane's row; the other branch computes every row's
        scale_mine = a.prologue(k, "0", 1, f"z * {M} + m_mine", tag="_mine")
    elif normed:  # each row's RMSNorm scale (row z * M + m of the norm's rows), computed by the workgroup's lanes
        slot = "0" if lanes == 1 else k.let(f"i32(lid.y) * {lanes} + lane", "i32")
        for r in range(rows):  # one lane: no barriers, each lane adds the whole row's squares itself
            scales.append(a.prologue(k, slot, lanes * per_group if lanes > 1 else 1, f"z * {M} + m{r}", tag=str(r)))
    for r in range(rows):
        for j in range(tn):
            k.emit(f"var acc{r}_{j}: vec4<f32> = vec4<f32>(0.0);")
    k.emit("var n0: i32 = 0;")
    for i, part in enumerate(parts):
        end = starts[i + 1] if i + 1 < len(parts) else blocks
        if len(parts) > 1:
            k.open(f"if (block >= {starts[i]} && block < {end})")
        B = k.bind(part.b.buf, elem=f"vec4<{part.b.buf.dtype}>")
        b = part.b
        k.emit(f"n0 = ((block - {starts[i]}) * {per_group} + {column}) * {tn};")
        # columns past the end (the last lanes of the last block) read past the weight, where WGSL's
        # bounds-checked loads give a value of the buffer or zero; their sums are written nowhere.
        # Not clamped, a lane's rows stay one stride apart, which lavapipe loads faster (NOTES)
        cb = [k.let(f"{b.offset} + z * {b.strides[0]} + (n0 + {j}) * {b.strides[2]}", "i32")
              for j in range(tn)]

        def row4(r: str, kk: str, scale: str | None, w4: str | None) -> str:
            """Elements ``kk .. kk + 3`` of row ``m{r}`` of ``a`` as a vec4<f32>."""
            if plain:
                return k.let(f4(A[quarter(f"ra{r} + {kk}")], a.buf.dtype), "vec4<f32>")
            if normed:
                return k.let(a.read4(k, kk, scale, f"z * {M} + m{r}", w4), "vec4<f32>")
            row = [cast(e, a.ty, "f32") for e in a.read4(k, ["z", f"m{r}", kk], 2)]
            return k.let(f"vec4<f32>({', '.join(row)})", "vec4<f32>")

        def products(weights):
            """The K loop: each lane's sums of its rows times its columns of ``weights``."""
            if not share:
                return k_loop(weights, scales, shared=False)
            k.open(f"if (sg_size >= {rows}u)")
            k_loop(weights, [], shared=True)
            k.close()
            k.open("else")
            k_loop(weights, [a.prologue(k, "0", 1, f"z * {M} + m{r}", tag=f"{r}_{k.fresh('f')}") for r in range(rows)]
                   if normed else [], shared=False)
            k.close()

        def k_loop(weights, row_scales: list[str], shared: bool) -> None:
            k.loop("i", -(-K // (4 * lanes)))
            kk = k.let("i * 4" if lanes == 1 else f"(lane + i * {lanes}) * 4", "i32")
            ragged = K % (4 * lanes) != 0
            if ragged:
                k.open(f"if ({kk} < {K})")
            w4 = k.let(a.weight4(k, kk), "vec4<f32>") if normed else None  # the norm's weight: one load for every row
            if shared:
                mine = row4("_mine", kk, scale_mine, w4)
                xs = [k.let(f"subgroupBroadcast({mine}, {r}u)", "vec4<f32>") for r in range(rows)]
            else:
                xs = [row4(str(r), kk, row_scales[r] if normed else None, w4) for r in range(rows)]
            for j in range(tn):
                w = k.let(f4(weights[quarter(f"{cb[j]} + {kk}")], b.buf.dtype), "vec4<f32>")
                for r in range(rows):
                    k.emit(f"acc{r}_{j} = acc{r}_{j} + {xs[r]} * {w};")
            if ragged:
                k.close()
            k.close()

        by_window(k, window_runs(B, b, part.n, per_group * tn, K, Z), B, "block", products, first=starts[i])
        if len(parts) > 1:
            k.close()
    sums = [f"(acc{r}_{j}.x + acc{r}_{j}.y + acc{r}_{j}.z + acc{r}_{j}.w)" for r in range(rows) for j in range(tn)]
    if lanes > 1:
        sums = combine_lanes(k, lanes, "lane", f"i32(lid.y) * {lanes} + lane", sums)
    for i, part in enumerate(parts):
        end = starts[i + 1] if i + 1 < len(parts) else blocks
        k.open(f"if (lane == 0 && block >= {starts[i]} && block < {end})")
        for r in range(rows):
            if M % rows:
                k.open(f"if (mb + {r} < {M})")
            for j in range(tn):
                k.open(f"if (n0 + {j} < {part.n})")
                e = sums[r * tn + j]
                e = e if part.alpha == 1 else f"({lit(part.alpha, 'f32')} * {e})"
                if part.bias is not None and part.beta != 0:
                    bv = cast(part.bias.read(k, ["z", f"m{r}", k.let(f"n0 + {j}", "i32")]), part.bias.ty, "f32")
                    e = f"({e} + {bv})" if part.beta == 1 else f"({e} + {lit(part.beta, 'f32')} * {bv})"
                k.write(part.out, f"(z * {M} + m{r}) * {part.n} + n0 + {j}", e, "f32")
                k.close()
            if M % rows:
                k.close()
        k.close()
    kern = k.finish(0, workgroup=(lanes, per_group, 1) if lanes > 1 else (per_group, 1, 1),
                    groups=(gx, -(-blocks // gx), Z * row_blocks), group_ids=True)
    pb.add(with_subgroup_ids(kern, True) if share else kern)


def with_subgroup_ids(kern, group_ids: bool):
    """``kern`` with ``sg_id`` (the lane in its subgroup) and ``sg_size`` among main's parameters."""
    sig = f"fn main({MAIN_WITH_GROUP_IDS if group_ids else MAIN})"
    assert sig in kern.wgsl
    kern.wgsl = kern.wgsl.replace(sig, sig[:-1] + ", @builtin(subgroup_invocation_id) sg_id: u32, "
                                                 "@builtin(subgroup_size) sg_size: u32)")
    return kern


def window_runs(binding, b: BufferView, n: int, block_columns: int, K: int, Z: int) -> list[tuple[int | None, int]]:
    """The column blocks of one weight (``b``, read along K, ``n`` columns in blocks of
    ``block_columns``: a GEMV's or a tiled product's workgroup) as runs of consecutive blocks:
    ``(window, end)`` where every column of the run's blocks lies wholly in that window of a split
    weight, or ``(None, end)`` where a block's columns straddle windows (read through the accessor).
    One run ``(None, blocks)`` for a weight bound whole. Each run's end is its exclusive last block."""
    blocks = -(-n // block_columns)
    if not binding.split or not binding.per_window or (Z > 1 and b.strides[0]):
        return [(None, blocks)]
    per = 4 * binding.per_window  # elements of the weight's dtype per window (vec4 bindings)

    def window(column: int) -> int | None:
        first = b.offset + column * b.strides[2]
        return first // per if first // per == (first + K - 1) // per else None

    runs: list[tuple[int | None, int]] = []
    for block in range(blocks):
        first, last = block * block_columns, min((block + 1) * block_columns, n) - 1
        w = window(first)
        w = w if w is not None and window(last) == w else None
        if runs and runs[-1][0] == w:
            runs[-1] = (w, block + 1)
        else:
            runs.append((w, block + 1))
    return runs


def by_window(k, runs: list[tuple[int | None, int]], binding, block: str, emit, first: int = 0) -> None:
    """``emit(weights)`` once for each run of :func:`window_runs`, under a branch on ``block`` (an
    i32 expression, the workgroup's column block counted from ``first``: uniform), with ``weights``
    the run's window of ``binding`` or, for a run that straddles windows, ``binding`` itself."""
    for r, (window, end) in enumerate(runs):
        if len(runs) > 1:
            k.open(("" if r == 0 else "else ") + (f"if ({block} < {first + end})" if r < len(runs) - 1 else ""))
        emit(binding if window is None else binding.window(window))
        if len(runs) > 1:
            k.close()


@dataclass
class ResidualProduct:
    """``add(other, views of mm(a, b))``: the product written with ``other`` added as it is stored
    (a residual connection after a linear), instead of a product kernel and an add kernel."""

    mm: Node  # the mm node
    other: str  # the ref added to the product
    nodes: list[str]  # the mm and the views between it and the add (folded into the add)


#: Views a product's result may pass through on its way to the add (same elements, same order).
_VIEWS = ("aten.view.default", "aten._unsafe_view.default", "aten.reshape.default", "aten.alias.default")


def find_residual_products(graph, uses, wanted: set[str]) -> dict[str, ResidualProduct]:
    """The float32 ``add.Tensor`` nodes of ``graph`` that add a same-shaped value to an ``mm``'s
    result (through views), every intermediate used once and not an output (a value kept for
    comparison, or an ``--inject`` op between them, leaves the ops separate), by the add's name.
    Rounding is unchanged: the product's float32 sum plus the value, rounded once, as torch does."""
    producer = {n.name: n for n in graph.nodes}
    found: dict[str, ResidualProduct] = {}
    for add in graph.nodes:
        if add.op != "aten.add.Tensor" or add.kwargs or len(add.args) != 2 or add.outputs[0].dtype != "float32":
            continue
        refs = [a.get("ref") if isinstance(a, dict) else None for a in add.args]
        if None in refs or refs[0] == refs[1]:
            continue
        for side in (1, 0):
            chain, ref = [], refs[side]
            node = producer.get(ref)
            while node is not None and not node.multi and uses[ref] == 1 and ref not in wanted and node.op in _VIEWS:
                chain.append(node.name)
                ref = node.args[0].get("ref") if isinstance(node.args[0], dict) else None
                node = producer.get(ref)
            other = graph.meta.get(refs[1 - side])
            if node is None or node.op != "aten.mm.default" or node.multi or uses[ref] != 1 or ref in wanted or \
                    node.outputs[0].dtype != "float32" or other is None or other.dtype != "float32" or \
                    tuple(other.shape) != tuple(add.outputs[0].shape) or node.outputs[0].numel != other.numel:
                continue
            found[add.name] = ResidualProduct(node, refs[1 - side], [node.name, *chain])
            break
    return found


@dataclass
class ProductGroup:
    """``mm`` nodes that multiply the same row by different matrices (q, k and v; gate and up),
    lowered together at the first of them as one GEMV kernel where each is one."""

    members: list[str]  # the mm nodes, in graph order
    early: list[str]  # view nodes after the first member that its partners read, lowered before it


#: Ops that only view their first argument: a product's operands may pass through them.
_OPERAND_VIEWS = (*_VIEWS, "aten.permute.default", "aten.t.default", "aten.transpose.int")


def find_product_groups(graph, skip: set[str]) -> dict[str, ProductGroup]:
    """Groups of float32 ``mm`` nodes (none in ``skip``) whose first operand is a view of the same
    value in the same shape, by the name of each group's first member. A partner joins only where
    its operands are views of values that exist at the first member (its views are then lowered
    there), so the group computes nothing out of order."""
    producer = {n.name: n for n in graph.nodes}
    pos = {n.name: i for i, n in enumerate(graph.nodes)}

    def first_ref(node):
        return node.args[0].get("ref") if node.args and isinstance(node.args[0], dict) else None

    def root(ref):
        node = producer.get(ref)
        while node is not None and node.op in _OPERAND_VIEWS and not node.multi and first_ref(node):
            ref = first_ref(node)
            node = producer.get(ref)
        return ref

    def views_after(ref, at: int):
        """The view nodes after position ``at`` that ``ref`` is made by, or None when it needs more."""
        chain, node = [], producer.get(ref)
        while node is not None and pos[node.name] > at:
            if node.op not in _OPERAND_VIEWS or node.multi or not first_ref(node) or \
                    any(isinstance(x, dict) for x in node.args[1:]):
                return None
            chain.append(node.name)
            node = producer.get(first_ref(node))
        return chain

    by_input: dict[tuple, list] = {}
    for node in graph.nodes:
        if node.op != "aten.mm.default" or node.name in skip or node.outputs[0].dtype != "float32" or \
                not all(isinstance(x, dict) and "ref" in x for x in node.args):
            continue
        a = node.args[0]["ref"]
        by_input.setdefault((root(a), tuple(graph.meta[a].shape)), []).append(node)
    groups: dict[str, ProductGroup] = {}
    for nodes in by_input.values():
        first, members, early = nodes[0], [nodes[0].name], []
        for node in nodes[1:]:
            chains = [views_after(x["ref"], pos[first.name]) for x in node.args]
            if any(c is None for c in chains):
                continue
            members.append(node.name)
            early.extend(n for c in chains for n in c)
        if len(members) > 1:
            groups[first.name] = ProductGroup(members, sorted(set(early), key=pos.__getitem__))
    return groups


def product_group(pb, group: ProductGroup, graph, env: dict) -> dict[str, BufferView]:
    """The values of the members that are one-row products read along K of the first member's
    row, from one GEMV kernel, by member name; none where fewer than two are (the others are
    lowered one by one, each where it stands)."""
    if _TILES.value is not None:
        return {}
    by_name = {n.name: n for n in graph.nodes}
    chosen, a0 = [], None
    for name in group.members:
        node = by_name[name]
        a, b = (views.unsqueeze(env[x["ref"]], 0) for x in node.args)
        if not (isinstance(a, (BufferView, NormedRow)) and isinstance(b, BufferView)):
            continue
        Z, M, K = a.shape
        if Z != 1 or not gemv_rows(M, K, b.shape[2]) or K == 0 or b.shape[2] == 0 or \
                (isinstance(a, BufferView) and not vec4_ok(a, 2, K)) or \
                (isinstance(a, NormedRow) and a.rows != M) or vec4_ok(b, 2, b.shape[2]) or not vec4_ok(b, 1, K):
            continue
        if a0 is None:
            a0 = a
        elif not _same_row(a, a0):
            continue
        chosen.append((node, b))
    if len(chosen) < 2:
        return {}
    parts, results = [], {}
    for node, b in chosen:
        out = pb.buffer("temp", node.outputs[0])
        parts.append(GemvPart(b, out, b.shape[2]))
        results[node.name] = BufferView.whole(out, node.outputs[0])
    gemv_kernel(pb, "mm", a0, parts, 1, a0.shape[2], a0.shape[1])
    return results


def _same_row(a: Value, b: Value) -> bool:
    """Whether two one-row operands are the same row: the same window of one buffer, or reshapes
    of one :class:`NormedRow`."""
    if isinstance(a, NormedRow) or isinstance(b, NormedRow):
        return isinstance(a, NormedRow) and a.same_row(b)
    return (a.buf.name, a.offset, a.shape, a.strides) == (b.buf.name, b.offset, b.shape, b.strides)


def residual_product(pb, match: ResidualProduct, env: dict, meta) -> BufferView:
    """The value of the add that ``match`` folds: ``mm(a, b)`` with ``other`` as its bias."""
    a, b = (env[arg["ref"]] for arg in match.mm.args)
    out_meta = match.mm.outputs[0]
    bias = views.reshape(env[match.other], out_meta.shape)
    result = product(pb, "mm", views.unsqueeze(a, 0), views.unsqueeze(b, 0), out_meta, bias=views.unsqueeze(bias, 0))
    return views.reshape(result, meta.shape)


def _empty_product(pb, out, meta, shape, bias: Value | None, beta) -> BufferView:
    """``out`` filled with ``beta * bias`` (or zeros): a matrix product over K = 0."""
    if bias is None:
        value = Compute(shape, meta.dtype, [], lambda k, e, idx: lit(0, ctype(meta.dtype)))
    elif meta.dtype in ALL_INT:
        def scaled(k, e, idx):
            bv = cast(e[0], bias.ty, "i32")
            return wrap_int(bv if beta == 1 else f"{lit(int(beta), 'i32')} * {bv}", meta.dtype)
        value = Compute(shape, meta.dtype, [bias], scaled)
    else:
        def scaled(k, e, idx):
            bv = cast(e[0], bias.ty, "f32")
            return cast(bv if beta == 1 else f"({lit(beta, 'f32')} * {bv})", "f32", ctype(meta.dtype))
        value = Compute(shape, meta.dtype, [bias], scaled)
    pb.materialize(value, out)
    return BufferView.whole(out, meta)


def product(pb, name: str, a: Value, b: Value, meta, bias: Value | None = None, alpha=1, beta=1) -> BufferView:
    """:func:`matmul` for float outputs, :func:`int_matmul` for integer ones."""
    fn = int_matmul if meta.dtype in ALL_INT else matmul
    return fn(pb, name, a, b, meta, bias=bias, alpha=alpha, beta=beta)


INT32_MIN, INT32_MAX = -2**31, 2**31 - 1


def _int_operands(m: int, k: int, n: int) -> list:
    """``(a, b)`` pairs of every integer dtype torch multiplies: int32 with the i32 boundaries and
    int8/int16/uint8 over their whole ranges (torch wraps: so must we), int64 with sums that
    pass the i32 boundaries on the way but end inside them, and int64 of moderate size."""
    import torch
    pairs = [(edge_ints(m, k, dtype=torch.int32), randint(k, n, lo=-1000, hi=1000, dtype=torch.int32)),
             (randint(m, k, lo=-2**15, hi=2**15, dtype=torch.int16),
              randint(k, n, lo=-2**15, hi=2**15, dtype=torch.int16)),
             (randint(m, k, lo=-128, hi=128, dtype=torch.int8), randint(k, n, lo=-128, hi=128, dtype=torch.int8)),
             (randint(m, k, lo=0, hi=256, dtype=torch.uint8), randint(k, n, lo=0, hi=256, dtype=torch.uint8)),
             (randint(m, k, lo=-3000, hi=3000, dtype=torch.int64), randint(k, n, lo=-3000, hi=3000, dtype=torch.int64))]
    rows = torch.tensor([[INT32_MAX, INT32_MAX, INT32_MIN, INT32_MIN + 7], [INT32_MIN, 3, INT32_MAX, -9]])
    pairs.append((rows, torch.ones(4, 3, dtype=torch.int64)))
    return pairs


def _mm_samples():
    import torch
    return [((rand(5, 7), rand(7, 3)), {}), ((rand(16, 64), rand(64, 32)), {}), ((rand(9, 12), rand(20, 12).t()), {}),
            ((rand(33, 8).t(), rand(33, 10)), {}),
            # K = 0 (OpInfo's mm and linalg.multi_dot samples): zeros, no read of the empty operands
            ((rand(5, 0), rand(0, 10)), {}), ((rand(0, 4), rand(4, 3)), {}),
            ((edge_floats(4, 6), rand(6, 5)), {}),
            # one row (a decode step's shape), K and columns past whole vec4s and lane groups
            ((rand(1, 300), rand(37, 300).t()), {}), ((edge_floats(1, 36), rand(70, 36).t()), {}),
            *[((a, b), {}) for a, b in _int_operands(5, 7, 3)],
            ((randint(20, 12, lo=-100, hi=100, dtype=torch.int32).t(),
              randint(20, 9, lo=-100, hi=100, dtype=torch.int32)), {}),
            ((randint(3, 0, dtype=torch.int8), randint(0, 4, dtype=torch.int8)), {})]


@register("aten.mm.default", NUMERIC, samples=_mm_samples, flops="matmul")
def mm(pb, node, a, b):
    return [product(pb, "mm", views.unsqueeze(a, 0), views.unsqueeze(b, 0), node.outputs[0])]


def _bmm_samples():
    return [((rand(2, 5, 7), rand(2, 7, 3)), {}), ((rand(4, 16, 16), rand(4, 16, 16)), {}),
            ((rand(3, 8, 6), rand(3, 5, 6).transpose(1, 2)), {}), ((rand(2, 3, 0), rand(2, 0, 4)), {}),
            ((edge_floats(2, 3, 4), rand(2, 4, 5)), {}), ((rand(3, 1, 40), rand(3, 70, 40).transpose(1, 2)), {}),
            *[((a.reshape(2, 3, 5), b.reshape(2, 5, 4)), {}) for a, b in _int_operands(6, 5, 8)[:-1]]]


@register("aten.bmm.default", NUMERIC, samples=_bmm_samples, flops="matmul")
def bmm(pb, node, a, b):
    return [product(pb, "bmm", a, b, node.outputs[0])]


def _addmm_samples():
    import torch
    *narrow, (a64, b64), _ = _int_operands(5, 7, 3)
    ints = [((edge_ints(3).to(a.dtype), a, b), {}) for a, b in narrow]
    ints.append(((randint(5, 3, lo=-9, hi=9), a64, b64), {}))
    return [((rand(3), rand(5, 7), rand(7, 3)), {}), ((rand(64), rand(16, 32), rand(64, 32).t()), {}),
            ((rand(5, 1), rand(5, 4), rand(4, 6)), {"beta": 0.5, "alpha": 2.0}),
            ((rand(45), rand(1, 28), rand(45, 28).t()), {"beta": 0.5, "alpha": 2.0}),
            ((rand(3), rand(2, 0), rand(0, 3)), {"beta": 0.5}),
            ((edge_floats(2, 3), rand(2, 0), rand(0, 3)), {"beta": 0}),
            ((edge_floats(2, 3), rand(2, 4), rand(4, 3)), {}),
            *ints,
            # torch truncates alpha and beta to integers for integer tensors
            ((randint(5, 1, lo=-9, hi=9, dtype=torch.int32), randint(5, 4, lo=-9, hi=9, dtype=torch.int32),
              randint(4, 6, lo=-9, hi=9, dtype=torch.int32)), {"beta": -2.5, "alpha": 3}),
            ((randint(3, lo=-9, hi=9, dtype=torch.int64), randint(2, 0, dtype=torch.int64),
              randint(0, 3, dtype=torch.int64)), {"beta": 2})]


@register("aten.addmm.default", NUMERIC, samples=_addmm_samples, flops="addmm")
def addmm(pb, node, bias, a, b, beta=1, alpha=1):
    return [product(pb, "addmm", views.unsqueeze(a, 0), views.unsqueeze(b, 0), node.outputs[0],
                    bias=views.unsqueeze(views.expand_to(bias, node.outputs[0].shape), 0), alpha=alpha, beta=beta)]


def _baddbmm_samples():
    import torch
    narrow = [((edge_ints(2, 1, 4).to(a.dtype), a.reshape(2, 3, 5), b.reshape(2, 5, 4)), {})
              for a, b in _int_operands(6, 5, 8)[1:4]]
    return [((rand(2, 5, 3), rand(2, 5, 7), rand(2, 7, 3)), {"beta": 0.5, "alpha": 0.25}),
            ((edge_floats(1, 5, 3), rand(1, 5, 7), rand(1, 7, 3)), {}),
            ((edge_ints(2, 1, 3, dtype=torch.int32), edge_ints(2, 4, 6, dtype=torch.int32),
              randint(2, 6, 3, lo=-50, hi=50, dtype=torch.int32)), {"beta": 2, "alpha": -1}),
            *narrow,
            ((randint(2, 4, 3, lo=-99, hi=99), randint(2, 4, 5, lo=-99, hi=99), randint(2, 5, 3, lo=-99, hi=99)),
             {"alpha": 2})]


@register("aten.baddbmm.default", NUMERIC, samples=_baddbmm_samples, flops="addmm")
def baddbmm(pb, node, bias, a, b, beta=1, alpha=1):
    return [product(pb, "baddbmm", a, b, node.outputs[0], bias=views.expand_to(bias, node.outputs[0].shape),
                    alpha=alpha, beta=beta)]
