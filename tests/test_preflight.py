"""The limits preflight: KernelPrograms held to a device's limits (tapml/driving/preflight.py), and
`inspect --target`, `replay` and `migrate` with `--device-limit` on real stores and lavapipe."""

import json
import math
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from tapml.cli import app
from tapml.graph import TensorMeta
from tapml.platforms.base import BufferSpec, Kernel, KernelProgram
from tapml.driving.preflight import OpPreflight, StorePreflight, check_program, format_bytes, format_limit, preflight_store

runner = CliRunner()
TAPML = [sys.executable, "-m", "tapml.cli"]
MiB = 1 << 20

WGSL_64 = "@group(0) @binding(0) var<storage, read_write> y: array<f32>;\n" \
          "@compute @workgroup_size(64)\nfn main(@builtin(global_invocation_id) g: vec3<u32>) { y[g.x] = 0.0; }\n"


def tapml(*args):
    return runner.invoke(app, [str(a) for a in args])


def program(buffers, kernels) -> KernelProgram:
    return KernelProgram(kind="wgsl", inputs=[buffers[0].name], outputs=[buffers[-1].name], buffers=buffers,
                         kernels=kernels)


def buf(name, size, shape=None, dtype="float32") -> BufferSpec:
    return BufferSpec(name, "f32", size, "temp", meta=TensorMeta(tuple(shape), dtype) if shape else None)


def kernel(bindings, workgroups=(1, 1, 1), wgsl=WGSL_64, name="k0") -> Kernel:
    return Kernel(name, wgsl, bindings, tuple(workgroups))


def caps(**limits) -> dict:
    return {"limits": {k.replace("_", "-"): v for k, v in limits.items()}}


# --- one program ---------------------------------------------------------------------------

def test_a_program_within_every_limit_has_nothing_to_say():
    p = program([buf("x", 4096, [1024]), buf("y", 4096, [1024])], [kernel([("x", "read"), ("y", "read_write")], (16, 1, 1))])
    found = check_program(p, caps(max_storage_buffer_binding_size=4096, max_buffer_size=4096,
                                  max_storage_buffers_per_shader_stage=2, max_compute_workgroups_per_dimension=16,
                                  max_compute_invocations_per_workgroup=64))
    assert found.fits and found.splits == [] and found.kernels == 1 and found.largest_binding == 4096


def test_split_windows_are_reported_with_the_tensor_and_the_limit_that_forced_them():
    size = 64000 * 1024 * 4  # the LM head of a 64 000-token vocabulary at hidden 1024
    half = size // 2
    p = program([buf("w", size, [64000, 1024]), buf("y", 4096, [1024])],
                [kernel([("w", "read", 0, half), ("w", "read", half, half), ("y", "read_write")]),
                 kernel([("w", "read", 0, half), ("w", "read", half, half), ("y", "read_write")], name="k1")])
    found = check_program(p, caps(max_storage_buffer_binding_size=128 * MiB, max_buffer_size=2048 * MiB))
    assert found.fits, [v.describe() for v in found.violations]
    [split] = found.splits
    assert (split.buffer, split.shape, split.dtype, split.bytes) == ("w", (64000, 1024), "float32", 262144000)
    assert (split.windows, split.window_bytes, split.limit, split.limit_value) == (2, half, "max-storage-buffer-binding-size",
                                                                                    128 * MiB)
    assert split.describe() == "f32 [64000,1024] 250 MiB -> 2 windows over max-storage-buffer-binding-size 128 MiB"
    assert found.largest_binding == half
    assert found.to_json()["splits"][0]["windows"] == 2


def test_a_window_covering_the_whole_buffer_is_not_a_split():
    p = program([buf("x", 1024, [256])], [kernel([("x", "read_write", 0, 1024)])])
    assert check_program(p, caps(max_storage_buffer_binding_size=4096)).splits == []


def test_each_limit_gone_over_is_named():
    big = kernel([("a", "read"), ("b", "read"), ("c", "read_write")], (70000, 1, 1),
                 wgsl=WGSL_64.replace("workgroup_size(64)", "workgroup_size(16, 16)"))
    p = program([buf("a", 8192, [2048]), buf("b", 1024, [256]), buf("c", 1024, [256])], [big])
    found = check_program(p, caps(max_buffer_size=4096, max_storage_buffer_binding_size=2048,
                                  max_storage_buffers_per_shader_stage=2, max_compute_workgroups_per_dimension=65535,
                                  max_compute_invocations_per_workgroup=128))
    by_limit = {v.limit: v for v in found.violations}
    assert set(by_limit) == {"max-buffer-size", "max-storage-buffer-binding-size", "max-storage-buffers-per-shader-stage",
                             "max-compute-workgroups-per-dimension", "max-compute-invocations-per-workgroup"}
    assert (by_limit["max-buffer-size"].buffer, by_limit["max-buffer-size"].value) == ("a", 8192)
    assert (by_limit["max-storage-buffer-binding-size"].buffer, by_limit["max-storage-buffer-binding-size"].allowed) == ("a", 2048)
    assert by_limit["max-storage-buffers-per-shader-stage"].value == 3
    assert by_limit["max-compute-workgroups-per-dimension"].value == 70000
    assert by_limit["max-compute-invocations-per-workgroup"].value == 256
    assert "over max-compute-invocations-per-workgroup 128" in by_limit["max-compute-invocations-per-workgroup"].describe()
    assert not found.fits


def test_a_misaligned_window_is_a_violation_even_where_the_device_does_not_say_its_alignment():
    p = program([buf("x", 8192, [2048]), buf("y", 4096, [1024])],
                [kernel([("x", "read", 0, 4096), ("x", "read", 4000, 4096), ("y", "read_write")])])
    [v] = check_program(p, caps()).violations  # WebGPU's default alignment, 256
    assert (v.limit, v.value, v.allowed, v.buffer) == ("min-storage-buffer-offset-alignment", 4000, 256, "x")
    assert check_program(p, caps(min_storage_buffer_offset_alignment=32)).fits  # 4000 = 125 x 32
    strict = check_program(p, caps(min_storage_buffer_offset_alignment=256)).violations
    assert [v.limit for v in strict] == ["min-storage-buffer-offset-alignment"]


def test_a_window_past_the_end_of_its_buffer_and_an_unreadable_workgroup_size_are_violations():
    p = program([buf("x", 1024, [256])],
                [kernel([("x", "read_write", 768, 512)], wgsl=WGSL_64.replace("workgroup_size(64)", "workgroup_size(N)"))])
    found = check_program(p, caps(max_compute_invocations_per_workgroup=256))
    assert {v.limit for v in found.violations} == {"buffer-bounds", "workgroup-size"}


def test_limits_the_device_does_not_report_are_not_checked():
    p = program([buf("x", 1 << 30, [1 << 28])], [kernel([("x", "read_write")], (1 << 20, 1, 1))])
    assert check_program(p, caps()).fits
    assert check_program(KernelProgram(kind="graph", inputs=[], outputs=[]), caps(max_buffer_size=1)).kernels == 0


def test_units():
    assert format_bytes(262144000) == "250 MiB" and format_bytes(4096) == "4 KiB" and format_bytes(64) == "64 B"
    assert format_limit(128 * MiB) == "128 MiB" and format_limit(4096) == "4 KiB" and format_limit(1000) == "1000 B"
    assert format_limit(32, "max-compute-invocations-per-workgroup") == "32"


# --- a store ---------------------------------------------------------------------------------

def test_the_summary_line_names_the_largest_split():
    size = 64000 * 1024 * 4
    op = OpPreflight("aten.mm.default", cases=1)
    op.add(check_program(program([buf("w", size, [64000, 1024]), buf("y", 64, [16])],
                                 [kernel([("w", "read", 0, 128 * MiB), ("w", "read", 128 * MiB, size - 128 * MiB),
                                          ("y", "read_write")])]), caps(max_storage_buffer_binding_size=128 * MiB)))
    small = OpPreflight("aten.add.Tensor", cases=2)
    small.add(check_program(program([buf("y", 64, [16])], [kernel([("y", "read_write")])]), caps()))
    report = StorePreflight("wgpu:vulkan", {"max-storage-buffer-binding-size": 128 * MiB}, {}, [op, small])
    assert report.summary_line() == ("preflight: 1 op split across binding windows (largest: f32 [64000,1024] 250 MiB "
                                     "in 2 windows of <= 128 MiB)")
    assert report.fits and report.summary()["ops_split"] == 1
    assert StorePreflight("wgpu:vulkan", {}, {}, [small]).summary_line() == ""


def test_preflight_store_records_compile_failures_per_op_and_runs_nothing(mlp):
    from tapml.driving.inject import InjectedPlatform, parse_faults
    from tapml.platforms.reference import ReferencePlatform
    platform = InjectedPlatform(ReferencePlatform(), parse_faults(["aten.relu.default=compile-error"]))
    report = preflight_store(mlp, platform, "reference")
    ops = {o.op: o for o in report.ops}
    assert sum(o.cases for o in report.ops) == len(mlp.cases)
    assert ops["aten.relu.default"].errors and not ops["aten.relu.default"].fits
    assert all(o.fits for name, o in ops.items() if name != "aten.relu.default")
    assert not report.fits and report.to_json()["summary"]["ops_error"] == 1
    assert platform.inner.__dict__.get("_serials") is None  # compiled only: nothing ran


# --- the CLI: bad input (no device needed) ---------------------------------------------------

@pytest.mark.parametrize("value, message", [
    ("bogus=4096", "max-storage-buffer-binding-size"),  # the known names are listed
    ("max-buffer-size", "NAME=VALUE"),
    ("max-buffer-size=12XB", "positive integer"),
    ("max-buffer-size=0", "positive integer"),
    ("max-buffer-size=-4", "positive integer"),
])
def test_a_bad_device_limit_exits_2_saying_what_to_fix(mlp, tmp_path, value, message):
    for args in (["inspect", mlp.path, "--target", "wgpu:vulkan"], ["replay", mlp.path, "--target", "wgpu:vulkan"],
                 ["migrate", mlp.path, "--target", "wgpu:vulkan", "--state", tmp_path / "s.json"]):
        r = tapml(*args, "--device-limit", value)
        assert r.exit_code == 2, (args, r.output)
        assert message in r.output, r.output
    assert not (tmp_path / "s.json").exists()


def test_device_limits_need_a_device_with_limits(mlp):
    r = tapml("replay", mlp.path, "--device-limit", "max-buffer-size=1MiB")
    assert r.exit_code == 2 and "the reference has none" in r.output
    r = tapml("inspect", mlp.path, "--device-limit", "max-buffer-size=1MiB")
    assert r.exit_code == 2 and "add --target" in r.output
    r = tapml("inspect", mlp.path, "--target", "wgpu:vulkan", "--device-limit", "max-buffer-size=1MiB",
              "--device-limit", "max-buffer-size=2MiB")
    assert r.exit_code == 2 and "given twice" in r.output


def test_inspect_without_target_is_unchanged(mlp, tmp_path):
    r = tapml("inspect", mlp.path, "--json", tmp_path / "ops.json")
    assert r.exit_code == 0, r.output
    rows = json.loads((tmp_path / "ops.json").read_text())
    assert isinstance(rows, list) and {"op", "cases", "instances", "shapes", "dtypes"} <= set(rows[0])


# --- the CLI on lavapipe -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama(carved):
    pytest.importorskip("wgpu")
    from tapml.platforms.wgpu_native import available_backends
    if "vulkan" not in available_backends():
        pytest.skip("no wgpu Vulkan adapter (install mesa-vulkan-drivers for lavapipe)")
    from tapml.carving import CarveStore
    return CarveStore(carved("zoo:tiny-llama"))


@pytest.mark.device
@pytest.mark.xdist_group("wgpu")
def test_inspect_target_reports_what_a_small_binding_limit_splits(llama, tmp_path):
    limit = 4096
    r = tapml("inspect", llama.path, "--target", "wgpu:vulkan", "--device-limit",
              f"max-storage-buffer-binding-size={limit}", "--json", tmp_path / "p.json")
    assert r.exit_code == 0, r.output
    doc = json.loads((tmp_path / "p.json").read_text())
    assert doc["limits"]["max-storage-buffer-binding-size"] == limit
    assert doc["forced_limits"] == {"max-storage-buffer-binding-size": limit}
    assert doc["summary"]["fits"] and doc["summary"]["cases"] == len(llama.cases)
    ops = {o["op"]: o for o in doc["ops"]}
    assert all(o["largest_binding"] <= limit and o["fits"] for o in ops.values())
    # every tensor over 4 KiB that a kernel binds comes through windows: the embedding table
    # [256, 64] (64 KiB) in its gather, and the weights the mm and permute cases read
    for op in ("aten.embedding.default", "aten.mm.default", "aten.permute.default"):
        assert ops[op]["splits"], op
    for s in (s for o in ops.values() for s in o["splits"]):
        assert s["bytes"] > limit and s["limit"] == "max-storage-buffer-binding-size" and s["limit_value"] == limit
        assert s["windows"] >= math.ceil(s["bytes"] / limit) and s["window_bytes"] <= limit
        assert s["bytes"] == math.prod(s["shape"]) * 4 and s["dtype"] == "float32"
    embedding = ops["aten.embedding.default"]["splits"][0]
    assert (embedding["shape"], embedding["windows"]) == ([256, 64], 16)
    assert embedding["message"] == "f32 [256,64] 64 KiB -> 16 windows over max-storage-buffer-binding-size 4 KiB"
    assert doc["summary"]["largest_split"]["bytes"] == max(s["bytes"] for o in ops.values() for s in o["splits"])
    r = tapml("inspect", llama.path, "--target", "wgpu:vulkan", "--device-limit", "max-storage-buffer-binding-size=4KiB")
    assert r.exit_code == 0, r.output
    text = " ".join(r.output.split())
    assert (f"preflight: {sum(bool(o['splits']) for o in ops.values())} ops split across binding windows (largest: "
            "f32 [256,64] 64 KiB in 16 windows of <= 4 KiB) [--device-limit max-storage-buffer-binding-size=4 KiB]") in text
    assert f"{len(ops)}/{len(ops)} ops fit wgpu:vulkan" in text


@pytest.mark.device
@pytest.mark.xdist_group("wgpu")
def test_inspect_target_on_the_device_as_it_is_splits_nothing(llama, tmp_path):
    r = tapml("inspect", llama.path, "--target", "wgpu:vulkan", "--json", tmp_path / "p.json", "-q")
    assert r.exit_code == 0, r.output
    doc = json.loads((tmp_path / "p.json").read_text())
    assert doc["forced_limits"] == {} and doc["summary"]["ops_split"] == 0 and doc["summary"]["fits"]
    assert doc["device"]["adapter"] and sum(o["kernels"] for o in doc["ops"]) >= len(llama.cases)


@pytest.mark.device
@pytest.mark.xdist_group("wgpu")
def test_inspect_target_exits_1_when_a_case_cannot_fit(llama, tmp_path):
    # a tensor over max-buffer-size is held in parts of whole binding windows (tests/test_parts.py);
    # a buffer smaller than one window (lavapipe aligns windows to 32 bytes) holds no part
    r = tapml("inspect", llama.path, "--target", "wgpu:vulkan", "--device-limit", "max-buffer-size=16",
              "--json", tmp_path / "p.json")
    assert r.exit_code == 1, r.output
    doc = json.loads((tmp_path / "p.json").read_text())
    bad = {o["op"]: o for o in doc["ops"] if not o["fits"]}
    assert "aten.embedding.default" in bad and not doc["summary"]["fits"]
    assert all(o["unsupported"] or o["violations"] for o in bad.values())
    assert any("max-buffer-size" in u["reason"] for u in bad["aten.embedding.default"]["unsupported"])


@pytest.mark.device
@pytest.mark.xdist_group("wgpu")
def test_replay_and_migrate_say_what_was_split_before_running(mlp, tmp_path):
    pytest.importorskip("wgpu")
    r = subprocess.run(TAPML + ["replay", str(mlp.path), "--target", "wgpu:vulkan", "--device-limit",
                                "max-storage-buffer-binding-size=1KiB", "--json", str(tmp_path / "v.json")],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "preflight: 2 ops split across binding windows (largest: f32 [64,64] 16 KiB in 16 windows of <= 1 KiB)" \
        in " ".join(r.stderr.split())
    verdicts = json.loads((tmp_path / "v.json").read_text())
    assert verdicts["summary"]["pass"] == len(mlp.cases)
    assert verdicts["device"]["limits"]["max-storage-buffer-binding-size"] == 1024
    pre = verdicts["preflight"]
    assert pre["forced_limits"] == {"max-storage-buffer-binding-size": 1024} and pre["summary"]["ops_split"] == 2
    assert pre["summary"]["largest_split"]["shape"] == [64, 64]
    r = subprocess.run(TAPML + ["replay", str(mlp.path), "--target", "reference", "--target", "wgpu:vulkan",
                                "--device-limit", "max-storage-buffer-binding-size=1KiB", "--json", str(tmp_path / "m.json")],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "wgpu:vulkan preflight: 2 ops split across binding windows" in r.stderr
    matrix = json.loads((tmp_path / "m.json").read_text())["verdicts"]
    assert "preflight" not in matrix["reference"]  # the reference has no limits, and none are forced on it
    assert matrix["wgpu:vulkan"]["preflight"]["summary"] == pre["summary"]
    r = subprocess.run(TAPML + ["migrate", str(mlp.path), "--target", "wgpu:vulkan", "--device-limit",
                                "max-storage-buffer-binding-size=1KiB", "--state", str(tmp_path / "s.json")],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "preflight: 2 ops split across binding windows" in r.stderr
    state = json.loads((tmp_path / "s.json").read_text())
    assert state["device"]["limits"]["max-storage-buffer-binding-size"] == 1024
    assert state["placement"]["ops_share"] == 1.0
    r = subprocess.run(TAPML + ["replay", str(mlp.path), "--target", "wgpu:vulkan", "--json", str(tmp_path / "w.json")],
                       capture_output=True, text=True)
    assert r.returncode == 0 and "preflight:" not in r.stderr  # nothing split: nothing to say
    assert json.loads((tmp_path / "w.json").read_text())["preflight"]["summary"]["ops_split"] == 0
