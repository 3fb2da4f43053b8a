"""Reading ``.pt2`` archives (``torch.export.save``) from strangers without running their code.

``torch.export.load`` unpickles whatever the archive asks for: the example inputs (with a
fallback to ``weights_only=False``), weights and constants marked ``use_pickle``, custom and
opaque objects, legacy ``*.pt`` weight files and the pre-2.8 zip layout; it loads AOTInductor
shared libraries; it ``sympify``s (``eval``s) symbolic-shape strings; it resolves node targets
as attribute chains under ``torch``, which run later; and ``ExportedProgram.module()`` (which
``run_decompositions`` calls) ``exec``s generated Python holding the archive's guard code,
names, attribute paths and keyword names. :func:`load_pt2` therefore checks the archive
first, from the zip directory and JSON only, and hands torch's archive reader a copy that
holds nothing it would unpickle or run:

- entries: stored (not compressed), under one root folder, each of a known kind; entries that
  only a pickle or native code can read are refused with a message saying how to re-save;
- weights and constants: raw bytes only (``use_pickle`` false), plain dotted names, each
  tensor's extent inside its record;
- the program JSON: every node target in tapml's closed op vocabulary (:mod:`tapml.ops`), or
  an in-place twin of one, or one of the few shape, assert and ``getitem`` operators export
  emits; no custom objects or operator arguments; every name that reaches generated code a
  plain identifier or dotted path; symbolic expressions only in a small subset of sympy's repr
  grammar; guard code dropped (it only checks inputs, and tapml runs the archive's own);
- the example inputs (a ``torch.save`` pickle): decoded by :func:`decode_tensor_pickle`, which
  walks the opcodes with :mod:`pickletools` (a decoder that never imports or calls anything)
  and rebuilds only tuples, lists, dicts, numbers, strings and plain CPU tensors.
"""

from __future__ import annotations

import io
import json
import logging
import pickletools
import re
import zipfile
from contextlib import contextmanager
from pathlib import Path

from tapml.errors import TapmlError

RESAVE = ("re-save it from the model with torch.export.save(torch.export.export(model, args), FILE) "
          "in a current torch")

# Entries of an archive written by torch.export.save (relative to its root folder).
_FIXED_ENTRIES = {"archive_format", "archive_version", "byteorder", ".data/version", ".data/serialization_id",
                  "models/model.json", "data/weights/model_weights_config.json",
                  "data/constants/model_constants_config.json"}
SAMPLE_INPUTS = "data/sample_inputs/model.pt"
#: Largest archive read (it is read whole; a FIFO or device is refused before reading).
MAX_PT2_BYTES = 1 << 40
_WEIGHT_RECORD = re.compile(r"weight_[0-9]{1,9}")
_CONSTANT_RECORD = re.compile(r"tensor_[0-9]{1,9}")
_EXTRA = re.compile(r"extra/[A-Za-z0-9_.-]{1,200}")

# Node targets outside the aten namespace that exported graphs use; all pure functions of ints.
_OTHER_TARGETS = {f"_operator.{name}" for name in (
    "getitem", "add", "sub", "mul", "floordiv", "truediv", "mod", "neg", "pos",
    "eq", "ne", "lt", "le", "gt", "ge", "and_", "or_")} | {
    f"torch.{name}" for name in ("sym_max", "sym_min", "sym_float", "sym_int", "sym_not", "sym_ite")} | {
    # torch.no_grad() regions of a model exported outside no_grad; its subgraph is checked
    # like the graph, and decomposition inlines it.
    "torch.ops.higher_order.wrap_with_set_grad_enabled"}
# Shape, scalar and assert ops that torch.export puts in graphs; none returns tensors.
_EXPORT_OPS = {f"aten.{name}" for name in (
    "sym_size.int", "sym_stride.int", "sym_numel.default", "sym_storage_offset.default",
    "_assert_scalar.default", "_assert_tensor_metadata.default", "sym_constrain_range.default",
    "sym_constrain_range_for_size.default", "_local_scalar_dense.default", "item.default")}
# Python-operator spellings of bitwise ops that export keeps (decomposition renames them).
_DUNDER_OPS = {f"__{name}__" for name in ("and", "or", "xor", "lshift", "rshift",
                                           "iand", "ior", "ixor", "ilshift", "irshift")}
_FQN = re.compile(r"(?:[A-Za-z0-9_]+(?:\.[A-Za-z0-9_]+)*)?")
_REFUSED_ARGUMENTS = {"as_custom_obj": "a custom (torchbind) object", "as_operator": "an operator argument"}

# Symbolic expressions are written by sympy's srepr (``Mul(Integer(2), Symbol('s0', integer=True))``)
# and read by sympify, which evaluates Python: only calls of sympy's and torch's shape-expression
# classes on short literals get through (no attribute access, no operators, no other names).
# Pow and LShift are left out, and integers kept short, so an expression cannot grow without bound.
_EXPR_TOKEN = re.compile(r"\s+|'[A-Za-z0-9_.+-]{0,64}'|-?[0-9]{1,19}|[A-Za-z_][A-Za-z0-9_]*|[(),=-]")
_EXPR_NAMES = {
    "Symbol", "Integer", "Rational", "Float", "Add", "Mul", "Mod", "Max", "Min", "Abs", "floor", "ceiling",
    "Equality", "Unequality", "StrictLessThan", "LessThan", "StrictGreaterThan", "GreaterThan",
    "And", "Or", "Not", "true", "false", "oo", "int_oo", "IntInfinity", "NegativeIntInfinity",
    "FloorDiv", "ModularIndexing", "Where", "PythonMod", "CleanDiv", "CeilToInt", "FloorToInt", "CeilDiv",
    "RShift", "FloatTrueDiv", "IntTrueDiv", "IsNonOverlappingAndDenseIndicator", "TruncToFloat",
    "TruncToInt", "RoundToInt", "RoundDecimal", "ToFloat", "Identity",
    # keyword arguments (assumptions, precision) and their values
    "integer", "positive", "nonnegative", "negative", "nonpositive", "real", "finite", "zero", "nonzero",
    "rational", "commutative", "precision", "True", "False", "None"}

# torch._export.serde.schema.ScalarType values -> torch dtype names (raw tensor records).
_SCALAR_TYPES = {1: "uint8", 2: "int8", 3: "int16", 4: "int32", 5: "int64", 6: "float16", 7: "float32",
                 8: "float64", 12: "bool", 13: "bfloat16", 35: "uint64"}
_STRIDED_LAYOUT = 7
# torch.save storage classes -> dtype names (example inputs).
_STORAGE_TYPES = {"FloatStorage": "float32", "DoubleStorage": "float64", "HalfStorage": "float16",
                  "BFloat16Storage": "bfloat16", "LongStorage": "int64", "IntStorage": "int32",
                  "ShortStorage": "int16", "CharStorage": "int8", "ByteStorage": "uint8", "BoolStorage": "bool"}


def load_pt2(path: str | Path):
    """``(exported_program, example_args, example_kwargs)`` of a ``.pt2`` file, reading nothing
    that could run code.

    Raises TapmlError saying what the archive holds that tapml refuses and how to re-save it.
    Example: ``ep, args, kwargs = load_pt2("model.pt2")``.
    """
    import torch

    name = str(path)
    from tapml.io import read_regular_file
    data = read_regular_file(path, name, max_bytes=MAX_PT2_BYTES)
    entries = _read_zip(data, name, "archive")
    if "version" in entries or any(k.startswith("serialized_") for k in entries):
        raise TapmlError(f"{name} uses the old torch.export zip layout, whose weights and inputs are pickles; "
                         f"load it where you trust it and {RESAVE}")
    root, rel = _split_root(entries, name)
    _check_entry_kinds(rel, name)
    for needed in ("archive_version", "models/model.json", SAMPLE_INPUTS,
                   "data/weights/model_weights_config.json", "data/constants/model_constants_config.json"):
        if needed not in rel:
            raise TapmlError(f"{name} has no {needed}: it was not written by torch.export.save; {RESAVE}")
    _check_payloads(rel, "data/weights/", "model_weights_config.json", _WEIGHT_RECORD, name)
    _check_payloads(rel, "data/constants/", "model_constants_config.json", _CONSTANT_RECORD, name)
    program = _json(rel["models/model.json"], f"{name}: models/model.json")
    _check_program(program, name)
    args, kwargs = _example_inputs(rel[SAMPLE_INPUTS], name)

    # Torch reads a copy without the example inputs (an empty record makes it skip them) and
    # without guard code, which ExportedProgram.module() would exec: guards only check inputs,
    # and tapml runs the program on the archive's own example inputs.
    program["guards_code"] = []
    replaced = {f"{root}/{SAMPLE_INPUTS}": b"", f"{root}/models/model.json": json.dumps(program).encode()}
    clean = io.BytesIO()
    with zipfile.ZipFile(clean, "w", zipfile.ZIP_STORED) as z:
        for entry, content in entries.items():
            z.writestr(entry, replaced.get(entry, content))
    clean.seek(0)
    if "transformers.modeling_outputs." in rel["models/model.json"].decode("utf-8", "replace"):
        _register_transformers_outputs()
    try:
        # torch.export.load's own reader, without the fallback to the pickled pre-2.8 layout
        # that torch.export.load tries when this one fails (torch is pinned in pyproject.toml).
        from torch.export.pt2_archive._package import load_pt2 as read_pt2_archive
        with _quiet_torch_export_logs():
            ep = read_pt2_archive(clean).exported_programs["model"]
    except Exception as e:  # noqa: BLE001 - anything torch rejects in a checked archive is bad input
        first = (str(e).strip().splitlines() or [""])[0][:300]
        raise TapmlError(f"{name} is not a readable torch.export program ({type(e).__name__}: {first}); "
                         f"{RESAVE}") from None
    try:
        ep.example_inputs = (args, kwargs)
    except Exception as e:  # noqa: BLE001 - torch checks the inputs against the program's signature
        raise TapmlError(f"{name}: its example inputs do not match the program ({e}); {RESAVE}") from None
    return ep, args, kwargs


def _read_zip(data: bytes, name: str, what: str) -> dict[str, bytes]:
    """Every entry of a zip held in ``data``; refuses compressed, duplicate or overlapping entries."""
    try:
        z = zipfile.ZipFile(io.BytesIO(data))
        infos = z.infolist()
    except Exception as e:  # noqa: BLE001 - whatever a malformed zip directory trips over is bad input
        raise TapmlError(f"{name}: the {what} is not a zip archive ({e}); {RESAVE}") from None
    names = [i.filename for i in infos]
    if len(set(names)) != len(names):
        raise TapmlError(f"{name}: the {what} lists an entry twice; {RESAVE}")
    # torch writes stored entries; refusing compression rules out decompression bombs, and
    # stored entries that fit in the file cannot be read more than once over.
    if any(i.compress_type != zipfile.ZIP_STORED or i.file_size != i.compress_size for i in infos) \
            or sum(i.file_size for i in infos) > len(data):
        raise TapmlError(f"{name}: the {what} has compressed or overlapping entries, which "
                         f"torch.export.save never writes; {RESAVE}")
    try:
        return {i.filename: z.read(i) for i in infos}
    except Exception as e:  # noqa: BLE001 - a damaged entry (bad CRC, header) is bad input
        raise TapmlError(f"{name}: the {what} is damaged ({e}); {RESAVE}") from None


def _split_root(entries: dict[str, bytes], name: str) -> tuple[str, dict[str, bytes]]:
    roots = {entry.partition("/")[0] for entry in entries}
    if len(roots) != 1 or any("/" not in entry for entry in entries):
        raise TapmlError(f"{name}: a torch.export archive keeps every entry under one folder; {RESAVE}")
    root = roots.pop()
    rel = {entry[len(root) + 1:]: content for entry, content in entries.items()}
    if any(not r or r.startswith("/") or "\\" in r or ".." in r.split("/") for r in rel):
        raise TapmlError(f"{name}: an entry name leaves its folder; {RESAVE}")
    return root, rel


def _check_entry_kinds(rel: dict[str, bytes], name: str) -> None:
    for entry in rel:
        if entry in _FIXED_ENTRIES or entry == SAMPLE_INPUTS or _EXTRA.fullmatch(entry):
            continue
        folder, _, base = entry.rpartition("/")
        if folder == "data/weights" and _WEIGHT_RECORD.fullmatch(base):
            continue
        if folder == "data/constants" and _CONSTANT_RECORD.fullmatch(base):
            continue
        if entry.startswith("data/aotinductor/"):
            raise TapmlError(f"{name} is an AOTInductor package: it holds compiled native code, which tapml "
                             f"never loads; save the exported program itself: {RESAVE}")
        if folder in ("data/weights", "data/constants") and base.endswith(".pt"):
            raise TapmlError(f"{name} stores its {folder[5:]} in the legacy pickled format ({entry}); {RESAVE}")
        if folder == "data/constants" and base.startswith(("custom_obj_", "opaque_obj_")):
            raise TapmlError(f"{name} holds a pickled custom or opaque object ({entry}), which tapml will not "
                             f"unpickle; export a model whose constants are plain tensors and {RESAVE}")
        raise TapmlError(f"{name} holds an entry torch.export.save does not write ({entry[:120]!r}); {RESAVE}")


def _json(content: bytes, where: str):
    try:
        return json.loads(content.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise TapmlError(f"{where} is not valid JSON ({type(e).__name__}); {RESAVE}") from None


def _int_field(value, where: str) -> int:
    if not (isinstance(value, dict) and set(value) == {"as_int"} and type(value["as_int"]) is int
            and value["as_int"] >= 0):
        raise TapmlError(f"{where} must be a non-negative integer (symbolic sizes are not supported for "
                         f"weights); {RESAVE}")
    return value["as_int"]


def _check_payloads(rel: dict[str, bytes], folder: str, config_name: str, record: re.Pattern, name: str) -> None:
    """Weights or constants: raw tensor records only, each tensor inside its record."""
    import torch
    where = f"{name}: {folder}{config_name}"
    config = _json(rel[folder + config_name], where)
    if not (isinstance(config, dict) and set(config) == {"config"} and isinstance(config["config"], dict)):
        raise TapmlError(f"{where} does not have the layout torch.export.save writes; {RESAVE}")
    for fqn, meta in config["config"].items():
        item = f"{where}: {str(fqn)[:80]!r}"
        if not _FQN.fullmatch(fqn) or not fqn:
            raise TapmlError(f"{item} is not a dotted name of plain identifiers; {RESAVE}")
        if not isinstance(meta, dict):
            raise TapmlError(f"{item} is not an object; {RESAVE}")
        if meta.get("use_pickle") is not False:
            raise TapmlError(f"{item} is stored as a pickle (a tensor subclass, e.g. quantized or "
                             f"parametrized), which tapml will not unpickle; turn it into a plain tensor "
                             f"(t.as_subclass(torch.Tensor), or dequantize) before exporting, then {RESAVE}")
        path_name, tensor_meta = meta.get("path_name"), meta.get("tensor_meta")
        if not (isinstance(path_name, str) and record.fullmatch(path_name) and folder + path_name in rel):
            raise TapmlError(f"{item} names no tensor record of the archive; {RESAVE}")
        if not isinstance(tensor_meta, dict) or tensor_meta.get("layout") != _STRIDED_LAYOUT:
            raise TapmlError(f"{item} is not a dense (strided) tensor; {RESAVE}")
        dtype = _SCALAR_TYPES.get(tensor_meta["dtype"]) if type(tensor_meta.get("dtype")) is int else None
        sizes, strides = tensor_meta.get("sizes"), tensor_meta.get("strides")
        if dtype is None or not isinstance(sizes, list) or not isinstance(strides, list) \
                or len(sizes) != len(strides) or len(sizes) > 16 or type(tensor_meta.get("requires_grad")) is not bool:
            raise TapmlError(f"{item} has a dtype, shape or stride tapml does not take; {RESAVE}")
        shape = [_int_field(s, item) for s in sizes]
        stride = [_int_field(s, item) for s in strides]
        offset = _int_field(tensor_meta.get("storage_offset"), item)
        itemsize = getattr(torch, dtype).itemsize
        nbytes = len(rel[folder + path_name])
        if 0 not in shape and (offset + 1 + sum((n - 1) * s for n, s in zip(shape, stride))) * itemsize > nbytes:
            raise TapmlError(f"{item} reaches past the end of its record {path_name} ({nbytes} bytes); {RESAVE}")


def _check_program(program, name: str) -> None:
    """The program JSON: closed op vocabulary, no code, no objects torch would resolve by name."""
    where = f"{name}: models/model.json"
    if not isinstance(program, dict) or not isinstance(program.get("graph_module"), dict):
        raise TapmlError(f"{where} does not have the layout torch.export.save writes; {RESAVE}")
    graph = program["graph_module"].get("graph")
    if not isinstance(graph, dict) or graph.get("custom_obj_values"):
        raise TapmlError(f"{where}: the graph holds custom objects, which tapml will not load; {RESAVE}")
    pending = [program]
    while pending:
        value = pending.pop()
        if isinstance(value, list):
            pending.extend(value)
            continue
        if not isinstance(value, dict):
            continue
        for key, kind in _REFUSED_ARGUMENTS.items():
            if key in value:
                raise TapmlError(f"{where}: the graph passes {kind}; tapml carves graphs of aten ops only, "
                                 f"so export a model without it and {RESAVE}")
        if "expr_str" in value:
            _check_expr(value["expr_str"], where)
        _check_names(value, where)
        if "target" in value and "inputs" in value and "outputs" in value:
            target = value["target"]
            if not isinstance(target, str):
                raise TapmlError(f"{where}: a node target is not a string; {RESAVE}")
            try:
                _check_target(target)
            except ValueError as e:
                raise TapmlError(f"{where}: node target {target[:120]!r} is outside the ops tapml accepts "
                                 f"({e}); export the model to plain aten ops and {RESAVE}") from None
        pending.extend(value.values())


def _check_names(value: dict, where: str) -> None:
    """Names that torch writes into the Python source it generates for the program (variables,
    parameters, attribute paths, keyword names) must be identifiers or dotted paths of them."""
    bad = None
    for key, item in value.items():
        if key == "name" and isinstance(item, str) and item and not item.isidentifier():
            bad = item
        elif (key == "fqn" or key.endswith("_name")) and isinstance(item, str) and not _FQN.fullmatch(item):
            bad = item
        elif key == "forward_arg_names" and not (isinstance(item, list) and all(
                isinstance(n, str) and n.isidentifier() for n in item)):
            bad = str(item)
        elif key in ("in_spec", "out_spec") and isinstance(item, str) and not _plain_treespec(item):
            bad = item
        elif key == "field_names" and not (isinstance(item, list) and all(
                isinstance(n, str) and n.isidentifier() for n in item)):
            bad = str(item)
        if bad is not None:
            raise TapmlError(f"{where}: {key} {bad[:80]!r} is not a plain Python name (torch would write it "
                             f"into generated code); {RESAVE}")


def _plain_treespec(text: str) -> bool:
    """A pytree spec (JSON) whose contexts (dict keys, field names) hold only plain names."""
    try:
        spec = json.loads(text)
    except (ValueError, RecursionError):
        return False
    pending = [spec]
    while pending:
        value = pending.pop()
        if isinstance(value, list):
            pending.extend(value)
        elif isinstance(value, dict):
            context = value.get("context")
            if isinstance(context, str):
                try:
                    pending.append(json.loads(context))
                except (ValueError, RecursionError):
                    return False
            pending.extend(v for k, v in value.items() if k != "context")
        elif isinstance(value, str) and not _FQN.fullmatch(value):
            return False
    return True


def _check_target(target: str) -> None:
    """A node target of a saved (not yet decomposed) graph: tapml's op vocabulary, plus the
    in-place variants of its ops and the shape and assert ops that export puts in graphs
    (decomposition turns both into functional core ATen). ValueError says why not."""
    import torch

    from tapml.ops import check_op
    if target in _OTHER_TARGETS:
        return
    name = target.removeprefix("torch.ops.")
    if name == target or not name.startswith("aten."):
        raise ValueError("not an aten op")
    if name in _EXPORT_OPS:
        return
    parts = name.split(".")
    op, overload = (parts[1], parts[2]) if len(parts) == 3 else ("", "")
    in_place = re.fullmatch(r"[a-z][a-z0-9_]*_", op) is not None
    if op in _DUNDER_OPS or in_place:
        # ``aten.add_.Tensor``: a real aten overload whose functional twin is in the vocabulary.
        packet = getattr(torch.ops.aten, op, None)
        if not isinstance(packet, torch._ops.OpOverloadPacket) or overload not in packet.overloads():
            raise ValueError(f"no such op {name}")
        if in_place:
            check_op(f"aten.{op[:-1]}.{overload}")
        return
    check_op(name)


def _check_expr(expr, where: str) -> None:
    if not isinstance(expr, str) or len(expr) > 2000:
        raise TapmlError(f"{where}: a symbolic expression is not a short string; {RESAVE}")
    tokens = _EXPR_TOKEN.findall(expr)
    if "".join(tokens) != expr or any((t[0].isalpha() or t[0] == "_") and t not in _EXPR_NAMES for t in tokens):
        raise TapmlError(f"{where}: symbolic expression {expr[:80]!r} is not a plain sympy shape expression "
                         f"(tapml takes Symbol, Integer, Add, Mul, FloorDiv and the like, without Pow); {RESAVE}")


def _example_inputs(content: bytes, name: str) -> tuple[tuple, dict]:
    where = f"{name}: {SAMPLE_INPUTS}"
    if not content:
        raise TapmlError(f"{name} holds no example inputs; save it from torch.export.export(model, args)")
    inner = _read_zip(content, where, "example-input file")
    roots = {entry.partition("/")[0] for entry in inner}
    if len(roots) != 1 or any("/" not in entry for entry in inner):
        raise TapmlError(f"{where} is not a file written by torch.save; {RESAVE}")
    root = roots.pop()
    records = {entry[len(root) + 1:]: data for entry, data in inner.items()}
    if records.get("byteorder", b"little") != b"little" or "data.pkl" not in records:
        raise TapmlError(f"{where} is not a little-endian file written by torch.save; {RESAVE}")
    value = decode_tensor_pickle(records["data.pkl"], records, where)
    if not (isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], tuple)
            and isinstance(value[1], dict)):
        raise TapmlError(f"{where} does not hold (args, kwargs); {RESAVE}")
    return value


class _Global:
    """A name a pickle refers to, kept as a name: nothing is imported."""

    def __init__(self, module: str, qualname: str):
        self.module, self.qualname = module, qualname


class _Storage:
    def __init__(self, tensor):
        self.tensor = tensor


def decode_tensor_pickle(data: bytes, records: dict[str, bytes], where: str = "pickle"):
    """Decode a ``torch.save`` pickle of tuples, lists, dicts, numbers, strings and plain tensors.

    ``records`` maps ``data/KEY`` to storage bytes. The opcodes are read with
    :func:`pickletools.genops`, which only decodes; globals are kept as names, and the only
    calls made are tapml's own tensor rebuild (from raw bytes) and an empty ``OrderedDict``.
    Anything else (another global, an object build, an extension) raises TapmlError.
    """
    stack: list = []
    marks: list[int] = []
    memo: dict = {}
    storages: dict[str, _Storage] = {}

    def pop_mark() -> list:
        start = marks.pop()
        items = stack[start:]
        del stack[start:]
        return items

    def refuse(what: str):
        raise TapmlError(f"{where} holds {what}, which tapml will not unpickle; keep the example inputs "
                         f"plain CPU tensors and {RESAVE}")

    try:
        for opcode, arg, _ in pickletools.genops(data):
            op = opcode.name
            if op in ("PROTO", "FRAME"):
                continue
            if op == "STOP":
                if len(stack) != 1 or marks:
                    refuse("a malformed pickle")
                return stack[0]
            if op == "MARK":
                marks.append(len(stack))
            elif op in ("BININT", "BININT1", "BININT2", "LONG1", "BINFLOAT", "BINUNICODE",
                        "SHORT_BINUNICODE", "BINUNICODE8"):
                stack.append(arg)
            elif op in ("NONE", "NEWTRUE", "NEWFALSE"):
                stack.append({"NONE": None, "NEWTRUE": True, "NEWFALSE": False}[op])
            elif op == "EMPTY_TUPLE":
                stack.append(())
            elif op in ("TUPLE1", "TUPLE2", "TUPLE3"):
                n = int(op[-1])
                if len(stack) - (marks[-1] if marks else 0) < n:
                    refuse("a malformed pickle")
                items = tuple(stack[-n:])
                del stack[-n:]
                stack.append(items)
            elif op == "TUPLE":
                stack.append(tuple(pop_mark()))
            elif op == "EMPTY_LIST":
                stack.append([])
            elif op in ("APPEND", "APPENDS"):
                items = [stack.pop()] if op == "APPEND" else pop_mark()
                if not isinstance(stack[-1], list):
                    refuse("a malformed pickle")
                stack[-1].extend(items)
            elif op == "EMPTY_DICT":
                stack.append({})
            elif op in ("SETITEM", "SETITEMS"):
                items = stack[-2:] if op == "SETITEM" else pop_mark()
                if op == "SETITEM":
                    del stack[-2:]
                if not isinstance(stack[-1], dict) or len(items) % 2:
                    refuse("a malformed pickle")
                for key, value in zip(items[::2], items[1::2]):
                    if not isinstance(key, (str, int, float, bool, type(None))):
                        refuse("a dict key that is not a plain value")
                    stack[-1][key] = value
            elif op in ("BINPUT", "LONG_BINPUT"):
                memo[arg] = stack[-1]
            elif op == "MEMOIZE":
                memo[len(memo)] = stack[-1]
            elif op in ("BINGET", "LONG_BINGET"):
                stack.append(memo[arg])
            elif op == "GLOBAL":
                module, _, qualname = arg.partition(" ")
                stack.append(_Global(module, qualname))
            elif op == "STACK_GLOBAL":
                qualname, module = stack.pop(), stack.pop()
                if not (isinstance(module, str) and isinstance(qualname, str)):
                    refuse("a malformed pickle")
                stack.append(_Global(module, qualname))
            elif op == "BINPERSID":
                stack.append(_storage(stack.pop(), records, storages, refuse))
            elif op == "REDUCE":
                args, fn = stack.pop(), stack.pop()
                stack.append(_call(fn, args, refuse))
            else:
                refuse(f"pickle opcode {op}")
        refuse("a pickle without an end")
    except TapmlError:
        raise
    except Exception as e:  # noqa: BLE001 - whatever a malformed pickle trips over is bad input
        raise TapmlError(f"{where} is not a valid torch.save pickle ({type(e).__name__}); {RESAVE}") from None


def _storage(pid, records: dict[str, bytes], storages: dict, refuse) -> _Storage:
    import torch
    if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage" and isinstance(pid[1], _Global)
            and isinstance(pid[2], str) and isinstance(pid[3], str) and type(pid[4]) is int and pid[4] >= 0):
        refuse("a persistent reference that is not a tensor storage")
    _, cls, key, _location, numel = pid
    dtype_name = _STORAGE_TYPES.get(cls.qualname) if cls.module == "torch" else None
    if dtype_name is None:
        refuse(f"a storage of type {cls.module}.{cls.qualname}"[:120])
    if key in storages:
        return storages[key]
    dtype = getattr(torch, dtype_name)
    raw = records.get(f"data/{key}")
    if raw is None or len(raw) != numel * dtype.itemsize:
        refuse(f"a tensor storage {key[:40]!r} whose data is missing or of the wrong size")
    # Loaded on the CPU whatever device it was saved from: the reference moves inputs itself.
    tensor = torch.frombuffer(bytearray(raw), dtype=dtype) if numel else torch.empty(0, dtype=dtype)
    storages[key] = _Storage(tensor)
    return storages[key]


def _call(fn, args, refuse):
    import torch
    if not isinstance(fn, _Global) or not isinstance(args, tuple):
        refuse("a call of something other than a known name")
    if (fn.module, fn.qualname) == ("collections", "OrderedDict") and args == ():
        return {}
    if (fn.module, fn.qualname) != ("torch._utils", "_rebuild_tensor_v2"):
        refuse(f"a call of {fn.module}.{fn.qualname}"[:160])
    if len(args) not in (6, 7):
        refuse("a tensor with unexpected fields")
    storage, offset, shape, stride, requires_grad, hooks = args[:6]
    if not (isinstance(storage, _Storage) and type(offset) is int and offset >= 0 and isinstance(shape, tuple)
            and isinstance(stride, tuple) and len(shape) == len(stride) <= 16
            and all(type(n) is int and n >= 0 for n in shape + stride)
            and isinstance(requires_grad, bool) and _empty(hooks) and (len(args) == 6 or _empty(args[6]))):
        refuse("a tensor with hooks, metadata or a malformed shape")
    numel = storage.tensor.numel()
    if 0 not in shape and offset + 1 + sum((n - 1) * s for n, s in zip(shape, stride)) > numel:
        refuse("a tensor that reaches past its storage")
    return torch.as_strided(storage.tensor, shape, stride, offset if 0 not in shape else 0)


def _register_transformers_outputs() -> None:
    """Programs of transformers models return ModelOutput classes, which transformers registers
    as pytree nodes when its (fixed, installed) module is imported; torch needs them to read the spec."""
    try:
        import transformers.modeling_outputs  # noqa: F401
    except ImportError:
        pass


def _empty(value) -> bool:
    return value is None or (isinstance(value, dict) and not value)


@contextmanager
def _quiet_torch_export_logs():
    """torch.export logs tracebacks as warnings while loading; tapml reports one line instead."""
    loggers = [logging.getLogger(n) for n in ("torch.export", "torch._export")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL + 1)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)
