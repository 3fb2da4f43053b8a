"""MODEL specs for llama.cpp's GGUF files: ``FILE.gguf``.

A GGUF file holds a model's hyperparameters and tokenizer as metadata and its weights as
tensors (float32, float16, bfloat16, or quantized blocks such as Q8_0 and Q4_0). transformers
reads it -- :func:`transformers.modeling_gguf_pytorch_utils.load_gguf_checkpoint` builds the
config, the tokenizer and the dequantized weights with the ``gguf`` package's reader -- and this
module decides whether it may: :func:`scan_gguf` walks the header itself, every count, length,
dimension and offset bounded by the file's size before anything is allocated, since ``gguf``'s
reader trusts what the header says (a string or array length past the end, a tensor count in the
billions, a tensor whose data lies outside the file). Reading a GGUF runs no code.

The weights are read in the dtype asked for; by default a file with quantized tensors loads in
float32, any other in the floating dtype most of its weights are stored in. A linear or embedding
weight stored in a quantized type of :data:`PACKED_TYPES` keeps its blocks as the file holds them
(:func:`keep_blocks_packed`): the module becomes a packed one of :mod:`tapml.frontends.quantize`
whose op reads those bytes. tapml has WGSL kernels for Q4_0, Q8_0, Q5_0 and Q4_K; the others (Q6_K,
Q5_K, Q4_1...) are ops without one, so a migration names each such node ``unsupported`` with its
type and checks the rest. A quantized tensor that is no linear's or embedding's weight is dequantized.

Example::

    header = scan_gguf("tiny.gguf")     # TapmlError (exit 2) for a file refused
    header.architecture, header.dtype   # "llama", "float32"
"""

from __future__ import annotations

import contextlib
import mmap
import os
import struct
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from tapml.errors import TapmlError
from tapml.quant import FORMATS

MAGIC = b"GGUF"
#: Bounds on a header's counts and lengths (beyond the file's own size, which bounds them all).
MAX_TENSORS = 1 << 16
MAX_FIELDS = 1 << 16
MAX_STRING_BYTES = 1 << 24
MAX_ARRAY_ITEMS = 1 << 24
MAX_NAME_BYTES = 256
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_ALIGNMENT = 1 << 16
_FLOAT_TYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64"}
# GGUF metadata value types: struct format of the scalar ones; 8 is a string, 9 an array.
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
_FIX = "convert the model again with llama.cpp's convert_hf_to_gguf.py, or download the file again"


@dataclass
class GGUFTensor:
    """One tensor's header entry: its name, shape (ggml order: fastest dimension first), ggml
    type name (``F32``, ``Q8_0``...), byte offset from the start of the data and byte length."""
    name: str
    shape: tuple[int, ...]
    type: str
    offset: int
    nbytes: int

    @property
    def elements(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass
class GGUFHeader:
    """What :func:`scan_gguf` checked: the format version, the scalar and string metadata
    (arrays are checked and left out), the tensors, and where their data starts."""
    path: Path
    version: int
    fields: dict = field(default_factory=dict)
    tensors: list[GGUFTensor] = field(default_factory=list)
    data_offset: int = 0

    @property
    def architecture(self) -> str:
        return self.fields.get("general.architecture", "")

    @property
    def quantized(self) -> list[str]:
        """The ggml types of the tensors that are not plain floats, sorted."""
        return sorted({t.type for t in self.tensors if t.type not in _FLOAT_TYPES})

    @property
    def dtype(self) -> str:
        """The dtype tapml loads the weights in by default: float32 when any tensor is quantized,
        else the floating dtype holding the most elements (float64 read as float32)."""
        if self.quantized:
            return "float32"
        counts: dict[str, int] = {}
        for t in self.tensors:
            counts[_FLOAT_TYPES[t.type]] = counts.get(_FLOAT_TYPES[t.type], 0) + t.elements
        best = max(counts, key=counts.get) if counts else "float32"
        return "float32" if best == "float64" else best

    @property
    def elements(self) -> int:
        return sum(t.elements for t in self.tensors)


def is_gguf_spec(spec) -> bool:
    """Whether the MODEL spec ``spec`` names a GGUF file (``*.gguf``)."""
    return isinstance(spec, str) and spec.lower().endswith(".gguf") and not spec.startswith(("hf:", "zoo:"))


class _Cursor:
    """Reads little-endian values from ``buf``, refusing any read past its end."""

    def __init__(self, spec: str, buf, size: int):
        self.spec, self.buf, self.size, self.pos = spec, buf, size, 0

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > self.size:
            raise TapmlError(f"{self.spec}: the header is cut short in {what} (needs {n} bytes at byte {self.pos}, "
                             f"the file has {self.size}); the file is truncated or not GGUF: {_FIX}")

    def scalar(self, fmt: str, what: str):
        n = struct.calcsize("<" + fmt)
        self.need(n, what)
        (value,) = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += n
        return value

    def string(self, what: str, limit: int = MAX_STRING_BYTES) -> str:
        n = self.scalar("Q", what)
        if n > limit:
            raise TapmlError(f"{self.spec}: {what} claims {n} bytes, more than the {limit} tapml reads; the header is "
                             f"corrupt: {_FIX}")
        self.need(n, what)
        raw = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise TapmlError(f"{self.spec}: {what} is not UTF-8 text; the header is corrupt: {_FIX}") from None

    def value(self, vtype: int, what: str, depth: int = 0):
        """A metadata value of type ``vtype``; arrays are skipped (their items checked), None returned."""
        if vtype in _SCALARS:
            return self.scalar(_SCALARS[vtype], what)
        if vtype == _STRING:
            return self.string(what)
        if vtype != _ARRAY or depth > 1:
            raise TapmlError(f"{self.spec}: {what} has value type {vtype}, which GGUF does not define"
                             f"{' (arrays nest at most twice)' if vtype == _ARRAY else ''}: {_FIX}")
        item_type = self.scalar("I", what)
        count = self.scalar("Q", what)
        if item_type in _SCALARS:
            least = struct.calcsize("<" + _SCALARS[item_type])
        elif item_type in (_STRING, _ARRAY):
            least = 8  # a length or an item type and count
        else:
            raise TapmlError(f"{self.spec}: {what} is an array of value type {item_type}, which GGUF does not define: "
                             f"{_FIX}")
        if count > MAX_ARRAY_ITEMS or count * least > self.size - self.pos:
            raise TapmlError(f"{self.spec}: {what} claims {count} items, more than the file can hold; the header is "
                             f"corrupt: {_FIX}")
        if item_type in _SCALARS:
            self.pos += count * least
        else:
            for _ in range(count):
                self.value(item_type, what, depth + 1)
        return None


def scan_gguf(spec: str) -> GGUFHeader:
    """Check the header of the GGUF file ``spec`` against the file, allocating nothing it claims.

    Refused (TapmlError, exit 2, saying what to fix): a file that is missing, no regular file,
    or not GGUF (bad magic); a big-endian file or a version other than 2 and 3; more than
    :data:`MAX_TENSORS` tensors or :data:`MAX_FIELDS` metadata fields, or counts the file
    cannot hold; a string or array longer than the bytes left; a tensor with no dimension, more
    than four, a zero or absurd dimension, a ggml type the ``gguf`` package does not know, a
    first dimension that is no whole number of its type's blocks, a misaligned offset, data
    past the end of the file (truncated) or overlapping another tensor's, or a name used twice."""
    path = Path(spec)
    if not path.exists():
        raise TapmlError(f"GGUF file {spec} does not exist")
    if not path.resolve().is_file():
        raise TapmlError(f"{spec} is not a regular file; a GGUF MODEL is one .gguf file")
    try:
        with open(path.resolve(), "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < 24:
                raise TapmlError(f"{spec} is {size} bytes, too short for a GGUF header: {_FIX}")
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                return _scan(spec, path, buf, size)
    except OSError as e:
        raise TapmlError(f"cannot read {spec}: {e.strerror or e}") from None


def _scan(spec: str, path: Path, buf, size: int) -> GGUFHeader:
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
    if bytes(buf[:4]) != MAGIC:
        raise TapmlError(f"{spec} is not a GGUF file (it starts with {bytes(buf[:4])!r}, not {MAGIC!r}); give a .gguf "
                         "written by llama.cpp or the gguf package")
    cur = _Cursor(spec, buf, size)
    cur.pos = 4
    version = cur.scalar("I", "the version")
    if version & 0xFFFF == 0 and version:
        raise TapmlError(f"{spec} is a big-endian GGUF file; tapml reads little-endian ones: convert it with "
                         "llama.cpp's gguf-py/gguf/scripts/gguf_convert_endian.py FILE little")
    if version not in (2, 3):
        raise TapmlError(f"{spec} is GGUF version {version}; tapml reads versions 2 and 3: {_FIX}")
    n_tensors = cur.scalar("Q", "the tensor count")
    n_fields = cur.scalar("Q", "the metadata count")
    # a field takes at least 12 bytes (key length, value type), a tensor entry at least 32
    for count, limit, least, what in ((n_tensors, MAX_TENSORS, 32, "tensors"),
                                      (n_fields, MAX_FIELDS, 12, "metadata fields")):
        if count > limit or count * least > size - cur.pos:
            raise TapmlError(f"{spec}: its header claims {count} {what}, more than "
                             f"{'the file can hold' if count <= limit else f'the {limit} tapml reads'}; the header is "
                             f"corrupt: {_FIX}")
    header = GGUFHeader(path=path, version=version)
    for i in range(n_fields):
        key = cur.string(f"metadata key {i}", MAX_NAME_BYTES)
        vtype = cur.scalar("I", f"metadata {key!r}")
        value = cur.value(vtype, f"metadata {key!r}")
        if key in header.fields:
            raise TapmlError(f"{spec}: metadata {key!r} appears twice: {_FIX}")
        header.fields[key] = value
    alignment = header.fields.get("general.alignment", 32)
    if type(alignment) is not int or not 0 < alignment <= MAX_ALIGNMENT or alignment & (alignment - 1):
        raise TapmlError(f"{spec}: general.alignment {alignment!r} is not a power of two up to {MAX_ALIGNMENT}: {_FIX}")
    for i in range(n_tensors):
        name = cur.string(f"tensor name {i}", MAX_NAME_BYTES)
        n_dims = cur.scalar("I", f"tensor {name!r}")
        if not 1 <= n_dims <= MAX_DIMS:
            raise TapmlError(f"{spec}: tensor {name!r} claims {n_dims} dimensions; GGUF tensors have 1 to {MAX_DIMS}: "
                             f"{_FIX}")
        shape = tuple(cur.scalar("Q", f"tensor {name!r}") for _ in range(n_dims))
        type_id = cur.scalar("I", f"tensor {name!r}")
        offset = cur.scalar("Q", f"tensor {name!r}")
        try:
            ggml_type = GGMLQuantizationType(type_id)
            block, block_bytes = GGML_QUANT_SIZES[ggml_type]
        except (ValueError, KeyError):
            raise TapmlError(f"{spec}: tensor {name!r} has ggml type {type_id}, which gguf does not know; upgrade "
                             f"gguf or {_FIX}") from None
        elements = 1
        for d in shape:
            elements *= d
        if not all(d >= 1 for d in shape) or elements > size * block:
            raise TapmlError(f"{spec}: tensor {name!r} claims the shape {list(shape)}, which the file cannot hold; the "
                             f"header is corrupt: {_FIX}")
        if shape[0] % block:
            raise TapmlError(f"{spec}: tensor {name!r} ({ggml_type.name}) has a first dimension {shape[0]} that is no "
                             f"whole number of its {block}-element blocks: {_FIX}")
        if offset % alignment:
            raise TapmlError(f"{spec}: tensor {name!r} starts at offset {offset}, not a multiple of the alignment "
                             f"{alignment}: {_FIX}")
        header.tensors.append(GGUFTensor(name, shape, ggml_type.name, offset, elements // block * block_bytes))
    names = [t.name for t in header.tensors]
    if len(set(names)) != len(names):
        raise TapmlError(f"{spec}: a tensor name appears twice: {_FIX}")
    header.data_offset = -(-cur.pos // alignment) * alignment
    end = header.data_offset
    for t in sorted(header.tensors, key=lambda t: t.offset):
        if header.data_offset + t.offset < end:
            raise TapmlError(f"{spec}: the data of tensor {t.name!r} overlaps another tensor's: {_FIX}")
        end = header.data_offset + t.offset + t.nbytes
        if end > size:
            raise TapmlError(f"{spec}: the data of tensor {t.name!r} ends at byte {end}, past the end of the file "
                             f"({size} bytes): the file is truncated; download or convert it again")
    return header


def check_architecture(spec: str, header: GGUFHeader) -> None:
    """TapmlError unless transformers reads GGUF files of ``header``'s architecture."""
    import transformers
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES
    arch = header.architecture
    if not isinstance(arch, str) or not arch:
        raise TapmlError(f"{spec} has no general.architecture; it is not a model GGUF: {_FIX}")
    readable = [a for a in GGUF_SUPPORTED_ARCHITECTURES if a not in ("general", "tokenizer")]  # key groups, no models
    if arch not in readable:
        from tapml.text import shown
        raise TapmlError(f"{spec}: architecture {shown(arch[:80])!r} is not one transformers "
                         f"{transformers.__version__} reads from GGUF (it reads "
                         f"{', '.join(readable)}); convert the model to a checkpoint folder "
                         "(config.json and safetensors) instead")


#: Config keys transformers maps ``ARCH.block_count`` to.
_LAYER_KEYS = ("num_hidden_layers", "n_layer", "num_layers")


def gguf_config(spec: str, header: GGUFHeader) -> dict:
    """The config dict transformers makes of the GGUF file's metadata (its ``model_type``...).
    TapmlError when it claims more layers than the file holds ``blk.N.`` tensors for: a model
    of a million layers would be built before its weights are found missing."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
    try:
        config = dict(load_gguf_checkpoint(str(header.path.resolve()), return_tensors=False)["config"])
    except Exception as e:  # noqa: BLE001 - metadata transformers cannot read is bad input
        raise TapmlError(f"{spec}: transformers cannot read its metadata: {type(e).__name__}: "
                         f"{(str(e).strip().splitlines() or [''])[0][:300]}") from None
    blocks = {t.name.split(".")[1] for t in header.tensors if t.name.startswith("blk.") and t.name.count(".") >= 2}
    for key in _LAYER_KEYS:
        layers = config.get(key)
        if key in config and (type(layers) is not int or not 0 <= layers <= len(blocks)):
            raise TapmlError(f"{spec}: {header.architecture}.block_count is {str(layers)[:40]}, but the file holds "
                             f"tensors of {len(blocks)} blocks (blk.N.*): {_FIX}")
    return config


def complete_gguf_config(ckpt, config, given: dict) -> None:
    """Set on ``config`` (transformers' config of the GGUF checkpoint ``ckpt``) what the file
    states but transformers' reading of it (``ckpt.config``) leaves to the config class's
    defaults, unless ``--hf-config`` (``given``) sets it: the head size
    ``ARCH.attention.key_length`` where transformers maps that key to nothing for the
    architecture and set no head_dim (Qwen3's default is 128, whatever the file says), and no
    padding token where the file names none and the class's default lies outside the vocabulary
    (Phi-3's 32000: the embedding could not be built)."""
    import inspect

    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING
    header = ckpt.gguf
    arch = header.architecture
    key_length = header.fields.get(f"{arch}.attention.key_length")
    # transformers set head_dim from the file, or maps key_length to another setting (gemma4: global_head_dim);
    # its mapping is keyed by the file's architecture or by its own name for it (qwen2moe: qwen2_moe)
    mapped = "head_dim" in ckpt.config or any("attention.key_length" in GGUF_CONFIG_MAPPING.get(name, {})
                                              for name in (arch, getattr(config, "model_type", None)))
    if ("head_dim" not in given and not mapped and type(key_length) is int and 0 < key_length <= 1 << 16
            and "head_dim" in inspect.signature(type(config).__init__).parameters):
        config.head_dim = key_length
    pad, vocab = getattr(config, "pad_token_id", None), getattr(config, "vocab_size", None)
    if ("pad_token_id" not in given and "tokenizer.ggml.padding_token_id" not in header.fields
            and type(pad) is int and type(vocab) is int and not 0 <= pad < vocab):
        config.pad_token_id = None


def load_gguf_weights(ckpt, model, dtype: str):
    """Load the GGUF file of ``ckpt`` into ``model`` (built from its config), dequantized to
    ``dtype``, with transformers' own GGUF reading (names mapped, llama's q/k permutation undone).
    TapmlError when a tensor does not fit the model or one the model needs is not in the file."""
    import io

    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from tapml.graph import torch_dtype
    try:
        _check_tensor_names(ckpt, model)
        with contextlib.redirect_stderr(io.StringIO()):  # its progress bar (tqdm) is no output of tapml's
            tensors = load_gguf_checkpoint(str(ckpt.weights[0]), return_tensors=True, model_to_load=model,
                                           torch_dtype=torch_dtype(dtype))["tensors"]
    except TapmlError:
        raise
    except Exception as e:  # noqa: BLE001 - tensors transformers cannot read are bad input
        raise TapmlError(f"{ckpt.spec}: transformers cannot read its tensors: {type(e).__name__}: "
                         f"{(str(e).strip().splitlines() or [''])[0][:300]}") from None
    own = dict(model.named_parameters())
    for name, tensor in tensors.items():
        if name in own and tuple(own[name].shape) != tuple(tensor.shape):
            raise TapmlError(f"{ckpt.spec}: the weights do not fit the config: {name} is {tuple(tensor.shape)} in the "
                             f"file, {tuple(own[name].shape)} in the model; fix --hf-config or {_FIX}")
    missing = sorted(set(model.load_state_dict(tensors, strict=False).missing_keys) & set(own))
    if missing:
        raise TapmlError(f"{ckpt.spec}: the weights do not fit the config: {len(missing)} tensors the model needs are "
                         f"not in the file (first: {missing[0][:120]}); {_FIX}")
    model = model.to(torch_dtype(dtype)).eval()
    keep_blocks_packed(ckpt, model)
    return model


#: ggml types whose blocks stay packed (a tapml op reads them), with their format in :data:`tapml.quant.FORMATS`.
PACKED_TYPES = {name.upper(): name for name, fmt in FORMATS.items() if fmt.family == "ggml"}


def keep_blocks_packed(ckpt, model) -> list[str]:
    """Replace every ``nn.Linear``/``nn.Embedding`` of ``model`` whose weight the file stores in a
    type of :data:`PACKED_TYPES` by a packed module holding the file's own blocks (rows in the
    order the model uses: a row permutation transformers applied, such as llama's q/k one, is
    applied to whole rows of blocks). Returns the names of the modules replaced.

    The row order is found by matching each loaded (dequantized) row to the file's row that
    dequantizes to the same values, so whatever transformers did to a tensor other than permuting
    its rows leaves that module as it loaded it (dequantized)."""
    import torch
    from transformers.modeling_gguf_pytorch_utils import TensorProcessor, get_gguf_hf_weights_map

    from tapml.frontends.quantize import packed_module
    from tapml.quant import dequantize, ggml_tensor
    wanted = [t for t in ckpt.gguf.tensors if t.type in PACKED_TYPES and len(t.shape) == 2]
    if not wanted:
        return []
    names = get_gguf_hf_weights_map(model, TensorProcessor())
    modules = dict(model.named_modules())
    replaced = []
    with open(ckpt.gguf.path, "rb") as f:
        for t in wanted:
            hf_weight = names.get(t.name) or ""
            hf_name = hf_weight.removesuffix(".weight")
            owner = modules.get(hf_name) if hf_weight.endswith(".weight") else None
            scheme = PACKED_TYPES[t.type]
            if type(owner) not in (torch.nn.Linear, torch.nn.Embedding) or t.shape[0] % FORMATS[scheme].block_elems:
                continue
            cols, rows = t.shape  # ggml order: the fastest dimension first
            if tuple(owner.weight.shape) != (rows, cols):
                continue
            f.seek(ckpt.gguf.data_offset + t.offset)
            raw = f.read(t.nbytes)
            block_rows = torch.frombuffer(bytearray(raw), dtype=torch.uint8).reshape(rows, -1)
            order = _row_order(dequantize(scheme, {"weight": ggml_tensor(raw)}, rows, cols).to(owner.weight.dtype),
                               owner.weight.detach())
            if order is None:
                continue
            packed = {"weight": ggml_tensor(raw) if isinstance(order, slice) else
                      ggml_tensor(block_rows[order].numpy().tobytes())}
            parent, _, attr = hf_name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, attr, packed_module(owner, scheme, packed))
            replaced.append(hf_name)
    config = getattr(model, "config", None)
    if replaced and config is not None and getattr(config, "tie_word_embeddings", False):
        config.tie_word_embeddings = False
    return replaced


def _row_order(file_rows, loaded):
    """Indices ``order`` with ``file_rows[order] == loaded`` row for row (bitwise), or None; a slice of
    every row for a tensor transformers left in the file's order (most of them), without matching rows."""
    import torch
    if torch.equal(file_rows, loaded):
        return slice(None)
    where: dict[bytes, int] = {}
    for i, row in enumerate(file_rows):
        where.setdefault(row.numpy().tobytes(), i)
    order = [where.get(row.numpy().tobytes()) for row in loaded]
    return None if any(i is None for i in order) else torch.tensor(order, dtype=torch.long)


def _check_tensor_names(ckpt, model) -> None:
    """TapmlError when transformers knows no GGUF tensor names for the model it built from the
    file (a llama file named exactly 'mistral' builds a Mistral, which gguf-py has no names for);
    its own error would advise installing gguf from source, which does not help."""
    import transformers
    from transformers.modeling_gguf_pytorch_utils import TensorProcessor, get_gguf_hf_weights_map
    arch, model_type = ckpt.gguf.architecture, model.config.model_type
    try:
        get_gguf_hf_weights_map(model, TensorProcessor())
    except NotImplementedError:
        named = "" if model_type == arch else f" (general.name {str(ckpt.gguf.fields.get('general.name'))[:80]!r})"
        raise TapmlError(f"{ckpt.spec}: transformers {transformers.__version__} builds a {model_type} model from this "
                         f"{arch!r} file{named} and knows no GGUF tensor names for {model_type}, so it cannot load the "
                         "weights; convert the model to a checkpoint folder (config.json and safetensors) instead") \
            from None


@contextlib.contextmanager
def gguf_alone(ckpt):
    """``(folder, name)`` for transformers' ``from_pretrained(folder, gguf_file=name)``: a private
    folder holding only a link to the GGUF file, so that nothing lying beside the file (a
    ``tokenizer_config.json``, a ``config.json``) is read with it."""
    with tempfile.TemporaryDirectory(prefix="tapml-gguf-") as folder:
        os.symlink(ckpt.weights[0], os.path.join(folder, "model.gguf"))
        yield folder, "model.gguf"


def load_gguf_tokenizer(ckpt):
    """The tokenizer transformers builds from the GGUF file's metadata (:func:`gguf_alone`), None
    when it holds none."""
    from transformers import AutoTokenizer
    if not isinstance(ckpt.gguf.fields.get("tokenizer.ggml.model"), str):
        return None
    try:
        with gguf_alone(ckpt) as (folder, name):
            return AutoTokenizer.from_pretrained(folder, gguf_file=name, local_files_only=True)
    except Exception as e:  # noqa: BLE001 - a tokenizer transformers cannot build is bad input
        raise TapmlError(f"{ckpt.spec}: transformers cannot build its tokenizer: {type(e).__name__}: "
                         f"{(str(e).strip().splitlines() or [''])[0][:300]}") from None


__all__ = ["scan_gguf", "is_gguf_spec", "check_architecture", "gguf_config", "complete_gguf_config",
           "load_gguf_weights", "keep_blocks_packed", "PACKED_TYPES", "load_gguf_tokenizer", "gguf_alone", "GGUFHeader", "GGUFTensor", "MAX_TENSORS",
           "MAX_FIELDS"]
