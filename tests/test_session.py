"""The interactive session: its Python API and its REPL driven by scripted input."""

import io
import json
import subprocess
import sys

import pytest

from tapml.errors import TapmlError

TAPML = [sys.executable, "-m", "tapml.cli"]
INJECT = ["aten.tanh.default=scale:1.01"]


@pytest.fixture(scope="module")
def gpt2_path(carved):
    return carved("zoo:tiny-gpt2")


@pytest.fixture
def session(gpt2_path, tmp_path):
    import tapml
    with tapml.Session(str(gpt2_path), target="reference", state=str(tmp_path / "s.json"), inject=INJECT) as s:
        yield s


def test_importing_tapml_stays_light_and_exports_session():
    code = ("import sys, tapml; light = 'torch' not in sys.modules; S = tapml.Session; "
            "print(light, S.__module__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["True", "tapml.driving.session"]


def test_api_finds_each_faulty_node_and_ends_matching(session, tmp_path):
    assert session.status()["placement"]["ops_on_target"] == 0
    assert len(session.offload("all")) == len(session.graph.nodes)
    found = []
    for _ in range(3):
        result = session.compare_model()
        if result["status"] == "pass":
            break
        assert result["status"] == "mismatch" and result["max_abs_err"] > 1e-4
        culprit = session.bisect()
        assert culprit["kind"] == "node" and culprit["op"] == "aten.tanh.default"
        found += culprit["nodes"]
        assert session.fallback(*culprit["nodes"]) == culprit["nodes"]
    assert sorted(found) == ["tanh", "tanh_1"]
    assert session.compare_model()["status"] == "pass"
    assert session.bisect() is None
    status = session.status()
    assert status["placement"]["ops_on_target"] == len(session.graph.nodes) - 2
    assert len(status["regions"]) == 3  # split around the two tanh nodes

    # diff: the faulty op on the target shows its error and the worst elements.
    session.offload("tanh_1")
    d = session.diff("tanh_1")
    out = d["outputs"][0]
    assert d["placed"] == "target" and not out["passed"] and len(out["worst"]) == 8
    w = out["worst"][0]
    assert abs(w["target"] - 1.01 * w["reference"]) < 1e-5
    session.fallback("aten.tanh.default")

    prof = session.profile()
    assert [r["nodes"] for r in prof["regions"]] == [r["nodes"] for r in status["regions"]]
    assert all(r["run_ms"] > 0 for r in prof["regions"])

    path = session.save()
    state = json.loads(path.read_text())
    assert state["target"] == "reference" and state["end_to_end"]["status"] == "pass"
    assert [c["nodes"] for c in state["culprits"]] == [["tanh"], ["tanh_1"]]
    assert sum(v == "reference" for v in state["placement"]["nodes"].values()) == 2


def test_api_selection(session):
    assert session.select("transformer.h.1.mlp.act") == [n.name for n in session.graph.nodes
                                                         if n.module == "transformer.h.1.mlp.act"]
    assert session.select("aten.tanh.default") == ["tanh", "tanh_1"]
    assert session.select("lm_head", "tanh") == ["tanh"] + [n.name for n in session.graph.nodes
                                                            if n.module == "lm_head"]
    with pytest.raises(TapmlError, match="did you mean"):
        session.select("transformer.h.9")
    with pytest.raises(TapmlError, match="nothing is on the target"):
        session.bisect()
    with pytest.raises(TapmlError, match="no node named"):
        session.diff("nope")


def test_compare_ops_runs_the_cases_of_offloaded_nodes(session):
    session.offload("transformer.h.0.mlp")
    result = session.compare_ops()
    ops = {v["op"] for v in result["cases"]}
    assert "aten.tanh.default" in ops and "aten.embedding.default" not in ops
    bad = [v for v in result["cases"] if v["status"] != "pass"]
    assert [v["op"] for v in bad] == ["aten.tanh.default"]


def test_shell_with_scripted_input(session, tmp_path):
    from rich.console import Console

    from tapml.cli.session import SessionShell
    script = "\n".join(["offload all", "check", "bisect", "fallback tanh", "bisect", "fallback tanh_1", "check",
                        "diff tanh", "status", "profile", f"save {tmp_path / 'saved.json'}",
                        f"report {tmp_path / 'r.html'}", "offload no.such.module", "frobnicate", "help", "quit",
                        "status"]) + "\n"
    buf = io.StringIO()
    shell = SessionShell(session, console=Console(file=buf, width=200, highlight=False), stdin=io.StringIO(script))
    shell.cmdloop()
    text = buf.getvalue()
    assert "end to end: mismatch" in text and "end to end: pass" in text
    assert "culprit (" in text and "aten.tanh.default at tanh " in text and "at tanh_1 " in text
    assert "no node, module, op or case named 'no.such.module'" in text
    assert "unknown command 'frobnicate'" in text and shell.errors == 2
    assert "check [ops]" in text  # help text is printed literally, not as markup
    assert json.loads((tmp_path / "saved.json").read_text())["end_to_end"]["status"] == "pass"
    assert "report written to" in text and (tmp_path / "r.html").stat().st_size > 1000
    assert text.rstrip().endswith("> quit")  # nothing after quit runs


def test_shell_completes_names(session):
    from tapml.cli.session import SessionShell
    shell = SessionShell(session, stdin=io.StringIO(""))
    assert shell.complete_offload("transformer.h.1.mlp.a", "offload transformer.h.1.mlp.a", 8, 29) == \
        ["transformer.h.1.mlp.act"]
    assert "aten.tanh.default" in shell.complete_fallback("aten.ta", "", 0, 0)
    assert shell.complete_diff("tanh", "", 0, 0) == ["tanh", "tanh_1"]


def test_cli_session_reads_a_script_from_stdin(gpt2_path, tmp_path):
    script = "offload all\ncheck\nbisect\nfallback aten.tanh.default\ncheck\nsave\nquit\n"
    r = subprocess.run(TAPML + ["session", str(gpt2_path), "--target", "reference", "--inject", INJECT[0],
                                "--state", str(tmp_path / "s.json")], input=script, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "2 node(s) moved to the reference" in r.stdout and "end to end: pass" in r.stdout
    placement = json.loads((tmp_path / "s.json").read_text())["placement"]
    # every node but the two tanh the fallback moved (torch 2.13 exports 157 of them, 2.14 fewer)
    assert placement["ops_on_target"] == placement["ops_total"] - 2
    bad = subprocess.run(TAPML + ["session", str(gpt2_path)], input="offload nowhere\n", capture_output=True, text=True)
    assert bad.returncode == 2 and "1 scripted command(s) failed" in bad.stderr


@pytest.mark.device
@pytest.mark.xdist_group("wgpu")
def test_session_on_vulkan(carved):
    pytest.importorskip("tapml.platforms.wgpu_native", reason="the wgpu platform is not built yet")
    import tapml
    with tapml.Session(str(carved("zoo:mlp")), target="wgpu:vulkan", inject=["aten.relu.default=offset:0.1"]) as s:
        s.offload("all")
        assert s.compare_model()["status"] == "mismatch"
        culprit = s.bisect()
        assert (culprit["op"], culprit["nodes"]) == ("aten.relu.default", ["relu"])
        s.fallback("relu")
        assert s.compare_model()["status"] == "pass"
        assert len(s.profile()["regions"]) == 2


def test_a_model_carved_without_state_is_removed_at_close_unless_saved(tmp_path):
    from tapml import Session
    with Session("zoo:mlp", target="reference") as s:
        scratch = s.store_path
        assert scratch.is_dir()
    assert not scratch.exists()
    with Session("zoo:mlp", target="reference") as s:
        kept = s.store_path
        s.save(str(tmp_path / "state.json"))
    assert kept.is_dir()
    import json
    import shutil
    assert json.loads((tmp_path / "state.json").read_text())["store"] == str(kept)
    shutil.rmtree(kept.parent)
