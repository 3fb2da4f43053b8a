"""MODEL specs: ``zoo:NAME``, ``hf:MODEL_TYPE``, ``path/file.py:factory``, ``file.pt2``, and the
checkpoints of :mod:`tapml.frontends.checkpoint` (a ``save_pretrained`` folder, ``hf:ORG/NAME``).

:func:`load_model` turns a spec into ``(model, example_inputs)``; :func:`tapml.frontends.capture.capture`
turns that into an exported core-ATen program. Weights and inputs are random and
deterministic: the same seed gives the same model and the same inputs.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import torch

from tapml.errors import TapmlError

SEQ_LEN = 16

# Small sizes applied to every key a config has (ARCHITECTURE.md: hidden 64, 2 layers, 4 heads, vocab 256).
_SMALL = {
    ("hidden_size", "n_embd", "d_model", "dim", "embed_dim"): 64,
    ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "encoder_layers", "decoder_layers"): 2,
    ("num_attention_heads", "n_head", "n_heads", "encoder_attention_heads", "decoder_attention_heads"): 4,
    ("num_key_value_heads", "multi_query_group_num"): 2,
    ("vocab_size",): 256,
    # not "hidden_dim": EfficientNet's must equal the width its last conv derives
    ("intermediate_size", "n_inner", "ffn_dim", "encoder_ffn_dim", "decoder_ffn_dim", "moe_intermediate_size",
     "shared_expert_intermediate_size"): 128,
    ("num_experts", "num_local_experts", "n_routed_experts"): 4,
    ("num_experts_per_tok",): 2,
    ("head_dim",): 16,
    ("max_position_embeddings", "n_positions", "n_ctx", "max_target_positions"): 128,
    # Whisper's encoder takes exactly 2 x max_source_positions feature frames: the 2 x SEQ_LEN example_inputs makes
    ("max_source_positions",): SEQ_LEN,
}
# Per-stage lists of hierarchical models (Swin, SegFormer, ResNet...): the stage count stays (other
# lists follow it), each stage gets one block, at most 4 heads (a power of two, so that they divide
# the widths) and a quarter of its width, rounded up to a multiple of 16.
_STAGE_DEPTHS = ("depths", "depth", "num_block_repeats", "num_blocks")
_STAGE_HEADS = ("num_heads", "num_attention_heads")
_STAGE_WIDTHS = ("hidden_sizes", "embed_dims", "embed_dim", "neck_hidden_sizes", "dims", "widths", "hidden_dims")
_IMAGE_SIZE = 64


def _zoo_mlp():
    model = torch.nn.Sequential(
        torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.GELU(),
        torch.nn.LayerNorm(64), torch.nn.Linear(64, 10), torch.nn.Softmax(dim=-1))
    return model, (torch.randn(4, 32),)


class _SmallCNN(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8),
                                        torch.nn.ReLU(), torch.nn.MaxPool2d(2))
        self.block = torch.nn.Sequential(torch.nn.Conv2d(8, 16, 3, stride=2, padding=1, groups=2),
                                         torch.nn.BatchNorm2d(16), torch.nn.SiLU(),
                                         torch.nn.Conv2d(16, 16, 3, padding=2, dilation=2))
        self.head = torch.nn.Linear(16, 10)

    def forward(self, x):
        x = self.block(self.stem(x))
        return self.head(x.mean(dim=(2, 3)))


def _zoo_cnn():
    model = _SmallCNN()
    with torch.no_grad():  # non-trivial running statistics, so batch norm is really exercised
        for m in model.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 1.5)
    return model, (torch.randn(2, 3, 16, 16),)


class _SumOfSquares(torch.nn.Module):
    """An energy term ``0.001 * sum((300 x)^2)``: the squares pass float16's 65504, so in float16
    the sum, and the model's output, become Inf (the energy itself, ~1e3, fits)."""

    def forward(self, x):
        return (x * 300).pow(2).sum(-1, keepdim=True) * 0.001


class _Fp16Overflow(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(16, 16)
        self.energy = _SumOfSquares()

    def forward(self, x):
        return self.proj(x) * self.energy(x)


class _ScaledRMSNorm(torch.nn.Module):
    """RMSNorm of ``300 x``: the mean of squares passes float16's 65504 and becomes Inf, rsqrt turns
    the Inf into 0, so in float16 the output is finite and wrong (all zeros)."""

    def __init__(self, dim: int):
        super().__init__()
        self.weight = torch.nn.Parameter(1 + 0.1 * torch.randn(dim))

    def forward(self, x):
        h = x * 300
        return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class _Fp16Absorbed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = _ScaledRMSNorm(64)
        self.head = torch.nn.Linear(64, 8)

    def forward(self, x):
        return self.head(self.norm(x))


class _Fp16Sum(torch.nn.Module):
    """A linear layer and the sum of its outputs: torch's ONNX exporter (2.13) computes a float16
    ``sum`` in float32 and drops the cast back, so the ONNX model's output is float32."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(16, 8)

    def forward(self, x):
        return self.proj(x).sum(-1)


class _LlamaRope4k(torch.nn.Module):
    """A llama's rotary embedding (transformers' own ``LlamaRotaryEmbedding`` and ``apply_rotary_pos_emb``)
    applied to queries and keys at positions 0..4095: a long prompt, so ``sin``/``cos`` see angles up
    to 4095 radians, where onnxruntime-web's WebGPU kernels lose digits (1.9e-4 at 200)."""

    def __init__(self, heads: int = 2, head_dim: int = 16):
        super().__init__()
        from transformers import LlamaConfig
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
        config = LlamaConfig(hidden_size=heads * head_dim, num_attention_heads=heads, max_position_embeddings=4096)
        self.rotary = LlamaRotaryEmbedding(config)

    def forward(self, q, k, positions):
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
        cos, sin = self.rotary(q, positions)
        return apply_rotary_pos_emb(q, k, cos, sin)


def _zoo_llama_rope_4k():
    return _LlamaRope4k(), (torch.randn(1, 2, 4096, 16), torch.randn(1, 2, 4096, 16), torch.arange(4096)[None])


def _hf_zoo(model_type: str, **overrides) -> Callable:
    build = lambda: build_hf(model_type, overrides)  # noqa: E731
    build.hf = (model_type, overrides)  # what load_causal_lm rebuilds with its cache enabled
    return build


ZOO: dict[str, Callable[[], tuple]] = {
    "mlp": _zoo_mlp,
    "cnn": _zoo_cnn,
    "tiny-llama": _hf_zoo("llama"),
    "tiny-gpt2": _hf_zoo("gpt2"),
    "tiny-bert": _hf_zoo("bert"),
    "tiny-vit": _hf_zoo("vit", image_size=32, patch_size=8),
    "tiny-resnet": _hf_zoo("resnet", embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], layer_type="basic"),
    # Planted float16 overflows, for `tapml precision --dtype float16` (float32 models and inputs).
    "fp16-overflow": lambda: (_Fp16Overflow(), (torch.randn(4, 16),)),
    "fp16-absorbed": lambda: (_Fp16Absorbed(), (torch.randn(4, 64),)),
    # A planted route bug, for `--dtype float16` on the `ort` target: the exporter drops a cast.
    "fp16-sum": lambda: (_Fp16Sum(), (torch.randn(4, 16),)),
    # Rotary angles of a long prompt, for the `ort-web:webgpu` target: its sin and cos lose digits there.
    "llama-rope-4k": _zoo_llama_rope_4k,
}


def parse_hf_overrides(items: list[str] | None, option: str = "--hf-config") -> dict:
    """``["hidden_size=32", "hidden_act=gelu"]`` -> dict with JSON-ish values (``option``: the
    flag they came from, for the message)."""
    out = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise TapmlError(f"{option} takes KEY=VALUE, got {item!r}")
        try:
            out[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            out[key.strip()] = value
    return out


def _export_settings(config, use_cache: bool) -> None:
    """Settings every exported transformers model gets: the cache on or off, eager attention,
    batched mixture-of-experts (every token through its top-k experts with gathered weights: the
    grouped-matmul default is a ``transformers::`` custom op, and the eager loop over the experts
    hit has a data-dependent length that does not export)."""
    config.use_cache = use_cache
    for setting, value in (("_attn_implementation", "eager"), ("_experts_implementation", "batched_mm")):
        if hasattr(config, setting):
            try:
                setattr(config, setting, value)
            except Exception:  # noqa: BLE001 - read-only on some configs; the default is fine then
                pass


def build_hf(model_type: str, overrides: dict | None = None):
    """A tiny random-init transformers model of ``model_type`` and its example inputs.

    The config is shrunk by :func:`_small_config`; the inputs are those the model's ``forward``
    needs (:func:`example_inputs`): the main input positionally, the others (a decoder prompt, the
    pixels of a text-image model) by keyword in a trailing dict.
    """
    config = _small_config(model_type, overrides)
    for part in (config, *_sub_configs(config)):  # a decoder sub-config would return its cache
        _export_settings(part, use_cache=False)
    auto = _auto_model_class(config)
    if auto is None:
        raise TapmlError(f"hf:{model_type}: transformers has no AutoModel class for this config")
    try:
        classes = auto._model_mapping[type(config)]
        if isinstance(classes, (list, tuple)) and not getattr(config, "architectures", None):
            config.architectures = [classes[0].__name__]  # several (Funnel's full and base): the first
        model = auto.from_config(config)
    except Exception as e:  # noqa: BLE001 - a config that builds no model is bad input
        raise TapmlError(f"hf:{model_type}: cannot build the model from its config: {type(e).__name__}: {e}") from None
    model.eval()
    inputs = example_inputs(model, config)
    _calibrate_batch_norms(model, inputs)
    return model, inputs


def _calibrate_batch_norms(model, inputs: tuple) -> None:
    """Give batch norms a scale near 1 and, as their running statistics, those of a batch of
    noisy copies of the example input. With transformers' init (every weight, batch-norm scales included, drawn with
    std 0.02) and running statistics of 0 and 1, a deep CNN's activations shrink layer by layer
    to exact zeros (EfficientNet's output was all zeros): a test model that checks nothing.
    Seeded, so the model stays deterministic."""
    norms = [m for m in model.modules()
             if isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and m.track_running_stats]
    if not norms:
        return
    args, kwargs = (inputs[:-1], inputs[-1]) if isinstance(inputs[-1], dict) else (inputs, {})
    # a batch of 8 noisy copies: one example's few elements per channel in a deep layer (2x2)
    # would give variances near 0, and such a norm amplifies rounding noise without bound
    gen = torch.Generator().manual_seed(0)

    def batch(t):
        if not isinstance(t, torch.Tensor) or t.dim() == 0:
            return t
        if not t.is_floating_point():
            return t.repeat(8, *[1] * (t.dim() - 1))
        return torch.cat([t + 0.5 * t.std().nan_to_num(1.0) * torch.randn(t.shape, generator=gen) for _ in range(8)])
    args, kwargs = [batch(a) for a in args], {k: batch(v) for k, v in kwargs.items()}
    momenta = [m.momentum for m in norms]
    for m in norms:
        if m.affine:  # a scale near 1 (transformers draws it like a weight: std 0.02)
            with torch.no_grad():
                m.weight.copy_(1 + 0.1 * torch.randn(m.weight.shape, generator=gen))
                m.bias.copy_(0.1 * torch.randn(m.bias.shape, generator=gen))
        m.reset_running_stats()
        m.momentum = None  # a cumulative average: after one batch, that batch's statistics
        m.train()
    try:
        with torch.no_grad():
            model(*args, **kwargs)
        for m in norms:  # a channel that hardly varies must not amplify noise either
            m.running_var.clamp_(min=1e-2 * float(m.running_var.mean()))
    except Exception:  # noqa: BLE001 - inputs a batch of 8 does not fit: keep the statistics 0 and 1
        for m in norms:
            m.reset_running_stats()
    finally:
        for m, momentum in zip(norms, momenta):
            m.momentum = momentum
        model.eval()


def _auto_model_class(config):
    """The transformers Auto class that builds ``config``: decoders get their LM head; encoders
    (also listed as causal LMs, e.g. BERT) and encoder-decoders (Whisper, whose causal LM would be
    its decoder alone) stay bare models; a config only a task-specific class takes
    (vision-encoder-decoder) gets the first such class by name."""
    import transformers
    bare = getattr(config, "is_encoder_decoder", False) or type(config) in transformers.AutoModelForMaskedLM._model_mapping
    preferred = ["AutoModel"] if bare else ["AutoModelForCausalLM", "AutoModel"]
    others = sorted(n for n in dir(transformers) if n.startswith("AutoModelFor") and n not in preferred)
    for name in preferred + others:
        cls = getattr(transformers, name, None)
        mapping = getattr(cls, "_model_mapping", None)
        try:
            if mapping is not None and type(config) in mapping:
                return cls
        except Exception:  # noqa: BLE001 - a lazy mapping whose module does not import here
            continue
    return None


def _small_config(model_type: str, overrides: dict | None):
    """The shrunk config of ``model_type`` with ``--hf-config`` overrides applied.

    The config is rebuilt from its constructor arguments (its dataclass fields) so that what it
    derives from them (Swin's stage widths, a backbone's stage names) follows the small values;
    overrides that are fields go through the constructor too, others are set afterwards.
    """
    try:
        from transformers import AutoConfig
    except ImportError as e:
        raise TapmlError(f"hf: models need transformers installed ({e})") from None
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    if model_type not in CONFIG_MAPPING_NAMES:
        close = [k for k in CONFIG_MAPPING_NAMES if model_type.replace("-", "_") in k][:8]
        hint = f"; similar: {', '.join(close)}" if close else ""
        raise TapmlError(f"unknown transformers model type {model_type!r}{hint}")
    default = AutoConfig.for_model(model_type)
    try:
        small = _rebuild(default, _shrunk_fields(default))
    except Exception:  # noqa: BLE001 - its validators reject the small sizes (GPT-Neo's per-layer list)
        small = _set_small(AutoConfig.for_model(model_type))
    if not overrides:
        return small
    fields = _field_names(small)
    given = ", ".join(f"{k}={v!r}" for k, v in overrides.items())
    try:
        config = _rebuild(small, {k: v for k, v in overrides.items() if k in fields})
        for key, value in overrides.items():
            if key not in fields:
                setattr(config, key, value)
    except Exception as e:  # noqa: BLE001 - configs validate their fields in their own ways
        raise TapmlError(f"hf:{model_type}: --hf-config {given}: {type(e).__name__}: {e}") from None
    return config


def _field_names(config) -> set[str]:
    import dataclasses
    if dataclasses.is_dataclass(config):
        return {f.name for f in dataclasses.fields(config) if f.init}
    import inspect
    return set(inspect.signature(type(config).__init__).parameters) - {"self", "kwargs"}


def _rebuild(config, changes: dict):
    """A new config of ``config``'s class: the fields ``config`` set apart from the class defaults
    (a sub-config's ``is_decoder``, say), then ``changes``; derived attributes are recomputed."""
    if not changes:
        return config
    fields = _field_names(config)
    current, defaults = config.to_dict(), type(config)().to_dict()
    kept = {k: getattr(config, k) for k in fields
            if k in current and k not in changes and current[k] != defaults.get(k, current[k])}
    return type(config)(**kept, **changes)


def _shrunk_fields(config) -> dict:
    """The constructor fields of ``config`` to change, sub-configs (a vision tower, a decoder)
    shrunk the same way and rebuilt."""
    fields = _field_names(config)
    present = config.to_dict()
    changes = {}
    for keys, value in _SMALL.items():
        for key in keys:
            # None too: an unset size (GPT-2's n_inner) would otherwise be derived from the full one
            if key in fields and key in present and (present[key] is None or type(present[key]) is int):
                changes[key] = value
    for key in fields & present.keys():
        value = present[key]
        if not (isinstance(value, (list, tuple)) and value and all(type(v) is int for v in value)):
            continue
        if key in _STAGE_DEPTHS:
            changes[key] = [min(v, 1) for v in value]
        elif key in _STAGE_HEADS:
            changes[key] = [_power_of_two_at_most(min(v, 4)) for v in value]
        elif key in _STAGE_WIDTHS:
            changes[key] = [max(16, -(-v // 64) * 16) for v in value]
    if isinstance(present.get("image_size"), int) and present["image_size"] > _IMAGE_SIZE \
            and "image_size" in fields:
        changes["image_size"] = _IMAGE_SIZE
    if "num_groups" in fields and isinstance(present.get("num_groups"), int) and present["num_groups"] > 8:
        changes["num_groups"] = 8  # group norms (BiT's) must divide the quartered widths
    # a size the full config makes equal to the hidden size follows it (SqueezeBERT's embedding_size)
    hidden_key = next((k for k in ("hidden_size", "n_embd", "d_model") if k in changes and type(present.get(k)) is int), None)
    if hidden_key:
        for key in fields & present.keys():
            if key not in changes and key.endswith(("_size", "_dim")) and type(present[key]) is int \
                    and present[key] == present[hidden_key]:
                changes[key] = changes[hidden_key]
    after = {**present, **changes}
    # Attention windows must fit the last stage of the smaller image (Swin's 7 against 64 / 4 / 2**3).
    if "image_size" in changes and "window_size" in fields and isinstance(after.get("window_size"), int) \
            and isinstance(after.get("patch_size"), int):
        stages = len(after["depths"]) if isinstance(after.get("depths"), (list, tuple)) else 1
        last = max(1, after["image_size"] // after["patch_size"] // 2 ** (stages - 1))
        changes["window_size"] = min(after["window_size"], last)
    # Special token ids of the full-size vocabulary must stay inside the small one.
    vocab = after.get("vocab_size")
    if isinstance(vocab, int):
        for key in fields & present.keys():
            if key.endswith("token_id") and isinstance(after[key], int) and after[key] >= vocab:
                changes[key] = vocab - 1
    # Rotary embeddings cover at most a head (GPT-J's rotary_dim 64 against heads of 16).
    hidden = next((after[k] for k in ("hidden_size", "n_embd", "d_model") if isinstance(after.get(k), int)), None)
    heads = next((after[k] for k in ("num_attention_heads", "n_head") if isinstance(after.get(k), int)), None)
    head_dim = after.get("head_dim") if isinstance(after.get("head_dim"), int) else \
        (hidden // heads if hidden and heads else None)
    if head_dim and "rotary_dim" in fields and isinstance(after.get("rotary_dim"), int) \
            and after["rotary_dim"] > head_dim:
        changes["rotary_dim"] = head_dim
    for key in fields:
        sub = getattr(config, key, None)
        if sub is not config and hasattr(sub, "to_dict") and hasattr(sub, "model_type"):
            try:
                shrunk = _rebuild(sub, _shrunk_fields(sub))
            except Exception:  # noqa: BLE001 - as in _small_config
                shrunk = _set_small(sub)
            if shrunk is not sub:
                changes[key] = shrunk
    return changes


def _set_small(config):
    """``config`` with the small sizes set attribute by attribute, for a config whose constructor
    rejects them: what it derives keeps its full-size value (a per-layer list longer than needed)."""
    for key, value in _shrunk_fields(config).items():
        setattr(config, key, value)
    return config


def _sub_configs(config) -> list:
    """The configs nested in ``config`` (a vision tower, a decoder), depth first."""
    out = []
    for value in vars(config).values():
        if value is not config and hasattr(value, "to_dict") and hasattr(value, "model_type"):
            out += [value, *_sub_configs(value)]
    return out


def _power_of_two_at_most(n: int) -> int:
    return 1 << (max(n, 1).bit_length() - 1)


def _config_value(config, key: str, default=None):
    """``config.key``, else the first sub-config's (text tower, vision tower, encoder) that has it."""
    value = getattr(config, key, None)
    if value is not None:
        return value
    for sub_key in ("text_config", "vision_config", "audio_config", "encoder", "decoder"):
        value = getattr(getattr(config, sub_key, None), key, None)
        if value is not None:
            return value
    return default


def _make_input(name: str, config) -> torch.Tensor | None:
    """An example tensor for the ``forward`` argument ``name``; None for an argument this does not make."""
    if name == "input_ids":
        vocab = int(_config_value(config, "vocab_size", 256) or 256)
        return torch.randint(0, vocab, (1, SEQ_LEN))
    if name == "decoder_input_ids":
        return torch.zeros(1, 4, dtype=torch.long)
    if name == "pixel_values":
        vision = getattr(config, "vision_config", None) or getattr(config, "encoder", None) or config
        channels = int(getattr(vision, "num_channels", 3) or 3)
        size = getattr(vision, "image_size", 32) or 32
        size = size if isinstance(size, int) else int(size[0])
        return torch.randn(1, channels, size, size)
    if name == "input_features":
        bins = int(_config_value(config, "num_mel_bins", None) or _config_value(config, "feature_size", 80) or 80)
        return torch.randn(1, bins, 2 * SEQ_LEN)
    if name == "input_values":
        return torch.randn(1, 16000 // 10)
    return None


#: forward arguments that carry what the model takes in (as opposed to masks, caches, options).
_MODALITY_INPUTS = ("input_ids", "pixel_values", "input_features", "input_values", "decoder_input_ids")


def example_inputs(model, config) -> tuple:
    """Example inputs of a transformers model: its ``main_input_name`` tensor positionally, then a
    dict of keyword tensors for the other model inputs its ``forward`` takes (CLIP's pixel values
    beside its token ids, an encoder-decoder's ``decoder_input_ids``) and for required masks."""
    import inspect
    main = getattr(model, "main_input_name", "input_ids")
    first = _make_input(main, config)
    if first is None:
        raise TapmlError(f"cannot make an example input for main_input_name {main!r}; "
                         "use a path/to/file.py:factory spec that returns (model, inputs)")
    keywords = {}
    for name, param in inspect.signature(model.forward).parameters.items():
        if name == main or param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        if name in _MODALITY_INPUTS:
            keywords[name] = _make_input(name, config)
        elif name in ("attention_mask", "decoder_attention_mask") and param.default is param.empty:
            ids = first if name == "attention_mask" else keywords.get("decoder_input_ids")
            if ids is not None:
                keywords[name] = torch.ones(ids.shape[:2], dtype=torch.long)
        elif param.default is param.empty:
            raise TapmlError(f"{type(model).__name__}.forward requires {name!r}, which hf: specs cannot make; "
                             "use a path/to/file.py:factory spec that returns (model, inputs)")
    return (first, keywords) if keywords else (first,)


def example_input(model, config) -> torch.Tensor:
    """The example tensor of the model's ``main_input_name`` (see :func:`example_inputs`)."""
    return example_inputs(model, config)[0]


def _load_factory(spec: str):
    from tapml.io import load_python_file
    path, _, factory = spec.rpartition(":")
    if not Path(path).is_file():
        raise TapmlError(f"model file {path!r} does not exist")
    module = load_python_file(path, f"model {spec}")
    fn = getattr(module, factory, None)
    if not callable(fn):
        raise TapmlError(f"{path} has no function {factory!r}")
    try:
        result = fn()
    except Exception as e:  # noqa: BLE001 - a user's factory failing is bad input
        raise TapmlError(f"{spec}: the factory raised {type(e).__name__}: {e}") from None
    if not (isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], torch.nn.Module)):
        raise TapmlError(f"{spec}: factory must return (model, example_inputs_tuple)")
    model, inputs = result
    return model.eval(), tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)


def _check_dtype(dtype: str) -> torch.dtype:
    """The torch dtype of a ``--dtype`` value; TapmlError naming the choices otherwise."""
    from tapml.dtypes import check_model_dtype
    from tapml.graph import torch_dtype
    try:
        return torch_dtype(check_model_dtype(dtype))
    except ValueError as e:
        raise TapmlError(str(e)) from None


def cast_inputs(inputs: tuple, dtype: torch.dtype) -> tuple:
    """``inputs`` with every floating tensor (also inside a dict of keyword inputs) in ``dtype``."""
    def cast(x):
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            return x.to(dtype)
        if isinstance(x, dict):
            return {k: cast(v) for k, v in x.items()}
        return x
    return tuple(cast(x) for x in inputs)


def _archive_dtype(ep, args) -> str:
    """The low float dtype a ``.pt2`` archive holds (its first among parameters, buffers,
    constants and example inputs), else ``float32``."""
    from tapml.dtypes import LOW_FLOATS
    from tapml.graph import dtype_name
    tensors = [*ep.state_dict.values(), *getattr(ep, "constants", {}).values(), *args]
    for t in tensors:
        if isinstance(t, torch.Tensor) and dtype_name(t.dtype) in LOW_FLOATS:
            return dtype_name(t.dtype)
    return "float32"


def load_model(spec: str, seed: int = 0, hf_config: dict | None = None, dtype: str = "float32",
               quantize: str | None = None, quantized_ops: str = "whole"):
    """Model and example inputs of a MODEL spec; a ``.pt2`` spec returns the ExportedProgram
    itself in place of the model, read by :func:`tapml.frontends.pt2.load_pt2` (nothing in it runs).
    ``dtype`` (``float32``, ``float16``, ``bfloat16``): the model's floating parameters and
    buffers and its floating example inputs are cast to it (``float32`` leaves the model as its
    spec makes it); a ``.pt2`` cannot be recast, so it must already be in a low ``dtype`` asked for.
    ``quantize``: a scheme of :mod:`tapml.frontends.quantize` applied to the model's linears and
    embeddings after the cast (``quantized_ops``: ``whole`` or ``expand``, see
    :func:`tapml.frontends.quantize.quantize_model`). Raises TapmlError for bad specs, dtypes and schemes."""
    model, inputs = _load_model_in_dtype(spec, seed, hf_config, dtype)
    if quantize is not None:
        from tapml.frontends.quantize import quantize_model
        model = quantize_model(model, quantize, quantized_ops)
    return model, inputs


def _load_model_in_dtype(spec: str, seed: int, hf_config: dict | None, dtype: str):
    to = _check_dtype(dtype)
    if not isinstance(spec, str) or not spec:
        raise TapmlError("empty model spec; use zoo:NAME, hf:MODEL_TYPE, hf:ORG/NAME, a checkpoint folder, FILE.gguf, "
                         "file.py:factory or file.pt2")
    from tapml.frontends.checkpoint import is_checkpoint_spec, load_checkpoint
    if is_checkpoint_spec(spec):
        torch.manual_seed(seed)
        return load_checkpoint(spec, hf_config, dtype)
    model, inputs = _load_model(spec, seed, hf_config)
    if dtype == "float32":
        return model, inputs
    if isinstance(model, torch.nn.Module):
        return model.to(to), cast_inputs(inputs, to)
    held = _archive_dtype(model, inputs)
    if held != dtype:
        raise TapmlError(f"{spec} is an exported program in {held}; a .pt2 cannot be recast, so --dtype {dtype} "
                         f"needs an archive exported in {dtype} (or leave --dtype out)")
    return model, inputs


def _load_model(spec: str, seed: int, hf_config: dict | None):
    torch.manual_seed(seed)
    if hf_config and not spec.startswith("hf:"):
        raise TapmlError("--hf-config only applies to hf:MODEL_TYPE specs and checkpoints")
    if spec.startswith("zoo:"):
        name = spec[4:]
        if name not in ZOO:
            raise TapmlError(f"unknown zoo model {name!r}; the zoo has: {', '.join(ZOO)}")
        model, inputs = ZOO[name]()
        return model.eval(), inputs
    if spec.startswith("hf:"):
        return build_hf(spec[3:], hf_config)
    if spec.endswith(".pt2"):
        if not Path(spec).is_file():
            raise TapmlError(f"exported program {spec!r} does not exist")
        from tapml.frontends.pt2 import load_pt2  # never torch.export.load: it unpickles (see tapml/frontends/pt2.py)
        ep, args, kwargs = load_pt2(spec)
        if kwargs:
            raise TapmlError(f"{spec}: keyword example inputs are not supported")
        return ep, tuple(args)
    if ".py:" in spec:
        return _load_factory(spec)
    check_model_spec(spec)
    raise TapmlError(f"unknown model spec {spec!r}")  # check_model_spec refuses every other form


def is_model_file(spec: str) -> bool:
    """Whether ``spec`` is a MODEL spec that names one file (``file.pt2``, ``FILE.gguf``); any other
    existing file is neither a store nor a model."""
    from tapml.frontends.gguf import is_gguf_spec
    return str(spec).endswith(".pt2") or is_gguf_spec(str(spec))


def check_model_spec(spec: str) -> None:
    """Raise TapmlError (exit 2) when ``spec`` has none of the MODEL spec forms (zoo:NAME,
    hf:MODEL_TYPE, hf:ORG/NAME, a checkpoint folder, path/to/file.py:factory, file.pt2); nothing
    is loaded. A spec that is no model spec and names no existing folder is most likely a store
    path with a typo: the message says so."""
    from tapml.frontends.checkpoint import is_checkpoint_spec
    if spec.startswith(("zoo:", "hf:")) or spec.endswith(".pt2") or ".py:" in spec or is_checkpoint_spec(spec):
        return
    forms = (f"zoo:NAME ({', '.join(ZOO)}), hf:MODEL_TYPE, hf:ORG/NAME, a checkpoint folder (config.json and "
             "safetensors), FILE.gguf, path/to/file.py:factory or file.pt2")
    if ":" not in spec and not Path(spec).exists():
        raise TapmlError(f"no store at {spec}: that folder does not exist (carve one with `tapml carve MODEL -o "
                         f"{spec}`), and {spec!r} is not a model spec either ({forms})")
    raise TapmlError(f"unknown model spec {spec!r}; use {forms}")


#: Config keys that bound a causal LM's positions, first present wins.
_MAX_POSITIONS = ("max_position_embeddings", "n_positions", "n_ctx", "max_sequence_length", "seq_length")


def model_positions(config) -> int | None:
    """The most positions ``config`` (a transformers config) gives its model, None when it says none."""
    return next((getattr(config, k) for k in _MAX_POSITIONS if isinstance(getattr(config, k, None), int)), None)


def load_causal_lm(spec: str, *, tokens: int, prompt_len: int, seed: int = 0, hf_config: dict | None = None,
                   dtype: str = "float32", quantize: str | None = None, quantized_ops: str = "whole"):
    """A causal LM of a MODEL spec with its key/value cache enabled, for carving a generation of
    ``prompt_len`` prompt tokens and ``tokens`` generated ones, its floating parameters and
    buffers in ``dtype`` (``float32``, ``float16``, ``bfloat16``), its linears and embeddings
    packed in ``quantize`` (a scheme of :mod:`tapml.frontends.quantize`) when given.

    ``spec`` is ``hf:MODEL_TYPE`` (shrunk like :func:`build_hf`, ``hf_config`` overrides) or a
    zoo model built from transformers (``zoo:tiny-llama``, ``zoo:tiny-gpt2``); the weights are
    those :func:`load_model` gives for the same seed. The model's ``generation_config`` asks for
    a static cache. Raises TapmlError (saying what fits) when the model is no causal LM (an
    encoder, an encoder-decoder, a pure-torch or file model), when ``tokens`` or ``prompt_len``
    is below 1, or when ``prompt_len + tokens`` exceeds the model's positions.
    Example: ``load_causal_lm("zoo:tiny-llama", tokens=4, prompt_len=8)``.
    """
    model = _load_causal_lm(spec, tokens=tokens, prompt_len=prompt_len, seed=seed, hf_config=hf_config, dtype=dtype)
    if quantize is not None:
        from tapml.frontends.quantize import quantize_model
        model = quantize_model(model, quantize, quantized_ops)
    return model


def _load_causal_lm(spec: str, *, tokens: int, prompt_len: int, seed: int, hf_config: dict | None, dtype: str):
    to = _check_dtype(dtype)
    for name, value in (("tokens", tokens), ("prompt_len", prompt_len)):
        if type(value) is not int or value < 1:
            raise TapmlError(f"{name} must be an integer of at least 1, not {value!r}")
    fits = ("a causal LM fits: hf:MODEL_TYPE of a decoder-only transformers model (hf:llama, hf:gpt2, "
            f"hf:gpt_neox, hf:qwen2, hf:mistral...), {', '.join(f'zoo:{n}' for n in _zoo_causal_lms())}, "
            "or a checkpoint folder or hf:ORG/NAME of one")
    from tapml.frontends.checkpoint import checkpoint_config, is_checkpoint_spec, load_checkpoint_model, open_checkpoint
    ckpt = open_checkpoint(spec) if isinstance(spec, str) and is_checkpoint_spec(spec) else None
    if ckpt is not None:
        config = checkpoint_config(ckpt, hf_config, use_cache=True)
    else:
        config = _small_config(*_causal_lm_type(spec, hf_config, fits))
    import transformers
    if (getattr(config, "is_encoder_decoder", False) or type(config) in transformers.AutoModelForMaskedLM._model_mapping
            or type(config) not in transformers.AutoModelForCausalLM._model_mapping):
        raise TapmlError(f"{spec} is not a decoder-only causal LM (no text generation with a key/value cache); "
                         f"{fits}")
    max_positions = model_positions(config)
    if max_positions is not None and prompt_len + tokens > max_positions:
        raise TapmlError(f"{spec}: prompt_len {prompt_len} + tokens {tokens} exceeds the model's {max_positions} "
                         f"positions; ask for at most {max_positions - prompt_len} tokens, a shorter prompt, or "
                         "raise max_position_embeddings with --hf-config")
    _export_settings(config, use_cache=True)
    torch.manual_seed(seed)
    if ckpt is not None:
        model = load_checkpoint_model(ckpt, transformers.AutoModelForCausalLM, config, dtype)
        model.generation_config.use_cache = True
        model.generation_config.cache_implementation = "static"
        return model
    try:
        model = transformers.AutoModelForCausalLM.from_config(config).eval()
    except Exception as e:  # noqa: BLE001 - a config that builds no model is bad input
        raise TapmlError(f"{spec}: cannot build the causal LM from its config: {type(e).__name__}: {e}") from None
    model.generation_config.use_cache = True
    model.generation_config.cache_implementation = "static"
    return model if dtype == "float32" else model.to(to)


def _causal_lm_type(spec, hf_config: dict | None, fits: str) -> tuple[str, dict | None]:
    """``(model_type, overrides)`` of a ``zoo:`` or ``hf:MODEL_TYPE`` causal LM spec; TapmlError
    (saying what ``fits``) for any other spec."""
    if not isinstance(spec, str) or not spec.startswith(("zoo:", "hf:")):
        raise TapmlError(f"cannot carve a generation of {str(spec)[:80]!r}: {fits}")
    if hf_config and not spec.startswith("hf:"):
        raise TapmlError("--hf-config only applies to hf:MODEL_TYPE specs and checkpoints")
    if spec.startswith("hf:"):
        return spec[3:], hf_config
    build = ZOO.get(spec[4:])
    if build is None:
        raise TapmlError(f"unknown zoo model {spec[4:]!r}; {fits}")
    if spec[4:] not in _zoo_causal_lms():
        raise TapmlError(f"{spec} is not a causal LM, so it has no generation to carve; {fits}")
    return build.hf


def _zoo_causal_lms() -> list[str]:
    """Zoo models that are causal LMs (built from transformers, with an LM head)."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    names = []
    for name, build in ZOO.items():
        hf = getattr(build, "hf", None)
        if hf and CONFIG_MAPPING[hf[0]] in transformers.AutoModelForCausalLM._model_mapping \
                and CONFIG_MAPPING[hf[0]] not in transformers.AutoModelForMaskedLM._model_mapping:
            names.append(name)
    return names
