"""Per-op speed (`replay --profile`, `--baseline`, `--tapml-baseline`): device times on real
shapes, and a kernel slowed on purpose caught as `slower` while an unchanged replay flags nothing."""

import dataclasses
import json
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from tapml.cli import app
from tapml.platforms.base import Platform

runner = CliRunner()
SLOWED_OP = "aten.addmm.default"


def tapml(*args):
    return runner.invoke(app, [str(a) for a in args])


class SlowedPlatform(Platform):
    """A test-only fault: programs of ``op`` dispatch each of their kernels ``times`` times (same
    results, ``times`` times the work), the rest runs unchanged on ``inner``."""

    def __init__(self, inner, op: str, times: int = 50):
        self.inner, self.op, self.times, self.name = inner, op, times, inner.name

    def _caps(self):
        return self.inner.caps()

    def _supports(self, node):
        return self.inner.supports(node)

    def _compile(self, graph):
        program = self.inner.compile(graph)
        if not any(n.op == self.op for n in graph.nodes):
            return program
        return dataclasses.replace(program, kernels=[k for k in program.kernels for _ in range(self.times)])

    def _run(self, program, inputs):
        return self.inner.run(program, inputs)


def old_ms(baseline, case_id: str) -> float:
    return next((c.device_ms or 0.0) for c in baseline.cases if c.id == case_id)


@pytest.fixture(scope="module")
def vulkan():
    from tapml.platforms.wgpu_native import available_backends, shared_platform
    if "vulkan" not in available_backends():
        pytest.skip("no Vulkan adapter (install mesa-vulkan-drivers for lavapipe)")
    return shared_platform("vulkan")


@pytest.fixture(scope="module")
def baseline(carved, tmp_path_factory, vulkan):
    """A `replay --profile --json` of zoo:mlp on wgpu:vulkan, recorded through the CLI."""
    path = tmp_path_factory.mktemp("baseline") / "old.json"
    r = tapml("replay", carved("zoo:mlp"), "-t", "wgpu:vulkan", "--profile", "--json", path, "-q")
    assert r.exit_code == 0, r.output
    return path


@pytest.mark.device
def test_profile_records_device_time_flops_and_bytes(baseline):
    doc = json.loads(baseline.read_text())
    assert doc["summary"]["pass"] == len(doc["cases"]) == 10
    for c in doc["cases"]:
        assert c["timing"] == "timestamp"  # lavapipe has timestamp-query
        assert c["device_ms"] > 0 and c["gbps"] > 0, c
        assert c["shapes"]
    addmm = [c for c in doc["cases"] if c["op"] == SLOWED_OP]
    assert addmm and all(c["gflops"] > 0 for c in addmm)
    assert all(c["gflops"] == 0 for c in doc["cases"] if c["op"] == "aten.permute.default")  # a view: no FLOPs


@pytest.mark.device
def test_unchanged_replay_flags_nothing(carved, baseline, tmp_path):
    out = tmp_path / "new.json"
    r = tapml("replay", carved("zoo:mlp"), "-t", "wgpu:vulkan", "--baseline", baseline, "--json", out)
    assert r.exit_code == 0, r.output
    doc = json.loads(out.read_text())
    assert doc["slower"] == []
    assert all(c["baseline_ms"] > 0 for c in doc["cases"])
    assert "0 slower than the baseline" in r.output


# The slowed-kernel tests time the 256x256 linears of MM_SOURCE (about 1.6 ms a kernel on lavapipe):
# zoo:mlp's kernels are so small that dispatch overhead is their time, and a loaded CI run recorded
# a baseline of that overhead that 50 dispatches of them did not clearly exceed.
@pytest.fixture(scope="module")
def mm_baseline(mm_store, tmp_path_factory, vulkan):
    """A `replay --profile --json` of the mm store on wgpu:vulkan, recorded through the CLI."""
    path = tmp_path_factory.mktemp("mm-baseline") / "old.json"
    r = tapml("replay", mm_store.path, "-t", "wgpu:vulkan", "--profile", "--json", path, "-q")
    assert r.exit_code == 0, r.output
    return path


@pytest.mark.device
def test_slowed_kernel_is_slower_than_baseline(mm_store, mm_baseline, vulkan):
    from tapml.driving.profile import RUNS, compare_with_baseline, read_baseline
    from tapml.driving.replay import replay
    slowed = SlowedPlatform(vulkan, SLOWED_OP)
    result = replay(mm_store, slowed, "wgpu:vulkan", profile=RUNS)
    assert result["summary"]["pass"] == len(result["cases"])  # slower, not wrong
    slower = compare_with_baseline(mm_store, slowed, result, read_baseline(str(mm_baseline)))
    # the slowed kernels come first, far above anything the load did to the others (on a machine as
    # loaded as CI, an mm may itself measure 2-3x slower with confidence)
    assert slower and slower[0]["op"] == SLOWED_OP and slower[0]["ratio"] > 5, slower
    assert all(s["ratio"] > 5 and s["device_ms"] > s["baseline_ms"] for s in slower if s["op"] == SLOWED_OP), slower
    assert all(s["ratio"] < slower[0]["ratio"] / 4 for s in slower if s["op"] != SLOWED_OP), slower


@pytest.mark.device
def test_pytest_plugin_fails_a_slowed_case_with_its_ratio(mm_store, mm_baseline, vulkan):
    from tapml.driving.profile import read_baseline
    from tapml.pytest_plugin import CarvedCase, CaseFailure
    old = read_baseline(str(mm_baseline))
    case = max((c for c in mm_store.cases if c["op"] == SLOWED_OP), key=lambda c: old_ms(old, c["id"]))
    for attempt in range(3):  # a shared machine's load swings device times 2x: unslowed, one try in 3 passes
        try:
            verdict = CarvedCase(mm_store, case, vulkan, "wgpu:vulkan", None, None, baseline=old).check()
            break
        except CaseFailure:
            if attempt == 2:
                raise
    assert verdict["status"] == "pass" and verdict["device_ms"] > 0
    with pytest.raises(CaseFailure, match=r"\d+\.\d\dx slower than the baseline"):
        CarvedCase(mm_store, case, SlowedPlatform(vulkan, SLOWED_OP), "wgpu:vulkan", None, None, baseline=old).check()


@pytest.mark.device
def test_pytest_option_tapml_baseline(carved, baseline, tmp_path):
    test = tmp_path / "test_cases.py"
    test.write_text("import pytest\n\n@pytest.mark.tapml(op='aten.relu.default')\n"
                    "def test_case(tapml_case):\n    assert tapml_case.check()['device_ms'] > 0\n")
    r = subprocess.run([sys.executable, "-m", "pytest", str(test), "-q", "-p", "no:cacheprovider",
                        f"--tapml-store={carved('zoo:mlp')}", "--tapml-target=wgpu:vulkan",
                        f"--tapml-baseline={baseline}"], capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "1 passed" in r.stdout


def test_bad_baseline_is_bad_input(carved, tmp_path):
    store = carved("zoo:mlp")
    plain = tmp_path / "plain.json"
    assert tapml("replay", store, "--json", plain, "-q").exit_code == 0
    r = tapml("replay", store, "--baseline", plain)
    assert r.exit_code == 2 and "holds no device times" in r.output and "--profile --json" in r.output
    doc = json.loads(plain.read_text())
    doc["cases"][0]["device_ms"] = -1.0
    negative = tmp_path / "negative.json"
    negative.write_text(json.dumps(doc))
    r = tapml("replay", store, "--baseline", negative)
    assert r.exit_code == 2 and "device_ms" in r.output
    assert tapml("replay", store, "--baseline", plain, "--slower-than", "-5").exit_code == 2
    assert tapml("replay", store, "-t", "reference", "-t", "wgpu:gl", "--baseline", plain).exit_code == 2


def test_reference_profile_and_report_speed_section(carved, tmp_path):
    from tapml.reports.data import load_states
    from tapml.reports.html import render_html
    store = carved("zoo:mlp")
    old, new = tmp_path / "old.json", tmp_path / "new.json"
    assert tapml("replay", store, "--profile", "--json", old, "-q").exit_code == 0
    r = tapml("replay", store, "--baseline", old, "--slower-than", "1000000", "--json", new, "-q")
    assert r.exit_code == 0, r.output
    doc = json.loads(new.read_text())
    assert doc["slower"] == [] and all(c["timing"] == "wall" and c["baseline_ms"] > 0 for c in doc["cases"])
    html = render_html(load_states([str(new)]))
    assert "Device speed per op against the baseline" in html and "aten.addmm.default" in html
    assert "GFLOP/s" in html and "baseline ms" in html


# --- a speed verdict that holds against noise (issue #29 item 6) ------------------------------

# Two bias-free linears (aten.mm) stand beside the slowed addmm as control cases of the same kind of
# work: the load a loaded machine puts on a compute-bound kernel is read from them, not from relu and
# transposes, whose time is dispatch overhead that grows far more under load.
MM_SOURCE = '''
import torch
class M(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(256, 256)
        self.c = torch.nn.Linear(256, 256, bias=False)
        self.d = torch.nn.Linear(256, 256, bias=False)
        self.b = torch.nn.Linear(256, 64)
    def forward(self, x):
        return self.b(torch.relu(self.d(self.c(self.a(x)))))
def factory():
    torch.manual_seed(0)
    return M(), (torch.randn(256, 256),)
'''


class _Doc:
    """A baseline as :func:`tapml.driving.profile.slower_cases` reads it: cases with id, op, shapes and device_ms."""

    def __init__(self, times: dict):
        self.cases = [type("Case", (), {"id": k, "op": "aten.mm.default", "shapes": "8x8", "device_ms": ms})()
                      for k, ms in times.items()]


def _result(times: dict) -> dict:
    return {"cases": [{"id": k, "op": "aten.mm.default", "shapes": "8x8", "device_ms": ms} for k, ms in times.items()]}


def test_noise_is_not_slower_and_a_steady_slowdown_is():
    """Timings as a loaded 2-core machine gives them: the issue's 0.136 -> 0.303 ms case is under
    the floor; a 10 ms case that measured 13 ms once and then scatters about 10 ms is cleared by
    the sign test; a machine twice as loaded (its control cases twice as slow too) flags nothing;
    a kernel that stays at 2x is slower, with a p-value."""
    from itertools import cycle

    from tapml.driving.profile import slower_cases
    base = {"c0": 0.136, "c1": 10.0, "c2": 5.0, "c3": 4.0, "c4": 3.0}
    noisy = cycle([9.0, 10.5, 14.0, 9.8, 11.0, 10.2, 13.0])
    def remeasure(v):
        return {"c0": [0.3] * 5, "c1": [next(noisy) for _ in range(5)]}.get(v["id"], [base[v["id"]]] * 5)
    result = _result({**base, "c0": 0.303, "c1": 13.0})
    assert slower_cases(result, _Doc(base), remeasure=remeasure) == []
    assert result["speed_check"]["suspects"] == 1  # c1 looked slower, then was cleared
    loaded = _result({k: 2 * ms for k, ms in base.items()})
    assert slower_cases(loaded, _Doc(base), remeasure=lambda v: [2 * base[v["id"]]] * 5) == []
    slowed = _result({**base, "c1": 20.0})
    (found,) = slower_cases(slowed, _Doc(base), remeasure=lambda v: [20.0 if v["id"] == "c1" else base[v["id"]]] * 5)
    assert found["id"] == "c1" and found["ratio"] == 2.0 and found["p_value"] <= 0.01 and found["timings"] == 20


def test_a_small_kernel_is_judged_beside_the_small_controls():
    """A neighbour that slows only the short kernels (0.5-1 ms, wake-ups) to 2.5x: the short suspect's
    controls are the short cases, which read that load, so it is cleared; judged beside the long
    cases (unchanged) it would be a finding."""
    from tapml.driving.profile import slower_cases
    base = {"c0": 0.8, "c1": 0.6, "c2": 1.0, "c3": 0.9, "c4": 40.0, "c5": 30.0, "c6": 20.0}
    short = {"c0", "c1", "c2", "c3"}

    def loaded(k):
        return base[k] * (2.5 if k in short else 1.0)
    result = _result({**{k: loaded(k) for k in base}, "c1": base["c1"], "c2": base["c2"], "c3": base["c3"]})
    assert slower_cases(result, _Doc(base), remeasure=lambda v: [loaded(v["id"])] * 5) == []
    assert result["speed_check"]["suspects"] == 1  # c0 looked slower first


def test_a_suspect_is_judged_beside_controls_bound_by_the_same_resource():
    """A memory-heavy neighbour slows the memory-bound kernels 2.5x and leaves the compute-bound ones
    of the same length alone: a memory-bound suspect is cleared beside memory-bound controls (judged
    beside the compute-bound cases nearest it in time, it would be a finding); a memory-bound kernel
    slowed on its own, beside memory-bound controls at their baseline, is still found."""
    from tapml.driving.profile import control_cases, slower_cases
    base = {"m0": 2.0, "m1": 4.0, "m2": 8.0, "m3": 6.0, "c0": 2.1, "c1": 1.9, "c2": 2.2}
    bound = {k: "memory" if k.startswith("m") else "compute" for k in base}

    def result(times: dict) -> dict:
        doc = _result(times)
        for v in doc["cases"]:
            v["roofline_bound"] = bound[v["id"]]
        return doc

    def loaded(k):
        return base[k] * (2.5 if bound[k] == "memory" else 1.0)
    # m0 looks slower first; the other memory-bound cases were measured before the neighbour came
    neighbour = result({**base, "m0": loaded("m0")})
    assert [c["id"] for c in control_cases({**neighbour["cases"][0], "baseline_ms": 2.0},
                                           [{**v, "baseline_ms": base[v["id"]]} for v in neighbour["cases"][1:]])] \
        == ["m1", "m3", "m2"]
    assert slower_cases(neighbour, _Doc(base), remeasure=lambda v: [loaded(v["id"])] * 5) == []
    assert neighbour["speed_check"]["suspects"] == 1
    unbound = _result({**base, "m0": loaded("m0")})  # no roofline: the nearest in time, compute-bound
    assert [f["id"] for f in slower_cases(unbound, _Doc(base), remeasure=lambda v: [loaded(v["id"])] * 5)] == ["m0"]
    alone = result({**base, "m0": 5.0})
    (found,) = slower_cases(alone, _Doc(base), remeasure=lambda v: [5.0 if v["id"] == "m0" else base[v["id"]]] * 5)
    assert found["id"] == "m0" and found["ratio"] == 2.5


@pytest.fixture(scope="module")
def mm_store(tmp_path_factory):
    from support import store_from_source
    return store_from_source(tmp_path_factory, "mm", MM_SOURCE)


@pytest.mark.device
def test_a_kernel_made_twelve_times_as_slow_is_slower_and_says_exit_1_is_about_speed(mm_store, vulkan, tmp_path):
    from tapml.cli.common import out
    from tapml.cli.store import render_speed_verdict
    from tapml.driving.profile import RUNS, compare_with_baseline, read_baseline
    from tapml.driving.replay import replay
    base = tmp_path / "base.json"
    assert tapml("replay", mm_store.path, "-t", "wgpu:vulkan", "--profile", "--json", base, "-q").exit_code == 0
    # unchanged, nothing is slower; but a neighbour on a shared machine can slow one kind of kernel
    # alone for a minute (a CI run once flagged a permute 2.4x beside its compute-bound controls),
    # which no control reads, so the claim is that such a finding does not survive a rerun
    for _ in range(3):
        r = tapml("replay", mm_store.path, "-t", "wgpu:vulkan", "--baseline", base)
        if r.exit_code == 0:
            break
    assert r.exit_code == 0 and "0 slower than the baseline" in r.output, r.output
    # twelve times the kernels: the load is read from control cases (relu, small copies) whose time
    # is mostly dispatch overhead, and on a loaded CI run they read 3-4x; 2x and then 4x were lost
    slowed = SlowedPlatform(vulkan, SLOWED_OP, times=12)
    result = replay(mm_store, slowed, "wgpu:vulkan", profile=RUNS)
    slower = compare_with_baseline(mm_store, slowed, result, read_baseline(str(base)))
    # what the sign test is sure of: the slowed kernel, first (on a loaded machine one of the two addmm
    # may not be found, and an unslowed kernel may measure slower too, never as slow)
    assert slower and slower[0]["op"] == SLOWED_OP, slower
    # twelve times the kernels: less than 12x where fixed costs count, more on a loaded machine
    assert all(s["ratio"] > 1.5 and s["p_value"] <= 0.01 for s in slower if s["op"] == SLOWED_OP), slower
    with out.capture() as shown:
        render_speed_verdict(result, slower, 25.0)
    assert "Exit 1 is about speed" in shown.get() and "values of every case pass" in shown.get()
