"""Device tier: resampling in model code, carved from torch and migrated to lavapipe Vulkan.

The model holds what diffusion and segmentation models resample with: diffusers' Upsample2D
(nearest x2, then a 3x3 convolution), SAM's mask post-processing (bilinear to a size, crop,
bilinear again, align_corners off and on), an antialiased downscale, a grid sample and a
reflection-padded convolution. The resampling ops that stay ops in a core-ATen export
(upsample_nearest2d.vec, upsample_bilinear2d.vec, _upsample_bilinear2d_aa, grid_sampler_2d) must
reach the store as such and pass there alone, inside their regions and in the whole model.
"""

from __future__ import annotations

import textwrap

import pytest
import torch

from support import store_from_source, vulkan_or_skip

RESAMPLER = textwrap.dedent("""
    import torch
    import torch.nn.functional as F
    from torch import nn


    class Upsample2D(nn.Module):
        \"\"\"diffusers' Upsample2D with use_conv=True: nearest x2, then a 3x3 convolution.\"\"\"

        def __init__(self, channels):
            super().__init__()
            self.conv = nn.Conv2d(channels, channels, 3, padding=1)

        def forward(self, hidden_states):
            return self.conv(F.interpolate(hidden_states, scale_factor=2.0, mode="nearest"))


    class MaskPostprocess(nn.Module):
        \"\"\"SAM's postprocess_masks: to the padded input size, crop, to the original size.\"\"\"

        def forward(self, masks):
            masks = F.interpolate(masks, (40, 40), mode="bilinear", align_corners=False)
            masks = masks[..., :37, :33]
            return F.interpolate(masks, (23, 19), mode="bilinear", align_corners=True)


    class Resampler(nn.Module):
        def __init__(self):
            super().__init__()
            self.up = Upsample2D(4)
            self.post = MaskPostprocess()
            self.smooth = nn.Conv2d(4, 4, 3, padding=1, padding_mode="reflect")

        def forward(self, latents, masks, grid):
            up = self.up(latents)
            thumb = F.interpolate(up, size=(7, 5), mode="bilinear", antialias=True)
            warped = F.grid_sample(self.smooth(up), grid, mode="bilinear", padding_mode="border", align_corners=False)
            return up, self.post(masks), thumb, warped


    def factory():
        torch.manual_seed(0)
        grid = torch.rand(1, 9, 11, 2) * 2.4 - 1.2
        return Resampler().eval(), (torch.randn(1, 4, 6, 5), torch.randn(1, 3, 10, 10), grid)
""")

RESAMPLING_OPS = {"aten.upsample_nearest2d.vec", "aten.upsample_bilinear2d.vec", "aten._upsample_bilinear2d_aa.default",
                  "aten.grid_sampler_2d.default"}

def on_wgpu(test):
    """Mark a test that needs a wgpu adapter (the device tier)."""
    return pytest.mark.device(pytest.mark.xdist_group("wgpu")(test))


@pytest.fixture(scope="module")
def resampler_store(tmp_path_factory):
    return store_from_source(tmp_path_factory, "resampler", RESAMPLER)




def test_resampling_ops_stay_ops_in_the_export(resampler_store):
    ops = {c["op"] for c in resampler_store.cases}
    assert RESAMPLING_OPS <= ops, sorted(ops)
    bilinear = [c for c in resampler_store.cases if c["op"] == "aten.upsample_bilinear2d.vec"]
    assert sorted(c["args"][2] for c in bilinear) == [False, True]  # align_corners both ways


@on_wgpu
def test_resampler_migrates_to_vulkan(resampler_store, tmp_path):
    vulkan_or_skip()
    from tapml.driving.migrate import Migration, exit_code
    from tapml.driving.targets import open_target
    with open_target("wgpu:vulkan") as platform:
        state = Migration(resampler_store, platform, "wgpu:vulkan", tmp_path / "s.json").run()
    resampling = [c for c in state["cases"] if c["op"] in RESAMPLING_OPS]
    assert len(resampling) >= 5 and all(c["status"] == "pass" for c in resampling), \
        [(c["op"], c["status"], c["message"][:200]) for c in resampling]
    assert state["summary"]["pass"] == len(resampler_store.cases), state["summary"]
    assert state["placement"]["ops_share"] == 1.0 and state["end_to_end"]["status"] == "pass"
    assert state["culprits"] == [] and exit_code(state) == 0


@on_wgpu
def test_upsample_by_scale_factor_uses_the_given_factor_on_vulkan():
    """A scale factor whose output size implies another factor (5 * 2.3 -> 11, not 2.2): torch
    indexes with 1 / 2.3, not 5 / 11, and so must the device; also with the same size the
    factor does not imply (3 * 1.3 -> 3), where torch's 2-d kernel copies."""
    vulkan_or_skip()
    from tapml.platforms.wgpu_native import shared_platform
    from tapml.platforms.wgsl.registry import case_graph
    vulkan = shared_platform("vulkan")
    torch.manual_seed(5)
    for op in ("aten.upsample_nearest2d.vec", "aten._upsample_nearest_exact2d.vec"):
        for factors in ([2.3, 1.3], [0.45, 2.0]):
            x = torch.randn(2, 3, 5, 3)
            graph, inputs = case_graph(op, [x, None, factors])
            out = vulkan.run(vulkan.compile(graph), inputs)[0]
            expected = torch.ops.aten.upsample_nearest2d.vec(x, None, factors) if "exact" not in op else \
                torch.ops.aten._upsample_nearest_exact2d.vec(x, None, factors)
            assert torch.equal(out, expected), (op, factors)


def test_a_node_that_does_not_fit_its_shapes_is_refused_with_the_reason():
    """A store from elsewhere may carry any arguments: a pad wider than its input (reflection
    needs pads below the size), a grid mode torch lacks, or an output that drops the batch is a
    verdict that names the problem, never a kernel reading outside its input."""
    from tapml.errors import PlatformError
    from tapml.graph import TensorMeta
    from tapml.platforms.wgsl import compile_graph, supports
    from tapml.platforms.wgsl.registry import case_graph
    torch.manual_seed(0)
    graph, _ = case_graph("aten.reflection_pad2d.default", [torch.randn(1, 2, 4, 4), [1, 1, 1, 1]])
    graph.nodes[0].args[1] = [5, -3, 1, 1]  # the output width still adds up, the reflection does not
    with pytest.raises(PlatformError, match="padding \\[5, -3, 1, 1\\] does not fit"):
        compile_graph(graph, {})
    graph, _ = case_graph("aten.grid_sampler_2d.default", [torch.randn(1, 2, 4, 4), torch.rand(1, 3, 3, 2), 0, 0, False])
    graph.nodes[0].args[2] = 7
    assert "interpolation mode 7" in supports(graph.nodes[0], {}, [m for _, m in graph.inputs])
    graph, _ = case_graph("aten.upsample_nearest2d.vec", [torch.randn(2, 3, 4, 4), None, [2.0, 2.0]])
    graph.nodes[0].outputs = [TensorMeta((3, 3, 8, 8), "float32")]
    with pytest.raises(PlatformError, match="do not fit 2 spatial dims"):
        compile_graph(graph, {})
