"""Long rows: no kernel loops past LOOP_BUDGET iterations per invocation, whatever the row length.

Fast tier: every reduction, scan, norm, softmax and convolution family compiled (not run) on rows
past lavapipe's loop cap of 65 535, each kernel's counted loop iterations within the budget; the
lowerings that still loop over a data length are listed (and must still do so, or leave the list).
Device tier (lavapipe Vulkan, llvmpipe GL): the same cases run against torch on seeded inputs with
NaN, Inf and ties, float32, float16 and bfloat16 (integers and bools where the op takes them),
outputs poisoned before the run (platforms/base.py); the loop-cap probe measures 65 535; the
preflight lists a kernel that still goes past it, and a mismatch of one says why.
"""

from __future__ import annotations

import math

import pytest
import torch

from tapml.judging.compare import compare_anchored, compare_tensor
from tapml.graph import run_node
from tapml.platforms.base import LOOP_PROBE_ITERATIONS
from tapml.platforms.wgsl import compile_graph
from tapml.platforms.wgsl.codegen import CHUNK, LOOP_BUDGET
from tapml.platforms.wgsl.registry import case_graph
from tapml.driving.preflight import check_program
from support import LOW, LOW_FLOORS, low_precision_case

CAPS = {"features": ["shader-f16"], "limits": {}}
#: Past lavapipe's cap of 65 535, a multiple of neither CHUNK nor the workgroup size (7 x 10 001).
L = 70007
LAVAPIPE_CAP = 65535


def _rows(n: int = L) -> torch.Tensor:
    """Three rows: plain, with +-Inf, with a NaN (seeded)."""
    g = torch.Generator().manual_seed(n)
    x = torch.randn(3, n, generator=g)
    x[1, n // 3], x[1, n // 2] = math.inf, -math.inf
    x[2, n - 5] = math.nan
    return x


def _ties(n: int = L) -> torch.Tensor:
    """Two rows of few distinct values (ties everywhere) as floats."""
    g = torch.Generator().manual_seed(n + 1)
    return torch.randint(-3, 4, (2, n), generator=g).float()


def _finite(n: int = L) -> torch.Tensor:
    g = torch.Generator().manual_seed(n + 2)
    return torch.randn(2, n, generator=g)


def _masked(n: int = L) -> torch.Tensor:
    """Two rows of scores with -inf where an attention mask hides them: leading, and scattered."""
    g = torch.Generator().manual_seed(n + 3)
    x = torch.randn(2, n, generator=g) * 4
    x[0, :5000] = -math.inf
    x[1, torch.randperm(n, generator=g)[:n // 3]] = -math.inf
    return x


def _conv(cin: int, transposed: bool = False, groups: int = 1, dtype=torch.float32):
    g = torch.Generator().manual_seed(cin)
    if transposed:  # weight (Cin, Cout/groups, k): each output sums Cin/groups x k terms
        x, w = torch.randn(1, cin, 9, generator=g), torch.randn(cin, 3, 33, generator=g) * 0.05
        return [x, w, torch.randn(3, generator=g), [1], [0], [1], True, [0], groups]
    if dtype != torch.float32:
        x = torch.randint(-20, 20, (1, cin, 70, 1), generator=g, dtype=dtype)
        w = torch.randint(-20, 20, (4, cin // groups, 64, 1), generator=g, dtype=dtype)
        return [x, w, None, [1, 1], [0, 0], [1, 1], False, [0, 0], groups]
    x, w = torch.randn(1, cin, 70, 1, generator=g), torch.randn(4, cin // groups, 64, 1, generator=g) * 0.05
    return [x, w, torch.randn(4, generator=g), [1, 1], [0, 0], [1, 1], False, [0, 0], groups]


#: (id, op, args) of every long-row family; float cases also run in float16 on the device.
LONG = [
    ("sum", "aten.sum.dim_IntList", lambda: [_rows(), [1]]),
    ("sum-all", "aten.sum.default", lambda: [_finite()]),
    ("sum-int", "aten.sum.dim_IntList", lambda: [_ties().long(), [1]]),
    ("mean", "aten.mean.dim", lambda: [_rows(), [1]]),
    ("mean-dim0", "aten.mean.dim", lambda: [_finite().T.contiguous(), [0], True]),
    ("prod", "aten.prod.dim_int", lambda: [1 + _finite() * 1e-5, 1]),
    ("amax", "aten.amax.default", lambda: [_rows(), [1]]),
    ("amin", "aten.amin.default", lambda: [_rows(), [1]]),
    ("argmax-ties", "aten.argmax.default", lambda: [_ties(), 1]),
    ("argmax-edges", "aten.argmax.default", lambda: [_rows(), 1]),
    ("argmin-ties", "aten.argmin.default", lambda: [_ties(), 1]),
    ("max-dim", "aten.max.dim", lambda: [_ties(), 1]),
    ("min-dim", "aten.min.dim", lambda: [_rows(), 1, True]),
    ("any", "aten.any.dim", lambda: [_finite() > 4.2, 1]),
    ("all", "aten.all.dim", lambda: [_finite() > -4.2, 1]),
    ("var", "aten.var.correction", lambda: [_rows() * 10 + 100, [1]]),
    ("var-mean", "aten.var_mean.correction", lambda: [_finite() + 50, [1]]),
    ("std-dim", "aten.var.dim", lambda: [_finite(), [1], False]),
    ("norm-2", "aten.linalg_vector_norm.default", lambda: [_rows(), 2, [1]]),
    ("norm-inf", "aten.linalg_vector_norm.default", lambda: [_rows(), math.inf, [1]]),
    ("norm-3", "aten.linalg_vector_norm.default", lambda: [_finite(), 3, [1]]),
    ("cumsum", "aten.cumsum.default", lambda: [_ties(), 1]),
    ("cumsum-dim0", "aten.cumsum.default", lambda: [_ties().T.contiguous(), 0]),
    ("cumprod", "aten.cumprod.default", lambda: [1 + _finite() * 1e-5, 1]),
    ("cummax", "aten.cummax.default", lambda: [_rows(), 1]),
    ("cummin-ties", "aten.cummin.default", lambda: [_ties().int(), 1]),
    ("logcumsumexp", "aten.logcumsumexp.default", lambda: [_finite(), 1]),
    ("softmax", "aten._softmax.default", lambda: [_rows() * 4, 1, False]),
    ("softmax-dim0", "aten._softmax.default", lambda: [_finite().T.contiguous(), 0, False]),
    ("softmax-masked", "aten._softmax.default", lambda: [_masked(), 1, False]),
    ("log-softmax", "aten._log_softmax.default", lambda: [_rows() * 4, 1, False]),
    ("log-softmax-masked", "aten._log_softmax.default", lambda: [_masked(), 1, False]),
    ("layer-norm", "aten.native_layer_norm.default", lambda: [_finite() * 3 + 1, [L], torch.randn(L), torch.randn(L), 1e-5]),
    ("layer-norm-2d", "aten.native_layer_norm.default", lambda: [_finite().reshape(2, 7, L // 7), [7, L // 7], None, None, 1e-5]),
    ("group-norm", "aten.native_group_norm.default",
     lambda: [_finite().reshape(2, 7, L // 7), torch.randn(7), torch.randn(7), 2, 7, L // 7, 1, 1e-5]),
    ("batch-norm-train", "aten._native_batch_norm_legit.no_stats",
     lambda: [_finite().reshape(2, 7, L // 7).transpose(0, 1).contiguous() * 2 + 1, torch.randn(2), torch.randn(2), True, 0.1,
              1e-5]),
    ("batch-norm-running", "aten._native_batch_norm_legit_functional.default",
     lambda: [_finite().reshape(2, 7, L // 7).transpose(0, 1).contiguous(), None, None, torch.zeros(2), torch.ones(2), True,
              0.1, 1e-5]),
    ("conv", "aten.convolution.default", lambda: [*_conv(1100)]),
    ("conv-groups", "aten.convolution.default", lambda: [*_conv(2200, groups=2)]),
    ("conv-int", "aten.convolution.default", lambda: [*_conv(1100, dtype=torch.int32)]),
    ("conv-transpose", "aten.convolution.default", lambda: [*_conv(2200, transposed=True)]),
]

#: Lowerings that still loop over a data length in one invocation (not split yet): the preflight
#: lists them where a device stops loops. (id, op, args, loop iterations at that size.)
UNSPLIT = [
    ("bincount", "aten.bincount.default", lambda: [torch.randint(0, 3, (L,))]),
    ("mm-long-k", "aten.mm.default", lambda: [torch.randn(2, 4 * L), torch.randn(4 * L, 2)]),
    ("layer-norm-backward", "aten.native_layer_norm_backward.default",
     lambda: [torch.randn(2, L), torch.randn(2, L), [L], torch.zeros(2, 1), torch.ones(2, 1), torch.randn(L), torch.randn(L),
              [True, True, True]]),
    ("conv-backward", "aten.convolution_backward.default",
     lambda: [torch.randn(1, 4, L, 1), torch.randn(1, 3, L + 2, 1), torch.randn(4, 3, 3, 1), [4], [1, 1], [0, 0], [1, 1],
              False, [0, 0], 1, [True, True, True]]),
]


def _iterations(op, args) -> list:
    graph, _ = case_graph(op, args())
    return [k.loop_iterations for k in compile_graph(graph, CAPS).kernels]


@pytest.mark.parametrize("name,op,args", LONG, ids=[c[0] for c in LONG])
def test_long_rows_stay_within_the_loop_budget(name, op, args):
    iterations = _iterations(op, args)
    assert iterations and all(i is not None for i in iterations), f"{name}: a loop the compiler did not count: {iterations}"
    # a split pass may fold one partial state before its CHUNK elements (scans)
    assert max(iterations) <= LOOP_BUDGET + 1, f"{name}: {iterations}"
    assert len(iterations) > 1, f"{name}: one kernel, so nothing was split: {iterations}"


@pytest.mark.parametrize("name,op,args", UNSPLIT, ids=[c[0] for c in UNSPLIT])
def test_unsplit_lowerings_are_counted_past_the_cap(name, op, args):
    """Each still loops past lavapipe's cap at these sizes; once split, it moves to LONG."""
    assert max(_iterations(op, args)) > LAVAPIPE_CAP, f"{name} is within the budget now: move it to LONG"


def test_short_rows_keep_one_kernel():
    graph, _ = case_graph("aten.sum.dim_IntList", [torch.randn(4, CHUNK), [1]])
    (kernel,) = compile_graph(graph, CAPS).kernels
    assert kernel.loop_iterations == CHUNK


def test_kernel_iterations_cross_json():
    from tapml.platforms.base import Kernel
    graph, _ = case_graph("aten.cumsum.default", [torch.randn(2, L), 1])
    for kern in compile_graph(graph, CAPS).kernels:
        assert Kernel.from_json(kern.to_json()) == kern
    with pytest.raises(ValueError, match="loop_iterations"):
        Kernel.from_json({**kern.to_json(), "loop_iterations": -1})


# --- device tier -----------------------------------------------------------------------------

def _backends():
    from tapml.platforms.wgpu_native import available_backends
    return available_backends()


def _platform(backend):
    from tapml.platforms.wgpu_native import shared_platform
    if backend not in _backends():
        pytest.skip(f"no wgpu {backend} adapter (install mesa-vulkan-drivers and libegl-mesa0)")
    return shared_platform(backend)


def _run(platform, graph, inputs):
    env = dict(zip([r for r, _ in graph.inputs], inputs))
    ref = run_node(graph.nodes[0], env.__getitem__)
    return platform.run(platform.compile(graph), inputs), list(ref) if isinstance(ref, (list, tuple)) else [ref]


DEVICE = [pytest.mark.device, pytest.mark.xdist_group("wgpu")]


@pytest.mark.parametrize("backend", [pytest.param(b, marks=DEVICE) for b in ("vulkan", "gl")])
@pytest.mark.parametrize("name,op,args", LONG, ids=[c[0] for c in LONG])
def test_long_rows_match_torch(backend, name, op, args):
    platform = _platform(backend)
    inputs = args()
    graph, tensors = case_graph(op, inputs)
    out, ref = _run(platform, graph, tensors)
    for i, (o, r) in enumerate(zip(out, ref)):
        assert o.dtype == r.dtype and o.shape == r.shape, f"{name} output {i}: {o.dtype}{list(o.shape)}"
        res = compare_tensor(o, r)
        assert res.passed, f"{name} output {i} on {backend}: {res.message}; worst {res.worst}"
    if not any(t.dtype == torch.float32 for t in tensors) or op == "aten.prod.dim_int":
        return  # integer cases; a product of 70 007 factors near 1 is no low-precision case
    for dtype in LOW:
        case = low_precision_case(graph, tensors, dtype)
        if case is None:
            continue
        g, low, ref_low, ref64 = case
        for r_low, r64 in zip(ref_low, ref64):
            # torch's own float16 CPU convolution returns NaN now and then where float64 is finite
            # (seen run to run on the same inputs): the float64 result, rounded, stands in there
            bad = torch.isnan(r_low) & ~torch.isnan(r64)
            r_low[bad] = r64[bad].to(r_low.dtype)
        out = platform.run(platform.compile(g), low)
        res = compare_anchored(out, ref_low, ref64, floor=LOW_FLOORS[dtype])
        assert res.passed, f"{name} {dtype} on {backend}: {res.message}; worst {res.worst}"


@pytest.mark.parametrize("backend", [pytest.param(b, marks=DEVICE) for b in ("vulkan", "gl")])
def test_loop_cap_probe_measures_the_device(backend):
    platform = _platform(backend)
    cap = platform.loop_limits()["loop_cap"]
    if "llvmpipe" in platform.caps()["adapter"]:
        assert cap == LAVAPIPE_CAP
    else:  # another device: no cap found, or one past what tapml's kernels ask for
        assert cap is None or LOOP_BUDGET < cap < LOOP_PROBE_ITERATIONS
    from tapml.driving.replay import device_info
    assert device_info(platform)["loop_cap"] == cap


@pytest.mark.device
@pytest.mark.xdist_group("wgpu")
def test_preflight_lists_a_kernel_past_the_cap():
    platform = _platform("vulkan")
    cap = platform.loop_limits()["loop_cap"]
    if cap is None:
        pytest.skip("this device stops no loop")
    name, op, args = UNSPLIT[0]
    graph, _ = case_graph(op, args())
    found = check_program(platform.compile(graph), platform.caps(), cap)
    (violation,) = [v for v in found.violations if v.limit == "loop-iterations"]
    assert violation.value > cap and violation.allowed == cap and "loop_cap" in violation.describe()
    graph, _ = case_graph(LONG[0][1], LONG[0][2]())
    assert not check_program(platform.compile(graph), platform.caps(), cap).violations


@pytest.mark.device
@pytest.mark.xdist_group("wgpu")
def test_a_kernel_past_the_cap_is_cut_short_and_the_mismatch_says_why():
    """mm is not split: with K/4 = 70 007 iterations per invocation lavapipe returns truncated
    sums, and replay's note names the kernel and the cap."""
    from tapml.driving.replay import loop_cap_note
    platform = _platform("vulkan")
    if platform.loop_limits()["loop_cap"] != LAVAPIPE_CAP:
        pytest.skip("not a device that stops loops at 65 535")
    name, op, args = UNSPLIT[1]
    graph, inputs = case_graph(op, args())
    program = platform.compile(graph)
    out, ref = _run(platform, graph, inputs)
    assert not compare_tensor(out[0], ref[0]).passed
    note = loop_cap_note(platform, program)
    assert "70007 times" in note and str(LAVAPIPE_CAP) in note and program.kernels[0].name in note
    graph, _ = case_graph(LONG[0][1], LONG[0][2]())
    assert loop_cap_note(platform, platform.compile(graph)) == ""
