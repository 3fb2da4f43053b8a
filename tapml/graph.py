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
from dataclasses import dataclass, field
from typing import Any, Iterable

import torch

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
    torch.bool: "bool",
    torch.complex64: "complex64",
}
_DTYPES = {v: k for k, v in _DTYPE_NAMES.items()}


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
        return cls(tuple(int(s) for s in d["shape"]), str(d["dtype"]))


def op_name(target: Any) -> str:
    """Full overload name of an fx target: ``torch.ops.aten.add.Tensor`` -> ``"aten.add.Tensor"``."""
    if isinstance(target, torch._ops.OpOverload):
        ns, name = target.name().split("::")
        return f"{ns}.{name}" if "." in name else f"{ns}.{name}.default"
    return getattr(target, "__name__", str(target))


def resolve_op(name: str) -> torch._ops.OpOverload:
    """``"aten.add.Tensor"`` -> ``torch.ops.aten.add.Tensor``; ValueError when there is no such op."""
    parts = name.split(".")
    if len(parts) != 3:
        raise ValueError(f"op name {name!r} is not of the form namespace.op.overload")
    try:
        return getattr(getattr(getattr(torch.ops, parts[0]), parts[1]), parts[2])
    except (AttributeError, RuntimeError):
        raise ValueError(f"no such op {name!r}") from None


# --- argument encoding -------------------------------------------------------------------
# Arguments are JSON values; what JSON cannot say is a one-key dict:
# {"ref": r} a tensor value, {"dtype": "float32"}, {"device": "cpu"}, {"layout": "strided"},
# {"memory_format": "contiguous_format"}, {"float": "inf"|"-inf"|"nan"}.

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
    if isinstance(a, (bool, int, float, str)) or a is None:
        return a
    if isinstance(a, torch.Tensor):
        raise ValueError("tensor constants in arguments must be lifted to graph inputs")
    raise ValueError(f"cannot encode argument of type {type(a).__name__}: {a!r}")


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
        if key == "device":
            return torch.device(v)
        if key == "layout":
            return getattr(torch, v)
        if key == "memory_format":
            return getattr(torch, v)
        if key == "float":
            return float(v)
        if key == "dict":
            return {k: decode_arg(x, value_of) for k, x in v.items()}
        raise ValueError(f"unknown encoded argument {a!r}")
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
    def from_json(cls, d: dict) -> "Node":
        return cls(name=d["name"], op=d["op"], args=list(d["args"]), kwargs=dict(d.get("kwargs", {})),
                   outputs=[TensorMeta.from_json(m) for m in d["outputs"]], multi=bool(d.get("multi")),
                   module=d.get("module", ""), module_type=d.get("module_type", ""), case=d.get("case"))


@dataclass
class Graph:
    """A core-ATen graph: named tensor inputs, nodes in topological order, output refs."""

    inputs: list[tuple[str, TensorMeta]]
    nodes: list[Node]
    outputs: list[str]
    meta: dict[str, TensorMeta] = field(default_factory=dict, repr=False)

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
        return {"inputs": [{"name": r, **m.to_json()} for r, m in self.inputs],
                "nodes": [n.to_json() for n in self.nodes], "outputs": list(self.outputs)}

    @classmethod
    def from_json(cls, d: dict) -> "Graph":
        return cls(inputs=[(i["name"], TensorMeta.from_json(i)) for i in d["inputs"]],
                   nodes=[Node.from_json(n) for n in d["nodes"]], outputs=list(d["outputs"]))


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


def graph_from_fx(fx_graph: torch.fx.Graph) -> Graph:
    """Convert an exported (core ATen) fx graph. ``getitem`` nodes fold into ``name#i`` refs;
    nodes that return no tensor (assertions) are dropped."""
    refs: dict[torch.fx.Node, str] = {}
    inputs, nodes, outputs = [], [], []

    def ref_of(n: torch.fx.Node) -> str:
        if n not in refs:
            raise ValueError(f"node {n.name} is used but returns no tensor")
        return refs[n]

    for n in fx_graph.nodes:
        if n.op == "placeholder":
            refs[n] = n.name
            inputs.append((n.name, TensorMeta.of(n.meta["val"])))
        elif n.op == "call_function" and n.target is operator.getitem:
            refs[n] = f"{refs[n.args[0]]}#{n.args[1]}"
        elif n.op == "call_function":
            metas = _tensor_metas(n.meta.get("val"))
            if metas is None:
                if n.users:
                    raise ValueError(f"node {n.name} ({op_name(n.target)}) returns a non-tensor value")
                continue
            outs, multi = metas
            refs[n] = n.name
            module, module_type = module_of(n)
            nodes.append(Node(name=n.name, op=op_name(n.target), args=encode_arg(list(n.args), ref_of),
                              kwargs={k: encode_arg(v, ref_of) for k, v in n.kwargs.items()},
                              outputs=outs, multi=multi, module=module, module_type=module_type))
        elif n.op == "output":
            outputs = [ref_of(x) for x in torch.utils._pytree.tree_leaves(n.args[0])
                       if isinstance(x, torch.fx.Node)]
        else:
            raise ValueError(f"unexpected fx node {n.op} {n.name}")
    return Graph(inputs=inputs, nodes=nodes, outputs=outputs)


def run_node(node: Node, value_of) -> list[torch.Tensor]:
    """Run one node eagerly with torch; returns its output tensors in ``output_refs`` order."""
    fn = resolve_op(node.op)
    out = fn(*decode_arg(node.args, value_of), **{k: decode_arg(v, value_of) for k, v in node.kwargs.items()})
    return list(out) if node.multi else [out]


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
