"""Runs the saved program (program.pt2) with the backend class that made the repro, re-imported:
it needs torch, tapml's backend contract module and that backend. plan.json's ``backend`` names the
class (``module:Class`` of an installed package, or ``/path/to/file.py:Class``, whose code runs)."""

from __future__ import annotations

import importlib
import importlib.util
import json
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _backend(plan: dict):
    where, _, name = plan["backend"].rpartition(":")
    if where.endswith(".py"):
        spec = importlib.util.spec_from_file_location("repro_backend_module", where)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    else:
        module = importlib.import_module(where)
    return getattr(module, name)(plan["target"])


def run(artifact: bytes, inputs: list, dtypes: list[str]) -> list:
    import numpy as np
    import torch
    plan = json.loads((HERE / "plan.json").read_text())
    backend = _backend(plan)
    program = torch.export.load(str(HERE / "program.pt2"))
    tensors = [torch.from_numpy(np.ascontiguousarray(a)).to(getattr(torch, d)) for a, d in zip(inputs, dtypes)]
    try:
        outputs = backend.run(backend.compile(program), tensors)
    finally:
        backend.close()
    outputs = list(outputs) if isinstance(outputs, (list, tuple)) else [outputs]
    return [(o.float() if o.dtype == torch.bfloat16 else o).detach().cpu().numpy() for o in outputs]
