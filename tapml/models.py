"""MODEL specs: ``zoo:NAME``, ``hf:MODEL_TYPE``, ``path/file.py:factory``, ``file.pt2``.

:func:`load_model` turns a spec into ``(model, example_inputs)``; :func:`tapml.capture.capture`
turns that into an exported core-ATen program. Weights and inputs are random and
deterministic: the same seed gives the same model and the same inputs.
"""

from __future__ import annotations

import importlib.util
import json
import sys
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
    ("intermediate_size", "n_inner", "ffn_dim", "encoder_ffn_dim", "decoder_ffn_dim", "hidden_dim"): 128,
    ("head_dim",): 16,
    ("max_position_embeddings", "n_positions", "n_ctx"): 128,
}


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
}


def parse_hf_overrides(items: list[str] | None) -> dict:
    """``["hidden_size=32", "hidden_act=gelu"]`` -> dict with JSON-ish values."""
    out = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise TapmlError(f"--hf-config takes KEY=VALUE, got {item!r}")
        try:
            out[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            out[key.strip()] = value
    return out


def _export_settings(config, use_cache: bool) -> None:
    """Settings every exported transformers model gets: the cache on or off, eager attention."""
    config.use_cache = use_cache
    if hasattr(config, "_attn_implementation"):
        try:
            config._attn_implementation = "eager"
        except Exception:  # noqa: BLE001 - read-only on some configs; sdpa is fine then
            pass


def build_hf(model_type: str, overrides: dict | None = None):
    """A tiny random-init transformers model of ``model_type`` and an example input."""
    config = _small_config(model_type, overrides)
    import transformers
    _export_settings(config, use_cache=False)
    model = None
    # Decoders get their LM head; encoders (also listed as causal LMs, e.g. BERT) stay bare models.
    encoder = type(config) in transformers.AutoModelForMaskedLM._model_mapping
    for auto in ("AutoModel",) if encoder else ("AutoModelForCausalLM", "AutoModel"):
        cls = getattr(transformers, auto)
        if type(config) in cls._model_mapping:
            try:
                model = cls.from_config(config)
                break
            except Exception as e:  # noqa: BLE001
                raise TapmlError(f"hf:{model_type}: cannot build the model from its config: {e}") from None
    if model is None:
        raise TapmlError(f"hf:{model_type}: transformers has no AutoModel for this config")
    model.eval()
    example = example_input(model, config)
    import inspect
    if "decoder_input_ids" in inspect.signature(model.forward).parameters:
        # Encoder-decoder models need a decoder prompt too; passed by keyword.
        return model, (example, {"decoder_input_ids": torch.zeros(1, 4, dtype=torch.long)})
    return model, (example,)


def _small_config(model_type: str, overrides: dict | None):
    """The shrunk config of ``model_type`` with ``--hf-config`` overrides applied."""
    try:
        from transformers import AutoConfig
    except ImportError as e:
        raise TapmlError(f"hf: models need transformers installed ({e})") from None
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    if model_type not in CONFIG_MAPPING_NAMES:
        close = [k for k in CONFIG_MAPPING_NAMES if model_type.replace("-", "_") in k][:8]
        hint = f"; similar: {', '.join(close)}" if close else ""
        raise TapmlError(f"unknown transformers model type {model_type!r}{hint}")
    config = AutoConfig.for_model(model_type)
    _shrink(config)
    for key, value in (overrides or {}).items():
        try:
            setattr(config, key, value)
        except Exception as e:  # noqa: BLE001 - configs validate their fields in their own ways
            raise TapmlError(f"hf:{model_type}: --hf-config {key}={value!r}: {type(e).__name__}: {e}") from None
    return config


def _shrink(config) -> None:
    present = config.to_dict()
    for keys, value in _SMALL.items():
        for key in keys:
            if key in present and not isinstance(getattr(config, key, None), (list, dict)):
                setattr(config, key, value)
    # Special token ids of the full-size vocabulary must stay inside the small one.
    vocab = getattr(config, "vocab_size", None)
    if isinstance(vocab, int):
        for key in present:
            value = getattr(config, key, None)
            if key.endswith("token_id") and isinstance(value, int) and value >= vocab:
                setattr(config, key, vocab - 1)
    # Sub-configs (vision towers, text towers) get the same treatment.
    for key, sub in list(vars(config).items()):
        if hasattr(sub, "to_dict") and hasattr(sub, "model_type") and sub is not config:
            _shrink(sub)


def example_input(model, config) -> torch.Tensor:
    """An input following the model's ``main_input_name``."""
    name = getattr(model, "main_input_name", "input_ids")
    if name == "input_ids":
        vocab = int(getattr(config, "vocab_size", 256) or 256)
        return torch.randint(0, vocab, (1, SEQ_LEN))
    if name == "pixel_values":
        channels = int(getattr(config, "num_channels", 3) or 3)
        size = getattr(config, "image_size", 32) or 32
        size = size if isinstance(size, int) else int(size[0])
        return torch.randn(1, channels, size, size)
    if name == "input_features":
        bins = int(getattr(config, "num_mel_bins", getattr(config, "feature_size", 80)) or 80)
        return torch.randn(1, bins, 2 * SEQ_LEN)
    if name == "input_values":
        return torch.randn(1, 16000 // 10)
    raise TapmlError(f"cannot make an example input for main_input_name {name!r}; "
                     "use a path/to/file.py:factory spec that returns (model, inputs)")


def _load_factory(spec: str):
    path, _, factory = spec.rpartition(":")
    file = Path(path)
    if not file.is_file():
        raise TapmlError(f"model file {path!r} does not exist")
    mod_name = f"tapml_user_model_{abs(hash(str(file.resolve())))}"
    module_spec = importlib.util.spec_from_file_location(mod_name, file)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[mod_name] = module
    try:
        module_spec.loader.exec_module(module)
    except Exception as e:  # noqa: BLE001 - a user's file failing to import is bad input
        raise TapmlError(f"importing {path} failed: {type(e).__name__}: {e}") from None
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


def load_model(spec: str, seed: int = 0, hf_config: dict | None = None, dtype: str = "float32"):
    """Model and example inputs of a MODEL spec; a ``.pt2`` spec returns the ExportedProgram
    itself in place of the model, read by :func:`tapml.pt2.load_pt2` (nothing in it runs).
    ``dtype`` (``float32``, ``float16``, ``bfloat16``): the model's floating parameters and
    buffers and its floating example inputs are cast to it (``float32`` leaves the model as its
    spec makes it); a ``.pt2`` cannot be recast, so it must already be in a low ``dtype`` asked for.
    Raises TapmlError for bad specs and dtypes."""
    to = _check_dtype(dtype)
    if not isinstance(spec, str) or not spec:
        raise TapmlError("empty model spec; use zoo:NAME, hf:MODEL_TYPE, file.py:factory or file.pt2")
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
        raise TapmlError("--hf-config only applies to hf:MODEL_TYPE specs")
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
        from tapml.pt2 import load_pt2  # never torch.export.load: it unpickles (see tapml/pt2.py)
        ep, args, kwargs = load_pt2(spec)
        if kwargs:
            raise TapmlError(f"{spec}: keyword example inputs are not supported")
        return ep, tuple(args)
    if ".py:" in spec:
        return _load_factory(spec)
    raise TapmlError(f"unknown model spec {spec!r}; use zoo:NAME ({', '.join(ZOO)}), hf:MODEL_TYPE, "
                     "path/to/file.py:factory or file.pt2")


#: Config keys that bound a causal LM's positions, first present wins.
_MAX_POSITIONS = ("max_position_embeddings", "n_positions", "n_ctx", "max_sequence_length", "seq_length")


def load_causal_lm(spec: str, *, tokens: int, prompt_len: int, seed: int = 0, hf_config: dict | None = None,
                   dtype: str = "float32"):
    """A causal LM of a MODEL spec with its key/value cache enabled, for carving a generation of
    ``prompt_len`` prompt tokens and ``tokens`` generated ones, its floating parameters and
    buffers in ``dtype`` (``float32``, ``float16``, ``bfloat16``).

    ``spec`` is ``hf:MODEL_TYPE`` (shrunk like :func:`build_hf`, ``hf_config`` overrides) or a
    zoo model built from transformers (``zoo:tiny-llama``, ``zoo:tiny-gpt2``); the weights are
    those :func:`load_model` gives for the same seed. The model's ``generation_config`` asks for
    a static cache. Raises TapmlError (saying what fits) when the model is no causal LM (an
    encoder, an encoder-decoder, a pure-torch or file model), when ``tokens`` or ``prompt_len``
    is below 1, or when ``prompt_len + tokens`` exceeds the model's positions.
    Example: ``load_causal_lm("zoo:tiny-llama", tokens=4, prompt_len=8)``.
    """
    to = _check_dtype(dtype)
    for name, value in (("tokens", tokens), ("prompt_len", prompt_len)):
        if type(value) is not int or value < 1:
            raise TapmlError(f"{name} must be an integer of at least 1, not {value!r}")
    fits = ("a causal LM fits: hf:MODEL_TYPE of a decoder-only transformers model (hf:llama, hf:gpt2, "
            f"hf:gpt_neox, hf:qwen2, hf:mistral...) or {', '.join(f'zoo:{n}' for n in _zoo_causal_lms())}")
    if not isinstance(spec, str) or not spec.startswith(("zoo:", "hf:")):
        raise TapmlError(f"cannot carve a generation of {str(spec)[:80]!r}: {fits}")
    if hf_config and not spec.startswith("hf:"):
        raise TapmlError("--hf-config only applies to hf:MODEL_TYPE specs")
    if spec.startswith("zoo:"):
        build = ZOO.get(spec[4:])
        if build is None:
            raise TapmlError(f"unknown zoo model {spec[4:]!r}; {fits}")
        if spec[4:] not in _zoo_causal_lms():
            raise TapmlError(f"{spec} is not a causal LM, so it has no generation to carve; {fits}")
        model_type, overrides = build.hf
    else:
        model_type, overrides = spec[3:], hf_config
    config = _small_config(model_type, overrides)
    import transformers
    if (getattr(config, "is_encoder_decoder", False) or type(config) in transformers.AutoModelForMaskedLM._model_mapping
            or type(config) not in transformers.AutoModelForCausalLM._model_mapping):
        raise TapmlError(f"{spec} is not a decoder-only causal LM (no text generation with a key/value cache); "
                         f"{fits}")
    max_positions = next((getattr(config, k) for k in _MAX_POSITIONS if isinstance(getattr(config, k, None), int)),
                         None)
    if max_positions is not None and prompt_len + tokens > max_positions:
        raise TapmlError(f"{spec}: prompt_len {prompt_len} + tokens {tokens} exceeds the model's {max_positions} "
                         f"positions; ask for at most {max_positions - prompt_len} tokens, a shorter prompt, or "
                         "raise max_position_embeddings with --hf-config")
    _export_settings(config, use_cache=True)
    torch.manual_seed(seed)
    try:
        model = transformers.AutoModelForCausalLM.from_config(config).eval()
    except Exception as e:  # noqa: BLE001 - a config that builds no model is bad input
        raise TapmlError(f"{spec}: cannot build the causal LM from its config: {type(e).__name__}: {e}") from None
    model.generation_config.use_cache = True
    model.generation_config.cache_implementation = "static"
    return model if dtype == "float32" else model.to(to)


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
