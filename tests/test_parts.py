"""Tensors over the device's max-buffer-size are held in several device buffers (parts).

A small max-buffer-size is forced together with a small binding size (``Platform.force_limits``),
so that tensors of a few KiB are held in several parts, each bound through several windows; every
op family (tests/support.py SPLIT_FAMILIES) runs so on lavapipe Vulkan and llvmpipe GL (packed
float16/bfloat16 there), a whole tiny Llama runs as one program on Vulkan, one family set runs in
Chromium and through a real ``tapml serve``, all against torch. A repro of a multi-part case runs
outside tapml, programs with malformed ``parts`` are refused by the server's checks, and
``inspect --target`` says what was held in parts and why.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch
from typer.testing import CliRunner

from tapml.errors import Unsupported
from tapml.graph import Graph, Node, TensorMeta
from support import LOW, in_chromium, own_wgpu, run_split_families

TOKEN = "parts token"
#: A window of 4 KiB and buffers of two windows: the tiny models' 64 KiB embeddings take 8 parts.
SMALL = {"max-storage-buffer-binding-size": 4096, "max-buffer-size": 8192}


def _all_in_parts(held: dict) -> None:
    missing = [family for family, did in held.items() if not did]
    assert not missing, f"no tensor was held in parts bound through several windows for: {', '.join(missing)}"


def _windows_per_part(program) -> dict[str, int]:
    spans: dict[str, set] = {}
    for k in program.kernels:
        for b in k.bindings:
            spans.setdefault(b[0], set()).add(tuple(b[2:]))
    return {name: len(spans.get(name, ())) for t in program.parts for name, _, _ in t.parts}


# --- every op family, on both local adapters ---------------------------------------------------

@pytest.mark.device
@pytest.mark.xdist_group("wgpu")
@pytest.mark.parametrize("backend", ["vulkan", "gl"])
def test_every_op_family_runs_in_parts_onown_wgpu(backend):
    platform = own_wgpu(backend)
    try:
        _all_in_parts(run_split_families(platform, parts=True))
        # float16 native on Vulkan (shader-f16), packed two per word on GL; bfloat16 packed on both
        for dtype in LOW:
            held = run_split_families(platform, dtype, parts=True)
            _all_in_parts({f: did for f, did in held.items() if did is not None})
            assert sum(bool(did) for did in held.values()) >= 12, (dtype, held)
    finally:
        platform.close()


@pytest.mark.device
@pytest.mark.xdist_group("wgpu")
def test_whole_model_in_parts_as_one_program_on_vulkan(carved):
    from tapml.carving import CarveStore
    from tapml.judging.compare import compare_outputs
    store = CarveStore(carved("zoo:tiny-llama"))
    graph, inputs = store.graph, store.program_inputs()
    platform = own_wgpu("vulkan")
    try:
        platform.force_limits(SMALL)
        program = platform.compile(graph)
        counts = {t.name: len(t.parts) for t in program.parts}
        assert max(counts.values()) >= 8 and len(counts) >= 5, counts  # the [256, 64] embedding: 64 KiB / 8 KiB
        assert max(_windows_per_part(program).values()) == 2
        assert all(b.size <= SMALL["max-buffer-size"] for b in program.buffers)
        out = platform.run(program, [inputs[r] for r, _ in graph.inputs])
    finally:
        platform.close()
    ref = store.model_outputs()
    result = compare_outputs(out, [ref[r] for r in graph.outputs])
    assert result.passed, result.message


def _two_outputs_graph(n: int) -> Graph:
    """y = -x (x of ``n`` float32) and c2 = c + c (c of 4): the first split when forced, the second never."""
    big, small = TensorMeta((n,), "float32"), TensorMeta((4,), "float32")
    nodes = [Node("y", "aten.neg.default", [{"ref": "x"}], {}, [big]),
             Node("c2", "aten.add.Tensor", [{"ref": "c"}, {"ref": "c"}], {}, [small])]
    return Graph(inputs=[("x", big), ("c", small)], nodes=nodes, outputs=["y", "c2"])


@pytest.mark.device
@pytest.mark.xdist_group("wgpu")
def test_resident_tensors_beside_parts_and_split_ones_refused():
    """A generation keeps its cache on the device while a large weight is held in parts: kept
    outputs and resident inputs that are not split work as before; a split one is refused."""
    platform = own_wgpu("vulkan")
    try:
        graph = _two_outputs_graph(3000)
        whole = platform.compile(graph)  # the device's own limits: nothing split
        platform.force_limits(SMALL)
        program = platform.compile(graph)
        assert [t.name for t in program.parts] and not whole.parts
        x, c = torch.randn(3000), torch.arange(4.0)
        platform.run(program, [x, c])
        uploaded = platform.upload_bytes
        platform.run(program, [x, c])
        assert platform.upload_bytes == uploaded  # the same tensors again: their parts are not sent again
        x2 = x.clone()
        assert torch.equal(platform.run(program, [x2, c])[0], -x) and platform.upload_bytes == uploaded + 12000
        x.mul_(2)  # changed in place: sent again
        assert torch.equal(platform.run(program, [x, c])[0], -x) and platform.upload_bytes == uploaded + 24000
        y, cache = platform.run(program, [x, c], keep=[1])
        assert torch.equal(y, -x) and cache.shape == (4,)
        y, cache = platform.run(program, [x, cache], keep=[1])  # the kept output fed back, device-side
        assert torch.equal(y, -x) and torch.equal(platform.read(cache), c * 4)
        with pytest.raises(Unsupported, match="split across 2 device buffers.*cannot stay on the device"):
            platform.run(program, [x, c], keep=[0])
        held_whole, _ = platform.run(whole, [x, c], keep=[0])
        with pytest.raises(Unsupported, match="split across 2 device buffers.*host tensor"):
            platform.run(program, [held_whole, c])
    finally:
        platform.close()


# --- Chromium and a device server ---------------------------------------------------------------

@in_chromium
def test_op_families_run_in_parts_in_chromium():
    from tapml.platforms.browser import BrowserPlatform
    platform = BrowserPlatform()
    try:
        _all_in_parts(run_split_families(platform, parts=True))
        _all_in_parts(run_split_families(platform, torch.float16, parts=True))  # packed: SwiftShader lacks shader-f16
    finally:
        platform.close()


@pytest.mark.device
@pytest.mark.xdist_group("wgpu")
def test_parts_through_tapml_serve_and_hostile_parts_refused_there():
    from tapml.errors import TapmlError
    from tapml.remote.client import RemotePlatform
    from tapml.remote.launcher import ServerProcess
    from tapml.driving.targets import open_target
    try:
        open_target("wgpu:vulkan").close()
    except TapmlError as e:
        pytest.skip(f"no Vulkan adapter: {e}")
    srv = ServerProcess(platform="wgpu:vulkan", token=TOKEN)
    try:
        with RemotePlatform(srv.host, srv.port, token=TOKEN) as platform:
            _all_in_parts(run_split_families(platform, parts=True))  # compiled here, part buffers cross the wire
            platform.force_limits(SMALL)
            program = platform.compile(_two_outputs_graph(3000))
            platform.__dict__.pop("forced_limits")
            doc = program.to_json()
            doc["parts"][0]["parts"][1][1] += 4  # a gap between the parts of the input
            reply = json.loads(platform._call("load", json.dumps(doc)))
            assert reply["error"]["kind"] == "usage" and "cover its elements in order" in reply["error"]["message"]
            x = torch.randn(3000)
            assert torch.equal(platform.run(program, [x, torch.ones(4)])[0], -x)  # the real one still runs
    finally:
        assert srv.stop() == 0


# --- what a server accepts (no device) ----------------------------------------------------------

def _parts_program():
    from tapml.platforms.wgsl import compile_graph
    caps = {"adapter": "test", "backend": "vulkan", "features": [], "dtypes": [],
            "limits": {**SMALL, "min-storage-buffer-offset-alignment": 256}}
    return compile_graph(_two_outputs_graph(3000), caps)


def _edit(fn):
    from tapml.platforms.base import KernelProgram

    def make():
        doc = _parts_program().to_json()
        fn(doc)
        return KernelProgram.from_json(doc)
    return make


def _swap_parts(doc):
    parts = doc["parts"][0]["parts"]
    parts[0], parts[1] = parts[1], parts[0]


def _set(path, value):
    def edit(doc):
        target = doc
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value
    return edit


HOSTILE_PARTS = {
    "unknown buffer": (_set(["parts", 0, "parts", 0, 0], "nowhere"), "names no buffer"),
    "part of two tensors": (_set(["parts", 1, "parts", 0, 0], "i0.p0"), "already a part"),
    "gap": (_set(["parts", 0, "parts", 1, 1], 1000), "cover its elements in order"),
    "overlap": (_set(["parts", 0, "parts", 1, 1], 2), "cover its elements in order"),
    "out of order": (_swap_parts, "cover its elements in order"),
    "short of the tensor": (_set(["parts", 0, "meta", "shape"], [3001]), "cover 3000 of its 3001"),
    "count beyond its buffer": (_set(["parts", 0, "parts", 1, 2], 2000), "must be a buffer of role input holding float32\\[2000\\]"),
    "negative count": (_set(["parts", 0, "parts", 1, 2], -1), r"program\.parts\[0\]\.parts\[1\]\[2\] is -1: input should be greater than or equal to 0"),
    "wrong role": (_set(["parts", 0, "role"], "temp"), "must be a buffer of role temp"),
    "wrong dtype": (_set(["parts", 0, "meta", "dtype"], "int32"), "int32"),
    "one part": (lambda d: d["parts"][0]["parts"].pop(), "between 2 and"),
    "not in a row": (lambda d: d["inputs"].reverse(), "in a row, in order"),
    "listed twice": (lambda d: (d["inputs"].append("i0.p1"), d["input_meta"].append(d["input_meta"][1])), "once each"),
    "metas missing": (lambda d: d["input_meta"].pop(), "a meta for each"),
    "too many elements": (_set(["parts", 0, "meta", "shape"], [1 << 16, 1 << 15]), "2\\*\\*31"),
    "not a list": (_set(["parts"], {"i0": 1}), r"program\.parts is \{'i0': 1\}: input should be a valid list"),
    "malformed part": (_set(["parts", 0, "parts", 0], "i0.p0"), r"program\.parts\[0\]\.parts\[0\] is 'i0\.p0': input should be a valid tuple"),
}


@pytest.mark.parametrize("name", list(HOSTILE_PARTS))
def test_malformed_parts_are_refused_by_the_server_checks(name):
    from tapml.remote.limits import ServerLimits, check_program
    edit, message = HOSTILE_PARTS[name]
    assert check_program(_parts_program(), ServerLimits(), "wgsl")["buffer_bytes"] > 0  # the real one passes
    with pytest.raises((ValueError, TypeError, KeyError), match=message):
        check_program(_edit(edit)(), ServerLimits(), "wgsl")


def test_graph_programs_carry_no_parts():
    from tapml.platforms.base import KernelProgram, graph_program
    from tapml.remote.limits import ServerLimits, check_program
    doc = graph_program(_two_outputs_graph(8)).to_json()
    doc["parts"] = _parts_program().to_json()["parts"]
    with pytest.raises(ValueError, match="graph program has no split tensors"):
        check_program(KernelProgram.from_json(doc), ServerLimits(), "graph")


def test_program_json_round_trips_its_parts_and_the_device_sees_none():
    from tapml.platforms.base import KernelProgram
    program = _parts_program()
    again = KernelProgram.from_json(json.loads(program.dumps()))
    assert again.key == program.key and again.parts == program.parts
    device = program.device_program()
    assert not device.parts and device.inputs == program.inputs and "parts" not in device.to_json()
    assert [(m.shape, pos) for m, pos in program.tensor_inputs()] == [((3000,), [0, 1]), ((4,), [2])]
    assert [(m.shape, pos) for m, pos in program.tensor_outputs()] == [((3000,), [0, 1]), ((4,), [2])]
    x = torch.arange(3000.0).reshape(3000)
    pieces = program.split_tensors([x, torch.ones(4)])
    assert [p.shape for p in pieces] == [(2048,), (952,), (4,)] and pieces[0].data_ptr() == x.data_ptr()  # views
    assert torch.equal(program.join_outputs(pieces)[0], x)


# --- repro and inspect --------------------------------------------------------------------------

@pytest.mark.device
@pytest.mark.xdist_group("wgpu")
def test_repro_of_a_case_held_in_parts_runs_outside_tapml(carved, tmp_path):
    from tapml.carving import CarveStore
    from tapml.driving.repro import find_subject, write_repro
    store = CarveStore(carved("zoo:tiny-llama"))
    case = next(c for c in store.cases if c["op"] == "aten.embedding.default")
    platform = own_wgpu("vulkan")
    try:
        platform.force_limits(SMALL)
        result = write_repro(store, find_subject(store, case["id"]), platform, tmp_path / "r", target="wgpu:vulkan")
    finally:
        platform.close()
    assert result["observed"]["status"] == "pass", result["observed"]
    plan = json.loads((tmp_path / "r" / "plan.json").read_text())
    weight = [i for i in plan["inputs"] if i.get("tensor_shape") == [256, 64]]
    assert [i["part"] for i in weight] == list(range(8)) and weight[0]["parts"] == 8
    assert [i["elements"] for i in weight][:2] == [[0, 2048], [2048, 2048]]
    assert all(b["size"] <= SMALL["max-buffer-size"] for b in plan["buffers"])
    assert "part 1 of 8 of a float32[256, 64] tensor" in (tmp_path / "r" / "README.md").read_text()
    r = subprocess.run([sys.executable, "run.py", "--backend", "vulkan", "--json"], cwd=tmp_path / "r",
                       capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": ""})
    assert r.returncode == 0, r.stdout + r.stderr
    assert json.loads(r.stdout)["status"] == "pass"


@pytest.mark.device
@pytest.mark.xdist_group("wgpu")
def test_inspect_says_which_tensors_were_held_in_parts_and_why(carved, tmp_path):
    from tapml.cli import app
    store = str(carved("zoo:tiny-llama"))
    r = CliRunner().invoke(app, ["inspect", store, "--target", "wgpu:vulkan", "--device-limit", "max-buffer-size=8KiB",
                                 "--device-limit", "max-storage-buffer-binding-size=4KiB", "--json", str(tmp_path / "p.json")])
    assert r.exit_code == 0, r.output  # every case fits: nothing is unsupported for size
    doc = json.loads((tmp_path / "p.json").read_text())
    embedding = next(o for o in doc["ops"] if o["op"] == "aten.embedding.default")
    (split,) = embedding["splits"]
    assert (split["shape"], split["buffers"], split["windows"], split["limit"], split["limit_value"]) == \
        ([256, 64], 8, 16, "max-buffer-size", 8192)
    assert split["message"] == "f32 [256,64] 64 KiB -> 8 buffers over max-buffer-size 8 KiB, 16 windows of <= 4 KiB"
    assert doc["summary"]["fits"] and doc["summary"]["largest_split"]["buffers"] == 8
    text = " ".join(r.output.split())
    assert re.search(r"preflight: \d+ ops split across buffers and binding windows \(largest: f32 \[256,64\] 64 KiB "
                     r"in 8 buffers and 16 windows of <= 4 KiB\)", text), text
    assert "cannot" not in text and "unsupported" not in text
