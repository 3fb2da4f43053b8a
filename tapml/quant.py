"""Packed-weight formats and the ops that keep a quantized linear or embedding whole in a graph.

A quantized model as it ships holds its weights as codes and scales; its linears dequantize inside
their kernel. tapml keeps each such linear (and embedding) one node of the graph, of an op of its
own namespace (``tapml.q4_0_linear.default``, ...), whose inputs are the packed tensors with their
real bytes. The ops are part of the closed vocabulary (:mod:`tapml.ops`); their CPU kernels here are
the reference: dequantize to float32, then the float32 product.

Formats, each bit for bit as its project defines it:

- ``q4_0``, ``q8_0``, ``q5_0``, ``q4_k``: llama.cpp's blocks along a row (32 weights; Q4_K 256) (ggml/src/ggml-common.h,
  ``block_q4_0``/``block_q8_0``; written by ``gguf.quants.quantize``, gguf-py/gguf/quants.py).
  ``q4_0``: 18 bytes, a float16 scale ``d`` then 16 bytes whose low nibbles are weights 0..15 and
  high nibbles weights 16..31, ``w = d * (q - 8)``. ``q8_0``: 34 bytes, ``d`` then 32 int8 codes,
  ``w = d * q``. ``q5_0``: 22 bytes, ``d``, 4 bytes of fifth bits (bit i for weight i), then the low
  nibbles as in ``q4_0``, ``w = d * (q - 16)``. ``q4_k``: 144-byte super-blocks of 256 weights, a
  float16 ``d`` and ``dmin``, 12 bytes of 6-bit scales and mins of 8 sub-blocks, 128 bytes of codes
  (64 weights per 32 bytes, low nibbles first), ``w = d * sc * q - dmin * m``. The blocks of a
  ``[N, K]`` weight are the row-major bytes of its blocks,
  held as an int32 tensor of those bytes (little-endian words, zero-padded to a whole word).
- ``q4f16_1``, ``q4f32_1``: MLC-LLM's group quantization (python/mlc_llm/quantization/
  group_quantization.py): groups of 32 along a row, eight 4-bit codes per u32 word, lowest nibble
  first, ``w = (q - 7) * scale``; codes ``[N, K/8]`` (int32 holding the u32 bits), scales
  ``[N, K/32]`` in float16 (q4f16_1) or float32 (q4f32_1).

Example::

    from tapml.quant import quantize_weight, dequantize
    packed = quantize_weight(w, "q4_0")            # {"weight": int32 tensor of the blocks' bytes}
    dequantize("q4_0", packed, *w.shape)           # float32, what the kernel computes with
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

GROUP = 32


@dataclass(frozen=True)
class QuantFormat:
    """A packed-weight format: ``family`` ``ggml`` (blocks with their own scale) or ``mlc`` (codes
    and a separate scale tensor); ``block_bytes`` a ggml block's bytes; ``scale_dtype`` an mlc
    format's scale dtype."""

    name: str
    family: str
    bits: int
    block_bytes: int = 0
    scale_dtype: str = "float32"
    block_elems: int = 32  # weights of a row one ggml block holds (Q4_K's super-block: 256)
    #: tapml can write this format itself (``--quantize``); False for a type only read from GGUF files
    quantizable: bool = True

    @property
    def linear_op(self) -> str:
        return f"tapml.{self.name}_linear.default"

    @property
    def embedding_op(self) -> str:
        return f"tapml.{self.name}_embedding.default"


FORMATS = {
    "q4_0": QuantFormat("q4_0", "ggml", 4, block_bytes=18),
    "q8_0": QuantFormat("q8_0", "ggml", 8, block_bytes=34),
    "q5_0": QuantFormat("q5_0", "ggml", 5, block_bytes=22),
    "q4_k": QuantFormat("q4_k", "ggml", 4, block_bytes=144, block_elems=256),
    "q4f16_1": QuantFormat("q4f16_1", "mlc", 4, scale_dtype="float16"),
    "q4f32_1": QuantFormat("q4f32_1", "mlc", 4, scale_dtype="float32"),
}
#: ggml block types a GGUF file may hold that tapml reads but does not write: (bits, weights and bytes
#: per block) as ggml-common.h defines them. Their linears and embeddings stay packed too, ops of
#: their own whose CPU kernel dequantizes with the ``gguf`` package's own dequantizer; a target
#: with no kernel for one gives its nodes an ``unsupported`` verdict naming the op, and the rest of
#: the model is still checked.
_READ_ONLY = {"q4_1": (4, 32, 20), "q5_1": (5, 32, 24), "q2_k": (2, 256, 84), "q3_k": (3, 256, 110),
              "q5_k": (5, 256, 176), "q6_k": (6, 256, 210), "iq4_nl": (4, 32, 18), "iq4_xs": (4, 256, 136)}
FORMATS.update({name: QuantFormat(name, "ggml", bits, block_bytes=nbytes, block_elems=elems, quantizable=False)
                for name, (bits, elems, nbytes) in _READ_ONLY.items()})



@dataclass(frozen=True)
class IntxScheme:
    """A torchao scheme (torchao/quantization/quant_api.py): ``bits``-bit integer weight codes with an
    affine scale and zero point per ``group`` weights of a row (None: per output channel),
    ``dynamic_activation``: the input quantized to int8 per token on the fly (ExecuTorch's 8da4w).
    Its linears are :data:`INTX_LINEAR` nodes; the codes are packed into int32 words, ``32 / bits``
    per word, lowest bits first, two's complement."""

    name: str
    bits: int
    group: int | None
    dynamic_activation: bool = False


INTX_SCHEMES = {
    "int8": IntxScheme("int8", 8, None),
    "int4": IntxScheme("int4", 4, 32),
    "int4_g128": IntxScheme("int4_g128", 4, 128),
    "8da4w": IntxScheme("8da4w", 4, 32, dynamic_activation=True),
}
INTX_LINEAR = "tapml.intx_linear.default"

#: The ``--quantize`` schemes.
SCHEMES = tuple(name for name, fmt in FORMATS.items() if fmt.quantizable) + tuple(INTX_SCHEMES)

#: Op names (``NAME`` of ``tapml.NAME.default``) the vocabulary accepts, with their format (None: torchao's).
OPS = {**{f"{name}_{kind}": fmt for name, fmt in FORMATS.items() for kind in ("linear", "embedding")},
       "intx_linear": None}


def ggml_words(rows: int, cols: int, fmt: QuantFormat) -> int:
    """int32 words holding the blocks of a ``[rows, cols]`` weight in ggml format ``fmt``."""
    return -(-rows * (cols // fmt.block_elems) * fmt.block_bytes // 4)


def check_packed(fmt: QuantFormat, tensors: dict, rows: int, cols: int) -> None:
    """ValueError (saying what is wrong) unless ``tensors`` (``weight``, mlc: ``scales``) hold a
    ``[rows, cols]`` weight in ``fmt``: group-aligned sizes, dtypes and element counts."""
    import torch
    if rows < 0 or cols <= 0 or cols % fmt.block_elems:
        raise ValueError(f"{fmt.name}: a weight of {rows}x{cols} does not split into blocks of {fmt.block_elems} "
                         "along its rows")
    w = tensors["weight"]
    if not isinstance(w, torch.Tensor) or w.dtype != torch.int32:
        raise ValueError(f"{fmt.name}: packed weight must be an int32 tensor")
    if fmt.family == "ggml":
        want = ggml_words(rows, cols, fmt)
        if w.dim() != 1 or w.numel() != want:
            raise ValueError(f"{fmt.name}: packed weight of {rows}x{cols} holds {want} int32 words "
                             f"({rows * cols // fmt.block_elems} blocks of {fmt.block_bytes} bytes), not shape "
                             f"{list(w.shape)}")
        return
    s = tensors["scales"]
    if w.dim() != 2 or tuple(w.shape) != (rows, cols // 8):
        raise ValueError(f"{fmt.name}: codes of a {rows}x{cols} weight have shape [{rows}, {cols // 8}], "
                         f"not {list(w.shape)}")
    # the format stores scales in fmt.scale_dtype; a float32/float64 twin of a graph (tapml.dtypes) widens them
    if not isinstance(s, torch.Tensor) or not s.dtype.is_floating_point or tuple(s.shape) != (rows, cols // GROUP):
        raise ValueError(f"{fmt.name}: scales of a {rows}x{cols} weight are {fmt.scale_dtype} of shape "
                         f"[{rows}, {cols // GROUP}], not {s.dtype} {list(s.shape)}")


def quantize_weight(weight, scheme: str) -> dict:
    """The packed tensors of a float ``[N, K]`` weight in format ``scheme``: ``{"weight": int32}``
    (ggml: the blocks' bytes as ``gguf.quants.quantize`` writes them) or ``{"weight", "scales"}``
    (mlc). K must be a multiple of 32."""
    import torch
    fmt = FORMATS[scheme]
    rows, cols = weight.shape
    w = weight.detach().to(torch.float32)
    if cols % fmt.block_elems:
        raise ValueError(f"{scheme}: rows of {cols} weights do not split into blocks of {fmt.block_elems}")
    if not fmt.quantizable:
        raise ValueError(f"{scheme}: tapml reads this format from GGUF files but does not write it")
    if scheme == "q4_k":
        return {"weight": ggml_tensor(quantize_q4_k(w))}
    if fmt.family == "ggml":
        import gguf
        qtype = gguf.GGMLQuantizationType[scheme.upper()]
        blocks = gguf.quants.quantize(w.numpy(), qtype).reshape(-1)
        return {"weight": ggml_tensor(blocks.tobytes())}
    groups = w.reshape(rows, cols // GROUP, GROUP)
    scale = groups.abs().amax(dim=-1) / 7.0
    scale = scale.to(getattr(torch, fmt.scale_dtype))
    s32 = scale.to(torch.float32).unsqueeze(-1)
    q = torch.where(s32 > 0, torch.round(groups / torch.where(s32 > 0, s32, 1.0)), 0.0) + 7
    q = q.clamp(0, 14).to(torch.int64).reshape(rows, cols // 8, 8)
    shifts = torch.arange(8, dtype=torch.int64) * 4
    words = (q << shifts).sum(dim=-1)
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    return {"weight": words.contiguous(), "scales": scale.contiguous()}


def _shr(x, shift):
    """``x >> shift`` as ``aten.bitwise_right_shift`` (torch's ``>>`` exports as ``aten.__rshift__``, a
    dunder the op vocabulary refuses), so the dequantization traces as ops a graph may hold."""
    import torch
    return torch.bitwise_right_shift(x, shift)


def q4_k_scales(scales):
    """``(sc, m)``, the 6-bit scale and min of each of the 8 sub-blocks of Q4_K super-blocks whose 12
    scale bytes are ``scales`` (``[blocks, 12]`` int64; ggml-quants.c's ``get_scale_min_k4``)."""
    import torch
    q = scales
    lo_sc, lo_m = q[:, 0:4] & 63, q[:, 4:8] & 63
    hi_sc = (q[:, 8:12] & 0xF) | (_shr(q[:, 0:4], 6) * 16)
    hi_m = _shr(q[:, 8:12], 4) | (_shr(q[:, 4:8], 6) * 16)
    return torch.cat([lo_sc, hi_sc], dim=1), torch.cat([lo_m, hi_m], dim=1)


def _dequantize_q4_k(raw, d):
    """Q4_K super-blocks (``[blocks, 144]`` uint8): ``d``, ``dmin``, 12 bytes of 6-bit scales and
    mins, 128 bytes of codes; 64 weights per 32 code bytes, low nibbles first
    (``w = d * sc * q - dmin * m`` per sub-block of 32)."""
    import torch
    dmin = raw[:, 2:4].contiguous().view(torch.float16).to(torch.float32)
    sc, m = q4_k_scales(raw[:, 4:16].to(torch.int64))
    qs = raw[:, 16:].to(torch.int64).reshape(-1, 4, 32)
    q = torch.stack([qs & 0xF, _shr(qs, 4)], dim=2).reshape(-1, 8, 32).to(torch.float32)  # sub-block 2c, 2c+1
    return (d.unsqueeze(-1) * sc.to(torch.float32).unsqueeze(-1) * q
            - dmin.unsqueeze(-1) * m.to(torch.float32).unsqueeze(-1)).reshape(-1, 256)


def quantize_q4_k(w) -> bytes:
    """The Q4_K super-blocks of a float32 ``[N, K]`` weight (K a multiple of 256), laid out as
    ``block_q4_K`` (ggml-common.h). The codes follow from a per-sub-block min/max fit: each sub-block
    of 32 gets ``scale = (max - min) / 15`` and ``min = -min`` (its minimum held at or below zero),
    the super-block's float16 ``d``/``dmin`` are the largest of those over 63, and each sub-block's
    6-bit ``sc``/``m`` and 4-bit codes are rounded against them. (llama.cpp's own quantizer searches
    the scales further; the blocks are the same format either way.)"""
    import numpy as np
    import torch
    x = w.reshape(-1, 8, 32).to(torch.float32)
    lo = torch.clamp(x.amin(dim=-1), max=0.0)
    hi = x.amax(dim=-1)
    scale, mn = (hi - lo) / 15.0, -lo
    d = (scale.amax(dim=-1) / 63.0).to(torch.float16)
    dmin = (mn.amax(dim=-1) / 63.0).to(torch.float16)
    d32, dmin32 = d.to(torch.float32).unsqueeze(-1), dmin.to(torch.float32).unsqueeze(-1)
    sc = torch.where(d32 > 0, torch.round(scale / torch.where(d32 > 0, d32, 1.0)), 0.0).clamp(0, 63).to(torch.int64)
    m = torch.where(dmin32 > 0, torch.round(mn / torch.where(dmin32 > 0, dmin32, 1.0)), 0.0).clamp(0, 63)
    m = m.to(torch.int64)
    step = (d32 * sc).unsqueeze(-1)
    offset = (dmin32 * m).unsqueeze(-1)
    q = torch.where(step > 0, torch.round((x + offset) / torch.where(step > 0, step, 1.0)), 0.0).clamp(0, 15)
    q = q.to(torch.int64).reshape(-1, 4, 2, 32)
    qs = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, 128)
    scales = torch.zeros(x.shape[0], 12, dtype=torch.int64)
    scales[:, 0:4] = sc[:, 0:4] | ((sc[:, 4:8] >> 4) << 6)
    scales[:, 4:8] = m[:, 0:4] | ((m[:, 4:8] >> 4) << 6)
    scales[:, 8:12] = (sc[:, 4:8] & 0xF) | ((m[:, 4:8] & 0xF) << 4)
    halves = torch.stack([d, dmin], dim=1).view(torch.int16).to(torch.int64) & 0xFFFF
    head = torch.stack([halves[:, 0] & 0xFF, halves[:, 0] >> 8, halves[:, 1] & 0xFF, halves[:, 1] >> 8], dim=1)
    blocks = torch.cat([head, scales, qs], dim=1).to(torch.uint8)
    return np.ascontiguousarray(blocks.numpy()).tobytes()


def ggml_tensor(raw: bytes):
    """The int32 tensor holding ggml blocks ``raw`` (little-endian words, zero-padded)."""
    import numpy as np
    import torch
    raw = raw + b"\0" * (-len(raw) % 4)
    return torch.from_numpy(np.frombuffer(raw, dtype="<i4").astype(np.int32))


def ggml_bytes(packed):
    """The bytes of the blocks an int32 ggml tensor holds, as a uint8 tensor."""
    import torch
    return packed.contiguous().view(torch.uint8) if packed.numel() else torch.zeros(0, dtype=torch.uint8)


def dequantize(scheme: str, tensors: dict, rows: int, cols: int):
    """The float32 ``[rows, cols]`` weight that the packed ``tensors`` of format ``scheme`` hold."""
    import torch
    fmt = FORMATS[scheme]
    check_packed(fmt, tensors, rows, cols)
    if fmt.family == "mlc":
        words = tensors["weight"].to(torch.int64) & 0xFFFFFFFF
        shifts = torch.arange(8, dtype=torch.int64) * 4
        codes = (_shr(words.unsqueeze(-1), shifts) & 0xF).reshape(rows, cols)
        scale = tensors["scales"].to(torch.float32).repeat_interleave(GROUP, dim=1)
        return (codes.to(torch.float32) - 7.0) * scale
    nblocks = rows * cols // fmt.block_elems
    raw = ggml_bytes(tensors["weight"])[:nblocks * fmt.block_bytes].reshape(nblocks, fmt.block_bytes)
    if not fmt.quantizable:
        import gguf
        qtype = gguf.GGMLQuantizationType[scheme.upper()]
        return torch.from_numpy(gguf.quants.dequantize(raw.reshape(rows, -1).numpy(), qtype)).reshape(rows, cols)
    d = raw[:, :2].contiguous().view(torch.float16).to(torch.float32)  # [nblocks, 1]
    if scheme == "q4_k":
        return _dequantize_q4_k(raw, d).reshape(rows, cols)
    if scheme == "q8_0":
        q = raw[:, 2:].contiguous().view(torch.int8).to(torch.float32)
    elif scheme == "q5_0":
        high = raw[:, 2:6].contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF  # qh: bit i is weight i's 5th
        bits = (_shr(high, torch.arange(32, dtype=torch.int64)) & 1) * 16
        qs = raw[:, 6:].to(torch.int64)
        q = (torch.cat([qs & 0xF, _shr(qs, 4)], dim=1) | bits).to(torch.float32) - 16.0
    else:
        qs = raw[:, 2:].to(torch.int32)
        q = torch.cat([qs & 0xF, _shr(qs, 4)], dim=1).to(torch.float32) - 8.0
    return (d * q).reshape(rows, cols)


# --- torchao's integer schemes -------------------------------------------------------------

def pack_codes(codes, bits: int):
    """int32 words ``[N, K * bits / 32]`` holding the signed ``bits``-bit ``codes`` ``[N, K]`` (lowest bits first)."""
    import torch
    rows, cols = codes.shape
    per = 32 // bits
    if cols % per:
        raise ValueError(f"rows of {cols} {bits}-bit codes do not fill whole 32-bit words")
    lanes = (codes.to(torch.int64) & ((1 << bits) - 1)).reshape(rows, cols // per, per)
    words = (lanes << (torch.arange(per, dtype=torch.int64) * bits)).sum(dim=-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32).contiguous()


def unpack_codes(words, bits: int):
    """The signed codes ``[N, K]`` that :func:`pack_codes` packed into ``words``."""
    import torch
    per = 32 // bits
    lanes = _shr(words.to(torch.int64).unsqueeze(-1), torch.arange(per, dtype=torch.int64) * bits) & ((1 << bits) - 1)
    lanes = torch.where(lanes >= 1 << (bits - 1), lanes - (1 << bits), lanes)
    return lanes.reshape(words.shape[0], -1)


def check_intx(weight, scale, zero_point, bits: int, group_size: int) -> tuple[int, int]:
    """``(rows, cols)`` of an intx weight; ValueError unless the packed codes, the scales and the
    zero points fit ``bits`` and ``group_size``."""
    import torch
    if bits not in (4, 8):
        raise ValueError(f"intx_linear: bits must be 4 or 8, not {bits}")
    if not isinstance(weight, torch.Tensor) or weight.dtype != torch.int32 or weight.dim() != 2:
        raise ValueError("intx_linear: the packed codes must be a 2-D int32 tensor [out_features, in_features * bits / 32]")
    rows, cols = int(weight.shape[0]), int(weight.shape[1]) * 32 // bits
    if group_size < 1 or cols % group_size:
        raise ValueError(f"intx_linear: group_size {group_size} does not divide the {cols} weights of a row")
    want = (rows, cols // group_size)
    if not scale.dtype.is_floating_point or tuple(scale.shape) != want:
        raise ValueError(f"intx_linear: scale must be floating of shape {list(want)}, not {scale.dtype} {list(scale.shape)}")
    if zero_point.dtype not in (torch.int8, torch.int32) or tuple(zero_point.shape) != want:
        raise ValueError(f"intx_linear: zero_point must be int8 of shape {list(want)}, not {zero_point.dtype} "
                         f"{list(zero_point.shape)}")
    return rows, cols


def dequantize_intx(weight, scale, zero_point, bits: int, group_size: int):
    """The float32 weight of torchao's affine dequantization: ``(q - zero_point) * scale`` per group."""
    import torch
    rows, cols = check_intx(weight, scale, zero_point, bits, group_size)
    q = unpack_codes(weight, bits).to(torch.float32).reshape(rows, cols // group_size, group_size)
    zp = zero_point.to(torch.float32).unsqueeze(-1)
    return ((q - zp) * scale.to(torch.float32).unsqueeze(-1)).reshape(rows, cols)


def quantize_per_token_int8(x):
    """torchao's int8 asymmetric per-token quantization (``int8_asym_per_token``), then back to
    floats: per row of the last dimension, the range stretched to hold zero, 255 steps, the zero
    point rounded, each value ``round(x * (1 / scale)) + zero_point`` clamped to int8."""
    import torch
    xf = x.to(torch.float32)
    lo = torch.clamp(xf.amin(dim=-1, keepdim=True), max=0.0)
    hi = torch.clamp(xf.amax(dim=-1, keepdim=True), min=0.0)
    scale = torch.clamp((hi - lo) / 255.0, min=torch.finfo(torch.float32).smallest_normal)
    zp = torch.clamp(-128 - torch.round(lo / scale), -128, 127)
    q = torch.clamp(torch.round(xf * (1.0 / scale)) + zp, -128, 127)
    return ((q - zp) * scale).to(x.dtype)


def intx_linear_reference(x, weight, scale, zero_point, bits: int, group_size: int, dynamic_activation: bool,
                          bias=None):
    """What ``tapml.intx_linear`` computes (its CPU kernel), in plain torch ops."""
    import torch
    rows, cols = check_intx(weight, scale, zero_point, bits, group_size)
    if not x.dtype.is_floating_point or x.dim() < 1 or x.shape[-1] != cols:
        raise ValueError(f"intx_linear: the input ({x.dtype}, shape {list(x.shape)}) must be floating point with "
                         f"{cols} features, as the weight has")
    if bias is not None and tuple(bias.shape) != (rows,):
        raise ValueError(f"intx_linear: bias must have shape [{rows}], not {list(bias.shape)}")
    if dynamic_activation:
        x = quantize_per_token_int8(x)
    w = dequantize_intx(weight, scale, zero_point, bits, group_size).to(x.dtype)
    return torch.nn.functional.linear(x, w, bias)


# --- the ops ------------------------------------------------------------------------------

def _check_linear(fmt: QuantFormat, x, tensors: dict, rows: int, cols: int, bias) -> None:
    """ValueError unless ``x`` (float, ``[..., cols]``), the packed weight and ``bias`` (``[rows]``) fit together."""
    if not x.dtype.is_floating_point or x.dim() < 1 or x.shape[-1] != cols:
        raise ValueError(f"{fmt.name}_linear: the input ({x.dtype}, shape {list(x.shape)}) must be floating point "
                         f"with {cols} features, as the weight has")
    check_packed(fmt, tensors, rows, cols)
    if bias is not None and (tuple(bias.shape) != (rows,) or not bias.dtype.is_floating_point):
        raise ValueError(f"{fmt.name}_linear: bias must be a floating tensor of shape [{rows}], not {list(bias.shape)}")


def linear_reference(scheme: str, x, tensors: dict, rows: int, cols: int, bias):
    """What ``tapml.SCHEME_linear`` computes (its CPU kernel): the weight dequantized to float32, the
    float32 product, cast to ``x``'s dtype. Plain torch ops, so it also traces as the float chain."""
    import torch
    _check_linear(FORMATS[scheme], x, tensors, rows, cols, bias)
    w = dequantize(scheme, tensors, rows, cols)
    out = torch.nn.functional.linear(x.to(torch.float32), w, None if bias is None else bias.to(torch.float32))
    return out.to(x.dtype)


def _embedding(scheme: str, tensors: dict, indices, rows: int, cols: int, dtype):
    import torch
    if indices.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"{scheme}_embedding: indices must be int64 or int32, not {indices.dtype}")
    if indices.numel() and (int(indices.min()) < 0 or int(indices.max()) >= rows):
        raise ValueError(f"{scheme}_embedding: indices hold {int(indices.min())}..{int(indices.max())}, outside "
                         f"the table's {rows} rows")
    return dequantize(scheme, tensors, rows, cols)[indices].to(dtype)


@functools.lru_cache(maxsize=1)
def define_ops():
    """Define the ``tapml`` ops in torch (once per process): each format's ``NAME_linear`` and
    ``NAME_embedding``, with CPU kernels (the reference) and fake kernels (export, meta sizes)."""
    import torch
    lib = torch.library.Library("tapml", "DEF")
    for name, fmt in FORMATS.items():
        if fmt.family == "ggml":
            lib.define(f"{name}_linear(Tensor input, Tensor weight, int out_features, int in_features, "
                       "Tensor? bias=None) -> Tensor")
            lib.define(f"{name}_embedding(Tensor weight, Tensor indices, int num_embeddings, int embedding_dim, "
                       "ScalarType dtype) -> Tensor")
        else:
            lib.define(f"{name}_linear(Tensor input, Tensor weight, Tensor scales, Tensor? bias=None) -> Tensor")
            lib.define(f"{name}_embedding(Tensor weight, Tensor scales, Tensor indices, ScalarType dtype) -> Tensor")
        _implement(lib, name, fmt)
    lib.define("intx_linear(Tensor input, Tensor weight, Tensor scale, Tensor zero_point, int bits, int group_size, "
               "bool dynamic_activation, Tensor? bias=None) -> Tensor")
    lib.impl("intx_linear", intx_linear_reference, "CompositeExplicitAutograd")

    def intx_fake(x, weight, scale, zero_point, bits, group_size, dynamic_activation, bias=None):
        rows, cols = check_intx(weight, scale, zero_point, bits, group_size)
        if x.shape[-1] != cols:
            raise ValueError(f"intx_linear: the input has {x.shape[-1]} features, the weight {cols}")
        return x.new_empty((*x.shape[:-1], rows))
    _register_fake(lib, "intx_linear", intx_fake)
    _LIBRARIES.append(lib)
    return True


_LIBRARIES: list = []  # a Library's definitions last as long as the object


def _mlc_dims(fmt: QuantFormat, codes) -> tuple[int, int]:
    """``(rows, cols)`` of the weight whose codes are ``codes`` (``[rows, cols / 8]``)."""
    if codes.dim() != 2:
        raise ValueError(f"{fmt.name}: codes must be a 2-D tensor [rows, cols / 8], not shape {list(codes.shape)}")
    return int(codes.shape[0]), int(codes.shape[1]) * 8


def _implement(lib, name: str, fmt: QuantFormat) -> None:
    import torch
    if fmt.family == "ggml":
        def linear(x, weight, out_features, in_features, bias=None):
            return linear_reference(name, x, {"weight": weight}, out_features, in_features, bias)

        def embedding(weight, indices, num_embeddings, embedding_dim, dtype):
            return _embedding(name, {"weight": weight}, indices, num_embeddings, embedding_dim, dtype)

        def linear_fake(x, weight, out_features, in_features, bias=None):
            _check_linear(fmt, x, {"weight": weight}, out_features, in_features, bias)
            return x.new_empty((*x.shape[:-1], out_features))

        def embedding_fake(weight, indices, num_embeddings, embedding_dim, dtype):
            check_packed(fmt, {"weight": weight}, num_embeddings, embedding_dim)
            return torch.empty((*indices.shape, embedding_dim), dtype=dtype, device=weight.device)
    else:
        def linear(x, weight, scales, bias=None):
            return linear_reference(name, x, {"weight": weight, "scales": scales}, *_mlc_dims(fmt, weight), bias)

        def embedding(weight, scales, indices, dtype):
            return _embedding(name, {"weight": weight, "scales": scales}, indices, *_mlc_dims(fmt, weight), dtype)

        def linear_fake(x, weight, scales, bias=None):
            _check_linear(fmt, x, {"weight": weight, "scales": scales}, *_mlc_dims(fmt, weight), bias)
            return x.new_empty((*x.shape[:-1], weight.shape[0]))

        def embedding_fake(weight, scales, indices, dtype):
            rows, cols = _mlc_dims(fmt, weight)
            check_packed(fmt, {"weight": weight, "scales": scales}, rows, cols)
            return torch.empty((*indices.shape, cols), dtype=dtype, device=weight.device)
    lib.impl(f"{name}_linear", linear, "CompositeExplicitAutograd")
    lib.impl(f"{name}_embedding", embedding, "CompositeExplicitAutograd")
    _register_fake(lib, f"{name}_linear", linear_fake)
    _register_fake(lib, f"{name}_embedding", embedding_fake)


def _register_fake(lib, name: str, fake) -> None:
    """Register ``fake`` as the meta kernel of ``tapml::NAME``, its refusals raised as RuntimeError,
    as torch's own meta kernels refuse arguments (:func:`tapml.meta_sizes.meta_results`)."""
    import functools

    import torch

    @functools.wraps(fake)
    def refusing(*args, **kwargs):
        try:
            return fake(*args, **kwargs)
        except ValueError as e:
            raise RuntimeError(str(e)) from None
    torch.library.register_fake(f"tapml::{name}", refusing, lib=lib)


def packed_op_name(op_name: str) -> str | None:
    """``NAME`` of a packed-weight op ``tapml.NAME.default`` (a key of :data:`OPS`), None for any other op."""
    name = op_name.removeprefix("tapml.").removesuffix(".default")
    return name if op_name.startswith("tapml.") and op_name.endswith(".default") and name in OPS else None


def packed_op_format(op_name: str) -> QuantFormat | None:
    """The format of a packed linear or embedding op (``tapml.q4_0_linear.default`` -> q4_0); None for
    torchao's ``intx_linear`` and any other op."""
    name = packed_op_name(op_name)
    return OPS.get(name) if name is not None else None


def packed_positions(op_name: str) -> tuple[int, ...]:
    """Positions of the arguments of packed-weight op ``op_name`` (``tapml.NAME.default``) that hold
    its packed tensors -- codes, scales, zero points, never the input or the bias -- by its schema
    in :func:`define_ops`; empty for any other op."""
    name = packed_op_name(op_name)
    if name is None:
        return ()
    if name == "intx_linear":
        return (1, 2, 3)
    fmt = OPS[name]
    first = 1 if name.endswith("_linear") else 0
    return (first,) if fmt.family == "ggml" else (first, first + 1)


def op(name: str):
    """``torch.ops.tapml.NAME.default`` for a name of :data:`OPS` (the ops defined first)."""
    import torch
    define_ops()
    return getattr(getattr(torch.ops.tapml, name), "default")


__all__ = ["FORMATS", "GROUP", "INTX_LINEAR", "linear_reference", "intx_linear_reference", "INTX_SCHEMES", "IntxScheme", "OPS", "SCHEMES", "check_intx",
           "dequantize_intx", "pack_codes", "quantize_per_token_int8", "unpack_codes", "QuantFormat", "check_packed", "define_ops", "dequantize", "ggml_bytes",
           "ggml_tensor", "ggml_words", "op", "packed_op_format", "packed_op_name", "packed_positions", "quantize_weight"]
