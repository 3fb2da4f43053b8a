"""RMSNorm as one kernel (platforms/wgsl/norms.py), issue 34: the norm of transformers' Llama
family, exported from its own module code, compiled for a real adapter and compared with torch on
seeded random inputs: one row and several, rows longer than a workgroup's lanes and not a multiple
of them, more rows than two workgroups of one lane a row hold, large and small magnitudes. The
runtime poisons outputs, so an element the kernel skips shows. Device tier: lavapipe and llvmpipe; browser tier: Chromium."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from tapml.graph import graph_from_fx
from tests.support import exported, on_every_webgpu, own_wgpu

#: name -> (shape of x, scale of x)
CASES = {"decode-row": ((1, 1, 512), 1.0), "prefill-rows": ((1, 7, 200), 3.0), "long-row": ((2, 5000), 1e-3),
         "large-values": ((3, 64), 1e15), "one-element-rows": ((4, 1), 1.0),
         # a prefill's rows: on a CPU adapter one lane a row, 70 rows past two workgroups of 32
         "many-rows": ((1, 70, 200), 1.0),
         # rows of a length that is no multiple of 4: read and written an element at a time
         "rows-past-vec4s": ((3, 6, 30), 2.0)}


def _case(name: str):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    shape, scale = CASES[name]
    gen = torch.Generator().manual_seed(len(name))
    norm = LlamaRMSNorm(shape[-1], eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(shape[-1], generator=gen))
    x = torch.randn(*shape, generator=gen) * scale
    ep = exported(lambda x, w: (torch.func.functional_call(norm, {"weight": w}, (x,)),), x, norm.weight.detach())
    return graph_from_fx(ep.graph, ep.graph_signature), [x, norm.weight.detach()], norm(x).detach()


def _block_case(hidden: int, extra_reader: bool, columns: int = 48, rows: int = 1):
    """A decode row (or ``rows`` rows of a short prompt) through a Llama norm into q and k
    projections (one GEMV that computes the norm itself); ``extra_reader``: the normed rows are also
    an output, so their own kernel writes them; ``columns`` of q past ``COMPUTED_ROW_BLOCKS`` blocks
    (an LM head): the norm is written first."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    gen = torch.Generator().manual_seed(hidden + rows)
    norm = LlamaRMSNorm(hidden, eps=1e-5)
    x = torch.randn(1, rows, hidden, generator=gen) * 4
    x[0, 0, :3] = torch.tensor([1e4, -1e-30, 0.0])
    x[0, -1, :2] = torch.tensor([-3e3, 1e-20])
    w, wq, wk = torch.randn(hidden, generator=gen), torch.randn(columns, hidden, generator=gen), \
        torch.randn(20, hidden, generator=gen)

    def fn(x, w, wq, wk):
        h = torch.func.functional_call(norm, {"weight": w}, (x,))
        outs = (torch.nn.functional.linear(h, wq), torch.nn.functional.linear(h, wk))
        return outs + ((h,) if extra_reader else ())
    ep = exported(fn, x, w, wq, wk)
    return graph_from_fx(ep.graph, ep.graph_signature), [x, w, wq, wk], fn(x, w, wq, wk)


def _check_blocks(platform):
    # (hidden, normed rows also an output, columns, rows, kernels): the GEMV computes the norm, for
    # one row or a few (13: a block of 8 rows and a part-full one); an output, or a product the GEMV
    # does not take (K past vec4s, more rows than codegen.GEMV_ROWS), reads the rows the norm's own
    # kernel writes
    for hidden, extra, columns, rows, kernels in ((512, False, 48, 1, ["mm_gemv"]), (1000, False, 48, 1, ["mm_gemv"]),
                                                  (512, True, 48, 1, ["rms_norm", "mm_gemv"]),
                                                  (64, False, 5000, 1, ["rms_norm", "mm_gemv"]),
                                                  (998, False, 48, 1, ["rms_norm", "mm", "mm"]),
                                                  (200, False, 48, 13, ["mm_gemv"]),
                                                  (64, True, 48, 5, ["rms_norm", "mm_gemv"]),
                                                  (64, False, 48, 70, ["rms_norm", "mm", "mm"])):
        graph, inputs, want = _block_case(hidden, extra, columns, rows)
        program = platform.compile(graph)
        assert [k.name.rsplit("_", 1)[0] for k in program.kernels] == kernels, [k.name for k in program.kernels]
        for got, expected in zip(platform.run(program, inputs), want):
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-4 * float(expected.abs().max()),
                                       msg=f"hidden {hidden}, {rows} rows")


def _check_computed_rows(platform):
    """A row the norm kernel reads as it is computed (a decode step's embedding gather, a tiny value
    recomputed where it is read, as a decoder's first norm reads it): the gather is read an element
    at a time inside a four-element read."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    gen = torch.Generator().manual_seed(11)
    norm = LlamaRMSNorm(64, eps=1e-6)
    table, ids = torch.randn(50, 64, generator=gen), torch.randint(0, 50, (1, 1), generator=gen)

    def fn(table, ids, w):
        x = torch.nn.functional.embedding(ids, table)
        return (torch.func.functional_call(norm, {"weight": w}, (x,)),)
    inputs = [table, ids, torch.randn(64, generator=gen)]
    ep = exported(fn, *inputs)
    program = platform.compile(graph_from_fx(ep.graph, ep.graph_signature))
    assert [k.name.rsplit("_", 1)[0] for k in program.kernels] == ["rms_norm"], [k.name for k in program.kernels]
    torch.testing.assert_close(platform.run(program, inputs)[0], fn(*inputs)[0], rtol=1e-5, atol=1e-5)


def _check_long_rows_on_cpu_adapters(platform):
    """Several rows longer than ``LANE_ROW_K`` on a CPU adapter: a GEMV would add each row's squares
    through a barrier tree, so the norm's kernel writes the rows and the GEMV reads them, one lane a
    column group; one such row is still folded into the GEMV."""
    assert platform.caps().get("cpu_adapter")
    for rows, kernels in ((13, ["rms_norm", "mm_gemv"]), (1, ["mm_gemv"])):
        graph, inputs, want = _block_case(200, False, 48, rows)
        program = platform.compile(graph)
        assert [k.name.rsplit("_", 1)[0] for k in program.kernels] == kernels, [k.name for k in program.kernels]
        for got, expected in zip(platform.run(program, inputs), want):
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-4 * float(expected.abs().max()))


def _check(platform):
    from tapml.platforms.wgsl.matmul import forced_gemv
    for shape in ("split", "lane"):  # the norm's squares added across a workgroup, or by each lane alone
        with forced_gemv(shape):
            _check_blocks(platform)
    _check_long_rows_on_cpu_adapters(platform)
    _check_computed_rows(platform)
    for name in CASES:
        graph, inputs, want = _case(name)
        program = platform.compile(graph)
        assert [k.name.rsplit("_", 1)[0] for k in program.kernels] == ["rms_norm"], (name, [k.name for k in program.kernels])
        got = platform.run(program, inputs)[0]
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=name)


(test_rms_norm_is_one_kernel_equal_to_torch,
 test_rms_norm_is_one_kernel_equal_to_torch_in_chromium) = on_every_webgpu(_check)


def test_the_norm_is_found_only_where_it_may_be_folded():
    from tapml.platforms.wgsl.norms import find_rms_norms
    graph, _, _ = _case("decode-row")
    uses = Counter(r for n in graph.nodes for r in set(n.input_refs))
    (match,) = find_rms_norms(graph, uses, set(graph.outputs)).values()
    assert len(match.nodes) == 6 and match.eps == 1e-6
    # a node kept for comparison (here the mean) leaves the ops separate
    assert find_rms_norms(graph, uses, set(graph.outputs) | {match.nodes[1]}) == {}


@pytest.mark.device
@pytest.mark.xdist_group("wgpu")
def test_an_injected_fault_inside_the_norm_stays_visible():
    from tapml.driving.inject import InjectedPlatform, parse_faults
    graph, inputs, want = _case("prefill-rows")
    faulty = InjectedPlatform(own_wgpu("vulkan"), parse_faults(["aten.rsqrt.default=scale:2"]))
    program = faulty.compile(graph)
    assert not any(k.name.startswith("rms_norm") for k in program.kernels)
    torch.testing.assert_close(faulty.run(program, inputs)[0], want * 2, rtol=1e-5, atol=1e-5)
