"""The reference platform: torch eager on CPU (or CUDA), the ground truth everything is checked against.

It runs only ops of the closed vocabulary (:mod:`tapml.ops`): a graph is read back with
:meth:`Graph.from_json`, which refuses any other op name, and each node resolves its op there.
"""

from __future__ import annotations

import dataclasses

import torch

from tapml.errors import TapmlError
from tapml.graph import Graph, Node, run_graph, run_node
from tapml.ops import check_op
from tapml.platforms.base import KernelProgram, Platform, graph_program


class ReferencePlatform(Platform):
    """Runs graphs op by op with torch eager. ``device`` is ``cpu`` or ``cuda``."""

    def __init__(self, device: str = "cpu"):
        if device == "cuda" and not torch.cuda.is_available():
            raise TapmlError("target reference:cuda needs a CUDA device; this machine has none (use `reference`)")
        self.device = torch.device(device)
        self.name = "reference" if device == "cpu" else f"reference:{device}"

    def _caps(self) -> dict:
        adapter = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu"
        return {"adapter": adapter, "backend": f"torch-{torch.__version__}", "features": [],
                "limits": {}, "dtypes": ["float16", "bfloat16", "float32", "float64", "int32", "int64", "bool"]}

    def _supports(self, node) -> str | None:
        try:
            check_op(node.op)
        except ValueError as e:
            return str(e)
        return None

    def _compile(self, graph: Graph) -> KernelProgram:
        return graph_program(graph)

    def _run(self, program: KernelProgram, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        graph = Graph.from_json(program.graph)
        env = {r: t.to(self.device) for r, t in zip(program.inputs, inputs)}
        out = run_graph(graph, env, run=run_node if self.device.type == "cpu" else self._run_node_on_device)
        return [out[r].cpu() for r in program.outputs]

    def _run_node_on_device(self, node: Node, value_of):
        # Factory ops (arange, full, ...) carry device="cpu" from capture; place them on ours.
        kwargs = {k: ({"device": str(self.device)} if isinstance(v, dict) and "device" in v else v)
                  for k, v in node.kwargs.items()}
        return run_node(dataclasses.replace(node, kwargs=kwargs), value_of)
