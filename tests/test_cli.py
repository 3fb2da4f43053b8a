"""The CLI end to end: real commands on real tiny models, and bad input giving exit 2."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from support import interruptible
from typer.testing import CliRunner

from tapml.cli import app

runner = CliRunner()
TAPML = [sys.executable, "-m", "tapml.cli"]


def tapml(*args):
    return runner.invoke(app, [str(a) for a in args])


def test_help_is_fast_and_imports_nothing_heavy():
    code = ("import sys, tapml.cli; heavy = [m for m in ('torch', 'wgpu', 'transformers') if m in sys.modules];"
            "print(heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_carve_inspect_replay_tiny_llama(tmp_path):
    store = tmp_path / "S"
    r = subprocess.run(TAPML + ["carve", "zoo:tiny-llama", "-o", str(store)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "cases" in r.stderr
    r = tapml("inspect", store, "--json", tmp_path / "ops.json")
    assert r.exit_code == 0, r.output
    ops = json.loads((tmp_path / "ops.json").read_text())
    assert len(ops) >= 30 and {"op", "cases", "instances", "shapes", "dtypes"} <= set(ops[0])
    r = subprocess.run(TAPML + ["replay", str(store), "--target", "reference", "--json", str(tmp_path / "v.json")],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    verdicts = json.loads((tmp_path / "v.json").read_text())
    assert verdicts["target"] == "reference"
    assert set(verdicts["device"]) >= {"adapter", "backend", "features", "limits"}
    assert verdicts["summary"]["pass"] == len(verdicts["cases"]) > 50
    case = verdicts["cases"][0]
    assert set(case) >= {"id", "op", "node", "module", "status", "max_abs_err", "max_rel_err",
                         "mismatch_fraction", "message", "time_ms"}


def test_replay_with_injected_fault_exits_1_and_names_the_op(carved, tmp_path):
    store = carved("zoo:mlp")
    r = tapml("replay", store, "--inject", "aten.addmm.default=scale:1.5", "--json", tmp_path / "v.json")
    assert r.exit_code == 1, r.output
    verdicts = json.loads((tmp_path / "v.json").read_text())
    bad = {v["op"] for v in verdicts["cases"] if v["status"] != "pass"}
    assert bad == {"aten.addmm.default"}
    r = tapml("replay", store, "--inject", "aten.relu.default=compile-error")
    assert r.exit_code == 1 and "error" in r.output


def test_per_op_replays_the_first_cases_of_each_op_and_still_exits_1_on_a_failure(carved, tmp_path):
    store = carved("zoo:tiny-llama")
    manifest = json.loads((store / "manifest.json").read_text())["cases"]
    ops = {c["op"] for c in manifest}
    assert len(manifest) > len(ops)  # some op has several cases, so the selection is seen
    r = tapml("replay", store, "--per-op", "2", "--json", tmp_path / "v.json")
    assert r.exit_code == 0, r.output
    ran = json.loads((tmp_path / "v.json").read_text())["cases"]
    first_two = [c["id"] for c in manifest if sum(d["op"] == c["op"] for d in manifest[:manifest.index(c)]) < 2]
    assert [c["id"] for c in ran] == first_two and {c["op"] for c in ran} == ops
    r = tapml("replay", store, "--per-op", "1", "--op", "aten.mm.default", "--op", "aten.mul.Tensor",
              "--inject", "aten.mul.Tensor=scale:2", "--json", tmp_path / "w.json")
    assert r.exit_code == 1, r.output
    ran = json.loads((tmp_path / "w.json").read_text())["cases"]
    assert len(ran) == 2 and {c["op"]: c["status"] for c in ran} == {"aten.mm.default": "pass",
                                                                     "aten.mul.Tensor": "mismatch"}


def test_tolerance_override_turns_a_mismatch_into_a_pass(carved):
    store = carved("zoo:mlp")
    assert tapml("replay", store, "--inject", "aten.relu.default=offset:1e-3").exit_code == 1
    assert tapml("replay", store, "--inject", "aten.relu.default=offset:1e-3",
                 "--tol", "aten.relu.default=0,1e-2").exit_code == 0


@pytest.mark.parametrize("args,message", [
    (["carve", "zoo:nope", "-o", "{tmp}/x"], "unknown zoo model"),
    (["carve", "hf:llama", "-o", "{tmp}/x", "--hf-config", "novalue"], "KEY=VALUE"),
    (["carve", "hf:gpt2", "-o", "{tmp}/x", "--hf-config", "n_embd=abc"], "hf:gpt2: "),
    (["replay", "{tmp}/missing"], "does not exist"),
    (["replay", "{tmp}", "--target", "reference"], "not a carve store"),
    (["replay", "{store}", "--target", "tpu"], "unknown target"),
    (["replay", "{store}", "--target", "remote://nohostport"], "remote://HOST:PORT"),
    (["replay", "{store}", "--tol", "abc"], "RTOL,ATOL"),
    (["replay", "{store}", "--inject", "relu=scale:2"], "full aten"),
    (["replay", "{store}", "--inject", "aten.relu.default=explode"], "unknown fault kind"),
    (["replay", "{store}", "--op", "aten.nope.default"], "no cases of"),
    (["replay", "{store}", "--per-op", "0"], "--per-op 0: give a number of cases of 1 or more"),
    (["inspect", "{tmp}/missing"], "does not exist"),
    (["carve", "zoo:mlp", "-o", "{tmp}/x", "--device", "tpu"], "cpu or cuda"),
    (["replay", "{store}", "--target", "reference:cuda"], "CUDA"),
])
def test_bad_input_exits_2_with_one_clear_line(carved, tmp_path, args, message):
    store = carved("zoo:mlp")
    r = tapml(*[a.format(tmp=tmp_path, store=store) for a in args])
    assert r.exit_code == 2, r.output
    assert message in r.output
    assert "Traceback" not in r.output


def test_failing_factory_exits_2_and_prints_the_spec_as_written(tmp_path):
    (tmp_path / "m.py").write_text("def boom():\n    raise RuntimeError('weights missing')\n")
    r = tapml("carve", f"{tmp_path}/m.py:boom", "-o", tmp_path / "s")
    assert r.exit_code == 2, r.output
    assert "m.py:boom: the factory raised RuntimeError: weights missing" in r.output  # no :boom: emoji
    assert "Traceback" not in r.output


def _copy(store, tmp_path) -> Path:
    dst = tmp_path / "copy"
    shutil.copytree(store, dst)
    return dst


@pytest.mark.parametrize("damage,message", [
    (lambda s: (s / "manifest.json").write_text("{not json"), "not valid JSON"),
    (lambda s: (s / "manifest.json").write_text("[]"), "not a JSON object"),
    (lambda s: (s / "manifest.json").write_text(json.dumps({"format_version": 1})), "lacks"),
    (lambda s: (s / "manifest.json").write_text(json.dumps({**json.loads((s / "manifest.json").read_text()),
                                                             "format_version": 99})), "store format"),
    (lambda s: next((s / "shards").iterdir()).unlink(), "missing shard"),
    (lambda s: _truncate(next((s / "shards").iterdir())), "truncated"),
    (lambda s: next((s / "shards").iterdir()).write_bytes(b"\xff" * 16), "corrupt"),
])
def test_corrupt_store_exits_2(carved, tmp_path, damage, message):
    store = _copy(carved("zoo:mlp"), tmp_path)
    damage(store)
    for cmd in ("replay", "inspect"):
        r = tapml(cmd, store)
        assert r.exit_code == 2, r.output
        assert message in r.output


def _truncate(path: Path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 100])


def test_carve_refuses_to_overwrite_other_files(tmp_path):
    (tmp_path / "keep.txt").write_text("precious")
    r = tapml("carve", "zoo:mlp", "-o", tmp_path)
    assert r.exit_code == 2 and "choose another" in r.output
    assert (tmp_path / "keep.txt").read_text() == "precious"


def test_json_and_quiet_modes_for_scripts(carved, tmp_path):
    r = tapml("carve", "zoo:mlp", "-o", tmp_path / "s", "--json", tmp_path / "carve.json", "-q")
    assert r.exit_code == 0, r.output
    info = json.loads((tmp_path / "carve.json").read_text())
    assert info["cases"] == 10 and info["store"].endswith("s")
    r = tapml("inspect", tmp_path / "s", "-q")
    assert r.exit_code == 0 and r.output.strip() == "zoo:mlp: 6 ops, 10 cases, 10 nodes"


def test_interrupted_carve_leaves_no_half_store(tmp_path, monkeypatch):
    from tapml.carving.tracer import CarvingInterpreter
    run_node, calls = CarvingInterpreter.run_node, []

    def interrupted(self, n):  # Ctrl-C arriving in the middle of the reference run
        calls.append(n)
        if len(calls) == 5:
            raise KeyboardInterrupt
        return run_node(self, n)

    monkeypatch.setattr(CarvingInterpreter, "run_node", interrupted)
    r = tapml("carve", "zoo:mlp", "-o", tmp_path / "out")
    assert r.exit_code == 130, r.output
    assert len(calls) == 5 and not (tmp_path / "out").exists()


def test_ctrl_c_that_native_code_turns_into_another_error_still_exits_130(tmp_path):
    """Native code (safetensors, wgpu) may turn a Ctrl-C into an error of its own; after a SIGINT
    that error is the interrupt, not an internal error (exit 3) or bad input (exit 2)."""
    import subprocess
    import sys
    model = tmp_path / "m.py"
    model.write_text(
        "import os, signal, torch\n"
        "def factory():\n"
        "    try:\n"
        "        os.kill(os.getpid(), signal.SIGINT)\n"
        "        import time; time.sleep(5)\n"
        "    except KeyboardInterrupt:\n"
        "        raise ValueError('could not determine the shape of object type UntypedStorage')\n"
        "    return torch.nn.Linear(2, 2), (torch.ones(1, 2),)\n")
    r = subprocess.run([sys.executable, "-m", "tapml.cli", "carve", f"{model}:factory", "-o", str(tmp_path / "out")],
                       capture_output=True, text=True, timeout=120, preexec_fn=interruptible)
    assert r.returncode == 130, r.stderr
    assert "internal error" not in r.stderr and "interrupted" in r.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("after", ["sleep", "return"])
def test_ctrl_c_that_a_finalizer_swallows_still_stops_the_command(tmp_path, after):
    """Python drops a KeyboardInterrupt raised while a ``__del__`` runs (garbage collection can
    run one anywhere). The command must still stop promptly with 130, not run on and exit 0."""
    import subprocess
    import sys
    import time
    model = tmp_path / "m.py"
    model.write_text(
        "import gc, os, signal, time, torch\n"
        "class Finalized:\n"
        "    def __del__(self):\n"
        "        os.kill(os.getpid(), signal.SIGINT)\n"
        "        sum(range(10000))  # the interrupt lands here, inside the finalizer\n"
        "def factory():\n"
        "    Finalized()\n"
        f"    {'time.sleep(60)' if after == 'sleep' else 'pass'}\n"
        "    return torch.nn.Linear(2, 2), (torch.ones(1, 2),)\n")
    started = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "tapml.cli", "carve", f"{model}:factory", "-o", str(tmp_path / "out")],
                       capture_output=True, text=True, timeout=120, preexec_fn=interruptible)
    assert r.returncode == 130, r.stderr
    assert "interrupted" in r.stderr and "Traceback" not in r.stderr
    assert time.monotonic() - started < 50
    if after == "sleep":  # interrupted long before the carve; after `return`, the tiny carve may finish first
        assert not (tmp_path / "out").exists()
