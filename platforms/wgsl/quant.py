"""Packed-weight kernels: tapml's quantized linears and embeddings (:mod:`tapml.quant`).

The weight stays packed on the device, as the model ships it: every kernel reads the int32 words
of the codes and dequantizes inside (``w = scale * (q - zero)``), so no float copy of a quantized
weight ever exists in a program. A format is a :class:`PackedLayout`: where a group's scale and
its code words sit, and which weight of the group each code of a word is (nibble order, zero
point) -- the one piece of code that knows the format's bits, shared by all three kernels:

- **GEMV** (one row, decode): lanes of a workgroup split a column's groups, each lane
  dequantizes its groups' weights, and the partial sums are added in workgroup memory.
- **GEMM** (several rows, prefill): each lane holds a tile of rows and columns, so a weight it
  dequantizes serves every row of the tile and an input it loads every column; lanes split K only
  as far as the loop budget needs.
- **embedding**: one thread per code word of a picked row writes the word's weights (indices
  clamped into range, as :mod:`tapml.platforms.wgsl.index` does).

Products and sums are f32 (as the CPU reference: dequantize to float32, float32 product), the
result is rounded once to the input's dtype. ggml's float16 scales sit inside the blocks and are
read with ``unpack2x16float``, so no kernel needs shader-f16; MLC's scales are a tensor of their
own, read through the ordinary value readers (f16 or packed f16p storage, whichever the device
has). Every loop has a known trip count within :data:`~tapml.platforms.wgsl.codegen.LOOP_BUDGET`.
"""

from __future__ import annotations

import math

import torch

from tapml.errors import Unsupported
from tapml.platforms.wgsl import views
from tapml.platforms.wgsl.codegen import LOOP_BUDGET, MAX_GROUPS, WORKGROUP, BufferView, Value, cast
from tapml.platforms.wgsl.index import wrapped_index
from tapml.platforms.wgsl.registry import register
from tapml.quant import FORMATS, GROUP, ggml_bytes, ggml_tensor, ggml_words, quantize_weight

LINEAR_DTYPES = ("float32", "float16", "bfloat16", "int32")
EMBEDDING_DTYPES = LINEAR_DTYPES + ("int64",)


# --- reading bytes, halves and nibbles out of int32 words ---------------------------------------

def word_at(k, words: Value, index: str) -> str:
    """The u32 bits of element ``index`` of ``words`` (an int32 value, 1-d)."""
    return k.let(f"bitcast<u32>({words.read(k, [index])})", "u32")


def u32_at_even_byte(k, words: Value, byte: str) -> str:
    """The u32 of the four bytes from byte ``byte`` (an even offset) of ``words`` on: one word
    when it is word-aligned, else the high half of one and the low half of the next (ggml's
    blocks of 18 and 34 bytes are aligned to two bytes only)."""
    o = k.let(byte, "i32")
    index = k.let(f"{o} >> 2u", "i32")
    lo = word_at(k, words, index)
    hi = word_at(k, words, k.let(f"min({index} + 1, {words.numel - 1})", "i32"))
    return k.let(f"select({lo}, ({lo} >> 16u) | ({hi} << 16u), ({o} & 2) != 0)", "u32")


def half_at_even_byte(k, words: Value, byte: str) -> str:
    """The float16 at byte ``byte`` (an even offset) of ``words``, as f32 (no shader-f16 needed)."""
    o = k.let(byte, "i32")
    word = word_at(k, words, k.let(f"{o} >> 2u", "i32"))
    return k.let(f"unpack2x16float({word})[({o} >> 1u) & 1]", "f32")


def nibble(word: str, i: int) -> str:
    """The ``i``-th 4-bit code of ``word``, lowest first (u32)."""
    return f"(({word} >> {4 * i}u) & 15u)"


def signed_byte(word: str, i: int) -> str:
    """The ``i``-th byte of ``word``, lowest first, as a signed integer (i32)."""
    return f"(bitcast<i32>({word} << {24 - 8 * i}u) >> 24u)"


# --- formats --------------------------------------------------------------------------------

class PackedLayout:
    """Where the codes and scales of a ``[rows, cols]`` weight sit, by groups of 32 along a row.

    ``scale(k, n, g)``: group ``g`` of row ``n``'s scale (f32); ``word(k, n, g, j)``: its ``j``-th
    code word (u32, ``j < words_per_group``); ``codes(word, j)``: ``[(position in the group,
    q - zero as f32)]`` for each code the word holds."""

    words_per_group: int
    zero: int

    def __init__(self, fmt, rows: int, cols: int, values: list[Value]):
        self.fmt, self.rows, self.cols, self.values = fmt, rows, cols, values
        self.groups = cols // GROUP

    def scale(self, k, n: str, g: str) -> str:
        raise NotImplementedError

    def word(self, k, n: str, g: str, j: str) -> str:
        raise NotImplementedError

    def codes(self, word: str, j: str) -> list[tuple[str, str]]:
        raise NotImplementedError

    def weight(self, code: str) -> str:
        return f"f32(i32({code}) - {self.zero})"


class GgmlBlocks(PackedLayout):
    """llama.cpp's blocks (ggml-common.h): a float16 ``d``, then the codes; block ``n * G + g``."""

    def block_byte(self, k, n: str, g: str) -> str:
        return k.let(f"({n} * {self.groups} + {g}) * {self.fmt.block_bytes}", "i32")

    def scale(self, k, n, g):
        return half_at_even_byte(k, self.values[0], self.block_byte(k, n, g))

    def word(self, k, n, g, j):
        return u32_at_even_byte(k, self.values[0], f"{self.block_byte(k, n, g)} + 2 + 4 * {j}")


class Q4_0(GgmlBlocks):
    """``block_q4_0``: 16 bytes of codes, low nibbles weights 0..15, high nibbles 16..31, q - 8."""

    words_per_group, zero = 4, 8

    def codes(self, word, j):
        out = []
        for t in range(4):  # byte t of word j is byte 4j + t of the codes
            out.append((f"4 * {j} + {t}", self.weight(nibble(word, 2 * t))))
            out.append((f"16 + 4 * {j} + {t}", self.weight(nibble(word, 2 * t + 1))))
        return out


class Q8_0(GgmlBlocks):
    """``block_q8_0``: 32 int8 codes, ``w = d * q``."""

    words_per_group, zero = 8, 0

    def codes(self, word, j):
        return [(f"4 * {j} + {t}", f"f32({signed_byte(word, t)})") for t in range(4)]


class Q5_0(GgmlBlocks):
    """``block_q5_0``: 4 bytes of fifth bits (bit i of the u32: weight i), then 16 bytes of codes
    whose low nibbles are weights 0..15 and high nibbles 16..31; q - 16. A code word is carried with
    the block's fifth bits as a ``vec2<u32>``."""

    words_per_group, zero = 4, 16

    def word(self, k, n, g, j):
        base = self.block_byte(k, n, g)
        codes = u32_at_even_byte(k, self.values[0], f"{base} + 6 + 4 * {j}")
        fifth = u32_at_even_byte(k, self.values[0], f"{base} + 2")
        return k.let(f"vec2<u32>({codes}, {fifth})", "vec2<u32>")

    def codes(self, word, j):
        out = []
        for t in range(4):
            for half in (0, 1):  # low nibble: weight 4j + t; high: 16 + 4j + t
                position = f"{16 * half} + 4 * {j} + {t}"
                bit = f"((({word}.y >> u32({position})) & 1u) << 4u)"
                out.append((position, self.weight(f"({nibble(word + '.x', 2 * t + half)} | {bit})")))
        return out


class Q4_K(GgmlBlocks):
    """``block_q4_K``: super-blocks of 256 weights (144 bytes, word-aligned): float16 ``d`` and
    ``dmin``, 12 bytes of the 6-bit scales and mins of its 8 groups of 32 (``get_scale_min_k4``),
    then 128 bytes of codes, 32 bytes per two groups (low nibbles the first, high the second);
    ``w = d * sc * q - dmin * m``. :meth:`scale` works out a group's ``d * sc`` and ``dmin * m``
    once; the code words carry them (``vec4<u32>``: the word, both as f32 bits, the nibble half)."""

    words_per_group, zero = 8, 0

    def __init__(self, fmt, rows, cols, values):
        super().__init__(fmt, rows, cols, values)
        self.factors: dict[tuple[str, str], tuple[str, str]] = {}

    def super_byte(self, k, n, g):
        return k.let(f"({n} * {self.groups // 8} + {g} / 8) * {self.fmt.block_bytes}", "i32")

    def scale_byte(self, k, base: str, i: str) -> str:
        word = word_at(k, self.values[0], k.let(f"({base} + 4 + {i}) >> 2u", "i32"))
        return k.let(f"(({word} >> (u32(({base} + 4 + {i}) & 3) * 8u)) & 255u)", "u32")

    def scale(self, k, n, g):
        base = self.super_byte(k, n, g)
        s = k.let(f"{g} % 8", "i32")
        halves = k.let(f"unpack2x16float({word_at(k, self.values[0], k.let(f'{base} >> 2u', 'i32'))})", "vec2<f32>")
        low = [self.scale_byte(k, base, f"{s} % 4"), self.scale_byte(k, base, f"{s} % 4 + 4")]
        high = self.scale_byte(k, base, f"{s} % 4 + 8")
        sc = k.let(f"select(({high} & 15u) | (({low[0]} >> 6u) << 4u), {low[0]} & 63u, {s} < 4)", "u32")
        m = k.let(f"select(({high} >> 4u) | (({low[1]} >> 6u) << 4u), {low[1]} & 63u, {s} < 4)", "u32")
        self.factors[(n, g)] = (k.let(f"{halves}.x * f32({sc})", "f32"), k.let(f"{halves}.y * f32({m})", "f32"))
        return "1.0"

    def word(self, k, n, g, j):
        step, offset = self.factors[(n, g)]
        base = self.super_byte(k, n, g)
        s = k.let(f"{g} % 8", "i32")
        codes = word_at(k, self.values[0], k.let(f"({base} + 16 + 32 * ({s} / 2) + 4 * {j}) >> 2u", "i32"))
        return k.let(f"vec4<u32>({codes}, bitcast<u32>({step}), bitcast<u32>({offset}), u32({s} & 1) * 4u)",
                     "vec4<u32>")

    def codes(self, word, j):
        return [(f"4 * {j} + {t}", f"(bitcast<f32>({word}.y) * f32(({word}.x >> ({8 * t}u + {word}.w)) & 15u) "
                                   f"- bitcast<f32>({word}.z))") for t in range(4)]


class MlcGroups(PackedLayout):
    """MLC-LLM's group quantization (group_quantization.py): codes ``[N, K/8]``, eight per word
    lowest nibble first, ``q - 7``; scales ``[N, K/32]``."""

    words_per_group, zero = 4, 7

    def scale(self, k, n, g):
        scales = self.values[1]
        return k.let(cast(scales.read(k, [n, g]), scales.ty, "f32"), "f32")

    def word(self, k, n, g, j):
        codes = self.values[0]
        return k.let(f"bitcast<u32>({codes.read(k, [n, k.let(f'{g} * 4 + {j}', 'i32')])})", "u32")

    def codes(self, word, j):
        return [(f"8 * {j} + {t}", self.weight(nibble(word, t))) for t in range(8)]


LAYOUTS = {"q4_0": Q4_0, "q8_0": Q8_0, "q5_0": Q5_0, "q4_k": Q4_K, "q4f16_1": MlcGroups, "q4f32_1": MlcGroups}


def layout_of(scheme: str, packed: list[Value], rows: int, cols: int) -> PackedLayout:
    """The :class:`PackedLayout` of ``packed`` (ggml: ``[weight]``, mlc: ``[codes, scales]``),
    or Unsupported saying how its sizes disagree with a ``[rows, cols]`` weight."""
    fmt = FORMATS[scheme]
    if rows < 0 or cols <= 0 or cols % fmt.block_elems:
        raise Unsupported(f"{scheme}: a weight of {rows}x{cols} does not split into blocks of {fmt.block_elems} "
                          "along its rows")
    if fmt.family == "ggml":
        want = ggml_words(rows, cols, fmt)
        if packed[0].shape != (want,):
            raise Unsupported(f"{scheme}: a packed {rows}x{cols} weight is {want} int32 words, not {list(packed[0].shape)}")
    else:
        codes, scales = packed
        if codes.shape != (rows, cols // 8) or scales.shape != (rows, cols // GROUP):
            raise Unsupported(f"{scheme}: codes {list(codes.shape)} and scales {list(scales.shape)} do not hold a "
                              f"{rows}x{cols} weight ([{rows}, {cols // 8}] and [{rows}, {cols // GROUP}])")
    return LAYOUTS[scheme](fmt, rows, cols, packed)


# --- kernels --------------------------------------------------------------------------------

MAIN = "fn main(@builtin(global_invocation_id) gid: vec3<u32>)"
WORKGROUP_IDS = MAIN[:-1] + ", @builtin(local_invocation_id) lid: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>)"
#: Rows and columns one lane of the GEMM holds: a weight it dequantizes serves GEMM_ROWS rows, an
#: input element it loads GEMM_COLUMNS columns (on lavapipe every storage load is a loop over lanes,
#: so loads per product are what counts).
GEMM_ROWS, GEMM_COLUMNS = 8, 4


def linear_plan(m: int, groups: int, words_per_group: int) -> tuple[str, int, int, int]:
    """``(path, lanes per column, rows per lane, columns per lane)`` of a packed linear with ``m``
    rows and ``groups`` groups along K: GEMV splits K over up to 32 lanes; GEMM only as far as the
    loop budget needs (a lane runs ``ceil(groups / lanes) * (1 + words_per_group)`` iterations)."""
    need = 1
    while math.ceil(groups / need) * (1 + words_per_group) > LOOP_BUDGET:
        need *= 2
    if need > WORKGROUP:
        raise Unsupported(f"a packed linear over {groups * GROUP} inputs needs more than {WORKGROUP} lanes per column "
                          f"to keep each within {LOOP_BUDGET} loop iterations")
    if m == 1:
        return "gemv", max(need, min(32, 1 << (groups - 1).bit_length())), 1, 1
    return "gemm", need, GEMM_ROWS, GEMM_COLUMNS


def packed_linear(pb, node, scheme: str, x: Value, packed: list[Value], rows: int, cols: int,
                  bias: Value | None) -> list[Value]:
    """``x @ dequantize(packed).T + bias`` with the weight dequantized inside the kernel."""
    meta = node.outputs[0]
    N, K = int(rows), int(cols)
    if x.shape[-1] != K:
        raise Unsupported(f"{scheme}_linear: the input has {x.shape[-1]} features, the weight {K}")
    M = math.prod(x.shape[:-1])
    out = pb.buffer("temp", meta)
    result = BufferView.whole(out, meta)
    x = views.reshape(x, (M, K))
    fitted = pb.fit([x, *packed] + ([bias] if bias is not None else []), 1)
    x, packed, bias = fitted[0], fitted[1:1 + len(packed)], (fitted[-1] if bias is not None else None)
    layout = layout_of(scheme, packed, N, K)
    if M * N == 0:
        return [result]
    G = layout.groups
    path, lanes, tm, tn = linear_plan(M, G, layout.words_per_group)
    tiles_per_group = WORKGROUP // lanes  # column tiles of a workgroup, tn columns each
    k = pb.kernel(f"{scheme}_{path}")
    blocks = -(-N // (tiles_per_group * tn))
    gx = min(blocks, MAX_GROUPS)
    groups = (gx, -(-blocks // gx), -(-M // tm))
    k.emit("let lane: i32 = i32(lid.x);")
    k.emit(f"let col0: i32 = ((i32(wid.y) * {gx} + i32(wid.x)) * {tiles_per_group} + i32(lid.y)) * {tn};")
    k.emit(f"let row0: i32 = i32(wid.z) * {tm};")
    # tiles past the last row or column compute real ones (clamped reads) that are written nowhere
    ns = [k.let(f"min(col0 + {c}, {N - 1})", "i32") for c in range(tn)]
    rows_read = [k.let(f"min(row0 + {r}, {M - 1})", "i32") for r in range(tm)]
    acc = [[f"acc{r}_{c}" for c in range(tn)] for r in range(tm)]
    for r in range(tm):
        for c in range(tn):
            k.emit(f"var {acc[r][c]}: f32 = 0.0;")
    k.loop("gi", -(-G // lanes))
    g = k.let(f"lane + gi * {lanes}", "i32")
    k.open(f"if ({g} < {G})")
    scales = [layout.scale(k, n, g) for n in ns]
    k.loop("j", layout.words_per_group)
    codes = [layout.codes(layout.word(k, n, g, "j"), "j") for n in ns]
    for slot, (position, _) in enumerate(codes[0]):
        kk = k.let(f"{g} * {GROUP} + {position}", "i32")
        xs = [k.let(cast(x.read(k, [rows_read[r], kk]), x.ty, "f32"), "f32") for r in range(tm)]
        for c in range(tn):
            w = k.let(f"{scales[c]} * {codes[c][slot][1]}", "f32")
            for r in range(tm):
                k.emit(f"{acc[r][c]} = {acc[r][c]} + {xs[r]} * {w};")
    k.close()
    k.close()
    k.close()
    sums = acc
    if lanes > 1:  # the lanes of a column tile add their partial sums in workgroup memory, as a tree
        k.helpers["partial"] = f"var<workgroup> partial: array<f32, {WORKGROUP * tm * tn}>;"
        base = k.let(f"(i32(lid.y) * {lanes} + lane) * {tm * tn}", "i32")
        for r in range(tm):
            for c in range(tn):
                k.emit(f"partial[{base} + {r * tn + c}] = {acc[r][c]};")
        step = lanes // 2
        while step:
            k.emit("workgroupBarrier();")
            k.open(f"if (lane < {step})")
            for e in range(tm * tn):
                k.emit(f"partial[{base} + {e}] = partial[{base} + {e}] + partial[{base} + {step * tm * tn + e}];")
            k.close()
            step //= 2
        k.emit("workgroupBarrier();")
        sums = [[f"partial[{base} + {r * tn + c}]" for c in range(tn)] for r in range(tm)]
    k.open("if (lane == 0)")
    for c in range(tn):
        k.open(f"if (col0 + {c} < {N})")
        b = cast(bias.read(k, [ns[c]]), bias.ty, "f32") if bias is not None else None
        for r in range(tm):
            k.open(f"if (row0 + {r} < {M})")
            e = sums[r][c] if b is None else f"({sums[r][c]} + {b})"
            k.write(out, f"(row0 + {r}) * {N} + {ns[c]}", e, "f32")
            k.close()
        k.close()
    k.close()
    kern = k.finish(0, workgroup=(lanes, tiles_per_group, 1), groups=groups)
    kern.wgsl = kern.wgsl.replace(MAIN, WORKGROUP_IDS)
    pb.add(kern)
    return [result]


def packed_embedding(pb, node, scheme: str, packed: list[Value], indices: Value, rows: int, cols: int) -> list[Value]:
    """Rows ``indices`` of ``dequantize(packed)``: one thread per code word of a picked row."""
    meta = node.outputs[0]
    out = pb.buffer("temp", meta)
    result = BufferView.whole(out, meta)
    T = indices.numel
    indices = views.reshape(indices, (T,))
    fitted = pb.fit([*packed, indices], 1)
    packed, indices = fitted[:-1], fitted[-1]
    layout = layout_of(scheme, packed, rows, cols)
    if T == 0 or rows == 0:
        if T and not rows:
            raise Unsupported(f"{scheme}_embedding: indices into a table of no rows")
        return [result]
    G, W = layout.groups, layout.words_per_group
    k = pb.kernel(f"{scheme}_embedding")
    t, g, j = k.unravel("n", (T, G, W))
    row = wrapped_index(k, indices, [t], rows, wrap=False)
    s = layout.scale(k, row, g)
    word = layout.word(k, row, g, j)
    for position, code in layout.codes(word, j):
        k.write(out, f"{t} * {cols} + {g} * {GROUP} + {position}", f"{s} * {code}", "f32")
    pb.add(k.finish(T * G * W))
    return [result]


# --- registry entries -------------------------------------------------------------------------

def edge_packed(scheme: str, weight: torch.Tensor) -> dict:
    """``weight`` (``[N, K]``, N >= 2, K >= 96) packed in ``scheme``, with the format's edge values
    planted: row 0's first group all zero, its second of the largest codes (15; q8_0: 127 and
    -128) at a scale of 65504, its third at a scale of -0.0; row 1's first group of the smallest codes
    (0; q8_0: -128)."""
    w = weight.clone()
    w[0, :GROUP] = 0.0
    packed = quantize_weight(w, scheme)
    G = w.shape[1] // GROUP
    fmt = FORMATS[scheme]
    if scheme == "q4_k":  # super-blocks: row 0's first of the largest everything, row 1's first all zero
        raw = ggml_bytes(packed["weight"]).clone()
        first = raw[:fmt.block_bytes]
        first[:4] = torch.tensor([0xFF, 0x7B, 0x00, 0x80], dtype=torch.uint8)  # d 65504, dmin -0.0
        first[4:] = 0xFF  # sc = m = 63, every code 15
        per_row = w.shape[1] // fmt.block_elems * fmt.block_bytes
        raw[per_row:per_row + fmt.block_bytes] = 0
        return {"weight": ggml_tensor(raw.numpy().tobytes())}
    if fmt.family == "ggml":
        raw = ggml_bytes(packed["weight"]).clone()
        bb = fmt.block_bytes

        def block(n, g):
            return raw[(n * G + g) * bb:(n * G + g + 1) * bb]
        b = block(0, 1)
        b[:2] = torch.tensor([0xFF, 0x7B], dtype=torch.uint8)  # 65504 as float16, little-endian
        if scheme == "q8_0":
            b[2:] = torch.tensor([0x7F, 0x80] * 16, dtype=torch.uint8)  # 127, -128
        else:
            b[2:] = 0xFF  # 15 in both nibbles
        block(0, 2)[:2] = torch.tensor([0x00, 0x80], dtype=torch.uint8)  # -0.0
        block(1, 0)[2:] = 0 if scheme == "q4_0" else 0x80  # the smallest codes: 0, -128
        return {"weight": ggml_tensor(raw.numpy().tobytes())}
    codes, scales = packed["weight"].clone(), packed["scales"].clone()
    codes[0, 4:8] = -1  # 0xFFFFFFFF: eight codes of 15
    codes[1, 0:4] = 0
    scales[0, 1] = 65504.0
    scales[0, 2] = -0.0
    return {"weight": codes, "scales": scales}


def _x(m: int, k: int, dtype=torch.float32, small: bool = False) -> torch.Tensor:
    lim = 0.25 if small else 2.0
    return (torch.rand(m, k) * 2 * lim - lim).to(dtype)


def _linear_args(scheme: str, x, packed: dict, n: int, k: int, bias=None) -> tuple:
    fmt = FORMATS[scheme]
    if fmt.family == "ggml":
        return (x, packed["weight"], n, k), ({"bias": bias} if bias is not None else {})
    return (x, packed["weight"], packed["scales"]), ({"bias": bias} if bias is not None else {})


def linear_samples(scheme: str):
    """Seeded samples of ``scheme``'s linear: M = 1, 3, 17 (3-d input too), N not a multiple of a
    workgroup's columns, K = 32, 64, 96 and 4096, with and without bias, float32 and float16
    inputs, and :func:`edge_packed`'s edge values (small inputs: the 65504 scale stays finite)."""
    gen = torch.Generator().manual_seed(33)

    def weight(n, k):
        return torch.randn(n, k, generator=gen)

    out = []
    for m, n, k, bias, dtype in [(1, 5, 32, False, torch.float32), (1, 7, 4096, True, torch.float32),
                                 (3, 9, 64, True, torch.float32), (17, 67, 96, False, torch.float32),
                                 (1, 6, 96, True, torch.float16), (17, 5, 64, False, torch.float16),
                                 (3, 3, 4096, False, torch.float32)]:
        k = _whole_blocks(scheme, k)
        packed = quantize_weight(weight(n, k), scheme)
        b = torch.randn(n, generator=gen).to(dtype) if bias else None
        out.append(_linear_args(scheme, _x(m, k, dtype), packed, n, k, b))
    k = _whole_blocks(scheme, 96)
    x = _x(6, k, small=True).reshape(2, 3, k)
    out.append(_linear_args(scheme, x, edge_packed(scheme, weight(4, k)), 4, k, torch.randn(4, generator=gen)))
    out.append(_linear_args(scheme, _x(1, k, small=True), edge_packed(scheme, weight(3, k)), 3, k))
    return out


def _whole_blocks(scheme: str, k: int) -> int:
    """``k`` rounded up to whole blocks of ``scheme`` (Q4_K: 256 weights, 512 and up for two or more)."""
    per = FORMATS[scheme].block_elems
    return k if per == GROUP else max(per, -(-k // per) * per) * (2 if k == 96 else 1)


def embedding_samples(scheme: str):
    """Seeded samples of ``scheme``'s embedding: 2-d and 1-d int64 and int32 indices, float32,
    float16 and bfloat16 outputs, K = 32 and 96, :func:`edge_packed`'s rows among the picked ones."""
    gen = torch.Generator().manual_seed(34)
    fmt = FORMATS[scheme]
    out = []
    for n, k, idx, dtype, edges in [(10, 64, torch.tensor([[0, 9, 3], [3, 1, 7]]), torch.float32, False),
                                    (5, 32, torch.tensor([4, 0, 2], dtype=torch.int32), torch.float16, False),
                                    (6, 96, torch.tensor([1, 0, 5, 0]), torch.float32, True),
                                    (4, 96, torch.tensor([[0], [1]]), torch.bfloat16, True)]:
        k = _whole_blocks(scheme, k)
        w = torch.randn(n, k, generator=gen)
        packed = edge_packed(scheme, w) if edges else quantize_weight(w, scheme)
        if fmt.family == "ggml":
            out.append(((packed["weight"], idx, n, k, dtype), {}))
        else:
            out.append(((packed["weight"], packed["scales"], idx, dtype), {}))
    return out


def _register(scheme: str) -> None:
    fmt = FORMATS[scheme]
    if fmt.family == "ggml":
        def linear(pb, node, x, weight, out_features, in_features, bias=None):
            return packed_linear(pb, node, scheme, x, [weight], out_features, in_features, bias)

        def embedding(pb, node, weight, indices, num_embeddings, embedding_dim, dtype):
            return packed_embedding(pb, node, scheme, [weight], indices, num_embeddings, embedding_dim)
    else:
        def linear(pb, node, x, weight, scales, bias=None):
            return packed_linear(pb, node, scheme, x, [weight, scales], weight.shape[0], weight.shape[1] * 8, bias)

        def embedding(pb, node, weight, scales, indices, dtype):
            return packed_embedding(pb, node, scheme, [weight, scales], indices, weight.shape[0], weight.shape[1] * 8)
    linear.__name__, embedding.__name__ = f"{scheme}_linear", f"{scheme}_embedding"
    register(fmt.linear_op, LINEAR_DTYPES, samples=lambda: linear_samples(scheme), flops="matmul")(linear)
    register(fmt.embedding_op, EMBEDDING_DTYPES, samples=lambda: embedding_samples(scheme))(embedding)


for _scheme in FORMATS:
    _register(_scheme)
