"""Device tier: every registered WGSL lowering against torch, on lavapipe Vulkan and llvmpipe GL.

The cases come from the registry itself (each entry's seeded sample inputs), so a new
lowering is tested the moment it is registered: every sample on lavapipe, the samples of each op's
first ``GL_FORMS`` kernel forms (edge values told apart) on llvmpipe GL. Needs a wgpu adapter;
skipped as a whole, with the reason, when there is none.
"""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tapml.judging.compare import compare_anchored, compare_tensor
from tapml.errors import PlatformError, Unsupported
from tapml.graph import Graph, Node, TensorMeta, run_node
from tapml.platforms.base import KernelProgram
from tapml.platforms.wgpu_native import available_backends, shared_platform
from tapml.platforms.wgsl import load_lowerings
from tapml.platforms.wgsl.registry import case_graph, sample_cases
from support import (GL_FORMS, INT_AND_BOOL, LOW, KernelForms, derived_dtype_cases, run_low_precision_samples,
                     sampled_dtypes)

BACKENDS = available_backends()
pytestmark = [pytest.mark.device,
              pytest.mark.skipif(not BACKENDS, reason="no wgpu adapter (install mesa-vulkan-drivers for lavapipe)")]
REGISTRY = load_lowerings()
OPS = sorted(REGISTRY)


def _platform(backend):
    if backend not in BACKENDS:
        pytest.skip(f"no {backend} adapter here (have: {', '.join(BACKENDS) or 'none'})")
    return shared_platform(backend)


@pytest.fixture(scope="session")
def vulkan():
    return _platform("vulkan")


@pytest.fixture(scope="session")
def gl():
    return _platform("gl")


def reference(graph: Graph, inputs):
    env = dict(zip([r for r, _ in graph.inputs], inputs))
    return run_node(graph.nodes[0], env.__getitem__)


def check_case(platform, graph, inputs, op, values=True, forms: KernelForms | None = None):
    """Compile and run one sample and judge it against torch (``forms``: skip a form already run)."""
    program = platform.compile(graph)
    if forms and not forms.is_new(program, inputs):
        return
    # what the compiler writes, the program's declared schema reads back (ProgramJSON, #37)
    assert KernelProgram.from_json(json.loads(program.dumps())).key == program.key, op
    out = platform.run(program, inputs)
    ref = reference(graph, inputs)
    assert len(out) == len(ref)
    for i, (o, r) in enumerate(zip(out, ref)):
        assert tuple(o.shape) == tuple(r.shape) and o.dtype == r.dtype, \
            f"{op} output {i}: {o.dtype}{list(o.shape)} != reference {r.dtype}{list(r.shape)}"
        if values:
            res = compare_tensor(o, r)
            assert res.passed, f"{op} output {i}: {res.message}; worst {res.worst}\ninputs: {[tuple(t.shape) for t in inputs]}"


def _run_registry_entry(platform, op, forms=None):
    torch.manual_seed(0)
    cases = sample_cases(op)
    assert cases, f"{op}: no sample fits its schema; give the registry entry samples"
    low = REGISTRY[op]
    ran = 0
    new_forms = KernelForms(forms)
    for graph, inputs in cases:
        check_case(platform, graph, inputs, op, values=low.compare_values, forms=new_forms)
        ran += 1
    assert ran, f"{op}: every sample was unsupported on {platform.name}"


@pytest.mark.parametrize("op", OPS)
def test_lowering_vulkan(vulkan, op):
    _run_registry_entry(vulkan, op)


# The same registry on GL: integer division, f16 and limits differ there (GLSL leaves / and %
# undefined for negative operands; llvmpipe GL has no shader-f16). GL runs the samples of each op's
# first GL_FORMS kernel forms (support.KernelForms), as the browser tier runs its first two: what
# GL can get wrong is the translation of a kernel's code, which another sample of one form repeats
# with other sizes; lavapipe runs every sample of every form.
@pytest.mark.parametrize("op", OPS)
def test_lowering_gl(gl, op):
    _run_registry_entry(gl, op, forms=GL_FORMS)


# --- float16 and bfloat16 -----------------------------------------------------------------
# Every lowering that claims a low-precision float runs its seeded samples (edge values
# included) cast to that dtype, judged fp64-anchored against torch's CPU result in the same
# dtype: Vulkan holds float16 natively (shader-f16), GL packed two per u32, bfloat16 is packed
# everywhere.

LOW_OPS = [op for op in OPS if set(REGISTRY[op].dtypes) & {"float16", "bfloat16"}]


@pytest.mark.parametrize("op", LOW_OPS)
def test_lowering_low_precision_vulkan(vulkan, op):
    run_low_precision_samples(vulkan, op)


@pytest.mark.parametrize("op", LOW_OPS)
def test_lowering_low_precision_gl(gl, op):
    run_low_precision_samples(gl, op, forms=GL_FORMS)


# --- integer and bool dtypes an entry claims without a sample of its own --------------------
# Each such dtype runs the entry's float samples turned into it (where torch takes them), exact.

# (Creation ops, whose dtype is an argument, and entries with no float sample are not derived here.)
DERIVED = [(op, d) for op in OPS for d in REGISTRY[op].dtypes
           if d in INT_AND_BOOL and d not in sampled_dtypes(op) and next(derived_dtype_cases(op, d), None)]


def _run_derived(platform, op, dtype, forms=None):
    ran = 0
    new_forms = KernelForms(forms)
    for graph, inputs, ref in derived_dtype_cases(op, dtype):
        program = platform.compile(graph)
        if not new_forms.is_new(program, inputs):
            continue
        out = platform.run(program, inputs)
        for i, (o, r) in enumerate(zip(out, ref)):
            assert tuple(o.shape) == tuple(r.shape) and o.dtype == r.dtype, f"{op} {dtype} output {i}: {o.dtype}"
            if REGISTRY[op].compare_values:
                res = compare_tensor(o, r)
                assert res.passed, f"{op} {dtype} output {i}: {res.message}; worst {res.worst}"
        ran += 1
    assert ran


@pytest.mark.parametrize("op,dtype", DERIVED)
def test_claimed_int_and_bool_dtypes_vulkan(vulkan, op, dtype):
    _run_derived(vulkan, op, dtype)


@pytest.mark.parametrize("op,dtype", DERIVED)
def test_claimed_int_and_bool_dtypes_gl(gl, op, dtype):
    _run_derived(gl, op, dtype, forms=GL_FORMS)


def test_low_precision_samples_exist():
    ran = [op for op in LOW_OPS if any(t.dtype == torch.float32 for _, ins in sample_cases(op) for t in ins)]
    assert len(ran) > 0.8 * len(LOW_OPS), "most low-precision lowerings must have float samples"


def _conversion_sweep():
    torch.manual_seed(0)
    bits = torch.randint(-2**31, 2**31 - 1, (100000,), dtype=torch.int64).to(torch.int32).view(torch.float32)
    near = torch.cat([torch.linspace(65000, 66000, 2001), torch.linspace(-1e-4, 1e-4, 20001),
                      torch.logspace(-9, -4, 5001), torch.tensor([2**-25, 2**-24, 1.5 * 2**-25, 0.0, -0.0, 3.4e38])])
    return torch.cat([bits, near, -near])


@pytest.mark.parametrize("dtype", LOW, ids=["float16", "bfloat16"])
@pytest.mark.parametrize("backend", ["vulkan", "gl"])
def test_rounding_to_low_precision_is_bit_exact(backend, dtype):
    """float32 -> float16/bfloat16 on the device rounds as torch does: to nearest even, to Inf
    past the largest finite value, through subnormals, NaN kept."""
    platform = _platform(backend)
    x = _conversion_sweep()
    graph, inputs = case_graph("aten._to_copy.default", [x], {"dtype": dtype})
    out = platform.run(platform.compile(graph), inputs)[0]
    ref = x.to(dtype)
    both_nan = torch.isnan(ref) & torch.isnan(out)
    differ = (out.view(torch.int16) != ref.view(torch.int16)) & ~both_nan
    assert int(differ.sum()) == 0, f"{int(differ.sum())} differ, e.g. {x[differ][:4].tolist()}"
    assert torch.isinf(out[x.abs() >= 65520]).all() if dtype == torch.float16 else True


def test_float16_without_shader_f16_is_packed(gl):
    """llvmpipe GL has no shader-f16: float16 lives two per u32 word and the WGSL never enables f16."""
    assert "shader-f16" not in gl.caps()["features"]
    assert gl.caps()["low_precision"]["float16"].startswith("packed")
    torch.manual_seed(4)
    graph, inputs = case_graph("aten.add.Tensor", [torch.randn(7).half(), torch.randn(7).half()])
    program = gl.compile(graph)
    assert {b.dtype for b in program.buffers} == {"f16p"}
    assert "enable f16" not in program.kernels[0].wgsl and "atomicOr" in program.kernels[0].wgsl
    out = gl.run(program, inputs)[0]
    assert out.dtype == torch.float16 and torch.equal(out, inputs[0] + inputs[1])


def test_odd_length_float16_output_keeps_poison_past_its_end(gl):
    """A packed store writes only its own half-word: an element no kernel wrote stays poison (NaN)."""
    graph, inputs = case_graph("aten.neg.default", [torch.randn(300).half()])
    program = gl.compile(graph)
    program.kernels[0].workgroups = (1, 1, 1)  # covers only the first 64 elements
    out = gl.run(program, inputs)[0]
    assert torch.isnan(out[64:]).all() and torch.equal(out[:64], -inputs[0][:64])


# --- runtime behaviour -------------------------------------------------------------------

def test_caps_report_limits_and_features(vulkan):
    caps = vulkan.caps()
    for key in ("max-storage-buffer-binding-size", "max-storage-buffers-per-shader-stage",
                "max-compute-workgroups-per-dimension", "max-compute-invocations-per-workgroup", "max-buffer-size"):
        assert caps["limits"][key] > 0
    assert caps["backend"] == "vulkan" and vulkan.name == "wgpu:vulkan"
    assert isinstance(caps["features"], list) and "float32" in caps["dtypes"]
    assert set(caps["low_precision"]) == {"float16", "bfloat16"} and "bfloat16" in caps["dtypes"]


def test_missing_backend_names_the_adapters():
    from tapml.errors import TapmlError
    from tapml.platforms.wgpu_native import WgpuPlatform
    missing = next((b for b in ("dx12", "metal") if b not in BACKENDS), None)
    if missing is None:
        pytest.skip("every backend exists here")
    with pytest.raises(TapmlError, match="adapters on this machine"):
        WgpuPlatform(missing)


def test_program_round_trips_through_json(vulkan):
    torch.manual_seed(2)
    graph, inputs = case_graph("aten.addmm.default", [torch.randn(8), torch.randn(5, 6), torch.randn(6, 8)])
    program = KernelProgram.from_json(vulkan.compile(graph).to_json())
    out = vulkan.run(program, inputs)
    assert compare_tensor(out[0], reference(graph, inputs)[0]).passed


def test_int64_that_does_not_fit_i32_runs_in_two_words(vulkan):
    graph, inputs = case_graph("aten.add.Tensor", [torch.tensor([1, 2**40]), torch.tensor([1, 1])])
    out = vulkan.run(vulkan.compile(graph), inputs)
    assert out[0].tolist() == [2, 2**40 + 1] and "x0" in vulkan.last_wide


def test_int_results_come_back_as_int64(vulkan):
    graph, inputs = case_graph("aten.cumsum.default", [torch.arange(10), 0])
    out = vulkan.run(vulkan.compile(graph), inputs)
    assert out[0].dtype == torch.int64 and torch.equal(out[0], torch.arange(10).cumsum(0))


def test_shader_compile_error_is_a_platform_error(vulkan):
    graph, inputs = case_graph("aten.neg.default", [torch.randn(4)])
    program = vulkan.compile(graph)
    program.kernels[0].wgsl = program.kernels[0].wgsl.replace("main", "main(", 1)
    with pytest.raises(PlatformError, match="WGSL"):
        vulkan.run(program, inputs)


def test_unwritten_outputs_show_as_poison(vulkan):
    graph, inputs = case_graph("aten.neg.default", [torch.randn(300)])
    program = vulkan.compile(graph)
    program.kernels[0].workgroups = (1, 1, 1)  # covers only the first 64 elements
    out = vulkan.run(program, inputs)[0]
    assert torch.isnan(out[64:]).all() and not torch.isnan(out[:64]).any()


def test_large_dispatch_uses_2d_grid(vulkan):
    n = 64 * 65535 + 1000
    graph, inputs = case_graph("aten.neg.default", [torch.randn(n)])
    program = vulkan.compile(graph)
    assert program.kernels[0].workgroups[1] > 1
    out = vulkan.run(program, inputs)[0]
    assert torch.equal(out, -inputs[0])


def test_fused_chain_runs_as_one_kernel(vulkan):
    torch.manual_seed(3)
    x = torch.randn(4, 16)
    nodes = [Node("a", "aten.mul.Tensor", [{"ref": "x"}, 0.5], {}, [TensorMeta((4, 16), "float32")]),
             Node("b", "aten.gelu.default", [{"ref": "a"}], {}, [TensorMeta((4, 16), "float32")]),
             Node("c", "aten.permute.default", [{"ref": "b"}, [1, 0]], {}, [TensorMeta((16, 4), "float32")]),
             Node("d", "aten.add.Tensor", [{"ref": "c"}, {"ref": "y"}], {}, [TensorMeta((16, 4), "float32")])]
    graph = Graph(inputs=[("x", TensorMeta((4, 16), "float32")), ("y", TensorMeta((4,), "float32"))],
                  nodes=nodes, outputs=["d"])
    y = torch.randn(4)
    program = vulkan.compile(graph)
    assert len(program.kernels) == 1
    out = vulkan.run(program, [x, y])[0]
    assert compare_tensor(out, torch.nn.functional.gelu(x * 0.5).t() + y).passed


# --- hypothesis: broadcasting and strided (view) inputs ----------------------------------

dims = st.integers(min_value=1, max_value=6)
shapes = st.lists(dims, min_size=1, max_size=4)


@st.composite
def broadcast_pair(draw):
    a = draw(shapes)
    b = [draw(st.sampled_from([1, s])) for s in a][draw(st.integers(0, len(a) - 1)):]
    if draw(st.booleans()):
        a, b = b, a
    return a, b


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(pair=broadcast_pair(), op=st.sampled_from(["aten.add.Tensor", "aten.mul.Tensor", "aten.sub.Tensor",
                                                  "aten.maximum.default", "aten.lt.Tensor"]),
       seed=st.integers(0, 2**16))
def test_broadcasting(vulkan, pair, op, seed):
    torch.manual_seed(seed)
    a, b = (torch.rand(*s) * 4 - 2 for s in pair)
    graph, inputs = case_graph(op, [a, b])
    check_case(vulkan, graph, inputs, op)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(shape=st.lists(st.integers(2, 6), min_size=2, max_size=4), data=st.data(), seed=st.integers(0, 2**16))
def test_strided_views_feed_elementwise(vulkan, shape, data, seed):
    """permute + slice + expand of an input, then mul and a where: read through strides."""
    torch.manual_seed(seed)
    nd = len(shape)
    perm = data.draw(st.permutations(range(nd)))
    x = torch.rand(*shape) * 4 - 2
    pshape = [shape[p] for p in perm]
    start = data.draw(st.integers(0, pshape[-1] - 1))
    sshape = pshape[:-1] + [pshape[-1] - start]
    y = torch.rand(sshape[-1]) + 0.5
    f = TensorMeta
    nodes = [Node("p", "aten.permute.default", [{"ref": "x"}, list(perm)], {}, [f(tuple(pshape), "float32")]),
             Node("s", "aten.slice.Tensor", [{"ref": "p"}, nd - 1, start, 2**62], {}, [f(tuple(sshape), "float32")]),
             Node("m", "aten.mul.Tensor", [{"ref": "s"}, {"ref": "y"}], {}, [f(tuple(sshape), "float32")]),
             Node("g", "aten.gt.Scalar", [{"ref": "m"}, 0.0], {}, [f(tuple(sshape), "bool")]),
             Node("w", "aten.where.self", [{"ref": "g"}, {"ref": "m"}, {"ref": "s"}], {}, [f(tuple(sshape), "float32")])]
    graph = Graph(inputs=[("x", f(tuple(shape), "float32")), ("y", f((sshape[-1],), "float32"))], nodes=nodes,
                  outputs=["w", "g"])
    out = vulkan.run(vulkan.compile(graph), [x, y])
    s = x.permute(*perm)[..., start:]
    m = s * y
    assert compare_tensor(out[0], torch.where(m > 0, m, s)).passed
    assert torch.equal(out[1], m > 0)


def test_pipeline_and_program_caches_are_capped(monkeypatch, vulkan):
    """A long-running device server compiles endless shapes: the caches drop the least recently
    used, and a dropped program's device buffers are released."""
    from tapml.graph import Graph, Node, TensorMeta
    monkeypatch.setattr(vulkan.programs, "max_entries", 3)
    monkeypatch.setattr(vulkan._pipelines, "max_entries", 3)
    prepared = []
    for n in range(1, 7):
        meta = TensorMeta((n,), "float32")
        graph = Graph(inputs=[("x", meta)], nodes=[Node("y", "aten.neg.default", [{"ref": "x"}], {}, [meta])],
                      outputs=["y"])
        x = torch.randn(n)
        program = vulkan.compile(graph)
        prepared.append(vulkan.prepared(program))
        (y,) = vulkan.run(program, [x])
        assert torch.equal(y, -x)
    assert len(vulkan._pipelines) <= 3 and len(vulkan.programs) <= 3
    assert prepared[0].buffers == {} and prepared[-1].buffers  # evicted: released; kept: still on the device
