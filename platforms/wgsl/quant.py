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

torchao's codes (``tapml.intx_linear``, :class:`IntxGroups`) are one more layout: signed 4- and
8-bit codes, a scale and a zero point per group; with ``dynamic_activation`` (8da4w) a first kernel
(:func:`per_token_int8`) computes each row's int8 scale and zero point and the product kernel
quantizes the input as it loads it.

Products and sums are f32 (as the CPU reference: dequantize to float32, float32 product), the
result is rounded once to the input's dtype (``intx_linear``'s reference rounds each weight to the
input's dtype first, and so does its kernel). ggml's float16 scales sit inside the blocks and are
read with ``unpack2x16float``, so no kernel needs shader-f16; MLC's scales are a tensor of their
own, read through the ordinary value readers (f16 or packed f16p storage, whichever the device
has). Every loop has a known trip count within :data:`~tapml.platforms.wgsl.codegen.LOOP_BUDGET`.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from tapml.errors import Unsupported
from tapml.platforms.wgsl import views
from tapml.graph import TensorMeta
from tapml.platforms.wgsl.codegen import (LOOP_BUDGET, MAX_GROUPS, WORKGROUP, BufferView, Value, cast, combine_lanes,
                                          lit, round_low)
from tapml.platforms.wgsl.index import wrapped_index
from tapml.platforms.wgsl.registry import register
from tapml.quant import FORMATS, GROUP, INTX_LINEAR, ggml_bytes, ggml_tensor, ggml_words, pack_codes, quantize_weight

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


def signed_code(word: str, i: int, bits: int) -> str:
    """The ``i``-th ``bits``-bit field of ``word``, lowest first, sign-extended (i32): shifted to the
    top of the word, then arithmetically back down."""
    return f"(bitcast<i32>({word} << {32 - bits * (i + 1)}u) >> {32 - bits}u)"


# --- formats --------------------------------------------------------------------------------

class PackedLayout:
    """Where the codes, scales and zero points of a ``[rows, cols]`` weight sit, by groups of
    ``block`` weights along a row (32 unless a layout says otherwise; the kernels' unit of work).

    ``scale(k, n, g)``: group ``g`` of row ``n``'s scale (f32); ``zero_point(k, n, g)``: its zero
    point (i32; the format's constant ``zero`` unless a layout stores them); ``word(k, n, g, j)``:
    its ``j``-th code word (u32, ``j < words_per_group``); ``codes(word, j)``: ``[(position in the
    group, q as i32)]`` for each code the word holds. A weight is ``scale * f32(q - zero_point)``."""

    words_per_group: int
    zero: int = 0
    block: int = GROUP

    def __init__(self, fmt, rows: int, cols: int, values: list[Value]):
        self.fmt, self.rows, self.cols, self.values = fmt, rows, cols, values
        self.groups = cols // self.block

    def scale(self, k, n: str, g: str) -> str:
        raise NotImplementedError

    def zero_point(self, k, n: str, g: str) -> str:
        return str(self.zero)

    def word(self, k, n: str, g: str, j: str) -> str:
        raise NotImplementedError

    def codes(self, word: str, j: str) -> list[tuple[str, str]]:
        raise NotImplementedError

    def dequantized(self, scale: str, code: str, zero: str) -> str:
        """The f32 weight of ``code`` with ``scale`` and ``zero`` (:func:`dequantized` unless a format says otherwise)."""
        return dequantized(scale, code, zero)


def dequantized(scale: str, code: str, zero: str) -> str:
    """The f32 weight of code ``code`` (i32) with ``scale`` and ``zero`` (i32): ``(q - zero) * scale``
    exactly as the CPU ops compute it (an integer difference, one rounding)."""
    return f"{scale} * f32({code})" if zero == "0" else f"{scale} * f32({code} - {zero})"


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
            out.append((f"4 * {j} + {t}", f"i32({nibble(word, 2 * t)})"))
            out.append((f"16 + 4 * {j} + {t}", f"i32({nibble(word, 2 * t + 1)})"))
        return out


class Q8_0(GgmlBlocks):
    """``block_q8_0``: 32 int8 codes, ``w = d * q``."""

    words_per_group, zero = 8, 0

    def codes(self, word, j):
        return [(f"4 * {j} + {t}", signed_code(word, t, 8)) for t in range(4)]


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
                out.append((position, f"i32({nibble(word + '.x', 2 * t + half)} | {bit})"))
        return out


class Q4_K(GgmlBlocks):
    """``block_q4_K``: super-blocks of 256 weights (144 bytes, word-aligned): float16 ``d`` and
    ``dmin``, 12 bytes of the 6-bit scales and mins of its 8 groups of 32 (``get_scale_min_k4``),
    then 128 bytes of codes, 32 bytes per two groups (low nibbles the first, high the second);
    ``w = d * sc * q - dmin * m``: :meth:`scale` is a group's ``d * sc``, :meth:`zero_point` its
    ``dmin * m`` (an f32, subtracted after the product: :meth:`dequantized`). A code word is carried
    with the shift of the group's nibble half (``vec2<u32>``)."""

    words_per_group = 8

    def __init__(self, fmt, rows, cols, values):
        super().__init__(fmt, rows, cols, values)
        self.offsets: dict[tuple[str, str], str] = {}

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
        self.offsets[(n, g)] = k.let(f"{halves}.y * f32({m})", "f32")
        return k.let(f"{halves}.x * f32({sc})", "f32")

    def zero_point(self, k, n, g):
        return self.offsets[(n, g)]

    def dequantized(self, scale: str, code: str, zero: str) -> str:
        return f"({scale} * f32({code}) - {zero})"

    def word(self, k, n, g, j):
        base = self.super_byte(k, n, g)
        s = k.let(f"{g} % 8", "i32")
        codes = word_at(k, self.values[0], k.let(f"({base} + 16 + 32 * ({s} / 2) + 4 * {j}) >> 2u", "i32"))
        return k.let(f"vec2<u32>({codes}, u32({s} & 1) * 4u)", "vec2<u32>")

    def codes(self, word, j):
        return [(f"4 * {j} + {t}", f"i32(({word}.x >> ({8 * t}u + {word}.y)) & 15u)") for t in range(4)]


class WordCodes(PackedLayout):
    """Codes in a tensor of their own, ``[N, K * bits / 32]`` int32 words (a group's
    ``words_per_group`` words in a row), scales in another, ``[N, K / group]``: a group of the
    kernels (``block`` weights) lies inside scale group ``g // blocks_per_group``."""

    blocks_per_group = 1

    def scale_group(self, k, g: str) -> str:
        return g if self.blocks_per_group == 1 else k.let(f"{g} / {self.blocks_per_group}", "i32")

    def scale(self, k, n, g):
        scales = self.values[1]
        return k.let(cast(scales.read(k, [n, self.scale_group(k, g)]), scales.ty, "f32"), "f32")

    def word(self, k, n, g, j):
        codes = self.values[0]
        index = k.let(f"{g} * {self.words_per_group} + {j}", "i32")
        return k.let(f"bitcast<u32>({codes.read(k, [n, index])})", "u32")


class MlcGroups(WordCodes):
    """MLC-LLM's group quantization (group_quantization.py): codes ``[N, K/8]``, eight per word
    lowest nibble first, ``q - 7``; scales ``[N, K/32]``."""

    words_per_group, zero = 4, 7

    def codes(self, word, j):
        return [(f"8 * {j} + {t}", f"i32({nibble(word, t)})") for t in range(8)]


class IntxGroups(WordCodes):
    """torchao's affine integer codes (``tapml.intx_linear``; torchao/quantization/quant_primitives.py,
    ``dequantize_affine``): signed ``bits``-bit codes, ``32 / bits`` per word lowest first (two's
    complement, :func:`tapml.quant.pack_codes`), a float scale and an int8 zero point per
    ``group_size`` weights of a row (``[N, K / group_size]`` each), ``w = (q - zero_point) * scale``.
    The kernels walk blocks of ``gcd(group_size, 32)`` weights, each inside one of torchao's groups."""

    def __init__(self, rows: int, cols: int, values: list[Value], bits: int, group_size: int):
        self.bits, self.per_word = bits, 32 // bits
        if bits not in (4, 8) or group_size % self.per_word:
            raise Unsupported(f"intx_linear: {bits}-bit codes in groups of {group_size} (the kernels take 4 or 8 bits "
                              f"in groups of whole words, {self.per_word} codes each)")
        self.block = math.gcd(group_size, GROUP)
        self.words_per_group, self.blocks_per_group = self.block // self.per_word, group_size // self.block
        super().__init__(None, rows, cols, values)
        codes, scale, zero_point = values
        want = (rows, cols // group_size)
        if codes.shape != (rows, cols // self.per_word) or scale.shape != want or zero_point.shape != want:
            raise Unsupported(f"intx_linear: codes {list(codes.shape)}, scale {list(scale.shape)} and zero point "
                              f"{list(zero_point.shape)} do not hold a {rows}x{cols} weight of {bits}-bit codes in "
                              f"groups of {group_size}")

    def zero_point(self, k, n, g):
        zero = self.values[2]
        return k.let(zero.read(k, [n, self.scale_group(k, g)]), "i32")

    def codes(self, word, j):
        return [(f"{self.per_word} * {j} + {t}", signed_code(word, t, self.bits)) for t in range(self.per_word)]


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


#: float32's smallest normal: the floor of a per-token scale (:func:`tapml.quant.quantize_per_token_int8`).
SMALLEST_NORMAL = 1.1754943508222875e-38


def per_token_int8(pb, x: Value) -> BufferView:
    """Each row's int8 quantization parameters, as :func:`tapml.quant.quantize_per_token_int8`
    computes them (torchao's int8_asym_per_token), into a ``[M, 3]`` float32 temp buffer
    (scale, ``1 / scale``, zero point): one workgroup per row, its lanes splitting the row's min and max
    (a tree in workgroup memory), then in f32 ``lo = min(min x, 0)``, ``hi = max(max x, 0)``,
    ``scale = max((hi - lo) / 255, smallest normal)``, ``zero = clamp(-128 - round(lo / scale), -128, 127)``.
    WGSL lets a division be 2.5 ULP off (Chromium's SwiftShader is, by an ULP or two), so each
    quotient is moved to the correctly rounded one (``tap_div_rn``): the codes are torch's."""
    M, K = x.shape
    meta = TensorMeta((M, 3), "float32")
    out = pb.buffer("temp", meta)
    if M == 0:
        return BufferView.whole(out, meta)
    if -(-K // WORKGROUP) > LOOP_BUDGET:
        raise Unsupported(f"per-token int8 quantization of rows of {K} needs more than {LOOP_BUDGET} loop "
                          f"iterations per lane")
    (x,) = pb.fit([x], 1)
    k = pb.kernel("per_token_int8")
    gx = min(M, MAX_GROUPS)
    k.emit("let lane: i32 = i32(lid.x);")
    k.emit(f"let row: i32 = i32(wid.y) * {gx} + i32(wid.x);")
    row = k.let(f"min(row, {M - 1})", "i32")
    k.emit("var lo: f32 = 0.0;")  # starting at zero is torchao's widening of the range to hold it
    k.emit("var hi: f32 = 0.0;")
    k.loop("i", -(-K // WORKGROUP))
    kk = k.let(f"lane + i * {WORKGROUP}", "i32")
    k.open(f"if ({kk} < {K})")
    v = k.let(cast(x.read(k, [row, kk]), x.ty, "f32"), "f32")
    k.emit(f"lo = min(lo, {v});")
    k.emit(f"hi = max(hi, {v});")
    k.close()
    k.close()
    lo, hi = combine_lanes(k, WORKGROUP, "lane", "lane", ["lo", "hi"],
                           lambda e, a, b: f"{'min' if e == 0 else 'max'}({a}, {b})")
    k.open(f"if (lane == 0 && row < {M})")
    divide = k.need("tap_div_rn")  # lo <= 0 <= hi: the quotients it takes are of non-negative numbers
    k.emit(f"let scale: f32 = max({divide}({hi} - {lo}, 255.0), {lit(SMALLEST_NORMAL, 'f32')});")
    k.emit(f"let zero: f32 = clamp(-128.0 + round({divide}(-{lo}, scale)), -128.0, 127.0);")
    k.write(out, "row * 3", "scale", "f32")
    k.write(out, "row * 3 + 1", f"{divide}(1.0, scale)", "f32")
    k.write(out, "row * 3 + 2", "zero", "f32")
    k.close()
    kern = k.finish(0, workgroup=(WORKGROUP, 1, 1), groups=(gx, -(-M // gx), 1), group_ids=True)
    pb.add(kern)
    return BufferView.whole(out, meta)


def packed_linear(pb, node, name: str, x: Value, packed: list[Value], rows: int, cols: int, bias: Value | None,
                  make_layout: Callable[[list[Value]], PackedLayout], per_token: bool = False,
                  operand_dtype: str = "float32") -> list[Value]:
    """``x @ dequantize(packed).T + bias`` with the weight dequantized inside the kernel; ``make_layout``
    gives the :class:`PackedLayout` of the packed values (as bound). ``per_token``: ``x`` is first
    quantized to int8 per row (:func:`per_token_int8`'s parameters, applied to each element as the
    kernel loads it: ``q = clamp(round(x * (1 / scale)) + zero, -128, 127)``, ``x = (q - zero) * scale``).
    ``operand_dtype``: the dtype the reference rounds each dequantized weight (and quantized input) to
    before its float32 product (``tapml.intx_linear``: the input's)."""
    meta = node.outputs[0]
    N, K = int(rows), int(cols)
    if x.shape[-1] != K:
        raise Unsupported(f"{name}_linear: the input has {x.shape[-1]} features, the weight {K}")
    M = math.prod(x.shape[:-1])
    out = pb.buffer("temp", meta)
    result = BufferView.whole(out, meta)
    x = views.reshape(x, (M, K))
    if M * N == 0:
        make_layout(packed)
        return [result]
    extra = [bias] if bias is not None else []
    if per_token:
        extra.append(per_token_int8(pb, x))
    fitted = pb.fit([x, *packed, *extra], 1)
    x, packed = fitted[0], fitted[1:1 + len(packed)]
    bias = fitted[1 + len(packed)] if bias is not None else None
    stats = fitted[-1] if per_token else None
    layout = make_layout(packed)
    G, B = layout.groups, layout.block
    path, lanes, tm, tn = linear_plan(M, G, layout.words_per_group)
    tiles_per_group = WORKGROUP // lanes  # column tiles of a workgroup, tn columns each
    k = pb.kernel(f"{name}_{path}")
    blocks = -(-N // (tiles_per_group * tn))
    gx = min(blocks, MAX_GROUPS)
    groups = (gx, -(-blocks // gx), -(-M // tm))
    k.emit("let lane: i32 = i32(lid.x);")
    k.emit(f"let col0: i32 = ((i32(wid.y) * {gx} + i32(wid.x)) * {tiles_per_group} + i32(lid.y)) * {tn};")
    k.emit(f"let row0: i32 = i32(wid.z) * {tm};")
    # tiles past the last row or column compute real ones (clamped reads) that are written nowhere
    ns = [k.let(f"min(col0 + {c}, {N - 1})", "i32") for c in range(tn)]
    rows_read = [k.let(f"min(row0 + {r}, {M - 1})", "i32") for r in range(tm)]
    if stats is not None:
        token_scale = [stats.read(k, [rows_read[r], "0"]) for r in range(tm)]
        token_inverse = [stats.read(k, [rows_read[r], "1"]) for r in range(tm)]
        token_zero = [stats.read(k, [rows_read[r], "2"]) for r in range(tm)]

    def load_x(r: int, kk: str) -> str:
        v = k.let(cast(x.read(k, [rows_read[r], kk]), x.ty, "f32"), "f32")
        if stats is None:
            return v
        q = k.let(f"clamp(round({v} * {token_inverse[r]}) + {token_zero[r]}, -128.0, 127.0)", "f32")
        return k.let(round_low(k, f"({q} - {token_zero[r]}) * {token_scale[r]}", operand_dtype), "f32")

    acc = [[f"acc{r}_{c}" for c in range(tn)] for r in range(tm)]
    for r in range(tm):
        for c in range(tn):
            k.emit(f"var {acc[r][c]}: f32 = 0.0;")
    k.loop("gi", -(-G // lanes))
    g = k.let(f"lane + gi * {lanes}", "i32")
    k.open(f"if ({g} < {G})")
    scales = [layout.scale(k, n, g) for n in ns]
    zeros = [layout.zero_point(k, n, g) for n in ns]
    k.loop("j", layout.words_per_group)
    codes = [layout.codes(layout.word(k, n, g, "j"), "j") for n in ns]
    for slot, (position, _) in enumerate(codes[0]):
        kk = k.let(f"{g} * {B} + {position}", "i32")
        xs = [load_x(r, kk) for r in range(tm)]
        for c in range(tn):
            w = k.let(round_low(k, layout.dequantized(scales[c], codes[c][slot][1], zeros[c]), operand_dtype), "f32")
            for r in range(tm):
                k.emit(f"{acc[r][c]} = {acc[r][c]} + {xs[r]} * {w};")
    k.close()
    k.close()
    k.close()
    sums = acc
    if lanes > 1:  # the lanes of a column tile add their partial sums in workgroup memory
        flat = combine_lanes(k, lanes, "lane", f"i32(lid.y) * {lanes} + lane", [a for row in acc for a in row])
        sums = [flat[r * tn:(r + 1) * tn] for r in range(tm)]
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
    kern = k.finish(0, workgroup=(lanes, tiles_per_group, 1), groups=groups, group_ids=True)
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
    zero = layout.zero_point(k, row, g)
    for position, code in layout.codes(word, j):
        k.write(out, f"{t} * {cols} + {g} * {layout.block} + {position}", layout.dequantized(s, code, zero), "f32")
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
            return packed_linear(pb, node, scheme, x, [weight], out_features, in_features, bias,
                                 lambda packed: layout_of(scheme, packed, out_features, in_features))

        def embedding(pb, node, weight, indices, num_embeddings, embedding_dim, dtype):
            return packed_embedding(pb, node, scheme, [weight], indices, num_embeddings, embedding_dim)
    else:
        def linear(pb, node, x, weight, scales, bias=None):
            rows, cols = weight.shape[0], weight.shape[1] * 8
            return packed_linear(pb, node, scheme, x, [weight, scales], rows, cols, bias,
                                 lambda packed: layout_of(scheme, packed, rows, cols))

        def embedding(pb, node, weight, scales, indices, dtype):
            return packed_embedding(pb, node, scheme, [weight, scales], indices, weight.shape[0], weight.shape[1] * 8)
    linear.__name__, embedding.__name__ = f"{scheme}_linear", f"{scheme}_embedding"
    register(fmt.linear_op, LINEAR_DTYPES, samples=lambda: linear_samples(scheme), flops="matmul")(linear)
    register(fmt.embedding_op, EMBEDDING_DTYPES, samples=lambda: embedding_samples(scheme))(embedding)


for _scheme in LAYOUTS:
    _register(_scheme)


# --- torchao's integer codes (tapml.intx_linear) ---------------------------------------------

def intx_edge_weight(codes: torch.Tensor, zero_point: torch.Tensor, bits: int) -> None:
    """Plant the edge values into ``codes`` ``[N >= 2, K >= 16]`` and ``zero_point`` ``[N >= 2, G]``
    (in place): row 0's first eight codes the smallest (-8; 8 bits: -128), its next eight the largest
    (7; 127), at a zero point of -128; row 1's first group at a zero point of 127."""
    lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    codes[0, :8], codes[0, 8:16] = lo, hi
    zero_point[0, 0], zero_point[1, 0] = -128, 127


def intx_edge_input(x: torch.Tensor) -> torch.Tensor:
    """``x`` (``[M >= 3, K >= 2]``) with row 0 all zero, row 1 small but for one huge value (1000 at
    its fourth element: per token, every other value of that row rounds to the zero point), and row 2
    of exact ties: from -8 to 7.9375, so that the per-token scale is 1/16 and the zero point 0, its
    other values ``(j + 0.5) / 16``, each ``x * (1 / scale)`` a half that rounds to even."""
    x = x.clone()
    x[0] = 0
    x[1] = x[1] * 0.01
    x[1, 3] = 1000.0
    halves = torch.arange(x.shape[1]) % 255 - 127.5
    x[2] = (halves / 16).to(x.dtype)
    x[2, 0], x[2, 1] = -8.0, 7.9375
    return x


def intx_samples():
    """Seeded samples of ``tapml.intx_linear``: codes of 4 and 8 bits packed by
    :func:`tapml.quant.pack_codes`, groups of 32, 128 and a whole row (per channel), M = 1, 3, 17,
    K = 64, 256 and 4096, N not a multiple of a workgroup's columns, with and without bias, float32 and
    float16 inputs (scales in the input's dtype or float32, as torchao leaves them), the int8 per-token
    activation quantization on and off, and the edge values of :func:`intx_edge_weight` and
    :func:`intx_edge_input` (an all-zero row, a row with one huge value, 3-d inputs)."""
    gen = torch.Generator().manual_seed(35)
    out = []

    def sample(bits, group, m, n, k, bias, dtype, dynamic, edges=False):
        group = group or k
        lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
        codes = torch.randint(lo, hi + 1, (n, k), generator=gen)
        zero_point = torch.randint(lo, hi + 1, (n, k // group), generator=gen).to(torch.int8)
        scale = (torch.rand(n, k // group, generator=gen) * (0.4 if bits == 4 else 0.03) + 0.002).to(dtype)
        x = (torch.rand(m, k, generator=gen) * 4 - 2).to(dtype)
        if edges:
            intx_edge_weight(codes, zero_point, bits)
            x = intx_edge_input(x).reshape(2, m // 2, k)
        b = (torch.randn(n, generator=gen).to(dtype),) if bias else ()
        out.append(((x, pack_codes(codes, bits), scale, zero_point, bits, group, dynamic, *b), {}))

    for params in [(4, 32, 1, 5, 64, False, torch.float32, False), (4, 128, 3, 9, 256, True, torch.float32, False),
                   (8, None, 1, 7, 4096, True, torch.float32, False),
                   (8, None, 17, 67, 256, False, torch.float16, False),
                   (4, 32, 17, 5, 64, True, torch.float16, False), (4, 128, 1, 6, 4096, False, torch.float16, False),
                   (4, 32, 1, 3, 4096, False, torch.float32, True), (4, 32, 3, 9, 256, True, torch.float32, True),
                   (4, 128, 17, 6, 256, False, torch.float16, True), (8, None, 3, 5, 64, True, torch.float32, True),
                   (4, 32, 17, 3, 4096, True, torch.float32, True)]:
        sample(*params)
    for bits, group in ((4, 32), (8, None)):
        for dynamic in (False, True):
            sample(bits, group, 6, 4, 64, dynamic, torch.float32, dynamic, edges=True)
    return out


@register(INTX_LINEAR, LINEAR_DTYPES + ("int8",), samples=intx_samples, flops="matmul")
def intx_linear(pb, node, x, weight, scale, zero_point, bits, group_size, dynamic_activation, bias=None):
    if bits not in (4, 8):
        raise Unsupported(f"intx_linear: {bits}-bit codes (the kernels take 4 and 8)")
    rows, cols = weight.shape[0], weight.shape[1] * 32 // bits
    return packed_linear(pb, node, "intx", x, [weight, scale, zero_point], rows, cols, bias,
                         lambda packed: IntxGroups(rows, cols, packed, bits, group_size), per_token=dynamic_activation,
                         operand_dtype=x.dtype)
