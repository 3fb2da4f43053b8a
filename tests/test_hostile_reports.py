"""Reports and generated suites from files written by a stranger: every string a state or a
store carries (model, target, adapter, op, node, module, message, culprit, case id) holds HTML,
script, Markdown syntax, control characters, non-ASCII and very long text. The HTML, Markdown
and JUnit reports must show it as text and stay well formed; a generated suite must collect
exactly one test per case, with ASCII names and ids."""

import json
import re
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from html.parser import HTMLParser
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tapml.cli import app
from tapml.reports.html import TEMPLATES, visible_text

IMG = "<img src=x onerror=alert(1)>"
SCRIPT = "</script><script>alert(1)</script>"
CONTROLS = "\x00\x01\x08\x0b\x1b\x7f\x85\u2028\u2029\u202e\ud800\ufffe"
# One line break, table pipes, a code span, emphasis, a link, a heading, an entity, an HTML comment.
MARKUP = "`code` | cell | *em* _u_ [link](javascript:alert(1)) ![i](x) # h &lt; <!-- c --> $x$ ~~s~~ \\"
PAYLOAD = f"{IMG}{SCRIPT}{MARKUP}\n- item{CONTROLS}é日本🙂"
LONG = "m" * 5000 + IMG
FORBIDDEN_IN_XML = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ud800-\udfff\ufffe\uffff]")
UNSHOWABLE = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\u2028\u2029\u202e\ud800-\udfff]")


def tapml(*args):
    """Run ``tapml ARGS`` in this process."""
    return CliRunner().invoke(app, [str(a) for a in args])


def hostile_state(tag: str) -> dict:
    """A migration state (the shape `tapml migrate --state` writes, valid for tapml.judging.verdict's
    schema) whose every free-text field is hostile."""
    p = f"{tag}{PAYLOAD}"
    worst = [{"index": [0, 1], "target": p, "reference": 2.0}, {"index": [7], "target": None, "reference": p}]
    return {
        "target": f"wgpu:{p}", "model": f"zoo:{p}", "store": p, "stage": "region", "inject": [p],
        "device": {"adapter": p, "backend": p, "features": [p, LONG], "limits": {p: p, "maxThing": 4}, "error": p},
        "tolerances": {p: [1e-3, 1e-4]},
        "cases": [
            {"id": f"c0{p}", "op": f"aten.mm.default{p}", "node": p, "module": p, "status": "mismatch",
             "message": p, "max_abs_err": 0.5, "max_rel_err": 0.1, "mismatch_fraction": 0.25, "time_ms": 1.0,
             "instances": 2, "worst": worst},
            {"id": f"c1{p}", "op": p, "node": LONG, "module": LONG, "status": "error", "message": LONG},
            {"id": "c2", "op": "aten.add.Tensor", "node": p, "module": "", "status": "pass", "time_ms": 0.5},
        ],
        "units": [{"id": p, "kind": "region", "role": p, "module": p, "nodes": [p], "status": "mismatch",
                   "message": p, "max_abs_err": 1.0, "worst": worst}],
        "culprits": [{"op": p, "ops": [p, f"aten.mm.default{p}"], "node": p, "nodes": [p], "module": p, "kind": "node",
                      "status": "mismatch", "unit": f"case:c0{p}", "case": p, "region": p, "message": p}],
        "placement": {"ops_share": 0.5, "ops_on_target": 1, "ops_total": 2, "flops_share": 0.25},
        "end_to_end": {"status": "mismatch", "message": p, "max_abs_err": 2.0, "worst": worst},
    }


@pytest.fixture(scope="module")
def hostile_files(tmp_path_factory):
    """Two hostile states with the same target (the report tells them apart by file name, which
    is hostile too), written the way json.dumps writes them (controls as \\u escapes)."""
    work = tmp_path_factory.mktemp("hostile")
    first = work / "state.json"
    second = work / f"{IMG}`|*_#.json"
    first.write_text(json.dumps(hostile_state("A")))
    state = hostile_state("A")
    state["cases"][2]["status"] = "unsupported"
    second.write_text(json.dumps(state))
    return [first, second]


class Document(HTMLParser):
    """Every element, attribute and script body of an HTML document."""

    def __init__(self, text):
        super().__init__(convert_charrefs=True)
        self.tags: list[tuple[str, dict]] = []
        self.scripts: list[str] = []
        self._in_script = False
        self.feed(text)
        self.close()

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))
        self._in_script = tag == "script"

    def handle_endtag(self, tag):
        if tag == "script":
            self._in_script = False

    def handle_data(self, data):
        if self._in_script:
            self.scripts.append(data)


def render_cli(files, out):
    r = tapml("report", *files, "-o", out)
    assert r.exit_code == 1, r.output  # findings, not a crash and not bad input
    return out.read_text(encoding="utf-8")


def test_html_report_shows_hostile_strings_as_text(hostile_files, tmp_path):
    text = render_cli(hostile_files, tmp_path / "r.html")
    reference = Document(render_cli(benign(tmp_path), tmp_path / "benign.html"))
    page = Document(text)
    # no element and no attribute came from the data: the same vocabulary as a benign report
    allowed_tags = {t for t, _ in reference.tags}
    allowed_attrs = {k for _, a in reference.tags for k in a}
    assert {t for t, _ in page.tags} <= allowed_tags
    assert {k for _, a in page.tags for k in a} <= allowed_attrs
    assert not any(t == "img" for t, _ in page.tags)
    assert not any(k.startswith("on") for _, a in page.tags for k in a)
    js = (TEMPLATES / "report.js").read_text()
    assert [t for t, _ in page.tags].count("script") == 1 and "".join(page.scripts) == js
    # the data is there, as text: escaped in the markup, intact in attributes
    assert "&lt;img src=x onerror=alert(1)&gt;&lt;/script&gt;&lt;script&gt;" in text
    finding = next(a for t, a in page.tags if t == "div" and "finding" in (a.get("class") or "").split())
    assert finding["data-op"] == visible_text(f"A{PAYLOAD}")
    assert not UNSHOWABLE.search(text), UNSHOWABLE.search(text)
    assert "\\x01" in text and "\\u202e" in text  # shown, not dropped
    assert text.count("<tr class=\"row-") == 2 * (3 + 1)  # every case and unit row of both states


def benign(tmp_path):
    """The hostile states' files with plain text in place of every string: the report's own vocabulary."""
    paths = []
    for i in range(2):
        state = json.loads(json.dumps(hostile_state("A")).replace(json.dumps(PAYLOAD)[1:-1], " plain text"))
        state["cases"][2]["status"] = "pass" if i == 0 else "unsupported"
        paths.append(tmp_path / f"benign{i}.json")
        paths[-1].write_text(json.dumps(state))
    return paths


def unescaped_pipes(line: str) -> int:
    """Cell separators of a Markdown table row: pipes not escaped by an odd run of backslashes."""
    return sum(1 for m in re.finditer(r"(\\*)\|", line) if len(m.group(1)) % 2 == 0)


def test_markdown_report_has_no_raw_html_and_keeps_its_tables(hostile_files, tmp_path):
    md = render_cli(hostile_files, tmp_path / "r.md")
    lower = md.lower()
    assert "<img" not in lower and "<script" not in lower and "</script" not in lower and "<!--" not in md
    # the only HTML is the report's own
    assert {t.lower() for t in re.findall(r"</?([A-Za-z][\w-]*)", md)} <= {"details", "summary", "code"}
    assert not UNSHOWABLE.search(md), UNSHOWABLE.search(md)
    assert "&lt;img src=x onerror=alert(1)&gt;" in md and "\\\\x01" in md  # shown as text
    lines = md.splitlines()
    # no heading, list item or quote came from the data
    headings = [line for line in lines if line.lstrip().startswith("#")]
    assert all(re.match(r"#{1,2} (tapml report: |Findings$|Op coverage$|zoo:)", h) for h in headings), headings
    assert not [line for line in lines if re.match(r"\s*- item", line)]
    # tables: every row has the header's cells, and each case is one row
    tables, current = [], []
    for line in lines + [""]:
        if line.startswith("|"):
            current.append(line)
        elif current:
            tables.append(current)
            current = []
    assert len(tables) == 1 + 2 * 2  # coverage, and cases + times per state
    for table in tables:
        assert len({unescaped_pipes(row) for row in table}) == 1, table
    assert [len(tables[1]) - 2, len(tables[3]) - 2] == [3, 3]  # the cases of each state, one row each
    # code spans: balanced on every line, and none holds text a code span would not show as is
    for line in lines:
        ticks = [m.start() for m in re.finditer(r"(?<!\\)`", line)]
        assert len(ticks) % 2 == 0, line
        for a, b in zip(ticks[::2], ticks[1::2]):
            assert not set(line[a + 1:b]) & set("<>&|"), line


def test_junit_report_is_valid_xml_with_the_data_as_text(hostile_files, tmp_path):
    text = render_cli(hostile_files, tmp_path / "r.xml")
    assert not FORBIDDEN_IN_XML.search(text)
    root = ET.parse(tmp_path / "r.xml").getroot()
    suites = root.findall("testsuite")
    assert [int(s.get("tests")) for s in suites] == [4, 4] == [len(s.findall("testcase")) for s in suites]
    props = {p.get("name"): p.get("value") for p in suites[0].iter("property")}
    assert props["model"] == visible_text(f"zoo:A{PAYLOAD}") and props["adapter"] == visible_text(f"A{PAYLOAD}")
    failure = next(tc.find("failure") for tc in suites[0].iter("testcase") if tc.find("failure") is not None)
    assert IMG in failure.get("message") and SCRIPT in failure.text and "\\x01" in failure.text
    for el in root.iter():
        for value in [el.text or "", *el.attrib.values()]:
            assert not UNSHOWABLE.search(value), (el.tag, value[:80])


def test_each_format_of_one_hostile_state_through_format_and_the_api(hostile_files, tmp_path):
    from tapml.reports import write_report
    state = json.loads(hostile_files[0].read_text())
    for fmt, start in (("html", "<!DOCTYPE html>"), ("md", "# tapml report: zoo:A&lt;img"), ("junit", "<?xml")):
        r = tapml("report", hostile_files[0], "--format", fmt, "-o", tmp_path / f"out-{fmt}.txt")
        assert r.exit_code == 1, r.output
        by_cli = (tmp_path / f"out-{fmt}.txt").read_text(encoding="utf-8")
        by_api = write_report(state, tmp_path / f"api-{fmt}.txt", format=fmt).read_text(encoding="utf-8")
        for text in (by_cli, by_api):
            assert text.startswith(start) and IMG not in text and SCRIPT not in text, text[:200]
            assert not UNSHOWABLE.search(text)


# --- generated suites -------------------------------------------------------------------------

PRINTABLE_NAME = 'x"""\'\\%é日' + IMG + SCRIPT
HOSTILE_NAME = PRINTABLE_NAME + "\n\x00\x1b\u2028\ud800"


def test_naming_is_ascii_unique_and_never_drops_a_name():
    from tapml.carving.gentests import ascii_text, case_test_id, suite_function_names, unique_ids
    ops = ["aten.permute-default", "aten.permute.default", "aten.Permute.default", "aten.é.x", "aten.日.x",
           HOSTILE_NAME, "aten.mm.default", "a" * 400, "a" * 400 + "b", ""]
    names = suite_function_names(ops)
    assert set(names) == set(ops)
    assert all(re.fullmatch(r"test_[A-Za-z0-9_]*", n) and len(n) <= 100 for n in names.values())
    assert len({n.lower() for n in names.values()}) == len(ops)  # distinct on case-insensitive disks too
    assert names["aten.mm.default"] == "test_aten_mm_default"
    assert suite_function_names(reversed(ops)) == names  # deterministic
    index = {"t": {"shape": [2, 3]}}
    cases = [{"id": cid, "module": module, "op": op, "inputs": ["t"], "output_meta": []}
             for cid, module, op in [("c1", HOSTILE_NAME, "aten.mm.default"), ("c1", HOSTILE_NAME, "aten.mm.default"),
                                     ("c2", "é", "aten.mm.default"), ("c3", "%C3%A9", "aten.mm.default"),
                                     (HOSTILE_NAME, "m", "aten.mm.default"), ("c5", "m", "aten.mm.default")]]
    ids = unique_ids([(c["id"], case_test_id(c, index)) for c in cases])
    assert len(ids) == len(cases) == len(set(ids))
    assert all(re.fullmatch(r"[ -~]+", i) and "\\" not in i for i in ids)
    assert ids[2] != ids[3]  # percent-encoding is one-to-one
    assert len(ascii_text("x" * 10000)) <= 120 and ascii_text("x" * 10000) != ascii_text("x" * 9999)


def test_literals_cannot_break_out_of_the_generated_source():
    from tapml.carving.gentests import docstring_text, py_literal
    for value in [HOSTILE_NAME, "\ud800", "'''", '"""', "\\", "\u2028", (float("nan"), float("inf")), ("a",)]:
        source = f'"""{docstring_text(value)}"""\nVALUE = {py_literal(value)}\n'
        assert source.isascii()
        scope = {}
        exec(compile(source, "<generated>", "exec"), scope)
        assert scope["__doc__"] == str(value)
        got = scope["VALUE"]
        assert got == value or (isinstance(value, tuple) and str(got) == str(value))


def _hostile_store(src: Path, dst: Path, ops: dict[int, str] | None = None) -> Path:
    """A copy of the store at ``src`` whose model, case ids and module names are hostile (every
    module the same, so readable test ids collide), with case 0 listed a second time under
    another id, and, when ``ops`` is given, op names replaced (case index -> name)."""
    shutil.copytree(src, dst)
    manifest = json.loads((dst / "manifest.json").read_text())
    manifest["model"] = f"zoo:mlp{PRINTABLE_NAME}"  # a model spec is printable text
    cases = manifest["cases"]
    cases.append(dict(cases[0]))
    renamed = {}
    for i, case in enumerate(cases):
        renamed.setdefault(case["id"], f"c{i}{HOSTILE_NAME}")
        case["id"] = f"c{i}{HOSTILE_NAME}"
        case["module"] = HOSTILE_NAME
    for node in manifest["nodes"]:
        if node.get("case") is not None:
            node["case"] = renamed[node["case"]]
    for i, op in (ops or {}).items():
        cases[i]["op"] = op
    (dst / "manifest.json").write_text(json.dumps(manifest))
    return dst


def _collect(suite: Path, *args) -> tuple[int, str]:
    r = subprocess.run([sys.executable, "-m", "pytest", str(suite), "-q", "-p", "no:cacheprovider", *args],
                       capture_output=True, text=True, cwd=suite.parent, timeout=300,
                       env={"PATH": "/usr/bin:/bin", "XDG_RUNTIME_DIR": "/tmp", "HOME": str(suite.parent)})
    return r.returncode, r.stdout + r.stderr


def _check_suite(suite: Path, n_cases: int) -> None:
    files = sorted(suite.glob("*.py"))
    for f in files:
        text = f.read_bytes()
        assert text.isascii(), f.name
        compile(text, str(f), "exec")
    written = sum(f.read_text().count("    case(") for f in files if f.name.startswith("test_"))
    assert written == n_cases
    rc, out = _collect(suite, "--collect-only")
    assert rc == 0, out
    ids = [line for line in out.splitlines() if "::" in line and "/test_" in line]
    assert len(ids) == len(set(ids)) == n_cases, out
    assert all(i.isascii() for i in ids)
    assert re.search(rf"\b{n_cases} tests? collected", out), out


def test_generated_suite_of_a_hostile_store_collects_every_case(carved, tmp_path):
    from tapml.carving.gentests import generate_suite
    store = _hostile_store(carved("zoo:mlp"), tmp_path / "store")
    info = generate_suite(store, tmp_path / "gen")
    assert info["cases"] == len(json.loads((store / "manifest.json").read_text())["cases"])
    _check_suite(tmp_path / "gen", info["cases"])
    rc, out = _collect(tmp_path / "gen")  # and they run: each test finds its case by its hostile id
    assert rc == 0 and f"{info['cases']} passed" in out, out


def test_a_store_with_op_names_outside_the_vocabulary_is_refused(carved, tmp_path):
    """Ops that differ only in characters the file naming folds (and a non-ASCII op) never reach
    the generator: the store reader refuses them, gen-tests exits 2 naming the op and writes
    nothing. (Real aten overloads never fold together: the naming test above covers the fold.)"""
    ops = {0: "aten.permute.default", 1: "aten.permute-default", 2: "aten.pérmute.default"}
    store = _hostile_store(carved("zoo:mlp"), tmp_path / "store", ops)
    r = subprocess.run([sys.executable, "-m", "tapml.cli", "gen-tests", str(store), "-o", str(tmp_path / "gen")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "aten.permute-default" in r.stdout + r.stderr, r.stdout + r.stderr
    assert not (tmp_path / "gen").exists()


# --- the terminal: escape sequences and rich markup in every printed field ------------------

#: An OSC title change, a colour, rich markup that would close no tag, C1 controls (CSI, NEL),
#: a bidi override.
TERMINAL = "\x1b]0;pwned\x07\x1b[31m[/][bold]b[/bold][/]\x9b2J\x85\u202e"
DRIVES_A_TERMINAL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def clean_terminal(r, *codes) -> str:
    """The output of a command that met hostile text: an expected exit code, no byte that drives
    a terminal, no markup error, no internal error."""
    assert r.exit_code in codes, (r.exit_code, r.output)
    assert not DRIVES_A_TERMINAL.search(r.output), repr(r.output[:2000])
    assert "MarkupError" not in r.output and "internal error" not in r.output, r.output
    return r.output


@pytest.fixture(scope="module")
def terminal_store(carved, tmp_path_factory):
    """zoo:mlp's store with hostile case ids and module paths, and markup in its model spec (a
    spec must be printable)."""
    store = tmp_path_factory.mktemp("terminal") / "store"
    shutil.copytree(carved("zoo:mlp"), store)
    m = json.loads((store / "manifest.json").read_text())
    m["model"] = "zoo:mlp[/][bold]x[/bold]"
    renamed = {c["id"]: f"{c['id']}{TERMINAL}" for c in m["cases"]}
    for item in m["cases"] + m["nodes"]:
        item["module"] = f"mod{TERMINAL}"
        if item.get("case") in renamed:
            item["case"] = renamed[item["case"]]
        if "id" in item:
            item["id"] = renamed[item["id"]]
    (store / "manifest.json").write_text(json.dumps(m))
    return store


def test_store_fields_reach_the_terminal_as_text(terminal_store, tmp_path):
    fault = ["--inject", "aten.relu.default=nan"]
    assert "zoo:mlp[/][bold]x[/bold]" in clean_terminal(tapml("inspect", terminal_store), 0)
    out = clean_terminal(tapml("replay", terminal_store, *fault), 1)
    assert "\\x1b" in out and "pwned" in out  # shown, as visible escapes (the table may fold it)
    state = tmp_path / "s.json"
    out = clean_terminal(tapml("migrate", terminal_store, "--state", state, *fault), 1)
    assert "\\x1b" in out
    clean_terminal(tapml("report", state, "-o", tmp_path / "r.html"), 1)
    clean_terminal(tapml("gen-tests", terminal_store, "-o", tmp_path / "suite", "--state", state), 0)
    script = "offload all\nstatus\ncheck ops\ncheck\nbisect\ndiff addmm\nquit\n"
    out = clean_terminal(CliRunner().invoke(app, ["session", str(terminal_store), *fault], input=script), 0)
    assert "\\x1b" in out
    # a journal whose verdicts' messages hold markup and escapes, resumed
    journal = journal_of(state)
    lines = [json.loads(line) for line in journal.read_text().splitlines()]
    for line in lines:
        record = line.get("record")
        if isinstance(record, dict) and "message" in record:
            record["message"] = f"msg{TERMINAL}"
    journal.write_text("".join(json.dumps(line) + "\n" for line in lines))
    state.unlink()
    clean_terminal(tapml("migrate", terminal_store, "--state", state, "--resume", *fault), 1)


def journal_of(state: Path) -> Path:
    from tapml.driving.journal import journal_path
    return journal_path(state)


def test_states_and_verdicts_from_strangers_reach_the_terminal_as_text(hostile_files, tmp_path):
    state = hostile_state("T")
    for case in state["cases"]:
        case["id"] += TERMINAL
        case["op"] = case["op"] + TERMINAL
    state["model"] = f"zoo:{TERMINAL}"
    path = tmp_path / "s.json"
    path.write_text(json.dumps(state))
    clean_terminal(tapml("report", path, *hostile_files, "-o", tmp_path / "r.html"), 1)
    clean_terminal(tapml("report", path, "-o", tmp_path / "r.md"), 1)


@pytest.mark.parametrize("spec", [f"zoo:x{TERMINAL}", f"hf:{TERMINAL}", f"m.py:{TERMINAL}", f"{TERMINAL}.pt2",
                                  "zoo:[/]", "[bold]x[/]"], ids=["zoo", "hf", "factory", "pt2", "zoo-markup", "markup"])
def test_model_specs_reach_the_terminal_as_text(tmp_path, spec):
    clean_terminal(tapml("carve", spec, "-o", tmp_path / "out"), 2)
    clean_terminal(tapml("migrate", spec, "--state", tmp_path / "s.json"), 2)
    clean_terminal(tapml("inspect", spec), 2)


def test_a_registrys_announcements_reach_the_terminal_as_text(tmp_path):
    """A real `tapml registry` told of a device whose announcement holds escapes, markup and a
    number where a list of features belongs: `tapml devices` lists it as text."""
    import base64
    import socket

    from tapml.remote.server import SERVICE_NAME, registry_client
    registry = subprocess.Popen([sys.executable, "-m", "tapml.cli", "registry", "--port", "0"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        m = re.search(r"listening on udp://(\S+):(\d+)", registry.stdout.readline())
        assert m, registry.stderr.read()
        spec = f"udp://127.0.0.1:{m.group(2)}"
        with socket.socket() as s:  # a port where nothing listens: the probe fails, the row stays
            s.bind(("127.0.0.1", 0))
            dead_port = s.getsockname()[1]
        # the second is malformed (a number where text and a list belong): refused whole, listed as "?"
        for info, platform in (({"platform": f"wgpu{TERMINAL}", "adapter": f"a{TERMINAL}", "backend": TERMINAL,
                                 "features": [TERMINAL]}, f"wgpu{TERMINAL}"),
                               ({"platform": "[/]", "adapter": 7, "features": 5}, "?")):
            text = json.dumps(info, separators=(",", ":"))
            alias = f"{SERVICE_NAME}-" + base64.b32encode(text.encode()).decode()
            assert registry_client(spec).register((SERVICE_NAME, alias), dead_port)
            clean_terminal(tapml("devices", "--registry", spec, "--timeout", "1"), 0)
            rows = json.loads(tapml("devices", "--registry", spec, "--timeout", "1", "--json", "-").stdout)
            row = next(r for r in rows if r["target"] == f"remote://127.0.0.1:{dead_port}")
            assert row["platform"] == platform and row["status"] != "ok"
            registry_client(spec).unregister(dead_port)
    finally:
        registry.terminate()
        registry.wait(10)
