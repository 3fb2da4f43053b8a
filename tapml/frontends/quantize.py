"""``--quantize SCHEME``: a model's linears and token embeddings replaced by packed-weight ones.

llama.cpp's and MLC-LLM's formats (``q4_0``, ``q8_0``, ``q4f16_1``, ``q4f32_1``): each ``nn.Linear``
(the LM head included) and each ``nn.Embedding`` becomes a module holding the packed tensors of its
weight in the scheme's format (:mod:`tapml.quant`) and calling that format's op. torchao's schemes
(``int8``, ``int4``, ``int4_g128``, ``8da4w``): each ``nn.Linear`` is quantized by torchao's own
config (``quantize_``) and becomes an :class:`IntxLinear` holding torchao's codes (packed into
words), scales and zero points. Either way an exported graph holds one node per quantized linear or
embedding whose inputs are the codes and scales as stored, and a carve stores their real bytes. The
float weights are dropped.

Example::

    from tapml.frontends.quantize import quantize_model
    model = quantize_model(model, "q4_0")      # every Linear and Embedding packed as llama.cpp's Q4_0
"""

from __future__ import annotations

import torch

from tapml.errors import TapmlError
from tapml.quant import (FORMATS, GROUP, INTX_SCHEMES, SCHEMES, check_packed, dequantize, intx_linear_reference,
                         linear_reference, op, pack_codes, quantize_weight)


#: ``--quantized-ops``: ``whole``, each quantized linear one tapml op (what a port runs), or
#: ``expand``, the op's reference computation traced in its place, so the graph holds the float chain
#: (bytes and nibbles picked with shifts and masks, scales, the dequantized weight, then the product)
#: as aten ops, each a case of its own.
QUANTIZED_OPS = ("whole", "expand")


def _packed_tensors(module) -> dict:
    """The packed tensors a :class:`QuantizedLinear` or :class:`QuantizedEmbedding` holds, as
    :mod:`tapml.quant` takes them (ggml: ``weight``; mlc: ``weight`` and ``scales``)."""
    if FORMATS[module.scheme].family == "ggml":
        return {"weight": module.weight}
    return {"weight": module.weight, "scales": module.scales}


class QuantizedLinear(torch.nn.Module):
    """A linear whose weight is held packed in ``scheme``; forward is the format's linear op (with
    ``expand``: its reference computation, traced as aten ops)."""

    def __init__(self, linear: torch.nn.Linear, scheme: str, packed: dict | None = None, expand: bool = False):
        super().__init__()
        self.scheme, self.in_features, self.out_features = scheme, linear.in_features, linear.out_features
        for name, t in (packed or quantize_weight(linear.weight, scheme)).items():
            self.register_buffer(name, t)
        self.bias = linear.bias
        self.expand = expand
        self._op = op(f"{scheme}_linear")

    def forward(self, x):
        if self.expand:
            return linear_reference(self.scheme, x, _packed_tensors(self), self.out_features, self.in_features,
                                    self.bias)
        if FORMATS[self.scheme].family == "ggml":
            return self._op(x, self.weight, self.out_features, self.in_features, self.bias)
        return self._op(x, self.weight, self.scales, self.bias)

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, scheme={self.scheme}, bias={self.bias is not None}"


class QuantizedEmbedding(torch.nn.Module):
    """A token embedding whose table is held packed in ``scheme``; rows come out in ``dtype``."""

    def __init__(self, embedding: torch.nn.Embedding, scheme: str, packed: dict | None = None, expand: bool = False):
        super().__init__()
        self.scheme, self.num_embeddings, self.embedding_dim = scheme, embedding.num_embeddings, embedding.embedding_dim
        self.dtype = embedding.weight.dtype
        for name, t in (packed or quantize_weight(embedding.weight, scheme)).items():
            self.register_buffer(name, t)
        self.expand = expand
        self._op = op(f"{scheme}_embedding")

    def forward(self, indices):
        if self.expand:
            table = dequantize(self.scheme, _packed_tensors(self), self.num_embeddings, self.embedding_dim)
            return table[indices].to(self.dtype)
        if FORMATS[self.scheme].family == "ggml":
            return self._op(self.weight, indices, self.num_embeddings, self.embedding_dim, self.dtype)
        return self._op(self.weight, self.scales, indices, self.dtype)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, scheme={self.scheme}"


class IntxLinear(torch.nn.Module):
    """A linear quantized by torchao (:data:`tapml.quant.INTX_SCHEMES`): its codes packed into
    int32 words, torchao's scale and zero point per group; forward is ``tapml.intx_linear``."""

    def __init__(self, linear: torch.nn.Linear, scheme: str, codes, scale, zero_point, expand: bool = False):
        super().__init__()
        s = INTX_SCHEMES[scheme]
        self.scheme, self.in_features, self.out_features = scheme, linear.in_features, linear.out_features
        self.bits, self.group_size, self.dynamic_activation = s.bits, int(linear.in_features // scale.shape[1]), \
            s.dynamic_activation
        self.register_buffer("weight", pack_codes(codes, s.bits))
        self.register_buffer("scale", scale.detach().clone())
        self.register_buffer("zero_point", zero_point.detach().to(torch.int8).clone())
        self.bias = None if linear.bias is None else torch.nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
        self.expand = expand
        self._op = op("intx_linear")

    def forward(self, x):
        if self.expand:
            return intx_linear_reference(x, self.weight, self.scale, self.zero_point, self.bits, self.group_size,
                                         self.dynamic_activation, self.bias)
        return self._op(x, self.weight, self.scale, self.zero_point, self.bits, self.group_size,
                        self.dynamic_activation, self.bias)

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, scheme={self.scheme}, group={self.group_size}"


def _import_torchao():
    """``torchao.quantization`` (imported here, not at tapml's import: it is heavy)."""
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import torchao.quantization as tq
        import torchao.quantization.granularity  # noqa: F401
    return tq


def torchao_config(scheme: str):
    """torchao's config of an :data:`INTX_SCHEMES` scheme."""
    tq = _import_torchao()
    from torchao.quantization.granularity import PerGroup
    s = INTX_SCHEMES[scheme]
    if s.bits == 8:
        return tq.Int8WeightOnlyConfig()
    if s.dynamic_activation:
        return tq.Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4, weight_granularity=PerGroup(s.group))
    return tq.IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(s.group))


def _quantize_with_torchao(model: torch.nn.Module, scheme: str, targets: list, expand: bool = False) -> None:
    """Quantize the ``targets`` (``(name, nn.Linear)``) with torchao's config of ``scheme``, then
    replace each by an :class:`IntxLinear` holding torchao's codes, scales and zero points."""
    import contextlib
    import io
    quantize_ = _import_torchao().quantize_
    for name, linear in targets:
        holder = torch.nn.Sequential(torch.nn.Linear(linear.in_features, linear.out_features,
                                                     bias=linear.bias is not None, dtype=linear.weight.dtype))
        with torch.no_grad():
            holder[0].weight.copy_(linear.weight)
            if linear.bias is not None:
                holder[0].bias.copy_(linear.bias)
        with contextlib.redirect_stdout(io.StringIO()):
            quantize_(holder, torchao_config(scheme))
        w = holder[0].weight
        codes, scale, zero_point = (getattr(w, k, None) for k in ("qdata", "scale", "zero_point"))
        if codes is None or scale is None:
            raise TapmlError(f"--quantize {scheme}: torchao left {name} as {type(w).__name__}, with no codes and scales")
        if zero_point is None:
            zero_point = torch.zeros_like(scale, dtype=torch.int8)
        scale, zero_point = scale.reshape(linear.out_features, -1), zero_point.reshape(linear.out_features, -1)
        _replace(model, name, IntxLinear(linear, scheme, codes, scale, zero_point, expand))


def packed_module(module: torch.nn.Module, scheme: str, packed: dict | None = None,
                  expand: bool = False) -> torch.nn.Module:
    """The packed replacement of an ``nn.Linear`` or ``nn.Embedding``: its weight quantized in
    ``scheme``, or the ``packed`` tensors given (already in that format, e.g. a GGUF file's blocks)."""
    if packed is not None:
        rows, cols = module.weight.shape
        check_packed(FORMATS[scheme], packed, rows, cols)
    cls = QuantizedLinear if isinstance(module, torch.nn.Linear) else QuantizedEmbedding
    return cls(module, scheme, packed, expand)


#: llama.cpp's stand-in for a k-quant whose rows do not split into 256-weight super-blocks
#: (src/llama-quant.cpp, the fallback when a tensor's row length is not a multiple of QK_K).
K_QUANT_FALLBACK = {"q4_k": "q5_0"}


def row_scheme(scheme: str, cols: int) -> str:
    """The format a weight with rows of ``cols`` takes under ``scheme``: the scheme itself, or
    llama.cpp's fallback (:data:`K_QUANT_FALLBACK`) for a k-quant whose super-blocks do not fit."""
    fmt = FORMATS.get(scheme)
    if fmt is not None and cols % fmt.block_elems and scheme in K_QUANT_FALLBACK:
        return K_QUANT_FALLBACK[scheme]
    return scheme


def check_scheme(scheme: str) -> str:
    """``scheme`` when it is one of :data:`SCHEMES`, else TapmlError naming them."""
    if scheme not in SCHEMES:
        raise TapmlError(f"unknown --quantize scheme {str(scheme)[:40]!r}; choose one of {', '.join(SCHEMES)}")
    return scheme


def quantize_model(model: torch.nn.Module, scheme: str, quantized_ops: str = "whole") -> torch.nn.Module:
    """``model`` with every ``nn.Linear`` and ``nn.Embedding`` replaced in place by a packed one of
    ``scheme``. TapmlError when ``model`` is no module (a ``.pt2``), holds none of them, or one of
    them has rows that do not split into groups of 32 (naming it). ``quantized_ops`` (one of
    :data:`QUANTIZED_OPS`): ``expand`` traces each quantized module's reference computation (the float
    chain) in place of its op."""
    check_scheme(scheme)
    if quantized_ops not in QUANTIZED_OPS:
        raise TapmlError(f"--quantized-ops {str(quantized_ops)[:40]!r}: choose {' or '.join(QUANTIZED_OPS)}")
    expand = quantized_ops == "expand"
    if not isinstance(model, torch.nn.Module) or isinstance(model, torch.export.ExportedProgram):
        raise TapmlError("--quantize needs a model that is a module (zoo:, hf:, a checkpoint, FILE.gguf or "
                         "file.py:factory); an exported program (.pt2) or a store is already fixed")
    intx = INTX_SCHEMES.get(scheme)
    kinds = (torch.nn.Linear,) if intx else (torch.nn.Linear, torch.nn.Embedding)
    targets = [(name, m) for name, m in model.named_modules() if type(m) in kinds]
    if not targets:
        raise TapmlError(f"--quantize {scheme}: the model has no {' or '.join(k.__name__ for k in kinds)} to quantize")
    group = (intx.group or 32 // intx.bits) if intx else GROUP
    for name, m in targets:
        if not name:
            raise TapmlError("--quantize needs a model that holds linears, not one that is a single nn.Linear")
        cols = m.in_features if isinstance(m, torch.nn.Linear) else m.embedding_dim
        if cols % group or cols % (32 // (intx.bits if intx else 4)):
            raise TapmlError(f"--quantize {scheme}: {name} has rows of {cols} weights, which do not split into groups "
                             f"of {group}; this model cannot take {scheme}")
    if intx:
        _quantize_with_torchao(model, scheme, targets, expand)
        return model
    for name, m in targets:
        _replace(model, name, packed_module(m, row_scheme(scheme, m.weight.shape[1]), expand=expand))
    # tied weights (an LM head sharing the embedding) are now two packed copies; transformers must not re-tie
    config = getattr(model, "config", None)
    if config is not None and getattr(config, "tie_word_embeddings", False):
        config.tie_word_embeddings = False
    return model


def _replace(model: torch.nn.Module, name: str, new: torch.nn.Module) -> None:
    if not name:
        raise TapmlError("--quantize needs a model that holds linears, not one that is a single nn.Linear")
    parent_name, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, attr, new)


def packed_bytes(model: torch.nn.Module) -> dict:
    """``{"packed": bytes of packed weights and scales, "float": bytes of the other parameters and buffers}``."""
    packed = float_ = 0
    seen = set()
    for module in model.modules():
        quantized = isinstance(module, (QuantizedLinear, QuantizedEmbedding, IntxLinear))
        for t in list(module.parameters(recurse=False)) + list(module.buffers(recurse=False)):
            if id(t) in seen:
                continue
            seen.add(id(t))
            n = t.numel() * t.element_size()
            if quantized and t is not getattr(module, "bias", None):
                packed += n
            else:
                float_ += n
    return {"packed": packed, "float": float_}


__all__ = ["QUANTIZED_OPS", "SCHEMES", "IntxLinear", "QuantizedEmbedding", "QuantizedLinear", "torchao_config", "check_scheme", "packed_bytes", "packed_module",
           "quantize_model"]
