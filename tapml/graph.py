"""The graph IR every stage shares: plain, JSON-serializable core-ATen graphs.

A :class:`Graph` is a list of :class:`Node` in topological order. Tensor values are named by
*refs*: ``"add"`` for a node's only output, ``"native_layer_norm#1"`` for element 1 of a node
that returns several tensors, or a graph input's name. A carved case is a one-node graph; a
migration region is the subgraph of a set of nodes; the whole model is the graph of its
exported program. Platforms compile graphs, so this module must stay free of torch.fx at
import time and of anything that is not plain data.
"""

from __future__ import annotations

import math
import operator
import re
from dataclasses import dataclass, field
from typing import Annotated, Any, Iterable

import torch
from pydantic import AfterValidator, Field

from tapml.ops import check_op, resolve_op  # noqa: F401 - the vocabulary; importers use tapml.graph.resolve_op
from tapml.schema import Bool, Count, Schema, Str, validate

_DTYPE_NAMES = {
    torch.float32: "float32",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.float64: "float64",
    torch.int64: "int64",
    torch.int32: "int32",
    torch.int16: "int16",
    torch.int8: "int8",
    torch.uint8: "uint8",
    torch.uint64: "uint64",
    torch.bool: "bool",
    torch.complex64: "complex64",
    torch.complex32: "complex32",
}
_DTYPES = {v: k for k, v in _DTYPE_NAMES.items()}
_LAYOUTS = {"strided": torch.strided, "sparse_coo": torch.sparse_coo, "sparse_csr": torch.sparse_csr,
            "sparse_csc": torch.sparse_csc, "sparse_bsr": torch.sparse_bsr, "sparse_bsc": torch.sparse_bsc}
_MEMORY_FORMATS = {"contiguous_format": torch.contiguous_format, "channels_last": torch.channels_last,
                   "channels_last_3d": torch.channels_last_3d, "preserve_format": torch.preserve_format}
_DEVICE = re.compile(r"(cpu|cuda|meta)(:[0-9]{1,3})?")
_DTYPE_TEXT = re.compile(r"[a-z][a-z0-9_]{0,31}")

#: Bounds on what graphs read from files may hold (a store, a program sent to a server).
MAX_ARG_DEPTH = 64
MAX_RANK = 64
MAX_DIM = 1 << 48
MAX_INT = 1 << 64
MAX_TEXT = 4096


class TensorMetaJSON(Schema):
    """A tensor's shape (at most :data:`MAX_RANK` sizes, each below :data:`MAX_DIM`) and dtype
    name, as files and requests hold it."""

    shape: Annotated[tuple[Annotated[Count, Field(lt=MAX_DIM)], ...], Field(max_length=MAX_RANK)]
    dtype: Annotated[Str, Field(pattern=f"^{_DTYPE_TEXT.pattern}$")]


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"``."""
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        return str(dtype).removeprefix("torch.")


def torch_dtype(name: str) -> torch.dtype:
    """``"float32"`` -> ``torch.float32``; raises ValueError for an unknown name."""
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; known: {', '.join(sorted(_DTYPES))}") from None


@dataclass(frozen=True)
class TensorMeta:
    """Shape and dtype of a tensor value."""

    shape: tuple[int, ...]
    dtype: str

    @classmethod
    def of(cls, t: torch.Tensor) -> "TensorMeta":
        return cls(tuple(int(s) for s in t.shape), dtype_name(t.dtype))

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * torch_dtype(self.dtype).itemsize

    def to_json(self) -> dict:
        return {"shape": list(self.shape), "dtype": self.dtype}

    @classmethod
    def from_json(cls, d: dict) -> "TensorMeta":
        """``{"shape": [2, 3], "dtype": "float32"}`` -> TensorMeta; a ValueError naming the field
        (:class:`tapml.schema.SchemaError`) unless it is :class:`TensorMetaJSON`."""
        m = validate(TensorMetaJSON, d)
        return cls(m.shape, m.dtype)


def check_call(op: str, args: list, kwargs: dict, where: str) -> None:
    """What a schema cannot say about a call read from a file (a node's, a carved case's): its op
    is in the vocabulary of :mod:`tapml.ops` and its arguments follow :func:`check_arg`'s grammar;
    ValueError/TypeError starting with ``where`` otherwise."""
    try:
        check_op(op)
    except ValueError as e:
        raise ValueError(f"{where}: field 'op': {e}") from None
    check_arg(args, f"{where}: field 'args'")
    for k, v in kwargs.items():
        check_arg(v, f"{where}: field 'kwargs'[{k[:40]!r}]")


def _short(value: Any, limit: int = 60) -> str:
    """``repr`` of a value read from a file, cut to ``limit`` characters (it may be huge or deep)."""
    try:
        text = repr(value)
    except RecursionError:
        text = f"<deeply nested {type(value).__name__}>"
    return text if len(text) <= limit else text[:limit] + "..."


def op_name(target: Any) -> str:
    """Full overload name of an fx target: ``torch.ops.aten.add.Tensor`` -> ``"aten.add.Tensor"``."""
    if isinstance(target, torch._ops.OpOverload):
        ns, name = target.name().split("::")
        return f"{ns}.{name}" if "." in name else f"{ns}.{name}.default"
    return getattr(target, "__name__", str(target))


# --- argument encoding -------------------------------------------------------------------
# Arguments are JSON values; what JSON cannot say is a one-key dict:
# {"ref": r} a tensor value, {"dtype": "float32"}, {"device": "cpu"}, {"layout": "strided"},
# {"memory_format": "contiguous_format"}, {"float": "inf"|"-inf"|"nan"}, {"complex": [re, im]} (each
# part a float or one of those strings).

def encode_arg(a: Any, ref_of) -> Any:
    """Encode an fx argument; ``ref_of(fx_node)`` names tensor values."""
    if isinstance(a, torch.fx.Node):
        return {"ref": ref_of(a)}
    if isinstance(a, (list, tuple)):
        return [encode_arg(x, ref_of) for x in a]
    if isinstance(a, dict):
        return {"dict": {str(k): encode_arg(v, ref_of) for k, v in a.items()}}
    if isinstance(a, torch.dtype):
        return {"dtype": dtype_name(a)}
    if isinstance(a, torch.device):
        return {"device": str(a)}
    if isinstance(a, torch.layout):
        return {"layout": str(a).removeprefix("torch.")}
    if isinstance(a, torch.memory_format):
        return {"memory_format": str(a).removeprefix("torch.")}
    if isinstance(a, float) and not math.isfinite(a):
        return {"float": str(a)}
    if isinstance(a, complex):
        return {"complex": [x if math.isfinite(x) else str(x) for x in (a.real, a.imag)]}
    if isinstance(a, (bool, int, float, str)) or a is None:
        return a
    if isinstance(a, torch.Tensor):
        raise ValueError("tensor constants in arguments must be lifted to graph inputs")
    raise ValueError(f"cannot encode argument of type {type(a).__name__}: {a!r}")


def check_arg(a: Any, where: str = "args", depth: int = 0) -> None:
    """Check that ``a`` is an encoded argument (the grammar :func:`encode_arg` writes), nested at
    most :data:`MAX_ARG_DEPTH` deep, with ints of at most 64 bits, finite floats and short
    strings; ValueError naming ``where`` (``args[1][0]``) otherwise. Graphs read from files
    are checked with it before anything walks or runs them."""
    if depth > MAX_ARG_DEPTH:
        raise ValueError(f"{where[:90]}...: arguments are nested deeper than {MAX_ARG_DEPTH} levels")
    if a is None or isinstance(a, bool):
        return
    if isinstance(a, int):
        if not -MAX_INT < a < MAX_INT:
            raise ValueError(f"{where}: integer {_short(a)} is beyond 64 bits")
        return
    if isinstance(a, float):
        if not math.isfinite(a):
            raise ValueError(f"{where}: a float must be finite (write {{\"float\": \"inf\"}} for infinity)")
        return
    if isinstance(a, str):
        if len(a) > MAX_TEXT:
            raise ValueError(f"{where}: a string argument is longer than {MAX_TEXT} characters")
        return
    if isinstance(a, list):
        for i, x in enumerate(a):
            check_arg(x, f"{where}[{i}]", depth + 1)
        return
    if not isinstance(a, dict) or len(a) != 1:
        raise ValueError(f"{where}: {_short(a)} is not an encoded argument")
    (key, v), = a.items()
    if key == "complex":
        if not (isinstance(v, list) and len(v) == 2 and all(
                isinstance(x, float) and math.isfinite(x) or x in ("inf", "-inf", "nan") for x in v)):
            raise ValueError(f"{where}: {_short(a)} is not an encoded complex number (two floats)")
        return
    if key == "dict" and isinstance(v, dict):
        for k, x in v.items():
            if not isinstance(k, str) or len(k) > MAX_TEXT:
                raise ValueError(f"{where}: dict keys must be short strings")
            check_arg(x, f"{where}[{k[:40]!r}]", depth + 1)
        return
    valid = {"ref": lambda: 0 < len(v) <= MAX_TEXT, "dtype": lambda: v in _DTYPES,
             "layout": lambda: v in _LAYOUTS, "memory_format": lambda: v in _MEMORY_FORMATS,
             "float": lambda: v in ("inf", "-inf", "nan"), "device": lambda: _DEVICE.fullmatch(v) is not None}
    if key not in valid or not isinstance(v, str) or not valid[key]():
        raise ValueError(f"{where}: {_short(a)} is not an encoded argument")


def decode_arg(a: Any, value_of) -> Any:
    """Inverse of :func:`encode_arg`; ``value_of(ref)`` supplies tensor values."""
    if isinstance(a, list):
        return [decode_arg(x, value_of) for x in a]
    if isinstance(a, dict):
        (key, v), = a.items()
        if key == "ref":
            return value_of(v)
        if key == "dtype":
            return torch_dtype(v)
        if key == "device" and isinstance(v, str) and _DEVICE.fullmatch(v):
            return torch.device(v)
        if key == "layout" and isinstance(v, str) and v in _LAYOUTS:
            return _LAYOUTS[v]
        if key == "memory_format" and isinstance(v, str) and v in _MEMORY_FORMATS:
            return _MEMORY_FORMATS[v]
        if key == "float" and isinstance(v, str) and v in ("inf", "-inf", "nan"):
            return float(v)
        if key == "complex" and isinstance(v, list) and len(v) == 2:
            return complex(float(v[0]), float(v[1]))
        if key == "dict":
            return {k: decode_arg(x, value_of) for k, x in v.items()}
        raise ValueError(f"unknown encoded argument {_short(a)}")
    return a


def arg_refs(a: Any) -> list[str]:
    """All tensor refs inside an encoded argument, in order."""
    if isinstance(a, list):
        return [r for x in a for r in arg_refs(x)]
    if isinstance(a, dict):
        if "ref" in a:
            return [a["ref"]]
        if "dict" in a:
            return [r for x in a["dict"].values() for r in arg_refs(x)]
    return []


def map_refs(a: Any, fn) -> Any:
    """A copy of an encoded argument with every ref ``r`` replaced by ``fn(r)``."""
    if isinstance(a, list):
        return [map_refs(x, fn) for x in a]
    if isinstance(a, dict):
        if "ref" in a:
            return {"ref": fn(a["ref"])}
        if "dict" in a:
            return {"dict": {k: map_refs(v, fn) for k, v in a["dict"].items()}}
    return a


@dataclass
class Node:
    """One op call. ``outputs`` has one meta per tensor the op returns; ``multi`` says the op
    returns a tuple/list, so its values are named ``name#i``."""

    name: str
    op: str
    args: list
    kwargs: dict
    outputs: list[TensorMeta]
    multi: bool = False
    module: str = ""
    module_type: str = ""
    case: str | None = None

    @property
    def output_refs(self) -> list[str]:
        """Refs of the node's output values: ``[name]``, or ``name#i`` for each of a multi-output op."""
        return [f"{self.name}#{i}" for i in range(len(self.outputs))] if self.multi else [self.name]

    @property
    def input_refs(self) -> list[str]:
        """Refs of the tensor values the node reads, in argument order."""
        return arg_refs(self.args) + arg_refs(list(self.kwargs.values()))

    def to_json(self) -> dict:
        d = {"name": self.name, "op": self.op, "args": self.args, "kwargs": self.kwargs,
             "outputs": [m.to_json() for m in self.outputs], "multi": self.multi,
             "module": self.module, "module_type": self.module_type}
        if self.case is not None:
            d["case"] = self.case
        return d

    @classmethod
    def from_json(cls, d: Any, root: str = "") -> "Node":
        """A node read from a file: its fields as :class:`NodeJSON` declares them, then what the
        schema cannot say (:meth:`from_schema`); ValueError naming the field (under ``root``)
        otherwise."""
        return cls.from_schema(validate(NodeJSON, d, root), root)

    @classmethod
    def from_schema(cls, m: "NodeJSON", where: str = "") -> "Node":
        """The node of a validated :class:`NodeJSON`, after the checks its schema cannot say: the
        op against the vocabulary of :mod:`tapml.ops`, the argument grammar (:func:`check_arg`),
        one output unless ``multi``. ``where`` (``nodes[3]``) starts the messages."""
        where = f"{where} ({m.name[:60]!r})" if where else f"node {m.name[:60]!r}"
        check_call(m.op, m.args, m.kwargs, where)
        if len(m.outputs) > 1 and not m.multi:
            raise ValueError(f"{where}: field 'outputs' must hold one tensor, or several with 'multi'")
        return cls(name=m.name, op=m.op, args=m.args, kwargs=m.kwargs,
                   outputs=[TensorMeta(o.shape, o.dtype) for o in m.outputs], multi=m.multi,
                   module=m.module, module_type=m.module_type, case=m.case)


def _node_name(name: str) -> str:
    if "#" in name:
        raise ValueError("a node name has no '#' (name#i names output i of a node)")
    return name


#: Text a graph names things with (a node, a graph input, a keyword argument).
Name = Annotated[Str, Field(min_length=1, max_length=MAX_TEXT)]
ShortText = Annotated[Str, Field(max_length=MAX_TEXT)]


class NodeJSON(Schema):
    """A node as files and requests hold it (:meth:`Node.to_json`).

    Three things stay checked by hand (:meth:`Node.from_schema`, :meth:`Graph.from_schema`), not
    declared: the arguments are a recursive grammar (refs, dtypes, nested lists, ``{"dict": ...}``)
    bounded at :data:`MAX_ARG_DEPTH` levels, which :func:`check_arg` walks without recursing
    through pydantic; the op names a closed vocabulary that :mod:`tapml.ops` builds from torch at
    first use (:func:`check_op`, the one place it lives); and a ref is only valid against the rest
    of the graph (an input or an earlier node's output), which no field's type can say."""

    name: Annotated[Name, AfterValidator(_node_name)]
    op: Str
    args: list[Any]
    kwargs: dict[ShortText, Any] = {}
    outputs: Annotated[tuple[TensorMetaJSON, ...], Field(min_length=1)]
    multi: Bool = False
    module: Str = ""
    module_type: Str = ""
    case: Str | None = None


class GraphInputJSON(TensorMetaJSON):
    """A graph input: its name with its shape and dtype."""

    name: Name


class GraphJSON(Schema):
    """A graph as files and requests hold it (:meth:`Graph.to_json`); every ref it holds is
    checked against the graph by :meth:`Graph.from_schema`."""

    inputs: tuple[GraphInputJSON, ...]
    nodes: tuple[NodeJSON, ...]
    outputs: tuple[Str, ...]
    state: dict[Str, Str] = {}


@dataclass
class Graph:
    """A core-ATen graph: named tensor inputs, nodes in topological order, output refs.

    ``state`` maps an input that holds state across calls (a key/value cache buffer the
    program mutates) to the output ref whose value that input takes after a call; see
    :func:`step`. Empty for a graph without state."""

    inputs: list[tuple[str, TensorMeta]]
    nodes: list[Node]
    outputs: list[str]
    meta: dict[str, TensorMeta] = field(default_factory=dict, repr=False)
    state: dict[str, str] = field(default_factory=dict)

    def __post_init__(self):
        if not self.meta:
            self.meta = dict(self.inputs)
            for n in self.nodes:
                self.meta.update(zip(n.output_refs, n.outputs))

    def node(self, name: str) -> Node:
        """The node named ``name``; KeyError when there is none."""
        for n in self.nodes:
            if n.name == name:
                return n
        raise KeyError(name)

    def producer(self) -> dict[str, Node]:
        """ref -> node that produces it."""
        return {r: n for n in self.nodes for r in n.output_refs}

    def subgraph(self, names: Iterable[str], keep_outputs: Iterable[str] = ()) -> "Graph":
        """The graph of a subset of nodes: inputs are the refs it reads from outside, outputs
        the refs of its nodes that are read outside it (or are graph outputs, or in keep_outputs)."""
        chosen = set(names)
        nodes = [n for n in self.nodes if n.name in chosen]
        if len(nodes) != len(chosen):
            missing = chosen - {n.name for n in nodes}
            raise KeyError(f"no such nodes: {sorted(missing)}")
        produced = {r for n in nodes for r in n.output_refs}
        inputs, seen = [], set()
        for n in nodes:
            for r in n.input_refs:
                if r not in produced and r not in seen:
                    seen.add(r)
                    inputs.append((r, self.meta[r]))
        used_outside = set(self.outputs) | set(keep_outputs)
        for n in self.nodes:
            if n.name not in chosen:
                used_outside.update(n.input_refs)
        outputs = [r for n in nodes for r in n.output_refs if r in used_outside]
        return Graph(inputs=inputs, nodes=nodes, outputs=outputs)

    def to_json(self) -> dict:
        d = {"inputs": [{"name": r, **m.to_json()} for r, m in self.inputs],
             "nodes": [n.to_json() for n in self.nodes], "outputs": list(self.outputs)}
        if self.state:
            d["state"] = dict(self.state)
        return d

    @classmethod
    def from_json(cls, d: Any, root: str = "") -> "Graph":
        """A graph read from a file: its fields as :class:`GraphJSON` declares them, then every
        ref checked (:meth:`from_schema`); ValueError naming the field (under ``root``) otherwise."""
        return cls.from_schema(validate(GraphJSON, d, root), root)

    @classmethod
    def from_schema(cls, g: "GraphJSON", root: str = "", fields: tuple[str, str, str] = ("inputs", "nodes", "outputs")
                    ) -> "Graph":
        """The graph of a validated :class:`GraphJSON` (or of its three parts under other
        ``fields`` names, as a store's manifest holds them), after the checks its schema cannot
        say: each node's (:meth:`Node.from_schema`), and every ref a node reads or the graph
        outputs names a graph input or an earlier node's output; ValueError naming the field."""
        at = [f"{root}.{f}" if root else f for f in fields]
        raw_inputs, raw_nodes, outputs = (getattr(g, f) for f in fields)
        inputs = [(i.name, TensorMeta(i.shape, i.dtype)) for i in raw_inputs]
        known = {name for name, _ in inputs}
        if len(known) != len(inputs):
            raise ValueError(f"{at[0]}: two graph inputs have the same name")
        names, nodes = set(known), []
        for i, raw in enumerate(raw_nodes):
            node = Node.from_schema(raw, f"{at[1]}[{i}]")
            for ref in node.input_refs:
                if ref not in known:
                    raise ValueError(f"{at[1]}[{i}] ({node.name[:60]!r}) reads {_short(ref)}, which is no graph input "
                                     "or output of an earlier node")
            if node.name in names or any(r in known for r in node.output_refs):
                raise ValueError(f"{at[1]}[{i}]: the name {node.name[:60]!r} is used twice")
            known.update(node.output_refs)
            names.add(node.name)
            nodes.append(node)
        for ref in outputs:
            if ref not in known:
                raise ValueError(f"{at[2]}: {_short(ref)} is no graph input or node output")
        graph = cls(inputs=inputs, nodes=nodes, outputs=list(outputs))
        graph.state = check_state(getattr(g, "state", {}), graph, f"{root}.state" if root else "state")
        return graph


def check_state(state: dict[str, str], graph: Graph, where: str = "state") -> dict[str, str]:
    """Check a ``state`` for ``graph`` (read from a file, its types as a schema declares them):
    each key a graph input, each value a distinct graph output of the same shape and dtype as
    its input. Returns it as a dict; ValueError naming the entry (under ``where``) otherwise."""
    inputs = dict(graph.inputs)
    taken = set()
    for name, ref in state.items():
        if name not in inputs:
            raise ValueError(f"{where}: {_short(name)} is no graph input")
        if ref not in graph.outputs or ref in taken:
            raise ValueError(f"{where}[{name[:60]!r}]: {_short(ref)} is no graph output (or is taken by another input)")
        if graph.meta[ref] != inputs[name]:
            raise ValueError(f"{where}[{name[:60]!r}]: output {ref[:60]!r} is {graph.meta[ref]}, the input is "
                             f"{inputs[name]}; a state must keep its shape and dtype")
        taken.add(ref)
    return dict(state)


def _tensor_metas(val: Any) -> tuple[list[TensorMeta], bool] | None:
    if isinstance(val, torch.Tensor):
        return [TensorMeta.of(val)], False
    if isinstance(val, (list, tuple)) and val and all(isinstance(v, torch.Tensor) for v in val):
        return [TensorMeta.of(v) for v in val], True
    return None


def module_of(fx_node: torch.fx.Node) -> tuple[str, str]:
    """(module path, module type) of the innermost module an fx node was traced in."""
    stack = fx_node.meta.get("nn_module_stack") or {}
    if not stack:
        return "", ""
    path, mtype = list(stack.values())[-1]
    if not isinstance(mtype, str):
        mtype = f"{mtype.__module__}.{mtype.__qualname__}"
    return str(path), mtype


_SYMBOLIC = (torch.SymInt, torch.SymFloat, torch.SymBool)
_CONSTANT_TYPES = (bool, int, float, str, type(None))


def _is_data_dependent(val: Any) -> bool:
    """True for an fx value torch.export could not make concrete: a symbolic scalar (``x.item()``,
    ``sym_size`` of a data-dependent size) or a tensor with a symbolic size (``nonzero``, ``x[mask]``)."""
    if isinstance(val, _SYMBOLIC):
        return True
    if isinstance(val, torch.Tensor):
        return not all(type(s) is int for s in val.shape)
    if isinstance(val, (list, tuple)):
        return any(_is_data_dependent(v) for v in val)
    return False


def needs_real_values(fx_graph: torch.fx.Graph) -> bool:
    """True when :func:`graph_from_fx` needs ``real_values`` for ``fx_graph``: some node's shape or
    scalar value depends on the data (``nonzero``, ``masked_select``, ``x[mask]``, ``x.item()``)."""
    return any(_is_data_dependent(n.meta.get("val")) for n in fx_graph.nodes)


def _is_with_effects(n: torch.fx.Node) -> bool:
    return n.op == "call_function" and getattr(n.target, "__name__", "") == "with_effects"


def _is_token_placeholder(n: torch.fx.Node) -> bool:
    """An effect token: a placeholder read only as the token (first argument) of ``with_effects``."""
    return n.op == "placeholder" and bool(n.users) and all(
        _is_with_effects(u) and u.args and u.args[0] is n and n not in u.args[1:] for u in n.users)


def graph_from_fx(fx_graph: torch.fx.Graph, signature=None, real_values: dict[str, Any] | None = None) -> Graph:
    """Convert an exported (core ATen) fx graph. ``getitem`` nodes fold into ``name#i`` refs;
    nodes that return no tensor (assertions) are dropped; ValueError naming the node for what
    cannot be represented (an op outside the vocabulary of :mod:`tapml.ops`, a call with
    side effects whose result is used). With the ExportedProgram's ``graph_signature``, the
    buffers the program mutates become the graph's ``state`` (buffer input -> output ref).

    Non-tensor values become constants of the graph: a non-tensor input (``return_dict=False``,
    an int) takes its example value, a scalar node (``x.item()``, the size of ``x[mask]``) takes
    its value in ``real_values`` and its consumers take that value as a constant argument.
    ``real_values`` (fx node name -> the node's value in a reference run, tensors as
    :class:`TensorMeta`; see :func:`needs_real_values`) also gives the real shapes where export
    has only symbols (``nonzero``, ``masked_select``): the graph is then specialized to that run.
    Effect tokens (``with_effects``) are dropped with the side-effect-only calls they order.
    """
    refs: dict[torch.fx.Node, str] = {}
    constants: dict[torch.fx.Node, Any] = {}
    tokens: set[torch.fx.Node] = set()
    kept: dict[torch.fx.Node, list[int]] = {}  # a masked op's results that are not None
    inputs, nodes, outputs = [], [], []

    def ref_of(n: torch.fx.Node) -> str:
        if n not in refs:
            raise ValueError(f"node {n.name} is used but returns no tensor")
        return refs[n]

    def folded(a: Any) -> Any:
        return torch.fx.node.map_arg(a, lambda x: constants[x] if x in constants else x)

    def real(n: torch.fx.Node) -> Any:
        if real_values is None or n.name not in real_values:
            raise ValueError(f"node {n.name} ({op_name(n.target)}) has a data-dependent shape or value "
                             f"({_short(n.meta.get('val'))}); it needs the values of a reference run")
        return real_values[n.name]

    for n in fx_graph.nodes:
        val = n.meta.get("val")
        if n.op == "placeholder":
            if _is_token_placeholder(n):
                tokens.add(n)
            elif isinstance(val, torch.Tensor):
                refs[n] = n.name
                inputs.append((n.name, real(n) if _is_data_dependent(val) else TensorMeta.of(val)))
                _check_carvable(n, [inputs[-1][1]], val)
            elif isinstance(val, _CONSTANT_TYPES):
                constants[n] = val
            else:
                raise ValueError(f"input {n.name} is a {type(val).__name__} ({_short(val)}); model inputs must be "
                                 "tensors or bool, int, float, str or None constants")
        elif n.op == "call_function" and n.target is operator.getitem:
            source = n.args[0]
            if source in tokens or (_is_with_effects(source) and n.args[1] == 0):
                tokens.add(n)
            elif source in constants:
                constants[n] = constants[source][n.args[1]]
            elif _is_with_effects(source):
                raise ValueError(f"node {source.name} calls {op_name(source.args[1])} with side effects "
                                 "(with_effects) and its result is used; tapml carves only functional ops")
            else:
                index = n.args[1] if source not in kept else kept[source].index(n.args[1])
                refs[n] = f"{ref_of(source)}#{index}"
        elif n.op == "call_function" and _is_with_effects(n):
            continue  # its token and results are handled where getitem reads them
        elif n.op == "call_function":
            if _is_data_dependent(val):
                val = real(n)
            if isinstance(val, TensorMeta):
                metas = [val], False
            elif isinstance(val, list) and val and all(isinstance(v, TensorMeta) for v in val):
                metas = list(val), True
            else:
                metas = _tensor_metas(val)
            if metas is None and _masked_results(n, val):
                metas = [TensorMeta.of(v) for v in val if v is not None], True
            if metas is None:
                if isinstance(val, _CONSTANT_TYPES) and val is not None:
                    constants[n] = val  # a scalar (x.item(), a size): its consumers take the reference's value
                elif n.users:
                    raise ValueError(f"node {n.name} ({op_name(n.target)}) returns a non-tensor value "
                                     f"({type(val).__name__}) that tapml cannot represent")
                continue
            outs, multi = metas
            _check_carvable(n, outs, val)
            if multi and _masked_results(n, val):
                kept[n] = [i for i, v in enumerate(val) if v is not None]
            refs[n] = n.name
            module, module_type = module_of(n)
            try:
                check_op(op_name(n.target))
                call_args, call_kwargs = list(folded(n.args)), folded(dict(n.kwargs))
                if n in kept:
                    _set_output_mask(n.target, call_args, call_kwargs, [v is not None for v in val])
                args = encode_arg(call_args, ref_of)
                kwargs = {k: encode_arg(v, ref_of) for k, v in call_kwargs.items()}
            except ValueError as e:
                raise ValueError(f"node {n.name}: {e}") from None
            nodes.append(Node(name=n.name, op=op_name(n.target), args=args, kwargs=kwargs,
                              outputs=outs, multi=multi, module=module, module_type=module_type))
        elif n.op == "output":
            outputs = [ref_of(x) for x in torch.utils._pytree.tree_leaves(n.args[0])
                       if isinstance(x, torch.fx.Node) and x not in tokens and x not in constants]
        else:
            raise ValueError(f"unexpected fx node {n.op} {n.name}")
    graph = Graph(inputs=inputs, nodes=nodes, outputs=outputs)
    if signature is not None:
        graph.state = _state_from_signature(signature, {n.name: r for n, r in refs.items()})
        check_state(graph.state, graph)
    return graph


def _state_from_signature(signature, ref_of_name: dict[str, str]) -> dict[str, str]:
    """Buffer input -> output ref, for every buffer an ExportGraphSignature says is mutated."""
    from torch.export.graph_signature import InputKind, OutputKind
    buffer_input = {s.target: s.arg.name for s in signature.input_specs if s.kind == InputKind.BUFFER}
    state = {}
    for spec in signature.output_specs:
        if spec.kind == OutputKind.USER_INPUT_MUTATION:
            raise ValueError(f"the program mutates its input {spec.target!r}; only buffers may hold state")
        if spec.kind == OutputKind.BUFFER_MUTATION:
            if spec.target not in buffer_input or spec.arg.name not in ref_of_name:
                raise ValueError(f"mutated buffer {spec.target!r} is no graph input or its value no graph output")
            state[buffer_input[spec.target]] = ref_of_name[spec.arg.name]
    return state


#: The dtypes a carve can hold (a store's tensors; the WGSL platforms refuse float64 and complex64).
CARVABLE_DTYPES = frozenset({"float64", "float32", "float16", "bfloat16", "complex64", "complex32", "int64", "int32",
                             "int16", "int8", "uint8", "uint64", "bool"})


def _check_carvable(n: torch.fx.Node, metas: list[TensorMeta], val: Any) -> None:
    """ValueError naming the node for a tensor no store can hold: a dtype outside
    :data:`CARVABLE_DTYPES` (complex128, uint16 and uint32, float8) or a sparse layout."""
    what = f"input {n.name}" if n.op == "placeholder" else f"node {n.name} ({op_name(n.target)})"
    for m in metas:
        if m.dtype not in CARVABLE_DTYPES:
            raise ValueError(f"{what} makes a {m.dtype} tensor, which tapml cannot carve (it holds "
                             f"{', '.join(sorted(CARVABLE_DTYPES))})")
    values = val if isinstance(val, (list, tuple)) else [val]
    if any(isinstance(v, torch.Tensor) and v.layout != torch.strided for v in values):
        raise ValueError(f"{what} makes a sparse tensor, which tapml cannot carve (dense tensors only)")


def _output_mask_index(op) -> int | None:
    """Where an op (a backward op: convolution, layer/group/batch norm) takes its ``output_mask``."""
    names = [a.name for a in op._schema.arguments]
    return names.index("output_mask") if "output_mask" in names else None


def _masked_results(n: torch.fx.Node, val: Any) -> bool:
    """Whether ``val`` is the results of an op with an ``output_mask``, some of them None (the
    gradients it was not asked for)."""
    return (isinstance(val, (list, tuple)) and any(v is None for v in val)
            and all(v is None or isinstance(v, torch.Tensor) for v in val)
            and isinstance(n.target, torch._ops.OpOverload) and _output_mask_index(n.target) is not None)


def _set_output_mask(op, args: list, kwargs: dict, mask: list[bool]) -> None:
    """Make the call's ``output_mask`` the results the graph lists: torch's meta kernels and its
    CPU kernels disagree on some (CPU convolution_backward adds grad_weight to a wanted grad_bias)."""
    index = _output_mask_index(op)
    if index < len(args):
        args[index] = mask
    else:
        kwargs["output_mask"] = mask


def node_results(node: Node, result: Any) -> list:
    """What a torch call of ``node`` returned, as the node lists it: one result, all of several,
    or, for an op with an ``output_mask`` whose node lists fewer, the ones its mask wants."""
    if not node.multi:
        return [result]
    out = list(result)
    if len(out) != len(node.outputs) and (index := _output_mask_index(resolve_op(node.op))) is not None:
        mask = node.args[index] if index < len(node.args) else node.kwargs.get("output_mask")
        if isinstance(mask, list) and len(mask) == len(out):
            out = [o for o, m in zip(out, mask) if m]
    return out


def run_node(node: Node, value_of) -> list[torch.Tensor]:
    """Run one node eagerly with torch; returns its output tensors in ``output_refs`` order.
    Its data-dependent arguments (indices, offsets, lengths, data-sized outputs) are checked first
    (:func:`tapml.op_bounds.check_call`: :class:`~tapml.op_bounds.OutOfBounds`, a ValueError, instead
    of an out-of-bounds kernel); its output sizes were checked when the graph was read
    (:func:`tapml.meta_sizes.check_graph_sizes`)."""
    from tapml.op_bounds import check_call
    fn = resolve_op(node.op)
    args = decode_arg(node.args, value_of)
    kwargs = {k: decode_arg(v, value_of) for k, v in node.kwargs.items()}
    check_call(node.op, args, kwargs)
    return node_results(node, fn(*args, **kwargs))


def run_graph(graph: Graph, inputs: dict[str, torch.Tensor], run=run_node) -> dict[str, torch.Tensor]:
    """Run a graph eagerly; returns every graph output by ref. ``run(node, value_of)`` can be
    swapped to place nodes elsewhere. Values are freed after their last use."""
    env = dict(inputs)
    last_use = {}
    for i, n in enumerate(graph.nodes):
        for r in n.input_refs:
            last_use[r] = i
    keep = set(graph.outputs)
    for i, n in enumerate(graph.nodes):
        env.update(zip(n.output_refs, run(n, env.__getitem__)))
        for r in n.input_refs:
            if last_use.get(r) == i and r not in keep:
                env.pop(r, None)
    return {r: env[r] for r in graph.outputs}


def step(graph: Graph, inputs: dict[str, torch.Tensor], state_values: dict[str, torch.Tensor],
         run=run_node) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """One call of a graph with state: run it (:func:`run_graph`) on ``inputs`` plus the
    current ``state_values`` (by state input name) and return ``(outputs by ref, new state
    values by state input name)``. Example, a decode loop::

        outputs, cache = step(decode, {**params, "input_ids": ids, "cache_position": pos}, cache)
    """
    missing = sorted(set(graph.state) - set(state_values))
    if missing:
        raise KeyError(f"no value for state input {missing[0]!r}")
    outputs = run_graph(graph, {**inputs, **{k: state_values[k] for k in graph.state}}, run=run)
    return outputs, {name: outputs[ref] for name, ref in graph.state.items()}
