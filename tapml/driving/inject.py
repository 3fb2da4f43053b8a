"""Fault injection: make a target return wrong results for one op, to prove tapml finds it.

``--inject OP=KIND`` or ``--inject OP@NODE=KIND`` with KIND ``scale:F``, ``offset:F``, ``nan``
or ``compile-error``. The fault is compiled *into* the program (an extra op after the faulty
node), so it behaves like a buggy kernel inside any region, not only in single-op cases.
Only floating-point outputs are corrupted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tapml.errors import PlatformError, TapmlError
from tapml.graph import Graph, Node, map_refs
from tapml.platforms.base import Platform, PlatformWrapper

KINDS = ("scale:F", "offset:F", "nan", "compile-error")


@dataclass(frozen=True)
class Fault:
    """One parsed ``--inject`` item: corrupt ``op`` (only node ``node`` when given) with ``kind``
    (``scale``, ``offset``, ``nan``, ``compile-error``) and, for scale and offset, ``value``."""

    op: str
    node: str | None
    kind: str
    value: float = 0.0

    def matches(self, node: Node) -> bool:
        return node.op == self.op and (self.node is None or self.node == node.name)

    def __str__(self) -> str:
        where = f"{self.op}@{self.node}" if self.node else self.op
        value = f":{self.value:g}" if self.kind in ("scale", "offset") else ""
        return f"{where}={self.kind}{value}"


def parse_faults(items: list[str]) -> list[Fault]:
    """Parse ``--inject`` values; TapmlError says what is wrong."""
    faults = []
    for item in items:
        target, sep, kind = item.partition("=")
        op, _, node = target.partition("@")
        if not sep or not op or op.count(".") != 2:
            raise TapmlError(f"--inject {item!r}: expected OP=KIND or OP@NODE=KIND with OP a full aten "
                             f"overload name (aten.tanh.default); KIND one of {', '.join(KINDS)}")
        name, _, value = kind.partition(":")
        if name in ("scale", "offset"):
            try:
                v = float(value)
                if not math.isfinite(v):
                    raise ValueError
            except ValueError:
                raise TapmlError(f"--inject {item!r}: {name} needs a finite number, e.g. {name}:1.01") from None
            faults.append(Fault(op, node or None, name, v))
        elif name in ("nan", "compile-error") and not value:
            faults.append(Fault(op, node or None, name))
        else:
            raise TapmlError(f"--inject {item!r}: unknown fault kind {kind!r}; use {', '.join(KINDS)}")
    return faults


def inject_faults(graph: Graph, faults: list[Fault]) -> Graph:
    """A copy of ``graph`` with an extra node after each faulty node's float outputs."""
    nodes, renamed = [], {}
    for node in graph.nodes:
        node = Node(**{**vars(node), "args": map_refs(node.args, lambda r: renamed.get(r, r)),
                       "kwargs": {k: map_refs(v, lambda r: renamed.get(r, r)) for k, v in node.kwargs.items()}})
        nodes.append(node)
        fault = next((f for f in faults if f.matches(node)), None)
        if fault is None:
            continue
        if fault.kind == "compile-error":
            raise PlatformError(f"injected compile error in {node.op} ({node.name})")
        for i, (ref, meta) in enumerate(zip(node.output_refs, node.outputs)):
            if not meta.dtype.startswith(("float", "bfloat")):
                continue
            op, value = {"scale": ("aten.mul.Scalar", fault.value), "offset": ("aten.add.Scalar", fault.value),
                         "nan": ("aten.add.Scalar", {"float": "nan"})}[fault.kind]
            name = f"{node.name}__fault{i}"
            nodes.append(Node(name=name, op=op, args=[{"ref": ref}, value], kwargs={}, outputs=[meta],
                              module=node.module, module_type=node.module_type))
            renamed[ref] = name
    return Graph(inputs=list(graph.inputs), nodes=nodes, outputs=[renamed.get(r, r) for r in graph.outputs])


class InjectedPlatform(PlatformWrapper):
    """Wraps a platform so that programs compiled for it carry the injected faults."""

    def __init__(self, inner: Platform, faults: list[Fault]):
        super().__init__(inner)
        self.faults = faults

    def _compile(self, graph: Graph):
        return self.inner.compile(inject_faults(graph, self.faults))
