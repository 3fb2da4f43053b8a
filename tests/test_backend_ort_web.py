"""The ``ort-web`` backends: onnxruntime-web (npm, installed by the setup) in headless Chromium.

Browser tier: :class:`OrtWebBackend` in this process on small exported programs (dtypes, weights that
cross the socket once, the blob round trip, WebGPU refusing onnxruntime-web's own float16 shaders,
Chromium killed under it, the files its page bridge serves), and the repro page that runs a case's
``model.onnx`` with onnxruntime-web alone. Slow tier, over the CLI (the backend in its worker process):
every case of zoo:tiny-llama's float32 and float16 stores, the cross-compiler matrix in the terminal
and in HTML, a generation step by step, and a migration of hf:gpt2 whose Chromium is killed with
SIGKILL, then resumed. The README's worked example (zoo:llama-rope-4k) is walked by tests/test_readme.py.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest
import torch
from support import exported, repro_page_result
from typer.testing import CliRunner

from tapml.cli import app
from tapml.platforms.backend import BackendRefused
from tapml.platforms.ort_web import ORT_WEB_FILES, OrtWebBackend, ort_web_package

# not in the one browser group: each test's Chromium has its own profile, port and token, and these runs
# are long enough that xdist must be free to put them beside the browser group's
pytestmark = [pytest.mark.browser]


def _installed() -> bool:
    try:
        ort_web_package()
        return True
    except BackendRefused:
        return False


if not _installed():  # the setup installs it; a missing package is a broken setup, not a skip
    pytest.fail("onnxruntime-web is not installed in platforms/web/ort: run `make setup`", pytrace=False)


def tapml(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


@pytest.fixture(scope="module")
def webgpu():
    backend = OrtWebBackend("ort-web:webgpu")
    yield backend
    backend.close()


@pytest.fixture(scope="module")
def wasm():
    backend = OrtWebBackend("ort-web:wasm")
    yield backend
    backend.close()


def test_describe_names_the_adapter_the_provider_and_the_pinned_version(webgpu, wasm):
    pinned = json.loads((ort_web_package() / "package.json").read_text())["version"]
    lock = json.loads((ort_web_package().parents[1] / "package-lock.json").read_text())
    assert lock["packages"]["node_modules/onnxruntime-web"]["version"] == pinned
    info = webgpu.describe()
    assert info["provider"] == "webgpu" and info["onnxruntime_web"] == pinned and "HeadlessChrome" in info["user_agent"]
    assert info["adapter"]["vendor"] and info["adapter"]["vendor"] in info["device"] and "webgpu" in info["device"]
    assert f"onnxruntime-web {pinned} (webgpu)" in info["version"] and torch.__version__ in info["version"]
    assert wasm.describe()["device"] == "CPU (onnxruntime-web wasm in Chromium)"
    assert OrtWebBackend.control == "ort" and OrtWebBackend.forms == ("ort-web:webgpu", "ort-web:wasm")


@pytest.mark.parametrize("provider", ["webgpu", "wasm"])
def test_float32_int64_and_bool_programs_run_as_torch_runs_them(provider, webgpu, wasm):
    backend = {"webgpu": webgpu, "wasm": wasm}[provider]
    torch.manual_seed(0)
    a, w, ids = torch.randn(5, 7), torch.randn(7, 3), torch.randint(-1000, 1000, (9,))
    fn = lambda a, w, ids: ((a @ w).relu(), torch.cumsum(ids, 0), a > 0, a.exp())  # noqa: E731
    compiled = backend.compile(exported(fn, a, w, ids))
    got, want = backend.run(compiled, [a, w, ids]), fn(a, w, ids)
    assert [g.dtype for g in got] == [torch.float32, torch.int64, torch.bool, torch.float32]
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
    assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])
    torch.testing.assert_close(got[3], want[3], rtol=1e-5, atol=1e-6)
    again = backend.load(compiled.blob)  # the compile cache's round trip: the same ONNX, a session again
    assert torch.equal(backend.run(type(compiled)(handle=again), [a, w, ids])[1], want[1])


def test_a_weight_crosses_to_the_page_once_for_every_run_and_program_that_uses_it(webgpu):
    w = torch.randn(256, 256)
    first = webgpu.compile(exported(lambda x, w: (x @ w,), torch.randn(2, 256), w))
    second = webgpu.compile(exported(lambda x, w: ((x @ w).tanh(),), torch.randn(2, 256), w))
    before = webgpu.sent_bytes
    webgpu.run(first, [torch.randn(2, 256), w])
    assert webgpu.sent_bytes - before == (256 * 256 + 2 * 256) * 4  # the weight and this run's x
    before = webgpu.sent_bytes
    x = torch.randn(2, 256)
    out = webgpu.run(second, [x, w])
    assert webgpu.sent_bytes - before == 2 * 256 * 4  # only x: the page holds the weight by its digest
    torch.testing.assert_close(out[0], (x @ w).tanh(), rtol=1e-4, atol=1e-5)


def test_float16_where_webgpu_rejects_onnxruntime_webs_shaders_is_an_error_with_webgpus_words(webgpu, wasm):
    a = torch.tensor([[1.0, -2.0, 0.5, 100.0]], dtype=torch.float16)
    compiled_wasm = wasm.compile(exported(lambda a: (a + 1,), a))
    assert torch.equal(wasm.run(compiled_wasm, [a])[0], a + 1)  # the same ONNX is right on the wasm provider
    compiled = webgpu.compile(exported(lambda a: (a + 1,), a))
    if "shader-f16" in webgpu.describe()["features"]:
        assert torch.equal(webgpu.run(compiled, [a])[0], a + 1)
        return
    # onnxruntime-web writes f16 WGSL for an adapter without shader-f16; WebGPU refuses the shader, the run
    # "succeeds" with zeros, and tapml says why instead of judging the zeros
    with pytest.raises(RuntimeError, match=r"WebGPU rejected onnxruntime-web's Add kernel.*'f16' type used without 'f16' extension"):
        webgpu.run(compiled, [a])


def test_a_float_node_left_to_the_cpu_is_refused_and_integer_ones_are_not(webgpu):
    """onnxruntime-web leaves nodes its WebGPU provider has no kernel for to its wasm CPU provider without a
    word: one on floating-point data (atan2's IsNaN) is refused naming it; int64 ones (a cumsum of positions)
    are onnxruntime-web's design, as in every deployed model, and run."""
    x = torch.randn(4, 6)
    with pytest.raises(BackendRefused, match=r"did not put the program on webgpu.*IsNaN '\w+' \(float\) on its CPU"):
        webgpu.compile(exported(lambda x: (torch.atan2(x, x + 1),), x))
    ids = torch.arange(7)
    compiled = webgpu.compile(exported(lambda ids: (torch.cumsum(ids, 0),), ids))
    assert torch.equal(webgpu.run(compiled, [ids])[0], torch.cumsum(ids, 0))


def test_bfloat16_is_refused_before_compiling(webgpu):
    assert "bfloat16" in webgpu.refuse(exported(lambda a: (a * 2,), torch.randn(3, dtype=torch.bfloat16)))


def test_chromium_killed_under_the_backend_is_replaced_and_the_run_still_answers(tmp_path):
    backend = OrtWebBackend("ort-web:wasm")
    try:
        x = torch.randn(4, 4)
        compiled = backend.compile(exported(lambda x: (x.sin(),), x))
        os.killpg(backend.browser.pid, signal.SIGKILL)
        backend.browser.proc.wait(10)
        out = backend.run(compiled, [x])  # the session is made again on a fresh page from the ONNX bytes
        assert backend.relaunches == 1
        torch.testing.assert_close(out[0], x.sin(), rtol=1e-6, atol=1e-6)
    finally:
        backend.close()


def test_the_page_bridge_serves_the_page_and_onnxruntime_webs_own_files_only(webgpu):
    url = webgpu.bridge.url
    assert b"ort_runtime.js" in urllib.request.urlopen(url, timeout=5).read()
    for name in ORT_WEB_FILES:
        assert urllib.request.urlopen(url + "ort/" + name, timeout=10).status == 200
    wasm = urllib.request.urlopen(url + "ort/ort-wasm-simd-threaded.jsep.wasm", timeout=10)
    assert wasm.headers["Content-Type"] == "application/wasm"
    for path in ("ort/ort.all.min.mjs", "ort/../package.json", "ort/%2e%2e/package.json", "../ort_runtime.js"):
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(url + path, timeout=5)
        assert refused.value.code in (403, 404), path
    with pytest.raises(urllib.error.HTTPError) as wrong:
        urllib.request.urlopen(url.replace(webgpu.bridge.token, "x" * len(webgpu.bridge.token)) + "ort/ort.min.mjs",
                               timeout=5)
    assert wrong.value.code == 403


def test_the_repro_page_runs_model_onnx_with_onnxruntime_web_alone(carved, tmp_path):
    """zoo:llama-rope-4k's sin (angles up to 4095 rad) on WebGPU: the folder's page, served with
    onnxruntime-web's dist/ as its ./ort/, fails on webgpu as tapml saw it, and passes on wasm."""
    store = carved("zoo:llama-rope-4k")
    folder = tmp_path / "repro"
    r = tapml("repro", store, "sin", "--target", "ort-web:webgpu", "-o", folder)
    assert r.exit_code == 0, r.output
    assert {"model.onnx", "index.html", "check.js", "ort_web.js", "plan.json", "input_0.npy", "expected_0.npy"} <= \
        {p.name for p in folder.iterdir()}
    plan = json.loads((folder / "plan.json").read_text())
    assert plan["observed"]["status"] == "mismatch" and plan["page"] == "index.html"
    assert "onnxruntime-web alone" in (folder / "README.md").read_text() or "web runtime alone" in (folder / "README.md").read_text()
    (folder / "ort").symlink_to(ort_web_package() / "dist")
    shown = repro_page_result(folder)
    assert shown.startswith("FAIL mismatch: case c") and "(onnxruntime-web" in shown and "webgpu)" in shown, shown
    assert repro_page_result(folder, "index.html?provider=wasm").startswith("PASS pass"), shown


# --- end to end, over the CLI (slow) -------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_every_case_of_tiny_llama_is_judged_on_ort_web_webgpu(carved, tmp_path, dtype):
    store = carved("zoo:tiny-llama", dtype=dtype)
    out = tmp_path / "v.json"
    r = tapml("replay", store, "--target", "ort-web:webgpu", "--json", out)
    assert r.exit_code in (0, 1), r.output
    doc = json.loads(out.read_text())
    assert len(doc["cases"]) == len(json.loads((store / "manifest.json").read_text())["cases"])
    failed = [c for c in doc["cases"] if c["status"] != "pass"]
    for case in failed:  # every finding names its op, and the blame of a re-run on the control (ort)
        assert case["op"].startswith("aten.") and case["op"] in flat(r.output) and case["message"], case
    if dtype == "float32":
        assert r.exit_code == 0 and not failed, r.output
    elif "shader-f16" not in doc["device"].get("features", []):
        assert r.exit_code == 1 and failed and {c["status"] for c in failed} == {"error"}
        assert all("'f16' type used without 'f16' extension" in c["message"] for c in failed), \
            [c["message"] for c in failed if "'f16' type" not in c["message"]][:3]
        assert all(c.get("blame") == "device compiler" for c in failed)  # ort (ONNX Runtime's CPU) passes them


def flat(text: str) -> str:
    return " ".join(text.split())


@pytest.mark.slow
@pytest.mark.device
def test_the_four_compiler_matrix_renders_in_the_terminal_and_in_html(carved, tmp_path):
    """tapml's WGSL, IREE, onnxruntime-web and tinygrad, each on WebGPU or Vulkan, side by side on the float16
    tiny llama's matmuls and products: which compiler is wrong on which op."""
    store = carved("zoo:tiny-llama", dtype="float16")
    out, page = tmp_path / "m.json", tmp_path / "m.html"
    targets = ["wgpu:vulkan", "iree:vulkan", "ort-web:webgpu", "tinygrad:webgpu"]
    r = tapml("replay", store, *[a for t in targets for a in ("--target", t)], "--op", "aten.mm.default",
              "--op", "aten.mul.Tensor", "--json", out)
    assert r.exit_code == 1, r.output  # ort-web:webgpu's float16 errors
    shown = flat(r.output)
    assert all(t in shown for t in targets) and "aten.mm.default" in shown and "differs between targets" in shown
    doc = json.loads(out.read_text())
    assert doc["targets"] == targets and [c["target"] for c in doc["matrix"]["columns"]] == targets
    mm = next(row for row in doc["matrix"]["rows"] if row["op"] == "aten.mm.default")
    assert len(mm["cells"]) == 4
    assert tapml("report", out, "-o", page).exit_code == 1  # rendered; exit 1: the document holds findings
    html = page.read_text()
    assert all(t in html for t in targets) and "aten.mm.default" in html and 'id="coverage-table"' in html


@pytest.mark.slow
def test_generate_on_ort_web_checks_every_step_and_says_the_cache_goes_back_in(tmp_path):
    out = tmp_path / "g.json"
    r = tapml("generate", "zoo:tiny-llama", "--target", "ort-web:webgpu", "--tokens", "8", "--json", out)
    assert r.exit_code == 0, r.output
    doc = json.loads(out.read_text())
    assert len(doc["steps"]) == 9 and {s["status"] for s in doc["steps"]} == {"pass"}
    assert "passed back in with every step" in flat(r.output)


def _descendants(pid: int) -> list[int]:
    children = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = open(f"/proc/{entry}/stat").read()
            except OSError:
                continue
            children.setdefault(int(stat[stat.rfind(")") + 2:].split()[1]), []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


@pytest.mark.slow
def test_migrate_gpt2_with_chromium_killed_then_resumed_loses_no_verdict(tmp_path):
    state, journal = tmp_path / "s.json", tmp_path / "s.json.journal"
    command = [sys.executable, "-m", "tapml.cli", "migrate", "hf:gpt2", "--target", "ort-web:webgpu", "--state", state]
    run = subprocess.Popen(command, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    killed = []
    try:
        deadline = time.monotonic() + 600
        while not (journal.exists() and journal.read_text().count("\n") >= 10):
            assert run.poll() is None, run.stdout.read()[-3000:]
            assert time.monotonic() < deadline, "the migration wrote no 10 verdicts in 10 minutes"
            time.sleep(0.2)
        for pid in _descendants(run.pid):
            try:
                if "--user-data-dir=" in open(f"/proc/{pid}/cmdline").read():
                    os.kill(pid, signal.SIGKILL)
                    killed.append(pid)
            except OSError:
                pass
        output, _ = run.communicate(timeout=900)
    finally:
        if run.poll() is None:
            run.kill()
    assert killed, "no Chromium was found under the migration"
    assert run.returncode in (0, 1), output[-3000:]
    resumed = tapml("migrate", "hf:gpt2", "--target", "ort-web:webgpu", "--state", state, "--resume")
    assert resumed.exit_code in (0, 1), resumed.output
    doc = json.loads(state.read_text())
    store_cases = json.loads((tmp_path / "s.store" / "manifest.json").read_text())["cases"]
    assert doc["complete"] and doc["placement"] and len(doc["cases"]) == len(store_cases)
    assert not [c for c in doc["cases"] if c["status"] == "error"], "a verdict was lost to the killed browser"
    assert re.search(r"placement: \d+/\d+ ops", flat(resumed.output))
