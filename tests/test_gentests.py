"""Generated pytest regression suites: generate from real carved stores, then run the generated
suite with plain pytest in a subprocess against real targets (reference, fault-injected, wgpu)."""

import json
import os
import re
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest
from typer.testing import CliRunner

from tapml.carving.gentests import case_test_id, generate_suite, unique_ids
from tapml.cli import app

runner = CliRunner()


def gen_tests(*args):
    return runner.invoke(app, ["gen-tests", *map(str, args)])


def run_suite(suite, *args, cwd=None, env=None):
    """Run a generated suite with plain pytest in a fresh process; returns (rc, output)."""
    env = {**{k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "TAPML_"))}, **(env or {})}
    env.setdefault("XDG_RUNTIME_DIR", "/tmp")
    r = subprocess.run([sys.executable, "-m", "pytest", str(suite), "-q", "-p", "no:cacheprovider", *map(str, args)],
                       capture_output=True, text=True, cwd=cwd or suite.parent, env=env, timeout=300)
    return r.returncode, r.stdout + r.stderr


def junit(path):
    """{test name: (outcome, message)} from a JUnit XML report."""
    result = {}
    for tc in ET.parse(path).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for kind in ("failure", "error", "skipped"):
            el = tc.find(kind)
            if el is not None:
                outcome, message = kind, (el.get("message") or "") + (el.text or "")
                break
        result[tc.get("name")] = (outcome, message)
    return result


@pytest.fixture(scope="module")
def llama(carved):
    from tapml.carving.store import CarveStore
    path = carved("zoo:tiny-llama")
    return path, CarveStore(path)


@pytest.fixture(scope="module")
def llama_suite(llama, tmp_path_factory):
    path, _ = llama
    out = tmp_path_factory.mktemp("suite") / "gen"
    r = gen_tests(path, "-o", out)
    assert r.exit_code == 0, r.output
    return out


def test_one_readable_test_per_case_parametrized_per_op(llama, llama_suite):
    _, store = llama
    ops = {c["op"] for c in store.cases}
    files = sorted(p.name for p in llama_suite.glob("test_*.py"))
    assert len(files) == len(ops)
    assert "test_aten_mm_default.py" in files
    params = []
    for f in llama_suite.glob("test_*.py"):
        text = f.read_text()
        assert len(text) < 6000, f"{f.name} should stay small: data belongs in the store"
        assert text.count("def test_") == 1 and "indirect=True" in text
        params += re.findall(r"case\('(c\d+)', '([^']+)'", text)
    assert sorted(cid for cid, _ in params) == sorted(c["id"] for c in store.cases)
    ids = [tid for _, tid in params]
    assert len(set(ids)) == len(ids)
    mm = store.case(next(c["id"] for c in store.cases if c["op"] == "aten.mm.default"
                         and c["module"] == "model.layers.0.mlp.down_proj"))
    assert f"{mm['module']}::aten.mm.default[16x128-128x64]" in ids
    # tolerances are recorded per case; exact (integer) cases carry none
    assert "tol=(0.001, 0.0001)" in (llama_suite / "test_aten_mm_default.py").read_text()
    conftest = (llama_suite / "conftest.py").read_text()
    assert str(store.path.resolve()) in conftest and "DEFAULT_TARGET = 'reference'" in conftest


def test_ids_disambiguate_cases_that_differ_only_in_arguments():
    index = {"a": {"shape": [1, 17]}, "b": {"shape": []}}
    c = {"id": "c7", "module": "model", "op": "aten.slice.Tensor", "inputs": ["a"], "output_meta": []}
    assert case_test_id(c, index) == "model::aten.slice.Tensor[1x17]"
    top = {"id": "c1", "module": "", "op": "aten.arange.start_step", "inputs": [], "output_meta": [{"shape": [16]}]}
    assert case_test_id(top, index) == "top::aten.arange.start_step[out:16]"
    assert case_test_id({**c, "inputs": ["b"]}, index) == "model::aten.slice.Tensor[scalar]"
    assert unique_ids([("c7", "x"), ("c8", "x"), ("c9", "y")]) == ["x/c7", "x/c8", "y"]


def test_generated_suite_passes_on_reference_with_junit(llama, llama_suite, tmp_path):
    _, store = llama
    rc, out = run_suite(llama_suite, "--junitxml", tmp_path / "r.xml")
    assert rc == 0, out
    report = junit(tmp_path / "r.xml")
    assert len(report) == len(store.cases)
    assert {o for o, _ in report.values()} == {"passed"}
    assert "test_aten_mm_default[lm_head::aten.mm.default[16x64-64x256]]" in report
    props = {p.get("name"): p.get("value") for p in ET.parse(tmp_path / "r.xml").getroot().iter("property")}
    assert props["tapml_status"] == "pass" and "tapml_op" in props


def test_injected_fault_fails_exactly_the_affected_tests(llama, llama_suite, tmp_path):
    _, store = llama
    mm = [c for c in store.cases if c["op"] == "aten.mm.default"]
    rc, out = run_suite(llama_suite, "--tapml-inject", "aten.mm.default=scale:1.01", "--junitxml", tmp_path / "r.xml")
    assert rc == 1, out
    failed = {name: msg for name, (o, msg) in junit(tmp_path / "r.xml").items() if o != "passed"}
    assert len(failed) == len(mm)
    assert all(name.startswith("test_aten_mm_default[") for name in failed)
    lm_head = next(msg for name, msg in failed.items() if "lm_head::" in name)
    node = next(c["node"] for c in mm if c["module"] == "lm_head")
    for part in (f"aten.mm.default at node {node} in module lm_head", "on reference: mismatch",
                 "max_abs_err=", "max_rel_err=", "mismatch_fraction=", "elements mismatch"):
        assert part in lm_head, lm_head

    # --tapml-tol takes precedence over the tolerance each test recorded
    rc, out = run_suite(llama_suite, "--tapml-inject", "aten.mm.default=scale:1.01", "--tapml-tol",
                        "aten.mm=0.02,1e-4", "-k", "aten.mm")
    assert rc == 0 and f"{len(mm)} passed" in out, out

    # one planted bug in one node: exactly that case's test fails
    target = next(c for c in store.cases if c["op"] == "aten.bmm.default")
    rc, out = run_suite(llama_suite, "--tapml-inject", f"aten.bmm.default@{target['node']}=nan", "-k", "bmm or mm")
    assert rc == 1
    assert re.search(r"\b1 failed, \d+ passed, \d+ deselected", out), out
    assert f"aten.bmm.default at node {target['node']}" in out and "NaN/Inf differ" in out


@pytest.mark.slow
def test_xdist_and_k_selection(llama, llama_suite):
    _, store = llama
    n_mm = sum(c["op"] == "aten.mm.default" for c in store.cases)
    rc, out = run_suite(llama_suite, "-n", "2", "-k", "aten.mm.default")
    assert rc == 0, out
    assert f"{n_mm} passed" in out and "failed" not in out


def _state(store, tmp_path, inject):
    """A real migration state: the Verdict JSON of replaying the store on a faulty reference."""
    from tapml.driving.replay import replay
    from tapml.driving.targets import open_target
    with open_target("reference", inject=inject) as platform:
        result = replay(store, platform, "reference")
    path = tmp_path / "state.json"
    path.write_text(json.dumps(result))
    return path, [v for v in result["cases"] if v["status"] != "pass"]


@pytest.mark.slow
def test_state_known_failures_are_strict_xfails(llama, tmp_path):
    path, store = llama
    faults = ["aten.mm.default=scale:1.01", "aten.sin.default=compile-error"]
    state, failing = _state(store, tmp_path, faults)
    assert {v["status"] for v in failing} == {"mismatch", "error"}
    suite = tmp_path / "gen"
    r = gen_tests(path, "-o", suite, "--state", state)
    assert r.exit_code == 0, r.output
    assert f"{len(failing)} known failure(s) marked xfail" in r.output

    # today's port (the same faults): green, the known failures xfail with their reason
    rc, out = run_suite(suite, "-rx", *[a for f in faults for a in ("--tapml-inject", f)])
    assert rc == 0, out
    assert f"{len(store.cases) - len(failing)} passed, {len(failing)} xfailed" in out
    assert "injected compile error in aten.sin.default" in out

    # the port got fixed underneath the suite: strict xfails pass unexpectedly and turn it red
    rc, out = run_suite(suite, "-k", "sin or mm")
    assert rc == 1
    assert out.count("XPASS(strict)") >= 1 and f"{len(failing)} failed" in out

    # skip: not run; fail: run, and the failure carries the recorded reason
    r = gen_tests(path, "-o", suite, "--state", state, "--known-failures", "skip")
    assert r.exit_code == 0, r.output
    rc, out = run_suite(suite, "-k", "sin or mm")
    assert rc == 0 and f"{len(failing)} skipped" in out, out
    r = gen_tests(path, "-o", suite, "--state", state, "--known-failures", "fail")
    assert r.exit_code == 0, r.output
    rc, out = run_suite(suite, "-k", "sin", "--tapml-inject", faults[1])
    assert rc == 1 and "known failure recorded during migration: error on reference" in out, out


def test_copied_data_moves_with_the_suite_and_works_without_the_plugin(llama, tmp_path):
    path, store = llama
    copy = tmp_path / "store"
    shutil.copytree(path, copy)
    r = gen_tests(copy, "-o", tmp_path / "gen", "--copy-data")
    assert r.exit_code == 0, r.output
    shutil.rmtree(copy)
    moved = tmp_path / "elsewhere" / "suite"
    moved.parent.mkdir()
    shutil.move(tmp_path / "gen", moved)
    # -p no:tapml: the entry point is off, the generated conftest registers the plugin itself
    rc, out = run_suite(moved, "-p", "no:tapml", "--tapml-target", "reference", "-k", "mm or embedding")
    assert rc == 0 and "passed" in out, out

    manifest = moved / "data" / "manifest.json"
    manifest.write_text(manifest.read_text() + "\n")
    rc, out = run_suite(moved, "-k", "lm_head")
    assert rc == 1 and "changed since this suite was generated" in out, out


@pytest.mark.slow
def test_generated_suite_on_a_remote_device_server(llama, llama_suite, tmp_path):
    token = tmp_path / "token"
    token.write_text("gentests-token-0123456789")
    env = {**os.environ, "XDG_RUNTIME_DIR": "/tmp"}
    server = subprocess.Popen([sys.executable, "-m", "tapml.cli", "serve", "-p", "reference", "--port", "0",
                               "--token-file", str(token)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, env=env)
    try:
        port = None
        for line in server.stdout:
            m = re.search(r"listening on 127\.0\.0\.1:(\d+)", line)
            if m:
                port = m.group(1)
                break
        assert port, "tapml serve did not say where it listens"
        target = f"remote://127.0.0.1:{port}"
        rc, out = run_suite(llama_suite, "--tapml-target", target, "--tapml-token-file", token, "-k", "aten.mm")
        assert rc == 0 and "passed" in out, out
        rc, out = run_suite(llama_suite, "--tapml-target", target, "-k", "lm_head::aten.mm")
        assert rc == 1 and "requires a token" in out and "--tapml-token-file" in out, out
    finally:
        server.terminate()
        server.wait(timeout=30)


def test_hand_written_suite_uses_the_plugin(llama, tmp_path):
    path, store = llama
    (tmp_path / "hand").mkdir()
    (tmp_path / "hand" / "test_mine.py").write_text(
        "import pytest\n\n\n"
        "@pytest.mark.tapml(op='aten.mm.default')\n"
        "def test_matmuls(tapml_case):\n"
        "    assert tapml_case.check()['status'] == 'pass'\n\n\n"
        "@pytest.mark.parametrize('tapml_case', ['c0'], indirect=True)\n"
        "def test_embedding(tapml_case):\n"
        "    assert tapml_case.case['op'] == 'aten.embedding.default'\n"
        "    tapml_case.check()\n\n\n"
        "def test_target(tapml_target):\n"
        "    assert tapml_target.caps()['adapter'] == 'cpu'\n")
    n_mm = sum(c["op"] == "aten.mm.default" for c in store.cases)
    rc, out = run_suite(tmp_path / "hand", "--tapml-store", path, "--tapml-tol", "aten.mm=1e-3,1e-4")
    assert rc == 0 and f"{n_mm + 2} passed" in out, out
    rc, out = run_suite(tmp_path / "hand")
    assert rc != 0 and "pass --tapml-store DIR" in out


def test_bad_options_and_input_say_what_to_fix(llama, llama_suite, tmp_path):
    path, _ = llama
    rc, out = run_suite(llama_suite, "--tapml-target", "wgpu:nope")
    assert rc == 4 and "unknown target 'wgpu:nope'" in out
    rc, out = run_suite(llama_suite, "--tapml-inject", "mm=scale:2")
    assert rc == 4 and "full aten overload name" in out
    rc, out = run_suite(llama_suite, "--tapml-tol", "fast")
    assert rc == 4 and "--tapml-tol 'fast'" in out

    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    bad_state = tmp_path / "state.json"
    bad_state.write_text(json.dumps({"cases": [{"id": "c9999", "op": "aten.mm.default", "status": "mismatch"}]}))
    for args, message in [
        ((tmp_path / "missing", "-o", tmp_path / "g"), "does not exist"),
        ((path, "-o", tmp_path / "mine"), "which tapml did not generate"),
        ((path, "-o", tmp_path / "g", "--known-failures", "maybe"), "use one of xfail, fail, skip"),
        ((path, "-o", tmp_path / "g", "--state", tmp_path / "none.json"), "cannot read --state"),
        ((path, "-o", tmp_path / "g", "--state", bad_state), "not in store"),
        ((path, "-o", tmp_path / "g", "--tol", "x"), "--tol 'x'"),
    ]:
        r = gen_tests(*args)
        assert r.exit_code == 2, (args, r.output)
        assert message in r.output, (args, r.output)
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"


@pytest.mark.slow
def test_generate_for_a_pure_torch_zoo_model(carved, tmp_path):
    info = generate_suite(carved("zoo:mlp"), tmp_path / "gen")
    assert info["cases"] >= 3 and info["data"] == "referenced"
    rc, out = run_suite(tmp_path / "gen")
    assert rc == 0 and f"{info['cases']} passed" in out, out


@pytest.fixture(scope="module")
def vulkan_available():
    """Skips the test, with the reason, when wgpu:vulkan cannot be opened here."""
    from tapml.driving.targets import open_target
    try:
        open_target("wgpu:vulkan").close()
    except Exception as e:  # noqa: BLE001 - any failure to get an adapter means skip
        pytest.skip(f"no wgpu Vulkan adapter on this machine ({e}); CI provides lavapipe")


@pytest.mark.device
def test_generated_suite_on_wgpu_vulkan(vulkan_available, llama, llama_suite, tmp_path):
    _, store = llama
    rc, out = run_suite(llama_suite, "--tapml-target", "wgpu:vulkan", "--junitxml", tmp_path / "r.xml")
    assert rc == 0, out[-4000:]
    report = junit(tmp_path / "r.xml")
    assert len(report) == len(store.cases) and {o for o, _ in report.values()} == {"passed"}

    rc, out = run_suite(llama_suite, "--tapml-target", "wgpu:vulkan", "--tapml-inject",
                        "aten._softmax.default=offset:0.01", "-k", "softmax or mm")
    assert rc == 1
    n = sum(c["op"] == "aten._softmax.default" for c in store.cases)
    assert f"{n} failed" in out and "aten._softmax.default at node" in out and "on wgpu:vulkan: mismatch" in out


PLANTED_BUG = """
# A regression planted in the wgpu platform's lowering of aten.sigmoid.default: it emits tanh.
from tapml.graph import Graph, Node
from tapml.platforms.wgpu_native import WgpuPlatform

_compile = WgpuPlatform._compile


def _buggy(self, graph):
    nodes = [Node(**{**vars(n), "op": "aten.tanh.default"}) if n.op == "aten.sigmoid.default" else n
             for n in graph.nodes]
    return _compile(self, Graph(inputs=graph.inputs, nodes=nodes, outputs=graph.outputs))


WgpuPlatform._compile = _buggy
"""


@pytest.mark.device
def test_regression_planted_in_a_wgpu_lowering_fails_exactly_its_tests(vulkan_available, llama, llama_suite,
                                                                      tmp_path):
    _, store = llama
    (tmp_path / "planted_bug.py").write_text(PLANTED_BUG)
    sigmoid = [c for c in store.cases if c["op"] == "aten.sigmoid.default"]
    assert sigmoid
    rc, out = run_suite(llama_suite, "--tapml-target", "wgpu:vulkan", "-p", "planted_bug", "--junitxml",
                        tmp_path / "r.xml", env={"PYTHONPATH": str(tmp_path)})
    assert rc == 1, out[-4000:]
    failed = {name: msg for name, (o, msg) in junit(tmp_path / "r.xml").items() if o != "passed"}
    assert len(failed) == len(sigmoid) and all(n.startswith("test_aten_sigmoid_default[") for n in failed)
    msg = next(iter(failed.values()))
    assert f"aten.sigmoid.default at node {sigmoid[0]['node']} in module {sigmoid[0]['module']}" in msg
    assert "on wgpu:vulkan: mismatch" in msg and "max_abs_err=" in msg
