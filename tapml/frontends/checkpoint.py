"""MODEL specs for the checkpoints people have: a ``save_pretrained`` folder and ``hf:ORG/NAME``.

A checkpoint folder holds ``config.json`` and safetensors weights (``model.safetensors``, or
shards listed by ``model.safetensors.index.json``). ``hf:ORG/NAME`` (a name with a slash) is
looked up in the local Hugging Face cache with ``huggingface_hub``'s own lookup, offline: tapml
never downloads. :func:`open_checkpoint` checks everything it will let transformers read before
transformers reads it; :func:`load_checkpoint` then builds the model with transformers' own
loading code (``AutoConfig`` and the Auto class that fits, weights memory-mapped from the
safetensors files).

A checkpoint is data, so loading one runs no code: pickle weights (``pytorch_model.bin``,
``*.pt``, ``*.pth``) are refused with how to convert them, a config with ``auto_map`` (code shipped
in the folder) is refused unless ``--trust-remote-code`` was given, and every file the loader
reads -- the config, the index, each shard it names -- is a regular file that resolves inside
the folder (inside the repository's cache folder for ``hf:``, whose snapshots link to its blobs).

Example::

    ckpt = open_checkpoint("./my-llama")          # TapmlError (exit 2) for anything refused
    ckpt.dtype                                    # "bfloat16": what the weights are stored in
    model, inputs = load_checkpoint(ckpt, hf_config={"num_hidden_layers": 1})
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from tapml.errors import TapmlError

if TYPE_CHECKING:
    from tapml.frontends.gguf import GGUFHeader

CONFIG = "config.json"
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
#: Other files transformers may read beside the weights (each checked like the config when present).
SIDE_FILES = ("generation_config.json",)
#: Weight files that are pickles: loading one can run code.
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
_STORE_MANIFEST = "manifest.json"
_SAFETENSORS_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64"}
_MAX_CONFIG_BYTES = 16 << 20

_remote_code: contextvars.ContextVar[bool] = contextvars.ContextVar("tapml_trust_remote_code", default=False)


@contextlib.contextmanager
def remote_code_trusted(trusted: bool):
    """Within the block, a checkpoint whose config has ``auto_map`` may run the code it ships
    (``--trust-remote-code``); outside it, such a checkpoint is refused."""
    token = _remote_code.set(bool(trusted))
    try:
        yield
    finally:
        _remote_code.reset(token)


def remote_code_is_trusted() -> bool:
    """Whether the current command was given ``--trust-remote-code`` (:func:`remote_code_trusted`)."""
    return _remote_code.get()


def is_hub_name(spec: str) -> bool:
    """Whether ``spec`` is ``hf:ORG/NAME`` (a hub repository name) rather than ``hf:MODEL_TYPE``."""
    return isinstance(spec, str) and spec.startswith("hf:") and "/" in spec[3:]


def is_checkpoint_folder(path: str | Path) -> bool:
    """Whether ``path`` is a folder that is meant as a checkpoint: no carve store (no
    ``manifest.json``) and holding ``config.json`` or weight files."""
    p = Path(path)
    if not p.is_dir() or (p / _STORE_MANIFEST).exists():
        return False
    try:
        names = [e.name for e in os.scandir(p)]
    except OSError:
        return False
    return CONFIG in names or any(n.endswith((".safetensors", *PICKLE_SUFFIXES)) for n in names)


def is_checkpoint_spec(spec: str) -> bool:
    """Whether the MODEL spec ``spec`` names a checkpoint (a folder, ``hf:ORG/NAME`` or a GGUF file)."""
    from tapml.frontends.gguf import is_gguf_spec
    return is_hub_name(spec) or is_gguf_spec(spec) or is_checkpoint_folder(spec)


@dataclass
class Checkpoint:
    """A checked checkpoint: ``folder`` holds ``config.json`` (read as ``config``), ``weights``
    are the safetensors files transformers will read, ``dtype`` is the floating dtype most of
    the weights are stored in, ``root`` the folder nothing read may leave. A GGUF file
    (:mod:`tapml.frontends.gguf`) is the one weight file, its checked header ``gguf``."""
    spec: str
    folder: Path
    root: Path
    config: dict
    weights: list[Path] = field(default_factory=list)
    dtype: str = "float32"
    remote_code: bool = False
    gguf: GGUFHeader | None = None


def split_hub_name(spec: str) -> tuple[str, str | None]:
    """``("ORG/NAME", "REV")`` of ``hf:ORG/NAME@REV`` (REV: a branch, a tag or a commit hash), REV None
    without ``@``."""
    name, at, revision = spec[3:].partition("@")
    if at and not revision:
        raise TapmlError(f"{spec}: nothing after '@'; write hf:{name}@REV with a branch, tag or commit, "
                         f"or hf:{name} for the revision the cache calls main")
    if revision and (not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._/-]{0,199}", revision) or ".." in revision
                     or "//" in revision or revision.endswith("/")):
        raise TapmlError(f"{spec}: {revision!r} is not a revision name; a branch, tag or commit hash is letters, "
                         "digits and . _ - / (no '..')")
    return name, revision or None


def resolve_hub_name(spec: str) -> tuple[Path, Path]:
    """The snapshot folder of ``hf:ORG/NAME`` or ``hf:ORG/NAME@REV`` in the local Hugging Face cache
    (``$HF_HUB_CACHE``, else huggingface_hub's default) and that repository's cache folder, found
    offline with ``huggingface_hub.snapshot_download(local_files_only=True)``: REV is a branch or tag
    the cache has a ref for, or a commit it has a snapshot of (without it, ``main``). TapmlError
    saying how to download it when it is not there."""
    name, revision = split_hub_name(spec)
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError
    except ImportError as e:
        raise TapmlError(f"{spec}: hub names need huggingface_hub installed ({e})") from None
    cache = os.environ.get("HF_HUB_CACHE") or None  # read now: huggingface_hub read it when first imported
    try:
        folder = snapshot_download(name, revision=revision, local_files_only=True, cache_dir=cache)
    except HFValidationError as e:
        raise TapmlError(f"{spec}: {name!r} is not a hub repository name (ORG/NAME): {str(e).splitlines()[0]}") \
            from None
    except (LocalEntryNotFoundError, FileNotFoundError, OSError):
        where = cache or "the Hugging Face cache"
        download = f"{name} --revision {revision}" if revision else name
        held = cached_revisions(name, cache)
        holds = f"; it holds {', '.join(f'hf:{name}@{r}' for r in held)}" if held else ""
        raise TapmlError(f"{spec} is not in {where}{holds}; tapml never downloads: run `hf download {download}` "
                         f"(or `huggingface-cli download {download}`) first, or pass the checkpoint folder itself") \
            from None
    folder = Path(folder)
    if folder.parent.name != "snapshots":  # a ref file's content names the snapshot: it must be one
        raise TapmlError(f"{spec}: the cache's ref names {folder}, which is not a snapshot of {name}")
    return folder, folder.parent.parent  # snapshots/REV -> models--ORG--NAME


def cached_revisions(name: str, cache: str | None, most: int = 8) -> list[str]:
    """The revisions of ``ORG/NAME`` the local hub cache holds, as ``hf:ORG/NAME@REV`` takes them:
    its refs (branches and tags) and the commits it has snapshots of, at most ``most`` of each; only
    names are read, never a file's content."""
    from huggingface_hub.constants import HF_HUB_CACHE
    from huggingface_hub.file_download import repo_folder_name

    from tapml.text import shown
    repo = Path(cache or HF_HUB_CACHE) / repo_folder_name(repo_id=name, repo_type="model")
    found: list[str] = []
    for folder, named in ((repo / "refs", lambda p: p.relative_to(repo / "refs").as_posix()),
                          (repo / "snapshots", lambda p: p.name)):
        try:
            names = sorted(named(p) for p in folder.rglob("*") if p.is_file() and not p.is_symlink()) \
                if folder.name == "refs" else sorted(named(p) for p in folder.iterdir() if p.is_dir())
        except OSError:
            continue
        found += [shown(n[:80]) for n in names[:most]]
    return list(dict.fromkeys(found))


def open_checkpoint(spec: str) -> Checkpoint:
    """Check the checkpoint ``spec`` (a folder or ``hf:ORG/NAME``) without building anything.

    Refused (TapmlError, exit 2, saying what to fix): no folder; no ``config.json``, or one that
    is not a JSON object with a ``model_type`` transformers knows; ``auto_map`` without
    :func:`remote_code_trusted`; pickle weights only; no weights; an index whose names leave the
    folder, name missing files or files without the tensors it puts there; a shard that is
    truncated or not safetensors; any file read that is no regular file inside the folder. A GGUF
    file: what :func:`tapml.frontends.gguf.scan_gguf` and ``check_architecture`` refuse."""
    from tapml.frontends.gguf import is_gguf_spec
    if is_gguf_spec(spec):
        return _open_gguf(spec)
    if is_hub_name(spec):
        folder, root = resolve_hub_name(spec)
    else:
        folder = Path(spec)
        if not folder.is_dir():
            raise TapmlError(f"checkpoint folder {spec} does not exist")
        root = folder
    root = root.resolve()
    config = _read_config(spec, folder, root)
    remote = "auto_map" in config
    if remote and not _remote_code.get():
        raise TapmlError(f"{spec}: its config.json has auto_map, so building it runs Python code shipped with the "
                         "checkpoint; tapml runs it only with --trust-remote-code (as it runs a file.py:factory): "
                         "read that code first")
    if not remote:
        _check_model_type(spec, config)
    for name in SIDE_FILES:
        if os.path.lexists(folder / name):
            _inside(spec, folder / name, root)
    weights = _weight_files(spec, folder, root)
    return Checkpoint(spec=spec, folder=folder, root=root, config=config, weights=weights,
                      dtype=_stored_dtype(spec, weights), remote_code=remote)


def _open_gguf(spec: str) -> Checkpoint:
    from tapml.frontends.gguf import check_architecture, gguf_config, scan_gguf
    header = scan_gguf(spec)
    check_architecture(spec, header)
    path = Path(spec).resolve()
    config = gguf_config(spec, header)
    _check_model_type(spec, config)
    return Checkpoint(spec=spec, folder=path.parent, root=path.parent, config=config, weights=[path],
                      dtype=header.dtype, gguf=header)


def _inside(spec: str, path: Path, root: Path) -> Path:
    """``path`` resolved, when it is a regular file inside ``root`` (links followed, ``..`` too)."""
    resolved = path.resolve()
    if not resolved.is_relative_to(root):
        raise TapmlError(f"{spec}: {path.name} resolves to {resolved}, outside the checkpoint folder {root}; a "
                         "checkpoint's files must lie inside it")
    if not resolved.is_file():
        raise TapmlError(f"{spec}: {path.name} is {'missing' if not resolved.exists() else 'not a regular file'}; "
                         "copy the checkpoint again (a save_pretrained folder or a complete hub download)")
    return resolved


def _read_config(spec: str, folder: Path, root: Path) -> dict:
    from tapml.io import read_json_file
    path = folder / CONFIG
    if not os.path.lexists(path):
        raise TapmlError(f"{spec} has no config.json: a checkpoint folder is what save_pretrained writes "
                         "(config.json and *.safetensors); a carve store has a manifest.json")
    config = read_json_file(_inside(spec, path, root), f"{spec}/config.json", "copy the checkpoint again",
                            max_bytes=_MAX_CONFIG_BYTES)
    if not isinstance(config, dict):
        raise TapmlError(f"{spec}/config.json is not a JSON object; copy the checkpoint again")
    return config


def _check_model_type(spec: str, config: dict) -> None:
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    model_type = config.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        raise TapmlError(f"{spec}/config.json has no model_type; it is not a transformers checkpoint config")
    if model_type not in CONFIG_MAPPING_NAMES:
        from tapml.text import shown
        raise TapmlError(f"{spec}: unknown architecture model_type {shown(model_type[:80])!r}: transformers "
                         f"{transformers.__version__} does not know it; upgrade transformers, or fix model_type in "
                         "config.json")


def _weight_files(spec: str, folder: Path, root: Path) -> list[Path]:
    """The safetensors files transformers will load (it tries ``model.safetensors`` first, then the index)."""
    if os.path.lexists(folder / SINGLE):
        return [_check_shard(spec, _inside(spec, folder / SINGLE, root), SINGLE, None)]
    if os.path.lexists(folder / INDEX):
        return _indexed_shards(spec, folder, root)
    pickles = sorted(p.name for p in folder.iterdir() if p.name.endswith(PICKLE_SUFFIXES))
    if pickles:
        raise TapmlError(
            f"{spec} holds pickle weights ({', '.join(pickles[:3])}), and loading a pickle can run code; tapml "
            "reads safetensors only. Convert them where you trust the file: `python -c \"import torch; from "
            "safetensors.torch import save_file; sd = torch.load('pytorch_model.bin', weights_only=True); "
            "save_file({k: v.contiguous() for k, v in sd.items()}, 'model.safetensors', metadata={'format': 'pt'})\"` "
            "(or AutoModel.from_pretrained(DIR).save_pretrained(DIR) with transformers)")
    raise TapmlError(f"{spec} has no weights: expected {SINGLE}, or shards listed in {INDEX}")


def _indexed_shards(spec: str, folder: Path, root: Path) -> list[Path]:
    from tapml.io import read_json_file
    index = read_json_file(_inside(spec, folder / INDEX, root), f"{spec}/{INDEX}", "copy the checkpoint again",
                           max_bytes=_MAX_CONFIG_BYTES)
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map \
            or not all(isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
        raise TapmlError(f"{spec}/{INDEX} has no weight_map of tensor names to shard files; copy the checkpoint "
                         "again")
    by_file: dict[str, set[str]] = {}
    for tensor, name in weight_map.items():
        by_file.setdefault(name, set()).add(tensor)
    shards = []
    for name, tensors in by_file.items():
        parts = Path(name).parts
        if not name or Path(name).is_absolute() or ".." in parts or "\\" in name or "\0" in name:
            from tapml.text import shown
            raise TapmlError(f"{spec}/{INDEX} names the file {shown(name[:200])!r}, which is not a plain name inside "
                             "the checkpoint folder; a shard must lie in the folder")
        if not os.path.lexists(folder / name):
            raise TapmlError(f"{spec}: shard {name} (listed in {INDEX}) is missing; copy the checkpoint again")
        shards.append(_check_shard(spec, _inside(spec, folder / name, root), name, tensors))
    return shards


def _check_shard(spec: str, path: Path, name: str, tensors: set[str] | None) -> Path:
    """``path`` when safetensors opens it (header whole, data covering it) and it holds ``tensors``."""
    from safetensors import safe_open
    try:
        with safe_open(str(path), "pt") as f:
            keys = set(f.keys())
    except Exception as e:  # noqa: BLE001 - any refusal of safetensors' own parser is a broken file
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise TapmlError(f"{spec}: shard {name} is not a whole safetensors file ({first}); it may be truncated: "
                         "copy the checkpoint again") from None
    missing = sorted((tensors or set()) - keys)
    if missing:
        raise TapmlError(f"{spec}: {INDEX} puts {len(missing)} tensors in {name} that it does not hold (first: "
                         f"{missing[0][:120]}); copy the checkpoint again")
    return path


def _stored_dtype(spec: str, weights: list[Path]) -> str:
    """The floating dtype holding the most weight elements (float32 when none is float16/bfloat16/float32)."""
    from safetensors import safe_open
    counts: dict[str, int] = {}
    for path in weights:
        with safe_open(str(path), "pt") as f:
            for key in f.keys():
                piece = f.get_slice(key)
                dtype = _SAFETENSORS_DTYPES.get(piece.get_dtype())
                if dtype:
                    n = 1
                    for d in piece.get_shape():
                        n *= d
                    counts[dtype] = counts.get(dtype, 0) + n
    best = max(counts, key=counts.get) if counts else "float32"
    return "float32" if best == "float64" else best


def checkpoint_config(ckpt: Checkpoint, hf_config: dict | None = None, use_cache: bool = False):
    """The transformers config of ``ckpt`` (``AutoConfig.from_pretrained``, local files only)
    with the ``--hf-config`` overrides applied (``num_hidden_layers=N``: the first N layers)."""
    from transformers import AutoConfig

    from tapml.frontends.models import _export_settings, _sub_configs
    given = ", ".join(f"{k}={v!r}" for k, v in (hf_config or {}).items())
    try:
        with _from_folder(ckpt) as (folder, gguf):
            config = AutoConfig.from_pretrained(folder, local_files_only=True, trust_remote_code=ckpt.remote_code,
                                                **gguf, **_with_per_layer_lists(ckpt.config, hf_config or {}))
    except Exception as e:  # noqa: BLE001 - a config transformers refuses is bad input
        what = f" with --hf-config {given}" if given else ""
        raise TapmlError(f"{ckpt.spec}: transformers cannot read its config.json{what}: {type(e).__name__}: "
                         f"{(str(e).strip().splitlines() or [''])[0][:300]}") from None
    if ckpt.gguf:
        from tapml.frontends.gguf import complete_gguf_config
        complete_gguf_config(ckpt, config, hf_config or {})
    for part in (config, *_sub_configs(config)):
        _export_settings(part, use_cache=use_cache)
    return config


@contextlib.contextmanager
def _from_folder(ckpt: Checkpoint):
    """``(folder, kwargs)`` to hand ``from_pretrained``: the checkpoint folder, or for a GGUF file
    a private folder holding only it and ``gguf_file``."""
    if not ckpt.gguf:
        yield str(ckpt.folder), {}
        return
    from tapml.frontends.gguf import gguf_alone
    with gguf_alone(ckpt) as (folder, name):
        yield folder, {"gguf_file": name}


def _with_per_layer_lists(stored: dict, overrides: dict) -> dict:
    """``overrides`` plus, when they lower a layer count, every per-layer list of the stored config
    (Qwen2's ``layer_types``: one entry per layer) cut to the first layers, so that the config
    stays consistent with itself."""
    out = dict(overrides)
    for key, layers in overrides.items():
        before = stored.get(key)
        if type(layers) is not int or type(before) is not int or not 0 < layers < before:
            continue
        for name, value in stored.items():
            if name not in out and isinstance(value, list) and len(value) == before:
                out[name] = value[:layers]
    return out


def load_checkpoint_model(ckpt: Checkpoint, auto, config, dtype: str):
    """``auto.from_pretrained`` of ``ckpt`` with ``config``, its floating weights in ``dtype``,
    safetensors only and local files only. TapmlError when the weights do not fit the config
    (a tensor of another shape, or one the model needs that the checkpoint lacks)."""
    from transformers.utils import logging as hf_logging

    from tapml.graph import torch_dtype
    hf_logging.disable_progress_bar()
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # its load report goes to the log; tapml says what matters
    _check_size(ckpt, auto, config)
    if ckpt.gguf:
        try:
            from tapml.frontends.gguf import load_gguf_weights
            return load_gguf_weights(ckpt, _build(ckpt, auto, config, torch_dtype(dtype)), dtype)
        finally:
            hf_logging.set_verbosity(verbosity)
    try:
        model, info = auto.from_pretrained(
            str(ckpt.folder), config=config, dtype=torch_dtype(dtype), use_safetensors=True, local_files_only=True,
            trust_remote_code=ckpt.remote_code, ignore_mismatched_sizes=True, output_loading_info=True)
    except TapmlError:
        raise
    except Exception as e:  # noqa: BLE001 - weights transformers cannot load are bad input
        raise TapmlError(f"{ckpt.spec}: transformers cannot load the weights: {type(e).__name__}: "
                         f"{(str(e).strip().splitlines() or [''])[0][:300]}") from None
    finally:
        hf_logging.set_verbosity(verbosity)
    mismatched = [m for m in info.get("mismatched_keys") or []]
    missing = sorted(info.get("missing_keys") or [])
    if mismatched:
        first = mismatched[0]
        shown_first = first[0] if isinstance(first, (tuple, list)) else first
        shapes = f" (checkpoint {tuple(first[1])}, model {tuple(first[2])})" if isinstance(first, (tuple, list)) \
            and len(first) == 3 else ""
        raise TapmlError(f"{ckpt.spec}: the weights do not fit the config: {len(mismatched)} tensors have other shapes "
                         f"than the config gives, first {shown_first}{shapes}; fix config.json (or --hf-config) to "
                         "match the weights")
    if missing:
        raise TapmlError(f"{ckpt.spec}: the weights do not fit the config: {len(missing)} tensors the model needs are "
                         f"not in the checkpoint (first: {missing[0][:120]}); copy the checkpoint again or fix "
                         "config.json")
    return model.eval()


#: How many layers a config may claim per numbered weight set before it is refused unbuilt.
MAX_LAYERS_PER_NUMBERED = 64


def _check_size(ckpt: Checkpoint, auto, config) -> None:
    """Refuse, before anything is allocated, a config whose model has more weight elements than
    the checkpoint stores: such weights cannot fit it, and building it could exhaust memory."""
    import torch
    from safetensors import safe_open
    stored = ckpt.gguf.elements if ckpt.gguf else 0
    numbered = 0  # 1 + the largest number in a weight's name (layers.N., h.N., blocks.N. ...)
    for path in [] if ckpt.gguf else ckpt.weights:
        with safe_open(str(path), "pt") as f:
            for key in f.keys():
                n = 1
                for d in f.get_slice(key).get_shape():
                    n *= d
                stored += n
                numbered = max([numbered] + [int(p) + 1 for p in key.split(".") if p.isdigit() and len(p) < 7])
    layers = getattr(config, "num_hidden_layers", None)
    # building on the meta device takes time in the number of layers (a million took minutes), so a
    # count far past the numbered weights is refused first; shared layers (ALBERT: 12 layers, one
    # set of weights) stay far below this bound
    if not ckpt.gguf and isinstance(layers, int) and layers > max(MAX_LAYERS_PER_NUMBERED * numbered, 1024):
        raise TapmlError(f"{ckpt.spec}: the weights do not fit the config: it claims {layers} layers and the weights "
                         f"number at most {numbered}; fix num_hidden_layers in config.json (or --hf-config)")
    with torch.device("meta"):
        model = _build(ckpt, auto, config)
    needed = sum(p.numel() for p in model.parameters())
    if needed > stored:
        raise TapmlError(f"{ckpt.spec}: the weights do not fit the config: the model it describes has {needed} weight "
                         f"elements, the checkpoint stores {stored}; fix config.json (or --hf-config) to match the "
                         "weights")


def _build(ckpt: Checkpoint, auto, config, dtype=None):
    """The model ``auto`` builds from ``config`` (random weights; on the current device)."""
    kwargs = {"dtype": dtype} if dtype is not None else {}
    try:
        if not hasattr(auto, "from_config"):  # a model class, not an Auto class
            return auto(config) if dtype is None else auto(config).to(dtype)
        if ckpt.remote_code:
            return auto.from_config(config, trust_remote_code=True, **kwargs)
        return auto.from_config(config, **kwargs)
    except Exception as e:  # noqa: BLE001 - a config that builds no model is bad input
        raise TapmlError(f"{ckpt.spec}: cannot build the model from its config: {type(e).__name__}: "
                         f"{(str(e).strip().splitlines() or [''])[0][:300]}") from None


def load_checkpoint(spec: str, hf_config: dict | None = None, dtype: str | None = None):
    """``(model, example_inputs)`` of the checkpoint ``spec``: the Auto class that fits its
    config (as for ``hf:MODEL_TYPE``, :func:`tapml.frontends.models._auto_model_class`), its real weights
    in ``dtype`` (None: the dtype they are stored in), the example inputs its ``forward`` takes
    (:func:`tapml.frontends.models.example_inputs`) in that dtype."""
    from tapml.frontends.models import cast_inputs, example_inputs
    from tapml.graph import torch_dtype
    ckpt = open_checkpoint(spec)
    config = checkpoint_config(ckpt, hf_config)
    model = load_checkpoint_model(ckpt, model_class(ckpt, config), config, dtype or ckpt.dtype)
    return model, cast_inputs(example_inputs(model, model.config), torch_dtype(dtype or ckpt.dtype))


def model_class(ckpt: Checkpoint, config, causal_lm: bool = False):
    """The class that builds ``ckpt``: with remote code, the Auto class its ``auto_map`` names
    (the causal LM one first); else the transformers class its config's ``architectures`` names
    when that class takes this config (what ``save_pretrained`` recorded, so every weight has its
    place), else the Auto class that fits the config, as for ``hf:MODEL_TYPE``.
    ``causal_lm``: ``AutoModelForCausalLM`` whatever the config says (a generation)."""
    import transformers

    from tapml.frontends.models import _auto_model_class
    if causal_lm:
        return transformers.AutoModelForCausalLM
    if ckpt.remote_code:
        names = [k for k in ckpt.config.get("auto_map") or {} if isinstance(k, str) and k.startswith("AutoModel")]
        name = next((n for n in ("AutoModelForCausalLM", "AutoModel") if n in names), names[0] if names else None)
        if name is None or not hasattr(transformers, name):
            raise TapmlError(f"{ckpt.spec}: its auto_map names no AutoModel class transformers has; fix auto_map")
        return getattr(transformers, name)
    archs = config.architectures if isinstance(getattr(config, "architectures", None), list) else []
    cls = getattr(transformers, archs[0], None) if archs and isinstance(archs[0], str) \
        and archs[0].isidentifier() else None
    if isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel) \
            and isinstance(config, cls.config_class):
        return cls
    auto = _auto_model_class(config)
    if auto is None:
        raise TapmlError(f"{ckpt.spec}: transformers has no AutoModel class for its config ({type(config).__name__})")
    return auto
