"""``--dtype float16|bfloat16``: models carved in a low precision, their cases judged
fp64-anchored, their regions, whole model and generation judged against the model in float32."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from tapml.carving import CarveStore
from tapml.cli import app
from tapml.errors import TapmlError
from tapml.platforms.wgpu_native import available_backends, shared_platform
from tapml.driving.replay import anchored_by_default, replay

LOW = ["float16", "bfloat16"]
SPECS = ["zoo:mlp", "zoo:tiny-llama"]
#: This file is also the factory of the overflowing model (a MODEL spec path/file.py:factory).
OVERFLOW = f"{Path(__file__).resolve()}:overflow_model"

vulkan_adapter = pytest.mark.skipif("vulkan" not in available_backends(),
                                    reason="no wgpu Vulkan adapter (install mesa-vulkan-drivers for lavapipe)")
gl_adapter = pytest.mark.skipif("gl" not in available_backends(),
                                reason="no wgpu OpenGL adapter (install EGL for llvmpipe)")


class _ScaledNorm(torch.nn.Module):
    """RMSNorm of ``300 x``: the mean of squares passes float16's 65504, rsqrt turns the Inf
    into 0, so in float16 the output is finite and wrong (zeros); in float32 it is fine."""

    def forward(self, x):
        h = x * 300
        return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)


class _Inverse(torch.nn.Module):
    def forward(self, x):
        return torch.linalg.inv(x) + 1  # torch has no float16/bfloat16 kernel for it


def inverse_model():
    return _Inverse(), (torch.randn(3, 3) + 3 * torch.eye(3),)


def test_a_model_torch_cannot_run_in_float16_is_one_line_and_exit_2(tmp_path):
    """torch logs a traceback while exporting an op it has no float16 kernel for; the user sees
    only tapml's one line."""
    import subprocess
    import sys
    spec = f"{Path(__file__).resolve()}:inverse_model"
    r = subprocess.run([sys.executable, "-m", "tapml.cli", "carve", spec, "--dtype", "float16", "-o",
                        str(tmp_path / "s"), "-q"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr and "Low precision dtypes not supported" in r.stderr
    assert len(r.stderr.strip().splitlines()) <= 2  # one error line (rich may wrap it once)


def overflow_model():
    return _ScaledNorm(), (torch.randn(4, 64),)


def tapml(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def _all_pass(result) -> list[str]:
    return [f"{v['id']} {v['op']}: {v['status']}: {v['message'][:300]}" for v in result["cases"] if v["status"] != "pass"]


@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("spec", SPECS)
def test_carve_in_low_precision_records_the_dtype_and_replays_on_the_reference(carved, spec, dtype):
    from tapml.driving.targets import open_target
    store = CarveStore(carved(spec, dtype=dtype))
    assert store.dtype == dtype and store.manifest["dtype"] == dtype
    assert anchored_by_default(store)
    floats = [t for t in store.program_inputs().values() if t.is_floating_point()]
    assert floats and all(str(t.dtype) == f"torch.{dtype}" for t in floats)
    assert any(m["dtype"] == dtype for c in store.cases for m in c["output_meta"])
    with open_target("reference") as platform:
        result = replay(store, platform, "reference")
    assert not _all_pass(result) and result["summary"]["pass"] == len(store.cases)


def test_fp64_anchor_retypes_dtype_arguments(carved):
    from tapml.driving.replay import _reference64
    store = CarveStore(carved("zoo:tiny-llama", dtype="float16"))
    casts = [c for c in store.cases if c["kwargs"].get("dtype") == {"dtype": "float16"}]
    assert casts, "tiny-llama in float16 casts back to float16 after its float32 norms"
    (out,) = _reference64(store, casts[0])
    assert out.dtype == torch.float64


def test_replay_is_fp64_anchored_by_default_for_low_precision_and_can_be_turned_off(carved, tmp_path):
    store = carved("zoo:mlp", dtype="float16")
    fault = ["--inject", "aten.relu.default=offset:0.5"]
    r = tapml("replay", store, *fault, "--json", tmp_path / "a.json")
    assert r.exit_code == 1, r.output
    bad = [v for v in json.loads((tmp_path / "a.json").read_text())["cases"] if v["status"] != "pass"]
    assert bad and all("fp64-anchored" in v["message"] and "floor 0.001" in v["message"] for v in bad)
    r = tapml("replay", store, *fault, "--no-fp64-anchored", "--json", tmp_path / "b.json")
    assert r.exit_code == 1, r.output
    bad = [v for v in json.loads((tmp_path / "b.json").read_text())["cases"] if v["status"] != "pass"]
    assert bad and not any("fp64-anchored" in v["message"] for v in bad)
    assert tapml("replay", store).exit_code == 0
    assert tapml("replay", store, "--no-fp64-anchored").exit_code == 0


BACKENDS = [pytest.param("vulkan", marks=vulkan_adapter), pytest.param("gl", marks=gl_adapter)]


@pytest.mark.device
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("dtype", LOW)
def test_low_precision_cases_pass_on_vulkan_and_gl(carved, backend, spec, dtype):
    """Native f16 on Vulkan (shader-f16), packed two per u32 on GL; bfloat16 packed on both."""
    store = CarveStore(carved(spec, dtype=dtype))
    result = replay(store, shared_platform(backend), f"wgpu:{backend}")
    bad = _all_pass(result)
    assert not bad, f"{len(bad)}/{len(result['cases'])} cases of {spec} in {dtype} fail on {backend}:\n" + "\n".join(bad)
    assert result["dtype"] == dtype and result["anchored"] is True
    packed = dtype == "bfloat16" or "shader-f16" not in result["device"]["features"]
    assert result["device"]["low_precision"][dtype].startswith("packed" if packed else "native")


@pytest.mark.device
@pytest.mark.slow
def test_float16_generation_passes_on_vulkan(tmp_path):
    r = tapml("generate", "zoo:tiny-llama", "--dtype", "float16", "--target", "wgpu:vulkan", "--tokens", "3",
              "--json", tmp_path / "g.json", "-q")
    assert r.exit_code == 0, r.output
    doc = json.loads((tmp_path / "g.json").read_text())
    assert doc["dtype"] == "float16" and [s["status"] for s in doc["steps"]] == ["pass"] * len(doc["steps"])
    assert doc["upload_bytes_per_decode_step"] == 8 and doc["programs_compiled"] == 2


def test_float16_overflow_fails_at_the_model_stage_against_float32(tmp_path):
    r = tapml("migrate", OVERFLOW, "--dtype", "float16", "--state", tmp_path / "f16.json", "-q")
    assert r.exit_code == 1, r.output
    state = json.loads((tmp_path / "f16.json").read_text())
    assert (tmp_path / "f16.store").is_dir() and CarveStore(tmp_path / "f16.store").dtype == "float16"
    # Each op matches the float16 reference (its overflow included): the ops are not at fault.
    assert state["summary"]["pass"] == len(state["cases"]) > 0
    e = state["end_to_end"]
    assert e["status"] == "mismatch" and "against the model in float32" in e["message"]
    assert e["max_abs_err"] > 1  # zeros where float32 gives the normalized values
    r = tapml("migrate", OVERFLOW, "--state", tmp_path / "f32.json", "-q")
    assert r.exit_code == 0, r.output
    state = json.loads((tmp_path / "f32.json").read_text())
    assert state["passed"] and state["end_to_end"]["status"] == "pass"
    assert CarveStore(tmp_path / "f32.store").dtype == "float32"


def test_float16_generation_is_judged_against_float32(tmp_path):
    store = tmp_path / "g16"
    r = tapml("carve", "zoo:tiny-llama", "--generate", "1", "--prompt-len", "4", "--dtype", "float16", "-o", store, "-q")
    assert r.exit_code == 0, r.output
    assert CarveStore(store).dtype == "float16" and CarveStore(store).is_generation
    r = tapml("generate", store, "--json", tmp_path / "g.json", "-q")
    assert r.exit_code == 0, r.output
    doc = json.loads((tmp_path / "g.json").read_text())
    assert doc["dtype"] == "float16" and doc["judged_against"] == "float32"
    assert [s["status"] for s in doc["steps"]] == ["pass", "pass"]
    assert all(0 < s["max_abs_err"] < 1e-2 for s in doc["steps"])  # float16 against float32: never bit-equal
    r = tapml("generate", store, "--dtype", "bfloat16")
    assert r.exit_code == 2 and "carved in float16" in r.output


@pytest.mark.parametrize("args,message", [
    (["carve", "zoo:mlp", "-o", "{tmp}/x", "--dtype", "float8"], "--dtype must be one of float32, float16, bfloat16"),
    (["carve", "zoo:tiny-llama", "--generate", "1", "-o", "{tmp}/x", "--dtype", "half"], "--dtype must be one of"),
    (["migrate", "zoo:mlp", "--state", "{tmp}/s.json", "--dtype", "fp16"], "--dtype must be one of"),
    (["migrate", "{store16}", "--state", "{tmp}/s.json", "--dtype", "float32"], "carved in float16, not float32"),
    (["session", "{store16}", "--dtype", "bfloat16"], "carved in float16, not bfloat16"),
    (["generate", "zoo:tiny-llama", "--dtype", "int8"], "--dtype must be one of"),
    (["bench", "--dtype", "float64"], "--dtype must be one of"),
])
def test_bad_dtype_exits_2(carved, tmp_path, args, message):
    store16 = carved("zoo:mlp", dtype="float16")
    r = tapml(*[a.format(tmp=tmp_path, store16=store16) for a in args])
    assert r.exit_code == 2, r.output
    assert message in " ".join(r.output.split())
    assert not (tmp_path / "x").exists()


def test_a_pt2_cannot_be_recast(tmp_path):
    from tapml.frontends.models import load_model
    model, x = torch.nn.Linear(4, 4), torch.randn(2, 4)
    torch.export.save(torch.export.export(model, (x,)), tmp_path / "m.pt2")
    with pytest.raises(TapmlError, match="cannot be recast.*exported in float16"):
        load_model(str(tmp_path / "m.pt2"), dtype="float16")
    half = torch.nn.Linear(4, 4).half()
    torch.export.save(torch.export.export(half, (x.half(),)), tmp_path / "h.pt2")
    _, inputs = load_model(str(tmp_path / "h.pt2"), dtype="float16")
    assert inputs[0].dtype == torch.float16


def test_reused_state_store_must_have_the_same_dtype(tmp_path):
    from tapml.carving import open_or_carve
    store, path = open_or_carve("zoo:mlp", tmp_path / "s.json", dtype="float16")
    assert store.dtype == "float16" and path == tmp_path / "s.store"
    # reused when a migration's journal recorded it (tests/test_hostile_states.py: only then)
    recorded = store.manifest_sha256
    assert open_or_carve("zoo:mlp", tmp_path / "s.json", dtype="float16", recorded=recorded)[0].dtype == "float16"
    with pytest.raises(TapmlError, match="--dtype float16.*--dtype float32"):
        open_or_carve("zoo:mlp", tmp_path / "s.json", recorded=recorded)


def test_a_store_without_dtype_opens_as_float32_and_a_bad_dtype_is_refused(carved, tmp_path):
    old = tmp_path / "old"
    shutil.copytree(carved("zoo:mlp"), old)
    manifest = json.loads((old / "manifest.json").read_text())
    manifest.pop("dtype", None)
    (old / "manifest.json").write_text(json.dumps(manifest))
    store = CarveStore(old)
    assert store.dtype == "float32" and not anchored_by_default(store)
    for bad, why in (("float8", "dtype is 'float8': input should be 'float32', 'float16' or 'bfloat16'"),
                     (16, "dtype is 16: input should be 'float32', 'float16' or 'bfloat16'"),
                     ("float16", "dtype says float16, but no value of the graph is float16")):
        (old / "manifest.json").write_text(json.dumps({**manifest, "dtype": bad}))
        with pytest.raises(TapmlError, match=why):
            CarveStore(old)
