"""complex64 as pairs of float32 and the FFT on the device (platforms/wgsl/complex.py, issue 36
items 4-5).

Device and browser tiers: every complex lowering's samples (edge values: signed zeros, infinities,
NaN, huge and tiny parts; FFT lengths 1, 2, 3, 5, 7, 8, 400, 512, 1024, one and several dims,
every norm mode) against torch on lavapipe Vulkan, llvmpipe GL and Chromium; then, slow tier,
model code as its authors wrote it (tests/models/complex_models.py): a block of Meta's reference
Llama with its ``torch.polar`` rotary embedding, and STFT -> magnitude/phase -> iSTFT with
``n_fft`` 400 and 512, each migrated with every op on the target. Fast tier: complex outputs are
compared as real and imaginary parts, and an FFT is judged by its arithmetic bound."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from tapml.cli import app
from tapml.graph import run_graph
from tapml.judging.compare import compare_outputs, compare_tensor
from tapml.platforms.wgsl.complex import COMPLEX_LOWERINGS, FFT_SIZES
from tapml.platforms.wgsl.registry import case_graph
from tests.support import accepted_samples, on_every_webgpu

MODELS = Path(__file__).parent / "models" / "complex_models.py"


def _cases():
    out = accepted_samples(COMPLEX_LOWERINGS)
    z = torch.complex(torch.randn(3, 4), torch.randn(3, 4))
    out += [("aten.cat.default", ([z, z * 2], 0), {}), ("aten.permute.default", (z, [1, 0]), {}),
            ("aten.clone.default", (z,), {}), ("aten._to_copy.default", (z,), {"dtype": torch.float32}),
            ("aten._to_copy.default", (torch.randn(5),), {"dtype": torch.complex64}),
            ("aten.full.default", ([2, 3], 1.5), {"dtype": torch.complex64})]
    return out


def _check(platform):
    ran, bad = set(), []
    with platform:
        for op, args, kwargs in _cases():
            graph, inputs = case_graph(op, args, kwargs)
            outputs = platform.run(platform.compile(graph), inputs)
            got = run_graph(graph, dict(zip([r for r, _ in graph.inputs], inputs)))
            expected = [got[r] for r in graph.outputs]
            if op.startswith("aten._fft"):  # judged as tapml judges an FFT: by its arithmetic bound
                result = _fft_judged(op, args, kwargs, outputs, expected)
            else:
                result = compare_outputs(outputs, expected, op=op)
            if not result.passed:
                bad.append((op, [tuple(getattr(a, "shape", ())) for a in args], result.message[:160]))
            ran.add(op)
    assert not bad, bad[:5]
    assert ran >= set(COMPLEX_LOWERINGS), set(COMPLEX_LOWERINGS) - ran


def _fft_judged(op, args, kwargs, outputs, expected):
    from tapml.judging.compare import Rule, arithmetic_bounds
    args64 = [a.to(torch.complex128) if isinstance(a, torch.Tensor) and a.is_complex() else
              a.double() if isinstance(a, torch.Tensor) else a for a in args]
    ref64 = [torch.ops.aten.__getattr__(op.split(".")[1]).default(*args64)]
    bound = arithmetic_bounds(op, args64, kwargs, ref64, "float32")[0]
    return compare_tensor(outputs[0], expected[0], rules=[Rule("arithmetic", ref64[0], bound)], fast=None)


test_complex_lowerings_equal_torch, test_complex_lowerings_equal_torch_in_chromium = on_every_webgpu(_check)


# --- complex32: pairs of float16, computed as complex64 and rounded per part at each op -------

def _c32(*shape) -> torch.Tensor:
    """Seeded complex32 values with float16 edges among them: zeros of both signs, infinities, NaN,
    a part past float16's range (inf once rounded), subnormal parts."""
    g = torch.Generator().manual_seed(math.prod(shape) + 7)
    z = torch.complex(torch.randn(*shape, generator=g) * 4, torch.randn(*shape, generator=g) * 4).reshape(-1)
    edges = [complex(0.0, -0.0), complex(math.inf, 1.0), complex(-2.0, -math.inf), complex(math.nan, 0.5),
             complex(70000.0, 3.0), complex(3e-6, -1e-7), complex(65504.0, -65504.0)]
    z[:len(edges)] = torch.tensor(edges[:z.numel()], dtype=torch.complex64)
    return z.to(torch.complex32).reshape(shape)


def _complex32_cases() -> list:
    """(op, args, kwargs) of every op torch computes on complex32 (its CPU kernels implement few)."""
    a, b, h = _c32(4, 6), _c32(6), torch.randn(4, 6, 2).half()
    return [("aten.add.Tensor", (a, b), {}), ("aten.add.Tensor", (a, b), {"alpha": 3}), ("aten.sub.Tensor", (a, b), {}),
            ("aten.mul.Tensor", (a, b), {}), ("aten.mul.Scalar", (a, 1.5 - 0.25j), {}), ("aten.mul.Tensor", (a, h[..., 0]), {}),
            ("aten.neg.default", (a,), {}), ("aten._conj.default", (a,), {}), ("aten.abs.default", (a,), {}),
            ("aten.real.default", (a,), {}), ("aten.imag.default", (a,), {}), ("aten.view_as_real.default", (a,), {}),
            ("aten.view_as_complex.default", (h,), {}), ("aten.complex.default", (h[..., 0], h[..., 1]), {}),
            ("aten.cat.default", ([a, a * 2],), {}), ("aten.where.self", (h[..., 0] > 0, a, b), {}),
            ("aten.index_select.default", (a, 0, torch.tensor([3, 0, 3])), {}),
            ("aten._to_copy.default", (a,), {"dtype": torch.complex64}),
            ("aten._to_copy.default", (_c32(5).to(torch.complex64) * 1.0009765625,), {"dtype": torch.complex32}),
            ("aten._to_copy.default", (h[..., 0],), {"dtype": torch.complex32}),
            ("aten._to_copy.default", (a,), {"dtype": torch.float16}), ("aten.clone.default", (a,), {})]


def _check_complex32(platform):
    bad = []
    with platform:
        for op, args, kwargs in _complex32_cases():
            graph, inputs = case_graph(op, args, kwargs)
            assert any(m.dtype == "complex32" for m in graph.meta.values()), op
            got = platform.run(platform.compile(graph), inputs)
            want = run_graph(graph, dict(zip([r for r, _ in graph.inputs], inputs)))
            for g, ref in zip(got, [want[r] for r in graph.outputs]):
                # torch computes complex32 as complex64 rounded to float16 per part, as the device does
                result = compare_tensor(g, ref, rtol=0, atol=0)
                if g.dtype != ref.dtype or not result.passed:
                    bad.append((op, kwargs, g.dtype, result.message))
    assert not bad, bad


test_complex32_equals_torch, test_complex32_equals_torch_in_chromium = on_every_webgpu(_check_complex32)


def _migrate(tmp_path, factory: str, target: str) -> dict:
    runner = CliRunner()
    store = tmp_path / factory
    r = runner.invoke(app, ["carve", f"{MODELS}:{factory}", "-o", str(store)])
    assert r.exit_code == 0, r.output
    state = tmp_path / f"{factory}.json"
    r = runner.invoke(app, ["migrate", str(store), "--target", target, "--state", str(state), "--quiet"])
    assert r.exit_code == 0, r.output
    return json.loads(state.read_text())


@pytest.mark.slow
@pytest.mark.device
@pytest.mark.xdist_group("wgpu")
@pytest.mark.parametrize("target", ["wgpu:vulkan", "wgpu:gl"])
@pytest.mark.parametrize("factory", ["llama_block", "stft400", "stft512"])
def test_complex_model_code_migrates_whole(tmp_path, factory, target):
    doc = _migrate(tmp_path, factory, target)
    assert doc["placement"]["ops_on_target"] == doc["placement"]["ops_total"], doc["placement"]
    assert doc["end_to_end"]["status"] == "pass"
    ops = {c["op"] for c in doc["cases"]}
    assert ops & ({"aten.polar.default", "aten.view_as_complex.default"} if factory == "llama_block" else
                  {"aten._fft_r2c.default", "aten._fft_c2r.default"})


@pytest.mark.device
@pytest.mark.xdist_group("wgpu")
@pytest.mark.parametrize("target", ["wgpu:vulkan", "wgpu:gl"])
def test_complex32_model_code_migrates_whole(tmp_path, target):
    """Half-precision rotary pairs in complex32 (tests/models/complex_models.py ``half_rotation``):
    carved (the store holds complex32 as float16 pairs, and a conj view as its values), then every op
    on the target."""
    doc = _migrate(tmp_path, "half_rotation", target)
    assert doc["placement"]["ops_on_target"] == doc["placement"]["ops_total"], doc["placement"]
    assert doc["end_to_end"]["status"] == "pass"
    assert {"aten.mul.Tensor", "aten._conj.default", "aten.view_as_complex.default"} <= {c["op"] for c in doc["cases"]}


@pytest.mark.browser
def test_complex32_model_code_migrates_whole_in_chromium(tmp_path):
    doc = _migrate(tmp_path, "half_rotation", "browser")
    assert doc["placement"]["ops_on_target"] == doc["placement"]["ops_total"], doc["placement"]


@pytest.mark.device
@pytest.mark.xdist_group("wgpu")
def test_a_python_complex_constant_is_carved_and_runs_on_the_target(tmp_path):
    doc = _migrate(tmp_path, "rotate_by_constant", "wgpu:vulkan")
    assert doc["placement"]["ops_on_target"] == doc["placement"]["ops_total"], doc["placement"]
    assert doc["end_to_end"]["status"] == "pass"
    assert any(c["op"] in ("aten.mul.Tensor", "aten.mul.Scalar") and c["status"] == "pass" for c in doc["cases"])


@pytest.mark.slow
@pytest.mark.browser
@pytest.mark.parametrize("factory", ["llama_block", "stft400", "stft512"])
def test_complex_model_code_migrates_whole_in_chromium(tmp_path, factory):
    doc = _migrate(tmp_path, factory, "browser")
    assert doc["placement"]["ops_on_target"] == doc["placement"]["ops_total"], doc["placement"]


# --- fast tier ---------------------------------------------------------------------------------

def test_complex_outputs_are_compared_as_real_and_imaginary_parts():
    ref = torch.complex(torch.tensor([1.0, -2.0]), torch.tensor([0.5, 3.0]))
    assert compare_tensor(ref.clone(), ref).passed
    off = ref + 0.01j
    result = compare_tensor(off, ref)
    assert not result.passed and result.max_abs_err == pytest.approx(0.01, rel=1e-3)
    nan = ref.clone()
    nan[0] = complex(math.nan, 0.5)
    assert not compare_tensor(nan, ref).passed


def test_an_fft_is_judged_by_its_arithmetic_bound_which_a_scaled_result_fails():
    from tapml.judging.compare import arithmetic_bounds
    x = torch.randn(3, 512, dtype=torch.float64)
    out = torch.ops.aten._fft_r2c.default(x, [1], 0, True)
    bound = arithmetic_bounds("aten._fft_r2c.default", [x, [1], 0, True], {}, [out], "float32")[0]
    assert bound.shape == out.shape
    # the bound grows like sqrt(n) u sum|x|: a float32 FFT passes, a result scaled by 1.001 does not
    f32 = torch.ops.aten._fft_r2c.default(x.float(), [1], 0, True)
    from tapml.judging.compare import Rule
    assert compare_tensor(f32, out.to(torch.complex64), rules=[Rule("arithmetic", out, bound)], fast=None).passed
    assert not compare_tensor(f32 * 1.001, out.to(torch.complex64), rules=[Rule("arithmetic", out, bound)],
                              fast=None).passed


def test_fft_samples_cover_the_sizes_the_issue_names():
    assert set(FFT_SIZES) >= {1, 2, 3, 5, 7, 8, 400, 512, 1024}
