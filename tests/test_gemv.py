"""One-row products (platforms/wgsl/matmul.py ``_gemv``), issue 34: a decode step's linears and LM
head, exported from ``F.linear`` (so the weight reaches ``mm``/``addmm`` as a transposed view, read
along K), compiled for a real adapter and compared with torch on seeded random inputs, and the residual
add after a linear that the product writes (``find_residual_products``). Shapes put K and the
columns past whole vec4s and lane groups; one case has more columns than one dispatch dimension
holds workgroups. The runtime poisons outputs, so a column the kernel skips shows.
Device tier: lavapipe and llvmpipe; browser tier: Chromium."""

from __future__ import annotations

import dataclasses
import re
from functools import cache

import pytest
import torch

from tapml.graph import graph_from_fx
from tests.support import (SPLIT_WEIGHT, exported, on_every_webgpu, own_wgpu, reads_windows_directly,
                           split_weight_linear)

#: name -> (batch: 0 for a linear, else a bmm of that many products; K; columns; bias; rows)
CASES = {
    "decode-linear": (0, 64, 96, False, 1),
    "k-past-lane-groups": (0, 300, 37, True, 1),
    "edge-values": (0, 36, 70, False, 1),
    "batched-rows-of-one": (3, 40, 45, True, 1),
    "many-columns": (0, 8, 2_200_000, False, 1),
    # a short prompt: a block of matmul.GEMV_ROW_BLOCK rows and a part-full one, each weight load
    # serving every row of its block
    "rows-in-blocks": (0, 64, 96, True, 13),
    "batched-rows": (2, 40, 21, True, 9),
}


@cache  # an export each: built once per process, for both GEMV shapes and every platform
def _case(name: str):
    batch, k, n, bias, rows = CASES[name]
    gen = torch.Generator().manual_seed(len(name))
    x = torch.randn(max(batch, 1), rows, k, generator=gen)
    if name == "edge-values":  # large, tiny, subnormal and signed-zero operands
        x[0, 0, :6] = torch.tensor([1e20, -1e20, 1e-40, -0.0, 3.4e18, -3.4e18])
    w = torch.randn(*([batch] if batch else []), n, k, generator=gen)
    inputs = [x, w] + ([torch.randn(n, generator=gen)] if bias else [])

    def fn(*args):
        if batch:
            return (torch.matmul(args[0], args[1].transpose(1, 2)) + (args[2] if bias else 0),)
        return (torch.nn.functional.linear(*args),)
    ep = exported(fn, *inputs)
    return graph_from_fx(ep.graph, ep.graph_signature), inputs, fn(*inputs)[0]


@cache
def _group_case(rows: int, plain_partner: bool = False):
    """Three linears of one input, as q, k and v are (``plain_partner``: the third multiplies by a
    matrix stored K-major, which the GEMV does not read)."""
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(1, rows, 64, generator=gen)
    wq, wk = torch.randn(96, 64, generator=gen), torch.randn(40, 64, generator=gen)
    wv = torch.randn(64, 33, generator=gen) if plain_partner else torch.randn(33, 64, generator=gen)

    def fn(x, wq, wk, wv):
        v = x @ wv if plain_partner else torch.nn.functional.linear(x, wv)
        return (torch.nn.functional.linear(x, wq).relu(), torch.nn.functional.linear(x, wk) * 2, v)
    ep = exported(fn, x, wq, wk, wv)
    return graph_from_fx(ep.graph, ep.graph_signature), [x, wq, wk, wv], fn(x, wq, wk, wv)


def _check_groups(platform):
    # (rows, third weight K-major, GEMV kernels, tiled product kernels): past codegen.GEMV_ROWS rows,
    # three tiled products
    for rows, plain, gemv, tiled in ((1, False, 1, 0), (1, True, 1, 1), (5, False, 1, 0), (11, True, 1, 1),
                                     (70, False, 0, 3)):
        graph, inputs, want = _group_case(rows, plain)
        program = platform.compile(graph)
        names = [k.name for k in program.kernels if k.name.startswith("mm")]
        assert sum("_gemv" in n for n in names) == gemv and len(names) == gemv + tiled, (rows, plain, names)
        for got, expected in zip(platform.run(program, inputs), want):
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-4)


@cache
def _mlp_case(rows: int, dtype=torch.float32):
    """A Llama MLP: ``down(silu(gate(x)) * up(x))``, whose one-row ``silu * up`` the down projection's
    GEMV computes as it reads it."""
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(1, rows, 64, generator=gen).to(dtype)
    wg, wu, wd = (torch.randn(*s, generator=gen).to(dtype) for s in ((88, 64), (88, 64), (48, 88)))
    x[0, 0, :4] = torch.tensor([30.0, -30.0, 1e-30, -0.0])  # sigmoid's saturated and tiny arguments

    def fn(x, wg, wu, wd):
        f = torch.nn.functional
        return (f.linear(f.silu(f.linear(x, wg)) * f.linear(x, wu), wd),)
    ep = exported(fn, x, wg, wu, wd)
    return graph_from_fx(ep.graph, ep.graph_signature), [x, wg, wu, wd], fn(x, wg, wu, wd)[0]


def _check_mlp(platform):
    # (rows, dtype, kernels): a row, or a few, of float32: gate/up as one GEMV, the down projection
    # computing silu * up; of float16: gate and up apart (groups are float32), the gate's float32 copy
    # that silu reads twice written, the down projection computing the rest; more rows than
    # codegen.GEMV_ROWS: two tiled products, the elementwise product written, the down projection.
    # Without shader-f16 (GL) float16 is stored packed, which the GEMV does not read: then silu * up
    # is written for the tiled kernel.
    for rows, dtype, kernels in ((1, torch.float32, 2), (1, torch.float16, 4), (3, torch.float32, 2),
                                 (70, torch.float32, 4)):
        graph, inputs, want = _mlp_case(rows, dtype)
        program = platform.compile(graph)
        if program.buffers[0].dtype == "f16p":
            kernels += 1
        assert len(program.kernels) == kernels, (rows, dtype, [k.name for k in program.kernels])
        got = platform.run(program, inputs)[0]
        # float32 sums of K = 88 terms of up to 1e4 in another order: the error follows the largest output
        tol = dict(rtol=1e-5, atol=1e-3 + 1e-6 * float(want.abs().max())) if dtype == torch.float32 else \
            dict(rtol=1e-2, atol=0.5)
        torch.testing.assert_close(got, want, **tol, msg=f"{rows} rows, {dtype}")


def _small_values_case():
    """A one-element position used by several readers, as a decode step's cache position is: each
    reader computes it (no kernel of its own); the mask of 40 positions it also makes is larger work."""
    pos, a, b = torch.tensor([5]), torch.randn(40), torch.randn(40)

    def fn(pos, a, b):
        p = pos + 1
        return (a * p, b - p, torch.arange(40) <= p)
    ep = exported(fn, pos, a, b)
    return graph_from_fx(ep.graph, ep.graph_signature), [pos, a, b], fn(pos, a, b)


def _check_small_values(platform):
    graph, inputs, want = _small_values_case()
    program = platform.compile(graph)
    # three bodies (one per output; none for p), which then run as one dispatch (merge_independent)
    assert sum(len(k.name.split("+")) for k in program.kernels) == 3, [k.name for k in program.kernels]
    for got, expected in zip(platform.run(program, inputs), want):
        torch.testing.assert_close(got, expected)


def _check(platform):
    from tapml.platforms.wgsl.matmul import forced_gemv
    for shape in ("split", "lane"):  # lanes splitting K (GPUs), one lane a column group (CPU adapters)
        with forced_gemv(shape):
            _check_shape(platform)
            _check_split_weight(platform)
    _check_small_values(platform)


def _check_split_weight(platform):
    for rows in (1, 5):
        with split_weight_linear(platform, rows, seed=rows) as (graph, (x, w, bias)):
            program = platform.compile(graph)
            (gemv,) = [kern for kern in program.kernels if "_gemv" in kern.name]
            assert reads_windows_directly(gemv.wgsl), "no window read directly"
            got, want = platform.run(program, [x, w, bias])[0], torch.nn.functional.linear(x, w, bias)
            atol = 1e-5 * SPLIT_WEIGHT[0] * float(x.abs().max() * w.abs().max())
            torch.testing.assert_close(got, want, rtol=1e-5, atol=atol, msg=f"{rows} rows, weight in windows")


def _check_shape(platform):
    _check_mlp(platform)
    for name in CASES:
        graph, inputs, want = _case(name)
        program = platform.compile(graph)
        assert any("_gemv" in k.name for k in program.kernels), (name, [k.name for k in program.kernels])
        got = platform.run(program, inputs)[0]
        assert got.shape == want.shape and not got.isnan().any(), name
        # float32 sums in another order: the error follows K and the operands' size
        atol = 1e-5 * CASES[name][1] * float(inputs[0].abs().max() * inputs[1].abs().max())
        torch.testing.assert_close(got, want, rtol=1e-5, atol=atol, msg=name)
    _check_residual(platform)
    _check_groups(platform)


(test_one_row_products_and_residual_folds_equal_torch,
 test_one_row_products_and_residual_folds_equal_torch_in_chromium) = on_every_webgpu(_check)


@pytest.mark.device
@pytest.mark.xdist_group("wgpu")
def test_many_rows_and_large_products_keep_the_tiled_kernel():
    """A GEMV reads each weight once per row: past codegen.GEMV_ROWS rows, or GEMV_ROWS_MACS
    multiply-adds, the tiled kernel (each weight once per tile of rows) takes the product."""
    from tapml.platforms.wgsl.codegen import GEMV_ROWS, GEMV_ROWS_MACS, gemv_rows
    assert gemv_rows(1, 4096, 128256) and gemv_rows(16, 64, 64)
    assert not gemv_rows(GEMV_ROWS + 1, 64, 64) and not gemv_rows(4, 1024, GEMV_ROWS_MACS // 4096 + 1)
    assert not gemv_rows(4, 64, 8)  # too narrow: most lanes of a row block would idle
    platform = own_wgpu("vulkan")
    gen = torch.Generator().manual_seed(3)
    for (m, k, n), gemv in (((GEMV_ROWS + 1, 64, 32), False), ((4, 1024, 1024), False), ((16, 64, 32), True)):
        x, w = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen)
        ep = exported(lambda a, b: (torch.nn.functional.linear(a, b),), x, w)
        program = platform.compile(graph_from_fx(ep.graph, ep.graph_signature))
        assert any("_gemv" in kk.name for kk in program.kernels) == gemv, (m, k, n)
        torch.testing.assert_close(platform.run(program, [x, w])[0], x @ w.t(), rtol=1e-5, atol=1e-3)


@cache
def _normed_case(rows: int):
    """A Llama RMSNorm into a linear, as q/k/v read a short prompt: the GEMV computes each row's
    scale and the normed row as it reads it."""
    gen = torch.Generator().manual_seed(rows)
    x, g, w = torch.randn(1, rows, 64, generator=gen) * 3, torch.rand(64, generator=gen) + 0.5, torch.randn(72, 64, generator=gen)

    def fn(x, g, w):
        normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * g
        return (torch.nn.functional.linear(normed, w),)
    ep = exported(fn, x, g, w)
    return graph_from_fx(ep.graph, ep.graph_signature), [x, g, w], fn(x, g, w)[0]


@pytest.mark.device
@pytest.mark.xdist_group("wgpu")
def test_rows_shared_through_the_subgroup_and_the_branch_for_a_small_subgroup_equal_torch():
    """On lavapipe (subgroups of 8) a GEMV over a few rows has each row read (plain), normed or
    computed (silu(gate) * up) once per subgroup and broadcast; a device whose subgroups are smaller
    than the rows takes the other branch, where every lane reads every row. That branch is run here
    too, by asking for more lanes than any subgroup has."""
    from tapml.platforms.wgsl.matmul import forced_gemv
    platform = own_wgpu("vulkan")
    if "subgroup" not in platform.caps().get("features", []):
        pytest.skip("the adapter has no subgroups")
    cases = [("rows-in-blocks", *_case("rows-in-blocks")), ("batched-rows", *_case("batched-rows")),
             ("normed 6 rows", *_normed_case(6)), ("normed 13 rows", *_normed_case(13)),
             ("silu(gate) * up, 3 rows", *_mlp_case(3))]
    with forced_gemv("lane"):
        for name, graph, inputs, want in cases:
            program = platform.compile(graph)
            (gemv, *_) = [kern for kern in program.kernels if "_gemv" in kern.name and "subgroupBroadcast" in kern.wgsl]
            branch = re.search(r"if \(sg_size >= (\d+)u\)", gemv.wgsl)
            assert branch and 1 < int(branch.group(1)) <= 8, name
            small = dataclasses.replace(program, kernels=[
                dataclasses.replace(kern, wgsl=kern.wgsl.replace(branch.group(0), "if (sg_size >= 4096u)"))
                for kern in program.kernels])
            atol = 1e-5 * 100 * float(max(t.abs().max() for t in inputs)) ** 2
            for label, run in (("shared rows", program), ("small subgroups", small)):
                got = platform.run(run, inputs)[0]
                torch.testing.assert_close(got, want, rtol=1e-5, atol=atol, msg=f"{name}: {label}")


@cache
def _residual_case(rows: int, seed: int = 0):
    """``h + linear(x, w)``: a residual connection after a linear, as a decoder layer ends."""
    gen = torch.Generator().manual_seed(seed)
    h, x, w = torch.randn(1, rows, 48, generator=gen), torch.randn(1, rows, 40, generator=gen), torch.randn(48, 40, generator=gen)
    ep = exported(lambda h, x, w: (h + torch.nn.functional.linear(x, w),), h, x, w)
    return graph_from_fx(ep.graph, ep.graph_signature), [h, x, w], h + torch.nn.functional.linear(x, w)


def _check_residual(platform):
    for rows in (1, 5):  # the GEMV and the tiled product both add the residual as they store
        graph, inputs, want = _residual_case(rows)
        program = platform.compile(graph)
        assert len(program.kernels) == 1, (rows, [k.name for k in program.kernels])
        torch.testing.assert_close(platform.run(program, inputs)[0], want, rtol=1e-5, atol=1e-4)



@pytest.mark.device
@pytest.mark.xdist_group("wgpu")
def test_the_residual_fold_leaves_kept_and_injected_values_visible():
    """A product kept for comparison, or an injected fault after it, keeps the product and the add
    apart, so the fault shows in the product's own value."""
    from tapml.driving.inject import InjectedPlatform, parse_faults
    from tapml.platforms.wgsl.matmul import find_residual_products
    from collections import Counter
    platform = own_wgpu("vulkan")
    graph, inputs, want = _residual_case(1, seed=1)
    uses = Counter(r for n in graph.nodes for r in set(n.input_refs))
    (match,) = find_residual_products(graph, uses, set(graph.outputs)).values()
    assert find_residual_products(graph, uses, set(graph.outputs) | {match.mm.name}) == {}
    faulty = InjectedPlatform(platform, parse_faults(["aten.mm.default=scale:2"]))
    program = faulty.compile(graph)
    assert len(program.kernels) > 1
    h, x, w = inputs
    torch.testing.assert_close(faulty.run(program, inputs)[0], h + 2 * torch.nn.functional.linear(x, w),
                               rtol=1e-5, atol=1e-4)


def test_a_split_weight_is_read_window_by_window_where_a_block_fits_one():
    from types import SimpleNamespace
    from tapml.platforms.wgsl.codegen import Binding
    from tapml.platforms.wgsl.matmul import window_runs
    k, n, limit = SPLIT_WEIGHT
    weight = SimpleNamespace(offset=0, strides=(0, 1, k))  # [N, K] read along K, as F.linear's weight
    split = Binding("buf_w_v4", split=True, per_window=limit // 16)
    # 409.6 rows a window: blocks of 256 columns, 0 in window 0, 1 across the boundary, 2 in window 1, ...
    runs = window_runs(split, weight, n, 256, k, 1)
    assert runs[:3] == [(0, 1), (None, 2), (1, 3)] and runs[-1][1] == 8
    assert {w for w, _ in runs} == {0, 1, 3, 4, None}  # no block lies wholly in window 2
    assert window_runs(Binding("buf_w_v4"), weight, n, 256, k, 1) == [(None, 8)]  # bound whole
    assert split.window(2)["i + 4"] == f"buf_w_v4_w2[(i + 4) - {2 * limit // 16}]"
    assert split.window(0)["i"] == "buf_w_v4_w0[i]"


def test_a_cpu_adapter_gets_one_lane_a_column_where_the_row_is_cheap():
    from tapml.platforms.wgsl.codegen import LANE_GROUP, LANE_ROW_K, WORKGROUP
    from tapml.platforms.wgsl.matmul import GEMV_COLUMNS, GEMV_LANES, forced_gemv, gemv_shape
    cpu, gpu = {"cpu_adapter": True}, {"cpu_adapter": False}
    split = (GEMV_LANES, WORKGROUP // GEMV_LANES, GEMV_COLUMNS)
    assert gemv_shape(gpu, False, 512, 4096) == split and gemv_shape(None, True, 64, 64) == split
    assert gemv_shape(cpu, False, 4096, 100) == (1, LANE_GROUP, 4)
    assert gemv_shape(cpu, False, 512, 128_256) == (1, LANE_GROUP, 8)  # wide: 8 columns share each row load
    assert gemv_shape(cpu, True, LANE_ROW_K, 64)[0] == 1  # a short normed row: each lane adds its squares
    assert gemv_shape(cpu, True, LANE_ROW_K + 4, 64) == split  # a long one: the workgroup adds them
    with forced_gemv("lane"):
        assert gemv_shape(gpu, True, 4096, 64)[0] == 1
    with forced_gemv("split"):
        assert gemv_shape(cpu, False, 64, 64) == split
    with pytest.raises(ValueError, match="'lane' or 'split'"):
        with forced_gemv("wide"):
            pass
