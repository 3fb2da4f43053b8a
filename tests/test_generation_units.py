"""Generation stores through migrate, gen-tests and reports: a decode pass of units after the
prefill's, culprits named with their graph and step, kill -9 and --resume of a generation
migration, generated tests of decode cases, and the report of a `tapml generate --json`."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tapml.driving.journal import journal_path

FAULT = "aten.rsqrt.default=scale:1.01"
TAPML = [sys.executable, "-m", "tapml.cli"]


def tapml(*args, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([*TAPML, *map(str, args)], capture_output=True, text=True, timeout=300, **kwargs)


def normalized(state: dict) -> dict:
    """A state without what differs between runs: timings and the store's path."""
    def strip(x):
        if isinstance(x, dict):
            return {k: strip(v) for k, v in x.items() if k not in ("time_ms", "device_ms")}
        if isinstance(x, list):
            return [strip(v) for v in x]
        return x
    return strip({k: v for k, v in state.items() if k != "store"})


@pytest.mark.device
def test_migrate_a_generation_store_checks_the_decode_graph_too(gen_store, tmp_path):
    state_path = tmp_path / "s.json"
    r = tapml("migrate", gen_store, "--target", "wgpu:vulkan", "--state", state_path, "--quiet")
    assert r.returncode == 0, r.stdout + r.stderr
    state = json.loads(state_path.read_text())
    decode = [u for u in state["units"] if u["id"].startswith("decode:")]
    assert decode and all(u["graph"] == "decode" and u["status"] == "pass" for u in decode)
    assert {u["kind"] for u in decode} == {"region", "model"}
    models = {u["id"]: u for u in state["units"] if u["kind"] == "model"}
    assert set(models) == {"model", "decode:model"} and models["model"]["graph"] == "prefill"
    assert state["placement"]["decode"]["ops_share"] == 1.0 and state["placement"]["ops_share"] == 1.0
    assert state["passed"] and "decode step end to end: pass" in r.stdout
    # the state (with its decode units and placement) is valid to the strict reader
    from tapml.judging.verdict import MigrationState
    assert MigrationState.read(state_path, strict=True).passed


@pytest.mark.device
def test_an_injected_fault_is_found_in_the_prefill_and_the_decode_pass(gen_store, tmp_path):
    state_path = tmp_path / "s.json"
    r = tapml("migrate", gen_store, "--target", "wgpu:vulkan", "--state", state_path, "--inject", FAULT, "--quiet")
    assert r.returncode == 1, r.stdout + r.stderr
    culprits = json.loads(state_path.read_text())["culprits"]
    found = {(c["graph"], c["step"]) for c in culprits if c["op"] == "aten.rsqrt.default"}
    assert found == {("prefill", 0), ("decode", 1)}
    assert all(c["op"] == "aten.rsqrt.default" for c in culprits)


@pytest.mark.device
def test_kill_9_mid_decode_pass_then_resume_reaches_the_same_state(gen_store, tmp_path):
    whole = tmp_path / "whole.json"
    assert tapml("migrate", gen_store, "--target", "wgpu:vulkan", "--state", whole, "--inject", FAULT,
                 "--quiet").returncode == 1
    expected = json.loads(whole.read_text())

    killed = tmp_path / "killed.json"
    args = ["migrate", gen_store, "--target", "wgpu:vulkan", "--state", killed, "--inject", FAULT, "--quiet"]
    proc = subprocess.Popen([*TAPML, *map(str, args)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 240
    journal = journal_path(killed)
    while '"unit:decode:' not in (journal.read_text() if journal.exists() else ""):  # inside the decode pass
        assert proc.poll() is None, "the migration ended before its decode pass was journaled"
        assert time.monotonic() < deadline
        time.sleep(0.005)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    partial = json.loads(killed.read_text())
    assert partial["stage"] != "done"

    r = tapml(*args, "--resume")
    assert r.returncode == 1, r.stdout + r.stderr
    final = json.loads(killed.read_text())
    assert final["complete"] and normalized(final) == normalized(expected)


def test_gen_tests_of_a_generation_store_name_the_graph_and_steps_and_pass(gen_store, tmp_path):
    suite = tmp_path / "suite"
    r = tapml("gen-tests", gen_store, "-o", suite)
    assert r.returncode == 0, r.stdout + r.stderr
    collected = subprocess.run([sys.executable, "-m", "pytest", str(suite), "-q", "-p", "no:cacheprovider",
                                "--collect-only"], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    ids = [line for line in collected.stdout.splitlines() if "::test_" in line]
    assert any("[decode@steps1-2::" in i for i in ids) and any("[prefill@steps0" in i for i in ids)
    run = subprocess.run([sys.executable, "-m", "pytest", str(suite), "-q", "-p", "no:cacheprovider",
                          "--tapml-target", "reference"], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:]
    assert f"{len(ids)} passed" in run.stdout


def _generate_doc(status: str = "mismatch") -> dict:
    steps = [{"step": 0, "kind": "prefill", "reference_token": 7, "target_token": 7, "max_abs_err": 1e-6,
              "status": "pass", "message": ""},
             {"step": 1, "kind": "decode", "reference_token": 9, "target_token": 9, "max_abs_err": 2e-6,
              "status": "near-tie", "message": "top-2 gap 1e-5"},
             {"step": 2, "kind": "decode", "reference_token": 3, "target_token": 4, "max_abs_err": 0.25,
              "status": status, "message": "logits differ"}]
    return {"target": "wgpu:vulkan", "model": "zoo:tiny-llama", "device": {"adapter": "llvmpipe", "backend": "Vulkan",
                                                                        "features": [], "limits": {}},
            "mode": "teacher-forced", "steps": steps,
            "summary": {"steps": 3, "pass": 1, "mismatch": 1, "near_tie": 1, "error": 0, "first_failure": 2},
            "culprits": [{"op": "aten.rsqrt.default", "node": "rsqrt_3", "module": "model.layers.1.input_layernorm",
                          "kind": "op", "step": 2, "max_abs_err": 0.5, "graph": "decode"}],
            "programs_compiled": 12, "upload_bytes_per_decode_step": 8,
            "tokens_per_s": {"target": 10.0, "reference": 100.0}}


def test_report_of_a_generate_json_has_the_step_table_plot_and_culprits(tmp_path):
    doc = tmp_path / "g.json"
    doc.write_text(json.dumps(_generate_doc()))
    for fmt in ("html", "md", "xml"):
        r = tapml("report", doc, "-o", tmp_path / f"r.{fmt}")
        assert r.returncode == 1, r.stdout + r.stderr  # step 2 mismatches: a finding
    html = (tmp_path / "r.html").read_text()
    assert 'id="steps-s0"' in html and "near-tie" in html and "error per step" in html and "<svg" in html
    assert "rsqrt_3" in html
    md = (tmp_path / "r.md").read_text()
    assert "| 2 | decode | 3 | 4 | 0.25 | ❌ mismatch |" in md and "`aten.rsqrt.default`" in md
    xml = (tmp_path / "r.xml").read_text()
    assert 'name="step 2 decode"' in xml and xml.count("<failure") == 1  # the near-tie is not a failure


def test_a_malformed_generate_json_is_refused_with_the_field(tmp_path):
    bad = _generate_doc(status="wrong")
    doc = tmp_path / "g.json"
    doc.write_text(json.dumps(bad))
    r = tapml("report", doc, "-o", tmp_path / "r.md")
    assert r.returncode == 2 and "steps[2]" in r.stderr and "status" in r.stderr
    assert not (tmp_path / "r.md").exists()
