"""``--quantize SCHEME``: a model's linears and token embeddings replaced by packed-weight ones.

Each ``nn.Linear`` (the LM head included) and each ``nn.Embedding`` becomes a module holding the
packed tensors of its weight in the scheme's format (:mod:`tapml.quant`) and calling that format's
op, so an exported graph holds one node per quantized linear or embedding whose inputs are the codes
and scales as stored, and a carve stores their real bytes. The float weights are dropped.

Example::

    from tapml.frontends.quantize import quantize_model
    model = quantize_model(model, "q4_0")      # every Linear and Embedding packed as llama.cpp's Q4_0
"""

from __future__ import annotations

import torch

from tapml.errors import TapmlError
from tapml.quant import FORMATS, GROUP, SCHEMES, check_packed, op, quantize_weight


class QuantizedLinear(torch.nn.Module):
    """A linear whose weight is held packed in ``scheme``; forward is the format's linear op."""

    def __init__(self, linear: torch.nn.Linear, scheme: str, packed: dict | None = None):
        super().__init__()
        self.scheme, self.in_features, self.out_features = scheme, linear.in_features, linear.out_features
        for name, t in (packed or quantize_weight(linear.weight, scheme)).items():
            self.register_buffer(name, t)
        self.bias = linear.bias
        self._op = op(f"{scheme}_linear")

    def forward(self, x):
        if FORMATS[self.scheme].family == "ggml":
            return self._op(x, self.weight, self.out_features, self.in_features, self.bias)
        return self._op(x, self.weight, self.scales, self.bias)

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, scheme={self.scheme}, bias={self.bias is not None}"


class QuantizedEmbedding(torch.nn.Module):
    """A token embedding whose table is held packed in ``scheme``; rows come out in ``dtype``."""

    def __init__(self, embedding: torch.nn.Embedding, scheme: str, packed: dict | None = None):
        super().__init__()
        self.scheme, self.num_embeddings, self.embedding_dim = scheme, embedding.num_embeddings, embedding.embedding_dim
        self.dtype = embedding.weight.dtype
        for name, t in (packed or quantize_weight(embedding.weight, scheme)).items():
            self.register_buffer(name, t)
        self._op = op(f"{scheme}_embedding")

    def forward(self, indices):
        if FORMATS[self.scheme].family == "ggml":
            return self._op(self.weight, indices, self.num_embeddings, self.embedding_dim, self.dtype)
        return self._op(self.weight, self.scales, indices, self.dtype)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, scheme={self.scheme}"


def packed_module(module: torch.nn.Module, scheme: str, packed: dict | None = None) -> torch.nn.Module:
    """The packed replacement of an ``nn.Linear`` or ``nn.Embedding``: its weight quantized in
    ``scheme``, or the ``packed`` tensors given (already in that format, e.g. a GGUF file's blocks)."""
    if packed is not None:
        rows, cols = module.weight.shape
        check_packed(FORMATS[scheme], packed, rows, cols)
    cls = QuantizedLinear if isinstance(module, torch.nn.Linear) else QuantizedEmbedding
    return cls(module, scheme, packed)


def check_scheme(scheme: str) -> str:
    """``scheme`` when it is one of :data:`SCHEMES`, else TapmlError naming them."""
    if scheme not in FORMATS:
        raise TapmlError(f"unknown --quantize scheme {str(scheme)[:40]!r}; choose one of {', '.join(SCHEMES)}")
    return scheme


def quantize_model(model: torch.nn.Module, scheme: str) -> torch.nn.Module:
    """``model`` with every ``nn.Linear`` and ``nn.Embedding`` replaced in place by a packed one of
    ``scheme``. TapmlError when ``model`` is no module (a ``.pt2``), holds none of them, or one of
    them has rows that do not split into groups of 32 (naming it)."""
    check_scheme(scheme)
    if not isinstance(model, torch.nn.Module) or isinstance(model, torch.export.ExportedProgram):
        raise TapmlError("--quantize needs a model that is a module (zoo:, hf:, a checkpoint, FILE.gguf or "
                         "file.py:factory); an exported program (.pt2) or a store is already fixed")
    targets = [(name, m) for name, m in model.named_modules()
               if type(m) in (torch.nn.Linear, torch.nn.Embedding)]
    if not targets:
        raise TapmlError(f"--quantize {scheme}: the model has no nn.Linear or nn.Embedding to quantize")
    for name, m in targets:
        cols = m.in_features if isinstance(m, torch.nn.Linear) else m.embedding_dim
        if cols % GROUP:
            raise TapmlError(f"--quantize {scheme}: {name or 'the model'} has rows of {cols} weights, which do not "
                             f"split into groups of {GROUP}; this model cannot take {scheme}")
    for name, m in targets:
        _replace(model, name, packed_module(m, scheme))
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
        quantized = isinstance(module, (QuantizedLinear, QuantizedEmbedding))
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


__all__ = ["SCHEMES", "QuantizedEmbedding", "QuantizedLinear", "check_scheme", "packed_bytes", "packed_module",
           "quantize_model"]
