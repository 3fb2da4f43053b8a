"""Carving: record every operator's real inputs and outputs as test cases in a CarveStore."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

from tapml.carving.store import CarveStore, CarveStoreWriter

__all__ = ["carve", "CarveStore", "CarveStoreWriter"]


def carve(spec: str, out: str | Path, *, seed: int = 0, device: str = "cpu", hf_config: dict | None = None,
          shard_bytes: int = 64 << 20, on_start: Callable[[int], None] | None = None,
          on_node: Callable[[str], None] | None = None) -> dict:
    """Capture ``spec``, run it on the reference and write a CarveStore at ``out``.

    Returns timing and size figures: ``export_s``, ``carve_s``, ``bytes``, ``cases``, ``nodes``.
    Example: ``carve("zoo:mlp", "stores/mlp")``.
    """
    import torch

    from tapml.capture import export, program_inputs
    from tapml.carving.tracer import CarvingInterpreter
    from tapml.errors import TapmlError
    from tapml.graph import graph_from_fx
    from tapml.models import load_model

    if device not in ("cpu", "cuda"):
        raise TapmlError(f"--device must be cpu or cuda, not {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise TapmlError("--device cuda: no CUDA device on this machine; use --device cpu")
    t0 = time.perf_counter()
    model, example = load_model(spec, seed=seed, hf_config=hf_config)
    ep = export(model, example)
    if device == "cuda":
        from torch.export.passes import move_to_device_pass
        ep = move_to_device_pass(ep, "cuda")
    try:
        graph = graph_from_fx(ep.graph)
    except ValueError as e:
        raise TapmlError(f"the exported graph cannot be represented: {e}") from None
    t1 = time.perf_counter()

    writer = CarveStoreWriter(out, shard_bytes=shard_bytes)
    inputs = program_inputs(ep, example)
    stored_inputs = {name: {"kind": kind, "tensor": writer.put(f"in.{name}", t)} for name, kind, t in inputs}
    if on_start:
        on_start(len(graph.nodes))
    interp = CarvingInterpreter(ep.graph_module, graph, writer, on_node=on_node)
    with torch.no_grad():
        result = interp.run(*[t.to(device) for _, _, t in inputs], enable_io_processing=False)
    leaves = [x for x in torch.utils._pytree.tree_leaves(result) if isinstance(x, torch.Tensor)]
    model_outputs = {ref: writer.put(f"out.{i}", t) for i, (ref, t) in enumerate(zip(graph.outputs, leaves))}
    graph_json = graph.to_json()
    writer.close({
        "model": spec, "hf_config": hf_config or {}, "torch_version": torch.__version__,
        "reference_device": device, "seed": seed,
        "graph_inputs": graph_json["inputs"], "nodes": graph_json["nodes"], "graph_outputs": graph_json["outputs"],
        "program_inputs": stored_inputs, "model_outputs": model_outputs, "cases": interp.cases,
    })
    t2 = time.perf_counter()
    return {"export_s": t1 - t0, "carve_s": t2 - t1, "bytes": writer.bytes_written, "cases": len(interp.cases),
            "nodes": len(graph.nodes), "ops": len({c["op"] for c in interp.cases}),
            "shards": writer._shard, "peak_pending_bytes": writer.peak_pending_bytes}
