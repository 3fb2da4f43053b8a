"""Hybrid execution: placements split the model into target regions; values cross only at their edges."""

import random

import pytest
import torch

from tapml.graph import Graph
from tapml.driving.hybrid import REFERENCE, TARGET, HybridRunner, node_flops, placement_shares, reference_values, segments
from tapml.driving.regions import bisect
from tapml.platforms.reference import ReferencePlatform


class RecordingReference(ReferencePlatform):
    """The real reference platform, remembering each graph it compiled and each run's inputs."""

    def __init__(self):
        super().__init__("cpu")
        self.compiled: list[Graph] = []
        self.runs = 0

    def _compile(self, graph):
        self.compiled.append(graph)
        return super()._compile(graph)

    def _run(self, program, inputs):
        self.runs += 1
        return super()._run(program, inputs)


@pytest.fixture(scope="module")
def llama(carved):
    from tapml.carving import CarveStore
    return CarveStore(carved("zoo:tiny-llama"))


def model_outputs_match(store, values):
    expected = store.model_outputs()
    return all(torch.equal(values[r], t) for r, t in expected.items())


def test_random_placements_match_the_reference_and_cross_only_at_region_edges(llama):
    graph, inputs = llama.graph, llama.program_inputs()
    rng = random.Random(0)
    for trial in range(3):
        placement = {n.name: rng.choice([TARGET, REFERENCE]) for n in graph.nodes}
        platform = RecordingReference()
        result = HybridRunner(graph, platform).run(inputs, placement)
        assert model_outputs_match(llama, result.values)
        target_segments = [s for s in segments(graph, placement) if s.where == TARGET]
        assert len(result.regions) == len(target_segments) == len(platform.compiled) == platform.runs
        for seg, sub, run in zip(target_segments, platform.compiled, result.regions):
            assert [n.name for n in sub.nodes] == seg.names == run.nodes
            inside = {r for n in seg.nodes for r in n.output_refs}
            # Inputs come from outside the region; outputs are only what something outside reads.
            assert not inside & {r for r, _ in sub.inputs}
            read_outside = set(graph.outputs) | {r for n in graph.nodes if n.name not in set(seg.names)
                                                  for r in n.input_refs}
            assert set(sub.outputs) == inside & read_outside
            assert run.bytes_in == sum(inputs[r].nbytes if r in inputs else
                                       llama.graph.meta[r].nbytes for r, _ in sub.inputs)


def test_all_target_is_one_program_compiled_once(llama):
    platform = RecordingReference()
    runner = HybridRunner(llama.graph, platform)
    placement = {n.name: TARGET for n in llama.graph.nodes}
    first = runner.run(llama.program_inputs(), placement)
    second = runner.run(llama.program_inputs(), placement)
    assert len(first.regions) == 1 and not first.regions[0].cached and second.regions[0].cached
    assert len(platform.compiled) == 1 and platform.runs == 2
    assert set(first.regions[0].inputs) == {r for r, _ in llama.graph.inputs if any(
        r in n.input_refs for n in llama.graph.nodes)}
    assert model_outputs_match(llama, second.values)


def test_keep_returns_intermediates_without_changing_programs(llama):
    graph = llama.graph
    placement = {n.name: TARGET for n in graph.nodes}
    platform = RecordingReference()
    runner = HybridRunner(graph, platform)
    mid = graph.nodes[len(graph.nodes) // 2]
    result = runner.run(llama.program_inputs(), placement, keep=mid.output_refs)
    ref = reference_values(graph, llama.program_inputs())
    assert torch.equal(result.values[mid.output_refs[0]], ref[mid.output_refs[0]])
    assert mid.output_refs[0] in platform.compiled[-1].outputs


def test_shares_and_flops(llama):
    graph = llama.graph
    everything = placement_shares(graph, {n.name: TARGET for n in graph.nodes})
    assert everything["ops_share"] == 1.0 and everything["flops_share"] == 1.0
    nothing = placement_shares(graph, {})
    assert nothing["ops_on_target"] == 0 and nothing["flops_share"] == 0.0
    mm = next(n for n in graph.nodes if n.op == "aten.mm.default")
    a, b = (graph.meta[r] for r in mm.input_refs)
    assert node_flops(mm, graph.meta) == 2 * a.shape[0] * a.shape[1] * b.shape[1]
    view = next(n for n in graph.nodes if n.op == "aten.view.default")
    assert node_flops(view, graph.meta) == 0


def test_missing_inputs_are_named(llama):
    runner = HybridRunner(llama.graph, ReferencePlatform())
    with pytest.raises(ValueError, match="lacks graph inputs"):
        runner.run({}, {})


@pytest.mark.parametrize("n", [1, 2, 7, 64, 250])
def test_bisect_finds_one_bad_node_in_log_steps(n):
    import math
    for bad in sorted({0, n // 3, n - 1}):
        calls = []

        def fails(window):
            calls.append(window)
            return bad in window

        assert bisect(list(range(n)), fails) == [bad]
        assert len(calls) <= 2 * max(1, math.ceil(math.log2(n)))


def test_bisect_finds_the_smallest_accumulating_window():
    import math
    # Error builds up: a window fails once it holds 3 of the "lossy" nodes 40..44.
    lossy = set(range(40, 45))

    def fails(window):
        calls.append(1)
        return len(lossy & set(window)) >= 3

    for n in (64, 200):
        calls = []
        window = bisect(list(range(n)), fails)
        assert len(window) == 3 and set(window) <= lossy and window == list(range(window[0], window[0] + 3))
        assert len(calls) <= 6 * math.ceil(math.log2(n))


@pytest.mark.device
@pytest.mark.xdist_group("wgpu")
def test_hybrid_on_wgpu_vulkan(carved):
    wgpu_native = pytest.importorskip("tapml.platforms.wgpu_native", reason="the wgpu platform is not built yet")
    from tapml.carving import CarveStore
    from tapml.judging.compare import compare_outputs
    store = CarveStore(carved("zoo:mlp"))
    graph = store.graph
    with wgpu_native.WgpuPlatform("vulkan") as platform:
        runner = HybridRunner(graph, platform)
        expected = store.model_outputs()
        for placement in ({n.name: TARGET for n in graph.nodes},
                          {n.name: (TARGET if i % 3 else REFERENCE) for i, n in enumerate(graph.nodes)}):
            result = runner.run(store.program_inputs(), placement)
            refs = list(expected)
            c = compare_outputs([result.values[r] for r in refs], [expected[r] for r in refs])
            assert c.passed, c.message
            assert len(result.regions) == len([s for s in segments(graph, placement) if s.where == TARGET])
