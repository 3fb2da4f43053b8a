"""The ``ort`` backend: ONNX Runtime's CPU execution provider through torch's ONNX exporter.

Fast tier: :class:`OrtBackend` in this process on small exported programs (every dtype the route
carries, the blob round trip, the exporter's dropped float16 cast, refusals: bfloat16 without a
kernel, an op the exporter cannot convert, a dtype ONNX does not carry, a provider that falls back
or is not there) and ``tapml replay --target ort`` over the CLI (the backend in its worker process).
Slow tier: every case of zoo:tiny-llama's float32 and bfloat16 stores. The README's worked example (a
migration over ``ort``) is walked, and its shown output checked, by tests/test_readme.py.
"""

from __future__ import annotations

import json
import re

import pytest
import torch
from support import exported
from typer.testing import CliRunner

from tapml.cli import app
from tapml.platforms.backend import BackendRefused
from tapml.platforms.ort import SIGNATURE_KEY, OrtBackend  # before onnxruntime: it turns ORT's telemetry off

pytest.importorskip("onnxruntime", reason="the backends extra is not installed: pip install 'tapml[backends]'")


def tapml(*args):
    """``tapml ARGS`` in this process (an external backend still runs in its worker process)."""
    return CliRunner().invoke(app, [str(a) for a in args])


@pytest.fixture(scope="module")
def ort():
    backend = OrtBackend("ort")
    yield backend
    backend.close()


def test_describe_names_the_provider_the_versions_and_the_opset(ort):
    import onnxruntime
    info = ort.describe()
    assert info["providers"] == ["CPUExecutionProvider"] and "CPUExecutionProvider" in info["device"]
    assert info["onnxruntime"] == onnxruntime.__version__ and isinstance(info["opset"], int) and info["opset"] >= 18
    assert onnxruntime.__version__ in info["version"] and torch.__version__ in info["version"]
    assert OrtBackend.control is None and OrtBackend.forms == ("ort",)


def test_every_dtype_the_route_carries_runs_as_torch_runs_it(ort):
    a, b, ids = torch.randn(3, 4), torch.randn(4, 2), torch.arange(5)
    program = exported(lambda a, b, ids: ((a @ b).relu(), a.half() * 3, torch.cumsum(ids, 0), a > 0,
                                          a.bfloat16().float(), a.bfloat16()), a, b, ids)
    assert ort.refuse(program) is None
    compiled = ort.compile(program)
    got, want = ort.run(compiled, [a, b, ids]), program.module()(a, b, ids)
    assert [t.dtype for t in got] == [t.dtype for t in want] == [torch.float32, torch.float16, torch.int64,
                                                                   torch.bool, torch.float32, torch.bfloat16]
    for g, w in zip(got, want):  # float16: ORT's Mul may round once where torch's rounds twice (1 ulp)
        torch.testing.assert_close(g, w)


def test_the_onnx_model_is_the_artifact_and_its_blob_loads_into_a_session_that_runs_the_same(ort):
    import onnx
    x = torch.randn(2, 8)
    program = exported(lambda x, unused: (torch.softmax(x, -1), x), x, torch.ones(3))  # an output that is an input
    compiled = ort.compile(program)
    assert compiled.artifact_name == "model.onnx" and compiled.artifact == compiled.blob
    model = onnx.load_model_from_string(compiled.artifact)
    onnx.checker.check_model(model)
    assert any(p.key == SIGNATURE_KEY for p in model.metadata_props)
    loaded = ort.load(compiled.blob)
    first = ort.run(compiled, [x, torch.ones(3)])
    again = ort.run(type(compiled)(handle=loaded), [x, torch.ones(3)])
    assert all(torch.equal(f, g) for f, g in zip(first, again)) and torch.equal(first[1], x)


def test_a_blob_it_did_not_make_is_refused_never_run(ort):
    import onnx
    with pytest.raises(BackendRefused, match="does not parse"):
        ort.load(b"\x00 not onnx at all \xff")
    model = onnx.load_model_from_string(ort.compile(exported(lambda x: (x + 1,), torch.randn(3))).blob)
    for prop in model.metadata_props:
        if prop.key == SIGNATURE_KEY:
            prop.value = '{"inputs": "x", "outputs": -1}'
    with pytest.raises(BackendRefused, match=f"no valid {SIGNATURE_KEY} metadata \\({SIGNATURE_KEY}.inputs is 'x': "
                                             "input should be a valid list\\)"):
        ort.load(model.SerializeToString())


def test_the_exporter_drops_the_float16_cast_of_a_sum_and_the_output_keeps_the_dtype_it_came_back_in(ort):
    """The route's bug, as the README shows it: the program's output is float16, ONNX Runtime's float32.
    The backend returns it as made, so the comparison reports the changed dtype (never cast back)."""
    import onnx
    x = torch.randn(4, 8, dtype=torch.float16)
    program = exported(lambda x: (x.sum(-1),), x)
    compiled = ort.compile(program)
    declared = onnx.load_model_from_string(compiled.artifact).graph.output[0].type.tensor_type.elem_type
    assert program.module()(x)[0].dtype == torch.float16
    assert onnx.TensorProto.DataType.Name(declared) == "FLOAT"
    (out,) = ort.run(compiled, [x])
    assert out.dtype == torch.float32 and torch.allclose(out, x.float().sum(-1), atol=1e-3)


def test_bfloat16_without_a_cpu_kernel_is_refused_with_the_onnx_op_and_the_dtype(ort):
    program = exported(lambda a, b: (a @ b,), torch.randn(3, 4, dtype=torch.bfloat16), torch.randn(4, 2, dtype=torch.bfloat16))
    with pytest.raises(BackendRefused, match=r"CPUExecutionProvider has no kernel for ONNX MatMul\(\d+\) on bfloat16"):
        ort.compile(program)


def test_an_op_the_exporter_cannot_convert_is_refused_with_the_exporters_own_reason(ort):
    with pytest.raises(BackendRefused, match=r"ONNX exporter could not convert.*No ONNX function found for .*aten\.cummax"):
        ort.compile(exported(lambda x: (torch.cummax(x, 0)[0],), torch.randn(5)))


def test_a_dtype_onnx_does_not_carry_is_refused_before_compiling(ort):
    program = exported(lambda z: (z * 2,), torch.randn(3, dtype=torch.complex64))
    assert "complex64" in ort.refuse(program)


class _AzureProvider(OrtBackend):
    # installed with every onnxruntime wheel, and it runs no ordinary ONNX node: ORT falls back to the CPU
    provider = "AzureExecutionProvider"


class _AbsentProvider(OrtBackend):
    provider = "NoSuchExecutionProvider"


def test_a_provider_that_falls_back_silently_is_refused_naming_where_the_nodes_went():
    backend = _AzureProvider("ort")
    with pytest.raises(BackendRefused, match=r"did not put the program on AzureExecutionProvider.*Add .*on CPUExecutionProvider"):
        backend.compile(exported(lambda x: (x + 1,), torch.randn(3)))


def test_a_provider_this_onnxruntime_lacks_refuses_to_open():
    with pytest.raises(BackendRefused, match="has no NoSuchExecutionProvider"):
        _AbsentProvider("ort")


def test_replay_on_ort_judges_every_case_and_leaves_no_telemetry_behind(carved, tmp_path, monkeypatch):
    """Over the CLI, the backend in its worker process; ONNX Runtime's wheel would write a telemetry
    database under ~/.cache and a session file in $TMPDIR when it loads, were it not turned off."""
    store = carved("zoo:mlp")
    home, tmp, out = tmp_path / "home", tmp_path / "tmp", tmp_path / "v.json"
    home.mkdir(), tmp.mkdir()
    for name, value in (("HOME", home), ("TMPDIR", tmp), ("XDG_CACHE_HOME", home / ".cache")):
        monkeypatch.setenv(name, str(value))
    monkeypatch.delenv("ORT_DISABLE_TELEMETRY", raising=False)
    r = tapml("replay", store, "--target", "ort", "--json", out)
    assert r.exit_code == 0, r.output
    doc = json.loads(out.read_text())
    assert doc["cases"] and {c["status"] for c in doc["cases"]} == {"pass"}
    assert doc["device"]["adapter"] == "cpu (CPUExecutionProvider)" and doc["device"]["backend"].startswith("ort onnxruntime")
    left = [p for p in (*home.rglob("*"), *tmp.rglob("*")) if "Microsoft" in p.parts or p.name.endswith(".ses")]
    assert not left, left


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_every_case_of_tiny_llama_is_judged_on_ort(carved, tmp_path, dtype):
    store = carved("zoo:tiny-llama", dtype=dtype)
    out = tmp_path / "v.json"
    r = tapml("replay", store, "--target", "ort", "--json", out)
    doc = json.loads(out.read_text())
    statuses = [c["status"] for c in doc["cases"]]
    assert len(statuses) == len(json.loads((store / "manifest.json").read_text())["cases"])
    assert "error" not in statuses, [c for c in doc["cases"] if c["status"] == "error"]
    if dtype == "float32":
        assert r.exit_code == 0 and set(statuses) == {"pass"}, r.output
    else:  # ONNX Runtime's CPU provider has few bfloat16 kernels: each refusal names the op and the dtype
        refused = [c for c in doc["cases"] if c["status"] == "unsupported"]
        assert r.exit_code == 1 and refused, r.output
        assert all(re.search(r"no kernel for ONNX \w+\(\d+\) on .*bfloat16", c["message"]) for c in refused), refused
        assert {c["status"] for c in doc["cases"]} <= {"pass", "unsupported"}
