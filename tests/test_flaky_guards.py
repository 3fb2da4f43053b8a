"""Flaky kernels (``replay --repeat K``) and out-of-bounds writes (``replay --guards``).

Two planted defects, built here as KernelPrograms and run through the real wgpu-native run
path on lavapipe: a racy kernel whose workgroups race for an atomic ticket (its outputs vary
from run to run), and a kernel whose index math goes past its tensor's end (it writes into the
guard behind the tensor). Neither is reachable from the product CLI. A healthy zoo:mlp store
replayed with ``--repeat 5`` and ``--guards`` finds nothing. Last, a flake of the tests' own: a
device closed while wgpu-py's poll thread still waits on its queue.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from tapml.errors import PlatformError
from tapml.judging.flaky import RunToRun, classify, text_map
from tapml.graph import TensorMeta
from tapml.platforms.base import BufferSpec, Kernel, KernelProgram
from tapml.judging.verdict import STATUSES, VerdictDocument, summary
from support import vulkan_or_skip

TAPML = [sys.executable, "-m", "tapml.cli"]




# --- the analysis, no device ---------------------------------------------------------------

def _mask(rows, cols, cells):
    m = np.zeros((rows, cols), bool)
    for r, c in cells:
        m[r, c] = True
    return m


def test_patterns_are_classified():
    rows = np.zeros((8, 16), bool)
    rows[[1, 5]] = True
    assert classify(rows) == "whole rows (2 of 8)"
    cols = np.zeros((8, 16), bool)
    cols[:, 3] = True
    assert classify(cols) == "whole columns (1 of 16)"
    tiles = np.zeros((32, 64), bool)
    tiles[8:16, 0:8] = True
    tiles[24:32, 40:48] = True
    assert classify(tiles) == "tiles of 8x8 (2 of 32 tiles)"
    assert classify(_mask(8, 16, [(0, 0), (3, 7), (6, 2)])) == "scattered"
    assert classify(np.ones((4, 4), bool)) == "all elements"


def test_the_map_is_downsampled_to_at_most_32_by_64_cells():
    m = np.zeros((100, 1000), bool)
    m[50, 999] = True
    lines = text_map(m)
    assert len(lines) == 32 and {len(line) for line in lines} == {64}
    assert "".join(lines).count("#") == 1 and lines[16][63] == "#"
    assert text_map(np.array([[True, False, True]])) == ["#.#"]


def test_run_to_run_compares_bits_so_poison_that_comes_and_goes_varies():
    first = torch.tensor([[1.0, float("nan")], [3.0, 4.0]])
    same = RunToRun([first])
    same.add([first.clone()])  # NaN == NaN bit for bit: not a difference
    assert same.report() is None
    runs = RunToRun([first])
    runs.add([torch.tensor([[1.0, 2.0], [3.0, 4.0]])])  # the unwritten (poison) element got written
    runs.add([first.clone()])
    report = runs.report()
    assert report.startswith("outputs varied run to run: 1 of 2 repeat runs differed from run 1 (50%)")
    assert "1 of 4 elements varied (25.0%), pattern: scattered" in report
    assert report.splitlines()[-2:] == [".#", ".."]


def test_flaky_is_a_status_of_its_own_in_verdict_files():
    assert "flaky" in STATUSES and "mismatch" in STATUSES
    doc = {"target": "wgpu:vulkan", "cases": [{"id": "c0", "op": "aten.add.Tensor", "status": "flaky",
                                               "message": "outputs varied run to run"}],
           "summary": {"pass": 0, "mismatch": 0, "unsupported": 0, "error": 0, "flaky": 1}}
    read = VerdictDocument.from_json(doc, "v.json")
    assert read.cases[0].status == "flaky" and summary(read.cases)["flaky"] == 1 and not read.passed


# --- the planted defects on lavapipe -------------------------------------------------------

ROWS, COLS = 64, 64

ZERO_COUNTER = """
@group(0) @binding(0) var<storage, read_write> counter: array<atomic<u32>>;
@compute @workgroup_size(1) fn main() { atomicStore(&counter[0], 0u); }
"""

# Each 8x8 workgroup spins, then takes a ticket from a shared counter with no ordering between
# workgroups; one workgroup in five adds its ticket to its tile. Which workgroup gets which
# ticket depends on how lavapipe's threads interleave, so those tiles vary from run to run.
RACY_TICKETS = """
@group(0) @binding(0) var<storage, read> x: array<f32>;
@group(0) @binding(1) var<storage, read_write> counter: array<atomic<u32>>;
@group(0) @binding(2) var<storage, read_write> y: array<f32>;
var<workgroup> ticket: u32;
@compute @workgroup_size(8, 8) fn main(@builtin(global_invocation_id) g: vec3<u32>,
                                       @builtin(local_invocation_index) l: u32,
                                       @builtin(workgroup_id) w: vec3<u32>) {
  var spin = x[0];
  for (var k = 0u; k < 20000u; k++) { spin = spin * 0.5 + 1.0; }
  if (l == 0u) { ticket = atomicAdd(&counter[0], 1u); }
  workgroupBarrier();
  let i = g.y * COLSu + g.x;
  let racy = (w.x + 2u * w.y) % 5u == 0u;
  y[i] = x[i] + select(0.0, f32(workgroupUniformLoad(&ticket)), racy);
  if (spin == 12345.0) { y[i] = 0.0; }
}
""".replace("COLS", str(COLS))


def _racy_program() -> KernelProgram:
    meta = TensorMeta((ROWS, COLS), "float32")
    return KernelProgram(
        kind="wgsl", inputs=["x"], outputs=["y"], input_meta=[meta], output_meta=[meta],
        buffers=[BufferSpec("x", "f32", ROWS * COLS * 4, "input", meta),
                 BufferSpec("counter", "u32", 4, "temp", TensorMeta((1,), "int32")),
                 BufferSpec("y", "f32", ROWS * COLS * 4, "output", meta)],
        kernels=[Kernel("zero_counter_0", ZERO_COUNTER, [("counter", "read_write")], (1, 1, 1)),
                 Kernel("racy_tickets_0", RACY_TICKETS, [("x", "read"), ("counter", "read_write"), ("y", "read_write")],
                        (COLS // 8, ROWS // 8, 1))])


N = 100

COPY_TO_TEMP = f"""
@group(0) @binding(0) var<storage, read> x: array<f32>;
@group(0) @binding(1) var<storage, read_write> t: array<f32>;
@compute @workgroup_size(64) fn main(@builtin(global_invocation_id) g: vec3<u32>) {{
  if (g.x < {N}u + EXTRAu) {{ t[g.x] = x[min(g.x, {N - 1}u)] * 2.0; }}
}}
"""

# Off by EXTRA: the last invocation's index math lands EXTRA elements past its own, past the tensor.
STORE_PAST_END = f"""
@group(0) @binding(0) var<storage, read> t: array<f32>;
@group(0) @binding(1) var<storage, read_write> y: array<f32>;
@compute @workgroup_size(64) fn main(@builtin(global_invocation_id) g: vec3<u32>) {{
  if (g.x < {N}u) {{
    let i = select(g.x, g.x + EXTRAu, g.x == {N - 1}u);
    y[i] = t[g.x] + 1.0;
    y[g.x] = t[g.x] + 1.0;
  }}
}}
"""


def _oob_program(temp_extra: int = 0, out_extra: int = 0) -> KernelProgram:
    meta = TensorMeta((N,), "float32")
    return KernelProgram(
        kind="wgsl", inputs=["x"], outputs=["y"], input_meta=[meta], output_meta=[meta],
        buffers=[BufferSpec("x", "f32", N * 4, "input", meta), BufferSpec("t", "f32", N * 4, "temp", meta),
                 BufferSpec("y", "f32", N * 4, "output", meta)],
        kernels=[Kernel("copy_to_temp_0", COPY_TO_TEMP.replace("EXTRA", str(temp_extra)),
                        [("x", "read"), ("t", "read_write")], (2, 1, 1)),
                 Kernel("store_past_end_0", STORE_PAST_END.replace("EXTRA", str(out_extra)),
                        [("t", "read"), ("y", "read_write")], (2, 1, 1))])


@pytest.fixture(scope="module")
def guarded():
    """A Vulkan platform of its own with guards on (the shared one stays unguarded)."""
    vulkan_or_skip()
    from tapml.platforms.wgpu_native import WgpuPlatform
    platform = WgpuPlatform("vulkan")
    assert platform.enable_guards()
    yield platform
    platform.close()


@pytest.mark.device
def test_a_racy_kernel_is_flaky_with_the_tiles_that_varied(figure):
    vulkan_or_skip()
    from tapml.platforms.wgpu_native import shared_platform
    from tapml.driving.replay import flaky_verdict, repeat_runs
    from tapml.judging.verdict import Verdict
    platform = shared_platform("vulkan")
    program, x = _racy_program(), torch.zeros(ROWS, COLS)
    first = platform.run(program, [x])
    report = repeat_runs(platform, program, [x], first, 20)
    assert report is not None, "the racy kernel gave bit-identical outputs in 20 runs"
    head = report.splitlines()[0]
    differed = int(head.split(": ")[1].split(" of ")[0])
    figure("racy kernel: repeat runs of 19 that differed from run 1", differed)
    assert 1 <= differed <= 19 and head.endswith(f"({differed / 19:.0%})")
    pattern = report.splitlines()[1].split("pattern: ")[1]
    # every invocation of a racy workgroup adds the same ticket: what varies is whole 8x8 tiles
    assert pattern.startswith("tiles of 8x8 ("), pattern
    assert int(pattern.split("(")[1].split(" of ")[0]) <= 13  # 13 of the 64 tiles are racy
    grid = report.splitlines()[3:]
    assert len(grid) == 32 and all(len(line) == 64 and set(line) <= {".", "#"} for line in grid) and "#" in "".join(grid)
    verdict = flaky_verdict(Verdict(status="pass", max_abs_err=0.0), report)
    assert verdict.status == "flaky" and verdict.message.endswith("run 1 against the reference: pass")


@pytest.mark.device
def test_a_healthy_program_repeated_is_not_flaky():
    vulkan_or_skip()
    from tapml.platforms.wgpu_native import shared_platform
    from tapml.driving.replay import repeat_runs
    platform = shared_platform("vulkan")
    program, x = _oob_program(), torch.randn(N)
    assert repeat_runs(platform, program, [x], platform.run(program, [x]), 10) is None


@pytest.mark.device
def test_a_write_past_the_output_is_an_error_naming_kernel_buffer_and_offset(guarded):
    with pytest.raises(PlatformError) as e:
        guarded.run(_oob_program(out_extra=3), [torch.randn(N)])
    assert ("kernel store_past_end_0 wrote past buffer y (output f32[100], 400 bytes): "
            "first bad byte at offset +8 after its end (last at +11") in str(e.value)  # y[99 + 3]: bytes 408..411


@pytest.mark.device
def test_a_write_past_a_temp_buffer_names_the_kernel_that_wrote_it(guarded):
    with pytest.raises(PlatformError) as e:
        guarded.run(_oob_program(temp_extra=1), [torch.randn(N)])
    assert "kernel copy_to_temp_0 wrote past buffer t (temp f32[100], 400 bytes): first bad byte at offset +0" in str(e.value)


@pytest.mark.device
def test_guards_pass_a_correct_program_and_are_refilled_every_run(guarded):
    x = torch.randn(N)
    healthy = _oob_program()
    for _ in range(2):
        assert torch.equal(guarded.run(healthy, [x])[0], x * 2 + 1)
    with pytest.raises(PlatformError, match="wrote past buffer y"):
        guarded.run(_oob_program(out_extra=3), [x])
    assert torch.equal(guarded.run(healthy, [x])[0], x * 2 + 1)  # its own guards, fresh sentinel


@pytest.mark.device
def test_without_guards_the_same_write_goes_unnoticed():
    vulkan_or_skip()
    from tapml.platforms.wgpu_native import shared_platform
    x = torch.randn(N)
    # WGSL robustness discards or clamps the store outside the binding: no error, right values
    out = shared_platform("vulkan").run(_oob_program(out_extra=3), [x])[0]
    assert torch.equal(out, x * 2 + 1)


@pytest.mark.device
def test_replay_repeat_and_guards_find_nothing_in_a_healthy_model(carved, tmp_path):
    vulkan_or_skip()
    store = carved("zoo:mlp")
    out = tmp_path / "v.json"
    r = subprocess.run(TAPML + ["replay", str(store), "--target", "wgpu:vulkan", "--repeat", "5", "--guards",
                                "--json", str(out)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    doc = json.loads(out.read_text())
    assert doc["summary"]["flaky"] == 0 and doc["summary"]["error"] == 0
    assert doc["summary"]["pass"] == len(doc["cases"]) > 0
    assert "0 flaky" not in r.stdout and f"{len(doc['cases'])}/{len(doc['cases'])} pass" in r.stdout


def test_guards_on_a_target_that_cannot_is_a_usage_error(carved):
    r = subprocess.run(TAPML + ["replay", str(carved("zoo:mlp")), "--target", "reference", "--guards"],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "--guards checks for out-of-bounds writes on wgpu and browser targets only" in r.stdout + r.stderr
    r = subprocess.run(TAPML + ["replay", str(carved("zoo:mlp")), "--repeat", "0"], capture_output=True, text=True)
    assert r.returncode == 2 and "--repeat 0" in r.stdout + r.stderr


@pytest.mark.browser
@pytest.mark.xdist_group("browser")
def test_the_browser_page_guards_buffers_too():
    import os
    import shutil
    if shutil.which("chromium") is None and not os.environ.get("TAPML_CHROMIUM"):
        pytest.skip("no chromium on PATH (apt-get install chromium)")
    from tapml.platforms.browser import BrowserPlatform
    x = torch.randn(N)
    with BrowserPlatform() as browser:
        assert torch.equal(browser.run(_oob_program(out_extra=3), [x])[0], x * 2 + 1)  # unguarded: unnoticed
        assert browser.enable_guards()
        with pytest.raises(PlatformError) as e:
            browser.run(_oob_program(out_extra=3), [x])  # the same program, sent to the page again with guards
        assert ("kernel store_past_end_0 wrote past buffer y (400 bytes): first bad byte at offset +8 after its end"
                in str(e.value))
        with pytest.raises(PlatformError, match="kernel copy_to_temp_0 wrote past buffer t .* offset \\+0 after"):
            browser.run(_oob_program(temp_extra=1), [x])
        assert torch.equal(browser.run(_oob_program(), [x])[0], x * 2 + 1)


def test_the_pytest_plugin_repeats_cases(carved, tmp_path):
    suite = tmp_path / "test_cases.py"
    suite.write_text("import pytest\n\n@pytest.mark.tapml(op='aten.relu.default')\n"
                     "def test_case(tapml_case):\n    assert tapml_case.check()['status'] == 'pass'\n")
    store = str(carved("zoo:mlp"))
    base = [sys.executable, "-m", "pytest", str(suite), "-q", "-p", "no:cacheprovider", "--tapml-store", store]
    r = subprocess.run(base + ["--tapml-repeat", "3"], capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0 and " passed" in r.stdout, r.stdout + r.stderr
    r = subprocess.run(base + ["--tapml-repeat", "0"], capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 4 and "--tapml-repeat 0: give a number of runs of 1 or more" in r.stderr


# --- closing a device while its poll thread is busy ---------------------------------------------

_BUSY = """
@group(0) @binding(0) var<storage, read_write> out: array<f32>;
@compute @workgroup_size(64) fn main(@builtin(global_invocation_id) g: vec3<u32>) {
  var s = 0.0;
  for (var i = 0u; i < 20000u; i++) { s = s * 0.999 + f32(i ^ g.x); }
  out[g.x] = s;
}"""


def _busy_platform():
    """A Vulkan platform whose queue holds a few seconds of lavapipe work, with wgpu-py's poll
    thread inside a blocking poll for it (a poll token outstanding)."""
    import wgpu
    from tapml.platforms.wgpu_native import WgpuPlatform
    platform = WgpuPlatform("vulkan")
    dev = platform.device
    out = dev.create_buffer(size=4 * 64 * 64, usage=wgpu.BufferUsage.STORAGE)
    pipe = dev.create_compute_pipeline(layout="auto", compute={
        "module": dev.create_shader_module(code=_BUSY), "entry_point": "main"})
    group = dev.create_bind_group(layout=pipe.get_bind_group_layout(0),
                                  entries=[{"binding": 0, "resource": {"buffer": out}}])
    encoder = dev.create_command_encoder()
    compute = encoder.begin_compute_pass()
    compute.set_pipeline(pipe)
    compute.set_bind_group(0, group)
    for _ in range(100):
        compute.dispatch_workgroups(64)
    compute.end()
    dev.queue.submit([encoder.finish()])
    token = dev._poller.get_token()
    time.sleep(0.3)  # the thread wakes and enters its blocking poll
    assert dev._poller.is_alive()
    return platform, dev._poller, token


@pytest.mark.device
def test_closing_or_dropping_a_busy_device_ends_its_poll_thread_first():
    """wgpu-py's own stop() waits 1 s for the poll thread; destroying the device under a poll that
    is still running can abort the process. close(), and a platform dropped without it, wait for
    the queue and the thread."""
    import gc
    vulkan_or_skip()
    platform, poller, token = _busy_platform()
    platform.close()
    assert not poller.is_alive() and platform.device is None
    platform, poller, token = _busy_platform()
    del platform
    gc.collect()
    assert not poller.is_alive()
