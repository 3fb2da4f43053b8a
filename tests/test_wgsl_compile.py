"""Compile-only tier: WGSL codegen without any adapter (runs everywhere, fast).

Golden shaders live in tests/golden/*.wgsl; regenerate them after an intended codegen change
with ``TAPML_UPDATE_GOLDEN=1 pytest tests/test_wgsl_compile.py``.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch

from tapml.errors import PlatformError, Unsupported
from tapml.graph import Graph, Node, TensorMeta
from tapml.platforms.base import KernelProgram
from tapml.platforms.wgsl import compile_graph, load_lowerings, supports
from tapml.platforms.wgsl.registry import case_graph, sample_cases
from tapml.platforms.wgsl.tensors import from_device, to_device
from support import INT_AND_BOOL, derived_dtype_cases, sampled_dtypes

GOLDEN = Path(__file__).parent / "golden"
LIMITS = {"max-storage-buffer-binding-size": 134217728, "max-storage-buffers-per-shader-stage": 8,
          "max-compute-workgroups-per-dimension": 65535, "max-compute-invocations-per-workgroup": 256,
          "max-buffer-size": 268435456}
VULKAN = {"adapter": "test", "backend": "vulkan", "features": ["shader-f16"], "limits": LIMITS, "dtypes": []}
GL = {"adapter": "test-gl", "backend": "gl", "features": [], "limits": LIMITS, "dtypes": []}
REGISTRY = load_lowerings()
M = TensorMeta


def graph_of(inputs, nodes, outputs):
    return Graph(inputs=[(n, M(tuple(s), d)) for n, s, d in inputs], nodes=nodes, outputs=outputs)


def node(name, op, args, shape, dtype="float32", kwargs=None):
    return Node(name, op, args, kwargs or {}, [M(tuple(shape), dtype)])


def assert_well_formed(program: KernelProgram, caps: dict):
    names = {b.name for b in program.buffers}
    limit = caps["limits"]["max-storage-buffers-per-shader-stage"]
    for k in program.kernels:
        assert len(k.bindings) <= limit, f"{k.name} binds {len(k.bindings)} > {limit}"
        assert all(n in names for n, _ in k.bindings)
        assert all(1 <= g <= 65535 for g in k.workgroups)
        assert "@compute" in k.wgsl and "fn main" in k.wgsl
        decl = re.findall(r"@binding\((\d+)\)", k.wgsl)
        assert decl == [str(i) for i in range(len(k.bindings))]
    assert set(program.inputs) <= names and set(program.outputs) <= names


# --- every lowering compiles without a device --------------------------------------------

#: Lowerings with a loop whose trip count the compiler does not count (Kernel.loop_iterations is
#: None): pooling and resampling windows, segments and bags bounded by the data, binary searches,
#: sort stages. The preflight cannot hold them to a device's loop cap (ARCHITECTURE.md, "Long
#: reductions and the loop cap"); every other lowering's kernels count every loop.
UNCOUNTED_LOOPS = frozenset({
    "aten._adaptive_avg_pool2d.default", "aten._adaptive_avg_pool2d_backward.default", "aten._adaptive_avg_pool3d.default",
    "aten._embedding_bag.default", "aten._embedding_bag_forward_only.default", "aten._pdist_forward.default",
    "aten._unique2.default", "aten._upsample_bicubic2d_aa.default", "aten._upsample_bicubic2d_aa.vec",
    "aten._upsample_bilinear2d_aa.default", "aten._upsample_bilinear2d_aa.vec", "aten.adaptive_avg_pool1d.default",
    "aten.adaptive_max_pool2d.default", "aten.adaptive_max_pool3d.default", "aten.avg_pool1d.default",
    "aten.avg_pool2d.default", "aten.avg_pool2d_backward.default", "aten.avg_pool3d.default", "aten.bucketize.Scalar",
    "aten.bucketize.Tensor", "aten.fractional_max_pool2d.default", "aten.fractional_max_pool3d.default",
    "aten.histc.default", "aten.kthvalue.default", "aten.max_pool2d_with_indices_backward.default",
    "aten.max_pool3d_with_indices.default", "aten.median.default", "aten.median.dim", "aten.mode.default",
    "aten.multinomial.default", "aten.nanmedian.default", "aten.nanmedian.dim", "aten.randperm.default",
    "aten.searchsorted.Scalar", "aten.searchsorted.Tensor", "aten.segment_reduce.default", "aten.sort.default",
    "aten.sort.stable", "aten.topk.default", "aten.unique_consecutive.default"})

@pytest.mark.parametrize("op", sorted(REGISTRY))
def test_every_lowering_compiles_for_vulkan_and_gl_caps(op):
    torch.manual_seed(0)
    cases = sample_cases(op)
    assert cases, f"{op} has no sample that fits its schema"
    uncounted = 0
    for graph, _ in cases:
        program = compile_graph(graph, VULKAN)
        assert_well_formed(program, VULKAN)
        gl = compile_graph(graph, GL)  # no shader-f16: float16 is packed two per u32
        assert_well_formed(gl, GL)
        assert not any("enable f16" in k.wgsl for k in gl.kernels)
        uncounted += sum(k.loop_iterations is None for k in program.kernels)
    if op in UNCOUNTED_LOOPS:
        assert uncounted, f"{op} counts all its loops now: take it out of UNCOUNTED_LOOPS"
    else:
        assert not uncounted, f"{op}: a kernel loops without a trip count (KernelBuilder.loop, or open(header, trips))"


@pytest.mark.parametrize("op", sorted(REGISTRY))
def test_every_claimed_dtype_has_a_case(op):
    """An entry's samples hold every dtype it claims (in an input or an output), or, for an
    integer or bool dtype, its float samples turned into it give a case torch accepts (the device
    tier runs those: tests/test_wgsl_ops.py)."""
    seen = sampled_dtypes(op)
    missing = [d for d in REGISTRY[op].dtypes
               if d not in seen and not (d in INT_AND_BOOL and next(derived_dtype_cases(op, d), None))]
    assert not missing, f"{op} claims {missing} but no sample holds them"


def test_registry_covers_the_ops_transformer_and_cnn_models_use():
    needed = """add.Tensor sub.Tensor mul.Tensor div.Tensor div.Tensor_mode remainder.Tensor floor_divide.default
    pow.Tensor_Scalar pow.Tensor_Tensor pow.Scalar eq.Tensor ne.Scalar lt.Tensor le.Tensor gt.Tensor ge.Scalar
    where.self sum.dim_IntList mean.dim amax.default any.dim cumsum.default prod.default max.dim argmax.default
    mm.default bmm.default addmm.default _softmax.default _log_softmax.default native_layer_norm.default
    embedding.default gather.default index.Tensor cat.default slice.Tensor select.int split.Tensor
    split_with_sizes.default permute.default expand.default view.default _unsafe_view.default unsqueeze.default
    squeeze.dim clone.default _to_copy.default alias.default t.default transpose.int arange.default arange.start
    arange.start_step full.default full_like.default scalar_tensor.default zeros_like.default ones_like.default
    empty_like.default convolution.default max_pool2d_with_indices.default avg_pool2d.default
    _native_batch_norm_legit_no_training.default gelu.default silu.default tanh.default sigmoid.default
    relu.default rsqrt.default sqrt.default sin.default cos.default exp.default log.default log1p.default
    neg.default abs.default reciprocal.default erf.default bitwise_and.Tensor bitwise_or.Tensor
    bitwise_not.default logical_not.default logical_and.default logical_or.default clamp.default
    minimum.default maximum.default""".split()
    missing = [op for op in needed if f"aten.{op}" not in REGISTRY]
    assert not missing


# --- golden WGSL -------------------------------------------------------------------------

def _golden_graphs():
    x, w, b = ("x", (4, 16), "float32"), ("w", (8, 16), "float32"), ("b", (8,), "float32")
    return {
        "fused_chain": graph_of([x, ("y", (16,), "float32")], [
            node("m", "aten.mul.Tensor", [{"ref": "x"}, 0.5], (4, 16)),
            node("a", "aten.add.Tensor", [{"ref": "m"}, {"ref": "y"}], (4, 16)),
            node("g", "aten.gelu.default", [{"ref": "a"}], (4, 16))], ["g"]),
        "linear": graph_of([x, w, b], [
            node("wt", "aten.t.default", [{"ref": "w"}], (16, 8)),
            node("mm", "aten.addmm.default", [{"ref": "b"}, {"ref": "x"}, {"ref": "wt"}], (4, 8))], ["mm"]),
        "softmax": graph_of([x], [node("s", "aten._softmax.default", [{"ref": "x"}, -1, False], (4, 16))], ["s"]),
        "embedding": graph_of([("ids", (2, 3), "int64"), ("table", (10, 16), "float32")], [
            node("e", "aten.embedding.default", [{"ref": "table"}, {"ref": "ids"}], (2, 3, 16))], ["e"]),
        "mean_keepdim": graph_of([x], [node("r", "aten.mean.dim", [{"ref": "x"}, [-1], True], (4, 1))], ["r"]),
    }


@pytest.mark.parametrize("name", sorted(_golden_graphs()))
def test_golden_wgsl(name):
    program = compile_graph(_golden_graphs()[name], VULKAN)
    text = "\n".join(f"// kernel {k.name} workgroups={list(k.workgroups)} bindings={k.bindings}\n{k.wgsl}"
                     for k in program.kernels)
    path = GOLDEN / f"{name}.wgsl"
    if os.environ.get("TAPML_UPDATE_GOLDEN") or not path.exists():
        GOLDEN.mkdir(exist_ok=True)
        path.write_text(text)
    assert text == path.read_text(), f"WGSL for {name} changed; if intended, rerun with TAPML_UPDATE_GOLDEN=1"


# --- fusion, views, intermediates --------------------------------------------------------

def test_elementwise_chain_fuses_into_one_kernel():
    program = compile_graph(_golden_graphs()["fused_chain"], VULKAN)
    assert len(program.kernels) == 1
    assert [b.role for b in program.buffers].count("temp") == 0


def test_views_are_strides_not_copies():
    g = graph_of([("x", (2, 3, 4), "float32")], [
        node("p", "aten.permute.default", [{"ref": "x"}, [2, 0, 1]], (4, 2, 3)),
        node("s", "aten.slice.Tensor", [{"ref": "p"}, 2, 1, 3], (4, 2, 2)),
        node("u", "aten.unsqueeze.default", [{"ref": "s"}, 0], (1, 4, 2, 2)),
        node("e", "aten.expand.default", [{"ref": "u"}, [3, 4, 2, 2]], (3, 4, 2, 2)),
        node("n", "aten.neg.default", [{"ref": "e"}], (3, 4, 2, 2))], ["n"])
    program = compile_graph(g, VULKAN)
    assert len(program.kernels) == 1  # the neg kernel reads x through strides
    assert [b.role for b in program.buffers] == ["input", "output"]


def test_matmul_reads_transposed_weight_in_place():
    program = compile_graph(_golden_graphs()["linear"], VULKAN)
    assert len(program.kernels) == 1 and "vec4<f32>" in program.kernels[0].wgsl


def test_value_used_twice_is_computed_once():
    """...unless it is tiny (at most RECOMPUTED_NUMEL elements, cheap): then each reader computes it."""
    from tapml.platforms.wgsl import RECOMPUTED_NUMEL

    def program_of(n):
        g = graph_of([("x", (n,), "float32")], [
            node("e", "aten.exp.default", [{"ref": "x"}], (n,)),
            node("a", "aten.add.Tensor", [{"ref": "e"}, 1.0], (n,)),
            node("m", "aten.mul.Tensor", [{"ref": "e"}, 2.0], (n,))], ["a", "m"])
        return compile_graph(g, VULKAN)
    program = program_of(RECOMPUTED_NUMEL + 1)
    assert sum(k.wgsl.count("exp(") for k in program.kernels) == 1
    assert any(b.role == "temp" for b in program.buffers)
    program = program_of(RECOMPUTED_NUMEL)
    assert sum(k.wgsl.count("exp(") for k in program.kernels) == 2
    assert not any(b.role == "temp" for b in program.buffers)


def test_fusion_respects_binding_limit():
    caps = {**VULKAN, "limits": {**LIMITS, "max-storage-buffers-per-shader-stage": 4}}
    inputs = [(f"x{i}", (5,), "float32") for i in range(7)]
    nodes, prev = [], "x0"
    for i in range(1, 7):
        nodes.append(node(f"a{i}", "aten.add.Tensor", [{"ref": prev}, {"ref": f"x{i}"}], (5,)))
        prev = f"a{i}"
    program = compile_graph(graph_of(inputs, nodes, [prev]), caps)
    assert_well_formed(program, caps)
    assert len(program.kernels) > 1


def test_cat_of_many_inputs_stays_within_binding_limit():
    torch.manual_seed(0)
    graph, _ = case_graph("aten.cat.default", [[torch.randn(2, 3) for _ in range(12)], 0])
    program = compile_graph(graph, VULKAN)
    assert_well_formed(program, VULKAN)


def test_large_tensor_uses_2d_dispatch():
    n = 64 * 70000
    g = graph_of([("x", (n,), "float32")], [node("n", "aten.neg.default", [{"ref": "x"}], (n,))], ["n"])
    (k,) = compile_graph(g, VULKAN).kernels
    assert k.workgroups[0] <= 65535 and k.workgroups[1] == 2


def test_program_key_is_a_content_hash():
    g = _golden_graphs()["linear"]
    a, b = compile_graph(g, VULKAN), compile_graph(g, VULKAN)
    assert a.key == b.key == KernelProgram.from_json(a.to_json()).key
    assert a.key != compile_graph(_golden_graphs()["softmax"], VULKAN).key


# --- honest types and limits -------------------------------------------------------------

def test_float64_is_unsupported_with_reason():
    graph, _ = case_graph("aten.add.Tensor", [torch.randn(3, dtype=torch.float64), torch.randn(3, dtype=torch.float64)])
    with pytest.raises(Unsupported, match="float64: WGSL has no 64-bit floats"):
        compile_graph(graph, VULKAN)
    assert "float64" in supports(graph.nodes[0], VULKAN)


def test_float16_is_native_with_shader_f16_and_packed_without():
    graph, _ = case_graph("aten.mul.Tensor", [torch.randn(3).half(), torch.randn(3).half()])
    native = compile_graph(graph, VULKAN)
    assert native.buffers[0].dtype == "f16" and "enable f16;" in native.kernels[0].wgsl
    packed = compile_graph(graph, GL)
    assert {b.dtype for b in packed.buffers} == {"f16p"} and "enable f16" not in packed.kernels[0].wgsl
    assert "unpack2x16float" in packed.kernels[0].wgsl and "atomic<u32>" in packed.kernels[0].wgsl
    assert packed.buffers[0].size == 8  # three 2-byte elements, rounded up to a whole u32 word


def test_bfloat16_is_packed_everywhere():
    graph, _ = case_graph("aten.mul.Tensor", [torch.randn(3).bfloat16(), torch.randn(3).bfloat16()])
    for caps in (VULKAN, GL):
        program = compile_graph(graph, caps)
        assert {b.dtype for b in program.buffers} == {"bf16p"} and "tap_bf16_bits" in program.kernels[0].wgsl


def test_buffer_over_binding_size_is_split_into_windows():
    caps = {**VULKAN, "limits": {**LIMITS, "max-storage-buffer-binding-size": 1024,
                                 "min-storage-buffer-offset-alignment": 256}}
    graph, _ = case_graph("aten.neg.default", [torch.randn(1000)])
    program = compile_graph(graph, caps)
    (kern,) = program.kernels
    windows = [b[2:] for b in kern.bindings]
    # 4000 bytes in, 4000 out: each through windows of 1024 bytes at 256-aligned offsets
    assert windows == [(0, 1024), (1024, 1024), (2048, 1024), (3072, 928)] * 2
    assert "fn buf_" in kern.wgsl and "_set(" in kern.wgsl


def test_buffer_over_max_buffer_size_is_held_in_parts_or_unsupported_naming_the_limit():
    graph, _ = case_graph("aten.neg.default", [torch.randn(1000)])
    over_buffer = {**VULKAN, "limits": {**LIMITS, "max-buffer-size": 2048}}
    program = compile_graph(graph, over_buffer)  # 4000 bytes: two parts of at most 2048 (tests/test_parts.py runs them)
    assert [(b.name, b.size) for b in program.buffers] == [("i0.p0", 2048), ("i0.p1", 1952), ("o1.p0", 2048), ("o1.p1", 1952)]
    assert [(t.name, t.parts) for t in program.parts] == [("i0", [("i0.p0", 0, 512), ("i0.p1", 512, 488)]),
                                                          ("o1", [("o1.p0", 0, 512), ("o1.p1", 512, 488)])]
    one_window = {**VULKAN, "limits": {**LIMITS, "max-buffer-size": 128, "min-storage-buffer-offset-alignment": 256}}
    with pytest.raises(Unsupported, match="max-buffer-size"):
        compile_graph(graph, one_window)  # not even one 256-byte-aligned window fits a buffer
    huge = graph_of([("x", (1 << 16, 1 << 15), "float32")], [node("n", "aten.neg.default", [{"ref": "x"}], (1 << 16, 1 << 15))], ["n"])
    with pytest.raises(Unsupported, match="2\\*\\*31"):
        compile_graph(huge, VULKAN)  # 8 GiB could be held in parts, but i32 element indices cannot reach it
    few_bindings = {**VULKAN, "limits": {**LIMITS, "max-storage-buffer-binding-size": 256,
                                         "max-storage-buffers-per-shader-stage": 8}}
    with pytest.raises(Unsupported, match="max-storage-buffers-per-shader-stage"):
        compile_graph(graph, few_bindings)


def test_unknown_op_reason():
    n = Node("n", "aten.fft_fft.default", [{"ref": "x"}], {}, [M((4,), "float32")])
    assert "no WGSL lowering" in supports(n, VULKAN)
    with pytest.raises(Unsupported, match="no WGSL lowering"):
        compile_graph(graph_of([("x", (4,), "float32")], [n], ["n"]), VULKAN)


def test_lowering_failure_is_a_platform_error():
    n = Node("n", "aten.permute.default", [{"ref": "x"}, [0, 7]], {}, [M((4, 4), "float32")])
    with pytest.raises(PlatformError, match="permute"):
        compile_graph(graph_of([("x", (4, 4), "float32")], [n], ["n"]), VULKAN)


def test_int64_upload_checks_range_and_round_trips():
    t = torch.tensor([-5, 0, 2**31 - 1])
    assert torch.equal(from_device(to_device(t, "i32"), "i32", M((3,), "int64")), t)
    with pytest.raises(Unsupported, match="does not fit in i32"):
        to_device(torch.tensor([2**31]), "i32", "ids")


def test_bool_is_one_u32_per_element():
    t = torch.tensor([True, False, True])
    data = to_device(t, "u32")
    assert len(data) == 12 and torch.equal(from_device(data, "u32", M((3,), "bool")), t)


@pytest.mark.parametrize("storage,dtype", [("f32", torch.float32), ("f16", torch.float16), ("f16p", torch.float16),
                                           ("bf16p", torch.bfloat16), ("i32", torch.int64), ("u32", torch.bool)])
def test_chunked_upload_bytes_are_the_whole_upload(storage, dtype):
    from tapml.platforms.wgsl.tensors import to_device_chunks
    g = torch.Generator().manual_seed(3)
    t = (torch.randn(7, 13, generator=g) * 100).to(dtype)  # 91 elements: an odd count, a padded last chunk
    whole = to_device(t, storage)
    for chunk_bytes in (8, 12, 64, 1 << 20):
        parts = list(to_device_chunks(t, storage, "w", chunk_bytes))
        joined = bytearray(len(whole))
        for offset, data in parts:
            assert offset % 4 == 0  # write_buffer needs 4-byte offsets: packed halves never split
            joined[offset:offset + len(data)] = data
        assert bytes(joined) == whole and parts[-1][0] + len(parts[-1][1]) == len(whole)


def test_page_out_keeps_the_values_of_a_memory_mapped_tensor(tmp_path):
    import mmap
    import os
    from tapml.platforms.wgsl.tensors import page_out
    t = torch.randn(1 << 20, generator=torch.Generator().manual_seed(0))
    (tmp_path / "w.bin").write_bytes(t.numpy().tobytes())
    fd = os.open(tmp_path / "w.bin", os.O_RDONLY)
    mapped = torch.frombuffer(mmap.mmap(fd, 4 << 20, access=mmap.ACCESS_COPY), dtype=torch.float32)
    os.close(fd)
    mapped[:5] = 7.0  # a private change (a copy-on-write page) survives too
    page_out(mapped)
    assert torch.equal(mapped[5:], t[5:]) and bool((mapped[:5] == 7).all())
