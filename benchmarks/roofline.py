"""Kernels against the device's roofline, before and after (issue 35), in one process.

Workloads: ``mm`` at 256, 512, 1024 and 2048, the MLP 1024 -> 4096 -> 1024 on a batch of 64,
convolutions (a ResNet 3x3 layer of 64 channels, a 1x1 layer from 1024 to 256 channels, a 1-d
audio layer of 512 channels and 5 taps, a grouped strided layer, the bench's 1024-channel 64-tap
row), and zoo:tiny-llama's and zoo:tiny-vit's forward. Each is compiled twice:

- ``before``: the convolution's direct kernel (implicit GEMM off) and the matmul's untuned
  default tiles (what a device got when the tuner timed one candidate for all, before 32a021f);
- ``after``: as the compiler is, with the tiles :func:`tapml.platforms.wgsl.matmul.tune` picks
  for this device (tuned once at the start, into a scratch cache folder).

Then both are timed on the device (``Platform.device_times``: GPU timestamps on lavapipe), inputs
resident, in ``ROUNDS`` alternated rounds, beside torch eager on the CPU; each figure is the median
of the rounds, with its place on the device's roofline (probed once) and the load average of each
round. Prints one JSON document::

    .venv/bin/python benchmarks/roofline.py wgpu:vulkan > /tmp/roofline.json
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

ROUNDS = 5


def _conv(xs, ws, stride, padding, dilation, groups, bias=True):
    import torch

    from tapml.platforms.wgsl.registry import case_graph
    gen = torch.Generator().manual_seed(sum(xs))
    args = [torch.randn(*xs, generator=gen), torch.randn(*ws, generator=gen) * 0.05,
            torch.randn(ws[0], generator=gen) if bias else None, stride, padding, dilation, False, [0] * len(stride),
            groups]
    return case_graph("aten.convolution.default", args)


def _store_graph(spec: str, root: Path):
    from tapml.carving import CarveStore, carve
    out = root / spec.replace(":", "_")
    carve(spec, out)
    store = CarveStore(out)
    values = store.program_inputs()
    return store.graph, [values[ref] for ref, _ in store.graph.inputs]


def workloads(root: Path) -> dict:
    from tapml import peers
    from tapml.bench import LONG_ROW_CASES
    loads = {f"mm {n}": peers._mm(n)[:2] for n in (256, 512, 1024, 2048)}
    loads["MLP 1024-4096-1024 x64"] = peers._mlp(1024, 4096, 64)[:2]
    loads["conv 3x3 64ch 56x56"] = _conv((1, 64, 56, 56), (64, 64, 3, 3), [1, 1], [1, 1], [1, 1], 1)
    loads["conv 1x1 1024->256 14x14"] = _conv((1, 1024, 14, 14), (256, 1024, 1, 1), [1, 1], [0, 0], [1, 1], 1)
    loads["conv 1d 512ch k5 x200"] = _conv((2, 512, 200), (512, 512, 5), [1], [2], [1], 1)
    loads["conv grouped 128ch/32 s2"] = _conv((1, 128, 32, 32), (128, 4, 3, 3), [2, 2], [1, 1], [1, 1], 32, bias=False)
    import torch
    from tapml.platforms.wgsl.registry import case_graph
    op, make = LONG_ROW_CASES["conv_1024x64"]
    loads["conv 1024ch 64 taps (bench row)"] = case_graph(op, make(torch.Generator().manual_seed(0)))
    for spec in ("zoo:tiny-llama", "zoo:tiny-vit"):
        loads[f"{spec} forward"] = _store_graph(spec, root)
    return loads


@contextmanager
def before():
    """The compiler as it was: the direct convolution and the default matmul tiles."""
    from tapml.platforms.wgsl import conv_gemm, matmul
    fits = conv_gemm.fits
    conv_gemm.fits = lambda *a, **k: False
    try:
        with matmul.forced_tiles(matmul.DEFAULT_TILES):
            yield
    finally:
        conv_gemm.fits = fits


def main(target: str) -> None:
    import torch

    from tapml.driving.profile import graph_flops, program_bytes, roofline_place
    from tapml.graph import run_graph
    from tapml.platforms.targets import open_platform
    from tapml.platforms.wgsl import matmul
    root = Path(tempfile.mkdtemp(prefix="tapml-roofline-"))
    os.environ["TAPML_CACHE_DIR"] = str(root / "cache")
    platform = open_platform(target)
    tuned = matmul.tune(platform)
    roof = platform.roofline()
    loads = workloads(root)
    programs = {}
    for name, (graph, inputs) in loads.items():
        with before():
            old = platform.compile(graph)
        programs[name] = {"before": old, "after": platform.compile(graph)}
    rows = {name: {"before": [], "after": [], "torch": []} for name in loads}
    load_avg = []
    for r in range(ROUNDS):
        load_avg.append(round(os.getloadavg()[0], 2))
        for name, (graph, inputs) in loads.items():
            env = dict(zip([ref for ref, _ in graph.inputs], inputs))
            order = ["before", "after", "torch"] if r % 2 == 0 else ["torch", "after", "before"]
            for who in order:
                if who == "torch":
                    with torch.no_grad():
                        start = time.perf_counter()
                        run_graph(graph, env)
                        rows[name]["torch"].append((time.perf_counter() - start) * 1e3)
                else:
                    rows[name][who].append(min(platform.device_times(programs[name][who], inputs, 3)[0]))
    out = {"target": target, "adapter": platform.caps().get("adapter"), "rounds": ROUNDS, "load_avg": load_avg,
           "tuned_tiles": tuned["label"], "roofline": roof, "workloads": {}}
    for name, (graph, _inputs) in loads.items():
        flops = graph_flops(graph)
        entry = {"gflop": round(flops / 1e9, 4)}
        for who in ("before", "after", "torch"):
            ms = statistics.median(rows[name][who])
            entry[f"{who}_ms"] = round(ms, 4)
            if who != "torch":
                program = programs[name][who]
                place = roofline_place(roof, flops, program_bytes(program), ms, max(1, len(program.kernels)))
                entry[f"{who}_kernels"] = len(program.kernels)
                entry[f"{who}_bound"] = place.get("roofline_bound")
                entry[f"{who}_fraction"] = place.get("roofline_fraction")
        entry["speedup"] = round(entry["before_ms"] / entry["after_ms"], 3)
        entry["after_vs_torch"] = round(entry["torch_ms"] / entry["after_ms"], 4)
        out["workloads"][name] = entry
    json.dump(out, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "wgpu:vulkan")
