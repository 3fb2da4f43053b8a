"""Workgroup folds (platforms/wgsl/folds.py, issue #35 item 1): on a GPU the rows of a reduction
are folded by workgroups, whose lanes fold interleaved elements and then each other's states in
workgroup memory through a barrier tree; a long row's parts are folded by merge passes.

Fast tier: the rule (a device known not to be a CPU adapter and rows of ``WORKGROUP_FOLD_K`` or
more; ``forced_fold`` overrides it), the kernels it compiles, and that CPU adapters and caps that
do not say keep one invocation a row. Device tier (lavapipe Vulkan, llvmpipe GL) and Chromium: all
three are CPU adapters here, so the form is forced. Every lowering that folds runs its registry
samples (edge values on the native adapters, float32, float16, bfloat16, and the int and bool
dtypes it claims; in Chromium the samples of its first kernel forms, support.KernelForms) and the
long rows of test_long_rows' reduction families (float16 and bfloat16 on Vulkan) against torch,
outputs poisoned before each run (platforms/base.py).
"""

from __future__ import annotations

import functools

import pytest
import torch

from support import (BROWSER_FORMS, INT_AND_BOOL, LOW, LOW_FLOORS, KernelForms, derived_dtype_cases, finite_normal,
                     low_precision_case, on_every_webgpu, run_low_precision_samples, sampled_dtypes)
from tapml.errors import Unsupported
from tapml.graph import run_node
from tapml.judging.compare import compare_anchored, compare_tensor
from tapml.platforms.wgsl import compile_graph, load_lowerings
from tapml.platforms.wgsl.codegen import WORKGROUP
from tapml.platforms.wgsl.folds import LANE_FOLD, WORKGROUP_FOLD_K, forced_fold, workgroup_fold
from tapml.platforms.wgsl.registry import case_graph, sample_cases

GPU = {"features": ["shader-f16"], "limits": {}, "cpu_adapter": False}
CPU = {**GPU, "cpu_adapter": True}
#: Long rows past CHUNK x LANE_FOLD parts: families of test_long_rows that fold (its scans do not).
SCANS = ("cumsum", "cumprod", "cummax", "cummin", "logcumsumexp")


def _folds(program) -> bool:
    return any("fold_seen" in k.wgsl for k in program.kernels)


@functools.cache
def fold_ops() -> tuple[str, ...]:
    """The lowerings with a sample that compiles to a workgroup fold when the form is forced."""
    found = []
    with forced_fold("workgroup"):
        for op in sorted(load_lowerings()):
            torch.manual_seed(0)
            for graph, _ in sample_cases(op):
                try:
                    if _folds(compile_graph(graph, GPU)):
                        found.append(op)
                        break
                except Unsupported:
                    continue
    return tuple(found)


def test_the_rule_follows_the_device_and_the_rows():
    assert workgroup_fold(GPU, WORKGROUP_FOLD_K) and not workgroup_fold(GPU, WORKGROUP_FOLD_K - 1)
    assert not workgroup_fold(CPU, 10 ** 6)
    assert not workgroup_fold({"limits": {}}, 10 ** 6)  # caps that do not say what the device is
    with forced_fold("workgroup"):
        assert workgroup_fold(CPU, 1)
    with forced_fold("invocation"):
        assert not workgroup_fold(GPU, 10 ** 6)
    with pytest.raises(ValueError, match="workgroup"):
        with forced_fold("tree"):
            pass


def test_every_reduction_family_folds_in_workgroups():
    ops = set(fold_ops())
    assert {"aten.sum.dim_IntList", "aten.mean.dim", "aten.amax.default", "aten.argmax.default", "aten.max.dim",
            "aten.prod.dim_int", "aten.any.dim", "aten.var_mean.correction",
            "aten.linalg_vector_norm.default"} <= ops, sorted(ops)


def test_a_gpu_row_is_one_workgroup_and_a_cpu_row_one_invocation():
    graph, _ = case_graph("aten.sum.dim_IntList", [torch.randn(4, 1024), [1]])
    (kernel,) = compile_graph(graph, GPU).kernels
    assert "workgroupBarrier()" in kernel.wgsl and f"@workgroup_size({WORKGROUP}, 1, 1)" in kernel.wgsl
    assert kernel.workgroups == (4, 1, 1) and kernel.loop_iterations == 1024 // WORKGROUP
    (kernel,) = compile_graph(graph, CPU).kernels
    assert "workgroupBarrier" not in kernel.wgsl and kernel.loop_iterations == 1024
    short, _ = case_graph("aten.sum.dim_IntList", [torch.randn(4, WORKGROUP_FOLD_K - 1), [1]])
    assert not _folds(compile_graph(short, GPU))


def test_a_long_row_spreads_over_workgroups_and_merges():
    n = 70007  # test_long_rows' length: a multiple of neither the lanes nor a part
    graph, _ = case_graph("aten.argmax.default", [torch.randn(3, n), 1])
    first, merge = compile_graph(graph, GPU).kernels
    parts = -(-n // (WORKGROUP * LANE_FOLD))
    assert first.workgroups == (3 * parts, 1, 1) and first.loop_iterations <= LANE_FOLD
    assert "merge" in merge.name and merge.loop_iterations == parts


def _check_samples(platform, op: str, browser: bool) -> None:
    """Every sample of ``op`` on the native adapters; in Chromium the samples of its first
    ``BROWSER_FORMS`` folding kernel forms (test_browser runs the others' first forms)."""
    torch.manual_seed(0)
    folded = 0
    forms = BROWSER_FORMS if browser else None
    new_forms = KernelForms(forms)
    for graph, inputs in sample_cases(op):
        inputs = finite_normal(inputs) if browser else inputs
        program = platform.compile(graph)
        folds = _folds(program)
        if (browser and not folds) or not new_forms.is_new(program):
            continue
        folded += folds
        out = platform.run(program, inputs)
        env = dict(zip([r for r, _ in graph.inputs], inputs))
        ref = run_node(graph.nodes[0], env.__getitem__)
        for i, (o, r) in enumerate(zip(out, ref)):
            assert o.dtype == r.dtype and o.shape == r.shape, f"{op} output {i}: {o.dtype}{list(o.shape)}"
            res = compare_tensor(o, r)
            assert res.passed, f"{op} output {i}: {res.message}; worst {res.worst}; {[tuple(t.shape) for t in inputs]}"
    assert folded, f"{op}: no sample compiled to a workgroup fold"
    run_low_precision_samples(platform, op, edges=not browser, forms=forms)
    for dtype in set(load_lowerings()[op].dtypes) & set(INT_AND_BOOL) - sampled_dtypes(op):
        new_forms = KernelForms(forms)
        for graph, inputs, ref in derived_dtype_cases(op, dtype):
            program = platform.compile(graph)
            if not new_forms.is_new(program):
                continue
            for i, (o, r) in enumerate(zip(platform.run(program, inputs), ref)):
                assert o.dtype == r.dtype and compare_tensor(o, r).passed, f"{op} {dtype} output {i}"


def _check_long_rows(platform, browser: bool) -> None:
    """The long rows in float32 everywhere; in float16 and bfloat16 on Vulkan (the registry's samples
    hold those dtypes on every adapter)."""
    from test_long_rows import LONG
    for name, op, args in LONG:
        if name.startswith(SCANS):
            continue
        graph, inputs = case_graph(op, args())
        inputs = finite_normal(inputs) if browser else inputs
        program = platform.compile(graph)
        assert _folds(program), name
        env = dict(zip([r for r, _ in graph.inputs], inputs))
        ref = run_node(graph.nodes[0], env.__getitem__)
        ref = list(ref) if isinstance(ref, (list, tuple)) else [ref]
        for i, (o, r) in enumerate(zip(platform.run(program, inputs), ref)):
            res = compare_tensor(o, r)
            assert o.dtype == r.dtype and res.passed, f"{name} output {i}: {res.message}; worst {res.worst}"
        if platform.caps().get("backend") == "vulkan" and any(t.dtype == torch.float32 for t in inputs):
            for dtype in LOW:
                case = low_precision_case(graph, inputs, dtype)
                if case is None:
                    continue
                g, low, ref_low, ref64 = case
                for r_low, r64 in zip(ref_low, ref64):  # torch's float16 CPU convolution gives NaN now and then
                    bad = torch.isnan(r_low) & ~torch.isnan(r64)  # (test_long_rows): float64's rounded stands in
                    r_low[bad] = r64[bad].to(r_low.dtype)
                res = compare_anchored(platform.run(platform.compile(g), low), ref_low, ref64, floor=LOW_FLOORS[dtype])
                assert res.passed, f"{name} {dtype}: {res.message}; worst {res.worst}"


def _check(platform):
    with platform, forced_fold("workgroup"):
        browser = platform.caps().get("backend") == "browser-webgpu"
        for op in fold_ops():
            _check_samples(platform, op, browser)
        _check_long_rows(platform, browser)


test_workgroup_folds_equal_torch, test_workgroup_folds_equal_torch_in_chromium = on_every_webgpu(_check)


@pytest.mark.device
@pytest.mark.xdist_group("wgpu")
def test_two_word_int64_states_fold_in_workgroups():
    """int64 values past i32 (test_int64_wide's reductions): their states are two words in workgroup memory."""
    from test_int64_wide import _cases, _equal, _expected
    from support import own_wgpu
    reductions = ("sum", "prod", "argmax", "argmin", "min.dim", "max.dim", "amax", "amin")
    folded = 0
    with own_wgpu("vulkan") as vulkan, forced_fold("workgroup"):
        for op, args, kwargs in _cases():
            if not op.removeprefix("aten.").startswith(reductions):
                continue
            graph, inputs = case_graph(op, args, kwargs)
            program = vulkan.for_values(vulkan.compile(graph), inputs)  # the program that runs: two words
            folded += any("fold_seen" in k.wgsl and "tap_i64" in k.wgsl for k in program.kernels)
            for got, want in zip(vulkan.run(vulkan.compile(graph), inputs), _expected(graph, inputs)):
                assert _equal(got, want), (op, got.flatten()[:4].tolist(), want.flatten()[:4].tolist())
    assert folded >= 3
