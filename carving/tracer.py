"""The carving tracer: runs an exported program on the reference and records every op call."""

from __future__ import annotations

import json
import operator
from typing import Callable

import torch

from tapml.graph import Graph, TensorMeta, map_refs, node_results, op_name
from tapml.carving.store import CarveStoreWriter


#: torch.export's runtime checks (op packets). They compute nothing, and the graph drops them;
#: the carve is specialized to the reference run's real values, so a check that torch got wrong
#: for the model's own example inputs (masked_select bounds its size by the input, not the
#: broadcast of input and mask) does not stop it.
RUNTIME_CHECKS = frozenset({"aten._assert_scalar", "aten._assert_async", "aten._assert_tensor_metadata",
                            "aten.sym_constrain_range", "aten.sym_constrain_range_for_size"})


def is_runtime_check(n: torch.fx.Node) -> bool:
    """Whether fx node ``n`` is one of torch.export's :data:`RUNTIME_CHECKS`."""
    return n.op == "call_function" and str(n.target).rsplit(".", 1)[0] in RUNTIME_CHECKS


def guard_node(interpreter: torch.fx.Interpreter, n: torch.fx.Node) -> None:
    """Before an aten op of the program runs on the reference: its data-dependent arguments within
    bounds and its outputs within the memory budget (:func:`tapml.meta_sizes.guard_call`);
    TapmlError (exit 2) naming the node otherwise."""
    if n.op != "call_function" or not isinstance(n.target, torch._ops.OpOverload):
        return
    from tapml.errors import TapmlError
    from tapml.meta_sizes import guard_call
    from tapml.op_bounds import OutOfBounds
    args, kwargs = interpreter.fetch_args_kwargs_from_env(n)
    try:
        guard_call(op_name(n.target), args, kwargs)
    except (OutOfBounds, ValueError) as e:
        raise TapmlError(f"the program's node {n.name[:60]!r} is refused before it runs: {e}") from None


class CarvingInterpreter(torch.fx.Interpreter):
    """An fx Interpreter that records each ``call_function`` node's real inputs and outputs.

    Cases are deduplicated by (op, input shapes and dtypes, non-tensor arguments); the first
    instance's tensors are written to the store, later ones only count.

    A generation runs several programs (prefill, decode) several times: interpreters made with
    ``shares=`` an earlier one add to its cases, deduplicated across programs and steps, and
    with ``graph_kind`` set each case records ``graph`` (the program of its ``node``) and
    ``steps`` (the values :attr:`step` had at its instances).
    """

    def __init__(self, gm: torch.fx.GraphModule, graph: Graph, writer: CarveStoreWriter,
                 on_node: Callable[[str], None] | None = None, *, shares: "CarvingInterpreter | None" = None,
                 graph_kind: str | None = None):
        super().__init__(gm, garbage_collect_values=True)
        self.ir = {n.name: n for n in graph.nodes}
        self.writer = writer
        self.on_node = on_node
        self.cases: list[dict] = [] if shares is None else shares.cases
        self._by_key: dict[str, dict] = {} if shares is None else shares._by_key
        self.graph_kind = graph_kind
        self.step = 0

    def run_node(self, n: torch.fx.Node):
        if is_runtime_check(n):
            return None
        guard_node(self, n)
        result = super().run_node(n)
        node = self.ir.get(n.name)
        if n.op == "call_function" and n.target is not operator.getitem and node is not None:
            args, kwargs = self.fetch_args_kwargs_from_env(n)
            tensors = [x for x in torch.utils._pytree.tree_leaves((list(args), list(kwargs.values())))
                       if isinstance(x, torch.Tensor)]
            outputs = node_results(node, result)
            self._record(node, tensors, outputs)
            if self.on_node:
                self.on_node(n.name)
        return result

    def _record(self, node, inputs: list[torch.Tensor], outputs: list[torch.Tensor]) -> None:
        refs = node.input_refs
        unique = list(dict.fromkeys(refs))
        inputs = [inputs[refs.index(r)] for r in unique]
        position = {r: i for i, r in enumerate(unique)}
        key = json.dumps([node.op, [TensorMeta.of(t).to_json() for t in inputs], map_refs(node.args, position.get),
                          {k: map_refs(v, position.get) for k, v in node.kwargs.items()}], sort_keys=True)
        case = self._by_key.get(key)
        if case is None:
            cid = f"c{len(self.cases)}"
            names = [f"{cid}.i{i}" for i in range(len(inputs))]
            rename = lambda r: names[position[r]]  # noqa: E731
            case = {"id": cid, "op": node.op, "node": node.name, "nodes": [], "module": node.module,
                    "args": map_refs(node.args, rename),
                    "kwargs": {k: map_refs(v, rename) for k, v in node.kwargs.items()},
                    "multi": node.multi, "output_meta": [m.to_json() for m in node.outputs],
                    "inputs": [self.writer.put(name, t) for name, t in zip(names, inputs)],
                    "outputs": [self.writer.put(f"{cid}.o{i}", t) for i, t in enumerate(outputs)],
                    "instances": 0}
            if self.graph_kind is not None:
                case.update(graph=self.graph_kind, steps=[])
            self._by_key[key] = case
            self.cases.append(case)
        case["instances"] += 1
        if self.graph_kind is None:
            case["nodes"].append(node.name)
        else:  # a generation runs each node once per step: name it once, and each step once
            if node.name not in case["nodes"]:
                case["nodes"].append(node.name)
            if self.step not in case["steps"]:
                case["steps"].append(self.step)
        node.case = case["id"]


class RealValueRecorder(torch.fx.Interpreter):
    """Runs an exported program on real inputs and keeps, for every node, what
    :func:`tapml.graph.graph_from_fx` needs where export has only symbols: a tensor's
    :class:`TensorMeta` (a list of them for a node returning several), a scalar's value.

    Example: ``values = RealValueRecorder(ep.graph_module).record(*placeholder_values(ep, example))``.
    """

    def __init__(self, gm: torch.fx.GraphModule):
        super().__init__(gm, garbage_collect_values=True)
        self.values: dict[str, object] = {}

    def record(self, *args) -> dict[str, object]:
        """Run the program on ``args`` (one value per placeholder); returns fx node name -> value."""
        with torch.no_grad():
            self.run(*args, enable_io_processing=False)
        return self.values

    def run_node(self, n: torch.fx.Node):
        if is_runtime_check(n):
            return None
        guard_node(self, n)
        result = super().run_node(n)
        if isinstance(result, torch.Tensor):
            self.values[n.name] = TensorMeta.of(result)
        elif isinstance(result, (list, tuple)) and result and all(isinstance(v, torch.Tensor) for v in result):
            self.values[n.name] = [TensorMeta.of(v) for v in result]
        elif isinstance(result, (bool, int, float)):
            self.values[n.name] = result
        return result

