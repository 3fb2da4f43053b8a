"""Your own kernels (``--kernel OP=FILE.wgsl``): the README's example files replace tapml's lowering of
gelu and mm, run on real devices (lavapipe Vulkan, llvmpipe GL, a `tapml serve` on loopback), a wrong
one is a mismatch on exactly its cases, a broken one is unsupported with the device's own message.
The browser tier's check is in tests/test_browser.py."""

import json
import os
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from tapml.errors import TapmlError, Unsupported
from support import store_from_source

ROOT = Path(__file__).resolve().parents[1]
GELU = ROOT / "examples" / "kernels" / "gelu.wgsl"
MM = ROOT / "examples" / "kernels" / "mm.wgsl"

NET = textwrap.dedent("""
    import torch

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(8, 16, bias=False)
            self.b = torch.nn.Linear(16, 12, bias=False)

        def forward(self, x):
            h = torch.nn.functional.gelu(self.a(x))
            return torch.tanh(torch.nn.functional.gelu(self.b(h)) * 2.0)

    def factory():
        torch.manual_seed(0)
        return Net(), (torch.randn(5, 8),)
""")


@pytest.fixture(scope="module")
def net(tmp_path_factory):
    """Two mm and two gelu cases (other shapes each), a transposed weight and three other ops."""
    return store_from_source(tmp_path_factory, "kernel_net", NET)


def variant(tmp_path: Path, name: str, old: str, new: str) -> Path:
    """The README's gelu kernel with one line changed."""
    source = GELU.read_text()
    assert old in source
    path = tmp_path / name
    path.write_text(source.replace(old, new))
    return path


WRONG = ("y[i] = 0.5 * v * select(e, 2.0 - e, v >= 0.0);", "y[i] = 1.01 * (0.5 * v * select(e, 2.0 - e, v >= 0.0));")
BROKEN = ("let v = x[i];", "let v = x[i] + undefined_name;")


def gelu_graph(shape, dtype="float32"):
    from tapml.platforms.wgsl.registry import case_graph
    return case_graph("aten.gelu.default", [torch.randn(*shape).to(getattr(torch, dtype))])[0]


# --- the file and the program, no device ------------------------------------------------------

def test_the_compiled_program_carries_the_file_and_follows_the_convention():
    from tapml.platforms.wgsl import compile_graph
    from tapml.platforms.wgsl.registry import case_graph
    from tapml.platforms.wgsl.user_kernels import HEADER, RECORD, parse_kernel_options, user_lowerings
    kernels = parse_kernel_options([f"aten.mm.default={MM}"])
    a, b = torch.randn(5, 8), torch.randn(12, 8).t()  # b is a transposed view: made contiguous for the kernel
    graph, _ = case_graph("aten.mm.default", [a, b])
    program = compile_graph(graph, {"limits": {"max-compute-workgroups-per-dimension": 65535}}, user_lowerings(kernels))
    mine = [k for k in program.kernels if k.wgsl == MM.read_text()]
    assert len(mine) == 1 and mine[0].entry == "main" and mine[0].workgroups == (1, 1, 1)
    buffers = {buf.name: buf for buf in program.buffers}
    ins, out, shapes = mine[0].bindings[:2], mine[0].bindings[2], mine[0].bindings[3]
    assert [acc for _, acc in mine[0].bindings] == ["read", "read", "read_write", "read"]
    assert out[0] == program.outputs[0] and buffers[ins[0][0]].role == "input"
    words = struct.unpack(f"<{buffers[shapes[0]].size // 4}I", buffers[shapes[0]].data)
    assert words[:HEADER] == (2, 1, 60, 64)  # inputs, outputs, elements of the output, invocations per grid row
    records = [words[HEADER + k * RECORD:HEADER + (k + 1) * RECORD] for k in range(3)]
    assert records[0][:4] == (2, 40, 5, 8) and records[0][10:12] == (8, 1)  # rank, numel, sizes, strides
    assert records[1][:4] == (2, 96, 8, 12) and records[1][10:12] == (12, 1)
    assert records[2][:4] == (2, 60, 5, 12) and records[2][4:10] == (0,) * 6


def test_dispatch_splits_over_y_past_the_per_dimension_limit():
    from tapml.platforms.wgsl import compile_graph
    from tapml.platforms.wgsl.user_kernels import HEADER, parse_kernel_options, user_lowerings
    lowerings = user_lowerings(parse_kernel_options([f"aten.gelu.default={GELU}"]))
    program = compile_graph(gelu_graph((7, 100)), {"limits": {"max-compute-workgroups-per-dimension": 4}}, lowerings)
    (kernel,) = [k for k in program.kernels if k.wgsl == GELU.read_text()]
    assert kernel.workgroups == (4, 3, 1)  # 700 invocations in groups of 64: 11 groups, 4 per row
    shapes = next(b for b in program.buffers if b.name == kernel.bindings[-1][0])
    assert struct.unpack("<4I", shapes.data[:16]) == (1, 1, 700, 256)
    with pytest.raises(Unsupported, match="more than 2x2 workgroups"):
        compile_graph(gelu_graph((7, 100)), {"limits": {"max-compute-workgroups-per-dimension": 2}}, lowerings)


def test_a_case_no_file_fits_is_unsupported_with_the_reason():
    from tapml.platforms.wgsl import compile_graph
    from tapml.platforms.wgsl.user_kernels import parse_kernel_options, user_lowerings
    lowerings = user_lowerings(parse_kernel_options([f"aten.gelu.default={GELU}"]))
    with pytest.raises(Unsupported, match=r"gelu.wgsl declares read f32, read_write f32, read u32; this case needs "
                                          r"read f16, read_write f16, read u32"):
        compile_graph(gelu_graph((3, 4), "float16"), {"features": ["shader-f16"]}, lowerings)
    with pytest.raises(Unsupported, match="bfloat16 is held packed two per u32"):
        compile_graph(gelu_graph((3, 4), "bfloat16"), {}, lowerings)


def test_a_device_server_accepts_a_program_with_a_user_kernel():
    from tapml.platforms.wgsl import compile_graph
    from tapml.platforms.wgsl.user_kernels import parse_kernel_options, user_lowerings
    from tapml.remote.limits import ServerLimits, check_program
    program = compile_graph(gelu_graph((5, 16)), {}, user_lowerings(parse_kernel_options([f"aten.gelu.default={GELU}"])))
    assert [k.wgsl for k in program.kernels] == [GELU.read_text()]
    assert check_program(program, ServerLimits(), "wgsl")["invocations"] == 2 * 64  # 80 elements, groups of 64


@pytest.mark.parametrize("text, error", [
    (b"\xff\xfe not text", "not UTF-8"),
    (GELU.read_bytes().replace(b"fn main(", b"fn entry("), "entry point 'main' must be declared once"),
    (GELU.read_bytes().replace(b"@workgroup_size(64)", b"@workgroup_size(N)"), "only integer literals"),
    (GELU.read_bytes().replace(b"@binding(2)", b"@binding(5)"), r"@binding\(0\) .. @binding\(N-1\)"),
    (GELU.read_bytes().replace(b"array<u32>", b"array<f32>"), "the last binding must be the shapes buffer"),
    (GELU.read_bytes().replace(b"array<f32>;\n@group(0) @binding(1)", b"array<f32, 4>;\n@group(0) @binding(1)"),
     "fixed-size array"),
    (GELU.read_bytes() + b"\n@group(1) @binding(0) var<uniform> u: vec4<f32>;\n", "uniform"),
    (GELU.read_bytes() + b"\n" + b"/" * (256 << 10), "more than the 262144 bytes"),
])
def test_a_bad_kernel_file_is_refused_saying_what_to_fix(tmp_path, text, error):
    from tapml.platforms.wgsl.user_kernels import parse_kernel_options
    path = tmp_path / "k.wgsl"
    path.write_bytes(text)
    with pytest.raises(TapmlError, match=error):
        parse_kernel_options([f"aten.gelu.default={path}"])


@pytest.mark.parametrize("item, error", [
    ("aten.gelu.default", "expected OP=FILE.wgsl"),
    ("aten.gelu=g.wgsl", "full aten overload name"),
    ("aten.gelu_.default=g.wgsl", "refused: it writes to its argument"),
    ("aten.gelu.default=/nonexistent/g.wgsl", "cannot read --kernel aten.gelu.default=/nonexistent/g.wgsl"),
])
def test_bad_kernel_options_say_what_is_wrong(item, error):
    from tapml.platforms.wgsl.user_kernels import parse_kernel_options
    with pytest.raises(TapmlError, match=error):
        parse_kernel_options([item])


def test_targets_that_run_no_wgsl_refuse_kernels():
    from tapml.driving.targets import open_target
    for spec in ("reference", "registry://127.0.0.1:9?platform=wgpu"):
        with pytest.raises(TapmlError, match="--kernel replaces a lowering of tapml's WGSL compiler"):
            open_target(spec, kernels=[f"aten.gelu.default={GELU}"])


def test_a_suite_carries_its_kernel_files(net, tmp_path):
    from tapml.carving.gentests import generate_suite
    info = generate_suite(net.path, tmp_path / "suite", kernels=[("aten.gelu.default", "my gelu.wgsl", GELU.read_bytes())])
    carried = tmp_path / "suite" / "kernels" / "00_my_gelu.wgsl"
    assert carried.read_bytes() == GELU.read_bytes() and info["kernels"] == [f"aten.gelu.default={carried}"]
    assert "KERNELS = [('aten.gelu.default', '00_my_gelu.wgsl'), ]" in (tmp_path / "suite" / "conftest.py").read_text()
    generate_suite(net.path, tmp_path / "suite")  # regenerated without kernels: none are carried
    assert not (tmp_path / "suite" / "kernels").exists()


def test_the_readme_shows_the_shipped_gelu_kernel_and_its_convention():
    from tapml.platforms.wgsl.user_kernels import HEADER, MAX_KERNEL_BYTES, MAX_RANK, RECORD
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("### Your own kernels"):readme.index("## Op coverage")]
    shown = section[section.index("```wgsl\n") + len("```wgsl\n"):]
    assert shown[:shown.index("```")] == GELU.read_text()
    assert f"from word `{HEADER} + {RECORD}k`" in section and f"{MAX_RANK} sizes, {MAX_RANK} contiguous strides" in section
    assert f"at most {MAX_KERNEL_BYTES >> 10} KiB" in section


# --- on devices -------------------------------------------------------------------------------

def replay_with(store, spec: str, kernels: list[str], **options):
    from tapml.driving.replay import replay
    from tapml.driving.targets import open_target
    with open_target(spec, kernels=kernels, **options) as platform:
        return replay(store, platform, spec)


def statuses(result) -> dict[str, str]:
    return {c["id"]: c["status"] for c in result["cases"]}


@pytest.mark.device
@pytest.mark.xdist_group("wgpu")
@pytest.mark.parametrize("backend", ["vulkan", "gl"])
def test_the_readme_kernels_pass_every_gelu_and_mm_case(net, backend):
    from tapml.platforms.wgpu_native import available_backends
    if backend not in available_backends():
        pytest.skip(f"no wgpu {backend} adapter (install mesa-vulkan-drivers and libegl-mesa0)")
    result = replay_with(net, f"wgpu:{backend}", [f"aten.gelu.default={GELU}", f"aten.mm.default={MM}"])
    assert result["summary"]["pass"] == len(net.cases) == 8, result["cases"]
    assert sorted(c["op"] for c in net.cases).count("aten.gelu.default") == 2


@pytest.mark.device
@pytest.mark.xdist_group("wgpu")
def test_a_wrong_kernel_is_a_mismatch_on_exactly_its_cases(net, tmp_path):
    from support import vulkan_or_skip
    vulkan_or_skip()
    wrong = variant(tmp_path, "wrong_gelu.wgsl", *WRONG)
    result = replay_with(net, "wgpu:vulkan", [f"aten.gelu.default={wrong}"])
    gelu = {c["id"] for c in net.cases if c["op"] == "aten.gelu.default"}
    assert {i for i, s in statuses(result).items() if s != "pass"} == gelu
    assert all(statuses(result)[i] == "mismatch" for i in gelu)


@pytest.mark.device
@pytest.mark.xdist_group("wgpu")
def test_a_kernel_the_device_cannot_compile_is_unsupported_with_its_message(net, tmp_path):
    from support import vulkan_or_skip
    vulkan_or_skip()
    broken = variant(tmp_path, "broken_gelu.wgsl", *BROKEN)
    result = replay_with(net, "wgpu:vulkan", [f"aten.gelu.default={broken}"])
    failed = [c for c in result["cases"] if c["status"] != "pass"]
    assert {c["op"] for c in failed} == {"aten.gelu.default"} and len(failed) == 2
    for case in failed:
        assert case["status"] == "unsupported"
        assert f"--kernel {broken} does not compile on wgpu:vulkan" in case["message"]
        assert "undefined_name" in case["message"] and "let v = x[i] + undefined_name" in case["message"]


@pytest.mark.device
@pytest.mark.xdist_group("wgpu")
def test_migrate_and_session_name_a_wrong_kernel_as_the_culprit(net, tmp_path):
    """The wrong gelu inside regions and the whole model too: migrate puts exactly the gelu nodes
    back on the reference; a session that offloads everything bisects to a gelu node."""
    from support import vulkan_or_skip
    vulkan_or_skip()
    from tapml import Session
    from tapml.driving.migrate import Migration
    from tapml.driving.targets import open_target
    wrong = [f"aten.gelu.default={variant(tmp_path, 'wrong_gelu.wgsl', *WRONG)}", f"aten.mm.default={MM}"]
    gelu_nodes = sorted(c["node"] for c in net.cases if c["op"] == "aten.gelu.default")
    with open_target("wgpu:vulkan", kernels=wrong) as platform:
        state = Migration(net, platform, "wgpu:vulkan", tmp_path / "s.json", kernels=wrong).run()
        with pytest.raises(TapmlError, match=r"cannot resume .*kernels: journal has .*wrong_gelu.wgsl sha256:"):
            Migration(net, platform, "wgpu:vulkan", tmp_path / "s.json", resume=True,
                      kernels=[f"aten.gelu.default={GELU}", f"aten.mm.default={MM}"]).run()
    assert {(c["kind"], c["op"]) for c in state["culprits"]} == {("op", "aten.gelu.default")}, state["culprits"]
    assert sorted(c["node"] for c in state["culprits"]) == gelu_nodes
    assert sorted(n for n, where in state["placement"]["nodes"].items() if where == "reference") == gelu_nodes
    assert state["end_to_end"]["status"] == "pass"
    with Session(str(net.path), target="wgpu:vulkan", kernels=wrong) as s:
        s.offload("all")
        assert s.compare_model()["status"] == "mismatch"
        culprit = s.bisect()
        assert culprit["op"] == "aten.gelu.default" and set(culprit["nodes"]) <= set(gelu_nodes)


F16_GELU = GELU.read_text().replace("array<f32>", "array<f16>").replace(
    "  let v = x[i];", "  let v = f32(x[i]);").replace(
    "  y[i] = 0.5 * v * select(e, 2.0 - e, v >= 0.0);", "  y[i] = f16(0.5 * v * select(e, 2.0 - e, v >= 0.0));")


@pytest.mark.device
@pytest.mark.xdist_group("wgpu")
def test_an_f16_kernel_runs_float16_cases_where_the_device_has_shader_f16(tmp_path):
    """Vulkan (lavapipe) has shader-f16: the f16 file takes the float16 case, the f32 file the float32
    one; GL (llvmpipe) has not, so its float16 case is unsupported and says why."""
    from support import own_wgpu
    from tapml.judging.compare import compare_anchored
    from tapml.platforms.kernel_override import KernelOverridePlatform
    from tapml.platforms.wgsl.user_kernels import parse_kernel_options
    f16 = tmp_path / "gelu_f16.wgsl"
    f16.write_text("enable f16;\n" + F16_GELU)
    kernels = parse_kernel_options([f"aten.gelu.default={GELU}", f"aten.gelu.default={f16}"])
    torch.manual_seed(0)
    x = torch.randn(9, 33)
    with KernelOverridePlatform(own_wgpu("vulkan"), kernels) as vulkan:
        assert "shader-f16" in vulkan.caps()["features"]
        for dtype in (torch.float32, torch.float16):
            graph = gelu_graph((9, 33), str(dtype).split(".")[1])
            program = vulkan.compile(graph)
            assert [k.wgsl for k in program.kernels] == [(GELU if dtype == torch.float32 else f16).read_text()]
            (out,) = vulkan.run(program, [x.to(dtype)])
            expected = torch.nn.functional.gelu(x.to(dtype))
            exact = torch.nn.functional.gelu(x.to(dtype).double())
            assert out.dtype == dtype and compare_anchored([out], [expected], [exact]).passed
    with KernelOverridePlatform(own_wgpu("gl"), kernels) as gl:
        with pytest.raises(Unsupported, match="float16 without shader-f16 is held packed two per u32"):
            gl.compile(gelu_graph((9, 33), "float16"))


def tapml_cli(*args, timeout=300):
    env = {**os.environ, "XDG_RUNTIME_DIR": os.environ.get("XDG_RUNTIME_DIR", "/tmp")}
    return subprocess.run([sys.executable, "-m", "tapml.cli", *args], capture_output=True, text=True, env=env,
                          timeout=timeout)


@pytest.mark.device
@pytest.mark.xdist_group("wgpu")
def test_cli_replay_with_kernels_and_exit_2_for_a_missing_file(net, tmp_path):
    from support import vulkan_or_skip
    vulkan_or_skip()
    wrong = variant(tmp_path, "wrong_gelu.wgsl", *WRONG)
    r = tapml_cli("replay", str(net.path), "-t", "wgpu:vulkan", "--kernel", f"aten.gelu.default={wrong}",
                  "--kernel", f"aten.mm.default={MM}", "--json", str(tmp_path / "v.json"), "-q")
    assert r.returncode == 1, r.stdout + r.stderr
    doc = json.loads((tmp_path / "v.json").read_text())
    assert doc["summary"]["mismatch"] == 2 and doc["summary"]["pass"] == 6
    r = tapml_cli("replay", str(net.path), "-t", "wgpu:vulkan", "--kernel", f"aten.gelu.default={tmp_path / 'nope.wgsl'}")
    assert r.returncode == 2 and "cannot read --kernel aten.gelu.default=" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.slow
@pytest.mark.device
@pytest.mark.xdist_group("wgpu")
def test_a_generated_suite_reruns_its_kernels_under_pytest(net, tmp_path):
    from support import vulkan_or_skip
    vulkan_or_skip()
    wrong = variant(tmp_path, "wrong_gelu.wgsl", *WRONG)
    r = tapml_cli("gen-tests", str(net.path), "-o", str(tmp_path / "suite"), "--kernel", f"aten.gelu.default={wrong}")
    assert r.returncode == 0, r.stderr
    run = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path / "suite"), "--tapml-target", "wgpu:vulkan"]
    carried = subprocess.run(run, capture_output=True, text=True, timeout=300)
    assert carried.returncode == 1 and "2 failed, 6 passed" in carried.stdout, carried.stdout[-2000:]
    assert "test_aten_gelu_default" in carried.stdout
    fixed = subprocess.run(run + ["--tapml-kernel", f"aten.gelu.default={GELU}"], capture_output=True, text=True, timeout=300)
    assert fixed.returncode == 0 and "8 passed" in fixed.stdout, fixed.stdout[-2000:]


@pytest.mark.slow
@pytest.mark.device
@pytest.mark.xdist_group("wgpu")
def test_kernels_run_on_a_remote_device_server(net, tmp_path):
    from support import vulkan_or_skip
    vulkan_or_skip()
    from tapml.remote.launcher import ServerProcess
    wrong, broken = variant(tmp_path, "wrong.wgsl", *WRONG), variant(tmp_path, "broken.wgsl", *BROKEN)
    with ServerProcess(platform="wgpu:vulkan", token="kernel-test") as srv:
        target = f"remote://{srv.host}:{srv.port}"
        good = replay_with(net, target, [f"aten.gelu.default={GELU}", f"aten.mm.default={MM}"], token="kernel-test")
        assert good["summary"]["pass"] == 8, good["cases"]
        bad = replay_with(net, target, [f"aten.gelu.default={wrong}", f"aten.mm.default={broken}"], token="kernel-test")
        by_op = {}
        for c in bad["cases"]:
            by_op.setdefault(c["op"], set()).add(c["status"])
        assert by_op["aten.gelu.default"] == {"mismatch"}
        # a gelu kernel given for mm does not fit mm's two inputs: unsupported, saying so
        assert by_op["aten.mm.default"] == {"unsupported"}
        assert all(v == {"pass"} for op, v in by_op.items() if op not in ("aten.gelu.default", "aten.mm.default"))
        assert "no --kernel file fits this case" in next(c["message"] for c in bad["cases"] if c["op"] == "aten.mm.default")
