"""A roofline per device (platforms/roofline.py), issue 35: the probes measure a device's peak
arithmetic rate, storage-load and workgroup-memory bandwidth and dispatch cost on lavapipe,
llvmpipe GL and Chromium; a measured kernel is placed against them (what bounds it, the fraction
reached); `replay --profile` writes both into its document and prints them per op, and a
document's roofline is read as strictly as the rest of it."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from tapml.cli import app
from tapml.platforms.roofline import attained
from tests.support import in_chromium, own_wgpu

PEAKS = ("peak_gflops", "storage_gbps", "workgroup_gbps", "dispatch_us")


def test_a_kernel_is_placed_by_the_bound_that_takes_longest():
    roof = {"peak_gflops": 100.0, "storage_gbps": 10.0, "workgroup_gbps": 20.0, "dispatch_us": 20.0}
    # 2 GFLOP over 3 MB: 20 ms of arithmetic, 0.3 ms of loads; it took 40 ms
    assert attained(roof, 2e9, 3e6, 0.040) == {"bound": "compute", "bound_ms": 20.0, "fraction": 0.5}
    # 1 MFLOP over 100 MB: 10 ms of loads
    assert attained(roof, 1e6, 1e8, 0.0125) == {"bound": "memory", "bound_ms": 10.0, "fraction": 0.8}
    # nothing to speak of, in 10 kernels: their dispatches are the floor
    assert attained(roof, 10, 40, 0.001, kernels=10) == {"bound": "dispatch", "bound_ms": 0.2, "fraction": 0.2}
    assert attained({}, 2e9, 3e6, 0.04) == {} and attained(roof, 2e9, 3e6, 0.0) == {}


def _check_probes(platform, timing: str):
    roof = platform.roofline()
    # in round trips (the browser) the jitter of a whole run can exceed one more dispatch's cost: 0 then
    assert set(PEAKS) <= set(roof) and all(roof[k] > 0 for k in PEAKS[:3]), roof
    assert roof["dispatch_us"] > 0 if timing == "device" else roof["dispatch_us"] >= 0, roof
    assert roof["timing"] == timing
    assert platform.roofline() is roof  # probed once per platform
    return roof


@pytest.mark.device
@pytest.mark.xdist_group("wgpu")
@pytest.mark.parametrize("backend", ["vulkan", "gl"])
def test_probes_bound_what_a_matmul_reaches(backend):
    """The probed peak is a ceiling: a 512 x 512 matmul, timed the same way, stays under it."""
    from tapml.bench import matmul_graph
    platform = own_wgpu(backend)
    roof = _check_probes(platform, "device")
    a, b = torch.rand(512, 512), torch.rand(512, 512)
    program = platform.compile(matmul_graph(512))
    ms = min(platform.device_times(program, [a, b], 5)[0])
    gflops = 2 * 512 ** 3 / ms / 1e6
    assert gflops < 1.5 * roof["peak_gflops"], (gflops, roof)


@in_chromium
def test_probes_run_in_chromium():
    from tapml.platforms.browser import BrowserPlatform
    from tapml.bench import long_row_figure, matmul_figure
    with BrowserPlatform() as browser:
        _check_probes(browser, "round trip")
        # what `tapml bench --target browser` prints: each kernel on the page's roofline
        for row in (matmul_figure(browser, 256, repeat=1), long_row_figure(browser, "softmax_131072", repeat=1)):
            assert row["timing"] == "round trip" and row["roofline_bound"] in ("compute", "memory", "dispatch"), row
            assert 0 < row["roofline_fraction"] <= 1.5, row


def test_a_platform_that_runs_no_kernels_has_no_roofline():
    from tapml.platforms.reference import ReferencePlatform
    assert ReferencePlatform().roofline() == {}


@pytest.mark.device
def test_replay_profile_places_every_case_on_the_device_roofline(carved, tmp_path):
    out = tmp_path / "profile.json"
    r = CliRunner().invoke(app, ["replay", str(carved("zoo:mlp")), "-t", "wgpu:vulkan", "--profile", "--json",
                                 str(out)])
    assert r.exit_code == 0, r.output
    doc = json.loads(out.read_text())
    roof = doc["device"]["roofline"]
    assert all(roof[k] > 0 for k in PEAKS)
    for c in doc["cases"]:
        assert c["roofline_bound"] in ("compute", "memory", "dispatch"), c
        assert c["roofline_ms"] > 0 and c["roofline_fraction"] == pytest.approx(c["roofline_ms"] / c["device_ms"],
                                                                               rel=0.01, abs=1e-4), c
    text = " ".join(r.output.split())  # the table folds its title and headers to the terminal's width
    assert f"roofline peak {roof['peak_gflops']:.3g} GFLOP/s" in text and "bound" in text and "dispatch" in text

    from tapml.errors import TapmlError
    from tapml.judging.verdict import VerdictDocument
    assert VerdictDocument.read(str(out)).device["roofline"] == roof
    for bad in ({**roof, "evil": 1}, {**roof, "peak_gflops": -1}, {**roof, "timing": "guess"}):
        (tmp_path / "bad.json").write_text(json.dumps({**doc, "device": {**doc["device"], "roofline": bad}}))
        with pytest.raises(TapmlError):
            VerdictDocument.read(str(tmp_path / "bad.json"))
    case = {**doc["cases"][0], "roofline_bound": "vibes"}
    (tmp_path / "bad.json").write_text(json.dumps({**doc, "cases": [case] + doc["cases"][1:]}))
    with pytest.raises(TapmlError):
        VerdictDocument.read(str(tmp_path / "bad.json"))
