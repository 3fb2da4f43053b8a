"""The session on a generation store's decode graph (``graph="decode"``, ``tapml session --graph
decode``): the first decode step's real inputs, the reference's cache after the prefill, and a
saved state that says which graph it is about."""

import json
import subprocess
import sys

import pytest

from tapml.errors import TapmlError

TAPML = [sys.executable, "-m", "tapml.cli"]
FAULT = "aten.rsqrt.default=scale:1.01"


def run_tapml(*args, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([*TAPML, *map(str, args)], capture_output=True, text=True, timeout=300, **kwargs)


def test_decode_session_runs_the_decode_step_and_matches_on_the_reference(gen_store, tmp_path):
    import torch

    import tapml
    from tapml.carving import CarveStore
    from tapml.judging.verdict import MigrationState
    store = CarveStore(gen_store)
    decode = store.step_graph("decode")
    with tapml.Session(str(gen_store), target="reference", graph="decode", state=str(tmp_path / "s.json")) as s:
        assert [n.name for n in s.graph.nodes] == [n.name for n in decode.nodes]
        assert "decode graph" in s.scope_note
        # the decode step's real inputs: step 1's token, and a run on them gives step 1's logits
        inputs, expected = s.checker.model_io()
        assert torch.equal(inputs["input_ids"], store.step_inputs(1)["input_ids"])
        logits = next(v for v in expected.values() if v.shape[-1:] == store.step_logits(1).shape)
        assert torch.equal(logits.flatten(), store.step_logits(1))

        assert len(s.offload("all")) == len(decode.nodes)
        result = s.compare_model()
        assert result["status"] == "pass" and result["graph"] == "decode" and result["id"].startswith("decode:")
        assert result["on_target"] == len(decode.nodes) and result["regions"] == 1
        assert s.status()["graph"] == "decode"
        assert s.bisect() is None
        assert all(r["run_ms"] >= 0 for r in s.profile()["regions"])
        path = s.save()
    state = json.loads(path.read_text())
    assert state["graph"] == "decode" and state["nodes"] == len(decode.nodes)
    assert set(state["placement"]["nodes"]) == {n.name for n in decode.nodes}
    assert state["placement"]["ops_share"] == 1.0 and state["end_to_end"]["status"] == "pass"
    assert [u["graph"] for u in state["units"]] == ["decode"]
    read = MigrationState.read(path, strict=True)
    assert read.graph == "decode" and read.units[0].graph == "decode"


def test_prefill_session_on_a_generation_store_says_its_graph(gen_store):
    import tapml
    from tapml.carving import CarveStore
    with tapml.Session(str(gen_store), target="reference") as s:
        assert len(s.graph.nodes) == len(CarveStore(gen_store).step_graph("prefill").nodes)
        assert "--graph decode" in s.scope_note
        s.offload("all")
        assert s.compare_model()["graph"] == "prefill"
        assert s.state()["graph"] == "prefill"


def test_an_injected_fault_is_bisected_to_rsqrt_nodes_of_the_decode_graph(gen_store):
    import tapml
    with tapml.Session(str(gen_store), target="reference", graph="decode", inject=[FAULT]) as s:
        rsqrt = s.select("aten.rsqrt.default")
        assert rsqrt and all(s.graph.node(n).op == "aten.rsqrt.default" for n in rsqrt)
        s.offload("all")
        found = []
        for _ in range(len(rsqrt) + 1):
            result = s.compare_model()
            if result["status"] == "pass":
                break
            assert result["status"] == "mismatch" and result["max_abs_err"] > 1e-4
            culprit = s.bisect()
            assert culprit["op"] == "aten.rsqrt.default" and set(culprit["nodes"]) <= set(rsqrt)
            assert (culprit["graph"], culprit["step"]) == ("decode", 1)
            found += culprit["nodes"]
            s.fallback(*culprit["nodes"])
        assert found and s.compare_model()["status"] == "pass"

        # diff and the op stage see the fault on the decode step's inputs too
        s.offload(found[0])
        out = s.diff(found[0])["outputs"][0]
        assert not out["passed"]
        w = out["worst"][0]
        assert abs(w["target"] - 1.01 * w["reference"]) < 1e-4 * max(1.0, abs(w["reference"]))
        bad = [v for v in s.compare_ops()["cases"] if v["status"] != "pass"]
        assert bad and {v["op"] for v in bad} == {"aten.rsqrt.default"}
        culprits = s.state()["culprits"]
        assert culprits and all(c["graph"] == "decode" for c in culprits)


def test_cli_session_on_the_decode_graph_reads_a_script(gen_store, tmp_path):
    script = "offload all\ncheck\nbisect\nstatus\nsave\nquit\n"
    r = run_tapml("session", gen_store, "--graph", "decode", "--target", "reference", "--inject", FAULT,
              "--state", tmp_path / "s.json", input=script)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "(decode graph)" in r.stdout and "end to end: mismatch" in r.stdout
    assert "culprit (" in r.stdout and "aten.rsqrt.default at rsqrt" in r.stdout
    state = json.loads((tmp_path / "s.json").read_text())
    assert state["graph"] == "decode" and state["culprits"][0]["graph"] == "decode"
    assert state["units"][0]["id"] == "decode:check:0"


def test_bad_graph_usage_exits_2(gen_store, carved, tmp_path):
    import tapml
    mlp = carved("zoo:mlp")
    r = run_tapml("session", mlp, "--graph", "decode", input="quit\n")
    assert r.returncode == 2 and "not a generation store" in r.stderr, r.stdout + r.stderr
    r = run_tapml("session", "zoo:mlp", "--graph", "decode", input="quit\n")
    assert r.returncode == 2 and "needs a generation store" in r.stderr, r.stdout + r.stderr
    r = run_tapml("session", gen_store, "--graph", "sideways", input="quit\n")
    assert r.returncode == 2 and "prefill or decode" in r.stderr, r.stdout + r.stderr
    with pytest.raises(TapmlError, match="not a generation store"):
        tapml.Session(str(mlp), graph="decode")
    # a fault must name an op of the decode graph
    r = run_tapml("session", gen_store, "--graph", "decode", "--inject", "aten.tanh.default=scale:1.01", input="quit\n")
    assert r.returncode == 2 and "no aten.tanh.default node" in r.stderr, r.stdout + r.stderr


@pytest.mark.device
@pytest.mark.xdist_group("wgpu")
def test_decode_session_on_vulkan(gen_store):
    pytest.importorskip("tapml.platforms.wgpu_native", reason="the wgpu platform is not built yet")
    import tapml
    with tapml.Session(str(gen_store), target="wgpu:vulkan", graph="decode") as s:
        assert len(s.offload("all")) == len(s.graph.nodes)
        result = s.compare_model()
        assert result["status"] == "pass", result["message"]
        assert result["graph"] == "decode" and result["regions"] == 1
