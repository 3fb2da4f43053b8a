"""Long rows end to end (issue 27, pattern 3): a model with a Conv2d(2048, 8, (64, 1)) (131 072 terms
per output) and softmax, log_softmax, cumsum, layer_norm, sum and argmax over rows of 262 144
elements migrates whole on lavapipe Vulkan and llvmpipe GL in float32 and float16 and replays clean
in Chromium; `tapml inspect --target` lists a kernel that still loops past the device's cap.

Before the split kernels, lavapipe ended these loops after 65 535 iterations: truncated sums.
The rows hold halves in [-8, 8]: cumsum and sum stay exact in float32 and, in float16, the sum of
exponentials of a softmax stays under float16's largest value, where torch's own float16
log_softmax (which sums in float16 on the CPU) would otherwise return -inf.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from support import in_chromium, vulkan_or_skip

TAPML = [sys.executable, "-m", "tapml.cli"]

MODEL = '''
import torch


class LongRows(torch.nn.Module):
    def __init__(self, cin, length):
        super().__init__()
        self.conv = torch.nn.Conv2d(cin, 8, (64, 1))
        self.norm = torch.nn.LayerNorm(length)

    def forward(self, x, rows):
        return (self.conv(x), torch.softmax(rows, -1), torch.log_softmax(rows, -1), torch.cumsum(rows, -1),
                self.norm(rows), rows.sum(-1), rows.argmax(-1))


def factory():
    torch.manual_seed(0)
    rows = torch.randint(-16, 17, (2, 262144)).float() / 2
    return LongRows(2048, 262144).eval(), (torch.randn(1, 2048, 80, 1), rows)
'''

LONG_K = '''
import torch


class LongK(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(280000, 2) * 0.01)

    def forward(self, x):
        return x @ self.w


def factory():
    torch.manual_seed(0)
    return LongK(), (torch.randn(1, 280000),)
'''

SLOW_DEVICE = [pytest.mark.slow, pytest.mark.device, pytest.mark.xdist_group("wgpu")]


@pytest.fixture(scope="module")
def model_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("long_rows") / "long_rows.py"
    path.write_text(MODEL)
    return path


@pytest.fixture(scope="module")
def stores(model_file):
    """``stores(dtype)`` -> the model carved in that dtype (once per module)."""
    from tapml.carving import carve
    made = {}

    def get(dtype):
        if dtype not in made:
            made[dtype] = model_file.parent / f"store-{dtype}"
            carve(f"{model_file}:factory", made[dtype], dtype=dtype)
        return made[dtype]
    return get


@pytest.mark.parametrize("dtype", [pytest.param(d, marks=SLOW_DEVICE) for d in ("float32", "float16")])
def test_long_rows_migrate_whole_on_vulkan_and_gl(stores, tmp_path, dtype):
    vulkan_or_skip()
    state = tmp_path / "state.json"
    r = subprocess.run(TAPML + ["migrate", str(stores(dtype)), "--target", "wgpu:vulkan", "--target", "wgpu:gl",
                                "--state", str(state)], capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    for target in ("wgpu-vulkan", "wgpu-gl"):
        doc = json.loads((tmp_path / f"state.{target}.json").read_text())
        assert doc["device"]["loop_cap"] == 65535
        ops = {c["op"]: c["status"] for c in doc["cases"]}
        assert set(ops) == {"aten.convolution.default", "aten._softmax.default", "aten._log_softmax.default",
                            "aten.cumsum.default", "aten.native_layer_norm.default", "aten.sum.dim_IntList",
                            "aten.argmax.default"}, ops
        assert set(ops.values()) == {"pass"}, ops
    assert "100.0% of FLOPs on wgpu:vulkan" in r.stdout and "100.0% of FLOPs on wgpu:gl" in r.stdout, r.stdout[-2000:]


@pytest.mark.slow
@in_chromium
def test_long_rows_replay_clean_in_chromium(stores, tmp_path):
    out = tmp_path / "verdict.json"
    r = subprocess.run(TAPML + ["replay", str(stores("float32")), "--target", "browser", "--json", str(out)],
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    doc = json.loads(out.read_text())
    assert doc["summary"]["pass"] == 7 and doc["summary"]["mismatch"] == 0, doc["summary"]


@pytest.mark.slow
@pytest.mark.device
@pytest.mark.xdist_group("wgpu")
def test_inspect_lists_a_kernel_past_the_loop_cap(tmp_path):
    """An mm with K = 280 000 still loops K/4 = 70 000 times per invocation (mm is not split):
    past lavapipe's 65 535, so the preflight names it, its kernel and the cap."""
    vulkan_or_skip()
    from tapml.carving import carve
    (tmp_path / "long_k.py").write_text(LONG_K)
    carve(f"{tmp_path / 'long_k.py'}:factory", tmp_path / "store")
    out = tmp_path / "inspect.json"
    r = subprocess.run(TAPML + ["inspect", str(tmp_path / "store"), "--target", "wgpu:vulkan", "--json", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 1, r.stdout[-2000:] + r.stderr[-2000:]
    assert "loop-iterations" in r.stdout, r.stdout[-2000:]
    pre = json.loads(out.read_text())
    assert pre["loop_cap"] == 65535
    (op,) = [o for o in pre["ops"] if o["violations"]]
    (v,) = op["violations"]
    assert op["op"] == "aten.mm.default" and v["limit"] == "loop-iterations" and v["value"] == 70000 and v["allowed"] == 65535
    assert "loop_cap" in v["message"]
