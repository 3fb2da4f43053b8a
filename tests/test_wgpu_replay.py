"""Replay: every carved case of every zoo model runs on wgpu:vulkan and matches the stored
reference output; each whole model also runs as a single KernelProgram (intermediates on
the device, elementwise chains fused) and matches the reference model outputs."""

from __future__ import annotations

import pytest

from tapml.judging.compare import compare_outputs
from tapml.platforms.wgpu_native import available_backends, shared_platform

ZOO = ["mlp", "cnn", "tiny-llama", "tiny-gpt2", "tiny-bert", "tiny-vit", "tiny-resnet"]
pytestmark = [pytest.mark.device,
              pytest.mark.skipif("vulkan" not in available_backends(),
                                 reason="no wgpu Vulkan adapter (install mesa-vulkan-drivers for lavapipe)")]


@pytest.fixture(scope="session")
def vulkan():
    return shared_platform("vulkan")


def _replay(carved, spec, backend):
    from tapml.carving import CarveStore
    from tapml.driving.replay import replay
    store = CarveStore(carved(spec))
    return replay(store, shared_platform(backend), f"wgpu:{backend}")


def _not_passing(result, allowed=("pass",)):
    return [f"{v['id']} {v['op']}: {v['status']}: {v['message'][:300]}" for v in result["cases"]
            if v["status"] not in allowed]


@pytest.mark.parametrize("model", ZOO)
def test_every_carved_case_passes_on_vulkan(carved, model):
    result = _replay(carved, f"zoo:{model}", "vulkan")
    bad = _not_passing(result)
    assert not bad, f"{len(bad)}/{len(result['cases'])} cases of zoo:{model} fail:\n" + "\n".join(bad)


@pytest.mark.skipif("gl" not in available_backends(), reason="no wgpu OpenGL adapter (llvmpipe via EGL)")
@pytest.mark.parametrize("model", ZOO)
def test_every_carved_case_passes_or_is_unsupported_with_a_reason_on_gl(carved, model):
    result = _replay(carved, f"zoo:{model}", "gl")
    bad = _not_passing(result, ("pass", "unsupported"))
    assert not bad, "\n".join(bad)
    assert all(v["message"] for v in result["cases"] if v["status"] == "unsupported")


@pytest.mark.slow
@pytest.mark.parametrize("spec", ["hf:mistral", "hf:roberta", "hf:deit"])
def test_architectures_beyond_the_zoo_pass_on_vulkan(carved, spec):
    """Decoder, encoder and vision families that no code names: the registry is generic."""
    result = _replay(carved, spec, "vulkan")
    assert not _not_passing(result), _not_passing(result)


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


def test_inputs_uploaded_in_small_chunks_give_the_same_outputs(vulkan, carved, monkeypatch):
    """Weights go to the device in chunks (bounded host staging); every chunk lands where it belongs."""
    from tapml.platforms import wgpu_native
    monkeypatch.setattr(wgpu_native, "_UPLOAD_CHUNK", 100)  # not a multiple of any row
    test_whole_model_as_one_program(vulkan, carved, "tiny-llama")
