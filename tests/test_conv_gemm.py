"""Convolution as an implicit GEMM (platforms/wgsl/conv_gemm.py), issue 35: 1-3 spatial dims,
groups, stride, padding, dilation, with and without bias, output channels and positions that are
not multiples of the tile, the 1x1 convolution that runs as a batched matrix product, in float32,
float16 and bfloat16, against torch on seeded random inputs (edge values in one case). The runtime
poisons outputs, so an element no invocation writes shows.
Device tier: lavapipe and llvmpipe; browser tier: Chromium."""

from __future__ import annotations

import pytest
import torch

from tapml.platforms.wgsl.conv_gemm import MIN_TILES, fits
from tapml.platforms.wgsl.registry import case_graph
from tests.support import on_every_webgpu

#: name -> (input shape, weight shape, bias, stride, padding, dilation, groups, kernel the case runs as)
CASES = {
    "3x3-padded": ((2, 5, 19, 21), (20, 5, 3, 3), True, [1, 1], [1, 1], [1, 1], 1, "conv_gemm"),
    "grouped-strided": ((1, 12, 23, 17), (18, 4, 3, 2), False, [2, 1], [1, 0], [1, 1], 3, "conv_gemm"),
    "dilated-1d": ((3, 7, 200), (9, 7, 5), True, [1], [4], [2], 1, "conv_gemm"),
    "3d": ((2, 4, 9, 10, 21), (8, 2, 3, 2, 3), True, [1, 2, 1], [1, 0, 1], [1, 1, 2], 2, "conv_gemm"),
    "pointwise": ((2, 24, 17, 15), (33, 24, 1, 1), True, [1, 1], [0, 0], [1, 1], 1, "conv"),
}
#: float16 and bfloat16 round each product's inputs, then the float32 sum once at the end
TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 1.6e-2)}


def _case(name: str, dtype):
    xs, ws, bias, stride, padding, dilation, groups, _ = CASES[name]
    gen = torch.Generator().manual_seed(len(name))
    x, w = torch.randn(*xs, generator=gen), torch.randn(*ws, generator=gen) / (ws[1] * ws[2]) ** 0.5
    if name == "3x3-padded" and dtype == torch.float32:  # large, tiny, subnormal and signed-zero inputs
        x[0, 0, 0, :6] = torch.tensor([1e18, -1e18, 1e-40, -0.0, 3.4e15, -3.4e15])
    b = torch.randn(ws[0], generator=gen) if bias else None
    args = [x.to(dtype), w.to(dtype), None if b is None else b.to(dtype), stride, padding, dilation, False,
            [0] * len(stride), groups]
    graph, inputs = case_graph("aten.convolution.default", args)
    want = torch.ops.aten.convolution(*[a.double() if isinstance(a, torch.Tensor) else a for a in args])
    return graph, inputs, want


def _check(platform, dtypes=(torch.float32, torch.float16, torch.bfloat16)):
    for dtype in dtypes:
        for name, case in CASES.items():
            graph, inputs, want = _case(name, dtype)
            program = platform.compile(graph)
            assert [k.name.rsplit("_", 1)[0] for k in program.kernels] == [case[-1]], (name, program.kernels)
            got = platform.run(program, inputs)[0]
            assert got.dtype == dtype and got.shape == want.shape and not got.isnan().any(), (name, dtype)
            rtol, atol = TOLERANCE[dtype]
            scale = float(want.abs().max())
            torch.testing.assert_close(got.double(), want, rtol=rtol, atol=atol * max(scale, 1.0), msg=f"{name} {dtype}")


def test_the_implicit_gemm_takes_only_what_it_should():
    from tapml.graph import TensorMeta as M
    big, w = M((1, 64, 56, 56), "float32"), M((64, 64, 3, 3), "float32")
    assert fits(big, w, M((1, 64, 56, 56), "float32"), False, 1)
    assert not fits(big, w, M((1, 64, 56, 56), "float32"), True, 1)  # transposed: the direct kernel
    assert not fits(M((1, 64, 56, 56), "int32"), M((64, 64, 3, 3), "int32"), M((1, 64, 56, 56), "int32"), False, 1)
    # a sum longer than one invocation may loop: the direct kernel splits it
    assert not fits(M((1, 4096, 9, 9), "float32"), M((64, 4096, 3, 3), "float32"), M((1, 64, 7, 7), "float32"), False, 1)
    # too few output tiles to keep the device busy (the bench's 1024-channel, 64-tap row)
    assert not fits(M((1, 1024, 80, 1), "float32"), M((8, 1024, 64, 1), "float32"), M((1, 8, 17, 1), "float32"), False, 1)
    for name, case in CASES.items():
        graph, _, _ = _case(name, torch.float32)
        x, wm = (meta for _, meta in graph.inputs[:2])
        assert fits(x, wm, graph.nodes[0].outputs[0], False, case[6]), f"{name} must exercise the implicit GEMM"
    assert MIN_TILES > 1


(test_implicit_gemm_convolutions_equal_torch,
 test_implicit_gemm_convolutions_equal_torch_in_chromium) = on_every_webgpu(_check)
