"""The tinygrad backend (`tinygrad:webgpu`, `tinygrad:cpu`; issue #32 item 2): tinygrad's own ONNX runner
on the ONNX route's bytes, real tinygrad devices throughout.

Fast tier: :class:`TinygradBackend` in this process on ``tinygrad:cpu`` (clang): every dtype the route
carries, the blob round trip, the repro runner, the exporter's dropped float16 cast, refusals. Device
tier: ``tinygrad:webgpu`` (Dawn on lavapipe Vulkan) in this process: the adapter it names, the same
programs, its own faults (int64 floor division past 2**32 is wrong; a tensor past the device's binding
limit fails). Slow tier, over the CLI: that wrong division named with its op and blamed on the device
compiler by the control, the four-target matrix (wgpu:vulkan, iree:vulkan, ort, tinygrad:webgpu) naming the
op the ONNX route gets wrong, in the terminal and in HTML, and every case of zoo:tiny-llama's float16 store.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest
import torch
from support import LAYOUT_OPS, exported, store_from_source

# found, not imported: tinygrad reads its settings (CACHELEVEL, which the backend sets) when first imported
if importlib.util.find_spec("tinygrad") is None or importlib.util.find_spec("onnxscript") is None:
    pytest.skip("the backends extra is not installed (pip install 'tapml[backends]')", allow_module_level=True)

from tapml.platforms.backend import BackendRefused, Compiled  # noqa: E402
from tapml.platforms.onnx_route import SIGNATURE_KEY  # noqa: E402
from tapml.platforms.tinygrad import TinygradBackend  # noqa: E402

ON_WEBGPU = [pytest.mark.device, pytest.mark.xdist_group("wgpu")]


@pytest.fixture(scope="module", autouse=True)
def own_compile_cache(tmp_path_factory):
    """This module's compile cache (the commands it runs inherit it): never the user's ~/.cache."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TAPML_CACHE_DIR", str(tmp_path_factory.mktemp("tinygrad-cache")))
        yield


def tapml(*args, timeout=600, env=None):
    """The tapml CLI in a subprocess (the backend runs in a worker process of its own anyway)."""
    return subprocess.run([sys.executable, "-m", "tapml.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


def mixed(x, w, ids, mask, h, unused):
    """Outputs of every dtype the route carries, an output that is an input, and a float16 ``sum``
    (whose final cast the exporter drops: it comes back float32)."""
    y = x @ w
    return (y.relu(), h * 3, ids.cumsum(0), y > 0, torch.where(mask, ids.to(torch.float32), -1.0),
            x.bfloat16(), x, h.sum())


MIXED_INPUTS = (torch.randn(3, 4), torch.randn(4, 5), torch.tensor([7, -2, 5]), torch.tensor([True, False, True]),
                torch.randn(3, 4, dtype=torch.float16), torch.ones(2))


@pytest.fixture(scope="module")
def program():
    return exported(mixed, *MIXED_INPUTS)


@pytest.fixture(scope="module")
def cpu():
    backend = TinygradBackend("tinygrad:cpu")
    yield backend
    backend.close()


@pytest.fixture(scope="module")
def webgpu():
    backend = TinygradBackend("tinygrad:webgpu")
    yield backend
    backend.close()


def check_mixed(out):
    """``out`` is what torch gives for :func:`mixed`, but the float16 sum, which stays float32."""
    want = mixed(*MIXED_INPUTS)
    assert [o.dtype for o in out] == [w.dtype for w in want[:-1]] + [torch.float32]
    assert [o.shape for o in out] == [w.shape for w in want]
    for got, expected in zip(out, want):
        if got.is_floating_point():
            torch.testing.assert_close(got, expected.to(got.dtype), rtol=1e-2, atol=1e-2)
        else:
            assert torch.equal(got, expected)


def test_cpu_runs_every_dtype_as_torch_and_its_blob_and_repro_runner_run_the_same(cpu, program):
    import numpy as np
    import onnx
    info = cpu.describe()
    assert info["device"].startswith("cpu (") and "clang" in info["device"] and info["tinygrad"] == "0.14.0"
    assert "tinygrad 0.14.0" in info["version"] and torch.__version__ in info["version"]
    assert cpu.control == "ort" and TinygradBackend.control == "tinygrad:cpu"
    assert TinygradBackend.forms == ("tinygrad:webgpu", "tinygrad:cpu")
    assert cpu.refuse(program) is None
    compiled = cpu.compile(program)
    assert compiled.artifact_name == "model.onnx" and compiled.artifact == compiled.blob
    assert any(p.key == SIGNATURE_KEY for p in onnx.load_model_from_string(compiled.artifact).metadata_props)
    out = cpu.run(compiled, list(MIXED_INPUTS))
    check_mixed(out)
    again = cpu.run(Compiled(handle=cpu.load(compiled.blob)), list(MIXED_INPUTS))
    assert all(torch.equal(a, b) for a, b in zip(again, out))  # a cached blob runs the same
    doubled = cpu.run(compiled, [MIXED_INPUTS[0] * 2, *MIXED_INPUTS[1:]])  # the same runner, other inputs
    torch.testing.assert_close(doubled[0], (MIXED_INPUTS[0] * 2 @ MIXED_INPUTS[1]).relu())
    namespace = {}
    exec(compile(cpu.repro_runner(), "runner.py", "exec"), namespace)  # noqa: S102 - our own source
    alone = namespace["run"](compiled.artifact, [t.numpy() for t in MIXED_INPUTS],
                             ["float32", "float32", "int64", "bool", "float16", "float32"])
    assert len(alone) == len(out) and alone[5].dtype == np.float32  # bfloat16 travels as float32
    assert all(np.array_equal(a, o.float().numpy() if o.dtype == torch.bfloat16 else o.numpy()) for a, o in zip(alone, out))


def external_data_model(location: str) -> bytes:
    """ONNX bytes with the route's signature whose one initializer lives in the file ``location``."""
    from onnx import TensorProto, helper
    weight = TensorProto(name="w", data_type=TensorProto.FLOAT, dims=[4])
    weight.data_location = TensorProto.EXTERNAL
    weight.external_data.add(key="location", value=location)
    graph = helper.make_graph([helper.make_node("Add", ["x", "w"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])], [weight])
    model = helper.make_model(graph)
    model.metadata_props.add(key=SIGNATURE_KEY, value=json.dumps({"inputs": ["x"], "outputs": 1}))
    return model.SerializeToString()


def test_what_tinygrad_cannot_take_is_refused_with_the_reason(cpu, monkeypatch):
    from tapml.errors import TapmlError
    from tapml.platforms.targets import backend_prefix, describe_targets, load_backend_class
    with pytest.raises(BackendRefused, match="tinygrad's ONNX runner has no implementation of ONNX BitShift"):
        cpu.compile(exported(lambda x: (x << 1,), torch.tensor([1, 2], dtype=torch.int32)))
    assert "complex64, which the ONNX route does not carry" in cpu.refuse(exported(lambda z: (z * 2,), torch.randn(3, dtype=torch.complex64)))
    with pytest.raises(BackendRefused, match="could not load model.onnx: AssertionError: no fmt dtype for dtypes.bfloat16"):
        cpu.compile(exported(lambda x: (x.bfloat16() * 2,), torch.randn(3)))  # its parser reads a bfloat16 constant
    with pytest.raises(BackendRefused, match="does not parse"):
        cpu.load(b"\x00 not onnx \xff")
    with pytest.raises(BackendRefused, match="onnx external_data needs the origin file path"):
        cpu.load(external_data_model("/etc/passwd"))  # a tensor whose bytes are in a file: no file is read
    assert backend_prefix("tinygrad:webgpu") == "tinygrad" and load_backend_class("tinygrad:cpu") is TinygradBackend
    with pytest.raises(TapmlError, match="TinygradBackend takes: tinygrad:webgpu, tinygrad:cpu"):
        load_backend_class("tinygrad:metal")
    row = next(r for r in describe_targets() if r["target"] == "tinygrad")
    assert row["forms"] == ["tinygrad:webgpu", "tinygrad:cpu"] and row["importable"], row
    monkeypatch.setenv("PATH", "")
    with pytest.raises(BackendRefused, match="compiles with clang, which is not on PATH: apt-get install clang"):
        TinygradBackend("tinygrad:cpu")


@pytest.mark.device
@pytest.mark.xdist_group("wgpu")
def test_webgpu_names_the_dawn_adapter_runs_every_dtype_and_its_faults_are_verdicts(webgpu, cpu, program):
    info = webgpu.describe()
    assert re.match(r"(llvmpipe|lavapipe).* \(Dawn on Vulkan\)$", info["device"]), info
    assert info["dawn-python"] == "0.3.0" and "dawn-python 0.3.0" in info["version"]
    assert webgpu.control == "tinygrad:cpu"
    check_mixed(webgpu.run(webgpu.compile(program), list(MIXED_INPUTS)))
    assert "float64: WGSL has no 64-bit floats" in webgpu.refuse(exported(lambda x: (x.double(),), torch.randn(2)))
    # int64 is emulated in WGSL: floor division past 2**32 comes out wrong where tinygrad's CPU is right
    big = torch.tensor([1 << 40, -7])
    halve = exported(lambda ids: (ids // 2,), big)
    assert not torch.equal(webgpu.run(webgpu.compile(halve), [big])[0], big // 2)
    assert torch.equal(cpu.run(cpu.compile(halve), [big])[0], big // 2)
    # a tensor past lavapipe's 128 MiB storage binding: Dawn's validation error, raised (an error verdict)
    huge = torch.zeros(34_000_000)
    with pytest.raises(RuntimeError, match="larger than the maximum storage buffer binding size"):
        webgpu.run(webgpu.compile(exported(lambda x: (x + 1,), huge)), [huge])


FLOOR_DIVIDE_MODEL = '''
import torch


class Halve(torch.nn.Module):
    def forward(self, ids, x):
        return ids // 2, x * 2


def factory():
    return Halve(), (torch.tensor([1 << 40, -7, 9]), torch.randn(3))
'''


@pytest.mark.slow  # 13 s: a carve, a worker and its control's worker
@pytest.mark.device
def test_replay_names_the_op_tinygrad_webgpu_gets_wrong_and_blames_the_device_compiler(tmp_path_factory, tmp_path):
    """Over the CLI (the backend in its worker process): the failing case is named with its op, and its
    control (tinygrad:cpu, the same route on a mature device) passes it, so the WGSL side is blamed. The
    comparison's int64 policy judges a wrong value past the i32 range ``unsupported`` on any target."""
    store = store_from_source(tmp_path_factory, "halve", FLOOR_DIVIDE_MODEL)
    out, home = tmp_path / "v.json", tmp_path / "home"
    home.mkdir()
    r = tapml("replay", store.path, "--target", "tinygrad:webgpu", "--json", out,
              env={"HOME": str(home), "XDG_CACHE_HOME": str(home / ".cache")})
    assert r.returncode == 1, r.stdout + r.stderr
    assert not list(home.rglob("*tinygrad*"))  # tinygrad's own kernel cache (pickles) is neither read nor written
    doc = json.loads(out.read_text())
    assert doc["device"]["adapter"].endswith("(Dawn on Vulkan)") and "tinygrad 0.14.0" in doc["device"]["backend"]
    failed = [c for c in doc["cases"] if c["status"] != "pass"]
    assert [(c["op"], c["status"]) for c in failed] == [("aten.div.Tensor_mode", "unsupported")], doc["cases"]
    assert failed[0]["message"].startswith("int64 values outside the i32 range"), failed[0]
    assert (failed[0]["control"], failed[0]["control_status"], failed[0]["blame"]) == ("tinygrad:cpu", "pass", "device compiler")
    assert "aten.div.Tensor_mode" in r.stdout and "blame the device compiler" in r.stdout


@pytest.mark.slow  # 30 s: four workers (IREE compiles, two ONNX exporters) and tinygrad's control
@pytest.mark.device
def test_the_four_target_matrix_names_the_op_the_onnx_route_gets_wrong_in_the_terminal_and_in_html(carved, tmp_path):
    """zoo:fp16-sum (the README's example): the exporter drops the float16 cast of the sum, so both
    compilers fed by ONNX (ort, tinygrad:webgpu) fail it where tapml's WGSL and IREE pass."""
    pytest.importorskip("iree.runtime", reason="the backends extra is not installed")
    store = carved("zoo:fp16-sum", dtype="float16")
    targets = ["wgpu:vulkan", "iree:vulkan", "ort", "tinygrad:webgpu"]
    out = tmp_path / "m.json"
    r = tapml("replay", store, *(a for t in targets for a in ("--target", t)), "--json", out)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "1 differ between targets" in r.stdout and all(t in r.stdout for t in targets)
    assert re.search(r"aten\.sum\.dim_IntList\W+pass 1/1\W+pass 1/1\W+mismatch\W+mismatch", r.stdout), r.stdout
    data = json.loads(out.read_text())
    assert data["targets"] == targets and [c["target"] for c in data["matrix"]["columns"]] == targets
    (differs,) = [row for row in data["matrix"]["rows"] if row["group"] == "differs"]
    assert differs["op"] == "aten.sum.dim_IntList"
    assert [c["status"] for c in differs["cells"]] == ["pass", "pass", "mismatch", "mismatch"]
    r = tapml("report", out, "-o", tmp_path / "r.html")
    assert r.returncode == 1 and "wrote html report" in r.stderr, r.stdout + r.stderr  # 1: a verdict failed
    html = (tmp_path / "r.html").read_text()
    assert 'id="coverage-table"' in html and html.count('data-group="differs"') == 1 and all(t in html for t in targets)


# float16 only: float32 programs run on tinygrad:webgpu in the device tier above; each computing op's
# first case (each case is tinygrad compiles of its own: ~100 s a whole store on 2 cores)
@pytest.mark.slow
@pytest.mark.device
def test_every_computing_op_of_tiny_llama_float16_is_judged_on_tinygrad_webgpu(carved, tmp_path):
    store = carved("zoo:tiny-llama", dtype="float16")
    out = tmp_path / "v.json"
    ops = sorted({c["op"] for c in json.loads((store / "manifest.json").read_text())["cases"]} - LAYOUT_OPS)
    r = tapml("replay", store, "--target", "tinygrad:webgpu", *(a for op in ops for a in ("--op", op)),
              "--per-op", "1", "--json", out)
    assert r.returncode in (0, 1), r.stdout + r.stderr
    doc = json.loads(out.read_text())
    assert len(ops) >= 25 and sorted(c["op"] for c in doc["cases"]) == ops
    assert all(c["status"] in ("pass", "mismatch", "unsupported", "error") for c in doc["cases"])
    failed = [c for c in doc["cases"] if c["status"] != "pass"]
    assert (r.returncode == 1) == bool(failed), r.stdout
    for case in failed:  # each one named by its op, in the JSON and in what the terminal shows
        assert case["op"].startswith("aten.") and case["op"] in r.stdout, case


def test_time_resident_times_runs_on_realized_device_tensors_and_grows_with_the_work(cpu):
    """:meth:`Backend.time_resident` (what `tapml bench --target A --target B` puts beside run times)."""
    def product(n):
        gen = torch.Generator().manual_seed(n)
        a, b = torch.rand(n, n, generator=gen), torch.rand(n, n, generator=gen)
        compiled = cpu.compile(exported(lambda x, y: (x @ y,), a, b))
        seconds = cpu.time_resident(compiled, [a, b], 3)
        torch.testing.assert_close(cpu.run(compiled, [a, b])[0], a @ b, rtol=1e-4, atol=1e-3)
        return seconds
    small, large = product(16), product(256)
    assert 0 < small < large < 60
