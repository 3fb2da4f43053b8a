"""Device tier: scripts/conformance.py, torch's own operator samples (OpInfo) carved and replayed
on lavapipe Vulkan as a user would run them, on a few ops: sorted and data-dependent outputs, a
complex dtype no store holds (refused at carve, exit 2) and an op without a lowering (unsupported)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytestmark = [pytest.mark.device, pytest.mark.xdist_group("wgpu")]


def _run(out: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "conformance.py"), "--target", "wgpu:vulkan",
                           "--out", str(out), "--ops", "sort", "masked_select", "cdouble", "svd", "--samples", "2"],
                          capture_output=True, text=True, timeout=600)


def test_opinfo_samples_carve_and_replay_with_no_crash_and_resume(tmp_path):
    pytest.importorskip("expecttest", reason="torch's OpInfo database needs expecttest (in the dev extras)")
    from tapml.platforms.wgpu_native import available_backends
    if "vulkan" not in available_backends():
        pytest.skip("no wgpu Vulkan adapter (install mesa-vulkan-drivers for lavapipe)")
    r = _run(tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    records = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert len(records) == 8 and not any(rec["crashed"] for rec in records)
    by_op = {}
    for rec in records:
        by_op.setdefault(rec["op"], []).append(rec)
    assert all(rec["carve"] == 2 and "complex128" in rec["message"] for rec in by_op["cdouble"])
    statuses = {(op, s) for rec in records for op, s, _ in rec.get("cases", [])}
    assert ("aten.sort.default", "pass") in statuses or ("aten.sort.stable", "pass") in statuses
    assert ("aten.masked_select.default", "pass") in statuses
    assert ("aten._linalg_svd.default", "unsupported") in statuses
    assert "0 crashed" in r.stdout and "unsupported" in r.stdout
    again = _run(tmp_path)  # everything recorded is skipped
    assert again.returncode == 0 and len((tmp_path / "results.jsonl").read_text().splitlines()) == 8
