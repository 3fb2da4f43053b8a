"""Fused decode attention (platforms/wgsl/attention.py) and the key/value put written in place
(platforms/wgsl/scatter.py put_in_place), issue 34.

The attention pattern is exported from the code transformers runs (matmul, scale, mask,
softmax, matmul, grouped-query heads expanded), compiled for a real adapter, run, and compared
with torch on seeded random inputs: one and several queries, keys in one chunk and in several,
masks of the dtype's minimum and of -inf, rows with every key masked, no mask, a divided scale,
values of another width than the keys, widths that are no multiple of 4 (the cache read an element
at a time, not as vec4s), rows sharing a workgroup, a prefill's query blocks (the last one
part-full), and the two-kernel form of a long cache. The puts of a prompt's positions written
in place are checked against torch's sequential put, repeated and negative positions included. The
runtime poisons outputs, so an element the kernels skip shows. Device tier: lavapipe and llvmpipe;
browser tier: Chromium."""

from __future__ import annotations

import pytest
import torch

from tapml.graph import graph_from_fx
from tests.support import attention_kernels, exported, on_every_webgpu, own_wgpu

MIN = torch.finfo(torch.float32).min


def _attention(q, k, v, mask, *, rep: int, scale: float, divide: bool = False):
    b, hkv, lk, d = k.shape
    k = k[:, :, None].expand(b, hkv, rep, lk, d).reshape(b, hkv * rep, lk, d)
    v = v[:, :, None].expand(b, hkv, rep, lk, v.shape[-1]).reshape(b, hkv * rep, lk, v.shape[-1])
    scores = torch.matmul(q, k.transpose(2, 3))
    scores = scores / (1 / scale) if divide else scores * scale
    if mask is not None:
        scores = scores + mask
    return torch.matmul(torch.softmax(scores, dim=-1), v)


def _case(seed: int, *, heads=4, rep=2, lq=1, lk=16, d=16, dv=16, mask="causal", divide=False):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, heads, lq, d, generator=gen) * 3
    k = torch.randn(1, heads // rep, lk, d, generator=gen)
    v = torch.randn(1, heads // rep, lk, dv, generator=gen)
    if mask is None:
        m = None
    elif mask == "causal":  # a decode step at position t of the cache: keys past t masked
        t = torch.randint(0, lk, (lq,), generator=gen)
        m = torch.where(torch.arange(lk)[None, :] <= t[:, None], 0.0, MIN)[None, None]
    elif mask == "random-inf":
        m = torch.where(torch.rand(1, 1, lq, lk, generator=gen) < 0.7, -float("inf"), torch.randn(1, 1, lq, lk, generator=gen))
        m[..., 0] = 0.0
    elif mask in ("all-min", "all-inf"):  # the first query row has no key at all
        m = torch.where(torch.rand(1, 1, lq, lk, generator=gen) < 0.5, 0.0, MIN)
        m[..., 0, :] = MIN if mask == "all-min" else -float("inf")
    else:
        raise ValueError(mask)
    inputs = [q, k, v] + ([m] if m is not None else [])

    def fn(*args):
        return (_attention(args[0], args[1], args[2], args[3] if m is not None else None, rep=rep,
                           scale=d ** -0.5, divide=divide),)
    ep = exported(fn, *inputs)
    return graph_from_fx(ep.graph, ep.graph_signature), inputs, fn(*inputs)[0]


CASES = {
    "decode-causal": dict(),
    "decode-one-key": dict(lk=1),
    "several-queries-several-chunks": dict(lq=3, lk=300, mask="random-inf"),
    "no-mask-divided-scale-wider-values": dict(lk=37, d=64, dv=32, mask=None, divide=True),
    "mha-long-cache": dict(heads=2, rep=1, lk=1000, d=64, dv=64),
    "row-all-minimum": dict(lq=2, lk=50, mask="all-min"),
    "row-all-inf": dict(lq=2, lk=50, mask="all-inf"),
    # short rows share a workgroup (21 rows of 3 chunks each), 80 rows over 4 workgroups, the last one partly
    "rows-sharing-workgroups": dict(heads=16, rep=4, lq=5, lk=300),
    # a prefill: blocks of QUERY_BLOCK queries share their key and value loads, the last block part-full
    "prefill-query-blocks": dict(lq=37, lk=300),
    "prefill-blocks-two-kernels": dict(heads=2, rep=1, lq=6, lk=3000, d=64, dv=64),
    # more chunks than a workgroup has lanes: the partial results and their combination in two kernels
    "two-kernels-long-cache": dict(heads=2, rep=1, lk=3000, d=64, dv=64, mask="random-inf"),
    # widths that are no multiple of 4: keys and values read an element at a time, not four a load
    "widths-past-vec4s": dict(lq=2, lk=40, d=10, dv=6, mask="all-min"),
    "keys-in-vec4s-values-not": dict(lk=40, d=12, dv=10),
}



def _check_cases(platform):
    from tapml.platforms.wgsl.attention import chunk_keys
    from tapml.platforms.wgsl.codegen import WORKGROUP
    assert {-(-kw.get("lk", 16) // chunk_keys(kw.get("d", 16), kw.get("dv", 16))) <= WORKGROUP
            for kw in CASES.values()} == {True, False}  # both forms are run
    for name, kw in CASES.items():
        graph, inputs, want = _case(len(name), **kw)
        program = platform.compile(graph)
        kernels = [k.name for k in program.kernels]
        one_kernel = -(-kw.get("lk", 16) // chunk_keys(kw.get("d", 16), kw.get("dv", 16))) <= WORKGROUP
        assert len(attention_kernels(kernels)) == (1 if one_kernel else 2), (name, kernels)
        assert not any(n.startswith(("bmm", "softmax")) for n in kernels), (name, kernels)
        got = platform.run(program, inputs)[0]
        assert got.shape == want.shape, name
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5, equal_nan=True, msg=name)
        # the cache rows, read through the grouped-query expand and the transpose, are four
        # elements a load where their width allows, and bound once
        wgsl = "".join(k.wgsl for k in program.kernels if attention_kernels([k.name]))
        key_in = program.inputs[1]
        vec4 = kw.get("d", 16) % 4 == 0 and platform.caps()["backend"] != "gl"  # GL: compile time (attention.py)
        assert (f"buf_{key_in}_v4:" in wgsl) == vec4, name
        assert not (f"buf_{key_in}_v4:" in wgsl and f"buf_{key_in}:" in wgsl), name
        if kw.get("mask") == "all-inf":
            assert got[0, :, 0].isnan().all() and not got[0, :, 1].isnan().any(), name


(test_fused_attention_equals_torch,
 test_fused_attention_equals_torch_in_chromium) = on_every_webgpu(_check_cases)


def test_the_pattern_is_found_only_where_it_may_be_folded():
    from collections import Counter

    from tapml.platforms.wgsl.attention import find_attention
    graph, _, _ = _case(0)
    uses = Counter(r for n in graph.nodes for r in set(n.input_refs))
    found = find_attention(graph, uses, set(graph.outputs))
    assert len(found) == 1
    match = next(iter(found.values()))
    op_of = {n.name: n.op for n in graph.nodes}
    ops = [op_of[n] for n in match.nodes]
    assert ops[-1] == "aten.bmm.default" and "aten._softmax.default" in ops and ops.count("aten.bmm.default") == 2
    softmax = next(n for n in graph.nodes if n.op == "aten._softmax.default")
    # an intermediate the caller keeps (an output, a comparison point) leaves the ops separate
    assert find_attention(graph, uses, set(graph.outputs) | {softmax.name}) == {}
    from tapml.platforms.wgsl.attention import FEW_QUERIES, MAX_QUERIES

    def found(**kw) -> bool:
        g, _, _ = _case(0, **kw)
        return bool(find_attention(g, Counter(r for n in g.nodes for r in set(n.input_refs)), set(g.outputs)))
    # a prefill into a longer cache is fused; self-attention of many queries (an encoder, a forward
    # without a cache) and more queries than MAX_QUERIES keep the separate ops
    assert found(lq=FEW_QUERIES + 8, lk=64) and not found(lq=FEW_QUERIES + 8, lk=FEW_QUERIES + 8)
    assert not found(lq=FEW_QUERIES + 8, lk=64, mask=None) and found(lq=FEW_QUERIES, lk=FEW_QUERIES, mask=None)
    assert not found(lq=MAX_QUERIES + 1, lk=MAX_QUERIES + 8)


@pytest.mark.device
@pytest.mark.xdist_group("wgpu")
def test_an_injected_fault_inside_the_pattern_stays_visible():
    """``--inject`` puts an op after the faulty node: the pattern is broken there, the ops compile
    separately, and the fault changes the result."""
    from tapml.driving.inject import InjectedPlatform, parse_faults
    platform = own_wgpu("vulkan")
    graph, inputs, want = _case(3)
    faulty = InjectedPlatform(platform, parse_faults(["aten._softmax.default=scale:1.5"]))
    program = faulty.compile(graph)
    assert not attention_kernels(k.name for k in program.kernels)
    got = faulty.run(program, inputs)[0]
    torch.testing.assert_close(got, want * 1.5, rtol=1e-4, atol=1e-5)


@pytest.mark.device
@pytest.mark.xdist_group("wgpu")
def test_the_cache_put_of_a_decode_step_writes_one_row_in_place():
    """A graph input that only an index_put of one position reads is written in place: the program
    lists that input's buffer as the output, and the run returns the whole updated cache."""
    platform = own_wgpu("vulkan")
    cache = torch.randn(1, 2, 64, 8)
    pos = torch.tensor([5])
    row = torch.randn(1, 2, 1, 8)
    ep = exported(lambda c, p, r: (torch.ops.aten.index_put.default(c, [None, None, p], r),), cache, pos, row)
    graph = graph_from_fx(ep.graph, ep.graph_signature)
    program = platform.compile(graph)
    assert program.outputs[0] == program.inputs[0]
    assert [k.name for k in program.kernels] == ["put_in_place_0"]
    want = cache.clone()
    want[:, :, 5] = row[:, :, 0]
    assert torch.equal(platform.run(program, [cache, pos, row])[0], want)


def _check_prompt_puts(platform):
    """Several positions (a prefill's prompt) are put in place too; where one repeats, the last
    entry wins, as in torch's sequential put (and tapml's lazy put)."""
    gen = torch.Generator().manual_seed(7)
    cache = torch.randn(1, 2, 64, 8, generator=gen)
    put = (lambda c, p, r: (torch.ops.aten.index_put.default(c, [None, None, p], r),))
    for positions in (torch.arange(3, 40), torch.tensor([5, 9, 5, -1, 63, 9, 0]), torch.randint(0, 64, (100,), generator=gen)):
        rows = torch.randn(1, 2, len(positions), 8, generator=gen)
        ep = exported(put, cache, positions, rows)
        program = platform.compile(graph_from_fx(ep.graph, ep.graph_signature))
        assert program.outputs[0] == program.inputs[0]
        assert [k.name for k in program.kernels][-1].endswith("put_in_place_0"), [k.name for k in program.kernels]
        want = cache.clone()
        for i, at in enumerate(positions.tolist()):  # one entry after another: the last one wins
            want[:, :, at] = rows[:, :, i]
        assert torch.equal(platform.run(program, [cache, positions, rows])[0], want), positions


(test_prompt_puts_in_place_equal_torch,
 test_prompt_puts_in_place_equal_torch_in_chromium) = on_every_webgpu(_check_prompt_puts)
