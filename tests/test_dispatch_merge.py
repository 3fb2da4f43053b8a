"""Neighbouring one-dimensional kernels run as one dispatch (``ProgramBuilder.merge_independent``),
issue 34: graphs exported from torch, compiled for a real adapter and compared with torch on seeded
random inputs. Kernels that share no written buffer merge; a kernel that reads what the one before it
wrote, one with workgroup memory (a reduction), and a run past the device's bindings stay apart. The
runtime poisons outputs, so an element a merged body skips shows. Device tier: lavapipe and
llvmpipe; browser tier: Chromium."""

from __future__ import annotations

import pytest
import torch

from tapml.graph import graph_from_fx
from tests.support import exported, on_every_webgpu


def _graph(fn, *inputs):
    ep = exported(fn, *inputs)
    return graph_from_fx(ep.graph, ep.graph_signature), list(inputs), fn(*inputs)


def _independent():
    """Three outputs of different sizes and dtypes, none reading another: one dispatch."""
    gen = torch.Generator().manual_seed(1)
    a, b, c = torch.randn(37, generator=gen), torch.randn(5, 300, generator=gen), torch.randint(-50, 50, (9,), generator=gen)
    a[:4] = torch.tensor([float("inf"), -float("inf"), 1e-40, -0.0])
    return _graph(lambda a, b, c: (a.exp(), b * 2 - 1, c.abs() + 3), a, b, c)


def _dependent():
    """An output that is read by the next kernel (``y`` is written because two nodes read it)."""
    gen = torch.Generator().manual_seed(2)
    a = torch.randn(64, generator=gen)

    def fn(a):
        y = (a * 3).abs() - 1
        return (y, y.flip(0) * y + 1)
    return _graph(fn, a)


def _with_reduction():
    """A row reduction (workgroup memory) between elementwise kernels."""
    gen = torch.Generator().manual_seed(3)
    a, b = torch.randn(4, 700, generator=gen), torch.randn(50, generator=gen)
    return _graph(lambda a, b: (a.softmax(-1), b + 1, a.amax(-1)), a, b)


def _bodies(program) -> int:
    return sum(len(k.name.split("+")) for k in program.kernels)


def _run(platform, case):
    graph, inputs, want = case
    program = platform.compile(graph)
    got = platform.run(program, inputs)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6, equal_nan=True)
    return program


def _check(platform):
    program = _run(platform, _independent())
    assert [len(k.name.split("+")) for k in program.kernels] == [3], [k.name for k in program.kernels]
    _run(platform, _dependent())
    program = _run(platform, _with_reduction())
    assert all("+" not in k.name for k in program.kernels if "workgroupBarrier" in k.wgsl)


(test_independent_kernels_merge_and_equal_torch,
 test_independent_kernels_merge_and_equal_torch_in_chromium) = on_every_webgpu(_check)


def test_a_run_past_the_bindings_limit_is_cut():
    """Twelve independent outputs on a device of 8 storage buffers a shader: no merged kernel binds more."""
    from tapml.platforms.wgsl import compile_graph
    gen = torch.Generator().manual_seed(4)
    xs = [torch.randn(10, generator=gen) for _ in range(12)]
    graph, _, _ = _graph(lambda *xs: tuple(x + i for i, x in enumerate(xs)), *xs)
    caps = {"limits": {"max-storage-buffers-per-shader-stage": 8}, "features": []}
    program = compile_graph(graph, caps)
    assert _bodies(program) == 12 and 1 < len(program.kernels) < 12
    assert all(len(k.bindings) <= 8 for k in program.kernels)


def test_a_run_is_cut_at_the_most_bodies_a_merged_kernel_takes():
    from tapml.platforms.wgsl import compile_graph
    from tapml.platforms.wgsl.codegen import MAX_MERGED_BODIES
    gen = torch.Generator().manual_seed(5)
    xs = [torch.randn(10, generator=gen) for _ in range(3)]
    n = 3 * MAX_MERGED_BODIES  # outputs reading the same three inputs: few bindings, many bodies
    graph, _, _ = _graph(lambda a, b, c: tuple(a * i + b - c for i in range(n)), *xs)
    program = compile_graph(graph, {"limits": {"max-storage-buffers-per-shader-stage": 64}, "features": []})
    assert _bodies(program) == n and all(len(k.name.split("+")) <= MAX_MERGED_BODIES for k in program.kernels)
    assert len(program.kernels) == 3


def test_a_kernel_that_reads_what_the_run_wrote_starts_a_new_run():
    """Kernels built by hand: A writes x; B reads x; C reads y; D writes y. B cannot join A, C can join
    B, D cannot join B+C (C reads what D writes), and a kernel with a barrier joins nothing."""
    from tapml.graph import TensorMeta
    from tapml.platforms.wgsl.codegen import ProgramBuilder
    pb = ProgramBuilder({"limits": {}, "features": []})
    meta = TensorMeta((16,), "float32")
    x, y, z, w = (pb.buffer("temp", meta) for _ in range(4))

    def kernel(name, reads, writes, barrier=False):
        k = pb.kernel(name)
        for buf in reads:
            k.emit(f"let v{buf.name}: f32 = {k.bind(buf).name}[n];")
        for buf in writes:
            k.emit(f"{k.bind(buf, 'read_write').name}[n] = 1.0;")
        if barrier:
            k.emit("workgroupBarrier();")
        pb.add(k.finish(16))
    kernel("a", [], [x])
    kernel("b", [x], [z])
    kernel("c", [y], [w])
    kernel("d", [], [y])
    kernel("e", [], [x], barrier=True)
    kernel("f", [], [z])
    pb.merge_independent()
    assert [k.name for k in pb.kernels] == ["a_0", "b_0+c_0", "d_0", "e_0", "f_0"]
    merged = pb.kernels[1]
    assert sorted(b[0] for b in merged.bindings) == sorted([x.name, z.name, y.name, w.name])
    assert merged.workgroups == (1, 1, 1) and "n - 16" in merged.wgsl
