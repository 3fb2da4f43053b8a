"""Helpers shared by test modules (importable because pytest puts tests/ on sys.path)."""

import pytest
import torch

from tapml.compare import compare_anchored
from tapml.graph import Graph, Node, TensorMeta, run_node
from tapml.platforms.wgsl.registry import sample_cases


def _vulkan_backends():
    try:
        from tapml.platforms.wgpu_native import available_backends
        return available_backends()
    except Exception:  # noqa: BLE001 - no wgpu at all: the device tests say why they skip
        return ()


#: ``reference`` and ``wgpu:vulkan`` (a device test, skipped with the reason where lavapipe is
#: missing): for tests that check one command on the CPU reference and on a real adapter.
REFERENCE_AND_VULKAN = ["reference", pytest.param("wgpu:vulkan", marks=[
    pytest.mark.device, pytest.mark.xdist_group("wgpu"),
    pytest.mark.skipif("vulkan" not in _vulkan_backends(),
                       reason="no wgpu Vulkan adapter (install mesa-vulkan-drivers for lavapipe)")])]


def rss_mib(pid: int) -> float:
    """Resident memory of a process, in MiB."""
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmRSS:"))


# --- float16 and bfloat16 samples of the registry ------------------------------------------
# Every lowering that claims a low-precision float runs its seeded samples (edge values
# included) cast to that dtype, judged fp64-anchored against torch's CPU result in that dtype.

LOW = (torch.float16, torch.bfloat16)
LOW_FLOORS = {torch.float16: 1e-3, torch.bfloat16: 1e-2}


def low_precision_case(graph: Graph, inputs, dtype):
    """The sample ``graph`` with its float32 inputs in ``dtype``: (graph, inputs, torch's outputs,
    float64 outputs), or None when torch refuses the op in that dtype."""
    low = [t.to(dtype) if t.dtype == torch.float32 else t for t in inputs]
    node = graph.nodes[0]
    env = dict(zip([r for r, _ in graph.inputs], low))
    try:
        ref = run_node(node, env.__getitem__)
    except (RuntimeError, NotImplementedError):
        return None
    wide = {r: t.double() if t.dtype == dtype else t for r, t in env.items()}
    ref64 = [r.double() if r.is_floating_point() else r for r in run_node(node, wide.__getitem__)]
    node = Node(node.name, node.op, node.args, node.kwargs, [TensorMeta.of(r) for r in ref], node.multi)
    g = Graph(inputs=[(r, TensorMeta.of(t)) for (r, _), t in zip(graph.inputs, low)], nodes=[node],
              outputs=graph.outputs)
    return g, low, ref, ref64


def run_low_precision_samples(platform, op: str) -> int:
    """Run the registry's samples of ``op`` cast to every low-precision float it claims on
    ``platform``, judged fp64-anchored against torch in that dtype; returns how many ran."""
    from tapml.platforms.wgsl import load_lowerings
    low = load_lowerings()[op]
    ran = 0
    for dtype in LOW:
        if str(dtype).removeprefix("torch.") not in low.dtypes:
            continue
        torch.manual_seed(0)
        for graph, inputs in sample_cases(op):
            if not any(t.dtype == torch.float32 for t in inputs):
                continue
            case = low_precision_case(graph, inputs, dtype)
            if case is None:
                continue
            g, ins, ref, ref64 = case
            out = platform.run(platform.compile(g), ins)
            assert [o.dtype for o in out] == [r.dtype for r in ref], f"{op} {dtype}: output dtypes"
            if low.compare_values:
                res = compare_anchored(out, ref, ref64, floor=LOW_FLOORS[dtype])
                assert res.passed, f"{op} {dtype}: {res.message}; worst {res.worst}"
            ran += 1
    return ran
