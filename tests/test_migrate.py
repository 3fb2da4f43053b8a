"""Migration: the three stages, exact localization of injected faults, bisection of accumulated
error, the journal surviving a real kill, and the CLI's exit codes."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from typer.testing import CliRunner

from tapml.judging.compare import Tolerances
from tapml.driving.hybrid import REFERENCE, TARGET
from tapml.errors import DeviceLost, PlatformError, Unsupported
from tapml.driving.journal import journal_path
from tapml.driving.migrate import Migration, exit_code
from tapml.driving.regions import module_regions
from tapml.driving.replay import run_case
from tapml.driving.targets import open_target
from tapml.judging.verdict import outcome_verdict
from support import store_from_source

TAPML = [sys.executable, "-m", "tapml.cli"]
CHAIN_MODEL = textwrap.dedent("""
    import torch

    class Add(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.bias = torch.nn.Parameter(torch.randn(8))

        def forward(self, x):
            return x + self.bias

    class Chained(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.chain = torch.nn.Sequential(*[Add() for _ in range(4)])
            self.head = torch.nn.Linear(8, 4)

        def forward(self, x):
            return self.head(torch.relu(self.chain(x)))

    def factory():
        return Chained(), (torch.randn(2, 8),)
""")


def tapml(*args):
    from tapml.cli import app
    return CliRunner().invoke(app, [str(a) for a in args])


@pytest.fixture(scope="module")
def gpt2(carved):
    from tapml.carving import CarveStore
    return CarveStore(carved("zoo:tiny-gpt2"))


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    return store_from_source(tmp_path_factory, "chain", CHAIN_MODEL)


def migrate(store, tmp_path, target="reference", inject=None, tol=None, name="s.json"):
    with open_target(target, inject=inject) as platform:
        return Migration(store, platform, target, tmp_path / name, inject=inject,
                         tolerances=Tolerances.parse(tol)).run()


def strip_times(x):
    if isinstance(x, dict):
        return {k: strip_times(v) for k, v in x.items() if k not in ("time_ms",)}
    if isinstance(x, list):
        return [strip_times(v) for v in x]
    return x


def test_clean_migration_offloads_everything(gpt2, tmp_path):
    state = migrate(gpt2, tmp_path)
    assert state["passed"] and exit_code(state) == 0 and state["complete"]
    assert state["placement"]["ops_share"] == 1.0 and state["placement"]["flops_share"] == 1.0
    assert state["end_to_end"]["status"] == "pass" and state["culprits"] == []
    # The op stage's verdicts are exactly what replay gives.
    with open_target("reference") as platform:
        expected = run_case(platform, gpt2, gpt2.cases[5])
    assert set(state["cases"][5]) == set(expected)
    assert [c["id"] for c in state["cases"]] == [c["id"] for c in gpt2.cases]
    # Regions grow along the module tree: every module checked once, children before parents, the model last.
    regions = [u for u in state["units"] if u["kind"] == "region"]
    assert [u["module"] for u in regions] == [p for p, _ in module_regions(gpt2.graph)]
    assert regions[-1]["module"] == "" and state["units"][-1]["kind"] == "model"
    on_disk = json.loads((tmp_path / "s.json").read_text())
    assert strip_times(on_disk) == strip_times(state)


TANH_NODES = ["tanh", "tanh_1"]


@pytest.mark.parametrize("inject,kind,nodes", [
    ("aten.tanh.default=scale:1.01", "op", TANH_NODES),
    ("aten.tanh.default=offset:0.05", "op", TANH_NODES),
    ("aten.tanh.default=nan", "op", TANH_NODES),
    ("aten.tanh.default=compile-error", "error", TANH_NODES),
    # One node only: the op's carved case passes, the node is found by bisecting its region.
    ("aten.tanh.default@tanh_1=scale:1.01", "node", ["tanh_1"]),
    ("aten.addmm.default@addmm_6=compile-error", "node", ["addmm_6"]),
])
def test_injected_faults_are_localized_exactly(gpt2, tmp_path, inject, kind, nodes):
    state = migrate(gpt2, tmp_path, inject=[inject])
    op = inject.split("=")[0].split("@")[0]
    assert len(state["culprits"]) == 1, state["culprits"]
    culprit = state["culprits"][0]
    assert (culprit["kind"], culprit["op"], culprit["nodes"]) == (kind, op, nodes)
    assert culprit["module"].startswith("transformer.h.")
    on_reference = sorted(n for n, where in state["placement"]["nodes"].items() if where == REFERENCE)
    assert on_reference == sorted(nodes)
    assert state["end_to_end"]["status"] == "pass", state["end_to_end"]
    assert not state["passed"] and exit_code(state) == 1
    if culprit["kind"] == "node":
        probes = [u for u in state["units"] if u.get("role") == "bisect"]
        assert 0 < len(probes) <= 12  # O(log n) in the region's size


def test_accumulated_error_is_bisected(chain, tmp_path):
    # Each add is 6e-5 off: alone within atol 1e-4, but two in a row are not.
    state = migrate(chain, tmp_path, inject=["aten.add.Tensor=offset:6e-5"], tol=["0,1e-4"])
    assert state["summary"] == {"pass": len(chain.cases), "mismatch": 0, "unsupported": 0, "error": 0, "flaky": 0}
    leaf = [u for u in state["units"] if u["id"].startswith("region:chain.")]
    assert len(leaf) == 4 and all(u["status"] == "pass" for u in leaf)
    assert next(u for u in state["units"] if u["id"] == "region:chain")["status"] == "mismatch"
    culprits = state["culprits"]
    assert [c["kind"] for c in culprits] == ["accumulated", "accumulated"]
    assert [c["nodes"] for c in culprits] == [["add", "add_1"], ["add_2", "add_3"]]
    assert all(c["module"] == "chain" for c in culprits)
    assert state["end_to_end"]["status"] == "pass" and exit_code(state) == 1
    assert state["placement"]["nodes"]["addmm"] == TARGET


def _journal_lines(path):
    try:
        return path.read_text().count("\n")
    except FileNotFoundError:
        return 0


def _run_until(cmd, journal, lines, timeout=90):
    """Start a migration and SIGKILL it once its journal holds ``lines`` lines."""
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + timeout
    while _journal_lines(journal) < lines:
        if proc.poll() is not None:
            pytest.fail(f"migration ended before the kill point: {proc.stderr.read()}")
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail("migration did not reach the kill point")
        time.sleep(0.005)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    return _journal_lines(journal)


@pytest.mark.slow
def test_kill_and_resume_gives_the_same_state(gpt2, tmp_path):
    inject = "aten.tanh.default@tanh_1=scale:1.01"
    expected = migrate(gpt2, tmp_path, inject=[inject], name="whole.json")
    state = tmp_path / "killed.json"
    journal = journal_path(state)
    base = TAPML + ["migrate", str(gpt2.path), "--target", "reference", "--state", str(state), "--inject", inject, "-q"]
    # First kill in the op stage, second in the region stage (74 cases, then regions and bisection).
    at = _run_until(base, journal, 30)
    assert 30 <= at < 80
    json.loads(state.read_text())  # readable at any instant
    at = _run_until(base + ["--resume"], journal, 90)
    assert at >= 90
    partial = json.loads(state.read_text())
    assert not partial["complete"]
    with open(journal, "a") as f:  # a write torn by the kill
        f.write('{"key": "unit:region:transfor')
    done = subprocess.run(base + ["--resume"], capture_output=True, text=True)
    assert done.returncode == 1, done.stderr
    final = json.loads(state.read_text())
    assert final["complete"]
    assert strip_times(final) == strip_times(expected)
    ids = [u["id"] for u in final["units"]]
    assert len(ids) == len(set(ids))


def test_cli_migrate_carves_beside_the_state_and_reports(tmp_path):
    r = subprocess.run(TAPML + ["migrate", "zoo:mlp", "--state", str(tmp_path / "m.json")],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "m.store" / "manifest.json").is_file()
    assert "placement: 10/10 ops (100.0%)" in r.stdout and "end to end: pass" in r.stdout
    state = json.loads((tmp_path / "m.json").read_text())
    assert state["passed"] and state["store"] == str(tmp_path / "m.store")
    # Resuming a finished migration redoes nothing and gives the same answer.
    again = tapml("migrate", "zoo:mlp", "--state", tmp_path / "m.json", "--resume")
    assert again.exit_code == 0, again.output
    assert strip_times(json.loads((tmp_path / "m.json").read_text())) == strip_times(state)


def failure(e):
    v = outcome_verdict(e)
    return {"status": v.status, "message": v.message}


def test_failure_turns_any_exception_into_a_verdict_that_names_its_region():
    e = PlatformError("shader broke")
    e.region = ["a", "b", "c"]
    assert failure(e) == {"status": "error", "message": "in region a..c (3 nodes): shader broke"}
    assert failure(Unsupported("no f64")) == {"status": "unsupported", "message": "no f64"}
    k = KeyError("x")
    k.region = ["mm"]
    assert failure(k) == {"status": "error", "message": "in mm: KeyError: 'x'"}
    with pytest.raises(DeviceLost):  # the device's absence is never a verdict on the code
        failure(DeviceLost("server gone"))


def test_resume_rebuilds_a_removed_journal_from_the_state(mlp, tmp_path):
    args = ["migrate", mlp.path, "--state", tmp_path / "s.json", "--inject", "aten.gelu.default=scale:1.1"]
    assert tapml(*args).exit_code == 1
    state = json.loads((tmp_path / "s.json").read_text())
    journal_path(tmp_path / "s.json").unlink()
    r = tapml(*args, "--resume")
    assert r.exit_code == 1, r.output
    assert strip_times(json.loads((tmp_path / "s.json").read_text())) == strip_times(state)


def test_cli_finding_exits_1_with_the_culprit(gpt2, tmp_path):
    r = tapml("migrate", gpt2.path, "--state", tmp_path / "s.json", "--inject", "aten.tanh.default=scale:1.01")
    assert r.exit_code == 1, r.output
    assert "aten.tanh.default" in r.output and "end to end: pass" in r.output


@pytest.mark.parametrize("args,message", [
    (["--inject", "aten.tanh.default=wobble"], "unknown fault kind"),
    (["--inject", "aten.conv2d.default=nan"], "has no aten.conv2d.default"),
    (["--inject", "aten.tanh.default@mm=nan"], "no aten.tanh.default node named 'mm'"),
    (["--tol", "fast"], "--tol"),
    (["--target", "tpu"], "unknown target"),
])
def test_cli_bad_input_exits_2(gpt2, tmp_path, args, message):
    r = tapml("migrate", gpt2.path, "--state", tmp_path / "s.json", *args)
    assert r.exit_code == 2, r.output
    assert message in r.output


def test_cli_bad_paths_and_mismatched_resume_exit_2(gpt2, tmp_path):
    r = tapml("migrate", gpt2.path, "--state", tmp_path / "nowhere" / "s.json")
    assert r.exit_code == 2 and "does not exist" in r.output
    r = tapml("migrate", "zoo:nonesuch", "--state", tmp_path / "s.json")
    assert r.exit_code == 2 and "unknown zoo model" in r.output
    journal_path(tmp_path / "s.json").write_text(json.dumps({"header": {"format": "tapml-migration/1",
                                                                        "target": "wgpu:gl"}}) + "\n")
    r = tapml("migrate", gpt2.path, "--state", tmp_path / "s.json", "--resume")
    assert r.exit_code == 2 and "cannot resume" in r.output and "without --resume" in r.output


def _wgpu_or_skip():
    try:
        import tapml.platforms.wgpu_native  # noqa: F401
    except ImportError as e:
        pytest.skip(f"the wgpu platform is not available: {e}")


@pytest.mark.device
@pytest.mark.slow
@pytest.mark.xdist_group("wgpu")
def test_migrate_tiny_llama_to_vulkan(carved, tmp_path):
    _wgpu_or_skip()
    r = subprocess.run(TAPML + ["migrate", str(carved("zoo:tiny-llama")), "--target", "wgpu:vulkan",
                                "--state", str(tmp_path / "s.json")], capture_output=True, text=True)
    state = json.loads((tmp_path / "s.json").read_text())
    assert r.returncode == 0, (r.stdout[-3000:], [c["message"][:200] for c in state["culprits"]])
    assert state["placement"]["ops_share"] == 1.0 and state["end_to_end"]["status"] == "pass"
    assert state["device"]["backend"].lower().startswith("vulkan")


@pytest.mark.device
@pytest.mark.slow
@pytest.mark.xdist_group("wgpu")
def test_migrate_tiny_gpt2_to_vulkan_finds_the_injected_tanh(gpt2, tmp_path):
    _wgpu_or_skip()
    r = subprocess.run(TAPML + ["migrate", str(gpt2.path), "--target", "wgpu:vulkan", "--state",
                                str(tmp_path / "s.json"), "--inject", "aten.tanh.default=scale:1.01"],
                       capture_output=True, text=True)
    assert r.returncode == 1, r.stderr[-2000:]
    state = json.loads((tmp_path / "s.json").read_text())
    assert [(c["kind"], c["op"]) for c in state["culprits"]] == [("op", "aten.tanh.default")], \
        [(c["kind"], c["op"], c["message"][:200]) for c in state["culprits"]]
    assert state["end_to_end"]["status"] == "pass"
    assert 0 < state["placement"]["ops_share"] < 1.0
