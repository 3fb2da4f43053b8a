"""float64 constants that float32 holds exactly run as float32 on WGSL targets (issue 36 item 6).

WGSL has no 64-bit floats, and float64 stays refused, except where a graph's float64 values are
only its inputs (the constants model code keeps in float64), no node computes a float64 value and
float32 holds each value exactly: those inputs are held as float32 and the ops reading them run
on the target. Fast tier: the rule and the exactness check. Device tier: a model with float64
buffers migrates whole on Vulkan and GL; one whose constant float32 cannot hold stays refused
with the reason, and ``inspect --target`` says so before any run."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from tapml.cli import app
from tapml.errors import Unsupported
from tapml.graph import graph_from_fx
from tapml.platforms.wgsl.registry import exact_float32, float64_held_as_float32
from tests.support import exported, on_every_webgpu

MODELS = Path(__file__).parent / "models" / "float64_constants.py"


def _graph(fn, *inputs):
    ep = exported(fn, *inputs)
    return graph_from_fx(ep.graph, ep.graph_signature)


def test_only_float64_inputs_that_no_node_computes_are_held_as_float32():
    scale = torch.tensor([0.5, 2.0], dtype=torch.float64)
    x = torch.randn(3, 2)
    assert float64_held_as_float32(_graph(lambda s, x: (x * s.float(), x > s), scale, x))
    assert not float64_held_as_float32(_graph(lambda s, x: (x * s,), scale, x))  # x * s is float64
    assert not float64_held_as_float32(_graph(lambda s, x: (s * 2,), scale, x))  # computed in float64
    assert not float64_held_as_float32(_graph(lambda x: (x + 1,), x))  # no float64 at all


def test_float32_must_hold_every_value_exactly():
    exact = torch.tensor([0.5, -3.0, math.inf, -math.inf, math.nan, 2.0**-149, 3.4028234663852886e38],
                         dtype=torch.float64)
    held = exact_float32(exact, "input 0")
    assert held.dtype == torch.float32
    assert torch.equal(held.double().nan_to_num(), exact.nan_to_num())
    for inexact in (0.1, 2.0**-150, 1e39, 1 + 2.0**-30):
        with pytest.raises(Unsupported, match="input 3: float64 values that float32 does not hold exactly"):
            exact_float32(torch.tensor([1.0, inexact], dtype=torch.float64), "input 3")


def _check_constants(platform):
    scale = torch.tensor([0.5, -1.25, 3.0], dtype=torch.float64)
    x = torch.randn(4, 3)
    graph = _graph(lambda s, x: (x * s.float() + 1, x > s, torch.where(x < s, s.float(), x)), scale, x)
    with platform:
        program = platform.compile(graph)
        assert [m.dtype for m in program.input_meta] == ["float32", "float32"]
        out = platform.run(program, [scale, x])
        want = [x * scale.float() + 1, x > scale, torch.where(x < scale, scale.float(), x)]
        assert all(torch.equal(o, w) for o, w in zip(out, want)), (out, want)
        with pytest.raises(Unsupported, match="float64 values that float32 does not hold exactly"):
            platform.run(program, [torch.tensor([0.1, 1.0, 2.0], dtype=torch.float64), x])


test_float64_constants_run_as_float32, test_float64_constants_run_as_float32_in_chromium = \
    on_every_webgpu(_check_constants)


def _carve(tmp_path, factory: str) -> Path:
    store = tmp_path / factory
    r = CliRunner().invoke(app, ["carve", f"{MODELS}:{factory}", "-o", str(store)])
    assert r.exit_code == 0, r.output
    return store


@pytest.mark.device
@pytest.mark.xdist_group("wgpu")
def test_a_model_with_exact_float64_constants_migrates_whole(tmp_path):
    store = _carve(tmp_path, "exact")
    state = tmp_path / "state.json"
    r = CliRunner().invoke(app, ["migrate", str(store), "--target", "wgpu:vulkan", "--state", str(state), "--quiet"])
    assert r.exit_code == 0, r.output
    doc = json.loads(state.read_text())
    assert doc["placement"]["ops_on_target"] == doc["placement"]["ops_total"], doc["placement"]
    assert doc["end_to_end"]["status"] == "pass"
    reads_float64 = [c for c in doc["cases"] if c["op"] in ("aten._to_copy.default", "aten.gt.Tensor")]
    assert reads_float64 and all(c["status"] == "pass" for c in reads_float64)


@pytest.mark.device
@pytest.mark.xdist_group("wgpu")
def test_an_inexact_float64_constant_is_refused_with_the_reason(tmp_path):
    store = _carve(tmp_path, "inexact")
    r = CliRunner().invoke(app, ["inspect", str(store), "--target", "wgpu:vulkan", "--json", str(tmp_path / "p.json")])
    assert r.exit_code == 1, r.output
    preflight = json.loads((tmp_path / "p.json").read_text())
    reasons = [u["reason"] for op in preflight["ops"] for u in op["unsupported"]]
    assert any("float64 values that float32 does not hold exactly" in reason for reason in reasons), preflight
    state = tmp_path / "state.json"
    r = CliRunner().invoke(app, ["migrate", str(store), "--target", "wgpu:vulkan", "--state", str(state), "--quiet"])
    assert r.exit_code == 1, r.output
    doc = json.loads(state.read_text())
    refused = [c for c in doc["cases"] if c["status"] == "unsupported"]
    assert refused and all("float32 does not hold exactly" in c["message"] for c in refused)
    assert doc["placement"]["ops_on_target"] < doc["placement"]["ops_total"]
