"""Replay: every carved case of every zoo model runs on wgpu:vulkan and matches the stored
reference output; each whole model also runs as a single KernelProgram (intermediates on
the device, elementwise chains fused) and matches the reference model outputs."""

from __future__ import annotations

import pytest

from tapml.compare import compare_outputs
from tapml.platforms.wgpu_native import available_backends, shared_platform

ZOO = ["mlp", "cnn", "tiny-llama", "tiny-gpt2", "tiny-bert", "tiny-vit", "tiny-resnet"]
pytestmark = [pytest.mark.device,
              pytest.mark.skipif("vulkan" not in available_backends(),
                                 reason="no wgpu Vulkan adapter (install mesa-vulkan-drivers for lavapipe)")]


@pytest.fixture(scope="session")
def vulkan():
    return shared_platform("vulkan")


@pytest.mark.parametrize("model", ZOO)
def test_every_carved_case_matches_reference(vulkan, carved, model):
    from tapml.carving import CarveStore
    store = CarveStore(carved(f"zoo:{model}"))
    failures = []
    for case in store.cases:
        try:
            out = vulkan.run(vulkan.compile(store.case_graph(case)), store.case_inputs(case))
        except Exception as e:  # noqa: BLE001 - collect every failing case, then report them all
            failures.append(f"{case['id']} {case['op']}: {type(e).__name__}: {str(e)[:300]}")
            continue
        result = compare_outputs(out, store.case_outputs(case), op=case["op"])
        if not result.passed:
            failures.append(f"{case['id']} {case['op']}: {result.message}")
    assert not failures, f"{len(failures)}/{len(store.cases)} cases of zoo:{model} fail:\n" + "\n".join(failures)


@pytest.mark.parametrize("model", ZOO)
def test_whole_model_as_one_program(vulkan, carved, model):
    from tapml.carving import CarveStore
    store = CarveStore(carved(f"zoo:{model}"))
    graph = store.graph
    inputs = store.program_inputs()
    program = vulkan.compile(graph)
    assert len(program.kernels) < len(graph.nodes)  # views and fused elementwise ops cost no kernel
    out = vulkan.run(program, [inputs[r] for r, _ in graph.inputs])
    ref = store.model_outputs()
    result = compare_outputs(out, [ref[r] for r in graph.outputs])
    assert result.passed, result.message
