"""The browser tier: KernelPrograms on WebGPU inside a real headless Chromium (SwiftShader Vulkan).

Every test shares one module-scoped browser (one xdist group); tests that need a browser of
their own (crash, no adapter, --no-launch) start and close it themselves. The last test checks
that no Chromium started here is left running.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch

from tapml.errors import DeviceLost, PlatformError, TapmlError
from tapml.graph import TensorMeta
from tapml.platforms.base import BufferSpec, Kernel, KernelProgram

pytestmark = [
    pytest.mark.browser,
    pytest.mark.xdist_group("browser"),
    pytest.mark.skipif(shutil.which("chromium") is None and not os.environ.get("TAPML_CHROMIUM"),
                       reason="no chromium on PATH (apt-get install chromium)"),
]

LAUNCHED = []  # every ChromiumProcess this module started, for the leftover check


def open_browser(**kwargs):
    from tapml.platforms.browser import BrowserPlatform
    platform = BrowserPlatform(**kwargs)
    if platform.browser is not None:
        LAUNCHED.append(platform.browser)
    return platform


@pytest.fixture(scope="module")
def browser():
    platform = open_browser()
    yield platform
    platform.close()


# Bindings of add_program's buffers: a (f32 in), b (i32 in), c (f32 out), m (bool out as u32).
BINDINGS = """
@group(0) @binding(0) var<storage, read> a: array<f32>;
@group(0) @binding(1) var<storage, read> b: array<i32>;
@group(0) @binding(2) var<storage, read_write> c: array<f32>;
@group(0) @binding(3) var<storage, read_write> m: array<u32>;
"""

ADD_WGSL = BINDINGS + """@compute @workgroup_size(64) fn main(@builtin(global_invocation_id) g: vec3<u32>) {
  let i = g.x;
  if (i < arrayLength(&c)) { c[i] = a[i] + f32(b[i]); m[i] = select(0u, 1u, c[i] > 0.0); }
}"""


def add_program(n: int, wgsl: str = ADD_WGSL) -> KernelProgram:
    """c = a + float(b); m = c > 0, written by hand: a f32, an int64 and a bool tensor."""
    fa, ib, bm = TensorMeta((n,), "float32"), TensorMeta((n,), "int64"), TensorMeta((n,), "bool")
    return KernelProgram(
        kind="wgsl", inputs=["a", "b"], outputs=["c", "m"],
        buffers=[BufferSpec("a", "f32", 4 * n, "input", fa), BufferSpec("b", "i32", 4 * n, "input", ib),
                 BufferSpec("c", "f32", 4 * n, "output", fa), BufferSpec("m", "u32", 4 * n, "output", bm)],
        kernels=[Kernel("add", wgsl, [("a", "read"), ("b", "read"), ("c", "read_write"), ("m", "read_write")],
                        (-(-n // 64), 1, 1))],
        input_meta=[fa, ib], output_meta=[fa, bm])


def test_caps_report_the_adapter_as_the_page_sees_it(browser):
    caps = browser.caps()
    assert caps["adapter_info"]["vendor"] == "google" and caps["adapter_info"]["architecture"] == "swiftshader"
    assert caps["adapter"].startswith("google swiftshader")
    assert caps["backend"] == "browser-webgpu" and "HeadlessChrome" in caps["browser"]
    assert caps["limits"]["max-storage-buffer-binding-size"] >= 128 << 20
    assert caps["limits"]["max-storage-buffers-per-shader-stage"] >= 8
    assert isinstance(caps["features"], list)
    assert "float32" in caps["dtypes"] and "float64" not in caps["dtypes"]


def test_hand_written_program_runs_with_int64_and_bool_conversion(browser):
    program = add_program(1000)
    a, b = torch.randn(1000), torch.randint(-5, 5, (1000,))
    for _ in range(2):  # the second run reuses the page's cached pipeline
        c, m = browser.run(program, [a, b])
        assert c.dtype == torch.float32 and m.dtype == torch.bool
        assert torch.equal(c, a + b.float()) and torch.equal(m, (a + b.float()) > 0)
    assert program.key in browser._on_page


def test_page_cache_eviction_is_recovered(browser):
    program = add_program(10)
    browser.run(program, [torch.ones(10), torch.ones(10, dtype=torch.int64)])
    browser._on_page.clear()  # the page still has it; claim it does not, then the opposite
    c, _ = browser.run(program, [torch.ones(10), torch.ones(10, dtype=torch.int64)])
    assert torch.equal(c, torch.full((10,), 2.0))
    other = add_program(12)
    browser._on_page.put(other.key, True)  # the host believes the page has it; the page asks for it again
    c, _ = browser.run(other, [torch.ones(12), torch.zeros(12, dtype=torch.int64)])
    assert torch.equal(c, torch.ones(12))


def test_page_keeps_as_many_programs_as_the_host_tells_it(monkeypatch):
    """The page's program cache takes its limit from the host's welcome (TAPML_PROGRAM_CACHE),
    not a constant of its own: with a limit of 2, the oldest of three programs is dropped there."""
    monkeypatch.setenv("TAPML_PROGRAM_CACHE", "2")
    platform = open_browser()
    try:
        assert platform.bridge.program_cache["max_programs"] == 2
        programs = [add_program(n) for n in (16, 17, 18)]
        for p in programs:
            platform.run(p, [torch.ones(p.input_meta[0].shape), torch.ones(p.input_meta[1].shape, dtype=torch.int64)])
        assert programs[0].key not in platform._on_page and len(platform._on_page) == 2
        platform._on_page.put(programs[0].key, True)  # claim the page has it: the page must ask for it again
        c, _ = platform.run(programs[0], [torch.ones(16), torch.ones(16, dtype=torch.int64)])
        assert torch.equal(c, torch.full((16,), 2.0)) and platform.page_misses == 1
        platform._on_page.pop(programs[2].key)  # the page has the newest: sending it again is no miss
        platform.run(programs[2], [torch.ones(18), torch.ones(18, dtype=torch.int64)])
        assert platform.page_misses == 1
    finally:
        platform.close()


def test_shader_compile_error_is_a_platform_error_not_a_crash(browser):
    program = add_program(8, ADD_WGSL.replace("f32(b[i])", "undefined_fn(b[i])"))
    with pytest.raises(PlatformError, match="undefined_fn|unresolved"):
        browser.run(program, [torch.ones(8), torch.ones(8, dtype=torch.int64)])
    c, _ = browser.run(add_program(8), [torch.ones(8), torch.ones(8, dtype=torch.int64)])  # still usable
    assert torch.equal(c, torch.full((8,), 2.0))


def test_int64_values_outside_i32_are_unsupported(browser):
    from tapml.errors import Unsupported
    with pytest.raises(Unsupported, match="i32"):
        browser.run(add_program(4), [torch.ones(4), torch.tensor([0, 1, 2, 2**40])])


def test_page_and_websocket_need_the_one_time_token(browser):
    base = browser.url.split("/t/")[0]
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(f"{base}/t/wrong-token/", timeout=5)
    assert e.value.code == 403 and b"exact URL" in e.value.read()
    page = urllib.request.urlopen(browser.url, timeout=5).read()
    assert b"runtime.js" in page
    js = urllib.request.urlopen(browser.url + "runtime.js", timeout=5)
    assert js.headers["Content-Type"].startswith("text/javascript")
    with pytest.raises(urllib.error.HTTPError) as e:  # the page already took the WebSocket
        urllib.request.urlopen(urllib.request.Request(browser.url + "ws", headers={
            "Upgrade": "websocket", "Connection": "Upgrade", "Sec-WebSocket-Version": "13",
            "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ==", "Origin": base}), timeout=5)
    assert e.value.code == 403 and b"already used" in e.value.read()


def _ws_refusal(url: str, origin: str | None) -> tuple[int, bytes]:
    """Open the page's WebSocket as a local program would; ``(status, body)`` of the refusal."""
    from websockets.exceptions import InvalidStatus
    from websockets.sync.client import connect
    try:
        with connect(url.replace("http://", "ws://") + "ws", origin=origin, open_timeout=10, proxy=None):
            pass
    except InvalidStatus as e:
        return e.response.status_code, bytes(e.response.body)
    raise AssertionError(f"the bridge let a WebSocket client with Origin {origin!r} in")


def _cmdlines_holding(secret: str) -> dict[int, str]:
    found = {}
    for entry in os.listdir("/proc"):
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
        except (OSError, ValueError):
            continue
        if secret.encode() in cmdline:
            found[int(entry)] = cmdline.replace(b"\0", b" ").decode(errors="replace")[:200]
    return found


def test_the_page_token_is_on_no_command_line_and_no_other_client_gets_the_page(browser, carved):
    """A local user sees every command line (/proc/PID/cmdline) and can connect to the bridge's port:
    the token must be on none of Chromium's command lines, and a client with a foreign Origin, with
    no Origin, or with the real token copied after the page joined gets no WebSocket."""
    from tapml.carving import CarveStore
    from tapml.driving.replay import replay
    token = browser.bridge.token
    assert token in browser.url and browser.bridge.pages == 1
    chromium = browser.browser
    pids = [chromium.pid, *chromium.session_pids()]
    assert len(pids) > 3  # the browser, its zygotes, GPU process and renderers
    for pid in pids:
        assert token not in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace"), pid
    assert _cmdlines_holding(token) == {}  # nor on any other process's (setpriv, the wrapper script)
    # What holds the URL instead: a 0600 start file in the 0700 profile, unreadable to other users.
    assert os.stat(chromium.profile).st_mode & 0o077 == 0
    start = Path(chromium.profile, "start.html")
    assert start.stat().st_mode & 0o077 == 0 and token in start.read_text()

    base = browser.url.split("/t/")[0]
    for origin in ("http://evil.example", "http://127.0.0.1:1", base.replace("http://", "https://"), "null"):
        status, body = _ws_refusal(browser.url, origin)
        assert status == 403 and b"Origin" in body, (origin, body)
    status, body = _ws_refusal(browser.url, None)
    assert status == 403 and b"Origin" in body
    status, body = _ws_refusal(browser.url, base)  # the real token and the right Origin: spent
    assert status == 403 and b"already used" in body

    result = replay(CarveStore(carved("zoo:mlp")), browser, "browser")  # the real page is still the device
    assert result["cases"] and result["summary"]["pass"] == len(result["cases"]), result["summary"]
    assert browser.bridge.pages == 1 and browser.bridge.lost is None


def test_websocket_origin_rule():
    from tapml.platforms.page_bridge import PageBridge
    bridge = PageBridge()
    try:
        port = bridge.port
        own = f"http://127.0.0.1:{port}"
        assert bridge.origin == own and bridge.origin_allowed(own, f"127.0.0.1:{port}")
        assert bridge.origin_allowed(own, None)  # the Host header does not matter for the URL's own origin
        for origin, host in ((f"http://localhost:{port}", f"localhost:{port}"),  # typed localhost
                             ("http://127.0.0.1:9000", "127.0.0.1:9000"),  # ssh -L 9000:127.0.0.1:PORT
                             ("http://[::1]:9000", "[::1]:9000")):
            assert bridge.origin_allowed(origin, host), origin
        for origin, host in ((None, f"127.0.0.1:{port}"), ("", f"127.0.0.1:{port}"), ("null", f"127.0.0.1:{port}"),
                             ("http://evil.example", f"127.0.0.1:{port}"),
                             (f"http://evil.example:{port}", f"evil.example:{port}"),  # DNS rebinding
                             (f"https://127.0.0.1:{port}", f"127.0.0.1:{port}"),
                             (f"http://127.0.0.1:{port}/t/x", f"127.0.0.1:{port}"),
                             ("http://127.0.0.1:9000", "127.0.0.1:9001"), ("http://localhost:9000", None),
                             ("http://[::1", f"127.0.0.1:{port}"), (f"http://user@127.0.0.1:{port}", None)):
            assert not bridge.origin_allowed(origin, host), (origin, host)
    finally:
        bridge.close()


def test_frames_have_a_small_binary_header():
    from tapml.platforms.page_bridge import KIND_OUTPUT, decode_frame, encode_frame
    data = encode_frame(7, 2, KIND_OUTPUT, b"\x01\x02\x03\x04")
    assert len(data) == 16 + 4 and data[:4] == b"TPT1"
    assert decode_frame(data) == (7, 2, KIND_OUTPUT, b"\x01\x02\x03\x04")
    with pytest.raises(ValueError, match="header"):
        decode_frame(b"[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]")


SLOW_WGSL = BINDINGS + """@compute @workgroup_size(64) fn main(@builtin(global_invocation_id) g: vec3<u32>) {
  var x = a[g.x];
  for (var i = 0; i < b[g.x]; i++) { x = fma(x, 0.999999, 1e-7); }
  c[g.x] = x;
  m[g.x] = 1u;
}"""


def test_browser_crash_mid_run_is_device_lost_not_a_hang():
    import threading
    import time
    platform = open_browser()
    try:
        program = add_program(4096, SLOW_WGSL)
        quick = [torch.ones(4096), torch.ones(4096, dtype=torch.int64)]
        platform.run(program, quick)
        busy = [torch.ones(4096), torch.full((4096,), 2**30, dtype=torch.int64)]  # minutes on SwiftShader
        threading.Timer(1.0, os.kill, (platform.browser.pid, signal.SIGKILL)).start()
        start = time.monotonic()
        with pytest.raises(DeviceLost, match="device lost: the browser process was killed by signal 9"):
            platform.run(program, busy)
        assert time.monotonic() - start < 10
        with pytest.raises(DeviceLost, match="killed by signal 9"):  # and every later run, at once
            platform.run(program, quick)
    finally:
        platform.close()


def test_crash_during_replay_gives_device_lost_verdicts(carved):
    from tapml.carving import CarveStore
    from tapml.driving.replay import replay
    store = CarveStore(carved("zoo:mlp"))
    platform = open_browser()
    seen = []

    def on_case(verdict):
        seen.append(verdict)
        if len(seen) == 1:
            os.kill(platform.browser.pid, signal.SIGKILL)
            platform.browser.proc.wait(timeout=10)

    try:
        result = replay(store, platform, "browser", on_case=on_case)
    finally:
        platform.close()
    assert result["cases"][0]["status"] == "pass"
    later = result["cases"][1:]
    assert later and all(v["status"] == "error" and v["message"].startswith("error: device lost") for v in later)


def _registry_ops() -> list:
    from tapml.platforms.wgsl import load_lowerings
    return sorted(load_lowerings())


@pytest.mark.parametrize("op", _registry_ops())
def test_lowering_in_the_browser(browser, op):
    """The registry's own samples of the op's first kernel forms (``support.KernelForms``; the same
    checks as the wgpu tier, which runs every sample), on the browser's WebGPU, without NaN, Inf and
    subnormal inputs: the WGSL spec lets a device assume no NaN or Inf and flush subnormals, and
    Chromium's Tint on SwiftShader does (exp(NaN) is Inf, sign(1e-40) is 0)."""
    from support import KernelForms, finite_normal, only_ties_reordered
    from tapml.judging.compare import compare_tensor
    from tapml.graph import run_node
    from tapml.platforms.wgsl.registry import REGISTRY, sample_cases
    torch.manual_seed(0)
    cases = sample_cases(op)
    assert cases, f"{op}: the registry has no samples for it"
    ran, forms = 0, KernelForms()
    for graph, inputs in cases:
        inputs = finite_normal(inputs)
        program = browser.compile(graph)
        if not forms.is_new(program):
            continue
        out = browser.run(program, inputs)
        env = dict(zip([r for r, _ in graph.inputs], inputs))
        ref = run_node(graph.nodes[0], env.__getitem__)
        assert len(out) == len(ref)
        for i, (o, r) in enumerate(zip(out, ref)):
            assert tuple(o.shape) == tuple(r.shape) and o.dtype == r.dtype, \
                f"{op} output {i}: {o.dtype}{list(o.shape)} != reference {r.dtype}{list(r.shape)}"
            if REGISTRY[op].compare_values:
                res = compare_tensor(o, r)
                assert res.passed or only_ties_reordered(graph, inputs, out, ref), \
                    f"{op} output {i}: {res.message}; worst {res.worst}"
        ran += 1
    assert ran, f"{op}: every sample was unsupported in the browser"


def _low_precision_ops() -> list:
    from tapml.platforms.wgsl import load_lowerings
    return sorted(op for op, low in load_lowerings().items() if set(low.dtypes) & {"float16", "bfloat16"})


@pytest.mark.parametrize("op", _low_precision_ops())
def test_low_precision_lowering_in_the_browser(browser, op):
    """float16 and bfloat16 samples (packed two per u32 word where the page has no shader-f16),
    fp64-anchored against torch in the same dtype, as on wgpu (finite normal inputs: see above);
    the first kernel forms of each dtype, as above."""
    from support import BROWSER_FORMS, run_low_precision_samples
    run_low_precision_samples(browser, op, edges=False, forms=BROWSER_FORMS)


def test_browser_reports_how_it_holds_low_precision(browser):
    paths = browser.caps()["low_precision"]
    native = "shader-f16" in browser.caps()["features"]
    assert paths["float16"].startswith("native" if native else "packed") and paths["bfloat16"].startswith("packed")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_zoo_low_precision_replay_passes_in_the_browser(browser, carved, dtype):
    from tapml.carving import CarveStore
    from tapml.driving.replay import replay
    result = replay(CarveStore(carved("zoo:tiny-llama", dtype=dtype)), browser, "browser")
    failing = [(v["id"], v["op"], v["status"], v["message"][:200]) for v in result["cases"] if v["status"] != "pass"]
    assert not failing and len(result["cases"]) > 20, failing
    assert result["dtype"] == dtype and result["anchored"] is True


def _f32_case(case) -> bool:
    return all(m["dtype"] == "float32" for m in case["output_meta"])


def _open_vulkan():
    from tapml.platforms.wgpu_native import WgpuPlatform
    return WgpuPlatform("vulkan")


@pytest.mark.slow
@pytest.mark.parametrize("spec", ["zoo:tiny-llama", "zoo:tiny-vit"])
def test_zoo_replay_passes_every_f32_case_and_matches_wgpu_vulkan(browser, carved, spec):
    from tapml.carving import CarveStore
    from tapml.driving.replay import replay
    store = CarveStore(carved(spec))
    on_browser = replay(store, browser, "browser")
    assert on_browser["device"]["adapter"].startswith("google swiftshader")
    f32 = [v for v, c in zip(on_browser["cases"], store.cases) if _f32_case(c)]
    assert len(f32) > 20
    failing = [(v["id"], v["op"], v["status"], v["message"][:200]) for v in f32 if v["status"] != "pass"]
    assert not failing, failing
    with _open_vulkan() as vulkan:
        on_vulkan = replay(store, vulkan, "wgpu:vulkan")
    assert ({v["id"]: v["status"] for v in on_browser["cases"]} == {v["id"]: v["status"] for v in on_vulkan["cases"]})


@pytest.mark.slow
def test_cli_replay_on_browser(carved, tmp_path):
    store = carved("zoo:tiny-llama")
    r = subprocess.run([sys.executable, "-m", "tapml.cli", "replay", str(store), "--target", "browser", "--json",
                        str(tmp_path / "v.json")], capture_output=True, text=True, timeout=300)
    assert r.returncode in (0, 1), r.stdout + r.stderr
    verdicts = json.loads((tmp_path / "v.json").read_text())
    assert verdicts["target"] == "browser" and verdicts["device"]["adapter"].startswith("google swiftshader")
    assert (r.returncode == 0) == (verdicts["summary"]["pass"] == len(verdicts["cases"]))
    assert "pass" in r.stdout and "on browser (google swiftshader" in r.stdout


def test_no_webgpu_adapter_is_a_clear_error():
    with pytest.raises(TapmlError, match="no WebGPU adapter.*mesa-vulkan-drivers"):
        # no Vulkan and no GL fallback: Dawn finds no adapter at all
        open_browser(chromium_flags=("--use-vulkan=none", "--use-angle=none",
                                     "--disable-vulkan-fallback-to-gl-for-dawn"), connect_timeout=60)


def test_missing_chromium_is_exit_2_saying_what_to_install(tmp_path, carved):
    env = {**os.environ, "PATH": str(tmp_path), "TAPML_CHROMIUM": ""}
    store = carved("zoo:mlp")
    r = subprocess.run([sys.executable, "-m", "tapml.cli", "replay", str(store), "--target", "browser"],
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "apt-get install chromium" in r.stderr


def test_no_launch_mode_turns_a_separately_started_browser_into_the_device():
    from tapml.platforms.chromium import ChromiumProcess
    platform = open_browser(launch=False, connect_timeout=60)
    assert platform.browser is None and "/t/" in platform.url
    other = ChromiumProcess(platform.url)  # stands in for a person opening the URL
    LAUNCHED.append(other)
    try:
        assert platform.caps()["adapter_info"]["architecture"] == "swiftshader"
        a, b = torch.randn(33), torch.randint(0, 3, (33,))
        c, _ = platform.run(add_program(33), [a, b])
        assert torch.equal(c, a + b.float())
    finally:
        platform.close()
        other.close()


def test_no_launch_mode_refuses_foreign_clients_without_spending_the_url():
    """Before any page joined: clients without the page's Origin are refused and the URL stays
    good for the real page; after it joined, the URL (token included) is spent."""
    from tapml.platforms.chromium import ChromiumProcess
    platform = open_browser(launch=False, connect_timeout=60)
    page = None
    try:
        for origin in (None, "http://evil.example", "null"):
            status, body = _ws_refusal(platform.url, origin)
            assert status == 403 and b"Origin" in body
        assert not platform.bridge.hello.done()
        page = ChromiumProcess(platform.url)
        LAUNCHED.append(page)
        assert platform.wait_for_device()["adapter"]["architecture"] == "swiftshader"
        status, body = _ws_refusal(platform.url, platform.bridge.origin)
        assert status == 403 and b"already used" in body
        a, b = torch.randn(33), torch.randint(0, 3, (33,))
        assert torch.equal(platform.run(add_program(33), [a, b])[0], a + b.float())
    finally:
        platform.close()
        if page is not None:
            page.close()


def _serve_browser_no_launch() -> subprocess.Popen:
    """``tapml serve --platform browser --no-launch`` on a free port, its output piped."""
    return subprocess.Popen([sys.executable, "-m", "tapml.cli", "serve", "--platform", "browser", "--no-launch",
                             "--port", "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _page_url_and_port(server: subprocess.Popen) -> tuple[str, str]:
    """The page URL and the port that ``server`` (serve --no-launch) prints once it listens."""
    import re
    url = port = None
    while port is None:
        line = server.stdout.readline()
        assert line, f"serve exited: {server.stderr.read()}"
        url = url or (re.search(r"open (http://\S+/t/\S+/) in a browser", line) or [None, None])[1]
        port = (re.search(r"listening on \S+:(\d+)", line) or [None, None])[1]
    assert url, "serve printed no page URL"
    return url, port


def test_serve_no_launch_refuses_foreign_clients_at_its_page_bridge():
    """`tapml serve --platform browser --no-launch` prints its URL (for the person who started it);
    its bridge refuses a WebSocket without the page's Origin, and a copied URL once a page joined."""
    from tapml.platforms.chromium import ChromiumProcess
    from tapml.driving.targets import open_target
    server = _serve_browser_no_launch()
    page = None
    try:
        url, port = _page_url_and_port(server)
        origin = url.split("/t/")[0]
        for bad in (None, "http://evil.example", origin.replace("127.0.0.1", "127.0.0.2")):
            status, body = _ws_refusal(url, bad)
            assert status == 403 and b"Origin" in body, (bad, body)
        page = ChromiumProcess(url)  # the person opens the printed URL: the refusals did not spend it
        LAUNCHED.append(page)
        with open_target(f"remote://127.0.0.1:{port}") as device:
            assert device.caps()["adapter"].startswith("google swiftshader")  # the page joined
            status, body = _ws_refusal(url, origin)
            assert status == 403 and b"already used" in body
            a, b = torch.randn(33), torch.randint(0, 3, (33,))
            assert torch.equal(device.run(add_program(33), [a, b])[0], a + b.float())
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()
        if page is not None:
            page.close()


def test_no_launch_mode_hands_out_a_fresh_url_when_the_page_is_lost():
    import time
    from tapml.platforms.chromium import ChromiumProcess
    urls = []
    platform = open_browser(launch=False, connect_timeout=60, on_url=urls.append)
    first_url = platform.url
    pages = [ChromiumProcess(first_url)]  # a person opening the URL
    LAUNCHED.extend(pages)
    try:
        program = add_program(33)
        a, b = torch.randn(33), torch.randint(0, 3, (33,))
        assert torch.equal(platform.run(program, [a, b])[0], a + b.float())
        pages[0].close()  # the person closes the tab
        deadline = time.monotonic() + 20
        while not urls and time.monotonic() < deadline:
            time.sleep(0.05)
        assert urls == [platform.url] and platform.url != first_url and "/t/" in platform.url
        with pytest.raises(DeviceLost, match="device lost: .*; open the new page URL tapml printed"):
            platform.run(program, [a, b])  # at once, not after a timeout
        with pytest.raises(DeviceLost, match="new page URL"):
            platform.reconnect()
        with pytest.raises(urllib.error.HTTPError) as e:  # the old URL is spent
            urllib.request.urlopen(first_url, timeout=5)
        assert e.value.code == 403
        pages.append(ChromiumProcess(platform.url))  # another page takes its place
        LAUNCHED.append(pages[-1])
        assert platform.wait_for_device()["adapter"]["architecture"] == "swiftshader"
        platform.reconnect()  # a page is attached: nothing to do
        a = torch.randn(33)
        assert torch.equal(platform.run(program, [a, b])[0], a + b.float())  # the new page gets the program anew
        assert len(urls) == 1  # no new URL while a page is attached
    finally:
        platform.close()
        for page in pages:
            page.close()


@pytest.mark.slow
def test_serve_no_launch_makes_a_browser_a_remote_device(browser, carved, tmp_path):
    """`tapml serve --platform browser --no-launch` + a separately started Chromium on the printed URL
    is a device that `remote://` replay uses; when that page is lost, serve prints a fresh URL and
    a page opening it is the device again, without restarting serve."""
    import re
    import select
    import time
    from tapml.platforms.chromium import ChromiumProcess
    store = carved("zoo:mlp")
    server = _serve_browser_no_launch()
    pages = []
    try:
        url, port = _page_url_and_port(server)
        pages.append(ChromiumProcess(url))  # a person opening the URL
        LAUNCHED.append(pages[-1])

        def remote_replay():
            r = subprocess.run([sys.executable, "-m", "tapml.cli", "replay", str(store), "--target",
                                f"remote://127.0.0.1:{port}", "--json", str(tmp_path / "v.json")],
                               capture_output=True, text=True, timeout=180)
            assert r.returncode in (0, 1), r.stdout + r.stderr
            return json.loads((tmp_path / "v.json").read_text())
        verdicts = remote_replay()
        assert verdicts["device"]["adapter"].startswith("google swiftshader")
        assert verdicts["summary"]["pass"] > 0
        from tapml.carving import CarveStore
        from tapml.driving.replay import replay
        direct = replay(CarveStore(store), browser, "browser")  # the same page, without the server in between
        assert [(v["id"], v["status"]) for v in verdicts["cases"]] == [(v["id"], v["status"]) for v in direct["cases"]]

        pages[0].close()  # the tab is closed: serve hands out a fresh URL
        assert select.select([server.stdout], [], [], 20)[0], "serve printed no new URL after the page was lost"
        line = server.stdout.readline()
        new_url = (re.search(r"open (http://\S+/t/\S+/) in a browser", line) or [None, None])[1]
        assert new_url and new_url != url, line
        pages.append(ChromiumProcess(new_url))
        LAUNCHED.append(pages[-1])
        for _ in range(20):  # runs before the new page has opened WebGPU are device-lost verdicts
            again = remote_replay()
            if not any("device lost" in v["message"] for v in again["cases"]):
                break
            time.sleep(1)
        assert [(v["id"], v["status"]) for v in again["cases"]] == [(v["id"], v["status"]) for v in direct["cases"]]
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()
        for page in pages:
            page.close()


def _processes_mentioning(text: str) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        try:
            if text in Path(f"/proc/{entry}/cmdline").read_bytes().decode(errors="replace"):
                pids.append(int(entry))
        except (OSError, ValueError):
            continue
    return pids


@pytest.mark.slow
def test_interrupted_replay_leaves_no_chromium(carved):
    import time
    store = carved("zoo:tiny-llama")
    from support import interruptible
    tapml = subprocess.Popen([sys.executable, "-m", "tapml.cli", "replay", str(store), "--target", "browser"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=interruptible)
    profile = None
    deadline = time.monotonic() + 60
    while profile is None and time.monotonic() < deadline and tapml.poll() is None:
        for entry in os.listdir("/proc"):
            try:
                if Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1] != str(tapml.pid):
                    continue
                args = Path(f"/proc/{entry}/cmdline").read_bytes().decode().split("\0")
            except (OSError, IndexError):
                continue
            profile = next((a.split("=", 1)[1] for a in args if a.startswith("--user-data-dir=")), profile)
        time.sleep(0.1)
    assert profile, "tapml never started chromium"
    time.sleep(1.0)  # let the replay get going
    tapml.send_signal(signal.SIGINT)
    out, err = tapml.communicate(timeout=30)
    assert tapml.returncode == 130, err[-2000:]
    time.sleep(0.5)
    assert _processes_mentioning(profile) == []
    assert not Path(profile).exists()


NON_FINITE_MODEL = '''
import torch


class Guarded(torch.nn.Module):
    def forward(self, x):
        return torch.exp(x) * torch.sign(x)


def factory():
    x = torch.tensor([[float("nan"), float("inf"), 1e-40, -2e-39, 0.5, -1.0]])
    return Guarded(), (x,)
'''


def test_a_mismatch_on_data_the_device_does_not_keep_names_its_float_model(browser, tmp_path_factory):
    """SwiftShader assumes no NaN/Inf and flushes subnormals (the WGSL spec allows both): the
    device's float model is measured and in the verdict, and a case whose data holds such values
    says so instead of leaving a bare mismatch; lavapipe keeps them, and the same cases pass."""
    from support import store_from_source, vulkan_or_skip
    from tapml.driving.replay import replay
    store = store_from_source(tmp_path_factory, "non_finite", NON_FINITE_MODEL)
    on_browser = replay(store, browser, "browser")
    assert on_browser["device"]["float_model"] == {"nan_inf": False, "subnormals": False}
    mismatched = [v for v in on_browser["cases"] if v["status"] == "mismatch"]
    assert mismatched, [(v["op"], v["status"]) for v in on_browser["cases"]]
    for v in mismatched:
        assert "which this device does not keep" in v["message"] and "float_model" in v["message"], v["message"]
    vulkan_or_skip()
    with _open_vulkan() as vulkan:
        on_vulkan = replay(store, vulkan, "wgpu:vulkan")
    assert on_vulkan["device"]["float_model"] == {"nan_inf": True, "subnormals": True}
    assert all(v["status"] == "pass" for v in on_vulkan["cases"]), [(v["op"], v["message"]) for v in on_vulkan["cases"]]


# Last in the file: it closes the session's browser that the tests above share.
def test_your_own_gelu_kernel_runs_in_the_browser(browser, carved, tmp_path):
    """The README's gelu kernel (examples/kernels/gelu.wgsl) on every gelu case of zoo:mlp in the page;
    the same file scaled by 1.01 is a mismatch on exactly those cases."""
    from tapml.carving.store import CarveStore
    from tapml.platforms.kernel_override import KernelOverridePlatform
    from tapml.platforms.wgsl.user_kernels import parse_kernel_options
    from tapml.driving.replay import replay
    gelu = Path(__file__).resolve().parents[1] / "examples" / "kernels" / "gelu.wgsl"
    wrong = tmp_path / "wrong_gelu.wgsl"
    wrong.write_text(gelu.read_text().replace("y[i] = 0.5 * v", "y[i] = 1.01 * 0.5 * v"))
    store = CarveStore(carved("zoo:mlp"))
    cases = [c for c in store.cases if c["op"] in ("aten.gelu.default", "aten.relu.default")]
    assert any(c["op"] == "aten.gelu.default" for c in cases)
    for path, status in ((gelu, "pass"), (wrong, "mismatch")):
        platform = KernelOverridePlatform(browser, parse_kernel_options([f"aten.gelu.default={path}"]))
        result = replay(store, platform, "browser", cases=cases)
        assert {(v["op"], v["status"]) for v in result["cases"]} == \
            {("aten.gelu.default", status), ("aten.relu.default", "pass")}, result["cases"]


def test_no_leftover_chromium_processes(browser):
    browser.close()
    assert LAUNCHED
    for proc in LAUNCHED:
        assert proc.proc.poll() is not None
        assert proc.session_pids() == [], f"chromium helpers of {proc.pid} still run"
        assert not Path(proc.profile).exists()
    profiles = [p.profile for p in LAUNCHED]
    for entry in os.listdir("/proc"):
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        assert not any(p in cmdline for p in profiles), f"process {entry} still runs: {cmdline[:200]}"
