"""How much a ``--quantize`` scheme changes a model: its quality against the float model.

This is the model's own loss of accuracy, not a port's fault, so it is reported apart from every
verdict (``tapml precision MODEL --quantize SCHEME``, the ``quantization`` part of its JSON). Both
models run on the reference (torch on the CPU) in float32 on the same tokens:

- per quantized linear or embedding, the SQNR of its output against the float model's same
  module (``10·log10(Σ ref² / Σ (ref − quantized)²)`` dB, each on the inputs its own model gives it);
- on the logits, as llama.cpp's ``--kl-divergence`` reports them: the mean KL divergence of the
  quantized model's next-token distribution from the float one's, the share of positions whose
  top-1 token is the same, and each model's perplexity on the tokens (a causal LM: position ``i``
  predicts token ``i + 1``).

Example::

    doc = quantization_quality("zoo:tiny-llama", "q4_0")
    doc["mean_kl"], doc["top1_agreement"], doc["layers"][0]["sqnr_db"]
"""

from __future__ import annotations

import math

from tapml.errors import TapmlError


def quantization_quality(spec: str, scheme: str, *, seed: int = 0, hf_config: dict | None = None,
                         token_ids: list[int] | None = None) -> dict:
    """The quality document of ``spec`` quantized in ``scheme`` against ``spec`` in float32 (module
    docstring). ``token_ids``: the tokens to run (a text through the model's tokenizer); None runs
    the model's example inputs. TapmlError when the model takes no such tokens or has no outputs
    to compare."""
    import copy

    import torch

    from tapml.frontends.models import load_model
    from tapml.frontends.quantize import QuantizedEmbedding, QuantizedLinear, packed_bytes, quantize_model
    float_model, inputs = load_model(spec, seed=seed, hf_config=hf_config)
    quantized = quantize_model(copy.deepcopy(float_model), scheme)  # the same weights, loaded once
    if token_ids is not None:
        vocab = getattr(getattr(float_model, "config", None), "vocab_size", None)
        if not isinstance(vocab, int):
            raise TapmlError(f"{spec} takes no token ids (no config.vocab_size): --text-file needs a language model")
        if max(token_ids) >= vocab:
            raise TapmlError(f"the text's token {max(token_ids)} is outside {spec}'s vocabulary of {vocab}")
        inputs = (torch.tensor([token_ids], dtype=torch.long),)
    packed = {name for name, m in quantized.named_modules() if isinstance(m, (QuantizedLinear, QuantizedEmbedding))}
    outputs: dict[str, dict] = {"float": {}, "quantized": {}}
    hooks = []
    for which, model in (("float", float_model), ("quantized", quantized)):
        for name, module in model.named_modules():
            if name in packed:
                hooks.append(module.register_forward_hook(
                    lambda m, args, out, name=name, which=which: outputs[which].setdefault(name, out.detach())))
    try:
        with torch.no_grad():
            ref, got = _logits(float_model(*inputs)), _logits(quantized(*inputs))
    finally:
        for h in hooks:
            h.remove()
    if ref is None or got is None or ref.shape != got.shape:
        raise TapmlError(f"{spec}: no logits (or other tensor output) to compare between the float and the "
                         f"{scheme} model")
    layers = [{"module": name, "kind": "embedding" if isinstance(quantized.get_submodule(name), QuantizedEmbedding)
               else "linear", "sqnr_db": sqnr_db(outputs["float"][name], outputs["quantized"][name])}
              for name in sorted(packed, key=_depth_key(quantized)) if name in outputs["float"]]
    doc = {"scheme": scheme, "reference": "float32, torch on the CPU", "tokens": int(ref.shape[:-1].numel()),
           "text": token_ids is not None, "layers": layers, **logit_agreement(ref, got),
           "weight_bytes": packed_bytes(quantized)}
    float_bytes = sum(m.weight.numel() * m.weight.element_size() for name, m in float_model.named_modules()
                      if name in packed)
    doc["weight_bytes"]["float_of_packed"] = int(float_bytes)
    if token_ids is not None or _is_token_input(inputs):
        ids = inputs[0]
        doc["perplexity"] = {"float": perplexity(ref, ids), "quantized": perplexity(got, ids)}
    return doc


def sqnr_db(ref, got) -> float | None:
    """Signal to quantization noise of ``got`` against ``ref`` in dB; None when not defined (the two
    equal, or ``ref`` zero)."""
    import torch
    ref, got = ref.double(), got.double()
    signal, noise = float(torch.sum(ref * ref)), float(torch.sum((ref - got) ** 2))
    if signal == 0:
        return None
    return None if noise == 0 else 10 * math.log10(signal / noise)


def logit_agreement(ref, got) -> dict:
    """``mean_kl`` (KL(ref || got) per position, nats, averaged), ``max_kl`` and ``top1_agreement``
    (share of positions with the same argmax) of two logits tensors ``[..., vocab]``."""
    import torch
    ref, got = ref.double().reshape(-1, ref.shape[-1]), got.double().reshape(-1, got.shape[-1])
    p_log, q_log = torch.log_softmax(ref, -1), torch.log_softmax(got, -1)
    kl = torch.sum(p_log.exp() * (p_log - q_log), dim=-1).clamp_min(0)
    return {"mean_kl": float(kl.mean()), "max_kl": float(kl.max()),
            "top1_agreement": float((ref.argmax(-1) == got.argmax(-1)).double().mean())}


def perplexity(logits, ids) -> float | None:
    """exp of the mean negative log-likelihood of ``ids[:, 1:]`` under ``logits[:, :-1]`` (None for one token)."""
    import torch
    if ids.shape[-1] < 2:
        return None
    logp = torch.log_softmax(logits[:, :-1].double(), -1)
    nll = -logp.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    return float(torch.exp(nll.mean()))


def _logits(out):
    import torch
    if isinstance(out, torch.Tensor):
        return out
    logits = getattr(out, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    return None


def _is_token_input(inputs) -> bool:
    import torch
    return len(inputs) >= 1 and isinstance(inputs[0], torch.Tensor) and inputs[0].dtype == torch.long \
        and inputs[0].dim() == 2


def _depth_key(model):
    order = {name: i for i, (name, _) in enumerate(model.named_modules())}
    return lambda name: order.get(name, 0)


__all__ = ["quantization_quality", "sqnr_db", "logit_agreement", "perplexity"]
