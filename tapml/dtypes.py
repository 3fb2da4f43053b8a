"""Low-precision floats: the dtypes a model may be carved in, their finite ranges, and the two
graph rewrites precision checking needs.

- :func:`as_float32` is the *float32 twin* of a float16/bfloat16 graph: the same nodes with
  every low-precision value, and every ``dtype=`` argument naming the low dtype, in float32.
  Regions, whole models and generations carved in a low dtype are judged against it (what a
  port must preserve is the model's arithmetic, not the CPU's float16 rounding).
- :func:`keep_float32` is *mixed placement by dtype*: named nodes compute in float32 while the
  rest stays in the low dtype, with casts inserted where values cross between the two.

Example::

    twin = as_float32(store.graph, "float16")
    mixed = keep_float32(store.graph, {"pow", "mean", "add", "rsqrt"}, "float16")
"""

from __future__ import annotations

import functools
from typing import Iterable

from tapml.graph import Graph, Node, TensorMeta, map_refs

#: Dtypes ``--dtype`` accepts for a model's floating parameters and inputs.
MODEL_DTYPES = ("float32", "float16", "bfloat16")
#: The low-precision float dtypes (judged fp64-anchored per op and against float32 as a model).
LOW_FLOATS = ("float16", "bfloat16")
#: Largest finite value of each float dtype.
FINITE_MAX = {"float16": 65504.0, "bfloat16": 3.3895313892515355e38, "float32": 3.4028234663852886e38,
              "float64": 1.7976931348623157e308}
#: The op inserted where a value changes dtype.
CAST_OP = "aten._to_copy.default"


def check_model_dtype(dtype: str) -> str:
    """``dtype`` when it is one of :data:`MODEL_DTYPES`; ValueError saying which are otherwise."""
    if dtype not in MODEL_DTYPES:
        raise ValueError(f"--dtype must be one of {', '.join(MODEL_DTYPES)}, not {dtype!r}")
    return dtype


def graph_dtype(graph: Graph) -> str:
    """The low float dtype a graph computes in (``float16``/``bfloat16``), else ``float32``:
    the first low dtype among its inputs and node outputs."""
    for meta in graph.meta.values():
        if meta.dtype in LOW_FLOATS:
            return meta.dtype
    return "float32"


def _retype_arg(a, low: str, to: str):
    if isinstance(a, list):
        return [_retype_arg(x, low, to) for x in a]
    if isinstance(a, dict):
        if a.get("dtype") == low and len(a) == 1:
            return {"dtype": to}
        if "dict" in a:
            return {"dict": {k: _retype_arg(v, low, to) for k, v in a["dict"].items()}}
    return a


def _retype_meta(m: TensorMeta, low: str, to: str) -> TensorMeta:
    return TensorMeta(m.shape, to) if m.dtype == low else m


def _retype_node(n: Node, low: str, to: str, name: str | None = None) -> Node:
    return Node(name=name or n.name, op=n.op, args=_retype_arg(n.args, low, to),
                kwargs={k: _retype_arg(v, low, to) for k, v in n.kwargs.items()},
                outputs=[_retype_meta(m, low, to) for m in n.outputs], multi=n.multi, module=n.module,
                module_type=n.module_type, case=n.case)


def as_float32(graph: Graph, dtype: str | None = None, to: str = "float32") -> Graph:
    """The float32 twin of ``graph``: every value of the low dtype ``dtype`` (default: the
    graph's own, :func:`graph_dtype`) and every ``dtype=`` argument naming it become float32
    (``to="float64"``: the float64 anchor; ``dtype="float32", to="float64"``: a float32
    graph's float64 anchor). Feed it the low-precision inputs upcast (:func:`upcast`). A graph
    with nothing to retype is returned as is."""
    low = dtype or graph_dtype(graph)
    if low == to or low not in (*LOW_FLOATS, "float32"):
        return graph
    return Graph(inputs=[(r, _retype_meta(m, low, to)) for r, m in graph.inputs],
                 nodes=[_retype_node(n, low, to) for n in graph.nodes], outputs=list(graph.outputs),
                 state=dict(graph.state))


def upcast(values: dict, dtype: str | None = None, to: str = "float32") -> dict:
    """``values`` (ref -> tensor) with every tensor of a low float dtype (only ``dtype`` when
    given, which may be ``float32`` for a float64 anchor) converted to float32 (or ``to``);
    other values as they are."""
    import torch
    from tapml.graph import dtype_name, torch_dtype
    out = {}
    for r, t in values.items():
        name = isinstance(t, torch.Tensor) and dtype_name(t.dtype)
        low = name in LOW_FLOATS and dtype is None or name == dtype != to
        out[r] = t.to(torch_dtype(to)) if low else t
    return out


def _cast_node(name: str, ref: str, meta: TensorMeta, to: str, like: Node) -> Node:
    return Node(name=name, op=CAST_OP, args=[{"ref": ref}], kwargs={"dtype": {"dtype": to}},
                outputs=[TensorMeta(meta.shape, to)], module=like.module, module_type=like.module_type)


def keep_float32(graph: Graph, keep: Iterable[str], dtype: str | None = None) -> Graph:
    """``graph`` with the nodes named in ``keep`` computing in float32: their low-precision
    inputs are cast up (one cast per value), their outputs stay float32 for kept consumers and
    are cast back down for the others. Graph outputs and state keep their refs (an output made
    by a kept node is float32); a state output a kept node makes is cast back, so the state
    keeps its dtype. Cast nodes are named ``REF.float32`` / ``REF.DTYPE`` after the value they
    convert (placement follows with :func:`cast_nodes`). Unknown names raise KeyError."""
    low = dtype or graph_dtype(graph)
    keep = set(keep)
    missing = keep - {n.name for n in graph.nodes}
    if missing:
        raise KeyError(f"no such nodes: {', '.join(sorted(missing)[:5])}")
    if low not in LOW_FLOATS or not keep:
        return graph
    wide: set[str] = set()  # refs whose value is float32 in the new graph but low in the old
    casts: dict[tuple[str, str], str] = {}
    nodes: list[Node] = []

    def cast(ref: str, to: str, like: Node) -> str:
        if (ref, to) not in casts:
            casts[ref, to] = f"{ref.replace('#', '_')}.{to}"
            nodes.append(_cast_node(casts[ref, to], ref, graph.meta[ref], to, like))
        return casts[ref, to]

    def reading(ref: str, n: Node, kept: bool) -> str:
        """The ref node ``n`` reads for ``ref``: a kept node reads low-precision values cast up,
        the others read a kept node's float32 value cast back down."""
        if kept:
            return ref if ref in wide or graph.meta[ref].dtype != low else cast(ref, "float32", n)
        return cast(ref, low, n) if ref in wide else ref

    for n in graph.nodes:
        kept = n.name in keep
        new = _retype_node(n, low, "float32") if kept else Node(**vars(n))
        fix = functools.partial(reading, n=n, kept=kept)
        new.args, new.kwargs = map_refs(new.args, fix), {k: map_refs(v, fix) for k, v in new.kwargs.items()}
        if kept:
            wide.update(r for r, m in zip(n.output_refs, n.outputs) if m.dtype == low)
        nodes.append(new)
    producer = graph.producer()
    state = {name: cast(ref, low, producer[ref]) if ref in wide else ref for name, ref in graph.state.items()}
    return Graph(inputs=list(graph.inputs), nodes=nodes, outputs=list(graph.outputs), state=state)


def cast_nodes(original: Graph, mixed: Graph) -> list[str]:
    """Names of the cast nodes :func:`keep_float32` added to ``original`` to make ``mixed``."""
    known = {n.name for n in original.nodes}
    return [n.name for n in mixed.nodes if n.name not in known]


__all__ = ["MODEL_DTYPES", "LOW_FLOATS", "FINITE_MAX", "CAST_OP", "check_model_dtype", "graph_dtype",
           "as_float32", "upcast", "keep_float32", "cast_nodes"]
