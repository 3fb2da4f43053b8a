"""Reports from real states: a fault-injected migration and replays of zoo:tiny-gpt2, rendered as
HTML (opened in headless Chromium), Markdown, JUnit XML and in the terminal."""

import asyncio
import base64
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from html.parser import HTMLParser
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tapml.cli import app

pytestmark = pytest.mark.xdist_group("reports")  # one worker carves and migrates once for all tests
TAPML = [sys.executable, "-m", "tapml.cli"]
FAULT = "aten.tanh.default=scale:1.01"
CULPRIT_MODULE = "transformer.h.0.mlp.act"  # tiny-gpt2's GELU (tanh approximation) in layer 0


def tapml(*args):
    """Run ``tapml ARGS`` in this process."""
    return CliRunner().invoke(app, [str(a) for a in args])


@pytest.fixture(scope="module")
def states(carved, tmp_path_factory):
    """Real states of zoo:tiny-gpt2: a migration with an injected fault (the real CLI in a
    subprocess), a clean replay and a replay whose addmm returns NaN."""
    store = carved("zoo:tiny-gpt2")
    work = tmp_path_factory.mktemp("reports")
    mig = work / "migration.json"
    r = subprocess.run(TAPML + ["migrate", str(store), "--target", "reference", "--inject", FAULT,
                                "--state", str(mig), "-q"], capture_output=True, text=True)
    assert r.returncode == 1, r.stdout + r.stderr  # a finding, not a crash
    clean = work / "clean.json"
    r = tapml("replay", store, "--json", clean, "-q")
    assert r.exit_code == 0, r.output
    nan = work / "nan.json"
    r = tapml("replay", store, "--inject", "aten.addmm.default=nan", "--json", nan, "-q")
    assert r.exit_code == 1, r.output
    return {"migration": mig, "clean": clean, "nan": nan, "work": work, "store": store}


class Tags(HTMLParser):
    """Every start tag with its attributes, and the text inside <script>/<style>."""

    def __init__(self, text):
        super().__init__()
        self.tags: list[tuple[str, dict]] = []
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))

    def find(self, tag=None, **attrs):
        return [a for t, a in self.tags if (tag is None or t == tag)
                and all((a.get(k.rstrip("_")) or "").split().__contains__(v) if k == "class_" else a.get(k) == v
                        for k, v in attrs.items())]


def test_html_report_of_faulty_migration_names_the_culprit_first(states, tmp_path):
    out = tmp_path / "reports" / "gpt2.html"
    r = tapml("report", states["migration"], "-o", out)
    assert r.exit_code == 1, r.output  # the state has a finding
    assert out.is_file() and "1 culprit" in r.output
    text = out.read_text()
    page = Tags(text)
    # self-contained: nothing is fetched from anywhere
    assert not page.find("link") and not [a for a in page.find("script") if "src" in a]
    assert not [a for _, a in page.tags for k in ("src", "href") if re.match(r"\s*(https?:)?//", a.get(k) or "")]
    assert "<svg" in text and "@import" not in text
    # the culprit is the first finding, and its module is highlighted in the plot
    findings = page.find("div", class_="finding")
    assert findings[0]["data-op"] == "aten.tanh.default" and findings[0]["data-module"] == CULPRIT_MODULE
    assert "culprit" in findings[0]["class"].split()
    headline = re.search(r'id="headline-s0">(.*?)</div>', text, re.S).group(1)
    assert "culprit <code>aten.tanh.default</code>" in headline
    marked = {a["data-module"] for a in page.find("g", class_="culprit")}
    assert CULPRIT_MODULE in marked and marked <= {CULPRIT_MODULE, "transformer.h.1.mlp.act"}
    assert len(page.find("rect", class_="culprit-band")) == len(marked)
    # the per-op table has every case; the units table every region
    state = json.loads(states["migration"].read_text())
    rows = re.search(r'<table class="sortable cases" id="cases-s0">.*?<tbody>(.*?)</tbody>', text, re.S).group(1)
    assert rows.count("<tr") == len(state["cases"])
    assert 'data-status="mismatch"' in rows
    units = re.search(r'id="units-s0">.*?<tbody>(.*?)</tbody>', text, re.S).group(1)
    assert units.count("<tr") == len(state["units"])
    # summary: placement shares and the end-to-end verdict of the state
    assert f"{100 * state['placement']['ops_share']:.1f}%" in text
    assert state["end_to_end"]["status"] == "pass" and re.search(r"end to end.*?st-pass", text, re.S)


def test_markdown_report_for_pull_requests(states, tmp_path):
    out = tmp_path / "gpt2.md"
    r = tapml("report", states["migration"], states["clean"], "-o", out)
    assert r.exit_code == 1, r.output
    md = out.read_text()
    lines = md.splitlines()
    assert lines[0] == "# tapml report: zoo:tiny-gpt2"
    heads = [line for line in lines if line.startswith("## ")]
    assert heads[0] == "## Findings" and heads[1] == "## Op coverage"
    first = lines[lines.index("## Findings") + 2]
    assert "**culprit** `aten.tanh.default`" in first and CULPRIT_MODULE in first
    # every table is well formed: same number of cells in each row as in its header
    tables, current = [], []
    for line in lines + [""]:
        if line.startswith("|"):
            current.append(line)
        elif current:
            tables.append(current)
            current = []
    assert len(tables) >= 4
    for table in tables:
        widths = {len(re.split(r"(?<!\\)\|", row)) for row in table}
        assert len(widths) == 1, table[:3]
        assert set(table[1].replace("|", "").split()) <= {"---", "---:"}
    coverage = tables[0]
    tanh = next(row for row in coverage if "`aten.tanh.default`" in row)
    assert "❌ 0/1" in tanh and "✅ 1/1" in tanh  # mismatching in the migration, passing in the clean replay
    assert len(coverage) == 2 + len({c["op"] for c in json.loads(states["clean"].read_text())["cases"]})


def test_junit_report_for_ci(states, tmp_path):
    out = tmp_path / "gpt2.xml"
    r = tapml("report", states["migration"], states["clean"], states["nan"], "-o", out)
    assert r.exit_code == 1, r.output
    root = ET.parse(out).getroot()
    assert root.tag == "testsuites"
    suites = root.findall("testsuite")
    assert len(suites) == 3
    loaded = [json.loads(states[k].read_text()) for k in ("migration", "clean", "nan")]
    for suite, state in zip(suites, loaded):
        cases = suite.findall("testcase")
        assert int(suite.get("tests")) == len(cases) == len(state["cases"]) + len(state.get("units", []))
        assert int(suite.get("failures")) == len(suite.findall("testcase/failure"))
        assert int(suite.get("errors")) == len(suite.findall("testcase/error"))
        assert int(suite.get("skipped")) == len(suite.findall("testcase/skipped"))
        assert float(suite.get("time")) >= 0
        for tc in cases:
            assert tc.get("classname") and tc.get("name") and float(tc.get("time")) >= 0
            assert len(list(tc)) <= 1
        props = {p.get("name"): p.get("value") for p in suite.findall("properties/property")}
        assert props["model"] == "zoo:tiny-gpt2" and props["target"] == "reference"
    assert sum(int(s.get("tests")) for s in suites) == int(root.get("tests"))
    assert suites[1].get("failures") == "0"  # the clean replay
    failing = [tc for tc in suites[0].findall("testcase") if tc.find("failure") is not None]
    case_failure = next(tc for tc in failing if ".op.aten.tanh.default" in tc.get("classname"))
    message = case_failure.find("failure").get("message")
    assert message.startswith(f"culprit aten.tanh.default in {CULPRIT_MODULE}")
    assert "max_abs_err=" in case_failure.find("failure").text
    nan_failures = suites[2].findall("testcase/failure")
    assert nan_failures and all("addmm" in tc.get("classname") for tc in suites[2].findall("testcase")
                                if tc.find("failure") is not None)
    assert all("NaN/Inf" in f.get("message") for f in nan_failures)


def test_terminal_json_and_coverage(states):
    r = tapml("report", states["migration"], states["clean"], states["nan"])
    assert r.exit_code == 1
    assert "culprit" in r.output and "op coverage" in r.output and "aten.addmm" in r.output
    assert "98.7% of ops" in r.output
    r = tapml("report", states["clean"], "-q")
    cases = len(json.loads(Path(states["clean"]).read_text())["cases"])  # 74 with torch 2.13, 72 with 2.14
    assert r.exit_code == 0 and len(r.output.strip().splitlines()) <= 3 and f"{cases}/{cases} cases pass" in r.output
    r = tapml("report", states["migration"], states["nan"], "--json", "-")
    assert r.exit_code == 1
    data = json.loads(r.output)
    assert [d["kind"] for d in data] == ["migration", "replay"]
    assert data[0]["failures"][0]["op"] == "aten.tanh.default" and data[0]["shares"]["basis"] == "placement"
    assert data[1]["failures"][0]["max_abs_err"] is None  # NaN: no finite error, still strict JSON
    assert {f["op"] for f in data[1]["failures"]} == {"aten.addmm.default"}


def test_report_writer_api_takes_a_state_dict(states, tmp_path):
    from tapml.reports import write_report
    state = json.loads(states["migration"].read_text())
    path = write_report(state, tmp_path / "deep" / "dir" / "r.html")  # what the session's `report` calls
    assert path.is_file() and "aten.tanh.default" in path.read_text()


def test_plot_is_wellformed_svg_for_edge_cases():
    from tapml.reports.plot import module_error_svg
    svg = module_error_svg([], None)
    ET.fromstring(svg)
    points = [{"module": "a<b>&c", "max_abs_err": float("inf"), "status": "mismatch", "culprit": True, "ops": ["x"]},
              {"module": "", "max_abs_err": None, "status": "error", "culprit": False, "ops": []},
              {"module": "m.n", "max_abs_err": 0.0, "status": "pass", "culprit": False, "ops": []},
              *[{"module": f"l.{i}", "max_abs_err": 10.0 ** -i, "status": "pass", "culprit": False, "ops": []}
                for i in range(200)]]
    root = ET.fromstring(module_error_svg(points, {"status": "pass", "max_abs_err": 1e-6}))
    groups = root.findall("{http://www.w3.org/2000/svg}g")
    assert len(groups) == len(points) + 1
    assert groups[0].get("class") == "pt culprit" and groups[0].get("data-module") == "a<b>&c"


def test_minimal_verdicts_missing_optional_keys_still_render(tmp_path):
    from tapml.reports import render
    from tapml.reports.data import parse_state
    minimal = parse_state({"target": "wgpu:gl", "cases": [
        {"op": "aten.mm.default", "status": "error", "message": "device lost"},
        {"op": "aten.add.Tensor", "status": "mismatch"}, {"op": "aten.add.Tensor", "status": "pass"}]}, "min.json")
    empty = parse_state({"target": "reference", "cases": [], "device": None}, "empty.json")
    stopped = parse_state({"target": "wgpu:vulkan", "cases": [], "units": [], "stage": "region",
                           "complete": False, "culprits": [{"kind": "accumulated", "op": "aten.add.Tensor",
                                                            "node": "add..add_3", "module": "m.layers.0"}]}, "s.json")
    states = [minimal, empty, stopped]
    assert [f["op"] for f in minimal.failures] == ["aten.mm.default", "aten.add.Tensor"]  # errors first
    assert stopped.failures[0]["kind"] == "accumulated" and not stopped.passed and empty.passed
    page = render(states, "html")
    assert "device lost" in page and "stopped in stage region" in page and "not run" in page
    md = render(states, "md")
    assert "`aten.mm.default` error" in md
    root = ET.fromstring(render(states, "junit").split("\n", 1)[1])
    assert [s.get("tests") for s in root.findall("testsuite")] == ["3", "0", "0"]
    assert root.get("errors") == "1" and root.get("failures") == "1"


@pytest.mark.parametrize("content, expect", [
    ("not json", "is not valid JSON"),
    ("[1, 2]", "not an object"),
    ('{"target": "x"}', "lacks cases"),
    ('{"target": "x", "cases": [{"op": "a", "status": "fine"}]}', "cases[0].status is 'fine': input should be 'pass'"),
    ('{"target": "x", "cases": [], "units": [{"id": "u"}]}', "units[0] lacks status"),
])
def test_bad_input_exits_2_with_what_to_fix(tmp_path, content, expect):
    bad = tmp_path / "bad.json"
    bad.write_text(content)
    r = tapml("report", bad, "-o", tmp_path / "r.html")
    assert r.exit_code == 2 and expect in r.output, r.output
    assert not (tmp_path / "r.html").exists()


def test_missing_file_and_unknown_format_exit_2(states, tmp_path):
    r = tapml("report", tmp_path / "nope.json")
    assert r.exit_code == 2 and "does not exist" in r.output
    r = tapml("report", states["clean"], "-o", tmp_path / "r.pdf", "--format", "pdf")
    assert r.exit_code == 2 and "unknown report format 'pdf'" in r.output


# --- the HTML in a real browser ---------------------------------------------------------

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_FLAGS = ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--remote-debugging-port=0"]


class DevToolsPage:
    """A page in headless Chromium driven over the DevTools protocol (one websocket, a flattened
    session); records console errors, exceptions and every request the page makes."""

    def __init__(self, ws):
        self.ws, self.session, self.next_id = ws, None, 0
        self.pending: dict[int, asyncio.Future] = {}
        self.errors: list[str] = []
        self.requests: list[str] = []
        self.loaded = asyncio.Event()

    async def send(self, method, params=None, browser=False):
        self.next_id += 1
        msg = {"id": self.next_id, "method": method, "params": params or {}}
        if not browser:
            msg["sessionId"] = self.session
        self.pending[self.next_id] = fut = asyncio.get_running_loop().create_future()
        await self.ws.send(json.dumps(msg))
        return await asyncio.wait_for(fut, 30)

    async def pump(self):
        async for raw in self.ws:
            msg = json.loads(raw)
            if msg.get("id") in self.pending:
                fut = self.pending.pop(msg["id"])
                if "error" in msg:
                    fut.set_exception(RuntimeError(f"DevTools: {msg['error']}"))
                else:
                    fut.set_result(msg.get("result", {}))
                continue
            method, p = msg.get("method"), msg.get("params", {})
            if method == "Runtime.consoleAPICalled" and p.get("type") in ("error", "assert", "warning"):
                self.errors.append(f"console.{p['type']}: {[a.get('value', a.get('description')) for a in p['args']]}")
            elif method == "Runtime.exceptionThrown":
                d = p["exceptionDetails"]
                self.errors.append("exception: " + d.get("exception", {}).get("description", d.get("text", "")))
            elif method == "Log.entryAdded" and p["entry"].get("level") in ("error", "warning"):
                self.errors.append(f"log: {p['entry'].get('text')} {p['entry'].get('url', '')}")
            elif method == "Network.requestWillBeSent":
                self.requests.append(p["request"]["url"])
            elif method == "Page.loadEventFired":
                self.loaded.set()

    async def js(self, expression):
        r = await self.send("Runtime.evaluate", {"expression": expression, "returnByValue": True})
        assert "exceptionDetails" not in r, r["exceptionDetails"]
        return r["result"].get("value")


async def _in_chromium(url: str, profile: Path, drive):
    import websockets
    proc = subprocess.Popen([CHROMIUM, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", "about:blank"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        port_file = profile / "DevToolsActivePort"
        deadline = time.monotonic() + 60
        while not (port_file.exists() and len(port_file.read_text().splitlines()) >= 2):
            assert proc.poll() is None, "chromium exited at start"
            assert time.monotonic() < deadline, "chromium did not open its DevTools port in 60 s"
            await asyncio.sleep(0.1)
        port, path = port_file.read_text().splitlines()[:2]
        async with websockets.connect(f"ws://127.0.0.1:{port}{path}", max_size=64 << 20) as ws:
            page = DevToolsPage(ws)
            pump = asyncio.create_task(page.pump())
            target = await page.send("Target.createTarget", {"url": "about:blank"}, browser=True)
            attached = await page.send("Target.attachToTarget", {"targetId": target["targetId"], "flatten": True},
                                       browser=True)
            page.session = attached["sessionId"]
            for domain in ("Runtime", "Log", "Network", "Page"):
                await page.send(f"{domain}.enable")
            await page.send("Emulation.setDeviceMetricsOverride",
                            {"width": 1400, "height": 1000, "deviceScaleFactor": 1, "mobile": False})
            await page.send("Page.navigate", {"url": url})
            await asyncio.wait_for(page.loaded.wait(), 30)
            try:
                return await drive(page)
            finally:
                pump.cancel()
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _open_report(html: Path, drive):
    """Open ``html`` in a fresh headless Chromium profile beside it and run ``drive(page)``."""
    if not Path(CHROMIUM).exists():
        pytest.skip("no system chromium (apt-get install chromium)")
    profile = Path(tempfile.mkdtemp(prefix="chromium-", dir=html.parent))
    try:
        return asyncio.run(_in_chromium(html.as_uri(), profile, drive))
    finally:
        shutil.rmtree(profile, ignore_errors=True)


VISIBLE = "Array.from(document.querySelectorAll('#{t} tbody tr')).filter(r => !r.hidden)"


@pytest.mark.browser
def test_html_report_in_headless_chromium(states, tmp_path_factory):
    artifacts = tmp_path_factory.mktemp("report-artifacts")
    html = artifacts / "gpt2.html"
    r = tapml("report", states["migration"], states["clean"], states["nan"], "-o", html)
    assert r.exit_code == 1, r.output
    migration = json.loads(states["migration"].read_text())
    n_cases = len(migration["cases"])
    n_failing = sum(c["status"] != "pass" for c in migration["cases"])

    async def drive(page):
        got = {}
        await asyncio.sleep(0.2)  # let late console messages arrive
        got["first_finding"] = await page.js("document.querySelector('.finding').dataset.op")
        # sort the migration's cases by max abs error: ascending, then descending
        header = "document.querySelectorAll('#cases-s0 thead th')[5]"
        column = f"{VISIBLE.format(t='cases-s0')}.map(r => r.cells[5].dataset.v)"
        got["sort_header"] = await page.js(f"{header}.textContent")
        await page.js(f"{header}.click()")
        got["ascending"] = await page.js(column)
        got["aria"] = await page.js(f"{header}.getAttribute('aria-sort')")
        await page.js(f"{header}.click()")
        got["descending"] = await page.js(column)
        got["top_op"] = await page.js(f"{VISIBLE.format(t='cases-s0')}[0].cells[1].textContent")
        # filter by text, then by status
        set_text = ("(v => {{ const i = document.querySelector('input.filter[data-table=\"cases-s0\"]'); "
                    "i.value = v; i.dispatchEvent(new Event('input')); }})({!r})")
        await page.js(set_text.format("tanh"))
        got["text_rows"] = await page.js(f"{VISIBLE.format(t='cases-s0')}.map(r => r.textContent.toLowerCase())")
        got["count"] = await page.js("document.querySelector('.count[data-table=\"cases-s0\"]').textContent")
        await page.js(set_text.format(""))
        await page.js("(s => { s.value = 'fail'; s.dispatchEvent(new Event('change')); })"
                      "(document.querySelector('select.status-filter[data-table=\"cases-s0\"]'))")
        got["fail_rows"] = await page.js(f"{VISIBLE.format(t='cases-s0')}.map(r => r.dataset.status)")
        await page.js("(s => { s.value = ''; s.dispatchEvent(new Event('change')); })"
                      "(document.querySelector('select.status-filter[data-table=\"cases-s0\"]'))")
        got["all_rows"] = await page.js(f"{VISIBLE.format(t='cases-s0')}.length")
        got["matrix_cols"] = await page.js("document.querySelectorAll('#coverage-table thead th').length")
        got["plot_culprits"] = await page.js(
            "Array.from(document.querySelectorAll('#s0 svg g.culprit')).map(g => g.dataset.module)")
        await page.js("window.scrollTo(0, 0)")
        shot = await page.send("Page.captureScreenshot", {"format": "png"})
        got["png"] = base64.b64decode(shot["data"])
        got["errors"], got["requests"] = list(page.errors), list(page.requests)
        return got

    got = _open_report(html, drive)
    screenshot = artifacts / "gpt2-report.png"
    screenshot.write_bytes(got.pop("png"))
    print(f"report screenshot: {screenshot}")
    assert got["errors"] == []
    assert got["requests"] == [html.as_uri()]  # the document itself, nothing else
    assert got["first_finding"] == "aten.tanh.default"
    assert screenshot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and screenshot.stat().st_size > 20_000
    assert got["sort_header"].startswith("max abs err") and got["aria"] == "ascending"
    asc = [float(v) for v in got["ascending"] if v != ""]
    assert asc == sorted(asc) and len(got["ascending"]) == n_cases
    desc = [float(v) for v in got["descending"] if v != ""]
    assert desc == sorted(desc, reverse=True) and got["top_op"] == "aten.tanh.default"
    assert got["text_rows"] and all("tanh" in row for row in got["text_rows"])
    assert got["count"] == f"{len(got['text_rows'])} of {n_cases} rows"
    assert got["fail_rows"] == ["mismatch"] * n_failing and got["all_rows"] == n_cases
    assert got["matrix_cols"] == 5  # op, agreement across targets, three states
    assert CULPRIT_MODULE in got["plot_culprits"]


@pytest.mark.device
@pytest.mark.browser
@pytest.mark.slow
def test_report_of_fault_injected_migration_on_vulkan(states, tmp_path_factory):
    """The issue's bar: a fault-injected migration of zoo:tiny-gpt2 on wgpu:vulkan, reported: the
    culprit at the top, its module highlighted in the plot, no console errors in Chromium."""
    try:
        from tapml.platforms.wgpu_native import available_backends
    except ImportError as e:
        pytest.skip(f"the wgpu platform is not available: {e}")
    if "vulkan" not in available_backends():
        pytest.skip("no Vulkan adapter (install mesa-vulkan-drivers for lavapipe)")
    work = tmp_path_factory.mktemp("vulkan-report")
    state_path = work / "gpt2-vulkan.json"
    r = subprocess.run(TAPML + ["migrate", str(states["store"]), "--target", "wgpu:vulkan", "--inject", FAULT,
                                "--state", str(state_path), "-q"], capture_output=True, text=True)
    assert r.returncode == 1, r.stdout[-2000:] + r.stderr[-2000:]
    state = json.loads(state_path.read_text())
    assert state["device"]["backend"].lower().startswith("vulkan")
    html = work / "gpt2-vulkan.html"
    r = tapml("report", state_path, states["migration"], "-o", html)
    assert r.exit_code == 1, r.output

    async def drive(page):
        await asyncio.sleep(0.2)
        got = {"headline": await page.js("document.querySelector('.banner').textContent"),
               "first": await page.js("(f => [f.dataset.op, f.dataset.module, f.classList.contains('culprit')])"
                                      "(document.querySelector('.finding'))"),
               "marked": await page.js("Array.from(document.querySelectorAll('#s0 svg g.culprit'))"
                                       ".map(g => g.dataset.module)"),
               "bands": await page.js("document.querySelectorAll('#s0 svg rect.culprit-band').length"),
               "adapter": await page.js("document.querySelector('#s0 .card:nth-child(2) dd').textContent")}
        shot = await page.send("Page.captureScreenshot", {"format": "png"})
        (work / "gpt2-vulkan.png").write_bytes(base64.b64decode(shot["data"]))
        got["errors"], got["requests"] = list(page.errors), list(page.requests)
        return got

    got = _open_report(html, drive)
    print(f"report screenshot: {work / 'gpt2-vulkan.png'}")
    assert got["errors"] == [] and got["requests"] == [html.as_uri()]
    assert "wgpu:vulkan" in got["headline"] and "culprit aten.tanh.default" in " ".join(got["headline"].split())
    assert got["first"] == ["aten.tanh.default", CULPRIT_MODULE, True]
    assert CULPRIT_MODULE in got["marked"] and got["bands"] == len(got["marked"])
    assert "llvmpipe" in got["adapter"] or got["adapter"].strip() != "—"
