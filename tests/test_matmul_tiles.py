"""The matrix product's tile variants (platforms/wgsl/matmul.py), issue 35: the kernel that stages
tiles of A and B in workgroup memory, forced for every product of a graph, against torch on seeded
random inputs whose sizes cross tile boundaries (rows, columns and K that are not multiples of the
tiles, one row, one column, batches), transposed operands read in place, a bias with alpha and
beta, in float32, float16 and bfloat16. The runtime poisons outputs, so an element no lane writes
shows. A weight split across binding windows is read window by window by the register and subgroup
tiles. Also the tuner's bookkeeping: a compiled program is not reused under other tiles, and a
cached choice is honoured only when it is one of the candidates.
Device tier: lavapipe and llvmpipe; browser tier: Chromium."""

from __future__ import annotations

import json

import pytest
import torch

from tapml.graph import graph_from_fx
from tapml.platforms.wgsl import matmul
from tests.support import (SPLIT_WEIGHT, exported, in_chromium, on_every_webgpu, own_wgpu, reads_windows_directly,
                           split_weight_linear)

#: name -> (function, input shapes, K); the function's operands are what the graph's product reads
CASES = {
    "ragged-tiles": (lambda a, b: (a @ b,), [(130, 70), (70, 67)], 70),
    "both-transposed": (lambda a, b: (a.t() @ b.t(),), [(37, 130), (67, 37)], 37),
    "one-row": (lambda a, b: (a @ b,), [(1, 50), (50, 90)], 50),
    "one-column": (lambda a, b: (a @ b,), [(90, 33), (33, 1)], 33),
    "batched": (lambda a, b: (torch.bmm(a, b),), [(3, 65, 40), (3, 40, 66)], 40),
    "bias-alpha-beta": (lambda c, a, b: (torch.addmm(c, a, b, beta=0.5, alpha=2.0),), [(67,), (129, 20), (20, 67)],
                        20),
    "batched-bias": (lambda c, a, b: (torch.baddbmm(c, a, b.transpose(1, 2), alpha=-1.5),),
                     [(2, 1, 70), (2, 66, 9), (2, 70, 9)], 9),
    # vec4 rows of B (N and K multiples of 4, M and N not of any tile): what the subgroup tiles need
    "vec-rows": (lambda a, b: (a @ b,), [(130, 72), (72, 68)], 72),
    "vec-rows-transposed": (lambda a, b: (a @ b.t(),), [(75, 36), (100, 36)], 36),
    "vec-rows-batched-bias": (lambda c, a, b: (torch.baddbmm(c, a, b, beta=-1.0),), [(2, 65, 136), (2, 65, 12),
                                                                                     (2, 12, 136)], 12),
}
#: the cases whose B the subgroup tiles can share (vec4 rows or columns)
VEC_CASES = ("vec-rows", "vec-rows-transposed", "vec-rows-batched-bias")
EPS = {torch.float32: 1.2e-7, torch.float16: 9.8e-4, torch.bfloat16: 7.8e-3}


def _case(name: str, dtype):
    fn, shapes, _ = CASES[name]
    gen = torch.Generator().manual_seed(len(name))
    inputs = [torch.randn(*s, generator=gen) for s in shapes]
    if name == "ragged-tiles" and dtype == torch.float32:  # large, tiny, subnormal and signed-zero operands
        inputs[0][0, :6] = torch.tensor([1e18, -1e18, 1e-40, -0.0, 3.4e15, -3.4e15])
    inputs = [t.to(dtype) for t in inputs]
    ep = exported(fn, *inputs)
    want = fn(*[t.double() for t in inputs])[0]
    return graph_from_fx(ep.graph, ep.graph_signature), inputs, want


def _check(platform, tiles, dtypes=(torch.float32, torch.float16, torch.bfloat16), names=tuple(CASES),
           kernel_says=("tile_a", "workgroupBarrier")):
    for dtype in dtypes:
        for name in names:
            graph, inputs, want = _case(name, dtype)
            with matmul.forced_tiles(tiles):
                program = platform.compile(graph)
            assert any(all(w in k.wgsl for w in kernel_says) for k in program.kernels), name
            got = platform.run(program, inputs)[0]
            assert got.dtype == dtype and got.shape == want.shape and not got.isnan().any(), (name, dtype)
            # one rounding of a float32 sum taken in another order: the error follows K and the operands
            k = CASES[name][2]
            scale = float(inputs[-2].double().abs().max() * inputs[-1].double().abs().max())
            atol = 2 * EPS[dtype] * abs(float(want.abs().max())) + 1e-6 * k * scale
            torch.testing.assert_close(got.double(), want, rtol=2 * EPS[dtype], atol=atol, msg=f"{name} {dtype}")


@pytest.mark.device
@pytest.mark.xdist_group("wgpu")
@pytest.mark.parametrize("tiles", matmul.WORKGROUP_CANDIDATES, ids=matmul.tiles_label)
def test_workgroup_memory_tiles_equal_torch_on_vulkan(tiles):
    """Every candidate in float32; the first in float16 and bfloat16 as well (the loads and the
    write are the same code for every candidate)."""
    first = tiles == matmul.WORKGROUP_CANDIDATES[0]
    _check(own_wgpu("vulkan"), tiles, dtypes=(torch.float32, torch.float16, torch.bfloat16) if first else (torch.float32,))


@pytest.mark.device
@pytest.mark.xdist_group("wgpu")
def test_workgroup_memory_tiles_equal_torch_on_gl():
    _check(own_wgpu("gl"), matmul.WORKGROUP_CANDIDATES[1])


@in_chromium
def test_workgroup_memory_tiles_equal_torch_in_chromium():
    from tapml.platforms.browser import BrowserPlatform
    with BrowserPlatform() as browser:
        _check(browser, matmul.WORKGROUP_CANDIDATES[0])


@pytest.mark.device
@pytest.mark.xdist_group("wgpu")
@pytest.mark.parametrize("tiles", matmul.SUBGROUP_CANDIDATES, ids=matmul.tiles_label)
def test_subgroup_tiles_equal_torch_on_vulkan(tiles):
    """The tiles the tuner picks on lavapipe share B's rows across a subgroup (subgroupBroadcast):
    every candidate in float32 on the shapes it takes, the first in float16 too; bfloat16 and the
    other shapes fall back to the register tiles and must be right as well."""
    platform = own_wgpu("vulkan")
    if "subgroup" not in platform.caps().get("features", []):
        pytest.skip("this Vulkan adapter has no subgroup feature")
    first = tiles == matmul.SUBGROUP_CANDIDATES[0]
    dtypes = (torch.float32, torch.float16) if first else (torch.float32,)
    _check(platform, tiles, dtypes=dtypes, names=VEC_CASES, kernel_says=("subgroupBroadcast",))
    # bfloat16 has no vec4 loads, so it takes the register tiles, as every other shape does
    _check(platform, tiles, dtypes=(torch.bfloat16,) if first else (), names=VEC_CASES, kernel_says=("acc0_0",))
    others = [n for n in CASES if n not in VEC_CASES] if first else ["ragged-tiles", "one-row"]
    _check(platform, tiles, dtypes=(torch.float32,), names=others, kernel_says=("acc0_0",))


def _check_split_weight(platform):
    """A product of 6 rows, forced onto the tiled kernel, by a weight bound as several windows, under
    the register tiles and, where the device has subgroups, the tiles sharing B across a subgroup."""
    tile_sets = [matmul.DEFAULT_TILES]
    if "subgroup" in platform.caps().get("features", []):
        tile_sets.append(matmul.SUBGROUP_CANDIDATES[0])
    with split_weight_linear(platform, 6, seed=11) as (graph, (x, w, bias)):
        want = torch.nn.functional.linear(x.double(), w.double(), bias.double())
        for tiles in tile_sets:
            with matmul.forced_tiles(tiles):
                program = platform.compile(graph)
            (product,) = [kern for kern in program.kernels if "acc0_0" in kern.wgsl]
            assert reads_windows_directly(product.wgsl), ("no window read directly", tiles)
            got = platform.run(program, [x, w, bias])[0]
            assert not got.isnan().any(), tiles
            atol = 1e-5 * SPLIT_WEIGHT[0] * float(x.abs().max() * w.abs().max())
            torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=atol,
                                       msg=f"{matmul.tiles_label(tiles)}, weight in windows")


(test_a_split_weight_is_read_window_by_window_by_the_tiled_kernel,
 test_a_split_weight_is_read_window_by_window_by_the_tiled_kernel_in_chromium) = on_every_webgpu(_check_split_weight)


@pytest.mark.device
@pytest.mark.xdist_group("wgpu")
def test_a_program_compiled_under_other_tiles_is_not_reused():
    """The tuner compiles one graph under each candidate: each must be that candidate's kernel
    (a compiled-program cache keyed by the graph alone once timed one kernel as all of them)."""
    platform = own_wgpu("vulkan")
    graph = _case("ragged-tiles", torch.float32)[0]
    seen = {}
    for tiles in (matmul.CANDIDATES[0], matmul.CANDIDATES[3], matmul.WORKGROUP_CANDIDATES[0]):
        with matmul.forced_tiles(tiles):
            seen[tiles] = platform.compile(graph).kernels[-1].workgroups
    assert len(set(seen.values())) == 3, seen


def test_a_cached_tile_choice_counts_only_when_it_is_a_candidate(tmp_path, monkeypatch):
    monkeypatch.setenv("TAPML_CACHE_DIR", str(tmp_path))
    caps = {"backend": "vulkan", "adapter": "llvmpipe"}
    key = matmul.device_key(caps)

    def cached(tiles):
        (tmp_path / "matmul-tiles.json").write_text(json.dumps({"format": 1, "devices": {key: {"tiles": tiles}}}))
        return matmul.tiles_for(caps, 512, 512)

    assert cached(list(matmul.WORKGROUP_CANDIDATES[2])) == matmul.WORKGROUP_CANDIDATES[2]
    assert cached([8, 32, 8, 1, 8]) == (8, 32, 8, 1, 8, 0)  # an entry written before the K tile existed
    for bad in ([8, 8, 8, 8, 0, 4096], [8, 16, 8, 4, 0, True], ["8"], None, [8, 16, 8, 4, 0, 0, 0]):
        assert cached(bad) == matmul.DEFAULT_TILES, bad
    assert matmul.tiles_for(caps, 8, 512) == matmul.SMALL_TILES
    # tiles tuned on 512 x 512 whose workgroup covers 128 rows: a 64-row output takes the fastest
    # timed candidate that fits it, and the tuned one where it fits
    table = {"8x32/16x1/sg8": 50.3, "8x32/8x1/sg8": 46.0, "4x32/8x1/sg8": 39.1, "16x16/8x2": 26.6, "4x4/8x8": "fast"}
    (tmp_path / "matmul-tiles.json").write_text(json.dumps({"format": 1, "devices": {key: {
        "tiles": [8, 32, 16, 1, 8, 0], "gflops": table}}}))
    assert matmul.workgroup_span((8, 32, 16, 1, 8, 0)) == (128, 32)
    assert matmul.tiles_for(caps, 64, 4096) == (8, 32, 8, 1, 8, 0)
    assert matmul.tiles_for(caps, 512, 512) == (8, 32, 16, 1, 8, 0)
    assert matmul.tiles_label(matmul.WORKGROUP_CANDIDATES[0]) == "4x4/16x16/wm16"
    for tiles in matmul.WORKGROUP_CANDIDATES:  # each fits the workgroup memory every WebGPU device has
        tm, tn, wx, wy, _, bk = tiles
        assert bk * (wy * tm + wx * tn) * 4 <= matmul.WORKGROUP_BYTES and wx * wy <= 256
